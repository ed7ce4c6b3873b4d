# ngx_http_dpd_state_module with a master and two workers: each worker maps
# the table itself (init_process) and each one follows the agent's restart
# (new file by rename) on its own.
use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/kv_agent";
use Test::Nginx::Socket;
use Time::HiRes qw(sleep time);
use KvAgentTest;

plan(skip_all => 'build/kv_agent not built') unless -x kv_bin();
plan('no_plan');   # after the skip checks: a skip must not plan twice

my $base = $ENV{DPD_STATE_PORT_BASE} // 18700;

our $CFG = agent_config(id => "router-7", role => "router",
                        port => $base + 20);
our $AGENT = start_agent($CFG);
die "router-7 did not start" unless -s $CFG->{state_path};

$ENV{TEST_NGINX_STATE} = $CFG->{state_path};

# every response names the current writer, whichever worker answered
sub current_writer {
    my ($b) = @_;
    my ($pid) = $b =~ /"writer_pid":(\d+),/;
    return "no writer_pid: $b" unless $pid;
    return "writer $pid, want $main::AGENT->{pid}: $b"
        unless $pid == $main::AGENT->{pid};
    return $b;
}

master_on();
workers(2);
no_shuffle();
log_level('info');
run_tests();

__DATA__

=== TEST 1: both workers answer from the table
--- http_config
    dpd_state_table $TEST_NGINX_STATE check=50ms;
--- config
    location = /state { dpd_state_status; }
--- request eval
[("GET /state") x 8]
--- response_body_filters eval
\&main::current_writer
--- response_body_like eval
[(qr/"ok":true,.*\{"id":"router-7","role":"router","http":"","self":true,"alive":true,/) x 8]
--- no_error_log
[alert]
[crit]
no readiness information



=== TEST 2: agent restarted: every worker maps the new file
--- init
KvAgentTest::stop_agent($main::AGENT, 'TERM');
$main::AGENT = KvAgentTest::start_agent($main::CFG);
sleep 0.3;
--- http_config
    dpd_state_table $TEST_NGINX_STATE check=50ms;
--- config
    location = /state { dpd_state_status; }
--- request eval
[("GET /state") x 8]
--- response_body_filters eval
\&main::current_writer
--- response_body_like eval
[(qr/"ok":true,"generation":\d+,"writer_pid":\d+,"writer_alive":true,/) x 8]
--- no_error_log
[alert]
[crit]
