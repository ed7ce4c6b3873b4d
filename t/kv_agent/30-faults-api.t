#!/usr/bin/perl
# Bad input on the local API: every case gets a clear error reply, the
# agent keeps serving, nothing is written out of bounds.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use IO::Socket::UNIX;
use KvAgentTest;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();
plan skip_all => "libfabric tcp;ofi_rxm provider not available here"
    unless provider_ok('tcp;ofi_rxm');

my $po = 30;
my $pool = small_pool(blocks => 64);
my $d = start_agent(agent_config(id => "decode-0", role => "decode",
    port => kv_port($po + 1), pool => $pool, api => { max_message => 4096 },
    peers => [{ id => "prefill-0", ctrl => "127.0.0.1:" . kv_port($po),
                role => "prefill" }]));
my $p = start_agent(agent_config(id => "prefill-0", role => "prefill",
    port => kv_port($po), pool => $pool,
    peers => [
        { id => "decode-0", ctrl => "127.0.0.1:" . kv_port($po + 1),
          role => "decode" },
        { id => "prefill-1", ctrl => "127.0.0.1:" . kv_port($po + 2),
          role => "prefill" },
        { id => "decode-9", ctrl => "127.0.0.1:" . kv_port($po + 3),
          role => "decode" },
    ]));
ok(wait_connected($p, ["decode-0"]), "prefill connected to decode-0")
    or diag(log_text($p), log_text($d));

sub frame { pack("N", length $_[0]) . $_[0] }
sub err_like {
    my ($rep, $code, $re, $name) = @_;
    ok($rep && !$rep->{ok}, "$name: refused");
    is($rep && $rep->{code}, $code, "$name: code $code");
    like($rep && $rep->{error} // "", $re, "$name: message");
}

# malformed / unknown
err_like(api_raw($d->{sock}, frame('{"verb": "info",')), "bad_request",
         qr/malformed JSON/, "truncated JSON");
err_like(api_raw($d->{sock}, frame('[1,2,3]')), "bad_request",
         qr/malformed JSON/, "JSON array");
err_like(api($d, { noverb => 1 }), "bad_request", qr/no "verb"/,
         "missing verb");
err_like(api($d, { verb => "format_disk" }), "unknown_verb",
         qr/unknown verb "format_disk"/, "unknown verb");
err_like(api($d, { verb => "reserve" }), "bad_request", qr/needs req_id/,
         "reserve without req_id");

# oversized frame: answered, then the connection is closed
{
    my $s = IO::Socket::UNIX->new(Type => SOCK_STREAM, Peer => $d->{sock});
    print $s pack("N", 1 << 20) . ("x" x 8192);
    my $buf = "";
    my $deadline = time + 5;
    while (time < $deadline) {
        my $r = sysread($s, $buf, 65536, length $buf);
        last unless $r;
    }
    my $n = length($buf) >= 4 ? unpack("N", $buf) : 0;
    my $rep = $n ? eval { json_dec(substr($buf, 4, $n)) } : undef;
    err_like($rep, "too_large", qr/too large/, "oversized frame");
    ok(length($buf) == 4 + $n, "oversized frame: connection closed after "
       . "the reply");
    like(log_text($d), qr/message too large \(limit 4096 bytes\)/,
         "oversized frame logged");
}

# block ids out of range, on both sides
err_like(api($d, { verb => "reserve", req_id => "r1", blocks => [1, 64] }),
         "out_of_range", qr/block 64 out of range \(pool has 64 blocks\)/,
         "reserve out of range");
err_like(api($d, { verb => "reserve", req_id => "r1b",
                   blocks => [1, -3] }), "bad_request",
         qr/out of range/, "negative block id");
err_like(api($p, { verb => "push", req_id => "p1", peer => "decode-0",
                   src => [0, 99] }), "out_of_range",
         qr/src block 99 out of range/, "push src out of range");
err_like(api($p, { verb => "push", req_id => "p2", peer => "decode-0",
                   src => [0, 1], dst => [5, 64] }), "out_of_range",
         qr/dst block 64 out of range \(decode-0 has 64 blocks\)/,
         "push dst out of range (sender checks the peer's geometry)");
err_like(api($d, { verb => "checksum", blocks => [70] }), "out_of_range",
         qr/block 70 out of range/, "checksum out of range");

# the receiver checks too: destination blocks owned by another request
my $r = api($d, { verb => "reserve", req_id => "owner", nblocks => 4 });
ok($r->{ok}, "reserve 4 blocks for another request");
my $rep = api($p, { verb => "push", req_id => "steal", peer => "decode-0",
                    src => [0, 1], dst => [ @{ $r->{blocks} }[0, 1] ] });
ok($rep->{ok}, "push accepted by the sender");
$rep = api($p, { verb => "wait", req_id => "steal", timeout_ms => 5000 });
is($rep->{state}, "failed", "receiver refused blocks it reserved for "
   . "another request");
like($rep->{error}, qr/refused by decode-0: block 0 is not free/,
     "... with the receiver's reason");
ok(api($d, { verb => "release", req_id => "owner" })->{ok}, "release");

# reserve on a full pool
$r = api($d, { verb => "reserve", req_id => "big", nblocks => 64 });
ok($r->{ok} && @{ $r->{blocks} } == 64, "reserve the whole pool");
err_like(api($d, { verb => "reserve", req_id => "more", nblocks => 1 }),
         "pool_full", qr/pool full: 1 blocks requested, 0 free of 64/,
         "reserve on a full pool");
err_like(api($d, { verb => "reserve", req_id => "big", nblocks => 1 }),
         "bad_request", qr/already has a reservation/, "duplicate reserve");
$rep = api($p, { verb => "push", req_id => "full", peer => "decode-0",
                 src => [0] });
$rep = api($p, { verb => "wait", req_id => "full", timeout_ms => 5000 });
is($rep->{state}, "failed", "push into a full pool fails");
like($rep->{error}, qr/pool full/, "... saying the pool is full");
ok(api($d, { verb => "release", req_id => "big" })->{ok}, "release all");
$r = api($d, { verb => "reserve", req_id => "again", nblocks => 64 });
ok($r->{ok}, "the pool is usable again after release");
api($d, { verb => "release", req_id => "again" });

# unknown and unauthorised peers
err_like(api($p, { verb => "push", req_id => "x", peer => "nobody",
                   src => [0] }), "unknown_peer", qr/unknown peer nobody/,
         "push to an unknown peer");
err_like(api($p, { verb => "push", req_id => "x", peer => "prefill-1",
                   src => [0] }), "peer",
         qr/prefill-1 is a prefill node, not authorised to receive KV/,
         "push to a peer that may not receive KV");
err_like(api($p, { verb => "push", req_id => "x", peer => "decode-9",
                   src => [0] }), "peer", qr/decode-9 is not connected/,
         "push to a configured peer that is down");

# many pushes nobody releases on the prefill side: finished ones are
# recycled (the decode side releases its blocks)
my $okn = 0;
for my $k (1 .. 40) {
    my $q = api($p, { verb => "push", req_id => "many$k", peer => "decode-0",
                      src => [$k % 64] });
    $q = api($d, { verb => "wait", req_id => "many$k", timeout_ms => 5000 });
    $okn++ if $q->{state} eq "ready";
    api($d, { verb => "release", req_id => "many$k" });
}
is($okn, 40, "40 unreleased pushes in a row all land (32 slots recycled)");

# other misuse
err_like(api($d, { verb => "register_pool", memory => "host" }),
         "bad_request", qr/needs a memfd passed with SCM_RIGHTS/,
         "register_pool without a descriptor");
err_like(api($d, { verb => "wait", req_id => "ghost" }), "not_found",
         qr/unknown request ghost/, "wait on an unknown request");
err_like(api($d, { verb => "release", req_id => "ghost" }), "not_found",
         qr/unknown request/, "release of an unknown request");
$r = api($d, { verb => "reserve", req_id => "slow", nblocks => 2 });
$rep = api($d, { verb => "wait", req_id => "slow", timeout_ms => 200 });
ok($rep->{ok} && $rep->{timeout} && $rep->{state} eq "reserved",
   "wait returns at its timeout with the current state");

# still serving, nothing crashed
my $info = api($d, { verb => "info" });
ok($info->{ok} && $info->{pool}{free} == 62, "decode agent still serves, "
   . "free blocks accounted");
ok(agent_alive($d) && agent_alive($p), "both agents alive");
is(stop_agent($p), 0, "prefill exits cleanly");
is(stop_agent($d), 0, "decode exits cleanly");
done_testing();
