package PushSuite;

# The proof tests shared by the tcp;ofi_rxm and shm runs: real agents on
# loopback, a Llama-70B-shaped push (80 layers, K and V, 4 KiB per block
# per region, 512 blocks = 320 MiB) checked byte for byte, then the other
# ways of naming destination blocks, and the C client library.

use strict;
use warnings;
use Test::More;
use KvAgentTest;

our $TRANSFER_MS = 90000;
our @WAIT = ("--timeout-ms", $TRANSFER_MS);

sub pair {
    my ($prov, $po, %o) = @_;
    # 90 s per transfer: a shuffled 160 MiB push over shm (40960 writes
    # of 4 KiB) takes ~2 s alone, can exceed 10 s on 2 loaded cores and
    # exceeded 30 s at a load of 10 (make test runs 4 files at a time);
    # what is proven here is the bytes, not the speed
    my $p = agent_config(id => "prefill-0", role => "prefill",
        provider => $prov, port => kv_port($po), pool => llama_pool(),
        transfer_ms => $TRANSFER_MS,
        peers => [{ id => "decode-0", ctrl => "127.0.0.1:" . kv_port($po + 1),
                    role => "decode", http => "127.0.0.1:8200" }], %o);
    my $d = agent_config(id => "decode-0", role => "decode",
        provider => $prov, port => kv_port($po + 1), pool => llama_pool(),
        http => "127.0.0.1:8200", transfer_ms => $TRANSFER_MS,
        peers => [{ id => "prefill-0", ctrl => "127.0.0.1:" . kv_port($po),
                    role => "prefill" }], %o);
    my $pa = start_agent($p);
    my $da = start_agent($d);
    return ($pa, $da);
}

sub check_results {
    my ($j, $what, $n) = @_;
    if ($j->{error}) {
        fail("$what: $j->{error}");
        return;
    }
    for my $r (@{ $j->{results} }) {
        is($r->{push_state}, "done", "$what: push to $r->{decode} done")
            or diag("push error: $r->{push_error}");
        is($r->{recv_state}, "ready", "$what: $r->{decode} ready")
            or diag("recv error: $r->{recv_error}");
        is($r->{bytes}, $n * 80 * 2 * 4096, "$what: all bytes counted");
        is($r->{mismatched_slices}, 0,
           "$what: $r->{slices_checked} slices bit-exact on $r->{decode}");
        is($r->{sum_src}, $r->{sum_dst},
           "$what: agent checksums agree ($r->{sum_src})");
    }
}

sub run {
    my ($prov, $po) = @_;
    my ($pa, $da) = pair($prov, $po);
    ok(wait_connected($pa, ["decode-0"]), "$prov: prefill connected")
        or diag(log_text($pa), log_text($da));
    like(log_text($pa), qr/provider \Q$prov\E, fabric/,
         "$prov: provider and fabric logged");

    my $j = run_kvpush("--prefill", $pa->{sock},
        "--decode", "decode-0=$da->{sock}", "--nblocks", 512,
        "--dst", "auto", "--req", "llama", "--keep", @WAIT);
    check_results($j, "$prov llama auto-dst", 512);

    # the decode table says the request landed
    my ($st) = status_json($da->{cfg}{state_path});
    my ($rec) = grep { $_->{req_id} eq $j->{results}[0]{req} }
        @{ $st->{requests} };
    is($rec && $rec->{state}, "ready", "$prov: state table shows ready");
    is($rec && $rec->{peer}, "prefill-0", "$prov: ... pushed by prefill-0");
    my $rel = api($da, { verb => "release", req_id => $j->{results}[0]{req} });
    ok($rel->{ok}, "$prov: release frees the blocks");

    # explicit destination runs far apart, pairs shuffled (no coalescing
    # across the shuffle), on fresh pools
    $j = run_kvpush("--prefill", $pa->{sock},
        "--decode", "decode-0=$da->{sock}", "--nblocks", 256,
        "--dst", "explicit", "--shuffle", "--req", "shuf", @WAIT);
    check_results($j, "$prov explicit shuffled", 256);

    # reserve on the decode side first, then push into the reservation,
    # through the C client library (kv_agent_ctl)
    my $ctl = kv_ctl();
    my $out = `$ctl $da->{sock} reserve c-req 16 2>&1`;
    like($out, qr/"ok":true,"nblocks":16/, "$prov: C client reserve");
    $out = `$ctl $pa->{sock} push c-req decode-0 100-115 2>&1`;
    like($out, qr/"ok":true/, "$prov: C client push");
    $out = `$ctl $da->{sock} wait c-req 10000 2>&1`;
    like($out, qr/"state":"ready"/, "$prov: C client wait sees ready");
    my ($first) = `$ctl $da->{sock} call '{"verb":"poll","req_id":"c-req"}'`
        =~ /"blocks_runs":\[\[(\d+),16\]\]/;
    ok(defined $first, "$prov: reservation is one run");
    my $s1 = `$ctl $pa->{sock} checksum 100-115`;
    my $s2 = `$ctl $da->{sock} checksum $first-@{[$first + 15]}`;
    chomp($s1, $s2);
    ok($s1 ne "" && $s1 eq $s2, "$prov: checksums match via C client");
    $out = `$ctl $da->{sock} release c-req 2>&1`;
    like($out, qr/"ok":true/, "$prov: C client release");

    is(stop_agent($pa), 0, "$prov: prefill exits 0 on SIGTERM");
    is(stop_agent($da), 0, "$prov: decode exits 0 on SIGTERM");
    unlike(log_text($pa) . log_text($da), qr/\berror:/,
           "$prov: no errors logged");
    return if $prov ne 'tcp;ofi_rxm';

    # two rails (two endpoints on lo): writes striped over both
    ($pa, $da) = pair($prov, $po + 2, rails => ["lo", "lo"]);
    ok(wait_connected($pa, ["decode-0"]), "2 rails: connected");
    like(log_text($pa), qr/rail 1: provider \Q$prov\E/, "2 rails: opened");
    like(log_text($pa), qr/connected to decode-0 \(decode, 2 rail\(s\)/,
         "2 rails: peer has both");
    $j = run_kvpush("--prefill", $pa->{sock},
        "--decode", "decode-0=$da->{sock}", "--nblocks", 512,
        "--dst", "explicit", "--req", "rails", @WAIT);
    check_results($j, "$prov 2 rails", 512);
    stop_agent($_) for $pa, $da;
}

1;
