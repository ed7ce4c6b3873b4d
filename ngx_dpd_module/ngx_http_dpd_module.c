/*
 * ngx_http_dpd_module: directives, configuration, the request phase
 * handler and the $dpd_* variables.
 *
 * Flow of an inference request in a "dpd on" location (PRECONTENT phase,
 * i.e. after rewrite, limit_req and access checks, before proxy_pass):
 *   1. read the whole body (mirror pattern: NGX_DONE, resume in the body
 *      handler through ngx_http_core_run_phases);
 *   2. parse, validate, count, decide (ngx_http_dpd_openai.c);
 *   3. disaggregated with a prefill pool: run the prefill hook until it
 *      declines (auth_request pattern: NGX_AGAIN while waiting; the
 *      post-subrequest handler and the module's timers only record what
 *      happened and resume the phases, the phase handler acts on it);
 *   4. decline, so that the location's proxy_pass sends the (possibly
 *      replaced) body to the decode pool.
 *
 * Nothing here sends a response or finalizes the request from the phase
 * handler (the one exception is the mirror pattern's NGX_DONE while the
 * body is read): a rejected request, a relayed prefill 4xx and the
 * dpd_fallback error answer are recorded in ctx->answer and sent by a
 * content handler, errors are returned as a status; the phase engine
 * finalizes, and nothing touches the request after that.
 */


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include <time.h>

#if (NGX_OPENSSL)
#include <openssl/rand.h>
#endif

#include "ngx_http_dpd_module.h"


/*
 * Random bytes for generated request ids, drawn from a CSPRNG (OpenSSL's
 * RAND_bytes(), else /dev/urandom) in batches: one call per 256 ids
 * instead of one per request (it costs about as much as the rest of the
 * direct path).  Per process: refilled when the pid changes, so forked
 * workers never share bytes; each id's bytes are wiped once used.
 */
#define NGX_HTTP_DPD_RAND_BATCH  4096
#define NGX_HTTP_DPD_ID_BYTES    16

static u_char     ngx_http_dpd_rand[NGX_HTTP_DPD_RAND_BATCH];
static size_t     ngx_http_dpd_rand_left;
static ngx_pid_t  ngx_http_dpd_rand_pid;


static ngx_int_t ngx_http_dpd_handler(ngx_http_request_t *r);
static void ngx_http_dpd_body_handler(ngx_http_request_t *r);
static void ngx_http_dpd_decide(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_loc_conf_t *dlcf);
static ngx_int_t ngx_http_dpd_strip_body(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx);
static ngx_int_t ngx_http_dpd_decided(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_loc_conf_t *dlcf);
static ngx_int_t ngx_http_dpd_answer_handler(ngx_http_request_t *r);
static ngx_int_t ngx_http_dpd_send_body(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx);
static ngx_int_t ngx_http_dpd_header_filter(ngx_http_request_t *r);
static void ngx_http_dpd_cleanup(void *data);
static ngx_uint_t ngx_http_dpd_classify(ngx_http_request_t *r);
static ngx_table_elt_t *ngx_http_dpd_find_request_id(ngx_http_request_t *r);
static ngx_int_t ngx_http_dpd_random_fill(ngx_log_t *log);
static ngx_int_t ngx_http_dpd_random_id(ngx_http_request_t *r,
    ngx_str_t *id);
static ngx_int_t ngx_http_dpd_set_request_id(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx);
static ngx_int_t ngx_http_dpd_log_handler(ngx_http_request_t *r);

static ngx_int_t ngx_http_dpd_variable(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, uintptr_t data);

static ngx_int_t ngx_http_dpd_preconfiguration(ngx_conf_t *cf);
static ngx_int_t ngx_http_dpd_postconfiguration(ngx_conf_t *cf);
static void *ngx_http_dpd_create_main_conf(ngx_conf_t *cf);
static void *ngx_http_dpd_create_loc_conf(ngx_conf_t *cf);
static char *ngx_http_dpd_merge_loc_conf(ngx_conf_t *cf, void *parent,
    void *child);

static char *ngx_http_dpd_tokenizer(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
static void ngx_http_dpd_tokenizer_cleanup(void *data);
static char *ngx_http_dpd_chat_template(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
static char *ngx_http_dpd_merge_chat_template(ngx_conf_t *cf,
    ngx_http_dpd_loc_conf_t *prev, ngx_http_dpd_loc_conf_t *conf);
static char *ngx_http_dpd_metrics(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
static char *ngx_http_dpd_count_thread_pool(ngx_conf_t *cf,
    ngx_command_t *cmd, void *conf);
static ngx_int_t ngx_http_dpd_init_process(ngx_cycle_t *cycle);


static ngx_conf_num_bounds_t  ngx_http_dpd_json_depth_bounds = {
    ngx_conf_check_num_bounds, 1, NGX_HTTP_DPD_MAX_JSON_DEPTH
};


static ngx_conf_num_bounds_t  ngx_http_dpd_cap_bounds = {
    ngx_conf_check_num_bounds, 1, NGX_MAX_INT32_VALUE
};


static ngx_conf_enum_t  ngx_http_dpd_count_modes[] = {
    { ngx_string("exact"), NGX_HTTP_DPD_COUNT_EXACT },
    { ngx_string("bound"), NGX_HTTP_DPD_COUNT_BOUND },
    { ngx_null_string, 0 }
};


static ngx_command_t  ngx_http_dpd_commands[] = {

    { ngx_string("dpd"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_FLAG,
      ngx_conf_set_flag_slot,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_dpd_loc_conf_t, enable),
      NULL },

    { ngx_string("dpd_tokenizer"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE12,
      ngx_http_dpd_tokenizer,
      NGX_HTTP_LOC_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("dpd_model"),
      NGX_HTTP_LOC_CONF|NGX_CONF_TAKE2,
      ngx_http_dpd_model,
      NGX_HTTP_LOC_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("dpd_models"),
      NGX_HTTP_LOC_CONF|NGX_CONF_ANY,
      ngx_http_dpd_models,
      NGX_HTTP_LOC_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("dpd_chat_template"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,
      ngx_http_dpd_chat_template,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_dpd_loc_conf_t, chat_template),
      NULL },

    { ngx_string("dpd_prefix_cache"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_1MORE,
      ngx_http_dpd_prefix_cache,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_dpd_loc_conf_t, prefix),
      NULL },

    { ngx_string("dpd_threshold"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_num_slot,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_dpd_loc_conf_t, threshold),
      NULL },

    { ngx_string("dpd_count"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_enum_slot,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_dpd_loc_conf_t, count),
      &ngx_http_dpd_count_modes },

    { ngx_string("dpd_count_thread_pool"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE12,
      ngx_http_dpd_count_thread_pool,
      NGX_HTTP_LOC_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("dpd_max_json_depth"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_num_slot,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_dpd_loc_conf_t, max_json_depth),
      &ngx_http_dpd_json_depth_bounds },

    { ngx_string("dpd_max_json_members"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_num_slot,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_dpd_loc_conf_t, max_json_members),
      &ngx_http_dpd_cap_bounds },

    { ngx_string("dpd_max_prompt_ids"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_num_slot,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_dpd_loc_conf_t, max_prompt_ids),
      &ngx_http_dpd_cap_bounds },

    { ngx_string("dpd_max_messages"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_num_slot,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_dpd_loc_conf_t, max_messages),
      &ngx_http_dpd_cap_bounds },

    { ngx_string("dpd_metrics"),
      NGX_HTTP_LOC_CONF|NGX_CONF_NOARGS,
      ngx_http_dpd_metrics,
      NGX_HTTP_LOC_CONF_OFFSET,
      0,
      NULL },

    NGX_HTTP_DPD_PREFILL_COMMANDS

      ngx_null_command
};


static ngx_http_module_t  ngx_http_dpd_module_ctx = {
    ngx_http_dpd_preconfiguration,         /* preconfiguration */
    ngx_http_dpd_postconfiguration,        /* postconfiguration */

    ngx_http_dpd_create_main_conf,         /* create main configuration */
    NULL,                                  /* init main configuration */

    NULL,                                  /* create server configuration */
    NULL,                                  /* merge server configuration */

    ngx_http_dpd_create_loc_conf,          /* create location configuration */
    ngx_http_dpd_merge_loc_conf            /* merge location configuration */
};


ngx_module_t  ngx_http_dpd_module = {
    NGX_MODULE_V1,
    &ngx_http_dpd_module_ctx,              /* module context */
    ngx_http_dpd_commands,                 /* module directives */
    NGX_HTTP_MODULE,                       /* module type */
    NULL,                                  /* init master */
    NULL,                                  /* init module */
    ngx_http_dpd_init_process,             /* init process */
    NULL,                                  /* init thread */
    NULL,                                  /* exit thread */
    NULL,                                  /* exit process */
    NULL,                                  /* exit master */
    NGX_MODULE_V1_PADDING
};


#define NGX_HTTP_DPD_VAR_PROMPT_TOKENS   0
#define NGX_HTTP_DPD_VAR_ROUTE           1
#define NGX_HTTP_DPD_VAR_REQUEST_ID      2
#define NGX_HTTP_DPD_VAR_DECISION_TIME   3
#define NGX_HTTP_DPD_VAR_TOKENS_BOUND    4
#define NGX_HTTP_DPD_VAR_KV_REQUEST_ID   5
#define NGX_HTTP_DPD_VAR_MODEL           6
#define NGX_HTTP_DPD_VAR_CACHED_TOKENS   7
#define NGX_HTTP_DPD_VAR_UNCACHED_TOKENS 8
#define NGX_HTTP_DPD_VAR_PREFIX_TIME     9


static ngx_http_variable_t  ngx_http_dpd_vars[] = {

    { ngx_string("dpd_prompt_tokens"), NULL, ngx_http_dpd_variable,
      NGX_HTTP_DPD_VAR_PROMPT_TOKENS, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("dpd_route"), NULL, ngx_http_dpd_variable,
      NGX_HTTP_DPD_VAR_ROUTE, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("dpd_request_id"), NULL, ngx_http_dpd_variable,
      NGX_HTTP_DPD_VAR_REQUEST_ID, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("dpd_decision_time"), NULL, ngx_http_dpd_variable,
      NGX_HTTP_DPD_VAR_DECISION_TIME, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("dpd_prompt_tokens_bound"), NULL, ngx_http_dpd_variable,
      NGX_HTTP_DPD_VAR_TOKENS_BOUND, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("dpd_kv_request_id"), NULL, ngx_http_dpd_variable,
      NGX_HTTP_DPD_VAR_KV_REQUEST_ID, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("dpd_model"), NULL, ngx_http_dpd_variable,
      NGX_HTTP_DPD_VAR_MODEL, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("dpd_cached_tokens"), NULL, ngx_http_dpd_variable,
      NGX_HTTP_DPD_VAR_CACHED_TOKENS, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("dpd_uncached_tokens"), NULL, ngx_http_dpd_variable,
      NGX_HTTP_DPD_VAR_UNCACHED_TOKENS, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("dpd_prefix_time"), NULL, ngx_http_dpd_variable,
      NGX_HTTP_DPD_VAR_PREFIX_TIME, NGX_HTTP_VAR_NOCACHEABLE, 0 },

      ngx_http_null_variable
};


static ngx_str_t  ngx_http_dpd_request_id_header = ngx_string("X-Request-Id");
static ngx_str_t  ngx_http_dpd_client_id_header =
    ngx_string("X-Client-Request-Id");


static ngx_http_output_header_filter_pt  ngx_http_next_header_filter;


static ngx_int_t
ngx_http_dpd_handler(ngx_http_request_t *r)
{
    ngx_int_t                 rc;
    ngx_http_dpd_ctx_t       *ctx;
    ngx_http_dpd_loc_conf_t  *dlcf;
    ngx_http_dpd_main_conf_t *dmcf;

    if (r != r->main) {
        return NGX_DECLINED;
    }

    dlcf = ngx_http_get_module_loc_conf(r, ngx_http_dpd_module);

    ctx = ngx_http_dpd_get_ctx(r);

    if (ctx == NULL) {

        if (!dlcf->enable) {
            return NGX_DECLINED;
        }

        ctx = ngx_http_dpd_create_ctx(r);
        if (ctx == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        ctx->kind = ngx_http_dpd_classify(r);

        if (ctx->kind == NGX_HTTP_DPD_KIND_NONE) {
            /* other methods and paths pass untouched */
            ctx->route = NGX_HTTP_DPD_ROUTE_BYPASS;
            ctx->state = NGX_HTTP_DPD_STATE_DONE;
            return NGX_DECLINED;
        }

        ngx_log_debug1(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                       "dpd handler: reading %s request body",
                       ctx->kind == NGX_HTTP_DPD_KIND_CHAT
                       ? "chat" : "completions");

        ctx->state = NGX_HTTP_DPD_STATE_READING;

        rc = ngx_http_dpd_read_body(r, ngx_http_dpd_body_handler);

        if (rc >= NGX_HTTP_SPECIAL_RESPONSE || rc == NGX_ERROR) {
            /* the body handler did not run: r is ours to return rc for */
            ctx->state = NGX_HTTP_DPD_STATE_DONE;
            ctx->err_status = (rc == NGX_ERROR)
                              ? NGX_HTTP_INTERNAL_SERVER_ERROR : rc;
            ctx->err_reason = (rc == NGX_HTTP_REQUEST_ENTITY_TOO_LARGE)
                              ? NGX_HTTP_DPD_E_BODY_TOO_LARGE
                              : NGX_HTTP_DPD_E_BODY_READ;
            return rc;
        }

        /*
         * mirror pattern: drop the reference the body read took.  The
         * body handler may have run already and the request been answered
         * through the phases it resumed: this is the last touch of r.
         */

        ngx_http_finalize_request(r, NGX_DONE);
        return NGX_DONE;
    }

    switch (ctx->state) {

    case NGX_HTTP_DPD_STATE_READING:
    case NGX_HTTP_DPD_STATE_COUNTING:
        /* not resumed before the body handler (the thread's completion)
         * runs; wait */
        return NGX_AGAIN;

    case NGX_HTTP_DPD_STATE_BODY:

        /* first, so that even a rejected request is logged with its id */

        if (ngx_http_dpd_set_request_id(r, ctx) != NGX_OK) {
            ctx->state = NGX_HTTP_DPD_STATE_DONE;
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        /* fall through */

    case NGX_HTTP_DPD_STATE_COUNTED:

        dmcf = ngx_http_get_module_main_conf(r, ngx_http_dpd_module);

        rc = ngx_http_dpd_openai_process(r, ctx, dmcf, dlcf);

        if (rc == NGX_AGAIN) {
            /* counted in a thread: ngx_http_dpd_job_done() resumes */
            return NGX_AGAIN;
        }

        if (rc == NGX_OK && ctx->err_status == 0 && ctx->model
            && !ctx->model_done)
        {
            /* dpd_model: decided and answered in the model's location */
            return ngx_http_dpd_model_pass(r, ctx);
        }

        ctx->decision_usec = ngx_http_dpd_now_usec() - ctx->start_usec;
        ctx->timed = 1;
        ctx->state = NGX_HTTP_DPD_STATE_DECIDED;

        if (rc == NGX_ERROR) {
            ctx->state = NGX_HTTP_DPD_STATE_DONE;
            ctx->err_status = NGX_HTTP_INTERNAL_SERVER_ERROR;
            ctx->err_reason = NGX_HTTP_DPD_E_INTERNAL;
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        if (ctx->err_status) {
            /* bad input: the client gets the OpenAI-shaped error */

            ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                          "dpd: rejected request %V: %V",
                          &ctx->request_id,
                          ngx_http_dpd_log_text(r->pool, ctx->err_message,
                                       ngx_strlen(ctx->err_message)));

            ctx->answer = NGX_HTTP_DPD_ANSWER_ERROR;
            ctx->answer_status = ctx->err_status;
            ctx->answer_type = ctx->err_type;
            ctx->answer_message = (char *) ctx->err_message;

            return ngx_http_dpd_answer(r, ctx);
        }

        ngx_http_dpd_decide(r, ctx, dlcf);

        if (dlcf->prefix.mode != NGX_HTTP_DPD_PREFIX_OFF) {
            /* $dpd_decision_time includes the cache's lookup and pin */
            ctx->decision_usec = ngx_http_dpd_now_usec() - ctx->start_usec;
        }

        if (ctx->kv_stripped
            && (ctx->route != NGX_HTTP_DPD_ROUTE_DISAGGREGATED
                || ctx->observe))
        {
            /* the direct path sends the client's bytes: without them */
            if (ngx_http_dpd_strip_body(r, ctx) != NGX_OK) {
                ctx->state = NGX_HTTP_DPD_STATE_DONE;
                return NGX_HTTP_INTERNAL_SERVER_ERROR;
            }
        }

        return ngx_http_dpd_decided(r, ctx, dlcf);

    case NGX_HTTP_DPD_STATE_DECIDED:
        /* resumed by the prefill subrequest */
        return ngx_http_dpd_decided(r, ctx, dlcf);

    default: /* NGX_HTTP_DPD_STATE_DONE */
        return NGX_DECLINED;
    }
}


static void
ngx_http_dpd_decide(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_loc_conf_t *dlcf)
{
    uint64_t   start;
    ngx_int_t  rc;

    /*
     * dpd_prefix_cache: the decoder first (cost of its uncached blocks
     * and its load), then the threshold on what it must compute; a
     * lookup that cannot run routes as without the cache
     */

    rc = NGX_DECLINED;

    if (dlcf->prefix.mode != NGX_HTTP_DPD_PREFIX_OFF
        && !ctx->count_skipped && ctx->prompt_tokens >= 0)
    {
        start = ngx_http_dpd_now_usec();

        rc = ngx_http_dpd_prefix_route(r, ctx, &dlcf->prefix,
                                       dlcf->threshold);

        /* $dpd_prefix_time: the cache's own share of the decision */
        ctx->prefix_usec = ngx_http_dpd_now_usec() - start;
        ctx->prefix_timed = 1;

        if (rc == NGX_ERROR) {
            ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                          "dpd: prefix cache decision failed, routing by "
                          "the prompt alone");
        }
    }

    if (rc == NGX_OK) {
        /* decided */

    /* >= threshold: disaggregate (HyperPod's routingThreshold rule) */

    /* count_skipped: the upper bound is already below the threshold */

    } else if (!ctx->count_skipped
               && (dlcf->threshold == 0
                   || ctx->prompt_tokens >= dlcf->threshold))
    {
        ctx->route = NGX_HTTP_DPD_ROUTE_DISAGGREGATED;

    } else {
        ctx->route = NGX_HTTP_DPD_ROUTE_DIRECT;
    }

    ctx->observe = (dlcf->prefill.prefill_pass.len == 0);

    if (ctx->count_skipped) {
        ngx_log_debug3(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                       "dpd: request \"%V\": at most %i prompt tokens "
                       "(dpd_count bound), threshold %i: direct",
                       &ctx->request_id, ctx->prompt_bound, dlcf->threshold);

    } else if (ctx->observe) {
        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "dpd observe: request \"%V\": %i prompt tokens%s, "
                      "threshold %i: %s (sent direct: no dpd_prefill_pass)",
                      &ctx->request_id, ctx->prompt_tokens,
                      ctx->estimated ? " (estimated)" : "",
                      dlcf->threshold, ngx_http_dpd_route_name(ctx->route));

    } else {
        ngx_log_debug4(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                       "dpd: request \"%V\": %i prompt tokens, "
                       "threshold %i: %s",
                       &ctx->request_id, ctx->prompt_tokens,
                       dlcf->threshold, ngx_http_dpd_route_name(ctx->route));
    }
}


/*
 * The direct path forwards the client's bytes untouched, unless they hold
 * kv_transfer_params: then the same bytes without those members.
 */

static ngx_int_t
ngx_http_dpd_strip_body(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx)
{
    char    *text;
    size_t   len;

    text = ngx_http_dpd_proto_decode_body(&ctx->req, NULL, NULL, &len);
    if (text == NULL) {
        return NGX_ERROR;
    }

    return ngx_http_dpd_replace_body(r, (u_char *) text, len);
}


static ngx_int_t
ngx_http_dpd_decided(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_loc_conf_t *dlcf)
{
    ngx_int_t  rc;

    if (ctx->route != NGX_HTTP_DPD_ROUTE_DISAGGREGATED
        || dlcf->prefill.prefill_pass.len == 0)
    {
        ctx->state = NGX_HTTP_DPD_STATE_DONE;
        return NGX_DECLINED;
    }

    rc = ngx_http_dpd_prefill_handler(r, ctx);

    ngx_log_debug1(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "dpd prefill handler: %i", rc);

    switch (rc) {

    case NGX_AGAIN:
        /* waiting for the prefill or the KV; it resumes the phases */
        return NGX_AGAIN;

    case NGX_DONE:
        /* the prefill code set ctx->answer (a 4xx relay, dpd_fallback
         * error): the content phase sends it */
        return ngx_http_dpd_answer(r, ctx);

    case NGX_OK:
    case NGX_DECLINED:
        /* decode body in place: on to proxy_pass */
        ctx->state = NGX_HTTP_DPD_STATE_DONE;
        return NGX_DECLINED;

    default:
        /* NGX_ERROR or an HTTP status: the phase engine finalizes, the
         * error filter gives the body its OpenAI shape */
        ctx->state = NGX_HTTP_DPD_STATE_DONE;
        return rc;
    }
}


ngx_int_t
ngx_http_dpd_answer(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx)
{
    ctx->state = NGX_HTTP_DPD_STATE_DONE;

    /*
     * NGX_OK skips the rest of the precontent phase (try_files, mirror)
     * and the content phase calls our handler instead of the location's
     * and finalizes the request with what it returns
     */

    r->content_handler = ngx_http_dpd_answer_handler;

    return NGX_OK;
}


static ngx_int_t
ngx_http_dpd_answer_handler(ngx_http_request_t *r)
{
    ngx_http_dpd_ctx_t  *ctx;

    ctx = ngx_http_dpd_get_ctx(r);

    if (ctx == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    switch (ctx->answer) {

    case NGX_HTTP_DPD_ANSWER_ERROR:
        return ngx_http_dpd_send_error(r, ctx->answer_status,
                                       ctx->answer_type, ctx->answer_message);

    case NGX_HTTP_DPD_ANSWER_BODY:
        return ngx_http_dpd_send_body(r, ctx);

    default:
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }
}


/* answer_status with answer_body as it is (the core's error filter leaves
 * it alone) */

static ngx_int_t
ngx_http_dpd_send_body(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx)
{
    ngx_int_t     rc;
    ngx_buf_t    *b;
    ngx_chain_t   out;

    ngx_http_clear_content_length(r);
    ngx_http_clear_accept_ranges(r);

    r->headers_out.status = ctx->answer_status;
    r->headers_out.content_length_n = ctx->answer_body.len;

    if (ctx->answer_content_type.len) {
        r->headers_out.content_type = ctx->answer_content_type;

    } else {
        ngx_str_set(&r->headers_out.content_type, "application/json");
    }

    r->headers_out.content_type_len = r->headers_out.content_type.len;
    r->headers_out.content_type_lowcase = NULL;

    ctx->own_error = 1;

    if (ctx->answer_body.len == 0) {
        r->header_only = 1;
    }

    rc = ngx_http_send_header(r);

    if (rc == NGX_ERROR || rc > NGX_OK || r->header_only) {
        return rc;
    }

    b = ngx_calloc_buf(r->pool);
    if (b == NULL) {
        return NGX_ERROR;
    }

    b->pos = ctx->answer_body.data;
    b->last = ctx->answer_body.data + ctx->answer_body.len;
    b->memory = 1;
    b->last_buf = 1;
    b->last_in_chain = 1;

    out.buf = b;
    out.next = NULL;

    return ngx_http_output_filter(r, &out);
}


static void
ngx_http_dpd_body_handler(ngx_http_request_t *r)
{
    ngx_http_dpd_ctx_t  *ctx;

    ctx = ngx_http_get_module_ctx(r, ngx_http_dpd_module);

    ngx_log_debug0(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "dpd body handler");

    if (ctx != NULL && ctx->state == NGX_HTTP_DPD_STATE_READING) {
        ctx->state = NGX_HTTP_DPD_STATE_BODY;
    }

    r->write_event_handler = ngx_http_core_run_phases;
    ngx_http_core_run_phases(r);
}


ngx_http_dpd_ctx_t *
ngx_http_dpd_create_ctx(ngx_http_request_t *r)
{
    ngx_pool_cleanup_t  *cln;
    ngx_http_dpd_ctx_t  *ctx;

    ctx = ngx_pcalloc(r->pool, sizeof(ngx_http_dpd_ctx_t));
    if (ctx == NULL) {
        return NULL;
    }

    cln = ngx_pool_cleanup_add(r->pool, 0);
    if (cln == NULL) {
        return NULL;
    }

    cln->handler = ngx_http_dpd_cleanup;
    cln->data = ctx;

    ctx->prompt_tokens = -1;
    ctx->prompt_bound = -1;
    ctx->cached_tokens = -1;
    ctx->uncached_tokens = -1;
    ctx->route = NGX_HTTP_DPD_ROUTE_NONE;
    ctx->start_usec = ngx_http_dpd_now_usec();

    ngx_http_set_ctx(r, ctx, ngx_http_dpd_module);

    return ctx;
}


static void
ngx_http_dpd_cleanup(void *data)
{
    ngx_http_dpd_ctx_t  *ctx = data;

    ngx_http_dpd_openai_cleanup(ctx);
}


ngx_http_dpd_ctx_t *
ngx_http_dpd_get_ctx(ngx_http_request_t *r)
{
    ngx_pool_cleanup_t  *cln;
    ngx_http_dpd_ctx_t  *ctx;

    ctx = ngx_http_get_module_ctx(r, ngx_http_dpd_module);

    if (ctx || !(r->internal || r->filter_finalize)) {
        return ctx;
    }

    /*
     * an internal redirect (error_page, named location) zeroes the module
     * contexts: find ours through the pool cleanup, as realip does
     */

    for (cln = r->pool->cleanup; cln; cln = cln->next) {
        if (cln->handler == ngx_http_dpd_cleanup) {
            ctx = cln->data;
            ngx_http_set_ctx(r, ctx, ngx_http_dpd_module);
            return ctx;
        }
    }

    return NULL;
}


static ngx_uint_t
ngx_http_dpd_classify(ngx_http_request_t *r)
{
    static const u_char  chat[] = "/chat/completions";
    static const u_char  compl[] = "/completions";

    if (r->method != NGX_HTTP_POST) {
        return NGX_HTTP_DPD_KIND_NONE;
    }

    /* match the suffix, so that prefixes and regex locations both work */

    if (r->uri.len >= sizeof(chat) - 1
        && ngx_strncmp(r->uri.data + r->uri.len - (sizeof(chat) - 1),
                       chat, sizeof(chat) - 1) == 0)
    {
        return NGX_HTTP_DPD_KIND_CHAT;
    }

    if (r->uri.len >= sizeof(compl) - 1
        && ngx_strncmp(r->uri.data + r->uri.len - (sizeof(compl) - 1),
                       compl, sizeof(compl) - 1) == 0)
    {
        return NGX_HTTP_DPD_KIND_COMPLETIONS;
    }

    return NGX_HTTP_DPD_KIND_NONE;
}


static ngx_table_elt_t *
ngx_http_dpd_find_request_id(ngx_http_request_t *r)
{
    ngx_uint_t        i;
    ngx_list_part_t  *part;
    ngx_table_elt_t  *h;

    part = &r->headers_in.headers.part;
    h = part->elts;

    for (i = 0; /* void */; i++) {

        if (i >= part->nelts) {
            if (part->next == NULL) {
                return NULL;
            }

            part = part->next;
            h = part->elts;
            i = 0;
        }

        if (h[i].hash != 0
            && h[i].key.len == ngx_http_dpd_request_id_header.len
            && ngx_strncasecmp(h[i].key.data,
                               ngx_http_dpd_request_id_header.data,
                               h[i].key.len) == 0)
        {
            return &h[i];
        }
    }
}


static ngx_uint_t
ngx_http_dpd_request_id_valid(ngx_str_t *id)
{
    u_char  *p, *last;

    /* printable ASCII without quotes or backslashes: the id is echoed in
     * logs and JSON bodies sent to the engines */

    if (id->len == 0 || id->len > NGX_HTTP_DPD_REQUEST_ID_MAX) {
        return 0;
    }

    last = id->data + id->len;

    for (p = id->data; p < last; p++) {
        if (*p <= 0x20 || *p >= 0x7f || *p == '"' || *p == '\\') {
            return 0;
        }
    }

    return 1;
}


/*
 * The batch of random bytes: OpenSSL's CSPRNG where nginx has OpenSSL,
 * else the kernel's (/dev/urandom).  NGX_ERROR when neither gives bytes:
 * the request then fails rather than run with a guessable id.
 */

static ngx_int_t
ngx_http_dpd_random_fill(ngx_log_t *log)
{
#if (NGX_OPENSSL)

    if (RAND_bytes(ngx_http_dpd_rand, NGX_HTTP_DPD_RAND_BATCH) != 1) {
        ngx_log_error(NGX_LOG_ALERT, log, 0, "dpd: RAND_bytes() failed");
        return NGX_ERROR;
    }

#else

    size_t    got;
    ssize_t   n;
    ngx_fd_t  fd;

    fd = ngx_open_file("/dev/urandom", NGX_FILE_RDONLY, NGX_FILE_OPEN, 0);
    if (fd == NGX_INVALID_FILE) {
        ngx_log_error(NGX_LOG_ALERT, log, ngx_errno,
                      ngx_open_file_n " \"/dev/urandom\" failed");
        return NGX_ERROR;
    }

    for (got = 0; got < NGX_HTTP_DPD_RAND_BATCH; got += n) {
        n = read(fd, ngx_http_dpd_rand + got, NGX_HTTP_DPD_RAND_BATCH - got);

        if (n <= 0) {
            if (n == -1 && ngx_errno == NGX_EINTR) {
                n = 0;
                continue;
            }

            ngx_log_error(NGX_LOG_ALERT, log, ngx_errno,
                          "read() from \"/dev/urandom\" failed");
            (void) ngx_close_file(fd);
            return NGX_ERROR;
        }
    }

    (void) ngx_close_file(fd);

#endif

    ngx_http_dpd_rand_pid = ngx_pid;
    ngx_http_dpd_rand_left = NGX_HTTP_DPD_RAND_BATCH;

    return NGX_OK;
}


/* 32 hex digits of 16 fresh random bytes, in the request pool */

static ngx_int_t
ngx_http_dpd_random_id(ngx_http_request_t *r, ngx_str_t *id)
{
    u_char  *bytes;

    if (ngx_http_dpd_rand_pid != ngx_pid
        || ngx_http_dpd_rand_left < NGX_HTTP_DPD_ID_BYTES)
    {
        if (ngx_http_dpd_random_fill(r->connection->log) != NGX_OK) {
            ngx_http_dpd_rand_left = 0;
            return NGX_ERROR;
        }
    }

    id->data = ngx_pnalloc(r->pool, 2 * NGX_HTTP_DPD_ID_BYTES);
    if (id->data == NULL) {
        return NGX_ERROR;
    }

    bytes = ngx_http_dpd_rand + NGX_HTTP_DPD_RAND_BATCH
            - ngx_http_dpd_rand_left;

    id->len = ngx_hex_dump(id->data, bytes, NGX_HTTP_DPD_ID_BYTES)
              - id->data;

    /* used once: do not keep it around */
    ngx_explicit_memzero(bytes, NGX_HTTP_DPD_ID_BYTES);
    ngx_http_dpd_rand_left -= NGX_HTTP_DPD_ID_BYTES;

    return NGX_OK;
}


/*
 * The ids of a request (docs/module.md, X-Request-Id: never key KV by an id the
 * client chose).
 *
 * ctx->kv_id is generated here for every request the module handles:
 * 16 random bytes from the batch above, unguessable and unique.  It is
 * the only X-Request-Id the engines get (vLLM derives its engine request
 * ids, NIXL's remote_request_id among them, from that header, so a client
 * reusing another request's id can collide with it there too), the
 * kv_agent req_id and state table key and lmcache's disagg_spec.req_id;
 * $dpd_kv_request_id, and $request_id unless something read it before.
 *
 * ctx->request_id is the client's X-Request-Id when usable, else kv_id:
 * logs, $dpd_request_id, and the X-Request-Id of the response when an
 * engine echoes it.  Every client X-Request-Id header is forwarded
 * renamed to X-Client-Request-Id (engine logs can still be matched; no
 * engine keys anything by it).
 */

static ngx_int_t
ngx_http_dpd_set_request_id(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx)
{
    ngx_uint_t                  i, n;
    ngx_list_part_t            *part;
    ngx_table_elt_t            *h;
    ngx_http_variable_value_t  *vv;
    ngx_http_dpd_main_conf_t   *dmcf;

    if (ngx_http_dpd_random_id(r, &ctx->kv_id) != NGX_OK) {
        return NGX_ERROR;
    }

    n = 0;
    part = &r->headers_in.headers.part;
    h = part->elts;

    for (i = 0; /* void */; i++) {

        if (i >= part->nelts) {
            if (part->next == NULL) {
                break;
            }

            part = part->next;
            h = part->elts;
            i = 0;
        }

        if (h[i].hash == 0
            || h[i].key.len != ngx_http_dpd_request_id_header.len
            || ngx_strncasecmp(h[i].key.data,
                               ngx_http_dpd_request_id_header.data,
                               h[i].key.len) != 0)
        {
            continue;
        }

        if (n++ == 0) {
            if (ngx_http_dpd_request_id_valid(&h[i].value)) {
                ctx->request_id = h[i].value;

            } else {
                ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                              "dpd: unusable client X-Request-Id, "
                              "request id \"%V\"", &ctx->kv_id);
            }
        }

        h[i].key = ngx_http_dpd_client_id_header;
        h[i].lowcase_key = (u_char *) "x-client-request-id";
        h[i].hash = ngx_hash_key(h[i].lowcase_key, h[i].key.len);
    }

    if (ctx->request_id.len == 0) {
        ctx->request_id = ctx->kv_id;
    }

    /* $request_id (unless read before) and X-Request-Id stay equal */

    dmcf = ngx_http_get_module_main_conf(r, ngx_http_dpd_module);
    vv = &r->variables[dmcf->request_id_index];

    if (!vv->valid && !vv->not_found) {
        vv->data = ctx->kv_id.data;
        vv->len = ctx->kv_id.len;
        vv->valid = 1;
        vv->no_cacheable = 0;
        vv->not_found = 0;
    }

    h = ngx_list_push(&r->headers_in.headers);
    if (h == NULL) {
        return NGX_ERROR;
    }

    h->key = ngx_http_dpd_request_id_header;
    h->value = ctx->kv_id;
    h->lowcase_key = (u_char *) "x-request-id";
    h->hash = ngx_hash_key(h->lowcase_key, h->key.len);
#if (nginx_version >= 1023000)
    h->next = NULL;
#endif

    return NGX_OK;
}


/*
 * An engine that echoes X-Request-Id (vLLM's --enable-request-id-headers)
 * echoes the generated id: the client gets its own back.
 */

static ngx_int_t
ngx_http_dpd_header_filter(ngx_http_request_t *r)
{
    ngx_uint_t            i;
    ngx_list_part_t      *part;
    ngx_table_elt_t      *h;
    ngx_http_upstream_t  *u;
    ngx_http_dpd_ctx_t   *ctx;

    if (r != r->main) {
        return ngx_http_next_header_filter(r);
    }

    ctx = ngx_http_get_module_ctx(r, ngx_http_dpd_module);

    if (ctx == NULL) {
        return ngx_http_next_header_filter(r);
    }

    if (ctx->prefix_decoder.len) {
        /* dpd_prefix_cache approximate: the decoder answered; learn its
         * prompt only on success (ngx_http_dpd_prefix_learn()) */
        u = r->upstream;

        if (u && r->headers_out.status >= NGX_HTTP_OK
            && r->headers_out.status < NGX_HTTP_SPECIAL_RESPONSE)
        {
            ngx_http_dpd_prefix_learn(r, ctx, 0,
                                      (u->state && u->state->peer)
                                      ? u->state->peer : u->peer.name);

        } else {
            ctx->prefix_decoder.len = 0;
        }
    }

    if (ctx->kv_id.len == 0 || ctx->request_id.data == ctx->kv_id.data) {
        return ngx_http_next_header_filter(r);
    }

    part = &r->headers_out.headers.part;
    h = part->elts;

    for (i = 0; /* void */; i++) {

        if (i >= part->nelts) {
            if (part->next == NULL) {
                break;
            }

            part = part->next;
            h = part->elts;
            i = 0;
        }

        if (h[i].hash != 0
            && h[i].key.len == ngx_http_dpd_request_id_header.len
            && ngx_strncasecmp(h[i].key.data,
                               ngx_http_dpd_request_id_header.data,
                               h[i].key.len) == 0
            && h[i].value.len == ctx->kv_id.len
            && ngx_strncmp(h[i].value.data, ctx->kv_id.data,
                           ctx->kv_id.len) == 0)
        {
            h[i].value = ctx->request_id;
        }
    }

    return ngx_http_next_header_filter(r);
}


static ngx_int_t
ngx_http_dpd_log_handler(ngx_http_request_t *r)
{
    ngx_http_dpd_ctx_t       *ctx;
    ngx_http_dpd_loc_conf_t  *dlcf;

    if (r != r->main) {
        return NGX_OK;
    }

    ctx = ngx_http_dpd_get_ctx(r);

    if (ctx == NULL) {
        dlcf = ngx_http_get_module_loc_conf(r, ngx_http_dpd_module);
        if (!dlcf->enable) {
            return NGX_OK;
        }
    }

    ngx_http_dpd_metrics_log_request(r, ctx);

    return NGX_OK;
}


const char *
ngx_http_dpd_route_name(ngx_uint_t route)
{
    switch (route) {
    case NGX_HTTP_DPD_ROUTE_DIRECT:
        return "direct";
    case NGX_HTTP_DPD_ROUTE_DISAGGREGATED:
        return "disaggregated";
    case NGX_HTTP_DPD_ROUTE_FALLBACK:
        return "fallback";
    case NGX_HTTP_DPD_ROUTE_BYPASS:
        return "bypass";
    default:
        return NULL;
    }
}


uint64_t
ngx_http_dpd_now_usec(void)
{
    struct timespec  ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);

    return (uint64_t) ts.tv_sec * 1000000 + (uint64_t) ts.tv_nsec / 1000;
}


static ngx_int_t
ngx_http_dpd_variable(ngx_http_request_t *r, ngx_http_variable_value_t *v,
    uintptr_t data)
{
    u_char              *p;
    ngx_int_t            n;
    const char          *name;
    ngx_table_elt_t     *h;
    ngx_http_dpd_ctx_t  *ctx;

    ctx = ngx_http_dpd_get_ctx(r->main);

    v->not_found = 1;

    if (ctx == NULL) {
        return NGX_OK;
    }

    switch (data) {

    case NGX_HTTP_DPD_VAR_PROMPT_TOKENS:
    case NGX_HTTP_DPD_VAR_TOKENS_BOUND:
    case NGX_HTTP_DPD_VAR_CACHED_TOKENS:
    case NGX_HTTP_DPD_VAR_UNCACHED_TOKENS:
        switch (data) {
        case NGX_HTTP_DPD_VAR_PROMPT_TOKENS:
            n = ctx->prompt_tokens;
            break;
        case NGX_HTTP_DPD_VAR_TOKENS_BOUND:
            n = ctx->prompt_bound;
            break;
        case NGX_HTTP_DPD_VAR_CACHED_TOKENS:
            n = ctx->cached_tokens;
            break;
        default:
            n = ctx->uncached_tokens;
        }

        if (n < 0) {
            return NGX_OK;
        }

        p = ngx_pnalloc(r->pool, NGX_INT_T_LEN);
        if (p == NULL) {
            return NGX_ERROR;
        }

        v->len = ngx_sprintf(p, "%i", n) - p;
        v->data = p;
        break;

    case NGX_HTTP_DPD_VAR_ROUTE:
        name = ngx_http_dpd_route_name(ctx->route);
        if (name == NULL) {
            return NGX_OK;
        }

        v->len = ngx_strlen(name);
        v->data = (u_char *) name;
        break;

    case NGX_HTTP_DPD_VAR_REQUEST_ID:
        if (ctx->request_id.len == 0) {
            /* bypassed or rejected: the client's id, if any */
            h = ngx_http_dpd_find_request_id(r->main);
            if (h == NULL || h->value.len == 0) {
                return NGX_OK;
            }

            v->len = h->value.len;
            v->data = h->value.data;
            break;
        }

        v->len = ctx->request_id.len;
        v->data = ctx->request_id.data;
        break;

    case NGX_HTTP_DPD_VAR_MODEL:
        if (ctx->model_name.len == 0) {
            return NGX_OK;
        }

        v->len = ctx->model_name.len;
        v->data = ctx->model_name.data;
        break;

    case NGX_HTTP_DPD_VAR_KV_REQUEST_ID:
        if (ctx->kv_id.len == 0) {
            return NGX_OK;
        }

        v->len = ctx->kv_id.len;
        v->data = ctx->kv_id.data;
        break;

    case NGX_HTTP_DPD_VAR_DECISION_TIME:
    case NGX_HTTP_DPD_VAR_PREFIX_TIME:
        if (data == NGX_HTTP_DPD_VAR_DECISION_TIME ? !ctx->timed
                                                   : !ctx->prefix_timed)
        {
            return NGX_OK;
        }

        p = ngx_pnalloc(r->pool, NGX_INT64_LEN);
        if (p == NULL) {
            return NGX_ERROR;
        }

        v->len = ngx_sprintf(p, "%uL", data == NGX_HTTP_DPD_VAR_DECISION_TIME
                                       ? ctx->decision_usec
                                       : ctx->prefix_usec)
                 - p;
        v->data = p;
        break;

    default:
        return NGX_OK;
    }

    v->valid = 1;
    v->no_cacheable = 1;
    v->not_found = 0;

    return NGX_OK;
}


static ngx_int_t
ngx_http_dpd_preconfiguration(ngx_conf_t *cf)
{
    ngx_http_variable_t  *var, *v;

    for (v = ngx_http_dpd_vars; v->name.len; v++) {
        var = ngx_http_add_variable(cf, &v->name, v->flags);
        if (var == NULL) {
            return NGX_ERROR;
        }

        var->get_handler = v->get_handler;
        var->data = v->data;
    }

    return ngx_http_dpd_prefill_add_variables(cf);
}


static ngx_int_t
ngx_http_dpd_postconfiguration(ngx_conf_t *cf)
{
    ngx_str_t                   name = ngx_string("request_id");
    ngx_http_handler_pt        *h;
    ngx_http_core_main_conf_t  *cmcf;
    ngx_http_dpd_main_conf_t   *dmcf;

    dmcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_dpd_module);

    if (!dmcf->used) {
        /* the module is loaded but not configured in this http{} */
        return NGX_OK;
    }

    dmcf->request_id_index = ngx_http_get_variable_index(cf, &name);
    if (dmcf->request_id_index == NGX_ERROR) {
        return NGX_ERROR;
    }

    cmcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_core_module);

    /*
     * PRECONTENT: after rewrite, limit_req/limit_conn and access checks,
     * so an unauthorized or rate-limited client never makes us read and
     * tokenize its body; before try_files, mirror and the content handler
     */

    h = ngx_array_push(&cmcf->phases[NGX_HTTP_PRECONTENT_PHASE].handlers);
    if (h == NULL) {
        return NGX_ERROR;
    }

    *h = ngx_http_dpd_handler;

    h = ngx_array_push(&cmcf->phases[NGX_HTTP_LOG_PHASE].handlers);
    if (h == NULL) {
        return NGX_ERROR;
    }

    *h = ngx_http_dpd_log_handler;

    if (ngx_http_dpd_error_filter_init(cf) != NGX_OK) {
        return NGX_ERROR;
    }

    if (ngx_http_dpd_prefill_init(cf) != NGX_OK) {
        return NGX_ERROR;
    }

    ngx_http_next_header_filter = ngx_http_top_header_filter;
    ngx_http_top_header_filter = ngx_http_dpd_header_filter;

    if (ngx_http_dpd_model_init(cf) != NGX_OK
        || ngx_http_dpd_models_init(cf) != NGX_OK)
    {
        return NGX_ERROR;
    }

    if (ngx_http_dpd_check_init(cf) != NGX_OK) {
        return NGX_ERROR;
    }

    return ngx_http_dpd_metrics_init_zone_conf(cf, dmcf);
}


static void *
ngx_http_dpd_create_main_conf(ngx_conf_t *cf)
{
    ngx_http_dpd_main_conf_t  *dmcf;

    dmcf = ngx_pcalloc(cf->pool, sizeof(ngx_http_dpd_main_conf_t));
    if (dmcf == NULL) {
        return NULL;
    }

    /*
     * set by ngx_pcalloc():
     *
     *     dmcf->metrics_zone = NULL;
     *     dmcf->used = 0;
     */

    if (ngx_array_init(&dmcf->tokenizers, cf->pool, 2,
                       sizeof(ngx_http_dpd_tokenizer_t *))
        != NGX_OK)
    {
        return NULL;
    }

    if (ngx_array_init(&dmcf->model_locs, cf->pool, 2,
                       sizeof(ngx_http_dpd_loc_conf_t *))
        != NGX_OK
        || ngx_array_init(&dmcf->models_locs, cf->pool, 1, sizeof(void *))
           != NGX_OK)
    {
        return NULL;
    }

    dmcf->request_id_index = NGX_ERROR;

    return dmcf;
}


static void *
ngx_http_dpd_create_loc_conf(ngx_conf_t *cf)
{
    ngx_http_dpd_loc_conf_t  *dlcf;

    dlcf = ngx_pcalloc(cf->pool, sizeof(ngx_http_dpd_loc_conf_t));
    if (dlcf == NULL) {
        return NULL;
    }

    dlcf->tokenizer = NGX_CONF_UNSET_PTR;
    dlcf->enable = NGX_CONF_UNSET;
    dlcf->threshold = NGX_CONF_UNSET;
    dlcf->chat_template = NGX_CONF_UNSET;
    dlcf->max_json_depth = NGX_CONF_UNSET;
    dlcf->max_json_members = NGX_CONF_UNSET;
    dlcf->max_prompt_ids = NGX_CONF_UNSET;
    dlcf->max_messages = NGX_CONF_UNSET;
    dlcf->count = NGX_CONF_UNSET_UINT;
    dlcf->count_min_size = NGX_CONF_UNSET_SIZE;
    dlcf->metrics = NGX_CONF_UNSET;
    dlcf->model_default = NGX_CONF_UNSET_UINT;

    ngx_http_dpd_prefill_init_conf(&dlcf->prefill);
    ngx_http_dpd_prefix_init_conf(&dlcf->prefix);

    return dlcf;
}


static char *
ngx_http_dpd_merge_loc_conf(ngx_conf_t *cf, void *parent, void *child)
{
    ngx_http_dpd_loc_conf_t *prev = parent;
    ngx_http_dpd_loc_conf_t *conf = child;

    ngx_uint_t  mode;

    ngx_conf_merge_ptr_value(conf->tokenizer, prev->tokenizer, NULL);
    ngx_conf_merge_value(conf->enable, prev->enable, 0);
    ngx_conf_merge_value(conf->threshold, prev->threshold,
                         NGX_HTTP_DPD_DEFAULT_THRESHOLD);
    ngx_conf_merge_value(conf->max_json_depth, prev->max_json_depth,
                         NGX_HTTP_DPD_DEFAULT_JSON_DEPTH);
    ngx_conf_merge_value(conf->max_json_members, prev->max_json_members,
                         NGX_HTTP_DPD_DEFAULT_JSON_MEMBERS);
    ngx_conf_merge_value(conf->max_prompt_ids, prev->max_prompt_ids,
                         NGX_HTTP_DPD_DEFAULT_PROMPT_IDS);
    ngx_conf_merge_value(conf->max_messages, prev->max_messages,
                         NGX_HTTP_DPD_DEFAULT_MESSAGES);
    ngx_conf_merge_value(conf->metrics, prev->metrics, 0);
    ngx_conf_merge_uint_value(conf->count, prev->count,
                              NGX_HTTP_DPD_COUNT_EXACT);

    if (conf->count_min_size == NGX_CONF_UNSET_SIZE) {
        /* dpd_count_thread_pool: the pool and its size go together */
#if (NGX_THREADS)
        conf->count_pool = prev->count_pool;
#endif
        conf->count_min_size = (prev->count_min_size == NGX_CONF_UNSET_SIZE)
                               ? 0 : prev->count_min_size;
    }

    if (ngx_http_dpd_merge_chat_template(cf, prev, conf) != NGX_CONF_OK) {
        return NGX_CONF_ERROR;
    }

    if (conf->models == NULL) {
        /* a nested location routes by the same entries */
        conf->models = prev->models;
        conf->model_default = prev->model_default;
    }

    if (conf->enable && conf->tokenizer == NULL && conf->models == NULL) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "\"dpd on\" requires \"dpd_tokenizer\" "
                           "in this location or a block around it");
        return NGX_CONF_ERROR;
    }

    /* with the cache on, dpd_decode_upstream names the pool it chooses
     * in whatever the protocol (nixl too) */

    mode = (conf->prefix.mode != NGX_CONF_UNSET_UINT) ? conf->prefix.mode
                                                      : prev->prefix.mode;
    conf->prefill.prefix = (mode != NGX_CONF_UNSET_UINT
                            && mode != NGX_HTTP_DPD_PREFIX_OFF);

    if (ngx_http_dpd_prefill_merge_conf(cf, &prev->prefill, &conf->prefill)
        != NGX_CONF_OK)
    {
        return NGX_CONF_ERROR;
    }

    return ngx_http_dpd_prefix_merge_conf(cf, &prev->prefix, &conf->prefix,
                                          &conf->prefill.decode_name,
                                          conf->enable);
}


/*
 * dpd_tokenizer FILE [config=FILE]: in http, server or location (a block
 * without one inherits its parent's).  Each pair of files is loaded once,
 * however many blocks name it (by path or through another name for the
 * same files: compared by device and inode): the tokenizers live in the
 * master from configuration time and the workers share them.
 */
static char *
ngx_http_dpd_tokenizer(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_dpd_loc_conf_t *dlcf = conf;

    char                        err[512];
    u_char                     *p;
    ngx_str_t                  *value, path, config, dir, sibling;
    ngx_uint_t                  i;
    ngx_file_info_t             fi, cfi;
    ngx_pool_cleanup_t         *cln;
    ngx_http_dpd_tokenizer_t   *t, **tp;
    ngx_http_dpd_main_conf_t   *dmcf;

    if (dlcf->tokenizer != NGX_CONF_UNSET_PTR) {
        return "is duplicate";
    }

    dmcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_dpd_module);

    value = cf->args->elts;

    path = value[1];
    ngx_str_null(&config);

    if (cf->args->nelts == 3) {
        if (value[2].len <= sizeof("config=") - 1
            || ngx_strncmp(value[2].data, "config=", sizeof("config=") - 1)
               != 0)
        {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "invalid parameter \"%V\", "
                               "expected \"config=FILE\"", &value[2]);
            return NGX_CONF_ERROR;
        }

        config.data = value[2].data + sizeof("config=") - 1;
        config.len = value[2].len - (sizeof("config=") - 1);
    }

    /* relative paths are relative to the configuration prefix */

    if (ngx_conf_full_name(cf->cycle, &path, 1) != NGX_OK) {
        return NGX_CONF_ERROR;
    }

    if (config.len) {
        if (ngx_conf_full_name(cf->cycle, &config, 1) != NGX_OK) {
            return NGX_CONF_ERROR;
        }

    } else {
        /* tokenizer_config.json next to tokenizer.json, if it is there */

        dir = path;
        while (dir.len && dir.data[dir.len - 1] != '/') {
            dir.len--;
        }

        sibling.len = dir.len + sizeof("tokenizer_config.json") - 1;
        sibling.data = ngx_pnalloc(cf->pool, sibling.len + 1);
        if (sibling.data == NULL) {
            return NGX_CONF_ERROR;
        }

        p = ngx_cpymem(sibling.data, dir.data, dir.len);
        p = ngx_cpymem(p, "tokenizer_config.json",
                       sizeof("tokenizer_config.json") - 1);
        *p = '\0';

        if (ngx_file_info(sibling.data, &fi) != NGX_FILE_ERROR
            && ngx_is_file(&fi))
        {
            config = sibling;
        }
    }

    /* ngx_conf_full_name() results are NUL-terminated */

    if (ngx_file_info(path.data, &fi) == NGX_FILE_ERROR) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, ngx_errno,
                           "dpd_tokenizer \"%V\": "
                           ngx_file_info_n " failed", &path);
        return NGX_CONF_ERROR;
    }

    if (config.len && ngx_file_info(config.data, &cfi) == NGX_FILE_ERROR) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, ngx_errno,
                           "dpd_tokenizer \"%V\" (config \"%V\"): "
                           ngx_file_info_n " failed", &path, &config);
        return NGX_CONF_ERROR;
    }

    /* the same files again: the tokenizer already loaded */

    tp = dmcf->tokenizers.elts;

    for (i = 0; i < dmcf->tokenizers.nelts; i++) {
        t = tp[i];

        if (t->uniq == ngx_file_uniq(&fi) && t->dev == fi.st_dev
            && (config.len == 0) == (t->config.len == 0)
            && (config.len == 0
                || (t->config_uniq == ngx_file_uniq(&cfi)
                    && t->config_dev == cfi.st_dev)))
        {
            dlcf->tokenizer = t;

            ngx_log_error(NGX_LOG_NOTICE, cf->log, 0,
                          "dpd_tokenizer \"%V\": already loaded as \"%V\"",
                          &path, &t->path);

            return NGX_CONF_OK;
        }
    }

    t = ngx_pcalloc(cf->pool, sizeof(ngx_http_dpd_tokenizer_t));
    if (t == NULL) {
        return NGX_CONF_ERROR;
    }

    t->path = path;
    t->config = config;
    t->uniq = ngx_file_uniq(&fi);
    t->dev = fi.st_dev;

    if (config.len) {
        t->config_uniq = ngx_file_uniq(&cfi);
        t->config_dev = cfi.st_dev;
    }

    err[0] = '\0';

    t->tok = dpd_tok_load((char *) path.data,
                          config.len ? (char *) config.data : NULL,
                          err, sizeof(err));

    if (t->tok == NULL) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "dpd_tokenizer \"%V\"%s%V%s: %s",
                           &path,
                           config.len ? " (config \"" : "",
                           &config,
                           config.len ? "\")" : "",
                           err[0] ? err : "load failed");
        return NGX_CONF_ERROR;
    }

    /* loaded once in the master, shared copy-on-write by the workers,
     * freed with the cycle */

    cln = ngx_pool_cleanup_add(cf->pool, 0);
    if (cln == NULL) {
        dpd_tok_free(t->tok);
        return NGX_CONF_ERROR;
    }

    cln->handler = ngx_http_dpd_tokenizer_cleanup;
    cln->data = t->tok;

    tp = ngx_array_push(&dmcf->tokenizers);
    if (tp == NULL) {
        return NGX_CONF_ERROR;
    }

    *tp = t;

    t->tmpl = dpd_tok_chat_template(t->tok);
    dmcf->used = 1;
    dlcf->tokenizer = t;

    ngx_http_dpd_count_bound_init(t);

    ngx_log_error(NGX_LOG_NOTICE, cf->log, 0,
                  "dpd_tokenizer \"%V\": %uD ids, chat template \"%s\"",
                  &t->path, dpd_tok_vocab_size(t->tok),
                  dpd_chat_template_name(t->tmpl));

    if (t->tmpl == DPD_CHAT_NONE) {
        /* a base model, or the config left out: say what that costs */
        ngx_conf_log_error(NGX_LOG_WARN, cf, 0,
                           "dpd_tokenizer \"%V\" has no chat template (%s): "
                           "/v1/chat/completions prompts are estimated "
                           "(content tokens + %d per message + %d, logged "
                           "\"(estimated)\") and dpd_threshold routes chats "
                           "on that estimate; completions stay exact; give "
                           "config=tokenizer_config.json or "
                           "\"dpd_chat_template FILE\"",
                           &t->path,
                           config.len ? "its tokenizer_config.json has no "
                                        "\"chat_template\""
                                      : "no tokenizer_config.json next to it "
                                        "and no config=",
                           DPD_CHAT_EST_PER_MESSAGE, DPD_CHAT_EST_PRIMING);
    }

    return NGX_CONF_OK;
}


static void
ngx_http_dpd_tokenizer_cleanup(void *data)
{
    dpd_tok_free(data);
}


/*
 * dpd_chat_template auto | none | FILE: "auto" (and the old family names
 * llama3, llama3.1, chatml) renders with the model's own Jinja template,
 * "none" gives the documented estimate, anything else is a Jinja template
 * file compiled here, at configuration time, on the loaded tokenizer.
 */

static char *
ngx_http_dpd_chat_template(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_dpd_loc_conf_t *dlcf = conf;

    int         t;
    ngx_str_t  *value, path;

    if (dlcf->chat_template != NGX_CONF_UNSET) {
        return "is duplicate";
    }

    value = cf->args->elts;

    if (ngx_strlen(value[1].data) != value[1].len) {
        return "has a NUL byte in its argument";
    }

    t = dpd_chat_template_from_name((char *) value[1].data);

    if (t >= 0) {
        dlcf->chat_template = t;
        return NGX_CONF_OK;
    }

    /*
     * a template file: compiled when the block is merged, on the tokenizer
     * the block ends up with (dpd_tokenizer may follow in the block or be
     * inherited); an unreadable file or a syntax error fails nginx -t there
     */

    path = value[1];

    if (ngx_conf_full_name(cf->cycle, &path, 1) != NGX_OK) {
        return NGX_CONF_ERROR;
    }

    dlcf->chat_template = NGX_HTTP_DPD_CHAT_FILE_PENDING;
    dlcf->chat_template_file = path;
    dlcf->chat_template_name = value[1];

    return NGX_CONF_OK;
}


/*
 * dpd_chat_template is inherited with its file; a file is compiled (once
 * per tokenizer it is used with: the result is inherited too) on the
 * tokenizer of the block, where its template handle belongs
 */

static char *
ngx_http_dpd_merge_chat_template(ngx_conf_t *cf, ngx_http_dpd_loc_conf_t *prev,
    ngx_http_dpd_loc_conf_t *conf)
{
    int   t;
    char  err[512];

    if (conf->chat_template == NGX_CONF_UNSET) {
        conf->chat_template = (prev->chat_template == NGX_CONF_UNSET)
                              ? DPD_CHAT_AUTO : prev->chat_template;
        conf->chat_template_file = prev->chat_template_file;
        conf->chat_template_name = prev->chat_template_name;
        conf->chat_template_tok = prev->chat_template_tok;
    }

    if (conf->chat_template_file.len == 0
        || (conf->chat_template_tok == conf->tokenizer
            && conf->chat_template != NGX_HTTP_DPD_CHAT_FILE_PENDING))
    {
        return NGX_CONF_OK;
    }

    if (conf->tokenizer == NULL) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "dpd_chat_template \"%V\": a template file "
                           "needs \"dpd_tokenizer\" in the block or a block "
                           "around it (or use \"auto\" or \"none\")",
                           &conf->chat_template_name);
        return NGX_CONF_ERROR;
    }

    err[0] = '\0';

    t = dpd_tok_chat_template_file(conf->tokenizer->tok,
                                   (char *) conf->chat_template_file.data,
                                   err, sizeof(err));

    if (t < 0) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "dpd_chat_template \"%V\": %s",
                           &conf->chat_template_name,
                           err[0] ? err : "invalid template");
        return NGX_CONF_ERROR;
    }

    conf->chat_template = t;
    conf->chat_template_tok = conf->tokenizer;

    return NGX_CONF_OK;
}


/*
 * dpd_count_thread_pool NAME [min_size=SIZE] | off: bodies of min_size
 * (default 32k) or more are parsed and counted in a thread of pool NAME
 * (a thread_pool, or "default"), as "aio threads=NAME" reads files; an
 * unknown pool fails the configuration (nginx's thread pool module
 * checks, naming it).
 */

static char *
ngx_http_dpd_count_thread_pool(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf)
{
    ngx_http_dpd_loc_conf_t *dlcf = conf;

    ssize_t     size;
    ngx_str_t  *value, s;

    if (dlcf->count_min_size != NGX_CONF_UNSET_SIZE) {
        return "is duplicate";
    }

    value = cf->args->elts;

    if (ngx_strcmp(value[1].data, "off") == 0) {
        if (cf->args->nelts > 2) {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "invalid parameter \"%V\": \"off\" takes "
                               "none", &value[2]);
            return NGX_CONF_ERROR;
        }

#if (NGX_THREADS)
        dlcf->count_pool = NULL;
#endif
        dlcf->count_min_size = 0;

        return NGX_CONF_OK;
    }

#if (NGX_THREADS)

    if (value[1].len == 0) {
        return "has an empty thread pool name";
    }

    size = NGX_HTTP_DPD_DEFAULT_COUNT_MIN_SIZE;

    if (cf->args->nelts > 2) {
        if (value[2].len <= sizeof("min_size=") - 1
            || ngx_strncmp(value[2].data, "min_size=",
                           sizeof("min_size=") - 1) != 0)
        {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "invalid parameter \"%V\", expected "
                               "\"min_size=SIZE\"", &value[2]);
            return NGX_CONF_ERROR;
        }

        s.data = value[2].data + sizeof("min_size=") - 1;
        s.len = value[2].len - (sizeof("min_size=") - 1);

        size = ngx_parse_size(&s);

        if (size == NGX_ERROR) {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "invalid min_size \"%V\"", &s);
            return NGX_CONF_ERROR;
        }
    }

    dlcf->count_pool = ngx_thread_pool_add(cf, &value[1]);
    if (dlcf->count_pool == NULL) {
        return NGX_CONF_ERROR;
    }

    dlcf->count_min_size = (size_t) size;

    return NGX_CONF_OK;

#else

    (void) size;
    (void) s;

    ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                       "\"dpd_count_thread_pool\" needs an nginx built "
                       "with threads (--with-threads); use "
                       "\"dpd_count_thread_pool off\"");
    return NGX_CONF_ERROR;

#endif
}


static ngx_int_t
ngx_http_dpd_init_process(ngx_cycle_t *cycle)
{
    ngx_http_dpd_openai_init_process();

    return NGX_OK;
}


static char *
ngx_http_dpd_metrics(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_dpd_loc_conf_t *dlcf = conf;

    ngx_http_core_loc_conf_t  *clcf;
    ngx_http_dpd_main_conf_t  *dmcf;

    if (dlcf->metrics != NGX_CONF_UNSET) {
        return "is duplicate";
    }

    dlcf->metrics = 1;

    dmcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_dpd_module);
    dmcf->used = 1;

    clcf = ngx_http_conf_get_module_loc_conf(cf, ngx_http_core_module);
    clcf->handler = ngx_http_dpd_metrics_handler;

    return NGX_CONF_OK;
}
