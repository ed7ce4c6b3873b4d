#!/usr/bin/perl
# Adaptive CQ polling (issue 12, point 6).  shm has no CQ wait fd (nor has
# EFA with its shm transfer on): the agent busy-polls while its writes are
# in flight, then backs off to sleeping instead of spinning a core.  A push
# over shm is frozen mid-way, once by stopping the receiver (the sender's
# writes stay in flight) and once by stopping the sender (the receive
# stays open); the side left running must use little CPU meanwhile, and
# the push must still complete bit-exact once the other side resumes.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use Time::HiRes qw(sleep time);
use POSIX ();
use KvAgentTest;
use PushSuite;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();
plan skip_all => "libfabric shm provider not available here"
    unless provider_ok('shm');

# voluntary context switches of the agent's main thread (its poll loop;
# a copy engine's thread would hide a spin there) so far
sub sleeps {
    my ($pid) = @_;
    open my $fh, '<', "/proc/$pid/status" or return 0;
    while (<$fh>) { return $1 if /^voluntary_ctxt_switches:\s+(\d+)/ }
    return 0;
}

my ($pa, $da) = PushSuite::pair('shm', 780, transfer => { coalesce => JSON::PP::false },
                                transfer_ms => 60000);
ok(wait_connected($pa, ["decode-0"]), "shm pair connected");
like(log_text($pa), qr/cq wait fd no \(polling\)/, "shm: no CQ wait fd");

my $n = 0;
for my $case (["receiver", $da, $pa], ["sender", $pa, $da]) {
    my ($who, $frozen, $running) = @$case;
    $n++;
    my $req = "poll-$n";
    api($pa, { verb => "fill", blocks_runs => [[0, 256]], seed => $n });
    my $r = api($pa, { verb => "push", req_id => $req, peer => "decode-0",
                       src_runs => [[0, 256]] });
    ok($r->{ok}, "$who case: push accepted") or diag(explain($r));
    # freeze the other side once bytes move
    my $deadline = time + 20;
    my $st;
    while (time < $deadline) {
        $st = api($pa, { verb => "poll", req_id => $req });
        last if ($st->{bytes_done} // 0) > 0 || $st->{final};
        sleep 0.005;
    }
    ok(!$st->{final}, "$who case: push in progress when $who is stopped")
        or diag(explain($st));
    kill 'STOP', $frozen->{pid};
    sleep 0.6;                                   # past two heartbeats
    # CPU per wall second over 2 s; on a loaded machine one window can be
    # inflated by scheduling alone (each wake-up costs more), so up to
    # three windows, the least counts: a spin stays high in every one.
    # And the side polling must sleep between polls (voluntary context
    # switches), which a spin never does, however loaded the machine.
    my ($used, $sleeps, @seen);
    for my $try (1 .. 3) {
        my ($c0, $v0, $t0) = (cpu_s($running->{pid}),
                              sleeps($running->{pid}), time);
        sleep 2;
        my $dt = time - $t0;
        my $u = (cpu_s($running->{pid}) - $c0) / $dt;
        my $v = (sleeps($running->{pid}) - $v0) / $dt;
        push @seen, sprintf("%.0f%%", 100 * $u);
        ($used, $sleeps) = ($u, $v) if !defined $used || $u < $used;
        last if $u < 0.15;
    }
    kill 'CONT', $frozen->{pid};
    cmp_ok($used, '<', 0.15, sprintf("%s stopped: the other side used %.0f%% "
           . "of a core polling (adaptive back-off, not a spin; windows: %s)",
           $who, 100 * $used, join(' ', @seen)));
    cmp_ok($sleeps, '>', 50, sprintf("%s stopped: the other side slept "
           . "between polls (%.0f voluntary context switches a second)",
           $who, $sleeps));
    my $w = api($da, { verb => "wait", req_id => $req, timeout_ms => 30000 },
                40);
    is($w->{state}, "ready", "$who case: ready after the $who resumed")
        or diag(explain($w));
    my $a = api($pa, { verb => "checksum", blocks_runs => [[0, 256]] });
    my $b = api($da, { verb => "checksum",
                       blocks_runs => $w->{blocks_runs} // [] });
    is($a->{checksum}, $b->{checksum}, "$who case: bit-exact");
    api($da, { verb => "release", req_id => $req });
    api($pa, { verb => "release", req_id => $req });
}
is(stop_agent($pa), 0, "prefill exits 0");
is(stop_agent($da), 0, "decode exits 0");
done_testing();
