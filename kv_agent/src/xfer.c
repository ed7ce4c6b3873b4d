/*
 * xfer.c - the data path.
 *
 * Sender (prefill): push = request id + peer + (src, dst) block pairs.
 *   1. push_begin over the control channel; the receiver bounds-checks the
 *      destination blocks against its pool and its reservations (or picks
 *      free blocks) and answers with the final destination list.
 *   2. The segment walker coalesces runs across blocks using both pool
 *      layouts; segments are split at min(max_write, max RMA size),
 *      striped round-robin over the rails and posted with fi_write under a
 *      global window.  Everything used here was allocated at start.
 *   3. When every write completed (FI_DELIVERY_COMPLETE where the provider
 *      offers it), a trailing "done" message goes over the fabric; the
 *      receiver marks the request ready only when it arrives.
 * Receiver (decode): reservations own blocks (ctx->owner); request states
 *   go to the state table and, as events, to router peers.
 *
 * Aborts and quarantine: once the receiver has answered push_ok, the sender
 * may have writes aimed at those blocks in flight until it says otherwise.
 * A request that fails after that point keeps its blocks in quarantine
 * (owned, not free, whoever released the request) and the receiver sends
 * push_cancel; the sender stops posting, waits for the completions of what
 * it posted and answers push_abort with "drained": only then are the
 * blocks reusable.  A quarantine nobody acknowledges ends when the peer's
 * process is gone (same host: pidfd) and its address is out of our AV, or
 * after quarantine_ms by revocation (the pool re-registered under new keys,
 * every peer reconnects) on providers where a new key stops old writes
 * (not shm, whose CMA writes do not check keys at the target).
 */

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "kv.h"

#define KV_NPUSH         32
#define KV_NRREQ         512
#define KV_PUSH_CAP_MAX  65536
#define KV_CQ_TURN_MAX   64       /* CQ reads per rail per loop turn */


static int push_active(const kv_push_t *p);
static void rreq_quar_end(kv_ctx_t *ctx, kv_rreq_t *r, const char *why);
static void rreq_hold_end(kv_ctx_t *ctx, kv_rreq_t *r);
static void stage_lost(kv_ctx_t *ctx, int r, uint32_t i, const char *why);
static void fault_parse(void);
static int  fault_no_credits, fault_repeat_notice;


/* Some rank of ours lands staged writes in a ring (ring.c). */
static int
has_ring(kv_ctx_t *ctx)
{
    int k;

    for (k = 0; k < ctx->nranks; k++) {
        if (ctx->rring[k]) {
            return 1;
        }
    }
    return 0;
}


static uint64_t
block_total_bytes(const kv_layout_t *l)
{
    return (uint64_t) l->layers * l->regions * l->block_bytes;
}


/* ---- fabric operation contexts ----------------------------------------- */

static kv_op_t *
op_get(kv_ctx_t *ctx)
{
    kv_op_t *op = ctx->op_free;

    if (op) {
        ctx->op_free = op->next_free;
        ctx->ops_used++;
        memset(&op->fctx, 0, sizeof(op->fctx));
    }
    return op;
}


static void
op_put(kv_ctx_t *ctx, kv_op_t *op)
{
    op->kind = 0;
    op->written_off = 0;
    op->cr = 0;
    op->next_free = ctx->op_free;
    ctx->op_free = op;
    ctx->ops_used--;
}


static char *
msg_slot(kv_ctx_t *ctx, uint32_t i)
{
    return ctx->fab.rail[0].msgbuf + (size_t) i * KV_MSG_SLOT;
}


static int
post_recv(kv_ctx_t *ctx, kv_op_t *op)
{
    kv_rail_t *r = &ctx->fab.rail[0];
    ssize_t rc;

    op->kind = KV_OP_RECV;
    op->rail = 0;
    rc = fi_recv(r->ep, msg_slot(ctx, op->slot), KV_MSG_SLOT, r->msg_desc,
                 FI_ADDR_UNSPEC, op);
    if (rc != 0) {
        kv_err("xfer: cannot post receive: %s", kv_fi_err((int) rc));
        return -1;
    }
    return 0;
}


int
kv_xfer_init(kv_ctx_t *ctx)
{
    const kv_layout_t *l = &ctx->cfg.layout;
    uint32_t i, nops;
    kv_rail_t *r;
    uint64_t key;

    ctx->nwaiters = ctx->cfg.max_clients;
    ctx->waiters = calloc(ctx->nwaiters, sizeof(*ctx->waiters));
    if (ctx->waiters == NULL) {
        return -1;
    }
    if (!ctx->cfg.has_pool) {
        return 0;
    }
    if (getrandom(&ctx->inst, sizeof(ctx->inst), 0) != sizeof(ctx->inst)) {
        ctx->inst = kv_wall_ms() ^ ((uint64_t) getpid() << 32);
    }
    ctx->inst |= 1;                     /* 0 means "not given" */
    ctx->owner = calloc(l->nblocks, sizeof(uint32_t));
    ctx->scratch = calloc(l->nblocks, sizeof(uint32_t));
    ctx->dupmap = calloc((l->nblocks + 7) / 8, 1);
    ctx->free_blocks = l->nblocks;
    ctx->push_cap = l->nblocks < KV_PUSH_CAP_MAX ? l->nblocks
                                                 : KV_PUSH_CAP_MAX;
    ctx->npush = KV_NPUSH;
    ctx->push = calloc(ctx->npush, sizeof(kv_push_t));
    ctx->nrreq = KV_NRREQ;
    ctx->rreq = calloc(ctx->nrreq, sizeof(kv_rreq_t));
    if (!ctx->owner || !ctx->scratch || !ctx->dupmap || !ctx->push
        || !ctx->rreq)
    {
        return -1;
    }
    for (i = 0; i < ctx->npush; i++) {
        ctx->push[i].cap = ctx->push_cap;
        ctx->push[i].src = malloc(2 * sizeof(uint32_t) * ctx->push_cap);
        if (ctx->push[i].src == NULL) {
            return -1;
        }
        ctx->push[i].dst = ctx->push[i].src + ctx->push_cap;
    }
    if (!ctx->fab_ok) {
        return 0;
    }
    fault_parse();
    /* shm writes through CMA (process_vm_writev) at the virtual address,
     * with no key check at the target: a new key does not stop them */
    ctx->revocable = strcmp(ctx->fab.rail[0].info->fabric_attr->prov_name,
                            "shm") != 0;

    /* trailing messages use rail 0: receive and send slots */
    r = &ctx->fab.rail[0];
    if (posix_memalign((void **) &r->msgbuf, 4096,
                       (size_t) (KV_NRECV + KV_NSEND) * KV_MSG_SLOT) != 0)
    {
        return -1;
    }
    memset(r->msgbuf, 0, (size_t) (KV_NRECV + KV_NSEND) * KV_MSG_SLOT);
    if (kv_rail_reg(r, r->msgbuf, (size_t) (KV_NRECV + KV_NSEND)
                    * KV_MSG_SLOT, -1, FI_SEND | FI_RECV, &r->msg_mr,
                    &r->msg_desc, &key) != 0)
    {
        return -1;
    }
    /* a window per rail, and as many again for writes of failed pushes
     * whose completions are still owed (write_off) */
    nops = KV_NRECV + KV_NSEND + 2 * ctx->cfg.window * ctx->fab.nrails + 16;
    ctx->ops = calloc(nops, sizeof(kv_op_t));
    if (ctx->ops == NULL) {
        return -1;
    }
    ctx->nops = nops;
    for (i = 0; i < nops; i++) {
        ctx->ops[i].next_free = i + 1 < nops ? &ctx->ops[i + 1] : NULL;
    }
    ctx->op_free = &ctx->ops[0];
    for (i = 0; i < KV_NSEND; i++) {
        ctx->send_free[i] = KV_NRECV + i;
    }
    ctx->nsend_free = KV_NSEND;
    for (i = 0; i < KV_NRECV; i++) {
        kv_op_t *op = op_get(ctx);
        op->slot = i;
        if (post_recv(ctx, op) != 0) {
            return -1;
        }
    }
    return 0;
}


void
kv_xfer_fini(kv_ctx_t *ctx)
{
    uint32_t i;

    if (ctx->push) {
        for (i = 0; i < ctx->npush; i++) {
            free(ctx->push[i].src);
        }
    }
    free(ctx->push);
    for (i = 0; ctx->rreq && i < ctx->nrreq; i++) {
        free(ctx->rreq[i].blocks);     /* a ring held by a lost copy */
    }
    free(ctx->rreq);
    free(ctx->owner);
    free(ctx->scratch);
    free(ctx->dupmap);
    free(ctx->ops);
    free(ctx->waiters);
    ctx->push = NULL;
    ctx->rreq = NULL;
    ctx->owner = NULL;
    ctx->scratch = NULL;
    ctx->dupmap = NULL;
    ctx->ops = NULL;
    ctx->waiters = NULL;
}


/* ---- receiver side: reservations ---------------------------------------- */

kv_rreq_t *
kv_rreq_find(kv_ctx_t *ctx, const char *req_id)
{
    uint64_t h = dpd_state_hash(req_id, strlen(req_id));
    uint32_t i;

    for (i = 0; ctx->rreq && i < ctx->nrreq; i++) {
        if (ctx->rreq[i].used && !ctx->rreq[i].detached
            && ctx->rreq[i].hash == h
            && strcmp(ctx->rreq[i].req_id, req_id) == 0)
        {
            return &ctx->rreq[i];
        }
    }
    return NULL;
}


static uint32_t
rreq_slot(kv_ctx_t *ctx, kv_rreq_t *r)
{
    return (uint32_t) (r - ctx->rreq);
}


/* The blocks a reservation owns, ascending, into ctx->scratch. */
static uint32_t
rreq_blocks(kv_ctx_t *ctx, kv_rreq_t *r)
{
    uint32_t tag = rreq_slot(ctx, r) + 1, b, n = 0;

    for (b = 0; b < ctx->cfg.layout.nblocks; b++) {
        if (ctx->owner[b] == tag) {
            ctx->scratch[n++] = b;
        }
    }
    return n;
}


static void
rreq_free_blocks(kv_ctx_t *ctx, kv_rreq_t *r)
{
    uint32_t tag = rreq_slot(ctx, r) + 1, b;

    if (r->n == 0) {
        return;
    }
    for (b = 0; b < ctx->cfg.layout.nblocks; b++) {
        if (ctx->owner[b] == tag) {
            ctx->owner[b] = 0;
            ctx->free_blocks++;
        }
    }
    r->n = 0;
}


static void
rreq_publish(kv_ctx_t *ctx, kv_rreq_t *r)
{
    dpd_req_rec_t *rec = kv_state_req(&ctx->st, r->req_id, 1);

    if (rec) {
        kv_state_req_begin(rec);
        rec->state = r->state;
        rec->bytes_done = r->bytes_done;
        rec->bytes_total = r->bytes_total;
        rec->nblocks = r->n;
        rec->t_reserved_ms = r->t_reserved_ms;
        rec->t_start_ms = r->t_start_ms;
        rec->t_done_ms = r->t_done_ms;
        rec->error = r->state == DPD_REQ_FAILED ? -EIO : 0;
        snprintf(rec->node_id, sizeof(rec->node_id), "%s",
                 ctx->cfg.node_id);
        snprintf(rec->peer_id, sizeof(rec->peer_id), "%s", r->peer_id);
        kv_state_req_end(&ctx->st, rec);
    }
    kv_ctrl_req_event(ctx, r);
    kv_ctrl_update_self(ctx);
}


/* 1 (and *dup) when ids[] names a block twice; ids >= nblocks are left to
 * the caller's range check.  No allocation: a bitmap of the pool. */
int
kv_dup_check(kv_ctx_t *ctx, const uint32_t *ids, uint32_t n, uint32_t *dup)
{
    uint32_t i, k, b, nb = ctx->cfg.layout.nblocks;
    int found = 0;

    for (i = 0; i < n; i++) {
        b = ids[i];
        if (b >= nb) {
            continue;
        }
        if (ctx->dupmap[b >> 3] & (1u << (b & 7))) {
            *dup = b;
            found = 1;
            break;
        }
        ctx->dupmap[b >> 3] |= (uint8_t) (1u << (b & 7));
    }
    for (k = 0; k < i; k++) {
        if (ids[k] < nb) {
            ctx->dupmap[ids[k] >> 3] = 0;
        }
    }
    return found;
}


/* Why block b (owned) cannot be given out. */
static void
block_busy_err(kv_ctx_t *ctx, uint32_t b, char *err, size_t elen)
{
    kv_rreq_t *o = &ctx->rreq[ctx->owner[b] - 1];

    if (o->quar) {
        snprintf(err, elen, "block %u is quarantined (a failed transfer "
                 "from %s may still write it)", b, o->peer_id);
    } else if (o->copying && o->state != DPD_REQ_TRANSFERRING) {
        snprintf(err, elen, "block %u is held: a copy from the staging ring "
                 "into it has not completed%s", b,
                 kv_ring_lost(ctx) ? " (the copy engine failed; restart the "
                 "agent)" : "");
    } else {
        snprintf(err, elen, "block %u is not free", b);
    }
}


int
kv_rreq_reserve(kv_ctx_t *ctx, const char *req_id, uint32_t n,
    const uint32_t *want, int peer, char *err, size_t elen, kv_rreq_t **out)
{
    const kv_layout_t *l = &ctx->cfg.layout;
    kv_rreq_t *r = NULL;
    uint32_t i, b, tag, got, dup;

    if (!ctx->cfg.has_pool) {
        snprintf(err, elen, "this node has no KV pool");
        return -1;
    }
    if (strlen(req_id) == 0 || strlen(req_id) >= KV_REQID_LEN) {
        snprintf(err, elen, "req_id must be 1..%d bytes", KV_REQID_LEN - 1);
        return -1;
    }
    r = kv_rreq_find(ctx, req_id);
    if (r) {
        if (r->state != DPD_REQ_FAILED) {
            snprintf(err, elen, "request %s already has a reservation",
                     req_id);
            return -1;
        }
        /* a retry of a failed request: the failed record goes (its
         * blocks stay quarantined while a late write may land) */
        kv_rreq_release(ctx, r);
        r = NULL;
    }
    if (n == 0) {
        snprintf(err, elen, "nblocks must be > 0");
        return -1;
    }
    if (want && kv_dup_check(ctx, want, n, &dup)) {
        snprintf(err, elen, "block %u is listed twice", dup);
        return -1;
    }
    if (n > ctx->free_blocks) {
        snprintf(err, elen, "pool full: %u blocks requested, %u free of %u",
                 n, ctx->free_blocks, l->nblocks);
        if (ctx->nquar || kv_copy_held(ctx)) {
            size_t k = strlen(err);
            snprintf(err + k, elen - k, " (%u request(s) quarantined, %u "
                     "held by copies from the staging ring)", ctx->nquar,
                     kv_copy_held(ctx));
        }
        return -1;
    }
    for (i = 0; i < ctx->nrreq; i++) {
        if (!ctx->rreq[i].used) {
            r = &ctx->rreq[i];
            break;
        }
    }
    if (r == NULL) {
        snprintf(err, elen, "too many requests (%u)", ctx->nrreq);
        return -1;
    }
    tag = rreq_slot(ctx, r) + 1;
    if (want) {
        for (i = 0; i < n; i++) {
            b = want[i];
            if (b >= l->nblocks || ctx->owner[b] != 0) {
                if (b >= l->nblocks) {
                    snprintf(err, elen, "block %u out of range (pool has %u "
                             "blocks)", b, l->nblocks);
                } else {
                    block_busy_err(ctx, b, err, elen);
                }
                /* roll back what this call claimed */
                while (i-- > 0) {
                    ctx->owner[want[i]] = 0;
                }
                return -1;
            }
            ctx->owner[b] = tag;
        }
    } else {
        for (b = 0, got = 0; b < l->nblocks && got < n; b++) {
            if (ctx->owner[b] == 0) {
                ctx->owner[b] = tag;
                got++;
            }
        }
    }
    ctx->free_blocks -= n;
    free(r->blocks);                   /* NULL unless a bug left one */
    memset(r, 0, sizeof(*r));
    r->used = 1;
    r->state = DPD_REQ_RESERVED;
    snprintf(r->req_id, sizeof(r->req_id), "%s", req_id);
    r->hash = dpd_state_hash(req_id, strlen(req_id));
    r->n = n;
    r->peer = peer;
    r->bytes_total = (uint64_t) n * block_total_bytes(l) * ctx->nranks;
    r->t_reserved_ms = kv_wall_ms();
    rreq_publish(ctx, r);
    *out = r;
    return 0;
}


/* A message to the sender of r's push: on the connection its push came
 * on (after our push_ok), else ours. */
int
kv_rreq_ctrl_send(kv_ctx_t *ctx, kv_rreq_t *r, cJSON *j)
{
    kv_peer_t *pe = &ctx->peers[r->peer];

    if (pe->in_conn >= 0 && !ctx->clients[pe->in_conn].conn.closing) {
        return kv_client_send(ctx, pe->in_conn, j);
    }
    return kv_ctrl_send(ctx, r->peer, j);
}


/* Tell the sender to stop writing into r's blocks and to say when its
 * writes have drained. */
static void
send_cancel(kv_ctx_t *ctx, kv_rreq_t *r)
{
    char num[32];
    cJSON *j;

    j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "type", "push_cancel");
    cJSON_AddStringToObject(j, "req_id", r->req_id);
    cJSON_AddNumberToObject(j, "id", (double) r->begin_id);
    snprintf(num, sizeof(num), "%llu", (unsigned long long) r->begin_inst);
    cJSON_AddStringToObject(j, "inst", num);
    cJSON_AddStringToObject(j, "error", r->error);
    kv_rreq_ctrl_send(ctx, r, j);
}


static void
rreq_quar_start(kv_ctx_t *ctx, kv_rreq_t *r)
{
    r->quar = 1;
    r->quar_since_ms = kv_now_ms();
    r->quar_warn_ms = r->quar_since_ms;
    ctx->nquar++;
    kv_info("xfer: %u block(s) of %s quarantined until %s confirms that no "
            "write to them is in flight", r->n, r->req_id, r->peer_id);
    if (!ctx->stop) {
        send_cancel(ctx, r);
    }
}


static void
rreq_quar_end(kv_ctx_t *ctx, kv_rreq_t *r, const char *why)
{
    if (!r->quar) {
        return;
    }
    r->quar = 0;
    ctx->nquar--;
    kv_info("xfer: quarantine of %s (%u block(s)) lifted: %s", r->req_id,
            r->n, why);
    kv_ring_release(ctx, r);           /* its ring slots too */
    rreq_hold_end(ctx, r);
}


/* Nothing holds r's blocks any more (no quarantine, no copy from the ring
 * still writing them): what waited for that. */
static void
rreq_hold_end(kv_ctx_t *ctx, kv_rreq_t *r)
{
    if (r->quar || r->copying) {
        return;
    }
    if (r->detached || (r->auto_res && r->state == DPD_REQ_FAILED)) {
        /* nobody local holds these blocks any more */
        rreq_free_blocks(ctx, r);
        kv_ctrl_update_self(ctx);
    }
    if (r->detached) {
        r->used = 0;
    }
}


/* The last copy from the ring into a failed or released r's blocks
 * completed (ring.c). */
void
kv_rreq_copies_done(kv_ctx_t *ctx, kv_rreq_t *r)
{
    if (r->quar) {
        return;                        /* its quarantine still holds them */
    }
    kv_info("xfer: the copies into %s's %u block(s) completed; they are no "
            "longer held", r->req_id, r->n);
    rreq_hold_end(ctx, r);
}


/* drained: the sender said nothing of its push is in flight any more */
static void
rreq_set(kv_ctx_t *ctx, kv_rreq_t *r, uint32_t state, const char *error,
    int drained)
{
    uint32_t was = r->state;

    r->state = state;
    if (state == DPD_REQ_READY || state == DPD_REQ_FAILED) {
        r->t_done_ms = kv_wall_ms();
        r->t_final_ms = kv_now_ms();
    }
    if (state == DPD_REQ_READY) {
        r->bytes_done = r->bytes_total;
        ctx->stat_reqs_ready++;
        ctx->stat_bytes_in += r->bytes_total;
        kv_info("xfer: request %s ready (%llu bytes from %s)", r->req_id,
                (unsigned long long) r->bytes_total, r->peer_id);
    }
    if (state == DPD_REQ_FAILED) {
        snprintf(r->error, sizeof(r->error), "%s", error ? error : "failed");
        ctx->stat_reqs_failed++;
        kv_warn("xfer: request %s failed: %s", r->req_id, r->error);
        if (was == DPD_REQ_TRANSFERRING && r->peer >= 0 && !drained) {
            /* the sender was told these blocks: it may still write */
            rreq_quar_start(ctx, r);
        } else if (r->auto_res && !r->copying) {
            /* nobody local asked for these blocks: give them back (once
             * copies still writing them completed: kv_rreq_copies_done) */
            rreq_free_blocks(ctx, r);
        }
    }
    if ((state == DPD_REQ_FAILED && !r->quar) || state == DPD_REQ_READY) {
        /* nothing of its sender can land in its ring slots any more */
        kv_ring_release(ctx, r);
    }
    rreq_publish(ctx, r);
    if (state == DPD_REQ_READY || state == DPD_REQ_FAILED) {
        kv_api_notify(ctx, r->req_id);
    }
}


void
kv_rreq_set(kv_ctx_t *ctx, kv_rreq_t *r, uint32_t state, const char *error)
{
    rreq_set(ctx, r, state, error, 0);
}


void
kv_rreq_release(kv_ctx_t *ctx, kv_rreq_t *r)
{
    dpd_req_rec_t *rec;
    uint32_t st = r->state;

    if (!r->quar) {
        kv_ring_release(ctx, r);
        if (!r->copying) {
            rreq_free_blocks(ctx, r);
        }
    }
    r->state = DPD_REQ_FREE;            /* routers drop their copy */
    kv_ctrl_req_event(ctx, r);
    r->state = st;
    rec = kv_state_req(&ctx->st, r->req_id, 0);
    if (rec) {
        kv_state_req_delete(&ctx->st, rec);
    }
    if (r->quar || r->copying) {
        /* the request id is free again; the slot keeps its blocks until
         * the quarantine ends and the copies into them completed */
        r->detached = 1;
    } else {
        r->used = 0;
    }
    kv_ctrl_update_self(ctx);
}


void
kv_rreq_peer_down(kv_ctx_t *ctx, int peer, const char *why)
{
    uint32_t i;

    for (i = 0; ctx->rreq && i < ctx->nrreq; i++) {
        if (ctx->rreq[i].used && ctx->rreq[i].peer == peer
            && ctx->rreq[i].state == DPD_REQ_TRANSFERRING)
        {
            kv_rreq_set(ctx, &ctx->rreq[i], DPD_REQ_FAILED, why);
        }
    }
}


/* The peer (re)connected: ask again for the acknowledgements we miss. */
void
kv_rreq_peer_up(kv_ctx_t *ctx, int peer)
{
    uint32_t i;

    for (i = 0; ctx->rreq && i < ctx->nrreq; i++) {
        if (ctx->rreq[i].used && ctx->rreq[i].quar
            && ctx->rreq[i].peer == peer)
        {
            send_cancel(ctx, &ctx->rreq[i]);
        }
    }
}


static uint64_t
inst_of(cJSON *j)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(j, "inst");

    return cJSON_IsString(v) ? strtoull(v->valuestring, NULL, 10) : 0;
}


/* push_abort from the sender: it failed the push ("drained": and nothing
 * it posted is in flight any more). */
void
kv_rreq_abort_msg(kv_ctx_t *ctx, int peer, cJSON *j)
{
    cJSON *jr = cJSON_GetObjectItemCaseSensitive(j, "req_id");
    cJSON *jid = cJSON_GetObjectItemCaseSensitive(j, "id");
    cJSON *je = cJSON_GetObjectItemCaseSensitive(j, "error");
    int drained = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j,
                                                                "drained"));
    uint64_t id = cJSON_IsNumber(jid) ? (uint64_t) jid->valuedouble : 0;
    uint64_t inst = inst_of(j);
    kv_rreq_t *r = NULL;
    char why[200];
    uint32_t i;

    for (i = 0; ctx->rreq && i < ctx->nrreq; i++) {
        kv_rreq_t *q = &ctx->rreq[i];
        if (q->used && q->peer == peer && id != 0 && q->begin_id == id
            && (inst == 0 || q->begin_inst == inst))
        {
            r = q;
            break;
        }
    }
    if (r == NULL && id == 0 && cJSON_IsString(jr)) {
        /* a sender that does not number its pushes */
        r = kv_rreq_find(ctx, jr->valuestring);
        if (r && r->peer != peer) {
            r = NULL;
        }
        drained = 0;
    }
    if (r == NULL) {
        kv_debug("ctrl: push_abort from %s matches no request",
                 ctx->peers[peer].conf.id);
        return;
    }
    if (r->state == DPD_REQ_TRANSFERRING) {
        snprintf(why, sizeof(why), "aborted by %s: %s",
                 ctx->peers[peer].conf.id,
                 cJSON_IsString(je) ? je->valuestring : "?");
        rreq_set(ctx, r, DPD_REQ_FAILED, why, drained);
    }
    if (drained) {
        rreq_quar_end(ctx, r, "the sender's writes drained");
    }
}


/* Has the incarnation of the peer that r's push came from exited, with
 * its address out of our AV (so nothing it sent can still complete)? */
static int
sender_gone(kv_ctx_t *ctx, kv_rreq_t *r)
{
    kv_peer_t *pe = &ctx->peers[r->peer];
    struct pollfd pf;
    uint64_t start;
    int fd, i, pid;

    if (r->begin_inst != 0 && r->begin_inst == pe->inst) {
        fd = pe->pidfd;
        pid = pe->pid;
        start = pe->pid_start;
        if (pe->out_state == KV_LINK_UP || pe->in_conn >= 0) {
            return 0;
        }
        for (i = 0; i < KV_MAX_RAILS * KV_MAX_RAILS; i++) {
            if (pe->remote.av_ok[i / KV_MAX_RAILS][i % KV_MAX_RAILS]) {
                return 0;
            }
        }
    } else if (r->begin_inst != 0 && r->begin_inst == pe->old_inst) {
        fd = pe->old_pidfd;         /* its successor's hello re-keyed AV */
        pid = pe->old_pid;
        start = pe->old_pid_start;
    } else {
        return 0;
    }
    if (fd < 0) {
        /* no pidfd: the same pid with the same start time is the same
         * process; anything else means it is gone */
        return pid > 0 && start != 0 && kv_proc_start(pid) != start;
    }
    pf.fd = fd;
    pf.events = POLLIN;
    pf.revents = 0;
    return poll(&pf, 1, 0) == 1 && (pf.revents & POLLIN);
}


void
kv_quar_lift_all(kv_ctx_t *ctx, const char *why)
{
    uint32_t i;

    for (i = 0; ctx->rreq && i < ctx->nrreq; i++) {
        if (ctx->rreq[i].used && ctx->rreq[i].quar) {
            rreq_quar_end(ctx, &ctx->rreq[i], why);
        }
    }
}


void
kv_quar_tick(kv_ctx_t *ctx, uint64_t now)
{
    uint64_t lim = (uint64_t) ctx->cfg.quarantine_ms;
    kv_rreq_t *r;
    int revoke = 0;
    uint32_t i;

    for (i = 0; ctx->nquar && ctx->rreq && i < ctx->nrreq; i++) {
        r = &ctx->rreq[i];
        if (!r->used || !r->quar) {
            continue;
        }
        if (sender_gone(ctx, r)) {
            rreq_quar_end(ctx, r, "the sender's process exited");
            continue;
        }
        if (now < r->quar_since_ms + lim) {
            continue;
        }
        if (ctx->revocable) {
            revoke = 1;
        } else if (now >= r->quar_warn_ms + lim) {
            r->quar_warn_ms = now;
            kv_warn("xfer: %u block(s) of %s quarantined for %llu ms: %s has "
                    "not confirmed that its writes stopped, and on %s a new "
                    "memory key does not stop them; waiting", r->n,
                    r->req_id, (unsigned long long) (now - r->quar_since_ms),
                    r->peer_id, ctx->fab.rail[0].info->fabric_attr->prov_name);
        }
    }
    if (revoke) {
        kv_pool_revoke(ctx, "a quarantine was not acknowledged within "
                       "quarantine_ms");
    }
}


/* push_begin from peer: validate, reserve or match the reservation, and
 * answer with the destination blocks.  Returns 0 (reply filled) or -1
 * (reply holds the error). */
int
kv_ctrl_push_begin(kv_ctx_t *ctx, int peer, cJSON *j, cJSON *reply)
{
    const kv_layout_t *l = &ctx->cfg.layout;
    cJSON *jr = cJSON_GetObjectItemCaseSensitive(j, "req_id");
    cJSON *jn = cJSON_GetObjectItemCaseSensitive(j, "nblocks");
    cJSON *jd = cJSON_GetObjectItemCaseSensitive(j, "dst_runs");
    cJSON *jg = cJSON_GetObjectItemCaseSensitive(j, "geometry");
    cJSON *jid = cJSON_GetObjectItemCaseSensitive(j, "id");
    kv_rreq_t *r;
    char err[200];
    uint32_t n, nd = 0, i, tag, dup, *want = NULL;
    const char *req_id;

    err[0] = '\0';
    if (!cJSON_IsString(jr) || !cJSON_IsNumber(jn) || jn->valuedouble < 1
        || jn->valuedouble > 4294967295.0)
    {
        snprintf(err, sizeof(err), "push_begin needs req_id and nblocks");
        goto fail;
    }
    req_id = jr->valuestring;
    n = (uint32_t) jn->valuedouble;
    if (!ctx->cfg.has_pool) {
        snprintf(err, sizeof(err), "node %s has no registered KV pool",
                 ctx->cfg.node_id);
        goto fail;
    }
    if (kv_pools_ready(ctx, err, sizeof(err)) != 0) {
        goto fail;
    }
    if (ctx->cfg.role != DPD_ROLE_DECODE) {
        snprintf(err, sizeof(err), "node %s is not a decode node",
                 ctx->cfg.node_id);
        goto fail;
    }
    if (ctx->peers[peer].conf.role != DPD_ROLE_PREFILL) {
        snprintf(err, sizeof(err), "peer %s is configured as %s, only "
                 "prefill peers may push", ctx->peers[peer].conf.id,
                 dpd_state_role_name(ctx->peers[peer].conf.role));
        goto fail;
    }
    {
        /* the sender says which of our ranks it writes through our ring
         * ("ring_ranks", a bit per rank); it must be exactly ours: a
         * write at pool offsets into a ring would land past it */
        cJSON *jc = cJSON_GetObjectItemCaseSensitive(j, "credits");
        cJSON *jm = cJSON_GetObjectItemCaseSensitive(j, "ring_ranks");
        uint32_t mine = 0, theirs;
        int k;
        for (k = 0; k < ctx->nranks; k++) {
            mine |= ctx->rring[k] ? 1u << k : 0;
        }
        theirs = cJSON_IsNumber(jm) && jm->valuedouble >= 0
                 && jm->valuedouble < 256 ? (uint32_t) jm->valuedouble : 0;
        if (mine && (!cJSON_IsNumber(jc) || jc->valuedouble < KV_RING_PROTO))
        {
            /* an older sender would write at pool offsets: refuse */
            snprintf(err, sizeof(err), "%s lands staged writes in a ring "
                     "of granted slots; the sender's kv_agent does not "
                     "follow ring credits (upgrade it)", ctx->cfg.node_id);
            goto fail;
        }
        if (theirs != mine) {
            snprintf(err, sizeof(err), "the sender's view of %s's landing "
                     "ring is stale (ranks 0x%x, ours 0x%x): reconnect",
                     ctx->cfg.node_id, theirs, mine);
            goto fail;
        }
    }
    if (cJSON_IsObject(jg)) {
        cJSON *a = cJSON_GetObjectItemCaseSensitive(jg, "layers");
        cJSON *b = cJSON_GetObjectItemCaseSensitive(jg, "regions");
        cJSON *c = cJSON_GetObjectItemCaseSensitive(jg, "block_bytes");
        if (!cJSON_IsNumber(a) || !cJSON_IsNumber(b) || !cJSON_IsNumber(c)
            || (uint32_t) a->valuedouble != l->layers
            || (uint32_t) b->valuedouble != l->regions
            || (uint64_t) c->valuedouble != l->block_bytes)
        {
            snprintf(err, sizeof(err), "pool geometry differs from %s's",
                     ctx->cfg.node_id);
            goto fail;
        }
        a = cJSON_GetObjectItemCaseSensitive(jg, "ranks");
        if ((a ? (cJSON_IsNumber(a) ? (int) a->valuedouble : -1) : 1)
            != ctx->nranks)
        {
            snprintf(err, sizeof(err), "tensor-parallel mismatch: %s pushes "
                     "%d rank(s), %s serves %d; pushes between different TP "
                     "sizes are not supported", ctx->peers[peer].conf.id,
                     a && cJSON_IsNumber(a) ? (int) a->valuedouble : 1,
                     ctx->cfg.node_id, ctx->nranks);
            goto fail;
        }
    }
    if (n > l->nblocks) {
        snprintf(err, sizeof(err), "%u blocks requested, pool has %u", n,
                 l->nblocks);
        goto fail;
    }
    if (jd) {
        if (kv_runs_parse(jd, ctx->scratch, l->nblocks, &nd, err,
                          sizeof(err)) != 0)
        {
            goto fail;
        }
        if (nd != n) {
            snprintf(err, sizeof(err), "dst_runs holds %u blocks, nblocks "
                     "is %u", nd, n);
            goto fail;
        }
        for (i = 0; i < nd; i++) {
            if (ctx->scratch[i] >= l->nblocks) {
                snprintf(err, sizeof(err), "dst block %u out of range (pool "
                         "has %u blocks)", ctx->scratch[i], l->nblocks);
                goto fail;
            }
        }
        if (kv_dup_check(ctx, ctx->scratch, nd, &dup)) {
            snprintf(err, sizeof(err), "dst block %u is listed twice", dup);
            goto fail;
        }
        want = ctx->scratch;
    }

    r = kv_rreq_find(ctx, req_id);
    if (r && r->state == DPD_REQ_FAILED) {
        /* a retry: the failed attempt's record goes, its blocks stay in
         * quarantine while a late write of it may still land */
        kv_rreq_release(ctx, r);
        r = NULL;
    }
    if (r) {
        if (r->state == DPD_REQ_TRANSFERRING || r->state == DPD_REQ_READY) {
            snprintf(err, sizeof(err), "request %s is already %s", req_id,
                     dpd_state_req_name(r->state));
            goto fail;
        }
        if (r->n != n) {
            snprintf(err, sizeof(err), "request %s reserved %u blocks, the "
                     "push has %u", req_id, r->n, n);
            goto fail;
        }
        tag = rreq_slot(ctx, r) + 1;
        if (want) {
            for (i = 0; i < n; i++) {
                if (ctx->owner[want[i]] != tag) {
                    snprintf(err, sizeof(err), "dst block %u is not reserved "
                             "for request %s", want[i], req_id);
                    goto fail;
                }
            }
        } else {
            rreq_blocks(ctx, r);
        }
        r->peer = peer;
    } else {
        if (kv_rreq_reserve(ctx, req_id, n, want, peer, err, sizeof(err), &r)
            != 0)
        {
            goto fail;
        }
        r->auto_res = 1;
        if (!want) {
            rreq_blocks(ctx, r);
        }
    }
    /* ctx->scratch now holds the destination blocks in push order */
    if (has_ring(ctx) && kv_ring_setup(ctx, r, ctx->scratch, n, err,
                                       sizeof(err)) != 0)
    {
        if (r->auto_res) {
            kv_rreq_release(ctx, r);
        }
        goto fail;
    }
    snprintf(r->peer_id, sizeof(r->peer_id), "%s", ctx->peers[peer].conf.id);
    r->begin_id = cJSON_IsNumber(jid) && jid->valuedouble > 0
                  ? (uint64_t) jid->valuedouble : 0;
    r->begin_inst = inst_of(j);
    r->bytes_done = 0;
    r->error[0] = '\0';
    r->t_start_ms = kv_wall_ms();
    r->deadline_ms = kv_now_ms() + ctx->cfg.transfer_timeout_ms;
    cJSON_AddItemToObject(reply, "dst_runs", kv_runs_json(ctx->scratch, n));
    cJSON_AddStringToObject(reply, "type", "push_ok");
    kv_rreq_set(ctx, r, DPD_REQ_TRANSFERRING, NULL);
    return 0;

fail:
    kv_warn("xfer: push_begin from %s refused: %s",
            ctx->peers[peer].conf.id, err);
    cJSON_AddStringToObject(reply, "type", "push_err");
    cJSON_AddStringToObject(reply, "error", err);
    return -1;
}


/* Non-staged GPU pools written by the NIC (GPUDirect RDMA): make the
 * writes visible to the GPU before the request is ready. */
static int
rreq_flush(kv_ctx_t *ctx)
{
    int k;

    for (k = 0; k < ctx->nranks; k++) {
        kv_pool_t *p = KV_POOL(ctx, k);
        if (p->cuda_dev >= 0 && !p->staged && ctx->rcopy_open[k]) {
            if (ctx->rcopy[k].ops->flush(&ctx->rcopy[k]) != 0) {
                return -1;
            }
            ctx->stat_flushes++;
        }
    }
    return 0;
}


/* A ring request is ready when the sender's done came and every ring
 * rank's chunks were copied in (other ranks' writes landed directly). */
void
kv_rreq_ring_check(kv_ctx_t *ctx, kv_rreq_t *r)
{
    if (r->state != DPD_REQ_TRANSFERRING || !r->ring || !r->done_seen
        || !kv_ring_complete(ctx, r))
    {
        return;
    }
    if (rreq_flush(ctx) != 0) {
        rreq_set(ctx, r, DPD_REQ_FAILED, "flushing GPUDirect RDMA writes "
                 "failed", 1);
        return;
    }
    kv_rreq_set(ctx, r, DPD_REQ_READY, NULL);
}


static void
handle_done_msg(kv_ctx_t *ctx, const char *buf, size_t len)
{
    kv_done_msg_t m;
    kv_rreq_t *r;

    if (len < sizeof(m)) {
        kv_warn("xfer: short fabric message (%zu bytes) ignored", len);
        return;
    }
    memcpy(&m, buf, sizeof(m));
    m.req_id[sizeof(m.req_id) - 1] = '\0';
    m.node_id[sizeof(m.node_id) - 1] = '\0';
    if (m.magic != KV_DONE_MAGIC) {
        kv_warn("xfer: fabric message with bad magic ignored");
        return;
    }
    r = kv_rreq_find(ctx, m.req_id);
    if (r == NULL || r->hash != m.hash || r->state != DPD_REQ_TRANSFERRING
        || strcmp(r->peer_id, m.node_id) != 0)
    {
        kv_warn("xfer: completion for %s from %s does not match a transfer "
                "in progress", m.req_id, m.node_id);
        return;
    }
    if (m.status != 0) {
        /* the done message follows the last write's completion */
        rreq_set(ctx, r, DPD_REQ_FAILED, "sender reported a failure", 1);
        return;
    }
    if (m.bytes != r->bytes_total) {
        rreq_set(ctx, r, DPD_REQ_FAILED, "size mismatch", 1);
        return;
    }
    if (r->ring) {
        if (r->done_seen) {
            kv_warn("xfer: repeated completion for %s ignored", m.req_id);
            return;
        }
        /* ready once every chunk was copied in */
        r->done_seen = 1;
        kv_rreq_ring_check(ctx, r);
        return;
    }
    if (rreq_flush(ctx) != 0) {
        rreq_set(ctx, r, DPD_REQ_FAILED, "flushing GPUDirect RDMA writes "
                 "failed", 1);
        return;
    }
    kv_rreq_set(ctx, r, DPD_REQ_READY, NULL);
}


/* ---- sender side -------------------------------------------------------- */

kv_push_t *
kv_push_find(kv_ctx_t *ctx, const char *req_id)
{
    uint64_t h = dpd_state_hash(req_id, strlen(req_id));
    uint32_t i;

    for (i = 0; ctx->push && i < ctx->npush; i++) {
        kv_push_t *p = &ctx->push[i];
        if (p->state != KV_PUSH_FREE && !p->release_pending && p->hash == h
            && strcmp(p->req_id, req_id) == 0)
        {
            return p;
        }
    }
    return NULL;
}


static int
push_active(const kv_push_t *p)
{
    return p->state == KV_PUSH_BEGIN || p->state == KV_PUSH_WRITING
           || p->state == KV_PUSH_FLUSH;
}


static void
push_free(kv_ctx_t *ctx, kv_push_t *p)
{
    p->state = KV_PUSH_FREE;
    p->release_pending = 0;
    p->gen = ++ctx->push_gen;
}


void
kv_push_release(kv_ctx_t *ctx, kv_push_t *p)
{
    if (p->inflight > 0) {
        p->release_pending = 1;     /* freed when its writes drain */
        return;
    }
    push_free(ctx, p);
}


/* push_abort to the receiver: the push failed; "drained" once nothing
 * we posted for it is in flight (the receiver then frees its blocks). */
static void
send_abort(kv_ctx_t *ctx, int peer, const char *req_id, uint64_t begin_id,
    int drained, const char *why)
{
    char num[32];
    cJSON *j;

    j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "type", "push_abort");
    cJSON_AddStringToObject(j, "req_id", req_id);
    cJSON_AddNumberToObject(j, "id", (double) begin_id);
    snprintf(num, sizeof(num), "%llu", (unsigned long long) ctx->inst);
    cJSON_AddStringToObject(j, "inst", num);
    cJSON_AddBoolToObject(j, "drained", drained);
    cJSON_AddStringToObject(j, "error", why);
    kv_ctrl_send(ctx, peer, j);
}


static void
push_abort_check(kv_ctx_t *ctx, kv_push_t *p)
{
    if (p->abort_pending && p->inflight == 0) {
        p->abort_pending = 0;
        send_abort(ctx, p->peer, p->req_id, p->begin_id, 1, p->error);
    }
}


/*
 * A failed push's writes still in flight leave the rails' windows: the
 * window is shared by every peer, and a provider need not complete a write
 * to a peer that died (ofi_rxm can drop the queued operations of a
 * connection it closes), so counting them would stall the pushes to every
 * other peer behind one dead one.  The ops themselves stay allocated (the
 * provider may still report them) and p->inflight still counts them: the
 * receiver hears "drained" only when they have really completed, and its
 * quarantine covers the case where that never happens.
 */
static void
write_off(kv_ctx_t *ctx, kv_push_t *p)
{
    uint32_t i, slot = (uint32_t) (p - ctx->push), n = 0;
    kv_op_t *op;

    if (p->inflight == 0 || ctx->ops == NULL) {
        return;
    }
    for (i = 0; i < ctx->nops; i++) {
        op = &ctx->ops[i];
        if (op->kind == KV_OP_WRITE && op->slot == slot && op->gen == p->gen
            && !op->written_off)
        {
            op->written_off = 1;
            ctx->fab.rail[op->rail].inflight--;
            ctx->writes_inflight--;
            ctx->writes_owed++;
            n++;
        }
    }
    if (n) {
        kv_info("xfer: push %s: %u write(s) in flight taken off the window "
                "(%u owed in all)", p->req_id, n, ctx->writes_owed);
    }
}


static void
push_finish(kv_ctx_t *ctx, kv_push_t *p, int ok, const char *why)
{

    p->t_done_ms = kv_wall_ms();
    p->t_final_ms = kv_now_ms();
    if (ok) {
        p->state = KV_PUSH_DONE;
        ctx->stat_pushes_ok++;
        ctx->stat_bytes_out += p->bytes_total;
        kv_info("xfer: push %s -> %s done: %llu bytes in %llu ms",
                p->req_id, ctx->peers[p->peer].conf.id,
                (unsigned long long) p->bytes_total,
                (unsigned long long) (p->t_done_ms - p->t_start_ms));
    } else {
        int was_active = push_active(p);
        p->state = KV_PUSH_FAILED;
        snprintf(p->error, sizeof(p->error), "%s", why);
        ctx->stat_pushes_failed++;
        kv_warn("xfer: push %s -> %s failed: %s", p->req_id,
                ctx->peers[p->peer].conf.id, why);
        if (was_active && ctx->peers[p->peer].out_state == KV_LINK_UP) {
            /* no write is posted for it from now on; writes in flight
             * are waited for, then "drained" frees the receiver's blocks */
            send_abort(ctx, p->peer, p->req_id, p->begin_id,
                       p->inflight == 0, why);
            p->abort_pending = p->inflight > 0;
        }
        write_off(ctx, p);
    }
    kv_api_notify(ctx, p->req_id);
}


int
kv_push_start(kv_ctx_t *ctx, const char *req_id, int peer,
    const uint32_t *src, const uint32_t *dst, uint32_t n, int dst_given,
    char *err, size_t elen)
{
    const kv_layout_t *l = &ctx->cfg.layout;
    kv_peer_t *pe;
    kv_push_t *p = NULL, *old;
    uint32_t i;
    cJSON *j, *g;

    if (!ctx->cfg.has_pool || !ctx->fab_ok) {
        snprintf(err, elen, "this node has no registered KV pool");
        return -1;
    }
    if (kv_pools_ready(ctx, err, elen) != 0) {
        return -1;
    }
    if (strlen(req_id) == 0 || strlen(req_id) >= KV_REQID_LEN) {
        snprintf(err, elen, "req_id must be 1..%d bytes", KV_REQID_LEN - 1);
        return -1;
    }
    if (peer < 0) {
        snprintf(err, elen, "unknown peer");
        return -1;
    }
    pe = &ctx->peers[peer];
    if (pe->conf.role != DPD_ROLE_DECODE) {
        snprintf(err, elen, "peer %s is a %s node, not authorised to "
                 "receive KV", pe->conf.id, dpd_state_role_name(pe->conf.role));
        return -1;
    }
    if (pe->out_state != KV_LINK_UP) {
        snprintf(err, elen, "peer %s is not connected", pe->conf.id);
        return -1;
    }
    if (pe->remote.nranks != ctx->nranks) {
        /* rank r's shard goes to rank r: both sides need the same TP */
        snprintf(err, elen, "tensor-parallel mismatch: %s serves %d "
                 "rank(s), %s %d; pushes between different TP sizes are "
                 "not supported (they would need KV heads re-sharded)",
                 ctx->cfg.node_id, ctx->nranks, pe->conf.id,
                 pe->remote.nranks);
        return -1;
    }
    if (!pe->remote.has_pool) {
        snprintf(err, elen, "peer %s is not connected (or has not "
                 "registered every rank's pool)", pe->conf.id);
        return -1;
    }
    if (n == 0 || n > ctx->push_cap) {
        snprintf(err, elen, "a push needs 1..%u blocks", ctx->push_cap);
        return -1;
    }
    if (pe->remote.layout.layers != l->layers
        || pe->remote.layout.regions != l->regions
        || pe->remote.layout.block_bytes != l->block_bytes)
    {
        snprintf(err, elen, "pool geometry of %s differs from ours",
                 pe->conf.id);
        return -1;
    }
    for (i = 0; i < n; i++) {
        if (src[i] >= l->nblocks) {
            snprintf(err, elen, "src block %u out of range (pool has %u "
                     "blocks)", src[i], l->nblocks);
            return -1;
        }
        if (dst_given && dst[i] >= pe->remote.layout.nblocks) {
            snprintf(err, elen, "dst block %u out of range (%s has %u "
                     "blocks)", dst[i], pe->conf.id,
                     pe->remote.layout.nblocks);
            return -1;
        }
    }
    old = kv_push_find(ctx, req_id);
    if (old) {
        if (push_active(old)) {
            snprintf(err, elen, "request %s is already being pushed", req_id);
            return -1;
        }
        kv_push_release(ctx, old);
    }
    for (i = 0; i < ctx->npush; i++) {
        if (ctx->push[i].state == KV_PUSH_FREE) {
            p = &ctx->push[i];
            break;
        }
    }
    if (p == NULL) {
        /* recycle the oldest finished push nobody released */
        for (i = 0; i < ctx->npush; i++) {
            kv_push_t *q = &ctx->push[i];
            if ((q->state == KV_PUSH_DONE || q->state == KV_PUSH_FAILED)
                && q->inflight == 0 && !q->release_pending
                && (p == NULL || q->t_final_ms < p->t_final_ms))
            {
                p = q;
            }
        }
    }
    if (p == NULL) {
        snprintf(err, elen, "too many pushes (%u) in progress", ctx->npush);
        return -1;
    }
    p->gen = ++ctx->push_gen;
    snprintf(p->req_id, sizeof(p->req_id), "%s", req_id);
    p->hash = dpd_state_hash(req_id, strlen(req_id));
    p->peer = peer;
    p->n = n;
    memcpy(p->src, src, n * sizeof(uint32_t));
    if (dst_given) {
        memcpy(p->dst, dst, n * sizeof(uint32_t));
    }
    p->dst_given = dst_given;
    p->segs_done = p->done_sent = 0;
    p->stage_pending = 0;
    p->release_pending = 0;
    p->abort_pending = 0;
    p->bytes_total = (uint64_t) n * block_total_bytes(l) * ctx->nranks;
    p->bytes_posted = p->bytes_done = 0;
    p->inflight = 0;
    p->next_rail = 0;
    p->rank_rr = 0;
    memset(p->cur_valid, 0, sizeof(p->cur_valid));
    memset(p->rank_done, 0, sizeof(p->rank_done));
    memset(p->rail_rr, 0, sizeof(p->rail_rr));
    p->error[0] = '\0';
    /* a receiver ring: chunk k of a rank's stream goes to the slot it
     * grants for it (push_credit) */
    p->ring = pe->remote.ring_slots > 0;
    p->rank_bytes = (uint64_t) n * block_total_bytes(l);
    p->nchunks = p->ring ? (uint32_t) ((p->rank_bytes
                                        + pe->remote.ring_chunk - 1)
                                       / pe->remote.ring_chunk) : 0;
    p->cr_live = 0;
    memset(p->cr_take, 0, sizeof(p->cr_take));
    memset(p->cr, 0, sizeof(p->cr));
    p->t_start_ms = kv_wall_ms();
    p->t_done_ms = 0;
    p->deadline_ms = kv_now_ms() + ctx->cfg.transfer_timeout_ms;
    p->begin_id = ++ctx->begin_seq;
    p->state = KV_PUSH_BEGIN;

    j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "type", "push_begin");
    cJSON_AddNumberToObject(j, "id", (double) p->begin_id);
    {
        char num[32];
        snprintf(num, sizeof(num), "%llu", (unsigned long long) ctx->inst);
        cJSON_AddStringToObject(j, "inst", num);
    }
    cJSON_AddStringToObject(j, "req_id", req_id);
    cJSON_AddNumberToObject(j, "nblocks", n);
    if (!fault_no_credits) {
        uint32_t mask = 0;
        for (i = 0; p->ring && i < (uint32_t) ctx->nranks; i++) {
            mask |= pe->remote.ring[i] ? 1u << i : 0;
        }
        cJSON_AddNumberToObject(j, "credits", KV_RING_PROTO);
        cJSON_AddNumberToObject(j, "ring_ranks", mask);
    }
    if (dst_given) {
        cJSON_AddItemToObject(j, "dst_runs", kv_runs_json(dst, n));
    }
    g = cJSON_AddObjectToObject(j, "geometry");
    cJSON_AddNumberToObject(g, "layers", l->layers);
    cJSON_AddNumberToObject(g, "regions", l->regions);
    cJSON_AddNumberToObject(g, "block_bytes", (double) l->block_bytes);
    cJSON_AddNumberToObject(g, "ranks", ctx->nranks);
    if (kv_ctrl_send(ctx, peer, j) != 0) {
        p->state = KV_PUSH_FREE;
        snprintf(err, elen, "peer %s is not connected", pe->conf.id);
        return -1;
    }
    kv_info("xfer: push %s -> %s: %u blocks, %llu bytes", req_id,
            pe->conf.id, n, (unsigned long long) p->bytes_total);
    return 0;
}


void
kv_push_begin_reply(kv_ctx_t *ctx, int peer, cJSON *j)
{
    cJSON *jid = cJSON_GetObjectItemCaseSensitive(j, "id");
    cJSON *jt = cJSON_GetObjectItemCaseSensitive(j, "type");
    cJSON *jd = cJSON_GetObjectItemCaseSensitive(j, "dst_runs");
    cJSON *je = cJSON_GetObjectItemCaseSensitive(j, "error");
    kv_push_t *p = NULL;
    char err[200], why[240];
    uint32_t i, nd = 0;
    uint64_t id;

    if (!cJSON_IsNumber(jid) || !cJSON_IsString(jt)) {
        return;
    }
    id = (uint64_t) jid->valuedouble;
    for (i = 0; i < ctx->npush; i++) {
        if (ctx->push[i].state == KV_PUSH_BEGIN
            && ctx->push[i].begin_id == id && ctx->push[i].peer == peer)
        {
            p = &ctx->push[i];
            break;
        }
    }
    if (p == NULL) {
        return;                      /* timed out or aborted meanwhile */
    }
    if (strcmp(jt->valuestring, "push_ok") != 0) {
        snprintf(why, sizeof(why), "refused by %s: %s",
                 ctx->peers[peer].conf.id,
                 cJSON_IsString(je) ? je->valuestring : "unknown error");
        push_finish(ctx, p, 0, why);
        return;
    }
    if (kv_runs_parse(jd, p->dst, p->cap, &nd, err, sizeof(err)) != 0
        || nd != p->n)
    {
        push_finish(ctx, p, 0, "bad push_ok from receiver");
        return;
    }
    /* the receiver picked the blocks: check them against its geometry
     * before a single byte is written */
    for (i = 0; i < nd; i++) {
        if (p->dst[i] >= ctx->peers[peer].remote.layout.nblocks) {
            push_finish(ctx, p, 0, "receiver answered a block out of range");
            return;
        }
    }
    /* every rank moves the same block pairs in its own pool */
    for (i = 0; i < (uint32_t) ctx->nranks; i++) {
        kv_segiter_init(&p->it[i], &ctx->cfg.layout,
                        &ctx->peers[peer].remote.layout, p->src, p->dst, p->n,
                        ctx->cfg.coalesce);
    }
    p->state = KV_PUSH_WRITING;
}


/* push_cancel from the receiver: it failed the request.  Stop writing,
 * and answer "drained" once our writes for it completed. */
void
kv_push_cancel_msg(kv_ctx_t *ctx, int peer, cJSON *j)
{
    cJSON *jid = cJSON_GetObjectItemCaseSensitive(j, "id");
    cJSON *jr = cJSON_GetObjectItemCaseSensitive(j, "req_id");
    cJSON *je = cJSON_GetObjectItemCaseSensitive(j, "error");
    uint64_t id = cJSON_IsNumber(jid) ? (uint64_t) jid->valuedouble : 0;
    uint64_t inst = inst_of(j);
    kv_push_t *p = NULL;
    char why[160];
    uint32_t i;

    if (id == 0 || !cJSON_IsString(jr) || (inst != 0 && inst != ctx->inst)) {
        /* meant for an earlier incarnation of this node: not ours to
         * answer (the receiver waits for that one to be gone) */
        return;
    }
    for (i = 0; ctx->push && i < ctx->npush; i++) {
        if (ctx->push[i].state != KV_PUSH_FREE && ctx->push[i].peer == peer
            && ctx->push[i].begin_id == id)
        {
            p = &ctx->push[i];
            break;
        }
    }
    if (p == NULL) {
        /* no slot holds it: nothing of it can be in flight */
        send_abort(ctx, peer, jr->valuestring, id, 1, "no such push");
        return;
    }
    snprintf(why, sizeof(why), "cancelled by %s: %s",
             ctx->peers[peer].conf.id,
             cJSON_IsString(je) ? je->valuestring : "?");
    if (push_active(p)) {
        push_finish(ctx, p, 0, why);    /* answers when drained */
        return;
    }
    if (p->state == KV_PUSH_DONE) {
        /* our done message crossed its failure: the KV is not there */
        p->state = KV_PUSH_FAILED;
        snprintf(p->error, sizeof(p->error), "%s", why);
        ctx->stat_pushes_ok--;
        ctx->stat_pushes_failed++;
        kv_warn("xfer: push %s -> %s failed after completing: %s",
                p->req_id, ctx->peers[peer].conf.id, why);
        kv_api_notify(ctx, p->req_id);
    }
    p->abort_pending = 1;
    push_abort_check(ctx, p);
}


/* push_credit from a ring receiver: slots granted to our push, each for
 * one chunk of one rank's stream.  A grant we cannot honour fails the
 * push (the receiver then gets its slots back through push_abort). */
void
kv_push_credit_msg(kv_ctx_t *ctx, int peer, cJSON *j)
{
    cJSON *jid = cJSON_GetObjectItemCaseSensitive(j, "id");
    cJSON *jg = cJSON_GetObjectItemCaseSensitive(j, "grants"), *e;
    uint64_t id = cJSON_IsNumber(jid) ? (uint64_t) jid->valuedouble : 0;
    uint64_t inst = inst_of(j), grant, off;
    kv_remote_t *rm = &ctx->peers[peer].remote;
    kv_push_t *p = NULL;
    kv_credit_t *c;
    uint32_t i, k, rank, slot, chunk;
    cJSON *a[4];

    if (id == 0 || !cJSON_IsArray(jg) || (inst != 0 && inst != ctx->inst)) {
        return;
    }
    for (i = 0; ctx->push && i < ctx->npush; i++) {
        if (ctx->push[i].state != KV_PUSH_FREE && ctx->push[i].peer == peer
            && ctx->push[i].begin_id == id)
        {
            p = &ctx->push[i];
            break;
        }
    }
    if (p == NULL || !push_active(p)) {
        /* failed meanwhile: our push_abort gives the slots back */
        kv_debug("xfer: push_credit from %s for no active push",
                 ctx->peers[peer].conf.id);
        return;
    }
    if (!p->ring) {
        push_finish(ctx, p, 0, "the receiver granted ring slots to a push "
                    "that does not use its ring");
        return;
    }
    cJSON_ArrayForEach(e, jg) {
        for (k = 0; k < 4; k++) {
            a[k] = cJSON_GetArrayItem(e, (int) k);
        }
        if (!cJSON_IsNumber(a[0]) || !cJSON_IsNumber(a[1])
            || !cJSON_IsNumber(a[2]) || !cJSON_IsString(a[3])
            || a[0]->valuedouble < 0 || a[0]->valuedouble >= ctx->nranks
            || a[1]->valuedouble < 0 || a[1]->valuedouble >= rm->ring_slots
            || a[2]->valuedouble < 0 || a[2]->valuedouble >= p->nchunks)
        {
            push_finish(ctx, p, 0, "bad push_credit from the receiver");
            return;
        }
        rank = (uint32_t) a[0]->valuedouble;
        slot = (uint32_t) a[1]->valuedouble;
        chunk = (uint32_t) a[2]->valuedouble;
        grant = strtoull(a[3]->valuestring, NULL, 10);
        if (!rm->ring[rank] || chunk < p->cr_take[rank]) {
            push_finish(ctx, p, 0, "the receiver granted a chunk already "
                        "written, or a rank without a ring");
            return;
        }
        c = NULL;
        for (i = 0; i < KV_RING_MAX; i++) {
            kv_credit_t *q = &p->cr[rank][i];
            if (q->state != KV_CR_FREE
                && (q->slot == slot || q->chunk == chunk))
            {
                push_finish(ctx, p, 0, "the receiver granted a slot or a "
                            "chunk twice");
                return;
            }
            if (q->state == KV_CR_FREE && c == NULL) {
                c = q;
            }
        }
        if (c == NULL) {
            push_finish(ctx, p, 0, "the receiver granted more slots than "
                        "its ring has");
            return;
        }
        off = (uint64_t) chunk * rm->ring_chunk;
        c->state = KV_CR_TAKING;
        c->slot = slot;
        c->chunk = chunk;
        c->grant = grant;
        c->len = p->rank_bytes - off < rm->ring_chunk ? p->rank_bytes - off
                                                      : rm->ring_chunk;
        c->taken = c->done = 0;
        p->cr_live++;
    }
}


void
kv_push_peer_down(kv_ctx_t *ctx, int peer, const char *why)
{
    uint32_t i;

    for (i = 0; ctx->push && i < ctx->npush; i++) {
        if (ctx->push[i].peer == peer && push_active(&ctx->push[i])) {
            push_finish(ctx, &ctx->push[i], 0, why);
        }
    }
}


static int
post_done(kv_ctx_t *ctx, kv_push_t *p)
{
    kv_rail_t *r = &ctx->fab.rail[0];
    kv_done_msg_t *m;
    kv_op_t *op;
    uint32_t slot;
    ssize_t rc;

    if (ctx->nsend_free == 0 || (op = op_get(ctx)) == NULL) {
        return 0;                    /* try again on the next turn */
    }
    slot = ctx->send_free[--ctx->nsend_free];
    m = (kv_done_msg_t *) msg_slot(ctx, slot);
    memset(m, 0, sizeof(*m));
    m->magic = KV_DONE_MAGIC;
    m->status = 0;
    m->hash = p->hash;
    m->bytes = p->bytes_done;
    snprintf(m->req_id, sizeof(m->req_id), "%s", p->req_id);
    snprintf(m->node_id, sizeof(m->node_id), "%s", ctx->cfg.node_id);
    op->kind = KV_OP_SEND;
    op->slot = (uint32_t) (p - ctx->push);
    op->gen = p->gen;
    op->len = slot;
    op->rail = 0;
    rc = fi_send(r->ep, m, sizeof(*m), r->msg_desc,
                 ctx->peers[p->peer].remote.fiaddr[0][0], op);
    if (rc == -FI_EAGAIN) {
        ctx->send_free[ctx->nsend_free++] = slot;
        op_put(ctx, op);
        return 0;
    }
    if (rc != 0) {
        ctx->send_free[ctx->nsend_free++] = slot;
        op_put(ctx, op);
        push_finish(ctx, p, 0, "cannot send the completion message");
        return -1;
    }
    p->done_sent = 1;
    p->state = KV_PUSH_FLUSH;
    return 0;
}


/* ---- posting writes: every rank, on its rails, directly or staged ---- */

/* Test-only (KV_TEST_FAULT=delay_rank:R:MS): rank R's writes wait MS ms
 * after the push began (readiness must wait for the slowest rank).
 * KV_TEST_FAULT=lose_write_errors: a write that fails is never reported,
 * as when ofi_rxm closes a dead peer's connection with writes queued. */
static int  fault_delay_rank = -1;
static long fault_delay_ms;
static int  fault_lose_write_errors;


static void
fault_parse(void)
{
    const char *f = getenv("KV_TEST_FAULT"), *q;

    fault_lose_write_errors = f && strstr(f, "lose_write_errors") != NULL;
    /* no_credits: push_begin as an agent without ring credits sends it;
     * repeat_notice: every chunk notice goes twice */
    fault_no_credits = f && strstr(f, "no_credits") != NULL;
    fault_repeat_notice = f && strstr(f, "repeat_notice") != NULL;

    if (f && (q = strstr(f, "delay_rank:")) != NULL) {
        fault_delay_rank = (int) strtol(q + 11, (char **) &q, 10);
        if (*q == ':') {
            fault_delay_ms = strtol(q + 1, NULL, 10);
        }
    }
}


static int
rank_held(kv_ctx_t *ctx, kv_push_t *p, int r)
{
    return r == fault_delay_rank
           && kv_now_ms() + ctx->cfg.transfer_timeout_ms
              < p->deadline_ms + (uint64_t) fault_delay_ms;
}


/* Rank r's next piece (at most max bytes), not yet taken: 1, or 0 when
 * the rank has posted all its segments. */
static int
next_piece(kv_push_t *p, int r, uint64_t max, uint64_t *so, uint64_t *dof,
    uint64_t *len)
{
    if (p->rank_done[r]) {
        return 0;
    }
    if (!p->cur_valid[r] || p->cur_off[r] == p->cur[r].len) {
        if (!kv_segiter_next(&p->it[r], &p->cur[r])) {
            p->rank_done[r] = 1;
            return 0;
        }
        p->cur_off[r] = 0;
        p->cur_valid[r] = 1;
    }
    *len = p->cur[r].len - p->cur_off[r];
    if (*len > max) {
        *len = max;
    }
    *so = p->cur[r].src + p->cur_off[r];
    *dof = p->cur[r].dst + p->cur_off[r];
    return 1;
}


/* Rank r's next piece: for a ring rank of the receiver, inside the chunk
 * being filled (0 until its slot is granted), *dof then in the receiver's
 * ring and *cri the credit + 1.  Taken by take_commit. */
static int
take_piece(kv_ctx_t *ctx, kv_push_t *p, int r, uint64_t max, uint64_t *so,
    uint64_t *dof, uint64_t *len, uint32_t *cri)
{
    kv_remote_t *rm = &ctx->peers[p->peer].remote;
    kv_credit_t *c = NULL;
    uint32_t i;

    *cri = 0;
    if (!p->ring || !rm->ring[r]) {
        return next_piece(p, r, max, so, dof, len);
    }
    if (p->cr_take[r] >= p->nchunks) {
        if (next_piece(p, r, max, so, dof, len)) {
            push_finish(ctx, p, 0, "more bytes than ring chunks (bug)");
        }
        return 0;
    }
    for (i = 0; i < KV_RING_MAX; i++) {
        if (p->cr[r][i].state == KV_CR_TAKING
            && p->cr[r][i].chunk == p->cr_take[r])
        {
            c = &p->cr[r][i];
            break;
        }
    }
    if (c == NULL) {
        return 0;                      /* until the receiver grants it */
    }
    if (max > c->len - c->taken) {
        max = c->len - c->taken;
    }
    if (!next_piece(p, r, max, so, dof, len)) {
        push_finish(ctx, p, 0, "fewer bytes than ring chunks (bug)");
        return 0;
    }
    *dof = (uint64_t) c->slot * rm->ring_chunk + c->taken;
    *cri = i + 1;
    return 1;
}


static void
take_commit(kv_push_t *p, int r, uint32_t cri, uint64_t len)
{
    kv_credit_t *c;

    p->cur_off[r] += len;
    if (cri == 0) {
        return;
    }
    c = &p->cr[r][cri - 1];
    c->taken += len;
    if (c->taken == c->len) {
        c->state = KV_CR_WRITTEN;      /* its notice once the writes end */
        p->cr_take[r]++;
    }
}


/* How far into rank r's remote memory a write may reach: its pool, or
 * its ring. */
static uint64_t
remote_lim(const kv_remote_t *rm, int r)
{
    return rm->ring_slots && rm->ring[r]
           ? (uint64_t) rm->ring_slots * rm->ring_chunk : rm->layout.size;
}


/* A rail of rank r with room in its window, round-robin from the rank's
 * cursor; -1 when all are full.  *k: the counter the choice came from. */
static int
pick_rail(kv_ctx_t *ctx, kv_push_t *p, int r, uint32_t *k)
{
    kv_topo_t *t = &ctx->topo;
    uint32_t n = (uint32_t) t->nrails[r], j;
    int li;

    for (j = 0; j < n; j++) {
        li = t->rail[r][(p->rail_rr[r] + j) % n];
        if (ctx->fab.rail[li].inflight < ctx->cfg.window) {
            *k = p->rail_rr[r] + j;
            return li;
        }
    }
    return -1;
}


static uint64_t
rail_lim(kv_ctx_t *ctx, int li)
{
    uint64_t m = ctx->fab.rail[li].max_rma;

    return ctx->cfg.max_write < m ? ctx->cfg.max_write : m;
}


/* fi_write of one piece of rank r from local rail li; the peer's rail is
 * the k-th of its rails for that rank.  1 posted, 0 try later (EAGAIN),
 * -1 the push failed. */
static int
post_write(kv_ctx_t *ctx, kv_push_t *p, int r, int li, uint32_t k,
    void *buf, void *desc, uint64_t len, uint64_t dof, int stage,
    uint32_t cr)
{
    kv_remote_t *rm = &ctx->peers[p->peer].remote;
    kv_rail_t *rl = &ctx->fab.rail[li];
    int ri = rm->rr[r][k % (uint32_t) rm->nrr[r]];
    char why[160];
    kv_op_t *op;
    ssize_t rc;

    if (!rm->av_ok[li][ri]) {
        push_finish(ctx, p, 0, "no fabric route to the peer's rail (bug)");
        return -1;
    }
    if ((op = op_get(ctx)) == NULL) {
        return 0;
    }
    op->kind = KV_OP_WRITE;
    op->slot = (uint32_t) (p - ctx->push);
    op->gen = p->gen;
    op->len = len;
    op->rail = li;
    op->rank = r;
    op->stage = stage;
    op->cr = cr;
    rc = fi_write(rl->ep, buf, len, desc, rm->fiaddr[li][ri],
                  rm->base[r][ri] + dof, rm->key[r][ri], op);
    if (rc == -FI_EAGAIN) {
        op_put(ctx, op);
        return 0;
    }
    if (rc != 0) {
        op_put(ctx, op);
        snprintf(why, sizeof(why), "fi_write: %s", kv_fi_err((int) rc));
        push_finish(ctx, p, 0, why);
        return -1;
    }
    p->bytes_posted += len;
    p->inflight++;
    p->rail_rr[r] = k + 1;
    rl->inflight++;
    ctx->poll_last_us = kv_now_us();
    ctx->writes_inflight++;
    return 1;
}


/* fi_send of the chunk notice of credit c (rank r): 1 sent, 0 later, -1
 * error */
static int
send_notice(kv_ctx_t *ctx, kv_push_t *p, int r, kv_credit_t *c,
    uint32_t slot_as)
{
    kv_rail_t *rl = &ctx->fab.rail[0];
    kv_chunk_msg_t *m;
    kv_op_t *op;
    uint32_t slot;
    ssize_t rc;

    if (ctx->nsend_free == 0 || (op = op_get(ctx)) == NULL) {
        return 0;
    }
    slot = ctx->send_free[--ctx->nsend_free];
    m = (kv_chunk_msg_t *) msg_slot(ctx, slot);
    memset(m, 0, sizeof(*m));
    m->magic = KV_CHUNK_MAGIC;
    m->rank = (uint32_t) r;
    m->slot = slot_as;
    m->grant = c->grant;
    m->hash = p->hash;
    snprintf(m->req_id, sizeof(m->req_id), "%s", p->req_id);
    snprintf(m->node_id, sizeof(m->node_id), "%s", ctx->cfg.node_id);
    op->kind = KV_OP_SEND;
    op->slot = (uint32_t) (p - ctx->push);
    op->gen = p->gen;
    op->len = slot;
    op->rail = 0;
    op->cr = 1;
    rc = fi_send(rl->ep, m, sizeof(*m), rl->msg_desc,
                 ctx->peers[p->peer].remote.fiaddr[0][0], op);
    if (rc != 0) {
        ctx->send_free[ctx->nsend_free++] = slot;
        op_put(ctx, op);
        return rc == -FI_EAGAIN ? 0 : -1;
    }
    return 1;
}


/* Chunk notices for the ring slots whose writes all completed (after the
 * completions, like the done message).  0, or -1 when the push failed. */
static int
post_notices(kv_ctx_t *ctx, kv_push_t *p)
{
    kv_credit_t *c;
    uint32_t i;
    int r, rc;

    for (r = 0; r < ctx->nranks; r++) {
        for (i = 0; i < KV_RING_MAX; i++) {
            c = &p->cr[r][i];
            if (c->state != KV_CR_WRITTEN || c->done != c->len) {
                continue;
            }
            rc = send_notice(ctx, p, r, c, c->slot);
            if (rc == 0) {
                return 0;              /* next turn */
            }
            if (rc < 0) {
                push_finish(ctx, p, 0, "cannot send a chunk notice");
                return -1;
            }
            if (fault_repeat_notice) {
                /* test: a repeat, then the same grant for a slot the
                 * push does not hold, then a slot that does not exist */
                send_notice(ctx, p, r, c, c->slot);
                send_notice(ctx, p, r, c, (c->slot + 1)
                            % ctx->peers[p->peer].remote.ring_slots);
                send_notice(ctx, p, r, c, KV_RING_MAX + 7);
            }
            c->state = KV_CR_FREE;     /* the receiver's to grant again */
            p->cr_live--;
        }
    }
    return 0;
}


/* Staged rank: fill free slots of its ring with batches of copies from
 * the pool (one event per slot).  1 when it queued something. */
static int
stage_fill(kv_ctx_t *ctx, kv_push_t *p, int r)
{
    kv_stage_t *s = ctx->stage[r];
    kv_pool_t *pool = KV_POOL(ctx, r);
    uint64_t lim = rail_lim(ctx, ctx->topo.rail[r][0]), so, dof, len, room;
    uint32_t i, added = 0, cri;
    kv_slot_t *sl;

    if (s->copy.failed) {
        push_finish(ctx, p, 0, "the staging copy engine failed earlier (a "
                    "slot's copies could not be followed); restart the "
                    "agent");
        return 0;
    }
    while (s->nfree > 0 && !p->rank_done[r]) {
        for (i = 0; i < s->nslots && s->slot[i].state != KV_SLOT_FREE; i++) {
        }
        sl = &s->slot[i];
        sl->npieces = sl->posted = sl->done = 0;
        sl->used = 0;
        while (sl->npieces < KV_SLOT_PIECES && sl->used < s->chunk) {
            room = s->chunk - sl->used;
            if (!take_piece(ctx, p, r, room < lim ? room : lim, &so, &dof,
                            &len, &cri))
            {
                break;
            }
            if (so + len > pool->size) {
                push_finish(ctx, p, 0, "segment outside a pool (bug)");
                break;
            }
            if (s->copy.ops->copy(&s->copy, s->buf + (i * s->chunk)
                                  + sl->used, (char *) pool->base + so, len,
                                  0) != 0)
            {
                push_finish(ctx, p, 0, "staging copy from GPU failed");
                break;
            }
            sl->piece[sl->npieces].off = sl->used;
            sl->piece[sl->npieces].dst = dof;
            sl->piece[sl->npieces].len = len;
            sl->piece[sl->npieces].cr = cri;
            sl->npieces++;
            sl->used += len;
            take_commit(p, r, cri, len);
            p->stage_pending++;
            s->stat_copies++;
        }
        if (sl->npieces == 0) {
            break;
        }
        sl->push = (uint32_t) (p - ctx->push);
        sl->gen = p->gen;
        s->nfree--;
        sl->t_us = sl->warn_us = kv_now_us();
        if (s->copy.ops->record(&s->copy, &sl->seq) != 0) {
            /* the copies queued into it may still run and nothing will
             * say when: the slot is never filled again */
            stage_lost(ctx, r, i, "could not record the event after its "
                       "copies");
            if (push_active(p)) {
                push_finish(ctx, p, 0, "staging copy from GPU failed");
            }
            break;
        }
        sl->state = KV_SLOT_COPYING;
        s->stat_batches++;
        added = 1;
        if (!push_active(p)) {
            break;
        }
    }
    return (int) added;
}


/* A staging slot whose copies cannot be followed (ring.c's engine_failed
 * for the sender): a copy still queued could land in it after another
 * push filled it, and that push would send those bytes. */
static void
stage_lost(kv_ctx_t *ctx, int r, uint32_t i, const char *why)
{
    kv_stage_t *s = ctx->stage[r];

    s->slot[i].state = KV_SLOT_LOST;
    s->nlost++;
    if (!s->copy.failed) {
        s->copy.failed = 1;
        kv_err("stage: rank %d: the %s copy engine failed (%s): staging slot "
               "%u is never used again and rank %d sends no staged push any "
               "more (restart the agent)", r, s->copy.ops->name, why, i, r);
    }
}


static void
slot_free(kv_stage_t *s, kv_slot_t *sl)
{
    sl->state = KV_SLOT_FREE;
    s->nfree++;
}


/* Staged rank: slots whose copies completed go on the wire. */
static void
stage_post(kv_ctx_t *ctx, int r)
{
    kv_stage_t *s = ctx->stage[r];
    kv_slot_t *sl;
    kv_push_t *p;
    kv_piece_t *pc;
    uint32_t i, k;
    int li, q;

    for (i = 0; i < s->nslots; i++) {
        sl = &s->slot[i];
        if (sl->state == KV_SLOT_FREE) {
            continue;
        }
        p = &ctx->push[sl->push];
        if (sl->state == KV_SLOT_LOST) {
            continue;
        }
        if (sl->state == KV_SLOT_COPYING) {
            q = s->copy.ops->query(&s->copy, sl->seq);
            if (q == 0) {
                uint64_t now = kv_now_us();
                if (kv_copy_overdue(now, &sl->warn_us)) {
                    kv_warn("stage: rank %d: slot %u: the copy engine has not "
                            "completed its copies for %llu s; the slot stays "
                            "held until it does", r, i,
                            (unsigned long long) ((now - sl->t_us)
                                                  / 1000000));
                }
                continue;
            }
            if (q < 0) {
                stage_lost(ctx, r, i, "an event reported an error");
                if (p->gen == sl->gen && push_active(p)) {
                    push_finish(ctx, p, 0, "staging copy from GPU failed");
                }
                continue;
            }
            sl->state = KV_SLOT_READY;
        }
        if (p->gen != sl->gen || p->state != KV_PUSH_WRITING) {
            /* its push failed: nothing more of it goes out */
            if (p->gen == sl->gen) {
                p->stage_pending -= sl->npieces - sl->posted;
            }
            sl->npieces = sl->posted;
            if (sl->done == sl->posted) {
                slot_free(s, sl);
            }
            continue;
        }
        while (sl->posted < sl->npieces
               && ctx->writes_inflight
                  < ctx->cfg.window * (uint32_t) ctx->fab.nrails)
        {
            if ((li = pick_rail(ctx, p, r, &k)) < 0) {
                break;
            }
            pc = &sl->piece[sl->posted];
            if (pc->dst + pc->len
                > remote_lim(&ctx->peers[p->peer].remote, r))
            {
                push_finish(ctx, p, 0, "segment outside a pool (bug)");
                break;
            }
            q = post_write(ctx, p, r, li, k, s->buf + (i * s->chunk)
                           + pc->off, s->desc[li], pc->len, pc->dst, i + 1,
                           pc->cr);
            if (q <= 0) {
                break;
            }
            sl->posted++;
            p->stage_pending--;
        }
    }
}


/* Post writes of one push, interleaving its ranks, until the windows are
 * full; no allocation. */
static void
push_post(kv_ctx_t *ctx, kv_push_t *p)
{
    kv_remote_t *rm = &ctx->peers[p->peer].remote;
    uint32_t budget = ctx->cfg.window * (uint32_t) ctx->fab.nrails, k, cri;
    uint64_t len, so, dof;
    int r, j, li, rc, progress, done;
    kv_pool_t *pool;

    do {
        progress = 0;
        for (j = 0; j < ctx->nranks && p->state == KV_PUSH_WRITING; j++) {
            r = (int) ((p->rank_rr + (uint32_t) j) % (uint32_t) ctx->nranks);
            if (p->rank_done[r] || rank_held(ctx, p, r)) {
                continue;
            }
            if (ctx->stage[r]) {
                progress |= stage_fill(ctx, p, r);
                continue;
            }
            if (ctx->writes_inflight >= budget
                || (li = pick_rail(ctx, p, r, &k)) < 0
                || !take_piece(ctx, p, r, rail_lim(ctx, li), &so, &dof, &len,
                               &cri))
            {
                continue;
            }
            pool = KV_POOL(ctx, r);
            if (so + len > pool->size || dof + len > remote_lim(rm, r)) {
                push_finish(ctx, p, 0, "segment outside a pool (bug)");
                return;
            }
            rc = post_write(ctx, p, r, li, k, (char *) pool->fab_base + so,
                            pool->desc[li], len, dof, 0, cri);
            if (rc < 0) {
                return;
            }
            if (rc > 0) {
                take_commit(p, r, cri, len);
                progress = 1;
            }
        }
        p->rank_rr++;
    } while (progress && p->state == KV_PUSH_WRITING);

    if (p->state != KV_PUSH_WRITING) {
        return;
    }
    for (r = 0, done = 1; r < ctx->nranks; r++) {
        done &= p->rank_done[r];
    }
    p->segs_done = done;
    if (p->cr_live && post_notices(ctx, p) != 0) {
        return;
    }
    if (done && p->stage_pending == 0 && p->inflight == 0 && p->cr_live == 0
        && !p->done_sent)
    {
        post_done(ctx, p);
    }
}


static void
on_completion(kv_ctx_t *ctx, kv_op_t *op, int err, size_t len)
{
    kv_push_t *p;
    char why[160];

    switch (op->kind) {
    case KV_OP_WRITE:
        if (op->written_off) {
            ctx->writes_owed--;
        } else {
            ctx->writes_inflight--;
            ctx->fab.rail[op->rail].inflight--;
        }
        if (err == 0) {
            ctx->fab.rail[op->rail].bytes_out += op->len;
        }
        if (op->stage && ctx->stage[op->rank]) {
            kv_stage_t *s = ctx->stage[op->rank];
            kv_slot_t *sl = &s->slot[op->stage - 1];
            sl->done++;
            if (sl->done == sl->posted && sl->posted == sl->npieces) {
                slot_free(s, sl);
            }
        }
        p = &ctx->push[op->slot];
        if (p->gen == op->gen) {
            p->inflight--;
            if (err == 0 && op->cr) {
                p->cr[op->rank][op->cr - 1].done += op->len;
            }
            if (err == 0) {
                p->bytes_done += op->len;
            } else if (push_active(p)) {
                snprintf(why, sizeof(why), "write to %s failed: %s",
                         ctx->peers[p->peer].conf.id, kv_fi_err(err));
                push_finish(ctx, p, 0, why);
            }
            push_abort_check(ctx, p);
            if (p->release_pending && p->inflight == 0) {
                push_free(ctx, p);
            }
        }
        op_put(ctx, op);
        break;

    case KV_OP_SEND:
        ctx->send_free[ctx->nsend_free++] = (uint32_t) op->len;
        p = &ctx->push[op->slot];
        if (op->cr) {
            /* a chunk notice: only its failure matters here */
            if (err != 0 && p->gen == op->gen && push_active(p)) {
                snprintf(why, sizeof(why), "chunk notice to %s failed: %s",
                         ctx->peers[p->peer].conf.id, kv_fi_err(err));
                push_finish(ctx, p, 0, why);
            }
        } else if (p->gen == op->gen && p->state == KV_PUSH_FLUSH) {
            if (err == 0) {
                push_finish(ctx, p, 1, NULL);
            } else {
                snprintf(why, sizeof(why), "completion message to %s "
                         "failed: %s", ctx->peers[p->peer].conf.id,
                         kv_fi_err(err));
                push_finish(ctx, p, 0, why);
            }
        }
        op_put(ctx, op);
        break;

    case KV_OP_RECV:
        if (err == 0 && len >= sizeof(uint32_t)
            && *(uint32_t *) msg_slot(ctx, op->slot) == KV_CHUNK_MAGIC)
        {
            kv_ring_notice(ctx, msg_slot(ctx, op->slot), len);
        } else if (err == 0) {
            handle_done_msg(ctx, msg_slot(ctx, op->slot), len);
        }
        if (err != FI_ECANCELED && !ctx->stop) {
            post_recv(ctx, op);
        } else {
            op_put(ctx, op);
        }
        break;

    default:
        break;
    }
}


/* Drain the CQs, then post what the window allows.  Returns 1 while a
 * transfer is in progress (the loop then polls without sleeping). */
int
kv_xfer_progress(kv_ctx_t *ctx)
{
    struct fi_cq_data_entry ce[64];
    struct fi_cq_err_entry ee;
    uint32_t i, k, budget;
    ssize_t n;
    int rail;

    if (!ctx->fab_ok) {
        return 0;
    }
    for (rail = 0; rail < ctx->fab.nrails; rail++) {
        /* bounded: a CQ that keeps producing (or an error entry that
         * cannot be read) must not keep the loop from the sockets */
        for (budget = 0; budget < KV_CQ_TURN_MAX; budget++) {
            n = kv_rail_cq_read(&ctx->fab.rail[rail], ce, 64);
            if (n > 0) {
                ctx->poll_last_us = kv_now_us();
                for (k = 0; k < (uint32_t) n; k++) {
                    on_completion(ctx, (kv_op_t *) ce[k].op_context, 0,
                                  ce[k].len);
                }
                if (n == 64) {
                    continue;
                }
            } else if (n == -FI_EAVAIL) {
                if (kv_rail_cq_error(&ctx->fab.rail[rail], &ee) < 0) {
                    break;
                }
                if (ee.op_context && fault_lose_write_errors
                    && ((kv_op_t *) ee.op_context)->kind == KV_OP_WRITE)
                {
                    continue;           /* test fault: never reported */
                }
                if (ee.op_context) {
                    on_completion(ctx, (kv_op_t *) ee.op_context,
                                  ee.err ? ee.err : FI_EIO, 0);
                }
                continue;
            } else if (n < 0 && n != -FI_EAGAIN) {
                kv_warn("fabric: rail %d: fi_cq_read: %s", rail,
                        kv_fi_err((int) n));
            }
            break;
        }
    }
    /* staged slots whose copies completed go out first */
    for (rail = 0; rail < ctx->nranks; rail++) {
        if (ctx->stage[rail]) {
            stage_post(ctx, rail);
        }
    }
    /* round-robin over pushes so concurrent transfers share the window */
    for (k = 0; k < ctx->npush; k++) {
        i = (ctx->push_rr + k) % ctx->npush;
        if (ctx->push[i].state == KV_PUSH_WRITING) {
            push_post(ctx, &ctx->push[i]);
        }
    }
    ctx->push_rr++;
    kv_ring_progress(ctx);
    return kv_xfer_busy(ctx);
}


/*
 * One pass for the poll loop's choice of timeout: *busy (kv_xfer_busy),
 * *copies (copies queued on an engine: staging slots, copy-ins), *polled
 * (some of them on an engine without a wake fd), *live (a receive in
 * progress from a sender heard from within two heartbeats: it is alive
 * and writing, and shm's target must progress for its writes to complete).
 */
void
kv_xfer_poll_state(kv_ctx_t *ctx, uint64_t now, kv_poll_state_t *ps)
{
    uint64_t lim = 2 * (uint64_t) ctx->cfg.heartbeat_ms, now_us = kv_now_us();
    uint32_t i;
    int k;

    memset(ps, 0, sizeof(*ps));
    ps->busy = ctx->writes_inflight > 0;
    for (k = 0; k < ctx->nranks; k++) {
        kv_stage_t *s = ctx->stage[k];
        for (i = 0; s && i < s->nslots; i++) {
            if (s->slot[i].state == KV_SLOT_COPYING) {
                kv_copy_poll(&s->copy, s->slot[i].t_us, now_us, ps);
            }
        }
        if (s && s->nfree + s->nlost < s->nslots) {
            ps->busy = 1;
        }
    }
    for (i = 0; ctx->push && i < ctx->npush; i++) {
        ps->busy |= push_active(&ctx->push[i]);
    }
    for (i = 0; ctx->rreq && i < ctx->nrreq; i++) {
        kv_rreq_t *r = &ctx->rreq[i];
        if (!r->used || r->state != DPD_REQ_TRANSFERRING) {
            continue;
        }
        ps->busy = 1;
        if (r->peer >= 0 && now < ctx->peers[r->peer].last_heard_ms + lim) {
            ps->live = 1;
        }
    }
    kv_ring_poll_state(ctx, now_us, ps);
}


/* At exit: wait up to ms for the copies queued (staging and landing) to
 * report; what is still outstanding then (lost slots count). */
uint32_t
kv_copies_settle(kv_ctx_t *ctx, int ms)
{
    struct timespec ts = { 0, 1000000 };
    uint32_t n, i;
    int k, q, t;

    for (t = 0;; t++) {
        n = 0;
        for (k = 0; k < ctx->nranks; k++) {
            kv_stage_t *s = ctx->stage[k];
            kv_rring_t *g = ctx->rring[k];
            for (i = 0; s && i < s->nslots; i++) {
                if (s->slot[i].state == KV_SLOT_COPYING) {
                    q = s->copy.ops->query(&s->copy, s->slot[i].seq);
                    if (q == 0) {
                        n++;
                    } else {
                        s->slot[i].state = q > 0 ? KV_SLOT_READY
                                                 : KV_SLOT_LOST;
                        n += q < 0;
                    }
                } else if (s->slot[i].state == KV_SLOT_LOST) {
                    n++;
                }
            }
            for (i = 0; g && i < g->nslots; i++) {
                if (g->slot[i].state == KV_RS_COPYING) {
                    q = ctx->rcopy[k].ops->query(&ctx->rcopy[k],
                                                 g->slot[i].seq);
                    if (q == 0) {
                        n++;
                    } else {
                        g->slot[i].state = q > 0 ? KV_RS_FREE : KV_RS_LOST;
                        n += q < 0;
                    }
                } else if (g->slot[i].state == KV_RS_LOST) {
                    n++;
                }
            }
        }
        if (n == 0 || t >= ms) {
            return n;
        }
        nanosleep(&ts, NULL);
    }
}


/* Failed or released requests whose blocks wait for ring copies. */
uint32_t
kv_copy_held(kv_ctx_t *ctx)
{
    uint32_t i, n = 0;

    for (i = 0; ctx->rreq && i < ctx->nrreq; i++) {
        n += ctx->rreq[i].used && ctx->rreq[i].copying
             && ctx->rreq[i].state != DPD_REQ_TRANSFERRING;
    }
    return n;
}


/* Slots (staging and landing) lost to a failed copy engine: their copies
 * may still read or write the pool. */
uint32_t
kv_xfer_lost(kv_ctx_t *ctx)
{
    uint32_t n = kv_ring_lost(ctx);
    int k;

    for (k = 0; k < ctx->nranks; k++) {
        n += ctx->stage[k] ? ctx->stage[k]->nlost : 0;
    }
    return n;
}


int
kv_xfer_busy(kv_ctx_t *ctx)
{
    uint32_t i, k;

    if (ctx->writes_inflight) {
        return 1;
    }
    for (i = 0; i < (uint32_t) ctx->nranks; i++) {
        if (ctx->stage[i] && ctx->stage[i]->nfree + ctx->stage[i]->nlost
                             < ctx->stage[i]->nslots)
        {
            return 1;                  /* copies or writes of a slot */
        }
        for (k = 0; ctx->rring[i] && k < ctx->rring[i]->nslots; k++) {
            if (ctx->rring[i]->slot[k].state == KV_RS_COPYING) {
                return 1;              /* copying into the pool */
            }
        }
    }
    for (i = 0; ctx->push && i < ctx->npush; i++) {
        if (push_active(&ctx->push[i])) {
            return 1;
        }
    }
    for (i = 0; ctx->rreq && i < ctx->nrreq; i++) {
        if (ctx->rreq[i].used && ctx->rreq[i].state == DPD_REQ_TRANSFERRING) {
            return 1;
        }
    }
    return 0;
}


void
kv_xfer_timeouts(kv_ctx_t *ctx, uint64_t now)
{
    char why[96];
    uint32_t i;
    uint64_t keep = (uint64_t) ctx->cfg.retention_ms;

    snprintf(why, sizeof(why), "timed out after %d ms",
             ctx->cfg.transfer_timeout_ms);
    for (i = 0; ctx->push && i < ctx->npush; i++) {
        kv_push_t *p = &ctx->push[i];
        if (push_active(p) && now > p->deadline_ms) {
            push_finish(ctx, p, 0, why);
        } else if ((p->state == KV_PUSH_DONE || p->state == KV_PUSH_FAILED)
                   && !p->release_pending && now > p->t_final_ms + keep)
        {
            kv_push_release(ctx, p);
        }
    }
    for (i = 0; ctx->rreq && i < ctx->nrreq; i++) {
        kv_rreq_t *r = &ctx->rreq[i];
        if (!r->used) {
            continue;
        }
        if (r->state == DPD_REQ_TRANSFERRING && now > r->deadline_ms) {
            kv_rreq_set(ctx, r, DPD_REQ_FAILED, why);
        } else if (r->state == DPD_REQ_FAILED && r->n == 0 && !r->quar
                   && !r->copying && now > r->t_final_ms + keep)
        {
            r->used = 0;
        }
    }
    kv_quar_tick(ctx, now);
}


void
kv_xfer_fail_all(kv_ctx_t *ctx, const char *why)
{
    uint32_t i;

    for (i = 0; ctx->push && i < ctx->npush; i++) {
        if (push_active(&ctx->push[i])) {
            push_finish(ctx, &ctx->push[i], 0, why);
        }
    }
    for (i = 0; ctx->rreq && i < ctx->nrreq; i++) {
        if (ctx->rreq[i].used
            && (ctx->rreq[i].state == DPD_REQ_TRANSFERRING
                || ctx->rreq[i].state == DPD_REQ_RESERVED))
        {
            kv_rreq_set(ctx, &ctx->rreq[i], DPD_REQ_FAILED, why);
        }
    }
}
