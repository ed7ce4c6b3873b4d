/*
 * kv_fuzz_prefix.c - libFuzzer target for the KV-events prefix index
 * writer (kv_agent/src/prefix_events.c, prefix_index.c) behind the
 * decoder: every input is decoded and fed to a small index (1024 slots,
 * 256 engine ids, block 4, two nodes that are one source each), so the
 * cache_salt reader, the id map, its tombstones and rehash, slot reuse
 * and node clears all run on what any engine on the network could send.
 * Checked after every input: each slot's masks hold only known nodes'
 * bits, and no node has more bits set than blocks it counts.
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
    int                      fd;
    uint64_t                 i, bits[2] = { 0, 0 };
    dpd_pfx_header_t         h;
    static dpd_pfx_slot_t    s[1024];

    fd = open(path, O_RDONLY);
    if (fd < 0 || pread(fd, &h, sizeof(h), 0) != (ssize_t) sizeof(h)
        || dpd_pfx_check(&h, h.file_size) != 0
        || pread(fd, s, sizeof(s), h.slots_off) != (ssize_t) sizeof(s))
    {
        abort();
    }
    close(fd);
    for (i = 0; i < 1024; i++) {
        if ((s[i].gpu_mask | s[i].lower_mask) & ~UINT64_C(3)) {
            abort();                   /* a bit of no node */
        }
        if (s[i].seq & 1) {
            abort();                   /* left mid-write */
        }
        bits[0] += s[i].gpu_mask & 1;
        bits[1] += (s[i].gpu_mask >> 1) & 1;
    }
    if (bits[0] > kv_pfx_node_blocks(ix, 0)
        || bits[1] > kv_pfx_node_blocks(ix, 1))
    {
        abort();
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
        ix = kv_pfx_open(path, 1024, 2, 4, 256);
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
    kv_ev_decode(&dec, copy, size, &o, &sink);
    free(copy);
    check();
    return 0;
}
