# dpd_prefill_timeout is the deadline of the whole prefill in every state
# of its subrequest (issue 8 items 8 and 11): here while the upstream's
# name is being resolved by a resolver that never answers (a UDP socket
# that reads nothing back), so no upstream connection exists yet.  The
# deadline ends the prefill, not the peer: a peer with max_fails=1 that
# let the deadline pass is still used by the next request.  And settings
# a protocol does not use are reported at startup.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Pools qw(block_defaults long_body recs);
use IO::Socket::INET ();
use JSON::PP ();

plan(skip_all => $_) for DPD::Pools->unavailable;
plan('no_plan');   # after the skip checks: a skip must not plan twice

# ports: $DPD_TEST_PORT_BASE (default 18600) + 80 .. 83; nothing listens
# on + 88 (TCP); the silent resolver is on + 89 (UDP)
my $pools = DPD::Pools->start(offset => 80, time_scale => 0.01);
our @prefill = $pools->prefill;
our @decode = $pools->decode;

$ENV{TEST_NGINX_DEAD_PORT} = DPD::Pools::port_base() + 88;
$ENV{TEST_NGINX_DNS_PORT} = DPD::Pools::port_base() + 89;

# a resolver that takes every query and never answers
our $DNS = IO::Socket::INET->new(LocalAddr => '127.0.0.1',
                                 LocalPort => $ENV{TEST_NGINX_DNS_PORT},
                                 Proto => 'udp', ReuseAddr => 1)
    or die "udp bind: $!";

my $http_config = $pools->http_config(lmcache => 1) . <<'_EOC_';

    upstream prefill_mf {
        server 127.0.0.2:$TEST_NGINX_EMU_PORT max_fails=1 fail_timeout=60s;
        server 127.0.0.1:$TEST_NGINX_DEAD_PORT down;
    }
_EOC_

my $config = <<'_EOC_';
    dpd_threshold 256;
    dpd_prefill_timeout 1s;
    proxy_http_version 1.1;
    proxy_buffering off;
    add_header X-Route $dpd_route always;
    add_header X-Prefill-Status $dpd_prefill_status always;
    add_header X-Time $request_time always;

    location /unresolved/ {
        dpd on;
        dpd_prefill_pass /_dpd_unresolved;
        proxy_pass http://decode/;
    }

    location /strict/ {
        dpd on;
        dpd_prefill_pass /_dpd_unresolved;
        dpd_fallback error;
        proxy_pass http://decode/;
    }

    location /mf/ {
        dpd on;
        dpd_prefill_pass /_dpd_mf;
        proxy_pass http://decode/;
    }

    location /_dpd_unresolved/ {
        internal;
        resolver 127.0.0.1:$TEST_NGINX_DNS_PORT ipv6=off;
        resolver_timeout 20s;
        set $prefill_host "prefill.dpd.test";
        proxy_pass http://$prefill_host:$TEST_NGINX_DEAD_PORT;
    }

    location /_dpd_mf/ {
        internal;
        proxy_pass http://prefill_mf/;
    }
_EOC_

block_defaults(http_config => $http_config, config => $config, timeout => 40,
               more_headers => sub {
                   "Content-Type: application/json\nX-Request-Id: "
                   . ($_[0]->rid // 'x') },
               request => sub {
                   "POST " . ($_[0]->uri // '/unresolved/v1/completions')
                   . "\n" . long_body() });

sub faults {
    my (%rule) = @_;
    $_->clear_faults for @decode;
    $_->fault(%rule) for @prefill;
}

no_shuffle();
log_level('info');
run_tests();

# --- what the prefill engine saw ---------------------------------------------

for my $id (qw(dl-mf-1 dl-mf-2)) {
    my @p = recs($id, $prefill[0]);
    is scalar(@p), 1, "$id: the prefill peer got the request";
    ok $p[0] && $p[0]{aborted}, "$id: and its request was closed at the "
                                . "deadline";
}

__DATA__

=== TEST 1: resolving the prefill upstream: fallback at the deadline
--- rid: dl-resolve
--- response_body_like: "choices"
--- response_headers_like
X-Route: fallback
X-Prefill-Status: 504
X-Time: ^[0-4]\.\d+$
--- error_log
dpd: prefill of request "dl-resolve" timed out
dpd: prefill timeout (status 504) for request "dl-resolve", falling back to decode only
--- no_error_log
[alert]
could not be resolved



=== TEST 2: resolving, dpd_fallback error: 504 at the deadline
--- rid: dl-resolve-strict
--- uri: /strict/v1/completions
--- error_code: 504
--- response_body_like: "the prefill pool timed out"
--- response_headers_like
X-Time: ^[0-4]\.\d+$
--- no_error_log
[alert]



=== TEST 3: a deadline is not a failure of the peer (max_fails=1)
--- init
main::faults(hang => JSON::PP::true);
--- request eval
["POST /mf/v1/completions\n" . main::long_body(),
 "POST /mf/v1/completions\n" . main::long_body()]
--- more_headers eval
["Content-Type: application/json\nX-Request-Id: dl-mf-1",
 "Content-Type: application/json\nX-Request-Id: dl-mf-2"]
--- response_body_like eval
["choices", "choices"]
--- no_error_log
no live upstreams
[alert]



=== TEST 4: settings the protocol does not use are reported
--- config
    location /v1/ {
        dpd on;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        dpd_decode_upstream decode;
        dpd_kv_wait 3s;
        proxy_pass http://decode;
    }
    location /lm/ {
        dpd on;
        dpd_protocol lmcache;
        dpd_prefill_pass /_dpd_prefill;
        dpd_decode_upstream decode;
        dpd_kv_wait 3s;
        proxy_pass http://decode;
    }
    location /_dpd_prefill/ {
        internal;
        proxy_pass http://prefill/;
    }
--- request
GET /nothing
--- error_code: 404
--- error_log
"dpd_decode_upstream" is ignored with "dpd_protocol nixl"
"dpd_kv_wait" is ignored with "dpd_protocol nixl"
--- no_error_log
"dpd_kv_wait" is ignored with "dpd_protocol lmcache"
