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


/* A piece between raw-matched added tokens: normalize, then go on. */
static void
tok_encode_raw_piece(tok_work_t *w, const char *s, size_t len)
{
    const dpd_tok_t    *tok = w->tok;
    utf8proc_uint8_t   *cur = NULL, *dst;
    utf8proc_ssize_t    n;
    size_t              i;
    int                 k;

    if (tok->n_norm == 0) {
        tok_encode_normalized(w, s, len);
        return;
    }
    /* every normal form leaves ASCII as it is */
    for (i = 0; i < len && (unsigned char) s[i] < 0x80; i++) {
        /* scan */
    }
    if (i == len) {
        tok_encode_normalized(w, s, len);
        return;
    }

    for (k = 0; k < tok->n_norm; k++) {
        n = utf8proc_map(cur ? cur : (const utf8proc_uint8_t *) s,
                         (utf8proc_ssize_t) len, &dst,
                         (utf8proc_option_t) tok->norm[k]);
        free(cur);
        cur = NULL;
        if (n < 0) {
            w->oom = 1;
            return;
        }
        cur = dst;
        len = (size_t) n;
    }
    tok_encode_normalized(w, (const char *) cur, len);
    free(cur);
}


static void
tok_work_release(tok_work_t *w)
{
    free(w->sym);
    free(w->heap);
    free(w->pbuf);
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


uint32_t
dpd_tok_vocab_size(const dpd_tok_t *tok)
{
    return tok ? tok->vocab_size : 0;
}
