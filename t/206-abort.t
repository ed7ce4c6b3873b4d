# A client that goes away cancels everything: during the prefill (the
# prefill subrequest's upstream request is closed, no decode request is
# made) and during the decode stream (the decoder's request is closed); the
# lmcache decoder reservation is given back either way, so the next
# requests still spread over both decoders.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Pools qw(block_defaults long_body recs count_requests wait_for
                  nginx_socket send_post);
use JSON::PP ();
use Time::HiRes qw(sleep time);

plan(skip_all => $_) for DPD::Pools->unavailable;
plan('no_plan');   # after the skip checks: a skip must not plan twice

# ports: $DPD_TEST_PORT_BASE (default 18600) + 60 .. 63
# slow decode steps (1 ms): a long answer streams for seconds
my $pools = DPD::Pools->start(offset => 60,
                              prefill => {time_scale => 0.01},
                              decode => {time_scale => 0.05});
our @prefill = $pools->prefill;
our @decode = $pools->decode;

my $http_config = $pools->http_config(lmcache => 1);

my $config = <<'_EOC_';
    dpd_threshold 256;
    dpd_prefill_timeout 30s;
    proxy_http_version 1.1;
    proxy_buffering off;

    location /v1/ {
        dpd on;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode;
    }

    location /lm/ {
        dpd on;
        dpd_protocol lmcache;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode/;
        add_header X-Decode-Peer $dpd_decode_peer always;
    }

    location /_dpd_prefill/ {
        internal;
        proxy_pass http://prefill/;
    }
_EOC_

block_defaults(http_config => $http_config, config => $config);

# send a request, wait until $ready says the stage is reached, hang up
sub abort_at {
    my ($path, $rid, $body, $ready) = @_;
    my $s = nginx_socket();
    send_post($s, $path, $rid, $body);
    my $ok = wait_for("$rid to reach its stage", $ready, 15);
    close $s;
    return $ok;
}

sub abort_during_prefill {
    my ($path, $rid) = @_;
    $_->fault(hang => JSON::PP::true) for @prefill;
    abort_at($path, $rid, long_body(), sub { scalar recs($rid, @prefill) });
    wait_for("$rid prefill aborted",
             sub { grep { $_->{aborted} } recs($rid, @prefill) });
    $_->clear_faults for @prefill;
}

sub abort_during_decode {
    my ($path, $rid) = @_;
    $_->clear_faults for @prefill;
    abort_at($path, $rid,
             long_body(max_tokens => 20000, stream => JSON::PP::true),
             sub { grep { ($_->{completion_tokens} // 0) > 0
                          || ($_->{ttft_ms} // 0) > 0 } recs($rid, @decode)
                   or (recs($rid, @decode) and sleep 0.3) });
    wait_for("$rid decode aborted",
             sub { grep { $_->{aborted} } recs($rid, @decode) });
}

no_shuffle();
log_level('info');
run_tests();

# --- what the engines saw --------------------------------------------------

for my $rid (qw(abort-nixl-prefill abort-lm-prefill)) {
    my @p = recs($rid, @prefill);
    is scalar(@p), 1, "$rid: one prefill request";
    ok $p[0] && $p[0]{aborted}, "$rid: the prefill request was cancelled";
    is scalar(recs($rid, @decode)), 0, "$rid: no decode request was made";
}

for my $rid (qw(abort-nixl-decode abort-lm-decode)) {
    my @d = recs($rid, @decode);
    is scalar(@d), 1, "$rid: one decode request";
    ok $d[0] && $d[0]{aborted}, "$rid: the decode request was cancelled";
    ok $d[0] && ($d[0]{completion_tokens} // 0) < 20000,
        "$rid: the decoder stopped early";
}

for my $set (['after-prefill-abort', 'lm-a'], ['after-decode-abort', 'lm-b']) {
    my ($what, $prefix) = @$set;
    my @per = map { count_requests(qr/^$prefix-/, $_) } @decode;
    is_deeply [sort @per], [2, 2],
        "$what: the decoder reservation was released, both decoders used";
}

__DATA__

=== TEST 1: nixl: client gone during the prefill
--- init
main::abort_during_prefill('/v1/completions', 'abort-nixl-prefill');
--- request
GET /nothing
--- error_code: 404
--- error_log
client prematurely closed connection, so upstream connection is closed too
--- no_error_log
[alert]



=== TEST 2: nixl: client gone during the decode stream
--- init
main::abort_during_decode('/v1/completions', 'abort-nixl-decode');
--- request
GET /nothing
--- error_code: 404
--- error_log eval
qr/client prematurely closed connection|\(\) failed \((?:32|104): /
--- no_error_log
[alert]



=== TEST 3: lmcache: client gone during the prefill, reservation released
--- init
main::abort_during_prefill('/lm/v1/completions', 'abort-lm-prefill');
--- request eval
[map { "POST /lm/v1/completions\n" . main::long_body() } 1 .. 4]
--- more_headers eval
[map { "Content-Type: application/json\nX-Request-Id: lm-a-$_" } 1 .. 4]
--- response_body_like eval
[("cached_tokens") x 4]
--- no_error_log
[alert]



=== TEST 4: lmcache: client gone during the decode, reservation released
--- init
main::abort_during_decode('/lm/v1/completions', 'abort-lm-decode');
--- request eval
[map { "POST /lm/v1/completions\n" . main::long_body() } 1 .. 4]
--- more_headers eval
[map { "Content-Type: application/json\nX-Request-Id: lm-b-$_" } 1 .. 4]
--- response_body_like eval
[("cached_tokens") x 4]
--- no_error_log
[alert]
