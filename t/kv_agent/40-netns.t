#!/usr/bin/perl
# Three agents as three hosts: each in its own network namespace, joined
# by veth pairs on a bridge, talking tcp;ofi_rxm over the veth addresses.
# Skipped (with the reason) where namespaces cannot be created.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use KvAgentTest;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();
plan skip_all => "libfabric tcp;ofi_rxm provider not available here"
    unless provider_ok('tcp;ofi_rxm');
plan skip_all => "needs root for ip netns" if $> != 0;

my $tag = $$ % 100000;
my $br = "kvbr$tag";
my @ns = map { "kvns$_-$tag" } 0 .. 2;
my @if = map { "kvp$_-$tag" } 0 .. 2;
my @host = map { "kvv$_-$tag" } 0 .. 2;
my $net = 10 + $$ % 200;
my @ip = map { "10.231.$net." . (1 + $_) } 0 .. 2;
my $ready = 0;

sub sh {
    my ($cmd) = @_;
    my $out = `$cmd 2>&1`;
    die "`$cmd` failed: $out" if $?;
    return $out;
}

sub cleanup {
    system("ip netns del $_ >/dev/null 2>&1") for @ns;
    system("ip link del $br >/dev/null 2>&1");
    system("ip link del $_ >/dev/null 2>&1") for @host;
}

eval {
    sh("ip link add $br type bridge");
    sh("ip link set $br up");
    for my $i (0 .. 2) {
        sh("ip netns add $ns[$i]");
        sh("ip link add $host[$i] type veth peer name $if[$i]");
        sh("ip link set $if[$i] netns $ns[$i]");
        sh("ip link set $host[$i] master $br");
        sh("ip link set $host[$i] up");
        sh("ip -n $ns[$i] link set lo up");
        sh("ip -n $ns[$i] addr add $ip[$i]/24 dev $if[$i]");
        sh("ip -n $ns[$i] link set $if[$i] up");
    }
    $ready = 1;
};
if (!$ready) {
    my $why = $@;
    cleanup();
    $why =~ s/\s+$//;
    plan skip_all => "network namespaces unavailable here: $why";
}
END { my $st = $?; cleanup() if $ready; $? = $st }

my $port = kv_port(80);
my @ids = ("prefill-0", "decode-0", "decode-1");
my @roles = ("prefill", "decode", "decode");
my @agents;
for my $i (0 .. 2) {
    my @peers = map { { id => $ids[$_], ctrl => "$ip[$_]:$port",
                        role => $roles[$_] } } grep { $_ != $i } 0 .. 2;
    my $cfg = agent_config(id => $ids[$i], role => $roles[$i],
        port => $port, pool => llama_pool(), rails => [$if[$i]],
        peers => \@peers);
    $cfg->{listen} = "$ip[$i]:$port";
    push @agents, start_agent($cfg, wrap => ["ip", "netns", "exec",
                                             $ns[$i]]);
}
ok(wait_connected($agents[0], ["decode-0", "decode-1"], 20),
   "prefill (in $ns[0]) connected to both decoders over veth")
    or diag(log_text($agents[0]));
like(log_text($agents[0]), qr/domain \Q$if[0]\E/,
     "the fabric uses the namespace's veth, not loopback");

my $j = run_kvpush("--prefill", $agents[0]{sock},
    "--decode", "decode-0=$agents[1]{sock}",
    "--decode", "decode-1=$agents[2]{sock}",
    "--nblocks", 512, "--dst", "auto", "--req", "ns");
ok(!$j->{error}, "driver ran") or diag($j->{error});
for my $r (@{ $j->{results} // [] }) {
    is($r->{push_state}, "done", "push to $r->{decode} done");
    is($r->{recv_state}, "ready", "$r->{decode} ready");
    is($r->{mismatched_slices}, 0, "$r->{decode}: bit-exact across hosts");
    is($r->{sum_src}, $r->{sum_dst}, "$r->{decode}: checksums agree");
}
is(scalar @{ $j->{results} // [] }, 2, "both decoders served");
is(stop_agent($_), 0, "$_->{name} exits cleanly") for @agents;
done_testing();
