package DPD::KvAgent;

# Start, query and stop real kv_agent daemons (build/kv_agent) next to
# emulator instances in Perl tests.  See the POD at the end of the file.

use strict;
use warnings;

use Carp qw(croak);
use Digest::SHA qw(sha256_hex);
use File::Spec;
use File::Temp qw(tempdir);
use IO::Socket::UNIX;
use JSON::PP ();
use POSIX ();
use Socket qw(SOCK_STREAM);
use Time::HiRes qw(sleep time);

require DPD::Emu;

my @AGENTS;
my $OWNER = $$;
my $JSON = JSON::PP->new->utf8->canonical;

sub bin { File::Spec->catfile(DPD::Emu::build_dir(), 'kv_agent') }

sub port_base { $ENV{DPD_KV_AGENT_PORT} || 18800 }

# () when agents can run here, else the reason (for skip_all).
sub unavailable {
    my ($class, $provider) = @_;
    $provider //= 'tcp;ofi_rxm';
    return 'build/kv_agent not built (make programs)' unless -x bin();
    my $out = `fi_info -p '$provider' 2>&1`;
    return "libfabric provider $provider not available here"
        unless $? == 0 && $out =~ /type:\s+FI_EP_RDM/;
    return ();
}

sub small_pool {
    my ($class, %o) = @_;
    return {layers => $o{layers} // 2, regions => 2,
            block_bytes => $o{block_bytes} // 1024,
            blocks => $o{blocks} // 64, memory => 'host'};
}

sub _dir {
    my ($o) = @_;
    return $o->{dir} ||= tempdir('dpd-kva-XXXXXX', TMPDIR => 1,
                                 CLEANUP => !$ENV{DPD_KEEP_TMP});
}

# The key of the link between two nodes, the same in both configurations
# (derived from the pair of ids; $salt gives another one).
sub link_key {
    my ($class, $x, $y, $salt) = @_;
    return sha256_hex('dpd-test-link|' . join('|', sort($x, $y)) . '|'
                      . ($salt // ''));
}

# start(id => 'decode-0', role => 'decode', port => N, peers => [{id, ctrl,
#       role}] (each gets its link key unless it has key/keys/key_file),
#       pool => {...}, provider => 'tcp;ofi_rxm', dir => ...,
#       timeouts => {...}, config => {extra keys}, timeout => 20)
sub start {
    my ($class, %o) = @_;
    my $id = $o{id} or croak 'DPD::KvAgent: id';
    my $dir = _dir(\%o);
    my $provider = $o{provider} // 'tcp;ofi_rxm';
    my %c = (
        node_id => $id,
        role => $o{role} // 'decode',
        provider => $provider,
        allow_fallback => JSON::PP::false(),
        rails => $o{rails} // ($provider eq 'shm' ? 'auto' : ['lo']),
        listen => '127.0.0.1:' . ($o{port} or croak 'DPD::KvAgent: port'),
        peers => [map { my %p = %$_;
                        $p{key} = $class->link_key($id, $p{id})
                            unless grep { exists $p{$_} }
                                   qw(key keys key_file);
                        \%p } @{ $o{peers} // [] }],
        api_socket => "$dir/$id.sock",
        state_path => "$dir/$id.state",
        timeouts => {heartbeat_ms => 100, dead_after_ms => 600,
                     transfer_ms => 5000, reconnect_ms => 100,
                     %{ $o{timeouts} || {} }},
        %{ $o{config} || {} },
    );
    $c{http} = $o{http} if $o{http};
    $c{pool} = $o{pool} // $class->small_pool if $c{role} ne 'router';
    my $cfg = "$dir/$id.json";
    open my $fh, '>', $cfg or croak "DPD::KvAgent: $cfg: $!";
    print $fh $JSON->encode(\%c);
    close $fh;
    chmod 0600, $cfg;                  # it holds the link keys
    my $self = bless {id => $id, cfg => \%c, cfgfile => $cfg,
                      log => "$dir/$id.log", sock => $c{api_socket},
                      state => $c{state_path}, owner => $$}, $class;
    push @AGENTS, $self;
    return $self->_run($o{timeout});
}

sub _run {
    my ($self, $timeout) = @_;
    my ($id, $log, $cfg) = @$self{qw(id log cfgfile)};
    unlink $self->{sock};
    my $skip = length $self->log_text;   # a restart appends to the log
    my $pid = fork();
    croak "DPD::KvAgent: fork: $!" unless defined $pid;
    if ($pid == 0) {
        open STDIN, '<', '/dev/null';
        open STDOUT, '>>', $log or POSIX::_exit(127);
        open STDERR, '>&', \*STDOUT;
        exec bin(), 'run', '--config', $cfg or POSIX::_exit(127);
    }
    $self->{pid} = $pid;
    my $deadline = time + ($timeout || 20);
    while (1) {
        last if substr($self->log_text, $skip) =~ /info: ready$/m;
        croak "DPD::KvAgent: $id exited at start: " . $self->log_text
            unless $self->alive;
        if (time > $deadline) {
            $self->stop;
            croak "DPD::KvAgent: $id not ready: " . $self->log_text;
        }
        sleep 0.05;
    }
    return $self;
}

# restart(): start the same agent again (same config, socket, ports)
sub restart {
    my ($self, $timeout) = @_;
    $self->stop if $self->{pid};
    return $self->_run($timeout);
}

# pair(base => port, pool => {...}): a prefill and a decode agent that know
# each other (ids prefill-0 / decode-0), connected.
sub pair {
    my ($class, %o) = @_;
    my $base = $o{base} // port_base();
    my $dir = _dir(\%o);
    my ($pid, $did) = ($o{prefill_id} // 'prefill-0',
                       $o{decode_id} // 'decode-0');
    my %common = (dir => $dir, pool => $o{pool} // $class->small_pool,
                  provider => $o{provider}, timeouts => $o{timeouts},
                  config => $o{config});
    delete $common{$_} for grep { !defined $common{$_} } keys %common;
    my $p = $class->start(%common, id => $pid, role => 'prefill',
        port => $base,
        peers => [{id => $did, ctrl => '127.0.0.1:' . ($base + 1),
                   role => 'decode'}]);
    my $d = $class->start(%common, id => $did, role => 'decode',
        port => $base + 1,
        peers => [{id => $pid, ctrl => "127.0.0.1:$base",
                   role => 'prefill'}]);
    return ($p, $d);
}

sub id { $_[0]{id} }
sub socket_path { $_[0]{sock} }
sub state_path { $_[0]{state} }
sub log_file { $_[0]{log} }
sub pid { $_[0]{pid} }

sub log_text {
    my ($self) = @_;
    open my $fh, '<', $self->{log} or return '';
    local $/;
    my $t = <$fh>;
    return $t // '';
}

sub alive {
    my ($self) = @_;
    return 0 unless $self->{pid};
    if (waitpid($self->{pid}, POSIX::WNOHANG()) == $self->{pid}) {
        $self->{pid} = undef;
        return 0;
    }
    return 1;
}

sub _read_exact {
    my ($s, $n, $deadline) = @_;
    my $buf = '';
    while (length($buf) < $n) {
        my $rin = '';
        vec($rin, fileno($s), 1) = 1;
        my $left = $deadline - time;
        return undef if $left <= 0;
        next unless select($rin, undef, undef, $left);
        my $r = sysread($s, $buf, $n - length($buf), length $buf);
        return undef unless $r;
    }
    return $buf;
}

# api({verb => ...}, $timeout) -> reply hash; {ok => 0, code => 'connect'}
# when the agent cannot be reached, undef when it closed the connection.
sub api {
    my ($self, $msg, $timeout) = @_;
    my $s = IO::Socket::UNIX->new(Type => SOCK_STREAM,
                                  Peer => $self->{sock})
        or return {ok => 0, code => 'connect', error => "connect: $!"};
    my $body = $JSON->encode($msg);
    syswrite $s, pack('N', length $body) . $body;
    my $deadline = time + ($timeout // 10);
    my $h = _read_exact($s, 4, $deadline) // return undef;
    my $rep = _read_exact($s, unpack('N', $h), $deadline) // return undef;
    close $s;
    return $JSON->decode($rep);
}

sub info { $_[0]->api({verb => 'info'}) }

sub poll { $_[0]->api({verb => 'poll', req_id => $_[1]}) }

# free blocks of the pool (undef if the agent does not answer)
sub free_blocks {
    my ($self) = @_;
    my $i = $self->info;
    return $i && $i->{ok} ? $i->{pool}{free} : undef;
}

# wait until the request is final (ready / done / failed), or timeout;
# returns the last poll reply
sub wait_final {
    my ($self, $req, $timeout) = @_;
    my $deadline = time + ($timeout // 10);
    my $r;
    while (time < $deadline) {
        $r = $self->poll($req);
        return $r if $r && $r->{ok} && $r->{final};
        sleep 0.02;
    }
    return $r;
}

sub wait_connected {
    my ($self, $peers, $timeout) = @_;
    my $deadline = time + ($timeout // 15);
    while (time < $deadline) {
        my $i = $self->info;
        if ($i && $i->{ok}) {
            my %up = map { $_->{id} => $_->{connected} } @{ $i->{peers} };
            return 1 unless grep { !$up{$_} } @$peers;
        }
        sleep 0.05;
    }
    return 0;
}

# stop($signal = 'TERM'): signal, reap (KILL after 10 s)
sub stop {
    my ($self, $sig) = @_;
    my $pid = $self->{pid} or return;
    return unless $$ == $self->{owner};
    kill $sig // 'TERM', $pid;
    my $deadline = time + 10;
    while (time < $deadline) {
        my $w = waitpid($pid, POSIX::WNOHANG());
        if ($w == $pid || $w == -1) {
            $self->{pid} = undef;
            return;
        }
        sleep 0.02;
    }
    kill 'KILL', $pid;
    waitpid($pid, 0);
    $self->{pid} = undef;
}

sub stop_all {
    $_->stop('KILL') for grep { $_->{pid} } @AGENTS;
    @AGENTS = ();
}

END {
    local ($?, $!, $@);
    stop_all() if $$ == $OWNER;
}

1;

__END__

=head1 NAME

DPD::KvAgent - run real kv_agent daemons next to vLLM emulator instances

=head1 SYNOPSIS

    use DPD::Emu;
    use DPD::KvAgent;

    plan skip_all => $_ for DPD::KvAgent->unavailable;
    my ($pa, $da) = DPD::KvAgent->pair(base => 18800);   # 18800, 18801
    $pa->wait_connected(['decode-0']);
    my $p = DPD::Emu->start(role => 'prefill', kv_agent => $pa, ...);
    my $d = DPD::Emu->start(role => 'decode', kv_agent => $da, ...);
    ...
    is $da->free_blocks, 64, 'nothing left at the decode agent';

=head1 METHODS

  unavailable($provider)   () or the reason agents cannot run here
  small_pool(%o)           {layers 2, regions 2, block_bytes 1024,
                           blocks 64, memory host} (layers, block_bytes,
                           blocks overridable)
  start(%o)                one agent: id, role, port (control channel),
                           peers [{id, ctrl, role}] (each given its
                           link key unless key/keys/key_file is set),
                           pool, provider (tcp;ofi_rxm), timeouts, config
                           (extra keys), dir (temp dir for config, socket,
                           state, log)
  link_key($a, $b, $salt)  the test key of the link between nodes a and b
  pair(base => P, pool => {..})  prefill-0 on P and decode-0 on P+1
  socket_path state_path log_file log_text pid id alive
  api({verb ..}, $timeout) info poll($req) free_blocks
  wait_final($req, $timeout) wait_connected([ids], $timeout)
  restart($timeout)        the same agent again (after stop / a kill)
  stop($sig)               TERM by default (KILL after 10 s); all agents
                           are killed at END

Ports: the control ports are yours to pick (the emulator tests use
$DPD_KV_AGENT_PORT or 18800 upward).

=cut
