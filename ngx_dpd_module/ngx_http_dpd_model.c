/*
 * Several models behind one gateway: "dpd_model NAME @location;".
 *
 * OpenAI clients name the model in the body ("model": "..."), not in the
 * URI, so nginx alone cannot send them to per-model pools.  A location
 * with dpd_model entries reads and parses the body once, picks the entry
 * whose NAME is the request's "model" ("*": any other, and requests
 * without one), counts the prompt with that entry's named location's
 * settings (its dpd_tokenizer, dpd_chat_template, dpd_count, caps), and
 * continues the request there (ngx_http_named_location(), as try_files
 * does): its access checks, its dpd_threshold, dpd_prefill_pass and
 * proxy_pass, i.e. that model's pools.  The count is not repeated there
 * (the context survives the redirect, ngx_http_dpd_get_ctx()).
 *
 * Names are matched exactly, as vLLM matches --served-model-name.  A
 * model with no entry and no "*" gets vLLM's answer: 404, "The model `X`
 * does not exist."; a "model" that is not a string: 400.  Targets are
 * resolved at configuration time: each must be a named location of the
 * same server, with "dpd on", and without dpd_model of its own.
 */


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "ngx_http_dpd_module.h"


char *
ngx_http_dpd_model(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_dpd_loc_conf_t *dlcf = conf;

    ngx_str_t                 *value;
    ngx_uint_t                 i;
    ngx_http_dpd_model_t      *m;
    ngx_http_dpd_loc_conf_t  **lp;
    ngx_http_dpd_main_conf_t  *dmcf;

    value = cf->args->elts;

    if (value[1].len == 0) {
        return "needs a model name (or \"*\")";
    }

    if (value[2].len < 2 || value[2].data[0] != '@') {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "\"dpd_model %V\" needs a named location "
                           "(\"@name\"), not \"%V\"", &value[1], &value[2]);
        return NGX_CONF_ERROR;
    }

    dmcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_dpd_module);
    dmcf->used = 1;

    if (dlcf->models == NULL) {
        dlcf->models = ngx_array_create(cf->pool, 4,
                                        sizeof(ngx_http_dpd_model_t));
        if (dlcf->models == NULL) {
            return NGX_CONF_ERROR;
        }

        lp = ngx_array_push(&dmcf->model_locs);
        if (lp == NULL) {
            return NGX_CONF_ERROR;
        }

        *lp = dlcf;
    }

    m = dlcf->models->elts;

    for (i = 0; i < dlcf->models->nelts; i++) {
        if (m[i].name.len == value[1].len
            && ngx_strncmp(m[i].name.data, value[1].data, value[1].len) == 0)
        {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "duplicate \"dpd_model %V\"", &value[1]);
            return NGX_CONF_ERROR;
        }
    }

    m = ngx_array_push(dlcf->models);
    if (m == NULL) {
        return NGX_CONF_ERROR;
    }

    m->name = value[1];
    m->location = value[2];
    m->cscf = ngx_http_conf_get_module_srv_conf(cf, ngx_http_core_module);
    m->target = NULL;

    if (value[1].len == 1 && value[1].data[0] == '*') {
        dlcf->model_default = dlcf->models->nelts - 1;
    }

    return NGX_CONF_OK;
}


/*
 * postconfiguration: the servers' named locations exist now
 * (ngx_http_init_locations() ran); point each entry at its target's
 * settings
 */

ngx_int_t
ngx_http_dpd_model_init(ngx_conf_t *cf)
{
    ngx_uint_t                  i, k;
    ngx_http_dpd_model_t       *m;
    ngx_http_dpd_loc_conf_t   **lp, *t;
    ngx_http_core_loc_conf_t  **clcfp;
    ngx_http_dpd_main_conf_t   *dmcf;

    dmcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_dpd_module);

    lp = dmcf->model_locs.elts;

    for (i = 0; i < dmcf->model_locs.nelts; i++) {

        m = lp[i]->models->elts;

        for (k = 0; k < lp[i]->models->nelts; k++) {

            t = NULL;

            for (clcfp = m[k].cscf->named_locations;
                 clcfp && *clcfp;
                 clcfp++)
            {
                if ((*clcfp)->name.len == m[k].location.len
                    && ngx_strncmp((*clcfp)->name.data, m[k].location.data,
                                   m[k].location.len) == 0)
                {
                    t = (*clcfp)->loc_conf[ngx_http_dpd_module.ctx_index];
                    break;
                }
            }

            if (t == NULL) {
                ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                              "\"dpd_model %V %V\": no named location "
                              "\"%V\" in that server",
                              &m[k].name, &m[k].location, &m[k].location);
                return NGX_ERROR;
            }

            if (!t->enable) {
                ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                              "\"dpd_model %V %V\": \"%V\" needs "
                              "\"dpd on\"",
                              &m[k].name, &m[k].location, &m[k].location);
                return NGX_ERROR;
            }

            if (t->models) {
                ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                              "\"dpd_model %V %V\": \"%V\" routes by "
                              "model itself (one dpd_model level only)",
                              &m[k].name, &m[k].location, &m[k].location);
                return NGX_ERROR;
            }

            m[k].target = t;
        }
    }

    return NGX_OK;
}


/*
 * The entry for the parsed request (any thread: reads configuration
 * only).  Returns it, or NULL with *bad: 1 no entry for this model,
 * 2 "model" is not a string.  *name, *len: the model as sent (NULL when
 * the request has none).
 */

ngx_http_dpd_model_t *
ngx_http_dpd_model_pick(ngx_http_dpd_loc_conf_t *dlcf, const cJSON *json,
    const char **name, size_t *len, int *bad)
{
    size_t                 n;
    ngx_uint_t             i;
    const char            *s;
    const cJSON           *v;
    ngx_http_dpd_model_t  *m;

    *bad = 0;
    *name = NULL;
    *len = 0;

    m = dlcf->models->elts;

    /* top-level keys are unique here: the parse refused repeats */

    v = cJSON_GetObjectItemCaseSensitive(json, "model");

    if (v == NULL || cJSON_IsNull(v)) {
        goto other;
    }

    if (!cJSON_IsString(v) || v->valuestring == NULL) {
        *bad = 2;
        return NULL;
    }

    /* no NUL inside: the parse refused "\u0000" */

    s = v->valuestring;
    n = strlen(s);

    *name = s;
    *len = n;

    for (i = 0; i < dlcf->models->nelts; i++) {
        if (i != dlcf->model_default
            && m[i].name.len == n
            && ngx_strncmp(m[i].name.data, s, n) == 0)
        {
            return &m[i];
        }
    }

other:

    if (dlcf->model_default != NGX_CONF_UNSET_UINT) {
        return &m[dlcf->model_default];
    }

    *bad = 1;
    return NULL;
}


/*
 * The phase handler's step once counted: continue in the entry's named
 * location (the request is answered there; the reference the redirect
 * takes is dropped here, as try_files does).
 */

ngx_int_t
ngx_http_dpd_model_pass(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx)
{
    ngx_log_debug2(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "dpd model: \"%V\" in %V",
                   ngx_http_dpd_log_text(r->pool, ctx->model_name.data,
                                         ctx->model_name.len),
                   &ctx->model->location);

    ctx->model_done = 1;
    ctx->count_rc = NGX_OK;
    ctx->state = NGX_HTTP_DPD_STATE_COUNTED;

    (void) ngx_http_named_location(r, &ctx->model->location);

    ngx_http_finalize_request(r, NGX_DONE);

    return NGX_DONE;
}
