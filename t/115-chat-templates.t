# ngx_http_dpd_module: chats are counted with the model's own Jinja chat
# template and the variables vLLM passes (tools, chat_template_kwargs, the
# parsed tool-call arguments), or with a template file named by
# dpd_chat_template; a request the template refuses gets vLLM's 400 with
# the template's message.  Expected counts come from outside the project:
# Python's Jinja2 set up as transformers does (t/tokenizer/jinja-render.py)
# and the Hugging Face tokenizer (t/tokenizer/hf-oracle.js).
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;
use JSON::PP ();
use File::Temp qw(tempdir);
use FindBin;

my ($llama_tj, $llama_tc) = DPD::Emu->tokenizer_files('llama3');
my ($qwen_tj, $qwen_tc) = DPD::Emu->tokenizer_files('qwen3');
my ($oss_tj) = DPD::Emu->tokenizer_files('gptoss');
plan(skip_all => 'tokenizer fixtures missing (make deps)')
    unless $llama_tj && $qwen_tj && $qwen_tc && $oss_tj;
plan(skip_all => 'python3-jinja2 or node missing (make deps)')
    if system("python3 -c 'import jinja2' 2>/dev/null") != 0
       || system('node -v >/dev/null 2>&1') != 0;
plan('no_plan');

my $root = "$FindBin::Bin/..";
my $tmp = tempdir(CLEANUP => 1);
my $JSON = JSON::PP->new->utf8->canonical;
my $l2 = "$root/t/tokenizer/data/llama2-template.jinja";

# the count vLLM reports for a request: rendered by Jinja2, ids by HF
sub oracle_count {
    my ($tj, $src, $req) = @_;
    open(my $f, '>', "$tmp/req.jsonl") or die;
    print $f $JSON->encode($req), "\n";
    close $f;
    my $r = `python3 '$root/t/tokenizer/jinja-render.py' $src < '$tmp/req.jsonl'`;
    my $text = $JSON->decode($r)->{text};
    die "oracle render failed: $r" unless defined $text;
    open($f, '>', "$tmp/text.jsonl") or die;
    print $f JSON::PP->new->utf8->allow_nonref->encode($text), "\n";
    close $f;
    my $ids = `node '$root/t/tokenizer/hf-oracle.js' '$tj' < '$tmp/text.jsonl'`;
    chomp $ids;
    my @ids = split / /, $ids;
    return scalar @ids;
}

my $tools = [{ type => 'function', function => {
    name => 'get_weather', description => 'Weather for a city.',
    parameters => { type => 'object', properties => {
        city => { type => 'string' } }, required => ['city'] } } }];

our %REQ = (
    tools => { model => 'm', tools => $tools, messages => [
        { role => 'user', content => 'Weather in Paris?' },
        { role => 'assistant', content => undef, tool_calls => [
            { id => 'c1', type => 'function', function => {
                name => 'get_weather', arguments => '{"city": "Paris"}' } }] },
        { role => 'tool', tool_call_id => 'c1', content => '22 degrees' },
        { role => 'user', content => 'And tomorrow?' }] },
    kwargs => { model => 'm', chat_template_kwargs => { enable_thinking => JSON::PP::false },
                messages => [{ role => 'user', content => 'Hi there' }] },
    emptyargs => { model => 'm', messages => [
        { role => 'user', content => 'Now?' },
        { role => 'assistant', content => '', tool_calls => [
            { id => 'c1', type => 'function', function => { name => 'now', arguments => '' } }] },
        { role => 'user', content => 'ok' }] },
    llama2 => { model => 'm', messages => [
        { role => 'system', content => 'Be brief.' },
        { role => 'user', content => 'Hello' },
        { role => 'assistant', content => ' Hi! ' },
        { role => 'user', content => [{ type => 'text', text => 'Bye' }] }] },
);

our %WANT = (
    tools => oracle_count($qwen_tj, "'$qwen_tc'", $REQ{tools}),
    kwargs => oracle_count($qwen_tj, "'$qwen_tc'", $REQ{kwargs}),
    emptyargs => oracle_count($qwen_tj, "'$qwen_tc'", $REQ{emptyargs}),
    llama2 => oracle_count($llama_tj, "'$l2' '$llama_tc'", $REQ{llama2}),
);
our %BODY = map { $_ => $JSON->encode($REQ{$_}) } keys %REQ;

# gpt-oss: vLLM renders with openai_harmony; the text below is derived by
# hand from harmony's src/encoding.rs (HEAD ec7606df) and current vLLM
# (renderers/online_renderer.py _make_request_with_harmony, commit efa1035f;
# entrypoints/openai/parser/harmony_utils.py extract_instructions_from_
# messages, build_harmony_preamble, get_system_message,
# get_system_or_developer_message): the leading system message becomes the
# developer message's "# Instructions", one in the middle a developer
# message of its own, the system message lists all three channels (see
# t/tokenizer/22-harmony.t for each part); its ids by Hugging Face
sub hf_count {
    my ($tj, $text) = @_;
    open(my $f, '>', "$tmp/text.jsonl") or die;
    print $f JSON::PP->new->utf8->allow_nonref->encode($text), "\n";
    close $f;
    my $ids = `node '$root/t/tokenizer/hf-oracle.js' '$tj' < '$tmp/text.jsonl'`;
    chomp $ids;
    return scalar(my @ids = split / /, $ids);
}
my @today = gmtime;
my $date = sprintf('%04d-%02d-%02d', $today[5] + 1900, $today[4] + 1, $today[3]);
$REQ{oss} = { model => 'm', reasoning_effort => 'low', messages => [
    { role => 'system', content => 'Answer with a number.' },
    { role => 'user', content => 'What is 2+2?' },
    { role => 'assistant', content => '4', reasoning => 'Add them.' },
    { role => 'system', content => 'Be brief.' },
    { role => 'user', content => 'And 3+3?' }] };
$BODY{oss} = $JSON->encode($REQ{oss});
$WANT{oss} = hf_count($oss_tj,
    "<|start|>system<|message|>You are ChatGPT, a large language model "
  . "trained by OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: $date\n\n"
  . "Reasoning: low\n\n# Valid channels: analysis, commentary, final. "
  . "Channel must be included for every message.<|end|>"
  . "<|start|>developer<|message|># Instructions\n\nAnswer with a number.<|end|>"
  . "<|start|>user<|message|>What is 2+2?<|end|>"
  . "<|start|>assistant<|channel|>final<|message|>4<|end|>"
  . "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>"
  . "<|start|>user<|message|>And 3+3?<|end|><|start|>assistant");
$ENV{TEST_NGINX_GPTOSS} = $oss_tj;

open(my $bad, '>', "$tmp/bad.jinja") or die;
print $bad "{% for m in messages %}\n{{ m.content }\n{% endfor %}\n";
close $bad;

$ENV{TEST_NGINX_LLAMA3} = $llama_tj;
$ENV{TEST_NGINX_QWEN3} = $qwen_tj;
$ENV{TEST_NGINX_LLAMA2_TMPL} = $l2;
$ENV{TEST_NGINX_BAD_TMPL} = "$tmp/bad.jinja";

add_block_preprocessor(sub {
    my $block = shift;

    if (!defined $block->http_config) {
        $block->set_value('http_config', <<'_EOC_');
    dpd_tokenizer $TEST_NGINX_QWEN3;
_EOC_
    }
    if (!defined $block->config) {
        $block->set_value('config', <<'_EOC_');
    location /v1/ {
        dpd on;
        add_header X-Dpd-Tokens $dpd_prompt_tokens always;
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/decoder/;
    }
    location /decoder/ { return 200 "decoder reached\n"; }
_EOC_
    }
});

no_shuffle();
log_level('info');
run_tests();

__DATA__

=== TEST 1: Qwen 3: tools are rendered into the system block, tool calls parsed
--- request eval
"POST /v1/chat/completions\n$::BODY{tools}"
--- response_headers eval
"X-Dpd-Tokens: $::WANT{tools}"
--- response_body
decoder reached


=== TEST 2: Qwen 3: chat_template_kwargs (enable_thinking false) reach the template
--- request eval
"POST /v1/chat/completions\n$::BODY{kwargs}"
--- response_headers eval
"X-Dpd-Tokens: $::WANT{kwargs}"
--- response_body
decoder reached


=== TEST 3: Qwen 3: empty tool-call arguments become {} as in vLLM
--- request eval
"POST /v1/chat/completions\n$::BODY{emptyargs}"
--- response_headers eval
"X-Dpd-Tokens: $::WANT{emptyargs}"
--- response_body
decoder reached


=== TEST 4: dpd_chat_template FILE overrides the model's template
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- config
    location /v1/ {
        dpd on;
        dpd_chat_template $TEST_NGINX_LLAMA2_TMPL;
        add_header X-Dpd-Tokens $dpd_prompt_tokens always;
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/decoder/;
    }
    location /decoder/ { return 200 "decoder reached\n"; }
--- request eval
"POST /v1/chat/completions\n$::BODY{llama2}"
--- response_headers eval
"X-Dpd-Tokens: $::WANT{llama2}"
--- response_body
decoder reached


=== TEST 5: the template raises: vLLM's 400 with the template's message, not a guess
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- config
    location /v1/ {
        dpd on;
        dpd_chat_template $TEST_NGINX_LLAMA2_TMPL;
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/decoder/;
    }
    location /decoder/ { return 200 "decoder reached\n"; }
--- request
POST /v1/chat/completions
{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
--- error_code: 400
--- response_body_like: ^\{"error":\{"message":"Conversation roles must alternate user/assistant/user/assistant/\.\.\.","type":"invalid_request_error","param":null,"code":400\}\}$


=== TEST 6: a template file that does not parse fails nginx -t with the line
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- config
    location /v1/ { dpd on; dpd_chat_template $TEST_NGINX_BAD_TMPL; }
--- must_die
--- error_log
chat template: line 2: unexpected


=== TEST 7: a template file before dpd_tokenizer in its block is compiled on that tokenizer
--- http_config
    dpd_chat_template $TEST_NGINX_LLAMA2_TMPL;
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- config
    location /v1/ {
        dpd on;
        add_header X-Dpd-Tokens $dpd_prompt_tokens always;
        proxy_pass http://127.0.0.1:$TEST_NGINX_SERVER_PORT/decoder/;
    }
    location /decoder/ { return 200 "decoder reached\n"; }
--- request eval
"POST /v1/chat/completions\n$::BODY{llama2}"
--- response_headers eval
"X-Dpd-Tokens: $::WANT{llama2}"
--- response_body
decoder reached


=== TEST 8: a template file where no block has dpd_tokenizer is refused
--- http_config
--- config
    location /v1/ {
        dpd_chat_template $TEST_NGINX_LLAMA2_TMPL;
        return 204;
    }
--- must_die
--- error_log
needs "dpd_tokenizer" in the block or a block around it


=== TEST 9: Qwen 3: an image part is left out, the text counted, said in the log
--- request
POST /v1/chat/completions
{"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
--- response_headers_like
X-Dpd-Tokens: ^\d+$
--- response_body
decoder reached
--- error_log
text counted only (messages[0].content[1]: a non-text part is not counted)


=== TEST 10: gpt-oss: the chat is counted as vLLM's harmony renders it
--- http_config
    dpd_tokenizer $TEST_NGINX_GPTOSS;
--- request eval
"POST /v1/chat/completions\n$::BODY{oss}"
--- response_headers eval
"X-Dpd-Tokens: $::WANT{oss}"
--- response_body
decoder reached


=== TEST 11: gpt-oss: what harmony refuses gets vLLM's 400, not a guess
--- http_config
    dpd_tokenizer $TEST_NGINX_GPTOSS;
--- request
POST /v1/chat/completions
{"messages": [{"role": "wizard", "content": "a"}]}
--- error_code: 400
--- response_body_like: unknown role


=== TEST 12: gpt-oss: a feature left to the estimate is counted so, said in the log
--- http_config
    dpd_tokenizer $TEST_NGINX_GPTOSS;
--- request
POST /v1/chat/completions
{"tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}, {"type": "number"}]}}}}}], "messages": [{"role": "user", "content": "a"}]}
--- response_headers_like
X-Dpd-Tokens: ^\d+$
--- response_body
decoder reached
--- error_log
estimated (harmony: a tool parameter with oneOf gets the estimate)
