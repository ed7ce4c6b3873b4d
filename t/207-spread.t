# Load spread with two workers and many concurrent requests: dpd_balance
# counts outstanding requests in the upstream zone, so both workers see
# all of them; the lmcache pin holds under concurrency (every decode lands
# where its KV was pushed); a slow decoder gets fewer requests than a fast
# one (least outstanding, not round robin).
use strict;
use warnings;

use Test::Nginx::Socket 'no_plan';
use DPD::Emu;
use JSON::PP ();
use LWP::UserAgent ();
use HTTP::Request ();
use POSIX ();

my ($tj, $tc) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'Llama 3 tokenizer fixture not installed (make deps)')
    unless $tj && $tc;
plan(skip_all => 'build/libdpdtok.so missing (make)')
    unless DPD::Emu->have_tokenizer_lib;

my $base = $ENV{DPD_TEST_PORT_BASE} || 18600;
my $port = $base + 70;
my %emu = (port => $port, side_channel_port => $base + 71,
           lmcache_init_port => $base + 72, lmcache_alloc_port => $base + 73,
           tokenizer => 'llama3', time_scale => 0.02, kv_hold_timeout => 30);

our @prefill = DPD::Emu->start_many(count => 2, first => 2, role => 'prefill',
                                    %emu);
our @decode = DPD::Emu->start_many(count => 2, first => 4, role => 'decode',
                                   %emu);

$ENV{TEST_NGINX_LLAMA3} = $tj;
$ENV{TEST_NGINX_LLAMA3_CONFIG} = $tc;
$ENV{TEST_NGINX_EMU_PORT} = $port;
$ENV{TEST_NGINX_LMC_INIT} = $base + 72;
$ENV{TEST_NGINX_LMC_ALLOC} = $base + 73;
$ENV{TEST_NGINX_LONG} = join ' ', ('the quick brown fox jumps over the lazy dog') x 60;

our $N = $ENV{DPD_SPREAD_REQUESTS} || 32;     # requests per block
our $C = 8;                                    # concurrent clients

my $http_config = <<'_EOC_';
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;

    upstream prefill {
        dpd_balance;
        zone prefill 64k;
        server 127.0.0.2:$TEST_NGINX_EMU_PORT;
        server 127.0.0.3:$TEST_NGINX_EMU_PORT;
    }

    upstream decode {
        dpd_balance;
        zone decode 64k;
        server 127.0.0.4:$TEST_NGINX_EMU_PORT;
        server 127.0.0.5:$TEST_NGINX_EMU_PORT;
        dpd_lmcache_ports init=$TEST_NGINX_LMC_INIT alloc=$TEST_NGINX_LMC_ALLOC;
    }
_EOC_

my $config = <<'_EOC_';
    dpd_threshold 256;
    dpd_prefill_timeout 30s;
    proxy_http_version 1.1;

    location /v1/ {
        dpd on;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode;
    }

    location /lm/ {
        dpd on;
        dpd_protocol lmcache;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode/;
    }

    location /_dpd_prefill/ {
        internal;
        proxy_pass http://prefill/;
    }

    location = /workers { return 200 "ok\n"; }
_EOC_

master_on();
workers(2);

add_block_preprocessor(sub {
    my $block = shift;
    $block->set_value('http_config', $http_config)
        unless defined $block->http_config;
    $block->set_value('config', $config) unless defined $block->config;
    $block->set_value('request', "GET /workers") unless defined $block->request;
    $block->set_value('response_body', "ok\n")
        unless defined $block->response_body;
    $block->set_value('timeout', 60) unless defined $block->timeout;
});

our %STATUS;

# $N requests from $C concurrent clients; statuses by request id in %STATUS
sub blast {
    my ($path, $prefix, %body) = @_;
    my $url = "http://127.0.0.1:" . server_port() . $path;
    my @kids;
    pipe(my $r, my $w) or die "pipe: $!";
    for my $k (0 .. $C - 1) {
        my $pid = fork // die "fork: $!";
        if ($pid == 0) {
            close $r;
            my $ua = LWP::UserAgent->new(timeout => 60, keep_alive => 1);
            for (my $i = $k; $i < $N; $i += $C) {
                my $req = HTTP::Request->new(POST => $url);
                $req->header('Content-Type' => 'application/json');
                $req->header('X-Request-Id' => "$prefix-$i");
                $req->content(JSON::PP->new->encode({model => 'm',
                    prompt => "$i $ENV{TEST_NGINX_LONG}", max_tokens => 4,
                    %body}));
                my $res;
                for (1 .. 50) {    # nginx may still be starting (valgrind)
                    $res = $ua->request($req);
                    last unless $res->code == 500
                                && ($res->header('Client-Warning') // '')
                                   eq 'Internal response';
                    select undef, undef, undef, 0.2;
                }
                print $w "$prefix-$i " . $res->code . "\n";
            }
            close $w;
            POSIX::_exit(0);
        }
        push @kids, $pid;
    }
    close $w;
    while (my $line = <$r>) {
        my ($id, $code) = split ' ', $line;
        $STATUS{$id} = $code;
    }
    waitpid $_, 0 for @kids;
}

sub per_decoder {
    my ($prefix) = @_;
    return map { my $d = $_;
                 scalar grep { $_->{request_id} =~ /^$prefix-\d+$/ } $d->requests }
           @decode;
}

no_shuffle();
log_level('warn');
run_tests();

# --- the spread ---------------------------------------------------------------

sub band_ok {
    my ($what, @n) = @_;
    my $total = 0;
    $total += $_ for @n;
    is $total, $N, "$what: every request decoded once";
    my $lo = int($N * 0.25);
    ok !(grep { $_ < $lo } @n), "$what: both decoders busy (@n, at least $lo each)";
}

is scalar(grep { $STATUS{$_} == 200 } grep { /^nixl-/ } keys %STATUS), $N,
    'nixl: all requests answered 200';
band_ok('nixl', per_decoder('nixl'));
{
    my @p = map { my $e = $_; scalar grep { $_->{request_id} =~ /^nixl-\d+$/ } $e->requests } @prefill;
    ok !(grep { $_ < int($N * 0.25) } @p), "nixl: both prefill engines busy (@p)";
    my @cached = grep { ($_->{cached_tokens} // 0) > 0 }
                 grep { $_->{request_id} =~ /^nixl-\d+$/ } map { $_->requests } @decode;
    is scalar(@cached), $N, 'nixl: every decode reused the transferred KV';
}

is scalar(grep { $STATUS{$_} == 200 } grep { /^lmc-/ } keys %STATUS), $N,
    'lmcache: all requests answered 200';
band_ok('lmcache', per_decoder('lmc'));
{
    my @recs = grep { $_->{request_id} =~ /^lmc-\d+$/ } map { $_->requests } @decode;
    my @hit = grep { ($_->{cached_tokens} // 0) == $_->{prompt_tokens} - 1 } @recs;
    is scalar(@hit), $N,
        'lmcache: under concurrency every decode went to the decoder that got its KV';
}

{
    my ($slow, $fast) = per_decoder('skew');
    is $slow + $fast, $N, 'skewed decoders: every request decoded once';
    cmp_ok $fast, '>=', $slow * 2,
        "least outstanding: the fast decoder took most ($fast vs $slow)";
}

__DATA__

=== TEST 1: nixl: concurrent requests over two workers spread
--- init
main::blast('/v1/completions', 'nixl');
--- no_error_log
[error]
[alert]



=== TEST 2: lmcache: concurrent requests spread, each pinned where its KV went
--- init
main::blast('/lm/v1/completions', 'lmc');
--- no_error_log
[error]
[alert]



=== TEST 3: a slow decoder gets fewer requests than a fast one
--- init
$main::decode[0]->fault(delay_ms => 300, role => 'decode');
main::blast('/v1/completions', 'skew', prompt => 'short');
$main::decode[0]->clear_faults;
--- no_error_log
[alert]
