/*
 * Our side of bench/tokenizer.sh: load time, memory, and encode throughput
 * of libdpdtok on a JSONL corpus (one JSON string per line).
 *
 *   tokenizer_bench TOKENIZER_JSON CORPUS_JSONL [SECONDS]
 *
 * The corpus is decoded into memory first (as the Hugging Face side does),
 * then encoded again and again for at least SECONDS (default 3): one
 * thread, ids materialised (dpd_tok_encode) and count only (dpd_tok_count).
 */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <cjson/cJSON.h>

#include "dpd_tokenizer.h"


static int  use_cpu_clock;


/* wall clock; BENCH_CPU=1: this process's CPU time (steadier on a busy box) */
static double
now(void)
{
    struct timespec  ts;

    clock_gettime(use_cpu_clock ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC,
                  &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}


static long
status_kb(const char *key)
{
    FILE  *f = fopen("/proc/self/status", "r");
    char   line[256];
    long   v = -1;

    if (f == NULL) {
        return -1;
    }
    while (fgets(line, sizeof(line), f)) {
        if (strncmp(line, key, strlen(key)) == 0) {
            v = strtol(line + strlen(key) + 1, NULL, 10);
        }
    }
    fclose(f);
    return v;
}


static int
cmp_double(const void *a, const void *b)
{
    double  x = *(const double *) a, y = *(const double *) b;

    return (x > y) - (x < y);
}


int
main(int argc, char **argv)
{
    dpd_tok_t  *tok;
    char        err[512], line[1 << 16], **texts = NULL, *big = NULL;
    size_t     *lens = NULL, n = 0, cap = 0, bytes = 0, i, bl = 0, bc = 0;
    double      t0, t1, secs = argc > 3 ? atof(argv[3]) : 3.0;
    long        rss0, total = 0, r;
    int         reps;
    double      loads[64];
    size_t      nloads = 5;
    uint32_t   *ids = malloc(sizeof(uint32_t) << 20);
    FILE       *f;

    if (argc < 3) {
        fprintf(stderr, "usage: tokenizer_bench TOKENIZER CORPUS [SECS]\n");
        return 2;
    }
    use_cpu_clock = getenv("BENCH_CPU") && atoi(getenv("BENCH_CPU"));
    if (getenv("BENCH_LOADS") && atoi(getenv("BENCH_LOADS")) > 0) {
        nloads = (size_t) atoi(getenv("BENCH_LOADS"));
        if (nloads > 64) {
            nloads = 64;
        }
    }
    rss0 = status_kb("VmRSS:");
    t0 = now();
    tok = dpd_tok_load(argv[1], NULL, err, sizeof(err));
    t1 = now();
    if (tok == NULL) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    loads[0] = (t1 - t0) * 1e3;
    printf("ours.rss_after_load_mb %.1f\n", status_kb("VmRSS:") / 1024.0);
    printf("ours.rss_peak_load_mb %.1f\n", status_kb("VmHWM:") / 1024.0);
    printf("ours.rss_tables_mb %.1f\n", (status_kb("VmRSS:") - rss0) / 1024.0);

    /* the load time: the median of BENCH_LOADS loads (one sample swings
     * by half on a shared host); the first one is the memory figures' */
    for (i = 1; i < nloads; i++) {
        dpd_tok_t  *again;

        t0 = now();
        again = dpd_tok_load(argv[1], NULL, err, sizeof(err));
        t1 = now();
        if (again == NULL) {
            fprintf(stderr, "%s\n", err);
            return 1;
        }
        dpd_tok_free(again);
        loads[i] = (t1 - t0) * 1e3;
    }
    printf("ours.load_ms_first %.1f\n", loads[0]);
    qsort(loads, nloads, sizeof(double), cmp_double);
    printf("ours.load_ms %.1f\n", loads[nloads / 2]);
    printf("ours.load_ms_min %.1f\n", loads[0]);
    printf("ours.load_ms_max %.1f\n", loads[nloads - 1]);
    printf("ours.loads %zu\n", nloads);

    /* read the corpus: long lines are read in pieces and joined */
    f = fopen(argv[2], "rb");
    if (f == NULL) {
        perror(argv[2]);
        return 1;
    }
    while (fgets(line, sizeof(line), f)) {
        size_t l = strlen(line);
        if (bl + l + 1 > bc) {
            bc = (bl + l + 1) * 2;
            big = realloc(big, bc);
        }
        memcpy(big + bl, line, l + 1);
        bl += l;
        if (l == 0 || line[l - 1] != '\n') {
            continue;
        }
        cJSON *s = cJSON_ParseWithLength(big, bl);
        bl = 0;
        if (!cJSON_IsString(s)) {
            cJSON_Delete(s);
            continue;
        }
        if (n == cap) {
            cap = cap ? cap * 2 : 1024;
            texts = realloc(texts, cap * sizeof(char *));
            lens = realloc(lens, cap * sizeof(size_t));
        }
        texts[n] = strdup(s->valuestring);
        lens[n] = strlen(texts[n]);
        bytes += lens[n];
        n++;
        cJSON_Delete(s);
    }
    fclose(f);

    for (i = 0; i < n; i++) {
        total += dpd_tok_count(tok, texts[i], lens[i], 0);
    }
    printf("corpus.texts %zu\ncorpus.bytes %zu\ncorpus.tokens %ld\n", n, bytes,
           total);

    for (int mode = 0; mode < 2; mode++) {
        reps = 0;
        t0 = now();
        do {
            for (i = 0; i < n; i++) {
                r = mode == 0 ? dpd_tok_encode(tok, texts[i], lens[i], 0, ids,
                                               1 << 20)
                              : dpd_tok_count(tok, texts[i], lens[i], 0);
                if (r < 0) {
                    fprintf(stderr, "encode failed\n");
                    return 1;
                }
            }
            reps++;
            t1 = now();
        } while (t1 - t0 < secs);
        printf("ours.%s.mb_per_s %.2f\n", mode == 0 ? "encode" : "count",
               bytes * (double) reps / (t1 - t0) / 1e6);
        printf("ours.%s.tokens_per_s %.0f\n", mode == 0 ? "encode" : "count",
               total * (double) reps / (t1 - t0));
    }
    for (i = 0; i < n; i++) {
        free(texts[i]);
    }
    free(texts);
    free(lens);
    free(big);
    free(ids);
    dpd_tok_free(tok);
    return 0;
}
