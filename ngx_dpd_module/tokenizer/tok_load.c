/*
 * Loading a Hugging Face tokenizer.json with cJSON.  Every refusal names
 * the field it is about ("model.merges[12]: ...") so that nginx -t and the
 * CLI can tell the user what is wrong with the file.  model.vocab and
 * model.merges usually come from tok_load_fast.c instead of the tree (see
 * tok_load_text()); either way the same code fills the tables.
 */

#include <errno.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cjson/cJSON.h>
#include <utf8proc.h>

#include "tok_internal.h"

#define TOK_MAX_FILE  (1024L * 1024 * 1024)


void
tok_err(char *err, size_t errlen, const char *fmt, ...)
{
    va_list  ap;

    if (err == NULL || errlen == 0) {
        return;
    }
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}


char *
tok_read_file(const char *path, size_t *len, char *err, size_t errlen)
{
    FILE   *f;
    long    sz;
    char   *buf;

    f = fopen(path, "rb");
    if (f == NULL) {
        tok_err(err, errlen, "%s: %s", path, strerror(errno));
        return NULL;
    }
    if (fseek(f, 0, SEEK_END) != 0 || (sz = ftell(f)) < 0
        || fseek(f, 0, SEEK_SET) != 0)
    {
        tok_err(err, errlen, "%s: cannot size the file", path);
        fclose(f);
        return NULL;
    }
    if (sz > TOK_MAX_FILE) {
        tok_err(err, errlen, "%s: file too large", path);
        fclose(f);
        return NULL;
    }
    buf = malloc((size_t) sz + 1);
    if (buf == NULL) {
        tok_err(err, errlen, "%s: out of memory", path);
        fclose(f);
        return NULL;
    }
    if (fread(buf, 1, (size_t) sz, f) != (size_t) sz) {
        tok_err(err, errlen, "%s: read error", path);
        free(buf);
        fclose(f);
        return NULL;
    }
    fclose(f);
    buf[sz] = '\0';
    *len = (size_t) sz;
    return buf;
}


/*
 * A "\u0000" inside a JSON string: cJSON keeps strings NUL-terminated, so
 * the string would silently end there (a vocabulary entry, a merge or a
 * template cut short).  Offset of the first one, or -1.
 */
static long
tok_json_nul_at(const char *s, size_t len)
{
    const char  *p = s, *end = s + len;

    /*
     * Called on text cJSON has parsed: a backslash can only start an
     * escape inside a string, and escapes are taken two characters at a
     * time from the left, so "\\u0000" (an escaped backslash) is skipped.
     */
    while ((p = memchr(p, '\\', (size_t) (end - p))) != NULL) {
        if (end - p >= 6 && p[1] == 'u' && memcmp(p + 2, "0000", 4) == 0) {
            return (long) (p - s);
        }
        p += 2;
        if (p >= end) {
            break;
        }
    }
    return -1;
}


cJSON *
tok_parse_json(const char *path, const char *buf, size_t len, char *err,
    size_t errlen)
{
    cJSON       *root;
    const char  *ep;
    size_t       line = 1, i, off;
    long         nul;

    root = cJSON_ParseWithLength(buf, len);
    if (root != NULL && (nul = tok_json_nul_at(buf, len)) >= 0) {
        cJSON_Delete(root);
        for (i = 0; i < (size_t) nul; i++) {
            line += buf[i] == '\n';
        }
        tok_err(err, errlen, "%s: a \\u0000 in a string at byte %ld (line "
                "%zu) is not supported", path, nul, line);
        return NULL;
    }
    if (root == NULL) {
        ep = cJSON_GetErrorPtr();
        off = (ep && ep >= buf && ep <= buf + len) ? (size_t) (ep - buf) : 0;
        for (i = 0; i < off; i++) {
            line += buf[i] == '\n';
        }
        tok_err(err, errlen, "%s: invalid JSON near byte %zu (line %zu)",
                path, off, line);
    }
    return root;
}


static int
tok_json_bool(const cJSON *o, const char *key, int dflt)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);

    if (cJSON_IsBool(v)) {
        return cJSON_IsTrue(v);
    }
    return dflt;
}


/* A JSON number that is an integer id in [0, 2^31). */
static int
tok_json_id(const cJSON *v, uint32_t *id)
{
    double d;

    if (!cJSON_IsNumber(v)) {
        return -1;
    }
    d = v->valuedouble;
    if (d < 0 || d >= 2147483648.0 || d != (double) (uint32_t) d) {
        return -1;
    }
    *id = (uint32_t) d;
    return 0;
}


/* ---- model */

/* One vocabulary entry; raw is a scratch buffer of at least klen bytes. */
static int
tok_vocab_add(dpd_tok_t *tok, const char *key, size_t klen, uint32_t id,
    char *raw)
{
    size_t  rawlen;
    int     rc;

    if (!tok->byte_level) {
        rc = tok_strmap_put(&tok->vocab, key, klen, id);
    } else if (tok_byte_level_decode(key, klen, raw, &rawlen) == 0) {
        rc = tok_strmap_put(&tok->vocab, raw, rawlen, id);
    } else {
        /* not reachable from byte-level text; kept to check merges */
        rc = tok_strmap_put(&tok->other, key, klen, id);
    }
    if (rc < 0) {
        return -1;
    }
    if (id + 1 > tok->vocab_size) {
        tok->vocab_size = id + 1;
    }
    return 0;
}


static int
tok_vocab_init(dpd_tok_t *tok, uint32_t n, char *err, size_t errlen)
{
    if (tok_strmap_init(&tok->vocab, n) != 0
        || tok_strmap_init(&tok->other, 16) != 0)
    {
        tok_err(err, errlen, "model.vocab: out of memory");
        return -1;
    }
    return 0;
}


static int
tok_load_vocab(dpd_tok_t *tok, const cJSON *vocab, char *err, size_t errlen)
{
    const cJSON  *e;
    uint32_t      id, n = 0;
    char         *raw = NULL;
    size_t        rawcap = 0, klen;

    if (!cJSON_IsObject(vocab)) {
        tok_err(err, errlen, "model.vocab: missing or not an object");
        return -1;
    }
    cJSON_ArrayForEach(e, vocab) {
        n++;
    }
    if (n == 0) {
        tok_err(err, errlen, "model.vocab: empty");
        return -1;
    }
    if (tok_vocab_init(tok, n, err, errlen) != 0) {
        return -1;
    }

    cJSON_ArrayForEach(e, vocab) {
        if (tok_json_id(e, &id) != 0) {
            tok_err(err, errlen, "model.vocab[\"%.64s\"]: id is not a "
                    "non-negative integer", e->string);
            free(raw);
            return -1;
        }
        klen = strlen(e->string);
        if (klen + 1 > rawcap) {
            char *p = realloc(raw, klen + 64);
            if (p == NULL) {
                free(raw);
                tok_err(err, errlen, "model.vocab: out of memory");
                return -1;
            }
            raw = p;
            rawcap = klen + 64;
        }
        if (tok_vocab_add(tok, e->string, klen, id, raw) != 0) {
            free(raw);
            tok_err(err, errlen, "model.vocab: out of memory");
            return -1;
        }
    }
    free(raw);
    return 0;
}


/* The same from the text tok_fast_scan() checked (ids all valid). */
static int
tok_load_vocab_fast(dpd_tok_t *tok, const tok_fast_t *f, char *err,
    size_t errlen)
{
    tok_fast_iter_t   it;
    const char       *key;
    size_t            klen;
    uint32_t          id;
    char             *buf;

    if (tok_vocab_init(tok, f->n_vocab, err, errlen) != 0) {
        return -1;
    }
    /* an escaped key decodes into the first half, byte-level into the second */
    buf = malloc(2 * f->max_str + 2);
    if (buf == NULL) {
        tok_err(err, errlen, "model.vocab: out of memory");
        return -1;
    }
    tok_fast_iter_init(&it, f, buf, NULL);
    while (tok_fast_vocab_next(&it, &key, &klen, &id)) {
        if (tok_vocab_add(tok, key, klen, id, buf + f->max_str + 1) != 0) {
            free(buf);
            tok_err(err, errlen, "model.vocab: out of memory");
            return -1;
        }
    }
    free(buf);
    return 0;
}


/* Find a merge side in the vocab; 1 = byte-level id, 0 = other, -1 none */
static int
tok_merge_side(const dpd_tok_t *tok, const char *s, size_t len, char *raw,
    uint32_t *id, size_t *rawlen)
{
    if (!tok->byte_level) {
        memcpy(raw, s, len);
        *rawlen = len;
        *id = tok_strmap_get(&tok->vocab, s, len);
        return *id == TOK_NO_ID ? -1 : 1;
    }
    if (tok_byte_level_decode(s, len, raw, rawlen) == 0) {
        *id = tok_strmap_get(&tok->vocab, raw, *rawlen);
        return *id == TOK_NO_ID ? -1 : 1;
    }
    *id = tok_strmap_get(&tok->other, s, len);
    return *id == TOK_NO_ID ? -1 : 0;
}


/* "a b": exactly one space, as Hugging Face requires */
static int
tok_merge_split(const char *s, size_t len, uint32_t rank, size_t *ll,
    const char **rs, size_t *rl, char *err, size_t errlen)
{
    const char  *sp = memchr(s, ' ', len);

    if (sp == NULL || memchr(sp + 1, ' ', len - (size_t) (sp + 1 - s))
                      != NULL)
    {
        tok_err(err, errlen, "model.merges[%u]: \"%.*s\" is not two "
                "tokens separated by one space", rank,
                (int) (len > 64 ? 64 : len), s);
        return -1;
    }
    *ll = (size_t) (sp - s);
    *rs = sp + 1;
    *rl = len - *ll - 1;
    return 0;
}


/*
 * One merge of rank "rank"; ra and rb are scratch buffers of maxlen + 2
 * bytes, the longest merge's text (ra is followed by rb).
 */
static int
tok_merge_add(dpd_tok_t *tok, const char *ls, size_t ll, const char *rs,
    size_t rl, uint32_t rank, char *ra, char *rb, char *err, size_t errlen)
{
    size_t    alen, blen;
    uint32_t  lid, rid, mid;
    int       ka, kb;

    ka = tok_merge_side(tok, ls, ll, ra, &lid, &alen);
    if (ka < 0) {
        tok_err(err, errlen, "model.merges[%u]: token \"%.*s\" is not in "
                "model.vocab", rank, (int) (ll > 64 ? 64 : ll), ls);
        return -1;
    }
    kb = tok_merge_side(tok, rs, rl, rb, &rid, &blen);
    if (kb < 0) {
        tok_err(err, errlen, "model.merges[%u]: token \"%.*s\" is not in "
                "model.vocab", rank, (int) (rl > 64 ? 64 : rl), rs);
        return -1;
    }
    if (ka == 1 && kb == 1) {
        memmove(ra + alen, rb, blen);   /* ra and rb do not overlap */
        mid = tok_strmap_get(&tok->vocab, ra, alen + blen);
    } else {
        /* outside the byte alphabet: check, but it can never apply */
        char *cat = malloc(ll + rl + 1);
        if (cat == NULL) {
            tok_err(err, errlen, "model.merges: out of memory");
            return -1;
        }
        memcpy(cat, ls, ll);
        memcpy(cat + ll, rs, rl);
        mid = tok_strmap_get(&tok->other, cat, ll + rl);
        if (mid == TOK_NO_ID && tok_byte_level_decode(cat, ll + rl, ra,
                                                      &alen) == 0)
        {
            mid = tok_strmap_get(&tok->vocab, ra, alen);
        }
        free(cat);
        if (mid != TOK_NO_ID) {
            return 0;
        }
    }
    if (mid == TOK_NO_ID) {
        tok_err(err, errlen, "model.merges[%u]: merged token \"%.*s%.*s\" "
                "is not in model.vocab", rank, (int) (ll > 64 ? 64 : ll),
                ls, (int) (rl > 64 ? 64 : rl), rs);
        return -1;
    }
    if (ka == 1 && kb == 1
        && tok_pairmap_put(&tok->merges, lid, rid, rank, mid) != 0)
    {
        tok_err(err, errlen, "model.merges: out of memory");
        return -1;
    }
    return 0;
}


static int
tok_load_merges(dpd_tok_t *tok, const cJSON *merges, char *err,
    size_t errlen)
{
    const cJSON  *e, *a, *b;
    const char   *ls, *rs;
    size_t        ll, rl, maxlen = 0;
    uint32_t      n = 0, rank = 0;
    char         *buf = NULL;

    if (!cJSON_IsArray(merges)) {
        tok_err(err, errlen, "model.merges: missing or not an array");
        return -1;
    }
    cJSON_ArrayForEach(e, merges) {
        n++;
        /* one form for the whole list, as Hugging Face's MergeType */
        if (n > 1 && cJSON_IsString(e) != cJSON_IsString(merges->child)) {
            tok_err(err, errlen, "model.merges[%u]: mixes \"a b\" strings "
                    "and [\"a\", \"b\"] pairs", n - 1);
            return -1;
        }
        if (cJSON_IsString(e)) {
            ll = strlen(e->valuestring);
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2
                   && cJSON_IsString(a = cJSON_GetArrayItem(e, 0))
                   && cJSON_IsString(b = cJSON_GetArrayItem(e, 1)))
        {
            ll = strlen(a->valuestring) + strlen(b->valuestring) + 1;
        } else {
            tok_err(err, errlen, "model.merges[%u]: expected \"a b\" or "
                    "[\"a\", \"b\"]", n - 1);
            return -1;
        }
        if (ll > maxlen) {
            maxlen = ll;
        }
    }
    if (tok_pairmap_init(&tok->merges, n) != 0
        || (buf = malloc(3 * maxlen + 8)) == NULL)
    {
        tok_err(err, errlen, "model.merges: out of memory");
        return -1;
    }

    cJSON_ArrayForEach(e, merges) {
        if (cJSON_IsString(e)) {
            ls = e->valuestring;
            if (tok_merge_split(ls, strlen(ls), rank, &ll, &rs, &rl, err,
                                errlen) != 0)
            {
                goto fail;
            }
        } else {
            ls = cJSON_GetArrayItem(e, 0)->valuestring;
            rs = cJSON_GetArrayItem(e, 1)->valuestring;
            ll = strlen(ls);
            rl = strlen(rs);
        }
        if (tok_merge_add(tok, ls, ll, rs, rl, rank, buf, buf + maxlen + 2,
                          err, errlen) != 0)
        {
            goto fail;
        }
        rank++;
    }
    free(buf);
    return 0;

fail:
    free(buf);
    return -1;
}


/* The same from the text tok_fast_scan() checked (its form is uniform). */
static int
tok_load_merges_fast(dpd_tok_t *tok, const tok_fast_t *f, char *err,
    size_t errlen)
{
    tok_fast_iter_t   it;
    const char       *ls, *rs;
    size_t            ll, rl, maxlen = f->merge_max;
    uint32_t          rank = 0;
    char             *buf, *dec;

    if (tok_pairmap_init(&tok->merges, f->n_merges) != 0
        || (buf = malloc(3 * maxlen + 8 + 2 * f->max_str + 2)) == NULL)
    {
        tok_err(err, errlen, "model.merges: out of memory");
        return -1;
    }
    dec = buf + 3 * maxlen + 8;
    tok_fast_iter_init(&it, f, dec, dec + f->max_str + 1);
    while (tok_fast_merge_next(&it, &ls, &ll, &rs, &rl)) {
        if ((rs == NULL
             && tok_merge_split(ls, ll, rank, &ll, &rs, &rl, err, errlen)
                != 0)
            || tok_merge_add(tok, ls, ll, rs, rl, rank, buf,
                             buf + maxlen + 2, err, errlen) != 0)
        {
            free(buf);
            return -1;
        }
        rank++;
    }
    free(buf);
    return 0;
}


static int
tok_load_model(dpd_tok_t *tok, cJSON *model, const tok_fast_t *fast,
    char *err, size_t errlen)
{
    const cJSON  *v;
    unsigned      b;
    char          c, ubuf[256];
    size_t        ulen;

    if (!cJSON_IsObject(model)) {
        tok_err(err, errlen, "model: missing or not an object");
        return -1;
    }
    v = cJSON_GetObjectItemCaseSensitive(model, "type");
    if (v != NULL && !(cJSON_IsString(v) && strcmp(v->valuestring, "BPE")
                                              == 0))
    {
        tok_err(err, errlen, "model.type: unsupported \"%.32s\" (only BPE)",
                cJSON_IsString(v) ? v->valuestring : "?");
        return -1;
    }
    v = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (v != NULL && !cJSON_IsNull(v)
        && !(cJSON_IsNumber(v) && v->valuedouble == 0))
    {
        tok_err(err, errlen, "model.dropout: unsupported (must be null)");
        return -1;
    }
    tok->byte_fallback = tok_json_bool(model, "byte_fallback", 0);
    if (tok->byte_fallback && tok->byte_level) {
        tok_err(err, errlen, "model.byte_fallback: unsupported with a "
                "ByteLevel pre-tokenizer");
        return -1;
    }
    tok->fuse_unk = tok_json_bool(model, "fuse_unk", 0);
    v = cJSON_GetObjectItemCaseSensitive(model, "continuing_subword_prefix");
    if (v != NULL && !cJSON_IsNull(v)
        && !(cJSON_IsString(v) && v->valuestring[0] == '\0'))
    {
        tok_err(err, errlen, "model.continuing_subword_prefix: unsupported");
        return -1;
    }
    v = cJSON_GetObjectItemCaseSensitive(model, "end_of_word_suffix");
    if (v != NULL && !cJSON_IsNull(v)
        && !(cJSON_IsString(v) && v->valuestring[0] == '\0'))
    {
        tok_err(err, errlen, "model.end_of_word_suffix: unsupported");
        return -1;
    }
    tok->ignore_merges = tok_json_bool(model, "ignore_merges", 0);

    if (fast != NULL ? tok_load_vocab_fast(tok, fast, err, errlen) != 0
                     : tok_load_vocab(tok, cJSON_GetObjectItemCaseSensitive(
                                          model, "vocab"), err, errlen) != 0)
    {
        return -1;
    }
    for (b = 0; b < 256; b++) {
        char  code[8];

        snprintf(code, sizeof(code), "<0x%02X>", b);
        tok->fb_id[b] = tok->byte_fallback
                        ? tok_strmap_get(&tok->vocab, code, 6) : TOK_NO_ID;
    }
    /* the parsed vocab is no longer needed: give its memory to the merges */
    cJSON_DeleteItemFromObjectCaseSensitive(model, "vocab");

    v = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (v == NULL) {
        tok_err(err, errlen, "model.merges: missing");
        return -1;
    }
    if (fast != NULL ? tok_load_merges_fast(tok, fast, err, errlen) != 0
                     : tok_load_merges(tok, v, err, errlen) != 0)
    {
        return -1;
    }
    cJSON_DeleteItemFromObjectCaseSensitive(model, "merges");
    for (b = 0; b < 256; b++) {
        c = (char) b;
        tok->byte_id[b] = tok_strmap_get(&tok->vocab, &c, 1);
    }
    tok->unk_id = TOK_NO_ID;
    v = cJSON_GetObjectItemCaseSensitive(model, "unk_token");
    if (v != NULL && !cJSON_IsNull(v)) {
        if (!cJSON_IsString(v)) {
            tok_err(err, errlen, "model.unk_token: not a string");
            return -1;
        }
        /* Hugging Face fails each encode that needs it: refuse the file */
        ulen = strlen(v->valuestring);
        if (tok->byte_level) {
            if (ulen <= sizeof(ubuf)
                && tok_byte_level_decode(v->valuestring, ulen, ubuf, &ulen)
                   == 0)
            {
                tok->unk_id = tok_strmap_get(&tok->vocab, ubuf, ulen);
            }
            if (tok->unk_id == TOK_NO_ID) {
                tok->unk_id = tok_strmap_get(&tok->other, v->valuestring,
                                             strlen(v->valuestring));
            }
        } else {
            tok->unk_id = tok_strmap_get(&tok->vocab, v->valuestring,
                                         strlen(v->valuestring));
        }
        for (b = 0; tok->byte_level && b < 256; b++) {
            if (tok->byte_id[b] == TOK_NO_ID) {
                break;
            }
        }
        /* byte-level with every byte in the vocabulary never needs it */
        if (tok->unk_id == TOK_NO_ID && !(tok->byte_level && b == 256)) {
            tok_err(err, errlen, "model.unk_token: \"%.64s\" is not in "
                    "model.vocab", v->valuestring);
            return -1;
        }
    }
    return 0;
}


/* ---- added tokens */

/*
 * A token whose content is already a vocabulary entry keeps the model's id
 * (Hugging Face's AddedVocabulary::add_tokens); others use the file's id.
 */
static uint32_t
tok_added_vocab_id(const dpd_tok_t *tok, const char *s, size_t len,
    uint32_t id)
{
    char      small[256];
    size_t    rl;
    uint32_t  v;

    if (!tok->byte_level) {
        v = tok_strmap_get(&tok->vocab, s, len);
        return v != TOK_NO_ID ? v : id;
    }
    if (len <= sizeof(small) && tok_byte_level_decode(s, len, small, &rl) == 0
        && (v = tok_strmap_get(&tok->vocab, small, rl)) != TOK_NO_ID)
    {
        return v;
    }
    v = tok_strmap_get(&tok->other, s, len);
    return v != TOK_NO_ID ? v : id;
}

static int
tok_load_added(dpd_tok_t *tok, const cJSON *arr, char *err, size_t errlen)
{
    const cJSON  *e, *c;
    uint32_t      n = 0, i = 0, id;
    tok_added_t  *a;

    if (arr == NULL || cJSON_IsNull(arr)) {
        return 0;
    }
    if (!cJSON_IsArray(arr)) {
        tok_err(err, errlen, "added_tokens: not an array");
        return -1;
    }
    n = (uint32_t) cJSON_GetArraySize(arr);
    tok->added = calloc(n ? n : 1, sizeof(tok_added_t));
    if (tok->added == NULL) {
        tok_err(err, errlen, "added_tokens: out of memory");
        return -1;
    }
    cJSON_ArrayForEach(e, arr) {
        if (!cJSON_IsObject(e)) {
            tok_err(err, errlen, "added_tokens[%u]: not an object", i);
            return -1;
        }
        c = cJSON_GetObjectItemCaseSensitive(e, "content");
        if (!cJSON_IsString(c)) {
            tok_err(err, errlen, "added_tokens[%u].content: missing or not a "
                    "string", i);
            return -1;
        }
        if (tok_json_id(cJSON_GetObjectItemCaseSensitive(e, "id"), &id)
            != 0)
        {
            tok_err(err, errlen, "added_tokens[%u].id: missing or not a "
                    "non-negative integer", i);
            return -1;
        }
        a = &tok->added[i];
        a->content = strdup(c->valuestring);
        if (a->content == NULL) {
            tok_err(err, errlen, "added_tokens: out of memory");
            return -1;
        }
        a->len = strlen(a->content);
        a->id = tok_added_vocab_id(tok, a->content, a->len, id);
        a->special = tok_json_bool(e, "special", 0);
        a->lstrip = tok_json_bool(e, "lstrip", 0);
        a->rstrip = tok_json_bool(e, "rstrip", 0);
        a->single_word = tok_json_bool(e, "single_word", 0);
        /* Hugging Face's default: special tokens are not normalized */
        a->normalized = tok_json_bool(e, "normalized", !a->special);
        if (id + 1 > tok->vocab_size) {
            tok->vocab_size = id + 1;
        }
        tok->n_added = ++i;
    }
    return 0;
}


/*
 * Normalized added tokens are matched in their normalized form, by the
 * whole normalizer (Prepend included), as Hugging Face builds its trie.
 */
static int
tok_normalize_added(dpd_tok_t *tok, char *err, size_t errlen)
{
    uint32_t  i;
    char     *out;
    size_t    olen;

    if (tok->n_norm == 0) {
        return 0;
    }
    for (i = 0; i < tok->n_added; i++) {
        tok_added_t *a = &tok->added[i];
        if (!a->normalized) {
            continue;
        }
        if (tok_normalize(tok, a->content, a->len, &out, &olen) != 0) {
            tok_err(err, errlen, "added_tokens[%u].content: cannot "
                    "normalize", i);
            return -1;
        }
        free(a->content);
        a->content = out;
        a->len = olen;
    }
    return 0;
}


/* ---- typed components (normalizer, pre-tokenizer, post-processor) */

/* 1 with *type set; 0 when the component is absent (null); -1 on error. */
static int
tok_json_type(const cJSON *j, const char *path, const char **type, char *err,
    size_t errlen)
{
    const cJSON  *t;

    if (j == NULL || cJSON_IsNull(j)) {
        return 0;
    }
    t = cJSON_GetObjectItemCaseSensitive(j, "type");
    if (!cJSON_IsObject(j) || !cJSON_IsString(t)) {
        tok_err(err, errlen, "%s.type: missing", path);
        return -1;
    }
    *type = t->valuestring;
    return 1;
}


typedef int (*tok_load_fn)(dpd_tok_t *tok, const cJSON *j, const char *path,
    char *err, size_t errlen);


/* Load each element of the array seq[key] with load, in order. */
static int
tok_load_seq(dpd_tok_t *tok, const cJSON *seq, const char *key,
    const char *path, tok_load_fn load, char *err, size_t errlen)
{
    const cJSON  *e;
    char          sub[128];
    int           i = 0;

    e = cJSON_GetObjectItemCaseSensitive(seq, key);
    if (!cJSON_IsArray(e)) {
        tok_err(err, errlen, "%s.%s: missing or not an array", path, key);
        return -1;
    }
    for (e = e->child; e; e = e->next, i++) {
        snprintf(sub, sizeof(sub), "%s.%s[%d]", path, key, i);
        if (load(tok, e, sub, err, errlen) != 0) {
            return -1;
        }
    }
    return 0;
}


/* ---- normalizer */

static int
tok_load_normalizer(dpd_tok_t *tok, const cJSON *n, const char *path,
    char *err, size_t errlen)
{
    const cJSON  *v, *pat;
    const char   *type;
    char          rerr[256];
    int           rc, opt = 0;
    tok_norm_t   *st;

    if ((rc = tok_json_type(n, path, &type, err, errlen)) <= 0) {
        return rc;
    }
    if (strcmp(type, "Sequence") == 0) {
        return tok_load_seq(tok, n, "normalizers", path,
                            tok_load_normalizer, err, errlen);
    }
    if (tok->n_norm == TOK_MAX_NORM) {
        tok_err(err, errlen, "%s: too many normalizers", path);
        return -1;
    }
    st = &tok->norm[tok->n_norm];
    memset(st, 0, sizeof(*st));

    if (strcmp(type, "NFC") == 0) {
        opt = UTF8PROC_STABLE | UTF8PROC_COMPOSE;
    } else if (strcmp(type, "NFD") == 0) {
        opt = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE;
    } else if (strcmp(type, "NFKC") == 0) {
        opt = UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
    } else if (strcmp(type, "NFKD") == 0) {
        opt = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;

    } else if (strcmp(type, "Prepend") == 0) {
        v = cJSON_GetObjectItemCaseSensitive(n, "prepend");
        if (!cJSON_IsString(v)) {
            tok_err(err, errlen, "%s.prepend: missing or not a string", path);
            return -1;
        }
        st->kind = TOK_NORM_PREPEND;
        st->len = strlen(v->valuestring);
        st->str = strdup(v->valuestring);
        if (st->str == NULL) {
            tok_err(err, errlen, "%s: out of memory", path);
            return -1;
        }
        tok->n_norm++;
        return 0;

    } else if (strcmp(type, "Replace") == 0) {
        v = cJSON_GetObjectItemCaseSensitive(n, "content");
        pat = cJSON_GetObjectItemCaseSensitive(n, "pattern");
        if (!cJSON_IsString(v)) {
            tok_err(err, errlen, "%s.content: missing or not a string", path);
            return -1;
        }
        st->kind = TOK_NORM_REPLACE;
        st->len = strlen(v->valuestring);
        st->str = strdup(v->valuestring);
        if (st->str == NULL) {
            tok_err(err, errlen, "%s: out of memory", path);
            return -1;
        }
        tok->n_norm++;      /* freed with the tokenizer from here on */
        if (cJSON_IsObject(pat)
            && cJSON_IsString(v = cJSON_GetObjectItemCaseSensitive(pat,
                                                                 "String")))
        {
            st->plen = strlen(v->valuestring);
            if (st->plen == 0) {
                tok_err(err, errlen, "%s.pattern.String: empty", path);
                return -1;
            }
            st->pat = strdup(v->valuestring);
            if (st->pat == NULL) {
                tok_err(err, errlen, "%s: out of memory", path);
                return -1;
            }
            return 0;
        }
        if (cJSON_IsObject(pat)
            && cJSON_IsString(v = cJSON_GetObjectItemCaseSensitive(pat,
                                                                 "Regex")))
        {
            st->re = tok_regex_compile(v->valuestring, strlen(v->valuestring),
                                       0, rerr, sizeof(rerr));
            if (st->re == NULL) {
                tok_err(err, errlen, "%s.pattern.Regex: %s", path, rerr);
                return -1;
            }
            return 0;
        }
        tok_err(err, errlen, "%s.pattern: expected {\"String\": ...} or "
                "{\"Regex\": ...}", path);
        return -1;

    } else {
        tok_err(err, errlen, "%s.type: unsupported \"%.32s\" (NFC, NFD, NFKC, "
                "NFKD, Prepend, Replace, Sequence)", path, type);
        return -1;
    }
    st->kind = TOK_NORM_UNICODE;
    st->opt = opt;
    tok->n_norm++;
    if (!(opt & UTF8PROC_COMPOSE)) {
        tok->norm_decomposes = 1;
    }
    return 0;
}


/* ---- pre-tokenizer */

#define TOK_GPT2_REGEX \
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+" \
    "|\\s+(?!\\S)|\\s+"


static int
tok_load_pre(dpd_tok_t *tok, const cJSON *p, const char *path, char *err,
    size_t errlen)
{
    const cJSON  *pat, *v;
    const char   *type, *b;
    char          rerr[256];
    int           rc, literal;
    tok_pre_t    *pre;

    if ((rc = tok_json_type(p, path, &type, err, errlen)) <= 0) {
        return rc;
    }
    if (strcmp(type, "Sequence") == 0) {
        return tok_load_seq(tok, p, "pretokenizers", path, tok_load_pre,
                            err, errlen);
    }
    if (tok->n_pre == TOK_MAX_PRE) {
        tok_err(err, errlen, "%s: too many pre-tokenizers", path);
        return -1;
    }
    pre = &tok->pre[tok->n_pre];
    memset(pre, 0, sizeof(*pre));

    if (strcmp(type, "Split") == 0) {
        pre->kind = TOK_PRE_SPLIT;
        pat = cJSON_GetObjectItemCaseSensitive(p, "pattern");
        v = NULL;
        literal = 0;
        if (cJSON_IsObject(pat)) {
            v = cJSON_GetObjectItemCaseSensitive(pat, "Regex");
            if (v == NULL) {
                v = cJSON_GetObjectItemCaseSensitive(pat, "String");
                literal = 1;
            }
        }
        if (!cJSON_IsString(v)) {
            tok_err(err, errlen, "%s.pattern: expected {\"Regex\": ...} or "
                    "{\"String\": ...}", path);
            return -1;
        }
        pre->re = tok_regex_compile(v->valuestring, strlen(v->valuestring),
                                    literal, rerr, sizeof(rerr));
        if (pre->re == NULL) {
            tok_err(err, errlen, "%s.pattern.%s: %s", path,
                    literal ? "String" : "Regex", rerr);
            return -1;
        }
        if (!literal) {
            pre->fast = tok_pretok_fast_kind(v->valuestring,
                                             strlen(v->valuestring));
        }
        v = cJSON_GetObjectItemCaseSensitive(p, "behavior");
        b = cJSON_IsString(v) ? v->valuestring : "";
        if (strcmp(b, "Removed") == 0) {
            pre->behavior = TOK_SPLIT_REMOVED;
        } else if (strcmp(b, "Isolated") == 0) {
            pre->behavior = TOK_SPLIT_ISOLATED;
        } else if (strcmp(b, "MergedWithPrevious") == 0) {
            pre->behavior = TOK_SPLIT_MERGED_PREV;
        } else if (strcmp(b, "MergedWithNext") == 0) {
            pre->behavior = TOK_SPLIT_MERGED_NEXT;
        } else if (strcmp(b, "Contiguous") == 0) {
            pre->behavior = TOK_SPLIT_CONTIGUOUS;
        } else {
            pcre2_code_free(pre->re);
            pre->re = NULL;
            tok_err(err, errlen, "%s.behavior: unsupported \"%.32s\"", path,
                    b);
            return -1;
        }
        pre->invert = tok_json_bool(p, "invert", 0);

    } else if (strcmp(type, "ByteLevel") == 0) {
        pre->kind = TOK_PRE_BYTELEVEL;
        pre->add_prefix_space = tok_json_bool(p, "add_prefix_space", 1);
        if (tok_json_bool(p, "use_regex", 1)) {
            pre->re = tok_regex_compile(TOK_GPT2_REGEX,
                                        sizeof(TOK_GPT2_REGEX) - 1, 0, rerr,
                                        sizeof(rerr));
            if (pre->re == NULL) {
                tok_err(err, errlen, "%s: %s", path, rerr);
                return -1;
            }
            pre->fast = tok_pretok_fast_kind(TOK_GPT2_REGEX,
                                             sizeof(TOK_GPT2_REGEX) - 1);
        }

    } else if (strcmp(type, "Digits") == 0) {
        pre->kind = TOK_PRE_DIGITS;
        pre->individual = tok_json_bool(p, "individual_digits", 0);

    } else if (strcmp(type, "Metaspace") == 0) {
        uint32_t  cp;
        size_t    n;

        pre->kind = TOK_PRE_METASPACE;
        v = cJSON_GetObjectItemCaseSensitive(p, "replacement");
        /* one character, as Hugging Face's serde char */
        if (!cJSON_IsString(v) || v->valuestring[0] == '\0'
            || (n = tok_utf8_decode(v->valuestring, strlen(v->valuestring),
                                    &cp)) != strlen(v->valuestring)
            || cp == 0xFFFD)
        {
            tok_err(err, errlen, "%s.replacement: expected one character",
                    path);
            return -1;
        }
        memcpy(pre->rep, v->valuestring, n);
        pre->rep_len = (uint8_t) n;
        v = cJSON_GetObjectItemCaseSensitive(p, "prepend_scheme");
        b = cJSON_IsString(v) ? v->valuestring : "always";
        if (strcmp(b, "always") == 0) {
            pre->scheme = TOK_PREPEND_ALWAYS;
        } else if (strcmp(b, "first") == 0) {
            pre->scheme = TOK_PREPEND_FIRST;
        } else if (strcmp(b, "never") == 0) {
            pre->scheme = TOK_PREPEND_NEVER;
        } else {
            tok_err(err, errlen, "%s.prepend_scheme: unsupported \"%.32s\" "
                    "(first, always, never)", path, b);
            return -1;
        }
        /* the legacy add_prefix_space: false must say never */
        v = cJSON_GetObjectItemCaseSensitive(p, "add_prefix_space");
        if (cJSON_IsFalse(v)) {
            if (pre->scheme != TOK_PREPEND_NEVER) {
                tok_err(err, errlen, "%s.add_prefix_space: false does not "
                        "match prepend_scheme", path);
                return -1;
            }
            pre->scheme = TOK_PREPEND_NEVER;
        }
        pre->split = (uint8_t) tok_json_bool(p, "split", 1);

    } else {
        tok_err(err, errlen, "%s.type: unsupported \"%.32s\" (Split, "
                "ByteLevel, Digits, Metaspace, Sequence)", path, type);
        return -1;
    }
    tok->n_pre++;
    return 0;
}


/* ---- post-processor: the ids add_special_tokens=True puts around text */

static int
tok_post_append(uint32_t **arr, uint32_t *n, uint32_t id)
{
    uint32_t *p = realloc(*arr, (*n + 1) * sizeof(uint32_t));

    if (p == NULL) {
        return -1;
    }
    p[(*n)++] = id;
    *arr = p;
    return 0;
}


static int
tok_load_template(dpd_tok_t *tok, const cJSON *p, const char *path,
    char *err, size_t errlen)
{
    const cJSON  *single, *specials, *item, *st, *idv, *sp, *ids, *x;
    int           i = 0, seen_a = 0;
    uint32_t      id;

    single = cJSON_GetObjectItemCaseSensitive(p, "single");
    specials = cJSON_GetObjectItemCaseSensitive(p, "special_tokens");
    if (!cJSON_IsArray(single)) {
        tok_err(err, errlen, "%s.single: missing or not an array", path);
        return -1;
    }
    cJSON_ArrayForEach(item, single) {
        if ((st = cJSON_GetObjectItemCaseSensitive(item, "Sequence"))) {
            seen_a = 1;
            i++;
            continue;
        }
        st = cJSON_GetObjectItemCaseSensitive(item, "SpecialToken");
        idv = cJSON_GetObjectItemCaseSensitive(st, "id");
        if (!cJSON_IsString(idv)) {
            tok_err(err, errlen, "%s.single[%d]: expected Sequence or "
                    "SpecialToken with an id", path, i);
            return -1;
        }
        sp = cJSON_GetObjectItemCaseSensitive(specials, idv->valuestring);
        ids = cJSON_GetObjectItemCaseSensitive(sp, "ids");
        if (!cJSON_IsArray(ids)) {
            tok_err(err, errlen, "%s.special_tokens[\"%.64s\"].ids: missing",
                    path, idv->valuestring);
            return -1;
        }
        cJSON_ArrayForEach(x, ids) {
            if (tok_json_id(x, &id) != 0 || id >= tok->vocab_size) {
                tok_err(err, errlen, "%s.special_tokens[\"%.64s\"].ids: not "
                        "an id of the vocabulary", path, idv->valuestring);
                return -1;
            }
            if (seen_a ? tok_post_append(&tok->post_suffix, &tok->n_suffix,
                                         id)
                       : tok_post_append(&tok->post_prefix, &tok->n_prefix,
                                         id))
            {
                tok_err(err, errlen, "%s: out of memory", path);
                return -1;
            }
        }
        i++;
    }
    return 0;
}


static int
tok_special_pair(dpd_tok_t *tok, const cJSON *p, const char *key,
    const char *path, int suffix, char *err, size_t errlen)
{
    const cJSON  *v = cJSON_GetObjectItemCaseSensitive(p, key);
    uint32_t      id;

    if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) != 2
        || tok_json_id(cJSON_GetArrayItem(v, 1), &id) != 0
        || id >= tok->vocab_size)
    {
        tok_err(err, errlen, "%s.%s: expected [\"token\", id]", path, key);
        return -1;
    }
    if (suffix ? tok_post_append(&tok->post_suffix, &tok->n_suffix, id)
               : tok_post_append(&tok->post_prefix, &tok->n_prefix, id))
    {
        tok_err(err, errlen, "%s: out of memory", path);
        return -1;
    }
    return 0;
}


static int
tok_load_post(dpd_tok_t *tok, const cJSON *p, const char *path, char *err,
    size_t errlen)
{
    const char  *type;
    int          rc;

    if ((rc = tok_json_type(p, path, &type, err, errlen)) <= 0) {
        return rc;
    }
    if (strcmp(type, "ByteLevel") == 0) {
        return 0;   /* offsets only */
    }
    if (strcmp(type, "TemplateProcessing") == 0) {
        return tok_load_template(tok, p, path, err, errlen);
    }
    if (strcmp(type, "BertProcessing") == 0
        || strcmp(type, "RobertaProcessing") == 0)
    {
        if (tok_special_pair(tok, p, "cls", path, 0, err, errlen) != 0) {
            return -1;
        }
        return tok_special_pair(tok, p, "sep", path, 1, err, errlen);
    }
    if (strcmp(type, "Sequence") == 0) {
        return tok_load_seq(tok, p, "processors", path, tok_load_post,
                            err, errlen);
    }
    tok_err(err, errlen, "%s.type: unsupported \"%.32s\" (ByteLevel, "
            "TemplateProcessing, BertProcessing, RobertaProcessing, "
            "Sequence)", path, type);
    return -1;
}


/* ---- the whole file */

/* Is there a ByteLevel pre-tokenizer, at any depth of Sequences? */
static int
tok_has_byte_level(const cJSON *p, int depth)
{
    const cJSON  *t, *e;

    if (!cJSON_IsObject(p) || depth > 16) {
        return 0;
    }
    t = cJSON_GetObjectItemCaseSensitive(p, "type");
    if (cJSON_IsString(t) && strcmp(t->valuestring, "ByteLevel") == 0) {
        return 1;
    }
    e = cJSON_GetObjectItemCaseSensitive(p, "pretokenizers");
    if (cJSON_IsString(t) && strcmp(t->valuestring, "Sequence") == 0
        && cJSON_IsArray(e))
    {
        cJSON_ArrayForEach(t, e) {
            if (tok_has_byte_level(t, depth + 1)) {
                return 1;
            }
        }
    }
    return 0;
}


static int
tok_load_json(dpd_tok_t *tok, cJSON *root, const tok_fast_t *fast, char *err,
    size_t errlen)
{
    if (!cJSON_IsObject(root)) {
        tok_err(err, errlen, "tokenizer.json: not a JSON object");
        return -1;
    }
    /* the vocabulary's form depends on it: decided before the model */
    tok->byte_level = tok_has_byte_level(
        cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), 0);
    if (tok_load_model(tok, cJSON_GetObjectItemCaseSensitive(root, "model"),
                       fast, err, errlen) != 0
        || tok_load_normalizer(tok, cJSON_GetObjectItemCaseSensitive(root,
                               "normalizer"), "normalizer", err, errlen) != 0
        || tok_load_added(tok, cJSON_GetObjectItemCaseSensitive(root,
                          "added_tokens"), err, errlen) != 0
        || tok_load_pre(tok, cJSON_GetObjectItemCaseSensitive(root,
                        "pre_tokenizer"), "pre_tokenizer", err, errlen) != 0
        || tok_load_post(tok, cJSON_GetObjectItemCaseSensitive(root,
                         "post_processor"), "post_processor", err, errlen)
           != 0)
    {
        return -1;
    }
    if (tok_normalize_added(tok, err, errlen) != 0) {
        return -1;
    }
    if (tok_trie_build(&tok->trie_raw, tok->added, tok->n_added, 0) != 0
        || tok_trie_build(&tok->trie_norm, tok->added, tok->n_added, 1) != 0)
    {
        tok_err(err, errlen, "added_tokens: out of memory");
        return -1;
    }
    return 0;
}


/*
 * Build a tokenizer from a parsed tokenizer.json; deletes root.  With fast,
 * model.vocab and model.merges come from the text it points into.
 */
static dpd_tok_t *
tok_load_root(cJSON *root, const tok_fast_t *fast, const char *name,
    char *err, size_t errlen)
{
    dpd_tok_t  *tok;
    char        ferr[512];

    static uint64_t  tok_gen_counter;

    tok = calloc(1, sizeof(*tok));
    if (tok == NULL) {
        cJSON_Delete(root);
        tok_err(err, errlen, "out of memory");
        return NULL;
    }
    /* never 0: a zeroed cache entry must not match any tokenizer */
    tok->gen = __atomic_add_fetch(&tok_gen_counter, 1, __ATOMIC_RELAXED);

    ferr[0] = '\0';
    if (tok_load_json(tok, root, fast, ferr, sizeof(ferr)) != 0) {
        tok_err(err, errlen, "%s: %s", name, ferr);
        cJSON_Delete(root);
        dpd_tok_free(tok);
        return NULL;
    }
    cJSON_Delete(root);
    return tok;
}


static dpd_tok_t *
tok_trimmed(dpd_tok_t *tok)
{
#ifdef __GLIBC__
    /* hand the parse's pages back: workers keep only the tables */
    malloc_trim(0);
#endif
    return tok;
}


/*
 * Load from tokenizer.json text.  When tok_fast_scan() vouches for the
 * document, cJSON parses it without model.vocab and model.merges and those
 * are read from the text; otherwise cJSON parses it all (the same result,
 * slower).  own: buf may be freed as soon as it is no longer needed.
 */
static dpd_tok_t *
tok_load_text(const char *buf, size_t len, const char *name, int mode,
    int *fast_used, char *own, char *err, size_t errlen)
{
    tok_fast_t   fast;
    dpd_tok_t   *tok;
    cJSON       *root = NULL;
    char        *rest;
    size_t       rlen;

    if (fast_used != NULL) {
        *fast_used = 0;
    }
    if (mode == TOK_LOAD_AUTO && tok_fast_scan(buf, len, &fast) == 0) {
        rest = tok_fast_rest(buf, len, &fast, &rlen);
        if (rest != NULL) {
            root = cJSON_ParseWithLength(rest, rlen);
            free(rest);
        }
        if (root != NULL) {
            if (fast_used != NULL) {
                *fast_used = 1;
            }
            tok = tok_load_root(root, &fast, name, err, errlen);
            tok_fast_free(&fast);
            free(own);
            return tok_trimmed(tok);
        }
        tok_fast_free(&fast);
    }
    root = tok_parse_json(name, buf, len, err, errlen);
    free(own);      /* before the tables are built: a lower peak */
    return root ? tok_trimmed(tok_load_root(root, NULL, name, err, errlen))
                : NULL;
}


/* Load from tokenizer.json text in memory (the fuzzer's entry point). */
dpd_tok_t *
tok_load_mem(const char *buf, size_t len, const char *name, char *err,
    size_t errlen)
{
    return tok_load_text(buf, len, name, TOK_LOAD_AUTO, NULL, NULL, err,
                         errlen);
}


dpd_tok_t *
tok_load_mem_mode(const char *buf, size_t len, const char *name, int mode,
    int *fast, char *err, size_t errlen)
{
    return tok_load_text(buf, len, name, mode, fast, NULL, err, errlen);
}


dpd_tok_t *
dpd_tok_load(const char *tokenizer_path, const char *config_path,
    char *err, size_t errlen)
{
    dpd_tok_t  *tok;
    char       *buf;
    size_t      len;

    if (tokenizer_path == NULL) {
        tok_err(err, errlen, "no tokenizer.json given");
        return NULL;
    }
    buf = tok_read_file(tokenizer_path, &len, err, errlen);
    if (buf == NULL) {
        return NULL;
    }
    tok = tok_load_text(buf, len, tokenizer_path, TOK_LOAD_AUTO, NULL, buf,
                        err, errlen);
    if (tok == NULL) {
        return NULL;
    }
    if (config_path != NULL
        && tok_load_config(tok, config_path, err, errlen) != 0)
    {
        dpd_tok_free(tok);
        return NULL;
    }
    tok_harmony_detect(tok);
    return tok;
}


void
dpd_tok_free(dpd_tok_t *tok)
{
    uint32_t  i;
    int       k;

    if (tok == NULL) {
        return;
    }
    tok_strmap_free(&tok->vocab);
    tok_strmap_free(&tok->other);
    tok_pairmap_free(&tok->merges);
    for (i = 0; i < tok->n_added; i++) {
        free(tok->added[i].content);
    }
    free(tok->added);
    tok_trie_free(&tok->trie_raw);
    tok_trie_free(&tok->trie_norm);
    for (k = 0; k < tok->n_norm; k++) {
        free(tok->norm[k].str);
        free(tok->norm[k].pat);
        if (tok->norm[k].re) {
            pcre2_code_free(tok->norm[k].re);
        }
    }
    for (k = 0; k < tok->n_pre; k++) {
        if (tok->pre[k].re) {
            pcre2_code_free(tok->pre[k].re);
        }
    }
    free(tok->post_prefix);
    free(tok->post_suffix);
    free(tok->bos_token);
    free(tok->eos_token);
    tok_chat_free(tok->chat);
    free(tok);
}
