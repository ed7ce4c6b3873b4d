/*
 * lmcache_notify.c - the notify port of LMCache's PD proxy, in the agent.
 *
 * LMCache's PD sender (lmcache/v1/storage_backend/pd_backend.py) ends every
 * request's last transfer, on every TP rank, by sending
 *     msgspec.msgpack.encode(ProxyNotif(req_id=...))
 * over a ZeroMQ PUSH socket connected to pd_proxy_host:pd_proxy_port.
 * ProxyNotif is a tagged msgspec Struct: a msgpack map
 *     {"type": "ProxyNotif", "req_id": "<id>"}
 * LMCache's proxy binds a PULL socket there and sends the decode request
 * once it has counted one notice per decode TP rank.
 *
 * With "lmcache_notify" configured, the agent (the router-side instance,
 * whose state table nginx reads) is that PULL socket: each accepted notice
 * marks the request's record (peer_id "lmcache", no node id) READY with
 * nblocks = the number of distinct sender connections that notified it;
 * nginx (dpd_protocol lmcache) decodes once nblocks reaches the decode
 * pool's TP ranks.
 *
 * Who may send: ZeroMQ's NULL mechanism has no credentials (LMCache's
 * senders use none).  The allowlist ("allow", CIDRs) is enforced twice:
 * at accept (ZMQ_TCP_ACCEPT_FILTER: libzmq closes the descriptor of any
 * other address at once, so an outsider's idle connections hold none; the
 * ZAP check alone runs only after a greeting, and an outsider that sent
 * nothing kept a descriptor each until the handshake timed out), and by
 * this file's ZAP handler, which gives each admitted connection its own
 * user id, which its messages carry, so a sender repeating a notice counts
 * once.  An admitted connection has ZMQ_HANDSHAKE_IVL (3 s) to greet.
 * libzmq's listener polls again at once when accept() fails for want of
 * descriptors (a spin): a socket monitor reports each failed accept, and
 * when the process is out of descriptors the port is unbound and bound
 * again after 50 ms, doubling to 1 s (senders reconnect by themselves).  Messages over 1 KiB close the
 * connection (ZMQ_MAXMSGSIZE); anything but a well-formed ProxyNotif with
 * a printable req_id is dropped and counted; a notice never touches a
 * record of this agent's own transfers (node id set, or another peer).
 */

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <msgpack.h>
#include <zmq.h>

#include "kv.h"


#define KV_LMC_MAX_MSG     1024        /* bytes; larger: disconnected */
#define KV_LMC_MAX_RANKS   64          /* distinct senders per request */
#define KV_LMC_PROBE       16
#define KV_LMC_PEER        "lmcache"   /* peer_id of our records */
#define KV_LMC_ZAP         "inproc://zeromq.zap.01"
#define KV_LMC_MON         "inproc://dpd-lmcache-monitor"
#define KV_LMC_HANDSHAKE   3000        /* ms to greet once accepted */


typedef struct {
    uint64_t  hash;                    /* 0: free */
    uint64_t  t_ms;                    /* last notice, monotonic */
    char      req_id[DPD_STATE_REQID_LEN];
    uint32_t  n;
    uint32_t  conns[KV_LMC_MAX_RANKS];
} kv_lmc_req_t;

struct kv_lmc {
    void          *zctx;
    void          *pull;
    void          *zap;
    void          *mon;                /* PAIR: the pull socket's events */
    char           ep[KV_ADDR_LEN + 16];   /* bound: ZMQ_LAST_ENDPOINT */
    int            bound;
    uint64_t       rebind_ms;          /* unbound: bind again then */
    uint32_t       backoff_ms;
    uint32_t       next_conn;
    kv_lmc_req_t  *reqs;
    uint32_t       nreqs;
    uint64_t       accepted, bad, dup, denied, foreign, filtered, nofd;
    kv_loglim_t    warn_bad, warn_denied, warn_nofd;
};


static int
lmc_cidr(const char *s, kv_lmc_cidr_t *out)
{
    char buf[64], *slash;
    long bits;
    int i, max;

    if (strlen(s) >= sizeof(buf)) {
        return -1;
    }
    strcpy(buf, s);
    slash = strchr(buf, '/');
    if (slash) {
        *slash++ = '\0';
    }
    memset(out, 0, sizeof(*out));
    if (inet_pton(AF_INET, buf, out->addr) == 1) {
        out->family = AF_INET;
        max = 32;
    } else if (inet_pton(AF_INET6, buf, out->addr) == 1) {
        out->family = AF_INET6;
        max = 128;
    } else {
        return -1;
    }
    bits = max;
    if (slash) {
        char *end;
        errno = 0;
        bits = strtol(slash, &end, 10);
        if (errno || *end || end == slash || bits < 0 || bits > max) {
            return -1;
        }
    }
    for (i = 0; i < max / 8; i++) {
        int b = (int) bits - i * 8;
        out->mask[i] = b >= 8 ? 0xff : b <= 0 ? 0 : (uint8_t) (0xff << (8 - b));
        out->addr[i] &= out->mask[i];
    }
    return 0;
}


int
kv_lmc_config(kv_lmc_conf_t *c, cJSON *o, char *err, size_t elen)
{
    cJSON *e, *v;

    memset(c, 0, sizeof(*c));
    if (!cJSON_IsObject(o)) {
        snprintf(err, elen, "\"lmcache_notify\" must be an object");
        return -1;
    }
    cJSON_ArrayForEach(e, o) {
        if (strcmp(e->string, "listen") != 0
            && strcmp(e->string, "allow") != 0)
        {
            snprintf(err, elen, "lmcache_notify: unknown key \"%s\"",
                     e->string);
            return -1;
        }
    }
    v = cJSON_GetObjectItemCaseSensitive(o, "listen");
    if (!cJSON_IsString(v) || v->valuestring[0] == '\0'
        || strlen(v->valuestring) >= sizeof(c->listen)
        || strchr(v->valuestring, ':') == NULL
        || strstr(v->valuestring, "://") != NULL)
    {
        snprintf(err, elen, "lmcache_notify.listen must be \"host:port\" "
                 "(the pd_proxy_host:pd_proxy_port of the senders)");
        return -1;
    }
    strcpy(c->listen, v->valuestring);
    v = cJSON_GetObjectItemCaseSensitive(o, "allow");
    if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) == 0
        || cJSON_GetArraySize(v) > KV_LMC_MAX_ALLOW)
    {
        snprintf(err, elen, "lmcache_notify.allow must list 1..%d "
                 "addresses or networks of the prefill nodes (CIDR)",
                 KV_LMC_MAX_ALLOW);
        return -1;
    }
    cJSON_ArrayForEach(e, v) {
        if (!cJSON_IsString(e)
            || lmc_cidr(e->valuestring, &c->allow[c->nallow]) != 0)
        {
            snprintf(err, elen, "lmcache_notify.allow: \"%s\" is not an "
                     "address or network",
                     cJSON_IsString(e) ? e->valuestring : "?");
            return -1;
        }
        c->nallow++;
    }
    return 0;
}


static int
lmc_allowed(const kv_lmc_conf_t *c, const char *addr)
{
    uint8_t a[16];
    int fam, i, k, n;

    memset(a, 0, sizeof(a));
    if (inet_pton(AF_INET, addr, a) == 1) {
        fam = AF_INET;
    } else if (inet_pton(AF_INET6, addr, a) == 1) {
        static const uint8_t mapped[12] = { 0,0,0,0,0,0,0,0,0,0,0xff,0xff };
        fam = AF_INET6;
        if (memcmp(a, mapped, 12) == 0) {      /* ::ffff:a.b.c.d */
            memmove(a, a + 12, 4);
            memset(a + 4, 0, 12);
            fam = AF_INET;
        }
    } else {
        return 0;
    }
    for (i = 0; i < c->nallow; i++) {
        if (c->allow[i].family != (uint32_t) fam) {
            continue;
        }
        n = fam == AF_INET ? 4 : 16;
        for (k = 0; k < n; k++) {
            if ((a[k] & c->allow[i].mask[k]) != c->allow[i].addr[k]) {
                break;
            }
        }
        if (k == n) {
            return 1;
        }
    }
    return 0;
}


/* the prefix length of a mask */
static int
lmc_bits(const kv_lmc_cidr_t *c)
{
    int i, b, bits = 0, n = c->family == AF_INET ? 4 : 16;

    for (i = 0; i < n; i++) {
        for (b = 7; b >= 0; b--) {
            bits += (c->mask[i] >> b) & 1;
        }
    }
    return bits;
}


/*
 * The allowlist as libzmq's accept filters: a connection from any other
 * address is closed as soon as it is accepted.  libzmq parses a filter as
 * the socket's ZMQ_IPV6 says at that moment (with it on, "10.0.0.0/8"
 * would become ::ffff:10.0.0.0 with an 8-bit mask: almost everything), so
 * IPv4 networks go in first with ZMQ_IPV6 off; then, for an IPv6 listener
 * (which sees an IPv4 peer as ::ffff:a.b.c.d), ZMQ_IPV6 on, the IPv6
 * networks and each IPv4 one in its mapped form.  An IPv4 listener
 * cannot be reached over IPv6: its IPv6 networks need no filter.
 */
static int
lmc_filters(void *s, const kv_lmc_conf_t *c, int ipv6)
{
    char a[INET6_ADDRSTRLEN], f[INET6_ADDRSTRLEN + 32];
    int i, pass, v;

    for (pass = 0; pass < (ipv6 ? 2 : 1); pass++) {
        v = pass;
        if (zmq_setsockopt(s, ZMQ_IPV6, &v, sizeof(v)) != 0) {
            return -1;
        }
        for (i = 0; i < c->nallow; i++) {
            const kv_lmc_cidr_t *e = &c->allow[i];
            if ((pass == 0 && e->family != AF_INET)
                || inet_ntop((int) e->family, e->addr, a, sizeof(a)) == NULL)
            {
                continue;
            }
            if (pass == 0 || e->family == AF_INET6) {
                snprintf(f, sizeof(f), "%s/%d", a, lmc_bits(e));
            } else {
                snprintf(f, sizeof(f), "::ffff:%s/%d", a, 96 + lmc_bits(e));
            }
            if (zmq_setsockopt(s, ZMQ_TCP_ACCEPT_FILTER, f, strlen(f)) != 0)
            {
                return -1;
            }
        }
    }
    return 0;
}


/* 1 when this process has no descriptor left (EMFILE, ENFILE) */
static int
lmc_out_of_fds(void *s)
{
    size_t sz;
    int fd, nfd;

    sz = sizeof(fd);
    if (zmq_getsockopt(s, ZMQ_FD, &fd, &sz) != 0) {
        return 0;
    }
    nfd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (nfd < 0) {
        return errno == EMFILE || errno == ENFILE;
    }
    close(nfd);
    return 0;
}


/*
 * The monitor's ACCEPT_FAILED events: a connection the filter closed, or
 * an accept() without a descriptor, which libzmq's listener would retry
 * at once, forever: then the port is unbound for a while.
 */
static void
lmc_monitor(kv_ctx_t *ctx)
{
    struct kv_lmc *l = ctx->lmc;
    uint8_t ev[64];
    char addr[256];
    int n, more, failed = 0;
    uint16_t id;
    size_t sz;

    for (;;) {
        n = zmq_recv(l->mon, ev, sizeof(ev), ZMQ_DONTWAIT);
        if (n < 0) {
            break;
        }
        more = 0;
        sz = sizeof(more);
        zmq_getsockopt(l->mon, ZMQ_RCVMORE, &more, &sz);
        while (more) {                 /* the endpoint */
            if (zmq_recv(l->mon, addr, sizeof(addr), ZMQ_DONTWAIT) < 0) {
                break;
            }
            sz = sizeof(more);
            zmq_getsockopt(l->mon, ZMQ_RCVMORE, &more, &sz);
        }
        if (n < 6) {
            continue;
        }
        memcpy(&id, ev, sizeof(id));
        if (id == ZMQ_EVENT_ACCEPT_FAILED) {
            failed++;
        }
    }
    if (failed == 0) {
        return;
    }
    if (l->bound && lmc_out_of_fds(l->pull)) {
        l->nofd += (uint64_t) failed;
        l->backoff_ms = l->backoff_ms == 0 ? 50
                        : l->backoff_ms * 2 > 1000 ? 1000 : l->backoff_ms * 2;
        l->rebind_ms = kv_now_ms() + l->backoff_ms;
        if (zmq_unbind(l->pull, l->ep) == 0) {
            l->bound = 0;
        }
        if (kv_log_limit(&l->warn_nofd)) {
            kv_warn("lmcache_notify: no descriptor left to accept a "
                    "connection: not listening for %u ms (%llu failed "
                    "accepts so far)", l->backoff_ms,
                    (unsigned long long) l->nofd);
        }
        return;
    }
    l->filtered += (uint64_t) failed;
    if (kv_log_limit(&l->warn_denied)) {
        kv_warn("lmcache_notify: connections refused at accept (not in "
                "lmcache_notify.allow) or failed (%llu so far)",
                (unsigned long long) l->filtered);
    }
}


int
kv_lmc_open(kv_ctx_t *ctx)
{
    struct kv_lmc *l;
    char ep[KV_ADDR_LEN + 16];
    int v;

    if (ctx->cfg.lmc.listen[0] == '\0') {
        return 0;
    }
    l = calloc(1, sizeof(*l));
    if (l == NULL) {
        return -1;
    }
    l->nreqs = ctx->cfg.max_reqs ? ctx->cfg.max_reqs : 1024;
    l->reqs = calloc(l->nreqs, sizeof(kv_lmc_req_t));
    l->zctx = zmq_ctx_new();
    if (l->reqs == NULL || l->zctx == NULL) {
        goto failed;
    }
    /* the ZAP handler first: connections before it would go unchecked */
    l->zap = zmq_socket(l->zctx, ZMQ_REP);
    if (l->zap == NULL || zmq_bind(l->zap, KV_LMC_ZAP) != 0) {
        kv_err("lmcache_notify: ZAP handler: %s", zmq_strerror(errno));
        goto failed;
    }
    l->pull = zmq_socket(l->zctx, ZMQ_PULL);
    if (l->pull == NULL) {
        goto failed;
    }
    {
        int64_t max = KV_LMC_MAX_MSG;
        v = 0;
        zmq_setsockopt(l->pull, ZMQ_LINGER, &v, sizeof(v));
        zmq_setsockopt(l->zap, ZMQ_LINGER, &v, sizeof(v));
        zmq_setsockopt(l->pull, ZMQ_MAXMSGSIZE, &max, sizeof(max));
        v = 4096;
        zmq_setsockopt(l->pull, ZMQ_RCVHWM, &v, sizeof(v));
        zmq_setsockopt(l->pull, ZMQ_ZAP_DOMAIN, "dpd", 3);
    }
    v = KV_LMC_HANDSHAKE;
    zmq_setsockopt(l->pull, ZMQ_HANDSHAKE_IVL, &v, sizeof(v));
    /* sets ZMQ_IPV6 too: on for a [v6] listen address */
    if (lmc_filters(l->pull, &ctx->cfg.lmc,
                    strchr(ctx->cfg.lmc.listen, '[') != NULL) != 0)
    {
        kv_err("lmcache_notify: accept filter: %s", zmq_strerror(errno));
        goto failed;
    }
    /* failed accepts: refused by the filter, or no descriptor left */
    if (zmq_socket_monitor(l->pull, KV_LMC_MON, ZMQ_EVENT_ACCEPT_FAILED)
        != 0
        || (l->mon = zmq_socket(l->zctx, ZMQ_PAIR)) == NULL
        || zmq_setsockopt(l->mon, ZMQ_LINGER, &(int) { 0 }, sizeof(int))
           != 0
        || zmq_connect(l->mon, KV_LMC_MON) != 0)
    {
        kv_err("lmcache_notify: socket monitor: %s", zmq_strerror(errno));
        goto failed;
    }
    snprintf(ep, sizeof(ep), "tcp://%s", ctx->cfg.lmc.listen);
    if (zmq_bind(l->pull, ep) != 0) {
        kv_err("lmcache_notify: cannot listen on %s: %s", ep,
               zmq_strerror(errno));
        goto failed;
    }
    {
        size_t sz = sizeof(l->ep);
        if (zmq_getsockopt(l->pull, ZMQ_LAST_ENDPOINT, l->ep, &sz) != 0) {
            snprintf(l->ep, sizeof(l->ep), "%s", ep);
        }
    }
    l->bound = 1;
    ctx->lmc = l;
    kv_info("lmcache_notify: listening on %s for ProxyNotif (%d allowed "
            "networks)", ctx->cfg.lmc.listen, ctx->cfg.lmc.nallow);
    return 0;

failed:
    if (l->mon) {
        zmq_close(l->mon);
    }
    if (l->pull) {
        zmq_close(l->pull);
    }
    if (l->zap) {
        zmq_close(l->zap);
    }
    if (l->zctx) {
        zmq_ctx_term(l->zctx);
    }
    free(l->reqs);
    free(l);
    return -1;
}


void
kv_lmc_close(kv_ctx_t *ctx)
{
    struct kv_lmc *l = ctx->lmc;

    if (l == NULL) {
        return;
    }
    kv_info("lmcache_notify: %llu notices accepted, %llu repeated, "
            "%llu malformed, %llu for foreign records, %llu connections "
            "refused (%llu at accept), %llu accepts without a descriptor",
            (unsigned long long) l->accepted,
            (unsigned long long) l->dup, (unsigned long long) l->bad,
            (unsigned long long) l->foreign,
            (unsigned long long) (l->denied + l->filtered),
            (unsigned long long) l->filtered,
            (unsigned long long) l->nofd);
    zmq_socket_monitor(l->pull, NULL, 0);
    zmq_close(l->mon);
    zmq_close(l->pull);
    zmq_close(l->zap);
    zmq_ctx_term(l->zctx);
    free(l->reqs);
    free(l);
    ctx->lmc = NULL;
}


int
kv_lmc_pollfds(kv_ctx_t *ctx, struct pollfd *pfd)
{
    struct kv_lmc *l = ctx->lmc;
    size_t sz;
    int fd;

    if (l == NULL) {
        return 0;
    }
    sz = sizeof(fd);
    if (zmq_getsockopt(l->pull, ZMQ_FD, &fd, &sz) != 0) {
        return 0;
    }
    pfd[0].fd = fd;
    pfd[0].events = POLLIN;
    sz = sizeof(fd);
    if (zmq_getsockopt(l->zap, ZMQ_FD, &fd, &sz) != 0) {
        return 1;
    }
    pfd[1].fd = fd;
    pfd[1].events = POLLIN;
    sz = sizeof(fd);
    if (zmq_getsockopt(l->mon, ZMQ_FD, &fd, &sz) != 0) {
        return 2;
    }
    pfd[2].fd = fd;
    pfd[2].events = POLLIN;
    return 3;
}


/* one frame of a multipart message, NUL-terminated into buf; -1 on none */
static int
lmc_frame(void *s, char *buf, size_t blen, int *more)
{
    int n;
    size_t sz = sizeof(*more);

    n = zmq_recv(s, buf, blen - 1, ZMQ_DONTWAIT);
    if (n < 0) {
        return -1;
    }
    if ((size_t) n > blen - 1) {
        n = (int) blen - 1;            /* truncated: only compared */
    }
    buf[n] = '\0';
    *more = 0;
    zmq_getsockopt(s, ZMQ_RCVMORE, more, &sz);
    return n;
}


/* RFC 27 (ZAP): admit a connection whose address is allowed */
static void
lmc_zap(kv_ctx_t *ctx)
{
    struct kv_lmc *l = ctx->lmc;
    char ver[16], rid[256], dom[64], addr[128], rest[256], uid[32];
    int more, ridlen, ok;

    for (;;) {
        if (lmc_frame(l->zap, ver, sizeof(ver), &more) < 0) {
            return;
        }
        ridlen = -1;
        addr[0] = '\0';
        if (more) {
            ridlen = lmc_frame(l->zap, rid, sizeof(rid), &more);
        }
        if (more) {
            lmc_frame(l->zap, dom, sizeof(dom), &more);
        }
        if (more) {
            lmc_frame(l->zap, addr, sizeof(addr), &more);
        }
        while (more) {                 /* identity, mechanism, credentials */
            if (lmc_frame(l->zap, rest, sizeof(rest), &more) < 0) {
                break;
            }
        }
        if (ridlen < 0) {
            ridlen = 0;
            rid[0] = '\0';
        }
        ok = strcmp(ver, "1.0") == 0 && lmc_allowed(&ctx->cfg.lmc, addr);
        if (ok) {
            snprintf(uid, sizeof(uid), "c%u", ++l->next_conn);
        } else {
            uid[0] = '\0';
            l->denied++;
            if (kv_log_limit(&l->warn_denied)) {
                kv_warn("lmcache_notify: connection from \"%.64s\" refused "
                        "(not in lmcache_notify.allow; %llu so far)", addr,
                        (unsigned long long) l->denied);
            }
        }
        zmq_send(l->zap, "1.0", 3, ZMQ_SNDMORE);
        zmq_send(l->zap, rid, (size_t) ridlen, ZMQ_SNDMORE);
        zmq_send(l->zap, ok ? "200" : "400", 3, ZMQ_SNDMORE);
        zmq_send(l->zap, ok ? "OK" : "address not allowed",
                 ok ? 2 : 19, ZMQ_SNDMORE);
        zmq_send(l->zap, uid, strlen(uid), ZMQ_SNDMORE);
        zmq_send(l->zap, "", 0, 0);
    }
}


/* the req_id of a ProxyNotif, or -1 (reason in *why) */
static int
lmc_parse(const char *data, size_t len, char *req_id, size_t rlen,
    const char **why)
{
    msgpack_unpacked u;
    msgpack_object_kv *kv;
    size_t off = 0;
    uint32_t i, j;
    int type = 0, have = 0, rc = -1;

    msgpack_unpacked_init(&u);
    if (msgpack_unpack_next(&u, data, len, &off) != MSGPACK_UNPACK_SUCCESS
        || off != len)
    {
        *why = "not one msgpack value";
        goto done;
    }
    if (u.data.type != MSGPACK_OBJECT_MAP) {
        *why = "not a map";
        goto done;
    }
    for (i = 0; i < u.data.via.map.size; i++) {
        kv = &u.data.via.map.ptr[i];
        if (kv->key.type != MSGPACK_OBJECT_STR) {
            *why = "a key is not a string";
            goto done;
        }
        if (kv->key.via.str.size == 4
            && memcmp(kv->key.via.str.ptr, "type", 4) == 0)
        {
            if (type || kv->val.type != MSGPACK_OBJECT_STR
                || kv->val.via.str.size != 10
                || memcmp(kv->val.via.str.ptr, "ProxyNotif", 10) != 0)
            {
                *why = "not a ProxyNotif";
                goto done;
            }
            type = 1;
        } else if (kv->key.via.str.size == 6
                   && memcmp(kv->key.via.str.ptr, "req_id", 6) == 0)
        {
            if (have || kv->val.type != MSGPACK_OBJECT_STR
                || kv->val.via.str.size == 0
                || kv->val.via.str.size >= rlen)
            {
                *why = "req_id missing, repeated, empty or too long";
                goto done;
            }
            for (j = 0; j < kv->val.via.str.size; j++) {
                unsigned char c = (unsigned char) kv->val.via.str.ptr[j];
                if (c <= 0x20 || c >= 0x7f) {
                    *why = "req_id is not printable ASCII";
                    goto done;
                }
            }
            memcpy(req_id, kv->val.via.str.ptr, kv->val.via.str.size);
            req_id[kv->val.via.str.size] = '\0';
            have = 1;
        }
        /* other fields: as msgspec, ignored */
    }
    if (!type || !have) {
        *why = "no \"type\": \"ProxyNotif\" or no req_id";
        goto done;
    }
    rc = 0;

done:
    msgpack_unpacked_destroy(&u);
    return rc;
}


/* the connections that notified req_id so far */
static kv_lmc_req_t *
lmc_track(struct kv_lmc *l, const char *req_id, uint64_t now)
{
    uint64_t hash = dpd_state_hash(req_id, strlen(req_id));
    kv_lmc_req_t *e, *oldest = NULL;
    uint32_t i;

    for (i = 0; i < KV_LMC_PROBE && i < l->nreqs; i++) {
        e = &l->reqs[(hash + i) % l->nreqs];
        if (e->hash == hash && strcmp(e->req_id, req_id) == 0) {
            return e;
        }
        if (oldest == NULL || e->hash == 0 || e->t_ms < oldest->t_ms) {
            if (oldest == NULL || oldest->hash != 0) {
                oldest = e;
            }
        }
    }
    e = oldest;                        /* a free slot, else the oldest */
    memset(e, 0, sizeof(*e));
    e->hash = hash;
    e->t_ms = now;
    snprintf(e->req_id, sizeof(e->req_id), "%s", req_id);
    return e;
}


static void
lmc_notice(kv_ctx_t *ctx, const char *req_id, uint32_t conn)
{
    struct kv_lmc *l = ctx->lmc;
    kv_lmc_req_t *e;
    dpd_req_rec_t *r;
    uint64_t now = kv_now_ms(), wall = kv_wall_ms();
    uint32_t i;

    r = kv_state_req(&ctx->st, req_id, 0);
    if (r && (r->node_id[0] != '\0' || strcmp(r->peer_id, KV_LMC_PEER) != 0))
    {
        /* one of our own transfers: a notice must not steer it */
        l->foreign++;
        return;
    }
    e = lmc_track(l, req_id, now);
    for (i = 0; i < e->n; i++) {
        if (e->conns[i] == conn) {
            l->dup++;
            return;
        }
    }
    if (e->n == KV_LMC_MAX_RANKS) {
        l->dup++;
        return;
    }
    e->conns[e->n++] = conn;
    e->t_ms = now;
    if (r == NULL) {
        r = kv_state_req(&ctx->st, req_id, 1);
        if (r == NULL) {
            return;
        }
    }
    kv_state_req_begin(r);
    if (r->peer_id[0] == '\0') {
        snprintf(r->peer_id, sizeof(r->peer_id), "%s", KV_LMC_PEER);
        r->t_start_ms = wall;
    }
    /* READY: counted, and collected after retention like any final one;
     * nginx compares nblocks with the decode pool's TP ranks */
    r->state = DPD_REQ_READY;
    r->nblocks = e->n;
    r->t_done_ms = wall;
    kv_state_req_end(&ctx->st, r);
    l->accepted++;
    kv_debug("lmcache_notify: %s notified by %u of its ranks", req_id, e->n);
}


void
kv_lmc_process(kv_ctx_t *ctx)
{
    struct kv_lmc *l = ctx->lmc;
    char req_id[DPD_STATE_REQID_LEN];
    const char *why, *uid;
    zmq_msg_t msg;
    int more, n;
    unsigned long conn;
    char *end;

    if (l == NULL) {
        return;
    }
    lmc_monitor(ctx);
    if (!l->bound && kv_now_ms() >= l->rebind_ms) {
        if (zmq_bind(l->pull, l->ep) == 0) {
            l->bound = 1;
            kv_info("lmcache_notify: listening on %s again", l->ep);
        } else {
            l->backoff_ms = l->backoff_ms * 2 > 1000 ? 1000
                            : l->backoff_ms * 2;
            l->rebind_ms = kv_now_ms() + l->backoff_ms;
        }
    } else if (l->bound && l->backoff_ms
               && kv_now_ms() >= l->rebind_ms + 5000
               && lmc_out_of_fds(l->pull) == 0)
    {
        l->backoff_ms = 0;             /* 5 s without a shortage */
    }
    lmc_zap(ctx);
    for (n = 0; n < 1024; n++) {
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, l->pull, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&msg);
            break;
        }
        more = zmq_msg_more(&msg);
        why = NULL;
        uid = zmq_msg_gets(&msg, "User-Id");
        conn = 0;
        if (uid && uid[0] == 'c') {
            conn = strtoul(uid + 1, &end, 10);
            if (*end != '\0') {
                conn = 0;
            }
        }
        if (more) {
            why = "multipart message";
        } else if (conn == 0 || conn > UINT32_MAX) {
            why = "connection not admitted by the ZAP handler";
        } else if (lmc_parse(zmq_msg_data(&msg), zmq_msg_size(&msg),
                             req_id, sizeof(req_id), &why) == 0)
        {
            lmc_notice(ctx, req_id, (uint32_t) conn);
        }
        zmq_msg_close(&msg);
        while (more) {                 /* drop the rest of a multipart */
            zmq_msg_init(&msg);
            if (zmq_msg_recv(&msg, l->pull, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&msg);
                break;
            }
            more = zmq_msg_more(&msg);
            zmq_msg_close(&msg);
        }
        if (why) {
            l->bad++;
            if (kv_log_limit(&l->warn_bad)) {
                kv_warn("lmcache_notify: message dropped: %s (%llu so far)",
                        why, (unsigned long long) l->bad);
            }
        }
    }
}
