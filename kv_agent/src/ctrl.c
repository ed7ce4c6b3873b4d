/*
 * ctrl.c - the control channel between agents: framed JSON over TCP.
 *
 * Every agent connects out to every configured peer (reconnecting while it
 * is away) and accepts their connections.  The outbound link carries our
 * hello, heartbeats, request events and push_begin; the inbound one their
 * replies come back on.
 *
 * Handshake (auth.c has the proofs):
 *   listener -> connector  challenge {node, nonce_s}
 *   connector -> listener  hello {node, peer, nonce_c, key_id, proof_c}
 *   listener -> connector  hello_ok {node, proof_s, rails, pool}
 * Only configured peer ids are accepted, each with its own link key; the
 * connector believes nothing in hello_ok before proof_s verifies.  Fabric
 * addresses go to prefill and decode peers, the pool's MR key and base
 * address only from a decode node to an authenticated prefill peer (the
 * only role that writes into it); routers get neither.
 */

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "kv.h"
#include "resolve.h"

#define KV_CTRL_VERSION 2

static void hs_fail(kv_ctx_t *ctx, int peer, const char *why);
static void out_challenge(kv_ctx_t *ctx, int peer, cJSON *j);

int kv_fault_short_addr;               /* tests: advertise a cut address */


/* Which kernel and pid namespace we run in: a peer reporting the same
 * one runs on this host and its pid means the same process here. */
static const char *
host_id(void)
{
    static char id[128];
    char boot[64] = "", ns[48] = "";
    FILE *f;
    ssize_t n;

    if (id[0]) {
        return id;
    }
    f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (fgets(boot, sizeof(boot), f) == NULL) {
            boot[0] = '\0';
        }
        fclose(f);
        boot[strcspn(boot, "\n")] = '\0';
    }
    n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
    ns[n > 0 ? n : 0] = '\0';
    snprintf(id, sizeof(id), "%s/%s", boot[0] ? boot : "?",
             ns[0] ? ns : "?");
    return id;
}


/* Our incarnation, pid and host, in both hellos: learn_identity() on the
 * other side. */
static void
add_identity(kv_ctx_t *ctx, cJSON *j)
{
    char num[32];

    snprintf(num, sizeof(num), "%llu", (unsigned long long) ctx->inst);
    cJSON_AddStringToObject(j, "inst", num);
    cJSON_AddNumberToObject(j, "pid", (double) getpid());
    cJSON_AddStringToObject(j, "host", host_id());
}


/* The vLLM address the peer announces (its "http", "${POD_IP}:8000" in a
 * pod): host:port of printable bytes, else none.  Only called once the
 * hello's proof verified; it names where nginx finds that node, never who
 * the node is (the id is the link's, bound by the key). */
static void
learn_http(kv_peer_t *pe, cJSON *j)
{
    cJSON *jv = cJSON_GetObjectItemCaseSensitive(j, "http");
    char host[KV_ADDR_LEN];
    const char *s;
    int port;

    pe->http_seen[0] = '\0';
    if (!cJSON_IsString(jv) || strlen(jv->valuestring) >= KV_ADDR_LEN) {
        return;
    }
    for (s = jv->valuestring; *s; s++) {
        if ((unsigned char) *s <= 0x20 || (unsigned char) *s >= 0x7f) {
            return;
        }
    }
    if (kv_parse_hostport(jv->valuestring, host, sizeof(host), &port) != 0) {
        return;
    }
    strcpy(pe->http_seen, jv->valuestring);
}


/* The peer's incarnation (a random number per process) and, on this
 * host, a pidfd of its process: an aborted push's blocks are freed when
 * that process is gone (xfer.c). */
static void
learn_identity(kv_ctx_t *ctx, kv_peer_t *pe, cJSON *j)
{
    cJSON *ji = cJSON_GetObjectItemCaseSensitive(j, "inst");
    cJSON *jp = cJSON_GetObjectItemCaseSensitive(j, "pid");
    cJSON *jh = cJSON_GetObjectItemCaseSensitive(j, "host");
    uint64_t inst;

    learn_http(pe, j);

    if (!cJSON_IsString(ji)
        || (inst = strtoull(ji->valuestring, NULL, 10)) == 0
        || inst == pe->inst)
    {
        return;
    }
    if (pe->old_pidfd >= 0) {
        close(pe->old_pidfd);
    }
    pe->old_inst = pe->inst;
    pe->old_pidfd = pe->pidfd;
    pe->old_pid = pe->pid;
    pe->old_pid_start = pe->pid_start;
    pe->inst = inst;
    pe->pidfd = -1;
    pe->pid = 0;
    pe->pid_start = 0;
    if (!cJSON_IsNumber(jp) || jp->valuedouble < 1
        || jp->valuedouble >= 4194305.0 || !cJSON_IsString(jh)
        || strcmp(jh->valuestring, host_id()) != 0)
    {
        return;                        /* another host */
    }
    pe->pid = (int) jp->valuedouble;
#ifdef SYS_pidfd_open
    pe->pidfd = (int) syscall(SYS_pidfd_open, (pid_t) pe->pid, 0);
    if (pe->pidfd >= 0) {
        fcntl(pe->pidfd, F_SETFD, FD_CLOEXEC);
    }
#endif
    /* without pidfd_open (old kernel, valgrind): pid + start time */
    pe->pid_start = kv_proc_start(pe->pid);
    (void) ctx;
}


/* A process's start time (/proc/PID/stat field 22); 0 when it is gone
 * or a zombie.  With the pid it names one process for good. */
uint64_t
kv_proc_start(int pid)
{
    char path[64], buf[1024], *p;
    unsigned long long st = 0;
    size_t n;
    FILE *f;
    int i;

    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    f = fopen(path, "r");
    if (f == NULL) {
        return 0;
    }
    n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    p = strrchr(buf, ')');            /* the name may hold spaces */
    if (p == NULL || p[1] != ' ' || p[2] == 'Z' || p[2] == 'X') {
        return 0;
    }
    p += 2;
    for (i = 3; i < 22 && p; i++) {   /* p is at field 3 (state) */
        p = strchr(p, ' ');
        p = p ? p + 1 : NULL;
    }
    if (p == NULL || sscanf(p, "%llu", &st) != 1) {
        return 0;
    }
    return st ? st : 1;
}


static int
resolve(const char *hostport, struct addrinfo **res, int passive)
{
    struct addrinfo hints;
    char host[KV_ADDR_LEN], port[16];
    int p;

    if (kv_parse_hostport(hostport, host, sizeof(host), &p) != 0) {
        return -1;
    }
    snprintf(port, sizeof(port), "%d", p);
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
    return getaddrinfo(host, port, &hints, res) == 0 ? 0 : -1;
}


int
kv_ctrl_listen(kv_ctx_t *ctx)
{
    struct addrinfo *res;
    int fd, one = 1;

    if (resolve(ctx->cfg.listen, &res, 1) != 0) {
        kv_err("ctrl: cannot resolve listen address %s", ctx->cfg.listen);
        return -1;
    }
    fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC,
                0);
    if (fd < 0
        || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0
        || bind(fd, res->ai_addr, res->ai_addrlen) != 0
        || listen(fd, SOMAXCONN) != 0)
    {
        kv_err("ctrl: cannot listen on %s: %s", ctx->cfg.listen,
               strerror(errno));
        if (fd >= 0) {
            close(fd);
        }
        freeaddrinfo(res);
        return -1;
    }
    freeaddrinfo(res);
    ctx->ctrl_lfd = fd;
    kv_info("ctrl: listening on %s", ctx->cfg.listen);
    return 0;
}


int
kv_ctrl_peer_find(kv_ctx_t *ctx, const char *id)
{
    int i;

    for (i = 0; i < ctx->npeers; i++) {
        if (kv_peer_visible(&ctx->peers[i])
            && strcmp(ctx->peers[i].conf.id, id) == 0)
        {
            return i;
        }
    }
    return -1;
}


static uint32_t
inflight_count(kv_ctx_t *ctx)
{
    uint32_t i, n = 0;

    for (i = 0; ctx->push && i < ctx->npush; i++) {
        int s = ctx->push[i].state;
        n += (s == KV_PUSH_BEGIN || s == KV_PUSH_WRITING
              || s == KV_PUSH_FLUSH);
    }
    for (i = 0; ctx->rreq && i < ctx->nrreq; i++) {
        n += ctx->rreq[i].used
             && ctx->rreq[i].state == DPD_REQ_TRANSFERRING;
    }
    return n;
}


/* Our part of hello_ok for an authenticated peer: fabric addresses for the
 * nodes that move KV, the pool's key and base only for a prefill peer of a
 * decode node, geometry for everyone (routers size their records). */
static cJSON *
hello_ok_json(kv_ctx_t *ctx, int peer, const uint8_t proof[KV_MAC_LEN])
{
    cJSON *j = cJSON_CreateObject(), *rails, *o, *g, *a, *b;
    char hex[2 * KV_FABADDR_LEN + 1], num[32];
    uint32_t prole = ctx->peers[peer].conf.role;
    int i, k, ri, give_addr, give_key, nreg = 0;
    kv_pool_t *p0 = KV_POOL(ctx, 0);
    kv_rail_t *r;

    for (i = 0; i < ctx->nranks; i++) {
        nreg += KV_POOL(ctx, i)->registered;
    }
    give_addr = prole == DPD_ROLE_PREFILL || prole == DPD_ROLE_DECODE;
    give_key = give_addr && prole == DPD_ROLE_PREFILL
               && ctx->cfg.role == DPD_ROLE_DECODE && nreg > 0;
    cJSON_AddStringToObject(j, "type", "hello_ok");
    cJSON_AddNumberToObject(j, "version", KV_CTRL_VERSION);
    cJSON_AddStringToObject(j, "node", ctx->cfg.node_id);
    kv_hex_encode(proof, KV_MAC_LEN, hex);
    cJSON_AddStringToObject(j, "proof", hex);
    cJSON_AddStringToObject(j, "role", dpd_state_role_name(ctx->cfg.role));
    cJSON_AddStringToObject(j, "http", ctx->cfg.http);
    add_identity(ctx, j);
    rails = cJSON_AddArrayToObject(j, "rails");
    for (i = 0; give_addr && ctx->fab_ok && i < ctx->fab.nrails; i++) {
        r = &ctx->fab.rail[i];
        o = cJSON_CreateObject();
        kv_hex_encode(r->addr, r->addrlen - (kv_fault_short_addr
                                             && r->addrlen > 1), hex);
        cJSON_AddStringToObject(o, "addr", hex);
        cJSON_AddStringToObject(o, "provider",
                                r->info->fabric_attr->prov_name);
        if (give_key && p0->registered && p0->mr[i]) {
            /* rank 0's key on this rail (keys and addresses are 64-bit:
             * strings keep them exact) */
            snprintf(num, sizeof(num), "%llu",
                     (unsigned long long) p0->key[i]);
            cJSON_AddStringToObject(o, "key", num);
            snprintf(num, sizeof(num), "%llu", (unsigned long long)
                     kv_rail_raddr(r, p0->fab_base, 0));
            cJSON_AddStringToObject(o, "base", num);
        }
        cJSON_AddItemToArray(rails, o);
    }
    if (give_addr && ctx->fab_ok && ctx->cfg.has_pool) {
        /* which of those rails serve each rank, and (to a prefill peer of
         * a decode node) each rank's key and base on them */
        a = cJSON_AddArrayToObject(j, "rank_rails");
        b = give_key ? cJSON_AddArrayToObject(j, "rank_keys") : NULL;
        for (i = 0; i < ctx->nranks; i++) {
            kv_pool_t *p = KV_POOL(ctx, i);
            cJSON *ra = cJSON_CreateArray(), *rk = NULL;
            if (b) {
                rk = cJSON_CreateArray();
            }
            for (k = 0; k < ctx->topo.nrails[i]; k++) {
                ri = ctx->topo.rail[i][k];
                cJSON_AddItemToArray(ra, cJSON_CreateNumber(ri));
                if (rk && p->registered && p->mr[ri]) {
                    o = cJSON_CreateObject();
                    cJSON_AddNumberToObject(o, "rail", ri);
                    snprintf(num, sizeof(num), "%llu",
                             (unsigned long long) p->key[ri]);
                    cJSON_AddStringToObject(o, "key", num);
                    snprintf(num, sizeof(num), "%llu", (unsigned long long)
                             kv_rail_raddr(&ctx->fab.rail[ri], p->fab_base,
                                           0));
                    cJSON_AddStringToObject(o, "base", num);
                    cJSON_AddItemToArray(rk, o);
                }
            }
            cJSON_AddItemToArray(a, ra);
            if (rk) {
                cJSON_AddItemToArray(b, rk);
            }
        }
    }
    for (i = 0; give_key && ctx->fab_ok && i < ctx->nranks
                && !ctx->rring[i]; i++) {
    }
    if (give_key && ctx->fab_ok && ctx->cfg.has_pool && i < ctx->nranks) {
        /* staged ranks land writes in a ring of slots we grant (their
         * keys above are the ring's): a sender must follow credits */
        kv_rring_t *rg = ctx->rring[i];
        g = cJSON_AddObjectToObject(j, "ring");
        cJSON_AddNumberToObject(g, "version", KV_RING_PROTO);
        cJSON_AddNumberToObject(g, "slots", rg->nslots);
        cJSON_AddNumberToObject(g, "chunk", (double) rg->chunk);
        a = cJSON_AddArrayToObject(g, "ranks");
        for (i = 0; i < ctx->nranks; i++) {
            cJSON_AddItemToArray(a, cJSON_CreateBool(ctx->rring[i] != NULL));
        }
    }
    if (ctx->cfg.has_pool) {
        g = cJSON_AddObjectToObject(j, "pool");
        kv_layout_json(g, &ctx->cfg.layout);
        cJSON_AddNumberToObject(g, "ranks", ctx->nranks);
        cJSON_AddNumberToObject(g, "ranks_registered", nreg);
    }
    return j;
}


static int
get_hex(cJSON *j, const char *k, uint8_t *out, size_t len)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(j, k);
    size_t n;

    return cJSON_IsString(v) && strlen(v->valuestring) == 2 * len
           && kv_hex_decode(v->valuestring, out, len, &n) == 0 && n == len
           ? 0 : -1;
}


static void
av_forget(kv_ctx_t *ctx, kv_peer_t *pe)
{
    int i, k;

    for (i = 0; i < KV_MAX_RAILS; i++) {
        for (k = 0; k < KV_MAX_RAILS; k++) {
            if (pe->remote.av_ok[i][k] && ctx->fab_ok
                && i < ctx->fab.nrails)
            {
                fi_av_remove(ctx->fab.rail[i].av, &pe->remote.fiaddr[i][k],
                             1, 0);
            }
            pe->remote.av_ok[i][k] = 0;
        }
    }
    pe->remote.nrails = 0;
    pe->remote.nranks = 0;
    pe->remote.has_pool = 0;
}


/* fi_av_insert reads as many bytes as the provider's address format
 * has: a shorter (or longer) blob from a peer is refused, not read past. */
static int
addr_len_check(kv_rail_t *r, const uint8_t *blob, size_t n, char *err,
    size_t elen)
{
    size_t want = r->info->src_addrlen ? r->info->src_addrlen : r->addrlen;

    if (r->info->addr_format == FI_ADDR_STR) {
        /* a string: variable length, NUL-terminated within the blob */
        if (n == 0 || n > FI_NAME_MAX || memchr(blob, '\0', n) == NULL) {
            snprintf(err, elen, "fabric address of rail %d is not a "
                     "terminated %s address (%zu bytes)", r->index,
                     r->info->fabric_attr->prov_name, n);
            return -1;
        }
        return 0;
    }
    if (n != want) {
        snprintf(err, elen, "fabric address of rail %d is %zu bytes, "
                 "provider %s uses %zu", r->index, n,
                 r->info->fabric_attr->prov_name, want);
        return -1;
    }
    return 0;
}


/* Our rail l's AV gets the peer's rail k (once). */
static int
av_pair(kv_ctx_t *ctx, kv_peer_t *pe, int l, int k, uint8_t blobs[][KV_FABADDR_LEN],
    const size_t *lens, char *err, size_t elen)
{
    if (pe->remote.av_ok[l][k]) {
        return 0;
    }
    if (addr_len_check(&ctx->fab.rail[l], blobs[k], lens[k], err, elen)
        != 0)
    {
        return -1;
    }
    if (fi_av_insert(ctx->fab.rail[l].av, blobs[k], 1,
                     &pe->remote.fiaddr[l][k], 0, NULL) != 1)
    {
        snprintf(err, elen, "fi_av_insert failed for rail %d", k);
        return -1;
    }
    pe->remote.av_ok[l][k] = 1;
    return 0;
}


static int
json_u64(cJSON *o, const char *k, uint64_t *out)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);

    if (!cJSON_IsString(v)) {
        return -1;
    }
    *out = strtoull(v->valuestring, NULL, 10);
    return 0;
}


/* Learn a peer's rails, its ranks' rails and keys, and its pool from its
 * hello_ok.  Writes of rank r go from our rails of rank r to its rails of
 * rank r: those pairs (and rail 0 to rail 0, for the trailing message)
 * enter our AVs. */
static int
learn_remote(kv_ctx_t *ctx, kv_peer_t *pe, cJSON *j, char *err, size_t elen)
{
    static uint8_t blobs[KV_MAX_RAILS][KV_FABADDR_LEN];
    cJSON *rails = cJSON_GetObjectItemCaseSensitive(j, "rails"), *o, *a;
    cJSON *g = cJSON_GetObjectItemCaseSensitive(j, "pool");
    cJSON *jrr = cJSON_GetObjectItemCaseSensitive(j, "rank_rails");
    cJSON *jrk = cJSON_GetObjectItemCaseSensitive(j, "rank_keys");
    cJSON *jring = cJSON_GetObjectItemCaseSensitive(j, "ring");
    kv_remote_t *rm = &pe->remote;
    size_t lens[KV_MAX_RAILS];
    uint8_t haskey[KV_MAX_RANKS][KV_MAX_RAILS];
    int i = 0, r, k, l, nr, nranks = 1, nreg = 1, complete;
    kv_layout_t lay;
    size_t n;

    av_forget(ctx, pe);
    memset(&lay, 0, sizeof(lay));
    memset(haskey, 0, sizeof(haskey));
    if (cJSON_IsObject(g)) {
        cJSON *f;
#define GEO(name, field) \
        f = cJSON_GetObjectItemCaseSensitive(g, name); \
        if (!cJSON_IsNumber(f) || f->valuedouble < 0) { \
            snprintf(err, elen, "bad pool geometry (%s)", name); \
            return -1; \
        } \
        lay.field = f->valuedouble;
        GEO("layers", layers)
        GEO("regions", regions)
        GEO("blocks", nblocks)
        GEO("block_bytes", block_bytes)
        GEO("block_stride", block_stride)
        GEO("region_stride", region_stride)
        GEO("layer_stride", layer_stride)
#undef GEO
        if (kv_layout_finish(&lay, err, elen) != 0) {
            return -1;
        }
        rm->layout = lay;
        f = cJSON_GetObjectItemCaseSensitive(g, "ranks");
        if (f) {
            if (!cJSON_IsNumber(f) || f->valuedouble < 1
                || f->valuedouble > KV_MAX_RANKS)
            {
                snprintf(err, elen, "bad pool geometry (ranks)");
                return -1;
            }
            nranks = (int) f->valuedouble;
            nreg = nranks;
        }
        f = cJSON_GetObjectItemCaseSensitive(g, "ranks_registered");
        if (cJSON_IsNumber(f)) {
            nreg = (int) f->valuedouble;
        }
    }
    rm->nranks = nranks;
    rm->ring_slots = 0;
    rm->ring_chunk = 0;
    memset(rm->ring, 0, sizeof(rm->ring));
    if (jring) {
        cJSON *v = cJSON_GetObjectItemCaseSensitive(jring, "version");
        cJSON *sl = cJSON_GetObjectItemCaseSensitive(jring, "slots");
        cJSON *ch = cJSON_GetObjectItemCaseSensitive(jring, "chunk");
        cJSON *rr = cJSON_GetObjectItemCaseSensitive(jring, "ranks");
        if (!cJSON_IsNumber(v) || v->valuedouble != KV_RING_PROTO) {
            snprintf(err, elen, "the peer's receiver ring speaks another "
                     "version (this agent speaks %d)", KV_RING_PROTO);
            return -1;
        }
        if (!cJSON_IsNumber(sl) || sl->valuedouble < 1
            || sl->valuedouble > KV_RING_MAX || !cJSON_IsNumber(ch)
            || ch->valuedouble < 4096 || ch->valuedouble > (1 << 30)
            || !cJSON_IsArray(rr) || cJSON_GetArraySize(rr) != nranks)
        {
            snprintf(err, elen, "bad receiver ring in hello");
            return -1;
        }
        rm->ring_slots = (uint32_t) sl->valuedouble;
        rm->ring_chunk = (uint64_t) ch->valuedouble;
        for (r = 0; r < nranks; r++) {
            rm->ring[r] = cJSON_IsTrue(cJSON_GetArrayItem(rr, r));
        }
    }
    if (!ctx->fab_ok || !cJSON_IsArray(rails)) {
        return 0;
    }
    cJSON_ArrayForEach(o, rails) {
        if (i >= KV_MAX_RAILS) {
            break;
        }
        a = cJSON_GetObjectItemCaseSensitive(o, "addr");
        if (!cJSON_IsString(a)
            || kv_hex_decode(a->valuestring, blobs[i], KV_FABADDR_LEN, &n)
               != 0)
        {
            snprintf(err, elen, "bad fabric address");
            return -1;
        }
        lens[i] = n;
        if (cJSON_IsObject(o) && jrk == NULL
            && json_u64(o, "key", &rm->key[0][i]) == 0
            && json_u64(o, "base", &rm->base[0][i]) == 0)
        {
            haskey[0][i] = 1;          /* a single-rank peer's form */
        }
        i++;
    }
    rm->nrails = nr = i;
    if (nr == 0) {
        return 0;
    }
    /* each rank's rails on the peer: all of them unless it says */
    for (r = 0; r < nranks; r++) {
        cJSON *ra = cJSON_IsArray(jrr) ? cJSON_GetArrayItem(jrr, r) : NULL;
        rm->nrr[r] = 0;
        if (ra == NULL) {
            for (k = 0; k < nr; k++) {
                rm->rr[r][rm->nrr[r]++] = (uint8_t) k;
            }
            continue;
        }
        cJSON_ArrayForEach(a, ra) {
            if (!cJSON_IsNumber(a) || a->valuedouble < 0
                || a->valuedouble >= nr || rm->nrr[r] >= KV_MAX_RAILS)
            {
                snprintf(err, elen, "bad rank_rails for rank %d", r);
                return -1;
            }
            rm->rr[r][rm->nrr[r]++] = (uint8_t) a->valuedouble;
        }
        if (rm->nrr[r] == 0) {
            snprintf(err, elen, "rank %d has no rail", r);
            return -1;
        }
    }
    for (r = 0; cJSON_IsArray(jrk) && r < nranks; r++) {
        cJSON *rk = cJSON_GetArrayItem(jrk, r);
        cJSON_ArrayForEach(o, rk) {
            cJSON *jri = cJSON_GetObjectItemCaseSensitive(o, "rail");
            uint64_t key, base;
            if (!cJSON_IsNumber(jri) || jri->valuedouble < 0
                || jri->valuedouble >= nr || json_u64(o, "key", &key) != 0
                || json_u64(o, "base", &base) != 0)
            {
                snprintf(err, elen, "bad rank_keys for rank %d", r);
                return -1;
            }
            k = (int) jri->valuedouble;
            rm->key[r][k] = key;
            rm->base[r][k] = base;
            haskey[r][k] = 1;
        }
    }
    /* the AV pairs our writes and messages use */
    if (av_pair(ctx, pe, 0, 0, blobs, lens, err, elen) != 0) {
        return -1;
    }
    for (r = 0; r < nranks && r < ctx->nranks; r++) {
        for (l = 0; l < ctx->topo.nrails[r]; l++) {
            for (k = 0; k < rm->nrr[r]; k++) {
                if (av_pair(ctx, pe, ctx->topo.rail[r][l], rm->rr[r][k],
                            blobs, lens, err, elen) != 0)
                {
                    return -1;
                }
            }
        }
    }
    /* a pool we may write: geometry, every rank registered, and a key for
     * each rank on each of its rails */
    complete = cJSON_IsObject(g) && nreg == nranks;
    for (r = 0; complete && r < nranks; r++) {
        for (k = 0; k < rm->nrr[r]; k++) {
            complete &= haskey[r][rm->rr[r][k]];
        }
    }
    rm->has_pool = complete;
    return 0;
}


static void
peer_heard(kv_ctx_t *ctx, int peer)
{
    kv_peer_t *pe = &ctx->peers[peer];

    pe->last_heard_ms = kv_now_ms();
    if (!pe->alive) {
        pe->alive = 1;
        kv_info("ctrl: peer %s is alive", pe->conf.id);
        kv_ctrl_update_node(ctx, peer);
    }
}


void
kv_ctrl_update_node(kv_ctx_t *ctx, int peer)
{
    kv_peer_t *pe = &ctx->peers[peer];
    dpd_node_rec_t *r;

    if (!kv_peer_visible(pe)) {
        return;                        /* an unproven claim, or gone */
    }
    r = kv_state_node(&ctx->st, pe->conf.id);
    if (r == NULL) {
        return;
    }
    kv_state_node_begin(r);
    r->role = pe->conf.role;
    r->flags = DPD_NODE_USED | (pe->alive ? DPD_NODE_ALIVE : 0);
    r->free_blocks = pe->free_blocks;
    r->total_blocks = pe->total_blocks;
    r->inflight = pe->inflight;
    r->block_bytes = pe->remote.layout.layers * pe->remote.layout.regions
                     * pe->remote.layout.block_bytes;
    if (pe->last_hb_ms) {
        r->last_heartbeat_ms = pe->last_hb_ms;
    }
    snprintf(r->http_addr, sizeof(r->http_addr), "%s",
             pe->conf.http[0] ? pe->conf.http : pe->http_seen);
    kv_state_node_end(&ctx->st, r);
}


void
kv_ctrl_update_self(kv_ctx_t *ctx)
{
    dpd_node_rec_t *r = kv_state_node(&ctx->st, ctx->cfg.node_id);
    const kv_layout_t *l = &ctx->cfg.layout;

    if (r == NULL) {
        return;
    }
    kv_state_node_begin(r);
    r->role = ctx->cfg.role;
    r->flags = DPD_NODE_USED | DPD_NODE_SELF | (ctx->stop ? 0
                                                          : DPD_NODE_ALIVE);
    r->free_blocks = ctx->cfg.has_pool ? ctx->free_blocks : 0;
    r->total_blocks = ctx->cfg.has_pool ? l->nblocks : 0;
    r->block_bytes = ctx->cfg.has_pool
                     ? (uint64_t) l->layers * l->regions * l->block_bytes : 0;
    r->inflight = inflight_count(ctx);
    r->last_heartbeat_ms = kv_wall_ms();
    snprintf(r->http_addr, sizeof(r->http_addr), "%s", ctx->cfg.http);
    kv_state_node_end(&ctx->st, r);
}


int
kv_ctrl_send(kv_ctx_t *ctx, int peer, cJSON *j)
{
    kv_peer_t *pe = &ctx->peers[peer];

    if (pe->out_state != KV_LINK_UP && pe->out_state != KV_LINK_HELLO) {
        cJSON_Delete(j);
        return -1;
    }
    if (kv_conn_send_json(&pe->out, j) != 0) {
        kv_ctrl_link_down(ctx, peer, pe->out.overflow
                          ? "the peer does not read (output limit)"
                          : "send failed");
        return -1;
    }
    return 0;
}


void
kv_ctrl_link_down(kv_ctx_t *ctx, int peer, const char *why)
{
    kv_peer_t *pe = &ctx->peers[peer];
    char msg[200];
    int was_up = pe->out_state == KV_LINK_UP;

    if (pe->out.fd >= 0 || pe->out_state != KV_LINK_DOWN) {
        kv_conn_free(&pe->out);
    }
    pe->out.fd = -1;
    pe->out_state = KV_LINK_DOWN;
    pe->next_connect_ms = kv_now_ms() + ctx->cfg.reconnect_ms;
    if (was_up) {
        kv_warn("ctrl: link to %s lost: %s", pe->conf.id, why);
    } else if (!pe->warned_down) {
        kv_info("ctrl: cannot reach %s yet (%s); retrying every %d ms",
                pe->conf.id, why, ctx->cfg.reconnect_ms);
    }
    pe->warned_down = 1;
    snprintf(msg, sizeof(msg), "peer %s disconnected (%s)", pe->conf.id, why);
    kv_push_peer_down(ctx, peer, msg);
    av_forget(ctx, pe);
    if (pe->res_id) {
        kv_res_cancel(ctx->res, pe->res_id);
        pe->res_id = 0;
    }
    if (pe->dyn) {
        /* its address is probed again by peers_dns.c */
        kv_pdns_link_down(ctx, peer);
    }
}


/* Our pool's keys changed (a new registration or a revocation): every
 * peer reconnects now and learns the new ones from our hello. */
void
kv_ctrl_rekeyed(kv_ctx_t *ctx, const char *why)
{
    int i;

    for (i = 0; i < ctx->npeers; i++) {
        if (ctx->peers[i].retired) {
            continue;
        }
        if (ctx->peers[i].out_state != KV_LINK_DOWN) {
            kv_ctrl_link_down(ctx, i, why);
        }
        av_forget(ctx, &ctx->peers[i]);
        ctx->peers[i].next_connect_ms = 0;
        if (ctx->peers[i].in_conn >= 0) {
            kv_client_close(ctx, ctx->peers[i].in_conn);
        }
    }
}


/* With peers_dns, outbound control connections leave from the listen
 * address when it is one (not a wildcard): a peer that checks our source
 * address against its DNS answers sees the address those answers name,
 * also on a host or pod with several.  Static configs keep the kernel's
 * choice. */
void
kv_ctrl_bind_source(kv_ctx_t *ctx, int fd, int family)
{
    struct addrinfo hints, *res;
    char host[KV_ADDR_LEN];
    int port;

    if (ctx->cfg.ndns == 0
        || kv_parse_hostport(ctx->cfg.listen, host, sizeof(host), &port) != 0
        || host[0] == '\0' || strcmp(host, "0.0.0.0") == 0
        || strcmp(host, "::") == 0)
    {
        return;
    }
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = family;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICHOST;
    if (getaddrinfo(host, "0", &hints, &res) != 0) {
        return;                        /* a name, or another family */
    }
    if (bind(fd, res->ai_addr, res->ai_addrlen) != 0) {
        kv_debug("ctrl: cannot bind the source address %s: %s", host,
                 strerror(errno));
    }
    freeaddrinfo(res);
}


static void
connect_addr(kv_ctx_t *ctx, int peer, const struct sockaddr *sa,
    socklen_t sl)
{
    kv_peer_t *pe = &ctx->peers[peer];
    int fd, one = 1;

    fd = socket(sa->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC,
                0);
    if (fd < 0) {
        kv_ctrl_link_down(ctx, peer, strerror(errno));
        return;
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    kv_ctrl_bind_source(ctx, fd, sa->sa_family);
    kv_conn_init(&pe->out, fd);
    pe->out_state = KV_LINK_CONNECTING;
    if (connect(fd, sa, sl) != 0 && errno != EINPROGRESS) {
        kv_ctrl_link_down(ctx, peer, strerror(errno));
    }
}


/* A name in "ctrl" resolved off the loop (resolve.c): connect to the
 * first address of the answer. */
static void
ctrl_resolved(void *data, const kv_res_result_t *res)
{
    kv_ctx_t *ctx = data;
    struct sockaddr_storage ss;
    struct sockaddr_in *s4 = (struct sockaddr_in *) &ss;
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *) &ss;
    const kv_res_addr_t *a;
    char why[200];
    int i;

    for (i = 0; i < ctx->npeers && ctx->peers[i].res_id != res->id; i++) {
    }
    if (i == ctx->npeers) {
        return;
    }
    ctx->peers[i].res_id = 0;
    if (res->status != KV_RES_OK || res->naddrs == 0) {
        snprintf(why, sizeof(why), "cannot resolve %s: %s", res->name,
                 res->status != KV_RES_OK ? res->error : "no address");
        kv_ctrl_link_down(ctx, i, why);
        return;
    }
    a = &res->addrs[0];
    memset(&ss, 0, sizeof(ss));
    if (a->family == AF_INET) {
        s4->sin_family = AF_INET;
        s4->sin_port = htons((uint16_t) a->port);
        memcpy(&s4->sin_addr, a->addr, 4);
        connect_addr(ctx, i, (struct sockaddr *) s4, sizeof(*s4));
    } else {
        s6->sin6_family = AF_INET6;
        s6->sin6_port = htons((uint16_t) a->port);
        memcpy(&s6->sin6_addr, a->addr, 16);
        s6->sin6_scope_id = a->scope_id;
        connect_addr(ctx, i, (struct sockaddr *) s6, sizeof(*s6));
    }
}


/* A numeric address connects at once; a name is resolved by resolve.c's
 * threads (a slow cluster DNS must not stall the loop), then connected. */
static void
connect_peer(kv_ctx_t *ctx, int peer)
{
    kv_peer_t *pe = &ctx->peers[peer];
    struct addrinfo hints, *res;
    char host[KV_ADDR_LEN], port[16], why[200];
    int p;

    pe->t_connect_s = kv_now_s();
    if (kv_parse_hostport(pe->conf.ctrl, host, sizeof(host), &p) != 0) {
        kv_ctrl_link_down(ctx, peer, "bad address");
        return;
    }
    snprintf(port, sizeof(port), "%d", p);
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV | AI_NUMERICHOST;
    if (getaddrinfo(host, port, &hints, &res) == 0) {
        connect_addr(ctx, peer, res->ai_addr, res->ai_addrlen);
        freeaddrinfo(res);
        return;
    }
    if (ctx->res == NULL) {
        kv_ctrl_link_down(ctx, peer, "no resolver");
        return;
    }
    pe->res_id = kv_res_start(ctx->res, host, p, AF_UNSPEC, ctrl_resolved,
                              ctx);
    if (pe->res_id == 0) {
        snprintf(why, sizeof(why), "cannot resolve %s: %s", host,
                 strerror(errno));
        kv_ctrl_link_down(ctx, peer, why);
    }
}


/* peers_dns.c read a discovered listener's challenge on conn and found
 * the claimed id's slot: the slot answers it as its own connection. */
void
kv_ctrl_adopt(kv_ctx_t *ctx, int peer, kv_conn_t *conn, cJSON *challenge)
{
    kv_peer_t *pe = &ctx->peers[peer];

    pe->out = *conn;
    memset(conn, 0, sizeof(*conn));
    conn->fd = -1;
    pe->t_connect_s = kv_now_s();
    pe->out_state = KV_LINK_HELLO;
    pe->got_challenge = 0;
    pe->hs_deadline_ms = kv_now_ms() + ctx->cfg.hello_timeout_ms;
    out_challenge(ctx, peer, challenge);
}


static void
send_heartbeats(kv_ctx_t *ctx)
{
    cJSON *j;
    int i;

    for (i = 0; i < ctx->npeers; i++) {
        if (ctx->peers[i].out_state != KV_LINK_UP) {
            continue;
        }
        j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "type", "hb");
        cJSON_AddStringToObject(j, "node", ctx->cfg.node_id);
        cJSON_AddNumberToObject(j, "free", ctx->cfg.has_pool
                                ? ctx->free_blocks : 0);
        cJSON_AddNumberToObject(j, "total", ctx->cfg.has_pool
                                ? ctx->cfg.layout.nblocks : 0);
        cJSON_AddNumberToObject(j, "inflight", inflight_count(ctx));
        cJSON_AddNumberToObject(j, "ts", (double) kv_wall_ms());
        kv_ctrl_send(ctx, i, j);
    }
}


void
kv_ctrl_tick(kv_ctx_t *ctx, uint64_t now)
{
    kv_peer_t *pe;
    int i;

    for (i = 0; i < ctx->npeers; i++) {
        pe = &ctx->peers[i];
        if (pe->retired) {
            continue;
        }
        if (pe->out_state == KV_LINK_DOWN && now >= pe->next_connect_ms
            && !pe->dyn && pe->res_id == 0)
        {
            connect_peer(ctx, i);
        } else if (pe->out_state == KV_LINK_HELLO
                   && now > pe->hs_deadline_ms)
        {
            hs_fail(ctx, i, "no handshake within hello_timeout_ms");
        }
        if (pe->alive && now > pe->last_heard_ms
                               + (uint64_t) ctx->cfg.dead_after_ms)
        {
            pe->alive = 0;
            kv_warn("ctrl: peer %s is dead (silent for %llu ms)", pe->conf.id,
                    (unsigned long long) (now - pe->last_heard_ms));
            kv_ctrl_update_node(ctx, i);
        }
    }
    if (now >= ctx->next_hb_ms) {
        ctx->next_hb_ms = now + ctx->cfg.heartbeat_ms;
        send_heartbeats(ctx);
        kv_ctrl_update_self(ctx);
    }
}


/* A failed outbound handshake: warned once until the link comes up. */
static void
hs_fail(kv_ctx_t *ctx, int peer, const char *why)
{
    kv_peer_t *pe = &ctx->peers[peer];

    if (!pe->warned_auth) {
        kv_warn("ctrl: handshake with %s failed: %s", pe->conf.id, why);
        pe->warned_auth = 1;
    }
    pe->warned_down = 0;
    kv_ctrl_link_down(ctx, peer, why);
    pe->warned_down = 1;
}


static int
version_ok(cJSON *j)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(j, "version");

    return cJSON_IsNumber(v) && v->valuedouble == KV_CTRL_VERSION;
}


/* The listener's challenge: answer with our nonce and proof. */
static void
out_challenge(kv_ctx_t *ctx, int peer, cJSON *j)
{
    kv_peer_t *pe = &ctx->peers[peer];
    cJSON *jn = cJSON_GetObjectItemCaseSensitive(j, "node"), *h;
    uint8_t proof[KV_MAC_LEN];
    char hex[2 * KV_MAC_LEN + 1], why[200];

    if (pe->got_challenge) {
        hs_fail(ctx, peer, "a second challenge");
        return;
    }
    if (!version_ok(j)) {
        hs_fail(ctx, peer, "the peer speaks another control protocol "
                "version (this agent speaks 2)");
        return;
    }
    if (!cJSON_IsString(jn) || strcmp(jn->valuestring, pe->conf.id) != 0) {
        snprintf(why, sizeof(why), "the listener at %s says it is %.64s",
                 pe->conf.ctrl, cJSON_IsString(jn) ? jn->valuestring : "?");
        hs_fail(ctx, peer, why);
        return;
    }
    if (get_hex(j, "nonce", pe->nonce_s, KV_NONCE_LEN) != 0) {
        hs_fail(ctx, peer, "malformed challenge");
        return;
    }
    if (kv_auth_nonce(pe->nonce_c, KV_NONCE_LEN) != 0
        || kv_auth_proof(pe->conf.key[0], pe->conf.keylen[0], KV_AUTH_CLIENT,
                         ctx->cfg.node_id, ctx->cfg.role, pe->conf.id,
                         pe->conf.role, pe->nonce_c, pe->nonce_s,
                         pe->conf.kid[0], proof) != 0)
    {
        hs_fail(ctx, peer, "no random bytes or HMAC failed (libcrypto)");
        return;
    }
    pe->got_challenge = 1;
    h = cJSON_CreateObject();
    cJSON_AddStringToObject(h, "type", "hello");
    cJSON_AddNumberToObject(h, "version", KV_CTRL_VERSION);
    cJSON_AddStringToObject(h, "node", ctx->cfg.node_id);
    cJSON_AddStringToObject(h, "peer", pe->conf.id);
    kv_hex_encode(pe->nonce_c, KV_NONCE_LEN, hex);
    cJSON_AddStringToObject(h, "nonce", hex);
    cJSON_AddStringToObject(h, "key_id", pe->conf.kid[0]);
    kv_hex_encode(proof, KV_MAC_LEN, hex);
    cJSON_AddStringToObject(h, "proof", hex);
    cJSON_AddStringToObject(h, "http", ctx->cfg.http);
    add_identity(ctx, h);
    kv_ctrl_send(ctx, peer, h);
}


/* hello_ok: nothing in it is believed before the listener's proof. */
static void
out_hello_ok(kv_ctx_t *ctx, int peer, cJSON *j)
{
    kv_peer_t *pe = &ctx->peers[peer];
    cJSON *jn = cJSON_GetObjectItemCaseSensitive(j, "node");
    uint8_t want[KV_MAC_LEN], got[KV_MAC_LEN];
    char err[200];
    uint32_t i;

    if (!pe->got_challenge) {
        hs_fail(ctx, peer, "hello_ok without a challenge");
        return;
    }
    if (!version_ok(j) || !cJSON_IsString(jn)
        || strcmp(jn->valuestring, pe->conf.id) != 0
        || get_hex(j, "proof", got, KV_MAC_LEN) != 0
        || kv_auth_proof(pe->conf.key[0], pe->conf.keylen[0], KV_AUTH_SERVER,
                         ctx->cfg.node_id, ctx->cfg.role, pe->conf.id,
                         pe->conf.role, pe->nonce_c, pe->nonce_s,
                         pe->conf.kid[0], want) != 0
        || !kv_auth_equal(want, got, KV_MAC_LEN))
    {
        snprintf(err, sizeof(err), "the listener at %s did not prove key %s "
                 "(wrong key, or not %s)", pe->conf.ctrl, pe->conf.kid[0],
                 pe->conf.id);
        hs_fail(ctx, peer, err);
        return;
    }
    err[0] = '\0';
    learn_identity(ctx, pe, j);
    if (learn_remote(ctx, pe, j, err, sizeof(err)) != 0) {
        hs_fail(ctx, peer, err);
        return;
    }
    pe->out_state = KV_LINK_UP;
    if (pe->dyn) {
        kv_pdns_link_up(ctx, peer);    /* the claim is proven */
    }
    pe->warned_down = 0;
    pe->warned_auth = 0;
    pe->link_gen++;
    peer_heard(ctx, peer);
    kv_info("ctrl: connected to %s (%s, %d rail(s)%s, key %s, handshake "
            "%.3f ms)", pe->conf.id, dpd_state_role_name(pe->conf.role),
            pe->remote.nrails, pe->remote.has_pool ? ", pool" : "",
            pe->conf.kid[0], (kv_now_s() - pe->t_connect_s) * 1e3);
    if (pe->conf.role == DPD_ROLE_ROUTER) {
        /* a (re)connected router learns every request we hold */
        for (i = 0; ctx->rreq && i < ctx->nrreq; i++) {
            if (ctx->rreq[i].used) {
                kv_ctrl_req_event(ctx, &ctx->rreq[i]);
            }
        }
    }
}


static void
out_message(kv_ctx_t *ctx, int peer, cJSON *j)
{
    kv_peer_t *pe = &ctx->peers[peer];
    cJSON *t = cJSON_GetObjectItemCaseSensitive(j, "type");
    cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "error");
    char err[200];

    if (!cJSON_IsString(t)) {
        return;
    }
    if (strcmp(t->valuestring, "error") == 0) {
        snprintf(err, sizeof(err), "rejected by %s: %.160s", pe->conf.id,
                 cJSON_IsString(e) ? e->valuestring : "?");
        if (!pe->warned_auth || pe->out_state == KV_LINK_UP) {
            kv_warn("ctrl: %s", err);
            pe->warned_auth = 1;
        }
        pe->warned_down = 0;
        kv_ctrl_link_down(ctx, peer, err);
        pe->warned_down = 1;
        return;
    }
    if (pe->out_state == KV_LINK_HELLO) {
        if (strcmp(t->valuestring, "challenge") == 0) {
            out_challenge(ctx, peer, j);
        } else if (strcmp(t->valuestring, "hello_ok") == 0) {
            out_hello_ok(ctx, peer, j);
        } else {
            hs_fail(ctx, peer, "unexpected message during the handshake");
        }
        return;
    }
    peer_heard(ctx, peer);
    if (strcmp(t->valuestring, "push_ok") == 0
        || strcmp(t->valuestring, "push_err") == 0)
    {
        kv_push_begin_reply(ctx, peer, j);
    } else if (strcmp(t->valuestring, "push_cancel") == 0) {
        kv_push_cancel_msg(ctx, peer, j);
    } else if (strcmp(t->valuestring, "push_credit") == 0) {
        kv_push_credit_msg(ctx, peer, j);
    } else {
        kv_debug("ctrl: ignoring \"%s\" from %s", t->valuestring,
                 pe->conf.id);
    }
}


void
kv_ctrl_out_event(kv_ctx_t *ctx, int peer, short revents)
{
    kv_peer_t *pe = &ctx->peers[peer];
    const char *why = NULL;
    uint32_t len;
    char *msg;
    cJSON *j;
    int rc, soerr = 0;
    socklen_t sl = sizeof(soerr);

    if (pe->out_state == KV_LINK_CONNECTING) {
        if (!(revents & (POLLOUT | POLLERR | POLLHUP))) {
            return;
        }
        if (getsockopt(pe->out.fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0
            || soerr != 0)
        {
            kv_ctrl_link_down(ctx, peer, strerror(soerr ? soerr : errno));
            return;
        }
        /* the listener speaks first (its challenge) */
        pe->out_state = KV_LINK_HELLO;
        pe->got_challenge = 0;
        pe->hs_deadline_ms = kv_now_ms() + ctx->cfg.hello_timeout_ms;
        return;
    }
    if (revents & POLLOUT) {
        if (kv_conn_flush(&pe->out) != 0) {
            kv_ctrl_link_down(ctx, peer, "write failed");
            return;
        }
    }
    if (!(revents & ~POLLOUT)) {
        return;
    }
    for ( ;; ) {
        rc = kv_conn_read(&pe->out, ctx->cfg.max_msg, 0, &msg, &len, &why);
        if (rc == 0) {
            return;
        }
        if (rc < 0) {
            kv_ctrl_link_down(ctx, peer, why);
            return;
        }
        j = cJSON_ParseWithLength(msg, len);
        kv_conn_consume(&pe->out, len);
        if (j == NULL) {
            kv_ctrl_link_down(ctx, peer, "malformed control message");
            return;
        }
        out_message(ctx, peer, j);
        cJSON_Delete(j);
        if (pe->out_state == KV_LINK_DOWN) {
            return;
        }
    }
}


void
kv_ctrl_req_event(kv_ctx_t *ctx, const kv_rreq_t *r)
{
    cJSON *j;
    int i;

    for (i = 0; i < ctx->npeers; i++) {
        if (ctx->peers[i].conf.role != DPD_ROLE_ROUTER
            || ctx->peers[i].out_state != KV_LINK_UP)
        {
            continue;
        }
        j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "type", "req");
        cJSON_AddStringToObject(j, "req_id", r->req_id);
        cJSON_AddStringToObject(j, "state", dpd_state_req_name(r->state));
        cJSON_AddNumberToObject(j, "bytes_done", (double) r->bytes_done);
        cJSON_AddNumberToObject(j, "bytes_total", (double) r->bytes_total);
        cJSON_AddNumberToObject(j, "nblocks", r->n);
        cJSON_AddStringToObject(j, "peer", r->peer_id);
        cJSON_AddNumberToObject(j, "t_reserved_ms", (double) r->t_reserved_ms);
        cJSON_AddNumberToObject(j, "t_start_ms", (double) r->t_start_ms);
        cJSON_AddNumberToObject(j, "t_done_ms", (double) r->t_done_ms);
        kv_ctrl_send(ctx, i, j);
    }
}


static uint64_t
num(cJSON *j, const char *k)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(j, k);

    return cJSON_IsNumber(v) && v->valuedouble > 0
           ? (uint64_t) v->valuedouble : 0;
}


/* Router side: mirror a peer's request into the local table. */
static void
router_req_event(kv_ctx_t *ctx, int peer, cJSON *j)
{
    cJSON *jr = cJSON_GetObjectItemCaseSensitive(j, "req_id");
    cJSON *js = cJSON_GetObjectItemCaseSensitive(j, "state");
    cJSON *jp = cJSON_GetObjectItemCaseSensitive(j, "peer");
    dpd_req_rec_t *rec;
    uint32_t st;

    if (!cJSON_IsString(jr) || !cJSON_IsString(js)
        || strlen(jr->valuestring) == 0)
    {
        return;
    }
    if (strcmp(js->valuestring, "reserved") == 0) st = DPD_REQ_RESERVED;
    else if (strcmp(js->valuestring, "transferring") == 0)
        st = DPD_REQ_TRANSFERRING;
    else if (strcmp(js->valuestring, "ready") == 0) st = DPD_REQ_READY;
    else if (strcmp(js->valuestring, "failed") == 0) st = DPD_REQ_FAILED;
    else st = DPD_REQ_FREE;
    rec = kv_state_req(&ctx->st, jr->valuestring, st != DPD_REQ_FREE);
    if (rec == NULL) {
        return;
    }
    if (st == DPD_REQ_FREE) {
        kv_state_req_delete(&ctx->st, rec);
        return;
    }
    kv_state_req_begin(rec);
    rec->state = st;
    rec->bytes_done = num(j, "bytes_done");
    rec->bytes_total = num(j, "bytes_total");
    rec->nblocks = (uint32_t) num(j, "nblocks");
    rec->t_reserved_ms = num(j, "t_reserved_ms");
    rec->t_start_ms = num(j, "t_start_ms");
    rec->t_done_ms = num(j, "t_done_ms");
    rec->error = st == DPD_REQ_FAILED ? -EIO : 0;
    snprintf(rec->node_id, sizeof(rec->node_id), "%s",
             ctx->peers[peer].conf.id);
    snprintf(rec->peer_id, sizeof(rec->peer_id), "%s",
             cJSON_IsString(jp) ? jp->valuestring : "");
    kv_state_req_end(&ctx->st, rec);
}


/* Send our challenge on a freshly accepted control connection. */
int
kv_ctrl_accepted(kv_ctx_t *ctx, int client)
{
    kv_client_t *c = &ctx->clients[client];
    char hex[2 * KV_NONCE_LEN + 1];
    cJSON *j;

    if (kv_auth_nonce(c->nonce_s, KV_NONCE_LEN) != 0) {
        kv_err("ctrl: no random bytes for a challenge (libcrypto)");
        return -1;
    }
    kv_hex_encode(c->nonce_s, KV_NONCE_LEN, hex);
    j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "type", "challenge");
    cJSON_AddNumberToObject(j, "version", KV_CTRL_VERSION);
    cJSON_AddStringToObject(j, "node", ctx->cfg.node_id);
    cJSON_AddStringToObject(j, "nonce", hex);
    return kv_client_send(ctx, client, j);
}


int
kv_ctrl_unauth_count(kv_ctx_t *ctx)
{
    int i, n = 0;

    for (i = 0; i < ctx->nclients; i++) {
        n += ctx->clients[i].used && ctx->clients[i].is_peer
             && ctx->clients[i].peer < 0;
    }
    return n;
}


/* max_peer_connects accepted handshakes per peer_connect_window_ms. */
static int
connect_budget_ok(kv_ctx_t *ctx, kv_peer_t *pe, uint64_t now)
{
    uint32_t n = (uint32_t) ctx->cfg.max_peer_connects;
    uint32_t slot = pe->in_accepts_n % n;

    if (ctx->cfg.peer_connect_window_ms > 0 && pe->in_accepts_n >= n
        && now < pe->in_accepts[slot] + ctx->cfg.peer_connect_window_ms)
    {
        return 0;
    }
    pe->in_accepts[slot] = now;
    pe->in_accepts_n++;
    return 1;
}


static int
in_hello(kv_ctx_t *ctx, int client, cJSON *j)
{
    kv_client_t *c = &ctx->clients[client];
    cJSON *jn = cJSON_GetObjectItemCaseSensitive(j, "node");
    cJSON *jp = cJSON_GetObjectItemCaseSensitive(j, "peer");
    cJSON *jk = cJSON_GetObjectItemCaseSensitive(j, "key_id");
    uint8_t nc[KV_NONCE_LEN], got[KV_MAC_LEN], want[KV_MAC_LEN];
    const char *wire = "authentication failed";
    cJSON *reply;
    kv_peer_t *pe;
    char err[256], wbuf[200];
    int peer, old, k;

    err[0] = '\0';
    if (!version_ok(j)) {
        snprintf(err, sizeof(err), "hello without control protocol version "
                 "%d (an older agent sending a plaintext token?)",
                 KV_CTRL_VERSION);
        wire = "control protocol version 2 required (mutual key "
               "authentication): upgrade this agent and give it the link key";
        goto reject;
    }
    if (!cJSON_IsString(jn) || !cJSON_IsString(jp) || !cJSON_IsString(jk)
        || get_hex(j, "nonce", nc, KV_NONCE_LEN) != 0
        || get_hex(j, "proof", got, KV_MAC_LEN) != 0)
    {
        snprintf(err, sizeof(err), "malformed hello");
        wire = "malformed hello";
        goto reject;
    }
    peer = kv_ctrl_peer_find(ctx, jn->valuestring);
    if (peer < 0 && strcmp(jp->valuestring, ctx->cfg.node_id) == 0) {
        /* not configured: a peers_dns key may prove it */
        peer = kv_pdns_inbound(ctx, client, jn->valuestring,
                               jk->valuestring, nc, c->nonce_s, got, err,
                               sizeof(err));
    }
    if (peer < 0) {
        if (err[0] == '\0') {
            snprintf(err, sizeof(err), "node %.64s is not an allowed peer",
                     jn->valuestring);
        }
        goto reject;
    }
    pe = &ctx->peers[peer];
    if (strcmp(jp->valuestring, ctx->cfg.node_id) != 0) {
        snprintf(err, sizeof(err), "node %.64s meant its hello for %.64s",
                 pe->conf.id, jp->valuestring);
        goto reject;
    }
    for (k = 0; k < pe->conf.nkeys; k++) {
        if (strcmp(pe->conf.kid[k], jk->valuestring) == 0) {
            break;
        }
    }
    if (k == pe->conf.nkeys) {
        snprintf(err, sizeof(err), "node %.64s uses key %.20s, which is not "
                 "one of its keys here (%s%s%s)", pe->conf.id,
                 jk->valuestring, pe->conf.kid[0],
                 pe->conf.nkeys > 1 ? ", " : "",
                 pe->conf.nkeys > 1 ? pe->conf.kid[1] : "");
        snprintf(wbuf, sizeof(wbuf), "authentication failed: key %.20s is "
                 "not a key of this link here", jk->valuestring);
        wire = wbuf;
        goto reject;
    }
    if (kv_auth_proof(pe->conf.key[k], pe->conf.keylen[k], KV_AUTH_CLIENT,
                      pe->conf.id, pe->conf.role, ctx->cfg.node_id,
                      ctx->cfg.role, nc, c->nonce_s, pe->conf.kid[k], want)
        != 0
        || !kv_auth_equal(want, got, KV_MAC_LEN))
    {
        snprintf(err, sizeof(err), "node %.64s did not prove key %s (another "
                 "key, a replayed or reflected hello, or roles that differ "
                 "between the two configurations)", pe->conf.id,
                 pe->conf.kid[k]);
        goto reject;
    }
    if (!connect_budget_ok(ctx, pe, kv_now_ms())) {
        snprintf(err, sizeof(err), "node %.64s connected %d times within "
                 "%d ms (max_peer_connects)", pe->conf.id,
                 ctx->cfg.max_peer_connects, ctx->cfg.peer_connect_window_ms);
        wire = "too many connections; retry later";
        goto reject;
    }
    if (kv_auth_proof(pe->conf.key[k], pe->conf.keylen[k], KV_AUTH_SERVER,
                      pe->conf.id, pe->conf.role, ctx->cfg.node_id,
                      ctx->cfg.role, nc, c->nonce_s, pe->conf.kid[k], want)
        != 0)
    {
        snprintf(err, sizeof(err), "HMAC failed (libcrypto)");
        goto reject;
    }
    old = pe->in_conn;
    if (old >= 0 && old != client) {
        /* the peer came back (restart): its old incarnation's transfers
         * cannot complete any more */
        ctx->clients[old].peer = -1;
        kv_client_close(ctx, old);
        kv_rreq_peer_down(ctx, peer, "peer reconnected");
    }
    pe->in_conn = client;
    c->peer = peer;
    learn_identity(ctx, pe, j);
    peer_heard(ctx, peer);
    kv_info("ctrl: accepted %s (key %s)", pe->conf.id, pe->conf.kid[k]);
    reply = hello_ok_json(ctx, peer, want);
    if (kv_client_send(ctx, client, reply) != 0) {
        return -1;
    }
    /* acknowledgements of aborted pushes we still wait for */
    kv_rreq_peer_up(ctx, peer);
    return 0;

reject:
    /* a line a second at most: anyone may connect and fail, in a loop */
    ctx->stat_ctrl_rejected++;
    if (kv_log_limit(&ctx->ctrl_reject_warn)) {
        kv_warn("ctrl: rejected a peer: %s (%llu so far)", err,
                (unsigned long long) ctx->stat_ctrl_rejected);
    }
    reply = cJSON_CreateObject();
    cJSON_AddStringToObject(reply, "type", "error");
    cJSON_AddStringToObject(reply, "error", wire);
    kv_client_send(ctx, client, reply);
    c->conn.closing = 1;
    return 0;
}


int
kv_ctrl_in_msg(kv_ctx_t *ctx, int client, char *msg, uint32_t len)
{
    kv_client_t *c = &ctx->clients[client];
    cJSON *j = cJSON_ParseWithLength(msg, len), *t, *reply, *id;
    kv_peer_t *pe;
    int peer = c->peer, rc = 0;

    if (j == NULL || !cJSON_IsString(t = cJSON_GetObjectItemCaseSensitive(j,
                                                                   "type")))
    {
        kv_warn("ctrl: malformed control message; closing");
        cJSON_Delete(j);
        return -1;
    }
    if (peer < 0) {
        if (strcmp(t->valuestring, "hello") != 0) {
            kv_warn("ctrl: first message is not a hello; closing");
            cJSON_Delete(j);
            return -1;
        }
        rc = in_hello(ctx, client, j);
        cJSON_Delete(j);
        return rc;
    }
    pe = &ctx->peers[peer];
    peer_heard(ctx, peer);
    if (strcmp(t->valuestring, "hb") == 0) {
        pe->last_hb_ms = kv_wall_ms();
        pe->free_blocks = num(j, "free");
        pe->total_blocks = num(j, "total");
        pe->inflight = (uint32_t) num(j, "inflight");
        kv_ctrl_update_node(ctx, peer);
    } else if (strcmp(t->valuestring, "req") == 0) {
        /* only decode nodes hold requests: nobody else reports them */
        if (pe->conf.role == DPD_ROLE_DECODE) {
            router_req_event(ctx, peer, j);
        } else {
            kv_debug("ctrl: ignoring a request event from %s node %s",
                     dpd_state_role_name(pe->conf.role), pe->conf.id);
        }
    } else if (strcmp(t->valuestring, "push_begin") == 0) {
        reply = cJSON_CreateObject();
        id = cJSON_GetObjectItemCaseSensitive(j, "id");
        cJSON_AddNumberToObject(reply, "id", cJSON_IsNumber(id)
                                ? id->valuedouble : 0);
        kv_ctrl_push_begin(ctx, peer, j, reply);
        rc = kv_client_send(ctx, client, reply);
    } else if (strcmp(t->valuestring, "push_abort") == 0) {
        kv_rreq_abort_msg(ctx, peer, j);
    } else if (strcmp(t->valuestring, "push_cancel") == 0) {
        kv_push_cancel_msg(ctx, peer, j);
    } else if (strcmp(t->valuestring, "push_credit") == 0) {
        kv_push_credit_msg(ctx, peer, j);
    } else {
        kv_debug("ctrl: ignoring \"%s\" from %s", t->valuestring,
                 pe->conf.id);
    }
    cJSON_Delete(j);
    return rc;
}


void
kv_ctrl_inbound_closed(kv_ctx_t *ctx, int client)
{
    int peer = ctx->clients[client].peer;
    char why[160];

    if (peer < 0) {
        return;
    }
    if (ctx->peers[peer].in_conn == client) {
        ctx->peers[peer].in_conn = -1;
    }
    snprintf(why, sizeof(why), "peer %s disconnected",
             ctx->peers[peer].conf.id);
    kv_rreq_peer_down(ctx, peer, why);
}
