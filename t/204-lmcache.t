# The disaggregated path with dpd_protocol lmcache, end to end through
# nginx: the decoder is chosen (least outstanding) before the prefill, the
# prefill engine pushes the KV to that decoder's LMCache ports, and the
# decode request goes to exactly that decoder.  2 prefill (127.0.0.2, .3)
# and 2 decode (127.0.0.4, .5) emulators; the decoders listen on the same
# LMCache ports at their own addresses, as pods do.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Pools qw(block_defaults recs one count_requests);
use JSON::PP ();

plan(skip_all => $_) for DPD::Pools->unavailable;
plan('no_plan');   # after the skip checks: a skip must not plan twice

# ports: $DPD_TEST_PORT_BASE (default 18600) + 40 .. 43
my $pools = DPD::Pools->start(offset => 40, time_scale => 0.01);
my @prefill = $pools->prefill;
our @decode = $pools->decode;

# keepalive on the decode pool, as in production: the pin must hold behind it
my $http_config = $pools->http_config(lmcache => 1, decode_keepalive => 8);

my $config = <<'_EOC_';
    location /v1/ {
        dpd on;
        dpd_threshold 256;
        dpd_protocol lmcache;
        dpd_prefill_pass /_dpd_prefill;
        dpd_prefill_timeout 20s;

        proxy_pass http://decode;
        proxy_http_version 1.1;
        proxy_buffering off;
        # nginx would try another decoder even for a POST: the pin must not
        proxy_next_upstream error timeout non_idempotent;

        add_header X-Route $dpd_route always;
        add_header X-Prefill-Peer $dpd_prefill_peer always;
        add_header X-Decode-Peer $dpd_decode_peer always;
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

# --- what the engines received ---------------------------------------------

for my $id (qw(lmc-cmpl lmc-chat-stream lmc-chat)) {
    my $p = one('prefill', $id, @prefill);
    my $d = one('decode', $id, @decode);
    my $spec = (($p->{body}{kv_transfer_params} || {})->{disagg_spec}) || {};
    is $spec->{req_id}, $id, "$id: disagg_spec.req_id is the request id";
    is $spec->{receiver_host}, $d->{emu}->host,
        "$id: the KV was pushed to the decoder that got the decode request";
    is_deeply $spec->{receiver_init_port}, [$pools->lmcache_init_port],
        "$id: receiver_init_port from dpd_lmcache_ports";
    is_deeply $spec->{receiver_alloc_port}, [$pools->lmcache_alloc_port],
        "$id: receiver_alloc_port from dpd_lmcache_ports";
    ok $p->{body}{kv_transfer_params}{ret_first_tok}, "$id: ret_first_tok";
    is $p->{body}{max_tokens}, 1, "$id: prefill max_tokens 1";
    ok !exists $d->{body}{kv_transfer_params},
        "$id: decode request without kv_transfer_params";
    is $d->{cached_tokens}, $d->{prompt_tokens} - 1,
        "$id: the decoder reused the pushed KV (all but the last token)";
}

{
    my @p = recs('lmc-short', @prefill);
    is scalar(@p), 0, 'short prompt: no prefill';
    my $d = one('decode', 'lmc-short', @decode);
    is $d->{cached_tokens} // 0, 0, 'short prompt: nothing cached';
}

{
    my $p = one('prefill', 'lmc-client-ktp', @prefill);
    my $d = one('decode', 'lmc-client-ktp', @decode);
    is $p->{body}{kv_transfer_params}{disagg_spec}{receiver_host}, $d->{emu}->host,
        'client disagg_spec replaced by ours';
    ok !exists $d->{body}{kv_transfer_params}, 'client params never reach the decoder';
}

{
    my @per = map { count_requests(qr/^lmc-seq-/, $_) } @decode;
    is_deeply [sort @per], [2, 2],
        'sequential lmcache requests: the choice alternates between idle decoders';
}

{
    my @d = recs('lmc-pinned-fail', @decode);
    is scalar(@d), 1, 'pinned decoder failed: no second decoder tried';
}

__DATA__

=== TEST 1: long completions prompt: pushed to the chosen decoder, cached
--- request eval
"POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 8})
--- more_headers
Content-Type: application/json
X-Request-Id: lmc-cmpl
--- response_body_like: "prompt_tokens_details":\{"cached_tokens":[1-9]\d\d\}
--- response_headers_like
X-Route: disaggregated
X-Prefill-Peer: 127\.0\.0\.[23]:\d+
X-Decode-Peer: 127\.0\.0\.[45]:\d+
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
X-Request-Id: lmc-chat-stream
--- response_body_like: ^(data: \{"id":"chatcmpl-lmc-chat-stream".*\n\n)+.*"cached_tokens":[1-9]\d\d.*\n\ndata: \[DONE\]\n\n$
--- response_headers_like
X-Route: disaggregated
--- no_error_log
[error]



=== TEST 3: long chat, not streamed
--- request eval
"POST /v1/chat/completions\n" . JSON::PP->new->encode({model => "m",
    messages => [{role => "user", content => $ENV{TEST_NGINX_LONG}}],
    max_tokens => 4})
--- more_headers
Content-Type: application/json
X-Request-Id: lmc-chat
--- response_body_like: ^\{"id":"chatcmpl-lmc-chat".*"cached_tokens":[1-9]\d\d
--- response_headers_like
X-Route: disaggregated



=== TEST 4: short prompt goes straight to a decoder
--- request eval
"POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => "a short prompt", max_tokens => 3})
--- more_headers
Content-Type: application/json
X-Request-Id: lmc-short
--- response_body_like: "choices"
--- response_headers_like
X-Route: direct



=== TEST 5: client kv_transfer_params (a disagg_spec) are replaced
--- request eval
"POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 2,
    kv_transfer_params => {ret_first_tok => JSON::PP::true,
        disagg_spec => {req_id => "x", receiver_host => "10.6.6.6",
                        receiver_init_port => [1], receiver_alloc_port => [2]}}})
--- more_headers
Content-Type: application/json
X-Request-Id: lmc-client-ktp
--- response_body_like: "cached_tokens":[1-9]\d\d
--- response_headers_like
X-Route: disaggregated



=== TEST 6: idle decoders take the pinned requests in turn
--- request eval
[map { "POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => "$_ $ENV{TEST_NGINX_LONG}", max_tokens => 1}) } 1 .. 4]
--- more_headers eval
[map { "Content-Type: application/json\nX-Request-Id: lmc-seq-$_" } 1 .. 4]
--- response_body_like eval
[("cached_tokens") x 4]



=== TEST 7: a pinned decoder that fails ends in an error, not another decoder
--- init
$_->fault(disconnect_after => 0, role => "decode") for @main::decode;
--- request eval
"POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 2})
--- more_headers
Content-Type: application/json
X-Request-Id: lmc-pinned-fail
--- error_code: 502
--- response_body_like: ^\{"error":\{.*"code":502
--- response_headers_like
X-Route: disaggregated
--- error_log
upstream prematurely closed connection
--- no_error_log
[alert]



=== TEST 8: faults cleared, metrics: handoffs counted, no fallback
--- init
$_->clear_faults for @main::decode;
--- request eval
["POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 2}),
 "GET /metrics"]
--- more_headers
Content-Type: application/json
--- response_body_like eval
["cached_tokens",
 qr/dpd_prefill_requests_total 1\n.*dpd_fallbacks_total 0\n.*dpd_kv_handoffs_total\{transfer_params="yes"\} 1\n/s]
