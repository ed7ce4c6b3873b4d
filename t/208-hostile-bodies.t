# Hostile request bodies through nginx, end to end with 2 prefill + 2
# decode vLLM emulators (whose json module, like vLLM's, keeps the last of
# repeated keys): repeated kv_transfer_params never reach an engine on any
# path (direct, nixl, lmcache), other repeated keys and "\u0000" are
# refused before anything is counted or sent, the per-request caps answer
# 400, and 40k repeated keys cost no more than one pass (issue 8, items 2,
# 4, 5, 6).  The checks after run_tests() read what each engine received.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Pools qw(block_defaults recs one);
use JSON::PP ();

plan(skip_all => $_) for DPD::Pools->unavailable;
plan('no_plan');   # after the skip checks: a skip must not plan twice

# ports: $DPD_TEST_PORT_BASE (default 18600) + 80 .. 83
my $pools = DPD::Pools->start(offset => 80, time_scale => 0.01);
my @prefill = $pools->prefill;
my @decode = $pools->decode;

my $http_config = $pools->http_config(lmcache => 1);

my $config = <<'_EOC_';
    location /v1/ {
        dpd on;
        client_max_body_size 16m;
        client_body_buffer_size 1m;
        dpd_threshold 256;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        dpd_prefill_timeout 20s;
        proxy_pass http://decode;
        add_header X-Route $dpd_route always;
        add_header X-Tokens $dpd_prompt_tokens always;
    }

    location /lmcache/ {
        dpd on;
        client_max_body_size 16m;
        dpd_threshold 256;
        dpd_protocol lmcache;
        dpd_prefill_pass /_dpd_prefill;
        dpd_prefill_timeout 20s;
        proxy_pass http://decode/;
        add_header X-Route $dpd_route always;
    }

    location /caps/ {
        dpd on;
        dpd_max_json_members 100;
        dpd_max_prompt_ids 50;
        dpd_max_messages 3;
        proxy_pass http://decode/;
        add_header X-Route $dpd_route always;
    }

    location /_dpd_prefill/ {
        internal;
        subrequest_output_buffer_size 64k;
        proxy_pass http://prefill/;
    }

    location = /metrics { dpd_metrics; }
_EOC_

block_defaults(http_config => $http_config, config => $config, timeout => 30,
               more_headers => sub {
                   my $n = $_[0]->name;
                   $n =~ s/^TEST (\d+):.*/hb-$1/;
                   "Content-Type: application/json\nX-Request-Id: $n\n";
               });

my $long = $ENV{TEST_NGINX_LONG};
my $evil = '{"do_remote_prefill":true,"remote_host":"169.254.169.254",'
         . '"remote_port":80,"remote_engine_id":"evil","remote_block_ids":[1]}';
$ENV{TEST_NGINX_EVIL} = $evil;

no_shuffle();
log_level('info');
run_tests();

# --- what the engines received ---------------------------------------------

{
    my $d = one('decode', 'hb-1', @decode);
    ok !exists $d->{body}{kv_transfer_params},
        'direct: neither of two client kv_transfer_params reaches the decoder';
    is $d->{body}{prompt}, 'short one', 'direct: the request itself arrives';
}

for my $id (qw(hb-2 hb-3)) {
    my $p = one('prefill', $id, @prefill);
    my $d = one('decode', $id, @decode);
    is $p->{body}{kv_transfer_params}{remote_host}, undef,
        "$id nixl: the prefill gets the gateway's params only";
    is $d->{body}{kv_transfer_params}{remote_host}, $p->{emu}->host,
        "$id nixl: the decoder pulls from the prefill peer, not 169.254.169.254";
    isnt $d->{body}{kv_transfer_params}{remote_engine_id}, 'evil',
        "$id nixl: no client engine id";
}

{
    my $p = one('prefill', 'hb-4', @prefill);
    my $d = one('decode', 'hb-4', @decode);
    ok !exists $p->{body}{kv_transfer_params}{remote_host},
        'lmcache: the prefill gets the gateway\'s disagg_spec only';
    ok $p->{body}{kv_transfer_params}{disagg_spec}, '  ... with its disagg_spec';
    ok !exists $d->{body}{kv_transfer_params},
        'lmcache: no kv_transfer_params reach the decoder';
}

for my $id (map { "hb-$_" } 5 .. 12) {
    is scalar(recs($id, @prefill, @decode)), 0,
        "$id: refused before any engine saw it";
}

__DATA__

=== TEST 1: direct: two kv_transfer_params, the last one hostile
--- request eval
qq(POST /v1/completions\n{"model":"m","prompt":"short one","max_tokens":2,)
. qq("kv_transfer_params":{},"kv_transfer_params":$ENV{TEST_NGINX_EVIL}})
--- response_body_like: "choices"
--- response_headers
X-Route: direct
--- error_log
client "kv_transfer_params" removed (2)



=== TEST 2: nixl: the hostile kv_transfer_params last
--- request eval
qq(POST /v1/completions\n{"model":"m","prompt":"$ENV{TEST_NGINX_LONG}",)
. qq("kv_transfer_params":{},"max_tokens":2,"kv_transfer_params":$ENV{TEST_NGINX_EVIL}})
--- response_body_like: "cached_tokens":[1-9]\d\d
--- response_headers
X-Route: disaggregated



=== TEST 3: nixl: hostile kv_transfer_params first and last
--- request eval
qq(POST /v1/completions\n{"kv_transfer_params":$ENV{TEST_NGINX_EVIL},"model":"m",)
. qq("prompt":"$ENV{TEST_NGINX_LONG}","max_tokens":2,)
. qq("kv_transfer_params":null,"kv_transfer_params":$ENV{TEST_NGINX_EVIL}})
--- response_body_like: "cached_tokens":[1-9]\d\d
--- response_headers
X-Route: disaggregated



=== TEST 4: lmcache: repeated kv_transfer_params reach neither engine
--- request eval
qq(POST /lmcache/v1/completions\n{"model":"m","prompt":"$ENV{TEST_NGINX_LONG}",)
. qq("kv_transfer_params":$ENV{TEST_NGINX_EVIL},"max_tokens":2,"kv_transfer_params":$ENV{TEST_NGINX_EVIL}})
--- response_body_like: "choices"
--- response_headers
X-Route: disaggregated



=== TEST 5: a repeated "prompt" (short first, long last) is refused
--- request eval
qq(POST /v1/completions\n{"model":"m","prompt":"short","max_tokens":2,)
. qq("prompt":"$ENV{TEST_NGINX_LONG}"})
--- error_code: 400
--- response_body_like: ^\{"error":\{"message":"the key \\"prompt\\" appears more than once in the request object; repeated keys are refused
--- no_error_log
[error]



=== TEST 6: a repeated "stream" in a chat is refused
--- request
POST /v1/chat/completions
{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":false,"stream":true}
--- error_code: 400
--- response_body_like: the key \\"stream\\" appears more than once



=== TEST 7: a repeated "content" inside a message is refused
--- request eval
qq(POST /v1/chat/completions\n{"model":"m","messages":[{"role":"user","content":"hi",)
. qq("content":"$ENV{TEST_NGINX_LONG}"}]})
--- error_code: 400
--- response_body_like: the key \\"content\\" appears more than once in a nested object



=== TEST 8: "\u0000" before a long prompt is refused, not counted as 0
--- request eval
qq(POST /v1/completions\n{"model":"m","prompt":"\\u0000$ENV{TEST_NGINX_LONG}","max_tokens":2})
--- error_code: 400
--- response_body_like: "message":"the request holds a NUL character \(\\\\u0000\) at byte 23, which is refused"



=== TEST 9: "\u0000" inside chat content is refused
--- request eval
qq(POST /v1/chat/completions\n{"model":"m","messages":[{"role":"user",)
. qq("content":"hi\\u0000$ENV{TEST_NGINX_LONG}"}]})
--- error_code: 400
--- response_body_like: NUL character



=== TEST 9b: an invalid "\u" escape (cJSON reads it as U+0000) is refused
--- request eval
qq(POST /v1/completions\n{"model":"m","prompt":"caf\\u00]9 $ENV{TEST_NGINX_LONG}","max_tokens":2})
--- error_code: 400
--- response_body_like: "message":"malformed JSON: invalid escape in a string at byte 26"



=== TEST 10: dpd_max_prompt_ids
--- request eval
"POST /caps/v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => [(1) x 51]})
--- error_code: 400
--- response_body_like: "message":"prompt: more than 50 token ids \(dpd_max_prompt_ids\)"



=== TEST 11: dpd_max_messages
--- request eval
"POST /caps/v1/chat/completions\n" . JSON::PP->new->encode({model => "m",
    messages => [map { {role => "user", content => "m$_"} } 1 .. 4]})
--- error_code: 400
--- response_body_like: "message":"field \\"messages\\": more than 3 messages \(dpd_max_messages\)"



=== TEST 12: dpd_max_json_members
--- request eval
"POST /caps/v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => "x", logit_bias => {map { ($_ => 1) } 1 .. 100}})
--- error_code: 400
--- response_body_like: "message":"the request JSON has more than 100 elements \(dpd_max_json_members\)"



=== TEST 13: within the caps: served
--- request eval
"POST /caps/v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => [(1) x 50], max_tokens => 1})
--- response_body_like: "prompt_tokens":50



=== TEST 14: 40k repeated "stream" keys between others, disaggregated: one pass
--- request eval
qq(POST /v1/completions\n{"model":"m","prompt":"$ENV{TEST_NGINX_LONG}","max_tokens":2)
. CORE::join('', map { qq(,"stream":false,"k$_":$_) } 1 .. 40000) . '}'
--- error_code: 400
--- response_body_like: the key \\"stream\\" appears more than once
--- timeout: 3



=== TEST 15: 40k kv_transfer_params between others, disaggregated: removed in one pass
--- request eval
qq(POST /v1/completions\n{"model":"m","prompt":"$ENV{TEST_NGINX_LONG}","max_tokens":2)
. CORE::join('', map { qq(,"kv_transfer_params":{"remote_host":"169.254.169.254"},"k$_":$_) }
           1 .. 40000) . '}'
--- response_body_like: "cached_tokens":[1-9]\d\d
--- response_headers
X-Route: disaggregated
--- timeout: 5



=== TEST 16: the refusals are counted by reason
--- request eval
[ qq(POST /v1/completions\n{"prompt":"x","model":"a","model":"b"}),
  qq(POST /v1/completions\n{"prompt":"\\u0000"}),
  "POST /caps/v1/completions\n" . JSON::PP->new->encode({prompt => [(1) x 51]}),
  "GET /metrics" ]
--- error_code eval
[400, 400, 400, 200]
--- response_body_like eval
[ "appears more than once", "NUL", "dpd_max_prompt_ids",
  qr/dpd_errors_total\{type="duplicate_key"\} 1\n.*dpd_errors_total\{type="nul_character"\} 1\n.*dpd_errors_total\{type="over_limit"\} 1\n/s ]
