/*
 * config.c - the agent's JSON configuration (examples in conf/kv_agent/).
 * Unknown keys are rejected so a typo never silently changes behaviour.
 */

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "kv.h"
#include "dpd_prefix.h"
#include "dpd_prefix_index.h"


uint32_t
kv_role_parse(const char *s)
{
    if (strcmp(s, "prefill") == 0) return DPD_ROLE_PREFILL;
    if (strcmp(s, "decode") == 0) return DPD_ROLE_DECODE;
    if (strcmp(s, "router") == 0) return DPD_ROLE_ROUTER;
    return DPD_ROLE_UNKNOWN;
}


static int
only_keys(cJSON *obj, const char *where, const char *const *keys, char *err,
    size_t elen)
{
    cJSON *e;
    const char *const *k;

    cJSON_ArrayForEach(e, obj) {
        for (k = keys; *k; k++) {
            if (strcmp(e->string, *k) == 0) {
                break;
            }
        }
        if (*k == NULL) {
            snprintf(err, elen, "%s: unknown key \"%s\"", where, e->string);
            return -1;
        }
    }
    return 0;
}


static int
get_str(cJSON *obj, const char *key, char *out, size_t olen, int required,
    char *err, size_t elen)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);

    if (v == NULL) {
        if (required) {
            snprintf(err, elen, "missing \"%s\"", key);
            return -1;
        }
        return 0;
    }
    if (!cJSON_IsString(v) || strlen(v->valuestring) >= olen) {
        snprintf(err, elen, "\"%s\" must be a string shorter than %zu", key,
                 olen);
        return -1;
    }
    strcpy(out, v->valuestring);
    return 0;
}


/* Numbers may be given as JSON numbers or as strings with K/M/G suffixes. */
static int
get_u64(cJSON *obj, const char *key, uint64_t *out, uint64_t min,
    uint64_t max, char *err, size_t elen)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    uint64_t x;

    if (v == NULL) {
        return 0;
    }
    if (cJSON_IsNumber(v)) {
        if (v->valuedouble < 0 || v->valuedouble > 1.8e19
            || v->valuedouble != (double) (uint64_t) v->valuedouble)
        {
            goto bad;
        }
        x = (uint64_t) v->valuedouble;
    } else if (cJSON_IsString(v)) {
        if (kv_parse_size(v->valuestring, &x) != 0) {
            goto bad;
        }
    } else {
        goto bad;
    }
    if (x < min || x > max) {
        goto bad;
    }
    *out = x;
    return 0;

bad:
    snprintf(err, elen, "\"%s\" must be an integer in [%llu, %llu]", key,
             (unsigned long long) min, (unsigned long long) max);
    return -1;
}


static int
get_int(cJSON *obj, const char *key, int *out, int min, int max, char *err,
    size_t elen)
{
    uint64_t v = (uint64_t) *out;

    if (get_u64(obj, key, &v, (uint64_t) min, (uint64_t) max, err, elen)) {
        return -1;
    }
    *out = (int) v;
    return 0;
}


static int
get_bool(cJSON *obj, const char *key, int *out, char *err, size_t elen)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);

    if (v == NULL) {
        return 0;
    }
    if (!cJSON_IsBool(v)) {
        snprintf(err, elen, "\"%s\" must be true or false", key);
        return -1;
    }
    *out = cJSON_IsTrue(v);
    return 0;
}


static int
parse_pool(kv_config_t *c, cJSON *p, char *err, size_t elen)
{
    static const char *const keys[] = {
        "layers", "regions", "kv_split", "block_bytes", "blocks", "memory",
        "block_stride", "region_stride", "layer_stride", "ranks", NULL
    };
    kv_layout_t *l = &c->layout;
    uint64_t v;
    char mem[32] = "host";
    int split = -1;
    char *end;

    if (!cJSON_IsObject(p)) {
        snprintf(err, elen, "\"pool\" must be an object");
        return -1;
    }
    if (only_keys(p, "pool", keys, err, elen)) {
        return -1;
    }
    v = 0;
    if (get_u64(p, "layers", &v, 1, 4096, err, elen)) return -1;
    l->layers = (uint32_t) v;
    v = 2;
    if (get_bool(p, "kv_split", &split, err, elen)) return -1;
    if (split == 0) v = 1;
    if (get_u64(p, "regions", &v, 1, 16, err, elen)) return -1;
    l->regions = (uint32_t) v;
    v = 0;
    if (get_u64(p, "blocks", &v, 1, 1u << 24, err, elen)) return -1;
    l->nblocks = (uint32_t) v;
    if (get_u64(p, "block_bytes", &l->block_bytes, 1, 1ULL << 32, err, elen)
        || get_u64(p, "block_stride", &l->block_stride, 0, 1ULL << 40, err,
                   elen)
        || get_u64(p, "region_stride", &l->region_stride, 0, 1ULL << 44,
                   err, elen)
        || get_u64(p, "layer_stride", &l->layer_stride, 0, 1ULL << 44, err,
                   elen)
        || get_str(p, "memory", mem, sizeof(mem), 0, err, elen))
    {
        return -1;
    }
    /* one pool per tensor-parallel rank, each the same geometry (the
     * rank's shard: its KV heads) */
    v = 1;
    if (get_u64(p, "ranks", &v, 1, KV_MAX_RANKS, err, elen)) return -1;
    c->ranks = (int) v;
    if (strcmp(mem, "host") == 0) {
        c->cuda_dev = -1;
    } else if (strcmp(mem, "cuda") == 0) {
        c->cuda_dev = 0;                 /* rank r on cuda:r */
        c->cuda_per_rank = 1;
    } else if (strncmp(mem, "cuda:", 5) == 0) {
        errno = 0;
        c->cuda_dev = (int) strtol(mem + 5, &end, 10);
        if (errno || *end || end == mem + 5 || c->cuda_dev < 0) {
            snprintf(err, elen, "pool.memory: \"%s\" is not host or "
                     "cuda:<dev>", mem);
            return -1;
        }
    } else {
        snprintf(err, elen, "pool.memory: \"%s\" is not host or cuda:<dev>",
                 mem);
        return -1;
    }
    if (kv_layout_finish(l, err, elen)) {
        return -1;
    }
    c->has_pool = 1;
    return 0;
}


/*
 * The link's key(s): exactly one of "key" (hex), "keys" (one or two hex
 * strings, the first is the one we prove with) or "key_file" (a file of
 * one or two hex lines that others cannot read).
 */
static int
parse_peer_keys(kv_config_t *c, kv_peer_conf_t *p, cJSON *e, char *err,
    size_t elen)
{
    cJSON *k = cJSON_GetObjectItemCaseSensitive(e, "key");
    cJSON *ks = cJSON_GetObjectItemCaseSensitive(e, "keys");
    cJSON *kf = cJSON_GetObjectItemCaseSensitive(e, "key_file");
    cJSON *x;

    p->nkeys = 0;
    if ((k != NULL) + (ks != NULL) + (kf != NULL) != 1) {
        snprintf(err, elen, "peer %s: give exactly one of \"key\", \"keys\" "
                 "or \"key_file\" (the key this link shares with %s's own "
                 "configuration)", p->id, p->id);
        return -1;
    }
    if (kf) {
        if (!cJSON_IsString(kf) || kf->valuestring[0] == '\0') {
            snprintf(err, elen, "peer %s: \"key_file\" must be a path",
                     p->id);
            return -1;
        }
        return kv_auth_key_file(p, kf->valuestring, err, elen);
    }
    c->inline_keys = 1;
    if (k) {
        if (!cJSON_IsString(k)) {
            snprintf(err, elen, "peer %s: \"key\" must be a hex string",
                     p->id);
            return -1;
        }
        return kv_auth_key_hex(p, k->valuestring, "key", err, elen);
    }
    if (!cJSON_IsArray(ks) || cJSON_GetArraySize(ks) < 1) {
        snprintf(err, elen, "peer %s: \"keys\" must be an array of one or "
                 "two hex strings", p->id);
        return -1;
    }
    cJSON_ArrayForEach(x, ks) {
        if (!cJSON_IsString(x)) {
            snprintf(err, elen, "peer %s: \"keys\" must be an array of one "
                     "or two hex strings", p->id);
            return -1;
        }
        if (kv_auth_key_hex(p, x->valuestring, "keys", err, elen) != 0) {
            return -1;
        }
    }
    return 0;
}


/*
 * 1 (and which of b's keys in *k) when two links share a key: a key proves
 * a node's id only if no other node holds it, so one key for two peers
 * would let either claim to be the other.
 */
static int
shared_key(const kv_peer_conf_t *a, const kv_peer_conf_t *b, int *k)
{
    int i, j;

    for (i = 0; i < a->nkeys; i++) {
        for (j = 0; j < b->nkeys; j++) {
            if (a->keylen[i] == b->keylen[j]
                && memcmp(a->key[i], b->key[j], a->keylen[i]) == 0)
            {
                *k = j;
                return 1;
            }
        }
    }
    return 0;
}


static int
parse_peers(kv_config_t *c, cJSON *arr, char *err, size_t elen)
{
    static const char *const keys[] = {
        "id", "ctrl", "role", "http", "key", "keys", "key_file", NULL
    };
    kv_peer_conf_t *p;
    char role[32], host[KV_ADDR_LEN];
    cJSON *e;
    int port, i, k;

    if (!cJSON_IsArray(arr)) {
        snprintf(err, elen, "\"peers\" must be an array");
        return -1;
    }
    cJSON_ArrayForEach(e, arr) {
        if (c->npeers == KV_MAX_PEERS) {
            snprintf(err, elen, "at most %d peers", KV_MAX_PEERS);
            return -1;
        }
        if (!cJSON_IsObject(e) || only_keys(e, "peer", keys, err, elen)) {
            if (!err[0]) snprintf(err, elen, "peers[] must be objects");
            return -1;
        }
        p = &c->peers[c->npeers];
        strcpy(role, "decode");
        if (get_str(e, "id", p->id, sizeof(p->id), 1, err, elen)
            || get_str(e, "ctrl", p->ctrl, sizeof(p->ctrl), 1, err, elen)
            || get_str(e, "http", p->http, sizeof(p->http), 0, err, elen)
            || get_str(e, "role", role, sizeof(role), 0, err, elen))
        {
            return -1;
        }
        p->role = kv_role_parse(role);
        if (p->role == DPD_ROLE_UNKNOWN) {
            snprintf(err, elen, "peer %s: role \"%s\" is not prefill, decode "
                     "or router", p->id, role);
            return -1;
        }
        if (kv_parse_hostport(p->ctrl, host, sizeof(host), &port)) {
            snprintf(err, elen, "peer %s: ctrl \"%s\" is not host:port",
                     p->id, p->ctrl);
            return -1;
        }
        if (strcmp(p->id, c->node_id) == 0) {
            snprintf(err, elen, "peer id %s is this node's id", p->id);
            return -1;
        }
        if (parse_peer_keys(c, p, e, err, elen) != 0) {
            return -1;
        }
        for (i = 0; i < c->npeers; i++) {
            if (strcmp(c->peers[i].id, p->id) == 0) {
                snprintf(err, elen, "duplicate peer id %s", p->id);
                return -1;
            }
            if (shared_key(&c->peers[i], p, &k)) {
                snprintf(err, elen, "peers %s and %s share the key %s: each "
                         "link needs its own key (either node could claim to "
                         "be the other); see kv_agent/README.md, "
                         "\"Authentication\"", c->peers[i].id, p->id,
                         p->kid[k]);
                return -1;
            }
        }
        c->npeers++;
    }
    return 0;
}


int
kv_peer_id_safe(const char *id, size_t len)
{
    size_t i;

    if (len == 0 || len >= KV_ID_LEN || id[0] == '.' || id[0] == '-') {
        return 0;
    }
    for (i = 0; i < len; i++) {
        unsigned char ch = (unsigned char) id[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z')
              || (ch >= '0' && ch <= '9') || ch == '.' || ch == '_'
              || ch == '-'))
        {
            return 0;                  /* '/', NUL, controls, UTF-8 */
        }
        if (ch == '.' && i + 1 < len && id[i + 1] == '.') {
            return 0;
        }
    }
    return 1;
}


/* A DNS name (letters, digits, '-', '.'; 253 bytes) or a numeric
 * address: what a Service's name looks like.  Checked here so that a
 * typo is found by `check`, not by a resolver that fails forever. */
static int
dns_name_ok(const char *s)
{
    size_t n = strlen(s), i, label = 0;

    if (n == 0 || n > 253) {
        return 0;
    }
    if (strchr(s, ':') != NULL) {      /* IPv6 literal */
        for (i = 0; i < n; i++) {
            if (!isxdigit((unsigned char) s[i]) && s[i] != ':'
                && s[i] != '.')
            {
                return 0;
            }
        }
        return 1;
    }
    for (i = 0; i < n; i++) {
        unsigned char ch = (unsigned char) s[i];
        if (ch == '.') {
            if (label == 0 && i + 1 < n) {
                return 0;              /* empty label */
            }
            label = 0;
            continue;
        }
        if (!isalnum(ch) && ch != '-' && ch != '_') {
            return 0;
        }
        if (++label > 63) {
            return 0;
        }
    }
    return 1;
}


/*
 * "peers_dns": [{"name": "dpd-decode-hl.ns.svc.cluster.local",
 *                "port": 7100, "role": "decode",
 *                "key_file": "/etc/dpd/keys/${POD_NAME}+{peer}.key",
 *                "resolve_ms": 5000}]
 * The pattern must name the peer ("{peer}" exactly once, replaced by the
 * id the peer claims): one key for a whole pool would let any pod of it
 * claim any other's id.
 */
static int
parse_peers_dns(kv_config_t *c, cJSON *arr, char *err, size_t elen)
{
    static const char *const keys[] = {
        "name", "port", "role", "key_file", "resolve_ms", NULL
    };
    kv_dns_conf_t *d;
    char role[32], where[32];
    const char *t;
    uint64_t v;
    cJSON *e;
    int i;

    if (!cJSON_IsArray(arr)) {
        snprintf(err, elen, "\"peers_dns\" must be an array");
        return -1;
    }
    cJSON_ArrayForEach(e, arr) {
        snprintf(where, sizeof(where), "peers_dns[%d]", c->ndns);
        if (c->ndns == KV_DNS_MAX) {
            snprintf(err, elen, "peers_dns: at most %d names", KV_DNS_MAX);
            return -1;
        }
        if (!cJSON_IsObject(e)) {
            snprintf(err, elen, "%s must be an object", where);
            return -1;
        }
        if (only_keys(e, where, keys, err, elen)) {
            return -1;
        }
        d = &c->dns[c->ndns];
        role[0] = '\0';
        d->resolve_ms = 5000;
        if (get_str(e, "name", d->name, sizeof(d->name), 1, err, elen)
            || get_str(e, "role", role, sizeof(role), 1, err, elen)
            || get_str(e, "key_file", d->key_file, sizeof(d->key_file), 1,
                       err, elen)
            || get_int(e, "resolve_ms", &d->resolve_ms, 100, 3600000, err,
                       elen))
        {
            return -1;
        }
        if (cJSON_GetObjectItemCaseSensitive(e, "port") == NULL) {
            snprintf(err, elen, "%s: missing \"port\" (the pool's control "
                     "port)", where);
            return -1;
        }
        v = 0;
        if (get_u64(e, "port", &v, 1, 65535, err, elen)) {
            return -1;
        }
        d->port = (int) v;
        if (!dns_name_ok(d->name)) {
            snprintf(err, elen, "%s: name \"%s\" is not a DNS name or an "
                     "address", where, d->name);
            return -1;
        }
        d->role = kv_role_parse(role);
        if (d->role == DPD_ROLE_UNKNOWN) {
            snprintf(err, elen, "%s: role \"%s\" is not prefill, decode or "
                     "router", where, role);
            return -1;
        }
        t = strstr(d->key_file, KV_DNS_PEER_TOKEN);
        if (t == NULL || strstr(t + 1, KV_DNS_PEER_TOKEN) != NULL) {
            snprintf(err, elen, "%s: key_file \"%s\" must contain \"%s\" "
                     "exactly once (the id each peer claims: one key per "
                     "link, never one for the pool)", where, d->key_file,
                     KV_DNS_PEER_TOKEN);
            return -1;
        }
        if (d->key_file[0] != '/') {
            snprintf(err, elen, "%s: key_file \"%s\" must be an absolute "
                     "path", where, d->key_file);
            return -1;
        }
        if (strlen(d->key_file) - strlen(KV_DNS_PEER_TOKEN) + KV_ID_LEN
            >= KV_PATH_LEN)
        {
            snprintf(err, elen, "%s: key_file pattern is too long (a path "
                     "with the longest id must stay under %d bytes)", where,
                     KV_PATH_LEN);
            return -1;
        }
        for (i = 0; i < c->ndns; i++) {
            if (strcmp(c->dns[i].name, d->name) == 0
                && c->dns[i].port == d->port)
            {
                snprintf(err, elen, "%s: %s port %d is already in "
                         "peers_dns[%d]", where, d->name, d->port, i);
                return -1;
            }
        }
        c->ndns++;
    }
    return 0;
}


/* transfer.staging: "auto" (GPU pools without FI_HMEM), "off", or
 * "host" (every pool through the ring with the host copy engine: tests,
 * benchmarks); stage_chunk bytes per slot, stage_slots slots per rank. */
static int
parse_staging(kv_config_t *c, cJSON *o, char *err, size_t elen)
{
    char mode[16] = "auto";
    uint64_t v;

    if (get_str(o, "staging", mode, sizeof(mode), 0, err, elen)) {
        return -1;
    }
    if (strcmp(mode, "auto") == 0) {
        c->staging = KV_STAGE_AUTO;
    } else if (strcmp(mode, "off") == 0) {
        c->staging = KV_STAGE_OFF;
    } else if (strcmp(mode, "host") == 0) {
        c->staging = KV_STAGE_HOST_TEST;
    } else {
        snprintf(err, elen, "transfer.staging: \"%s\" is not auto, off or "
                 "host", mode);
        return -1;
    }
    if (get_u64(o, "stage_chunk", &c->stage_chunk, 4096, 1ULL << 30, err,
                elen))
    {
        return -1;
    }
    v = c->stage_slots;
    if (get_u64(o, "stage_slots", &v, 1, 1024, err, elen)) {
        return -1;
    }
    c->stage_slots = (uint32_t) v;
    /* a staged receiver's landing ring (ring.c) */
    if (get_u64(o, "recv_chunk", &c->recv_chunk, 4096, 1ULL << 30, err,
                elen))
    {
        return -1;
    }
    v = c->recv_slots;
    if (get_u64(o, "recv_slots", &v, 1, KV_RING_MAX, err, elen)) {
        return -1;
    }
    c->recv_slots = (uint32_t) v;
    return 0;
}


static int
parse_rails(kv_config_t *c, cJSON *r, char *err, size_t elen)
{
    cJSON *e;

    if (cJSON_IsString(r) && strcmp(r->valuestring, "auto") == 0) {
        c->nrails = 0;
        return 0;
    }
    if (!cJSON_IsArray(r)) {
        snprintf(err, elen, "\"rails\" must be \"auto\" or an array of "
                 "domain names");
        return -1;
    }
    cJSON_ArrayForEach(e, r) {
        if (!cJSON_IsString(e) || strlen(e->valuestring) >= 64
            || c->nrails == KV_MAX_RAILS)
        {
            snprintf(err, elen, "\"rails\": at most %d names of < 64 bytes",
                     KV_MAX_RAILS);
            return -1;
        }
        strcpy(c->rails[c->nrails++], e->valuestring);
    }
    return 0;
}


/* An endpoint we connect to: tcp://host:port (host a name, an IPv4
 * address or [IPv6]) or ipc://path; never a wildcard, which is the
 * publisher's own (bind) side of the same setting. */
static int
evs_endpoint_ok(const char *ep)
{
    const char *h, *colon;
    char *end;
    long port;

    if (strncmp(ep, "ipc://", 6) == 0) {
        return ep[6] != '\0';
    }
    if (strncmp(ep, "tcp://", 6) != 0) {
        return 0;
    }
    h = ep + 6;
    colon = strrchr(h, ':');
    if (colon == NULL || colon == h || strchr(h, '*') != NULL
        || strncmp(h, "0.0.0.0:", 8) == 0 || strncmp(h, "[::]:", 5) == 0)
    {
        return 0;
    }
    errno = 0;
    port = strtol(colon + 1, &end, 10);
    return errno == 0 && *end == '\0' && end != colon + 1 && port > 0
           && port < 65536;
}


/* A name to resolve: letters, digits, '-', '_' and '.' (a host name, a
 * Service's DNS name) or a numeric address; nothing a log line or the
 * resolver could take for something else. */
static int
evs_dns_name_ok(const char *n)
{
    size_t len = strlen(n), i;

    if (len == 0 || len > 253 || n[0] == '.' || n[0] == '-') {
        return 0;
    }
    for (i = 0; i < len; i++) {
        if (!((n[i] >= 'a' && n[i] <= 'z') || (n[i] >= 'A' && n[i] <= 'Z')
              || (n[i] >= '0' && n[i] <= '9') || n[i] == '-' || n[i] == '_'
              || n[i] == '.' || n[i] == ':'))
        {
            return 0;
        }
    }
    return strstr(n, "..") == NULL;
}


/* {"dns", "port", "replay_port", "http_port", "family", "resolve_ms",
 * "topic", "model", "replay_timeout_ms"}: every address of the name is a
 * source (kv_events_dns.c) */
static int
parse_kv_events_dns(kv_config_t *c, cJSON *e, const char *where, char *err,
    size_t elen)
{
    static const char *const keys[] = {
        "dns", "port", "replay_port", "http_port", "family", "resolve_ms",
        "topic", "model", "replay_timeout_ms", NULL
    };
    static const char *const fixed[] = { "node", "http", "endpoint",
                                         "replay", NULL };
    kv_evs_dns_conf_t *d;
    char fam[16];
    int i;

    for (i = 0; fixed[i]; i++) {
        if (cJSON_GetObjectItemCaseSensitive(e, fixed[i]) != NULL) {
            snprintf(err, elen, "%s: \"dns\" and \"%s\" exclude each "
                     "other (a DNS source's nodes, \"http\" and endpoints "
                     "are its addresses with \"http_port\", \"port\" and "
                     "\"replay_port\")", where, fixed[i]);
            return -1;
        }
    }
    d = &c->evs.dns[c->evs.ndns];
    memset(d, 0, sizeof(*d));
    d->replay_timeout_ms = 2000;
    d->resolve_ms = 5000;
    d->family = AF_UNSPEC;
    snprintf(fam, sizeof(fam), "any");
    if (only_keys(e, where, keys, err, elen)
        || get_str(e, "dns", d->name, sizeof(d->name), 1, err, elen)
        || get_int(e, "port", &d->port, 1, 65535, err, elen)
        || get_int(e, "replay_port", &d->replay_port, 1, 65535, err, elen)
        || get_int(e, "http_port", &d->http_port, 1, 65535, err, elen)
        || get_str(e, "family", fam, sizeof(fam), 0, err, elen)
        || get_int(e, "resolve_ms", &d->resolve_ms, 100, 3600000, err,
                   elen)
        || get_str(e, "topic", d->topic, sizeof(d->topic), 0, err, elen)
        || get_str(e, "model", d->model, sizeof(d->model), 0, err, elen)
        || get_int(e, "replay_timeout_ms", &d->replay_timeout_ms, 10,
                   600000, err, elen))
    {
        return -1;
    }
    if (!evs_dns_name_ok(d->name)) {
        snprintf(err, elen, "%s: \"dns\" must be a host name (letters, "
                 "digits, '-', '_', '.'; 253 bytes at most) or an address",
                 where);
        return -1;
    }
    if (d->port == 0 || d->http_port == 0) {
        snprintf(err, elen, "%s: a \"dns\" source needs \"port\" (the "
                 "engines' KV-event publisher) and \"http_port\" (their "
                 "vLLM, as nginx's upstream names each address)", where);
        return -1;
    }
    if (d->replay_port == d->port) {
        snprintf(err, elen, "%s: \"replay_port\" is \"port\"", where);
        return -1;
    }
    if (strcmp(fam, "any") == 0) {
        d->family = AF_UNSPEC;
    } else if (strcmp(fam, "ipv4") == 0) {
        d->family = AF_INET;
    } else if (strcmp(fam, "ipv6") == 0) {
        d->family = AF_INET6;
    } else {
        snprintf(err, elen, "%s: \"family\" must be \"any\", \"ipv4\" or "
                 "\"ipv6\"", where);
        return -1;
    }
    for (i = 0; i < c->evs.ndns; i++) {
        if (strcasecmp(c->evs.dns[i].name, d->name) == 0
            && c->evs.dns[i].port == d->port)
        {
            snprintf(err, elen, "kv_events: \"dns\" %s port %d given twice",
                     d->name, d->port);
            return -1;
        }
    }
    c->evs.ndns++;
    return 0;
}


/* "kv_events": [{"node", "http", "endpoint", "replay", "topic",
 * "replay_timeout_ms"} or {"dns", ...}, ...] (kv_events_sub.c,
 * kv_events_dns.c) */
static int
parse_kv_events(kv_config_t *c, cJSON *arr, char *err, size_t elen)
{
    static const char *const keys[] = {
        "node", "http", "endpoint", "replay", "topic", "model",
        "replay_timeout_ms", NULL
    };
    kv_evs_src_conf_t *s;
    cJSON *e;
    char where[64 + KV_ID_LEN];
    int i, n = 0, k = 0;

    if (!cJSON_IsArray(arr)) {
        snprintf(err, elen, "\"kv_events\" must be a list of sources "
                 "({\"node\", \"http\", \"endpoint\", ...} or {\"dns\", "
                 "\"port\", \"http_port\", ...})");
        return -1;
    }
    if (c->role != DPD_ROLE_ROUTER) {
        snprintf(err, elen, "\"kv_events\" is for the router's agent (the "
                 "one whose state nginx reads), not a %s node",
                 dpd_state_role_name(c->role));
        return -1;
    }
    if (cJSON_GetArraySize(arr) > KV_EVS_MAX_SOURCES) {
        snprintf(err, elen, "\"kv_events\": at most %d sources",
                 KV_EVS_MAX_SOURCES);
        return -1;
    }
    c->evs.ndns = 0;
    cJSON_ArrayForEach(e, arr) {
        snprintf(where, sizeof(where), "kv_events[%d]", k++);
        if (!cJSON_IsObject(e)) {
            snprintf(err, elen, "%s must be an object", where);
            return -1;
        }
        if (cJSON_GetObjectItemCaseSensitive(e, "dns") != NULL) {
            if (parse_kv_events_dns(c, e, where, err, elen) != 0) {
                size_t l = strlen(err);
                if (strstr(err, where) == NULL && l + 1 < elen) {
                    snprintf(err + l, elen - l, " (%s)", where);
                }
                return -1;
            }
            continue;
        }
        s = &c->evs.src[n];
        memset(s, 0, sizeof(*s));
        s->replay_timeout_ms = 2000;
        if (only_keys(e, where, keys, err, elen)
            || get_str(e, "node", s->node, sizeof(s->node), 1, err, elen)
            || get_str(e, "http", s->http, sizeof(s->http), 1, err, elen)
            || get_str(e, "endpoint", s->endpoint, sizeof(s->endpoint), 1,
                       err, elen)
            || get_str(e, "replay", s->replay, sizeof(s->replay), 0, err,
                       elen)
            || get_str(e, "topic", s->topic, sizeof(s->topic), 0, err, elen)
            || get_str(e, "model", s->model, sizeof(s->model), 0, err, elen)
            || get_int(e, "replay_timeout_ms", &s->replay_timeout_ms, 10,
                       600000, err, elen))
        {
            size_t l = strlen(err);
            if (strstr(err, where) == NULL && l + 1 < elen) {
                snprintf(err + l, elen - l, " (%s)", where);
            }
            return -1;
        }
        if (s->node[0] == '\0') {
            snprintf(err, elen, "%s: \"node\" must not be empty", where);
            return -1;
        }
        if (strchr(s->http, ':') == NULL || strstr(s->http, "://")) {
            snprintf(err, elen, "kv_events %s: \"http\" must be the "
                     "engine's \"host:port\" as nginx's upstream names it",
                     s->node);
            return -1;
        }
        if (!evs_endpoint_ok(s->endpoint)) {
            snprintf(err, elen, "kv_events %s: \"endpoint\" must be "
                     "tcp://host:port of the engine's publisher (the agent "
                     "connects: not tcp://*:port) or ipc://path",
                     s->node);
            return -1;
        }
        if (s->replay[0] && !evs_endpoint_ok(s->replay)) {
            snprintf(err, elen, "kv_events %s: \"replay\" must be "
                     "tcp://host:port of the engine's replay_endpoint or "
                     "ipc://path", s->node);
            return -1;
        }
        for (i = 0; i < n; i++) {
            /* a node twice is a data-parallel engine: one publisher per
             * rank (vLLM shifts the port by the rank), one http */
            if (strcmp(c->evs.src[i].node, s->node) == 0
                && (strcmp(c->evs.src[i].http, s->http) != 0
                    || strcmp(c->evs.src[i].model, s->model) != 0))
            {
                snprintf(err, elen, "kv_events: node \"%s\" given twice "
                         "with different \"http\" or \"model\"",
                         s->node);
                return -1;
            }
            if (strcmp(c->evs.src[i].endpoint, s->endpoint) == 0) {
                snprintf(err, elen, "kv_events: endpoint %s given twice "
                         "(%s and %s)", s->endpoint, c->evs.src[i].node,
                         s->node);
                return -1;
            }
        }
        n++;
    }
    c->evs.nsrc = n;
    return 0;
}


/* "prefix_index": {"path", "slots", "block", "map_entries"}: where the
 * router writes what the "kv_events" sources hold (prefix_index.c) */
static int
parse_prefix_index(kv_config_t *c, cJSON *o, char *err, size_t elen)
{
    static const char *const keys[] = {
        "path", "slots", "block", "map_entries", NULL
    };
    int             i;
    kv_pfx_conf_t  *p = &c->pfx;

    if (!cJSON_IsObject(o)) {
        snprintf(err, elen, "\"prefix_index\" must be an object "
                 "({\"path\", \"slots\", \"block\", \"map_entries\"})");
        return -1;
    }
    if (c->evs.nsrc == 0 && c->evs.ndns == 0) {
        snprintf(err, elen, "\"prefix_index\" needs \"kv_events\" sources "
                 "(the index holds what their engines cache)");
        return -1;
    }
    snprintf(p->path, sizeof(p->path), "%s", DPD_PFX_DEFAULT_PATH);
    p->slots = UINT64_C(1) << 20;
    p->map_entries = 0;
    p->block = DPD_PREFIX_DEFAULT_BLOCK;
    if (only_keys(o, "prefix_index", keys, err, elen)
        || get_str(o, "path", p->path, sizeof(p->path), 0, err, elen)
        || get_u64(o, "slots", &p->slots, 1024, UINT64_C(1) << 28, err,
                   elen)
        || get_int(o, "block", &p->block, 1, DPD_PREFIX_MAX_BLOCK, err, elen)
        || get_u64(o, "map_entries", &p->map_entries, 0,
                   UINT64_C(1) << 28, err, elen))
    {
        return -1;
    }
    if ((p->slots & (p->slots - 1)) != 0) {
        snprintf(err, elen, "\"prefix_index\": \"slots\" must be a power "
                 "of two (%llu is not)", (unsigned long long) p->slots);
        return -1;
    }
    if (p->path[0] != '/') {
        snprintf(err, elen, "\"prefix_index\": \"path\" must be absolute");
        return -1;
    }
    if (strcmp(p->path, c->state_path) == 0) {
        snprintf(err, elen, "\"prefix_index\": \"path\" is the state "
                 "table's");
        return -1;
    }
    for (i = 0; i < c->evs.nsrc; i++) {
        if (c->evs.src[i].model[0] == '\0') {
            snprintf(err, elen, "kv_events %s: \"model\" is needed with "
                     "\"prefix_index\" (the name requests use for the "
                     "model: it seeds the block keys as nginx does)",
                     c->evs.src[i].node);
            return -1;
        }
    }
    for (i = 0; i < c->evs.ndns; i++) {
        if (c->evs.dns[i].model[0] == '\0') {
            snprintf(err, elen, "kv_events \"dns\" %s: \"model\" is needed "
                     "with \"prefix_index\" (the name requests use for the "
                     "model: it seeds the block keys as nginx does)",
                     c->evs.dns[i].name);
            return -1;
        }
    }
    if (p->map_entries == 0) {
        p->map_entries = p->slots / 2;  /* the slots' load bound */
    }
    return 0;
}


static int
parse_root(kv_config_t *c, cJSON *root, char *err, size_t elen)
{
    static const char *const keys[] = {
        "node_id", "role", "http", "provider", "allow_fallback", "rails",
        "listen", "token", "peers", "api_socket", "state_path", "state",
        "pool", "timeouts", "transfer", "api", "ctrl", "log_level",
        "lmcache_notify", "kv_events", "prefix_index", "peers_dns", NULL
    };
    static const char *const ctrl_keys[] = {
        "hello_timeout_ms", "max_unauthenticated", "max_peer_connects",
        "peer_connect_window_ms", NULL
    };
    static const char *const st_keys[] = { "max_nodes", "max_reqs", NULL };
    static const char *const to_keys[] = {
        "heartbeat_ms", "dead_after_ms", "transfer_ms", "reconnect_ms",
        "retention_ms", "quarantine_ms", NULL
    };
    static const char *const tr_keys[] = {
        "window", "max_write", "coalesce", "staging", "stage_chunk",
        "stage_slots", "recv_chunk", "recv_slots", NULL
    };
    static const char *const api_keys[] = {
        "max_message", "max_clients", "debug_verbs", NULL
    };
    char role[32] = "", lvl[16] = "";
    cJSON *o;
    uint64_t v;
    char host[KV_ADDR_LEN];
    int port;

    if (!cJSON_IsObject(root)) {
        snprintf(err, elen, "top level must be an object");
        return -1;
    }
    if (only_keys(root, "config", keys, err, elen)
        || get_str(root, "node_id", c->node_id, sizeof(c->node_id), 1, err,
                   elen)
        || get_str(root, "role", role, sizeof(role), 1, err, elen)
        || get_str(root, "http", c->http, sizeof(c->http), 0, err, elen)
        || get_str(root, "provider", c->provider, sizeof(c->provider), 0,
                   err, elen)
        || get_bool(root, "allow_fallback", &c->allow_fallback, err, elen)
        || get_str(root, "listen", c->listen, sizeof(c->listen), 1, err,
                   elen)
        || get_str(root, "api_socket", c->api_socket, sizeof(c->api_socket),
                   0, err, elen)
        || get_str(root, "state_path", c->state_path, sizeof(c->state_path),
                   0, err, elen)
        || get_str(root, "log_level", lvl, sizeof(lvl), 0, err, elen))
    {
        return -1;
    }
    if (c->node_id[0] == '\0') {
        snprintf(err, elen, "\"node_id\" must not be empty");
        return -1;
    }
    o = cJSON_GetObjectItemCaseSensitive(root, "lmcache_notify");
    if (o && kv_lmc_config(&c->lmc, o, err, elen) != 0) {
        return -1;
    }
    c->role = kv_role_parse(role);
    if (c->role == DPD_ROLE_UNKNOWN) {
        snprintf(err, elen, "role \"%s\" is not prefill, decode or router",
                 role);
        return -1;
    }
    o = cJSON_GetObjectItemCaseSensitive(root, "kv_events");
    if (o && parse_kv_events(c, o, err, elen) != 0) {
        return -1;
    }
    o = cJSON_GetObjectItemCaseSensitive(root, "prefix_index");
    if (o && parse_prefix_index(c, o, err, elen) != 0) {
        return -1;
    }
    if (cJSON_GetObjectItemCaseSensitive(root, "token") != NULL) {
        snprintf(err, elen, "\"token\" (one plaintext secret sent in every "
                 "hello) is no longer supported: remove it and give each "
                 "entry of \"peers\" the key of that link as \"key_file\" "
                 "(or \"key\"), the same on both ends; see kv_agent/README.md, "
                 "\"Authentication\"");
        return -1;
    }
    if (kv_parse_hostport(c->listen, host, sizeof(host), &port)) {
        snprintf(err, elen, "\"listen\": \"%s\" is not host:port", c->listen);
        return -1;
    }
    if (lvl[0]) {
        if (strcmp(lvl, "error") == 0) c->log_level = KV_LOG_ERR;
        else if (strcmp(lvl, "warn") == 0) c->log_level = KV_LOG_WARN;
        else if (strcmp(lvl, "info") == 0) c->log_level = KV_LOG_INFO;
        else if (strcmp(lvl, "debug") == 0) c->log_level = KV_LOG_DEBUG;
        else {
            snprintf(err, elen, "log_level: error, warn, info or debug");
            return -1;
        }
    }
    if ((o = cJSON_GetObjectItemCaseSensitive(root, "rails"))
        && parse_rails(c, o, err, elen))
    {
        return -1;
    }
    if ((o = cJSON_GetObjectItemCaseSensitive(root, "peers"))
        && parse_peers(c, o, err, elen))
    {
        return -1;
    }
    if ((o = cJSON_GetObjectItemCaseSensitive(root, "peers_dns"))
        && parse_peers_dns(c, o, err, elen))
    {
        return -1;
    }
    if ((o = cJSON_GetObjectItemCaseSensitive(root, "pool"))
        && parse_pool(c, o, err, elen))
    {
        return -1;
    }
    if ((o = cJSON_GetObjectItemCaseSensitive(root, "state"))) {
        if (only_keys(o, "state", st_keys, err, elen)) return -1;
        v = c->max_nodes;
        if (get_u64(o, "max_nodes", &v, 1, 4096, err, elen)) return -1;
        c->max_nodes = (uint32_t) v;
        v = c->max_reqs;
        if (get_u64(o, "max_reqs", &v, 16, 1u << 20, err, elen)) return -1;
        c->max_reqs = (uint32_t) v;
    }
    if ((o = cJSON_GetObjectItemCaseSensitive(root, "timeouts"))) {
        if (only_keys(o, "timeouts", to_keys, err, elen)
            || get_int(o, "heartbeat_ms", &c->heartbeat_ms, 10, 60000, err,
                       elen)
            || get_int(o, "dead_after_ms", &c->dead_after_ms, 20, 600000,
                       err, elen)
            || get_int(o, "transfer_ms", &c->transfer_timeout_ms, 10,
                       3600000, err, elen)
            || get_int(o, "reconnect_ms", &c->reconnect_ms, 10, 600000, err,
                       elen)
            || get_int(o, "retention_ms", &c->retention_ms, 0, 86400000,
                       err, elen)
            || get_int(o, "quarantine_ms", &c->quarantine_ms, 10, 3600000,
                       err, elen))
        {
            return -1;
        }
    }
    if ((o = cJSON_GetObjectItemCaseSensitive(root, "transfer"))) {
        v = c->window;
        if (only_keys(o, "transfer", tr_keys, err, elen)
            || get_u64(o, "window", &v, 1, 4096, err, elen)
            || get_u64(o, "max_write", &c->max_write, 4096, 1ULL << 32, err,
                       elen)
            || get_bool(o, "coalesce", &c->coalesce, err, elen)
            || parse_staging(c, o, err, elen))
        {
            return -1;
        }
        c->window = (uint32_t) v;
    }
    if ((o = cJSON_GetObjectItemCaseSensitive(root, "api"))) {
        v = c->max_msg;
        if (only_keys(o, "api", api_keys, err, elen)
            || get_u64(o, "max_message", &v, 1024, 64u << 20, err, elen)
            || get_int(o, "max_clients", &c->max_clients, 1, 4096, err, elen)
            || get_bool(o, "debug_verbs", &c->debug_verbs, err, elen))
        {
            return -1;
        }
        c->max_msg = (uint32_t) v;
    }
    if ((o = cJSON_GetObjectItemCaseSensitive(root, "ctrl"))) {
        if (only_keys(o, "ctrl", ctrl_keys, err, elen)
            || get_int(o, "hello_timeout_ms", &c->hello_timeout_ms, 50,
                       60000, err, elen)
            || get_int(o, "max_unauthenticated", &c->max_unauth, 1, 4096,
                       err, elen)
            || get_int(o, "max_peer_connects", &c->max_peer_connects, 1, 64,
                       err, elen)
            || get_int(o, "peer_connect_window_ms",
                       &c->peer_connect_window_ms, 0, 3600000, err, elen))
        {
            return -1;
        }
    }
    if (c->role != DPD_ROLE_ROUTER && !c->has_pool) {
        snprintf(err, elen, "a %s node needs a \"pool\"", role);
        return -1;
    }
    if (c->dead_after_ms <= c->heartbeat_ms) {
        snprintf(err, elen, "dead_after_ms must exceed heartbeat_ms");
        return -1;
    }
    return 0;
}


static void
defaults(kv_config_t *c)
{
    memset(c, 0, sizeof(*c));
    strcpy(c->provider, "tcp;ofi_rxm");
    strcpy(c->state_path, DPD_STATE_DEFAULT_PATH);
    c->cuda_dev = -1;
    c->max_nodes = 64;
    c->max_reqs = 4096;
    c->heartbeat_ms = 500;
    c->dead_after_ms = 2000;
    c->transfer_timeout_ms = 30000;
    c->reconnect_ms = 500;
    c->retention_ms = 600000;
    c->quarantine_ms = 10000;
    c->window = 64;
    c->max_write = 4u << 20;
    c->coalesce = 1;
    c->ranks = 1;
    c->stage_chunk = 4u << 20;
    c->stage_slots = 8;
    c->recv_chunk = 4u << 20;
    c->recv_slots = 8;
    c->max_msg = KV_MSG_MAX_DEF;
    c->max_clients = 256;
    c->hello_timeout_ms = 1000;
    c->max_unauth = 64;
    c->max_peer_connects = 10;
    c->peer_connect_window_ms = 10000;
    c->log_level = KV_LOG_INFO;
}


/*
 * A "\u0000" escape inside a JSON string: cJSON ends the C string there,
 * so "a\u0000b" would be read as "a" and the rest dropped without a word.
 * Returns its byte offset, or -1.  Outside strings, and "\\u0000" (an
 * escaped backslash), are not one.
 */
static long
json_nul_escape(const char *p, size_t n)
{
    size_t i;
    int in = 0;

    for (i = 0; i < n; i++) {
        if (!in) {
            in = p[i] == '"';
        } else if (p[i] == '"') {
            in = 0;
        } else if (p[i] == '\\' && i + 1 < n) {
            if (p[i + 1] == 'u' && i + 5 < n
                && memcmp(p + i + 2, "0000", 4) == 0)
            {
                return (long) i;
            }
            i++;                       /* the escaped character */
        }
    }
    return -1;
}


int
kv_config_load(kv_config_t *c, const char *path, char *err, size_t elen)
{
    struct stat sb;
    FILE *f;
    char *buf;
    long n;
    cJSON *root;
    int rc, used;

    defaults(c);
    err[0] = '\0';
    f = fopen(path, "rb");
    if (f == NULL) {
        snprintf(err, elen, "%s: %s", path, strerror(errno));
        return -1;
    }
    if (fseek(f, 0, SEEK_END) || (n = ftell(f)) < 0 || n > (1 << 20)
        || fseek(f, 0, SEEK_SET))
    {
        fclose(f);
        snprintf(err, elen, "%s: unreadable or larger than 1 MiB", path);
        return -1;
    }
    buf = malloc(n + 1);
    if (buf == NULL || fread(buf, 1, n, f) != (size_t) n) {
        free(buf);
        fclose(f);
        snprintf(err, elen, "%s: read failed", path);
        return -1;
    }
    fclose(f);
    buf[n] = '\0';
    if (json_nul_escape(buf, (size_t) n) >= 0) {
        snprintf(err, elen, "%s: a NUL character (\\u0000) in a string "
                 "near byte %ld: no value may hold one", path,
                 json_nul_escape(buf, (size_t) n));
        free(buf);
        return -1;
    }
    root = cJSON_ParseWithLength(buf, n);
    if (root == NULL) {
        const char *at = cJSON_GetErrorPtr();
        snprintf(err, elen, "%s: invalid JSON near byte %ld", path,
                 at ? (long) (at - buf) : 0L);
        free(buf);
        return -1;
    }
    /* ${VAR} from the pod's environment (config_env.c) before any key
     * reads a value, so each is validated as its literal would be */
    rc = kv_config_expand(root, &used, err, elen);
    if (rc == 0) {
        rc = parse_root(c, root, err, elen);
    }
    cJSON_Delete(root);
    explicit_bzero(buf, n);
    free(buf);
    /* keys that came from the environment are not in the file */
    if (rc == 0 && c->inline_keys && (used & KV_ENV_LITERAL_SECRET)
        && stat(path, &sb) == 0
        && (sb.st_mode & S_IROTH))
    {
        kv_warn("config: %s holds keys and is readable by every user "
                "(mode %04o): chmod 600 it, or move the keys to key_file",
                path, (unsigned) (sb.st_mode & 07777));
    }
    if (rc) {
        char tmp[512];
        snprintf(tmp, sizeof(tmp), "%s: %s", path, err);
        snprintf(err, elen, "%s", tmp);
    }
    return rc;
}
