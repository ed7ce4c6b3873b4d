/*
 * dpd_tokenizer: Hugging Face byte-level BPE and chat templates in C.
 *
 * No nginx dependency: the nginx module, the dpd-tokenize CLI, the vLLM
 * emulator (through ctypes on libdpdtok.so) and the tests link this code.
 *
 * A loaded tokenizer is immutable and reentrant: any number of threads or
 * forked processes may encode with it at once.  Everything it owns is freed
 * by dpd_tok_free().
 */

#ifndef DPD_TOKENIZER_H
#define DPD_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dpd_tok_s  dpd_tok_t;

/*
 * Which chat template renders a chat (dpd_chat_template directive,
 * --template): the model's own Jinja template from tokenizer_config.json
 * (or chat_template.jinja beside it), a template file registered with
 * dpd_tok_chat_template_file(), or none (the documented estimate).
 * LLAMA3, LLAMA31 and CHATML are the names of the families once written
 * out in C: they now mean the model's own template, like AUTO.
 */
typedef enum {
    DPD_CHAT_AUTO = 0,      /* the model's template, or none */
    DPD_CHAT_LLAMA3,        /* (old name) = AUTO */
    DPD_CHAT_LLAMA31,       /* (old name) = AUTO */
    DPD_CHAT_CHATML,        /* (old name) = AUTO */
    DPD_CHAT_NONE,          /* no template: documented estimate */
    DPD_CHAT_MODEL,         /* the model's template (AUTO resolved) */
    DPD_CHAT_FILE = 16      /* + k: the k-th registered template file */
} dpd_chat_template_t;

/*
 * Load tokenizer.json (and optionally tokenizer_config.json, may be NULL).
 * On failure returns NULL and writes a message naming the field to err.
 */
dpd_tok_t *dpd_tok_load(const char *tokenizer_path, const char *config_path,
    char *err, size_t errlen);

void dpd_tok_free(dpd_tok_t *tok);

/*
 * Encode len bytes of text.  Invalid UTF-8 is replaced by U+FFFD first.
 * add_special: as Hugging Face add_special_tokens=True (post-processor).
 * Writes at most cap ids; returns the total number of ids (may exceed cap:
 * call again with a larger buffer), or -1 on error.
 */
long dpd_tok_encode(const dpd_tok_t *tok, const char *text, size_t len,
    int add_special, uint32_t *ids, size_t cap);

/* Same count as dpd_tok_encode() without materialising ids; -1 on error. */
long dpd_tok_count(const dpd_tok_t *tok, const char *text, size_t len,
    int add_special);

/*
 * A cheap upper bound of dpd_tok_count() from the text's bytes alone, for
 * callers that only need to know whether a count reaches some limit:
 *
 *   count <= (ascii_bytes + other_bytes * other_factor) * prefix_factor
 *            + (add_special ? specials : 0)
 *
 * It holds because every id of a byte-level BPE covers at least one byte
 * of the normalized, pre-tokenized text: other_factor is the normalizers'
 * worst growth of non-ASCII text (NFC/NFD 3x, NFKC/NFKD 11x per stage;
 * ASCII is stable under every normal form), prefix_factor 2 per ByteLevel
 * stage that adds a prefix space, specials the ids the post-processor
 * adds.  Returns 0, or -1 when this tokenizer's pipeline cannot be
 * bounded that way (count exactly).
 */
typedef struct {
    uint32_t    other_factor;
    uint32_t    prefix_factor;
    uint32_t    specials;
} dpd_tok_bound_t;

int dpd_tok_bound_params(const dpd_tok_t *tok, dpd_tok_bound_t *out);

/* Number of ids the model knows (vocab + added tokens): ids are < this. */
uint32_t dpd_tok_vocab_size(const dpd_tok_t *tok);

/* DPD_CHAT_MODEL if the model ships a chat template, else DPD_CHAT_NONE. */
dpd_chat_template_t dpd_tok_chat_template(const dpd_tok_t *tok);

/* "auto", "model", "none" (and the old "llama3", "llama3.1", "chatml",
 * = auto) -> enum; -1 if unknown (a file name, see below). */
int dpd_chat_template_from_name(const char *name);
const char *dpd_chat_template_name(dpd_chat_template_t t);

/*
 * Compile a Jinja chat template (a file, or src[0..len)) and register it
 * on tok; returns its dpd_chat_template_t (DPD_CHAT_FILE + k), or -1 with
 * the parse error in err ("chat template: line 3: ...").  Call it at
 * load / configuration time only, before tok is shared: registering is
 * not thread safe, rendering is.
 */
int dpd_tok_chat_template_file(dpd_tok_t *tok, const char *path,
    char *err, size_t errlen);
int dpd_tok_chat_template_add(dpd_tok_t *tok, const char *src, size_t len,
    char *err, size_t errlen);

/*
 * Render an OpenAI chat request to the prompt text vLLM renders: the
 * model's Jinja template with the variables vLLM passes (messages
 * prepared as vllm/entrypoints/chat_utils.py does, tools, documents,
 * add_generation_prompt, continue_final_message, the special tokens,
 * chat_template_kwargs; see tok_chat.c).
 *
 * messages_json: the JSON text of the whole request object (len bytes),
 * or of a bare messages array (the defaults for everything else).
 * Returns 0 and *out, a malloc'ed NUL-terminated string (free() it),
 * *outlen its length; 2 the same but non-text content parts (images,
 * audio) were not counted, err says where; -1 on a request vLLM refuses
 * with 400 (message in err: "messages[2].content: ...", or the
 * template's own raise_exception() text, or "chat template: line 7:
 * ..."); 1 and *out NULL with DPD_CHAT_NONE or no template: use
 * dpd_chat_count() which gives the documented estimate.
 */
int dpd_chat_render(const dpd_tok_t *tok, dpd_chat_template_t tmpl,
    const char *messages_json, size_t len, char **out, size_t *outlen,
    char *err, size_t errlen);

/*
 * Token count of a chat request as vLLM computes it: the rendered prompt
 * with no further specials.  With DPD_CHAT_NONE: the estimate (content
 * tokens + DPD_CHAT_EST_PER_MESSAGE per message + DPD_CHAT_EST_PRIMING)
 * and *estimated is set to 1.  -1 on bad input (message in err).
 */
#define DPD_CHAT_EST_PER_MESSAGE  4
#define DPD_CHAT_EST_PRIMING      3

long dpd_chat_count(const dpd_tok_t *tok, dpd_chat_template_t tmpl,
    const char *messages_json, size_t len, int *estimated,
    char *err, size_t errlen);

/*
 * The same two entry points on an already parsed cJSON request object or
 * messages array (the nginx module parses the body once).  messages is a
 * "const cJSON *".  dpd_chat_count_json() sets *estimated for the
 * estimate and when non-text parts were left out (err then says where).
 */
struct cJSON;

int dpd_chat_render_json(const dpd_tok_t *tok, dpd_chat_template_t tmpl,
    const struct cJSON *messages, char **out, size_t *outlen,
    char *err, size_t errlen);

long dpd_chat_count_json(const dpd_tok_t *tok, dpd_chat_template_t tmpl,
    const struct cJSON *messages, int *estimated, char *err, size_t errlen);

/*
 * gpt-oss: a tokenizer with harmony's format tokens (<|start|>,
 * <|message|>, <|end|>, <|channel|>, <|call|>, <|constrain|>) as special
 * added tokens and no Jinja template renders chats as vLLM does, with
 * openai_harmony (tok_harmony.c).  dpd_chat_render_json/count_json do so
 * for the automatic template; this gives the text, the ids (harmony's:
 * text pieces without added-token matching) and their count.  0: exact;
 * 1: a feature left to the estimate (err says which); -1: refused.
 */
int dpd_tok_chat_harmony(const dpd_tok_t *tok);
int dpd_chat_harmony_json(const dpd_tok_t *tok, const struct cJSON *request,
    char **text, size_t *textlen, uint32_t **ids, size_t *nids, long *count,
    char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif /* DPD_TOKENIZER_H */
