# dpd_prefix_cache approximate (issue 23): the decoder is chosen by the
# prompt's cached blocks and its load, then disaggregation is decided on
# the tokens that decoder does not hold.  Off keeps today's decisions; turn
# 2 of a conversation goes where turn 1 went (direct when what is left is
# short); $dpd_cached_tokens / $dpd_uncached_tokens; cache_salt and the
# model isolate; entries expire; a full zone cuts prompts short without
# failing requests; the load guard overrides a hot decoder; with nixl the
# decoder is pinned before the prefill; a decoder or prefiller that fails
# (5xx, prefill fallen back) is not remembered as holding the prompt;
# nginx -t refuses bad parameters.
# The decoders are server blocks of the same nginx answering their port.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;
use JSON::PP ();
use LWP::UserAgent ();
use HTTP::Request ();
use POSIX ();
use Time::HiRes ();
use File::Temp ();
use File::Spec ();
use File::Basename ();

my ($tj, $tc) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'Llama 3 tokenizer fixture not installed (make deps)')
    unless $tj && $tc;
plan('no_plan');   # after the skip checks: a skip must not plan twice

$ENV{TEST_NGINX_LLAMA3} = $tj;

# backend ports: DPD_TEST_PORT_BASE (default 18600) + 40..42
my $base = $ENV{DPD_TEST_PORT_BASE} || 18600;
$ENV{TEST_NGINX_B1} = $base + 40;
$ENV{TEST_NGINX_B2} = $base + 41;
$ENV{TEST_NGINX_PF} = $base + 42;
$ENV{TEST_NGINX_PF2} = $base + 43;
$ENV{TEST_NGINX_SLOW} = 'x' x 2500;

our $JSON = JSON::PP->new->canonical;
our $UA = LWP::UserAgent->new(timeout => 60, keep_alive => 1);

# a completions body with token ids: runs of (id, count)
sub ids {
    my (%o) = @_;
    my @ids = map { ($_->[0]) x $_->[1] } @{ $o{runs} };
    my $b = { model => $o{model} // 'm', prompt => \@ids, max_tokens => 1 };
    $b->{cache_salt} = $o{salt} if defined $o{salt};
    return $JSON->encode($b);
}

# POST through nginx: (status, body, X-Cached, X-Uncached, X-Route)
sub post {
    my ($path, $body, %hdr) = @_;
    my $req = HTTP::Request->new(POST => "http://127.0.0.1:"
                                         . server_port() . $path);
    $req->header('Content-Type' => 'application/json');
    $req->header($_ => $hdr{$_}) for keys %hdr;
    $req->content($body);
    my $res;
    for (1 .. 50) {    # nginx may still be starting
        $res = $UA->request($req);
        last unless $res->code == 500
                    && ($res->header('Client-Warning') // '') eq
                       'Internal response';
        select undef, undef, undef, 0.2;
    }
    my $port = $res->content;
    $port =~ s/\s+$//;
    return ($res->code, $port, scalar $res->header('X-Cached'),
            scalar $res->header('X-Uncached'),
            scalar $res->header('X-Route'),
            scalar $res->header('X-Prefill'),
            scalar $res->header('X-Prefix-Time'));
}

sub metric {
    my ($name) = @_;
    my $res = $UA->get("http://127.0.0.1:" . server_port() . "/metrics");
    return $res->content =~ /^\Q$name\E (\d+)$/m ? $1 : undef;
}

add_block_preprocessor(sub {
    my $block = shift;

    $block->set_value('request', "GET /ok") unless defined $block->request;
    $block->set_value('response_body', "ok\n")
        unless defined $block->response_body;
    $block->set_value('timeout', 60) unless defined $block->timeout;

    if (!defined $block->http_config) {
        $block->set_value('http_config', <<'_EOC_');
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    upstream pool {
        dpd_balance;
        zone pool 64k;
        server 127.0.0.1:$TEST_NGINX_B1;
        server 127.0.0.1:$TEST_NGINX_B2;
    }
    upstream prefill {
        server 127.0.0.1:$TEST_NGINX_PF;
    }
    upstream prefills {
        dpd_balance;
        zone prefills 64k;
        server 127.0.0.1:$TEST_NGINX_PF;
        server 127.0.0.1:$TEST_NGINX_PF2;
    }
    server {
        listen 127.0.0.1:$TEST_NGINX_B1;
        listen 127.0.0.1:$TEST_NGINX_B2;
        location / { return 200 "$server_port\n"; }
        location /slow/ {
            limit_rate 1000;
            return 200 "$TEST_NGINX_SLOW";
        }
    }
    server {
        listen 127.0.0.1:$TEST_NGINX_PF;
        listen 127.0.0.1:$TEST_NGINX_PF2;
        location / {
            default_type application/json;
            return 200 '{"id":"p","object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":"length"}],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e","remote_block_ids":[1],"remote_request_id":"p","remote_host":"127.0.0.1","remote_port":5600}}';
        }
    }
_EOC_
    }
});

# the checks of each block (its --- init), run with nginx up

# TEST 11: keys aimed at one bucket of the zone's hash table.  The key
# function is public (dpd_prefix.h) and a completions prompt may be token
# ids, so a client can pick ids whose keys share their low bits; with the
# bucket taken from those bits every insert and lookup walks one chain
# under the zone mutex (quadratic in the prompt, all workers stalled).
# The generator is compiled here from the real header.
our $COLLIDE_C = <<'_C_';
#include <stdio.h>
#include <stdlib.h>
#include "dpd_prefix.h"
int main(int argc, char **argv)
{
    size_t    nb, k, j;
    uint64_t  mask, parent, key;
    uint32_t  ids[16];
    if (argc != 3) return 2;
    nb = strtoul(argv[1], NULL, 10);
    mask = strtoull(argv[2], NULL, 0);
    parent = dpd_prefix_salted(dpd_prefix_seed("m", 1, "", 0), "", 0);
    printf("[");
    for (k = 0; k < nb; k++) {
        for (j = 0; j < 16; j++) ids[j] = 1000 + (uint32_t) ((k * 7 + j) % 20000);
        for (ids[15] = 1000; ; ids[15]++) {
            key = dpd_prefix_block_key(parent, ids, 16);
            if ((key & mask) == 0) break;
        }
        parent = key;
        for (j = 0; j < 16; j++) printf("%s%u", (k || j) ? "," : "", ids[j]);
    }
    printf("]\n");
    return 0;
}
_C_

# TEST 12: a decode pool of more than 64 peers (the candidate bound):
# the cache must not confine every request to the first 64.  (It was
# skipped under make test-asan, blamed for a hang that was the nginx -t
# runs' symbolizer: see tools/san/llvm-symbolizer.)
{
    # one wildcard listener, 66 peer addresses 127.0.0.1 .. 127.0.0.66
    my $port = $base + 100;
    $ENV{TEST_NGINX_BIG_PORT} = $port;
    $ENV{TEST_NGINX_BIG_SERVERS} = join '', map {
        "server 127.0.0.$_:$port;\n        " } 1 .. 66;
}

sub init_12 {
    my %seen;
    for my $i (0 .. 66 * 3 - 1) {
        my ($c, $addr) = post('/v1/completions',
                              ids(runs => [[200 + $i, 32]]));
        $seen{$addr}++ if $c == 200;
    }
    my @last = grep { $seen{"127.0.0.$_"} } 65, 66;
    is scalar(keys %seen), 66, 'all 66 decoders got requests ('
        . scalar(keys %seen) . ')';
    is scalar(@last), 2, 'the 65th and 66th among them';
}


sub init_11 {
    my $dir = File::Temp::tempdir(CLEANUP => 1);
    my $cc = $ENV{CC} || 'cc';
    open my $fh, '>', "$dir/collide.c" or die "collide.c: $!";
    print $fh $COLLIDE_C;
    close $fh;
    my $inc = File::Spec->rel2abs(File::Basename::dirname(__FILE__)
                                  . "/../kv_agent/include");
    system("$cc -O2 -I$inc -o $dir/collide $dir/collide.c") == 0
        or die "cannot build the generator";
    # a 1m zone: 4096 buckets (mask 4095), ~15000 entries; 10000 blocks
    my $ids = `$dir/collide 10000 4095`;
    die "generator failed" unless $? == 0 && $ids =~ /^\[/;
    my $aimed = '{"model":"m","max_tokens":1,"prompt":' . $ids . '}';
    my $plain = ids(runs => [map { [1000 + ($_ % 20000), 16] }
                             0 .. 9999]);
    my $time = sub {
        my $t0 = Time::HiRes::time();
        my ($c, undef, $k) = post('/v1/completions', $_[0]);
        return ($c, $k, Time::HiRes::time() - $t0);
    };
    my ($c, $k, $tp) = $time->($plain);
    ($c, $k, $tp) = $time->($plain);
    is $c, 200, 'a plain 160k-token prompt twice: answered';
    my $ta;
    ($c, $k, $ta) = $time->($aimed);
    ($c, $k, $ta) = $time->($aimed);
    is $c, 200, 'the aimed prompt twice: answered';
    cmp_ok $k, '>', 0, "the aimed prompt is remembered ($k tokens)";
    cmp_ok $ta, '<', 3 * $tp + 0.1,
        sprintf('aimed keys cost about what plain ones do (%.3f s vs '
                . '%.3f s)', $ta, $tp);
}


sub init_10 {
    # two prefillers: a conversation's long turns go to the one holding
    # its start (dpd_balance alone would alternate between equal loads)
    my ($c1, $d1, $k1, $u1, $r1, $p1) = post('/v1/completions',
        ids(runs => [[100, 80]]));
    is $r1, 'disaggregated', 'prefill=: turn 1 disaggregated';
    like $p1, qr/^127\.0\.0\.1:\d+$/, "prefill=: turn 1 prefilled on $p1";
    my (undef, undef, undef, undef, $r2, $p2) = post('/v1/completions',
        ids(runs => [[100, 80], [200, 80]]));
    is $r2, 'disaggregated', 'prefill=: turn 2 disaggregated (80 uncached)';
    is $p2, $p1, 'prefill=: turn 2 prefilled where turn 1 was';
    my (undef, undef, undef, undef, $r3, $p3) = post('/v1/completions',
        ids(runs => [[100, 80], [200, 80], [300, 80]]));
    is $p3, $p1, 'prefill=: turn 3 too';
    my (undef, undef, undef, undef, undef, $q1) = post('/v1/completions',
        ids(runs => [[700, 80]]));
    my (undef, undef, undef, undef, undef, $q2) = post('/v1/completions',
        ids(runs => [[800, 80]]));
    isnt $q1, $q2, 'prefill=: new conversations on idle prefillers rotate';
}

# TEST 13: a decoder answering 500 computed nothing: remembering the
# prompt against it at the decision (as before) drew the next turn there
# with $dpd_cached_tokens counting blocks it never held
sub init_13 {
    my @p = ([100, 64], [200, 40]);
    my ($c1, $d1, $k1) = post('/v1/completions', ids(runs => [[100, 64]]),
                              'X-Fail-Decode' => 1);
    is $c1, 500, 'the decoder answered 500';
    my ($c2, $d2, $k2) = post('/v1/completions', ids(runs => \@p));
    is $c2, 200, 'the same prompt again: answered';
    is $k2, 0, '... nothing counted cached for the decoder that failed';
    my ($c3, $d3, $k3) = post('/v1/completions', ids(runs => \@p));
    is $d3, $d2, 'after a success: the next turn goes where it succeeded';
    is $k3, 96, '... learned from the success (6 blocks)';
}

# TEST 14: a prefill that failed (500, fallen back to decode only) leaves
# nothing remembered against the prefiller: the next turn rotates like a
# new prompt on idle prefillers instead of following the failed one
sub init_14 {
    my (undef, undef, undef, undef, $r1, $p1) = post('/v1/completions',
        ids(runs => [[100, 80]]), 'X-Fail-Prefill' => 1);
    is $r1, 'fallback', "the prefill on $p1 failed: fallen back";
    my (undef, undef, undef, undef, $r2, $p2) = post('/v1/completions',
        ids(runs => [[100, 80], [200, 80]]));
    is $r2, 'disaggregated', 'turn 2 disaggregated';
    isnt $p2, $p1, "... not drawn to the failed prefiller $p1 (on $p2: "
        . "rotated as a new prompt)";
    my (undef, undef, undef, undef, $r3, $p3) = post('/v1/completions',
        ids(runs => [[100, 80], [200, 80], [300, 80]]));
    is $p3, $p2, "turn 3 prefilled where turn 2 succeeded ($p2)";
}

sub init_9 {
    # counted (and keyed) in a thread of the pool: the keys come back
    my @p = ([100, 64], [200, 40]);
    my ($c1, $d1, $k1) = post('/v1/completions', ids(runs => [[100, 64]]));
    is $c1, 200, 'thread pool: turn 1 answered';
    is $k1, 0, 'thread pool: nothing cached yet';
    my ($c2, $d2, $k2, $u2) = post('/v1/completions', ids(runs => \@p));
    is $d2, $d1, 'thread pool: turn 2 where turn 1 went';
    is $k2, 64, 'thread pool: 64 cached';
    is $u2, 40, 'thread pool: 40 uncached';
}

sub init_1 {
    my $p = ids(runs => [[100, 64]]);
    my @got = map { [ post('/v1/completions', $p) ] } 1 .. 4;
    is scalar(grep { $_->[0] == 200 } @got), 4, 'off: all answered';
    isnt $got[0][1], $got[1][1], 'off: equally loaded decoders alternate';
    is $got[0][1], $got[2][1], 'off: ... in turn';
    ok !(grep { defined $_->[2] && $_->[2] ne '' } @got),
        'off: $dpd_cached_tokens is empty';
    ok !(grep { defined $_->[6] && $_->[6] ne '' } @got),
        'off: $dpd_prefix_time is empty';
    is $got[0][4], 'direct', 'off: the route by the prompt alone';
}


sub init_2 {
    my ($c1, $d1, $k1, $u1, undef, undef, $t1) =
        post('/v1/completions', ids(runs => [[100, 64]]));
    is $c1, 200, 'turn 1 answered';
    like $t1, qr/^\d+$/, '$dpd_prefix_time: microseconds';
    cmp_ok $t1, '<', 1000000, '$dpd_prefix_time: under a second';
    is $k1, 0, 'turn 1: nothing cached';
    is $u1, 64, 'turn 1: 64 uncached';
    my ($c2, $d2, $k2, $u2, $r2) = post('/v1/completions',
        ids(runs => [[100, 64], [200, 40]]));
    is $d2, $d1, 'turn 2 went to the decoder of turn 1';
    is $k2, 64, 'turn 2: $dpd_cached_tokens 64 (4 blocks)';
    is $u2, 40, 'turn 2: $dpd_uncached_tokens 40';
    is $r2, 'direct', 'turn 2: direct';
    # turn 3 extends turn 2: its 6 full blocks (96 of 104 tokens) are held
    my ($c3, $d3, $k3, $u3) = post('/v1/completions',
        ids(runs => [[100, 64], [200, 40], [300, 20]]));
    is $d3, $d1, 'turn 3 went there too';
    is $k3, 96, 'turn 3: the full blocks of turn 2 cached (96)';
    is $u3, 28, 'turn 3: 28 uncached';
    # another conversation on idle decoders: the other decoder (rotation)
    my ($c4, $d4, $k4) = post('/v1/completions',
                                    ids(runs => [[400, 64]]));
    is $k4, 0, 'a new conversation: nothing cached';
    # a prompt that diverges in block 0 shares nothing
    my (undef, undef, $k5) = post('/v1/completions',
        ids(runs => [[101, 1], [100, 63], [200, 40]]));
    is $k5, 0, 'a prompt differing in its first block: nothing cached';
    is metric('dpd_prefix_routes_total{reason="direct_short"}'), 5,
        'metrics: 5 routes direct_short';
    is metric('dpd_prefix_lookups_total{result="hit"}'), 2,
        'metrics: 2 lookups hit';
    is metric('dpd_prefix_cached_tokens_total'), 160,
        'metrics: 160 cached tokens';
}


sub init_3 {
    my @r = ([[100, 64]]);
    post('/v1/completions', ids(runs => @r, salt => 'alice'));
    my (undef, undef, $k) = post('/v1/completions',
        ids(runs => @r, salt => 'alice'));
    is $k, 64, 'same salt: cached';
    (undef, undef, $k) = post('/v1/completions',
        ids(runs => @r, salt => 'bob'));
    is $k, 0, 'another salt: nothing cached';
    (undef, undef, $k) = post('/v1/completions', ids(runs => @r));
    is $k, 0, 'no salt: nothing cached';
    (undef, undef, $k) = post('/v1/completions',
        ids(runs => @r, salt => ''));
    is $k, 64, 'an empty salt is no salt (as vLLM)';
    (undef, undef, $k) = post('/v1/completions',
        ids(runs => @r, model => 'other'));
    is $k, 0, 'another model: nothing cached';
}


sub init_4 {
    my ($c1, $d1, $k1, $u1, $r1) = post('/v1/completions',
                                              ids(runs => [[100, 80]]));
    is $c1, 200, 'long turn 1 answered';
    is $r1, 'disaggregated', 'turn 1: 80 uncached >= 64: disaggregated';
    my ($c2, $d2, $k2, $u2, $r2) = post('/v1/completions',
        ids(runs => [[100, 80], [200, 16]]));
    is $d2, $d1, 'turn 2: the decoder the nixl decode of turn 1 was pinned to';
    is $k2, 80, 'turn 2: 80 cached';
    is $r2, 'direct', 'turn 2: 16 uncached < 64: direct, no prefill';
    my ($c3, $d3, $k3, $u3, $r3) = post('/v1/completions',
        ids(runs => [[100, 80], [200, 16], [300, 64]]));
    is $d3, $d1, 'turn 3: same decoder';
    is $k3, 96, 'turn 3: 96 cached';
    is $r3, 'disaggregated', 'turn 3: 64 uncached >= 64: disaggregated';
    my (undef, undef, undef, undef, $r4) = post('/v1/completions',
        ids(runs => [[500, 16]]));
    is $r4, 'direct', 'a short prompt stays direct';
    is metric('dpd_prefix_routes_total{reason="direct_cached"}'), 1,
        'metrics: 1 route direct_cached';
    is metric('dpd_prefix_routes_total{reason="disaggregated"}'), 2,
        'metrics: 2 routes disaggregated';
    is metric('dpd_prefix_routes_total{reason="direct_short"}'), 1,
        'metrics: 1 route direct_short';
    is metric('dpd_prefill_requests_total'), 2,
        'metrics: 2 prefills (none for the cached turn)';
}


sub init_5 {
    my $p = ids(runs => [[100, 64]]);
    post('/v1/completions', $p);
    my (undef, undef, $k) = post('/v1/completions', $p);
    is $k, 64, 'within ttl: cached';
    select undef, undef, undef, 1.6;
    (undef, undef, $k) = post('/v1/completions', $p);
    is $k, 0, 'after ttl: nothing cached';
    (undef, undef, $k) = post('/v1/completions', $p);
    is $k, 64, 'remembered again';
}


sub init_6 {
    # 8000 blocks: more than a 256k zone holds (~3500 entries)
    my $big = ids(runs => [map { [1000 + $_, 16] } 0 .. 7999]);
    my ($c, $d, $k) = post('/v1/completions', $big);
    is $c, 200, 'a prompt larger than the zone: answered';
    ($c, undef, $k) = post('/v1/completions', $big);
    is $c, 200, 'again: answered';
    cmp_ok $k, '>', 0, "its start is remembered ($k tokens)";
    cmp_ok $k, '<', 128000, 'not all of it';
    is $k % 16, 0, 'whole blocks';
    my $other = ids(runs => [map { [50000 + $_, 16] } 0 .. 7999]);
    ($c) = post('/v1/completions', $other);
    is $c, 200, 'another big prompt evicts and is answered';
    (undef, undef, $k) = post('/v1/completions',
                                    ids(runs => [[7, 64]]));
    is $k, 0, 'a small prompt still works after the evictions';
    (undef, undef, $k) = post('/v1/completions',
                                    ids(runs => [[7, 64]]));
    is $k, 64, '... and is remembered';
}


sub init_7 {
    # 4096 ids: 256 blocks; three slow requests keep the decoder that holds
    # them busy (conns 3 vs 0)
    my $p = ids(runs => [[100, 4096]]);
    my (undef, $hot) = post('/v1/completions', $p);
    my @kids;
    for (1 .. 3) {
        my $pid = fork // die "fork: $!";
        if ($pid == 0) {
            # a connection of its own (not the parent's kept-alive one)
            $UA = LWP::UserAgent->new(timeout => 60);
            post('/slow/v1/completions', $p);
            POSIX::_exit(0);
        }
        push @kids, $pid;
        select undef, undef, undef, 0.2;
    }
    select undef, undef, undef, 0.3;
    my (undef, $d1, $k1) = post('/noguard/v1/completions', $p);
    is $d1, $hot, 'without the guard: the cost (256 uncached blocks > 3 '
                  . 'requests x 32) keeps the cached decoder';
    is $k1, 4096, '... with everything cached';
    my (undef, $d2, $k2) = post('/v1/completions', $p);
    isnt $d2, $hot, 'with imbalance=2:1.5: 3 - 0 > 2 and 3 > 1.5 x 0: the '
                    . 'idle decoder';
    is $k2, 0, '... where nothing is cached';
    waitpid $_, 0 for @kids;
}


sub init_8 {
    my @m = ({ role => 'system', content => 'You are a helpful assistant. ' x 20 },
             { role => 'user', content => 'Tell me about the tides.' });
    my $chat = sub {
        my $q = HTTP::Request->new(POST => "http://127.0.0.1:" . server_port()
                                           . "/v1/chat/completions");
        $q->content($JSON->encode({ model => 'm', messages => \@m }));
        my $res;
        for (1 .. 50) {    # nginx may still be starting (valgrind)
            $res = $UA->request($q);
            last unless $res->code == 500
                        && ($res->header('Client-Warning') // '') eq
                           'Internal response';
            select undef, undef, undef, 0.2;
        }
        return $res;
    };
    my $res = $chat->();
    my $n1 = $res->header('X-Tokens');
    push @m, { role => 'assistant', content => 'The moon pulls the sea.' },
             { role => 'user', content => 'And the sun?' };
    $res = $chat->();
    my $k = $res->header('X-Cached');
    is $res->code, 200, 'chat turn 2 answered';
    cmp_ok $k, '>=', int($n1 / 16) * 16 - 16,
        "turn 2 holds turn 1's full blocks ($k of $n1)";
    cmp_ok $k, '<=', $n1, '... and no more';
}


no_shuffle();
log_level('info');
run_tests();

# --- nginx -t: the directive's errors -------------------------------------

SKIP: {
    my $so = (split ' ', $ENV{TEST_NGINX_LOAD_MODULES} // '')[0];
    skip 'no module to load (TEST_NGINX_LOAD_MODULES)', 30
        unless $so && -f $so;
    my $dir = server_root();
    mkdir "$dir/conf";
    mkdir "$dir/logs";
    my $bin = $ENV{TEST_NGINX_BINARY} || 'nginx';

    my @cases = (
        ['maybe', qr/invalid mode "maybe"/],
        ['off block=16', qr/takes no parameters with "off"/],
        ['approximate block=0', qr/invalid "block=0"/],
        ['approximate block=abc', qr/invalid "block=abc"/],
        ['approximate block=4096', qr/invalid "block=4096"/],
        ['approximate ttl=0', qr/invalid "ttl=0"/],
        ['approximate ttl=soon', qr/invalid "ttl=soon"/],
        ['approximate zone=:1m', qr/invalid zone name/],
        ['approximate zone=z:1k', qr/invalid zone size "zone=z:1k"/],
        ['approximate weights=1', qr/invalid parameter "weights=1"/],
        ['approximate weights=0:0', qr/invalid parameter "weights=0:0"/],
        ['approximate imbalance=3:0.5',
         qr/invalid parameter "imbalance=3:0.5"/],
        ['approximate imbalance=x:2', qr/invalid parameter "imbalance=x:2"/],
        ['approximate file=/x', qr/invalid parameter "file=\/x"/],
        ['events', qr/needs "file=PATH" with "events"/],
        ['events zone=z:1m file=/x', qr/invalid parameter "zone=z:1m"/],
        ['approximate size=1m', qr/invalid parameter "size=1m"/],
        ['approximate prefill=', qr/invalid parameter "prefill="/],
        ['approximate prefill=plain', qr/prefill=plain: .*must use "dpd_balance"/],
        ['approximate prefill=nosuch', qr/prefill=nosuch/],
    );

    my $run = sub {
        my ($directive, $decode) = @_;
        open my $out, '>', "$dir/conf/prefix-test.conf" or die $!;
        print $out <<"EOF";
load_module $so;
pid $dir/logs/prefix-test.pid;
error_log $dir/logs/prefix-test.log;
events { worker_connections 64; }
http {
    access_log off;
    dpd_tokenizer $tj;
    upstream pool { dpd_balance; zone pool 64k; server 127.0.0.1:1; }
    upstream plain { server 127.0.0.1:1; }
    server {
        listen 127.0.0.1:1;
        location / {
            dpd on;
            $decode
            $directive
            proxy_pass http://pool;
        }
    }
}
EOF
        close $out;
        # into a file, not a pipe: a process nginx leaves behind (the
        # sanitizer's symbolizer once hung so) cannot hold the harness.
        # No LeakSanitizer (make test-asan): a successful `nginx -t`
        # returns from main() without destroying its cycle, so all the
        # pool cleanups would free (the tokenizer) shows as leaked
        local $ENV{DPD_SAN_LEAKS} = 0;
        system("$bin -t -p $dir -c conf/prefix-test.conf "
               . ">$dir/logs/prefix-test.out 2>&1");
        my $rc = $? >> 8;
        open my $in, '<', "$dir/logs/prefix-test.out" or die $!;
        my $res = do { local $/; <$in> };
        return ($rc, $res);
    };

    for my $c (@cases) {
        my ($rc, $res) = $run->("dpd_prefix_cache $c->[0];",
                                'dpd_decode_upstream pool;');
        isnt $rc, 0, "nginx -t fails: dpd_prefix_cache $c->[0]";
        like $res, $c->[1], "... with the reason ($c->[0])" or diag $res;
    }

    my ($rc, $res) = $run->("dpd_prefix_cache approximate;\n"
                            . "dpd_prefix_cache off;",
                            'dpd_decode_upstream pool;');
    like $res, qr/"dpd_prefix_cache" directive is duplicate/,
        'a second dpd_prefix_cache in one block is refused';

    ($rc, $res) = $run->('dpd_prefix_cache approximate;', '');
    like $res, qr/"dpd_prefix_cache" needs "dpd_decode_upstream"/,
        'the cache needs the decode pool it chooses in';

    ($rc, $res) = $run->('dpd_prefix_cache approximate;',
                         'dpd_decode_upstream plain;');
    like $res, qr/must use "dpd_balance"/,
        'the decode pool must use dpd_balance' or diag $res;

    ($rc, $res) = $run->('dpd_prefix_cache approximate zone=z:1m block=32 '
                         . 'ttl=30s weights=2:16 imbalance=32:1.25;',
                         'dpd_decode_upstream pool;');
    is $rc, 0, 'every parameter together passes nginx -t' or diag $res;

    ($rc, $res) = $run->('dpd_prefix_cache events file=/dev/shm/none '
                         . 'block=16 imbalance=off;',
                         'dpd_decode_upstream pool;');
    is $rc, 0, 'events with a file that does not exist yet passes nginx -t'
        or diag $res;
}

__DATA__

=== TEST 1: off: decisions as today (equal load alternates, no cache variables)
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 1000;
        dpd_decode_upstream pool;
        dpd_prefix_cache off;
        add_header X-Cached $dpd_cached_tokens always;
        add_header X-Prefix-Time $dpd_prefix_time always;
        add_header X-Route $dpd_route always;
        proxy_pass http://pool;
    }
    location = /ok { return 200 "ok\n"; }
--- init
main::init_1();
--- no_error_log
[error]
[alert]



=== TEST 2: approximate: turn 2 goes where turn 1 went, direct, with cached tokens
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 1000;
        dpd_decode_upstream pool;
        dpd_prefix_cache approximate;
        add_header X-Cached $dpd_cached_tokens always;
        add_header X-Uncached $dpd_uncached_tokens always;
        add_header X-Prefix-Time $dpd_prefix_time always;
        add_header X-Route $dpd_route always;
        proxy_pass http://pool;
    }
    location = /ok { return 200 "ok\n"; }
    location = /metrics { dpd_metrics; }
--- init
main::init_2();
--- no_error_log
[error]
[alert]



=== TEST 3: cache_salt and the model isolate
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 1000;
        dpd_decode_upstream pool;
        dpd_prefix_cache approximate;
        add_header X-Cached $dpd_cached_tokens always;
        proxy_pass http://pool;
    }
    location = /ok { return 200 "ok\n"; }
--- init
main::init_3();
--- no_error_log
[error]
[alert]



=== TEST 4: threshold on the uncached tokens; nixl pins the decoder before the prefill
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 64;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        dpd_decode_upstream pool;
        dpd_prefix_cache approximate;
        add_header X-Cached $dpd_cached_tokens always;
        add_header X-Uncached $dpd_uncached_tokens always;
        add_header X-Route $dpd_route always;
        proxy_pass http://pool;
    }
    location /_dpd_prefill/ {
        internal;
        proxy_pass http://prefill/;
    }
    location = /ok { return 200 "ok\n"; }
    location = /metrics { dpd_metrics; }
--- init
main::init_4();
--- no_error_log
[error]
[alert]



=== TEST 5: entries expire after ttl
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 1000;
        dpd_decode_upstream pool;
        dpd_prefix_cache approximate ttl=1s;
        add_header X-Cached $dpd_cached_tokens always;
        proxy_pass http://pool;
    }
    location = /ok { return 200 "ok\n"; }
--- init
main::init_5();
--- no_error_log
[error]
[alert]



=== TEST 6: a full zone cuts prompts short, every request still answered
--- config
    client_body_buffer_size 4m;
    location /v1/ {
        dpd on;
        dpd_threshold 1000000;
        dpd_decode_upstream pool;
        dpd_prefix_cache approximate zone=tiny:256k;
        add_header X-Cached $dpd_cached_tokens always;
        proxy_pass http://pool;
    }
    location = /ok { return 200 "ok\n"; }
--- init
main::init_6();
--- no_error_log
[error]
[alert]
[crit]



=== TEST 7: the load guard: a hot decoder loses to an idle one despite its cache
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 100000;
        dpd_decode_upstream pool;
        dpd_prefix_cache approximate imbalance=2:1.5;
        add_header X-Cached $dpd_cached_tokens always;
        proxy_pass http://pool;
    }
    location /noguard/v1/ {
        dpd on;
        dpd_threshold 100000;
        dpd_decode_upstream pool;
        dpd_prefix_cache approximate imbalance=off;
        add_header X-Cached $dpd_cached_tokens always;
        proxy_pass http://pool/v1/;
    }
    location /slow/v1/ {
        dpd on;
        dpd_threshold 100000;
        dpd_decode_upstream pool;
        dpd_prefix_cache approximate imbalance=off;
        proxy_pass http://pool/slow/;
    }
    location = /ok { return 200 "ok\n"; }
--- init
main::init_7();
--- no_error_log
[error]
[alert]



=== TEST 8: a chat conversation: turn 2 finds turn 1's rendered prompt
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 100000;
        dpd_decode_upstream pool;
        dpd_prefix_cache approximate;
        add_header X-Cached $dpd_cached_tokens always;
        add_header X-Tokens $dpd_prompt_tokens always;
        proxy_pass http://pool;
    }
    location = /ok { return 200 "ok\n"; }
--- init
main::init_8();
--- no_error_log
[error]
[alert]



=== TEST 9: keys made in a dpd_count_thread_pool thread
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 1000;
        dpd_count_thread_pool default min_size=1;
        dpd_decode_upstream pool;
        dpd_prefix_cache approximate;
        add_header X-Cached $dpd_cached_tokens always;
        add_header X-Uncached $dpd_uncached_tokens always;
        proxy_pass http://pool;
    }
    location = /ok { return 200 "ok\n"; }
--- init
main::init_9();
--- no_error_log
[error]
[alert]



=== TEST 10: prefill=: the prefiller by its own cached prefix
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 64;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        dpd_decode_upstream pool;
        dpd_prefix_cache approximate prefill=prefills;
        add_header X-Cached $dpd_cached_tokens always;
        add_header X-Route $dpd_route always;
        add_header X-Prefill $dpd_prefill_peer always;
        proxy_pass http://pool;
    }
    location /_dpd_prefill/ {
        internal;
        proxy_pass http://prefills/;
    }
    location = /ok { return 200 "ok\n"; }
--- init
main::init_10();
--- no_error_log
[error]
[alert]



=== TEST 11: keys aimed at one bucket do not make the zone quadratic
--- config
    client_body_buffer_size 4m;
    location /v1/ {
        dpd on;
        dpd_threshold 1000000;
        dpd_decode_upstream pool;
        dpd_prefix_cache approximate zone=aim:1m;
        add_header X-Cached $dpd_cached_tokens always;
        proxy_pass http://pool;
    }
    location = /ok { return 200 "ok\n"; }
--- init
main::init_11();
--- no_error_log
[error]
[alert]
[crit]



=== TEST 12: more than 64 decoders: none left out of the choice
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    upstream pool {
        dpd_balance;
        zone pool 256k;
        $TEST_NGINX_BIG_SERVERS
    }
    server {
        listen $TEST_NGINX_BIG_PORT;
        location / { return 200 "$server_addr\n"; }
    }
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 1000000;
        dpd_decode_upstream pool;
        dpd_prefix_cache approximate;
        proxy_pass http://pool;
    }
    location = /ok { return 200 "ok\n"; }
--- init
main::init_12();
--- no_error_log
[error]
[alert]
[crit]



=== TEST 13: a decoder that answers 500 is not remembered as holding the prompt
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    upstream pool {
        dpd_balance;
        zone pool 64k;
        server 127.0.0.1:$TEST_NGINX_B1;
        server 127.0.0.1:$TEST_NGINX_B2;
    }
    server {
        listen 127.0.0.1:$TEST_NGINX_B1;
        listen 127.0.0.1:$TEST_NGINX_B2;
        location / {
            if ($http_x_fail_decode) { return 500; }
            return 200 "$server_port\n";
        }
    }
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 1000000;
        dpd_decode_upstream pool;
        dpd_prefix_cache approximate;
        add_header X-Cached $dpd_cached_tokens always;
        proxy_pass http://pool;
    }
    location = /ok { return 200 "ok\n"; }
--- init
main::init_13();
--- no_error_log
[alert]



=== TEST 14: a prefill that fails is not remembered against its prefiller
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    upstream pool {
        dpd_balance;
        zone pool 64k;
        server 127.0.0.1:$TEST_NGINX_B1;
        server 127.0.0.1:$TEST_NGINX_B2;
    }
    upstream prefills {
        dpd_balance;
        zone prefills 64k;
        server 127.0.0.1:$TEST_NGINX_PF;
        server 127.0.0.1:$TEST_NGINX_PF2;
    }
    server {
        listen 127.0.0.1:$TEST_NGINX_B1;
        listen 127.0.0.1:$TEST_NGINX_B2;
        location / { return 200 "$server_port\n"; }
    }
    server {
        listen 127.0.0.1:$TEST_NGINX_PF;
        listen 127.0.0.1:$TEST_NGINX_PF2;
        location / {
            if ($http_x_fail_prefill) { return 500; }
            default_type application/json;
            return 200 '{"id":"p","object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":"length"}],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e","remote_block_ids":[1],"remote_request_id":"p","remote_host":"127.0.0.1","remote_port":5600}}';
        }
    }
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 64;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        dpd_decode_upstream pool;
        dpd_prefix_cache approximate prefill=prefills;
        add_header X-Cached $dpd_cached_tokens always;
        add_header X-Route $dpd_route always;
        add_header X-Prefill $dpd_prefill_peer always;
        proxy_pass http://pool;
    }
    location /_dpd_prefill/ {
        internal;
        proxy_pass http://prefills/;
    }
    location = /ok { return 200 "ok\n"; }
--- init
main::init_14();
--- no_error_log
[alert]
