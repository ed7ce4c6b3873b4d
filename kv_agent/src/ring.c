/*
 * ring.c - a staged receiver's bounded landing ring (one per rank whose
 * pool the NIC cannot write: GPU memory without FI_HMEM, or any pool with
 * transfer.staging "host").
 *
 * recv_slots slots of recv_chunk bytes of pinned host memory per rank,
 * registered on the rank's rails (FI_REMOTE_WRITE) in place of a mirror of
 * the pool.  A rank's part of a request is a byte stream: for each (layer,
 * region), the destination blocks in push order.  Chunk k of it is the
 * bytes [k * recv_chunk, (k + 1) * recv_chunk).  The receiver grants a
 * free slot to one request for one chunk (push_credit over the control
 * channel, a grant number unique to that grant); the sender writes the
 * chunk into the slot and, once those writes completed, sends a chunk
 * notice over the fabric (ordered after the write completions like the
 * done message).  The receiver knows what the chunk holds from its own
 * block list, so a notice names only the slot and the grant: a notice for
 * a slot its sender does not hold, for an earlier grant, or repeated, is
 * ignored.  The slot is copied into the pool (a batch of copies, one
 * event) and, when the event completed, is free to be granted again.
 * A request that fails keeps its granted slots as long as its blocks stay
 * quarantined (its sender may still write them); memory: ranks x
 * recv_slots x recv_chunk (32 MiB per rank by default).
 *
 * A slot being copied in is writing its holder's blocks: whatever happens
 * to the request (failed, released, its quarantine lifted), the slot and
 * those blocks stay held until the copy engine reports the event done.
 * Nothing is freed on a timeout and the loop never waits for a copy.  An
 * engine that cannot record or report an event has failed: its slots are
 * lost (held, with their holders' blocks, until the agent exits), the
 * rank takes no staged transfer any more, and that is said loudly.
 */

#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "kv.h"


int
kv_ring_open(kv_ctx_t *ctx, int rank, int dev)
{
    kv_rring_t *g;
    kv_copy_t tmp;

    if (ctx->rring[rank]) {
        return 0;
    }
    g = calloc(1, sizeof(*g));
    if (g == NULL) {
        return -1;
    }
    g->chunk = ctx->cfg.recv_chunk;
    g->nslots = g->nfree = ctx->cfg.recv_slots;
    g->cuda_dev = dev;
    memset(&tmp, 0, sizeof(tmp));
    tmp.dev = dev;
    g->buf = kv_copy_host_alloc(&tmp, g->chunk * g->nslots);
    if (g->buf == NULL) {
        kv_err("ring: rank %d: cannot allocate %zu bytes of pinned landing "
               "memory", rank, g->chunk * g->nslots);
        free(g);
        return -1;
    }
    ctx->rring[rank] = g;
    return 0;
}


void
kv_ring_close(kv_ctx_t *ctx, int rank)
{
    kv_rring_t *g = ctx->rring[rank];
    kv_copy_t tmp;

    if (g == NULL) {
        return;
    }
    memset(&tmp, 0, sizeof(tmp));
    tmp.dev = g->cuda_dev;
    kv_copy_host_free(&tmp, g->buf, g->chunk * g->nslots);
    free(g);
    ctx->rring[rank] = NULL;
}


static uint64_t
rank_bytes(kv_ctx_t *ctx, const kv_rreq_t *r)
{
    const kv_layout_t *l = &ctx->cfg.layout;

    return (uint64_t) r->n * l->layers * l->regions * l->block_bytes;
}


/* A request landing in the ring: its destination blocks in push order
 * (the stream's layout).  0, or -1 (err) */
int
kv_ring_setup(kv_ctx_t *ctx, kv_rreq_t *r, const uint32_t *dst, uint32_t n,
    char *err, size_t elen)
{
    uint64_t c = ctx->cfg.recv_chunk, rb;

    if (kv_ring_usable(ctx, err, elen) != 0) {
        return -1;
    }
    if (r->copying) {
        snprintf(err, elen, "request %s still has copies in flight (bug)",
                 r->req_id);
        return -1;
    }
    free(r->blocks);
    r->blocks = malloc((size_t) n * sizeof(uint32_t));
    if (r->blocks == NULL) {
        snprintf(err, elen, "out of memory");
        return -1;
    }
    memcpy(r->blocks, dst, (size_t) n * sizeof(uint32_t));
    rb = rank_bytes(ctx, r);
    r->ring = 1;
    r->nchunks = (uint32_t) ((rb + c - 1) / c);
    memset(r->granted, 0, sizeof(r->granted));
    memset(r->copied, 0, sizeof(r->copied));
    r->held = 0;
    r->ring_left = 0;
    r->done_seen = 0;
    return 0;
}


/* 0 when every rank's copy-in engine can be trusted with a new request. */
int
kv_ring_usable(kv_ctx_t *ctx, char *err, size_t elen)
{
    int k;

    for (k = 0; k < ctx->nranks; k++) {
        if (ctx->rring[k] && ctx->rcopy_open[k] && ctx->rcopy[k].failed) {
            snprintf(err, elen, "the copy engine of rank %d failed with "
                     "copies into the pool outstanding (%u ring slot(s) and "
                     "their blocks held); restart the agent", k,
                     ctx->rring[k]->nlost);
            return -1;
        }
    }
    return 0;
}


/* Ring slots lost to a failed copy engine, all ranks. */
uint32_t
kv_ring_lost(kv_ctx_t *ctx)
{
    uint32_t n = 0;
    int k;

    for (k = 0; k < ctx->nranks; k++) {
        n += ctx->rring[k] ? ctx->rring[k]->nlost : 0;
    }
    return n;
}


/* 1 when every ring rank's chunks were copied in */
int
kv_ring_complete(kv_ctx_t *ctx, const kv_rreq_t *r)
{
    int k;

    for (k = 0; k < ctx->nranks; k++) {
        if (ctx->rring[k] && r->copied[k] != r->nchunks) {
            return 0;
        }
    }
    return 1;
}


/* r's sender can no longer write its granted slots (it drained, or it is
 * gone, or the keys changed): they go back to the ring.  Slots still
 * being copied in stay r's until their events complete (kv_ring_progress
 * finishes the release then). */
void
kv_ring_release(kv_ctx_t *ctx, kv_rreq_t *r)
{
    uint32_t tag = (uint32_t) (r - ctx->rreq), i;
    kv_rring_t *g;
    int k;

    if (!r->ring) {
        return;
    }
    for (k = 0; r->held > r->copying && k < ctx->nranks; k++) {
        g = ctx->rring[k];
        for (i = 0; g && i < g->nslots; i++) {
            if (g->slot[i].state == KV_RS_GRANTED && g->slot[i].rreq == tag) {
                g->slot[i].state = KV_RS_FREE;
                g->nfree++;
                r->held--;
            }
        }
    }
    if (r->held != r->copying) {
        kv_err("ring: %s: %u slot(s) unaccounted for (bug)", r->req_id,
               r->held - r->copying);
        r->held = r->copying;
    }
    if (r->copying) {
        r->ring_left = 1;
        return;
    }
    free(r->blocks);
    r->blocks = NULL;
    r->ring = 0;
    r->ring_left = 0;
}


/* A grant number nobody can guess (a fabric message's sender is not
 * authenticated): random high bits; the low 24 count, so live grants
 * (at most ranks x recv_slots) never share one; never 0. */
static uint64_t
grant_number(kv_ctx_t *ctx)
{
    uint64_t g = 0;

    if (getrandom(&g, sizeof(g), 0) != sizeof(g)) {
        g = kv_now_us() * 0x9e3779b97f4a7c15ULL;
    }
    g = (g & ~0xffffffULL) | (++ctx->grant_seq & 0xffffff);
    return g ? g : 1;
}


/* Hand free slots to the requests that still have chunks to receive, a
 * fair share each, as push_credit messages. */
void
kv_ring_grant(kv_ctx_t *ctx)
{
    uint32_t i, j, nact = 0, quota, start;
    kv_rreq_t *r;
    kv_rring_t *g;
    cJSON *msg, *arr, *e;
    char num[32];
    int k, any = 0;

    for (k = 0; k < ctx->nranks; k++) {
        any |= ctx->rring[k] && ctx->rring[k]->nfree > 0;
    }
    if (!any || ctx->rreq == NULL) {
        return;
    }
    for (i = 0; i < ctx->nrreq; i++) {
        r = &ctx->rreq[i];
        nact += r->used && r->ring && r->state == DPD_REQ_TRANSFERRING;
    }
    if (nact == 0) {
        return;
    }
    start = ctx->ring_rr++;
    for (j = 0; j < ctx->nrreq; j++) {
        i = (start + j) % ctx->nrreq;
        r = &ctx->rreq[i];
        if (!r->used || !r->ring || r->state != DPD_REQ_TRANSFERRING
            || r->detached)
        {
            continue;
        }
        msg = NULL;
        arr = NULL;
        for (k = 0; k < ctx->nranks; k++) {
            g = ctx->rring[k];
            if (g == NULL || ctx->rcopy[k].failed) {
                continue;
            }
            quota = g->nslots / nact ? g->nslots / nact : 1;
            while (g->nfree > 0 && r->granted[k] < r->nchunks
                   && r->granted[k] - r->copied[k] < quota)
            {
                kv_rslot_t *sl = NULL;
                uint32_t s;
                uint64_t off;
                for (s = 0; s < g->nslots; s++) {
                    if (g->slot[s].state == KV_RS_FREE) {
                        sl = &g->slot[s];
                        break;
                    }
                }
                if (sl == NULL) {
                    break;
                }
                off = (uint64_t) r->granted[k] * g->chunk;
                sl->state = KV_RS_GRANTED;
                sl->rreq = i;
                sl->chunk = r->granted[k]++;
                sl->grant = grant_number(ctx);
                sl->len = rank_bytes(ctx, r) - off < g->chunk
                          ? rank_bytes(ctx, r) - off : g->chunk;
                g->nfree--;
                r->held++;
                ctx->stat_ring_grants++;
                if (msg == NULL) {
                    msg = cJSON_CreateObject();
                    cJSON_AddStringToObject(msg, "type", "push_credit");
                    cJSON_AddStringToObject(msg, "req_id", r->req_id);
                    cJSON_AddNumberToObject(msg, "id", (double) r->begin_id);
                    snprintf(num, sizeof(num), "%llu",
                             (unsigned long long) r->begin_inst);
                    cJSON_AddStringToObject(msg, "inst", num);
                    arr = cJSON_AddArrayToObject(msg, "grants");
                }
                /* [rank, slot, chunk, grant]: the grant number as a
                 * string keeps it exact */
                e = cJSON_CreateArray();
                cJSON_AddItemToArray(e, cJSON_CreateNumber(k));
                cJSON_AddItemToArray(e, cJSON_CreateNumber(s));
                cJSON_AddItemToArray(e, cJSON_CreateNumber(sl->chunk));
                snprintf(num, sizeof(num), "%llu",
                         (unsigned long long) sl->grant);
                cJSON_AddItemToArray(e, cJSON_CreateString(num));
                cJSON_AddItemToArray(arr, e);
            }
        }
        if (msg) {
            /* a grant that cannot be sent stays held: the request times
             * out and its slots come back with it */
            kv_rreq_ctrl_send(ctx, r, msg);
        }
    }
}


/* Queue the copies of slot s of rank k (chunk sl->chunk of r) into the
 * pool: the stream's pieces, merged where the pool is contiguous. */
static int
slot_copy(kv_ctx_t *ctx, kv_rreq_t *r, int k, uint32_t s)
{
    const kv_layout_t *l = &ctx->cfg.layout;
    kv_rring_t *g = ctx->rring[k];
    kv_rslot_t *sl = &g->slot[s];
    kv_pool_t *p = KV_POOL(ctx, k);
    kv_copy_t *c = &ctx->rcopy[k];
    uint64_t bb = l->block_bytes, per_lr = (uint64_t) r->n * bb;
    uint64_t pos, end, take, dst, pdst = 0, plen = 0, psrc = 0;
    uint32_t lr, i;
    char *src = g->buf + (size_t) s * g->chunk;

    sl->seq = 0;
    pos = (uint64_t) sl->chunk * g->chunk;
    end = pos + sl->len;
    while (pos < end) {
        lr = (uint32_t) (pos / per_lr);
        i = (uint32_t) ((pos % per_lr) / bb);
        take = bb - pos % bb;
        if (take > end - pos) {
            take = end - pos;
        }
        if (lr >= l->layers * l->regions || i >= r->n
            || r->blocks[i] >= l->nblocks)
        {
            return -1;
        }
        dst = kv_layout_off(l, lr, r->blocks[i]) + pos % bb;
        if (dst + take > p->size) {
            return -1;
        }
        if (plen && pdst + plen == dst) {
            plen += take;
        } else {
            if (plen && c->ops->copy(c, (char *) p->base + pdst, src + psrc,
                                     plen, 1) != 0)
            {
                return -1;
            }
            pdst = dst;
            psrc = pos - (uint64_t) sl->chunk * g->chunk;
            plen = take;
        }
        pos += take;
    }
    if (plen && c->ops->copy(c, (char *) p->base + pdst, src + psrc, plen, 1)
        != 0)
    {
        return -1;
    }
    return c->ops->record(c, &sl->seq);
}


/* A copy-in whose event cannot be followed: nobody can say when (or
 * whether) its copies stop writing the holder's blocks.  The slot is lost
 * and the blocks stay owned until the agent exits (the CUDA context goes
 * with the process); the rank takes no staged transfer any more. */
static void
engine_failed(kv_ctx_t *ctx, int k, uint32_t s, const char *why)
{
    kv_rring_t *g = ctx->rring[k];
    kv_rslot_t *sl = &g->slot[s];
    kv_rreq_t *r = &ctx->rreq[sl->rreq];

    sl->state = KV_RS_LOST;
    g->nlost++;
    if (!ctx->rcopy[k].failed) {
        uint32_t i;
        ctx->rcopy[k].failed = 1;
        kv_err("ring: rank %d: the %s copy engine failed (%s): ring slot %u "
               "and the blocks of %s it copies into stay held until the "
               "agent exits; rank %d takes no staged transfer any more "
               "(restart the agent)", k, ctx->rcopy[k].ops->name, why, s,
               r->req_id, k);
        /* the others landing now would wait for grants that never come;
         * the caller fails r itself */
        for (i = 0; i < ctx->nrreq; i++) {
            kv_rreq_t *o = &ctx->rreq[i];
            if (o != r && o->used && o->ring
                && o->state == DPD_REQ_TRANSFERRING)
            {
                kv_rreq_set(ctx, o, DPD_REQ_FAILED, "the copy engine of "
                            "its staging ring failed; restart the agent");
            }
        }
    } else {
        kv_err("ring: rank %d: slot %u lost to the failed copy engine (%s); "
               "%s's blocks stay held", k, s, why, r->req_id);
    }
}


/* A chunk notice from a sender: its writes into the slot completed. */
void
kv_ring_notice(kv_ctx_t *ctx, const char *buf, size_t len)
{
    kv_chunk_msg_t m;
    kv_rring_t *g;
    kv_rslot_t *sl;
    kv_rreq_t *r;

    if (len < sizeof(m)) {
        kv_warn("ring: short chunk notice (%zu bytes) ignored", len);
        ctx->stat_ring_bad++;
        return;
    }
    memcpy(&m, buf, sizeof(m));
    m.req_id[sizeof(m.req_id) - 1] = '\0';
    m.node_id[sizeof(m.node_id) - 1] = '\0';
    r = kv_rreq_find(ctx, m.req_id);
    if (r == NULL || r->hash != m.hash || !r->ring
        || r->state != DPD_REQ_TRANSFERRING
        || strcmp(r->peer_id, m.node_id) != 0)
    {
        kv_warn("ring: chunk notice for %s from %s matches no transfer in "
                "progress", m.req_id, m.node_id);
        ctx->stat_ring_bad++;
        return;
    }
    if (m.rank >= (uint32_t) ctx->nranks || ctx->rring[m.rank] == NULL
        || m.slot >= ctx->rring[m.rank]->nslots)
    {
        kv_warn("ring: chunk notice for %s names rank %u slot %u, which "
                "does not exist", m.req_id, m.rank, m.slot);
        ctx->stat_ring_bad++;
        return;
    }
    g = ctx->rring[m.rank];
    sl = &g->slot[m.slot];
    if (sl->state != KV_RS_GRANTED || sl->rreq != (uint32_t) (r - ctx->rreq)
        || sl->grant != m.grant)
    {
        /* a repeat, a stale grant, or a slot that is not its */
        kv_warn("ring: chunk notice for %s (rank %u slot %u grant %llu) "
                "does not match a slot it holds; ignored", m.req_id, m.rank,
                m.slot, (unsigned long long) m.grant);
        ctx->stat_ring_bad++;
        return;
    }
    sl->state = KV_RS_COPYING;
    sl->t_us = sl->warn_us = kv_now_us();
    r->copying++;
    if (slot_copy(ctx, r, (int) m.rank, m.slot) != 0) {
        /* the copies queued so far must finish before the slot and r's
         * blocks are free: follow the event like any other */
        kv_copy_t *c = &ctx->rcopy[m.rank];
        if (sl->seq == 0 && c->ops->record(c, &sl->seq) != 0) {
            sl->seq = 0;
            engine_failed(ctx, (int) m.rank, m.slot, "could not record the "
                          "event after a failed copy");
        }
        kv_rreq_set(ctx, r, DPD_REQ_FAILED, "staging copy to GPU failed");
    }
}


/* Copies that completed free their slots; 1 while some are queued.  A
 * copy the engine has not reported for long is warned about (every 10 s),
 * never given up on. */
int
kv_ring_progress(kv_ctx_t *ctx)
{
    uint64_t now = 0;
    kv_rring_t *g;
    kv_rslot_t *sl;
    kv_rreq_t *r;
    uint32_t i;
    int k, q, busy = 0;

    for (k = 0; k < ctx->nranks; k++) {
        g = ctx->rring[k];
        for (i = 0; g && i < g->nslots; i++) {
            sl = &g->slot[i];
            if (sl->state != KV_RS_COPYING) {
                continue;
            }
            r = &ctx->rreq[sl->rreq];
            q = ctx->rcopy[k].ops->query(&ctx->rcopy[k], sl->seq);
            if (q == 0) {
                busy = 1;
                now = now ? now : kv_now_us();
                if (kv_copy_overdue(now, &sl->warn_us)) {
                    kv_warn("ring: rank %d: slot %u: the copy engine has not "
                            "completed the copy into %s's blocks for %llu s; "
                            "the slot and those blocks stay held until it "
                            "does", k, i, r->req_id,
                            (unsigned long long) ((now - sl->t_us)
                                                  / 1000000));
                }
                continue;
            }
            if (q < 0) {
                engine_failed(ctx, k, i, "an event reported an error");
                if (r->state == DPD_REQ_TRANSFERRING) {
                    kv_rreq_set(ctx, r, DPD_REQ_FAILED,
                                "staging copy to GPU failed");
                }
                continue;
            }
            sl->state = KV_RS_FREE;
            g->nfree++;
            r->held--;
            r->copying--;
            if (r->state == DPD_REQ_TRANSFERRING) {
                r->copied[k]++;
                ctx->stat_ring_chunks++;
                kv_rreq_ring_check(ctx, r);
            } else if (r->copying == 0) {
                /* what waited for its copies: the release of its ring,
                 * its blocks */
                if (r->ring_left) {
                    kv_ring_release(ctx, r);
                }
                kv_rreq_copies_done(ctx, r);
            }
        }
    }
    kv_ring_grant(ctx);
    return busy;
}


/* For the poll loop: the copies queued (kv_copy_poll). */
void
kv_ring_poll_state(kv_ctx_t *ctx, uint64_t now_us, kv_poll_state_t *ps)
{
    uint32_t i;
    int k;

    for (k = 0; k < ctx->nranks; k++) {
        kv_rring_t *g = ctx->rring[k];
        for (i = 0; g && i < g->nslots; i++) {
            if (g->slot[i].state == KV_RS_COPYING) {
                kv_copy_poll(&ctx->rcopy[k], g->slot[i].t_us, now_us, ps);
            }
        }
    }
}
