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

#include <msgpack.h>

#include "kv.h"
#include "prefix_index.h"
#include "prefix_events.h"

#define PFX_SALT_MAX  1024


static int
str_is(const msgpack_object *o, const char *s)
{
    size_t n = strlen(s);

    return o->type == MSGPACK_OBJECT_STR && o->via.str.size == n
           && memcmp(o->via.str.ptr, s, n) == 0;
}


/*
 * cache_salt of the sequence's first block from the event's extra_keys
 * (msgpack bytes of a list, one entry per block).  1: *salt/*len set
 * (len 0: none), 0: not indexable (extra keys we cannot reproduce),
 * salt points into buf (copied there, NUL-free is not required).
 */
static int
first_block_salt(const kv_ev_stored_t *ev, char *buf, size_t cap,
    size_t *len)
{
    int                     ok;
    size_t                  off, i, j;
    const char             *s;
    msgpack_object         *e, *it, *k;
    msgpack_unpacked        u;
    msgpack_unpack_return   rc;

    *len = 0;
    if (ev->extra_keys == NULL || ev->extra_keys_len == 0) {
        return 1;
    }

    msgpack_unpacked_init(&u);
    off = 0;
    rc = msgpack_unpack_next(&u, (const char *) ev->extra_keys,
                             ev->extra_keys_len, &off);
    ok = 0;
    if (rc != MSGPACK_UNPACK_SUCCESS) {
        goto done;
    }
    if (u.data.type == MSGPACK_OBJECT_NIL) {
        ok = 1;
        goto done;
    }
    if (u.data.type != MSGPACK_OBJECT_ARRAY || u.data.via.array.size == 0) {
        goto done;
    }
    e = &u.data.via.array.ptr[0];
    if (e->type == MSGPACK_OBJECT_NIL) {
        ok = 1;
        goto done;
    }
    if (e->type != MSGPACK_OBJECT_ARRAY) {
        goto done;
    }

    s = NULL;
    for (i = 0; i < e->via.array.size; i++) {
        it = &e->via.array.ptr[i];

        if (it->type == MSGPACK_OBJECT_STR) {
            /* plain form: the LoRA name, else the salt (one at most) */
            if (ev->lora_name != NULL
                && it->via.str.size == strlen(ev->lora_name)
                && memcmp(it->via.str.ptr, ev->lora_name,
                          it->via.str.size) == 0)
            {
                continue;
            }
            if (s != NULL) {
                goto done;             /* two strings: multimodal too */
            }
            s = it->via.str.ptr;
            *len = it->via.str.size;
            continue;
        }

        if (it->type == MSGPACK_OBJECT_MAP) {
            /* typed form: {"type": "lora"|"cache_salt", ...} */
            const msgpack_object *type = NULL, *salt = NULL;

            for (j = 0; j < it->via.map.size; j++) {
                k = &it->via.map.ptr[j].key;
                if (str_is(k, "type")) {
                    type = &it->via.map.ptr[j].val;
                } else if (str_is(k, "salt")) {
                    salt = &it->via.map.ptr[j].val;
                }
            }
            if (type != NULL && str_is(type, "lora")) {
                continue;
            }
            if (type != NULL && str_is(type, "cache_salt") && salt != NULL
                && salt->type == MSGPACK_OBJECT_STR && s == NULL)
            {
                s = salt->via.str.ptr;
                *len = salt->via.str.size;
                continue;
            }
        }
        goto done;                     /* anything else: not ours */
    }

    if (s != NULL) {
        if (*len > cap) {
            *len = 0;
            goto done;
        }
        memcpy(buf, s, *len);
    }
    ok = 1;

done:
    msgpack_unpacked_destroy(&u);
    if (!ok) {
        *len = 0;
    }
    return ok;
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
    kv_pfx_feed_t  *f;

    f = data;
    if (o->idx >= KV_EVS_MAX_SOURCES) {
        return;
    }
    kv_info("prefix index: node %s cleared (%s)", o->node,
            kv_ev_clear_name(why));
    kv_pfx_node_clear(f->ix, f->node_of[o->idx]);
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


void
kv_pfx_feed_free(kv_pfx_feed_t *f)
{
    free(f->ids);
    f->ids = NULL;
}
