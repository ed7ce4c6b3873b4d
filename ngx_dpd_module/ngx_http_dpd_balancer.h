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
 * In a location (http, server, location):
 *
 *     dpd_decode_retry on | off | error timeout http_502 ...;
 *                                  the decode leg of a request dpd routed
 *                                  is sent to another decoder when the
 *                                  chosen one fails before answering
 *                                  (default on: error timeout http_502
 *                                  http_503), POST or not
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
 * decode request of the same client request then goes to exactly that peer
 * first.  When that peer fails before answering (or left the upstream, nginx
 * 1.27.3+ "resolve") and dpd_decode_retry allows it, the decode goes to
 * another peer without the KV: the pin's "moved" handler rebuilds the body
 * for it, the route becomes "fallback".
 *
 * nginx 1.27.3+ re-resolves "server NAME resolve" in a zoned upstream: peers
 * are then taken and dropped by reference, the peers' configuration
 * generation is checked before the tried bitmap is used, and a pin holds a
 * reference of its peer so the peer's memory outlives its removal.
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


typedef struct {
    ngx_uint_t                      retry;       /* dpd_decode_retry:
                                                    NGX_HTTP_UPSTREAM_FT_*
                                                    mask, 0: off */
} ngx_http_dpd_balancer_loc_conf_t;


typedef struct ngx_http_dpd_pin_s  ngx_http_dpd_pin_t;


/*
 * The decode of a pinned request goes to another peer than the one its KV
 * went to: "name" and "host" are the new peer's ("127.0.0.5:8000",
 * "127.0.0.5").  The handler makes the request's body right for a decoder
 * that holds none of its KV (e.g. no kv_agent "dpd" params) and returns
 * NGX_OK when it replaced the body (ngx_http_dpd_replace_body()), NGX_DECLINED
 * when the body stands as it is, NGX_ERROR to fail the request (500).  It
 * runs inside the upstream's peer choice: no I/O, no subrequest, nothing
 * that waits.  The balancer then rebuilds the upstream request from the new
 * body, sets the route to "fallback" and counts it.
 */
typedef ngx_int_t (*ngx_http_dpd_pin_moved_pt)(ngx_http_request_t *r,
    ngx_http_dpd_pin_t *pin, ngx_str_t *name, ngx_str_t *host);


/* a decoder chosen for one client request */
struct ngx_http_dpd_pin_s {
    ngx_http_upstream_srv_conf_t   *upstream;
    ngx_http_upstream_rr_peers_t   *peers;       /* list holding the peer */
    ngx_http_upstream_rr_peer_t    *peer;        /* referenced while
                                                    reserved (1.27.3+) */
    ngx_str_t                       name;        /* "127.0.0.4:8000" */
    ngx_str_t                       host;        /* "127.0.0.4" */
    unsigned                        reserved:1;  /* holds a conns count */
    unsigned                        handed:1;    /* count now owned by the
                                                    decode connection */
    unsigned                        used:1;      /* get_peer took it */
    unsigned                        moved:1;     /* decoded elsewhere */

    ngx_http_dpd_pin_moved_pt       moved_handler; /* set by the caller of
                                                    ngx_http_dpd_balancer_pin;
                                                    NULL: body unchanged */
    void                           *data;        /* for the handler */
};


extern ngx_module_t  ngx_http_dpd_balancer_module;


/*
 * Choose the peer of "us" with the least outstanding requests now, reserve
 * it and pin the main request to it.  NGX_OK: *pin set; NGX_BUSY: no live
 * peer; NGX_ERROR: allocation failure.
 */
ngx_int_t ngx_http_dpd_balancer_pin(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us, ngx_http_dpd_pin_t **pin);

/*
 * The same for the peer called "name" (a candidate the caller chose):
 * NGX_DECLINED when it is no longer a usable peer of "us".
 */
ngx_int_t ngx_http_dpd_balancer_pin_name(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us, ngx_str_t *name,
    ngx_http_dpd_pin_t **pin);


#define NGX_HTTP_DPD_CAND_NAME_LEN  128

/* one peer of an upstream as ngx_http_dpd_balancer_candidates() saw it */
typedef struct {
    ngx_str_t                       name;        /* in buf, maybe cut */
    ngx_uint_t                      conns;       /* outstanding requests */
    ngx_uint_t                      weight;
    unsigned                        usable:1;    /* may take a request now
                                                    (not down, failed, full
                                                    or dead per the state
                                                    table) */
    unsigned                        down:1;      /* marked down */
    u_char                          buf[NGX_HTTP_DPD_CAND_NAME_LEN];
} ngx_http_dpd_balancer_cand_t;


/*
 * At most "max" peers of the first peer list (primary, else backup) that
 * has a usable one, with their load now: *n set.  NGX_ERROR when "us"
 * does not use dpd_balance.
 */
ngx_int_t ngx_http_dpd_balancer_candidates(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us, ngx_http_dpd_balancer_cand_t *cand,
    ngx_uint_t max, ngx_uint_t *n);

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
