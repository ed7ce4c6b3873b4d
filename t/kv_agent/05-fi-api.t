#!/usr/bin/perl
# libfabric API levels (issue 12, point 7): every kv_agent source compiles
# against the headers installed here (Debian: 1.17), and against any other
# libfabric's include/ directories named in KV_FI_HEADERS (colon-separated,
# e.g. v1.18.0 and v2.0.0 checkouts), where the gated EFA / 2.x options
# must be compiled in.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use KvAgentTest;

my $root = kv_root();
my $chk = "$root/kv_agent/tools/fi-api-check.sh";
ok(-x $chk, "fi-api-check.sh present");
my $out = `bash '$chk' /usr/include 2>&1`;
is($? >> 8, 0, "compiles against the system headers") or diag($out);
like($out, qr/libfabric API 1\.\d+: compiles|libfabric API \d+\.\d+: compiles/,
     "API level reported");
for my $inc (grep { length } split /:/, $ENV{KV_FI_HEADERS} // "") {
    $out = `bash '$chk' '$inc' 2>&1`;
    is($? >> 8, 0, "compiles against $inc") or diag($out);
    my ($maj, $min) = $out =~ /libfabric API (\d+)\.(\d+)/;
    if (defined $maj && ($maj > 1 || $min >= 18)) {
        like($out, qr/FI_OPT_EFA_USE_DEVICE_RDMA/,
             "$maj.$min: the >= 1.18 EFA options compiled in");
    }
    if (defined $maj && $maj >= 2) {
        like($out, qr/FI_OPT_MAX_RMA_SIZE FI_OPT_SHARED_MEMORY_PERMITTED/,
             "$maj.$min: the 2.x options compiled in");
    }
}
done_testing();
