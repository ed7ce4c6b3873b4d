# Ids from the real Llama 3 and Qwen 3 tokenizer.json files against Hugging
# Face's Rust tokenizers (npm @anush008/tokenizers), over the corpus built
# by tools/corpus/build-corpus.py (>= 2 MB: Debian texts, code, translated
# man pages and messages, generated edge cases, invalid UTF-8), without and
# with add_special_tokens.  Zero mismatches allowed.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/lib";
use Test::More;
use TokTest;

skip_unless_ready(oracle => 1);
my $corpus = need_corpus();
my $tags = corpus_dir() . '/corpus.tags';
my $dir = corpus_dir();
my $cli = tokcli();

cmp_ok(-s $corpus, '>=', 2_000_000, 'corpus is at least 2 MB');

for my $m ([llama3 => llama3()], [qwen3 => qwen3()]) {
    my ($name, $path) = @$m;
    for my $special (0, 1) {
        my $flag = $special ? '--special' : '';
        my $tag = "$name" . ($special ? '-special' : '');
        my ($rc, $e) = run_cmd("node '$FindBin::Bin/hf-oracle.js' '$path/tokenizer.json' "
                               . "$flag < '$corpus' > '$dir/hf-$tag.txt'", 120);
        is($rc, 0, "$tag: oracle ran") or diag $e;
        ($rc, $e) = run_cmd("'$cli' --tokenizer '$path/tokenizer.json' --jsonl --ids "
                            . "$flag < '$corpus' > '$dir/our-$tag.txt'", 60);
        is($rc, 0, "$tag: dpd-tokenize ran") or diag $e;
        compare_lines($tag, "$dir/hf-$tag.txt", "$dir/our-$tag.txt", $corpus, $tags);
    }
}

done_testing();
