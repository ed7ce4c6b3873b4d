#!/usr/bin/perl
# GPU-to-GPU push (cuda:<dev> pools, FI_HMEM or pinned staging, CUDA IPC
# registration) through tools/gpu-check.sh - only where a GPU is present.
# Without one, the script's flow is still checked with host pools.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use KvAgentTest;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();
my $root = kv_root();
my $gpu = system("nvidia-smi -L >/dev/null 2>&1") == 0;
my $cuda = `@{[kv_bin()]} version` =~ /cuda/;

SKIP: {
    skip "no NVIDIA GPU on this machine (nvidia-smi -L fails); run "
       . "tools/gpu-check.sh where one is lent", 1 unless $gpu && $cuda;
    my $out = `KV_GPU_PORT=@{[kv_port(950)]} timeout 300 $root/tools/gpu-check.sh 2>&1`;
    is($? >> 8, 0, "tools/gpu-check.sh passes on the GPU") or diag($out);
}

# the same script with host pools: its flow works here too
my $out = `KV_GPU_DRY_RUN=1 KV_GPU_PORT=@{[kv_port(960)]} KV_GPU_PROVIDERS='tcp;ofi_rxm' timeout 120 $root/tools/gpu-check.sh 2>&1`;
is($? >> 8, 0, "gpu-check.sh dry run (host pools) passes") or diag($out);
like($out, qr/PASS tcp;ofi_rxm agent-allocated: 512 blocks/,
     "dry run pushed and compared 512 blocks");
like($out, qr/PASS tcp;ofi_rxm TP=2: every rank's 256 blocks bit-exact/,
     "dry run: the tensor-parallel step (2 ranks, staged) too");
# without a GPU the real run says so and checks nothing (exit 2)
if (!$gpu) {
    $out = `timeout 60 $root/tools/gpu-check.sh 2>&1`;
    is($? >> 8, 2, "no GPU: gpu-check.sh exits 2");
    like($out, qr/SKIP: no NVIDIA GPU visible/, "... saying why");
}
done_testing();
