# The request body's tree builder (ngx_dpd_module/ngx_http_dpd_json.c)
# against libcjson's parser: ngx_dpd_module/fuzz/dpd_fuzz_json.c, built
# here with cc (-DDPD_JSON_MAIN), parses each input with both and aborts
# on the first difference: verdict, error position, tree (types, keys,
# strings, valueint, valuedouble bits, links), allocations.  The inputs:
# edge cases (numbers, escapes, surrogates, nesting at cJSON's limit,
# white space at the end, BOM), every prefix and many one-byte mutations
# of them, random numbers and escapes, huge strings, the fuzz seeds and the
# JSON bodies of the other test files.
use strict;
use warnings;

use Test::More;
use File::Temp qw(tempdir);
use DPD::Emu;
use DPD::ProtoDriver;

plan skip_all => $_ for DPD::ProtoDriver->unavailable;

my $root = DPD::Emu::root();
my $dir = tempdir(TMPDIR => 1, CLEANUP => 1);
my $bin = "$dir/dpd_json";
my $cc = $ENV{CC} || 'cc';
# with ASan/UBSan where the compiler has them: any read past an input
my $san = system("echo 'int main(void){return 0;}' | $cc "
                 . "-fsanitize=address,undefined -x c -o /dev/null - "
                 . '>/dev/null 2>&1') == 0
    ? '-fsanitize=address,undefined' : '';
my $out = `$cc -std=c11 -Wall -Wextra -Werror -O1 -g $san -DDPD_JSON_MAIN \\
    -I$root/ngx_dpd_module $root/ngx_dpd_module/fuzz/dpd_fuzz_json.c \\
    $root/ngx_dpd_module/ngx_http_dpd_json.c -o $bin -lcjson -lm 2>&1`;
is $?, 0, 'the differential driver builds' or diag $out;
BAIL_OUT('cannot build the driver') if $?;

# inputs as records: "LENGTH\n" then the bytes
sub records {
    my ($name, @in) = @_;
    my $f = "$dir/$name";
    open my $fh, '>:raw', $f or die "$f: $!";
    print $fh length($_), "\n", $_ for @in;
    close $fh;
    return $f;
}

sub agree {
    my ($what, @in) = @_;
    my $f = records('in', @in);
    my $r = `ASAN_OPTIONS=detect_leaks=1 $bin -r $f 2>&1`;
    is $r, 'ok ' . scalar(@in) . "\n", "$what: " . scalar(@in)
        . ' inputs, same verdict, position and tree' or diag $r;
}

srand(216);

my @edge = (
    '{}', '[]', '{ }', '[ ]', '""', '{"":""}', '{"a":1}', '[1,2,3]',
    '{"a":"b\n\u00e9\ud83d\ude00x\/\b\f\r\t\\\\\""}',
    '["\ud800"]', '["\udc00"]', '["\ud800\u0041"]', '["\ud800\udbff"]',
    '["\udbff\udfff"]', '["\ud800\\\\"]', '["\ud800\ud800\udc00"]',
    '["\u12"]', '["\u00"]', '["\uD83D\uDE00"]', '["\uFFFF\uFEFF\u0800\u07ff\u0080"]',
    '[-0,-0.0,0e0,-0e-0,1e999,-1e999,1e-999,2147483647,2147483648]',
    '[-2147483648,-2147483649,2147483646.9,-2147483648.5,1.5,0.1,1E+2]',
    '[123456789012345678,1234567890123456789,12345678901234567890]',
    '[9007199254740993,-9007199254740993,999999999999999999]',
    '[1e,1]', '[1e+]', '[-]', '[--1]', '[+1]', '[.5]', '[1.]', '[01]',
    '[1-2]', '[1e5e5]', '[0x10]', '[-inf]', '[1.0x5]', '[1 2]', '[1,]',
    '[', '[1', '[1,', '[1,   ', '   ', "\t\r\n ", '[ ', '{ ', '{"a"', '{"a" ',
    '{"a":', '{"a": ', '{"a":1', '{"a":1,', '{"a":1 , ', '{"a" 1}',
    '{"a":1,}', '{1:2}', '{"a":tru}', '[nul', '[true,false,null]',
    'true', 'false', 'null', 'nul', '1', '-1.5', '1e5', '"abc', '"ab\\',
    '{"a" :  1 , "a": [ ] , "": {}, "a": null}',
    "\xef\xbb\xbf{}", "\xef\xbb\xbf1", "\xef\xbb\xbf", "\xef\xbb\xbf ",
    "\xef\xbb\xbf\"a\"", "{\xef\xbb\xbf}", "[\"\xc3\xa9\xe2\x82\xac\"]",
    '{"k":"v"}   x', '{"k":"v"},{}', '{"a":{"b":{"c":[{}]}}}',
    '["\q"]', '["\\', '["\\"]', "[\"a\x00b\"]", "[1\x00]", "\x00",
);

my @base = (
    '{"model":"m","messages":[{"role":"user","content":"hi\nthere \u00e9"}],"max_tokens":16,"stream":true}',
    '{"prompt":"a\"b\\\\c\ud83d\ude00","n":-1.5e3,"x":[1,2,{"y":null}],"":false}',
    '[ 1 , -0.5e-3 , "\u0041" , [ ] , { } , true ]',
);

agree('edge cases', @edge, @base);

# every prefix; one-byte mutations at every position
my @mut;
for my $s (@edge, @base) {
    push @mut, substr($s, 0, $_) for 0 .. length($s) - 1;
    for my $i (0 .. length($s) - 1) {
        for my $c (' ', '"', '\\', ',', ':', ']', '}', '[', '{', '1', 'e',
                   '.', '-', 'u', 'd', "\x00", "\xff", "\n")
        {
            my $m = $s;
            substr($m, $i, 1) = $c;
            push @mut, $m;
        }
        my $m = $s;
        substr($m, $i, 1) = '';
        push @mut, $m;
    }
}
agree('prefixes and one-byte mutations', @mut);

# random numbers, some of them longer than cJSON 1.7.15's 63 bytes
my @num;
for (1 .. 3000) {
    my $n = (rand() < 0.3 ? '-' : '')
        . join('', map { int(rand(10)) } 1 .. 1 + int(rand(rand() < 0.1 ? 300 : 22)));
    $n .= '.' . join('', map { int(rand(10)) } 1 .. 1 + int(rand(20)))
        if rand() < 0.5;
    $n .= (rand() < 0.5 ? 'e' : 'E') . ('', '+', '-')[int(rand(3))]
        . int(rand(rand() < 0.5 ? 400 : 30)) if rand() < 0.4;
    push @num, "[$n]", "{\"n\":$n}", $n, "[$n ,$n]";
}
agree('random numbers', @num);

# random \u escapes around the surrogate ranges, and other escapes
my @esc;
my @hex = (0x0001, 0x001f, 0x007f, 0x0080, 0x07ff, 0x0800, 0xd7ff, 0xd800,
           0xdbff, 0xdc00, 0xdfff, 0xe000, 0xfffd, 0xffff);
for (1 .. 3000) {
    my $s = '';
    for (0 .. int(rand(6))) {
        my $r = rand();
        $s .= $r < 0.6 ? sprintf('\u%04' . (rand() < 0.5 ? 'x' : 'X'),
                                 rand() < 0.5 ? $hex[int(rand(@hex))]
                                              : 1 + int(rand(0xffff)))
            : $r < 0.8 ? ('\n', '\"', '\\\\', '\/', '\t', '\b')[int(rand(6))]
            : ('a', 'é', ' ', 'xyz', '\u')[int(rand(5))];
    }
    push @esc, "[\"$s\"]", "{\"$s\":\"$s\"}";
}
agree('random escapes and surrogates', @esc);

# nesting at cJSON's limit, repeated and empty keys, huge strings
my @big = (
    '[' x 1000 . ']' x 1000, '[' x 1001 . ']' x 1001, '[' x 1000,
    '{"a":' x 999 . '1' . '}' x 999, '{"a":' x 1000 . '1' . '}' x 1000,
    '[{"":' x 500 . '[]' . '}]' x 500, '[{"":' x 501 . '[]' . '}]' x 501,
    '{' . join(',', map { '"k":' . $_ } 1 .. 2000) . '}',
    '{"prompt":"' . ('x' x 1_000_000) . '"}',
    '{"prompt":"' . ('abc\n\"\u00e9' x 100_000) . '"}',
    '{"prompt":"' . ('\\\\' x 50_000) . '"}',
    '{"prompt":"' . ('y' x 70_000) . '\ud800"}',
    '["' . ('\ud83d\ude00' x 20_000) . '"]',
);
agree('deep nesting, repeated keys, huge strings', @big);

# the fuzz seeds (whole, and without their selector byte: the driver
# does both) and the JSON bodies of the other tests
my @files;
opendir my $dh, "$root/ngx_dpd_module/fuzz/corpus" or die $!;
for my $f (sort grep { !/^\./ } readdir $dh) {
    open my $fh, '<:raw', "$root/ngx_dpd_module/fuzz/corpus/$f" or die $!;
    local $/;
    push @files, scalar <$fh>;
}
closedir $dh;

for my $t (glob "$root/t/*.t") {
    open my $fh, '<:raw', $t or die "$t: $!";
    while (my $l = <$fh>) {
        push @files, $1 if $l =~ /^\s*(\{.*\})\s*$/;
        push @files, $1 while $l =~ /'(\{"[^']*\})'/g;
    }
}
cmp_ok scalar(@files), q{>}, 50, q{test bodies found};
agree('fuzz seeds and test bodies', @files);

done_testing;
