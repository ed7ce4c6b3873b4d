/*
 * OpenAI-shaped errors of ngx_http_dpd_module.
 *
 *   {"error":{"message":"...","type":"...","param":null,"code":400}}
 *
 * ngx_http_dpd_send_error() answers a request with such a body.  The error
 * filter gives the same shape to the error pages nginx itself generates in
 * a "dpd on" location (413 for a body over client_max_body_size, 502/504
 * when the decode pool fails, ...), so OpenAI clients can always parse the
 * error; error pages configured with error_page are left alone.
 */


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "ngx_http_dpd_module.h"


static ngx_int_t ngx_http_dpd_error_json(ngx_http_request_t *r,
    ngx_uint_t status, const char *type, const char *message, ngx_str_t *out);
static const char *ngx_http_dpd_error_text(ngx_uint_t status);
static ngx_int_t ngx_http_dpd_error_header_filter(ngx_http_request_t *r);
static ngx_int_t ngx_http_dpd_error_body_filter(ngx_http_request_t *r,
    ngx_chain_t *in);


static ngx_http_output_header_filter_pt  ngx_http_next_header_filter;
static ngx_http_output_body_filter_pt    ngx_http_next_body_filter;


/*
 * Client or peer text (a model name, an error message quoting the body, a
 * prefill reply's field) for error.log: control bytes (newline, CR, ESC,
 * NUL, DEL), the backslash, the double quote and bytes that are not UTF-8 (as
 * ngx_utf8_decode() reads it) as \xNN, as nginx's access log escapes,
 * valid UTF-8 kept; at most NGX_HTTP_DPD_LOG_TEXT_MAX bytes of the input,
 * then "...".  A client cannot forge a line ("\n2026/12/04 [emerg] ...")
 * nor drive a terminal.  The string is the pool's; "(no memory)" when it
 * has none.
 */
ngx_str_t *
ngx_http_dpd_log_text(ngx_pool_t *pool, const u_char *data, size_t len)
{
    static ngx_str_t   nomem = ngx_string("(no memory)");
    static u_char      hex[] = "0123456789abcdef";
    u_char            *p, *q, *end, *next;
    size_t             n;
    uint32_t           cp;
    ngx_str_t         *out;

    n = ngx_min(len, NGX_HTTP_DPD_LOG_TEXT_MAX);

    out = ngx_palloc(pool, sizeof(ngx_str_t) + 4 * n + sizeof("..."));
    if (out == NULL) {
        return &nomem;
    }

    out->data = (u_char *) (out + 1);
    q = out->data;
    p = (u_char *) data;
    end = p + n;

    while (p < end) {

        if (*p >= 0x20 && *p < 0x7f && *p != '\\' && *p != '"') {
            *q++ = *p++;
            continue;
        }

        if (*p >= 0x80) {
            next = p;
            cp = ngx_utf8_decode(&next, end - p);

            if (cp <= 0x10ffff && (cp < 0xd800 || cp > 0xdfff)) {
                q = ngx_cpymem(q, p, next - p);
                p = next;
                continue;
            }
        }

        *q++ = '\\';
        *q++ = 'x';
        *q++ = hex[*p >> 4];
        *q++ = hex[*p & 0xf];
        p++;
    }

    if (n < len) {
        q = ngx_cpymem(q, "...", 3);
    }

    out->len = q - out->data;

    return out;
}


ngx_str_t *
ngx_http_dpd_log_cstr(ngx_pool_t *pool, const char *s)
{
    return ngx_http_dpd_log_text(pool, (const u_char *) s, ngx_strlen(s));
}


const char *
ngx_http_dpd_error_type(ngx_uint_t status)
{
    switch (status) {
    case NGX_HTTP_UNAUTHORIZED:
        return "authentication_error";
    case NGX_HTTP_FORBIDDEN:
        return "permission_error";
    case NGX_HTTP_NOT_FOUND:
        return "not_found_error";
    case 429:
        return "rate_limit_error";
    default:
        return status >= NGX_HTTP_INTERNAL_SERVER_ERROR
               ? "server_error" : "invalid_request_error";
    }
}


static const char *
ngx_http_dpd_error_text(ngx_uint_t status)
{
    switch (status) {
    case NGX_HTTP_BAD_REQUEST:
        return "bad request";
    case NGX_HTTP_UNAUTHORIZED:
        return "authorization required";
    case NGX_HTTP_FORBIDDEN:
        return "forbidden";
    case NGX_HTTP_NOT_FOUND:
        return "not found";
    case NGX_HTTP_NOT_ALLOWED:
        return "method not allowed";
    case NGX_HTTP_REQUEST_TIME_OUT:
        return "timed out reading the request";
    case NGX_HTTP_LENGTH_REQUIRED:
        return "length required";
    case NGX_HTTP_REQUEST_ENTITY_TOO_LARGE:
        return "the request body is larger than the gateway accepts "
               "(client_max_body_size)";
    case 429:
        return "too many requests";
    case NGX_HTTP_INTERNAL_SERVER_ERROR:
        return "internal gateway error";
    case NGX_HTTP_BAD_GATEWAY:
        return "the inference backend failed (bad gateway)";
    case NGX_HTTP_SERVICE_UNAVAILABLE:
        return "the inference backend is unavailable";
    case NGX_HTTP_GATEWAY_TIME_OUT:
        return "the inference backend timed out";
    default:
        return status >= NGX_HTTP_INTERNAL_SERVER_ERROR
               ? "gateway error" : "request error";
    }
}


static ngx_int_t
ngx_http_dpd_error_json(ngx_http_request_t *r, ngx_uint_t status,
    const char *type, const char *message, ngx_str_t *out)
{
    char    *text;
    size_t   len;
    cJSON   *root, *err;

    root = cJSON_CreateObject();
    if (root == NULL) {
        return NGX_ERROR;
    }

    err = cJSON_AddObjectToObject(root, "error");

    if (err == NULL
        || cJSON_AddStringToObject(err, "message", message) == NULL
        || cJSON_AddStringToObject(err, "type", type) == NULL
        || cJSON_AddNullToObject(err, "param") == NULL
        || cJSON_AddNumberToObject(err, "code", (double) status) == NULL)
    {
        cJSON_Delete(root);
        return NGX_ERROR;
    }

    text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);

    if (text == NULL) {
        return NGX_ERROR;
    }

    len = ngx_strlen(text);

    out->data = ngx_pnalloc(r->pool, len + 1);
    if (out->data == NULL) {
        cJSON_free(text);
        return NGX_ERROR;
    }

    ngx_memcpy(out->data, text, len);
    out->data[len] = '\n';
    out->len = len + 1;

    cJSON_free(text);

    return NGX_OK;
}


ngx_int_t
ngx_http_dpd_send_error(ngx_http_request_t *r, ngx_uint_t status,
    const char *type, const char *message)
{
    ngx_int_t            rc;
    ngx_str_t            body;
    ngx_buf_t           *b;
    ngx_chain_t          out;
    ngx_http_dpd_ctx_t  *ctx;

    if (r->header_sent) {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "dpd: cannot send error %ui after the header: %V",
                      status, ngx_http_dpd_log_cstr(r->pool, message));
        return NGX_ERROR;
    }

    if (type == NULL) {
        type = ngx_http_dpd_error_type(status);
    }

    if (message == NULL) {
        message = ngx_http_dpd_error_text(status);
    }

    ctx = ngx_http_dpd_get_ctx(r);
    if (ctx == NULL) {
        ctx = ngx_http_dpd_create_ctx(r);
        if (ctx == NULL) {
            return NGX_ERROR;
        }
    }

    /* this body is final: the error filter leaves it alone */
    ctx->own_error = 1;

    if (ngx_http_dpd_error_json(r, status, type, message, &body) != NGX_OK) {
        return NGX_ERROR;
    }

    if (ngx_http_discard_request_body(r) != NGX_OK) {
        r->keepalive = 0;
    }

    ngx_http_clear_accept_ranges(r);
    ngx_http_clear_last_modified(r);
    ngx_http_clear_etag(r);

    r->headers_out.status = status;
    r->headers_out.content_length_n = body.len;
    ngx_str_set(&r->headers_out.content_type, "application/json");
    r->headers_out.content_type_len = r->headers_out.content_type.len;
    r->headers_out.content_type_lowcase = NULL;

    rc = ngx_http_send_header(r);

    if (rc == NGX_ERROR || rc > NGX_OK || r->header_only) {
        return rc;
    }

    b = ngx_calloc_buf(r->pool);
    if (b == NULL) {
        return NGX_ERROR;
    }

    b->pos = body.data;
    b->last = body.data + body.len;
    b->memory = 1;
    b->last_buf = (r == r->main) ? 1 : 0;
    b->last_in_chain = 1;

    out.buf = b;
    out.next = NULL;

    return ngx_http_output_filter(r, &out);
}


static ngx_int_t
ngx_http_dpd_error_header_filter(ngx_http_request_t *r)
{
    ngx_uint_t                status;
    ngx_http_dpd_ctx_t       *ctx;
    ngx_http_dpd_loc_conf_t  *dlcf;

    status = r->headers_out.status;

    /*
     * nginx's own error pages (ngx_http_special_response_handler) set
     * r->err_status and a text/html body; proxied errors set neither
     */

    if (r != r->main
        || r->err_status < NGX_HTTP_BAD_REQUEST
        || status < NGX_HTTP_BAD_REQUEST
        || r->headers_out.content_type.len != sizeof("text/html") - 1
        || ngx_strncmp(r->headers_out.content_type.data, "text/html",
                       sizeof("text/html") - 1) != 0)
    {
        return ngx_http_next_header_filter(r);
    }

    dlcf = ngx_http_get_module_loc_conf(r, ngx_http_dpd_module);
    if (!dlcf->enable) {
        return ngx_http_next_header_filter(r);
    }

    ctx = ngx_http_dpd_get_ctx(r);

    if (ctx == NULL) {
        ctx = ngx_http_dpd_create_ctx(r);
        if (ctx == NULL) {
            return NGX_ERROR;
        }

    } else if (ctx->own_error || ctx->error_page) {
        return ngx_http_next_header_filter(r);
    }

    if (ctx->err_reason == NGX_HTTP_DPD_E_NONE
        && status == NGX_HTTP_REQUEST_ENTITY_TOO_LARGE)
    {
        ctx->err_reason = NGX_HTTP_DPD_E_BODY_TOO_LARGE;
    }

    if (ngx_http_dpd_error_json(r, status, ngx_http_dpd_error_type(status),
                                ngx_http_dpd_error_text(status),
                                &ctx->error_body)
        != NGX_OK)
    {
        return NGX_ERROR;
    }

    ctx->error_page = 1;

    ngx_http_clear_content_length(r);

    r->headers_out.content_length_n = ctx->error_body.len;
    ngx_str_set(&r->headers_out.content_type, "application/json");
    r->headers_out.content_type_len = r->headers_out.content_type.len;
    r->headers_out.content_type_lowcase = NULL;
    r->headers_out.charset.len = 0;

    return ngx_http_next_header_filter(r);
}


static ngx_int_t
ngx_http_dpd_error_body_filter(ngx_http_request_t *r, ngx_chain_t *in)
{
    ngx_buf_t           *b;
    ngx_uint_t           last;
    ngx_chain_t         *cl, out;
    ngx_http_dpd_ctx_t  *ctx;

    if (r != r->main) {
        return ngx_http_next_body_filter(r, in);
    }

    ctx = ngx_http_get_module_ctx(r, ngx_http_dpd_module);

    if (ctx == NULL || !ctx->error_page) {
        return ngx_http_next_body_filter(r, in);
    }

    /* swallow nginx's HTML page, send ours once it is complete */

    last = 0;

    for (cl = in; cl; cl = cl->next) {
        b = cl->buf;

        if (b->last_buf) {
            last = 1;
        }

        b->pos = b->last;

        if (b->in_file) {
            b->file_pos = b->file_last;
        }
    }

    if (!last || ctx->error_sent) {
        return NGX_OK;
    }

    ctx->error_sent = 1;

    b = ngx_calloc_buf(r->pool);
    if (b == NULL) {
        return NGX_ERROR;
    }

    b->pos = ctx->error_body.data;
    b->last = ctx->error_body.data + ctx->error_body.len;
    b->memory = 1;
    b->last_buf = 1;
    b->last_in_chain = 1;

    out.buf = b;
    out.next = NULL;

    return ngx_http_next_body_filter(r, &out);
}


ngx_int_t
ngx_http_dpd_error_filter_init(ngx_conf_t *cf)
{
    ngx_http_next_header_filter = ngx_http_top_header_filter;
    ngx_http_top_header_filter = ngx_http_dpd_error_header_filter;

    ngx_http_next_body_filter = ngx_http_top_body_filter;
    ngx_http_top_body_filter = ngx_http_dpd_error_body_filter;

    return NGX_OK;
}
