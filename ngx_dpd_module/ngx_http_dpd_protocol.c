/*
 * Wire transforms of the disaggregated path (docs/dpd.md).  No nginx
 * headers here: the nginx side hands in the parsed request and copies the
 * texts out; t/201-protocol.t links this file alone with cJSON.
 */

#include <string.h>
#include <math.h>

#include "ngx_http_dpd_protocol.h"


#define DPD_KTP  "kv_transfer_params"


static void dpd_json_delete_all(cJSON *obj, const char *key);
static int dpd_json_set(cJSON *obj, const char *key, cJSON *item);
static int dpd_json_is_uint(const cJSON *item, double max);
static cJSON *dpd_nixl_request_params(void);
static cJSON *dpd_lmcache_request_params(
    const ngx_http_dpd_lmcache_spec_t *spec);
static char *dpd_print(cJSON *obj, size_t *len);
static char *dpd_prefill_copy(const cJSON *req, cJSON *ktp, size_t *len);
static char *dpd_decode_copy(const cJSON *req, cJSON *ktp, size_t *len);
static cJSON *dpd_parse_object(const char *data, size_t len);


/* removes every occurrence of key: JSON objects may repeat a key */

static void
dpd_json_delete_all(cJSON *obj, const char *key)
{
    cJSON  *item;

    while ((item = cJSON_GetObjectItemCaseSensitive(obj, key)) != NULL) {
        cJSON_Delete(cJSON_DetachItemViaPointer(obj, item));
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


int
ngx_http_dpd_proto_strip(cJSON *req)
{
    int     n;
    cJSON  *item;

    n = 0;

    while ((item = cJSON_GetObjectItemCaseSensitive(req, DPD_KTP)) != NULL) {
        cJSON_Delete(cJSON_DetachItemViaPointer(req, item));
        n++;
    }

    return n;
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


static char *
dpd_print(cJSON *obj, size_t *len)
{
    char  *text;

    text = cJSON_PrintUnformatted(obj);
    if (text == NULL) {
        return NULL;
    }

    *len = strlen(text);

    return text;
}


char *
ngx_http_dpd_proto_prefill_body(const cJSON *req, int protocol,
    const ngx_http_dpd_lmcache_spec_t *spec, size_t *len)
{
    cJSON  *ktp;

    if (!cJSON_IsObject(req)) {
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

    return dpd_prefill_copy(req, ktp, len);
}


char *
ngx_http_dpd_proto_kv_agent_prefill_body(const cJSON *req,
    const char *req_id, const char *decode_node, size_t *len)
{
    cJSON  *ktp, *dpd;

    if (!cJSON_IsObject(req) || req_id == NULL || req_id[0] == '\0'
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

    return dpd_prefill_copy(req, ktp, len);
}


/* the prefill copy of req with ktp as its kv_transfer_params (taken over) */

static char *
dpd_prefill_copy(const cJSON *req, cJSON *ktp, size_t *len)
{
    int     has_mct;
    char   *text;
    cJSON  *copy;

    if (ktp == NULL) {
        return NULL;
    }

    copy = cJSON_Duplicate(req, 1);
    if (copy == NULL) {
        cJSON_Delete(ktp);
        return NULL;
    }

    ngx_http_dpd_proto_strip(copy);

    has_mct = cJSON_GetObjectItemCaseSensitive(copy, "max_completion_tokens")
              != NULL;

    /* one token: the prefill's product is the KV, not text */

    if (dpd_json_set(copy, "max_tokens", cJSON_CreateNumber(1)) != 0
        || (has_mct
            && dpd_json_set(copy, "max_completion_tokens",
                            cJSON_CreateNumber(1)) != 0)
        || dpd_json_set(copy, "stream", cJSON_CreateFalse()) != 0)
    {
        cJSON_Delete(ktp);
        cJSON_Delete(copy);
        return NULL;
    }

    dpd_json_delete_all(copy, "stream_options");
    dpd_json_delete_all(copy, "min_tokens");
    dpd_json_delete_all(copy, "min_completion_tokens");

    if (dpd_json_set(copy, DPD_KTP, ktp) != 0) {
        cJSON_Delete(copy);
        return NULL;
    }

    text = dpd_print(copy, len);

    cJSON_Delete(copy);

    return text;
}


/*
 * vLLM NixlConnector reply params: do_remote_prefill true, the engine id,
 * block ids, and the side channel port.  remote_host is not checked: it is
 * replaced by the prefill peer's host anyway.
 */

static const char *
dpd_nixl_check(const cJSON *p)
{
    const cJSON  *v, *id;

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

    v = cJSON_GetObjectItemCaseSensitive(p, "remote_block_ids");
    if (!cJSON_IsArray(v)) {
        return "remote_block_ids is not an array";
    }

    cJSON_ArrayForEach(id, v) {
        if (!dpd_json_is_uint(id, 4294967295.0)) {
            return "remote_block_ids holds a non block id";
        }
    }

    v = cJSON_GetObjectItemCaseSensitive(p, "remote_port");
    if (!dpd_json_is_uint(v, 65535) || v->valuedouble < 1) {
        return "remote_port missing or out of range";
    }

    v = cJSON_GetObjectItemCaseSensitive(p, "tp_size");
    if (v != NULL && !cJSON_IsNull(v) && !dpd_json_is_uint(v, 65535)) {
        return "tp_size is not a count";
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
ngx_http_dpd_proto_decode_body(const cJSON *req, const cJSON *params,
    const char *prefill_host, size_t *len)
{
    cJSON  *ktp;

    if (!cJSON_IsObject(req)) {
        return NULL;
    }

    ktp = NULL;

    if (params != NULL && prefill_host != NULL && prefill_host[0] != '\0') {

        ktp = cJSON_Duplicate(params, 1);
        if (ktp == NULL) {
            return NULL;
        }

        /* the decoder pulls from the peer we asked, from nowhere else */

        if (dpd_json_set(ktp, "remote_host", cJSON_CreateString(prefill_host))
            != 0)
        {
            cJSON_Delete(ktp);
            return NULL;
        }
    }

    return dpd_decode_copy(req, ktp, len);
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

    obj = cJSON_ParseWithLengthOpts(data, len, &end, 0);

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
ngx_http_dpd_proto_kv_agent_decode_body(const cJSON *req, const char *req_id,
    size_t *len)
{
    cJSON  *ktp, *dpd;

    if (!cJSON_IsObject(req)) {
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

    return dpd_decode_copy(req, ktp, len);
}


/* the decode copy of req, with ktp (taken over) as its kv_transfer_params */

static char *
dpd_decode_copy(const cJSON *req, cJSON *ktp, size_t *len)
{
    char   *text;
    cJSON  *copy;

    copy = cJSON_Duplicate(req, 1);
    if (copy == NULL) {
        cJSON_Delete(ktp);
        return NULL;
    }

    ngx_http_dpd_proto_strip(copy);

    /* dpd_json_set() releases ktp when it fails */

    if (ktp != NULL && dpd_json_set(copy, DPD_KTP, ktp) != 0) {
        cJSON_Delete(copy);
        return NULL;
    }

    text = dpd_print(copy, len);

    cJSON_Delete(copy);

    return text;
}
