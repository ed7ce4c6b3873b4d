# The disaggregated path with dpd_protocol nixl, end to end through nginx:
# 2 prefill (127.0.0.2, .3) and 2 decode (127.0.0.4, .5) vLLM emulators
# speaking the NixlConnector pull protocol.  Blocks check what the client
# sees; the checks after run_tests() read what each engine received
# (/emu/stats), by X-Request-Id.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;
use DPD::Pools qw(block_defaults recs one);
use JSON::PP ();

plan(skip_all => $_) for DPD::Pools->unavailable;
plan('no_plan');   # after the skip checks: a skip must not plan twice

# ports: $DPD_TEST_PORT_BASE (default 18600) + 30 .. 33
my $pools = DPD::Pools->start(offset => 30, time_scale => 0.01);
my @prefill = $pools->prefill;
my @decode = $pools->decode;
# a prefill engine whose replies name another host (127.0.0.9, where its
# side channel really listens): the decoder must not be sent there
my $liar = DPD::Emu->start(host => '127.0.0.6', role => 'prefill',
                           $pools->emu_options,
                           args => ['--side-channel-host', '127.0.0.9']);

# $TEST_NGINX_LONG (set by DPD::Pools): ~600 prompt tokens, over the test
# threshold (256)
my $http_config = $pools->http_config(prefill_keepalive => 8) . <<'_EOC_';

    upstream liar { server 127.0.0.6:$TEST_NGINX_EMU_PORT; }
    upstream not_a_prefiller { server 127.0.0.4:$TEST_NGINX_EMU_PORT; }
_EOC_

my $config = <<'_EOC_';
    location /v1/ {
        dpd on;
        dpd_threshold 256;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        dpd_prefill_timeout 20s;

        proxy_pass http://decode;
        proxy_http_version 1.1;
        proxy_buffering off;

        add_header X-Route $dpd_route always;
        add_header X-Tokens $dpd_prompt_tokens always;
        add_header X-Prefill-Peer $dpd_prefill_peer always;
        add_header X-Prefill-Status $dpd_prefill_status always;
        add_header X-Decode-Peer $dpd_decode_peer always;
        add_header X-Req $dpd_request_id always;
    }

    location /tmpfile/ {
        dpd on;
        dpd_threshold 256;
        dpd_prefill_pass /_dpd_prefill;
        client_body_buffer_size 1k;     # the body lands in a temp file
        proxy_pass http://decode/;
        add_header X-Route $dpd_route always;
    }

    location /liar/ {
        dpd on;
        dpd_threshold 256;
        dpd_prefill_pass /_dpd_liar;
        proxy_pass http://decode/;
        add_header X-Route $dpd_route always;
    }

    location /noparams/ {
        dpd on;
        dpd_threshold 256;
        dpd_prefill_pass /_dpd_noparams;
        proxy_pass http://decode/;
        add_header X-Route $dpd_route always;
    }

    location /_dpd_prefill/ {
        internal;
        subrequest_output_buffer_size 64k;
        proxy_pass http://prefill/;
        proxy_http_version 1.1;
        proxy_set_header Connection "";     # keepalive to the prefill pool
    }

    location /_dpd_liar/ {
        internal;
        subrequest_output_buffer_size 64k;
        proxy_pass http://liar/;
    }

    location /_dpd_noparams/ {
        internal;
        subrequest_output_buffer_size 64k;
        proxy_pass http://not_a_prefiller/;
    }

    location = /metrics { dpd_metrics; }
_EOC_

block_defaults(http_config => $http_config, config => $config, timeout => 30);

no_shuffle();
log_level('info');
run_tests();

# --- what the engines received ---------------------------------------------

sub expected_cached {
    my ($prompt, $bs) = @_;
    return $bs * int(($prompt - 1) / $bs);
}

for my $id (qw(nixl-cmpl nixl-chat-stream nixl-chat nixl-tmpfile)) {
    my $p = one('prefill', $id, @prefill);
    my $d = one('decode', $id, @decode);
    is_deeply $p->{body}{kv_transfer_params},
        {do_remote_decode => JSON::PP::true, do_remote_prefill => JSON::PP::false,
         remote_engine_id => undef, remote_block_ids => undef,
         remote_host => undef, remote_port => undef},
        "$id: prefill request carries the NIXL producer params";
    is $p->{body}{max_tokens}, 1, "$id: prefill max_tokens 1";
    ok !$p->{body}{stream}, "$id: prefill not streamed";
    ok !exists $p->{body}{stream_options}, "$id: prefill without stream_options";
    my $ktp = $d->{body}{kv_transfer_params} || {};
    is $ktp->{remote_host}, $p->{emu}->host,
        "$id: decoder pulls from the prefill peer that answered";
    is $ktp->{remote_engine_id}, $p->{emu}->engine_id,
        "$id: decoder gets that peer's engine id";
    is $d->{kv}{outcome}, 'ok', "$id: KV pulled";
    is $d->{cached_tokens}, expected_cached($d->{prompt_tokens}, $d->{emu}->block_size),
        "$id: cached_tokens = the prompt minus what NIXL leaves to the decoder";
    is $d->{prompt_tokens}, $p->{prompt_tokens}, "$id: same prompt on both sides";
}

{
    my $p = one('prefill', 'nixl-chat-stream', @prefill);
    my $d = one('decode', 'nixl-chat-stream', @decode);
    ok $d->{body}{stream}, 'streaming request: decoder streams';
    is_deeply $d->{body}{stream_options}, {include_usage => JSON::PP::true},
        'streaming request: stream_options reach the decoder';
}

{
    my @p = recs('nixl-short', @prefill, $liar);
    is scalar(@p), 0, 'short prompt: no prefill request';
    my $d = one('decode', 'nixl-short', @decode);
    ok !exists $d->{body}{kv_transfer_params}, 'short prompt: plain decode request';
    is $d->{cached_tokens} // 0, 0, 'short prompt: nothing cached';
}

{
    my $p = one('prefill', 'nixl-client-ktp', @prefill);
    my $d = one('decode', 'nixl-client-ktp', @decode);
    is $p->{body}{kv_transfer_params}{remote_host}, undef,
        'client kv_transfer_params do not reach the prefill engine';
    ok !exists $p->{body}{kv_transfer_params}{remote_block_ids_evil},
        'no client key survives in the prefill params';
    is $d->{body}{kv_transfer_params}{remote_host}, $p->{emu}->host,
        'client remote_host replaced by the prefill peer';
    isnt $d->{body}{kv_transfer_params}{remote_engine_id}, 'evil-engine',
        'client engine id gone';
    ok !exists $d->{body}{kv_transfer_params}{remote_block_ids_evil},
        'no client key survives in the decode params';

    my $s = one('decode', 'nixl-client-ktp-short', @decode);
    ok !exists $s->{body}{kv_transfer_params},
        'direct path: client kv_transfer_params removed too';
}

{
    my $p = one('prefill', 'nixl-liar', $liar);
    my $d = one('decode', 'nixl-liar', @decode);
    is $d->{body}{kv_transfer_params}{remote_host}, '127.0.0.6',
        'a reply naming 127.0.0.9 still sends the decoder to 127.0.0.6';
    is $liar->counter('nixl_served_total'), 0,
        'nothing pulled from the host the reply named';
    is $d->{cached_tokens} // 0, 0, 'the decoder recomputed (no KV where it was sent)';
}

{
    my @pre = grep { ($_->{body}{kv_transfer_params} || {})->{do_remote_decode} }
              recs('nixl-noparams', @decode);
    is scalar(@pre), 1, 'the "prefill" went to an engine that returns no params';
    my @dec = grep { !($_->{body}{kv_transfer_params}) } recs('nixl-noparams', @decode);
    is scalar(@dec), 1, 'decoded anyway, without transfer params';
}

{
    # nginx's own request id when the client sends none: same on both sides
    my ($gen) = grep { !defined $_->{client_request_id}
                       && $_->{request_id} =~ /^[0-9a-f]{32}$/ }
                map { $_->requests(path => '/v1/completions') } @decode;
    ok $gen, 'generated X-Request-Id reached the decoder';
    my @p = $gen ? recs($gen->{request_id}, @prefill) : ();
    is scalar(@p), 1, 'and the same id reached the prefill engine';
}

{
    # the engines get the gateway's id, the client's as X-Client-Request-Id
    my @r = (recs('nixl-chat', @prefill), recs('nixl-chat', @decode));
    is scalar(@r), 2, 'nixl-chat: one prefill and one decode request';
    like $r[0]{request_id} // '', qr/^[0-9a-f]{32}$/,
        'nixl-chat: the engines get a generated X-Request-Id';
    is $r[1]{request_id}, $r[0]{request_id},
        'nixl-chat: the same one on both engines';
    is $r[0]{headers}{'x-client-request-id'}, 'nixl-chat',
        "nixl-chat: the client's id as X-Client-Request-Id";
}

{
    my $ids = 0;
    for my $e (@prefill, @decode) {
        $ids += grep { ($_->{headers}{authorization} // '') eq 'Bearer sk-nixl' }
                $e->requests(request_id => 'nixl-chat');
    }
    is $ids, 2, 'Authorization forwarded to the prefill and the decode engine';
}

__DATA__

=== TEST 1: long completions prompt: prefilled, decoded with the KV
--- request eval
"POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 8})
--- more_headers
Content-Type: application/json
X-Request-Id: nixl-cmpl
--- response_body_like: "prompt_tokens_details":\{"cached_tokens":[1-9]\d\d\}
--- response_headers_like
X-Route: disaggregated
X-Prefill-Peer: 127\.0\.0\.[23]:\d+
X-Prefill-Status: 200
X-Decode-Peer: 127\.0\.0\.[45]:\d+
X-Req: nixl-cmpl
--- no_error_log
[error]
[warn]



=== TEST 2: long chat, streamed: SSE from the decoder with cached usage
--- request eval
"POST /v1/chat/completions\n" . JSON::PP->new->encode({model => "m",
    messages => [{role => "user", content => $ENV{TEST_NGINX_LONG}}],
    max_tokens => 6, stream => JSON::PP::true,
    stream_options => {include_usage => JSON::PP::true}})
--- more_headers
Content-Type: application/json
X-Request-Id: nixl-chat-stream
--- response_body_like: ^(data: \{"id":"chatcmpl-[0-9a-f]{32}".*\n\n)+.*"cached_tokens":[1-9]\d\d.*\n\ndata: \[DONE\]\n\n$
--- response_headers_like
X-Route: disaggregated
Content-Type: text/event-stream.*
--- no_error_log
[error]



=== TEST 3: long chat, not streamed
--- request eval
"POST /v1/chat/completions\n" . JSON::PP->new->encode({model => "m",
    messages => [{role => "system", content => "be brief"},
                 {role => "user", content => $ENV{TEST_NGINX_LONG}}],
    max_tokens => 4})
--- more_headers
Content-Type: application/json
Authorization: Bearer sk-nixl
X-Request-Id: nixl-chat
--- response_body_like: ^\{"id":"chatcmpl-[0-9a-f]{32}".*"cached_tokens":[1-9]\d\d
--- response_headers_like
X-Route: disaggregated
--- no_error_log
[error]



=== TEST 4: short prompt goes straight to a decoder
--- request eval
"POST /v1/chat/completions\n" . JSON::PP->new->encode({model => "m",
    messages => [{role => "user", content => "hi"}], max_tokens => 3})
--- more_headers
Content-Type: application/json
X-Request-Id: nixl-short
--- response_body_like: "choices"
--- response_headers_like
X-Route: direct
--- response_headers
!X-Prefill-Peer
!X-Prefill-Status



=== TEST 5: client-supplied kv_transfer_params are stripped (long prompt)
--- request eval
"POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 2,
    kv_transfer_params => {do_remote_prefill => JSON::PP::true,
        remote_host => "10.6.6.6", remote_port => 22,
        remote_engine_id => "evil-engine", remote_block_ids => [1, 2],
        remote_block_ids_evil => [3]}})
--- more_headers
Content-Type: application/json
X-Request-Id: nixl-client-ktp
--- response_body_like: "cached_tokens":[1-9]\d\d
--- response_headers_like
X-Route: disaggregated



=== TEST 6: client-supplied kv_transfer_params are stripped (short prompt)
--- request eval
"POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => "short one", max_tokens => 2,
    kv_transfer_params => {do_remote_prefill => JSON::PP::true,
        remote_host => "10.6.6.6", remote_port => 22}})
--- more_headers
Content-Type: application/json
X-Request-Id: nixl-client-ktp-short
--- response_body_like: "choices"
--- response_headers_like
X-Route: direct



=== TEST 7: a prefill reply naming a foreign remote_host cannot redirect
--- request eval
"POST /liar/v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 2})
--- more_headers
Content-Type: application/json
X-Request-Id: nixl-liar
--- response_body_like: "choices"
--- response_headers_like
X-Route: disaggregated



=== TEST 8: a prefill reply without kv_transfer_params still decodes
--- request eval
"POST /noparams/v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 2})
--- more_headers
Content-Type: application/json
X-Request-Id: nixl-noparams
--- response_body_like: "choices"
--- response_headers_like
X-Route: fallback
--- error_log
decodes without KV transfer params (prefill reply has no kv_transfer_params)



=== TEST 9: no X-Request-Id from the client: one generated id for both
--- request eval
"POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 2})
--- more_headers
Content-Type: application/json
--- response_body_like: ^\{"id":"cmpl-[0-9a-f]{32}
--- response_headers_like
X-Route: disaggregated
X-Req: [0-9a-f]{32}



=== TEST 10: metrics count prefills and KV hand-offs
--- request eval
["POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 2}),
 "POST /noparams/v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 2}),
 "GET /metrics"]
--- more_headers
Content-Type: application/json
--- response_body_like eval
["choices", "choices",
 qr/dpd_prefill_requests_total 2\n.*dpd_kv_handoffs_total\{transfer_params="yes"\} 1\ndpd_kv_handoffs_total\{transfer_params="no"\} 1\n/s]



=== TEST 11: a body read into a temp file takes the same path
--- request eval
"POST /tmpfile/v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 3})
--- more_headers
Content-Type: application/json
X-Request-Id: nixl-tmpfile
--- response_body_like: "cached_tokens":[1-9]\d\d
--- response_headers_like
X-Route: disaggregated
--- error_log
a client request body is buffered to a temporary file
