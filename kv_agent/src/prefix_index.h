/*
 * prefix_index.h - the writer of the KV-events prefix index
 * (kv_agent/include/dpd_prefix_index.h), the file nginx reads for
 * "dpd_prefix_cache events".
 *
 * The router-role agent feeds it what the engines' KV events say (through
 * kv_events.c's decoder): blocks stored on a node, blocks removed, a node
 * cleared.  Engine block hashes are opaque ids here (uint64 as vLLM sends
 * them by default, or a 64-bit digest of the bytes form): each is mapped
 * to the gateway's own key (dpd_prefix.h, computed from the block's token
 * ids and its parent's key), so that BlockRemoved can find the slot and a
 * later BlockStored can chain on it.
 *
 * Bounded: the file has a fixed number of slots and the id map a fixed
 * capacity, both from configuration; what does not fit is not indexed
 * (counted, logged at a limited rate).  A missed block costs a recompute
 * on the engine, never a wrong answer.
 */

#ifndef KV_PREFIX_INDEX_H
#define KV_PREFIX_INDEX_H

#include <stddef.h>
#include <stdint.h>

#include "dpd_prefix_index.h"

typedef struct kv_pfx kv_pfx_t;

typedef struct {
    uint64_t  stored;          /* blocks indexed */
    uint64_t  removed;         /* blocks un-indexed */
    uint64_t  cleared;         /* node clears */
    uint64_t  orphans;         /* blocks whose parent we never saw */
    uint64_t  bad_size;        /* events with another block size */
    uint64_t  full;            /* blocks dropped: no slot or map room */
    uint64_t  unknown_removed; /* BlockRemoved of an id never stored */
} kv_pfx_stats_t;

/* one BlockStored event, as the decoder hands it over */
typedef struct {
    int              has_parent;    /* parent_block_hash present */
    uint64_t         parent_id;     /* its opaque id */
    const uint64_t  *ids;           /* block_hashes as opaque ids */
    size_t           nblocks;
    const uint32_t  *tokens;        /* nblocks * block_size ids */
    size_t           ntokens;
    uint32_t         block_size;
    const char      *lora;          /* LoRA seed ("": the module seeds an
                                       adapter by its name as the model) */
    size_t           lora_len;
    const char      *salt;          /* cache_salt from block 0's extra
                                       keys, "" for none */
    size_t           salt_len;
    int              lower_tier;    /* medium is not "GPU" */
} kv_pfx_stored_t;

/* An opaque id for a hash sent as bytes (vLLM's non-int form). */
uint64_t kv_pfx_bytes_id(const void *p, size_t n);

/*
 * Creates the file at path (write to a temporary name + rename, fresh
 * generation): nslots (a power of two) slots, max_nodes node records,
 * block_size tokens a block, an id map of map_cap entries.
 */
kv_pfx_t *kv_pfx_open(const char *path, uint64_t nslots, uint32_t max_nodes,
    uint32_t block_size, uint64_t map_cap);
void kv_pfx_close(kv_pfx_t *x, int clean);
/* The writer's heartbeat: header.updated_ms refreshed about every
 * DPD_PFX_HEARTBEAT_MS / 2 (call it from the loop, idle or not); readers
 * treat an index without one as stale. */
void kv_pfx_heartbeat(kv_pfx_t *x, uint64_t wall_ms);

/* A node record: index >= 0, -1 when the table is full (no record
 * free, see kv_pfx_node_release()).  model seeds its
 * keys (the name requests use for it: what the module seeds with). */
int  kv_pfx_node(kv_pfx_t *x, const char *id, const char *http_addr,
    const char *model);
/* A node an engine no longer is (a DNS source's address gone): all it
 * holds dropped, its record no longer USED; the blocks it held.  The
 * record is reused by kv_pfx_node() once readers cannot map the old
 * address to it any more (KV_PFX_REUSE_MS later), never-used ones first. */
#define KV_PFX_REUSE_MS  5000
uint64_t kv_pfx_node_release(kv_pfx_t *x, int node);
/* records kv_pfx_node() could hand out now */
int  kv_pfx_node_free(const kv_pfx_t *x);
/* drops all a node holds; the blocks it held (0: nothing, no scan) */
uint64_t kv_pfx_node_clear(kv_pfx_t *x, int node);

void kv_pfx_stored(kv_pfx_t *x, int node, const kv_pfx_stored_t *ev);
/* the same, block 0 seeded with another model name (an adapter's) */
void kv_pfx_stored_seeded(kv_pfx_t *x, int node, const kv_pfx_stored_t *ev,
    const char *model, size_t model_len);
void kv_pfx_removed(kv_pfx_t *x, int node, const uint64_t *ids, size_t n,
    int lower_tier);

const kv_pfx_stats_t *kv_pfx_stats(const kv_pfx_t *x);
uint64_t kv_pfx_node_blocks(const kv_pfx_t *x, int node);

#endif /* KV_PREFIX_INDEX_H */
