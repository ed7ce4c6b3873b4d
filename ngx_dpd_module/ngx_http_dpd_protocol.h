/*
 * The client's request as the gateway sees it, and the wire transforms of
 * the disaggregated path (docs/dpd.md), with cJSON and no nginx types, so
 * a test program or a fuzzer links this file alone.
 *
 *   request        the client's bytes, checked in one pass before cJSON
 *                  parses them (UTF-8, nesting, element count, NUL, raw
 *                  control characters), then parsed once; a key repeated
 *                  in any object is refused (the engines' JSON keeps the
 *                  last one, cJSON finds the first), except a top-level
 *                  kv_transfer_params, which is removed however often it
 *                  appears.  The top-level members are indexed by byte
 *                  range, so that the bodies below splice the client's
 *                  bytes instead of copying and printing a tree.
 *   prefill copy   the client's members without max_tokens,
 *                  max_completion_tokens, stream, stream_options,
 *                  min_tokens, min_completion_tokens, kv_transfer_params,
 *                  then max_tokens 1 (and max_completion_tokens 1 when
 *                  present), stream false and the protocol's
 *                  kv_transfer_params
 *   prefill reply  must be a JSON object; for nixl its kv_transfer_params
 *                  are validated and kept, or dropped with a reason
 *   decode body    the client's members without kv_transfer_params; for
 *                  nixl plus the reply's params unchanged (any shape of
 *                  remote_block_ids, fields unknown here) but remote_host,
 *                  which is the one the caller vetted (the prefill peer
 *                  that answered, or the reply's own inside
 *                  dpd_nixl_remote_hosts)
 *
 * Every body is linear in the client's body: one pass to size it, one to
 * write it, one allocation through req->alloc (malloc() when NULL: release
 * with free()).  Objects returned are released with cJSON_Delete().
 */

#ifndef _NGX_HTTP_DPD_PROTOCOL_H_INCLUDED_
#define _NGX_HTTP_DPD_PROTOCOL_H_INCLUDED_


#include <stddef.h>
#include <cjson/cJSON.h>


#define NGX_HTTP_DPD_PROTO_NIXL      1
#define NGX_HTTP_DPD_PROTO_LMCACHE   2
#define NGX_HTTP_DPD_PROTO_KV_AGENT  3


/* what a prefill reply gave the decoder */
#define NGX_HTTP_DPD_REPLY_PARAMS     0   /* usable kv_transfer_params */
#define NGX_HTTP_DPD_REPLY_NO_PARAMS  1   /* valid reply, decoder recomputes */
#define NGX_HTTP_DPD_REPLY_INVALID    2   /* not a JSON object: as a 5xx */


/* why a request is refused (400): req->bad, and the counting code's */
#define NGX_HTTP_DPD_BAD_NONE         0
#define NGX_HTTP_DPD_BAD_MALFORMED    1   /* not JSON, raw control chars */
#define NGX_HTTP_DPD_BAD_UTF8         2
#define NGX_HTTP_DPD_BAD_DEPTH        3   /* deeper than max_depth */
#define NGX_HTTP_DPD_BAD_FIELD        4   /* not an object, wrong field */
#define NGX_HTTP_DPD_BAD_TOKEN_RANGE  5   /* token id outside the vocab */
#define NGX_HTTP_DPD_BAD_DUPLICATE    6   /* a key repeated in an object */
#define NGX_HTTP_DPD_BAD_NUL          7   /* "\u0000" in a string */
#define NGX_HTTP_DPD_BAD_LIMIT        8   /* over a dpd_max_* cap */

#define NGX_HTTP_DPD_WHY_LEN        512


/* the top-level members the transforms remove or replace */
#define NGX_HTTP_DPD_KEY_OTHER                  0
#define NGX_HTTP_DPD_KEY_KV_TRANSFER_PARAMS     1
#define NGX_HTTP_DPD_KEY_MAX_TOKENS             2
#define NGX_HTTP_DPD_KEY_MAX_COMPLETION_TOKENS  3
#define NGX_HTTP_DPD_KEY_STREAM                 4
#define NGX_HTTP_DPD_KEY_STREAM_OPTIONS         5
#define NGX_HTTP_DPD_KEY_MIN_TOKENS             6
#define NGX_HTTP_DPD_KEY_MIN_COMPLETION_TOKENS  7
#define NGX_HTTP_DPD_KEY_PROMPT                 8
#define NGX_HTTP_DPD_KEY_N                      9
#define NGX_HTTP_DPD_KEY_BEST_OF               10
#define NGX_HTTP_DPD_KEY_ECHO                  11
#define NGX_HTTP_DPD_KEY_LOGPROBS              12


typedef struct {
    size_t                   start;     /* the key's opening quote */
    size_t                   end;       /* just past the value */
    unsigned                 key;       /* NGX_HTTP_DPD_KEY_* */
} ngx_http_dpd_member_t;


typedef struct {
    size_t                   max_depth;     /* dpd_max_json_depth */
    size_t                   max_elements;  /* dpd_max_json_members */
} ngx_http_dpd_limits_t;


typedef struct {
    /* set by the caller before parsing; alloc NULL: malloc() */
    void                  *(*alloc)(void *data, size_t size);
    void                    *alloc_data;

    /*
     * optional, set by the caller before parsing: the tree lives in the
     * caller's arena (cJSON's hooks point into it while the caller parses
     * and counts), and _drop_tree() hands the whole arena back with
     * tree_release(tree_data) instead of freeing node by node
     */
    void                   (*tree_release)(void *data);
    void                    *tree_data;

    /* optional, with tree_release: the tree's nodes and strings come from
     * tree_alloc(tree_data, size) directly, not through cJSON's hooks */
    void                  *(*tree_alloc)(void *data, size_t size);

    /* the client's bytes (not copied: they must outlive the bodies) */
    const char              *data;
    size_t                   len;

    cJSON                   *json;      /* parsed; see _drop_tree() */
    ngx_http_dpd_member_t   *members;   /* top level, in body order */
    size_t                   nmembers;
    size_t                   elements;  /* values below the top, bound */
    size_t                   kv_params; /* client kv_transfer_params */

    int                      bad;       /* NGX_HTTP_DPD_BAD_* */
    char                     why[NGX_HTTP_DPD_WHY_LEN];
} ngx_http_dpd_req_t;


typedef struct {
    const char            *req_id;
    const char            *receiver_host;
    const unsigned short  *init_ports;     /* one per TP rank */
    const unsigned short  *alloc_ports;
    size_t                 nports;
} ngx_http_dpd_lmcache_spec_t;


/*
 * Checks, parses and indexes len bytes at data (kept by reference).
 * Returns 0 when usable, 1 when refused (req->bad, req->why: a message for
 * the client), -1 when out of memory.  Release with _release().
 */
int ngx_http_dpd_proto_parse_request(ngx_http_dpd_req_t *req,
    const char *data, size_t len, const ngx_http_dpd_limits_t *limits);

/* frees the tree only: the bodies below need the index, not the tree */
void ngx_http_dpd_proto_drop_tree(ngx_http_dpd_req_t *req);

/* frees the tree and (alloc NULL) the index */
void ngx_http_dpd_proto_release(ngx_http_dpd_req_t *req);

/*
 * The prefill copy of the request.  spec is used by lmcache only.
 * Returns the body and its length, or NULL (out of memory, bad arguments).
 */
char *ngx_http_dpd_proto_prefill_body(const ngx_http_dpd_req_t *req,
    int protocol, const ngx_http_dpd_lmcache_spec_t *spec, size_t *len);

/*
 * Parses and classifies a prefill reply.  On NGX_HTTP_DPD_REPLY_PARAMS,
 * *params is a validated copy of the reply's kv_transfer_params (caller
 * deletes); otherwise *params is NULL and *why names the reason.
 */
int ngx_http_dpd_proto_parse_reply(const char *data, size_t len,
    int protocol, cJSON **params, const char **why);

/*
 * The decode body: the request without client kv_transfer_params, plus
 * "params" (may be NULL) with remote_host set to prefill_host (left as it
 * is, in place, when it already says that).  params without a
 * prefill_host are dropped (no host was vetted).
 * With neither, this is the body of the direct path and of a fallback.
 */
char *ngx_http_dpd_proto_decode_body(const ngx_http_dpd_req_t *req,
    const cJSON *params, const char *prefill_host, size_t *len);


/*
 * kv_agent (docs/dpd.md): the prefill copy with
 *   "kv_transfer_params": {"dpd": {"req_id": req_id,
 *                                  "decode_node": decode_node}}
 * Returns the body, or NULL.
 */
char *ngx_http_dpd_proto_kv_agent_prefill_body(const ngx_http_dpd_req_t *req,
    const char *req_id, const char *decode_node, size_t *len);

/*
 * kv_agent prefill reply: NGX_HTTP_DPD_REPLY_INVALID when it is not a JSON
 * object; NGX_HTTP_DPD_REPLY_PARAMS when the engine's agent accepted a
 * push of *blocks > 0 blocks for req_id ({"dpd": {"req_id", "blocks",
 * "state": "pushed"}}): worth waiting for; NGX_HTTP_DPD_REPLY_NO_PARAMS
 * otherwise (state "failed", 0 blocks, missing or foreign params), with
 * *why saying which.
 */
int ngx_http_dpd_proto_kv_agent_reply(const char *data, size_t len,
    const char *req_id, unsigned long *blocks, const char **why);

/*
 * kv_agent decode body: the request without client kv_transfer_params,
 * plus "kv_transfer_params": {"dpd": {"req_id": req_id}}
 * (req_id NULL: without any, as for a fallback).
 */
char *ngx_http_dpd_proto_kv_agent_decode_body(const ngx_http_dpd_req_t *req,
    const char *req_id, size_t *len);


/*
 * The value of the (single: repeats are refused) top-level member of kind
 * key (NGX_HTTP_DPD_KEY_*, not OTHER), parsed on its own: *value is NULL
 * when the request has no such member.  Returns 0, or -1 (out of memory).
 * Release *value with cJSON_Delete().
 */
int ngx_http_dpd_proto_member(const ngx_http_dpd_req_t *req, unsigned key,
    cJSON **value);

/* one JSON object and nothing after it but white space, else NULL */
cJSON *ngx_http_dpd_proto_parse_object(const char *data, size_t len);

/*
 * lmcache, as LMCache's disagg proxy does it
 * (examples/disagg_prefill/disagg_proxy_server.py):
 *
 * the prefill copy (max_tokens 1 ...) with "prompt" replaced by prompt
 * (a JSON text, e.g. "[1,2,3]": the prompt's token ids; NULL: the
 * client's) and spec's kv_transfer_params ({"ret_first_tok": true,
 * "disagg_spec": {...}})
 */
char *ngx_http_dpd_proto_lmcache_prefill_body(const ngx_http_dpd_req_t *req,
    const char *prompt, const ngx_http_dpd_lmcache_spec_t *spec,
    size_t *len);

/*
 * the decode body: the client's request without kv_transfer_params, with
 * "prompt" replaced by prompt (NULL: the client's), max_tokens and
 * max_completion_tokens by those given (< 0: the client's, left alone).
 */
char *ngx_http_dpd_proto_lmcache_decode_body(const ngx_http_dpd_req_t *req,
    const char *prompt, long max_tokens, long max_completion_tokens,
    size_t *len);


#endif /* _NGX_HTTP_DPD_PROTOCOL_H_INCLUDED_ */
