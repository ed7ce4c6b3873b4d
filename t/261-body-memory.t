# Worker memory after the bodies that grew a worker for good (issue 8,
# item 5; found by t/260): the replayed t/260 cases (seed 1) of a 248k-id
# prompt, 1-2 MB one-word prompts and chat messages, one worker.  They
# used to stay resident after they were answered (the heap's free hole
# filled by the request's tree and tokenizer scratch): 19.6 -> 56.7 MB
# after these five, peak 89 MB over the start.  Now (the tree in its own
# pool, the freed pages handed back after a big body, 20 B of BPE scratch
# per byte of a word): +3.9 MB, peak +48 MB.  Bounds: growth 8 MB, peak
# 64 MB over the start (t/260 keeps its own, looser, for 3000 cases).
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Pools;
use DPD::FuzzNginx;

plan(skip_all => $_) for DPD::Pools->unavailable;
plan(skip_all => 'RSS says nothing under the sanitizers')
    if $ENV{DPD_SAN_LOG_DIR};
plan('no_plan');

# ports: $DPD_TEST_PORT_BASE (default 18600) + 94 .. 97
my $pools = DPD::Pools->start(offset => 94, time_scale => 0.001);
our @engines = ($pools->prefill, $pools->decode);
our (@Findings, $Summary, $Rc);

# the same prefixes in the same order as t/260: they pick the cases
sub replay {
    my ($f, $sum, $rc) = DPD::FuzzNginx::run(\@engines, '--seed', 1,
        (map { ('--only', $_) } 1, 16, 112, 175, 957),
        '--rss-growth-mb', 8, '--peak-mb', 64, '--peak-factor', 0);
    @Findings = @$f;
    ($Summary, $Rc) = ($sum, $rc);
}

our $http_config = $pools->http_config(lmcache => 1);

our $config = $DPD::FuzzNginx::Config;

master_on();
workers(1);
log_level('warn');
no_shuffle();
run_tests();

ok(defined $Summary, 'replay summary') and diag("replay: $Summary");
my @rss = grep { /RSS/ } @Findings;
is(scalar @rss, 0, 'worker RSS bounded after the big bodies')
    or diag(join "\n", @rss);
my @other = grep { !/RSS/ } @Findings;
is(scalar @other, 0, 'no other finding') or diag(join "\n", @other);
is($Rc, 0, 'replay exited cleanly');

__DATA__

=== TEST 1: five big bodies; the worker gives their memory back
--- http_config eval: $::http_config
--- config eval: $::config
--- init
main::replay();
--- request
GET /ping
--- timeout: 30
--- response_body
pong
--- no_error_log
exited on signal
[alert]
