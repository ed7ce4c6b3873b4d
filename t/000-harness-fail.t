# The harness must detect wrong results: run a fixture whose blocks are
# wrong on purpose and check every comparison is reported "not ok" with a
# readable diagnostic; check TEST_NGINX_LOAD_MODULES emits load_module
# lines first in nginx.conf.  Stock nginx only.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/lib/harness-fixtures";
use RunFixture;
use Test::More;

my ($out, $rc) = run_fixture('wrong.tfix', TEST_NGINX_LOAD_MODULES => undef);
my @lines = split /\n/, $out;

sub tap_line {
    my ($re) = @_;
    my ($l) = grep { /$re/ } @lines;
    return $l // '';
}

# prove must fail the fixture: a non-zero exit, or no plan at all (the real
# module's client timeout handler turns off Test::Builder's ending, so
# neither the plan nor the exit status follow there)
ok($rc != 0 || $out !~ /^1\.\.\d+$/m,
   'fixture with wrong expectations fails under prove');

like(tap_line(qr/TEST 1: control - response_body/), qr/^ok /,
     'control block passes');

my @must_fail = (
    [qr/TEST 2: wrong body - response_body - response is expected/,
     'wrong body'],
    [qr/TEST 3: wrong status - status code ok/, 'wrong status'],
    [qr/TEST 4: .* - header X-Present ok/, 'wrong header value'],
    [qr/TEST 4: .* - header X-Unwanted not present/, 'header must be absent'],
    [qr/TEST 5: .* pattern "this text is never logged" should match/,
     'missing error_log pattern'],
    [qr/TEST 5: .* pattern "No such file or directory" should not match/,
     'unwanted no_error_log pattern'],
    [qr/TEST 6: must_die with a valid config - die as expected/,
     'must_die with a valid config'],
    [qr/ERROR: client socket timed out - .*TEST 7/, 'timeout without abort'],
    [qr/TEST 8: .* - response_body_like - response is expected/,
     'response_body_like mismatch'],
    [qr/TEST 9: .* - response_body - response is expected/,
     'de-chunked body mismatch'],
);
for my $case (@must_fail) {
    my ($re, $what) = @$case;
    like(tap_line($re), qr/^not ok /, "reported as not ok: $what");
}

# diagnostics a developer can read: the strings that differ
like($out, qr/got: "right\\x\{0a\}"|got: 'right\n'/,
     'diff shows what was received');
like($out, qr/expected: "wrong\\x\{0a\}"|expected: 'wrong\n'/,
     'diff shows what was expected');
my $not_ok = grep { /^not ok / } @lines;
is($not_ok, 10, 'exactly the wrong blocks fail (10 checks)');

# TEST_NGINX_LOAD_MODULES: a load_module directive per path, in the main
# context before http{} and in the given order (as the real module: in
# front of the block's main_config); nginx then fails on the first file.
my $servroot = $ENV{TEST_NGINX_SERVROOT} || "$FindBin::Bin/servroot";
($out, $rc) = run_fixture('loadmod.tfix',
    TEST_NGINX_LOAD_MODULES => '/nonexistent/ngx_harness_probe_a.so '
                               . '/nonexistent/ngx_harness_probe_b.so');
is($rc, 0, 'must_die block for a missing module passes')
    or diag $out;
like($out, qr/^ok \d+ .*dlopen/m, 'dlopen failure found in the error log');

my $conf = do {
    local $/;
    open my $in, '<', "$servroot/conf/nginx.conf" or die "$servroot: $!";
    <$in>;
};
my ($main) = $conf =~ /\A(.*?)^http\s*\{/ms;
like($main // '', qr{\bload_module\s+/nonexistent/ngx_harness_probe_a\.so;.*
                     \bload_module\s+/nonexistent/ngx_harness_probe_b\.so;}xs,
     'both modules, in order, in the main context');
my $loads = () = $conf =~ m{\bload_module\s+/}g;
is($loads, 2, 'one load_module per path');

done_testing();
