# The C API (api_test.c linked against build/libdpdtok.a): vocab sizes,
# template detection, the encode cap contract, chat entry points, and
# concurrent encodes on one tokenizer from 4 threads.  Then the CLI under
# valgrind: no invalid reads and nothing lost after dpd_tok_free().
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
my $exe = corpus_dir() . '/api_test';
my $inc = root() . '/ngx_dpd_module/tokenizer';
my ($rc, $err) = run_cmd("cc -std=c11 -D_GNU_SOURCE -O1 -g -Wall -Wextra -I'$inc' "
                         . "'$FindBin::Bin/api_test.c' '$lib' -lpcre2-8 -lcjson "
                         . "-lutf8proc -lpthread -lm -o '$exe'", 60);
is($rc, 0, 'api_test builds') or diag $err;

my $out = `timeout 120 '$exe' '${\ llama3()}' '${\ qwen3()}' '$corpus'`;
is($? >> 8, 0, 'api_test passes');
for (split /\n/, $out) {
    if (/^(not )?ok \d+ - (.*)/) { ok(!$1, "api: $2") }
    elsif (/^#/) { diag $_ }
}

SKIP: {
    skip 'valgrind not installed', 4 if system('valgrind --version >/dev/null 2>&1');
    my $cli = tokcli();
    my $in = corpus_dir() . '/vg-in.jsonl';
    # a slice of the corpus: every category, valgrind is slow
    my @lines = split /\n/, slurp($corpus);
    spew($in, join('', map { "$lines[$_]\n" } grep { $_ % 25 == 0 } 0 .. $#lines));
    ($rc, $err) = run_cmd("valgrind --error-exitcode=9 --leak-check=full "
                          . "--errors-for-leak-kinds=definite '$cli' --tokenizer '"
                          . qwen3() . "/tokenizer.json' --jsonl --ids < '$in' >/dev/null", 240);
    is($rc, 0, 'valgrind: no memory errors, no leaks (qwen3, corpus slice)')
        or diag substr($err, -3000);
    like($err, qr/ERROR SUMMARY: 0 errors/, 'valgrind error summary is clean');

    # chat rendering and counting, tool calls included
    my (undef, $multi) = need_chats();
    my @chats = split /\n/, slurp($multi);
    spew("$in.chat", join('', map { "$_\n" } @chats[0 .. 59]));
    ($rc, $err) = run_cmd("valgrind --error-exitcode=9 --leak-check=full "
                          . "--errors-for-leak-kinds=definite '$cli' --tokenizer '"
                          . qwen3() . "/tokenizer.json' --config '" . qwen3()
                          . "/tokenizer_config.json' --chat --jsonl --ids "
                          . "< '$in.chat' >/dev/null", 240);
    is($rc, 0, 'valgrind: chat rendering clean (qwen3, 60 chats)')
        or diag substr($err, -3000);
    like($err, qr/ERROR SUMMARY: 0 errors/, 'valgrind chat error summary is clean');
}

done_testing();
