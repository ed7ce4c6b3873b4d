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
#include "ngx_http_dpd_json.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif


#define NGX_HTTP_DPD_ERR_MSG_LEN  512


/* the largest block of a tree's pool */
#define NGX_HTTP_DPD_TREE_BLOCK   (1024 * 1024)

/* a body from this size on: the freed pages go back to the system */
#define NGX_HTTP_DPD_TRIM_BODY    (256 * 1024)

/* bodies up to this size parse into the event loop's kept tree pool */
#define NGX_HTTP_DPD_TREE_KEPT_BODY  2048


/*
 * The parse and count of one body: what ngx_http_dpd_job_run() needs and
 * what it found.  Inline, on the stack; with dpd_count_thread_pool, in a
 * pool of its own (the job's pool also holds the index, so that the
 * thread never allocates from the request pool), with the task.
 */
typedef struct {
    ngx_http_request_t         *request;
    ngx_http_dpd_ctx_t         *ctx;
    ngx_pool_t                 *tree;       /* cJSON's arena */
    ngx_http_dpd_limits_t       limits;
    ngx_http_dpd_count_conf_t   cf;

    ngx_http_dpd_loc_conf_t    *models;     /* dpd_model: whose entries
                                               pick the count's settings */
    int                         model_bad;  /* _model_pick()'s *bad */

    int                         parse_rc;   /* _proto_parse_request() */
    int                         count_rc;   /* ngx_http_dpd_count() */
    unsigned                    stream:1;
    ngx_http_dpd_count_t        count;
} ngx_http_dpd_job_t;


static void ngx_http_dpd_job_init(ngx_http_dpd_job_t *job,
    ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_main_conf_t *dmcf, ngx_http_dpd_loc_conf_t *dlcf,
    ngx_uint_t inline_job);
static void ngx_http_dpd_job_conf(ngx_http_dpd_job_t *job,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_loc_conf_t *dlcf);
static void ngx_http_dpd_job_run(ngx_http_dpd_job_t *job);
static ngx_int_t ngx_http_dpd_job_finish(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_job_t *job);
#if (NGX_THREADS)
static ngx_int_t ngx_http_dpd_job_post(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_main_conf_t *dmcf,
    ngx_http_dpd_loc_conf_t *dlcf);
static void ngx_http_dpd_job_thread(void *data, ngx_log_t *log);
static void ngx_http_dpd_job_done(ngx_event_t *ev);
static void ngx_http_dpd_job_pool_cleanup(void *data);
#endif
static ngx_int_t ngx_http_dpd_reject(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_uint_t reason, const char *message);
static ngx_uint_t ngx_http_dpd_bad_reason(int bad);
static void ngx_http_dpd_job_model(ngx_http_dpd_job_t *job);
static ngx_int_t ngx_http_dpd_model_reject(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, int bad);
static void *ngx_http_dpd_pool_alloc(void *pool, size_t size);
static void *ngx_http_dpd_tree_alloc(size_t size);
static void ngx_http_dpd_tree_free(void *p);
static void ngx_http_dpd_tree_release(void *data);
static void ngx_http_dpd_tree_reset(void *data);
static ngx_pool_t *ngx_http_dpd_tree_keep(void);
static void ngx_http_dpd_tree_unkeep(void *data);
#if defined(__GLIBC__)
static void ngx_http_dpd_trim_handler(ngx_event_t *ev);
#endif


/*
 * cJSON's allocator while a request is parsed and counted (see below):
 * per thread, as a count may run in a dpd_count_thread_pool thread while
 * the event loop parses another request or a prefill reply (malloc())
 */
static __thread ngx_pool_t  *ngx_http_dpd_tree_pool;

#if defined(__GLIBC__)
/* malloc_trim() once the current event is done with a big request */
static ngx_event_t  ngx_http_dpd_trim_event;
#endif

/*
 * The tree pool of small bodies counted inline (the event loop's thread
 * only): reset after each, not created and destroyed (a malloc() and a
 * free() of its block cost more than the parse of a short chat)
 */
static ngx_pool_t  *ngx_http_dpd_tree_kept;


/*
 * dpd_count bound: ids <= (ascii bytes + other bytes * G) * P + specials,
 * with G, P and the specials from the tokenizer (dpd_tok_bound_params(),
 * which says why it holds).  A tokenizer the bound cannot describe gets
 * factor 0: always exact.
 */

void
ngx_http_dpd_count_bound_init(ngx_http_dpd_tokenizer_t *t)
{
    dpd_tok_bound_t  b;

    if (dpd_tok_bound_params(t->tok, &b) != 0) {
        /* a pipeline the bound cannot describe: always count exactly */
        t->bound_other = 0;
        t->bound_prefix = 0;
        t->bound_specials = 0;
        return;
    }

    t->bound_other = b.other_factor;
    t->bound_prefix = b.prefix_factor;
    t->bound_specials = b.specials;
}


/*
 * The parsed tree (64 bytes a node, up to dpd_max_json_members nodes) lives
 * in a pool of its own: cJSON's hooks point into it from the parse to the
 * end of the count (a per-thread pointer: the event loop, or the
 * dpd_count_thread_pool thread that runs the job), and the whole tree goes back with one ngx_destroy_pool() once counted,
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
    ngx_int_t           rc;
    ngx_http_dpd_job_t  job;

    if (ctx->state == NGX_HTTP_DPD_STATE_COUNTED) {
        /* back from the thread: ngx_http_dpd_job_done() */
        return ctx->count_rc;
    }

    if (ngx_http_dpd_body_bytes(r, &ctx->body) != NGX_OK) {
        return NGX_ERROR;
    }

    if (ctx->body.len == 0) {
        return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_EMPTY_BODY,
                                   "the request body is empty: expected a "
                                   "JSON object");
    }

#if (NGX_THREADS)

    if (dlcf->count_pool && ctx->body.len >= dlcf->count_min_size) {
        rc = ngx_http_dpd_job_post(r, ctx, dmcf, dlcf);

        if (rc != NGX_DECLINED) {
            return rc;
        }

        /* the pool's queue is full (logged by nginx): counted here */
    }

#endif

    ngx_http_dpd_job_init(&job, r, ctx, dmcf, dlcf, 1);

    if (job.tree == NULL) {
        return NGX_ERROR;
    }

    /* the index and the bodies built from it live in the request pool */

    ctx->req.alloc = ngx_http_dpd_pool_alloc;
    ctx->req.alloc_data = r->pool;

    ngx_http_dpd_job_run(&job);

    rc = ngx_http_dpd_job_finish(r, ctx, &job);

#if defined(__GLIBC__)
    if (ctx->body.len >= NGX_HTTP_DPD_TRIM_BODY) {
        malloc_trim(0);
    }
#endif

    return rc;
}


/*
 * cJSON's hooks, set once per process: the tree pool of the calling
 * thread while it parses and counts a request, else malloc() and free()
 * (prefill replies, the tokenizer's files at configuration time)
 */

void
ngx_http_dpd_openai_init_process(void)
{
    cJSON_Hooks  hooks;

    hooks.malloc_fn = ngx_http_dpd_tree_alloc;
    hooks.free_fn = ngx_http_dpd_tree_free;

    cJSON_InitHooks(&hooks);
}


static void
ngx_http_dpd_job_init(ngx_http_dpd_job_t *job, ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_main_conf_t *dmcf,
    ngx_http_dpd_loc_conf_t *dlcf, ngx_uint_t inline_job)
{
    size_t  size;

    job->request = r;
    job->ctx = ctx;
    job->parse_rc = -1;
    job->count_rc = -1;
    job->stream = 0;
    job->model_bad = 0;
    job->count.keys = NULL;
    job->count.nkeys = 0;

    /* the parse follows this location's caps, also with dpd_model */

    job->limits.max_depth = (size_t) dlcf->max_json_depth;
    job->limits.max_elements = (size_t) dlcf->max_json_members;

    if (dlcf->models && !ctx->model_done) {
        /* the count's settings: the model's location's, once parsed */
        job->models = dlcf;
        ngx_memzero(&job->cf, sizeof(ngx_http_dpd_count_conf_t));

    } else {
        job->models = NULL;
        ngx_http_dpd_job_conf(job, ctx, dlcf);
    }

    if (inline_job && ctx->body.len <= NGX_HTTP_DPD_TREE_KEPT_BODY) {

        /* one block holds such a tree; the pool is reset once counted */

        if (ngx_http_dpd_tree_kept == NULL) {
            ngx_http_dpd_tree_kept = ngx_http_dpd_tree_keep();
        }

        job->tree = ngx_http_dpd_tree_kept;
        if (job->tree == NULL) {
            return;
        }

        ctx->req.tree_release = ngx_http_dpd_tree_reset;
        ctx->req.tree_data = job->tree;
        ctx->req.tree_alloc = ngx_http_dpd_pool_alloc;

        return;
    }

    /*
     * a value takes at least 2 bytes of the body, a node 64 bytes of the
     * pool: a block holds the tree of a small body whole
     */

    size = ctx->body.len;
    size = (size > NGX_HTTP_DPD_TREE_BLOCK / 32) ? NGX_HTTP_DPD_TREE_BLOCK
                                                 : size * 32;
    size = ngx_align(size, ngx_pagesize);

    /* the cycle's log: the pool may be freed in a thread, where the
     * request's log handler must not run */

    job->tree = ngx_create_pool(size, ngx_cycle->log);
    if (job->tree == NULL) {
        return;
    }

    ctx->req.tree_release = ngx_http_dpd_tree_release;
    ctx->req.tree_data = job->tree;
    ctx->req.tree_alloc = ngx_http_dpd_pool_alloc;
}


/* the count's settings from a location's (any thread: reads only) */

static void
ngx_http_dpd_job_conf(ngx_http_dpd_job_t *job, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_loc_conf_t *dlcf)
{
    ngx_http_dpd_count_conf_t  *cf;

    cf = &job->cf;

    cf->tok = dlcf->tokenizer->tok;
    cf->tmpl = (dpd_chat_template_t) dlcf->chat_template;
    if (cf->tmpl == DPD_CHAT_AUTO) {
        cf->tmpl = dlcf->tokenizer->tmpl;
    }

    cf->chat = (ctx->kind == NGX_HTTP_DPD_KIND_CHAT);
    cf->bound = (dlcf->count == NGX_HTTP_DPD_COUNT_BOUND);
    cf->threshold = (long) dlcf->threshold;
    cf->max_prompt_ids = (size_t) dlcf->max_prompt_ids;
    cf->max_messages = (size_t) dlcf->max_messages;
    cf->bound_other = dlcf->tokenizer->bound_other;
    cf->bound_prefix = dlcf->tokenizer->bound_prefix;
    cf->bound_specials = dlcf->tokenizer->bound_specials;

    /* dpd_prefix_cache: every request's exact ids make its keys (the
     * byte bound cannot: a short prompt is routed by its cache too) */

    cf->prefix_block = 0;

    if (dlcf->prefix.mode != NGX_HTTP_DPD_PREFIX_OFF) {
        cf->prefix_block = dlcf->prefix.block;
        cf->bound = 0;
    }
}


/*
 * The parse and the count: nginx-free but for the job's own pools, so
 * that a thread may run it (ngx_http_dpd_job_thread()); the event loop
 * does not touch ctx->req while it runs.
 */

static void
ngx_http_dpd_job_run(ngx_http_dpd_job_t *job)
{
    const cJSON         *stream;
    ngx_http_dpd_ctx_t  *ctx;

    ctx = job->ctx;

    ngx_http_dpd_tree_pool = job->tree;

    job->parse_rc = ngx_http_dpd_proto_parse_request(&ctx->req,
                                              (const char *) ctx->body.data,
                                              ctx->body.len, &job->limits);

    if (job->parse_rc == 0 && job->models) {
        ngx_http_dpd_job_model(job);
    }

    if (job->parse_rc == 0 && job->model_bad == 0) {
        stream = ngx_http_dpd_json_get(ctx->req.json, "stream");
        job->stream = ngx_http_dpd_json_is(stream, cJSON_True) ? 1 : 0;

        job->count_rc = ngx_http_dpd_count(ctx->req.json, &job->cf,
                                           &job->count);
    }

    ngx_http_dpd_tree_pool = NULL;

    /* from here on the index is enough: the tree is not kept for the
     * life of a (possibly long) stream */

    ngx_http_dpd_proto_drop_tree(&ctx->req);
}


/* dpd_model: the entry for this request, whose location counts it */

static void
ngx_http_dpd_job_model(ngx_http_dpd_job_t *job)
{
    size_t                 len;
    const char            *name;
    ngx_http_dpd_ctx_t    *ctx;
    ngx_http_dpd_model_t  *m;

    ctx = job->ctx;

    m = ngx_http_dpd_model_pick(job->models, ctx->req.json, &name, &len,
                                &job->model_bad);

    if (name) {
        /* for $dpd_model and the 404's message; logs take a cut one */
        len = ngx_min(len, NGX_HTTP_DPD_MODEL_LEN);
        ngx_memcpy(ctx->model_buf, name, len);
        ctx->model_name.data = ctx->model_buf;
        ctx->model_name.len = len;
    }

    if (m == NULL) {
        return;
    }

    ctx->model = m;
    ngx_http_dpd_job_conf(job, ctx, m->target);
}


/* what the job found, in the event loop: logs, metrics, the answer */

static ngx_int_t
ngx_http_dpd_job_finish(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_job_t *job)
{
    if (job->count.keys) {
        /*
         * dpd_prefix_cache: the keys into the request's pool, aligned
         * (ngx_pnalloc is not: a misaligned uint64_t load is undefined,
         * a trap on strict-alignment machines, an abort under UBSan)
         */

        if (job->count_rc == 0 && job->count.bad == 0) {
            ctx->prefix_keys = ngx_palloc(r->pool,
                                    job->count.nkeys * sizeof(uint64_t));

            if (ctx->prefix_keys) {
                ngx_memcpy(ctx->prefix_keys, job->count.keys,
                           job->count.nkeys * sizeof(uint64_t));
                ctx->prefix_nkeys = job->count.nkeys;
            }
        }

        free(job->count.keys);
        job->count.keys = NULL;
    }

    if (job->parse_rc < 0) {
        return NGX_ERROR;
    }

    if (job->parse_rc > 0) {
        return ngx_http_dpd_reject(r, ctx,
                                   ngx_http_dpd_bad_reason(ctx->req.bad),
                                   ctx->req.why);
    }

    if (job->model_bad) {
        return ngx_http_dpd_model_reject(r, ctx, job->model_bad);
    }

    /* transfer metadata is the gateway's business, never the client's */

    if (ctx->req.kv_params) {
        ctx->kv_stripped = 1;
        ngx_http_dpd_metrics_inc(r, NGX_HTTP_DPD_M_KV_STRIPPED);

        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "dpd: client \"kv_transfer_params\" removed (%uz)",
                      ctx->req.kv_params);
    }

    ctx->stream = job->stream;

    if (job->count_rc != 0) {
        return NGX_ERROR;
    }

    if (job->count.bad) {
        return ngx_http_dpd_reject(r, ctx,
                                   ngx_http_dpd_bad_reason(job->count.bad),
                                   job->count.why);
    }

    if (job->count.note[0]) {
        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "dpd: request \"%V\": %V", &ctx->request_id,
                      ngx_http_dpd_log_cstr(r->pool, job->count.note));
    }

    ctx->prompt_tokens = job->count.tokens;
    ctx->prompt_bound = job->count.bound;
    ctx->count_skipped = job->count.skipped;
    ctx->estimated = job->count.estimated;

    return NGX_OK;
}


#if (NGX_THREADS)

/*
 * dpd_count_thread_pool: the parse and count of a big body in a thread of
 * the pool, the event loop serving other requests meanwhile (aio threads'
 * pattern, ngx_http_upstream_thread_handler()).  r->main->blocked keeps
 * the request, its pool and its connection alive until the completion
 * handler has run, even when the client goes (test_reading sees it: the
 * request is terminated, and finalized once the job is back).  The job,
 * the task, the index and the tree belong to the job's pools, which the
 * request pool's cleanup frees; the thread touches nothing else but the
 * body's bytes (r->pool or request buffer memory, live as long as r) and
 * the shared tokenizer (read-only).
 *
 * NGX_AGAIN: posted; NGX_DECLINED: the queue is full, count inline;
 * NGX_ERROR.
 */

static ngx_int_t
ngx_http_dpd_job_post(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_main_conf_t *dmcf, ngx_http_dpd_loc_conf_t *dlcf)
{
    ngx_pool_t          *pool;
    ngx_thread_task_t   *task;
    ngx_pool_cleanup_t  *cln;
    ngx_http_dpd_job_t  *job;

    cln = ngx_pool_cleanup_add(r->pool, 0);
    if (cln == NULL) {
        return NGX_ERROR;
    }

    pool = ngx_create_pool(NGX_DEFAULT_POOL_SIZE, ngx_cycle->log);
    if (pool == NULL) {
        return NGX_ERROR;
    }

    cln->handler = ngx_http_dpd_job_pool_cleanup;
    cln->data = pool;

    task = ngx_thread_task_alloc(pool, sizeof(ngx_http_dpd_job_t));
    if (task == NULL) {
        return NGX_ERROR;
    }

    job = task->ctx;

    ngx_http_dpd_job_init(job, r, ctx, dmcf, dlcf, 0);

    if (job->tree == NULL) {
        return NGX_ERROR;
    }

    /* the index and the bodies built from it: the job's pool */

    ctx->req.alloc = ngx_http_dpd_pool_alloc;
    ctx->req.alloc_data = pool;

    task->handler = ngx_http_dpd_job_thread;
    task->event.data = job;
    task->event.handler = ngx_http_dpd_job_done;

    if (ngx_thread_task_post(dlcf->count_pool, task) != NGX_OK) {
        /* counted in place, with a tree pool of its own */
        ngx_http_dpd_proto_drop_tree(&ctx->req);
        return NGX_DECLINED;
    }

    ngx_log_debug1(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "dpd count: %uz bytes to the thread pool",
                   ctx->body.len);

    ctx->count_job = job;
    ctx->state = NGX_HTTP_DPD_STATE_COUNTING;

    r->main->blocked++;

    /* a client that goes is seen now, not after the count */
    r->read_event_handler = ngx_http_test_reading;

    return NGX_AGAIN;
}


static void
ngx_http_dpd_job_thread(void *data, ngx_log_t *log)
{
    ngx_http_dpd_job_t  *job = data;

    ngx_http_dpd_job_run(job);
}


static void
ngx_http_dpd_job_done(ngx_event_t *ev)
{
    ngx_connection_t    *c;
    ngx_http_request_t  *r;
    ngx_http_dpd_job_t  *job;
    ngx_http_dpd_ctx_t  *ctx;

    job = ev->data;
    r = job->request;
    ctx = job->ctx;
    c = r->connection;

    ngx_http_set_log_request(c->log, r);

    ngx_log_debug2(NGX_LOG_DEBUG_HTTP, c->log, 0,
                   "dpd count: thread done, parse %d, count %d",
                   job->parse_rc, job->count_rc);

    r->main->blocked--;

    ctx->count_job = NULL;

    if (c->error) {
        /*
         * the client went (the request was terminated while blocked): its
         * write handler now finalizes it
         */
        ctx->state = NGX_HTTP_DPD_STATE_DONE;
        free(job->count.keys);
        job->count.keys = NULL;
        r->write_event_handler(r);
        ngx_http_run_posted_requests(c);
        return;
    }

    r->read_event_handler = ngx_http_block_reading;

    ctx->count_rc = ngx_http_dpd_job_finish(r, ctx, job);
    ctx->state = NGX_HTTP_DPD_STATE_COUNTED;

#if defined(__GLIBC__)
    if (ctx->body.len >= NGX_HTTP_DPD_TRIM_BODY) {
        malloc_trim(0);
    }
#endif

    r->write_event_handler(r);
    ngx_http_run_posted_requests(c);
}


static void
ngx_http_dpd_job_pool_cleanup(void *data)
{
    ngx_destroy_pool(data);
}

#endif /* NGX_THREADS */


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


/* as vLLM answers a model it does not serve (serving_engine.py,
 * _check_model): 404 "The model `X` does not exist." */

static ngx_int_t
ngx_http_dpd_model_reject(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    int bad)
{
    u_char  msg[NGX_HTTP_DPD_MODEL_LEN + 64], *p;

    if (bad == 2) {
        return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_INVALID_FIELD,
                                   "field \"model\" must be a string");
    }

    if (ctx->model_name.len) {
        p = ngx_snprintf(msg, sizeof(msg) - 1,
                         "The model `%V` does not exist.", &ctx->model_name);
    } else {
        p = ngx_snprintf(msg, sizeof(msg) - 1,
                         "the request names no model, and no \"dpd_model *\" "
                         "takes such requests");
    }

    *p = '\0';

    if (ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_UNKNOWN_MODEL,
                            (const char *) msg)
        != NGX_OK)
    {
        return NGX_ERROR;
    }

    ctx->err_status = NGX_HTTP_NOT_FOUND;
    ctx->err_type = "not_found_error";

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
    if (ngx_http_dpd_tree_pool) {
        return ngx_palloc(ngx_http_dpd_tree_pool, size);
    }

    return malloc(size);
}


static void
ngx_http_dpd_tree_free(void *p)
{
    if (ngx_http_dpd_tree_pool == NULL) {
        free(p);
    }

    /* else the memory goes back with the pool: ngx_http_dpd_tree_release() */
}


/*
 * cJSON's allocator for the calling thread until the next call: trees
 * made meanwhile come from pool (a prefill's request and reply are a few
 * dozen nodes: malloc() and free() for each cost more than the rest of
 * their handling), and cJSON_Delete() leaves them to it.  So every tree
 * made in a scope must be dropped or pool-owned before the scope ends.
 * Returns the allocator's pool before the call (NULL: malloc()).
 */

ngx_pool_t *
ngx_http_dpd_tree_scope(ngx_pool_t *pool)
{
    ngx_pool_t  *prev;

    prev = ngx_http_dpd_tree_pool;
    ngx_http_dpd_tree_pool = pool;

    return prev;
}


static void
ngx_http_dpd_tree_release(void *data)
{
    ngx_destroy_pool(data);
}


/*
 * The kept pool, made on first use and destroyed with the cycle that was
 * current then (a reload in single-process mode, the worker's exit): the
 * module that holds the pointer is unloaded with that cycle.
 */

static ngx_pool_t *
ngx_http_dpd_tree_keep(void)
{
    ngx_pool_t          *pool;
    ngx_pool_cleanup_t  *cln;

    pool = ngx_create_pool(NGX_HTTP_DPD_TREE_KEPT_BODY * 32, ngx_cycle->log);
    if (pool == NULL) {
        return NULL;
    }

    cln = ngx_pool_cleanup_add(ngx_cycle->pool, 0);
    if (cln == NULL) {
        ngx_destroy_pool(pool);
        return NULL;
    }

    cln->handler = ngx_http_dpd_tree_unkeep;
    cln->data = pool;

    return pool;
}


static void
ngx_http_dpd_tree_unkeep(void *data)
{
    if (ngx_http_dpd_tree_kept == data) {
        ngx_http_dpd_tree_kept = NULL;
    }

    ngx_destroy_pool(data);
}


/* the kept pool: its 64 KB block stays (a tree of 2 KB of body fills at
 * most one, and the few bytes of a second), large parts go */

static void
ngx_http_dpd_tree_reset(void *data)
{
    ngx_reset_pool(data);
}


#if defined(__GLIBC__)

static void
ngx_http_dpd_trim_handler(ngx_event_t *ev)
{
    malloc_trim(0);
}

#endif
