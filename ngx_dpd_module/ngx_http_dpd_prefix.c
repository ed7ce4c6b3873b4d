/*
 * dpd_prefix_cache (see ngx_http_dpd_prefix.h and docs/dpd.md).
 *
 * Approximate mode: a shared zone all workers update as they route
 * (limit_req's pattern: ngx_slab_pool_t, ngx_shmtx, LRU queues).  One
 * entry per (block key, node): a hash table of keys (a bucket array sized
 * from the zone at its creation; lookups are O(1), an rbtree would cost
 * ~20 dependent loads per block, 2k blocks for a 32k-token chat) and one
 * LRU queue per node.  A routed request's keys are remembered against the
 * decoder it was pinned to, from the last block to the first, so that a
 * prompt's block 0 is its freshest entry and memory pressure cuts prompts
 * from their tails (vLLM evicts the same way).  Entries older than ttl
 * count as absent and are reclaimed from the tails; an allocation failure
 * evicts the node's own oldest entries, then the fullest node's, then
 * gives up the rest of the prompt (never an error for the request).
 * Nodes are the decoders by their upstream name ("10.0.0.7:8000"); a
 * node whose peer left the upstream or is marked down loses its entries.
 *
 * Events mode: the file the router-role kv_agent writes
 * (kv_agent/include/dpd_prefix_index.h), read with pread() into private
 * copies, never mapped, seqlock per record; a missing, shrunk, torn or
 * foreign file, one of another ABI version, or one whose writer exited
 * or has not beaten its heartbeat for stale= (a killed agent: its file
 * no longer follows the engines) means "nothing cached" (a warning when
 * that changes, a notice when it is usable again).
 *
 * Lookup: for each candidate decoder, the number of leading blocks of the
 * prompt it holds.  Approximate: a walk from block 0 that stops when no
 * candidate holds the block.  Events: a binary search per node over the
 * prompt (the index's prefix closure, see dpd_prefix_index.h): ~log2(n)
 * probes of two pread()s each.
 */


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "ngx_http_dpd_module.h"
#include "ngx_http_dpd_balancer.h"
#include "dpd_prefix.h"
#include "dpd_prefix_index.h"


#define NGX_HTTP_DPD_PREFIX_MAX_NODES     64
#define NGX_HTTP_DPD_PREFIX_MAX_CANDS     64
#define NGX_HTTP_DPD_PREFIX_DEFAULT_SIZE  (16 * 1024 * 1024)
#define NGX_HTTP_DPD_PREFIX_MIN_SIZE      (256 * 1024)
#define NGX_HTTP_DPD_PREFIX_EXPIRE_STEP   64      /* entries per reclaim */
#define NGX_HTTP_DPD_PREFIX_EVICT_STEP    64      /* entries per eviction */
#define NGX_HTTP_DPD_PREFIX_CHECK         1000    /* ms between file stat */
#define NGX_HTTP_DPD_PREFIX_WARN_EVERY    60      /* seconds */
#define NGX_HTTP_DPD_PREFIX_PROBE_CHUNK   4       /* slots per pread */
#define NGX_HTTP_DPD_PREFIX_MEMO          160     /* probed blocks kept */
#define NGX_HTTP_DPD_PREFIX_LOCK_STEP     2048    /* keys per mutex hold */
#define NGX_HTTP_DPD_PREFIX_STALE         5000    /* ms without heartbeat */
#define NGX_HTTP_DPD_PREFIX_MIN_STALE     2000    /* the writer beats each
                                                     second, we look each
                                                     second */


typedef struct ngx_http_dpd_prefix_entry_s  ngx_http_dpd_prefix_entry_t;

struct ngx_http_dpd_prefix_entry_s {
    ngx_queue_t                      queue;      /* its node's LRU */
    ngx_http_dpd_prefix_entry_t     *next;       /* bucket chain */
    uint64_t                         key;
    ngx_msec_t                       time;       /* last remembered */
    ngx_uint_t                       node;
};


typedef struct {
    ngx_queue_t                      lru;        /* head: newest */
    ngx_uint_t                       count;
    ngx_uint_t                       used;       /* unsigned:1 */
    uint64_t                         pool;       /* upstream name hash */
    size_t                           len;
    u_char                           name[NGX_HTTP_DPD_CAND_NAME_LEN];
} ngx_http_dpd_prefix_node_t;


typedef struct {
    ngx_http_dpd_prefix_node_t       nodes[NGX_HTTP_DPD_PREFIX_MAX_NODES];
    ngx_http_dpd_prefix_entry_t    **buckets;
    ngx_uint_t                       mask;       /* buckets - 1 */
    uint64_t                         seed;       /* secret, per zone */
    ngx_uint_t                       entries;
    ngx_uint_t                       failed;     /* prompts cut short */
} ngx_http_dpd_prefix_sh_t;


typedef struct {
    ngx_http_dpd_prefix_sh_t        *sh;
    ngx_slab_pool_t                 *shpool;
} ngx_http_dpd_prefix_zone_t;


/*
 * The bucket of a key.  The key function is public (dpd_prefix.h) and a
 * prompt may be token ids, so a client can choose blocks whose keys share
 * any bits it likes; buckets taken from the key's own bits would let it
 * pile a prompt into one chain and make every insert and lookup walk it
 * under the zone mutex (quadratic, all workers waiting).  A secret seed
 * drawn when the zone is made, through the avalanche, leaves nothing to
 * aim at.
 */
#define ngx_http_dpd_prefix_bucket(sh, key)                                   \
    (&(sh)->buckets[dpd_prefix_fmix((key) ^ (sh)->seed) & (sh)->mask])


struct ngx_http_dpd_prefix_reader_s {
    ngx_str_t                        path;       /* NUL-terminated */
    ngx_msec_t                       stale;      /* stale= */

    /* per worker */
    ngx_fd_t                         fd;         /* NGX_INVALID_FILE */
    dev_t                            dev;
    ino_t                            ino;
    ngx_uint_t                       valid;      /* hdr, nodes usable */
    ngx_uint_t                       dead;       /* writer gone, or its
                                                    heartbeat too old */
    ngx_msec_t                       checked;
    ngx_uint_t                       ever;       /* checked once */
    dpd_pfx_header_t                 hdr;
    uint64_t                         ready;      /* READY node bits */
    u_char                           addr[DPD_PFX_MAX_NODES]
                                         [DPD_PFX_ADDR_LEN];
    size_t                           addr_len[DPD_PFX_MAX_NODES];
    time_t                           last_warn;
    u_char                           reason[160];
    size_t                           reason_len;
};


static char *ngx_http_dpd_prefix_merge_prefill(ngx_conf_t *cf,
    ngx_http_dpd_prefix_conf_t *conf);
static ngx_int_t ngx_http_dpd_prefix_init_zone(ngx_shm_zone_t *shm_zone,
    void *data);
static ngx_int_t ngx_http_dpd_prefix_score(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefix_conf_t *pc,
    ngx_http_upstream_srv_conf_t *us, ngx_http_dpd_balancer_cand_t **candp,
    size_t *blocks, uint64_t *pool, ngx_uint_t *imbalanced);
static ngx_int_t ngx_http_dpd_prefix_node(ngx_http_dpd_prefix_sh_t *sh,
    ngx_str_t *name, uint64_t pool, ngx_uint_t create);
static void ngx_http_dpd_prefix_free_entry(ngx_http_dpd_prefix_zone_t *z,
    ngx_http_dpd_prefix_entry_t *e);
static void ngx_http_dpd_prefix_drop_node(ngx_http_dpd_prefix_zone_t *z,
    ngx_uint_t n);
static ngx_uint_t ngx_http_dpd_prefix_evict(ngx_http_dpd_prefix_zone_t *z,
    ngx_uint_t n, ngx_uint_t max, ngx_msec_t older);
static void ngx_http_dpd_prefix_sweep(ngx_http_dpd_prefix_zone_t *z,
    ngx_http_dpd_balancer_cand_t *cand, ngx_uint_t ncand, uint64_t pool);
static void ngx_http_dpd_prefix_zone_lookup(ngx_http_dpd_prefix_conf_t *pc,
    ngx_http_dpd_balancer_cand_t *cand, ngx_uint_t ncand, uint64_t pool,
    uint64_t *keys, size_t nkeys, size_t *blocks);
static void ngx_http_dpd_prefix_zone_insert(ngx_http_dpd_prefix_conf_t *pc,
    ngx_str_t *name, uint64_t pool, uint64_t *keys, size_t nkeys,
    ngx_log_t *log);
static ngx_int_t ngx_http_dpd_prefix_events_lookup(
    ngx_http_dpd_prefix_reader_t *rd, ngx_http_dpd_balancer_cand_t *cand,
    ngx_uint_t ncand, uint64_t *keys, size_t nkeys, size_t block,
    size_t *blocks, ngx_log_t *log);
static void ngx_http_dpd_prefix_refresh(ngx_http_dpd_prefix_reader_t *rd,
    ngx_log_t *log);
static ngx_int_t ngx_http_dpd_prefix_probe(ngx_http_dpd_prefix_reader_t *rd,
    uint64_t key, uint64_t *mask);
static ssize_t ngx_http_dpd_prefix_pread(ngx_fd_t fd, void *buf,
    size_t size, uint64_t off);
static void ngx_http_dpd_prefix_fail(ngx_http_dpd_prefix_reader_t *rd,
    ngx_log_t *log, const char *reason);


static ngx_str_t  ngx_http_dpd_prefix_default_zone =
    ngx_string("dpd_prefix");

/* per worker: where the tie-break among equal costs starts, one for the
 * decode choices and one for the prefill choices (a shared one would step
 * twice a request and always start on the same peer of two) */
static ngx_uint_t  ngx_http_dpd_prefix_rotate[2];

/* per worker: the last "pool too large" warning */
static time_t      ngx_http_dpd_prefix_big_warn;


/* ------------------------------------------------------------------ */
/* configuration                                                       */


void
ngx_http_dpd_prefix_init_conf(ngx_http_dpd_prefix_conf_t *conf)
{
    conf->mode = NGX_CONF_UNSET_UINT;
}


/*
 * dpd_prefix_cache off | approximate [zone=NAME[:SIZE]] [block=N]
 *     [ttl=TIME] [weights=U:L] [imbalance=ABS:REL]
 *   | events file=PATH [block=N] [stale=TIME] [weights=U:L]
 *     [imbalance=ABS:REL]
 */

char *
ngx_http_dpd_prefix_cache(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_dpd_prefix_conf_t  *pc;

    u_char                        *p, *colon, *end;
    double                         rel, frac;
    ssize_t                        size;
    ngx_int_t                      n;
    ngx_msec_t                     stale;
    ngx_str_t                     *value, s, name, file;
    ngx_uint_t                     i;
    ngx_shm_zone_t                *shm_zone;
    ngx_http_dpd_prefix_zone_t    *z;
    ngx_http_dpd_prefix_reader_t  *rd;

    /* the module's location conf; the directive's own part at offset */
    pc = (ngx_http_dpd_prefix_conf_t *) ((u_char *) conf + cmd->offset);

    if (pc->mode != NGX_CONF_UNSET_UINT) {
        return "is duplicate";
    }

    value = cf->args->elts;

    if (ngx_strcmp(value[1].data, "off") == 0) {
        if (cf->args->nelts != 2) {
            return "takes no parameters with \"off\"";
        }

        pc->mode = NGX_HTTP_DPD_PREFIX_OFF;
        return NGX_CONF_OK;
    }

    if (ngx_strcmp(value[1].data, "approximate") == 0) {
        pc->mode = NGX_HTTP_DPD_PREFIX_APPROXIMATE;

    } else if (ngx_strcmp(value[1].data, "events") == 0) {
        pc->mode = NGX_HTTP_DPD_PREFIX_EVENTS;

    } else {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid mode \"%V\" (off, approximate or "
                           "events)", &value[1]);
        return NGX_CONF_ERROR;
    }

    pc->block = DPD_PREFIX_DEFAULT_BLOCK;
    pc->ttl = 120000;                 /* Dynamo's default */
    pc->w_uncached = 1;
    pc->w_load = 32;                  /* one request ~ 512 tokens */
    pc->imb_abs = 64;                 /* SGLang's guard (DESIGN.md 9) */
    pc->imb_rel = 1500;

    ngx_str_null(&name);
    ngx_str_null(&file);
    size = NGX_CONF_UNSET;
    stale = NGX_HTTP_DPD_PREFIX_STALE;

    for (i = 2; i < cf->args->nelts; i++) {

        if (ngx_strncmp(value[i].data, "zone=", 5) == 0
            && pc->mode == NGX_HTTP_DPD_PREFIX_APPROXIMATE)
        {
            name.data = value[i].data + 5;
            p = (u_char *) ngx_strchr(name.data, ':');

            if (p) {
                name.len = p - name.data;
                s.data = p + 1;
                s.len = value[i].data + value[i].len - s.data;

                size = ngx_parse_size(&s);

                if (size == NGX_ERROR
                    || size < NGX_HTTP_DPD_PREFIX_MIN_SIZE)
                {
                    ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                                       "invalid zone size \"%V\" (at least "
                                       "256k)", &value[i]);
                    return NGX_CONF_ERROR;
                }

            } else {
                name.len = value[i].len - 5;
                size = 0;             /* a zone declared elsewhere */
            }

            if (name.len == 0) {
                ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                                   "invalid zone name \"%V\"", &value[i]);
                return NGX_CONF_ERROR;
            }

            continue;
        }

        if (ngx_strncmp(value[i].data, "file=", 5) == 0
            && pc->mode == NGX_HTTP_DPD_PREFIX_EVENTS)
        {
            file.data = value[i].data + 5;
            file.len = value[i].len - 5;

            if (file.len == 0) {
                return "has an empty \"file=\"";
            }

            continue;
        }

        if (ngx_strncmp(value[i].data, "stale=", 6) == 0
            && pc->mode == NGX_HTTP_DPD_PREFIX_EVENTS)
        {
            s.data = value[i].data + 6;
            s.len = value[i].len - 6;

            stale = ngx_parse_time(&s, 0);

            if (stale == (ngx_msec_t) NGX_ERROR
                || stale < NGX_HTTP_DPD_PREFIX_MIN_STALE)
            {
                ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                                   "invalid \"%V\" (at least 2s: the "
                                   "agent beats once a second)", &value[i]);
                return NGX_CONF_ERROR;
            }

            continue;
        }

        if (ngx_strncmp(value[i].data, "prefill=", 8) == 0) {
            pc->prefill_name.data = value[i].data + 8;
            pc->prefill_name.len = value[i].len - 8;

            if (pc->prefill_name.len == 0) {
                goto invalid;
            }

            continue;
        }

        if (ngx_strncmp(value[i].data, "block=", 6) == 0) {
            n = ngx_atoi(value[i].data + 6, value[i].len - 6);

            if (n < 1 || n > DPD_PREFIX_MAX_BLOCK) {
                ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                                   "invalid \"%V\" (1..%d tokens, the "
                                   "engine's block size)", &value[i],
                                   DPD_PREFIX_MAX_BLOCK);
                return NGX_CONF_ERROR;
            }

            pc->block = (size_t) n;
            continue;
        }

        if (ngx_strncmp(value[i].data, "ttl=", 4) == 0
            && pc->mode == NGX_HTTP_DPD_PREFIX_APPROXIMATE)
        {
            s.data = value[i].data + 4;
            s.len = value[i].len - 4;

            pc->ttl = ngx_parse_time(&s, 0);

            if (pc->ttl == (ngx_msec_t) NGX_ERROR || pc->ttl == 0) {
                ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                                   "invalid \"%V\"", &value[i]);
                return NGX_CONF_ERROR;
            }

            continue;
        }

        if (ngx_strncmp(value[i].data, "weights=", 8) == 0) {
            s.data = value[i].data + 8;
            s.len = value[i].len - 8;
            colon = ngx_strlchr(s.data, s.data + s.len, ':');

            if (colon == NULL) {
                goto invalid;
            }

            n = ngx_atoi(s.data, colon - s.data);
            pc->w_load = ngx_atoi(colon + 1, s.data + s.len - colon - 1);

            if (n == NGX_ERROR || (ngx_int_t) pc->w_load == NGX_ERROR
                || n > 1000000 || pc->w_load > 1000000
                || (n == 0 && pc->w_load == 0))
            {
                goto invalid;
            }

            pc->w_uncached = (ngx_uint_t) n;
            continue;
        }

        if (ngx_strncmp(value[i].data, "imbalance=", 10) == 0) {
            s.data = value[i].data + 10;
            s.len = value[i].len - 10;

            if (s.len == 3 && ngx_strncmp(s.data, "off", 3) == 0) {
                pc->imb_abs = NGX_MAX_UINT32_VALUE;
                pc->imb_rel = 0;
                continue;
            }

            colon = ngx_strlchr(s.data, s.data + s.len, ':');

            if (colon == NULL) {
                goto invalid;
            }

            n = ngx_atoi(s.data, colon - s.data);

            /* REL: a decimal such as 1.5 */
            rel = 0;
            p = colon + 1;

            if (p == s.data + s.len) {
                goto invalid;
            }

            end = s.data + s.len;

            for ( /* void */ ; p < end && *p >= '0' && *p <= '9'; p++) {
                rel = rel * 10 + (*p - '0');
                if (rel > 1000) {
                    goto invalid;
                }
            }

            if (p < end && *p == '.') {
                frac = 0.1;

                for (p++; p < end && *p >= '0' && *p <= '9'; p++) {
                    rel += (*p - '0') * frac;
                    frac /= 10;
                }
            }

            if (p != end) {
                goto invalid;
            }

            if (n == NGX_ERROR || rel < 1.0) {
                goto invalid;
            }

            pc->imb_abs = (ngx_uint_t) n;
            pc->imb_rel = (ngx_uint_t) (rel * 1000 + 0.5);
            continue;
        }

        goto invalid;
    }

    if (pc->mode == NGX_HTTP_DPD_PREFIX_EVENTS) {

        if (file.len == 0) {
            return "needs \"file=PATH\" with \"events\" (the index the "
                   "router-role kv_agent writes)";
        }

        rd = ngx_pcalloc(cf->pool, sizeof(ngx_http_dpd_prefix_reader_t));
        if (rd == NULL) {
            return NGX_CONF_ERROR;
        }

        if (ngx_conf_full_name(cf->cycle, &file, 0) != NGX_OK) {
            return NGX_CONF_ERROR;
        }

        rd->path.data = ngx_pnalloc(cf->pool, file.len + 1);
        if (rd->path.data == NULL) {
            return NGX_CONF_ERROR;
        }

        ngx_memcpy(rd->path.data, file.data, file.len);
        rd->path.data[file.len] = '\0';
        rd->path.len = file.len;
        rd->fd = NGX_INVALID_FILE;
        rd->stale = stale;

        /* the index says its block size; block= must agree (checked at
         * read time: a mismatch means no cache information) */

        pc->reader = rd;

        return NGX_CONF_OK;
    }

    /* approximate: the zone */

    if (name.len == 0) {
        name = ngx_http_dpd_prefix_default_zone;
        size = NGX_HTTP_DPD_PREFIX_DEFAULT_SIZE;
    }

    shm_zone = ngx_shared_memory_add(cf, &name, size, &ngx_http_dpd_module);
    if (shm_zone == NULL) {
        return NGX_CONF_ERROR;
    }

    if (shm_zone->data == NULL) {
        z = ngx_pcalloc(cf->pool, sizeof(ngx_http_dpd_prefix_zone_t));
        if (z == NULL) {
            return NGX_CONF_ERROR;
        }

        shm_zone->init = ngx_http_dpd_prefix_init_zone;
        shm_zone->data = z;

    } else if (shm_zone->init != ngx_http_dpd_prefix_init_zone) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "zone \"%V\" is not a dpd_prefix_cache zone",
                           &name);
        return NGX_CONF_ERROR;
    }

    pc->zone = shm_zone;

    return NGX_CONF_OK;

invalid:

    ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                       "invalid parameter \"%V\" for \"dpd_prefix_cache %V\"",
                       &value[i], &value[1]);
    return NGX_CONF_ERROR;
}


char *
ngx_http_dpd_prefix_merge_conf(ngx_conf_t *cf,
    ngx_http_dpd_prefix_conf_t *prev, ngx_http_dpd_prefix_conf_t *conf,
    ngx_str_t *decode_name, ngx_flag_t enable)
{
    char  *err;

    if (conf->mode == NGX_CONF_UNSET_UINT) {
        if (prev->mode == NGX_CONF_UNSET_UINT) {
            conf->mode = NGX_HTTP_DPD_PREFIX_OFF;

        } else {
            *conf = *prev;
        }
    }

    if (conf->mode == NGX_HTTP_DPD_PREFIX_OFF) {
        return NGX_CONF_OK;
    }

    if (decode_name->len == 0) {
        if (!enable) {
            /* a block around the dpd location: checked there */
            conf->decode = NULL;
            return NGX_CONF_OK;
        }

        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "\"dpd_prefix_cache\" needs \"dpd_decode_upstream\" "
                           "naming the decode pool it chooses in");
        return NGX_CONF_ERROR;
    }

    if (conf->decode
        && conf->decode->host.len == decode_name->len
        && ngx_strncmp(conf->decode->host.data, decode_name->data,
                       decode_name->len) == 0)
    {
        return ngx_http_dpd_prefix_merge_prefill(cf, conf);
    }

    conf->decode = ngx_http_dpd_balancer_find_upstream(cf, decode_name, 0,
                                                       &err);
    if (conf->decode == NULL) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "\"dpd_prefix_cache\" with upstream \"%V\": %s",
                           decode_name, err);
        return NGX_CONF_ERROR;
    }

    return ngx_http_dpd_prefix_merge_prefill(cf, conf);
}


/* prefill=NAME: the prefill pool, chosen in by its own cache and load */

static char *
ngx_http_dpd_prefix_merge_prefill(ngx_conf_t *cf,
    ngx_http_dpd_prefix_conf_t *conf)
{
    char  *err;

    if (conf->prefill_name.len == 0 || conf->prefill) {
        return NGX_CONF_OK;
    }

    conf->prefill = ngx_http_dpd_balancer_find_upstream(cf,
                                                        &conf->prefill_name,
                                                        0, &err);
    if (conf->prefill == NULL) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "\"dpd_prefix_cache\" with prefill=%V: %s",
                           &conf->prefill_name, err);
        return NGX_CONF_ERROR;
    }

    return NGX_CONF_OK;
}


/* 64 random bits: the kernel's, else what nginx seeded random() with */

static uint64_t
ngx_http_dpd_prefix_secret(void)
{
    ssize_t   n;
    ngx_fd_t  fd;
    uint64_t  v;

    v = 0;
    fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);

    if (fd != -1) {
        n = read(fd, &v, sizeof(v));
        (void) close(fd);

        if (n == (ssize_t) sizeof(v)) {
            return v;
        }
    }

    return ((uint64_t) ngx_random() << 33) ^ ((uint64_t) ngx_random() << 11)
           ^ (uint64_t) ngx_random() ^ (uint64_t) ngx_pid
           ^ ((uint64_t) ngx_current_msec << 20);
}


static ngx_int_t
ngx_http_dpd_prefix_init_zone(ngx_shm_zone_t *shm_zone, void *data)
{
    ngx_http_dpd_prefix_zone_t  *ozone = data;

    size_t                       n, size;
    ngx_uint_t                   i;
    ngx_http_dpd_prefix_zone_t  *z;

    z = shm_zone->data;

    if (ozone) {
        /* a reload: the same memory, the same index */
        z->sh = ozone->sh;
        z->shpool = ozone->shpool;
        return NGX_OK;
    }

    z->shpool = (ngx_slab_pool_t *) shm_zone->shm.addr;

    if (shm_zone->shm.exists) {
        z->sh = z->shpool->data;
        return NGX_OK;
    }

    z->sh = ngx_slab_calloc(z->shpool, sizeof(ngx_http_dpd_prefix_sh_t));
    if (z->sh == NULL) {
        return NGX_ERROR;
    }

    z->shpool->data = z->sh;

    for (i = 0; i < NGX_HTTP_DPD_PREFIX_MAX_NODES; i++) {
        ngx_queue_init(&z->sh->nodes[i].lru);
    }

    /* about one bucket per two 64-byte entries the zone can hold */

    size = shm_zone->shm.size;

    for (n = 1024; n * 128 < size; n <<= 1) { /* void */ }

    n >>= 1;

    z->sh->buckets = ngx_slab_calloc(z->shpool,
                                     n * sizeof(ngx_http_dpd_prefix_entry_t *));
    if (z->sh->buckets == NULL) {
        return NGX_ERROR;
    }

    z->sh->mask = n - 1;
    z->sh->seed = ngx_http_dpd_prefix_secret();

    n = sizeof(" in dpd_prefix_cache zone \"\"") + shm_zone->shm.name.len;

    z->shpool->log_ctx = ngx_slab_alloc(z->shpool, n);
    if (z->shpool->log_ctx == NULL) {
        return NGX_ERROR;
    }

    ngx_sprintf(z->shpool->log_ctx, " in dpd_prefix_cache zone \"%V\"%Z",
                &shm_zone->shm.name);

    /* allocation failures are expected (the index is bounded): quiet */
    z->shpool->log_nomem = 0;

    return NGX_OK;
}


/* ------------------------------------------------------------------ */
/* the decision                                                        */


/*
 * The cheapest usable peer of "us" for this prompt (its index into
 * *candp, blocks[] its cached blocks); NGX_DECLINED: nothing to score,
 * NGX_ERROR: memory.
 */

static ngx_int_t
ngx_http_dpd_prefix_score(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefix_conf_t *pc, ngx_http_upstream_srv_conf_t *us,
    ngx_http_dpd_balancer_cand_t **candp, size_t *blocks, uint64_t *pool,
    ngx_uint_t *imbalanced)
{
    uint64_t                       cost, best_cost;
    ngx_int_t                      best;
    ngx_uint_t                     i, j, n, maxl, minl, usable, start, max;
    ngx_http_upstream_rr_peers_t  *peers;
    ngx_http_dpd_balancer_cand_t  *cand;

    /*
     * room for the pool's peers as configured or resolved now (read
     * without the lock: a bound only, candidates() never writes more);
     * a small pool allocation, not a large one per request
     */

    peers = us->peer.data;
    max = 0;

    if (peers) {
        max = peers->number + (peers->next ? peers->next->number : 0);
    }

    if (max > NGX_HTTP_DPD_PREFIX_MAX_CANDS) {
        /*
         * The scores fit 64 peers (a mask bit each, 64 nodes a zone or
         * index); scoring the first 64 of a larger pool would starve the
         * rest.  dpd_balance chooses, as with the cache off.
         */
        if (ngx_time() - ngx_http_dpd_prefix_big_warn
            >= NGX_HTTP_DPD_PREFIX_WARN_EVERY)
        {
            ngx_http_dpd_prefix_big_warn = ngx_time();
            ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                          "dpd prefix: upstream \"%V\" has %ui peers, more "
                          "than the %d dpd_prefix_cache scores: routing "
                          "without the cache", &us->host, max,
                          NGX_HTTP_DPD_PREFIX_MAX_CANDS);
        }

        return NGX_DECLINED;
    }

    max = ngx_max(max, 2);

    cand = ngx_palloc(r->pool, max * sizeof(ngx_http_dpd_balancer_cand_t));
    if (cand == NULL) {
        return NGX_ERROR;
    }

    *candp = cand;

    if (ngx_http_dpd_balancer_candidates(r, us, cand, max, &n) != NGX_OK
        || n == 0)
    {
        return NGX_DECLINED;
    }

    ngx_memzero(blocks, n * sizeof(size_t));

    *pool = dpd_prefix_hash_str(us->host.data, us->host.len);

    if (ctx->prefix_nkeys) {
        if (pc->mode == NGX_HTTP_DPD_PREFIX_APPROXIMATE) {
            ngx_http_dpd_prefix_zone_lookup(pc, cand, n, *pool,
                                            ctx->prefix_keys,
                                            ctx->prefix_nkeys, blocks);

        } else {
            (void) ngx_http_dpd_prefix_events_lookup(pc->reader, cand, n,
                                                     ctx->prefix_keys,
                                                     ctx->prefix_nkeys,
                                                     pc->block, blocks,
                                                     r->connection->log);
        }
    }

    /* the imbalance guard: SGLang's abs/rel rule over usable peers */

    maxl = 0;
    minl = NGX_MAX_UINT32_VALUE;
    usable = 0;

    for (i = 0; i < n; i++) {
        if (!cand[i].usable) {
            continue;
        }

        usable++;
        maxl = ngx_max(maxl, cand[i].conns);
        minl = ngx_min(minl, cand[i].conns);
    }

    if (usable == 0) {
        return NGX_DECLINED;
    }

    *imbalanced = (maxl - minl > pc->imb_abs
                   && (uint64_t) maxl * 1000 > (uint64_t) pc->imb_rel * minl);

    /* equal costs (a new prompt on idle peers) rotate, as dpd_balance
     * does among equally loaded peers */

    best = -1;
    best_cost = 0;
    start = ngx_http_dpd_prefix_rotate[us == pc->prefill]++;

    for (j = 0; j < n; j++) {
        i = (start + j) % n;

        if (!cand[i].usable) {
            continue;
        }

        if (*imbalanced) {
            /* least loaded; more cached blocks break ties */
            cost = (uint64_t) cand[i].conns * (ctx->prefix_nkeys + 1)
                   + (ctx->prefix_nkeys - blocks[i]);

        } else {
            cost = (uint64_t) pc->w_uncached
                       * (ctx->prefix_nkeys - blocks[i])
                   + (uint64_t) pc->w_load * cand[i].conns;
        }

        if (best < 0
            || cost < best_cost
            || (cost == best_cost && cand[i].conns < cand[best].conns))
        {
            best = (ngx_int_t) i;
            best_cost = cost;
        }
    }

    return best;
}


ngx_int_t
ngx_http_dpd_prefix_route(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_http_dpd_prefix_conf_t *pc, ngx_int_t threshold)
{
    size_t                         blocks[NGX_HTTP_DPD_PREFIX_MAX_CANDS];
    size_t                         unc, cached;
    uint64_t                       pool;
    ngx_int_t                      rc, best;
    ngx_uint_t                     imbalanced;
    ngx_http_dpd_pin_t            *pin;
    ngx_http_dpd_balancer_cand_t  *cand;

    if (pc->decode == NULL) {
        return NGX_DECLINED;
    }

    if (ctx->prefix_nkeys) {
        ngx_http_dpd_metrics_inc(r, NGX_HTTP_DPD_M_PREFIX_LOOKUPS);
    }

    imbalanced = 0;

    best = ngx_http_dpd_prefix_score(r, ctx, pc, pc->decode, &cand, blocks,
                                     &pool, &imbalanced);

    if (best == NGX_ERROR) {
        return NGX_ERROR;
    }

    if (best < 0) {
        return NGX_DECLINED;
    }

    if (imbalanced) {
        ngx_http_dpd_metrics_inc(r, NGX_HTTP_DPD_M_PREFIX_IMBALANCED);
    }

    if (pc->mode == NGX_HTTP_DPD_PREFIX_EVENTS && ctx->prefix_nkeys
        && pc->reader->dead)
    {
        /* looked up in an index whose writer is gone: counted nothing */
        ngx_http_dpd_metrics_inc(r, NGX_HTTP_DPD_M_PREFIX_STALE);
    }

    cached = blocks[best] * pc->block;

    if ((ngx_int_t) cached > ctx->prompt_tokens) {
        cached = ctx->prompt_tokens;
    }

    unc = ctx->prompt_tokens - cached;

    ctx->cached_tokens = cached;
    ctx->uncached_tokens = unc;

    if (cached) {
        ngx_http_dpd_metrics_inc(r, NGX_HTTP_DPD_M_PREFIX_HITS);
        ngx_http_dpd_metrics_add(r, NGX_HTTP_DPD_M_PREFIX_CACHED_TOKENS,
                                 cached);
    }

    /* dpd_threshold on the tokens the chosen decoder must compute */

    if (threshold != 0 && ctx->prompt_tokens < threshold) {
        ctx->route = NGX_HTTP_DPD_ROUTE_DIRECT;
        ctx->prefix_reason = NGX_HTTP_DPD_PR_SHORT;
        ngx_http_dpd_metrics_inc(r, NGX_HTTP_DPD_M_PREFIX_ROUTE_SHORT);

    } else if (threshold != 0 && (ngx_int_t) unc < threshold) {
        ctx->route = NGX_HTTP_DPD_ROUTE_DIRECT;
        ctx->prefix_reason = NGX_HTTP_DPD_PR_CACHED;
        ngx_http_dpd_metrics_inc(r, NGX_HTTP_DPD_M_PREFIX_ROUTE_CACHED);

    } else {
        ctx->route = NGX_HTTP_DPD_ROUTE_DISAGGREGATED;
        ctx->prefix_reason = NGX_HTTP_DPD_PR_DISAGG;
        ngx_http_dpd_metrics_inc(r, NGX_HTTP_DPD_M_PREFIX_ROUTE_DISAGG);
    }

    rc = ngx_http_dpd_balancer_pin_name(r, pc->decode, &cand[best].name,
                                        &pin);

    ngx_log_debug6(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "dpd prefix: %uz of %uz blocks cached on %V (%ui "
                   "outstanding%s), pin %i",
                   blocks[best], ctx->prefix_nkeys, &cand[best].name,
                   cand[best].conns, imbalanced ? ", imbalanced" : "", rc);

    if (rc == NGX_ERROR) {
        return NGX_ERROR;
    }

    if (rc != NGX_OK) {
        /* gone since the snapshot: dpd_balance picks; nothing learned */
        return NGX_OK;
    }

    if (pc->mode == NGX_HTTP_DPD_PREFIX_APPROXIMATE && ctx->prefix_nkeys) {
        /* learned when it answers (ngx_http_dpd_prefix_learn()); the
         * name lies in cand's buffer, in the request's pool */
        ctx->prefix_conf = pc;
        ctx->prefix_decoder = cand[best].name;
    }

    return NGX_OK;
}


/*
 * prefill=NAME: the prefill subrequest sr goes to the prefiller of that
 * pool with the cheapest cost by its own cached blocks and load (pinned
 * on sr, so that its proxy_pass through dpd_balance takes it first);
 * nothing to score leaves the choice to dpd_balance.
 */

ngx_int_t
ngx_http_dpd_prefix_prefill(ngx_http_request_t *r, ngx_http_request_t *sr,
    ngx_http_dpd_ctx_t *ctx, ngx_http_dpd_prefix_conf_t *pc)
{
    size_t                         blocks[NGX_HTTP_DPD_PREFIX_MAX_CANDS];
    uint64_t                       pool;
    ngx_int_t                      rc, best;
    ngx_uint_t                     imbalanced;
    ngx_http_dpd_pin_t            *pin;
    ngx_http_dpd_balancer_cand_t  *cand;

    if (pc->mode == NGX_HTTP_DPD_PREFIX_OFF || pc->prefill == NULL) {
        return NGX_DECLINED;
    }

    imbalanced = 0;

    best = ngx_http_dpd_prefix_score(r, ctx, pc, pc->prefill, &cand, blocks,
                                     &pool, &imbalanced);

    if (best == NGX_ERROR) {
        return NGX_ERROR;
    }

    if (best < 0) {
        return NGX_DECLINED;
    }

    rc = ngx_http_dpd_balancer_pin_name(sr, pc->prefill, &cand[best].name,
                                        &pin);

    ngx_log_debug4(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "dpd prefix: prefill on %V, %uz of %uz blocks cached, "
                   "pin %i", &cand[best].name, blocks[best],
                   ctx->prefix_nkeys, rc);

    if (rc != NGX_OK) {
        return rc;
    }

    if (pc->mode == NGX_HTTP_DPD_PREFIX_APPROXIMATE && ctx->prefix_nkeys) {
        /* learned when the prefill succeeded (prefill_finish) */
        ctx->prefix_conf = pc;
        ctx->prefix_prefiller = cand[best].name;
    }

    return NGX_OK;
}


/*
 * A node holds a prompt's blocks only once its engine computed them: a
 * request refused (5xx), never connected, timed out or moved to another
 * node says nothing of the chosen node's cache, and remembering it there
 * would draw the next turn to a node that must recompute everything.
 * So the choice waits in ctx until the node answered: the decoder's 2xx
 * response header (ngx_http_dpd_header_filter(); a stream that breaks
 * later still had its prompt prefilled), the prefiller's 2xx reply.
 */

void
ngx_http_dpd_prefix_learn(ngx_http_request_t *r, ngx_http_dpd_ctx_t *ctx,
    ngx_uint_t prefill, ngx_str_t *peer)
{
    uint64_t                       pool;
    ngx_str_t                      name;
    ngx_http_dpd_prefix_conf_t    *pc;
    ngx_http_upstream_srv_conf_t  *us;

    pc = ctx->prefix_conf;
    name = prefill ? ctx->prefix_prefiller : ctx->prefix_decoder;

    if (pc == NULL || name.len == 0
        || pc->mode != NGX_HTTP_DPD_PREFIX_APPROXIMATE
        || ctx->prefix_nkeys == 0)
    {
        return;
    }

    /* once: a second header (an error page after a 2xx) learns nothing */

    if (prefill) {
        ctx->prefix_prefiller.len = 0;

    } else {
        ctx->prefix_decoder.len = 0;
    }

    if (peer == NULL) {
        return;
    }

    if (peer->len != name.len
        || ngx_strncmp(peer->data, name.data, name.len) != 0)
    {
        ngx_log_debug2(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                       "dpd prefix: %V answered, not the chosen %V: "
                       "nothing learned", peer, &name);
        return;
    }

    us = prefill ? pc->prefill : pc->decode;

    if (us == NULL) {
        return;
    }

    pool = dpd_prefix_hash_str(us->host.data, us->host.len);

    ngx_http_dpd_prefix_zone_insert(pc, &name, pool, ctx->prefix_keys,
                                    ctx->prefix_nkeys, r->connection->log);
}


/* ------------------------------------------------------------------ */
/* approximate: the shared zone                                        */


/* the node called "name", created when asked; -1: none (table full) */

static ngx_int_t
ngx_http_dpd_prefix_node(ngx_http_dpd_prefix_sh_t *sh, ngx_str_t *name,
    uint64_t pool, ngx_uint_t create)
{
    ngx_int_t                    free;
    ngx_uint_t                   i;
    ngx_http_dpd_prefix_node_t  *nd;

    free = -1;

    for (i = 0; i < NGX_HTTP_DPD_PREFIX_MAX_NODES; i++) {
        nd = &sh->nodes[i];

        if (!nd->used) {
            if (free < 0) {
                free = i;
            }

            continue;
        }

        if (nd->len == name->len
            && ngx_memcmp(nd->name, name->data, name->len) == 0)
        {
            nd->pool = pool;
            return i;
        }
    }

    if (!create || free < 0) {
        return -1;
    }

    nd = &sh->nodes[free];
    nd->used = 1;
    nd->pool = pool;
    nd->count = 0;
    nd->len = ngx_min(name->len, NGX_HTTP_DPD_CAND_NAME_LEN);
    ngx_memcpy(nd->name, name->data, nd->len);
    ngx_queue_init(&nd->lru);

    return free;
}


static void
ngx_http_dpd_prefix_free_entry(ngx_http_dpd_prefix_zone_t *z,
    ngx_http_dpd_prefix_entry_t *e)
{
    ngx_http_dpd_prefix_entry_t  **pp;

    for (pp = ngx_http_dpd_prefix_bucket(z->sh, e->key);
         *pp;
         pp = &(*pp)->next)
    {
        if (*pp == e) {
            *pp = e->next;
            break;
        }
    }

    ngx_queue_remove(&e->queue);
    z->sh->nodes[e->node].count--;
    z->sh->entries--;

    ngx_slab_free_locked(z->shpool, e);
}


/* up to max of node n's oldest entries (only those older than "older"
 * when it is not 0); the number freed */

static ngx_uint_t
ngx_http_dpd_prefix_evict(ngx_http_dpd_prefix_zone_t *z, ngx_uint_t n,
    ngx_uint_t max, ngx_msec_t older)
{
    ngx_uint_t                    k;
    ngx_msec_t                    now;
    ngx_queue_t                  *q;
    ngx_http_dpd_prefix_entry_t  *e;

    now = ngx_current_msec;

    for (k = 0; k < max; k++) {
        if (ngx_queue_empty(&z->sh->nodes[n].lru)) {
            break;
        }

        q = ngx_queue_last(&z->sh->nodes[n].lru);
        e = ngx_queue_data(q, ngx_http_dpd_prefix_entry_t, queue);

        if (older && (ngx_msec_int_t) (now - e->time) < (ngx_msec_int_t) older)
        {
            break;
        }

        ngx_http_dpd_prefix_free_entry(z, e);
    }

    return k;
}


static void
ngx_http_dpd_prefix_drop_node(ngx_http_dpd_prefix_zone_t *z, ngx_uint_t n)
{
    while (ngx_http_dpd_prefix_evict(z, n, 4096, 0) == 4096) {
        /* void */
    }

    z->sh->nodes[n].used = 0;
}


/*
 * Nodes of this decode pool that are no longer its peers (1.27.3+
 * "resolve" re-resolved them away, a reload removed them) or are marked
 * down lose their entries: what they held is unknown when they return.
 */

static void
ngx_http_dpd_prefix_sweep(ngx_http_dpd_prefix_zone_t *z,
    ngx_http_dpd_balancer_cand_t *cand, ngx_uint_t ncand, uint64_t pool)
{
    ngx_uint_t                   i, j, found;
    ngx_http_dpd_prefix_node_t  *nd;

    for (i = 0; i < NGX_HTTP_DPD_PREFIX_MAX_NODES; i++) {
        nd = &z->sh->nodes[i];

        if (!nd->used || nd->pool != pool) {
            continue;
        }

        found = 0;

        for (j = 0; j < ncand; j++) {
            if (cand[j].name.len == nd->len
                && ngx_memcmp(cand[j].name.data, nd->name, nd->len) == 0)
            {
                found = !cand[j].down;
                break;
            }
        }

        if (!found) {
            ngx_http_dpd_prefix_drop_node(z, i);
        }
    }
}


static void
ngx_http_dpd_prefix_zone_lookup(ngx_http_dpd_prefix_conf_t *pc,
    ngx_http_dpd_balancer_cand_t *cand, ngx_uint_t ncand, uint64_t pool,
    uint64_t *keys, size_t nkeys, size_t *blocks)
{
    size_t                        k;
    uint64_t                      alive, held, gone;
    ngx_int_t                     node;
    ngx_uint_t                    i;
    ngx_msec_t                    now;
    ngx_http_dpd_prefix_sh_t     *sh;
    ngx_http_dpd_prefix_zone_t   *z;
    ngx_http_dpd_prefix_entry_t  *e;
    int8_t                        of_node[NGX_HTTP_DPD_PREFIX_MAX_NODES];

    z = pc->zone->data;
    sh = z->sh;
    now = ngx_current_msec;

    ngx_memset(of_node, -1, sizeof(of_node));
    alive = 0;

    ngx_shmtx_lock(&z->shpool->mutex);

    ngx_http_dpd_prefix_sweep(z, cand, ncand, pool);

    for (i = 0; i < ncand; i++) {
        if (!cand[i].usable) {
            continue;
        }

        node = ngx_http_dpd_prefix_node(sh, &cand[i].name, pool, 0);

        if (node >= 0 && sh->nodes[node].count) {
            of_node[node] = (int8_t) i;
            alive |= (uint64_t) 1 << i;
        }
    }

    for (k = 0; k < nkeys && alive; k++) {

        if (k && k % NGX_HTTP_DPD_PREFIX_LOCK_STEP == 0) {
            /* a long prompt lets the other workers in now and then (a
             * 1M-token prompt: ~7 ms in one hold); a node dropped or
             * reused meanwhile ends its run here */
            ngx_shmtx_unlock(&z->shpool->mutex);
            ngx_shmtx_lock(&z->shpool->mutex);

            ngx_memset(of_node, -1, sizeof(of_node));

            for (i = 0; i < ncand; i++) {
                if (!(alive & ((uint64_t) 1 << i))) {
                    continue;
                }

                node = ngx_http_dpd_prefix_node(sh, &cand[i].name, pool, 0);

                if (node < 0) {
                    alive &= ~((uint64_t) 1 << i);
                    blocks[i] = k;
                    continue;
                }

                of_node[node] = (int8_t) i;
            }
        }

        held = 0;

        for (e = *ngx_http_dpd_prefix_bucket(sh, keys[k]); e; e = e->next) {
            if (e->key == keys[k]
                && of_node[e->node] >= 0
                && (ngx_msec_int_t) (now - e->time)
                   < (ngx_msec_int_t) pc->ttl)
            {
                held |= (uint64_t) 1 << of_node[e->node];
            }
        }

        gone = alive & ~held;
        alive &= held;

        for (i = 0; gone; i++, gone >>= 1) {
            if (gone & 1) {
                blocks[i] = k;
            }
        }
    }

    for (i = 0; alive; i++, alive >>= 1) {
        if (alive & 1) {
            blocks[i] = k;
        }
    }

    ngx_shmtx_unlock(&z->shpool->mutex);
}


static void
ngx_http_dpd_prefix_zone_insert(ngx_http_dpd_prefix_conf_t *pc,
    ngx_str_t *name, uint64_t pool, uint64_t *keys, size_t nkeys,
    ngx_log_t *log)
{
    size_t                        k;
    ngx_int_t                     node;
    ngx_uint_t                    i, big, tries;
    ngx_msec_t                    now;
    ngx_http_dpd_prefix_sh_t     *sh;
    ngx_http_dpd_prefix_zone_t   *z;
    ngx_http_dpd_prefix_entry_t  *e, **b;

    z = pc->zone->data;
    sh = z->sh;
    now = ngx_current_msec;

    ngx_shmtx_lock(&z->shpool->mutex);

    node = ngx_http_dpd_prefix_node(sh, name, pool, 1);

    if (node < 0) {
        sh->failed++;
        ngx_shmtx_unlock(&z->shpool->mutex);
        ngx_log_error(NGX_LOG_INFO, log, 0,
                      "dpd prefix: more than %d decoders, %V not indexed",
                      NGX_HTTP_DPD_PREFIX_MAX_NODES, name);
        return;
    }

    /* reclaim expired entries first, from the node's tail */
    (void) ngx_http_dpd_prefix_evict(z, node, NGX_HTTP_DPD_PREFIX_EXPIRE_STEP,
                                     pc->ttl);

    /* last block first: block 0 ends up the freshest entry */

    for (k = nkeys; k-- > 0; /* void */) {

        if ((nkeys - k) % NGX_HTTP_DPD_PREFIX_LOCK_STEP == 0) {
            /* let the other workers in (a 1M-token prompt: ~22 ms in one
             * hold); stop if another worker dropped the node meanwhile */
            ngx_shmtx_unlock(&z->shpool->mutex);
            ngx_shmtx_lock(&z->shpool->mutex);

            if (!sh->nodes[node].used
                || sh->nodes[node].len != name->len
                || ngx_memcmp(sh->nodes[node].name, name->data, name->len)
                   != 0)
            {
                break;
            }
        }

        b = ngx_http_dpd_prefix_bucket(sh, keys[k]);

        for (e = *b; e; e = e->next) {
            if (e->key == keys[k] && e->node == (ngx_uint_t) node) {
                break;
            }
        }

        if (e) {
            e->time = now;
            ngx_queue_remove(&e->queue);
            ngx_queue_insert_head(&sh->nodes[node].lru, &e->queue);
            continue;
        }

        for (tries = 0; ; tries++) {
            e = ngx_slab_alloc_locked(z->shpool,
                                      sizeof(ngx_http_dpd_prefix_entry_t));
            if (e || tries == 2) {
                break;
            }

            /* full: this node's oldest, then the fullest node's */

            if (tries == 0
                && ngx_http_dpd_prefix_evict(z, node,
                                             NGX_HTTP_DPD_PREFIX_EVICT_STEP,
                                             0))
            {
                continue;
            }

            big = 0;

            for (i = 1; i < NGX_HTTP_DPD_PREFIX_MAX_NODES; i++) {
                if (sh->nodes[i].count > sh->nodes[big].count) {
                    big = i;
                }
            }

            (void) ngx_http_dpd_prefix_evict(z, big,
                                             NGX_HTTP_DPD_PREFIX_EVICT_STEP,
                                             0);
        }

        if (e == NULL) {
            /* the zone is too small: keep what fitted (a prefix of the
             * remembered part, as the blocks went in tail first) */
            sh->failed++;
            break;
        }

        e->key = keys[k];
        e->node = node;
        e->time = now;
        e->next = *b;
        *b = e;
        ngx_queue_insert_head(&sh->nodes[node].lru, &e->queue);
        sh->nodes[node].count++;
        sh->entries++;
    }

    ngx_shmtx_unlock(&z->shpool->mutex);
}


/* ------------------------------------------------------------------ */
/* events: the kv_agent's index file                                   */


static ngx_int_t
ngx_http_dpd_prefix_events_lookup(ngx_http_dpd_prefix_reader_t *rd,
    ngx_http_dpd_balancer_cand_t *cand, ngx_uint_t ncand, uint64_t *keys,
    size_t nkeys, size_t block, size_t *blocks, ngx_log_t *log)
{
    size_t      lo, hi, mid, nmemo, j;
    uint64_t    mask, bit;
    ngx_int_t   node[NGX_HTTP_DPD_PREFIX_MAX_CANDS];
    ngx_uint_t  i, m, found;
    size_t      memo_k[NGX_HTTP_DPD_PREFIX_MEMO];
    uint64_t    memo_m[NGX_HTTP_DPD_PREFIX_MEMO];

    /* at most one stat() (and header read) a second, usable or not */

    if (!rd->ever
        || (ngx_msec_int_t) (ngx_current_msec - rd->checked)
           >= NGX_HTTP_DPD_PREFIX_CHECK)
    {
        ngx_http_dpd_prefix_refresh(rd, log);
    }

    if (!rd->valid) {
        return NGX_DECLINED;
    }

    if (rd->hdr.block_size != block) {
        /* the agent keys other blocks than ours: nothing would match */
        ngx_http_dpd_prefix_fail(rd, log, "block size differs from "
                                 "dpd_prefix_cache block=");
        return NGX_DECLINED;
    }

    found = 0;

    for (i = 0; i < ncand; i++) {
        node[i] = -1;

        if (!cand[i].usable) {
            continue;
        }

        for (m = 0; m < rd->hdr.max_nodes; m++) {
            if ((rd->ready & ((uint64_t) 1 << m))
                && rd->addr_len[m] == cand[i].name.len
                && ngx_memcmp(rd->addr[m], cand[i].name.data,
                              cand[i].name.len) == 0)
            {
                node[i] = m;
                found++;
                break;
            }
        }
    }

    if (found == 0) {
        return NGX_OK;
    }

    nmemo = 0;

    /*
     * Per node: the last held block by binary search (the held blocks of
     * a prompt are a run from block 0, dpd_prefix_index.h), probes shared
     * between nodes through the memo.  An unreadable probe is a miss.
     */

    for (i = 0; i < ncand; i++) {
        if (node[i] < 0) {
            continue;
        }

        bit = (uint64_t) 1 << node[i];

        /*
         * invariant: blocks [0, lo) held, block hi not (hi = nkeys: the
         * end); block 0 first, so that a prompt whose start is gone (or
         * torn) counts as nothing cached whatever follows
         */
        lo = 0;
        hi = nkeys;

        while (lo < hi) {
            mid = (lo == 0) ? 0 : lo + (hi - lo) / 2;

            mask = 0;

            for (j = 0; j < nmemo; j++) {
                if (memo_k[j] == mid) {
                    mask = memo_m[j];
                    break;
                }
            }

            if (j == nmemo) {
                if (ngx_http_dpd_prefix_probe(rd, keys[mid], &mask)
                    != NGX_OK)
                {
                    /* the file went bad under us: nothing cached */
                    ngx_http_dpd_prefix_fail(rd, log,
                                             "short read (shrunk?)");
                    ngx_memzero(blocks, ncand * sizeof(size_t));
                    return NGX_DECLINED;
                }

                if (nmemo < NGX_HTTP_DPD_PREFIX_MEMO) {
                    memo_k[nmemo] = mid;
                    memo_m[nmemo] = mask;
                    nmemo++;
                }
            }

            if (mask & bit) {
                lo = mid + 1;

            } else {
                hi = mid;
            }
        }

        blocks[i] = lo;
    }

    return NGX_OK;
}


/*
 * The slot of "key": *mask its GPU bits (0: absent, or unreadable after
 * DPD_PFX_READ_TRIES).  NGX_ERROR: a short read (the file shrank).
 */

static ngx_int_t
ngx_http_dpd_prefix_probe(ngx_http_dpd_prefix_reader_t *rd, uint64_t key,
    uint64_t *mask)
{
    ssize_t          want;
    uint64_t         i, idx, home, nslots;
    uint32_t         seqs[NGX_HTTP_DPD_PREFIX_PROBE_CHUNK];
    ngx_uint_t       j, n, tries, ok;
    dpd_pfx_slot_t   chunk[NGX_HTTP_DPD_PREFIX_PROBE_CHUNK];
    dpd_pfx_slot_t   again[NGX_HTTP_DPD_PREFIX_PROBE_CHUNK];

    *mask = 0;
    nslots = rd->hdr.nslots;
    home = dpd_pfx_home(&rd->hdr, key);   /* salted: dpd_prefix_index.h */

    for (i = 0; i < rd->hdr.max_probe; i += n) {

        idx = (home + i) & (nslots - 1);

        /* a chunk of consecutive slots, not past the array's end */
        n = ngx_min(NGX_HTTP_DPD_PREFIX_PROBE_CHUNK, nslots - idx);
        n = ngx_min(n, rd->hdr.max_probe - i);
        want = n * sizeof(dpd_pfx_slot_t);

        for (tries = 0; tries < DPD_PFX_READ_TRIES; tries++) {

            if (ngx_http_dpd_prefix_pread(rd->fd, chunk, want,
                                          dpd_pfx_slot_off(&rd->hdr, idx))
                != want)
            {
                return NGX_ERROR;
            }

            ok = 1;

            for (j = 0; j < n; j++) {
                seqs[j] = chunk[j].seq;
                if (seqs[j] & 1) {
                    ok = 0;
                }
            }

            if (!ok) {
                continue;
            }

            /* the seqlock's second load: the same seqs, so no write ran
             * between (a pread() is not atomic, the seqs frame it) */

            if (ngx_http_dpd_prefix_pread(rd->fd, again, want,
                                          dpd_pfx_slot_off(&rd->hdr, idx))
                != want)
            {
                return NGX_ERROR;
            }

            for (j = 0; j < n; j++) {
                if (again[j].seq != seqs[j]
                    || ngx_memcmp(&again[j], &chunk[j],
                                  sizeof(dpd_pfx_slot_t)) != 0)
                {
                    ok = 0;
                }
            }

            if (ok) {
                break;
            }
        }

        if (tries == DPD_PFX_READ_TRIES) {
            /* still being written: unknown, a miss */
            return NGX_OK;
        }

        for (j = 0; j < n; j++) {
            if (chunk[j].key == 0) {
                return NGX_OK;
            }

            if (chunk[j].key == key) {
                *mask = chunk[j].gpu_mask;
                return NGX_OK;
            }
        }
    }

    return NGX_OK;
}


static void
ngx_http_dpd_prefix_refresh(ngx_http_dpd_prefix_reader_t *rd, ngx_log_t *log)
{
    ngx_fd_t          fd;
    ngx_err_t         err;
    uint32_t          m, tries;
    ngx_file_info_t   fi;
    dpd_pfx_node_t    nd;
    dpd_pfx_header_t  h;
    uint32_t          s2;
    uint64_t          off, now;
    ngx_time_t       *tp;
    u_char           *p;
    u_char            why[160];

    rd->checked = ngx_current_msec;
    rd->ever = 1;
    rd->dead = 0;

    if (ngx_file_info(rd->path.data, &fi) == NGX_FILE_ERROR) {
        err = ngx_errno;

        if (rd->fd != NGX_INVALID_FILE) {
            (void) ngx_close_file(rd->fd);
            rd->fd = NGX_INVALID_FILE;
        }

        /* EACCES: the worker's user may not reach it */
        ngx_http_dpd_prefix_fail(rd, log, err == NGX_ENOENT
                                 ? "missing" : "cannot stat (permissions?)");
        return;
    }

    if (rd->fd != NGX_INVALID_FILE
        && (fi.st_ino != rd->ino || fi.st_dev != rd->dev))
    {
        (void) ngx_close_file(rd->fd);
        rd->fd = NGX_INVALID_FILE;
    }

    if (rd->fd == NGX_INVALID_FILE) {
        if (!S_ISREG(fi.st_mode)) {
            ngx_http_dpd_prefix_fail(rd, log, "not a regular file");
            return;
        }

        fd = open((char *) rd->path.data, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
        if (fd == -1) {
            ngx_http_dpd_prefix_fail(rd, log, "cannot open (permissions?)");
            return;
        }

        if (fstat(fd, &fi) == -1 || !S_ISREG(fi.st_mode)) {
            (void) close(fd);
            ngx_http_dpd_prefix_fail(rd, log, "changed while opening");
            return;
        }

        rd->fd = fd;
        rd->dev = fi.st_dev;
        rd->ino = fi.st_ino;

    } else if (fstat(rd->fd, &fi) == -1) {
        ngx_http_dpd_prefix_fail(rd, log, "cannot stat");
        return;
    }

    if (ngx_http_dpd_prefix_pread(rd->fd, &h, sizeof(h), 0)
        != (ssize_t) sizeof(h))
    {
        ngx_http_dpd_prefix_fail(rd, log, "truncated");
        return;
    }

    if (h.magic == DPD_PFX_MAGIC && h.version != DPD_PFX_VERSION) {
        /* an agent of another release: its layout or slot positions
         * differ (version 1 had unsalted homes): every probe would look
         * in the wrong place; refused, said once per change */
        p = ngx_snprintf(why, sizeof(why) - 1, "index ABI version %uD, "
                         "this module reads version %d (kv_agent and "
                         "nginx module of different releases)",
                         h.version, DPD_PFX_VERSION);
        *p = '\0';
        ngx_http_dpd_prefix_fail(rd, log, (char *) why);
        return;
    }

    if (dpd_pfx_check(&h, (uint64_t) fi.st_size) != 0) {
        ngx_http_dpd_prefix_fail(rd, log, "corrupt, foreign or truncated "
                                 "(header does not describe the file)");
        return;
    }

    /*
     * The writer's liveness (dpd_prefix_index.h): a clean exit clears
     * writer_alive, a kill leaves the heartbeat behind.  Either way the
     * engines go on evicting and storing without the file following:
     * what it says would pin requests on decoders that no longer hold
     * their prefix.  Cache-blind until a writer beats again.
     */
    tp = ngx_timeofday();
    now = (uint64_t) tp->sec * 1000 + tp->msec;

    if (!h.writer_alive
        || (now > h.updated_ms && now - h.updated_ms > rd->stale))
    {
        rd->dead = 1;
        p = ngx_snprintf(why, sizeof(why) - 1, "%s (kv_agent pid %uD): "
                         "stale", h.writer_alive
                         ? "no writer heartbeat within stale="
                         : "the writer exited", h.writer_pid);
        *p = '\0';
        ngx_http_dpd_prefix_fail(rd, log, (char *) why);
        return;
    }

    rd->hdr = h;
    rd->ready = 0;

    for (m = 0; m < h.max_nodes; m++) {
        off = h.nodes_off + (uint64_t) m * sizeof(dpd_pfx_node_t);

        for (tries = 0; tries < DPD_PFX_READ_TRIES; tries++) {
            if (ngx_http_dpd_prefix_pread(rd->fd, &nd, sizeof(nd), off)
                != (ssize_t) sizeof(nd)
                || ngx_http_dpd_prefix_pread(rd->fd, &s2, sizeof(s2), off)
                   != (ssize_t) sizeof(s2))
            {
                ngx_http_dpd_prefix_fail(rd, log, "short read (shrunk?)");
                return;
            }

            if (!(nd.seq & 1) && nd.seq == s2) {
                break;
            }
        }

        if (tries == DPD_PFX_READ_TRIES) {
            continue;                 /* being written: not ready */
        }

        if ((nd.flags & (DPD_PFX_NODE_USED | DPD_PFX_NODE_READY))
            != (DPD_PFX_NODE_USED | DPD_PFX_NODE_READY))
        {
            continue;
        }

        nd.http_addr[DPD_PFX_ADDR_LEN - 1] = '\0';
        rd->addr_len[m] = ngx_strlen(nd.http_addr);
        ngx_memcpy(rd->addr[m], nd.http_addr, rd->addr_len[m]);
        rd->ready |= (uint64_t) 1 << m;
    }

    if (!rd->valid && rd->reason_len) {
        ngx_log_error(NGX_LOG_NOTICE, log, 0,
                      "dpd prefix index \"%V\" usable again (block %uD, "
                      "%uL slots)", &rd->path, h.block_size, h.nslots);
    }

    rd->valid = 1;
    rd->reason_len = 0;
}


/* a failed index: no cache information; warn on changes, once a minute */

static void
ngx_http_dpd_prefix_fail(ngx_http_dpd_prefix_reader_t *rd, ngx_log_t *log,
    const char *reason)
{
    size_t  len;
    time_t  now;

    rd->valid = 0;

    len = ngx_strlen(reason);
    now = ngx_time();

    if (len == rd->reason_len && ngx_memcmp(rd->reason, reason, len) == 0
        && now - rd->last_warn < NGX_HTTP_DPD_PREFIX_WARN_EVERY)
    {
        return;
    }

    rd->reason_len = ngx_min(len, sizeof(rd->reason));
    ngx_memcpy(rd->reason, reason, rd->reason_len);
    rd->last_warn = now;

    ngx_log_error(NGX_LOG_WARN, log, 0,
                  "dpd prefix index \"%V\": %s: routing as if nothing "
                  "were cached", &rd->path, reason);
}


/* bytes read (fewer at the end of the file), -1 on an error */

static ssize_t
ngx_http_dpd_prefix_pread(ngx_fd_t fd, void *buf, size_t size, uint64_t off)
{
    size_t   done;
    ssize_t  n;

    if (off > (uint64_t) NGX_MAX_OFF_T_VALUE - size) {
        return 0;
    }

    for (done = 0; done < size; done += n) {
        n = pread(fd, (u_char *) buf + done, size - done,
                  (off_t) (off + done));

        if (n == -1) {
            if (ngx_errno == NGX_EINTR) {
                n = 0;
                continue;
            }

            return -1;
        }

        if (n == 0) {
            break;
        }
    }

    return done;
}
