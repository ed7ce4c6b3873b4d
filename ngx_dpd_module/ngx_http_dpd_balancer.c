/*
 * dpd_balance: least outstanding requests with a pinned-peer override.
 *
 * The counts are the round-robin peers' "conns", which live in the upstream
 * zone when one is configured, so every worker sees every outstanding
 * request.  Peer state (down, backup, max_fails/fail_timeout, max_conns) is
 * honoured the way nginx's least_conn does; failures are recorded by the
 * round-robin free handler we keep.
 */

#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "ngx_http_dpd_balancer.h"
#include "ngx_http_dpd_state.h"


typedef struct {
    /* the round-robin data must be first: rr's free handler gets it */
    ngx_http_upstream_rr_peer_data_t   rrp;
    ngx_http_dpd_pin_t                *pin;
    ngx_http_request_t                *request;   /* readiness lookups */
} ngx_http_dpd_balancer_peer_data_t;


/* what the kv_agent state table says about one peer */
#define NGX_HTTP_DPD_READY_UNKNOWN  0   /* no table or no record: usable */
#define NGX_HTTP_DPD_READY_ALIVE    1
#define NGX_HTTP_DPD_READY_DEAD     2


static ngx_int_t ngx_http_dpd_balancer_init_upstream(ngx_conf_t *cf,
    ngx_http_upstream_srv_conf_t *us);
static ngx_int_t ngx_http_dpd_balancer_init_peer(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us);
static ngx_int_t ngx_http_dpd_balancer_get_peer(ngx_peer_connection_t *pc,
    void *data);
static ngx_int_t ngx_http_dpd_balancer_get_pinned(ngx_peer_connection_t *pc,
    ngx_http_dpd_balancer_peer_data_t *bp);
static ngx_http_upstream_rr_peer_t *ngx_http_dpd_balancer_least(
    ngx_http_request_t *r, ngx_http_upstream_rr_peers_t *peers,
    uintptr_t *tried, time_t now, ngx_uint_t *index);
static ngx_http_upstream_rr_peer_t *ngx_http_dpd_balancer_least_pass(
    ngx_http_request_t *r, ngx_http_upstream_rr_peers_t *peers,
    uintptr_t *tried, time_t now, ngx_uint_t *index, ngx_uint_t *dead);
static ngx_uint_t ngx_http_dpd_balancer_ready(ngx_http_request_t *r,
    ngx_http_upstream_rr_peer_t *peer, uint64_t *free_blocks);
static ngx_uint_t ngx_http_dpd_balancer_usable(
    ngx_http_upstream_rr_peers_t *peers, ngx_http_upstream_rr_peer_t *peer,
    uintptr_t *tried, ngx_uint_t i, time_t now);
static void ngx_http_dpd_balancer_release(ngx_http_dpd_pin_t *pin);
static void ngx_http_dpd_balancer_pin_cleanup(void *data);
static void *ngx_http_dpd_balancer_create_srv_conf(ngx_conf_t *cf);
static char *ngx_http_dpd_balance(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
static char *ngx_http_dpd_lmcache_ports(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
static ngx_array_t *ngx_http_dpd_parse_ports(ngx_conf_t *cf, ngx_str_t *s);


static ngx_command_t  ngx_http_dpd_balancer_commands[] = {

    { ngx_string("dpd_balance"),
      NGX_HTTP_UPS_CONF|NGX_CONF_NOARGS,
      ngx_http_dpd_balance,
      NGX_HTTP_SRV_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("dpd_lmcache_ports"),
      NGX_HTTP_UPS_CONF|NGX_CONF_TAKE12,
      ngx_http_dpd_lmcache_ports,
      NGX_HTTP_SRV_CONF_OFFSET,
      0,
      NULL },

      ngx_null_command
};


static ngx_http_module_t  ngx_http_dpd_balancer_module_ctx = {
    NULL,                                  /* preconfiguration */
    NULL,                                  /* postconfiguration */

    NULL,                                  /* create main configuration */
    NULL,                                  /* init main configuration */

    ngx_http_dpd_balancer_create_srv_conf, /* create server configuration */
    NULL,                                  /* merge server configuration */

    NULL,                                  /* create location configuration */
    NULL                                   /* merge location configuration */
};


ngx_module_t  ngx_http_dpd_balancer_module = {
    NGX_MODULE_V1,
    &ngx_http_dpd_balancer_module_ctx,     /* module context */
    ngx_http_dpd_balancer_commands,        /* module directives */
    NGX_HTTP_MODULE,                       /* module type */
    NULL,                                  /* init master */
    NULL,                                  /* init module */
    NULL,                                  /* init process */
    NULL,                                  /* init thread */
    NULL,                                  /* exit thread */
    NULL,                                  /* exit process */
    NULL,                                  /* exit master */
    NGX_MODULE_V1_PADDING
};


static ngx_str_t  ngx_http_dpd_unnamed = ngx_string("?");


#define ngx_http_dpd_bit_word(i)  ((i) / (8 * sizeof(uintptr_t)))
#define ngx_http_dpd_bit_mask(i)                                            \
    ((uintptr_t) 1 << (i) % (8 * sizeof(uintptr_t)))


static ngx_int_t
ngx_http_dpd_balancer_init_upstream(ngx_conf_t *cf,
    ngx_http_upstream_srv_conf_t *us)
{
    ngx_core_conf_t                   *ccf;
    ngx_http_dpd_balancer_srv_conf_t  *bscf;

    ngx_log_debug0(NGX_LOG_DEBUG_HTTP, cf->log, 0, "dpd balancer init");

    if (ngx_http_upstream_init_round_robin(cf, us) != NGX_OK) {
        return NGX_ERROR;
    }

    /*
     * Without a zone every worker has its own copy of the peers and counts
     * only its own requests: least outstanding is then per worker, and so
     * are max_conns and max_fails.  That is exact with one worker, so warn
     * (not fail: existing configs keep loading) only when there may be
     * several.  worker_processes and master_process are known here when
     * they precede http{}, as they normally do; unset means one worker.
     */

    ccf = (ngx_core_conf_t *) ngx_get_conf(cf->cycle->conf_ctx,
                                           ngx_core_module);
    bscf = ngx_http_conf_upstream_srv_conf(us, ngx_http_dpd_balancer_module);

    if (us->shm_zone == NULL
        && ccf->master != 0
        && ccf->worker_processes != NGX_CONF_UNSET
        && ccf->worker_processes > 1)
    {
        ngx_log_error(NGX_LOG_WARN, cf->log, 0,
                      "\"dpd_balance\" in upstream \"%V\" without \"zone\": "
                      "each of the %i worker processes counts only its own "
                      "requests to its peers in %V:%ui",
                      &us->host, ccf->worker_processes, &bscf->file,
                      bscf->line);
    }

    us->peer.init = ngx_http_dpd_balancer_init_peer;

    return NGX_OK;
}


static ngx_int_t
ngx_http_dpd_balancer_init_peer(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us)
{
    ngx_http_dpd_pin_t                 *pin;
    ngx_http_dpd_balancer_peer_data_t  *bp;

    bp = ngx_pcalloc(r->pool, sizeof(ngx_http_dpd_balancer_peer_data_t));
    if (bp == NULL) {
        return NGX_ERROR;
    }

    r->upstream->peer.data = &bp->rrp;

    if (ngx_http_upstream_init_round_robin_peer(r, us) != NGX_OK) {
        return NGX_ERROR;
    }

    r->upstream->peer.get = ngx_http_dpd_balancer_get_peer;

    bp->request = r;

    pin = ngx_http_dpd_balancer_get_pin(r);

    if (pin != NULL) {
        if (pin->upstream == us) {
            /* the KV was sent to this one peer: no second choice */
            bp->pin = pin;
            r->upstream->peer.tries = 1;

        } else {
            ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                          "dpd: request pinned to a peer of upstream \"%V\" "
                          "but proxied to upstream \"%V\", pin ignored",
                          &pin->upstream->host, &us->host);
        }
    }

    return NGX_OK;
}


static ngx_int_t
ngx_http_dpd_balancer_get_peer(ngx_peer_connection_t *pc, void *data)
{
    ngx_http_dpd_balancer_peer_data_t  *bp = data;

    time_t                         now;
    ngx_int_t                      rc;
    ngx_uint_t                     i, n, p;
    ngx_http_upstream_rr_peer_t   *best, *peer;
    ngx_http_upstream_rr_peers_t  *peers;
    ngx_http_upstream_rr_peer_data_t  *rrp;

    if (bp->pin) {
        return ngx_http_dpd_balancer_get_pinned(pc, bp);
    }

    rrp = &bp->rrp;

    ngx_log_debug1(NGX_LOG_DEBUG_HTTP, pc->log, 0,
                   "dpd balancer get peer, try: %ui", pc->tries);

    if (rrp->peers->single) {
        return ngx_http_upstream_get_round_robin_peer(pc, rrp);
    }

    pc->cached = 0;
    pc->connection = NULL;

    now = ngx_time();
    peers = rrp->peers;

    ngx_http_upstream_rr_peers_wlock(peers);

    best = ngx_http_dpd_balancer_least(bp->request, peers, rrp->tried, now,
                                       &p);

    if (best == NULL) {
        goto failed;
    }

    if (now - best->checked > best->fail_timeout) {
        best->checked = now;
    }

    pc->sockaddr = best->sockaddr;
    pc->socklen = best->socklen;
    pc->name = &best->name;

    best->conns++;

    rrp->current = best;
    rrp->tried[ngx_http_dpd_bit_word(p)] |= ngx_http_dpd_bit_mask(p);

    ngx_log_debug2(NGX_LOG_DEBUG_HTTP, pc->log, 0,
                   "dpd balancer chose %V, outstanding %ui",
                   &best->name, best->conns);

    ngx_http_upstream_rr_peers_unlock(peers);

    return NGX_OK;

failed:

    if (peers->next) {
        ngx_log_debug0(NGX_LOG_DEBUG_HTTP, pc->log, 0,
                       "dpd balancer: trying backup servers");

        rrp->peers = peers->next;

        n = (rrp->peers->number + (8 * sizeof(uintptr_t) - 1))
            / (8 * sizeof(uintptr_t));

        for (i = 0; i < n; i++) {
            rrp->tried[i] = 0;
        }

        ngx_http_upstream_rr_peers_unlock(peers);

        rc = ngx_http_dpd_balancer_get_peer(pc, bp);

        if (rc != NGX_BUSY) {
            return rc;
        }

        ngx_http_upstream_rr_peers_wlock(peers);
    }

    /* every peer failed: forget the failures for a quick recovery */

    for (peer = peers->peer; peer; peer = peer->next) {
        peer->fails = 0;
    }

    ngx_http_upstream_rr_peers_unlock(peers);

    pc->name = peers->name;

    return NGX_BUSY;
}


static ngx_int_t
ngx_http_dpd_balancer_get_pinned(ngx_peer_connection_t *pc,
    ngx_http_dpd_balancer_peer_data_t *bp)
{
    time_t                             now;
    ngx_uint_t                         i, known;
    ngx_http_dpd_pin_t                *pin;
    ngx_http_upstream_rr_peer_t       *peer;
    ngx_http_upstream_rr_peers_t      *list;
    ngx_http_upstream_rr_peer_data_t  *rrp;

    pin = bp->pin;
    rrp = &bp->rrp;

    if (pin->used) {
        /* one try only: the KV is on that peer and nowhere else */
        pc->name = &pin->name;
        return NGX_BUSY;
    }

    pc->cached = 0;
    pc->connection = NULL;

    /* the pin must still name a peer of this upstream's lists */

    known = 0;

    for (list = pin->upstream->peer.data; list; list = list->next) {
        if (list == pin->peers) {
            known = 1;
            break;
        }
    }

    if (!known) {
        ngx_log_error(NGX_LOG_ERR, pc->log, 0,
                      "dpd: pinned peer %V is no longer in upstream \"%V\"",
                      &pin->name, &pin->upstream->host);
        pc->name = &pin->name;
        return NGX_BUSY;
    }

    now = ngx_time();
    list = pin->peers;

    ngx_http_upstream_rr_peers_wlock(list);

    for (peer = list->peer, i = 0; peer; peer = peer->next, i++) {
        if (peer == pin->peer) {
            break;
        }
    }

    if (peer == NULL) {
        ngx_http_upstream_rr_peers_unlock(list);
        pc->name = &pin->name;
        return NGX_BUSY;
    }

    if (!pin->reserved) {
        peer->conns++;
    }

    /* from now on the count belongs to the connection: rr free drops it */
    pin->handed = 1;
    pin->used = 1;

    if (now - peer->checked > peer->fail_timeout) {
        peer->checked = now;
    }

    pc->sockaddr = peer->sockaddr;
    pc->socklen = peer->socklen;
    pc->name = &peer->name;

    rrp->peers = list;
    rrp->current = peer;
    rrp->tried[ngx_http_dpd_bit_word(i)] |= ngx_http_dpd_bit_mask(i);

    ngx_http_upstream_rr_peers_unlock(list);

    ngx_log_debug1(NGX_LOG_DEBUG_HTTP, pc->log, 0,
                   "dpd balancer pinned peer %V", &pin->name);

    return NGX_OK;
}


/*
 * The usable peer with the fewest outstanding requests per weight; among
 * equally loaded peers the one with the most free KV blocks (kv_agent state
 * table; no record counts as 0); peers equal in both share by smooth
 * weighted round robin.  Peers the table knows as dead are skipped, unless
 * that would leave none: the table is advice (a stale table says every node
 * is dead), nginx's own max_fails still applies.  Peers lock held.
 */

static ngx_http_upstream_rr_peer_t *
ngx_http_dpd_balancer_least(ngx_http_request_t *r,
    ngx_http_upstream_rr_peers_t *peers, uintptr_t *tried, time_t now,
    ngx_uint_t *index)
{
    ngx_uint_t                    dead;
    ngx_http_upstream_rr_peer_t  *best;

    if (r != NULL && !ngx_http_dpd_state_enabled(r)) {
        r = NULL;
    }

    dead = 0;

    best = ngx_http_dpd_balancer_least_pass(r, peers, tried, now, index,
                                            &dead);

    if (best == NULL && dead) {
        /* info: the state module already warns about a stale table */
        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "dpd: the state table says every usable peer of "
                      "upstream \"%V\" is dead, ignoring it",
                      peers->name ? peers->name : &ngx_http_dpd_unnamed);

        best = ngx_http_dpd_balancer_least_pass(NULL, peers, tried, now,
                                                index, &dead);
    }

    return best;
}


static ngx_http_upstream_rr_peer_t *
ngx_http_dpd_balancer_least_pass(ngx_http_request_t *r,
    ngx_http_upstream_rr_peers_t *peers, uintptr_t *tried, time_t now,
    ngx_uint_t *index, ngx_uint_t *dead)
{
    uint64_t                      free, best_free;
    ngx_int_t                     total;
    ngx_uint_t                    i, p, many;
    ngx_http_upstream_rr_peer_t  *peer, *best, *first;

    best = NULL;
    best_free = 0;
    many = 0;
    p = 0;

    for (peer = peers->peer, i = 0; peer; peer = peer->next, i++) {

        if (!ngx_http_dpd_balancer_usable(peers, peer, tried, i, now)) {
            continue;
        }

        free = 0;

        if (r
            && ngx_http_dpd_balancer_ready(r, peer, &free)
               == NGX_HTTP_DPD_READY_DEAD)
        {
            (*dead)++;
            continue;
        }

        if (best == NULL
            || peer->conns * best->weight < best->conns * peer->weight
            || (peer->conns * best->weight == best->conns * peer->weight
                && free > best_free))
        {
            best = peer;
            best_free = free;
            many = 0;
            p = i;

        } else if (peer->conns * best->weight == best->conns * peer->weight
                   && free == best_free)
        {
            many = 1;
        }
    }

    if (best == NULL) {
        return NULL;
    }

    if (many) {
        first = best;
        total = 0;
        best = NULL;

        for (peer = first, i = p; peer; peer = peer->next, i++) {

            if (!ngx_http_dpd_balancer_usable(peers, peer, tried, i, now)) {
                continue;
            }

            if (peer->conns * first->weight != first->conns * peer->weight) {
                continue;
            }

            free = 0;

            if (r
                && (ngx_http_dpd_balancer_ready(r, peer, &free)
                    == NGX_HTTP_DPD_READY_DEAD
                    || free != best_free))
            {
                /* the table may have moved since the first pass */
                continue;
            }

            peer->current_weight += peer->effective_weight;
            total += peer->effective_weight;

            if (peer->effective_weight < peer->weight) {
                peer->effective_weight++;
            }

            if (best == NULL || peer->current_weight > best->current_weight) {
                best = peer;
                *index = i;
            }
        }

        if (best == NULL) {
            *index = p;
            return first;
        }

        best->current_weight -= total;

        return best;
    }

    *index = p;

    return best;
}


/*
 * The kv_agent's view of a peer, by its "host:port" name: one probe of the
 * worker's own address index (ngx_http_dpd_state.c re-reads the table on a
 * timer), so the cost does not grow with the table and nothing of the
 * table file is touched while the peers lock is held.
 */

static ngx_uint_t
ngx_http_dpd_balancer_ready(ngx_http_request_t *r,
    ngx_http_upstream_rr_peer_t *peer, uint64_t *free_blocks)
{
    ngx_http_dpd_state_node_t  node;

    *free_blocks = 0;

    if (ngx_http_dpd_state_node_by_addr(r, &peer->name, &node) != NGX_OK) {
        return NGX_HTTP_DPD_READY_UNKNOWN;
    }

    if (!node.alive) {
        return NGX_HTTP_DPD_READY_DEAD;
    }

    *free_blocks = node.free_blocks;

    return NGX_HTTP_DPD_READY_ALIVE;
}


static ngx_uint_t
ngx_http_dpd_balancer_usable(ngx_http_upstream_rr_peers_t *peers,
    ngx_http_upstream_rr_peer_t *peer, uintptr_t *tried, ngx_uint_t i,
    time_t now)
{
    if (tried
        && (tried[ngx_http_dpd_bit_word(i)] & ngx_http_dpd_bit_mask(i)))
    {
        return 0;
    }

    if (peer->down) {
        return 0;
    }

    if (peer->max_conns && peer->conns >= peer->max_conns) {
        return 0;
    }

    /* a lone peer is always tried, as round robin does */

    if (!peers->single
        && peer->max_fails
        && peer->fails >= peer->max_fails
        && now - peer->checked <= peer->fail_timeout)
    {
        return 0;
    }

    return 1;
}


ngx_int_t
ngx_http_dpd_balancer_pin(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us, ngx_http_dpd_pin_t **pinp)
{
    time_t                             now;
    ngx_uint_t                         p;
    ngx_pool_cleanup_t                *cln;
    ngx_http_dpd_pin_t                *pin;
    ngx_http_upstream_rr_peer_t       *best;
    ngx_http_upstream_rr_peers_t      *list;
    ngx_http_dpd_balancer_srv_conf_t  *bscf;

    *pinp = NULL;

    /*
     * Ask the srv conf, not us->peer.init: "keepalive" (and any module
     * that wraps the balancer) replaces peer.init with its own and calls
     * ours from it, so the pin is still honoured behind it.
     */

    bscf = ngx_http_conf_upstream_srv_conf(us, ngx_http_dpd_balancer_module);

    if (us->peer.data == NULL || bscf == NULL || !bscf->balance) {
        ngx_log_error(NGX_LOG_ALERT, r->connection->log, 0,
                      "dpd: upstream \"%V\" does not use dpd_balance",
                      &us->host);
        return NGX_ERROR;
    }

    /* a second choice for the same request replaces the first */
    ngx_http_dpd_balancer_unpin(r);

    pin = ngx_pcalloc(r->pool, sizeof(ngx_http_dpd_pin_t));
    if (pin == NULL) {
        return NGX_ERROR;
    }

    /* registered before reserving, so no path can leak the reservation */
    cln = ngx_pool_cleanup_add(r->pool, 0);
    if (cln == NULL) {
        return NGX_ERROR;
    }

    cln->handler = ngx_http_dpd_balancer_pin_cleanup;
    cln->data = pin;

    now = ngx_time();
    best = NULL;

    for (list = us->peer.data; list; list = list->next) {

        ngx_http_upstream_rr_peers_wlock(list);

        best = ngx_http_dpd_balancer_least(r, list, NULL, now, &p);

        if (best) {
            best->conns++;

            if (now - best->checked > best->fail_timeout) {
                best->checked = now;
            }

            ngx_http_upstream_rr_peers_unlock(list);
            break;
        }

        ngx_http_upstream_rr_peers_unlock(list);
    }

    if (best == NULL) {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "dpd: no live peer in upstream \"%V\" to pin",
                      &us->host);
        return NGX_BUSY;
    }

    pin->upstream = us;
    pin->peers = list;
    pin->peer = best;
    pin->reserved = 1;

    /* the peer's name and address do not change while the cycle lives */

    pin->name.data = ngx_pstrdup(r->pool, &best->name);
    if (pin->name.data == NULL) {
        return NGX_ERROR;
    }

    pin->name.len = best->name.len;

    if (ngx_http_dpd_sockaddr_host(r->pool, best->sockaddr, best->socklen,
                                   &pin->host)
        != NGX_OK)
    {
        return NGX_ERROR;
    }

    ngx_http_set_ctx(r, pin, ngx_http_dpd_balancer_module);

    ngx_log_debug1(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "dpd balancer pinned %V", &pin->name);

    *pinp = pin;

    return NGX_OK;
}


void
ngx_http_dpd_balancer_unpin(ngx_http_request_t *r)
{
    ngx_http_dpd_pin_t  *pin;

    pin = ngx_http_dpd_balancer_get_pin(r);

    if (pin == NULL) {
        return;
    }

    ngx_http_dpd_balancer_release(pin);

    ngx_http_set_ctx(r, NULL, ngx_http_dpd_balancer_module);
}


ngx_http_dpd_pin_t *
ngx_http_dpd_balancer_get_pin(ngx_http_request_t *r)
{
    return ngx_http_get_module_ctx(r, ngx_http_dpd_balancer_module);
}


static void
ngx_http_dpd_balancer_release(ngx_http_dpd_pin_t *pin)
{
    ngx_http_upstream_rr_peers_t  *list;

    if (!pin->reserved || pin->handed) {
        return;
    }

    list = pin->peers;

    ngx_http_upstream_rr_peers_wlock(list);

    if (pin->peer->conns) {
        pin->peer->conns--;
    }

    ngx_http_upstream_rr_peers_unlock(list);

    pin->reserved = 0;
}


static void
ngx_http_dpd_balancer_pin_cleanup(void *data)
{
    ngx_http_dpd_pin_t  *pin = data;

    if (pin->peer) {
        ngx_http_dpd_balancer_release(pin);
    }
}


ngx_http_dpd_balancer_srv_conf_t *
ngx_http_dpd_balancer_srv_conf(ngx_http_upstream_srv_conf_t *us)
{
    if (us->srv_conf == NULL) {
        /* an implicit upstream made by proxy_pass http://host:port */
        return NULL;
    }

    return ngx_http_conf_upstream_srv_conf(us, ngx_http_dpd_balancer_module);
}


ngx_http_upstream_srv_conf_t *
ngx_http_dpd_balancer_find_upstream(ngx_conf_t *cf, ngx_str_t *name,
    ngx_uint_t need_ports, char **err)
{
    ngx_uint_t                         i, found;
    ngx_http_upstream_srv_conf_t     **uscfp, *us;
    ngx_http_upstream_main_conf_t     *umcf;
    ngx_http_dpd_balancer_srv_conf_t  *bscf;

    umcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_upstream_module);

    uscfp = umcf->upstreams.elts;
    us = NULL;
    found = 0;

    for (i = 0; i < umcf->upstreams.nelts; i++) {

        if (!(uscfp[i]->flags & NGX_HTTP_UPSTREAM_CREATE)) {
            continue;
        }

        bscf = ngx_http_dpd_balancer_srv_conf(uscfp[i]);
        if (bscf == NULL) {
            continue;
        }

        if (name->len) {
            if (uscfp[i]->host.len == name->len
                && ngx_strncasecmp(uscfp[i]->host.data, name->data,
                                   name->len) == 0)
            {
                us = uscfp[i];
                found = 1;
                break;
            }

            continue;
        }

        if (bscf->init_ports) {
            us = uscfp[i];
            found++;
        }
    }

    if (found == 0) {
        *err = name->len ? "no upstream{} block of that name"
                         : "lmcache needs an upstream{} with "
                           "\"dpd_lmcache_ports\"";
        return NULL;
    }

    if (found > 1) {
        *err = "several upstreams carry \"dpd_lmcache_ports\": name the "
               "decode pool with \"dpd_decode_upstream\"";
        return NULL;
    }

    bscf = ngx_http_dpd_balancer_srv_conf(us);

    if (!bscf->balance) {
        *err = "the decode upstream must use \"dpd_balance\"";
        return NULL;
    }

    if (need_ports && bscf->init_ports == NULL) {
        *err = "the decode upstream has no \"dpd_lmcache_ports\"";
        return NULL;
    }

    return us;
}


ngx_int_t
ngx_http_dpd_sockaddr_host(ngx_pool_t *pool, struct sockaddr *sa,
    socklen_t socklen, ngx_str_t *host)
{
    size_t  len;
    u_char  buf[NGX_SOCKADDR_STRLEN];

    len = ngx_sock_ntop(sa, socklen, buf, NGX_SOCKADDR_STRLEN, 0);
    if (len == 0) {
        return NGX_ERROR;
    }

    host->data = ngx_pnalloc(pool, len);
    if (host->data == NULL) {
        return NGX_ERROR;
    }

    ngx_memcpy(host->data, buf, len);
    host->len = len;

    return NGX_OK;
}


static void *
ngx_http_dpd_balancer_create_srv_conf(ngx_conf_t *cf)
{
    ngx_http_dpd_balancer_srv_conf_t  *conf;

    /*
     * set by ngx_pcalloc():
     *
     *     conf->balance = 0;
     *     conf->file = { 0, NULL };
     *     conf->line = 0;
     *     conf->init_ports = NULL;
     *     conf->alloc_ports = NULL;
     */

    conf = ngx_pcalloc(cf->pool, sizeof(ngx_http_dpd_balancer_srv_conf_t));

    return conf;
}


static char *
ngx_http_dpd_balance(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_dpd_balancer_srv_conf_t *bscf = conf;

    ngx_http_upstream_srv_conf_t  *uscf;

    if (bscf->balance) {
        return "is duplicate";
    }

    uscf = ngx_http_conf_get_module_srv_conf(cf, ngx_http_upstream_module);

    if (uscf->peer.init_upstream) {
        ngx_conf_log_error(NGX_LOG_WARN, cf, 0,
                           "load balancing method redefined");
    }

    uscf->peer.init_upstream = ngx_http_dpd_balancer_init_upstream;

    bscf->file = cf->conf_file->file.name;
    bscf->line = cf->conf_file->line;

    uscf->flags = NGX_HTTP_UPSTREAM_CREATE
                  |NGX_HTTP_UPSTREAM_WEIGHT
                  |NGX_HTTP_UPSTREAM_MAX_CONNS
                  |NGX_HTTP_UPSTREAM_MAX_FAILS
                  |NGX_HTTP_UPSTREAM_FAIL_TIMEOUT
                  |NGX_HTTP_UPSTREAM_DOWN
                  |NGX_HTTP_UPSTREAM_BACKUP;

    bscf->balance = 1;

    return NGX_CONF_OK;
}


static char *
ngx_http_dpd_lmcache_ports(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_dpd_balancer_srv_conf_t *bscf = conf;

    ngx_str_t   *value, s;
    ngx_uint_t   i;

    if (bscf->init_ports) {
        return "is duplicate";
    }

    value = cf->args->elts;

    for (i = 1; i < cf->args->nelts; i++) {

        if (ngx_strncmp(value[i].data, "init=", 5) == 0) {
            if (bscf->init_ports) {
                goto invalid;
            }

            s.data = value[i].data + 5;
            s.len = value[i].len - 5;

            bscf->init_ports = ngx_http_dpd_parse_ports(cf, &s);
            if (bscf->init_ports == NULL) {
                goto invalid;
            }

            continue;
        }

        if (ngx_strncmp(value[i].data, "alloc=", 6) == 0) {
            if (bscf->alloc_ports) {
                goto invalid;
            }

            s.data = value[i].data + 6;
            s.len = value[i].len - 6;

            bscf->alloc_ports = ngx_http_dpd_parse_ports(cf, &s);
            if (bscf->alloc_ports == NULL) {
                goto invalid;
            }

            continue;
        }

        goto invalid;
    }

    if (bscf->init_ports == NULL || bscf->alloc_ports == NULL) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "\"dpd_lmcache_ports\" needs both init= and "
                           "alloc=");
        return NGX_CONF_ERROR;
    }

    if (bscf->init_ports->nelts != bscf->alloc_ports->nelts) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "\"dpd_lmcache_ports\": init= and alloc= must "
                           "list one port per TP rank each (%ui vs %ui)",
                           bscf->init_ports->nelts,
                           bscf->alloc_ports->nelts);
        return NGX_CONF_ERROR;
    }

    return NGX_CONF_OK;

invalid:

    ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                       "invalid parameter \"%V\"", &value[i]);

    return NGX_CONF_ERROR;
}


/* "7300,7301,..." -> array of in_port_t; NULL on a bad list */

static ngx_array_t *
ngx_http_dpd_parse_ports(ngx_conf_t *cf, ngx_str_t *s)
{
    u_char       *p, *last, *start;
    ngx_int_t     port;
    in_port_t    *pp;
    ngx_array_t  *a;

    a = ngx_array_create(cf->pool, 2, sizeof(in_port_t));
    if (a == NULL) {
        return NULL;
    }

    p = s->data;
    last = s->data + s->len;

    while (p <= last) {
        start = p;

        while (p < last && *p != ',') {
            p++;
        }

        port = ngx_atoi(start, p - start);

        if (port < 1 || port > 65535) {
            return NULL;
        }

        if (a->nelts == NGX_HTTP_DPD_MAX_TP_RANKS) {
            return NULL;
        }

        pp = ngx_array_push(a);
        if (pp == NULL) {
            return NULL;
        }

        *pp = (in_port_t) port;

        p++;    /* past ',' or one past the end */
    }

    return a;
}
