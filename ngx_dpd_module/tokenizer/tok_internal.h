/*
 * Internal structures of the tokenizer library.  Not installed, not used
 * outside ngx_dpd_module/tokenizer/.
 *
 * Everything below is built once by dpd_tok_load() and only read by the
 * encoders: a loaded tokenizer carries no mutable state, so concurrent
 * encodes need no locking.  Per-call scratch lives in tok_work_t.
 */

#ifndef DPD_TOK_INTERNAL_H
#define DPD_TOK_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8

#include <pcre2.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "dpd_tokenizer.h"

#define TOK_NO_ID  UINT32_MAX

/* ---- string -> id hash (vocab, byte strings after byte-level decoding)
 *
 * A slot holds 32 bits of the key's hash and the entry index, so a probe
 * touches one slot and, on a tag match only, one entry and the pool. */

typedef struct {
    uint32_t    off;        /* offset into pool */
    uint32_t    len;        /* byte length */
    uint32_t    id;
} tok_strent_t;

typedef struct {
    uint64_t      *slots;   /* hash tag << 32 | (entry index + 1), 0 = empty */
    uint32_t       mask;
    tok_strent_t  *ent;
    uint32_t       n, cap;
    char          *pool;
    size_t         pool_len, pool_cap;
} tok_strmap_t;

int tok_strmap_init(tok_strmap_t *m, uint32_t expect);
void tok_strmap_free(tok_strmap_t *m);
/* returns 0 on success, 1 if key existed (id overwritten), -1 on ENOMEM */
int tok_strmap_put(tok_strmap_t *m, const char *s, size_t len, uint32_t id);
uint32_t tok_strmap_get(const tok_strmap_t *m, const char *s, size_t len);


/* ---- (left id, right id) -> (rank, merged id) hash, one slot per line */

typedef struct {
    uint64_t    key;        /* (left << 32 | right) + 1, 0 = empty */
    uint32_t    rank;
    uint32_t    merged;
} tok_pairslot_t;

typedef struct {
    tok_pairslot_t  *slots;
    uint32_t         mask;
    uint32_t         n;
    uint32_t         shift;     /* 64 - log2(slots) */
} tok_pairmap_t;

int tok_pairmap_init(tok_pairmap_t *m, uint32_t expect);
void tok_pairmap_free(tok_pairmap_t *m);
int tok_pairmap_put(tok_pairmap_t *m, uint32_t l, uint32_t r, uint32_t rank,
    uint32_t merged);

static inline uint64_t
tok_mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/*
 * a == b over len bytes, for the short strings of the hot lookups (a
 * pre-token is a few bytes): no call, and no load outside either string.
 * Two overlapping loads cover 2..3, 4..7 and the last 1..8 bytes.
 */
static inline int
tok_bytes_eq(const char *a, const char *b, size_t len)
{
    uint64_t  x, y;
    uint32_t  u, v, d;
    uint16_t  c, e;

    if (len >= 8) {
        while (len > 8) {
            memcpy(&x, a, 8);
            memcpy(&y, b, 8);
            if (x != y) {
                return 0;
            }
            a += 8;
            b += 8;
            len -= 8;
        }
        memcpy(&x, a + len - 8, 8);
        memcpy(&y, b + len - 8, 8);
        return x == y;
    }
    if (len >= 4) {
        memcpy(&u, a, 4);
        memcpy(&v, b, 4);
        d = u ^ v;
        memcpy(&u, a + len - 4, 4);
        memcpy(&v, b + len - 4, 4);
        return (d | (u ^ v)) == 0;
    }
    if (len >= 2) {
        memcpy(&c, a, 2);
        memcpy(&e, b, 2);
        d = (uint32_t) (c ^ e);
        memcpy(&c, a + len - 2, 2);
        memcpy(&e, b + len - 2, 2);
        return (d | (uint32_t) (c ^ e)) == 0;
    }
    return len == 0 || a[0] == b[0];
}


/* the hot lookups hash and probe inline (one call less a pre-token) */
static inline uint64_t
tok_hash_bytes(const char *s, size_t len)
{
    /* 8 bytes at a time, finished by a multiply that mixes every bit */
    uint64_t  h = 0x9e3779b97f4a7c15ULL ^ len;
    uint64_t  w;
#ifdef __SIZEOF_INT128__
    unsigned __int128  p;
#endif

    while (len >= 8) {
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdULL;
        h ^= h >> 32;
        s += 8;
        len -= 8;
    }
    /* the last 0-7 bytes without a variable-length memcpy (a call): two
     * overlapping 4-byte loads, or first / middle / last byte; either
     * covers every byte, so equal (w, len) means equal tails */
    if (len >= 4) {
        uint32_t  lo, hi;

        memcpy(&lo, s, 4);
        memcpy(&hi, s + len - 4, 4);
        w = (uint64_t) hi << 32 | lo;
    } else if (len > 0) {
        w = (uint64_t) (uint8_t) s[0] | (uint64_t) (uint8_t) s[len / 2] << 8
            | (uint64_t) (uint8_t) s[len - 1] << 16;
    } else {
        w = 0;
    }
#ifdef __SIZEOF_INT128__
    /* the full 128-bit product, halves folded: one multiply reaches every
     * bit of both halves (tok_mix64 takes three) */
    p = (unsigned __int128) (h ^ w) * 0xc4ceb9fe1a85ec53ULL;
    return (uint64_t) p ^ (uint64_t) (p >> 64);
#else
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ULL;
    return tok_mix64(h);
#endif
}


/* tok_strmap_get with h = tok_hash_bytes(s, len) already computed */
static inline uint32_t
tok_strmap_get_h(const tok_strmap_t *m, const char *s, size_t len,
    uint64_t h)
{
    uint64_t             tag = h & 0xffffffff00000000ULL, v;
    uint32_t             i = (uint32_t) h & m->mask;
    const tok_strent_t  *e;

    while ((v = m->slots[i]) != 0) {
        if ((v & 0xffffffff00000000ULL) == tag) {
            e = &m->ent[(uint32_t) v - 1];
            if (e->len == len && tok_bytes_eq(m->pool + e->off, s, len)) {
                return e->id;
            }
        }
        i = (i + 1) & m->mask;
    }
    return TOK_NO_ID;
}

static inline uint64_t
tok_pair_key(uint32_t l, uint32_t r)
{
    return (((uint64_t) l << 32) | r) + 1;
}


/*
 * The first slot to probe for a key: prefetch it before the lookups.
 * Fibonacci hashing (the product's top bits): one multiply, and every bit
 * of both ids reaches the slot number; cheaper than tok_mix64 on the
 * hottest lookup of BPE, with no longer probes on the shipped tables.
 */
static inline uint32_t
tok_pairmap_slot(const tok_pairmap_t *m, uint64_t key)
{
    return (uint32_t) ((key * 0x9e3779b97f4a7c15ULL) >> m->shift) & m->mask;
}


/* lookup from slot i = tok_pairmap_slot(m, key) */
static inline int
tok_pairmap_get_at(const tok_pairmap_t *m, uint64_t key, uint32_t i,
    uint32_t *rank, uint32_t *merged)
{
    for ( ;; ) {
        const tok_pairslot_t *s = &m->slots[i];
        if (s->key == key) {
            *rank = s->rank;
            *merged = s->merged;
            return 1;
        }
        if (s->key == 0) {
            return 0;
        }
        i = (i + 1) & m->mask;
    }
}


/* returns 1 and fills rank/merged if the pair merges */
static inline int
tok_pairmap_get(const tok_pairmap_t *m, uint32_t l, uint32_t r,
    uint32_t *rank, uint32_t *merged)
{
    uint64_t  key = tok_pair_key(l, r);

    return tok_pairmap_get_at(m, key, tok_pairmap_slot(m, key), rank, merged);
}

/* ---- added tokens: byte trie, leftmost-longest as Hugging Face
 *
 * Path-compressed: a node's label holds the bytes after the edge that
 * reaches it, a chain of nodes that end no token and have one child each
 * (the "tart_header_id|>" of "<|start_header_id|>"), compared at once. */

typedef struct {
    uint32_t    label;       /* offset into labels */
    uint32_t    label_len;
    uint32_t    first_edge;  /* index into edge_byte / edge_child */
    uint32_t    n_edges;
    int32_t     token;       /* index into added[] at the label's end, or -1 */
} tok_trie_node_t;

typedef struct {
    tok_trie_node_t  *nodes;
    uint8_t          *edge_byte;    /* sorted per node */
    uint32_t         *edge_child;
    char             *labels;
    uint32_t          n_nodes;
    uint32_t          root[256];    /* node after the first byte, 0: none */
    uint8_t           first[256];   /* 1 if some token starts with byte */
    int               single;       /* the only such byte, or -1 */
    int               empty;
} tok_trie_t;

typedef struct {
    char       *content;
    size_t      len;
    uint32_t    id;
    unsigned    special:1;
    unsigned    lstrip:1;
    unsigned    rstrip:1;
    unsigned    single_word:1;
    unsigned    normalized:1;
} tok_added_t;

/* ---- normalizer stages, applied in order */

#define TOK_MAX_NORM 8

typedef enum {
    TOK_NORM_UNICODE = 1,   /* NFC / NFD / NFKC / NFKD (opt) */
    TOK_NORM_PREPEND,       /* Prepend: str before a non-empty piece */
    TOK_NORM_REPLACE        /* Replace: pat (or re) -> str, every match */
} tok_norm_kind_t;

typedef struct {
    tok_norm_kind_t   kind;
    int               opt;      /* utf8proc options (TOK_NORM_UNICODE) */
    char             *str;      /* Prepend text, Replace content */
    size_t            len;
    char             *pat;      /* Replace String pattern */
    size_t            plen;
    pcre2_code       *re;       /* Replace Regex pattern */
} tok_norm_t;

/* ---- pre-tokenizer stages */

typedef enum {
    TOK_PRE_SPLIT = 1,      /* Split (regex or literal) with a behaviour */
    TOK_PRE_BYTELEVEL,      /* ByteLevel: prefix space, optional GPT-2 regex */
    TOK_PRE_DIGITS,         /* Digits (individual_digits or runs) */
    TOK_PRE_METASPACE       /* Metaspace: ' ' -> replacement, prepend, split */
} tok_pre_kind_t;

typedef enum {
    TOK_PREPEND_ALWAYS = 0,
    TOK_PREPEND_FIRST,
    TOK_PREPEND_NEVER
} tok_prepend_scheme_t;

typedef enum {
    TOK_SPLIT_REMOVED = 0,
    TOK_SPLIT_ISOLATED,
    TOK_SPLIT_MERGED_PREV,
    TOK_SPLIT_MERGED_NEXT,
    TOK_SPLIT_CONTIGUOUS
} tok_split_behavior_t;

/* Split regexes with a hand-written matcher (tok_pretok_fast.c) */
typedef enum {
    TOK_FAST_NONE = 0,      /* pcre2 */
    TOK_FAST_LLAMA3,        /* Llama 3 / 3.1: \p{N}{1,3} */
    TOK_FAST_QWEN2,         /* Qwen 2 / 3: \p{N} */
    TOK_FAST_GPT2           /* ByteLevel's GPT-2 regex */
} tok_fast_kind_t;

typedef struct {
    tok_pre_kind_t        kind;
    tok_split_behavior_t  behavior;
    int                   invert;
    int                   add_prefix_space;   /* ByteLevel */
    int                   individual;         /* Digits */
    pcre2_code           *re;                 /* Split, ByteLevel regex */
    int                   fast;               /* tok_fast_kind_t of re */
    char                  rep[4];             /* Metaspace replacement */
    uint8_t               rep_len;
    uint8_t               scheme;             /* tok_prepend_scheme_t */
    uint8_t               split;              /* Metaspace split */
} tok_pre_t;

#define TOK_MAX_PRE 8

/* ---- the loaded tokenizer */

struct dpd_tok_s {
    tok_strmap_t   vocab;       /* raw bytes -> id */
    tok_pairmap_t  merges;
    uint32_t       byte_id[256];/* id of each single byte token (byte-level);
                                   of each ASCII character (otherwise) */
    int            ignore_merges;
    /*
     * byte_level: some pre-tokenizer is ByteLevel, the vocabulary is kept
     * as the bytes its GPT-2 alphabet stands for and BPE starts from
     * bytes.  Otherwise (SentencePiece-style files) the vocabulary is the
     * file's UTF-8 and BPE starts from characters, with byte_fallback
     * (<0xNN> tokens, fb_id) and unk_id (fuse_unk) for characters the
     * vocabulary lacks, as Hugging Face's BPE::merge_word.
     */
    int            byte_level;
    int            byte_fallback;
    int            fuse_unk;
    uint32_t       unk_id;      /* TOK_NO_ID: none */
    uint32_t       fb_id[256];  /* id of "<0xNN>", TOK_NO_ID if absent */
    uint32_t       vocab_size;  /* max id + 1 */

    tok_strmap_t   other;       /* vocab strings outside the byte alphabet */
    uint64_t       gen;         /* unique per load: keys the piece cache */

    tok_added_t   *added;
    uint32_t       n_added;
    tok_trie_t     trie_raw;    /* added tokens with normalized=false */
    tok_trie_t     trie_norm;   /* added tokens with normalized=true */

    tok_norm_t     norm[TOK_MAX_NORM];
    int            n_norm;
    int            norm_decomposes;     /* some form is NFD or NFKD */

    tok_pre_t      pre[TOK_MAX_PRE];
    int            n_pre;

    uint32_t      *post_prefix; /* ids added before the text (add_special) */
    uint32_t       n_prefix;
    uint32_t      *post_suffix; /* ids added after */
    uint32_t       n_suffix;

    /* tokenizer_config.json */
    char          *bos_token;
    char          *eos_token;
    struct tok_chat_s *chat;        /* chat templates (tok_chat.c) */

    /* gpt-oss: chats rendered as openai_harmony (tok_harmony.c) */
    int            harmony;
    uint32_t       harmony_id[6];
};

/* the harmony format tokens, in harmony_id[] */
enum {
    TOK_H_START = 0, TOK_H_MESSAGE, TOK_H_END, TOK_H_CHANNEL, TOK_H_CALL,
    TOK_H_CONSTRAIN, TOK_H_N
};

/* ---- per-call work area and output sink */

typedef struct {
    uint32_t   *ids;
    size_t      cap;
    size_t      n;          /* total produced (may exceed cap) */
} tok_sink_t;

typedef struct {
    const dpd_tok_t   *tok;
    tok_sink_t        *sink;
    pcre2_match_data  *md;          /* tok_work_md(): made on first use */
    pcre2_match_context *mctx;      /* only after a JIT stack overflow */
    pcre2_jit_stack   *jstack;
    /* BPE scratch */
    void              *sym;
    size_t             sym_cap;
    uint64_t          *tree;        /* tok_bpe.c: the pairs of a long piece */
    size_t             tree_cap;
    int                oom;
    int                at_start;    /* this piece starts the input text */
} tok_work_t;

/* w->md, made on first use (most encodes never run pcre2: the fast
 * pre-tokenizers, no normalizer); NULL with w->oom set if it cannot be */
pcre2_match_data *tok_work_md(tok_work_t *w);

static inline void
tok_emit(tok_sink_t *s, uint32_t id)
{
    if (s->n < s->cap) {
        s->ids[s->n] = id;
    }
    s->n++;
}

/* tok_utf8.c */
size_t tok_utf8_sanitize_len(const char *s, size_t len, int *valid);
size_t tok_utf8_sanitize(const char *s, size_t len, char *out);
int tok_byte_level_decode(const char *s, size_t len, char *out,
    size_t *outlen);
size_t tok_utf8_encode(uint32_t cp, char *out);
size_t tok_utf8_decode(const char *s, size_t len, uint32_t *cp);
int tok_is_unicode_space(uint32_t cp);
int tok_is_word_char(uint32_t cp);
/* assigned in Unicode 9.0, the tables of Hugging Face's normalizers */
int tok_unicode9_assigned(uint32_t cp);

/* tok_trie.c */
int tok_trie_build(tok_trie_t *t, const tok_added_t *added, uint32_t n,
    int normalized);
void tok_trie_free(tok_trie_t *t);
/* longest token starting at s[0..len); returns added index or -1 */
int32_t tok_trie_match(const tok_trie_t *t, const char *s, size_t len,
    size_t *mlen);

/* tok_bpe.c */
void tok_bpe(tok_work_t *w, const char *s, size_t len);
void tok_bpe_merge(tok_work_t *w, const char *s, size_t len, uint64_t h);

/* tok_pretok.c */
pcre2_code *tok_regex_compile(const char *pattern, size_t len, int literal,
    char *err, size_t errlen);
void tok_pretokenize(tok_work_t *w, int stage, const char *s, size_t len);

/* tok_pretok_fast.c */
int tok_pretok_fast_kind(const char *pattern, size_t len);
/* end of the match of pattern `kind` that starts at `at` (< len) */
size_t tok_pretok_fast_next(int kind, const char *s, size_t len, size_t at);
void tok_pretok_fast_bpe(tok_work_t *w, int kind, const char *s, size_t len,
    int top);

/* tok_encode.c */
long tok_encode_sink(const dpd_tok_t *tok, const char *text, size_t len,
    int add_special, tok_sink_t *sink);
/* encode_ordinary: no added-token matching (harmony's text pieces) */
long tok_encode_plain_sink(const dpd_tok_t *tok, const char *text,
    size_t len, tok_sink_t *sink);
/* s normalized by every stage: 0 with *out malloc'ed, or -1 (ENOMEM) */
int tok_normalize(const dpd_tok_t *tok, const char *s, size_t len,
    char **out, size_t *outlen);

/* tok_config.c */
int tok_load_config(dpd_tok_t *tok, const char *path, char *err,
    size_t errlen);
struct cJSON;
int tok_config_specials(dpd_tok_t *tok, const struct cJSON *root, char *err,
    size_t errlen);
int tok_chat_load(dpd_tok_t *tok, const struct cJSON *config_root,
    const char *config_path, char *err, size_t errlen);
void tok_chat_free(struct tok_chat_s *chat);

/* tok_harmony.c */
void tok_harmony_detect(dpd_tok_t *tok);
int tok_harmony_render(const dpd_tok_t *tok, const struct cJSON *request,
    int want_ids, char **text, size_t *textlen, uint32_t **ids,
    size_t *nids, long *count, char *err, size_t errlen);

/* tok_load.c */
struct cJSON;
dpd_tok_t *tok_load_mem(const char *buf, size_t len, const char *name,
    char *err, size_t errlen);
/* mode: TOK_LOAD_AUTO (the fast path when the file allows it) or
 * TOK_LOAD_CJSON (the whole file through cJSON, for differential tests);
 * *fast (may be NULL) says which path loaded it */
#define TOK_LOAD_AUTO   0
#define TOK_LOAD_CJSON  1
dpd_tok_t *tok_load_mem_mode(const char *buf, size_t len, const char *name,
    int mode, int *fast, char *err, size_t errlen);
char *tok_read_file(const char *path, size_t *len, char *err, size_t errlen);
struct cJSON *tok_parse_json(const char *path, const char *buf, size_t len,
    char *err, size_t errlen);

/* tok_load_fast.c: model.vocab and model.merges read from the text */
typedef struct {
    uint32_t     off, len;      /* a string's text (len | 1 << 31: escaped) */
    uint32_t     off2, len2;    /* vocab: off2 is the id; pairs: "b" */
} tok_fast_ent_t;

typedef struct {
    const char  *base;          /* the document */
    const char  *vocab;         /* the value's text, in the document */
    size_t       vocab_len;
    uint32_t     n_vocab;
    const char  *merges;
    size_t       merges_len;
    uint32_t     n_merges;
    int          pairs;         /* merges as ["a", "b"] */
    size_t       merge_max;     /* longest merge, raw text */
    size_t       max_str;       /* longest string of either, raw text */
    tok_fast_ent_t  *vocab_ent;     /* n_vocab, in document order */
    tok_fast_ent_t  *merges_ent;    /* n_merges */
} tok_fast_t;

typedef struct {
    const tok_fast_t  *f;
    uint32_t           i;
    char              *dec_a, *dec_b;   /* max_str + 1 bytes each */
} tok_fast_iter_t;

int tok_fast_scan(const char *buf, size_t len, tok_fast_t *f);
char *tok_fast_rest(const char *buf, size_t len, const tok_fast_t *f,
    size_t *outlen);
void tok_fast_free(tok_fast_t *f);
void tok_fast_iter_init(tok_fast_iter_t *it, const tok_fast_t *f,
    char *dec_a, char *dec_b);
int tok_fast_vocab_next(tok_fast_iter_t *it, const char **key, size_t *klen,
    uint32_t *id);
int tok_fast_merge_next(tok_fast_iter_t *it, const char **a, size_t *alen,
    const char **b, size_t *blen);

/* error helper */
void tok_err(char *err, size_t errlen, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

#endif /* DPD_TOK_INTERNAL_H */
