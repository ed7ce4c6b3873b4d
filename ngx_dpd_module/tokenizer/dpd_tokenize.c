/*
 * dpd-tokenize: the tokenizer library on the command line.
 *
 *   dpd-tokenize --tokenizer tokenizer.json [--config tokenizer_config.json]
 *                [--ids | --count | --render] [--special] [--jsonl]
 *                [--chat [--template auto|none|FILE.jinja] [--estimate]]
 *
 * Reads stdin.  Plain mode tokenizes all of it; --jsonl reads one JSON
 * string per line (raw bytes inside the quotes are passed through, so
 * invalid UTF-8 can be tested) and writes one line per input; --chat reads
 * an OpenAI chat request body (or a bare messages array) and tokenizes the
 * rendered prompt (the model's Jinja chat template, or --template FILE,
 * with the variables vLLM passes: tools, chat_template_kwargs, ...; as
 * vLLM, no specials are added to it, --special or not: the template
 * carries them); with --jsonl, one request per line.  --render prints the
 * rendered prompt as a JSON string instead of ids.  Without any template a
 * chat is an error, unless --estimate (--count only): the documented
 * estimate.  Image and other non-text parts are left out of the count and
 * said so on stderr, as the gateway does.  With --jsonl a bad line prints
 * "error: line N: ..." in its place and the rest goes on.  Text is passed
 * by length everywhere: a NUL byte (or \u0000 in a --jsonl string) is text
 * like any other character.
 * Without --config, tokenizer_config.json next to the tokenizer file is
 * read when it is there, as nginx's dpd_tokenizer does ("--config none":
 * no config).
 * Exit 0 on success, 2 on bad input (some bad line) or usage, 1 on
 * internal failure.
 */

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <cjson/cJSON.h>

#include "dpd_tokenizer.h"

typedef struct {
    const char           *tokenizer, *config;
    int                   count, render, special, jsonl, chat, estimate;
    dpd_chat_template_t   tmpl;
    const char           *tmpl_file;
} opts_t;

static uint32_t  *ids;
static size_t     ids_cap;


/*
 * tokenizer_config.json in the directory of path, if it is a regular file
 * (ngx_http_dpd_tokenizer()'s rule); NULL otherwise.  Caller frees.
 */
static char *
sibling_config(const char *path)
{
    static const char  name[] = "tokenizer_config.json";

    char          *s;
    size_t         dir;
    struct stat    st;
    const char    *slash;

    slash = strrchr(path, '/');
    dir = slash ? (size_t) (slash - path) + 1 : 0;

    s = malloc(dir + sizeof(name));
    if (s == NULL) {
        return NULL;
    }
    memcpy(s, path, dir);
    memcpy(s + dir, name, sizeof(name));

    if (stat(s, &st) != 0 || !S_ISREG(st.st_mode)) {
        free(s);
        return NULL;
    }
    return s;
}


static void
usage(void)
{
    fprintf(stderr,
        "usage: dpd-tokenize --tokenizer FILE [--config FILE|none] "
        "[--ids|--count"
        "|--render]\n"
        "                    [--special] [--jsonl] [--chat [--template "
        "auto|none|FILE]\n"
        "                    [--estimate]]\n"
        "  reads stdin; --jsonl: one JSON string (or, with --chat, one chat "
        "request)\n"
        "  per line; --template FILE: a Jinja chat template file\n"
        "  without --config: tokenizer_config.json next to FILE, if there "
        "(as nginx)\n");
}


static char *
read_all(FILE *f, size_t *len)
{
    size_t   cap = 65536, n = 0, r;
    char    *buf = malloc(cap), *p;

    if (buf == NULL) {
        return NULL;
    }
    while ((r = fread(buf + n, 1, cap - n - 1, f)) > 0) {
        n += r;
        if (cap - n - 1 == 0) {
            p = realloc(buf, cap * 2);
            if (p == NULL) {
                free(buf);
                return NULL;
            }
            buf = p;
            cap *= 2;
        }
    }
    buf[n] = '\0';
    *len = n;
    return buf;
}


static int
hex4(const char *s, unsigned *v)
{
    unsigned  i, c, r = 0;

    for (i = 0; i < 4; i++) {
        c = (unsigned char) s[i];
        r <<= 4;
        if (c >= '0' && c <= '9') {
            r |= c - '0';
        } else if (c >= 'a' && c <= 'f') {
            r |= c - 'a' + 10;
        } else if (c >= 'A' && c <= 'F') {
            r |= c - 'A' + 10;
        } else {
            return -1;
        }
    }
    *v = r;
    return 0;
}


static size_t
put_utf8(unsigned cp, char *o)
{
    if (cp < 0x80) {
        o[0] = (char) cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char) (0xC0 | (cp >> 6));
        o[1] = (char) (0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char) (0xE0 | (cp >> 12));
        o[1] = (char) (0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char) (0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char) (0xF0 | (cp >> 18));
    o[1] = (char) (0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char) (0x80 | ((cp >> 6) & 0x3F));
    o[3] = (char) (0x80 | (cp & 0x3F));
    return 4;
}


/*
 * Decode one JSON string occupying the line s[0..len) (surrounding blanks
 * allowed) into out (at least len bytes).  Lone surrogates become U+FFFD.
 */
static int
json_string_line(const char *s, size_t len, char *out, size_t *outlen,
    const char **why)
{
    size_t    i = 0, o = 0;
    unsigned  v, lo;

    while (i < len && (s[i] == ' ' || s[i] == '\t' || s[i] == '\r')) {
        i++;
    }
    if (i >= len || s[i] != '"') {
        *why = "expected a JSON string";
        return -1;
    }
    i++;
    for ( ;; ) {
        if (i >= len) {
            *why = "unterminated JSON string";
            return -1;
        }
        if (s[i] == '"') {
            i++;
            break;
        }
        if (s[i] != '\\') {
            out[o++] = s[i++];
            continue;
        }
        if (++i >= len) {
            *why = "bad escape";
            return -1;
        }
        switch (s[i++]) {
        case '"': out[o++] = '"'; break;
        case '\\': out[o++] = '\\'; break;
        case '/': out[o++] = '/'; break;
        case 'b': out[o++] = '\b'; break;
        case 'f': out[o++] = '\f'; break;
        case 'n': out[o++] = '\n'; break;
        case 'r': out[o++] = '\r'; break;
        case 't': out[o++] = '\t'; break;
        case 'u':
            if (i + 4 > len || hex4(s + i, &v) != 0) {
                *why = "bad \\u escape";
                return -1;
            }
            i += 4;
            if (v >= 0xD800 && v <= 0xDBFF && i + 6 <= len && s[i] == '\\'
                && s[i + 1] == 'u' && hex4(s + i + 2, &lo) == 0
                && lo >= 0xDC00 && lo <= 0xDFFF)
            {
                v = 0x10000 + ((v - 0xD800) << 10) + (lo - 0xDC00);
                i += 6;
            } else if (v >= 0xD800 && v <= 0xDFFF) {
                v = 0xFFFD;
            }
            o += put_utf8(v, out + o);
            break;
        default:
            *why = "bad escape";
            return -1;
        }
    }
    while (i < len && (s[i] == ' ' || s[i] == '\t' || s[i] == '\r')) {
        i++;
    }
    if (i != len) {
        *why = "trailing characters after the JSON string";
        return -1;
    }
    *outlen = o;
    return 0;
}


static int
ensure_ids(long n)
{
    uint32_t  *p;

    if ((size_t) n <= ids_cap) {
        return 0;
    }
    p = realloc(ids, (size_t) n * sizeof(uint32_t));
    if (p == NULL) {
        return -1;
    }
    ids = p;
    ids_cap = (size_t) n;
    return 0;
}


static int
print_tokens(const dpd_tok_t *tok, const opts_t *o, const char *text,
    size_t len)
{
    long    n;
    size_t  i;

    if (o->count) {
        n = dpd_tok_count(tok, text, len, o->special);
        if (n < 0) {
            fprintf(stderr, "dpd-tokenize: tokenizer failure\n");
            return 1;
        }
        printf("%ld\n", n);
        return 0;
    }
    n = dpd_tok_encode(tok, text, len, o->special, ids, ids_cap);
    if (n >= 0 && (size_t) n > ids_cap) {
        if (ensure_ids(n) != 0) {
            fprintf(stderr, "dpd-tokenize: out of memory\n");
            return 1;
        }
        n = dpd_tok_encode(tok, text, len, o->special, ids, ids_cap);
    }
    if (n < 0) {
        fprintf(stderr, "dpd-tokenize: tokenizer failure\n");
        return 1;
    }
    for (i = 0; i < (size_t) n; i++) {
        printf(i ? " %u" : "%u", ids[i]);
    }
    putchar('\n');
    return 0;
}


static void
print_json_string(const char *s, size_t len)
{
    cJSON  *str;
    char   *p;

    /* rendered prompts have no NUL: cJSON's printer is enough here */
    (void) len;
    str = cJSON_CreateString(s);
    p = str ? cJSON_PrintUnformatted(str) : NULL;
    if (p) {
        puts(p);
    }
    free(p);
    cJSON_Delete(str);
}


/* offset of the first NUL in a JSON text (a raw byte, or "\u0000" in a
 * string), or -1 */
static long
json_nul_at(const char *s, size_t len)
{
    size_t  i;
    int     in_str = 0;

    for (i = 0; i < len; i++) {
        if (s[i] == '\0') {
            return (long) i;
        }
        if (!in_str) {
            in_str = (s[i] == '"');
            continue;
        }
        if (s[i] == '"') {
            in_str = 0;
        } else if (s[i] == '\\' && i + 1 < len) {
            if (s[i + 1] == 'u' && i + 5 < len && memcmp(s + i + 2, "0000", 4)
                == 0)
            {
                return (long) i;
            }
            i++;
        }
    }
    return -1;
}


/*
 * gpt-oss: harmony's ids are the text pieces encoded without added-token
 * matching, not the rendered text re-encoded.  1: the estimate's path.
 */
static int
do_harmony(const dpd_tok_t *tok, const opts_t *o, const cJSON *root,
    const char *where)
{
    char       err[512], *text;
    size_t     tlen, n, i;
    uint32_t  *hids;
    long       count;
    int        rc;

    rc = dpd_chat_harmony_json(tok, root, &text, &tlen, &hids, &n, &count,
                               err, sizeof(err));
    if (rc < 0) {
        fprintf(stderr, "dpd-tokenize: %s%s\n", where, err);
        return 2;
    }
    if (rc == 1) {
        fprintf(stderr, "dpd-tokenize: %s%s\n", where, err);
        if (!o->estimate || !o->count) {
            fprintf(stderr, "dpd-tokenize: %s--count --estimate gives the "
                    "documented estimate\n", where);
            return 2;
        }
        return 1;
    }
    if (o->render) {
        print_json_string(text, tlen);
    } else if (o->count) {
        printf("%ld\n", count);
    } else {
        for (i = 0; i < n; i++) {
            printf(i ? " %u" : "%u", hids[i]);
        }
        putchar('\n');
    }
    free(text);
    free(hids);
    return 0;
}


static int
do_chat(const dpd_tok_t *tok, const opts_t *o, const char *body, size_t len,
    const char *where)
{
    cJSON        *root;
    const cJSON  *msgs;
    char          err[512], *text;
    size_t        tlen;
    int           rc, est;
    long          n;

    n = json_nul_at(body, len);
    if (n >= 0) {
        fprintf(stderr, "dpd-tokenize: %sthe chat request holds a NUL "
                "character (\\u0000) at byte %ld: refused, as the gateway "
                "refuses it\n", where, n);
        return 2;
    }

    root = cJSON_ParseWithLength(body, len);
    if (root == NULL) {
        fprintf(stderr, "dpd-tokenize: %sinvalid JSON chat request\n", where);
        return 2;
    }
    msgs = cJSON_IsArray(root) ? root
                               : cJSON_GetObjectItemCaseSensitive(root,
                                                                  "messages");
    if (msgs == NULL) {
        fprintf(stderr, "dpd-tokenize: %smessages: missing\n", where);
        cJSON_Delete(root);
        return 2;
    }
    if (dpd_tok_chat_harmony(tok) && o->tmpl == DPD_CHAT_AUTO) {
        rc = do_harmony(tok, o, root, where);
        if (rc != 1) {
            cJSON_Delete(root);
            return rc;
        }
    }
    /* the whole request: tools, chat_template_kwargs, documents, ... */
    rc = dpd_chat_render_json(tok, o->tmpl, root, &text, &tlen, err,
                              sizeof(err));
    if (rc < 0) {
        fprintf(stderr, "dpd-tokenize: %s%s\n", where, err);
        cJSON_Delete(root);
        return 2;
    }
    if (rc == 2) {
        fprintf(stderr, "dpd-tokenize: %stext counted only (%s)\n", where,
                err);
    }
    if (rc == 1) {
        if (!o->estimate || !o->count) {
            fprintf(stderr, "dpd-tokenize: %sno chat template (the model has "
                    "none, or --template none): --count --estimate gives the "
                    "documented estimate\n", where);
            cJSON_Delete(root);
            return 2;
        }
        n = dpd_chat_count_json(tok, o->tmpl, root, &est, err, sizeof(err));
        cJSON_Delete(root);
        if (n < 0) {
            fprintf(stderr, "dpd-tokenize: %s%s\n", where, err);
            return 2;
        }
        fprintf(stderr, "dpd-tokenize: no chat template, the count is "
                "an estimate (content tokens + %d per message + %d)\n",
                DPD_CHAT_EST_PER_MESSAGE, DPD_CHAT_EST_PRIMING);
        printf("%ld\n", n);
        return 0;
    }
    cJSON_Delete(root);
    if (o->render) {
        print_json_string(text, tlen);
        rc = 0;
    } else {
        /* vLLM encodes the prompt with add_special_tokens=False */
        opts_t plain = *o;
        plain.special = 0;
        rc = print_tokens(tok, &plain, text, tlen);
    }
    free(text);
    return rc;
}


static int
run(const dpd_tok_t *tok, const opts_t *o, char *in, size_t len)
{
    char        *line, *nl, *buf = NULL, where[64];
    const char  *why;
    size_t       llen, blen, lineno = 0;
    int          rc = 0, r;

    if (!o->jsonl) {
        if (o->chat) {
            return do_chat(tok, o, in, len, "");
        }
        if (o->render) {
            fprintf(stderr, "dpd-tokenize: --render needs --chat\n");
            return 2;
        }
        return print_tokens(tok, o, in, len);
    }

    buf = calloc(1, len + 1);  /* initialised: see tok_buf_add() */
    if (buf == NULL) {
        fprintf(stderr, "dpd-tokenize: out of memory\n");
        return 1;
    }
    if (o->render && !o->chat) {
        free(buf);
        fprintf(stderr, "dpd-tokenize: --render needs --chat\n");
        return 2;
    }
    /*
     * A bad line gives an "error: line N: ..." output line (the message
     * also on stderr) and the next lines go on, so output line N is still
     * input line N; the exit status is then 2.  An internal failure
     * (out of memory) stops at once with 1.
     */
    line = in;
    while (line < in + len) {
        nl = memchr(line, '\n', (size_t) (in + len - line));
        llen = nl ? (size_t) (nl - line) : (size_t) (in + len - line);
        lineno++;
        snprintf(where, sizeof(where), "line %zu: ", lineno);
        if (o->chat) {
            fflush(stdout);
            r = do_chat(tok, o, line, llen, where);
            if (r == 2) {
                printf("error: line %zu: bad chat request (see stderr)\n",
                       lineno);
            }
        } else if (json_string_line(line, llen, buf, &blen, &why) != 0) {
            fprintf(stderr, "dpd-tokenize: line %zu: %s\n", lineno, why);
            printf("error: line %zu: %s\n", lineno, why);
            r = 2;
        } else {
            r = print_tokens(tok, o, buf, blen);
        }
        if (r == 1) {
            rc = 1;
            break;
        }
        if (r != 0) {
            rc = 2;
        }
        line += llen + 1;
    }
    free(buf);
    return rc;
}


int
main(int argc, char **argv)
{
    opts_t      o;
    dpd_tok_t  *tok;
    char        err[1024], *in, *found;
    size_t      len;
    int         i, t, rc, none;

    memset(&o, 0, sizeof(o));
    o.tmpl = DPD_CHAT_AUTO;

    for (i = 1; i < argc; i++) {
        const char *a = argv[i];
        if ((strcmp(a, "--tokenizer") == 0 || strcmp(a, "--config") == 0
             || strcmp(a, "--template") == 0) && i + 1 >= argc)
        {
            fprintf(stderr, "dpd-tokenize: %s needs a value\n", a);
            return 2;
        }
        if (strcmp(a, "--tokenizer") == 0) {
            o.tokenizer = argv[++i];
        } else if (strcmp(a, "--config") == 0) {
            o.config = argv[++i];
        } else if (strcmp(a, "--template") == 0) {
            t = dpd_chat_template_from_name(argv[++i]);
            if (t < 0) {
                o.tmpl_file = argv[i];     /* a template file */
            } else {
                o.tmpl = (dpd_chat_template_t) t;
            }
        } else if (strcmp(a, "--estimate") == 0) {
            o.estimate = 1;
        } else if (strcmp(a, "--ids") == 0) {
            o.count = 0;
        } else if (strcmp(a, "--count") == 0) {
            o.count = 1;
        } else if (strcmp(a, "--render") == 0) {
            o.render = 1;
        } else if (strcmp(a, "--special") == 0) {
            o.special = 1;
        } else if (strcmp(a, "--jsonl") == 0) {
            o.jsonl = 1;
        } else if (strcmp(a, "--chat") == 0) {
            o.chat = 1;
        } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage();
            return 0;
        } else {
            fprintf(stderr, "dpd-tokenize: unknown option \"%s\"\n", a);
            usage();
            return 2;
        }
    }
    if (o.tokenizer == NULL) {
        fprintf(stderr, "dpd-tokenize: --tokenizer FILE is required\n");
        usage();
        return 2;
    }

    found = NULL;
    none = 0;
    if (o.config == NULL) {
        found = sibling_config(o.tokenizer);
        o.config = found;
    } else if (strcmp(o.config, "none") == 0) {
        o.config = NULL;
        none = 1;
    }

    tok = dpd_tok_load(o.tokenizer, o.config, err, sizeof(err));
    free(found);
    o.config = found ? "" : o.config;   /* only "given or found" below */
    if (tok == NULL) {
        fprintf(stderr, "dpd-tokenize: %s\n", err);
        return 2;
    }
    if (o.tmpl_file) {
        t = dpd_tok_chat_template_file(tok, o.tmpl_file, err, sizeof(err));
        if (t < 0) {
            fprintf(stderr, "dpd-tokenize: --template: %s\n", err);
            dpd_tok_free(tok);
            return 2;
        }
        o.tmpl = (dpd_chat_template_t) t;
    }
    if (o.chat && o.tmpl == DPD_CHAT_AUTO
        && dpd_tok_chat_template(tok) == DPD_CHAT_NONE)
    {
        fprintf(stderr, "dpd-tokenize: the model has no chat template%s\n",
                o.config ? "" : none ? " (--config none)"
                : " (no --config given and no tokenizer_config.json next "
                  "to the tokenizer)");
    }
    if (o.estimate && !(o.chat && o.count)) {
        fprintf(stderr, "dpd-tokenize: --estimate needs --chat --count\n");
        dpd_tok_free(tok);
        return 2;
    }

    in = read_all(stdin, &len);
    if (in == NULL) {
        fprintf(stderr, "dpd-tokenize: cannot read stdin: %s\n",
                strerror(errno));
        dpd_tok_free(tok);
        return 1;
    }
    rc = run(tok, &o, in, len);
    if (fflush(stdout) != 0 && rc == 0) {
        rc = 1;
    }
    free(in);
    free(ids);
    dpd_tok_free(tok);
    return rc;
}
