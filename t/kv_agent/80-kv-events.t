#!/usr/bin/perl
# vLLM KV events: the decoder on payloads msgspec encodes with Structs
# declared as in vllm/distributed/kv_events.py (t/kv_agent/kvevents.py,
# both event forms, both hash forms, 2- and 3-element batches, a map
# batch), refusals (malformed, too deep, lying sizes, over the bounds),
# and the subscriber against a publisher speaking ZmqEventPublisher's
# protocol: in order, gaps with and without replay, a replay that never
# answers, a replay whose buffer rolled over, a late subscriber catching
# up, a restart, garbage frames and a neighbour's topic.  Then the
# "kv_events" config: accepted, refused with a clear reason, and a
# running router agent subscribed.

use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use KvAgentTest;
use Time::HiRes qw(sleep);

my $py = ($ENV{DPD_VENV} // kv_root() . "/.venv") . "/bin/python";
plan skip_all => "no Python venv with msgspec and pyzmq ($py)"
    unless -x $py
        && system("$py -c 'import msgspec, zmq' 2>/dev/null") == 0;

my $bin = kv_bin();
my $dir = kv_tmpdir();
my $helper = "$FindBin::Bin/kvevents.py";
my @WRAP;              # valgrind, for the last part
my $sub_rc;            # the subscriber's exit status in scenario()

# ---- the decoder ----------------------------------------------------------

system($py, $helper, "cases", $dir) == 0 or BAIL_OUT("kvevents.py cases");
my $exp = json_dec(do { local $/; open my $f, '<', "$dir/expected.json"
                                      or die; <$f> });

sub decode {
    my (@files) = @_;
    my @out = `@WRAP $bin events --decode @files 2>&1`;
    $sub_rc = $? >> 8;
    my @ev = map { json_dec($_) } grep { /^\{/ } @out;
    return @ev;
}

for my $c (@{ $exp->{cases} }) {
    my @got = decode("$dir/$c->{name}.mp");
    my $stats = pop @got;
    my @ev = grep { $_->{event} =~ /^(stored|removed|cleared)$/ } @got;
    for my $e (@ev) {
        delete @$e{qw(node seq ts)};
    }
    is_deeply(\@ev, $c->{events}, "decoded exactly: $c->{name}")
        or diag explain \@got;
    is($stats->{msgs_refused}, 0, "$c->{name}: the batch is accepted");
}

{
    my ($s) = grep { $_->{event} eq 'stats' } decode("$dir/unknown.mp");
    is($s->{ignored}, 3, "unknown types and a REMOTE locality: ignored, "
       . "counted");
    ($s) = grep { $_->{event} eq 'stats' } decode("$dir/wrong.mp");
    is($s->{refused}, 15, "each malformed event refused and counted; the "
       . "good ones around them delivered (above)");
    ($s) = grep { $_->{event} eq 'stats' } decode("$dir/repeated_key.mp");
    is($s->{refused}, 1, "a repeated key refuses its event");
    ($s) = grep { $_->{event} eq 'stats' } decode("$dir/map_int.mp");
    is($s->{stored_lower}, 1, "medium CPU: a lower tier, counted apart");
}

for my $name (@{ $exp->{refused} }) {
    my @got = decode("$dir/$name.mp");
    my ($r) = grep { $_->{event} eq 'refused_msg' } @got;
    ok($r && $r->{why}, "refused whole: $name" . ($r ? " ($r->{why})" : ""));
    ok(!grep({ $_->{event} =~ /^(stored|removed|cleared)$/ } @got),
       "$name: nothing delivered");
}

{
    my @got = decode("$dir/too_many_events.mp");
    my ($r) = grep { $_->{event} eq 'refused_msg' } @got;
    like($r->{why} // '', qr/more events/, "65537 events: refused whole");
    @got = decode("$dir/too_many_blocks.mp");
    my ($s) = grep { $_->{event} eq 'stats' } @got;
    is($s->{refused}, 1, "65537 hashes in one event: that event refused");
}

{
    # a 16 MiB + 1 payload: refused before it is read
    my $f = "$dir/huge.mp";
    open my $fh, '>', $f or die;
    print $fh "\x92\xcb" . ("\0" x 8) . "\xdb" . pack("N", 16 << 20)
              . ("a" x (16 << 20));
    close $fh;
    my @got = decode($f);
    my ($r) = grep { $_->{event} eq 'refused_msg' } @got;
    like($r->{why} // '', qr/larger than allowed/,
         "a payload over 16 MiB: refused");
}

# ---- the subscriber --------------------------------------------------------

my $port = kv_port(800);

# run a publisher script and the subscriber; the events and stats lines
sub scenario {
    my (%o) = @_;
    my $pubp = $port++;
    my $repp = $port++;
    my @scripts;
    for my $k (0 .. $#{ $o{scripts} // [$o{script}] }) {
        my $sc = ($o{scripts} // [$o{script}])->[$k];
        my $script = "$dir/script-$pubp-$k.json";
        open my $fh, '>', $script or die;
        print $fh json_enc([["sleep", $o{lead} // 100], @$sc]);
        close $fh;
        push @scripts, $script;
    }
    my @sub = (@WRAP, $bin, "events", "--endpoint", "tcp://127.0.0.1:$pubp",
               "--node", "pod-a", "--seconds", $o{seconds} // 6,
               "--replay-timeout-ms", $o{timeout} // 1000);
    push @sub, "--replay", "tcp://127.0.0.1:$repp" if $o{replay};
    push @sub, "--topic", $o{topic} if defined $o{topic};
    push @sub, "--count", $o{count} if $o{count};
    my @pub = ($py, $helper, "pub", "--pub", "tcp://127.0.0.1:$pubp");
    push @pub, "--replay", "tcp://127.0.0.1:$repp" if $o{replay};
    push @pub, "--topic", $o{topic} if defined $o{topic};
    push @pub, "--replay-topic" if $o{replay_topic};
    my $out = "$dir/sub-$pubp.out";
    my $spid = fork // die;
    if ($spid == 0) {
        open STDOUT, '>', $out or die;
        open STDERR, '>', "$out.err" or die;
        exec @sub or exit 127;
    }
    sleep 0.2;
    for my $script (@scripts) {        # one publisher process each
        my $ppid = fork // die;
        if ($ppid == 0) {
            open STDOUT, '>>', "$out.pub" or die;
            open STDERR, '>&', \*STDOUT;
            exec @pub, "--script", $script or exit 127;
        }
        if ($o{freeze}) {              # [after s, for s]: SIGSTOP it
            sleep $o{freeze}[0];
            kill 'STOP', $ppid;
            sleep $o{freeze}[1];
            kill 'CONT', $ppid;
        }
        waitpid $ppid, 0;
    }
    waitpid $spid, 0;
    $sub_rc = $? >> 8;
    my @lines = map { json_dec($_) } grep { /^\{/ }
                do { open my $f, '<', $out or die; <$f> };
    my ($st) = grep { $_->{event} eq 'stats' } @lines;
    my @ev = grep { $_->{event} ne 'stats' } @lines;
    return (\@ev, $st // {}, "$out.err");
}

sub summary {
    my ($ev) = @_;
    return join ' ', map {
        $_->{event} eq 'stored' ? "s$_->{seq}:$_->{hashes}[0]"
                                : "c$_->{seq}:$_->{why}"
    } @$ev;
}

{
    my ($ev, $st) = scenario(script => [map { ["send", $_] } 0 .. 4],
                             count => 5);
    is(summary($ev), "s0:1000 s1:1001 s2:1002 s3:1003 s4:1004",
       "in order: every batch delivered once");
    is($st->{gaps}, 0, "no gap");
}

for my $rt (0, 1) {
    my ($ev, $st) = scenario(replay => 1, replay_topic => $rt, count => 5,
        script => [["send", 0], ["send", 1], ["send", 2, 0],
                   ["send", 3, 0], ["send", 4], ["sleep", 500]]);
    is(summary($ev), "s0:1000 s1:1001 s2:1002 s3:1003 s4:1004",
       "a gap replayed (replies " . ($rt ? "with" : "without")
       . " the topic frame): nothing lost, nothing twice");
    is_deeply([@$st{qw(gaps replays replays_ok clears)}], [1, 1, 1, 0],
              "one gap, one replay, no clear");
}

{
    my ($ev, $st) = scenario(count => 3,
        script => [["send", 0], ["send", 1], ["send", 2, 0], ["send", 3]]);
    is(summary($ev), "s0:1000 s1:1001 c3:gap s3:1003",
       "a gap without replay: the node cleared, the stream taken up");
}

{
    my ($ev, $st) = scenario(replay => 1, timeout => 300, count => 4,
        script => [["send", 0], ["mute"], ["send", 1, 0], ["send", 2],
                   ["sleep", 600], ["send", 3]]);
    is(summary($ev), "s0:1000 c2:gap s2:1002 s3:1003",
       "a replay that never answers: abandoned, cleared, taken up live");
    is($st->{replays_failed}, 1, "counted as abandoned");
}

{
    my ($ev, $st) = scenario(replay => 1, count => 5,
        script => [["send", 0], ["send", 1, 0], ["send", 2, 0],
                   ["send", 3, 0], ["forget", 3], ["send", 4],
                   ["sleep", 300]]);
    is(summary($ev), "s0:1000 c3:gap s3:1003 s4:1004",
       "the replay buffer rolled over: cleared at its first seq");
}

{
    my ($ev, $st) = scenario(replay => 1, count => 4,
        script => [["send", 0, 0], ["send", 1, 0], ["send", 2, 0],
                   ["send", 3], ["sleep", 300]]);
    is(summary($ev), "s0:1000 s1:1001 s2:1002 s3:1003",
       "a late subscriber: the publisher's buffer replayed from 0");
}

{
    my ($ev, $st) = scenario(replay => 1, count => 5,
        script => [["send", 0], ["send", 1], ["send", 2], ["restart"],
                   ["send", 0], ["send", 1]]);
    is(summary($ev), "s0:1000 s1:1001 s2:1002 c0:restart s0:1000 s1:1001",
       "a restart (seq back to 0): cleared, rebuilt");
    is($st->{restarts}, 1, "counted");
}

{
    # a publisher that restarts in a loop: 300 clears, the log gets one
    # "publisher restarted" line a second, the next one counting those
    # left out (one line a clear before)
    my ($ev, $st, $err) = scenario(seconds => 4,
        script => [(map { (["send", 0], ["send", 1], ["restart"]) }
                    1 .. 300), ["sleep", 300]]);
    is($st->{restarts}, 299, "a flapping publisher: every restart counted")
        or diag explain $st;
    my @l = grep { /publisher restarted/ }
            do { open my $f, '<', $err or die; <$f> };
    ok(@l >= 1 && @l <= 6, scalar(@l) . " 'publisher restarted' lines for "
       . "299 clears (one a second)");
    like(join('', @l), qr/\((?:[1-9]\d*) clears not logged in the last second/,
         "... a later line counts the clears left out") if @l > 1;
}

{
    # a new publisher process that published past our last seq before we
    # reconnected: seen through the dropped connection, rebuilt from 0
    my ($ev, $st) = scenario(replay => 1, count => 10, seconds => 10,
        scripts => [[["send", 0], ["send", 1], ["send", 2], ["sleep", 300]],
                    [(map { ["send", $_, 0] } 0 .. 5), ["send", 6],
                     ["sleep", 500]]]);
    is(summary($ev), "s0:1000 s1:1001 s2:1002 c6:reconnect s0:1000 "
       . "s1:1001 s2:1002 s3:1003 s4:1004 s5:1005 s6:1006",
       "a restart that overtook our seq: cleared on reconnect, replayed "
       . "from 0");
    is($st->{reconnects}, 1, "counted");
    # and without replay: cleared, taken up where it is
    ($ev, $st) = scenario(count => 4, seconds => 10,
        scripts => [[["send", 0], ["send", 1], ["send", 2], ["sleep", 300]],
                    [(map { ["send", $_, 0] } 0 .. 5), ["send", 6],
                     ["sleep", 300]]]);
    is(summary($ev), "s0:1000 s1:1001 s2:1002 c6:reconnect s6:1006",
       "... without replay: cleared, taken up at its seq");
}

{
    # a 17 MiB message: the connection is dropped (ZMQ_MAXMSGSIZE), the
    # reconnect seen, the stream taken up; nothing stalls
    my ($ev, $st) = scenario(count => 2, seconds => 10,
        script => [["send", 0], ["big", 1, 17 << 20], ["sleep", 1500],
                   ["send", 2], ["sleep", 300]]);
    is(summary($ev), "s0:1000 c2:reconnect s2:1002",
       "a message over the bound: its connection dropped, the stream "
       . "taken up after a clear");
}

{
    # a frozen publisher (SIGSTOP: TCP still up, nothing answers): the
    # heartbeats drop the connection, the stream resumes where it was
    my ($ev, $st, $errf) = scenario(count => 3, seconds => 25,
        freeze => [1.5, 11],
        script => [["send", 0], ["send", 1], ["sleep", 14500],
                   ["send", 2], ["sleep", 300]]);
    is(summary($ev), "s0:1000 s1:1001 s2:1002",
       "a publisher frozen for 11 s: nothing lost, nothing cleared");
    my $err = do { local $/; open my $f, '<', $errf or die; <$f> };
    like($err, qr/connection to \S+ lost/,
         "... its silence seen as a dropped connection (heartbeats)");
}

{
    my $t = "kv\@pod1\@m";
    my $seq = sub { unpack("H*", pack("Q>", $_[0])) };
    my ($ev, $st) = scenario(topic => $t, count => 3, script => [
        ["send", 0],
        ["raw", [unpack("H*", $t), $seq->(1)]],                # 2 frames
        ["raw", [unpack("H*", $t), "00000001", "c0"]],          # short seq
        ["raw", [unpack("H*", "${t}x"), $seq->(1), "c0"]],      # neighbour
        ["raw", [unpack("H*", $t), $seq->(1), "c1c1c1"]],       # garbage
        ["send", 2]]);
    is(summary($ev), "s0:1000 s2:1002",
       "garbage frames, a neighbour's topic, a garbage payload: dropped");
    is_deeply([@$st{qw(bad_frames other_topic refused_msgs gaps)}],
              [2, 1, 1, 0], "each counted; the garbage payload still "
              . "counts in the sequence");
}

# ---- configuration --------------------------------------------------------

sub check_cfg {
    my ($kv, %o) = @_;
    my $c = agent_config(id => "router-0", role => $o{role} // "router",
                         port => kv_port(890));
    $c->{kv_events} = $kv;
    my $f = "$dir/cfg-" . int(rand(1e9)) . ".json";
    open my $fh, '>', $f or die;
    print $fh json_enc($c);
    close $fh;
    my $out = `$bin check --config $f 2>&1`;
    return ($? >> 8, $out, $f);
}

{
    my $src = { node => "decode-0", http => "127.0.0.1:8100",
                endpoint => "tcp://127.0.0.1:5557",
                replay => "tcp://127.0.0.1:5558", topic => "kv\@d0\@m",
                model => "llama" };
    my ($rc, $out) = check_cfg([$src]);
    is($rc, 0, "a kv_events source is accepted") or diag $out;
    my $line = 'kv_events: decode-0 (127.0.0.1:8100) from '
               . 'tcp://127.0.0.1:5557 topic "kv@d0@m", replay '
               . 'tcp://127.0.0.1:5558';
    ok(index($out, $line) >= 0, "... and shown by check") or diag $out;
    for my $bad (
        [{ %$src, endpoint => "tcp://*:5557" }, qr/connects/],
        [{ %$src, endpoint => "127.0.0.1:5557" }, qr/tcp:\/\/host:port/],
        [{ %$src, replay => "tcp://h:99999" }, qr/"replay"/],
        [{ %$src, http => "http://x:1" }, qr/"http"/],
        [{ %$src, node => "" }, qr/"node" must not be empty/],
        [{ %$src, colour => 1 }, qr/unknown key "colour"/],
        [{ %$src, replay_timeout_ms => 1 }, qr/replay_timeout_ms/])
    {
        my ($rc2, $o2) = check_cfg([$bad->[0]]);
        ok($rc2 != 0 && $o2 =~ $bad->[1], "refused: $o2" =~ s/\n//r);
    }
    my ($rc3, $o3) = check_cfg([$src, { %$src, endpoint => "tcp://h:1",
                                        http => "h:2" }]);
    like($o3, qr/node "decode-0" given twice with different "http" or/,
         "a node twice with two addresses: refused");
    ($rc3, $o3) = check_cfg([$src, { %$src, endpoint =>
                                     "tcp://127.0.0.1:5558" }]);
    is($rc3, 0, "a node twice with one address (data-parallel ranks): "
       . "accepted") or diag $o3;
    ($rc3, $o3) = check_cfg([$src, { %$src }]);
    like($o3, qr/endpoint tcp:\/\/127.0.0.1:5557 given twice/,
         "an endpoint twice: refused");
    ($rc3, $o3) = check_cfg([$src], role => "decode");
    like($o3, qr/for the router's agent/, "kv_events on a decode node: "
         . "refused");
    ($rc3, $o3) = check_cfg({});
    like($o3, qr/must be a list/, "kv_events not a list: refused");
}

{
    # a router agent subscribed to a live publisher: in its log, and never
    # blocked by it (its API answers while the publisher is gone)
    my $pubp = $port++;
    my $c = agent_config(id => "router-0", role => "router",
                         port => kv_port(891));
    $c->{kv_events} = [{ node => "decode-0", http => "127.0.0.1:8100",
                         endpoint => "tcp://127.0.0.1:$pubp",
                         replay => "tcp://127.0.0.1:" . ($pubp + 1) }];
    $c->{log_level} = "debug";
    my $a = start_agent($c);
    ok(log_wait($a, qr/kv_events: decode-0 .*subscribed to tcp/, 5),
       "the router agent subscribes");
    my $script = "$dir/agent-script.json";
    open my $fh, '>', $script or die;
    print $fh json_enc([["sleep", 100], ["send", 0], ["send", 1, 0],
                        ["send", 2], ["sleep", 500]]);
    close $fh;
    system($py, $helper, "pub", "--pub", "tcp://127.0.0.1:$pubp",
           "--replay", "tcp://127.0.0.1:" . ($pubp + 1), "--script",
           $script);
    ok(log_wait($a, qr/decode-0 seq 2: 1 block\(s\) stored/, 5),
       "events reach the agent's sink, the gap replayed");
    like(log_text($a), qr/decode-0 seq 1: 1 block/, "seq 1 from the replay");
    my $r = api($a, { verb => "info" });
    ok($r, "the agent answers with its publisher gone");
    stop_agent($a);
    like(log_text($a), qr/kv_events: decode-0: 3 messages .*1 gaps/,
         "its counters at exit");
}

# ---- once more under valgrind: no invalid access, no definite leak ----------

SKIP: {
    skip "no valgrind", 6 if system("valgrind --version >/dev/null 2>&1");
    skip "$bin is built with a sanitizer", 6
        if system("nm $bin 2>/dev/null | grep -q __asan_init") == 0;
    @WRAP = qw(valgrind -q --error-exitcode=99 --leak-check=full
               --errors-for-leak-kinds=definite);
    my @all = map { "$dir/$_.mp" } (map { $_->{name} } @{ $exp->{cases} }),
              @{ $exp->{refused} }, @{ $exp->{huge} };
    my @got = decode(@all);
    is($sub_rc, 0, "valgrind: the decoder over every case is clean");
    my ($ev) = scenario(replay => 1, count => 4, seconds => 20,
        script => [["send", 0], ["send", 1, 0], ["send", 2], ["sleep", 1500],
                   ["restart"], ["send", 0], ["sleep", 300]]);
    is($sub_rc, 0, "valgrind: the subscriber through a replay and a "
       . "restart is clean");
    is(summary($ev), "s0:1000 s1:1001 s2:1002 c0:restart s0:1000",
       "... and decodes the same");
    ($ev) = scenario(replay => 1, timeout => 300, count => 3, seconds => 20,
        script => [["send", 0], ["mute"], ["send", 1, 0], ["send", 2],
                   ["sleep", 800], ["send", 3]]);
    is($sub_rc, 0, "valgrind: an abandoned replay is clean");

    # the router agent itself: subscribed, a replay, a message over the
    # bound, SIGTERM
    my $vlog = "$dir/valgrind-router.log";
    my $pubp = $port++;
    my $c = agent_config(id => "router-1", role => "router",
                         port => kv_port(892));
    $c->{kv_events} = [{ node => "decode-0", http => "127.0.0.1:8100",
                         endpoint => "tcp://127.0.0.1:$pubp",
                         replay => "tcp://127.0.0.1:" . ($pubp + 1) }];
    $c->{log_level} = "debug";
    my $a = start_agent($c, timeout => 60, wrap => [@WRAP[0 .. 4],
                                                    "--log-file=$vlog"]);
    my $script = "$dir/agent-vg-script.json";
    open my $fh, '>', $script or die;
    print $fh json_enc([["send", 0], ["send", 1, 0], ["send", 2],
                        ["sleep", 1500], ["big", 3, 17 << 20],
                        ["sleep", 2000], ["send", 4], ["sleep", 1500]]);
    close $fh;
    system($py, $helper, "pub", "--pub", "tcp://127.0.0.1:$pubp",
           "--replay", "tcp://127.0.0.1:" . ($pubp + 1), "--script",
           $script);
    ok(log_wait($a, qr/decode-0 seq 4: 1 block\(s\) stored/, 20),
       "valgrind: the router agent took up the stream after it all");
    is(stop_agent($a, 'TERM', 60), 0, "valgrind: the router agent exits "
       . "clean (no errors, no definite leaks)")
        or diag(do { local $/; open my $v, '<', $vlog; <$v> });
}

done_testing();
