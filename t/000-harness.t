# Self-test of the Test::Nginx::Socket harness (t/lib, or the real CPAN
# module when installed) with stock nginx features only: every section the
# project's tests rely on.  The dpd module is not loaded here.
BEGIN { delete $ENV{TEST_NGINX_LOAD_MODULES} }

use Test::Nginx::Socket 'no_plan';

# the real module does not export this one itself
$ENV{TEST_NGINX_HTML_DIR} ||= html_dir();

# TEST 15's listening socket, outside the server root: Test::Nginx stops
# at the next file when its clean-up finds anything it did not create there
use File::Temp ();
$ENV{TEST_NGINX_BLACKHOLE} = File::Temp::tempdir(CLEANUP => 1)
                             . '/blackhole.sock';

log_level('warn');
no_shuffle();
run_tests();

__DATA__

=== TEST 1: status, body, headers, absent header, clean error log
--- config
    location /t {
        add_header X-Harness "yes";
        return 200 "hello\n";
    }
--- request
GET /t
--- response_body
hello
--- response_headers
Content-Type: text/plain
X-Harness: yes
!X-Absent
--- no_error_log
[error]
[alert]



=== TEST 2: error_code, response_body_like, error_log (plain and eval)
--- config
    location /missing {
        root $TEST_NGINX_HTML_DIR/nothing-here;
    }
--- request
GET /missing/file.txt
--- error_code: 404
--- response_body_like: <title>404 Not Found</title>
--- error_log
open()
No such file or directory



=== TEST 3: error_log eval with a qr// list
--- config
    location /missing {
        root $TEST_NGINX_HTML_DIR/nothing-here;
    }
--- request
GET /missing/x.txt
--- error_code: 404
--- error_log eval
[qr/\[error\] \d+#\d+: \*\d+ open\(\) ".*x\.txt" failed/, "No such file"]



=== TEST 4: response_body_unlike, response_headers_like
--- config
    location /t {
        return 200 "alpha beta\n";
    }
--- request
GET /t
--- response_body_unlike: gamma
--- response_headers_like
Content-Length: \d+
Server: nginx.*



=== TEST 5: POST body with more_headers through proxy_pass to another location
--- config
    location /front {
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/back;
        add_header X-Body $request_body;
    }
    location /back {
        return 200 "back: $request_method $uri len=$content_length foo=$http_x_foo\n";
    }
--- more_headers
X-Foo: bar
# a comment line is ignored
--- request
POST /front
hello world
--- response_body
back: POST /back len=11 foo=bar
--- response_headers
X-Body: hello world



=== TEST 6: chunked response is de-chunked before comparing
--- config
    location /chunked {
        sub_filter_types *;
        sub_filter "one" "ONE";
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/plain;
    }
    location /plain {
        return 200 "one two three\n";
    }
--- request
GET /chunked
--- response_headers
Transfer-Encoding: chunked
!Content-Length
--- response_body
ONE two three



=== TEST 7: SSE stream, chunked, compared byte for byte
--- user_files eval
[["events.txt", "data: {\"n\":1}\n\ndata: {\"n\":2}\n\ndata: [DONE]\n\n"]]
--- config
    location /sse {
        default_type text/event-stream;
        sub_filter_types text/event-stream;
        sub_filter "never-matches" "";
        alias $TEST_NGINX_HTML_DIR/events.txt;
    }
--- request
GET /sse
--- response_headers
Content-Type: text/event-stream
Transfer-Encoding: chunked
--- response_body eval
"data: {\"n\":1}\n\ndata: {\"n\":2}\n\ndata: [DONE]\n\n"



=== TEST 8: must_die with the reason in the error log
--- config
    location /t {
        bogus_harness_directive on;
    }
--- must_die
--- error_log
[emerg]
unknown directive "bogus_harness_directive"



=== TEST 9: main_config is placed at the top level
--- main_config
    bogus_main_directive 1;
--- config
    location /t { return 200; }
--- must_die
--- error_log eval
qr/\[emerg\] .*unknown directive "bogus_main_directive" in \S+nginx\.conf:\d+/



=== TEST 10: http_config with a second server and $TEST_NGINX_ variables
--- http_config
    map $uri $harness_mapped {
        default "mapped-$TEST_NGINX_SERVER_PORT";
    }
--- config
    location /t {
        return 200 "$harness_mapped\n";
    }
--- request
GET /t
--- response_body eval
"mapped-$ENV{TEST_NGINX_SERVER_PORT}\n"



=== TEST 11: several requests with --- request eval
--- config
    location /a { return 200 "A"; }
    location /b { return 201 "B"; }
--- request eval
["GET /a", "GET /b"]
--- error_code eval
[200, 201]
--- response_body eval
["A", "B"]



=== TEST 12: pipelined requests on one connection
--- config
    location /a { return 200 "first\n"; }
    location /b { return 200 "second\n"; }
--- pipelined_requests eval
["GET /a", "GET /b"]
--- response_body eval
["first\n", "second\n"]



=== TEST 13: raw_request
--- config
    location /raw { return 200 "raw $http_x_raw\n"; }
--- raw_request eval
"GET /raw HTTP/1.0\r\nHost: localhost\r\nX-Raw: 42\r\n\r\n"
--- response_body
raw 42



=== TEST 14: user_files with variable expansion
--- user_files
>>> sub/dir/hello.txt
port $TEST_NGINX_SERVER_PORT
--- config
    location /sub/ { root $TEST_NGINX_HTML_DIR; }
--- request
GET /sub/dir/hello.txt
--- response_body_like: ^port \d+$



=== TEST 15: timeout with abort: the client gives up on a hanging upstream
--- init
use IO::Socket::UNIX;
unlink $ENV{TEST_NGINX_BLACKHOLE};
our $Blackhole = IO::Socket::UNIX->new(
    Local => $ENV{TEST_NGINX_BLACKHOLE},
    Listen => 5) or die "blackhole: $!";
--- config
    location /hang {
        proxy_read_timeout 60s;
        proxy_pass http://unix:$TEST_NGINX_BLACKHOLE:/;
    }
--- request
GET /hang
--- timeout: 300ms
--- abort
--- ignore_response
--- no_error_log
[alert]



=== TEST 16: HEAD request and a Host header from more_headers
--- config
    location /t { return 200 "body that HEAD must not return"; }
--- more_headers
Host: example.test
--- request
HEAD /t
--- response_body eval
""



=== TEST 17: log_level per block and --- wait
--- log_level: debug
--- config
    location /t { return 200 "x"; }
--- request
GET /t
--- wait: 0.1
--- error_log
[debug]



=== TEST 18: global log_level('warn') keeps debug lines out
--- config
    location /t { return 200 "x"; }
--- request
GET /t
--- no_error_log
[debug]
[info]



=== TEST 19: skip_nginx that does not apply runs the block
--- skip_nginx: 1: < 0.0.1
--- config
    location /t { return 200 "ran\n"; }
--- request
GET /t
--- response_body
ran



=== TEST 20: skip_nginx that applies skips the given number of tests
--- skip_nginx: 2: > 0.0.1: every nginx is newer
--- config
    location /t { return 500; }
--- request
GET /t
--- response_body
never compared



=== TEST 21: access_log and shutdown_error_log
--- log_level: notice
--- config
    location /logged { return 204; }
--- request
GET /logged?x=1
--- error_code: 204
--- access_log
"GET /logged?x=1 HTTP/1.1" 204
--- shutdown_error_log eval
qr/signal 3 \(SIGQUIT\) received|gracefully shutting down/



=== TEST 22: grep_error_log
--- config
    location /missing { root $TEST_NGINX_HTML_DIR/none; }
--- request
GET /missing/abc.txt
--- error_code: 404
--- grep_error_log eval: qr/open\(\) "[^"]+abc\.txt"/
--- grep_error_log_out eval
qr/^open\(\) "\S+\/missing\/abc\.txt"\n$/



=== TEST 23: response_body chomp filter and a request with leading comments
--- config
    location /t { return 200 "no newline"; }
--- request
    # leading comment lines and blanks are skipped
    GET /t
--- response_body chomp
no newline



=== TEST 24: first of two blocks sharing one nginx
--- config
    location /conn { return 200 "conn=$connection\n"; }
--- request
GET /conn
--- response_body
conn=1



=== TEST 25: a block without --- config reuses the running nginx
--- skip_eval: 1: $ENV{TEST_NGINX_USE_VALGRIND}
--- request
GET /conn
--- response_body_like: ^conn=[2-9]\d*$



=== TEST 26: a large request body through proxy_pass (temp file inside servroot)
--- config
    client_body_buffer_size 1k;
    location /front {
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/back;
    }
    location /back { return 200 "len=$content_length\n"; }
--- request eval
"POST /front\n" . ("x" x 100000)
--- response_body
len=100000
--- no_error_log
[error]
[crit]



=== TEST 27: early reply while the client still sends its body
--- config
    location /small {
        client_max_body_size 1k;
        return 200;
    }
--- request eval
"POST /small\n" . ("y" x 2000000)
--- error_code: 413
--- response_body_like: 413 Request Entity Too Large



=== TEST 28: chunked request body from more_headers (no Content-Length added)
--- config
    location /front {
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/back;
    }
    location /back { return 200 "len=$content_length\n"; }
--- more_headers
Transfer-Encoding: chunked
--- request eval
"POST /front\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
--- response_body
len=11
