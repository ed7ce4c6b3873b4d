/*
 * prefix_events.c - what the engines' KV events say, fed to the prefix
 * index (the sink of kv_events_sub.c when the router's config has
 * "prefix_index").
 *
 * Per event:
 *   - the source's node: one index node per configured "node" (several
 *     data-parallel ranks of one engine share it);
 *   - the seed of block 0's key: the name requests use for the model, as
 *     ngx_dpd_module seeds it (the source's "model", or the event's
 *     lora_name: vLLM serves an adapter under its own name, and the
 *     module seeds with the request's "model"), and cache_salt, read from
 *     block 0's extra keys (vllm/v1/core/kv_cache_utils.py
 *     generate_block_hash_extra_keys: LoRA name, multimodal hashes,
 *     cache_salt on the block that starts at token 0; sent as plain
 *     values before vLLM's typed ExtraKey structs, as {"type":
 *     "cache_salt", "salt": ...} maps after);
 *   - a block 0 whose extra keys hold anything else (multimodal hashes,
 *     prompt embeddings) is not indexed: the module keys text prompts
 *     only, so such a block could never be looked up anyway.
 */

#include <stdlib.h>
#include <string.h>

#include "kv.h"
#include "prefix_index.h"
#include "prefix_events.h"

#define PFX_SALT_MAX  1024


/*
 * A reader of just what block 0's extra keys hold: arrays, maps, strings
 * and nil.  The bytes were checked whole by kv_events.c (every length
 * lies inside them; checked again here); anything else (a multimodal
 * hash's tuple, a number) makes the block unkeyable, so nothing ever
 * needs skipping.  No allocation: msgpack-c would allocate whatever an
 * array header claims.
 */

typedef struct {
    const uint8_t  *p, *end;
} pe_rd_t;

enum { PE_NIL = 1, PE_STR, PE_ARR, PE_MAP, PE_OTHER };


static int
pe_be(pe_rd_t *r, unsigned n, uint32_t *v)
{
    unsigned  i;

    if ((size_t) (r->end - r->p) < n) {
        return -1;
    }
    *v = 0;
    for (i = 0; i < n; i++) {
        *v = (*v << 8) | *r->p++;
    }
    return 0;
}


/* The next value's kind: a string's bytes in *s and *len, a container's
 * element count in *len; -1 when the bytes end early. */
static int
pe_next(pe_rd_t *r, const char **s, uint32_t *len)
{
    uint8_t  b;

    if (r->p >= r->end) {
        return -1;
    }
    b = *r->p++;
    if (b == 0xc0) {
        return PE_NIL;
    }
    if ((b & 0xf0) == 0x90) {
        *len = b & 0x0f;
        return PE_ARR;
    }
    if ((b & 0xf0) == 0x80) {
        *len = b & 0x0f;
        return PE_MAP;
    }
    if (b == 0xdc || b == 0xdd) {
        return pe_be(r, b == 0xdc ? 2 : 4, len) ? -1 : PE_ARR;
    }
    if (b == 0xde || b == 0xdf) {
        return pe_be(r, b == 0xde ? 2 : 4, len) ? -1 : PE_MAP;
    }
    if ((b & 0xe0) == 0xa0) {
        *len = b & 0x1f;
    } else if (b == 0xd9 || b == 0xda || b == 0xdb) {
        if (pe_be(r, b == 0xd9 ? 1 : (b == 0xda ? 2 : 4), len)) {
            return -1;
        }
    } else {
        return PE_OTHER;
    }
    if ((size_t) (r->end - r->p) < *len) {
        return -1;
    }
    *s = (const char *) r->p;
    r->p += *len;
    return PE_STR;
}


static int
pe_streq(const char *s, uint32_t len, const char *lit)
{
    return len == strlen(lit) && memcmp(s, lit, len) == 0;
}


/*
 * cache_salt of the sequence's first block from the event's extra_keys
 * (msgpack bytes of a list, one entry per block).  1: the salt copied to
 * buf, its length in *len (0: none); 0: not indexable (extra keys we
 * cannot reproduce, or a salt longer than cap).
 */
static int
first_block_salt(const kv_ev_stored_t *ev, char *buf, size_t cap,
    size_t *len)
{
    int          t, vt;
    size_t       lora_len;
    uint32_t     n, i, m, j, kl, vl, sl;
    const char  *s, *k, *v, *salt, *type, *tsalt;
    pe_rd_t      r;

    *len = 0;
    if (ev->extra_keys == NULL || ev->extra_keys_len == 0) {
        return 1;
    }
    r.p = ev->extra_keys;
    r.end = ev->extra_keys + ev->extra_keys_len;

    t = pe_next(&r, &s, &n);
    if (t == PE_NIL) {
        return 1;
    }
    if (t != PE_ARR || n == 0) {
        return 0;
    }
    t = pe_next(&r, &s, &n);            /* block 0's entry */
    if (t == PE_NIL) {
        return 1;
    }
    if (t != PE_ARR) {
        return 0;
    }

    lora_len = ev->lora_name ? strlen(ev->lora_name) : 0;
    salt = NULL;
    sl = 0;

    for (i = 0; i < n; i++) {
        t = pe_next(&r, &s, &m);

        if (t == PE_STR) {
            /* plain form: the LoRA name, else the salt (one at most) */
            if (ev->lora_name != NULL && m == lora_len
                && memcmp(s, ev->lora_name, m) == 0)
            {
                continue;
            }
            if (salt != NULL) {
                return 0;              /* two strings: multimodal too */
            }
            salt = s;
            sl = m;
            continue;
        }

        if (t != PE_MAP) {
            return 0;
        }

        /* typed form: {"type": "lora", "name": ...} or
         * {"type": "cache_salt", "salt": ...}; other kinds: not ours */
        type = NULL;
        tsalt = NULL;
        vl = 0;
        for (j = 0; j < m; j++) {
            if (pe_next(&r, &k, &kl) != PE_STR) {
                return 0;
            }
            vt = pe_next(&r, &v, &n);
            if (vt != PE_STR) {
                return 0;
            }
            if (pe_streq(k, kl, "type")) {
                if (type != NULL) {
                    return 0;          /* a key given twice */
                }
                type = pe_streq(v, n, "lora") ? "lora"
                       : pe_streq(v, n, "cache_salt") ? "cache_salt" : "";
            } else if (pe_streq(k, kl, "salt")) {
                if (tsalt != NULL) {
                    return 0;
                }
                tsalt = v;
                vl = n;
            }
        }
        if (type != NULL && strcmp(type, "lora") == 0) {
            continue;
        }
        if (type == NULL || strcmp(type, "cache_salt") != 0
            || tsalt == NULL || salt != NULL)
        {
            return 0;
        }
        salt = tsalt;
        sl = vl;
    }

    if (salt != NULL) {
        if (sl > cap) {
            return 0;
        }
        memcpy(buf, salt, sl);
        *len = sl;
    }
    return 1;
}


static void
feed_stored(void *data, const kv_ev_origin_t *o, const kv_ev_stored_t *ev)
{
    int                node;
    size_t             i, salt_len;
    char               salt[PFX_SALT_MAX];
    uint64_t          *ids;
    kv_pfx_feed_t     *f;
    kv_pfx_stored_t    s;

    f = data;
    if (o->idx >= KV_EVS_MAX_SOURCES) {
        return;
    }
    node = f->node_of[o->idx];

    memset(&s, 0, sizeof(s));
    salt_len = 0;
    if (ev->parent == NULL
        && !first_block_salt(ev, salt, sizeof(salt), &salt_len))
    {
        f->unkeyable += ev->nblocks;
        return;
    }

    ids = f->ids;
    if (ev->nblocks > KV_PFX_FEED_MAX_BLOCKS) {
        f->unkeyable += ev->nblocks;
        return;
    }
    for (i = 0; i < ev->nblocks; i++) {
        ids[i] = ev->hashes[i].id;
    }

    s.has_parent = ev->parent != NULL;
    s.parent_id = ev->parent ? ev->parent->id : 0;
    s.ids = ids;
    s.nblocks = ev->nblocks;
    s.tokens = ev->tokens;
    s.ntokens = ev->ntokens;
    s.block_size = ev->block_size;
    s.salt = salt;
    s.salt_len = salt_len;
    s.lower_tier = ev->tier != KV_EV_TIER_GPU;

    /* the module seeds with the request's "model": an adapter's name */
    if (ev->lora_name != NULL && ev->lora_name[0] != '\0') {
        kv_pfx_stored_seeded(f->ix, node, &s, ev->lora_name,
                             strlen(ev->lora_name));
    } else {
        kv_pfx_stored(f->ix, node, &s);
    }
}


static void
feed_removed(void *data, const kv_ev_origin_t *o, const kv_ev_removed_t *ev)
{
    size_t          i;
    kv_pfx_feed_t  *f;

    f = data;
    if (o->idx >= KV_EVS_MAX_SOURCES || ev->nblocks > KV_PFX_FEED_MAX_BLOCKS)
    {
        return;
    }
    for (i = 0; i < ev->nblocks; i++) {
        f->ids[i] = ev->hashes[i].id;
    }
    kv_pfx_removed(f->ix, f->node_of[o->idx], f->ids, ev->nblocks,
                   ev->tier != KV_EV_TIER_GPU);
}


static void
feed_cleared(void *data, const kv_ev_origin_t *o, kv_ev_clear_t why)
{
    uint32_t        i;
    uint64_t        held, now;
    kv_pfx_feed_t  *f;

    f = data;
    i = o->idx;
    if (i >= KV_EVS_MAX_SOURCES) {
        return;
    }
    held = kv_pfx_node_clear(f->ix, f->node_of[i]);
    if (held == 0) {
        return;                        /* nothing went: nothing to say */
    }
    /* at most one line a second per source (a publisher restarting in a
     * loop with blocks stored between restarts clears every time) */
    now = kv_now_ms();
    if (f->clear_t[i] != 0 && now - f->clear_t[i] < 1000) {
        f->clear_quiet[i]++;
        f->clear_quiet_blocks[i] += held;
        return;
    }
    kv_info("prefix index: node %s cleared (%s): %llu blocks dropped "
            "(%llu clears, %llu blocks, not logged in the last second)",
            o->node, kv_ev_clear_name(why), (unsigned long long) held,
            (unsigned long long) f->clear_quiet[i],
            (unsigned long long) f->clear_quiet_blocks[i]);
    f->clear_t[i] = now;
    f->clear_quiet[i] = 0;
    f->clear_quiet_blocks[i] = 0;
}


int
kv_pfx_feed_init(kv_pfx_feed_t *f, kv_pfx_t *ix, const kv_evs_conf_t *c,
    kv_ev_sink_t *sink)
{
    int  i, j;

    memset(f, 0, sizeof(*f));
    f->ix = ix;
    f->ids = malloc(KV_PFX_FEED_MAX_BLOCKS * sizeof(uint64_t));
    if (f->ids == NULL) {
        kv_err("prefix index: out of memory");
        return -1;
    }

    for (i = 0; i < KV_EVS_MAX_SOURCES; i++) {
        f->node_of[i] = -1;            /* a slot no source has (yet) */
    }
    for (i = 0; i < c->nsrc; i++) {
        /* a node given once per data-parallel rank: one index node */
        for (j = 0; j < i; j++) {
            if (strcmp(c->src[j].node, c->src[i].node) == 0) {
                break;
            }
        }
        if (j < i) {
            f->node_of[i] = f->node_of[j];
            continue;
        }
        f->node_of[i] = kv_pfx_node(ix, c->src[i].node, c->src[i].http,
                                    c->src[i].model);
        if (f->node_of[i] < 0) {
            kv_err("prefix index: no room for node %s (at most %d)",
                   c->src[i].node, DPD_PFX_MAX_NODES);
            return -1;
        }
    }

    sink->data = f;
    sink->stored = feed_stored;
    sink->removed = feed_removed;
    sink->cleared = feed_cleared;
    return 0;
}


int
kv_pfx_feed_attach(kv_pfx_feed_t *f, uint32_t idx, const char *node,
    const char *http, const char *model)
{
    if (idx >= KV_EVS_MAX_SOURCES || f->node_of[idx] >= 0) {
        return -1;
    }
    f->node_of[idx] = kv_pfx_node(f->ix, node, http, model);
    return f->node_of[idx];
}


uint64_t
kv_pfx_feed_detach(kv_pfx_feed_t *f, uint32_t idx)
{
    uint64_t  held;

    if (idx >= KV_EVS_MAX_SOURCES || f->node_of[idx] < 0) {
        return 0;
    }
    held = kv_pfx_node_release(f->ix, f->node_of[idx]);
    f->node_of[idx] = -1;
    return held;
}


void
kv_pfx_feed_free(kv_pfx_feed_t *f)
{
    free(f->ids);
    f->ids = NULL;
}
