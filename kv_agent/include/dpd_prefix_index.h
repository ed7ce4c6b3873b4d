/*
 * dpd_prefix_index.h: the KV-events prefix index ABI (issue 23,
 * "dpd_prefix_cache events").  One fixed-size file (normally under
 * /dev/shm) written by exactly one process, the router-role kv_agent that
 * subscribes to the engines' KV events, and read by the nginx workers.
 * Same discipline as the state table (dpd_state.h, docs/state.md):
 *
 *   - no pointers, every offset relative to the file start, fixed-size
 *     records, a versioned header carrying the record sizes;
 *   - a seqlock per record (node and slot): the writer makes seq odd,
 *     release fence, writes the fields, release-stores seq + 1 (even);
 *     a reader copies the record between two loads of seq and retries at
 *     most DPD_PFX_READ_TRIES times, else treats it as absent (a miss:
 *     a stale or unknown index only costs a recompute, never a wrong
 *     answer);
 *   - readers pread() into private copies, never map the file (a file
 *     that shrinks under a mapping faults with SIGBUS); a short read is
 *     an unusable index ("no cache information"), not an error;
 *   - the writer (re)creates the file with write-to-temp + rename and a
 *     fresh random generation; readers stat() the path now and then and
 *     reopen when the inode or the generation changes.
 *
 * Layout:  [dpd_pfx_header_t][dpd_pfx_node_t x max_nodes]
 *          [dpd_pfx_slot_t x nslots]
 *
 * Nodes: the engines (vLLM pods) the agent follows, at most 64 (a slot's
 * masks have one bit per node index).  http_addr is the address as
 * nginx's upstream names the peer ("10.0.0.7:8000"): that is how a reader
 * maps a peer to a node index.  When a node is cleared (publisher
 * restart, AllBlocksCleared, no replay after a gap) the writer first
 * bumps its epoch and clears DPD_PFX_NODE_READY, clears the node's bit in
 * every slot, then sets READY again; readers ignore nodes that are not
 * READY.  A node index is reused for another engine only after all its
 * bits were cleared.
 *
 * Slots: an open-addressing hash table of block keys (dpd_prefix.h: the
 * gateway's own chained key over the block's token ids, seeded by model,
 * LoRA name and cache_salt; the engine's block hash is only the agent's
 * private id for parent links and BlockRemoved).  nslots is a power of
 * two; home slot = dpd_pfx_home() (the key mixed with header.salt, a
 * random value the writer draws per file), linear probing over at most
 * header.max_probe (<= DPD_PFX_MAX_PROBE) slots.  The key function is
 * public and a client may send token ids, so a home taken from the key's
 * own bits would let it aim prompts at one probe window and fill it (its
 * blocks, and everyone else's that hash there, go unindexed); the salt
 * leaves nothing to aim at (version 2; version 1 had no salt).  Key 0 = never used
 * (ends a probe); a slot whose masks are both 0 is a tombstone (probing
 * continues past it; the writer may reuse it for the same key or, when
 * no probe can run through it any more, for another).  gpu_mask bit i:
 * node i holds the block in GPU memory (medium "GPU" or absent); lower_mask
 * bit i: in a lower tier (CPU, STORAGE; counted apart, not routed on).
 *
 * Liveness: the writer sets writer_alive while it runs (0 on a clean
 * exit) and stores updated_ms (CLOCK_REALTIME) at least every
 * DPD_PFX_HEARTBEAT_MS even when idle.  A reader treats an index whose
 * writer is gone, or whose heartbeat is older than its own stale limit
 * (nginx: dpd_prefix_cache events stale=), as holding nothing: a killed
 * agent stops following the engines, and what its file says drifts away
 * from what they hold.
 *
 * Prefix closure: vLLM stores a block only after its parent and evicts a
 * request's tail blocks first, so the blocks a node holds of a prompt are
 * (nearly always) a run from block 0.  The reader relies on it: it binary
 * searches for the last held block of each candidate node (about log2(n)
 * probes for n blocks instead of n), and checks block 0.
 */

#ifndef DPD_PREFIX_INDEX_H
#define DPD_PREFIX_INDEX_H

#include <stddef.h>
#include <stdint.h>

#include "dpd_prefix.h"

#define DPD_PFX_MAGIC          0x3130584650445044ULL  /* "DPDPFX01" LE */
#define DPD_PFX_VERSION        2u    /* 2: salted home slot */
#define DPD_PFX_KEY_VERSION    1u    /* dpd_prefix.h's key function */
#define DPD_PFX_READ_TRIES     64
#define DPD_PFX_MAX_PROBE      64
#define DPD_PFX_MAX_NODES      64    /* one mask bit per node */
#define DPD_PFX_ID_LEN         64
#define DPD_PFX_ADDR_LEN       128
#define DPD_PFX_DEFAULT_PATH   "/dev/shm/dpd_prefix"
#define DPD_PFX_HEARTBEAT_MS   1000  /* writer: updated_ms at least this
                                        often */

/* node flags */
#define DPD_PFX_NODE_USED      0x1u  /* slot holds a node */
#define DPD_PFX_NODE_READY     0x2u  /* its bits are current (not being
                                        cleared or rebuilt) */


typedef struct {
    uint64_t magic;            /* DPD_PFX_MAGIC */
    uint32_t version;          /* DPD_PFX_VERSION */
    uint32_t header_size;      /* sizeof(dpd_pfx_header_t) */
    uint32_t node_size;        /* sizeof(dpd_pfx_node_t) */
    uint32_t slot_size;        /* sizeof(dpd_pfx_slot_t) */
    uint32_t max_nodes;        /* <= DPD_PFX_MAX_NODES */
    uint32_t max_probe;        /* <= DPD_PFX_MAX_PROBE */
    uint64_t nslots;           /* a power of two */
    uint64_t nodes_off;        /* byte offset of the node array */
    uint64_t slots_off;        /* byte offset of the slot array */
    uint64_t file_size;
    uint64_t generation;       /* random per (re)creation */
    uint32_t key_version;      /* DPD_PFX_KEY_VERSION */
    uint32_t block_size;       /* tokens per block the keys cover */
    uint32_t writer_pid;
    uint32_t writer_alive;     /* 1 while the writer runs, 0 after exit */
    uint64_t updated_ms;       /* CLOCK_REALTIME, last write or
                                  heartbeat (DPD_PFX_HEARTBEAT_MS) */
    uint64_t salt;             /* random per file: dpd_pfx_home() */
    uint8_t  reserved[152];    /* pads the header to 256 bytes */
} dpd_pfx_header_t;


typedef struct {
    uint32_t seq;              /* seqlock: odd = being written */
    uint32_t flags;            /* DPD_PFX_NODE_* */
    uint64_t epoch;            /* bumped on every clear of the node */
    uint64_t blocks;           /* GPU blocks held (for status) */
    uint64_t lower_blocks;     /* lower-tier blocks held */
    uint64_t updated_ms;
    char     id[DPD_PFX_ID_LEN];          /* the agent's name for it */
    char     http_addr[DPD_PFX_ADDR_LEN]; /* "host:port" as nginx names it */
    uint8_t  reserved[24];     /* pads the record to 256 bytes */
} dpd_pfx_node_t;


typedef struct {
    uint32_t seq;              /* seqlock: odd = being written */
    uint32_t reserved;
    uint64_t key;              /* dpd_prefix.h key; 0: never used */
    uint64_t gpu_mask;         /* bit i: node i holds it in GPU memory */
    uint64_t lower_mask;       /* bit i: node i holds it in a lower tier */
} dpd_pfx_slot_t;


#if defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
_Static_assert(sizeof(dpd_pfx_header_t) == 256, "dpd_pfx_header_t size");
_Static_assert(sizeof(dpd_pfx_node_t) == 256, "dpd_pfx_node_t size");
_Static_assert(sizeof(dpd_pfx_slot_t) == 32, "dpd_pfx_slot_t size");
#endif


/* the home slot of key (nslots a power of two, checked) */

static inline uint64_t
dpd_pfx_home(const dpd_pfx_header_t *h, uint64_t key)
{
    return dpd_prefix_fmix(key ^ h->salt) & (h->nslots - 1);
}


/* byte offset of slot i (the caller checked i < nslots) */

static inline uint64_t
dpd_pfx_slot_off(const dpd_pfx_header_t *h, uint64_t i)
{
    return h->slots_off + i * sizeof(dpd_pfx_slot_t);
}


/*
 * Checks a header copy against the size of the file it came from: 0 when
 * every record the header describes lies inside "size" bytes, -1
 * otherwise.  Overflow-safe (all products of 32-bit counts and record
 * sizes fit 64 bits; nslots is bounded before it is multiplied).
 */

static inline int
dpd_pfx_check(const dpd_pfx_header_t *h, uint64_t size)
{
    if (h->magic != DPD_PFX_MAGIC || h->version != DPD_PFX_VERSION
        || h->header_size != sizeof(dpd_pfx_header_t)
        || h->node_size != sizeof(dpd_pfx_node_t)
        || h->slot_size != sizeof(dpd_pfx_slot_t)
        || h->key_version != DPD_PFX_KEY_VERSION)
    {
        return -1;
    }

    if (h->file_size > size
        || h->max_nodes > DPD_PFX_MAX_NODES
        || h->max_probe == 0 || h->max_probe > DPD_PFX_MAX_PROBE
        || h->nslots == 0 || (h->nslots & (h->nslots - 1)) != 0
        || h->nslots > (UINT64_C(1) << 40)
        || h->block_size == 0
        || h->nodes_off < sizeof(dpd_pfx_header_t)
        || h->nodes_off % 8 || h->slots_off % 8
        || h->nodes_off > h->file_size
        || h->slots_off > h->file_size
        || (uint64_t) h->max_nodes * sizeof(dpd_pfx_node_t)
           > h->file_size - h->nodes_off
        || h->nslots * sizeof(dpd_pfx_slot_t) > h->file_size - h->slots_off
        || (h->slots_off < h->nodes_off
            + (uint64_t) h->max_nodes * sizeof(dpd_pfx_node_t)
            && h->nodes_off < h->slots_off
               + h->nslots * sizeof(dpd_pfx_slot_t)))
    {
        return -1;
    }

    return 0;
}


#endif /* DPD_PREFIX_INDEX_H */
