#!/usr/bin/perl
# The KV-event subscriber against the emulator's publisher
# (tools/vllm_emu.py --kv-events-config): every event form it speaks
# (map, typed, array, array0) and both hash forms, with a dropped batch
# replayed.  The emulator is the project's own encoder, so this is an
# interoperability check; the decoder's independent proof is
# 80-kv-events.t (msgspec).  Skipped where the emulator has no publisher.

use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use KvAgentTest;
use IO::Socket::INET;
use Time::HiRes qw(sleep time);

my $py = ($ENV{DPD_VENV} // kv_root() . "/.venv") . "/bin/python";
my $emu = $ENV{DPD_EMU} // kv_root() . "/tools/vllm_emu.py";
plan skip_all => "no Python venv with pyzmq ($py)"
    unless -x $py && system("$py -c 'import zmq' 2>/dev/null") == 0;
plan skip_all => "the emulator has no KV-event publisher"
    unless -f $emu && `$py $emu --help 2>&1` =~ /--kv-events-form/;

my $bin = kv_bin();
my $dir = kv_tmpdir();
my $n = 0;

sub http_post {
    my ($port, $path, $body) = @_;
    my $s = IO::Socket::INET->new(PeerAddr => "127.0.0.1:$port",
                                  Timeout => 10) or return undef;
    print $s "POST $path HTTP/1.1\r\nHost: x\r\nContent-Type: "
        . "application/json\r\nContent-Length: " . length($body)
        . "\r\nConnection: close\r\n\r\n$body";
    local $/;
    my $r = <$s>;
    return $r;
}

for my $form (qw(map typed array array0)) {
    for my $hash (qw(int bytes)) {
        my $hp = kv_port(900 + 10 * $n);
        my ($pp, $rp) = ($hp + 1, $hp + 2);
        $n++;
        my $cfg = json_enc({ enable_kv_cache_events => JSON::PP::true,
                             endpoint => "tcp://*:$pp",
                             replay_endpoint => "tcp://*:$rp",
                             topic => "kv\@emu\@m" });
        my $epid = fork // die;
        if ($epid == 0) {
            open STDOUT, '>', "$dir/emu-$form-$hash.log" or die;
            open STDERR, '>&', \*STDOUT;
            exec $py, $emu, "--port", $hp, "--kv-events-config", $cfg,
                 "--kv-events-form", $form, "--kv-events-hash", $hash
                or exit 127;
        }
        my $up = wait_for(15, sub {
            IO::Socket::INET->new(PeerAddr => "127.0.0.1:$hp",
                                  Timeout => 1) });
        my $out = "$dir/sub-$form-$hash.out";
        my $spid = fork // die;
        if ($spid == 0) {
            open STDOUT, '>', $out or die;
            open STDERR, '>', "$out.err" or die;
            exec $bin, "events", "--endpoint", "tcp://127.0.0.1:$pp",
                 "--replay", "tcp://127.0.0.1:$rp", "--topic",
                 "kv\@emu\@m", "--node", "emu", "--seconds", 6
                or exit 127;
        }
        sleep 1;                       # subscribed (slow joiner)
        my $p = join ' ', map { "word$_" } 1 .. 100;
        for my $body ($p, "again $p", "DROP", "other $p", "third $p") {
            if ($body eq 'DROP') {     # the next batch: a gap
                http_post($hp, "/emu/kv_events", '{"drop":1}');
                next;
            }
            http_post($hp, "/v1/completions", json_enc({ model => "m",
                      prompt => $body, max_tokens => 2 }));
        }
        waitpid $spid, 0;
        kill 'TERM', $epid;
        waitpid $epid, 0;
        my @l = map { json_dec($_) } grep { /^\{/ }
                do { open my $f, '<', $out or die; <$f> };
        my ($st) = grep { $_->{event} eq 'stats' } @l;
        my @stored = grep { $_->{event} eq 'stored' } @l;
        ok($up && @stored >= 3, "$form/$hash: blocks stored decoded ("
           . scalar(@stored) . ")");
        is_deeply([map { $st->{$_} // -1 } qw(msgs_refused refused
                                              gaps replays_ok)],
                  [0, 0, 1, 1], "$form/$hash: nothing refused; the "
                  . "dropped batch replayed");
        my $bad = grep {
            @{ $_->{tokens} } != @{ $_->{hashes} } * $_->{block_size}
            || ($hash eq 'bytes'
                ? grep({ !/^hex:[0-9a-f]{64}$/ } @{ $_->{hashes} })
                : grep({ !/^\d+$/ } @{ $_->{hashes} }))
        } @stored;
        is($bad, 0, "$form/$hash: full blocks, hashes in the form asked");
    }
}

done_testing();
