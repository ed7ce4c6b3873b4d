/*
 * Byte-level BPE on one pre-token, merge for merge as Hugging Face's
 * Word::merge_all: it pops the lowest (rank, left position) of a heap of
 * candidate pairs and applies it if that pair is still there.  Here every
 * symbol keeps the rank of the pair it starts, and the lowest (leftmost on
 * ties) current pair is applied: the same sequence, since a popped
 * candidate that is still valid is exactly the lowest current pair.
 *
 * Pieces of up to TOK_BPE_SMALL bytes scan an array of symbols for the
 * lowest; longer ones keep the pairs in a tournament tree (below).
 */

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

/*
 * Up to TOK_BPE_SMALL bytes the scan is cheaper than the tree (fewer
 * instructions and mispredicted branches under callgrind: 24 beat 16, 32,
 * 48, 64 and 128 on the corpus); up to TOK_BPE_STACK bytes the tree's
 * scratch is on the stack, so only longer pieces allocate.
 */
#ifndef TOK_BPE_SMALL
#define TOK_BPE_SMALL  24
#endif
#define TOK_BPE_STACK  128

/*
 * The tree touches all of its 32 bytes per byte at once; past
 * TOK_BPE_TREE_MAX bytes (a hostile one-word prompt of megabytes) the
 * heap of candidates merges instead: 12-byte symbols and 8-byte
 * candidates filled as they come (about 20 bytes per byte resident, the
 * bound t/261-body-memory.t holds the worker to).  Same result.
 */
#ifndef TOK_BPE_TREE_MAX
#define TOK_BPE_TREE_MAX  16384
#endif

/*
 * Per-thread cache of recent BPE results for short pre-tokens that needed
 * merging (whole-vocab hits are already one lookup).  Direct-mapped by the
 * piece's hash; entries carry the tokenizer's load generation, so several
 * tokenizers share a thread's cache without confusion and nothing in a
 * loaded tokenizer is ever written.  256 KiB per thread, freed when the
 * thread exits.
 */
#ifndef TOK_CACHE_SLOTS
#define TOK_CACHE_SLOTS    4096
#endif
#ifndef TOK_CACHE_MAXLEN
#define TOK_CACHE_MAXLEN   24
#endif
#ifndef TOK_CACHE_MAXIDS
#define TOK_CACHE_MAXIDS   6
#endif

typedef struct {
    uint64_t  hash;
    uint64_t  gen;
    uint8_t   len;
    uint8_t   nids;
    char      bytes[TOK_CACHE_MAXLEN];
    uint32_t  ids[TOK_CACHE_MAXIDS];
} tok_cache_ent_t;

typedef struct {
    tok_cache_ent_t  e[TOK_CACHE_SLOTS];
} tok_cache_t;

static pthread_once_t            tok_cache_once = PTHREAD_ONCE_INIT;
static pthread_key_t             tok_cache_key;
static int                       tok_cache_ok;
static _Thread_local tok_cache_t *tok_cache_tls;
static _Thread_local int          tok_cache_failed;


static void
tok_cache_key_init(void)
{
    tok_cache_ok = pthread_key_create(&tok_cache_key, free) == 0;
}


static tok_cache_t *
tok_cache_get(void)
{
    tok_cache_t  *c;

    if (tok_cache_tls != NULL || tok_cache_failed) {
        return tok_cache_tls;
    }
    pthread_once(&tok_cache_once, tok_cache_key_init);
    c = tok_cache_ok ? calloc(1, sizeof(tok_cache_t)) : NULL;
    if (c == NULL || pthread_setspecific(tok_cache_key, c) != 0) {
        free(c);
        tok_cache_failed = 1;   /* run without a cache */
        return NULL;
    }
    tok_cache_tls = c;
    return c;
}


/*
 * The scratch of a long piece is per byte of the piece: one symbol (16
 * bytes) and two tree nodes (16 bytes) per byte, 32 bytes in all (a 2 MB
 * word: 64 MB for the call).
 */
typedef struct {
    uint32_t  id;
    uint32_t  mid;      /* what (this, next) merges into, if it does */
    int32_t   prev;
    int32_t   next;
} tok_sym_t;

/*
 * The pairs of a long piece sit in a min-tournament tree (t[1] the root,
 * t[k] = min(t[2k], t[2k+1]), leaf of symbol i at t[n + i]), one leaf per
 * symbol holding rank << 32 | i of the pair it starts, TOK_LEAF_NONE when
 * it starts none: the root is the lowest rank, leftmost on ties, in one
 * read.  Unlike a heap of candidates, a leaf always holds its symbol's
 * current pair, so nothing stale is ever popped, and an update stops as
 * soon as a node keeps its value.
 */
#define TOK_LEAF_NONE  UINT64_MAX

#define tok_leaf(rank, pos)  ((uint64_t) (rank) << 32 | (uint32_t) (pos))


static inline void
tok_tree_set(uint64_t *t, size_t n, size_t i, uint64_t v)
{
    uint64_t  s;

    /* v is the new value of node i: its parent's is min(v, sibling) */
    i += n;
    t[i] = v;
    while (i > 1) {
        s = t[i ^ 1];
        v = v < s ? v : s;
        i >>= 1;
        if (t[i] == v) {
            break;
        }
        t[i] = v;
    }
}


/* nsym symbols of symsz bytes, ntree 8-byte words (tree or heap) */
static int
tok_work_reserve(tok_work_t *w, size_t nsym, size_t symsz, size_t ntree)
{
    void  *p;

    if (w->sym_cap < nsym * symsz) {
        p = realloc(w->sym, nsym * symsz);
        if (p == NULL) {
            return -1;
        }
        w->sym = p;
        w->sym_cap = nsym * symsz;
    }
    if (w->tree_cap < ntree) {
        p = realloc(w->tree, ntree * sizeof(uint64_t));
        if (p == NULL) {
            return -1;
        }
        w->tree = p;
        w->tree_cap = ntree;
    }
    return 0;
}


/* ---- the heap path, for pieces over TOK_BPE_TREE_MAX bytes ---------- */

typedef struct {
    uint32_t  id;       /* TOK_NO_ID once merged into its left neighbour */
    int32_t   prev;
    int32_t   next;
} tok_hsym_t;

/* a candidate is rank << 32 | pos: (rank, leftmost) order is one compare;
 * it keeps no merged id: the rank names one pair of the merges table and
 * a symbol only ever grows, so the pair now at pos with the same rank is
 * the pair it was pushed for */
static inline void
tok_heap_up(uint64_t *h, size_t i, uint64_t c)
{
    size_t  p;

    while (i > 0) {
        p = (i - 1) / 2;
        if (c >= h[p]) {
            break;
        }
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}


/* Floyd's pop: the hole goes down by the smaller child, then the last
 * entry rises from there */
static inline uint64_t
tok_heap_pop(uint64_t *h, size_t *n)
{
    uint64_t  top = h[0];
    size_t    i = 0, c, m = --(*n);

    if (m == 0) {
        return top;
    }
    for ( ;; ) {
        c = 2 * i + 1;
        if (c + 1 >= m) {
            if (c < m) {
                h[i] = h[c];
                i = c;
            }
            break;
        }
        c += h[c + 1] < h[c];
        h[i] = h[c];
        i = c;
    }
    tok_heap_up(h, i, h[m]);
    return top;
}


static inline size_t tok_bpe_word(const dpd_tok_t *tok, const char *s,
    size_t len, uint32_t *id);


static void
tok_bpe_merge_heap(tok_work_t *w, const char *s, size_t len)
{
    const dpd_tok_t  *tok = w->tok;
    tok_hsym_t       *sym, *l;
    uint64_t         *heap, c;
    size_t            i, nh = 0, cap = 3 * len;
    int32_t           n, prev, nx;
    uint32_t          rank, merged;

    /* each merge pushes at most 2 candidates: len + 2 * len bounds it */
    if (tok_work_reserve(w, len, sizeof(tok_hsym_t), cap) != 0) {
        w->oom = 1;
        return;
    }
    sym = w->sym;
    heap = w->tree;

    /* the word's ids go through the heap's space, then into the symbols */
    n = (int32_t) tok_bpe_word(tok, s, len, (uint32_t *) heap);
    if (n == 0) {
        return;
    }
    for (i = 0; i < (size_t) n; i++) {
        sym[i].id = ((uint32_t *) heap)[i];
        sym[i].prev = (int32_t) i - 1;
        sym[i].next = (int32_t) i + 1;
    }
    sym[n - 1].next = -1;
    for (i = 0; i + 1 < (size_t) n; i++) {
        if (tok_pairmap_get(&tok->merges, sym[i].id, sym[i + 1].id, &rank,
                            &merged))
        {
            tok_heap_up(heap, nh++, (uint64_t) rank << 32 | i);
        }
    }

    while (nh > 0) {
        c = tok_heap_pop(heap, &nh);
        l = &sym[(uint32_t) c];
        if (l->id == TOK_NO_ID || l->next < 0) {
            continue;
        }
        nx = l->next;
        if (!tok_pairmap_get(&tok->merges, l->id, sym[nx].id, &rank, &merged)
            || rank != (uint32_t) (c >> 32))
        {
            continue;
        }
        l->id = merged;
        l->next = sym[nx].next;
        sym[nx].id = TOK_NO_ID;
        if (l->next >= 0) {
            sym[l->next].prev = (int32_t) (uint32_t) c;
        }
        prev = l->prev;
        if (prev >= 0 && nh < cap
            && tok_pairmap_get(&tok->merges, sym[prev].id, l->id, &rank,
                               &merged))
        {
            tok_heap_up(heap, nh++, (uint64_t) rank << 32 | (uint32_t) prev);
        }
        nx = l->next;
        if (nx >= 0 && nh < cap
            && tok_pairmap_get(&tok->merges, l->id, sym[nx].id, &rank,
                               &merged))
        {
            tok_heap_up(heap, nh++, (uint64_t) rank << 32 | (uint32_t) c);
        }
    }

    for (i = 0; (int32_t) i >= 0 && i < (size_t) n; ) {
        tok_emit(w->sink, sym[i].id);
        if (sym[i].next < 0) {
            break;
        }
        i = (size_t) sym[i].next;
    }
}


/*
 * The word before merges, as Hugging Face's BPE::merge_word: one symbol per
 * unit (a byte of byte-level text, else a UTF-8 character) found in the
 * vocabulary; a unit it lacks becomes its bytes' <0xNN> tokens
 * (byte_fallback, when all exist), else the unknown token (consecutive
 * ones fused into one with fuse_unk), else nothing.  A pending unknown
 * token is only written before the next known unit or at the end, as
 * there: byte-fallback tokens in between come before it.  At most one id
 * per byte of s.
 */
static size_t tok_bpe_word_chars(const dpd_tok_t *tok, const char *s,
    size_t len, uint32_t *id);


static inline size_t
tok_bpe_word(const dpd_tok_t *tok, const char *s, size_t len, uint32_t *id)
{
    size_t    i, n = 0;
    uint32_t  x;

    if (!tok->byte_level || tok->unk_id != TOK_NO_ID) {
        return tok_bpe_word_chars(tok, s, len, id);
    }
    for (i = 0; i < len; i++) {
        x = tok->byte_id[(uint8_t) s[i]];
        if (x != TOK_NO_ID) {
            id[n++] = x;
        }
    }
    return n;
}


static size_t
tok_bpe_word_chars(const dpd_tok_t *tok, const char *s, size_t len,
    uint32_t *id)
{
    size_t    i = 0, n = 0, cl, k;
    uint32_t  x;
    int       unk = 0;
    uint8_t   c;
    while (i < len) {
        c = (uint8_t) s[i];
        if (tok->byte_level || c < 0x80) {
            cl = 1;
            x = tok->byte_id[c];
        } else {
            cl = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
            if (cl > len - i) {
                cl = len - i;
            }
            x = tok_strmap_get(&tok->vocab, s + i, cl);
        }
        if (x != TOK_NO_ID) {
            if (unk) {
                id[n++] = tok->unk_id;
                unk = 0;
            }
            id[n++] = x;
            i += cl;
            continue;
        }
        if (tok->byte_fallback) {
            for (k = 0; k < cl; k++) {
                if (tok->fb_id[(uint8_t) s[i + k]] == TOK_NO_ID) {
                    break;
                }
            }
            if (k == cl) {
                for (k = 0; k < cl; k++) {
                    id[n++] = tok->fb_id[(uint8_t) s[i + k]];
                }
                i += cl;
                continue;
            }
        }
        if (tok->unk_id != TOK_NO_ID) {
            if (unk && !tok->fuse_unk) {
                id[n++] = tok->unk_id;
            }
            unk = 1;
        }
        i += cl;
    }
    if (unk) {
        id[n++] = tok->unk_id;
    }
    return n;
}


/* a symbol of the short path with the pair it starts: one memmove per merge */
typedef struct {
    uint32_t  rk;       /* rank of (this, next), UINT32_MAX: none */
    uint32_t  mid;      /* what the pair merges into */
    uint32_t  id;
} tok_ssym_t;


static void
tok_bpe_small(tok_work_t *w, const char *s, size_t len, uint64_t h)
{
    const dpd_tok_t  *tok = w->tok;
    uint32_t          id[TOK_BPE_SMALL], best;
    tok_ssym_t        y[TOK_BPE_SMALL];
    size_t            i, n, b;

    n = tok_bpe_word(tok, s, len, id);
    if (n == 0) {
        return;
    }
    /* all first-round lookups are independent: start their cache misses
     * together, then read (rk holds the slots in the meantime) */
    for (i = 0; i + 1 < n; i++) {
        y[i].id = id[i];
        y[i].rk = tok_pairmap_slot(&tok->merges, tok_pair_key(id[i], id[i + 1]));
        __builtin_prefetch(&tok->merges.slots[y[i].rk]);
    }
    y[n - 1].id = id[n - 1];
    for (i = 0; i + 1 < n; i++) {
        if (!tok_pairmap_get_at(&tok->merges, tok_pair_key(id[i], id[i + 1]),
                                y[i].rk, &y[i].rk, &y[i].mid))
        {
            y[i].rk = UINT32_MAX;
        }
    }
    y[n - 1].rk = UINT32_MAX;

    while (n > 1) {
        best = UINT32_MAX;
        b = 0;
        for (i = 0; i + 1 < n; i++) {
            if (y[i].rk < best) {
                best = y[i].rk;
                b = i;
            }
        }
        if (best == UINT32_MAX) {
            break;
        }
        y[b].id = y[b].mid;
        n--;
        memmove(&y[b + 1], &y[b + 2], (n - b - 1) * sizeof(tok_ssym_t));
        if (b > 0 && !tok_pairmap_get(&tok->merges, y[b - 1].id, y[b].id,
                                      &y[b - 1].rk, &y[b - 1].mid))
        {
            y[b - 1].rk = UINT32_MAX;
        }
        if (b + 1 < n) {
            if (!tok_pairmap_get(&tok->merges, y[b].id, y[b + 1].id,
                                 &y[b].rk, &y[b].mid))
            {
                y[b].rk = UINT32_MAX;
            }
        } else {
            y[b].rk = UINT32_MAX;
        }
    }
    for (i = 0; i < n; i++) {
        id[i] = y[i].id;
        tok_emit(w->sink, id[i]);
    }
    if (h != 0 && n <= TOK_CACHE_MAXIDS) {
        tok_cache_t *c = tok_cache_get();
        if (c != NULL) {
            tok_cache_ent_t *e = &c->e[h & (TOK_CACHE_SLOTS - 1)];
            e->hash = h;
            e->gen = tok->gen;
            e->len = (uint8_t) len;
            e->nids = (uint8_t) n;
            memcpy(e->bytes, s, len);
            memcpy(e->ids, id, n * sizeof(uint32_t));
        }
    }
}


void
tok_bpe(tok_work_t *w, const char *s, size_t len)
{
    const dpd_tok_t  *tok = w->tok;
    uint32_t          id;
    uint64_t          h;

    if (len == 0) {
        return;
    }
    if (len == 1) {
        id = tok->byte_id[(uint8_t) s[0]];
        if (id != TOK_NO_ID) {
            tok_emit(w->sink, id);
            return;
        }
        if (tok->unk_id == TOK_NO_ID && !tok->byte_fallback) {
            return;
        }
    }
    h = tok_hash_bytes(s, len);
    if (tok->ignore_merges) {
        id = tok_strmap_get_h(&tok->vocab, s, len, h);
        if (id != TOK_NO_ID) {
            tok_emit(w->sink, id);
            return;
        }
    }
    tok_bpe_merge(w, s, len, h);
}


/*
 * The rest of tok_bpe(): the pre-token (len >= 1) is not a token of its
 * own under ignore_merges; h = tok_hash_bytes(s, len).  The cache, then
 * the merges.
 */
void
tok_bpe_merge(tok_work_t *w, const char *s, size_t len, uint64_t h)
{
    const dpd_tok_t  *tok = w->tok;
    tok_sym_t        *sym, *l, sym_stack[TOK_BPE_STACK];
    uint64_t         *t, c, tree_stack[2 * TOK_BPE_STACK];
    size_t            i, nn;
    int32_t           n = 0, prev, nx;
    uint32_t          rank, pos;

    if (len <= TOK_CACHE_MAXLEN) {
        tok_cache_t *tc = tok_cache_get();
        if (tc != NULL) {
            const tok_cache_ent_t *e = &tc->e[h & (TOK_CACHE_SLOTS - 1)];
            if (e->hash == h && e->gen == tok->gen && e->len == len
                && tok_bytes_eq(e->bytes, s, len))
            {
                for (i = 0; i < e->nids; i++) {
                    tok_emit(w->sink, e->ids[i]);
                }
                return;
            }
        }
    } else {
        h = 0;      /* too long to cache */
    }
    if (len <= TOK_BPE_SMALL) {
        tok_bpe_small(w, s, len, h | (h == 0 && len <= TOK_CACHE_MAXLEN));
        return;
    }
    if (len > TOK_BPE_TREE_MAX) {
        tok_bpe_merge_heap(w, s, len);
        return;
    }
    if (len <= TOK_BPE_STACK) {
        sym = sym_stack;
        t = tree_stack;
    } else {
        if (tok_work_reserve(w, len, sizeof(tok_sym_t), 2 * len) != 0) {
            w->oom = 1;
            return;
        }
        sym = w->sym;
        t = w->tree;
    }

    /* the word's ids go through the tree's space (2 * len nodes of 8
     * bytes hold len ids), then into the symbols */
    n = (int32_t) tok_bpe_word(tok, s, len, (uint32_t *) t);
    if (n == 0) {
        return;
    }
    for (i = 0; i < (size_t) n; i++) {
        sym[i].id = ((uint32_t *) t)[i];
        sym[i].prev = (int32_t) i - 1;
        sym[i].next = (int32_t) i + 1;
    }
    sym[n - 1].next = -1;

    /* the first lookups are independent: start their cache misses
     * together (the leaves hold the slots in the meantime), then read */
    nn = (size_t) n;
    for (i = 0; i + 1 < nn; i++) {
        t[nn + i] = tok_pairmap_slot(&tok->merges,
                                     tok_pair_key(sym[i].id, sym[i + 1].id));
        __builtin_prefetch(&tok->merges.slots[t[nn + i]]);
    }
    for (i = 0; i + 1 < nn; i++) {
        t[nn + i] = tok_pairmap_get_at(&tok->merges,
                                       tok_pair_key(sym[i].id, sym[i + 1].id),
                                       (uint32_t) t[nn + i], &rank,
                                       &sym[i].mid)
                    ? tok_leaf(rank, i) : TOK_LEAF_NONE;
    }
    t[2 * nn - 1] = TOK_LEAF_NONE;
    for (i = nn - 1; i > 0; i--) {
        t[i] = t[2 * i] < t[2 * i + 1] ? t[2 * i] : t[2 * i + 1];
    }

    /* t[1] for n == 1 is the only leaf, TOK_LEAF_NONE */
    while ((c = t[1]) != TOK_LEAF_NONE) {
        pos = (uint32_t) c;
        l = &sym[pos];
        nx = l->next;
        l->id = l->mid;
        l->next = sym[nx].next;
        tok_tree_set(t, nn, (size_t) nx, TOK_LEAF_NONE);
        if (l->next >= 0) {
            sym[l->next].prev = (int32_t) pos;
        }

        prev = l->prev;
        if (prev >= 0) {
            tok_tree_set(t, nn, (size_t) prev,
                         tok_pairmap_get(&tok->merges, sym[prev].id, l->id,
                                         &rank, &sym[prev].mid)
                         ? tok_leaf(rank, prev) : TOK_LEAF_NONE);
        }
        nx = l->next;
        tok_tree_set(t, nn, pos,
                     nx >= 0 && tok_pairmap_get(&tok->merges, l->id,
                                                sym[nx].id, &rank, &l->mid)
                     ? tok_leaf(rank, pos) : TOK_LEAF_NONE);
    }

    for (i = 0; (int32_t) i >= 0 && i < (size_t) n; ) {
        tok_emit(w->sink, sym[i].id);
        if (sym[i].next < 0) {
            break;
        }
        i = (size_t) sym[i].next;
    }
}
