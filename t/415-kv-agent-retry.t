# dpd_protocol kv_agent and the decode-leg retry (issue 10, dpd_decode_retry):
# the pinned decoder (the one the prefill's agent pushed the KV to) answers
# 503 to the decode; the decode goes to the other decoder with a body that
# names no KV (the protocol's pin "moved" handler rebuilt it, the balancer
# made the upstream request again from it), route fallback; with
# dpd_decode_retry off the 503 reaches the client.
#
# Against real agents (router + prefill + 2 decode; tcp;ofi_rxm on
# loopback).  The decode agents are frozen while the request waits for its
# KV (dpd_kv_wait), so the test can read which decoder the prefill named
# and make that one fail before the decode is sent.
#
# Ports: emulators $DPD_KVA_EMU_PORT (default 19690) on 127.0.0.2-4,
# agents $DPD_KVA_AGENT_PORT (default 18900) .. +3.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::KvMesh;
use DPD::Pools qw(block_defaults long_body recs wait_for nginx_socket);
use JSON::PP ();
use Time::HiRes qw(sleep time);

plan(skip_all => $_) for DPD::KvMesh->unavailable;
plan('no_plan');   # after the skip checks: a skip must not plan twice

our $MESH = DPD::KvMesh->start(tmp => 'dpd-kva-t415', blocks => 256,
                               dead_after_ms => 30000);
our $PA = $MESH->agent('prefill-0');
our %DA = map { $_ => $MESH->agent($_) } qw(decode-0 decode-1);
our $P = $MESH->engine('prefill-0');
our %D = map { $_ => $MESH->engine($_) } qw(decode-0 decode-1);

my $http_config = $MESH->http_config;

my $common = <<'_EOC_';
        dpd on;
        dpd_threshold 256;
        dpd_protocol kv_agent;
        dpd_decode_upstream decode;
        dpd_prefill_pass /_dpd_prefill;
        dpd_prefill_timeout 20s;
        dpd_kv_wait 3s;
        proxy_http_version 1.1;
        proxy_buffering off;
        add_header X-Route $dpd_route always;
        add_header X-Tried $upstream_addr always;
_EOC_

my $config = <<_EOC_;
    location /v1/ {
$common
        proxy_pass http://decode;
    }

    location /off/ {
$common
        dpd_decode_retry off;
        proxy_pass http://decode/;
    }

    location /_dpd_prefill/ {
        internal;
        proxy_pass http://prefill/;
        proxy_http_version 1.1;
    }

    location = /metrics { dpd_metrics; }
_EOC_

block_defaults(http_config => $http_config, config => $config, timeout => 30,
               request => 'GET /metrics', response_body_like => 'dpd_');

our %RES;    # by request id: [status line, headers + body]

# the request waits for its KV with the decode agents frozen; the decoder
# the prefill named gets a 503 fault; then the KV wait runs out
sub pinned_fails {
    my ($path, $rid) = @_;
    $_->clear_faults for $P, values %D;
    kill 'STOP', $_->pid for values %DA;
    my $s = nginx_socket();
    my $body = long_body();
    print $s "POST $path HTTP/1.1\r\nHost: localhost\r\n"
             . "Content-Type: application/json\r\nX-Request-Id: $rid\r\n"
             . "Connection: close\r\n"
             . "Content-Length: " . length($body) . "\r\n\r\n$body";
    wait_for("$rid prefill answered",
             sub { grep { $_->{status} } $P->requests(request_id => $rid) },
             20);
    my ($p) = $P->requests(request_id => $rid);
    my $node = $p->{body}{kv_transfer_params}{dpd}{decode_node} // '';
    $D{$node}->fault(status => 503, role => 'decode', count => 1) if $D{$node};
    $RES{$rid}{pinned} = $node;
    local $/;
    $RES{$rid}{raw} = <$s> // '';
    close $s;
    kill 'CONT', $_->pid for values %DA;
    for my $a (values %DA) {
        $a->wait_final($p->{request_id}, 8);
        $a->api({verb => 'release', req_id => $p->{request_id}});
    }
    $_->clear_faults for values %D;
}

no_shuffle();
log_level('info');
run_tests();

# --- what the decoders saw --------------------------------------------------

{
    my $pinned = $RES{'kvr-on'}{pinned} // '';
    my ($other) = grep { $_ ne $pinned } keys %D;
    ok $D{$pinned}, "retry on: the prefill named a decoder ($pinned)";
    like $RES{'kvr-on'}{raw}, qr{^HTTP/1\.1 200 }, 'retry on: the client got 200';
    like $RES{'kvr-on'}{raw}, qr{\r\nX-Route: fallback\r\n},
        'retry on: route fallback';
    like $RES{'kvr-on'}{raw}, qr{"choices"}, 'retry on: an answer';
    my @p = recs('kvr-on', $D{$pinned});
    is scalar(@p), 1, 'retry on: the pinned decoder got the decode once';
    is_deeply(($p[0] || {})->{body}{kv_transfer_params},
              {dpd => {req_id => ($P->requests(request_id => 'kvr-on'))[0]
                                 ->{request_id}}},
              'retry on: the pinned decoder was asked for its KV');
    my @o = $other ? recs('kvr-on', $D{$other}) : ();
    is scalar(@o), 1, 'retry on: the other decoder got the decode once';
    ok $o[0] && !exists $o[0]{body}{kv_transfer_params},
        'retry on: rebuilt body: the other decoder is asked for no KV';
    is(($o[0] || {})->{status}, 200, 'retry on: the other decoder answered');
}

{
    my $pinned = $RES{'kvr-off'}{pinned} // '';
    like $RES{'kvr-off'}{raw}, qr{^HTTP/1\.1 503 },
        'retry off: the pinned decoder\'s 503 reached the client';
    is scalar(map { recs('kvr-off', $_) } values %D), 1,
        'retry off: one decode request only';
}

__DATA__

=== TEST 1: kv_agent: the pinned decoder answers 503: decoded on the other one, no KV named
--- init
main::pinned_fails('/v1/completions', 'kvr-on');
--- response_body_like: dpd_decode_retries_total\{outcome="ok"\} 1\n
--- error_log eval
qr/dpd: the decode pinned to 127\.0\.0\.[34]:\d+ goes to 127\.0\.0\.[34]:\d+, without the KV/
--- no_error_log
[alert]



=== TEST 2: kv_agent with dpd_decode_retry off: the 503 reaches the client
--- init
main::pinned_fails('/off/v1/completions', 'kvr-off');
--- response_body_like: dpd_decode_retries_total\{outcome="ok"\} 0\n
--- no_error_log
goes to
