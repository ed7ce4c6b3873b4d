#!/usr/bin/perl
# A hung or failing copy engine never frees memory a copy may still write
# (kv_agent/src/ring.c, xfer.c; README "GPU", issue 12), with the host copy
# engine's test faults (KV_TEST_FAULT copy_stall / copy_fail /
# copy_record_fail) on real agents over tcp;ofi_rxm:
#  * the receiver's engine stalls 6 s with chunks queued; the request
#    times out meanwhile: the agent keeps answering (it never waits for a
#    copy), the request's blocks stay held after the engine's release
#    until the copies report, then they are free, reusable, and hold
#    exactly what was written into them afterwards;
#  * an event that reports an error, or one that cannot be recorded
#    (the receiver's, then the sender's engine): the slot is lost, not
#    freed; the request fails with the reason; the rank refuses further
#    staged transfers and register_pool with "restart the agent";
#  * a stalled engine without a wake fd (CUDA's events are polled): the
#    receiver backs off instead of spinning a core;
#  * SIGTERM with a copy stuck: the agent exits within seconds, saying why.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use Time::HiRes qw(time sleep);
use POSIX ();
use KvAgentTest;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();
plan skip_all => "tcp;ofi_rxm not available" unless provider_ok('tcp;ofi_rxm');

my $po = 820;
my $NB = 64;
my $T = { staging => "host", stage_chunk => 1 << 20, recv_slots => 2,
          recv_chunk => 65536 };

sub pair {
    my (%o) = @_;
    my $p = start_agent(agent_config(id => "prefill-0", role => "prefill",
        port => kv_port($po), pool => llama_pool(), transfer => $T,
        transfer_ms => 30000,
        peers => [{ id => "decode-0", role => "decode",
                    ctrl => "127.0.0.1:" . kv_port($po + 1) }]),
        env => $o{penv} // {});
    my $d = start_agent(agent_config(id => "decode-0", role => "decode",
        port => kv_port($po + 1), pool => llama_pool(), transfer => $T,
        transfer_ms => $o{transfer_ms} // 30000,
        peers => [{ id => "prefill-0", role => "prefill",
                    ctrl => "127.0.0.1:" . kv_port($po) }]),
        env => $o{denv} // {});
    $po += 2;
    ok(wait_connected($p, ["decode-0"]), "$o{what}: connected");
    return ($p, $d);
}

sub kvpush {
    my ($p, $d, $req, $n) = @_;
    my $j = run_kvpush("--prefill", $p->{sock}, "--decode",
        "decode-0=$d->{sock}", "--nblocks", $n // 16, "--dst", "explicit",
        "--req", $req, "--timeout-ms", 20000);
    return $j->{results}[0] // { error => $j->{error} // "no result" };
}

sub stats { api($_[0], { verb => "info" })->{stats} }

# a push through the API on the pools kvpush registered (kvpush itself
# registers new pools, which a failed engine refuses)
sub api_push {
    my ($p, $req, $n) = @_;
    my $r = api($p, { verb => "push", req_id => $req, peer => "decode-0",
                      src_runs => [[0, $n]] });
    return $r unless $r->{ok};
    return api($p, { verb => "wait", req_id => $req, timeout_ms => 15000 },
               20);
}

# --- a stalled engine: held, never waited for, freed when it reports -----
{
    my ($p, $d) = pair(what => "stall", transfer_ms => 2000,
                       denv => { KV_TEST_FAULT => "copy_stall:40:6000" });
    my $r = api($d, { verb => "reserve", req_id => "old",
                      blocks_runs => [[0, $NB]] });
    ok($r->{ok}, "stall: decode reserves blocks 0..63 for 'old'");
    api($p, { verb => "fill", blocks_runs => [[0, $NB]], seed => 5 });
    $r = api($p, { verb => "push", req_id => "old", peer => "decode-0",
                   src_runs => [[0, $NB]] });
    ok($r->{ok}, "stall: push 'old' started");
    my $t0 = time;
    $r = wait_for(10, sub {
        my $x = api($d, { verb => "poll", req_id => "old" }, 5);
        return $x && ($x->{state} // "") eq "failed" ? $x : undef;
    });
    ok($r, "stall: the receiver fails 'old' by its timeout while its "
       . "copies are stuck");
    like($r && $r->{error} // "", qr/timed out/, "stall: ... timed out");
    ok(time - $t0 < 5.5, "stall: ... before the engine comes back");
    # the loop never waits for a copy: every call answers at once
    my $worst = 0;
    for (1 .. 5) {
        my $a = time;
        api($d, { verb => "info" }, 5);
        $worst = time - $a if time - $a > $worst;
        sleep 0.05;
    }
    ok($worst < 0.5, sprintf("stall: the agent keeps answering (slowest "
       . "info %.0f ms)", $worst * 1000));
    $r = wait_for(3, sub {
        my $x = api($d, { verb => "poll", req_id => "old" }, 5);
        return $x && $x->{copy_pending} ? $x : undef;
    });
    ok($r && $r->{quarantined} && $r->{copy_pending},
       "stall: poll says its blocks are held by a pending copy");
    is(api($d, { verb => "info" })->{pool}{copy_held}, 1,
       "stall: info pool.copy_held 1");
    ok(api($d, { verb => "release", req_id => "old" })->{ok},
       "stall: the engine releases 'old'");
    my $new = api($d, { verb => "reserve", req_id => "new",
                        blocks_runs => [[0, $NB]] });
    ok(!$new->{ok}, "stall: its blocks cannot be reserved while a copy "
       . "into them is queued");
    like($new->{error} // "", qr/held: a copy from the staging ring into (?#
         )it has not completed/, "stall: ... and the error says why: "
         . ($new->{error} // "(reserved!)"));
    ok(log_wait($d, qr/the copies into old's 64 block\(s\) completed/, 15),
       "stall: the engine comes back and reports: the blocks are let go");
    ok(time - $t0 > 4, "stall: ... only after the stall");
    $new = wait_for(5, sub {
        my $x = api($d, { verb => "reserve", req_id => "new",
                          blocks_runs => [[0, $NB]] });
        return $x->{ok} ? $x : undef;
    });
    ok($new, "stall: then the blocks are reserved for 'new'");
    api($d, { verb => "fill", blocks_runs => [[0, $NB]], seed => 77 });
    sleep 1;
    api($p, { verb => "fill", blocks_runs => [[0, $NB]], seed => 77 });
    is(api($d, { verb => "checksum", blocks_runs => [[0, $NB]] })->{checksum},
       api($p, { verb => "checksum", blocks_runs => [[0, $NB]] })->{checksum},
       "stall: 'new' holds exactly what was written into it (no late copy)");
    api($d, { verb => "release", req_id => "new" });
    api($p, { verb => "release", req_id => "old" });
    my $s = wait_for(5, sub {
        my $x = stats($d);
        return ($x->{recv_ring_free} // 0) == 2 ? $x : undef;
    });
    ok($s, "stall: both ring slots free again");
    is($s && $s->{recv_ring_lost}, 0, "stall: none lost");
    $r = kvpush($p, $d, "after");
    is($r->{recv_state}, "ready", "stall: the next push lands")
        or diag(explain($r));
    is($r->{mismatched_slices}, 0, "stall: ... bit-exact");
    unlike(log_text($d), qr/unaccounted/, "stall: no slot unaccounted for");
    stop_agent($_) for $p, $d;
}

# --- a stalled engine without a wake fd (polled, as CUDA's events are):
# the loop backs off instead of spinning a core, the push completes after
{
    my ($p, $d) = pair(what => "stall polled", denv => {
        KV_TEST_FAULT => "copy_no_wake,copy_stall:200:4000" });
    my $r = kvpush($p, $d, "warm", 1);
    is($r->{recv_state}, "ready", "stall polled: a push lands (events "
       . "polled)") or diag(explain($r));
    # the warm push took 160 copies (one block: 16 pieces a chunk); this
    # one's 160 chunks are one copy each: the engine stalls at its 40th
    my $tp = time;
    ok(api($p, { verb => "push", req_id => "slow", peer => "decode-0",
                 src_runs => [[0, 16]] })->{ok}, "stall polled: push slow");
    sleep 1;
    my ($c0, $t0) = (cpu_s($d->{pid}), time);
    sleep 2;
    my $used = (cpu_s($d->{pid}) - $c0) / (time - $t0);
    ok($used < 0.5, sprintf("stall polled: the receiver uses %.0f%% of a "
       . "core while the copy is stuck (not a spin)", $used * 100));
    $r = api($d, { verb => "wait", req_id => "slow", timeout_ms => 20000 },
             25);
    is($r->{state}, "ready", "stall polled: ready once the engine is back")
        or diag(explain($r));
    ok(time - $tp > 3.5, sprintf("stall polled: ... after the stall "
       . "(%.1f s)", time - $tp));
    is(api($d, { verb => "checksum", blocks_runs => $r->{blocks_runs} // [] })
       ->{checksum}, api($p, { verb => "checksum",
                               blocks_runs => [[0, 16]] })->{checksum},
       "stall polled: ... bit-exact");
    stop_agent($_) for $p, $d;
}

# --- SIGTERM while a copy is stuck: the agent exits (it does not wait on
# the engine, nor free memory under it), saying why
{
    my ($p, $d) = pair(what => "exit stuck", denv => {
        KV_TEST_FAULT => "copy_stall:200:60000" });
    my $r = kvpush($p, $d, "warm", 1);
    is($r->{recv_state}, "ready", "exit stuck: a push lands");
    ok(api($p, { verb => "push", req_id => "stuck", peer => "decode-0",
                 src_runs => [[0, 16]] })->{ok}, "exit stuck: push stuck");
    sleep 1;
    my $t = time;
    is(stop_agent($d, 'TERM', 20), 0, "exit stuck: SIGTERM: exit 0");
    ok(time - $t < 8, sprintf("exit stuck: ... in %.1f s (the stall had "
       . "59 s to go)", time - $t));
    like(log_text($d), qr/copy batch\(es\) never reported by the copy (?#
         )engine; the engines and the pool are left to the process exit/,
         "exit stuck: ... saying why");
    stop_agent($p);
}

# --- failed events: receiver side ---------------------------------------
for my $f (["copy_fail:30", "an event reported an error"],
           ["copy_record_fail:30", "could not record the event"])
{
    my ($fault, $why) = @$f;
    my ($p, $d) = pair(what => "receiver $fault",
                       denv => { KV_TEST_FAULT => $fault });
    my $r = kvpush($p, $d, "warm", 1);        # 10 chunks: events 1..10
    is($r->{recv_state}, "ready", "receiver $fault: a push before the "
       . "fault lands") or diag(explain($r));
    # two requests landing at once when the engine fails: both fail now,
    # not after transfer_ms (30 s)
    my $t0 = time;
    ok(api($p, { verb => "push", req_id => "a", peer => "decode-0",
                 src_runs => [[0, 16]] })->{ok}, "receiver $fault: push a");
    ok(api($p, { verb => "push", req_id => "b", peer => "decode-0",
                 src_runs => [[16, 16]] })->{ok}, "receiver $fault: push b");
    # waited for at the sender: a push whose push_begin reaches the
    # receiver after the failure is refused there and never has a record
    my %w;
    for my $q ("a", "b") {
        $w{$q} = api($p, { verb => "wait", req_id => $q,
                           timeout_ms => 20000 }, 25);
    }
    is($w{a}{state}, "failed", "receiver $fault: a fails");
    is($w{b}{state}, "failed", "receiver $fault: b fails");
    ok(time - $t0 < 8, sprintf("receiver $fault: both at once (%.1f s), "
       . "not by their timeout", time - $t0));
    like("$w{a}{error} | $w{b}{error}", qr/staging copy to GPU failed/,
         "receiver $fault: ... one with the reason: $w{a}{error}");
    like("$w{a}{error} | $w{b}{error}", qr/staging copy to GPU failed|(?#
         )copy engine of (its staging ring|rank 0) failed.*restart the agent/,
         "receiver $fault: ... the other too: $w{b}{error}");
    ok(log_wait($d, qr/the host copy engine failed \(\Q$why\E/, 5),
       "receiver $fault: the log says the engine failed and why");
    my $s = stats($d);
    ok(($s->{recv_ring_lost} // 0) >= 1 && $s->{recv_ring_lost} <= 2,
       "receiver $fault: the slot is lost, not freed "
       . "($s->{recv_ring_lost} lost)");
    ok(($s->{recv_ring_free} // 9) + $s->{recv_ring_lost} <= 2,
       "receiver $fault: lost slots are not granted again");
    $r = api_push($p, "next", 4);
    is($r->{state}, "failed",
       "receiver $fault: no staged transfer lands after that");
    like($r->{error} // "", qr/copy engine of rank 0 failed.*restart the (?#
         )agent/,
         "receiver $fault: ... refused with a clear error")
        or diag(explain($r));
    $r = api($d, { verb => "register_pool", memory => "host" });
    ok(!$r->{ok} && ($r->{error} // "") =~ /copy engine failed.*restart/,
       "receiver $fault: register_pool refused: " . ($r->{error} // ""));
    ok(agent_alive($d), "receiver $fault: the agent is still up");
    stop_agent($_) for $p, $d;
}

# --- failed events: sender side -----------------------------------------
for my $f (["copy_fail:3", "an event reported an error"],
           ["copy_record_fail:3", "could not record the event"])
{
    my ($fault, $why) = @$f;
    my ($p, $d) = pair(what => "sender $fault",
                       penv => { KV_TEST_FAULT => $fault });
    my $r = kvpush($p, $d, "bad", 32);
    is($r->{push_state}, "failed", "sender $fault: the push fails")
        or diag(explain($r));
    like($r->{push_error} // "", qr/staging copy from GPU failed/,
         "sender $fault: ... with the reason");
    ok(log_wait($p, qr/stage: rank 0: the host copy engine failed (?#
       )\(\Q$why\E/, 5), "sender $fault: the log says the engine failed");
    my $s = stats($p);
    ok(($s->{stage_lost} // 0) >= 1, "sender $fault: the staging slot is "
       . "lost, never filled again (" . ($s->{stage_lost} // 0) . ")");
    $r = api_push($p, "next", 4);
    is($r->{state}, "failed", "sender $fault: the next push fails");
    like($r->{error} // "", qr/staging copy engine failed earlier.*(?#
         )restart the agent/, "sender $fault: ... with a clear error")
        or diag(explain($r));
    ok(agent_alive($p), "sender $fault: the agent is still up");
    stop_agent($_) for $p, $d;
}

done_testing();
