# dpd_prefix_cache approximate and peers that come and go (nginx 1.27.3+
# "server NAME resolve", a real DNS server on loopback as in
# t/215-resolve.t): a decoder that leaves the upstream loses what the
# index remembered for it, so when it comes back (a new pod at the same
# address, an empty cache) nothing is claimed for it.  Skipped on nginx <
# 1.27.3 and without dnsmasq.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;
use DPD::Pools qw(wait_for);
use File::Temp ();
use HTTP::Request ();
use JSON::PP ();
use LWP::UserAgent ();
use POSIX ();

sub nginx_version {
    my $bin = $ENV{TEST_NGINX_BINARY} || 'nginx';
    my $v = `$bin -v 2>&1` // '';
    return $v =~ m{nginx/(\d+)\.(\d+)\.(\d+)} ? $1 * 1000000 + $2 * 1000 + $3
                                              : 0;
}

our $DNSMASQ = (grep { -x } map { "$_/dnsmasq" }
                qw(/usr/sbin /usr/local/sbin /usr/bin))[0];

my ($tj, $tc) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'Llama 3 tokenizer fixture not installed (make deps)')
    unless $tj && $tc;
plan(skip_all => 'nginx ' . ($ENV{TEST_NGINX_BINARY} || 'nginx')
     . ' is older than 1.27.3: no "resolve" in open-source nginx')
    if nginx_version() < 1027003;
plan(skip_all => 'dnsmasq not installed (tools/deps.sh: dnsmasq-base)')
    unless $DNSMASQ;
plan('no_plan');   # after the skip checks: a skip must not plan twice

$ENV{TEST_NGINX_LLAMA3} = $tj;

my $base = DPD::Pools::port_base();
our $PORT = $base + 145;
$ENV{TEST_NGINX_DEC_PORT} = $PORT;

our $DNS_PORT = $base + 149;
our $DNS_DIR = File::Temp->newdir('dpd-dns-XXXXXX', TMPDIR => 1);
our $HOSTS = "$DNS_DIR/hosts";
our $DNS_PID;
$ENV{TEST_NGINX_DNS_PORT} = $DNS_PORT;

sub hosts {
    my (@last) = @_;
    open my $fh, '>', "$HOSTS.tmp" or die "hosts: $!";
    print $fh "127.0.0.$_ decode.svc.test\n" for @last;
    close $fh;
    chmod 0644, "$HOSTS.tmp";
    rename "$HOSTS.tmp", $HOSTS or die "rename: $!";
    kill 'HUP', $DNS_PID if $DNS_PID;
}

hosts(4, 5);
$DNS_PID = fork // die "fork: $!";
if ($DNS_PID == 0) {
    { no warnings 'exec'; exec $DNSMASQ, '--keep-in-foreground',
         '--conf-file=/dev/null', "--port=$DNS_PORT",
         '--listen-address=127.0.0.1', '--bind-interfaces', '--no-resolv',
         '--no-hosts', "--addn-hosts=$HOSTS", '--local-ttl=0', '--user=root',
         "--pid-file=$DNS_DIR/pid", "--log-facility=$DNS_DIR/log"; }
    POSIX::_exit(127);
}
wait_for('dnsmasq', sub { -s "$DNS_DIR/log"
                          && `cat $DNS_DIR/log` =~ /read \Q$HOSTS\E/ }, 10)
    or die "dnsmasq did not start: " . `cat $DNS_DIR/log`;

END {
    if ($DNS_PID) {
        kill 'TERM', $DNS_PID;
        waitpid $DNS_PID, 0;
    }
}

our $JSON = JSON::PP->new->canonical;

# (decoder address, X-Cached); a fresh connection each time
sub post {
    my ($ids) = @_;
    my $ua = LWP::UserAgent->new(timeout => 30);
    my $req = HTTP::Request->new(POST => "http://127.0.0.1:" . server_port()
                                         . "/v1/completions");
    $req->content($JSON->encode({ model => 'm', prompt => $ids,
                                  max_tokens => 1 }));
    my $res = $ua->request($req);
    my $addr = $res->content;
    $addr =~ s/\s+$//;
    return ($res->code, $addr, scalar $res->header('X-Cached'));
}

# the decoders nginx has now: requests on prompts never seen (nothing
# cached anywhere) go to each in turn
our $FRESH = 1000;
sub peers {
    my %seen;
    for my $i (1 .. 6) {
        my (undef, $a) = post([($FRESH++) x 20]);
        $seen{$a} = 1;
    }
    return join ' ', sort keys %seen;
}

sub init_1 {
    ok wait_for('both decoders', sub { peers() eq '127.0.0.4 127.0.0.5' },
                15), 'both decoders resolved';
    my @p = (100) x 64;
    my ($c, $x, $k) = post(\@p);
    is $c, 200, 'learned';
    ($c, my $again, $k) = post(\@p);
    is $again, $x, 'the same decoder again';
    is $k, 64, '... with 64 cached';

    my $other = $x eq '127.0.0.4' ? 5 : 4;
    hosts($other);
    ok wait_for('the decoder to leave', sub { peers() eq "127.0.0.$other" },
                15), "$x left the upstream";

    hosts(4, 5);
    ok wait_for('the decoder to return',
                sub { peers() eq '127.0.0.4 127.0.0.5' }, 15),
        "$x is back";
    ($c, my $d, $k) = post(\@p);
    is $c, 200, 'answered';
    is $k, 0, 'nothing is claimed for the returned decoder (its entries '
              . 'were dropped when it left)';
}

add_block_preprocessor(sub {
    my $block = shift;
    $block->set_value('request', "GET /ok");
    $block->set_value('response_body', "ok\n");
    $block->set_value('timeout', 90);
    $block->set_value('http_config', <<'_EOC_');
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    resolver 127.0.0.1:$TEST_NGINX_DNS_PORT valid=1s ipv6=off;
    resolver_timeout 2s;
    upstream decode {
        zone decode 64k;
        dpd_balance;
        server decode.svc.test:$TEST_NGINX_DEC_PORT resolve;
    }
    server {
        listen 127.0.0.4:$TEST_NGINX_DEC_PORT;
        listen 127.0.0.5:$TEST_NGINX_DEC_PORT;
        location / { return 200 "$server_addr\n"; }
    }
_EOC_
    $block->set_value('config', <<'_EOC_');
    location /v1/ {
        dpd on;
        dpd_threshold 100000;
        dpd_decode_upstream decode;
        dpd_prefix_cache approximate;
        add_header X-Cached $dpd_cached_tokens always;
        proxy_pass http://decode;
    }
    location = /ok { return 200 "ok\n"; }
_EOC_
});

no_shuffle();
log_level('info');
run_tests();

__DATA__

=== TEST 1: a decoder that leaves the upstream loses its entries
--- init
main::init_1();
--- no_error_log
[error]
[alert]
