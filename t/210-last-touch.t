# Every way the module answers a request itself ends with the phase engine
# finalizing it, and nothing touches the request after that (issue 8 item
# 3).  Each case runs on a keep-alive connection: nginx frees the request
# the moment it is answered (ngx_http_set_keepalive), which is where a read
# or write through it shows under valgrind (TEST_NGINX_USE_VALGRIND=1); a
# second request on the same connection proves it survived.  Cases: a
# prefill 4xx relayed, dpd_fallback error after a prefill 5xx, a prefill
# timeout, a refused connection and no live decoder to pin (lmcache), and
# a request rejected as bad input.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Pools qw(block_defaults long_body nginx_socket send_post);
use JSON::PP ();

plan(skip_all => $_) for DPD::Pools->unavailable;
plan('no_plan');   # after the skip checks: a skip must not plan twice

# ports: $DPD_TEST_PORT_BASE (default 18600) + 90 .. 93; nothing listens
# on + 99
my $pools = DPD::Pools->start(offset => 90, time_scale => 0.01);
our @prefill = $pools->prefill;
our @decode = $pools->decode;

$ENV{TEST_NGINX_DEAD_PORT} = DPD::Pools::port_base() + 99;

my $http_config = $pools->http_config(lmcache => 1) . <<'_EOC_';

    upstream dead_prefill { server 127.0.0.1:$TEST_NGINX_DEAD_PORT; }

    upstream no_decoder {
        dpd_balance;
        dpd_lmcache_ports init=1 alloc=2;
        server 127.0.0.1:$TEST_NGINX_DEAD_PORT down;
    }
_EOC_

my $config = <<'_EOC_';
    dpd_threshold 256;
    dpd_prefill_timeout 1s;
    proxy_http_version 1.1;
    proxy_buffering off;
    keepalive_timeout 60s;

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

    location /strictdead/ {
        dpd on;
        dpd_prefill_pass /_dpd_dead;
        dpd_fallback error;
        proxy_pass http://decode/;
    }

    location /nodecoder/ {
        dpd on;
        dpd_protocol lmcache;
        dpd_decode_upstream no_decoder;
        dpd_prefill_pass /_dpd_prefill;
        dpd_fallback error;
        proxy_pass http://no_decoder/;
    }

    location /_dpd_prefill/ {
        internal;
        proxy_pass http://prefill/;
    }

    location /_dpd_dead/ {
        internal;
        proxy_pass http://dead_prefill/;
    }
_EOC_

block_defaults(http_config => $http_config, config => $config, timeout => 30,
               request => "GET /nothing", error_code => 404);

our %GOT;

sub read_response {
    my ($s) = @_;
    my ($head, $body) = ('', '');
    local $SIG{ALRM} = sub { die "timeout\n" };
    alarm 60;
    eval {
        while ($head !~ /\r\n\r\n/) {
            my $n = sysread($s, my $buf, 1) or last;
            $head .= $buf;
        }
        my ($len) = $head =~ /^Content-Length:\s*(\d+)/mi;
        while (defined $len && length($body) < $len) {
            my $n = sysread($s, my $buf, $len - length $body) or last;
            $body .= $buf;
        }
    };
    alarm 0;
    my ($status) = $head =~ m{^HTTP/1\.1 (\d+)};
    return {status => $status // 0, head => $head, body => $body};
}

# the request on a keep-alive connection, then GET /nothing on it
sub keepalive_pair {
    my ($path, $rid, $body) = @_;
    my $s = nginx_socket();
    send_post($s, $path, $rid, $body // long_body());
    my $first = read_response($s);
    print $s "GET /nothing HTTP/1.1\r\nHost: localhost\r\n"
             . "Connection: close\r\n\r\n";
    my $second = read_response($s);
    close $s;
    $GOT{$rid} = [$first, $second];
}

sub faults {
    my (%rule) = @_;
    $_->clear_faults for @decode;
    $_->fault(%rule) for @prefill;
}

no_shuffle();
log_level('info');
run_tests();

# --- what the clients got ----------------------------------------------------

my %want = (
    'lt-4xx'         => [400, qr/^\{"error":\{"message":"emulated fault: status 400"/],
    'lt-strict-5xx'  => [502, qr/"message":"the prefill pool failed"/],
    'lt-strict-time' => [504, qr/"message":"the prefill pool timed out"/],
    'lt-strict-conn' => [502, qr/"message":"the prefill pool failed"/],
    'lt-no-decoder'  => [502, qr/"message":"the prefill pool failed"/],
    'lt-rejected'    => [400, qr/"type":"invalid_request_error"/],
);

for my $rid (sort keys %want) {
    my ($first, $second) = @{ $GOT{$rid} || [{}, {}] };
    is $first->{status}, $want{$rid}[0], "$rid: status";
    like $first->{body} // '', $want{$rid}[1], "$rid: body";
    unlike $first->{head} // '', qr/^Connection: close/mi,
        "$rid: the connection is kept alive";
    is $second->{status}, 404, "$rid: the next request on the connection";
}

__DATA__

=== TEST 1: a prefill 4xx relayed on a keep-alive connection
--- init
main::faults(status => 400);
main::keepalive_pair('/v1/completions', 'lt-4xx');
--- no_error_log
[alert]
[crit]



=== TEST 2: dpd_fallback error after a prefill 5xx
--- init
main::faults(status => 500);
main::keepalive_pair('/strict/v1/completions', 'lt-strict-5xx');
--- no_error_log
[alert]
[crit]



=== TEST 3: dpd_fallback error after a prefill timeout
--- init
main::faults(hang => JSON::PP::true);
main::keepalive_pair('/strict/v1/completions', 'lt-strict-time');
main::faults();
--- error_log
dpd: prefill of request "lt-strict-time" timed out
--- no_error_log
[alert]
[crit]



=== TEST 4: dpd_fallback error after a refused connection
--- init
main::faults();
main::keepalive_pair('/strictdead/v1/completions', 'lt-strict-conn');
--- error_log
connect() failed
--- no_error_log
[alert]
[crit]



=== TEST 5: dpd_fallback error, no live decoder to pin (lmcache)
--- init
main::keepalive_pair('/nodecoder/v1/completions', 'lt-no-decoder');
--- error_log
no live decoder to pin
--- no_error_log
[alert]
[crit]



=== TEST 6: a request rejected as bad input
--- init
main::keepalive_pair('/v1/completions', 'lt-rejected', '{"model":"m"}');
--- error_log
dpd: rejected request lt-rejected
--- no_error_log
[alert]
[crit]
