#!/usr/bin/perl
# One prefill agent pushing Llama-shaped requests to two decode agents at
# the same time; a router agent mirrors heartbeats and request events into
# its table (what nginx reads) and marks a silent peer dead.
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

my $po = 70;
my %ctrl = map { $_->[0] => "127.0.0.1:" . kv_port($po + $_->[1]) }
    (["router-0", 0], ["prefill-0", 1], ["decode-0", 2], ["decode-1", 3]);
sub peer { my ($id, $role, $http) = @_;
           return { id => $id, ctrl => $ctrl{$id}, role => $role,
                    $http ? (http => $http) : () } }
my $R = peer("router-0", "router");

my $router = start_agent(agent_config(id => "router-0", role => "router",
    port => kv_port($po), peers => [peer("prefill-0", "prefill",
    "127.0.0.1:8100"), peer("decode-0", "decode", "127.0.0.1:8200"),
    peer("decode-1", "decode", "127.0.0.1:8201")]));
my $p = start_agent(agent_config(id => "prefill-0", role => "prefill",
    port => kv_port($po + 1), pool => llama_pool(),
    peers => [peer("decode-0", "decode"), peer("decode-1", "decode"), $R]));
my @d = map {
    start_agent(agent_config(id => "decode-$_", role => "decode",
        port => kv_port($po + 2 + $_), pool => llama_pool(),
        peers => [peer("prefill-0", "prefill"), $R]))
} 0, 1;
ok(wait_connected($p, ["decode-0", "decode-1", "router-0"]),
   "prefill connected to both decoders and the router");

my $j = run_kvpush("--prefill", $p->{sock}, "--decode",
    "decode-0=$d[0]{sock}", "--decode", "decode-1=$d[1]{sock}",
    "--nblocks", 512, "--dst", "reserve", "--req", "fan", "--keep");
ok(!$j->{error}, "driver ran") or diag($j->{error});
for my $r (@{ $j->{results} // [] }) {
    is($r->{push_state}, "done", "push to $r->{decode} done");
    is($r->{recv_state}, "ready", "$r->{decode} ready");
    is($r->{mismatched_slices}, 0, "$r->{decode}: $r->{slices_checked} "
       . "slices bit-exact");
    is($r->{sum_src}, $r->{sum_dst}, "$r->{decode}: checksums agree");
}
is(scalar @{ $j->{results} // [] }, 2, "two concurrent pushes");

# the router's table: nodes alive with their capacity, requests ready
my $deadline = time + 5;
my $st;
while (time < $deadline) {
    ($st) = status_json($router->{cfg}{state_path});
    my %n = map { $_->{id} => $_ } @{ $st->{nodes} };
    last if ($n{"decode-1"}{free_blocks} // -1) == 88
         && ($n{"decode-0"}{free_blocks} // -1) == 88
         && 2 == grep { $_->{state} eq "ready" } @{ $st->{requests} };
    sleep 0.1;
}
my %n = map { $_->{id} => $_ } @{ $st->{nodes} };
for my $id (qw(prefill-0 decode-0 decode-1)) {
    ok($n{$id} && $n{$id}{alive}, "router sees $id alive");
}
is($n{"decode-0"}{free_blocks}, 88, "router knows decode-0's free blocks");
is($n{"decode-0"}{total_blocks}, 600, "... and its total");
is($n{"decode-1"}{http}, "127.0.0.1:8201", "... and decode-1's vLLM");
for my $r (@{ $j->{results} // [] }) {
    my ($rec) = grep { $_->{req_id} eq $r->{req} } @{ $st->{requests} };
    is($rec && $rec->{state}, "ready", "router: $r->{req} ready");
    is($rec && $rec->{node}, $r->{decode}, "router: ... on $r->{decode}");
    is($rec && $rec->{bytes_done}, 512 * 80 * 2 * 4096,
       "router: ... all bytes");
}

# release on decode-0: the router drops the record
my $r0 = $j->{results}[0];
ok(api($d[0], { verb => "release", req_id => $r0->{req} })->{ok},
   "release on decode-0");
$deadline = time + 3;
my $gone = 0;
while (time < $deadline && !$gone) {
    my $o = `@{[kv_bin()]} status --state $router->{cfg}{state_path} --req $r0->{req}`;
    $gone = $? >> 8 == 3;
    sleep 0.05;
}
ok($gone, "router forgot the released request");

# a restarted router rebuilds its table from the peers
is(stop_agent($router), 0, "router stops");
$router = start_agent($router->{cfg});
my $r1 = $j->{results}[1];
my $back = 0;
$deadline = time + 5;
while (time < $deadline && !$back) {
    my ($s) = status_json($router->{cfg}{state_path});
    $back = grep { $_->{req_id} eq $r1->{req} && $_->{state} eq "ready" }
        @{ $s->{requests} };
    sleep 0.05;
}
ok($back, "restarted router relearns $r1->{req} (ready) from decode-1");

# a silent peer is marked dead within dead_after_ms (600 ms here)
my $t0 = time;
stop_agent($d[1], 'KILL');
my $dead = 0;
while (time < $t0 + 5) {
    ($st) = status_json($router->{cfg}{state_path});
    my ($x) = grep { $_->{id} eq "decode-1" } @{ $st->{nodes} };
    if ($x && !$x->{alive}) { $dead = time - $t0; last }
    sleep 0.02;
}
ok($dead && $dead < 1.5, sprintf("router marked decode-1 dead after %.2fs",
   $dead));
ok(log_wait($router, qr/peer decode-1 is dead \(silent for \d+ ms\)/, 2),
   "... and logged it");

for my $a ($p, $d[0], $router) {
    is(stop_agent($a), 0, "$a->{name} exits cleanly");
}

# the same 1 -> 2 fan-out over shm
SKIP: {
    skip "libfabric shm provider not available here", 11
        unless provider_ok('shm');
    my $q = 75;
    my %c2 = map { $_->[0] => "127.0.0.1:" . kv_port($q + $_->[1]) }
        (["prefill-0", 0], ["decode-0", 1], ["decode-1", 2]);
    my $sp = start_agent(agent_config(id => "prefill-0", role => "prefill",
        provider => "shm", port => kv_port($q), pool => llama_pool(),
        peers => [map { { id => $_, ctrl => $c2{$_}, role => "decode" } }
                  "decode-0", "decode-1"]));
    my @sd = map {
        start_agent(agent_config(id => "decode-$_", role => "decode",
            provider => "shm", port => kv_port($q + 1 + $_),
            pool => llama_pool(), peers => [{ id => "prefill-0",
            ctrl => $c2{"prefill-0"}, role => "prefill" }]))
    } 0, 1;
    ok(wait_connected($sp, ["decode-0", "decode-1"]), "shm: connected");
    my $js = run_kvpush("--prefill", $sp->{sock}, "--decode",
        "decode-0=$sd[0]{sock}", "--decode", "decode-1=$sd[1]{sock}",
        "--nblocks", 512, "--dst", "auto", "--req", "shmfan");
    for my $r (@{ $js->{results} // [] }) {
        is($r->{push_state} . "/" . $r->{recv_state}, "done/ready",
           "shm: push to $r->{decode} landed");
        is($r->{mismatched_slices}, 0, "shm: $r->{decode} bit-exact");
        is($r->{sum_src}, $r->{sum_dst}, "shm: $r->{decode} checksums");
    }
    is(scalar @{ $js->{results} // [] }, 2, "shm: two concurrent pushes")
        or diag($js->{error});
    is(stop_agent($_), 0, "shm: $_->{name} exits cleanly") for $sp, @sd;
}
done_testing();
