# ngx_http_dpd_module: "dpd_count_thread_pool".  A body of min_size or
# more is parsed and counted in a thread of the named pool: the counts,
# the refusals and the forwarded bytes are those of the inline path; the
# worker serves other requests while a huge prompt is counted; a client
# that goes mid-count is seen at once and nothing it left is touched after
# (ASan / valgrind: make test-asan SAN_TESTS=t/171-count-threads.t); a
# missing or misconfigured pool fails nginx -t.
#
# The direct path forwards the client's bytes as they are (white space,
# key order, escapes) when nothing is stripped, and the stripped body
# otherwise, with and without the thread pool: a backend here echoes what
# it received.
use strict;
use warnings;

use Test::Nginx::Socket;
use Test::More ();
use DPD::Emu;
use DPD::Pools qw(wait_for nginx_socket send_post);
use IO::Socket::INET;
use JSON::PP ();
use Time::HiRes qw(sleep time);

my ($tj, $tc) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'Llama 3 tokenizer fixture not installed (make deps)')
    unless $tj && $tc;
plan('no_plan');   # after the skip checks: a skip must not plan twice

$ENV{TEST_NGINX_LLAMA3} = $tj;
$ENV{TEST_NGINX_LLAMA3_CONFIG} = $tc;

my $echo_port = $ENV{DPD_THREAD_ECHO_PORT} || 19710;
$ENV{TEST_NGINX_ECHO_PORT} = $echo_port;

# --- a backend that answers each request with the body it received -------

my $listen = IO::Socket::INET->new(LocalAddr => '127.0.0.1',
                                   LocalPort => $echo_port, Listen => 64,
                                   ReuseAddr => 1)
    or die "echo backend: listen on $echo_port: $!\n";
my $echo_pid = fork // die "fork: $!\n";
if ($echo_pid == 0) {
    $SIG{PIPE} = 'IGNORE';
    while (my $c = $listen->accept) {
        my $buf = '';
        while ($buf !~ /\r\n\r\n/) {
            last unless sysread($c, $buf, 65536, length $buf);
        }
        my ($head, $body) = split /\r\n\r\n/, $buf, 2;
        $body //= '';
        my ($len) = $head =~ /^content-length:\s*(\d+)/im;
        $len //= 0;
        while (length $body < $len) {
            last unless sysread($c, $body, $len - length $body, length $body);
        }
        print $c "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream"
                 . "\r\nContent-Length: " . length($body)
                 . "\r\nConnection: close\r\n\r\n$body";
        close $c;
    }
    exit 0;
}
close $listen;
END { kill 'TERM', $echo_pid if $echo_pid; }

# --- bodies --------------------------------------------------------------

# a chat body of $words words (~1.3 tokens each), one message
sub chat_body {
    my ($words, $seed) = @_;
    my @w = qw(the of and to in is that for it as was with model token
               cache river mountain history science music garden window);
    my $x = $seed || 7;
    my $text = join ' ', map { $x = ($x * 1103515245 + 12345) % 2147483648;
                               $w[$x % @w] } 1 .. $words;
    return JSON::PP->new->canonical->encode({model => 'm', max_tokens => 2,
        messages => [{role => 'user', content => $text}]});
}

# pretty-printed, odd key order, escapes the engines read as they are
our $ODD = qq({\n  "stream" : false,\t"model":"m",\n  "messages": [ {"content": )
         . qq("caf\\u00e9 \\/ \\"quoted\\" \\ud83d\\ude00 tab\\there", )
         . qq("role" : "user"} ],\r\n  "max_tokens" : 3\n});
our $STRIP = qq({"model":"m", "kv_transfer_params": {"remote_host":"10.6.6.6"},)
           . qq( "messages":[{"role":"user","content":"hi"}],)
           . qq("kv_transfer_params":null , "max_tokens":1});
# the members kept, byte for byte, joined by commas
our $STRIPPED = qq({"model":"m","messages":[{"role":"user","content":"hi"}],)
              . qq("max_tokens":1});
our $DUP = '{"model":"m","messages":[{"role":"user","content":"'
         . ('x' x 4000) . '"}],"model":"n"}';
# ~1.4M tokens of words no cache has seen: a count of a second or so
sub random_words_body {
    my ($words) = @_;
    my $x = 11;
    my $text = join ' ', map {
        join '', map { $x = ($x * 1103515245 + 12345) % 2147483648;
                       chr(97 + ($x >> 16) % 26) } 1 .. 3 + $_ % 7
    } 1 .. $words;
    return JSON::PP->new->encode({model => 'm', max_tokens => 2,
        messages => [{role => 'user', content => $text}]});
}
# under valgrind (about 30x slower) smaller prompts make the same points
our $SLOW = $ENV{TEST_NGINX_USE_VALGRIND} || $ENV{DPD_T171_SMALL};
our $BIG = random_words_body($SLOW ? 40_000 : 400_000);
our $HUGE = chat_body($SLOW ? 20_000 : 200_000, 5);
# its count as a chat, and as a completions batch (with a second prompt)
our ($HUGE_CHAT, $HUGE_CMPL) = $SLOW ? (20010, 20004) : (200010, 200004);
our $SMALL = chat_body(5, 1);

# --- the stall and the client who goes: driven from --- init -------------

our %ORDER;
our $QUEUE = '';

# POST with "Connection: close": the answer ends with the connection
# ($hold: all but the body's last byte, which the caller sends)
sub post_close {
    my ($s, $path, $rid, $body, $hold) = @_;
    print $s "POST $path HTTP/1.1\r\nHost: localhost\r\n"
           . "Content-Type: application/json\r\nX-Request-Id: $rid\r\n"
           . "Connection: close\r\n"
           . "Content-Length: " . length($body) . "\r\n\r\n"
           . ($hold ? substr($body, 0, -1) : $body);
}

# nginx's worker processes (children of the pid file's master), or nginx
# itself when it runs without a master
sub nginx_workers {
    open my $pf, '<', $Test::Nginx::Util::PidFile or die "pid file: $!";
    my $master = <$pf>;
    chomp $master;
    my @w;
    for my $p (map { m{/proc/(\d+)$} ? $1 : () } glob '/proc/[0-9]*') {
        open my $st, '<', "/proc/$p/stat" or next;
        my $line = <$st> // '';
        push @w, $p if $line =~ /^\d+ \(.*\) \S (\d+) / && $1 == $master;
    }
    return @w ? @w : ($master);
}

sub read_all {
    my ($s) = @_;
    my $r = '';
    1 while sysread($s, $r, 65536, length $r);
    return $r;
}

# a huge prompt is posted and, while it is counted, a short request on the
# same worker: the short one is answered first
sub short_while_counting {
    my ($path) = @_;
    my $big = nginx_socket();
    post_close($big, $path, 'big-1', $BIG);
    sleep 0.3;                          # read, posted to the pool

    my $small = nginx_socket();
    post_close($small, '/short/v1/chat/completions', 'small-1', $SMALL);
    my $resp = read_all($small);
    $ORDER{small_done} = time;
    $ORDER{small_status} = ($resp =~ m{^HTTP/1\.\d (\d+)})[0];

    $resp = read_all($big);
    $ORDER{big_done} = time;
    $ORDER{big_status} = ($resp =~ m{^HTTP/1\.\d (\d+)})[0];
    ($ORDER{big_tokens}) = $resp =~ /^X-Tokens: (\d+)/mi;
    close $small;
    close $big;
}

# the client posts a huge prompt and hangs up while it is counted (the
# block's own request then waits behind it in the pool's one thread)
# the client goes once the count is in the thread (the error log says it
# was posted), not after a fixed sleep: under load the body may still be
# arriving then, or on a fast machine the count already done
sub gone_mid_count {
    my ($path) = @_;
    my $log = $Test::Nginx::Util::ErrLogFile;
    my $from = -s $log // 0;
    my $s = nginx_socket();
    post_close($s, $path, 'gone-1', $BIG);
    my $deadline = time + 15;
    while (time < $deadline) {
        if (open my $fh, '<', $log) {
            seek $fh, $from, 0;
            local $/;
            last if (<$fh> // '') =~ /dpd count: \d+ bytes to the thread pool/;
        }
        sleep 0.005;
    }
    close $s;
    sleep 0.2;
}

no_shuffle();
log_level('debug');
run_tests();

ok $ORDER{small_done} && $ORDER{big_done}
   && $ORDER{small_done} < $ORDER{big_done},
   'the short request is answered while the huge prompt is counted'
    or diag(join " ", map { "$_=" . ($ORDER{$_} // "") } sort keys %ORDER);
is $ORDER{small_status}, 200, 'the short request: 200';
is $ORDER{big_status}, 200, 'the huge prompt: 200';
ok(($ORDER{big_tokens} // 0) > ($SLOW ? 100_000 : 1_000_000),
   'the huge prompt: counted whole in the thread')
    or diag(join " ", map { "$_=" . ($ORDER{$_} // "") } sort keys %ORDER);
is $QUEUE, "$HUGE_CHAT " x 4, 'a full queue: every huge prompt counted';

__DATA__

=== TEST 1: an unknown thread pool fails nginx -t
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
--- config
    location /v1/ { dpd on; dpd_count_thread_pool nosuch; }
--- must_die
--- error_log
unknown thread pool "nosuch"



=== TEST 2: a bad min_size fails nginx -t
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
--- config
    location /v1/ { dpd on; dpd_count_thread_pool default min_size=12q; }
--- must_die
--- error_log
invalid min_size "12q"



=== TEST 3: an unknown parameter fails nginx -t
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
--- config
    location /v1/ { dpd on; dpd_count_thread_pool default size=1k; }
--- must_die
--- error_log
invalid parameter "size=1k", expected "min_size=SIZE"



=== TEST 4: "off" takes no parameter
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
--- config
    location /v1/ { dpd on; dpd_count_thread_pool off min_size=1k; }
--- must_die
--- error_log
invalid parameter "min_size=1k": "off" takes none



=== TEST 5: twice in one location fails nginx -t
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
--- config
    location /v1/ {
        dpd on;
        dpd_count_thread_pool default;
        dpd_count_thread_pool off;
    }
--- must_die
--- error_log
"dpd_count_thread_pool" directive is duplicate



=== TEST 6: direct path, inline: the client's bytes, untouched
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
--- config
    location /v1/ { dpd on; proxy_pass http://127.0.0.1:$TEST_NGINX_ECHO_PORT; }
--- request eval
"POST /v1/chat/completions\n$main::ODD"
--- response_body eval
$main::ODD



=== TEST 7: direct path, thread pool: the client's bytes, untouched
--- main_config
    thread_pool dpdcount threads=2;
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
--- config
    location /v1/ {
        dpd on;
        dpd_count_thread_pool dpdcount min_size=1;
        proxy_pass http://127.0.0.1:$TEST_NGINX_ECHO_PORT;
    }
--- request eval
"POST /v1/chat/completions\n$main::ODD"
--- response_body eval
$main::ODD



=== TEST 8: direct path: client kv_transfer_params stripped, the rest as sent (inline, thread)
--- main_config
    thread_pool dpdcount threads=2;
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
--- config
    location /v1/ { dpd on; proxy_pass http://127.0.0.1:$TEST_NGINX_ECHO_PORT; }
    location /thr/ {
        dpd on;
        dpd_count_thread_pool dpdcount min_size=1;
        proxy_pass http://127.0.0.1:$TEST_NGINX_ECHO_PORT/;
    }
--- request eval
["POST /v1/chat/completions\n$main::STRIP",
 "POST /thr/v1/chat/completions\n$main::STRIP"]
--- response_body eval
[$main::STRIPPED, $main::STRIPPED]



=== TEST 9: a huge prompt counted in the "default" pool: the inline count
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
    client_max_body_size 16m;
    client_body_buffer_size 4m;
--- config
    location /inline/ {
        dpd on;
        proxy_pass http://127.0.0.1:$TEST_NGINX_ECHO_PORT/;
        add_header X-Tokens $dpd_prompt_tokens;
        add_header X-Route $dpd_route;
    }
    location /thr/ {
        dpd on;
        dpd_count_thread_pool default;
        proxy_pass http://127.0.0.1:$TEST_NGINX_ECHO_PORT/;
        add_header X-Tokens $dpd_prompt_tokens;
        add_header X-Route $dpd_route;
    }
--- request eval
["POST /inline/v1/chat/completions\n$main::HUGE",
 "POST /thr/v1/chat/completions\n$main::HUGE",
 "POST /thr/v1/completions\n" . JSON::PP->new->encode({model => "m",
     prompt => [JSON::PP->new->decode($main::HUGE)->{messages}[0]{content},
                "and a second prompt"]}),
 "POST /inline/v1/completions\n" . JSON::PP->new->encode({model => "m",
     prompt => [JSON::PP->new->decode($main::HUGE)->{messages}[0]{content},
                "and a second prompt"]})]
--- response_headers eval
["X-Tokens: $main::HUGE_CHAT\nX-Route: disaggregated",
 "X-Tokens: $main::HUGE_CHAT\nX-Route: disaggregated",
 "X-Tokens: $main::HUGE_CMPL\nX-Route: disaggregated",
 "X-Tokens: $main::HUGE_CMPL\nX-Route: disaggregated"]
--- timeout: 60
--- no_error_log
[alert]
[error]



=== TEST 10: refusals from the thread are the inline ones
--- main_config
    thread_pool dpdcount threads=1;
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
--- config
    location /thr/ {
        dpd on;
        dpd_count_thread_pool dpdcount min_size=1k;
        proxy_pass http://127.0.0.1:$TEST_NGINX_ECHO_PORT/;
    }
--- request eval
["POST /thr/v1/chat/completions\n$main::DUP",
 "POST /thr/v1/chat/completions\n" . substr($main::DUP, 0, 3000),
 "POST /thr/v1/completions\n" . '{"model":"m","prompt":["' . ('x' x 4000)
     . '", 7]}']
--- error_code eval
[400, 400, 400]
--- response_body_like eval
[qr/"the key \\"model\\" appears more than once/,
 qr/malformed JSON in the request body near byte/,
 qr/prompt\[1\]: expected a string like the other elements/]



=== TEST 11: a client gone mid-count: seen at once, the request finalized after the count
--- main_config
    thread_pool dpdcount threads=1;
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
    client_max_body_size 16m;
    client_body_buffer_size 16m;
--- config
    location /thr/ {
        dpd on;
        dpd_count_thread_pool dpdcount min_size=1;
        proxy_pass http://127.0.0.1:$TEST_NGINX_ECHO_PORT/;
        add_header X-Tokens $dpd_prompt_tokens;
    }
--- init
main::gone_mid_count('/thr/v1/chat/completions');
--- request eval
"POST /thr/v1/chat/completions\n$main::SMALL"
--- timeout: 20
--- response_headers
X-Tokens: 15
--- error_log eval
[qr/client prematurely closed connection/,
 qr/http terminate cleanup count:\d+ blk:1/,
 qr/dpd count: thread done, parse 0, count 0/]
--- no_error_log
[alert]
[crit]



=== TEST 12: a short request is served while a huge prompt is counted
--- main_config
    thread_pool dpdcount threads=1;
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
    client_max_body_size 16m;
    client_body_buffer_size 16m;
--- config
    location /thr/ {
        dpd on;
        dpd_count_thread_pool dpdcount;
        proxy_pass http://127.0.0.1:$TEST_NGINX_ECHO_PORT/;
        add_header X-Tokens $dpd_prompt_tokens;
    }
    location /short/ {
        dpd on;
        return 200 "ok\n";
    }
--- init
main::short_while_counting('/thr/v1/chat/completions');
--- request eval
"POST /short/v1/chat/completions\n$main::SMALL"
--- response_body
ok
--- no_error_log
[alert]



=== TEST 13: a full queue: counted inline, nothing lost
--- main_config
    thread_pool tiny threads=1 max_queue=1;
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
    client_max_body_size 16m;
    client_body_buffer_size 4m;
--- config
    location /thr/ {
        dpd on;
        dpd_count_thread_pool tiny;
        proxy_pass http://127.0.0.1:$TEST_NGINX_ECHO_PORT/;
        add_header X-Tokens $dpd_prompt_tokens;
    }
--- init
# every body but its last byte first, then the four last bytes at once:
# the four counts are posted within microseconds of each other, so the
# queue is full whatever the machine's speed (sending the bodies whole let
# a slow upload finish the first count before the third was posted).  The
# worker is stopped while the last bytes go out, so it finds all four in
# one wake-up even when this process is descheduled between the writes
# (a loaded machine: the first count could end before the third write)
my @s = map { my $s = main::nginx_socket();
              main::post_close($s, '/thr/v1/chat/completions', "q-$_",
                               $main::HUGE, 1);
              $s } 1 .. 4;
my @w = main::nginx_workers();
kill 'STOP', @w;
syswrite $_, substr($main::HUGE, -1) for @s;
sleep 0.05;                             # loopback: in the socket buffers
kill 'CONT', @w;
for my $s (@s) { my $r = main::read_all($s);
                 $main::QUEUE .= (($r =~ /^X-Tokens: (\d+)/mi)[0] // 'none')
                                 . ' ';
                 close $s; }
--- request eval
"POST /thr/v1/chat/completions\n$main::SMALL"
--- response_headers
X-Tokens: 15
--- error_log eval
qr/thread pool "tiny" queue overflow: 1 tasks waiting/
--- no_error_log
[alert]
