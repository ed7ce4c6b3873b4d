# ngx_http_dpd_module: the routing decision in observe mode (no prefill
# pool: every request goes direct, the decision is still made, logged and
# visible in $dpd_route), the threshold boundary, bypassed requests,
# X-Request-Id, and client kv_transfer_params removed on the direct path.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;
use JSON::PP ();

my ($llama_tj) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'tokenizer fixtures or build/libdpdtok.so missing '
                 . '(make deps && make)')
    unless $llama_tj && DPD::Emu->have_tokenizer_lib;
plan('no_plan');   # after the skip checks: a skip must not plan twice

my $base = $ENV{DPD_CORE_EMU_PORT} || 18500;
my $JSON = JSON::PP->new->utf8->canonical;

our $emu = DPD::Emu->start(port => $base + 10,
                           side_channel_port => $base + 11,
                           tokenizer => 'llama3', args => ['--no-lmcache'],
                           default_max_tokens => 2);

$ENV{TEST_NGINX_LLAMA3} = $llama_tj;
$ENV{TEST_NGINX_EMU} = $emu->addr;

our $CHAT = $JSON->encode({ messages => [
    { role => 'system', content => 'You are a helpful assistant.' },
    { role => 'user', content => 'Summarize the plot of Hamlet.' } ] });

our $N = do {
    my $r = $emu->post_json('/v1/chat/completions', $CHAT);
    die "emulator: " . $r->status_line . "\n" unless $r->is_success;
    $JSON->decode($r->content)->{usage}{prompt_tokens};
};

$ENV{TEST_NGINX_CHAT_N} = $N;
$ENV{TEST_NGINX_CHAT_N1} = $N + 1;

sub ids { '{"prompt":[' . join(',', (100) x $_[0]) . ']}' }

add_block_preprocessor(sub {
    my $block = shift;

    if (!defined $block->http_config) {
        $block->set_value('http_config', <<'_EOC_');
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    upstream emu { server $TEST_NGINX_EMU; }
_EOC_
    }
});

no_shuffle();
log_level('info');
run_tests();

# after the blocks: what the emulator received

my $rec = $emu->last_request(request_id => 'strip-1');
ok($rec, 'stripped request reached the decoder');
ok($rec && !exists $rec->{body}{kv_transfer_params},
   'client kv_transfer_params removed before proxy_pass');
is($rec && $rec->{body}{prompt}, 'keep the rest',
   'the rest of the body forwarded');

$rec = $emu->last_request(request_id => 'keep-1');
is($rec && $rec->{headers}{'x-client-request-id'}, 'keep-1',
   "client's X-Request-Id forwarded upstream as X-Client-Request-Id");
like($rec && $rec->{headers}{'x-request-id'}, qr/^[0-9a-f]{32}$/,
   'the X-Request-Id the engine gets is generated');

__DATA__

=== TEST 1: threshold boundary with token ids: N-1 direct
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 8;
        add_header X-Dpd-Route $dpd_route always;
        add_header X-Dpd-Tokens $dpd_prompt_tokens always;
        proxy_pass http://emu;
    }
--- request eval
"POST /v1/completions\n" . ::ids(7)
--- response_headers
X-Dpd-Route: direct
X-Dpd-Tokens: 7
--- error_log
dpd observe: request
7 prompt tokens, threshold 8: direct (sent direct: no dpd_prefill_pass)


=== TEST 2: threshold boundary with token ids: N disaggregated (observed)
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 8;
        add_header X-Dpd-Route $dpd_route always;
        add_header X-Dpd-Tokens $dpd_prompt_tokens always;
        proxy_pass http://emu;
    }
--- request eval
"POST /v1/completions\n" . ::ids(8)
--- response_headers
X-Dpd-Route: disaggregated
X-Dpd-Tokens: 8
--- response_body_like: "prompt_tokens":8,
--- error_log
8 prompt tokens, threshold 8: disaggregated (sent direct: no dpd_prefill_pass)


=== TEST 3: default threshold 4096: 4095 tokens direct
--- config
    location /v1/ {
        dpd on;
        add_header X-Dpd-Route $dpd_route always;
        proxy_pass http://emu;
    }
--- request eval
"POST /v1/completions\n" . ::ids(4095)
--- response_headers
X-Dpd-Route: direct
--- response_body_like: "prompt_tokens":4095,


=== TEST 4: default threshold 4096: 4096 tokens disaggregated
--- config
    location /v1/ {
        dpd on;
        add_header X-Dpd-Route $dpd_route always;
        proxy_pass http://emu;
    }
--- request eval
"POST /v1/completions\n" . ::ids(4096)
--- response_headers
X-Dpd-Route: disaggregated
--- response_body_like: "prompt_tokens":4096,


=== TEST 5: chat at the boundary: threshold = its count -> disaggregated
--- config
    location /v1/ {
        dpd on;
        dpd_threshold $TEST_NGINX_CHAT_N;
        add_header X-Dpd-Route $dpd_route always;
        proxy_pass http://emu;
    }
--- request eval
"POST /v1/chat/completions\n$::CHAT"
--- response_headers
X-Dpd-Route: disaggregated


=== TEST 6: chat at the boundary: threshold = its count + 1 -> direct
--- config
    location /v1/ {
        dpd on;
        dpd_threshold $TEST_NGINX_CHAT_N1;
        add_header X-Dpd-Route $dpd_route always;
        proxy_pass http://emu;
    }
--- request eval
"POST /v1/chat/completions\n$::CHAT"
--- response_headers
X-Dpd-Route: direct


=== TEST 7: dpd_threshold 0: always disaggregate
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 0;
        add_header X-Dpd-Route $dpd_route always;
        proxy_pass http://emu;
    }
--- request eval
"POST /v1/completions\n" . ::ids(1)
--- response_headers
X-Dpd-Route: disaggregated


=== TEST 8: regex location as in the README; the URI suffix decides
--- config
    location ~ ^/v1/(chat/)?completions$ {
        dpd on;
        add_header X-Dpd-Route $dpd_route always;
        add_header X-Dpd-Tokens $dpd_prompt_tokens always;
        proxy_pass http://emu;
    }
--- request eval
"POST /v1/chat/completions\n$::CHAT"
--- response_headers eval
["X-Dpd-Route: direct", "X-Dpd-Tokens: $::N"]


=== TEST 9: other paths pass untouched (bypass): no id added, no count
--- config
    location /v1/ {
        dpd on;
        add_header X-Dpd-Route $dpd_route always;
        add_header X-Dpd-Tokens $dpd_prompt_tokens always;
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/echo$uri;
    }
    location /echo/ {
        return 200 "rid=[$http_x_request_id] len=$http_content_length\n";
    }
--- request
POST /v1/embeddings
{"input": "not counted"}
--- response_headers
X-Dpd-Route: bypass
X-Dpd-Tokens:
--- response_body
rid=[] len=24


=== TEST 10: other methods pass untouched: GET /v1/models
--- config
    location /v1/ {
        dpd on;
        add_header X-Dpd-Route $dpd_route always;
        proxy_pass http://emu;
    }
--- request
GET /v1/models
--- response_headers
X-Dpd-Route: bypass
--- response_body_like: "object":"list"


=== TEST 11: GET on an inference path is not inspected either
--- config
    location /v1/ {
        dpd on;
        add_header X-Dpd-Route $dpd_route always;
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/echo$uri;
    }
    location /echo/ { return 200 "method=$request_method\n"; }
--- request
GET /v1/completions
--- response_headers
X-Dpd-Route: bypass
--- response_body
method=GET


=== TEST 12: X-Request-Id generated (32 hex digits) and forwarded
--- config
    location /v1/ {
        dpd on;
        add_header X-Dpd-Id $dpd_request_id always;
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/echo$uri;
    }
    location /echo/ { return 200 "rid=$http_x_request_id\n"; }
--- request
POST /v1/completions
{"prompt": "hi"}
--- response_headers_like
X-Dpd-Id: ^[0-9a-f]{32}$
--- response_body_like: ^rid=[0-9a-f]{32}\n$


=== TEST 13: the client's X-Request-Id is kept and forwarded
--- config
    location /v1/ {
        dpd on;
        add_header X-Dpd-Id $dpd_request_id always;
        proxy_pass http://emu;
    }
--- request
POST /v1/completions
{"prompt": "hi"}
--- more_headers
X-Request-Id: keep-1
--- response_headers
X-Dpd-Id: keep-1


=== TEST 14: an unusable client X-Request-Id is replaced (logged)
--- config
    location /v1/ {
        dpd on;
        add_header X-Dpd-Id $dpd_request_id always;
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/echo$uri;
    }
    location /echo/ { return 200 "rid=$http_x_request_id\n"; }
--- request
POST /v1/completions
{"prompt": "hi"}
--- more_headers
X-Request-Id: has "quotes"
--- response_headers_like
X-Dpd-Id: ^[0-9a-f]{32}$
--- response_body_like: ^rid=[0-9a-f]{32}\n$
--- error_log
dpd: unusable client X-Request-Id


=== TEST 15: client kv_transfer_params are removed on the direct path
--- config
    location /v1/ {
        dpd on;
        add_header X-Dpd-Route $dpd_route always;
        proxy_pass http://emu;
    }
--- request
POST /v1/completions
{"prompt": "keep the rest", "kv_transfer_params": {"do_remote_prefill": true, "remote_host": "10.9.9.9", "remote_port": 1, "remote_engine_id": "x", "remote_block_ids": [1]}}
--- more_headers
X-Request-Id: strip-1
--- response_headers
X-Dpd-Route: direct
--- response_body_like: "prompt_tokens":3,
--- error_log
client "kv_transfer_params" removed


=== TEST 16: dpd off: nothing read, nothing counted
--- config
    location /v1/ {
        dpd off;
        add_header X-Dpd-Route $dpd_route always;
        proxy_pass http://emu;
    }
--- request
POST /v1/completions
{"prompt": "hi"}
--- response_headers
X-Dpd-Route:
--- no_error_log
dpd observe


=== TEST 17: decision variables survive an internal redirect (error_page)
--- config
    location /v1/ {
        dpd on;
        proxy_pass http://127.0.0.1:1/;
        proxy_intercept_errors on;
        error_page 502 = @fallback;
    }
    location @fallback {
        return 200 "route=$dpd_route tokens=$dpd_prompt_tokens id=$dpd_request_id\n";
    }
--- request eval
"POST /v1/completions\n" . ::ids(9)
--- more_headers
X-Request-Id: redirect-1
--- response_body
route=direct tokens=9 id=redirect-1
--- error_log
connect() failed



=== TEST 18: engines get only the generated X-Request-Id, the client its own
--- config
    location /v1/ {
        dpd on;
        add_header X-Kv-Id $dpd_kv_request_id always;
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/echo$uri;
    }
    location /echo/ {
        # an engine that echoes X-Request-Id (vLLM's
        # --enable-request-id-headers)
        add_header X-Request-Id $http_x_request_id;
        return 200 "rid=$http_x_request_id cid=$http_x_client_request_id\n";
    }
--- request
POST /v1/completions
{"prompt": "hi"}
--- more_headers
X-Request-Id: echo-1
X-Request-Id: evil-2
--- response_headers_like
X-Request-Id: ^echo-1$
X-Kv-Id: ^[0-9a-f]{32}$
--- response_body_like: ^rid=[0-9a-f]{32} cid=echo-1
