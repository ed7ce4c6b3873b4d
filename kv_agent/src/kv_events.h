/*
 * kv_events.h - vLLM's KV cache events: the decoder of one published
 * message (kv_events.c) and the subscriber to the engines' publishers
 * (kv_events_sub.c), both delivering to one sink.
 *
 * The sink is the interface of the prefix index's writer: it receives
 * what an engine's prefix cache gained and lost, per configured node, and
 * when to forget everything it knew about a node.  Pointers handed to a
 * callback are valid during that call only (they point into the message
 * or the decoder's scratch); copy what you keep.  Callbacks run on the
 * agent's loop: they must not block.
 *
 * See kv_events.c for the wire format and the sources it follows.
 */

#ifndef KV_EVENTS_H
#define KV_EVENTS_H

#include <stddef.h>
#include <stdint.h>


/* ---- bounds (defaults; kv_ev_limits_t overrides) ---------------------- */

#define KV_EV_MAX_PAYLOAD   (16u << 20)  /* bytes of one msgpack payload */
#define KV_EV_MAX_EVENTS    65536u       /* events in one batch */
#define KV_EV_MAX_BLOCKS    65536u       /* hashes in one event */
#define KV_EV_MAX_TOKENS    (1u << 20)   /* token ids in one event */
#define KV_EV_MAX_BLOCK_SIZE 65536u      /* tokens per block */
#define KV_EV_MAX_DEPTH     32u          /* msgpack nesting */
#define KV_EV_HASH_MAX      64u          /* bytes of a bytes-form hash */
#define KV_EV_STR_MAX       256u         /* medium, lora_name, kind ... */


/* An engine's block hash.  vLLM sends either an integer (the default,
 * VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1: the digest's last 8 bytes,
 * big-endian, as an unsigned 64-bit int; other publishers send it as a
 * signed int64) or the raw digest bytes.  `id` is one 64-bit value for
 * both: the integer (a negative int64 taken as its two's complement), or
 * the last 8 bytes of the digest big-endian (shorter: zero-padded on the
 * left), which is what vLLM's integer form of the same digest would be.
 * `raw`/`rawlen` keep the bytes form whole (rawlen 0 for an integer). */
typedef struct {
    uint64_t        id;
    const uint8_t  *raw;
    uint32_t        rawlen;
} kv_ev_hash_t;

/* Where a message came from (the subscriber fills node/http/idx/seq;
 * the decoder ts and dp_rank). */
typedef struct {
    const char *node;          /* the config's "node" ("" if none) */
    const char *http;          /* its vLLM as nginx's upstream names it */
    uint32_t    idx;           /* the source's index in "kv_events" */
    uint64_t    seq;           /* the publisher's sequence number */
    double      ts;            /* the batch's timestamp */
    int32_t     dp_rank;       /* data_parallel_rank; -1 when absent */
} kv_ev_origin_t;

enum {
    KV_EV_TIER_GPU = 0,        /* "GPU", absent, null or "" */
    KV_EV_TIER_LOWER = 1       /* any other medium: CPU, DISK, ... */
};

/* BlockStored: nblocks full blocks, tokens[i*block_size ..] are block i's;
 * block 0's parent is `parent` (NULL: the first block of a sequence). */
typedef struct {
    const kv_ev_hash_t *hashes;
    uint32_t            nblocks;
    const kv_ev_hash_t *parent;
    const uint32_t     *tokens;
    uint32_t            ntokens;       /* == nblocks * block_size */
    uint32_t            block_size;
    int                 tier;          /* KV_EV_TIER_* */
    const char         *medium;        /* NULL when absent/null */
    const char         *lora_name;     /* NULL when none */
    int64_t             lora_id;       /* -1 when none */
    int32_t             group_idx;     /* -1 when absent */
    const char         *spec_kind;     /* kv_cache_spec_kind; NULL absent */
    /* extra_keys as sent: the msgpack bytes of its array (one entry per
     * block, each null or a tuple of LoRA name, cache_salt on block 0,
     * multimodal hashes ...), NULL when absent or null; left to the
     * index writer to read (cache_salt changes block 0's key). */
    const uint8_t      *extra_keys;
    uint32_t            extra_keys_len;
} kv_ev_stored_t;

typedef struct {
    const kv_ev_hash_t *hashes;
    uint32_t            nblocks;
    int                 tier;
    const char         *medium;
    int32_t             group_idx;
} kv_ev_removed_t;

/* why everything learned from a source (origin->idx; the node, unless
 * it has one source per data-parallel rank) is to be dropped */
typedef enum {
    KV_EV_CLEAR_ENGINE = 1,    /* AllBlocksCleared from the engine */
    KV_EV_CLEAR_RESTART,       /* seq went back: the publisher restarted */
    KV_EV_CLEAR_GAP,           /* messages lost and not replayed */
    KV_EV_CLEAR_RECONNECT      /* the connection dropped and the stream
                                * came back elsewhere than last + 1: a
                                * restart or a loss, unknowable which */
} kv_ev_clear_t;

typedef struct {
    void  *data;
    void (*stored)(void *data, const kv_ev_origin_t *o,
                   const kv_ev_stored_t *ev);
    void (*removed)(void *data, const kv_ev_origin_t *o,
                    const kv_ev_removed_t *ev);
    void (*cleared)(void *data, const kv_ev_origin_t *o, kv_ev_clear_t why);
} kv_ev_sink_t;

const char *kv_ev_clear_name(kv_ev_clear_t why);


/* ---- decoder ---------------------------------------------------------- */

typedef struct {
    uint32_t max_payload, max_events, max_blocks, max_tokens;
} kv_ev_limits_t;

/* counters, cumulative over the decoder's life */
typedef struct {
    uint64_t msgs;             /* payloads given */
    uint64_t msgs_refused;     /* not a batch: nothing delivered */
    uint64_t stored, removed, cleared;     /* events delivered */
    uint64_t stored_lower, removed_lower;  /* of which medium != GPU */
    uint64_t ignored;          /* unknown type, non-LOCAL locality */
    uint64_t refused;          /* malformed or over a bound: dropped */
} kv_ev_stats_t;

typedef struct {
    kv_ev_limits_t  lim;
    kv_ev_hash_t   *hashes;            /* scratch, lim.max_blocks */
    uint32_t       *tokens;            /* scratch, lim.max_tokens */
    kv_ev_stats_t   st;
    const char     *why;               /* last refusal, for logs */
} kv_ev_decoder_t;

/* lim NULL: the defaults above.  0 / -1 (no memory). */
int  kv_ev_decoder_init(kv_ev_decoder_t *d, const kv_ev_limits_t *lim);
void kv_ev_decoder_free(kv_ev_decoder_t *d);

/* Decode one payload (the third frame) and deliver its events in order.
 * Returns the number of events delivered, or -1 when the payload was
 * refused as a whole (d->why says why; nothing was delivered).  A payload
 * is checked whole before its first event is delivered; then each event
 * stands alone: a malformed one is counted and skipped. */
int  kv_ev_decode(kv_ev_decoder_t *d, const uint8_t *p, size_t n,
    kv_ev_origin_t *o, const kv_ev_sink_t *sink);

#endif /* KV_EVENTS_H */
