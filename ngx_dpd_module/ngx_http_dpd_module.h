/*
 * ngx_http_dpd_module: shared declarations of the gateway core.
 *
 * The core reads an OpenAI request body early, parses it once (cJSON),
 * counts its prompt tokens with the project's tokenizer, decides the route
 * (direct / disaggregated) and hands disaggregated requests to the prefill
 * code (ngx_http_dpd_prefill.h).  This header is the contract between the
 * core files (module, body, openai, metrics, error) and the prefill work.
 */

#ifndef _NGX_HTTP_DPD_MODULE_H_INCLUDED_
#define _NGX_HTTP_DPD_MODULE_H_INCLUDED_


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include <cjson/cJSON.h>

#include "dpd_tokenizer.h"
#include "ngx_http_dpd_protocol.h"
#include "ngx_http_dpd_prefill.h"
#include "ngx_http_dpd_metrics.h"
#include "ngx_http_dpd_prefix.h"


/* ctx->route; also the value of $dpd_route */
#define NGX_HTTP_DPD_ROUTE_NONE           0   /* not decided (rejected) */
#define NGX_HTTP_DPD_ROUTE_DIRECT         1
#define NGX_HTTP_DPD_ROUTE_DISAGGREGATED  2
#define NGX_HTTP_DPD_ROUTE_FALLBACK       3
#define NGX_HTTP_DPD_ROUTE_BYPASS         4

/* ctx->kind */
#define NGX_HTTP_DPD_KIND_NONE            0   /* not an inference request */
#define NGX_HTTP_DPD_KIND_COMPLETIONS     1   /* POST .../v1/completions */
#define NGX_HTTP_DPD_KIND_CHAT            2   /* POST .../chat/completions */

/* ctx->state: where the phase handler stands */
#define NGX_HTTP_DPD_STATE_NEW            0
#define NGX_HTTP_DPD_STATE_READING        1   /* body read in progress */
#define NGX_HTTP_DPD_STATE_BODY           2   /* body read, not parsed */
#define NGX_HTTP_DPD_STATE_DECIDED        3   /* parsed, counted, routed */
#define NGX_HTTP_DPD_STATE_DONE           4   /* phases continue */
#define NGX_HTTP_DPD_STATE_COUNTING       5   /* parse + count in a thread */
#define NGX_HTTP_DPD_STATE_COUNTED        6   /* the thread's result is in */

/* ctx->answer: what the core's content handler sends (nothing else in the
 * module sends a response from the phase handler or finalizes there) */
#define NGX_HTTP_DPD_ANSWER_NONE          0
#define NGX_HTTP_DPD_ANSWER_ERROR         1   /* OpenAI-shaped error */
#define NGX_HTTP_DPD_ANSWER_BODY          2   /* answer_body as it is (a
                                                 relayed prefill 4xx) */

#define NGX_HTTP_DPD_DEFAULT_THRESHOLD    4096
#define NGX_HTTP_DPD_DEFAULT_JSON_DEPTH   64
#define NGX_HTTP_DPD_MAX_JSON_DEPTH       512
#define NGX_HTTP_DPD_REQUEST_ID_MAX       256

/* per-request caps (dpd_max_json_members, _prompt_ids, _messages) */
#define NGX_HTTP_DPD_DEFAULT_JSON_MEMBERS 524288
#define NGX_HTTP_DPD_DEFAULT_PROMPT_IDS   262144
#define NGX_HTTP_DPD_DEFAULT_MESSAGES     16384

/* dpd_chat_template FILE until the block's merge compiles it */
#define NGX_HTTP_DPD_CHAT_FILE_PENDING    (-2)

/* dpd_count_thread_pool NAME: bodies from this size on, by default */
#define NGX_HTTP_DPD_DEFAULT_COUNT_MIN_SIZE  (32 * 1024)

/* dpd_count: how a text prompt is measured against dpd_threshold */
#define NGX_HTTP_DPD_COUNT_EXACT          0   /* always the exact BPE count */
#define NGX_HTTP_DPD_COUNT_BOUND          1   /* skip BPE when a byte bound
                                                 is below the threshold */


/*
 * A loaded tokenizer (dpd_tokenizer): one per pair of files, whatever the
 * number of blocks naming it, loaded at configuration time in the master
 * and shared copy-on-write by the workers; freed with the cycle.
 */
typedef struct {
    dpd_tok_t                   *tok;
    ngx_str_t                    path;         /* tokenizer.json, full */
    ngx_str_t                    config;       /* tokenizer_config.json */
    ngx_file_uniq_t              uniq;         /* the files' identity */
    ngx_file_uniq_t              config_uniq;
    dev_t                        dev;
    dev_t                        config_dev;
    dpd_chat_template_t          tmpl;         /* detected from config */

    /* dpd_count bound: ids <= (ascii + other * bound_other)
     * * bound_prefix + specials; see ngx_http_dpd_count_bound_init() */
    ngx_uint_t                   bound_other;   /* non-ASCII byte factor */
    ngx_uint_t                   bound_prefix;  /* prefix-space factor */
    ngx_uint_t                   bound_specials; /* post-processor ids */
} ngx_http_dpd_tokenizer_t;


/* the model names $dpd_model keeps (longer ones are cut, for logs) */
#define NGX_HTTP_DPD_MODEL_LEN  128


/* http{}-level settings */
typedef struct {
    ngx_array_t                  tokenizers;   /* ngx_http_dpd_tokenizer_t *,
                                                  each loaded once */
    ngx_shm_zone_t              *metrics_zone;
    void                        *metrics;      /* its counters, set when
                                                  the zone is initialized */
    ngx_uint_t                   used;         /* any dpd directive seen */
    ngx_int_t                    request_id_index; /* $request_id */
    ngx_array_t                  model_locs;   /* ngx_http_dpd_loc_conf_t *
                                                  with dpd_model entries */
    ngx_array_t                  models_locs;  /* dpd_models confs (its
                                                  file's own type) */
} ngx_http_dpd_main_conf_t;


/* location-level settings (the typedef name is part of the contract) */
typedef struct {
    ngx_http_dpd_tokenizer_t    *tokenizer;     /* dpd_tokenizer (inherited) */
    ngx_flag_t                   enable;        /* dpd on|off */
    ngx_int_t                    threshold;     /* dpd_threshold */
    ngx_int_t                    chat_template; /* dpd_chat_template: a
                                                   dpd_chat_template_t, for
                                                   a FILE compiled on
                                                   chat_template_tok */
    ngx_str_t                    chat_template_file; /* its FILE, full */
    ngx_str_t                    chat_template_name; /* as written */
    ngx_http_dpd_tokenizer_t    *chat_template_tok;
    ngx_int_t                    max_json_depth; /* dpd_max_json_depth */
    ngx_int_t                    max_json_members; /* dpd_max_json_members */
    ngx_int_t                    max_prompt_ids; /* dpd_max_prompt_ids */
    ngx_int_t                    max_messages;  /* dpd_max_messages */
    ngx_uint_t                   count;         /* dpd_count */
#if (NGX_THREADS)
    ngx_thread_pool_t           *count_pool;    /* dpd_count_thread_pool */
#endif
    size_t                       count_min_size; /* its min_size= */
    ngx_flag_t                   metrics;       /* dpd_metrics handler */
    ngx_array_t                 *models;        /* dpd_model entries
                                                   (ngx_http_dpd_model_t) */
    ngx_uint_t                   model_default; /* index of "*", else
                                                   NGX_CONF_UNSET_UINT */
    ngx_http_dpd_prefill_conf_t  prefill;       /* owned by prefill code */
    ngx_http_dpd_prefix_conf_t   prefix;        /* dpd_prefix_cache */
    void                        *models_list;   /* dpd_models (not
                                                   inherited; models.c) */
} ngx_http_dpd_loc_conf_t;


/* one "dpd_model NAME @location" (ngx_http_dpd_model.c) */
typedef struct {
    ngx_str_t                    name;          /* as clients send it; "*" */
    ngx_str_t                    location;      /* "@name" */
    ngx_http_core_srv_conf_t    *cscf;          /* whose named locations */
    ngx_http_dpd_loc_conf_t     *target;        /* its settings (resolved at
                                                   postconfiguration) */
    ngx_uint_t                   metrics_slot;  /* its "model" label in the
                                                   metrics zone; 0: other */
} ngx_http_dpd_model_t;


/* per-request state (typedef ngx_http_dpd_ctx_t is in prefill.h) */
struct ngx_http_dpd_ctx_s {
    ngx_http_dpd_req_t           req;           /* the body parsed and
                                                   indexed: the tree is
                                                   dropped once counted
                                                   (and by a pool cleanup),
                                                   the index is kept for
                                                   the upstream bodies */
    ngx_str_t                    body;          /* body as parsed (pool or
                                                   request buffer memory,
                                                   live as long as r) */
    ngx_str_t                    request_id;    /* the client's X-Request-Id
                                                   (else kv_id): logs,
                                                   $dpd_request_id */
    ngx_str_t                    kv_id;         /* generated, unguessable:
                                                   the X-Request-Id sent to
                                                   the engines and the KV
                                                   key of every protocol */

    ngx_int_t                    prompt_tokens; /* -1: not counted */
    ngx_int_t                    prompt_bound;  /* dpd_count bound: upper
                                                   bound; -1: none */

    /* dpd_prefix_cache (ngx_http_dpd_prefix.c) */
    uint64_t                    *prefix_keys;   /* the prompt's block keys */
    size_t                       prefix_nkeys;
    ngx_int_t                    cached_tokens; /* on the chosen decoder;
                                                   -1: no lookup */
    ngx_int_t                    uncached_tokens;
    ngx_uint_t                   prefix_reason; /* NGX_HTTP_DPD_PR_* */
    /* approximate: the nodes chosen, learned once they answered (a 2xx
     * header, a 2xx prefill reply); len 0: nothing pending */
    ngx_http_dpd_prefix_conf_t  *prefix_conf;
    ngx_str_t                    prefix_decoder;
    ngx_str_t                    prefix_prefiller;
    ngx_uint_t                   route;         /* NGX_HTTP_DPD_ROUTE_* */
    ngx_uint_t                   kind;          /* NGX_HTTP_DPD_KIND_* */
    ngx_uint_t                   state;         /* NGX_HTTP_DPD_STATE_* */

    /* a rejected request: what the client gets and the metric label */
    ngx_uint_t                   err_status;
    ngx_uint_t                   err_reason;    /* NGX_HTTP_DPD_E_* */
    const char                  *err_type;
    u_char                      *err_message;
    ngx_str_t                    error_body;    /* error filter's JSON */

    /* the answer the content phase sends (NGX_HTTP_DPD_ANSWER_*) */
    ngx_uint_t                   answer;
    ngx_uint_t                   answer_status;
    const char                  *answer_type;   /* ERROR */
    const char                  *answer_message; /* ERROR */
    ngx_str_t                    answer_body;   /* BODY */
    ngx_str_t                    answer_content_type; /* BODY */

    ngx_http_dpd_model_t        *model;         /* dpd_model entry chosen */
    ngx_str_t                    model_name;    /* the request's "model"
                                                   (in model_buf, cut) */
    u_char                       model_buf[NGX_HTTP_DPD_MODEL_LEN];

    void                        *count_job;     /* the parse + count job
                                                   (ngx_http_dpd_openai.c) */
    ngx_int_t                    count_rc;      /* its result, once
                                                   COUNTED */

    /* CLOCK_MONOTONIC microseconds */
    uint64_t                     start_usec;    /* phase handler entry */
    uint64_t                     decision_usec; /* read + parse + count */
    uint64_t                     prefix_usec;   /* keys, lookup, pick */
    uint64_t                     decode_usec;   /* decode body handed to
                                                   proxy_pass (metrics) */
    uint64_t                     first_usec;    /* first response body
                                                   byte, 0: none yet */

    unsigned                     timed:1;       /* decision_usec is set */
    unsigned                     prefix_timed:1; /* prefix_usec is set */
    unsigned                     stream:1;      /* "stream": true */
    unsigned                     observe:1;     /* no prefill_pass: direct */
    unsigned                     estimated:1;   /* chat count is estimate */
    unsigned                     count_skipped:1; /* bound < threshold: no
                                                   BPE count, direct */
    unsigned                     kv_stripped:1; /* client kv_transfer_params
                                                   removed */
    unsigned                     own_error:1;   /* send_error() replied */
    unsigned                     error_page:1;  /* filter rewrites body */
    unsigned                     error_sent:1;  /* filter body sent */
    unsigned                     logged:1;      /* counted in metrics */
    unsigned                     model_done:1;  /* passed to its location */

    ngx_http_dpd_prefill_ctx_t   prefill;       /* owned by prefill code */
};


extern ngx_module_t  ngx_http_dpd_module;


/*
 * The request's ctx, or NULL for requests the module did not handle.
 * Survives internal redirects (recovered from the pool cleanup).
 */
ngx_http_dpd_ctx_t *ngx_http_dpd_get_ctx(ngx_http_request_t *r);

/* a new ctx (route NONE, prompt_tokens -1) set on the request */
ngx_http_dpd_ctx_t *ngx_http_dpd_create_ctx(ngx_http_request_t *r);

/*
 * Have the content phase answer the request with ctx->answer (set it
 * first); returns what the phase handler returns to the phase engine
 * (NGX_OK: on to the content phase, whose handler sends the answer and
 * whose finalize is the last touch of the request).
 */
ngx_int_t ngx_http_dpd_answer(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx);

/*
 * Client or peer text escaped for error.log (control bytes, '\\', bytes
 * that are not UTF-8 as \xNN; at most NGX_HTTP_DPD_LOG_TEXT_MAX bytes of
 * it): every log line that prints such text passes it through this.
 */
#define NGX_HTTP_DPD_LOG_TEXT_MAX  512

ngx_str_t *ngx_http_dpd_log_text(ngx_pool_t *pool, const u_char *data,
    size_t len);
ngx_str_t *ngx_http_dpd_log_cstr(ngx_pool_t *pool, const char *s);

/*
 * Replace the main request body by len bytes at data, so that a following
 * proxy_pass (and its retries) sends exactly these bytes with a matching
 * Content-Length.  data must live as long as the request (r->pool memory).
 */
ngx_int_t ngx_http_dpd_replace_body(ngx_http_request_t *r, u_char *data,
    size_t len);

/*
 * Send an OpenAI-shaped error response
 *   {"error":{"message":"...","type":"...","param":null,"code":status}}
 * Returns what ngx_http_finalize_request() expects after a content handler
 * sent a response (NGX_OK, NGX_AGAIN, NGX_ERROR): a content handler
 * returns it (the content phase finalizes with it); the phase handler
 * never calls this, it sets ctx->answer (ngx_http_dpd_answer()).
 * type: OpenAI's error type ("invalid_request_error", "server_error", ...);
 * NULL picks one from the status.
 */
ngx_int_t ngx_http_dpd_send_error(ngx_http_request_t *r, ngx_uint_t status,
    const char *type, const char *message);

/* default OpenAI error type for an HTTP status */
const char *ngx_http_dpd_error_type(ngx_uint_t status);

/* route name as in $dpd_route ("direct", ...); NULL for NONE */
const char *ngx_http_dpd_route_name(ngx_uint_t route);

/* CLOCK_MONOTONIC in microseconds */
uint64_t ngx_http_dpd_now_usec(void);


/* core-internal (body, openai, error, metrics files) */

ngx_int_t ngx_http_dpd_read_body(ngx_http_request_t *r,
    ngx_http_client_body_handler_pt handler);
ngx_int_t ngx_http_dpd_body_bytes(ngx_http_request_t *r, ngx_str_t *body);

void ngx_http_dpd_count_bound_init(ngx_http_dpd_tokenizer_t *t);
void ngx_http_dpd_openai_cleanup(ngx_http_dpd_ctx_t *ctx);
void ngx_http_dpd_openai_init_process(void);

/* cJSON's allocator for the calling thread (ngx_http_dpd_openai.c) */
ngx_pool_t *ngx_http_dpd_tree_scope(ngx_pool_t *pool);

/*
 * Parses, checks and counts the body.  NGX_OK (ctx->err_* set for bad
 * input), NGX_ERROR, or NGX_AGAIN: handed to the location's
 * dpd_count_thread_pool (ctx->state COUNTING); the thread's completion
 * sets ctx->count_rc and state COUNTED and resumes the phases.
 */
ngx_int_t ngx_http_dpd_openai_process(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_main_conf_t *dmcf,
    ngx_http_dpd_loc_conf_t *dlcf);

ngx_int_t ngx_http_dpd_error_filter_init(ngx_conf_t *cf);

ngx_int_t ngx_http_dpd_metrics_init_zone_conf(ngx_conf_t *cf,
    ngx_http_dpd_main_conf_t *dmcf);
ngx_int_t ngx_http_dpd_metrics_handler(ngx_http_request_t *r);
void ngx_http_dpd_metrics_log_request(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx);

/* dpd_model (ngx_http_dpd_model.c) */
char *ngx_http_dpd_model(ngx_conf_t *cf, ngx_command_t *cmd, void *conf);
ngx_int_t ngx_http_dpd_model_init(ngx_conf_t *cf);

/* dpd_models: GET /v1/models, the union (ngx_http_dpd_models.c) */
char *ngx_http_dpd_models(ngx_conf_t *cf, ngx_command_t *cmd, void *conf);
ngx_int_t ngx_http_dpd_models_init(ngx_conf_t *cf);
ngx_http_dpd_model_t *ngx_http_dpd_model_pick(ngx_http_dpd_loc_conf_t *dlcf,
    const cJSON *json, const char **name, size_t *len, int *bad);
ngx_int_t ngx_http_dpd_model_pass(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx);


#endif /* _NGX_HTTP_DPD_MODULE_H_INCLUDED_ */
