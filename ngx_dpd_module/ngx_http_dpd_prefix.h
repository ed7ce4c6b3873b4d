/*
 * dpd_prefix_cache: prefix-cache-aware decoder choice (issue 23).
 *
 *   dpd_prefix_cache off;                                   (default)
 *   dpd_prefix_cache approximate [zone=NAME[:SIZE]] [block=N] [ttl=TIME]
 *                    [weights=U:L] [imbalance=ABS:REL] [prefill=NAME];
 *   dpd_prefix_cache events file=PATH [block=N] [weights=U:L]
 *                    [imbalance=ABS:REL];
 *
 * With it on, every request's prompt is encoded to its exact ids and
 * keyed per full block (kv_agent/include/dpd_prefix.h); before the
 * prefill, each usable decoder of dpd_decode_upstream gets
 *
 *     cost = U * uncached_blocks + L * outstanding_requests
 *
 * and the cheapest is pinned (unless the pool is imbalanced: max load -
 * min load > ABS and max load > REL * min load, then the least loaded).
 * The request is disaggregated only when the tokens that decoder does not
 * hold reach dpd_threshold; otherwise it goes straight there.
 * ngx_http_dpd_prefix.c has the details; docs/dpd.md the user's view.
 */

#ifndef _NGX_HTTP_DPD_PREFIX_H_INCLUDED_
#define _NGX_HTTP_DPD_PREFIX_H_INCLUDED_


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>


#define NGX_HTTP_DPD_PREFIX_OFF          0
#define NGX_HTTP_DPD_PREFIX_APPROXIMATE  1
#define NGX_HTTP_DPD_PREFIX_EVENTS       2

/* ctx->prefix_reason: why the route is what it is */
#define NGX_HTTP_DPD_PR_NONE             0
#define NGX_HTTP_DPD_PR_SHORT            1   /* prompt < dpd_threshold */
#define NGX_HTTP_DPD_PR_CACHED           2   /* uncached < dpd_threshold */
#define NGX_HTTP_DPD_PR_DISAGG           3   /* uncached >= dpd_threshold */


typedef struct ngx_http_dpd_prefix_reader_s  ngx_http_dpd_prefix_reader_t;


typedef struct {
    ngx_uint_t                       mode;       /* NGX_HTTP_DPD_PREFIX_* */
    size_t                           block;      /* tokens per block */
    ngx_msec_t                       ttl;        /* approximate entries */
    ngx_uint_t                       w_uncached; /* per uncached block */
    ngx_uint_t                       w_load;     /* per outstanding req */
    ngx_uint_t                       imb_abs;    /* imbalance guard */
    ngx_uint_t                       imb_rel;    /* x 1000 */
    ngx_shm_zone_t                  *zone;       /* approximate */
    ngx_http_dpd_prefix_reader_t    *reader;     /* events */
    ngx_http_upstream_srv_conf_t    *decode;     /* dpd_decode_upstream */
    ngx_str_t                        prefill_name; /* prefill=NAME */
    ngx_http_upstream_srv_conf_t    *prefill;    /* its dpd_balance pool */
} ngx_http_dpd_prefix_conf_t;


char *ngx_http_dpd_prefix_cache(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
void ngx_http_dpd_prefix_init_conf(ngx_http_dpd_prefix_conf_t *conf);
char *ngx_http_dpd_prefix_merge_conf(ngx_conf_t *cf,
    ngx_http_dpd_prefix_conf_t *prev, ngx_http_dpd_prefix_conf_t *conf,
    ngx_str_t *decode_name, ngx_flag_t enable);

/*
 * The decision with the cache on (ctx->prompt_tokens counted, the keys in
 * ctx->prefix_keys): sets ctx->route, cached/uncached tokens and the
 * reason, pins the chosen decoder.  NGX_DECLINED: no decoder could be
 * scored (the caller routes by the prompt alone), NGX_ERROR: memory.
 */
ngx_int_t ngx_http_dpd_prefix_route(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefix_conf_t *pc,
    ngx_int_t threshold);


/*
 * prefill=NAME: pin the prefill subrequest sr to the prefiller of that
 * pool whose own cache and load cost least.  NGX_OK: pinned,
 * NGX_DECLINED: left to dpd_balance, NGX_ERROR: memory.
 */
ngx_int_t ngx_http_dpd_prefix_prefill(ngx_http_request_t *r,
    ngx_http_request_t *sr, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefix_conf_t *pc);


/*
 * Approximate mode: the prompt's keys are remembered for the decoder
 * (prefill = 0) or the prefiller (1) chosen for it only once that node
 * answered successfully; peer is the upstream peer that did (a retry on
 * another node learns nothing).  A no-op in the other modes, or when
 * nothing is pending.
 */
void ngx_http_dpd_prefix_learn(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_uint_t prefill, ngx_str_t *peer);


#endif /* _NGX_HTTP_DPD_PREFIX_H_INCLUDED_ */
