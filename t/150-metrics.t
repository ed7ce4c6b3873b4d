# ngx_http_dpd_module: dpd_metrics after a known sequence of requests
# (routes, status classes, errors by type, the prompt-token and decision
# time histograms), with two worker processes sharing the zone.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;

my ($llama_tj) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'Llama 3 tokenizer fixture not installed (make deps)')
    unless $llama_tj;
plan('no_plan');   # after the skip checks: a skip must not plan twice

$ENV{TEST_NGINX_LLAMA3} = $llama_tj;

sub ids { '{"prompt":[' . join(',', (100) x $_[0]) . ']}' }

# one request per connection: the two workers share them
our @SEQ = (
    "POST /v1/completions\n" . ids(3),                 # direct 2xx
    "POST /v1/completions\n" . ids(5),                 # direct 2xx
    "POST /v1/completions\n" . ids(8),                 # disaggregated 2xx
    "POST /v1/completions\n" . ids(20),                # disaggregated 2xx
    "GET /v1/models",                                  # bypass 2xx
    "POST /v1/completions\n{bad",                      # rejected 4xx
    "POST /v1/completions\n{\"prompt\":[1,999999]}",   # rejected 4xx
    "POST /v1/completions\n{\"prompt\":\"" . ('a' x 1200) . "\"}", # 413
    "POST /v1/embeddings\n{\"input\":\"x\"}",          # bypass 5xx
    "GET /metrics",
);

master_on();
workers(2);
no_shuffle();
log_level('info');
run_tests();

__DATA__

=== TEST 1: counters after a known sequence
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 8;
        client_max_body_size 1k;
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/backend/;
    }
    location /backend/ { return 200 "ok\n"; }
    location = /backend/embeddings { return 503; }
    location = /metrics { dpd_metrics; }
--- request eval
[ @::SEQ ]
--- error_code eval
[200, 200, 200, 200, 200, 400, 400, 413, 503, 200]
--- response_body_like eval
[ ("ok") x 5, ("\"code\":400") x 2, "\"code\":413",
  "503 Service Temporarily Unavailable",  # the decoder's own page
  qr/
dpd_requests_total\{route="rejected",status="2xx"\} 0
dpd_requests_total\{route="rejected",status="3xx"\} 0
dpd_requests_total\{route="rejected",status="4xx"\} 3
dpd_requests_total\{route="rejected",status="5xx"\} 0
.*
dpd_requests_total\{route="direct",status="2xx"\} 2
.*
dpd_requests_total\{route="disaggregated",status="2xx"\} 2
.*
dpd_requests_total\{route="bypass",status="2xx"\} 1
dpd_requests_total\{route="bypass",status="3xx"\} 0
dpd_requests_total\{route="bypass",status="4xx"\} 0
dpd_requests_total\{route="bypass",status="5xx"\} 1
.*
dpd_errors_total\{type="empty_body"\} 0
dpd_errors_total\{type="malformed_json"\} 1
dpd_errors_total\{type="invalid_utf8"\} 0
dpd_errors_total\{type="too_deep"\} 0
dpd_errors_total\{type="invalid_field"\} 0
dpd_errors_total\{type="token_out_of_range"\} 1
dpd_errors_total\{type="body_too_large"\} 1
.*
dpd_prompt_tokens_bucket\{le="8"\} 3
dpd_prompt_tokens_bucket\{le="16"\} 3
dpd_prompt_tokens_bucket\{le="32"\} 4
.*
dpd_prompt_tokens_bucket\{le="\+Inf"\} 4
dpd_prompt_tokens_sum 36
dpd_prompt_tokens_count 4
.*
dpd_decision_seconds_count 4
.*
dpd_prefill_requests_total 0
/s ]
