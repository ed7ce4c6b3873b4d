/*
 * layout.c - KV pool geometry: block id -> byte offset, and the segment
 * walker that turns (src block, dst block) pairs into as few contiguous
 * writes as the two layouts allow.
 *
 * Default layout (vLLM-like, one tensor per layer and region):
 *   offset(layer, region, block) = layer * layer_stride
 *                                + region * region_stride
 *                                + block * block_stride
 * with block_stride = block_bytes, region_stride = nblocks * block_stride,
 * layer_stride = regions * region_stride.
 */

#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "kv.h"


int
kv_layout_finish(kv_layout_t *l, char *err, size_t elen)
{
    uint64_t last;

    if (l->layers == 0 || l->regions == 0 || l->nblocks == 0
        || l->block_bytes == 0)
    {
        snprintf(err, elen, "pool: layers, regions, blocks and block_bytes "
                 "must be > 0");
        return -1;
    }
    if (l->regions > 16 || l->layers > 4096) {
        snprintf(err, elen, "pool: at most 4096 layers and 16 regions");
        return -1;
    }
    if (l->block_stride == 0) {
        l->block_stride = l->block_bytes;
    }
    if (l->block_stride < l->block_bytes) {
        snprintf(err, elen, "pool: block_stride < block_bytes");
        return -1;
    }
    if (l->region_stride == 0) {
        if (l->block_stride > UINT64_MAX / l->nblocks) {
            goto overflow;
        }
        l->region_stride = l->block_stride * l->nblocks;
    }
    if (l->layer_stride == 0) {
        if (l->region_stride > UINT64_MAX / l->regions) {
            goto overflow;
        }
        l->layer_stride = l->region_stride * l->regions;
    }
    /* the farthest byte: last layer, last region, last block */
    last = (uint64_t) (l->layers - 1) * l->layer_stride;
    if (l->layers > 1 && last / (l->layers - 1) != l->layer_stride) {
        goto overflow;
    }
    last += (uint64_t) (l->regions - 1) * l->region_stride;
    last += (uint64_t) (l->nblocks - 1) * l->block_stride;
    last += l->block_bytes;
    if (last < l->block_bytes || last > (1ULL << 46)) {
        goto overflow;
    }
    l->size = last;
    return 0;

overflow:
    snprintf(err, elen, "pool: geometry too large");
    return -1;
}


uint64_t
kv_layout_off(const kv_layout_t *l, uint32_t lr, uint32_t block)
{
    uint32_t layer = lr / l->regions, region = lr % l->regions;

    return (uint64_t) layer * l->layer_stride
           + (uint64_t) region * l->region_stride
           + (uint64_t) block * l->block_stride;
}


void
kv_segiter_init(kv_segiter_t *it, const kv_layout_t *sl,
    const kv_layout_t *dl, const uint32_t *src, const uint32_t *dst,
    uint32_t n, int coalesce)
{
    memset(it, 0, sizeof(*it));
    it->sl = sl;
    it->dl = dl;
    it->src = src;
    it->dst = dst;
    it->n = n;
    it->coalesce = coalesce;
}


/* One raw segment: a run of blocks consecutive on both sides within one
 * (layer, region), or a single block when coalescing is off. */
static int
raw_next(kv_segiter_t *it, kv_seg_t *seg)
{
    uint32_t nlr = it->sl->layers * it->sl->regions, i, j;
    int dense = it->sl->block_stride == it->sl->block_bytes
                && it->dl->block_stride == it->dl->block_bytes;

    while (it->lr < nlr) {
        if (it->i < it->n) {
            i = it->i;
            j = i + 1;
            if (it->coalesce && dense) {
                while (j < it->n && it->src[j] == it->src[j - 1] + 1
                       && it->dst[j] == it->dst[j - 1] + 1)
                {
                    j++;
                }
            }
            seg->src = kv_layout_off(it->sl, it->lr, it->src[i]);
            seg->dst = kv_layout_off(it->dl, it->lr, it->dst[i]);
            seg->len = (uint64_t) (j - i) * it->sl->block_bytes;
            it->i = j;
            return 1;
        }
        it->i = 0;
        it->lr++;
    }
    return 0;
}


int
kv_segiter_next(kv_segiter_t *it, kv_seg_t *out)
{
    if (!it->have_peek && !raw_next(it, &it->peek)) {
        return 0;
    }
    *out = it->peek;
    it->have_peek = 0;
    if (!it->coalesce) {
        return 1;
    }
    /* merge across (layer, region) boundaries while both sides stay
     * contiguous, e.g. a request owning a whole region */
    while (raw_next(it, &it->peek)) {
        if (it->peek.src == out->src + out->len
            && it->peek.dst == out->dst + out->len)
        {
            out->len += it->peek.len;
            continue;
        }
        it->have_peek = 1;
        break;
    }
    return 1;
}


/* The geometry fields shared by the info verb and the hello message. */
void
kv_layout_json(cJSON *o, const kv_layout_t *l)
{
    cJSON_AddNumberToObject(o, "layers", l->layers);
    cJSON_AddNumberToObject(o, "regions", l->regions);
    cJSON_AddNumberToObject(o, "blocks", l->nblocks);
    cJSON_AddNumberToObject(o, "block_bytes", (double) l->block_bytes);
    cJSON_AddNumberToObject(o, "block_stride", (double) l->block_stride);
    cJSON_AddNumberToObject(o, "region_stride", (double) l->region_stride);
    cJSON_AddNumberToObject(o, "layer_stride", (double) l->layer_stride);
}
