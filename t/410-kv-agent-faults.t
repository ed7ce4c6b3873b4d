# dpd_protocol kv_agent when things go wrong, and the readiness-aware
# dpd_balance, against real agents (router + prefill + 2 decode, each engine
# in front of its own agent; tcp;ofi_rxm on loopback) and vLLM emulators:
#   * prefill 5xx, no state table, no node record of the decoder: decode
#     only (route fallback), warn log with the reason;
#   * a prefill reply saying the push failed: no KV wait;
#   * the KV never lands (both decode agents frozen): nginx waits
#     dpd_kv_wait, the decoder recomputes;
#   * the client goes away during the KV wait: no decode request, nothing
#     left behind (run it with TEST_NGINX_USE_VALGRIND=1 too);
#   * readiness: more free KV blocks win among idle decoders; a decoder
#     whose agent died gets nothing once the router marks it dead, while a
#     plain round-robin upstream (max_fails alone) still sends to it.
#
# Ports: emulators $DPD_KVA_EMU_PORT (default 19690) on 127.0.0.2-5,
# agents $DPD_KVA_AGENT_PORT (default 18900) .. +3.
use strict;
use warnings;

use Test::Nginx::Socket 'no_plan';
use DPD::Emu;
use DPD::KvAgent;
use File::Temp qw(tempdir);
use JSON::PP ();
use Time::HiRes qw(sleep time);
use IO::Socket::INET;

if (my ($why) = DPD::KvAgent->unavailable('tcp;ofi_rxm')) {
    plan(skip_all => $why);
}
my ($tj, $tc) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'Llama 3 tokenizer fixture not installed (make deps)')
    unless $tj && $tc;
plan(skip_all => 'build/libdpdtok.so missing (make)')
    unless DPD::Emu->have_tokenizer_lib;

my $J = JSON::PP->new->utf8->canonical;
my $eport = $ENV{DPD_KVA_EMU_PORT} || 19690;
my $aport = $ENV{DPD_KVA_AGENT_PORT} || 18900;
my $dir = tempdir('dpd-kva-t41-XXXXXX', TMPDIR => 1,
                  CLEANUP => !$ENV{DPD_KEEP_TMP});

our %HTTP = ('prefill-0' => "127.0.0.2:$eport",
             'decode-0' => "127.0.0.3:$eport",
             'decode-1' => "127.0.0.4:$eport");
my %CTRL = ('router-0' => "127.0.0.1:$aport",
            'prefill-0' => "127.0.0.1:" . ($aport + 1),
            'decode-0' => "127.0.0.1:" . ($aport + 2),
            'decode-1' => "127.0.0.1:" . ($aport + 3));
my %ROLE = ('router-0' => 'router', 'prefill-0' => 'prefill',
            'decode-0' => 'decode', 'decode-1' => 'decode');

sub peers {
    return [map { {id => $_, ctrl => $CTRL{$_}, role => $ROLE{$_},
                   $HTTP{$_} ? (http => $HTTP{$_}) : ()} } @_];
}

# dead after 3 s: long enough for the frozen-agent cases below
my %timeouts = (heartbeat_ms => 100, dead_after_ms => 3000);
my $pool = DPD::KvAgent->small_pool(blocks => 256);

sub agent {
    my ($id, @peers) = @_;
    return DPD::KvAgent->start(id => $id, role => $ROLE{$id},
        port => (split /:/, $CTRL{$id})[1], dir => $dir,
        $HTTP{$id} ? (http => $HTTP{$id}) : (), pool => $pool,
        peers => peers(@peers), timeouts => \%timeouts);
}

our $ROUTER = agent('router-0', qw(prefill-0 decode-0 decode-1));
our %DA = map { $_ => agent($_, qw(prefill-0 router-0)) }
          qw(decode-0 decode-1);
our $PA = agent('prefill-0', qw(decode-0 decode-1 router-0));

my %emu = (port => $eport, side_channel_port => $eport + 1, no_lmcache => 1,
           tokenizer => 'llama3', time_scale => 0.01,
           kv_connect_timeout => 0.5);
our $P = DPD::Emu->start(%emu, host => '127.0.0.2', role => 'prefill',
                         kv_agent => $PA);
our %D = map { my $n = $_;
               ("decode-$n" => DPD::Emu->start(%emu, host => "127.0.0.${\($n + 3)}",
                                               role => 'decode',
                                               kv_agent => $DA{"decode-$n"})) }
         0, 1;
our %HOST_OF = ('decode-0' => '127.0.0.3', 'decode-1' => '127.0.0.4');

# registering pools makes the agents reconnect: wait for the mesh and the
# router's table (4 nodes alive) before nginx starts
$PA->wait_connected(['decode-0', 'decode-1', 'router-0'])
    or die "prefill agent not connected:\n" . $PA->log_text;
$DA{$_}->wait_connected(['prefill-0', 'router-0'])
    or die "$_ not connected:\n" . $DA{$_}->log_text for sort keys %DA;

sub table {
    my $out = `'@{[DPD::KvAgent::bin()]}' status --state '@{[$ROUTER->state_path]}' --json 2>&1`;
    return eval { $J->decode($out) } || {};
}

sub table_wait {
    my ($cond, $timeout) = @_;
    my $end = time + ($timeout // 10);
    while (time < $end) {
        return 1 if $cond->(table());
        sleep 0.05;
    }
    return 0;
}

sub node {
    my ($t, $id) = @_;
    my ($n) = grep { $_->{id} eq $id } @{ $t->{nodes} || [] };
    return $n || {};
}

table_wait(sub { 4 == grep { $_->{alive} } @{ $_[0]{nodes} || [] } }, 15)
    or die "router table: not 4 nodes alive: " . $J->encode(table());

$ENV{TEST_NGINX_LLAMA3} = $tj;
$ENV{TEST_NGINX_LLAMA3_CONFIG} = $tc;
$ENV{TEST_NGINX_EMU_PORT} = $eport;
$ENV{TEST_NGINX_STATE} = $ROUTER->state_path;
$ENV{TEST_NGINX_LONG} = join ' ',
    ('the quick brown fox jumps over the lazy dog') x 60;

our $BS = $P->block_size;

# a decoder without any agent or node record
our $LONE = DPD::Emu->start(%emu, host => '127.0.0.5', role => 'decode');

my $http_config = <<'_EOC_';
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
    dpd_state_table $TEST_NGINX_STATE check=100ms stale=3s;

    upstream prefill {
        dpd_balance;
        zone prefill 64k;
        server 127.0.0.2:$TEST_NGINX_EMU_PORT;
    }

    upstream decode {
        dpd_balance;
        zone decode 64k;
        server 127.0.0.3:$TEST_NGINX_EMU_PORT max_fails=3;
        server 127.0.0.4:$TEST_NGINX_EMU_PORT max_fails=3;
    }

    upstream lone {
        dpd_balance;
        zone lone 64k;
        server 127.0.0.5:$TEST_NGINX_EMU_PORT;
    }

    # the same decoders with nginx's own balancer: max_fails only
    upstream decode_rr {
        zone decode_rr 64k;
        server 127.0.0.3:$TEST_NGINX_EMU_PORT max_fails=3;
        server 127.0.0.4:$TEST_NGINX_EMU_PORT max_fails=3;
    }
_EOC_

my $common = <<'_EOC_';
        dpd on;
        dpd_threshold 256;
        dpd_protocol kv_agent;
        dpd_prefill_pass /_dpd_prefill;
        dpd_prefill_timeout 20s;
        proxy_http_version 1.1;
        proxy_buffering off;
        add_header X-Route $dpd_route always;
        add_header X-Decode-Peer $dpd_decode_peer always;
        add_header X-KV-Wait $dpd_kv_wait_time always;
_EOC_

my $config = <<_EOC_;
    location /v1/ {
$common
        dpd_decode_upstream decode;
        dpd_kv_wait 400ms;
        proxy_pass http://decode;
    }

    location /abort/ {
$common
        dpd_decode_upstream decode;
        dpd_kv_wait 20s;
        proxy_pass http://decode/;
    }

    location /lone/ {
$common
        dpd_decode_upstream lone;
        proxy_pass http://lone/;
    }

    location /rr/ {
        proxy_pass http://decode_rr/;
        proxy_http_version 1.1;
    }

    location /_dpd_prefill/ {
        internal;
        proxy_pass http://prefill/;
        proxy_http_version 1.1;
    }

    location = /state { dpd_state_status; }
    location = /metrics { dpd_metrics; }
_EOC_

add_block_preprocessor(sub {
    my $block = shift;
    $block->set_value('http_config', $http_config)
        unless defined $block->http_config;
    $block->set_value('config', $config) unless defined $block->config;
    $block->set_value('timeout', 30) unless defined $block->timeout;
});

sub body {
    my (%o) = @_;
    return JSON::PP->new->encode({model => 'm',
                                  prompt => $ENV{TEST_NGINX_LONG},
                                  max_tokens => 2, %o});
}

sub wait_for {
    my ($what, $cond, $timeout) = @_;
    my $deadline = time + ($timeout || 10);
    while (time < $deadline) {
        return 1 if $cond->();
        sleep 0.05;
    }
    Test::More::diag("timed out waiting for $what");
    return 0;
}

sub freeze { kill 'STOP', $_->pid for values %DA }

# thaw the decode agents, drop what landed for nobody, wait for the mesh
sub thaw {
    my (@ids) = @_;
    kill 'CONT', $_->pid for values %DA;
    for my $a (values %DA) {
        for my $id (@ids) {
            $a->wait_final($id, 8);
            $a->api({verb => 'release', req_id => $id});
        }
    }
    # an engine that lost its agent registers its pool again on its next
    # request; do it now, then wait for the agents to reconnect
    for my $d (values %D) {
        next if ($d->kv_agent_stats || {})->{registered};
        $d->post_json('/v1/completions', {prompt => 'poke', max_tokens => 1,
                      kv_transfer_params => {dpd => {req_id => 'poke'}}});
        wait_for('decoder registered again',
                 sub { ($d->kv_agent_stats || {})->{registered} }, 10);
    }
    $PA->wait_connected(['decode-0', 'decode-1'], 15);
    $_->wait_connected(['prefill-0'], 15) for values %DA;
}

our %ABORT;

# send a request, hang up once the prefill engine has answered: nginx is
# then waiting for the KV (the decode agents are frozen)
sub abort_in_kv_wait {
    my ($rid) = @_;
    my $s;
    wait_for('nginx to listen', sub {
        $s = IO::Socket::INET->new(PeerAddr => '127.0.0.1',
                                   PeerPort => server_port(), Timeout => 5);
    }, 20) or die "connect: $!";
    freeze();
    my $b = body();
    print $s "POST /abort/v1/completions HTTP/1.1\r\nHost: localhost\r\n"
           . "Content-Type: application/json\r\nX-Request-Id: $rid\r\n"
           . "Content-Length: " . length($b) . "\r\n\r\n$b";
    $ABORT{prefilled} = wait_for("$rid prefill answered", sub {
        grep { $_->{status} } $P->requests(request_id => $rid) }, 20);
    sleep 0.3;
    $ABORT{t} = time;
    close $s;
    sleep 0.5;
    thaw($rid);
}

sub node_alive {
    my ($id) = @_;
    return node(table(), $id)->{alive} ? 1 : 0;
}

sub recs {
    my ($id, @emus) = @_;
    return map { my $e = $_; map { {emu => $e, %$_} } $e->requests(request_id => $id) } @emus;
}

no_shuffle();
log_level('info');
run_tests();

# --- what the engines saw ---------------------------------------------------

{
    my @d = recs('kvf-5xx', values %D);
    is scalar(@d), 1, 'prefill 5xx: one decode request';
    ok $d[0] && !exists $d[0]{body}{kv_transfer_params},
        'prefill 5xx: decoded without kv_transfer_params';
}

{
    is scalar(recs('kvf-notable', $P)), 0, 'no state table: no prefill';
    my @d = recs('kvf-notable', values %D);
    is scalar(@d), 1, 'no state table: one decode request';
    ok $d[0] && !exists $d[0]{body}{kv_transfer_params},
        'no state table: no kv_transfer_params';
}

{
    is scalar(recs('kvf-norecord', $P)), 0, 'no node record: no prefill';
    my @d = recs('kvf-norecord', $LONE);
    is scalar(@d), 1, 'no node record: decoded by the lone decoder';
    ok $d[0] && !exists $d[0]{body}{kv_transfer_params},
        'no node record: no kv_transfer_params';
}

{
    my ($p) = recs('kvf-failed', $P);
    my @d = recs('kvf-failed', values %D);
    is scalar(@d), 1, 'push failed: one decode request';
    is_deeply $d[0]{body}{kv_transfer_params},
        {dpd => {req_id => 'kvf-failed'}},
        'push failed: the decoder still checks its agent';
    my $node = $p->{body}{kv_transfer_params}{dpd}{decode_node} // '';
    is $d[0]{emu}->host, $HOST_OF{$node},
        'push failed: still the pinned decoder';
}

{
    my @d = recs('kvf-lost', values %D);
    is scalar(@d), 1, 'KV never landed: one decode request';
    is_deeply $d[0]{body}{kv_transfer_params}, {dpd => {req_id => 'kvf-lost'}},
        'KV never landed: decode still names the request';
    isnt $d[0]{kv}{outcome}, 'ready', 'KV never landed: not ready at the decoder';
    ok !$d[0]{cached_tokens}, 'KV never landed: the decoder recomputed';
}

{
    ok $ABORT{prefilled}, 'abort: the prefill answered before the hang-up';
    is scalar(recs('kvf-abort', values %D)), 0,
        'abort during the KV wait: no decode request was made';
}

{
    my %per = map { my $n = $_;
                    ($n => scalar grep { $_->{request_id} =~ /^kvf-after-/ }
                                   $D{$n}->requests) } keys %D;
    is_deeply [sort values %per], [2, 2],
        'after the abort: idle decoders take turns (reservation released)';
}

{
    my %per = map { my $n = $_;
                    ($n => scalar grep { $_->{request_id} =~ /^kvf-free-/ }
                                   $D{$n}->requests) } keys %D;
    is $per{'decode-0'}, 0, 'free blocks: the loaded decoder got nothing';
    is $per{'decode-1'}, 4, 'free blocks: the other decoder got all 4';
}

{
    my %per = map { my $n = $_;
                    ($n => scalar grep { $_->{request_id} =~ /^kvf-dead-/ }
                                   $D{$n}->requests) } keys %D;
    is $per{'decode-1'}, 0, 'dead agent: its decoder got no new request';
    is $per{'decode-0'}, 6, 'dead agent: the live decoder got all 6';
    my @rr = grep { $_->{request_id} =~ /^kvf-rr-/ } $D{'decode-1'}->requests;
    ok @rr >= 1, 'max_fails alone (round robin) still sends to it';
}

__DATA__

=== TEST 1: prefill 5xx: decode only, route fallback
--- init
$main::P->fault(status => 503, role => 'prefill', count => 1);
--- request eval
"POST /v1/completions\n" . main::body()
--- more_headers
Content-Type: application/json
X-Request-Id: kvf-5xx
--- response_body_like: "choices"
--- response_headers_like
X-Route: fallback
X-KV-Wait:
--- error_log eval
qr/\[warn\].*prefill 5xx \(status 503\) for request "kvf-5xx", falling back to decode only/
--- no_error_log
[error]



=== TEST 2: no state table: decode only, warn with the reason
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
    upstream prefill { dpd_balance; server 127.0.0.2:$TEST_NGINX_EMU_PORT; }
    upstream decode { dpd_balance; server 127.0.0.3:$TEST_NGINX_EMU_PORT;
                      server 127.0.0.4:$TEST_NGINX_EMU_PORT; }
    upstream lone { dpd_balance; server 127.0.0.5:$TEST_NGINX_EMU_PORT; }
    upstream decode_rr { server 127.0.0.3:$TEST_NGINX_EMU_PORT; }
--- request eval
"POST /v1/completions\n" . main::body()
--- more_headers
Content-Type: application/json
X-Request-Id: kvf-notable
--- response_body_like: "choices"
--- response_headers_like
X-Route: fallback
--- error_log eval
qr/\[warn\].*kv_agent: no usable dpd_state_table \(decoder 127\.0\.0\.[34]:\d+\) for request "kvf-notable", falling back to decode only/
--- no_error_log
[error]



=== TEST 3: the decoder has no node record: decode only
--- request eval
"POST /lone/v1/completions\n" . main::body()
--- more_headers
Content-Type: application/json
X-Request-Id: kvf-norecord
--- response_body_like: "choices"
--- response_headers_like
X-Route: fallback
X-Decode-Peer: 127\.0\.0\.5:\d+
--- error_log eval
qr/\[warn\].*kv_agent: no node record for the decoder in the state table \(decoder 127\.0\.0\.5:\d+\) for request "kvf-norecord", falling back/
--- no_error_log
[error]



=== TEST 4: the prefill reply says the push failed: no KV wait
--- init
$main::P->fault(role => 'prefill', count => 1,
                kv_override => {dpd => {req_id => 'kvf-failed', blocks => 0,
                                        state => 'failed'}});
--- request eval
"POST /v1/completions\n" . main::body()
--- more_headers
Content-Type: application/json
X-Request-Id: kvf-failed
--- response_body_like: "choices"
--- response_headers_like
X-Route: disaggregated
X-KV-Wait: 0
--- error_log eval
qr/\[warn\].*KV of request "kvf-failed" not pushed: the prefill engine's agent could not push the KV \(waited 0 ms\), decoder 127\.0\.0\.[34]:\d+ recomputes/
--- no_error_log
[error]



=== TEST 5: the KV never lands (decode agents frozen): wait, then recompute
--- init
main::freeze();
--- request eval
"POST /v1/completions\n" . main::body()
--- more_headers
Content-Type: application/json
X-Request-Id: kvf-lost
--- response_body_like: "choices"
--- response_headers_like
X-Route: disaggregated
X-KV-Wait: (4\d\d|5[0-4]\d)
--- error_log eval
qr/\[warn\].*KV of request "kvf-lost" not ready after dpd_kv_wait \(waited 4\d\d ms\), decoder 127\.0\.0\.[34]:\d+ recomputes/
--- no_error_log
[error]



=== TEST 6: client gone during the KV wait
--- init
main::thaw('kvf-lost');
main::abort_in_kv_wait('kvf-abort');
--- request
GET /nothing
--- error_code: 404
--- error_log
client prematurely closed connection while waiting for the KV of request "kvf-abort"
--- no_error_log
[alert]
[crit]



=== TEST 7: after the abort both decoders are idle again (no reservation left)
--- init
main::table_wait(sub { 2 == grep { (main::node($_[0], $_)->{free_blocks} // 0) == 256 }
                              qw(decode-0 decode-1) })
    or die "decoders' blocks not all free";
--- request eval
[map { "POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => "short $_", max_tokens => 1}) } 1 .. 4]
--- more_headers eval
[map { "Content-Type: application/json\nX-Request-Id: kvf-after-$_" } 1 .. 4]
--- response_body_like eval
[("choices") x 4]



=== TEST 8: among idle decoders the one with more free KV blocks wins
--- init
my $r = $main::DA{'decode-0'}->api({verb => 'reserve', req_id => 'hog',
                                    nblocks => 200});
die "reserve: " . $main::J->encode($r) unless $r && $r->{ok};
main::table_wait(sub { (main::node($_[0], 'decode-0')->{free_blocks} // 256) <= 56 })
    or die "router never saw decode-0's reservation";
--- request eval
[map { "POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => "short $_", max_tokens => 1}) } 1 .. 4]
--- more_headers eval
[map { "Content-Type: application/json\nX-Request-Id: kvf-free-$_" } 1 .. 4]
--- response_headers_like eval
[("X-Decode-Peer: 127\\.0\\.0\\.4:\\d+") x 4]



=== TEST 9: a decoder whose agent died gets nothing once the router says so
--- init
$main::DA{'decode-0'}->api({verb => 'release', req_id => 'hog'});
$main::DA{'decode-1'}->stop('KILL');
main::table_wait(sub { !main::node($_[0], 'decode-1')->{alive} }, 10)
    or die "router never marked decode-1 dead";
--- request eval
[(map { "POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => "short $_", max_tokens => 1}) } 1 .. 4),
 (map { "POST /v1/completions\n" . main::body() } 5 .. 6),
 (map { "POST /rr/v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => "short $_", max_tokens => 1}) } 1 .. 2),
 "GET /state?addr=127.0.0.4:$ENV{TEST_NGINX_EMU_PORT}"]
--- more_headers eval
[(map { "Content-Type: application/json\nX-Request-Id: kvf-dead-$_" } 1 .. 6),
 "Content-Type: application/json\nX-Request-Id: kvf-rr-1",
 "Content-Type: application/json\nX-Request-Id: kvf-rr-2", ""]
--- response_headers_like eval
[("X-Decode-Peer: 127\\.0\\.0\\.3:\\d+") x 6, "", "", ""]
--- response_body_like eval
[("choices") x 4, ("cached_tokens\":[1-9]") x 2, "choices", "choices",
 qr/"id":"decode-1".*"alive":false/]
