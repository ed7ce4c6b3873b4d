package DPD::Pools;

# The emulator pools, the nginx http_config and the request helpers shared
# by the disaggregated-path tests (t/203 .. t/207; t/400 and t/410 through
# DPD::KvMesh).  See the POD at the end of the file.

use strict;
use warnings;

use Carp qw(croak);
use Exporter qw(import);
use IO::Socket::INET ();
use JSON::PP ();
use Time::HiRes qw(sleep time);

use DPD::Emu;

our $VERSION = '1.0';

our @EXPORT_OK = qw(block_defaults recs one count_requests long_body
                    wait_for nginx_socket send_post);

# ~600 Llama 3 tokens: over the tests' dpd_threshold (256)
our $LONG_PROMPT = join ' ',
    ('the quick brown fox jumps over the lazy dog') x 60;

sub port_base { $ENV{DPD_TEST_PORT_BASE} || 18600 }

# () when the pools can run here, else the reason (for skip_all)
sub unavailable {
    my ($tj, $tc) = DPD::Emu->tokenizer_files('llama3');
    return 'Llama 3 tokenizer fixture not installed (make deps)'
        unless $tj && $tc;
    return 'build/libdpdtok.so missing (make)'
        unless DPD::Emu->have_tokenizer_lib;
    return ();
}

# $TEST_NGINX_LLAMA3, $TEST_NGINX_LLAMA3_CONFIG, $TEST_NGINX_LONG
sub export_env {
    my ($tj, $tc) = DPD::Emu->tokenizer_files('llama3');
    croak 'DPD::Pools: Llama 3 tokenizer fixture not installed' unless $tj;
    $ENV{TEST_NGINX_LLAMA3} = $tj;
    $ENV{TEST_NGINX_LLAMA3_CONFIG} = $tc;
    $ENV{TEST_NGINX_LONG} = $LONG_PROMPT;
    return ($tj, $tc);
}

# start(offset => N, time_scale => .., prefill => {..}, decode => {..}):
# 2 prefill emulators on 127.0.0.2-3 and 2 decode emulators on 127.0.0.4-5,
# HTTP on port_base + N, side channel + N+1, LMCache init/alloc + N+2/N+3.
sub start {
    my ($class, %o) = @_;
    my $offset = delete $o{offset} // croak 'DPD::Pools: offset';
    my %role = map { $_ => delete $o{$_} || {} } qw(prefill decode);
    my $port = port_base() + $offset;
    my %emu = (port => $port, side_channel_port => $port + 1,
               lmcache_init_port => $port + 2,
               lmcache_alloc_port => $port + 3,
               tokenizer => 'llama3', kv_hold_timeout => 30, %o);

    my $self = bless {emu => \%emu}, $class;
    $self->{prefill} = [DPD::Emu->start_many(count => 2, first => 2,
                                             role => 'prefill',
                                             %emu, %{ $role{prefill} })];
    $self->{decode} = [DPD::Emu->start_many(count => 2, first => 4,
                                            role => 'decode',
                                            %emu, %{ $role{decode} })];
    export_env();
    $ENV{TEST_NGINX_EMU_PORT} = $port;
    $ENV{TEST_NGINX_LMC_INIT} = $port + 2;
    $ENV{TEST_NGINX_LMC_ALLOC} = $port + 3;
    return $self;
}

sub prefill { @{ $_[0]{prefill} } }
sub decode { @{ $_[0]{decode} } }
sub emu_options { %{ $_[0]{emu} } }
sub port { $_[0]{emu}{port} }
sub lmcache_init_port { $_[0]{emu}{lmcache_init_port} }
sub lmcache_alloc_port { $_[0]{emu}{lmcache_alloc_port} }

# --- nginx configuration ---------------------------------------------------

sub tokenizer_conf {
    my ($tj, $tc) = DPD::Emu->tokenizer_files('llama3');
    return "    dpd_tokenizer $tj config=$tc;\n";
}

# upstream_conf(name, port, hosts => [..], server_params => 'max_fails=3',
#               lines => ['keepalive 8;'])
sub upstream_conf {
    my (%o) = @_;
    my $sp = $o{server_params} ? " $o{server_params}" : '';
    return "    upstream $o{name} {\n"
           . "        dpd_balance;\n"
           . "        zone $o{name} 64k;\n"
           . join('', map { "        server $_:$o{port}$sp;\n" }
                          @{ $o{hosts} })
           . join('', map { "        $_\n" } @{ $o{lines} || [] })
           . "    }\n";
}

# http_config(lmcache => 1, prefill_keepalive => N, decode_keepalive => N):
# the tokenizer and the
# upstreams "prefill" (127.0.0.2-3) and "decode" (127.0.0.4-5), ports
# filled in; with lmcache the decoders' dpd_lmcache_ports.
sub http_config {
    my ($self, %o) = @_;
    my $port = $self->port;
    return tokenizer_conf() . "\n"
        . upstream_conf(name => 'prefill', port => $port,
                        hosts => ['127.0.0.2', '127.0.0.3'],
                        lines => [$o{prefill_keepalive}
                                  ? "keepalive $o{prefill_keepalive};"
                                  : ()])
        . "\n"
        . upstream_conf(name => 'decode', port => $port,
                        hosts => ['127.0.0.4', '127.0.0.5'],
                        lines => [($o{lmcache}
                                   ? 'dpd_lmcache_ports init='
                                     . $self->lmcache_init_port . ' alloc='
                                     . $self->lmcache_alloc_port . ';'
                                   : ()),
                                  ($o{decode_keepalive}
                                   ? "keepalive $o{decode_keepalive};"
                                   : ())]);
}

# block_defaults(section => value | sub { my ($block) = @_; value }, ...):
# every block that lacks one of these sections gets it.
sub block_defaults {
    my (%d) = @_;
    Test::Nginx::Socket::add_block_preprocessor(sub {
        my $block = shift;
        for my $k (sort keys %d) {
            next if defined $block->$k;
            $block->set_value($k, ref $d{$k} eq 'CODE' ? $d{$k}->($block)
                                                       : $d{$k});
        }
    });
}

# --- requests and what the engines saw ---------------------------------------

# a completions body with the long prompt, max_tokens 2, %o on top
sub long_body {
    my (%o) = @_;
    return JSON::PP->new->encode({model => 'm', prompt => $LONG_PROMPT,
                                  max_tokens => 2, %o});
}

# the records with this X-Request-Id (the client's, which the engines get
# as X-Client-Request-Id, or the one they got) on these engines, each with
# emu => $e
sub recs {
    my ($id, @emus) = @_;
    return map { my $e = $_;
                 map { {emu => $e, %$_} } $e->requests(request_id => $id) }
           @emus;
}

# the one record with this id (a test that there is exactly one)
sub one {
    my ($what, $id, @emus) = @_;
    my @r = recs($id, @emus);
    Test::More::is(scalar(@r), 1, "$id: exactly one $what request");
    return $r[0] || {};
}

# how many requests with an id matching $re the engine got
sub count_requests {
    my ($re, $emu) = @_;
    return scalar grep { ($_->{client_request_id} // $_->{request_id} // '')
                         =~ $re } $emu->requests;
}

sub wait_for {
    my ($what, $cond, $timeout) = @_;
    my $deadline = time + ($timeout || 10);
    while (time < $deadline) {
        return 1 if $cond->();
        sleep 0.05;
    }
    Test::More::diag("timed out waiting for $what");
    return 0;
}

# a connection to the test nginx (it may still be starting: valgrind)
sub nginx_socket {
    my $port = Test::Nginx::Socket::server_port();
    my $s;
    wait_for('nginx to listen', sub {
        $s = IO::Socket::INET->new(PeerAddr => '127.0.0.1', PeerPort => $port,
                                   Timeout => 5);
    }, 20) or die "connect: $!";
    return $s;
}

# write a JSON POST with this X-Request-Id on the socket (no reading)
sub send_post {
    my ($s, $path, $rid, $body) = @_;
    print $s "POST $path HTTP/1.1\r\nHost: localhost\r\n"
           . "Content-Type: application/json\r\nX-Request-Id: $rid\r\n"
           . "Content-Length: " . length($body) . "\r\n\r\n$body";
}

1;

__END__

=head1 NAME

DPD::Pools - the 2 prefill + 2 decode emulator pools, their nginx
http_config and request helpers for the disaggregated-path tests

=head1 SYNOPSIS

    use Test::Nginx::Socket;
    use DPD::Pools qw(block_defaults recs one);

    plan(skip_all => $_) for DPD::Pools->unavailable;
    plan('no_plan');          # after the skip: never plan twice
    my $pools = DPD::Pools->start(offset => 40, time_scale => 0.01);
    our @prefill = $pools->prefill;      # 127.0.0.2, .3
    our @decode = $pools->decode;        # 127.0.0.4, .5

    my $http_config = $pools->http_config(lmcache => 1);
    my $config = <<'_EOC_';
        location /v1/ { ... }
    _EOC_
    block_defaults(http_config => $http_config, config => $config,
                   timeout => 30);
    run_tests();

    my $d = one('decode', 'req-1', @decode);

=head1 FUNCTIONS AND METHODS

=over

=item unavailable()

() or the reason the pools cannot run here (no Llama 3 tokenizer fixture,
no build/libdpdtok.so), for C<plan(skip_all =E<gt> ...)>.

=item start(offset => N, %emulator_options, prefill => {..}, decode => {..})

Starts 2 prefill emulators on 127.0.0.2-3 and 2 decode emulators on
127.0.0.4-5 (DPD::Emu), all with the Llama 3 tokenizer and
kv_hold_timeout 30.  Ports: HTTP $DPD_TEST_PORT_BASE (default 18600) + N,
NIXL side channel + N+1, LMCache init + N+2, alloc + N+3.  Other options
go to every emulator; C<prefill> / C<decode> hold options for one role
only.  Sets $TEST_NGINX_LLAMA3, $TEST_NGINX_LLAMA3_CONFIG, $TEST_NGINX_LONG
(the long prompt), $TEST_NGINX_EMU_PORT, $TEST_NGINX_LMC_INIT and
$TEST_NGINX_LMC_ALLOC.  Methods: prefill, decode (lists), emu_options (for
one more engine with the same ports), port, lmcache_init_port,
lmcache_alloc_port.

=item $pools->http_config(lmcache => 1, prefill_keepalive => N)

The http{} text (ports and tokenizer paths filled in):

    dpd_tokenizer LLAMA3.json config=LLAMA3_CONFIG.json;

    upstream prefill {
        dpd_balance;
        zone prefill 64k;
        server 127.0.0.2:PORT;
        server 127.0.0.3:PORT;
        keepalive N;                       # prefill_keepalive
    }

    upstream decode {
        dpd_balance;
        zone decode 64k;
        server 127.0.0.4:PORT;
        server 127.0.0.5:PORT;
        dpd_lmcache_ports init=P+2 alloc=P+3;   # lmcache
    }

=item tokenizer_conf(), upstream_conf(name, port, hosts, server_params, lines)

The pieces of the above (DPD::KvMesh builds its http_config from them).

=item block_defaults(section => value | sub { $block }, ...)

One add_block_preprocessor: each block without the section gets the value
(a code ref is called with the block).

=item long_body(%o)

A completions request body: model "m", the long prompt, max_tokens 2,
%o on top.

=item recs($id, @emus), one($what, $id, @emus)

Records with this X-Request-Id (each with C<emu> =E<gt> the engine);
C<one> also tests that there is exactly one and returns it.

=item count_requests(qr/.../, $emu)

How many requests with a matching X-Request-Id the engine got.

=item wait_for($what, sub { cond }, $timeout)

Polls every 50 ms; diag and 0 on timeout.

=item nginx_socket(), send_post($socket, $path, $request_id, $body)

A connection to the test nginx (waits up to 20 s for it to listen) and a
JSON POST written on it, for tests that hang up at a chosen moment.

=back

=cut
