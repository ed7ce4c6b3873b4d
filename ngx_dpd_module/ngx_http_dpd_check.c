/*
 * Users' configuration mistakes around dpd_prefill_pass (issue 24, 4).
 *
 * At nginx -t (postconfiguration): for every location with "dpd on" and
 * dpd_prefill_pass, find the location that the prefill subrequest
 * (prefill_pass + "/v1/completions" and "/v1/chat/completions") lands in,
 * with nginx's own lookup order (ngx_http_core_find_location() and
 * ngx_http_core_find_static_location() of nginx 1.22/1.30,
 * src/http/ngx_http_core_module.c: static tree, "=" and "^~" stop,
 * regexes in order, nested locations), and refuse:
 *   - no location at all (the subrequest gets nginx's own 404);
 *   - a location that dpd_prefill_pass does not name and that is not
 *     "internal" (a broader prefix such as "location /" or a regex caught
 *     it: the prefill would go wherever that location sends it, e.g. to
 *     the decoders); an internal one is meant for subrequests;
 *   - the dpd location itself (an internal one whose name covers it);
 *   - a location without a content handler (no proxy_pass: static files).
 * A named location that is not "internal" gets a warning (clients can
 * call the prefill pool directly).
 *
 * What nginx -t cannot see: the proxy_pass URI part.  The proxy module's
 * location conf is private to ngx_http_proxy_module.c, so
 * "location /_dpd_prefill/ { proxy_pass http://prefill; }" (no "/" after
 * the pool: /_dpd_prefill/v1/... goes upstream) is caught on the first
 * request instead: ngx_http_dpd_check_prefill_404().
 */


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "ngx_http_dpd_module.h"
#include "ngx_http_dpd_balancer.h"


/* one error line per worker per this many seconds; the rest at info */
#define NGX_HTTP_DPD_CHECK_LOG_EVERY  60


static ngx_int_t ngx_http_dpd_check_loc(ngx_conf_t *cf,
    ngx_http_core_srv_conf_t *cscf, ngx_http_core_loc_conf_t *clcf);
static ngx_int_t ngx_http_dpd_check_tree(ngx_conf_t *cf,
    ngx_http_core_srv_conf_t *cscf, ngx_http_location_tree_node_t *node);
static ngx_int_t ngx_http_dpd_check_pass(ngx_conf_t *cf,
    ngx_http_core_srv_conf_t *cscf, ngx_http_core_loc_conf_t *dclcf,
    ngx_http_dpd_loc_conf_t *dlcf, const char *path);
static ngx_int_t ngx_http_dpd_find_location(
    ngx_http_core_loc_conf_t *pclcf, ngx_str_t *uri,
    ngx_http_core_loc_conf_t **out);
static ngx_int_t ngx_http_dpd_find_static(
    ngx_http_location_tree_node_t *node, ngx_str_t *uri,
    ngx_http_core_loc_conf_t **out);


ngx_int_t
ngx_http_dpd_check_init(ngx_conf_t *cf)
{
    ngx_uint_t                   s;
    ngx_http_core_loc_conf_t    *clcf, **named;
    ngx_http_core_srv_conf_t   **cscfp;
    ngx_http_core_main_conf_t   *cmcf;

    cmcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_core_module);
    cscfp = cmcf->servers.elts;

    for (s = 0; s < cmcf->servers.nelts; s++) {
        clcf = cscfp[s]->ctx->loc_conf[ngx_http_core_module.ctx_index];

        if (ngx_http_dpd_check_loc(cf, cscfp[s], clcf) != NGX_OK) {
            return NGX_ERROR;
        }

        /* dpd_model targets are named locations */

        for (named = cscfp[s]->named_locations; named && *named; named++) {
            if (ngx_http_dpd_check_loc(cf, cscfp[s], *named) != NGX_OK) {
                return NGX_ERROR;
            }
        }
    }

    return NGX_OK;
}


/* this location, then its nested ones */

static ngx_int_t
ngx_http_dpd_check_loc(ngx_conf_t *cf, ngx_http_core_srv_conf_t *cscf,
    ngx_http_core_loc_conf_t *clcf)
{
    ngx_http_core_loc_conf_t  **clcfp;
    ngx_http_dpd_loc_conf_t    *dlcf;

    /* the server's own settings: clcf->loc_conf is set for locations */

    dlcf = (clcf->loc_conf ? clcf->loc_conf : cscf->ctx->loc_conf)
               [ngx_http_dpd_module.ctx_index];

    if (dlcf->enable && dlcf->prefill.prefill_pass.len) {
        if (ngx_http_dpd_check_pass(cf, cscf, clcf, dlcf, "/v1/completions")
            != NGX_OK
            || ngx_http_dpd_check_pass(cf, cscf, clcf, dlcf,
                                       "/v1/chat/completions")
               != NGX_OK)
        {
            return NGX_ERROR;
        }
    }

    if (ngx_http_dpd_check_tree(cf, cscf, clcf->static_locations)
        != NGX_OK)
    {
        return NGX_ERROR;
    }

#if (NGX_PCRE)
    for (clcfp = clcf->regex_locations; clcfp && *clcfp; clcfp++) {
        if (ngx_http_dpd_check_loc(cf, cscf, *clcfp) != NGX_OK) {
            return NGX_ERROR;
        }
    }
#else
    (void) clcfp;
#endif

    return NGX_OK;
}


static ngx_int_t
ngx_http_dpd_check_tree(ngx_conf_t *cf, ngx_http_core_srv_conf_t *cscf,
    ngx_http_location_tree_node_t *node)
{
    if (node == NULL) {
        return NGX_OK;
    }

    if (ngx_http_dpd_check_tree(cf, cscf, node->left) != NGX_OK
        || ngx_http_dpd_check_tree(cf, cscf, node->right) != NGX_OK
        || ngx_http_dpd_check_tree(cf, cscf, node->tree) != NGX_OK)
    {
        return NGX_ERROR;
    }

    if (node->exact
        && ngx_http_dpd_check_loc(cf, cscf, node->exact) != NGX_OK)
    {
        return NGX_ERROR;
    }

    if (node->inclusive
        && ngx_http_dpd_check_loc(cf, cscf, node->inclusive) != NGX_OK)
    {
        return NGX_ERROR;
    }

    return NGX_OK;
}


static ngx_int_t
ngx_http_dpd_check_pass(ngx_conf_t *cf, ngx_http_core_srv_conf_t *cscf,
    ngx_http_core_loc_conf_t *dclcf, ngx_http_dpd_loc_conf_t *dlcf,
    const char *path)
{
    size_t                     n;
    ngx_str_t                  uri, *pass;
    ngx_http_core_loc_conf_t  *found, *sclcf;

    pass = &dlcf->prefill.prefill_pass;
    n = ngx_strlen(path);

    uri.len = pass->len + n;
    uri.data = ngx_pnalloc(cf->temp_pool, uri.len);
    if (uri.data == NULL) {
        return NGX_ERROR;
    }

    ngx_memcpy(ngx_cpymem(uri.data, pass->data, pass->len), path, n);

    sclcf = cscf->ctx->loc_conf[ngx_http_core_module.ctx_index];
    found = NULL;

    if (ngx_http_dpd_find_location(sclcf, &uri, &found) == NGX_ERROR) {
        return NGX_ERROR;
    }

    if (found == NULL) {
        ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                      "\"dpd_prefill_pass %V\" in location \"%V\": no "
                      "location of its server matches the prefill "
                      "request \"%V\" (nginx itself would answer 404); add "
                      "\"location %V/ { internal; proxy_pass "
                      "http://PREFILL_POOL/; }\"",
                      pass, &dclcf->name, &uri, pass);
        return NGX_ERROR;
    }

    /*
     * a location that dpd_prefill_pass does not name is a mistake unless
     * it is "internal": then it is meant for subrequests (e.g. a regex
     * "location ~ ^/_p/(\w+)(/.*)$ { internal; proxy_pass http://$1$2; }"
     * serving several pools)
     */

    if (!found->internal
        && (found->name.len < pass->len
            || ngx_filename_cmp(found->name.data, pass->data, pass->len) != 0
#if (NGX_PCRE)
            || found->regex
#endif
           ))
    {
        ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                      "\"dpd_prefill_pass %V\" in location \"%V\" names no "
                      "location: the prefill request \"%V\" lands in "
                      "\"location %V\"; add \"location %V/ { internal; "
                      "proxy_pass http://PREFILL_POOL/; }\"",
                      pass, &dclcf->name, &uri, &found->name, pass);
        return NGX_ERROR;
    }

    /* "dpd on" inherited from the server is harmless there (subrequests
     * are not routed), but the dpd location itself sends to the decoders */

    if (found == dclcf) {
        ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                      "\"dpd_prefill_pass %V\" in location \"%V\": the "
                      "prefill request \"%V\" lands in that same location "
                      "(its proxy_pass goes to the decoders); add "
                      "\"location %V/ { internal; proxy_pass "
                      "http://PREFILL_POOL/; }\"",
                      pass, &dclcf->name, &uri, pass);
        return NGX_ERROR;
    }

    if (found->handler == NULL) {
        ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                      "\"dpd_prefill_pass %V\" in location \"%V\": "
                      "\"location %V\" has no proxy_pass (it would serve "
                      "files); add \"proxy_pass http://PREFILL_POOL/;\"",
                      pass, &dclcf->name, &found->name);
        return NGX_ERROR;
    }

    if (!found->internal && path[4] == 'c' && path[5] == 'o') {
        /* once per location: on the completions path only */
        ngx_log_error(NGX_LOG_WARN, cf->log, 0,
                      "\"dpd_prefill_pass %V\": \"location %V\" is not "
                      "\"internal\", clients can call the prefill pool "
                      "through it", pass, &found->name);
    }

    return NGX_OK;
}


/*
 * ngx_http_core_find_location() without a request: *out is the location
 * that serves uri, NULL when none (the server's own settings would).
 */

static ngx_int_t
ngx_http_dpd_find_location(ngx_http_core_loc_conf_t *pclcf, ngx_str_t *uri,
    ngx_http_core_loc_conf_t **out)
{
    ngx_int_t                   rc;
#if (NGX_PCRE)
    ngx_int_t                   n;
    ngx_uint_t                  noregex;
    ngx_http_core_loc_conf_t  **clcfp;

    noregex = 0;
#endif

    rc = ngx_http_dpd_find_static(pclcf->static_locations, uri, out);

    if (rc == NGX_AGAIN) {
#if (NGX_PCRE)
        noregex = (*out)->noregex;
#endif
        rc = ngx_http_dpd_find_location(*out, uri, out);
    }

    if (rc == NGX_OK || rc == NGX_DONE || rc == NGX_ERROR) {
        return rc;
    }

#if (NGX_PCRE)
    if (noregex == 0 && pclcf->regex_locations) {

        for (clcfp = pclcf->regex_locations; *clcfp; clcfp++) {

            n = ngx_regex_exec((*clcfp)->regex->regex, uri, NULL, 0);

            if (n >= 0) {
                *out = *clcfp;
                rc = ngx_http_dpd_find_location(*clcfp, uri, out);
                return (rc == NGX_ERROR) ? rc : NGX_OK;
            }

            if (n != NGX_REGEX_NO_MATCHED) {
                return NGX_ERROR;
            }
        }
    }
#endif

    return rc;
}


static ngx_int_t
ngx_http_dpd_find_static(ngx_http_location_tree_node_t *node, ngx_str_t *uri,
    ngx_http_core_loc_conf_t **out)
{
    u_char     *p;
    size_t      len, n;
    ngx_int_t   rc, rv;

    len = uri->len;
    p = uri->data;

    rv = NGX_DECLINED;

    for ( ;; ) {

        if (node == NULL) {
            return rv;
        }

        n = (len <= (size_t) node->len) ? len : node->len;

        rc = ngx_filename_cmp(p, node->name, n);

        if (rc != 0) {
            node = (rc < 0) ? node->left : node->right;
            continue;
        }

        if (len > (size_t) node->len) {

            if (node->inclusive) {
                *out = node->inclusive;
                rv = NGX_AGAIN;

                node = node->tree;
                p += n;
                len -= n;

                continue;
            }

            /* exact only */

            node = node->right;
            continue;
        }

        if (len == (size_t) node->len) {

            if (node->exact) {
                *out = node->exact;
                return NGX_OK;
            }

            *out = node->inclusive;
            return NGX_AGAIN;
        }

        /* len < node->len */

        if (len + 1 == (size_t) node->len && node->auto_redirect) {
            *out = node->exact ? node->exact : node->inclusive;
            rv = NGX_DONE;
        }

        node = node->left;
    }
}


/*
 * The prefill answered 404 with a body that is not an OpenAI error
 * object: vLLM's 404 for a model it does not serve is one
 * ({"error": {...}}, or {"object": "error", ...} in older releases), while
 * a path it has no route for gets FastAPI's {"detail":"Not Found"} and
 * nginx's own 404 is HTML.  Such a 404 is the gateway's configuration,
 * not the client's request nor a pool failure: log the URI that went to
 * the engine and the fix, and answer 502 whatever dpd_fallback says (a
 * silent fallback would hide the mistake on every long request).
 * Returns NGX_DECLINED for any other reply.
 */

ngx_int_t
ngx_http_dpd_check_prefill_404(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_str_t *pass)
{
    static time_t                last;

    ngx_uint_t                   level;
    ngx_http_dpd_prefill_ctx_t  *p;

    p = &ctx->prefill;

    if (p->status != NGX_HTTP_NOT_FOUND
        || (p->reply.len
            && ngx_strlcasestrn(p->reply.data, p->reply.data + p->reply.len,
                                (u_char *) "\"error\"", 7 - 1)
               != NULL))
    {
        return NGX_DECLINED;
    }

    level = NGX_LOG_INFO;

    if (ngx_time() - last >= NGX_HTTP_DPD_CHECK_LOG_EVERY) {
        last = ngx_time();
        level = NGX_LOG_ERR;
    }

    ngx_log_error(level, r->connection->log, 0,
                  "dpd: the prefill location of \"dpd_prefill_pass %V\" "
                  "sent \"%V\" to %V%s and got 404 (no such path): the "
                  "engine must get /v1/...; write \"location %V/ { "
                  "internal; proxy_pass http://PREFILL_POOL/; }\" (the "
                  "\"/\" after the pool strips %V); request \"%V\" "
                  "answered 502",
                  pass, ngx_http_dpd_log_text(r->pool, p->sent.data,
                                              p->sent.len),
                  p->peer.len ? &p->peer : ngx_http_dpd_log_cstr(r->pool,
                                                                 "nginx"),
                  p->peer.len ? "" : " (no upstream answered)",
                  pass, pass, &ctx->request_id);

    p->cause = NGX_HTTP_DPD_CAUSE_4XX;
    ngx_http_dpd_balancer_unpin(r);

    ctx->answer = NGX_HTTP_DPD_ANSWER_ERROR;
    ctx->answer_status = NGX_HTTP_BAD_GATEWAY;
    ctx->answer_type = "server_error";
    ctx->answer_message = "the gateway's prefill location is misconfigured "
                          "(the prefill engine has no such path)";

    return NGX_DONE;
}
