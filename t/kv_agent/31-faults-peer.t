#!/usr/bin/perl
# Peer faults: wrong link key, a peer that is not allowed, a peer killed in
# the middle of a transfer (both directions), the peer coming back, and
# SIGTERM during a transfer (requests failed, state file consistent).
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use Time::HiRes qw(time sleep);
use KvAgentTest;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();
plan skip_all => "libfabric tcp;ofi_rxm provider not available here"
    unless provider_ok('tcp;ofi_rxm');

my $po = 40;
# slow, many small writes so a transfer lasts long enough to interrupt
my $slow = { window => 1, max_write => 65536 };
my $timeout_ms = 3000;

sub cfg {
    my ($id, $role, $off, $peers, %o) = @_;
    return agent_config(id => $id, role => $role, port => kv_port($po + $off),
        pool => llama_pool(), transfer => $slow, transfer_ms => $timeout_ms,
        peers => $peers, %o);
}
my $P = { id => "prefill-0", ctrl => "127.0.0.1:" . kv_port($po),
          role => "prefill" };
my $D = { id => "decode-0", ctrl => "127.0.0.1:" . kv_port($po + 1),
          role => "decode" };
my $D1 = { id => "decode-1", ctrl => "127.0.0.1:" . kv_port($po + 2),
           role => "decode" };

# --- wrong link key, and a node that is not on the allowlist ------------
{
    my $d = start_agent(cfg("decode-0", "decode", 1, [$P]));
    my $p = start_agent(cfg("prefill-0", "prefill", 0, [$D],
        keys => { "decode-0" => link_key("prefill-0", "decode-0", "x") }));
    ok(log_wait($d, qr/rejected a peer: node prefill-0 uses key \w+, which (?#
                )is not one of its keys here/, 10),
       "receiver logs the unknown key");
    ok(log_wait($p, qr/rejected by decode-0: authentication failed/, 10),
       "sender logs that it was rejected");
    my $r = api($p, { verb => "push", req_id => "t1", peer => "decode-0",
                      src => [0] });
    ok(!$r->{ok} && $r->{error} =~ /not connected/,
       "push over an unauthenticated link is refused");
    stop_agent($p);

    my $x = start_agent(cfg("prefill-x", "prefill", 3, [$D]));
    ok(log_wait($d, qr/rejected a peer: node prefill-x is not an allowed peer/,
                10), "unknown node id rejected");
    stop_agent($x);
    ok(agent_alive($d), "receiver still running");
    stop_agent($d);
}

sub fill_and_push {
    my ($p, $req, $peer) = @_;
    api($p, { verb => "fill", blocks_runs => [[0, 512]], seed => 3 });
    return api($p, { verb => "push", req_id => $req, peer => $peer,
                     src_runs => [[0, 512]] });
}

sub wait_state {
    my ($a, $req, $re, $secs) = @_;
    my $deadline = time + $secs;
    while (time < $deadline) {
        my $r = api($a, { verb => "poll", req_id => $req }, 5);
        return $r if $r && $r->{ok} && ($r->{state} // "") =~ $re;
        sleep 0.005;
    }
    return undef;
}

# --- decode killed mid-transfer; prefill keeps serving; decode returns ----
{
    my $p = start_agent(cfg("prefill-0", "prefill", 0, [$D, $D1]));
    my $d = start_agent(cfg("decode-0", "decode", 1, [$P]));
    my $d1 = start_agent(cfg("decode-1", "decode", 2, [$P]));
    ok(wait_connected($p, ["decode-0", "decode-1"]), "prefill connected")
        or diag(log_text($p));
    my $r = fill_and_push($p, "k1", "decode-0");
    ok($r->{ok}, "push started");
    ok(wait_state($d, "k1", qr/transferring/, 5), "decode is receiving");
    my $part;
    my $deadline = time + 5;
    while (time < $deadline) {
        $part = api($p, { verb => "poll", req_id => "k1" });
        last if $part->{bytes_done} > 0;
        sleep 0.002;
    }
    ok($part->{state} eq "transferring" && $part->{bytes_done}
       < $part->{bytes_total}, "killed mid-transfer ($part->{bytes_done} of "
       . "$part->{bytes_total} bytes)");
    my $t0 = time;
    stop_agent($d, 'KILL');
    $r = api($p, { verb => "wait", req_id => "k1", timeout_ms => 10000 });
    my $dt = time - $t0;
    is($r->{state}, "failed", "sender marks the push failed");
    like($r->{error}, qr/decode-0/, "... naming the peer: $r->{error}");
    ok($dt < $timeout_ms / 1000 + 1, sprintf("... within the timeout "
       . "(%.2fs)", $dt));

    # the agent keeps serving others
    $r = fill_and_push($p, "k2", "decode-1");
    $r = api($p, { verb => "wait", req_id => "k2", timeout_ms => 20000 });
    is($r->{state}, "done", "prefill still pushes to decode-1")
        or diag(explain($r), explain(api($p, { verb => "info" })->{stats}),
                log_text($p));
    my $r1 = api($d1, { verb => "wait", req_id => "k2", timeout_ms => 5000 });
    is($r1->{state}, "ready", "decode-1 has the blocks");
    api($_, { verb => "release", req_id => "k2" }) for $p, $d1;

    # a silent peer (stopped, socket open): the timeout fails it, on both
    # sides
    $r = fill_and_push($p, "k5", "decode-1");
    ok(wait_state($d1, "k5", qr/transferring/, 5), "decode-1 receiving k5");
    kill 'STOP', $d1->{pid};
    $t0 = time;
    $r = api($p, { verb => "wait", req_id => "k5", timeout_ms => 10000 });
    $dt = time - $t0;
    kill 'CONT', $d1->{pid};
    is($r->{state}, "failed", "push to a frozen peer fails");
    like($r->{error}, qr/timed out after $timeout_ms ms/, "... by timeout");
    ok($dt < $timeout_ms / 1000 + 1, sprintf("... in %.2fs", $dt));
    $r = api($d1, { verb => "wait", req_id => "k5", timeout_ms => 5000 });
    is($r->{state}, "failed", "the frozen receiver fails it too once it runs");
    ok(api($d1, { verb => "release", req_id => "k5" })->{ok},
       "receiver releases the failed request");

    # the peer returns (same config) and the link comes back
    $d = start_agent(cfg("decode-0", "decode", 1, [$P]));
    ok(wait_connected($p, ["decode-0"], 10), "prefill reconnects to the "
       . "restarted decode-0");
    api($p, { verb => "release", req_id => "k1" });
    $r = fill_and_push($p, "k1", "decode-0");
    $r = api($p, { verb => "wait", req_id => "k1", timeout_ms => 20000 });
    is($r->{state}, "done", "push to the returned peer succeeds")
        or diag(explain($r), log_text($p));
    $r = api($d, { verb => "wait", req_id => "k1", timeout_ms => 5000 });
    is($r->{state}, "ready", "... and lands");
    my $sum_p = api($p, { verb => "checksum", blocks_runs => [[0, 512]] });
    my $runs = $r->{blocks_runs};
    my $sum_d = api($d, { verb => "checksum", blocks_runs => $runs });
    is($sum_d->{checksum}, $sum_p->{checksum}, "... bit-exact");

    # --- prefill killed mid-transfer: the receiver fails the request ----
    api($d, { verb => "release", req_id => "k1" });
    api($p, { verb => "release", req_id => "k1" });
    $r = fill_and_push($p, "k3", "decode-0");
    ok(wait_state($d, "k3", qr/transferring/, 5), "decode receiving k3");
    $t0 = time;
    stop_agent($p, 'KILL');
    $r = api($d, { verb => "wait", req_id => "k3", timeout_ms => 10000 });
    $dt = time - $t0;
    is($r->{state}, "failed", "receiver fails the request when the sender "
       . "dies");
    like($r->{error}, qr/prefill-0/, "... naming the sender: $r->{error}");
    ok($dt < $timeout_ms / 1000 + 1, sprintf("... within the timeout "
       . "(%.2fs)", $dt));
    my ($st) = status_json($d->{cfg}{state_path});
    my ($rec) = grep { $_->{req_id} eq "k3" } @{ $st->{requests} };
    is($rec && $rec->{state}, "failed", "state table says failed");
    ok(api($d, { verb => "info" })->{ok}, "decode keeps serving");

    # --- SIGTERM during a transfer --------------------------------------
    $p = start_agent(cfg("prefill-0", "prefill", 0, [$D, $D1]));
    ok(wait_connected($p, ["decode-0"], 10), "new prefill connected");
    $r = fill_and_push($p, "k4", "decode-0");
    ok(wait_state($d, "k4", qr/transferring/, 5), "decode receiving k4");
    is(stop_agent($d, 'TERM'), 0, "decode exits 0 on SIGTERM mid-transfer");
    like(log_text($d), qr/request k4 failed: agent shutting down/,
         "in-flight request marked failed");
    my ($st2, $rc) = status_json($d->{cfg}{state_path});
    is($rc, 0, "state file still readable");
    ok($st2 && !$st2->{writer_alive}, "header says the writer stopped");
    is($st2 && $st2->{unreadable}, 0, "no record left mid-write");
    ($rec) = grep { $_->{req_id} eq "k4" } @{ $st2->{requests} };
    is($rec && $rec->{state}, "failed", "k4 recorded as failed");
    my ($self) = grep { $_->{self} } @{ $st2->{nodes} };
    ok($self && !$self->{alive}, "own node record no longer alive");
    $r = api($p, { verb => "wait", req_id => "k4", timeout_ms => 10000 });
    is($r->{state}, "failed", "the sender's push failed too");
    stop_agent($p);
    stop_agent($d1);
}
# --- a provider that never reports the dead peer's writes ---------------
# (ofi_rxm may drop the operations queued on a connection it closes).  The
# window is per rail and shared by all peers: the failed push's writes
# must leave it, or every later push, to any peer, waits forever.
{
    my $p = start_agent(cfg("prefill-0", "prefill", 0, [$D, $D1]),
                        env => { KV_TEST_FAULT => "lose_write_errors" });
    my $d = start_agent(cfg("decode-0", "decode", 1, [$P]));
    my $d1 = start_agent(cfg("decode-1", "decode", 2, [$P]));
    ok(wait_connected($p, ["decode-0", "decode-1"]), "lost completions: "
       . "prefill connected") or diag(log_text($p));
    fill_and_push($p, "w1", "decode-0");
    ok(wait_state($d, "w1", qr/transferring/, 5), "decode-0 receiving w1");
    my $deadline = time + 5;
    while (time < $deadline) {
        last if api($p, { verb => "poll", req_id => "w1" })->{bytes_done};
        sleep 0.002;
    }
    stop_agent($d, 'KILL');
    my $r = api($p, { verb => "wait", req_id => "w1", timeout_ms => 10000 });
    is($r->{state}, "failed", "push to the killed peer fails");
    my $st = api($p, { verb => "info" })->{stats};
    is($st->{writes_inflight}, 0, "its writes left the window (owed: "
       . "$st->{writes_owed})");
    fill_and_push($p, "w2", "decode-1");
    $r = api($p, { verb => "wait", req_id => "w2", timeout_ms => 20000 });
    is($r->{state}, "done", "a push to another peer still goes through")
        or diag(explain($r), log_text($p));
    my $r1 = api($d1, { verb => "wait", req_id => "w2", timeout_ms => 5000 });
    is($r1->{state}, "ready", "... and lands");
    ok(agent_alive($p), "sender still running");
    stop_agent($p);
    stop_agent($d1);
}
done_testing();
