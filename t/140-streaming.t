# ngx_http_dpd_module, direct path: SSE from the decoder streams through
# event by event (proxy_buffering off), and a client that goes away aborts
# the decoder's request.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;
use IO::Socket::INET ();
use POSIX ();
use Time::HiRes qw(sleep time);

my ($llama_tj) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'tokenizer fixtures or build/libdpdtok.so missing '
                 . '(make deps && make)')
    unless $llama_tj && DPD::Emu->have_tokenizer_lib;
plan('no_plan');   # after the skip checks: a skip must not plan twice

my $base = $ENV{DPD_CORE_EMU_PORT} || 18500;

# one token every 1.5 s
our $emu = DPD::Emu->start(port => $base + 20,
                           side_channel_port => $base + 21,
                           tokenizer => 'llama3', args => ['--no-lmcache'],
                           decode_step_ms => 1500);

$ENV{TEST_NGINX_LLAMA3} = $llama_tj;
$ENV{TEST_NGINX_EMU} = $emu->addr;

# A scripted SSE decoder: the first event at once, the next one 3 s later.
# Through nginx the client must see the first event within 1 s.
my $sse_port = $base + 22;
$ENV{TEST_NGINX_SSE} = "127.0.0.1:$sse_port";

my $listen = IO::Socket::INET->new(LocalAddr => '127.0.0.1',
                                   LocalPort => $sse_port, Listen => 8,
                                   ReuseAddr => 1)
    or die "sse server: $!\n";
my $parent = $$;
my $sse_pid = fork();
die "fork: $!\n" unless defined $sse_pid;

if ($sse_pid == 0) {
    alarm 60;
    while (my $c = $listen->accept) {
        my $req = '';
        while ($req !~ /\r\n\r\n/) {
            last unless sysread $c, $req, 4096, length $req;
        }
        my ($len) = $req =~ /Content-Length:\s*(\d+)/i;
        my $have = length($req) - index($req, "\r\n\r\n") - 4;
        while (defined $len && $have < $len) {
            my $n = sysread $c, my $buf, 4096;
            last unless $n;
            $have += $n;
        }
        my $chunk = sub { sprintf("%x\r\n%s\r\n", length $_[0], $_[0]) };
        syswrite $c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     . "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                     . $chunk->("data: {\"n\":1}\n\n");
        sleep 3;
        syswrite $c, $chunk->("data: {\"n\":2}\n\n") . $chunk->("data: [DONE]\n\n")
                     . "0\r\n\r\n";
        close $c;
    }
    POSIX::_exit(0);
}
close $listen;
END { kill 'KILL', $sse_pid if $sse_pid && $$ == $parent; }

add_block_preprocessor(sub {
    my $block = shift;

    $block->set_value('http_config', <<'_EOC_');
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    upstream emu { server $TEST_NGINX_EMU; }
    upstream sse { server $TEST_NGINX_SSE; }
_EOC_

    $block->set_value('config', <<'_EOC_');
    location ~ ^/v1/(chat/)?completions$ {
        dpd on;
        add_header X-Dpd-Route $dpd_route always;
        proxy_pass http://emu;
        proxy_buffering off;
        proxy_read_timeout 30s;
    }
    location = /scripted/v1/completions {
        dpd on;
        add_header X-Dpd-Route $dpd_route always;
        proxy_pass http://sse;
        proxy_buffering off;
    }
_EOC_
});

no_shuffle();
log_level('info');
run_tests();

# the aborted request: the emulator saw its client (nginx) go away

my $rec;
my $deadline = time + 8;
while (time < $deadline) {
    $rec = $emu->last_request(request_id => 'abort-1');
    last if $rec && $rec->{aborted};
    sleep 0.2;
}
ok($rec && $rec->{aborted}, 'client abort cancelled the decoder request')
    or diag(explain($rec));
ok($rec && ($rec->{completion_tokens} // 0) < 20,
   'the decoder stopped generating');

__DATA__

=== TEST 1: the first event arrives at once, not when the stream ends
HTTP/1.0: the stream comes unchunked and ends with the connection, so the
part read before the client gives up (1 s without a byte, --- abort) is a
complete response to compare (a chunked one cut short is no response at
all to Test::Nginx).
--- request
POST /scripted/v1/completions HTTP/1.0
{"prompt": "Tell me a story", "max_tokens": 3, "stream": true}
--- timeout: 1
--- abort
--- response_headers
Content-Type: text/event-stream
X-Dpd-Route: direct
--- response_body eval
qq{data: {"n":1}\n\n}


=== TEST 2: ... and the rest follows 3 s later, complete
--- request
POST /scripted/v1/completions
{"prompt": "Tell me a story", "max_tokens": 3, "stream": true}
--- timeout: 6
--- response_body eval
qq{data: {"n":1}\n\ndata: {"n":2}\n\ndata: [DONE]\n\n}


=== TEST 3: the decoder's whole stream passes intact, [DONE] last
--- request
POST /v1/chat/completions
{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": true, "stream_options": {"include_usage": true}}
--- timeout: 10
--- response_headers
Content-Type: text/event-stream; charset=utf-8
--- response_body_like eval
qr/\A(data: \{"id":"chatcmpl-[^\n]*\n\n){3,}data: \[DONE\]\n\n\z/s


=== TEST 4: client abort mid-stream closes the upstream request
HTTP/1.0 as in TEST 1, so the status is checked too.
--- request
POST /v1/completions HTTP/1.0
{"prompt": "A very long answer please", "max_tokens": 40, "stream": true}
--- more_headers
X-Request-Id: abort-1
--- timeout: 1
--- abort
--- wait: 0.5
--- error_log
client prematurely closed connection
