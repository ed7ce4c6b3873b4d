/*
 * stage.c - a sender's bounded staging ring (one per rank whose pool the
 * NIC cannot read: GPU memory without FI_HMEM, or any pool with
 * transfer.staging "host").
 *
 * stage_slots slots of stage_chunk bytes of pinned host memory, registered
 * on the rank's rails (FI_WRITE: the local source of our writes).  xfer.c
 * fills a free slot with a batch of device->host copies queued on the
 * rank's copy stream, closed by one event; once the event completed, the
 * slot's pieces are written to the peer; the last write completion frees
 * the slot.  Copies of slot k+1 run while slot k is on the wire; with one
 * slot the same code runs copy, write, copy, write (the benchmark's
 * serial baseline).  Memory: stage_slots x stage_chunk per rank (32 MiB
 * by default), not a mirror of the pool.
 */

#include <stdlib.h>
#include <string.h>

#include "kv.h"


int
kv_stage_open(kv_ctx_t *ctx, int rank)
{
    kv_pool_t *p = KV_POOL(ctx, rank);
    kv_topo_t *t = &ctx->topo;
    kv_stage_t *s;
    uint64_t key;
    int k, ri;

    s = calloc(1, sizeof(*s));
    if (s == NULL) {
        return -1;
    }
    s->chunk = ctx->cfg.stage_chunk;
    s->nslots = s->nfree = ctx->cfg.stage_slots;
    s->overlap = s->nslots > 1;
    s->slot = calloc(s->nslots, sizeof(kv_slot_t));
#ifdef KV_HAVE_CUDA
    s->copy.ops = p->cuda_dev >= 0 ? &kv_copy_cuda_ops : &kv_copy_host_ops;
#else
    s->copy.ops = &kv_copy_host_ops;
#endif
    s->copy.dev = p->cuda_dev;
    s->copy.jobs = (size_t) s->nslots * (KV_SLOT_PIECES + 1);
    if (s->slot == NULL) {
        free(s);
        return -1;
    }
    if (s->copy.ops->open(&s->copy, p->cuda_dev) != 0) {
        free(s->slot);
        free(s);
        return -1;
    }
    s->buf = kv_copy_host_alloc(&s->copy, s->chunk * s->nslots);
    if (s->buf == NULL) {
        kv_err("stage: rank %d: cannot allocate %zu bytes of pinned "
               "staging memory", rank, s->chunk * s->nslots);
        goto fail;
    }
    for (k = 0; k < t->nrails[rank]; k++) {
        ri = t->rail[rank][k];
        if (kv_rail_reg(&ctx->fab.rail[ri], s->buf, s->chunk * s->nslots, -1,
                        FI_WRITE, &s->mr[ri], &s->desc[ri], &key) != 0)
        {
            goto fail;
        }
    }
    ctx->stage[rank] = s;
    kv_info("stage: rank %d: %u slot(s) x %zu bytes of pinned memory, %s "
            "copy engine%s", rank, s->nslots, s->chunk, s->copy.ops->name,
            s->overlap ? ", copies overlap writes" : " (serial)");
    return 0;

fail:
    for (k = 0; k < KV_MAX_RAILS; k++) {
        if (s->mr[k]) {
            fi_close(&s->mr[k]->fid);
        }
    }
    s->copy.ops->close(&s->copy);
    kv_copy_host_free(&s->copy, s->buf, s->chunk * s->nslots);
    free(s->slot);
    free(s);
    return -1;
}


void
kv_stage_close(kv_ctx_t *ctx, int rank)
{
    kv_stage_t *s = ctx->stage[rank];
    int k;

    if (s == NULL) {
        return;
    }
    s->copy.ops->close(&s->copy);      /* waits for queued copies */
    for (k = 0; k < KV_MAX_RAILS; k++) {
        if (s->mr[k]) {
            fi_close(&s->mr[k]->fid);
        }
    }
    kv_copy_host_free(&s->copy, s->buf, s->chunk * s->nslots);
    free(s->slot);
    free(s);
    ctx->stage[rank] = NULL;
}
