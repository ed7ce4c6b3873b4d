/*
 * Chat render + count benchmark (bench/chat_render.sh builds it twice:
 * against this tree's library and against a baseline tree's).
 *   chat_bench tokenizer.json tokenizer_config.json SECONDS [chat10|doc4k]
 * Two requests, parsed once (as the module does), counted again and again
 * with dpd_chat_count_json(): a 10-message chat and a document chat (a
 * system prompt, a ~4096-token document, a question).  Prints
 * "NAME us_per_request tokens" lines; CPU time (one core).
 */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <cjson/cJSON.h>

#include "dpd_tokenizer.h"


static double
cpu_now(void)
{
    struct timespec  ts;

    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double) ts.tv_sec + (double) ts.tv_nsec / 1e9;
}


static cJSON *
msg(cJSON *arr, const char *role, const char *content)
{
    cJSON  *m = cJSON_CreateObject();

    cJSON_AddStringToObject(m, "role", role);
    cJSON_AddStringToObject(m, "content", content);
    cJSON_AddItemToArray(arr, m);
    return m;
}


static void
run(const dpd_tok_t *tok, const char *name, const cJSON *msgs, double secs)
{
    char    err[256];
    int     est;
    long    n = 0, iters = 0;
    double  t0, t;

    n = dpd_chat_count_json(tok, DPD_CHAT_AUTO, msgs, &est, err,
                            sizeof(err));
    if (n < 0) {
        fprintf(stderr, "chat_bench: %s: %s\n", name, err);
        exit(1);
    }
    if (getenv("BENCH_ITERS")) {
        /* a fixed number of calls: instruction counts under callgrind */
        long k, want = atol(getenv("BENCH_ITERS"));
        for (k = 0; k < want; k++) {
            (void) dpd_chat_count_json(tok, DPD_CHAT_AUTO, msgs, &est, err,
                                       sizeof(err));
        }
        printf("%s %ld calls %ld\n", name, want, n);
        return;
    }
    t0 = cpu_now();
    do {
        for (int k = 0; k < 50; k++) {
            if (dpd_chat_count_json(tok, DPD_CHAT_AUTO, msgs, &est, err,
                                    sizeof(err)) != n)
            {
                abort();
            }
        }
        iters += 50;
        t = cpu_now() - t0;
    } while (t < secs);
    printf("%s %.3f %ld\n", name, t * 1e6 / (double) iters, n);
}


int
main(int argc, char **argv)
{
    dpd_tok_t  *tok;
    char        err[512], *doc;
    cJSON      *chat, *docchat;
    size_t      i, o = 0;
    double      secs;
    static const char *turns[] = {
        "What is the capital of France?", "Paris is the capital of France.",
        "And how many people live there, roughly, in the city proper?",
        "About 2.1 million people live in the city proper of Paris.",
        "Can you compare that with Berlin and Madrid, please?",
        "Berlin has about 3.7 million, Madrid about 3.3 million inhabitants.",
        "Thanks! Now summarise all of this in one sentence.",
        "Paris (2.1M) is smaller than Berlin (3.7M) and Madrid (3.3M).",
        "Great, and which of them is the oldest city?",
    };

    if (argc < 4) {
        fprintf(stderr, "usage: chat_bench tokenizer.json config.json SECS\n");
        return 2;
    }
    secs = atof(argv[3]);
    tok = dpd_tok_load(argv[1], argv[2], err, sizeof(err));
    if (tok == NULL) {
        fprintf(stderr, "chat_bench: %s\n", err);
        return 1;
    }

    chat = cJSON_CreateArray();
    msg(chat, "system", "You are a helpful assistant. Answer briefly.");
    for (i = 0; i < sizeof(turns) / sizeof(turns[0]); i++) {
        msg(chat, i % 2 ? "assistant" : "user", turns[i]);
    }

    /* ~4096 tokens of prose with numbers and some non-ASCII */
    doc = malloc(1 << 20);
    for (i = 0; o < 17000; i++) {
        o += (size_t) snprintf(doc + o, (1 << 20) - o, "Paragraph %zu: the "
                               "committee reviewed the quarterly figures, "
                               "naïve estimates, and café receipts (total "
                               "%zu.%02zu EUR) before the meeting. ", i,
                               i * 37, i % 100);
    }
    docchat = cJSON_CreateArray();
    msg(docchat, "system", "You summarise documents.");
    msg(docchat, "user", doc);
    msg(docchat, "user", "Summarise the document above in three bullets.");

    /* argv[4]: only this request (for callgrind) */
    if (argc < 5 || strcmp(argv[4], "chat10") == 0) {
        run(tok, "chat10", chat, secs);
    }
    if (argc < 5 || strcmp(argv[4], "doc4k") == 0) {
        run(tok, "doc4k", docchat, secs);
    }

    cJSON_Delete(chat);
    cJSON_Delete(docchat);
    free(doc);
    dpd_tok_free(tok);
    return 0;
}
