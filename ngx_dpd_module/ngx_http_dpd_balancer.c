/*
 * dpd_balance: least outstanding requests with a pinned-peer override.
 *
 * The counts are the round-robin peers' "conns", which live in the upstream
 * zone when one is configured, so every worker sees every outstanding
 * request.  Peer state (down, backup, max_fails/fail_timeout, max_conns) is
 * honoured the way nginx's least_conn does; failures are recorded by the
 * round-robin free handler, which ours wraps to count decode retries.
 *
 * nginx 1.27.3+ (NGX_HTTP_DPD_PEER_REFS): with a zone, "server NAME
 * resolve" adds and removes peers at run time.  As 1.30's least_conn does,
 * every peer handed to a connection is referenced (the round-robin free
 * handler drops it), and the peers' configuration generation is compared
 * with the one the request's tried bitmap was made for before the bitmap
 * is used.  Where 1.30's own balancers then give up (NGX_BUSY), we rebuild
 * the bitmap for the new membership from the names of the peers already
 * tried, so a retry neither overruns it nor tries a failed peer again.
 * A pin references its peer: removed meanwhile, the peer is a zombie that
 * lives until the pin lets go, and is no longer found in the list.
 */

#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "ngx_http_dpd_module.h"
#include "ngx_http_dpd_balancer.h"
#include "ngx_http_dpd_state.h"


#if (NGX_HTTP_UPSTREAM_ZONE && nginx_version >= 1027003)

/* peers change at run time ("resolve"): references, config generation */
#define NGX_HTTP_DPD_PEER_REFS  1

#define ngx_http_dpd_peer_ref(peers, peer)                                  \
    ngx_http_upstream_rr_peer_ref(peers, peer)
#define ngx_http_dpd_peer_unref(peers, peer)                                \
    ngx_http_upstream_rr_peer_unref(peers, peer)
#define ngx_http_dpd_peers_config(peers)                                    \
    ((peers)->config ? *(peers)->config : 0)

#else

#define NGX_HTTP_DPD_PEER_REFS  0

#define ngx_http_dpd_peer_ref(peers, peer)
#define ngx_http_dpd_peer_unref(peers, peer)  NGX_OK
#define ngx_http_dpd_peers_config(peers)  0

#endif


/* what "dpd_decode_retry on" (and the default) retries on */
#define NGX_HTTP_DPD_RETRY_DEFAULT                                          \
    (NGX_HTTP_UPSTREAM_FT_ERROR|NGX_HTTP_UPSTREAM_FT_TIMEOUT                 \
     |NGX_HTTP_UPSTREAM_FT_HTTP_502|NGX_HTTP_UPSTREAM_FT_HTTP_503)


typedef struct {
    /* the round-robin data must be first: rr's free handler gets it */
    ngx_http_upstream_rr_peer_data_t   rrp;
    ngx_http_dpd_pin_t                *pin;
    ngx_http_request_t                *request;   /* readiness lookups */
    ngx_http_upstream_rr_peers_t      *primary;   /* us->peer.data */
    ngx_uint_t                         nbits;     /* capacity of rrp.tried */
    ngx_uint_t                         tries;     /* peers handed so far */
    ngx_uint_t                         counted;   /* tries whose retry
                                                     outcome is counted */
    ngx_array_t                       *names;     /* ngx_str_t: peers tried,
                                                     to rebuild the bitmap */
    unsigned                           retry:1;   /* dpd_decode_retry on */
    unsigned                           repin:1;   /* the pinned peer's
                                                     cached connection was
                                                     stale: that peer again */
} ngx_http_dpd_balancer_peer_data_t;


/* what the kv_agent state table says about one peer */
#define NGX_HTTP_DPD_READY_UNKNOWN  0   /* no table or no record: usable */
#define NGX_HTTP_DPD_READY_ALIVE    1
#define NGX_HTTP_DPD_READY_DEAD     2


static ngx_int_t ngx_http_dpd_balancer_init_upstream(ngx_conf_t *cf,
    ngx_http_upstream_srv_conf_t *us);
static ngx_int_t ngx_http_dpd_balancer_init_peer(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us);
static ngx_uint_t ngx_http_dpd_balancer_retry(ngx_http_request_t *r);
static ngx_int_t ngx_http_dpd_balancer_get_peer(ngx_peer_connection_t *pc,
    void *data);
static ngx_int_t ngx_http_dpd_balancer_choose(ngx_peer_connection_t *pc,
    ngx_http_dpd_balancer_peer_data_t *bp);
static ngx_int_t ngx_http_dpd_balancer_mark(
    ngx_http_dpd_balancer_peer_data_t *bp,
    ngx_http_upstream_rr_peers_t *peers, ngx_http_upstream_rr_peer_t *peer,
    ngx_uint_t p);
static ngx_int_t ngx_http_dpd_balancer_tried(
    ngx_http_dpd_balancer_peer_data_t *bp, ngx_uint_t n);
static ngx_int_t ngx_http_dpd_balancer_refresh(
    ngx_http_dpd_balancer_peer_data_t *bp,
    ngx_http_upstream_rr_peers_t *peers);
static ngx_int_t ngx_http_dpd_balancer_move(ngx_http_request_t *r,
    ngx_http_dpd_balancer_peer_data_t *bp, ngx_peer_connection_t *pc);
static void ngx_http_dpd_balancer_free_peer(ngx_peer_connection_t *pc,
    void *data, ngx_uint_t state);
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
static ngx_http_upstream_rr_peer_t *ngx_http_dpd_balancer_named(
    ngx_http_upstream_rr_peers_t *peers, ngx_str_t *name, time_t now);
static ngx_int_t ngx_http_dpd_balancer_pin_peer(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us, ngx_str_t *name,
    ngx_http_dpd_pin_t **pinp);
static void ngx_http_dpd_balancer_release(ngx_http_dpd_pin_t *pin);
static void ngx_http_dpd_balancer_pin_cleanup(void *data);
static void *ngx_http_dpd_balancer_create_srv_conf(ngx_conf_t *cf);
static void *ngx_http_dpd_balancer_create_loc_conf(ngx_conf_t *cf);
static char *ngx_http_dpd_balancer_merge_loc_conf(ngx_conf_t *cf,
    void *parent, void *child);
static char *ngx_http_dpd_decode_retry(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
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

    { ngx_string("dpd_decode_retry"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_1MORE,
      ngx_http_dpd_decode_retry,
      NGX_HTTP_LOC_CONF_OFFSET,
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

    ngx_http_dpd_balancer_create_loc_conf, /* create location configuration */
    ngx_http_dpd_balancer_merge_loc_conf   /* merge location configuration */
};


/* dpd_decode_retry conditions, as proxy_next_upstream spells them */
static ngx_conf_bitmask_t  ngx_http_dpd_retry_masks[] = {
    { ngx_string("error"), NGX_HTTP_UPSTREAM_FT_ERROR },
    { ngx_string("timeout"), NGX_HTTP_UPSTREAM_FT_TIMEOUT },
    { ngx_string("http_500"), NGX_HTTP_UPSTREAM_FT_HTTP_500 },
    { ngx_string("http_502"), NGX_HTTP_UPSTREAM_FT_HTTP_502 },
    { ngx_string("http_503"), NGX_HTTP_UPSTREAM_FT_HTTP_503 },
    { ngx_string("http_504"), NGX_HTTP_UPSTREAM_FT_HTTP_504 },
    { ngx_string("http_429"), NGX_HTTP_UPSTREAM_FT_HTTP_429 },
    { ngx_null_string, 0 }
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
    ngx_uint_t                          n;
    ngx_http_dpd_pin_t                 *pin;
    ngx_http_upstream_rr_peers_t       *peers;
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
    r->upstream->peer.free = ngx_http_dpd_balancer_free_peer;

    bp->request = r;
    bp->primary = us->peer.data;

    /*
     * The tried bitmap, sized here rather than taken from rr: its size and
     * the configuration generation it is good for come from one look under
     * the lock (the membership may change between rr's look and ours).
     */

    peers = bp->primary;

    ngx_http_upstream_rr_peers_rlock(peers);

    n = peers->number;

    if (peers->next && peers->next->number > n) {
        n = peers->next->number;
    }

#if (NGX_HTTP_DPD_PEER_REFS)
    bp->rrp.config = ngx_http_dpd_peers_config(peers);
#endif

    ngx_http_upstream_rr_peers_unlock(peers);

    if (n <= 8 * sizeof(uintptr_t)) {
        bp->rrp.tried = &bp->rrp.data;
        bp->rrp.data = 0;
        bp->nbits = 8 * sizeof(uintptr_t);

    } else if (ngx_http_dpd_balancer_tried(bp, n) != NGX_OK) {
        return NGX_ERROR;
    }

    bp->retry = ngx_http_dpd_balancer_retry(r);

    pin = ngx_http_dpd_balancer_get_pin(r);

    if (pin != NULL) {
        if (pin->upstream == us) {
            bp->pin = pin;

            if (!bp->retry) {
                /* the KV was sent to this one peer: no second choice */
                r->upstream->peer.tries = 1;
            }

        } else {
            ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                          "dpd: request pinned to a peer of upstream \"%V\" "
                          "but proxied to upstream \"%V\", pin ignored",
                          &pin->upstream->host, &us->host);
        }
    }

    return NGX_OK;
}


/*
 * Whether the decode leg of this request may go to another decoder, and if
 * so the request's upstream configuration made to say it.
 *
 * nginx sends a POST to a second peer only for errors before the request
 * went out (connect refused), unless proxy_next_upstream says
 * non_idempotent: a POST may have done something.  The decode of a request
 * dpd routed does nothing but compute, and nothing of the failed decoder's
 * answer reached the client (nginx never goes to the next peer once the
 * response header was taken), so repeating it elsewhere is what the client
 * would do itself, only sooner.  dpd_decode_retry names the conditions
 * (added to proxy_next_upstream's); proxy_next_upstream off, the
 * proxy_next_upstream_tries and _timeout limits still apply.  The
 * configuration is the location's: copied for this request only when it
 * lacks a condition.
 */

static ngx_uint_t
ngx_http_dpd_balancer_retry(ngx_http_request_t *r)
{
    ngx_uint_t                         add;
    ngx_http_upstream_t               *u;
    ngx_http_dpd_ctx_t                *ctx;
    ngx_http_upstream_conf_t          *conf;
    ngx_http_dpd_balancer_loc_conf_t  *blcf;

    if (r != r->main) {
        /* the prefill subrequest: its own location's rules and deadline */
        return 0;
    }

    blcf = ngx_http_get_module_loc_conf(r, ngx_http_dpd_balancer_module);

    if (blcf == NULL || blcf->retry == 0) {
        return 0;
    }

    ctx = ngx_http_dpd_get_ctx(r);

    if (ctx == NULL
        || (ctx->route != NGX_HTTP_DPD_ROUTE_DIRECT
            && ctx->route != NGX_HTTP_DPD_ROUTE_DISAGGREGATED
            && ctx->route != NGX_HTTP_DPD_ROUTE_FALLBACK))
    {
        /* not an inference request dpd routed: nginx's rules as they are */
        return 0;
    }

    u = r->upstream;

    if (u->conf->next_upstream & NGX_HTTP_UPSTREAM_FT_OFF) {
        return 0;
    }

    add = blcf->retry | NGX_HTTP_UPSTREAM_FT_NON_IDEMPOTENT;

    if ((u->conf->next_upstream & add) != add) {
        conf = ngx_palloc(r->pool, sizeof(ngx_http_upstream_conf_t));
        if (conf == NULL) {
            /* nginx's rules: no worse than without dpd_decode_retry */
            return 0;
        }

        *conf = *u->conf;
        conf->next_upstream |= add;
        u->conf = conf;
    }

    return 1;
}


static ngx_int_t
ngx_http_dpd_balancer_get_peer(ngx_peer_connection_t *pc, void *data)
{
    ngx_http_dpd_balancer_peer_data_t  *bp = data;

    ngx_int_t            rc;
    ngx_http_request_t  *r;

    r = bp->request;

    ngx_log_debug2(NGX_LOG_DEBUG_HTTP, pc->log, 0,
                   "dpd balancer get peer, try: %ui, tried: %ui",
                   pc->tries, bp->tries);

    pc->cached = 0;
    pc->connection = NULL;

    if (bp->tries && r->header_sent) {
        /* something of this response reached the client: never again */
        ngx_log_error(NGX_LOG_INFO, pc->log, 0,
                      "dpd: the client has the response header, "
                      "no other decoder");
        pc->name = bp->primary->name ? bp->primary->name
                                     : &ngx_http_dpd_unnamed;
        return NGX_BUSY;
    }

    if (bp->repin) {
        /* a fresh connection to the peer that has the KV */
        bp->repin = 0;
        bp->tries--;
        bp->pin->used = 0;
        bp->pin->reserved = 0;
        bp->pin->handed = 0;
    }

    if (bp->pin && !bp->pin->used) {
        rc = ngx_http_dpd_balancer_get_pinned(pc, bp);

        if (rc != NGX_BUSY) {
            if (rc == NGX_OK) {
                bp->tries++;
            }

            return rc;
        }

        if (!bp->retry) {
            return NGX_BUSY;
        }

        /* the pinned peer is gone: another one, without the KV */

    } else if (bp->pin && !bp->retry) {
        /* one try only: the KV is on that peer and nowhere else */
        pc->name = &bp->pin->name;
        return NGX_BUSY;
    }

    rc = ngx_http_dpd_balancer_choose(pc, bp);

    if (rc == NGX_BUSY) {
        if (bp->tries && bp->retry) {
            ngx_http_dpd_metrics_inc(r, NGX_HTTP_DPD_M_DECODE_RETRY_NO_PEER);
            ngx_log_error(NGX_LOG_WARN, pc->log, 0,
                          "dpd: no other decoder to retry the decode on");
        }

        return rc;
    }

    if (rc != NGX_OK) {
        return rc;
    }

    bp->tries++;

    if (bp->tries > 1 && bp->retry) {
        ngx_log_error(NGX_LOG_WARN, pc->log, 0,
                      "dpd: decode retried on %V (try %ui)",
                      pc->name, bp->tries);
    }

    if (bp->pin && !bp->pin->moved) {
        /* sockaddr set: on error nginx frees the peer it got */
        return ngx_http_dpd_balancer_move(r, bp, pc);
    }

    return NGX_OK;
}


/*
 * The least loaded usable peer of the request's current list, else of the
 * backup list; referenced and counted.  NGX_BUSY: none.
 */

static ngx_int_t
ngx_http_dpd_balancer_choose(ngx_peer_connection_t *pc,
    ngx_http_dpd_balancer_peer_data_t *bp)
{
    time_t                             now;
    ngx_int_t                          rc;
    ngx_uint_t                         i, n, p;
    ngx_http_upstream_rr_peer_t       *best;
    ngx_http_upstream_rr_peers_t      *peers;
    ngx_http_upstream_rr_peer_data_t  *rrp;

    rrp = &bp->rrp;

    now = ngx_time();
    peers = rrp->peers;

    ngx_http_upstream_rr_peers_wlock(peers);

    if (ngx_http_dpd_balancer_refresh(bp, peers) != NGX_OK) {
        ngx_http_upstream_rr_peers_unlock(peers);
        return NGX_ERROR;
    }

    best = ngx_http_dpd_balancer_least(bp->request, peers, rrp->tried, now,
                                       &p);

    if (best == NULL) {
        goto failed;
    }

    if (now - best->checked > best->fail_timeout) {
        best->checked = now;
    }

    if (ngx_http_dpd_balancer_mark(bp, peers, best, p) != NGX_OK) {
        ngx_http_upstream_rr_peers_unlock(peers);
        return NGX_ERROR;
    }

    best->conns++;
    ngx_http_dpd_peer_ref(peers, best);

    pc->sockaddr = best->sockaddr;
    pc->socklen = best->socklen;
    pc->name = &best->name;

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

        /* the whole bitmap: the backup list is checked before it is used */

        n = bp->nbits / (8 * sizeof(uintptr_t));

        for (i = 0; i < n; i++) {
            rrp->tried[i] = 0;
        }

        ngx_http_upstream_rr_peers_unlock(peers);

        rc = ngx_http_dpd_balancer_choose(pc, bp);

        if (rc != NGX_BUSY) {
            return rc;
        }

        ngx_http_upstream_rr_peers_wlock(peers);
    }

    ngx_http_upstream_rr_peers_unlock(peers);

    pc->name = peers->name ? peers->name : &ngx_http_dpd_unnamed;

    return NGX_BUSY;
}


/*
 * Peer p of "peers" (locked) is this try's: the current one, marked tried
 * and, where membership can change, its name kept.  Its count and
 * reference are the caller's to take.
 */

static ngx_int_t
ngx_http_dpd_balancer_mark(ngx_http_dpd_balancer_peer_data_t *bp,
    ngx_http_upstream_rr_peers_t *peers, ngx_http_upstream_rr_peer_t *peer,
    ngx_uint_t p)
{
#if (NGX_HTTP_DPD_PEER_REFS)
    ngx_str_t                         *name;
#endif
    ngx_http_upstream_rr_peer_data_t  *rrp;

    rrp = &bp->rrp;

#if (NGX_HTTP_DPD_PEER_REFS)

    if (peers->config) {
        /* to find it again in a list of another generation */

        if (bp->names == NULL) {
            bp->names = ngx_array_create(bp->request->pool, 2,
                                         sizeof(ngx_str_t));
            if (bp->names == NULL) {
                return NGX_ERROR;
            }
        }

        name = ngx_array_push(bp->names);
        if (name == NULL) {
            return NGX_ERROR;
        }

        name->data = ngx_pstrdup(bp->request->pool, &peer->name);
        if (name->data == NULL) {
            return NGX_ERROR;
        }

        name->len = peer->name.len;
    }

#endif

    rrp->current = peer;
    rrp->tried[ngx_http_dpd_bit_word(p)] |= ngx_http_dpd_bit_mask(p);

    return NGX_OK;
}


/* a cleared tried bitmap for n peers */

static ngx_int_t
ngx_http_dpd_balancer_tried(ngx_http_dpd_balancer_peer_data_t *bp,
    ngx_uint_t n)
{
    ngx_uint_t   words;
    uintptr_t   *tried;

    words = (n + (8 * sizeof(uintptr_t) - 1)) / (8 * sizeof(uintptr_t));

    tried = ngx_pcalloc(bp->request->pool, words * sizeof(uintptr_t));
    if (tried == NULL) {
        return NGX_ERROR;
    }

    bp->rrp.tried = tried;
    bp->nbits = words * 8 * sizeof(uintptr_t);

    return NGX_OK;
}


/*
 * Before the tried bitmap is used on "peers" (locked): if the membership
 * changed since the bitmap was made (nginx 1.27.3+ "resolve"), size it for
 * the lists as they are now and mark in it the peers already tried, by
 * name.  Without "resolve" the generation never moves and this is a
 * comparison.
 */

static ngx_int_t
ngx_http_dpd_balancer_refresh(ngx_http_dpd_balancer_peer_data_t *bp,
    ngx_http_upstream_rr_peers_t *peers)
{
#if (NGX_HTTP_DPD_PEER_REFS)

    ngx_uint_t                         i, j, n;
    ngx_str_t                         *name;
    ngx_http_upstream_rr_peer_t       *peer;
    ngx_http_upstream_rr_peer_data_t  *rrp;

    rrp = &bp->rrp;

    /*
     * The locked list's number is exact; the other list's is read without
     * its lock: should it grow meanwhile, the generation moves and its
     * next use rebuilds once more.  The number check also covers a look
     * that saw the new generation before the new number (the zone code
     * counts the generation first).
     */

    if (peers->config == NULL
        || (rrp->config == *peers->config && peers->number <= bp->nbits))
    {
        return NGX_OK;
    }

    n = ngx_max(bp->primary->number, peers->number);

    if (bp->primary->next && bp->primary->next->number > n) {
        n = bp->primary->next->number;
    }

    if (n > bp->nbits) {
        if (ngx_http_dpd_balancer_tried(bp, n) != NGX_OK) {
            return NGX_ERROR;
        }

    } else {
        ngx_memzero(rrp->tried, bp->nbits / 8);
    }

    name = bp->names ? bp->names->elts : NULL;

    for (peer = peers->peer, i = 0; peer; peer = peer->next, i++) {
        for (j = 0; name && j < bp->names->nelts; j++) {
            if (name[j].len == peer->name.len
                && ngx_memcmp(name[j].data, peer->name.data, name[j].len)
                   == 0)
            {
                rrp->tried[ngx_http_dpd_bit_word(i)] |=
                                                  ngx_http_dpd_bit_mask(i);
                break;
            }
        }
    }

    ngx_log_debug2(NGX_LOG_DEBUG_HTTP, bp->request->connection->log, 0,
                   "dpd balancer: peers changed (generation %ui -> %ui)",
                   rrp->config, *peers->config);

    rrp->config = *peers->config;

#endif

    return NGX_OK;
}


/*
 * The decode of a pinned request goes to another peer (the pinned one
 * failed, or is gone): its KV is not there.  The protocol's handler
 * rebuilds the body for that peer, the upstream request is made again
 * from it, and the request is reported as decoded without KV.
 */

static ngx_int_t
ngx_http_dpd_balancer_move(ngx_http_request_t *r,
    ngx_http_dpd_balancer_peer_data_t *bp, ngx_peer_connection_t *pc)
{
    ngx_int_t             rc;
    ngx_str_t             host;
    ngx_http_dpd_pin_t   *pin;
    ngx_http_dpd_ctx_t   *ctx;
    ngx_http_upstream_t  *u;

    pin = bp->pin;
    pin->moved = 1;

    ngx_log_error(NGX_LOG_WARN, pc->log, 0,
                  "dpd: the decode pinned to %V goes to %V, without the KV "
                  "sent to %V (route fallback)",
                  &pin->name, pc->name, &pin->name);

    /* a pinned prefill subrequest (dpd_prefix_cache prefill=) retried
     * elsewhere is not the main request's decode */
    ctx = (r == r->main) ? ngx_http_dpd_get_ctx(r) : NULL;

    if (ctx && ctx->route == NGX_HTTP_DPD_ROUTE_DISAGGREGATED) {
        ctx->route = NGX_HTTP_DPD_ROUTE_FALLBACK;
        ngx_http_dpd_metrics_fallback(r, NGX_HTTP_DPD_FB_DECODE_MOVED);
    }

    if (pin->moved_handler == NULL) {
        return NGX_OK;
    }

    if (ngx_http_dpd_sockaddr_host(r->pool, pc->sockaddr, pc->socklen, &host)
        != NGX_OK)
    {
        return NGX_ERROR;
    }

    rc = pin->moved_handler(r, pin, pc->name, &host);

    if (rc == NGX_DECLINED) {
        return NGX_OK;
    }

    if (rc != NGX_OK || r->request_body == NULL) {
        return NGX_ERROR;
    }

    /* the request to send: headers (Content-Length) and the new body */

    u = r->upstream;
    u->request_bufs = r->request_body->bufs;

    if (u->create_request(r) != NGX_OK) {
        return NGX_ERROR;
    }

    return NGX_OK;
}


/*
 * Every peer a try got comes back here (keepalive's free handler calls it
 * when keepalive wraps us): the outcome of a retry is counted once, then
 * the round-robin handler records failures, drops the count and the
 * reference.
 */

static void
ngx_http_dpd_balancer_free_peer(ngx_peer_connection_t *pc, void *data,
    ngx_uint_t state)
{
    ngx_http_dpd_balancer_peer_data_t  *bp = data;

    ngx_uint_t            metric;
    ngx_http_request_t   *r;
    ngx_http_upstream_t  *u;

    r = bp->request;

    if (bp->pin
        && bp->tries == 1
        && bp->pin->handed
        && !bp->pin->moved
        && pc->cached
        && (state & NGX_PEER_FAILED)
        && r->upstream->headers_in.status_n == 0)
    {
        /*
         * a kept-alive connection to the pinned peer the peer had closed:
         * nginx tries once more (it gives the try back), and the KV is
         * still on that peer
         */
        bp->repin = 1;
    }

    /* only the decode legs dpd_decode_retry governs: not the prefill
     * subrequest, not other locations' requests (nginx's own retries) */

    if (bp->retry && bp->tries > 1 && bp->counted < bp->tries) {
        bp->counted = bp->tries;

        u = r->upstream;

        if (state & NGX_PEER_FAILED) {
            metric = NGX_HTTP_DPD_M_DECODE_RETRY_FAILED;

        } else if (u->headers_in.status_n == 0) {
            /* finalized before any answer: the client went away */
            metric = NGX_HTTP_DPD_M_DECODE_RETRY_ABORTED;

        } else if (u->headers_in.status_n >= NGX_HTTP_INTERNAL_SERVER_ERROR) {
            /* the last try's 5xx went to the client as it came */
            metric = NGX_HTTP_DPD_M_DECODE_RETRY_FAILED;

        } else {
            metric = NGX_HTTP_DPD_M_DECODE_RETRY_OK;
        }

        ngx_http_dpd_metrics_inc(r, metric);
    }

    ngx_http_upstream_free_round_robin_peer(pc, &bp->rrp, state);
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

    pin->used = 1;

    /* the pin must still name a peer of this upstream's lists */

    known = 0;

    for (list = pin->upstream->peer.data; list; list = list->next) {
        if (list == pin->peers) {
            known = 1;
            break;
        }
    }

    if (!known || pin->peer == NULL) {
        ngx_log_error(NGX_LOG_ERR, pc->log, 0,
                      "dpd: pinned peer %V is no longer in upstream \"%V\"",
                      &pin->name, &pin->upstream->host);
        pc->name = &pin->name;
        return NGX_BUSY;
    }

    now = ngx_time();
    list = pin->peers;

    ngx_http_upstream_rr_peers_wlock(list);

    /*
     * By address in the list as it is now: a peer removed by a re-resolve
     * is unlinked (the pin's reference keeps its memory, so the address
     * cannot be another peer's)
     */

    for (peer = list->peer, i = 0; peer; peer = peer->next, i++) {
        if (peer == pin->peer) {
            break;
        }
    }

    if (peer == NULL) {
        ngx_http_upstream_rr_peers_unlock(list);

        ngx_log_error(NGX_LOG_WARN, pc->log, 0,
                      "dpd: pinned peer %V left upstream \"%V\"",
                      &pin->name, &pin->upstream->host);

        ngx_http_dpd_balancer_release(pin);

        pc->name = &pin->name;
        return NGX_BUSY;
    }

    rrp->peers = list;

    if (ngx_http_dpd_balancer_refresh(bp, list) != NGX_OK) {
        ngx_http_upstream_rr_peers_unlock(list);
        return NGX_ERROR;
    }

    if (ngx_http_dpd_balancer_mark(bp, list, peer, i) != NGX_OK) {
        ngx_http_upstream_rr_peers_unlock(list);
        return NGX_ERROR;
    }

    if (!pin->reserved) {
        peer->conns++;
        ngx_http_dpd_peer_ref(list, peer);
    }

    /*
     * from now on the count and the reference belong to the connection:
     * the round-robin free handler drops them
     */
    pin->reserved = 1;
    pin->handed = 1;

    if (now - peer->checked > peer->fail_timeout) {
        peer->checked = now;
    }

    pc->sockaddr = peer->sockaddr;
    pc->socklen = peer->socklen;
    pc->name = &peer->name;

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
    /* a lone peer is tried again (a stale keepalive connection), as
     * round robin does */

    if (tried
        && !peers->single
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


/* the usable peer of "peers" called "name", under the caller's lock */

static ngx_http_upstream_rr_peer_t *
ngx_http_dpd_balancer_named(ngx_http_upstream_rr_peers_t *peers,
    ngx_str_t *name, time_t now)
{
    ngx_uint_t                    i;
    ngx_http_upstream_rr_peer_t  *peer;

    for (peer = peers->peer, i = 0; peer; peer = peer->next, i++) {

        if (peer->name.len != name->len
            || ngx_strncmp(peer->name.data, name->data, name->len) != 0)
        {
            continue;
        }

        return ngx_http_dpd_balancer_usable(peers, peer, NULL, i, now)
               ? peer : NULL;
    }

    return NULL;
}


ngx_int_t
ngx_http_dpd_balancer_pin(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us, ngx_http_dpd_pin_t **pinp)
{
    return ngx_http_dpd_balancer_pin_peer(r, us, NULL, pinp);
}


ngx_int_t
ngx_http_dpd_balancer_pin_name(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us, ngx_str_t *name,
    ngx_http_dpd_pin_t **pinp)
{
    return ngx_http_dpd_balancer_pin_peer(r, us, name, pinp);
}


/*
 * A snapshot of the peers for a caller that scores them itself (the
 * prefix cache): taken under the read lock, scored without it, then
 * pinned by name (the peer may have gone meanwhile: NGX_DECLINED).
 */

ngx_int_t
ngx_http_dpd_balancer_candidates(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us, ngx_http_dpd_balancer_cand_t *cand,
    ngx_uint_t max, ngx_uint_t *n)
{
    time_t                             now;
    uint64_t                           free;
    ngx_uint_t                         i, k, state;
    ngx_http_upstream_rr_peer_t       *peer;
    ngx_http_upstream_rr_peers_t      *list;
    ngx_http_dpd_balancer_srv_conf_t  *bscf;

    *n = 0;

    bscf = ngx_http_conf_upstream_srv_conf(us, ngx_http_dpd_balancer_module);

    if (us->peer.data == NULL || bscf == NULL || !bscf->balance) {
        return NGX_ERROR;
    }

    now = ngx_time();
    state = ngx_http_dpd_state_enabled(r);

    /* the backup list only when no primary peer is usable, as pinning */

    for (list = us->peer.data; list; list = list->next) {

        k = 0;

        ngx_http_upstream_rr_peers_rlock(list);

        for (peer = list->peer, i = 0; peer && k < max;
             peer = peer->next, i++)
        {
            cand[k].usable = ngx_http_dpd_balancer_usable(list, peer, NULL,
                                                          i, now);
            cand[k].down = peer->down ? 1 : 0;

            if (cand[k].usable && state) {
                free = 0;

                if (ngx_http_dpd_balancer_ready(r, peer, &free)
                    == NGX_HTTP_DPD_READY_DEAD)
                {
                    cand[k].usable = 0;
                }
            }

            cand[k].conns = peer->conns;
            cand[k].weight = peer->weight ? peer->weight : 1;
            cand[k].name.len = ngx_min(peer->name.len,
                                       NGX_HTTP_DPD_CAND_NAME_LEN);
            ngx_memcpy(cand[k].buf, peer->name.data, cand[k].name.len);
            cand[k].name.data = cand[k].buf;
            k++;
        }

        ngx_http_upstream_rr_peers_unlock(list);

        for (i = 0; i < k; i++) {
            if (cand[i].usable) {
                *n = k;
                return NGX_OK;
            }
        }
    }

    /* none usable: the caller pins as dpd_balance would (NGX_BUSY) */

    return NGX_OK;
}


static ngx_int_t
ngx_http_dpd_balancer_pin_peer(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us, ngx_str_t *name,
    ngx_http_dpd_pin_t **pinp)
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

        if (name) {
            best = ngx_http_dpd_balancer_named(list, name, now);

        } else {
            best = ngx_http_dpd_balancer_least(r, list, NULL, now, &p);
        }

        if (best) {
            /* the reference keeps the peer's memory while we hold it */
            best->conns++;
            ngx_http_dpd_peer_ref(list, best);

            if (now - best->checked > best->fail_timeout) {
                best->checked = now;
            }

            ngx_http_upstream_rr_peers_unlock(list);
            break;
        }

        ngx_http_upstream_rr_peers_unlock(list);
    }

    if (best == NULL && name) {
        /* gone or unusable since the snapshot: the caller picks again */
        return NGX_DECLINED;
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

    /* copies: a re-resolve may remove the peer (1.27.3+ "resolve") */

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

    /* a peer removed meanwhile (a zombie) is freed with the last one */
    (void) ngx_http_dpd_peer_unref(list, pin->peer);

    ngx_http_upstream_rr_peers_unlock(list);

    pin->reserved = 0;
    pin->peer = NULL;
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


static void *
ngx_http_dpd_balancer_create_loc_conf(ngx_conf_t *cf)
{
    ngx_http_dpd_balancer_loc_conf_t  *conf;

    conf = ngx_palloc(cf->pool, sizeof(ngx_http_dpd_balancer_loc_conf_t));
    if (conf == NULL) {
        return NULL;
    }

    conf->retry = NGX_CONF_UNSET_UINT;

    return conf;
}


static char *
ngx_http_dpd_balancer_merge_loc_conf(ngx_conf_t *cf, void *parent,
    void *child)
{
    ngx_http_dpd_balancer_loc_conf_t *prev = parent;
    ngx_http_dpd_balancer_loc_conf_t *conf = child;

    ngx_conf_merge_uint_value(conf->retry, prev->retry,
                              NGX_HTTP_DPD_RETRY_DEFAULT);

    return NGX_CONF_OK;
}


/* dpd_decode_retry on | off | condition ... */

static char *
ngx_http_dpd_decode_retry(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_dpd_balancer_loc_conf_t *blcf = conf;

    ngx_str_t   *value;
    ngx_uint_t   i, m;

    if (blcf->retry != NGX_CONF_UNSET_UINT) {
        return "is duplicate";
    }

    value = cf->args->elts;

    if (cf->args->nelts == 2) {
        if (ngx_strcmp(value[1].data, "off") == 0) {
            blcf->retry = 0;
            return NGX_CONF_OK;
        }

        if (ngx_strcmp(value[1].data, "on") == 0) {
            blcf->retry = NGX_HTTP_DPD_RETRY_DEFAULT;
            return NGX_CONF_OK;
        }
    }

    blcf->retry = 0;

    for (i = 1; i < cf->args->nelts; i++) {

        for (m = 0; ngx_http_dpd_retry_masks[m].name.len; m++) {
            if (ngx_http_dpd_retry_masks[m].name.len == value[i].len
                && ngx_strcmp(ngx_http_dpd_retry_masks[m].name.data,
                              value[i].data) == 0)
            {
                break;
            }
        }

        if (ngx_http_dpd_retry_masks[m].name.len == 0) {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "invalid value \"%V\" in \"dpd_decode_retry\": "
                               "on, off, or conditions of error, timeout, "
                               "http_500, http_502, http_503, http_504, "
                               "http_429", &value[i]);
            return NGX_CONF_ERROR;
        }

        if (blcf->retry & ngx_http_dpd_retry_masks[m].mask) {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "duplicate value \"%V\" in "
                               "\"dpd_decode_retry\"", &value[i]);
            return NGX_CONF_ERROR;
        }

        blcf->retry |= ngx_http_dpd_retry_masks[m].mask;
    }

    return NGX_CONF_OK;
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
#if (NGX_HTTP_DPD_PEER_REFS)
                  |NGX_HTTP_UPSTREAM_MODIFY    /* "server ... resolve" */
#endif
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
