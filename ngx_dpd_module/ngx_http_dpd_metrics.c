/*
 * Metrics of ngx_http_dpd_module.
 *
 * One shared memory zone ("dpd_metrics", created when the module is
 * configured) holds fixed arrays of atomic counters: every worker adds to
 * them, the dpd_metrics handler renders them as Prometheus text.  The zone
 * survives reloads (same name, size and tag), so counters keep counting.
 * Histogram sums are kept as integers in the unit times a fixed scale
 * (seconds in microseconds), so atomic adds suffice.
 *
 * Label sets are bounded by construction: routes, causes and protocols are
 * fixed lists; "model" takes the dpd_model names of the configuration
 * (slots in the zone, given at configuration time, kept across reloads),
 * anything else is "other", never the client's string; "pool" is the name
 * of an upstream{} with dpd_balance, read at scrape time.
 */


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "ngx_http_dpd_module.h"
#include "ngx_http_dpd_balancer.h"


#define NGX_HTTP_DPD_METRICS_MAGIC  0x64706432   /* "dpd2" */

/* label "protocol" of dpd_kv_transfer_seconds: NGX_HTTP_DPD_PROTO_* - 1 */
#define NGX_HTTP_DPD_METRICS_PROTOS  3


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
    ngx_atomic_t        fallbacks[NGX_HTTP_DPD_FB_N];
    ngx_atomic_t        observe[2];             /* direct, disaggregated */
    ngx_http_dpd_hist_t hist[NGX_HTTP_DPD_H_N];

    /* by route (NGX_HTTP_DPD_LR_*) and model slot */
    ngx_http_dpd_hist_t ttft[NGX_HTTP_DPD_LR_N][NGX_HTTP_DPD_METRICS_MODELS];
    ngx_http_dpd_hist_t e2e[NGX_HTTP_DPD_LR_N][NGX_HTTP_DPD_METRICS_MODELS];
    ngx_http_dpd_hist_t kv_transfer[NGX_HTTP_DPD_METRICS_PROTOS];

    /* the model label of each slot (0: "other", no name); written by the
     * master at configuration time only, a slot never changes its name */
    ngx_atomic_t        model_len[NGX_HTTP_DPD_METRICS_MODELS];
    u_char              model[NGX_HTTP_DPD_METRICS_MODELS]
                             [NGX_HTTP_DPD_MODEL_LEN];
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
static u_char *ngx_http_dpd_metrics_render_latency(ngx_http_dpd_metrics_t *m,
    u_char *p);
static u_char *ngx_http_dpd_metrics_render_pools(ngx_http_request_t *r,
    u_char *p, u_char *last);
static size_t ngx_http_dpd_metrics_pools_size(ngx_http_request_t *r);
static void ngx_http_dpd_metrics_hist_add(ngx_http_dpd_hist_t *h,
    const ngx_http_dpd_hist_def_t *def, double value);
static u_char *ngx_http_dpd_metrics_hist_lines(u_char *p,
    const ngx_http_dpd_hist_def_t *def, ngx_http_dpd_hist_t *h,
    u_char *lab, size_t len);
static u_char *ngx_http_dpd_metrics_escape(u_char *p, u_char *s, size_t len);
static void ngx_http_dpd_metrics_models(ngx_log_t *log,
    ngx_http_dpd_main_conf_t *dmcf, ngx_http_dpd_metrics_t *m);
static ngx_int_t ngx_http_dpd_metrics_body_filter(ngx_http_request_t *r,
    ngx_chain_t *in);
static ngx_uint_t ngx_http_dpd_metrics_nixl(ngx_http_request_t *r);


static ngx_http_output_body_filter_pt  ngx_http_next_body_filter;


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
      "kv_agent, lmcache: time from the prefill reply until the KV was "
      "said ready or failed, or dpd_kv_wait passed.",
      1000000, 13,
      { "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1",
        "0.25", "0.5", "1", "2.5", "5", "10" },
      { 1000, 2500, 5000, 10000, 25000, 50000, 100000,
        250000, 500000, 1000000, 2500000, 5000000, 10000000 } }
};


/*
 * The labelled histograms.  Buckets for LLM serving: a short prompt's
 * first token in milliseconds, a long prompt queued behind others in
 * minutes; a whole request (generation included) up to 20 minutes.
 */

static const ngx_http_dpd_hist_def_t  ngx_http_dpd_ttft_def =

    { "dpd_ttft_seconds",
      "Time to first token: from the gateway's first look at the request "
      "to the first byte of a streamed 200 response, by route and model.",
      1000000, 15,
      { "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5",
        "1", "2.5", "5", "10", "30", "60", "120", "300" },
      { 5000, 10000, 25000, 50000, 100000, 250000, 500000,
        1000000, 2500000, 5000000, 10000000, 30000000, 60000000,
        120000000, 300000000 } };

static const ngx_http_dpd_hist_def_t  ngx_http_dpd_e2e_def =

    { "dpd_request_duration_seconds",
      "End-to-end latency of routed requests, from the gateway's first "
      "look at the request to its log phase, by route and model.",
      1000000, 15,
      { "0.05", "0.1", "0.25", "0.5", "1", "2.5", "5",
        "10", "20", "30", "60", "120", "300", "600", "1200" },
      { 50000, 100000, 250000, 500000, 1000000, 2500000, 5000000,
        10000000, 20000000, 30000000, 60000000, 120000000, 300000000,
        600000000, 1200000000 } };

static const ngx_http_dpd_hist_def_t  ngx_http_dpd_kv_transfer_def =

    { "dpd_kv_transfer_seconds",
      "KV hand-off time of disaggregated requests: lmcache and kv_agent "
      "the wait until the KV was ready on the decoder; nixl (the decoder "
      "pulls) the decode leg's first-byte latency, KV pull + first token.",
      1000000, 14,
      { "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1",
        "0.25", "0.5", "1", "2.5", "5", "10", "30" },
      { 1000, 2500, 5000, 10000, 25000, 50000, 100000,
        250000, 500000, 1000000, 2500000, 5000000, 10000000,
        30000000 } };


static const char  *ngx_http_dpd_lroute_labels[NGX_HTTP_DPD_LR_N] = {
    "direct", "direct_cached", "disaggregated", "fallback"
};

static const char  *ngx_http_dpd_proto_labels[NGX_HTTP_DPD_METRICS_PROTOS] = {
    "nixl", "lmcache", "kv_agent"
};

static const char  *ngx_http_dpd_fallback_labels[NGX_HTTP_DPD_FB_N] = {
    "prefill_5xx", "prefill_timeout", "prefill_connect", "prefill_bad_reply",
    "no_decoder", "no_node", "no_kv_params", "decode_moved", "other"
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

    /* the configuration: its model names get their slots at zone init */

    dmcf->metrics_zone->init = ngx_http_dpd_metrics_init_zone;
    dmcf->metrics_zone->data = dmcf;

    /* the first body byte of a response: time to first token */

    ngx_http_next_body_filter = ngx_http_top_body_filter;
    ngx_http_top_body_filter = ngx_http_dpd_metrics_body_filter;

    return NGX_OK;
}


/*
 * shm_zone->data is this cycle's main conf, data the old cycle's (on a
 * reload): its counters are ours when the layout is the same.
 */

static ngx_int_t
ngx_http_dpd_metrics_init_zone(ngx_shm_zone_t *shm_zone, void *data)
{
    ngx_http_dpd_main_conf_t *dmcf = shm_zone->data;
    ngx_http_dpd_main_conf_t *odmcf = data;

    ngx_slab_pool_t         *shpool;
    ngx_http_dpd_metrics_t  *m, *old;

    old = odmcf ? odmcf->metrics : NULL;

    if (old
        && old->magic == NGX_HTTP_DPD_METRICS_MAGIC
        && old->size == sizeof(ngx_http_dpd_metrics_t))
    {
        /* reload: keep counting where the old cycle left off */
        m = old;
        goto done;
    }

    shpool = (ngx_slab_pool_t *) shm_zone->shm.addr;

    if (shm_zone->shm.exists) {
        m = shpool->data;
        goto done;
    }

    m = ngx_slab_calloc(shpool, sizeof(ngx_http_dpd_metrics_t));
    if (m == NULL) {
        return NGX_ERROR;
    }

    m->magic = NGX_HTTP_DPD_METRICS_MAGIC;
    m->size = sizeof(ngx_http_dpd_metrics_t);

    shpool->data = m;

done:

    dmcf->metrics = m;

    ngx_http_dpd_metrics_models(shm_zone->shm.log, dmcf, m);

    return NGX_OK;
}


/*
 * Each dpd_model NAME (not "*") gets the slot that already carries its
 * name (a reload), else a free one; when all are taken, "other".  Slots
 * are never emptied while the zone lives, so a series keeps its meaning.
 */

static void
ngx_http_dpd_metrics_models(ngx_log_t *log, ngx_http_dpd_main_conf_t *dmcf,
    ngx_http_dpd_metrics_t *m)
{
    ngx_uint_t                 i, k, s, free;
    ngx_http_dpd_model_t      *e;
    ngx_http_dpd_loc_conf_t  **lp;

    lp = dmcf->model_locs.elts;

    for (i = 0; i < dmcf->model_locs.nelts; i++) {

        e = lp[i]->models->elts;

        for (k = 0; k < lp[i]->models->nelts; k++) {

            e[k].metrics_slot = 0;

            if (k == lp[i]->model_default) {
                continue;
            }

            if (e[k].name.len > NGX_HTTP_DPD_MODEL_LEN) {
                ngx_log_error(NGX_LOG_WARN, log, 0,
                              "dpd_metrics: model name \"%V\" longer than "
                              "%d bytes, counted as model=\"other\"",
                              &e[k].name, NGX_HTTP_DPD_MODEL_LEN);
                continue;
            }

            free = 0;

            for (s = 1; s < NGX_HTTP_DPD_METRICS_MODELS; s++) {

                if (m->model_len[s] == 0) {
                    if (free == 0) {
                        free = s;
                    }

                    continue;
                }

                if (m->model_len[s] == e[k].name.len
                    && ngx_memcmp(m->model[s], e[k].name.data,
                                  e[k].name.len) == 0)
                {
                    break;
                }
            }

            if (s < NGX_HTTP_DPD_METRICS_MODELS) {
                e[k].metrics_slot = s;
                continue;
            }

            if (free == 0) {
                ngx_log_error(NGX_LOG_WARN, log, 0,
                              "dpd_metrics: more than %d model names since "
                              "the start, \"%V\" is counted as "
                              "model=\"other\"",
                              NGX_HTTP_DPD_METRICS_MODELS - 1, &e[k].name);
                continue;
            }

            /* the name before its length: a scrape in an old worker sees
             * the slot empty or whole */

            ngx_memcpy(m->model[free], e[k].name.data, e[k].name.len);
            ngx_memory_barrier();
            m->model_len[free] = e[k].name.len;

            e[k].metrics_slot = free;
        }
    }
}


static ngx_http_dpd_metrics_t *
ngx_http_dpd_metrics_get(ngx_http_request_t *r)
{
    ngx_http_dpd_main_conf_t  *dmcf;

    if (r == NULL) {
        return NULL;
    }

    dmcf = ngx_http_get_module_main_conf(r, ngx_http_dpd_module);

    if (dmcf == NULL) {
        return NULL;
    }

    return dmcf->metrics;
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
    ngx_http_dpd_metrics_t  *m;

    m = ngx_http_dpd_metrics_get(r);

    if (m == NULL || histogram >= NGX_HTTP_DPD_H_N) {
        return;
    }

    ngx_http_dpd_metrics_hist_add(&m->hist[histogram],
                                  &ngx_http_dpd_hist_defs[histogram], value);
}


static void
ngx_http_dpd_metrics_hist_add(ngx_http_dpd_hist_t *h,
    const ngx_http_dpd_hist_def_t *def, double value)
{
    uint64_t    v;
    ngx_uint_t  i;

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
    uint64_t                 now;
    ngx_uint_t               status, cls, route, reason, lr, slot;
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

        /*
         * latency by what was done: observe mode sends every request
         * direct (its decisions are counted apart), and a direct route
         * the prefix cache chose for the cached blocks is its own
         */

        lr = NGX_HTTP_DPD_LR_N;

        switch (ctx->route) {
        case NGX_HTTP_DPD_ROUTE_DIRECT:
        case NGX_HTTP_DPD_ROUTE_DISAGGREGATED:
            if (ctx->observe) {
                (void) ngx_atomic_fetch_add(&m->observe[
                        ctx->route == NGX_HTTP_DPD_ROUTE_DISAGGREGATED], 1);
            }

            if (ctx->route == NGX_HTTP_DPD_ROUTE_DISAGGREGATED
                && !ctx->observe)
            {
                lr = NGX_HTTP_DPD_LR_DISAGG;

            } else if (ctx->prefix_reason == NGX_HTTP_DPD_PR_CACHED) {
                lr = NGX_HTTP_DPD_LR_DIRECT_CACHED;

            } else {
                lr = NGX_HTTP_DPD_LR_DIRECT;
            }

            break;

        case NGX_HTTP_DPD_ROUTE_FALLBACK:
            lr = NGX_HTTP_DPD_LR_FALLBACK;
            break;
        }

        if (lr != NGX_HTTP_DPD_LR_N) {
            slot = ctx->model ? ctx->model->metrics_slot : 0;
            now = ngx_http_dpd_now_usec();

            ngx_http_dpd_metrics_hist_add(&m->e2e[lr][slot],
                                          &ngx_http_dpd_e2e_def,
                                 (double) (now - ctx->start_usec) / 1e6);

            if (ctx->first_usec) {
                ngx_http_dpd_metrics_hist_add(&m->ttft[lr][slot],
                                              &ngx_http_dpd_ttft_def,
                        (double) (ctx->first_usec - ctx->start_usec) / 1e6);
            }
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
    size_t                   size, n;
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

    /* generous: every unlabelled series line is well under 160 bytes, a
     * labelled one under 160 + its escaped model name */

    size = 8192
           + 160 * (NGX_HTTP_DPD_MR_N * NGX_HTTP_DPD_STATUS_N
                    + NGX_HTTP_DPD_E_N + NGX_HTTP_DPD_M_N
                    + NGX_HTTP_DPD_KVW_N + NGX_HTTP_DPD_FB_N
                    + (NGX_HTTP_DPD_H_N + NGX_HTTP_DPD_METRICS_PROTOS)
                      * (NGX_HTTP_DPD_HIST_BUCKETS + 4))
           + (160 + 2 * NGX_HTTP_DPD_MODEL_LEN)
             * 2 * NGX_HTTP_DPD_LR_N * NGX_HTTP_DPD_METRICS_MODELS
             * (NGX_HTTP_DPD_HIST_BUCKETS + 4);

    n = size;
    size += ngx_http_dpd_metrics_pools_size(r);

    b = ngx_create_temp_buf(r->pool, size);
    if (b == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    p = ngx_http_dpd_metrics_render(m, b->last);
    p = ngx_http_dpd_metrics_render_latency(m, p);

    if ((size_t) (p - b->start) > n) {
        ngx_log_error(NGX_LOG_ALERT, r->connection->log, 0,
                      "dpd_metrics: output larger than its buffer");
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    p = ngx_http_dpd_metrics_render_pools(r, p, b->end);
    if (p == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

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

        p = ngx_http_dpd_metrics_hist_lines(p, def, h, NULL, 0);
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
            "decoder without KV, by cause.\n"
            "# TYPE dpd_fallbacks_total counter\n");

    for (i = 0; i < NGX_HTTP_DPD_FB_N; i++) {
        p = ngx_sprintf(p, "dpd_fallbacks_total{cause=\"%s\"} %uA\n",
                        ngx_http_dpd_fallback_labels[i], m->fallbacks[i]);
    }

    p = ngx_sprintf(p,
            "# HELP dpd_observe_decisions_total Decisions made in observe "
            "mode (no dpd_prefill_pass: every request went direct), by the "
            "route decided.\n"
            "# TYPE dpd_observe_decisions_total counter\n"
            "dpd_observe_decisions_total{route=\"direct\"} %uA\n"
            "dpd_observe_decisions_total{route=\"disaggregated\"} %uA\n",
            m->observe[0], m->observe[1]);

    p = ngx_sprintf(p,
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
            "(dpd_prefix_cache), those that found cached blocks on the "
            "chosen decoder, and those in an index whose writer is gone "
            "(stale: nothing counted as cached).\n"
            "# TYPE dpd_prefix_lookups_total counter\n"
            "dpd_prefix_lookups_total{result=\"all\"} %uA\n"
            "dpd_prefix_lookups_total{result=\"hit\"} %uA\n"
            "dpd_prefix_lookups_total{result=\"stale\"} %uA\n"
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
            m->counters[NGX_HTTP_DPD_M_PREFIX_STALE],
            m->counters[NGX_HTTP_DPD_M_PREFIX_CACHED_TOKENS],
            m->counters[NGX_HTTP_DPD_M_PREFIX_ROUTE_SHORT],
            m->counters[NGX_HTTP_DPD_M_PREFIX_ROUTE_CACHED],
            m->counters[NGX_HTTP_DPD_M_PREFIX_ROUTE_DISAGG],
            m->counters[NGX_HTTP_DPD_M_PREFIX_IMBALANCED]);

    p = ngx_sprintf(p,
            "# HELP dpd_kv_wait_total kv_agent and lmcache handoffs, by how "
            "the wait for the KV ended.\n"
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
    ngx_uint_t                proto;
    ngx_http_dpd_metrics_t   *m;
    ngx_http_dpd_loc_conf_t  *dlcf;

    m = ngx_http_dpd_metrics_get(r);

    if (m == NULL || outcome >= NGX_HTTP_DPD_KVW_N) {
        return;
    }

    (void) ngx_atomic_fetch_add(&m->kv_wait[outcome], 1);

    if (msec < 0) {
        return;
    }

    ngx_http_dpd_metrics_observe(r, NGX_HTTP_DPD_H_KV_WAIT_SECONDS,
                                 (double) msec / 1000);

    if (outcome != NGX_HTTP_DPD_KVW_READY) {
        return;
    }

    /* the KV landed: the protocol's transfer time (lmcache, kv_agent) */

    dlcf = ngx_http_get_module_loc_conf(r, ngx_http_dpd_module);
    proto = dlcf->prefill.protocol;

    if (proto >= 1 && proto <= NGX_HTTP_DPD_METRICS_PROTOS) {
        ngx_http_dpd_metrics_hist_add(&m->kv_transfer[proto - 1],
                                      &ngx_http_dpd_kv_transfer_def,
                                      (double) msec / 1000);
    }
}


void
ngx_http_dpd_metrics_fallback(ngx_http_request_t *r, ngx_uint_t cause)
{
    ngx_http_dpd_metrics_t  *m;

    m = ngx_http_dpd_metrics_get(r);

    if (m == NULL) {
        return;
    }

    if (cause >= NGX_HTTP_DPD_FB_N) {
        cause = NGX_HTTP_DPD_FB_OTHER;
    }

    (void) ngx_atomic_fetch_add(&m->fallbacks[cause], 1);
}


/*
 * The first byte of the main request's response body (streamed 2xx):
 * time to first token, and for nixl the decode leg's first-byte latency.
 * A check of two fields per body buffer once it is known.
 */

static ngx_int_t
ngx_http_dpd_metrics_body_filter(ngx_http_request_t *r, ngx_chain_t *in)
{
    uint64_t                 now;
    ngx_chain_t             *cl;
    ngx_http_dpd_ctx_t      *ctx;
    ngx_http_dpd_metrics_t  *m;

    if (in == NULL || r != r->main) {
        return ngx_http_next_body_filter(r, in);
    }

    ctx = ngx_http_get_module_ctx(r, ngx_http_dpd_module);

    if (ctx == NULL || ctx->first_usec || !ctx->stream
        || r->headers_out.status != NGX_HTTP_OK)
    {
        return ngx_http_next_body_filter(r, in);
    }

    for (cl = in; cl; cl = cl->next) {
        if (ngx_buf_size(cl->buf) > 0) {
            break;
        }
    }

    if (cl == NULL) {
        return ngx_http_next_body_filter(r, in);
    }

    now = ngx_http_dpd_now_usec();
    ctx->first_usec = now;

    /*
     * nixl: the decoder pulls the KV itself before its first token; from
     * here that is the time from the decode body's hand-off to proxy_pass
     * to the decoder's first byte (connect, the pull, the first step)
     */

    if (ctx->route == NGX_HTTP_DPD_ROUTE_DISAGGREGATED
        && ctx->prefill.params
        && ctx->decode_usec
        && ctx->prefill.proto
        && ngx_http_dpd_metrics_nixl(r))
    {
        m = ngx_http_dpd_metrics_get(r);

        if (m) {
            ngx_http_dpd_metrics_hist_add(
                &m->kv_transfer[NGX_HTTP_DPD_PROTO_NIXL - 1],
                &ngx_http_dpd_kv_transfer_def,
                (double) (now - ctx->decode_usec) / 1e6);
        }
    }

    return ngx_http_next_body_filter(r, in);
}


static ngx_uint_t
ngx_http_dpd_metrics_nixl(ngx_http_request_t *r)
{
    ngx_http_dpd_loc_conf_t  *dlcf;

    dlcf = ngx_http_get_module_loc_conf(r, ngx_http_dpd_module);

    return dlcf->prefill.protocol == NGX_HTTP_DPD_PROTO_NIXL;
}


/* a histogram's lines; lab: its other labels ("route=\"direct\"") */

static u_char *
ngx_http_dpd_metrics_hist_lines(u_char *p, const ngx_http_dpd_hist_def_t *def,
    ngx_http_dpd_hist_t *h, u_char *lab, size_t len)
{
    uint64_t    cum;
    ngx_uint_t  j;

    cum = 0;

    for (j = 0; j < def->nbuckets; j++) {
        cum += h->bucket[j];

        if (len) {
            p = ngx_sprintf(p, "%s_bucket{%*s,le=\"%s\"} %uL\n",
                            def->name, len, lab, def->le[j], cum);

        } else {
            p = ngx_sprintf(p, "%s_bucket{le=\"%s\"} %uL\n",
                            def->name, def->le[j], cum);
        }
    }

    cum += h->bucket[def->nbuckets];

    if (len) {
        p = ngx_sprintf(p, "%s_bucket{%*s,le=\"+Inf\"} %uL\n%s_sum{%*s} ",
                        def->name, len, lab, cum, def->name, len, lab);
        p = ngx_http_dpd_metrics_sum(p, h->sum, def->scale);
        return ngx_sprintf(p, "\n%s_count{%*s} %uL\n",
                           def->name, len, lab, cum);
    }

    p = ngx_sprintf(p, "%s_bucket{le=\"+Inf\"} %uL\n%s_sum ",
                    def->name, cum, def->name);
    p = ngx_http_dpd_metrics_sum(p, h->sum, def->scale);

    return ngx_sprintf(p, "\n%s_count %uL\n", def->name, cum);
}


/* a label value: backslash, double quote and newline escaped */

static u_char *
ngx_http_dpd_metrics_escape(u_char *p, u_char *s, size_t len)
{
    size_t  i;

    for (i = 0; i < len; i++) {
        switch (s[i]) {
        case '\\':
        case '"':
            *p++ = '\\';
            *p++ = s[i];
            break;
        case '\n':
            *p++ = '\\';
            *p++ = 'n';
            break;
        default:
            *p++ = s[i];
        }
    }

    return p;
}


/*
 * The latency histograms by route and model: every route, and every
 * model slot that has a name, "other" always.
 */

static u_char *
ngx_http_dpd_metrics_render_latency(ngx_http_dpd_metrics_t *m, u_char *p)
{
    size_t                          len;
    u_char                         *q;
    ngx_uint_t                      i, k, s;
    ngx_http_dpd_hist_t            *h;
    const ngx_http_dpd_hist_def_t  *def;
    u_char                          lab[64 + 2 * NGX_HTTP_DPD_MODEL_LEN];

    for (k = 0; k < 2; k++) {
        def = k ? &ngx_http_dpd_e2e_def : &ngx_http_dpd_ttft_def;

        p = ngx_sprintf(p, "# HELP %s %s\n# TYPE %s histogram\n",
                        def->name, def->help, def->name);

        for (i = 0; i < NGX_HTTP_DPD_LR_N; i++) {
            for (s = 0; s < NGX_HTTP_DPD_METRICS_MODELS; s++) {

                len = m->model_len[s];

                if (s && (len == 0 || len > NGX_HTTP_DPD_MODEL_LEN)) {
                    continue;
                }

                q = ngx_sprintf(lab, "route=\"%s\",model=\"",
                                ngx_http_dpd_lroute_labels[i]);

                if (s == 0) {
                    q = ngx_cpymem(q, "other", 5);

                } else {
                    q = ngx_http_dpd_metrics_escape(q, m->model[s], len);
                }

                *q++ = '"';

                h = k ? &m->e2e[i][s] : &m->ttft[i][s];

                p = ngx_http_dpd_metrics_hist_lines(p, def, h, lab, q - lab);
            }
        }
    }

    def = &ngx_http_dpd_kv_transfer_def;

    p = ngx_sprintf(p, "# HELP %s %s\n# TYPE %s histogram\n",
                    def->name, def->help, def->name);

    for (i = 0; i < NGX_HTTP_DPD_METRICS_PROTOS; i++) {
        q = ngx_sprintf(lab, "protocol=\"%s\"",
                        ngx_http_dpd_proto_labels[i]);
        p = ngx_http_dpd_metrics_hist_lines(p, def, &m->kv_transfer[i],
                                            lab, q - lab);
    }

    return p;
}


/* the pools: upstream{} blocks with dpd_balance */

static size_t
ngx_http_dpd_metrics_pools_size(ngx_http_request_t *r)
{
    size_t                             size;
    ngx_uint_t                         i;
    ngx_http_upstream_srv_conf_t     **uscfp;
    ngx_http_upstream_main_conf_t     *umcf;
    ngx_http_dpd_balancer_srv_conf_t  *bscf;

    umcf = ngx_http_get_module_main_conf(r, ngx_http_upstream_module);

    size = 1024;

    if (umcf == NULL) {
        return size;
    }

    uscfp = umcf->upstreams.elts;

    for (i = 0; i < umcf->upstreams.nelts; i++) {
        bscf = ngx_http_dpd_balancer_srv_conf(uscfp[i]);

        if (bscf && bscf->balance) {
            size += 3 * (96 + 2 * uscfp[i]->host.len);
        }
    }

    return size;
}


/*
 * Gauges read now from the balancer: the outstanding requests of a pool's
 * peers (across workers when the upstream has a zone, else this worker's)
 * and how many peers may take a request (not down, failed or dead by the
 * state table), of the peer list the balancer would use.
 */

static u_char *
ngx_http_dpd_metrics_render_pools(ngx_http_request_t *r, u_char *p,
    u_char *last)
{
    ngx_uint_t                         i, j, k, n, np, *v;
    ngx_http_upstream_srv_conf_t     **uscfp, **pool;
    ngx_http_upstream_rr_peers_t      *peers;
    ngx_http_upstream_main_conf_t     *umcf;
    ngx_http_dpd_balancer_cand_t      *cand;
    ngx_http_dpd_balancer_srv_conf_t  *bscf;

    static const char  *help[3] = {
        "# HELP dpd_pool_peers Primary peers of the pool (an upstream{} "
        "with dpd_balance).\n"
        "# TYPE dpd_pool_peers gauge\n",
        "# HELP dpd_pool_live_peers Peers of the pool that may take a "
        "request now (not down, failed or dead by the state table).\n"
        "# TYPE dpd_pool_live_peers gauge\n",
        "# HELP dpd_pool_outstanding_requests Requests in flight on the "
        "pool's peers (this worker's alone when the upstream has no "
        "zone).\n"
        "# TYPE dpd_pool_outstanding_requests gauge\n"
    };

    static const char  *series[3] = {
        "dpd_pool_peers", "dpd_pool_live_peers",
        "dpd_pool_outstanding_requests"
    };

    umcf = ngx_http_get_module_main_conf(r, ngx_http_upstream_module);

    if (umcf == NULL || umcf->upstreams.nelts == 0) {
        return p;
    }

    uscfp = umcf->upstreams.elts;

    pool = ngx_palloc(r->pool, umcf->upstreams.nelts
                               * (sizeof(void *) + 3 * sizeof(ngx_uint_t)));
    cand = ngx_palloc(r->pool, NGX_HTTP_DPD_METRICS_POOL_PEERS
                               * sizeof(ngx_http_dpd_balancer_cand_t));
    if (pool == NULL || cand == NULL) {
        return NULL;
    }

    v = (ngx_uint_t *) &pool[umcf->upstreams.nelts];
    np = 0;

    /* one look at each pool, as the balancer would choose now */

    for (i = 0; i < umcf->upstreams.nelts; i++) {
        bscf = ngx_http_dpd_balancer_srv_conf(uscfp[i]);

        if (bscf == NULL || !bscf->balance || uscfp[i]->peer.data == NULL) {
            continue;
        }

        if (ngx_http_dpd_balancer_candidates(r, uscfp[i], cand,
                                             NGX_HTTP_DPD_METRICS_POOL_PEERS,
                                             &n)
            != NGX_OK)
        {
            continue;
        }

        peers = uscfp[i]->peer.data;

        pool[np] = uscfp[i];
        v[3 * np] = peers->number;
        v[3 * np + 1] = 0;
        v[3 * np + 2] = 0;

        for (j = 0; j < n; j++) {
            v[3 * np + 1] += cand[j].usable;
            v[3 * np + 2] += cand[j].conns;
        }

        np++;
    }

    if (np == 0) {
        return p;
    }

    for (k = 0; k < 3; k++) {
        p = ngx_sprintf(p, "%s", help[k]);

        for (j = 0; j < np; j++) {
            if (last - p < (ssize_t) (96 + 2 * pool[j]->host.len)) {
                return p;
            }

            p = ngx_sprintf(p, "%s{pool=\"", series[k]);
            p = ngx_http_dpd_metrics_escape(p, pool[j]->host.data,
                                            pool[j]->host.len);
            p = ngx_sprintf(p, "\"} %ui\n", v[3 * j + k]);
        }
    }

    return p;
}
