# A client that goes away cancels everything: during the prefill (the
# prefill subrequest's upstream request is closed, no decode request is
# made) and during the decode stream (the decoder's request is closed); the
# lmcache decoder reservation is given back either way, so the next
# requests still spread over both decoders.
use strict;
use warnings;

use Test::Nginx::Socket 'no_plan';
use DPD::Emu;
use IO::Socket::INET ();
use JSON::PP ();
use Time::HiRes qw(sleep time);

my ($tj, $tc) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'Llama 3 tokenizer fixture not installed (make deps)')
    unless $tj && $tc;
plan(skip_all => 'build/libdpdtok.so missing (make)')
    unless DPD::Emu->have_tokenizer_lib;

my $base = $ENV{DPD_TEST_PORT_BASE} || 18600;
my $port = $base + 60;
my %emu = (port => $port, side_channel_port => $base + 61,
           lmcache_init_port => $base + 62, lmcache_alloc_port => $base + 63,
           tokenizer => 'llama3', kv_hold_timeout => 30);

our @prefill = DPD::Emu->start_many(count => 2, first => 2, role => 'prefill',
                                    time_scale => 0.01, %emu);
# slow decode steps (1 ms): a long answer streams for seconds
our @decode = DPD::Emu->start_many(count => 2, first => 4, role => 'decode',
                                   time_scale => 0.05, %emu);

$ENV{TEST_NGINX_LLAMA3} = $tj;
$ENV{TEST_NGINX_LLAMA3_CONFIG} = $tc;
$ENV{TEST_NGINX_EMU_PORT} = $port;
$ENV{TEST_NGINX_LMC_INIT} = $base + 62;
$ENV{TEST_NGINX_LMC_ALLOC} = $base + 63;
$ENV{TEST_NGINX_LONG} = join ' ', ('the quick brown fox jumps over the lazy dog') x 60;

my $http_config = <<'_EOC_';
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;

    upstream prefill {
        dpd_balance;
        zone prefill 64k;
        server 127.0.0.2:$TEST_NGINX_EMU_PORT;
        server 127.0.0.3:$TEST_NGINX_EMU_PORT;
    }

    upstream decode {
        dpd_balance;
        zone decode 64k;
        server 127.0.0.4:$TEST_NGINX_EMU_PORT;
        server 127.0.0.5:$TEST_NGINX_EMU_PORT;
        dpd_lmcache_ports init=$TEST_NGINX_LMC_INIT alloc=$TEST_NGINX_LMC_ALLOC;
    }
_EOC_

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

add_block_preprocessor(sub {
    my $block = shift;
    $block->set_value('http_config', $http_config)
        unless defined $block->http_config;
    $block->set_value('config', $config) unless defined $block->config;
});

sub body {
    my (%o) = @_;
    return JSON::PP->new->encode({model => 'm', prompt => $ENV{TEST_NGINX_LONG},
                                  max_tokens => 2, %o});
}

sub wait_for {
    my ($what, $cond, $timeout) = @_;
    my $deadline = time + ($timeout || 10);
    while (time < $deadline) {
        return 1 if $cond->();
        sleep 0.05;
    }
    Test::More::diag("timed out waiting for $what");
    return 0;
}

# send a request, wait until $ready says the stage is reached, hang up
sub abort_at {
    my ($path, $rid, $body, $ready) = @_;
    my $s;
    # nginx may still be starting (valgrind)
    wait_for('nginx to listen', sub {
        $s = IO::Socket::INET->new(PeerAddr => '127.0.0.1',
                                   PeerPort => server_port(), Timeout => 5);
    }, 20) or die "connect: $!";
    print $s "POST $path HTTP/1.1\r\nHost: localhost\r\n"
           . "Content-Type: application/json\r\nX-Request-Id: $rid\r\n"
           . "Content-Length: " . length($body) . "\r\n\r\n$body";
    my $ok = wait_for("$rid to reach its stage", $ready, 15);
    close $s;
    return $ok;
}

sub recs {
    my ($id, @emus) = @_;
    return map { $_->requests(request_id => $id) } @emus;
}

sub abort_during_prefill {
    my ($path, $rid) = @_;
    $_->fault(hang => JSON::PP::true) for @prefill;
    abort_at($path, $rid, body(), sub { scalar recs($rid, @prefill) });
    wait_for("$rid prefill aborted",
             sub { grep { $_->{aborted} } recs($rid, @prefill) });
    $_->clear_faults for @prefill;
}

sub abort_during_decode {
    my ($path, $rid) = @_;
    $_->clear_faults for @prefill;
    abort_at($path, $rid, body(max_tokens => 20000, stream => JSON::PP::true),
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
    my %per = map { my $d = $_;
                    ($d->host => scalar grep { $_->{request_id} =~ /^$prefix-/ }
                                 $d->requests) } @decode;
    is_deeply [sort values %per], [2, 2],
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
[map { "POST /lm/v1/completions\n" . main::body() } 1 .. 4]
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
[map { "POST /lm/v1/completions\n" . main::body() } 1 .. 4]
--- more_headers eval
[map { "Content-Type: application/json\nX-Request-Id: lm-b-$_" } 1 .. 4]
--- response_body_like eval
[("cached_tokens") x 4]
--- no_error_log
[alert]
