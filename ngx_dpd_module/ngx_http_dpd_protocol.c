/*
 * The client's request and the wire transforms of the disaggregated path
 * (docs/dpd.md).  No nginx headers here: the nginx side hands in the
 * body's bytes and an allocator; t/201-protocol.t and the libFuzzer target
 * (ngx_dpd_module/fuzz/) link this file alone with cJSON.
 */

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <math.h>
#include <float.h>

#include "ngx_http_dpd_protocol.h"
#include "ngx_http_dpd_json.h"


#define DPD_KTP  "kv_transfer_params"

/* the state of the scanner inside the top-level object */
#define DPD_TOP_KEY      0     /* a key (or the end) comes next */
#define DPD_TOP_IN_KEY   1     /* inside the key's string */
#define DPD_TOP_COLON    2     /* after the key */
#define DPD_TOP_VALUE    3     /* in the value */

/* objects up to this many members are checked for repeats pairwise */
#define DPD_PAIRWISE_MAX  8

/* top-level members recorded by the checking pass (more: a second pass) */
#define DPD_SCAN_MEMBERS  64

/* 0x0101010101010101: SWAR byte tests in dpd_scan() */
#define DPD_ONES  0x0101010101010101ULL


static int dpd_bad(ngx_http_dpd_req_t *req, int bad, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static void *dpd_alloc(const ngx_http_dpd_req_t *req, size_t size);
static int dpd_is_hex(unsigned char c);
static int dpd_scan(ngx_http_dpd_req_t *req,
    const ngx_http_dpd_limits_t *limits, ngx_http_dpd_member_t *out,
    size_t nout, size_t *nmembers);
static unsigned dpd_key_kind(const char *name);
static int dpd_key_cmp(const void *a, const void *b);
static int dpd_check_keys(ngx_http_dpd_req_t *req, const cJSON *obj,
    int top);
static void dpd_json_delete_all(cJSON *obj, const char *key);
static int dpd_json_set(cJSON *obj, const char *key, cJSON *item);
static int dpd_json_is_uint(const cJSON *item, double max);
static cJSON *dpd_nixl_request_params(void);
static cJSON *dpd_lmcache_request_params(
    const ngx_http_dpd_lmcache_spec_t *spec);
static size_t dpd_print(const cJSON *item, char *out);
static size_t dpd_print_string(const char *s, char *out);
static size_t dpd_print_params(const cJSON *ktp, const char *host,
    char *out);
static char *dpd_splice_params(const ngx_http_dpd_req_t *req,
    unsigned drop, const char *extra, const cJSON *ktp, const char *host,
    size_t *len);
static char *dpd_splice(const ngx_http_dpd_req_t *req, unsigned drop,
    const char *extra, cJSON *ktp, size_t *len);
static char *dpd_prefill_copy(const ngx_http_dpd_req_t *req, cJSON *ktp,
    const char *prompt, size_t *len);
static cJSON *dpd_parse_object(const char *data, size_t len);


/* with each name's length: most members are told apart without a compare;
 * a new name's first byte goes into dpd_key_kind()'s switch as well */

#define dpd_key(name, key)  { name, sizeof(name) - 1, key }

static const struct {
    const char  *name;
    size_t       len;
    unsigned     key;
} dpd_keys[] = {
    dpd_key(DPD_KTP,                 NGX_HTTP_DPD_KEY_KV_TRANSFER_PARAMS),
    dpd_key("max_tokens",            NGX_HTTP_DPD_KEY_MAX_TOKENS),
    dpd_key("max_completion_tokens", NGX_HTTP_DPD_KEY_MAX_COMPLETION_TOKENS),
    dpd_key("stream",                NGX_HTTP_DPD_KEY_STREAM),
    dpd_key("stream_options",        NGX_HTTP_DPD_KEY_STREAM_OPTIONS),
    dpd_key("min_tokens",            NGX_HTTP_DPD_KEY_MIN_TOKENS),
    dpd_key("min_completion_tokens", NGX_HTTP_DPD_KEY_MIN_COMPLETION_TOKENS),
    dpd_key("prompt",                NGX_HTTP_DPD_KEY_PROMPT),
    dpd_key("n",                     NGX_HTTP_DPD_KEY_N),
    dpd_key("best_of",               NGX_HTTP_DPD_KEY_BEST_OF),
    dpd_key("echo",                  NGX_HTTP_DPD_KEY_ECHO),
    dpd_key("logprobs",              NGX_HTTP_DPD_KEY_LOGPROBS),
    { NULL, 0, 0 }
};


static int
dpd_bad(ngx_http_dpd_req_t *req, int bad, const char *fmt, ...)
{
    va_list  args;

    req->bad = bad;

    va_start(args, fmt);
    vsnprintf(req->why, sizeof(req->why), fmt, args);
    va_end(args);

    return 1;
}


static void *
dpd_alloc(const ngx_http_dpd_req_t *req, size_t size)
{
    if (req->alloc) {
        return req->alloc(req->alloc_data, size);
    }

    return malloc(size);
}


static int
dpd_is_hex(unsigned char c)
{
    return (c >= '0' && c <= '9') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'f');
}


/*
 * One pass over the raw body.  Without "out", the checks cJSON does not
 * make, before it allocates anything: UTF-8 (RFC 8259), no raw control
 * characters in strings and none but white space outside them (cJSON
 * skips any byte <= 0x20 as white space, Python's json refuses them),
 * only RFC 8259's escapes, no "\u0000" (cJSON ends the string there, the
 * engines do not: a prompt would be counted short), nesting up to max_depth (bounds the parser's
 * recursion), at most max_elements values (bounds the tree: one cJSON
 * node per value).  Returns 0, or 1 with req->bad set.
 *
 * In the same pass, records up to nout top-level members in out, each
 * from its key's opening quote to the end of its value (meaningful once
 * cJSON accepted the body too), and sets *nmembers to how many there are.
 */

static int
dpd_scan(ngx_http_dpd_req_t *req, const ngx_http_dpd_limits_t *limits,
    ngx_http_dpd_member_t *out, size_t nout, size_t *nmembers)
{
    int                   in_str, top, state;
    size_t                depth, elements, n, k, start;
    unsigned char         c, lo, hi;
    const unsigned char  *data, *p, *end, *sig;

    data = (const unsigned char *) req->data;
    p = data;
    end = data + req->len;
    sig = p;             /* just past the last byte that is not white space */

    depth = 0;
    elements = 0;
    in_str = 0;
    top = 0;             /* 0: before the value, 1: in it (an object), 2 */
    state = DPD_TOP_KEY;
    start = 0;
    k = 0;

    while (p < end) {
        c = *p;

        if (c >= 0x80) {

            /* a multi-byte sequence: lead byte, range of the second byte */

            lo = 0x80;
            hi = 0xbf;

            if (c >= 0xc2 && c <= 0xdf) {
                n = 1;

            } else if (c >= 0xe0 && c <= 0xef) {
                n = 2;
                if (c == 0xe0) {
                    lo = 0xa0;              /* no overlong forms */
                } else if (c == 0xed) {
                    hi = 0x9f;              /* no UTF-16 surrogates */
                }

            } else if (c >= 0xf0 && c <= 0xf4) {
                n = 3;
                if (c == 0xf0) {
                    lo = 0x90;
                } else if (c == 0xf4) {
                    hi = 0x8f;              /* nothing above U+10FFFF */
                }

            } else {
                goto invalid;
            }

            if ((size_t) (end - p) <= n || p[1] < lo || p[1] > hi
                || (n >= 2 && (p[2] & 0xc0) != 0x80)
                || (n == 3 && (p[3] & 0xc0) != 0x80))
            {
                goto invalid;
            }

            p += n + 1;
            sig = p;
            continue;
        }

        if (in_str) {

            /*
             * the bulk of a body is string text: skip 8 bytes at a time
             * while none of them is a quote, a backslash, a control
             * character or a non-ASCII byte (t/201: same verdicts)
             */

            if (c >= 0x20 && c != '"' && c != '\\') {
                p++;

                while (end - p >= 8) {
                    uint64_t  v, m;

                    memcpy(&v, p, 8);

                    m = ((v - DPD_ONES * 0x20)
                         | ((v ^ (DPD_ONES * '"')) - DPD_ONES)
                         | ((v ^ (DPD_ONES * '\\')) - DPD_ONES)
                         | v)
                        & (DPD_ONES * 0x80);

                    if (m) {
#if (defined(__GNUC__) && defined(__BYTE_ORDER__)                             \
     && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__)
                        /*
                         * the lowest flagged byte is the first of them (a
                         * borrow only flags the bytes above a flagged one):
                         * on to it, not byte by byte (short strings: keys)
                         */
                        p += __builtin_ctzll(m) >> 3;
#endif
                        break;
                    }

                    p += 8;
                }

                sig = p;
                continue;
            }

            if (c == '"') {
                in_str = 0;

                if (state == DPD_TOP_IN_KEY && depth == 1 && top == 1) {
                    state = DPD_TOP_COLON;
                }

            } else if (c == '\\') {

                /*
                 * only RFC 8259's escapes: cJSON reads a bad "\u" escape
                 * ("\u00]9") as U+0000 and ends the string there
                 */

                if (p + 1 >= end || strchr("\"\\/bfnrtu", p[1]) == NULL
                    || p[1] == '\0'
                    || (p[1] == 'u'
                        && (end - p < 6 || !dpd_is_hex(p[2])
                            || !dpd_is_hex(p[3]) || !dpd_is_hex(p[4])
                            || !dpd_is_hex(p[5]))))
                {
                    return dpd_bad(req, NGX_HTTP_DPD_BAD_MALFORMED,
                               "malformed JSON: invalid escape in a string "
                               "at byte %zu", (size_t) (p - data));
                }

                if (p[1] == 'u' && p[2] == '0' && p[3] == '0'
                    && p[4] == '0' && p[5] == '0')
                {
                    return dpd_bad(req, NGX_HTTP_DPD_BAD_NUL,
                               "the request holds a NUL character "
                               "(\\u0000) at byte %zu, which is refused",
                               (size_t) (p - data));
                }

                /* the escaped character (its hex digits are plain ASCII) */
                p++;

            } else if (c < 0x20) {
                return dpd_bad(req, NGX_HTTP_DPD_BAD_MALFORMED,
                               "malformed JSON: unescaped control character "
                               "in a string at byte %zu",
                               (size_t) (p - data));
            }

            p++;
            sig = p;
            continue;
        }

        switch (c) {

        case ' ':
        case '\t':
        case '\r':
        case '\n':
            p++;
            continue;

        case '"':
            in_str = 1;

            if (state == DPD_TOP_KEY && depth == 1 && top == 1) {
                start = (size_t) (p - data);
                state = DPD_TOP_IN_KEY;
            }

            break;

        case '[':
        case '{':
            /* with the commas: a bound on the values in the containers */

            if (++elements > limits->max_elements) {
                goto too_many;
            }

            if (++depth > limits->max_depth) {
                return dpd_bad(req, NGX_HTTP_DPD_BAD_DEPTH,
                               "JSON nesting deeper than %zu levels",
                               limits->max_depth);
            }

            if (depth == 1 && top == 0) {
                top = (c == '{') ? 1 : 2;
                state = DPD_TOP_KEY;
            }

            break;

        case ']':
        case '}':
            if (depth == 1 && top == 1) {
                if (state == DPD_TOP_VALUE) {
                    if (k < nout) {
                        out[k].start = start;
                        out[k].end = (size_t) (sig - data);
                    }

                    k++;
                }

                top = 2;
            }

            if (depth > 0) {
                depth--;
            }

            break;

        case ',':
            if (++elements > limits->max_elements) {
                goto too_many;
            }

            if (depth == 1 && top == 1 && state == DPD_TOP_VALUE) {
                if (k < nout) {
                    out[k].start = start;
                    out[k].end = (size_t) (sig - data);
                }

                k++;
                state = DPD_TOP_KEY;
            }

            break;

        case ':':
            if (depth == 1 && top == 1 && state == DPD_TOP_COLON) {
                state = DPD_TOP_VALUE;
            }

            break;

        default:
            if (c < 0x20) {
                return dpd_bad(req, NGX_HTTP_DPD_BAD_MALFORMED,
                               "malformed JSON: control character outside "
                               "a string at byte %zu", (size_t) (p - data));
            }
        }

        p++;
        sig = p;
    }

    req->elements = elements;
    *nmembers = k;

    return 0;

invalid:

    return dpd_bad(req, NGX_HTTP_DPD_BAD_UTF8,
                   "the request body is not valid UTF-8 (byte %zu)",
                   (size_t) (p - data));

too_many:

    return dpd_bad(req, NGX_HTTP_DPD_BAD_LIMIT,
                   "the request JSON has more than %zu elements "
                   "(dpd_max_json_members)", limits->max_elements);
}


/* the names of dpd_keys[] by their first byte (every first byte of
 * dpd_keys[] is a case here): most keys meet none */

static unsigned
dpd_key_kind(const char *name)
{
    size_t  i;

    switch (name[0]) {
    case 'k': case 'm': case 's': case 'p': case 'n': case 'b': case 'e':
    case 'l':
        break;
    default:
        return NGX_HTTP_DPD_KEY_OTHER;
    }

    for (i = 0; dpd_keys[i].name; i++) {
        if (name[0] == dpd_keys[i].name[0]
            && strcmp(name, dpd_keys[i].name) == 0)
        {
            return dpd_keys[i].key;
        }
    }

    return NGX_HTTP_DPD_KEY_OTHER;
}


static int
dpd_key_cmp(const void *a, const void *b)
{
    const cJSON  *x = *(const cJSON * const *) a;
    const cJSON  *y = *(const cJSON * const *) b;

    return strcmp(x->string, y->string);
}


/*
 * Refuses a key repeated in any object: cJSON's lookups find the first,
 * the engines' json module keeps the last, so the gateway would count,
 * route and rewrite something else than what the engine runs.  The
 * top-level kv_transfer_params are exempt: they all go.  Objects of up
 * to DPD_PAIRWISE_MAX members are compared pairwise, larger ones sorted:
 * O(n log n) in the members, whatever the keys.  With top, obj is
 * req->json and req->members holds its members' kinds.
 */

static int
dpd_check_keys(ngx_http_dpd_req_t *req, const cJSON *obj, int top)
{
    int            rc;
    char           name[64];
    size_t         n, i, j;
    const cJSON   *c, *dup, *small[DPD_PAIRWISE_MAX], **keys;

    for (c = obj->child; c; c = c->next) {
        if ((ngx_http_dpd_json_is(c, cJSON_Object)
             || ngx_http_dpd_json_is(c, cJSON_Array))
            && c->child)
        {
            rc = dpd_check_keys(req, c, 0);
            if (rc != 0) {
                return rc;
            }
        }
    }

    if (!ngx_http_dpd_json_is(obj, cJSON_Object)) {
        return 0;
    }

    /* at the top, the members' kinds (req->members, in the same order) */

    n = 0;

    for (c = obj->child, i = 0; c; c = c->next, i++) {
        if (c->string == NULL) {
            return -1;
        }

        if (!(top && req->members[i].key
                     == NGX_HTTP_DPD_KEY_KV_TRANSFER_PARAMS))
        {
            n++;
        }
    }

    if (n < 2) {
        return 0;
    }

    keys = (n <= DPD_PAIRWISE_MAX) ? small : malloc(n * sizeof(cJSON *));
    if (keys == NULL) {
        return -1;
    }

    i = 0;

    for (c = obj->child, j = 0; c; c = c->next, j++) {
        if (!(top && req->members[j].key
                     == NGX_HTTP_DPD_KEY_KV_TRANSFER_PARAMS))
        {
            keys[i++] = c;
        }
    }

    dup = NULL;

    if (n <= DPD_PAIRWISE_MAX) {
        for (i = 0; dup == NULL && i < n; i++) {
            for (j = i + 1; j < n; j++) {
                if (keys[i]->string[0] == keys[j]->string[0]
                    && strcmp(keys[i]->string, keys[j]->string) == 0)
                {
                    dup = keys[i];
                    break;
                }
            }
        }

    } else {
        qsort(keys, n, sizeof(cJSON *), dpd_key_cmp);

        for (i = 1; i < n; i++) {
            if (strcmp(keys[i - 1]->string, keys[i]->string) == 0) {
                dup = keys[i];
                break;
            }
        }
    }

    if (dup) {
        /* the name goes into logs and the error body: printable only */

        for (i = 0; dup->string[i] && i < sizeof(name) - 4; i++) {
            name[i] = ((unsigned char) dup->string[i] < 0x20
                       || dup->string[i] == 0x7f || dup->string[i] == '"'
                       || dup->string[i] == '\\')
                      ? '?' : dup->string[i];
        }

        if (dup->string[i]) {
            memcpy(name + i, "...", 3);
            i += 3;
        }

        name[i] = '\0';

        rc = dpd_bad(req, NGX_HTTP_DPD_BAD_DUPLICATE,
                     "the key \"%s\" appears more than once in %s object; "
                     "repeated keys are refused (engines keep the last, "
                     "the gateway cannot tell which one counts)",
                     name, top ? "the request" : "a nested");

    } else {
        rc = 0;
    }

    if (keys != small) {
        free(keys);
    }

    return rc;
}


int
ngx_http_dpd_proto_parse_request(ngx_http_dpd_req_t *req, const char *data,
    size_t len, const ngx_http_dpd_limits_t *limits)
{
    int                     rc;
    size_t                  n, i, k;
    const char             *end;
    const cJSON            *c, *xargs;
    ngx_http_dpd_member_t   local[DPD_SCAN_MEMBERS];

    req->data = data;
    req->len = len;
    req->json = NULL;
    req->members = NULL;
    req->nmembers = 0;
    req->elements = 0;
    req->kv_params = 0;
    req->bad = NGX_HTTP_DPD_BAD_NONE;
    req->why[0] = '\0';

    if (data == NULL || len == 0) {
        return dpd_bad(req, NGX_HTTP_DPD_BAD_MALFORMED,
                       "the request body is empty: expected a JSON object");
    }

    if (dpd_scan(req, limits, local, DPD_SCAN_MEMBERS, &k) != 0) {
        return 1;
    }

    /* cJSON's tree and verdict, at a fraction of its parser's cost */

    end = NULL;

    if (req->tree_alloc && req->tree_release) {
        req->json = ngx_http_dpd_json_parse_in(data, len, &end,
                                               req->tree_alloc,
                                               req->tree_data);

    } else {
        req->json = ngx_http_dpd_json_parse(data, len, &end);
    }

    if (req->json == NULL) {
        if (end == NULL || end < data || end > data + len) {
            end = data;
        }

        return dpd_bad(req, NGX_HTTP_DPD_BAD_MALFORMED,
                       "malformed JSON in the request body near byte %zu",
                       (size_t) (end - data));
    }

    /* nothing but white space may follow the value */

    while (end < data + len
           && (*end == ' ' || *end == '\t' || *end == '\r' || *end == '\n'))
    {
        end++;
    }

    if (end < data + len) {
        return dpd_bad(req, NGX_HTTP_DPD_BAD_MALFORMED,
                       "malformed JSON: unexpected data after the value at "
                       "byte %zu", (size_t) (end - data));
    }

    if (!ngx_http_dpd_json_is(req->json, cJSON_Object)) {
        return dpd_bad(req, NGX_HTTP_DPD_BAD_FIELD,
                       "the request body must be a JSON object");
    }

    n = 0;

    for (c = req->json->child; c; c = c->next) {
        n++;
    }

    req->members = dpd_alloc(req, (n ? n : 1) * sizeof(ngx_http_dpd_member_t));
    if (req->members == NULL) {
        return -1;
    }

    /* the scanner and cJSON agree on what a valid body holds */

    if (n <= DPD_SCAN_MEMBERS) {
        if (k != n) {
            return -1;
        }

        memcpy(req->members, local, n * sizeof(ngx_http_dpd_member_t));

    } else if (dpd_scan(req, limits, req->members, n, &k) != 0 || k != n) {
        return -1;
    }

    req->nmembers = n;

    xargs = NULL;

    for (i = 0, c = req->json->child; c; c = c->next, i++) {
        req->members[i].key = dpd_key_kind(c->string);

        if (req->members[i].key == NGX_HTTP_DPD_KEY_KV_TRANSFER_PARAMS) {
            req->kv_params++;

        } else if (xargs == NULL && c->string[0] == 'v'
                   && strcmp(c->string, "vllm_xargs") == 0)
        {
            /* the first, as cJSON_GetObjectItemCaseSensitive() finds */
            xargs = c;
        }
    }

    rc = dpd_check_keys(req, req->json, 1);
    if (rc != 0) {
        return rc;
    }

    /*
     * vLLM hands vllm_xargs to the engine as extra_args, where its KV
     * connectors look for kv_transfer_params when the request has none
     */

    if (ngx_http_dpd_json_get(xargs, DPD_KTP) != NULL) {
        return dpd_bad(req, NGX_HTTP_DPD_BAD_FIELD,
                       "vllm_xargs.kv_transfer_params is reserved for the "
                       "gateway");
    }

    return 0;
}


void
ngx_http_dpd_proto_drop_tree(ngx_http_dpd_req_t *req)
{
    if (req->tree_release) {
        req->tree_release(req->tree_data);
        req->tree_release = NULL;
        req->tree_data = NULL;
        req->tree_alloc = NULL;

    } else {
        cJSON_Delete(req->json);
    }

    req->json = NULL;
}


void
ngx_http_dpd_proto_release(ngx_http_dpd_req_t *req)
{
    ngx_http_dpd_proto_drop_tree(req);

    if (req->alloc == NULL) {
        free(req->members);
    }

    req->members = NULL;
    req->nmembers = 0;
}


/* removes every occurrence of key, in one pass */

static void
dpd_json_delete_all(cJSON *obj, const char *key)
{
    cJSON  *item, *next;

    for (item = obj->child; item; item = next) {
        next = item->next;

        if (item->string && strcmp(item->string, key) == 0) {
            cJSON_Delete(cJSON_DetachItemViaPointer(obj, item));
        }
    }
}


/* sets key to item (taking it over) replacing every earlier occurrence */

static int
dpd_json_set(cJSON *obj, const char *key, cJSON *item)
{
    if (item == NULL) {
        return -1;
    }

    dpd_json_delete_all(obj, key);

    if (!cJSON_AddItemToObject(obj, key, item)) {
        cJSON_Delete(item);
        return -1;
    }

    return 0;
}


static int
dpd_json_is_uint(const cJSON *item, double max)
{
    double  v;

    if (!cJSON_IsNumber(item)) {
        return 0;
    }

    v = item->valuedouble;

    return v >= 0 && v <= max && floor(v) == v;
}


/* what a vLLM NixlConnector prefill request carries (pull side unset) */

static cJSON *
dpd_nixl_request_params(void)
{
    cJSON  *p;

    p = cJSON_CreateObject();
    if (p == NULL) {
        return NULL;
    }

    if (cJSON_AddTrueToObject(p, "do_remote_decode") == NULL
        || cJSON_AddFalseToObject(p, "do_remote_prefill") == NULL
        || cJSON_AddNullToObject(p, "remote_engine_id") == NULL
        || cJSON_AddNullToObject(p, "remote_block_ids") == NULL
        || cJSON_AddNullToObject(p, "remote_host") == NULL
        || cJSON_AddNullToObject(p, "remote_port") == NULL)
    {
        cJSON_Delete(p);
        return NULL;
    }

    return p;
}


/* LMCache PD: the prefiller pushes to the receiver named here */

static cJSON *
dpd_lmcache_request_params(const ngx_http_dpd_lmcache_spec_t *spec)
{
    size_t   i;
    cJSON   *p, *s, *init, *alloc;

    if (spec == NULL || spec->req_id == NULL || spec->receiver_host == NULL
        || spec->nports == 0)
    {
        return NULL;
    }

    p = cJSON_CreateObject();
    if (p == NULL) {
        return NULL;
    }

    if (cJSON_AddTrueToObject(p, "ret_first_tok") == NULL) {
        goto failed;
    }

    s = cJSON_AddObjectToObject(p, "disagg_spec");

    if (s == NULL
        || cJSON_AddStringToObject(s, "req_id", spec->req_id) == NULL
        || cJSON_AddStringToObject(s, "receiver_host", spec->receiver_host)
           == NULL)
    {
        goto failed;
    }

    init = cJSON_AddArrayToObject(s, "receiver_init_port");
    alloc = cJSON_AddArrayToObject(s, "receiver_alloc_port");

    if (init == NULL || alloc == NULL) {
        goto failed;
    }

    for (i = 0; i < spec->nports; i++) {
        if (!cJSON_AddItemToArray(init,
                                  cJSON_CreateNumber(spec->init_ports[i]))
            || !cJSON_AddItemToArray(alloc,
                                     cJSON_CreateNumber(spec->alloc_ports[i])))
        {
            goto failed;
        }
    }

    return p;

failed:

    cJSON_Delete(p);
    return NULL;
}


/*
 * The client's body without the members whose kind is in "drop" (a mask
 * of 1 << NGX_HTTP_DPD_KEY_*), then the members in "extra" (a text of
 * members, may be NULL) and, if given, ktp (taken over) as
 * kv_transfer_params: the client's bytes are copied by range, never
 * re-encoded.  Linear in the body: one pass to size, one to write.
 */

/*
 * cJSON_PrintUnformatted()'s text of item, byte for byte (cJSON 1.7.15:
 * numbers as "%1.15g" unless that does not read back, then "%1.17g",
 * integers of up to 15 digits without snprintf(); NaN and infinities as
 * null; strings
 * with \", \\, \b, \f, \n, \r, \t and \u00xx for other control
 * characters, everything else as it is), without its buffer reallocations
 * and snprintf() per integer.  out NULL: only the length.  (size_t) -1:
 * what cJSON cannot print (an invalid item, a raw item without text).
 */

#define DPD_PRINT_ERROR  ((size_t) -1)

static size_t
dpd_print_number(const cJSON *item, char *out)
{
    int        n;
    char       buf[32], *p;
    double     d, test;
    uint64_t   u;

    d = item->valuedouble;

    if (isnan(d) || isinf(d)) {
        if (out) {
            memcpy(out, "null", 4);
        }

        return 4;
    }

    if (d == floor(d) && fabs(d) < 1e15 && !(d == 0 && signbit(d))) {

        /* what "%1.15g" prints for an integer of up to 15 digits */

        p = buf + sizeof(buf);
        u = (uint64_t) fabs(d);

        do {
            *--p = (char) ('0' + u % 10);
            u /= 10;
        } while (u);

        if (d < 0) {
            *--p = '-';
        }

        n = (int) (buf + sizeof(buf) - p);

        if (out) {
            memcpy(out, p, (size_t) n);
        }

        return (size_t) n;
    }

    n = snprintf(buf, sizeof(buf), "%1.15g", d);

    if (sscanf(buf, "%lg", &test) != 1
        || !(fabs(test - d) <= fmax(fabs(test), fabs(d)) * DBL_EPSILON))
    {
        n = snprintf(buf, sizeof(buf), "%1.17g", d);
    }

    if (n < 0 || n > 25) {
        return DPD_PRINT_ERROR;
    }

    if (out) {
        memcpy(out, buf, (size_t) n);
    }

    return (size_t) n;
}


static size_t
dpd_print_string(const char *s, char *out)
{
    size_t                n, len, i, run;
    uint64_t              v, q, b;
    unsigned char         c;
    const unsigned char  *p;
    static const char     hex[] = "0123456789abcdef";

    p = (const unsigned char *) (s ? s : "");
    len = strlen((const char *) p);
    n = 2;

    if (out) {
        *out++ = '"';
    }

    for (i = 0; i < len; /* void */) {

        /*
         * prompt text is long runs that need no escape: find the run's
         * end 8 bytes at a time (a byte below 0x20, a quote or a
         * backslash ends it; the tests are exact for "some byte is"),
         * then copy it at once
         */

        run = i;

        while (len - run >= 8) {
            memcpy(&v, p + run, 8);
            q = v ^ (DPD_ONES * '"');
            b = v ^ (DPD_ONES * '\\');

            if ((((v - DPD_ONES * 0x20) & ~v) | ((q - DPD_ONES) & ~q)
                 | ((b - DPD_ONES) & ~b))
                & (DPD_ONES * 0x80))
            {
                break;
            }

            run += 8;
        }

        while (run < len && p[run] >= 32 && p[run] != '"'
               && p[run] != '\\')
        {
            run++;
        }

        if (run > i) {
            if (out) {
                memcpy(out, p + i, run - i);
                out += run - i;
            }

            n += run - i;
            i = run;

            if (i == len) {
                break;
            }
        }

        c = p[i++];

        switch (c) {
        case '"':  c = '"';  break;
        case '\\': c = '\\'; break;
        case '\b': c = 'b';  break;
        case '\f': c = 'f';  break;
        case '\n': c = 'n';  break;
        case '\r': c = 'r';  break;
        case '\t': c = 't';  break;
        default:
            if (out) {
                memcpy(out, "\\u00", 4);
                out[4] = hex[c >> 4];
                out[5] = hex[c & 0xf];
                out += 6;
            }

            n += 6;
            continue;
        }

        if (out) {
            *out++ = '\\';
            *out++ = (char) c;
        }

        n += 2;
    }

    if (out) {
        *out = '"';
    }

    return n;
}


static size_t
dpd_print(const cJSON *item, char *out)
{
    size_t        n, k;
    const cJSON  *c;

    switch (item->type & 0xff) {

    case cJSON_NULL:
        if (out) {
            memcpy(out, "null", 4);
        }
        return 4;

    case cJSON_False:
        if (out) {
            memcpy(out, "false", 5);
        }
        return 5;

    case cJSON_True:
        if (out) {
            memcpy(out, "true", 4);
        }
        return 4;

    case cJSON_Number:
        return dpd_print_number(item, out);

    case cJSON_String:
        return dpd_print_string(item->valuestring, out);

    case cJSON_Raw:
        if (item->valuestring == NULL) {
            return DPD_PRINT_ERROR;
        }

        n = strlen(item->valuestring);

        if (out) {
            memcpy(out, item->valuestring, n);
        }

        return n;

    case cJSON_Array:
    case cJSON_Object:
        n = 0;

        if (out) {
            out[n] = (item->type & cJSON_Object) ? '{' : '[';
        }

        n++;

        for (c = item->child; c; c = c->next) {
            if (c != item->child) {
                if (out) {
                    out[n] = ',';
                }

                n++;
            }

            if (item->type & cJSON_Object) {
                n += dpd_print_string(c->string, out ? out + n : NULL);

                if (out) {
                    out[n] = ':';
                }

                n++;
            }

            k = dpd_print(c, out ? out + n : NULL);
            if (k == DPD_PRINT_ERROR) {
                return DPD_PRINT_ERROR;
            }

            n += k;
        }

        if (out) {
            out[n] = (item->type & cJSON_Object) ? '}' : ']';
        }

        return n + 1;

    default:
        return DPD_PRINT_ERROR;
    }
}


/*
 * ktp's text, with host (when not NULL) as its remote_host: ktp as it is
 * when its remote_host already says so, else every remote_host member
 * left out and "remote_host":host appended (what deleting them and adding
 * one to a copy printed)
 */

static size_t
dpd_print_params(const cJSON *ktp, const char *host, char *out)
{
    size_t        n, k;
    const cJSON  *c, *v;

    if (host == NULL) {
        return dpd_print(ktp, out);
    }

    v = cJSON_GetObjectItemCaseSensitive(ktp, "remote_host");

    if (cJSON_IsString(v) && strcmp(v->valuestring, host) == 0) {
        return dpd_print(ktp, out);
    }

    n = 0;

    if (out) {
        out[n] = '{';
    }

    n++;

    for (c = ktp->child; c; c = c->next) {
        if (c->string && strcmp(c->string, "remote_host") == 0) {
            continue;
        }

        if (n > 1) {
            if (out) {
                out[n] = ',';
            }

            n++;
        }

        n += dpd_print_string(c->string, out ? out + n : NULL);

        if (out) {
            out[n] = ':';
        }

        n++;

        k = dpd_print(c, out ? out + n : NULL);
        if (k == DPD_PRINT_ERROR) {
            return DPD_PRINT_ERROR;
        }

        n += k;
    }

    if (n > 1) {
        if (out) {
            out[n] = ',';
        }

        n++;
    }

    n += dpd_print_string("remote_host", out ? out + n : NULL);

    if (out) {
        out[n] = ':';
    }

    n++;

    n += dpd_print_string(host, out ? out + n : NULL);

    if (out) {
        out[n] = '}';
    }

    return n + 1;
}


/* dpd_splice_params() taking ktp over (deleted) */

static char *
dpd_splice(const ngx_http_dpd_req_t *req, unsigned drop, const char *extra,
    cJSON *ktp, size_t *len)
{
    char  *out;

    out = dpd_splice_params(req, drop, extra, ktp, NULL, len);

    cJSON_Delete(ktp);

    return out;
}


static char *
dpd_splice_params(const ngx_http_dpd_req_t *req, unsigned drop,
    const char *extra, const cJSON *ktp, const char *host, size_t *len)
{
    char                         *out, *p;
    size_t                        size, i, kept, elen, klen;
    const ngx_http_dpd_member_t  *m;

    klen = 0;

    if (ktp) {
        klen = dpd_print_params(ktp, host, NULL);

        if (klen == DPD_PRINT_ERROR) {
            return NULL;
        }
    }

    elen = extra ? strlen(extra) : 0;

    size = sizeof("{}") - 1;
    kept = 0;

    for (i = 0; i < req->nmembers; i++) {
        m = &req->members[i];

        if (!(drop & (1u << m->key))) {
            size += (m->end - m->start) + 1;
            kept++;
        }
    }

    size += elen + 1;

    if (ktp) {
        size += sizeof(",\"" DPD_KTP "\":") - 1 + klen;
    }

    out = dpd_alloc(req, size + 1);
    if (out == NULL) {
        return NULL;
    }

    p = out;
    *p++ = '{';

    for (i = 0; i < req->nmembers; i++) {
        m = &req->members[i];

        if (drop & (1u << m->key)) {
            continue;
        }

        if (p != out + 1) {
            *p++ = ',';
        }

        memcpy(p, req->data + m->start, m->end - m->start);
        p += m->end - m->start;
    }

    if (elen) {
        if (p != out + 1) {
            *p++ = ',';
        }

        memcpy(p, extra, elen);
        p += elen;
    }

    if (ktp) {
        if (p != out + 1) {
            *p++ = ',';
        }

        memcpy(p, "\"" DPD_KTP "\":", sizeof("\"" DPD_KTP "\":") - 1);
        p += sizeof("\"" DPD_KTP "\":") - 1;
        (void) dpd_print_params(ktp, host, p);
        p += klen;
    }

    *p++ = '}';
    *p = '\0';

    *len = (size_t) (p - out);

    return out;
}


char *
ngx_http_dpd_proto_prefill_body(const ngx_http_dpd_req_t *req, int protocol,
    const ngx_http_dpd_lmcache_spec_t *spec, size_t *len)
{
    cJSON  *ktp;

    if (req == NULL || req->members == NULL) {
        return NULL;
    }

    switch (protocol) {

    case NGX_HTTP_DPD_PROTO_NIXL:
        ktp = dpd_nixl_request_params();
        break;

    case NGX_HTTP_DPD_PROTO_LMCACHE:
        ktp = dpd_lmcache_request_params(spec);
        break;

    default:
        return NULL;
    }

    return dpd_prefill_copy(req, ktp, NULL, len);
}


char *
ngx_http_dpd_proto_kv_agent_prefill_body(const ngx_http_dpd_req_t *req,
    const char *req_id, const char *decode_node, size_t *len)
{
    cJSON  *ktp, *dpd;

    if (req == NULL || req->members == NULL
        || req_id == NULL || req_id[0] == '\0'
        || decode_node == NULL || decode_node[0] == '\0')
    {
        return NULL;
    }

    ktp = cJSON_CreateObject();
    if (ktp == NULL) {
        return NULL;
    }

    dpd = cJSON_AddObjectToObject(ktp, "dpd");

    if (dpd == NULL
        || cJSON_AddStringToObject(dpd, "req_id", req_id) == NULL
        || cJSON_AddStringToObject(dpd, "decode_node", decode_node) == NULL)
    {
        cJSON_Delete(ktp);
        return NULL;
    }

    return dpd_prefill_copy(req, ktp, NULL, len);
}


/*
 * the prefill copy of req with ktp as its kv_transfer_params (taken over),
 * and prompt (a JSON text, may be NULL) instead of the client's "prompt"
 */

static char *
dpd_prefill_copy(const ngx_http_dpd_req_t *req, cJSON *ktp,
    const char *prompt, size_t *len)
{
    char         *extra, *out, *p;
    size_t        i, n;
    unsigned      drop, has_mct;
    const char   *fixed;

    if (ktp == NULL) {
        return NULL;
    }

    drop = (1u << NGX_HTTP_DPD_KEY_KV_TRANSFER_PARAMS)
           | (1u << NGX_HTTP_DPD_KEY_MAX_TOKENS)
           | (1u << NGX_HTTP_DPD_KEY_MAX_COMPLETION_TOKENS)
           | (1u << NGX_HTTP_DPD_KEY_STREAM)
           | (1u << NGX_HTTP_DPD_KEY_STREAM_OPTIONS)
           | (1u << NGX_HTTP_DPD_KEY_MIN_TOKENS)
           | (1u << NGX_HTTP_DPD_KEY_MIN_COMPLETION_TOKENS);

    has_mct = 0;

    for (i = 0; i < req->nmembers; i++) {
        if (req->members[i].key == NGX_HTTP_DPD_KEY_MAX_COMPLETION_TOKENS) {
            has_mct = 1;
        }
    }

    /* one token: the prefill's product is the KV, not text */

    fixed = has_mct ? "\"max_tokens\":1,\"max_completion_tokens\":1,"
                      "\"stream\":false"
                    : "\"max_tokens\":1,\"stream\":false";

    if (prompt == NULL) {
        return dpd_splice(req, drop, fixed, ktp, len);
    }

    drop |= 1u << NGX_HTTP_DPD_KEY_PROMPT;

    n = strlen(fixed) + sizeof(",\"prompt\":") + strlen(prompt);

    extra = malloc(n);
    if (extra == NULL) {
        cJSON_Delete(ktp);
        return NULL;
    }

    memcpy(extra, fixed, strlen(fixed));
    p = extra + strlen(fixed);
    memcpy(p, ",\"prompt\":", sizeof(",\"prompt\":") - 1);
    p += sizeof(",\"prompt\":") - 1;
    memcpy(p, prompt, strlen(prompt) + 1);

    out = dpd_splice(req, drop, extra, ktp, len);

    free(extra);

    return out;
}


/*
 * vLLM NixlConnector reply params (nixl/pull_scheduler.py request_finished:
 * do_remote_prefill, remote_block_ids (one list per KV cache group),
 * remote_engine_id, remote_request_id, remote_host, remote_port, tp_size,
 * dcp_size, pp_size, remote_num_tokens, remote_blocks_expiry_time,
 * transfer_mode).  The decoder gets them unchanged but for remote_host, so
 * only what decides where it pulls from and what is checked here: the
 * rest (block ids of any shape, sizes, fields we do not know) is the
 * engines' business.  remote_host is the caller's (the allowlist).
 */

static const char *
dpd_nixl_check(const cJSON *p)
{
    const cJSON  *v;

    if (!cJSON_IsObject(p)) {
        return "kv_transfer_params is not an object";
    }

    v = cJSON_GetObjectItemCaseSensitive(p, "do_remote_prefill");
    if (!cJSON_IsTrue(v)) {
        return "do_remote_prefill is not true";
    }

    v = cJSON_GetObjectItemCaseSensitive(p, "remote_engine_id");
    if (!cJSON_IsString(v) || v->valuestring[0] == '\0') {
        return "remote_engine_id missing";
    }

    v = cJSON_GetObjectItemCaseSensitive(p, "remote_request_id");
    if (!cJSON_IsString(v) || v->valuestring[0] == '\0') {
        return "remote_request_id missing";
    }

    v = cJSON_GetObjectItemCaseSensitive(p, "remote_port");
    if (!dpd_json_is_uint(v, 65535) || v->valuedouble < 1) {
        return "remote_port missing or out of range";
    }

    return NULL;
}


int
ngx_http_dpd_proto_parse_reply(const char *data, size_t len, int protocol,
    cJSON **params, const char **why)
{
    cJSON         *reply, *ktp;
    const char    *bad;

    *params = NULL;
    *why = NULL;

    if (data == NULL || len == 0) {
        *why = "empty prefill reply";
        return NGX_HTTP_DPD_REPLY_INVALID;
    }

    reply = dpd_parse_object(data, len);

    if (reply == NULL) {
        *why = "prefill reply is not a JSON object";
        return NGX_HTTP_DPD_REPLY_INVALID;
    }

    if (protocol != NGX_HTTP_DPD_PROTO_NIXL) {
        /* lmcache pushes the KV itself: the reply carries nothing for us */
        cJSON_Delete(reply);
        return NGX_HTTP_DPD_REPLY_NO_PARAMS;
    }

    ktp = cJSON_GetObjectItemCaseSensitive(reply, DPD_KTP);

    if (ktp == NULL || cJSON_IsNull(ktp)) {
        cJSON_Delete(reply);
        *why = "prefill reply has no kv_transfer_params";
        return NGX_HTTP_DPD_REPLY_NO_PARAMS;
    }

    bad = dpd_nixl_check(ktp);

    /*
     * The decoder's json keeps the last of a repeated key, dpd_nixl_check()
     * saw the first: a reply that repeats one (remote_port, remote_block_ids
     * ...) is not passed on, whatever the copies say.
     */

    if (bad == NULL && cJSON_IsObject(ktp)) {
        ngx_http_dpd_req_t  scratch;

        memset(&scratch, 0, sizeof(scratch));

        if (dpd_check_keys(&scratch, ktp, 0) != 0) {
            bad = "prefill reply repeats a key in kv_transfer_params";
        }
    }

    if (bad) {
        cJSON_Delete(reply);
        *why = bad;
        return NGX_HTTP_DPD_REPLY_NO_PARAMS;
    }

    *params = cJSON_DetachItemViaPointer(reply, ktp);

    cJSON_Delete(reply);

    return NGX_HTTP_DPD_REPLY_PARAMS;
}


char *
ngx_http_dpd_proto_decode_body(const ngx_http_dpd_req_t *req,
    const cJSON *params, const char *prefill_host, size_t *len)
{
    cJSON        *ktp;
    const cJSON  *v;

    if (req == NULL || req->members == NULL) {
        return NULL;
    }

    if (params != NULL && prefill_host != NULL && prefill_host[0] != '\0'
        && cJSON_IsObject(params))
    {
        /* printed with the vetted host in place: no copy of the tree */
        return dpd_splice_params(req,
                                 1u << NGX_HTTP_DPD_KEY_KV_TRANSFER_PARAMS,
                                 NULL, params, prefill_host, len);
    }

    ktp = NULL;

    if (params != NULL && prefill_host != NULL && prefill_host[0] != '\0') {

        ktp = cJSON_Duplicate(params, 1);
        if (ktp == NULL) {
            return NULL;
        }

        /* the decoder pulls from the host the caller vetted, nowhere else */

        v = cJSON_GetObjectItemCaseSensitive(ktp, "remote_host");

        if (!(cJSON_IsString(v) && strcmp(v->valuestring, prefill_host) == 0)
            && dpd_json_set(ktp, "remote_host",
                            cJSON_CreateString(prefill_host))
               != 0)
        {
            cJSON_Delete(ktp);
            return NULL;
        }
    }

    return dpd_splice(req, 1u << NGX_HTTP_DPD_KEY_KV_TRANSFER_PARAMS, NULL,
                      ktp, len);
}


cJSON *
ngx_http_dpd_proto_parse_object(const char *data, size_t len)
{
    return dpd_parse_object(data, len);
}


/* one JSON object and nothing after it but white space, else NULL */

static cJSON *
dpd_parse_object(const char *data, size_t len)
{
    cJSON       *obj;
    const char  *end;

    if (data == NULL || len == 0) {
        return NULL;
    }

    obj = ngx_http_dpd_json_parse(data, len, &end);

    while (obj != NULL && end < data + len) {
        if (*end != ' ' && *end != '\t' && *end != '\r' && *end != '\n') {
            cJSON_Delete(obj);
            return NULL;
        }

        end++;
    }

    if (obj != NULL && !cJSON_IsObject(obj)) {
        cJSON_Delete(obj);
        return NULL;
    }

    return obj;
}


int
ngx_http_dpd_proto_kv_agent_reply(const char *data, size_t len,
    const char *req_id, unsigned long *blocks, const char **why)
{
    int           rc;
    cJSON        *reply;
    const cJSON  *ktp, *dpd, *v;

    *blocks = 0;
    *why = NULL;

    reply = dpd_parse_object(data, len);

    if (reply == NULL) {
        *why = "prefill reply is not a JSON object";
        return NGX_HTTP_DPD_REPLY_INVALID;
    }

    rc = NGX_HTTP_DPD_REPLY_NO_PARAMS;

    ktp = cJSON_GetObjectItemCaseSensitive(reply, DPD_KTP);
    dpd = cJSON_GetObjectItemCaseSensitive(ktp, "dpd");

    if (!cJSON_IsObject(dpd)) {
        *why = "prefill reply has no kv_transfer_params.dpd";
        goto done;
    }

    /* the reply must be about this request: never wait for another one */

    v = cJSON_GetObjectItemCaseSensitive(dpd, "req_id");
    if (!cJSON_IsString(v) || req_id == NULL
        || strcmp(v->valuestring, req_id) != 0)
    {
        *why = "prefill reply names another req_id";
        goto done;
    }

    v = cJSON_GetObjectItemCaseSensitive(dpd, "state");
    if (!cJSON_IsString(v)) {
        *why = "prefill reply has no push state";
        goto done;
    }

    if (strcmp(v->valuestring, "pushed") != 0) {
        *why = (strcmp(v->valuestring, "failed") == 0)
               ? "the prefill engine's agent could not push the KV"
               : "prefill reply has an unknown push state";
        goto done;
    }

    v = cJSON_GetObjectItemCaseSensitive(dpd, "blocks");
    if (!dpd_json_is_uint(v, 4294967295.0)) {
        *why = "prefill reply has no block count";
        goto done;
    }

    *blocks = (unsigned long) v->valuedouble;

    if (*blocks == 0) {
        *why = "nothing to push (prompt shorter than a KV block)";
        goto done;
    }

    rc = NGX_HTTP_DPD_REPLY_PARAMS;

done:

    cJSON_Delete(reply);

    return rc;
}


char *
ngx_http_dpd_proto_kv_agent_decode_body(const ngx_http_dpd_req_t *req,
    const char *req_id, size_t *len)
{
    cJSON  *ktp, *dpd;

    if (req == NULL || req->members == NULL) {
        return NULL;
    }

    ktp = NULL;

    if (req_id != NULL && req_id[0] != '\0') {
        ktp = cJSON_CreateObject();
        dpd = ktp ? cJSON_AddObjectToObject(ktp, "dpd") : NULL;

        if (dpd == NULL
            || cJSON_AddStringToObject(dpd, "req_id", req_id) == NULL)
        {
            cJSON_Delete(ktp);
            return NULL;
        }
    }

    return dpd_splice(req, 1u << NGX_HTTP_DPD_KEY_KV_TRANSFER_PARAMS, NULL,
                      ktp, len);
}


int
ngx_http_dpd_proto_member(const ngx_http_dpd_req_t *req, unsigned key,
    cJSON **value)
{
    size_t                        i;
    const char                   *p, *end;
    const ngx_http_dpd_member_t  *m;

    *value = NULL;

    for (i = 0; i < req->nmembers; i++) {
        m = &req->members[i];

        if (m->key != key) {
            continue;
        }

        /* past the key (a JSON string: the scanner checked its escapes) */

        p = req->data + m->start + 1;
        end = req->data + m->end;

        while (p < end && *p != '"') {
            p += (*p == '\\') ? 2 : 1;
        }

        p++;

        while (p < end && (*p == ' ' || *p == '\t' || *p == '\r'
                           || *p == '\n' || *p == ':'))
        {
            p++;
        }

        if (p >= end) {
            return -1;
        }

        *value = ngx_http_dpd_json_parse(p, (size_t) (end - p), NULL);

        return (*value == NULL) ? -1 : 0;
    }

    return 0;
}


char *
ngx_http_dpd_proto_lmcache_prefill_body(const ngx_http_dpd_req_t *req,
    const char *prompt, const ngx_http_dpd_lmcache_spec_t *spec, size_t *len)
{
    if (req == NULL || req->members == NULL) {
        return NULL;
    }

    return dpd_prefill_copy(req, dpd_lmcache_request_params(spec), prompt,
                            len);
}


char *
ngx_http_dpd_proto_lmcache_decode_body(const ngx_http_dpd_req_t *req,
    const char *prompt, long max_tokens, long max_completion_tokens,
    size_t *len)
{
    int        n;
    char      *extra, *out;
    size_t     size, used;
    unsigned   drop;

    if (req == NULL || req->members == NULL) {
        return NULL;
    }

    drop = 1u << NGX_HTTP_DPD_KEY_KV_TRANSFER_PARAMS;

    size = (prompt ? strlen(prompt) : 0) + 3 * 48;

    extra = malloc(size);
    if (extra == NULL) {
        return NULL;
    }

    used = 0;
    extra[0] = '\0';

    if (prompt) {
        drop |= 1u << NGX_HTTP_DPD_KEY_PROMPT;
        n = snprintf(extra, size, "\"prompt\":%s", prompt);
        used = (size_t) n;
    }

    if (max_tokens >= 0) {
        drop |= 1u << NGX_HTTP_DPD_KEY_MAX_TOKENS;
        n = snprintf(extra + used, size - used, "%s\"max_tokens\":%ld",
                     used ? "," : "", max_tokens);
        used += (size_t) n;
    }

    if (max_completion_tokens >= 0) {
        drop |= 1u << NGX_HTTP_DPD_KEY_MAX_COMPLETION_TOKENS;
        n = snprintf(extra + used, size - used,
                     "%s\"max_completion_tokens\":%ld", used ? "," : "",
                     max_completion_tokens);
        used += (size_t) n;
    }

    out = dpd_splice(req, drop, used ? extra : NULL, NULL, len);

    free(extra);

    return out;
}
