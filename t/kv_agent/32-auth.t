#!/usr/bin/perl
# Control channel authentication (issue 9 item 5) and least privilege on
# the pool (item 6), with real agents on loopback and a fake peer
# (fakepeer.py) that lies in the ways an attacker would:
#  * a wrong key is refused in both directions;
#  * a fake listener that answers hello_ok without the key (a random proof,
#    or the connector's own proof echoed back) is refused by the agent;
#  * a recorded hello replayed on a new connection is refused;
#  * the agent's own hello reflected back at it is refused;
#  * a node id claimed with another node's key is refused, and so are
#    roles the two configurations disagree on;
#  * a key roll with two keys per link keeps the link up at every step;
#  * a router gets no memory key nor fabric address, a decode peer of a
#    prefill node none either; only a prefill peer of a decode node gets
#    the decode pool's key; the MR access flags are logged.
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

my $po = 110;
my $dir = kv_tmpdir();
my $fake = "$FindBin::Bin/fakepeer.py";
my ($pport, $dport, $d1port, $rport, $fport) =
    map { kv_port($po + $_) } 0 .. 4;
my $P = { id => "prefill-0", ctrl => "127.0.0.1:$pport", role => "prefill" };
my $D = { id => "decode-0", ctrl => "127.0.0.1:$dport", role => "decode" };
my $P1 = { id => "prefill-1", ctrl => "127.0.0.1:$d1port",
           role => "prefill" };
my $R = { id => "router-0", ctrl => "127.0.0.1:$rport", role => "router" };
my $pool = small_pool(blocks => 64);

sub fakepeer {
    my (@args) = @_;
    my $cmd = join ' ', 'timeout', '30', 'python3', $fake,
        map { "'$_'" } @args;
    my $out = `$cmd 2>&1`;
    my $j = eval { json_dec((split /\n/, $out)[-1] // "") };
    return $j // { error => "fakepeer: $out" };
}

sub info { api($_[0], { verb => "info" }, 5) // {} }

sub peer_info {
    my ($a, $id) = @_;
    my ($p) = grep { $_->{id} eq $id } @{ info($a)->{peers} // [] };
    return $p // {};
}

sub decode_cfg {
    my (%o) = @_;
    return agent_config(id => "decode-0", role => "decode", port => $dport,
                        pool => $pool, peers => [$P], %o);
}

sub prefill_cfg {
    my (%o) = @_;
    return agent_config(id => "prefill-0", role => "prefill", port => $pport,
                        pool => $pool, peers => [$D], %o);
}

# --- the real pair works and logs what it registered ----------------------
{
    my $d = start_agent(decode_cfg());
    my $p = start_agent(prefill_cfg());
    ok(wait_connected($p, ["decode-0"]) && wait_connected($d, ["prefill-0"]),
       "prefill and decode authenticate each other both ways");
    like(log_text($d), qr/info: pool: registered \d+ bytes on 1 rail\(s\), (?#
         )access FI_REMOTE_WRITE \(remote write only\); its key goes to (?#
         )authenticated prefill peers only/,
         "decode pool: remote write only, logged at info");
    like(log_text($p), qr/info: pool: registered \d+ bytes on 1 rail\(s\), (?#
         )access FI_WRITE \(local source only, no remote access\)/,
         "prefill pool: local source only, logged at info");
    like(log_text($p), qr/connected to decode-0 \(decode, 1 rail\(s\), pool, (?#
         )key [0-9a-f]{16}, handshake [0-9.]+ ms\)/,
         "prefill learnt the decode pool (key id and handshake time logged)");
    like(log_text($d), qr/connected to prefill-0 \(prefill, 1 rail\(s\), (?#
         )key/, "decode learnt no prefill pool key");
    ok(!peer_info($d, "prefill-0")->{remote_pool},
       "... the decode node cannot write into the prefill pool");
    ok(peer_info($p, "decode-0")->{remote_pool},
       "... the prefill node can write into the decode pool");
    api($p, { verb => "fill", blocks_runs => [[0, 8]], seed => 5 });
    my $r = api($p, { verb => "push", req_id => "a1", peer => "decode-0",
                      src_runs => [[0, 8]] });
    $r = api($d, { verb => "wait", req_id => "a1", timeout_ms => 10000 }, 20);
    is($r->{state}, "ready", "a push over the authenticated link lands");
    unlike(log_text($p) . log_text($d), qr/"token"|token/,
           "no token anywhere");
    stop_agent($p);
    stop_agent($d);
}

# --- wrong key, both directions -------------------------------------------
{
    my $d = start_agent(decode_cfg(
        keys => { "prefill-0" => link_key("prefill-0", "decode-0", "d") }));
    my $p = start_agent(prefill_cfg(
        keys => { "decode-0" => link_key("prefill-0", "decode-0", "p") }));
    ok(log_wait($d, qr/rejected a peer: node prefill-0 uses key \w+, which (?#
                )is not one of its keys here/, 10),
       "decode refuses prefill's key");
    ok(log_wait($p, qr/rejected a peer: node decode-0 uses key \w+, which (?#
                )is not one of its keys here/, 10),
       "prefill refuses decode's key");
    ok(log_wait($p, qr/rejected by decode-0: authentication failed: key/, 10)
       && log_wait($d, qr/rejected by prefill-0: authentication failed/, 10),
       "each side is told");
    ok(!peer_info($p, "decode-0")->{connected}
       && !peer_info($d, "prefill-0")->{connected}
       && !peer_info($d, "prefill-0")->{inbound},
       "no link in either direction");
    my $r = api($p, { verb => "push", req_id => "w1", peer => "decode-0",
                      src => [0] });
    ok(!$r->{ok} && $r->{error} =~ /not connected/, "push refused");
    stop_agent($p);
    stop_agent($d);
}

# --- roles are bound too: configurations that disagree on a role ----------
{
    my $d = start_agent(agent_config(id => "decode-0", role => "decode",
        port => $dport, pool => $pool,
        peers => [{ %$P, role => "decode" }]));
    my $p = start_agent(prefill_cfg());
    ok(log_wait($d, qr/rejected a peer: node prefill-0 did not prove key (?#
                )\w+ \(another key, a replayed or reflected hello, or roles (?#
                )that differ/, 10),
       "a node that is a prefill to itself but a decode to its peer: refused");
    ok(!peer_info($p, "decode-0")->{connected}, "no link");
    stop_agent($p);
    stop_agent($d);
}

# --- a fake listener without the key --------------------------------------
# prefill-0's peer decode-0 is the fake: it answers hello_ok with a random
# proof, then with the prefill's own proof echoed back.
for my $mode (qw(nokey echo)) {
    my $p = start_agent(agent_config(id => "prefill-0", role => "prefill",
        port => $pport, pool => $pool,
        peers => [{ %$D, ctrl => "127.0.0.1:$fport" }]));
    my $f = fakepeer("server", "--listen", $fport, "--node", "decode-0",
                     "--mode", $mode, "--hold", 1.5);
    is($f->{hello}{node}, "prefill-0", "$mode: the agent sent its hello")
        or diag(explain($f));
    ok(!grep({ /^(token|key|keys|base|rails)$/ } keys %{ $f->{hello} }),
       "$mode: the hello carries no secret") or diag(explain($f->{hello}));
    ok($f->{closed} && !$f->{used},
       "$mode: the agent dropped the link without using it")
        or diag(explain($f));
    ok(log_wait($p, qr/handshake with decode-0 failed: the listener at (?#
                )127\.0\.0\.1:\d+ did not prove key \w+ \(wrong key, or not (?#
                )decode-0\)/, 5), "$mode: logged");
    ok(!peer_info($p, "decode-0")->{connected} && !peer_info($p, "decode-0")->{alive},
       "$mode: decode-0 is neither connected nor alive");
    stop_agent($p);
}

# --- a legitimate fake listener works (the fake is honest when it can) ----
{
    my $p = start_agent(agent_config(id => "prefill-0", role => "prefill",
        port => $pport, pool => $pool,
        peers => [{ %$D, ctrl => "127.0.0.1:$fport" }]));
    my $f = fakepeer("server", "--listen", $fport, "--node", "decode-0",
                     "--mode", "valid", "--hold", 1.5,
                     "--key", link_key("prefill-0", "decode-0"));
    ok($f->{used} && !$f->{closed},
       "with the key, the same fake is accepted (and heartbeats follow)")
        or diag(explain($f), log_text($p));
    stop_agent($p);
}

# --- replay: a hello recorded from the real prefill agent -----------------
{
    my $rec = "$dir/hello.json";
    my $p = start_agent(agent_config(id => "prefill-0", role => "prefill",
        port => $pport, pool => $pool,
        peers => [{ %$D, ctrl => "127.0.0.1:$fport" }]));
    fakepeer("server", "--listen", $fport, "--node", "decode-0", "--record",
             $rec, "--hold", 0.2);
    stop_agent($p);
    ok(-s $rec, "recorded the prefill agent's hello");
    my $d = start_agent(decode_cfg());
    my $r = fakepeer("replay", "--connect", $dport, "--hello", $rec);
    is($r->{reply}{type}, "error", "the replayed hello is refused")
        or diag(explain($r));
    ok(log_wait($d, qr/rejected a peer: node prefill-0 did not prove key/, 5),
       "... logged as a failed proof");
    ok(!peer_info($d, "prefill-0")->{inbound}, "no inbound link for it");
    stop_agent($d);
}

# --- reflection: the decode agent's own hello sent back to it ------------
{
    my $d = start_agent(agent_config(id => "decode-0", role => "decode",
        port => $dport, pool => $pool,
        peers => [{ %$P, ctrl => "127.0.0.1:$fport" }]));
    for my $rw (0, 1) {
        my $r = fakepeer("reflect", "--listen", $fport, "--connect", $dport,
                         "--node", "prefill-0", $rw ? ("--rewrite") : ());
        is($r->{hello}{node}, "decode-0", "reflect $rw: got the agent's hello")
            or diag(explain($r));
        is($r->{reply}{type}, "error",
           "reflect $rw: its own hello is refused"
           . ($rw ? " (relabelled as prefill-0)" : ""))
            or diag(explain($r));
    }
    like(log_text($d), qr/rejected a peer: node decode-0 is not an allowed/,
         "the verbatim reflection names itself");
    like(log_text($d), qr/rejected a peer: node prefill-0 did not prove key/,
         "the relabelled one fails its proof");
    ok(!peer_info($d, "prefill-0")->{inbound}, "no inbound link");
    stop_agent($d);
}

# --- a node id claimed with another node's key ----------------------------
{
    my $d = start_agent(agent_config(id => "decode-0", role => "decode",
        port => $dport, pool => $pool, peers => [$P, $P1]));
    my $k1 = link_key("prefill-1", "decode-0");
    # prefill-1's key, honestly labelled, under prefill-0's id
    my $r = fakepeer("client", "--connect", $dport, "--node", "prefill-0",
        "--role", "prefill", "--peer", "decode-0", "--peer-role", "decode",
        "--key", $k1);
    is($r->{results}[0]{reply}{type}, "error",
       "prefill-0 with prefill-1's key: refused") or diag(explain($r));
    ok(log_wait($d, qr/node prefill-0 uses key \w+, which is not one of its/,
                5), "... as a key that is not prefill-0's");
    # ... and with prefill-0's key id (a lie)
    my $kid0 = peer_info($d, "prefill-0")->{key_id};
    $r = fakepeer("client", "--connect", $dport, "--node", "prefill-0",
        "--role", "prefill", "--peer", "decode-0", "--peer-role", "decode",
        "--key", $k1, "--kid", $kid0);
    is($r->{results}[0]{reply}{type}, "error",
       "... also when it claims prefill-0's key id");
    # a real agent doing the same
    my $x = start_agent(agent_config(id => "prefill-0", role => "prefill",
        port => $pport, pool => $pool, peers => [$D],
        keys => { "decode-0" => $k1 }));
    ok(log_wait($d, qr/rejected a peer: node prefill-0 uses key/, 10),
       "an agent configured that way: refused");
    ok(!peer_info($d, "prefill-0")->{inbound}, "no link");
    stop_agent($x);
    # while the right key works for each
    $r = fakepeer("client", "--connect", $dport, "--node", "prefill-1",
        "--role", "prefill", "--peer", "decode-0", "--peer-role", "decode",
        "--key", $k1);
    is($r->{results}[0]{reply}{type}, "hello_ok", "prefill-1 with its key")
        or diag(explain($r));
    ok($r->{results}[0]{server_proof_ok}, "... and decode-0 proved it back");
    stop_agent($d);
}

# --- what each role is told (least privilege) -----------------------------
{
    my $d = start_agent(agent_config(id => "decode-0", role => "decode",
        port => $dport, pool => $pool, peers => [$P, $R]));
    my $p = start_agent(agent_config(id => "prefill-0", role => "prefill",
        port => $pport, pool => $pool, peers => [$D, $R]));
    my %told;
    for my $c (["router-0", "router", $dport, "decode-0", "decode"],
               ["prefill-0", "prefill", $dport, "decode-0", "decode"],
               ["router-0", "router", $pport, "prefill-0", "prefill"],
               ["decode-0", "decode", $pport, "prefill-0", "prefill"]) {
        my ($me, $role, $port, $them, $their_role) = @$c;
        my $r = fakepeer("client", "--connect", $port, "--node", $me,
            "--role", $role, "--peer", $them, "--peer-role", $their_role,
            "--key", link_key($me, $them));
        $told{"$them>$me"} = $r->{results}[0];
    }
    my $rails = sub { $_[0]{reply}{rails} // [] };
    my $keys = sub { scalar grep { exists $_->{key} || exists $_->{base} }
                     @{ $rails->($_[0]) } };
    my $t = $told{"decode-0>prefill-0"};
    ok($t->{server_proof_ok} && @{ $rails->($t) } == 1 && $keys->($t) == 1,
       "decode tells a prefill peer its fabric address and pool key")
        or diag(explain($t));
    $t = $told{"decode-0>router-0"};
    ok($t->{server_proof_ok} && !@{ $rails->($t) } && $t->{reply}{pool},
       "decode tells a router no key and no fabric address (geometry only)")
        or diag(explain($t));
    $t = $told{"prefill-0>router-0"};
    ok($t->{server_proof_ok} && !@{ $rails->($t) },
       "prefill tells a router nothing of its fabric") or diag(explain($t));
    $t = $told{"prefill-0>decode-0"};
    ok($t->{server_proof_ok} && @{ $rails->($t) } == 1 && !$keys->($t),
       "prefill tells a decode peer its address but no pool key")
        or diag(explain($t));
    is(info($d)->{pool}{access}, "FI_REMOTE_WRITE (remote write only)",
       "info: decode pool access");
    is(info($p)->{pool}{access},
       "FI_WRITE (local source only, no remote access)",
       "info: prefill pool access");
    stop_agent($p);
    stop_agent($d);
}

# --- a request event is believed from a decode node only ------------------
{
    my $r = start_agent(agent_config(id => "router-0", role => "router",
        port => $rport, peers => [$P, $D]));
    # prefill-0 (with its own key) tries to report a request to the router
    my $out = `timeout 20 python3 - '$rport' '@{[link_key("prefill-0", "router-0")]}' '$fake' 2>&1 <<'EOF'
import sys, importlib.util, os, json
spec = importlib.util.spec_from_file_location("fp", sys.argv[3])
fp = importlib.util.module_from_spec(spec); spec.loader.exec_module(fp)
key = bytes.fromhex(sys.argv[2]); kid = fp.key_id(key)
s = fp.connect(int(sys.argv[1]))
ch = fp.read_msg(s, 3); ns = bytes.fromhex(ch["nonce"]); nc = os.urandom(32)
s.sendall(fp.frame({"type": "hello", "version": 2, "node": "prefill-0",
    "peer": "router-0", "nonce": nc.hex(), "key_id": kid,
    "proof": fp.proof(key, "client", "prefill-0", "prefill", "router-0",
                      "router", nc, ns, kid)}))
print(fp.read_msg(s, 3)["type"])
s.sendall(fp.frame({"type": "req", "req_id": "forged-1", "state": "ready",
                    "bytes_done": 1, "bytes_total": 1}))
s.sendall(fp.frame({"type": "hb", "free": 1, "total": 1}))
import time; time.sleep(0.5)
EOF`;
    like($out, qr/^hello_ok$/m, "prefill-0 authenticated at the router");
    my ($j, $rc, $txt) = status_json($r->{cfg}{state_path}, "--req",
                                     "forged-1");
    is($rc, 3, "... but its request event is not written to the router's "
       . "table") or diag($txt);
    stop_agent($r);
}

# --- key rotation: two keys per link during the roll ----------------------
{
    my $old = link_key("prefill-0", "decode-0", "old");
    my $new = link_key("prefill-0", "decode-0", "new");
    my ($d, $p);
    my @steps = (
        ["both on the old key", [$old], [$old]],
        ["decode accepts old and new", [$old, $new], [$old]],
        ["prefill proves with new, still accepts old", [$old, $new],
         [$new, $old]],
        ["decode on the new key only", [$new], [$new, $old]],
        ["prefill on the new key only", [$new], [$new]],
    );
    for my $s (@steps) {
        my ($what, $dk, $pk) = @$s;
        stop_agent($d) if $d;
        stop_agent($p) if $p;
        $d = start_agent(decode_cfg(keys => { "prefill-0" => $dk }));
        $p = start_agent(prefill_cfg(keys => { "decode-0" => $pk }));
        ok(wait_connected($p, ["decode-0"], 10)
           && wait_connected($d, ["prefill-0"], 10),
           "roll: $what: linked both ways")
            or diag(log_text($p), log_text($d));
    }
    stop_agent($d);
    stop_agent($p);
    $d = start_agent(decode_cfg(keys => { "prefill-0" => [$new] }));
    $p = start_agent(prefill_cfg(keys => { "decode-0" => [$old] }));
    ok(log_wait($d, qr/rejected a peer: node prefill-0 uses key/, 10)
       && !peer_info($p, "decode-0")->{connected},
       "roll: the old key alone no longer gets in");
    stop_agent($p);
    stop_agent($d);
}

done_testing();
