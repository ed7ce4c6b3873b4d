/*
 * dpd_balance: the peer-aware upstream balancer of the DPD gateway.
 *
 * A separate nginx module (ngx_http_dpd_balancer_module) in the same .so.
 * Inside an upstream{} block:
 *
 *     dpd_balance;                 least outstanding requests, counted
 *                                  across all workers when the upstream
 *                                  has a zone; honours a peer pinned by
 *                                  the disaggregated path
 *     dpd_lmcache_ports init=7300[,7301..] alloc=7400[,7401..];
 *                                  LMCache receiver ports of every decoder
 *                                  of this pool, one per TP rank
 *
 * With a kv_agent state table (dpd_state_table), peers whose node record
 * says not alive are skipped (unless that leaves none) and, among peers
 * with equally many outstanding requests, the one with more free KV blocks
 * wins; peers without a record are ordinary peers.
 *
 * The prefill code chooses a decoder before the prefill (lmcache,
 * kv_agent) with
 * ngx_http_dpd_balancer_pin(): the choice is reserved at once (it counts as
 * an outstanding request on that peer, so concurrent choices spread) and the
 * decode request of the same client request then goes to exactly that peer,
 * with no second try on another one.
 */

#ifndef _NGX_HTTP_DPD_BALANCER_H_INCLUDED_
#define _NGX_HTTP_DPD_BALANCER_H_INCLUDED_


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>


#define NGX_HTTP_DPD_MAX_TP_RANKS  64


typedef struct {
    ngx_flag_t                      balance;     /* dpd_balance given */
    ngx_str_t                       file;        /* where, for the warning */
    ngx_uint_t                      line;        /* without a zone */
    ngx_array_t                    *init_ports;  /* in_port_t, one per rank */
    ngx_array_t                    *alloc_ports; /* in_port_t, one per rank */
} ngx_http_dpd_balancer_srv_conf_t;


/* a decoder chosen for one client request */
typedef struct {
    ngx_http_upstream_srv_conf_t   *upstream;
    ngx_http_upstream_rr_peers_t   *peers;       /* list holding the peer */
    ngx_http_upstream_rr_peer_t    *peer;
    ngx_str_t                       name;        /* "127.0.0.4:8000" */
    ngx_str_t                       host;        /* "127.0.0.4" */
    unsigned                        reserved:1;  /* holds a conns count */
    unsigned                        handed:1;    /* count now owned by the
                                                    decode connection */
    unsigned                        used:1;      /* get_peer took it */
} ngx_http_dpd_pin_t;


extern ngx_module_t  ngx_http_dpd_balancer_module;


/*
 * Choose the peer of "us" with the least outstanding requests now, reserve
 * it and pin the main request to it.  NGX_OK: *pin set; NGX_BUSY: no live
 * peer; NGX_ERROR: allocation failure.
 */
ngx_int_t ngx_http_dpd_balancer_pin(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us, ngx_http_dpd_pin_t **pin);

/* drop the pin (fallback path): the reservation is released */
void ngx_http_dpd_balancer_unpin(ngx_http_request_t *r);

ngx_http_dpd_pin_t *ngx_http_dpd_balancer_get_pin(ngx_http_request_t *r);

/*
 * Configuration time: the upstream{} named "name", or when name is empty the
 * single upstream that carries dpd_lmcache_ports.  It must use dpd_balance
 * (and have dpd_lmcache_ports when need_ports is set).  Returns NULL with
 * *err set on failure.
 */
ngx_http_upstream_srv_conf_t *ngx_http_dpd_balancer_find_upstream(
    ngx_conf_t *cf, ngx_str_t *name, ngx_uint_t need_ports, char **err);

ngx_http_dpd_balancer_srv_conf_t *ngx_http_dpd_balancer_srv_conf(
    ngx_http_upstream_srv_conf_t *us);

/* the address of a peer without the port, allocated from pool */
ngx_int_t ngx_http_dpd_sockaddr_host(ngx_pool_t *pool, struct sockaddr *sa,
    socklen_t socklen, ngx_str_t *host);


#endif /* _NGX_HTTP_DPD_BALANCER_H_INCLUDED_ */
