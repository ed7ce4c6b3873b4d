/*
 * dpd_protocol lmcache: LMCache PD, the prefiller pushes, as LMCache's
 * own proxy does it (examples/disagg_prefill/disagg_proxy_server.py and
 * lmcache/integration/vllm/vllm_v1_adapter.py; docs/dpd.md).
 *
 *   decoder first  least outstanding in the upstream with dpd_lmcache_ports
 *   prefill body   the prompt as token ids (completions: the gateway's
 *                  tokenizer, the ids vLLM itself makes, specials
 *                  included; ids a client sent go as they are),
 *                  max_tokens 1, stream false and
 *                  "kv_transfer_params": {"ret_first_tok": true,
 *                  "disagg_spec": {"req_id", "receiver_host",
 *                  "receiver_init_port": [..], "receiver_alloc_port": [..]}}
 *                  (one port per decode TP rank, dpd_lmcache_ports)
 *   reply          a JSON object; its kv_transfer_params.first_tok (a token
 *                  id) and choices[0].text (that token's text, as the
 *                  prefill engine detokenized it: what LMCache's proxy
 *                  shows the client) are kept
 *   ready          every decode TP rank's transfer was notified: LMCache's
 *                  sender ranks send ProxyNotif{req_id} (ZeroMQ PUSH,
 *                  msgpack) to pd_proxy_host:pd_proxy_port; the router's
 *                  kv_agent receives them (kv_agent/src/lmcache_notify.c)
 *                  and counts distinct senders of req_id in the state
 *                  table's record (nblocks), which is polled here until it
 *                  reaches the ranks of dpd_lmcache_ports, bounded by
 *                  dpd_kv_wait (then the decode goes anyway, counted)
 *   decode body    the same token ids with first_tok appended and
 *                  max_tokens (max_completion_tokens) minus one, without
 *                  kv_transfer_params, to exactly the pinned decoder; the
 *                  client gets the prefill's first token first: an output
 *                  filter puts it ahead of the decoder's answer (streamed:
 *                  one SSE event before the decoder's; not streamed: in
 *                  front of choices[0].text, usage moved by one token)
 *
 * The first token is carried over only when that is exact: one prompt,
 * n and best_of 1, no echo, no logprobs, max_tokens >= 2, the prefill
 * not finished by it; otherwise the decoder gets the prompt ids with the
 * client's max_tokens and generates every token itself from the pushed
 * KV.  Chat requests are not rewritten (their messages go to both legs;
 * docs/dpd.md says why).
 */

#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "ngx_http_dpd_proto.h"
#include "ngx_http_dpd_balancer.h"
#include "ngx_http_dpd_state.h"


/* a non-streamed decoder reply larger than this is passed on untouched */
#define NGX_HTTP_DPD_LMCACHE_MAX_REPLY  (16 * 1024 * 1024)


typedef struct {
    ngx_str_t                    ids;           /* "[1,2,3" (no "]"): the
                                                   prompt's ids; empty:
                                                   the client's prompt */
    ngx_uint_t                   nranks;        /* decode TP ranks */
    ngx_int_t                    first_tok;     /* -1: none */
    ngx_str_t                    head;          /* streamed: the SSE event
                                                   of the first token;
                                                   not: its text */
    long                         max_tokens;    /* the client's, -1 */
    long                         max_ctokens;   /* max_completion_tokens */

    u_char                      *buf;           /* not streamed: the */
    size_t                       len;           /* decoder's reply */
    size_t                       size;

    unsigned                     exact:1;       /* the first token may be
                                                   carried over */
    unsigned                     append:1;      /* it is */
    unsigned                     stream:1;
    unsigned                     filter:1;      /* rewriting the answer */
    unsigned                     head_sent:1;
} ngx_http_dpd_lmcache_ctx_t;


static ngx_int_t ngx_http_dpd_lmcache_init(ngx_conf_t *cf);
static ngx_int_t ngx_http_dpd_lmcache_prefill_body(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf,
    ngx_str_t *body);
static ngx_int_t ngx_http_dpd_lmcache_prompt(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_lmcache_ctx_t *lc);
static ngx_int_t ngx_http_dpd_lmcache_ids_text(ngx_http_request_t *r,
    ngx_http_dpd_lmcache_ctx_t *lc, const cJSON *arr, const uint32_t *ids,
    size_t n);
static ngx_int_t ngx_http_dpd_lmcache_exact(ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_lmcache_ctx_t *lc);
static long ngx_http_dpd_lmcache_uint(const ngx_http_dpd_req_t *req,
    unsigned key, ngx_int_t *bad);
static ngx_int_t ngx_http_dpd_lmcache_reply(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf,
    const char **why);
static ngx_int_t ngx_http_dpd_lmcache_ready(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf);
static ngx_int_t ngx_http_dpd_lmcache_decode_body(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf,
    ngx_str_t *body);
static ngx_http_dpd_lmcache_ctx_t *ngx_http_dpd_lmcache_get(
    ngx_http_request_t *r);
static ngx_int_t ngx_http_dpd_lmcache_header_filter(ngx_http_request_t *r);
static ngx_int_t ngx_http_dpd_lmcache_body_filter(ngx_http_request_t *r,
    ngx_chain_t *in);
static ngx_int_t ngx_http_dpd_lmcache_gather(ngx_http_request_t *r,
    ngx_http_dpd_lmcache_ctx_t *lc, ngx_buf_t *b);
static ngx_chain_t *ngx_http_dpd_lmcache_rewrite(ngx_http_request_t *r,
    ngx_http_dpd_lmcache_ctx_t *lc);


ngx_http_dpd_proto_t  ngx_http_dpd_proto_lmcache = {
    ngx_string("lmcache"),
    NGX_HTTP_DPD_PROTO_LMCACHE,
    NGX_HTTP_DPD_PROTO_DECODER_FIRST|NGX_HTTP_DPD_PROTO_NEEDS_PORTS,
    ngx_http_dpd_lmcache_init,
    NULL,                                  /* conf */
    NULL,                                  /* chosen */
    ngx_http_dpd_lmcache_prefill_body,
    ngx_http_dpd_lmcache_reply,
    ngx_http_dpd_lmcache_ready,
    ngx_http_dpd_lmcache_decode_body
};


static ngx_http_output_header_filter_pt  ngx_http_next_header_filter;
static ngx_http_output_body_filter_pt    ngx_http_next_body_filter;


static ngx_int_t
ngx_http_dpd_lmcache_init(ngx_conf_t *cf)
{
    ngx_http_next_header_filter = ngx_http_top_header_filter;
    ngx_http_top_header_filter = ngx_http_dpd_lmcache_header_filter;

    ngx_http_next_body_filter = ngx_http_top_body_filter;
    ngx_http_top_body_filter = ngx_http_dpd_lmcache_body_filter;

    return NGX_OK;
}


static ngx_int_t
ngx_http_dpd_lmcache_prefill_body(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf,
    ngx_str_t *body)
{
    char                              *text, *prompt;
    size_t                             len;
    ngx_uint_t                         i;
    in_port_t                         *ip, *ap;
    ngx_http_dpd_pin_t                *pin;
    ngx_http_dpd_lmcache_ctx_t        *lc;
    ngx_http_dpd_lmcache_spec_t        spec;
    ngx_http_dpd_balancer_srv_conf_t  *bscf;
    unsigned short                     init[NGX_HTTP_DPD_MAX_TP_RANKS];
    unsigned short                     alloc[NGX_HTTP_DPD_MAX_TP_RANKS];

    pin = ngx_http_dpd_balancer_get_pin(r);
    bscf = ngx_http_dpd_balancer_srv_conf(pcf->decode_upstream);

    if (pin == NULL || bscf == NULL || bscf->init_ports == NULL) {
        return NGX_ERROR;
    }

    lc = ngx_pcalloc(r->pool, sizeof(ngx_http_dpd_lmcache_ctx_t));
    if (lc == NULL) {
        return NGX_ERROR;
    }

    lc->first_tok = -1;
    lc->max_tokens = -1;
    lc->max_ctokens = -1;
    lc->stream = ctx->stream;
    lc->nranks = bscf->init_ports->nelts;

    ctx->prefill.proto_data = lc;

    ip = bscf->init_ports->elts;
    ap = bscf->alloc_ports->elts;

    for (i = 0; i < bscf->init_ports->nelts; i++) {
        init[i] = ip[i];
        alloc[i] = ap[i];
    }

    spec.req_id = (char *) ngx_http_dpd_cstr(r->pool, &ctx->kv_id);
    spec.receiver_host = (char *) ngx_http_dpd_cstr(r->pool, &pin->host);
    spec.init_ports = init;
    spec.alloc_ports = alloc;
    spec.nports = bscf->init_ports->nelts;

    if (spec.req_id == NULL || spec.receiver_host == NULL) {
        return NGX_ERROR;
    }

    if (ctx->kind == NGX_HTTP_DPD_KIND_COMPLETIONS) {
        if (ngx_http_dpd_lmcache_prompt(r, ctx, lc) != NGX_OK) {
            return NGX_ERROR;
        }
    }

    prompt = NULL;

    if (lc->ids.len) {
        prompt = ngx_pnalloc(r->pool, lc->ids.len + 2);
        if (prompt == NULL) {
            return NGX_ERROR;
        }

        ngx_memcpy(prompt, lc->ids.data, lc->ids.len);
        prompt[lc->ids.len] = ']';
        prompt[lc->ids.len + 1] = '\0';
    }

    text = ngx_http_dpd_proto_lmcache_prefill_body(&ctx->req, prompt, &spec,
                                                   &len);

    return ngx_http_dpd_proto_text(text, len, body);
}


/*
 * The prompt of a completions request as token ids: ids the client sent
 * (one list), or its one text prompt encoded as vLLM encodes it (the
 * gateway's tokenizer, special tokens added).  A batch stays as it is.
 */

static ngx_int_t
ngx_http_dpd_lmcache_prompt(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_lmcache_ctx_t *lc)
{
    long                       n;
    cJSON                     *prompt;
    size_t                     cap;
    uint32_t                  *ids;
    ngx_int_t                  rc;
    const cJSON               *one;
    ngx_http_dpd_loc_conf_t   *dlcf;

    if (ngx_http_dpd_proto_member(&ctx->req, NGX_HTTP_DPD_KEY_PROMPT,
                                  &prompt)
        != 0)
    {
        return NGX_ERROR;
    }

    if (prompt == NULL) {
        return NGX_OK;
    }

    one = prompt;

    if (cJSON_IsArray(prompt) && prompt->child
        && prompt->child->next == NULL
        && (cJSON_IsString(prompt->child) || cJSON_IsArray(prompt->child)))
    {
        /* ["text"] and [[1,2,3]]: one prompt */
        one = prompt->child;
    }

    rc = NGX_OK;

    if (cJSON_IsArray(one) && one->child && cJSON_IsNumber(one->child)) {

        /* ids the client sent (checked against the vocabulary before) */

        rc = ngx_http_dpd_lmcache_ids_text(r, lc, one, NULL, 0);

    } else if (cJSON_IsString(one)) {

        /* the location's tokenizer: the one that counted the prompt */

        dlcf = ngx_http_get_module_loc_conf(r->main, ngx_http_dpd_module);

        if (dlcf->tokenizer == NULL) {
            goto done;
        }

        cap = (ctx->prompt_tokens > 0) ? (size_t) ctx->prompt_tokens + 16
                                       : 256;

        for ( ;; ) {
            ids = ngx_alloc(cap * sizeof(uint32_t), r->connection->log);
            if (ids == NULL) {
                rc = NGX_ERROR;
                goto done;
            }

            n = dpd_tok_encode(dlcf->tokenizer->tok, one->valuestring,
                               ngx_strlen(one->valuestring), 1, ids, cap);

            if (n >= 0 && (size_t) n > cap) {
                ngx_free(ids);
                cap = (size_t) n;
                continue;
            }

            break;
        }

        if (n > 0) {
            rc = ngx_http_dpd_lmcache_ids_text(r, lc, NULL, ids, (size_t) n);
        }

        ngx_free(ids);
    }

    if (rc == NGX_OK && lc->ids.len) {
        rc = ngx_http_dpd_lmcache_exact(ctx, lc);
    }

done:

    cJSON_Delete(prompt);

    return rc;
}


/* "[1,2,3" into lc->ids, from a cJSON array or from n ids */

static ngx_int_t
ngx_http_dpd_lmcache_ids_text(ngx_http_request_t *r,
    ngx_http_dpd_lmcache_ctx_t *lc, const cJSON *arr, const uint32_t *ids,
    size_t n)
{
    u_char       *p;
    size_t        i;
    const cJSON  *c;

    if (arr) {
        n = 0;

        for (c = arr->child; c; c = c->next) {
            if (!cJSON_IsNumber(c) || c->valuedouble < 0
                || c->valuedouble > 4294967295.0)
            {
                return NGX_OK;
            }

            n++;
        }
    }

    if (n == 0) {
        return NGX_OK;
    }

    /* 10 digits and a separator per id, "]" and first_tok added later */

    lc->ids.data = ngx_pnalloc(r->pool, n * 11 + 1);
    if (lc->ids.data == NULL) {
        return NGX_ERROR;
    }

    p = lc->ids.data;
    c = arr ? arr->child : NULL;

    for (i = 0; i < n; i++) {
        *p++ = (i == 0) ? '[' : ',';
        p = ngx_sprintf(p, "%uD",
                        arr ? (uint32_t) c->valuedouble : ids[i]);

        if (c) {
            c = c->next;
        }
    }

    lc->ids.len = p - lc->ids.data;

    return NGX_OK;
}


/*
 * The decoder may continue after the prefill's token only where the answer
 * is the same as one engine's: one choice, no echo of the prompt, no
 * logprobs (the first token's would be missing), room for a second token.
 */

static ngx_int_t
ngx_http_dpd_lmcache_exact(ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_lmcache_ctx_t *lc)
{
    long          v;
    cJSON        *item;
    ngx_int_t     bad;

    bad = 0;

    lc->max_tokens = ngx_http_dpd_lmcache_uint(&ctx->req,
                                      NGX_HTTP_DPD_KEY_MAX_TOKENS, &bad);
    lc->max_ctokens = ngx_http_dpd_lmcache_uint(&ctx->req,
                                      NGX_HTTP_DPD_KEY_MAX_COMPLETION_TOKENS,
                                      &bad);

    v = ngx_http_dpd_lmcache_uint(&ctx->req, NGX_HTTP_DPD_KEY_N, &bad);
    if (v > 1 && bad == 0) {
        bad = 1;
    }

    v = ngx_http_dpd_lmcache_uint(&ctx->req, NGX_HTTP_DPD_KEY_BEST_OF, &bad);
    if (v > 1 && bad == 0) {
        bad = 1;
    }

    if (bad == NGX_ERROR) {
        return NGX_ERROR;
    }

    if (ngx_http_dpd_proto_member(&ctx->req, NGX_HTTP_DPD_KEY_ECHO, &item)
        != 0)
    {
        return NGX_ERROR;
    }

    if (item && !cJSON_IsFalse(item) && !cJSON_IsNull(item)) {
        bad = 1;
    }

    cJSON_Delete(item);

    if (ngx_http_dpd_proto_member(&ctx->req, NGX_HTTP_DPD_KEY_LOGPROBS,
                                  &item)
        != 0)
    {
        return NGX_ERROR;
    }

    if (item && !cJSON_IsFalse(item) && !cJSON_IsNull(item)) {
        bad = 1;
    }

    cJSON_Delete(item);

    /* the limit that counts: max_completion_tokens wins where both are */

    v = (lc->max_ctokens >= 0) ? lc->max_ctokens : lc->max_tokens;

    lc->exact = (!bad && v >= 2);

    return NGX_OK;
}


/* a member's non-negative integer value, -1 when absent; *bad = 1 when
 * present and not one, NGX_ERROR when out of memory */

static long
ngx_http_dpd_lmcache_uint(const ngx_http_dpd_req_t *req, unsigned key,
    ngx_int_t *bad)
{
    long    v;
    cJSON  *item;

    if (ngx_http_dpd_proto_member(req, key, &item) != 0) {
        *bad = NGX_ERROR;
        return -1;
    }

    if (item == NULL || cJSON_IsNull(item)) {
        cJSON_Delete(item);
        return -1;
    }

    v = -1;

    if (cJSON_IsNumber(item) && item->valuedouble >= 0
        && item->valuedouble < 2147483647.0
        && (double) (long) item->valuedouble == item->valuedouble)
    {
        v = (long) item->valuedouble;

    } else if (*bad == 0) {
        *bad = 1;
    }

    cJSON_Delete(item);

    return v;
}


/* the prefill's first token: kept when it can be carried over */

static ngx_int_t
ngx_http_dpd_lmcache_reply(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefill_conf_t *pcf, const char **why)
{
    char                        *ev;
    cJSON                       *reply, *head, *ch, *c;
    size_t                       len;
    uint32_t                     vocab;
    const cJSON                 *ktp, *tok, *choice, *text, *fin;
    ngx_http_dpd_loc_conf_t     *dlcf;
    ngx_http_dpd_lmcache_ctx_t  *lc;
    ngx_http_dpd_prefill_ctx_t  *p;

    p = &ctx->prefill;
    lc = p->proto_data;

    reply = ngx_http_dpd_proto_parse_object((char *) p->reply.data,
                                            p->reply.len);
    if (reply == NULL) {
        *why = "prefill reply is not a JSON object";
        return NGX_ABORT;
    }

    /* the prefiller pushes the KV whatever the reply says: wait for it */

    if (!lc->exact) {
        cJSON_Delete(reply);
        return NGX_OK;
    }

    dlcf = ngx_http_get_module_loc_conf(r->main, ngx_http_dpd_module);
    vocab = dlcf->tokenizer ? dpd_tok_vocab_size(dlcf->tokenizer->tok) : 0;

    ktp = cJSON_GetObjectItemCaseSensitive(reply, "kv_transfer_params");
    tok = cJSON_GetObjectItemCaseSensitive(ktp, "first_tok");
    choice = cJSON_GetArrayItem(
                 cJSON_GetObjectItemCaseSensitive(reply, "choices"), 0);
    text = cJSON_GetObjectItemCaseSensitive(choice, "text");
    fin = cJSON_GetObjectItemCaseSensitive(choice, "finish_reason");

    if (!cJSON_IsNumber(tok) || tok->valuedouble < 0
        || tok->valuedouble >= (double) vocab
        || (double) (ngx_int_t) tok->valuedouble != tok->valuedouble
        || !cJSON_IsString(text))
    {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "dpd: lmcache: the prefill reply of request \"%V\" "
                      "has no usable kv_transfer_params.first_tok or "
                      "choices[0].text, the decoder generates the first "
                      "token itself", &ctx->request_id);
        cJSON_Delete(reply);
        return NGX_OK;
    }

    if (cJSON_IsString(fin) && ngx_strcmp(fin->valuestring, "length") != 0)
    {
        /* the first token ended the answer (a stop): nothing follows it */
        cJSON_Delete(reply);
        return NGX_OK;
    }

    lc->first_tok = (ngx_int_t) tok->valuedouble;

    if (!lc->stream) {
        len = ngx_strlen(text->valuestring);

        lc->head.data = ngx_pnalloc(r->pool, len);
        if (lc->head.data == NULL) {
            cJSON_Delete(reply);
            return NGX_ERROR;
        }

        ngx_memcpy(lc->head.data, text->valuestring, len);
        lc->head.len = len;
        lc->append = 1;

        cJSON_Delete(reply);
        return NGX_OK;
    }

    /* the event LMCache's proxy sends first, from the prefill's answer */

    head = cJSON_CreateObject();
    ch = cJSON_CreateArray();
    c = cJSON_CreateObject();

    if (head == NULL || ch == NULL || c == NULL) {
        goto failed;
    }

    if (!cJSON_AddItemReferenceToObject(head, "id",
                     cJSON_GetObjectItemCaseSensitive(reply, "id"))
        && cJSON_AddNullToObject(head, "id") == NULL)
    {
        goto failed;
    }

    if (cJSON_AddStringToObject(head, "object", "text_completion") == NULL) {
        goto failed;
    }

    if (!cJSON_AddItemReferenceToObject(head, "created",
                     cJSON_GetObjectItemCaseSensitive(reply, "created"))
        && cJSON_AddNullToObject(head, "created") == NULL)
    {
        goto failed;
    }

    if (!cJSON_AddItemReferenceToObject(head, "model",
                     cJSON_GetObjectItemCaseSensitive(reply, "model"))
        && cJSON_AddNullToObject(head, "model") == NULL)
    {
        goto failed;
    }

    cJSON_AddItemToArray(ch, c);
    cJSON_AddItemToObject(head, "choices", ch);
    ch = NULL;

    if (cJSON_AddNumberToObject(c, "index", 0) == NULL
        || cJSON_AddStringToObject(c, "text", text->valuestring) == NULL
        || cJSON_AddNullToObject(c, "logprobs") == NULL
        || cJSON_AddNullToObject(c, "finish_reason") == NULL
        || cJSON_AddNullToObject(c, "stop_reason") == NULL
        || cJSON_AddNullToObject(head, "usage") == NULL)
    {
        c = NULL;
        goto failed;
    }

    c = NULL;

    ev = cJSON_PrintUnformatted(head);
    cJSON_Delete(head);
    head = NULL;

    if (ev == NULL) {
        goto failed;
    }

    len = ngx_strlen(ev);

    lc->head.data = ngx_pnalloc(r->pool, sizeof("data: \n\n") - 1 + len);
    if (lc->head.data == NULL) {
        cJSON_free(ev);
        goto failed;
    }

    lc->head.len = ngx_sprintf(lc->head.data, "data: %*s\n\n", len, ev)
                   - lc->head.data;
    cJSON_free(ev);

    lc->append = 1;

    cJSON_Delete(reply);

    return NGX_OK;

failed:

    cJSON_Delete(c);
    cJSON_Delete(ch);
    cJSON_Delete(head);
    cJSON_Delete(reply);

    return NGX_ERROR;
}


/*
 * The notices of every decode TP rank counted (the router's kv_agent
 * keeps the number of distinct senders of req_id in the record's nblocks;
 * a record with a node id is a kv_agent transfer, not ours).
 */

static ngx_int_t
ngx_http_dpd_lmcache_ready(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefill_conf_t *pcf)
{
    ngx_http_dpd_state_req_t     rec;
    ngx_http_dpd_lmcache_ctx_t  *lc;
    ngx_http_dpd_prefill_ctx_t  *p;

    p = &ctx->prefill;
    lc = p->proto_data;

    if (!ngx_http_dpd_state_enabled(r)) {
        /* no notices can reach us: LMCache's proxy without its PULL
         * socket; not a fault of this request (logged at info) */
        p->kv = NGX_HTTP_DPD_KV_NO_TABLE;
        p->quiet = 1;
        return NGX_OK;
    }

    if (ngx_http_dpd_state_request(r, &ctx->kv_id, &rec) != NGX_OK
        || rec.node_id[0] != '\0'
        || ngx_strcmp(rec.peer_id, "lmcache") != 0)
    {
        return NGX_AGAIN;
    }

    p->kv_state = rec.state;

    if (rec.state == DPD_REQ_FAILED) {
        p->kv = NGX_HTTP_DPD_KV_FAILED;
        return NGX_OK;
    }

    if (rec.nblocks >= lc->nranks) {
        p->kv = NGX_HTTP_DPD_KV_READY;
        return NGX_OK;
    }

    return NGX_AGAIN;
}


/*
 * The prompt ids (and the prefill's first token), max_tokens minus one.
 * The same for a decode retry on another decoder: it has no pushed KV and
 * recomputes the prompt, but the answer still continues the prefill's
 * first token the client was (or will be) shown.
 */

static ngx_int_t
ngx_http_dpd_lmcache_decode_body(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefill_conf_t *pcf,
    ngx_str_t *body)
{
    char                        *text, *prompt;
    u_char                      *q;
    size_t                       len;
    ngx_http_dpd_lmcache_ctx_t  *lc;

    lc = ctx->prefill.proto_data;

    if (lc == NULL || lc->ids.len == 0) {
        text = ngx_http_dpd_proto_decode_body(&ctx->req, NULL, NULL, &len);
        return ngx_http_dpd_proto_text(text, len, body);
    }

    prompt = ngx_pnalloc(r->pool, lc->ids.len + NGX_INT_T_LEN + 3);
    if (prompt == NULL) {
        return NGX_ERROR;
    }

    q = ngx_cpymem(prompt, lc->ids.data, lc->ids.len);

    if (lc->append) {
        q = ngx_sprintf(q, ",%i", lc->first_tok);
    }

    *q++ = ']';
    *q = '\0';

    text = ngx_http_dpd_proto_lmcache_decode_body(&ctx->req, prompt,
               (lc->append && lc->max_tokens >= 1) ? lc->max_tokens - 1 : -1,
               (lc->append && lc->max_ctokens >= 1) ? lc->max_ctokens - 1 : -1,
               &len);

    return ngx_http_dpd_proto_text(text, len, body);
}


/* the first token ahead of the decoder's answer */

static ngx_http_dpd_lmcache_ctx_t *
ngx_http_dpd_lmcache_get(ngx_http_request_t *r)
{
    ngx_http_dpd_ctx_t          *ctx;
    ngx_http_dpd_lmcache_ctx_t  *lc;

    if (r != r->main) {
        return NULL;
    }

    ctx = ngx_http_dpd_get_ctx(r);

    if (ctx == NULL || ctx->prefill.proto != &ngx_http_dpd_proto_lmcache
        || ctx->prefill.state != NGX_HTTP_DPD_PREFILL_FINISHED)
    {
        return NULL;
    }

    lc = ctx->prefill.proto_data;

    return (lc && lc->append) ? lc : NULL;
}


static ngx_int_t
ngx_http_dpd_lmcache_header_filter(ngx_http_request_t *r)
{
    ngx_http_dpd_lmcache_ctx_t  *lc;

    lc = ngx_http_dpd_lmcache_get(r);

    if (lc == NULL || lc->filter || lc->head_sent) {
        return ngx_http_next_header_filter(r);
    }

    /* the decoder's own answer only: not an error page, not a 4xx */

    if (r->headers_out.status != NGX_HTTP_OK || r->upstream == NULL) {
        lc->append = 0;
        return ngx_http_next_header_filter(r);
    }

    lc->filter = 1;

    ngx_http_clear_content_length(r);
    ngx_http_clear_accept_ranges(r);
    ngx_http_weak_etag(r);

    return ngx_http_next_header_filter(r);
}


static ngx_int_t
ngx_http_dpd_lmcache_body_filter(ngx_http_request_t *r, ngx_chain_t *in)
{
    ngx_buf_t                   *b;
    ngx_chain_t                 *cl, *out;
    ngx_uint_t                   last;
    ngx_http_dpd_lmcache_ctx_t  *lc;

    lc = ngx_http_dpd_lmcache_get(r);

    if (lc == NULL || !lc->filter) {
        return ngx_http_next_body_filter(r, in);
    }

    if (lc->stream) {

        /* one SSE event ahead of the decoder's first bytes */

        if (lc->head_sent || in == NULL) {
            return ngx_http_next_body_filter(r, in);
        }

        b = ngx_calloc_buf(r->pool);
        cl = ngx_alloc_chain_link(r->pool);

        if (b == NULL || cl == NULL) {
            return NGX_ERROR;
        }

        b->pos = lc->head.data;
        b->last = lc->head.data + lc->head.len;
        b->memory = 1;
        b->flush = 1;

        cl->buf = b;
        cl->next = in;

        lc->head_sent = 1;

        return ngx_http_next_body_filter(r, cl);
    }

    /* not streamed: gather the whole reply, then rewrite it once */

    last = 0;

    for (cl = in; cl; cl = cl->next) {
        b = cl->buf;

        if (ngx_http_dpd_lmcache_gather(r, lc, b) != NGX_OK) {
            return NGX_ERROR;
        }

        if (!lc->filter) {
            /* too large: what was gathered goes on as it came, then the
             * rest */

            b = ngx_calloc_buf(r->pool);
            out = ngx_alloc_chain_link(r->pool);

            if (b == NULL || out == NULL) {
                return NGX_ERROR;
            }

            b->pos = lc->buf;
            b->last = lc->buf + lc->len;
            b->memory = (lc->len != 0);
            b->sync = (lc->len == 0);

            out->buf = b;
            out->next = cl;

            return ngx_http_next_body_filter(r, out);
        }

        if (b->last_buf) {
            last = 1;
        }
    }

    if (!last) {
        return NGX_OK;
    }

    out = ngx_http_dpd_lmcache_rewrite(r, lc);
    if (out == NULL) {
        return NGX_ERROR;
    }

    lc->filter = 0;
    lc->head_sent = 1;

    return ngx_http_next_body_filter(r, out);
}


/*
 * Appends b's bytes (memory or file) to lc->buf and marks b consumed.
 * Over NGX_HTTP_DPD_LMCACHE_MAX_REPLY: lc->filter is cleared and b is
 * left as it is.
 */

static ngx_int_t
ngx_http_dpd_lmcache_gather(ngx_http_request_t *r,
    ngx_http_dpd_lmcache_ctx_t *lc, ngx_buf_t *b)
{
    off_t     size;
    u_char   *nb;
    ssize_t   n;
    size_t    want;

    size = ngx_buf_size(b);

    if (size == 0) {
        return NGX_OK;
    }

    if ((off_t) lc->len + size > NGX_HTTP_DPD_LMCACHE_MAX_REPLY) {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "dpd: lmcache: decoder reply over %uz bytes, sent "
                      "without the prefill's first token",
                      (size_t) NGX_HTTP_DPD_LMCACHE_MAX_REPLY);
        lc->filter = 0;
        return NGX_OK;
    }

    want = lc->len + (size_t) size;

    if (want > lc->size) {
        lc->size = ngx_max(want, 2 * lc->size);
        lc->size = ngx_max(lc->size, 4096);

        nb = ngx_pnalloc(r->pool, lc->size);
        if (nb == NULL) {
            return NGX_ERROR;
        }

        if (lc->len) {
            ngx_memcpy(nb, lc->buf, lc->len);
        }

        lc->buf = nb;
    }

    if (ngx_buf_in_memory(b)) {
        ngx_memcpy(lc->buf + lc->len, b->pos, (size_t) size);
        b->pos = b->last;

    } else {
        n = ngx_read_file(b->file, lc->buf + lc->len, (size_t) size,
                          b->file_pos);

        if (n != (ssize_t) size) {
            return NGX_ERROR;
        }

        b->file_pos = b->file_last;
    }

    lc->len += (size_t) size;

    return NGX_OK;
}


/*
 * {"choices":[{"text":T}], "usage":{"prompt_tokens":P+1,
 * "completion_tokens":C}} from the decoder becomes text = first + T,
 * prompt_tokens P, completion_tokens C+1: what one engine would have said.
 * A reply that is not such an object goes on unchanged.
 */

static ngx_chain_t *
ngx_http_dpd_lmcache_rewrite(ngx_http_request_t *r,
    ngx_http_dpd_lmcache_ctx_t *lc)
{
    char         *text, *joined;
    cJSON        *reply, *choice, *t, *usage, *v;
    size_t        len, tl;
    ngx_buf_t    *b;
    ngx_chain_t  *out;

    b = ngx_calloc_buf(r->pool);
    out = ngx_alloc_chain_link(r->pool);

    if (b == NULL || out == NULL) {
        return NULL;
    }

    out->buf = b;
    out->next = NULL;

    b->last_buf = 1;
    b->last_in_chain = 1;

    reply = ngx_http_dpd_proto_parse_object((char *) lc->buf, lc->len);
    choice = cJSON_GetArrayItem(
                 cJSON_GetObjectItemCaseSensitive(reply, "choices"), 0);
    t = cJSON_GetObjectItemCaseSensitive(choice, "text");

    text = NULL;

    if (cJSON_IsString(t)) {
        tl = ngx_strlen(t->valuestring);

        joined = cJSON_malloc(lc->head.len + tl + 1);

        if (joined) {
            ngx_memcpy(joined, lc->head.data, lc->head.len);
            ngx_memcpy(joined + lc->head.len, t->valuestring, tl + 1);

            cJSON_free(t->valuestring);
            t->valuestring = joined;

            usage = cJSON_GetObjectItemCaseSensitive(reply, "usage");

            v = cJSON_GetObjectItemCaseSensitive(usage, "prompt_tokens");
            if (cJSON_IsNumber(v) && v->valuedouble >= 1) {
                cJSON_SetNumberValue(v, v->valuedouble - 1);
            }

            v = cJSON_GetObjectItemCaseSensitive(usage, "completion_tokens");
            if (cJSON_IsNumber(v)) {
                cJSON_SetNumberValue(v, v->valuedouble + 1);
            }

            text = cJSON_PrintUnformatted(reply);
        }
    }

    cJSON_Delete(reply);

    if (text == NULL) {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "dpd: lmcache: decoder reply is not a completion, "
                      "sent without the prefill's first token");

        b->pos = lc->buf;
        b->last = lc->buf + lc->len;
        b->memory = (lc->len != 0);
        return out;
    }

    len = ngx_strlen(text);

    b->pos = ngx_pnalloc(r->pool, len ? len : 1);
    if (b->pos == NULL) {
        cJSON_free(text);
        return NULL;
    }

    b->last = ngx_cpymem(b->pos, text, len);
    b->memory = 1;

    cJSON_free(text);

    return out;
}
