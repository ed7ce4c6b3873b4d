# The readiness table changed under a running nginx in every way an
# operator or a script can: truncated to 0 bytes and to the middle of a
# record in place (same inode), overwritten with garbage in place, replaced
# by garbage, deleted, and a good table copied back over it ("cp", same
# inode).  No worker may die (a read of a mapping cut short is SIGBUS; in
# the balancer it happened under the upstream's peers lock, and the
# respawned worker then spun on that lock forever), every request is
# answered, lookups answer "unknown" (usable) while the table is bad, and
# the readiness comes back once a good table is there again.
#
# The table marks peer B1 alive and B2 dead, so with a good table every
# request goes to B1.  A small HTTP server forked here performs the file
# operations when nginx proxies /op/NAME to it, so each block runs its
# whole sequence against one nginx (also under valgrind).
use strict;
use warnings;

use Test::Nginx::Socket;
use IO::Socket::INET;
use POSIX ();
use Time::HiRes qw(sleep);
use File::Temp qw(tempdir);
use DPD::StateTable;

plan('no_plan');

my $base = $ENV{DPD_STATE_PORT_BASE} // 18700;
$ENV{TEST_NGINX_B1} = $base + 40;
$ENV{TEST_NGINX_B2} = $base + 41;
$ENV{TEST_NGINX_CTL} = $base + 42;

our $dir = tempdir('dpd-311-XXXXXX', TMPDIR => 1, CLEANUP => 1);
$ENV{TEST_NGINX_STATE} = "$dir/state";

# 64 node slots: the two peers sit in slots 30 and 31, past the first
# two pages of the file, so a cut to the middle of record 20 (offset
# 6160) removes the pages holding them
my $good = DPD::StateTable::build(
    max_nodes => 64, max_reqs => 256, self_id => 'router-0',
    nodes => [
        { slot => 0, id => 'router-0', role => 'router', self => 1,
          alive => 1 },
        { slot => 30, id => 'decode-1', http => "127.0.0.1:$ENV{TEST_NGINX_B1}",
          alive => 1, free => 60, total => 64 },
        { slot => 31, id => 'decode-2', http => "127.0.0.1:$ENV{TEST_NGINX_B2}",
          alive => 0, free => 64, total => 64 },
    ],
    reqs => [ { id => 'req-1', state => 'ready', node => 'decode-1' } ]);

our $MID = DPD::StateTable::node_offset(20) + 144;

srand(11);
my $garbage = join '', map { chr(int(rand(256))) } 1 .. length $good;

sub op {
    my ($name, $arg) = @_;
    my $path = $ENV{TEST_NGINX_STATE};
    if ($name eq 'good') {             # cp good over the file
        DPD::StateTable::write_in_place($path, $good);
    } elsif ($name eq 'rename') {      # the agent's way
        DPD::StateTable::write_file($path, $good);
    } elsif ($name eq 'zero') {
        truncate $path, 0 or die "truncate: $!";
    } elsif ($name eq 'mid') {
        truncate $path, $MID or die "truncate: $!";
    } elsif ($name eq 'garbage') {     # same inode, same size
        DPD::StateTable::write_in_place($path, $garbage);
    } elsif ($name eq 'garbage_rename') {
        DPD::StateTable::write_file($path, $garbage);
    } elsif ($name eq 'delete') {
        unlink $path or die "unlink: $!";
    } elsif ($name eq 'wait') {        # longer than check=
        sleep(($arg // 1500) / 1000);
    } else {
        return;
    }
    return "ok $name\n";
}

# the operations server: one request per connection
our $CTL_PID;
{
    my $srv = IO::Socket::INET->new(LocalAddr => '127.0.0.1',
                                    LocalPort => $ENV{TEST_NGINX_CTL},
                                    Listen => 16, ReuseAddr => 1)
        or die "ctl server: $!";
    $CTL_PID = fork() // die "fork: $!";
    if ($CTL_PID == 0) {
        while (my $c = $srv->accept) {
            my $line = <$c> // '';
            while (my $h = <$c>) { last if $h =~ /^\r?\n$/ }
            my ($name, $arg) = $line =~ m{^GET /op/(\w+)(?:\?ms=(\d+))? };
            my $body = eval { $name && op($name, $arg) };
            my $st = defined $body ? '200 OK' : '500 Bad';
            $body //= "failed: " . ($@ || "unknown op") . "\n";
            print $c "HTTP/1.0 $st\r\nContent-Length: " . length($body)
                   . "\r\nConnection: close\r\n\r\n$body";
            close $c;
        }
        POSIX::_exit(0);
    }
    close $srv;
}

END {
    local $?;    # waitpid must not change the exit status
    if ($CTL_PID) { kill 'KILL', $CTL_PID; waitpid($CTL_PID, 0) }
}

add_block_preprocessor(sub {
    my $block = shift;
    DPD::StateTable::write_file($ENV{TEST_NGINX_STATE}, $good);
    $block->set_value('no_error_log',
                      "[alert]\n[crit]\nexited on signal\n[emerg]");
    $block->set_value('timeout', 10) unless defined $block->timeout;
});

# request name -> [request, more_headers, code, body pattern]
my $B1 = qr/^B1\n\z/;
my $ANY = qr/^B[12]\n\z/;
my %R = (
    t     => ['GET /t', '', 200, $ANY],
    t1    => ['GET /t', '', 200, $B1],
    ready => ['GET /v', 'X-Request-Id: req-1', 200,
              qr/^kv=ready alive=2\n\z/],
    kv    => ['GET /v', 'X-Request-Id: req-1', 200,
              qr/^kv=(?:unknown|none|ready|) alive=\d*\n\z/],
    ok    => ['GET /state', '', 200, qr/^\{"table":"[^"]+","ok":true,/],
);

sub seq {
    my @req;
    for my $s (@_) {
        if (ref $s) {                    # [503, qr/reason/]
            push @req, ['GET /state', '', $s->[0], $s->[1]];
        } elsif ($s =~ m{^/op/}) {
            push @req, ["GET $s", '', 200, qr/^ok /];
        } else {
            push @req, $R{$s} // die "no request $s";
        }
    }
    return \@req;
}

our @SEQ1 = @{ seq(
    qw(t1 t1 ready ok),
    # truncate to 0 bytes in place, then a request at once
    qw(/op/zero t t kv /op/wait t t kv),
    [503, qr/"ok":false,"error":"truncated \(0 bytes\)"/],
    # cp the good table back: readiness returns
    qw(/op/good /op/wait t1 t1 ready ok),
    # cut in the middle of a record
    qw(/op/mid t t kv /op/wait t t kv),
    [503, qr/"error":"truncated \(${\ $main::MID} of \d+ bytes\)"/],
    qw(/op/good /op/wait t1 ready),
    # garbage in place, same size
    qw(/op/garbage t t kv /op/wait t t kv),
    [503, qr/"error":"corrupt \(bad magic\)"/],
    qw(/op/good /op/wait t1 ready),
    # deleted
    qw(/op/delete t t kv /op/wait t t kv),
    [503, qr/"error":"missing \(No such file or directory\)"/],
    # a new file appears with cp
    qw(/op/good /op/wait t1 t1 ready ok),
    # replaced by garbage (rename), then by a good table (rename)
    qw(/op/garbage_rename t kv /op/wait t kv),
    [503, qr/"error":"corrupt \(bad magic\)"/],
    qw(/op/rename /op/wait t1 t1 ready ok),
) };

# check=1h: nginx never looks at the file again after start-up, so every
# lookup after the cut reads what the worker holds (the old code's mapping
# faulted here every time)
our @SEQ2 = @{ seq(qw(t1 ready /op/zero t t kv t kv /op/good /op/mid
                      t t kv t kv /op/garbage t kv /op/delete t kv)) };

master_on();
workers(1);
no_shuffle();
log_level('notice');
run_tests();

__DATA__

=== TEST 1: truncate, cut, scribble, delete, restore (check=1s): no worker dies, readiness returns
--- http_config
    dpd_state_table $TEST_NGINX_STATE check=1s stale=0;
    upstream pool {
        dpd_balance;
        zone pool 64k;
        server 127.0.0.1:$TEST_NGINX_B1;
        server 127.0.0.1:$TEST_NGINX_B2;
    }
    server {
        listen 127.0.0.1:$TEST_NGINX_B1;
        location / { return 200 "B1\n"; }
    }
    server {
        listen 127.0.0.1:$TEST_NGINX_B2;
        location / { return 200 "B2\n"; }
    }
--- config
    location = /t { proxy_pass http://pool; }
    location /op/ { proxy_pass http://127.0.0.1:$TEST_NGINX_CTL; }
    location = /state { dpd_state_status; }
    location = /v {
        return 200 "kv=$dpd_kv_state alive=$dpd_kv_nodes_alive\n";
    }
--- request eval
[map { $_->[0] } @main::SEQ1]
--- more_headers eval
[map { $_->[1] } @main::SEQ1]
--- error_code eval
[map { $_->[2] } @main::SEQ1]
--- response_body_like eval
[map { $_->[3] } @main::SEQ1]
--- timeout: 20



=== TEST 2: the same cuts while the worker never re-reads the file (check=1h)
--- http_config
    dpd_state_table $TEST_NGINX_STATE check=1h stale=0;
    upstream pool {
        dpd_balance;
        zone pool 64k;
        server 127.0.0.1:$TEST_NGINX_B1;
        server 127.0.0.1:$TEST_NGINX_B2;
    }
    server {
        listen 127.0.0.1:$TEST_NGINX_B1;
        location / { return 200 "B1\n"; }
    }
    server {
        listen 127.0.0.1:$TEST_NGINX_B2;
        location / { return 200 "B2\n"; }
    }
--- config
    location = /t { proxy_pass http://pool; }
    location /op/ { proxy_pass http://127.0.0.1:$TEST_NGINX_CTL; }
    location = /v {
        return 200 "kv=$dpd_kv_state alive=$dpd_kv_nodes_alive\n";
    }
--- request eval
[map { $_->[0] } @main::SEQ2]
--- more_headers eval
[map { $_->[1] } @main::SEQ2]
--- error_code eval
[map { $_->[2] } @main::SEQ2]
--- response_body_like eval
[map { $_->[3] } @main::SEQ2]
