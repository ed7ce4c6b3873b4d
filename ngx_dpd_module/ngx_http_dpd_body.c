/*
 * Request body of ngx_http_dpd_module: the early whole-body read, a
 * contiguous view of the body for the JSON parser (memory buffers and
 * temp-file bodies alike), and the body replacement used before proxy_pass.
 */


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "ngx_http_dpd_module.h"


ngx_int_t
ngx_http_dpd_read_body(ngx_http_request_t *r,
    ngx_http_client_body_handler_pt handler)
{
    /*
     * The whole body, buffered (memory up to client_body_buffer_size, a
     * temp file beyond): the proxy later sends the same buffers again.
     */

    r->request_body_no_buffering = 0;

    return ngx_http_read_client_request_body(r, handler);
}


/*
 * The body as one contiguous byte string.  A body that is a single memory
 * buffer is used in place; anything else (several buffers, a temp file) is
 * copied into the request pool.
 */

ngx_int_t
ngx_http_dpd_body_bytes(ngx_http_request_t *r, ngx_str_t *body)
{
    off_t         size;
    u_char       *p;
    ssize_t       n;
    ngx_buf_t    *b;
    ngx_chain_t  *cl;

    body->len = 0;
    body->data = NULL;

    if (r->request_body == NULL || r->request_body->bufs == NULL) {
        return NGX_OK;
    }

    size = 0;

    for (cl = r->request_body->bufs; cl; cl = cl->next) {
        size += ngx_buf_size(cl->buf);
    }

    if (size == 0) {
        return NGX_OK;
    }

    if ((uint64_t) size > NGX_MAX_SIZE_T_VALUE / 2) {
        return NGX_ERROR;
    }

    b = r->request_body->bufs->buf;

    if (r->request_body->bufs->next == NULL && ngx_buf_in_memory(b)) {
        body->data = b->pos;
        body->len = b->last - b->pos;
        return NGX_OK;
    }

    /* one extra byte: callers may NUL-terminate */

    body->data = ngx_pnalloc(r->pool, (size_t) size + 1);
    if (body->data == NULL) {
        return NGX_ERROR;
    }

    p = body->data;

    for (cl = r->request_body->bufs; cl; cl = cl->next) {
        b = cl->buf;

        if (ngx_buf_in_memory(b)) {
            p = ngx_cpymem(p, b->pos, b->last - b->pos);
            continue;
        }

        if (b->in_file && b->file) {
            size = b->file_last - b->file_pos;

            n = ngx_read_file(b->file, p, (size_t) size, b->file_pos);

            if (n == NGX_ERROR) {
                return NGX_ERROR;
            }

            if (n != size) {
                ngx_log_error(NGX_LOG_ALERT, r->connection->log, 0,
                              ngx_read_file_n " read only %z of %O "
                              "from \"%s\"", n, size, b->file->name.data);
                return NGX_ERROR;
            }

            p += n;
        }
    }

    body->len = p - body->data;
    *p = '\0';

    ngx_log_debug2(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "dpd body: %uz bytes%s", body->len,
                   r->request_body->temp_file ? " (from temp file)" : "");

    return NGX_OK;
}


ngx_int_t
ngx_http_dpd_replace_body(ngx_http_request_t *r, u_char *data, size_t len)
{
    u_char                   *p;
    ngx_buf_t                *b;
    ngx_chain_t              *cl;
    ngx_http_request_body_t  *rb;

    r = r->main;

    rb = r->request_body;

    if (rb == NULL) {
        rb = ngx_pcalloc(r->pool, sizeof(ngx_http_request_body_t));
        if (rb == NULL) {
            return NGX_ERROR;
        }

        r->request_body = rb;
    }

    b = ngx_calloc_buf(r->pool);
    if (b == NULL) {
        return NGX_ERROR;
    }

    cl = ngx_alloc_chain_link(r->pool);
    if (cl == NULL) {
        return NGX_ERROR;
    }

    /* start == pos: the upstream rewinds to start on a retry */

    b->start = data;
    b->pos = data;
    b->last = data + len;
    b->end = data + len;
    b->memory = 1;
    b->last_buf = 1;
    b->last_in_chain = 1;

    cl->buf = b;
    cl->next = NULL;

    rb->bufs = cl;
    rb->rest = 0;

    r->headers_in.content_length_n = len;

    /* $content_length and anything else reading the header itself */

    if (r->headers_in.content_length) {
        p = ngx_pnalloc(r->pool, NGX_SIZE_T_LEN);
        if (p == NULL) {
            return NGX_ERROR;
        }

        r->headers_in.content_length->value.data = p;
        r->headers_in.content_length->value.len =
                                          ngx_sprintf(p, "%uz", len) - p;
    }

    ngx_log_debug1(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "dpd body replaced: %uz bytes", len);

    return NGX_OK;
}
