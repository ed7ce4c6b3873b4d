# gpt-oss chats against openai-harmony itself: the ids dpd-tokenize --chat
# renders (ngx_dpd_module/tokenizer/tok_harmony.c) equal the ids of
# tools/python/harmony_oracle.py, which builds the harmony messages as
# current vLLM does (renderers/online_renderer.py
# _make_request_with_harmony, commit 01063cd0, and the
# parser/harmony_utils.py it imports) and renders them with harmony's own
# render_conversation_for_completion (openai-harmony 0.0.8, the pinned
# peer).  Inputs: every request 22-harmony.t renders exactly, and a
# deterministic generated set (system/developer messages, tools with
# nested schemas, tool calls and results, reasoning, every
# reasoning_effort, multi-turn, unicode, empty content).  The vocab
# harmony needs is built offline from the gpt-oss tokenizer.json by
# tools/python/make_tiktoken_vocab.py; harmony checks it against the
# published file's SHA-256.
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
my $venv = $ENV{DPD_VENV} || root() . '/.venv';
my $py = "$venv/bin/python";
plan skip_all => "no Python venv at $venv (make deps)" unless -x $py;
plan skip_all => 'openai_harmony not in the venv (make deps)'
    if system("'$py' -c 'import openai_harmony' >/dev/null 2>&1");
my $dir = corpus_dir();
use File::Path qw(make_path);
make_path($dir);
my $tt = build() . '/tiktoken';
# (re)built when missing or older than the tokenizer.json it comes from
unless (-s "$tt/o200k_base.tiktoken"
        && (stat _)[9] >= (stat "$m/tokenizer.json")[9]) {
    my ($rc, $err) = run_cmd("'$py' '" . root()
        . "/tools/python/make_tiktoken_vocab.py' '$m/tokenizer.json' '$tt'", 120);
    plan skip_all => "o200k_base.tiktoken cannot be built: $err" if $rc;
}
$ENV{TIKTOKEN_ENCODINGS_BASE} = $tt;

my $cli = tokcli();
my $T = "'$cli' --tokenizer '$m/tokenizer.json' --config '$m/tokenizer_config.json'";
my $js = JSON::PP->new->utf8->canonical;

# ---- the requests of 22-harmony.t that the gateway renders exactly
my @cases;
sub add { push @cases, [ $_[0], ref $_[1] ? $js->encode($_[1]) : $_[1] ] }
add('user', { messages => [{ role => 'user', content => 'Hello' }] });
add('bare array', [{ role => 'user', content => 'Hello' }]);
add('system+user', { messages => [{ role => 'system', content => 'You are terse.' },
                                  { role => 'user', content => 'Hi' }] });
add('developer+user', { messages => [
    { role => 'developer', content => [{ type => 'text', text => 'Be ' },
                                       { type => 'text', text => 'terse.' }] },
    { role => 'user', content => 'Hi' }] });
add("empty system $_", { messages => [{ role => 'system', content => $_ eq 'null' ? undef : '' },
                                      { role => 'user', content => 'Hi' }] })
    for '""', 'null';
add('system in the middle', { messages => [
    { role => 'system', content => 'One.' }, { role => 'system', content => 'Two.' },
    { role => 'user', content => 'Hi' }, { role => 'developer', content => '' },
    { role => 'system', content => undef }, { role => 'user', content => 'Bye' }] });
add("effort $_", { reasoning_effort => $_, messages => [{ role => 'user', content => 'x' }] })
    for qw(low medium high);
add('multi-turn', { messages => [
    { role => 'user', content => 'What is 2+2?' },
    { role => 'assistant', content => '4', reasoning => 'Add them.' },
    { role => 'user', content => 'And 3+3?' }] });
add('earlier reasoning dropped', { messages => [
    { role => 'user', content => 'a' }, { role => 'assistant', content => 'b', reasoning => 'r1' },
    { role => 'user', content => 'c' }, { role => 'assistant', content => 'd' },
    { role => 'user', content => 'e' }] });
add('ongoing analysis', { messages => [
    { role => 'user', content => 'Hi' },
    { role => 'assistant', content => '', reasoning => 'Think.' }] });
my $tools_json = '[{"type":"function","function":{"name":"get_location",'
  . '"description":"Gets the location of the user."}},'
  . '{"type":"function","function":{"name":"get_current_weather",'
  . '"description":"Gets the current weather in the provided location.",'
  . '"parameters":{"type":"object","properties":{"location":{"type":"string",'
  . '"description":"The city and state, e.g. San Francisco, CA"},'
  . '"format":{"type":"string","enum":["celsius","fahrenheit"],"default":"celsius"}},'
  . '"required":["location"]}}},'
  . '{"type":"function","function":{"name":"kitchensink",'
  . '"description":"A function with various complex schemas.\\nSecond line.",'
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
my $sf = '{"role":"user","content":"What is the weather like in SF?"}';
add('tools', "{\"tools\":$tools_json,\"messages\":[$sf]}");
add("system + tools ($_)", "{\"tools\":$tools_json,\"messages\":[{\"role\":\"system\","
    . "\"content\":\"$_\"},$sf]}") for 'Always respond in riddles', '';
add('tool calls', '{"tools":[{"type":"function","function":{"name":"get_weather",'
  . '"description":"Weather.","parameters":{"type":"object","properties":'
  . '{"city":{"type":"string"}},"required":["city"]}}}],"messages":['
  . '{"role":"user","content":"Weather in Paris?"},'
  . '{"role":"assistant","content":null,"reasoning":"Call the tool.",'
  . '"tool_calls":[{"id":"c1","type":"function","function":{"name":"get_weather",'
  . '"arguments":"{\"city\":\"Paris\"}"}}]},'
  . '{"role":"tool","tool_call_id":"c1","content":"18C"}]}');
add('preamble', '{"tools":[{"type":"function","function":{"name":"now","description":""}}],'
  . '"messages":[{"role":"user","content":"Time?"},'
  . '{"role":"assistant","content":[{"type":"text","text":"Checking."}],'
  . '"tool_calls":[{"id":"t","type":"function","function":{"name":"now"}}]},'
  . '{"role":"tool","tool_call_id":"t","content":[{"type":"text","text":"noon"}]},'
  . '{"role":"assistant","content":"Noon."}]}');
add('text parts', { messages => [{ role => 'user', content => [
    { type => 'text', text => 'Hel' }, { type => 'text', text => 'lo' }] }] });
add('unicode', { messages => [{ role => 'user', content => "Grüße, 世界 🌍 — <|end|>" }] });
# what the gateway once left to the estimate and now renders: a tool
# without a description (current vLLM: `description or ""`), an empty
# tools array (no developer message)
add('no description', '{"tools":[{"type":"function","function":{"name":"f"}}],'
    . '"messages":[{"role":"user","content":"x"}]}');
add('null description', '{"tools":[{"type":"function","function":{"name":"f",'
    . '"description":null,"parameters":{"type":"object","properties":{}}}}],'
    . '"messages":[{"role":"user","content":"x"}]}');
add('empty tools', { tools => [], messages => [{ role => 'user', content => 'x' }] });
add('empty tools, tool_choice none', { tools => [], tool_choice => 'none',
    messages => [{ role => 'system', content => 'S' }, { role => 'user', content => 'x' }] });
# schema and message shapes one by one: what json_schema_to_typescript
# does with each keyword, alone, required or not
{
    my $T = JSON::PP::true;
    my @props = (
        { type => 'string', title => 'T' },
        { type => 'string', title => 'T', description => 'D' },
        { type => 'string', examples => ['a', 1, $T, undef, { k => 'v' }] },
        { type => 'string', const => 'x' },
        { type => 'integer', enum => [1, 2, 3] },
        { enum => ['a', 1, undef] },
        { type => ['string', 'null'] },
        { type => ['string', 'null'], default => undef },
        { type => 'array', items => { type => 'array', items => { type => 'string' } } },
        { type => 'array', items => { type => 'string', enum => ['a', 'b'] } },
        { type => 'object' },
        { type => 'object', additionalProperties => { type => 'string' } },
        { type => 'object', properties => {} },
        { anyOf => [{ type => 'string' }, { type => 'number' }] },
        { type => 'string', format => 'date-time', minLength => 1 },
        { type => 'number', minimum => 0, maximum => 10 },
        {},
        { description => 'only a description' },
        { '$ref' => '#/definitions/x' },
        { type => 'string', default => "a\"b\\c\nd" },
        { type => 'boolean', default => $T, description => "multi\nline" },
        { type => 'string', nullable => $T, enum => ['a', 'b'] },
        { type => 'array' },
        { type => 'array', description => 'arr', items => { type => 'object',
          properties => { x => { type => 'string', description => 'xd' } },
          required => ['x'] } },
        { type => 'null' },
        { type => 'string', enum => [] },
        { type => 'string', examples => [] },
        { type => 'string', description => '' },
        { type => 'object', properties => { a => { type => 'object', properties => {
          b => { type => 'object', properties => {
          c => { type => 'string', description => 'deep' } } } } } } },
    );
    my $i = 0;
    for my $p (@props) {
        for my $req ([], ['a']) {
            add("shape: property $i" . (@$req ? ' (required)' : ''),
                { tools => [{ type => 'function', function => { name => "f$i",
                    description => 'd', parameters => { type => 'object',
                    properties => { a => $p }, required => $req } } }],
                  messages => [{ role => 'user', content => 'x' }] });
        }
        $i++;
    }
    $i = 0;
    for my $params ({}, { type => 'object' }, { type => 'string' },
                    { properties => { a => { type => 'string' } } },
                    { type => 'object', properties => { a => { type => 'string' } },
                      required => ['zzz'] },
                    { type => 'object', properties => { a => { type => 'string' } },
                      additionalProperties => JSON::PP::false }) {
        add('shape: parameters ' . $i++, { tools => [{ type => 'function', function => {
            name => 'g', description => 'd', parameters => $params } }],
            messages => [{ role => 'user', content => 'x' }] });
    }
    my $call = sub { { id => $_[0], type => 'function',
                       function => { name => $_[1], arguments => '{}' } } };
    $i = 0;
    for my $msgs (
        [{ role => 'user', content => '' }],
        [{ role => 'user', content => [] }],
        [{ role => 'user', content => undef }],
        [{ role => 'assistant', content => 'a' }],
        [{ role => 'assistant', content => [{ type => 'text', text => '' },
                                            { type => 'text', text => 'x' }] },
         { role => 'user', content => 'u' }],
        [{ role => 'tool', tool_call_id => 'nope', content => 'r' }],
        [{ role => 'user', content => 'u' },
         { role => 'assistant', tool_calls => [$call->('a', 'f'), $call->('b', 'g')] },
         { role => 'tool', tool_call_id => 'b', content => 'rb' },
         { role => 'tool', tool_call_id => 'a', content => 'ra' }],
        [{ role => 'user', content => 'u' }, { role => 'assistant', content => 'x', reasoning => '' }],
        [{ role => 'developer', content => 'd' }, { role => 'system', content => 's' }],
        [{ role => 'system', content => [{ type => 'text', text => 'a' }, { type => 'text', text => 'b' }] },
         { role => 'system', content => [] }],
        [{ role => 'user', content => 'u' }, { role => 'assistant', content => 'f1' },
         { role => 'assistant', content => '', reasoning => 'r' },
         { role => 'assistant', content => 'f2' }],
        [{ role => 'user', content => 'u' }, { role => 'assistant', content => undef, reasoning => 'r1' },
         { role => 'assistant', content => undef, reasoning => 'r2' }],
        [{ role => 'user', content => 'u', name => 'bob' }],
        [{ role => 'user', content => 'u' }, { role => 'assistant', content => 'a', tool_calls => [] }],
    ) {
        add('shape: messages ' . $i++, { messages => $msgs });
    }
}
# 22-harmony.t's estimate: an earlier turn's reasoning, this turn reasoning
add('earlier reasoning', '{"messages":[{"role":"user","content":"a"},'
    . '{"role":"assistant","content":"b","reasoning":"r1"},{"role":"user","content":"c"},'
    . '{"role":"assistant","content":"","reasoning":"r2"}]}');
my $n22 = @cases;

# ---- the generated set: a fixed LCG, so every run compares the same chats
my $seed = 20261204;
sub rnd { $seed = ($seed * 1103515245 + 12345) % 2147483648; return $seed % $_[0] }
sub pick { return $_[ rnd(scalar @_) ] }

my @texts = ('Hello', '', 'What is the capital of France?', "Line one\nLine two\n\n  indented",
             "Grüße, 世界 🌍 — naïve café", '<|start|>not a token<|end|>', '   ',
             "tab\there", 'مرحبا بالعالم', '12345678901234567890', "emoji 👩‍👩‍👧 family",
             '{"json": [1, 2, 3]}', "trailing space ", 'a' x 300, '日本語のテキストです。',
             "\x{1F600}\x{1F601}", 'Ünïcödé ÀÉÎÕÜ', "CRLF\r\nline", 'x');
sub text { return pick(@texts) }
sub content {
    my $t = text();
    my $k = rnd(4);
    return $t if $k < 2;
    return [{ type => 'text', text => $t }] if $k == 2;
    return [map { { type => 'text', text => text() } } 1 .. 1 + rnd(3)];
}

sub schema {
    my ($depth) = @_;
    my $k = rnd($depth > 2 ? 5 : 8);
    my %s;
    if ($k == 0) { %s = (type => 'string') }
    elsif ($k == 1) { %s = (type => 'string', enum => [map { pick(qw(red green blue a b ümlaut)) . $_ } 1 .. 1 + rnd(3)]) }
    elsif ($k == 2) { %s = (type => pick(qw(integer number))) }
    elsif ($k == 3) { %s = (type => 'boolean') }
    elsif ($k == 4) { %s = (type => 'string', default => pick('x', 'default value', '')) }
    elsif ($k == 5) { %s = (type => 'array', items => schema($depth + 1)) }
    elsif ($k == 6) { %s = %{ object_schema($depth + 1) } }
    else { %s = (type => 'array', items => object_schema($depth + 1)) }
    $s{description} = pick('A field.', "Two\nlines.", 'Ünïcode description', '')
        if rnd(2);
    $s{default} = (rnd(2) ? JSON::PP::true : JSON::PP::false)
        if ($s{type} // '') eq 'boolean' && rnd(3) == 0;
    $s{nullable} = JSON::PP::true if ($s{type} // '') eq 'string' && rnd(5) == 0;
    return \%s;
}
sub object_schema {
    my ($depth) = @_;
    my %p;
    my @names = map { pick(qw(city unit query limit options items filter name tags mode)) . "_$_" }
                1 .. 1 + rnd(4);
    $p{$_} = schema($depth) for @names;
    my %o = (type => 'object', properties => \%p);
    my @req = grep { rnd(2) } @names;
    $o{required} = \@req if @req || rnd(2);
    $o{description} = 'An object.' if rnd(4) == 0;
    return \%o;
}
sub tool {
    my ($i) = @_;
    my %f = (name => pick(qw(get_weather search lookup_user calc send_mail)) . "_$i",
             description => pick('Does a thing.', "Multi\nline description.",
                                 'Ünïcode: 天気', '', undef));
    delete $f{description} if !defined $f{description} && rnd(2);
    $f{parameters} = object_schema(0) if rnd(4);
    return { type => 'function', function => \%f };
}

# $any: reasoning in any turn, not only the last; where the two published
# forms of vLLM's auto_drop_analysis_messages then render differently the
# gateway gives the estimate (checked below)
sub chat {
    my ($any) = @_;
    my @msgs;
    my %req;
    my $e = rnd(4);
    $req{reasoning_effort} = (qw(low medium high))[$e] if $e < 3;
    my $lead = rnd(5);
    push @msgs, { role => 'system', content => content() } if $lead == 1;
    push @msgs, { role => 'developer', content => content() } if $lead == 2;
    push @msgs, { role => 'system', content => undef } if $lead == 3;
    my @tools;
    if (rnd(2)) {
        @tools = map { tool($_) } 1 .. 1 + rnd(3);
        $req{tools} = \@tools;
    }
    my $turns = 1 + rnd(4);
    my $cid = 0;
    for my $t (1 .. $turns) {
        push @msgs, { role => pick('system', 'developer'), content => content() }
            if rnd(8) == 0;
        push @msgs, { role => 'user', content => content() };
        my $last = $t == $turns;
        my $k = rnd(@tools ? 5 : 3);
        next if $last && rnd(2);        # ends with the user
        if ($k == 0) {
            push @msgs, { role => 'assistant', content => content() };
        } elsif ($k == 1) {
            # reasoning next to a final: the last turn only (see k == 2)
            push @msgs, { role => 'assistant', content => content(),
                          $last || $any ? (reasoning => text()) : () };
        } elsif ($k == 2) {
            # reasoning only: only the last turn (an earlier turn's
            # reasoning before this turn's is the documented estimate)
            push @msgs, { role => 'assistant', content => pick('', undef),
                          reasoning => text() || 'r' } if $last;
            push @msgs, { role => 'assistant', content => undef,
                          reasoning => text() || 'r' } if !$last && $any;
            push @msgs, { role => 'assistant', content => content() || 'f' } unless $last;
        } else {
            my @calls = map {
                my $tl = pick(@tools);
                { id => 'call_' . $cid++, type => 'function',
                  function => { name => $tl->{function}{name},
                                arguments => pick('{}', '{"city": "Paris"}', '',
                                                  '{"q":"天気","n":3}') } }
            } 1 .. 1 + rnd(2);
            my %a = (role => 'assistant', tool_calls => \@calls);
            $a{content} = pick(undef, '', 'Let me check.', [{ type => 'text', text => 'Checking.' }]);
            $a{reasoning} = text() if rnd(2) && ($last || $any);
            push @msgs, \%a;
            push @msgs, { role => 'tool', tool_call_id => $_->{id},
                          content => content() } for @calls;
            push @msgs, { role => 'assistant', content => content() || 'Done.' }
                if !$last || rnd(2);
        }
    }
    $req{messages} = \@msgs;
    return \%req;
}
add("generated $_", chat(0)) for 1 .. 600;
add("generated, reasoning in any turn $_", chat(1)) for 1 .. 200;

# ---- both sides, one process each
sub both {
    my ($date) = @_;
    my $f = "$dir/harmony-oracle-$$.jsonl";
    spew($f, join('', map { "$_->[1]\n" } @cases));
    my ($rc, $err) = run_cmd("$T --chat --jsonl --ids < '$f' > '$f.ours'", 300);
    my @ours = split /\n/, slurp("$f.ours");
    ($rc, $err) = run_cmd("'$py' '" . root() . "/tools/python/harmony_oracle.py' "
                          . "--jsonl --date $date < '$f' > '$f.theirs'", 300);
    die "harmony_oracle.py: $err" if $rc;
    my @theirs = split /\n/, slurp("$f.theirs");
    ($rc, $err) = run_cmd("'$py' '" . root() . "/tools/python/harmony_oracle.py' "
                          . "--jsonl --drop-turn --date $date < '$f' > '$f.turn'", 300);
    die "harmony_oracle.py --drop-turn: $err" if $rc;
    my @turn = split /\n/, slurp("$f.turn");
    unlink $f, "$f.ours", "$f.theirs", "$f.turn";
    return (\@ours, \@theirs, \@turn);
}
my ($ours, $theirs, $turn, $date);
for (1 .. 2) {          # a run across midnight UTC: once more
    $date = strftime('%Y-%m-%d', gmtime);
    ($ours, $theirs, $turn) = both($date);
    last if $date eq strftime('%Y-%m-%d', gmtime);
}
is(scalar @$ours, scalar @cases, 'dpd-tokenize: one line per request');
is(scalar @$theirs, scalar @cases, 'harmony: one line per request');

my ($same, $diff, $est, $split) = (0, 0, 0, 0);
for my $i (0 .. $#cases) {
    my ($name, $req) = @{ $cases[$i] };
    my ($o, $h) = ($ours->[$i] // '', $theirs->[$i] // '');
    unlike($h, qr/^ERROR/, "$name: harmony renders it") or diag "$h\n$req";
    if ($h ne ($turn->[$i] // '')) {
        # the two vLLM forms differ: the estimate, never one of them
        $split++;
        like($o, qr/^error:/, "$name: vLLM versions differ: the estimate");
        next;
    }
    if ($o =~ /^error:/) {
        $est++;
        fail("$name: the gateway renders it exactly") ;
        diag "$o\n$req";
        next;
    }
    if ($o eq $h) { $same++; pass("$name: ids = harmony's") }
    else {
        $diff++;
        fail("$name: ids = harmony's");
        my @a = split ' ', $o;
        my @b = split ' ', $h;
        my $k = 0;
        $k++ while $k < @a && $k < @b && $a[$k] == $b[$k];
        diag "$req\nfirst difference at id $k of " . scalar(@a) . '/' . scalar(@b)
             . ": ours [@a[$k .. ($k + 8 > $#a ? $#a : $k + 8)]] harmony's ["
             . "@b[$k .. ($k + 8 > $#b ? $#b : $k + 8)]]";
    }
}
note sprintf('compared %d requests (%d fixed: 22-harmony.t, former estimates, shapes; %d generated): '
             . '%d equal, %d differ, %d not rendered exactly by the gateway, '
             . '%d where vLLM\'s two drop forms differ (estimated)',
             scalar @cases, $n22, @cases - $n22, $same, $diff, $est, $split);
cmp_ok($split, '>', 0, 'some chats tell the two drop forms apart');
diag sprintf('harmony oracle: %d requests compared, %d mismatches, '
             . '%d left to the estimate where vLLM versions differ',
             scalar @cases, $diff + $est, $split);
is($diff + $est, 0, 'no request differs from harmony');

done_testing();
