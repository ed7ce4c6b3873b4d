/*
 * OpenAI requests in ngx_http_dpd_module: validate the body (UTF-8, JSON
 * nesting), parse it once with cJSON, and count the prompt tokens as vLLM
 * reports them in usage.prompt_tokens:
 *
 *   /v1/completions       "prompt": a string (tokenized with the specials
 *                         the tokenizer's post-processor adds, e.g. BOS for
 *                         Llama 3), an array of strings (each one so), an
 *                         array of token ids or an array of token-id arrays
 *                         (ids counted and range-checked, not re-tokenized);
 *   /v1/chat/completions  "messages": the rendered chat template, which
 *                         carries its own specials, nothing added.
 *
 * Bad input sets ctx->err_* (status 400, the metric reason, a message); the
 * phase handler answers it with an OpenAI-shaped error.
 */


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include <math.h>
#include <stdio.h>

#include "ngx_http_dpd_module.h"

/* the loaded tokenizer's normalizers, pre-tokenizers and post-processor,
 * read once at configuration time for the dpd_count bound */


#define NGX_HTTP_DPD_ERR_MSG_LEN  512


static ngx_int_t ngx_http_dpd_reject(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_uint_t reason, const char *fmt, ...);
static ngx_int_t ngx_http_dpd_json_scan(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, u_char *data, size_t len, ngx_uint_t max_depth);
static ngx_int_t ngx_http_dpd_parse(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx);
static ngx_int_t ngx_http_dpd_count_completions(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_main_conf_t *dmcf,
    ngx_http_dpd_loc_conf_t *dlcf);
static ngx_int_t ngx_http_dpd_count_ids(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, const cJSON *arr, uint32_t vocab,
    ngx_int_t outer, ngx_int_t *total);
static ngx_int_t ngx_http_dpd_count_chat(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_main_conf_t *dmcf,
    ngx_http_dpd_loc_conf_t *dlcf, dpd_chat_template_t tmpl);
static cJSON *ngx_http_dpd_chat_text_only(const cJSON *messages);
static ngx_int_t ngx_http_dpd_check_messages(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, const cJSON *messages);
static uint64_t ngx_http_dpd_text_bound(ngx_http_dpd_main_conf_t *dmcf,
    const u_char *text, size_t len, ngx_uint_t add_special);
static ngx_uint_t ngx_http_dpd_bound_skips(ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_loc_conf_t *dlcf, uint64_t bound);


/*
 * dpd_count bound: ids <= (ascii bytes + other bytes * G) * P + specials,
 * with G, P and the specials from the tokenizer (dpd_tok_bound_params(),
 * which says why it holds).  A tokenizer the bound cannot describe gets
 * factor 0: always exact.
 */

void
ngx_http_dpd_count_bound_init(ngx_http_dpd_main_conf_t *dmcf)
{
    dpd_tok_bound_t  b;

    if (dpd_tok_bound_params(dmcf->tok, &b) != 0) {
        /* a pipeline the bound cannot describe: always count exactly */
        dmcf->bound_other = 0;
        dmcf->bound_prefix = 0;
        dmcf->bound_specials = 0;
        return;
    }

    dmcf->bound_other = b.other_factor;
    dmcf->bound_prefix = b.prefix_factor;
    dmcf->bound_specials = b.specials;
}


/* UINT64_MAX: no bound for this tokenizer */

static uint64_t
ngx_http_dpd_text_bound(ngx_http_dpd_main_conf_t *dmcf, const u_char *text,
    size_t len, ngx_uint_t add_special)
{
    size_t         other;
    const u_char  *p, *end;

    if (dmcf->bound_prefix == 0) {
        return UINT64_MAX;
    }

    other = 0;

    if (dmcf->bound_other != 1) {
        end = text + len;

        for (p = text; p < end; p++) {
            other += (*p >> 7);
        }
    }

    return ((uint64_t) (len - other) + (uint64_t) other * dmcf->bound_other)
           * dmcf->bound_prefix
           + (add_special ? dmcf->bound_specials : 0);
}


/* bound mode and the bound below the threshold: no exact count needed */

static ngx_uint_t
ngx_http_dpd_bound_skips(ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_loc_conf_t *dlcf, uint64_t bound)
{
    if (bound > (uint64_t) NGX_MAX_INT_T_VALUE) {
        return 0;
    }

    ctx->prompt_bound = (ngx_int_t) bound;

    if (dlcf->threshold > 0 && ctx->prompt_bound < dlcf->threshold) {
        ctx->count_skipped = 1;
        return 1;
    }

    return 0;
}


ngx_int_t
ngx_http_dpd_openai_process(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_main_conf_t *dmcf, ngx_http_dpd_loc_conf_t *dlcf)
{
    ngx_int_t            rc;
    const cJSON         *stream;
    dpd_chat_template_t  tmpl;

    if (ngx_http_dpd_body_bytes(r, &ctx->body) != NGX_OK) {
        return NGX_ERROR;
    }

    if (ctx->body.len == 0) {
        return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_EMPTY_BODY,
                                   "the request body is empty: expected a "
                                   "JSON object");
    }

    rc = ngx_http_dpd_json_scan(r, ctx, ctx->body.data, ctx->body.len,
                                (ngx_uint_t) dlcf->max_json_depth);
    if (rc != NGX_OK || ctx->err_status) {
        return rc;
    }

    rc = ngx_http_dpd_parse(r, ctx);
    if (rc != NGX_OK || ctx->err_status) {
        return rc;
    }

    /* transfer metadata is the gateway's business, never the client's */

    if (cJSON_GetObjectItemCaseSensitive(ctx->json, "kv_transfer_params")) {
        cJSON_DeleteItemFromObjectCaseSensitive(ctx->json,
                                                "kv_transfer_params");
        ctx->kv_stripped = 1;
        ngx_http_dpd_metrics_inc(r, NGX_HTTP_DPD_M_KV_STRIPPED);

        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "dpd: client \"kv_transfer_params\" removed");
    }

    stream = cJSON_GetObjectItemCaseSensitive(ctx->json, "stream");
    ctx->stream = cJSON_IsTrue(stream) ? 1 : 0;

    if (ctx->kind == NGX_HTTP_DPD_KIND_CHAT) {
        tmpl = (dpd_chat_template_t) dlcf->chat_template;
        if (tmpl == DPD_CHAT_AUTO) {
            tmpl = dmcf->tok_template;
        }

        return ngx_http_dpd_count_chat(r, ctx, dmcf, dlcf, tmpl);
    }

    return ngx_http_dpd_count_completions(r, ctx, dmcf, dlcf);
}


static ngx_int_t
ngx_http_dpd_reject(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_uint_t reason, const char *fmt, ...)
{
    u_char   *p, *last;
    va_list   args;

    ctx->err_message = ngx_pnalloc(r->pool, NGX_HTTP_DPD_ERR_MSG_LEN);
    if (ctx->err_message == NULL) {
        return NGX_ERROR;
    }

    last = ctx->err_message + NGX_HTTP_DPD_ERR_MSG_LEN - 1;

    va_start(args, fmt);
    p = ngx_vslprintf(ctx->err_message, last, fmt, args);
    va_end(args);

    *p = '\0';

    ctx->err_status = NGX_HTTP_BAD_REQUEST;
    ctx->err_reason = reason;
    ctx->err_type = "invalid_request_error";

    return NGX_OK;
}


/*
 * One pass over the raw body before cJSON sees it: the text must be UTF-8
 * (RFC 8259; cJSON does not check), strings must not hold raw control
 * characters, and arrays/objects must not nest deeper than
 * dpd_max_json_depth (bounds the parser's recursion).
 */

static ngx_int_t
ngx_http_dpd_json_scan(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    u_char *data, size_t len, ngx_uint_t max_depth)
{
    u_char      c, lo, hi, *p, *end;
    ngx_uint_t  depth, in_str, n;

    p = data;
    end = data + len;
    depth = 0;
    in_str = 0;

    while (p < end) {
        c = *p;

        if (c < 0x80) {

            if (in_str) {
                if (c == '"') {
                    in_str = 0;

                } else if (c == '\\') {
                    /* skip the escaped character if it is ASCII */
                    if (p + 1 < end && p[1] < 0x80) {
                        p++;
                    }

                } else if (c < 0x20) {
                    return ngx_http_dpd_reject(r, ctx,
                               NGX_HTTP_DPD_E_MALFORMED_JSON,
                               "malformed JSON: unescaped control character "
                               "in a string at byte %uz", (size_t) (p - data));
                }

            } else if (c == '"') {
                in_str = 1;

            } else if (c == '[' || c == '{') {
                if (++depth > max_depth) {
                    return ngx_http_dpd_reject(r, ctx,
                               NGX_HTTP_DPD_E_TOO_DEEP,
                               "JSON nesting deeper than %ui levels",
                               max_depth);
                }

            } else if ((c == ']' || c == '}') && depth > 0) {
                depth--;
            }

            p++;
            continue;
        }

        /* a multi-byte sequence: lead byte, range of the second byte */

        lo = 0x80;
        hi = 0xbf;

        if (c >= 0xc2 && c <= 0xdf) {
            n = 1;

        } else if (c >= 0xe0 && c <= 0xef) {
            n = 2;
            if (c == 0xe0) {
                lo = 0xa0;              /* no overlong forms */
            } else if (c == 0xed) {
                hi = 0x9f;              /* no UTF-16 surrogates */
            }

        } else if (c >= 0xf0 && c <= 0xf4) {
            n = 3;
            if (c == 0xf0) {
                lo = 0x90;
            } else if (c == 0xf4) {
                hi = 0x8f;              /* nothing above U+10FFFF */
            }

        } else {
            goto invalid;
        }

        if ((size_t) (end - p) <= n || p[1] < lo || p[1] > hi) {
            goto invalid;
        }

        if (n >= 2 && (p[2] & 0xc0) != 0x80) {
            goto invalid;
        }

        if (n == 3 && (p[3] & 0xc0) != 0x80) {
            goto invalid;
        }

        p += n + 1;
    }

    return NGX_OK;

invalid:

    return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_INVALID_UTF8,
                               "the request body is not valid UTF-8 "
                               "(byte %uz)", (size_t) (p - data));
}


static ngx_int_t
ngx_http_dpd_parse(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx)
{
    u_char      *p, *end;
    const char  *parse_end;

    parse_end = NULL;

    ctx->json = cJSON_ParseWithLengthOpts((const char *) ctx->body.data,
                                          ctx->body.len, &parse_end, 0);

    if (ctx->json == NULL) {
        if (parse_end == NULL
            || parse_end < (const char *) ctx->body.data
            || parse_end > (const char *) ctx->body.data + ctx->body.len)
        {
            parse_end = (const char *) ctx->body.data;
        }

        return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_MALFORMED_JSON,
                                   "malformed JSON in the request body "
                                   "near byte %uz",
                                   (size_t) (parse_end
                                             - (const char *) ctx->body.data));
    }

    /* nothing but white space may follow the value */

    p = (u_char *) parse_end;
    end = ctx->body.data + ctx->body.len;

    while (p < end
           && (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n'))
    {
        p++;
    }

    if (p < end) {
        return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_MALFORMED_JSON,
                                   "malformed JSON: unexpected data after "
                                   "the value at byte %uz",
                                   (size_t) (p - ctx->body.data));
    }

    if (!cJSON_IsObject(ctx->json)) {
        return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_INVALID_FIELD,
                                   "the request body must be a JSON object");
    }

    return NGX_OK;
}


static ngx_int_t
ngx_http_dpd_count_completions(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_main_conf_t *dmcf, ngx_http_dpd_loc_conf_t *dlcf)
{
    long              n;
    uint32_t          vocab;
    uint64_t          bound, b;
    ngx_int_t         i, total, rc;
    const cJSON      *prompt, *item, *first;
    const dpd_tok_t  *tok;

    tok = dmcf->tok;

    prompt = cJSON_GetObjectItemCaseSensitive(ctx->json, "prompt");

    if (prompt == NULL) {
        return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_INVALID_FIELD,
                                   "field \"prompt\" is required");
    }

    if (cJSON_IsString(prompt)) {
        if (dlcf->count == NGX_HTTP_DPD_COUNT_BOUND
            && ngx_http_dpd_bound_skips(ctx, dlcf,
                   ngx_http_dpd_text_bound(dmcf,
                                           (u_char *) prompt->valuestring,
                                           ngx_strlen(prompt->valuestring),
                                           1)))
        {
            return NGX_OK;
        }

        n = dpd_tok_count(tok, prompt->valuestring,
                          ngx_strlen(prompt->valuestring), 1);
        if (n < 0) {
            return NGX_ERROR;
        }

        ctx->prompt_tokens = n;
        return NGX_OK;
    }

    if (!cJSON_IsArray(prompt)) {
        goto wrong_type;
    }

    first = prompt->child;

    if (first == NULL) {
        return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_INVALID_FIELD,
                                   "field \"prompt\" must not be empty");
    }

    vocab = dpd_tok_vocab_size(tok);
    total = 0;

    if (cJSON_IsString(first)) {
        /* a batch of prompts: each tokenized with its specials */

        i = 0;
        bound = 0;

        for (item = first; item; item = item->next, i++) {
            if (!cJSON_IsString(item)) {
                return ngx_http_dpd_reject(r, ctx,
                           NGX_HTTP_DPD_E_INVALID_FIELD,
                           "prompt[%i]: expected a string like the other "
                           "elements", i);
            }

            if (dlcf->count == NGX_HTTP_DPD_COUNT_BOUND
                && bound != UINT64_MAX)
            {
                b = ngx_http_dpd_text_bound(dmcf,
                                            (u_char *) item->valuestring,
                                            ngx_strlen(item->valuestring),
                                            1);
                bound = (b > UINT64_MAX - bound) ? UINT64_MAX : bound + b;
            }
        }

        if (dlcf->count == NGX_HTTP_DPD_COUNT_BOUND
            && ngx_http_dpd_bound_skips(ctx, dlcf, bound))
        {
            return NGX_OK;
        }

        for (item = first; item; item = item->next) {
            n = dpd_tok_count(tok, item->valuestring,
                              ngx_strlen(item->valuestring), 1);
            if (n < 0) {
                return NGX_ERROR;
            }

            total += n;
        }

        ctx->prompt_tokens = total;
        return NGX_OK;
    }

    if (cJSON_IsNumber(first)) {
        rc = ngx_http_dpd_count_ids(r, ctx, prompt, vocab, -1, &total);
        if (rc != NGX_OK || ctx->err_status) {
            return rc;
        }

        ctx->prompt_tokens = total;
        goto ids_counted;
    }

    if (cJSON_IsArray(first)) {
        i = 0;

        for (item = first; item; item = item->next, i++) {
            if (!cJSON_IsArray(item)) {
                return ngx_http_dpd_reject(r, ctx,
                           NGX_HTTP_DPD_E_INVALID_FIELD,
                           "prompt[%i]: expected an array of token ids like "
                           "the other elements", i);
            }

            if (item->child == NULL) {
                return ngx_http_dpd_reject(r, ctx,
                           NGX_HTTP_DPD_E_INVALID_FIELD,
                           "prompt[%i] must not be empty", i);
            }

            rc = ngx_http_dpd_count_ids(r, ctx, item, vocab, i, &total);
            if (rc != NGX_OK || ctx->err_status) {
                return rc;
            }
        }

        ctx->prompt_tokens = total;
        goto ids_counted;
    }

    goto wrong_type;

ids_counted:

    /* token ids: counted exactly and cheaply; the bound is the count */

    if (dlcf->count == NGX_HTTP_DPD_COUNT_BOUND) {
        ctx->prompt_bound = ctx->prompt_tokens;
    }

    return NGX_OK;

wrong_type:

    return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_INVALID_FIELD,
                               "field \"prompt\" must be a string, an array "
                               "of strings, an array of token ids or an "
                               "array of token-id arrays");
}


static ngx_int_t
ngx_http_dpd_count_ids(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    const cJSON *arr, uint32_t vocab, ngx_int_t outer, ngx_int_t *total)
{
    char          num[32];
    double        v;
    ngx_int_t     i;
    const cJSON  *id;

    i = 0;

    for (id = arr->child; id; id = id->next, i++) {

        if (!cJSON_IsNumber(id)) {
            goto invalid;
        }

        v = id->valuedouble;

        if (!isfinite(v) || v != floor(v)) {
            goto invalid;
        }

        if (v < 0 || v >= (double) vocab) {
            /* C formatting: nginx's %f does not cover huge values */
            snprintf(num, sizeof(num), "%.17g", v);

            if (outer >= 0) {
                return ngx_http_dpd_reject(r, ctx,
                           NGX_HTTP_DPD_E_TOKEN_RANGE,
                           "prompt[%i][%i]: token id %s is out of range "
                           "[0, %uD)", outer, i, num, vocab);
            }

            return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_TOKEN_RANGE,
                                       "prompt[%i]: token id %s is out of "
                                       "range [0, %uD)", i, num, vocab);
        }
    }

    *total += i;

    return NGX_OK;

invalid:

    if (outer >= 0) {
        return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_INVALID_FIELD,
                                   "prompt[%i][%i]: token ids must be "
                                   "integers", outer, i);
    }

    return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_INVALID_FIELD,
                               "prompt[%i]: token ids must be integers", i);
}


static ngx_int_t
ngx_http_dpd_count_chat(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_main_conf_t *dmcf, ngx_http_dpd_loc_conf_t *dlcf,
    dpd_chat_template_t tmpl)
{
    int               estimated;
    long              n;
    char              err[256], err2[256], *text;
    size_t            len;
    cJSON            *copy;
    ngx_int_t         rc;
    const cJSON      *messages;
    const dpd_tok_t  *tok;

    tok = dmcf->tok;

    messages = cJSON_GetObjectItemCaseSensitive(ctx->json, "messages");

    if (messages == NULL) {
        return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_INVALID_FIELD,
                                   "field \"messages\" is required");
    }

    if (!cJSON_IsArray(messages)) {
        return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_INVALID_FIELD,
                                   "field \"messages\" must be an array");
    }

    if (messages->child == NULL) {
        return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_INVALID_FIELD,
                                   "field \"messages\" must not be empty");
    }

    rc = ngx_http_dpd_check_messages(r, ctx, messages);
    if (rc != NGX_OK || ctx->err_status) {
        return rc;
    }

    estimated = 0;
    err[0] = '\0';

    if (dlcf->count == NGX_HTTP_DPD_COUNT_BOUND) {

        /*
         * The rendered prompt holds the template's specials as text (each
         * at least one byte) and is encoded without added specials: its
         * bytes bound the ids.  Render once, count the same text if the
         * bound is not enough.  Unknown template (estimate) or messages
         * the renderer refuses: the exact path below.
         */

        text = NULL;
        len = 0;

        if (dpd_chat_render_json(tok, tmpl, messages, &text, &len, err,
                                 sizeof(err))
            == 0)
        {
            if (ngx_http_dpd_bound_skips(ctx, dlcf,
                    ngx_http_dpd_text_bound(dmcf, (u_char *) text, len, 0)))
            {
                free(text);
                return NGX_OK;
            }

            n = dpd_tok_count(tok, text, len, 0);
            free(text);

            if (n < 0) {
                return NGX_ERROR;
            }

            ctx->prompt_tokens = n;
            return NGX_OK;
        }

        free(text);
        err[0] = '\0';
    }

    n = dpd_chat_count_json(tok, tmpl, messages, &estimated, err,
                            sizeof(err));

    if (n < 0) {
        /*
         * The request has OpenAI's shape (checked above) but the counter
         * is stricter than vLLM (custom roles, image or audio parts): count
         * the text of a normalized copy rather than refuse what the
         * decoder accepts.
         */

        copy = ngx_http_dpd_chat_text_only(messages);
        if (copy == NULL) {
            return NGX_ERROR;
        }

        n = dpd_chat_count_json(tok, tmpl, copy, &estimated, err2,
                                sizeof(err2));
        cJSON_Delete(copy);

        if (n < 0) {
            return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_INVALID_FIELD,
                                       "%s", err[0] ? err
                                                    : "invalid messages");
        }

        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "dpd: request \"%V\": text counted only (%s)",
                      &ctx->request_id, err);

        estimated = 1;
    }

    ctx->prompt_tokens = n;
    ctx->estimated = estimated ? 1 : 0;

    return NGX_OK;
}


/*
 * A copy of messages the counter accepts: roles other than system, user,
 * assistant and tool become "system" (OpenAI's "developer") or "user", and
 * only the text parts of array contents are kept.  NULL: out of memory.
 */

static cJSON *
ngx_http_dpd_chat_text_only(const cJSON *messages)
{
    cJSON       *copy, *m, *role, *content, *part, *next, *type, *calls;
    const char  *name;

    copy = cJSON_Duplicate(messages, 1);
    if (copy == NULL) {
        return NULL;
    }

    cJSON_ArrayForEach(m, copy) {
        role = cJSON_GetObjectItemCaseSensitive(m, "role");

        if (cJSON_IsString(role)
            && ngx_strcmp(role->valuestring, "system") != 0
            && ngx_strcmp(role->valuestring, "user") != 0
            && ngx_strcmp(role->valuestring, "assistant") != 0
            && ngx_strcmp(role->valuestring, "tool") != 0)
        {
            name = ngx_strcmp(role->valuestring, "developer") == 0
                   ? "system" : "user";

            if (cJSON_ReplaceItemInObjectCaseSensitive(m, "role",
                                               cJSON_CreateString(name))
                == 0)
            {
                cJSON_Delete(copy);
                return NULL;
            }
        }

        calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
        if (calls && !cJSON_IsArray(calls)) {
            cJSON_DeleteItemFromObjectCaseSensitive(m, "tool_calls");
        }

        content = cJSON_GetObjectItemCaseSensitive(m, "content");
        if (!cJSON_IsArray(content)) {
            continue;
        }

        for (part = content->child; part; part = next) {
            next = part->next;
            type = cJSON_GetObjectItemCaseSensitive(part, "type");

            if (!cJSON_IsString(type)
                || ngx_strcmp(type->valuestring, "text") != 0)
            {
                cJSON_Delete(cJSON_DetachItemViaPointer(content, part));
            }
        }
    }

    return copy;
}


/*
 * The shape OpenAI's API requires, checked here so that every template
 * (and the estimate) rejects the same requests: objects with a string
 * "role"; "content" a string or an array of content parts, or null/absent
 * for an assistant message (tool calls).
 */

static ngx_int_t
ngx_http_dpd_check_messages(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    const cJSON *messages)
{
    ngx_int_t     i, j;
    const cJSON  *m, *role, *content, *part, *type, *text;

    i = 0;

    for (m = messages->child; m; m = m->next, i++) {

        if (!cJSON_IsObject(m)) {
            return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_INVALID_FIELD,
                                       "messages[%i] must be an object", i);
        }

        role = cJSON_GetObjectItemCaseSensitive(m, "role");

        if (!cJSON_IsString(role)) {
            return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_INVALID_FIELD,
                                       "messages[%i].role: %s", i,
                                       role ? "expected a string"
                                            : "is required");
        }

        content = cJSON_GetObjectItemCaseSensitive(m, "content");

        if (content == NULL || cJSON_IsNull(content)) {
            if (ngx_strcmp(role->valuestring, "assistant") == 0) {
                continue;
            }

            return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_INVALID_FIELD,
                                       "messages[%i].content is required",
                                       i);
        }

        if (cJSON_IsString(content)) {
            continue;
        }

        if (!cJSON_IsArray(content)) {
            return ngx_http_dpd_reject(r, ctx, NGX_HTTP_DPD_E_INVALID_FIELD,
                                       "messages[%i].content: expected a "
                                       "string or an array of content parts",
                                       i);
        }

        j = 0;

        for (part = content->child; part; part = part->next, j++) {
            type = cJSON_IsObject(part)
                   ? cJSON_GetObjectItemCaseSensitive(part, "type") : NULL;

            if (!cJSON_IsString(type)) {
                return ngx_http_dpd_reject(r, ctx,
                           NGX_HTTP_DPD_E_INVALID_FIELD,
                           "messages[%i].content[%i]: expected an object "
                           "with a string \"type\"", i, j);
            }

            if (ngx_strcmp(type->valuestring, "text") != 0) {
                continue;
            }

            text = cJSON_GetObjectItemCaseSensitive(part, "text");

            if (!cJSON_IsString(text)) {
                return ngx_http_dpd_reject(r, ctx,
                           NGX_HTTP_DPD_E_INVALID_FIELD,
                           "messages[%i].content[%i].text: expected a "
                           "string", i, j);
            }
        }
    }

    return NGX_OK;
}
