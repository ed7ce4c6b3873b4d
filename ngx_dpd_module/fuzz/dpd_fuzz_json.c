/*
 * Differential libFuzzer target: ngx_http_dpd_json_parse() against
 * libcjson's cJSON_ParseWithLengthOpts(data, len, &end, 0), on any bytes
 * (a superset of the bodies dpd_scan() lets through).  Asserted for each
 * input (and for it without its first byte, the selector byte of the
 * dpd_fuzz_request corpus):
 *   - both accept or both refuse, with the same end (error) position;
 *   - accepted: the trees are identical node by node: type, key bytes,
 *     valuestring bytes, valueint, valuedouble's bit pattern, next/prev
 *     links, child counts; the same number of live allocations of the
 *     same total size through cJSON's hooks (cJSON's temporary number
 *     copies are freed again, so they do not count);
 *   - refused: nothing left allocated by either;
 *   - ngx_http_dpd_json_parse_in() (nodes from a caller's pool, here each
 *     block malloc()ed alone) gives the same verdict, end and tree, and
 *     leaves nothing allocated through cJSON's hooks.
 * Without libFuzzer (-DDPD_JSON_MAIN, t/216-json-builder.t): each file
 * named on the command line is one input, or with "-r FILE" a series of
 * inputs, each "LENGTH\n" then its bytes; prints "ok N" (inputs) or
 * aborts on the first difference.
 */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ngx_http_dpd_json.h"


#define CHECK(c)                                                              \
    do {                                                                      \
        if (!(c)) {                                                           \
            fprintf(stderr, "dpd_fuzz_json: %s:%d: %s\n", __FILE__,           \
                    __LINE__, #c);                                            \
            abort();                                                          \
        }                                                                     \
    } while (0)


static size_t  live_n, live_bytes;


static void *
count_alloc(size_t size)
{
    size_t  *p;

    p = malloc(size + sizeof(size_t) * 2);
    if (p == NULL) {
        return NULL;
    }

    p[0] = size;
    live_n++;
    live_bytes += size;

    return p + 2;
}


static void
count_free(void *q)
{
    size_t  *p;

    if (q == NULL) {
        return;
    }

    p = (size_t *) q - 2;
    live_n--;
    live_bytes -= p[0];
    free(p);
}


/* the pool of _parse_in(): every block of its own, freed together */
static void   **pool_v;
static size_t   pool_n, pool_cap;


static void *
pool_alloc(void *data, size_t size)
{
    void  *p, **v;

    (void) data;

    if (pool_n == pool_cap) {
        pool_cap = pool_cap ? pool_cap * 2 : 64;
        v = realloc(pool_v, pool_cap * sizeof(void *));
        if (v == NULL) {
            return NULL;
        }
        pool_v = v;
    }

    p = malloc(size ? size : 1);
    if (p) {
        pool_v[pool_n++] = p;
    }

    return p;
}


static void
pool_free(void)
{
    while (pool_n) {
        free(pool_v[--pool_n]);
    }
}


static void
same_tree(const cJSON *a, const cJSON *b)
{
    const cJSON  *ca, *cb, *pa, *pb;

    CHECK(a->type == b->type);
    CHECK(a->valueint == b->valueint);
    CHECK(memcmp(&a->valuedouble, &b->valuedouble, sizeof(double)) == 0);
    CHECK((a->string == NULL) == (b->string == NULL));
    CHECK(a->string == NULL || strcmp(a->string, b->string) == 0);
    CHECK((a->valuestring == NULL) == (b->valuestring == NULL));
    CHECK(a->valuestring == NULL
          || strcmp(a->valuestring, b->valuestring) == 0);
    CHECK((a->child == NULL) == (b->child == NULL));

    pa = NULL;
    pb = NULL;

    for (ca = a->child, cb = b->child; ca && cb; ca = ca->next, cb = cb->next)
    {
        /* prev: the previous sibling, the first's the last one */
        CHECK(pa == NULL || ca->prev == pa);
        CHECK(pb == NULL || cb->prev == pb);
        same_tree(ca, cb);
        pa = ca;
        pb = cb;
    }

    CHECK(ca == NULL && cb == NULL);
    CHECK(a->child == NULL || a->child->prev == pa);
    CHECK(b->child == NULL || b->child->prev == pb);
}


static void
one(const char *data, size_t len)
{
    cJSON       *a, *b, *c;
    size_t       an, abytes;
    const char  *ea, *eb, *ec;

    ea = NULL;
    eb = NULL;
    ec = NULL;

    a = cJSON_ParseWithLengthOpts(data, len, &ea, 0);
    an = live_n;
    abytes = live_bytes;

    c = ngx_http_dpd_json_parse_in(data, len, &ec, pool_alloc, NULL);

    CHECK((a == NULL) == (c == NULL));
    CHECK(ea == ec);
    CHECK(live_n == an && live_bytes == abytes);

    if (a) {
        same_tree(a, c);
    }

    pool_free();

    b = ngx_http_dpd_json_parse(data, len, &eb);

    CHECK((a == NULL) == (b == NULL));
    CHECK(ea == eb);

    if (a) {
        CHECK(live_n - an == an && live_bytes - abytes == abytes);
        same_tree(a, b);
        cJSON_Delete(a);
        cJSON_Delete(b);
    }

    CHECK(live_n == 0 && live_bytes == 0);
}


int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int  hooked;
    cJSON_Hooks  hooks;
    char        *copy;

    if (!hooked) {
        hooks.malloc_fn = count_alloc;
        hooks.free_fn = count_free;
        cJSON_InitHooks(&hooks);
        hooked = 1;
    }

    /* an exact-size copy: ASan sees any read past the end */
    copy = malloc(size ? size : 1);
    CHECK(copy != NULL);
    memcpy(copy, data, size);

    one(copy, size);

    if (size > 1) {
        one(copy + 1, size - 1);
    }

    free(copy);

    return 0;
}


#ifdef DPD_JSON_MAIN

static char *
slurp(const char *name, size_t *len)
{
    long   n;
    char  *buf;
    FILE  *f;

    f = fopen(name, "rb");
    if (f == NULL) {
        perror(name);
        exit(2);
    }

    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);

    buf = malloc(n ? n : 1);
    if (n < 0 || buf == NULL || fread(buf, 1, n, f) != (size_t) n) {
        fprintf(stderr, "%s: cannot read\n", name);
        exit(2);
    }

    fclose(f);
    *len = (size_t) n;

    return buf;
}


int
main(int argc, char **argv)
{
    int            i;
    char          *buf, *p, *e;
    size_t         len, n;
    unsigned long  count, one_len;

    count = 0;

    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-r") == 0 && i + 1 < argc) {
            buf = slurp(argv[++i], &len);
            p = buf;

            while (p < buf + len) {
                one_len = strtoul(p, &e, 10);
                if (e == p || e >= buf + len || *e != '\n'
                    || one_len > (size_t) (buf + len - e - 1))
                {
                    fprintf(stderr, "%s: bad record\n", argv[i]);
                    return 2;
                }

                LLVMFuzzerTestOneInput((const uint8_t *) e + 1, one_len);
                p = e + 1 + one_len;
                count++;
            }

            free(buf);
            continue;
        }

        buf = slurp(argv[i], &n);
        LLVMFuzzerTestOneInput((const uint8_t *) buf, n);
        free(buf);
        count++;
    }

    printf("ok %lu\n", count);

    return 0;
}

#endif
