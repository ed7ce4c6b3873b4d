# Pods come and go without a reload (issue 11 §1): nginx 1.27.3+ re-resolves
# "server NAME resolve" in a zoned upstream, and dpd_balance follows the
# membership (peer references, the configuration generation, pins that
# outlive their peer).  A real DNS server on loopback (dnsmasq) answers the
# A records of two "headless services" from a hosts file this test rewrites
# and reloads with SIGHUP; nginx asks it with resolver valid=1s.
#
#   1. a decoder added receives traffic within a few valid= periods;
#   2. a decoder removed while requests decode on it: they finish, new
#      ones go to the one left;
#   3. a decoder removed while lmcache requests are pinned to it (during
#      their prefill): they decode on the other one without the KV (route
#      fallback), or with dpd_decode_retry off fail cleanly with a 502;
#   4. the prefill pool likewise: the prefill in flight on a removed peer
#      finishes, the next prefill goes to the new one.
# No crash, no alert, no worker exit (valgrind clean with
# TEST_NGINX_USE_VALGRIND=1).  Skipped on nginx < 1.27.3 (Debian's 1.22 has
# no "resolve" in open source) and without dnsmasq (tools/deps.sh).
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Pools qw(block_defaults recs long_body wait_for);
use File::Temp ();
use HTTP::Request ();
use JSON::PP ();
use LWP::UserAgent ();
use POSIX ();
use Time::HiRes qw(sleep time);

sub nginx_version {
    my $bin = $ENV{TEST_NGINX_BINARY} || 'nginx';
    my $v = `$bin -v 2>&1` // '';
    return $v =~ m{nginx/(\d+)\.(\d+)\.(\d+)} ? $1 * 1000000 + $2 * 1000 + $3
                                              : 0;
}

our $DNSMASQ = (grep { -x } map { "$_/dnsmasq" }
                qw(/usr/sbin /usr/local/sbin /usr/bin))[0];

plan(skip_all => $_) for DPD::Pools->unavailable;
plan(skip_all => 'nginx ' . ($ENV{TEST_NGINX_BINARY} || 'nginx')
     . ' is older than 1.27.3: no "resolve" in open-source nginx')
    if nginx_version() < 1027003;
plan(skip_all => 'dnsmasq not installed (tools/deps.sh: dnsmasq-base)')
    unless $DNSMASQ;
plan('no_plan');   # after the skip checks: a skip must not plan twice

# ports: $DPD_TEST_PORT_BASE (default 18600) + 130 .. 133, DNS on + 139
my $pools = DPD::Pools->start(offset => 130, time_scale => 0.01);
our @prefill = $pools->prefill;     # 127.0.0.2, .3
our @decode = $pools->decode;       # 127.0.0.4, .5
our $EMU_PORT = $pools->port;

# under valgrind nginx is many times slower: longer windows
our $SLOW = $ENV{TEST_NGINX_USE_VALGRIND} ? 4 : 1;

# --- the DNS server ------------------------------------------------------------

our $DNS_PORT = DPD::Pools::port_base() + 139;
our $DNS_DIR = File::Temp->newdir('dpd-dns-XXXXXX', TMPDIR => 1);
our $HOSTS = "$DNS_DIR/hosts";
our $DNS_PID;

# hosts(decode => [4, 5], prefill => [2]): the services' A records now
sub hosts {
    my (%svc) = @_;
    open my $fh, '>', "$HOSTS.tmp" or die "hosts: $!";
    for my $name (sort keys %svc) {
        print $fh "127.0.0.$_ $name.svc.test\n" for @{ $svc{$name} };
    }
    close $fh;
    chmod 0644, "$HOSTS.tmp";
    rename "$HOSTS.tmp", $HOSTS or die "rename: $!";
    kill 'HUP', $DNS_PID if $DNS_PID;
}

sub dns_start {
    hosts(decode => [4], prefill => [2]);
    $DNS_PID = fork // die "fork: $!";
    if ($DNS_PID == 0) {
        { no warnings 'exec'; exec $DNSMASQ, '--keep-in-foreground', '--conf-file=/dev/null',
             "--port=$DNS_PORT", '--listen-address=127.0.0.1',
             '--bind-interfaces', '--no-resolv', '--no-hosts',
             "--addn-hosts=$HOSTS", '--local-ttl=0', '--user=root',
             "--pid-file=$DNS_DIR/pid", "--log-facility=$DNS_DIR/log",
             '--log-queries'; }
        POSIX::_exit(127);
    }
    # answering: dnsmasq logs its start, then reads the hosts file
    wait_for('dnsmasq', sub { -s "$DNS_DIR/log"
                              && `cat $DNS_DIR/log` =~ /read \Q$HOSTS\E/ },
             10) or die "dnsmasq did not start: " . `cat $DNS_DIR/log`;
}

END {
    if ($DNS_PID) {
        kill 'TERM', $DNS_PID;
        waitpid $DNS_PID, 0;
    }
}

dns_start();

$ENV{TEST_NGINX_DNS_PORT} = $DNS_PORT;

my $http_config = DPD::Pools::tokenizer_conf() . <<'_EOC_';

    resolver 127.0.0.1:$TEST_NGINX_DNS_PORT valid=1s ipv6=off;
    resolver_timeout 2s;

    upstream decode {
        zone decode 64k;
        dpd_balance;
        server decode.svc.test:$TEST_NGINX_EMU_PORT resolve;
        dpd_lmcache_ports init=$TEST_NGINX_LMC_INIT alloc=$TEST_NGINX_LMC_ALLOC;
    }

    upstream prefill {
        zone prefill 64k;
        dpd_balance;
        server prefill.svc.test:$TEST_NGINX_EMU_PORT resolve;
    }
_EOC_

my $config = <<'_EOC_';
    dpd_threshold 256;
    dpd_prefill_timeout 60s;
    proxy_http_version 1.1;
    proxy_buffering off;
    proxy_read_timeout 60s;
    add_header X-Route $dpd_route always;
    add_header X-Upstream $upstream_addr always;
    add_header X-Prefill-Peer $dpd_prefill_peer always;

    location /v1/ {
        dpd on;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode;
    }

    location /lm/ {
        dpd on;
        dpd_protocol lmcache;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode/;
    }

    location /lmoff/ {
        dpd on;
        dpd_protocol lmcache;
        dpd_prefill_pass /_dpd_prefill;
        dpd_decode_retry off;
        proxy_pass http://decode/;
    }

    location /_dpd_prefill/ {
        internal;
        proxy_pass http://prefill/;
    }

    # which decoders nginx knows now, without a generation request
    location = /peek { proxy_pass http://decode/v1/models; }
    location = /peek-prefill { proxy_pass http://prefill/v1/models; }

    location = /ok { return 200 "ok\n"; }
_EOC_

master_on();
workers(2);

block_defaults(http_config => $http_config, config => $config,
               timeout => 120 * $SLOW, request => 'GET /ok',
               response_body => "ok\n");

our %R;    # results by request id: {code, route, upstream, prefill, body}

sub ua { LWP::UserAgent->new(timeout => 120 * $SLOW, keep_alive => 0) }

sub post {
    my ($path, $id) = @_;
    my $req = HTTP::Request->new(
        POST => 'http://127.0.0.1:' . server_port() . $path);
    $req->header('Content-Type' => 'application/json');
    $req->header('X-Request-Id' => $id);
    $req->content(long_body(prompt => "$id $DPD::Pools::LONG_PROMPT"));
    my $res;
    for (1 .. 100) {    # nginx may still be starting (valgrind)
        $res = ua()->request($req);
        last unless $res->code == 500
                    && ($res->header('Client-Warning') // '')
                       eq 'Internal response';
        sleep 0.2;
    }
    return {code => $res->code, route => $res->header('X-Route') // '',
            upstream => $res->header('X-Upstream') // '',
            prefill => $res->header('X-Prefill-Peer') // '',
            body => $res->content};
}

# requests in child processes; their results arrive through a pipe
sub post_async {
    my (@req) = @_;    # [path, id], ...
    pipe(my $r, my $w) or die "pipe: $!";
    my @kids;
    for my $q (@req) {
        my $pid = fork // die "fork: $!";
        if ($pid == 0) {
            close $r;
            my $res = post(@$q);
            print $w JSON::PP->new->encode({id => $q->[1], %$res}) . "\n";
            close $w;
            POSIX::_exit(0);
        }
        push @kids, $pid;
    }
    close $w;
    return {r => $r, kids => \@kids};
}

sub collect {
    my ($a) = @_;
    my $fh = $a->{r};
    while (my $line = <$fh>) {
        my $res = JSON::PP->new->decode($line);
        $R{ delete $res->{id} } = $res;
    }
    waitpid $_, 0 for @{ $a->{kids} };
}

# the peer /peek reaches, until nginx's view of the service is $want
# (a set of last octets), at most $limit seconds; the seconds it took or -1
sub until_members {
    my ($path, $limit, @want) = @_;
    my %want = map { ("127.0.0.$_:$EMU_PORT" => 1) } @want;
    my $t0 = time;
    while (time - $t0 < $limit) {
        my %seen;
        # every member, whatever the balancer's turn: 2 rounds per member
        for (1 .. 2 * @want + 2) {
            my $res = ua()->get('http://127.0.0.1:' . server_port() . $path);
            my $u = $res->header('X-Upstream') // '';
            $seen{$u} = 1 if $res->is_success;
        }
        return time - $t0
            if join(',', sort keys %seen) eq join(',', sort keys %want);
        sleep 0.2;
    }
    return -1;
}

our %T;    # seconds to converge, by step

sub clear_all { $_->clear_faults for @prefill, @decode }

sub scenario {
    clear_all();

    # --- 1: one decoder; a second one appears --------------------------------
    $T{start} = until_members('/peek', 30 * $SLOW, 4);
    $R{"one-$_"} = post('/v1/completions', "one-$_") for 1 .. 3;

    hosts(decode => [4, 5], prefill => [2]);
    $T{added} = until_members('/peek', 20 * $SLOW, 4, 5);
    $R{"two-$_"} = post('/v1/completions', "two-$_") for 1 .. 4;

    # --- 2: in-flight decodes on a decoder that goes away --------------------
    $_->fault(role => 'decode', delay_ms => 4000 * $SLOW, count => 1)
        for @decode;
    my $a = post_async(['/v1/completions', 'fly-1'],
                       ['/v1/completions', 'fly-2']);
    wait_for('both decoders busy', sub {
        (grep { scalar recs('fly-1', $_) + scalar recs('fly-2', $_) } @decode)
            == 2 }, 20 * $SLOW);
    hosts(decode => [5], prefill => [2]);
    $T{removed} = until_members('/peek', 20 * $SLOW, 5);
    collect($a);
    $R{"after-$_"} = post('/v1/completions', "after-$_") for 1 .. 3;
    clear_all();

    # --- 3: lmcache requests pinned to a decoder that goes away ---------------
    # the only decoder is .5: the pins go there, then .4 replaces it while
    # the prefills are held
    $_->fault(role => 'prefill', delay_ms => 5000 * $SLOW) for @prefill;
    $a = post_async(['/lm/v1/completions', 'pin-retry'],
                    ['/lmoff/v1/completions', 'pin-off']);
    wait_for('both prefills started', sub {
        scalar(recs('pin-retry', @prefill)) && scalar(recs('pin-off', @prefill))
    }, 20 * $SLOW);
    hosts(decode => [4], prefill => [2]);
    $T{pinned_gone} = until_members('/peek', 20 * $SLOW, 4);
    collect($a);
    clear_all();

    # --- 4: the prefill pool: .2 leaves with a prefill in flight, .3 joins ---
    $prefill[0]->fault(role => 'prefill', delay_ms => 4000 * $SLOW, count => 1);
    $a = post_async(['/v1/completions', 'pf-fly']);
    wait_for('the prefill started', sub { scalar recs('pf-fly', @prefill) },
             20 * $SLOW);
    hosts(decode => [4], prefill => [3]);
    $T{prefill_moved} = until_members('/peek-prefill', 20 * $SLOW, 3);
    collect($a);
    $R{"pf-after-$_"} = post('/v1/completions', "pf-after-$_") for 1 .. 2;
}

no_shuffle();
log_level('info');
run_tests();

diag(join ', ', map { "$_ $T{$_} s" } sort keys %T) if $ENV{TEST_VERBOSE};

# --- 1: added ------------------------------------------------------------------

ok $T{start} >= 0, 'nginx resolved the decode service at start';
is $R{"one-$_"}{code}, 200, "one decoder: one-$_ answered" for 1 .. 3;
is scalar(recs("one-$_", $decode[0])), 1, "one decoder: one-$_ decoded on .4"
    for 1 .. 3;
ok $T{added} >= 0 && $T{added} <= 6 * $SLOW,
   "the added decoder is in nginx's view within a few valid=1s periods"
   . " ($T{added} s)";
{
    my @n = map { my $e = $_; scalar grep { recs("two-$_", $e) } 1 .. 4 } @decode;
    is $n[0] + $n[1], 4, 'after the addition every request decoded once';
    ok $n[1] >= 1, "the added decoder takes requests (@n)";
}

# --- 2: removed in flight --------------------------------------------------------

for my $id (qw(fly-1 fly-2)) {
    is $R{$id}{code}, 200, "$id: decoding while its decoder left: finished";
}
ok $T{removed} >= 0, "the removed decoder left nginx's view ($T{removed} s)";
is scalar(grep { recs("after-$_", $decode[0]) } 1 .. 3), 0,
    'after the removal nothing goes to .4';
is scalar(grep { recs("after-$_", $decode[1]) } 1 .. 3), 3,
    'after the removal everything goes to .5';

# --- 3: pinned to a removed decoder ------------------------------------------------

{
    my ($p) = recs('pin-retry', @prefill);
    is $p->{body}{kv_transfer_params}{disagg_spec}{receiver_host}, '127.0.0.5',
        'pin-retry: the KV was pushed to .5 (the only decoder then)';
    ok $T{pinned_gone} >= 0, "the pinned decoder left during the prefill";
    is $R{'pin-retry'}{code}, 200,
        'pin-retry: its decoder gone, decoded on the one left';
    is $R{'pin-retry'}{route}, 'fallback', 'pin-retry: route fallback';
    is scalar(recs('pin-retry', $decode[1])), 0, 'pin-retry: nothing sent to .5';
    my ($d) = recs('pin-retry', $decode[0]);
    ok $d, 'pin-retry: decoded on .4';
    is(($d || {})->{cached_tokens} // 0, 0, 'pin-retry: .4 recomputed (no KV)');

    is $R{'pin-off'}{code}, 502,
        'pin-off (dpd_decode_retry off): its decoder gone, a clean 502';
    like $R{'pin-off'}{body}, qr/^\{"error":\{/, 'pin-off: an OpenAI error';
    is scalar(recs('pin-off', @decode)), 0, 'pin-off: no decoder got it';
}

# --- 4: the prefill pool ---------------------------------------------------------------

is $R{'pf-fly'}{code}, 200, 'pf-fly: its prefill peer left in flight: finished';
like $R{'pf-fly'}{prefill}, qr/^127\.0\.0\.2:/, 'pf-fly: prefilled by .2';
is $R{'pf-fly'}{route}, 'disaggregated', 'pf-fly: still disaggregated';
ok $T{prefill_moved} >= 0, "the prefill pool moved to .3 ($T{prefill_moved} s)";
for (1 .. 2) {
    is $R{"pf-after-$_"}{code}, 200, "pf-after-$_ answered";
    like $R{"pf-after-$_"}{prefill}, qr/^127\.0\.0\.3:/,
        "pf-after-$_: prefilled by the new peer";
}

__DATA__

=== TEST 1: membership changes under load: added, removed in flight, pinned, prefill pool
--- init
main::scenario();
--- no_error_log
[alert]
[emerg]
exited on signal
