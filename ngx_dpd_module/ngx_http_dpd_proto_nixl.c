/*
 * dpd_protocol nixl: vLLM's NixlConnector, the decoder pulls (docs/dpd.md).
 *
 *   prefill body  the client's request, max_tokens 1, stream false,
 *                 "kv_transfer_params": {"do_remote_decode": true, ...}
 *   reply         its kv_transfer_params validated (do_remote_prefill,
 *                 remote_engine_id, remote_request_id, remote_port) and
 *                 kept unchanged but remote_host: the prefill peer's own
 *                 address, or the reply's when it is that address or in
 *                 dpd_nixl_remote_hosts (never anywhere a reply says)
 *   decode body   the client's request plus those params; any decoder can
 *                 pull while the prefill holds the blocks, so a decode
 *                 retry on another decoder gets the same body
 *   no readiness wait; a decode without params is route "fallback"
 */

#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "ngx_http_dpd_proto.h"


typedef struct {
    ngx_str_t                    decode;        /* the decode body, built
                                                   once from the vetted
                                                   params */
} ngx_http_dpd_nixl_ctx_t;


static ngx_int_t ngx_http_dpd_nixl_prefill_body(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf,
    ngx_str_t *body);
static ngx_int_t ngx_http_dpd_nixl_reply(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf,
    const char **why);
static ngx_int_t ngx_http_dpd_nixl_decode_body(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf,
    ngx_str_t *body);
static const char *ngx_http_dpd_nixl_host(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf,
    cJSON *params, ngx_str_t *peer);


ngx_http_dpd_proto_t  ngx_http_dpd_proto_nixl = {
    ngx_string("nixl"),
    NGX_HTTP_DPD_PROTO_NIXL,
    NGX_HTTP_DPD_PROTO_NO_KV_FALLBACK,
    NULL,                                  /* init */
    NULL,                                  /* conf */
    NULL,                                  /* chosen */
    ngx_http_dpd_nixl_prefill_body,
    ngx_http_dpd_nixl_reply,
    NULL,                                  /* ready */
    ngx_http_dpd_nixl_decode_body
};


static ngx_int_t
ngx_http_dpd_nixl_prefill_body(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefill_conf_t *pcf, ngx_str_t *body)
{
    char    *text;
    size_t   len;

    text = ngx_http_dpd_proto_prefill_body(&ctx->req, NGX_HTTP_DPD_PROTO_NIXL,
                                           NULL, &len);

    return ngx_http_dpd_proto_text(text, len, body);
}


static ngx_int_t
ngx_http_dpd_nixl_reply(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefill_conf_t *pcf, const char **why)
{
    int                          kind;
    char                        *text;
    cJSON                       *params;
    size_t                       len;
    ngx_str_t                    host;
    const char                  *pull;
    ngx_http_dpd_nixl_ctx_t     *nc;
    ngx_http_dpd_prefill_ctx_t  *p;

    p = &ctx->prefill;

    nc = ngx_pcalloc(r->pool, sizeof(ngx_http_dpd_nixl_ctx_t));
    if (nc == NULL) {
        return NGX_ERROR;
    }

    p->proto_data = nc;

    kind = ngx_http_dpd_proto_parse_reply((char *) p->reply.data,
                                          p->reply.len,
                                          NGX_HTTP_DPD_PROTO_NIXL,
                                          &params, why);

    if (kind == NGX_HTTP_DPD_REPLY_INVALID) {
        return NGX_ABORT;
    }

    host.len = 0;
    host.data = NULL;
    pull = NULL;

    if (params) {
        /* the decoder may pull from the peer that answered or the list */

        if (ngx_http_dpd_peer_host(r->pool, &p->peer, &host) != NGX_OK) {
            cJSON_Delete(params);
            params = NULL;
            *why = "the prefill peer's address is unknown";

        } else {
            pull = ngx_http_dpd_nixl_host(r, ctx, pcf, params, &host);
            if (pull == NULL) {
                cJSON_Delete(params);
                return NGX_ERROR;
            }
        }
    }

    text = ngx_http_dpd_proto_decode_body(&ctx->req, params, pull, &len);

    if (params) {
        cJSON_Delete(params);
    }

    if (ngx_http_dpd_proto_text(text, len, &nc->decode) != NGX_OK) {
        return NGX_ERROR;
    }

    return pull ? NGX_OK : NGX_DECLINED;
}


static ngx_int_t
ngx_http_dpd_nixl_decode_body(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefill_conf_t *pcf, ngx_str_t *body)
{
    ngx_http_dpd_nixl_ctx_t  *nc;

    nc = ctx->prefill.proto_data;

    if (nc == NULL || nc->decode.data == NULL) {
        return NGX_ERROR;
    }

    *body = nc->decode;

    return NGX_OK;
}


/*
 * The remote_host the decoder pulls from: the reply's own (as canonical
 * text) when it is an IP literal that is the prefill peer's address or
 * lies in dpd_nixl_remote_hosts (a side channel on another NIC), else the
 * peer's (a hostname, "localhost", a foreign address: never where a reply
 * says).
 * Returns a NUL-terminated host, or NULL when out of memory.
 */

static const char *
ngx_http_dpd_nixl_host(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefill_conf_t *pcf, cJSON *params, ngx_str_t *peer)
{
    u_char        *s, *text;
    size_t         len, n;
    ngx_addr_t     want, peer_addr;
    const cJSON   *v;
    const char    *why;

    v = cJSON_GetObjectItemCaseSensitive(params, "remote_host");

    if (v == NULL || cJSON_IsNull(v)) {
        /* vLLM always names one: nothing to vet, nothing to warn about */
        return (char *) peer->data;
    }

    why = "is not an IP address";

    if (!cJSON_IsString(v)) {
        why = "is not a string";
        s = (u_char *) "";
        len = 0;
        goto replace;
    }

    s = (u_char *) v->valuestring;
    len = ngx_strlen(s);

    if (len > 2 && s[0] == '[' && s[len - 1] == ']') {
        s++;
        len -= 2;
    }

    ngx_memzero(&want, sizeof(ngx_addr_t));
    ngx_memzero(&peer_addr, sizeof(ngx_addr_t));

    if (len == 0 || len > NGX_SOCKADDR_STRLEN
        || ngx_parse_addr(r->pool, &want, s, len) != NGX_OK)
    {
        goto replace;
    }

    /*
     * kept, it goes on in its canonical text (the same bytes when it was
     * already): "127.0.0.010" is 127.0.0.10 here but 127.0.0.8 to
     * inet_aton(), "[::1]" is "::1" (vLLM adds the brackets itself)
     */

    text = ngx_pnalloc(r->pool, NGX_SOCKADDR_STRLEN + 1);
    if (text == NULL) {
        return NULL;
    }

    len = ngx_sock_ntop(want.sockaddr, want.socklen, text,
                        NGX_SOCKADDR_STRLEN, 0);
    text[len] = '\0';

    if (ngx_parse_addr(r->pool, &peer_addr, peer->data, peer->len) == NGX_OK
        && ngx_cmp_sockaddr(want.sockaddr, want.socklen,
                            peer_addr.sockaddr, peer_addr.socklen, 0)
           == NGX_OK)
    {
        return (char *) text;
    }

    if (pcf->nixl_hosts != NULL
        && ngx_cidr_match(want.sockaddr, pcf->nixl_hosts) == NGX_OK)
    {
        return (char *) text;
    }

    why = pcf->nixl_hosts ? "is neither the prefill peer nor in "
                            "dpd_nixl_remote_hosts"
                          : "is not the prefill peer";

replace:

    /* the engine's text goes to the log: bounded, escaped */

    s = (u_char *) (cJSON_IsString(v) ? v->valuestring : "");
    n = ngx_strlen(s);

    ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                  "dpd: request \"%V\": the prefill reply's remote_host "
                  "\"%V\"%s %s, the decoder pulls from %V instead",
                  &ctx->request_id,
                  ngx_http_dpd_log_text(r->pool, s,
                                ngx_min(n, NGX_HTTP_DPD_NIXL_HOST_SHOWN)),
                  n > NGX_HTTP_DPD_NIXL_HOST_SHOWN ? "..." : "", why, peer);

    return (char *) peer->data;
}


char *
ngx_http_dpd_nixl_remote_hosts(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf)
{
    char  *p = conf;

    ngx_int_t      rc;
    ngx_str_t     *value;
    ngx_uint_t     i;
    ngx_cidr_t    *cidr;
    ngx_array_t  **a;

    a = (ngx_array_t **) (p + cmd->offset);

    if (*a != NGX_CONF_UNSET_PTR) {
        return "is duplicate";
    }

    *a = ngx_array_create(cf->pool, cf->args->nelts - 1, sizeof(ngx_cidr_t));
    if (*a == NULL) {
        return NGX_CONF_ERROR;
    }

    value = cf->args->elts;

    for (i = 1; i < cf->args->nelts; i++) {
        cidr = ngx_array_push(*a);
        if (cidr == NULL) {
            return NGX_CONF_ERROR;
        }

        rc = ngx_ptocidr(&value[i], cidr);

        if (rc == NGX_ERROR || cidr->family == AF_UNIX) {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "invalid address or network \"%V\" in "
                               "\"dpd_nixl_remote_hosts\"", &value[i]);
            return NGX_CONF_ERROR;
        }

        if (rc == NGX_DONE) {
            ngx_conf_log_error(NGX_LOG_WARN, cf, 0,
                               "low address bits of %V are meaningless",
                               &value[i]);
        }
    }

    return NGX_CONF_OK;
}
