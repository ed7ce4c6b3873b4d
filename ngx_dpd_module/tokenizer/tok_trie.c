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
 * every node's children come out sorted by byte.  That byte trie is then
 * laid out path-compressed, breadth first.
 */
int
tok_trie_build(tok_trie_t *t, const tok_added_t *added, uint32_t n,
    int normalized)
{
    uint32_t   *idx = NULL, *path = NULL, *parent = NULL, *first = NULL;
    uint32_t   *cnt = NULL, *kids = NULL, *orig = NULL;
    uint32_t    m = 0, i, nn = 1, x, k, c, ne, nl;
    uint8_t    *byte = NULL;
    int32_t    *term = NULL;
    size_t      total = 1, maxlen = 0, j, common;
    const tok_added_t  *prev = NULL;
    tok_trie_node_t    *nd;

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

    /* the children of each byte-trie node; creation order is byte order */
    first = calloc(nn + 1, sizeof(*first));
    cnt = calloc(nn, sizeof(*cnt));
    kids = malloc(nn * sizeof(*kids));
    orig = malloc(nn * sizeof(*orig));
    t->nodes = calloc(nn, sizeof(*t->nodes));
    t->edge_byte = malloc(nn);
    t->edge_child = malloc(nn * sizeof(*t->edge_child));
    t->labels = malloc(nn);
    if (!first || !cnt || !kids || !orig || !t->nodes || !t->edge_byte
        || !t->edge_child || !t->labels)
    {
        goto nomem;
    }
    for (i = 1; i < nn; i++) {
        first[parent[i] + 1]++;
    }
    for (i = 0; i < nn; i++) {
        first[i + 1] += first[i];
    }
    for (i = 1; i < nn; i++) {
        kids[first[parent[i]] + cnt[parent[i]]++] = i;
    }

    /*
     * Node k of the compressed trie stands for byte-trie node orig[k],
     * reached by its byte; its label runs down the chain below it while a
     * node ends no token and has one child.  Children are numbered as
     * they are found: breadth first, so orig[k] is known when k is laid.
     */
    orig[0] = 0;
    t->nodes[0].token = -1;
    for (j = 0; j < cnt[0]; j++) {
        x = kids[first[0] + j];
        t->root[byte[x]] = (uint32_t) j + 1;
        orig[j + 1] = x;
    }
    k = cnt[0] + 1;
    ne = 0;
    nl = 0;
    for (c = 1; c < k; c++) {
        nd = &t->nodes[c];
        x = orig[c];
        nd->label = nl;
        while (term[x] < 0 && cnt[x] == 1) {
            x = kids[first[x]];
            t->labels[nl++] = (char) byte[x];
        }
        nd->label_len = nl - nd->label;
        nd->token = term[x];
        nd->first_edge = ne;
        nd->n_edges = cnt[x];
        for (j = 0; j < cnt[x]; j++) {
            t->edge_byte[ne] = byte[kids[first[x] + j]];
            t->edge_child[ne++] = k;
            orig[k++] = kids[first[x] + j];
        }
    }
    t->n_nodes = k;
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
    free(first);
    free(cnt);
    free(kids);
    free(orig);
    return 0;

nomem:
    free(idx);
    free(path);
    free(parent);
    free(byte);
    free(term);
    free(first);
    free(cnt);
    free(kids);
    free(orig);
    tok_trie_free(t);
    return -1;
}


void
tok_trie_free(tok_trie_t *t)
{
    free(t->nodes);
    free(t->edge_byte);
    free(t->edge_child);
    free(t->labels);
    memset(t, 0, sizeof(*t));
}


int32_t
tok_trie_match(const tok_trie_t *t, const char *s, size_t len, size_t *mlen)
{
    const uint8_t          *p = (const uint8_t *) s, *e = p + len, *eb;
    const tok_trie_node_t  *nd;
    uint32_t                node, lo, hi, mid;
    int32_t                 best = -1;
    uint8_t                 b;

    if (len == 0) {
        return -1;
    }
    node = t->root[*p++];

    while (node != 0) {
        nd = &t->nodes[node];
        if (nd->label_len > 0) {
            /* no token ends inside a label: a mismatch ends the search */
            if ((size_t) (e - p) < nd->label_len
                || !tok_bytes_eq((const char *) p, t->labels + nd->label,
                                 nd->label_len))
            {
                break;
            }
            p += nd->label_len;
        }
        if (nd->token >= 0) {
            best = nd->token;
            *mlen = (size_t) (p - (const uint8_t *) s);
        }
        if (p == e || nd->n_edges == 0) {
            break;
        }

        b = *p++;
        eb = t->edge_byte + nd->first_edge;
        node = 0;
        if (nd->n_edges <= 8) {
            /* few children (most nodes): a scan of the sorted bytes */
            for (lo = 0; lo < nd->n_edges && eb[lo] <= b; lo++) {
                if (eb[lo] == b) {
                    node = t->edge_child[nd->first_edge + lo];
                    break;
                }
            }
            continue;
        }
        lo = 0;
        hi = nd->n_edges;
        while (lo < hi) {
            mid = (lo + hi) / 2;
            if (eb[mid] < b) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        if (lo < nd->n_edges && eb[lo] == b) {
            node = t->edge_child[nd->first_edge + lo];
        }
    }
    return best;
}
