/*
 * Open-addressing hashes: byte string -> id (the vocabulary) and
 * (left id, right id) -> (rank, merged id) (the merges).  Linear probing,
 * built once at load and read-only afterwards.
 */

#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"


int
tok_strmap_init(tok_strmap_t *m, uint32_t expect)
{
    uint32_t  slots = 16;

    while (slots < expect * 2 + 1 && slots < (1u << 31)) {
        slots <<= 1;
    }
    memset(m, 0, sizeof(*m));
    m->slots = calloc(slots, sizeof(uint64_t));
    m->cap = expect ? expect : 1;
    m->ent = malloc(m->cap * sizeof(tok_strent_t));
    m->pool_cap = (size_t) m->cap * 8 + 64;
    m->pool = malloc(m->pool_cap);
    m->mask = slots - 1;
    if (!m->slots || !m->ent || !m->pool) {
        tok_strmap_free(m);
        return -1;
    }
    return 0;
}


void
tok_strmap_free(tok_strmap_t *m)
{
    free(m->slots);
    free(m->ent);
    free(m->pool);
    memset(m, 0, sizeof(*m));
}


static int
tok_strmap_grow(tok_strmap_t *m)
{
    uint32_t   slots = (m->mask + 1) * 2, i, j;
    uint64_t  *ns, h;

    ns = calloc(slots, sizeof(uint64_t));
    if (ns == NULL) {
        return -1;
    }
    for (i = 0; i < m->n; i++) {
        h = tok_hash_bytes(m->pool + m->ent[i].off, m->ent[i].len);
        j = (uint32_t) h & (slots - 1);
        while (ns[j]) {
            j = (j + 1) & (slots - 1);
        }
        ns[j] = (h & 0xffffffff00000000ULL) | (i + 1);
    }
    free(m->slots);
    m->slots = ns;
    m->mask = slots - 1;
    return 0;
}


int
tok_strmap_put(tok_strmap_t *m, const char *s, size_t len, uint32_t id)
{
    uint64_t       h = tok_hash_bytes(s, len), tag = h & 0xffffffff00000000ULL;
    uint32_t       i = (uint32_t) h & m->mask;
    tok_strent_t  *e;
    void          *p;

    while (m->slots[i] != 0) {
        if ((m->slots[i] & 0xffffffff00000000ULL) == tag) {
            e = &m->ent[(uint32_t) m->slots[i] - 1];
            if (e->len == len && tok_bytes_eq(m->pool + e->off, s, len)) {
                e->id = id;
                return 1;
            }
        }
        i = (i + 1) & m->mask;
    }

    if (m->n == m->cap) {
        p = realloc(m->ent, (size_t) m->cap * 2 * sizeof(tok_strent_t));
        if (p == NULL) {
            return -1;
        }
        m->ent = p;
        m->cap *= 2;
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
    e = &m->ent[m->n];
    e->off = (uint32_t) m->pool_len;
    e->len = (uint32_t) len;
    e->id = id;
    m->pool_len += len + 1;
    m->slots[i] = tag | ++m->n;

    if ((uint64_t) m->n * 2 > m->mask) {
        return tok_strmap_grow(m);
    }
    return 0;
}


uint32_t
tok_strmap_get(const tok_strmap_t *m, const char *s, size_t len)
{
    return tok_strmap_get_h(m, s, len, tok_hash_bytes(s, len));
}


int
tok_pairmap_init(tok_pairmap_t *m, uint32_t expect)
{
    uint32_t  slots = 16, shift = 60;

    /* load factor up to 3/4: the pair table is the largest one we keep */
    while ((uint64_t) slots * 3 < (uint64_t) expect * 4 + 4
           && slots < (1u << 30))
    {
        slots <<= 1;
        shift--;
    }
    memset(m, 0, sizeof(*m));
    m->slots = calloc(slots, sizeof(tok_pairslot_t));
    m->mask = slots - 1;
    m->shift = shift;
    if (m->slots == NULL) {
        return -1;
    }
    return 0;
}


void
tok_pairmap_free(tok_pairmap_t *m)
{
    free(m->slots);
    memset(m, 0, sizeof(*m));
}


int
tok_pairmap_put(tok_pairmap_t *m, uint32_t l, uint32_t r, uint32_t rank,
    uint32_t merged)
{
    uint64_t  key = (((uint64_t) l << 32) | r) + 1;
    uint32_t  i = tok_pairmap_slot(m, key);

    /* the table is sized for all merges at init: never more than 3/4 full */
    if ((uint64_t) (m->n + 1) * 4 > ((uint64_t) m->mask + 1) * 3) {
        return -1;
    }
    while (m->slots[i].key != 0 && m->slots[i].key != key) {
        i = (i + 1) & m->mask;
    }
    if (m->slots[i].key == 0) {
        m->n++;
    }
    /* a pair listed twice keeps its last rank, as Hugging Face does */
    m->slots[i].key = key;
    m->slots[i].rank = rank;
    m->slots[i].merged = merged;
    return 0;
}
