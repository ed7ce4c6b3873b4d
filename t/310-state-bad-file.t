# ngx_http_dpd_state_module with missing, truncated, corrupt and garbage
# state files, and files replaced under a running nginx: the status handler
# answers "no table" (503, ok:false, the reason), the variables are empty,
# a rate-limited warning names the reason, and nginx never crashes.
use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/kv_agent";
use Test::Nginx::Socket;
use File::Copy qw(copy);
use POSIX ();
use Time::HiRes qw(sleep time);
use KvAgentTest;
use DPD::StateTable;

plan(skip_all => 'build/kv_agent not built') unless -x kv_bin();
plan('no_plan');   # after the skip checks: a skip must not plan twice

my $base = $ENV{DPD_STATE_PORT_BASE} // 18700;
our $dir = kv_tmpdir();

# a genuine table: a router agent started and stopped (writer_alive = 0)
my $cfg = agent_config(id => "router-9", role => "router",
                       port => $base + 10);
my $agent = start_agent($cfg);
stop_agent($agent, 'TERM');

my $valid = do {
    local $/;
    open my $fh, '<:raw', $cfg->{state_path}
        or die "no table from the agent: $cfg->{state_path}: $!";
    <$fh>;
};
die "agent wrote a short table" unless length($valid) > 4096;

sub put {
    my ($name, $bytes) = @_;
    my $path = "$dir/$name";
    open my $fh, '>:raw', $path or die "$path: $!";
    print $fh $bytes;
    close $fh;
    return $path;
}

# header fields (dpd_state.h): magic@0 version@8 ... nodes_off@32
# reqs_off@40 file_size@48
sub patch {
    my ($off, $fmt, @val) = @_;
    my $b = $valid;
    my $packed = pack($fmt, @val);
    substr($b, $off, length $packed) = $packed;
    return $b;
}

srand(7);
my $garbage = join '', map { chr(int(rand(256))) } 1 .. 65536;

put("valid", $valid);
put("empty", "");
put("short", substr($valid, 0, 100));
put("cut", substr($valid, 0, 4096));
put("magic", patch(0, "C", 0x00));
put("version", patch(8, "V", 2));
put("reqs_off", patch(40, "VV", 0xFFFF_FF00, 0xFFFF_FFFF));
put("max_nodes", patch(24, "V", 0xFFFF_FFFF));
put("garbage", $garbage);
put("garbage_hdr", substr($valid, 0, 12) . substr($garbage, 12));
mkdir "$dir/dir";
put("many_nodes", DPD::StateTable::build(max_nodes => 65537, max_reqs => 16));
# three records of one address: a dead one first, then two alive ones
put("same_addr", DPD::StateTable::build(nodes => [
    { id => 'old-0', http => '127.0.0.1:8200', alive => 0 },
    { id => 'new-0', http => '127.0.0.1:8200', alive => 1 },
    { id => 'new-1', http => '127.0.0.1:8200', alive => 1 },
    { id => 'other', http => '127.0.0.1:8201', alive => 0 }]));

$ENV{TEST_NGINX_STATE_DIR} = $dir;

# mutants: the valid table with random bytes changed in the header and in
# the records (strings without NUL, odd flags, huge counts, torn seqs)
my @mutants;
for my $k (0 .. 39) {
    my $b = $valid;
    for (1 .. 1 + $k % 6) {
        my $off = $k % 2 ? int(rand(256)) : int(rand(length $b));
        substr($b, $off, 1) = chr(int(rand(256)));
    }
    push @mutants, put("mutant$k", $b);
}

# for a few seconds, keeps replacing "churn" by mutants (rename) and
# scribbling over its records in place (same inode and size)
our $CHURN_PID;
sub churn {
    my ($secs) = @_;
    copy($mutants[0], "$dir/churn") or die "copy: $!";
    $CHURN_PID = fork() // die "fork: $!";
    return if $CHURN_PID;
    my $end = time + $secs;
    my $i = 0;
    while (time < $end) {
        if ($i++ % 3) {
            if (open my $fh, '+<:raw', "$dir/churn") {
                seek $fh, 256 + int(rand(length($valid) - 512)), 0;
                print $fh join '', map { chr(int(rand(256))) } 1 .. 64;
                close $fh;
            }
        } else {
            copy($mutants[int(rand(@mutants))], "$dir/churn.tmp");
            rename "$dir/churn.tmp", "$dir/churn";
        }
        sleep 0.005;
    }
    POSIX::_exit(0);
}

END { if ($CHURN_PID) { kill 'KILL', $CHURN_PID; waitpid($CHURN_PID, 0) } }

# rename() over the watched path, as the agent does
sub replace_with {
    my ($src) = @_;
    copy("$dir/$src", "$dir/live.tmp") or die "copy: $!";
    rename("$dir/live.tmp", "$dir/live") or die "rename: $!";
}

add_block_preprocessor(sub {
    my $block = shift;
    $block->set_value("no_error_log", "[alert]\n[crit]\nsignal")
        unless defined $block->no_error_log || defined $block->must_die;
});

no_shuffle();
check_accum_error_log();
log_level('info');
run_tests();

__DATA__

=== TEST 1: missing file: 503 with the reason, warned once
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/none check=1ms;
--- config
    location = /state { dpd_state_status; }
--- request eval
["GET /state", "GET /state", "GET /state"]
--- error_code eval
[503, 503, 503]
--- response_body_like eval
[(qr/^\{"table":"[^"]+\/none","ok":false,"error":"missing \(No such file or directory\)","nodes":\[\],"requests":0\}$/) x 3]
--- grep_error_log eval
qr/dpd_state: table "[^"]+" missing \(No such file or directory\): no readiness information/
--- grep_error_log_out eval
qr/\A[^\n]+\n\z/



=== TEST 2: missing file: variables are empty
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/none;
--- config
    location = /v {
        return 200 "kv=$dpd_kv_state alive=$dpd_kv_nodes_alive\n";
    }
--- request
GET /v
--- more_headers
X-Request-Id: abc
--- response_body
kv= alive=



=== TEST 3: empty file
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/empty;
--- config
    location = /state { dpd_state_status; }
--- request
GET /state
--- error_code: 503
--- response_body_like chomp
"ok":false,"error":"truncated \(0 bytes\)"
--- error_log
empty" truncated (0 bytes): no readiness information



=== TEST 4: file shorter than the header
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/short;
--- config
    location = /state { dpd_state_status; }
--- request
GET /state
--- error_code: 503
--- response_body_like chomp
"error":"truncated \(100 bytes\)"
--- error_log
short" truncated (100 bytes): no readiness information



=== TEST 5: header intact, records cut off
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/cut;
--- config
    location = /state { dpd_state_status; }
--- request
GET /state
--- error_code: 503
--- response_body_like chomp
"error":"truncated \(4096 of \d+ bytes\)"
--- error_log eval
qr/cut" truncated \(4096 of \d+ bytes\): no readiness information/



=== TEST 6: wrong magic
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/magic;
--- config
    location = /state { dpd_state_status; }
--- request
GET /state
--- error_code: 503
--- response_body_like chomp
"ok":false,"error":"corrupt \(bad magic\)"
--- error_log
magic" corrupt (bad magic): no readiness information



=== TEST 7: another ABI version
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/version;
--- config
    location = /state { dpd_state_status; }
--- request
GET /state
--- error_code: 503
--- response_body_like chomp
"error":"wrong version 2 \(want 1\)"
--- error_log
version" wrong version 2 (want 1): no readiness information



=== TEST 8: request table offset far past the end (overflowing sums)
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/reqs_off;
--- config
    location = /state { dpd_state_status; }
--- request
GET /state
--- error_code: 503
--- response_body_like chomp
"error":"corrupt \(bad sizes\)"
--- error_log
reqs_off" corrupt (bad sizes): no readiness information



=== TEST 9: node count far beyond the file
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/max_nodes;
--- config
    location = /state { dpd_state_status; }
--- request
GET /state
--- error_code: 503
--- response_body_like chomp
"error":"corrupt \(bad sizes\)"
--- error_log
max_nodes" corrupt (bad sizes): no readiness information



=== TEST 10: random bytes
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/garbage;
--- config
    location = /state { dpd_state_status; }
    location = /v {
        return 200 "kv=$dpd_kv_state alive=$dpd_kv_nodes_alive\n";
    }
--- request eval
["GET /state", "GET /v"]
--- more_headers eval
["", "X-Request-Id: abc"]
--- error_code eval
[503, 200]
--- response_body_like eval
[qr/"error":"corrupt \(bad magic\)"/, qr/^kv= alive=\n\z/]



=== TEST 11: valid magic and version over random bytes
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/garbage_hdr;
--- config
    location = /state { dpd_state_status; }
--- request
GET /state
--- error_code: 503
--- response_body_like chomp
"ok":false,"error":"(?:corrupt \(bad sizes\)|truncated \(65536 of \d+ bytes\))"



=== TEST 12: a directory
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/dir;
--- config
    location = /state { dpd_state_status; }
--- request
GET /state
--- error_code: 503
--- response_body_like chomp
"error":"not a regular file"



=== TEST 13: a table whose writer stopped: mapped, nothing alive
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/valid;
--- config
    location = /state { dpd_state_status; }
    location = /v {
        return 200 "kv=$dpd_kv_state alive=$dpd_kv_nodes_alive\n";
    }
--- request eval
["GET /state", "GET /v"]
--- more_headers eval
["", "X-Request-Id: abc"]
--- response_body_like eval
[qr/^(?=.*"ok":true,)(?=.*"writer_alive":false,)(?=.*"self":"router-9",)
     (?=.*\{"id":"router-9","role":"router","http":"","self":true,
          "alive":false,)(?=.*"nodes_alive":0,"requests":0,)/sx,
 qr/^kv=none alive=0\n\z/]



=== TEST 14: the file appears while nginx runs
--- init
unlink "$main::dir/live";
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/live check=50ms;
--- config
    location = /state { dpd_state_status; }
--- request
GET /state
--- error_code: 503
--- response_body_like chomp
"error":"missing



=== TEST 15: ... and is picked up (nginx started without it)
--- init
main::replace_with("valid");
sleep 0.2;
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/live check=50ms;
--- config
    location = /state { dpd_state_status; }
--- request
GET /state
--- response_body_like chomp
"ok":true,.*"self":"router-9"
--- error_log eval
qr/using table "[^"]+\/live"/



=== TEST 16: replaced by garbage while mapped (nginx started on a valid file)
--- init
main::replace_with("garbage_hdr");
sleep 0.2;
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/live check=50ms;
--- config
    location = /state { dpd_state_status; }
--- request
GET /state
--- error_code: 503
--- response_body_like chomp
"error":"(?:corrupt \(bad sizes\)|truncated \(65536 of \d+ bytes\))"
--- error_log eval
qr/live" (?:corrupt \(bad sizes\)|truncated \(65536 of \d+ bytes\)): no readiness information/



=== TEST 17: replaced by a truncated copy (nginx started on garbage)
--- init
main::replace_with("cut");
sleep 0.2;
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/live check=50ms;
--- config
    location = /state { dpd_state_status; }
--- request
GET /state
--- error_code: 503
--- response_body_like chomp
"error":"truncated \(4096 of \d+ bytes\)"



=== TEST 18: ... then by a good one again (nginx started on the cut one)
--- init
main::replace_with("valid");
sleep 0.2;
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/live check=50ms;
--- config
    location = /state { dpd_state_status; }
--- request
GET /state
--- response_body_like chomp
"ok":true,.*"self":"router-9"



=== TEST 19: mutated tables replaced and scribbled on while read: no crash
--- init
main::churn(2.5);
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/churn check=1ms;
--- config
    location = /state { dpd_state_status; }
    location = /node { dpd_state_status; }
    location = /v {
        return 200 "kv=$dpd_kv_state alive=$dpd_kv_nodes_alive\n";
    }
--- request eval
[map { ("GET /state", "GET /node?addr=127.0.0.1:8200", "GET /state?req=x",
        "GET /v") } 1 .. 15]
--- more_headers eval
[map { ("", "", "", "X-Request-Id: abc") } 1 .. 15]
--- error_code_like eval
[map { (qr/^(?:200|503)$/, qr/^(?:404|503)$/, qr/^(?:404|503)$/,
        qr/^200$/) } 1 .. 15]
--- response_body_like eval
[map { (qr/^\{"table":"[^"]+","ok":(?:true|false),.*\}\n\z/s,
        qr/^\{"ok":false,"error":"(?:no table|unknown node)"\}\n\z/,
        qr/^\{"ok":false,"error":"(?:no table|unknown request)"\}\n\z/,
        qr/^kv=(?:none|unknown|) alive=\d*\n\z/) } 1 .. 15]
--- no_error_log
[alert]
[crit]
signal



=== TEST 20: no dpd_state_table: the handler says so
--- config
    location = /state { dpd_state_status; }
    location = /v {
        return 200 "kv=$dpd_kv_state alive=$dpd_kv_nodes_alive\n";
    }
--- request eval
["GET /state", "GET /v"]
--- error_code eval
[503, 200]
--- response_body eval
["{\"table\":null,\"ok\":false,\"error\":\"no dpd_state_table configured\",\"nodes\":[],\"requests\":0}\n",
 "kv= alive=\n"]



=== TEST 21: unknown parameter
--- http_config
    dpd_state_table /dev/shm/x stale=1s bogus=1;
--- config
--- must_die
--- error_log
[emerg]
invalid parameter "bogus=1"



=== TEST 22: bad time
--- http_config
    dpd_state_table /dev/shm/x check=soon;
--- config
--- must_die
--- error_log
[emerg]
invalid parameter "check=soon"



=== TEST 23: duplicate
--- http_config
    dpd_state_table /dev/shm/x;
    dpd_state_table /dev/shm/y;
--- config
--- must_die
--- error_log
[emerg]
"dpd_state_table" directive is duplicate



=== TEST 24: more node records than any agent writes
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/many_nodes;
--- config
    location = /state { dpd_state_status; }
--- request
GET /state
--- error_code: 503
--- response_body_like chomp
"ok":false,"error":"too many nodes \(65537, at most 65536\)"



=== TEST 25: several records of one address: the first alive one answers
--- http_config
    dpd_state_table $TEST_NGINX_STATE_DIR/same_addr stale=0;
--- config
    location = /state { dpd_state_status; }
--- request eval
["GET /state?addr=127.0.0.1:8200", "GET /state?addr=127.0.0.1:8201",
 "GET /state?addr=127.0.0.1:8202"]
--- error_code eval
[200, 200, 404]
--- response_body_like eval
[qr/^\{"id":"new-0",.*"alive":true,/, qr/^\{"id":"other",.*"alive":false,/,
 qr/^\{"ok":false,"error":"unknown node"\}$/]
