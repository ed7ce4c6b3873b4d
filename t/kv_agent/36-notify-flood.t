#!/usr/bin/perl
# An outsider against the LMCache notify port and the control port (issue
# 24 item 5, an attacker review's reproductions):
#   * 3000 idle TCP connections to the notify port from an address outside
#     lmcache_notify.allow, the agent under RLIMIT_NOFILE 256: before, each
#     one held a descriptor until ZeroMQ's handshake timeout (the ZAP check
#     only runs after a greeting), the agent ran out of descriptors, allowed
#     notices were lost, the control port stopped answering and the accept
#     loop spun at 100 % CPU logging EMFILE.  Now the allowlist is enforced
#     at accept (the descriptor is closed at once): the agent holds none of
#     them, an allowed notice still counts, the control port and the local
#     API answer, CPU stays low and the log stays short;
#   * refused connections and rejected control peers: a few log lines a
#     second with a count, not one line per try;
#   * a peer's node id with a newline and ESC is escaped in the log: no
#     forged line.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use IPC::Open2;
use IO::Select;
use IO::Socket::INET;
use Time::HiRes qw(time sleep);
use KvAgentTest;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();
plan skip_all => "libfabric tcp;ofi_rxm provider not available here"
    unless provider_ok('tcp;ofi_rxm');
my $PY = -x '/usr/bin/python3' ? '/usr/bin/python3' : 'python3';
plan skip_all => 'python3-zmq / python3-msgpack missing (make deps)'
    if system("$PY -c 'import zmq, msgpack' 2>/dev/null") != 0;
plan skip_all => 'prlimit (util-linux) missing'
    if system('prlimit --version >/dev/null 2>&1') != 0;

my $N = $ENV{KV_FLOOD_CONNS} // 3000;
my ($cport, $nport) = (kv_port(160), kv_port(161));
my $NOTIFY = "127.0.0.1:$nport";
my $cfg = agent_config(id => "router-0", role => "router", port => $cport);
$cfg->{lmcache_notify} = { listen => $NOTIFY, allow => ["127.0.0.2/32"] };
# KV_TEST_VALGRIND=1: the agent under memcheck too (CPU bounds looser)
my $VG = $ENV{KV_TEST_VALGRIND} ? kv_tmpdir() . "/router-0.vg" : undef;
my @vg = $VG ? ("valgrind", "--leak-check=full",
                "--show-leak-kinds=definite", "--errors-for-leak-kinds=definite",
                "--error-exitcode=99", "--log-file=$VG") : ();
my $CPU_MAX = $VG ? 0.5 : 0.15;
my $a = start_agent($cfg, wrap => ["prlimit", "--nofile=256:256", "--", @vg],
                    timeout => $VG ? 90 : 20);
ok(log_text($a) =~ /info: ready$/m, "router agent ready (RLIMIT_NOFILE 256)")
    or BAIL_OUT(log_text($a));
my $pid = $a->{pid};

sub nfds { opendir(my $d, "/proc/$_[0]/fd") or return -1;
           my $n = grep { /^\d+$/ } readdir $d; closedir $d; return $n }

sub notice {
    my ($from, $id) = @_;
    return system($PY, kv_root() . "/tools/lmcache_notice.py", "--to",
                  $NOTIFY, "--from", $from, "notice", $id) >> 8;
}

sub notified {
    my ($id) = @_;
    return wait_for(5, sub {
        my ($j) = status_json($cfg->{state_path}, "--req", $id);
        return $j && ($j->{state} // '') eq 'ready' });
}

sub ctrl_answers {
    my $s = IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => $cport,
                                  Proto => "tcp", Timeout => 3) or return 0;
    my $sel = IO::Select->new($s);
    my $buf = '';
    my $deadline = time + 3;
    while (time < $deadline && length($buf) < 4) {
        next unless $sel->can_read(0.1);
        last unless sysread($s, $buf, 4096, length $buf);
    }
    close $s;
    return length($buf) >= 4;          # the challenge's frame
}

is(notice("127.0.0.2", "before-flood"), 0, "an allowed sender connects");
ok(notified("before-flood"), "... and its notice counts before the flood");
my $fd0 = nfds($pid);
my $lines0 = () = log_text($a) =~ /\n/g;

# --- the flood ----------------------------------------------------------
my $t0 = time;
my $fpid = open2(my $fout, my $fin, $PY, "$FindBin::Bin/idleconns.py",
                 "127.0.0.1", $nport, $N);
my $opened = <$fout> // '';
chomp $opened;
diag(sprintf("%s of %d idle connections from 127.0.0.1 (%.1f s)", $opened,
             $N, time - $t0));
sleep 1;
my ($fdmax, $c0, $w0) = (0, cpu_s($pid), time);
for (1 .. 30) {
    my $n = nfds($pid);
    $fdmax = $n if $n > $fdmax;
    sleep 0.1;
}
my $cpu = (cpu_s($pid) - $c0) / (time - $w0);
diag(sprintf("agent: %d descriptors before, at most %d during the flood; "
             . "CPU %.1f %%", $fd0, $fdmax, 100 * $cpu));
ok($fdmax <= $fd0 + 16, "the outsider holds no descriptors of the agent "
   . "($fd0 before, at most $fdmax during the flood)");
ok($cpu < $CPU_MAX, sprintf("no spin: %.1f %% CPU during the flood", 100 * $cpu));
is(notice("127.0.0.2", "during-flood"), 0, "an allowed sender connects");
ok(notified("during-flood"), "... and its notice counts during the flood");
ok(ctrl_answers(), "the control port answers during the flood");
my $info = api($a, { verb => "info" }, 5);
ok($info && $info->{ok}, "the local API answers during the flood");
my $text = log_text($a);
my $lines = (() = $text =~ /\n/g) - $lines0;
ok($lines <= 20, "the flood logged $lines lines (at most 20)")
    or diag(substr($text, -2000));
unlike($text, qr/Too many open files/, "no EMFILE in the log");
my @ref = $text =~ /^.*lmcache_notify: .*refused.*$/mg;
ok(@ref >= 1 && @ref <= 15, scalar(@ref) . " lines about refused notify "
   . "connections (5 a second at most)") or diag(join "\n", @ref[0 .. ($#ref > 5 ? 5 : $#ref)]);
like($ref[-1] // '', qr/\d+ so far/, "... with a count");
close $fin;
waitpid($fpid, 0);
ok(agent_alive($a), "the agent survived");

# --- an allowed address floods: out of descriptors, no spin, recovers -----
{
    my $l0 = () = log_text($a) =~ /\n/g;
    my $fp = open2(my $fo, my $fi, $PY, "$FindBin::Bin/idleconns.py",
                   "127.0.0.1", $nport, 1000, "--from", "127.0.0.2");
    my $op = <$fo> // '';
    chomp $op;
    sleep 0.5;
    my ($c1, $w1) = (cpu_s($pid), time);
    my $fdm = 0;
    for (1 .. 20) { my $n = nfds($pid); $fdm = $n if $n > $fdm; sleep 0.1 }
    my $cpu1 = (cpu_s($pid) - $c1) / (time - $w1);
    diag(sprintf("allowed flood (%s of 1000): at most %d descriptors, "
                 . "CPU %.1f %%", $op, $fdm, 100 * $cpu1));
    ok($cpu1 < $CPU_MAX, sprintf("out of descriptors: no spin (%.1f %% CPU)",
                             100 * $cpu1));
    ok(log_wait($a, qr/no descriptor left to accept a connection: not (?#
                      )listening for \d+ ms/, 1),
       "the shortage is logged, with the back-off");
    # idle ones are dropped after ZMQ_HANDSHAKE_IVL (3 s): the port works
    # again while the flooder still holds its ends
    my $ok = 0;
    my $t1 = time;
    while (!$ok && time < $t1 + 10) {
        $ok = notice("127.0.0.2", "after-allowed-flood") == 0
              && notified("after-allowed-flood");
    }
    ok($ok, sprintf("an allowed notice counts again %.1f s later",
                    time - $t1));
    ok(ctrl_answers(), "the control port answers again");
    my $l1 = (() = log_text($a) =~ /\n/g) - $l0;
    ok($l1 <= 60, "the allowed flood logged $l1 lines");
    close $fi;
    waitpid($fp, 0);
}

# --- a dual-stack listener ("[::]:PORT"): IPv4 peers arrive as
# ::ffff:a.b.c.d and the filter must still hold (libzmq parses a filter as
# ZMQ_IPV6 says when it is set: done wrong, "127.0.0.2/32" became a mask
# of ::ffff:0:0/32, which passes every mapped address) -------------------
SKIP: {
    my $p6 = kv_port(162);
    my $c6 = agent_config(id => "router-6", role => "router",
                          port => kv_port(163));
    $c6->{lmcache_notify} = { listen => "[::]:$p6",
                              allow => ["127.0.0.2/32", "::1/128"] };
    my $b = start_agent($c6, wrap => ["prlimit", "--nofile=256:256", "--"],
                        timeout => $VG ? 90 : 20);
    skip("no IPv6 here: " . (log_text($b) =~ /(cannot listen.*)/)[0], 3)
        unless log_text($b) =~ /info: ready$/m;
    my $f0 = nfds($b->{pid});
    my $fp = open2(my $fo, my $fi, $PY, "$FindBin::Bin/idleconns.py",
                   "127.0.0.1", $p6, 1000);
    my $op = <$fo> // '';
    sleep 1;
    my $fm = 0;
    for (1 .. 10) { my $n = nfds($b->{pid}); $fm = $n if $n > $fm;
                    sleep 0.1 }
    ok($fm <= $f0 + 16, "dual-stack listener: 1000 idle IPv4 connections "
       . "from outside allow hold none ($f0 before, at most $fm)");
    my $rc = system($PY, kv_root() . "/tools/lmcache_notice.py", "--to",
                    "127.0.0.1:$p6", "--from", "127.0.0.2", "notice",
                    "v6-listener") >> 8;
    my $ok = wait_for(5, sub {
        my ($j) = status_json($c6->{state_path}, "--req", "v6-listener");
        return $j && ($j->{state} // '') eq 'ready' });
    ok($rc == 0 && $ok, "dual-stack listener: an allowed IPv4 sender counts");
    close $fi;
    waitpid($fp, 0);
    is(stop_agent($b), 0, "dual-stack listener: clean exit");
}

# --- rejected control peers: rate-limited, escaped --------------------------
my $key = "ab" x 32;
my $evil = "intruder\n2026/12/04 00:00:00 [emerg] forged\x1b[2J\r";
$t0 = time;
my $out = `$PY $FindBin::Bin/fakepeer.py client --connect $cport --node '$evil' --role prefill --peer router-0 --peer-role router --key $key --count 300 2>&1`;
my $rej = () = log_text($a) =~ /rejected a peer/g;
diag(sprintf("300 rejected hellos in %.1f s: %d log lines", time - $t0, $rej));
ok($rej >= 1 && $rej <= 10, "300 rejected control peers: $rej log lines "
   . "(1 to 10)");
$text = log_text($a);
unlike($text, qr/^2026\/12\/04 00:00:00 \[emerg\] forged/m,
       "a peer's node id cannot forge a log line");
unlike($text, qr/\x1b|\r/, "no ESC or CR reaches the log");
like($text, qr/intruder\\x0a2026/, "the node id is logged escaped");
ok(agent_alive($a), "the agent is still running");
is(stop_agent($a, 'TERM', $VG ? 60 : 15), 0, "clean exit"
   . ($VG ? " (valgrind: no errors, no definite leaks)" : ""));
if ($VG) {
    my $v = do { local (@ARGV, $/) = $VG; <> } // '';
    like($v, qr/ERROR SUMMARY: 0 errors/, "valgrind: 0 errors")
        or diag($v);
}
done_testing();
