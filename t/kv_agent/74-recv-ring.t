#!/usr/bin/perl
# The staged receiver's bounded landing ring (kv_agent/src/ring.c, README
# "GPU", issue 12): writes land in recv_slots x recv_chunk pinned slots the
# receiver grants one chunk at a time (push_credit), each chunk announced
# by a notice after its writes completed and copied into the pool before
# the slot is granted again.  A ring far smaller than the request (slots
# reused hundreds of times), an odd chunk size, a sender with and without
# its own ring, two ranks (ready only after both), a throttled copy
# engine, a request failing mid-push (no slot leaked, the next one exact),
# repeated and stray notices (ignored), an old sender (refused with a clear error).
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use JSON::PP;
use KvAgentTest;
use PushSuite;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();

my $BB = 80 * 2 * 4096;               # llama_pool: bytes per block per rank

sub kvtp {
    my (@args) = @_;
    my $cmd = join ' ', 'timeout', '120', 'python3',
        "$FindBin::Bin/kvtp.py", map { "'$_'" } @args;
    my $out = `$cmd 2>&1`;
    my $j = eval { decode_json((split /\n/, $out)[-1] // "") };
    return $j // { error => $out };
}

# a prefill/decode pair with their own transfer settings and environments
sub pair2 {
    my (%o) = @_;
    my $po = $o{port};
    my $pool = $o{pool} // llama_pool();
    my $p = start_agent(agent_config(id => "prefill-0", role => "prefill",
        provider => $o{prov}, port => kv_port($po), pool => $pool,
        transfer => $o{ptransfer}, transfer_ms => $o{transfer_ms} // 30000,
        peers => [{ id => "decode-0", role => "decode",
                    ctrl => "127.0.0.1:" . kv_port($po + 1) }]),
        env => $o{penv} // {});
    my $d = start_agent(agent_config(id => "decode-0", role => "decode",
        provider => $o{prov}, port => kv_port($po + 1), pool => $pool,
        transfer => $o{dtransfer}, transfer_ms => $o{transfer_ms} // 30000,
        peers => [{ id => "prefill-0", role => "prefill",
                    ctrl => "127.0.0.1:" . kv_port($po) }]),
        env => $o{denv} // {});
    ok(wait_connected($p, ["decode-0"]), "$o{what}: connected");
    return ($p, $d);
}

sub push_ok {
    my ($p, $d, $n, $req, $what, @extra) = @_;
    my $j = run_kvpush("--prefill", $p->{sock}, "--decode",
        "decode-0=$d->{sock}", "--nblocks", $n, "--dst", "explicit",
        "--req", $req, "--timeout-ms", 60000, @extra);
    PushSuite::check_results($j, $what, $n);
    return $j;
}

sub stats { api($_[0], { verb => "info" })->{stats} }

# the ring back to all free once nothing is in flight
sub ring_settles {
    my ($d, $slots) = @_;
    my $s;
    for (1 .. 100) {
        $s = stats($d);
        return $s if ($s->{recv_ring_free} // -1) == $slots;
        select(undef, undef, undef, 0.1);
    }
    return $s;
}

my $po = 780;
for my $prov ('tcp;ofi_rxm', 'shm') {
    SKIP: {
        skip "$prov not available", 40 unless provider_ok($prov);
        # both staged, an odd chunk (pieces straddle block boundaries),
        # 3 slots for a 64-block request of 40 MiB: ~600 chunks
        my $t = { staging => "host", stage_slots => 4,
                  stage_chunk => 1 << 20, recv_slots => 3,
                  recv_chunk => 70000 };
        my ($p, $d) = pair2(prov => $prov, port => $po, ptransfer => $t,
                            dtransfer => $t, what => "$prov ring");
        $po += 2;
        like(log_text($d), qr/rank 0: writes land in a bounded ring of (?#
             )3 slot\(s\) x 70000 bytes of pinned memory/,
             "$prov: receiver lands in a 3-slot ring");
        unlike(log_text($d), qr/mirror/, "$prov: no mirror of the pool");
        my $s0 = stats($d);
        is($s0->{recv_ring_bytes}, 210000,
           "$prov: resident landing memory 3 x 70000 bytes");
        is($s0->{recv_ring_slots}, 3, "$prov: 3 slots");
        push_ok($p, $d, 64, "rg", "$prov ring 64 blocks");
        push_ok($p, $d, 32, "rgs", "$prov ring shuffled", "--shuffle");
        my $s = ring_settles($d, 3);
        my $chunks = int((64 * $BB + 69999) / 70000)
                     + int((32 * $BB + 69999) / 70000);
        is($s->{recv_ring_chunks}, $chunks,
           "$prov: $chunks chunks copied in through 3 slots");
        is($s->{recv_ring_grants}, $chunks, "$prov: one grant per chunk");
        is($s->{recv_ring_free}, 3, "$prov: every slot free again");
        is($s->{recv_ring_bytes}, 210000,
           "$prov: landing memory stayed bounded (request: "
           . 64 * $BB . " bytes)");
        is($s->{recv_ring_bad_notices}, 0, "$prov: no bad notice");
        stop_agent($_) for $p, $d;

        # a sender writing straight from its pool into the ring
        ($p, $d) = pair2(prov => $prov, port => $po,
            ptransfer => { staging => "off" },
            dtransfer => { staging => "host", recv_slots => 2,
                           recv_chunk => 65536 },
            what => "$prov direct sender");
        $po += 2;
        push_ok($p, $d, 48, "rd", "$prov direct sender into the ring");
        $s = ring_settles($d, 2);
        is($s->{recv_ring_chunks}, 48 * $BB / 65536,
           "$prov: 2 slots reused " . 48 * $BB / 65536 . " times");
        stop_agent($_) for $p, $d;
    }
}

SKIP: {
    skip "tcp;ofi_rxm not available", 30 unless provider_ok('tcp;ofi_rxm');
    my $t = { staging => "host", stage_chunk => 1 << 20, recv_slots => 2,
              recv_chunk => 65536 };

    # two ranks, rank 1 held back: not ready before both ranks' chunks
    my $pool = small_pool(layers => 80, blocks => 80);
    $pool->{ranks} = 2;
    my $hold = $ENV{KV_TEST_VALGRIND} ? 20000 : 3000;
    my ($p, $d) = pair2(prov => 'tcp;ofi_rxm', port => $po, pool => $pool,
        ptransfer => $t, dtransfer => $t, what => "2 ranks",
        penv => { KV_TEST_FAULT => "delay_rank:1:$hold" });
    $po += 2;
    my $j = kvtp("--prefill", $p->{sock}, "--decode", "decode-0=$d->{sock}",
                 "--ranks", 2, "--nblocks", 64, "--watch", 1,
                 "--watch-s", $hold / 1000 + 5, "--timeout-ms", 60000);
    ok($j->{watch_others_landed}, "2 ranks: rank 0 landed first")
        or diag(explain($j));
    is($j->{watch_state}, "transferring",
       "2 ranks: not ready while rank 1 is held back");
    ok(($j->{watch_rank_bad} // 0) > 0, "2 ranks: rank 1 had not landed");
    is($j->{push_state}, "done", "2 ranks: push done")
        or diag($j->{push_error});
    is($j->{recv_state}, "ready", "2 ranks: then ready")
        or diag($j->{recv_error});
    is_deeply($j->{bad}, [0, 0], "2 ranks: both bit-exact");
    my $s = ring_settles($d, 4);
    is($s->{recv_ring_bytes}, 2 * 2 * 65536, "2 ranks: a ring per rank");
    is($s->{recv_ring_chunks}, 2 * 64 * $BB / 65536,
       "2 ranks: every chunk of both ranks copied in");
    stop_agent($_) for $p, $d;

    # a slow receiver copy engine (20 MB/s) behind a 2-slot ring; a
    # request too big for the timeout fails mid-push, the next is exact
    ($p, $d) = pair2(prov => 'tcp;ofi_rxm', port => $po, ptransfer => $t,
        dtransfer => $t, transfer_ms => 1500, what => "throttled",
        denv => { KV_COPY_HOST_GBPS => "0.02" });
    $po += 2;
    push_ok($p, $d, 8, "th1", "throttled copy-in");
    $j = run_kvpush("--prefill", $p->{sock}, "--decode",
        "decode-0=$d->{sock}", "--nblocks", 200, "--dst", "explicit",
        "--req", "thbig", "--timeout-ms", 10000);
    my $r = $j->{results}[0] // {};
    is($r->{recv_state}, "failed", "a request too slow for the timeout "
       . "fails mid-push") or diag(explain($j));
    $s = ring_settles($d, 2);
    is($s->{recv_ring_free}, 2, "no ring slot leaked by the failed request")
        or diag(explain($s));
    ok($s->{recv_ring_chunks} > 8 * $BB / 65536
       && $s->{recv_ring_chunks} < (8 + 200) * $BB / 65536,
       "it failed mid-way ($s->{recv_ring_chunks} chunks copied)");
    my $i = api($d, { verb => "info" });
    for (1 .. 50) {
        last if ($i->{pool}{quarantined} // 1) == 0;
        select(undef, undef, undef, 0.1);
        $i = api($d, { verb => "info" });
    }
    is($i->{pool}{quarantined}, 0, "its blocks left quarantine (drained)");
    push_ok($p, $d, 8, "th2", "after the failure");
    stop_agent($_) for $p, $d;

    # every chunk notice sent again, for another slot with the same grant,
    # and for a slot out of range: all ignored, the bytes exact
    ($p, $d) = pair2(prov => 'tcp;ofi_rxm', port => $po, ptransfer => $t,
        dtransfer => $t, what => "repeats",
        penv => { KV_TEST_FAULT => "repeat_notice" });
    $po += 2;
    push_ok($p, $d, 16, "rep", "repeated notices");
    $s = ring_settles($d, 2);
    is($s->{recv_ring_bad_notices}, 3 * 16 * $BB / 65536,
       "every repeated or stray notice refused");
    like(log_text($d), qr/does not match a slot it holds; ignored/,
         "the receiver says why (a repeat, another slot)");
    like(log_text($d), qr/names rank 0 slot 39, which does not exist/,
         "... and for a slot out of range");
    stop_agent($_) for $p, $d;

    # a sender that does not speak ring credits: refused, clearly
    ($p, $d) = pair2(prov => 'tcp;ofi_rxm', port => $po, ptransfer => $t,
        dtransfer => $t, what => "old sender",
        penv => { KV_TEST_FAULT => "no_credits" });
    $po += 2;
    $j = run_kvpush("--prefill", $p->{sock}, "--decode",
        "decode-0=$d->{sock}", "--nblocks", 4, "--dst", "explicit",
        "--req", "old", "--timeout-ms", 10000);
    $r = $j->{results}[0] // {};
    is($r->{push_state}, "failed", "old sender: push refused");
    like($r->{push_error} // "", qr/does not follow ring credits/,
         "old sender: the error says why") or diag(explain($j));
    stop_agent($_) for $p, $d;
}
done_testing();
