/*
 * The hand-written pre-tokenizer matchers (tok_pretok_fast.c) against
 * pcre2 on the same patterns: identical split boundaries on every code
 * point in a set of contexts, on the corpus, on random strings of the
 * characters where the patterns' branches meet, and on random bytes after
 * the lossy UTF-8 decode; then whole encodes (ids) with the fast path on
 * and off, under every Split behaviour and invert.  TAP lines on stdout.
 *
 *   pretok_diff LLAMA3_DIR QWEN3_DIR CORPUS.jsonl [RANDOM_STRINGS [quick]]
 * quick (for valgrind): no code point sweep, the first 100 corpus texts.
 */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cjson/cJSON.h>

#include "tok_internal.h"

#define GPT2_RE "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+" \
                "| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"

typedef struct {
    const char        *name;
    int                kind;
    const pcre2_code  *re;
    long               checked;
    long               bad;
} pat_t;

static pat_t              pats[3];
static pcre2_match_data  *md;
static int                test_no;
static int                failed;
static uint64_t           rng = 0x9E3779B97F4A7C15ull;


static void
ok(int cond, const char *fmt, const char *arg)
{
    printf("%sok %d - ", cond ? "" : "not ", ++test_no);
    printf(fmt, arg);
    printf("\n");
    if (!cond) {
        failed = 1;
    }
}


static uint32_t
rnd(uint32_t n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t) (rng % n);
}


static void
show(const char *s, size_t len)
{
    size_t  i;

    for (i = 0; i < len && i < 120; i++) {
        printf("%02x", (unsigned char) s[i]);
    }
    printf("\n");
}


/* Split s both ways; 0 if the boundaries agree. */
static int
compare(pat_t *p, const char *s, size_t len)
{
    PCRE2_SIZE  *ov = pcre2_get_ovector_pointer(md);
    size_t       at = 0, fe;
    int          rc;

    p->checked++;
    while (at < len) {
        rc = pcre2_match(p->re, (PCRE2_SPTR) s, len, at, PCRE2_NO_UTF_CHECK,
                         md, NULL);
        fe = tok_pretok_fast_next(p->kind, s, len, at);
        if (rc < 0 || ov[0] != at || ov[1] != fe || fe <= at) {
            if (p->bad++ < 5) {
                printf("# %s: at %zu pcre2 %ld..%ld fast ..%zu in ", p->name,
                       at, rc < 0 ? -1L : (long) ov[0],
                       rc < 0 ? -1L : (long) ov[1], fe);
                show(s, len);
            }
            return -1;
        }
        at = fe;
    }
    return 0;
}


static void
compare_all(const char *s, size_t len)
{
    int  i;

    for (i = 0; i < 3; i++) {
        compare(&pats[i], s, len);
    }
}


/* Every code point in contexts where the branches meet. */
static void
every_code_point(void)
{
    static const char  *ctx[] = {
        "%", "a%b", "%a", " %", " %a", " %.", "%%", "%%%%", "'%", "'%e",
        "'r%", "'v%", "'l%", "'%l", "'%x", "1%2", "123%4", "%\n", "%\r\n",
        " %\n", "\n%", "% ", "%  ", "%  x", "\t%", "\t%a", ".%", "%.",
        " \t%", "%'s", "x%'S", NULL
    };
    char      buf[64], u[8];
    size_t    n, o, k, c;
    uint32_t  cp;
    long      before[3];
    int       i;

    for (i = 0; i < 3; i++) {
        before[i] = pats[i].bad;
    }
    for (cp = 0; cp <= 0x10FFFF; cp++) {
        if (cp >= 0xD800 && cp <= 0xDFFF) {
            continue;
        }
        n = tok_utf8_encode(cp, u);
        for (k = 0; ctx[k] != NULL; k++) {
            o = 0;
            for (c = 0; ctx[k][c] != '\0'; c++) {
                if (ctx[k][c] == '%') {
                    memcpy(buf + o, u, n);
                    o += n;
                } else {
                    buf[o++] = ctx[k][c];
                }
            }
            compare_all(buf, o);
        }
    }
    for (i = 0; i < 3; i++) {
        ok(pats[i].bad == before[i],
           "%s: every code point in 31 contexts", pats[i].name);
    }
}


/* Characters where the patterns' branches meet, and a random one. */
static size_t
random_text(char *out, size_t max)
{
    static const char  *pieces[] = {
        "a", "Z", "s", "S", "t", "T", "r", "R", "e", "E", "v", "V", "m", "M",
        "l", "L", "d", "D", "k", "K", "'", "'", "'", "\xc5\xbf", /* long s */
        "\xe2\x84\xaa", /* Kelvin */ "\xe2\x80\x99", "0", "7", "\xd9\xa3",
        "\xe2\x85\xa2", "\xc2\xb2", "\xef\xbc\x91", " ", " ", " ", "\t",
        "\n", "\r", "\r\n", "\x0b", "\x0c", "\xc2\x85", "\xc2\xa0",
        "\xe1\x9a\x80", "\xe2\x80\x80", "\xe2\x80\x8a", "\xe2\x80\x8b",
        "\xe2\x80\xa8", "\xe2\x80\xa9", "\xe2\x80\xaf", "\xe2\x81\x9f",
        "\xe3\x80\x80", "\xe1\xa0\x8e", /* U+180E */ "\xef\xbb\xbf",
        "\xcc\x81", "\xe0\xa4\x95", "\xe0\xa5\x8d", "\xe0\xb8\x81",
        "\xe4\xb8\xad", "\xe3\x81\x82", "\xf0\x9f\x98\x80", "\xf0\x9d\x90\x80",
        "\xc3\xa9", "\xce\xb1", "\xd0\x96", "\xd7\x90", "\xd8\xb9", ".", ",",
        "!", "/", "-", "_", "\"", "(", "\xc2\xbf", "\xe2\x80\x94",
        "\xef\xbf\xbd", "NUL", "\x01", "\x7f", "\xc2\x80", "\xf4\x8f\xbf\xbf",
        NULL
    };
    size_t    n = 0, np, k, want = 1 + rnd(48);
    uint32_t  cp;

    for (np = 0; pieces[np] != NULL; np++) {
    }
    while (n + 8 < max && want-- > 0) {
        if (rnd(8) == 0) {
            do {
                cp = rnd(4) ? rnd(0x3000) : rnd(0x110000);
            } while (cp >= 0xD800 && cp <= 0xDFFF);
            n += tok_utf8_encode(cp, out + n);
            continue;
        }
        k = rnd((uint32_t) np);
        if (strcmp(pieces[k], "NUL") == 0) {
            out[n++] = '\0';
            continue;
        }
        memcpy(out + n, pieces[k], strlen(pieces[k]));
        n += strlen(pieces[k]);
    }
    return n;
}


static size_t
random_bytes(char *out, size_t max)
{
    char    raw[256];
    size_t  n = 1 + rnd(sizeof(raw) - 1), i;
    int     valid;

    for (i = 0; i < n; i++) {
        raw[i] = (char) (rnd(3) ? 0x80 + rnd(0x80) : rnd(0x80));
    }
    if (tok_utf8_sanitize_len(raw, n, &valid) > max) {
        return 0;
    }
    return tok_utf8_sanitize(raw, n, out);
}


static int
encode_same(dpd_tok_t *a, dpd_tok_t *b, const char *s, size_t len)
{
    static uint32_t  ia[1 << 16], ib[1 << 16];
    long             na, nb;

    na = dpd_tok_encode(a, s, len, 1, ia, 1 << 16);
    nb = dpd_tok_encode(b, s, len, 1, ib, 1 << 16);
    if (na != nb || na < 0
        || memcmp(ia, ib, (size_t) (na < (1 << 16) ? na : (1 << 16))
                  * sizeof(uint32_t)) != 0)
    {
        printf("# encode differs (%ld vs %ld ids) on ", na, nb);
        show(s, len);
        return -1;
    }
    return 0;
}


static dpd_tok_t *
load(const char *dir)
{
    char        path[4096], err[512];
    dpd_tok_t  *t;

    snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
    t = dpd_tok_load(path, NULL, err, sizeof(err));
    if (t == NULL) {
        printf("Bail out! %s: %s\n", path, err);
        exit(1);
    }
    return t;
}


int
main(int argc, char **argv)
{
    static char  buf[1 << 16];
    dpd_tok_t   *l3, *q3, *slow[2], *fast[2];
    pcre2_code  *gpt2;
    FILE        *f;
    char        *line = NULL, err[256];
    size_t       cap = 0, n, len;
    ssize_t      r;
    long         lines = 0, nrand, i, before[3], bad;
    cJSON       *j;
    int          k, m, beh, inv, quick;

    if (argc < 4) {
        fprintf(stderr, "usage: %s LLAMA3_DIR QWEN3_DIR CORPUS [N]\n",
                argv[0]);
        return 2;
    }
    nrand = argc > 4 ? atol(argv[4]) : 300000;
    quick = argc > 5 && strcmp(argv[5], "quick") == 0;
    md = pcre2_match_data_create(1, NULL);
    l3 = load(argv[1]);
    q3 = load(argv[2]);

    ok(l3->n_pre == 2 && l3->pre[0].fast == TOK_FAST_LLAMA3,
       "%s: the Split regex gets the fast matcher", "llama3");
    ok(q3->n_pre == 2 && q3->pre[0].fast == TOK_FAST_QWEN2,
       "%s: the Split regex gets the fast matcher", "qwen3");
    ok(tok_pretok_fast_kind(GPT2_RE, sizeof(GPT2_RE) - 1) == TOK_FAST_GPT2,
       "%s: ByteLevel's regex gets the fast matcher", "gpt2");
    ok(tok_pretok_fast_kind(GPT2_RE, sizeof(GPT2_RE) - 2) == TOK_FAST_NONE,
       "%s: another pattern stays on pcre2", "gpt2 minus a char");
    gpt2 = tok_regex_compile(GPT2_RE, sizeof(GPT2_RE) - 1, 0, err,
                             sizeof(err));
    if (gpt2 == NULL) {
        printf("Bail out! %s\n", err);
        return 1;
    }
    pats[0] = (pat_t) { "llama3", TOK_FAST_LLAMA3, l3->pre[0].re, 0, 0 };
    pats[1] = (pat_t) { "qwen3", TOK_FAST_QWEN2, q3->pre[0].re, 0, 0 };
    pats[2] = (pat_t) { "gpt2", TOK_FAST_GPT2, gpt2, 0, 0 };

    if (!quick) {
        every_code_point();
    }

    /* the corpus, each text as the encoder sees it */
    for (k = 0; k < 3; k++) {
        before[k] = pats[k].bad;
    }
    f = fopen(argv[3], "r");
    if (f == NULL) {
        printf("Bail out! %s\n", argv[3]);
        return 1;
    }
    while ((r = getline(&line, &cap, f)) > 0 && (!quick || lines < 100)) {
        j = cJSON_Parse(line);
        if (cJSON_IsString(j)) {
            const char *t = j->valuestring;
            size_t      tl = strlen(t);
            int         valid;
            char       *san = malloc(tok_utf8_sanitize_len(t, tl, &valid) + 1);

            len = tok_utf8_sanitize(t, tl, san);
            compare_all(san, len);
            free(san);
            lines++;
        }
        cJSON_Delete(j);
    }
    fclose(f);
    for (k = 0; k < 3; k++) {
        ok(lines > (quick ? 50 : 1000) && pats[k].bad == before[k],
           "%s: corpus texts split identically", pats[k].name);
    }

    for (k = 0; k < 3; k++) {
        before[k] = pats[k].bad;
    }
    for (i = 0; i < nrand; i++) {
        n = random_text(buf, sizeof(buf));
        compare_all(buf, n);
        n = random_bytes(buf, sizeof(buf));
        compare_all(buf, n);
    }
    for (k = 0; k < 3; k++) {
        ok(pats[k].bad == before[k],
           "%s: random strings and lossy-decoded bytes split identically",
           pats[k].name);
    }
    printf("# strings compared: llama3 %ld, qwen3 %ld, gpt2 %ld\n",
           pats[0].checked, pats[1].checked, pats[2].checked);

    /* whole encodes, fast path on and off, every behaviour and invert */
    for (m = 0; m < 2; m++) {
        fast[m] = load(argv[1 + m]);
        slow[m] = load(argv[1 + m]);
        slow[m]->pre[0].fast = TOK_FAST_NONE;
        for (beh = TOK_SPLIT_REMOVED; beh <= TOK_SPLIT_CONTIGUOUS; beh++) {
            for (inv = 0; inv < 2; inv++) {
                fast[m]->pre[0].behavior = slow[m]->pre[0].behavior = beh;
                fast[m]->pre[0].invert = slow[m]->pre[0].invert = inv;
                bad = 0;
                for (i = 0; i < nrand / 50; i++) {
                    n = random_text(buf, sizeof(buf));
                    if (encode_same(fast[m], slow[m], buf, n) != 0
                        && ++bad > 3)
                    {
                        break;
                    }
                }
                snprintf(err, sizeof(err), "%s, behaviour %d, invert %d",
                         m ? "qwen3" : "llama3", beh, inv);
                ok(bad == 0, "%s: encode ids equal with and without the "
                   "fast matcher", err);
            }
        }
        dpd_tok_free(fast[m]);
        dpd_tok_free(slow[m]);
    }

    pcre2_code_free(gpt2);
    pcre2_match_data_free(md);
    dpd_tok_free(l3);
    dpd_tok_free(q3);
    free(line);
    printf("1..%d\n", test_no);
    return failed;
}
