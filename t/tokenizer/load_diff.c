/*
 * load_diff [-m N] FILE...: load each tokenizer.json both ways (the fast
 * path of tok_load_fast.c and cJSON for the whole file) and compare the
 * outcome: the same refusal message or equal tables.  -m N also tries N
 * mutations of each file (bytes replaced, JSON fragments inserted, ranges
 * deleted, truncation; one to three each), chosen by a fixed seed.  Prints one summary line
 * per file: "FILE: fast F/T loaded L/T diffs D"; exit 1 on any difference.
 */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"
#include "fuzz/tok_load_diff.h"


static uint64_t  rng = 0x2545f4914f6cdd1dULL;

static uint32_t
rnd(uint32_t n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return n ? (uint32_t) (rng % n) : 0;
}


static const char *const  frags[] = {
    "\\u0000", "\\uD83D\\uDE00", "\\uDE00", "\\uD83D", "\\uD83Dx", "\\u0041",
    "\\u0120", "\\u00e9", "\\n", "\\\"", "\\\\", "\\/", "\\x", "\\u12", "1.0",
    "1e2", "-0", "-1", "2147483648", "2147483647", "01", "1.", "0.5e-3",
    "99999999999999999999999999999999999999", "\"vocab\":{\"a\":1},",
    "\"merges\":[],", "\"merges\":[\"a b\"],", "\"model\":{},",
    "\"model\":{\"vocab\":{\"h\":0},\"merges\":[]},", "\"vocab\":",
    "\"merges\":", "\"voc\\u0061b\":{\"q\":5},", "{", "}", "[", "]", ",",
    ":", "\"", " ", "\t", "\r\n", "\f", "\x01", "\x7f", "\xef\xbb\xbf",
    "\xc4\xa0", "\xc4", "\x80", "\xff", "null", "true", "[[[[[[[[", "]]]]",
    "[\"a\",\"b\"]", "\"a b\"", "\"a  b\"", "\"\"", "\"\\u0020\"",
};

static const char  bytes[] = "\"\\{}[],: \t\n0-.eEu\x01\x7f\xff\xc4\x80" "aA";


static char *
mutate1(const char *buf, size_t len, size_t *olen)
{
    size_t       pos = rnd((uint32_t) len + 1), n, k;
    const char  *f;
    char        *out = malloc(len + 64);

    if (out == NULL) {
        return NULL;
    }
    memcpy(out, buf, len);
    switch (rnd(4)) {
    case 0:     /* replace a byte */
        if (pos < len) {
            out[pos] = bytes[rnd(sizeof(bytes) - 1)];
        }
        *olen = len;
        break;
    case 1:     /* insert a fragment */
        f = frags[rnd(sizeof(frags) / sizeof(frags[0]))];
        n = strlen(f);
        memmove(out + pos + n, out + pos, len - pos);
        memcpy(out + pos, f, n);
        *olen = len + n;
        break;
    case 2:     /* delete a few bytes */
        k = 1 + rnd(8);
        if (pos + k > len) {
            k = len - pos;
        }
        memmove(out + pos, out + pos + k, len - pos - k);
        *olen = len - k;
        break;
    default:    /* truncate */
        *olen = pos;
        break;
    }
    return out;
}


/* one to three edits */
static char *
mutate(const char *buf, size_t len, size_t *olen)
{
    char      *m = mutate1(buf, len, olen), *m2;
    uint32_t   k = rnd(3);

    while (m != NULL && k-- > 0) {
        m2 = mutate1(m, *olen, olen);
        free(m);
        m = m2;
    }
    return m;
}


int
main(int argc, char **argv)
{
    char      err[512], *buf, *m;
    size_t    len, mlen;
    long      muts = 0, j;
    int       i = 1, fast, loaded, bad = 0, nf, nl, nd, tries;

    if (argc > 2 && strcmp(argv[1], "-m") == 0) {
        muts = atol(argv[2]);
        i = 3;
    }
    for ( ; i < argc; i++) {
        buf = tok_read_file(argv[i], &len, err, sizeof(err));
        if (buf == NULL) {
            fprintf(stderr, "%s\n", err);
            return 2;
        }
        nf = nl = nd = 0;
        tries = 1;
        if (tok_load_diff(buf, len, argv[i], &fast, &loaded) != 0) {
            nd++;
        }
        nf += fast;
        nl += loaded;
        for (j = 0; j < muts; j++) {
            m = mutate(buf, len, &mlen);
            if (m == NULL) {
                return 2;
            }
            tries++;
            if (tok_load_diff(m, mlen, argv[i], &fast, &loaded) != 0) {
                nd++;
                fprintf(stderr, "  (mutation %ld)\n", j);
            }
            nf += fast;
            nl += loaded;
            free(m);
        }
        printf("%s: fast %d/%d loaded %d/%d diffs %d\n", argv[i], nf, tries,
               nl, tries, nd);
        bad |= nd != 0;
        free(buf);
    }
    return bad;
}
