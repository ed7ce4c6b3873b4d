# ngx_http_dpd_module: every kind of bad input gets an OpenAI-shaped JSON
# error ({"error":{"message","type","param","code"}}) with the right status,
# and never reaches the decoder.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;

my ($llama_tj) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'Llama 3 tokenizer fixture not installed (make deps)')
    unless $llama_tj;
plan('no_plan');   # after the skip checks: a skip must not plan twice

$ENV{TEST_NGINX_LLAMA3} = $llama_tj;

sub nested { my ($n) = @_; '{"prompt":"x","x":' . ('[' x ($n - 1))
                           . (']' x ($n - 1)) . '}' }

add_block_preprocessor(sub {
    my $block = shift;

    if (!defined $block->http_config) {
        $block->set_value('http_config', <<'_EOC_');
    dpd_tokenizer $TEST_NGINX_LLAMA3;
_EOC_
    }

    if (!defined $block->config) {
        $block->set_value('config', <<'_EOC_');
    location /v1/ {
        dpd on;
        client_max_body_size 2k;
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/decoder/;
    }
    location /decoder/ { return 200 "decoder reached\n"; }
_EOC_
    }

    # every rejection: JSON body, OpenAI shape
    if (!defined $block->response_headers) {
        $block->set_value('response_headers',
                          "Content-Type: application/json\n");
    }
});

no_shuffle();
log_level('info');
run_tests();

__DATA__

=== TEST 1: malformed JSON
--- request
POST /v1/completions
{"prompt": "unterminated
--- error_code: 400
--- response_body_like: ^\{"error":\{"message":"malformed JSON in the request body near byte \d+","type":"invalid_request_error","param":null,"code":400\}\}$
--- error_log
dpd: rejected request


=== TEST 2: trailing data after the JSON value
--- request
POST /v1/completions
{"prompt": "x"} {"prompt": "y"}
--- error_code: 400
--- response_body_like: unexpected data after the value


=== TEST 3: JSON that is not an object
--- request
POST /v1/completions
["x"]
--- error_code: 400
--- response_body_like: must be a JSON object


=== TEST 4: empty body
--- request
POST /v1/completions
--- more_headers
Content-Length: 0
--- error_code: 400
--- response_body_like: "message":"the request body is empty


=== TEST 5: prompt missing
--- request
POST /v1/completions
{"model": "m", "max_tokens": 3}
--- error_code: 400
--- response_body_like: field \\"prompt\\" is required


=== TEST 6: prompt of the wrong type: number
--- request
POST /v1/completions
{"prompt": 5}
--- error_code: 400
--- response_body_like: field \\"prompt\\" must be a string, an array of strings


=== TEST 7: prompt of the wrong type: object
--- request
POST /v1/completions
{"prompt": {"text": "x"}}
--- error_code: 400
--- response_body_like: field \\"prompt\\" must be a string


=== TEST 8: prompt: mixed array
--- request
POST /v1/completions
{"prompt": ["a", 1]}
--- error_code: 400
--- response_body_like: prompt\[1\]: expected a string


=== TEST 9: prompt: empty array
--- request
POST /v1/completions
{"prompt": []}
--- error_code: 400
--- response_body_like: must not be empty


=== TEST 10: prompt: non-integer token id
--- request
POST /v1/completions
{"prompt": [1, 2.5]}
--- error_code: 400
--- response_body_like: prompt\[1\]: token ids must be integers


=== TEST 11: prompt: an empty token-id array inside
--- request
POST /v1/completions
{"prompt": [[1], []]}
--- error_code: 400
--- response_body_like: prompt\[1\] must not be empty


=== TEST 12: token id out of range (= vocabulary size)
--- request
POST /v1/completions
{"prompt": [1, 128256]}
--- error_code: 400
--- response_body_like: prompt\[1\]: token id 128256 is out of range \[0, 128256\)


=== TEST 13: token id negative, in a nested array
--- request
POST /v1/completions
{"prompt": [[5, 6], [7, -1]]}
--- error_code: 400
--- response_body_like: prompt\[1\]\[1\]: token id -1 is out of range


=== TEST 14: token id huge
--- request
POST /v1/completions
{"prompt": [1e300]}
--- error_code: 400
--- response_body_like: token id 1.*e\+300 is out of range


=== TEST 15: the largest valid token id passes
--- request
POST /v1/completions
{"prompt": [0, 128255]}
--- response_headers
--- response_body
decoder reached


=== TEST 16: messages missing
--- request
POST /v1/chat/completions
{"prompt": "wrong endpoint"}
--- error_code: 400
--- response_body_like: field \\"messages\\" is required


=== TEST 17: messages of the wrong type
--- request
POST /v1/chat/completions
{"messages": "hello"}
--- error_code: 400
--- response_body_like: field \\"messages\\" must be an array


=== TEST 18: messages empty
--- request
POST /v1/chat/completions
{"messages": []}
--- error_code: 400
--- response_body_like: field \\"messages\\" must not be empty


=== TEST 19: a message that is not an object
--- request
POST /v1/chat/completions
{"messages": [{"role": "user", "content": "a"}, "b"]}
--- error_code: 400
--- response_body_like: messages\[1\] must be an object


=== TEST 20: role missing
--- request
POST /v1/chat/completions
{"messages": [{"content": "a"}]}
--- error_code: 400
--- response_body_like: messages\[0\].role: is required


=== TEST 21: content missing in a user message
--- request
POST /v1/chat/completions
{"messages": [{"role": "user"}]}
--- error_code: 400
--- response_body_like: messages\[0\].content is required


=== TEST 22: content of the wrong type
--- request
POST /v1/chat/completions
{"messages": [{"role": "user", "content": 42}]}
--- error_code: 400
--- response_body_like: messages\[0\].content: expected a string or an array of content parts


=== TEST 23: content part without a type
--- request
POST /v1/chat/completions
{"messages": [{"role": "user", "content": [{"text": "a"}]}]}
--- error_code: 400
--- response_body_like: messages\[0\].content\[0\]: expected an object with a string \\"type\\"


=== TEST 24: text part with a non-string text
--- request
POST /v1/chat/completions
{"messages": [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}]}
--- error_code: 400
--- response_body_like: messages\[0\].content\[0\].text: expected a string


=== TEST 25: assistant message with null content (tool calls) is fine
--- request
POST /v1/chat/completions
{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": null}, {"role": "user", "content": "b"}]}
--- response_headers
--- response_body
decoder reached


=== TEST 26: invalid UTF-8 inside a string
--- request eval
"POST /v1/completions\n{\"prompt\": \"caf\xe9\"}"
--- error_code: 400
--- response_body_like: "the request body is not valid UTF-8 \(byte 15\)"


=== TEST 27: invalid UTF-8: overlong encoding
--- request eval
"POST /v1/completions\n{\"prompt\": \"\xc0\xaf\"}"
--- error_code: 400
--- response_body_like: not valid UTF-8


=== TEST 28: invalid UTF-8: encoded surrogate
--- request eval
"POST /v1/completions\n{\"prompt\": \"\xed\xa0\x80\"}"
--- error_code: 400
--- response_body_like: not valid UTF-8


=== TEST 29: invalid UTF-8: truncated sequence at the end
--- request eval
"POST /v1/completions\n{\"prompt\": \"x\"}\xe2\x82"
--- error_code: 400
--- response_body_like: not valid UTF-8


=== TEST 30: valid multi-byte UTF-8 passes
--- request eval
"POST /v1/completions\n{\"prompt\": \"caf\xc3\xa9 \xe6\x9d\xb1 \xf0\x9f\x9a\x80\"}"
--- response_headers
--- response_body
decoder reached


=== TEST 31: unescaped control character in a string
--- request eval
"POST /v1/completions\n{\"prompt\": \"a\x01b\"}"
--- error_code: 400
--- response_body_like: unescaped control character


=== TEST 32: nesting at the default limit (64) passes
--- request eval
"POST /v1/completions\n" . ::nested(64)
--- response_headers
--- response_body
decoder reached


=== TEST 33: nesting deeper than the default limit
--- request eval
"POST /v1/completions\n" . ::nested(65)
--- error_code: 400
--- response_body_like: "JSON nesting deeper than 64 levels"


=== TEST 34: dpd_max_json_depth lowers the limit
--- config
    location /v1/ {
        dpd on;
        dpd_max_json_depth 3;
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/decoder/;
    }
    location /decoder/ { return 200 "decoder reached\n"; }
--- request
POST /v1/chat/completions
{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
--- error_code: 400
--- response_body_like: "JSON nesting deeper than 3 levels"


=== TEST 35: brackets inside strings do not count as nesting
--- config
    location /v1/ {
        dpd on;
        dpd_max_json_depth 2;
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/decoder/;
    }
    location /decoder/ { return 200 "decoder reached\n"; }
--- request
POST /v1/completions
{"prompt": ["[[[{{{\"]]]"]}
--- response_headers
--- response_body
decoder reached


=== TEST 36: body over client_max_body_size (Content-Length): 413, JSON
--- request eval
"POST /v1/completions\n{\"prompt\": \"" . ("a" x 3000) . "\"}"
--- error_code: 413
--- response_body
{"error":{"message":"the request body is larger than the gateway accepts (client_max_body_size)","type":"invalid_request_error","param":null,"code":413}}


=== TEST 37: body over client_max_body_size (chunked): 413, JSON
--- raw_request eval
"POST /v1/completions HTTP/1.1\r
Host: localhost\r
Connection: close\r
Transfer-Encoding: chunked\r
\r
" . sprintf("%x\r\n", 3000) . ("a" x 3000) . "\r\n0\r\n\r\n"
--- error_code: 413
--- response_body_like: ^\{"error":\{"message":"the request body is larger than the gateway accepts \(client_max_body_size\)","type":"invalid_request_error","param":null,"code":413\}\}$


=== TEST 38: a decoder failure becomes an OpenAI-shaped 502
--- config
    location /v1/ {
        dpd on;
        proxy_pass http://127.0.0.1:1/;
    }
--- request
POST /v1/completions
{"prompt": "x"}
--- error_code: 502
--- response_body_like: "type":"server_error","param":null,"code":502\}\}$
--- error_log
connect() failed


=== TEST 39: the decoder's own error bodies pass through unchanged
--- config
    location /v1/ {
        dpd on;
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/decoder/;
    }
    location /decoder/ {
        default_type text/html;
        return 503 "<p>decoder busy</p>\n";
    }
--- request
POST /v1/completions
{"prompt": "x"}
--- error_code: 503
--- response_headers
Content-Type: text/html
--- response_body
<p>decoder busy</p>


=== TEST 40: error_page configured by the user wins
--- config
    location /v1/ {
        dpd on;
        client_max_body_size 10;
        error_page 413 = @too_large;
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/decoder/;
    }
    location @too_large {
        default_type text/plain;
        return 413 "custom\n";
    }
--- request
POST /v1/completions
{"prompt": "more than ten bytes"}
--- error_code: 413
--- response_headers
Content-Type: text/plain
--- response_body
custom


=== TEST 41: client gone while sending its body: nothing sent upstream
--- raw_request eval
"POST /v1/completions HTTP/1.1\r
Host: localhost\r
Content-Length: 100\r
\r
{\"prompt\": \"only part"
--- shutdown: 1
--- ignore_response
--- error_log
client prematurely closed connection
--- no_error_log
[alert]


=== TEST 42: not refused: a custom role and an image part (text counted)
--- config
    location /v1/ {
        dpd on;
        add_header X-Dpd-Tokens $dpd_prompt_tokens always;
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/decoder/;
    }
    location /decoder/ { return 200 "decoder reached\n"; }
--- request
POST /v1/chat/completions
{"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
--- response_headers
--- response_headers_like
X-Dpd-Tokens: ^\d+$
--- response_body
decoder reached
--- error_log
text counted only (messages[
