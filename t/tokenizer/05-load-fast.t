# The fast load path (tok_load_fast.c: model.vocab and model.merges read
# from the text, cJSON for the rest) against cJSON for the whole file, by
# load_diff.c: every model file under the npm fixtures, variants of a small
# tokenizer that probe the corners (duplicate keys and members, escapes and
# surrogates, \u0000, odd numbers, whitespace, trailing bytes, nesting,
# truncation), thousands of mutations of them; each must give the same
# refusal message or byte-equal tables, and the usual files must take the
# fast path.  Then the small ones under valgrind.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/lib";
use Test::More;
use JSON::PP;
use TokTest;

skip_unless_ready();
my $lib = build() . '/libdpdtok.a';
plan skip_all => 'build/libdpdtok.a not built' unless -f $lib;
my $dir = corpus_dir() . '/load-fast';
system('mkdir', '-p', $dir);
my $exe = "$dir/load_diff";
my $inc = root() . '/ngx_dpd_module/tokenizer';
my ($rc, $err) = run_cmd("cc -std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Werror "
                         . "-I'$inc' '$FindBin::Bin/load_diff.c' '$lib' -lpcre2-8 "
                         . "-lcjson -lutf8proc -lpthread -lm -o '$exe'", 60);
is($rc, 0, 'load_diff builds') or diag $err;

# "FILE: fast F/T loaded L/T diffs D" per file
sub diff_run {
    my ($pre, $args) = @_;
    my $out = `$pre '$exe' $args 2>&1`;
    my %r;
    for (split /\n/, $out) {
        $r{$1} = { fast => $2, loaded => $3, tries => $4, diffs => $5 }
            if m{^(.*): fast (\d+)/\d+ loaded (\d+)/(\d+) diffs (\d+)$};
    }
    return ($? >> 8, $out, \%r);
}

# every real model file: fast path taken, tables equal to cJSON's
my @models = grep { -f } map { model_dir($_) . '/tokenizer.json' } oracle_models();
SKIP: {
    skip 'npm fixtures missing', 1 unless @models;
    my ($x, $out, $r) = diff_run('timeout 300', join ' ', map { "'$_'" } @models);
    is($x, 0, scalar(@models) . ' model files: both paths agree') or diag $out;
    for my $f (@models) {
        my ($m) = $f =~ m{tokenizer-([^/]+)/};
        ok($r->{$f} && $r->{$f}{fast} == 1 && $r->{$f}{loaded} == 1
           && $r->{$f}{diffs} == 0, "$m: fast path, same tables as cJSON");
    }
}

# a small byte-level BPE (the one of 01-cli-errors.t)
my @b2u;
my $n = 0;
for my $b (0 .. 255) {
    my $p = ($b >= 0x21 && $b <= 0x7E) || ($b >= 0xA1 && $b <= 0xAC) || ($b >= 0xAE);
    $b2u[$b] = $p ? chr($b) : chr(256 + $n++);
}
my %vocab = map { ($b2u[$_] => $_) } 0 .. 255;
$vocab{'he'} = 256; $vocab{'ll'} = 257; $vocab{'hell'} = 258;
$vocab{'hello'} = 259; $vocab{"\x{120}w"} = 260;
my $tiny = {
    version => '1.0', normalizer => undef,
    added_tokens => [{ id => 261, content => '<s>', special => JSON::PP::true,
                       normalized => JSON::PP::false }],
    pre_tokenizer => { type => 'ByteLevel', add_prefix_space => JSON::PP::false,
                       use_regex => JSON::PP::true },
    post_processor => { type => 'ByteLevel' },
    model => { type => 'BPE', vocab => \%vocab,
               merges => ['h e', 'l l', 'he ll', 'hell o', "\x{120} w"] },
};
my $compact = JSON::PP->new->utf8->canonical->encode($tiny);
my $pretty = JSON::PP->new->utf8->canonical->pretty->encode($tiny);
my $pairs = do {
    my %t = %$tiny;
    $t{model} = { %{ $tiny->{model} }, merges => [map { [split / /] } @{ $tiny->{model}{merges} }] };
    JSON::PP->new->utf8->canonical->pretty->encode(\%t);
};
# in the canonical text: model's keys are merges, type, vocab; the
# vocabulary opens with "!":33 and model is followed by "normalizer"
my $sub = sub { my ($re, $to, $t) = @_; $t //= $compact;
                $t =~ s/$re/$to/ or die "no match for $re"; $t };

my @variants = (
    # [name, text, takes the fast path]
    ['compact', $compact, 1],
    ['pretty', $pretty, 1],
    ['pairs', $pairs, 1],
    ['dup token first', $sub->(qr/"vocab":\{/, '"vocab":{"he":7,'), 1],
    ['dup token last', $sub->(qr/"vocab":\{"!":33/, '"vocab":{"!":33,"!":9'), 1],
    ['dup vocab before', $sub->(qr/"model":\{/, '"model":{"vocab":{"x":0},'), 1],
    ['dup vocab after', $sub->(qr/\}\},"normalizer"/, '},"vocab":{"x":0}},"normalizer"'), 1],
    ['dup merges after', $sub->(qr/\}\},"normalizer"/, '},"merges":["q r"]},"normalizer"'), 1],
    ['dup merges before', $sub->(qr/"model":\{/, '"model":{"merges":["q r"],'), 1],
    ['dup model after', $sub->(qr/^\{/, '{"zz":0,') =~ s/\}$/,"model":{"type":"WordPiece"}}/r, 1],
    ['dup model before', $sub->(qr/^\{/, '{"model":{"type":"WordPiece"},'), 0],
    ['escaped vocab key', $sub->(qr/"vocab":/, '"voc\\u0061b":'), 0],
    ['escaped model key', $sub->(qr/"model":/, '"mod\\u0065l":'), 0],
    ['escaped root key', $sub->(qr/"version":/, '"v\\u0065rsion":'), 0],
    ['surrogate pair', $sub->(qr/"vocab":\{/, '"vocab":{"\\uD83D\\uDE00":300,'), 1],
    ['lone high surrogate', $sub->(qr/"vocab":\{/, '"vocab":{"\\uD83D":300,'), 0],
    ['high then not low', $sub->(qr/"vocab":\{/, '"vocab":{"\\uD83D\\u0041":300,'), 0],
    ['lone low surrogate', $sub->(qr/"vocab":\{/, '"vocab":{"\\uDE00":300,'), 0],
    ['escape u0000', $sub->(qr/"vocab":\{/, '"vocab":{"a\\u0000b":300,'), 0],
    ['escape u0000 elsewhere', $sub->(qr/"version":"1.0"/, '"version":"1\\u0000"'), 0],
    ['escaped \\u0000 text', $sub->(qr/"version":"1.0"/, '"version":"1\\\\u0000"'), 1],
    ['raw NUL in key', $sub->(qr/"vocab":\{/, "\"vocab\":{\"a\x00b\":300,"), 0],
    ['raw control in key', $sub->(qr/"vocab":\{/, "\"vocab\":{\"a\x01b\":300,"), 0],
    ['bad escape', $sub->(qr/"vocab":\{/, '"vocab":{"a\\qb":300,'), 0],
    ['bad hex', $sub->(qr/"vocab":\{/, '"vocab":{"a\\uZZZZ":300,'), 0],
    ['escapes in keys', $sub->(qr/"A":65/, '"\\u0041":65') =~ s{"/":47}{"\\/":47}r, 1],
    ['escaped merge space', $sub->(qr/"h e"/, '"h\\u0020e"'), 1],
    ['two spaces merge', $sub->(qr/"h e"/, '"h  e"'), 1],
    ['missing merge side', $sub->(qr/"h e"/, '"hx e"'), 1],
    ['id 1.0', $sub->(qr/"he":256/, '"he":256.0'), 0],
    ['id 2.56e2', $sub->(qr/"he":256/, '"he":2.56e2'), 0],
    ['id 1.5', $sub->(qr/"he":256/, '"he":256.5'), 0],
    ['id -0', $sub->(qr/"!":33/, '"!":-0'), 0],
    ['id 01', $sub->(qr/"he":256/, '"he":0256'), 0],
    ['id 2^31', $sub->(qr/"he":256/, '"he":2147483648'), 0],
    ['id 2^31-1', $sub->(qr/"he":256/, '"he":2147483647'), 1],
    ['id string', $sub->(qr/"he":256/, '"he":"256"'), 0],
    ['id huge', $sub->(qr/"he":256/, '"he":' . ('9' x 70)), 0],
    ['formfeed ws', $sub->(qr/"vocab":\{/, "\"vocab\":\f{"), 0],
    ['tab ws', $sub->(qr/"vocab":\{/, "\"vocab\":\t{\r\n"), 1],
    ['trailing bytes', "$compact xyz", 0],
    ['trailing NUL', "$compact\0", 0],
    ['leading BOM', "\xef\xbb\xbf$compact", 0],
    ['truncated', substr($compact, 0, length($compact) - 3), 0],
    ['truncated in vocab', substr($compact, 0, index($compact, '"vocab"') + 40), 0],
    ['deep 150', $sub->(qr/^\{/, '{"deep":' . ('[' x 150) . (']' x 150) . ','), 0],
    ['deep 2000', $sub->(qr/^\{/, '{"deep":' . ('[' x 2000) . (']' x 2000) . ','), 0],
    ['deep 100', $sub->(qr/^\{/, '{"deep":' . ('[' x 100) . (']' x 100) . ','), 1],
    ['huge string', $sub->(qr/^\{/, '{"big":"' . ('x' x 1_000_000) . '",'), 1],
    ['number 1e400', $sub->(qr/^\{/, '{"n":[1e400,-0.0,0,1E+2],'), 1],
    ['long number', $sub->(qr/^\{/, '{"n":' . ('1' x 40) . ','), 0],
    ['empty vocab', $sub->(qr/"vocab":\{.*?\}/, '"vocab":{}'), 0],
    ['empty merges', $sub->(qr/"merges":\[.*?\]/, '"merges":[]'), 0],
    ['vocab array', $sub->(qr/"vocab":\{.*?\}/, '"vocab":[]'), 0],
    ['merges mixed', $sub->(qr/"h e"/, '["h","e"]'), 0],
    ['merge triple', $sub->(qr/"merges":\[.*?\]/, '"merges":[["h","e","x"]]', $pairs =~ s/\s+//gr), 0],
    ['no model', $sub->(qr/"model":/, '"modem":'), 0],
    ['root array', "[$compact]", 0],
);
my @files;
for my $i (0 .. $#variants) {
    my $f = "$dir/v$i.json";
    spew($f, $variants[$i][1]);
    push @files, $f;
}
my ($x, $out, $r) = diff_run('timeout 300', join ' ', map { "'$_'" } @files);
is($x, 0, scalar(@variants) . ' variants: both paths agree') or diag $out;
for my $i (0 .. $#variants) {
    my ($name, undef, $fast) = @{ $variants[$i] };
    my $g = $r->{$files[$i]};
    ok($g && $g->{diffs} == 0 && $g->{fast} == $fast,
       "$name: same outcome both ways, " . ($fast ? 'fast path' : 'cJSON path'))
        or diag explain $g;
}
my %ix = map { ($variants[$_][0] => $_) } 0 .. $#variants;
ok($r->{$files[0]}{loaded}, 'the compact file loads');
ok(!$r->{$files[$ix{$_}]}{loaded}, "$_: refused") for
    'escape u0000', 'escape u0000 elsewhere', 'lone high surrogate', 'two spaces merge',
    'dup vocab before', 'dup model before', 'id 1.5', 'truncated', 'deep 2000';
ok($r->{$files[$ix{$_}]}{loaded}, "$_: loads") for
    'dup token first', 'dup vocab after', 'dup model after', 'surrogate pair', 'escaped vocab key',
    'id 1.0', 'pairs', 'escaped merge space', 'deep 150', 'huge string';

# mutations of the small files (fixed seed): bytes, fragments, cuts
($x, $out, $r) = diff_run('timeout 600', "-m 2000 " . join ' ', map { "'$_'" } @files[0 .. 2, 5, 13, 25]);
is($x, 0, '2000 mutations each of 6 variants: both paths agree') or diag $out;
my ($tf, $tt) = (0, 0);
$tf += $_->{fast}, $tt += $_->{tries} for values %$r;
ok($tf > 100, "mutations: $tf of $tt took the fast path");

# the same under valgrind: the scanner reads no byte past its input
SKIP: {
    skip 'valgrind not installed', 1 if system('valgrind --version >/dev/null 2>&1');
    my $vout = `timeout 600 valgrind --error-exitcode=9 --leak-check=full --errors-for-leak-kinds=definite '$exe' -m 100 '$files[0]' '$files[2]' '$files[13]' 2>&1`;
    is($? >> 8, 0, 'load_diff under valgrind: no error, no leak')
        or diag substr($vout, -3000);
}

done_testing();
