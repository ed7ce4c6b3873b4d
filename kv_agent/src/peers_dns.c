/*
 * peers_dns.c - peers found from DNS answers ("peers_dns"): the pods of a
 * pool behind a Kubernetes headless Service, so one config serves every
 * replica and a scale-up needs no rollout.
 *
 * A DNS answer names addresses, never identities.  Each address is probed:
 * we connect, the listener's challenge claims its node id, and that claim
 * is believed only once the peer proves it with the key of the link
 * (self, id), read from the entry's key_file pattern with "{peer}"
 * replaced by the id (auth.c: the proofs bind both ids and roles).  An id
 * that is not a safe file name is refused before any path is built; so is
 * an id that a configured peer holds, or a discovered one linked at
 * another address, or one whose key another link already uses.  Inbound
 * links work the same way: an unknown id in a hello is looked up in each
 * entry's key pattern and accepted only if that key proves the hello.
 *
 * Each name is resolved every resolve_ms through resolve.c (off the loop:
 * a slow cluster DNS never stalls it).  An address missing from two
 * answers in a row is forgotten; the peer linked through it (or whose
 * inbound link came from it) is dropped: links closed, its transfers
 * failed, its node record removed from the state table.  A failed lookup
 * (timeout, SERVFAIL) changes nothing; "no such name" is an empty pool.
 *
 * A peer slot (ctx->peers[i]) is an identity: its index stays with one id
 * while any transfer, reservation or connection refers to it (a retired
 * slot comes back for the same id, or is reused for another only when
 * nothing refers to it any more).  At most KV_MAX_PEERS slots, configured
 * ones included.
 */

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "kv.h"
#include "resolve.h"

#define KV_PDNS_DROP_AFTER  2          /* answers in a row without it */

enum {
    PA_FREE = 0,
    PA_IDLE,                           /* waiting for next_ms */
    PA_CONNECTING,
    PA_CHALLENGE,                      /* connected, waiting for its claim */
    PA_LINKED,                         /* handed to a peer slot */
    PA_SELF                            /* our own listener */
};

typedef struct {
    int            state;
    int            entry;
    kv_res_addr_t  addr;
    char           ip[64];
    char           hostport[KV_ADDR_LEN];
    kv_conn_t      conn;
    uint64_t       next_ms;
    uint64_t       deadline_ms;
    int            peer;               /* slot handed to, -1 */
    int            missing;
    uint32_t       refusals;           /* in a row: the back-off */
} kv_pdns_addr_t;

struct kv_pdns {
    kv_pdns_addr_t addr[KV_PDNS_MAX_ADDRS];
    uint64_t       res_id[KV_DNS_MAX];
    uint64_t       next_ms[KV_DNS_MAX];
    uint64_t       started_ms[KV_DNS_MAX];
    int            failing[KV_DNS_MAX];
    kv_loglim_t    warn;
    uint64_t       refused;
    /* our own listener, as answers write it: skipped */
    char           self_ip[16][64];
    int            nself, self_any, self_port;
};


int
kv_peer_visible(const kv_peer_t *pe)
{
    return !pe->retired && (!pe->dyn || pe->dyn_proven);
}


static int
entry_of(kv_ctx_t *ctx, int i)
{
    return ctx->peers[i].dyn - 1;
}


/* Rate-limited: anyone reachable may claim anything, in a loop. */
static void
refuse_log(kv_ctx_t *ctx, const char *fmt, const char *a, const char *b,
    const char *c)
{
    struct kv_pdns *d = ctx->pdns;
    char line[512];

    d->refused++;
    if (!kv_log_limit(&d->warn)) {
        return;
    }
    snprintf(line, sizeof(line), fmt, a, b, c);
    /* kv_log escapes the whole line: a claimed id cannot forge one */
    kv_warn("peers_dns: %s (%llu refused so far)", line,
            (unsigned long long) d->refused);
}


static void
ip_of(const kv_res_addr_t *a, char *out, size_t len)
{
    if (kv_res_addr_str(a, 0, out, len) < 0) {
        snprintf(out, len, "?");
    }
}


/* Our listener's addresses: the listen host, or every local address when
 * it listens on a wildcard. */
static void
self_addrs(kv_ctx_t *ctx, struct kv_pdns *d)
{
    char host[KV_ADDR_LEN], buf[64];
    struct ifaddrs *ifa, *i;
    const void *src;

    if (kv_parse_hostport(ctx->cfg.listen, host, sizeof(host),
                          &d->self_port) != 0)
    {
        return;
    }
    if (strcmp(host, "0.0.0.0") != 0 && strcmp(host, "::") != 0
        && strcmp(host, "[::]") != 0 && host[0] != '\0')
    {
        snprintf(d->self_ip[d->nself++], sizeof(d->self_ip[0]), "%.63s", host);
        return;
    }
    d->self_any = 1;
    if (getifaddrs(&ifa) != 0) {
        return;
    }
    for (i = ifa; i && d->nself < 16; i = i->ifa_next) {
        if (i->ifa_addr == NULL) {
            continue;
        }
        if (i->ifa_addr->sa_family == AF_INET) {
            src = &((struct sockaddr_in *) i->ifa_addr)->sin_addr;
        } else if (i->ifa_addr->sa_family == AF_INET6) {
            src = &((struct sockaddr_in6 *) i->ifa_addr)->sin6_addr;
        } else {
            continue;
        }
        if (inet_ntop(i->ifa_addr->sa_family, src, buf, sizeof(buf))) {
            snprintf(d->self_ip[d->nself++], sizeof(d->self_ip[0]), "%s",
                     buf);
        }
    }
    freeifaddrs(ifa);
}


static int
is_self(struct kv_pdns *d, const kv_pdns_addr_t *a)
{
    int i;

    if (a->addr.port != d->self_port) {
        return 0;
    }
    for (i = 0; i < d->nself; i++) {
        if (strcmp(d->self_ip[i], a->ip) == 0) {
            return 1;
        }
    }
    return 0;
}


int
kv_pdns_open(kv_ctx_t *ctx)
{
    struct kv_pdns *d;

    if (ctx->cfg.ndns == 0) {
        return 0;
    }
    d = calloc(1, sizeof(*d));
    if (d == NULL) {
        kv_err("peers_dns: out of memory");
        return -1;
    }
    self_addrs(ctx, d);
    ctx->pdns = d;
    kv_info("peers_dns: %d name(s), up to %d peers in all", ctx->cfg.ndns,
            KV_MAX_PEERS);
    return 0;
}


void
kv_pdns_close(kv_ctx_t *ctx)
{
    struct kv_pdns *d = ctx->pdns;
    int i;

    if (d == NULL) {
        return;
    }
    for (i = 0; i < KV_PDNS_MAX_ADDRS; i++) {
        if (d->addr[i].state == PA_CONNECTING
            || d->addr[i].state == PA_CHALLENGE)
        {
            kv_conn_free(&d->addr[i].conn);
        }
    }
    for (i = 0; i < KV_DNS_MAX; i++) {
        if (d->res_id[i] && ctx->res) {
            kv_res_cancel(ctx->res, d->res_id[i]);
        }
    }
    free(d);
    ctx->pdns = NULL;
}


/* ---- peer slots ------------------------------------------------------ */

static int
slot_referenced(kv_ctx_t *ctx, int i)
{
    uint32_t k;
    int c;

    for (k = 0; ctx->push && k < ctx->npush; k++) {
        if (ctx->push[k].state != KV_PUSH_FREE && ctx->push[k].peer == i) {
            return 1;
        }
    }
    for (k = 0; ctx->rreq && k < ctx->nrreq; k++) {
        if (ctx->rreq[k].used && ctx->rreq[k].peer == i) {
            return 1;
        }
    }
    for (c = 0; c < ctx->nclients; c++) {
        if (ctx->clients[c].used && ctx->clients[c].peer == i) {
            return 1;
        }
    }
    return 0;
}


/* The slot of id (retired ones too: an id keeps its index), else a free
 * one; -1 when every slot is taken. */
static int
slot_for(kv_ctx_t *ctx, const char *id, int *fresh)
{
    kv_peer_t *pe;
    int i;

    *fresh = 0;
    for (i = ctx->npeers_static; i < ctx->npeers; i++) {
        if (ctx->peers[i].dyn && strcmp(ctx->peers[i].conf.id, id) == 0) {
            return i;
        }
    }
    *fresh = 1;
    for (i = ctx->npeers_static; i < ctx->npeers; i++) {
        pe = &ctx->peers[i];
        if (pe->retired && pe->out.fd < 0 && pe->out_state == KV_LINK_DOWN
            && pe->in_conn < 0 && !slot_referenced(ctx, i))
        {
            /* another id's slot: what it knew of that node goes */
            if (pe->pidfd >= 0) {
                close(pe->pidfd);
            }
            if (pe->old_pidfd >= 0) {
                close(pe->old_pidfd);
            }
            goto take;
        }
    }
    if (ctx->npeers == KV_MAX_PEERS) {
        return -1;
    }
    i = ctx->npeers++;
    pe = &ctx->peers[i];

take:
    memset(pe, 0, sizeof(*pe));
    pe->out.fd = -1;
    pe->in_conn = -1;
    pe->pidfd = pe->old_pidfd = -1;
    pe->dyn_addr = -1;
    pe->retired = 1;                   /* until the caller fills it */
    return i;
}


/* Another link with one of these keys: either end could claim the
 * other's id (config.c refuses the same among configured peers). */
static const char *
key_shared(kv_ctx_t *ctx, const kv_peer_conf_t *p, int self)
{
    int i, a, b;

    for (i = 0; i < ctx->npeers; i++) {
        if (i == self || ctx->peers[i].retired) {
            continue;
        }
        for (a = 0; a < p->nkeys; a++) {
            for (b = 0; b < ctx->peers[i].conf.nkeys; b++) {
                if (strcmp(p->kid[a], ctx->peers[i].conf.kid[b]) == 0) {
                    return ctx->peers[i].conf.id;
                }
            }
        }
    }
    return NULL;
}


/* The entry's key file for the link with id (which is safe: checked). */
static int
load_key(kv_ctx_t *ctx, int e, const char *id, kv_peer_conf_t *p,
    char *err, size_t elen)
{
    const kv_dns_conf_t *dc = &ctx->cfg.dns[e];
    const char *t = strstr(dc->key_file, KV_DNS_PEER_TOKEN);
    char path[KV_PATH_LEN + KV_ID_LEN];

    memset(p, 0, sizeof(*p));
    snprintf(p->id, sizeof(p->id), "%s", id);
    p->role = dc->role;
    snprintf(path, sizeof(path), "%.*s%s%s", (int) (t - dc->key_file),
             dc->key_file, id, t + strlen(KV_DNS_PEER_TOKEN));
    return kv_auth_key_file(p, path, err, elen);
}


/* Drop a discovered peer: links closed, transfers failed, node record
 * gone from the table; the slot retired. */
static void
drop_peer(kv_ctx_t *ctx, int i, const char *why)
{
    struct kv_pdns *d = ctx->pdns;
    kv_peer_t *pe = &ctx->peers[i];
    char msg[160];
    int a;

    kv_info("peers_dns: peer %s (%s) dropped: %s", pe->conf.id,
            pe->dyn_ip[0] ? pe->dyn_ip : "?", why);
    snprintf(msg, sizeof(msg), "peer %s left (%s)", pe->conf.id, why);
    a = pe->dyn_addr;
    pe->dyn_addr = -1;
    pe->retired = 1;                   /* no probe re-arm from link_down */
    if (pe->out_state != KV_LINK_DOWN || pe->out.fd >= 0) {
        kv_ctrl_link_down(ctx, i, msg);
    }
    if (pe->in_conn >= 0) {
        kv_client_close(ctx, pe->in_conn);
    }
    pe->in_conn = -1;
    kv_rreq_peer_down(ctx, i, msg);
    kv_push_peer_down(ctx, i, msg);
    pe->alive = 0;
    if (a >= 0 && d->addr[a].peer == i) {
        d->addr[a].peer = -1;
        if (d->addr[a].state == PA_LINKED) {
            d->addr[a].state = PA_IDLE;
            d->addr[a].next_ms = kv_now_ms() + ctx->cfg.reconnect_ms;
        }
    }
    if (pe->dyn_proven) {
        kv_state_node_remove(&ctx->st, pe->conf.id);
    }
    pe->dyn_proven = 0;
}


/* ---- probes ------------------------------------------------------------ */

static void
probe_reset(kv_ctx_t *ctx, kv_pdns_addr_t *a, int refused)
{
    uint64_t back;

    if (a->state == PA_CONNECTING || a->state == PA_CHALLENGE) {
        kv_conn_free(&a->conn);
    }
    a->conn.fd = -1;
    a->state = PA_IDLE;
    a->peer = -1;
    /* a refused claim is tried again later, not every reconnect_ms:
     * reconnect_ms doubling up to the name's resolve_ms */
    back = (uint64_t) ctx->cfg.reconnect_ms;
    if (refused) {
        a->refusals++;
        back <<= a->refusals < 10 ? a->refusals : 10;
        if (back > (uint64_t) ctx->cfg.dns[a->entry].resolve_ms) {
            back = (uint64_t) ctx->cfg.dns[a->entry].resolve_ms;
        }
    }
    a->next_ms = kv_now_ms() + back;
}


static void
probe_connect(kv_ctx_t *ctx, kv_pdns_addr_t *a)
{
    struct sockaddr_storage ss;
    struct sockaddr_in *s4 = (struct sockaddr_in *) &ss;
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *) &ss;
    socklen_t sl;
    int fd, one = 1;

    memset(&ss, 0, sizeof(ss));
    if (a->addr.family == AF_INET) {
        s4->sin_family = AF_INET;
        s4->sin_port = htons((uint16_t) a->addr.port);
        memcpy(&s4->sin_addr, a->addr.addr, 4);
        sl = sizeof(*s4);
    } else {
        s6->sin6_family = AF_INET6;
        s6->sin6_port = htons((uint16_t) a->addr.port);
        memcpy(&s6->sin6_addr, a->addr.addr, 16);
        s6->sin6_scope_id = a->addr.scope_id;
        sl = sizeof(*s6);
    }
    fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        kv_warn("peers_dns: socket: %s", strerror(errno));
        probe_reset(ctx, a, 1);
        return;
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    kv_ctrl_bind_source(ctx, fd, ss.ss_family);
    kv_conn_init(&a->conn, fd);
    a->state = PA_CONNECTING;
    a->deadline_ms = kv_now_ms() + ctx->cfg.hello_timeout_ms;
    if (connect(fd, (struct sockaddr *) &ss, sl) != 0
        && errno != EINPROGRESS)
    {
        kv_debug("peers_dns: %s: %s", a->hostport, strerror(errno));
        probe_reset(ctx, a, 0);
    }
}


/* The listener at a claims id in its challenge j: hand the connection to
 * the slot of that id if the claim may be tried; it is believed only
 * when the hello_ok's proof verifies (ctrl.c). */
static void
probe_claim(kv_ctx_t *ctx, int ai, cJSON *j)
{
    struct kv_pdns *d = ctx->pdns;
    kv_pdns_addr_t *a = &d->addr[ai];
    cJSON *jn = cJSON_GetObjectItemCaseSensitive(j, "node");
    kv_peer_conf_t pc;
    const char *id, *other;
    char err[256];
    kv_peer_t *pe;
    int i, fresh;

    if (!cJSON_IsString(jn)) {
        refuse_log(ctx, "%s: a listener that names no node%s%s",
                   a->hostport, "", "");
        probe_reset(ctx, a, 1);
        return;
    }
    id = jn->valuestring;
    if (!kv_peer_id_safe(id, strlen(id))) {
        refuse_log(ctx, "%s claims the id \"%.80s\", not a safe name "
                   "([A-Za-z0-9._-], no \"..\", under 64 bytes)%s",
                   a->hostport, id, "");
        probe_reset(ctx, a, 1);
        return;
    }
    if (strcmp(id, ctx->cfg.node_id) == 0) {
        kv_info("peers_dns: %s is this node; not linked", a->hostport);
        kv_conn_free(&a->conn);
        a->state = PA_SELF;
        return;
    }
    for (i = 0; i < ctx->npeers_static; i++) {
        if (strcmp(ctx->peers[i].conf.id, id) == 0) {
            refuse_log(ctx, "%s claims %s, a configured peer (at %s): "
                       "refused", a->hostport, id, ctx->peers[i].conf.ctrl);
            probe_reset(ctx, a, 1);
            return;
        }
    }
    for (i = ctx->npeers_static; i < ctx->npeers; i++) {
        pe = &ctx->peers[i];
        if (!pe->dyn || pe->retired || strcmp(pe->conf.id, id) != 0) {
            continue;
        }
        if (pe->out_state != KV_LINK_DOWN
            && (pe->dyn_addr != ai || pe->out.fd >= 0))
        {
            refuse_log(ctx, "%s claims %s, linked at %s: refused",
                       a->hostport, id, pe->dyn_addr >= 0
                       ? d->addr[pe->dyn_addr].hostport : pe->dyn_ip);
            probe_reset(ctx, a, 1);
            return;
        }
        if (entry_of(ctx, i) != a->entry
            && pe->conf.role != ctx->cfg.dns[a->entry].role)
        {
            refuse_log(ctx, "%s claims %s, found as another role: "
                       "refused%s", a->hostport, id, "");
            probe_reset(ctx, a, 1);
            return;
        }
    }
    if (load_key(ctx, a->entry, id, &pc, err, sizeof(err)) != 0) {
        refuse_log(ctx, "%s claims %s: no key for that link here: %s",
                   a->hostport, id, err);
        kv_auth_forget_peer(&pc);
        probe_reset(ctx, a, 1);
        return;
    }
    i = slot_for(ctx, id, &fresh);
    if (i < 0) {
        kv_auth_forget_peer(&pc);
        refuse_log(ctx, "%s (%s) not linked: at most %s peers in all "
                   "(KV_MAX_PEERS, configured ones included)", a->hostport,
                   id, "64");
        probe_reset(ctx, a, 1);
        return;
    }
    if ((other = key_shared(ctx, &pc, i)) != NULL) {
        refuse_log(ctx, "%s claims %s with the key of the link with %s: "
                   "each link needs its own key", a->hostport, id, other);
        kv_auth_forget_peer(&pc);
        if (fresh) {
            ctx->peers[i].retired = 1;
        }
        probe_reset(ctx, a, 1);
        return;
    }
    pe = &ctx->peers[i];
    snprintf(pc.ctrl, sizeof(pc.ctrl), "%s", a->hostport);
    if (fresh || pe->retired) {
        pe->dyn_proven = 0;
    }
    pe->conf = pc;
    kv_auth_forget_peer(&pc);
    pe->dyn = a->entry + 1;
    pe->retired = 0;
    a->state = PA_LINKED;
    a->peer = i;
    kv_debug("peers_dns: %s claims %s; proving", a->hostport, id);
    kv_ctrl_adopt(ctx, i, &a->conn, j);
    a->conn.fd = -1;
}


static void
probe_read(kv_ctx_t *ctx, int ai)
{
    kv_pdns_addr_t *a = &ctx->pdns->addr[ai];
    const char *why = NULL;
    uint32_t len;
    char *msg;
    cJSON *j, *t;
    int rc;

    rc = kv_conn_read(&a->conn, KV_HELLO_MAX, 0, &msg, &len, &why);
    if (rc == 0) {
        return;
    }
    if (rc < 0) {
        kv_debug("peers_dns: %s: %s", a->hostport, why ? why : "closed");
        probe_reset(ctx, a, rc == -2);
        return;
    }
    j = cJSON_ParseWithLength(msg, len);
    kv_conn_consume(&a->conn, len);
    t = j ? cJSON_GetObjectItemCaseSensitive(j, "type") : NULL;
    if (!cJSON_IsString(t) || strcmp(t->valuestring, "challenge") != 0) {
        refuse_log(ctx, "%s: the listener's first message is not a "
                   "challenge%s%s", a->hostport, "", "");
        probe_reset(ctx, a, 1);
    } else {
        probe_claim(ctx, ai, j);
    }
    cJSON_Delete(j);
}


void
kv_pdns_event(kv_ctx_t *ctx, int i, short revents)
{
    kv_pdns_addr_t *a;
    int soerr = 0;
    socklen_t sl = sizeof(soerr);

    if (ctx->pdns == NULL || i < 0 || i >= KV_PDNS_MAX_ADDRS) {
        return;
    }
    a = &ctx->pdns->addr[i];
    if (a->state == PA_CONNECTING) {
        if (!(revents & (POLLOUT | POLLERR | POLLHUP))) {
            return;
        }
        if (getsockopt(a->conn.fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0
            || soerr != 0)
        {
            kv_debug("peers_dns: %s: %s", a->hostport,
                     strerror(soerr ? soerr : errno));
            probe_reset(ctx, a, 0);
            return;
        }
        a->state = PA_CHALLENGE;       /* the listener speaks first */
        return;
    }
    if (a->state == PA_CHALLENGE && (revents & (POLLIN | POLLERR | POLLHUP)))
    {
        probe_read(ctx, i);
    }
}


int
kv_pdns_pollfds(kv_ctx_t *ctx, struct pollfd *pfd, int *who, int base)
{
    struct kv_pdns *d = ctx->pdns;
    int i, n = 0;

    if (d == NULL) {
        return 0;
    }
    for (i = 0; i < KV_PDNS_MAX_ADDRS; i++) {
        if (d->addr[i].state != PA_CONNECTING
            && d->addr[i].state != PA_CHALLENGE)
        {
            continue;
        }
        pfd[n].fd = d->addr[i].conn.fd;
        pfd[n].events = d->addr[i].state == PA_CONNECTING ? POLLOUT : POLLIN;
        pfd[n].revents = 0;
        who[n++] = base - i;
    }
    return n;
}


/* ---- answers ------------------------------------------------------------ */

static int
in_answer(const kv_res_result_t *res, const char *ip)
{
    char buf[64];
    uint32_t k;

    for (k = 0; k < res->naddrs; k++) {
        ip_of(&res->addrs[k], buf, sizeof(buf));
        if (strcmp(buf, ip) == 0) {
            return 1;
        }
    }
    return 0;
}


static void
on_answer(void *data, const kv_res_result_t *res)
{
    kv_ctx_t *ctx = data;
    struct kv_pdns *d = ctx->pdns;
    const kv_dns_conf_t *dc;
    kv_pdns_addr_t *a;
    char ip[64];
    uint32_t k;
    int e, i, f, added = 0, full = 0;

    for (e = 0; e < ctx->cfg.ndns && d->res_id[e] != res->id; e++) {
    }
    if (e == ctx->cfg.ndns) {
        return;
    }
    dc = &ctx->cfg.dns[e];
    d->res_id[e] = 0;
    if (res->status != KV_RES_OK && res->status != EAI_NONAME
#ifdef EAI_NODATA
        && res->status != EAI_NODATA
#endif
       )
    {
        /* no answer is not an empty pool: keep what we have */
        if (!d->failing[e]++) {
            kv_warn("peers_dns: cannot resolve %s: %s; keeping the %s "
                    "peers found so far", dc->name, res->error,
                    dpd_state_role_name(dc->role));
        }
        return;
    }
    if (d->failing[e]) {
        kv_info("peers_dns: %s resolves again", dc->name);
        d->failing[e] = 0;
    }
    if (res->total > res->naddrs) {
        kv_warn("peers_dns: %s has %u addresses; following the lowest %u",
                dc->name, res->total, res->naddrs);
    }
    /* forget what is gone */
    for (i = 0; i < KV_PDNS_MAX_ADDRS; i++) {
        a = &d->addr[i];
        if (a->state == PA_FREE || a->entry != e) {
            continue;
        }
        if (in_answer(res, a->ip)) {
            a->missing = 0;
            continue;
        }
        if (++a->missing < KV_PDNS_DROP_AFTER) {
            continue;
        }
        kv_info("peers_dns: %s is gone from %s", a->hostport, dc->name);
        if (a->peer >= 0 && a->state == PA_LINKED
            && ctx->peers[a->peer].dyn_addr != i)
        {
            /* still proving a claim through it */
            kv_ctrl_link_down(ctx, a->peer, "its address left the DNS");
        }
        if (a->state == PA_CONNECTING || a->state == PA_CHALLENGE) {
            kv_conn_free(&a->conn);
        }
        for (f = ctx->npeers_static; f < ctx->npeers; f++) {
            if (ctx->peers[f].dyn_addr == i) {
                ctx->peers[f].dyn_addr = -1;
            }
        }
        memset(a, 0, sizeof(*a));
        a->conn.fd = -1;
    }
    for (i = ctx->npeers_static; i < ctx->npeers; i++) {
        kv_peer_t *pe = &ctx->peers[i];
        if (!pe->dyn || pe->retired || entry_of(ctx, i) != e) {
            continue;
        }
        if (pe->dyn_ip[0] && in_answer(res, pe->dyn_ip)) {
            pe->dyn_missing = 0;
        } else if (pe->dyn_proven
                   && ++pe->dyn_missing >= KV_PDNS_DROP_AFTER)
        {
            drop_peer(ctx, i, "its address left the DNS answers");
        }
    }
    /* follow what is new */
    for (k = 0; k < res->naddrs; k++) {
        ip_of(&res->addrs[k], ip, sizeof(ip));
        for (i = 0; i < KV_PDNS_MAX_ADDRS; i++) {
            if (d->addr[i].state != PA_FREE && d->addr[i].entry == e
                && strcmp(d->addr[i].ip, ip) == 0)
            {
                break;
            }
        }
        if (i < KV_PDNS_MAX_ADDRS) {
            continue;
        }
        for (i = 0; i < KV_PDNS_MAX_ADDRS && d->addr[i].state != PA_FREE;
             i++)
        {
        }
        if (i == KV_PDNS_MAX_ADDRS) {
            full++;
            continue;
        }
        a = &d->addr[i];
        memset(a, 0, sizeof(*a));
        a->conn.fd = -1;
        a->entry = e;
        a->addr = res->addrs[k];
        a->addr.port = dc->port;
        a->peer = -1;
        snprintf(a->ip, sizeof(a->ip), "%s", ip);
        if (kv_res_addr_str(&a->addr, 1, a->hostport, sizeof(a->hostport))
            < 0)
        {
            snprintf(a->hostport, sizeof(a->hostport), "%s", ip);
        }
        a->state = is_self(d, a) ? PA_SELF : PA_IDLE;
        a->next_ms = 0;
        added++;
    }
    if (full) {
        kv_warn("peers_dns: %s: %d address(es) not followed: at most %d "
                "addresses in all", dc->name, full, KV_PDNS_MAX_ADDRS);
    }
    if (added) {
        kv_info("peers_dns: %s: %d new address(es) of %u", dc->name, added,
                res->naddrs);
    }
}


void
kv_pdns_tick(kv_ctx_t *ctx, uint64_t now)
{
    struct kv_pdns *d = ctx->pdns;
    kv_pdns_addr_t *a;
    int e, i;

    if (d == NULL) {
        return;
    }
    for (e = 0; e < ctx->cfg.ndns; e++) {
        if (d->res_id[e] || now < d->next_ms[e]) {
            continue;
        }
        d->next_ms[e] = now + ctx->cfg.dns[e].resolve_ms;
        d->started_ms[e] = now;
        d->res_id[e] = kv_res_start(ctx->res, ctx->cfg.dns[e].name,
                                    ctx->cfg.dns[e].port, AF_UNSPEC,
                                    on_answer, ctx);
        if (d->res_id[e] == 0 && kv_log_limit(&d->warn)) {
            kv_warn("peers_dns: cannot start resolving %s: %s",
                    ctx->cfg.dns[e].name, strerror(errno));
        }
    }
    for (i = 0; i < KV_PDNS_MAX_ADDRS; i++) {
        a = &d->addr[i];
        if (a->state == PA_IDLE && now >= a->next_ms) {
            probe_connect(ctx, a);
        } else if ((a->state == PA_CONNECTING || a->state == PA_CHALLENGE)
                   && now > a->deadline_ms)
        {
            kv_debug("peers_dns: %s: no challenge within hello_timeout_ms",
                     a->hostport);
            probe_reset(ctx, a, 1);
        }
    }
    /* inbound-only peers no answer ever named, and claims that failed */
    for (i = ctx->npeers_static; i < ctx->npeers; i++) {
        kv_peer_t *pe = &ctx->peers[i];
        if (pe->dyn && !pe->retired && !pe->dyn_proven
            && pe->out_state == KV_LINK_DOWN && pe->in_conn < 0)
        {
            pe->retired = 1;
            kv_auth_forget_peer(&pe->conf);
        }
    }
}


/* ---- link events from ctrl.c --------------------------------------------- */

void
kv_pdns_link_down(kv_ctx_t *ctx, int peer)
{
    struct kv_pdns *d = ctx->pdns;
    kv_peer_t *pe = &ctx->peers[peer];
    int i;

    if (d == NULL) {
        return;
    }
    /* the address it was being linked through is probed again (a pod's
     * address may now be another pod's: the claim is read anew) */
    for (i = 0; i < KV_PDNS_MAX_ADDRS; i++) {
        if (d->addr[i].state == PA_LINKED && d->addr[i].peer == peer) {
            d->addr[i].state = PA_IDLE;
            d->addr[i].peer = -1;
            d->addr[i].next_ms = kv_now_ms()
                                 + (pe->dyn_proven ? ctx->cfg.reconnect_ms
                                    : ctx->cfg.dns[d->addr[i].entry]
                                      .resolve_ms);
            if (!pe->dyn_proven || pe->dyn_addr != i) {
                d->addr[i].refusals++;
            }
        }
    }
}


void
kv_pdns_link_up(kv_ctx_t *ctx, int peer)
{
    struct kv_pdns *d = ctx->pdns;
    kv_peer_t *pe = &ctx->peers[peer];
    int i;

    if (d == NULL || !pe->dyn) {
        return;
    }
    for (i = 0; i < KV_PDNS_MAX_ADDRS; i++) {
        if (d->addr[i].state == PA_LINKED && d->addr[i].peer == peer) {
            break;
        }
    }
    if (i == KV_PDNS_MAX_ADDRS) {
        return;
    }
    if (!pe->dyn_proven) {
        kv_info("peers_dns: %s at %s proved its id (%s)", pe->conf.id,
                d->addr[i].hostport,
                dpd_state_role_name(pe->conf.role));
    }
    pe->dyn_proven = 1;
    pe->dyn_addr = i;
    pe->dyn_missing = 0;
    d->addr[i].refusals = 0;
    snprintf(pe->dyn_ip, sizeof(pe->dyn_ip), "%s", d->addr[i].ip);
}


/* Where an inbound connection comes from, as answers write it. */
static void
client_ip(kv_ctx_t *ctx, int client, char *out, size_t len)
{
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *) &ss;
    struct sockaddr_in *s4 = (struct sockaddr_in *) &ss;

    out[0] = '\0';
    if (getpeername(ctx->clients[client].conn.fd, (struct sockaddr *) &ss,
                    &sl) != 0)
    {
        return;
    }
    if (ss.ss_family == AF_INET) {
        inet_ntop(AF_INET, &s4->sin_addr, out, len);
    } else if (ss.ss_family == AF_INET6) {
        if (IN6_IS_ADDR_V4MAPPED(&s6->sin6_addr)) {
            inet_ntop(AF_INET, &s6->sin6_addr.s6_addr[12], out, len);
        } else {
            inet_ntop(AF_INET6, &s6->sin6_addr, out, len);
        }
    }
}


int
kv_pdns_inbound(kv_ctx_t *ctx, int client, const char *id, const char *kid,
    const uint8_t nc[KV_NONCE_LEN], const uint8_t ns[KV_NONCE_LEN],
    const uint8_t proof[KV_MAC_LEN], char *err, size_t elen)
{
    uint8_t want[KV_MAC_LEN];
    kv_peer_conf_t pc;
    const char *other;
    char kerr[256], ip[64];
    int e, k, i, fresh, tried = 0;

    if (ctx->pdns == NULL) {
        snprintf(err, elen, "node %.64s is not an allowed peer", id);
        return -1;
    }
    if (!kv_peer_id_safe(id, strlen(id))) {
        snprintf(err, elen, "a hello claims the id \"%.80s\", not a safe "
                 "name ([A-Za-z0-9._-], no \"..\", under 64 bytes)", id);
        return -1;
    }
    if (strcmp(id, ctx->cfg.node_id) == 0) {
        snprintf(err, elen, "a hello claims this node's own id");
        return -1;
    }
    kerr[0] = '\0';
    for (e = 0; e < ctx->cfg.ndns; e++) {
        if (load_key(ctx, e, id, &pc, kerr, sizeof(kerr)) != 0) {
            continue;
        }
        tried++;
        for (k = 0; k < pc.nkeys; k++) {
            if (strcmp(pc.kid[k], kid) == 0
                && kv_auth_proof(pc.key[k], pc.keylen[k], KV_AUTH_CLIENT,
                                 id, pc.role, ctx->cfg.node_id,
                                 ctx->cfg.role, nc, ns, pc.kid[k], want) == 0
                && kv_auth_equal(want, proof, KV_MAC_LEN))
            {
                goto proven;
            }
        }
        kv_auth_forget_peer(&pc);
    }
    if (tried) {
        snprintf(err, elen, "node %.64s did not prove the key of its link "
                 "(peers_dns key_file)", id);
    } else {
        snprintf(err, elen, "node %.64s is not an allowed peer (not "
                 "configured; peers_dns: %.160s)", id,
                 kerr[0] ? kerr : "no key");
    }
    return -1;

proven:
    /* the key says who it is, the answers whether it is in the pool: a
     * node no answer lists (any more) is not linked, however it proves
     * its id; if it just came up, the name is looked up again now (at
     * most once a second) and its next try gets in */
    client_ip(ctx, client, ip, sizeof(ip));
    for (i = 0; i < KV_PDNS_MAX_ADDRS; i++) {
        kv_pdns_addr_t *a = &ctx->pdns->addr[i];
        if (a->state != PA_FREE && a->entry == e && a->missing == 0
            && strcmp(a->ip, ip) == 0)
        {
            break;
        }
    }
    if (i == KV_PDNS_MAX_ADDRS) {
        kv_auth_forget_peer(&pc);
        if (ctx->pdns->res_id[e] == 0
            && kv_now_ms() >= ctx->pdns->started_ms[e] + 1000)
        {
            ctx->pdns->next_ms[e] = 0;
        }
        snprintf(err, elen, "node %.64s proved its key, but %s is not in "
                 "the answers for %s (yet): refused", id, ip,
                 ctx->cfg.dns[e].name);
        return -1;
    }
    i = slot_for(ctx, id, &fresh);
    if (i < 0) {
        kv_auth_forget_peer(&pc);
        snprintf(err, elen, "node %.64s not linked: at most %d peers in "
                 "all (KV_MAX_PEERS, configured ones included)", id,
                 KV_MAX_PEERS);
        return -1;
    }
    if (!fresh && !ctx->peers[i].retired
        && ctx->peers[i].conf.role != pc.role)
    {
        kv_auth_forget_peer(&pc);
        snprintf(err, elen, "node %.64s is linked as another role", id);
        return -1;
    }
    if ((other = key_shared(ctx, &pc, i)) != NULL) {
        kv_auth_forget_peer(&pc);
        snprintf(err, elen, "node %.64s proves the key of the link with "
                 "%.64s: each link needs its own key", id, other);
        if (fresh) {
            ctx->peers[i].retired = 1;
        }
        return -1;
    }
    if (fresh || ctx->peers[i].retired) {
        ctx->peers[i].dyn_addr = -1;
        ctx->peers[i].out_state = KV_LINK_DOWN;
        pc.ctrl[0] = '\0';
        ctx->peers[i].conf = pc;
        ctx->peers[i].dyn = e + 1;
        snprintf(ctx->peers[i].dyn_ip, sizeof(ctx->peers[i].dyn_ip), "%s",
                 ip);
        kv_info("peers_dns: %s (%s) connected first from %s; proven by its "
                "key", id, dpd_state_role_name(pc.role), ip);
    }
    kv_auth_forget_peer(&pc);
    ctx->peers[i].retired = 0;
    ctx->peers[i].dyn_proven = 1;
    ctx->peers[i].dyn_missing = 0;
    return i;
}
