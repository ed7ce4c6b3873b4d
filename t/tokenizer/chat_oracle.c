/*
 * Renders each chat request of a JSONL file (stdin) with the library as
 * the gateway does and prints one JSON object per line:
 *   {"text": PROMPT, "count": N, "ids": [...]} or {"error": MESSAGE}
 * (plus "note" when non-text parts were left out); the ids and the count
 * are the prompt's without added special tokens, as the gateway counts.
 *   chat_oracle tokenizer.json tokenizer_config.json [template.jinja]
 */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <cjson/cJSON.h>

#include "dpd_tokenizer.h"


int
main(int argc, char **argv)
{
    dpd_tok_t    *tok;
    char          err[1024], *line = NULL, *text, *s;
    size_t        cap = 0, len;
    ssize_t       n;
    int           tmpl = DPD_CHAT_AUTO, rc;
    cJSON        *req, *o, *a;
    uint32_t     *ids;
    long          nids, k;

    if (argc < 3) {
        fprintf(stderr, "usage: chat_oracle tokenizer.json config.json "
                "[template.jinja]\n");
        return 2;
    }
    tok = dpd_tok_load(argv[1], argv[2], err, sizeof(err));
    if (tok == NULL) {
        fprintf(stderr, "chat_oracle: %s\n", err);
        return 2;
    }
    if (argc > 3) {
        tmpl = dpd_tok_chat_template_file(tok, argv[3], err, sizeof(err));
        if (tmpl < 0) {
            fprintf(stderr, "chat_oracle: %s\n", err);
            return 2;
        }
    }
    while ((n = getline(&line, &cap, stdin)) > 0) {
        if (line[n - 1] == '\n') {
            line[--n] = '\0';
        }
        if (n == 0) {
            continue;
        }
        o = cJSON_CreateObject();
        req = cJSON_ParseWithLength(line, (size_t) n);
        if (req == NULL) {
            cJSON_AddStringToObject(o, "error", "invalid JSON");
        } else {
            rc = dpd_chat_render_json(tok, (dpd_chat_template_t) tmpl, req,
                                      &text, &len, err, sizeof(err));
            if (rc == 0 || rc == 2) {
                cJSON_AddStringToObject(o, "text", text);
                cJSON_AddNumberToObject(o, "count",
                                        (double) dpd_tok_count(tok, text, len,
                                                               0));
                nids = dpd_tok_encode(tok, text, len, 0, NULL, 0);
                ids = malloc(sizeof(uint32_t) * (size_t) (nids > 0 ? nids : 1));
                a = cJSON_AddArrayToObject(o, "ids");
                if (ids == NULL || nids < 0
                    || dpd_tok_encode(tok, text, len, 0, ids, (size_t) nids)
                       != nids)
                {
                    fprintf(stderr, "chat_oracle: encode failed\n");
                    return 2;
                }
                for (k = 0; k < nids; k++) {
                    cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[k]));
                }
                free(ids);
                if (rc == 2) {
                    cJSON_AddStringToObject(o, "note", err);
                }
                free(text);
            } else if (rc == 1) {
                cJSON_AddStringToObject(o, "error", "no chat template");
            } else {
                cJSON_AddStringToObject(o, "error", err);
            }
            cJSON_Delete(req);
        }
        s = cJSON_PrintUnformatted(o);
        puts(s);
        free(s);
        cJSON_Delete(o);
    }
    free(line);
    dpd_tok_free(tok);
    return 0;
}
