/*
 * Wire transforms of the disaggregated path (docs/dpd.md), with cJSON and
 * no nginx types, so a test program links this file alone.
 *
 *   prefill copy   the client's request with max_tokens 1 (and
 *                  max_completion_tokens 1 when present), stream false, no
 *                  stream_options/min_tokens/min_completion_tokens, and the
 *                  protocol's kv_transfer_params
 *   prefill reply  must be a JSON object; for nixl its kv_transfer_params
 *                  are validated and kept, or dropped with a reason
 *   decode body    the client's request without any client-supplied
 *                  kv_transfer_params; for nixl plus the reply's params with
 *                  remote_host forced to the prefill peer that answered
 *
 * Texts returned by the builders come from cJSON's allocator: release them
 * with cJSON_free().  Objects returned are released with cJSON_Delete().
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


typedef struct {
    const char            *req_id;
    const char            *receiver_host;
    const unsigned short  *init_ports;     /* one per TP rank */
    const unsigned short  *alloc_ports;
    size_t                 nports;
} ngx_http_dpd_lmcache_spec_t;


/* removes every client-supplied kv_transfer_params; returns how many */
int ngx_http_dpd_proto_strip(cJSON *req);

/*
 * The prefill copy of "req" (left untouched).  spec is used by lmcache only.
 * Returns the serialized body and its length, or NULL (out of memory, bad
 * arguments).
 */
char *ngx_http_dpd_proto_prefill_body(const cJSON *req, int protocol,
    const ngx_http_dpd_lmcache_spec_t *spec, size_t *len);

/*
 * Parses and classifies a prefill reply.  On NGX_HTTP_DPD_REPLY_PARAMS,
 * *params is a validated copy of the reply's kv_transfer_params (caller
 * deletes); otherwise *params is NULL and *why names the reason.
 */
int ngx_http_dpd_proto_parse_reply(const char *data, size_t len,
    int protocol, cJSON **params, const char **why);

/*
 * The decode body: "req" without client kv_transfer_params, plus "params"
 * (may be NULL) with remote_host set to prefill_host.  params without a
 * prefill_host are dropped (the peer that answered is unknown).
 */
char *ngx_http_dpd_proto_decode_body(const cJSON *req, const cJSON *params,
    const char *prefill_host, size_t *len);


/*
 * kv_agent (docs/dpd.md, "dpd_protocol kv_agent"): the prefill copy of "req" with
 *   "kv_transfer_params": {"dpd": {"req_id": req_id,
 *                                  "decode_node": decode_node}}
 * Returns the serialized body, or NULL.
 */
char *ngx_http_dpd_proto_kv_agent_prefill_body(const cJSON *req,
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
 * kv_agent decode body: "req" without client kv_transfer_params, plus
 *   "kv_transfer_params": {"dpd": {"req_id": req_id}}
 * (req_id NULL: without any, as for a fallback).
 */
char *ngx_http_dpd_proto_kv_agent_decode_body(const cJSON *req,
    const char *req_id, size_t *len);


#endif /* _NGX_HTTP_DPD_PROTOCOL_H_INCLUDED_ */
