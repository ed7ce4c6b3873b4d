/*
 * Byte trie over the added tokens.  Scanning every start position and
 * taking the longest token that starts there is exactly Hugging Face's
 * Aho-Corasick LeftmostLongest search; the first-byte table skips most
 * positions without touching the trie.
 */

#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"


static int
tok_idx_cmp(const void *a, const void *b, void *base)
{
    const tok_added_t  *x = (const tok_added_t *) base + *(const uint32_t *) a;
    const tok_added_t  *y = (const tok_added_t *) base + *(const uint32_t *) b;
    size_t              n = x->len < y->len ? x->len : y->len;
    int                 c = memcmp(x->content, y->content, n);

    if (c != 0) {
        return c;
    }
    if (x->len != y->len) {
        return x->len < y->len ? -1 : 1;
    }
    /* equal contents: keep file order so the later one wins below */
    return *(const uint32_t *) a < *(const uint32_t *) b ? -1 : 1;
}


/*
 * Built from the tokens in byte order: each token shares a prefix with the
 * previous one, so new nodes are only appended along the previous path and
 * every node's children come out sorted by byte.
 */
int
tok_trie_build(tok_trie_t *t, const tok_added_t *added, uint32_t n,
    int normalized)
{
    uint32_t   *idx = NULL, *path = NULL, *parent = NULL, m = 0, i, nn = 1;
    uint8_t    *byte = NULL;
    int32_t    *term = NULL;
    size_t      total = 1, maxlen = 0, j, common, ne;
    const tok_added_t  *prev = NULL;

    memset(t, 0, sizeof(*t));
    for (i = 0; i < n; i++) {
        total += added[i].len;
        if (added[i].len > maxlen) {
            maxlen = added[i].len;
        }
    }

    idx = malloc((n ? n : 1) * sizeof(*idx));
    path = malloc((maxlen + 1) * sizeof(*path));
    parent = malloc(total * sizeof(*parent));
    byte = malloc(total);
    term = malloc(total * sizeof(*term));
    if (!idx || !path || !parent || !byte || !term) {
        goto nomem;
    }
    for (i = 0; i < n; i++) {
        if ((int) added[i].normalized == normalized && added[i].len > 0) {
            idx[m++] = i;
        }
    }
    qsort_r(idx, m, sizeof(*idx), tok_idx_cmp, (void *) added);

    term[0] = -1;
    path[0] = 0;
    for (i = 0; i < m; i++) {
        const tok_added_t *a = &added[idx[i]];
        common = 0;
        if (prev) {
            while (common < a->len && common < prev->len
                   && a->content[common] == prev->content[common])
            {
                common++;
            }
        }
        for (j = common; j < a->len; j++) {
            parent[nn] = path[j];
            byte[nn] = (uint8_t) a->content[j];
            term[nn] = -1;
            path[j + 1] = nn++;
        }
        /* equal contents sort by file order: the later duplicate wins */
        term[path[a->len]] = (int32_t) idx[i];
        t->first[(uint8_t) a->content[0]] = 1;
        prev = a;
    }

    /* lay the edges out per parent; creation order is byte order */
    t->nodes = calloc(nn, sizeof(*t->nodes));
    t->edges = malloc(nn * sizeof(*t->edges));
    if (t->nodes == NULL || t->edges == NULL) {
        goto nomem;
    }
    for (i = 0; i < nn; i++) {
        t->nodes[i].token = term[i];
    }
    for (i = 1; i < nn; i++) {
        t->nodes[parent[i]].n_edges++;
    }
    ne = 0;
    for (i = 0; i < nn; i++) {
        t->nodes[i].first_edge = (uint32_t) ne;
        ne += t->nodes[i].n_edges;
        t->nodes[i].n_edges = 0;
    }
    for (i = 1; i < nn; i++) {
        tok_trie_node_t *p = &t->nodes[parent[i]];
        tok_trie_edge_t *e = &t->edges[p->first_edge + p->n_edges++];
        e->byte = byte[i];
        e->child = i;
    }
    t->n_nodes = nn;
    t->empty = (m == 0);

    /* one first byte (Llama 3, Qwen: every added token starts with '<'):
     * the text is searched for it with memchr */
    t->single = -1;
    for (i = 0, j = 0; i < 256; i++) {
        if (t->first[i]) {
            t->single = (int) i;
            j++;
        }
    }
    if (j != 1) {
        t->single = -1;
    }

    free(idx);
    free(path);
    free(parent);
    free(byte);
    free(term);
    return 0;

nomem:
    free(idx);
    free(path);
    free(parent);
    free(byte);
    free(term);
    tok_trie_free(t);
    return -1;
}


void
tok_trie_free(tok_trie_t *t)
{
    free(t->nodes);
    free(t->edges);
    memset(t, 0, sizeof(*t));
}


int32_t
tok_trie_match(const tok_trie_t *t, const char *s, size_t len, size_t *mlen)
{
    uint32_t  node = 0, lo, hi, mid;
    int32_t   best = -1;
    size_t    i;

    for (i = 0; i < len; i++) {
        const tok_trie_node_t *nd = &t->nodes[node];
        uint8_t b = (uint8_t) s[i];

        lo = nd->first_edge;
        hi = lo + nd->n_edges;
        while (lo < hi) {
            mid = (lo + hi) / 2;
            if (t->edges[mid].byte < b) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        if (lo == nd->first_edge + nd->n_edges || t->edges[lo].byte != b) {
            break;
        }
        node = t->edges[lo].child;
        if (t->nodes[node].token >= 0) {
            best = t->nodes[node].token;
            *mlen = i + 1;
        }
    }
    return best;
}
