#!/usr/bin/perl
# A decode agent under valgrind: receive pushes, answer bad input, lose its
# peer, shut down on SIGTERM - with no memory errors and no leaks.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use KvAgentTest;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();
plan skip_all => "libfabric tcp;ofi_rxm provider not available here"
    unless provider_ok('tcp;ofi_rxm');
my ($vg) = grep { -x "$_/valgrind" } split /:/, $ENV{PATH};
plan skip_all => "valgrind not installed" unless $vg;

my $po = 90;
my $dir = kv_tmpdir();
my $pool = small_pool(layers => 8, blocks => 64);
my $P = { id => "prefill-0", ctrl => "127.0.0.1:" . kv_port($po),
          role => "prefill" };
my $D = { id => "decode-0", ctrl => "127.0.0.1:" . kv_port($po + 1),
          role => "decode" };
sub vg { my ($log) = @_;
         return ["$vg/valgrind", "--leak-check=full",
                 "--show-leak-kinds=definite",
                 "--errors-for-leak-kinds=definite", "--error-exitcode=99",
                 "--log-file=$log"] }
my $vlog = "$dir/valgrind.log";
my $plog = "$dir/valgrind-prefill.log";
my $d = start_agent(agent_config(id => "decode-0", role => "decode",
    port => kv_port($po + 1), pool => $pool, peers => [$P],
    api => { max_message => 4096 },
    timeouts => { heartbeat_ms => 200, dead_after_ms => 3000 }),
    wrap => vg($vlog), timeout => 60);
ok(log_text($d) =~ /info: ready$/m, "agent ready under valgrind")
    or diag(log_text($d));
# the sender under valgrind too (push path, completions, shutdown)
my $p = start_agent(agent_config(id => "prefill-0", role => "prefill",
    port => kv_port($po), pool => $pool, peers => [$D],
    timeouts => { heartbeat_ms => 200, dead_after_ms => 3000 }),
    wrap => vg($plog), timeout => 60);
ok(wait_connected($p, ["decode-0"], 30), "prefill connected");

for my $k (1 .. 3) {
    api($p, { verb => "fill", blocks_runs => [[0, 32]], seed => $k });
    my $r = api($p, { verb => "push", req_id => "vg$k", peer => "decode-0",
                      src_runs => [[0, 32]] });
    $r = api($d, { verb => "wait", req_id => "vg$k", timeout_ms => 20000 },
             30);
    is($r->{state}, "ready", "push $k landed");
    my $a = api($p, { verb => "checksum", blocks_runs => [[0, 32]] });
    my $b = api($d, { verb => "checksum", blocks_runs => $r->{blocks_runs} },
                30);
    is($a->{checksum}, $b->{checksum}, "push $k bit-exact");
    api($d, { verb => "release", req_id => "vg$k" });
    api($p, { verb => "release", req_id => "vg$k" });
}
# bad input paths
ok(!api_raw($d->{sock}, pack("N", 10) . '{"verb":[}')->{ok},
   "malformed JSON refused");
ok(!api($d, { verb => "nope" })->{ok}, "unknown verb refused");
ok(!api($d, { verb => "reserve", req_id => "x", blocks => [999] })->{ok},
   "out of range refused");
api_raw($d->{sock}, pack("N", 100000) . ("z" x 5000));
ok(!api($p, { verb => "push", req_id => "bad", peer => "decode-0",
               src => [0, 999] })->{ok}, "sender refuses an out-of-range "
   . "block");
my $r = api($d, { verb => "reserve", req_id => "held", nblocks => 3 });
ok($r->{ok}, "reservation held at shutdown");
is(stop_agent($p, 'TERM', 60), 0, "prefill: SIGTERM, exit 0 under valgrind");
open my $pf, '<', $plog;
my $ptext = do { local $/; <$pf> } // "";
like($ptext, qr/ERROR SUMMARY: 0 errors/, "prefill: valgrind 0 errors")
    or diag($ptext);
like($ptext, qr/definitely lost: 0 bytes|no leaks are possible/,
     "prefill: nothing definitely lost");
# the peer went away while the agent runs
ok(log_wait($d, qr/peer prefill-0 is dead|lost|disconnected/, 20),
   "agent notices the lost peer");

is(stop_agent($d, 'TERM', 60), 0,
   "SIGTERM: exit 0 under valgrind (no errors, no definite leaks)");
open my $fh, '<', $vlog;
my $vtext = do { local $/; <$fh> } // "";
like($vtext, qr/ERROR SUMMARY: 0 errors/, "valgrind: 0 errors")
    or diag($vtext);
like($vtext, qr/definitely lost: 0 bytes|no leaks are possible/,
     "valgrind: nothing definitely lost");
done_testing();
