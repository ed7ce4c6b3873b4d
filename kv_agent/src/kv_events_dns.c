/*
 * kv_events_dns.c - "kv_events" sources given as a DNS name ({"dns": ...,
 * "port": ..., "http_port": ...}): every address the name resolves to is
 * one engine, as nginx's upstream "server NAME resolve" makes every
 * address a peer (a Kubernetes headless Service: one address per ready
 * pod).  The name is resolved again every resolve_ms (getaddrinfo() has
 * no TTL; Kubernetes' CoreDNS answers with a 5 s one, the default here)
 * off the loop (resolve.c).
 *
 * Per answer:
 *   - an address new to the name becomes a source of the subscriber
 *     (kv_events_sub.c: SUB on tcp://ADDR:port, DEALER replay on
 *     tcp://ADDR:replay_port) whose node and "http" are "ADDR:http_port"
 *     ("[ADDR]:http_port" for IPv6), what the module's upstream names the
 *     peer, and, with "prefix_index", an index node of its own;
 *   - an address missing from KV_DNS_GONE_AFTER answers in a row is gone:
 *     its source is closed and its index node released (everything it
 *     held dropped, the record no longer USED).  One answer without it is
 *     not enough: a DNS server that answers with a rotating subset would
 *     otherwise clear and rebuild a pod that stays, every period;
 *   - an address that is already a source (a static one, another DNS
 *     name's, the same "http" or endpoint) is not subscribed twice;
 *   - a failed or timed-out lookup changes nothing (the last good set is
 *     kept; one warning, then one a minute while it lasts);
 *   - at most KV_RES_MAX_ADDRS addresses of a name (the lowest, sorted:
 *     the same ones every time) and KV_EVS_MAX_SOURCES sources in all;
 *     what does not fit waits for room and is said once per change.
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <arpa/inet.h>

#include "kv.h"
#include "prefix_events.h"
#include "resolve.h"
#include "kv_events_dns.h"


#define KV_DNS_GONE_AFTER    2      /* answers in a row without it */
#define KV_DNS_FAIL_LOG_MS   60000  /* failures: one line a minute */
#define KV_DNS_TICK_MS       10     /* the resolver's answers looked at */

typedef struct {
    kv_res_addr_t  addr;
    int            idx;             /* the subscriber's slot */
    int            missing;         /* answers in a row without it */
} dns_member_t;

typedef struct kv_evs_dns_name_s {
    struct kv_evs_dns        *d;
    const kv_evs_dns_conf_t  *c;
    uint64_t                  next_ms;
    uint64_t                  req;          /* in flight; 0: none */
    dns_member_t              m[KV_EVS_MAX_SOURCES];
    int                       nm;
    uint64_t                  fails;        /* in a row */
    uint64_t                  t_fail_log;
    uint64_t                  sig;          /* last answer summarised */
    kv_loglim_t               log_lim;
    uint64_t                  answers, failures, added, removed;
} dns_name_t;

struct kv_evs_dns {
    kv_res_t        *res;
    struct kv_evs   *evs;
    kv_pfx_feed_t   *feed;          /* NULL: no prefix index */
    dns_name_t      *names;
    int              n;
    uint64_t         t_tick;
};


static void
dns_source_conf(const dns_name_t *nm, const kv_res_addr_t *a,
    kv_evs_src_conf_t *s)
{
    char ip[INET6_ADDRSTRLEN], host[INET6_ADDRSTRLEN + 2];

    memset(s, 0, sizeof(*s));
    kv_res_addr_str(a, 0, ip, sizeof(ip));
    snprintf(host, sizeof(host), a->family == AF_INET6 ? "[%s]" : "%s", ip);
    snprintf(s->node, sizeof(s->node), "%s:%d", host, nm->c->http_port);
    snprintf(s->http, sizeof(s->http), "%s:%d", host, nm->c->http_port);
    snprintf(s->endpoint, sizeof(s->endpoint), "tcp://%s:%d", host,
             nm->c->port);
    if (nm->c->replay_port) {
        snprintf(s->replay, sizeof(s->replay), "tcp://%s:%d", host,
                 nm->c->replay_port);
    }
    snprintf(s->topic, sizeof(s->topic), "%s", nm->c->topic);
    snprintf(s->model, sizeof(s->model), "%s", nm->c->model);
    s->replay_timeout_ms = nm->c->replay_timeout_ms;
}


static void
dns_member_drop(dns_name_t *nm, int j, const char *why)
{
    struct kv_evs_dns *d = nm->d;
    dns_member_t *mb = &nm->m[j];
    uint64_t held = 0;
    char a[64];

    kv_evs_remove(d->evs, mb->idx);
    if (d->feed != NULL) {
        held = kv_pfx_feed_detach(d->feed, (uint32_t) mb->idx);
    }
    kv_res_addr_str(&mb->addr, 0, a, sizeof(a));
    kv_info("kv_events: dns %s: %s %s: its source closed, %llu blocks "
            "dropped from the prefix index", nm->c->name, a, why,
            (unsigned long long) held);
    nm->removed++;
    nm->m[j] = nm->m[--nm->nm];
}


/* 0: added; 1: already a source; 2: no room (slot or index record) */
static int
dns_member_add(dns_name_t *nm, const kv_res_addr_t *a)
{
    struct kv_evs_dns *d = nm->d;
    kv_evs_src_conf_t s;
    int idx;

    dns_source_conf(nm, a, &s);
    if (kv_evs_find(d->evs, s.endpoint, s.http) >= 0) {
        return 1;
    }
    if (nm->nm >= KV_EVS_MAX_SOURCES || kv_evs_free_slots(d->evs) == 0
        || (d->feed != NULL && kv_pfx_node_free(d->feed->ix) == 0))
    {
        return 2;
    }
    idx = kv_evs_add(d->evs, &s);
    if (idx < 0) {
        return 2;
    }
    /* before the loop reads the new SUB: no event of it is delivered
     * without its index node */
    if (d->feed != NULL
        && kv_pfx_feed_attach(d->feed, (uint32_t) idx, s.node, s.http,
                              s.model) < 0)
    {
        kv_evs_remove(d->evs, idx);
        return 2;
    }
    nm->m[nm->nm].addr = *a;
    nm->m[nm->nm].idx = idx;
    nm->m[nm->nm].missing = 0;
    nm->nm++;
    nm->added++;
    return 0;
}


static uint64_t
dns_answer_sig(const kv_res_result_t *r)
{
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ r->total;
    uint32_t i;

    for (i = 0; i < r->naddrs; i++) {
        h = kv_checksum(h, r->addrs[i].addr, 16);
        h = kv_checksum(h, &r->addrs[i].family, sizeof(int));
    }
    return h | 1;                   /* never 0: "nothing said yet" */
}


static void
dns_apply(dns_name_t *nm, const kv_res_result_t *r)
{
    uint32_t i;
    int j, found, rc, dup = 0, full = 0, changed = 0;
    uint64_t sig;

    for (j = 0; j < nm->nm; j++) {
        found = 0;
        for (i = 0; i < r->naddrs && !found; i++) {
            found = kv_res_addr_cmp(&nm->m[j].addr, &r->addrs[i]) == 0;
        }
        nm->m[j].missing = found ? 0 : nm->m[j].missing + 1;
    }
    for (j = 0; j < nm->nm; ) {
        if (nm->m[j].missing >= KV_DNS_GONE_AFTER) {
            dns_member_drop(nm, j, "no longer resolved");
            changed = 1;
            continue;               /* m[j] is now another */
        }
        j++;
    }
    for (i = 0; i < r->naddrs; i++) {
        found = 0;
        for (j = 0; j < nm->nm && !found; j++) {
            found = kv_res_addr_cmp(&nm->m[j].addr, &r->addrs[i]) == 0;
        }
        if (found) {
            continue;
        }
        rc = dns_member_add(nm, &r->addrs[i]);
        dup += rc == 1;
        full += rc == 2;
        changed |= rc == 0;
    }

    sig = dns_answer_sig(r);
    if (sig == nm->sig && !changed) {
        return;                     /* said already */
    }
    nm->sig = sig;
    /* answers that change every period (a flapping server, 100 ms
     * periods): at most KV_LOG_BURST lines a second */
    if (!kv_log_limit(&nm->log_lim)) {
        nm->sig = 0;                /* said when the burst allows */
        return;
    }
    kv_info("kv_events: dns %s: %u address%s, %d followed%s", nm->c->name,
            r->total, r->total == 1 ? "" : "es", nm->nm,
            dup ? " (some already sources under another name)" : "");
    if (r->total > r->naddrs) {
        kv_warn("kv_events: dns %s: %u addresses: only the first %u "
                "(sorted) are considered", nm->c->name, r->total,
                r->naddrs);
    }
    if (full) {
        kv_warn("kv_events: dns %s: %d address%s not followed: at most %d "
                "sources (and %d prefix index nodes) in all; taken when "
                "room is made", nm->c->name, full, full == 1 ? "" : "es",
                KV_EVS_MAX_SOURCES, DPD_PFX_MAX_NODES);
        nm->sig = 0;                /* said again when it changes */
    }
}


static void
dns_answer(void *data, const kv_res_result_t *r)
{
    dns_name_t *nm = data;
    uint64_t now = kv_now_ms();

    nm->req = 0;
    if (r->status != KV_RES_OK) {
        nm->failures++;
        if (nm->fails++ == 0 || now - nm->t_fail_log >= KV_DNS_FAIL_LOG_MS) {
            nm->t_fail_log = now;
            kv_warn("kv_events: dns %s: cannot resolve: %s (%llu failures "
                    "in a row); its %d source%s kept", nm->c->name,
                    r->error, (unsigned long long) nm->fails, nm->nm,
                    nm->nm == 1 ? "" : "s");
        }
        return;
    }
    if (nm->fails) {
        kv_info("kv_events: dns %s: resolved again after %llu failures",
                nm->c->name, (unsigned long long) nm->fails);
        nm->fails = 0;
    }
    nm->answers++;
    dns_apply(nm, r);
}


struct kv_evs_dns *
kv_evs_dns_open(const kv_evs_conf_t *c, struct kv_evs *evs,
    kv_pfx_feed_t *feed)
{
    struct kv_evs_dns *d;
    kv_res_conf_t rc;
    int i;

    d = calloc(1, sizeof(*d));
    if (d == NULL) {
        return NULL;
    }
    d->names = calloc((size_t) c->ndns, sizeof(dns_name_t));
    memset(&rc, 0, sizeof(rc));
    rc.max_pending = c->ndns;
    rc.max_threads = 2;
    d->res = kv_res_create(&rc);
    if (d->names == NULL || d->res == NULL) {
        kv_err("kv_events: cannot start the resolver: %s", strerror(errno));
        kv_evs_dns_close(d);
        return NULL;
    }
    d->evs = evs;
    d->feed = feed;
    d->n = c->ndns;
    for (i = 0; i < c->ndns; i++) {
        d->names[i].d = d;
        d->names[i].c = &c->dns[i];
        kv_info("kv_events: dns %s: publishers on port %d%s%.0d, nodes "
                "ADDRESS:%d, resolved every %d ms", c->dns[i].name,
                c->dns[i].port, c->dns[i].replay_port ? ", replay on "
                                                      : "",
                c->dns[i].replay_port, c->dns[i].http_port,
                c->dns[i].resolve_ms);
    }
    return d;
}


int
kv_evs_dns_pollfds(struct kv_evs_dns *d, struct pollfd *pfd, int max)
{
    if (d == NULL || max < 1) {
        return 0;
    }
    pfd[0].fd = kv_res_fd(d->res);
    pfd[0].events = POLLIN;
    pfd[0].revents = 0;
    return 1;
}


void
kv_evs_dns_process(struct kv_evs_dns *d)
{
    dns_name_t *nm;
    uint64_t now;
    int i;

    if (d == NULL) {
        return;
    }
    now = kv_now_ms();
    if (now - d->t_tick < KV_DNS_TICK_MS) {
        return;                     /* the loop turns far more often */
    }
    d->t_tick = now;
    kv_res_process(d->res);
    for (i = 0; i < d->n; i++) {
        nm = &d->names[i];
        if (nm->req != 0 || now < nm->next_ms) {
            continue;
        }
        nm->next_ms = now + (uint64_t) nm->c->resolve_ms;
        nm->req = kv_res_start(d->res, nm->c->name, nm->c->port,
                               nm->c->family, dns_answer, nm);
        if (nm->req == 0) {
            nm->failures++;
            if (nm->fails++ == 0
                || now - nm->t_fail_log >= KV_DNS_FAIL_LOG_MS)
            {
                nm->t_fail_log = now;
                kv_warn("kv_events: dns %s: lookup not started: %s",
                        nm->c->name, strerror(errno));
            }
        }
    }
}


void
kv_evs_dns_close(struct kv_evs_dns *d)
{
    int i;

    if (d == NULL) {
        return;
    }
    for (i = 0; d->names != NULL && i < d->n; i++) {
        kv_info("kv_events: dns %s: %llu answers, %llu failed lookups, "
                "%llu sources added, %llu removed", d->names[i].c->name,
                (unsigned long long) d->names[i].answers,
                (unsigned long long) d->names[i].failures,
                (unsigned long long) d->names[i].added,
                (unsigned long long) d->names[i].removed);
    }
    /* a lookup stuck in getaddrinfo() is not waited for (resolve.h);
     * the sources themselves close with the subscriber */
    kv_res_destroy(d->res);
    free(d->names);
    free(d);
}
