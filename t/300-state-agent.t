# ngx_http_dpd_state_module against real kv_agents: a router agent mirrors
# two decode agents into its table; nginx maps it (dpd_state_table) and
# shows it (dpd_state_status, $dpd_kv_nodes_alive, $dpd_kv_state).  Then a
# decoder is killed (dead within dead_after_ms), the router is killed (the
# table goes stale) and restarted (nginx maps the new file).
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
plan('no_plan');   # after the skip checks: a skip must not plan twice

# agents: 18700-18799 unless DPD_STATE_PORT_BASE moves them
my $base = $ENV{DPD_STATE_PORT_BASE} // 18700;
my %ctrl = map { $_->[0] => "127.0.0.1:" . ($base + $_->[1]) }
    (["router-0", 0], ["decode-0", 1], ["decode-1", 2], ["prefill-0", 3]);
my %http = ("decode-0" => "127.0.0.1:8200", "decode-1" => "127.0.0.1:8201",
            "prefill-0" => "127.0.0.1:8100");

sub peer {
    my ($id, $role) = @_;
    return { id => $id, ctrl => $ctrl{$id}, role => $role,
             $http{$id} ? (http => $http{$id}) : () };
}

# heartbeat 100 ms, dead after 600 ms (agent_config's test timeouts)
our $ROUTER_CFG = agent_config(id => "router-0", role => "router",
    port => $base, peers => [peer("decode-0", "decode"),
                             peer("decode-1", "decode"),
                             peer("prefill-0", "prefill")]);
our $ROUTER = start_agent($ROUTER_CFG);
our @DEC = map {
    start_agent(agent_config(id => "decode-$_", role => "decode",
        port => $base + 1 + $_, http => $http{"decode-$_"},
        pool => small_pool(blocks => 64),
        peers => [peer("prefill-0", "prefill"), peer("router-0", "router")]))
} 0, 1;
our $PRE = start_agent(agent_config(id => "prefill-0", role => "prefill",
    port => $base + 3, http => $http{"prefill-0"},
    pool => small_pool(blocks => 64),
    peers => [peer("decode-0", "decode"), peer("decode-1", "decode"),
              peer("router-0", "router")]));

# both decoders mirrored alive in the router's table before nginx starts
my ($deadline, $up) = (time + 15, 0);
while (time < $deadline) {
    my ($st) = status_json($ROUTER_CFG->{state_path});
    $up = grep { $_->{alive} } @{ $st->{nodes} // [] };
    last if $up == 4;
    sleep 0.1;
}
if ($up != 4) {
    my @down = grep { !agent_alive($_) } $ROUTER, @DEC, $PRE;
    die "only $up of 4 agents alive in the router's table (ports "
        . "$base-" . ($base + 3) . " in use?); exited: "
        . join(", ", map { $_->{name} } @down) . "\n"
        . join("", map { "$_->{name}: " . log_text($_) } @down);
}

$ENV{TEST_NGINX_STATE} = $ROUTER_CFG->{state_path};

# waits until the router's own table says $cond (a sub over its JSON)
sub router_wait {
    my ($cond, $timeout) = @_;
    my $end = time + ($timeout // 10);
    while (time < $end) {
        my ($st) = status_json($ROUTER_CFG->{state_path});
        return 1 if $st && $cond->($st);
        sleep 0.05;
    }
    return 0;
}

sub node_re {
    my ($id, $role, $http, $alive, $rest) = @_;
    return qr/\{"id":"$id","role":"$role","http":"\Q$http\E","self":\w+,/
         . qr/"alive":$alive,"heartbeat_age_ms":-?\d+,$rest/;
}

no_shuffle();
log_level('info');
run_tests();

__DATA__

=== TEST 1: the router's table: four nodes alive, capacity, addresses
--- http_config
    dpd_state_table $TEST_NGINX_STATE check=100ms stale=2s;
--- config
    location = /state { dpd_state_status; }
--- request
GET /state
--- response_headers
Content-Type: application/json
--- response_body_like eval
qr/^(?=.*"ok":true,)(?=.*"writer_alive":true,"stale":false,)
    (?=.*"self":"router-0",)
    (?=.*${\ main::node_re("router-0", "router", "", "true",
                           '"free_blocks":0,"total_blocks":0,')})
    (?=.*${\ main::node_re("decode-0", "decode", "127.0.0.1:8200", "true",
      '"free_blocks":64,"total_blocks":64,"block_bytes":32768,"inflight":0')})
    (?=.*${\ main::node_re("decode-1", "decode", "127.0.0.1:8201", "true",
                           '"free_blocks":64,"total_blocks":64,')})
    (?=.*${\ main::node_re("prefill-0", "prefill", "127.0.0.1:8100", "true",
                           '"free_blocks":64,"total_blocks":64,')})
    (?=.*"nodes_alive":4,"requests":0,)/sx
--- error_log eval
qr/dpd_state: using table ".*router-0\.state" \(writer pid \d+/
--- no_error_log
[alert]
[crit]
no readiness information



=== TEST 2: $dpd_kv_nodes_alive counts them
--- http_config
    dpd_state_table $TEST_NGINX_STATE check=100ms stale=2s;
--- config
    location = /alive { return 200 "alive=$dpd_kv_nodes_alive\n"; }
--- request
GET /alive
--- response_body
alive=4



=== TEST 3: a reservation on decode-0 shows in $dpd_kv_state
--- init
my $rep = KvAgentTest::api($main::DEC[0], { verb => "reserve", req_id => "req-state-1",
                              nblocks => 4 });
die "reserve failed: " . KvAgentTest::json_enc($rep) unless $rep && $rep->{ok};
main::router_wait(sub { grep { $_->{req_id} eq "req-state-1" }
                        @{ $_[0]{requests} // [] } }, 5)
    or die "router never mirrored req-state-1";
sleep 0.2;
--- http_config
    dpd_state_table $TEST_NGINX_STATE check=100ms;
--- config
    location = /kv { return 200 "state=$dpd_kv_state\n"; }
    location = /state { dpd_state_status; }
--- request eval
["GET /kv", "GET /kv", "GET /kv", "GET /state"]
--- more_headers eval
["X-Request-Id: req-state-1", "X-Request-Id: req-state-2", "",
 "X-Request-Id: req-state-1"]
--- response_body_like eval
["^state=reserved\n\\z", "^state=none\n\\z", "^state=\n\\z",
 qr/"requests":1,"requests_by_state":\{"reserved":1,"transferring":0,/
 . qr/"ready":0,"failed":0\}/]
--- no_error_log
[alert]
[crit]



=== TEST 4: the C API: one node by its vLLM address, one request by id
--- http_config
    dpd_state_table $TEST_NGINX_STATE check=100ms;
--- config
    location = /state { dpd_state_status; }
--- request eval
["GET /state?addr=127.0.0.1:8200", "GET /state?addr=127.0.0.1%3A8201",
 "GET /state?addr=127.0.0.1:9999", "GET /state?req=req-state-1",
 "GET /state?req=req-state-2"]
--- error_code eval
[200, 200, 404, 200, 404]
--- response_body_like eval
[qr/^\{"id":"decode-0","role":"decode","http":"127.0.0.1:8200","self":false,"alive":true,"heartbeat_age_ms":\d+,"free_blocks":60,"total_blocks":64,"block_bytes":32768,"inflight":0\}\n\z/,
 qr/^\{"id":"decode-1","role":"decode","http":"127.0.0.1:8201",/,
 qr/^\{"ok":false,"error":"unknown node"\}\n\z/,
 qr/^\{"state":"reserved",.*"node":"decode-0"/,
 qr/^\{"ok":false,"error":"unknown request"\}\n\z/]



=== TEST 5: a push from prefill-0 to decode-0: ready, with its bytes
--- init
my $rep = KvAgentTest::api($main::PRE, { verb => "push",
    req_id => "req-push-1", peer => "decode-0", src => [0 .. 7] });
die "push failed: " . KvAgentTest::json_enc($rep) unless $rep && $rep->{ok};
$rep = KvAgentTest::api($main::DEC[0], { verb => "wait",
    req_id => "req-push-1", timeout_ms => 10000 });
die "not ready: " . KvAgentTest::json_enc($rep)
    unless $rep && ($rep->{state} // "") eq "ready";
main::router_wait(sub { grep { $_->{req_id} eq "req-push-1"
                               && $_->{state} eq "ready" }
                        @{ $_[0]{requests} // [] } }, 5)
    or die "router never mirrored req-push-1 ready";
sleep 0.2;
--- http_config
    dpd_state_table $TEST_NGINX_STATE check=100ms;
--- config
    location = /kv { return 200 "state=$dpd_kv_state\n"; }
    location = /state { dpd_state_status; }
--- request eval
["GET /kv", "GET /state?req=req-push-1", "GET /state"]
--- more_headers eval
["X-Request-Id: req-push-1", "", ""]
--- response_body_like eval
["^state=ready\n\\z",
 qr/^\{"state":"ready","bytes_done":262144,"bytes_total":262144,"nblocks":8,
     "t_reserved_ms":\d+,"t_start_ms":[1-9]\d*,"t_done_ms":[1-9]\d*,
     "error":0,"node":"decode-0","peer":"prefill-0"\}\n\z/x,
 qr/"requests":2,"requests_by_state":\{"reserved":1,"transferring":0,"ready":1,/]



=== TEST 6: decode-1 killed: dead within dead_after_ms (600 ms)
--- init
KvAgentTest::stop_agent($main::DEC[1], 'KILL');
# dead_after 600 ms + one heartbeat + nginx's check interval, with margin
sleep 1.2;
--- http_config
    dpd_state_table $TEST_NGINX_STATE check=100ms;
--- config
    location = /state { dpd_state_status; }
    location = /alive { return 200 "alive=$dpd_kv_nodes_alive\n"; }
--- request eval
["GET /state", "GET /alive"]
--- response_body_like eval
[qr/^(?=.*${\ main::node_re("decode-1", "decode", "127.0.0.1:8201",
                             "false", '')})
     (?=.*${\ main::node_re("decode-0", "decode", "127.0.0.1:8200",
                             "true", '')})
     (?=.*"nodes_alive":3,)/sx,
 "alive=3\n"]
--- no_error_log
[alert]
[crit]



=== TEST 7: router killed (SIGKILL): the table goes stale, nothing alive
--- init
KvAgentTest::stop_agent($main::ROUTER, 'KILL');
sleep 1.5;
--- http_config
    dpd_state_table $TEST_NGINX_STATE check=100ms stale=1s;
--- config
    location = /state { dpd_state_status; }
    location = /alive { return 200 "alive=$dpd_kv_nodes_alive\n"; }
--- request eval
["GET /state", "GET /alive"]
--- response_body_like eval
[qr/^(?=.*"ok":true,)(?=.*"writer_alive":true,"stale":true,)
     (?=.*${\ main::node_re("decode-0", "decode", "127.0.0.1:8200",
                             "false", '')})
     (?=.*"nodes_alive":0,)/sx,
 "alive=0\n"]
--- no_error_log
[alert]
[crit]



=== TEST 8: router restarted: nginx maps the new file (new writer pid)
--- init
$main::OLD_PID = $main::ROUTER->{pid} || 0;
$main::ROUTER = KvAgentTest::start_agent($main::ROUTER_CFG);
main::router_wait(sub { grep { $_->{id} eq "decode-0" && $_->{alive} }
                        @{ $_[0]{nodes} // [] } }, 10)
    or die "restarted router never saw decode-0";
sleep 0.3;
--- http_config
    dpd_state_table $TEST_NGINX_STATE check=100ms stale=1s;
--- config
    location = /state { dpd_state_status; }
--- request
GET /state
--- response_body_filters eval
sub {
    my ($b) = @_;
    my ($pid) = $b =~ /"writer_pid":(\d+),/;
    return "no writer_pid: $b" unless $pid;
    return "old writer $pid: $b" unless $pid == $main::ROUTER->{pid};
    return $b;
}
--- response_body_like eval
qr/^(?=.*"writer_alive":true,"stale":false,)
    (?=.*${\ main::node_re("decode-0", "decode", "127.0.0.1:8200",
                            "true", '')})
    (?=.*"nodes_alive":3,)/sx
--- no_error_log
[alert]
[crit]
