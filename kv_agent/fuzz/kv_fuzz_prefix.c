/*
 * kv_fuzz_prefix.c - libFuzzer target for the KV-events prefix index
 * writer (kv_agent/src/prefix_events.c, prefix_index.c) behind the
 * decoder: every input is decoded and fed to a small index (1024 slots,
 * 256 engine ids, block 4, two nodes that are one source each, three
 * node records), so the cache_salt reader, the id map, its tombstones
 * and rehash, slot reuse and node clears all run on what any engine on
 * the network could send; a first byte 0xfe releases source 1's node
 * and attaches it again (a DNS source's pod gone and back: a fresh
 * record, or none until a released one may be reused).
 * Checked after every input: each slot's masks hold only known nodes'
 * bits, no node has more bits set than blocks it counts, and a record
 * that is not USED has none.
 * Seeds: kv_agent/fuzz/corpus.  Run: kv_agent/fuzz/run.sh BUILD SECONDS.
 */

#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kv.h"
#include "prefix_events.h"

static kv_pfx_t       *ix;
static kv_pfx_feed_t   feed;
static kv_ev_sink_t    sink;
static kv_evs_conf_t   conf;
static char            path[64];


static void
check(void)
{
    int                      fd, n;
    uint64_t                 i, bits[3] = { 0, 0, 0 };
    dpd_pfx_header_t         h;
    static dpd_pfx_slot_t    s[1024];
    dpd_pfx_node_t           nd[3];

    fd = open(path, O_RDONLY);
    if (fd < 0 || pread(fd, &h, sizeof(h), 0) != (ssize_t) sizeof(h)
        || dpd_pfx_check(&h, h.file_size) != 0
        || pread(fd, s, sizeof(s), h.slots_off) != (ssize_t) sizeof(s)
        || pread(fd, nd, sizeof(nd), h.nodes_off) != (ssize_t) sizeof(nd))
    {
        abort();
    }
    close(fd);
    for (i = 0; i < 1024; i++) {
        if ((s[i].gpu_mask | s[i].lower_mask) & ~UINT64_C(7)) {
            abort();                   /* a bit of no node */
        }
        if (s[i].seq & 1) {
            abort();                   /* left mid-write */
        }
        for (n = 0; n < 3; n++) {
            bits[n] += ((s[i].gpu_mask | s[i].lower_mask) >> n) & 1;
        }
    }
    for (n = 0; n < 3; n++) {
        if (nd[n].seq & 1) {
            abort();
        }
        if (!(nd[n].flags & DPD_PFX_NODE_USED) && bits[n] != 0) {
            abort();                   /* a released node's bits left */
        }
        if (bits[n] > kv_pfx_node_blocks(ix, n) + nd[n].lower_blocks) {
            abort();
        }
    }
}


int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static kv_ev_decoder_t  dec;
    static int              ready;
    kv_ev_origin_t          o;
    uint8_t                *copy;

    if (!ready) {
        kv_log_level = KV_LOG_ERR - 1;   /* quiet */
        snprintf(path, sizeof(path), "/tmp/kv_fuzz_prefix.%d", getpid());
        conf.nsrc = 2;
        strcpy(conf.src[0].node, "d0");
        strcpy(conf.src[0].http, "127.0.0.1:1");
        strcpy(conf.src[0].model, "m");
        strcpy(conf.src[1].node, "d1");
        strcpy(conf.src[1].http, "127.0.0.1:2");
        strcpy(conf.src[1].model, "m");
        ix = kv_pfx_open(path, 1024, 3, 4, 256);
        if (ix == NULL || kv_pfx_feed_init(&feed, ix, &conf, &sink) != 0
            || kv_ev_decoder_init(&dec, NULL) != 0)
        {
            abort();
        }
        ready = 1;
    }
    copy = malloc(size ? size : 1);
    if (copy == NULL) {
        return 0;
    }
    memcpy(copy, data, size);
    memset(&o, 0, sizeof(o));
    /* the first byte picks the source; a clear now and then */
    o.idx = size ? (data[0] & 1) : 0;
    o.node = o.idx ? "d1" : "d0";
    o.http = "";
    if (size && data[0] == 0xff) {
        sink.cleared(sink.data, &o, KV_EV_CLEAR_GAP);
    }
    if (size && data[0] == 0xfe) {
        kv_pfx_feed_detach(&feed, 1);
        (void) kv_pfx_feed_attach(&feed, 1, "d1", "127.0.0.1:2", "m");
    }
    kv_ev_decode(&dec, copy, size, &o, &sink);
    free(copy);
    check();
    return 0;
}
