/*
 * Prompt tokens of a parsed OpenAI request (see ngx_http_dpd_count.h).
 * No nginx headers here: the module and the libFuzzer target link it.
 */

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ngx_http_dpd_count.h"
#include "ngx_http_dpd_json.h"
#include "dpd_prefix.h"


static int dpd_refuse(ngx_http_dpd_count_t *out, int bad,
    const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static uint64_t dpd_text_bound(const ngx_http_dpd_count_conf_t *cf,
    const unsigned char *text, size_t len, int add_special);
static int dpd_bound_skips(const ngx_http_dpd_count_conf_t *cf,
    ngx_http_dpd_count_t *out, uint64_t bound);
static int dpd_count_completions(const cJSON *req,
    const ngx_http_dpd_count_conf_t *cf, ngx_http_dpd_count_t *out);
static int dpd_count_ids(const cJSON *arr, uint32_t vocab, long outer,
    size_t max, size_t *total, ngx_http_dpd_count_t *out);
static int dpd_count_chat(const cJSON *req,
    const ngx_http_dpd_count_conf_t *cf, ngx_http_dpd_count_t *out);
static int dpd_check_messages(const cJSON *messages, size_t max,
    ngx_http_dpd_count_t *out);
static long dpd_encode(const dpd_tok_t *tok, const char *text, size_t len,
    int add_special, uint32_t **ids);
static void dpd_prefix_keys_of(const cJSON *req,
    const ngx_http_dpd_count_conf_t *cf, ngx_http_dpd_count_t *out,
    const uint32_t *ids, size_t n);
static int dpd_chat_keys(const cJSON *req,
    const ngx_http_dpd_count_conf_t *cf, ngx_http_dpd_count_t *out);


static int
dpd_refuse(ngx_http_dpd_count_t *out, int bad, const char *fmt, ...)
{
    va_list  args;

    out->bad = bad;

    va_start(args, fmt);
    vsnprintf(out->why, sizeof(out->why), fmt, args);
    va_end(args);

    return 0;
}


int
ngx_http_dpd_count(const cJSON *req, const ngx_http_dpd_count_conf_t *cf,
    ngx_http_dpd_count_t *out)
{
    out->tokens = -1;
    out->bound = -1;
    out->keys = NULL;
    out->nkeys = 0;
    out->skipped = 0;
    out->estimated = 0;
    out->bad = NGX_HTTP_DPD_BAD_NONE;
    out->why[0] = '\0';
    out->note[0] = '\0';

    if (!ngx_http_dpd_json_is(req, cJSON_Object)) {
        return dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD,
                          "the request body must be a JSON object");
    }

    return cf->chat ? dpd_count_chat(req, cf, out)
                    : dpd_count_completions(req, cf, out);
}


/* UINT64_MAX: no bound for this tokenizer */

static uint64_t
dpd_text_bound(const ngx_http_dpd_count_conf_t *cf, const unsigned char *text,
    size_t len, int add_special)
{
    size_t                other;
    const unsigned char  *p, *end;

    if (cf->bound_prefix == 0) {
        return UINT64_MAX;
    }

    other = 0;

    if (cf->bound_other != 1) {
        end = text + len;

        for (p = text; p < end; p++) {
            other += (*p >> 7);
        }
    }

    return ((uint64_t) (len - other) + (uint64_t) other * cf->bound_other)
           * cf->bound_prefix
           + (add_special ? cf->bound_specials : 0);
}


/* bound mode and the bound below the threshold: no exact count needed */

static int
dpd_bound_skips(const ngx_http_dpd_count_conf_t *cf,
    ngx_http_dpd_count_t *out, uint64_t bound)
{
    if (bound > (uint64_t) LONG_MAX) {
        return 0;
    }

    out->bound = (long) bound;

    if (cf->threshold > 0 && out->bound < cf->threshold) {
        out->skipped = 1;
        return 1;
    }

    return 0;
}


static int
dpd_count_completions(const cJSON *req, const ngx_http_dpd_count_conf_t *cf,
    ngx_http_dpd_count_t *out)
{
    long              n, i, total;
    size_t            ids;
    uint32_t          vocab, *ids32;
    uint64_t          bound, b;
    const cJSON      *prompt, *item, *first;
    const dpd_tok_t  *tok;

    tok = cf->tok;

    prompt = cJSON_GetObjectItemCaseSensitive(req, "prompt");

    if (prompt == NULL) {
        return dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD,
                          "field \"prompt\" is required");
    }

    if (cJSON_IsString(prompt)) {
        if (cf->bound
            && dpd_bound_skips(cf, out,
                   dpd_text_bound(cf, (unsigned char *) prompt->valuestring,
                                  strlen(prompt->valuestring), 1)))
        {
            return 0;
        }

        if (cf->prefix_block) {
            /* the ids themselves, for the prefix cache's keys */
            n = dpd_encode(tok, prompt->valuestring,
                           strlen(prompt->valuestring), 1, &ids32);
            if (n < 0) {
                return -1;
            }

            dpd_prefix_keys_of(req, cf, out, ids32, (size_t) n);
            free(ids32);

            out->tokens = n;
            return 0;
        }

        n = dpd_tok_count(tok, prompt->valuestring,
                          strlen(prompt->valuestring), 1);
        if (n < 0) {
            return -1;
        }

        out->tokens = n;
        return 0;
    }

    if (!cJSON_IsArray(prompt)) {
        goto wrong_type;
    }

    first = prompt->child;

    if (first == NULL) {
        return dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD,
                          "field \"prompt\" must not be empty");
    }

    vocab = dpd_tok_vocab_size(tok);

    if (cJSON_IsString(first)) {
        /* a batch of prompts: each tokenized with its specials */

        i = 0;
        bound = 0;

        for (item = first; item; item = item->next, i++) {
            if (!cJSON_IsString(item)) {
                return dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD,
                                  "prompt[%ld]: expected a string like the "
                                  "other elements", i);
            }

            if (cf->bound && bound != UINT64_MAX) {
                b = dpd_text_bound(cf, (unsigned char *) item->valuestring,
                                   strlen(item->valuestring), 1);
                bound = (b > UINT64_MAX - bound) ? UINT64_MAX : bound + b;
            }
        }

        if (cf->bound && dpd_bound_skips(cf, out, bound)) {
            return 0;
        }

        total = 0;

        for (item = first; item; item = item->next) {
            n = dpd_tok_count(tok, item->valuestring,
                              strlen(item->valuestring), 1);
            if (n < 0) {
                return -1;
            }

            total += n;
        }

        out->tokens = total;
        return 0;
    }

    ids = 0;

    if (cJSON_IsNumber(first)) {
        if (dpd_count_ids(prompt, vocab, -1, cf->max_prompt_ids, &ids, out)
            != 0)
        {
            return 0;
        }

        if (cf->prefix_block && ids >= cf->prefix_block) {
            /* checked above: integers in [0, vocab) */
            ids32 = malloc(ids * sizeof(uint32_t));

            if (ids32 != NULL) {
                i = 0;

                for (item = first; item; item = item->next) {
                    ids32[i++] = (uint32_t) item->valuedouble;
                }

                dpd_prefix_keys_of(req, cf, out, ids32, ids);
                free(ids32);
            }
        }

        goto ids_counted;
    }

    if (cJSON_IsArray(first)) {
        i = 0;

        for (item = first; item; item = item->next, i++) {
            if (!cJSON_IsArray(item)) {
                return dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD,
                                  "prompt[%ld]: expected an array of token "
                                  "ids like the other elements", i);
            }

            if (item->child == NULL) {
                return dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD,
                                  "prompt[%ld] must not be empty", i);
            }

            if (dpd_count_ids(item, vocab, i, cf->max_prompt_ids, &ids, out)
                != 0)
            {
                return 0;
            }
        }

        goto ids_counted;
    }

    goto wrong_type;

ids_counted:

    /* token ids: counted exactly and cheaply; the bound is the count */

    out->tokens = (long) ids;

    if (cf->bound) {
        out->bound = out->tokens;
    }

    return 0;

wrong_type:

    return dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD,
                      "field \"prompt\" must be a string, an array of "
                      "strings, an array of token ids or an array of "
                      "token-id arrays");
}


/* adds arr's ids to *total; 1: refused (out->bad set) */

static int
dpd_count_ids(const cJSON *arr, uint32_t vocab, long outer, size_t max,
    size_t *total, ngx_http_dpd_count_t *out)
{
    long          i;
    char          num[32];
    double        v;
    const cJSON  *id;

    i = 0;

    for (id = arr->child; id; id = id->next, i++) {

        if (++*total > max) {
            dpd_refuse(out, NGX_HTTP_DPD_BAD_LIMIT,
                       "prompt: more than %zu token ids "
                       "(dpd_max_prompt_ids)", max);
            return 1;
        }

        if (!cJSON_IsNumber(id)) {
            goto invalid;
        }

        v = id->valuedouble;

        if (!isfinite(v) || v != floor(v)) {
            goto invalid;
        }

        if (v < 0 || v >= (double) vocab) {
            snprintf(num, sizeof(num), "%.17g", v);

            if (outer >= 0) {
                dpd_refuse(out, NGX_HTTP_DPD_BAD_TOKEN_RANGE,
                           "prompt[%ld][%ld]: token id %s is out of range "
                           "[0, %u)", outer, i, num, (unsigned) vocab);

            } else {
                dpd_refuse(out, NGX_HTTP_DPD_BAD_TOKEN_RANGE,
                           "prompt[%ld]: token id %s is out of range "
                           "[0, %u)", i, num, (unsigned) vocab);
            }

            return 1;
        }
    }

    return 0;

invalid:

    if (outer >= 0) {
        dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD,
                   "prompt[%ld][%ld]: token ids must be integers", outer, i);

    } else {
        dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD,
                   "prompt[%ld]: token ids must be integers", i);
    }

    return 1;
}


static int
dpd_count_chat(const cJSON *req, const ngx_http_dpd_count_conf_t *cf,
    ngx_http_dpd_count_t *out)
{
    int               estimated;
    long              n;
    char              err[256], *text;
    size_t            len;
    const cJSON      *messages;
    const dpd_tok_t  *tok;

    tok = cf->tok;

    messages = ngx_http_dpd_json_get(req, "messages");

    if (messages == NULL) {
        return dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD,
                          "field \"messages\" is required");
    }

    if (!ngx_http_dpd_json_is(messages, cJSON_Array)) {
        return dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD,
                          "field \"messages\" must be an array");
    }

    if (messages->child == NULL) {
        return dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD,
                          "field \"messages\" must not be empty");
    }

    if (dpd_check_messages(messages, cf->max_messages, out) != 0) {
        return 0;
    }

    estimated = 0;
    err[0] = '\0';

    if (cf->prefix_block) {
        /* 1: no exact ids (no template, estimate): counted below */
        n = dpd_chat_keys(req, cf, out);
        if (n <= 0) {
            return (int) n;
        }
    }

    if (cf->bound) {

        /*
         * The rendered prompt holds the template's specials as text (each
         * at least one byte) and is encoded without added specials: its
         * bytes bound the ids.  Render once, count the same text if the
         * bound is not enough.  Unknown template (estimate) or messages
         * the renderer refuses: the exact path below.
         */

        text = NULL;
        len = 0;

        /* the whole request: tools, chat_template_kwargs, documents */

        if (dpd_chat_render_json(tok, cf->tmpl, req, &text, &len, err,
                                 sizeof(err))
            == 0)
        {
            if (dpd_bound_skips(cf, out,
                    dpd_text_bound(cf, (unsigned char *) text, len, 0)))
            {
                free(text);
                return 0;
            }

            /*
             * gpt-oss: harmony encodes its text pieces without matching
             * added tokens, the rendered text re-encoded is not its ids:
             * the exact path below counts them
             */

            if (!dpd_tok_chat_harmony(tok)) {
                n = dpd_tok_count(tok, text, len, 0);
                free(text);

                if (n < 0) {
                    return -1;
                }

                out->tokens = n;
                return 0;
            }
        }

        free(text);
        err[0] = '\0';
    }

    n = dpd_chat_count_json(tok, cf->tmpl, req, &estimated, err,
                            sizeof(err));

    if (n < 0) {
        /* what vLLM answers with 400: bad fields, the template raised */
        return dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD, "%s",
                          err[0] ? err : "invalid messages");
    }

    if (estimated && err[0]) {
        /* image, audio parts: the text is counted */
        if (strncmp(err, "harmony:", 8) == 0) {
            /* gpt-oss: a request feature left to the estimate */
            snprintf(out->note, sizeof(out->note), "estimated (%s)", err);

        } else {
            snprintf(out->note, sizeof(out->note), "text counted only (%s)",
                     err);
        }
    }

    out->tokens = n;
    out->estimated = estimated ? 1 : 0;

    return 0;
}


/*
 * The shape OpenAI's API requires, checked here so that every template
 * (and the estimate) rejects the same requests: at most max messages,
 * objects with a string "role"; "content" a string or an array of content
 * parts, or null/absent for an assistant message (tool calls).  1: refused.
 */

static int
dpd_check_messages(const cJSON *messages, size_t max,
    ngx_http_dpd_count_t *out)
{
    long          i, j;
    const cJSON  *m, *role, *content, *part, *type, *text;

    i = 0;

    for (m = messages->child; m; m = m->next, i++) {

        if ((size_t) i >= max) {
            dpd_refuse(out, NGX_HTTP_DPD_BAD_LIMIT,
                       "field \"messages\": more than %zu messages "
                       "(dpd_max_messages)", max);
            return 1;
        }

        if (!ngx_http_dpd_json_is(m, cJSON_Object)) {
            dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD,
                       "messages[%ld] must be an object", i);
            return 1;
        }

        role = ngx_http_dpd_json_get(m, "role");

        if (!ngx_http_dpd_json_is(role, cJSON_String)) {
            dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD, "messages[%ld].role: %s",
                       i, role ? "expected a string" : "is required");
            return 1;
        }

        content = ngx_http_dpd_json_get(m, "content");

        if (content == NULL || ngx_http_dpd_json_is(content, cJSON_NULL)) {
            if (strcmp(role->valuestring, "assistant") == 0) {
                continue;
            }

            dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD,
                       "messages[%ld].content is required", i);
            return 1;
        }

        if (ngx_http_dpd_json_is(content, cJSON_String)) {
            continue;
        }

        if (!ngx_http_dpd_json_is(content, cJSON_Array)) {
            dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD,
                       "messages[%ld].content: expected a string or an "
                       "array of content parts", i);
            return 1;
        }

        j = 0;

        for (part = content->child; part; part = part->next, j++) {
            type = cJSON_IsObject(part)
                   ? cJSON_GetObjectItemCaseSensitive(part, "type") : NULL;

            if (!cJSON_IsString(type)) {
                dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD,
                           "messages[%ld].content[%ld]: expected an object "
                           "with a string \"type\"", i, j);
                return 1;
            }

            if (strcmp(type->valuestring, "text") != 0) {
                continue;
            }

            text = cJSON_GetObjectItemCaseSensitive(part, "text");

            if (!cJSON_IsString(text)) {
                dpd_refuse(out, NGX_HTTP_DPD_BAD_FIELD,
                           "messages[%ld].content[%ld].text: expected a "
                           "string", i, j);
                return 1;
            }
        }
    }

    return 0;
}


/* the ids of a text into *ids (malloc()ed); their number or -1 */

static long
dpd_encode(const dpd_tok_t *tok, const char *text, size_t len,
    int add_special, uint32_t **ids)
{
    long       n;
    size_t     cap;
    uint32_t  *buf;

    /* about 4 bytes per id in practice; a second pass when more */

    cap = len / 3 + 64;

    for ( ;; ) {
        buf = malloc(cap * sizeof(uint32_t));
        if (buf == NULL) {
            return -1;
        }

        n = dpd_tok_encode(tok, text, len, add_special, buf, cap);

        if (n < 0) {
            free(buf);
            return -1;
        }

        if ((size_t) n <= cap) {
            *ids = buf;
            return n;
        }

        free(buf);
        cap = (size_t) n;
    }
}


/*
 * The block keys of a prompt's ids (dpd_prefix.h): seeded by the request's
 * "model" (which names the LoRA adapter too when one is addressed, as
 * vLLM serves adapters under their own model names) and "cache_salt".
 * Out of memory: no keys, the request is routed as if nothing were cached.
 */

static void
dpd_prefix_keys_of(const cJSON *req, const ngx_http_dpd_count_conf_t *cf,
    ngx_http_dpd_count_t *out, const uint32_t *ids, size_t n)
{
    size_t        nblocks;
    uint64_t      seed;
    const char   *model, *salt;
    const cJSON  *v;

    nblocks = n / cf->prefix_block;

    if (nblocks == 0) {
        return;
    }

    v = cJSON_GetObjectItemCaseSensitive(req, "model");
    model = cJSON_IsString(v) ? v->valuestring : "";

    v = cJSON_GetObjectItemCaseSensitive(req, "cache_salt");
    salt = cJSON_IsString(v) ? v->valuestring : "";

    seed = dpd_prefix_salted(dpd_prefix_seed(model, strlen(model), "", 0),
                             salt, strlen(salt));

    out->keys = malloc(nblocks * sizeof(uint64_t));
    if (out->keys == NULL) {
        return;
    }

    out->nkeys = dpd_prefix_keys(seed, ids, n, cf->prefix_block, out->keys,
                                 nblocks);
}


/*
 * A chat's exact ids and keys: the rendered template encoded without
 * specials (harmony: its own ids).  0: counted (or refused, out->bad),
 * -1: failure, 1: no exact ids (no template, an estimate): count as usual.
 */

static int
dpd_chat_keys(const cJSON *req, const ngx_http_dpd_count_conf_t *cf,
    ngx_http_dpd_count_t *out)
{
    int        rc;
    long       n, count;
    char       err[256], *text;
    size_t     len, nids;
    uint32_t  *ids;

    err[0] = '\0';

    if (dpd_tok_chat_harmony(cf->tok)) {
        ids = NULL;
        nids = 0;

        rc = dpd_chat_harmony_json(cf->tok, req, NULL, NULL, &ids, &nids,
                                   &count, err, sizeof(err));
        if (rc != 0) {
            /* refused or an estimate: the usual path says which */
            free(ids);
            return 1;
        }

        dpd_prefix_keys_of(req, cf, out, ids, nids);
        free(ids);

        out->tokens = count;
        return 0;
    }

    text = NULL;

    rc = dpd_chat_render_json(cf->tok, cf->tmpl, req, &text, &len, err,
                              sizeof(err));

    if (rc != 0 && rc != 2) {
        /* -1: refused, 1: no template: the usual path */
        free(text);
        return 1;
    }

    n = dpd_encode(cf->tok, text, len, 0, &ids);
    free(text);

    if (n < 0) {
        return -1;
    }

    dpd_prefix_keys_of(req, cf, out, ids, (size_t) n);
    free(ids);

    if (rc == 2) {
        /* non-text parts: the text's ids only */
        out->estimated = 1;
        snprintf(out->note, sizeof(out->note), "text counted only (%s)",
                 err);
    }

    out->tokens = n;
    return 0;
}
