# dpd-tokenize's command line and the loader's refusals: every bad
# tokenizer.json fails with exit 2 and a message naming the field.
# The bad files are variants of a small valid byte-level BPE built here.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/lib";
use Test::More;
use JSON::PP;
use TokTest;

skip_unless_ready();
my $cli = tokcli();
my $dir = corpus_dir() . '/bad';
system('mkdir', '-p', $dir);
my $json = JSON::PP->new->utf8->canonical;

# GPT-2 byte alphabet: printable Latin-1 stands for itself, the rest 256+
my @b2u;
my $n = 0;
for my $b (0 .. 255) {
    my $p = ($b >= 0x21 && $b <= 0x7E) || ($b >= 0xA1 && $b <= 0xAC) || ($b >= 0xAE);
    $b2u[$b] = $p ? chr($b) : chr(256 + $n++);
}
sub tiny {
    my %vocab = map { ($b2u[$_] => $_) } 0 .. 255;
    $vocab{'he'} = 256; $vocab{'ll'} = 257; $vocab{'hell'} = 258;
    $vocab{'hello'} = 259; $vocab{"\x{120}w"} = 260;
    return {
        version => '1.0', normalizer => undef,
        added_tokens => [{ id => 261, content => '<s>', special => JSON::PP::true,
                           normalized => JSON::PP::false, lstrip => JSON::PP::false,
                           rstrip => JSON::PP::false, single_word => JSON::PP::false }],
        pre_tokenizer => { type => 'Sequence', pretokenizers => [
            { type => 'Split', pattern => { Regex => '\\s?\\p{L}+|\\s+|.' },
              behavior => 'Isolated', invert => JSON::PP::false },
            { type => 'ByteLevel', add_prefix_space => JSON::PP::false,
              trim_offsets => JSON::PP::false, use_regex => JSON::PP::false } ] },
        post_processor => { type => 'TemplateProcessing',
            single => [{ SpecialToken => { id => '<s>', type_id => 0 } },
                       { Sequence => { id => 'A', type_id => 0 } }],
            pair => [{ SpecialToken => { id => '<s>', type_id => 0 } },
                     { Sequence => { id => 'A', type_id => 0 } },
                     { Sequence => { id => 'B', type_id => 1 } }],
            special_tokens => { '<s>' => { id => '<s>', ids => [261], tokens => ['<s>'] } } },
        model => { type => 'BPE', ignore_merges => JSON::PP::false, vocab => \%vocab,
                   merges => ['h e', 'l l', 'he ll', 'hell o', "\x{120} w"] },
    };
}
sub write_tok { my ($name, $d) = @_; my $f = "$dir/$name.json";
                spew($f, ref $d ? $json->encode($d) : $d); return $f }

sub run_in {
    my ($args, $input) = @_;
    spew("$dir/in.txt", $input);
    my ($rc, $err) = run_cmd("'$cli' $args < '$dir/in.txt' > '$dir/out.txt'", 20);
    return ($rc, $err, slurp("$dir/out.txt"));
}

# the valid one works: "hello" is one token, <s> matched, BOS with --special
my $good = write_tok('good', tiny());
my ($rc, $err, $out) = run_in("--tokenizer '$good' --ids", "hello world<s>");
is($rc, 0, 'tiny tokenizer loads') or diag $err;
is($out, "259 260 111 114 108 100 261\n", "tiny tokenizer ids (as the oracle gives)");
(undef, undef, $out) = run_in("--tokenizer '$good' --ids --special", "");
is($out, "261\n", 'empty text + --special gives the template BOS only');
(undef, undef, $out) = run_in("--tokenizer '$good' --count", "");
is($out, "0\n", 'empty text: count 0');
(undef, undef, $out) = run_in("--tokenizer '$good' --ids", "");
is($out, "\n", 'empty text: no ids');
(undef, undef, $out) = run_in("--tokenizer '$good' --jsonl --ids", "\"\"\n\"hello\"\n\"\\u0000\"\n");
is($out, "\n259\n0\n", '--jsonl: one line per input, empty string gives empty line');

# NUL characters: text is tokenized in full (raw or "\u0000" in --jsonl,
# never cut short); a chat request holding one is refused, as the gateway
# refuses it (cJSON would end the content there)
(undef, undef, $out) = run_in("--tokenizer '$good' --ids", "hello\0hello");
is($out, "259 0 259\n", 'raw NUL byte: the text after it is tokenized too');
(undef, undef, $out) = run_in("--tokenizer '$good' --jsonl --count", "\"\\u0000hello\"\n");
is($out, "2\n", '--jsonl "\\u0000hello": counted in full');
for my $chat ('{"messages":[{"role":"user","content":"hi\\u0000hello hello"}]}',
              '[{"role":"user","content":"hi","name":"\\u0000"}]',
              "[{\"role\":\"user\",\"content\":\"hi\"}]\0") {
    ($rc, $err, $out) = run_in("--tokenizer '$good' --chat --count --estimate", $chat);
    is($rc, 2, "--chat with a NUL character: exit 2 (" . substr($chat, 0, 40) . ")");
    like($err, qr/holds a NUL character \(\\u0000\) at byte \d+: refused/, '  ... saying why');
    is($out, '', '  ... and no count');
}
($rc, $err, $out) = run_in("--tokenizer '$good' --chat --count --estimate",
                           '[{"role":"user","content":"a\\\\u0000b"}]');
is($rc, 0, '--chat: an escaped backslash before "u0000" is no NUL') or diag $err;

my @bad = (
    ['missing file', "$dir/nonexistent.json", qr/nonexistent\.json: No such file/],
    ['invalid JSON', write_tok('badjson', '{"model": {'), qr/invalid JSON near byte \d+ \(line 1\)/],
    ['not an object', write_tok('array', '[]'), qr/not a JSON object/],
    ['no model', sub { delete $_[0]{model} }, qr/model: missing or not an object/],
    ['model type', sub { $_[0]{model}{type} = 'Unigram' }, qr/model\.type: unsupported "Unigram"/],
    ['no vocab', sub { delete $_[0]{model}{vocab} }, qr/model\.vocab: missing/],
    ['bad id', sub { $_[0]{model}{vocab}{he} = -1 }, qr/model\.vocab\["he"\]: id is not a non-negative integer/],
    ['no merges', sub { delete $_[0]{model}{merges} }, qr/model\.merges: missing/],
    ['merge shape', sub { $_[0]{model}{merges}[1] = 'l l l' }, qr/model\.merges\[1\]: "l l l" is not two tokens/],
    ['merge mix', sub { $_[0]{model}{merges}[1] = ['l', 'l'] }, qr/model\.merges\[1\]: mixes/],
    ['merge pair', sub { $_[0]{model}{merges} = [['h', 'e'], ['l']] }, qr/model\.merges\[1\]: expected/],
    ['merge side', sub { $_[0]{model}{merges}[2] = 'hx ll' }, qr/model\.merges\[2\]: token "hx" is not in model\.vocab/],
    ['merge result', sub { $_[0]{model}{merges}[2] = 'll he' }, qr/model\.merges\[2\]: merged token "llhe" is not in model\.vocab/],
    ['byte_fallback', sub { $_[0]{model}{byte_fallback} = JSON::PP::true }, qr/model\.byte_fallback: unsupported/],
    ['bad regex', sub { $_[0]{pre_tokenizer}{pretokenizers}[0]{pattern}{Regex} = '(\\p{L}' },
     qr/pre_tokenizer\.pretokenizers\[0\]\.pattern\.Regex: bad regex: missing closing parenthesis/],
    ['no pattern', sub { $_[0]{pre_tokenizer}{pretokenizers}[0]{pattern} = 'x' },
     qr/pre_tokenizer\.pretokenizers\[0\]\.pattern: expected/],
    ['behavior', sub { $_[0]{pre_tokenizer}{pretokenizers}[0]{behavior} = 'Bogus' },
     qr/pre_tokenizer\.pretokenizers\[0\]\.behavior: unsupported "Bogus"/],
    ['pre type', sub { $_[0]{pre_tokenizer}{pretokenizers}[1]{type} = 'Whitespace' },
     qr/pre_tokenizer\.pretokenizers\[1\]\.type: unsupported "Whitespace"/],
    ['unk missing', sub { pop @{$_[0]{pre_tokenizer}{pretokenizers}}; $_[0]{model}{unk_token} = '<nope>' },
     qr/model\.unk_token: "<nope>" is not in model\.vocab/],
    ['unk type', sub { $_[0]{model}{unk_token} = 5 }, qr/model\.unk_token: not a string/],
    ['metaspace rep', sub { $_[0]{pre_tokenizer} = { type => 'Metaspace', replacement => 'ab' } },
     qr/pre_tokenizer\.replacement: expected one character/],
    ['metaspace scheme', sub { $_[0]{pre_tokenizer} = { type => 'Metaspace', replacement => "\x{2581}", prepend_scheme => 'sometimes' } },
     qr/pre_tokenizer\.prepend_scheme: unsupported "sometimes"/],
    ['metaspace prefix', sub { $_[0]{pre_tokenizer} = { type => 'Metaspace', replacement => "\x{2581}",
                                                         add_prefix_space => JSON::PP::false } },
     qr/pre_tokenizer\.add_prefix_space: false does not match prepend_scheme/],
    ['replace empty', sub { $_[0]{normalizer} = { type => 'Replace', pattern => { String => '' }, content => 'x' } },
     qr/normalizer\.pattern\.String: empty/],
    ['replace regex', sub { $_[0]{normalizer} = { type => 'Sequence', normalizers => [
                              { type => 'Replace', pattern => { Regex => '(' }, content => 'x' }] } },
     qr/normalizer\.normalizers\[0\]\.pattern\.Regex: bad regex/],
    ['replace shape', sub { $_[0]{normalizer} = { type => 'Replace', pattern => 'x', content => 'y' } },
     qr/normalizer\.pattern: expected/],
    ['replace content', sub { $_[0]{normalizer} = { type => 'Replace', pattern => { String => 'x' } } },
     qr/normalizer\.content: missing or not a string/],
    ['prepend', sub { $_[0]{normalizer} = { type => 'Prepend', prepend => 1 } },
     qr/normalizer\.prepend: missing or not a string/],
    ['normalizer', sub { $_[0]{normalizer} = { type => 'Sequence', normalizers => [{ type => 'NFC' }, { type => 'Lowercase' }] } },
     qr/normalizer\.normalizers\[1\]\.type: unsupported "Lowercase"/],
    ['added content', sub { delete $_[0]{added_tokens}[0]{content} }, qr/added_tokens\[0\]\.content: missing/],
    ['added id', sub { $_[0]{added_tokens}[0]{id} = 'x' }, qr/added_tokens\[0\]\.id: missing or not/],
    ['post ids', sub { delete $_[0]{post_processor}{special_tokens}{'<s>'}{ids} },
     qr/post_processor\.special_tokens\["<s>"\]\.ids: missing/],
    ['post id range', sub { $_[0]{post_processor}{special_tokens}{'<s>'}{ids} = [999999] },
     qr/post_processor\.special_tokens\["<s>"\]\.ids: not an id of the vocabulary/],
    ['post type', sub { $_[0]{post_processor}{type} = 'Magic' }, qr/post_processor\.type: unsupported "Magic"/],
);
for my $b (@bad) {
    my ($name, $what, $re) = @$b;
    my $f = $what;
    if (ref $what eq 'CODE') {
        my $d = tiny();
        $what->($d);
        $f = write_tok("bad-$name", $d);
        $f =~ s/ /_/g if 0;
    }
    ($rc, $err) = run_in("--tokenizer '$f' --count", "x");
    is($rc, 2, "$name: exit 2");
    like($err, $re, "$name: message names the field") or diag $err;
}

# tokenizer_config.json problems name the file and the field
my $cfg = "$dir/config-bad.json";
spew($cfg, '{"bos_token": 5}');
($rc, $err) = run_in("--tokenizer '$good' --config '$cfg' --count", "x");
is($rc, 2, 'bad config: exit 2');
like($err, qr/config-bad\.json: bos_token: expected a string/, 'bad config: names the field');

# command line misuse: exit 2 with a clear message
for my $c (['', qr/--tokenizer FILE is required/],
           ["--tokenizer '$good' --frobnicate", qr/unknown option "--frobnicate"/],
           ["--tokenizer '$good' --template jinja",
            qr/--template: jinja: cannot read the chat template file/],
           ["--tokenizer", qr/--tokenizer needs a value/]) {
    my ($args, $re) = @$c;
    ($rc, $err) = run_in($args, "x");
    is($rc, 2, "usage error exits 2: $args");
    like($err, $re, "usage error message: $args");
}
($rc, $err) = run_in("--tokenizer '$good' --jsonl", "\"ok\"\nnot json\n");
is($rc, 2, 'bad JSONL line: exit 2');
like($err, qr/line 2: expected a JSON string/, 'bad JSONL line: names the line');
($rc, $err) = run_in("--tokenizer '$good' --jsonl", "\"unterminated\n");
like($err, qr/line 1: unterminated JSON string/, 'unterminated JSONL string');

# a bad line in --jsonl: an error line in its place, the others go on
($rc, $err, $out) = run_in("--tokenizer '$good' --jsonl --ids",
                           "\"hello\"\nnot json\n\"he\\u0000\"\n\n\"hello\"\n\"x\\q\"\n");
is($rc, 2, 'bad lines in the middle: exit 2 at the end');
is($out, "259\nerror: line 2: expected a JSON string\n256 0\n"
         . "error: line 4: expected a JSON string\n259\nerror: line 6: bad escape\n",
   'bad lines in the middle: an error line for each, the other lines tokenized');
like($err, qr/line 2: expected a JSON string.*line 4:.*line 6: bad escape/s,
     'bad lines in the middle: each named on stderr');
($rc, $err, $out) = run_in("--tokenizer '$good' --jsonl --count", "\"hello\"\n\"hello\"\n");
is($rc, 0, 'all lines good: exit 0');
is($out, "1\n1\n", 'all lines good: one count each');
($rc, $err, $out) = run_in("--tokenizer '$good' --jsonl --chat --count --estimate",
                           "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}\n{bad\n"
                           . "[{\"role\":\"user\",\"content\":\"hi\"}]\n");
is($rc, 2, '--chat --jsonl with a bad request: exit 2');
like($out, qr/^\d+\nerror: line 2: [^\n]*\n\d+\n\z/, '--chat --jsonl: error line in its place');

# a \u0000 inside a tokenizer.json string would be cut short by cJSON
my $nul = tiny();
$nul->{model}{vocab}{"a\x00b"} = 262;
($rc, $err) = run_in("--tokenizer '" . write_tok('nul', $nul) . "' --count", "x");
is($rc, 2, 'tokenizer.json with \\u0000 in a string: exit 2');
like($err, qr/nul\.json: a \\u0000 in a string at byte \d+ \(line 1\) is not supported/,
     '  ... saying where');

done_testing();
