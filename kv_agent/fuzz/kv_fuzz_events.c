/*
 * kv_fuzz_events.c - libFuzzer target for the KV-event decoder
 * (kv_agent/src/kv_events.c).  Every input is decoded twice: with the
 * default bounds and with tiny ones (so the bound paths are reached);
 * the sink reads every byte it is handed and checks what the decoder
 * promises: token count = blocks x block size, every count within its
 * bound, bytes hashes of 1..64 bytes with the id their last 8 bytes,
 * strings NUL-terminated and short, a tier that matches the medium.
 * Seeds: kv_agent/fuzz/corpus (msgspec-built payloads of
 * t/kv_agent/kvevents.py).  Run: kv_agent/fuzz/run.sh BUILD SECONDS.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_events.h"


static const kv_ev_limits_t  *cur;
static volatile uint64_t      sum;


static void
touch_hash(const kv_ev_hash_t *h)
{
    uint64_t id = 0;
    uint32_t k;

    if (h->rawlen == 0) {
        if (h->raw != NULL) {
            abort();
        }
        sum += h->id;
        return;
    }
    if (h->rawlen > KV_EV_HASH_MAX || h->raw == NULL) {
        abort();
    }
    for (k = 0; k < h->rawlen; k++) {
        sum += h->raw[k];
    }
    for (k = h->rawlen > 8 ? h->rawlen - 8 : 0; k < h->rawlen; k++) {
        id = (id << 8) | h->raw[k];
    }
    if (id != h->id) {
        abort();
    }
}


static void
touch_str(const char *s)
{
    if (s && strlen(s) >= KV_EV_STR_MAX) {
        abort();
    }
}


static void
touch_tier(int tier, const char *medium)
{
    int gpu = medium == NULL || strcmp(medium, "GPU") == 0;

    if (medium && medium[0] == '\0') {
        abort();                       /* "" is reported as no medium */
    }
    if ((tier == KV_EV_TIER_GPU) != gpu) {
        abort();
    }
}


static void
f_stored(void *data, const kv_ev_origin_t *o, const kv_ev_stored_t *ev)
{
    uint32_t i;

    if (ev->nblocks == 0 || ev->nblocks > cur->max_blocks
        || ev->ntokens > cur->max_tokens || ev->block_size == 0
        || (uint64_t) ev->nblocks * ev->block_size != ev->ntokens)
    {
        abort();
    }
    for (i = 0; i < ev->nblocks; i++) {
        touch_hash(&ev->hashes[i]);
    }
    if (ev->parent) {
        touch_hash(ev->parent);
    }
    for (i = 0; i < ev->ntokens; i++) {
        sum += ev->tokens[i];
    }
    if (ev->extra_keys) {
        for (i = 0; i < ev->extra_keys_len; i++) {
            sum += ev->extra_keys[i];
        }
        if (ev->extra_keys_len == 0
            || ((ev->extra_keys[0] & 0xf0) != 0x90
                && ev->extra_keys[0] != 0xdc && ev->extra_keys[0] != 0xdd))
        {
            abort();                   /* not an array's bytes */
        }
    }
    touch_str(ev->medium);
    touch_str(ev->lora_name);
    touch_str(ev->spec_kind);
    touch_tier(ev->tier, ev->medium);
}


static void
f_removed(void *data, const kv_ev_origin_t *o, const kv_ev_removed_t *ev)
{
    uint32_t i;

    if (ev->nblocks == 0 || ev->nblocks > cur->max_blocks) {
        abort();
    }
    for (i = 0; i < ev->nblocks; i++) {
        touch_hash(&ev->hashes[i]);
    }
    touch_str(ev->medium);
    touch_tier(ev->tier, ev->medium);
}


static void
f_cleared(void *data, const kv_ev_origin_t *o, kv_ev_clear_t why)
{
    if (why != KV_EV_CLEAR_ENGINE) {
        abort();
    }
}


int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static kv_ev_decoder_t big, tiny;
    static int ready;
    static const kv_ev_limits_t small = { 4096, 8, 4, 64 };
    kv_ev_sink_t sink = { NULL, f_stored, f_removed, f_cleared };
    kv_ev_origin_t o;
    kv_ev_stats_t before;
    uint8_t *copy;
    int r;

    if (!ready) {
        if (kv_ev_decoder_init(&big, NULL) != 0
            || kv_ev_decoder_init(&tiny, &small) != 0)
        {
            abort();
        }
        ready = 1;
    }
    /* an exact-size heap copy: ASan sees any read past the end */
    copy = malloc(size ? size : 1);
    if (copy == NULL) {
        return 0;
    }
    memcpy(copy, data, size);
    memset(&o, 0, sizeof(o));
    o.node = "fuzz";
    o.http = "";

    cur = &big.lim;
    before = big.st;
    r = kv_ev_decode(&big, copy, size, &o, &sink);
    if (r < 0 && (big.st.stored != before.stored
                  || big.st.removed != before.removed
                  || big.st.cleared != before.cleared))
    {
        abort();                       /* refused whole, yet delivered */
    }
    cur = &tiny.lim;
    kv_ev_decode(&tiny, copy, size, &o, &sink);
    free(copy);
    return 0;
}
