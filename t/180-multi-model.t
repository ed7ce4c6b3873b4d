# ngx_http_dpd_module: several models behind one gateway.  dpd_tokenizer in
# http, server and location blocks (a block without one inherits its
# parent's): the same prompt is counted by each location's own tokenizer
# (Llama 3 and Qwen 3 count digit runs differently), the chat template
# follows the tokenizer (auto), and the same files named twice, by another
# path too, are loaded once.  dpd_model: one location for every model,
# the body's "model" picks the named location (its tokenizer, template,
# threshold and pools); unknown models get vLLM's 404.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;
use JSON::PP ();

my ($llama_tj, $llama_tc) = DPD::Emu->tokenizer_files('llama3');
my ($qwen_tj) = DPD::Emu->tokenizer_files('qwen3');
plan(skip_all => 'tokenizer fixtures or build/libdpdtok.so missing '
                 . '(make deps && make)')
    unless $llama_tj && $llama_tc && $qwen_tj && DPD::Emu->have_tokenizer_lib;
plan('no_plan');   # after the skip checks: a skip must not plan twice

my $base = $ENV{DPD_MULTI_EMU_PORT} || 19760;
our $JSON = JSON::PP->new->utf8->canonical;

my $llama = DPD::Emu->start(port => $base, side_channel_port => $base + 1,
                            tokenizer => 'llama3', args => ['--no-lmcache'],
                            default_max_tokens => 2);
my $qwen = DPD::Emu->start(port => $base + 2, side_channel_port => $base + 3,
                           tokenizer => 'qwen3', args => ['--no-lmcache'],
                           default_max_tokens => 2);

# another name for the Llama 3 file: loaded once all the same
my $link = DPD::Emu->build_dir . "/t180-llama3-link.json";
unlink $link;
symlink($llama_tj, $link) or die "symlink $link: $!\n";

$ENV{TEST_NGINX_LLAMA3} = $llama_tj;
$ENV{TEST_NGINX_LLAMA3_CONFIG} = $llama_tc;
$ENV{TEST_NGINX_LLAMA3_LINK} = $link;
$ENV{TEST_NGINX_QWEN3} = $qwen_tj;
$ENV{TEST_NGINX_LLAMA3_EMU} = $llama->addr;
$ENV{TEST_NGINX_QWEN3_EMU} = $qwen->addr;

our $PROMPT = { prompt => "Order 1234567890 shipped 9876543210 items, naïve café." };
our $CHAT = { messages => [ { role => 'user', content => 'Count 1234567890 please' } ] };
our (%N, %C);
for my $e ([llama => $llama], [qwen => $qwen]) {
    my $r = $e->[1]->post_json('/v1/completions', $PROMPT);
    die "emulator: " . $r->status_line . "\n" unless $r->is_success;
    $N{$e->[0]} = $JSON->decode($r->content)->{usage}{prompt_tokens};
    $r = $e->[1]->post_json('/v1/chat/completions', $CHAT);
    die "emulator: " . $r->status_line . "\n" unless $r->is_success;
    $C{$e->[0]} = $JSON->decode($r->content)->{usage}{prompt_tokens};
}
die "the prompt must count differently: $N{llama} / $N{qwen}\n"
    if $N{llama} == $N{qwen};
die "the chat must count differently: $C{llama} / $C{qwen}\n"
    if $C{llama} == $C{qwen};
our $REQ = "POST /PATH/v1/completions\n" . $JSON->encode($PROMPT);
our $CHAT_REQ = "POST /PATH/v1/chat/completions\n" . $JSON->encode($CHAT);
# dpd_model: one location, the model in the body picks @llama or @qwen
# (add_header in each: a block with its own drops the server's)
our $MODELS = <<'_EOC_';
    add_header X-Dpd-Model $dpd_model always;
    location /v1/ {
        dpd on;
        dpd_model llama-3 @llama;
        dpd_model qwen-3 @qwen;
        dpd_model qwen-disagg @qwen_disagg;
    }
    location @llama {
        rewrite ^/(?:any|thr)(/v1/.*)$ $1 break;
        add_header X-Dpd-Tokens $dpd_prompt_tokens always;
        add_header X-Dpd-Model $dpd_model always;
        dpd on;
        add_header X-Pool llama always;
        proxy_pass http://llama;
    }
    location @qwen {
        rewrite ^/(?:any|thr)(/v1/.*)$ $1 break;
        add_header X-Dpd-Tokens $dpd_prompt_tokens always;
        add_header X-Dpd-Model $dpd_model always;
        dpd_tokenizer $TEST_NGINX_QWEN3;
        dpd on;
        add_header X-Pool qwen always;
        proxy_pass http://qwen;
    }
    location @qwen_disagg {
        rewrite ^/(?:any|thr)(/v1/.*)$ $1 break;
        add_header X-Dpd-Tokens $dpd_prompt_tokens always;
        add_header X-Dpd-Model $dpd_model always;
        dpd_tokenizer $TEST_NGINX_QWEN3;
        dpd on;
        dpd_threshold 1;
        dpd_protocol nixl;
        dpd_prefill_pass /_pf_qwen;
        add_header X-Pool qwen always;
        add_header X-Dpd-Route $dpd_route always;
        proxy_pass http://qwen;
    }
    location /_pf_qwen/ {
        internal;
        proxy_pass http://qwen/;
    }
_EOC_
sub req { my ($tmpl, $p) = @_; (my $r = $tmpl) =~ s/PATH/$p/; $r }
sub usage_like { qr/"usage":\{"prompt_tokens":$_[0],/ }

add_block_preprocessor(sub {
    my $block = shift;

    if (!defined $block->http_config) {
        $block->set_value('http_config', <<'_EOC_');
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    upstream llama { server $TEST_NGINX_LLAMA3_EMU; }
    upstream qwen { server $TEST_NGINX_QWEN3_EMU; }
_EOC_
    }

    if (!defined $block->config) {
        $block->set_value('config', <<'_EOC_');
    add_header X-Dpd-Tokens $dpd_prompt_tokens always;

    location /llama/ {
        dpd on;
        proxy_pass http://llama/;
    }
    location /qwen/ {
        dpd_tokenizer $TEST_NGINX_QWEN3;
        dpd on;
        proxy_pass http://qwen/;
    }
    location /again/ {
        dpd_tokenizer $TEST_NGINX_LLAMA3_LINK config=$TEST_NGINX_LLAMA3_CONFIG;
        dpd on;
        proxy_pass http://llama/;
    }
_EOC_
    }
});

no_shuffle();
log_level('info');
run_tests();

__DATA__

=== TEST 1: the location's own tokenizer: Qwen 3's count, not Llama 3's
--- request eval: ::req($::REQ, 'qwen')
--- response_headers eval
"X-Dpd-Tokens: $::N{qwen}"
--- response_body_like eval: ::usage_like($::N{qwen})
--- no_error_log
[error]


=== TEST 2: a location without one inherits the http block's (Llama 3)
--- request eval: ::req($::REQ, 'llama')
--- response_headers eval
"X-Dpd-Tokens: $::N{llama}"
--- response_body_like eval: ::usage_like($::N{llama})
--- no_error_log
[error]


=== TEST 3: the chat template follows the location's tokenizer (auto)
--- request eval: ::req($::CHAT_REQ, 'qwen')
--- response_headers eval
"X-Dpd-Tokens: $::C{qwen}"
--- response_body_like eval: ::usage_like($::C{qwen})


=== TEST 4: ... and the http block's one elsewhere
--- request eval: ::req($::CHAT_REQ, 'llama')
--- response_headers eval
"X-Dpd-Tokens: $::C{llama}"
--- response_body_like eval: ::usage_like($::C{llama})


=== TEST 5: the same files by another name: loaded once, counted the same
--- request eval: ::req($::REQ, 'again')
--- response_headers eval
"X-Dpd-Tokens: $::N{llama}"
--- response_body_like eval: ::usage_like($::N{llama})
--- grep_error_log eval: qr/\d+ ids, chat|already loaded as "[^"]*"/
--- grep_error_log_out eval
"128256 ids, chat\n151669 ids, chat\nalready loaded as \"$ENV{TEST_NGINX_LLAMA3}\"\n"


=== TEST 6: a server-level tokenizer for the locations inside
--- http_config
    upstream qwen { server $TEST_NGINX_QWEN3_EMU; }
--- config
    dpd_tokenizer $TEST_NGINX_QWEN3;
    add_header X-Dpd-Tokens $dpd_prompt_tokens always;
    location /qwen/ {
        dpd on;
        proxy_pass http://qwen/;
    }
--- request eval: ::req($::REQ, 'qwen')
--- response_headers eval
"X-Dpd-Tokens: $::N{qwen}"
--- response_body_like eval: ::usage_like($::N{qwen})


=== TEST 7: dpd on with no tokenizer in any block around it
--- http_config
--- config
    location /t {
        location /t/inner { dpd_tokenizer $TEST_NGINX_QWEN3; }
        dpd on;
    }
--- must_die
--- error_log
"dpd on" requires "dpd_tokenizer" in this location or a block around it


=== TEST 8: a server's tokenizer twice
--- http_config
--- config
    dpd_tokenizer $TEST_NGINX_QWEN3;
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- must_die
--- error_log
"dpd_tokenizer" directive is duplicate



=== TEST 9: dpd_model: the request's "model" picks the location, whose tokenizer counts it
--- config eval: $::MODELS
--- request eval
"POST /v1/completions\n" . $::JSON->encode({ %$::PROMPT, model => 'qwen-3' })
--- response_headers eval
["X-Dpd-Tokens: $::N{qwen}", "X-Dpd-Model: qwen-3", "X-Pool: qwen"]
--- response_body_like eval: ::usage_like($::N{qwen})
--- no_error_log
[error]


=== TEST 10: dpd_model: the other model, the other pool and count
--- config eval: $::MODELS
--- request eval
"POST /v1/completions\n" . $::JSON->encode({ %$::PROMPT, model => 'llama-3' })
--- response_headers eval
["X-Dpd-Tokens: $::N{llama}", "X-Dpd-Model: llama-3", "X-Pool: llama"]
--- response_body_like eval: ::usage_like($::N{llama})
--- no_error_log
[error]


=== TEST 11: dpd_model: a chat is rendered with the model's template and counted by its tokenizer
--- config eval: $::MODELS
--- request eval
"POST /v1/chat/completions\n" . $::JSON->encode({ %$::CHAT, model => 'qwen-3' })
--- response_headers eval
["X-Dpd-Tokens: $::C{qwen}", "X-Pool: qwen"]
--- response_body_like eval: ::usage_like($::C{qwen})


=== TEST 12: dpd_model: a model nobody serves gets vLLM's 404, nothing is sent upstream
--- config eval: $::MODELS
--- request eval
"POST /v1/completions\n" . $::JSON->encode({ %$::PROMPT, model => 'gpt-9' })
--- error_code: 404
--- response_headers
X-Dpd-Model: gpt-9
--- response_body_like: "message":"The model `gpt-9` does not exist\.","type":"not_found_error"
--- error_log
rejected request
--- no_error_log
[error]


=== TEST 13: dpd_model: no "model" and no "*": 404 that says so
--- config eval: $::MODELS
--- request eval
"POST /v1/completions\n" . $::JSON->encode($::PROMPT)
--- error_code: 404
--- response_body_like: the request names no model, and no \\"dpd_model \*\\" takes such requests


=== TEST 14: dpd_model: a "model" that is not a string: 400
--- config eval: $::MODELS
--- request eval
"POST /v1/completions\n" . $::JSON->encode({ %$::PROMPT, model => [ 'qwen-3' ] })
--- error_code: 400
--- response_body_like: field \\"model\\" must be a string


=== TEST 15: dpd_model *: any other model and requests without one go there
--- config eval: $::MODELS . '    location /any/ { dpd on; dpd_model qwen-3 @qwen; dpd_model * @llama; }'
--- pipelined_requests eval
["POST /any/v1/completions\n" . $::JSON->encode({ %$::PROMPT, model => 'gpt-9' }),
 "POST /any/v1/completions\n" . $::JSON->encode($::PROMPT),
 "POST /any/v1/completions\n" . $::JSON->encode({ %$::PROMPT, model => 'qwen-3' })]
--- response_headers eval
["X-Pool: llama", "X-Pool: llama", "X-Pool: qwen"]
--- response_body_like eval
[::usage_like($::N{llama}), ::usage_like($::N{llama}), ::usage_like($::N{qwen})]


=== TEST 16: dpd_model in a location whose big bodies go to a thread pool: the model's tokenizer counts there
--- main_config
    thread_pool dpdmodels threads=1;
--- config eval: $::MODELS . '    location /thr/ { dpd on; dpd_count_thread_pool dpdmodels min_size=1; dpd_model qwen-3 @qwen; }'
--- request eval
"POST /thr/v1/completions\n" . $::JSON->encode({ %$::PROMPT, model => 'qwen-3' })
--- response_headers eval
["X-Dpd-Tokens: $::N{qwen}", "X-Pool: qwen"]
--- response_body_like eval: ::usage_like($::N{qwen})
--- log_level: debug
--- error_log
to the thread pool


=== TEST 17: dpd_model: the model's location decides (its threshold, its prefill pool)
--- config eval: $::MODELS
--- request eval
"POST /v1/completions\n" . $::JSON->encode({ %$::PROMPT, model => 'qwen-disagg' })
--- response_headers eval
["X-Dpd-Tokens: $::N{qwen}", "X-Dpd-Route: disaggregated", "X-Pool: qwen"]
--- response_body_like eval: ::usage_like($::N{qwen})
--- no_error_log
[error]


=== TEST 18: dpd_model: the target must be a named location of the server
--- config
    location /v1/ { dpd on; dpd_model qwen-3 @nosuch; }
--- must_die
--- error_log
"dpd_model qwen-3 @nosuch": no named location "@nosuch" in that server


=== TEST 19: dpd_model: the target needs dpd on
--- config
    location /v1/ { dpd on; dpd_model qwen-3 @off; }
    location @off { proxy_pass http://qwen; }
--- must_die
--- error_log
"dpd_model qwen-3 @off": "@off" needs "dpd on"


=== TEST 20: dpd_model: a plain location is no target, and a name twice is refused
--- config
    location /v1/ { dpd on; dpd_model qwen-3 /qwen/; }
--- must_die
--- error_log
"dpd_model qwen-3" needs a named location ("@name"), not "/qwen/"


=== TEST 21: dpd_model: the same name twice
--- config
    location @q { dpd on; proxy_pass http://qwen; }
    location /v1/ { dpd on; dpd_model qwen-3 @q; dpd_model qwen-3 @q; }
--- must_die
--- error_log
duplicate "dpd_model qwen-3"


=== TEST 22: dpd_model in a location with no tokenizer of its own nor around it: the models' count
--- http_config
    upstream qwen { server $TEST_NGINX_QWEN3_EMU; }
--- config
    location /v1/ { dpd on; dpd_model qwen-3 @qwen; }
    location @qwen {
        dpd_tokenizer $TEST_NGINX_QWEN3;
        dpd on;
        add_header X-Dpd-Tokens $dpd_prompt_tokens always;
        proxy_pass http://qwen;
    }
--- pipelined_requests eval
["POST /v1/completions\n" . $::JSON->encode({ %$::PROMPT, model => 'qwen-3' }),
 "POST /v1/completions\n" . $::JSON->encode({ %$::PROMPT, model => 'x' })]
--- error_code eval
[200, 404]
--- response_body_like eval
[::usage_like($::N{qwen}), qr/The model `x` does not exist/]
--- no_error_log
[error]
