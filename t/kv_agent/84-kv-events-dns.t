#!/usr/bin/perl
# "kv_events" sources given as a DNS name (kv_agent/src/kv_events_dns.c),
# as a Kubernetes headless Service gives one address per ready pod: three
# emulator "pods" (tools/vllm_emu.py on 127.0.0.2, .3, .4, each binding
# the same publisher, replay and HTTP ports on its own address) behind a
# name the test points at two of them, then three, then one, by rewriting
# a private /etc/hosts (a mount namespace: glibc reads /etc/hosts on each
# getaddrinfo() and returns every line's address of a name).  Checked in
# the index nginx reads (tools/prefix_index.py nodes): the new pod's
# blocks appear under "ADDRESS:http_port", a pod that stays is never
# cleared, the gone pods' records are released; a name that stops
# resolving keeps the last good set (one warning); a second name with an
# address already followed subscribes nothing twice (nor one that is a
# static source); 100 addresses fill the 64 sources, no more; an IPv6
# address is node "[::1]:port"; a name whose DNS
# server never answers (a UDP black hole in /etc/resolv.conf) neither
# stalls the loop nor delays the shutdown (a small UDP responder in
# /etc/resolv.conf: NXDOMAIN for other names).
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use KvAgentTest;
use IO::Socket::INET;
use Time::HiRes qw(sleep time);

my $py = ($ENV{DPD_VENV} // kv_root() . "/.venv") . "/bin/python";
my $emu = $ENV{DPD_EMU} // kv_root() . "/tools/vllm_emu.py";
my $pidx = kv_root() . "/tools/prefix_index.py";
plan skip_all => "build/kv_agent not built" unless -x kv_bin();
plan skip_all => "no Python venv with pyzmq ($py)"
    unless -x $py && system("$py -c 'import zmq' 2>/dev/null") == 0;
plan skip_all => "the emulator cannot bind one pod's address"
    unless -f $emu && `$py $emu --help 2>&1` =~ /--kv-events-bind-host/;

# a private /etc/hosts needs a mount namespace of our own
if (!$ENV{KV_DNS_TEST_NS}) {
    plan skip_all => "not root: no mount namespace for a private "
                     . "/etc/hosts" if $> != 0;
    plan skip_all => "unshare -m is not allowed here"
        unless system("unshare -m --propagation private true "
                      . "2>/dev/null") == 0;
    $ENV{KV_DNS_TEST_NS} = 1;
    exec "unshare", "-m", "--propagation", "private", $^X,
         (map { "-I$_" } grep { !ref } @INC), $0;
    die "exec unshare: $!";
}

my $dir = kv_tmpdir();
my $hosts = "$dir/hosts";
my $resolv = "$dir/resolv.conf";

sub put {
    my ($f, $text) = @_;
    # in place: the bind mount is of this inode
    my $fh;
    open($fh, '+<', $f) or open($fh, '>', $f) or die "$f: $!";
    truncate $fh, 0;
    syswrite $fh, $text;
    close $fh;
}

put($hosts, "127.0.0.1 localhost\n");
put($resolv, "nameserver 127.0.0.53\noptions timeout:30 attempts:3\n");
system("mount --bind $hosts /etc/hosts") == 0
    or plan skip_all => "cannot bind-mount /etc/hosts";
system("mount --bind $resolv /etc/resolv.conf") == 0
    or plan skip_all => "cannot bind-mount /etc/resolv.conf";

sub point {
    my ($name, @last) = @_;
    my $t = "127.0.0.1 localhost\n::1 v6.test\n";
    $t .= join "", map { "127.0.0.$_ $name\n" } @last;
    # another name for one of them: already followed, never twice
    $t .= "127.0.0.$last[0] alias.test\n" if @last;
    put($hosts, $t);
}

# the resolver's DNS server: NXDOMAIN for every name but hang.test,
# whose queries it reads and never answers
my $hole = fork // die;
if ($hole == 0) {
    exec $py, "-c", 'import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.53", 53))
while True:
    q, peer = s.recvfrom(2048)
    if len(q) < 12 or b"\x04hang\x04test\x00" in q.lower():
        continue
    end = q.find(b"\x00", 12) + 5
    # the question echoed, QR + RD + RA, RCODE 3 (NXDOMAIN)
    s.sendto(q[:2] + bytes([0x81, 0x83, 0, 1]) + bytes(6) + q[12:end],
             peer)
' or exit 127;
}

my $hp = kv_port(960);
my ($pp, $rp) = ($hp + 1, $hp + 2);
my @emu;

sub http_post {
    my ($host, $path, $body) = @_;
    my $s = IO::Socket::INET->new(PeerAddr => "$host:$hp", Timeout => 10)
        or return undef;
    print $s "POST $path HTTP/1.1\r\nHost: x\r\nContent-Type: "
        . "application/json\r\nContent-Length: " . length($body)
        . "\r\nConnection: close\r\n\r\n$body";
    local $/;
    my $r = <$s>;
    return $r;
}

# pods 2..4 on 127.0.0.x; pod 6 publishes on ::1 (its HTTP on 127.0.0.1:
# the emulator's server is IPv4-only; the index names it [::1]:port)
my $v6 = system("$py -c 'import socket; socket.socket(socket.AF_INET6)"
                . ".bind((\"::1\", 0))' 2>/dev/null") == 0;
for my $i (2 .. 4, $v6 ? 6 : ()) {
    my $bind = $i == 6 ? "::1" : "127.0.0.$i";
    my $host = $i == 6 ? "127.0.0.1" : "127.0.0.$i";
    my $cfg = json_enc({ enable_kv_cache_events => JSON::PP::true,
                         endpoint => "tcp://*:$pp",
                         replay_endpoint => "tcp://*:$rp",
                         topic => "kv" });
    my $pid = fork // die;
    if ($pid == 0) {
        open STDOUT, '>', "$dir/emu-$i.log" or die;
        open STDERR, '>&', \*STDOUT;
        exec $py, $emu, "--host", $host, "--port", $hp,
             "--model", "m", "--kv-events-config", $cfg,
             "--kv-events-bind-host", $bind or exit 127;
    }
    $emu[$i] = $pid;
}
for my $i (2 .. 4) {
    ok(wait_for(15, sub {
        IO::Socket::INET->new(PeerAddr => "127.0.0.$i:$hp", Timeout => 1)
    }), "pod 127.0.0.$i up");
}

my $idx = "$dir/prefix.idx";
point("pods.test", 2, 3);
my $c = agent_config(id => "router-0", role => "router",
                     port => kv_port(950));
$c->{kv_events} = [
    { dns => "pods.test", port => $pp, replay_port => $rp,
      http_port => $hp, topic => "kv", model => "m", resolve_ms => 300 },
    # one of the same pods under another name: not subscribed twice
    { dns => "alias.test", port => $pp, http_port => $hp, topic => "kv",
      model => "m", resolve_ms => 300 },
    # a static source: an address of the name that is already one is
    # not subscribed twice
    { node => "static-5", http => "127.0.0.5:$hp", model => "m",
      endpoint => "tcp://127.0.0.5:$pp", topic => "kv" },
    # IPv6: the node is [ADDRESS]:http_port
    { dns => "v6.test", family => "ipv6", port => $pp, replay_port => $rp,
      http_port => $hp, topic => "kv", model => "m", resolve_ms => 300 },
    # no answer ever (the black hole): the loop goes on without it
    { dns => "hang.test", port => $pp, http_port => $hp, model => "m",
      resolve_ms => 300 },
];
$c->{prefix_index} = { path => $idx, slots => 65536 };
my $a = start_agent($c);
ok(agent_alive($a), "the agent runs") or diag log_text($a);

# the index's nodes by http, the static source's left out
sub nodes {
    my %n;
    for (`$py $pidx nodes $idx 2>/dev/null`) {
        my $r = json_dec($_);
        $n{$r->{http}} = $r if $r->{http} =~ /^127\.0\./
                               && $r->{id} ne 'static-5';
    }
    return \%n;
}

sub prompt {
    my ($i, $tag) = @_;
    my $p = join ' ', map { "$tag$_" } 1 .. 120;
    return http_post("127.0.0.$i", "/v1/completions",
                     json_enc({ model => "m", prompt => $p,
                                max_tokens => 2 }));
}

my ($A, $B, $C) = map { "127.0.0.$_:$hp" } 2 .. 4;

# two pods: both subscribed, each pod's blocks under its own address
ok(log_wait($a, qr/subscribed to tcp:\/\/127\.0\.0\.2:$pp.*\n(?s:.*)subscribed to tcp:\/\/127\.0\.0\.3:$pp/, 10),
   "two addresses, two sources") or diag log_text($a);
sleep 0.5;
prompt(2, "alpha");
prompt(3, "beta");
my $n = wait_for(10, sub {
    my $n = nodes();
    ($n->{$A} && $n->{$A}{blocks} > 0 && $n->{$B} && $n->{$B}{blocks} > 0)
        ? $n : undef });
ok($n, "both pods' blocks are in the index") or diag explain nodes();
is(scalar(keys %{ $n // {} }), 2, "two nodes (alias.test's address is "
   . "already followed)");
is($n->{$A}{id}, $A, "node id = ADDRESS:http_port, as nginx names the peer")
    if $n;
my %before = map { $_ => $n->{$_}{epoch} } keys %{ $n // {} };

# three pods: the new one's blocks appear; the others are untouched
point("pods.test", 2, 3, 4);
ok(log_wait($a, qr/subscribed to tcp:\/\/127\.0\.0\.4:$pp/, 5),
   "the third address is subscribed");
sleep 0.5;
prompt(4, "gamma");
$n = wait_for(10, sub {
    my $n = nodes();
    ($n->{$C} && $n->{$C}{blocks} > 0) ? $n : undef });
ok($n, "the new pod's blocks appear") or diag explain nodes();
is_deeply({ map { $_ => $n->{$_}{epoch} } grep { $_ ne $C } keys %$n },
          \%before, "the pods that stayed were not cleared") if $n;

# one pod: the two gone are released (after two answers without them)
point("pods.test", 4);
$n = wait_for(10, sub {
    my $n = nodes();
    (!$n->{$A} && !$n->{$B} && $n->{$C}) ? $n : undef });
ok($n, "the gone pods' nodes are released") or diag explain nodes();
ok($n && $n->{$C}{blocks} > 0 && $n->{$C}{bits} > 0,
   "the pod that stays keeps its blocks");
# (alias.test may have been first to answer with .2: then it is its)
like(log_text($a), qr/dns (pods|alias)\.test: 127\.0\.0\.2 no longer resolved: its source closed, \d+ blocks dropped/,
     "said in the log");

# a gone pod's blocks are no longer anywhere in the table
my $bits = 0;
$bits += $_->{bits} for values %{ nodes() };
is($bits, nodes()->{$C}{bits}, "only the remaining pod has slot bits");

# a pod coming back gets a node again (a fresh record or a reused one)
point("pods.test", 2, 4);
ok(log_wait($a, qr/(?s:subscribed to tcp:\/\/127\.0\.0\.2:$pp.*){2}/, 5),
   "the address that came back is subscribed again");
sleep 0.5;                             # the SUB's connection is up
prompt(2, "delta");
$n = wait_for(15, sub {
    my $n = nodes();
    ($n->{$A} && $n->{$A}{blocks} > 0) ? $n : undef });
ok($n, "a pod that comes back is indexed again") or diag explain nodes();

# the name stops resolving: the last good set stays, one warning
point("nothing.test");
sleep 2;
$n = nodes();
ok($n->{$A} && $n->{$C}, "a failing name keeps its last sources");
my @w = log_text($a) =~ /dns pods\.test: cannot resolve/g;
is(scalar(@w), 1, "one warning while it fails");
point("pods.test", 2, 4);
ok(log_wait($a, qr/dns pods\.test: resolved again/, 5),
   "recovery said");

# the static source's address in the answer: still one node, the static
# one; then 100 addresses: the lowest 64 considered, the rest said
point("pods.test", 2, 4, 5);
sleep 1.5;
my @five = grep { /"http": "127\.0\.0\.5:$hp"/ }
           `$py $pidx nodes $idx 2>/dev/null`;
is(scalar(@five), 1, "an address that is a static source: one node");
like($five[0] // '', qr/"id": "static-5"/, "... the static one");
put($hosts, join "", map { "127.0.1.$_ pods.test\n" } 1 .. 100);
ok(log_wait($a, qr/dns pods\.test: 100 addresses: only the first 64 \(sorted\) are considered/, 5),
   "a name with 100 addresses: the first 64 considered");
ok(log_wait($a, qr/dns pods\.test: \d+ addresses not followed: at most 64 sources/, 5),
   "what does not fit is said");
ok(log_wait($a, qr/dns pods\.test: 127\.0\.0\.4 no longer resolved/, 5),
   "the old pods go");
my $nn = wait_for(5, sub { my $n = nodes(); keys %$n >= 60 ? $n : undef });
ok($nn && keys %$nn <= 63, "the sources fill up to the limit, no more ("
   . scalar(keys %{ $nn // {} }) . " DNS nodes + the static one)");
ok(agent_alive($a), "the agent runs on");
# back to two pods: the 60 go, the two come back once index records are
# free again (released ones are reused 5 s later: readers may still map
# an old address to them until then)
my $mark = length log_text($a);
point("pods.test", 2, 4);
ok(wait_for(15, sub { substr(log_text($a), $mark)
                      =~ /subscribed to tcp:\/\/127\.0\.0\.4:$pp/ }),
   "back to two pods: subscribed again once records are free");
like(substr(log_text($a), $mark), qr/127\.0\.1\.1 no longer resolved/,
     "the 100-address set went");
sleep 0.5;

# the IPv6 pod, followed all along
SKIP: {
    skip "no IPv6 loopback here", 2 unless $v6;
    http_post("127.0.0.1", "/v1/completions",
              json_enc({ model => "m", max_tokens => 2,
                         prompt => join ' ', map { "six$_" } 1 .. 120 }));
    my $six = wait_for(10, sub {
        my ($l) = grep { /"http": "\[::1\]:$hp"/ }
                  `$py $pidx nodes $idx 2>/dev/null`;
        $l && json_dec($l)->{blocks} > 0 ? json_dec($l) : undef });
    ok($six, "an IPv6 address: node [::1]:$hp, its blocks indexed");
    is($six && $six->{id}, "[::1]:$hp", "... named as nginx names it");
}

# the black-holed name: timed out, the loop kept going all along
ok(log_wait($a, qr/dns hang\.test: cannot resolve: timed out/, 15),
   "a lookup that hangs times out") or diag log_text($a);
prompt(4, "epsilon");
my $b0 = nodes()->{$C}{blocks};
prompt(4, "zeta " x 40);
ok(wait_for(10, sub { nodes()->{$C}{blocks} > $b0 }),
   "events still indexed while lookups hang");

# shutdown does not wait for a thread stuck in getaddrinfo()
my $t0 = time;
my $st = stop_agent($a, 'TERM', 10);
my $dt = time - $t0;
is($st, 0, "clean exit");
cmp_ok($dt, '<', 3, sprintf("shut down in %.2f s with lookups stuck", $dt));
like(log_text($a), qr/dns pods\.test: \d+ answers, \d+ failed lookups, \d+ sources added, \d+ removed/,
     "per-name counters logged");

kill 'TERM', grep { $_ } @emu, $hole;
waitpid $_, 0 for grep { $_ } @emu, $hole;
done_testing();
