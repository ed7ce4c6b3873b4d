/*
 * The disaggregated path (docs/dpd.md).
 *
 * For a request routed "disaggregated" the core calls
 * ngx_http_dpd_prefill_handler() from its phase handler:
 *
 *   1. protocols that push the KV (lmcache, kv_agent): choose the decoder
 *      now (least outstanding) and pin it; the protocol's chosen() hook
 *      may still decline (kv_agent: no node id in the state table);
 *   2. send the prefill copy of the request as a waited in-memory
 *      subrequest (auth_request pattern) with its own POST body to
 *      dpd_prefill_pass + URI, under a dpd_prefill_timeout timer;
 *   3. the post-subrequest handler records the outcome (once: it runs on
 *      every finalize of the subrequest) and the parent resumes;
 *   4. protocols with a readiness check (lmcache, kv_agent): after the
 *      reply, poll it (timer, 1 ms rising to 10 ms) until it says the KV
 *      is ready or failed, or dpd_kv_wait passes;
 *   5. the protocol builds the decode body (ngx_http_dpd_proto.h) and it
 *      replaces the main request body; proxy_pass streams the decoder's
 *      answer;
 *   6. on failure: a prefill 4xx goes back to the client as it came; 5xx,
 *      timeout, connection errors and unusable replies fall back to a
 *      decode-only request (dpd_fallback decode) or end in a 502/504
 *      OpenAI-shaped error (dpd_fallback error); both answers are left in
 *      ctx->answer for the core's content handler (NGX_DONE).
 *
 * Nothing here sends a response or finalizes the main request: the
 * post-subrequest handler, the deadline and the KV timer and read handler
 * record what happened and resume the phases; the core's phase handler
 * acts on it and the phase engine finalizes (auth_request's pattern).
 *
 * A client that goes away while the prefill runs terminates the main
 * request and with it the subrequest (nginx does this); the pool cleanup
 * below stops our timer and the balancer's drops a decoder reservation.
 * During the KV wait no subrequest watches the client: a read handler of
 * our own notices it going away (HTTP/1.x: the connection; HTTP/2: the
 * stream reset or its connection gone) and the request ends with 499.
 */

#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_event.h>
#include <ngx_http.h>

#include "ngx_http_dpd_module.h"
#include "ngx_http_dpd_protocol.h"
#include "ngx_http_dpd_proto.h"
#include "ngx_http_dpd_balancer.h"


static ngx_int_t ngx_http_dpd_prefill_start(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf);
static ngx_int_t ngx_http_dpd_prefill_done(ngx_http_request_t *sr,
    void *data, ngx_int_t rc);
static void ngx_http_dpd_prefill_sent(ngx_http_request_t *sr,
    ngx_http_dpd_prefill_ctx_t *p);
static void ngx_http_dpd_prefill_timeout(ngx_event_t *ev);
static void ngx_http_dpd_prefill_cleanup(void *data);
static ngx_int_t ngx_http_dpd_prefill_skip(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx);
static ngx_int_t ngx_http_dpd_prefill_finish(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf);
static ngx_int_t ngx_http_dpd_prefill_relay(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx);
static ngx_int_t ngx_http_dpd_prefill_fail(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf,
    ngx_uint_t cause, const char *why);
static ngx_int_t ngx_http_dpd_plain_body(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx);
static ngx_int_t ngx_http_dpd_prefill_variable(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, uintptr_t data);
static ngx_int_t ngx_http_dpd_kv_wait(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf);
static ngx_int_t ngx_http_dpd_kv_check(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf);
static void ngx_http_dpd_kv_arm(ngx_http_dpd_prefill_ctx_t *p,
    ngx_http_dpd_prefill_conf_t *pcf);
static void ngx_http_dpd_kv_tick(ngx_event_t *ev);
static void ngx_http_dpd_kv_reading(ngx_http_request_t *r);
static void ngx_http_dpd_kv_client_closed(ngx_http_request_t *r,
    ngx_http_dpd_prefill_ctx_t *p);
static ngx_int_t ngx_http_dpd_kv_client_gone(ngx_http_request_t *r);
static ngx_int_t ngx_http_dpd_prefill_moved(ngx_http_request_t *r,
    ngx_http_dpd_pin_t *pin, ngx_str_t *name, ngx_str_t *host);
static ngx_int_t ngx_http_dpd_prefill_handoff(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf,
    const char *why);


/* dpd_protocol NAME: one entry per protocol file (ngx_http_dpd_proto.h) */

ngx_http_dpd_proto_t  *ngx_http_dpd_protos[] = {
    &ngx_http_dpd_proto_nixl,
    &ngx_http_dpd_proto_lmcache,
    &ngx_http_dpd_proto_kv_agent,
    NULL
};


ngx_conf_enum_t  ngx_http_dpd_prefill_fallbacks[] = {
    { ngx_string("decode"), NGX_HTTP_DPD_FALLBACK_DECODE },
    { ngx_string("error"), NGX_HTTP_DPD_FALLBACK_ERROR },
    { ngx_null_string, 0 }
};


#define NGX_HTTP_DPD_VAR_PREFILL_PEER    0
#define NGX_HTTP_DPD_VAR_DECODE_PEER     1
#define NGX_HTTP_DPD_VAR_PREFILL_TIME    2
#define NGX_HTTP_DPD_VAR_PREFILL_STATUS  3
#define NGX_HTTP_DPD_VAR_KV_WAIT_TIME    4

/* readiness polls start at 1 ms and double up to this */
#define NGX_HTTP_DPD_KV_POLL_MAX         10


static ngx_http_variable_t  ngx_http_dpd_prefill_vars[] = {

    { ngx_string("dpd_prefill_peer"), NULL, ngx_http_dpd_prefill_variable,
      NGX_HTTP_DPD_VAR_PREFILL_PEER, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("dpd_decode_peer"), NULL, ngx_http_dpd_prefill_variable,
      NGX_HTTP_DPD_VAR_DECODE_PEER, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("dpd_prefill_time"), NULL, ngx_http_dpd_prefill_variable,
      NGX_HTTP_DPD_VAR_PREFILL_TIME, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("dpd_prefill_status"), NULL, ngx_http_dpd_prefill_variable,
      NGX_HTTP_DPD_VAR_PREFILL_STATUS, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("dpd_kv_wait_time"), NULL, ngx_http_dpd_prefill_variable,
      NGX_HTTP_DPD_VAR_KV_WAIT_TIME, NGX_HTTP_VAR_NOCACHEABLE, 0 },

      ngx_http_null_variable
};


static const char  *ngx_http_dpd_cause_names[] = {
    "none", "prefill 5xx", "prefill 4xx", "prefill timeout",
    "prefill connection error", "unusable prefill reply",
    "no live decoder to pin", "no state record of the decoder"
};


static const char  *ngx_http_dpd_kv_names[] = {
    "none", "ready", "failed", "not ready after dpd_kv_wait", "not pushed",
    "not waited for (no usable dpd_state_table)"
};


/* configuration */

void
ngx_http_dpd_prefill_init_conf(ngx_http_dpd_prefill_conf_t *conf)
{
    /*
     * set by ngx_pcalloc() in the core:
     *
     *     conf->prefill_pass = { 0, NULL };
     *     conf->decode_name = { 0, NULL };
     *     conf->decode_upstream = NULL;
     */

    conf->protocol = NGX_CONF_UNSET_UINT;
    conf->timeout = NGX_CONF_UNSET_MSEC;
    conf->fallback = NGX_CONF_UNSET_UINT;
    conf->kv_wait = NGX_CONF_UNSET_MSEC;
    conf->nixl_hosts = NGX_CONF_UNSET_PTR;
}


char *
ngx_http_dpd_prefill_merge_conf(ngx_conf_t *cf,
    ngx_http_dpd_prefill_conf_t *prev, ngx_http_dpd_prefill_conf_t *conf)
{
    char                  *err;
    ngx_uint_t             set_decode, set_wait;
    ngx_http_dpd_proto_t  *proto;

    /* set in this block (before the merge fills them in) */
    set_decode = (conf->decode_name.data != NULL);
    set_wait = (conf->kv_wait != NGX_CONF_UNSET_MSEC);

    if (conf->prefill_pass.data == NULL) {
        conf->prefill_pass = prev->prefill_pass;
    }

    ngx_conf_merge_uint_value(conf->protocol, prev->protocol,
                              NGX_HTTP_DPD_PROTO_NIXL);
    ngx_conf_merge_msec_value(conf->timeout, prev->timeout, 60000);
    ngx_conf_merge_uint_value(conf->fallback, prev->fallback,
                              NGX_HTTP_DPD_FALLBACK_DECODE);
    ngx_conf_merge_str_value(conf->decode_name, prev->decode_name, "");
    ngx_conf_merge_msec_value(conf->kv_wait, prev->kv_wait, 2000);
    ngx_conf_merge_ptr_value(conf->nixl_hosts, prev->nixl_hosts, NULL);

    proto = ngx_http_dpd_proto(conf);

    /* directives the protocol of a disaggregating block does not use */

    if (conf->prefill_pass.len == 0) {
        set_decode = 0;
        set_wait = 0;
    }

    if (set_decode && !(proto->flags & NGX_HTTP_DPD_PROTO_DECODER_FIRST)
        && !conf->prefix)
    {
        ngx_conf_log_error(NGX_LOG_WARN, cf, 0,
                           "\"dpd_decode_upstream\" is ignored with "
                           "\"dpd_protocol %V\" (any decoder takes the "
                           "request)", &proto->name);
    }

    if (set_wait && proto->ready == NULL) {
        ngx_conf_log_error(NGX_LOG_WARN, cf, 0,
                           "\"dpd_kv_wait\" is ignored with "
                           "\"dpd_protocol %V\" (it has no readiness wait)",
                           &proto->name);
    }

    if (conf->prefill_pass.len == 0) {
        return NGX_CONF_OK;
    }

    if (!(proto->flags & NGX_HTTP_DPD_PROTO_DECODER_FIRST)) {
        return proto->conf ? proto->conf(cf, conf) : NGX_CONF_OK;
    }

    if ((proto->flags & NGX_HTTP_DPD_PROTO_NEEDS_UPSTREAM)
        && conf->decode_name.len == 0)
    {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "\"dpd_protocol %V\" needs "
                           "\"dpd_decode_upstream\" naming the decode pool",
                           &proto->name);
        return NGX_CONF_ERROR;
    }

    /* the protocol chooses the decoder: find its pool now */

    if (prev->decode_upstream
        && conf->decode_name.len == prev->decode_name.len
        && ngx_strncmp(conf->decode_name.data, prev->decode_name.data,
                       conf->decode_name.len) == 0)
    {
        conf->decode_upstream = prev->decode_upstream;

    } else {
        conf->decode_upstream = ngx_http_dpd_balancer_find_upstream(cf,
                                    &conf->decode_name,
                                    (proto->flags
                                     & NGX_HTTP_DPD_PROTO_NEEDS_PORTS) != 0,
                                    &err);

        if (conf->decode_upstream == NULL) {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "\"dpd_protocol %V\"%s%V%s: %s", &proto->name,
                               conf->decode_name.len ? " with upstream \""
                                                     : "",
                               &conf->decode_name,
                               conf->decode_name.len ? "\"" : "", err);
            return NGX_CONF_ERROR;
        }
    }

    return proto->conf ? proto->conf(cf, conf) : NGX_CONF_OK;
}


ngx_http_dpd_proto_t *
ngx_http_dpd_proto(ngx_http_dpd_prefill_conf_t *pcf)
{
    ngx_uint_t  i;

    for (i = 0; ngx_http_dpd_protos[i]; i++) {
        if (ngx_http_dpd_protos[i]->id == pcf->protocol) {
            return ngx_http_dpd_protos[i];
        }
    }

    return ngx_http_dpd_protos[0];
}


char *
ngx_http_dpd_prefill_protocol(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    char  *c = conf;

    ngx_str_t   *value;
    ngx_uint_t   i, *id;

    id = (ngx_uint_t *) (c + cmd->offset);

    if (*id != NGX_CONF_UNSET_UINT) {
        return "is duplicate";
    }

    value = cf->args->elts;

    for (i = 0; ngx_http_dpd_protos[i]; i++) {
        if (ngx_http_dpd_protos[i]->name.len == value[1].len
            && ngx_strcmp(ngx_http_dpd_protos[i]->name.data, value[1].data)
               == 0)
        {
            *id = ngx_http_dpd_protos[i]->id;
            return NGX_CONF_OK;
        }
    }

    ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                       "invalid value \"%V\"", &value[1]);

    return NGX_CONF_ERROR;
}


ngx_int_t
ngx_http_dpd_prefill_init(ngx_conf_t *cf)
{
    ngx_uint_t  i;

    for (i = 0; ngx_http_dpd_protos[i]; i++) {
        if (ngx_http_dpd_protos[i]->init
            && ngx_http_dpd_protos[i]->init(cf) != NGX_OK)
        {
            return NGX_ERROR;
        }
    }

    return NGX_OK;
}


char *
ngx_http_dpd_prefill_pass(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_dpd_prefill_conf_t  *pcf;
    ngx_str_t                    *value;

    pcf = (ngx_http_dpd_prefill_conf_t *) ((char *) conf + cmd->offset);

    if (pcf->prefill_pass.data) {
        return "is duplicate";
    }

    value = cf->args->elts;

    if (ngx_strcmp(value[1].data, "off") == 0) {
        ngx_str_set(&pcf->prefill_pass, "");
        pcf->prefill_pass.len = 0;
        return NGX_CONF_OK;
    }

    if (value[1].len < 2 || value[1].data[0] != '/') {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "\"dpd_prefill_pass\" needs the URI of an "
                           "internal location, e.g. /_dpd_prefill, "
                           "not \"%V\"", &value[1]);
        return NGX_CONF_ERROR;
    }

    pcf->prefill_pass = value[1];

    /* "/_dpd_prefill/" and "/_dpd_prefill" name the same subrequest URI */

    if (pcf->prefill_pass.data[pcf->prefill_pass.len - 1] == '/') {
        pcf->prefill_pass.len--;
    }

    return NGX_CONF_OK;
}


ngx_int_t
ngx_http_dpd_prefill_add_variables(ngx_conf_t *cf)
{
    ngx_http_variable_t  *var, *v;

    for (v = ngx_http_dpd_prefill_vars; v->name.len; v++) {
        var = ngx_http_add_variable(cf, &v->name, v->flags);
        if (var == NULL) {
            return NGX_ERROR;
        }

        var->get_handler = v->get_handler;
        var->data = v->data;
    }

    return NGX_OK;
}


/* the request */

ngx_int_t
ngx_http_dpd_prefill_handler(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx)
{
    ngx_http_dpd_loc_conf_t      *dlcf;
    ngx_http_dpd_prefill_ctx_t   *p;

    p = &ctx->prefill;
    dlcf = ngx_http_get_module_loc_conf(r, ngx_http_dpd_module);

    switch (p->state) {

    case NGX_HTTP_DPD_PREFILL_NEW:
        return ngx_http_dpd_prefill_start(r, ctx, &dlcf->prefill);

    case NGX_HTTP_DPD_PREFILL_WAITING:
        if (!p->done) {
            return NGX_AGAIN;
        }

        p->state = NGX_HTTP_DPD_PREFILL_FINISHED;

        return ngx_http_dpd_prefill_finish(r, ctx, &dlcf->prefill);

    case NGX_HTTP_DPD_PREFILL_KV_WAIT:
        if (!p->kv_done) {
            return NGX_AGAIN;
        }

        if (p->aborted) {
            /* the client went away during the wait */
            p->state = NGX_HTTP_DPD_PREFILL_FINISHED;
            return NGX_HTTP_CLIENT_CLOSED_REQUEST;
        }

        return ngx_http_dpd_prefill_handoff(r, ctx, &dlcf->prefill, NULL);

    default:
        return NGX_DECLINED;
    }
}


static ngx_int_t
ngx_http_dpd_prefill_start(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefill_conf_t *pcf)
{
    u_char                      *u;
    ngx_int_t                    rc;
    ngx_str_t                    uri, path, body;
    ngx_buf_t                   *b;
    ngx_chain_t                 *cl;
    ngx_pool_cleanup_t          *cln;
    ngx_http_request_t          *sr;
    ngx_http_dpd_pin_t          *pin;
    ngx_http_request_body_t     *rb;
    ngx_http_post_subrequest_t  *ps;
    ngx_pool_t                  *tree;
    ngx_http_dpd_proto_t        *proto;
    ngx_http_dpd_prefill_ctx_t  *p;
    ngx_http_dpd_loc_conf_t     *dlcf;

    p = &ctx->prefill;

    if (ctx->req.members == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    cln = ngx_pool_cleanup_add(r->pool, 0);
    if (cln == NULL) {
        return NGX_ERROR;
    }

    cln->handler = ngx_http_dpd_prefill_cleanup;
    cln->data = p;

    proto = ngx_http_dpd_proto(pcf);
    p->proto = proto;

    if (proto->flags & NGX_HTTP_DPD_PROTO_DECODER_FIRST) {

        /* the prefill pushes the KV to the decoder we choose now, or
         * that dpd_prefix_cache chose and pinned already */

        pin = ngx_http_dpd_balancer_get_pin(r);

        if (pin != NULL && pin->upstream == pcf->decode_upstream
            && !pin->used)
        {
            rc = NGX_OK;

        } else {
            rc = ngx_http_dpd_balancer_pin(r, pcf->decode_upstream, &pin);
        }

        switch (rc) {

        case NGX_OK:
            p->decode_peer = pin->name;
            /* a decode retry elsewhere (dpd_decode_retry) rebuilds the body */
            pin->moved_handler = ngx_http_dpd_prefill_moved;
            break;

        case NGX_BUSY:
            p->state = NGX_HTTP_DPD_PREFILL_FINISHED;
            return ngx_http_dpd_prefill_fail(r, ctx, pcf,
                                             NGX_HTTP_DPD_CAUSE_NO_DECODER,
                                             NULL);

        default:
            return NGX_ERROR;
        }

        rc = proto->chosen ? proto->chosen(r, ctx, pcf) : NGX_OK;

        if (rc == NGX_DECLINED) {
            return ngx_http_dpd_prefill_skip(r, ctx);
        }

        if (rc != NGX_OK) {
            return NGX_ERROR;
        }
    }

    /* the hooks' trees live and die in the call: see tree_scope() */

    tree = ngx_http_dpd_tree_scope(r->pool);
    rc = proto->prefill_body(r, ctx, pcf, &body);
    (void) ngx_http_dpd_tree_scope(tree);

    if (rc != NGX_OK) {
        return NGX_ERROR;
    }

    /*
     * dpd_prefill_pass /_dpd_prefill + the engine's own path, whatever the
     * client's URI was: /_dpd_prefill/v1/chat/completions
     */

    if (ctx->kind == NGX_HTTP_DPD_KIND_CHAT) {
        ngx_str_set(&path, "/v1/chat/completions");

    } else {
        ngx_str_set(&path, "/v1/completions");
    }

    uri.len = pcf->prefill_pass.len + path.len;
    uri.data = ngx_pnalloc(r->pool, uri.len);
    if (uri.data == NULL) {
        return NGX_ERROR;
    }

    u = ngx_cpymem(uri.data, pcf->prefill_pass.data, pcf->prefill_pass.len);
    ngx_memcpy(u, path.data, path.len);

    ps = ngx_palloc(r->pool, sizeof(ngx_http_post_subrequest_t));
    if (ps == NULL) {
        return NGX_ERROR;
    }

    ps->handler = ngx_http_dpd_prefill_done;
    ps->data = ctx;

    if (ngx_http_subrequest(r, &uri, r->args.len ? &r->args : NULL, &sr, ps,
                            NGX_HTTP_SUBREQUEST_IN_MEMORY
                            |NGX_HTTP_SUBREQUEST_WAITED)
        != NGX_OK)
    {
        return NGX_ERROR;
    }

    /* dpd_prefix_cache prefill=: the prefiller by its own cache and load */

    dlcf = ngx_http_get_module_loc_conf(r, ngx_http_dpd_module);

    if (ngx_http_dpd_prefix_prefill(r, sr, ctx, &dlcf->prefix) == NGX_ERROR) {
        return NGX_ERROR;
    }

    /* its own POST body; the headers (Authorization, X-Request-Id) are the
     * client's, shared with the main request */

    rb = ngx_pcalloc(r->pool, sizeof(ngx_http_request_body_t));
    b = ngx_calloc_buf(r->pool);
    cl = ngx_alloc_chain_link(r->pool);

    if (rb == NULL || b == NULL || cl == NULL) {
        return NGX_ERROR;
    }

    b->start = body.data;
    b->pos = body.data;
    b->last = body.data + body.len;
    b->end = b->last;
    b->memory = 1;
    b->last_buf = 1;
    b->last_in_chain = 1;

    cl->buf = b;
    cl->next = NULL;

    rb->bufs = cl;

    sr->request_body = rb;
    sr->method = NGX_HTTP_POST;
    ngx_str_set(&sr->method_name, "POST");
    sr->headers_in.content_length_n = body.len;
    sr->headers_in.chunked = 0;

    p->sr = sr;
    p->start = ngx_current_msec;
    p->state = NGX_HTTP_DPD_PREFILL_WAITING;

    p->timer.handler = ngx_http_dpd_prefill_timeout;
    p->timer.data = r;
    p->timer.log = r->connection->log;

    ngx_add_timer(&p->timer, pcf->timeout);

    ngx_http_dpd_metrics_inc(r, NGX_HTTP_DPD_M_PREFILL_REQUESTS);

    ngx_log_debug3(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "dpd prefill subrequest \"%V\", %uz bytes, decoder \"%V\"",
                   &uri, body.len, &p->decode_peer);

    return NGX_AGAIN;
}


/*
 * Runs on every finalize of the subrequest: record the first outcome only.
 * The subrequest shares the main request's pool, so what is kept here
 * lives as long as the main request.
 */

static ngx_int_t
ngx_http_dpd_prefill_done(ngx_http_request_t *sr, void *data, ngx_int_t rc)
{
    ngx_http_dpd_ctx_t *ctx = data;

    ngx_buf_t                   *b;
    ngx_str_t                   *name;
    ngx_connection_t            *c;
    ngx_http_upstream_t         *u;
    ngx_http_dpd_prefill_ctx_t  *p;

    p = &ctx->prefill;

    if (p->done) {
        return rc;
    }

    p->done = 1;
    p->rc = rc;
    p->elapsed = ngx_current_msec - p->start;

    if (p->timer.timer_set) {
        ngx_del_timer(&p->timer);
    }

    c = sr->connection;
    u = sr->upstream;

    ngx_log_debug3(NGX_LOG_DEBUG_HTTP, c->log, 0,
                   "dpd prefill done rc:%i s:%ui c->error:%ui", rc,
                   sr->headers_out.status, (ngx_uint_t) c->error);

    if (u) {
        if (u->headers_in.status_n) {
            p->answered = 1;
            p->status = u->headers_in.status_n;
        }

        /* the peer of the last try: the one that answered */
        name = (u->state && u->state->peer) ? u->state->peer : u->peer.name;

        if (name && name->len) {
            p->peer.data = ngx_pstrdup(sr->pool, name);
            if (p->peer.data) {
                p->peer.len = name->len;
            }
        }
    }

    if (rc == NGX_ERROR && c->error
        && !c->read->eof && !c->read->error && !c->write->error)
    {
        /*
         * ngx_http_output_filter() marks the client connection failed on
         * any filter error, including "too big subrequest response" from
         * the in-memory collector: the prefill broke, the client did not
         */
        c->error = 0;
    }

    if (c->error || rc == NGX_HTTP_CLIENT_CLOSED_REQUEST) {
        /* nginx terminates the whole request; nothing more to do */
        p->aborted = 1;
        return rc;
    }

    if (!p->answered) {
        if (rc >= NGX_HTTP_SPECIAL_RESPONSE) {
            /* nginx's own verdict: 502 connect/error, 504 timeout */
            p->status = rc;

        } else if (u == NULL && sr->headers_out.status) {
            /* the prefill location answered without an upstream */
            p->answered = 1;
            p->status = sr->headers_out.status;
        }
    }

    ngx_http_dpd_prefill_sent(sr, p);

    if (sr->out && sr->out->buf) {
        b = sr->out->buf;
        p->reply.data = b->pos;
        p->reply.len = b->last - b->pos;
    }

    if (sr->headers_out.content_type.len) {
        p->content_type = sr->headers_out.content_type;
    }

    if (rc == NGX_ERROR) {
        /*
         * a reply over subrequest_output_buffer_size, or a broken one: an
         * error of this prefill, not of the client's request, which must
         * not be terminated with it
         */
        p->broken = 1;
        return NGX_OK;
    }

    return rc;
}


/*
 * What went to the prefill engine, for the 404 check's log line: the
 * request line the upstream module built (its first buffer, from start:
 * a retry rewinds pos to start), else the subrequest's URI (no upstream:
 * the location answered itself).
 */

static void
ngx_http_dpd_prefill_sent(ngx_http_request_t *sr,
    ngx_http_dpd_prefill_ctx_t *p)
{
    u_char               *s, *e, *eol;
    ngx_buf_t            *b;
    ngx_http_upstream_t  *u;

    u = sr->upstream;

    if (u && u->request_bufs && u->request_bufs->buf
        && !u->request_bufs->buf->in_file && u->request_bufs->buf->start)
    {
        b = u->request_bufs->buf;
        s = b->start;
        e = b->last;

        eol = ngx_strlchr(s, e, CR);
        if (eol == NULL) {
            eol = ngx_strlchr(s, e, LF);
        }

        if (eol && eol > s) {
            p->sent.len = ngx_min((size_t) (eol - s), 1024);
            p->sent.data = ngx_pnalloc(sr->pool, p->sent.len);
            if (p->sent.data) {
                ngx_memcpy(p->sent.data, s, p->sent.len);
                return;
            }
        }
    }

    p->sent = sr->uri;
}


/*
 * dpd_prefill_timeout: the deadline for the whole prefill, whatever state
 * the subrequest is in (resolving the upstream's name, connecting,
 * sending, waiting for the reply, between tries, or still in its own
 * phases).  The subrequest is ended here rather than nudged: its
 * upstream is released the way nginx releases it when a request is
 * terminated (the upstream's own cleanup: the resolver query cancelled,
 * the connection closed, the peer freed with state 0, so our deadline
 * never counts towards the peer's max_fails), then the subrequest is
 * finalized; the post-subrequest handler records the outcome and wakes
 * the main request, whose phase handler falls back or answers.
 */

static void
ngx_http_dpd_prefill_timeout(ngx_event_t *ev)
{
    ngx_connection_t            *c;
    ngx_http_cleanup_t          *cln;
    ngx_http_request_t          *r, *sr;
    ngx_http_upstream_t         *u;
    ngx_http_dpd_ctx_t          *ctx;
    ngx_http_dpd_prefill_ctx_t  *p;

    r = ev->data;
    c = r->connection;

    ctx = ngx_http_dpd_get_ctx(r);
    if (ctx == NULL) {
        return;
    }

    p = &ctx->prefill;

    if (p->done || p->sr == NULL) {
        return;
    }

    p->timed_out = 1;

    ngx_log_error(NGX_LOG_WARN, c->log, 0,
                  "dpd: prefill of request \"%V\" timed out",
                  &ctx->request_id);

    sr = p->sr;
    u = sr->upstream;

    if (u && u->cleanup) {

        /*
         * u->cleanup points at the handler of the ngx_http_cleanup_t the
         * upstream registered (its first member).  That handler finalizes
         * the upstream with NGX_DONE, which ends in
         * ngx_http_finalize_request(sr, NGX_DONE) and so drops one
         * reference of the main request: take one for it.
         */

        cln = (ngx_http_cleanup_t *) u->cleanup;

        if (cln->handler) {
            r->main->count++;
            cln->handler(cln->data);
        }
    }

    if (!p->answered) {
        /* nginx's own verdict for a deadline */
        p->status = NGX_HTTP_GATEWAY_TIME_OUT;
    }

    /*
     * NGX_ERROR: no error page is generated into a subrequest that may
     * have sent its header already; the post-subrequest handler takes
     * it as a broken prefill (never as the client's error) and the
     * subrequest completes and wakes its parent
     */

    ngx_http_finalize_request(sr, NGX_ERROR);
    ngx_http_run_posted_requests(c);
}


static void
ngx_http_dpd_prefill_cleanup(void *data)
{
    ngx_http_dpd_prefill_ctx_t  *p = data;

    if (p->timer.timer_set) {
        ngx_del_timer(&p->timer);
    }

    if (p->kv_timer.timer_set) {
        ngx_del_timer(&p->kv_timer);
    }
}


static ngx_int_t
ngx_http_dpd_prefill_finish(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefill_conf_t *pcf)
{
    ngx_int_t                    rc;
    const char                  *why;
    ngx_pool_t                  *tree;
    ngx_http_dpd_prefill_ctx_t  *p;

    p = &ctx->prefill;
    why = NULL;

    ngx_http_dpd_metrics_observe(r, NGX_HTTP_DPD_H_PREFILL_SECONDS,
                                 (double) p->elapsed / 1000);

    if (p->aborted) {
        return NGX_HTTP_CLIENT_CLOSED_REQUEST;
    }

    if (p->timed_out) {
        return ngx_http_dpd_prefill_fail(r, ctx, pcf,
                                         NGX_HTTP_DPD_CAUSE_TIMEOUT, NULL);
    }

    if (p->broken) {
        return ngx_http_dpd_prefill_fail(r, ctx, pcf,
                                         NGX_HTTP_DPD_CAUSE_BAD_REPLY,
                                         "prefill reply too large or broken "
                                         "(see subrequest_output_buffer_size)");
    }

    if (!p->answered) {
        return ngx_http_dpd_prefill_fail(r, ctx, pcf,
                                         p->status == NGX_HTTP_GATEWAY_TIME_OUT
                                         ? NGX_HTTP_DPD_CAUSE_TIMEOUT
                                         : NGX_HTTP_DPD_CAUSE_CONNECT,
                                         NULL);
    }

    if (p->status >= NGX_HTTP_BAD_REQUEST
        && p->status < NGX_HTTP_INTERNAL_SERVER_ERROR)
    {
        ngx_http_dpd_metrics_inc(r, NGX_HTTP_DPD_M_PREFILL_FAIL_4XX);
        p->cause = NGX_HTTP_DPD_CAUSE_4XX;

        /* a 404 for the path: the gateway's configuration, not the
         * client's (ngx_http_dpd_check.c) */

        rc = ngx_http_dpd_check_prefill_404(r, ctx, &pcf->prefill_pass);
        if (rc != NGX_DECLINED) {
            return rc;
        }

        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "dpd: prefill of request \"%V\" answered %ui, "
                      "returned to the client", &ctx->request_id, p->status);

        ngx_http_dpd_balancer_unpin(r);

        return ngx_http_dpd_prefill_relay(r, ctx);
    }

    if (p->status < NGX_HTTP_OK || p->status >= NGX_HTTP_SPECIAL_RESPONSE) {
        return ngx_http_dpd_prefill_fail(r, ctx, pcf,
                                         p->status >= 500
                                         ? NGX_HTTP_DPD_CAUSE_5XX
                                         : NGX_HTTP_DPD_CAUSE_BAD_REPLY,
                                         NULL);
    }

    /* the prefiller computed the prompt: dpd_prefix_cache approximate
     * remembers it there now, not when it was chosen */
    ngx_http_dpd_prefix_learn(r, ctx, 1, &p->peer);

    tree = ngx_http_dpd_tree_scope(r->pool);
    rc = ngx_http_dpd_proto(pcf)->reply(r, ctx, pcf, &why);
    (void) ngx_http_dpd_tree_scope(tree);

    switch (rc) {

    case NGX_OK:
        return ngx_http_dpd_kv_wait(r, ctx, pcf);

    case NGX_DECLINED:
        /* nothing on its way: do not wait for it */
        p->kv_start = ngx_current_msec;
        p->kv = NGX_HTTP_DPD_KV_NOT_PUSHED;
        p->kv_done = 1;
        return ngx_http_dpd_prefill_handoff(r, ctx, pcf, why);

    case NGX_ABORT:
        return ngx_http_dpd_prefill_fail(r, ctx, pcf,
                                         NGX_HTTP_DPD_CAUSE_BAD_REPLY, why);

    default:
        return NGX_ERROR;
    }
}


/*
 * A prefill 4xx: the client gets it as the prefill engine sent it, from
 * the core's content handler (NGX_DONE: nothing is sent here).
 */

static ngx_int_t
ngx_http_dpd_prefill_relay(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx)
{
    ngx_http_dpd_prefill_ctx_t  *p;

    p = &ctx->prefill;

    ctx->answer = NGX_HTTP_DPD_ANSWER_BODY;
    ctx->answer_status = p->status;
    ctx->answer_body = p->reply;
    ctx->answer_content_type = p->content_type;

    return NGX_DONE;
}


static ngx_int_t
ngx_http_dpd_prefill_fail(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefill_conf_t *pcf, ngx_uint_t cause, const char *why)
{
    ngx_uint_t                   status, metric, fb;
    ngx_http_dpd_prefill_ctx_t  *p;

    p = &ctx->prefill;
    p->cause = cause;

    switch (cause) {
    case NGX_HTTP_DPD_CAUSE_5XX:
        metric = NGX_HTTP_DPD_M_PREFILL_FAIL_5XX;
        fb = NGX_HTTP_DPD_FB_PREFILL_5XX;
        break;
    case NGX_HTTP_DPD_CAUSE_TIMEOUT:
        metric = NGX_HTTP_DPD_M_PREFILL_FAIL_TIMEOUT;
        fb = NGX_HTTP_DPD_FB_PREFILL_TIMEOUT;
        break;
    case NGX_HTTP_DPD_CAUSE_CONNECT:
        metric = NGX_HTTP_DPD_M_PREFILL_FAIL_CONNECT;
        fb = NGX_HTTP_DPD_FB_PREFILL_CONNECT;
        break;
    case NGX_HTTP_DPD_CAUSE_BAD_REPLY:
        metric = NGX_HTTP_DPD_M_PREFILL_FAIL_BAD_REPLY;
        fb = NGX_HTTP_DPD_FB_PREFILL_BAD_REPLY;
        break;
    case NGX_HTTP_DPD_CAUSE_NO_DECODER:
        metric = NGX_HTTP_DPD_M_N;
        fb = NGX_HTTP_DPD_FB_NO_DECODER;
        break;
    case NGX_HTTP_DPD_CAUSE_NO_NODE:
        metric = NGX_HTTP_DPD_M_N;
        fb = NGX_HTTP_DPD_FB_NO_NODE;
        break;
    default:
        metric = NGX_HTTP_DPD_M_N;
        fb = NGX_HTTP_DPD_FB_OTHER;
    }

    if (metric != NGX_HTTP_DPD_M_N) {
        ngx_http_dpd_metrics_inc(r, metric);
    }

    /* the KV (if any) went nowhere: any decoder will do */
    ngx_http_dpd_balancer_unpin(r);

    status = (cause == NGX_HTTP_DPD_CAUSE_TIMEOUT)
             ? NGX_HTTP_GATEWAY_TIME_OUT : NGX_HTTP_BAD_GATEWAY;

    if (pcf->fallback == NGX_HTTP_DPD_FALLBACK_ERROR) {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "dpd: %s (status %ui) for request \"%V\"%s%V, "
                      "answering %ui",
                      ngx_http_dpd_cause_names[cause], p->status,
                      &ctx->request_id, why ? ": " : "",
                      ngx_http_dpd_log_cstr(r->pool, why ? why : ""),
                      status);

        /* the core's content handler sends it */

        ctx->answer = NGX_HTTP_DPD_ANSWER_ERROR;
        ctx->answer_status = status;
        ctx->answer_type = "server_error";
        ctx->answer_message = (status == NGX_HTTP_GATEWAY_TIME_OUT)
                              ? "the prefill pool timed out"
                              : "the prefill pool failed";
        return NGX_DONE;
    }

    ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                  "dpd: %s (status %ui) for request \"%V\"%s%V, "
                  "falling back to decode only",
                  ngx_http_dpd_cause_names[cause], p->status,
                  &ctx->request_id, why ? ": " : "",
                  ngx_http_dpd_log_cstr(r->pool, why ? why : ""));

    ctx->route = NGX_HTTP_DPD_ROUTE_FALLBACK;
    ngx_http_dpd_metrics_fallback(r, fb);

    if (ngx_http_dpd_plain_body(r, ctx) != NGX_OK) {
        return NGX_ERROR;
    }

    return NGX_DECLINED;
}


/*
 * The chosen() hook declined (it logged and counted why): nothing can be
 * handed over, so decode only, on any decoder, route fallback.
 */

static ngx_int_t
ngx_http_dpd_prefill_skip(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx)
{
    ngx_http_dpd_prefill_ctx_t  *p;

    p = &ctx->prefill;

    p->state = NGX_HTTP_DPD_PREFILL_FINISHED;
    p->cause = NGX_HTTP_DPD_CAUSE_NO_NODE;
    p->decode_peer.len = 0;
    p->decode_peer.data = NULL;

    ngx_http_dpd_balancer_unpin(r);

    ctx->route = NGX_HTTP_DPD_ROUTE_FALLBACK;
    ngx_http_dpd_metrics_fallback(r, NGX_HTTP_DPD_FB_NO_NODE);

    if (ngx_http_dpd_plain_body(r, ctx) != NGX_OK) {
        return NGX_ERROR;
    }

    return NGX_DECLINED;
}


/* the client's request without kv_transfer_params: decode only */

static ngx_int_t
ngx_http_dpd_plain_body(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx)
{
    char    *text;
    size_t   len;

    text = ngx_http_dpd_proto_decode_body(&ctx->req, NULL, NULL, &len);
    if (text == NULL) {
        return NGX_ERROR;
    }

    return ngx_http_dpd_replace_body(r, (u_char *) text, len);
}


ngx_int_t
ngx_http_dpd_proto_text(char *text, size_t len, ngx_str_t *body)
{
    /* built in the request pool (ctx->req.alloc): used in place */

    if (text == NULL) {
        return NGX_ERROR;
    }

    body->data = (u_char *) text;
    body->len = len;

    return NGX_OK;
}


u_char *
ngx_http_dpd_cstr(ngx_pool_t *pool, ngx_str_t *s)
{
    u_char  *p;

    p = ngx_pnalloc(pool, s->len + 1);
    if (p == NULL) {
        return NULL;
    }

    ngx_memcpy(p, s->data, s->len);
    p[s->len] = '\0';

    return p;
}


/* "127.0.0.2:8000" or "[::1]:8000" -> NUL-terminated host, via the parser
 * nginx uses for addresses, so only a real address comes out */

ngx_int_t
ngx_http_dpd_peer_host(ngx_pool_t *pool, ngx_str_t *name, ngx_str_t *host)
{
    u_char     *p;
    ngx_addr_t  addr;

    if (name->len == 0) {
        return NGX_ERROR;
    }

    ngx_memzero(&addr, sizeof(ngx_addr_t));

    if (ngx_parse_addr_port(pool, &addr, name->data, name->len) != NGX_OK) {
        return NGX_ERROR;
    }

    if (ngx_http_dpd_sockaddr_host(pool, addr.sockaddr, addr.socklen, host)
        != NGX_OK)
    {
        return NGX_ERROR;
    }

    p = ngx_http_dpd_cstr(pool, host);
    if (p == NULL) {
        return NGX_ERROR;
    }

    host->data = p;

    return NGX_OK;
}


static ngx_int_t
ngx_http_dpd_prefill_variable(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, uintptr_t data)
{
    u_char                      *s;
    ngx_str_t                   *peer;
    ngx_uint_t                   i;
    ngx_http_dpd_ctx_t          *ctx;
    ngx_http_upstream_state_t   *state;
    ngx_http_dpd_prefill_ctx_t  *p;

    v->not_found = 1;

    ctx = ngx_http_dpd_get_ctx(r->main);
    if (ctx == NULL) {
        return NGX_OK;
    }

    p = &ctx->prefill;

    switch (data) {

    case NGX_HTTP_DPD_VAR_PREFILL_PEER:
        if (p->peer.len == 0) {
            return NGX_OK;
        }

        v->data = p->peer.data;
        v->len = p->peer.len;
        break;

    case NGX_HTTP_DPD_VAR_DECODE_PEER:

        /* the peer proxy_pass last used, else the pinned one */

        peer = NULL;

        if (r->main->upstream_states) {
            state = r->main->upstream_states->elts;

            for (i = r->main->upstream_states->nelts; i > 0; i--) {
                if (state[i - 1].peer) {
                    peer = state[i - 1].peer;
                    break;
                }
            }
        }

        if (peer == NULL && p->decode_peer.len) {
            peer = &p->decode_peer;
        }

        if (peer == NULL) {
            return NGX_OK;
        }

        v->data = peer->data;
        v->len = peer->len;
        break;

    case NGX_HTTP_DPD_VAR_PREFILL_TIME:
        if (!p->done) {
            return NGX_OK;
        }

        s = ngx_pnalloc(r->pool, NGX_TIME_T_LEN);
        if (s == NULL) {
            return NGX_ERROR;
        }

        v->data = s;
        v->len = ngx_sprintf(s, "%M", p->elapsed) - s;
        break;

    case NGX_HTTP_DPD_VAR_KV_WAIT_TIME:
        if (p->kv == NGX_HTTP_DPD_KV_NONE) {
            return NGX_OK;
        }

        s = ngx_pnalloc(r->pool, NGX_TIME_T_LEN);
        if (s == NULL) {
            return NGX_ERROR;
        }

        v->data = s;
        v->len = ngx_sprintf(s, "%M", p->kv_elapsed) - s;
        break;

    default: /* NGX_HTTP_DPD_VAR_PREFILL_STATUS */
        if (!p->done || p->status == 0) {
            return NGX_OK;
        }

        s = ngx_pnalloc(r->pool, NGX_INT_T_LEN);
        if (s == NULL) {
            return NGX_ERROR;
        }

        v->data = s;
        v->len = ngx_sprintf(s, "%ui", p->status) - s;
        break;
    }

    v->valid = 1;
    v->no_cacheable = 0;
    v->not_found = 0;

    return NGX_OK;
}


/* the readiness wait */

/*
 * reply() said the KV is on its way: with a ready() hook, check it now
 * and then poll it (timer, 1 ms doubling to 10 ms) until it has a verdict
 * or dpd_kv_wait passes, watching the client; without one, hand off now.
 */

static ngx_int_t
ngx_http_dpd_kv_wait(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefill_conf_t *pcf)
{
    ngx_connection_t            *c;
    ngx_http_dpd_prefill_ctx_t  *p;

    p = &ctx->prefill;
    c = r->connection;

    p->kv_start = ngx_current_msec;

    if (ngx_http_dpd_proto(pcf)->ready == NULL) {
        p->kv = NGX_HTTP_DPD_KV_READY;
        p->kv_done = 1;
        return ngx_http_dpd_prefill_handoff(r, ctx, pcf, NULL);
    }

    p->kv_waited = 1;
    p->state = NGX_HTTP_DPD_PREFILL_KV_WAIT;

    if (ngx_http_dpd_kv_check(r, ctx, pcf) == NGX_OK) {
        p->kv_done = 1;

        if (p->kv == NGX_HTTP_DPD_KV_NO_TABLE) {
            /* nothing was polled */
            p->kv_waited = 0;
        }

        return ngx_http_dpd_prefill_handoff(r, ctx, pcf, NULL);
    }

    /* no subrequest watches the client any more: we do */

    r->read_event_handler = ngx_http_dpd_kv_reading;

    if (ngx_handle_read_event(c->read, 0) != NGX_OK) {
        return NGX_ERROR;
    }

    p->kv_timer.handler = ngx_http_dpd_kv_tick;
    p->kv_timer.data = r;
    p->kv_timer.log = c->log;
    p->kv_interval = 1;

    ngx_http_dpd_kv_arm(p, pcf);

    return NGX_AGAIN;
}


/* NGX_OK: the wait is over (p->kv says why); NGX_AGAIN: keep waiting */

static ngx_int_t
ngx_http_dpd_kv_check(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefill_conf_t *pcf)
{
    ngx_int_t                    rc;
    ngx_http_dpd_prefill_ctx_t  *p;

    p = &ctx->prefill;

    rc = ngx_http_dpd_proto(pcf)->ready(r, ctx, pcf);

    if (rc == NGX_OK) {
        return NGX_OK;
    }

    if (rc != NGX_AGAIN) {
        p->kv = NGX_HTTP_DPD_KV_FAILED;
        return NGX_OK;
    }

    if (ngx_current_msec - p->kv_start >= pcf->kv_wait) {
        p->kv = NGX_HTTP_DPD_KV_TIMEOUT;
        return NGX_OK;
    }

    return NGX_AGAIN;
}


static void
ngx_http_dpd_kv_arm(ngx_http_dpd_prefill_ctx_t *p,
    ngx_http_dpd_prefill_conf_t *pcf)
{
    ngx_msec_t  t, elapsed;

    t = p->kv_interval;
    elapsed = ngx_current_msec - p->kv_start;

    /* never sleep past the deadline */

    if (elapsed < pcf->kv_wait && pcf->kv_wait - elapsed < t) {
        t = pcf->kv_wait - elapsed;
    }

    if (t == 0) {
        t = 1;
    }

    ngx_add_timer(&p->kv_timer, t);

    if (p->kv_interval < NGX_HTTP_DPD_KV_POLL_MAX) {
        p->kv_interval *= 2;

        if (p->kv_interval > NGX_HTTP_DPD_KV_POLL_MAX) {
            p->kv_interval = NGX_HTTP_DPD_KV_POLL_MAX;
        }
    }
}


static void
ngx_http_dpd_kv_tick(ngx_event_t *ev)
{
    ngx_connection_t            *c;
    ngx_http_request_t          *r;
    ngx_http_dpd_ctx_t          *ctx;
    ngx_http_dpd_loc_conf_t     *dlcf;
    ngx_http_dpd_prefill_ctx_t  *p;

    r = ev->data;
    c = r->connection;

    ctx = ngx_http_dpd_get_ctx(r);
    if (ctx == NULL) {
        return;
    }

    p = &ctx->prefill;

    if (p->state != NGX_HTTP_DPD_PREFILL_KV_WAIT || p->kv_done) {
        return;
    }

    /* an event nobody consumed yet (edge-triggered): is the client gone? */

    if ((c->error || c->read->ready || c->read->pending_eof)
        && ngx_http_dpd_kv_client_gone(r))
    {
        ngx_http_dpd_kv_client_closed(r, p);
        return;
    }

    dlcf = ngx_http_get_module_loc_conf(r, ngx_http_dpd_module);

    if (ngx_http_dpd_kv_check(r, ctx, &dlcf->prefill) == NGX_AGAIN) {
        ngx_http_dpd_kv_arm(p, &dlcf->prefill);
        return;
    }

    p->kv_done = 1;

    /* resume the phases: the handler hands off to the decoder */

    r->write_event_handler = ngx_http_core_run_phases;
    ngx_http_core_run_phases(r);
    ngx_http_run_posted_requests(c);
}


/*
 * The request's read handler during the wait: the client connection
 * (HTTP/1.x) or the stream (HTTP/2: a RST_STREAM or the connection's end
 * sets c->error and calls this handler) may report the client gone.
 */

static void
ngx_http_dpd_kv_reading(ngx_http_request_t *r)
{
    ngx_http_dpd_ctx_t  *ctx;

    ctx = ngx_http_dpd_get_ctx(r);

    if (ctx && ngx_http_dpd_kv_client_gone(r)) {
        ngx_http_dpd_kv_client_closed(r, &ctx->prefill);
    }
}


/*
 * The wait ends with the client: record it and resume the phases; the
 * phase handler returns 499 and the phase engine terminates the request
 * (the last touch of it).
 */

static void
ngx_http_dpd_kv_client_closed(ngx_http_request_t *r,
    ngx_http_dpd_prefill_ctx_t *p)
{
    ngx_connection_t  *c;

    if (p->state != NGX_HTTP_DPD_PREFILL_KV_WAIT || p->kv_done) {
        return;
    }

    ngx_http_dpd_metrics_kv_wait(r, NGX_HTTP_DPD_KVW_CLIENT_CLOSED, -1);

    p->kv_done = 1;
    p->aborted = 1;
    p->kv_elapsed = ngx_current_msec - p->kv_start;

    if (p->kv_timer.timer_set) {
        ngx_del_timer(&p->kv_timer);
    }

    r->read_event_handler = ngx_http_block_reading;

    c = r->connection;

    r->write_event_handler = ngx_http_core_run_phases;
    ngx_http_core_run_phases(r);
    ngx_http_run_posted_requests(c);
}


/*
 * 1 when the client closed its connection (as nginx's upstream checks a
 * broken connection: epoll's RDHUP, else a peek at the socket); the
 * request is then to be finalized with 499.
 */

static ngx_int_t
ngx_http_dpd_kv_client_gone(ngx_http_request_t *r)
{
    int                n;
    char               buf[1];
    ngx_err_t          err;
    ngx_event_t       *rev;
    ngx_connection_t  *c;

    c = r->connection;
    rev = c->read;

    /*
     * first, as ngx_http_upstream_check_broken_connection(): HTTP/2 marks
     * the stream's connection failed on RST_STREAM or when the whole
     * connection ends
     */

    if (c->error) {
        ngx_log_error(NGX_LOG_INFO, c->log, 0,
                      "client gone while waiting for the KV of request "
                      "\"%V\"", &ngx_http_dpd_get_ctx(r)->request_id);
        return 1;
    }

#if (NGX_HTTP_V2)
    if (r->stream) {
        /* nothing to peek at: the stream reports through c->error */
        return 0;
    }
#endif

    err = 0;

#if (NGX_HAVE_EPOLLRDHUP)

    if ((ngx_event_flags & NGX_USE_EPOLL_EVENT) && ngx_use_epoll_rdhup) {

        if (!rev->pending_eof) {
            return 0;
        }

        goto closed;
    }

#endif

    n = recv(c->fd, buf, 1, MSG_PEEK);

    if (n == 0) {
        goto closed;
    }

    if (n == -1) {
        err = ngx_socket_errno;

        if (err != NGX_EAGAIN) {
            goto closed;
        }
    }

    /* still there (a pipelined request, or nothing): no busy loop */

    if ((ngx_event_flags & NGX_USE_LEVEL_EVENT) && rev->active) {
        if (ngx_del_event(rev, NGX_READ_EVENT, 0) != NGX_OK) {
            return 1;
        }
    }

    return 0;

closed:

    rev->eof = 1;
    c->error = 1;

    ngx_log_error(NGX_LOG_INFO, c->log, err,
                  "client prematurely closed connection while waiting "
                  "for the KV of request \"%V\"",
                  &ngx_http_dpd_get_ctx(r)->request_id);

    return 1;
}


/*
 * The hand-off: the protocol's decode body replaces the main request's,
 * the wait's outcome (when there was one) goes to the metrics and the log.
 */

static ngx_int_t
ngx_http_dpd_prefill_handoff(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefill_conf_t *pcf, const char *why)
{
    ngx_str_t                    body;
    ngx_uint_t                   outcome, level;
    ngx_http_dpd_proto_t        *proto;
    ngx_http_dpd_prefill_ctx_t  *p;

    p = &ctx->prefill;
    proto = ngx_http_dpd_proto(pcf);

    p->state = NGX_HTTP_DPD_PREFILL_FINISHED;
    p->kv_elapsed = ngx_current_msec - p->kv_start;

    if (proto->ready) {

        switch (p->kv) {
        case NGX_HTTP_DPD_KV_READY:
            outcome = NGX_HTTP_DPD_KVW_READY;
            break;
        case NGX_HTTP_DPD_KV_FAILED:
            outcome = NGX_HTTP_DPD_KVW_FAILED;
            break;
        case NGX_HTTP_DPD_KV_TIMEOUT:
            outcome = NGX_HTTP_DPD_KVW_TIMEOUT;
            break;
        case NGX_HTTP_DPD_KV_NO_TABLE:
            outcome = NGX_HTTP_DPD_KVW_NO_TABLE;
            break;
        default: /* NGX_HTTP_DPD_KV_NOT_PUSHED */
            outcome = NGX_HTTP_DPD_KVW_NOT_PUSHED;
        }

        /* the histogram holds the waits that polled */

        ngx_http_dpd_metrics_kv_wait(r, outcome,
                                     p->kv_waited
                                     ? (ngx_msec_int_t) p->kv_elapsed : -1);
    }

    if (p->kv_timer.timer_set) {
        ngx_del_timer(&p->kv_timer);
    }

    if (r->read_event_handler == ngx_http_dpd_kv_reading) {
        r->read_event_handler = ngx_http_block_reading;
    }

    if (proto->decode_body(r, ctx, pcf, &body) != NGX_OK
        || ngx_http_dpd_replace_body(r, body.data, body.len) != NGX_OK)
    {
        return NGX_ERROR;
    }

    if (p->kv == NGX_HTTP_DPD_KV_READY) {
        p->params = 1;
        ngx_http_dpd_metrics_inc(r, NGX_HTTP_DPD_M_KV_HANDOFF_PARAMS);

        /* the decode leg starts: nixl's KV pull is timed from here */
        ctx->decode_usec = ngx_http_dpd_now_usec();

        ngx_log_debug4(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                       "dpd %V: KV of \"%V\" handed to %V after %M ms",
                       &proto->name, &ctx->request_id, &p->decode_peer,
                       p->kv_elapsed);

        return NGX_DECLINED;
    }

    ngx_http_dpd_metrics_inc(r, NGX_HTTP_DPD_M_KV_HANDOFF_NO_PARAMS);

    if (proto->flags & NGX_HTTP_DPD_PROTO_NO_KV_FALLBACK) {

        /* no KV reuse: reported as such, not as a disaggregated request */

        ctx->route = NGX_HTTP_DPD_ROUTE_FALLBACK;
        ngx_http_dpd_metrics_fallback(r, NGX_HTTP_DPD_FB_NO_KV_PARAMS);

        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "dpd: request \"%V\" decodes without KV transfer "
                      "params (%V), the decoder recomputes the prompt "
                      "(route fallback)",
                      &ctx->request_id,
                      ngx_http_dpd_log_cstr(r->pool,
                                            why ? why : "none in the reply"));

        return NGX_DECLINED;
    }

    level = p->quiet ? NGX_LOG_INFO : NGX_LOG_WARN;

    ngx_log_error(level, r->connection->log, 0,
                  "dpd: %V: KV of request \"%V\" %s%s%V "
                  "(waited %M ms), decoder %V recomputes the prompt",
                  &proto->name, &ctx->request_id,
                  ngx_http_dpd_kv_names[p->kv],
                  why ? ": " : "",
                  ngx_http_dpd_log_cstr(r->pool, why ? why : ""),
                  p->kv_elapsed, &p->decode_peer);

    return NGX_DECLINED;
}


/*
 * The balancer sends the decode of a pinned request to another decoder
 * (its pinned one failed or left the upstream): the protocol's decode body
 * for that decoder, which holds none of the pushed KV
 */

static ngx_int_t
ngx_http_dpd_prefill_moved(ngx_http_request_t *r, ngx_http_dpd_pin_t *pin,
    ngx_str_t *name, ngx_str_t *host)
{
    ngx_http_dpd_ctx_t  *ctx;

    ctx = ngx_http_dpd_get_ctx(r->main);
    if (ctx == NULL) {
        return NGX_ERROR;
    }

    /* the peer's name may go with the peer (resolve): a copy of our own */

    ctx->prefill.decode_peer.data = ngx_pstrdup(r->main->pool, name);
    if (ctx->prefill.decode_peer.data == NULL) {
        return NGX_ERROR;
    }

    ctx->prefill.decode_peer.len = name->len;

    return ngx_http_dpd_prefill_rebuild(r);
}


ngx_int_t
ngx_http_dpd_prefill_rebuild(ngx_http_request_t *r)
{
    ngx_str_t                 body;
    ngx_http_dpd_ctx_t       *ctx;
    ngx_http_dpd_loc_conf_t  *dlcf;

    ctx = ngx_http_dpd_get_ctx(r->main);

    if (ctx == NULL || ctx->prefill.state != NGX_HTTP_DPD_PREFILL_FINISHED
        || ctx->prefill.cause != NGX_HTTP_DPD_CAUSE_NONE)
    {
        /* a fallback's plain body fits any decoder as it is */
        return NGX_DECLINED;
    }

    dlcf = ngx_http_get_module_loc_conf(r->main, ngx_http_dpd_module);

    ctx->prefill.retried = 1;

    if (ngx_http_dpd_proto(&dlcf->prefill)->decode_body(r->main, ctx,
                                                        &dlcf->prefill, &body)
        != NGX_OK)
    {
        return NGX_ERROR;
    }

    return ngx_http_dpd_replace_body(r->main, body.data, body.len);
}
