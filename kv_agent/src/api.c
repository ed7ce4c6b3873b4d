/*
 * api.c - the local API for the inference engine: a Unix socket carrying
 * length-prefixed JSON ({"verb": ...} -> {"ok": true|false, ...}).
 *
 * Verbs: info, register_pool (memfd via SCM_RIGHTS, or a CUDA IPC handle),
 * reserve, push, poll, wait, release, checksum, and fill when the config
 * enables debug verbs.  Errors are answered, never fatal: a malformed
 * message gets an error reply, an oversized frame an error and a close.
 */

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "kv.h"


int
kv_api_listen(kv_ctx_t *ctx)
{
    struct sockaddr_un sa;
    struct stat st;
    int fd;

    if (ctx->cfg.api_socket[0] == '\0') {
        ctx->api_lfd = -1;
        return 0;
    }
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    if (strlen(ctx->cfg.api_socket) >= sizeof(sa.sun_path)) {
        kv_err("api: socket path too long");
        return -1;
    }
    strcpy(sa.sun_path, ctx->cfg.api_socket);

    /* a socket left by an agent that is gone is replaced; one a running
     * agent still answers on is not taken from it (non-blocking: a full
     * backlog, EAGAIN, is a live agent too, and must not hang the start) */
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd >= 0 && (connect(fd, (struct sockaddr *) &sa, sizeof(sa)) == 0
                    || errno == EAGAIN))
    {
        close(fd);
        kv_err("api: %s is in use by a running agent", ctx->cfg.api_socket);
        return -1;
    }
    if (fd >= 0) {
        close(fd);
    }
    unlink(ctx->cfg.api_socket);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *) &sa, sizeof(sa)) != 0
        || chmod(ctx->cfg.api_socket, 0660) != 0
        || stat(ctx->cfg.api_socket, &st) != 0 || listen(fd, 64) != 0)
    {
        kv_err("api: cannot listen on %s: %s", ctx->cfg.api_socket,
               strerror(errno));
        if (fd >= 0) {
            close(fd);
        }
        return -1;
    }
    ctx->api_lfd = fd;
    ctx->api_dev = st.st_dev;
    ctx->api_ino = st.st_ino;
    kv_info("api: listening on %s", ctx->cfg.api_socket);
    return 0;
}


/* On exit the socket file goes only if it is still ours: a new agent
 * started while this one shuts down (a rolling restart, a test's next
 * step) may have bound the same path already. */
void
kv_api_unlink(kv_ctx_t *ctx)
{
    struct stat st;

    if (ctx->cfg.api_socket[0] != '\0'
        && lstat(ctx->cfg.api_socket, &st) == 0 && S_ISSOCK(st.st_mode)
        && st.st_dev == ctx->api_dev && st.st_ino == ctx->api_ino)
    {
        unlink(ctx->cfg.api_socket);
    }
}


static cJSON *
err_reply(const char *code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static cJSON *
err_reply(const char *code, const char *fmt, ...)
{
    cJSON *j = cJSON_CreateObject();
    char buf[300];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    cJSON_AddBoolToObject(j, "ok", 0);
    cJSON_AddStringToObject(j, "code", code);
    cJSON_AddStringToObject(j, "error", buf);
    return j;
}


static cJSON *
ok_reply(void)
{
    cJSON *j = cJSON_CreateObject();

    cJSON_AddBoolToObject(j, "ok", 1);
    return j;
}


static const char *
push_state_name(int s)
{
    switch (s) {
    case KV_PUSH_BEGIN:   return "pending";
    case KV_PUSH_WRITING:
    case KV_PUSH_FLUSH:   return "transferring";
    case KV_PUSH_DONE:    return "done";
    case KV_PUSH_FAILED:  return "failed";
    default:              return "free";
    }
}


/* The state of a request this node pushes or receives; NULL if unknown. */
cJSON *
kv_api_req_json(kv_ctx_t *ctx, const char *req_id)
{
    kv_push_t *p = kv_push_find(ctx, req_id);
    kv_rreq_t *r;
    cJSON *j;

    if (p) {
        j = ok_reply();
        cJSON_AddStringToObject(j, "req_id", req_id);
        cJSON_AddStringToObject(j, "side", "push");
        cJSON_AddStringToObject(j, "state", push_state_name(p->state));
        cJSON_AddBoolToObject(j, "final", p->state == KV_PUSH_DONE
                                          || p->state == KV_PUSH_FAILED);
        cJSON_AddStringToObject(j, "peer", ctx->peers[p->peer].conf.id);
        cJSON_AddNumberToObject(j, "bytes_done", (double) p->bytes_done);
        cJSON_AddNumberToObject(j, "bytes_total", (double) p->bytes_total);
        cJSON_AddNumberToObject(j, "nblocks", p->n);
        if (p->t_done_ms) {
            cJSON_AddNumberToObject(j, "ms", (double) (p->t_done_ms
                                                       - p->t_start_ms));
        }
        if (p->state == KV_PUSH_FAILED) {
            cJSON_AddStringToObject(j, "error", p->error);
        }
        return j;
    }
    r = kv_rreq_find(ctx, req_id);
    if (r) {
        j = ok_reply();
        cJSON_AddStringToObject(j, "req_id", req_id);
        cJSON_AddStringToObject(j, "side", "receive");
        cJSON_AddStringToObject(j, "state", dpd_state_req_name(r->state));
        cJSON_AddBoolToObject(j, "final", r->state == DPD_REQ_READY
                                          || r->state == DPD_REQ_FAILED);
        cJSON_AddStringToObject(j, "peer", r->peer_id);
        cJSON_AddNumberToObject(j, "bytes_done", (double) r->bytes_done);
        cJSON_AddNumberToObject(j, "bytes_total", (double) r->bytes_total);
        cJSON_AddNumberToObject(j, "nblocks", r->n);
        if (r->n) {
            /* the blocks it owns, ascending: where a push without explicit
             * destinations landed, in push order */
            uint32_t tag = (uint32_t) (r - ctx->rreq) + 1, b, k = 0;
            for (b = 0; b < ctx->cfg.layout.nblocks; b++) {
                if (ctx->owner[b] == tag) {
                    ctx->scratch[k++] = b;
                }
            }
            cJSON_AddItemToObject(j, "blocks_runs",
                                  kv_runs_json(ctx->scratch, k));
        }
        if (r->state == DPD_REQ_FAILED) {
            cJSON_AddStringToObject(j, "error", r->error);
        }
        if (r->quar || (r->copying && r->state != DPD_REQ_TRANSFERRING)) {
            /* its blocks are not free: a sender or a copy may write them */
            cJSON_AddBoolToObject(j, "quarantined", 1);
        }
        if (r->copying && r->state != DPD_REQ_TRANSFERRING) {
            cJSON_AddBoolToObject(j, "copy_pending", 1);
        }
        return j;
    }
    return NULL;
}


static int
is_final(cJSON *st)
{
    return cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(st, "final"));
}


/* A block list given as "<key>" (ids) or "<key>_runs" ([start, count]). */
static int
get_blocks(cJSON *j, const char *key, uint32_t *out, uint32_t max,
    uint32_t *n, int *present, char *err, size_t elen)
{
    char rk[32];
    cJSON *a = cJSON_GetObjectItemCaseSensitive(j, key), *b;

    snprintf(rk, sizeof(rk), "%s_runs", key);
    b = cJSON_GetObjectItemCaseSensitive(j, rk);
    *present = a != NULL || b != NULL;
    *n = 0;
    if (a) {
        return kv_ids_parse(a, out, max, n, err, elen);
    }
    if (b) {
        return kv_runs_parse(b, out, max, n, err, elen);
    }
    return 0;
}


static cJSON *
verb_info(kv_ctx_t *ctx)
{
    cJSON *j = ok_reply(), *p, *arr, *o;
    const kv_layout_t *l = &ctx->cfg.layout;
    int i;

    cJSON_AddStringToObject(j, "node", ctx->cfg.node_id);
    cJSON_AddStringToObject(j, "role", dpd_state_role_name(ctx->cfg.role));
    if (ctx->fab_ok) {
        cJSON_AddStringToObject(j, "provider",
                                ctx->fab.rail[0].info->fabric_attr->prov_name);
        cJSON_AddStringToObject(j, "fabric",
                                ctx->fab.rail[0].info->fabric_attr->name);
        cJSON_AddNumberToObject(j, "rails", ctx->fab.nrails);
        arr = cJSON_AddArrayToObject(j, "rail_list");
        for (i = 0; i < ctx->fab.nrails; i++) {
            kv_rail_t *rl = &ctx->fab.rail[i];
            const char *pci = strrchr(rl->pci, '/');
            o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "domain", rl->info->domain_attr->name);
            cJSON_AddStringToObject(o, "pci", pci ? pci + 1 : "");
            cJSON_AddNumberToObject(o, "bytes_out", (double) rl->bytes_out);
            cJSON_AddItemToArray(arr, o);
        }
        cJSON_AddBoolToObject(j, "delivery_complete",
                              ctx->fab.rail[0].delivery_complete);
    }
    if (ctx->cfg.has_pool) {
        p = cJSON_AddObjectToObject(j, "pool");
        kv_layout_json(p, l);
        cJSON_AddNumberToObject(p, "size", (double) l->size);
        cJSON_AddNumberToObject(p, "free", ctx->free_blocks);
        cJSON_AddNumberToObject(p, "quarantined", ctx->nquar);
        /* failed or released: blocks held until ring copies report */
        cJSON_AddNumberToObject(p, "copy_held", kv_copy_held(ctx));
        cJSON_AddStringToObject(p, "memory", KV_POOL(ctx, 0)->cuda_dev >= 0
                                ? "cuda" : "host");
        cJSON_AddStringToObject(p, "access", kv_pool_access_name(ctx));
        cJSON_AddNumberToObject(p, "ranks", ctx->nranks);
        arr = cJSON_AddArrayToObject(p, "rank_pools");
        for (i = 0; i < ctx->nranks; i++) {
            kv_pool_t *kp = KV_POOL(ctx, i);
            cJSON *ra;
            int k;
            o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "rank", i);
            cJSON_AddBoolToObject(o, "registered", kp->registered);
            cJSON_AddStringToObject(o, "memory", kp->base == NULL ? "none"
                                    : kp->cuda_dev >= 0 ? "cuda" : "host");
            cJSON_AddBoolToObject(o, "staged", kp->staged);
            ra = cJSON_AddArrayToObject(o, "rails");
            for (k = 0; ctx->fab_ok && k < ctx->topo.nrails[i]; k++) {
                cJSON_AddItemToArray(ra, cJSON_CreateString(
                    ctx->fab.rail[ctx->topo.rail[i][k]].info->domain_attr
                    ->name));
            }
            cJSON_AddItemToArray(arr, o);
        }
    }
    arr = cJSON_AddArrayToObject(j, "peers");
    for (i = 0; i < ctx->npeers; i++) {
        if (!kv_peer_visible(&ctx->peers[i])) {
            continue;                  /* gone, or a claim not proven */
        }
        o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "id", ctx->peers[i].conf.id);
        cJSON_AddStringToObject(o, "role",
                                dpd_state_role_name(ctx->peers[i].conf.role));
        cJSON_AddBoolToObject(o, "connected",
                              ctx->peers[i].out_state == KV_LINK_UP);
        cJSON_AddBoolToObject(o, "alive", ctx->peers[i].alive);
        cJSON_AddStringToObject(o, "key_id", ctx->peers[i].conf.kid[0]);
        cJSON_AddBoolToObject(o, "inbound", ctx->peers[i].in_conn >= 0);
        cJSON_AddBoolToObject(o, "remote_pool",
                              ctx->peers[i].remote.has_pool);
        /* last: the fields before keep their order for scripts */
        cJSON_AddBoolToObject(o, "discovered", ctx->peers[i].dyn != 0);
        cJSON_AddStringToObject(o, "ctrl", ctx->peers[i].dyn
                                ? ctx->peers[i].dyn_ip
                                : ctx->peers[i].conf.ctrl);
        cJSON_AddItemToArray(arr, o);
    }
    o = cJSON_AddObjectToObject(j, "stats");
    cJSON_AddNumberToObject(o, "pushes_ok", (double) ctx->stat_pushes_ok);
    cJSON_AddNumberToObject(o, "pushes_failed",
                            (double) ctx->stat_pushes_failed);
    cJSON_AddNumberToObject(o, "writes_inflight", ctx->writes_inflight);
    cJSON_AddNumberToObject(o, "writes_owed", ctx->writes_owed);
    cJSON_AddNumberToObject(o, "bytes_out", (double) ctx->stat_bytes_out);
    cJSON_AddNumberToObject(o, "bytes_in", (double) ctx->stat_bytes_in);
    cJSON_AddNumberToObject(o, "reqs_ready", (double) ctx->stat_reqs_ready);
    cJSON_AddNumberToObject(o, "reqs_failed", (double) ctx->stat_reqs_failed);
    cJSON_AddNumberToObject(o, "ctrl_unauthenticated",
                            kv_ctrl_unauth_count(ctx));
    cJSON_AddNumberToObject(o, "ctrl_refused",
                            (double) ctx->stat_ctrl_refused);
    cJSON_AddNumberToObject(o, "ctrl_hello_timeouts",
                            (double) ctx->stat_ctrl_timeouts);
    cJSON_AddNumberToObject(o, "revocations", (double) ctx->stat_revocations);
    cJSON_AddNumberToObject(o, "gpu_flushes", (double) ctx->stat_flushes);
    {
        /* the staged receiver's landing memory: bounded, resident */
        uint64_t rb = 0;
        uint32_t rs = 0, rf = 0;
        for (i = 0; i < ctx->nranks; i++) {
            kv_rring_t *g = ctx->rring[i];
            if (g) {
                rb += (uint64_t) g->nslots * g->chunk;
                rs += g->nslots;
                rf += g->nfree;
            }
        }
        cJSON_AddNumberToObject(o, "recv_ring_bytes", (double) rb);
        cJSON_AddNumberToObject(o, "recv_ring_slots", rs);
        cJSON_AddNumberToObject(o, "recv_ring_free", rf);
        cJSON_AddNumberToObject(o, "recv_ring_grants",
                                (double) ctx->stat_ring_grants);
        cJSON_AddNumberToObject(o, "recv_ring_chunks",
                                (double) ctx->stat_ring_chunks);
        cJSON_AddNumberToObject(o, "recv_ring_bad_notices",
                                (double) ctx->stat_ring_bad);
        cJSON_AddNumberToObject(o, "recv_ring_lost", kv_ring_lost(ctx));
    }
    for (i = 0; i < ctx->nranks; i++) {
        if (ctx->stage[i]) {
            cJSON_AddNumberToObject(o, "stage_copies",
                                    (double) ctx->stage[i]->stat_copies);
            cJSON_AddNumberToObject(o, "stage_batches",
                                    (double) ctx->stage[i]->stat_batches);
            cJSON_AddNumberToObject(o, "stage_lost",
                                    kv_xfer_lost(ctx) - kv_ring_lost(ctx));
            break;
        }
    }
    return j;
}


/*
 * A new pool is adopted and registered before the old one is touched: a
 * refused registration changes nothing, and peers are told (reconnect,
 * new keys) only about one that took effect.
 */
static cJSON *
verb_register_pool(kv_ctx_t *ctx, kv_client_t *c, cJSON *j)
{
    cJSON *jm = cJSON_GetObjectItemCaseSensitive(j, "memory");
    cJSON *js = cJSON_GetObjectItemCaseSensitive(j, "size");
    cJSON *jh = cJSON_GetObjectItemCaseSensitive(j, "ipc_handle");
    cJSON *jr = cJSON_GetObjectItemCaseSensitive(j, "rank");
    cJSON *jt = cJSON_GetObjectItemCaseSensitive(j, "ranks");
    kv_pool_t np;
    char err[256];
    size_t size = 0;
    int fd, i, dev, rank = 0;

    if (!ctx->cfg.has_pool) {
        return err_reply("no_pool", "this node has no KV pool");
    }
    /* each engine worker registers its own rank's pool; one that says how
     * many ranks its engine has must agree with this node's pool.ranks */
    if (jt && (!cJSON_IsNumber(jt) || jt->valuedouble != ctx->nranks)) {
        return err_reply("rank_mismatch", "the engine has %g ranks, this "
                         "node serves %d (pool.ranks); a different "
                         "tensor-parallel size is not supported",
                         cJSON_IsNumber(jt) ? jt->valuedouble : -1.0,
                         ctx->nranks);
    }
    if (jr) {
        if (!cJSON_IsNumber(jr) || jr->valuedouble < 0
            || jr->valuedouble >= ctx->nranks
            || jr->valuedouble != (int) jr->valuedouble)
        {
            return err_reply("bad_rank", "rank must be 0..%d (this node "
                             "serves %d rank(s), pool.ranks)",
                             ctx->nranks - 1, ctx->nranks);
        }
        rank = (int) jr->valuedouble;
    }
    if (kv_xfer_lost(ctx)) {
        /* a copy that never reported may still touch the old memory */
        return err_reply("busy", "the copy engine failed with %u slot(s) of "
                         "copies outstanding; the pool cannot be replaced "
                         "(restart the agent)", kv_xfer_lost(ctx));
    }
    if (kv_xfer_busy(ctx)) {
        return err_reply("busy", "transfers in progress; register the pool "
                         "before use");
    }
    if (ctx->nquar && !ctx->revocable) {
        /* a late write of theirs would land in memory we no longer own */
        return err_reply("busy", "%u failed transfer(s) may still write "
                         "into the pool; it cannot be replaced until their "
                         "senders confirm", ctx->nquar);
    }
    if (cJSON_IsNumber(js) && js->valuedouble > 0) {
        size = (size_t) js->valuedouble;
    }
    if (!cJSON_IsString(jm) || strcmp(jm->valuestring, "host") == 0) {
        if (c->conn.nfds < 1) {
            return err_reply("bad_request", "register_pool with host memory "
                             "needs a memfd passed with SCM_RIGHTS");
        }
        fd = c->conn.fds[0];
        for (i = 1; i < c->conn.nfds; i++) {
            c->conn.fds[i - 1] = c->conn.fds[i];
        }
        c->conn.nfds--;
        if (kv_pool_adopt_memfd(ctx, &np, fd, size, err, sizeof(err)) != 0) {
            close(fd);
            return err_reply("bad_request", "%s", err);
        }
    } else if (strncmp(jm->valuestring, "cuda:", 5) == 0) {
        dev = atoi(jm->valuestring + 5);
        if (!cJSON_IsString(jh)) {
            return err_reply("bad_request", "register_pool with cuda memory "
                             "needs ipc_handle (hex)");
        }
        if (kv_pool_adopt_cuda_ipc(ctx, &np, jh->valuestring, dev, size, err,
                                   sizeof(err)) != 0)
        {
            return err_reply("bad_request", "%s", err);
        }
    } else {
        return err_reply("bad_request", "memory must be host or cuda:<dev>");
    }
    if (kv_pool_replace(ctx, rank, &np, err, sizeof(err)) != 0) {
        return err_reply("fabric", "%s", err);
    }
    /* new keys: no write issued under the old ones can land */
    kv_quar_lift_all(ctx, "the pool was registered again");
    kv_ctrl_rekeyed(ctx, "pool re-registered");
    {
        cJSON *rep = ok_reply();
        cJSON_AddNumberToObject(rep, "rank", rank);
        return rep;
    }
}


static cJSON *
verb_reserve(kv_ctx_t *ctx, cJSON *j)
{
    cJSON *jr = cJSON_GetObjectItemCaseSensitive(j, "req_id");
    cJSON *jn = cJSON_GetObjectItemCaseSensitive(j, "nblocks"), *rep;
    char err[256];
    uint32_t n = 0, nb;
    int present;
    kv_rreq_t *r;

    if (!cJSON_IsString(jr)) {
        return err_reply("bad_request", "reserve needs req_id");
    }
    if (!ctx->cfg.has_pool) {
        return err_reply("no_pool", "this node has no KV pool");
    }
    if (get_blocks(j, "blocks", ctx->scratch, ctx->cfg.layout.nblocks, &nb,
                   &present, err, sizeof(err)) != 0)
    {
        return err_reply("bad_request", "%s", err);
    }
    if (present) {
        n = nb;
    } else if (cJSON_IsNumber(jn) && jn->valuedouble >= 1
               && jn->valuedouble <= 4294967295.0)
    {
        n = (uint32_t) jn->valuedouble;
    } else {
        return err_reply("bad_request", "reserve needs nblocks >= 1 or "
                         "blocks");
    }
    if (kv_rreq_reserve(ctx, jr->valuestring, n, present ? ctx->scratch
                        : NULL, -1, err, sizeof(err), &r) != 0)
    {
        return err_reply(strncmp(err, "pool full", 9) == 0 ? "pool_full"
                         : strstr(err, "out of range") ? "out_of_range"
                         : "bad_request", "%s", err);
    }
    rep = kv_api_req_json(ctx, jr->valuestring);
    /* list the blocks, ascending */
    {
        uint32_t tag = (uint32_t) (r - ctx->rreq) + 1, b, k = 0;
        for (b = 0; b < ctx->cfg.layout.nblocks; b++) {
            if (ctx->owner[b] == tag) {
                ctx->scratch[k++] = b;
            }
        }
        cJSON_AddItemToObject(rep, "blocks",
                              cJSON_CreateIntArray((const int *) ctx->scratch,
                                                   (int) k));
    }
    return rep;
}


static cJSON *
verb_push(kv_ctx_t *ctx, cJSON *j)
{
    cJSON *jr = cJSON_GetObjectItemCaseSensitive(j, "req_id");
    cJSON *jp = cJSON_GetObjectItemCaseSensitive(j, "peer");
    uint32_t ns, nd, *src, *dst;
    char err[256];
    int sp, dp, peer;

    if (!cJSON_IsString(jr) || !cJSON_IsString(jp)) {
        return err_reply("bad_request", "push needs req_id, peer and src");
    }
    if (!ctx->cfg.has_pool || ctx->scratch == NULL) {
        return err_reply("no_pool", "this node has no KV pool");
    }
    peer = kv_ctrl_peer_find(ctx, jp->valuestring);
    if (peer < 0) {
        return err_reply("unknown_peer", "unknown peer %.64s",
                         jp->valuestring);
    }
    /* parse into a free push slot's arrays via scratch: src then dst */
    src = ctx->scratch;
    if (get_blocks(j, "src", src, ctx->cfg.layout.nblocks, &ns, &sp, err,
                   sizeof(err)) != 0)
    {
        return err_reply(strstr(err, "out of range") ? "out_of_range"
                         : "bad_request", "%s", err);
    }
    if (!sp || ns == 0) {
        return err_reply("bad_request", "push needs a non-empty src");
    }
    dst = malloc((size_t) ns * sizeof(uint32_t));
    if (dst == NULL) {
        return err_reply("internal", "out of memory");
    }
    if (get_blocks(j, "dst", dst, ns, &nd, &dp, err, sizeof(err)) != 0) {
        free(dst);
        return err_reply(strstr(err, "out of range") ? "out_of_range"
                         : "bad_request", "%s", err);
    }
    if (dp && nd != ns) {
        free(dst);
        return err_reply("bad_request", "src has %u blocks, dst %u", ns, nd);
    }
    if (kv_push_start(ctx, jr->valuestring, peer, src, dst, ns, dp, err,
                      sizeof(err)) != 0)
    {
        free(dst);
        return err_reply(strstr(err, "out of range") ? "out_of_range"
                         : strstr(err, "not connected")
                           || strstr(err, "not authorised") ? "peer"
                         : "bad_request", "%s", err);
    }
    free(dst);
    return kv_api_req_json(ctx, jr->valuestring);
}


static cJSON *
verb_release(kv_ctx_t *ctx, cJSON *j)
{
    cJSON *jr = cJSON_GetObjectItemCaseSensitive(j, "req_id");
    kv_push_t *p;
    kv_rreq_t *r;
    int found = 0;

    if (!cJSON_IsString(jr)) {
        return err_reply("bad_request", "release needs req_id");
    }
    if ((p = kv_push_find(ctx, jr->valuestring)) != NULL) {
        if (p->state == KV_PUSH_BEGIN || p->state == KV_PUSH_WRITING
            || p->state == KV_PUSH_FLUSH)
        {
            return err_reply("busy", "push %s is in progress",
                             jr->valuestring);
        }
        kv_push_release(ctx, p);
        found = 1;
    }
    if ((r = kv_rreq_find(ctx, jr->valuestring)) != NULL) {
        if (r->state == DPD_REQ_TRANSFERRING) {
            return err_reply("busy", "request %s is being written",
                             jr->valuestring);
        }
        kv_rreq_release(ctx, r);
        found = 1;
    }
    if (!found) {
        return err_reply("not_found", "unknown request %.128s",
                         jr->valuestring);
    }
    return ok_reply();
}


static uint64_t
splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}


/* checksum (and, with debug verbs, fill) over blocks in list order, each
 * block's (layer, region) slices in layout order */
static cJSON *
verb_blocks(kv_ctx_t *ctx, cJSON *j, int fill)
{
    const kv_layout_t *l = &ctx->cfg.layout;
    cJSON *js = cJSON_GetObjectItemCaseSensitive(j, "seed"), *rep;
    cJSON *jr = cJSON_GetObjectItemCaseSensitive(j, "rank");
    uint32_t n, i, lr, nlr = l->layers * l->regions;
    uint64_t h = KV_CHECKSUM_INIT, seed, st, off, w, k;
    char err[256], hex[20];
    unsigned char *bounce = NULL;
    int present, rank = 0;
    kv_pool_t *pool;

    if (!ctx->cfg.has_pool || ctx->scratch == NULL) {
        return err_reply("no_pool", "this node has no KV pool");
    }
    if (jr) {
        if (!cJSON_IsNumber(jr) || jr->valuedouble < 0
            || jr->valuedouble >= ctx->nranks)
        {
            return err_reply("bad_rank", "rank must be 0..%d",
                             ctx->nranks - 1);
        }
        rank = (int) jr->valuedouble;
    }
    pool = KV_POOL(ctx, rank);
    if (pool->base == NULL) {
        return err_reply("no_pool", "rank %d has no registered pool", rank);
    }
    if (get_blocks(j, "blocks", ctx->scratch, l->nblocks, &n, &present, err,
                   sizeof(err)) != 0 || !present)
    {
        return err_reply("bad_request", "%s", present ? err
                         : "needs blocks or blocks_runs");
    }
    for (i = 0; i < n; i++) {
        if (ctx->scratch[i] >= l->nblocks) {
            return err_reply("out_of_range", "block %u out of range (pool has "
                             "%u blocks)", ctx->scratch[i], l->nblocks);
        }
    }
    seed = cJSON_IsNumber(js) ? (uint64_t) js->valuedouble : 1;
    bounce = malloc(l->block_bytes);
    if (bounce == NULL) {
        return err_reply("internal", "out of memory");
    }
    for (i = 0; i < n; i++) {
        for (lr = 0; lr < nlr; lr++) {
            off = kv_layout_off(l, lr, ctx->scratch[i]);
            if (fill) {
                st = seed ^ ((uint64_t) ctx->scratch[i] << 24) ^ lr;
                for (k = 0; k + 8 <= l->block_bytes; k += 8) {
                    w = splitmix(&st);
                    memcpy(bounce + k, &w, 8);
                }
                for (; k < l->block_bytes; k++) {
                    bounce[k] = (unsigned char) splitmix(&st);
                }
                kv_pool_write(ctx, rank, off, bounce, l->block_bytes);
            } else if (pool->cuda_dev < 0) {
                h = kv_checksum(h, (char *) pool->base + off,
                                l->block_bytes);
            } else {
                kv_pool_read(ctx, rank, off, bounce, l->block_bytes);
                h = kv_checksum(h, bounce, l->block_bytes);
            }
        }
    }
    free(bounce);
    rep = ok_reply();
    if (!fill) {
        snprintf(hex, sizeof(hex), "%016llx", (unsigned long long) h);
        cJSON_AddStringToObject(rep, "checksum", hex);
    }
    cJSON_AddNumberToObject(rep, "bytes", (double) n * nlr * l->block_bytes);
    return rep;
}


static int
verb_wait(kv_ctx_t *ctx, int client, cJSON *j, cJSON **rep)
{
    cJSON *jr = cJSON_GetObjectItemCaseSensitive(j, "req_id");
    cJSON *jt = cJSON_GetObjectItemCaseSensitive(j, "timeout_ms");
    kv_waiter_t *w = NULL;
    uint32_t i;
    double t = cJSON_IsNumber(jt) ? jt->valuedouble : 30000;

    if (!cJSON_IsString(jr) || strlen(jr->valuestring) >= KV_REQID_LEN) {
        *rep = err_reply("bad_request", "wait needs req_id");
        return 0;
    }
    *rep = kv_api_req_json(ctx, jr->valuestring);
    if (*rep == NULL) {
        *rep = err_reply("not_found", "unknown request %.128s",
                         jr->valuestring);
        return 0;
    }
    if (is_final(*rep) || t <= 0) {
        return 0;
    }
    for (i = 0; i < ctx->nwaiters; i++) {
        if (!ctx->waiters[i].used) {
            w = &ctx->waiters[i];
            break;
        }
    }
    if (w == NULL) {
        return 0;                     /* answer with the current state */
    }
    cJSON_Delete(*rep);
    *rep = NULL;
    w->used = 1;
    w->client = client;
    w->deadline_ms = kv_now_ms() + (uint64_t) (t > 3.6e6 ? 3.6e6 : t);
    snprintf(w->req_id, sizeof(w->req_id), "%s", jr->valuestring);
    return 1;
}


void
kv_api_notify(kv_ctx_t *ctx, const char *req_id)
{
    uint32_t i;
    cJSON *rep;

    for (i = 0; ctx->waiters && i < ctx->nwaiters; i++) {
        kv_waiter_t *w = &ctx->waiters[i];
        if (!w->used || strcmp(w->req_id, req_id) != 0) {
            continue;
        }
        rep = kv_api_req_json(ctx, req_id);
        if (rep == NULL || !is_final(rep)) {
            cJSON_Delete(rep);
            continue;
        }
        w->used = 0;
        kv_client_send(ctx, w->client, rep);
    }
}


void
kv_api_waiters_tick(kv_ctx_t *ctx, uint64_t now)
{
    uint32_t i;
    cJSON *rep;

    for (i = 0; ctx->waiters && i < ctx->nwaiters; i++) {
        kv_waiter_t *w = &ctx->waiters[i];
        if (!w->used || now < w->deadline_ms) {
            continue;
        }
        w->used = 0;
        rep = kv_api_req_json(ctx, w->req_id);
        if (rep == NULL) {
            rep = err_reply("not_found", "request %s was released",
                            w->req_id);
        } else {
            cJSON_AddBoolToObject(rep, "timeout", 1);
        }
        kv_client_send(ctx, w->client, rep);
    }
}


int
kv_api_msg(kv_ctx_t *ctx, int client, char *msg, uint32_t len)
{
    kv_client_t *c = &ctx->clients[client];
    cJSON *j = cJSON_ParseWithLength(msg, len), *v, *rep = NULL;
    const char *verb;
    int i, rc;

    if (j == NULL || !cJSON_IsObject(j)) {
        cJSON_Delete(j);
        j = NULL;
        rep = err_reply("bad_request", "malformed JSON message");
        goto out;
    }
    v = cJSON_GetObjectItemCaseSensitive(j, "verb");
    if (!cJSON_IsString(v)) {
        rep = err_reply("bad_request", "message has no \"verb\"");
        goto out;
    }
    verb = v->valuestring;
    if (strcmp(verb, "info") == 0 || strcmp(verb, "hello") == 0) {
        rep = verb_info(ctx);
    } else if (strcmp(verb, "register_pool") == 0) {
        rep = verb_register_pool(ctx, c, j);
    } else if (strcmp(verb, "reserve") == 0) {
        rep = verb_reserve(ctx, j);
    } else if (strcmp(verb, "push") == 0) {
        rep = verb_push(ctx, j);
    } else if (strcmp(verb, "poll") == 0) {
        v = cJSON_GetObjectItemCaseSensitive(j, "req_id");
        rep = cJSON_IsString(v) ? kv_api_req_json(ctx, v->valuestring)
                                : err_reply("bad_request", "poll needs req_id");
        if (rep == NULL) {
            rep = err_reply("not_found", "unknown request %.128s",
                            v->valuestring);
        }
    } else if (strcmp(verb, "wait") == 0) {
        if (verb_wait(ctx, client, j, &rep)) {
            rep = NULL;               /* answered later */
        }
    } else if (strcmp(verb, "release") == 0) {
        rep = verb_release(ctx, j);
    } else if (strcmp(verb, "checksum") == 0) {
        rep = verb_blocks(ctx, j, 0);
    } else if (strcmp(verb, "fill") == 0 && ctx->cfg.debug_verbs) {
        rep = verb_blocks(ctx, j, 1);
    } else {
        rep = err_reply("unknown_verb", "unknown verb \"%.64s\"", verb);
    }

out:
    cJSON_Delete(j);
    /* descriptors nobody consumed must not leak */
    for (i = 0; i < c->conn.nfds; i++) {
        close(c->conn.fds[i]);
    }
    c->conn.nfds = 0;
    rc = 0;
    if (rep) {
        rc = kv_client_send(ctx, client, rep);
    }
    return rc;
}
