/*
 * Open-addressing hashes: byte string -> id (the vocabulary) and
 * (left id, right id) -> (rank, merged id) (the merges).  Linear probing,
 * load factor <= 1/2, built once at load and read-only afterwards.
 */

#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"


static uint64_t
tok_hash_bytes(const char *s, size_t len)
{
    /* FNV-1a over 8-byte words, finished with a 64-bit mixer */
    uint64_t  h = 0xcbf29ce484222325ULL ^ len;
    uint64_t  w;

    while (len >= 8) {
        memcpy(&w, s, 8);
        h = (h ^ w) * 0x100000001b3ULL;
        h ^= h >> 29;
        s += 8;
        len -= 8;
    }
    w = 0;
    memcpy(&w, s, len);
    h = (h ^ w) * 0x100000001b3ULL;
    return tok_mix64(h);
}


static uint32_t
tok_pow2_slots(uint32_t expect)
{
    uint32_t  n = 16;

    while (n < expect * 2 + 1 && n < (1u << 31)) {
        n <<= 1;
    }
    return n;
}


int
tok_strmap_init(tok_strmap_t *m, uint32_t expect)
{
    uint32_t  slots = tok_pow2_slots(expect);

    memset(m, 0, sizeof(*m));
    m->slots = calloc(slots, sizeof(uint32_t));
    m->cap = expect ? expect : 1;
    m->off = malloc(m->cap * sizeof(uint32_t));
    m->len = malloc(m->cap * sizeof(uint32_t));
    m->id = malloc(m->cap * sizeof(uint32_t));
    m->pool_cap = (size_t) m->cap * 8 + 64;
    m->pool = malloc(m->pool_cap);
    m->mask = slots - 1;
    if (!m->slots || !m->off || !m->len || !m->id || !m->pool) {
        tok_strmap_free(m);
        return -1;
    }
    return 0;
}


void
tok_strmap_free(tok_strmap_t *m)
{
    free(m->slots);
    free(m->off);
    free(m->len);
    free(m->id);
    free(m->pool);
    memset(m, 0, sizeof(*m));
}


static int
tok_strmap_grow(tok_strmap_t *m)
{
    uint32_t   slots = (m->mask + 1) * 2;
    uint32_t  *ns, i, j;

    ns = calloc(slots, sizeof(uint32_t));
    if (ns == NULL) {
        return -1;
    }
    for (i = 0; i < m->n; i++) {
        j = (uint32_t) tok_hash_bytes(m->pool + m->off[i], m->len[i])
            & (slots - 1);
        while (ns[j]) {
            j = (j + 1) & (slots - 1);
        }
        ns[j] = i + 1;
    }
    free(m->slots);
    m->slots = ns;
    m->mask = slots - 1;
    return 0;
}


int
tok_strmap_put(tok_strmap_t *m, const char *s, size_t len, uint32_t id)
{
    uint32_t  i, e;
    void     *p;

    i = (uint32_t) tok_hash_bytes(s, len) & m->mask;
    while ((e = m->slots[i]) != 0) {
        e--;
        if (m->len[e] == len && memcmp(m->pool + m->off[e], s, len) == 0) {
            m->id[e] = id;
            return 1;
        }
        i = (i + 1) & m->mask;
    }

    if (m->n == m->cap) {
        uint32_t ncap = m->cap * 2;
        if ((p = realloc(m->off, ncap * sizeof(uint32_t))) == NULL) {
            return -1;
        }
        m->off = p;
        if ((p = realloc(m->len, ncap * sizeof(uint32_t))) == NULL) {
            return -1;
        }
        m->len = p;
        if ((p = realloc(m->id, ncap * sizeof(uint32_t))) == NULL) {
            return -1;
        }
        m->id = p;
        m->cap = ncap;
    }
    if (m->pool_len + len + 1 > m->pool_cap) {
        size_t ncap = m->pool_cap * 2 + len + 1;
        if ((p = realloc(m->pool, ncap)) == NULL) {
            return -1;
        }
        m->pool = p;
        m->pool_cap = ncap;
    }
    if (m->pool_len > UINT32_MAX - len - 1) {
        return -1;
    }

    memcpy(m->pool + m->pool_len, s, len);
    m->pool[m->pool_len + len] = '\0';
    m->off[m->n] = (uint32_t) m->pool_len;
    m->len[m->n] = (uint32_t) len;
    m->id[m->n] = id;
    m->pool_len += len + 1;
    m->slots[i] = ++m->n;

    if ((uint64_t) m->n * 2 > m->mask) {
        return tok_strmap_grow(m);
    }
    return 0;
}


uint32_t
tok_strmap_get(const tok_strmap_t *m, const char *s, size_t len)
{
    uint32_t  i, e;

    i = (uint32_t) tok_hash_bytes(s, len) & m->mask;
    while ((e = m->slots[i]) != 0) {
        e--;
        if (m->len[e] == len && memcmp(m->pool + m->off[e], s, len) == 0) {
            return m->id[e];
        }
        i = (i + 1) & m->mask;
    }
    return TOK_NO_ID;
}


int
tok_pairmap_init(tok_pairmap_t *m, uint32_t expect)
{
    uint32_t  slots = 16;

    /* load factor up to 3/4: the pair table is the largest one we keep */
    while ((uint64_t) slots * 3 < (uint64_t) expect * 4 + 4
           && slots < (1u << 31))
    {
        slots <<= 1;
    }

    memset(m, 0, sizeof(*m));
    m->keys = calloc(slots, sizeof(uint64_t));
    m->rank = malloc(slots * sizeof(uint32_t));
    m->merged = malloc(slots * sizeof(uint32_t));
    m->mask = slots - 1;
    if (!m->keys || !m->rank || !m->merged) {
        tok_pairmap_free(m);
        return -1;
    }
    return 0;
}


void
tok_pairmap_free(tok_pairmap_t *m)
{
    free(m->keys);
    free(m->rank);
    free(m->merged);
    memset(m, 0, sizeof(*m));
}


int
tok_pairmap_put(tok_pairmap_t *m, uint32_t l, uint32_t r, uint32_t rank,
    uint32_t merged)
{
    uint64_t  key = (((uint64_t) l << 32) | r) + 1;
    uint32_t  i = (uint32_t) tok_mix64(key) & m->mask;

    /* the table is sized for all merges at init: never more than 3/4 full */
    if ((uint64_t) (m->n + 1) * 4 > ((uint64_t) m->mask + 1) * 3) {
        return -1;
    }
    while (m->keys[i] != 0 && m->keys[i] != key) {
        i = (i + 1) & m->mask;
    }
    if (m->keys[i] == 0) {
        m->n++;
    }
    /* a pair listed twice keeps its last rank, as Hugging Face does */
    m->keys[i] = key;
    m->rank[i] = rank;
    m->merged[i] = merged;
    return 0;
}
