/*
 * loop.c - `kv_agent run --config FILE`: start-up, the poll() loop and an
 * orderly shutdown (SIGTERM/SIGINT: in-flight requests are marked failed,
 * the state table is left consistent with writer_alive = 0).
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "kv.h"
#include "resolve.h"
#include "prefix_events.h"
#include "kv_events_dns.h"

#define KV_IDLE_POLL_MS     5      /* CQ without a wait fd, idle */
#define KV_SPIN_US          1000   /* busy-poll this long after an event */
#define KV_SPIN_WRITES_US   10000  /* ... or with our writes in flight */
#define KV_BUSY_POLL_MAX_US 200    /* back-off cap while a transfer runs */
#define KV_POLL_MIN_US      20
#define KV_WAIT_POLL_MS     20     /* timer granularity otherwise */

static volatile sig_atomic_t kv_got_signal;


static void
on_signal(int sig)
{
    kv_got_signal = sig;
}


/*
 * The slot table has separate budgets: max_clients local API connections,
 * max_unauthenticated control connections that have not completed their
 * handshake, and one per configured peer (a peer's new authenticated
 * connection replaces its old one).  The table is as large as the sum, so
 * no kind can take another's slots: a flood of idle TCP connections to the
 * control port never locks the engine out of the local API.
 */
int
kv_client_add(kv_ctx_t *ctx, int fd, int is_peer)
{
    int i, napi = 0, nunauth = 0, slot = -1;

    for (i = 0; i < ctx->nclients; i++) {
        kv_client_t *c = &ctx->clients[i];
        if (c->used) {
            napi += !c->is_peer;
            nunauth += c->is_peer && c->peer < 0;
        } else if (slot < 0) {
            slot = i;
        }
    }
    if (slot < 0 || (!is_peer && napi >= ctx->cfg.max_clients)
        || (is_peer && nunauth >= ctx->cfg.max_unauth))
    {
        if (is_peer) {
            ctx->stat_ctrl_refused++;
            if (ctx->stat_ctrl_refused == 1
                || ctx->stat_ctrl_refused % 1000 == 0)
            {
                kv_warn("ctrl: %d connections without a completed "
                        "handshake: refusing more (%llu so far)",
                        nunauth,
                        (unsigned long long) ctx->stat_ctrl_refused);
            }
        } else {
            kv_warn("api: too many connections, refusing one");
        }
        close(fd);
        return -1;
    }
    kv_set_nonblock(fd);
    memset(&ctx->clients[slot], 0, sizeof(kv_client_t));
    kv_conn_init(&ctx->clients[slot].conn, fd);
    ctx->clients[slot].used = 1;
    ctx->clients[slot].is_peer = is_peer;
    ctx->clients[slot].peer = -1;
    ctx->clients[slot].t_open_ms = kv_now_ms();
    return slot;
}


void
kv_client_close(kv_ctx_t *ctx, int i)
{
    kv_client_t *c = &ctx->clients[i];
    uint32_t k;

    if (!c->used) {
        return;
    }
    if (c->is_peer) {
        kv_ctrl_inbound_closed(ctx, i);
    }
    for (k = 0; ctx->waiters && k < ctx->nwaiters; k++) {
        if (ctx->waiters[k].used && ctx->waiters[k].client == i) {
            ctx->waiters[k].used = 0;
        }
    }
    kv_conn_free(&c->conn);
    c->used = 0;
}


int
kv_client_send(kv_ctx_t *ctx, int i, cJSON *j)
{
    kv_client_t *c = &ctx->clients[i];

    if (!c->used) {
        cJSON_Delete(j);
        return -1;
    }
    if (kv_conn_send_json(&c->conn, j) != 0) {
        if (c->conn.overflow) {
            kv_warn("%s: the other side does not read (more than %zu bytes "
                    "of output queued); closing", c->is_peer ? "ctrl" : "api",
                    kv_conn_wmax);
        }
        c->conn.closing = 2;          /* broken: close without flushing */
        return -1;
    }
    return 0;
}


/*
 * Accept what is queued.  Out of descriptors (EMFILE, ENFILE) or kernel
 * memory, the listener stays readable: polling it again at once would spin
 * a core and log a line per turn, so it is left out of poll() for 50 ms,
 * doubling to 1 s while the shortage lasts (as nginx disables its accept
 * events), with one warning a second that counts.  Connections wait in the
 * kernel's backlog meanwhile; the budgets of kv_client_add() close what
 * is over them, so our own use of descriptors stays bounded.
 */
static void
accept_all(kv_ctx_t *ctx, int lfd, int is_peer)
{
    int fd, i, k = is_peer ? 0 : 1;

    for ( ;; ) {
        fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EAGAIN || errno == EINTR) {
                ctx->accept_backoff_ms[k] = 0;
                return;
            }
            if (errno == ECONNABORTED || errno == EPROTO) {
                continue;             /* that one is gone: the next */
            }
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS
                || errno == ENOMEM)
            {
                int err = errno;
                uint32_t *b = &ctx->accept_backoff_ms[k];
                *b = *b == 0 ? 50 : *b * 2 > 1000 ? 1000 : *b * 2;
                ctx->accept_pause_ms[k] = kv_now_ms() + *b;
                ctx->stat_accept_nofd++;
                if (kv_log_limit(&ctx->accept_warn)) {
                    kv_warn("%s: cannot accept: %s; not accepting for %u ms "
                            "(%llu times so far)", is_peer ? "ctrl" : "api",
                            strerror(err), *b,
                            (unsigned long long) ctx->stat_accept_nofd);
                }
                return;
            }
            if (kv_log_limit(&ctx->accept_warn)) {
                kv_warn("%s: accept: %s", is_peer ? "ctrl" : "api",
                        strerror(errno));
            }
            return;
        }
        i = kv_client_add(ctx, fd, is_peer);
        if (i >= 0 && is_peer && kv_ctrl_accepted(ctx, i) != 0) {
            kv_client_close(ctx, i);
        }
    }
}


static void
client_event(kv_ctx_t *ctx, int i, short revents)
{
    kv_client_t *c = &ctx->clients[i];
    const char *why = NULL;
    uint32_t len;
    char *msg;
    int rc;
    cJSON *j;

    if (revents & POLLOUT) {
        if (kv_conn_flush(&c->conn) != 0) {
            kv_client_close(ctx, i);
            return;
        }
    }
    if (!(revents & (POLLIN | POLLERR | POLLHUP))) {
        return;
    }
    while (c->used && !c->conn.closing) {
        /* before its handshake a control peer gets a small frame only */
        rc = kv_conn_read(&c->conn, c->is_peer && c->peer < 0
                                    ? KV_HELLO_MAX : ctx->cfg.max_msg,
                          !c->is_peer, &msg, &len, &why);
        if (rc == 0) {
            break;
        }
        if (rc == -2) {
            kv_warn("%s: %s (limit %u bytes); closing the connection",
                    c->is_peer ? "ctrl" : "api", why, ctx->cfg.max_msg);
            if (!c->is_peer) {
                j = cJSON_CreateObject();
                cJSON_AddBoolToObject(j, "ok", 0);
                cJSON_AddStringToObject(j, "code", "too_large");
                cJSON_AddStringToObject(j, "error", "message too large");
                kv_client_send(ctx, i, j);
            }
            c->conn.closing = 1;
            c->conn.rlen = 0;
            break;
        }
        if (rc < 0) {
            kv_client_close(ctx, i);
            return;
        }
        rc = c->is_peer ? kv_ctrl_in_msg(ctx, i, msg, len)
                        : kv_api_msg(ctx, i, msg, len);
        if (!c->used) {
            return;
        }
        kv_conn_consume(&c->conn, len);
        if (rc < 0) {
            kv_client_close(ctx, i);
            return;
        }
    }
}


static void
housekeeping(kv_ctx_t *ctx, uint64_t now)
{
    int i;

    if (ctx->res) {
        kv_res_process(ctx->res);      /* answers, and their timeouts */
    }
    kv_pdns_tick(ctx, now);
    kv_ctrl_tick(ctx, now);
    kv_xfer_timeouts(ctx, now);
    kv_api_waiters_tick(ctx, now);
    if (ctx->pfx != NULL) {
        kv_pfx_heartbeat(ctx->pfx, kv_wall_ms());
    }
    for (i = 0; i < ctx->nclients; i++) {
        kv_client_t *c = &ctx->clients[i];
        if (!c->used) {
            continue;
        }
        if (c->conn.closing == 2
            || (c->conn.closing && c->conn.woff == c->conn.wlen))
        {
            kv_client_close(ctx, i);
        } else if (c->is_peer && c->peer < 0
                   && now >= c->t_open_ms + ctx->cfg.hello_timeout_ms)
        {
            kv_debug("ctrl: no hello within %d ms; closing",
                     ctx->cfg.hello_timeout_ms);
            ctx->stat_ctrl_timeouts++;
            kv_client_close(ctx, i);
        }
    }
    if (now >= ctx->next_gc_ms) {
        ctx->next_gc_ms = now + 10000;
        if (ctx->cfg.retention_ms > 0) {
            kv_state_gc(&ctx->st, kv_wall_ms() - ctx->cfg.retention_ms);
        }
    }
}


/*
 * Add the CQ wait fds (and the copy engines' wake fds) to the poll set and
 * choose the poll timeout.  With wait fds (tcp;ofi_rxm) both sides sleep
 * until the provider has work, which matters when sender and receiver
 * share few cores; fi_trywait says whether blocking is safe.  A CQ without
 * one (shm; EFA, whose FI_WAIT_FD is refused while its shm transfer is
 * on) is polled adaptively: busy-poll while our writes are in flight and
 * for KV_SPIN_US after the last completion or post, and while a receive
 * runs from a sender we heard from within two heartbeats (shm's target
 * must progress for the sender's writes to complete), then back off (20 us
 * doubling to 200 us while a transfer is in progress, up to
 * KV_IDLE_POLL_MS when idle) instead of spinning a core on a stalled or
 * silent peer.  Microseconds.
 */
static int64_t fabric_wait(kv_ctx_t *ctx, kv_poll_state_t *ps,
    struct pollfd *pfd, int *who, int *n);


/* A copy taking long (or a hung stream) is polled with a back-off of its
 * own (20 us doubling to 200 us) that bounds the timeout the fabric
 * chose, so neither a spin nor the idle timer, and other transfers keep
 * their CQ waits and busy polls. */
static int64_t
fabric_wait_setup(kv_ctx_t *ctx, struct pollfd *pfd, int *who, int *n)
{
    kv_poll_state_t ps;
    int64_t t;

    if (!ctx->fab_ok) {
        return KV_WAIT_POLL_MS * 1000;
    }
    kv_xfer_poll_state(ctx, kv_now_ms(), &ps);
    t = fabric_wait(ctx, &ps, pfd, who, n);
    if (!ps.slow || ps.polled) {
        ctx->copy_backoff_us = 0;
        return t;
    }
    ctx->copy_backoff_us = ctx->copy_backoff_us == 0
                           ? KV_POLL_MIN_US : ctx->copy_backoff_us * 2;
    if (ctx->copy_backoff_us > KV_BUSY_POLL_MAX_US) {
        ctx->copy_backoff_us = KV_BUSY_POLL_MAX_US;
    }
    return t < ctx->copy_backoff_us ? t : ctx->copy_backoff_us;
}


static int64_t
fabric_wait(kv_ctx_t *ctx, kv_poll_state_t *ps_in, struct pollfd *pfd,
    int *who, int *n)
{
    struct fid *fid;
    int i, waitable = 1, cap;
    kv_poll_state_t ps = *ps_in;
    uint64_t since;

    for (i = 0; i < ctx->nranks; i++) {
        int fd = ctx->stage[i] ? ctx->stage[i]->copy.wake_fd : -1;
        int k;
        for (k = 0; k < 2; k++, fd = ctx->rcopy_open[i]
                                     ? ctx->rcopy[i].wake_fd : -1)
        {
            if (fd >= 0) {
                pfd[*n].fd = fd;
                pfd[*n].events = POLLIN;
                who[(*n)++] = -4;
            }
        }
    }
    if (ps.polled) {
        return 0;                      /* cudaEventQuery: poll it */
    }
    for (i = 0; i < ctx->fab.nrails; i++) {
        kv_rail_t *r = &ctx->fab.rail[i];
        if (r->cq_fd < 0) {
            waitable = 0;
            continue;
        }
        fid = &r->cq->fid;
        if (fi_trywait(r->fabric, &fid, 1) != FI_SUCCESS) {
            return 0;                  /* events pending: progress now */
        }
        pfd[*n].fd = r->cq_fd;
        pfd[*n].events = POLLIN;
        who[(*n)++] = -3;
    }
    if (waitable) {
        return KV_WAIT_POLL_MS * 1000;
    }
    since = kv_now_us() - ctx->poll_last_us;
    if (since < KV_SPIN_US
        || (ctx->writes_inflight > 0 && since < KV_SPIN_WRITES_US)
        || ps.live)
    {
        ctx->poll_backoff_us = 0;
        return 0;
    }
    cap = ps.busy ? KV_BUSY_POLL_MAX_US : KV_IDLE_POLL_MS * 1000;
    ctx->poll_backoff_us = ctx->poll_backoff_us == 0
                           ? KV_POLL_MIN_US : ctx->poll_backoff_us * 2;
    if (ctx->poll_backoff_us > cap) {
        ctx->poll_backoff_us = cap;
    }
    return ctx->poll_backoff_us;
}


/* The sink the subscriber delivers to.  Until the prefix index's writer
 * provides its own (kv_events_sink() is where it plugs in), the events
 * are only counted by the subscriber and logged at debug level. */
static void
evs_log_stored(void *data, const kv_ev_origin_t *o, const kv_ev_stored_t *ev)
{
    kv_debug("kv_events: %s seq %llu: %u block(s) stored (%s)", o->node,
             (unsigned long long) o->seq, ev->nblocks,
             ev->medium ? ev->medium : "GPU");
}


static void
evs_log_removed(void *data, const kv_ev_origin_t *o,
    const kv_ev_removed_t *ev)
{
    kv_debug("kv_events: %s seq %llu: %u block(s) removed", o->node,
             (unsigned long long) o->seq, ev->nblocks);
}


static void
evs_log_cleared(void *data, const kv_ev_origin_t *o, kv_ev_clear_t why)
{
    kv_debug("kv_events: %s seq %llu: all blocks cleared (%s)", o->node,
             (unsigned long long) o->seq, kv_ev_clear_name(why));
}


/* The prefix index the "kv_events" sources feed ("prefix_index"): the
 * subscriber's sink becomes its writer. */
static int
kv_prefix_open(kv_ctx_t *ctx, kv_ev_sink_t *sink)
{
    const kv_pfx_conf_t *c = &ctx->cfg.pfx;

    ctx->pfx = kv_pfx_open(c->path, c->slots, DPD_PFX_MAX_NODES,
                           (uint32_t) c->block, c->map_entries);
    if (ctx->pfx == NULL) {
        return -1;
    }
    ctx->pfx_feed = calloc(1, sizeof(*ctx->pfx_feed));
    if (ctx->pfx_feed == NULL
        || kv_pfx_feed_init(ctx->pfx_feed, ctx->pfx, &ctx->cfg.evs, sink)
           != 0)
    {
        return -1;                     /* kv_prefix_close() frees */
    }
    return 0;
}


static void
kv_prefix_close(kv_ctx_t *ctx)
{
    const kv_pfx_stats_t *st;

    if (ctx->pfx != NULL) {
        st = kv_pfx_stats(ctx->pfx);
        kv_info("prefix index: %llu blocks indexed, %llu removed, %llu "
                "node clears, %llu orphans, %llu unkeyable, %llu over "
                "capacity, %llu of another block size",
                (unsigned long long) st->stored,
                (unsigned long long) st->removed,
                (unsigned long long) st->cleared,
                (unsigned long long) st->orphans,
                (unsigned long long) (ctx->pfx_feed
                                      ? ctx->pfx_feed->unkeyable : 0),
                (unsigned long long) st->full,
                (unsigned long long) st->bad_size);
    }
    if (ctx->pfx_feed != NULL) {
        kv_pfx_feed_free(ctx->pfx_feed);
        free(ctx->pfx_feed);
        ctx->pfx_feed = NULL;
    }
    kv_pfx_close(ctx->pfx, 1);
    ctx->pfx = NULL;
}


void
kv_events_sink(kv_ctx_t *ctx, kv_ev_sink_t *sink)
{
    sink->data = ctx;
    sink->stored = evs_log_stored;
    sink->removed = evs_log_removed;
    sink->cleared = evs_log_cleared;
}


static void
run_loop(kv_ctx_t *ctx)
{
    struct pollfd *pfd;
    int *who, n, i, np;
    int64_t timeout;
    uint64_t now;
    struct timespec ts;
    size_t cap = 2 + KV_LMC_NFDS + KV_MAX_RAILS + 2 * KV_MAX_RANKS
                 + KV_MAX_PEERS + KV_EVS_MAX_SOURCES + 1 + ctx->nclients
                 + 1 + KV_PDNS_MAX_ADDRS;

    pfd = calloc(cap, sizeof(*pfd));
    who = calloc(cap, sizeof(*who));
    if (pfd == NULL || who == NULL) {
        free(pfd);
        free(who);
        return;
    }
    while (!kv_got_signal) {
        n = 0;
        now = kv_now_ms();
        if (now >= ctx->accept_pause_ms[0]) {
            pfd[n].fd = ctx->ctrl_lfd;
            pfd[n].events = POLLIN;
            who[n++] = -1;
        }
        if (ctx->api_lfd >= 0 && now >= ctx->accept_pause_ms[1]) {
            pfd[n].fd = ctx->api_lfd;
            pfd[n].events = POLLIN;
            who[n++] = -2;
        }
        np = n;
        for (i = 0; i < ctx->npeers; i++) {
            kv_peer_t *pe = &ctx->peers[i];
            if (pe->out_state == KV_LINK_DOWN || pe->out.fd < 0) {
                continue;
            }
            pfd[n].fd = pe->out.fd;
            pfd[n].events = POLLIN;
            if (pe->out_state == KV_LINK_CONNECTING
                || pe->out.woff < pe->out.wlen)
            {
                pfd[n].events |= POLLOUT;
            }
            who[n++] = i;
        }
        for (i = 0; i < ctx->nclients; i++) {
            kv_client_t *c = &ctx->clients[i];
            if (!c->used) {
                continue;
            }
            pfd[n].fd = c->conn.fd;
            pfd[n].events = c->conn.closing ? 0 : POLLIN;
            if (c->conn.woff < c->conn.wlen) {
                pfd[n].events |= POLLOUT;
            }
            who[n++] = 1000 + i;
        }
        for (i = kv_lmc_pollfds(ctx, pfd + n); i > 0; i--) {
            who[n++] = -5;                /* lmcache: drained below */
        }
        for (i = kv_evs_pollfds(ctx->evs, pfd + n, KV_EVS_MAX_SOURCES);
             i > 0; i--)
        {
            who[n++] = -5;                /* kv_events: drained below */
        }
        for (i = kv_evs_dns_pollfds(ctx->evs_dns, pfd + n, 1); i > 0; i--) {
            who[n++] = -5;                /* its resolver: below */
        }
        if (ctx->res) {
            pfd[n].fd = kv_res_fd(ctx->res);
            pfd[n].events = POLLIN;
            who[n++] = -6;                /* answers: housekeeping */
        }
        n += kv_pdns_pollfds(ctx, pfd + n, who + n, -100);
        timeout = fabric_wait_setup(ctx, pfd, who, &n);
        ts.tv_sec = (time_t) (timeout / 1000000);
        ts.tv_nsec = (long) (timeout % 1000000) * 1000;
        if (ppoll(pfd, n, &ts, NULL) < 0 && errno != EINTR) {
            kv_err("poll: %s", strerror(errno));
            break;
        }
        for (i = 0; i < n; i++) {
            if (!pfd[i].revents) {
                continue;
            }
            if (who[i] == -3 || who[i] == -5 || who[i] == -6) {
                continue;                 /* a CQ, lmcache: below */
            }
            if (who[i] <= -100) {
                kv_pdns_event(ctx, -100 - who[i], pfd[i].revents);
                continue;
            }
            if (who[i] == -4) {
                uint64_t v;
                /* a copy event passed: drain; progressed below */
                if (read(pfd[i].fd, &v, sizeof(v)) < 0) {
                    /* EAGAIN: another turn took it */
                }
                continue;
            }
            if (who[i] == -1) {
                accept_all(ctx, ctx->ctrl_lfd, 1);
            } else if (who[i] == -2) {
                accept_all(ctx, ctx->api_lfd, 0);
            } else if (i >= np && who[i] < 1000) {
                if (ctx->peers[who[i]].out.fd == pfd[i].fd) {
                    kv_ctrl_out_event(ctx, who[i], pfd[i].revents);
                }
            } else if (who[i] >= 1000) {
                kv_client_t *c = &ctx->clients[who[i] - 1000];
                if (c->used && c->conn.fd == pfd[i].fd) {
                    client_event(ctx, who[i] - 1000, pfd[i].revents);
                }
            }
        }
        kv_lmc_process(ctx);
        kv_evs_dns_process(ctx->evs_dns);
        kv_evs_process(ctx->evs);
        kv_xfer_progress(ctx);
        housekeeping(ctx, kv_now_ms());
    }
    free(pfd);
    free(who);
}


static void
shutdown_ctx(kv_ctx_t *ctx)
{
    int i;

    ctx->stop = 1;
    if (ctx->push || ctx->rreq) {
        kv_xfer_fail_all(ctx, "agent shutting down");
    }
    for (i = 0; i < ctx->npeers; i++) {
        if (ctx->peers[i].out.fd >= 0) {
            kv_conn_flush(&ctx->peers[i].out);
            kv_conn_free(&ctx->peers[i].out);
        }
    }
    for (i = 0; i < ctx->nclients; i++) {
        if (ctx->clients[i].used) {
            kv_conn_flush(&ctx->clients[i].conn);
            kv_conn_free(&ctx->clients[i].conn);
            ctx->clients[i].used = 0;
        }
    }
    kv_pdns_close(ctx);
    if (ctx->res) {
        kv_res_destroy(ctx->res);
        ctx->res = NULL;
    }
    kv_lmc_close(ctx);
    kv_evs_dns_close(ctx->evs_dns);
    ctx->evs_dns = NULL;
    kv_evs_close(ctx->evs);
    ctx->evs = NULL;
    kv_prefix_close(ctx);
    if (ctx->st.map) {
        kv_ctrl_update_self(ctx);
        kv_state_close(&ctx->st, 1);
    }
    if (ctx->ctrl_lfd >= 0) {
        close(ctx->ctrl_lfd);
    }
    if (ctx->api_lfd >= 0) {
        close(ctx->api_lfd);
        kv_api_unlink(ctx);
    }
    if (kv_copies_settle(ctx, 2000) > 0) {
        /* closing an engine waits for its stream (forever, if it hung)
         * and freeing memory a copy may still touch is what all of this
         * avoids: the process exit ends the CUDA context and its DMA */
        kv_warn("exit: %u copy batch(es) never reported by the copy "
                "engine; the engines and the pool are left to the process "
                "exit", kv_copies_settle(ctx, 0));
        _exit(0);
    }
    for (i = 0; i < ctx->nranks; i++) {
        kv_stage_close(ctx, i);       /* its MRs go before the domains */
        if (ctx->rcopy_open[i]) {
            ctx->rcopy[i].ops->close(&ctx->rcopy[i]);
            ctx->rcopy_open[i] = 0;
        }
    }
    if (ctx->cfg.has_pool) {
        kv_pool_unregister(ctx);
    }
    if (ctx->fab_ok) {
        kv_fabric_close(&ctx->fab);
    }
    for (i = 0; i < ctx->npeers; i++) {
        if (ctx->peers[i].pidfd >= 0) {
            close(ctx->peers[i].pidfd);
        }
        if (ctx->peers[i].old_pidfd >= 0) {
            close(ctx->peers[i].old_pidfd);
        }
    }
    if (ctx->cfg.has_pool) {
        kv_pool_free(ctx);
    }
    kv_xfer_fini(ctx);
    free(ctx->clients);
}


int
kv_run_main(int argc, char **argv)
{
    const char *cfg_path = NULL;
    struct sigaction sa;
    char err[512];
    kv_ctx_t *ctx;
    int i, rc = 1;

    for (i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--config") == 0 && i + 1 < argc) {
            cfg_path = argv[++i];
        } else {
            fprintf(stderr, "usage: kv_agent run --config FILE\n");
            return 2;
        }
    }
    if (cfg_path == NULL) {
        fprintf(stderr, "usage: kv_agent run --config FILE\n");
        return 2;
    }
    ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL) {
        return 1;
    }
    ctx->ctrl_lfd = ctx->api_lfd = -1;
    if (kv_config_load(&ctx->cfg, cfg_path, err, sizeof(err)) != 0) {
        fprintf(stderr, "kv_agent: config: %s\n", err);
        free(ctx);
        return 2;
    }
    kv_log_level = ctx->cfg.log_level;
    /* output queued per connection: a few messages of the largest size */
    kv_conn_wmax = (size_t) ctx->cfg.max_msg * 4 > (1u << 20)
                   ? (size_t) ctx->cfg.max_msg * 4 : (1u << 20);

    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &sa, NULL);

    ctx->npeers = ctx->npeers_static = ctx->cfg.npeers;
    for (i = 0; i < ctx->npeers; i++) {
        ctx->peers[i].conf = ctx->cfg.peers[i];
        ctx->peers[i].out.fd = -1;
        ctx->peers[i].in_conn = -1;
        ctx->peers[i].pidfd = ctx->peers[i].old_pidfd = -1;
    }
    ctx->nclients = ctx->cfg.max_clients + ctx->cfg.max_unauth
                    + KV_MAX_PEERS;
    ctx->clients = calloc(ctx->nclients, sizeof(kv_client_t));
    if (ctx->clients == NULL) {
        goto out;
    }
    kv_info("starting node %s (%s)", ctx->cfg.node_id,
            dpd_state_role_name(ctx->cfg.role));
    if (kv_state_open(&ctx->st, ctx->cfg.state_path, ctx->cfg.node_id,
                      ctx->cfg.max_nodes, ctx->cfg.max_reqs) != 0)
    {
        goto out;
    }
    ctx->nranks = ctx->cfg.has_pool ? ctx->cfg.ranks : 0;
    if (ctx->cfg.has_pool) {
        if (kv_pool_alloc(ctx) != 0) {
            goto out;
        }
        /* the rails, and which serve each rank (PCIe topology) */
        if (kv_topo_plan(ctx) != 0) {
            goto out;
        }
        if (kv_fabric_open(&ctx->fab, ctx->cfg.provider,
                           ctx->cfg.allow_fallback, ctx->cfg.rails,
                           ctx->cfg.nrails, ctx->cfg.cuda_dev >= 0) != 0)
        {
            goto out;
        }
        ctx->fab_ok = 1;
        if (kv_pool_register(ctx) != 0) {
            goto out;
        }
    }
    if (kv_xfer_init(ctx) != 0) {
        kv_err("cannot allocate transfer state");
        goto out;
    }
    if (kv_ctrl_listen(ctx) != 0 || kv_api_listen(ctx) != 0
        || kv_lmc_open(ctx) != 0)
    {
        goto out;
    }
    /* names (peers' "ctrl", peers_dns) are resolved in resolve.c's
     * threads: the loop never waits for a DNS server */
    ctx->res = kv_res_create(NULL);
    if (ctx->res == NULL) {
        kv_err("resolver: %s", strerror(errno));
        goto out;
    }
    if (kv_pdns_open(ctx) != 0) {
        goto out;
    }
    if (ctx->cfg.evs.nsrc > 0 || ctx->cfg.evs.ndns > 0) {
        kv_ev_sink_t sink;
        kv_events_sink(ctx, &sink);
        if (ctx->cfg.pfx.path[0] && kv_prefix_open(ctx, &sink) != 0) {
            goto out;
        }
        ctx->evs = kv_evs_open(&ctx->cfg.evs, &sink, NULL);
        if (ctx->evs == NULL) {
            goto out;
        }
        if (ctx->cfg.evs.ndns > 0) {
            ctx->evs_dns = kv_evs_dns_open(&ctx->cfg.evs, ctx->evs,
                                           ctx->pfx_feed);
            if (ctx->evs_dns == NULL) {
                goto out;
            }
        }
    }
    kv_ctrl_update_self(ctx);
    for (i = 0; i < ctx->npeers; i++) {
        kv_ctrl_update_node(ctx, i);
    }
    kv_auth_forget(&ctx->cfg);     /* the copies in ctx->peers remain */
    kv_info("ready");
    run_loop(ctx);
    if (kv_got_signal) {
        kv_info("signal %d: shutting down", (int) kv_got_signal);
    }
    rc = 0;

out:
    shutdown_ctx(ctx);
    kv_info("stopped");
    free(ctx);
    return rc;
}
