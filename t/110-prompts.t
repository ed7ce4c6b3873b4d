# ngx_http_dpd_module: every prompt shape is counted as vLLM counts it.
# $dpd_prompt_tokens (sent back in X-Dpd-Tokens) must equal the emulator's
# usage.prompt_tokens for the very request nginx forwarded, with the Llama 3
# and the Qwen 3 tokenizer files; the expected numbers are asked from the
# emulator itself before the blocks run.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;
use JSON::PP ();

my ($llama_tj) = DPD::Emu->tokenizer_files('llama3');
my ($qwen_tj) = DPD::Emu->tokenizer_files('qwen3');
plan(skip_all => 'tokenizer fixtures or build/libdpdtok.so missing '
                 . '(make deps && make)')
    unless $llama_tj && $qwen_tj && DPD::Emu->have_tokenizer_lib;
plan('no_plan');   # after the skip checks: a skip must not plan twice

my $base = $ENV{DPD_CORE_EMU_PORT} || 18500;
my $JSON = JSON::PP->new->utf8->canonical;

my $llama = DPD::Emu->start(port => $base, side_channel_port => $base + 1,
                            tokenizer => 'llama3', args => ['--no-lmcache'],
                            default_max_tokens => 2);
my $qwen = DPD::Emu->start(port => $base + 2,
                           side_channel_port => $base + 3,
                           tokenizer => 'qwen3', args => ['--no-lmcache'],
                           default_max_tokens => 2);

$ENV{TEST_NGINX_LLAMA3} = $llama_tj;
$ENV{TEST_NGINX_QWEN3} = $qwen_tj;
$ENV{TEST_NGINX_LLAMA3_EMU} = $llama->addr;
$ENV{TEST_NGINX_QWEN3_EMU} = $qwen->addr;

my $doc = join '', map { "Line $_: naïve café, 東京, emoji 🚀, tabs\tand "
                         . "numbers 1234567.\n" } 1 .. 40;

our %BODY = (
    string => { prompt => 'The quick brown fox jumps over the lazy dog.' },
    strings => { prompt => ['Hello world', 'Second prompt here',
                            "ünïcödé テキスト"] },
    ids => { prompt => [128000, 9906, 1917, 0, 128255] },
    id_arrays => { prompt => [[1, 2, 3], [4, 5], [128000]] },
    specials => { prompt => '<|begin_of_text|>Hi<|eot_id|> there' },
    document => { prompt => $doc },
    empty_string => { prompt => '' },
    chat => { messages => [
        { role => 'system', content => 'You are terse.' },
        { role => 'user', content => 'What is 2+2?' } ] },
    chat_turns => { messages => [
        { role => 'user', content => 'Hi' },
        { role => 'assistant', content => 'Hello! How can I help?' },
        { role => 'user', content => $doc } ] },
    chat_parts => { messages => [
        { role => 'user', content => [
            { type => 'text', text => 'Describe ' },
            { type => 'text', text => 'this sentence.' } ] } ] },
    chat_stream => { stream => JSON::PP::true,
                     stream_options => { include_usage => JSON::PP::true },
                     messages => [ { role => 'user', content => 'Stream' } ] },
);

our (%LLAMA, %QWEN, %REQ);

for my $k (sort keys %BODY) {
    my $path = exists $BODY{$k}{messages} ? '/v1/chat/completions'
                                          : '/v1/completions';
    $REQ{$k} = "POST $path\n" . $JSON->encode($BODY{$k});

    next if $k eq 'chat_stream' || $k eq 'empty_string';

    for my $e ([$llama, \%LLAMA], [$qwen, \%QWEN]) {
        next if $e->[0] == $qwen && $k =~ /^(ids|id_arrays|specials)$/;
        my $r = $e->[0]->post_json($path, $BODY{$k});
        die "emulator: $path $k: " . $r->status_line . "\n"
            unless $r->is_success;
        $e->[1]{$k} = $JSON->decode($r->content)->{usage}{prompt_tokens};
    }
}

# the streamed chat counts what the plain one with the same messages counts
$LLAMA{chat_stream} = do {
    my $r = $llama->post_json('/v1/chat/completions',
                              { messages => $BODY{chat_stream}{messages} });
    $JSON->decode($r->content)->{usage}{prompt_tokens};
};

# content tokens of the two chat messages, without specials, from the
# tokenizer's own CLI
our %CONTENT;
{
    my $cli = DPD::Emu->build_dir . '/dpd-tokenize';
    for my $m (@{ $BODY{chat}{messages} }) {
        open my $fh, '-|', 'sh', '-c',
             'printf "%s" "$1" | "$2" --tokenizer "$3" --count', 'sh',
             $m->{content}, $cli, $llama_tj
            or die "dpd-tokenize: $!\n";
        my $n = <$fh>;
        close $fh;
        die "dpd-tokenize failed\n" unless defined $n && $n =~ /^(\d+)/;
        $CONTENT{$m->{role}} = $1;
    }
}

# usage in the emulator's (vLLM's) reply: the same count
sub usage_like { qr/"usage":\{"prompt_tokens":$_[0],/ }

add_block_preprocessor(sub {
    my $block = shift;

    if (!defined $block->http_config) {
        $block->set_value('http_config', <<'_EOC_');
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    upstream emu { server $TEST_NGINX_LLAMA3_EMU; }
_EOC_
    }

    if (!defined $block->config) {
        $block->set_value('config', <<'_EOC_');
    location ~ ^/v1/(chat/)?completions$ {
        dpd on;
        add_header X-Dpd-Tokens $dpd_prompt_tokens always;
        add_header X-Dpd-Route $dpd_route always;
        proxy_pass http://emu;
        proxy_buffering off;
    }
_EOC_
    }
});

no_shuffle();
log_level('info');
run_tests();

__DATA__

=== TEST 1: completions, string prompt (with the post-processor's specials)
--- request eval: $::REQ{string}
--- response_headers eval
"X-Dpd-Tokens: $::LLAMA{string}"
--- response_body_like eval: ::usage_like($::LLAMA{string})
--- no_error_log
[error]


=== TEST 2: completions, array of strings (a batch: each one counted)
--- request eval: $::REQ{strings}
--- response_headers eval
"X-Dpd-Tokens: $::LLAMA{strings}"
--- response_body_like eval: ::usage_like($::LLAMA{strings})


=== TEST 3: completions, array of token ids (counted, not re-tokenized)
--- request eval: $::REQ{ids}
--- response_headers
X-Dpd-Tokens: 5
--- response_body_like eval: ::usage_like($::LLAMA{ids})


=== TEST 4: completions, array of token-id arrays
--- request eval: $::REQ{id_arrays}
--- response_headers
X-Dpd-Tokens: 6
--- response_body_like eval: ::usage_like($::LLAMA{id_arrays})


=== TEST 5: completions, special tokens written in the text
--- request eval: $::REQ{specials}
--- response_headers eval
"X-Dpd-Tokens: $::LLAMA{specials}"
--- response_body_like eval: ::usage_like($::LLAMA{specials})


=== TEST 6: completions, a multi-line Unicode document
--- request eval: $::REQ{document}
--- response_headers eval
"X-Dpd-Tokens: $::LLAMA{document}"
--- response_body_like eval: ::usage_like($::LLAMA{document})


=== TEST 7: completions, empty string: no tokens (as HF: no BOS either)
and vLLM's 400 passes through unchanged
--- request eval: $::REQ{empty_string}
--- error_code: 400
--- response_headers
X-Dpd-Tokens: 0
Content-Type: application/json
--- response_body_like: ^\{"error":\{"message":


=== TEST 8: chat, system + user (Llama 3 template)
--- request eval: $::REQ{chat}
--- response_headers eval
"X-Dpd-Tokens: $::LLAMA{chat}"
--- response_body_like eval: ::usage_like($::LLAMA{chat})


=== TEST 9: chat, several turns with a long document
--- request eval: $::REQ{chat_turns}
--- response_headers eval
"X-Dpd-Tokens: $::LLAMA{chat_turns}"
--- response_body_like eval: ::usage_like($::LLAMA{chat_turns})


=== TEST 10: chat, content as an array of text parts
--- request eval: $::REQ{chat_parts}
--- response_headers eval
"X-Dpd-Tokens: $::LLAMA{chat_parts}"
--- response_body_like eval: ::usage_like($::LLAMA{chat_parts})


=== TEST 11: chat, streamed with include_usage: same count, SSE through
--- request eval: $::REQ{chat_stream}
--- response_headers eval
["X-Dpd-Tokens: $::LLAMA{chat_stream}", "Content-Type: text/event-stream"]
--- response_body_like eval
qr/^data: \{.*"usage":\{"prompt_tokens":$::LLAMA{chat_stream},.*data: \[DONE\]\n\n\z/s


=== TEST 12: Qwen 3: completions string (no BOS in Qwen's post-processor)
--- http_config
    dpd_tokenizer $TEST_NGINX_QWEN3;
    upstream emu { server $TEST_NGINX_QWEN3_EMU; }
--- request eval: $::REQ{string}
--- response_headers eval
"X-Dpd-Tokens: $::QWEN{string}"
--- response_body_like eval: ::usage_like($::QWEN{string})


=== TEST 13: Qwen 3: completions document
--- http_config
    dpd_tokenizer $TEST_NGINX_QWEN3;
    upstream emu { server $TEST_NGINX_QWEN3_EMU; }
--- request eval: $::REQ{document}
--- response_headers eval
"X-Dpd-Tokens: $::QWEN{document}"
--- response_body_like eval: ::usage_like($::QWEN{document})


=== TEST 14: Qwen 3: chat (the model's own Jinja template from the config)
--- http_config
    dpd_tokenizer $TEST_NGINX_QWEN3;
    upstream emu { server $TEST_NGINX_QWEN3_EMU; }
--- request eval: $::REQ{chat}
--- response_headers eval
"X-Dpd-Tokens: $::QWEN{chat}"
--- response_body_like eval: ::usage_like($::QWEN{chat})
--- error_log
chat template "model"


=== TEST 15: Qwen 3: chat turns
--- http_config
    dpd_tokenizer $TEST_NGINX_QWEN3;
    upstream emu { server $TEST_NGINX_QWEN3_EMU; }
--- request eval: $::REQ{chat_turns}
--- response_headers eval
"X-Dpd-Tokens: $::QWEN{chat_turns}"
--- response_body_like eval: ::usage_like($::QWEN{chat_turns})


=== TEST 16: Qwen 3: chat parts
--- http_config
    dpd_tokenizer $TEST_NGINX_QWEN3;
    upstream emu { server $TEST_NGINX_QWEN3_EMU; }
--- request eval: $::REQ{chat_parts}
--- response_headers eval
"X-Dpd-Tokens: $::QWEN{chat_parts}"
--- response_body_like eval: ::usage_like($::QWEN{chat_parts})


=== TEST 17: dpd_chat_template none: the documented estimate, not exact
--- config
    location ~ ^/v1/(chat/)?completions$ {
        dpd on;
        dpd_chat_template none;
        add_header X-Dpd-Tokens $dpd_prompt_tokens always;
        proxy_pass http://emu;
    }
--- request eval: $::REQ{chat}
--- response_headers eval
# content tokens (no specials) + 4 per message + 3 priming
"X-Dpd-Tokens: " . ($::CONTENT{system} + $::CONTENT{user} + 2 * 4 + 3)
--- error_log
(estimated)
