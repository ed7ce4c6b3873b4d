# dpd_metrics for dashboards (issue 24): time to first token and
# end-to-end latency by route (direct, direct_cached, disaggregated,
# fallback) and model, the model label bounded to the dpd_model names (a
# client's model string never becomes a label value), KV transfer time by
# protocol (nixl: the decode leg's first byte), fallbacks by cause,
# observe-mode decisions apart, the pool gauges of dpd_balance upstreams;
# every histogram's buckets, _sum and _count agree; and every PromQL
# expression of the Grafana dashboard names only metrics a live scrape
# shows.  The engines are server blocks of the same nginx.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;
use JSON::PP ();
use LWP::UserAgent ();
use HTTP::Request ();
use File::Basename ();
use Cwd ();
use POSIX ();

my ($tj) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'Llama 3 tokenizer fixture not installed (make deps)')
    unless $tj;
plan('no_plan');   # after the skip checks: a skip must not plan twice

$ENV{TEST_NGINX_LLAMA3} = $tj;

# backend ports: DPD_TEST_PORT_BASE (default 18600) + 50..52
my $base = $ENV{DPD_TEST_PORT_BASE} || 18600;
$ENV{TEST_NGINX_B1} = $base + 50;
$ENV{TEST_NGINX_B2} = $base + 51;
$ENV{TEST_NGINX_PF} = $base + 52;
$ENV{TEST_NGINX_SLOW} = 'x' x 3000;

our $ROOT = Cwd::abs_path(File::Basename::dirname(__FILE__) . '/..');
our $DASHBOARD = "$ROOT/deploy/helm/dpd-gateway/dashboards/dpd-gateway.json";

our $JSON = JSON::PP->new->canonical;
our $UA = LWP::UserAgent->new(timeout => 60, keep_alive => 1);

sub url { "http://127.0.0.1:" . server_port() . $_[0] }

# a completions body of token ids: runs of (id, count)
sub body {
    my (%o) = @_;
    my @ids = map { ($_->[0]) x $_->[1] } @{ $o{runs} };
    my $b = { prompt => \@ids, max_tokens => 1 };
    $b->{model} = $o{model} if exists $o{model};
    $b->{stream} = JSON::PP::true if $o{stream} // 1;
    return $JSON->encode($b);
}

# POST, wait for nginx to be up: (status, X-Route)
sub post {
    my ($body, $path) = @_;
    my $req = HTTP::Request->new(POST => url($path // '/v1/completions'));
    $req->header('Content-Type' => 'application/json');
    $req->content($body);
    my $res;
    for (1 .. 50) {
        $res = $UA->request($req);
        last unless $res->code == 500
                    && ($res->header('Client-Warning') // '') eq
                       'Internal response';
        select undef, undef, undef, 0.2;
    }
    return ($res->code, scalar $res->header('X-Route'));
}

sub scrape { $UA->get(url('/metrics'))->content }

# a request is counted in its log phase, which may come a moment after the
# client has the response: scrape until $ok->(series) or 5 s passed
sub settled {
    my ($ok) = @_;
    my ($text, $s);
    for (1 .. 50) {
        $text = scrape();
        $s = series($text);
        last if $ok->($s);
        select undef, undef, undef, 0.1;
    }
    return wantarray ? ($text, $s) : $s;
}

# series name and labels => value, from Prometheus text
sub series {
    my ($text) = @_;
    my %s;
    for (split /\n/, $text) {
        next if /^#/ || !/\S/;
        /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$/
            or die "not a series line: $_";
        $s{$1 . ($2 // '')} = $3;
    }
    return \%s;
}

# every histogram of the scrape: buckets cumulative and ending in +Inf ==
# _count; _sum 0 exactly when _count is 0
sub check_histograms {
    my ($text, $what) = @_;
    my (%buckets, %sum, %count);
    for (split /\n/, $text) {
        if (/^(\w+)_bucket\{(.*?),?le="([^"]+)"\} (\d+)$/) {
            push @{ $buckets{"$1\{$2\}"} }, [$3, $4];
        } elsif (/^(\w+)_sum(\{.*\})? (\S+)$/) {
            $sum{$1 . ($2 // '{}')} = $3;
        } elsif (/^(\w+)_count(\{.*\})? (\d+)$/) {
            $count{$1 . ($2 // '{}')} = $3;
        }
    }
    my ($bad, $n) = (0, 0);
    for my $k (sort keys %buckets) {
        my @b = @{ $buckets{$k} };
        $n++;
        my $prev = 0;
        for (@b) {
            if ($_->[1] < $prev) { $bad++; diag "$what: $k: not cumulative"; }
            $prev = $_->[1];
        }
        if ($b[-1][0] ne '+Inf') { $bad++; diag "$what: $k: no +Inf"; }
        if (!defined $count{$k} || $count{$k} != $b[-1][1]) {
            $bad++; diag "$what: $k: +Inf $b[-1][1], _count "
                         . ($count{$k} // 'none');
        }
        # nothing observed: _sum 0; a latency in microseconds is never 0
        # (prefill and KV waits are timed in milliseconds: 0 is possible)
        if (!defined $sum{$k} || $sum{$k} < 0
            || ($count{$k} == 0 && $sum{$k} != 0)
            || ($k =~ /^dpd_(?:ttft|request_duration)_seconds/
                && $count{$k} > 0 && $sum{$k} == 0))
        {
            $bad++; diag "$what: $k: _sum " . ($sum{$k} // 'none');
        }
    }
    ok $n > 20, "$what: $n histogram series";
    is $bad, 0, "$what: buckets, _sum and _count agree";
}

sub init_1 {
    my $before = scrape();
    my @r;

    # alpha: prefix cache, nixl, threshold 80
    @r = post(body(model => 'alpha', runs => [[100, 20]]));
    is "@r", '200 direct', 'alpha 20 tokens: direct';
    @r = post(body(model => 'alpha', runs => [[100, 96]]));
    is "@r", '200 disaggregated', 'alpha 96 tokens: disaggregated (nixl)';
    @r = post(body(model => 'alpha', runs => [[100, 96], [200, 40]]));
    is "@r", '200 direct', 'alpha turn 2: direct, 96 of 136 cached';
    @r = post(body(model => 'alpha', runs => [[100, 10]], stream => 0));
    is "@r", '200 direct', 'alpha, not streamed: direct';

    # beta: the prefill pool answers 503: fallback
    @r = post(body(model => 'beta', runs => [[300, 100]]));
    is "@r", '200 fallback', 'beta: fallback (prefill 503)';

    # "*": observe mode; hostile model names end up as "other"
    my $evil = "evil\"} 1\ndpd_injected_total{x=\"";
    @r = post(body(model => $evil, runs => [[400, 100]]));
    is "@r", '200 disaggregated', 'a hostile model: observe, decided '
                                  . 'disaggregated';
    @r = post(body(runs => [[400, 10]]));
    is "@r", '200 direct', 'no model: observe, direct';
    @r = post(body(model => 'alpha ', runs => [[400, 10]]));
    is "@r", '200 direct', '"alpha " (not alpha): observe, direct';

    my ($text, $s) = settled(sub {
        $_[0]{'dpd_request_duration_seconds_count{route="direct",model="other"}'}
        == 3 });

    if (my $f = $ENV{DPD_METRICS_DUMP}) {     # to read the scrape
        open my $o, '>', $f or die "$f: $!";
        print $o $text;
    }

    my $dur = 'dpd_request_duration_seconds_count';
    my $k = sub { $_[0] . '{route="' . $_[1] . '",model="' . $_[2] . '"}' };
    my $ttft = 'dpd_ttft_seconds_count';
    my %want = (
        $k->($dur, "direct", "alpha") => 2,
        $k->($ttft, "direct", "alpha") => 1,   # one streamed
        $k->($dur, "disaggregated", "alpha") => 1,
        $k->($ttft, "disaggregated", "alpha") => 1,
        $k->($dur, "direct_cached", "alpha") => 1,
        $k->($ttft, "direct_cached", "alpha") => 1,
        $k->($dur, "fallback", "beta") => 1,
        $k->($ttft, "fallback", "beta") => 1,
        $k->($dur, "direct", "other") => 3,   # observe: done
        $k->($ttft, "direct", "other") => 3,
        $k->($dur, "disaggregated", "other") => 0,
        $k->($dur, "direct", "beta") => 0,
        'dpd_kv_transfer_seconds_count{protocol="nixl"}' => 1,
        'dpd_kv_transfer_seconds_count{protocol="lmcache"}' => 0,
        'dpd_fallbacks_total{cause="prefill_5xx"}' => 1,
        'dpd_fallbacks_total{cause="no_kv_params"}' => 0,
        'dpd_observe_decisions_total{route="disaggregated"}' => 1,
        'dpd_observe_decisions_total{route="direct"}' => 2,
        'dpd_pool_peers{pool="pool"}' => 2,
        'dpd_pool_live_peers{pool="pool"}' => 2,
        'dpd_pool_outstanding_requests{pool="pool"}' => 0,
        # the aggregate by route still reports observe mode's decision
        'dpd_requests_total{route="disaggregated",status="2xx"}' => 2,
    );
    for (sort keys %want) {
        is $s->{$_}, $want{$_}, "$_ $want{$_}";
    }
    ok !exists $s->{'dpd_pool_peers{pool="plain"}'},
        'an upstream without dpd_balance is no pool';

    # the TTFT of a streamed request is below its duration
    my $t = $s->{$k->('dpd_ttft_seconds_sum', 'direct_cached', 'alpha')};
    ok $t > 0
       && $t <= $s->{$k->('dpd_request_duration_seconds_sum',
                          'direct_cached', 'alpha')},
       'ttft > 0 and <= the duration';

    # the model label takes the configured names and "other" only
    my %models = map { /model="((?:[^"\\]|\\.)*)"/ ? ($1 => 1) : () } keys %$s;
    is join(',', sort keys %models), 'alpha,beta,other,q\\"uote',
        'model label values: the dpd_model names (escaped) and other';
    unlike $text, qr/evil|injected/, 'the client\'s string is nowhere';
    my %before = map { /model="((?:[^"\\]|\\.)*)"/ ? ($1 => 1) : () }
                 keys %{ series($before) };
    is join(',', sort keys %before), 'alpha,beta,other,q\\"uote',
        'the same label values before any request';

    check_histograms($text, 'after the routes');

    # a request in flight: outstanding on its pool
    my $pid = fork // die "fork: $!";
    if ($pid == 0) {
        my $ua = LWP::UserAgent->new(timeout => 30);
        $ua->post(url('/slow/v1/completions'),
                  'Content-Type' => 'application/json',
                  Content => body(runs => [[100, 5]]));
        POSIX::_exit(0);
    }
    my $out;
    for (1 .. 50) {
        select undef, undef, undef, 0.1;
        $out = series(scrape())
               ->{'dpd_pool_outstanding_requests{pool="pool"}'};
        last if $out;
    }
    is $out, 1, 'a slow request in flight: 1 outstanding on the pool';
    waitpid $pid, 0;
    is settled(sub {
           !$_[0]{'dpd_pool_outstanding_requests{pool="pool"}'} })
       ->{'dpd_pool_outstanding_requests{pool="pool"}'},
       0, '... 0 once it ended';

    check_dashboard($text);
}

# PromQL of the dashboard: metric names = identifiers outside label
# matchers, strings and ranges, that are not functions, keywords or the
# label names of by/without/on/ignoring lists
sub check_dashboard {
    my ($text) = @_;
    ok -f $DASHBOARD, "dashboard $DASHBOARD";
    open my $fh, '<', $DASHBOARD or return;
    my $d = JSON::PP->new->decode(do { local $/; <$fh> });
    my @expr;
    my $walk;
    $walk = sub {
        my ($x) = @_;
        if (ref $x eq 'HASH') {
            push @expr, $x->{expr} if defined $x->{expr} && !ref $x->{expr};
            $walk->($_) for values %$x;
        } elsif (ref $x eq 'ARRAY') {
            $walk->($_) for @$x;
        }
    };
    $walk->($d);
    # template variables: label_values(METRIC, label)
    for my $v (@{ $d->{templating}{list} // [] }) {
        my $qy = ref $v->{query} ? $v->{query}{query} : $v->{query};
        push @expr, $1 if defined $qy && $qy =~ /label_values\((\w+)/;
    }
    ok @expr >= 10, scalar(@expr) . ' PromQL expressions in the dashboard';

    my %exported = map { /^(\w+)/ ? ($1 => 1) : () }
                   grep { !/^#/ && /\S/ } split /\n/, $text;
    my %kw = map { $_ => 1 } qw(by without on ignoring group_left
        group_right bool and or unless offset inf nan);
    my (%used, @unknown);
    for my $e (@expr) {
        my $x = $e;
        $x =~ s/"(?:[^"\\]|\\.)*"//g;                 # strings
        $x =~ s/\{[^}]*\}//g;                          # label matchers
        $x =~ s/\[[^\]]*\]//g;                         # ranges
        $x =~ s/\b(?:by|without|on|ignoring|group_left|group_right)
                \s*\([^)]*\)//gx;                      # label lists
        $x =~ s/\$\w+//g;                              # Grafana variables
        while ($x =~ /([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?/g) {
            my ($id, $call) = ($1, $2);
            next if $call || $kw{lc $id};
            next if $id =~ /^\d/;
            $used{$id}++;
            push @unknown, "$id (in: $e)" unless $exported{$id};
        }
    }
    ok scalar(keys %used) >= 10,
       scalar(keys %used) . ' metric names used: '
       . join(' ', sort keys %used);
    is_deeply \@unknown, [], 'every metric the dashboard queries is exported';
    for my $m (qw(dpd_ttft_seconds_bucket dpd_request_duration_seconds_count
                  dpd_fallbacks_total dpd_prefill_seconds_bucket
                  dpd_kv_transfer_seconds_bucket
                  dpd_pool_outstanding_requests dpd_pool_live_peers
                  dpd_prefix_lookups_total dpd_prefix_cached_tokens_total
                  dpd_observe_decisions_total))
    {
        ok $used{$m}, "the dashboard shows $m";
    }
}

sub init_2 {
    # more dpd_model names than the zone has slots: the rest is "other"
    my $s = series(scrape());
    my %models = map { /model="((?:[^"\\]|\\.)*)"/ ? ($1 => 1) : () } keys %$s;
    is scalar(keys %models), 16, '15 names and other';
    ok $models{m1} && $models{m15} && !$models{m16}, 'm1..m15, not m16';
    my @r = post(body(model => 'm16', runs => [[100, 5]]));
    is "@r", '200 direct', 'm16 answered';
    $s = settled(sub {
        $_[0]{'dpd_request_duration_seconds_count{route="direct",model="other"}'}
    });
    is $s->{'dpd_request_duration_seconds_count{route="direct",model="other"}'},
        1, 'm16 counted as other';
}

sub init_3 {
    # a reload keeps the counters and each name's slot; a new name gets a
    # free slot, a removed one keeps its series until a restart
  SKIP: {
    # (under make test-asan this reload once reported a
    # global-buffer-overflow in nginx's ngx_cycle_modules(): ASan had
    # registered the module's generated ngx_modules[] redzones at nginx's
    # own interposed ngx_modules; the module is now built with
    # -asan-use-private-alias, see SAN_FLAGS in the Makefile)
    my $dur = 'dpd_request_duration_seconds_count';
    my @r = post(body(model => 'a', runs => [[100, 5]]));
    is "@r", '200 direct', 'a answered';
    my $s = settled(sub { $_[0]{qq($dur) . '{route="direct",model="a"}'} });
    is $s->{qq($dur) . '{route="direct",model="a"}'}, 1, 'a counted';

    my $conf = $Test::Nginx::Util::ConfFile;
    open my $in, '<', $conf or die "$conf: $!";
    my $text = do { local $/; <$in> };
    close $in;
    $text =~ s/dpd_model b \@m;/dpd_model c \@m;/ or die 'no "dpd_model b"';
    open my $out, '>', $conf or die "$conf: $!";
    print $out $text;
    close $out;
    open my $pf, '<', $Test::Nginx::Util::PidFile or die "pid: $!";
    my $pid = <$pf>;
    chomp $pid;
    # the workers now: after the reload they stop accepting and exit
    my @old;
    for my $p (map { m{/proc/(\d+)$} ? $1 : () } glob '/proc/[0-9]*') {
        open my $st, '<', "/proc/$p/stat" or next;
        my $line = <$st> // '';
        push @old, $p if $line =~ /^\d+ \(.*\) \S (\d+) / && $1 == $pid;
    }
    ok @old >= 1, 'the workers before the reload: ' . scalar(@old);
    kill 'HUP', $pid or die "HUP $pid: $!";
    for (1 .. 100) {
        last unless grep { kill 0, $_ } @old;
        select undef, undef, undef, 0.1;
    }
    # new connections only: a kept-alive one may still be an old worker's
    $UA = LWP::UserAgent->new(timeout => 60, keep_alive => 0);

    for (1 .. 100) {
        $s = series(scrape());
        last if exists $s->{qq($dur) . '{route="direct",model="c"}'};
        select undef, undef, undef, 0.1;
    }
    ok exists $s->{qq($dur) . '{route="direct",model="c"}'},
       'after the reload: c has a slot';
    is $s->{qq($dur) . '{route="direct",model="a"}'}, 1,
       'a kept its count';
    is $s->{qq($dur) . '{route="direct",model="b"}'}, 0,
       'b (removed) keeps its series';
    @r = post(body(model => 'c', runs => [[100, 5]]));
    is "@r", '200 direct', 'c answered';
    @r = post(body(model => 'b', runs => [[100, 5]]));
    is "@r", '200 direct', 'b (now "*") answered';
    $s = settled(sub {
        $_[0]{qq($dur) . '{route="direct",model="other"}'}
        && $_[0]{qq($dur) . '{route="direct",model="c"}'} });
    is $s->{qq($dur) . '{route="direct",model="c"}'}, 1, 'c counted';
    is $s->{qq($dur) . '{route="direct",model="b"}'}, 0,
       'b no more: its request is other';
    is $s->{qq($dur) . '{route="direct",model="other"}'}, 1, '... here';
  }
}

add_block_preprocessor(sub {
    my $block = shift;
    $block->set_value('request', "GET /ok") unless defined $block->request;
    $block->set_value('response_body', "ok\n")
        unless defined $block->response_body;
    $block->set_value('timeout', 60) unless defined $block->timeout;
});

log_level('info');
master_on();
workers(2);
no_shuffle();
run_tests();

__DATA__

=== TEST 1: latency by route and model, fallbacks, observe, pools, dashboard
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    upstream pool {
        dpd_balance;
        zone pool 64k;
        server 127.0.0.1:$TEST_NGINX_B1;
        server 127.0.0.1:$TEST_NGINX_B2;
    }
    upstream plain {
        server 127.0.0.1:$TEST_NGINX_B1;
    }
    server {
        listen 127.0.0.1:$TEST_NGINX_B1;
        listen 127.0.0.1:$TEST_NGINX_B2;
        location / {
            default_type text/event-stream;
            return 200 "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]\n\n";
        }
        location /slow/ {
            limit_rate 1000;
            return 200 "$TEST_NGINX_SLOW";
        }
    }
    server {
        listen 127.0.0.1:$TEST_NGINX_PF;
        location / {
            default_type application/json;
            return 200 '{"id":"p","object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":"length"}],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e","remote_block_ids":[1],"remote_request_id":"p","remote_host":"127.0.0.1","remote_port":5600}}';
        }
        location /bad/ { return 503; }
    }
--- config
    add_header X-Route $dpd_route always;
    location /v1/ {
        dpd on;
        dpd_model alpha @alpha;
        dpd_model beta @beta;
        dpd_model 'q"uote' @other;
        dpd_model * @other;
    }
    location @alpha {
        dpd on;
        dpd_threshold 80;
        dpd_protocol nixl;
        dpd_prefill_pass /_pf;
        dpd_decode_upstream pool;
        dpd_prefix_cache approximate;
        proxy_pass http://pool;
    }
    location @beta {
        dpd on;
        dpd_threshold 80;
        dpd_prefill_pass /_pf_bad;
        proxy_pass http://pool;
    }
    location @other {
        dpd on;
        dpd_threshold 80;
        proxy_pass http://pool;
    }
    location /slow/ {
        dpd on;
        proxy_buffering off;
        proxy_pass http://pool;
    }
    location /_pf/ {
        internal;
        proxy_pass http://127.0.0.1:$TEST_NGINX_PF/;
    }
    location /_pf_bad/ {
        internal;
        proxy_pass http://127.0.0.1:$TEST_NGINX_PF/bad/;
    }
    location /plain/ { proxy_pass http://plain; }
    location = /ok { return 200 "ok\n"; }
    location = /metrics { dpd_metrics; }
--- init
main::init_1();
--- no_error_log
[alert]
[crit]



=== TEST 2: the model label holds 15 names at most
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    server {
        listen 127.0.0.1:$TEST_NGINX_B1;
        location / { return 200 "ok\n"; }
    }
--- config
    add_header X-Route $dpd_route always;
    location /v1/ {
        dpd on;
        dpd_model m1 @m; dpd_model m2 @m; dpd_model m3 @m; dpd_model m4 @m;
        dpd_model m5 @m; dpd_model m6 @m; dpd_model m7 @m; dpd_model m8 @m;
        dpd_model m9 @m; dpd_model m10 @m; dpd_model m11 @m;
        dpd_model m12 @m; dpd_model m13 @m; dpd_model m14 @m;
        dpd_model m15 @m; dpd_model m16 @m;
    }
    location @m {
        dpd on;
        proxy_pass http://127.0.0.1:$TEST_NGINX_B1;
    }
    location = /ok { return 200 "ok\n"; }
    location = /metrics { dpd_metrics; }
--- init
main::init_2();
--- error_log
more than 15 model names since the start, "m16" is counted as model="other"



=== TEST 3: a reload keeps the counts and the names' slots
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    server {
        listen 127.0.0.1:$TEST_NGINX_B1;
        location / { return 200 "ok\n"; }
    }
--- config
    add_header X-Route $dpd_route always;
    location /v1/ {
        dpd on;
        dpd_model a @m;
        dpd_model b @m;
        dpd_model * @m;
    }
    location @m {
        dpd on;
        proxy_pass http://127.0.0.1:$TEST_NGINX_B1;
    }
    location = /ok { return 200 "ok\n"; }
    location = /metrics { dpd_metrics; }
--- init
main::init_3();
--- no_error_log
[alert]
[crit]
