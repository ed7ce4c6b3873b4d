/*
 * OpenAI requests in ngx_http_dpd_module: the nginx side of reading a
 * request.  The body's bytes are checked, parsed and indexed once
 * (ngx_http_dpd_proto_parse_request(), ngx_http_dpd_protocol.c), the
 * prompt is counted as vLLM reports it in usage.prompt_tokens
 * (ngx_http_dpd_count(), ngx_http_dpd_count.c), and the parsed tree is
 * dropped: the bodies sent upstream are spliced from the client's bytes
 * with the index.  Both files are nginx-free, so t/201 and the libFuzzer
 * target (ngx_dpd_module/fuzz/) run the same code.
 *
 * Bad input sets ctx->err_* (status 400, the metric reason, a message); the
 * phase handler answers it with an OpenAI-shaped error.
 */


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "ngx_http_dpd_module.h"
#include "ngx_http_dpd_count.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif


#define NGX_HTTP_DPD_ERR_MSG_LEN  512


/* the largest block of a tree's pool */
#define NGX_HTTP_DPD_TREE_BLOCK   (1024 * 1024)

/* a body from this size on: the freed pages go back to the system */
#define NGX_HTTP_DPD_TRIM_BODY    (256 * 1024)


static ngx_int_t ngx_http_dpd_parse_and_count(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_main_conf_t *dmcf,
    ngx_http_dpd_loc_conf_t *dlcf);
static ngx_int_t ngx_http_dpd_reject(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_uint_t reason, const char *message);
static ngx_uint_t ngx_http_dpd_bad_reason(int bad);
static void *ngx_http_dpd_pool_alloc(void *pool, size_t size);
static void *ngx_http_dpd_tree_alloc(size_t size);
static void ngx_http_dpd_tree_free(void *p);
static void ngx_http_dpd_tree_release(void *data);
#if defined(__GLIBC__)
static void ngx_http_dpd_trim_handler(ngx_event_t *ev);
#endif


/* cJSON's allocator while a request is parsed and counted (see below) */
static ngx_pool_t  *ngx_http_dpd_tree_pool;

#if defined(__GLIBC__)
/* malloc_trim() once the current event is done with a big request */
static ngx_event_t  ngx_http_dpd_trim_event;
#endif


/*
 * dpd_count bound: ids <= (ascii bytes + other bytes * G) * P + specials,
 * with G, P and the specials from the tokenizer (dpd_tok_bound_params(),
 * which says why it holds).  A tokenizer the bound cannot describe gets
 * factor 0: always exact.
 */

void
ngx_http_dpd_count_bound_init(ngx_http_dpd_main_conf_t *dmcf)
{
    dpd_tok_bound_t  b;

    if (dpd_tok_bound_params(dmcf->tok, &b) != 0) {
        /* a pipeline the bound cannot describe: always count exactly */
        dmcf->bound_other = 0;
        dmcf->bound_prefix = 0;
        dmcf->bound_specials = 0;
        return;
    }

    dmcf->bound_other = b.other_factor;
    dmcf->bound_prefix = b.prefix_factor;
    dmcf->bound_specials = b.specials;
}


/*
 * The parsed tree (64 bytes a node, up to dpd_max_json_members nodes) lives
 * in a pool of its own: cJSON's hooks point into it from the parse to the
 * end of the count (nothing else runs in between: one thread, no event),
 * and the whole tree goes back with one ngx_destroy_pool() once counted,
 * instead of one free() per node (node by node through malloc(), 80 bytes
 * a node and 32 a key).
 *
 * A request's big buffers (the body's copy, the tree's blocks, a long
 * prompt's copies, the tokenizer's 20 bytes per byte of its longest word:
 * tens of MB for a body of a few MB) are freed, but malloc() keeps freed
 * pages: the worker's heap starts with a large free hole (the master's
 * parse of tokenizer.json) that such buffers fill first, so the pages they
 * touched stayed resident (t/260: two workers grew from 19 to 90 MB in a
 * run and never shrank).  For a body of NGX_HTTP_DPD_TRIM_BODY or more,
 * malloc_trim() hands every free page back, once counted (the tree and the
 * scratch, before a possibly long stream) and once the request is freed
 * (the copies: from an event posted by the request pool's cleanup, which
 * runs before the pool's large allocations are freed).  t/260: 0.1 to
 * 1.4 ms a call, median 0.55 ms, for requests of tens to hundreds of ms.
 */

ngx_int_t
ngx_http_dpd_openai_process(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_main_conf_t *dmcf, ngx_http_dpd_loc_conf_t *dlcf)
{
    size_t       size;
    ngx_int_t    rc;
    ngx_pool_t  *pool;
    cJSON_Hooks  hooks;

    if (ngx_http_dpd_body_bytes(r, &ctx->body) != NGX_OK) {
        return NGX_ERROR;
    }

    if (ctx->body.len == 0) {
        return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_EMPTY_BODY,
                                   "the request body is empty: expected a "
                                   "JSON object");
    }

    /*
     * a value takes at least 2 bytes of the body, a node 64 bytes of the
     * pool: a block holds the tree of a small body whole
     */

    size = ctx->body.len;
    size = (size > NGX_HTTP_DPD_TREE_BLOCK / 32) ? NGX_HTTP_DPD_TREE_BLOCK
                                                 : size * 32;
    size = ngx_align(size, ngx_pagesize);

    pool = ngx_create_pool(size, r->connection->log);
    if (pool == NULL) {
        return NGX_ERROR;
    }

    ctx->req.tree_release = ngx_http_dpd_tree_release;
    ctx->req.tree_data = pool;

    hooks.malloc_fn = ngx_http_dpd_tree_alloc;
    hooks.free_fn = ngx_http_dpd_tree_free;

    ngx_http_dpd_tree_pool = pool;
    cJSON_InitHooks(&hooks);

    rc = ngx_http_dpd_parse_and_count(r, ctx, dmcf, dlcf);

    cJSON_InitHooks(NULL);
    ngx_http_dpd_tree_pool = NULL;

    /* from here on the index is enough: the tree is not kept for the
     * life of a (possibly long) stream */

    ngx_http_dpd_proto_drop_tree(&ctx->req);

#if defined(__GLIBC__)
    if (ctx->body.len >= NGX_HTTP_DPD_TRIM_BODY) {
        malloc_trim(0);
    }
#endif

    return rc;
}


void
ngx_http_dpd_openai_cleanup(ngx_http_dpd_ctx_t *ctx)
{
    ngx_http_dpd_proto_drop_tree(&ctx->req);

#if defined(__GLIBC__)
    if (ctx->body.len >= NGX_HTTP_DPD_TRIM_BODY) {
        ngx_http_dpd_trim_event.handler = ngx_http_dpd_trim_handler;
        ngx_http_dpd_trim_event.log = ngx_cycle->log;

        ngx_post_event(&ngx_http_dpd_trim_event, &ngx_posted_events);
    }
#endif
}


static ngx_int_t
ngx_http_dpd_parse_and_count(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_main_conf_t *dmcf, ngx_http_dpd_loc_conf_t *dlcf)
{
    int                         rc;
    const cJSON                *stream;
    ngx_http_dpd_limits_t       limits;
    ngx_http_dpd_count_t        count;
    ngx_http_dpd_count_conf_t   cf;

    /* the index and the bodies built from it live in the request pool */

    ctx->req.alloc = ngx_http_dpd_pool_alloc;
    ctx->req.alloc_data = r->pool;

    limits.max_depth = (size_t) dlcf->max_json_depth;
    limits.max_elements = (size_t) dlcf->max_json_members;

    rc = ngx_http_dpd_proto_parse_request(&ctx->req,
                                          (const char *) ctx->body.data,
                                          ctx->body.len, &limits);
    if (rc < 0) {
        return NGX_ERROR;
    }

    if (rc > 0) {
        return ngx_http_dpd_reject(r, ctx,
                                   ngx_http_dpd_bad_reason(ctx->req.bad),
                                   ctx->req.why);
    }

    /* transfer metadata is the gateway's business, never the client's */

    if (ctx->req.kv_params) {
        ctx->kv_stripped = 1;
        ngx_http_dpd_metrics_inc(r, NGX_HTTP_DPD_M_KV_STRIPPED);

        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "dpd: client \"kv_transfer_params\" removed (%uz)",
                      ctx->req.kv_params);
    }

    stream = cJSON_GetObjectItemCaseSensitive(ctx->req.json, "stream");
    ctx->stream = cJSON_IsTrue(stream) ? 1 : 0;

    cf.tok = dmcf->tok;
    cf.tmpl = (dpd_chat_template_t) dlcf->chat_template;
    if (cf.tmpl == DPD_CHAT_AUTO) {
        cf.tmpl = dmcf->tok_template;
    }

    cf.chat = (ctx->kind == NGX_HTTP_DPD_KIND_CHAT);
    cf.bound = (dlcf->count == NGX_HTTP_DPD_COUNT_BOUND);
    cf.threshold = (long) dlcf->threshold;
    cf.max_prompt_ids = (size_t) dlcf->max_prompt_ids;
    cf.max_messages = (size_t) dlcf->max_messages;
    cf.bound_other = dmcf->bound_other;
    cf.bound_prefix = dmcf->bound_prefix;
    cf.bound_specials = dmcf->bound_specials;

    rc = ngx_http_dpd_count(ctx->req.json, &cf, &count);

    if (rc != 0) {
        return NGX_ERROR;
    }

    if (count.bad) {
        return ngx_http_dpd_reject(r, ctx, ngx_http_dpd_bad_reason(count.bad),
                                   count.why);
    }

    if (count.note[0]) {
        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "dpd: request \"%V\": %s", &ctx->request_id,
                      count.note);
    }

    ctx->prompt_tokens = count.tokens;
    ctx->prompt_bound = count.bound;
    ctx->count_skipped = count.skipped;
    ctx->estimated = count.estimated;

    return NGX_OK;
}


static ngx_int_t
ngx_http_dpd_reject(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_uint_t reason, const char *message)
{
    size_t  len;

    len = ngx_strlen(message);

    if (len > NGX_HTTP_DPD_ERR_MSG_LEN - 1) {
        len = NGX_HTTP_DPD_ERR_MSG_LEN - 1;
    }

    ctx->err_message = ngx_pnalloc(r->pool, len + 1);
    if (ctx->err_message == NULL) {
        return NGX_ERROR;
    }

    ngx_memcpy(ctx->err_message, message, len);
    ctx->err_message[len] = '\0';

    ctx->err_status = NGX_HTTP_BAD_REQUEST;
    ctx->err_reason = reason;
    ctx->err_type = "invalid_request_error";

    return NGX_OK;
}


static ngx_uint_t
ngx_http_dpd_bad_reason(int bad)
{
    switch (bad) {

    case NGX_HTTP_DPD_BAD_UTF8:
        return NGX_HTTP_DPD_E_INVALID_UTF8;

    case NGX_HTTP_DPD_BAD_DEPTH:
        return NGX_HTTP_DPD_E_TOO_DEEP;

    case NGX_HTTP_DPD_BAD_FIELD:
        return NGX_HTTP_DPD_E_INVALID_FIELD;

    case NGX_HTTP_DPD_BAD_TOKEN_RANGE:
        return NGX_HTTP_DPD_E_TOKEN_RANGE;

    case NGX_HTTP_DPD_BAD_DUPLICATE:
        return NGX_HTTP_DPD_E_DUPLICATE_KEY;

    case NGX_HTTP_DPD_BAD_NUL:
        return NGX_HTTP_DPD_E_NUL_CHAR;

    case NGX_HTTP_DPD_BAD_LIMIT:
        return NGX_HTTP_DPD_E_OVER_LIMIT;

    default: /* NGX_HTTP_DPD_BAD_MALFORMED */
        return NGX_HTTP_DPD_E_MALFORMED_JSON;
    }
}


static void *
ngx_http_dpd_pool_alloc(void *pool, size_t size)
{
    return ngx_palloc(pool, size);
}


static void *
ngx_http_dpd_tree_alloc(size_t size)
{
    return ngx_palloc(ngx_http_dpd_tree_pool, size);
}


static void
ngx_http_dpd_tree_free(void *p)
{
    /* the memory goes back with the pool: ngx_http_dpd_tree_release() */
}


static void
ngx_http_dpd_tree_release(void *data)
{
    ngx_destroy_pool(data);
}


#if defined(__GLIBC__)

static void
ngx_http_dpd_trim_handler(ngx_event_t *ev)
{
    malloc_trim(0);
}

#endif
