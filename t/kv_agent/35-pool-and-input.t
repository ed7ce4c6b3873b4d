#!/usr/bin/perl
# Pool registration and hostile input (issue 9, items 3, 4, 8, 9):
#  * a refused register_pool changes nothing: pushes still land;
#  * unsealed memfds are refused; a sealed one cannot be shrunk by the
#    engine, and the agent survives the attempt (no SIGBUS);
#  * a CQ error entry that cannot be read does not wedge the loop, and the
#    failure is logged at warn;
#  * duplicate destination blocks are refused; a peer's fabric address of
#    the wrong length is refused; a client that does not read its replies
#    is cut off at the output limit; the state table's temp file cannot be
#    redirected by a planted symlink, is mode 0644, and a directory others
#    can write is refused.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use IO::Socket::UNIX;
use Time::HiRes qw(time sleep);
use KvAgentTest;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();
plan skip_all => "libfabric tcp;ofi_rxm provider not available here"
    unless provider_ok('tcp;ofi_rxm');

my $po = 170;
my $pool = small_pool(blocks => 64);
my $P = { id => "prefill-0", ctrl => "127.0.0.1:" . kv_port($po),
          role => "prefill" };
my $D = { id => "decode-0", ctrl => "127.0.0.1:" . kv_port($po + 1),
          role => "decode" };
my $X = { id => "prefill-x", ctrl => "127.0.0.1:" . kv_port($po + 2),
          role => "prefill" };
my $py = kv_root() . "/t/kv_agent/kvseal.py";

sub seal_tool {
    my ($a, @args) = @_;
    my $out = `timeout 60 python3 '$py' '$a->{sock}' @args 2>&1`;
    return eval { json_dec((split /\n/, $out)[-1] // "") }
        // { error => $out };
}

# the log file is appended to: wait for this run's socket, not "ready"
sub wait_for_sock {
    my ($a) = @_;
    my $deadline = time + 20;
    sleep 0.05 until -S $a->{sock} || time > $deadline;
}

sub push_ok {
    my ($p, $d, $req, $name) = @_;
    api($p, { verb => "fill", blocks_runs => [[0, 16]], seed => 11 });
    api($p, { verb => "push", req_id => $req, peer => "decode-0",
              src_runs => [[0, 16]] });
    my $r = api($d, { verb => "wait", req_id => $req, timeout_ms => 10000 });
    is($r->{state}, "ready", "$name: push lands") or diag($r->{error});
    is(api($d, { verb => "checksum", blocks_runs => $r->{blocks_runs} // [] })
       ->{checksum}, api($p, { verb => "checksum",
                               blocks_runs => [[0, 16]] })->{checksum},
       "$name: ... bit-exact");
    api($_, { verb => "release", req_id => $req }) for $p, $d;
}

my $d = start_agent(agent_config(id => "decode-0", role => "decode",
    port => kv_port($po + 1), pool => $pool, peers => [$P, $X],
    api => { max_message => 4096 }));
my $p = start_agent(agent_config(id => "prefill-0", role => "prefill",
    port => kv_port($po), pool => $pool, peers => [$D]));
ok(wait_connected($p, ["decode-0"]), "prefill connected")
    or diag(log_text($p), log_text($d));
push_ok($p, $d, "first", "before any registration");

# --- item 3: a refused registration changes nothing ----------------------
my $r = seal_tool($d, "small");
ok(!$r->{reply}{ok}, "register_pool with too small a memfd is refused");
like($r->{reply}{error} // "", qr/the layout needs/, "... saying why");
sleep 0.5;
ok(!log_wait($d, qr/pool re-registered/, 0.1), "peers are not told about a "
   . "registration that did not take effect");
push_ok($p, $d, "after-bad", "after a refused registration");
$r = seal_tool($d, "good", 5);
ok($r->{reply}{ok}, "a good registration is accepted") or diag(json_enc($r));
ok(wait_connected($p, ["decode-0"]), "prefill reconnects for the new keys");
push_ok($p, $d, "after-good", "into the engine's pool");

# --- item 8: sealed memfds only -------------------------------------------
$r = seal_tool($d, "unsealed");
ok(!$r->{reply}{ok}, "an unsealed memfd is refused");
like($r->{reply}{error} // "", qr/not sealed against resizing.*F_SEAL_SHRINK/,
     "... with a clear error: " . ($r->{reply}{error} // ""));
ok(api($d, { verb => "checksum", blocks_runs => [[0, 64]] })->{ok},
   "the agent survives the engine shrinking the memfd it offered");
$r = seal_tool($d, "sealed");
ok($r->{reply}{ok}, "a sealed memfd is accepted") or diag(json_enc($r));
like($r->{truncate}, qr/Operation not permitted/,
     "the engine's ftruncate of the sealed pool fails: $r->{truncate}");
ok(api($d, { verb => "checksum", blocks_runs => [[0, 64]] })->{ok},
   "the agent reads its whole pool afterwards");
ok(agent_alive($d), "decode agent alive (no SIGBUS)");
ok(wait_connected($p, ["decode-0"]), "prefill reconnected");
push_ok($p, $d, "sealed", "into the sealed pool");

# --- item 9: duplicate destination blocks --------------------------------
$r = api($d, { verb => "reserve", req_id => "dup", blocks => [7, 8, 7] });
ok(!$r->{ok} && ($r->{error} // "") =~ /block 7 is listed twice/,
   "reserve with a block listed twice is refused: " . ($r->{error} // ""));
is(api($d, { verb => "info" })->{pool}{free}, 64, "... and claims nothing");
ok(api($d, { verb => "reserve", req_id => "dr", blocks => [5, 6] })->{ok},
   "reserve blocks 5 and 6");
api($p, { verb => "push", req_id => "dr", peer => "decode-0", src => [0, 1],
          dst => [5, 5] });
$r = api($p, { verb => "wait", req_id => "dr", timeout_ms => 5000 });
is($r->{state}, "failed", "a push writing block 5 twice fails");
like($r->{error} // "", qr/dst block 5 is listed twice/,
     "... refused by the receiver: " . ($r->{error} // ""));
api($_, { verb => "release", req_id => "dr" }) for $p, $d;

# --- item 9: a peer's address of the wrong length -------------------------
my $x = start_agent(agent_config(id => "prefill-x", role => "prefill",
    port => kv_port($po + 2), pool => $pool, peers => [$D]),
    env => { KV_TEST_FAULT => "short_addr" });
ok(log_wait($d, qr/prefill-x(?#
                   )(?:: | failed: )fabric address of rail 0 is 15 bytes, provider (?#
                   )tcp;ofi_rxm uses 16/, 10),
   "a fabric address one byte short is refused");
stop_agent($x);

# --- item 9: a client that does not read its replies ----------------------
{
    my $s = IO::Socket::UNIX->new(Type => SOCK_STREAM, Peer => $d->{sock});
    my $req = json_enc({ verb => "info" });
    my $frame = pack("N", length $req) . $req;
    for (1 .. 4000) {
        last unless print $s $frame;
    }
    ok(log_wait($d, qr/api: \s the \s other \s side \s does \s not \s read
                       \s \(more \s than \s 1048576 \s bytes/x, 10),
       "output to a client that does not read is capped (1 MiB)");
    my ($buf, $n, $total) = ("", 0, 0);
    my $deadline = time + 10;
    while (time < $deadline) {
        my $rin = "";
        vec($rin, fileno($s), 1) = 1;
        next unless select($rin, undef, undef, 0.5);
        $n = sysread($s, $buf, 1 << 16);
        last unless $n;
        $total += $n;
    }
    ok(defined $n && $n == 0, "... and its connection closed ($total bytes "
       . "were sent)");
    ok(api($d, { verb => "info" })->{ok}, "the agent keeps serving");
}

# --- item 4: an unreadable CQ error entry ---------------------------------
stop_agent($p);
$p = start_agent(agent_config(id => "prefill-0", role => "prefill",
    port => kv_port($po), pool => $pool, peers => [$D]),
    env => { KV_TEST_FAULT => "cq_readerr:150" }, wait => 0);
wait_for_sock($p);
my $t0 = time;
$r = api($p, { verb => "info" }, 5);
ok($r && $r->{ok}, sprintf("the agent answers while its CQ reports an error "
   . "it cannot read (%.2fs)", time - $t0)) or diag(json_enc($r // {}));
ok(log_wait($p, qr/warn: \s fabric: \s rail \s 0: \s a \s completion \s error
                   \s could \s not \s be \s read: \s Resource/x, 5),
   "... logged at warn");
ok(wait_connected($p, ["decode-0"], 20), "prefill connected");
push_ok($p, $d, "cq", "after the CQ fault");
is(stop_agent($p), 0, "prefill exits cleanly");
is(stop_agent($d), 0, "decode exits cleanly");

# --- item 9: the state table's file ---------------------------------------
my $dir = kv_tmpdir();
{
    my $sd = "$dir/statedir";
    mkdir $sd;
    my $victim = "$dir/victim";
    open my $fh, '>', $victim or die;
    print $fh "precious";
    close $fh;
    my $state = "$sd/plant.state";
    my $a = start_agent(agent_config(id => "plant", role => "decode",
        port => kv_port($po + 3), pool => $pool, state_path => $state),
        pre_exec => sub {
            # the pid-named temp file an older agent would have opened
            symlink $victim, "$state.tmp.$$";
            umask 077;
        });
    ok(log_text($a) =~ /info: ready$/m, "agent with a planted symlink "
       . "starts") or diag(log_text($a));
    open $fh, '<', $victim or die;
    my $v = do { local $/; <$fh> };
    close $fh;
    is($v, "precious", "the planted symlink's target is untouched");
    ok(-f $state && !-l $state, "the table is a regular file, not a link");
    is(sprintf("%04o", (stat $state)[2] & 07777), "0644",
       "the table is mode 0644 even under umask 077");
    stop_agent($a);

    my $ww = "$dir/open";
    mkdir $ww;
    chmod 0777, $ww;
    $a = start_agent(agent_config(id => "ww", role => "decode",
        port => kv_port($po + 4), pool => $pool,
        state_path => "$ww/ww.state"));
    ok(log_wait($a, qr/directory \s \Q$ww\E \s is \s writable \s by
                       \s everyone \s and \s not \s sticky/x, 10),
       "a world-writable directory without the sticky bit is refused");
    sleep 0.3;
    ok(!agent_alive($a), "... the agent does not start");
}
done_testing();
