# Text that is not valid UTF-8, given raw on stdin: every maximal invalid
# subpart becomes one U+FFFD (as Rust's String::from_utf8_lossy and the
# WHATWG decoder do) and the ids equal Hugging Face's for the lossily
# decoded text.  Truncated sequences at the very end, overlongs,
# surrogates, code points past U+10FFFF, stray continuation bytes.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/lib";
use Test::More;
use TokTest;

skip_unless_ready(oracle => 1);
my $cli = tokcli();
my $dir = corpus_dir();
system('mkdir', '-p', $dir);

my @cases = ("\x80", "abc\xff", "\xc3", "x\xe2\x82", "\xf0\x9f\x98",
             "\xc0\xaf <|eot_id|>\xed\xa0\x80", "\xf4\x90\x80\x80 \xf5\xff",
             "caf\xc3\xa9 \xe9t\xe9", "\xe0\x80\x80\xe0\xa0\x80",
             "\xf0\x9f\x98\x80\x9f\x98\x80", "'s\x80'S\xc3\x28 12\xff34",
             "\xef\xbb\xbf BOM then \xfe\xff", "\x00\x80\x00");
for my $m (['llama3', llama3()], ['qwen3', qwen3()]) {
    my ($name, $path) = @$m;
    my ($jsonl, @ours) = ('');
    for my $i (0 .. $#cases) {
        my $raw = $cases[$i];
        spew("$dir/utf8-$i.bin", $raw);
        push @ours, scalar `'$cli' --tokenizer '$path/tokenizer.json' --ids < '$dir/utf8-$i.bin'`;
        # the same bytes inside a JSON string: the oracle decodes lossily
        (my $j = $raw) =~ s/([\x00-\x1f"\\])/sprintf('\\u%04x', ord $1)/ge;
        $jsonl .= "\"$j\"\n";
    }
    spew("$dir/utf8.jsonl", $jsonl);
    my @want = split /^/, `node '$FindBin::Bin/hf-oracle.js' '$path/tokenizer.json' < '$dir/utf8.jsonl'`;
    is(scalar @want, scalar @cases, "$name: oracle answered every case");
    for my $i (0 .. $#cases) {
        is($ours[$i], $want[$i], sprintf("%s: raw bytes %s", $name,
           join(' ', map { sprintf '%02x', ord } split //, substr($cases[$i], 0, 12))));
    }
}

# U+FFFD per maximal subpart: "\xe2\x82" (truncated) is one, "\xc0\xaf" two
my $l = llama3() . '/tokenizer.json';
sub ids_of { spew("$dir/utf8-x.bin", $_[0]); return scalar `'$cli' --tokenizer '$l' --ids < '$dir/utf8-x.bin'` }
is(ids_of("\xe2\x82"), ids_of("\xef\xbf\xbd"), 'a truncated sequence is one U+FFFD');
is(ids_of("\xc0\xaf"), ids_of("\xef\xbf\xbd\xef\xbf\xbd"), 'an overlong pair is two U+FFFD');
isnt(ids_of("\xc0\xaf"), ids_of("\xef\xbf\xbd"), '... not one');

done_testing();
