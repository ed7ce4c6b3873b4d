
/*
 * gpt-oss chats as vLLM renders them: not a Jinja template but
 * openai_harmony (current vLLM: renderers/online_renderer.py
 * OnlineRenderer._make_request_with_harmony, commit efa1035f; default
 * env: VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS off, VLLM_SYSTEM_START_DATE
 * unset).  The messages are built as vLLM's
 * entrypoints/openai/parser/harmony_utils.py does
 * (extract_instructions_from_messages, build_harmony_preamble,
 * get_system_message, get_developer_message,
 * get_system_or_developer_message, parse_chat_inputs_to_harmony_messages
 * with its auto_drop_analysis_messages) and rendered as harmony's Rust renderer
 * does (src/encoding.rs: Render<Message>, Render<SystemContent>,
 * Render<DeveloperContent>, template_tools_section,
 * json_schema_to_typescript, render_conversation_for_completion).
 *
 * harmony encodes every piece of text on its own with encode_ordinary
 * (a user's "<|start|>" is text, not the special token) and the format
 * tokens as single ids: the ids are built the same way, piece by piece,
 * and the rendered text is those pieces joined (for --render).
 *
 * Checked against openai-harmony itself (0.0.8, vLLM's pin) by
 * t/tokenizer/23-harmony-oracle.t through tools/python/harmony_oracle.py,
 * which prepares requests as online_renderer.py 01063cd0 does.
 *
 * Returns 0 (exact), 1 (a feature not reproduced exactly: err says which,
 * the caller estimates) or -1 (refused as vLLM refuses it: 400).
 */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <cjson/cJSON.h>

#include "dpd_tokenizer.h"
#include "tok_internal.h"


static const char *th_names[TOK_H_N] = {
    "<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|call|>",
    "<|constrain|>"
};


/* gpt-oss: the format tokens are special added tokens, no Jinja template */
void
tok_harmony_detect(dpd_tok_t *tok)
{
    uint32_t  i;
    int       k, found;

    tok->harmony = 0;
    if (dpd_tok_chat_template(tok) != DPD_CHAT_NONE) {
        return;
    }
    for (k = 0; k < TOK_H_N; k++) {
        found = 0;
        for (i = 0; i < tok->n_added; i++) {
            if (tok->added[i].special
                && tok->added[i].len == strlen(th_names[k])
                && memcmp(tok->added[i].content, th_names[k],
                          tok->added[i].len) == 0)
            {
                tok->harmony_id[k] = tok->added[i].id;
                found = 1;
                break;
            }
        }
        if (!found) {
            return;
        }
    }
    tok->harmony = 1;
}


int
dpd_tok_chat_harmony(const dpd_tok_t *tok)
{
    return tok != NULL && tok->harmony;
}


/* ---- growing strings */

typedef struct {
    char    *p;
    size_t   n;
    size_t   cap;
    int      oom;
} th_str_t;


/*
 * What one render may cost, from the request's own size: the bytes it
 * appends to any string (a nested schema level copies its child's text
 * into its own, every comment line is indented) and the steps of its
 * lookups (the required list per property, the calls per tool result).
 * Past either, the request gets the estimate: a client must not buy
 * minutes of CPU or gigabytes of copies with a megabyte of body.  Per
 * thread: renders run in dpd_count_thread_pool threads too.
 */
typedef struct {
    size_t  bytes;
    size_t  max_bytes;
    size_t  steps;
    size_t  max_steps;
    int     over;
} th_budget_t;

static __thread th_budget_t  *th_budget;


/* n more steps; 1 when the render is past its budget */
static int
th_steps(size_t n)
{
    if (th_budget == NULL) {
        return 0;
    }
    th_budget->steps += n;
    if (th_budget->steps > th_budget->max_steps) {
        th_budget->over = 1;
    }
    return th_budget->over;
}


/* the request's own size: bytes of its strings and keys, and its values */
static void
th_size(const cJSON *j, size_t *bytes, size_t *nodes)
{
    const cJSON  *c;

    for (c = j; c != NULL; c = c->next) {
        (*nodes)++;
        if (c->string) {
            *bytes += strlen(c->string);
        }
        if (cJSON_IsString(c) && c->valuestring) {
            *bytes += strlen(c->valuestring);
        }
        if (c->child) {
            th_size(c->child, bytes, nodes);
        }
    }
}


static void
th_add(th_str_t *s, const char *src, size_t n)
{
    size_t   cap;
    char    *p;

    if (s->oom) {
        return;
    }
    if (th_budget != NULL) {
        th_budget->bytes += n;
        if (th_budget->bytes > th_budget->max_bytes) {
            th_budget->over = 1;
        }
        if (th_budget->over) {
            s->oom = 1;
            return;
        }
    }
    if (s->n + n + 1 > s->cap) {
        cap = s->cap ? s->cap : 256;
        while (cap < s->n + n + 1) {
            if (cap > ((size_t) -1) / 2) {
                s->oom = 1;
                return;
            }
            cap *= 2;
        }
        p = realloc(s->p, cap);
        if (p == NULL) {
            s->oom = 1;
            return;
        }
        s->p = p;
        s->cap = cap;
    }
    memcpy(s->p + s->n, src, n);
    s->n += n;
    s->p[s->n] = '\0';
}


static void
th_cs(th_str_t *s, const char *c)
{
    th_add(s, c, strlen(c));
}


/* ---- the output: text pieces and format tokens */

typedef struct {
    const dpd_tok_t  *tok;
    th_str_t          text;
    uint32_t         *ids;
    size_t            nids;
    size_t            cap;
    int               want_ids;
    long              count;
    int               oom;
} th_out_t;


static void
th_special(th_out_t *o, int k)
{
    uint32_t  *p;

    th_cs(&o->text, th_names[k]);
    o->count++;
    if (!o->want_ids || o->oom) {
        return;
    }
    if (o->nids == o->cap) {
        p = realloc(o->ids, (o->cap ? 2 * o->cap : 256) * sizeof(uint32_t));
        if (p == NULL) {
            o->oom = 1;
            return;
        }
        o->ids = p;
        o->cap = o->cap ? 2 * o->cap : 256;
    }
    o->ids[o->nids++] = o->tok->harmony_id[k];
}


/* encode_ordinary: added tokens in s are text */
static void
th_text(th_out_t *o, const char *s, size_t n)
{
    tok_sink_t   sink = { NULL, 0, 0 };
    long         c;
    uint32_t    *p;
    size_t       cap;

    if (n == 0 || o->oom) {
        return;
    }
    th_add(&o->text, s, n);
    if (o->want_ids) {
        sink.ids = o->ids + o->nids;
        sink.cap = o->cap - o->nids;
    }
    c = tok_encode_plain_sink(o->tok, s, n, &sink);
    if (c < 0) {
        o->oom = 1;
        return;
    }
    if (o->want_ids && (size_t) c > o->cap - o->nids) {
        cap = o->nids + (size_t) c + 256;
        p = realloc(o->ids, cap * sizeof(uint32_t));
        if (p == NULL) {
            o->oom = 1;
            return;
        }
        o->ids = p;
        o->cap = cap;
        sink.ids = o->ids + o->nids;
        sink.cap = o->cap - o->nids;
        sink.n = 0;
        if (tok_encode_plain_sink(o->tok, s, n, &sink) != c) {
            o->oom = 1;
            return;
        }
    }
    if (o->want_ids) {
        o->nids += (size_t) c;
    }
    o->count += c;
}


static void
th_text_cs(th_out_t *o, const char *s)
{
    th_text(o, s, strlen(s));
}


/* ---- JSON schema -> TypeScript (encoding.rs json_schema_to_typescript) */

#define TH_UNSUPPORTED  1

typedef struct {
    char          *err;
    size_t         errlen;
    const cJSON   *lead;        /* the leading system/developer message */
} th_ctx_t;


static const cJSON *
th_get(const cJSON *o, const char *k)
{
    /* serde's Value::get: None unless o is an object holding k */
    return cJSON_IsObject(o) ? cJSON_GetObjectItemCaseSensitive(o, k) : NULL;
}


static const char *
th_get_str(const cJSON *o, const char *k)
{
    const cJSON  *v = th_get(o, k);

    return cJSON_IsString(v) ? v->valuestring : NULL;
}


static int
th_is_enum(const cJSON *schema)
{
    const cJSON  *e = th_get(schema, "enum");

    return cJSON_IsArray(e) && e->child != NULL;
}


/* serde_json's compact Display; numbers are left to the estimate: the
 * request's digits ("1" or "1.0") are not kept by the parser */
static int
th_json(th_str_t *s, const cJSON *v)
{
    const cJSON          *c;
    const unsigned char  *p;
    char                  esc[8];

    if (cJSON_IsNull(v)) {
        th_cs(s, "null");
    } else if (cJSON_IsTrue(v)) {
        th_cs(s, "true");
    } else if (cJSON_IsFalse(v)) {
        th_cs(s, "false");
    } else if (cJSON_IsString(v)) {
        th_cs(s, "\"");
        for (p = (const unsigned char *) v->valuestring; *p; p++) {
            switch (*p) {
            case '"':  th_cs(s, "\\\""); break;
            case '\\': th_cs(s, "\\\\"); break;
            case '\b': th_cs(s, "\\b"); break;
            case '\f': th_cs(s, "\\f"); break;
            case '\n': th_cs(s, "\\n"); break;
            case '\r': th_cs(s, "\\r"); break;
            case '\t': th_cs(s, "\\t"); break;
            default:
                if (*p < 0x20) {
                    snprintf(esc, sizeof(esc), "\\u%04x", *p);
                    th_cs(s, esc);
                } else {
                    th_add(s, (const char *) p, 1);
                }
            }
        }
        th_cs(s, "\"");
    } else if (cJSON_IsArray(v) || cJSON_IsObject(v)) {
        th_cs(s, cJSON_IsArray(v) ? "[" : "{");
        for (c = v->child; c; c = c->next) {
            if (c != v->child) {
                th_cs(s, ",");
            }
            if (cJSON_IsObject(v)) {
                cJSON  key;

                memset(&key, 0, sizeof(key));
                key.type = cJSON_String;
                key.valuestring = c->string;
                th_json(s, &key);
                th_cs(s, ":");
            }
            if (th_json(s, c) != 0) {
                return TH_UNSUPPORTED;
            }
        }
        th_cs(s, cJSON_IsArray(v) ? "]" : "}");
    } else {
        return TH_UNSUPPORTED;
    }
    return 0;
}


static int
th_ts(th_ctx_t *x, th_str_t *out, const cJSON *schema, const char *indent);


static int
th_ts_object(th_ctx_t *x, th_str_t *out, const cJSON *schema,
    const char *indent)
{
    const cJSON  *props, *req, *val, *r, *ex, *e, *dflt, *nul;
    const char   *desc, *title;
    th_str_t      sub, inner;
    int           required, rc;

    if ((desc = th_get_str(schema, "description")) != NULL) {
        th_cs(out, indent);
        th_cs(out, "// ");
        th_cs(out, desc);
        th_cs(out, "\n");
    }
    th_cs(out, "{\n");
    props = th_get(schema, "properties");
    req = th_get(schema, "required");
    memset(&sub, 0, sizeof(sub));
    th_cs(&sub, indent);
    th_cs(&sub, "    ");
    if (sub.oom) {
        return -1;
    }
    for (val = cJSON_IsObject(props) ? props->child : NULL; val;
         val = val->next)
    {
        if ((title = th_get_str(val, "title")) != NULL) {
            th_cs(out, indent);
            th_cs(out, "// ");
            th_cs(out, title);
            th_cs(out, "\n");
            th_cs(out, indent);
            th_cs(out, "//\n");
        }
        if (th_get(val, "oneOf") == NULL
            && (desc = th_get_str(val, "description")) != NULL)
        {
            th_cs(out, indent);
            th_cs(out, "// ");
            th_cs(out, desc);
            th_cs(out, "\n");
        }
        ex = th_get(val, "examples");
        if (cJSON_IsArray(ex) && ex->child != NULL) {
            th_cs(out, indent);
            th_cs(out, "// Examples:\n");
            cJSON_ArrayForEach(e, ex) {
                if (cJSON_IsString(e)) {
                    th_cs(out, indent);
                    th_cs(out, "// - \"");
                    th_cs(out, e->valuestring);
                    th_cs(out, "\"\n");
                }
            }
        }
        if (cJSON_IsArray(th_get(val, "oneOf"))) {
            free(sub.p);
            tok_err(x->err, x->errlen, "harmony: a tool parameter with "
                    "oneOf gets the estimate");
            return TH_UNSUPPORTED;
        }
        required = 0;
        cJSON_ArrayForEach(r, (cJSON_IsArray(req) ? req : NULL)) {
            if (th_steps(1)) {
                free(sub.p);
                return -1;
            }
            if (cJSON_IsString(r) && strcmp(r->valuestring, val->string) == 0)
            {
                required = 1;
            }
        }
        th_cs(out, indent);
        th_cs(out, val->string);
        th_cs(out, required ? ": " : "?: ");
        memset(&inner, 0, sizeof(inner));
        rc = th_ts(x, &inner, val, sub.p);
        if (rc != 0) {
            free(inner.p);
            free(sub.p);
            return rc;
        }
        if (inner.oom) {
            free(sub.p);
            return -1;
        }
        nul = th_get(val, "nullable");
        if (cJSON_IsTrue(nul)
            && (inner.p == NULL || strstr(inner.p, "null") == NULL))
        {
            th_cs(&inner, " | null");
        }
        if (inner.p) {
            th_cs(out, inner.p);
        }
        free(inner.p);
        th_cs(out, ",");
        dflt = th_get(val, "default");
        if (th_get(val, "oneOf") == NULL && dflt != NULL) {
            if (cJSON_IsString(dflt) && !th_is_enum(val)) {
                th_cs(out, " // default: \"");
                th_cs(out, dflt->valuestring);
                th_cs(out, "\"");
            } else if (cJSON_IsString(dflt)) {
                th_cs(out, " // default: ");
                th_cs(out, dflt->valuestring);
            } else {
                th_cs(out, " // default: ");
                if (th_json(out, dflt) != 0) {
                    free(sub.p);
                    tok_err(x->err, x->errlen, "harmony: a numeric default "
                            "of a tool parameter gets the estimate");
                    return TH_UNSUPPORTED;
                }
            }
        }
        th_cs(out, "\n");
    }
    free(sub.p);
    th_cs(out, indent);
    th_cs(out, "}");
    return 0;
}


static int
th_ts(th_ctx_t *x, th_str_t *out, const cJSON *schema, const char *indent)
{
    const cJSON  *ty, *t, *en, *items;
    const char   *s;
    int           n;

    if (cJSON_IsArray(th_get(schema, "oneOf"))) {
        tok_err(x->err, x->errlen, "harmony: a tool schema with oneOf gets "
                "the estimate");
        return TH_UNSUPPORTED;
    }
    ty = th_get(schema, "type");
    if (cJSON_IsArray(ty)) {
        n = 0;
        cJSON_ArrayForEach(t, ty) {
            if (cJSON_IsString(t)) {
                th_cs(out, n++ ? " | " : "");
                th_cs(out, strcmp(t->valuestring, "integer") == 0
                           ? "number" : t->valuestring);
            }
        }
        if (n) {
            return 0;
        }
    }
    if (!cJSON_IsString(ty)) {
        th_cs(out, "any");
        return 0;
    }
    s = ty->valuestring;
    if (strcmp(s, "object") == 0) {
        return th_ts_object(x, out, schema, indent);
    }
    if (strcmp(s, "string") == 0) {
        en = th_get(schema, "enum");
        n = 0;
        cJSON_ArrayForEach(t, (cJSON_IsArray(en) ? en : NULL)) {
            if (cJSON_IsString(t)) {
                th_cs(out, n++ ? " | \"" : "\"");
                th_cs(out, t->valuestring);
                th_cs(out, "\"");
            }
        }
        if (n == 0) {
            th_cs(out, "string");
        }
        return 0;
    }
    if (strcmp(s, "number") == 0 || strcmp(s, "integer") == 0) {
        th_cs(out, "number");
        return 0;
    }
    if (strcmp(s, "boolean") == 0) {
        th_cs(out, "boolean");
        return 0;
    }
    if (strcmp(s, "array") == 0) {
        items = th_get(schema, "items");
        if (items == NULL) {
            th_cs(out, "Array<any>");
            return 0;
        }
        n = th_ts(x, out, items, indent);
        if (n == 0) {
            th_cs(out, "[]");
        }
        return n;
    }
    th_cs(out, "any");
    return 0;
}


/* Rust's str::lines: '\n' ends a line, one '\r' before it is dropped, no
 * empty last line */
static void
th_comment_lines(th_str_t *out, const char *s, int *first)
{
    const char  *nl;
    size_t       n;

    while (*s) {
        nl = strchr(s, '\n');
        n = nl ? (size_t) (nl - s) : strlen(s);
        th_cs(out, *first ? "" : "\n");
        *first = 0;
        th_cs(out, "// ");
        th_add(out, s, (n && s[n - 1] == '\r' && nl) ? n - 1 : n);
        if (nl == NULL) {
            break;
        }
        s = nl + 1;
    }
}


/* the developer message's text: template_tools_section with the one
 * namespace "functions" (no description), joined as encoding.rs joins */
static int
th_tools(th_ctx_t *x, th_str_t *dev, const cJSON *tools)
{
    const cJSON  *tool, *fn, *ty, *name, *desc, *params;
    th_str_t      sec;
    int           first, rc;

    th_cs(dev, "# Tools\n\n## functions\n\nnamespace functions {\n");
    cJSON_ArrayForEach(tool, tools) {
        if (!cJSON_IsObject(tool)) {
            tok_err(x->err, x->errlen, "tools: expected objects");
            return -1;
        }
        ty = cJSON_GetObjectItemCaseSensitive(tool, "type");
        if (ty != NULL && !(cJSON_IsString(ty)
                            && strcmp(ty->valuestring, "function") == 0))
        {
            tok_err(x->err, x->errlen, "tools: only type \"function\" is "
                    "supported");
            return -1;
        }
        fn = cJSON_GetObjectItemCaseSensitive(tool, "function");
        name = th_get(fn, "name");
        if (!cJSON_IsString(name)) {
            tok_err(x->err, x->errlen, "tools: function.name: expected a "
                    "string");
            return -1;
        }
        desc = th_get(fn, "description");
        /* a missing or null description is "": current vLLM's
         * create_tool_definition passes `description or ""` (harmony's
         * ToolDescription requires a str); harmony renders no comment
         * line for it (proven by t/tokenizer/23-harmony-oracle.t) */
        if (desc != NULL && !cJSON_IsNull(desc) && !cJSON_IsString(desc)) {
            tok_err(x->err, x->errlen, "tools: function.description: "
                    "expected a string");
            return -1;
        }
        params = th_get(fn, "parameters");
        if (params != NULL && !cJSON_IsNull(params)
            && !cJSON_IsObject(params))
        {
            tok_err(x->err, x->errlen, "tools: function.parameters: "
                    "expected an object");
            return -1;
        }
        /* joined with "\n": the namespace line ends in "\n" itself */
        first = 0;
        th_comment_lines(dev, cJSON_IsString(desc) ? desc->valuestring : "",
                         &first);
        th_cs(dev, "\ntype ");
        th_cs(dev, name->valuestring);
        if (params != NULL && !cJSON_IsNull(params)) {
            memset(&sec, 0, sizeof(sec));
            rc = th_ts(x, &sec, params, "");
            if (rc != 0 || sec.oom) {
                free(sec.p);
                return rc ? rc : -1;
            }
            th_cs(dev, " = (_: ");
            if (sec.p) {
                th_cs(dev, sec.p);
            }
            free(sec.p);
            th_cs(dev, ") => any;\n");
        } else {
            th_cs(dev, " = () => any;\n");
        }
    }
    th_cs(dev, "\n} // namespace functions");
    return 0;
}


/* ---- the chat messages, converted as vLLM converts them */

enum { TH_USER, TH_ASSISTANT, TH_SYSTEM, TH_DEVELOPER, TH_TOOL };

static const char *th_roles[] = {
    "user", "assistant", "system", "developer", "tool"
};

typedef struct {
    const char  *s;
    size_t       n;
} th_span_t;

typedef struct {
    int          role;
    char        *author;        /* tool: "functions.NAME" */
    char        *recipient;
    const char  *channel;
    int          json;          /* content type "json" */
    th_span_t   *parts;
    size_t       nparts;
    th_str_t     own;           /* flattened text, when it is built */
} th_msg_t;

typedef struct {
    th_msg_t    *m;
    size_t       n;
    size_t       cap;
} th_list_t;


static th_msg_t *
th_push(th_list_t *l, int role, const char *channel)
{
    th_msg_t  *p;

    if (l->n == l->cap) {
        p = realloc(l->m, (l->cap ? 2 * l->cap : 16) * sizeof(th_msg_t));
        if (p == NULL) {
            return NULL;
        }
        l->m = p;
        l->cap = l->cap ? 2 * l->cap : 16;
    }
    p = &l->m[l->n++];
    memset(p, 0, sizeof(*p));
    p->role = role;
    p->channel = channel;
    return p;
}


static void
th_list_free(th_list_t *l)
{
    size_t  i;

    for (i = 0; i < l->n; i++) {
        free(l->m[i].author);
        free(l->m[i].recipient);
        free(l->m[i].parts);
        free(l->m[i].own.p);
    }
    free(l->m);
}


static int
th_one_part(th_msg_t *m, const char *s, size_t n)
{
    m->parts = malloc(sizeof(th_span_t));
    if (m->parts == NULL) {
        return -1;
    }
    m->parts[0].s = s;
    m->parts[0].n = n;
    m->nparts = 1;
    return 0;
}


static char *
th_concat(const char *a, const char *b)
{
    size_t   na = strlen(a), nb = strlen(b);
    char    *p = malloc(na + nb + 1);

    if (p) {
        memcpy(p, a, na);
        memcpy(p + na, b, nb + 1);
    }
    return p;
}


/* content: NULL, a string or text parts; anything else is left to the
 * estimate (vLLM reads other parts as "") */
static int
th_check_content(th_ctx_t *x, const cJSON *c, size_t i)
{
    const cJSON  *p, *t;

    if (c == NULL || cJSON_IsNull(c) || cJSON_IsString(c)) {
        return 0;
    }
    if (!cJSON_IsArray(c)) {
        tok_err(x->err, x->errlen, "messages[%zu].content: expected a "
                "string or an array", i);
        return -1;
    }
    cJSON_ArrayForEach(p, c) {
        if (!cJSON_IsObject(p)) {
            tok_err(x->err, x->errlen, "messages[%zu].content: expected "
                    "objects", i);
            return -1;
        }
        t = cJSON_GetObjectItemCaseSensitive(p, "type");
        if (!cJSON_IsString(t) || strcmp(t->valuestring, "text") != 0
            || !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(p, "text")))
        {
            tok_err(x->err, x->errlen, "harmony: a non-text content part "
                    "(messages[%zu]) gets the estimate", i);
            return TH_UNSUPPORTED;
        }
    }
    return 0;
}


/* flatten_chat_text_content: the text parts joined */
static int
th_flat(th_msg_t *m, const cJSON *c)
{
    const cJSON  *p;

    if (cJSON_IsString(c)) {
        return th_one_part(m, c->valuestring, strlen(c->valuestring));
    }
    cJSON_ArrayForEach(p, (cJSON_IsArray(c) ? c : NULL)) {
        th_cs(&m->own, cJSON_GetObjectItemCaseSensitive(p, "text")
                       ->valuestring);
    }
    if (m->own.oom) {
        return -1;
    }
    return th_one_part(m, m->own.p ? m->own.p : "", m->own.n);
}


/*
 * flatten_input_text_content into s: 0 with the text, 1 where vLLM gets
 * None (null or absent content, an array without text), -1 out of memory
 */
static int
th_instr(th_str_t *s, const cJSON *c)
{
    const cJSON  *p;

    if (cJSON_IsString(c)) {
        th_cs(s, c->valuestring);
        return s->oom ? -1 : 0;
    }
    if (!cJSON_IsArray(c) || c->child == NULL) {
        return 1;
    }
    cJSON_ArrayForEach(p, c) {
        th_cs(s, cJSON_GetObjectItemCaseSensitive(p, "text")->valuestring);
    }
    return s->oom ? -1 : 0;
}


/* the id -> function name map of the tool calls (last one wins) */
static const cJSON *
th_call_name(const cJSON *msgs, const cJSON *skip, const char *id)
{
    const cJSON  *m, *calls, *c, *cid, *name = NULL;

    cJSON_ArrayForEach(m, msgs) {
        if (th_steps(1)) {
            return NULL;
        }
        if (m == skip) {
            continue;
        }
        calls = th_get(m, "tool_calls");
        cJSON_ArrayForEach(c, (cJSON_IsArray(calls) ? calls : NULL)) {
            if (th_steps(1)) {
                return NULL;
            }
            cid = th_get(c, "id");
            if ((id == NULL && (cid == NULL || cJSON_IsNull(cid)))
                || (id != NULL && cJSON_IsString(cid)
                    && strcmp(cid->valuestring, id) == 0))
            {
                name = th_get(th_get(c, "function"), "name");
                if (name == NULL) {
                    name = c;   /* marker: no name */
                }
            }
        }
    }
    return name;
}


static int
th_message(th_ctx_t *x, th_list_t *l, const cJSON *msgs, const cJSON *cm,
    size_t i)
{
    const cJSON  *role, *content, *calls, *call, *fn, *name, *args, *reason,
                 *id, *p;
    th_msg_t     *m;
    int           r, rc;
    size_t        k;

    if (!cJSON_IsObject(cm)) {
        tok_err(x->err, x->errlen, "messages[%zu]: expected an object", i);
        return -1;
    }
    role = cJSON_GetObjectItemCaseSensitive(cm, "role");
    if (!cJSON_IsString(role)) {
        tok_err(x->err, x->errlen, "messages[%zu].role: expected a string",
                i);
        return -1;
    }
    for (r = 0; r < 5; r++) {
        if (strcmp(role->valuestring, th_roles[r]) == 0) {
            break;
        }
    }
    if (r == 5) {
        tok_err(x->err, x->errlen, "messages[%zu].role: unknown role \"%s\"",
                i, role->valuestring);
        return -1;
    }
    content = cJSON_GetObjectItemCaseSensitive(cm, "content");
    if ((rc = th_check_content(x, content, i)) != 0) {
        return rc;
    }
    if (cJSON_GetObjectItemCaseSensitive(cm, "reasoning_content") != NULL) {
        tok_err(x->err, x->errlen, "harmony: reasoning_content "
                "(messages[%zu]) gets the estimate: vLLM versions read it "
                "differently", i);
        return TH_UNSUPPORTED;
    }
    reason = cJSON_GetObjectItemCaseSensitive(cm, "reasoning");
    if (reason != NULL && !cJSON_IsNull(reason) && !cJSON_IsString(reason)) {
        tok_err(x->err, x->errlen, "messages[%zu].reasoning: expected a "
                "string", i);
        return -1;
    }
    calls = cJSON_GetObjectItemCaseSensitive(cm, "tool_calls");
    if (calls != NULL && !cJSON_IsArray(calls)) {
        tok_err(x->err, x->errlen, "harmony: tool_calls that is not an "
                "array (messages[%zu]) gets the estimate", i);
        return TH_UNSUPPORTED;
    }

    if (r == TH_ASSISTANT && calls != NULL && calls->child != NULL) {
        if (content != NULL && !cJSON_IsNull(content)) {
            if ((m = th_push(l, r, "commentary")) == NULL
                || th_flat(m, content) != 0)
            {
                return -1;
            }
            if (m->parts[0].n == 0) {
                l->n--;         /* `if content:` */
                free(m->parts);
                free(m->own.p);
            }
        }
        if (cJSON_IsString(reason) && reason->valuestring[0]) {
            if ((m = th_push(l, r, "analysis")) == NULL
                || th_one_part(m, reason->valuestring,
                               strlen(reason->valuestring)) != 0)
            {
                return -1;
            }
        }
        k = 0;
        cJSON_ArrayForEach(call, calls) {
            fn = th_get(call, "function");
            if (!cJSON_IsObject(call)
                || (fn != NULL && !cJSON_IsObject(fn)))
            {
                tok_err(x->err, x->errlen, "messages[%zu].tool_calls[%zu]: "
                        "expected an object with a function object", i, k);
                return -1;
            }
            name = th_get(fn, "name");
            args = th_get(fn, "arguments");
            if ((name != NULL && !cJSON_IsString(name))
                || (args != NULL && !cJSON_IsNull(args)
                    && !cJSON_IsString(args)))
            {
                tok_err(x->err, x->errlen, "harmony: a tool call whose name "
                        "or arguments is not a string (messages[%zu]) gets "
                        "the estimate", i);
                return TH_UNSUPPORTED;
            }
            if ((m = th_push(l, r, "commentary")) == NULL) {
                return -1;
            }
            m->json = 1;
            m->recipient = th_concat("functions.",
                                     name ? name->valuestring : "");
            if (m->recipient == NULL
                || th_one_part(m, cJSON_IsString(args) ? args->valuestring
                                                       : "",
                               cJSON_IsString(args)
                               ? strlen(args->valuestring) : 0) != 0)
            {
                return -1;
            }
            k++;
        }
        return 0;
    }

    if (r == TH_TOOL) {
        id = cJSON_GetObjectItemCaseSensitive(cm, "tool_call_id");
        if (id != NULL && !cJSON_IsString(id)) {
            tok_err(x->err, x->errlen, "messages[%zu].tool_call_id: "
                    "expected a string", i);
            return -1;
        }
        name = th_call_name(msgs, x->lead, id ? id->valuestring : "");
        if (th_budget != NULL && th_budget->over) {
            return -1;
        }
        if (name != NULL && !cJSON_IsString(name)) {
            tok_err(x->err, x->errlen, "harmony: a tool result whose call "
                    "has no name (messages[%zu]) gets the estimate", i);
            return TH_UNSUPPORTED;
        }
        if ((m = th_push(l, r, "commentary")) == NULL) {
            return -1;
        }
        m->author = th_concat("functions.", name ? name->valuestring : "");
        m->recipient = th_concat("assistant", "");
        if (m->author == NULL || m->recipient == NULL
            || th_flat(m, content) != 0)
        {
            return -1;
        }
        return 0;
    }

    if (r == TH_SYSTEM || r == TH_DEVELOPER) {
        /* not the leading one: get_system_or_developer_message, with
         * VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS off a developer message
         * whose DeveloperContent has only instructions (Render<
         * DeveloperContent>: "# Instructions", the text, joined "\n\n",
         * one text piece); no message where the text is None */
        if ((m = th_push(l, TH_DEVELOPER, NULL)) == NULL) {
            return -1;
        }
        th_cs(&m->own, "# Instructions\n\n");
        rc = th_instr(&m->own, content);
        if (rc < 0 || m->own.oom) {
            return -1;
        }
        if (rc == 1) {
            free(m->own.p);
            l->n--;
            return 0;
        }
        return th_one_part(m, m->own.p, m->own.n);
    }

    if (r == TH_ASSISTANT && cJSON_IsString(reason) && reason->valuestring[0])
    {
        if ((m = th_push(l, r, "analysis")) == NULL
            || th_one_part(m, reason->valuestring,
                           strlen(reason->valuestring)) != 0)
        {
            return -1;
        }
    }
    if ((m = th_push(l, r, r == TH_ASSISTANT ? "final" : NULL)) == NULL) {
        return -1;
    }
    if (cJSON_IsArray(content) && content->child != NULL) {
        m->nparts = (size_t) cJSON_GetArraySize(content);
        m->parts = calloc(m->nparts, sizeof(th_span_t));
        if (m->parts == NULL) {
            return -1;
        }
        k = 0;
        cJSON_ArrayForEach(p, content) {
            m->parts[k].s = cJSON_GetObjectItemCaseSensitive(p, "text")
                            ->valuestring;
            m->parts[k].n = strlen(m->parts[k].s);
            k++;
        }
    } else if (th_one_part(m, cJSON_IsString(content) ? content->valuestring
                                                      : "",
                           cJSON_IsString(content)
                           ? strlen(content->valuestring) : 0) != 0)
    {
        return -1;
    }
    if (r == TH_ASSISTANT && m->parts[0].n == 0) {
        /* only assistant messages with text are kept */
        free(m->parts);
        l->n--;
    }
    return 0;
}


static int
th_is(const th_msg_t *m, const char *channel)
{
    return m->channel != NULL && strcmp(m->channel, channel) == 0;
}


/* harmony's render_conversation_into, auto_drop_analysis on: the analysis
 * before the first final when the last assistant message is final */
static void
th_drop_harmony(const th_list_t *l, unsigned char *keep)
{
    size_t   i;
    long     last_asst = -1, first_final = -1;

    for (i = 0; i < l->n; i++) {
        if (!keep[i]) {
            continue;
        }
        if (l->m[i].role == TH_ASSISTANT) {
            last_asst = (long) i;
        }
        if (first_final < 0 && th_is(&l->m[i], "final")) {
            first_final = (long) i;
        }
    }
    if (last_asst < 0 || !th_is(&l->m[last_asst], "final")) {
        return;
    }
    for (i = 0; i < l->n && (long) i < first_final; i++) {
        if (th_is(&l->m[i], "analysis")) {
            keep[i] = 0;
        }
    }
}


/*
 * vLLM's auto_drop_analysis_messages, in its two published forms: every
 * analysis before the last final (chat_completion/harmony.py) or only
 * those of the current turn (parser/harmony_utils.py), each followed by
 * harmony's own drop.  A chat where the two end differently gets the
 * estimate.  keep[] (2 * l->n bytes) is the answer.
 */
static int
th_drop(th_ctx_t *x, const th_list_t *l, unsigned char *keep)
{
    unsigned char  *b = keep + l->n;
    size_t          i, turn = 0;
    long            last = -1, last_turn = -1;

    for (i = 0; i < l->n; i++) {
        if (l->m[i].role == TH_USER) {
            turn = i + 1;
        }
    }
    for (i = 0; i < l->n; i++) {
        if (l->m[i].role == TH_ASSISTANT && th_is(&l->m[i], "final")) {
            last = (long) i;
            if (i >= turn) {
                last_turn = (long) i;
            }
        }
    }
    for (i = 0; i < l->n; i++) {
        keep[i] = !((long) i < last && th_is(&l->m[i], "analysis"));
        b[i] = !(i >= turn && (long) i < last_turn
                 && th_is(&l->m[i], "analysis") && l->m[i].role != TH_USER);
    }
    th_drop_harmony(l, keep);
    th_drop_harmony(l, b);
    if (l->n && memcmp(keep, b, l->n) != 0) {
        tok_err(x->err, x->errlen, "harmony: reasoning of an earlier turn "
                "gets the estimate: vLLM versions keep or drop it");
        return TH_UNSUPPORTED;
    }
    return 0;
}


/* Render<Message> */
static void
th_render_msg(th_out_t *o, const th_msg_t *m)
{
    size_t  k;

    th_special(o, TOK_H_START);
    th_text_cs(o, m->role == TH_TOOL ? m->author : th_roles[m->role]);
    if (m->recipient && strcmp(m->recipient, "all") != 0) {
        {
            th_str_t  r;

            memset(&r, 0, sizeof(r));
            th_cs(&r, " to=");
            th_cs(&r, m->recipient);
            if (r.oom) {
                o->oom = 1;
            } else {
                th_text(o, r.p, r.n);
            }
            free(r.p);
        }
    }
    if (m->channel) {
        th_special(o, TOK_H_CHANNEL);
        th_text_cs(o, m->channel);
    }
    if (m->json) {
        th_text_cs(o, " json");
    }
    th_special(o, TOK_H_MESSAGE);
    for (k = 0; k < m->nparts; k++) {
        th_text(o, m->parts[k].s, m->parts[k].n);
    }
    th_special(o, m->role == TH_ASSISTANT && m->recipient ? TOK_H_CALL
                                                          : TOK_H_END);
}


static int
th_bool(th_ctx_t *x, const cJSON *req, const char *k, int dflt, int *v)
{
    const cJSON  *b = req ? cJSON_GetObjectItemCaseSensitive(req, k) : NULL;

    if (b == NULL || cJSON_IsNull(b)) {
        *v = dflt;
        return 0;
    }
    if (!cJSON_IsBool(b)) {
        tok_err(x->err, x->errlen, "%s: expected a boolean", k);
        return -1;
    }
    *v = cJSON_IsTrue(b);
    return 0;
}


int
tok_harmony_render(const dpd_tok_t *tok, const cJSON *in, int want_ids,
    char **text, size_t *textlen, uint32_t **ids, size_t *nids, long *count,
    char *err, size_t errlen)
{
    const cJSON    *req = NULL, *msgs = in, *eff, *tools, *choice, *m, *role;
    th_ctx_t        x = { err, errlen, NULL };
    th_list_t       l;
    th_out_t        o;
    th_str_t        sys, dev, instr, fn;
    unsigned char  *keep = NULL;
    const char     *effort = "medium";
    char            date[32];
    struct tm       tm;
    time_t          now;
    size_t          i, bytes = 0, nodes = 0;
    int             rc = -1, agp, cfm, has_tools = 0, has_instr = 0;
    th_budget_t     budget;

    if (errlen) {
        err[0] = '\0';
    }
    th_size(in, &bytes, &nodes);
    memset(&budget, 0, sizeof(budget));
    budget.max_bytes = 8 * bytes + (1 << 20);
    budget.max_steps = 4 * nodes + 65536;
    th_budget = &budget;
    memset(&l, 0, sizeof(l));
    memset(&o, 0, sizeof(o));
    memset(&sys, 0, sizeof(sys));
    memset(&dev, 0, sizeof(dev));
    memset(&instr, 0, sizeof(instr));
    memset(&fn, 0, sizeof(fn));
    o.tok = tok;
    o.want_ids = want_ids;
    if (cJSON_IsObject(in)) {
        req = in;
        msgs = cJSON_GetObjectItemCaseSensitive(in, "messages");
    }
    if (!cJSON_IsArray(msgs) || msgs->child == NULL) {
        tok_err(err, errlen, cJSON_IsArray(msgs) ? "messages: empty array"
                                                 : "messages: expected an "
                                                   "array");
        rc = -1;
        goto done;
    }

    /* the request fields vLLM's harmony path reads */
    if (th_bool(&x, req, "add_generation_prompt", 1, &agp) != 0
        || th_bool(&x, req, "continue_final_message", 0, &cfm) != 0)
    {
        rc = -1;
        goto done;
    }
    if (agp && cfm) {
        tok_err(err, errlen, "Cannot set both `continue_final_message` and "
                "`add_generation_prompt` to True.");
        rc = -1;
        goto done;
    }
    eff = req ? cJSON_GetObjectItemCaseSensitive(req, "reasoning_effort")
              : NULL;
    if (eff != NULL && !cJSON_IsNull(eff)) {
        if (!cJSON_IsString(eff)
            || (strcmp(eff->valuestring, "low") != 0
                && strcmp(eff->valuestring, "medium") != 0
                && strcmp(eff->valuestring, "high") != 0))
        {
            tok_err(err, errlen, "reasoning_effort: harmony supports low, "
                    "medium or high");
            rc = -1;
            goto done;
        }
        effort = eff->valuestring;
    }
    tools = req ? cJSON_GetObjectItemCaseSensitive(req, "tools") : NULL;
    if (tools != NULL && !cJSON_IsNull(tools)) {
        if (!cJSON_IsArray(tools)) {
            tok_err(err, errlen, "tools: expected an array");
            rc = -1;
            goto done;
        }
        choice = cJSON_GetObjectItemCaseSensitive(req, "tool_choice");
        if (tools->child != NULL && cJSON_IsString(choice)
            && strcmp(choice->valuestring, "none") == 0)
        {
            /* vLLM's --exclude-tools-when-tool-choice-none decides */
            tok_err(err, errlen, "harmony: tools with tool_choice \"none\" "
                    "get the estimate");
            rc = 1;
            goto done;
        }
        /* an empty array renders as none: build_harmony_preamble's
         * `if developer_instructions or tools` and get_developer_message's
         * `if function_tools` both skip it */
        has_tools = (tools->child != NULL);
    }

    /* extract_instructions_from_messages: a leading system or developer
     * message is taken out; its flattened text is the instructions */
    m = msgs->child;
    role = cJSON_IsObject(m) ? cJSON_GetObjectItemCaseSensitive(m, "role")
                             : NULL;
    if (cJSON_IsString(role)
        && (strcmp(role->valuestring, "system") == 0
            || strcmp(role->valuestring, "developer") == 0))
    {
        x.lead = m;
        m = cJSON_GetObjectItemCaseSensitive(m, "content");
        if ((rc = th_check_content(&x, m, 0)) != 0) {
            goto done;
        }
        rc = th_instr(&instr, m);
        if (rc < 0) {
            tok_err(err, errlen, "out of memory");
            goto done;
        }
        has_instr = (rc == 0);
    }

    i = 0;
    cJSON_ArrayForEach(m, msgs) {
        if (m == x.lead) {
            i++;
            continue;
        }
        if ((rc = th_message(&x, &l, msgs, m, i++)) != 0) {
            goto done;
        }
    }
    rc = -1;
    if ((keep = malloc(2 * l.n + 1)) == NULL) {
        tok_err(err, errlen, "out of memory");
        goto done;
    }
    if ((rc = th_drop(&x, &l, keep)) != 0) {
        goto done;
    }
    rc = -1;

    /* build_harmony_preamble: the developer message only with instructions
     * (a non-empty text) or tools; Render<DeveloperContent>: "# Instructions"
     * and the text (an empty text too, once there), then the tools, all
     * joined "\n\n" */
    if (has_tools) {
        rc = th_tools(&x, &fn, tools);
        if (rc != 0) {
            goto done;
        }
        rc = -1;
    }
    if (has_instr) {
        th_cs(&dev, "# Instructions\n\n");
        th_add(&dev, instr.p ? instr.p : "", instr.n);
        if (has_tools) {
            th_cs(&dev, "\n\n");
        }
    }
    if (has_tools) {
        th_add(&dev, fn.p ? fn.p : "", fn.n);
    }

    /* Render<SystemContent>: SystemContent::new() as vLLM's
     * get_system_message sets it (all three channels: current vLLM no
     * longer drops "commentary" without tools); the "Calls to these tools"
     * line when a developer message has functions (RenderOptions
     * conversation_has_function_tools) */
    now = time(NULL);
    gmtime_r(&now, &tm);
    strftime(date, sizeof(date), "%Y-%m-%d", &tm);
    th_cs(&sys, "You are ChatGPT, a large language model trained by "
          "OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: ");
    th_cs(&sys, date);
    th_cs(&sys, "\n\nReasoning: ");
    th_cs(&sys, effort);
    th_cs(&sys, "\n\n# Valid channels: analysis, commentary, final. Channel "
          "must be included for every message.");
    if (has_tools) {
        th_cs(&sys, "\nCalls to these tools must go to the commentary "
              "channel: 'functions'.");
    }
    if (sys.oom || dev.oom || instr.oom || fn.oom) {
        tok_err(err, errlen, "out of memory");
        goto done;
    }

    th_special(&o, TOK_H_START);
    th_text_cs(&o, "system");
    th_special(&o, TOK_H_MESSAGE);
    th_text(&o, sys.p, sys.n);
    th_special(&o, TOK_H_END);
    if ((has_instr && instr.n > 0) || has_tools) {
        th_special(&o, TOK_H_START);
        th_text_cs(&o, "developer");
        th_special(&o, TOK_H_MESSAGE);
        th_text(&o, dev.p, dev.n);
        th_special(&o, TOK_H_END);
    }
    for (i = 0; i < l.n; i++) {
        if (keep[i]) {
            th_render_msg(&o, &l.m[i]);
        }
    }
    /* render_conversation_for_completion(.., Role.ASSISTANT) */
    th_special(&o, TOK_H_START);
    th_text_cs(&o, "assistant");
    if (o.oom || o.text.oom) {
        tok_err(err, errlen, "out of memory or tokenizer failure");
        goto done;
    }
    rc = 0;

done:
    th_budget = NULL;
    if (budget.over) {
        tok_err(err, errlen, "harmony: rendering the request would take "
                "more than %zu bytes or %zu steps (8 times its text + 1 MiB, "
                "4 per value + 64k): it gets the estimate", budget.max_bytes,
                budget.max_steps);
        rc = 1;
    }
    if (rc < 0 && errlen && err[0] == '\0') {
        tok_err(err, errlen, "out of memory");
    }
    if (rc == 0) {
        if (text) {
            *text = o.text.p ? o.text.p : strdup("");
            *textlen = o.text.n;
            o.text.p = NULL;
            if (*text == NULL) {
                rc = -1;
            }
        }
        if (ids) {
            *ids = o.ids;
            *nids = o.nids;
            o.ids = NULL;
        }
        if (count) {
            *count = o.count;
        }
    }
    free(o.text.p);
    free(o.ids);
    free(sys.p);
    free(dev.p);
    free(instr.p);
    free(fn.p);
    free(keep);
    th_list_free(&l);
    return rc;
}


int
dpd_chat_harmony_json(const dpd_tok_t *tok, const struct cJSON *request,
    char **text, size_t *textlen, uint32_t **ids, size_t *nids, long *count,
    char *err, size_t errlen)
{
    if (text) {
        *text = NULL;
        *textlen = 0;
    }
    if (ids) {
        *ids = NULL;
        *nids = 0;
    }
    if (!dpd_tok_chat_harmony(tok)) {
        tok_err(err, errlen, "not a harmony (gpt-oss) tokenizer");
        return -1;
    }
    return tok_harmony_render(tok, request, ids != NULL, text, textlen, ids,
                              nids, count, err, errlen);
}
