# dpd_protocol kv_agent: the KV-wait metrics.  Every kv_agent handoff
# counts once in dpd_kv_wait_total{outcome=...}; the waits that polled the
# state table (ready, failed, timeout) are also observed in the histogram
# dpd_kv_wait_seconds.  One prefill and one decode emulator, each in front
# of a real kv_agent (tcp;ofi_rxm on loopback), a router agent whose state
# table nginx reads, and a decoder without agent or node record.  The
# decode agent is frozen (SIGSTOP) from TEST 5 on: the KV never lands.
#
# Ports: emulators $DPD_KVW_EMU_PORT (default 19720) on 127.0.0.2-4,
# agents $DPD_KVW_AGENT_PORT (default 18950) .. +2.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;
use DPD::KvAgent;
use File::Temp qw(tempdir);
use JSON::PP ();
use Time::HiRes qw(sleep time);
use HTTP::Tiny;
use IO::Socket::INET;
use DPD::Pools ();

if (my ($why) = DPD::KvAgent->unavailable('tcp;ofi_rxm')) {
    plan(skip_all => $why);
}
my ($tj, $tc) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'Llama 3 tokenizer fixture not installed (make deps)')
    unless $tj && $tc;
plan(skip_all => 'build/libdpdtok.so missing (make)')
    unless DPD::Emu->have_tokenizer_lib;
plan('no_plan');   # after the skip checks: a skip must not plan twice

my $J = JSON::PP->new->utf8->canonical;
my $eport = $ENV{DPD_KVW_EMU_PORT} || 19720;
my $aport = $ENV{DPD_KVW_AGENT_PORT} || 18950;
my $dir = tempdir('dpd-kvw-XXXXXX', TMPDIR => 1,
                  CLEANUP => !$ENV{DPD_KEEP_TMP});

my %HTTP = ('prefill-0' => "127.0.0.2:$eport",
            'decode-0' => "127.0.0.3:$eport");
my %CTRL = ('router-0' => "127.0.0.1:$aport",
            'prefill-0' => "127.0.0.1:" . ($aport + 1),
            'decode-0' => "127.0.0.1:" . ($aport + 2));
my %ROLE = ('router-0' => 'router', 'prefill-0' => 'prefill',
            'decode-0' => 'decode');

sub peers {
    return [map { {id => $_, ctrl => $CTRL{$_}, role => $ROLE{$_},
                   $HTTP{$_} ? (http => $HTTP{$_}) : ()} } @_];
}

my %timeouts = (heartbeat_ms => 100, dead_after_ms => 3000);
my $pool = DPD::KvAgent->small_pool(blocks => 256);

sub agent {
    my ($id, @peers) = @_;
    return DPD::KvAgent->start(id => $id, role => $ROLE{$id},
        port => (split /:/, $CTRL{$id})[1], dir => $dir,
        $HTTP{$id} ? (http => $HTTP{$id}) : (), pool => $pool,
        peers => peers(@peers), timeouts => \%timeouts);
}

our $ROUTER = agent('router-0', qw(prefill-0 decode-0));
our $DA = agent('decode-0', qw(prefill-0 router-0));
our $PA = agent('prefill-0', qw(decode-0 router-0));

my %emu = (port => $eport, side_channel_port => $eport + 1, no_lmcache => 1,
           tokenizer => 'llama3', time_scale => 0.01,
           kv_connect_timeout => 0.5);
our $P = DPD::Emu->start(%emu, host => '127.0.0.2', role => 'prefill',
                         kv_agent => $PA);
our $D = DPD::Emu->start(%emu, host => '127.0.0.3', role => 'decode',
                         kv_agent => $DA);
# a decoder without agent or node record
our $LONE = DPD::Emu->start(%emu, host => '127.0.0.4', role => 'decode');

$PA->wait_connected(['decode-0', 'router-0'])
    or die "prefill agent not connected:\n" . $PA->log_text;
$DA->wait_connected(['prefill-0', 'router-0'])
    or die "decode agent not connected:\n" . $DA->log_text;

sub table {
    my $out = `'@{[DPD::KvAgent::bin()]}' status --state '@{[$ROUTER->state_path]}' --json 2>&1`;
    return eval { $J->decode($out) } || {};
}

sub table_wait {
    my ($cond, $timeout) = @_;
    my $end = time + ($timeout // 10);
    while (time < $end) {
        return 1 if $cond->(table());
        sleep 0.05;
    }
    return 0;
}

table_wait(sub { 3 == grep { $_->{alive} } @{ $_[0]{nodes} || [] } }, 15)
    or die "router table: not 3 nodes alive: " . $J->encode(table());

$ENV{TEST_NGINX_LLAMA3} = $tj;
$ENV{TEST_NGINX_LLAMA3_CONFIG} = $tc;
$ENV{TEST_NGINX_EMU_PORT} = $eport;
$ENV{TEST_NGINX_STATE} = $ROUTER->state_path;
$ENV{TEST_NGINX_LONG} = join ' ',
    ('the quick brown fox jumps over the lazy dog') x 60;

my $upstreams = <<'_EOC_';
    upstream prefill {
        dpd_balance;
        zone prefill 64k;
        server 127.0.0.2:$TEST_NGINX_EMU_PORT;
    }

    upstream decode {
        dpd_balance;
        zone decode 64k;
        server 127.0.0.3:$TEST_NGINX_EMU_PORT;
    }

    upstream lone {
        dpd_balance;
        zone lone 64k;
        server 127.0.0.4:$TEST_NGINX_EMU_PORT;
    }
_EOC_

our $WITH_TABLE = <<'_EOC_' . $upstreams;
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
    dpd_state_table $TEST_NGINX_STATE check=100ms stale=3s;
_EOC_

our $NO_TABLE = <<'_EOC_' . $upstreams;
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
_EOC_

my $common = <<'_EOC_';
        dpd on;
        dpd_threshold 256;
        dpd_protocol kv_agent;
        dpd_prefill_pass /_dpd_prefill;
        dpd_prefill_timeout 20s;
        proxy_http_version 1.1;
        proxy_buffering off;
        add_header X-Route $dpd_route always;
        add_header X-KV-Wait $dpd_kv_wait_time always;
_EOC_

my $config = <<_EOC_;
    location /v1/ {
$common
        dpd_kv_wait 400ms;
        dpd_decode_upstream decode;
        proxy_pass http://decode;
    }

    location /abort/ {
$common
        dpd_decode_upstream decode;
        dpd_kv_wait 20s;
        proxy_pass http://decode/;
    }

    location /lone/ {
$common
        dpd_kv_wait 400ms;
        dpd_decode_upstream lone;
        proxy_pass http://lone/;
    }

    location /_dpd_prefill/ {
        internal;
        proxy_pass http://prefill/;
        proxy_http_version 1.1;
    }

    location = /metrics { dpd_metrics; }
_EOC_

# the same /abort/ location behind an HTTP/2 (h2c) listener
$ENV{TEST_NGINX_H2_PORT} = $ENV{DPD_KVW_H2_PORT} || ($eport + 11);

our $H2_SERVER = <<_EOC_;
    server {
        listen 127.0.0.1:\$TEST_NGINX_H2_PORT http2;
        server_name h2;

        location /abort/ {
$common
            dpd_decode_upstream decode;
            dpd_kv_wait 20s;
            proxy_pass http://decode/;
        }

        location /_dpd_prefill/ {
            internal;
            proxy_pass http://prefill/;
            proxy_http_version 1.1;
        }
    }
_EOC_

add_block_preprocessor(sub {
    my $block = shift;
    $block->set_value('http_config', $WITH_TABLE)
        unless defined $block->http_config;
    $block->set_value('config', $config) unless defined $block->config;
    $block->set_value('timeout', 30) unless defined $block->timeout;
});

sub body {
    return JSON::PP->new->encode({model => 'm',
                                  prompt => $ENV{TEST_NGINX_LONG},
                                  max_tokens => 2});
}

# the request, then the metrics
sub req { ["POST $_[0]\n" . body(), "GET /metrics"] }
sub hdr { ["Content-Type: application/json\nX-Request-Id: $_[0]", ""] }

# the kv-wait series after one handoff with outcome $_[0]; $_[1]: the
# histogram count (and dpd_kv_transfer_seconds' for ready)
sub kv_metrics {
    my ($outcome, $count) = @_;
    my $re = '';
    for my $o (qw(ready failed timeout not_pushed no_table no_record
                  client_closed))
    {
        $re .= "dpd_kv_wait_total\\{outcome=\"$o\"\\} "
               . ($o eq $outcome ? 1 : 0) . "\n";
    }
    # the KV transfer time: the waits that ended ready
    my $xfer = $outcome eq 'ready' ? $count : 0;
    return qr/# TYPE dpd_kv_wait_seconds histogram\n(?s:.*)dpd_kv_wait_seconds_count $count\n(?s:.*)# TYPE dpd_kv_wait_total counter\n$re(?s:.*)dpd_kv_transfer_seconds_count\{protocol="kv_agent"\} $xfer\n/;
}

# --- a minimal HTTP/2 client (prior knowledge, h2c) -------------------------

sub h2_frame {
    my ($type, $flags, $sid, $payload) = @_;
    return substr(pack('N', length $payload), 1, 3)
           . pack('CCN', $type, $flags, $sid) . $payload;
}

# HPACK: literal header fields without indexing, new names, no Huffman
sub h2_headers {
    my $out = '';
    while (my ($k, $v) = splice @_, 0, 2) {
        for my $s ($k, $v) {
            die 'h2_headers: long string' if length $s > 126;
        }
        $out .= "\x00" . chr(length $k) . $k . chr(length $v) . $v;
    }
    return $out;
}

our %H2;   # how => seconds from the client's exit to client_closed

# POST on an HTTP/2 stream, wait until the KV wait runs, then cancel the
# stream (RST_STREAM CANCEL, connection kept) or close the connection;
# record how long nginx takes to count the request as client_closed
sub h2_abort {
    my ($how, $rid) = @_;
    my $body = body();
    my $s;
    DPD::Pools::wait_for('nginx to listen (h2)', sub {
        $s = IO::Socket::INET->new(PeerAddr => '127.0.0.1',
                                   PeerPort => $ENV{TEST_NGINX_H2_PORT},
                                   Timeout => 5);
    }, 30) or die "h2 connect: $!";
    binmode $s;
    print $s "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", h2_frame(4, 0, 0, '');
    print $s h2_frame(1, 0x4, 1,
                      h2_headers(':method' => 'POST', ':scheme' => 'http',
                                 ':path' => '/abort/v1/completions',
                                 ':authority' => 'localhost',
                                 'content-type' => 'application/json',
                                 'content-length' => length $body,
                                 'x-request-id' => $rid));
    print $s h2_frame(0, 0x1, 1, $body);
    $s->flush;
    DPD::Pools::wait_for("$rid prefill answered",
        sub { grep { defined $_->{status} } $P->requests(request_id => $rid) },
        20) or die "$rid: no prefill";
    sleep 0.5;          # in the KV wait now (the decode agent is frozen)
    if ($how eq 'rst') {
        print $s h2_frame(3, 0, 1, pack('N', 8));
        $s->flush;
    } else {
        close $s;
    }
    my $t0 = time;
    my $ok = DPD::Pools::wait_for("$rid counted client_closed", sub {
        my $r = HTTP::Tiny->new(timeout => 5)->get(
            'http://127.0.0.1:' . Test::Nginx::Socket::server_port()
            . '/metrics');
        $r->{content} =~ /dpd_kv_wait_total\{outcome="client_closed"\} 1\n/;
    }, 10);
    $H2{$how} = $ok ? time - $t0 : 'never';
    close $s if $how eq 'rst';
}

sub freeze { kill 'STOP', $DA->pid }
sub thaw { kill 'CONT', $DA->pid }

no_shuffle();
log_level('info');
run_tests();

thaw();

# the wait is 20 s: the client's exit is seen at once, as for HTTP/1.1
for my $how (qw(rst close)) {
    my $t = $H2{$how} // 'not run';
    ok $t =~ /^[\d.]+$/ && $t < 3,
        "HTTP/2 client gone ($how) during the KV wait: seen in $t s";
}

__DATA__

=== TEST 1: KV ready: outcome ready, one wait observed
--- request eval
main::req('/v1/completions')
--- more_headers eval
main::hdr('kvw-ready')
--- response_headers_like eval
["X-Route: disaggregated\nX-KV-Wait: \\d+", ""]
--- response_body_like eval
["\"choices\"", main::kv_metrics('ready', 1)]
--- no_error_log
[error]



=== TEST 2: the prefill reply says nothing was pushed: not_pushed, no wait
--- init
$main::P->fault(role => 'prefill', count => 1,
                kv_override => {dpd => {blocks => 0, state => 'failed'}});
--- request eval
main::req('/v1/completions')
--- more_headers eval
main::hdr('kvw-notpushed')
--- response_body_like eval
["\"choices\"", main::kv_metrics('not_pushed', 0)]
--- no_error_log
[error]



=== TEST 3: the decoder has no node record: no_record
--- request eval
main::req('/lone/v1/completions')
--- more_headers eval
main::hdr('kvw-norecord')
--- response_headers_like eval
["X-Route: fallback", ""]
--- response_body_like eval
["\"choices\"", main::kv_metrics('no_record', 0)]
--- no_error_log
[error]



=== TEST 4: no state table: no_table
--- http_config eval
$::NO_TABLE
--- request eval
main::req('/v1/completions')
--- more_headers eval
main::hdr('kvw-notable')
--- response_headers_like eval
["X-Route: fallback", ""]
--- response_body_like eval
["\"choices\"", main::kv_metrics('no_table', 0)]
--- no_error_log
[error]



=== TEST 5: the KV never lands (decode agent frozen): timeout after 400 ms
--- init
main::freeze();
--- request eval
main::req('/v1/completions')
--- more_headers eval
main::hdr('kvw-timeout')
--- response_headers_like eval
["X-Route: disaggregated\nX-KV-Wait: (4\\d\\d|5[0-4]\\d)", ""]
--- response_body_like eval
["\"choices\"",
 qr/dpd_kv_wait_seconds_bucket\{le="0.25"\} 0\n(?s:.*)dpd_kv_wait_seconds_bucket\{le="1"\} 1\n(?s:.*)dpd_kv_wait_total\{outcome="timeout"\} 1\n/]
--- no_error_log
[error]



=== TEST 6: the client goes away during the KV wait: client_closed
--- request eval
[ "POST /abort/v1/completions\n" . main::body(), "GET /nothing",
  "GET /metrics" ]
--- more_headers eval
[ "Content-Type: application/json\nX-Request-Id: kvw-abort", "", "" ]
--- timeout: 3
--- abort
--- error_code eval
["", 404, 200]
--- response_body_like eval
["^\$", "404 Not Found", main::kv_metrics('client_closed', 0)]
--- no_error_log
[alert]
[crit]



=== TEST 7: an HTTP/2 stream reset during the KV wait: client_closed
--- http_config eval
$::WITH_TABLE . $::H2_SERVER
--- init
main::h2_abort('rst', 'kvw-h2-rst');
--- request
GET /metrics
--- response_body_like eval
main::kv_metrics('client_closed', 0)
--- error_log
client gone while waiting for the KV of request "kvw-h2-rst"
--- no_error_log
[alert]
[crit]



=== TEST 8: an HTTP/2 connection closed during the KV wait: client_closed
--- http_config eval
$::WITH_TABLE . $::H2_SERVER
--- init
main::h2_abort('close', 'kvw-h2-close');
--- request
GET /metrics
--- response_body_like eval
main::kv_metrics('client_closed', 0)
--- error_log
client gone while waiting for the KV of request "kvw-h2-close"
--- no_error_log
[alert]
[crit]
