/*
 * Hand-written matchers for the Split regexes the shipped models use, so
 * the common case skips pcre2 (about 450 instructions per pre-token even
 * with JIT).  A pattern is recognised by its exact string at load; any
 * other pattern stays on pcre2.  Each matcher gives what pcre2_match gives
 * on the rewritten pattern (tok_pretok.c: \s is White_Space, without
 * U+180E) with PCRE2_UTF | PCRE2_UCP: the first alternative that matches at
 * the leftmost position, with pcre2's backtracking worked out by hand.
 * These patterns match at every position and never match empty, so a
 * matcher only returns where the match that starts at `at` ends.
 *
 * Llama 3 (Qwen 2/3: \p{N} instead of \p{N}{1,3}):
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}
 *   | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * GPT-2 (ByteLevel use_regex):
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+
 *   |\s+(?!\S)|\s+
 *
 * Classes: a table generated from pcre2 (gen_pretok_class.c; utf8proc has
 * a newer Unicode than pcre2 10.42, U+1123F is a letter there and not in
 * pcre2), checked for every code point by t/tokenizer/04-pretok-fast.t.
 * The input is valid UTF-8 (lossy-decoded first); a truncated sequence at
 * the end is read as one byte of "other" rather than read past the end.
 */

#include <sys/types.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

#define TOK_C_OTHER  0
#define TOK_C_L      1
#define TOK_C_N      2
#define TOK_C_WS     3


static const char  tok_pat_llama3[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char  tok_pat_qwen2[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char  tok_pat_gpt2[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+"
    "|\\s+(?!\\S)|\\s+";


#include "tok_pretok_class.h"

/* the first block is U+0000..U+00FF */
#define tok_ascii_class  tok_class_blocks[0]


/* DPD_TOK_PCRE2_ONLY=1 (read at load) keeps every pattern on pcre2: for
 * before/after measurements in one build */
int
tok_pretok_fast_kind(const char *pattern, size_t len)
{
    const char  *off = getenv("DPD_TOK_PCRE2_ONLY");

    if (off != NULL && off[0] == '1') {
        return TOK_FAST_NONE;
    }
    if (len == sizeof(tok_pat_llama3) - 1
        && memcmp(pattern, tok_pat_llama3, len) == 0)
    {
        return TOK_FAST_LLAMA3;
    }
    if (len == sizeof(tok_pat_qwen2) - 1
        && memcmp(pattern, tok_pat_qwen2, len) == 0)
    {
        return TOK_FAST_QWEN2;
    }
    if (len == sizeof(tok_pat_gpt2) - 1
        && memcmp(pattern, tok_pat_gpt2, len) == 0)
    {
        return TOK_FAST_GPT2;
    }
    return TOK_FAST_NONE;
}


static inline int
tok_class_cp(uint32_t cp)
{
    return tok_class_blocks[tok_class_stage1[cp >> 8]][cp & 0xFF];
}


/* Class of the character at p (p < e), its length in *n, its code point in
 * *cp. */
static inline int
tok_class_at(const u_char *p, const u_char *e, size_t *n, uint32_t *cp)
{
    uint32_t  c = p[0];

    if (c < 0x80) {
        *n = 1;
        *cp = c;
        return tok_ascii_class[c];
    }
    if (c >= 0xF0 && c < 0xF8 && e - p >= 4) {
        c = ((c & 0x07) << 18) | ((p[1] & 0x3F) << 12) | ((p[2] & 0x3F) << 6)
            | (p[3] & 0x3F);
        *n = 4;
    } else if (c >= 0xE0 && c < 0xF0 && e - p >= 3) {
        c = ((c & 0x0F) << 12) | ((p[1] & 0x3F) << 6) | (p[2] & 0x3F);
        *n = 3;
    } else if (c >= 0xC0 && c < 0xE0 && e - p >= 2) {
        c = ((c & 0x1F) << 6) | (p[1] & 0x3F);
        *n = 2;
    } else {
        /* not valid UTF-8 (the callers lossy-decode first): one byte */
        *n = 1;
        *cp = 0xFFFD;
        return TOK_C_OTHER;
    }
    *cp = c;
    return tok_class_cp(c);
}


/* End of the run of characters of class k from p. */
static inline const u_char *
tok_run(const u_char *p, const u_char *e, int k)
{
    size_t    n;
    uint32_t  cp;

    while (p < e) {
        if (*p < 0x80) {
            if (tok_ascii_class[*p] != k) {
                break;
            }
            p++;
            continue;
        }
        if (tok_class_at(p, e, &n, &cp) != k) {
            break;
        }
        p += n;
    }
    return p;
}


/*
 * The class of a byte: the rows of tok_ascii_class below 0x80 (as
 * tok_pretok_class.h has them), TOK_C_MB (a longer character: decode it)
 * from 0x80, so one load tells an ASCII letter.
 */
#define TOK_C_MB  4

static const unsigned char  tok_byte_class[256] = {
    0,0,0,0,0,0,0,0,0,3,3,3,3,3,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
    3,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,2,2,2,2,2,2,2,2,2,2,0,0,0,0,0,0,
    0,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,0,0,0,0,0,
    0,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,0,0,0,0,0,
    4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,
    4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,
    4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,
    4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,
};


/* End of the run of \p{L} from s[i] (an index: s and len are at hand in
 * the loops): ASCII letters by one load each, tok_run() from a longer
 * character on. */
static inline __attribute__((always_inline)) size_t
tok_run_letters(const char *s, size_t len, size_t i)
{
    while (i < len && tok_byte_class[(u_char) s[i]] == TOK_C_L) {
        i++;
    }
    if (i < len && (u_char) s[i] >= 0x80) {
        return (size_t) (tok_run((const u_char *) s + i,
                                 (const u_char *) s + len, TOK_C_L)
                         - (const u_char *) s);
    }
    return i;
}


/*
 * (?i:'s|'t|'re|'ve|'m|'ll|'d) at p (p[0] == '\''): the end, or NULL.
 * Caseless with UCP: 's' also matches U+017F (long s), 'k' is not used,
 * and no other of these letters has a third case form.
 */
static const u_char *
tok_contraction(const u_char *p, const u_char *e, int caseless)
{
    u_char  c1, c2;

    if (e - p < 2) {
        return NULL;
    }
    c1 = p[1];
    if (caseless) {
        if (c1 == 0xC5 && e - p >= 3 && p[2] == 0xBF) {
            return p + 3;                           /* 'U+017F */
        }
        if (c1 >= 'A' && c1 <= 'Z') {
            c1 |= 0x20;
        }
    }
    switch (c1) {
    case 's': case 't': case 'm': case 'd':
        return p + 2;
    case 'r': case 'v': case 'l':
        if (e - p < 3) {
            return NULL;
        }
        c2 = p[2];
        if (caseless && c2 >= 'A' && c2 <= 'Z') {
            c2 |= 0x20;
        }
        if ((c1 == 'l' && c2 == 'l') || (c1 != 'l' && c2 == 'e')) {
            return p + 3;
        }
        return NULL;
    }
    return NULL;
}


/* \s*[\r\n]+|\s+(?!\S)|\s+ at p (a White_Space character); with crlf 0,
 * only the last two. */
static const u_char *
tok_spaces(const u_char *p, const u_char *e, int crlf)
{
    const u_char  *q = p, *last = NULL, *nl = NULL;
    size_t         n;
    uint32_t       cp;

    while (q < e) {
        if (*q < 0x80) {
            if (tok_ascii_class[*q] != TOK_C_WS) {
                break;
            }
            if (*q == '\r' || *q == '\n') {
                nl = q;
            }
            last = q++;
            continue;
        }
        if (tok_class_at(q, e, &n, &cp) != TOK_C_WS) {
            break;
        }
        last = q;
        q += n;
    }
    /* \s* backs off to the last \r or \n of the run, [\r\n]+ takes it */
    if (crlf && nl != NULL) {
        return nl + 1;
    }
    /* \s+(?!\S): all of it at the end, else all but the last character */
    if (q == e || last == p) {
        return q;
    }
    return last;
}


static const u_char *
tok_match_llama3(const u_char *p, const u_char *e, int maxd)
{
    const u_char  *q, *r;
    size_t         n, n1;
    uint32_t       cp, cp1;
    int            k, k1;

    k = tok_class_at(p, e, &n, &cp);

    if (cp == '\'' && (q = tok_contraction(p, e, 1)) != NULL) {
        return q;
    }
    if (k == TOK_C_L) {
        return tok_run(p + n, e, TOK_C_L);
    }
    if (k == TOK_C_N) {
        q = p + n;
        while (--maxd > 0 && q < e
               && tok_class_at(q, e, &n1, &cp1) == TOK_C_N)
        {
            q += n1;
        }
        return q;
    }
    /* [^\r\n\p{L}\p{N}]\p{L}+ */
    k1 = -1;
    if (cp != '\r' && cp != '\n' && p + n < e) {
        k1 = tok_class_at(p + n, e, &n1, &cp1);
        if (k1 == TOK_C_L) {
            return tok_run(p + n + n1, e, TOK_C_L);
        }
    }
    /* ' ?[^\s\p{L}\p{N}]+[\r\n]*' */
    r = NULL;
    if (k == TOK_C_OTHER) {
        r = tok_run(p + n, e, TOK_C_OTHER);
    } else if (cp == ' ' && k1 == TOK_C_OTHER) {
        r = tok_run(p + n + n1, e, TOK_C_OTHER);
    }
    if (r != NULL) {
        while (r < e && (*r == '\r' || *r == '\n')) {
            r++;
        }
        return r;
    }
    return tok_spaces(p, e, 1);
}


static const u_char *
tok_match_gpt2(const u_char *p, const u_char *e)
{
    const u_char  *q;
    size_t         n, n1;
    uint32_t       cp, cp1;
    int            k;

    k = tok_class_at(p, e, &n, &cp);

    if (cp == '\'' && (q = tok_contraction(p, e, 0)) != NULL) {
        return q;
    }
    if (cp == ' ' && p + n < e) {
        k = tok_class_at(p + n, e, &n1, &cp1);
        if (k != TOK_C_WS) {
            return tok_run(p + n + n1, e, k);
        }
        k = TOK_C_WS;
    }
    if (k != TOK_C_WS) {
        return tok_run(p + n, e, k);
    }
    return tok_spaces(p, e, 0);
}


static inline __attribute__((always_inline)) size_t
tok_fast_next(int kind, const char *s, size_t len, size_t at)
{
    const u_char  *p = (const u_char *) s + at, *e = (const u_char *) s + len;
    size_t         r;

    /*
     * Most pre-tokens of text are a space and an ASCII letter, or an ASCII
     * letter, then letters: every pattern here takes the run of letters
     * for them (no contraction starts so), so skip the matcher's call and
     * its other cases.
     */
    if (p[0] == ' ') {
        if (len - at > 1 && tok_byte_class[p[1]] == TOK_C_L) {
            return tok_run_letters(s, len, at + 2);
        }
    } else if (tok_byte_class[p[0]] == TOK_C_L) {
        return tok_run_letters(s, len, at + 1);
    }

    switch (kind) {
    case TOK_FAST_LLAMA3:
        r = (size_t) (tok_match_llama3(p, e, 3) - (const u_char *) s);
        break;
    case TOK_FAST_QWEN2:
        r = (size_t) (tok_match_llama3(p, e, 1) - (const u_char *) s);
        break;
    default:
        r = (size_t) (tok_match_gpt2(p, e) - (const u_char *) s);
        break;
    }

    /* never empty, never past the end (the callers loop on it): a matcher
     * bug costs a wrong split of one character, not a hung worker */
    if (r <= at || r > len) {
        for (r = at + 1; r < len && ((u_char) s[r] & 0xc0) == 0x80; r++) {
            /* the rest of the character */
        }
    }

    return r;
}


size_t
tok_pretok_fast_next(int kind, const char *s, size_t len, size_t at)
{
    return tok_fast_next(kind, s, len, at);
}


/*
 * Every piece straight to BPE, the matcher inlined for its kind and
 * ignore_merges known at compile time.  The vocabulary is read through a
 * local copy: the sink's stores could alias it.  BPE does not read
 * w->at_start: it is set once, as the last piece left it.
 */
static inline __attribute__((always_inline)) void
tok_fast_bpe_loop(tok_work_t *w, int kind, int ignore, const char *s,
    size_t len, int top)
{
    size_t             at, me, n, last = 0;
    uint32_t           id;
    uint64_t           h;
    const dpd_tok_t   *tok = w->tok;
    tok_strmap_t       vocab = tok->vocab;

    if (w->oom) {
        return;
    }
    for (at = 0; at < len; at = me) {
        me = tok_fast_next(kind, s, len, at);
        n = me - at;
        last = at;

        /* tok_bpe()'s first step inlined: under ignore_merges most
         * pre-tokens of text are a vocabulary token of their own */
        if (ignore && n > 1) {
            h = tok_hash_bytes(s + at, n);
            id = tok_strmap_get_h(&vocab, s + at, n, h);
            if (id != TOK_NO_ID) {
                tok_emit(w->sink, id);
                continue;
            }
            tok_bpe_merge(w, s + at, n, h);
        } else {
            tok_bpe(w, s + at, n);
        }
        if (w->oom) {
            break;
        }
    }
    w->at_start = top && last == 0;
}


void
tok_pretok_fast_bpe(tok_work_t *w, int kind, const char *s, size_t len,
    int top)
{
    if (w->tok->ignore_merges) {
        switch (kind) {
        case TOK_FAST_LLAMA3:
            tok_fast_bpe_loop(w, TOK_FAST_LLAMA3, 1, s, len, top);
            break;
        case TOK_FAST_QWEN2:
            tok_fast_bpe_loop(w, TOK_FAST_QWEN2, 1, s, len, top);
            break;
        default:
            tok_fast_bpe_loop(w, kind, 1, s, len, top);
            break;
        }
        return;
    }
    switch (kind) {
    case TOK_FAST_LLAMA3:
        tok_fast_bpe_loop(w, TOK_FAST_LLAMA3, 0, s, len, top);
        break;
    case TOK_FAST_QWEN2:
        tok_fast_bpe_loop(w, TOK_FAST_QWEN2, 0, s, len, top);
        break;
    default:
        tok_fast_bpe_loop(w, kind, 0, s, len, top);
        break;
    }
}
