# Chat rendering against the templates in the model files, rendered by
# npm @huggingface/jinja (t/tokenizer/jinja-render.js, with Python's
# strip/lstrip/rstrip semantics as vLLM's Jinja2 has them):
#   llama3    chat_template of the Llama 3 tokenizer_config.json
#   llama3.1  Meta's 3.1 template (t/tokenizer/data/llama31-template.jinja)
#   chatml    chat_template of the Qwen 3 tokenizer_config.json, and a
#             Qwen 2.5 style template (data/qwen25-template.jinja: default
#             system message, no <think> handling) detected from a config
# Then the token counts of the rendered prompts against the oracle, the
# template detection from tokenizer_config.json, and the errors.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/lib";
use Test::More;
use JSON::PP;
use TokTest;

skip_unless_ready(oracle => 1);
my ($chats, $multi, $plain) = need_chats();
my $dir = corpus_dir();
my $cli = tokcli();
my ($L, $Q) = (llama3(), qwen3());
my $bos = '<|begin_of_text|>';

# a Qwen 2.5 style config (default system message, no <think> handling)
my $q25 = "$dir/config-qwen25.json";
spew($q25, JSON::PP->new->utf8->canonical->encode({
    eos_token => '<|im_end|>', bos_token => undef,
    chat_template => slurp("$FindBin::Bin/data/qwen25-template.jinja") }));

my @cases = (
    # name, tokenizer dir, template source, template, bos, eos, chats[, config]
    ['llama3',   $L, "$L/tokenizer_config.json", 'llama3', $bos, '<|end_of_text|>', $chats],
    ['llama3.1', $L, "$FindBin::Bin/data/llama31-template.jinja", 'llama3.1', $bos,
     '<|end_of_text|>', $chats],
    ['chatml',   $Q, "$Q/tokenizer_config.json", 'chatml', '', '<|im_end|>', $chats],
    ['chatml-multi-calls', $Q, "$Q/tokenizer_config.json", 'chatml', '', '<|im_end|>',
     $multi],
    # Qwen 2.5 dialect, plain messages (its tool call format is not rendered)
    ['chatml-qwen2.5', $Q, "$FindBin::Bin/data/qwen25-template.jinja", 'auto', '',
     '<|im_end|>', $plain, $q25],
);

for my $c (@cases) {
    my ($name, $m, $src, $tmpl, $b, $e, $in, $cfg) = @$c;
    $cfg ||= "$m/tokenizer_config.json";
    my $base = "$m/tokenizer.json' --config '$cfg' --template $tmpl";
    my ($rc, $err) = run_cmd("node '$FindBin::Bin/jinja-render.js' '$src' '$b' '$e' "
                             . "< '$in' > '$dir/ref-$name.txt'", 60);
    is($rc, 0, "$name: jinja rendered") or diag $err;
    ($rc, $err) = run_cmd("'$cli' --tokenizer '$base --chat --jsonl --render "
                          . "< '$in' > '$dir/our-$name.txt'", 30);
    is($rc, 0, "$name: dpd-tokenize rendered") or diag $err;
    compare_lines("$name render", "$dir/ref-$name.txt", "$dir/our-$name.txt", $in);

    # ids of the prompt as vLLM counts it: rendered text, no added specials
    ($rc, $err) = run_cmd("node '$FindBin::Bin/hf-oracle.js' '$m/tokenizer.json' "
                          . "< '$dir/ref-$name.txt' > '$dir/ref-ids-$name.txt'", 60);
    is($rc, 0, "$name: oracle ran") or diag $err;
    ($rc, $err) = run_cmd("'$cli' --tokenizer '$base --chat --jsonl --ids "
                          . "< '$in' > '$dir/our-ids-$name.txt'", 30);
    is($rc, 0, "$name: dpd-tokenize --ids ran") or diag $err;
    compare_lines("$name ids", "$dir/ref-ids-$name.txt", "$dir/our-ids-$name.txt", $in);

    ($rc, $err) = run_cmd("'$cli' --tokenizer '$base --chat --jsonl --count "
                          . "< '$in' > '$dir/our-count-$name.txt'", 30);
    my @want = map { my @x = split / /; scalar @x } split /\n/, slurp("$dir/ref-ids-$name.txt");
    my @got = split /\n/, slurp("$dir/our-count-$name.txt");
    is_deeply(\@got, \@want, "$name: --count equals the oracle's number of ids");
}

# detection from tokenizer_config.json: auto renders as the named family
for my $d ([llama3 => $L], [chatml => $Q]) {
    my ($t, $m) = @$d;
    my $cmd = "'$cli' --tokenizer '$m/tokenizer.json' --config '$m/tokenizer_config.json' "
            . "--chat --jsonl --render < '$chats'";
    my $auto = `$cmd`;
    my $named = `$cmd --template $t`;
    ok(length $auto && $auto eq $named, "auto detects $t from tokenizer_config.json");
}

# a tokenizer_config.json with Meta's 3.1 template is detected as llama3.1
{
    my $t31 = slurp("$FindBin::Bin/data/llama31-template.jinja");
    my $cfg = JSON::PP->new->utf8->canonical->encode({
        bos_token => $bos, eos_token => '<|eot_id|>', chat_template => $t31 });
    spew("$dir/config-31.json", $cfg);
    my $cmd = "'$cli' --tokenizer '$L/tokenizer.json' --config '$dir/config-31.json' "
            . "--chat --jsonl --render < '$chats'";
    my $auto = `$cmd`;
    my $named = `$cmd --template llama3.1`;
    my $ref = slurp("$dir/ref-llama3.1.txt");
    ok(length $auto && $auto eq $named && $auto eq $ref,
       'auto detects llama3.1 from a config carrying the 3.1 template');
}

# errors name the field; exit status 2
my $qcli = "'$cli' --tokenizer '$L/tokenizer.json' --config '$L/tokenizer_config.json' --chat";
my @bad = (
    ['{"messages":[{"role":"user","content":"hi"},{"role":"user","content":5}]}',
     qr/messages\[1\]\.content: expected a string or an array of text parts/],
    ['{"messages":[{"role":7,"content":"hi"}]}', qr/messages\[0\]\.role: missing or not a string/],
    ['{"messages":[{"content":"hi"}]}', qr/messages\[0\]\.role: missing/],
    ['{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}',
     qr/messages\[0\]\.content\[0\]\.type: "image_url" is not supported/],
    ['{"messages":[{"role":"user","content":[{"type":"text"}]}]}',
     qr/messages\[0\]\.content\[0\]\.text: expected a string/],
    ['{"messages":{}}', qr/messages: expected an array/],
    ['{"messages":[]}', qr/messages: empty array/],
    ['{"messages":["x"]}', qr/messages\[0\]: expected an object/],
    ['{"model":"m"}', qr/messages: missing/],
    ['{"messages":[', qr/invalid JSON/],
);
for my $b (@bad) {
    my ($body, $re) = @$b;
    spew("$dir/bad-chat.json", $body);
    my ($rc, $err) = run_cmd("$qcli --count < '$dir/bad-chat.json'", 20);
    is($rc, 2, "bad chat exits 2: $body");
    like($err, $re, "message names the field: $body");
}

# unknown template: documented estimate, content tokens + 4 per message + 3
spew("$dir/est-chat.json", '{"messages":[{"role":"system","content":"Be brief."},'
     . '{"role":"user","content":[{"type":"text","text":"Hello"},{"type":"text","text":"world"}]}]}');
my ($rc, $err) = run_cmd("$qcli --template none --count < '$dir/est-chat.json' "
                         . "> '$dir/est.txt'", 20);
is($rc, 0, 'estimate: exit 0');
like($err, qr/estimate/, 'estimate: says so on stderr');
my $c1 = `printf 'Be brief.' | '$cli' --tokenizer '$L/tokenizer.json' --count`;
my $c2 = `printf 'Hello\\nworld' | '$cli' --tokenizer '$L/tokenizer.json' --count`;
is(slurp("$dir/est.txt"), ($c1 + $c2 + 2 * 4 + 3) . "\n",
   'estimate = content tokens + 4 per message + 3');
($rc, $err) = run_cmd("$qcli --template none --ids < '$dir/est-chat.json'", 20);
is($rc, 2, 'no template: --ids refused (exit 2)');

done_testing();
