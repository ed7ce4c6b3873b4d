/*
 * Byte-level BPE on one pre-token, merge for merge as Hugging Face's
 * Word::merge_all: a min-heap of candidate pairs ordered by (rank, left
 * position); a popped candidate is applied if the pair now at that
 * position still produces the same merged id, that is still has the same
 * rank (one rank, one pair of the merges table).
 *
 * Pieces of up to TOK_BPE_SMALL bytes take a simpler path with the same
 * result: keep the rank of every adjacent pair, apply the lowest (the
 * leftmost among equal ranks), update the two pairs around it.  The heap
 * applies exactly that sequence: symbols only ever grow, so a popped entry
 * whose merged id still matches is the very pair it was pushed for.
 */

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

#define TOK_BPE_SMALL  128

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
 * The scratch of a long piece is per byte of the piece: one symbol (12
 * bytes) and, at first, one candidate (8 bytes) per byte, 20 bytes in all
 * (a 2 MB word: 40 MB for the call).  A candidate keeps no merged id: the
 * rank names one pair of the merges table, and a symbol only ever grows,
 * so the pair now at pos with the same rank is the pair it was pushed for.
 */
typedef struct {
    uint32_t  id;       /* TOK_NO_ID once merged into its left neighbour */
    int32_t   prev;
    int32_t   next;
} tok_sym_t;

typedef struct {
    uint32_t  rank;
    uint32_t  pos;
} tok_cand_t;


static inline int
tok_cand_less(const tok_cand_t *a, const tok_cand_t *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}


static void
tok_heap_push(tok_cand_t *h, size_t *n, tok_cand_t c)
{
    size_t  i = (*n)++, p;

    while (i > 0) {
        p = (i - 1) / 2;
        if (!tok_cand_less(&c, &h[p])) {
            break;
        }
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}


static tok_cand_t
tok_heap_pop(tok_cand_t *h, size_t *n)
{
    tok_cand_t  top = h[0], last = h[--(*n)];
    size_t      i = 0, c;

    for ( ;; ) {
        c = 2 * i + 1;
        if (c >= *n) {
            break;
        }
        if (c + 1 < *n && tok_cand_less(&h[c + 1], &h[c])) {
            c++;
        }
        if (!tok_cand_less(&h[c], &last)) {
            break;
        }
        h[i] = h[c];
        i = c;
    }
    if (*n > 0) {
        h[i] = last;
    }
    return top;
}


static int
tok_work_reserve(tok_work_t *w, size_t len)
{
    void  *p;

    if (w->sym_cap < len) {
        p = realloc(w->sym, len * sizeof(tok_sym_t));
        if (p == NULL) {
            return -1;
        }
        w->sym = p;
        w->sym_cap = len;
    }
    /* each merge pushes at most 2 candidates: len + 2 * len bounds it */
    if (w->heap_cap < 3 * len) {
        p = realloc(w->heap, 3 * len * sizeof(tok_cand_t));
        if (p == NULL) {
            return -1;
        }
        w->heap = p;
        w->heap_cap = 3 * len;
    }
    return 0;
}


static void
tok_bpe_small(tok_work_t *w, const char *s, size_t len, uint64_t h)
{
    const dpd_tok_t  *tok = w->tok;
    uint32_t          id[TOK_BPE_SMALL], rk[TOK_BPE_SMALL];
    uint32_t          mid[TOK_BPE_SMALL], best, x;
    size_t            i, n = 0, b;

    for (i = 0; i < len; i++) {
        x = tok->byte_id[(uint8_t) s[i]];
        if (x != TOK_NO_ID) {
            id[n++] = x;
        }
    }
    if (n == 0) {
        return;
    }
    /* all first-round lookups are independent: start their cache misses
     * together, then read (rk and mid hold the slots in the meantime) */
    for (i = 0; i + 1 < n; i++) {
        rk[i] = tok_pairmap_slot(&tok->merges, tok_pair_key(id[i], id[i + 1]));
        __builtin_prefetch(&tok->merges.slots[rk[i]]);
    }
    for (i = 0; i + 1 < n; i++) {
        if (!tok_pairmap_get_at(&tok->merges, tok_pair_key(id[i], id[i + 1]),
                                rk[i], &rk[i], &mid[i]))
        {
            rk[i] = UINT32_MAX;
        }
    }
    rk[n - 1] = UINT32_MAX;

    while (n > 1) {
        best = UINT32_MAX;
        b = 0;
        for (i = 0; i + 1 < n; i++) {
            if (rk[i] < best) {
                best = rk[i];
                b = i;
            }
        }
        if (best == UINT32_MAX) {
            break;
        }
        id[b] = mid[b];
        n--;
        memmove(&id[b + 1], &id[b + 2], (n - b - 1) * sizeof(uint32_t));
        memmove(&rk[b + 1], &rk[b + 2], (n - b - 1) * sizeof(uint32_t));
        memmove(&mid[b + 1], &mid[b + 2], (n - b - 1) * sizeof(uint32_t));
        if (b > 0 && !tok_pairmap_get(&tok->merges, id[b - 1], id[b],
                                      &rk[b - 1], &mid[b - 1]))
        {
            rk[b - 1] = UINT32_MAX;
        }
        if (b + 1 < n) {
            if (!tok_pairmap_get(&tok->merges, id[b], id[b + 1], &rk[b],
                                 &mid[b]))
            {
                rk[b] = UINT32_MAX;
            }
        } else {
            rk[b] = UINT32_MAX;
        }
    }
    for (i = 0; i < n; i++) {
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
    tok_sym_t        *sym;
    tok_cand_t       *heap, c;
    size_t            i, nh = 0;
    int32_t           n = 0, prev, nx;
    uint32_t          id, rank, merged;
    uint64_t          h;

    if (len == 0) {
        return;
    }
    if (len == 1) {
        id = tok->byte_id[(uint8_t) s[0]];
        if (id != TOK_NO_ID) {
            tok_emit(w->sink, id);
        }
        return;
    }
    h = tok_hash_bytes(s, len);
    if (tok->ignore_merges) {
        id = tok_strmap_get_h(&tok->vocab, s, len, h);
        if (id != TOK_NO_ID) {
            tok_emit(w->sink, id);
            return;
        }
    }
    if (len <= TOK_CACHE_MAXLEN) {
        tok_cache_t *tc = tok_cache_get();
        if (tc != NULL) {
            const tok_cache_ent_t *e = &tc->e[h & (TOK_CACHE_SLOTS - 1)];
            if (e->hash == h && e->gen == tok->gen && e->len == len
                && memcmp(e->bytes, s, len) == 0)
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
    if (tok_work_reserve(w, len) != 0) {
        w->oom = 1;
        return;
    }
    sym = w->sym;
    heap = w->heap;

    /* one symbol per byte; bytes the vocabulary lacks are dropped, as
     * Hugging Face does without unk_token and byte_fallback */
    for (i = 0; i < len; i++) {
        id = tok->byte_id[(uint8_t) s[i]];
        if (id == TOK_NO_ID) {
            continue;
        }
        sym[n].id = id;
        sym[n].prev = n - 1;
        sym[n].next = n + 1;
        n++;
    }
    if (n == 0) {
        return;
    }
    sym[n - 1].next = -1;

    for (i = 0; i + 1 < (size_t) n; i++) {
        if (tok_pairmap_get(&tok->merges, sym[i].id, sym[i + 1].id,
                            &rank, &merged))
        {
            c.rank = rank;
            c.pos = (uint32_t) i;
            tok_heap_push(heap, &nh, c);
        }
    }

    while (nh > 0) {
        c = tok_heap_pop(heap, &nh);
        tok_sym_t *l = &sym[c.pos];
        if (l->id == TOK_NO_ID || l->next < 0) {
            continue;
        }
        nx = l->next;
        if (!tok_pairmap_get(&tok->merges, l->id, sym[nx].id, &rank, &merged)
            || rank != c.rank)
        {
            continue;
        }
        l->id = merged;
        l->next = sym[nx].next;
        sym[nx].id = TOK_NO_ID;
        if (l->next >= 0) {
            sym[l->next].prev = (int32_t) c.pos;
        }

        prev = l->prev;
        if (prev >= 0 && tok_pairmap_get(&tok->merges, sym[prev].id, l->id,
                                         &rank, &merged))
        {
            c.rank = rank;
            c.pos = (uint32_t) prev;
            if (nh < w->heap_cap) {
                tok_heap_push(heap, &nh, c);
            }
        }
        nx = l->next;
        if (nx >= 0 && tok_pairmap_get(&tok->merges, l->id, sym[nx].id,
                                       &rank, &merged))
        {
            c.rank = rank;
            c.pos = (uint32_t) (l - sym);
            if (nh < w->heap_cap) {
                tok_heap_push(heap, &nh, c);
            }
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
