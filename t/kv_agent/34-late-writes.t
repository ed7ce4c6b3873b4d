#!/usr/bin/perl
# No late write lands in reused blocks (issue 9, items 1 and 2), with real
# agents on loopback over tcp;ofi_rxm and shm:
#  * the sender is stopped (SIGSTOP) mid-push, the receiver times out, and
#    the same 512 blocks are wanted for a new request: they stay
#    quarantined until the resumed sender has stopped writing and said so;
#    its push reports failure, and the new request's bytes are intact;
#  * with tcp;ofi_rxm, a sender that never answers is cut off by
#    revocation (new memory keys) after quarantine_ms;
#  * a sender killed mid-push (SIGKILL): its blocks come back once its
#    process is gone, and the same request id can be pushed again at once.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use Time::HiRes qw(time sleep);
use KvAgentTest;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();

my $po = 140;
my $NB = 512;

sub poll_state {
    my ($a, $req, $re, $secs) = @_;
    return wait_for($secs, sub {
        my $r = api($a, { verb => "poll", req_id => $req }, 5);
        return $r && $r->{ok} && ($r->{state} // "") =~ $re ? $r : undef;
    });
}

# the push is under way: some bytes written, not all
sub wait_midway {
    my ($p, $req) = @_;
    return wait_for(10, sub {
        my $r = api($p, { verb => "poll", req_id => $req }, 5);
        return $r && ($r->{bytes_done} // 0) > 0
               && $r->{bytes_done} < $r->{bytes_total} ? $r : undef;
    });
}

# what blocks 0..NB-1 hold after "fill" with this seed (same geometry)
my %expect;
sub expected_sum {
    my ($p, $seed) = @_;
    return $expect{$seed} //= do {
        api($p, { verb => "fill", blocks_runs => [[0, $NB]], seed => $seed });
        api($p, { verb => "checksum", blocks_runs => [[0, $NB]] })
            ->{checksum};
    };
}

for my $prov ("tcp;ofi_rxm", "shm") {
  SKIP: {
    skip "libfabric provider $prov not available here", 1
        unless provider_ok($prov);
    %expect = ();
    my $tag = $prov eq 'shm' ? 'shm' : 'tcp';
    # slow writes so that a push lasts long enough to interrupt
    my $slow = { window => 1, max_write => $prov eq 'shm' ? 4096 : 65536 };
    my $P = { id => "prefill-0", ctrl => "127.0.0.1:" . kv_port($po),
              role => "prefill" };
    my $D = { id => "decode-0", ctrl => "127.0.0.1:" . kv_port($po + 1),
              role => "decode" };
    my %pc = (id => "prefill-0", role => "prefill", port => kv_port($po),
              provider => $prov, pool => llama_pool(), transfer => $slow,
              transfer_ms => 60000, peers => [$D]);
    my %dc = (id => "decode-0", role => "decode", port => kv_port($po + 1),
              provider => $prov, pool => llama_pool(), transfer_ms => 3000,
              peers => [$P]);
    my $d = start_agent(agent_config(%dc));
    my $p = start_agent(agent_config(%pc));
    ok(wait_connected($p, ["decode-0"]), "$tag: prefill connected")
        or diag(log_text($p), log_text($d));

    # --- sender frozen mid-push, receiver times out ----------------------
    my $r = api($d, { verb => "reserve", req_id => "old",
                      blocks_runs => [[0, $NB]] });
    ok($r->{ok}, "$tag: decode reserves blocks 0..511 for 'old'");
    api($p, { verb => "fill", blocks_runs => [[0, $NB]], seed => 3 });
    $r = api($p, { verb => "push", req_id => "old", peer => "decode-0",
                   src_runs => [[0, $NB]] });
    ok($r->{ok}, "$tag: push 'old' started");
    my $mid = wait_midway($p, "old");
    ok($mid, "$tag: push under way ("
       . ($mid ? "$mid->{bytes_done} of $mid->{bytes_total}" : "?") . ")");
    kill 'STOP', $p->{pid};
    $r = poll_state($d, "old", qr/failed/, 10);
    ok($r, "$tag: receiver fails 'old' while the sender is stopped");
    like($r && $r->{error}, qr/timed out/, "$tag: ... by its timeout");
    ok($r && $r->{quarantined}, "$tag: ... and quarantines its blocks");
    ok(api($d, { verb => "release", req_id => "old" })->{ok},
       "$tag: the engine releases the failed request");
    # item 2: the failed id is usable again at once
    $r = api($d, { verb => "reserve", req_id => "old", nblocks => 4 });
    ok($r->{ok}, "$tag: the failed request id can be reserved again at once")
        or diag(json_enc($r));
    ok(api($d, { verb => "release", req_id => "old" })->{ok},
       "$tag: ... and released");

    my $new = api($d, { verb => "reserve", req_id => "new",
                        blocks_runs => [[0, $NB]] });
    ok(!$new->{ok}, "$tag: the same 512 blocks are not reusable while the "
       . "sender may still write them");
    like($new->{error} // "", qr/quarantined/, "$tag: ... they are "
         . "quarantined: " . ($new->{error} // "(reserved!)"));
    my $filled = 0;
    if ($new->{ok}) {
        # what the old agent allowed: fill them now, before the sender runs
        api($d, { verb => "fill", blocks_runs => [[0, $NB]], seed => 77 });
        $filled = 1;
    }
    kill 'CONT', $p->{pid};
    $r = api($p, { verb => "wait", req_id => "old", timeout_ms => 30000 },
             40);
    is($r->{state}, "failed", "$tag: the resumed sender reports the push "
       . "failed");
    like($r->{error} // "", qr/cancelled by decode-0/, "$tag: ... cancelled "
         . "by the receiver: " . ($r->{error} // ""));
    ok(log_wait($d, qr/quarantine of old \(512 block\(s\)\) lifted: the sender's writes drained/, 10),
       "$tag: the sender's acknowledgement lifts the quarantine");
    unless ($filled) {
        $new = wait_for(10, sub {
            my $x = api($d, { verb => "reserve", req_id => "new",
                              blocks_runs => [[0, $NB]] });
            return $x->{ok} ? $x : undef;
        });
        ok($new, "$tag: the blocks are reserved for 'new' after the ack");
        api($d, { verb => "fill", blocks_runs => [[0, $NB]], seed => 77 });
    }
    sleep 2;            # any late write of 'old' would land by now
    my $got = api($d, { verb => "checksum", blocks_runs => [[0, $NB]] });
    is($got->{checksum}, expected_sum($p, 77), "$tag: the new request's "
       . "512 blocks hold exactly what was written into them");
    my $info = api($d, { verb => "info" });
    is($info->{pool}{quarantined}, 0, "$tag: nothing left in quarantine");
    api($d, { verb => "release", req_id => "new" });
    api($p, { verb => "release", req_id => "old" });

    # --- tcp: a sender that never answers is revoked ---------------------
    if ($prov ne 'shm') {
        stop_agent($d);
        $d = start_agent(agent_config(%dc,
            timeouts => { quarantine_ms => 1500 }));
        ok(wait_connected($p, ["decode-0"]), "$tag: prefill reconnected");
        api($p, { verb => "fill", blocks_runs => [[0, $NB]], seed => 5 });
        api($p, { verb => "push", req_id => "rv", peer => "decode-0",
                  src_runs => [[0, $NB]] });
        ok(wait_midway($p, "rv"), "$tag: push 'rv' under way");
        kill 'STOP', $p->{pid};
        ok(poll_state($d, "rv", qr/failed/, 10), "$tag: 'rv' fails at the "
           . "receiver");
        ok(log_wait($d, qr/memory keys revoked \(a quarantine was not acknowledged/, 10), "$tag: no acknowledgement within "
           . "quarantine_ms: the pool's keys are revoked");
        $r = api($d, { verb => "poll", req_id => "rv" });
        my $runs = $r->{blocks_runs};
        ok(!$r->{quarantined} && !$runs, "$tag: its blocks are free again");
        $new = api($d, { verb => "reserve", req_id => "after",
                         nblocks => $NB });
        ok($new->{ok}, "$tag: ... and reserved for a new request");
        my @nb = @{ $new->{blocks} // [] };
        api($d, { verb => "fill", blocks => \@nb, seed => 78 });
        my $before = api($d, { verb => "checksum", blocks => \@nb });
        kill 'CONT', $p->{pid};
        $r = api($p, { verb => "wait", req_id => "rv", timeout_ms => 30000 },
                 40);
        is($r->{state}, "failed", "$tag: the revoked push fails at the "
           . "sender: " . ($r->{error} // ""));
        sleep 2;
        is(api($d, { verb => "checksum", blocks => \@nb })->{checksum},
           $before->{checksum}, "$tag: nothing of it landed after the "
           . "revocation");
        ok(wait_connected($p, ["decode-0"]), "$tag: prefill reconnected "
           . "with the new keys");
        api($d, { verb => "release", req_id => "after" });
        api($p, { verb => "fill", blocks_runs => [[0, 64]], seed => 9 });
        api($p, { verb => "push", req_id => "fresh", peer => "decode-0",
                  src_runs => [[0, 64]] });
        $r = api($d, { verb => "wait", req_id => "fresh",
                       timeout_ms => 20000 }, 30);
        is($r->{state}, "ready", "$tag: a push under the new keys lands");
        is(api($d, { verb => "checksum", blocks_runs => $r->{blocks_runs} })
           ->{checksum}, api($p, { verb => "checksum",
                                   blocks_runs => [[0, 64]] })->{checksum},
           "$tag: ... bit-exact");
        api($_, { verb => "release", req_id => "fresh" }) for $p, $d;
        api($p, { verb => "release", req_id => "rv" });
    }

    # --- sender killed mid-push -----------------------------------------
    api($p, { verb => "fill", blocks_runs => [[0, $NB]], seed => 4 });
    api($p, { verb => "push", req_id => "kk", peer => "decode-0",
              src_runs => [[0, $NB]] });
    ok(wait_midway($p, "kk"), "$tag: push 'kk' (no reservation) under way");
    stop_agent($p, 'KILL');
    $r = poll_state($d, "kk", qr/failed/, 10);
    ok($r, "$tag: the receiver fails 'kk' when the sender dies");
    ok(log_wait($d, qr/quarantine of kk \(512 block\(s\)\) lifted: the sender's process exited/, 10),
       "$tag: its blocks come back once the sender's process is gone");
    $info = api($d, { verb => "info" });
    is($info->{pool}{free}, 600, "$tag: every block is free again");
    # the new sender writes at the default pace: the decode's 3 s timeout
    # (short, to fail the stopped sender above) must not fail this one
    # on a loaded machine
    $p = start_agent(agent_config(%pc, transfer => undef));
    ok(wait_connected($p, ["decode-0"]), "$tag: a new prefill connected");
    api($p, { verb => "fill", blocks_runs => [[0, 64]], seed => 6 });
    $r = api($p, { verb => "push", req_id => "kk", peer => "decode-0",
                   src_runs => [[0, 64]] });
    $r = api($p, { verb => "wait", req_id => "kk", timeout_ms => 60000 },
             70);
    is($r->{state}, "done", "$tag: the failed request id is pushed again "
       . "at once") or diag($r->{error});
    $r = api($d, { verb => "wait", req_id => "kk", timeout_ms => 10000 });
    is($r->{state}, "ready", "$tag: ... and lands");
    is(api($d, { verb => "checksum", blocks_runs => $r->{blocks_runs} // [] })
       ->{checksum}, api($p, { verb => "checksum",
                               blocks_runs => [[0, 64]] })->{checksum},
       "$tag: ... bit-exact");
    ok(agent_alive($d), "$tag: decode alive");
    is(stop_agent($p), 0, "$tag: prefill exits cleanly");
    is(stop_agent($d), 0, "$tag: decode exits cleanly");
  }
}
done_testing();
