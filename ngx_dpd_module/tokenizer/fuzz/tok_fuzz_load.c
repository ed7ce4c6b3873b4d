/*
 * libFuzzer target: the tokenizer.json loader.  Any input either loads or
 * is refused with a message; a tokenizer that loads must encode its own
 * input and a fixed text without fault, and count what it encodes.  The
 * fast load path and cJSON for the whole file must agree on every input:
 * the same refusal or equal tables (tok_load_diff.h).
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../tok_internal.h"
#include "tok_load_diff.h"


int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const char  text[] = "Hello <s> world 123 \xe4\xb8\xad\xff 's";
    char               err[512];
    uint32_t           ids[256];
    dpd_tok_t         *tok;
    long               n, c;
    int                fast, loaded;

    if (tok_load_diff((const char *) data, size, "fuzz", &fast, &loaded)
        != 0)
    {
        abort();
    }
    err[0] = '\0';
    tok = tok_load_mem((const char *) data, size, "fuzz", err, sizeof(err));
    if (tok == NULL) {
        if (err[0] == '\0') {
            abort();    /* every refusal must say why */
        }
        return 0;
    }
    n = dpd_tok_encode(tok, text, sizeof(text) - 1, 1, ids, 256);
    c = dpd_tok_count(tok, text, sizeof(text) - 1, 1);
    if (n != c) {
        abort();
    }
    for (long i = 0; i < n && i < 256; i++) {
        if (ids[i] >= dpd_tok_vocab_size(tok)) {
            abort();
        }
    }
    (void) dpd_tok_count(tok, (const char *) data, size < 4096 ? size : 4096,
                         0);
    dpd_tok_free(tok);
    return 0;
}
