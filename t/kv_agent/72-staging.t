#!/usr/bin/perl
# The staging path (issue 12, point 4) on host memory: transfer.staging
# "host" sends every pool through the code GPU pools without FI_HMEM use
# (a bounded ring of pinned slots filled by batched asynchronous copies,
# written while the next slots are copied; the receiver lands writes in a
# bounded ring of granted slots and copies each chunk in with batched
# asynchronous copies before the slot is granted again and before it
# says ready), with the host copy engine standing in for CUDA.  Checked
# byte for byte over tcp;ofi_rxm and shm, coalesced and not, one slot
# (serial) and eight, one rank and two.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use JSON::PP;
use KvAgentTest;
use PushSuite;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();

sub kvtp {
    my (@args) = @_;
    my $cmd = join ' ', 'timeout', '120', 'python3',
        "$FindBin::Bin/kvtp.py", map { "'$_'" } @args;
    my $out = `$cmd 2>&1`;
    my $j = eval { decode_json((split /\n/, $out)[-1] // "") };
    return $j // { error => $out };
}

my $po = 740;
for my $prov ('tcp;ofi_rxm', 'shm') {
    SKIP: {
        skip "$prov not available", 17 unless provider_ok($prov);
        for my $slots (8, 1) {
            my %o = (transfer => { staging => "host", stage_slots => $slots,
                                   stage_chunk => 1 << 20 });
            # (a loaded 2-core machine, or valgrind: uncoalesced shm
            # pushes of 10240 writes can take seconds)
            my ($pa, $da) = PushSuite::pair($prov, $po, %o,
                                            transfer_ms => 50000);
            $po += 2;
            ok(wait_connected($pa, ["decode-0"]), "$prov/$slots: connected");
            like(log_text($pa), qr/stage: rank 0: $slots slot\(s\) x 1048576 (?#
                 )bytes of pinned memory, host copy engine/,
                 "$prov/$slots: sender ring set up")
                or diag(log_text($pa));
            like(log_text($da), qr/rank 0: writes land in a bounded ring (?#
                 )of 8 slot\(s\) x 4194304 bytes of pinned memory/,
                 "$prov/$slots: receiver lands in a bounded ring");
            my $j = run_kvpush("--prefill", $pa->{sock},
                "--decode", "decode-0=$da->{sock}", "--nblocks", 256,
                "--dst", "explicit", "--req", "stg");
            PushSuite::check_results($j, "$prov/$slots staged", 256);
            my $i = api($pa, { verb => "info" });
            ok(($i->{stats}{stage_batches} // 0) > 0
               && $i->{stats}{stage_copies} >= $i->{stats}{stage_batches},
               "$prov/$slots: $i->{stats}{stage_copies} copies in "
               . "$i->{stats}{stage_batches} batches");
            if ($slots == 8) {
                # not coalesced: 4 KiB pieces, up to 64 per slot
                $j = run_kvpush("--prefill", $pa->{sock},
                    "--decode", "decode-0=$da->{sock}", "--nblocks", 64,
                    "--dst", "explicit", "--shuffle", "--req", "stgs",
                    "--timeout-ms", 50000);
                PushSuite::check_results($j, "$prov staged shuffled", 64);
            }
            stop_agent($_) for $pa, $da;
        }
    }
}

# two ranks, each with its ring and its copy-in engine
SKIP: {
    skip "tcp;ofi_rxm not available", 4 unless provider_ok('tcp;ofi_rxm');
    my $pool = small_pool(layers => 80, blocks => 80);
    $pool->{ranks} = 2;
    my %t = (transfer => { staging => "host", stage_chunk => 1 << 20 });
    my $p = start_agent(agent_config(id => "prefill-0", role => "prefill",
        port => kv_port(760), pool => $pool, %t,
        peers => [{ id => "decode-0", role => "decode",
                    ctrl => "127.0.0.1:" . kv_port(761) }]));
    my $d = start_agent(agent_config(id => "decode-0", role => "decode",
        port => kv_port(761), pool => $pool, %t,
        peers => [{ id => "prefill-0", role => "prefill",
                    ctrl => "127.0.0.1:" . kv_port(760) }]));
    my $j = kvtp("--prefill", $p->{sock}, "--decode", "decode-0=$d->{sock}",
                 "--ranks", 2, "--nblocks", 64);
    is($j->{push_state}, "done", "2 ranks staged: push done")
        or diag(explain($j));
    is($j->{recv_state}, "ready", "2 ranks staged: ready");
    is_deeply($j->{bad}, [0, 0], "2 ranks staged: both bit-exact");
    like(log_text($p), qr/stage: rank 1: 8 slot/, "a ring per rank");
    stop_agent($_) for $p, $d;
}
done_testing();
