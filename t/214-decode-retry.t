# Decode-leg retry (issue 10, "Decode-leg retry"; docs/dpd.md): a decoder
# that fails before the first response byte (connection refused, closed or
# reset, 502/503, no first byte within proxy_read_timeout) does not fail
# the client: the decode goes to another decoder, POST or not
# (dpd_decode_retry, default on: error timeout http_502 http_503).  A
# pinned request (lmcache) decodes elsewhere without its KV, route
# "fallback".  Never once bytes reached the client; dpd_decode_retry off,
# proxy_next_upstream off and proxy_next_upstream_tries still rule.
# Counted in dpd_decode_retries_total{outcome}.
#
# Every block starts a fresh nginx: the first choice among idle, equal
# decoders is the first server of the upstream (127.0.0.4), the one the
# block makes fail; X-Tried ($upstream_addr) shows the tries.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Pools qw(block_defaults recs long_body);
use JSON::PP ();

plan(skip_all => $_) for DPD::Pools->unavailable;
plan('no_plan');   # after the skip checks: a skip must not plan twice

# ports: $DPD_TEST_PORT_BASE (default 18600) + 120 .. 123; nothing listens
# on + 129
my $pools = DPD::Pools->start(offset => 120, time_scale => 0.01);
our @prefill = $pools->prefill;
our @decode = $pools->decode;

$ENV{TEST_NGINX_DEAD_PORT} = DPD::Pools::port_base() + 129;

my $http_config = $pools->http_config(lmcache => 1) . <<'_EOC_';

    # kept-alive connections to the pinned decoder (.5 down: every pin is .4)
    upstream decode_ka {
        dpd_balance;
        zone decode_ka 64k;
        server 127.0.0.4:$TEST_NGINX_EMU_PORT;
        server 127.0.0.5:$TEST_NGINX_EMU_PORT down;
        dpd_lmcache_ports init=$TEST_NGINX_LMC_INIT alloc=$TEST_NGINX_LMC_ALLOC;
        keepalive 4;
    }

    upstream dead_first {
        dpd_balance;
        zone dead_first 64k;
        server 127.0.0.1:$TEST_NGINX_DEAD_PORT;
        server 127.0.0.4:$TEST_NGINX_EMU_PORT;
    }
_EOC_

my $config = <<'_EOC_';
    dpd_threshold 256;
    dpd_prefill_timeout 10s;
    proxy_http_version 1.1;
    proxy_buffering off;
    proxy_read_timeout 5s;
    add_header X-Route $dpd_route always;
    add_header X-Tried $upstream_addr always;
    add_header X-Status $upstream_status always;

    location /v1/ {
        dpd on;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode;
    }

    location /deadfirst/ {
        dpd on;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://dead_first/;
    }

    location /lm/ {
        dpd on;
        dpd_protocol lmcache;
        dpd_decode_upstream decode;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode/;
    }

    location /lmka/ {
        dpd on;
        dpd_protocol lmcache;
        dpd_decode_upstream decode_ka;
        dpd_prefill_pass /_dpd_prefill;
        proxy_set_header Connection "";
        proxy_pass http://decode_ka/;
    }

    location /fast/ {
        dpd on;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        proxy_read_timeout 1s;
        proxy_pass http://decode/;
    }

    location /off/ {
        dpd on;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        dpd_decode_retry off;
        proxy_pass http://decode/;
    }

    location /lmoff/ {
        dpd on;
        dpd_protocol lmcache;
        dpd_decode_upstream decode;
        dpd_prefill_pass /_dpd_prefill;
        dpd_decode_retry off;
        proxy_pass http://decode/;
    }

    location /nextoff/ {
        dpd on;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        proxy_next_upstream off;
        proxy_pass http://decode/;
    }

    location /onetry/ {
        dpd on;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        proxy_next_upstream_tries 1;
        proxy_pass http://decode/;
    }

    location /only504/ {
        dpd on;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        dpd_decode_retry http_504;
        proxy_pass http://decode/;
    }

    location /_dpd_prefill/ {
        internal;
        proxy_pass http://prefill/;
    }

    # not a dpd location: nginx's own rules for a POST
    location /plain/ {
        proxy_pass http://decode/;
    }

    location = /metrics { dpd_metrics; }
_EOC_

our $PORT = $pools->port;

# the decode requests of this id, by decoder (".4" / ".5")
sub per_decoder {
    my ($id) = @_;
    return map { scalar recs($id, $_) } @decode;
}

# faults on the first decoder (decode role only), the others cleared
sub fail_first {
    my (%rule) = @_;
    $_->clear_faults for @prefill, @decode;
    $decode[0]->fault(role => 'decode', %rule) if %rule;
}

sub fail_all {
    my (%rule) = @_;
    $_->clear_faults for @prefill;
    $_->fault(role => 'decode', %rule) for @decode;
}

block_defaults(http_config => $http_config, config => $config, timeout => 30,
               more_headers => sub {
                   "Content-Type: application/json\nX-Request-Id: "
                   . ($_[0]->rid // 'x') },
               request => sub {
                   "POST " . ($_[0]->uri // '/v1/completions') . "\n"
                   . ($_[0]->stream ? long_body(stream => JSON::PP::true)
                                    : long_body()) });

no_shuffle();
log_level('info');
run_tests();

# --- what the decoders received ----------------------------------------------

my ($d4, $d5);

($d4, $d5) = per_decoder('r-503');
is "$d4 $d5", "1 1", 'decoder 503: the first answered 503, the second the request';
{
    my ($r) = recs('r-503', $decode[1]);
    ok(($r->{cached_tokens} // 0) > 0,
       'nixl retried: the second decoder pulled the KV from the prefill');
}

($d4, $d5) = per_decoder('r-503-stream');
is "$d4 $d5", "1 1", 'streaming, decoder 503: retried once';

($d4, $d5) = per_decoder('r-close');
is "$d4 $d5", "1 1", 'decoder closed without answering: retried once';

($d4, $d5) = per_decoder('r-reset');
is "$d4 $d5", "1 1", 'decoder reset the connection: retried once';

($d4, $d5) = per_decoder('r-hang');
is "$d4 $d5", "1 1", 'no first byte within proxy_read_timeout: retried once';

($d4, $d5) = per_decoder('r-midstream');
is "$d4 $d5", "1 0", 'bytes reached the client: no second decoder';

($d4, $d5) = per_decoder('r-off');
is "$d4 $d5", "1 0", 'dpd_decode_retry off: no second decoder';

($d4, $d5) = per_decoder('r-nextoff');
is "$d4 $d5", "1 0", 'proxy_next_upstream off: no second decoder';

($d4, $d5) = per_decoder('r-onetry');
is "$d4 $d5", "1 0", 'proxy_next_upstream_tries 1: no second decoder';

($d4, $d5) = per_decoder('r-only504');
is "$d4 $d5", "1 0", 'dpd_decode_retry http_504: a 503 is not retried';

($d4, $d5) = per_decoder('r-plain');
is "$d4 $d5", "1 0", 'not a dpd location: a POST is not sent twice';

($d4, $d5) = per_decoder('r-direct');
is "$d4 $d5", "1 1", 'direct route: retried once';

($d4, $d5) = per_decoder('r-both');
is "$d4 $d5", "1 1", 'both decoders fail: each tried once';

{
    ($d4, $d5) = per_decoder('r-pinned');
    is "$d4 $d5", "1 1", 'pinned (lmcache) decoder 503: decoded on the other';
    my ($p) = recs('r-pinned', @prefill);
    is $p->{body}{kv_transfer_params}{disagg_spec}{receiver_host}, '127.0.0.4',
        'the KV was pushed to the pinned decoder';
    my ($r) = recs('r-pinned', $decode[1]);
    is $r->{cached_tokens} // 0, 0,
        'the other decoder had none of the KV: it recomputed';
    ok !exists $r->{body}{kv_transfer_params},
        'the other decoder got no transfer params';
}

{
    ($d4, $d5) = per_decoder('r-pinned-stream');
    is "$d4 $d5", "1 1", 'pinned, streaming, decoder reset: decoded on the other';
}

{
    my @r = recs('r-ka-2', $decode[0]);
    is scalar(@r), 2, 'stale kept-alive connection to the pinned decoder: '
        . 'tried again there on a new one';
    my ($ok) = grep { ($_->{status} // 0) == 200 } @r;
    cmp_ok((($ok || {})->{cached_tokens} // 0), '>', 0,
           'and that decode found the pushed KV');
}

($d4, $d5) = per_decoder('r-lmoff');
is "$d4 $d5", "1 0", 'pinned with dpd_decode_retry off: only the pinned decoder';

__DATA__

=== TEST 1: decoder answers 503 (not streaming): the decode goes to the other decoder
--- init
main::fail_first(status => 503, count => 1);
--- rid: r-503
--- response_body_like: "cached_tokens":[1-9]\d*
--- response_headers_like
X-Route: disaggregated
X-Tried: ^127\.0\.0\.4:\d+, 127\.0\.0\.5:\d+$
X-Status: ^503, 200$
--- error_log
dpd: decode retried on 127.0.0.5:
--- no_error_log
[alert]



=== TEST 2: decoder answers 503 to a streaming request: retried, the stream is whole
--- init
main::fail_first(status => 503, count => 1);
--- rid: r-503-stream
--- stream: 1
--- response_body_like: ^data: \{.*data: \[DONE\]\n\n$
--- response_headers_like
X-Tried: ^127\.0\.0\.4:\d+, 127\.0\.0\.5:\d+$
--- no_error_log
[alert]



=== TEST 3: decoder closes the connection without answering: retried
--- init
main::fail_first(disconnect_after => 0, count => 1);
--- rid: r-close
--- response_body_like: "choices"
--- response_headers_like
X-Tried: ^127\.0\.0\.4:\d+, 127\.0\.0\.5:\d+$
--- error_log
upstream prematurely closed connection
dpd: decode retried on 127.0.0.5:



=== TEST 4: decoder resets the connection (RST): retried
--- init
main::fail_first(reset => JSON::PP::true, count => 1);
--- rid: r-reset
--- response_body_like: "choices"
--- response_headers_like
X-Tried: ^127\.0\.0\.4:\d+, 127\.0\.0\.5:\d+$
--- error_log
dpd: decode retried on 127.0.0.5:



=== TEST 5: no first byte within proxy_read_timeout: retried
--- init
main::fail_first(hang => JSON::PP::true, count => 1);
--- rid: r-hang
--- uri: /fast/v1/completions
--- response_body_like: "choices"
--- response_headers_like
X-Tried: ^127\.0\.0\.4:\d+, 127\.0\.0\.5:\d+$
--- error_log
upstream timed out
dpd: decode retried on 127.0.0.5:



=== TEST 6: connection refused (nothing listens): the next decoder
--- init
main::fail_first();
--- rid: r-refused
--- uri: /deadfirst/v1/completions
--- response_body_like: "choices"
--- response_headers_like
X-Tried: ^127\.0\.0\.1:\d+, 127\.0\.0\.4:\d+$
--- error_log
connect() failed



=== TEST 7: bytes reached the client (stream cut after 2 events): no retry
--- init
main::fail_first(disconnect_after => 2, count => 1);
--- rid: r-midstream
--- request eval
# HTTP/1.0: the body ends with the connection, a cut stream is no bad chunk
"POST /v1/completions HTTP/1.0\n" . main::long_body(stream => JSON::PP::true)
--- response_body_like: ^data: \{
--- response_headers_like
X-Tried: ^127\.0\.0\.4:\d+$
--- no_error_log
dpd: decode retried



=== TEST 8: dpd_decode_retry off: the 503 reaches the client
--- init
main::fail_first(status => 503, count => 1);
--- rid: r-off
--- uri: /off/v1/completions
--- error_code: 503
--- response_headers_like
X-Tried: ^127\.0\.0\.4:\d+$



=== TEST 9: proxy_next_upstream off wins over dpd_decode_retry
--- init
main::fail_first(status => 503, count => 1);
--- rid: r-nextoff
--- uri: /nextoff/v1/completions
--- error_code: 503



=== TEST 10: proxy_next_upstream_tries 1 bounds the retries
--- init
main::fail_first(status => 503, count => 1);
--- rid: r-onetry
--- uri: /onetry/v1/completions
--- error_code: 503



=== TEST 11: dpd_decode_retry names the conditions: http_504 only, a 503 is not retried
--- init
main::fail_first(status => 503, count => 1);
--- rid: r-only504
--- uri: /only504/v1/completions
--- error_code: 503



=== TEST 12: not a dpd location: nginx's own rules (a POST that got 503 is not sent again)
--- init
main::fail_first(status => 503, count => 1);
--- rid: r-plain
--- uri: /plain/v1/completions
--- error_code: 503



=== TEST 13: direct route (short prompt) is retried too
--- init
main::fail_first(status => 503, count => 1);
--- rid: r-direct
--- request eval
"POST /v1/completions\n" . JSON::PP->new->encode({model => "m",
    prompt => "short", max_tokens => 2})
--- response_body_like: "choices"
--- response_headers_like
X-Route: direct
X-Tried: ^127\.0\.0\.4:\d+, 127\.0\.0\.5:\d+$



=== TEST 14: every decoder fails: the last one's answer, retry counted failed
--- init
main::fail_all(status => 503, count => 1);
--- rid: r-both
--- request eval
["POST /v1/completions\n" . main::long_body(), "GET /metrics"]
--- more_headers eval
["Content-Type: application/json\nX-Request-Id: r-both", ""]
--- error_code eval
[503, 200]
--- response_body_like eval
["emulated fault", qr/dpd_decode_retries_total\{outcome="ok"\} 0\ndpd_decode_retries_total\{outcome="failed"\} 1\n/]



=== TEST 15: pinned (lmcache) decoder answers 503: decoded on the other one, without KV, route fallback
--- init
main::fail_first(status => 503, count => 1);
--- rid: r-pinned
--- uri: /lm/v1/completions
--- response_body_like: "choices"
--- response_headers_like
X-Route: fallback
X-Tried: ^127\.0\.0\.4:\d+, 127\.0\.0\.5:\d+$
--- error_log eval
qr/dpd: the decode pinned to 127\.0\.0\.4:\d+ goes to 127\.0\.0\.5:\d+, without the KV/
--- no_error_log
[alert]



=== TEST 16: pinned, streaming, decoder resets: the other decoder streams it
--- init
main::fail_first(reset => JSON::PP::true, count => 1);
--- rid: r-pinned-stream
--- uri: /lm/v1/completions
--- stream: 1
--- response_body_like: ^data: \{.*data: \[DONE\]\n\n$
--- response_headers_like
X-Route: fallback



=== TEST 17: pinned with dpd_decode_retry off: the pinned decoder only
--- init
main::fail_first(status => 503, count => 1);
--- rid: r-lmoff
--- uri: /lmoff/v1/completions
--- error_code: 503
--- response_headers_like
X-Route: disaggregated
X-Tried: ^127\.0\.0\.4:\d+$



=== TEST 18: metrics: a retry that got the answer, fallbacks
--- init
main::fail_first(status => 503, count => 1);
--- request eval
["POST /lm/v1/completions\n" . main::long_body(), "GET /metrics"]
--- more_headers eval
["Content-Type: application/json\nX-Request-Id: r-metrics", ""]
--- response_body_like eval
["choices",
 qr/dpd_requests_total\{route="fallback",status="2xx"\} 1\n.*dpd_fallbacks_total\{cause="decode_moved"\} 1\n.*dpd_decode_retries_total\{outcome="ok"\} 1\ndpd_decode_retries_total\{outcome="failed"\} 0\ndpd_decode_retries_total\{outcome="no_decoder"\} 0\ndpd_decode_retries_total\{outcome="client_closed"\} 0\n/s]



=== TEST 19: dpd_decode_retry: bad values fail nginx -t
--- config
    location / { dpd_decode_retry error http_418; }
--- must_die
--- error_log
invalid value "http_418" in "dpd_decode_retry"



=== TEST 20: dpd_decode_retry: a repeated condition fails nginx -t
--- config
    location / { dpd_decode_retry error error; }
--- must_die
--- error_log
duplicate value "error" in "dpd_decode_retry"



=== TEST 21: a pinned decoder's kept-alive connection found closed: the same decoder again, with its KV
--- init
main::fail_first();
# the second decode (on the connection the first one left open) is closed
$main::decode[0]->fault(rules => [
    {role => 'decode', delay_ms => 1, count => 1},
    {role => 'decode', disconnect_after => 0, count => 1}]);
--- request eval
["POST /lmka/v1/completions\n" . main::long_body(),
 "POST /lmka/v1/completions\n" . main::long_body()]
--- more_headers eval
["Content-Type: application/json\nX-Request-Id: r-ka-1",
 "Content-Type: application/json\nX-Request-Id: r-ka-2"]
--- response_body_like eval
["choices", "choices"]
--- response_headers_like eval
["X-Route: disaggregated", "X-Route: disaggregated\nX-Tried: ^127\\.0\\.0\\.4:\\d+, 127\\.0\\.0\\.4:\\d+\$"]
--- no_error_log
goes to
