/*
 * The encode pipeline, in Hugging Face's order:
 *   lossy UTF-8 -> split on added tokens that match the raw text ->
 *   normalize each remaining piece -> split on added tokens that match the
 *   normalized text -> pre-tokenize -> BPE -> post-processor specials.
 */

#include <limits.h>
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
    size_t              pos = 0, seg = 0, mlen = 0, start, stop, ns;
    int32_t             m;

    if (t->empty) {
        next(w, s, len);
        return;
    }
    while (pos < len) {
        if (!t->first[(unsigned char) s[pos]]) {
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
            next(w, s + seg, start - seg);
        }
        tok_emit(w->sink, a->id);
        seg = stop;
    }
    if (seg < len) {
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
    return p->combining_class != 0 || p->decomp_seqindex != UINT16_MAX
           || (p->comb_index != UINT16_MAX && (p->comb_index & 0x8000));
}


/* Append s[0..len) normalized by every form of the tokenizer. */
static int
tok_norm_append(const dpd_tok_t *tok, const char *s, size_t len, char **buf,
    size_t *blen, size_t *bcap)
{
    utf8proc_uint8_t  *cur = NULL, *dst;
    utf8proc_ssize_t   n = (utf8proc_ssize_t) len;
    int                k;
    char              *p;

    for (k = 0; k < tok->n_norm; k++) {
        n = utf8proc_map(cur ? cur : (const utf8proc_uint8_t *) s, n, &dst,
                         (utf8proc_option_t) tok->norm[k]);
        free(cur);
        cur = NULL;
        if (n < 0) {
            return -1;
        }
        cur = dst;
    }
    if (*blen + (size_t) n > *bcap) {
        *bcap = (*blen + (size_t) n) * 2 + 64;
        p = realloc(*buf, *bcap);
        if (p == NULL) {
            free(cur);
            return -1;
        }
        *buf = p;
    }
    memcpy(*buf + *blen, cur, (size_t) n);
    *blen += (size_t) n;
    free(cur);
    return 0;
}


/*
 * A piece between raw-matched added tokens: normalize, then go on.
 * Only the stretches around flagged characters go through utf8proc; the
 * rest, usually everything, is used as it is.
 */
static void
tok_encode_raw_piece(tok_work_t *w, const char *s, size_t len)
{
    const dpd_tok_t  *tok = w->tok;
    size_t            i = 0, j, n, safe = 0, copied = 0, blen = 0, bcap = 0;
    char             *buf = NULL;
    uint32_t          cp;
    int               dec = tok->norm_decomposes;

    if (tok->n_norm == 0) {
        tok_encode_normalized(w, s, len);
        return;
    }
    while (i < len) {
        if ((unsigned char) s[i] < 0x80) {
            safe = i++;
            continue;
        }
        n = tok_utf8_decode(s + i, len - i, &cp);
        if (!tok_norm_flagged(cp, dec)) {
            safe = i;
            i += n;
            continue;
        }
        /* the stretch: from the last boundary to the next one */
        for (j = i + n; j < len; j += n) {
            if ((unsigned char) s[j] < 0x80) {
                break;
            }
            n = tok_utf8_decode(s + j, len - j, &cp);
            if (!tok_norm_flagged(cp, dec)) {
                break;
            }
        }
        if (safe > copied) {
            if (blen + (safe - copied) > bcap) {
                char *p;
                bcap = (blen + (safe - copied)) * 2 + 64;
                p = realloc(buf, bcap);
                if (p == NULL) {
                    goto nomem;
                }
                buf = p;
            }
            memcpy(buf + blen, s + copied, safe - copied);
            blen += safe - copied;
        }
        if (tok_norm_append(tok, s + safe, j - safe, &buf, &blen, &bcap)
            != 0)
        {
            goto nomem;
        }
        copied = safe = i = j;
    }
    if (copied == 0 && buf == NULL) {
        tok_encode_normalized(w, s, len);
        return;
    }
    if (copied < len) {
        if (blen + (len - copied) > bcap) {
            char *p;
            bcap = blen + (len - copied);
            p = realloc(buf, bcap);
            if (p == NULL) {
                goto nomem;
            }
            buf = p;
        }
        memcpy(buf + blen, s + copied, len - copied);
        blen += len - copied;
    }
    tok_encode_normalized(w, buf, blen);
    free(buf);
    return;

nomem:
    free(buf);
    w->oom = 1;
}


static void
tok_work_release(tok_work_t *w)
{
    free(w->sym);
    free(w->heap);
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


long
tok_encode_sink(const dpd_tok_t *tok, const char *text, size_t len,
    int add_special, tok_sink_t *sink)
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
    w.md = pcre2_match_data_create(1, NULL);
    if (w.md == NULL) {
        return -1;
    }

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
    if (len > 0) {
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
    int       i;
    uint64_t  other, prefix;

    if (tok == NULL || out == NULL) {
        return -1;
    }

    other = 1;
    prefix = 1;

    for (i = 0; i < tok->n_norm; i++) {
        other *= (tok->norm[i] & UTF8PROC_COMPAT) ? TOK_NORM_COMPAT_GROWTH
                                                  : TOK_NORM_CANON_GROWTH;
        if (other > TOK_BOUND_FACTOR_MAX) {
            return -1;
        }
    }

    for (i = 0; i < tok->n_pre; i++) {
        if (tok->pre[i].kind == TOK_PRE_BYTELEVEL
            && tok->pre[i].add_prefix_space)
        {
            prefix *= 2;
            if (prefix > TOK_BOUND_FACTOR_MAX) {
                return -1;
            }
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
