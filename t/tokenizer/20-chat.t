# dpd-tokenize --chat: the model's own chat template (the library's Jinja
# engine) against @huggingface/jinja (t/tokenizer/jinja-render.js, with
# Python's strip/lstrip/rstrip semantics as vLLM's Jinja2 has them) on the
# chat corpora of tools/corpus/build-chats.py, rendered text, ids and
# counts against the Hugging Face oracle; then the CLI's chat flags:
# --template FILE, no template is an error unless --estimate, --special
# never doubles the BOS, image parts counted as text with a note, and the
# errors.  (21-chat-templates.t compares with Python's Jinja2 on whole
# requests and more models.)
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
my $js = JSON::PP->new->utf8->allow_nonref;

# a Qwen 2.5 style config (default system message, no <think> handling)
my $q25 = "$dir/config-qwen25.json";
spew($q25, JSON::PP->new->utf8->canonical->encode({
    eos_token => '<|im_end|>', bos_token => undef,
    chat_template => slurp("$FindBin::Bin/data/qwen25-template.jinja") }));
my $t31 = "$FindBin::Bin/data/llama31-template.jinja";

my @cases = (
    # name, tokenizer dir, config, template file (undef: the config's), chats
    ['llama3',            $L, "$L/tokenizer_config.json", undef, $chats],
    ['llama3.1',          $L, "$L/tokenizer_config.json", $t31,  $chats],
    ['qwen3',             $Q, "$Q/tokenizer_config.json", undef, $chats],
    ['qwen3-multi-calls', $Q, "$Q/tokenizer_config.json", undef, $multi],
    ['qwen2.5',           $Q, $q25,                       undef, $plain],
);

for my $c (@cases) {
    my ($name, $m, $cfg, $tmpl, $in) = @$c;
    my $src = $tmpl ? "'$tmpl' '$cfg'" : "'$cfg'";
    my $base = "'$cli' --tokenizer '$m/tokenizer.json' --config '$cfg'"
             . ($tmpl ? " --template '$tmpl'" : '');
    my ($rc, $err) = run_cmd("node '$FindBin::Bin/jinja-render.js' $src < '$in' "
                             . "> '$dir/ref-$name.jsonl'", 60);
    is($rc, 0, "$name: jinja rendered") or diag $err;
    # the reference prompts as JSON strings, one per line
    my @ref = map { $js->decode($_) } grep { length } split /\n/, slurp("$dir/ref-$name.jsonl");
    is(scalar(grep { !exists $_->{text} } @ref), 0, "$name: every chat renders")
        or diag $js->encode((grep { !exists $_->{text} } @ref)[0]);
    spew("$dir/ref-$name.txt", join('', map { $js->encode($_->{text} // '') . "\n" } @ref));

    ($rc, $err) = run_cmd("$base --chat --jsonl --render < '$in' > '$dir/our-$name.txt'", 30);
    is($rc, 0, "$name: dpd-tokenize rendered") or diag $err;
    my @ours = map { $js->decode($_) } grep { length } split /\n/, slurp("$dir/our-$name.txt");
    my @bad = grep { !defined $ours[$_] || $ours[$_] ne ($ref[$_]{text} // '') } 0 .. $#ref;
    is(scalar @bad, 0, "$name render: " . scalar(@ref) . " chats, " . scalar(@bad)
       . " mismatches");
    diag("first mismatch, line " . ($bad[0] + 1) . "\n  want: "
         . $js->encode($ref[$bad[0]]{text}) . "\n  got:  " . $js->encode($ours[$bad[0]]))
        if @bad;

    # ids of the prompt as vLLM counts it: rendered text, no added specials
    ($rc, $err) = run_cmd("node '$FindBin::Bin/hf-oracle.js' '$m/tokenizer.json' "
                          . "< '$dir/ref-$name.txt' > '$dir/ref-ids-$name.txt'", 60);
    is($rc, 0, "$name: oracle ran") or diag $err;
    ($rc, $err) = run_cmd("$base --chat --jsonl --ids < '$in' > '$dir/our-ids-$name.txt'", 30);
    is($rc, 0, "$name: dpd-tokenize --ids ran") or diag $err;
    compare_lines("$name ids", "$dir/ref-ids-$name.txt", "$dir/our-ids-$name.txt", $in);

    ($rc, $err) = run_cmd("$base --chat --jsonl --count < '$in' > '$dir/our-count-$name.txt'", 30);
    my @want = map { my @x = split / /; scalar @x } split /\n/, slurp("$dir/ref-ids-$name.txt");
    my @got = split /\n/, slurp("$dir/our-count-$name.txt");
    is_deeply(\@got, \@want, "$name: --count equals the oracle's number of ids");
}

# the old family names mean the model's own template (auto)
{
    my $cmd = "'$cli' --tokenizer '$L/tokenizer.json' --config '$L/tokenizer_config.json' "
            . "--chat --jsonl --render < '$chats'";
    my $auto = `$cmd`;
    my $named = `$cmd --template llama3.1`;
    ok(length $auto && $auto eq $named, '--template llama3.1 (an old name) = the model\'s template');
}

my $qcli = "'$cli' --tokenizer '$Q/tokenizer.json' --config '$Q/tokenizer_config.json' --chat";
my $lcli = "'$cli' --tokenizer '$L/tokenizer.json' --config '$L/tokenizer_config.json' --chat";

# --special with --chat never doubles the BOS: the template carries it
spew("$dir/one-chat.json", '{"messages":[{"role":"user","content":"Hello"}]}');
my $plainc = `$lcli --count < '$dir/one-chat.json'`;
my $specc = `$lcli --count --special < '$dir/one-chat.json'`;
my $ids = `$lcli --ids --special < '$dir/one-chat.json'`;
ok(length $plainc && $plainc eq $specc, '--chat --special: same count as without');
like($ids, qr/^128000 128006 /, '--chat --special: one BOS (128000) then the header');
unlike($ids, qr/^128000 128000/, '--chat --special: no doubled BOS');

# image parts: the text counted, said on stderr (as the gateway logs it)
spew("$dir/img-chat.json", '{"messages":[{"role":"user","content":[{"type":"text",'
     . '"text":"Hello"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AA"}}]}]}');
my ($rc, $err) = run_cmd("$lcli --count < '$dir/img-chat.json' > '$dir/img.txt'", 20);
is($rc, 0, 'image part: exit 0');
like($err, qr/text counted only \(messages\[0\]\.content\[1\]/, 'image part: said on stderr');
is(slurp("$dir/img.txt"), $plainc, 'image part: the count of the text alone');

# no template: an error, unless --estimate (the documented estimate)
spew("$dir/est-chat.json", '{"messages":[{"role":"system","content":"Be brief."},'
     . '{"role":"user","content":[{"type":"text","text":"Hello"},{"type":"text","text":"world"}]}]}');
my $nocfg = "'$cli' --tokenizer '$L/tokenizer.json' --config none --chat";
($rc, $err) = run_cmd("$nocfg --count < '$dir/est-chat.json'", 20);
is($rc, 2, 'no template: --chat --count is an error (exit 2)');
like($err, qr/no chat template.*--estimate/s, 'no template: the error says --estimate');
($rc, $err) = run_cmd("$lcli --template none --count < '$dir/est-chat.json'", 20);
is($rc, 2, '--template none without --estimate: exit 2');
($rc, $err) = run_cmd("$nocfg --count --estimate < '$dir/est-chat.json' > '$dir/est.txt'", 20);
is($rc, 0, 'estimate: exit 0');
like($err, qr/estimate/, 'estimate: says so on stderr');
my $c1 = `printf 'Be brief.' | '$cli' --tokenizer '$L/tokenizer.json' --count`;
my $c2 = `printf 'Hello\\nworld' | '$cli' --tokenizer '$L/tokenizer.json' --count`;
is(slurp("$dir/est.txt"), ($c1 + $c2 + 2 * 4 + 3) . "\n",
   'estimate = content tokens + 4 per message + 3');
($rc, $err) = run_cmd("$nocfg --ids --estimate < '$dir/est-chat.json'", 20);
is($rc, 2, '--estimate needs --count (exit 2)');

# invalid UTF-8 in a request (the module passes the body's bytes on): a
# string iterated as a list has as many items as its length says (stray
# continuation bytes are one U+FFFD each), and slicing agrees; the list
# was sized by lead bytes and written past its end (found by
# tok_fuzz_jinja)
spew("$dir/iter.jinja", '{% set c = messages[0].content %}{{ c | length }} '
     . '{{ c | list | length }} {% for x in c %}[{{ x }}]{% endfor %} {{ c[2:4] }}');
spew("$dir/iter-chat.json", '{"messages":[{"role":"user","content":"a'
     . ("\x8e" x 40) . "\xe4\xb8b\xf0\x9f\x98\x80\"}]}");
{
    my $out = `$lcli --template '$dir/iter.jinja' --render < '$dir/iter-chat.json' 2>&1`;
    my ($len, $items) = $out =~ /^"?(\d+) (\d+) /;
    my $loop = () = $out =~ /\[[^\]]*\]/g;
    is($len, 44, 'invalid UTF-8: a stray continuation byte is one code point');
    is($items, $len, 'invalid UTF-8: a string as a list has as many items as its length');
    is($loop, $len, 'invalid UTF-8: a for loop over it as many turns');
    like($out, qr/ \x8e\x8e"?\n?$/, 'invalid UTF-8: slicing steps the same way');
}

# --template FILE: a template that does not parse names its line
spew("$dir/bad.jinja", "{% if messages %}\n{{ messages[0].content }}\n");
($rc, $err) = run_cmd("$lcli --template '$dir/bad.jinja' --count < '$dir/one-chat.json'", 20);
is($rc, 2, 'unparsable template file: exit 2');
like($err, qr/chat template: line \d+: unexpected end of template, expected '\{% elif %\}' or '\{% else %\}' or '\{% endif %\}'/,
     'unparsable template file: the line and what was expected');
spew("$dir/raise.jinja", "{{ raise_exception('Only user turns, please.') }}");
($rc, $err) = run_cmd("$lcli --template '$dir/raise.jinja' --count < '$dir/one-chat.json'", 20);
is($rc, 2, 'a template that raises: exit 2');
like($err, qr/Only user turns, please\./, 'a template that raises: its message');

# errors name the field; exit status 2
my @bad = (
    ['{"messages":[{"role":"user","content":"hi"},{"role":"user","content":5}]}',
     qr/messages\[1\]\.content: expected a string or an array of content parts/],
    ['{"messages":[{"role":7,"content":"hi"}]}', qr/messages\[0\]\.role: missing or not a string/],
    ['{"messages":[{"content":"hi"}]}', qr/messages\[0\]\.role: missing/],
    ['{"messages":[{"role":"user","content":[{"type":"video_game"}]}]}',
     qr/messages\[0\]\.content\[0\]: Unsupported chat content part type: 'video_game'/],
    ['{"messages":[{"role":"user","content":[{"type":"text","text":5}]}]}',
     qr/messages\[0\]\.content\[0\]\.text: expected a string/],
    ['{"messages":{}}', qr/messages: expected an array/],
    ['{"messages":[]}', qr/messages: empty array/],
    ['{"messages":["x"]}', qr/messages\[0\]: expected an object/],
    ['{"model":"m"}', qr/messages: missing/],
    ['{"messages":[', qr/invalid JSON/],
    ['{"messages":[{"role":"user","content":"hi"}],"tools":{}}', qr/tools: expected an array/],
    ['{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}]}',
     qr/tools\[0\]: expected/],
    ['{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":[1]}',
     qr/chat_template_kwargs: expected an object/],
    ['{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"tokenize":true}}',
     qr/unexpected chat_template_kwargs/],
    ['{"messages":[{"role":"user","content":"hi"}],"continue_final_message":true}',
     qr/Cannot set both `continue_final_message` and `add_generation_prompt`/],
    ['{"messages":[{"role":"assistant","content":"x","tool_calls":[{"id":"a"}]}]}',
     qr/messages\[0\]\.tool_calls\[0\]: chat completions only support assistant tool_calls of type 'function'/],
    ['{"messages":[{"role":"assistant","content":"x","tool_calls":[{"type":"x","function":{"name":"f"}}]}]}',
     qr/messages\[0\]\.tool_calls\[0\]: chat completions only support/],
);
for my $b (@bad) {
    my ($body, $re) = @$b;
    spew("$dir/bad-chat.json", $body);
    ($rc, $err) = run_cmd("$qcli --count < '$dir/bad-chat.json'", 20);
    is($rc, 2, "bad chat exits 2: $body");
    like($err, $re, "message names the field: $body");
}

done_testing();
