package DPD::KvMesh;

# The kv_agent test mesh of t/400 and t/410: a router agent, a prefill and
# two decode emulators each in front of its own real kv_agent (tcp;ofi_rxm
# on loopback), all connected, and the router's state table for nginx.
# See the POD at the end of the file.

use strict;
use warnings;

use Carp qw(croak);
use File::Temp qw(tempdir);
use JSON::PP ();
use Time::HiRes qw(sleep time);

use DPD::Emu;
use DPD::KvAgent;
use DPD::Pools;

our $VERSION = '1.0';

my $J = JSON::PP->new->utf8->canonical;

# () when the mesh can run here, else the reason (for skip_all)
sub unavailable {
    my @why = (DPD::KvAgent->unavailable('tcp;ofi_rxm'),
               DPD::Pools->unavailable);
    return @why ? $why[0] : ();
}

# start(tmp => 'dpd-kva-t4', blocks => 256, dead_after_ms => 3000)
sub start {
    my ($class, %o) = @_;
    my $eport = $ENV{DPD_KVA_EMU_PORT} || 19690;
    my $aport = $ENV{DPD_KVA_AGENT_PORT} || 18900;
    my $dir = tempdir(($o{tmp} || 'dpd-kvmesh') . '-XXXXXX', TMPDIR => 1,
                      CLEANUP => !$ENV{DPD_KEEP_TMP});
    my %http = ('prefill-0' => "127.0.0.2:$eport",
                'decode-0' => "127.0.0.3:$eport",
                'decode-1' => "127.0.0.4:$eport");
    my %ctrl = ('router-0' => $aport, 'prefill-0' => $aport + 1,
                'decode-0' => $aport + 2, 'decode-1' => $aport + 3);
    my %role = ('router-0' => 'router', 'prefill-0' => 'prefill',
                'decode-0' => 'decode', 'decode-1' => 'decode');
    my $pool = DPD::KvAgent->small_pool(blocks => $o{blocks} // 256);
    my %timeouts = (heartbeat_ms => 100,
                    dead_after_ms => $o{dead_after_ms} // 3000);

    my $agent = sub {
        my ($id, @peers) = @_;
        return DPD::KvAgent->start(id => $id, role => $role{$id},
            port => $ctrl{$id}, dir => $dir,
            $http{$id} ? (http => $http{$id}) : (), pool => $pool,
            peers => [map { {id => $_, ctrl => "127.0.0.1:$ctrl{$_}",
                             role => $role{$_},
                             $http{$_} ? (http => $http{$_}) : ()} }
                      @peers],
            timeouts => \%timeouts);
    };

    my $self = bless {port => $eport}, $class;
    my $a = $self->{agents} = {};
    $a->{'router-0'} = $agent->('router-0', qw(prefill-0 decode-0 decode-1));
    $a->{$_} = $agent->($_, qw(prefill-0 router-0)) for qw(decode-0 decode-1);
    $a->{'prefill-0'} = $agent->('prefill-0',
                                 qw(decode-0 decode-1 router-0));

    my %emu = (port => $eport, side_channel_port => $eport + 1,
               no_lmcache => 1, tokenizer => 'llama3', time_scale => 0.01,
               kv_connect_timeout => 0.5);
    $self->{emu} = \%emu;
    my $e = $self->{engines} = {};
    for my $id (qw(prefill-0 decode-0 decode-1)) {
        $e->{$id} = DPD::Emu->start(%emu,
                                    host => (split /:/, $http{$id})[0],
                                    role => $role{$id},
                                    kv_agent => $a->{$id});
    }

    # registering pools makes the agents reconnect: wait for the mesh and
    # the router's table (4 nodes alive) before nginx starts
    $a->{'prefill-0'}->wait_connected(['decode-0', 'decode-1', 'router-0'])
        or die "prefill agent not connected:\n"
               . $a->{'prefill-0'}->log_text;
    $a->{$_}->wait_connected(['prefill-0', 'router-0'])
        or die "$_ not connected:\n" . $a->{$_}->log_text
        for qw(decode-0 decode-1);
    $self->table_wait(sub { 4 == grep { $_->{alive} }
                                 @{ $_[0]{nodes} || [] } }, 15)
        or die "router table: not 4 nodes alive: "
               . $J->encode($self->table);

    DPD::Pools::export_env();
    $ENV{TEST_NGINX_EMU_PORT} = $eport;
    $ENV{TEST_NGINX_STATE} = $self->router->state_path;
    return $self;
}

sub agent { $_[0]{agents}{$_[1]} or croak "DPD::KvMesh: no agent $_[1]" }
sub router { $_[0]->agent('router-0') }
sub engine { $_[0]{engines}{$_[1]} or croak "DPD::KvMesh: no engine $_[1]" }
sub port { $_[0]{port} }
sub emu_options { %{ $_[0]{emu} } }

# the router's state table (kv_agent status --json), {} when unreadable
sub table {
    my ($self) = @_;
    my ($bin, $state) = (DPD::KvAgent::bin(), $self->router->state_path);
    my $out = `'$bin' status --state '$state' --json 2>&1`;
    return eval { $J->decode($out) } || {};
}

# table_wait(sub { my ($table) = @_; cond }, $timeout = 10) -> 1 / 0
sub table_wait {
    my ($self, $cond, $timeout) = @_;
    my $end = time + ($timeout // 10);
    while (time < $end) {
        return 1 if $cond->($self->table);
        sleep 0.05;
    }
    return 0;
}

# node($table, 'decode-0') -> that node's record ({} when absent)
sub node {
    my ($t, $id) = @_;
    my ($n) = grep { $_->{id} eq $id } @{ $t->{nodes} || [] };
    return $n || {};
}

# http_config(server_params => 'max_fails=3', decode_keepalive => N):
# tokenizer, state table,
# upstream prefill (127.0.0.2) and decode (127.0.0.3-4), ports filled in
sub http_config {
    my ($self, %o) = @_;
    return DPD::Pools::tokenizer_conf()
        . "    dpd_state_table " . $self->router->state_path
        . " check=100ms stale=3s;\n\n"
        . DPD::Pools::upstream_conf(name => 'prefill', port => $self->port,
                                    hosts => ['127.0.0.2'])
        . "\n"
        . DPD::Pools::upstream_conf(name => 'decode', port => $self->port,
                                    hosts => ['127.0.0.3', '127.0.0.4'],
                                    server_params => $o{server_params},
                                    lines => [$o{decode_keepalive}
                                              ? "keepalive $o{decode_keepalive};"
                                              : ()]);
}

1;

__END__

=head1 NAME

DPD::KvMesh - router + prefill + 2 decode kv_agents with their vLLM
emulators, connected, for the dpd_protocol kv_agent tests

=head1 SYNOPSIS

    use Test::Nginx::Socket;
    use DPD::KvMesh;

    plan(skip_all => $_) for DPD::KvMesh->unavailable;
    plan('no_plan');          # after the skip: never plan twice
    my $mesh = DPD::KvMesh->start(tmp => 'dpd-kva-t4', blocks => 256,
                                  dead_after_ms => 3000);
    our $P = $mesh->engine('prefill-0');              # 127.0.0.2
    our %D = map { $_ => $mesh->engine($_) } qw(decode-0 decode-1);
    our %DA = map { $_ => $mesh->agent($_) } qw(decode-0 decode-1);
    my $http_config = $mesh->http_config;

=head1 DESCRIPTION

C<start> starts, in this order, the agents router-0 (control port
$DPD_KVA_AGENT_PORT, default 18900), decode-0 (+2), decode-1 (+3) and
prefill-0 (+1), each with a host pool of C<blocks> blocks (default 256)
and heartbeat 100 ms / dead after C<dead_after_ms> (default 3000); then
the emulators prefill-0 on 127.0.0.2, decode-0 on 127.0.0.3 and decode-1
on 127.0.0.4 (port $DPD_KVA_EMU_PORT, default 19690; side channel +1; no
LMCache; Llama 3 tokenizer; time_scale 0.01; kv_connect_timeout 0.5), each
registered with its agent.  It returns once every agent is connected and
the router's table shows 4 nodes alive.  Sets $TEST_NGINX_LLAMA3,
$TEST_NGINX_LLAMA3_CONFIG, $TEST_NGINX_LONG, $TEST_NGINX_EMU_PORT and
$TEST_NGINX_STATE (the router's state table).

=head1 METHODS

  unavailable()             () or why agents / the tokenizer cannot run
  agent($id) router         DPD::KvAgent objects (router-0, prefill-0,
                            decode-0, decode-1)
  engine($id)               DPD::Emu objects (prefill-0, decode-0,
                            decode-1)
  port emu_options          the emulators' port and start options (for
                            one more engine)
  table                     the router's state table as a hash
  table_wait(sub { $t }, $timeout)  poll the table until the sub is true
  node($table, $id)         a node's record in a table (a function)
  http_config(server_params => '...')
        dpd_tokenizer LLAMA3.json config=LLAMA3_CONFIG.json;
        dpd_state_table STATE check=100ms stale=3s;

        upstream prefill {          # zone, dpd_balance
            server 127.0.0.2:PORT;
        }

        upstream decode {           # zone, dpd_balance
            server 127.0.0.3:PORT SERVER_PARAMS;
            server 127.0.0.4:PORT SERVER_PARAMS;
        }

=cut
