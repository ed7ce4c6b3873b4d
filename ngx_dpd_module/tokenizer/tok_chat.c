/*
 * Chat templates: the prompt text vLLM renders (transformers'
 * apply_chat_template with add_generation_prompt=True) for an OpenAI
 * "messages" array, written out in C for the template families we know:
 *
 *   llama3    the Llama 3 template (tokenizer_config.json of Llama 3):
 *             bos + per message "<|start_header_id|>ROLE<|end_header_id|>
 *             \n\n" + content|trim + "<|eot_id|>", then the assistant header.
 *   llama3.1  Meta's 3.1+ template: bos, a system block that always carries
 *             "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul
 *             2024\n\n" (the template's default when no date_string is
 *             passed, which is what vLLM does), the system message (trimmed)
 *             in that block, tool results as "ipython" with the content
 *             JSON-quoted (the template's tojson), tool calls as
 *             {"name": ..., "parameters": ...}.
 *   chatml    the Qwen 3 template: optional first system message, the
 *             <think> handling of assistant turns after the last user query,
 *             tool results wrapped in <tool_response> inside a user turn,
 *             tool calls as <tool_call> JSON, "<|im_start|>assistant\n".
 *             Qwen 2 / 2.5 dialect, when the config's template says so: a
 *             default system message, assistant content as it is.
 *
 * Content is a string or an array of {"type": "text", "text": ...} parts,
 * joined with "\n" as vLLM does for templates that take string content.
 * Roles other than system/user/assistant/tool are rendered where the
 * template puts them (a header with the role's name in the Llama
 * templates, nothing in Qwen 3's).
 * Template arguments (tools, date_string, enable_thinking) are not passed.
 */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cjson/cJSON.h>

#include "tok_internal.h"


typedef struct {
    char    *p;
    size_t   len, cap;
    int      oom;
} tok_buf_t;


static void
tok_buf_add(tok_buf_t *b, const char *s, size_t n)
{
    char    *p;
    size_t   cap;

    if (b->oom) {
        return;
    }
    if (b->len + n + 1 > b->cap) {
        cap = (b->cap ? b->cap * 2 : 256);
        while (cap < b->len + n + 1) {
            cap *= 2;
        }
        p = realloc(b->p, cap);
        if (p == NULL) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}


static void
tok_buf_str(tok_buf_t *b, const char *s)
{
    tok_buf_add(b, s, strlen(s));
}


/* ---- messages, validated */

typedef struct {
    const char    *role;
    char          *content;     /* malloc'ed, joined text */
    size_t         len;
    const char    *reasoning;   /* reasoning_content, may be NULL */
    const cJSON   *tool_calls;  /* non-empty array or NULL */
} tok_msg_t;


static void
tok_msgs_free(tok_msg_t *m, size_t n)
{
    size_t  i;

    for (i = 0; i < n; i++) {
        free(m[i].content);
    }
    free(m);
}


static int
tok_msg_content(tok_msg_t *m, const cJSON *c, size_t i, char *err,
    size_t errlen)
{
    tok_buf_t     b = { NULL, 0, 0, 0 };
    const cJSON  *part, *type, *text;
    size_t        j = 0;

    if (c == NULL || cJSON_IsNull(c)) {
        tok_buf_add(&b, "", 0);
    } else if (cJSON_IsString(c)) {
        tok_buf_str(&b, c->valuestring);
    } else if (cJSON_IsArray(c)) {
        tok_buf_add(&b, "", 0);
        cJSON_ArrayForEach(part, c) {
            type = cJSON_GetObjectItemCaseSensitive(part, "type");
            text = cJSON_GetObjectItemCaseSensitive(part, "text");
            if (!cJSON_IsObject(part) || !cJSON_IsString(type)) {
                tok_err(err, errlen, "messages[%zu].content[%zu]: expected "
                        "{\"type\": \"text\", \"text\": ...}", i, j);
                free(b.p);
                return -1;
            }
            if (strcmp(type->valuestring, "text") != 0) {
                tok_err(err, errlen, "messages[%zu].content[%zu].type: "
                        "\"%.32s\" is not supported (only text parts)", i, j,
                        type->valuestring);
                free(b.p);
                return -1;
            }
            if (!cJSON_IsString(text)) {
                tok_err(err, errlen, "messages[%zu].content[%zu].text: "
                        "expected a string", i, j);
                free(b.p);
                return -1;
            }
            if (j > 0) {
                tok_buf_add(&b, "\n", 1);
            }
            tok_buf_str(&b, text->valuestring);
            j++;
        }
    } else {
        tok_err(err, errlen, "messages[%zu].content: expected a string or an "
                "array of text parts", i);
        return -1;
    }
    if (b.oom) {
        free(b.p);
        tok_err(err, errlen, "out of memory");
        return -1;
    }
    m->content = b.p;
    m->len = b.len;
    return 0;
}


static int
tok_msgs_parse(const cJSON *messages, tok_msg_t **out, size_t *n,
    char *err, size_t errlen)
{
    const cJSON  *e, *role, *rc, *tc;
    tok_msg_t    *m;
    size_t        cnt, i = 0;

    if (!cJSON_IsArray(messages)) {
        tok_err(err, errlen, "messages: expected an array");
        return -1;
    }
    cnt = (size_t) cJSON_GetArraySize(messages);
    if (cnt == 0) {
        tok_err(err, errlen, "messages: empty array");
        return -1;
    }
    m = calloc(cnt, sizeof(*m));
    if (m == NULL) {
        tok_err(err, errlen, "out of memory");
        return -1;
    }
    cJSON_ArrayForEach(e, messages) {
        if (!cJSON_IsObject(e)) {
            tok_err(err, errlen, "messages[%zu]: expected an object", i);
            goto fail;
        }
        role = cJSON_GetObjectItemCaseSensitive(e, "role");
        if (!cJSON_IsString(role)) {
            tok_err(err, errlen, "messages[%zu].role: missing or not a "
                    "string", i);
            goto fail;
        }
        /* other roles (developer, ...) go where the template puts them */
        m[i].role = role->valuestring;
        if (tok_msg_content(&m[i], cJSON_GetObjectItemCaseSensitive(e,
                            "content"), i, err, errlen) != 0)
        {
            goto fail;
        }
        rc = cJSON_GetObjectItemCaseSensitive(e, "reasoning_content");
        if (cJSON_IsString(rc)) {
            m[i].reasoning = rc->valuestring;
        }
        tc = cJSON_GetObjectItemCaseSensitive(e, "tool_calls");
        if (tc != NULL && !cJSON_IsNull(tc)) {
            if (!cJSON_IsArray(tc)) {
                tok_err(err, errlen, "messages[%zu].tool_calls: expected an "
                        "array", i);
                goto fail;
            }
            if (cJSON_GetArraySize(tc) > 0) {
                m[i].tool_calls = tc;
            }
        }
        i++;
    }
    *out = m;
    *n = cnt;
    return 0;

fail:
    tok_msgs_free(m, cnt);
    return -1;
}


/* ---- string helpers with Python semantics */

/* Python str.isspace() for one code point (jinja's trim is str.strip()) */
static int
tok_py_space(uint32_t cp)
{
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20)
           || cp == 0x85 || cp == 0xA0 || cp == 0x1680
           || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029
           || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}


static void
tok_trim(const char *s, size_t len, size_t *a, size_t *b)
{
    size_t    i = 0, j = len, n, k;
    uint32_t  cp;

    while (i < len) {
        n = tok_utf8_decode(s + i, len - i, &cp);
        if (!tok_py_space(cp)) {
            break;
        }
        i += n;
    }
    while (j > i) {
        k = j;
        do {
            k--;
        } while (k > i && ((unsigned char) s[k] & 0xC0) == 0x80);
        tok_utf8_decode(s + k, j - k, &cp);
        if (!tok_py_space(cp)) {
            break;
        }
        j = k;
    }
    *a = i;
    *b = j;
}


static void
tok_buf_trimmed(tok_buf_t *b, const char *s, size_t len)
{
    size_t  x, y;

    tok_trim(s, len, &x, &y);
    tok_buf_add(b, s + x, y - x);
}


/* last occurrence of needle in s[0..len), or NULL */
static const char *
tok_memrmem(const char *s, size_t len, const char *needle)
{
    size_t       nl = strlen(needle);
    const char  *last = NULL, *p = s;

    while ((size_t) (s + len - p) >= nl
           && (p = memmem(p, (size_t) (s + len - p), needle, nl)) != NULL)
    {
        last = p;
        p++;
    }
    return last;
}


static void
tok_strip_nl(const char **s, size_t *len, int left, int right)
{
    while (left && *len > 0 && **s == '\n') {
        (*s)++;
        (*len)--;
    }
    while (right && *len > 0 && (*s)[*len - 1] == '\n') {
        (*len)--;
    }
}


/* ---- JSON as Python's json.dumps(ensure_ascii=False) writes it
 * (transformers' tojson filter): ", " and ": " separators. */

static void
tok_py_json_string(tok_buf_t *b, const char *s)
{
    char  tmp[8];

    tok_buf_add(b, "\"", 1);
    for ( ; *s; s++) {
        unsigned char c = (unsigned char) *s;
        switch (c) {
        case '"':  tok_buf_add(b, "\\\"", 2); break;
        case '\\': tok_buf_add(b, "\\\\", 2); break;
        case '\n': tok_buf_add(b, "\\n", 2); break;
        case '\r': tok_buf_add(b, "\\r", 2); break;
        case '\t': tok_buf_add(b, "\\t", 2); break;
        case '\b': tok_buf_add(b, "\\b", 2); break;
        case '\f': tok_buf_add(b, "\\f", 2); break;
        default:
            if (c < 0x20) {
                snprintf(tmp, sizeof(tmp), "\\u%04x", c);
                tok_buf_add(b, tmp, 6);
            } else {
                tok_buf_add(b, (const char *) &c, 1);
            }
        }
    }
    tok_buf_add(b, "\"", 1);
}


static void
tok_py_json(tok_buf_t *b, const cJSON *v)
{
    const cJSON  *e;
    char          num[64];
    int           first = 1;

    if (cJSON_IsNull(v) || v == NULL) {
        tok_buf_str(b, "null");
    } else if (cJSON_IsTrue(v)) {
        tok_buf_str(b, "true");
    } else if (cJSON_IsFalse(v)) {
        tok_buf_str(b, "false");
    } else if (cJSON_IsString(v)) {
        tok_py_json_string(b, v->valuestring);
    } else if (cJSON_IsNumber(v)) {
        /* cJSON keeps no source text: integral values print as ints */
        if (v->valuedouble == (double) (long long) v->valuedouble
            && v->valuedouble > -9007199254740992.0
            && v->valuedouble < 9007199254740992.0)
        {
            snprintf(num, sizeof(num), "%lld", (long long) v->valuedouble);
        } else {
            /* the shortest form that reads back the same, like repr() */
            int prec;
            for (prec = 1; prec <= 17; prec++) {
                snprintf(num, sizeof(num), "%.*g", prec, v->valuedouble);
                if (strtod(num, NULL) == v->valuedouble) {
                    break;
                }
            }
        }
        tok_buf_str(b, num);
    } else if (cJSON_IsArray(v)) {
        tok_buf_add(b, "[", 1);
        cJSON_ArrayForEach(e, v) {
            if (!first) {
                tok_buf_add(b, ", ", 2);
            }
            first = 0;
            tok_py_json(b, e);
        }
        tok_buf_add(b, "]", 1);
    } else if (cJSON_IsObject(v)) {
        tok_buf_add(b, "{", 1);
        cJSON_ArrayForEach(e, v) {
            if (!first) {
                tok_buf_add(b, ", ", 2);
            }
            first = 0;
            tok_py_json_string(b, e->string);
            tok_buf_add(b, ": ", 2);
            tok_py_json(b, e);
        }
        tok_buf_add(b, "}", 1);
    }
}


/* tool_calls[k].function, or the call itself if it has no "function" */
static const cJSON *
tok_call_function(const cJSON *call)
{
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(call, "function");

    return cJSON_IsObject(f) ? f : call;
}


/*
 * vLLM hands the template arguments parsed from their JSON string;
 * unparsable or non-string arguments are used as they are.
 */
static void
tok_call_arguments(tok_buf_t *b, const cJSON *fn, int raw_string_ok)
{
    const cJSON  *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
    cJSON        *parsed;

    if (cJSON_IsString(args)) {
        parsed = cJSON_Parse(args->valuestring);
        if (parsed != NULL) {
            tok_py_json(b, parsed);
            cJSON_Delete(parsed);
            return;
        }
        if (raw_string_ok) {
            tok_buf_str(b, args->valuestring);
            return;
        }
    }
    tok_py_json(b, args);
}


static const char *
tok_call_name(const cJSON *fn)
{
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(fn, "name");

    return cJSON_IsString(n) ? n->valuestring : "";
}


/* ---- the templates */

static const char *
tok_bos(const dpd_tok_t *tok)
{
    return tok->bos_token ? tok->bos_token : "<|begin_of_text|>";
}


/* One plain Llama 3 turn: header with the role, trimmed content, eot. */
static void
tok_llama3_turn(tok_buf_t *b, const tok_msg_t *m)
{
    tok_buf_str(b, "<|start_header_id|>");
    tok_buf_str(b, m->role);
    tok_buf_str(b, "<|end_header_id|>\n\n");
    tok_buf_trimmed(b, m->content, m->len);
    tok_buf_str(b, "<|eot_id|>");
}


static void
tok_render_llama3(const dpd_tok_t *tok, const tok_msg_t *m, size_t n,
    tok_buf_t *b)
{
    size_t  i;

    for (i = 0; i < n; i++) {
        if (i == 0) {
            tok_buf_str(b, tok_bos(tok));
        }
        tok_llama3_turn(b, &m[i]);
    }
    tok_buf_str(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
}


static void
tok_render_llama31(const dpd_tok_t *tok, const tok_msg_t *m, size_t n,
    tok_buf_t *b)
{
    const cJSON  *fn;
    size_t        i = 0;

    tok_buf_str(b, tok_bos(tok));
    tok_buf_str(b, "<|start_header_id|>system<|end_header_id|>\n\n");
    tok_buf_str(b, "Cutting Knowledge Date: December 2023\n");
    tok_buf_str(b, "Today Date: 26 Jul 2024\n\n");
    if (strcmp(m[0].role, "system") == 0) {
        tok_buf_trimmed(b, m[0].content, m[0].len);
        i = 1;
    }
    tok_buf_str(b, "<|eot_id|>");

    for ( ; i < n; i++) {
        if (m[i].tool_calls) {
            /* the template supports exactly one call */
            fn = tok_call_function(cJSON_GetArrayItem(m[i].tool_calls, 0));
            tok_buf_str(b, "<|start_header_id|>assistant<|end_header_id|>"
                        "\n\n");
            tok_buf_str(b, "{\"name\": \"");
            tok_buf_str(b, tok_call_name(fn));
            tok_buf_str(b, "\", \"parameters\": ");
            tok_call_arguments(b, fn, 0);
            tok_buf_str(b, "}<|eot_id|>");
        } else if (strcmp(m[i].role, "tool") == 0
                   || strcmp(m[i].role, "ipython") == 0)
        {
            /* strings are iterable in Jinja: the content goes through tojson */
            tok_buf_str(b, "<|start_header_id|>ipython<|end_header_id|>\n\n");
            tok_py_json_string(b, m[i].content);
            tok_buf_str(b, "<|eot_id|>");
        } else {
            tok_llama3_turn(b, &m[i]);
        }
    }
    tok_buf_str(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
}


static int
tok_is_tool_response(const tok_msg_t *m)
{
    static const char  open[] = "<tool_response>", close[] = "</tool_response>";

    return m->len >= sizeof(open) - 1
           && memcmp(m->content, open, sizeof(open) - 1) == 0
           && m->len >= sizeof(close) - 1
           && memcmp(m->content + m->len - (sizeof(close) - 1), close,
                     sizeof(close) - 1) == 0;
}


static void
tok_render_chatml_assistant(const tok_msg_t *m, size_t i, size_t n,
    size_t last_query, tok_buf_t *b)
{
    const char    *content = m[i].content, *reason = "", *p, *q;
    size_t         clen = m[i].len, rlen = 0, k = 0;
    const cJSON   *call;

    if (m[i].reasoning) {
        reason = m[i].reasoning;
        rlen = strlen(reason);
    } else if ((p = tok_memrmem(content, clen, "</think>")) != NULL) {
        /* reasoning = content.split('</think>')[0].rstrip('\n')
         *                     .split('<think>')[-1].lstrip('\n') */
        q = memmem(content, clen, "</think>", 8);
        reason = content;
        rlen = (size_t) (q - content);
        tok_strip_nl(&reason, &rlen, 0, 1);
        if ((q = tok_memrmem(reason, rlen, "<think>")) != NULL) {
            rlen -= (size_t) (q + 7 - reason);
            reason = q + 7;
        }
        tok_strip_nl(&reason, &rlen, 1, 0);
        /* content = content.split('</think>')[-1].lstrip('\n') */
        clen -= (size_t) (p + 8 - content);
        content = p + 8;
        tok_strip_nl(&content, &clen, 1, 0);
    }

    tok_buf_str(b, "<|im_start|>assistant\n");
    if (i + 1 > last_query + 1 && (i == n - 1 || rlen > 0)) {
        tok_buf_str(b, "<think>\n");
        p = reason;
        k = rlen;
        tok_strip_nl(&p, &k, 1, 1);
        tok_buf_add(b, p, k);
        tok_buf_str(b, "\n</think>\n\n");
        tok_strip_nl(&content, &clen, 1, 0);
    }
    tok_buf_add(b, content, clen);

    if (m[i].tool_calls) {
        k = 0;
        cJSON_ArrayForEach(call, m[i].tool_calls) {
            const cJSON *fn = tok_call_function(call);
            if ((k == 0 && clen > 0) || k > 0) {
                tok_buf_str(b, "\n");
            }
            tok_buf_str(b, "<tool_call>\n{\"name\": \"");
            tok_buf_str(b, tok_call_name(fn));
            tok_buf_str(b, "\", \"arguments\": ");
            tok_call_arguments(b, fn, 1);
            tok_buf_str(b, "}\n</tool_call>");
            k++;
        }
    }
    tok_buf_str(b, "<|im_end|>\n");
}


static void
tok_render_chatml(const dpd_tok_t *tok, const tok_msg_t *m, size_t n,
    tok_buf_t *b)
{
    size_t  i, last_query = n - 1;

    if (strcmp(m[0].role, "system") == 0) {
        tok_buf_str(b, "<|im_start|>system\n");
        tok_buf_add(b, m[0].content, m[0].len);
        tok_buf_str(b, "<|im_end|>\n");
    } else if (tok->chatml_system) {
        tok_buf_str(b, "<|im_start|>system\n");
        tok_buf_str(b, tok->chatml_system);
        tok_buf_str(b, "<|im_end|>\n");
    }
    /* the last user turn that is not a wrapped tool response */
    for (i = n; i-- > 0; ) {
        if (strcmp(m[i].role, "user") == 0 && !tok_is_tool_response(&m[i])) {
            last_query = i;
            break;
        }
    }

    for (i = 0; i < n; i++) {
        if (strcmp(m[i].role, "user") == 0
            || (strcmp(m[i].role, "system") == 0 && i > 0))
        {
            tok_buf_str(b, "<|im_start|>");
            tok_buf_str(b, m[i].role);
            tok_buf_str(b, "\n");
            tok_buf_add(b, m[i].content, m[i].len);
            tok_buf_str(b, "<|im_end|>\n");
        } else if (strcmp(m[i].role, "assistant") == 0 && tok->chatml_plain
                   && m[i].tool_calls == NULL)
        {
            /* Qwen 2 / 2.5: the content as it is */
            tok_buf_str(b, "<|im_start|>assistant\n");
            tok_buf_add(b, m[i].content, m[i].len);
            tok_buf_str(b, "<|im_end|>\n");
        } else if (strcmp(m[i].role, "assistant") == 0) {
            tok_render_chatml_assistant(m, i, n, last_query, b);
        } else if (strcmp(m[i].role, "tool") == 0) {
            if (i == 0 || strcmp(m[i - 1].role, "tool") != 0) {
                tok_buf_str(b, "<|im_start|>user");
            }
            tok_buf_str(b, "\n<tool_response>\n");
            tok_buf_add(b, m[i].content, m[i].len);
            tok_buf_str(b, "\n</tool_response>");
            if (i == n - 1 || strcmp(m[i + 1].role, "tool") != 0) {
                tok_buf_str(b, "<|im_end|>\n");
            }
        }
    }
    tok_buf_str(b, "<|im_start|>assistant\n");
}


static dpd_chat_template_t
tok_resolve(const dpd_tok_t *tok, dpd_chat_template_t t)
{
    if (t == DPD_CHAT_AUTO) {
        t = tok->detected;
    }
    if (t != DPD_CHAT_LLAMA3 && t != DPD_CHAT_LLAMA31
        && t != DPD_CHAT_CHATML)
    {
        t = DPD_CHAT_NONE;
    }
    return t;
}


int
dpd_chat_render_json(const dpd_tok_t *tok, dpd_chat_template_t tmpl,
    const struct cJSON *messages, char **out, size_t *outlen,
    char *err, size_t errlen)
{
    tok_msg_t  *m;
    size_t      n;
    tok_buf_t   b = { NULL, 0, 0, 0 };

    *out = NULL;
    *outlen = 0;
    if (tok == NULL) {
        tok_err(err, errlen, "no tokenizer");
        return -1;
    }
    if (tok_msgs_parse(messages, &m, &n, err, errlen) != 0) {
        return -1;
    }
    switch (tok_resolve(tok, tmpl)) {
    case DPD_CHAT_LLAMA3:
        tok_render_llama3(tok, m, n, &b);
        break;
    case DPD_CHAT_LLAMA31:
        tok_render_llama31(tok, m, n, &b);
        break;
    case DPD_CHAT_CHATML:
        tok_render_chatml(tok, m, n, &b);
        break;
    default:
        tok_msgs_free(m, n);
        return 1;
    }
    tok_msgs_free(m, n);
    if (b.oom) {
        free(b.p);
        tok_err(err, errlen, "out of memory");
        return -1;
    }
    *out = b.p;
    *outlen = b.len;
    return 0;
}


long
dpd_chat_count_json(const dpd_tok_t *tok, dpd_chat_template_t tmpl,
    const struct cJSON *messages, int *estimated, char *err, size_t errlen)
{
    tok_msg_t  *m;
    size_t      n, i, len;
    char       *text;
    long        total, c;
    int         rc;

    if (estimated) {
        *estimated = 0;
    }
    rc = dpd_chat_render_json(tok, tmpl, messages, &text, &len, err, errlen);
    if (rc < 0) {
        return -1;
    }
    if (rc == 0) {
        total = dpd_tok_count(tok, text, len, 0);
        free(text);
        if (total < 0) {
            tok_err(err, errlen, "tokenizer failure");
        }
        return total;
    }

    /* unknown template: content tokens plus a fixed overhead per message */
    if (tok_msgs_parse(messages, &m, &n, err, errlen) != 0) {
        return -1;
    }
    total = DPD_CHAT_EST_PRIMING;
    for (i = 0; i < n; i++) {
        c = dpd_tok_count(tok, m[i].content, m[i].len, 0);
        if (c < 0) {
            tok_msgs_free(m, n);
            tok_err(err, errlen, "tokenizer failure");
            return -1;
        }
        total += c + DPD_CHAT_EST_PER_MESSAGE;
    }
    tok_msgs_free(m, n);
    if (estimated) {
        *estimated = 1;
    }
    return total;
}


static cJSON *
tok_parse_messages(const char *json, size_t len, char *err, size_t errlen)
{
    cJSON  *root = cJSON_ParseWithLength(json, len);

    if (root == NULL) {
        tok_err(err, errlen, "messages: invalid JSON");
    }
    return root;
}


int
dpd_chat_render(const dpd_tok_t *tok, dpd_chat_template_t tmpl,
    const char *messages_json, size_t len, char **out, size_t *outlen,
    char *err, size_t errlen)
{
    cJSON  *root;
    int     rc;

    *out = NULL;
    *outlen = 0;
    if ((root = tok_parse_messages(messages_json, len, err, errlen)) == NULL) {
        return -1;
    }
    rc = dpd_chat_render_json(tok, tmpl, root, out, outlen, err, errlen);
    cJSON_Delete(root);
    return rc;
}


long
dpd_chat_count(const dpd_tok_t *tok, dpd_chat_template_t tmpl,
    const char *messages_json, size_t len, int *estimated,
    char *err, size_t errlen)
{
    cJSON  *root;
    long    rc;

    if ((root = tok_parse_messages(messages_json, len, err, errlen)) == NULL) {
        return -1;
    }
    rc = dpd_chat_count_json(tok, tmpl, root, estimated, err, errlen);
    cJSON_Delete(root);
    return rc;
}
