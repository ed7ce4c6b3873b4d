/*
 * prefix_events.h - the KV-events sink that feeds the prefix index
 * (prefix_events.c).
 */

#ifndef KV_PREFIX_EVENTS_H
#define KV_PREFIX_EVENTS_H

#include "kv_events.h"
#include "prefix_index.h"

#define KV_PFX_FEED_MAX_BLOCKS  KV_EV_MAX_BLOCKS

typedef struct kv_pfx_feed {
    kv_pfx_t  *ix;
    int        node_of[KV_EVS_MAX_SOURCES];  /* source -> index node */
    uint64_t  *ids;                          /* KV_PFX_FEED_MAX_BLOCKS */
    uint64_t   unkeyable;   /* blocks whose keys we cannot reproduce */
    /* the "node cleared" line, one a second per source: a flapping
     * publisher's clears are counted into the next line */
    uint64_t   clear_t[KV_EVS_MAX_SOURCES];
    uint64_t   clear_quiet[KV_EVS_MAX_SOURCES];
    uint64_t   clear_quiet_blocks[KV_EVS_MAX_SOURCES];
} kv_pfx_feed_t;

/* Index nodes for every source of c; sink set to feed ix.  0 / -1. */
int  kv_pfx_feed_init(kv_pfx_feed_t *f, kv_pfx_t *ix, const kv_evs_conf_t *c,
    kv_ev_sink_t *sink);
/* A source added at run time (a DNS source's address, kv_events_dns.c)
 * in subscriber slot idx: a node of its own.  The node index, or -1 (no
 * record free: see kv_pfx_node_release()). */
int  kv_pfx_feed_attach(kv_pfx_feed_t *f, uint32_t idx, const char *node,
    const char *http, const char *model);
/* ... and gone: its node released (cleared, no longer USED); the blocks
 * it held */
uint64_t kv_pfx_feed_detach(kv_pfx_feed_t *f, uint32_t idx);
void kv_pfx_feed_free(kv_pfx_feed_t *f);

#endif /* KV_PREFIX_EVENTS_H */
