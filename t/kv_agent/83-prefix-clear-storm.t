#!/usr/bin/perl
# The prefix index against a clear storm from one engine: a KV-event batch
# may carry up to 65536 events (KV_EV_MAX_EVENTS) and each
# AllBlocksCleared clears the node, which scans the whole slot table and
# id map (1M slots and a 1M-entry map by default: ~1.7 ms).  One
# ~1.2 MB message of clears must not hold the agent's loop for minutes
# (4096 of them: ~7 s before the fix), nor a block stored and cleared
# again and again (~1.8 ms a pair before).  A harness compiled here from the
# real sources (kv_events.c, prefix_events.c, prefix_index.c) decodes
# such a batch into the default-sized index.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use KvAgentTest;

my $root = kv_root();
my $dir = kv_tmpdir();
my $cc = $ENV{CC} || 'cc';
my $src = "$root/kv_agent/src";

plan skip_all => 'no cJSON headers' unless -f '/usr/include/cjson/cJSON.h';

open my $fh, '>', "$dir/storm.c" or die;
print $fh <<'_C_';
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "kv.h"
#include "prefix_events.h"

int
main(int argc, char **argv)
{
    static uint8_t    buf[64 + 17 * 65536];
    kv_pfx_t         *ix;
    kv_pfx_feed_t     feed;
    kv_ev_sink_t      sink;
    kv_evs_conf_t     conf;
    kv_ev_decoder_t   dec;
    kv_ev_origin_t    o;
    kv_pfx_stored_t   ev;
    uint32_t          tok[16], i, n;
    uint64_t          id = 7;
    size_t            len;
    struct timespec   t0, t1;

    n = (uint32_t) atoi(argv[2]);
    kv_log_level = KV_LOG_ERR - 1;
    memset(&conf, 0, sizeof(conf));
    conf.nsrc = 1;
    strcpy(conf.src[0].node, "d0");
    strcpy(conf.src[0].http, "127.0.0.1:1");
    strcpy(conf.src[0].model, "m");
    ix = kv_pfx_open(argv[1], UINT64_C(1) << 20, 8, 16, UINT64_C(1) << 19);
    if (ix == NULL || kv_pfx_feed_init(&feed, ix, &conf, &sink) != 0
        || kv_ev_decoder_init(&dec, NULL) != 0)
    {
        return 2;
    }
    /* the node holds one block */
    for (i = 0; i < 16; i++) {
        tok[i] = i + 1;
    }
    memset(&ev, 0, sizeof(ev));
    ev.ids = &id;
    ev.nblocks = 1;
    ev.tokens = tok;
    ev.ntokens = 16;
    ev.block_size = 16;
    kv_pfx_stored(ix, 0, &ev);
    /* [ts, [["AllBlocksCleared"] x n]] */
    len = 0;
    buf[len++] = 0x92;
    buf[len++] = 0xcb;
    memset(buf + len, 0, 8);
    len += 8;
    buf[len++] = 0xdd;
    buf[len++] = (uint8_t) (n >> 24);
    buf[len++] = (uint8_t) (n >> 16);
    buf[len++] = (uint8_t) (n >> 8);
    buf[len++] = (uint8_t) n;
    for (i = 0; i < n; i++) {
        buf[len++] = 0x91;
        buf[len++] = 0xb0;
        memcpy(buf + len, "AllBlocksCleared", 16);
        len += 16;
    }
    memset(&o, 0, sizeof(o));
    o.idx = 0;
    o.node = "d0";
    o.http = "";
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (kv_ev_decode(&dec, buf, len, &o, &sink) < 0) {
        return 3;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%u %.3f %llu %llu\n", n, (t1.tv_sec - t0.tv_sec)
           + (t1.tv_nsec - t0.tv_nsec) / 1e9,
           (unsigned long long) kv_pfx_stats(ix)->cleared,
           (unsigned long long) kv_pfx_node_blocks(ix, 0));
    /* a store and a clear, repeated (a batch alternating BlockStored
     * and AllBlocksCleared, or a publisher restarting after each) */
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (i = 0; i < n; i++) {
        id = 100 + i;
        tok[0] = 1000 + i;
        kv_pfx_stored(ix, 0, &ev);
        if (kv_pfx_node_blocks(ix, 0) != 1) {
            return 4;
        }
        kv_pfx_node_clear(ix, 0);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%.3f %llu\n", (t1.tv_sec - t0.tv_sec)
           + (t1.tv_nsec - t0.tv_nsec) / 1e9,
           (unsigned long long) kv_pfx_node_blocks(ix, 0));
    /* more than a clear can visit by id: the scan, and nothing left */
    for (i = 0; i < 5000; i++) {
        id = 20000 + i;
        tok[0] = 30000 + i;
        kv_pfx_stored(ix, 0, &ev);
    }
    printf("%llu", (unsigned long long) kv_pfx_node_blocks(ix, 0));
    kv_pfx_node_clear(ix, 0);
    kv_pfx_stored(ix, 0, &ev);         /* the last one again: not held */
    printf(" %llu\n", (unsigned long long) kv_pfx_node_blocks(ix, 0));
    /* a flapping publisher: a block stored, then the stream restarts,
     * over and over; each clear drops something, and the info lines
     * (stderr) must not follow one for one */
    kv_log_level = KV_LOG_INFO;
    t0.tv_sec = 1;                     /* past the second of the clears */
    t0.tv_nsec = 100000000;            /* above (logged or not) */
    nanosleep(&t0, NULL);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (i = 0; i < n; i++) {
        id = 900000 + i;
        tok[0] = 900000 + i;
        kv_pfx_stored(ix, 0, &ev);
        sink.cleared(sink.data, &o, KV_EV_CLEAR_RESTART);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    kv_log_level = KV_LOG_ERR - 1;
    printf("%.3f %llu\n", (t1.tv_sec - t0.tv_sec)
           + (t1.tv_nsec - t0.tv_nsec) / 1e9,
           (unsigned long long) kv_pfx_node_blocks(ix, 0));
    kv_pfx_close(ix, 1);
    return 0;
}
_C_
close $fh;

my $out = `$cc -O2 -std=c11 -D_GNU_SOURCE -I$root/kv_agent/include -I$src \\
    $dir/storm.c $src/kv_events.c $src/prefix_events.c $src/prefix_index.c \\
    $src/util.c -o $dir/storm -lcjson 2>&1`;
is $?, 0, 'the harness builds' or diag $out;

my @out = split /\n/, `$dir/storm $dir/pfx 4096 2>$dir/storm.err`;
is $?, 0, 'the harness ran';
my ($n, $secs, $cleared, $left) = split ' ', $out[0] // '';
is $n, 4096, '... all of them';
is $cleared, 4096, '... each a clear';
is $left, 0, '... the node holds nothing after';
cmp_ok $secs, '<', 0.5, "... in $secs s (not a table scan each)";
my ($psecs, $pleft) = split ' ', $out[1] // '';
is $pleft, 0, '4096 times a block stored then cleared: nothing left';
cmp_ok $psecs, '<', 0.5, "... in $psecs s (not a table scan each)";
my ($many, $after) = split ' ', $out[2] // '';
is $many, 5000, '5000 blocks stored (more than a clear visits by id)';
is $after, 1, 'cleared by the scan: a block stored again counts alone';

# a publisher restarting in a loop, a block stored each time: 4096 clears
# that each drop something, logged one line a second with the count of
# those left out (a line per clear flooded the log before)
my ($fsecs, $fleft) = split ' ', $out[3] // '';
is $fleft, 0, 'a flapping publisher: 4096 store+clear, nothing left';
my @lines = grep { /prefix index: node d0 cleared/ }
            do { open my $e, '<', "$dir/storm.err" or die; <$e> };
my $allowed = 1 + int($fsecs) + 1;
ok @lines >= 1 && @lines <= $allowed,
   scalar(@lines) . " 'cleared' lines for 4096 clears in $fsecs s "
   . "(at most $allowed)";
like $lines[0] // '', qr/cleared \(restart\): \d+ blocks dropped \(\d+ clears/,
     '... the first one says what went';
if (@lines > 1) {
    like $lines[1], qr/\((\d+) clears, \1 blocks, not logged/,
         '... the next one counts the clears left out';
}

done_testing();
