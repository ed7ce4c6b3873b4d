/*
 * The prefill protocols behind one interface (docs/dpd.md, "Protocols").
 *
 * The prefill driver (ngx_http_dpd_prefill.c) runs the disaggregated path
 * the same way for every protocol: pin a decoder first when the protocol
 * pushes the KV, send the prefill subrequest, classify its outcome (4xx
 * relayed, 5xx/timeout/connection error/unusable reply fall back), wait
 * for the KV when the protocol has a readiness check (bounded by
 * dpd_kv_wait, polled 1 ms rising to 10 ms, the client watched), then put
 * the decode body in place.  What differs per protocol is in one
 * descriptor per file:
 *
 *   ngx_http_dpd_proto_nixl.c      vLLM NixlConnector (decoder pulls)
 *   ngx_http_dpd_proto_lmcache.c   LMCache PD (prefiller pushes, notices)
 *   ngx_http_dpd_proto_kv_agent.c  this project's kv_agent (push)
 *
 * A fourth protocol is one new file with its descriptor (its id any number
 * no other descriptor uses) and one entry in ngx_http_dpd_protos[]
 * (ngx_http_dpd_prefill.c); "dpd_protocol NAME" finds it by name.
 *
 * Hooks (any may be NULL where the text says so).  They return nginx
 * codes; none of them sends a response or finalizes the request:
 *
 *   init(cf)             postconfiguration (e.g. an output filter); NULL
 *   conf(cf, pcf)        checks of a disaggregating location at merge time
 *                        (after the driver's own); NULL
 *   chosen(r, ctx, pcf)  DECODER_FIRST only, after the decoder was pinned
 *                        (ctx->prefill.decode_peer): NGX_OK to go on,
 *                        NGX_DECLINED when no hand-off can work (the
 *                        protocol logged why and counted it; the driver
 *                        unpins, decodes only: route fallback), NGX_ERROR;
 *                        NULL
 *   prefill_body(r, ctx, pcf, body)
 *                        the prefill subrequest's body: NGX_OK, NGX_ERROR
 *   reply(r, ctx, pcf, why)
 *                        a 2xx prefill reply (ctx->prefill.reply):
 *                        NGX_OK      the decoder gets the KV (once ready()
 *                                    says so, where there is a ready())
 *                        NGX_DECLINED it will not: the decoder recomputes
 *                                    (*why says why)
 *                        NGX_ABORT   not a usable reply (*why): as a 5xx
 *                        NGX_ERROR
 *   ready(r, ctx, pcf)   one readiness check, called right after reply()
 *                        said NGX_OK and then on every poll: NGX_AGAIN (not
 *                        yet), NGX_OK with ctx->prefill.kv set (READY,
 *                        FAILED, NO_TABLE); the driver ends the wait with
 *                        TIMEOUT after dpd_kv_wait.  NULL: no wait
 *   decode_body(r, ctx, pcf, body)
 *                        the decode request's body for the decoder now in
 *                        ctx->prefill.decode_peer (pool memory).  Called
 *                        once by the driver at the hand-off, and again by
 *                        a decode retry (ngx_http_dpd_prefill_rebuild())
 *                        after another decoder was pinned: it must build
 *                        from what reply()/ready() kept, never from the
 *                        subrequest (gone by then), and must not assume the
 *                        KV is on the new decoder: ctx->prefill.retried is
 *                        set then.  NGX_OK, NGX_ERROR
 *
 * Per-request state of a protocol lives in ctx->prefill.proto_data (its
 * own struct, pool memory).
 */

#ifndef _NGX_HTTP_DPD_PROTO_H_INCLUDED_
#define _NGX_HTTP_DPD_PROTO_H_INCLUDED_


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "ngx_http_dpd_module.h"


/* ngx_http_dpd_proto_t.flags */
#define NGX_HTTP_DPD_PROTO_DECODER_FIRST   0x01  /* pin a decoder in
                                                    dpd_decode_upstream
                                                    before the prefill */
#define NGX_HTTP_DPD_PROTO_NEEDS_UPSTREAM  0x02  /* dpd_decode_upstream is
                                                    required */
#define NGX_HTTP_DPD_PROTO_NEEDS_PORTS     0x04  /* the decode upstream has
                                                    dpd_lmcache_ports */
#define NGX_HTTP_DPD_PROTO_NO_KV_FALLBACK  0x08  /* a decode without KV is
                                                    route "fallback" */


typedef struct ngx_http_dpd_proto_s  ngx_http_dpd_proto_t;

struct ngx_http_dpd_proto_s {
    ngx_str_t                    name;          /* dpd_protocol NAME */
    ngx_uint_t                   id;            /* NGX_HTTP_DPD_PROTO_* */
    ngx_uint_t                   flags;

    ngx_int_t                  (*init)(ngx_conf_t *cf);
    char                      *(*conf)(ngx_conf_t *cf,
                                       ngx_http_dpd_prefill_conf_t *pcf);
    ngx_int_t                  (*chosen)(ngx_http_request_t *r,
                                         ngx_http_dpd_ctx_t *ctx,
                                         ngx_http_dpd_prefill_conf_t *pcf);
    ngx_int_t                  (*prefill_body)(ngx_http_request_t *r,
                                         ngx_http_dpd_ctx_t *ctx,
                                         ngx_http_dpd_prefill_conf_t *pcf,
                                         ngx_str_t *body);
    ngx_int_t                  (*reply)(ngx_http_request_t *r,
                                         ngx_http_dpd_ctx_t *ctx,
                                         ngx_http_dpd_prefill_conf_t *pcf,
                                         const char **why);
    ngx_int_t                  (*ready)(ngx_http_request_t *r,
                                         ngx_http_dpd_ctx_t *ctx,
                                         ngx_http_dpd_prefill_conf_t *pcf);
    ngx_int_t                  (*decode_body)(ngx_http_request_t *r,
                                         ngx_http_dpd_ctx_t *ctx,
                                         ngx_http_dpd_prefill_conf_t *pcf,
                                         ngx_str_t *body);
};


extern ngx_http_dpd_proto_t   ngx_http_dpd_proto_nixl;
extern ngx_http_dpd_proto_t   ngx_http_dpd_proto_lmcache;
extern ngx_http_dpd_proto_t   ngx_http_dpd_proto_kv_agent;

/* NULL-terminated, in ngx_http_dpd_prefill.c */
extern ngx_http_dpd_proto_t  *ngx_http_dpd_protos[];

/* the descriptor of a location's dpd_protocol (never NULL once merged) */
ngx_http_dpd_proto_t *ngx_http_dpd_proto(ngx_http_dpd_prefill_conf_t *pcf);


/* helpers of the driver the protocol files share */

/* a NUL-terminated copy of s in pool */
u_char *ngx_http_dpd_cstr(ngx_pool_t *pool, ngx_str_t *s);

/* "127.0.0.2:8000" or "[::1]:8000" -> NUL-terminated host */
ngx_int_t ngx_http_dpd_peer_host(ngx_pool_t *pool, ngx_str_t *name,
    ngx_str_t *host);

/* a body built through ctx->req.alloc (pool): NULL text is NGX_ERROR */
ngx_int_t ngx_http_dpd_proto_text(char *text, size_t len, ngx_str_t *body);


#endif /* _NGX_HTTP_DPD_PROTO_H_INCLUDED_ */
