/*
 * Differential check of the two load paths (tok_load_fast.c against cJSON
 * for the whole file): the same text must give the same refusal message,
 * or tables equal to the byte.  Used by the load fuzzer and by
 * t/tokenizer/load_diff.c.
 */

#ifndef TOK_LOAD_DIFF_H
#define TOK_LOAD_DIFF_H

#include <stdio.h>
#include <string.h>

#include "../tok_internal.h"


static int
tok_diff_strmap(const tok_strmap_t *a, const tok_strmap_t *b)
{
    return a->mask == b->mask && a->n == b->n && a->pool_len == b->pool_len
           && memcmp(a->slots, b->slots, ((size_t) a->mask + 1)
                                         * sizeof(uint64_t)) == 0
           && memcmp(a->ent, b->ent, a->n * sizeof(tok_strent_t)) == 0
           && memcmp(a->pool, b->pool, a->pool_len) == 0;
}


/* NULL if equal, else what differs */
static const char *
tok_diff_tables(const dpd_tok_t *a, const dpd_tok_t *b)
{
    uint32_t  i;
    int       k;

    if (!tok_diff_strmap(&a->vocab, &b->vocab)) {
        return "vocab";
    }
    if (!tok_diff_strmap(&a->other, &b->other)) {
        return "other";
    }
    if (a->merges.mask != b->merges.mask || a->merges.n != b->merges.n
        || memcmp(a->merges.slots, b->merges.slots,
                  ((size_t) a->merges.mask + 1) * sizeof(tok_pairslot_t)))
    {
        return "merges";
    }
    if (memcmp(a->byte_id, b->byte_id, sizeof(a->byte_id))
        || memcmp(a->fb_id, b->fb_id, sizeof(a->fb_id))
        || a->unk_id != b->unk_id || a->vocab_size != b->vocab_size
        || a->byte_level != b->byte_level
        || a->byte_fallback != b->byte_fallback
        || a->fuse_unk != b->fuse_unk || a->ignore_merges != b->ignore_merges)
    {
        return "model fields";
    }
    if (a->n_added != b->n_added) {
        return "added_tokens";
    }
    for (i = 0; i < a->n_added; i++) {
        const tok_added_t *x = &a->added[i], *y = &b->added[i];
        if (x->len != y->len || memcmp(x->content, y->content, x->len)
            || x->id != y->id || x->special != y->special
            || x->lstrip != y->lstrip || x->rstrip != y->rstrip
            || x->single_word != y->single_word
            || x->normalized != y->normalized)
        {
            return "added_tokens";
        }
    }
    if (a->n_norm != b->n_norm || a->n_pre != b->n_pre
        || a->norm_decomposes != b->norm_decomposes)
    {
        return "normalizer / pre_tokenizer";
    }
    for (k = 0; k < a->n_norm; k++) {
        if (a->norm[k].kind != b->norm[k].kind
            || a->norm[k].opt != b->norm[k].opt
            || a->norm[k].len != b->norm[k].len
            || a->norm[k].plen != b->norm[k].plen
            || (a->norm[k].len && memcmp(a->norm[k].str, b->norm[k].str,
                                         a->norm[k].len))
            || (a->norm[k].plen && memcmp(a->norm[k].pat, b->norm[k].pat,
                                          a->norm[k].plen)))
        {
            return "normalizer";
        }
    }
    for (k = 0; k < a->n_pre; k++) {
        if (a->pre[k].kind != b->pre[k].kind
            || a->pre[k].behavior != b->pre[k].behavior
            || a->pre[k].invert != b->pre[k].invert
            || a->pre[k].fast != b->pre[k].fast
            || a->pre[k].add_prefix_space != b->pre[k].add_prefix_space
            || a->pre[k].scheme != b->pre[k].scheme
            || a->pre[k].rep_len != b->pre[k].rep_len
            || memcmp(a->pre[k].rep, b->pre[k].rep, a->pre[k].rep_len))
        {
            return "pre_tokenizer";
        }
    }
    if (a->n_prefix != b->n_prefix || a->n_suffix != b->n_suffix
        || (a->n_prefix && memcmp(a->post_prefix, b->post_prefix,
                                  a->n_prefix * sizeof(uint32_t)))
        || (a->n_suffix && memcmp(a->post_suffix, b->post_suffix,
                                  a->n_suffix * sizeof(uint32_t))))
    {
        return "post_processor";
    }
    return NULL;
}


/*
 * Load buf both ways.  0: same outcome; -1: they differ (said on stderr).
 * *fast: the automatic path took the fast route; *loaded: it loaded.
 */
static int
tok_load_diff(const char *buf, size_t len, const char *name, int *fast,
    int *loaded)
{
    char         ea[512], eb[512];
    dpd_tok_t   *a, *b;
    const char  *why = NULL;

    ea[0] = eb[0] = '\0';
    a = tok_load_mem_mode(buf, len, name, TOK_LOAD_AUTO, fast, ea,
                          sizeof(ea));
    b = tok_load_mem_mode(buf, len, name, TOK_LOAD_CJSON, NULL, eb,
                          sizeof(eb));
    *loaded = a != NULL;
    if ((a == NULL) != (b == NULL)) {
        why = a ? "only the fast path loads it" : "only cJSON loads it";
    } else if (a == NULL) {
        if (strcmp(ea, eb) != 0) {
            why = "different refusals";
        }
    } else {
        why = tok_diff_tables(a, b);
    }
    if (why != NULL) {
        fprintf(stderr, "%s: %s\n  auto:  %s\n  cJSON: %s\n", name, why,
                a ? "(loaded)" : ea, b ? "(loaded)" : eb);
    }
    dpd_tok_free(a);
    dpd_tok_free(b);
    return why ? -1 : 0;
}

#endif /* TOK_LOAD_DIFF_H */
