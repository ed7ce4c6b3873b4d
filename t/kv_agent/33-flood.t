#!/usr/bin/perl
# Connection budgets (issue 9 item 7): 500 idle TCP connections to the
# control port must not lock the engine out of the local API; idle ones
# are closed within ~1 s (ctrl.hello_timeout_ms); a legitimate peer gets in
# once they are gone; one peer id may connect at most max_peer_connects
# times per window.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use Time::HiRes qw(time sleep);
use IO::Socket::INET;
use IO::Select;
use KvAgentTest;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();
plan skip_all => "libfabric tcp;ofi_rxm provider not available here"
    unless provider_ok('tcp;ofi_rxm');

my $po = 130;
my $fake = "$FindBin::Bin/fakepeer.py";
my ($pport, $dport) = map { kv_port($po + $_) } 0 .. 1;
my $P = { id => "prefill-0", ctrl => "127.0.0.1:$pport", role => "prefill" };
my $D = { id => "decode-0", ctrl => "127.0.0.1:$dport", role => "decode" };
my $pool = small_pool(blocks => 64);

# the decode agent under test: default budgets (max_clients 256,
# max_unauthenticated 64, hello_timeout_ms 1000)
my $d = start_agent(agent_config(id => "decode-0", role => "decode",
    port => $dport, pool => $pool, peers => [$P]));
ok(log_text($d) =~ /info: ready$/m, "decode agent ready");

# --- 500 idle connections --------------------------------------------------
my $N = 500;
my (@socks, %opened, %closed);
my $t0 = time;
for my $i (1 .. $N) {
    my $s = IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => $dport,
                                  Proto => "tcp", Timeout => 5);
    last unless $s;
    push @socks, $s;
    $opened{fileno $s} = time;
}
is(scalar @socks, $N, sprintf("opened $N idle TCP connections to the "
                               . "control port (%.2f s)", time - $t0));

# while they are open: the local API answers, several clients at once
my $t_api = time;
my @api = map { api($d, { verb => "info" }, 5) } 1 .. 8;
ok(!grep({ !$_ || !$_->{ok} } @api), "the local API works during the flood")
    or diag(explain(\@api), log_text($d));
my $st = $api[-1]{stats} // {};
ok(($st->{ctrl_unauthenticated} // 99) <= 64,
   "at most 64 unauthenticated control connections are held "
   . "($st->{ctrl_unauthenticated})");
ok(($st->{ctrl_refused} // 0) > 0, "the rest were refused at once "
   . "($st->{ctrl_refused})");

# every idle connection is closed by the agent: at once when over the cap,
# after ~1 s otherwise; note when each one saw EOF
my $sel = IO::Select->new(@socks);
my $deadline = time + 6;
while ($sel->count && time < $deadline) {
    for my $s ($sel->can_read(0.05)) {
        my $buf;
        my $n = sysread($s, $buf, 4096);
        next if defined $n && $n > 0;     # the challenge
        $closed{fileno $s} = time;
        $sel->remove($s);
    }
}
is(scalar keys %closed, $N, "the agent closed all $N");
my @held = sort { $a <=> $b }
           map { $closed{$_} - $opened{$_} } keys %closed;
my $max = $held[-1];
diag(sprintf("held: min %.2f s, median %.2f s, max %.2f s", $held[0],
             $held[@held / 2], $max));
ok($max < 2.0, sprintf("the longest-held idle one was closed after %.2f s "
                       . "(hello_timeout_ms 1000)", $max));
ok($held[-1] > 0.8, sprintf("... and the held ones were given their second "
                            . "(%.2f s)", $held[-1]));
close $_ for @socks;
like(log_text($d), qr/warn: ctrl: \d+ connections without a completed (?#
     )handshake: refusing more/, "refusals logged (once, not per socket)");

# a legitimate peer connects now
my $p = start_agent(agent_config(id => "prefill-0", role => "prefill",
    port => $pport, pool => $pool, peers => [$D]));
ok(wait_connected($p, ["decode-0"], 10) && wait_connected($d, ["prefill-0"]),
   "a legitimate peer connects after the flood");
api($p, { verb => "fill", blocks_runs => [[0, 8]], seed => 9 });
my $r = api($p, { verb => "push", req_id => "f1", peer => "decode-0",
                  src_runs => [[0, 8]] });
$r = api($d, { verb => "wait", req_id => "f1", timeout_ms => 10000 }, 20);
is($r->{state}, "ready", "... and pushes");

# --- a flood while the peer is connected does not touch it ---------------
@socks = ();
for (1 .. 200) {
    my $s = IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => $dport,
                                  Proto => "tcp", Timeout => 5) or last;
    push @socks, $s;
}
api($p, { verb => "fill", blocks_runs => [[8, 8]], seed => 10 });
$r = api($p, { verb => "push", req_id => "f2", peer => "decode-0",
               src_runs => [[8, 8]] });
$r = api($d, { verb => "wait", req_id => "f2", timeout_ms => 10000 }, 20);
is($r->{state}, "ready", "a push during a second flood lands");
close $_ for @socks;
stop_agent($p);
stop_agent($d);

# --- hello_timeout_ms is configurable; max_peer_connects -------------------
$d = start_agent(agent_config(id => "decode-0", role => "decode",
    port => $dport, pool => $pool, peers => [$P],
    ctrl => { hello_timeout_ms => 300, max_peer_connects => 3,
              peer_connect_window_ms => 60000 }));
{
    my $s = IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => $dport,
                                  Proto => "tcp", Timeout => 5);
    my $t = time;
    my $sl = IO::Select->new($s);
    my $eof;
    while (!$eof && time < $t + 3) {
        next unless $sl->can_read(0.05);
        my $n = sysread($s, my $buf, 4096);
        $eof = time - $t if !$n;
    }
    ok(defined $eof && $eof < 0.8 && $eof > 0.2,
       sprintf("hello_timeout_ms 300: an idle connection closed after %.2f s",
               $eof // -1));
}
my $out = `timeout 30 python3 '$fake' client --connect $dport --node prefill-0 --role prefill --peer decode-0 --peer-role decode --key @{[link_key("prefill-0", "decode-0")]} --count 5 2>&1`;
my $j = eval { json_dec((split /\n/, $out)[-1]) } // {};
my @types = map { $_->{reply}{type} // "none" } @{ $j->{results} // [] };
is("@types", "hello_ok hello_ok hello_ok error error",
   "max_peer_connects 3: the 4th and 5th handshakes of one peer id refused")
    or diag($out);
like($j->{results}[3]{reply}{error} // "", qr/too many connections/,
     "... told why");
ok(log_wait($d, qr/node prefill-0 connected 3 times within 60000 ms (?#
            )\(max_peer_connects\)/, 5), "... logged");
stop_agent($d);

done_testing();
