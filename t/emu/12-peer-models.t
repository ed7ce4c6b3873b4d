# vLLM emulator: its replies against the peers' own models
# (t/emu/peer_models.py): the `openai` package's pydantic models (the
# client's ChatCompletion, ChatCompletionChunk, Completion, CompletionUsage,
# ErrorObject) validate chat and completions, streamed and not, usage with
# stream_options.include_usage, errors; every key must be a field of
# vLLM 0.33.0's own protocol class (names listed in the helper: vLLM's
# classes import torch, so they cannot be loaded here); the NIXL prefill
# reply's kv_transfer_params has the fields of vLLM's request_finished.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/../inc";
use Test::More;
use JSON::PP;
use DPD::Emu;

my $ROOT = DPD::Emu::root();
my $PY = ($ENV{DPD_VENV} || "$ROOT/.venv") . '/bin/python';
plan skip_all => "no openai/pydantic in the venv ($PY; make deps)"
    unless -x $PY
           && system("$PY -c 'import openai, pydantic' 2>/dev/null") == 0;

my $J = JSON::PP->new->utf8;
my $port = ($ENV{DPD_EMU_PORT} || 19000) + 12;
my $e = DPD::Emu->start(host => '127.0.0.1', port => $port, role => 'both',
                        side_channel_port => $port + 100, no_lmcache => 1,
                        time_scale => 0.01, python => $PY);

my @out = `'$PY' '$ROOT/t/emu/peer_models.py' http://127.0.0.1:$port 2>&1`;
my $rc = $? >> 8;
my $n = 0;
for my $l (@out) {
    my $c = eval { $J->decode($l) };
    unless ($c) {
        fail("peer_models.py output: $l");
        next;
    }
    $n++;
    ok $c->{ok}, $c->{name} or diag $c->{detail};
}
ok $n >= 60, "$n checks ran";
is $rc, 0, 'peer_models.py: every check passed';

done_testing();
