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
    NGX_HTTP_DPD_M_FALLBACKS,            /* disaggregated -> decode only */
    NGX_HTTP_DPD_M_KV_HANDOFF_PARAMS,    /* decode got kv_transfer_params */
    NGX_HTTP_DPD_M_KV_HANDOFF_NO_PARAMS, /* prefill reply had none */
    NGX_HTTP_DPD_M_KV_STRIPPED,          /* client kv_transfer_params cut */
    NGX_HTTP_DPD_M_N
} ngx_http_dpd_counter_e;


/* histograms: ngx_http_dpd_metrics_observe(), value in the base unit */
typedef enum {
    NGX_HTTP_DPD_H_PROMPT_TOKENS = 0,    /* tokens */
    NGX_HTTP_DPD_H_DECISION_SECONDS,     /* seconds: read+parse+count */
    NGX_HTTP_DPD_H_PREFILL_SECONDS,      /* seconds: prefill subrequest */
    NGX_HTTP_DPD_H_N
} ngx_http_dpd_histogram_e;


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
void ngx_http_dpd_metrics_observe(ngx_http_request_t *r,
    ngx_uint_t histogram, double value);
void ngx_http_dpd_metrics_error(ngx_http_request_t *r, ngx_uint_t reason);

const char *ngx_http_dpd_error_reason_name(ngx_uint_t reason);


#endif /* _NGX_HTTP_DPD_METRICS_H_INCLUDED_ */
