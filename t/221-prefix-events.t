# dpd_prefix_cache events (issue 23): the module reads the prefix index the
# router-role kv_agent writes (kv_agent/include/dpd_prefix_index.h) with
# pread(), never a mapping.  The writer here is tools/prefix_index.py (the
# file format and a Python port of dpd_prefix.h's keys: a port that
# disagreed with the C keys would miss every block below).  Faults: a
# missing file, a shrunk file, a torn slot (odd seq: a writer killed
# mid-update), a broken header, a foreign block size, a node cleared, a
# file replaced by rename, a file of another ABI version (refused with one
# clear line), a writer that exited or stopped beating its heartbeat
# (stale=: cache-blind, counted as result="stale", one warning per
# transition, used again when it beats); nginx answers every request,
# routing as if nothing were cached while the index is unusable, and
# warns.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;
use JSON::PP ();
use LWP::UserAgent ();
use HTTP::Request ();
use File::Temp ();

my ($tj, $tc) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'Llama 3 tokenizer fixture not installed (make deps)')
    unless $tj && $tc;
plan('no_plan');   # after the skip checks: a skip must not plan twice

$ENV{TEST_NGINX_LLAMA3} = $tj;

my $base = $ENV{DPD_TEST_PORT_BASE} || 18600;
$ENV{TEST_NGINX_B1} = $base + 43;
$ENV{TEST_NGINX_B2} = $base + 44;

my $root = $ENV{DPD_ROOT} || '.';
our $TOOL = "python3 $root/tools/prefix_index.py";
# outside the server root, which the harness empties per block
our $DIR = File::Temp::tempdir('dpd-prefix-XXXXXX', TMPDIR => 1,
                               CLEANUP => 1);
our $IDX = "$DIR/prefix.idx";
$ENV{TEST_NGINX_IDX} = $IDX;

our $JSON = JSON::PP->new->canonical;
our $UA = LWP::UserAgent->new(timeout => 60, keep_alive => 1);

sub tool {
    my $cmd = "$TOOL @_ 2>&1";
    my $out = `$cmd`;
    die "prefix_index.py @_: $out" if $?;
}

sub ids {
    my (%o) = @_;
    my @ids = map { ($_->[0]) x $_->[1] } @{ $o{runs} };
    return $JSON->encode({ model => $o{model} // 'm', prompt => \@ids,
                           max_tokens => 1 });
}

# The writer's heartbeat, as the real agent beats every second: before
# each request (nginx under valgrind starts and answers slowly), unless a
# test stops it to play a dead writer
our $BEAT = 1;

sub beat {
    system("$TOOL beat $IDX >/dev/null 2>&1") if $BEAT && -f $IDX;
}

# (status, decoder port, X-Cached)
sub post {
    my ($body) = @_;
    beat();
    my $req = HTTP::Request->new(POST => "http://127.0.0.1:"
                                         . server_port() . "/v1/completions");
    $req->content($body);
    my $res;
    for (1 .. 50) {
        $res = $UA->request($req);
        last unless $res->code == 500
                    && ($res->header('Client-Warning') // '') eq
                       'Internal response';
        select undef, undef, undef, 0.2;
    }
    my $port = $res->content;
    $port =~ s/\s+$//;
    return ($res->code, $port, scalar $res->header('X-Cached'));
}

sub fresh {
    unlink $IDX;
    tool("create $IDX --node 127.0.0.1:$ENV{TEST_NGINX_B1} "
         . "--node 127.0.0.1:$ENV{TEST_NGINX_B2} --slots 65536 @_");
}

# the reader re-stats the file at most once a second
sub tick { select undef, undef, undef, 1.1 }

sub init_1 {
    fresh();
    # node 1 (B2) holds 64 tokens = 4 blocks, node 0 (B1) the first 2
    tool("store $IDX --node-index 1 --model m --repeat 100:64");
    tool("store $IDX --node-index 0 --model m --repeat 100:32");
    my ($c, $d, $k) = post(ids(runs => [[100, 64], [5, 16]]));
    is $c, 200, 'answered';
    is $d, $ENV{TEST_NGINX_B2}, 'the decoder holding more of the prompt';
    is $k, 64, '$dpd_cached_tokens from the index: 64';
    ($c, $d, $k) = post(ids(runs => [[100, 64], [5, 16]], model => 'x'));
    is $k, 0, 'another model: nothing cached';
    ($c, $d, $k) = post(ids(runs => [[100, 32], [6, 32]]));
    is $k, 32, 'a prompt sharing 2 blocks: 32 on either';
    # a long prompt: 2048 blocks (32k tokens), held by node 0
    tool("store $IDX --node-index 0 --model m --repeat 100:32+7:32736");
    ($c, $d, $k) = post(ids(runs => [[100, 32], [7, 32736], [8, 100]]));
    is $d, $ENV{TEST_NGINX_B1}, 'a 32k-token chat: the decoder holding it';
    is $k, 32768, '... all 2048 blocks found';
    # the node is cleared (publisher restart): nothing of it is held
    tool("clear-node $IDX --node-index 0");
    ($c, $d, $k) = post(ids(runs => [[100, 32], [7, 32736], [8, 100]]));
    is $k, 32, '... cleared: only what node 1 holds (block 0..1)';
}

sub init_2 {
    fresh();
    tool("store $IDX --node-index 1 --model m --repeat 100:64");
    my ($c, $d, $k) = post(ids(runs => [[100, 64]]));
    is $k, 64, 'before the faults: cached';

    # shrunk under the reader: a short pread, never SIGBUS
    tool("shrink $IDX 4096");
    ($c, $d, $k) = post(ids(runs => [[100, 64]]));
    is $c, 200, 'shrunk file: answered';
    is $k, 0, 'shrunk file: nothing cached';
    # a short read within the re-stat interval, else the header check
    # against the new size (slow runs: valgrind)
    like `cat ${\ server_root()}/logs/error.log`,
        qr/short read \(shrunk\?\)|corrupt, foreign or truncated/,
        'shrunk file: warned';
    tick();
    ($c, $d, $k) = post(ids(runs => [[100, 64]]));
    is $c, 200, 'shrunk file, re-read: answered';
    is $k, 0, '... nothing cached';

    # missing
    unlink $IDX;
    tick();
    ($c, $d, $k) = post(ids(runs => [[100, 64]]));
    is $c, 200, 'missing file: answered';
    is $k, 0, '... nothing cached';

    # a new file (a new inode) is picked up
    fresh();
    tool("store $IDX --node-index 1 --model m --repeat 100:64");
    tick();
    ($c, $d, $k) = post(ids(runs => [[100, 64]]));
    is $k, 64, 'a recreated file is read again';

    # torn: block 0's slot left odd by a writer that died
    tool("tear $IDX --node-index 0 --model m --repeat 200:64");
    ($c, $d, $k) = post(ids(runs => [[200, 64]]));
    is $c, 200, 'torn slot: answered';
    is $k, 0, 'torn slot at block 0: a miss (whatever follows)';

    # a broken header
    tool("tear-header $IDX");
    tick();
    ($c, $d, $k) = post(ids(runs => [[100, 64]]));
    is $c, 200, 'broken header: answered';
    is $k, 0, '... nothing cached';

    # keys of another block size than ours
    fresh("--block 32");
    tool("store $IDX --node-index 1 --model m --repeat 100:64");
    tick();
    ($c, $d, $k) = post(ids(runs => [[100, 64]]));
    is $c, 200, 'foreign block size: answered';
    is $k, 0, '... nothing cached';
}

sub metric {
    my ($name) = @_;
    my $res = $UA->get("http://127.0.0.1:" . server_port() . "/metrics");
    return $res->content =~ /^\Q$name\E (\d+)$/m ? $1 : undef;
}

sub log_count {
    my ($re) = @_;
    my @l = grep { /$re/ } `cat ${\ server_root()}/logs/error.log`;
    return scalar @l;
}

sub init_3 {
    fresh();
    tool("store $IDX --node-index 1 --model m --repeat 100:64");
    my ($c, $d, $k) = post(ids(runs => [[100, 64]]));
    is $k, 64, 'a live writer: cached';
    is metric('dpd_prefix_lookups_total{result="stale"}'), 0,
       'metrics: no stale lookup yet';

    # a writer killed: its heartbeat stops (here: 10 s old, stale=3s)
    $BEAT = 0;
    tool("beat $IDX --age 10000");
    tick();
    for (1 .. 3) {
        ($c, $d, $k) = post(ids(runs => [[100, 64]]));
        is $c, 200, "no heartbeat within stale=: answered ($_)";
        is $k, 0, '... cache-blind (nothing counted as cached)';
    }
    is metric('dpd_prefix_lookups_total{result="stale"}'), 3,
       'metrics: 3 lookups result="stale"';
    tick();
    ($c, $d, $k) = post(ids(runs => [[100, 64]]));
    is $k, 0, '... still stale a second later';
    is log_count(qr/no writer heartbeat within stale=/), 1,
       '... one warning for the transition, not one a lookup or a second';

    # it beats again: used again, one notice
    $BEAT = 1;
    tool("beat $IDX");
    tick();
    ($c, $d, $k) = post(ids(runs => [[100, 64]]));
    is $k, 64, 'heartbeat back: cached again';
    is log_count(qr/usable again/), 1, '... said once';

    # a clean exit: writer_alive 0, however fresh its last beat
    $BEAT = 0;
    tool("beat $IDX --dead");
    tick();
    ($c, $d, $k) = post(ids(runs => [[100, 64]]));
    is $k, 0, 'the writer exited: cache-blind';
    is log_count(qr/the writer exited/), 1, '... warned';

    # an index of another ABI version (version 1: unsalted slots) is
    # refused, not read
    $BEAT = 1;
    fresh("--version 1");
    tool("store $IDX --node-index 1 --model m --repeat 100:64");
    tick();
    ($c, $d, $k) = post(ids(runs => [[100, 64]]));
    is $c, 200, 'another index version: answered';
    is $k, 0, '... refused: nothing cached';
    ($c, $d, $k) = post(ids(runs => [[100, 64]]));
    tick();
    ($c, $d, $k) = post(ids(runs => [[100, 64]]));
    is log_count(qr/index ABI version 1, this module reads version 2/), 1,
       '... one clear line, not one a request';
    fresh();
    tool("store $IDX --node-index 1 --model m --repeat 100:64");
    tick();
    ($c, $d, $k) = post(ids(runs => [[100, 64]]));
    is $k, 64, 'this version again: read';
}

add_block_preprocessor(sub {
    my $block = shift;

    $block->set_value('request', "GET /ok");
    $block->set_value('response_body', "ok\n");
    $block->set_value('timeout', 60);
    $block->set_value('http_config', <<'_EOC_');
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
        location / { return 200 "$server_port\n"; }
    }
_EOC_
    $block->set_value('config', <<'_EOC_');
    client_body_buffer_size 1m;
    location /v1/ {
        dpd on;
        dpd_threshold 1000000;
        dpd_decode_upstream pool;
        dpd_prefix_cache events file=$TEST_NGINX_IDX stale=3s;
        add_header X-Cached $dpd_cached_tokens always;
        proxy_pass http://pool;
    }
    location = /ok { return 200 "ok\n"; }
    location = /metrics { dpd_metrics; }
_EOC_
});

no_shuffle();
log_level('info');
run_tests();

__DATA__

=== TEST 1: the index says which decoder holds the prompt
--- init
main::init_1();
--- no_error_log
[error]
[alert]
[warn]



=== TEST 2: a shrunk, missing, torn, broken or foreign index: requests answered, nothing cached, warned
--- init
main::init_2();
--- no_error_log
[error]
[alert]
--- error_log
dpd prefix index
routing as if nothing were cached
": missing: routing
corrupt, foreign or truncated
block size differs



=== TEST 3: a dead writer's index (stale=, writer gone) and one of another ABI version: cache-blind, one line per transition
--- init
main::init_3();
--- no_error_log
[error]
[alert]
--- error_log
no writer heartbeat within stale=
usable again
the writer exited
index ABI version 1, this module reads version 2
