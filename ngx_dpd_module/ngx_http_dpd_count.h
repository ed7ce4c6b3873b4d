/*
 * Prompt tokens of a parsed OpenAI request, as vLLM reports them in
 * usage.prompt_tokens, with the project's tokenizer and no nginx types
 * (the libFuzzer target links this file without nginx):
 *
 *   /v1/completions       "prompt": a string (tokenized with the specials
 *                         the tokenizer's post-processor adds, e.g. BOS for
 *                         Llama 3), an array of strings (each one so), an
 *                         array of token ids or an array of token-id arrays
 *                         (ids counted and range-checked, not re-tokenized);
 *   /v1/chat/completions  "messages": the rendered chat template, which
 *                         carries its own specials, nothing added.
 *
 * The request comes from ngx_http_dpd_proto_parse_request(): no key is
 * repeated and no string holds a NUL, so what is counted here is what the
 * engine tokenizes.
 */

#ifndef _NGX_HTTP_DPD_COUNT_H_INCLUDED_
#define _NGX_HTTP_DPD_COUNT_H_INCLUDED_


#include <stddef.h>
#include <stdint.h>
#include <cjson/cJSON.h>

#include "dpd_tokenizer.h"
#include "ngx_http_dpd_protocol.h"


typedef struct {
    const dpd_tok_t       *tok;
    dpd_chat_template_t    tmpl;            /* resolved, not AUTO */
    int                    chat;            /* messages, else prompt */
    int                    bound;           /* dpd_count bound */
    long                   threshold;       /* dpd_threshold */
    size_t                 max_prompt_ids;  /* dpd_max_prompt_ids */
    size_t                 max_messages;    /* dpd_max_messages */

    /* dpd_count bound: ids <= (ascii + other * bound_other)
     * * bound_prefix + specials; bound_prefix 0: no bound */
    unsigned long          bound_other;
    unsigned long          bound_prefix;
    unsigned long          bound_specials;

    /* dpd_prefix_cache: tokens per block; 0: no keys */
    size_t                 prefix_block;
} ngx_http_dpd_count_conf_t;


typedef struct {
    long                   tokens;          /* -1: not counted */
    long                   bound;           /* -1: none */
    unsigned               skipped:1;       /* bound < threshold: no BPE */
    unsigned               estimated:1;     /* chat count is an estimate */

    /* dpd_prefix_cache: the prompt's block keys (dpd_prefix.h), seeded
     * by "model" and "cache_salt"; malloc()ed, the caller frees them.
     * NULL: none (a batch of prompts, an estimated chat, no full block) */
    uint64_t              *keys;
    size_t                 nkeys;

    int                    bad;             /* NGX_HTTP_DPD_BAD_* */
    char                   why[NGX_HTTP_DPD_WHY_LEN];
    char                   note[320];       /* worth an info log line */
} ngx_http_dpd_count_t;


/*
 * Counts the prompt of req (an object).  Returns 0 (out->bad set when the
 * request is refused) or -1 (tokenizer failure, out of memory).  With
 * cf->prefix_block the prompt is encoded (not only counted) and its block
 * keys are set; failing to make them (memory) leaves keys NULL.
 */
int ngx_http_dpd_count(const cJSON *req, const ngx_http_dpd_count_conf_t *cf,
    ngx_http_dpd_count_t *out);


#endif /* _NGX_HTTP_DPD_COUNT_H_INCLUDED_ */
