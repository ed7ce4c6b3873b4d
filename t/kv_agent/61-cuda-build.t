#!/usr/bin/perl
# kv_agent's GPU path (-DKV_HAVE_CUDA) built on a machine with no CUDA
# toolkit and no GPU, against the CUDA 12 and CUDA 13 runtimes from PyPI
# that tools/deps.sh installs under .deps/cuda-N (tools/cuda/
# requirements-cuN.txt): `make kv-agent-cudaN` compiles it warning-free
# (-Werror) into build-cudaN/ and links libcudart.so.N (the wheels have
# no unversioned libcudart.so) with an rpath to the wheel's lib/.  Then
# the binaries must really call the runtime (every cuda* call in the
# source is an undefined symbol bound to libcudart.so.N, resolved by the
# loader), a GPU pool must fail with the runtime's reason and no crash,
# and host pools must still push bit-exact.  A runtime deps.sh could not
# install (PyPI unreachable) skips with the reason it wrote.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use KvAgentTest;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();
plan skip_all => "libfabric tcp;ofi_rxm provider not available here"
    unless provider_ok('tcp;ofi_rxm');
my $root = kv_root();
my $gpu = system("nvidia-smi -L >/dev/null 2>&1") == 0;

# the CUDA runtime calls the source makes; cudaGetDriverEntryPoint is the
# CUDA < 12.5 branch of pool.c (12.9 and 13.0 call ...ByVersion)
sub src_calls {
    my (@files) = @_;
    my %s;
    for my $f (@files) {
        open my $fh, '<', $f or die "$f: $!";
        local $/;
        my $t = <$fh>;
        $s{$1} = 1 while $t =~ /\b(cuda[A-Z]\w*)\s*\(/g;
    }
    delete $s{cudaGetDriverEntryPoint};
    return join " ", sort keys %s;
}
my @srcs = grep { !/cuda_ipc_helper\.c$/ } glob "$root/kv_agent/src/*.c";
my $agent_calls = src_calls(@srcs);
my $helper_calls = src_calls("$root/kv_agent/src/cuda_ipc_helper.c");
ok($agent_calls =~ /cudaMalloc .*cudaMemcpyAsync/,
   "the agent's CUDA calls are found in its source ($agent_calls)");

# undefined dynamic symbols named cuda*, each must be libcudart.so.N's
sub cudart_syms {
    my ($bin, $n) = @_;
    my (@ours, @other);
    for (`nm -D '$bin' 2>&1`) {
        next unless /^\s+U (cuda\w*)(\@\S+)?$/;
        if (($2 // "") eq "\@libcudart.so.$n") { push @ours, $1 }
        else { push @other, $1 . ($2 // "") }
    }
    return (join(" ", sort @ours), join(" ", sort @other));
}

my $po = 610;
for my $n (12, 13) {
    SKIP: {
        my $h = "$root/.deps/cuda-$n";
        if (!-f "$h/include/cuda_runtime.h") {
            my $why = "not installed (make deps)";
            if (open my $fh, '<', "$h.unavailable") {
                local $/;
                $why = <$fh>;
                $why =~ s/\s+/ /g;
            }
            skip "CUDA $n runtime from PyPI: $why", 13;
        }
        my $b = "$root/build-cuda$n";
        my $out = `cd '$root' && make -s --no-print-directory kv-agent-cuda$n 2>&1`;
        is($?, 0, "CUDA $n: make kv-agent-cuda$n builds the GPU path, "
                . "warnings as errors") or diag($out);
        like(`'$b/kv_agent' version 2>&1`, qr/, cuda$/,
             "CUDA $n: kv_agent version says cuda");

        my $dyn = `readelf -d '$b/kv_agent' 2>&1`;
        like($dyn, qr/NEEDED.*\[libcudart\.so\.$n\]/,
             "CUDA $n: needs libcudart.so.$n");
        like($dyn, qr/R(UN)?PATH.*\[\Q$h\E\/lib64\]/,
             "CUDA $n: rpath to the wheel's lib/");
        like(`ldd '$b/kv_agent' 2>&1`,
             qr/libcudart\.so\.$n => \Q$h\E\/lib64\/libcudart\.so\.$n /,
             "CUDA $n: the loader finds it there");
        my ($ours, $other) = cudart_syms("$b/kv_agent", $n);
        is($ours, $agent_calls, "CUDA $n: every CUDA call of the agent's "
           . "source binds to libcudart.so.$n");
        is($other, "", "CUDA $n: no cuda* symbol from elsewhere");
        ($ours, $other) = cudart_syms("$b/kv_cuda_ipc_helper", $n);
        is("$ours|$other", "$helper_calls|",
           "CUDA $n: kv_cuda_ipc_helper's too ($helper_calls)");

        skip "a GPU is present: tools/gpu-check.sh proves the GPU path", 5
            if $gpu;
        # a GPU pool without a GPU: a clear error, an exit, no signal
        my $c = agent_config(id => "gpu$n", port => kv_port($po++),
            pool => { %{ small_pool() }, memory => "cuda:0" });
        my $a = start_agent($c, bin => "$b/kv_agent", wait => 0);
        wait_for(20, sub { !agent_alive($a) });
        my $st = $a->{status} // -1;
        ok($st > 0 && ($st & 127) == 0 && ($st >> 8) != 0,
           "CUDA $n: a cuda:0 pool without a GPU: the agent exits "
           . "(status " . ($st >> 8) . "), no signal")
            or diag(log_text($a));
        like(log_text($a),
             qr/pool: rank 0: cuda:0: cannot allocate \d+ bytes: \w[^\n]+/,
             "CUDA $n: ... saying why") or diag(log_text($a));
        note((log_text($a) =~ /(cannot allocate[^\n]*)/)[0] // "");

        # host pools on this binary: a push, bit-exact
        my ($pp, $dp) = (kv_port($po++), kv_port($po++));
        my $p = start_agent(agent_config(id => "prefill-0",
            role => "prefill", port => $pp, pool => small_pool(),
            peers => [{ id => "decode-0", ctrl => "127.0.0.1:$dp",
                        role => "decode" }]), bin => "$b/kv_agent");
        my $d = start_agent(agent_config(id => "decode-0", port => $dp,
            pool => small_pool(),
            peers => [{ id => "prefill-0", ctrl => "127.0.0.1:$pp",
                        role => "prefill" }]), bin => "$b/kv_agent");
        # an engine's CUDA IPC pool without a GPU: refused with the
        # runtime's reason, the host pool stays
        my $r = api($d, { verb => "register_pool", memory => "cuda:0",
                          ipc_handle => "00" x 64,
                          size => 64 * 1024 * 1024 });
        ok(!$r->{ok} && ($r->{code} // "") eq "bad_request"
           && ($r->{error} // "") =~ /^cudaIpcOpenMemHandle: \w/,
           "CUDA $n: register_pool cuda:0 refused: "
           . ($r->{error} // json_enc($r)));
        ok(wait_connected($p, ["decode-0"]), "CUDA $n: host pools connect")
            or diag(log_text($p), log_text($d));
        my $j = run_kvpush("--prefill", $p->{sock},
            "--decode", "decode-0=$d->{sock}", "--nblocks", 32,
            "--dst", "auto", "--req", "cuda$n");
        my $res = $j->{results} ? $j->{results}[0] : {};
        ok(($res->{recv_state} // "") eq "ready"
           && ($res->{mismatched_slices} // -1) == 0
           && ($res->{sum_src} // "x") eq ($res->{sum_dst} // "y"),
           "CUDA $n: host pools push 32 blocks bit-exact "
           . "($res->{slices_checked} slices)")
            or diag(json_enc($j));
        stop_agent($_) for $p, $d;
    }
}

# tools/gpu-check.sh without /usr/local/cuda picks the PyPI runtime for
# the driver's CUDA major (a fake nvidia-smi says which; no provider is
# run, so only the choice and the build are checked here)
SKIP: {
    skip "a GPU is present (60-gpu.t runs tools/gpu-check.sh)", 4 if $gpu;
    skip "/usr/local/cuda is installed: gpu-check.sh uses it", 4
        if -f "/usr/local/cuda/include/cuda_runtime.h";
    skip "no PyPI CUDA 12 and 13 runtimes (make deps)", 4
        unless -f "$root/.deps/cuda-12/include/cuda_runtime.h"
            && -f "$root/.deps/cuda-13/include/cuda_runtime.h";
    my $fake = kv_tmpdir() . "/fakebin";
    mkdir $fake;
    for ([13, "13.0", 0], [12, "12.8", 0], [13, "14.1", 0], [0, "11.8", 2]) {
        my ($want, $drv, $rc) = @$_;
        open my $fh, '>', "$fake/nvidia-smi" or die;
        print $fh "#!/bin/sh\n[ \"\$1\" = -L ] && "
            . "echo 'GPU 0: NVIDIA H200 (UUID: GPU-0)' && exit 0\n"
            . "echo '| NVIDIA-SMI 580.00  Driver Version: 580.00  "
            . "CUDA Version: $drv |'\n";
        close $fh;
        chmod 0755, "$fake/nvidia-smi";
        my $out = `env -u CUDA_HOME PATH='$fake':"\$PATH" KV_GPU_PROVIDERS=none KV_GPU_PORT=@{[kv_port(620)]} timeout 120 '$root/tools/gpu-check.sh' 2>&1`;
        if ($want) {
            ok($? >> 8 == $rc && $out =~ /CUDA runtime: PyPI's CUDA $want in \.deps\/cuda-$want/
               && $out =~ /PASS build \(CUDA path compiled\)/,
               "gpu-check.sh, driver CUDA $drv: builds against PyPI's CUDA $want")
                or diag($out);
        } else {
            ok($? >> 8 == 2 && $out =~ /SKIP: no \/usr\/local\/cuda and no PyPI CUDA runtime/,
               "gpu-check.sh, driver CUDA $drv: SKIP, exit 2, saying why")
                or diag($out);
        }
    }
}
done_testing();
