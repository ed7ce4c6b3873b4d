/*
 * The fast load path: model.vocab and model.merges (nearly all of a
 * tokenizer.json) are read from the text, with no parse tree, and cJSON
 * parses only the rest of the document, with those two values replaced by
 * {} and [].  One scan checks the document and records where each
 * vocabulary key (with its id) and merge string is; tok_load.c then fills
 * the tables from those positions with the same per-entry code as for a
 * cJSON tree.
 *
 * tok_fast_scan() first checks the whole document against a strict JSON
 * grammar that is a subset of what cJSON accepts (whitespace is space, tab,
 * CR, LF only; no control bytes in strings; no \u0000, no lone surrogates,
 * no escapes in the keys of the root and of model; numbers as RFC 8259,
 * at most 32 characters; nesting at most TOK_FAST_DEPTH), and the two values
 * against their usual form (vocab: a non-empty object of plain integer ids
 * below 2^31; merges: a non-empty array, all "a b" strings or all
 * ["a", "b"] pairs).  Anything else -- invalid, unusual or just rare --
 * makes the caller take the cJSON path for the whole file, so a file is
 * accepted or refused, with the same ids and the same message, either way.
 * For a document that passes, the members found are exactly the ones cJSON's
 * tree would give (the first "model" of the root, its first "vocab" and
 * first "merges"), and strings decode exactly as cJSON decodes them.
 */

#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

#define TOK_FAST_DEPTH    128
#define TOK_FAST_NUMLEN   32


/* 0: an ordinary string byte; 1: '"'; 2: '\\'; 3: a control byte */
static const unsigned char  tok_js_cls[256] = {
    3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3,
    3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3,
    0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0,
};


typedef struct {
    const unsigned char  *p, *end, *base;
    size_t                max_str;  /* longest raw string in vocab/merges */
} tok_js_t;


/* where a string's text is: offset, length | TOK_FAST_ESC if escaped */
#define TOK_FAST_ESC  0x80000000u

static int
tok_fast_push(tok_fast_ent_t **arr, uint32_t n, uint32_t *cap)
{
    tok_fast_ent_t  *p;

    if (n < *cap) {
        return 0;
    }
    if (*cap >= (1u << 30)) {
        return -1;
    }
    p = realloc(*arr, (size_t) (*cap ? *cap * 2 : 4096)
                      * sizeof(tok_fast_ent_t));
    if (p == NULL) {
        return -1;
    }
    *arr = p;
    *cap = *cap ? *cap * 2 : 4096;
    return 0;
}


/* pretty-printed files indent every entry: four spaces at a time */
static inline void
tok_js_ws(tok_js_t *s)
{
    const unsigned char  *p = s->p, *end = s->end;
    uint32_t              w;

    if (p < end && *p > ' ') {
        return;     /* the usual case between tokens */
    }
    while (p < end) {
        if (*p == ' ') {
            if (end - p >= 4) {
                memcpy(&w, p, 4);
                if (w == 0x20202020u) {
                    p += 4;
                    continue;
                }
            }
            p++;
        } else if (*p == '\n' || *p == '\r' || *p == '\t') {
            p++;
        } else {
            break;
        }
    }
    s->p = p;
}


static int
tok_js_hex4(const unsigned char *p, unsigned *v)
{
    unsigned  i, c, x = 0;

    for (i = 0; i < 4; i++) {
        c = p[i];
        if (c >= '0' && c <= '9') {
            c -= '0';
        } else if ((c | 0x20) >= 'a' && (c | 0x20) <= 'f') {
            c = (c | 0x20) - 'a' + 10;
        } else {
            return -1;
        }
        x = x << 4 | c;
    }
    *v = x;
    return 0;
}


/*
 * A string at s->p (a '"'); on success s->p is past it, *raw and *rawlen
 * give the text between the quotes, *esc whether it holds an escape.
 */
static int
tok_js_string(tok_js_t *s, const char **raw, size_t *rawlen, int *esc)
{
    const unsigned char  *p = s->p + 1, *end = s->end;
    unsigned              u, u2;

    *esc = 0;
    for ( ;; ) {
        while (p < end && tok_js_cls[*p] == 0) {
            p++;
        }
        if (p == end || *p < 0x20) {
            return -1;
        }
        if (*p == '"') {
            break;
        }
        /* a backslash */
        *esc = 1;
        if (end - p < 2) {
            return -1;
        }
        switch (p[1]) {
        case '"': case '\\': case '/': case 'b': case 'f': case 'n':
        case 'r': case 't':
            p += 2;
            continue;
        case 'u':
            break;
        default:
            return -1;
        }
        if (end - p < 6 || tok_js_hex4(p + 2, &u) != 0 || u == 0
            || (u >= 0xDC00 && u <= 0xDFFF))
        {
            return -1;
        }
        if (u >= 0xD800 && u <= 0xDBFF) {
            if (end - p < 12 || p[6] != '\\' || p[7] != 'u'
                || tok_js_hex4(p + 8, &u2) != 0 || u2 < 0xDC00 || u2 > 0xDFFF)
            {
                return -1;
            }
            p += 12;
        } else {
            p += 6;
        }
    }
    *raw = (const char *) s->p + 1;
    *rawlen = (size_t) (p - s->p - 1);
    s->p = p + 1;
    return 0;
}


/* An RFC 8259 number */
static int
tok_js_number(tok_js_t *s)
{
    const unsigned char  *p = s->p, *end = s->end, *start = s->p;

    if (p < end && *p == '-') {
        p++;
    }
    if (p == end || *p < '0' || *p > '9') {
        return -1;
    }
    if (*p == '0') {
        p++;
    } else {
        while (p < end && *p >= '0' && *p <= '9') {
            p++;
        }
    }
    if (p < end && *p == '.') {
        p++;
        if (p == end || *p < '0' || *p > '9') {
            return -1;
        }
        while (p < end && *p >= '0' && *p <= '9') {
            p++;
        }
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < end && (*p == '+' || *p == '-')) {
            p++;
        }
        if (p == end || *p < '0' || *p > '9') {
            return -1;
        }
        while (p < end && *p >= '0' && *p <= '9') {
            p++;
        }
    }
    /* cJSON 1.7.15 reads at most 63 characters of a number */
    if (p - start > TOK_FAST_NUMLEN) {
        return -1;
    }
    s->p = p;
    return 0;
}


/* A vocabulary id: 0 or [1-9][0-9]* below 2^31, then no '.', 'e', 'E' */
static int
tok_js_id(tok_js_t *s, uint32_t *id)
{
    const unsigned char  *p = s->p, *end = s->end;
    uint64_t              v;

    if (p == end || *p < '0' || *p > '9') {
        return -1;
    }
    v = (uint64_t) (*p++ - '0');
    if (v != 0) {
        while (p < end && *p >= '0' && *p <= '9' && p - s->p < 11) {
            v = v * 10 + (uint64_t) (*p++ - '0');
        }
    }
    if (v >= 2147483648u
        || (p < end && ((*p >= '0' && *p <= '9') || *p == '.' || *p == 'e'
                        || *p == 'E')))
    {
        return -1;      /* the cJSON path decides */
    }
    *id = (uint32_t) v;
    s->p = p;
    return 0;
}


static int
tok_js_lit(tok_js_t *s, const char *lit, size_t n)
{
    if ((size_t) (s->end - s->p) < n || memcmp(s->p, lit, n) != 0) {
        return -1;
    }
    s->p += n;
    return 0;
}


static int tok_js_value(tok_js_t *s, int depth);


/* after a member or element: 1 = another follows, 0 = the closer, -1 */
static int
tok_js_next(tok_js_t *s, unsigned char closer)
{
    tok_js_ws(s);
    if (s->p < s->end && *s->p == ',') {
        s->p++;
        tok_js_ws(s);
        return 1;
    }
    if (s->p < s->end && *s->p == closer) {
        s->p++;
        return 0;
    }
    return -1;
}


static int
tok_js_value(tok_js_t *s, int depth)
{
    const char  *raw;
    size_t       rawlen;
    int          esc, rc;

    if (s->p == s->end || depth > TOK_FAST_DEPTH) {
        return -1;
    }
    switch (*s->p) {
    case '"':
        return tok_js_string(s, &raw, &rawlen, &esc);
    case 't':
        return tok_js_lit(s, "true", 4);
    case 'f':
        return tok_js_lit(s, "false", 5);
    case 'n':
        return tok_js_lit(s, "null", 4);
    case '[':
        s->p++;
        tok_js_ws(s);
        if (s->p < s->end && *s->p == ']') {
            s->p++;
            return 0;
        }
        do {
            if (tok_js_value(s, depth + 1) != 0) {
                return -1;
            }
        } while ((rc = tok_js_next(s, ']')) == 1);
        return rc;
    case '{':
        s->p++;
        tok_js_ws(s);
        if (s->p < s->end && *s->p == '}') {
            s->p++;
            return 0;
        }
        do {
            if (s->p == s->end || *s->p != '"'
                || tok_js_string(s, &raw, &rawlen, &esc) != 0)
            {
                return -1;
            }
            tok_js_ws(s);
            if (s->p == s->end || *s->p != ':') {
                return -1;
            }
            s->p++;
            tok_js_ws(s);
            if (tok_js_value(s, depth + 1) != 0) {
                return -1;
            }
        } while ((rc = tok_js_next(s, '}')) == 1);
        return rc;
    default:
        return tok_js_number(s);
    }
}


/* model.vocab: {"token": id, ...}, at least one member */
static int
tok_js_vocab(tok_js_t *s, tok_fast_t *f)
{
    const char      *raw;
    size_t           rawlen;
    int              esc, rc;
    uint32_t         id, n = 0, cap = 0;
    tok_fast_ent_t  *e;

    if (s->p == s->end || *s->p != '{') {
        return -1;
    }
    s->p++;
    tok_js_ws(s);
    do {
        if (s->p == s->end || *s->p != '"'
            || tok_js_string(s, &raw, &rawlen, &esc) != 0)
        {
            return -1;
        }
        if (rawlen > s->max_str) {
            s->max_str = rawlen;
        }
        tok_js_ws(s);
        if (s->p == s->end || *s->p != ':') {
            return -1;
        }
        s->p++;
        tok_js_ws(s);
        if (tok_js_id(s, &id) != 0
            || tok_fast_push(&f->vocab_ent, n, &cap) != 0)
        {
            return -1;
        }
        e = &f->vocab_ent[n++];
        e->off = (uint32_t) ((const unsigned char *) raw - s->base);
        e->len = (uint32_t) rawlen | (esc ? TOK_FAST_ESC : 0);
        e->off2 = id;
        e->len2 = 0;
    } while ((rc = tok_js_next(s, '}')) == 1);
    f->n_vocab = n;
    return rc;
}


/* model.merges: ["a b", ...] or [["a", "b"], ...], at least one */
static int
tok_js_merges(tok_js_t *s, tok_fast_t *f)
{
    const char      *ra, *rb = NULL;
    size_t           la, lb = 0, len;
    int              ea, eb = 0, rc;
    uint32_t         n = 0, cap = 0;
    tok_fast_ent_t  *e;

    if (s->p == s->end || *s->p != '[') {
        return -1;
    }
    s->p++;
    tok_js_ws(s);
    if (s->p == s->end) {
        return -1;
    }
    f->pairs = *s->p == '[';
    do {
        if (s->p == s->end) {
            return -1;
        }
        if (!f->pairs) {
            if (*s->p != '"' || tok_js_string(s, &ra, &la, &ea) != 0) {
                return -1;
            }
            len = la;
        } else {
            if (*s->p != '[') {
                return -1;
            }
            s->p++;
            tok_js_ws(s);
            if (s->p == s->end || *s->p != '"'
                || tok_js_string(s, &ra, &la, &ea) != 0
                || tok_js_next(s, ']') != 1
                || s->p == s->end || *s->p != '"'
                || tok_js_string(s, &rb, &lb, &eb) != 0
                || tok_js_next(s, ']') != 0)
            {
                return -1;
            }
            if (lb > s->max_str) {
                s->max_str = lb;
            }
            len = la + lb + 1;
        }
        if (la > s->max_str) {
            s->max_str = la;
        }
        if (len > f->merge_max) {
            f->merge_max = len;
        }
        if (tok_fast_push(&f->merges_ent, n, &cap) != 0) {
            return -1;
        }
        e = &f->merges_ent[n++];
        e->off = (uint32_t) ((const unsigned char *) ra - s->base);
        e->len = (uint32_t) la | (ea ? TOK_FAST_ESC : 0);
        e->off2 = rb ? (uint32_t) ((const unsigned char *) rb - s->base) : 0;
        e->len2 = (uint32_t) lb | (eb ? TOK_FAST_ESC : 0);
    } while ((rc = tok_js_next(s, ']')) == 1);
    f->n_merges = n;
    return rc;
}


static int
tok_js_key_is(const char *raw, size_t len, const char *name)
{
    return len == strlen(name) && memcmp(raw, name, len) == 0;
}


/* the first "model" of the root: find its first "vocab" and "merges" */
static int
tok_js_model(tok_js_t *s, tok_fast_t *f)
{
    const unsigned char  *start;
    const char           *raw;
    size_t                rawlen;
    int                   esc, rc;

    if (s->p == s->end || *s->p != '{') {
        return -1;
    }
    s->p++;
    tok_js_ws(s);
    if (s->p < s->end && *s->p == '}') {
        return -1;      /* no vocab: the cJSON path says so */
    }
    do {
        if (s->p == s->end || *s->p != '"'
            || tok_js_string(s, &raw, &rawlen, &esc) != 0 || esc)
        {
            return -1;
        }
        tok_js_ws(s);
        if (s->p == s->end || *s->p != ':') {
            return -1;
        }
        s->p++;
        tok_js_ws(s);
        start = s->p;
        if (f->vocab == NULL && tok_js_key_is(raw, rawlen, "vocab")) {
            if (tok_js_vocab(s, f) != 0) {
                return -1;
            }
            f->vocab = (const char *) start;
            f->vocab_len = (size_t) (s->p - start);
        } else if (f->merges == NULL && tok_js_key_is(raw, rawlen, "merges")) {
            if (tok_js_merges(s, f) != 0) {
                return -1;
            }
            f->merges = (const char *) start;
            f->merges_len = (size_t) (s->p - start);
        } else if (tok_js_value(s, 2) != 0) {
            return -1;
        }
    } while ((rc = tok_js_next(s, '}')) == 1);
    return rc;
}


static int tok_fast_scan_doc(const char *buf, size_t len, tok_fast_t *f);


void
tok_fast_free(tok_fast_t *f)
{
    free(f->vocab_ent);
    free(f->merges_ent);
    f->vocab_ent = f->merges_ent = NULL;
}


/* 0: the fast path can load the file (then tok_fast_free() it); -1 not */
int
tok_fast_scan(const char *buf, size_t len, tok_fast_t *f)
{
    if (tok_fast_scan_doc(buf, len, f) != 0) {
        tok_fast_free(f);
        return -1;
    }
    return 0;
}


static int
tok_fast_scan_doc(const char *buf, size_t len, tok_fast_t *f)
{
    tok_js_t     s;
    const char  *raw;
    size_t       rawlen;
    int          esc, rc, seen_model = 0;

    memset(f, 0, sizeof(*f));
    s.p = (const unsigned char *) buf;
    s.base = s.p;
    s.end = s.p + len;
    s.max_str = 0;
    if (len >= TOK_FAST_ESC) {
        return -1;      /* offsets and lengths are 31 bits */
    }

    tok_js_ws(&s);
    if (s.p == s.end || *s.p != '{') {
        return -1;
    }
    s.p++;
    tok_js_ws(&s);
    if (s.p < s.end && *s.p == '}') {
        return -1;
    }
    do {
        if (s.p == s.end || *s.p != '"'
            || tok_js_string(&s, &raw, &rawlen, &esc) != 0 || esc)
        {
            return -1;
        }
        tok_js_ws(&s);
        if (s.p == s.end || *s.p != ':') {
            return -1;
        }
        s.p++;
        tok_js_ws(&s);
        if (!seen_model && tok_js_key_is(raw, rawlen, "model")) {
            seen_model = 1;
            if (tok_js_model(&s, f) != 0) {
                return -1;
            }
        } else if (tok_js_value(&s, 1) != 0) {
            return -1;
        }
    } while ((rc = tok_js_next(&s, '}')) == 1);
    if (rc != 0) {
        return -1;
    }
    tok_js_ws(&s);
    if (s.p != s.end || f->vocab == NULL || f->merges == NULL) {
        return -1;
    }
    f->max_str = s.max_str;
    f->base = buf;
    return 0;
}


/* The document with model.vocab as {} and model.merges as [] (malloc'd). */
char *
tok_fast_rest(const char *buf, size_t len, const tok_fast_t *f,
    size_t *outlen)
{
    const char  *a = f->vocab, *b = f->merges;
    size_t       al = f->vocab_len, bl = f->merges_len;
    const char  *ar = "{}", *br = "[]";
    char        *out, *o;

    if (a > b) {
        a = f->merges; al = f->merges_len; ar = "[]";
        b = f->vocab; bl = f->vocab_len; br = "{}";
    }
    out = malloc(len - al - bl + 5);
    if (out == NULL) {
        return NULL;
    }
    o = out;
    memcpy(o, buf, (size_t) (a - buf));
    o += a - buf;
    memcpy(o, ar, 2);
    o += 2;
    memcpy(o, a + al, (size_t) (b - (a + al)));
    o += b - (a + al);
    memcpy(o, br, 2);
    o += 2;
    memcpy(o, b + bl, (size_t) (buf + len - (b + bl)));
    o += buf + len - (b + bl);
    *o = '\0';
    *outlen = (size_t) (o - out);
    return out;
}


/* ---- reading the checked values */

/* A string's text, decoded into dec when escaped (as cJSON decodes it). */
static void
tok_fast_str(const char *base, uint32_t off, uint32_t len, char *dec,
    const char **s, size_t *slen)
{
    const unsigned char  *q = (const unsigned char *) base + off, *end;
    char                 *o = dec;
    unsigned              u = 0, u2 = 0;

    if (!(len & TOK_FAST_ESC)) {
        *s = (const char *) q;
        *slen = len;
        return;
    }
    end = q + (len & ~TOK_FAST_ESC);
    while (q < end) {
        if (*q != '\\') {
            *o++ = (char) *q++;
            continue;
        }
        switch (q[1]) {
        case 'b': *o++ = '\b'; q += 2; continue;
        case 'f': *o++ = '\f'; q += 2; continue;
        case 'n': *o++ = '\n'; q += 2; continue;
        case 'r': *o++ = '\r'; q += 2; continue;
        case 't': *o++ = '\t'; q += 2; continue;
        case 'u': break;
        default: *o++ = (char) q[1]; q += 2; continue;     /* " \ / */
        }
        (void) tok_js_hex4(q + 2, &u);
        if (u >= 0xD800 && u <= 0xDBFF) {
            (void) tok_js_hex4(q + 8, &u2);
            u = 0x10000 + (((u & 0x3FF) << 10) | (u2 & 0x3FF));
            q += 12;
        } else {
            q += 6;
        }
        o += tok_utf8_encode(u, o);
    }
    *s = dec;
    *slen = (size_t) (o - dec);
}


void
tok_fast_iter_init(tok_fast_iter_t *it, const tok_fast_t *f, char *dec_a,
    char *dec_b)
{
    it->f = f;
    it->i = 0;
    it->dec_a = dec_a;
    it->dec_b = dec_b;
}


/* The next vocab member; 0 at the end. */
int
tok_fast_vocab_next(tok_fast_iter_t *it, const char **key, size_t *klen,
    uint32_t *id)
{
    const tok_fast_ent_t  *e;

    if (it->i == it->f->n_vocab) {
        return 0;
    }
    e = &it->f->vocab_ent[it->i++];
    tok_fast_str(it->f->base, e->off, e->len, it->dec_a, key, klen);
    *id = e->off2;
    return 1;
}


/* The next merge: "a b" in *a (*b NULL), or ["a", "b"]; 0 at the end. */
int
tok_fast_merge_next(tok_fast_iter_t *it, const char **a, size_t *alen,
    const char **b, size_t *blen)
{
    const tok_fast_ent_t  *e;

    if (it->i == it->f->n_merges) {
        return 0;
    }
    e = &it->f->merges_ent[it->i++];
    tok_fast_str(it->f->base, e->off, e->len, it->dec_a, a, alen);
    if (it->f->pairs) {
        tok_fast_str(it->f->base, e->off2, e->len2, it->dec_b, b, blen);
    } else {
        *b = NULL;
        *blen = 0;
    }
    return 1;
}
