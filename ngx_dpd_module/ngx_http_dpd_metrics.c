/*
 * Metrics of ngx_http_dpd_module.
 *
 * One shared memory zone ("dpd_metrics", created when the module is
 * configured) holds fixed arrays of atomic counters: every worker adds to
 * them, the dpd_metrics handler renders them as Prometheus text.  The zone
 * survives reloads (same name, size and tag), so counters keep counting.
 * Histogram sums are kept as integers in the unit times a fixed scale
 * (seconds in microseconds), so atomic adds suffice.
 */


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "ngx_http_dpd_module.h"


#define NGX_HTTP_DPD_METRICS_MAGIC  0x64706431   /* "dpd1" */


typedef struct {
    ngx_atomic_t        bucket[NGX_HTTP_DPD_HIST_BUCKETS + 1]; /* +Inf */
    ngx_atomic_t        sum;                    /* value * scale */
    ngx_atomic_t        count;
} ngx_http_dpd_hist_t;


typedef struct {
    ngx_uint_t          magic;
    size_t              size;                   /* layout check on reload */
    ngx_atomic_t        requests[NGX_HTTP_DPD_MR_N][NGX_HTTP_DPD_STATUS_N];
    ngx_atomic_t        errors[NGX_HTTP_DPD_E_N];
    ngx_atomic_t        counters[NGX_HTTP_DPD_M_N];
    ngx_atomic_t        kv_wait[NGX_HTTP_DPD_KVW_N];
    ngx_http_dpd_hist_t hist[NGX_HTTP_DPD_H_N];
} ngx_http_dpd_metrics_t;


typedef struct {
    const char         *name;
    const char         *help;
    uint64_t            scale;                  /* integer units per unit */
    ngx_uint_t          nbuckets;
    const char         *le[NGX_HTTP_DPD_HIST_BUCKETS];
    uint64_t            bound[NGX_HTTP_DPD_HIST_BUCKETS]; /* scaled */
} ngx_http_dpd_hist_def_t;


static ngx_int_t ngx_http_dpd_metrics_init_zone(ngx_shm_zone_t *shm_zone,
    void *data);
static ngx_http_dpd_metrics_t *ngx_http_dpd_metrics_get(
    ngx_http_request_t *r);
static u_char *ngx_http_dpd_metrics_render(ngx_http_dpd_metrics_t *m,
    u_char *p);


static ngx_str_t  ngx_http_dpd_metrics_zone_name = ngx_string("dpd_metrics");


static const ngx_http_dpd_hist_def_t  ngx_http_dpd_hist_defs[] = {

    { "dpd_prompt_tokens",
      "Prompt tokens of routed requests, as counted by the gateway.",
      1, 15,
      { "8", "16", "32", "64", "128", "256", "512", "1024", "2048", "4096",
        "8192", "16384", "32768", "65536", "131072" },
      { 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
        8192, 16384, 32768, 65536, 131072 } },

    { "dpd_decision_seconds",
      "Time to read, parse and count a request before routing it.",
      1000000, 12,
      { "0.00005", "0.0001", "0.00025", "0.0005", "0.001", "0.0025",
        "0.005", "0.01", "0.025", "0.05", "0.1", "1" },
      { 50, 100, 250, 500, 1000, 2500,
        5000, 10000, 25000, 50000, 100000, 1000000 } },

    { "dpd_prefill_seconds",
      "Latency of prefill subrequests.",
      1000000, 12,
      { "0.01", "0.025", "0.05", "0.1", "0.25", "0.5",
        "1", "2.5", "5", "10", "30", "60" },
      { 10000, 25000, 50000, 100000, 250000, 500000,
        1000000, 2500000, 5000000, 10000000, 30000000, 60000000 } },

    { "dpd_kv_wait_seconds",
      "kv_agent: time from the prefill reply until the state table said "
      "ready or failed, or dpd_kv_wait passed.",
      1000000, 13,
      { "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1",
        "0.25", "0.5", "1", "2.5", "5", "10" },
      { 1000, 2500, 5000, 10000, 25000, 50000, 100000,
        250000, 500000, 1000000, 2500000, 5000000, 10000000 } }
};


static const char  *ngx_http_dpd_kv_wait_labels[NGX_HTTP_DPD_KVW_N] = {
    "ready", "failed", "timeout", "not_pushed", "no_table", "no_record",
    "client_closed"
};


static const char  *ngx_http_dpd_route_labels[NGX_HTTP_DPD_MR_N] = {
    "rejected", "direct", "disaggregated", "fallback", "bypass"
};

static const char  *ngx_http_dpd_status_labels[NGX_HTTP_DPD_STATUS_N] = {
    "1xx", "2xx", "3xx", "4xx", "5xx", "other"
};

static const char  *ngx_http_dpd_error_labels[NGX_HTTP_DPD_E_N] = {
    "none", "empty_body", "malformed_json", "invalid_utf8", "too_deep",
    "invalid_field", "token_out_of_range", "body_too_large", "body_read",
    "internal", "duplicate_key", "nul_character", "over_limit",
    "unknown_model"
};

static const char  *ngx_http_dpd_retry_labels[] = {
    "ok", "failed", "no_decoder", "client_closed"
};

static const char  *ngx_http_dpd_failure_labels[] = {
    "status_5xx", "status_4xx", "timeout", "connect", "bad_reply"
};


ngx_int_t
ngx_http_dpd_metrics_init_zone_conf(ngx_conf_t *cf,
    ngx_http_dpd_main_conf_t *dmcf)
{
    size_t  size;

    /* the counters, the slab pool's own pages, and room to spare */

    size = ngx_align(sizeof(ngx_http_dpd_metrics_t), ngx_pagesize)
           + 8 * ngx_pagesize;

    dmcf->metrics_zone = ngx_shared_memory_add(cf,
                                             &ngx_http_dpd_metrics_zone_name,
                                             size, &ngx_http_dpd_module);
    if (dmcf->metrics_zone == NULL) {
        return NGX_ERROR;
    }

    dmcf->metrics_zone->init = ngx_http_dpd_metrics_init_zone;
    dmcf->metrics_zone->data = NULL;

    return NGX_OK;
}


static ngx_int_t
ngx_http_dpd_metrics_init_zone(ngx_shm_zone_t *shm_zone, void *data)
{
    ngx_slab_pool_t         *shpool;
    ngx_http_dpd_metrics_t  *m, *old = data;

    if (old
        && old->magic == NGX_HTTP_DPD_METRICS_MAGIC
        && old->size == sizeof(ngx_http_dpd_metrics_t))
    {
        /* reload: keep counting where the old cycle left off */
        shm_zone->data = old;
        return NGX_OK;
    }

    shpool = (ngx_slab_pool_t *) shm_zone->shm.addr;

    if (shm_zone->shm.exists) {
        shm_zone->data = shpool->data;
        return NGX_OK;
    }

    m = ngx_slab_calloc(shpool, sizeof(ngx_http_dpd_metrics_t));
    if (m == NULL) {
        return NGX_ERROR;
    }

    m->magic = NGX_HTTP_DPD_METRICS_MAGIC;
    m->size = sizeof(ngx_http_dpd_metrics_t);

    shpool->data = m;
    shm_zone->data = m;

    return NGX_OK;
}


static ngx_http_dpd_metrics_t *
ngx_http_dpd_metrics_get(ngx_http_request_t *r)
{
    ngx_http_dpd_main_conf_t  *dmcf;

    if (r == NULL) {
        return NULL;
    }

    dmcf = ngx_http_get_module_main_conf(r, ngx_http_dpd_module);

    if (dmcf == NULL || dmcf->metrics_zone == NULL) {
        return NULL;
    }

    return dmcf->metrics_zone->data;
}


void
ngx_http_dpd_metrics_inc(ngx_http_request_t *r, ngx_uint_t counter)
{
    ngx_http_dpd_metrics_t  *m;

    m = ngx_http_dpd_metrics_get(r);

    if (m == NULL || counter >= NGX_HTTP_DPD_M_N) {
        return;
    }

    (void) ngx_atomic_fetch_add(&m->counters[counter], 1);
}


void
ngx_http_dpd_metrics_add(ngx_http_request_t *r, ngx_uint_t counter,
    ngx_uint_t n)
{
    ngx_http_dpd_metrics_t  *m;

    m = ngx_http_dpd_metrics_get(r);

    if (m == NULL || counter >= NGX_HTTP_DPD_M_N) {
        return;
    }

    (void) ngx_atomic_fetch_add(&m->counters[counter], n);
}


void
ngx_http_dpd_metrics_error(ngx_http_request_t *r, ngx_uint_t reason)
{
    ngx_http_dpd_metrics_t  *m;

    m = ngx_http_dpd_metrics_get(r);

    if (m == NULL || reason == NGX_HTTP_DPD_E_NONE
        || reason >= NGX_HTTP_DPD_E_N)
    {
        return;
    }

    (void) ngx_atomic_fetch_add(&m->errors[reason], 1);
}


void
ngx_http_dpd_metrics_observe(ngx_http_request_t *r, ngx_uint_t histogram,
    double value)
{
    uint64_t                        v;
    ngx_uint_t                      i;
    ngx_http_dpd_hist_t            *h;
    ngx_http_dpd_metrics_t         *m;
    const ngx_http_dpd_hist_def_t  *def;

    m = ngx_http_dpd_metrics_get(r);

    if (m == NULL || histogram >= NGX_HTTP_DPD_H_N) {
        return;
    }

    def = &ngx_http_dpd_hist_defs[histogram];
    h = &m->hist[histogram];

    if (!(value > 0)) {             /* negative or NaN */
        value = 0;
    }

    if (value > 1e12) {
        value = 1e12;
    }

    v = (uint64_t) (value * (double) def->scale + 0.5);

    for (i = 0; i < def->nbuckets; i++) {
        if (v <= def->bound[i]) {
            break;
        }
    }

    /* i == nbuckets: only +Inf */

    (void) ngx_atomic_fetch_add(&h->bucket[i], 1);
    (void) ngx_atomic_fetch_add(&h->sum, (ngx_atomic_int_t) v);
    (void) ngx_atomic_fetch_add(&h->count, 1);
}


void
ngx_http_dpd_metrics_log_request(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx)
{
    ngx_uint_t               status, cls, route, reason;
    ngx_http_dpd_metrics_t  *m;

    m = ngx_http_dpd_metrics_get(r);
    if (m == NULL) {
        return;
    }

    if (ctx) {
        if (ctx->logged) {
            return;
        }

        ctx->logged = 1;
    }

    status = r->err_status ? r->err_status : r->headers_out.status;

    cls = (status >= 100 && status < 600) ? status / 100 - 1
                                          : NGX_HTTP_DPD_STATUS_N - 1;

    if (ctx == NULL) {
        route = (status >= NGX_HTTP_BAD_REQUEST) ? NGX_HTTP_DPD_MR_REJECTED
                                                 : NGX_HTTP_DPD_MR_BYPASS;
        reason = NGX_HTTP_DPD_E_NONE;

    } else {
        switch (ctx->route) {
        case NGX_HTTP_DPD_ROUTE_DIRECT:
            route = NGX_HTTP_DPD_MR_DIRECT;
            break;
        case NGX_HTTP_DPD_ROUTE_DISAGGREGATED:
            route = NGX_HTTP_DPD_MR_DISAGG;
            break;
        case NGX_HTTP_DPD_ROUTE_FALLBACK:
            route = NGX_HTTP_DPD_MR_FALLBACK;
            break;
        case NGX_HTTP_DPD_ROUTE_BYPASS:
            route = NGX_HTTP_DPD_MR_BYPASS;
            break;
        default:
            route = NGX_HTTP_DPD_MR_REJECTED;
        }

        reason = ctx->err_reason;

        if (ctx->timed && ctx->err_status == 0
            && (ctx->prompt_tokens >= 0 || ctx->count_skipped))
        {
            /* a request routed on its bound alone has no count to add */
            if (ctx->count_skipped) {
                ngx_http_dpd_metrics_inc(r, NGX_HTTP_DPD_M_COUNT_SKIPPED);

            } else {
                ngx_http_dpd_metrics_observe(r,
                                             NGX_HTTP_DPD_H_PROMPT_TOKENS,
                                             (double) ctx->prompt_tokens);
            }

            ngx_http_dpd_metrics_observe(r, NGX_HTTP_DPD_H_DECISION_SECONDS,
                                         (double) ctx->decision_usec / 1e6);
        }
    }

    if (reason == NGX_HTTP_DPD_E_NONE
        && status == NGX_HTTP_REQUEST_ENTITY_TOO_LARGE)
    {
        reason = NGX_HTTP_DPD_E_BODY_TOO_LARGE;
    }

    (void) ngx_atomic_fetch_add(&m->requests[route][cls], 1);

    ngx_http_dpd_metrics_error(r, reason);
}


ngx_int_t
ngx_http_dpd_metrics_handler(ngx_http_request_t *r)
{
    size_t                   size;
    u_char                  *p;
    ngx_int_t                rc;
    ngx_buf_t               *b;
    ngx_chain_t              out;
    ngx_http_dpd_metrics_t  *m;

    if (!(r->method & (NGX_HTTP_GET|NGX_HTTP_HEAD))) {
        return NGX_HTTP_NOT_ALLOWED;
    }

    rc = ngx_http_discard_request_body(r);
    if (rc != NGX_OK) {
        return rc;
    }

    m = ngx_http_dpd_metrics_get(r);
    if (m == NULL) {
        return NGX_HTTP_SERVICE_UNAVAILABLE;
    }

    /* generous: every series line is well under 160 bytes */

    size = 8192
           + 160 * (NGX_HTTP_DPD_MR_N * NGX_HTTP_DPD_STATUS_N
                    + NGX_HTTP_DPD_E_N + NGX_HTTP_DPD_M_N
                    + NGX_HTTP_DPD_KVW_N
                    + NGX_HTTP_DPD_H_N * (NGX_HTTP_DPD_HIST_BUCKETS + 4));

    b = ngx_create_temp_buf(r->pool, size);
    if (b == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    p = ngx_http_dpd_metrics_render(m, b->last);
    b->last = p;

    r->headers_out.status = NGX_HTTP_OK;
    r->headers_out.content_length_n = b->last - b->pos;
    ngx_str_set(&r->headers_out.content_type,
                "text/plain; version=0.0.4; charset=utf-8");
    r->headers_out.content_type_len = sizeof("text/plain") - 1;
    r->headers_out.content_type_lowcase = NULL;

    rc = ngx_http_send_header(r);

    if (rc == NGX_ERROR || rc > NGX_OK || r->header_only) {
        return rc;
    }

    b->last_buf = (r == r->main) ? 1 : 0;
    b->last_in_chain = 1;

    out.buf = b;
    out.next = NULL;

    return ngx_http_output_filter(r, &out);
}


static u_char *
ngx_http_dpd_metrics_sum(u_char *p, uint64_t sum, uint64_t scale)
{
    if (scale == 1) {
        return ngx_sprintf(p, "%uL", sum);
    }

    /* scale 1000000 */
    return ngx_sprintf(p, "%uL.%06uL", sum / scale, sum % scale);
}


static u_char *
ngx_http_dpd_metrics_render(ngx_http_dpd_metrics_t *m, u_char *p)
{
    uint64_t                        cum;
    ngx_uint_t                      i, j;
    ngx_http_dpd_hist_t            *h;
    const ngx_http_dpd_hist_def_t  *def;

    p = ngx_sprintf(p,
            "# HELP dpd_requests_total Requests in dpd locations, by route "
            "and status class.\n"
            "# TYPE dpd_requests_total counter\n");

    for (i = 0; i < NGX_HTTP_DPD_MR_N; i++) {
        for (j = 0; j < NGX_HTTP_DPD_STATUS_N; j++) {
            p = ngx_sprintf(p,
                            "dpd_requests_total{route=\"%s\",status=\"%s\"}"
                            " %uA\n",
                            ngx_http_dpd_route_labels[i],
                            ngx_http_dpd_status_labels[j],
                            m->requests[i][j]);
        }
    }

    p = ngx_sprintf(p,
            "# HELP dpd_errors_total Requests rejected, by error type.\n"
            "# TYPE dpd_errors_total counter\n");

    for (i = 1; i < NGX_HTTP_DPD_E_N; i++) {
        p = ngx_sprintf(p, "dpd_errors_total{type=\"%s\"} %uA\n",
                        ngx_http_dpd_error_labels[i], m->errors[i]);
    }

    for (i = 0; i < NGX_HTTP_DPD_H_N; i++) {
        def = &ngx_http_dpd_hist_defs[i];
        h = &m->hist[i];

        p = ngx_sprintf(p, "# HELP %s %s\n# TYPE %s histogram\n",
                        def->name, def->help, def->name);

        cum = 0;

        for (j = 0; j < def->nbuckets; j++) {
            cum += h->bucket[j];
            p = ngx_sprintf(p, "%s_bucket{le=\"%s\"} %uL\n",
                            def->name, def->le[j], cum);
        }

        cum += h->bucket[def->nbuckets];

        p = ngx_sprintf(p, "%s_bucket{le=\"+Inf\"} %uL\n%s_sum ",
                        def->name, cum, def->name);
        p = ngx_http_dpd_metrics_sum(p, h->sum, def->scale);
        p = ngx_sprintf(p, "\n%s_count %uL\n", def->name, cum);
    }

    p = ngx_sprintf(p,
            "# HELP dpd_prefill_requests_total Prefill subrequests sent.\n"
            "# TYPE dpd_prefill_requests_total counter\n"
            "dpd_prefill_requests_total %uA\n",
            m->counters[NGX_HTTP_DPD_M_PREFILL_REQUESTS]);

    p = ngx_sprintf(p,
            "# HELP dpd_prefill_failures_total Failed prefill subrequests, "
            "by cause.\n"
            "# TYPE dpd_prefill_failures_total counter\n");

    for (i = 0; i < 5; i++) {
        p = ngx_sprintf(p, "dpd_prefill_failures_total{cause=\"%s\"} %uA\n",
                        ngx_http_dpd_failure_labels[i],
                        m->counters[NGX_HTTP_DPD_M_PREFILL_FAIL_5XX + i]);
    }

    p = ngx_sprintf(p,
            "# HELP dpd_fallbacks_total Disaggregated requests sent to a "
            "decoder without KV.\n"
            "# TYPE dpd_fallbacks_total counter\n"
            "dpd_fallbacks_total %uA\n"
            "# HELP dpd_kv_handoffs_total Decode requests after a prefill, "
            "by presence of kv_transfer_params.\n"
            "# TYPE dpd_kv_handoffs_total counter\n"
            "dpd_kv_handoffs_total{transfer_params=\"yes\"} %uA\n"
            "dpd_kv_handoffs_total{transfer_params=\"no\"} %uA\n"
            "# HELP dpd_client_kv_params_removed_total Client-supplied "
            "kv_transfer_params removed.\n"
            "# TYPE dpd_client_kv_params_removed_total counter\n"
            "dpd_client_kv_params_removed_total %uA\n"
            "# HELP dpd_count_skipped_total Requests routed direct on their "
            "byte bound alone (dpd_count bound), without a token count.\n"
            "# TYPE dpd_count_skipped_total counter\n"
            "dpd_count_skipped_total %uA\n",
            m->counters[NGX_HTTP_DPD_M_FALLBACKS],
            m->counters[NGX_HTTP_DPD_M_KV_HANDOFF_PARAMS],
            m->counters[NGX_HTTP_DPD_M_KV_HANDOFF_NO_PARAMS],
            m->counters[NGX_HTTP_DPD_M_KV_STRIPPED],
            m->counters[NGX_HTTP_DPD_M_COUNT_SKIPPED]);

    p = ngx_sprintf(p,
            "# HELP dpd_decode_retries_total Decode requests sent to another "
            "decoder after one failed before answering, by how that try "
            "ended.\n"
            "# TYPE dpd_decode_retries_total counter\n");

    for (i = 0; i < 4; i++) {
        p = ngx_sprintf(p, "dpd_decode_retries_total{outcome=\"%s\"} %uA\n",
                        ngx_http_dpd_retry_labels[i],
                        m->counters[NGX_HTTP_DPD_M_DECODE_RETRY_OK + i]);
    }

    p = ngx_sprintf(p,
            "# HELP dpd_prefix_lookups_total Prefix-cache lookups "
            "(dpd_prefix_cache), and those that found cached blocks on "
            "the chosen decoder.\n"
            "# TYPE dpd_prefix_lookups_total counter\n"
            "dpd_prefix_lookups_total{result=\"all\"} %uA\n"
            "dpd_prefix_lookups_total{result=\"hit\"} %uA\n"
            "# HELP dpd_prefix_cached_tokens_total Prompt tokens the chosen "
            "decoder held, by the index.\n"
            "# TYPE dpd_prefix_cached_tokens_total counter\n"
            "dpd_prefix_cached_tokens_total %uA\n"
            "# HELP dpd_prefix_routes_total Routes decided with the prefix "
            "cache, by reason.\n"
            "# TYPE dpd_prefix_routes_total counter\n"
            "dpd_prefix_routes_total{reason=\"direct_short\"} %uA\n"
            "dpd_prefix_routes_total{reason=\"direct_cached\"} %uA\n"
            "dpd_prefix_routes_total{reason=\"disaggregated\"} %uA\n"
            "# HELP dpd_prefix_imbalanced_total Decisions where the load "
            "guard chose the least loaded decoder over the cache.\n"
            "# TYPE dpd_prefix_imbalanced_total counter\n"
            "dpd_prefix_imbalanced_total %uA\n",
            m->counters[NGX_HTTP_DPD_M_PREFIX_LOOKUPS],
            m->counters[NGX_HTTP_DPD_M_PREFIX_HITS],
            m->counters[NGX_HTTP_DPD_M_PREFIX_CACHED_TOKENS],
            m->counters[NGX_HTTP_DPD_M_PREFIX_ROUTE_SHORT],
            m->counters[NGX_HTTP_DPD_M_PREFIX_ROUTE_CACHED],
            m->counters[NGX_HTTP_DPD_M_PREFIX_ROUTE_DISAGG],
            m->counters[NGX_HTTP_DPD_M_PREFIX_IMBALANCED]);

    p = ngx_sprintf(p,
            "# HELP dpd_kv_wait_total kv_agent handoffs, by how the wait "
            "for the KV ended.\n"
            "# TYPE dpd_kv_wait_total counter\n");

    for (i = 0; i < NGX_HTTP_DPD_KVW_N; i++) {
        p = ngx_sprintf(p, "dpd_kv_wait_total{outcome=\"%s\"} %uA\n",
                        ngx_http_dpd_kv_wait_labels[i], m->kv_wait[i]);
    }

    return p;
}


void
ngx_http_dpd_metrics_kv_wait(ngx_http_request_t *r, ngx_uint_t outcome,
    ngx_msec_int_t msec)
{
    ngx_http_dpd_metrics_t  *m;

    m = ngx_http_dpd_metrics_get(r);

    if (m == NULL || outcome >= NGX_HTTP_DPD_KVW_N) {
        return;
    }

    (void) ngx_atomic_fetch_add(&m->kv_wait[outcome], 1);

    if (msec >= 0) {
        ngx_http_dpd_metrics_observe(r, NGX_HTTP_DPD_H_KV_WAIT_SECONDS,
                                     (double) msec / 1000);
    }
}
