/*
 * C API checks for libdpdtok (built and run by 02-api.t):
 *   api_test LLAMA3_DIR QWEN3_DIR CORPUS_JSONL
 * Prints TAP.  Covers vocab sizes, template detection, the cap/total
 * contract of dpd_tok_encode, count == encode, empty and invalid text,
 * chat entry points, and concurrent encodes from several threads on one
 * loaded tokenizer (results must equal the single-threaded ones).
 */

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dpd_tokenizer.h"

static int  ntest, nfail;

#define OK(cond, ...) do {                                                  \
        ntest++;                                                            \
        if (!(cond)) { nfail++; printf("not "); }                           \
        printf("ok %d - ", ntest); printf(__VA_ARGS__); printf("\n");       \
    } while (0)

typedef struct {
    const dpd_tok_t  *tok;
    char            **lines;
    size_t           *lens;
    long             *want;
    size_t            n;
    int               bad;
} job_t;


static void *
worker(void *arg)
{
    job_t     *j = arg;
    uint32_t  *ids = malloc(1 << 20);
    size_t     i, r;

    for (r = 0; r < 2; r++) {
        for (i = 0; i < j->n; i++) {
            long n = dpd_tok_encode(j->tok, j->lines[i], j->lens[i], 0, ids,
                                    (1 << 20) / 4);
            long c = dpd_tok_count(j->tok, j->lines[i], j->lens[i], 0);
            if (n != j->want[i] || c != j->want[i]) {
                j->bad++;
            }
        }
    }
    free(ids);
    return NULL;
}


static dpd_tok_t *
load(const char *dir, int with_config)
{
    char  tj[4096], cj[4096], err[512];
    dpd_tok_t *t;

    snprintf(tj, sizeof(tj), "%s/tokenizer.json", dir);
    snprintf(cj, sizeof(cj), "%s/tokenizer_config.json", dir);
    t = dpd_tok_load(tj, with_config ? cj : NULL, err, sizeof(err));
    if (t == NULL) {
        printf("# load %s: %s\n", dir, err);
    }
    return t;
}


int
main(int argc, char **argv)
{
    dpd_tok_t   *l, *q, *nc;
    uint32_t     ids[64];
    char         err[512], *out, *buf, *p;
    size_t       outlen, i, n = 0, cap = 0;
    long         r, r2;
    int          est, k;
    FILE        *f;
    job_t        job;
    pthread_t    th[4];

    if (argc < 4) {
        fprintf(stderr, "usage: api_test LLAMA3_DIR QWEN3_DIR CORPUS\n");
        return 2;
    }
    l = load(argv[1], 1);
    q = load(argv[2], 1);
    nc = load(argv[1], 0);
    OK(l && q && nc, "tokenizers load");
    if (!l || !q || !nc) {
        printf("1..%d\n", ntest);
        return 1;
    }

    OK(dpd_tok_vocab_size(l) == 128256, "llama3 vocab size %u",
       dpd_tok_vocab_size(l));
    OK(dpd_tok_vocab_size(q) == 151669, "qwen3 vocab size %u",
       dpd_tok_vocab_size(q));
    {
        /* count bound: llama3 has no normalizer, qwen3 NFC (3x non-ASCII) */
        dpd_tok_bound_t  bl, bq;
        const char      *t = "Grüße, 世界! don't stop 12345";
        long             nl, nq;

        OK(dpd_tok_bound_params(l, &bl) == 0 && bl.other_factor == 1
           && bl.prefix_factor == 1, "llama3 bound params %u %u %u",
           bl.other_factor, bl.prefix_factor, bl.specials);
        OK(dpd_tok_bound_params(q, &bq) == 0 && bq.other_factor == 3
           && bq.prefix_factor == 1, "qwen3 bound params %u %u %u",
           bq.other_factor, bq.prefix_factor, bq.specials);
        nl = dpd_tok_count(l, t, strlen(t), 1);
        nq = dpd_tok_count(q, t, strlen(t), 1);
        OK(nl > 0 && (size_t) nl <= strlen(t) + bl.specials,
           "llama3 count %ld within the byte bound", nl);
        OK(nq > 0 && (size_t) nq <= strlen(t) * 3 + bq.specials,
           "qwen3 count %ld within the byte bound", nq);
        OK(dpd_tok_bound_params(NULL, &bl) == -1, "bound params of NULL");
    }
    OK(dpd_tok_chat_template(l) == DPD_CHAT_MODEL, "llama3: the model's template");
    OK(dpd_tok_chat_template(q) == DPD_CHAT_MODEL, "qwen3: the model's template");
    OK(dpd_tok_chat_template(nc) == DPD_CHAT_NONE, "no config: no template");
    OK(dpd_chat_template_from_name("auto") == DPD_CHAT_AUTO
       && dpd_chat_template_from_name("none") == DPD_CHAT_NONE
       && dpd_chat_template_from_name("model") == DPD_CHAT_MODEL,
       "template names");
    OK(dpd_chat_template_from_name("llama3") == DPD_CHAT_AUTO
       && dpd_chat_template_from_name("chatml") == DPD_CHAT_AUTO,
       "old family names mean the model's template");
    OK(dpd_chat_template_from_name("jinja") == -1, "unknown template name");
    k = dpd_tok_chat_template_add(nc, "{{ bos_token }}[{% for m in messages %}"
                                  "{{ m.role }}{% endfor %}]", 64, err,
                                  sizeof(err));
    OK(k == DPD_CHAT_FILE, "template added to a tokenizer without config");
    r = dpd_chat_render(nc, (dpd_chat_template_t) k,
                        "[{\"role\":\"user\",\"content\":\"hi\"}]", 34, &out,
                        &outlen, err, sizeof(err));
    OK(r == 0 && out && strcmp(out, "[user]") == 0, "added template renders");
    free(out);
    OK(dpd_tok_chat_template_add(nc, "{% if %}", 8, err, sizeof(err)) == -1
       && strstr(err, "line 1") != NULL, "bad template refused: %s", err);

    r = dpd_tok_encode(l, "Hello world, hello tokens", 25, 0, ids, 2);
    r2 = dpd_tok_encode(l, "Hello world, hello tokens", 25, 0, ids + 10, 64);
    OK(r > 2 && r == r2 && ids[0] == ids[10] && ids[1] == ids[11],
       "encode returns the total when cap is short (%ld)", r);
    OK(dpd_tok_encode(l, "Hello", 5, 0, NULL, 0) == 1, "NULL ids counts");
    OK(dpd_tok_count(l, "Hello world, hello tokens", 25, 0) == r,
       "count equals encode");
    OK(dpd_tok_encode(l, "", 0, 0, ids, 64) == 0, "empty text: 0 ids");
    OK(dpd_tok_encode(l, NULL, 0, 1, ids, 64) == 0,
       "NULL empty text with add_special on a ByteLevel post-processor: 0");
    r = dpd_tok_encode(l, "\xff\xfe\xc3", 3, 0, ids, 64);
    r2 = dpd_tok_encode(l, "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd", 9, 0,
                        ids + 32, 32);
    OK(r > 0 && r == r2 && memcmp(ids, ids + 32, r * 4) == 0,
       "invalid UTF-8 encodes as U+FFFD per bad byte");

    r = dpd_chat_count(l, DPD_CHAT_AUTO,
                       "[{\"role\":\"user\",\"content\":\"hi\"}]", 34, &est,
                       err, sizeof(err));
    /* <|begin_of_text|> header user header \n\n hi <|eot_id|> + assistant */
    OK(r == 11 && est == 0, "chat count llama3 (%ld)", r);
    k = dpd_chat_render(l, DPD_CHAT_NONE,
                        "[{\"role\":\"user\",\"content\":\"hi\"}]", 34, &out,
                        &outlen, err, sizeof(err));
    OK(k == 1 && out == NULL, "render with no template returns 1");
    r = dpd_chat_count(l, DPD_CHAT_NONE,
                       "[{\"role\":\"user\",\"content\":\"hi\"}]", 34, &est,
                       err, sizeof(err));
    OK(r == 1 + DPD_CHAT_EST_PER_MESSAGE + DPD_CHAT_EST_PRIMING && est == 1,
       "estimate with no template (%ld)", r);
    r = dpd_chat_count(q, DPD_CHAT_AUTO,
                       "[{\"role\":\"tool\",\"content\":{}}]", 31, &est,
                       err, sizeof(err));
    OK(r == -1 && strstr(err, "messages[0].content:") != NULL,
       "bad content shape: %s", err);
    k = dpd_chat_render(q, DPD_CHAT_AUTO, "[", 1, &out, &outlen, err,
                        sizeof(err));
    OK(k == -1 && out == NULL, "invalid JSON refused: %s", err);
    k = dpd_chat_render(q, DPD_CHAT_AUTO,
                        "[{\"role\":\"user\",\"content\":\"x\"}]", 33, &out,
                        &outlen, err, sizeof(err));
    OK(k == 0 && out && strcmp(out, "<|im_start|>user\nx<|im_end|>\n"
                               "<|im_start|>assistant\n") == 0
       && outlen == strlen(out), "chatml render");
    free(out);
    OK(dpd_tok_load("/nonexistent", NULL, err, sizeof(err)) == NULL
       && strstr(err, "/nonexistent") != NULL, "load failure: %s", err);
    dpd_tok_free(NULL);

    /* concurrency: 4 threads on one tokenizer, results as single-threaded */
    f = fopen(argv[3], "rb");
    if (f == NULL) {
        printf("# %s: cannot open\n", argv[3]);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    cap = (size_t) ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = malloc(cap + 1);
    cap = fread(buf, 1, cap, f);
    buf[cap] = '\0';
    fclose(f);
    memset(&job, 0, sizeof(job));
    job.tok = q;
    for (p = buf; *p; p++) {
        n += *p == '\n';
    }
    job.lines = calloc(n + 1, sizeof(char *));
    job.lens = calloc(n + 1, sizeof(size_t));
    job.want = calloc(n + 1, sizeof(long));
    /* the raw JSON lines are text too: good enough for a race check */
    for (p = buf, i = 0; i < n && *p; i++) {
        char *e = strchr(p, '\n');
        job.lines[i] = p;
        job.lens[i] = (size_t) (e - p);
        job.want[i] = dpd_tok_count(q, p, job.lens[i], 0);
        p = e + 1;
    }
    job.n = i;
    for (k = 0; k < 4; k++) {
        pthread_create(&th[k], NULL, worker, &job);
    }
    for (k = 0; k < 4; k++) {
        pthread_join(th[k], NULL);
    }
    OK(job.bad == 0, "4 threads x %zu texts: same ids as single-threaded "
       "(%d differ)", job.n, job.bad);

    free(job.lines);
    free(job.lens);
    free(job.want);
    free(buf);
    dpd_tok_free(l);
    dpd_tok_free(q);
    dpd_tok_free(nc);
    printf("1..%d\n", ntest);
    return nfail != 0;
}
