# dpd-tokenize finds tokenizer_config.json next to tokenizer.json as nginx's
# dpd_tokenizer does (issue 24, 4).  Before: without --config the CLI loaded
# no config, so a chat of a model with a template failed ("the model has no
# chat template (no --config given)", exit 2) while nginx counted it with
# the model's template.  "--config none" keeps the old behaviour.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/lib";
use Test::More;
use File::Temp ();
use File::Copy ();
use TokTest;

skip_unless_ready();
my $cli = tokcli();
my $dir = llama3();
plan skip_all => 'no tokenizer_config.json in the Llama 3 fixture'
    unless -f "$dir/tokenizer_config.json";

my $chat = '{"messages":[{"role":"system","content":"Be brief."},'
         . '{"role":"user","content":"Hello there, how are you?"}]}';

sub cli {
    my (@args) = @_;
    my $tmp = File::Temp->new;
    print $tmp $chat;
    close $tmp;
    my $out = `'$cli' @args < '$tmp' 2>&1`;
    return ($? >> 8, $out);
}

my ($rc_given, $given) = cli('--tokenizer', "$dir/tokenizer.json",
                             '--config', "$dir/tokenizer_config.json",
                             '--chat', '--count');
is $rc_given, 0, 'explicit --config: counted';
like $given, qr/^\d+$/, 'explicit --config: a count';

my ($rc_found, $found) = cli('--tokenizer', "$dir/tokenizer.json",
                             '--chat', '--count');
is $rc_found, 0, 'no --config: the sibling tokenizer_config.json is used';
is $found, $given, 'the same count as with --config (the model template)';

my ($rc_none, $none) = cli('--tokenizer', "$dir/tokenizer.json",
                           '--config', 'none', '--chat', '--count');
is $rc_none, 2, '--config none: no template, a chat is refused';
like $none, qr/no chat template \(--config none\)/, '... and says why';

# a directory without tokenizer_config.json: the message says so
my $lone = File::Temp::tempdir(CLEANUP => 1);
File::Copy::copy("$dir/tokenizer.json", "$lone/tokenizer.json") or die $!;
my ($rc_lone, $lonely) = cli('--tokenizer', "$lone/tokenizer.json",
                             '--chat', '--count');
is $rc_lone, 2, 'no config anywhere: refused';
like $lonely, qr/no --config given and no tokenizer_config\.json next to the tokenizer/,
    '... and says where it looked';

# the estimate, explicitly asked for, still works there
my ($rc_est, $est) = cli('--tokenizer', "$lone/tokenizer.json",
                         '--chat', '--count', '--estimate');
is $rc_est, 0, '--estimate without a template: counted';
like $est, qr/^\d+$/m, '... a number';

done_testing();
