# Load spread with two workers and many concurrent requests: dpd_balance
# counts outstanding requests in the upstream zone, so both workers see
# all of them; the lmcache pin holds under concurrency (every decode lands
# where its KV was pushed); a slow decoder gets fewer requests than a fast
# one (least outstanding, not round robin).
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Pools qw(block_defaults count_requests);
use JSON::PP ();
use LWP::UserAgent ();
use HTTP::Request ();
use POSIX ();

plan(skip_all => $_) for DPD::Pools->unavailable;
plan('no_plan');   # after the skip checks: a skip must not plan twice

# ports: $DPD_TEST_PORT_BASE (default 18600) + 70 .. 73
my $pools = DPD::Pools->start(offset => 70, time_scale => 0.02);
our @prefill = $pools->prefill;
our @decode = $pools->decode;

our $N = $ENV{DPD_SPREAD_REQUESTS} || 32;     # requests per block
our $C = 8;                                    # concurrent clients

my $http_config = $pools->http_config(lmcache => 1);

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

block_defaults(http_config => $http_config, config => $config, timeout => 60,
               request => "GET /workers", response_body => "ok\n");

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
    return map { count_requests(qr/^$prefix-\d+$/, $_) } @decode;
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
    my @p = map { count_requests(qr/^nixl-\d+$/, $_) } @prefill;
    ok !(grep { $_ < int($N * 0.25) } @p), "nixl: both prefill engines busy (@p)";
    my @cached = grep { ($_->{cached_tokens} // 0) > 0 }
                 grep { ($_->{client_request_id} // '') =~ /^nixl-\d+$/ } map { $_->requests } @decode;
    is scalar(@cached), $N, 'nixl: every decode reused the transferred KV';
}

is scalar(grep { $STATUS{$_} == 200 } grep { /^lmc-/ } keys %STATUS), $N,
    'lmcache: all requests answered 200';
band_ok('lmcache', per_decoder('lmc'));
{
    my @recs = grep { ($_->{client_request_id} // '') =~ /^lmc-\d+$/ } map { $_->requests } @decode;
    # the decoder's prompt is the prefill's plus its first token (LMCache's
    # proxy): it finds the pushed full chunks, recomputes the last partial
    my @hit = grep { ($_->{cached_tokens} // 0)
                     == int(($_->{prompt_tokens} - 1) / 256) * 256
                     && $_->{cached_tokens} > 0 } @recs;
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
