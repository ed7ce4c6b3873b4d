#!/usr/bin/perl
# Rails by PCIe topology (issue 12, points 1 and 2), on fake sysfs trees
# (KV_SYSFS_ROOT): a p5.48xlarge (8 GPUs, 32 EFA NICs, 4 per PCIe switch),
# a p4d-like node (2 GPUs and 1 NIC per switch), a small node whose only
# NIC is local to no GPU, and a node without GPUs; EFA's "<device>-rdm"
# domain names and the bare device names both accepted.  Then two real
# agents with 2 ranks each on veth rails placed in a fake tree: each
# rank's pool registered only on its own two rails, its bytes written
# only there, bit-exact.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use JSON::PP;
use KvAgentTest;
use FakeSysfs qw(fake_node p5_node p4d_node small_node);

plan skip_all => "build/kv_agent not built" unless -x kv_bin();
my $B = kv_bin();
my $dir = kv_tmpdir();

sub topo {
    my ($root, @args) = @_;
    my $out = `'$B' topo --sysfs '$root' --json @args 2>&1`;
    my $j = eval { decode_json($out) };
    return $j // { error => $out, rc => $? >> 8 };
}

# --- p5.48xlarge ----------------------------------------------------------
my $p5 = "$dir/p5";
my @nics = p5_node($p5);
is(scalar @nics, 32, "p5 tree: 32 NICs");
my $doms = join ",", map { "$_-rdm" } @nics;      # what the efa provider lists
my $j = topo($p5, "--domains", $doms);
is($j->{gpus}, 8, "p5: 8 GPUs found (NVMe and NVSwitch functions ignored)")
    or diag(explain($j));
ok($j->{known}, "p5: topology known");
my (%seen, $ok_local);
$ok_local = 1;
for my $r (@{ $j->{ranks} }) {
    my @want = map { "$_-rdm" } @nics[4 * $r->{rank} .. 4 * $r->{rank} + 3];
    is_deeply($r->{rails}, \@want,
              "p5 rank $r->{rank} (GPU $r->{gpu}): its switch's 4 NICs");
    $ok_local &&= $r->{depth} >= 3;
    $seen{$_}++ for @{ $r->{rails} };
}
ok($ok_local, "p5: every rank's rails share its PCIe switch (depth >= 3)");
is(scalar(keys %seen), 32, "p5: all 32 NICs used");
ok(!grep({ $_ != 1 } values %seen), "p5: no NIC serves two GPUs");

# rails named as the README's examples (device names, no -rdm): matched
my @bare = @nics[0 .. 7];
$j = topo($p5, "--domains", $doms, "--rails", join(",", @bare));
ok(!$j->{error}, "p5: rails named without -rdm are accepted")
    or diag($j->{error});
is_deeply($j->{ranks}[0]{rails}, [map { "$_-rdm" } @bare[0 .. 3]],
          "... and resolve to the -rdm domains of rank 0's switch");
is_deeply($j->{ranks}[1]{rails}, [map { "$_-rdm" } @bare[4 .. 7]],
          "... and of rank 1's");
$j = topo($p5, "--domains", $doms, "--rails", "$nics[0]-rdm,$nics[4]");
ok(!$j->{error}, "p5: both spellings in one list");
$j = topo($p5, "--domains", $doms, "--rails", "rdmap999s0");
like($j->{error} // "", qr/rail "rdmap999s0" matches no domain/,
     "an unknown rail name is refused with its name");

# --- p4d-like: two GPUs per NIC ------------------------------------------
my $p4 = "$dir/p4d";
my @n4 = p4d_node($p4);
$j = topo($p4, "--domains", join(",", map { "$_-rdm" } @n4));
is($j->{gpus}, 8, "p4d: 8 GPUs");
for my $r (@{ $j->{ranks} }) {
    is_deeply($r->{rails}, ["$n4[int($r->{rank} / 2)]-rdm"],
              "p4d rank $r->{rank}: the NIC on its switch");
}

# --- small node: the only NIC is on another host bridge -------------------
my $sm = "$dir/small";
my @ns = small_node($sm);
$j = topo($sm, "--domains", join(",", @ns));
is($j->{gpus}, 4, "small: 4 GPUs");
ok(!grep({ "@{ $_->{rails} }" ne $ns[0] } @{ $j->{ranks} }),
   "small: every rank uses the one NIC (local to none)");
is($j->{ranks}[0]{depth}, 0, "small: ... at depth 0 (no shared bridge)");

# --- no GPUs in sysfs: every rank every rail ------------------------------
mkdir "$dir/empty";
$j = topo("$dir/empty", "--domains", "a,b", "--ranks", 2);
ok(!$j->{known}, "no GPUs: topology unknown");
is_deeply([map { $_->{rails} } @{ $j->{ranks} }], [["a", "b"], ["a", "b"]],
          "no GPUs: each rank on every rail");

# --- a real agent: a rail named with EFA's -rdm spelling opens the NIC --
SKIP: {
    skip "tcp;ofi_rxm not available", 2 unless provider_ok('tcp;ofi_rxm');
    my $a = start_agent(agent_config(id => "decode-9", role => "decode",
        port => kv_port(698), pool => small_pool(), rails => ["lo-rdm"]));
    like(log_text($a), qr/rail 0: provider tcp;ofi_rxm, fabric [^,]+, (?#
         )domain lo,/, "rail \"lo-rdm\" opens the domain lo")
        or diag(log_text($a));
    like(log_text($a), qr/info: ready$/m, "... and the agent starts");
    stop_agent($a);
}

# --- two agents, 2 ranks each, on four veth rails in a fake tree ----------
SKIP: {
    skip "tcp;ofi_rxm not available", 14 unless provider_ok('tcp;ofi_rxm');
    my $net = `ip link add kva0 type veth peer name kvb0 2>&1`
        . `ip link add kva1 type veth peer name kvb1 2>&1`;
    skip "cannot create veth interfaces here ($net)", 14 if $?;
    system("sysctl -qw net.ipv6.conf.all.disable_ipv6=1 2>/dev/null");
    my $n = 1;
    for my $if (qw(kva0 kva1 kvb0 kvb1)) {
        system("ip addr add 10.78.$n.1/24 dev $if && ip link set $if up");
        $n++;
    }
    # GPU 0's switch holds kva0 and kva1, GPU 1's kvb0 and kvb1
    my $fr = "$dir/veth";
    fake_node($fr, switches => [[1, 2], [1, 2]], nic_class => "net",
              names => [qw(kva0 kva1 kvb0 kvb1)]);
    my $pool = small_pool(layers => 8, blocks => 64);
    $pool->{ranks} = 2;
    my %env = (KV_SYSFS_ROOT => $fr);
    my $po = 700;
    my $p = start_agent(agent_config(id => "prefill-0", role => "prefill",
        port => kv_port($po), pool => $pool, rails => "auto",
        peers => [{ id => "decode-0", ctrl => "127.0.0.1:" . kv_port($po + 1),
                    role => "decode" }]), env => \%env);
    my $d = start_agent(agent_config(id => "decode-0", role => "decode",
        port => kv_port($po + 1), pool => $pool, rails => "auto",
        peers => [{ id => "prefill-0", ctrl => "127.0.0.1:" . kv_port($po),
                    role => "prefill" }]), env => \%env);
    # (the provider lists the domains in its own order)
    like(log_text($p), qr/topology: rank 0 \(GPU [0-9a-f:.]+\) -> rail\(s\) (?#
         )(kva0, kva1|kva1, kva0) \(PCIe-local\)/,
         "agent: rank 0 on GPU 0's rails") or diag(log_text($p));
    like(log_text($p), qr/topology: rank 1 \(GPU [0-9a-f:.]+\) -> rail\(s\) (?#
         )(kvb0, kvb1|kvb1, kvb0) \(PCIe-local\)/,
         "agent: rank 1 on GPU 1's rails");
    unlike(log_text($p), qr/domain lo,/, "agent: lo (no PCIe device) not opened");
    # register each rank's pool (kvpush-style, from Python)
    my $py = <<'PY';
import sys, os, json
sys.path.insert(0, os.path.join(sys.argv[1], "kv_agent", "python"))
from kv_agent_client import Client, HostPool
out = {}
for role, sock in (("p", sys.argv[2]), ("d", sys.argv[3])):
    c = Client(sock)
    size = c.info()["pool"]["size"]
    pools = []
    for r in range(2):
        hp = HostPool(size, "%s%d" % (role, r))
        if role == "p":
            hp.map[:] = os.urandom(size)
        c.call({"verb": "register_pool", "memory": "host", "size": size,
                "rank": r, "ranks": 2}, fds=[hp.fd])
        pools.append(hp)
    out[role] = (c, pools)
import time
pc, pp = out["p"]; dc, dp = out["d"]
deadline = time.time() + 15
while time.time() < deadline:
    if all(x["connected"] and x["remote_pool"] for x in pc.info()["peers"]):
        break
    time.sleep(0.05)
pc.push("topo-1", "decode-0", list(range(0, 32)), list(range(32, 64)))
ps = pc.wait("topo-1", 20000); rs = dc.wait("topo-1", 20000)
L = 8 * 2; bb = 4096
bad = 0
for r in range(2):
    for b in range(32):
        for lr in range(L):
            so = lr * 64 * bb + b * bb
            do = lr * 64 * bb + (32 + b) * bb
            if pp[r].map[so:so + bb] != dp[r].map[do:do + bb]:
                bad += 1
print(json.dumps({"push": ps["state"], "recv": rs["state"], "bad": bad,
                  "bytes": rs.get("bytes_done"),
                  "info": pc.info()}))
PY
    open my $fh, '>', "$dir/topo.py" or die;
    print $fh $py;
    close $fh;
    my $out = `timeout 60 python3 $dir/topo.py '@{[kv_root()]}' '$p->{sock}' '$d->{sock}' 2>&1`;
    my $r = eval { decode_json((split /\n/, $out)[-1]) } // {};
    is($r->{push}, "done", "agent: 2-rank push done") or diag($out);
    is($r->{recv}, "ready", "agent: decode ready");
    is($r->{bad}, 0, "agent: both ranks bit-exact (32 blocks x 16 slices each)");
    is($r->{bytes}, 2 * 32 * 16 * 4096, "agent: both ranks' bytes counted");
    like(log_text($p), qr/pool: rank 0: registered \d+ bytes on 2 rail\(s\) (?#
         )\((kva0, kva1|kva1, kva0)\),/,
         "agent: rank 0's pool registered on kva0 and kva1 only");
    like(log_text($d), qr/pool: rank 1: registered \d+ bytes on 2 rail\(s\) (?#
         )\((kvb0, kvb1|kvb1, kvb0)\),/,
         "agent: decode rank 1's pool registered on kvb0 and kvb1 only");
    my %by = map { $_->{domain} => $_->{bytes_out} }
        @{ $r->{info}{rail_list} // [] };
    is(scalar(keys %by), 4, "agent: 4 rails open") or diag(explain($r->{info}));
    my $per = 32 * 16 * 4096;
    is(($by{kva0} // 0) + ($by{kva1} // 0), $per,
       "agent: rank 0's bytes went out on kva0/kva1");
    is(($by{kvb0} // 0) + ($by{kvb1} // 0), $per,
       "agent: rank 1's bytes went out on kvb0/kvb1");
    ok(($by{kva0} // 0) > 0 && ($by{kva1} // 0) > 0
       && ($by{kvb0} // 0) > 0 && ($by{kvb1} // 0) > 0,
       "agent: each rank striped over both its rails");
    is_deeply([map { [sort @{ $_->{rails} }] }
               @{ $r->{info}{pool}{rank_pools} // [] }],
              [[qw(kva0 kva1)], [qw(kvb0 kvb1)]], "info: rails per rank");
    stop_agent($_) for $p, $d;
    system("ip link del kva0; ip link del kva1");
}
done_testing();
