/*
 * tokenizer_config.json: the bos/eos strings the chat templates print, the
 * chat template text, and the template family detected from it.
 */

#include <stdlib.h>
#include <string.h>
#include <cjson/cJSON.h>

#include "tok_internal.h"


/* "bos_token": "<s>" or {"content": "<s>", ...} or null */
static int
tok_config_token(const cJSON *root, const char *key, char **out, char *err,
    size_t errlen)
{
    const cJSON  *v = cJSON_GetObjectItemCaseSensitive(root, key);

    if (v == NULL || cJSON_IsNull(v)) {
        return 0;
    }
    if (cJSON_IsObject(v)) {
        v = cJSON_GetObjectItemCaseSensitive(v, "content");
    }
    if (!cJSON_IsString(v)) {
        tok_err(err, errlen, "%s: expected a string or {\"content\": ...}",
                key);
        return -1;
    }
    *out = strdup(v->valuestring);
    if (*out == NULL) {
        tok_err(err, errlen, "out of memory");
        return -1;
    }
    return 0;
}


/* "chat_template": "..." or [{"name": "default", "template": "..."}, ...] */
static int
tok_config_template(const cJSON *root, char **out, char *err, size_t errlen)
{
    const cJSON  *v = cJSON_GetObjectItemCaseSensitive(root, "chat_template");
    const cJSON  *e, *name, *t, *pick = NULL;

    if (v == NULL || cJSON_IsNull(v)) {
        return 0;
    }
    if (cJSON_IsArray(v)) {
        cJSON_ArrayForEach(e, v) {
            name = cJSON_GetObjectItemCaseSensitive(e, "name");
            t = cJSON_GetObjectItemCaseSensitive(e, "template");
            if (!cJSON_IsString(t)) {
                continue;
            }
            if (pick == NULL || (cJSON_IsString(name)
                                 && strcmp(name->valuestring, "default") == 0))
            {
                pick = t;
            }
        }
        v = pick;
    }
    if (!cJSON_IsString(v)) {
        tok_err(err, errlen, "chat_template: expected a string or a list of "
                "{\"name\", \"template\"}");
        return -1;
    }
    *out = strdup(v->valuestring);
    if (*out == NULL) {
        tok_err(err, errlen, "out of memory");
        return -1;
    }
    return 0;
}


/*
 * Template families by their markers: Llama 3 headers (with Meta's default
 * "Cutting Knowledge Date" system block: 3.1+), ChatML's <|im_start|>.
 */
dpd_chat_template_t
tok_detect_template(const char *t)
{
    if (t == NULL) {
        return DPD_CHAT_NONE;
    }
    if (strstr(t, "<|start_header_id|>") && strstr(t, "<|eot_id|>")) {
        return strstr(t, "Cutting Knowledge Date") ? DPD_CHAT_LLAMA31
                                                   : DPD_CHAT_LLAMA3;
    }
    if (strstr(t, "<|im_start|>") && strstr(t, "<|im_end|>")) {
        return DPD_CHAT_CHATML;
    }
    return DPD_CHAT_NONE;
}


/*
 * ChatML dialects: Qwen 2 / 2.5 templates print a default system message
 * when the first message is not a system one, written as a string literal
 * '<|im_start|>system\n...<|im_end|>\n'; Qwen 3's builds that block from
 * messages[0] only.  Take the literal's text (Jinja escapes undone), and
 * note whether the template handles <think> (Qwen 3) or not.
 */
static int
tok_chatml_dialect(dpd_tok_t *tok)
{
    static const char   mark[] = "<|im_start|>system\\n";
    const char         *t = tok->chat_template, *p, *e;
    char               *out;
    size_t              o = 0;

    tok->chatml_plain = strstr(t, "</think>") == NULL;
    for (p = strstr(t, mark); p; p = strstr(p + 1, mark)) {
        p += sizeof(mark) - 1;
        e = strstr(p, "<|im_end|>");
        if (e == NULL || e == p || memchr(p, '\'', (size_t) (e - p))
            || memchr(p, '"', (size_t) (e - p))
            || memchr(p, '{', (size_t) (e - p)))
        {
            continue;       /* an expression, not a literal text */
        }
        out = malloc((size_t) (e - p) + 1);
        if (out == NULL) {
            return -1;
        }
        for ( ; p < e; p++) {
            if (*p == '\\' && p + 1 < e) {
                p++;
                out[o++] = *p == 'n' ? '\n' : *p == 't' ? '\t' : *p;
            } else {
                out[o++] = *p;
            }
        }
        out[o] = '\0';
        tok->chatml_system = out;
        return 0;
    }
    return 0;
}


int
tok_load_config(dpd_tok_t *tok, const char *path, char *err, size_t errlen)
{
    cJSON   *root;
    char    *buf, ferr[256];
    size_t   len;

    buf = tok_read_file(path, &len, err, errlen);
    if (buf == NULL) {
        return -1;
    }
    root = tok_parse_json(path, buf, len, err, errlen);
    free(buf);
    if (root == NULL) {
        return -1;
    }
    ferr[0] = '\0';
    if (!cJSON_IsObject(root)) {
        tok_err(ferr, sizeof(ferr), "not a JSON object");
    } else if (tok_config_token(root, "bos_token", &tok->bos_token, ferr,
                                sizeof(ferr)) == 0
               && tok_config_token(root, "eos_token", &tok->eos_token, ferr,
                                   sizeof(ferr)) == 0
               && tok_config_template(root, &tok->chat_template, ferr,
                                      sizeof(ferr)) == 0)
    {
        tok->detected = tok_detect_template(tok->chat_template);
        if (tok->detected == DPD_CHAT_CHATML
            && tok_chatml_dialect(tok) != 0)
        {
            tok_err(ferr, sizeof(ferr), "out of memory");
        }
    }
    cJSON_Delete(root);
    if (ferr[0]) {
        tok_err(err, errlen, "%s: %s", path, ferr);
        return -1;
    }
    return 0;
}


dpd_chat_template_t
dpd_tok_chat_template(const dpd_tok_t *tok)
{
    return tok ? tok->detected : DPD_CHAT_NONE;
}


int
dpd_chat_template_from_name(const char *name)
{
    static const struct {
        const char           *name;
        dpd_chat_template_t   t;
    } names[] = {
        { "auto", DPD_CHAT_AUTO },
        { "llama3", DPD_CHAT_LLAMA3 },
        { "llama3.1", DPD_CHAT_LLAMA31 },
        { "chatml", DPD_CHAT_CHATML },
        { "none", DPD_CHAT_NONE },
    };
    size_t  i;

    if (name == NULL) {
        return -1;
    }
    for (i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (strcmp(name, names[i].name) == 0) {
            return (int) names[i].t;
        }
    }
    return -1;
}


const char *
dpd_chat_template_name(dpd_chat_template_t t)
{
    switch (t) {
    case DPD_CHAT_AUTO:
        return "auto";
    case DPD_CHAT_LLAMA3:
        return "llama3";
    case DPD_CHAT_LLAMA31:
        return "llama3.1";
    case DPD_CHAT_CHATML:
        return "chatml";
    case DPD_CHAT_NONE:
        return "none";
    }
    return "unknown";
}
