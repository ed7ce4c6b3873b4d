package KvAgentTest;

# Helpers for the kv_agent tests: write configs, start real agents, talk to
# their local API (length-prefixed JSON on a Unix socket), read logs and the
# state table.  Every agent started here is stopped at exit.

use strict;
use warnings;
use Exporter 'import';
use File::Temp qw(tempdir);
use IO::Socket::UNIX;
use JSON::PP;
use POSIX qw(:sys_wait_h);
use Time::HiRes qw(sleep time);
use Digest::SHA qw(sha256_hex);
use Cwd qw(abs_path);
use File::Basename qw(dirname);

our @EXPORT = qw(kv_bin kv_ctl kv_root kv_tmpdir kv_port agent_config
    start_agent stop_agent agent_alive api api_raw log_wait log_text
    wait_connected status_json run_kvpush json_enc json_dec provider_ok
    llama_pool small_pool link_key wait_for cpu_s);

my $ROOT = $ENV{DPD_ROOT} // abs_path(dirname(__FILE__) . "/../..");
my $BUILD = $ENV{DPD_BUILD} // "$ROOT/build";
my @AGENTS;
my $JSON = JSON::PP->new->canonical(1);
$SIG{PIPE} = "IGNORE";   # agents may close a connection we still write to
$SIG{INT} = $SIG{TERM} = sub { exit 1 };   # run END: stop our agents

sub kv_root { $ROOT }
sub kv_bin { "$BUILD/kv_agent" }
sub kv_ctl { "$BUILD/kv_agent_ctl" }
sub json_enc { $JSON->encode($_[0]) }
sub json_dec { decode_json($_[0]) }

my $TMP;
sub kv_tmpdir {
    $TMP //= tempdir("kvtest-XXXXXX", TMPDIR => 1,
                      CLEANUP => !$ENV{KV_TEST_KEEP});
    return $TMP;
}

# Ports: 18000-18999 by default; KV_TEST_PORT_BASE moves the range.
sub kv_port {
    my ($off) = @_;
    return ($ENV{KV_TEST_PORT_BASE} // 18000) + $off;
}

sub provider_ok {
    my ($prov) = @_;
    my $out = `fi_info -p '$prov' 2>&1`;
    return $? == 0 && $out =~ /type:\s+FI_EP_RDM/;
}

# Llama-70B shaped at TP=8: 80 layers, separate K and V, 4 KiB per block
# per region; a few blocks more than one request needs.
sub llama_pool {
    my (%o) = @_;
    return { layers => 80, regions => 2, block_bytes => 4096,
             blocks => $o{blocks} // 600, memory => "host" };
}

sub small_pool {
    my (%o) = @_;
    return { layers => $o{layers} // 4, regions => 2,
             block_bytes => $o{block_bytes} // 4096,
             blocks => $o{blocks} // 64, memory => "host" };
}

# The key of the link between two nodes (the same on both ends): derived
# from the pair of ids so every test's configs agree; $salt makes another.
sub link_key {
    my ($x, $y, $salt) = @_;
    return sha256_hex("kvtest-link|" . join("|", sort($x, $y))
                      . "|" . ($salt // ""));
}

# peers: [{id, ctrl, role}, ...]; each gets its link key unless it has a
# key, keys or key_file already.  keys => {peer_id => "hex" | [hex, hex]}
# overrides the key of one link.
sub _keyed_peers {
    my ($id, $peers, $keys) = @_;
    my @out;
    for my $p (@$peers) {
        my %c = %$p;
        if (my $k = $keys->{$c{id}}) {
            delete @c{qw(key keys key_file)};
            if (ref $k) { $c{keys} = $k } else { $c{key} = $k }
        } elsif (!grep { exists $c{$_} } qw(key keys key_file)) {
            $c{key} = link_key($id, $c{id});
        }
        push @out, \%c;
    }
    return \@out;
}

sub agent_config {
    my (%o) = @_;
    my $dir = kv_tmpdir();
    my $id = $o{id} or die "id";
    my %c = (
        node_id    => $id,
        role       => $o{role} // "decode",
        provider   => $o{provider} // "tcp;ofi_rxm",
        listen     => "127.0.0.1:" . $o{port},
        peers      => _keyed_peers($id, $o{peers} // [], $o{keys} // {}),
        api_socket => "$dir/$id.sock",
        state_path => $o{state_path} // "$dir/$id.state",
        timeouts   => { heartbeat_ms => 100, dead_after_ms => 600,
                        transfer_ms => $o{transfer_ms} // 10000,
                        reconnect_ms => 100, %{ $o{timeouts} // {} } },
        api        => { debug_verbs => JSON::PP::true,
                        %{ $o{api} // {} } },
    );
    $c{http} = $o{http} if $o{http};
    $c{rails} = $o{rails} // ($c{provider} eq 'shm' ? "auto" : ["lo"]);
    $c{pool} = $o{pool} if $o{pool};
    $c{transfer} = $o{transfer} if $o{transfer};
    $c{ctrl} = $o{ctrl} if $o{ctrl};
    $c{allow_fallback} = JSON::PP::false;
    return \%c;
}

# start_agent($cfg, wrap => [...], wait => 1, env => {K => V},
#             keep_socket => 1 (the API socket file is not removed first),
#             bin => path (another build's kv_agent than kv_bin()),
#             name => file names' stem (default: the node id, which may be
#                     "${POD_NAME}" in a config shared by replicas),
#             pre_exec => sub { ... })   (pre_exec runs in the child, whose
#                                         pid the agent keeps)
sub start_agent {
    my ($cfg, %o) = @_;
    my $dir = kv_tmpdir();
    my $name = $o{name} // $cfg->{node_id};
    my $cfgfile = "$dir/$name.json";
    open my $fh, '>', $cfgfile or die "$cfgfile: $!";
    print $fh json_enc($cfg);
    close $fh;
    chmod 0600, $cfgfile;           # it holds the link keys
    my $log = "$dir/$name.log";
    my $skip = -s $log // 0;        # a node started again appends to it
    unlink $cfg->{api_socket} if $cfg->{api_socket} && !$o{keep_socket};
    if ($ENV{KV_TEST_VALGRIND} && !$o{wrap}) {
        # KV_TEST_VALGRIND=1: every agent under memcheck, one log per
        # process in the test's directory (KV_TEST_KEEP=1 keeps it)
        $o{wrap} = ["valgrind", "--leak-check=full",
                    "--show-leak-kinds=definite",
                    "--errors-for-leak-kinds=definite",
                    "--error-exitcode=99", "--log-file=$dir/$name.vg.%p"];
        $o{timeout} //= 90;
    }
    my $pid = fork();
    die "fork: $!" unless defined $pid;
    if ($pid == 0) {
        open STDERR, '>>', $log or die;
        open STDOUT, '>&', \*STDERR or die;
        $ENV{$_} = $o{env}{$_} for keys %{ $o{env} // {} };
        $o{pre_exec}->() if $o{pre_exec};   # runs in the agent's process
        # KV_TEST_WRAP="valgrind --log-file=DIR/vg.%p ..." wraps every
        # agent a test starts (when it does not wrap it itself)
        my @wrap = @{ $o{wrap} // [split ' ', $ENV{KV_TEST_WRAP} // ""] };
        my @cmd = (@wrap, $o{bin} // kv_bin(), "run", "--config", $cfgfile);
        exec @cmd or die "exec: $!";
    }
    my $a = { pid => $pid, name => $name, cfg => $cfg, log => $log,
              sock => $cfg->{api_socket}, cfgfile => $cfgfile,
              wrap => $o{wrap}, log_skip => $skip };
    push @AGENTS, $a;
    if ($o{wait} // 1) {
        my $deadline = time + ($o{timeout}
                               // ($ENV{KV_TEST_WRAP} ? 60 : 20));
        while (time < $deadline) {
            last if log_text($a) =~ /info: ready$/m;
            last unless agent_alive($a);
            sleep 0.05;
        }
    }
    return $a;
}

sub agent_alive {
    my ($a) = @_;
    return 0 unless $a->{pid};
    my $r = waitpid($a->{pid}, WNOHANG);
    if ($r == $a->{pid}) {
        $a->{status} = $?;
        $a->{pid} = 0;
        return 0;
    }
    return 1;
}

# Returns the exit status (as $?), or -1 if it had to be SIGKILLed.
sub stop_agent {
    my ($a, $sig, $timeout) = @_;
    $sig //= 'TERM';
    $timeout //= 15;
    return $a->{status} // 0 unless $a->{pid};
    kill $sig, $a->{pid};
    my $deadline = time + $timeout;
    while (time < $deadline) {
        my $r = waitpid($a->{pid}, WNOHANG);
        if ($r == $a->{pid}) {
            $a->{status} = $?;
            $a->{pid} = 0;
            return $a->{status};
        }
        sleep 0.05;
    }
    kill 'KILL', $a->{pid};
    waitpid($a->{pid}, 0);
    $a->{pid} = 0;
    return -1;
}

END {
    my $st = $?;
    for my $a (@AGENTS) {
        next unless $a->{pid};
        kill 'KILL', $a->{pid};
        waitpid($a->{pid}, 0);
    }
    $? = $st;
}

# What this agent (this start) logged.
sub log_text {
    my ($a) = @_;
    open my $fh, '<', $a->{log} or return "";
    local $/;
    my $t = <$fh>;
    close $fh;
    return substr($t // "", $a->{log_skip} // 0);
}

sub log_wait {
    my ($a, $re, $timeout) = @_;
    my $deadline = time + ($timeout // 10);
    while (time < $deadline) {
        return 1 if log_text($a) =~ $re;
        sleep 0.05;
    }
    return 0;
}

# $f->() until it returns something true (that value), or undef after
# $secs seconds
sub wait_for {
    my ($secs, $f) = @_;
    my $deadline = time + $secs;
    while (time < $deadline) {
        my $r = $f->();
        return $r if $r;
        sleep 0.01;
    }
    return undef;
}

# CPU seconds (user + system) process $pid used so far
my $HZ = POSIX::sysconf(POSIX::_SC_CLK_TCK()) || 100;
sub cpu_s {
    my ($pid) = @_;
    open my $fh, '<', "/proc/$pid/stat" or return 0;
    my @f = split ' ', (split /\)/, <$fh>, 2)[1];
    return ($f[11] + $f[12]) / $HZ;            # utime + stime
}

sub _frame { my ($s) = @_; return pack("N", length $s) . $s }

# Raw bytes in, reply hash (or undef when the agent closed the connection).
sub api_raw {
    my ($sock, $bytes, $timeout) = @_;
    my $s = IO::Socket::UNIX->new(Type => SOCK_STREAM, Peer => $sock)
        or return { ok => 0, error => "connect: $!", code => "connect" };
    $s->autoflush(1);
    print $s $bytes;
    my $rep = _read_reply($s, $timeout // 30);
    close $s;
    return $rep;
}

sub _read_exact {
    my ($s, $n, $deadline) = @_;
    my $buf = "";
    while (length($buf) < $n) {
        my $rin = "";
        vec($rin, fileno($s), 1) = 1;
        my $left = $deadline - time;
        return undef if $left <= 0;
        next unless select($rin, undef, undef, $left);
        my $r = sysread($s, $buf, $n - length($buf), length $buf);
        return undef unless $r;
    }
    return $buf;
}

sub _read_reply {
    my ($s, $timeout) = @_;
    my $deadline = time + $timeout;
    my $h = _read_exact($s, 4, $deadline) // return undef;
    my $n = unpack("N", $h);
    my $body = _read_exact($s, $n, $deadline) // return undef;
    return decode_json($body);
}

# One request on a fresh connection; $sock may be an agent or a path.
sub api {
    my ($a, $msg, $timeout) = @_;
    my $sock = ref $a ? $a->{sock} : $a;
    return api_raw($sock, _frame(json_enc($msg)), $timeout);
}

sub wait_connected {
    my ($a, $peers, $timeout) = @_;
    my $deadline = time + ($timeout // 15);
    while (time < $deadline) {
        my $info = api($a, { verb => "info" }, 5);
        if ($info && $info->{ok}) {
            my %up = map { $_->{id} => $_->{connected} } @{ $info->{peers} };
            return 1 unless grep { !$up{$_} } @$peers;
        }
        sleep 0.05;
    }
    return 0;
}

sub status_json {
    my ($path, @extra) = @_;
    my $out = `'@{[kv_bin()]}' status --state '$path' --json @extra 2>&1`;
    my $rc = $? >> 8;
    my $j = eval { decode_json($out) };
    return ($j, $rc, $out);
}

# Runs t/kv_agent/kvpush.py; returns its decoded JSON (or {error => ...}).
sub run_kvpush {
    my (@args) = @_;
    my $py = "$ROOT/t/kv_agent/kvpush.py";
    # kvpush.py waits --timeout-ms (20 s by default) for the push, then
    # as long for the receive: twice that and a margin
    my ($wait) = join(' ', @args) =~ /--timeout-ms (\d+)/;
    my $limit = 2 * ($wait // 20000) / 1000 + 20;
    my $cmd = join ' ', 'timeout', $limit, 'python3', $py,
        map { "'$_'" } @args;
    my $out = `$cmd 2>&1`;
    my $j = eval { decode_json((split /\n/, $out)[-1] // "") };
    return $j // { error => "kvpush failed: $out" };
}

1;
