/*
 * Template text to tokens, as Jinja2's lexer does with transformers'
 * settings:
 *
 *   newlines normalised to "\n", one trailing newline dropped
 *   (keep_trailing_newline=False);
 *   "{%-", "{{-", "{#-" strip the whitespace before the tag, "-%}", "-}}",
 *   "-#}" the whitespace after it;
 *   trim_blocks: the newline right after "%}" or "#}" goes ("+%}" keeps it);
 *   lstrip_blocks: spaces and tabs from the start of a line to "{%" or "{#"
 *   go ("{%+" keeps them);
 *   an end tag only counts where brackets are balanced;
 *   {% raw %}...{% endraw %} is text.
 */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"
#include "tok_jinja.h"


typedef struct {
    tj_arena_t   *a;
    const char   *s;
    size_t        n, i;
    unsigned      line;
    tj_tokens_t  *out;
    char         *err;
    size_t        errlen;
    int           line_starting;
} tj_lx_t;


static int
tj_lx_err(tj_lx_t *x, const char *msg)
{
    tok_err(x->err, x->errlen, "chat template: line %u: %s", x->line, msg);
    return -1;
}


static int
tj_lx_push(tj_lx_t *x, tj_tok_kind_t k, const char *s, size_t n)
{
    tj_token_t  *t;
    size_t       cap;

    if (x->out->n == x->out->cap) {
        cap = x->out->cap ? x->out->cap * 2 : 256;
        t = tj_arena_alloc(x->a, cap * sizeof(tj_token_t));
        if (t == NULL) {
            return tj_lx_err(x, "out of memory");
        }
        if (x->out->n) {
            memcpy(t, x->out->t, x->out->n * sizeof(tj_token_t));
        }
        x->out->t = t;
        x->out->cap = cap;
    }
    t = &x->out->t[x->out->n++];
    memset(t, 0, sizeof(*t));
    t->kind = k;
    t->line = x->line;
    t->s = s;
    t->n = n;
    return 0;
}


static void
tj_lx_lines(tj_lx_t *x, const char *s, size_t n)
{
    const char  *p = s, *e = s + n;

    while ((p = memchr(p, '\n', (size_t) (e - p))) != NULL) {
        x->line++;
        p++;
    }
}


/* length of the Python whitespace at s[0..n) / at its end */
static size_t
tj_ws_prefix(const char *s, size_t n)
{
    size_t    i = 0, k;
    uint32_t  cp;

    while (i < n) {
        k = tj_utf8_next(s + i, n - i, &cp);
        if (!tj_py_space(cp)) {
            break;
        }
        i += k;
    }
    return i;
}


static size_t
tj_ws_suffix(const char *s, size_t n)
{
    size_t    j = n, k;
    uint32_t  cp;

    while (j > 0) {
        k = j - 1;
        while (k > 0 && ((unsigned char) s[k] & 0xC0) == 0x80) {
            k--;
        }
        tj_utf8_next(s + k, j - k, &cp);
        if (!tj_py_space(cp)) {
            break;
        }
        j = k;
    }
    return n - j;
}


/* the data s[0..n) before a tag opened with marker m ('{', '%', '#') */
static int
tj_lx_data(tj_lx_t *x, const char *s, size_t n, char m, char ctl)
{
    size_t  l;

    if (ctl == '-') {
        n -= tj_ws_suffix(s, n);
    } else if (ctl != '+' && m != '{') {
        /* lstrip_blocks */
        const char *nl = n ? memrchr(s, '\n', n) : NULL;
        l = nl ? (size_t) (nl - s) + 1 : 0;
        if (l > 0 || x->line_starting) {
            size_t k = l;
            while (k < n && (s[k] == ' ' || s[k] == '\t')) {
                k++;
            }
            if (k == n) {
                n = l;
            }
        }
    }
    if (n && tj_lx_push(x, TK_DATA, s, n) != 0) {
        return -1;
    }
    return 0;
}


static int
tj_is_name_start(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}


static int
tj_is_name_char(char c)
{
    return tj_is_name_start(c) || (c >= '0' && c <= '9');
}


static int
tj_hexval(char c)
{
    if (c >= '0' && c <= '9') {
        return c - '0';
    }
    if (c >= 'a' && c <= 'f') {
        return c - 'a' + 10;
    }
    if (c >= 'A' && c <= 'F') {
        return c - 'A' + 10;
    }
    return -1;
}


/* a string literal at x->i (the quote); escapes as Python's
 * unicode-escape codec, unknown ones kept */
static int
tj_lx_string(tj_lx_t *x)
{
    char         q = x->s[x->i], *out;
    size_t       j = x->i + 1, o = 0, k;
    int          esc = 0, h, d;
    uint32_t     cp;
    tj_token_t  *t;

    for (k = j; k < x->n && x->s[k] != q; k++) {
        if (x->s[k] == '\\') {
            esc = 1;
            k++;
        }
    }
    if (k >= x->n) {
        return tj_lx_err(x, "unterminated string");
    }
    if (tj_lx_push(x, TK_STRING, x->s + j, k - j) != 0) {
        return -1;
    }
    t = &x->out->t[x->out->n - 1];
    tj_lx_lines(x, x->s + j, k - j);
    x->i = k + 1;
    if (!esc) {
        return 0;
    }
    out = tj_arena_alloc(x->a, (k - j) * 2 + 1);
    if (out == NULL) {
        return tj_lx_err(x, "out of memory");
    }
    while (j < k) {
        char c = x->s[j];
        if (c != '\\' || j + 1 >= k) {
            out[o++] = c;
            j++;
            continue;
        }
        c = x->s[j + 1];
        j += 2;
        switch (c) {
        case 'n': out[o++] = '\n'; break;
        case 't': out[o++] = '\t'; break;
        case 'r': out[o++] = '\r'; break;
        case 'a': out[o++] = '\a'; break;
        case 'b': out[o++] = '\b'; break;
        case 'f': out[o++] = '\f'; break;
        case 'v': out[o++] = '\v'; break;
        case '\\': out[o++] = '\\'; break;
        case '\'': out[o++] = '\''; break;
        case '"': out[o++] = '"'; break;
        case '\n': break;
        case 'x': case 'u': case 'U':
            d = c == 'x' ? 2 : c == 'u' ? 4 : 8;
            cp = 0;
            for (h = 0; h < d; h++) {
                int hv = j + (size_t) h < k ? tj_hexval(x->s[j + h]) : -1;
                if (hv < 0) {
                    return tj_lx_err(x, "truncated \\x/\\u escape in a "
                                     "string");
                }
                cp = cp * 16 + (uint32_t) hv;
            }
            j += (size_t) d;
            if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
                cp = 0xFFFD;
            }
            o += tok_utf8_encode(cp, out + o);
            break;
        default:
            if (c >= '0' && c <= '7') {
                cp = (uint32_t) (c - '0');
                for (h = 0; h < 2 && j < k && x->s[j] >= '0'
                     && x->s[j] <= '7'; h++)
                {
                    cp = cp * 8 + (uint32_t) (x->s[j++] - '0');
                }
                o += tok_utf8_encode(cp, out + o);
                break;
            }
            out[o++] = '\\';
            out[o++] = c;
        }
    }
    out[o] = '\0';
    t->s = out;
    t->n = o;
    return 0;
}


static int
tj_lx_number(tj_lx_t *x)
{
    size_t       j = x->i, o = 0;
    int          isf = 0;
    char         tmp[128];
    tj_token_t  *t;

    while (j < x->n && ((x->s[j] >= '0' && x->s[j] <= '9')
                        || x->s[j] == '_'))
    {
        j++;
    }
    if (j + 1 < x->n && x->s[j] == '.' && x->s[j + 1] >= '0'
        && x->s[j + 1] <= '9')
    {
        isf = 1;
        j++;
        while (j < x->n && ((x->s[j] >= '0' && x->s[j] <= '9')
                            || x->s[j] == '_'))
        {
            j++;
        }
    }
    if (j < x->n && (x->s[j] == 'e' || x->s[j] == 'E')) {
        size_t e = j + 1;
        if (e < x->n && (x->s[e] == '+' || x->s[e] == '-')) {
            e++;
        }
        if (e < x->n && x->s[e] >= '0' && x->s[e] <= '9') {
            isf = 1;
            j = e;
            while (j < x->n && x->s[j] >= '0' && x->s[j] <= '9') {
                j++;
            }
        }
    }
    if (tj_lx_push(x, isf ? TK_FLOAT : TK_INT, x->s + x->i, j - x->i) != 0) {
        return -1;
    }
    t = &x->out->t[x->out->n - 1];
    for (size_t k = x->i; k < j && o < sizeof(tmp) - 1; k++) {
        if (x->s[k] != '_') {
            tmp[o++] = x->s[k];
        }
    }
    tmp[o] = '\0';
    if (isf) {
        t->f = strtod(tmp, NULL);
    } else {
        t->i = strtoll(tmp, NULL, 10);
        t->f = strtod(tmp, NULL);
    }
    x->i = j;
    return 0;
}


static const char *tj_ops2[] = { "**", "//", "==", "!=", "<=", ">=", NULL };
static const char tj_ops1[] = "+-*/%~<>=()[]{},.:|";


/* tokens inside {{ }} or {% %}, up to the end tag; end: '}' or '%' */
static int
tj_lx_tag(tj_lx_t *x, char end)
{
    int     bal = 0;
    size_t  k;
    char    c;

    for ( ;; ) {
        while (x->i < x->n && (x->s[x->i] == ' ' || x->s[x->i] == '\t'
                               || x->s[x->i] == '\n' || x->s[x->i] == '\r'))
        {
            if (x->s[x->i] == '\n') {
                x->line++;
            }
            x->i++;
        }
        if (x->i >= x->n) {
            return tj_lx_err(x, end == '}' ? "unexpected end of template, "
                             "expected '}}'" : "unexpected end of template, "
                             "expected '%}'");
        }
        c = x->s[x->i];

        /* the end tag: "-%}", "+%}", "%}" (or }}) when balanced */
        if (bal == 0) {
            size_t j = x->i;
            char ctl = 0;
            if ((c == '-' || c == '+') && j + 2 < x->n + 0
                && x->s[j + 1] == end && x->s[j + 2] == '}')
            {
                ctl = c;
                j++;
            }
            if (j + 1 < x->n && x->s[j] == end && x->s[j + 1] == '}'
                && (ctl != '+' || end == '%'))
            {
                if (tj_lx_push(x, end == '}' ? TK_VAR_END : TK_BLOCK_END,
                               NULL, 0) != 0)
                {
                    return -1;
                }
                x->i = j + 2;
                x->line_starting = 0;
                if (ctl == '-') {
                    k = tj_ws_prefix(x->s + x->i, x->n - x->i);
                    tj_lx_lines(x, x->s + x->i, k);
                    if (k) {
                        x->line_starting = x->s[x->i + k - 1] == '\n';
                    }
                    x->i += k;
                } else if (end == '%' && ctl != '+' && x->i < x->n
                           && x->s[x->i] == '\n')
                {
                    x->i++;
                    x->line++;
                    x->line_starting = 1;
                }
                return 0;
            }
        }

        if (c == '\'' || c == '"') {
            if (tj_lx_string(x) != 0) {
                return -1;
            }
            continue;
        }
        if (c >= '0' && c <= '9') {
            if (tj_lx_number(x) != 0) {
                return -1;
            }
            continue;
        }
        if (tj_is_name_start(c)) {
            k = x->i;
            while (k < x->n && tj_is_name_char(x->s[k])) {
                k++;
            }
            if (tj_lx_push(x, TK_NAME, x->s + x->i, k - x->i) != 0) {
                return -1;
            }
            x->i = k;
            continue;
        }
        for (k = 0; tj_ops2[k]; k++) {
            if (x->i + 1 < x->n && x->s[x->i] == tj_ops2[k][0]
                && x->s[x->i + 1] == tj_ops2[k][1])
            {
                break;
            }
        }
        if (tj_ops2[k]) {
            if (tj_lx_push(x, TK_OP, tj_ops2[k], 2) != 0) {
                return -1;
            }
            x->i += 2;
            continue;
        }
        if (c != '\0' && strchr(tj_ops1, c)) {
            if (c == '(' || c == '[' || c == '{') {
                bal++;
            } else if (c == ')' || c == ']' || c == '}') {
                if (bal == 0) {
                    return tj_lx_err(x, "unexpected closing bracket");
                }
                bal--;
            }
            if (tj_lx_push(x, TK_OP, strchr(tj_ops1, c), 1) != 0) {
                return -1;
            }
            x->i++;
            continue;
        }
        {
            char msg[64];
            snprintf(msg, sizeof(msg), "unexpected character '%c' (0x%02x)",
                     c >= 0x20 && c < 0x7f ? c : '?', (unsigned char) c);
            return tj_lx_err(x, msg);
        }
    }
}


/* "{% raw %}" at x->i (after "{%" and its control char): the text up to
 * "{% endraw %}" becomes one data token */
static int
tj_lx_raw(tj_lx_t *x, int *done)
{
    size_t       j = x->i, k;
    const char  *p, *e = x->s + x->n;
    char         ctl = 0;

    *done = 0;
    while (j < x->n && (x->s[j] == ' ' || x->s[j] == '\t' || x->s[j] == '\n')) {
        j++;
    }
    if (x->n - j < 3 || memcmp(x->s + j, "raw", 3) != 0
        || (j + 3 < x->n && tj_is_name_char(x->s[j + 3])))
    {
        return 0;
    }
    j += 3;
    while (j < x->n && (x->s[j] == ' ' || x->s[j] == '\t' || x->s[j] == '\n')) {
        j++;
    }
    if (j < x->n && (x->s[j] == '-' || x->s[j] == '+')) {
        ctl = x->s[j++];
    }
    if (x->n - j < 2 || x->s[j] != '%' || x->s[j + 1] != '}') {
        return 0;
    }
    j += 2;
    if (ctl == '-') {
        j += tj_ws_prefix(x->s + j, x->n - j);
    } else if (ctl != '+' && j < x->n && x->s[j] == '\n') {
        j++;
    }
    for (p = x->s + j; (p = memmem(p, (size_t) (e - p), "{%", 2)); p += 2) {
        const char *q = p + 2;
        char c2 = 0;
        if (q < e && (*q == '-' || *q == '+')) {
            c2 = *q++;
        }
        while (q < e && (*q == ' ' || *q == '\t' || *q == '\n')) {
            q++;
        }
        if (e - q < 6 || memcmp(q, "endraw", 6) != 0) {
            continue;
        }
        q += 6;
        while (q < e && (*q == ' ' || *q == '\t' || *q == '\n')) {
            q++;
        }
        ctl = 0;
        if (q < e && (*q == '-' || *q == '+')) {
            ctl = *q++;
        }
        if (e - q < 2 || q[0] != '%' || q[1] != '}') {
            continue;
        }
        k = (size_t) (p - (x->s + j));
        if (c2 == '-') {
            k -= tj_ws_suffix(x->s + j, k);
        }
        if (k && tj_lx_push(x, TK_DATA, x->s + j, k) != 0) {
            return -1;
        }
        tj_lx_lines(x, x->s + x->i, (size_t) (q - (x->s + x->i)));
        x->i = (size_t) (q + 2 - x->s);
        x->line_starting = 0;
        if (ctl == '-') {
            k = tj_ws_prefix(x->s + x->i, x->n - x->i);
            tj_lx_lines(x, x->s + x->i, k);
            x->i += k;
        } else if (ctl != '+' && x->i < x->n && x->s[x->i] == '\n') {
            x->i++;
            x->line++;
            x->line_starting = 1;
        }
        *done = 1;
        return 0;
    }
    return tj_lx_err(x, "missing {% endraw %}");
}


int
tj_lex(tj_arena_t *a, const char *src, size_t len, tj_tokens_t *out,
    char *err, size_t errlen)
{
    tj_lx_t      x;
    char        *norm;
    size_t       i, o = 0, start;
    const char  *p;
    int          raw;

    /* newlines normalised, one trailing newline dropped */
    norm = tj_arena_alloc(a, len + 1);
    if (norm == NULL) {
        tok_err(err, errlen, "chat template: out of memory");
        return -1;
    }
    for (i = 0; i < len; i++) {
        if (src[i] == '\r') {
            norm[o++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') {
                i++;
            }
        } else {
            norm[o++] = src[i];
        }
    }
    if (o && norm[o - 1] == '\n') {
        o--;
    }
    norm[o] = '\0';

    memset(&x, 0, sizeof(x));
    x.a = a;
    x.s = norm;
    x.n = o;
    x.line = 1;
    x.out = out;
    x.err = err;
    x.errlen = errlen;
    x.line_starting = 1;

    while (x.i < x.n) {
        start = x.i;
        p = x.s + x.i;
        for ( ;; ) {
            p = memchr(p, '{', (size_t) (x.s + x.n - p));
            if (p == NULL || p + 1 >= x.s + x.n) {
                p = NULL;
                break;
            }
            if (p[1] == '{' || p[1] == '%' || p[1] == '#') {
                break;
            }
            p++;
        }
        if (p == NULL) {
            if (tj_lx_push(&x, TK_DATA, x.s + start, x.n - start) != 0) {
                return -1;
            }
            break;
        }
        {
            char m = p[1];
            char ctl = (p + 2 < x.s + x.n && (p[2] == '-' || p[2] == '+'))
                       ? p[2] : 0;
            if (m == '{' && ctl == '+') {
                ctl = 0;
            }
            if (tj_lx_data(&x, x.s + start, (size_t) (p - (x.s + start)), m,
                           ctl) != 0)
            {
                return -1;
            }
            tj_lx_lines(&x, x.s + start, (size_t) (p - (x.s + start)));
            x.i = (size_t) (p - x.s) + 2 + (ctl ? 1 : 0);
            x.line_starting = 0;

            if (m == '#') {
                const char *e = memmem(x.s + x.i, x.n - x.i, "#}", 2);
                if (e == NULL) {
                    return tj_lx_err(&x, "missing end of comment tag");
                }
                tj_lx_lines(&x, x.s + x.i, (size_t) (e - (x.s + x.i)));
                ctl = (e > x.s + x.i && (e[-1] == '-' || e[-1] == '+'))
                      ? e[-1] : 0;
                x.i = (size_t) (e - x.s) + 2;
                if (ctl == '-') {
                    size_t k = tj_ws_prefix(x.s + x.i, x.n - x.i);
                    tj_lx_lines(&x, x.s + x.i, k);
                    if (k) {
                        x.line_starting = x.s[x.i + k - 1] == '\n';
                    }
                    x.i += k;
                } else if (ctl != '+' && x.i < x.n && x.s[x.i] == '\n') {
                    x.i++;
                    x.line++;
                    x.line_starting = 1;
                }
                continue;
            }
            if (m == '%') {
                if (tj_lx_raw(&x, &raw) != 0) {
                    return -1;
                }
                if (raw) {
                    continue;
                }
            }
            if (tj_lx_push(&x, m == '{' ? TK_VAR_BEGIN : TK_BLOCK_BEGIN,
                           NULL, 0) != 0
                || tj_lx_tag(&x, m == '{' ? '}' : '%') != 0)
            {
                return -1;
            }
        }
    }
    return tj_lx_push(&x, TK_EOF, NULL, 0);
}
