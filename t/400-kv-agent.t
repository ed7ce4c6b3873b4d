# dpd_protocol kv_agent end to end: nginx + 1 prefill and 2 decode vLLM
# emulators, each in front of its own real kv_agent (tcp;ofi_rxm on
# loopback), and a router agent whose state table nginx reads.  The decoder
# is chosen first, its node id comes from the table, the prefill engine's
# agent pushes the KV to it, nginx waits until the table says "ready", and
# the decode request goes to exactly that decoder, which reuses the KV.
#
# Ports: emulators $DPD_KVA_EMU_PORT (default 19690) on 127.0.0.2-4,
# agents $DPD_KVA_AGENT_PORT (default 18900) .. +3.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::KvMesh;
use DPD::Pools qw(block_defaults recs count_requests);
use JSON::PP ();
use Time::HiRes qw(sleep time);

plan(skip_all => $_) for DPD::KvMesh->unavailable;
plan('no_plan');   # after the skip checks: a skip must not plan twice

my $J = JSON::PP->new->utf8->canonical;

# router-0, prefill-0 (127.0.0.2), decode-0 (127.0.0.3), decode-1
# (127.0.0.4); pools of 256 blocks; agents dead after 3 s
my $mesh = DPD::KvMesh->start(tmp => 'dpd-kva-t4', blocks => 256,
                              dead_after_ms => 3000);
our %DA = map { $_ => $mesh->agent($_) } qw(decode-0 decode-1);
our $P = $mesh->engine('prefill-0');
our %D = map { $_ => $mesh->engine($_) } qw(decode-0 decode-1);
our %HOST_OF = ('decode-0' => '127.0.0.3', 'decode-1' => '127.0.0.4');

our $BS = $P->block_size;

# keepalive on the decode pool, as in production: the pin must hold behind it
my $http_config = $mesh->http_config(decode_keepalive => 8);

my $config = <<'_EOC_';
    location /v1/ {
        dpd on;
        dpd_threshold 256;
        dpd_protocol kv_agent;
        dpd_decode_upstream decode;
        dpd_prefill_pass /_dpd_prefill;
        dpd_prefill_timeout 20s;
        dpd_kv_wait 5s;

        proxy_pass http://decode;
        proxy_http_version 1.1;
        proxy_buffering off;
        # nginx would try another decoder even for a POST: the pin must not
        proxy_next_upstream error timeout non_idempotent;

        add_header X-Route $dpd_route always;
        add_header X-Prefill-Peer $dpd_prefill_peer always;
        add_header X-Decode-Peer $dpd_decode_peer always;
        add_header X-KV-Wait $dpd_kv_wait_time always;
    }

    location /_dpd_prefill/ {
        internal;
        proxy_pass http://prefill/;
        proxy_http_version 1.1;
    }

    location = /metrics { dpd_metrics; }
_EOC_

block_defaults(http_config => $http_config, config => $config, timeout => 30);

no_shuffle();
log_level('info');
run_tests();

# --- what the engines and agents saw ---------------------------------------

for my $id (qw(kva-cmpl kva-chat-stream kva-chat kva-client-ktp
               kva-seq-1 kva-seq-2 kva-seq-3 kva-seq-4)) {
    my @p = recs($id, $P);
    my @d = recs($id, values %D);
    is scalar(@p), 1, "$id: one prefill request";
    is scalar(@d), 1, "$id: one decode request";
    my ($p, $d) = ($p[0] || {}, $d[0] || {});
    my $kp = (($p->{body}{kv_transfer_params} || {})->{dpd}) || {};
    is $kp->{req_id}, $id, "$id: prefill dpd.req_id is the X-Request-Id";
    like $kp->{decode_node} // '', qr/^decode-[01]$/,
        "$id: prefill dpd.decode_node is a decoder's node id";
    is $d->{emu} && $d->{emu}->host, $HOST_OF{ $kp->{decode_node} // '' },
        "$id: the decode request went to the node the KV was pushed to";
    is $p->{body}{max_tokens}, 1, "$id: prefill max_tokens 1";
    is $p->{headers}{'x-request-id'}, $id, "$id: prefill X-Request-Id";
    is_deeply $d->{body}{kv_transfer_params}, {dpd => {req_id => $id}},
        "$id: decode kv_transfer_params {dpd:{req_id}}";
    is $d->{headers}{'x-request-id'}, $id, "$id: decode X-Request-Id";
    is $p->{kv}{outcome}, 'pushed', "$id: the prefill engine pushed";
    is $d->{kv}{outcome}, 'ready',
        "$id: the decoder found the KV landed (bytes verified)";
    is $d->{cached_tokens}, $BS * int(($d->{prompt_tokens} - 1) / $BS),
        "$id: cached_tokens = bs*floor((P-1)/bs)";
}

{
    my @p = recs('kva-short', $P);
    is scalar(@p), 0, 'short prompt: no prefill';
    my @d = recs('kva-short', values %D);
    is scalar(@d), 1, 'short prompt: one decode request';
    ok !exists $d[0]{body}{kv_transfer_params},
        'short prompt: no kv_transfer_params';
}

{
    my %per = map { $_ => count_requests(qr/^kva-seq-/, $D{$_}) } keys %D;
    ok $per{'decode-0'} >= 1 && $per{'decode-1'} >= 1,
        'sequential requests: both decoders chosen'
        or diag($J->encode(\%per));
}

# nothing held anywhere once the engines settle
my $deadline = time + 10;
my ($free0, $free1, $held);
while (time < $deadline) {
    ($free0, $free1) = map { $DA{$_}->free_blocks // -1 } qw(decode-0 decode-1);
    $held = ($P->kv_agent_stats || {})->{held_blocks};
    last if $free0 == 256 && $free1 == 256 && !$held;
    sleep 0.05;
}
is $free0, 256, 'decode-0 agent: every block free at the end';
is $free1, 256, 'decode-1 agent: every block free at the end';
ok !$held, 'prefill engine: no source blocks held at the end';

__DATA__

=== TEST 1: long completions prompt: KV pushed to the chosen decoder, reused
--- request eval
"POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 8})
--- more_headers
Content-Type: application/json
X-Request-Id: kva-cmpl
--- response_body_like: ^\{"id":"cmpl-kva-cmpl".*"prompt_tokens_details":\{"cached_tokens":[1-9]\d\d\}
--- response_headers_like
X-Route: disaggregated
X-Prefill-Peer: 127\.0\.0\.2:\d+
X-Decode-Peer: 127\.0\.0\.[34]:\d+
X-KV-Wait: \d+
--- no_error_log
[error]
[warn]



=== TEST 2: long chat, streamed
--- request eval
"POST /v1/chat/completions\n" . JSON::PP->new->encode({model => "m",
    messages => [{role => "user", content => $ENV{TEST_NGINX_LONG}}],
    max_tokens => 6, stream => JSON::PP::true,
    stream_options => {include_usage => JSON::PP::true}})
--- more_headers
Content-Type: application/json
X-Request-Id: kva-chat-stream
--- response_body_like: ^(data: \{"id":"chatcmpl-kva-chat-stream".*\n\n)+.*"cached_tokens":[1-9]\d\d.*\n\ndata: \[DONE\]\n\n$
--- response_headers_like
X-Route: disaggregated
--- no_error_log
[error]
[warn]



=== TEST 3: long chat, not streamed
--- request eval
"POST /v1/chat/completions\n" . JSON::PP->new->encode({model => "m",
    messages => [{role => "user", content => $ENV{TEST_NGINX_LONG}}],
    max_tokens => 4})
--- more_headers
Content-Type: application/json
X-Request-Id: kva-chat
--- response_body_like: ^\{"id":"chatcmpl-kva-chat".*"cached_tokens":[1-9]\d\d
--- response_headers_like
X-Route: disaggregated
--- no_error_log
[error]
[warn]



=== TEST 4: short prompt goes straight to a decoder
--- request eval
"POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => "a short prompt", max_tokens => 3})
--- more_headers
Content-Type: application/json
X-Request-Id: kva-short
--- response_body_like: "choices"
--- response_headers_like
X-Route: direct
X-KV-Wait:
--- no_error_log
[error]
[warn]



=== TEST 5: client kv_transfer_params are replaced by ours
--- request eval
"POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 2,
    kv_transfer_params => {dpd => {req_id => "evil",
                                   decode_node => "decode-9"}}})
--- more_headers
Content-Type: application/json
X-Request-Id: kva-client-ktp
--- response_body_like: "cached_tokens":[1-9]\d\d
--- response_headers_like
X-Route: disaggregated



=== TEST 6: idle decoders both take pinned requests
--- request eval
[map { "POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => "$_ $ENV{TEST_NGINX_LONG}", max_tokens => 1}) } 1 .. 4]
--- more_headers eval
[map { "Content-Type: application/json\nX-Request-Id: kva-seq-$_" } 1 .. 4]
--- response_body_like eval
[("cached_tokens") x 4]



=== TEST 7: metrics: the handoff counted with the KV ready, no fallback
--- request eval
["POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 2}),
 "GET /metrics"]
--- more_headers
Content-Type: application/json
X-Request-Id: kva-metrics
--- response_body_like eval
["cached_tokens",
 qr/dpd_prefill_requests_total 1\n.*dpd_fallbacks_total 0\n.*dpd_kv_handoffs_total\{transfer_params="yes"\} 1\n.*dpd_kv_handoffs_total\{transfer_params="no"\} 0\n/s]
