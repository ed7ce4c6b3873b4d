/*
 * "dpd_models [NAME ...];" in a location: GET /v1/models for several
 * models behind one gateway (issue 24, 4).
 *
 * The gateway answers it itself rather than asking the engines: the pools
 * of one model know nothing of the others', and a union built by fanning
 * out would fail with any pool.  The list is the union, in configuration
 * order and without repeats, of the dpd_model names of the location's
 * server (not "*", which is no name) and the NAMEs given here (for the
 * model of a "*" entry or of a single-model gateway, whose served name
 * the module cannot know).  The shape is vLLM's and OpenAI's
 * (vllm/entrypoints/openai/protocol.py ModelList, ModelCard):
 *   {"object":"list","data":[{"id":"NAME","object":"model",
 *    "created":UNIX_TIME,"owned_by":"vllm"}, ...]}
 * An empty list fails nginx -t.  Other methods: 405, OpenAI-shaped.
 */


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "ngx_http_dpd_module.h"


typedef struct {
    ngx_array_t                  names;        /* ngx_str_t, given here */
    ngx_http_core_srv_conf_t    *cscf;         /* whose dpd_model names */
    ngx_array_t                 *all;          /* the union (postconf) */
} ngx_http_dpd_models_conf_t;


static ngx_int_t ngx_http_dpd_models_handler(ngx_http_request_t *r);
static ngx_int_t ngx_http_dpd_models_add(ngx_array_t *all, ngx_str_t *name);
static size_t ngx_http_dpd_models_escape(u_char *dst, ngx_str_t *s);


char *
ngx_http_dpd_models(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_dpd_loc_conf_t *dlcf = conf;

    ngx_str_t                   *value, *n;
    ngx_uint_t                   i;
    ngx_http_core_loc_conf_t    *clcf;
    ngx_http_dpd_main_conf_t    *dmcf;
    ngx_http_dpd_models_conf_t  *mc, **mp;

    if (dlcf->models_list) {
        return "is duplicate";
    }

    mc = ngx_pcalloc(cf->pool, sizeof(ngx_http_dpd_models_conf_t));
    if (mc == NULL) {
        return NGX_CONF_ERROR;
    }

    if (ngx_array_init(&mc->names, cf->pool, 2, sizeof(ngx_str_t))
        != NGX_OK)
    {
        return NGX_CONF_ERROR;
    }

    value = cf->args->elts;

    for (i = 1; i < cf->args->nelts; i++) {
        if (value[i].len == 0
            || (value[i].len == 1 && value[i].data[0] == '*'))
        {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "\"dpd_models\" needs model names, "
                               "not \"%V\"", &value[i]);
            return NGX_CONF_ERROR;
        }

        n = ngx_array_push(&mc->names);
        if (n == NULL) {
            return NGX_CONF_ERROR;
        }

        *n = value[i];
    }

    mc->cscf = ngx_http_conf_get_module_srv_conf(cf, ngx_http_core_module);
    dlcf->models_list = mc;

    dmcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_dpd_module);
    dmcf->used = 1;

    mp = ngx_array_push(&dmcf->models_locs);
    if (mp == NULL) {
        return NGX_CONF_ERROR;
    }

    *mp = mc;

    clcf = ngx_http_conf_get_module_loc_conf(cf, ngx_http_core_module);
    clcf->handler = ngx_http_dpd_models_handler;

    return NGX_CONF_OK;
}


/* postconfiguration, after ngx_http_dpd_model_init(): build the unions */

ngx_int_t
ngx_http_dpd_models_init(ngx_conf_t *cf)
{
    ngx_str_t                    *n;
    ngx_uint_t                    i, k, j;
    ngx_http_dpd_model_t         *m;
    ngx_http_dpd_loc_conf_t     **lp;
    ngx_http_dpd_main_conf_t     *dmcf;
    ngx_http_dpd_models_conf_t  **mp, *mc;

    dmcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_dpd_module);

    mp = dmcf->models_locs.elts;
    lp = dmcf->model_locs.elts;

    for (i = 0; i < dmcf->models_locs.nelts; i++) {
        mc = mp[i];

        mc->all = ngx_array_create(cf->pool, 4, sizeof(ngx_str_t));
        if (mc->all == NULL) {
            return NGX_ERROR;
        }

        for (k = 0; k < dmcf->model_locs.nelts; k++) {
            m = lp[k]->models->elts;

            for (j = 0; j < lp[k]->models->nelts; j++) {
                if (m[j].cscf != mc->cscf
                    || (m[j].name.len == 1 && m[j].name.data[0] == '*'))
                {
                    continue;
                }

                if (ngx_http_dpd_models_add(mc->all, &m[j].name) != NGX_OK) {
                    return NGX_ERROR;
                }
            }
        }

        n = mc->names.elts;

        for (k = 0; k < mc->names.nelts; k++) {
            if (ngx_http_dpd_models_add(mc->all, &n[k]) != NGX_OK) {
                return NGX_ERROR;
            }
        }

        if (mc->all->nelts == 0) {
            ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                          "\"dpd_models\": no model to list: its server has "
                          "no \"dpd_model NAME\" and the directive names "
                          "none (\"dpd_models NAME;\", or proxy "
                          "/v1/models to the engine)");
            return NGX_ERROR;
        }
    }

    return NGX_OK;
}


static ngx_int_t
ngx_http_dpd_models_add(ngx_array_t *all, ngx_str_t *name)
{
    ngx_str_t   *s;
    ngx_uint_t   i;

    s = all->elts;

    for (i = 0; i < all->nelts; i++) {
        if (s[i].len == name->len
            && ngx_strncmp(s[i].data, name->data, name->len) == 0)
        {
            return NGX_OK;
        }
    }

    s = ngx_array_push(all);
    if (s == NULL) {
        return NGX_ERROR;
    }

    *s = *name;

    return NGX_OK;
}


static ngx_int_t
ngx_http_dpd_models_handler(ngx_http_request_t *r)
{
    u_char                      *p;
    size_t                       len;
    ngx_int_t                    rc;
    ngx_str_t                   *s;
    ngx_buf_t                   *b;
    ngx_uint_t                   i;
    ngx_chain_t                  out;
    ngx_http_dpd_loc_conf_t     *dlcf;
    ngx_http_dpd_models_conf_t  *mc;

    static const char  head[] = "{\"object\":\"list\",\"data\":[";
    static const char  id[] = "{\"id\":\"";
    static const char  rest[] = "\",\"object\":\"model\",\"created\":";
    static const char  owner[] = ",\"owned_by\":\"vllm\"}";

    if (!(r->method & (NGX_HTTP_GET|NGX_HTTP_HEAD))) {
        return ngx_http_dpd_send_error(r, NGX_HTTP_NOT_ALLOWED, NULL,
                                       "only GET lists the models");
    }

    rc = ngx_http_discard_request_body(r);
    if (rc != NGX_OK) {
        return rc;
    }

    dlcf = ngx_http_get_module_loc_conf(r, ngx_http_dpd_module);
    mc = dlcf->models_list;
    s = mc->all->elts;

    len = sizeof(head) - 1 + 2;

    for (i = 0; i < mc->all->nelts; i++) {
        /* JSON escapes take at most 6 bytes per byte (\u00XX) */
        len += sizeof(id) - 1 + 6 * s[i].len + sizeof(rest) - 1
               + NGX_TIME_T_LEN + sizeof(owner) - 1 + 1;
    }

    b = ngx_create_temp_buf(r->pool, len);
    if (b == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    p = ngx_cpymem(b->last, head, sizeof(head) - 1);

    for (i = 0; i < mc->all->nelts; i++) {
        if (i) {
            *p++ = ',';
        }

        p = ngx_cpymem(p, id, sizeof(id) - 1);
        p += ngx_http_dpd_models_escape(p, &s[i]);
        p = ngx_cpymem(p, rest, sizeof(rest) - 1);
        p = ngx_sprintf(p, "%T", ngx_time());
        p = ngx_cpymem(p, owner, sizeof(owner) - 1);
    }

    *p++ = ']';
    *p++ = '}';

    b->last = p;
    b->last_buf = (r == r->main) ? 1 : 0;
    b->last_in_chain = 1;

    r->headers_out.status = NGX_HTTP_OK;
    r->headers_out.content_length_n = b->last - b->pos;
    ngx_str_set(&r->headers_out.content_type, "application/json");
    r->headers_out.content_type_len = r->headers_out.content_type.len;

    rc = ngx_http_send_header(r);

    if (rc == NGX_ERROR || rc > NGX_OK || r->header_only) {
        return rc;
    }

    out.buf = b;
    out.next = NULL;

    return ngx_http_output_filter(r, &out);
}


/* a configured name as a JSON string's contents */

static size_t
ngx_http_dpd_models_escape(u_char *dst, ngx_str_t *s)
{
    u_char      *p, c;
    ngx_uint_t   i;

    static u_char  hex[] = "0123456789abcdef";

    p = dst;

    for (i = 0; i < s->len; i++) {
        c = s->data[i];

        if (c == '"' || c == '\\') {
            *p++ = '\\';
            *p++ = c;

        } else if (c < 0x20 || c == 0x7f) {
            p = ngx_cpymem(p, "\\u00", 4);
            *p++ = hex[c >> 4];
            *p++ = hex[c & 0xf];

        } else {
            *p++ = c;
        }
    }

    return p - dst;
}
