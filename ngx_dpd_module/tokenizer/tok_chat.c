/*
 * Chat requests to prompt text as vLLM renders them: the model's own Jinja
 * chat template (tok_jinja*.c), compiled once when the tokenizer loads,
 * rendered with the variables vLLM's OpenAI server passes to
 * transformers' apply_chat_template:
 *
 *   messages     prepared as vllm/renderers/chat_utils does: content
 *                a string (text parts joined with "\n"; null -> "") or,
 *                when the template loops over message content (vLLM's
 *                "openai" content format), a list of {"type": "text",
 *                "text": ...} and {"type": "tool_reference", "name"};
 *                assistant tool calls with
 *                function.arguments parsed from their JSON string ("" or
 *                invalid -> {}), an empty tool_calls list dropped;
 *                "reasoning" as reasoning and reasoning_content; name,
 *                tool_call_id, task; developer messages' tools;
 *   tools        each as pydantic's model_dump() of vLLM's tool param:
 *                {"type", "function": {"name", "description",
 *                "parameters", ...}, ...}, or none;
 *   documents    the request's, or none;
 *   add_generation_prompt (default true), continue_final_message (false);
 *   the special tokens of tokenizer_config.json (bos_token, eos_token,
 *   unk_token, sep_token, pad_token, cls_token, mask_token,
 *   additional_special_tokens), then chat_template_kwargs over all of it.
 *
 * continue_final_message cuts the prompt after the last message's text as
 * transformers does.  A template that raises (raise_exception, an
 * undefined attribute, a type error) fails the request: vLLM answers 400.
 * Image, audio and other non-text parts are not counted (the caller is
 * told: rc 2).  With no template at all, the documented estimate.
 */

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <cjson/cJSON.h>

#include "tok_internal.h"
#include "tok_jinja.h"
#include "tok_cjson.h"


#define TOK_CHAT_MAX_FILES  16

/* transformers' continue_final_message marker (a space follows it) */
#define TOK_CFM_TAG  "CONTINUE_FINAL_MESSAGE_TAG"


/* cJSON's tests and lookups inline (tok_cjson.h) */
#define tok_is(j, t)     tok_json_is(j, t)
#define tok_is_null(j)   tok_is(j, cJSON_NULL)
#define tok_is_string(j) tok_is(j, cJSON_String)
#define tok_is_array(j)  tok_is(j, cJSON_Array)
#define tok_is_object(j) tok_is(j, cJSON_Object)
#define tok_is_bool(j)                                                        \
    ((j) != NULL && ((j)->type & (cJSON_True | cJSON_False)) != 0)
#define tok_is_true(j)   tok_is(j, cJSON_True)
#define tok_get(obj, name)  tok_json_get(obj, name)

struct tok_chat_s {
    tj_template_t      *model;          /* chat_template / "default" */
    tj_template_t      *tool_use;       /* named "tool_use", or NULL */
    tj_template_t      *files[TOK_CHAT_MAX_FILES];
    unsigned            nfiles;
    tj_arena_t          arena;          /* the special token values */
    tj_dict_t          *specials;
};


/* ---- loading (tokenizer_config.json, chat_template.jinja) */

static char *
tok_chat_read(const char *path, size_t *len)
{
    FILE   *f = fopen(path, "rb");
    char   *buf;
    long    n;

    if (f == NULL) {
        return NULL;
    }
    if (fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0
        || n > 16 * 1024 * 1024 || fseek(f, 0, SEEK_SET) != 0)
    {
        fclose(f);
        return NULL;
    }
    buf = malloc((size_t) n + 1);
    if (buf == NULL || fread(buf, 1, (size_t) n, f) != (size_t) n) {
        free(buf);
        fclose(f);
        return NULL;
    }
    fclose(f);
    buf[n] = '\0';
    *len = (size_t) n;
    return buf;
}


static tj_template_t *
tok_chat_compile(const char *src, size_t len, const char *what, char *err,
    size_t errlen)
{
    tj_template_t  *t;
    char            e[400];

    if (memchr(src, '\0', len) != NULL) {
        tok_err(err, errlen, "%s%sthe chat template holds a NUL byte",
                what ? what : "", what ? ": " : "");
        return NULL;
    }
    t = tj_compile(src, len, e, sizeof(e));
    if (t == NULL) {
        if (what) {
            tok_err(err, errlen, "%s: %s", what, e);
        } else {
            tok_err(err, errlen, "%s", e);
        }
    }
    return t;
}


/* "x" or {"content": "x"} */
static const char *
tok_chat_token_str(const cJSON *v)
{
    if (cJSON_IsObject(v)) {
        v = cJSON_GetObjectItemCaseSensitive(v, "content");
    }
    return cJSON_IsString(v) ? v->valuestring : NULL;
}


static int
tok_chat_specials(struct tok_chat_s *ch, const cJSON *root)
{
    static const char *const names[] = { "bos_token", "eos_token",
        "unk_token", "sep_token", "pad_token", "cls_token", "mask_token" };
    const cJSON  *v, *e;
    const char   *s;
    tj_val_t      lv;
    size_t        i, n;
    char         *copy;

    ch->specials = tj_a_dict(&ch->arena);
    if (ch->specials == NULL) {
        return -1;
    }
    for (i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        v = cJSON_GetObjectItemCaseSensitive(root, names[i]);
        if ((s = tok_chat_token_str(v)) == NULL || *s == '\0') {
            continue;
        }
        n = strlen(s);
        copy = tj_arena_alloc(&ch->arena, n + 1);
        if (copy == NULL) {
            return -1;
        }
        memcpy(copy, s, n + 1);
        if (tj_a_dict_set(&ch->arena, ch->specials, names[i],
                          strlen(names[i]), tj_str(copy, n)) != 0)
        {
            return -1;
        }
    }
    v = cJSON_GetObjectItemCaseSensitive(root, "additional_special_tokens");
    if (cJSON_IsArray(v) && cJSON_GetArraySize(v) > 0) {
        lv.t = TJ_LIST;
        lv.u.l = tj_a_list(&ch->arena);
        if (lv.u.l == NULL) {
            return -1;
        }
        cJSON_ArrayForEach(e, v) {
            if ((s = tok_chat_token_str(e)) == NULL) {
                continue;
            }
            n = strlen(s);
            copy = tj_arena_alloc(&ch->arena, n + 1);
            if (copy == NULL || tj_a_list_push(&ch->arena, lv.u.l,
                                               tj_str(copy, n)) != 0)
            {
                return -1;
            }
            memcpy(copy, s, n + 1);
        }
        if (tj_a_dict_set(&ch->arena, ch->specials,
                          "additional_special_tokens", 25, lv) != 0)
        {
            return -1;
        }
    }
    return 0;
}


void
tok_chat_free(struct tok_chat_s *ch)
{
    unsigned  i;

    if (ch == NULL) {
        return;
    }
    tj_template_free(ch->model);
    tj_template_free(ch->tool_use);
    for (i = 0; i < ch->nfiles; i++) {
        tj_template_free(ch->files[i]);
    }
    tj_arena_free(&ch->arena);
    free(ch);
}


/*
 * From tokenizer_config.json (root, at path): the special tokens and the
 * template: "chat_template" a string, or a list of {"name", "template"}
 * ("default", else the only one; "tool_use" when the request has tools);
 * a chat_template.jinja file in the same directory wins, as transformers
 * loads it.  No template at all is not an error (estimates).
 */
int
tok_chat_load(dpd_tok_t *tok, const cJSON *root, const char *path,
    char *err, size_t errlen)
{
    struct tok_chat_s  *ch;
    const cJSON        *v, *e, *name, *t, *def = NULL, *tool = NULL;
    char               *jpath, *src;
    const char         *slash;
    size_t              dl, len;
    int                 count = 0;

    ch = calloc(1, sizeof(*ch));
    if (ch == NULL) {
        tok_err(err, errlen, "out of memory");
        return -1;
    }
    tok->chat = ch;
    if (tok_chat_specials(ch, root) != 0) {
        tok_err(err, errlen, "out of memory");
        return -1;
    }

    /* chat_template.jinja beside tokenizer_config.json */
    slash = strrchr(path, '/');
    dl = slash ? (size_t) (slash - path) + 1 : 0;
    jpath = malloc(dl + sizeof("chat_template.jinja"));
    if (jpath == NULL) {
        tok_err(err, errlen, "out of memory");
        return -1;
    }
    memcpy(jpath, path, dl);
    memcpy(jpath + dl, "chat_template.jinja", sizeof("chat_template.jinja"));
    src = tok_chat_read(jpath, &len);
    if (src != NULL) {
        ch->model = tok_chat_compile(src, len, jpath, err, errlen);
        free(src);
        free(jpath);
        return ch->model ? 0 : -1;
    }
    free(jpath);

    v = cJSON_GetObjectItemCaseSensitive(root, "chat_template");
    if (v == NULL || cJSON_IsNull(v)) {
        return 0;
    }
    if (cJSON_IsString(v)) {
        ch->model = tok_chat_compile(v->valuestring, strlen(v->valuestring),
                                     "chat_template", err, errlen);
        return ch->model ? 0 : -1;
    }
    if (!cJSON_IsArray(v)) {
        tok_err(err, errlen, "chat_template: expected a string or a list of "
                "{\"name\", \"template\"}");
        return -1;
    }
    cJSON_ArrayForEach(e, v) {
        name = cJSON_GetObjectItemCaseSensitive(e, "name");
        t = cJSON_GetObjectItemCaseSensitive(e, "template");
        if (!cJSON_IsString(name) || !cJSON_IsString(t)) {
            tok_err(err, errlen, "chat_template[%d]: expected {\"name\": "
                    "string, \"template\": string}", count);
            return -1;
        }
        if (strcmp(name->valuestring, "default") == 0) {
            def = t;
        } else if (strcmp(name->valuestring, "tool_use") == 0) {
            tool = t;
        }
        count++;
    }
    if (def == NULL && count == 1) {
        def = cJSON_GetObjectItemCaseSensitive(v->child, "template");
    }
    if (def) {
        ch->model = tok_chat_compile(def->valuestring,
                                     strlen(def->valuestring),
                                     "chat_template (default)", err, errlen);
        if (ch->model == NULL) {
            return -1;
        }
    }
    if (tool) {
        ch->tool_use = tok_chat_compile(tool->valuestring,
                                        strlen(tool->valuestring),
                                        "chat_template (tool_use)", err,
                                        errlen);
        if (ch->tool_use == NULL) {
            return -1;
        }
    }
    return 0;
}


int
dpd_tok_chat_template_add(dpd_tok_t *tok, const char *src, size_t len,
    char *err, size_t errlen)
{
    struct tok_chat_s  *ch;
    tj_template_t      *t;

    if (tok->chat == NULL) {
        tok->chat = calloc(1, sizeof(*tok->chat));
        if (tok->chat == NULL) {
            tok_err(err, errlen, "out of memory");
            return -1;
        }
    }
    ch = tok->chat;
    if (ch->nfiles == TOK_CHAT_MAX_FILES) {
        tok_err(err, errlen, "more than %d chat template files",
                TOK_CHAT_MAX_FILES);
        return -1;
    }
    t = tok_chat_compile(src, len, NULL, err, errlen);
    if (t == NULL) {
        return -1;
    }
    ch->files[ch->nfiles] = t;
    return DPD_CHAT_FILE + (int) ch->nfiles++;
}


int
dpd_tok_chat_template_file(dpd_tok_t *tok, const char *path, char *err,
    size_t errlen)
{
    char    *src, e[400];
    size_t   len;
    int      rc;

    src = tok_chat_read(path, &len);
    if (src == NULL) {
        tok_err(err, errlen, "%s: cannot read the chat template file", path);
        return -1;
    }
    rc = dpd_tok_chat_template_add(tok, src, len, e, sizeof(e));
    free(src);
    if (rc < 0) {
        tok_err(err, errlen, "%s: %s", path, e);
    }
    return rc;
}


dpd_chat_template_t
dpd_tok_chat_template(const dpd_tok_t *tok)
{
    return tok && ((tok->chat && tok->chat->model) || tok->harmony)
           ? DPD_CHAT_MODEL : DPD_CHAT_NONE;
}


int
dpd_chat_template_from_name(const char *name)
{
    static const struct {
        const char           *name;
        dpd_chat_template_t   t;
    } names[] = {
        { "auto", DPD_CHAT_AUTO },
        { "none", DPD_CHAT_NONE },
        { "model", DPD_CHAT_MODEL },
        /* the families once written out in C: the model's own template */
        { "llama3", DPD_CHAT_AUTO },
        { "llama3.1", DPD_CHAT_AUTO },
        { "chatml", DPD_CHAT_AUTO },
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
    case DPD_CHAT_NONE:
        return "none";
    case DPD_CHAT_MODEL:
        return "model";
    default:
        return (int) t >= DPD_CHAT_FILE ? "file" : "unknown";
    }
}


/* tmpl is the model's own (gpt-oss: harmony) */
static int
tok_chat_auto(dpd_chat_template_t tmpl)
{
    return tmpl == DPD_CHAT_AUTO || tmpl == DPD_CHAT_MODEL
           || tmpl == DPD_CHAT_LLAMA3 || tmpl == DPD_CHAT_LLAMA31
           || tmpl == DPD_CHAT_CHATML;
}


/* the compiled template for tmpl, NULL: none (estimate) */
static const tj_template_t *
tok_chat_pick(const dpd_tok_t *tok, dpd_chat_template_t tmpl, int tools)
{
    const struct tok_chat_s  *ch = tok->chat;

    if (ch == NULL) {
        return NULL;
    }
    if ((int) tmpl >= DPD_CHAT_FILE) {
        unsigned k = (unsigned) tmpl - DPD_CHAT_FILE;
        return k < ch->nfiles ? ch->files[k] : NULL;
    }
    if (tmpl == DPD_CHAT_AUTO || tmpl == DPD_CHAT_MODEL
        || tmpl == DPD_CHAT_LLAMA3 || tmpl == DPD_CHAT_LLAMA31
        || tmpl == DPD_CHAT_CHATML)
    {
        return tools && ch->tool_use ? ch->tool_use : ch->model;
    }
    return NULL;
}


/* ---- the request, prepared as vLLM does */

typedef struct {
    tj_arena_t      a;
    char           *err;
    size_t          errlen;
    size_t          bytes;          /* text bytes seen: sizes the limits */
    int             long_str;       /* a string of TJ_STR_MAX bytes or more */
    int             skipped;        /* non-text parts not counted */
    char            note[200];
} tok_prep_t;


static int
tok_prep_oom(tok_prep_t *p)
{
    tok_err(p->err, p->errlen, "out of memory");
    return -1;
}


/* a request string (too long ones are refused after the preparation) */
static tj_val_t
tok_cstr(tok_prep_t *p, const char *s)
{
    size_t  n = strlen(s);

    if (n >= TJ_STR_MAX) {
        p->long_str = 1;
        n = 0;
    }
    return tj_str(s, n);
}


static int
tok_prep_val(tok_prep_t *p, const cJSON *j, tj_val_t *v)
{
    if (tj_from_cjson(&p->a, j, v, 0) != 0) {
        tok_err(p->err, p->errlen, "out of memory or JSON nested too deep");
        return -1;
    }
    return 0;
}


static int
tok_set_n(tok_prep_t *p, tj_dict_t *d, const char *k, size_t n, tj_val_t v)
{
    if (tj_a_dict_set(&p->a, d, tj_intern(k, n), n, v) != 0) {
        return tok_prep_oom(p);
    }
    return 0;
}


static int
tok_set(tok_prep_t *p, tj_dict_t *d, const char *k, tj_val_t v)
{
    return tok_set_n(p, d, k, strlen(k), v);
}

/* k: tj_intern()'s own pointer already */
static int
tok_set_k(tok_prep_t *p, tj_dict_t *d, const char *k, size_t n, tj_val_t v)
{
    if (tj_a_dict_set(&p->a, d, k, n, v) != 0) {
        return tok_prep_oom(p);
    }
    return 0;
}



/* what one content part gives the template */
#define TOK_PART_SKIP  0    /* nothing: skipped, or a non-text part */
#define TOK_PART_TEXT  1    /* a text (*text) */
#define TOK_PART_NONE  2    /* a text part whose text is None */
#define TOK_PART_REF   3    /* a tool_reference; *ref its name (or NULL) */


/* the keys by which vLLM takes a part without a type (or with a uuid) for
 * a media one, in its order; then "tool_reference" */
static const char *const tok_media_keys[] = {
    "image_url", "image_pil", "image_embeds", "audio_embeds", "video_embeds",
    "prompt_embeds", "audio_url", "input_audio", "video_url", NULL
};

/* the media types of vLLM's MM_PARSER_MAP */
static const char *const tok_media_types[] = {
    "image_url", "input_image", "image_embeds", "audio_embeds",
    "video_embeds", "prompt_embeds", "image_pil", "audio_url", "input_audio",
    "video_url", NULL
};


static int
tok_in(const char *s, const char *const *set)
{
    for ( ; *set; set++) {
        if (strcmp(s, *set) == 0) {
            return 1;
        }
    }
    return 0;
}


/*
 * One content part as vLLM's _parse_chat_message_content_part and
 * _parse_chat_message_content_mm_part (renderers/chat_utils, be90fe165bb8)
 * parse it: by its type, unless it has none or carries a uuid (then by the
 * media key it holds, or "tool_reference", else "Missing 'type'"); text
 * and refusal parts without their field are skipped, the other text types
 * keep None.
 */
static int
tok_part_text(tok_prep_t *p, const cJSON *part, size_t i, size_t j,
    int *kind, const char **text, const cJSON **ref)
{
    const cJSON         *type, *uuid, *t;
    const char          *ty, *field;
    const char *const   *k;

    *kind = TOK_PART_SKIP;
    *text = NULL;
    *ref = NULL;
    if (cJSON_IsString(part)) {
        *kind = TOK_PART_TEXT;
        *text = part->valuestring;
        return 0;
    }
    if (!cJSON_IsObject(part)) {
        tok_err(p->err, p->errlen, "messages[%zu].content[%zu]: expected a "
                "string or an object", i, j);
        return -1;
    }
    type = cJSON_GetObjectItemCaseSensitive(part, "type");
    uuid = cJSON_GetObjectItemCaseSensitive(part, "uuid");
    if (type == NULL || cJSON_IsNull(type)
        || (uuid != NULL && !cJSON_IsNull(uuid)))
    {
        for (k = tok_media_keys; *k; k++) {
            if (cJSON_GetObjectItemCaseSensitive(part, *k)) {
                goto media;
            }
        }
        if (cJSON_GetObjectItemCaseSensitive(part, "tool_reference") == NULL) {
            tok_err(p->err, p->errlen, "messages[%zu].content[%zu]: Missing "
                    "'type' field in multimodal part.", i, j);
            return -1;
        }
        ty = "tool_reference";
    } else if (!cJSON_IsString(type)) {
        tok_err(p->err, p->errlen, "messages[%zu].content[%zu]: Invalid "
                "'type' field in multimodal part.", i, j);
        return -1;
    } else {
        ty = type->valuestring;
    }
    if (strcmp(ty, "tool_reference") == 0) {
        /* a deferred tool's name, for the template to expand */
        t = cJSON_GetObjectItemCaseSensitive(part, "name");
        *kind = TOK_PART_REF;
        *ref = (t == NULL || cJSON_IsNull(t)) ? NULL : t;
        return 0;
    }
    if (strcmp(ty, "text") == 0 || strcmp(ty, "input_text") == 0
        || strcmp(ty, "output_text") == 0)
    {
        field = "text";
    } else if (strcmp(ty, "refusal") == 0) {
        field = "refusal";
    } else if (strcmp(ty, "thinking") == 0) {
        field = "thinking";
    } else if (tok_in(ty, tok_media_types)) {
        goto media;
    } else {
        tok_err(p->err, p->errlen, "messages[%zu].content[%zu]: Unsupported "
                "chat content part type: '%.40s'", i, j, ty);
        return -1;
    }
    t = cJSON_GetObjectItemCaseSensitive(part, field);
    if (t == NULL || cJSON_IsNull(t)) {
        if (strcmp(ty, "text") != 0 && strcmp(ty, "refusal") != 0) {
            *kind = TOK_PART_NONE;
        }
        return 0;
    }
    if (!cJSON_IsString(t)) {
        tok_err(p->err, p->errlen, "messages[%zu].content[%zu].%s: expected "
                "a string", i, j, field);
        return -1;
    }
    *kind = TOK_PART_TEXT;
    *text = t->valuestring;
    return 0;

media:
    if (!p->skipped) {
        snprintf(p->note, sizeof(p->note), "messages[%zu].content[%zu]: "
                 "a non-text part is not counted", i, j);
    }
    p->skipped++;
    return 0;
}


/* one {"type": TYPE, KEY: v} item of an openai-format content list */
static int
tok_push_part(tok_prep_t *p, tj_list_t *l, const char *type, size_t tn,
    const char *key, size_t kn, tj_val_t v)
{
    tj_dict_t  *d;
    tj_val_t    item;

    if ((d = tj_a_dict(&p->a)) == NULL
        || tok_set_k(p, d, tj_k_type, 4, tj_str(type, tn)) != 0
        || tok_set_k(p, d, key, kn, v) != 0)
    {
        return tok_prep_oom(p);
    }
    item.t = TJ_DICT;
    item.u.d = d;
    item.n = 0;
    if (tj_a_list_push(&p->a, l, item) != 0) {
        return tok_prep_oom(p);
    }
    return 0;
}


/*
 * vLLM's _strip_claude_code_billing_header() for one system text part (a
 * string part or a {"type": "text"} one): Claude Code's attribution line
 * changes on every request, so vLLM drops it, up to its newline, and the
 * part when nothing follows.  NULL: the part is dropped.
 */
static const char *
tok_billing_strip(const cJSON *part, const char *text)
{
    static const char   hdr[] = "x-anthropic-billing-header";
    const cJSON        *type;
    const char         *nl;

    if (part != NULL && !cJSON_IsString(part)) {
        type = cJSON_GetObjectItemCaseSensitive(part, "type");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "text") != 0) {
            return text;
        }
    }
    if (strncmp(text, hdr, sizeof(hdr) - 1) != 0) {
        return text;
    }
    nl = strchr(text, '\n');
    return (nl == NULL || nl[1] == '\0') ? NULL : nl + 1;
}


/*
 * vLLM's _parse_chat_message_content_parts: the string format joins the
 * parts' texts with "\n", leaving out falsy ones (a falsy parse result is
 * not appended: "", None); the openai format keeps each as
 * {"type": "text"}, empty and None ones too, and a tool_reference as
 * {"type": "tool_reference", "name"}.  A tool message's openai list is
 * joined back with "\n", empty texts included, unless it holds a
 * tool_reference (then the template gets the list).
 */
static int
tok_prep_content(tok_prep_t *p, const cJSON *c, size_t i, int openai,
    int tool_role, int system, tj_val_t *out)
{
    const cJSON  *part, *ref;
    const char   *text;
    tj_buf_t      b = { 0 };
    tj_val_t      l = { 0 }, v;
    size_t        j = 0, texts = 0, refs = 0, nones = 0;
    int           kind;

    b.a = &p->a;
    if (openai) {
        l.t = TJ_LIST;
        if ((l.u.l = tj_a_list(&p->a)) == NULL) {
            return tok_prep_oom(p);
        }
    }
    if (c == NULL || tok_is_null(c)) {
        *out = openai && !tool_role ? l : tj_str("", 0);
        return 0;
    }
    if (tok_is_string(c)) {
        text = c->valuestring;
        if (system && (text = tok_billing_strip(NULL, text)) == NULL) {
            *out = openai && !tool_role ? l : tj_str("", 0);
            return 0;
        }
        p->bytes += strlen(text);
        if (!openai || tool_role) {
            *out = tok_cstr(p, text);
            return 0;
        }
        if (tok_push_part(p, l.u.l, "text", 4, tj_k_text, 4,
                          tok_cstr(p, text)) != 0)
        {
            return -1;
        }
        *out = l;
        return 0;
    }
    if (!cJSON_IsArray(c)) {
        tok_err(p->err, p->errlen, "messages[%zu].content: expected a string "
                "or an array of content parts", i);
        return -1;
    }
    cJSON_ArrayForEach(part, c) {
        if (tok_part_text(p, part, i, j++, &kind, &text, &ref) != 0) {
            return -1;
        }
        switch (kind) {

        case TOK_PART_TEXT:
            if (system && (text = tok_billing_strip(part, text)) == NULL) {
                continue;
            }
            if (!openai && text[0] == '\0') {
                continue;
            }
            p->bytes += strlen(text);
            if (openai && tok_push_part(p, l.u.l, "text", 4, tj_k_text, 4,
                                        tok_cstr(p, text)) != 0)
            {
                return -1;
            }
            break;

        case TOK_PART_NONE:
            if (!openai) {
                continue;       /* None is falsy: not appended */
            }
            nones++;
            if (tok_push_part(p, l.u.l, "text", 4, tj_k_text, 4, tj_none())
                != 0)
            {
                return -1;
            }
            continue;

        case TOK_PART_REF:
            if (openai) {
                refs++;
                v = tj_none();
                if (ref && tok_prep_val(p, ref, &v) != 0) {
                    return -1;
                }
                if (tok_push_part(p, l.u.l, "tool_reference", 14, tj_k_name,
                                  4, v) != 0)
                {
                    return -1;
                }
                continue;
            }
            /* the string format joins the name as a text (a falsy one is
             * not appended; anything else but a string fails the join) */
            if (ref == NULL || cJSON_IsFalse(ref)
                || (cJSON_IsNumber(ref) && ref->valuedouble == 0)
                || ((cJSON_IsArray(ref) || cJSON_IsObject(ref))
                    && ref->child == NULL))
            {
                continue;
            }
            if (!cJSON_IsString(ref)) {
                tok_err(p->err, p->errlen, "messages[%zu].content[%zu].name: "
                        "expected a string", i, j - 1);
                return -1;
            }
            text = ref->valuestring;
            if (text[0] == '\0') {
                continue;
            }
            p->bytes += strlen(text);
            break;

        default:
            continue;
        }
        if ((!openai || tool_role)
            && ((texts++ && tj_buf_add(&b, "\n", 1) != 0)
                || tj_buf_add(&b, text, strlen(text)) != 0))
        {
            return tok_prep_oom(p);
        }
    }
    if (openai && (!tool_role || refs)) {
        *out = l;
        return 0;
    }
    if (nones) {
        /* vLLM joins the tool message's texts: None is no string */
        tok_err(p->err, p->errlen, "messages[%zu].content: a text part "
                "without text cannot be joined", i);
        return -1;
    }
    *out = b.p ? tj_str(b.p, b.len) : tj_str("", 0);
    return 0;
}


/*
 * vLLM's _postprocess_messages for one assistant tool call: an object of
 * type "function" (the default) with a function object, whose arguments
 * become an object: a JSON string parsed, and whatever is not then an
 * object (invalid or empty JSON, an array, a number, null, missing) {}
 */
static int
tok_prep_args(tok_prep_t *p, const cJSON *args, tj_val_t *v)
{
    if (cJSON_IsString(args)) {
        p->bytes += strlen(args->valuestring);
        if (tj_json_loads(&p->a, args->valuestring, strlen(args->valuestring),
                          v) == 0
            && v->t == TJ_DICT)
        {
            return 0;
        }
    } else if (cJSON_IsObject(args)) {
        return tok_prep_val(p, args, v);
    }
    v->t = TJ_DICT;
    v->n = 0;
    if ((v->u.d = tj_a_dict(&p->a)) == NULL) {
        return tok_prep_oom(p);
    }
    return 0;
}


static int
tok_prep_call(tok_prep_t *p, const cJSON *call, size_t i, size_t k,
    tj_val_t *out)
{
    const cJSON  *fn, *e, *args;
    tj_dict_t    *d, *fd;
    tj_val_t      v;

    if (!cJSON_IsObject(call)) {
        tok_err(p->err, p->errlen, "messages[%zu].tool_calls[%zu]: expected "
                "an object", i, k);
        return -1;
    }
    fn = cJSON_GetObjectItemCaseSensitive(call, "function");
    e = cJSON_GetObjectItemCaseSensitive(call, "type");
    if (!cJSON_IsObject(fn)
        || (e && !(cJSON_IsString(e) && strcmp(e->valuestring, "function")
                   == 0)))
    {
        tok_err(p->err, p->errlen, "messages[%zu].tool_calls[%zu]: chat "
                "completions only support assistant tool_calls of type "
                "'function'.", i, k);
        return -1;
    }
    if ((d = tj_a_dict(&p->a)) == NULL || (fd = tj_a_dict(&p->a)) == NULL) {
        return tok_prep_oom(p);
    }
    cJSON_ArrayForEach(e, call) {
        if (e == fn) {
            v.t = TJ_DICT;
            v.u.d = fd;
            v.n = 0;
        } else if (tok_prep_val(p, e, &v) != 0) {
            return -1;
        }
        if (tok_set(p, d, e->string, v) != 0) {
            return -1;
        }
    }
    args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
    cJSON_ArrayForEach(e, fn) {
        if (e != args) {
            if (tok_prep_val(p, e, &v) != 0) {
                return -1;
            }
        } else if (tok_prep_args(p, args, &v) != 0) {
            return -1;
        }
        if (tok_set(p, fd, e->string, v) != 0) {
            return -1;
        }
    }
    if (args == NULL
        && (tok_prep_args(p, NULL, &v) != 0
            || tok_set(p, fd, "arguments", v) != 0))
    {
        return -1;
    }
    out->t = TJ_DICT;
    out->u.d = d;
    out->n = 0;
    return 0;
}


static int
tok_prep_message(tok_prep_t *p, const cJSON *m, size_t i, int openai,
    tj_val_t *out)
{
    const cJSON  *role = NULL, *content = NULL, *calls = NULL, *e;
    const cJSON  *reasoning = NULL, *call_id = NULL, *name = NULL;
    const cJSON  *task = NULL, *tools = NULL, *reasoning_content = NULL;
    tj_dict_t    *d;
    tj_val_t      v, l;
    const char   *r, *k;
    size_t        n = 0;
    int           tool_role;

    if (!tok_is_object(m)) {
        tok_err(p->err, p->errlen, "messages[%zu]: expected an object", i);
        return -1;
    }
    /* one pass over the keys (the request parser refused repeated keys) */
    cJSON_ArrayForEach(e, m) {
        k = e->string;
        switch (k[0]) {
        case 'r':
            if (strcmp(k, "role") == 0) {
                role = e;
            } else if (strcmp(k, "reasoning") == 0) {
                reasoning = e;
            } else if (strcmp(k, "reasoning_content") == 0) {
                reasoning_content = e;
            }
            break;
        case 'c':
            if (strcmp(k, "content") == 0) {
                content = e;
            }
            break;
        case 't':
            if (strcmp(k, "tool_calls") == 0) {
                calls = e;
            } else if (strcmp(k, "tool_call_id") == 0) {
                call_id = e;
            } else if (strcmp(k, "task") == 0) {
                task = e;
            } else if (strcmp(k, "tools") == 0) {
                tools = e;
            }
            break;
        case 'n':
            if (strcmp(k, "name") == 0) {
                name = e;
            }
            break;
        }
    }
    if (!tok_is_string(role)) {
        tok_err(p->err, p->errlen, "messages[%zu].role: missing or not a "
                "string", i);
        return -1;
    }
    r = role->valuestring;
    tool_role = (r[0] == 't' && strcmp(r, "tool") == 0);
    /*
     * vLLM's ChatCompletionRequest._normalize_messages_before: the
     * deprecated "reasoning_content" stands for "reasoning" when that is
     * unset (and is gone otherwise)
     */
    if ((reasoning == NULL || tok_is_null(reasoning))
        && reasoning_content && !tok_is_null(reasoning_content))
    {
        reasoning = reasoning_content;
    }
    if ((d = tj_a_dict(&p->a)) == NULL) {
        return tok_prep_oom(p);
    }
    /* a fresh dict: role and content are added, not looked up first */
    if (tj_a_dict_add(&p->a, d, tj_k_role, 4, tok_cstr(p, r)) != 0) {
        return tok_prep_oom(p);
    }
    if (tok_prep_content(p, content, i, openai, tool_role,
                         r[0] == 's' && strcmp(r, "system") == 0, &v) != 0)
    {
        return -1;
    }
    if (tj_a_dict_add(&p->a, d, tj_k_content, 7, v) != 0) {
        return tok_prep_oom(p);
    }
    if (r[0] == 'a' && strcmp(r, "assistant") == 0) {
        if (calls && !tok_is_null(calls)) {
            if (!tok_is_array(calls)) {
                tok_err(p->err, p->errlen, "messages[%zu].tool_calls: "
                        "expected an array", i);
                return -1;
            }
            if (calls->child) {
                l.t = TJ_LIST;
                l.n = 0;
                if ((l.u.l = tj_a_list(&p->a)) == NULL) {
                    return tok_prep_oom(p);
                }
                cJSON_ArrayForEach(e, calls) {
                    if (tok_prep_call(p, e, i, n++, &v) != 0) {
                        return -1;
                    }
                    if (tj_a_list_push(&p->a, l.u.l, v) != 0) {
                        return tok_prep_oom(p);
                    }
                }
                if (tok_set_k(p, d, tj_k_tool_calls, 10, l) != 0) {
                    return -1;
                }
            }
        }
        if (reasoning && !tok_is_null(reasoning)) {
            if (tok_prep_val(p, reasoning, &v) != 0
                || tok_set_k(p, d, tj_k_reasoning, 9, v) != 0
                || tok_set_k(p, d, tj_k_reasoning_content, 17, v) != 0)
            {
                return -1;
            }
        }
    } else if (tool_role) {
        if (call_id) {
            if (tok_prep_val(p, call_id, &v) != 0
                || tok_set_k(p, d, tj_k_tool_call_id, 12, v) != 0)
            {
                return -1;
            }
        }
    }
    if (tok_is_string(name)
        && tok_set_k(p, d, tj_k_name, 4, tok_cstr(p, name->valuestring)) != 0)
    {
        return -1;
    }
    /* "task" is no interned name: tj_intern() would give it back */
    if (tok_is_string(task)
        && tok_set_k(p, d, "task", 4, tok_cstr(p, task->valuestring)) != 0)
    {
        return -1;
    }
    if (r[0] == 'd' && strcmp(r, "developer") == 0) {
        if (tok_prep_val(p, tools, &v) != 0
            || tok_set_k(p, d, tj_k_tools, 5, v) != 0)
        {
            return -1;
        }
    }
    out->t = TJ_DICT;
    out->u.d = d;
    out->n = 0;
    return 0;
}


/* pydantic's model_dump() of ChatCompletionToolsParam */
static int
tok_prep_tool(tok_prep_t *p, const cJSON *tool, size_t i, tj_val_t *out)
{
    static const char *const fixed[] = { "name", "description", "parameters" };
    const cJSON  *fn, *e, *type;
    tj_dict_t    *d, *fd;
    tj_val_t      v;
    size_t        k;

    fn = cJSON_GetObjectItemCaseSensitive(tool, "function");
    if (!cJSON_IsObject(tool) || !cJSON_IsObject(fn)
        || !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(fn, "name")))
    {
        tok_err(p->err, p->errlen, "tools[%zu]: expected {\"type\": "
                "\"function\", \"function\": {\"name\": ...}}", i);
        return -1;
    }
    type = cJSON_GetObjectItemCaseSensitive(tool, "type");
    if (type && !(cJSON_IsString(type)
                  && strcmp(type->valuestring, "function") == 0))
    {
        tok_err(p->err, p->errlen, "tools[%zu].type: expected \"function\"",
                i);
        return -1;
    }
    if ((d = tj_a_dict(&p->a)) == NULL || (fd = tj_a_dict(&p->a)) == NULL) {
        return tok_prep_oom(p);
    }
    v.t = TJ_DICT;
    v.n = 0;
    v.u.d = fd;
    if (tok_set_k(p, d, tj_k_type, 4, tj_str("function", 8)) != 0
        || tok_set_k(p, d, tj_k_function, 8, v) != 0)
    {
        return -1;
    }
    for (k = 0; k < 3; k++) {
        e = cJSON_GetObjectItemCaseSensitive(fn, fixed[k]);
        if (k == 2 && e && !cJSON_IsNull(e) && !cJSON_IsObject(e)) {
            tok_err(p->err, p->errlen, "tools[%zu].function.parameters: "
                    "expected an object", i);
            return -1;
        }
        if (k == 1 && e && !cJSON_IsNull(e) && !cJSON_IsString(e)) {
            tok_err(p->err, p->errlen, "tools[%zu].function.description: "
                    "expected a string", i);
            return -1;
        }
        if (tok_prep_val(p, e, &v) != 0 || tok_set(p, fd, fixed[k], v) != 0) {
            return -1;
        }
    }
    /* extra fields (the model allows them) after the declared ones */
    cJSON_ArrayForEach(e, fn) {
        if (strcmp(e->string, "name") && strcmp(e->string, "description")
            && strcmp(e->string, "parameters"))
        {
            if (tok_prep_val(p, e, &v) != 0
                || tok_set(p, fd, e->string, v) != 0)
            {
                return -1;
            }
        }
    }
    cJSON_ArrayForEach(e, tool) {
        if (strcmp(e->string, "type") && strcmp(e->string, "function")) {
            if (tok_prep_val(p, e, &v) != 0
                || tok_set(p, d, e->string, v) != 0)
            {
                return -1;
            }
        }
    }
    out->t = TJ_DICT;
    out->u.d = d;
    out->n = 0;
    return 0;
}


/* v: the request's member named key, or NULL */
static int
tok_prep_bool(tok_prep_t *p, const cJSON *v, const char *key, int dflt,
    int *out)
{
    if (v == NULL || tok_is_null(v)) {
        *out = dflt;
        return 0;
    }
    if (!tok_is_bool(v)) {
        tok_err(p->err, p->errlen, "%s: expected a boolean", key);
        return -1;
    }
    *out = tok_is_true(v);
    return 0;
}


/* the request's members tok_prep() reads */
typedef struct {
    const cJSON    *messages;
    const cJSON    *tools;
    const cJSON    *documents;
    const cJSON    *agp;            /* add_generation_prompt */
    const cJSON    *cfm;            /* continue_final_message */
    const cJSON    *kwargs;         /* chat_template_kwargs */
    const cJSON    *effort;         /* reasoning_effort */
} tok_req_keys_t;


/*
 * One pass over the members instead of a lookup for each: what
 * cJSON_GetObjectItemCaseSensitive() finds (the first of a name; none
 * past a member without a name).  in: the request, or a messages array.
 */
static void
tok_req_keys(const cJSON *in, tok_req_keys_t *k)
{
    const cJSON  *e;
    const char   *s;

    memset(k, 0, sizeof(*k));
    if (!tok_is_object(in)) {
        return;
    }
    for (e = in->child; e && e->string; e = e->next) {
        s = e->string;
        switch (s[0]) {
        case 'm':
            if (k->messages == NULL && strcmp(s, "messages") == 0) {
                k->messages = e;
            }
            break;
        case 't':
            if (k->tools == NULL && strcmp(s, "tools") == 0) {
                k->tools = e;
            }
            break;
        case 'd':
            if (k->documents == NULL && strcmp(s, "documents") == 0) {
                k->documents = e;
            }
            break;
        case 'a':
            if (k->agp == NULL && strcmp(s, "add_generation_prompt") == 0) {
                k->agp = e;
            }
            break;
        case 'r':
            if (k->effort == NULL && strcmp(s, "reasoning_effort") == 0) {
                k->effort = e;
            }
            break;
        case 'c':
            if (k->cfm == NULL && strcmp(s, "continue_final_message") == 0) {
                k->cfm = e;
            } else if (k->kwargs == NULL
                       && strcmp(s, "chat_template_kwargs") == 0)
            {
                k->kwargs = e;
            }
            break;
        }
    }
}


/*
 * The template variables of a request (an object with "messages") or of a
 * bare messages array.  *final: the last message's text for
 * continue_final_message (NULL if off).
 */
static int
tok_prep(tok_prep_t *p, const dpd_tok_t *tok, const cJSON *in,
    const tok_req_keys_t *k, int openai, tj_dict_t **vars, int *has_tools,
    tj_val_t *final)
{
    const cJSON  *msgs = in, *e, *kw;
    tj_dict_t    *g;
    tj_val_t      v, l;
    size_t        i = 0;
    int           agp, cfm;

    *has_tools = 0;
    *final = tj_undef(NULL, 0);
    if (tok_is_object(in)) {
        msgs = k->messages;
    }
    if (!tok_is_array(msgs)) {
        tok_err(p->err, p->errlen, "messages: expected an array");
        return -1;
    }
    if (msgs->child == NULL) {
        tok_err(p->err, p->errlen, "messages: empty array");
        return -1;
    }
    /* room for the request's variables and the special tokens */
    g = tj_a_dict_cap(&p->a, 5 + (tok->chat && tok->chat->specials
                                  ? tok->chat->specials->n : 0));
    if (g == NULL) {
        return tok_prep_oom(p);
    }

    l.t = TJ_LIST;
    l.n = 0;
    if ((l.u.l = tj_a_list(&p->a)) == NULL) {
        return tok_prep_oom(p);
    }
    i = 0;
    cJSON_ArrayForEach(e, msgs) {
        if (tok_prep_message(p, e, i++, openai, &v) != 0) {
            return -1;
        }
        if (tj_a_list_push(&p->a, l.u.l, v) != 0) {
            return tok_prep_oom(p);
        }
    }
    /* g is new and its five names distinct: added, not looked up */
    if (tj_a_dict_add(&p->a, g, tj_k_messages, 8, l) != 0) {
        return tok_prep_oom(p);
    }

    v = tj_none();
    e = k->tools;
    if (e && !tok_is_null(e)) {
        const cJSON *t;
        if (!tok_is_array(e)) {
            tok_err(p->err, p->errlen, "tools: expected an array");
            return -1;
        }
        v.t = TJ_LIST;
        if ((v.u.l = tj_a_list(&p->a)) == NULL) {
            return tok_prep_oom(p);
        }
        i = 0;
        cJSON_ArrayForEach(t, e) {
            tj_val_t tv;
            if (tok_prep_tool(p, t, i++, &tv) != 0) {
                return -1;
            }
            if (tj_a_list_push(&p->a, v.u.l, tv) != 0) {
                return tok_prep_oom(p);
            }
        }
        *has_tools = 1;
    }
    if (tj_a_dict_add(&p->a, g, tj_k_tools, 5, v) != 0) {
        return tok_prep_oom(p);
    }
    e = k->documents;
    if (e && !tok_is_null(e) && !tok_is_array(e)) {
        tok_err(p->err, p->errlen, "documents: expected an array of objects");
        return -1;
    }
    if (tok_prep_val(p, e, &v) != 0) {
        return -1;
    }
    if (tj_a_dict_add(&p->a, g, tj_k_documents, 9, v) != 0) {
        return tok_prep_oom(p);
    }

    if (tok_prep_bool(p, k->agp, "add_generation_prompt", 1, &agp) != 0
        || tok_prep_bool(p, k->cfm, "continue_final_message", 0, &cfm) != 0)
    {
        return -1;
    }
    if (agp && cfm) {
        tok_err(p->err, p->errlen, "Cannot set both `continue_final_message` "
                "and `add_generation_prompt` to True.");
        return -1;
    }
    if (k->effort && !tok_is_null(k->effort) && !tok_is_string(k->effort)) {
        tok_err(p->err, p->errlen, "reasoning_effort: expected a string");
        return -1;
    }

    /* the special tokens (after the request's variables, which are looked
     * up most; no name is shared), then the kwargs over everything */
    if (tok->chat && tok->chat->specials) {
        /* the specials' names (*_token, additional_special_tokens) are
         * distinct, and none of the three above */
        for (i = 0; i < tok->chat->specials->n; i++) {
            const tj_pair_t *sp = &tok->chat->specials->p[i];
            if (tj_a_dict_add(&p->a, g, sp->k, sp->kn, sp->v) != 0) {
                return tok_prep_oom(p);
            }
        }
    }

    /*
     * vLLM's ChatCompletionRequest.build_chat_params() merges the request's
     * add_generation_prompt, continue_final_message, documents and
     * reasoning_effort over chat_template_kwargs, and the kwargs over the
     * tools (merge_kwargs(): a null or "auto" value overrides nothing);
     * continue_final_message reaches transformers' apply_chat_template()
     * as its own argument, which no template sees.
     */
    kw = k->kwargs;
    if (kw && !tok_is_null(kw)) {
        if (!tok_is_object(kw)) {
            tok_err(p->err, p->errlen, "chat_template_kwargs: expected an "
                    "object");
            return -1;
        }
        cJSON_ArrayForEach(e, kw) {
            if (strcmp(e->string, "chat_template") == 0
                || strcmp(e->string, "tokenize") == 0)
            {
                tok_err(p->err, p->errlen, "Found unexpected "
                        "chat_template_kwargs from request: ['%.40s']",
                        e->string);
                return -1;
            }
            if (tok_is_null(e)
                || (tok_is_string(e) && strcmp(e->valuestring, "auto") == 0)
                || strcmp(e->string, "continue_final_message") == 0)
            {
                continue;       /* overrides nothing, or the request's */
            }
            if (strcmp(e->string, "messages") == 0) {
                /* transformers renders with messages=the conversation and
                 * these kwargs: a second "messages" is a TypeError, 400 */
                tok_err(p->err, p->errlen, "chat_template_kwargs: "
                        "'messages' is the conversation's own name");
                return -1;
            }
            if (tok_prep_val(p, e, &v) != 0
                || tok_set(p, g, e->string, v) != 0)
            {
                return -1;
            }
        }
    }
    if (tok_set_k(p, g, tj_k_add_generation_prompt, 21, tj_bool(agp)) != 0) {
        return -1;
    }
    e = k->documents;
    if (e && !tok_is_null(e)) {
        if (tok_prep_val(p, e, &v) != 0
            || tok_set_k(p, g, tj_k_documents, 9, v) != 0)
        {
            return -1;
        }
    }
    e = k->effort;
    if (tok_is_string(e)) {
        if (tok_set(p, g, "reasoning_effort", tok_cstr(p, e->valuestring))
            != 0)
        {
            return -1;
        }
        /* reasoning requested turns thinking on (Gemma 4, Qwen 3) unless
         * the kwargs say otherwise */
        if ((kw == NULL || !tok_is_object(kw)
             || cJSON_GetObjectItemCaseSensitive(kw, "enable_thinking")
                == NULL)
            && tok_set(p, g, "enable_thinking",
                       tj_bool(strcmp(e->valuestring, "none") != 0)) != 0)
        {
            return -1;
        }
    }

    if (cfm) {
        /*
         * transformers (4.57 and 5): the final message's content, or its
         * last text block, gets CONTINUE_FINAL_MESSAGE_TAG appended before
         * the render; the prompt is cut where the tag lands
         */
        const tj_val_t *last = &l.u.l->v[l.u.l->n - 1];
        tj_val_t       *c = tj_dict_get(last->u.d, "content", 7);
        tj_dict_t      *blk = NULL;
        tj_val_t        t = tj_str("", 0);

        if (c && c->t == TJ_STR) {
            t = *c;
            blk = last->u.d;
        } else if (c && c->t == TJ_LIST) {
            for (i = c->u.l->n; i-- > 0; ) {
                const tj_val_t *x = c->u.l->v[i].t == TJ_DICT
                    ? tj_dict_get(c->u.l->v[i].u.d, "text", 4) : NULL;
                if (x && x->t == TJ_STR) {
                    t = *x;
                    blk = c->u.l->v[i].u.d;
                    break;
                }
            }
        }
        if (blk == NULL) {
            tok_err(p->err, p->errlen, "continue_final_message is set but we "
                    "could not find any text to continue in the final "
                    "message!");
            return -1;
        }
        *final = t;
        {
            tj_buf_t  b = { 0 };

            b.a = &p->a;
            if (tj_buf_add(&b, t.u.s, t.n) != 0
                || tj_buf_add(&b, TOK_CFM_TAG " ", sizeof(TOK_CFM_TAG)) != 0)
            {
                return tok_prep_oom(p);
            }
            if (tok_set_k(p, blk, blk == last->u.d ? tj_k_content : tj_k_text,
                          blk == last->u.d ? 7 : 4, tj_str(b.p, b.len)) != 0)
            {
                return -1;
            }
        }
    }
    *vars = g;
    return 0;
}


/*
 * transformers' continue_final_message cut (render_jinja_template(), 4.57
 * and 5): the final text (s, without the tag) stripped, and the tag, must
 * be in the prompt; it ends where the last tag starts, and loses its
 * trailing whitespace (Python's str.rstrip()) when the template did not
 * keep the tag's own space.
 */
static int
tok_continue_final(char *text, size_t *len, tj_val_t s, char *err,
    size_t errlen)
{
    static const char   tag[] = TOK_CFM_TAG " ";
    size_t              a, b, i, loc;
    const char         *found = NULL, *q;
    uint32_t            cp;

    for (a = 0; a < s.n; a += i) {
        i = tj_utf8_next(s.u.s + a, s.n - a, &cp);
        if (!tj_py_space(cp)) {
            break;
        }
    }
    for (b = s.n; b > a; b = i) {
        i = b - 1;
        while (i > a && ((unsigned char) s.u.s[i] & 0xC0) == 0x80) {
            i--;
        }
        tj_utf8_next(s.u.s + i, b - i, &cp);
        if (!tj_py_space(cp)) {
            break;
        }
    }
    for (q = text; (size_t) (text + *len - q) >= sizeof(tag) - 2; q++) {
        q = memmem(q, (size_t) (text + *len - q), tag, sizeof(tag) - 2);
        if (q == NULL) {
            break;
        }
        found = q;
    }
    if (found == NULL
        || (b > a && memmem(text, *len, s.u.s + a, b - a) == NULL))
    {
        tok_err(err, errlen, "continue_final_message is set but the final "
                "message does not appear in the chat after applying the chat "
                "template! This can happen if the chat template deletes "
                "portions of the final message. Please verify the chat "
                "template and final message in your chat to ensure they are "
                "compatible.");
        return -1;
    }
    loc = (size_t) (found - text);
    if (!(loc + sizeof(tag) - 1 <= *len
          && memcmp(found, tag, sizeof(tag) - 1) == 0))
    {
        /* rstrip(): back over the whitespace code points */
        while (loc > 0) {
            i = loc - 1;
            while (i > 0 && ((unsigned char) text[i] & 0xC0) == 0x80) {
                i--;
            }
            tj_utf8_next(text + i, loc - i, &cp);
            if (!tj_py_space(cp)) {
                break;
            }
            loc = i;
        }
    }
    text[loc] = '\0';
    *len = loc;
    return 0;
}


static void
tok_limits(tj_limits_t *lim, size_t bytes)
{
    lim->max_output = 4 * bytes + (4u << 20);
    lim->max_memory = 16 * bytes + (64u << 20);
    /* no string of a render reaches TJ_STR_MAX */
    if (lim->max_output >= TJ_STR_MAX / 2) {
        lim->max_output = TJ_STR_MAX / 2;
    }
    if (lim->max_memory >= TJ_STR_MAX / 2) {
        lim->max_memory = TJ_STR_MAX / 2;
    }
    lim->max_steps = 2000000 + 64 * (unsigned long) bytes;
    lim->max_depth = 64;
    lim->out_hint = bytes + 2048;     /* the texts and the template's own */
}


static int
tok_chat_render_keys(const dpd_tok_t *tok, const tj_template_t *t,
    const cJSON *request, const tok_req_keys_t *k, char **out,
    size_t *outlen, char *err, size_t errlen)
{
    tok_prep_t    p;
    tj_dict_t    *vars;
    tj_val_t      final;
    tj_limits_t   lim;
    int           tools, rc;

    *out = NULL;
    *outlen = 0;
    /* the note is written before it is read (p.skipped) */
    memset(&p, 0, offsetof(tok_prep_t, note));
    p.note[0] = '\0';
    p.err = err;
    p.errlen = errlen;
    if (tok_prep(&p, tok, request, k, t->openai, &vars, &tools, &final)
        != 0)
    {
        tj_arena_free(&p.a);
        return -1;
    }
    if (p.long_str || p.bytes >= TJ_STR_MAX / 2) {
        /* values hold 32-bit lengths */
        tj_arena_free(&p.a);
        tok_err(err, errlen, "the request's texts are too large to render");
        return -1;
    }
    tok_limits(&lim, p.bytes);
    rc = tj_render(t, &p.a, vars, &lim, out, outlen, err, errlen);
    if (rc == 0 && final.t == TJ_STR
        && tok_continue_final(*out, outlen, final, err, errlen) != 0)
    {
        free(*out);
        *out = NULL;
        *outlen = 0;
        rc = -1;
    }
    tj_arena_free(&p.a);
    if (rc != 0) {
        return -1;
    }
    if (p.skipped) {
        tok_err(err, errlen, "%s", p.note);
        return 2;
    }
    return 0;
}


/* render request with t (the fuzzer calls it with its own templates) */
int
tok_chat_render_with(const dpd_tok_t *tok, const tj_template_t *t,
    const cJSON *request, char **out, size_t *outlen, char *err,
    size_t errlen)
{
    tok_req_keys_t  k;

    tok_req_keys(request, &k);
    return tok_chat_render_keys(tok, t, request, &k, out, outlen, err,
                                errlen);
}


int
dpd_chat_render_json(const dpd_tok_t *tok, dpd_chat_template_t tmpl,
    const struct cJSON *request, char **out, size_t *outlen,
    char *err, size_t errlen)
{
    const tj_template_t  *t;
    tok_req_keys_t        k;

    *out = NULL;
    *outlen = 0;
    if (tok == NULL) {
        tok_err(err, errlen, "no tokenizer");
        return -1;
    }
    if (tok->harmony && tok_chat_auto(tmpl)) {
        /* 1: a feature harmony's renderer is not followed for: estimate */
        return dpd_chat_harmony_json(tok, request, out, outlen, NULL, NULL,
                                     NULL, err, errlen);
    }
    tok_req_keys(request, &k);
    t = tok_chat_pick(tok, tmpl, tok_is_array(k.tools));
    if (t == NULL) {
        return 1;
    }
    return tok_chat_render_keys(tok, t, request, &k, out, outlen, err,
                                errlen);
}


/* the documented estimate: content tokens + a fixed overhead per message */
static int
tok_chat_estimate(const dpd_tok_t *tok, const cJSON *request, long *out,
    char *err, size_t errlen)
{
    const cJSON  *msgs, *m;
    tok_prep_t    p;
    size_t        i = 0;
    long          total, c;
    tj_val_t      v;

    msgs = cJSON_IsObject(request)
           ? cJSON_GetObjectItemCaseSensitive(request, "messages") : request;
    if (!cJSON_IsArray(msgs) || msgs->child == NULL) {
        tok_err(err, errlen, cJSON_IsArray(msgs) ? "messages: empty array"
                                                 : "messages: expected an "
                                                   "array");
        return -1;
    }
    memset(&p, 0, sizeof(p));
    p.err = err;
    p.errlen = errlen;
    total = DPD_CHAT_EST_PRIMING;
    cJSON_ArrayForEach(m, msgs) {
        if (tok_prep_message(&p, m, i++, 0, &v) != 0) {
            tj_arena_free(&p.a);
            return -1;
        }
        v = *tj_dict_get(v.u.d, "content", 7);
        c = dpd_tok_count(tok, v.u.s, v.n, 0);
        if (c < 0) {
            tj_arena_free(&p.a);
            tok_err(err, errlen, "tokenizer failure");
            return -1;
        }
        total += c + DPD_CHAT_EST_PER_MESSAGE;
    }
    tj_arena_free(&p.a);
    *out = total;
    return 0;
}


long
dpd_chat_count_json(const dpd_tok_t *tok, dpd_chat_template_t tmpl,
    const struct cJSON *request, int *estimated, char *err, size_t errlen)
{
    size_t        len;
    char         *text;
    long          total;
    int           rc;

    if (estimated) {
        *estimated = 0;
    }
    if (tok && tok->harmony && tok_chat_auto(tmpl)) {
        rc = dpd_chat_harmony_json(tok, request, NULL, NULL, NULL, NULL,
                                   &total, err, errlen);
        if (rc <= 0) {
            return rc < 0 ? -1 : total;
        }
        /* err holds the note; the estimate below keeps it */
        if (tok_chat_estimate(tok, request, &total, err, errlen) != 0) {
            return -1;
        }
        if (estimated) {
            *estimated = 1;
        }
        return total;
    }
    rc = dpd_chat_render_json(tok, tmpl, request, &text, &len, err, errlen);
    if (rc < 0) {
        return -1;
    }
    if (rc == 0 || rc == 2) {
        total = dpd_tok_count(tok, text, len, 0);
        free(text);
        if (total < 0) {
            tok_err(err, errlen, "tokenizer failure");
        }
        if (rc == 2 && estimated) {
            *estimated = 1;     /* err holds the note */
        }
        return total;
    }

    /* no template: content tokens plus a fixed overhead per message */
    if (tok_chat_estimate(tok, request, &total, err, errlen) != 0) {
        return -1;
    }
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
