/*
 * Pre-tokenizers: Split (regex or literal, five delimiter behaviours,
 * invert), ByteLevel (prefix space, GPT-2 regex) and Digits, applied in
 * sequence; every final piece goes to the BPE model.
 *
 * Hugging Face compiles its regexes with Oniguruma, where \s is the Unicode
 * White_Space property.  pcre2's \s with UCP also takes U+180E, so \s and
 * \S are rewritten to the explicit White_Space set before compiling.
 * The shipped models' patterns skip pcre2 (tok_pretok_fast.c).
 */

#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "tok_internal.h"

#define TOK_WS_SET "\\t-\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}" \
                   "\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"


/* Rewrite \s and \S to the White_Space set; returns a malloc'ed pattern. */
static char *
tok_regex_rewrite(const char *p, size_t len, size_t *outlen)
{
    size_t   cap = len * 4 + 256, o = 0, i;
    size_t   ws = sizeof(TOK_WS_SET) - 1;
    int      in_class = 0;
    char    *out = malloc(cap);

    if (out == NULL) {
        return NULL;
    }
    for (i = 0; i < len; i++) {
        if (o + ws + 8 >= cap) {
            char *n = realloc(out, cap * 2);
            if (n == NULL) {
                free(out);
                return NULL;
            }
            out = n;
            cap *= 2;
        }
        if (p[i] == '\\' && i + 1 < len) {
            char c = p[i + 1];
            if (c == 's' && in_class) {
                memcpy(out + o, TOK_WS_SET, ws);
                o += ws;
            } else if (c == 's' || (c == 'S' && !in_class)) {
                out[o++] = '[';
                if (c == 'S') {
                    out[o++] = '^';
                }
                memcpy(out + o, TOK_WS_SET, ws);
                o += ws;
                out[o++] = ']';
            } else {
                out[o++] = p[i];
                out[o++] = c;
            }
            i++;
            continue;
        }
        if (!in_class && p[i] == '[') {
            in_class = 1;
            out[o++] = p[i];
            /* a ']' right after '[' or '[^' is a literal */
            if (i + 1 < len && p[i + 1] == '^') {
                out[o++] = p[++i];
            }
            if (i + 1 < len && p[i + 1] == ']') {
                out[o++] = p[++i];
            }
            continue;
        }
        if (in_class && p[i] == ']') {
            in_class = 0;
        }
        out[o++] = p[i];
    }
    *outlen = o;
    return out;
}


pcre2_code *
tok_regex_compile(const char *pattern, size_t len, int literal, char *err,
    size_t errlen)
{
    pcre2_code  *re;
    int          rc;
    PCRE2_SIZE   eoff;
    PCRE2_UCHAR  msg[256];
    char        *pat = NULL;
    size_t       plen = len;
    uint32_t     opts = PCRE2_UTF | PCRE2_UCP;

    if (literal) {
        opts = PCRE2_UTF | PCRE2_LITERAL;     /* UCP is refused with it */
    } else {
        pat = tok_regex_rewrite(pattern, len, &plen);
        if (pat == NULL) {
            tok_err(err, errlen, "out of memory");
            return NULL;
        }
    }
    re = pcre2_compile((PCRE2_SPTR) (pat ? pat : pattern), plen, opts, &rc,
                       &eoff, NULL);
    free(pat);
    if (re == NULL) {
        pcre2_get_error_message(rc, msg, sizeof(msg));
        tok_err(err, errlen, "bad regex: %s", (char *) msg);
        return NULL;
    }
    /* JIT is an optimisation: without it pcre2_match interprets */
    (void) pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    return re;
}


/* ---- delimiter behaviours, streamed over (start, end, is_match) items */

typedef struct {
    tok_work_t  *w;
    int          stage;
    const char  *s;
    int          behavior;
    int          have;          /* a pending piece */
    size_t       ps, pe;        /* pending piece */
    int          pmatch;        /* pending piece is a (merged-next) match */
    int          prev_match;
    int          at_start;      /* the piece split starts the input */
} tok_splitter_t;


static void
tok_split_emit(tok_splitter_t *sp, size_t a, size_t b)
{
    if (b > a) {
        sp->w->at_start = sp->at_start && a == 0;
        tok_pretokenize(sp->w, sp->stage + 1, sp->s + a, b - a);
    }
}


/* Emit the pending piece, if any, and hold [a, b) as the new one. */
static void
tok_split_hold(tok_splitter_t *sp, size_t a, size_t b)
{
    if (sp->have) {
        tok_split_emit(sp, sp->ps, sp->pe);
    }
    sp->have = 1;
    sp->ps = a;
    sp->pe = b;
}


static void
tok_split_item(tok_splitter_t *sp, size_t a, size_t b, int m)
{
    switch (sp->behavior) {
    case TOK_SPLIT_REMOVED:
        if (!m) {
            tok_split_emit(sp, a, b);
        }
        break;

    case TOK_SPLIT_ISOLATED:
        tok_split_emit(sp, a, b);
        break;

    case TOK_SPLIT_MERGED_PREV:
        if (m && !sp->prev_match && sp->have) {
            sp->pe = b;
        } else {
            tok_split_hold(sp, a, b);
        }
        sp->prev_match = m;
        break;

    case TOK_SPLIT_MERGED_NEXT:
        /* a match joins the piece after it unless that one is a match */
        if (sp->have && sp->pmatch && !m) {
            tok_split_emit(sp, sp->ps, b);
            sp->have = 0;
            break;
        }
        tok_split_hold(sp, a, b);
        sp->pmatch = m;
        break;

    case TOK_SPLIT_CONTIGUOUS:
        if (sp->have && m == sp->prev_match) {
            sp->pe = b;
        } else {
            tok_split_hold(sp, a, b);
        }
        sp->prev_match = m;
        break;
    }
}


static void
tok_split_finish(tok_splitter_t *sp)
{
    if (sp->have) {
        tok_split_emit(sp, sp->ps, sp->pe);
        sp->have = 0;
    }
}


/* The default JIT stack (32 KiB) can run out on pathological pre-tokens:
 * give this call a larger one and retry. */
static int
tok_work_jit_stack(tok_work_t *w)
{
    w->jstack = pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, NULL);
    w->mctx = pcre2_match_context_create(NULL);
    if (w->jstack == NULL || w->mctx == NULL) {
        return -1;
    }
    pcre2_jit_stack_assign(w->mctx, NULL, w->jstack);
    return 0;
}


/* A hand-written matcher: it matches at every position, never empty. */
static void
tok_split_fast(tok_work_t *w, int stage, int fast, int behavior, int invert,
    const char *s, size_t len)
{
    tok_splitter_t    sp;
    size_t            at, me;
    int               top = w->at_start, direct;
    const tok_pre_t  *nx = &w->tok->pre[stage + 1];

    if (behavior == TOK_SPLIT_ISOLATED) {
        /* straight to BPE when what is left is nothing or a ByteLevel
         * that only maps bytes (the shipped models) */
        direct = stage + 1 == w->tok->n_pre
                 || (stage + 2 == w->tok->n_pre
                     && nx->kind == TOK_PRE_BYTELEVEL
                     && !nx->add_prefix_space && nx->re == NULL);
        /* every match is a piece */
        if (direct) {
            tok_pretok_fast_bpe(w, fast, s, len, top);
            return;
        }
        for (at = 0; at < len && !w->oom; at = me) {
            me = tok_pretok_fast_next(fast, s, len, at);
            w->at_start = top && at == 0;
            tok_pretokenize(w, stage + 1, s + at, me - at);
        }
        return;
    }
    memset(&sp, 0, sizeof(sp));
    sp.w = w;
    sp.stage = stage;
    sp.s = s;
    sp.at_start = w->at_start;
    sp.behavior = behavior;
    for (at = 0; at < len; at = me) {
        me = tok_pretok_fast_next(fast, s, len, at);
        tok_split_item(&sp, at, me, !invert);
    }
    tok_split_finish(&sp);
}


static void
tok_split_regex(tok_work_t *w, int stage, const pcre2_code *re,
    int behavior, int invert, const char *s, size_t len)
{
    tok_splitter_t  sp;
    PCRE2_SIZE     *ov;
    size_t          prev = 0, at = 0, ms, me;
    int             rc;
    uint32_t        cp;

    memset(&sp, 0, sizeof(sp));
    sp.w = w;
    sp.stage = stage;
    sp.s = s;
    sp.at_start = w->at_start;
    sp.behavior = behavior;

    if (tok_work_md(w) == NULL) {
        return;
    }
    ov = pcre2_get_ovector_pointer(w->md);
    while (at <= len) {
        rc = pcre2_match(re, (PCRE2_SPTR) s, len, at, PCRE2_NO_UTF_CHECK,
                         w->md, w->mctx);
        if (rc == PCRE2_ERROR_NOMATCH) {
            break;
        }
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT && w->mctx == NULL) {
            if (tok_work_jit_stack(w) == 0) {
                continue;
            }
        }
        if (rc < 0) {
            w->oom = 1;
            return;
        }
        ms = ov[0];
        me = ov[1];
        if (prev != ms) {
            tok_split_item(&sp, prev, ms, invert);
        }
        tok_split_item(&sp, ms, me, !invert);
        prev = me;
        if (me == ms) {
            /* empty match: step over one character */
            if (me >= len) {
                break;
            }
            at = me + tok_utf8_decode(s + me, len - me, &cp);
        } else {
            at = me;
        }
    }
    if (prev != len) {
        tok_split_item(&sp, prev, len, invert);
    }
    tok_split_finish(&sp);
}


static int
tok_is_numeric_at(const char *s, size_t len, size_t *n)
{
    uint32_t  cp;
    int       c;

    *n = tok_utf8_decode(s, len, &cp);
    if (cp < 0x80) {
        return cp >= '0' && cp <= '9';
    }
    c = utf8proc_category((utf8proc_int32_t) cp);
    return c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL
           || c == UTF8PROC_CATEGORY_NO;
}


/* Digits: each numeric char is a match, the runs between are gaps */
static void
tok_split_digits(tok_work_t *w, int stage, int individual, const char *s,
    size_t len)
{
    tok_splitter_t  sp;
    size_t          i = 0, n, last = 0;

    memset(&sp, 0, sizeof(sp));
    sp.w = w;
    sp.stage = stage;
    sp.s = s;
    sp.at_start = w->at_start;
    sp.behavior = individual ? TOK_SPLIT_ISOLATED : TOK_SPLIT_CONTIGUOUS;

    while (i < len) {
        if (tok_is_numeric_at(s + i, len - i, &n)) {
            if (last < i) {
                tok_split_item(&sp, last, i, 0);
            }
            tok_split_item(&sp, i, i + n, 1);
            last = i + n;
        }
        i += n;
    }
    if (last < len) {
        tok_split_item(&sp, last, len, 0);
    }
    tok_split_finish(&sp);
}


/*
 * Metaspace: every ' ' becomes the replacement; the replacement is put
 * before a piece that does not start with it (always, or only on the piece
 * at the start of the input: first); with split, each replacement starts a
 * new piece (MergedWithNext).
 */
static void
tok_metaspace(tok_work_t *w, int stage, const tok_pre_t *p, const char *s,
    size_t len)
{
    tok_splitter_t  sp;
    char            small[512], *buf, *o;
    size_t          i, n, cap, last;
    int             pre;

    pre = p->scheme == TOK_PREPEND_ALWAYS
          || (p->scheme == TOK_PREPEND_FIRST && w->at_start);
    /* after the replacement: does it start with one? */
    if (pre) {
        pre = s[0] == ' ' ? 0
              : !(len >= p->rep_len && memcmp(s, p->rep, p->rep_len) == 0);
    }
    cap = (len + 1) * p->rep_len;
    buf = cap <= sizeof(small) ? small : malloc(cap);
    if (buf == NULL) {
        w->oom = 1;
        return;
    }
    o = buf;
    if (pre) {
        memcpy(o, p->rep, p->rep_len);
        o += p->rep_len;
    }
    for (i = 0; i < len; i++) {
        if (s[i] == ' ') {
            memcpy(o, p->rep, p->rep_len);
            o += p->rep_len;
        } else {
            *o++ = s[i];
        }
    }
    n = (size_t) (o - buf);

    if (!p->split) {
        tok_pretokenize(w, stage + 1, buf, n);
    } else {
        memset(&sp, 0, sizeof(sp));
        sp.w = w;
        sp.stage = stage;
        sp.s = buf;
        sp.behavior = TOK_SPLIT_MERGED_NEXT;
        sp.at_start = w->at_start;
        last = 0;
        for (i = 0; i + p->rep_len <= n; ) {
            if (memcmp(buf + i, p->rep, p->rep_len) == 0) {
                if (last < i) {
                    tok_split_item(&sp, last, i, 0);
                }
                tok_split_item(&sp, i, i + p->rep_len, 1);
                i += p->rep_len;
                last = i;
            } else {
                i++;
            }
        }
        if (last < n) {
            tok_split_item(&sp, last, n, 0);
        }
        tok_split_finish(&sp);
    }
    if (buf != small) {
        free(buf);
    }
}


void
tok_pretokenize(tok_work_t *w, int stage, const char *s, size_t len)
{
    const dpd_tok_t  *tok = w->tok;
    const tok_pre_t  *p;
    char              small[256], *buf;

    if (len == 0 || w->oom) {
        return;
    }
    if (stage >= tok->n_pre) {
        tok_bpe(w, s, len);
        return;
    }
    p = &tok->pre[stage];

    switch (p->kind) {
    case TOK_PRE_SPLIT:
        if (p->fast) {
            tok_split_fast(w, stage, p->fast, p->behavior, p->invert, s, len);
            return;
        }
        tok_split_regex(w, stage, p->re, p->behavior, p->invert, s, len);
        return;

    case TOK_PRE_DIGITS:
        tok_split_digits(w, stage, p->individual, s, len);
        return;

    case TOK_PRE_METASPACE:
        tok_metaspace(w, stage, p, s, len);
        return;

    case TOK_PRE_BYTELEVEL:
        if (p->add_prefix_space && s[0] != ' ') {
            buf = len + 1 <= sizeof(small) ? small : malloc(len + 1);
            if (buf == NULL) {
                w->oom = 1;
                return;
            }
            buf[0] = ' ';
            memcpy(buf + 1, s, len);
            if (p->fast) {
                tok_split_fast(w, stage, p->fast, TOK_SPLIT_ISOLATED, 0, buf,
                               len + 1);
            } else if (p->re) {
                tok_split_regex(w, stage, p->re, TOK_SPLIT_ISOLATED, 0, buf,
                                len + 1);
            } else {
                tok_pretokenize(w, stage + 1, buf, len + 1);
            }
            if (buf != small) {
                free(buf);
            }
            return;
        }
        if (p->fast) {
            tok_split_fast(w, stage, p->fast, TOK_SPLIT_ISOLATED, 0, s, len);
        } else if (p->re) {
            tok_split_regex(w, stage, p->re, TOK_SPLIT_ISOLATED, 0, s, len);
        } else {
            tok_pretokenize(w, stage + 1, s, len);
        }
        return;
    }
}
