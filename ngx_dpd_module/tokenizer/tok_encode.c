/*
 * The encode pipeline, in Hugging Face's order:
 *   lossy UTF-8 -> split on added tokens that match the raw text ->
 *   normalize each remaining piece -> split on added tokens that match the
 *   normalized text -> pre-tokenize -> BPE -> post-processor specials.
 */

#include <limits.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "tok_internal.h"


static void tok_encode_normalized(tok_work_t *w, const char *s, size_t len);


static int
tok_ends_with_word(const char *s, size_t len)
{
    size_t    i = len;
    uint32_t  cp;

    if (len == 0) {
        return 0;
    }
    /* step back to the start of the last character */
    do {
        i--;
    } while (i > 0 && ((unsigned char) s[i] & 0xC0) == 0x80);
    tok_utf8_decode(s + i, len - i, &cp);
    return tok_is_word_char(cp);
}


static int
tok_starts_with_word(const char *s, size_t len)
{
    uint32_t  cp;

    if (len == 0) {
        return 0;
    }
    tok_utf8_decode(s, len, &cp);
    return tok_is_word_char(cp);
}


/* start of the run of White_Space that ends s[0..len) */
static size_t
tok_space_at_end(const char *s, size_t len)
{
    size_t    i = len, j;
    uint32_t  cp;

    while (i > 0) {
        j = i;
        do {
            j--;
        } while (j > 0 && ((unsigned char) s[j] & 0xC0) == 0x80);
        tok_utf8_decode(s + j, i - j, &cp);
        if (!tok_is_unicode_space(cp)) {
            break;
        }
        i = j;
    }
    return i;
}


/* length of the run of White_Space that starts s[0..len) */
static size_t
tok_space_at_start(const char *s, size_t len)
{
    size_t    i = 0, n;
    uint32_t  cp;

    while (i < len) {
        n = tok_utf8_decode(s + i, len - i, &cp);
        if (!tok_is_unicode_space(cp)) {
            break;
        }
        i += n;
    }
    return i;
}


/*
 * Split s on the added tokens of trie t (AddedVocabulary::find_matches):
 * pieces between tokens go to next(), tokens are emitted.  A candidate
 * rejected by single_word is skipped whole, as the Aho-Corasick iterator
 * continues after it.
 */
static void
tok_split_added(tok_work_t *w, const tok_trie_t *t, const char *s, size_t len,
    void (*next)(tok_work_t *, const char *, size_t))
{
    const dpd_tok_t    *tok = w->tok;
    const tok_added_t  *a;
    const char         *q;
    size_t              pos = 0, seg = 0, mlen = 0, start, stop, ns;
    int32_t             m;
    int                 top = w->at_start;

    if (t->empty) {
        next(w, s, len);
        return;
    }
    while (pos < len) {
        if (t->single >= 0) {
            q = memchr(s + pos, t->single, len - pos);
            if (q == NULL) {
                break;
            }
            pos = (size_t) (q - s);

        } else if (!t->first[(unsigned char) s[pos]]) {
            pos++;
            continue;
        }
        m = tok_trie_match(t, s + pos, len - pos, &mlen);
        if (m < 0) {
            pos++;
            continue;
        }
        a = &tok->added[m];
        start = pos;
        stop = pos + mlen;
        pos = stop;

        if (a->single_word) {
            if ((start > 0 && tok_ends_with_word(s, start))
                || (stop < len && tok_starts_with_word(s + stop, len - stop)))
            {
                continue;
            }
        }
        if (a->lstrip) {
            ns = tok_space_at_end(s, start);
            start = ns > seg ? ns : seg;
        }
        if (a->rstrip) {
            stop += tok_space_at_start(s + stop, len - stop);
        }
        if (seg < start) {
            w->at_start = top && seg == 0;
            next(w, s + seg, start - seg);
        }
        tok_emit(w->sink, a->id);
        seg = stop;
    }
    if (seg < len) {
        w->at_start = top && seg == 0;
        next(w, s + seg, len - seg);
    }
}


static void
tok_encode_pretok(tok_work_t *w, const char *s, size_t len)
{
    tok_pretokenize(w, 0, s, len);
}


static void
tok_encode_normalized(tok_work_t *w, const char *s, size_t len)
{
    tok_split_added(w, &w->tok->trie_norm, s, len, tok_encode_pretok);
}


/*
 * Can a normal form change this character or join it to its neighbours?
 * Yes if it has a decomposition, a non-zero combining class, can be the
 * second of a composition pair (Hangul V/T jamo included) or, for the
 * decomposing forms, is a Hangul syllable.  Every other character is a
 * boundary normalization never crosses: NFx(a + b) = NFx(a) + NFx(b) when
 * b starts with one.
 *
 * Hugging Face's tables are Unicode 9.0 (unicode-normalization-alignments
 * 0.1.12): a character assigned later has combining class 0 and no
 * decomposition or composition there, so it is a boundary too, and is
 * never the starter a stretch begins with.
 */
static int
tok_norm_flagged(uint32_t cp, int decomposes)
{
    const utf8proc_property_t  *p;

    if ((cp >= 0x1160 && cp <= 0x11FF)
        || (decomposes && cp >= 0xAC00 && cp <= 0xD7A3))
    {
        return 1;
    }
    p = utf8proc_get_property((utf8proc_int32_t) cp);
    return (p->combining_class != 0 || p->decomp_seqindex != UINT16_MAX
            || (p->comb_index != UINT16_MAX && (p->comb_index & 0x8000)))
           && tok_unicode9_assigned(cp);
}


/*
 * tok_norm_flagged(cp, 0) as a bitmap, filled 64 code points at a time on
 * first use, process-wide: the answer depends on no tokenizer, so racing
 * threads store the same bits (the mask, then its "known" byte).  Text
 * then skips the property lookups for every character seen before.
 */
static _Atomic uint64_t  tok_norm_mask[0x110000 / 64];
static _Atomic uint8_t   tok_norm_known[0x110000 / 64];


static inline int
tok_norm_flagged_fast(uint32_t cp, int decomposes)
{
    uint32_t  k = cp / 64, c;
    uint64_t  m;

    if (decomposes && cp >= 0xAC00 && cp <= 0xD7A3) {
        return 1;
    }
    if (cp >= 0x110000) {
        return tok_norm_flagged(cp, decomposes);
    }
    if (atomic_load_explicit(&tok_norm_known[k], memory_order_acquire)) {
        m = atomic_load_explicit(&tok_norm_mask[k], memory_order_relaxed);
    } else {
        m = 0;
        for (c = 0; c < 64; c++) {
            m |= (uint64_t) tok_norm_flagged(k * 64 + c, 0) << c;
        }
        atomic_store_explicit(&tok_norm_mask[k], m, memory_order_relaxed);
        atomic_store_explicit(&tok_norm_known[k], 1, memory_order_release);
    }
    return (int) (m >> (cp % 64) & 1);
}


/* tok_utf8_decode() of s[0] >= 0x80, with the two- and three-byte forms
 * of valid UTF-8 inline */
static inline size_t
tok_norm_decode(const char *s, size_t len, uint32_t *cp)
{
    const unsigned char  *p = (const unsigned char *) s;
    uint32_t              c;

    if (p[0] >= 0xC2 && p[0] <= 0xDF && len >= 2 && (p[1] & 0xC0) == 0x80) {
        *cp = (uint32_t) (p[0] & 0x1F) << 6 | (p[1] & 0x3F);
        return 2;
    }
    if (p[0] >= 0xE0 && p[0] <= 0xEF && len >= 3 && (p[1] & 0xC0) == 0x80
        && (p[2] & 0xC0) == 0x80)
    {
        c = (uint32_t) (p[0] & 0x0F) << 12 | (uint32_t) (p[1] & 0x3F) << 6
            | (p[2] & 0x3F);
        if (c >= 0x800 && (c < 0xD800 || c > 0xDFFF)) {
            *cp = c;
            return 3;
        }
    }
    return tok_utf8_decode(s, len, cp);
}


typedef struct {
    char    *p;
    size_t   len;
    size_t   cap;
} tok_buf_t;


static int
tok_buf_add(tok_buf_t *b, const char *s, size_t n)
{
    char  *p;

    if (n == 0) {
        return 0;
    }
    if (b->len + n > b->cap) {
        size_t  cap = (b->len + n) * 2 + 64;

        p = realloc(b->p, cap);
        if (p == NULL) {
            return -1;
        }
        /* the slack initialised: pcre2's JIT may read a word past the
         * subject's end (harmless, but memcheck reports it) */
        memset(p + b->cap, 0, cap - b->cap);
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    return 0;
}


/* b holds a result, even an empty one */
static int
tok_buf_own(tok_buf_t *b)
{
    if (b->p == NULL) {
        b->p = calloc(1, 64);
        if (b->p == NULL) {
            return -1;
        }
        b->cap = 64;
    }
    return 0;
}


/* Append s[0..len) normalized by the Unicode forms k0..k1-1. */
static int
tok_norm_append(const dpd_tok_t *tok, int k0, int k1, const char *s,
    size_t len, tok_buf_t *b)
{
    utf8proc_uint8_t  *cur = NULL, *dst;
    utf8proc_ssize_t   n = (utf8proc_ssize_t) len;
    int                k, rc;

    for (k = k0; k < k1; k++) {
        n = utf8proc_map(cur ? cur : (const utf8proc_uint8_t *) s, n, &dst,
                         (utf8proc_option_t) tok->norm[k].opt);
        free(cur);
        cur = NULL;
        if (n < 0) {
            return -1;
        }
        cur = dst;
    }
    rc = tok_buf_add(b, (const char *) cur, (size_t) n);
    free(cur);
    return rc;
}


/*
 * The Unicode forms k0..k1-1 on s.  Only the stretches around flagged
 * characters go through utf8proc; the rest, usually everything, is used
 * as it is.  0 with out->p NULL: unchanged.
 */
static int
tok_norm_unicode(const dpd_tok_t *tok, int k0, int k1, const char *s,
    size_t len, tok_buf_t *out)
{
    size_t    i = 0, j, n, safe = 0, copied = 0;
    uint32_t  cp;
    int       dec = tok->norm_decomposes;

    while (i < len) {
        if ((unsigned char) s[i] < 0x80) {
            safe = i++;
            continue;
        }
        n = tok_norm_decode(s + i, len - i, &cp);
        if (!tok_norm_flagged_fast(cp, dec)) {
            safe = i;
            i += n;
            continue;
        }
        /* the starter before it, unless Hugging Face does not know it */
        if (safe < i && (unsigned char) s[safe] >= 0x80) {
            tok_utf8_decode(s + safe, i - safe, &cp);
            if (!tok_unicode9_assigned(cp)) {
                safe = i;
            }
        }
        /* the stretch: from the last boundary to the next one */
        for (j = i + n; j < len; j += n) {
            if ((unsigned char) s[j] < 0x80) {
                break;
            }
            n = tok_norm_decode(s + j, len - j, &cp);
            if (!tok_norm_flagged_fast(cp, dec)) {
                break;
            }
        }
        if (tok_buf_add(out, s + copied, safe - copied) != 0
            || tok_norm_append(tok, k0, k1, s + safe, j - safe, out) != 0)
        {
            return -1;
        }
        copied = safe = i = j;
    }
    if (copied == 0 && out->p == NULL) {
        return 0;
    }
    return tok_buf_add(out, s + copied, len - copied);
}


/* Replace: every leftmost, non-overlapping match of the pattern */
static int
tok_norm_replace(const tok_norm_t *st, pcre2_match_data *md, const char *s,
    size_t len, tok_buf_t *out)
{
    const char  *p;
    size_t       at = 0, ms, me, n;
    PCRE2_SIZE  *ov;
    uint32_t     cp;
    int          rc, any = 0;

    if (st->re == NULL) {
        while (at + st->plen <= len
               && (p = memmem(s + at, len - at, st->pat, st->plen)) != NULL)
        {
            ms = (size_t) (p - s);
            if (tok_buf_add(out, s + at, ms - at) != 0
                || tok_buf_add(out, st->str, st->len) != 0)
            {
                return -1;
            }
            at = ms + st->plen;
            any = 1;
        }
        if (!any) {
            return 0;
        }
        return tok_buf_own(out) != 0 ? -1
               : tok_buf_add(out, s + at, len - at);
    }

    ov = pcre2_get_ovector_pointer(md);
    n = 0;      /* copied up to */
    while (at <= len) {
        rc = pcre2_match(st->re, (PCRE2_SPTR) s, len, at, PCRE2_NO_UTF_CHECK,
                         md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) {
            break;
        }
        if (rc < 0) {
            return -1;
        }
        ms = ov[0];
        me = ov[1];
        if (tok_buf_add(out, s + n, ms - n) != 0
            || tok_buf_add(out, st->str, st->len) != 0)
        {
            return -1;
        }
        any = 1;
        n = me;
        if (me == ms) {
            /* an empty match: the next character is kept, then go on */
            if (me >= len) {
                break;
            }
            at = me + tok_utf8_decode(s + me, len - me, &cp);
            if (tok_buf_add(out, s + me, at - me) != 0) {
                return -1;
            }
            n = at;
        } else {
            at = me;
        }
    }
    if (!any) {
        return 0;
    }
    return tok_buf_own(out) != 0 ? -1 : tok_buf_add(out, s + n, len - n);
}


/*
 * Every normalizer stage, in order, on s.  0 with *res NULL when nothing
 * changed (use s), or *res malloc'ed; -1 when out of memory.
 */
static int
tok_norm_run(const dpd_tok_t *tok, pcre2_match_data *md, const char *s,
    size_t len, char **res, size_t *reslen)
{
    const tok_norm_t  *st;
    tok_buf_t          b;
    char              *own = NULL;
    int                k = 0, g, rc;

    while (k < tok->n_norm) {
        st = &tok->norm[k];
        memset(&b, 0, sizeof(b));
        g = k + 1;
        switch (st->kind) {
        case TOK_NORM_UNICODE:
            while (g < tok->n_norm && tok->norm[g].kind == TOK_NORM_UNICODE) {
                g++;
            }
            rc = tok_norm_unicode(tok, k, g, s, len, &b);
            break;
        case TOK_NORM_PREPEND:
            rc = 0;
            if (len > 0 && (tok_buf_own(&b) != 0
                            || tok_buf_add(&b, st->str, st->len) != 0
                            || tok_buf_add(&b, s, len) != 0))
            {
                rc = -1;
            }
            break;
        default:
            rc = tok_norm_replace(st, md, s, len, &b);
            break;
        }
        if (rc != 0) {
            free(b.p);
            free(own);
            return -1;
        }
        if (b.p != NULL) {
            free(own);
            own = b.p;
            s = own;
            len = b.len;
        }
        k = g;
    }
    *res = own;
    *reslen = len;
    return 0;
}


int
tok_normalize(const dpd_tok_t *tok, const char *s, size_t len, char **out,
    size_t *outlen)
{
    pcre2_match_data  *md;
    char              *res;
    int                rc;

    md = pcre2_match_data_create(1, NULL);
    if (md == NULL) {
        return -1;
    }
    rc = tok_norm_run(tok, md, s, len, &res, outlen);
    pcre2_match_data_free(md);
    if (rc != 0) {
        return -1;
    }
    if (res == NULL) {
        res = malloc(len + 1);
        if (res == NULL) {
            return -1;
        }
        memcpy(res, s, len);
        *outlen = len;
    }
    *out = res;
    return 0;
}


/* A piece between raw-matched added tokens: normalize, then go on. */
static void
tok_encode_raw_piece(tok_work_t *w, const char *s, size_t len)
{
    char    *buf;
    size_t   blen;

    if (w->tok->n_norm == 0) {
        tok_encode_normalized(w, s, len);
        return;
    }
    if (tok_work_md(w) == NULL
        || tok_norm_run(w->tok, w->md, s, len, &buf, &blen) != 0)
    {
        w->oom = 1;
        return;
    }
    if (buf == NULL) {
        tok_encode_normalized(w, s, len);
        return;
    }
    tok_encode_normalized(w, buf, blen);
    free(buf);
}


/* harmony's encode_ordinary: normalized, but no added token is matched */
static void
tok_encode_plain_piece(tok_work_t *w, const char *s, size_t len)
{
    char    *buf;
    size_t   blen;

    if (w->tok->n_norm == 0) {
        tok_encode_pretok(w, s, len);
        return;
    }
    if (tok_work_md(w) == NULL
        || tok_norm_run(w->tok, w->md, s, len, &buf, &blen) != 0)
    {
        w->oom = 1;
        return;
    }
    if (buf == NULL) {
        tok_encode_pretok(w, s, len);
        return;
    }
    tok_encode_pretok(w, buf, blen);
    free(buf);
}


pcre2_match_data *
tok_work_md(tok_work_t *w)
{
    if (w->md == NULL) {
        w->md = pcre2_match_data_create(1, NULL);
        if (w->md == NULL) {
            w->oom = 1;
        }
    }
    return w->md;
}


static void
tok_work_release(tok_work_t *w)
{
    free(w->sym);
    free(w->tree);
    if (w->md) {
        pcre2_match_data_free(w->md);
    }
    if (w->mctx) {
        pcre2_match_context_free(w->mctx);
    }
    if (w->jstack) {
        pcre2_jit_stack_free(w->jstack);
    }
    memset(w, 0, sizeof(*w));
}


static long
tok_encode_any(const dpd_tok_t *tok, const char *text, size_t len,
    int add_special, int plain, tok_sink_t *sink)
{
    tok_work_t   w;
    char        *clean = NULL;
    size_t       clen;
    uint32_t     i;
    int          valid;

    if (tok == NULL || (text == NULL && len > 0)) {
        return -1;
    }

    memset(&w, 0, sizeof(w));
    w.tok = tok;
    w.sink = sink;
    w.at_start = 1;

    clen = tok_utf8_sanitize_len(text, len, &valid);
    if (!valid) {
        clean = malloc(clen ? clen : 1);
        if (clean == NULL) {
            tok_work_release(&w);
            return -1;
        }
        len = tok_utf8_sanitize(text, len, clean);
        text = clean;
    }

    if (add_special) {
        for (i = 0; i < tok->n_prefix; i++) {
            tok_emit(sink, tok->post_prefix[i]);
        }
    }
    if (len > 0 && plain) {
        tok_encode_plain_piece(&w, text, len);
    } else if (len > 0) {
        tok_split_added(&w, &tok->trie_raw, text, len, tok_encode_raw_piece);
    }
    if (add_special) {
        for (i = 0; i < tok->n_suffix; i++) {
            tok_emit(sink, tok->post_suffix[i]);
        }
    }

    free(clean);
    valid = !w.oom;
    tok_work_release(&w);
    if (!valid || sink->n > (size_t) LONG_MAX) {
        return -1;
    }
    return (long) sink->n;
}


long
tok_encode_sink(const dpd_tok_t *tok, const char *text, size_t len,
    int add_special, tok_sink_t *sink)
{
    return tok_encode_any(tok, text, len, add_special, 0, sink);
}


long
tok_encode_plain_sink(const dpd_tok_t *tok, const char *text, size_t len,
    tok_sink_t *sink)
{
    return tok_encode_any(tok, text, len, 0, 1, sink);
}


long
dpd_tok_encode(const dpd_tok_t *tok, const char *text, size_t len,
    int add_special, uint32_t *ids, size_t cap)
{
    tok_sink_t  sink = { ids, ids ? cap : 0, 0 };

    return tok_encode_sink(tok, text, len, add_special, &sink);
}


long
dpd_tok_count(const dpd_tok_t *tok, const char *text, size_t len,
    int add_special)
{
    tok_sink_t  sink = { NULL, 0, 0 };

    return tok_encode_sink(tok, text, len, add_special, &sink);
}


/*
 * Largest growth, in UTF-8 bytes, of a string under one Unicode normal
 * form (Unicode normalization FAQ: NFC/NFD 3x, NFKC/NFKD 11x; e.g.
 * U+1D160 -> 3 code points, U+FDFA -> 18).  ASCII never changes.
 */
#define TOK_NORM_CANON_GROWTH   3
#define TOK_NORM_COMPAT_GROWTH  11
#define TOK_BOUND_FACTOR_MAX    1000000


int
dpd_tok_bound_params(const dpd_tok_t *tok, dpd_tok_bound_t *out)
{
    int       i, ascii_may_change = 0;
    uint64_t  other, prefix;

    if (tok == NULL || out == NULL) {
        return -1;
    }

    other = 1;
    prefix = 1;

    /*
     * After a stage that can turn ASCII into other text (Prepend,
     * Replace), a Unicode form's growth applies to every byte.  Prepend
     * adds its text to each non-empty piece (at least one byte), a String
     * Replace grows a match by content/pattern at most; a Regex Replace
     * can match the empty string: no bound.  Every id covers at least one
     * byte of the normalized text also for the SentencePiece-style files
     * (a character, one byte of a <0xNN> fallback, or an unknown run).
     */
    for (i = 0; i < tok->n_norm; i++) {
        const tok_norm_t *st = &tok->norm[i];
        uint64_t          f;

        switch (st->kind) {
        case TOK_NORM_UNICODE:
            f = (st->opt & UTF8PROC_COMPAT) ? TOK_NORM_COMPAT_GROWTH
                                            : TOK_NORM_CANON_GROWTH;
            if (ascii_may_change) {
                prefix *= f;
            } else {
                other *= f;
            }
            break;
        case TOK_NORM_PREPEND:
            prefix *= 1 + st->len;
            ascii_may_change = 1;
            break;
        default:
            if (st->re != NULL) {
                return -1;
            }
            prefix *= st->len > st->plen ? (st->len + st->plen - 1) / st->plen
                                         : 1;
            ascii_may_change = 1;
            break;
        }
        if (other > TOK_BOUND_FACTOR_MAX || prefix > TOK_BOUND_FACTOR_MAX) {
            return -1;
        }
    }

    for (i = 0; i < tok->n_pre; i++) {
        if (tok->pre[i].kind == TOK_PRE_BYTELEVEL
            && tok->pre[i].add_prefix_space)
        {
            prefix *= 2;
        } else if (tok->pre[i].kind == TOK_PRE_METASPACE) {
            /* ' ' -> the replacement, then one more per piece */
            prefix *= (uint64_t) tok->pre[i].rep_len
                      * (tok->pre[i].scheme == TOK_PREPEND_NEVER
                         ? 1 : 1 + tok->pre[i].rep_len);
        }
        if (prefix > TOK_BOUND_FACTOR_MAX) {
            return -1;
        }
    }

    out->other_factor = (uint32_t) other;
    out->prefix_factor = (uint32_t) prefix;
    out->specials = (uint32_t) (tok->n_prefix + tok->n_suffix);

    return 0;
}


uint32_t
dpd_tok_vocab_size(const dpd_tok_t *tok)
{
    return tok ? tok->vocab_size : 0;
}
