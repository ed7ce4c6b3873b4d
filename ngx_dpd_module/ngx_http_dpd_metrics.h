/*
 * Metrics of ngx_http_dpd_module: counters and histograms in one shared
 * memory zone, aggregated across workers, served as Prometheus text by the
 * dpd_metrics location handler.
 */

#ifndef _NGX_HTTP_DPD_METRICS_H_INCLUDED_
#define _NGX_HTTP_DPD_METRICS_H_INCLUDED_


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>


/*
 * Reasons a request is rejected: label "type" of dpd_errors_total.  Also
 * ctx->err_reason.
 */
typedef enum {
    NGX_HTTP_DPD_E_NONE = 0,
    NGX_HTTP_DPD_E_EMPTY_BODY,          /* empty_body */
    NGX_HTTP_DPD_E_MALFORMED_JSON,      /* malformed_json */
    NGX_HTTP_DPD_E_INVALID_UTF8,        /* invalid_utf8 */
    NGX_HTTP_DPD_E_TOO_DEEP,            /* too_deep */
    NGX_HTTP_DPD_E_INVALID_FIELD,       /* invalid_field: missing/wrong type */
    NGX_HTTP_DPD_E_TOKEN_RANGE,         /* token_out_of_range */
    NGX_HTTP_DPD_E_BODY_TOO_LARGE,      /* body_too_large (413) */
    NGX_HTTP_DPD_E_BODY_READ,           /* body_read: client, timeout */
    NGX_HTTP_DPD_E_INTERNAL,            /* internal */
    NGX_HTTP_DPD_E_DUPLICATE_KEY,       /* duplicate_key: repeated key */
    NGX_HTTP_DPD_E_NUL_CHAR,            /* nul_character: "\u0000" */
    NGX_HTTP_DPD_E_OVER_LIMIT,          /* over_limit: dpd_max_* caps */
    NGX_HTTP_DPD_E_UNKNOWN_MODEL,       /* unknown_model: no dpd_model (404) */
    NGX_HTTP_DPD_E_N
} ngx_http_dpd_error_reason_e;


/* plain counters: ngx_http_dpd_metrics_inc() */
typedef enum {
    NGX_HTTP_DPD_M_PREFILL_REQUESTS = 0, /* prefill subrequests started */
    NGX_HTTP_DPD_M_PREFILL_FAIL_5XX,     /* failures by cause ... */
    NGX_HTTP_DPD_M_PREFILL_FAIL_4XX,
    NGX_HTTP_DPD_M_PREFILL_FAIL_TIMEOUT,
    NGX_HTTP_DPD_M_PREFILL_FAIL_CONNECT,
    NGX_HTTP_DPD_M_PREFILL_FAIL_BAD_REPLY,
    NGX_HTTP_DPD_M_KV_HANDOFF_PARAMS,    /* decode got kv_transfer_params */
    NGX_HTTP_DPD_M_KV_HANDOFF_NO_PARAMS, /* prefill reply had none */
    NGX_HTTP_DPD_M_KV_STRIPPED,          /* client kv_transfer_params cut */
    NGX_HTTP_DPD_M_COUNT_SKIPPED,        /* dpd_count bound: no BPE */
    NGX_HTTP_DPD_M_DECODE_RETRY_OK,      /* decode retries, by outcome: */
    NGX_HTTP_DPD_M_DECODE_RETRY_FAILED,  /* ok, failed, no_decoder, */
    NGX_HTTP_DPD_M_DECODE_RETRY_NO_PEER, /* client_closed */
    NGX_HTTP_DPD_M_DECODE_RETRY_ABORTED,
    NGX_HTTP_DPD_M_PREFIX_LOOKUPS,       /* dpd_prefix_cache lookups */
    NGX_HTTP_DPD_M_PREFIX_HITS,          /* ... with cached blocks */
    NGX_HTTP_DPD_M_PREFIX_CACHED_TOKENS, /* sum of cached tokens */
    NGX_HTTP_DPD_M_PREFIX_ROUTE_SHORT,   /* routes by reason: direct */
    NGX_HTTP_DPD_M_PREFIX_ROUTE_CACHED,  /* short, direct cached, */
    NGX_HTTP_DPD_M_PREFIX_ROUTE_DISAGG,  /* disaggregated */
    NGX_HTTP_DPD_M_PREFIX_IMBALANCED,    /* the load guard overrode */
    NGX_HTTP_DPD_M_PREFIX_STALE,         /* lookups in a dead writer's
                                            index: nothing counted */
    NGX_HTTP_DPD_M_N
} ngx_http_dpd_counter_e;


/* histograms: ngx_http_dpd_metrics_observe(), value in the base unit */
typedef enum {
    NGX_HTTP_DPD_H_PROMPT_TOKENS = 0,    /* tokens */
    NGX_HTTP_DPD_H_DECISION_SECONDS,     /* seconds: read+parse+count */
    NGX_HTTP_DPD_H_PREFILL_SECONDS,      /* seconds: prefill subrequest */
    NGX_HTTP_DPD_H_KV_WAIT_SECONDS,      /* seconds: kv_agent table wait */
    NGX_HTTP_DPD_H_N
} ngx_http_dpd_histogram_e;


/* kv_agent: how the wait for the KV ended, label "outcome" of
 * dpd_kv_wait_total: ngx_http_dpd_metrics_kv_wait() */
typedef enum {
    NGX_HTTP_DPD_KVW_READY = 0,          /* ready: the table said ready */
    NGX_HTTP_DPD_KVW_FAILED,             /* failed: the table said failed */
    NGX_HTTP_DPD_KVW_TIMEOUT,            /* timeout: dpd_kv_wait passed */
    NGX_HTTP_DPD_KVW_NOT_PUSHED,         /* not_pushed: prefill reply said
                                            nothing was sent */
    NGX_HTTP_DPD_KVW_NO_TABLE,           /* no_table: no state table */
    NGX_HTTP_DPD_KVW_NO_RECORD,          /* no_record: no node record (or
                                            no id) for the decoder */
    NGX_HTTP_DPD_KVW_CLIENT_CLOSED,      /* client_closed: during the wait */
    NGX_HTTP_DPD_KVW_N
} ngx_http_dpd_kv_wait_e;


/* dpd_fallbacks_total{cause}: why a disaggregated request was decoded
 * without transferred KV: ngx_http_dpd_metrics_fallback() */
typedef enum {
    NGX_HTTP_DPD_FB_PREFILL_5XX = 0,     /* prefill_5xx */
    NGX_HTTP_DPD_FB_PREFILL_TIMEOUT,     /* prefill_timeout */
    NGX_HTTP_DPD_FB_PREFILL_CONNECT,     /* prefill_connect */
    NGX_HTTP_DPD_FB_PREFILL_BAD_REPLY,   /* prefill_bad_reply */
    NGX_HTTP_DPD_FB_NO_DECODER,          /* no_decoder: none to pin */
    NGX_HTTP_DPD_FB_NO_NODE,             /* no_node: kv_agent, no record */
    NGX_HTTP_DPD_FB_NO_KV_PARAMS,        /* no_kv_params: nixl reply had
                                            no kv_transfer_params */
    NGX_HTTP_DPD_FB_DECODE_MOVED,        /* decode_moved: the pinned
                                            decoder failed, another one
                                            recomputed */
    NGX_HTTP_DPD_FB_OTHER,               /* other */
    NGX_HTTP_DPD_FB_N
} ngx_http_dpd_fallback_e;


/* route label of the latency histograms: what was done (observe mode:
 * direct), the prefix cache's direct-because-cached apart */
#define NGX_HTTP_DPD_LR_DIRECT         0
#define NGX_HTTP_DPD_LR_DIRECT_CACHED  1
#define NGX_HTTP_DPD_LR_DISAGG         2
#define NGX_HTTP_DPD_LR_FALLBACK       3
#define NGX_HTTP_DPD_LR_N              4

/* model label values: slot 0 is "other", the rest dpd_model names */
#define NGX_HTTP_DPD_METRICS_MODELS    16

/* pools (dpd_balance upstreams) whose gauges a scrape shows */
#define NGX_HTTP_DPD_METRICS_POOL_PEERS  256


/* requests by route (label) and status class */
#define NGX_HTTP_DPD_MR_REJECTED   0    /* rejected before a decision */
#define NGX_HTTP_DPD_MR_DIRECT     1
#define NGX_HTTP_DPD_MR_DISAGG     2
#define NGX_HTTP_DPD_MR_FALLBACK   3
#define NGX_HTTP_DPD_MR_BYPASS     4
#define NGX_HTTP_DPD_MR_N          5

#define NGX_HTTP_DPD_STATUS_N      6    /* 1xx..5xx, other */

#define NGX_HTTP_DPD_HIST_BUCKETS  16   /* max finite buckets */


/* Safe from any worker, any time; a no-op without the zone. */
void ngx_http_dpd_metrics_inc(ngx_http_request_t *r, ngx_uint_t counter);
void ngx_http_dpd_metrics_add(ngx_http_request_t *r, ngx_uint_t counter,
    ngx_uint_t n);
void ngx_http_dpd_metrics_observe(ngx_http_request_t *r,
    ngx_uint_t histogram, double value);
void ngx_http_dpd_metrics_error(ngx_http_request_t *r, ngx_uint_t reason);

/* a request became route fallback, for this NGX_HTTP_DPD_FB_* cause */
void ngx_http_dpd_metrics_fallback(ngx_http_request_t *r, ngx_uint_t cause);

/* one kv_agent wait outcome; msec >= 0: a table wait that long ran (fed to
 * dpd_kv_wait_seconds), -1: no wait */
void ngx_http_dpd_metrics_kv_wait(ngx_http_request_t *r, ngx_uint_t outcome,
    ngx_msec_int_t msec);


#endif /* _NGX_HTTP_DPD_METRICS_H_INCLUDED_ */
