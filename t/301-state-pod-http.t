# One config per pool, as in a Kubernetes pod: each agent's node id and vLLM
# address come from the downward API ("${POD_NAME}", "${POD_IP}:8000",
# kv_agent/src/config_env.c).  The router's config names its peer but not
# the peer's vLLM address (a pod IP nobody knows in advance); the decoder
# announces its substituted "http" in its authenticated hello, the router's
# table records it, and nginx finds the node by the address its resolved
# upstream peer has (the lookup the balancer makes, dpd_state_find_node).
use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/kv_agent";
use Test::Nginx::Socket;
use Time::HiRes qw(sleep time);
use KvAgentTest;

plan(skip_all => 'build/kv_agent not built') unless -x kv_bin();
plan(skip_all => 'libfabric tcp;ofi_rxm provider not available here')
    unless provider_ok('tcp;ofi_rxm');
plan('no_plan');

my $base = ($ENV{DPD_STATE_PORT_BASE} // 18700) + 10;

# the same text for every replica of a pool: only the environment differs
our $ROUTER_CFG = agent_config(id => '${POD_NAME}', role => "router",
    port => $base, peers => [{ id => "dpd-decode-0", role => "decode",
        ctrl => "127.0.0.1:" . ($base + 1),
        key => link_key("dpd-router-0", "dpd-decode-0") }]);
$ROUTER_CFG->{state_path} = kv_tmpdir() . '/router.state';
$ROUTER_CFG->{api_socket} = kv_tmpdir() . '/router.sock';
our $ROUTER = start_agent($ROUTER_CFG, name => "router",
    env => { POD_NAME => "dpd-router-0", POD_IP => "127.0.0.1" });
my $dcfg = agent_config(id => '${POD_NAME}', role => "decode",
    port => $base + 1, http => '${POD_IP}:8000',
    pool => small_pool(blocks => 16),
    peers => [{ id => "dpd-router-0", role => "router",
        ctrl => "127.0.0.1:$base",
        key => link_key("dpd-router-0", "dpd-decode-0") }]);
$dcfg->{listen} = '${POD_IP}:' . ($base + 1);
$dcfg->{api_socket} = kv_tmpdir() . '/decode.sock';
$dcfg->{state_path} = kv_tmpdir() . '/decode.state';
our $DEC = start_agent($dcfg, name => "decode",
    env => { POD_NAME => "dpd-decode-0", POD_IP => "127.0.0.1" });

my ($deadline, $up) = (time + 15, 0);
while (time < $deadline) {
    my ($st) = status_json($ROUTER_CFG->{state_path});
    $up = grep { $_->{alive} && $_->{http} } @{ $st->{nodes} // [] };
    last if $up == 1;
    sleep 0.1;
}
die "the decoder never showed alive with its address in the router's "
    . "table:\n" . log_text($ROUTER) . log_text($DEC) unless $up == 1;

$ENV{TEST_NGINX_STATE} = $ROUTER_CFG->{state_path};

no_shuffle();
log_level('info');
run_tests();

# both leave cleanly on SIGTERM (under KV_TEST_VALGRIND=1: no memcheck
# error, no definite leak, or the status is 99)
for my $a ($DEC, $ROUTER) {
    is(KvAgentTest::stop_agent($a, 'TERM', 60), 0,
       "$a->{name}: exit status 0 on SIGTERM");
}

__DATA__

=== TEST 1: the node of the peer 127.0.0.1:8000 is dpd-decode-0
--- http_config
    dpd_state_table $TEST_NGINX_STATE check=100ms stale=2s;
--- config
    location = /state { dpd_state_status; }
--- request eval
["GET /state?addr=127.0.0.1:8000", "GET /state?addr=127.0.0.1:8001",
 "GET /state"]
--- error_code eval
[200, 404, 200]
--- response_body_like eval
[qr/^\{"id":"dpd-decode-0","role":"decode","http":"127\.0\.0\.1:8000",(?#
    )"self":false,"alive":true,.*"total_blocks":16,/,
 qr/^\{"ok":false,"error":"unknown node"\}\n\z/,
 qr/"self":"dpd-router-0",/]
--- no_error_log
[alert]
[crit]
