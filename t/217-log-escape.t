# ngx_http_dpd_module: client text in error.log is escaped (issue 24 item 5,
# an attacker review): a request's "model" went raw into an info line, so
# a newline in it forged a line of its own ("[emerg] ..."), CR and ESC
# reached the terminal of whoever reads the log.  Now control bytes, "\"
# and bytes that are not UTF-8 are \xNN, UTF-8 stays, and the text is
# bounded: one line per rejection, no forged line.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;

my ($llama_tj) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'Llama 3 tokenizer fixture not installed (make deps)')
    unless $llama_tj;
plan('no_plan');   # after the skip checks: a skip must not plan twice

$ENV{TEST_NGINX_LLAMA3} = $llama_tj;

add_block_preprocessor(sub {
    my $block = shift;

    $block->set_value('http_config', <<'_EOC_')
    dpd_tokenizer $TEST_NGINX_LLAMA3;
_EOC_
        unless defined $block->http_config;

    $block->set_value('config', <<'_EOC_')
    location /v1/ {
        dpd on;
        dpd_model llama-3 @llama;
    }
    location @llama { dpd on; return 200 "decoder reached\n"; }
_EOC_
        unless defined $block->config;
});

no_shuffle();
log_level('info');
run_tests();

__DATA__

=== TEST 1: a model with a newline, a forged [emerg] line, ESC, CR, DEL
--- request eval
"POST /v1/completions\n"
. '{"model":"m\n2026/12/04 00:00:00 [emerg] 1#1: forged\u001b[2J\r\u007fx caf\u00e9\\\\","prompt":"hi"}'
--- error_code: 404
--- response_body_like: does not exist
--- error_log eval
qr/dpd: rejected request \S+: The model `m\\x0a2026\/12\/04 00:00:00 \[emerg\] 1#1: forged\\x1b\[2J\\x0d\\x7fx café\\x5c` does not exist\./
--- no_error_log eval
[qr/^2026\/12\/04 00:00:00 \[emerg\] 1#1: forged/, qr/\x1b|\r|\x7f/]



=== TEST 2: a NUL (JSON \u0000) in the model: refused, one escaped line
--- request eval
"POST /v1/completions\n"
. '{"model":"m\u0000\n2026/12/04 00:00:00 [emerg] 1#1: nul forged","prompt":"hi"}'
--- error_code: 400
--- response_body_like: NUL character
--- error_log
dpd: rejected request
--- no_error_log eval
[qr/^2026\/12\/04 00:00:00 \[emerg\] 1#1: nul forged/, qr/\x00/]



=== TEST 3: a 64 KB model: the line is bounded (the message quotes 128 bytes)
--- request eval
"POST /v1/completions\n"
. '{"model":"' . ('A' x 65536) . '","prompt":"hi"}'
--- error_code: 404
--- error_log eval
qr/dpd: rejected request \S+: The model `A{100,130}/
--- no_error_log eval
qr/A{200}/



=== TEST 4: a chat whose role carries a forged line
--- config
    location /v1/ {
        dpd on;
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/decoder/;
    }
    location /decoder/ { return 200 "decoder reached\n"; }
--- request eval
"POST /v1/chat/completions\n"
. '{"model":"m","messages":[{"role":"user\n2026/12/04 00:00:00 [emerg] 1#1: role forged","content":"hi"}]}'
--- no_error_log eval
[qr/^2026\/12\/04 00:00:00 \[emerg\] 1#1: role forged/]
