#!/usr/bin/perl
# Peers found from DNS answers (issue 24 item 3, "peers_dns"): a pool's
# pods behind one name, as a Kubernetes headless Service answers, with
# real agents on 127.0.0.x.  The test's DNS is /etc/hosts: inside a mount
# namespace of its own a temp file is bind-mounted over it (and over
# /etc/host.conf, "multi on": every line of a name is answered) and
# rewritten in place; glibc reads it again at every lookup.
# /etc/resolv.conf names a server that never answers, so any other name
# hangs the way a slow cluster DNS does.
#  * a prefill node discovers the decode pool by name: links up both ways,
#    visible in the API's peers (discovered) and in its state table;
#  * scale up: a new address in the answer -> a new peer, no restart;
#  * scale down: an address gone from the answer -> peer dropped: link
#    closed, gone from the API and from the state table;
#  * an impostor at an answered address that claims a real id without the
#    link's key is refused, and so is one with no key file for its id;
#    ids with '/' or '..' are refused before any hello is sent;
#  * a claim of an id linked at another address is refused;
#  * a decode node refuses a proven prefill its answers do not list, and
#    accepts it (inbound first) as soon as they do;
#  * a pod back at another address keeps its id, link and record;
#  * at most 64 peers, configured ones included, with a clear line;
#  * a configured peer named by DNS links (resolved off the loop), and the
#    pool's answer naming it does not make a second one;
#  * while a peer's "ctrl" name hangs in the resolver, the loop answers
#    the API at once (before: one blocking getaddrinfo per reconnect).
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use Time::HiRes qw(time sleep);
use IO::Socket::INET;
use Socket ();
use POSIX ();
use KvAgentTest;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();
plan skip_all => "libfabric tcp;ofi_rxm provider not available here"
    unless provider_ok('tcp;ofi_rxm');

# Run again inside a mount namespace of our own (and private mounts).
unless ($ENV{KV_PDNS_NS}) {
    if (system("unshare -m --propagation private true 2>/dev/null") != 0) {
        plan skip_all => "unshare -m refused here (needs CAP_SYS_ADMIN): "
                         . "no private /etc/hosts for the test's DNS";
    }
    $ENV{KV_PDNS_NS} = 1;
    { exec "unshare", "-m", "--propagation", "private", $^X,
           (map { "-I$_" } @INC), $0, @ARGV };
    die "exec unshare: $!";
}

my $dir = kv_tmpdir();
my $port = kv_port(370);
my $fake = "$FindBin::Bin/fakepeer.py";

# --- the test's DNS ----------------------------------------------------------
my $hosts = "$dir/hosts";
my $base_hosts = "127.0.0.1 localhost\n::1 localhost ip6-localhost\n";
sub set_hosts {
    my (%names) = @_;   # name => [ip, ...]
    $names{"prefill.pool.test"} //= ["127.0.0.5"];
    $names{"router.pool.test"} //= ["127.0.0.11"];
    # in place (same inode: the bind mount shows it), one write of a
    # fixed size (never truncated): a lookup never reads a file without
    # the names
    my $text = $base_hosts;
    for my $n (sort keys %names) {
        $text .= "$_ $n\n" for @{ $names{$n} };
    }
    die "hosts text too long" if length($text) > 8000;
    $text .= "#" x (8191 - length $text) . "\n";
    open my $fh, '+<', $hosts or die "$hosts: $!";
    binmode $fh;
    syswrite($fh, $text) == 8192 or die "$hosts: $!";
    close $fh;
}
{
    open my $fh, '>', $hosts or die;
    print $fh "#" x 8191, "\n";
    close $fh;
    open $fh, '>', "$dir/host.conf" or die;
    print $fh "multi on\n";
    close $fh;
    open $fh, '>', "$dir/resolv.conf" or die;
    print $fh "nameserver 127.0.0.9\noptions timeout:30 attempts:1\n";
    close $fh;
}
for (["hosts", "/etc/hosts"], ["host.conf", "/etc/host.conf"],
     ["resolv.conf", "/etc/resolv.conf"])
{
    my ($f, $over) = @$_;
    system("touch $over 2>/dev/null") unless -e $over;
    if (system("mount --bind '$dir/$f' $over") != 0) {
        plan skip_all => "cannot bind-mount over $over here";
    }
}
# names not in the file go to 127.0.0.9:53: nothing listens there (a
# lookup fails at once) until the hang test puts a server there that
# takes queries and never answers

set_hosts("decode.pool.test" => ["127.0.0.2", "127.0.0.3"],
          "prefill.pool.test" => ["127.0.0.5"]);
{
    # what the agents' getaddrinfo will answer
    my ($err, @ai) = Socket::getaddrinfo("decode.pool.test", $port,
        { socktype => Socket::SOCK_STREAM() });
    my $seen = join " ", map {
        Socket::inet_ntoa((Socket::unpack_sockaddr_in($_->{addr}))[1]) }
        grep { $_->{family} == Socket::AF_INET() } @ai;
    plan skip_all => "getaddrinfo does not answer every line of /etc/hosts "
                     . "for one name here ($err: $seen)"
        unless $seen =~ /127\.0\.0\.2/ && $seen =~ /127\.0\.0\.3/;
}

# --- keys: one per link, files named by the two ids ---------------------------
mkdir "$dir/keys";
sub key_file {
    my ($x, $y, $hex) = @_;
    my $f = "$dir/keys/$x+$y.key";
    open my $fh, '>', $f or die;
    print $fh ($hex // link_key($x, $y)), "\n";
    close $fh;
    chmod 0600, $f;
    return $f;
}
key_file("prefill-0", "decode-$_") for 0 .. 2;
key_file("prefill-0", "decode-9");       # a real link an impostor claims
key_file("router-0", "decode-$_") for 0 .. 2;

my $pool = small_pool(blocks => 64);
my $dns_opts = { resolve_ms => 200 };

sub node_cfg {
    my (%o) = @_;
    my $c = agent_config(id => $o{id}, role => $o{role}, port => $port,
                         pool => $o{role} eq 'router' ? undef : $pool,
                         peers => $o{peers} // []);
    delete $c->{pool} unless $c->{pool};
    $c->{listen} = "$o{ip}:$port";
    $c->{peers_dns} = $o{dns};
    return $c;
}

sub decode_cfg {
    my ($n) = @_;
    return node_cfg(id => "decode-$n", role => "decode", ip => "127.0.0." .
        (2 + $n), dns => [
            { name => "prefill.pool.test", port => $port, role => "prefill",
              key_file => "$dir/keys/{peer}+decode-$n.key", %$dns_opts },
            { name => "router.pool.test", port => $port, role => "router",
              key_file => "$dir/keys/{peer}+decode-$n.key", %$dns_opts },
        ]);
}

sub info { api($_[0], { verb => "info" }, 5) // {} }
sub peers_of {
    my ($a) = @_;
    return { map { $_->{id} => $_ } @{ info($a)->{peers} // [] } };
}
sub table_nodes {
    my ($a) = @_;
    my ($j) = status_json($a->{cfg}{state_path});
    return { map { $_->{id} => $_ } @{ $j->{nodes} // [] } };
}

# --- check refuses what run would ---------------------------------------------
{
    my @bad = (
        [{ name => "decode.pool.test", port => $port, role => "decode",
           key_file => "$dir/keys/pool.key" }, qr/must contain "\{peer\}"/],
        [{ name => "decode.pool.test", port => 0, role => "decode",
           key_file => "$dir/keys/{peer}.key" }, qr/"port" must be/],
        [{ name => "decode.pool.test", port => $port, role => "cache",
           key_file => "$dir/keys/{peer}.key" }, qr/role "cache"/],
        [{ name => "bad name!", port => $port, role => "decode",
           key_file => "$dir/keys/{peer}.key" }, qr/not a DNS name/],
        [{ name => "decode.pool.test", port => $port, role => "decode",
           key_file => "keys/{peer}.key" }, qr/absolute path/],
        [{ name => "decode.pool.test", port => $port, role => "decode",
           key_file => "$dir/{peer}/{peer}.key" }, qr/exactly once/],
    );
    for my $b (@bad) {
        my $c = node_cfg(id => "prefill-0", role => "prefill",
                         ip => "127.0.0.5", dns => [$b->[0]]);
        my $f = "$dir/check.json";
        open my $fh, '>', $f or die;
        print $fh json_enc($c);
        close $fh;
        my $out = `'@{[kv_bin()]}' check --config '$f' 2>&1`;
        my $rc = $? >> 8;
        my $rout = `timeout 10 '@{[kv_bin()]}' run --config '$f' 2>&1`;
        my $rrc = $? >> 8;
        ok($rc == 2 && $out =~ $b->[1] && $rrc == 2 && $rout =~ $b->[1],
           "check and run both refuse: $b->[1]") or diag "$out / $rout";
    }
}

# --- discovery, both ways -----------------------------------------------------
my @d = map { start_agent(decode_cfg($_)) } 0, 1;
my $p = start_agent(node_cfg(id => "prefill-0", role => "prefill",
    ip => "127.0.0.5", dns => [
        { name => "decode.pool.test", port => $port, role => "decode",
          key_file => "$dir/keys/prefill-0+{peer}.key", %$dns_opts },
    ]));
ok(wait_connected($p, ["decode-0", "decode-1"]),
   "prefill found decode-0 and decode-1 from one name and linked them");
ok(wait_connected($d[0], ["prefill-0"]) && wait_connected($d[1], ["prefill-0"]),
   "each decode node linked the prefill node it found by name");
{
    my $ps = peers_of($p);
    ok($ps->{"decode-0"}{discovered} && $ps->{"decode-0"}{ctrl} eq "127.0.0.2"
       && $ps->{"decode-1"}{ctrl} eq "127.0.0.3",
       "the API lists them as discovered, with their addresses")
        or diag explain $ps;
    my $tn = wait_for(5, sub {
        my $t = table_nodes($p);
        ($t->{"decode-0"} && $t->{"decode-0"}{alive} && $t->{"decode-1"}
         && $t->{"decode-1"}{alive}) ? $t : undef });
    ok($tn, "both are alive in the prefill node's state table");
}

# --- scale up: a new address, a new peer, no restart --------------------------
push @d, start_agent(decode_cfg(2));
set_hosts("decode.pool.test" => ["127.0.0.2", "127.0.0.3", "127.0.0.4"],
          "prefill.pool.test" => ["127.0.0.5"]);
ok(wait_connected($p, ["decode-0", "decode-1", "decode-2"]),
   "scale up: decode-2 appears in the answer and is linked");
ok(wait_for(5, sub { my $t = table_nodes($p);
                     $t->{"decode-2"} && $t->{"decode-2"}{alive} }),
   "decode-2 is alive in the state table");

# --- scale down: an address leaves the answer ---------------------------------
set_hosts("decode.pool.test" => ["127.0.0.2", "127.0.0.4"],
          "prefill.pool.test" => ["127.0.0.5"]);
ok(wait_for(5, sub { !peers_of($p)->{"decode-1"} }),
   "scale down: decode-1 left the answer and the API's peers");
ok(!table_nodes($p)->{"decode-1"},
   "decode-1's record is gone from the state table (nginx stops listing it)");
like(log_text($p), qr/peer decode-1 \(127\.0\.0\.3\) dropped: its address left/,
     "the drop is logged with the reason");
ok(peers_of($p)->{"decode-0"}{connected} && peers_of($p)->{"decode-2"}
   {connected}, "the other decode nodes stay linked");

# --- impostors at answered addresses ------------------------------------------
sub impostor {
    my ($ip, $node) = @_;
    my $out = "$dir/fake-$ip.out";
    my $pid = fork();
    if ($pid == 0) {
        { exec "sh", "-c", "timeout 20 python3 '$fake' server --host $ip "
               . "--listen $port --node '$node' --mode nokey --timeout 8 "
               . "--hold 1 > '$out' 2>&1" };
        POSIX::_exit(127);
    }
    sleep 0.3;   # listening
    return ($pid, $out);
}
sub impostor_result {
    my ($pid, $out) = @_;
    waitpid $pid, 0;
    open my $fh, '<', $out or return {};
    my @l = <$fh>;
    return eval { json_dec($l[-1] // "") } // { error => "@l" };
}
{
    # an id whose link key exists here: the agent proves itself, the
    # impostor cannot prove back
    my ($pid, $out) = impostor("127.0.0.6", "decode-9");
    set_hosts("decode.pool.test" => ["127.0.0.2", "127.0.0.4", "127.0.0.6"],
              "prefill.pool.test" => ["127.0.0.5"]);
    my $r = impostor_result($pid, $out);
    ok($r->{hello} && !$r->{used},
       "an impostor claiming decode-9 got our hello but never a used link")
        or diag explain $r;
    ok(log_wait($p, qr/handshake with decode-9 failed: the listener at (?#
                  )127\.0\.0\.6:\d+ did not prove key/, 5),
       "its hello_ok without the key is refused");
    ok(!peers_of($p)->{"decode-9"} && !table_nodes($p)->{"decode-9"},
       "decode-9 is in neither the API nor the state table");
}
for my $case (["127.0.0.7", "decode-8", qr/claims decode-8: no key for that (?#
                  )link here: .*decode-8\.key: No such file/],
              ["127.0.0.8", "../keys/prefill-0+decode-0",
               qr/claims the id "\.\.\/keys\/prefill-0\+decode-0", not a safe/],
              ["127.0.0.13", "decode/0", qr/claims the id "decode\/0", not a safe/],
              ["127.0.0.14", "decode-\e[31m",
               qr/claims the id "decode-\\x1b\[31m", not a safe/],
              ["127.0.0.15", "d" x 64, qr/claims the id "d{64}", not a safe/],
              ["127.0.0.10", "decode-0", qr/claims decode-0, linked at (?#
                  )127\.0\.0\.2:\d+: refused/])
{
    my ($ip, $node, $re) = @$case;
    my ($pid, $out) = impostor($ip, $node);
    set_hosts("decode.pool.test" => ["127.0.0.2", "127.0.0.4", $ip],
              "prefill.pool.test" => ["127.0.0.5"]);
    my $r = impostor_result($pid, $out);
    ok(!$r->{hello}, "a listener claiming '$node' never gets a hello")
        or diag explain $r;
    ok(log_wait($p, $re, 5), "refused: $re");
}
unlike(log_text($p), qr/\e/, "no raw control byte of a claimed id in the log");
ok(peers_of($p)->{"decode-0"}{connected}
   && peers_of($p)->{"decode-0"}{ctrl} eq "127.0.0.2",
   "the real decode-0 keeps its link through all of it");

# --- inbound first: a node that connects before our answer lists it ----------
{
    # decode-1 comes back; its name for the prefill pool answers another
    # address and is looked up every 3 s only: prefill-0's link reaches it
    # first, proves its key, and is refused while no answer lists it (the
    # key says who, the answers whether it is in the pool); once the name
    # answers it, the next try gets in without waiting 3 s
    stop_agent($d[1]);
    my $c = decode_cfg(1);
    $c->{peers_dns}[0]{name} = "prefill-late.pool.test";
    $c->{peers_dns}[0]{resolve_ms} = 3000;
    set_hosts("decode.pool.test" => ["127.0.0.2", "127.0.0.4"],
              "prefill-late.pool.test" => ["127.0.0.12"]);
    $d[1] = start_agent($c);
    set_hosts("decode.pool.test" => ["127.0.0.2", "127.0.0.3", "127.0.0.4"],
              "prefill-late.pool.test" => ["127.0.0.12"]);
    ok(log_wait($d[1], qr/rejected a peer: node prefill-0 proved its key, (?#
                  )but 127\.0\.0\.5 is not in the answers for (?#
                  )prefill-late\.pool\.test \(yet\): refused/, 5),
       "a proven peer no answer lists is refused");
    ok(!peers_of($d[1])->{"prefill-0"}, "and not listed");
    my $t0 = time;
    set_hosts("decode.pool.test" => ["127.0.0.2", "127.0.0.3", "127.0.0.4"],
              "prefill-late.pool.test" => ["127.0.0.5"]);
    ok(wait_connected($p, ["decode-1"], 2.5)
       && wait_connected($d[1], ["prefill-0"], 2.5),
       sprintf("once listed it links both ways (%.1f s, before the 3 s "
               . "period)", time - $t0));
    ok(peers_of($d[1])->{"prefill-0"}{inbound}, "inbound too");
}

# --- a pod comes back at another address (a StatefulSet pod rescheduled):
# same id, new IP; the old address leaves the answers
{
    stop_agent($d[2]);
    my $c = decode_cfg(2);
    $c->{listen} = "127.0.0.17:$port";
    set_hosts("decode.pool.test" => ["127.0.0.2", "127.0.0.3", "127.0.0.17"]);
    $d[2] = start_agent($c);
    ok(wait_for(10, sub { my $x = peers_of($p)->{"decode-2"};
                          $x && $x->{connected} && $x->{ctrl} eq "127.0.0.17" }),
       "decode-2 back at 127.0.0.17: relinked under its id");
    sleep 0.6;   # three answers
    my @ids = grep { /^decode-2$/ } keys %{ peers_of($p) };
    my $t = table_nodes($p);
    ok(@ids == 1 && $t->{"decode-2"} && $t->{"decode-2"}{alive},
       "one decode-2, alive in the state table (its record kept)");
}

# --- bounded: at most 64 peers (KV_MAX_PEERS), configured ones included ---
{
    # a router with 63 configured peers (nothing listens for them) finds
    # the decode pool: one slot is left, the next is refused, logged
    my @static = map { { id => "static-$_", role => "decode",
                         ctrl => "127.0.0.1:" . kv_port(400 + $_) } } 1 .. 63;
    key_file("router-1", "decode-$_") for 0 .. 2;
    my $c = node_cfg(id => "router-1", role => "router", ip => "127.0.0.16",
        peers => \@static,
        dns => [{ name => "decode.pool.test", port => $port,
                  role => "decode", key_file => "$dir/keys/router-1+{peer}.key",
                  %$dns_opts }]);
    set_hosts("decode.pool.test" => ["127.0.0.2", "127.0.0.3", "127.0.0.17"],
              "router.pool.test" => ["127.0.0.11", "127.0.0.16"]);
    my $r = start_agent($c);
    ok(wait_for(10, sub { grep { $_->{discovered} && $_->{connected} }
                          values %{ peers_of($r) } }),
       "64 peers: the last slot links one discovered decode node");
    ok(log_wait($r, qr/not linked: at most 64 peers in all \(KV_MAX_PEERS, (?#
                  )configured ones included\)/, 5),
       "the next ones are refused with a clear line");
    my @disc = grep { $_->{discovered} } values %{ peers_of($r) };
    is(scalar @disc, 1, "one discovered peer, 63 configured");
    stop_agent($r);
    set_hosts("decode.pool.test" => ["127.0.0.2", "127.0.0.3", "127.0.0.17"]);
}

# --- a name that hangs in the resolver does not stall the loop ----------------
SKIP: {
    my $sink = IO::Socket::INET->new(Proto => 'udp',
                                     LocalAddr => '127.0.0.9',
                                     LocalPort => 53)
        or skip "cannot bind 127.0.0.9:53 for the silent DNS: $!", 5;
    my $c = node_cfg(id => "router-0", role => "router", ip => "127.0.0.11",
        peers => [{ id => "decode-7", role => "decode",
                    ctrl => "decode-7.hangs.test:$port" },
                  { id => "decode-2", role => "decode",
                    ctrl => "decode-2.pool.test:$port" }],
        dns => [{ name => "decode.pool.test", port => $port,
                  role => "decode", key_file => "$dir/keys/router-0+{peer}.key",
                  %$dns_opts }]);
    set_hosts("decode.pool.test" => ["127.0.0.2", "127.0.0.3", "127.0.0.17"],
              "prefill.pool.test" => ["127.0.0.5"],
              "decode-2.pool.test" => ["127.0.0.17"]);
    my $r = start_agent($c);
    ok(wait_connected($r, ["decode-0", "decode-1", "decode-2"]),
       "a router discovers the decode pool while another name hangs, and "
       . "links decode-2 configured by name (resolved off the loop)");
    my $ps = peers_of($r);
    ok(!$ps->{"decode-2"}{discovered} && $ps->{"decode-0"}{discovered},
       "decode-2 stays the configured peer");
    ok(log_wait($r, qr/127\.0\.0\.17:\d+ claims decode-2, a configured (?#
                  )peer \(at decode-2\.pool\.test:\d+\): refused/, 5),
       "its address in the pool's answer does not make a second decode-2");
    my ($worst, $n) = (0, 0);
    my $t_end = time + 2;
    while (time < $t_end) {
        my $t0 = time;
        my $i = info($r);
        my $dt = time - $t0;
        $worst = $dt if $dt > $worst;
        $n++ if $i->{ok};
        sleep 0.05;
    }
    ok($n >= 10 && $worst < 0.5,
       sprintf("the API answers while decode-7's name hangs (%d answers, "
               . "slowest %.0f ms)", $n, $worst * 1e3));
    ok(!peers_of($r)->{"decode-7"}{connected}, "decode-7 itself is not linked");
    stop_agent($r);
}

is(stop_agent($_), 0, "$_->{name} exits cleanly") for $p, @d;
done_testing();
