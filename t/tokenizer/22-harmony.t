# gpt-oss chats: dpd-tokenize renders them as vLLM does, with openai_harmony
# (ngx_dpd_module/tokenizer/tok_harmony.c), not a Jinja template.  No
# harmony oracle runs here: every expected text below is derived by hand
# from the sources named next to it (openai/harmony src/encoding.rs,
# src/chat.rs, test-data/, HEAD ec7606df; current vLLM:
# vllm/renderers/online_renderer.py OnlineRenderer._make_request_with_harmony
# at commit efa1035f (what serving.py's render_chat_request calls, commit
# 006c49d4), and the vllm/entrypoints/openai/parser/harmony_utils.py it
# imports: extract_instructions_from_messages, build_harmony_preamble,
# get_system_message, get_developer_message,
# get_system_or_developer_message, parse_chat_input_to_harmony_message,
# auto_drop_analysis_messages; VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS off
# and VLLM_SYSTEM_START_DATE unset, the defaults).  The
# ids are checked against the rendered text encoded with special tokens
# (the gpt-oss completions path is proven exact against Hugging Face in
# 10-oracle-real.t) wherever the text holds no special-token string, and
# piece by piece where it does (harmony's encode_ordinary).
use strict;
use warnings;
use utf8;
use FindBin;
use lib "$FindBin::Bin/lib";
use Test::More;
use JSON::PP;
use POSIX qw(strftime);
use TokTest;

skip_unless_ready();
my $m = model_dir('gptoss');
plan skip_all => 'gpt-oss tokenizer files missing (make deps)'
    unless -f "$m/tokenizer.json";
my $dir = corpus_dir();
use File::Path qw(make_path);
make_path($dir);
my $cli = tokcli();
my $T = "'$cli' --tokenizer '$m/tokenizer.json' --config '$m/tokenizer_config.json'";
my $js = JSON::PP->new->utf8->canonical->allow_nonref;
my $n = 0;

sub run_req {
    my ($req, $flags) = @_;
    my $f = "$dir/harmony-req-$$-" . $n++ . '.json';
    spew($f, ref $req ? $js->encode($req) : $req);
    my ($rc, $err) = run_cmd("$T --chat $flags < '$f' > '$f.out'", 30);
    my $out = -f "$f.out" ? slurp("$f.out") : '';
    unlink $f, "$f.out";
    return ($rc, $err, $out);
}

# ids of a plain text, special tokens matched (the completions path)
sub ids_of {
    my ($text) = @_;
    my $f = "$dir/harmony-txt-$$-" . $n++;
    utf8::encode(my $bytes = $text);
    spew($f, $bytes);
    my ($rc, $err) = run_cmd("$T --ids < '$f' > '$f.out'", 30);
    my $out = slurp("$f.out");
    unlink $f, "$f.out";
    chomp $out;
    return $out;
}

# vLLM: datetime.now().strftime("%Y-%m-%d"); the gateway: today, UTC.
# Every date of that form is the same number of tokens.
my $date;
sub sys_msg {
    my ($effort, $tools) = @_;
    # harmony src/chat.rs SystemContent::default (identity, cutoff 2024-06,
    # channels analysis/commentary/final, required); encoding.rs
    # Render<SystemContent>: top lines joined "\n", sections "\n\n".
    # Current vLLM get_system_message no longer drops "commentary" without
    # tools (its with_custom_tools is unused); "Calls to these tools ..."
    # when a developer message has functions (encoding.rs RenderOptions
    # conversation_has_function_tools).
    return "<|start|>system<|message|>You are ChatGPT, a large language "
         . "model trained by OpenAI.\nKnowledge cutoff: 2024-06\n"
         . "Current date: $date\n\nReasoning: $effort\n\n"
         . "# Valid channels: analysis, commentary, final. Channel "
         . "must be included for every message."
         . ($tools ? "\nCalls to these tools must go to the commentary "
                   . "channel: 'functions'." : '')
         . "<|end|>";
}

sub check {
    my ($name, $req, $want, %o) = @_;
    my ($rc, $err, $out);
    for (1 .. 2) {      # a render across midnight UTC: once more
        $date = strftime('%Y-%m-%d', gmtime);
        ($rc, $err, $out) = run_req($req, '--render');
        last if $rc == 0 && $js->decode($out) eq $want->();
    }
    is($rc, 0, "$name: rendered") or diag $err;
    my $text = $rc == 0 ? $js->decode($out) : '';
    is($text, $want->(), "$name: the text harmony renders");
    ok(index($text, "\0") < 0, "$name: no NUL in the render");
    my ($rc2, $err2, $ids) = run_req($req, '--ids');
    is($rc2, 0, "$name: ids") or diag $err2;
    chomp $ids;
    my $expect = $o{ids} // ids_of($want->());
    is($ids, $expect, "$name: ids = harmony's");
    my ($rc3, $err3, $cnt) = run_req($req, '--count');
    chomp $cnt;
    my @i = split ' ', $ids;
    is($cnt, scalar(@i), "$name: count = " . scalar(@i));
    return $text;
}

# ---- plain user chat: sys, user, then <|start|>assistant
# (encoding.rs render_conversation_for_completion, Render<Message>)
check('user', { messages => [{ role => 'user', content => 'Hello' }] },
      sub { sys_msg('medium', 0)
            . '<|start|>user<|message|>Hello<|end|><|start|>assistant' });

# a bare messages array is the same request
check('bare array', [{ role => 'user', content => 'Hello' }],
      sub { sys_msg('medium', 0)
            . '<|start|>user<|message|>Hello<|end|><|start|>assistant' });

# ---- a leading system (or developer) message: _make_request_with_harmony
# takes it out (extract_instructions_from_messages: its text flattened) and
# build_harmony_preamble puts it in the developer message as instructions
# (get_developer_message -> DeveloperContent.with_instructions; encoding.rs
# Render<DeveloperContent>: "# Instructions", the text, joined "\n\n")
check('system+user', { messages => [
        { role => 'system', content => 'You are terse.' },
        { role => 'user', content => 'Hi' }] },
      sub { sys_msg('medium', 0)
            . "<|start|>developer<|message|># Instructions\n\nYou are terse.<|end|>"
            . '<|start|>user<|message|>Hi<|end|><|start|>assistant' });
check('developer+user', { messages => [
        { role => 'developer', content => [{ type => 'text', text => 'Be ' },
                                           { type => 'text', text => 'terse.' }] },
        { role => 'user', content => 'Hi' }] },
      sub { sys_msg('medium', 0)
            . "<|start|>developer<|message|># Instructions\n\nBe terse.<|end|>"
            . '<|start|>user<|message|>Hi<|end|><|start|>assistant' });
# an empty or null leading text: `if developer_instructions or tools` emits
# no developer message
for my $c ('', undef) {
    check('empty system ' . (defined $c ? '""' : 'null'), { messages => [
            { role => 'system', content => $c },
            { role => 'user', content => 'Hi' }] },
          sub { sys_msg('medium', 0)
                . '<|start|>user<|message|>Hi<|end|><|start|>assistant' });
}
# only the first message is taken: a second system message, or one later
# on, is parse_chat_input_to_harmony_message's: a developer message with
# instructions only (get_system_or_developer_message), even for "" (not
# None); null content (None) gives no message at all
check('system in the middle', { messages => [
        { role => 'system', content => 'One.' },
        { role => 'system', content => 'Two.' },
        { role => 'user', content => 'Hi' },
        { role => 'developer', content => '' },
        { role => 'system', content => undef },
        { role => 'user', content => 'Bye' }] },
      sub { sys_msg('medium', 0)
            . "<|start|>developer<|message|># Instructions\n\nOne.<|end|>"
            . "<|start|>developer<|message|># Instructions\n\nTwo.<|end|>"
            . '<|start|>user<|message|>Hi<|end|>'
            . "<|start|>developer<|message|># Instructions\n\n<|end|>"
            . '<|start|>user<|message|>Bye<|end|><|start|>assistant' });

# ---- reasoning_effort low / high (REASONING_EFFORT, "Reasoning: low")
for my $e (qw(low high)) {
    check("effort $e", { reasoning_effort => $e,
                         messages => [{ role => 'user', content => 'x' }] },
          sub { sys_msg($e, 0)
                . '<|start|>user<|message|>x<|end|><|start|>assistant' });
}

# ---- multi-turn: assistant replies go to the final channel
# (parse_chat_input_to_harmony_message: with_channel("final")); the
# reasoning of the last turn before its final is dropped by both
# auto_drop_analysis_messages forms and by harmony's
# render_conversation_into (auto_drop_analysis: analysis before the first
# final when the last assistant message is final)
check('multi-turn', { messages => [
        { role => 'user', content => 'What is 2+2?' },
        { role => 'assistant', content => '4', reasoning => 'Add them.' },
        { role => 'user', content => 'And 3+3?' }] },
      sub { sys_msg('medium', 0)
            . '<|start|>user<|message|>What is 2+2?<|end|>'
            . '<|start|>assistant<|channel|>final<|message|>4<|end|>'
            . '<|start|>user<|message|>And 3+3?<|end|><|start|>assistant' });

# an earlier turn's reasoning with finals after it: both vLLM forms, or
# harmony's own drop, leave it out
check('earlier reasoning dropped', { messages => [
        { role => 'user', content => 'a' },
        { role => 'assistant', content => 'b', reasoning => 'r1' },
        { role => 'user', content => 'c' },
        { role => 'assistant', content => 'd' },
        { role => 'user', content => 'e' }] },
      sub { sys_msg('medium', 0)
            . '<|start|>user<|message|>a<|end|>'
            . '<|start|>assistant<|channel|>final<|message|>b<|end|>'
            . '<|start|>user<|message|>c<|end|>'
            . '<|start|>assistant<|channel|>final<|message|>d<|end|>'
            . '<|start|>user<|message|>e<|end|><|start|>assistant' });

# the reasoning of an ongoing turn (no final after it) is kept: analysis
# channel (test-data/test_does_not_drop_if_ongoing_analysis.txt)
check('ongoing analysis', { messages => [
        { role => 'user', content => 'Hi' },
        { role => 'assistant', content => '', reasoning => 'Think.' }] },
      sub { sys_msg('medium', 0)
            . '<|start|>user<|message|>Hi<|end|>'
            . '<|start|>assistant<|channel|>analysis<|message|>Think.<|end|>'
            . '<|start|>assistant' });

# ---- tools: get_developer_message -> DeveloperContent.with_function_tools;
# encoding.rs template_tools_section + json_schema_to_typescript.  The
# expected text is harmony's own test-data/test_render_functions_with_
# parameters.txt without its "# Instructions" section (no leading system
# message here) and without the oneOf property (left to the estimate).
my @tools = (
    { type => 'function', function => {
        name => 'get_location', description => 'Gets the location of the user.' } },
    { type => 'function', function => {
        name => 'get_current_weather',
        description => 'Gets the current weather in the provided location.',
        parameters => { type => 'object', properties => {
            location => { type => 'string',
                          description => 'The city and state, e.g. San Francisco, CA' },
            format => { type => 'string', enum => ['celsius', 'fahrenheit'],
                        default => 'celsius' } },
            required => ['location'] } } },
    { type => 'function', function => {
        name => 'kitchensink',
        description => "A function with various complex schemas.\nSecond line.",
        parameters => { description => 'params object', type => 'object',
            properties => {
                string => { type => 'string', title => 'STRING',
                            description => 'A string', examples => ['hello', 'world'] },
                string_nullable => { type => 'string', nullable => JSON::PP::true,
                                     description => 'A nullable string',
                                     default => 'the default' },
                string_enum => { type => 'string', enum => ['a', 'b', 'c'] },
                list => { type => 'array', items => { type => 'integer' } },
                anything => { type => 'array' },
                flag => { type => 'boolean', default => JSON::PP::false },
                multi => { type => ['integer', 'string'] },
                nested => { type => 'object', description => 'inner',
                            properties => { deep => { type => 'number' } },
                            required => ['deep'] } } } } },
);
# JSON key order is the request's (harmony's serde_json has preserve_order):
# write the request by hand so the order is known
my $tools_json = '[{"type":"function","function":{"name":"get_location",'
  . '"description":"Gets the location of the user."}},'
  . '{"type":"function","function":{"name":"get_current_weather",'
  . '"description":"Gets the current weather in the provided location.",'
  . '"parameters":{"type":"object","properties":{"location":{"type":"string",'
  . '"description":"The city and state, e.g. San Francisco, CA"},'
  . '"format":{"type":"string","enum":["celsius","fahrenheit"],"default":"celsius"}},'
  . '"required":["location"]}}},'
  . '{"type":"function","function":{"name":"kitchensink",'
  . '"description":"A function with various complex schemas.\nSecond line.",'
  . '"parameters":{"description":"params object","type":"object","properties":{'
  . '"string":{"type":"string","title":"STRING","description":"A string","examples":["hello","world"]},'
  . '"string_nullable":{"type":"string","nullable":true,"description":"A nullable string","default":"the default"},'
  . '"string_enum":{"type":"string","enum":["a","b","c"]},'
  . '"list":{"type":"array","items":{"type":"integer"}},'
  . '"anything":{"type":"array"},'
  . '"flag":{"type":"boolean","default":false},'
  . '"multi":{"type":["integer","string"]},'
  . '"nested":{"type":"object","description":"inner","properties":{"deep":{"type":"number"}},"required":["deep"]}'
  . '}}}}]';
$tools_json =~ s/\n/\\n/g;
my $dev = '<|start|>developer<|message|># Tools\n\n## functions\n\n'
  . 'namespace functions {\n\n'
  . '// Gets the location of the user.\ntype get_location = () => any;\n\n'
  . '// Gets the current weather in the provided location.\n'
  . 'type get_current_weather = (_: {\n'
  . '// The city and state, e.g. San Francisco, CA\nlocation: string,\n'
  . 'format?: "celsius" | "fahrenheit", // default: celsius\n}) => any;\n\n'
  . '// A function with various complex schemas.\n// Second line.\n'
  . 'type kitchensink = (_: // params object\n{\n'
  . '// STRING\n//\n// A string\n// Examples:\n// - "hello"\n// - "world"\nstring?: string,\n'
  . '// A nullable string\nstring_nullable?: string | null, // default: "the default"\n'
  . 'string_enum?: "a" | "b" | "c",\n'
  . 'list?: number[],\n'
  . 'anything?: Array<any>,\n'
  . 'flag?: boolean, // default: false\n'
  . 'multi?: number | string,\n'
  . '// inner\n'   # the property's description, then the object's own
  . 'nested?:     // inner\n{\n    deep: number,\n    },\n'
  . '}) => any;\n\n} // namespace functions<|end|>';
$dev =~ s/\\n/\n/g;
check('tools', '{"tools":' . $tools_json . ',"messages":[{"role":"user",'
      . '"content":"What is the weather like in SF?"}]}',
      sub { sys_msg('medium', 1) . $dev
            . '<|start|>user<|message|>What is the weather like in SF?<|end|>'
            . '<|start|>assistant' });

# a leading system message with tools: "# Instructions", its text, then
# "# Tools" in the one developer message, as harmony's own
# test-data/test_render_functions_with_parameters.txt places them ("Always
# respond in riddles"); an empty text still gives the "# Instructions"
# heading once tools make the developer message
for my $i ('Always respond in riddles', '') {
    (my $with = $dev) =~ s/<\|message\|>/<|message|># Instructions\n\n$i\n\n/;
    check('system + tools' . ($i eq '' ? ' (empty text)' : ''),
          '{"tools":' . $tools_json . ',"messages":[{"role":"system","content":'
          . $js->encode($i) . '},{"role":"user",'
          . '"content":"What is the weather like in SF?"}]}',
          sub { sys_msg('medium', 1) . $with
                . '<|start|>user<|message|>What is the weather like in SF?<|end|>'
                . '<|start|>assistant' });
}

# ---- assistant tool calls and tool results: commentary channel, recipient
# functions.NAME, content type json, <|call|> (Render<Message>: assistant
# with a recipient); the result: author "functions.NAME" (the call's name
# by tool_call_id), " to=assistant", commentary, <|end|>.  The reasoning
# before the calls is kept: no final follows in this turn.
my $calls = '{"tools":[{"type":"function","function":{"name":"get_weather",'
  . '"description":"Weather.","parameters":{"type":"object","properties":'
  . '{"city":{"type":"string"}},"required":["city"]}}}],"messages":['
  . '{"role":"user","content":"Weather in Paris?"},'
  . '{"role":"assistant","content":null,"reasoning":"Call the tool.",'
  . '"tool_calls":[{"id":"c1","type":"function","function":{"name":"get_weather",'
  . '"arguments":"{\"city\":\"Paris\"}"}}]},'
  . '{"role":"tool","tool_call_id":"c1","content":"18C"}]}';
check('tool calls', $calls, sub { sys_msg('medium', 1)
      . "<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n"
      . "// Weather.\ntype get_weather = (_: {\ncity: string,\n}) => any;\n\n"
      . "} // namespace functions<|end|>"
      . '<|start|>user<|message|>Weather in Paris?<|end|>'
      . '<|start|>assistant<|channel|>analysis<|message|>Call the tool.<|end|>'
      . '<|start|>assistant to=functions.get_weather<|channel|>commentary json'
      . '<|message|>{"city":"Paris"}<|call|>'
      . '<|start|>functions.get_weather to=assistant<|channel|>commentary'
      . '<|message|>18C<|end|><|start|>assistant' });

# a preamble (content next to tool calls) goes first, to commentary with
# no recipient: <|end|>, not <|call|> (parse_chat_input_to_harmony_message;
# Render<Message>); a call's missing arguments are "" (`or ""`); the
# assistant's final answer after the result ends the list
my $pre = '{"tools":[{"type":"function","function":{"name":"now","description":""}}],'
  . '"messages":[{"role":"user","content":"Time?"},'
  . '{"role":"assistant","content":[{"type":"text","text":"Checking."}],'
  . '"tool_calls":[{"id":"t","type":"function","function":{"name":"now"}}]},'
  . '{"role":"tool","tool_call_id":"t","content":[{"type":"text","text":"noon"}]},'
  . '{"role":"assistant","content":"Noon."}]}';
check('preamble', $pre, sub { sys_msg('medium', 1)
      # an empty description: str::lines() gives no comment line
      . "<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n"
      . "type now = () => any;\n\n} // namespace functions<|end|>"
      . '<|start|>user<|message|>Time?<|end|>'
      . '<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>'
      . '<|start|>assistant to=functions.now<|channel|>commentary json<|message|><|call|>'
      . '<|start|>functions.now to=assistant<|channel|>commentary<|message|>noon<|end|>'
      . '<|start|>assistant<|channel|>final<|message|>Noon.<|end|><|start|>assistant' });

# text parts are rendered one by one (Render<Message>: each TextContent
# through render_text_into): "Hel" + "lo" are not the ids of "Hello"
{
    my $want = sub { sys_msg('medium', 0) . '<|start|>user<|message|>Hello<|end|>'
                     . '<|start|>assistant' };
    check('text parts', { messages => [{ role => 'user', content => [
              { type => 'text', text => 'Hel' }, { type => 'text', text => 'lo' }] }] },
          $want, ids => join(' ', ids_of(sys_msg('medium', 0) . '<|start|>user<|message|>'),
                             ids_of('Hel'), ids_of('lo'), ids_of('<|end|><|start|>assistant')));
    isnt(ids_of('Hello'), join(' ', ids_of('Hel'), ids_of('lo')),
         'text parts: the pieces differ from the joined text');
}

# ---- unicode, and text that spells a format token: harmony encodes text
# with encode_ordinary, so "<|end|>" in a message is text, not id 200007
my $uni = "Grüße, 世界 🌍 — <|end|>";
my $t = check('unicode', { messages => [{ role => 'user', content => $uni }] },
    sub { sys_msg('medium', 0) . "<|start|>user<|message|>$uni<|end|>"
          . '<|start|>assistant' },
    ids => join(' ', grep { length } split(' ',
        ids_of(sys_msg('medium', 0) . '<|start|>user<|message|>')),
        split(' ', do {
            # the user text alone, no special matched: its pieces' ids
            my $plain = ids_of("Grüße, 世界 🌍 — <|");
            my $rest  = ids_of("end|>");
            "$plain $rest";
        }),
        split(' ', ids_of('<|end|><|start|>assistant'))));
{
    my ($rc, $err, $ids) = run_req({ messages => [{ role => 'user', content => $uni }] }, '--ids');
    my @i = split ' ', $ids;
    is(scalar(grep { $_ == 200007 } @i), 2,
       'unicode: a "<|end|>" typed by the user is not the end token');
}

# a tool without a description is one with "" (current vLLM's
# create_tool_definition: `description or ""`; 23-harmony-oracle.t checks
# it against harmony), and an empty tools array is no tools
# (build_harmony_preamble: `if developer_instructions or tools`)
for my $nd ('{"name":"now"}', '{"name":"now","description":null}') {
    check("no description $nd", '{"tools":[{"type":"function","function":' . $nd
          . '}],"messages":[{"role":"user","content":"Time?"}]}',
          sub { sys_msg('medium', 1)
                . "<|start|>developer<|message|># Tools\n\n## functions\n\n"
                . "namespace functions {\n\ntype now = () => any;\n\n"
                . "} // namespace functions<|end|>"
                . '<|start|>user<|message|>Time?<|end|><|start|>assistant' });
}
check('empty tools', { tools => [], messages => [{ role => 'user', content => 'Hi' }] },
      sub { sys_msg('medium', 0)
            . '<|start|>user<|message|>Hi<|end|><|start|>assistant' });

# ---- refused as vLLM refuses (400), never guessed
for my $bad (
    [ 'unknown role', { messages => [{ role => 'wizard', content => 'x' }] }, qr/unknown role/ ],
    [ 'effort none', { reasoning_effort => 'none', messages => [{ role => 'user', content => 'x' }] }, qr/reasoning_effort/ ],
    [ 'effort bogus', { reasoning_effort => 'max', messages => [{ role => 'user', content => 'x' }] }, qr/reasoning_effort/ ],
    [ 'tool type', { tools => [{ type => 'retrieval', function => { name => 'f', description => 'd' } }],
                     messages => [{ role => 'user', content => 'x' }] }, qr/type "function"/ ],
    [ 'tool no name', { tools => [{ type => 'function', function => { description => 'd' } }],
                        messages => [{ role => 'user', content => 'x' }] }, qr/function.name/ ],
    [ 'bad call', { messages => [{ role => 'user', content => 'x' },
                                 { role => 'assistant', tool_calls => [5] }] }, qr/tool_calls/ ],
    [ 'empty messages', { messages => [] }, qr/empty/ ],
    [ 'both prompts', { continue_final_message => JSON::PP::true,
                        messages => [{ role => 'user', content => 'x' }] }, qr/Cannot set both/ ],
) {
    my ($name, $req, $re) = @$bad;
    my ($rc, $err) = run_req($req, '--count');
    is($rc, 2, "refused: $name (exit 2)");
    like($err, $re, "refused: $name: says why");
}

# a NUL in the request is refused before any render, as the gateway does
{
    my ($rc, $err) = run_req('{"messages":[{"role":"user","content":"a\u0000b"}]}', '--count');
    is($rc, 2, 'NUL: refused');
    like($err, qr/NUL/, 'NUL: says so');
}

# ---- not reproduced exactly: an error without --estimate, the estimate with
for my $est (
    [ 'oneOf', '{"tools":[{"type":"function","function":{"name":"f","description":"d",'
      . '"parameters":{"type":"object","properties":{"a":{"oneOf":[{"type":"string"},'
      . '{"type":"number"}]}}}}}],"messages":[{"role":"user","content":"x"}]}', qr/oneOf/ ],
    [ 'numeric default', '{"tools":[{"type":"function","function":{"name":"f","description":"d",'
      . '"parameters":{"type":"object","properties":{"a":{"type":"number","default":1}}}}}],'
      . '"messages":[{"role":"user","content":"x"}]}', qr/numeric default/ ],
    [ 'tool_choice none', '{"tool_choice":"none","tools":[{"type":"function","function":'
      . '{"name":"f","description":"d"}}],"messages":[{"role":"user","content":"x"}]}', qr/tool_choice/ ],
    [ 'image part', '{"messages":[{"role":"user","content":[{"type":"image_url",'
      . '"image_url":{"url":"http://x/y.png"}}]}]}', qr/non-text/ ],
    # an earlier turn's reasoning while this turn is still reasoning:
    # chat_completion/harmony.py drops it, parser/harmony_utils.py keeps it
    [ 'earlier reasoning', '{"messages":[{"role":"user","content":"a"},'
      . '{"role":"assistant","content":"b","reasoning":"r1"},{"role":"user","content":"c"},'
      . '{"role":"assistant","content":"","reasoning":"r2"}]}', qr/earlier turn/ ],
    [ 'reasoning_content', '{"messages":[{"role":"user","content":"a"},'
      . '{"role":"assistant","content":"b","reasoning_content":"r"}]}', qr/reasoning_content/ ],
) {
    my ($name, $req, $re) = @$est;
    my ($rc, $err) = run_req($req, '--count');
    is($rc, 2, "estimate: $name: not counted without --estimate");
    like($err, $re, "estimate: $name: says which feature");
    my $out;
    ($rc, $err, $out) = run_req($req, '--count --estimate');
    is($rc, 0, "estimate: $name: --estimate counts") or diag $err;
    like($out, qr/^\d+\n\z/, "estimate: $name: a number");
}

# the count does not depend on the date: "YYYY-MM-DD" splits into digit
# runs of 1-3 (the pre-tokenizer's \p{N}{1,3}) and every such run is one
# token of the vocabulary
{
    my $f = "$dir/harmony-digits-$$";
    spew($f, join('', map { "\"$_\"\n" } (map { sprintf '%03d', $_ } 0 .. 999),
                                      (map { sprintf '%02d', $_ } 0 .. 99), 0 .. 9));
    my ($rc, $err) = run_cmd("$T --jsonl --count < '$f' > '$f.out'", 30);
    my @c = split /\n/, slurp("$f.out");
    unlink $f, "$f.out";
    is(scalar(grep { $_ eq '1' } @c), 1110, 'every 1-3 digit run is one token: any date counts the same');
}

# ---- what a render may cost is bounded by the request's own size (8 times
# its text + 1 MiB appended, 4 steps per value + 64k lookups): past that the
# request gets the estimate, at once.  Each of these took seconds to minutes
# of CPU, or hundreds of MB of copies, before the bound.
{
    use Time::HiRes qw(time);
    my $np = 30000;
    my $props = join(',', map { "\"p$_\":{\"type\":\"string\"}" } 1 .. $np);
    my $reqd = join(',', map { "\"p$_\"" } 1 .. $np);
    my $nest = '{"type":"string","examples":[' . join(',', ('""') x 100000) . ']}';
    $nest = '{"type":"object","properties":{"a":' . $nest . '}}' for 1 .. 25;
    for my $case (
        [ 'required list per property (quadratic)',
          '{"tools":[{"type":"function","function":{"name":"f","description":"d",'
          . "\"parameters\":{\"type\":\"object\",\"properties\":{$props},\"required\":[$reqd]}}}],"
          . '"messages":[{"role":"user","content":"x"}]}' ],
        [ 'calls scanned per tool result (quadratic)',
          '{"messages":[{"role":"user","content":"x"},'
          . join(',', ('{"role":"tool","content":""}') x 3000)
          . ',{"role":"assistant","content":"y","tool_calls":['
          . join(',', ('{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}')
                      x 20000) . ']}]}' ],
        [ 'nested examples (amplification)',
          '{"tools":[{"type":"function","function":{"name":"f","description":"d",'
          . "\"parameters\":$nest}}],\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}" ],
    ) {
        my ($name, $req) = @$case;
        my $t0 = time;
        my ($rc, $err) = run_req($req, '--count');
        is($rc, 2, "bounded: $name: not counted without --estimate");
        like($err, qr/more than \d+ bytes or \d+ steps/, "bounded: $name: says why");
        my $out;
        ($rc, $err, $out) = run_req($req, '--count --estimate');
        is($rc, 0, "bounded: $name: --estimate counts") or diag $err;
        my $dt = time - $t0;
        cmp_ok($dt, '<', 10, "bounded: $name: both runs in under 10 s ($dt s)");
    }
}

done_testing();
