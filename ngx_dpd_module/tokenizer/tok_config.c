/*
 * tokenizer_config.json: the bos/eos strings; the chat templates and the
 * special tokens they see are loaded by tok_chat.c (tok_chat_load).
 */

#include <stdlib.h>
#include <string.h>
#include <cjson/cJSON.h>

#include "tok_internal.h"


/* "bos_token": "<s>" or {"content": "<s>", ...} or null */
static int
tok_config_token(const cJSON *root, const char *key, char **out, char *err,
    size_t errlen)
{
    const cJSON  *v = cJSON_GetObjectItemCaseSensitive(root, key);

    if (v == NULL || cJSON_IsNull(v)) {
        return 0;
    }
    if (cJSON_IsObject(v)) {
        v = cJSON_GetObjectItemCaseSensitive(v, "content");
    }
    if (!cJSON_IsString(v)) {
        tok_err(err, errlen, "%s: expected a string or {\"content\": ...}",
                key);
        return -1;
    }
    *out = strdup(v->valuestring);
    if (*out == NULL) {
        tok_err(err, errlen, "out of memory");
        return -1;
    }
    return 0;
}


int
tok_load_config(dpd_tok_t *tok, const char *path, char *err, size_t errlen)
{
    cJSON   *root;
    char    *buf, ferr[256];
    size_t   len;

    buf = tok_read_file(path, &len, err, errlen);
    if (buf == NULL) {
        return -1;
    }
    root = tok_parse_json(path, buf, len, err, errlen);
    free(buf);
    if (root == NULL) {
        return -1;
    }
    ferr[0] = '\0';
    if (!cJSON_IsObject(root)) {
        tok_err(ferr, sizeof(ferr), "not a JSON object");
    } else if (tok_config_token(root, "bos_token", &tok->bos_token, ferr,
                                sizeof(ferr)) == 0
               && tok_config_token(root, "eos_token", &tok->eos_token, ferr,
                                   sizeof(ferr)) == 0
               && tok_config_specials(tok, root, ferr, sizeof(ferr)) == 0
               && tok_chat_load(tok, root, path, ferr, sizeof(ferr)) == 0)
    {
        /* the chat templates are tok_chat.c's */
    }
    cJSON_Delete(root);
    if (ferr[0]) {
        tok_err(err, errlen, "%s: %s", path, ferr);
        return -1;
    }
    return 0;
}


/* ---- add_bos_token / add_eos_token */

/*
 * The id of a token string as Hugging Face's token_to_id: the added
 * tokens first, then the model's vocabulary.
 */
static uint32_t
tok_token_id(const dpd_tok_t *tok, const char *s)
{
    size_t    len = strlen(s), rl;
    uint32_t  i, id;
    char     *raw;

    for (i = 0; i < tok->n_added; i++) {
        if (tok->added[i].len == len
            && memcmp(tok->added[i].content, s, len) == 0)
        {
            return tok->added[i].id;
        }
    }
    if (!tok->byte_level) {
        return tok_strmap_get(&tok->vocab, s, len);
    }
    raw = malloc(len + 1);
    if (raw == NULL) {
        return TOK_NO_ID;
    }
    id = tok_byte_level_decode(s, len, raw, &rl) == 0
         ? tok_strmap_get(&tok->vocab, raw, rl) : TOK_NO_ID;
    free(raw);
    return id != TOK_NO_ID ? id : tok_strmap_get(&tok->other, s, len);
}


static int
tok_config_flag(const cJSON *root, const char *key, int dflt, int *out,
    char *err, size_t errlen)
{
    const cJSON  *v = cJSON_GetObjectItemCaseSensitive(root, key);

    if (v == NULL || cJSON_IsNull(v)) {
        *out = dflt;
        return 0;
    }
    if (!cJSON_IsBool(v)) {
        tok_err(err, errlen, "%s: expected true or false", key);
        return -1;
    }
    *out = cJSON_IsTrue(v);
    return 0;
}


static int
tok_config_special_id(const dpd_tok_t *tok, const char *key,
    const char *token, uint32_t *id, char *err, size_t errlen)
{
    if (token == NULL) {
        tok_err(err, errlen, "add_%s = true but %s is null", key, key);
        return -1;
    }
    *id = tok_token_id(tok, token);
    if (*id == TOK_NO_ID) {
        tok_err(err, errlen, "%s: \"%.64s\" is not a token of the "
                "tokenizer", key, token);
        return -1;
    }
    return 0;
}


/*
 * transformers' LlamaTokenizerFast (and CodeLlama's and Gemma's, which
 * copy it) replaces the post-processor of tokenizer.json when it is
 * built: TemplateProcessing with bos_token before the text when
 * add_bos_token (default true) and eos_token after it when add_eos_token
 * (default false).  So the file's own post-processor, BOS or not, no
 * longer counts.  The fast class is used for the slow names too (vLLM
 * loads with use_fast).  Other classes follow tokenizer.json.
 */
int
tok_config_specials(dpd_tok_t *tok, const cJSON *root, char *err,
    size_t errlen)
{
    static const char  *classes[] = {
        "LlamaTokenizer", "LlamaTokenizerFast",
        "CodeLlamaTokenizer", "CodeLlamaTokenizerFast",
        "GemmaTokenizer", "GemmaTokenizerFast",
    };
    const cJSON  *cls = cJSON_GetObjectItemCaseSensitive(root,
                                                         "tokenizer_class");
    size_t        i;
    int           bos, eos;
    uint32_t      bos_id = 0, eos_id = 0, *pre = NULL, *suf = NULL;

    if (!cJSON_IsString(cls)) {
        return 0;
    }
    for (i = 0; i < sizeof(classes) / sizeof(classes[0]); i++) {
        if (strcmp(cls->valuestring, classes[i]) == 0) {
            break;
        }
    }
    if (i == sizeof(classes) / sizeof(classes[0])) {
        return 0;
    }
    if (tok_config_flag(root, "add_bos_token", 1, &bos, err, errlen) != 0
        || tok_config_flag(root, "add_eos_token", 0, &eos, err, errlen) != 0
        || (bos && tok_config_special_id(tok, "bos_token", tok->bos_token,
                                         &bos_id, err, errlen) != 0)
        || (eos && tok_config_special_id(tok, "eos_token", tok->eos_token,
                                         &eos_id, err, errlen) != 0))
    {
        return -1;
    }
    if ((bos && (pre = malloc(sizeof(uint32_t))) == NULL)
        || (eos && (suf = malloc(sizeof(uint32_t))) == NULL))
    {
        free(pre);
        tok_err(err, errlen, "out of memory");
        return -1;
    }
    if (pre) {
        pre[0] = bos_id;
    }
    if (suf) {
        suf[0] = eos_id;
    }
    free(tok->post_prefix);
    free(tok->post_suffix);
    tok->post_prefix = pre;
    tok->n_prefix = bos ? 1 : 0;
    tok->post_suffix = suf;
    tok->n_suffix = eos ? 1 : 0;
    return 0;
}
