# ngx_http_dpd_module: "dpd_count bound".  A text prompt whose byte bound
# is below dpd_threshold goes direct without the BPE count
# ($dpd_prompt_tokens empty, $dpd_prompt_tokens_bound set, counted in
# dpd_count_skipped_total, not in the prompt-token histogram); one whose
# bound reaches the threshold gets the exact count (vLLM's
# usage.prompt_tokens) and the exact N-1 / N boundary; token-id prompts
# are unchanged.  The bound must hold under Qwen's NFC normalizer for
# text that NFC expands.
use strict;
use warnings;
use utf8;

use Test::Nginx::Socket;
use DPD::Emu;
use JSON::PP ();

my ($llama_tj, $llama_tc) = DPD::Emu->tokenizer_files('llama3');
my ($qwen_tj) = DPD::Emu->tokenizer_files('qwen3');
plan(skip_all => 'tokenizer fixtures or build/libdpdtok.so missing '
                 . '(make deps && make)')
    unless $llama_tj && $llama_tc && $qwen_tj && DPD::Emu->have_tokenizer_lib
           && -x DPD::Emu->build_dir . '/dpd-tokenize';
plan('no_plan');   # after the skip checks: a skip must not plan twice

my $base = $ENV{DPD_COUNT_EMU_PORT} || 19700;
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
$ENV{TEST_NGINX_EMU} = $llama->addr;
$ENV{TEST_NGINX_QWEN3_EMU} = $qwen->addr;

sub usage {
    my ($emu, $path, $body) = @_;
    my $r = $emu->post_json($path, $body);
    die "emulator: $path: " . $r->status_line . "\n" unless $r->is_success;
    return $JSON->decode($r->content)->{usage}{prompt_tokens};
}

# bytes of the prompt the chat template renders (the module's chat bound)
sub rendered_bytes {
    my ($tj, $tc, $body) = @_;
    my $cli = DPD::Emu->build_dir . '/dpd-tokenize';
    my $in = $JSON->encode($body);
    open my $fh, '-|', 'sh', '-c',
         'printf "%s" "$1" | "$2" --tokenizer "$3" --config "$4" --chat '
         . '--render', 'sh', $in, $cli, $tj, $tc
        or die "dpd-tokenize: $!\n";
    binmode $fh;
    local $/;
    my $text = <$fh>;
    close $fh;
    die "dpd-tokenize --render failed\n" unless defined $text && length $text;
    # the CLI prints the rendered prompt as a JSON string
    return length JSON::PP->new->allow_nonref->decode($text);
}

# ids the post-processor adds to a completions prompt (none for this
# Llama 3 fixture, BOS for Meta's own tokenizer.json)
sub specials {
    my ($tj) = @_;
    my $cli = DPD::Emu->build_dir . '/dpd-tokenize';
    my $n = `printf '' | '$cli' --tokenizer '$tj' --count --special`;
    die "dpd-tokenize --count failed\n" unless defined $n && $n =~ /^(\d+)/;
    return $1;
}

our %B = (
    chat => { messages => [
        { role => 'system', content => 'You are a helpful assistant.' },
        { role => 'user', content => 'Summarize the plot of Hamlet.' } ] },
    text => { prompt => 'The quick brown fox jumps over the lazy dog.' },
    batch => { prompt => ['First prompt here', 'and a second one'] },
    ids => { prompt => [128000, 9906, 1917, 0, 128255] },
    # NFC turns each of these into more bytes (composition exclusions,
    # U+1D160): the bound must still be >= the exact count
    nfc => { prompt => "\x{FB2C}\x{0958}\x{1D160}\x{2126}" x 40 },
    big => { prompt => join(' ', ('lorem ipsum dolor sit amet') x 4000) },
);

our %R;    # request lines
for my $k (keys %B) {
    my $path = exists $B{$k}{messages} ? '/v1/chat/completions'
                                       : '/v1/completions';
    $R{$k} = "POST $path\n" . $JSON->encode($B{$k});
}

our %N = (
    chat => usage($llama, '/v1/chat/completions', $B{chat}),
    text => usage($llama, '/v1/completions', $B{text}),
    batch => usage($llama, '/v1/completions', $B{batch}),
    ids => 5,
    nfc => usage($qwen, '/v1/completions', $B{nfc}),
);

# bound of an ASCII completions string for Llama 3: bytes + specials
my $sp = specials($llama_tj);

our %BOUND = (
    chat => rendered_bytes($llama_tj, $llama_tc, $B{chat}),
    text => length($B{text}{prompt}) + $sp,
    batch => length($B{batch}{prompt}[0]) + length($B{batch}{prompt}[1])
             + 2 * $sp,
    big => length($B{big}{prompt}) + $sp,
);

for my $k (qw(chat text batch)) {
    die "test premise: bound $BOUND{$k} < count $N{$k} for $k\n"
        if $BOUND{$k} < $N{$k};
}

add_block_preprocessor(sub {
    my $block = shift;

    if (!defined $block->http_config) {
        $block->set_value('http_config', <<'_EOC_');
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    upstream emu { server $TEST_NGINX_EMU; }
_EOC_
    }

    if (!defined $block->config) {
        my $t = $block->threshold // 4096;
        my $m = $block->mode // 'bound';
        $block->set_value('config', <<"_EOC_");
    location /v1/ {
        dpd on;
        dpd_count $m;
        dpd_threshold $t;
        add_header X-Route \$dpd_route always;
        add_header X-Tokens \$dpd_prompt_tokens always;
        add_header X-Bound \$dpd_prompt_tokens_bound always;
        proxy_pass http://emu;
    }
    location = /metrics { dpd_metrics; }
_EOC_
    }
});

no_shuffle();
log_level('info');
run_tests();

$llama->stop if $llama->can('stop');
$qwen->stop if $qwen->can('stop');

__DATA__

=== TEST 1: dpd_count: bad value fails nginx -t
--- config
    location /v1/ { dpd on; dpd_count fast; }
--- must_die
--- error_log
invalid value "fast"


=== TEST 2: dpd_count: duplicate fails nginx -t
--- config
    location /v1/ { dpd on; dpd_count bound; dpd_count exact; }
--- must_die
--- error_log
"dpd_count" directive is duplicate


=== TEST 3: dpd_count: two arguments fail nginx -t
--- config
    location /v1/ { dpd on; dpd_count bound exact; }
--- must_die
--- error_log
invalid number of arguments in "dpd_count" directive


=== TEST 4: default (exact): short chat counted exactly, no bound
--- mode: exact
--- request eval
$::R{chat}
--- response_headers eval
"X-Route: direct\nX-Tokens: $::N{chat}\n!X-Bound\n"
--- response_body_like eval
qr/"prompt_tokens":$::N{chat},/


=== TEST 5: dpd_count inherited from the http block
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    dpd_count bound;
    upstream emu { server $TEST_NGINX_EMU; }
--- config
    location /v1/ {
        dpd on;
        add_header X-Tokens $dpd_prompt_tokens always;
        add_header X-Bound $dpd_prompt_tokens_bound always;
        proxy_pass http://emu;
    }
--- request eval
$::R{chat}
--- response_headers eval
"!X-Tokens\nX-Bound: $::BOUND{chat}\n"


=== TEST 6: bound, chat below the threshold: direct, no count
--- request eval
$::R{chat}
--- response_headers eval
"X-Route: direct\n!X-Tokens\nX-Bound: $::BOUND{chat}\n"
--- response_body_like eval
qr/"prompt_tokens":$::N{chat},/


=== TEST 7: bound, chat at the bound: the exact count runs, N-1 direct
--- threshold eval
$::BOUND{chat}
--- request eval
$::R{chat}
--- response_headers eval
"X-Route: direct\nX-Tokens: $::N{chat}\nX-Bound: $::BOUND{chat}\n"


=== TEST 8: bound, chat: threshold N disaggregated (observed)
--- threshold eval
$::N{chat}
--- request eval
$::R{chat}
--- response_headers eval
"X-Route: disaggregated\nX-Tokens: $::N{chat}\nX-Bound: $::BOUND{chat}\n"
--- error_log eval
"$::N{chat} prompt tokens, threshold $::N{chat}: disaggregated"


=== TEST 9: bound, chat: threshold N+1 direct with the exact count
--- threshold eval
$::N{chat} + 1
--- request eval
$::R{chat}
--- response_headers eval
"X-Route: direct\nX-Tokens: $::N{chat}\n"


=== TEST 10: bound, completions string below: direct, no count
--- request eval
$::R{text}
--- response_headers eval
"X-Route: direct\n!X-Tokens\nX-Bound: $::BOUND{text}\n"
--- response_body_like eval
qr/"prompt_tokens":$::N{text},/


=== TEST 11: bound, completions string: threshold N disaggregated
--- threshold eval
$::N{text}
--- request eval
$::R{text}
--- response_headers eval
"X-Route: disaggregated\nX-Tokens: $::N{text}\nX-Bound: $::BOUND{text}\n"


=== TEST 12: bound, completions string: threshold N+1 direct, exact
--- threshold eval
$::N{text} + 1
--- request eval
$::R{text}
--- response_headers eval
"X-Route: direct\nX-Tokens: $::N{text}\n"


=== TEST 13: bound, batch of strings: threshold N exact, below skipped
--- threshold eval
$::N{batch}
--- request eval
$::R{batch}
--- response_headers eval
"X-Route: disaggregated\nX-Tokens: $::N{batch}\nX-Bound: $::BOUND{batch}\n"


=== TEST 14: bound, batch of strings below the bound
--- threshold eval
$::BOUND{batch} + 1
--- request eval
$::R{batch}
--- response_headers eval
"X-Route: direct\n!X-Tokens\nX-Bound: $::BOUND{batch}\n"


=== TEST 15: bound, token ids: exact as before, bound = count
--- threshold: 5
--- request eval
$::R{ids}
--- response_headers
X-Route: disaggregated
X-Tokens: 5
X-Bound: 5


=== TEST 16: bound, token ids: N-1 direct
--- threshold: 6
--- request eval
$::R{ids}
--- response_headers
X-Route: direct
X-Tokens: 5


=== TEST 17: Qwen (NFC): text NFC expands still reaches threshold N
--- http_config
    dpd_tokenizer $TEST_NGINX_QWEN3;
    upstream emu { server $TEST_NGINX_QWEN3_EMU; }
--- threshold eval
$::N{nfc}
--- request eval
$::R{nfc}
--- response_headers eval
"X-Route: disaggregated\nX-Tokens: $::N{nfc}\n"
--- response_body_like eval
qr/"prompt_tokens":$::N{nfc},/


=== TEST 18: a large prompt below a large threshold: no BPE, metrics
--- threshold: 1000000
--- request eval
[ $::R{big}, $::R{text}, $::R{ids}, "GET /metrics" ]
--- response_headers eval
[ "X-Route: direct\n!X-Tokens\nX-Bound: $::BOUND{big}\n",
  "X-Route: direct\n!X-Tokens\n",
  "X-Route: direct\nX-Tokens: 5\n",
  "" ]
--- response_body_like eval
[ qr/"prompt_tokens":\d+,/, qr/"prompt_tokens":$::N{text},/,
  qr/"prompt_tokens":5,/,
  qr/dpd_prompt_tokens_count 1\n(?s:.*)dpd_decision_seconds_count 3\n(?s:.*)dpd_count_skipped_total 2\n/ ]


=== TEST 19: generated request id: $request_id is the X-Request-Id sent
--- config
    location /v1/ {
        dpd on;
        dpd_count bound;
        add_header X-Ids "$request_id $dpd_request_id" always;
        proxy_pass http://emu;
    }
--- request eval
[ $::R{text}, $::R{text} ]
--- response_headers_like eval
[ "X-Ids: ([0-9a-f]{32}) \\1", "X-Ids: ([0-9a-f]{32}) \\1" ]
--- response_body_like eval
[ qr/^\{"id":"cmpl-[0-9a-f]{32}"/, qr/^\{"id":"cmpl-[0-9a-f]{32}"/ ]
