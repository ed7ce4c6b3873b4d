# Every way the module ends a disaggregated request itself, on a kept-alive
# connection (issue 8 item 3).  With "Connection: close" nginx keeps the
# request for a lingering close, so an access after finalize reads memory
# that is still allocated and no checker sees it; on a kept-alive
# connection ngx_http_set_keepalive() frees the request's pool inside the
# finalize call.  Each block sends its request kept alive and a second one
# on the same connection (pipelined): the module must not touch the first
# request after finalizing it (run under TEST_NGINX_USE_VALGRIND=1 and
# `make test-asan`; a use-after-free also shows as a worker dying here).
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Pools qw(block_defaults long_body);
use JSON::PP ();

plan(skip_all => $_) for DPD::Pools->unavailable;
plan('no_plan');   # after the skip checks: a skip must not plan twice

# ports: $DPD_TEST_PORT_BASE (default 18600) + 80 .. 83; nothing listens
# on + 89
my $pools = DPD::Pools->start(offset => 80, time_scale => 0.01);
our @prefill = $pools->prefill;
our @decode = $pools->decode;

$ENV{TEST_NGINX_DEAD_PORT} = DPD::Pools::port_base() + 89;

my $http_config = $pools->http_config(lmcache => 1) . <<'_EOC_';

    upstream dead_prefill { server 127.0.0.1:$TEST_NGINX_DEAD_PORT; }
_EOC_

my $config = <<'_EOC_';
    dpd_threshold 256;
    dpd_prefill_timeout 1s;
    proxy_http_version 1.1;
    proxy_buffering off;

    location /nixl/ {
        dpd on;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode/;
    }

    location /lmcache/ {
        dpd on;
        dpd_protocol lmcache;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode/;
    }

    location /strict/ {
        dpd on;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        dpd_fallback error;
        proxy_pass http://decode/;
    }

    location /strictdead/ {
        dpd on;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_dead;
        dpd_fallback error;
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

    location = /next { return 200 "next\n"; }
_EOC_

# the request under test, kept alive, then GET /next on the same connection
block_defaults(http_config => $http_config, config => $config, timeout => 20,
               more_headers => "Content-Type: application/json\n",
               pipelined_requests => sub {
                   my $b = shift;
                   ["POST " . $b->uri . "\n" . ($b->body // long_body()),
                    "GET /next"] },
               no_error_log => "[alert]\n[emerg]\nexited on signal\n");

sub faults {
    my (%rule) = @_;
    $_->clear_faults for @decode;
    $_->fault(%rule) for @prefill;
}

no_shuffle();
log_level('info');
run_tests();

__DATA__

=== TEST 1: nixl: prefill 4xx relayed on a kept-alive connection
--- init
main::faults(status => 400);
--- uri: /nixl/v1/completions
--- error_code eval
[400, 200]
--- response_body eval
['{"error":{"message":"emulated fault: status 400","type":"BadRequestError","param":null,"code":400}}', "next\n"]



=== TEST 2: lmcache: prefill 4xx relayed on a kept-alive connection
--- init
main::faults(status => 422);
--- uri: /lmcache/v1/completions
--- error_code eval
[422, 200]
--- response_body_like eval
['"code":422', "^next\$"]



=== TEST 3: dpd_fallback error, prefill 5xx: 502 on a kept-alive connection
--- init
main::faults(status => 500);
--- uri: /strict/v1/completions
--- error_code eval
[502, 200]
--- response_body_like eval
['^\{"error":\{"message":"the prefill pool failed","type":"server_error","param":null,"code":502\}\}', "^next\$"]



=== TEST 4: dpd_fallback error, prefill timeout: 504 on a kept-alive connection
--- init
main::faults(hang => JSON::PP::true);
--- uri: /strict/v1/completions
--- error_code eval
[504, 200]
--- response_body_like eval
['"code":504', "^next\$"]



=== TEST 5: dpd_fallback error, prefill refused: 502 on a kept-alive connection
--- init
main::faults();
--- uri: /strictdead/v1/completions
--- error_code eval
[502, 200]
--- response_body_like eval
['"code":502', "^next\$"]



=== TEST 6: prefill 5xx, fallback to decode on a kept-alive connection
--- init
main::faults(status => 503);
--- uri: /nixl/v1/completions
--- error_code eval
[200, 200]
--- response_body_like eval
['"choices"', "^next\$"]



=== TEST 7: bad input rejected before the prefill, kept alive
--- init
main::faults();
--- uri: /nixl/v1/completions
--- body: {"model":"m","prompt":
--- error_code eval
[400, 200]
--- response_body_like eval
['"type":"BadRequestError"|"invalid_request_error"', "^next\$"]



=== TEST 8: disaggregated request served, kept alive
--- init
main::faults();
--- uri: /lmcache/v1/completions
--- error_code eval
[200, 200]
--- response_body_like eval
['"choices"', "^next\$"]
