/*
 * kv_events.c - the decoder of one vLLM KV-event message.
 *
 * Followed (read 2026-12-04):
 *   vllm-project/vllm vllm/distributed/kv_events.py
 *     @0181ea3173e53eea8cf04a86891488e3dc89bb34 (current: events as maps,
 *     msgspec Structs with tag=True and no array_like, after vLLM PR
 *     #42892; ExternalBlockHash = bytes | int; group_idx,
 *     kv_cache_spec_kind, kv_cache_spec_sliding_window)
 *     @b4e69e0af33f4698e157a262cc787fe61983cd3d (old: array_like=True,
 *     batch [ts, events], BlockStored up to lora_id)
 *   vllm-project/vllm vllm/config/kv_events.py
 *     @00634b8acf93e413a1c380288665a543b98be7ea (endpoint, replay_endpoint,
 *     buffer_steps, hwm, topic)
 *   vllm-project/vllm vllm/v1/core/kv_cache_utils.py maybe_convert_block_hash
 *     (integer hash = digest as big-endian int & (2^64 - 1))
 *   llm-d/llm-d-kv-cache pkg/kvevents/engineadapter/vllm_adapter.go and
 *     common.go @7be76e119ca50c5700b3bca65a19b6a0218a9b62 (positional
 *     field order; bytes hashes reduced to their last 8 bytes)
 *   ai-dynamo/dynamo lib/kv-router/src/zmq_wire/deserialize.rs
 *     @0917ca25f81d75c877b60edd91e2d809d136ecfd and types.rs
 *     @2bd0a36dcb371b2f22ad56aa48215e383aee02a0 (map and tuple events,
 *     int64 or uint64 hashes, "locality" LOCAL/REMOTE, an empty medium is
 *     no medium)
 *
 * Wire format.  A payload is one msgpack value, the batch:
 *   [ts, events]  or  [ts, events, data_parallel_rank]   (array_like)
 *   {"ts": .., "events": [..], "data_parallel_rank": ..} (also accepted:
 *       a Struct without array_like encodes so)
 * and each event either
 *   {"type": "BlockStored", "block_hashes": [..], ...}   (vLLM >= 0.26)
 * or, in the declaration order of the msgspec Struct (older vLLM),
 *   ["BlockStored", block_hashes, parent_block_hash, token_ids,
 *    block_size, lora_id, medium, lora_name, extra_keys, group_idx,
 *    kv_cache_spec_kind, kv_cache_spec_sliding_window]
 *   ["BlockRemoved", block_hashes, medium, group_idx]
 *   ["AllBlocksCleared"]
 * omit_defaults drops trailing defaults (shorter arrays, absent keys):
 * absent means the default.  Unknown keys, extra trailing elements and
 * unknown event types are ignored, as msgspec and the peers do.
 *
 * Safety.  No allocation per message: a small reader over the bytes (no
 * object tree: msgpack-c's unpacker allocates what an array header
 * claims before the elements exist).  The payload is first walked whole
 * (bounded size, bounded nesting, every length checked against the bytes
 * left, linear time whatever the headers claim) and refused unless it is
 * exactly one well-formed value; only then are events delivered, each
 * checked alone: a bad one is counted and skipped, the rest go through.
 * A repeated known key refuses its event (which of the two would be
 * meant is unknowable); keys are matched once each, so repeats cost
 * nothing more.  Strings with a NUL are refused.
 */

#include <stdlib.h>
#include <string.h>

#include "kv_events.h"


/* ---- a bounds-checked msgpack reader ----------------------------------- */

enum {
    MP_NIL, MP_BOOL, MP_UINT, MP_INT, MP_FLOAT, MP_STR, MP_BIN, MP_EXT,
    MP_ARRAY, MP_MAP
};

typedef struct {
    const uint8_t *p, *end;
} mp_t;

typedef struct {
    int             type;
    uint64_t        u;                 /* MP_UINT; MP_BOOL */
    int64_t         i;                 /* MP_INT (negative only) */
    double          f;                 /* MP_FLOAT */
    const uint8_t  *ptr;               /* MP_STR, MP_BIN, MP_EXT */
    uint32_t        len;               /* those, and MP_ARRAY / MP_MAP */
} mp_obj_t;


static int
mp_be(mp_t *m, unsigned n, uint64_t *v)
{
    unsigned k;

    if ((size_t) (m->end - m->p) < n) {
        return -1;
    }
    *v = 0;
    for (k = 0; k < n; k++) {
        *v = (*v << 8) | m->p[k];
    }
    m->p += n;
    return 0;
}


static int
mp_body(mp_t *m, mp_obj_t *o, int type, uint64_t len)
{
    if ((uint64_t) (m->end - m->p) < len) {
        return -1;                     /* a length past the bytes left */
    }
    o->type = type;
    o->ptr = m->p;
    o->len = (uint32_t) len;
    m->p += len;
    return 0;
}


/* One value's header; scalars, strings and binaries whole.  Containers:
 * o->len elements (pairs for a map) follow, unread. */
static int
mp_next(mp_t *m, mp_obj_t *o)
{
    uint64_t v;
    uint8_t b;

    if (m->p >= m->end) {
        return -1;
    }
    b = *m->p++;
    o->len = 0;                        /* the hot path: no memset */
    o->ptr = NULL;
    if (b <= 0x7f) {
        o->type = MP_UINT;
        o->u = b;
        return 0;
    }
    if (b >= 0xe0) {
        o->type = MP_INT;
        o->i = (int8_t) b;
        return 0;
    }
    if (b <= 0x8f) {
        o->type = MP_MAP;
        o->len = b & 0x0f;
        return 0;
    }
    if (b <= 0x9f) {
        o->type = MP_ARRAY;
        o->len = b & 0x0f;
        return 0;
    }
    if (b <= 0xbf) {
        return mp_body(m, o, MP_STR, b & 0x1f);
    }
    switch (b) {
    case 0xc0:
        o->type = MP_NIL;
        return 0;
    case 0xc2:
    case 0xc3:
        o->type = MP_BOOL;
        o->u = b & 1;
        return 0;
    case 0xc4: case 0xc5: case 0xc6:
        if (mp_be(m, 1u << (b - 0xc4), &v)) {
            return -1;
        }
        return mp_body(m, o, MP_BIN, v);
    case 0xc7: case 0xc8: case 0xc9:
        if (mp_be(m, 1u << (b - 0xc7), &v)) {
            return -1;
        }
        return mp_body(m, o, MP_EXT, v + 1);       /* + the type byte */
    case 0xca:
        if (mp_be(m, 4, &v)) {
            return -1;
        }
        {
            uint32_t w = (uint32_t) v;
            float f;
            memcpy(&f, &w, 4);
            o->f = f;
        }
        o->type = MP_FLOAT;
        return 0;
    case 0xcb:
        if (mp_be(m, 8, &v)) {
            return -1;
        }
        memcpy(&o->f, &v, 8);
        o->type = MP_FLOAT;
        return 0;
    case 0xcc: case 0xcd: case 0xce: case 0xcf:
        if (mp_be(m, 1u << (b - 0xcc), &v)) {
            return -1;
        }
        o->type = MP_UINT;
        o->u = v;
        return 0;
    case 0xd0: case 0xd1: case 0xd2: case 0xd3:
        if (mp_be(m, 1u << (b - 0xd0), &v)) {
            return -1;
        }
        switch (b) {
        case 0xd0: o->i = (int8_t) v; break;
        case 0xd1: o->i = (int16_t) v; break;
        case 0xd2: o->i = (int32_t) v; break;
        default:   o->i = (int64_t) v; break;
        }
        if (o->i >= 0) {               /* a signed encoding of >= 0 */
            o->type = MP_UINT;
            o->u = (uint64_t) o->i;
        } else {
            o->type = MP_INT;
        }
        return 0;
    case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8:
        return mp_body(m, o, MP_EXT, 1 + (1u << (b - 0xd4)));
    case 0xd9: case 0xda: case 0xdb:
        if (mp_be(m, 1u << (b - 0xd9), &v)) {
            return -1;
        }
        return mp_body(m, o, MP_STR, v);
    case 0xdc: case 0xdd:
        if (mp_be(m, b == 0xdc ? 2 : 4, &v)) {
            return -1;
        }
        o->type = MP_ARRAY;
        o->len = (uint32_t) v;
        return 0;
    case 0xde: case 0xdf:
        if (mp_be(m, b == 0xde ? 2 : 4, &v)) {
            return -1;
        }
        o->type = MP_MAP;
        o->len = (uint32_t) v;
        return 0;
    default:                           /* 0xc1: never used */
        return -1;
    }
}


/* Skip one whole value.  Every element costs at least one byte, so this
 * is linear in the bytes whatever the headers claim; nesting deeper than
 * maxdepth containers is refused. */
static int
mp_skip(mp_t *m, unsigned maxdepth)
{
    uint64_t left[KV_EV_MAX_DEPTH + 1];
    mp_obj_t o;
    int top = 0;

    if (maxdepth > KV_EV_MAX_DEPTH) {
        maxdepth = KV_EV_MAX_DEPTH;
    }
    left[0] = 1;
    while (top >= 0) {
        if (left[top] == 0) {
            top--;
            continue;
        }
        left[top]--;
        if (mp_next(m, &o) != 0) {
            return -1;
        }
        if ((o.type == MP_ARRAY || o.type == MP_MAP) && o.len > 0) {
            if ((unsigned) top + 1 > maxdepth) {
                return -1;
            }
            left[++top] = o.type == MP_MAP ? 2 * (uint64_t) o.len : o.len;
        }
    }
    return 0;
}


static int
mp_streq(const mp_obj_t *o, const char *s)
{
    size_t n = strlen(s);

    return o->type == MP_STR && o->len == n && memcmp(o->ptr, s, n) == 0;
}


/* ---- events ------------------------------------------------------------ */

enum {
    EV_UNKNOWN = 0, EV_STORED, EV_REMOVED, EV_CLEARED
};

enum {
    F_SKIP = 0, F_HASHES, F_PARENT, F_TOKENS, F_BSIZE, F_LORA_ID, F_MEDIUM,
    F_LORA_NAME, F_GROUP, F_KIND, F_LOCALITY, F_EXTRA, F_NFIELDS
};

/* positions in the array form (vLLM's declaration order) */
static const int stored_pos[] = {
    F_SKIP /* tag */, F_HASHES, F_PARENT, F_TOKENS, F_BSIZE, F_LORA_ID,
    F_MEDIUM, F_LORA_NAME, F_EXTRA, F_GROUP, F_KIND,
    F_SKIP /* kv_cache_spec_sliding_window */
};
static const int removed_pos[] = {
    F_SKIP, F_HASHES, F_MEDIUM, F_GROUP
};

/* keys of the map form; those not listed are skipped */
static const struct {
    const char *name;
    int         f;
} ev_keys[] = {
    { "block_hashes", F_HASHES },
    { "parent_block_hash", F_PARENT },
    { "token_ids", F_TOKENS },
    { "block_size", F_BSIZE },
    { "lora_id", F_LORA_ID },
    { "medium", F_MEDIUM },
    { "lora_name", F_LORA_NAME },
    { "group_idx", F_GROUP },
    { "kv_cache_spec_kind", F_KIND },
    { "locality", F_LOCALITY },
    { "extra_keys", F_EXTRA },
    { NULL, F_SKIP }
};

typedef struct {
    unsigned      seen;                /* 1 << F_* */
    uint32_t      nblocks, ntokens, block_size;
    int           have_parent;
    kv_ev_hash_t  parent;
    int64_t       lora_id;
    int32_t       group_idx;
    char          medium[KV_EV_STR_MAX], lora_name[KV_EV_STR_MAX];
    char          kind[KV_EV_STR_MAX], locality[KV_EV_STR_MAX];
    int           has_medium, has_lora_name, has_kind, has_locality;
    const uint8_t *extra;
    uint32_t      extra_len;
} ev_fields_t;


static int
ev_type(const mp_obj_t *tag)
{
    if (mp_streq(tag, "BlockStored")) {
        return EV_STORED;
    }
    if (mp_streq(tag, "BlockRemoved")) {
        return EV_REMOVED;
    }
    if (mp_streq(tag, "AllBlocksCleared")) {
        return EV_CLEARED;
    }
    return EV_UNKNOWN;
}


static int
ev_hash(kv_ev_decoder_t *d, const mp_obj_t *o, kv_ev_hash_t *h)
{
    uint32_t k;

    switch (o->type) {
    case MP_UINT:
        h->id = o->u;
        h->raw = NULL;
        h->rawlen = 0;
        return 0;
    case MP_INT:                       /* a signed int64 publisher */
        h->id = (uint64_t) o->i;
        h->raw = NULL;
        h->rawlen = 0;
        return 0;
    case MP_BIN:
    case MP_STR:
        if (o->len == 0 || o->len > KV_EV_HASH_MAX) {
            d->why = "a block hash of 0 or more than 64 bytes";
            return -1;
        }
        h->id = 0;
        for (k = o->len > 8 ? o->len - 8 : 0; k < o->len; k++) {
            h->id = (h->id << 8) | o->ptr[k];
        }
        h->raw = o->ptr;
        h->rawlen = o->len;
        return 0;
    default:
        d->why = "a block hash is not an integer or bytes";
        return -1;
    }
}


/* a short string field: NULL/"" for nil, else a copy without NUL */
static int
ev_str(kv_ev_decoder_t *d, const mp_obj_t *o, char *out, int *has,
    const char *name)
{
    if (o->type == MP_NIL) {
        *has = 0;
        return 0;
    }
    if (o->type != MP_STR || o->len >= KV_EV_STR_MAX
        || memchr(o->ptr, '\0', o->len) != NULL)
    {
        d->why = name;
        return -1;
    }
    memcpy(out, o->ptr, o->len);
    out[o->len] = '\0';
    *has = 1;
    return 0;
}


static int
ev_field(kv_ev_decoder_t *d, mp_t *m, int f, ev_fields_t *e)
{
    mp_obj_t o, x;
    uint32_t i;

    if (f == F_SKIP) {
        return mp_skip(m, KV_EV_MAX_DEPTH);
    }
    if (e->seen & (1u << f)) {
        d->why = "a field given twice";
        return -1;
    }
    e->seen |= 1u << f;
    if (f == F_EXTRA) {
        const uint8_t *start = m->p;
        mp_t peek = *m;
        if (mp_next(&peek, &o) != 0 || mp_skip(m, KV_EV_MAX_DEPTH) != 0) {
            d->why = "truncated";
            return -1;
        }
        if (o.type == MP_ARRAY) {
            e->extra = start;
            e->extra_len = (uint32_t) (m->p - start);
        } else if (o.type != MP_NIL) {
            d->why = "extra_keys is not an array";
            return -1;
        }
        return 0;
    }
    if (mp_next(m, &o) != 0) {
        d->why = "truncated";
        return -1;
    }
    switch (f) {
    case F_HASHES:
        if (o.type != MP_ARRAY) {
            d->why = "block_hashes is not an array";
            return -1;
        }
        if (o.len > d->lim.max_blocks) {
            d->why = "more block hashes than allowed";
            return -1;
        }
        for (i = 0; i < o.len; i++) {
            if (mp_next(m, &x) != 0 || ev_hash(d, &x, &d->hashes[i]) != 0) {
                if (d->why == NULL) {
                    d->why = "truncated";
                }
                return -1;
            }
        }
        e->nblocks = o.len;
        return 0;
    case F_PARENT:
        if (o.type == MP_NIL) {
            e->have_parent = 0;
            return 0;
        }
        e->have_parent = 1;
        return ev_hash(d, &o, &e->parent);
    case F_TOKENS:
        if (o.type != MP_ARRAY) {
            d->why = "token_ids is not an array";
            return -1;
        }
        if (o.len > d->lim.max_tokens) {
            d->why = "more token ids than allowed";
            return -1;
        }
        for (i = 0; i < o.len; i++) {
            if (mp_next(m, &x) != 0 || x.type != MP_UINT
                || x.u > UINT32_MAX)
            {
                d->why = "a token id is not an integer in 0..2^32-1";
                return -1;
            }
            d->tokens[i] = (uint32_t) x.u;
        }
        e->ntokens = o.len;
        return 0;
    case F_BSIZE:
        if (o.type != MP_UINT || o.u == 0 || o.u > KV_EV_MAX_BLOCK_SIZE) {
            d->why = "block_size is not an integer in 1..65536";
            return -1;
        }
        e->block_size = (uint32_t) o.u;
        return 0;
    case F_LORA_ID:
        if (o.type == MP_NIL) {
            e->lora_id = -1;
            return 0;
        }
        if (o.type != MP_UINT || o.u > INT64_MAX) {
            d->why = "lora_id is not a non-negative integer";
            return -1;
        }
        e->lora_id = (int64_t) o.u;
        return 0;
    case F_GROUP:
        if (o.type == MP_NIL) {
            e->group_idx = -1;
            return 0;
        }
        if (o.type != MP_UINT || o.u > INT32_MAX) {
            d->why = "group_idx is not a non-negative integer";
            return -1;
        }
        e->group_idx = (int32_t) o.u;
        return 0;
    case F_MEDIUM:
        return ev_str(d, &o, e->medium, &e->has_medium,
                      "medium is not a short string");
    case F_LORA_NAME:
        return ev_str(d, &o, e->lora_name, &e->has_lora_name,
                      "lora_name is not a short string");
    case F_KIND:
        return ev_str(d, &o, e->kind, &e->has_kind,
                      "kv_cache_spec_kind is not a short string");
    case F_LOCALITY:
        return ev_str(d, &o, e->locality, &e->has_locality,
                      "locality is not a short string");
    }
    return -1;
}


/* result of one event */
enum { EV_DONE = 0, EV_IGNORED, EV_REFUSED, EV_BROKEN };


static int
ev_deliver(kv_ev_decoder_t *d, int type, ev_fields_t *e, kv_ev_origin_t *o,
    const kv_ev_sink_t *sink)
{
    const char *medium;
    int tier;

    if (type == EV_CLEARED) {
        d->st.cleared++;
        if (sink && sink->cleared) {
            sink->cleared(sink->data, o, KV_EV_CLEAR_ENGINE);
        }
        return EV_DONE;
    }
    if (!(e->seen & (1u << F_HASHES))) {
        d->why = "no block_hashes";
        return EV_REFUSED;
    }
    if (e->has_locality && strcmp(e->locality, "LOCAL") != 0) {
        return EV_IGNORED;             /* another node's cache */
    }
    medium = e->has_medium && e->medium[0] ? e->medium : NULL;
    tier = medium == NULL || strcmp(medium, "GPU") == 0 ? KV_EV_TIER_GPU
                                                         : KV_EV_TIER_LOWER;
    if (type == EV_STORED) {
        kv_ev_stored_t s;

        if (!(e->seen & (1u << F_TOKENS)) || !(e->seen & (1u << F_BSIZE))) {
            d->why = "BlockStored without token_ids or block_size";
            return EV_REFUSED;
        }
        if ((uint64_t) e->nblocks * e->block_size != e->ntokens) {
            d->why = "token_ids is not block_size tokens per block hash";
            return EV_REFUSED;
        }
        if (e->nblocks == 0) {
            return EV_IGNORED;
        }
        memset(&s, 0, sizeof(s));
        s.hashes = d->hashes;
        s.nblocks = e->nblocks;
        s.parent = e->have_parent ? &e->parent : NULL;
        s.tokens = d->tokens;
        s.ntokens = e->ntokens;
        s.block_size = e->block_size;
        s.tier = tier;
        s.medium = medium;
        s.lora_name = e->has_lora_name ? e->lora_name : NULL;
        s.lora_id = e->lora_id;
        s.group_idx = e->group_idx;
        s.spec_kind = e->has_kind ? e->kind : NULL;
        s.extra_keys = e->extra;
        s.extra_keys_len = e->extra_len;
        d->st.stored++;
        if (tier != KV_EV_TIER_GPU) {
            d->st.stored_lower++;
        }
        if (sink && sink->stored) {
            sink->stored(sink->data, o, &s);
        }
        return EV_DONE;
    }
    {
        kv_ev_removed_t r;

        if (e->nblocks == 0) {
            return EV_IGNORED;
        }
        r.hashes = d->hashes;
        r.nblocks = e->nblocks;
        r.tier = tier;
        r.medium = medium;
        r.group_idx = e->group_idx;
        d->st.removed++;
        if (tier != KV_EV_TIER_GPU) {
            d->st.removed_lower++;
        }
        if (sink && sink->removed) {
            sink->removed(sink->data, o, &r);
        }
    }
    return EV_DONE;
}


/* One event at m (the payload is known well-formed: a failure inside an
 * event leaves m anywhere, so the caller re-positions from `next`). */
static int
ev_decode(kv_ev_decoder_t *d, mp_t *m, kv_ev_origin_t *o,
    const kv_ev_sink_t *sink)
{
    ev_fields_t e;
    mp_obj_t h, k;
    mp_t scan;
    uint32_t i;
    int type = EV_UNKNOWN, f, j, have_type = 0;

    memset(&e, 0, sizeof(e));
    e.lora_id = -1;
    e.group_idx = -1;
    if (mp_next(m, &h) != 0) {
        return EV_BROKEN;
    }
    if (h.type == MP_ARRAY) {
        const int *pos;
        uint32_t npos;

        if (h.len == 0 || mp_next(m, &k) != 0 || k.type != MP_STR) {
            d->why = "an array event without its type tag first";
            return EV_REFUSED;
        }
        type = ev_type(&k);
        if (type == EV_UNKNOWN) {
            return EV_IGNORED;
        }
        if (type == EV_STORED) {
            pos = stored_pos;
            npos = sizeof(stored_pos) / sizeof(stored_pos[0]);
            if (h.len < 5) {
                d->why = "a BlockStored array of fewer than 5 elements";
                return EV_REFUSED;
            }
        } else if (type == EV_REMOVED) {
            pos = removed_pos;
            npos = sizeof(removed_pos) / sizeof(removed_pos[0]);
            if (h.len < 2) {
                d->why = "a BlockRemoved array without block_hashes";
                return EV_REFUSED;
            }
        } else {
            pos = NULL;
            npos = 0;
        }
        for (i = 1; i < h.len; i++) {
            f = i < npos ? pos[i] : F_SKIP;
            if (ev_field(d, m, f, &e) != 0) {
                return EV_REFUSED;
            }
        }
        return ev_deliver(d, type, &e, o, sink);
    }
    if (h.type != MP_MAP) {
        d->why = "an event is neither a map nor an array";
        return EV_REFUSED;
    }
    /* pass 1: the "type" tag, wherever it is */
    scan = *m;
    for (i = 0; i < h.len; i++) {
        if (mp_next(&scan, &k) != 0) {
            return EV_BROKEN;
        }
        if (k.type != MP_STR) {
            d->why = "a map event with a key that is not a string";
            return EV_REFUSED;
        }
        if (mp_streq(&k, "type")) {
            mp_obj_t t;
            if (have_type) {
                d->why = "\"type\" given twice";
                return EV_REFUSED;
            }
            have_type = 1;
            if (mp_next(&scan, &t) != 0 || t.type != MP_STR) {
                d->why = "\"type\" is not a string";
                return EV_REFUSED;
            }
            type = ev_type(&t);
        } else if (mp_skip(&scan, KV_EV_MAX_DEPTH) != 0) {
            return EV_BROKEN;
        }
    }
    if (!have_type) {
        d->why = "a map event without \"type\"";
        return EV_REFUSED;
    }
    if (type == EV_UNKNOWN) {
        return EV_IGNORED;
    }
    /* pass 2: the fields */
    for (i = 0; i < h.len; i++) {
        if (mp_next(m, &k) != 0) {
            return EV_BROKEN;
        }
        f = F_SKIP;
        if (type != EV_CLEARED) {
            for (j = 0; ev_keys[j].name; j++) {
                if (mp_streq(&k, ev_keys[j].name)) {
                    f = ev_keys[j].f;
                    break;
                }
            }
            if (type == EV_REMOVED && (f == F_PARENT || f == F_TOKENS
                                       || f == F_BSIZE || f == F_LORA_ID
                                       || f == F_LORA_NAME || f == F_KIND
                                       || f == F_EXTRA))
            {
                f = F_SKIP;            /* not BlockRemoved's */
            }
        }
        if (ev_field(d, m, f, &e) != 0) {
            return EV_REFUSED;
        }
    }
    return ev_deliver(d, type, &e, o, sink);
}


/* ---- the batch ---------------------------------------------------------- */

static int
batch_refuse(kv_ev_decoder_t *d, const char *why)
{
    d->why = why;
    d->st.msgs_refused++;
    return -1;
}


static int
batch_number(const mp_obj_t *o, double *v)
{
    if (o->type == MP_FLOAT) {
        *v = o->f;
    } else if (o->type == MP_UINT) {
        *v = (double) o->u;
    } else if (o->type == MP_INT) {
        *v = (double) o->i;
    } else {
        return -1;
    }
    return 0;
}


static int32_t
batch_rank(const mp_obj_t *o)
{
    /* informational: anything but a small integer reads as absent */
    return o->type == MP_UINT && o->u <= INT32_MAX ? (int32_t) o->u : -1;
}


int
kv_ev_decode(kv_ev_decoder_t *d, const uint8_t *p, size_t n,
    kv_ev_origin_t *o, const kv_ev_sink_t *sink)
{
    mp_t m, events, next;
    mp_obj_t b, x, k;
    uint32_t i, nev = 0;
    int have_ts = 0, have_ev = 0, delivered = 0, r;

    d->st.msgs++;
    d->why = NULL;
    o->ts = 0;
    o->dp_rank = -1;
    if (n > d->lim.max_payload) {
        return batch_refuse(d, "payload larger than allowed");
    }
    m.p = p;
    m.end = p + n;
    if (mp_skip(&m, KV_EV_MAX_DEPTH) != 0) {
        return batch_refuse(d, "not well-formed msgpack (truncated, or "
                            "nested too deep)");
    }
    if (m.p != m.end) {
        return batch_refuse(d, "bytes after the batch");
    }
    m.p = p;
    if (mp_next(&m, &b) != 0) {
        return batch_refuse(d, "empty");
    }
    events.p = events.end = NULL;
    if (b.type == MP_ARRAY) {
        if (b.len < 2) {
            return batch_refuse(d, "a batch array of fewer than 2 elements");
        }
        for (i = 0; i < b.len; i++) {
            if (i == 1) {
                events = m;
                if (mp_next(&m, &x) != 0 || x.type != MP_ARRAY) {
                    return batch_refuse(d, "events is not an array");
                }
                nev = x.len;
                have_ev = 1;
                m = events;
                mp_skip(&m, KV_EV_MAX_DEPTH);
                continue;
            }
            next = m;
            if (mp_next(&next, &x) != 0) {
                return batch_refuse(d, "truncated");
            }
            if (i == 0) {
                if (batch_number(&x, &o->ts) != 0) {
                    return batch_refuse(d, "ts is not a number");
                }
                have_ts = 1;
            } else if (i == 2) {
                o->dp_rank = batch_rank(&x);
            }
            mp_skip(&m, KV_EV_MAX_DEPTH);      /* later elements: ignored */
        }
    } else if (b.type == MP_MAP) {
        for (i = 0; i < b.len; i++) {
            if (mp_next(&m, &k) != 0) {
                return batch_refuse(d, "truncated");
            }
            if (mp_streq(&k, "events")) {
                if (have_ev) {
                    return batch_refuse(d, "events given twice");
                }
                events = m;
                if (mp_next(&m, &x) != 0 || x.type != MP_ARRAY) {
                    return batch_refuse(d, "events is not an array");
                }
                nev = x.len;
                have_ev = 1;
                m = events;
                mp_skip(&m, KV_EV_MAX_DEPTH);
            } else if (mp_streq(&k, "ts")) {
                if (have_ts) {
                    return batch_refuse(d, "ts given twice");
                }
                if (mp_next(&m, &x) != 0 || batch_number(&x, &o->ts) != 0) {
                    return batch_refuse(d, "ts is not a number");
                }
                have_ts = 1;
            } else if (mp_streq(&k, "data_parallel_rank")) {
                next = m;
                if (mp_next(&next, &x) == 0) {
                    o->dp_rank = batch_rank(&x);
                }
                mp_skip(&m, KV_EV_MAX_DEPTH);
            } else {
                mp_skip(&m, KV_EV_MAX_DEPTH);
            }
        }
        if (!have_ts) {
            return batch_refuse(d, "a batch map without ts");
        }
    } else {
        return batch_refuse(d, "the batch is neither an array nor a map");
    }
    if (!have_ev) {
        return batch_refuse(d, "a batch without events");
    }
    if (nev > d->lim.max_events) {
        return batch_refuse(d, "more events in the batch than allowed");
    }
    mp_next(&events, &x);              /* the events array's header */
    for (i = 0; i < nev; i++) {
        next = events;
        mp_skip(&next, KV_EV_MAX_DEPTH);   /* where the next one starts */
        d->why = NULL;
        r = ev_decode(d, &events, o, sink);
        switch (r) {
        case EV_DONE:
            delivered++;
            break;
        case EV_IGNORED:
            d->st.ignored++;
            break;
        default:
            d->st.refused++;
            if (d->why == NULL) {
                d->why = "malformed event";
            }
            break;
        }
        events = next;
    }
    return delivered;
}


int
kv_ev_decoder_init(kv_ev_decoder_t *d, const kv_ev_limits_t *lim)
{
    memset(d, 0, sizeof(*d));
    if (lim) {
        d->lim = *lim;
    }
    if (d->lim.max_payload == 0 || d->lim.max_payload > KV_EV_MAX_PAYLOAD) {
        d->lim.max_payload = KV_EV_MAX_PAYLOAD;
    }
    if (d->lim.max_events == 0 || d->lim.max_events > KV_EV_MAX_EVENTS) {
        d->lim.max_events = KV_EV_MAX_EVENTS;
    }
    if (d->lim.max_blocks == 0 || d->lim.max_blocks > KV_EV_MAX_BLOCKS) {
        d->lim.max_blocks = KV_EV_MAX_BLOCKS;
    }
    if (d->lim.max_tokens == 0 || d->lim.max_tokens > KV_EV_MAX_TOKENS) {
        d->lim.max_tokens = KV_EV_MAX_TOKENS;
    }
    d->hashes = calloc(d->lim.max_blocks, sizeof(kv_ev_hash_t));
    d->tokens = calloc(d->lim.max_tokens, sizeof(uint32_t));
    if (d->hashes == NULL || d->tokens == NULL) {
        kv_ev_decoder_free(d);
        return -1;
    }
    return 0;
}


void
kv_ev_decoder_free(kv_ev_decoder_t *d)
{
    free(d->hashes);
    free(d->tokens);
    d->hashes = NULL;
    d->tokens = NULL;
}


const char *
kv_ev_clear_name(kv_ev_clear_t why)
{
    switch (why) {
    case KV_EV_CLEAR_ENGINE:  return "engine";
    case KV_EV_CLEAR_RESTART: return "restart";
    case KV_EV_CLEAR_GAP:     return "gap";
    case KV_EV_CLEAR_RECONNECT: return "reconnect";
    }
    return "?";
}
