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

use Test::Nginx::Socket;
use DPD::Emu;
use DPD::KvMesh;
use DPD::Pools qw(block_defaults long_body recs count_requests wait_for
                  nginx_socket send_post);
use JSON::PP ();
use Time::HiRes qw(sleep time);

plan(skip_all => $_) for DPD::KvMesh->unavailable;
plan('no_plan');   # after the skip checks: a skip must not plan twice

our $J = JSON::PP->new->utf8->canonical;

# router-0, prefill-0 (127.0.0.2), decode-0 (127.0.0.3), decode-1
# (127.0.0.4); pools of 256 blocks; agents dead after 3 s: long enough for
# the frozen-agent cases below
our $MESH = DPD::KvMesh->start(tmp => 'dpd-kva-t41', blocks => 256,
                               dead_after_ms => 3000);
our $PA = $MESH->agent('prefill-0');
our %DA = map { $_ => $MESH->agent($_) } qw(decode-0 decode-1);
our $P = $MESH->engine('prefill-0');
our %D = map { $_ => $MESH->engine($_) } qw(decode-0 decode-1);
our %HOST_OF = ('decode-0' => '127.0.0.3', 'decode-1' => '127.0.0.4');

# a decoder without any agent or node record
our $LONE = DPD::Emu->start($MESH->emu_options, host => '127.0.0.5',
                            role => 'decode');

my $http_config = $MESH->http_config(server_params => 'max_fails=3')
                  . <<'_EOC_';

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

block_defaults(http_config => $http_config, config => $config, timeout => 30);

sub freeze { kill 'STOP', $_->pid for values %DA }

# thaw the decode agents, drop what landed for nobody, wait for the mesh;
# @ids: the clients' ids, whose KV the agents know by the gateway's id
# (the X-Request-Id the prefill engine got)
sub thaw {
    my @ids = map { my $c = $_; map { $_->{request_id} }
                    $P->requests(request_id => $c) } @_;
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
    my $s = nginx_socket();
    freeze();
    send_post($s, '/abort/v1/completions', $rid, long_body());
    $ABORT{prefilled} = wait_for("$rid prefill answered", sub {
        grep { $_->{status} } $P->requests(request_id => $rid) }, 20);
    sleep 0.3;
    $ABORT{t} = time;
    close $s;
    sleep 0.5;
    thaw($rid);
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
        {dpd => {req_id => $p->{request_id}}},
        'push failed: the decoder still checks its agent (the KV id)';
    my $node = $p->{body}{kv_transfer_params}{dpd}{decode_node} // '';
    is $d[0]{emu}->host, $HOST_OF{$node},
        'push failed: still the pinned decoder';
}

{
    my ($p) = recs('kvf-lost', $P);
    my @d = recs('kvf-lost', values %D);
    is scalar(@d), 1, 'KV never landed: one decode request';
    is_deeply $d[0]{body}{kv_transfer_params},
        {dpd => {req_id => $p && $p->{request_id}}},
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
    my %per = map { $_ => count_requests(qr/^kvf-after-/, $D{$_}) } keys %D;
    is_deeply [sort values %per], [2, 2],
        'after the abort: idle decoders take turns (reservation released)';
}

{
    my %per = map { $_ => count_requests(qr/^kvf-free-/, $D{$_}) } keys %D;
    is $per{'decode-0'}, 0, 'free blocks: the loaded decoder got nothing';
    is $per{'decode-1'}, 4, 'free blocks: the other decoder got all 4';
}

{
    my %per = map { $_ => count_requests(qr/^kvf-dead-/, $D{$_}) } keys %D;
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
"POST /v1/completions\n" . main::long_body()
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
"POST /v1/completions\n" . main::long_body()
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
"POST /lone/v1/completions\n" . main::long_body()
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
                kv_override => {dpd => {blocks => 0,
                                        state => 'failed'}});
--- request eval
"POST /v1/completions\n" . main::long_body()
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
"POST /v1/completions\n" . main::long_body()
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
$main::MESH->table_wait(sub { 2 == grep { (DPD::KvMesh::node($_[0], $_)->{free_blocks} // 0) == 256 }
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
$main::MESH->table_wait(sub { (DPD::KvMesh::node($_[0], 'decode-0')->{free_blocks} // 256) <= 56 })
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
$main::MESH->table_wait(sub { !DPD::KvMesh::node($_[0], 'decode-1')->{alive} }, 10)
    or die "router never marked decode-1 dead";
--- request eval
[(map { "POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => "short $_", max_tokens => 1}) } 1 .. 4),
 (map { "POST /v1/completions\n" . main::long_body() } 5 .. 6),
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
