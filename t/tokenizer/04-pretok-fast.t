# The hand-written pre-tokenizer matchers (tok_pretok_fast.c) against pcre2
# on the same patterns (pretok_diff.c linked against build/libdpdtok.a):
# split boundaries on every code point in 31 contexts, the corpus, random
# strings and lossy-decoded random bytes; encode ids with the fast path on
# and off under every Split behaviour; then the same under valgrind.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/lib";
use Test::More;
use TokTest;

skip_unless_ready(oracle => 1);
my $lib = build() . '/libdpdtok.a';
plan skip_all => 'build/libdpdtok.a not built' unless -f $lib;
my $corpus = need_corpus();
my $exe = corpus_dir() . '/pretok_diff';
my $inc = root() . '/ngx_dpd_module/tokenizer';
my ($rc, $err) = run_cmd("cc -std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -I'$inc' "
                         . "'$FindBin::Bin/pretok_diff.c' '$lib' -lpcre2-8 -lcjson "
                         . "-lutf8proc -lpthread -lm -o '$exe'", 60);
is($rc, 0, 'pretok_diff builds') or diag $err;

my $run = sub {
    my ($pre, $n, $what) = @_;
    my $out = `$pre '$exe' '${\ llama3()}' '${\ qwen3()}' '$corpus' $n 2>&1`;
    is($? >> 8, 0, "pretok_diff passes ($what)");
    for (split /\n/, $out) {
        if (/^(not )?ok \d+ - (.*)/) { ok(!$1, "$what: $2") }
        elsif (/^#/) { diag $_ }
    }
    return $out;
};
$run->('timeout 300', 100000, 'native');

SKIP: {
    skip 'valgrind not installed', 2 if system('valgrind --version >/dev/null 2>&1');
    my $out = `timeout 900 valgrind --error-exitcode=9 --leak-check=full --errors-for-leak-kinds=definite '$exe' '${\ llama3()}' '${\ qwen3()}' '$corpus' 2000 quick 2>&1`;
    is($? >> 8, 0, 'pretok_diff passes under valgrind (quick)');
    like($out, qr/ERROR SUMMARY: 0 errors/, 'valgrind: no memory errors, no leaks')
        or diag substr($out, -3000);
}

done_testing();
