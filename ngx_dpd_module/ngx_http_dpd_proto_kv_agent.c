/*
 * dpd_protocol kv_agent: this project's transport (docs/dpd.md).
 *
 *   decoder first  least outstanding in dpd_decode_upstream, then its node
 *                  id from the state table (no table, no record, no id:
 *                  decode only, route fallback)
 *   prefill body   "kv_transfer_params": {"dpd": {"req_id", "decode_node"}}
 *   reply          {"dpd": {"req_id", "blocks", "state": "pushed"}} for
 *                  this req_id: worth waiting for; anything else: the
 *                  decoder recomputes
 *   ready          the state table's record of req_id on that node says
 *                  ready or failed
 *   decode body    "kv_transfer_params": {"dpd": {"req_id"}} whatever the
 *                  wait said (the decoder asks its agent and recomputes
 *                  what did not land); the same after a decode retry: the
 *                  new decoder's agent has nothing and it recomputes
 */

#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "ngx_http_dpd_proto.h"
#include "ngx_http_dpd_balancer.h"
#include "ngx_http_dpd_state.h"


typedef struct {
    u_char                      *node;          /* the decoder's node id */
    u_char                      *req_id;        /* ctx->kv_id, NUL-ended */
} ngx_http_dpd_kv_agent_ctx_t;


static ngx_int_t ngx_http_dpd_kv_agent_chosen(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf);
static ngx_int_t ngx_http_dpd_kv_agent_prefill_body(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf,
    ngx_str_t *body);
static ngx_int_t ngx_http_dpd_kv_agent_reply(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf,
    const char **why);
static ngx_int_t ngx_http_dpd_kv_agent_ready(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf);
static ngx_int_t ngx_http_dpd_kv_agent_decode_body(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf,
    ngx_str_t *body);


ngx_http_dpd_proto_t  ngx_http_dpd_proto_kv_agent = {
    ngx_string("kv_agent"),
    NGX_HTTP_DPD_PROTO_KV_AGENT,
    NGX_HTTP_DPD_PROTO_DECODER_FIRST|NGX_HTTP_DPD_PROTO_NEEDS_UPSTREAM,
    NULL,                                  /* init */
    NULL,                                  /* conf */
    ngx_http_dpd_kv_agent_chosen,
    ngx_http_dpd_kv_agent_prefill_body,
    ngx_http_dpd_kv_agent_reply,
    ngx_http_dpd_kv_agent_ready,
    ngx_http_dpd_kv_agent_decode_body
};


/*
 * The prefill engine's agent pushes to the decoder's node: its id from
 * the state table.  NGX_DECLINED (logged and counted here): nothing can be
 * handed over, the driver decodes only.
 */

static ngx_int_t
ngx_http_dpd_kv_agent_chosen(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefill_conf_t *pcf)
{
    size_t                        n;
    const char                   *why;
    ngx_uint_t                    outcome;
    ngx_http_dpd_state_node_t     node;
    ngx_http_dpd_kv_agent_ctx_t  *kc;
    ngx_http_dpd_prefill_ctx_t   *p;

    p = &ctx->prefill;

    kc = ngx_pcalloc(r->pool, sizeof(ngx_http_dpd_kv_agent_ctx_t));
    if (kc == NULL) {
        return NGX_ERROR;
    }

    kc->req_id = ngx_http_dpd_cstr(r->pool, &ctx->kv_id);
    if (kc->req_id == NULL) {
        return NGX_ERROR;
    }

    p->proto_data = kc;

    why = NULL;
    outcome = NGX_HTTP_DPD_KVW_NO_RECORD;

    if (!ngx_http_dpd_state_enabled(r)) {
        why = "no usable dpd_state_table";
        outcome = NGX_HTTP_DPD_KVW_NO_TABLE;

    } else if (ngx_http_dpd_state_node_by_addr(r, &p->decode_peer, &node)
               != NGX_OK)
    {
        why = "no node record for the decoder in the state table";

    } else {
        n = ngx_strlen(node.id);

        kc->node = ngx_pnalloc(r->pool, n + 1);
        if (kc->node == NULL) {
            return NGX_ERROR;
        }

        ngx_cpystrn(kc->node, node.id, n + 1);

        if (kc->node[0] != '\0') {
            return NGX_OK;
        }

        why = "the decoder's node record has no id";
    }

    ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                  "dpd: kv_agent: %s (decoder %V) for request \"%V\", "
                  "falling back to decode only",
                  why, &p->decode_peer, &ctx->request_id);

    ngx_http_dpd_metrics_kv_wait(r, outcome, -1);

    return NGX_DECLINED;
}


static ngx_int_t
ngx_http_dpd_kv_agent_prefill_body(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf,
    ngx_str_t *body)
{
    char                         *text;
    size_t                        len;
    ngx_http_dpd_kv_agent_ctx_t  *kc;

    kc = ctx->prefill.proto_data;

    if (kc == NULL || kc->node == NULL) {
        return NGX_ERROR;
    }

    text = ngx_http_dpd_proto_kv_agent_prefill_body(&ctx->req,
                                                    (char *) kc->req_id,
                                                    (char *) kc->node, &len);

    return ngx_http_dpd_proto_text(text, len, body);
}


static ngx_int_t
ngx_http_dpd_kv_agent_reply(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefill_conf_t *pcf, const char **why)
{
    int                           kind;
    unsigned long                 blocks;
    ngx_http_dpd_kv_agent_ctx_t  *kc;
    ngx_http_dpd_prefill_ctx_t   *p;

    p = &ctx->prefill;
    kc = p->proto_data;

    kind = ngx_http_dpd_proto_kv_agent_reply((char *) p->reply.data,
                                             p->reply.len,
                                             (char *) kc->req_id,
                                             &blocks, why);

    if (kind == NGX_HTTP_DPD_REPLY_INVALID) {
        return NGX_ABORT;
    }

    if (kind != NGX_HTTP_DPD_REPLY_PARAMS) {
        /* a prompt shorter than one KV block has nothing to send */
        p->quiet = (*why && ngx_strncmp(*why, "nothing to push", 15) == 0);
        return NGX_DECLINED;
    }

    ngx_log_debug3(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "dpd kv_agent: %ui blocks pushed to %s for \"%V\"",
                   (ngx_uint_t) blocks, kc->node, &ctx->request_id);

    return NGX_OK;
}


/* NGX_OK: the table has a verdict (p->kv); NGX_AGAIN: not yet */

static ngx_int_t
ngx_http_dpd_kv_agent_ready(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefill_conf_t *pcf)
{
    ngx_http_dpd_state_req_t      rec;
    ngx_http_dpd_kv_agent_ctx_t  *kc;
    ngx_http_dpd_prefill_ctx_t   *p;

    p = &ctx->prefill;
    kc = p->proto_data;

    if (ngx_http_dpd_state_request(r, &ctx->kv_id, &rec) != NGX_OK) {
        return NGX_AGAIN;
    }

    p->kv_state = rec.state;

    /* a record of the same id on another node is not ours */

    if (rec.node_id[0] != '\0'
        && ngx_strcmp(rec.node_id, kc->node) != 0)
    {
        return NGX_AGAIN;
    }

    if (rec.state == DPD_REQ_READY) {
        p->kv = NGX_HTTP_DPD_KV_READY;
        return NGX_OK;
    }

    if (rec.state == DPD_REQ_FAILED) {
        p->kv = NGX_HTTP_DPD_KV_FAILED;
        return NGX_OK;
    }

    return NGX_AGAIN;
}


/* always the req_id: the decoder asks its agent, recomputes what is not
 * there */

static ngx_int_t
ngx_http_dpd_kv_agent_decode_body(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf,
    ngx_str_t *body)
{
    char                         *text;
    size_t                        len;
    ngx_http_dpd_kv_agent_ctx_t  *kc;

    kc = ctx->prefill.proto_data;

    if (kc == NULL) {
        return NGX_ERROR;
    }

    /*
     * after a decode retry (ctx->prefill.retried) the decoder is not the
     * one the KV went to: it is asked for none and recomputes
     */

    text = ngx_http_dpd_proto_kv_agent_decode_body(&ctx->req,
                                                   ctx->prefill.retried
                                                   ? NULL
                                                   : (char *) kc->req_id,
                                                   &len);

    return ngx_http_dpd_proto_text(text, len, body);
}
