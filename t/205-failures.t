# Failure rules of the disaggregated path (docs/dpd.md, failure table; issue 4):
#   prefill 5xx, timeout, connection error, a reply that is not JSON or too
#   large -> dpd_fallback decode: a decoder without transfer params (route
#   "fallback", counted, warn log with the reason); dpd_fallback error: an
#   OpenAI-shaped 502/504.  Prefill 4xx -> returned to the client as is.
#   Decoder failures keep nginx's proxy_next_upstream semantics.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Pools qw(block_defaults long_body recs);
use JSON::PP ();

plan(skip_all => $_) for DPD::Pools->unavailable;
plan('no_plan');   # after the skip checks: a skip must not plan twice

# ports: $DPD_TEST_PORT_BASE (default 18600) + 50 .. 53; nothing listens
# on + 59
my $pools = DPD::Pools->start(offset => 50, time_scale => 0.01);
our @prefill = $pools->prefill;
our @decode = $pools->decode;

$ENV{TEST_NGINX_DEAD_PORT} = DPD::Pools::port_base() + 59;

my $http_config = $pools->http_config . <<'_EOC_';

    upstream dead_prefill { server 127.0.0.1:$TEST_NGINX_DEAD_PORT; }

    upstream decode_with_dead {
        dpd_balance;
        server 127.0.0.1:$TEST_NGINX_DEAD_PORT;
        server 127.0.0.4:$TEST_NGINX_EMU_PORT;
    }
_EOC_

my $config = <<'_EOC_';
    dpd_threshold 256;
    dpd_protocol nixl;
    dpd_prefill_timeout 2s;
    proxy_http_version 1.1;
    proxy_buffering off;
    add_header X-Route $dpd_route always;
    add_header X-Prefill-Status $dpd_prefill_status always;

    location /v1/ {
        dpd on;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode;
    }

    location /strict/ {
        dpd on;
        dpd_prefill_pass /_dpd_prefill;
        dpd_fallback error;
        proxy_pass http://decode/;
    }

    location /dead/ {
        dpd on;
        dpd_prefill_pass /_dpd_dead;
        proxy_pass http://decode/;
    }

    location /strictdead/ {
        dpd on;
        dpd_prefill_pass /_dpd_dead;
        dpd_fallback error;
        proxy_pass http://decode/;
    }

    location /deaddecoder/ {
        dpd on;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode_with_dead/;
        add_header X-Route $dpd_route always;
        add_header X-Tried $upstream_addr always;
    }

    location /small/ {
        dpd on;
        dpd_prefill_pass /_dpd_small;
        proxy_pass http://decode/;
    }

    location /_dpd_prefill/ {
        internal;
        subrequest_output_buffer_size 64k;
        proxy_pass http://prefill/;
    }

    location /_dpd_dead/ {
        internal;
        proxy_pass http://dead_prefill/;
    }

    location /_dpd_small/ {
        internal;
        subrequest_output_buffer_size 256;
        proxy_pass http://prefill/;
    }

    location = /metrics { dpd_metrics; }
_EOC_

# a block names its X-Request-Id (--- rid) and path (--- uri); the request
# is the long completions prompt unless the block says otherwise
block_defaults(http_config => $http_config, config => $config, timeout => 30,
               more_headers => sub {
                   "Content-Type: application/json\nX-Request-Id: "
                   . ($_[0]->rid // 'x') },
               request => sub {
                   "POST " . ($_[0]->uri // '/v1/completions') . "\n"
                   . long_body() });

sub faults {
    my (%rule) = @_;
    $_->clear_faults for @decode;
    $_->fault(%rule) for @prefill;
}

no_shuffle();
log_level('info');
run_tests();

# --- what the decoders received ----------------------------------------------

for my $id (qw(f-5xx f-timeout f-connect f-malformed f-large)) {
    my @d = recs($id, @decode);
    is scalar(@d), 1, "$id: one decode request";
    ok !exists(($d[0] || {})->{body}{kv_transfer_params}),
        "$id: the fallback decode request carries no transfer params";
}

for my $id (qw(f-strict-5xx f-strict-timeout f-strict-connect f-4xx)) {
    my @d = recs($id, @decode);
    is scalar(@d), 0, "$id: no decode request";
}

{
    my @d = recs('f-decoder-retry', @decode);
    is scalar(@d), 1, 'a decoder that fails to connect: the next one took it';
}

__DATA__

=== TEST 1: prefill 5xx -> fallback to decode only
--- init
main::faults(status => 503);
--- rid: f-5xx
--- response_body_like: "choices"
--- response_headers_like
X-Route: fallback
X-Prefill-Status: 503
--- error_log
dpd: prefill 5xx (status 503) for request "f-5xx", falling back to decode only



=== TEST 2: prefill 5xx with dpd_fallback error -> 502 OpenAI error
--- init
main::faults(status => 500);
--- rid: f-strict-5xx
--- uri: /strict/v1/completions
--- error_code: 502
--- response_body_like: ^\{"error":\{"message":"the prefill pool failed","type":"server_error","param":null,"code":502\}\}
--- response_headers
Content-Type: application/json
--- error_log
answering 502



=== TEST 3: prefill timeout -> fallback
--- init
main::faults(hang => JSON::PP::true);
--- rid: f-timeout
--- response_body_like: "choices"
--- response_headers_like
X-Route: fallback
X-Prefill-Status: 504
--- error_log
dpd: prefill of request "f-timeout" timed out
dpd: prefill timeout (status 504) for request "f-timeout", falling back to decode only



=== TEST 4: prefill timeout with dpd_fallback error -> 504 OpenAI error
--- init
main::faults(hang => JSON::PP::true);
--- rid: f-strict-timeout
--- uri: /strict/v1/completions
--- error_code: 504
--- response_body_like: ^\{"error":\{"message":"the prefill pool timed out","type":"server_error","param":null,"code":504\}\}



=== TEST 5: prefill connection refused -> fallback
--- init
main::faults();
--- rid: f-connect
--- uri: /dead/v1/completions
--- response_body_like: "choices"
--- response_headers_like
X-Route: fallback
X-Prefill-Status: 502
--- error_log
connect() failed
dpd: prefill connection error (status 502) for request "f-connect", falling back to decode only



=== TEST 6: prefill connection refused with dpd_fallback error -> 502
--- rid: f-strict-connect
--- uri: /strictdead/v1/completions
--- error_code: 502
--- response_body_like: "code":502



=== TEST 7: prefill reply not JSON -> as a 5xx: fallback
--- init
main::faults(malformed_json => JSON::PP::true);
--- rid: f-malformed
--- response_body_like: "choices"
--- response_headers_like
X-Route: fallback
X-Prefill-Status: 200
--- error_log
unusable prefill reply (status 200) for request "f-malformed": prefill reply is not a JSON object, falling back



=== TEST 8: prefill reply over subrequest_output_buffer_size -> fallback
--- init
main::faults();
--- rid: f-large
--- uri: /small/v1/completions
--- response_body_like: "choices"
--- response_headers_like
X-Route: fallback
--- error_log
too big subrequest response
unusable prefill reply (status 200) for request "f-large": prefill reply too large or broken
--- no_error_log
[alert]



=== TEST 9: prefill 4xx -> the client gets it unchanged
--- init
main::faults(status => 400);
--- rid: f-4xx
--- error_code: 400
--- response_body chomp
{"error":{"message":"emulated fault: status 400","type":"BadRequestError","param":null,"code":400}}
--- response_headers
Content-Type: application/json
--- response_headers_like
X-Route: disaggregated
X-Prefill-Status: 400
--- no_error_log
falling back



=== TEST 10: a decoder that fails (nixl, not pinned): proxy_next_upstream applies
--- init
main::faults();
--- rid: f-decoder-retry
--- uri: /deaddecoder/v1/completions
--- response_body_like: "cached_tokens":[1-9]\d\d
--- response_headers_like
X-Route: disaggregated
X-Tried: 127\.0\.0\.1:\d+, 127\.0\.0\.4:\d+
--- error_log
connect() failed



=== TEST 11: failures counted by cause
--- config
    location = /metrics { dpd_metrics; }
    location /v1/ {
        dpd on;
        dpd_threshold 256;
        dpd_prefill_pass /_dpd_prefill;
        dpd_prefill_timeout 2s;
        proxy_pass http://decode;
    }
    location /_dpd_prefill/ {
        internal;
        proxy_pass http://prefill/;
    }
--- init
main::faults(status => 502);
--- request eval
["POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 2}),
 "POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 2}),
 "GET /metrics"]
--- more_headers
Content-Type: application/json
--- response_body_like eval
["choices", "choices",
 qr/dpd_requests_total\{route="fallback",status="2xx"\} 2\n.*dpd_prefill_requests_total 2\n.*dpd_prefill_failures_total\{cause="status_5xx"\} 2\n.*dpd_fallbacks_total\{cause="prefill_5xx"\} 2\n/s]
