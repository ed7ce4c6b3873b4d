# ngx_http_dpd_module: every directive of the gateway core, its accepted
# values and the "nginx -t" errors for bad ones.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;
use File::Temp ();

my ($tj, $tc) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'Llama 3 tokenizer fixture not installed (make deps)')
    unless $tj && $tc;
plan('no_plan');   # after the skip checks: a skip must not plan twice

$ENV{TEST_NGINX_LLAMA3} = $tj;
$ENV{TEST_NGINX_LLAMA3_CONFIG} = $tc;
$ENV{TEST_NGINX_BAD_TOKENIZER} = "$ENV{TEST_NGINX_SERVROOT}/html/bad.json"
    if $ENV{TEST_NGINX_SERVROOT};

no_shuffle();
log_level('info');
run_tests();

# the shipped example configurations pass "nginx -t" as they are

{
    my $root = DPD::Emu->root;
    my $nginx = $ENV{TEST_NGINX_BINARY} || 'nginx';

    SKIP: {
        skip 'build/ngx_http_dpd_module.so not built', 2
            unless -f "$root/build/ngx_http_dpd_module.so";

        # another nginx (make test-1.30) loads the module built for it:
        # a copy of the file names that one, its relative paths made
        # absolute (they are relative to the file's directory)
        my $mod = $ENV{TEST_NGINX_LOAD_MODULES} // '';
        my $own = $mod ne '' && $mod ne "$root/build/ngx_http_dpd_module.so";
        my $dir = $own ? File::Temp::tempdir(CLEANUP => 1) : undef;

        for my $conf (qw(conf/nginx.conf conf/observe.conf)) {
            my $file = $conf;
            if ($own) {
                open my $in, '<', "$root/$conf" or die "$conf: $!\n";
                my $text = do { local $/; <$in> };
                $text =~ s{^load_module\s+\S+;}{load_module $mod;}m
                    or die "$conf: no load_module line\n";
                $text =~ s{(\s)\.\./}{$1$root/}g;
                ($file = $conf) =~ s{.*/}{$dir/};
                open my $out, '>', $file or die "$file: $!\n";
                print $out $text;
                close $out;
            }
            my $out = `'$nginx' -t -p '$root' -c '$file' 2>&1`;
            is($?, 0, "$conf passes nginx -t") or diag($out);
        }
    }
}

__DATA__

=== TEST 1: all directives accepted, defaults load
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
    dpd_chat_template llama3;
    dpd_threshold 2048;
    dpd_max_json_depth 32;
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 0;
        dpd_chat_template auto;
        return 200 "ok\n";
    }
    location = /metrics { dpd_metrics; }
--- request
GET /v1/models
--- response_body
ok
--- error_log
dpd_tokenizer
128256 ids, chat template "model"
--- no_error_log
[error]


=== TEST 2: tokenizer_config.json next to tokenizer.json is found
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- config
    location /t { dpd on; return 200 "ok\n"; }
--- request
GET /t
--- response_body
ok
--- error_log
chat template "model"


=== TEST 3: dpd_tokenizer: missing file fails nginx -t with the reason
--- http_config
    dpd_tokenizer /nonexistent/tokenizer.json;
--- config
    location /t { dpd on; }
--- must_die
--- error_log
dpd_tokenizer "/nonexistent/tokenizer.json"


=== TEST 4: dpd_tokenizer: a file that is not a tokenizer fails nginx -t
--- user_files
>>> bad.json
{"model": {"type": "WordPiece"}}
--- http_config
    dpd_tokenizer html/bad.json;
--- config
    location /t { dpd on; }
--- must_die
--- error_log eval
qr/\[emerg\].*dpd_tokenizer ".*bad\.json".*: \S+/


=== TEST 5: dpd_tokenizer: bad second parameter
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 cfg=$TEST_NGINX_LLAMA3_CONFIG;
--- config
    location /t { dpd on; }
--- must_die
--- error_log
invalid parameter "cfg=


=== TEST 6: dpd_tokenizer: twice in one location (t/180 for several models)
--- config
    location /t {
        dpd_tokenizer $TEST_NGINX_LLAMA3;
        dpd_tokenizer $TEST_NGINX_LLAMA3;
    }
--- must_die
--- error_log
"dpd_tokenizer" directive is duplicate


=== TEST 7: dpd_tokenizer: duplicate
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- config
--- must_die
--- error_log
"dpd_tokenizer" directive is duplicate


=== TEST 8: dpd on without dpd_tokenizer
--- config
    location /t { dpd on; }
--- must_die
--- error_log
"dpd on" requires "dpd_tokenizer"


=== TEST 9: dpd: not a flag
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- config
    location /t { dpd yes; }
--- must_die
--- error_log
invalid value "yes" in "dpd" directive, it must be "on" or "off"


=== TEST 10: dpd_chat_template: not a name, not a readable template file
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- config
    location /t { dpd on; dpd_chat_template mistral; }
--- must_die
--- error_log
dpd_chat_template "mistral":
cannot read the chat template file


=== TEST 11: dpd_chat_template: every name accepted
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- config
    location /a { dpd on; dpd_chat_template auto; return 204; }
    location /b { dpd on; dpd_chat_template llama3; return 204; }
    location /c { dpd on; dpd_chat_template llama3.1; return 204; }
    location /d { dpd on; dpd_chat_template chatml; return 204; }
    location /e { dpd on; dpd_chat_template none; return 204; }
--- request
GET /a
--- error_code: 204
--- response_body


=== TEST 12: dpd_threshold: negative
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- config
    location /t { dpd on; dpd_threshold -1; }
--- must_die
--- error_log
"dpd_threshold" directive invalid number


=== TEST 13: dpd_threshold: not a number
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- config
    location /t { dpd on; dpd_threshold 4k; }
--- must_die
--- error_log
"dpd_threshold" directive invalid number


=== TEST 14: dpd_max_json_depth: zero
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- config
    location /t { dpd on; dpd_max_json_depth 0; }
--- must_die
--- error_log
value must be between 1 and 512


=== TEST 15: dpd_max_json_depth: above the parser's limit
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- config
    location /t { dpd on; dpd_max_json_depth 1000; }
--- must_die
--- error_log
value must be between 1 and 512


=== TEST 16: dpd_metrics takes no arguments
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- config
    location /m { dpd_metrics on; }
--- must_die
--- error_log
invalid number of arguments in "dpd_metrics" directive


=== TEST 17: dpd_metrics: only in a location
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    dpd_metrics;
--- config
--- must_die
--- error_log
"dpd_metrics" directive is not allowed here


=== TEST 18: dpd_metrics without a tokenizer still serves (all zero)
--- config
    location = /metrics { dpd_metrics; }
--- request
GET /metrics
--- response_headers
Content-Type: text/plain; version=0.0.4; charset=utf-8
--- response_body_like eval
qr/^# HELP dpd_requests_total .*\ndpd_requests_total\{route="direct",status="2xx"\} 0\n/s


=== TEST 19: dpd_metrics: other methods are refused
--- config
    location = /metrics { dpd_metrics; }
--- request
POST /metrics
x
--- error_code: 405


=== TEST 20: dpd off in a nested location turns the module off there
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- config
    location /v1/ {
        dpd on;
        location = /v1/off/completions {
            dpd off;
            proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/echo;
        }
    }
    location = /echo { return 200 "route=$dpd_route\n"; }
--- request
POST /v1/off/completions
{"prompt": 1}
--- response_body
route=
