/*
 * dpd_state.h - the kv_agent readiness state table ABI (docs/state.md).
 *
 * One fixed-size file (normally under /dev/shm) written by exactly one
 * kv_agent process and read by any number of readers (nginx workers,
 * `kv_agent status`).  Readers should pread() it into a private copy
 * rather than map it: a mapping faults (SIGBUS) where a truncation or a
 * copy over the file removed pages; a short read is just a bad table.
 * Self-contained C: stdint/stddef/string only, no pointers inside the
 * file, every offset relative to the file start.
 *
 * Layout:  [dpd_state_header_t][dpd_node_rec_t x max_nodes]
 *          [dpd_req_rec_t x max_reqs]
 *
 * Consistency (seqlock per record):
 *   writer:  seq = seq + 1 (odd: being written); release fence;
 *            write the fields; release store seq = seq + 1 (even).
 *   reader:  s1 = acquire load seq; if s1 is odd, retry;
 *            copy the record; acquire fence; s2 = load seq;
 *            if s1 != s2, retry.
 *   A reader retries at most DPD_STATE_READ_TRIES times, then treats the
 *   record as UNKNOWN (never as ready).  The helpers below implement this.
 *
 * File replacement: the agent (re)creates the file with write-to-temp +
 * rename, so an open descriptor stays valid but stale.  Readers should
 * stat() the path now and then (nginx: every check= interval) and reopen
 * when st_ino changes or when header.generation differs;
 * header.writer_alive == 0 means the writer stopped cleanly (records are
 * then final, nodes not alive).
 *
 * Request records are an open-addressing hash table keyed by
 * dpd_state_hash() of the gateway's KV request id string: FNV-1a 64 over
 * its bytes (offset basis 0xcbf29ce484222325, prime 0x100000001b3), 0
 * mapped to 1.
 * Home slot = hash % max_reqs, linear probing over at most
 * DPD_STATE_MAX_PROBE slots; a slot whose id_hash is 0 was never used and
 * ends the probe; a deleted slot keeps its hash with state DPD_REQ_FREE
 * (a tombstone) so probing continues past it.
 */

#ifndef DPD_STATE_H
#define DPD_STATE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define DPD_STATE_MAGIC        0x3154415453445044ULL  /* "DPDSTAT1" LE */
#define DPD_STATE_VERSION      1u
#define DPD_STATE_READ_TRIES   64
#define DPD_STATE_MAX_PROBE    64
#define DPD_STATE_ID_LEN       64    /* node ids, NUL-terminated */
#define DPD_STATE_ADDR_LEN     128   /* "host:port", NUL-terminated */
#define DPD_STATE_REQID_LEN    128   /* request id (may be truncated) */
#define DPD_STATE_DEFAULT_PATH "/dev/shm/dpd_state"

/* node roles */
#define DPD_ROLE_UNKNOWN  0u
#define DPD_ROLE_PREFILL  1u
#define DPD_ROLE_DECODE   2u
#define DPD_ROLE_ROUTER   3u

/* node flags */
#define DPD_NODE_USED     0x1u   /* slot holds a node */
#define DPD_NODE_ALIVE    0x2u   /* heartbeat seen within dead_after */
#define DPD_NODE_SELF     0x4u   /* the writer's own record */

/* request states */
#define DPD_REQ_FREE          0u  /* tombstone / unused */
#define DPD_REQ_RESERVED      1u  /* blocks reserved, nothing written yet */
#define DPD_REQ_TRANSFERRING  2u
#define DPD_REQ_READY         3u  /* every byte delivered */
#define DPD_REQ_FAILED        4u

typedef struct {
    uint64_t magic;            /* DPD_STATE_MAGIC */
    uint32_t version;          /* DPD_STATE_VERSION */
    uint32_t header_size;      /* sizeof(dpd_state_header_t) */
    uint32_t node_rec_size;    /* sizeof(dpd_node_rec_t) */
    uint32_t req_rec_size;     /* sizeof(dpd_req_rec_t) */
    uint32_t max_nodes;
    uint32_t max_reqs;
    uint64_t nodes_off;        /* byte offset of the node array */
    uint64_t reqs_off;         /* byte offset of the request array */
    uint64_t file_size;
    uint64_t generation;       /* random per (re)creation */
    uint64_t created_ms;       /* CLOCK_REALTIME, ms */
    uint32_t writer_pid;
    uint32_t writer_alive;     /* 1 while the agent runs, 0 after exit */
    char     self_id[DPD_STATE_ID_LEN];
    uint64_t updated_ms;       /* last write of any record */
    uint8_t  reserved[104];    /* pads the header to 256 bytes */
} dpd_state_header_t;

typedef struct {
    uint32_t seq;              /* seqlock: odd = being written */
    uint32_t flags;            /* DPD_NODE_* */
    uint32_t role;             /* DPD_ROLE_* */
    uint32_t inflight;         /* transfers in progress on that node */
    uint64_t id_hash;          /* dpd_state_hash(id) */
    uint64_t last_heartbeat_ms;/* CLOCK_REALTIME, ms */
    uint64_t free_blocks;
    uint64_t total_blocks;
    uint64_t block_bytes;      /* bytes one block holds (all layers) */
    char     id[DPD_STATE_ID_LEN];
    char     http_addr[DPD_STATE_ADDR_LEN];   /* its vLLM, "host:port" */
    uint8_t  reserved[40];     /* pads the record to 288 bytes */
} dpd_node_rec_t;

typedef struct {
    uint32_t seq;              /* seqlock: odd = being written */
    uint32_t state;            /* DPD_REQ_* */
    uint64_t id_hash;          /* 0 = never used (ends a probe) */
    uint64_t bytes_done;
    uint64_t bytes_total;
    uint64_t t_reserved_ms;    /* CLOCK_REALTIME, ms; 0 = not set */
    uint64_t t_start_ms;
    uint64_t t_done_ms;
    uint32_t nblocks;
    int32_t  error;            /* 0 or a negative errno-style code */
    char     req_id[DPD_STATE_REQID_LEN];
    char     node_id[DPD_STATE_ID_LEN];   /* decode node holding the KV */
    char     peer_id[DPD_STATE_ID_LEN];   /* prefill node that pushed it */
    uint8_t  reserved[32];     /* pads the record to 352 bytes */
} dpd_req_rec_t;


static inline uint64_t
dpd_state_hash(const void *data, size_t len)
{
    const unsigned char *p = (const unsigned char *) data;
    uint64_t h = 0xcbf29ce484222325ULL;
    size_t i;

    for (i = 0; i < len; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h ? h : 1;
}


/* Returns 0 when the mapping of `size` bytes holds a table this header can
 * read, -1 otherwise (wrong magic, version, record sizes, truncated). */
static inline int
dpd_state_check(const void *map, size_t size)
{
    const dpd_state_header_t *h = (const dpd_state_header_t *) map;

    if (map == NULL || size < sizeof(*h)) {
        return -1;
    }
    if (h->magic != DPD_STATE_MAGIC || h->version != DPD_STATE_VERSION
        || h->header_size != sizeof(dpd_state_header_t)
        || h->node_rec_size != sizeof(dpd_node_rec_t)
        || h->req_rec_size != sizeof(dpd_req_rec_t)
        || h->file_size > size)
    {
        return -1;
    }
    if (h->nodes_off < sizeof(*h)
        || h->nodes_off + (uint64_t) h->max_nodes * sizeof(dpd_node_rec_t)
           > h->reqs_off
        || h->reqs_off + (uint64_t) h->max_reqs * sizeof(dpd_req_rec_t)
           > h->file_size
        || h->max_reqs == 0)
    {
        return -1;
    }
    return 0;
}


static inline const dpd_node_rec_t *
dpd_state_nodes(const void *map)
{
    const dpd_state_header_t *h = (const dpd_state_header_t *) map;
    return (const dpd_node_rec_t *) ((const char *) map + h->nodes_off);
}


static inline const dpd_req_rec_t *
dpd_state_reqs(const void *map)
{
    const dpd_state_header_t *h = (const dpd_state_header_t *) map;
    return (const dpd_req_rec_t *) ((const char *) map + h->reqs_off);
}


/* Seqlock copy of one record (node or request; seq is the first field).
 * Returns 0 with a consistent copy in out, -1 when it stayed unstable for
 * DPD_STATE_READ_TRIES attempts (treat as unknown). */
static inline int
dpd_state_read_rec(const void *rec, void *out, size_t size)
{
    const uint32_t *seqp = (const uint32_t *) rec;
    uint32_t s1, s2;
    int i;

    for (i = 0; i < DPD_STATE_READ_TRIES; i++) {
        s1 = __atomic_load_n(seqp, __ATOMIC_ACQUIRE);
        if (s1 & 1u) {
            continue;
        }
        memcpy(out, rec, size);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        s2 = __atomic_load_n(seqp, __ATOMIC_RELAXED);
        if (s1 == s2) {
            return 0;
        }
    }
    return -1;
}


/* Node lookup by id.  Returns 1 and fills out when found, 0 when absent,
 * -1 when a matching slot could not be read consistently. */
static inline int
dpd_state_find_node(const void *map, const char *id, dpd_node_rec_t *out)
{
    const dpd_state_header_t *h = (const dpd_state_header_t *) map;
    const dpd_node_rec_t *nodes = dpd_state_nodes(map);
    uint64_t hash = dpd_state_hash(id, strlen(id));
    uint32_t i;
    int unstable = 0;

    for (i = 0; i < h->max_nodes; i++) {
        if (__atomic_load_n(&nodes[i].id_hash, __ATOMIC_RELAXED) != hash) {
            continue;
        }
        if (dpd_state_read_rec(&nodes[i], out, sizeof(*out)) != 0) {
            unstable = 1;
            continue;
        }
        if ((out->flags & DPD_NODE_USED) && out->id_hash == hash
            && strncmp(out->id, id, DPD_STATE_ID_LEN) == 0)
        {
            return 1;
        }
    }
    return unstable ? -1 : 0;
}


/* Request lookup by X-Request-Id.  Returns 1 and fills out when found
 * (state != FREE), 0 when absent, -1 when unreadable (unknown). */
static inline int
dpd_state_find_req(const void *map, const char *req_id, size_t len,
    dpd_req_rec_t *out)
{
    const dpd_state_header_t *h = (const dpd_state_header_t *) map;
    const dpd_req_rec_t *reqs = dpd_state_reqs(map);
    uint64_t hash = dpd_state_hash(req_id, len), slot_hash;
    uint32_t i, idx, probe;
    size_t cmp = len < DPD_STATE_REQID_LEN - 1 ? len : DPD_STATE_REQID_LEN - 1;

    probe = h->max_reqs < DPD_STATE_MAX_PROBE ? h->max_reqs
                                              : DPD_STATE_MAX_PROBE;
    for (i = 0; i < probe; i++) {
        idx = (uint32_t) ((hash + i) % h->max_reqs);
        slot_hash = __atomic_load_n(&reqs[idx].id_hash, __ATOMIC_ACQUIRE);
        if (slot_hash == 0) {
            return 0;
        }
        if (slot_hash != hash) {
            continue;
        }
        if (dpd_state_read_rec(&reqs[idx], out, sizeof(*out)) != 0) {
            return -1;
        }
        if (out->id_hash == hash && out->state != DPD_REQ_FREE
            && strncmp(out->req_id, req_id, cmp) == 0
            && out->req_id[cmp] == '\0')
        {
            return 1;
        }
    }
    return 0;
}


static inline const char *
dpd_state_req_name(uint32_t state)
{
    switch (state) {
    case DPD_REQ_RESERVED:     return "reserved";
    case DPD_REQ_TRANSFERRING: return "transferring";
    case DPD_REQ_READY:        return "ready";
    case DPD_REQ_FAILED:       return "failed";
    default:                   return "free";
    }
}


static inline const char *
dpd_state_role_name(uint32_t role)
{
    switch (role) {
    case DPD_ROLE_PREFILL: return "prefill";
    case DPD_ROLE_DECODE:  return "decode";
    case DPD_ROLE_ROUTER:  return "router";
    default:               return "unknown";
    }
}

#endif /* DPD_STATE_H */
