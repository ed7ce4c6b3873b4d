/*
 * ngx_http_dpd_state_module: the reader side of the kv_agent readiness
 * table (docs/state.md, kv_agent/include/dpd_state.h).
 *
 * Each worker maps the file read-only in init_process and, at most once
 * per "check" interval, stat()s the path: a new inode, size or header
 * generation (the agent replaces the file by write-to-temp + rename) makes
 * it map the new file.  A missing, truncated or corrupt file means "no
 * readiness information": lookups decline, a warning is logged when the
 * condition changes and at most once a minute while it lasts.  The table
 * geometry is validated once per mapping and kept here, so no offset read
 * later from the shared file is ever trusted.
 */


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "ngx_http_dpd_state.h"


#define NGX_HTTP_DPD_STATE_MAX_SIZE     (1024 * 1024 * 1024)
#define NGX_HTTP_DPD_STATE_WARN_EVERY   60      /* seconds */
#define NGX_HTTP_DPD_STATE_REASON_LEN   160
#define NGX_HTTP_DPD_STATE_MAX_SHOWN    4096    /* nodes in the status */


typedef struct {
    ngx_str_t        path;              /* NUL-terminated */
    ngx_msec_t       stale;             /* 0: never stale */
    ngx_msec_t       check;

    ngx_str_t        reqid_var;         /* "dpd_request_id" */
    ngx_uint_t       reqid_key;

    /* per worker, after fork */
    u_char          *map;
    size_t           size;
    dev_t            dev;
    ino_t            ino;
    uint64_t         generation;
    uint64_t         nodes_off;         /* validated copies of the header */
    uint64_t         reqs_off;
    uint32_t         max_nodes;
    uint32_t         max_reqs;

    ngx_msec_t       last_check;
    ngx_uint_t       checked;           /* unsigned:1 */
    time_t           last_warn;
    u_char           reason[NGX_HTTP_DPD_STATE_REASON_LEN];
    size_t           reason_len;
} ngx_http_dpd_state_main_conf_t;


static void *ngx_http_dpd_state_create_main_conf(ngx_conf_t *cf);
static char *ngx_http_dpd_state_table(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
static char *ngx_http_dpd_state_status(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
static ngx_int_t ngx_http_dpd_state_add_variables(ngx_conf_t *cf);
static ngx_int_t ngx_http_dpd_state_init_process(ngx_cycle_t *cycle);
static void ngx_http_dpd_state_exit_process(ngx_cycle_t *cycle);

static ngx_http_dpd_state_main_conf_t *ngx_http_dpd_state_get(
    ngx_http_request_t *r);
static void ngx_http_dpd_state_refresh(ngx_http_dpd_state_main_conf_t *smcf,
    ngx_log_t *log, ngx_uint_t force);
static void ngx_http_dpd_state_unmap(ngx_http_dpd_state_main_conf_t *smcf);
static void ngx_http_dpd_state_fail(ngx_http_dpd_state_main_conf_t *smcf,
    ngx_log_t *log, const char *fmt, ...);
static ngx_int_t ngx_http_dpd_state_validate(
    ngx_http_dpd_state_main_conf_t *smcf, u_char *map, size_t size,
    ngx_log_t *log);
static uint64_t ngx_http_dpd_state_now_ms(void);
static ngx_flag_t ngx_http_dpd_state_stale(
    ngx_http_dpd_state_main_conf_t *smcf);
static ngx_flag_t ngx_http_dpd_state_fresh(
    ngx_http_dpd_state_main_conf_t *smcf);
static ngx_int_t ngx_http_dpd_state_read_node(
    ngx_http_dpd_state_main_conf_t *smcf, uint32_t i,
    ngx_http_dpd_state_node_t *out);
static ngx_int_t ngx_http_dpd_state_find_req(
    ngx_http_dpd_state_main_conf_t *smcf, u_char *id, size_t len,
    dpd_req_rec_t *rec);
static ngx_int_t ngx_http_dpd_state_request_id(ngx_http_request_t *r,
    ngx_http_dpd_state_main_conf_t *smcf, ngx_str_t *id);
static ngx_int_t ngx_http_dpd_state_variable(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, uintptr_t data);
static ngx_int_t ngx_http_dpd_state_status_handler(ngx_http_request_t *r);
static ngx_int_t ngx_http_dpd_state_lookup_handler(ngx_http_request_t *r,
    ngx_str_t *addr, ngx_str_t *req);
static ngx_int_t ngx_http_dpd_state_arg(ngx_http_request_t *r, char *name,
    size_t len, ngx_str_t *value);
static ngx_int_t ngx_http_dpd_state_send(ngx_http_request_t *r,
    ngx_uint_t status, ngx_buf_t *b);
static u_char *ngx_http_dpd_state_copy_str(u_char *dst, const char *src,
    size_t max);


static ngx_command_t  ngx_http_dpd_state_commands[] = {

    { ngx_string("dpd_state_table"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE123,
      ngx_http_dpd_state_table,
      NGX_HTTP_MAIN_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("dpd_state_status"),
      NGX_HTTP_LOC_CONF|NGX_CONF_NOARGS,
      ngx_http_dpd_state_status,
      0,
      0,
      NULL },

      ngx_null_command
};


static ngx_http_module_t  ngx_http_dpd_state_module_ctx = {
    ngx_http_dpd_state_add_variables,      /* preconfiguration */
    NULL,                                  /* postconfiguration */

    ngx_http_dpd_state_create_main_conf,   /* create main configuration */
    NULL,                                  /* init main configuration */

    NULL,                                  /* create server configuration */
    NULL,                                  /* merge server configuration */

    NULL,                                  /* create location configuration */
    NULL                                   /* merge location configuration */
};


ngx_module_t  ngx_http_dpd_state_module = {
    NGX_MODULE_V1,
    &ngx_http_dpd_state_module_ctx,        /* module context */
    ngx_http_dpd_state_commands,           /* module directives */
    NGX_HTTP_MODULE,                       /* module type */
    NULL,                                  /* init master */
    NULL,                                  /* init module */
    ngx_http_dpd_state_init_process,       /* init process */
    NULL,                                  /* init thread */
    NULL,                                  /* exit thread */
    ngx_http_dpd_state_exit_process,       /* exit process */
    NULL,                                  /* exit master */
    NGX_MODULE_V1_PADDING
};


#define NGX_HTTP_DPD_STATE_VAR_KV_STATE      0
#define NGX_HTTP_DPD_STATE_VAR_NODES_ALIVE   1


static ngx_http_variable_t  ngx_http_dpd_state_vars[] = {

    { ngx_string("dpd_kv_state"), NULL, ngx_http_dpd_state_variable,
      NGX_HTTP_DPD_STATE_VAR_KV_STATE, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("dpd_kv_nodes_alive"), NULL, ngx_http_dpd_state_variable,
      NGX_HTTP_DPD_STATE_VAR_NODES_ALIVE, NGX_HTTP_VAR_NOCACHEABLE, 0 },

      ngx_http_null_variable
};


static ngx_str_t  ngx_http_dpd_state_reqid_header = ngx_string("X-Request-Id");


static void *
ngx_http_dpd_state_create_main_conf(ngx_conf_t *cf)
{
    ngx_http_dpd_state_main_conf_t  *smcf;

    smcf = ngx_pcalloc(cf->pool, sizeof(ngx_http_dpd_state_main_conf_t));
    if (smcf == NULL) {
        return NULL;
    }

    /*
     * set by ngx_pcalloc():
     *
     *     smcf->path = { 0, NULL };
     *     smcf->map = NULL;
     *     smcf->checked = 0;
     */

    smcf->stale = NGX_CONF_UNSET_MSEC;
    smcf->check = NGX_CONF_UNSET_MSEC;

    ngx_str_set(&smcf->reqid_var, "dpd_kv_request_id");
    smcf->reqid_key = ngx_hash_key(smcf->reqid_var.data, smcf->reqid_var.len);

    return smcf;
}


static char *
ngx_http_dpd_state_table(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_dpd_state_main_conf_t *smcf = conf;

    ngx_str_t   *value, s;
    ngx_msec_t   ms;
    ngx_uint_t   i;

    if (smcf->path.data) {
        return "is duplicate";
    }

    value = cf->args->elts;

    if (value[1].len == 0) {
        return "has an empty path";
    }

    /* a NUL-terminated copy: open() and stat() take it as is */

    smcf->path.len = value[1].len;
    smcf->path.data = ngx_pnalloc(cf->pool, value[1].len + 1);
    if (smcf->path.data == NULL) {
        return NGX_CONF_ERROR;
    }

    ngx_memcpy(smcf->path.data, value[1].data, value[1].len);
    smcf->path.data[value[1].len] = '\0';

    smcf->stale = 5000;
    smcf->check = 1000;

    for (i = 2; i < cf->args->nelts; i++) {

        if (ngx_strncmp(value[i].data, "stale=", 6) == 0) {
            s.data = value[i].data + 6;
            s.len = value[i].len - 6;

            ms = ngx_parse_time(&s, 0);
            if (ms == (ngx_msec_t) NGX_ERROR) {
                goto invalid;
            }

            smcf->stale = ms;
            continue;
        }

        if (ngx_strncmp(value[i].data, "check=", 6) == 0) {
            s.data = value[i].data + 6;
            s.len = value[i].len - 6;

            ms = ngx_parse_time(&s, 0);
            if (ms == (ngx_msec_t) NGX_ERROR) {
                goto invalid;
            }

            smcf->check = ms;
            continue;
        }

        goto invalid;
    }

    return NGX_CONF_OK;

invalid:

    ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                       "invalid parameter \"%V\"", &value[i]);

    return NGX_CONF_ERROR;
}


static char *
ngx_http_dpd_state_status(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_core_loc_conf_t  *clcf;

    clcf = ngx_http_conf_get_module_loc_conf(cf, ngx_http_core_module);
    clcf->handler = ngx_http_dpd_state_status_handler;

    return NGX_CONF_OK;
}


static ngx_int_t
ngx_http_dpd_state_add_variables(ngx_conf_t *cf)
{
    ngx_http_variable_t  *var, *v;

    for (v = ngx_http_dpd_state_vars; v->name.len; v++) {
        var = ngx_http_add_variable(cf, &v->name, v->flags);
        if (var == NULL) {
            return NGX_ERROR;
        }

        var->get_handler = v->get_handler;
        var->data = v->data;
    }

    return NGX_OK;
}


static ngx_int_t
ngx_http_dpd_state_init_process(ngx_cycle_t *cycle)
{
    ngx_http_dpd_state_main_conf_t  *smcf;

    /* NULL without an http{} block */

    smcf = ngx_http_cycle_get_module_main_conf(cycle,
                                               ngx_http_dpd_state_module);

    if (smcf == NULL || smcf->path.len == 0) {
        return NGX_OK;
    }

    ngx_http_dpd_state_refresh(smcf, cycle->log, 1);

    return NGX_OK;
}


static void
ngx_http_dpd_state_exit_process(ngx_cycle_t *cycle)
{
    ngx_http_dpd_state_main_conf_t  *smcf;

    smcf = ngx_http_cycle_get_module_main_conf(cycle,
                                               ngx_http_dpd_state_module);

    if (smcf != NULL) {
        ngx_http_dpd_state_unmap(smcf);
    }
}


/* The main conf with a mapping as current as the check interval allows. */

static ngx_http_dpd_state_main_conf_t *
ngx_http_dpd_state_get(ngx_http_request_t *r)
{
    ngx_http_dpd_state_main_conf_t  *smcf;

    smcf = ngx_http_get_module_main_conf(r, ngx_http_dpd_state_module);

    if (smcf == NULL || smcf->path.len == 0) {
        return NULL;
    }

    ngx_http_dpd_state_refresh(smcf, r->connection->log, 0);

    return smcf;
}


static void
ngx_http_dpd_state_refresh(ngx_http_dpd_state_main_conf_t *smcf,
    ngx_log_t *log, ngx_uint_t force)
{
    int                        fd;
    u_char                    *map;
    uint64_t                   gen;
    ngx_err_t                  err;
    ngx_file_info_t            fi;
    const dpd_state_header_t  *h;

    if (!force && smcf->checked
        && ngx_current_msec - smcf->last_check < smcf->check)
    {
        return;
    }

    smcf->checked = 1;
    smcf->last_check = ngx_current_msec;

    if (ngx_file_info(smcf->path.data, &fi) == NGX_FILE_ERROR) {
        err = ngx_errno;
        ngx_http_dpd_state_unmap(smcf);
        ngx_http_dpd_state_fail(smcf, log, "%s (%s)",
                                err == NGX_ENOENT ? "missing"
                                                  : "cannot stat",
                                strerror(err));
        return;
    }

    if (smcf->map) {
        h = (const dpd_state_header_t *) smcf->map;
        gen = __atomic_load_n(&h->generation, __ATOMIC_ACQUIRE);

        if (fi.st_ino == smcf->ino && fi.st_dev == smcf->dev
            && (size_t) fi.st_size == smcf->size && gen == smcf->generation)
        {
            return;
        }

        /* replaced (or resized in place): map whatever is there now */
        ngx_http_dpd_state_unmap(smcf);
    }

    if (!S_ISREG(fi.st_mode)) {
        ngx_http_dpd_state_fail(smcf, log, "not a regular file");
        return;
    }

    if ((size_t) fi.st_size < sizeof(dpd_state_header_t)) {
        ngx_http_dpd_state_fail(smcf, log, "truncated (%uz bytes)",
                                (size_t) fi.st_size);
        return;
    }

    if (fi.st_size > NGX_HTTP_DPD_STATE_MAX_SIZE) {
        ngx_http_dpd_state_fail(smcf, log, "too large (%O bytes)",
                                fi.st_size);
        return;
    }

    fd = open((char *) smcf->path.data, O_RDONLY | O_CLOEXEC);
    if (fd == -1) {
        err = ngx_errno;
        ngx_http_dpd_state_fail(smcf, log, "cannot open (%s)",
                                strerror(err));
        return;
    }

    /* the path may have been replaced between stat() and open() */

    if (fstat(fd, &fi) == -1
        || (size_t) fi.st_size < sizeof(dpd_state_header_t)
        || fi.st_size > NGX_HTTP_DPD_STATE_MAX_SIZE)
    {
        close(fd);
        ngx_http_dpd_state_fail(smcf, log, "changed while opening");
        return;
    }

    map = mmap(NULL, (size_t) fi.st_size, PROT_READ, MAP_SHARED, fd, 0);
    err = ngx_errno;
    close(fd);

    if (map == MAP_FAILED) {
        ngx_http_dpd_state_fail(smcf, log, "cannot map (%s)",
                                strerror(err));
        return;
    }

    if (ngx_http_dpd_state_validate(smcf, map, (size_t) fi.st_size, log)
        != NGX_OK)
    {
        munmap(map, (size_t) fi.st_size);
        return;
    }

    smcf->map = map;
    smcf->size = (size_t) fi.st_size;
    smcf->dev = fi.st_dev;
    smcf->ino = fi.st_ino;

    h = (const dpd_state_header_t *) map;

    ngx_log_error(NGX_LOG_NOTICE, log, 0,
                  "dpd_state: mapped table \"%V\" (writer pid %uD, "
                  "generation %uL, %uD nodes, %uD requests)",
                  &smcf->path, h->writer_pid, smcf->generation,
                  smcf->max_nodes, smcf->max_reqs);

    smcf->reason_len = 0;
}


/*
 * Checks a fresh mapping and keeps the geometry: every offset is checked
 * against the mapped size with overflow-safe arithmetic before
 * dpd_state_check() (which adds offsets) is trusted.
 */

static ngx_int_t
ngx_http_dpd_state_validate(ngx_http_dpd_state_main_conf_t *smcf,
    u_char *map, size_t size, ngx_log_t *log)
{
    uint64_t                   file_size, nodes_off, reqs_off;
    uint32_t                   max_nodes, max_reqs;
    const dpd_state_header_t  *h;

    h = (const dpd_state_header_t *) map;

    if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != DPD_STATE_MAGIC) {
        ngx_http_dpd_state_fail(smcf, log, "corrupt (bad magic)");
        return NGX_ERROR;
    }

    if (h->version != DPD_STATE_VERSION) {
        ngx_http_dpd_state_fail(smcf, log, "wrong version %uD (want %uD)",
                                h->version, (uint32_t) DPD_STATE_VERSION);
        return NGX_ERROR;
    }

    file_size = h->file_size;
    nodes_off = h->nodes_off;
    reqs_off = h->reqs_off;
    max_nodes = h->max_nodes;
    max_reqs = h->max_reqs;

    /* products of uint32 counts and record sizes fit in 64 bits */

    if (file_size > size) {
        ngx_http_dpd_state_fail(smcf, log, "truncated (%uz of %uL bytes)",
                                size, file_size);
        return NGX_ERROR;
    }

    if (nodes_off < sizeof(dpd_state_header_t)
        || nodes_off > file_size
        || reqs_off < nodes_off
        || reqs_off > file_size
        || (uint64_t) max_nodes * sizeof(dpd_node_rec_t)
           > reqs_off - nodes_off
        || (uint64_t) max_reqs * sizeof(dpd_req_rec_t)
           > file_size - reqs_off
        || nodes_off % 8 || reqs_off % 8
        || max_reqs == 0
        || dpd_state_check(map, size) != 0)
    {
        ngx_http_dpd_state_fail(smcf, log, "corrupt (bad sizes)");
        return NGX_ERROR;
    }

    smcf->nodes_off = nodes_off;
    smcf->reqs_off = reqs_off;
    smcf->max_nodes = max_nodes;
    smcf->max_reqs = max_reqs;
    smcf->generation = __atomic_load_n(&h->generation, __ATOMIC_ACQUIRE);

    return NGX_OK;
}


static void
ngx_http_dpd_state_unmap(ngx_http_dpd_state_main_conf_t *smcf)
{
    if (smcf->map) {
        munmap(smcf->map, smcf->size);
        smcf->map = NULL;
        smcf->size = 0;
    }
}


/*
 * Remembers why there is no table (the status handler shows it) and warns:
 * a new reason at most once a second, the same one once a minute.
 */

static void
ngx_http_dpd_state_fail(ngx_http_dpd_state_main_conf_t *smcf, ngx_log_t *log,
    const char *fmt, ...)
{
    u_char      *p;
    size_t       len;
    time_t       now;
    va_list      args;
    ngx_uint_t   same;
    u_char       buf[NGX_HTTP_DPD_STATE_REASON_LEN];

    va_start(args, fmt);
    p = ngx_vslprintf(buf, buf + sizeof(buf), fmt, args);
    va_end(args);

    len = p - buf;
    same = (len == smcf->reason_len
            && ngx_memcmp(buf, smcf->reason, len) == 0);

    ngx_memcpy(smcf->reason, buf, len);
    smcf->reason_len = len;

    now = ngx_time();

    if (smcf->last_warn
        && now - smcf->last_warn < (same ? NGX_HTTP_DPD_STATE_WARN_EVERY : 1))
    {
        return;
    }

    smcf->last_warn = now;

    ngx_log_error(NGX_LOG_WARN, log, 0,
                  "dpd_state: table \"%V\" %*s: no readiness information",
                  &smcf->path, len, buf);
}


static uint64_t
ngx_http_dpd_state_now_ms(void)
{
    ngx_time_t  *tp;

    tp = ngx_timeofday();

    return (uint64_t) tp->sec * 1000 + tp->msec;
}


/* The writer has not written for longer than "stale" (killed, hung). */

static ngx_flag_t
ngx_http_dpd_state_stale(ngx_http_dpd_state_main_conf_t *smcf)
{
    uint64_t                   updated;
    const dpd_state_header_t  *h;

    if (smcf->stale == 0) {
        return 0;
    }

    h = (const dpd_state_header_t *) smcf->map;
    updated = __atomic_load_n(&h->updated_ms, __ATOMIC_ACQUIRE);

    return updated + smcf->stale < ngx_http_dpd_state_now_ms();
}


/* The writer runs and its records are current. */

static ngx_flag_t
ngx_http_dpd_state_fresh(ngx_http_dpd_state_main_conf_t *smcf)
{
    const dpd_state_header_t  *h;

    h = (const dpd_state_header_t *) smcf->map;

    return __atomic_load_n(&h->writer_alive, __ATOMIC_ACQUIRE) != 0
           && !ngx_http_dpd_state_stale(smcf);
}


/* NGX_OK: a used node slot copied; NGX_DECLINED: empty or unstable. */

static ngx_int_t
ngx_http_dpd_state_read_node(ngx_http_dpd_state_main_conf_t *smcf,
    uint32_t i, ngx_http_dpd_state_node_t *out)
{
    uint64_t        now;
    dpd_node_rec_t  rec;
    const u_char   *p;

    p = smcf->map + smcf->nodes_off + (uint64_t) i * sizeof(dpd_node_rec_t);

    if (dpd_state_read_rec(p, &rec, sizeof(rec)) != 0) {
        return NGX_DECLINED;
    }

    if (!(rec.flags & DPD_NODE_USED)) {
        return NGX_DECLINED;
    }

    ngx_http_dpd_state_copy_str(out->id, rec.id, sizeof(rec.id));
    ngx_http_dpd_state_copy_str(out->http_addr, rec.http_addr,
                                sizeof(rec.http_addr));

    out->role = rec.role;
    out->self = (rec.flags & DPD_NODE_SELF) ? 1 : 0;
    out->alive = (rec.flags & DPD_NODE_ALIVE)
                 && ngx_http_dpd_state_fresh(smcf);
    out->free_blocks = rec.free_blocks;
    out->total_blocks = rec.total_blocks;
    out->block_bytes = rec.block_bytes;
    out->inflight = rec.inflight;

    if (rec.last_heartbeat_ms == 0) {
        out->heartbeat_age = -1;

    } else {
        now = ngx_http_dpd_state_now_ms();
        out->heartbeat_age = now > rec.last_heartbeat_ms
                             ? (ngx_msec_int_t) (now - rec.last_heartbeat_ms)
                             : 0;
    }

    return NGX_OK;
}


/*
 * The probe of dpd_state_find_req() over the geometry validated at map
 * time.  NGX_OK: found; NGX_DECLINED: absent; NGX_ERROR: unstable.
 */

static ngx_int_t
ngx_http_dpd_state_find_req(ngx_http_dpd_state_main_conf_t *smcf, u_char *id,
    size_t len, dpd_req_rec_t *rec)
{
    size_t          cmp;
    uint32_t        i, idx, probe;
    uint64_t        hash, slot_hash;
    const u_char   *reqs, *p;

    hash = dpd_state_hash(id, len);
    cmp = ngx_min(len, DPD_STATE_REQID_LEN - 1);
    reqs = smcf->map + smcf->reqs_off;
    probe = ngx_min(smcf->max_reqs, DPD_STATE_MAX_PROBE);

    for (i = 0; i < probe; i++) {
        idx = (uint32_t) ((hash + i) % smcf->max_reqs);
        p = reqs + (uint64_t) idx * sizeof(dpd_req_rec_t);

        slot_hash = __atomic_load_n(
                         &((const dpd_req_rec_t *) p)->id_hash,
                         __ATOMIC_ACQUIRE);

        if (slot_hash == 0) {
            return NGX_DECLINED;
        }

        if (slot_hash != hash) {
            continue;
        }

        if (dpd_state_read_rec(p, rec, sizeof(*rec)) != 0) {
            return NGX_ERROR;
        }

        if (rec->id_hash == hash && rec->state != DPD_REQ_FREE
            && ngx_strncmp(rec->req_id, id, cmp) == 0
            && rec->req_id[cmp] == '\0')
        {
            /* a state this reader does not know is no answer */
            return rec->state <= DPD_REQ_FAILED ? NGX_OK : NGX_ERROR;
        }
    }

    return NGX_DECLINED;
}


ngx_flag_t
ngx_http_dpd_state_enabled(ngx_http_request_t *r)
{
    ngx_http_dpd_state_main_conf_t  *smcf;

    smcf = ngx_http_dpd_state_get(r);

    return smcf != NULL && smcf->map != NULL;
}


ngx_int_t
ngx_http_dpd_state_node_by_addr(ngx_http_request_t *r, ngx_str_t *http_addr,
    ngx_http_dpd_state_node_t *out)
{
    uint32_t                         i;
    ngx_int_t                        rc;
    ngx_http_dpd_state_node_t        node;
    ngx_http_dpd_state_main_conf_t  *smcf;

    smcf = ngx_http_dpd_state_get(r);

    if (smcf == NULL || smcf->map == NULL
        || http_addr->len == 0 || http_addr->len >= DPD_STATE_ADDR_LEN)
    {
        return NGX_DECLINED;
    }

    rc = NGX_DECLINED;

    for (i = 0; i < smcf->max_nodes; i++) {

        if (ngx_http_dpd_state_read_node(smcf, i, &node) != NGX_OK) {
            continue;
        }

        if (ngx_strlen(node.http_addr) != http_addr->len
            || ngx_memcmp(node.http_addr, http_addr->data, http_addr->len)
               != 0)
        {
            continue;
        }

        *out = node;
        rc = NGX_OK;

        if (node.alive) {
            break;
        }
    }

    return rc;
}


ngx_int_t
ngx_http_dpd_state_request(ngx_http_request_t *r, ngx_str_t *request_id,
    ngx_http_dpd_state_req_t *out)
{
    dpd_req_rec_t                    rec;
    ngx_http_dpd_state_main_conf_t  *smcf;

    smcf = ngx_http_dpd_state_get(r);

    if (smcf == NULL || smcf->map == NULL || request_id->len == 0) {
        return NGX_DECLINED;
    }

    if (ngx_http_dpd_state_find_req(smcf, request_id->data, request_id->len,
                                    &rec)
        != NGX_OK)
    {
        return NGX_DECLINED;
    }

    out->state = rec.state;
    out->bytes_done = rec.bytes_done;
    out->bytes_total = rec.bytes_total;
    out->t_reserved_ms = rec.t_reserved_ms;
    out->t_start_ms = rec.t_start_ms;
    out->t_done_ms = rec.t_done_ms;
    out->nblocks = rec.nblocks;
    out->error = rec.error;

    ngx_http_dpd_state_copy_str(out->node_id, rec.node_id,
                                sizeof(rec.node_id));
    ngx_http_dpd_state_copy_str(out->peer_id, rec.peer_id,
                                sizeof(rec.peer_id));

    return NGX_OK;
}


/* $dpd_kv_request_id (the KV key) when the core module set it, else the
 * client header. */

static ngx_int_t
ngx_http_dpd_state_request_id(ngx_http_request_t *r,
    ngx_http_dpd_state_main_conf_t *smcf, ngx_str_t *id)
{
    ngx_uint_t                  i;
    ngx_list_part_t            *part;
    ngx_table_elt_t            *h;
    ngx_http_variable_value_t  *vv;

    vv = ngx_http_get_variable(r, &smcf->reqid_var, smcf->reqid_key);

    if (vv != NULL && !vv->not_found && vv->len) {
        id->data = vv->data;
        id->len = vv->len;
        return NGX_OK;
    }

    part = &r->main->headers_in.headers.part;
    h = part->elts;

    for (i = 0; /* void */; i++) {

        if (i >= part->nelts) {
            if (part->next == NULL) {
                return NGX_DECLINED;
            }

            part = part->next;
            h = part->elts;
            i = 0;
        }

        if (h[i].hash != 0
            && h[i].key.len == ngx_http_dpd_state_reqid_header.len
            && ngx_strncasecmp(h[i].key.data,
                               ngx_http_dpd_state_reqid_header.data,
                               h[i].key.len) == 0
            && h[i].value.len)
        {
            *id = h[i].value;
            return NGX_OK;
        }
    }
}


static ngx_int_t
ngx_http_dpd_state_variable(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, uintptr_t data)
{
    u_char                          *p;
    uint32_t                         i;
    ngx_int_t                        rc;
    ngx_str_t                        id;
    ngx_uint_t                       alive;
    dpd_req_rec_t                    rec;
    ngx_http_dpd_state_node_t        node;
    ngx_http_dpd_state_main_conf_t  *smcf;

    v->not_found = 1;

    smcf = ngx_http_dpd_state_get(r);

    if (smcf == NULL || smcf->map == NULL) {
        return NGX_OK;
    }

    switch (data) {

    case NGX_HTTP_DPD_STATE_VAR_KV_STATE:
        if (ngx_http_dpd_state_request_id(r, smcf, &id) != NGX_OK) {
            return NGX_OK;
        }

        rc = ngx_http_dpd_state_find_req(smcf, id.data, id.len, &rec);

        if (rc == NGX_OK) {
            p = (u_char *) dpd_state_req_name(rec.state);

        } else if (rc == NGX_DECLINED) {
            p = (u_char *) "none";

        } else {
            p = (u_char *) "unknown";
        }

        v->len = ngx_strlen(p);
        v->data = p;
        break;

    case NGX_HTTP_DPD_STATE_VAR_NODES_ALIVE:
        alive = 0;

        for (i = 0; i < smcf->max_nodes; i++) {
            if (ngx_http_dpd_state_read_node(smcf, i, &node) == NGX_OK
                && node.alive)
            {
                alive++;
            }
        }

        p = ngx_pnalloc(r->pool, NGX_INT_T_LEN);
        if (p == NULL) {
            return NGX_ERROR;
        }

        v->len = ngx_sprintf(p, "%ui", alive) - p;
        v->data = p;
        break;

    default:
        return NGX_OK;
    }

    v->valid = 1;
    v->not_found = 0;
    v->no_cacheable = 1;

    return NGX_OK;
}


/*
 * Copies a fixed-size string field of the table: stops at NUL or max - 1
 * bytes and replaces anything that is not printable ASCII, a quote or a
 * backslash, so the copy is safe in logs and JSON.  dst holds max bytes.
 */

static u_char *
ngx_http_dpd_state_copy_str(u_char *dst, const char *src, size_t max)
{
    size_t  i;
    u_char  c;

    for (i = 0; i + 1 < max && src[i] != '\0'; i++) {
        c = (u_char) src[i];
        dst[i] = (c < 0x20 || c >= 0x7f || c == '"' || c == '\\') ? '?' : c;
    }

    dst[i] = '\0';

    return dst + i;
}


#define NGX_HTTP_DPD_STATE_NODE_JSON_LEN                                      \
    (sizeof("{\"id\":\"\",\"role\":\"unknown\",\"http\":\"\","                \
            "\"self\":false,\"alive\":false,\"heartbeat_age_ms\":,"           \
            "\"free_blocks\":,\"total_blocks\":,\"block_bytes\":,"            \
            "\"inflight\":},")                                                \
     + DPD_STATE_ID_LEN + DPD_STATE_ADDR_LEN + 4 * NGX_INT64_LEN               \
     + NGX_INT_T_LEN)


static ngx_int_t
ngx_http_dpd_state_status_handler(ngx_http_request_t *r)
{
    size_t                           len;
    u_char                          *p, *sep;
    uint32_t                         i, state;
    uint64_t                         counts[DPD_REQ_FAILED + 1], total, now;
    ngx_int_t                        rc;
    ngx_buf_t                       *b;
    ngx_str_t                        addr, req;
    ngx_uint_t                       nodes_alive, shown;
    const u_char                    *rp;
    ngx_http_dpd_state_node_t        node;
    const dpd_state_header_t        *h;
    ngx_http_dpd_state_main_conf_t  *smcf;
    u_char                           self[DPD_STATE_ID_LEN];

    if (!(r->method & (NGX_HTTP_GET|NGX_HTTP_HEAD))) {
        return NGX_HTTP_NOT_ALLOWED;
    }

    rc = ngx_http_discard_request_body(r);
    if (rc != NGX_OK) {
        return rc;
    }

    /* ?addr=host:port or ?req=ID: one record through the C API */

    rc = ngx_http_dpd_state_arg(r, "addr", 4, &addr);
    if (rc == NGX_ERROR) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    if (rc == NGX_OK) {
        return ngx_http_dpd_state_lookup_handler(r, &addr, NULL);
    }

    rc = ngx_http_dpd_state_arg(r, "req", 3, &req);
    if (rc == NGX_ERROR) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    if (rc == NGX_OK) {
        return ngx_http_dpd_state_lookup_handler(r, NULL, &req);
    }

    smcf = ngx_http_dpd_state_get(r);

    len = sizeof("{\"table\":\"\",\"ok\":false,\"error\":\"\",\"nodes\":[],"
                 "\"requests\":0}\n") + NGX_HTTP_DPD_STATE_REASON_LEN;

    if (smcf != NULL) {
        len += smcf->path.len * 6 + NGX_HTTP_DPD_STATE_REASON_LEN * 5;

        if (smcf->map) {
            len += sizeof(",\"generation\":,\"writer_pid\":,"
                          "\"writer_alive\":false,\"stale\":false,"
                          "\"updated_age_ms\":,\"self\":\"\","
                          "\"max_nodes\":,\"max_reqs\":,\"nodes_alive\":,"
                          "\"requests_by_state\":{\"reserved\":,"
                          "\"transferring\":,\"ready\":,\"failed\":}")
                   + 16 * NGX_INT64_LEN + DPD_STATE_ID_LEN
                   + ngx_min(smcf->max_nodes, NGX_HTTP_DPD_STATE_MAX_SHOWN)
                     * NGX_HTTP_DPD_STATE_NODE_JSON_LEN;
        }
    }

    b = ngx_create_temp_buf(r->pool, len);
    if (b == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    p = b->last;

    if (smcf == NULL || smcf->map == NULL) {
        r->headers_out.status = NGX_HTTP_SERVICE_UNAVAILABLE;

        if (smcf == NULL) {
            p = ngx_cpymem(p, "{\"table\":null,\"ok\":false,"
                           "\"error\":\"no dpd_state_table configured\"",
                           sizeof("{\"table\":null,\"ok\":false,"
                           "\"error\":\"no dpd_state_table configured\"")
                           - 1);

        } else {
            p = ngx_cpymem(p, "{\"table\":\"", sizeof("{\"table\":\"") - 1);
            p = (u_char *) ngx_escape_json(p, smcf->path.data,
                                           smcf->path.len);
            p = ngx_sprintf(p, "\",\"ok\":false,\"error\":\"");
            p = (u_char *) ngx_escape_json(p, smcf->reason,
                                           smcf->reason_len);
            *p++ = '"';
        }

        p = ngx_cpymem(p, ",\"nodes\":[],\"requests\":0}\n",
                       sizeof(",\"nodes\":[],\"requests\":0}\n") - 1);

        goto send;
    }

    r->headers_out.status = NGX_HTTP_OK;

    h = (const dpd_state_header_t *) smcf->map;
    now = ngx_http_dpd_state_now_ms();

    /* the header is not under a seqlock: copy what may change, once */

    ngx_http_dpd_state_copy_str(self, h->self_id, sizeof(h->self_id));
    total = __atomic_load_n(&h->updated_ms, __ATOMIC_ACQUIRE);

    p = ngx_cpymem(p, "{\"table\":\"", sizeof("{\"table\":\"") - 1);
    p = (u_char *) ngx_escape_json(p, smcf->path.data, smcf->path.len);

    p = ngx_sprintf(p, "\",\"ok\":true,\"generation\":%uL,\"writer_pid\":%uD,"
                    "\"writer_alive\":%s,\"stale\":%s,\"updated_age_ms\":%uL,"
                    "\"self\":\"%s\",\"max_nodes\":%uD,\"max_reqs\":%uD,"
                    "\"nodes\":[",
                    smcf->generation, h->writer_pid,
                    __atomic_load_n(&h->writer_alive, __ATOMIC_ACQUIRE)
                    ? "true" : "false",
                    ngx_http_dpd_state_stale(smcf) ? "true" : "false",
                    now > total ? now - total : (uint64_t) 0,
                    self, smcf->max_nodes, smcf->max_reqs);

    nodes_alive = 0;
    shown = 0;
    sep = (u_char *) "";

    for (i = 0; i < smcf->max_nodes; i++) {

        if (ngx_http_dpd_state_read_node(smcf, i, &node) != NGX_OK) {
            continue;
        }

        nodes_alive += node.alive;

        /* the buffer was sized for this many: count the rest only */

        if (shown == NGX_HTTP_DPD_STATE_MAX_SHOWN) {
            continue;
        }

        shown++;

        p = ngx_sprintf(p, "%s{\"id\":\"%s\",\"role\":\"%s\",\"http\":\"%s\","
                        "\"self\":%s,\"alive\":%s,\"heartbeat_age_ms\":%i,"
                        "\"free_blocks\":%uL,\"total_blocks\":%uL,"
                        "\"block_bytes\":%uL,\"inflight\":%ui}",
                        sep, node.id, dpd_state_role_name(node.role),
                        node.http_addr, node.self ? "true" : "false",
                        node.alive ? "true" : "false",
                        (ngx_int_t) node.heartbeat_age, node.free_blocks,
                        node.total_blocks, node.block_bytes, node.inflight);

        sep = (u_char *) ",";
    }

    /* counting needs no consistent copy: one aligned load per field */

    ngx_memzero(counts, sizeof(counts));
    total = 0;
    rp = smcf->map + smcf->reqs_off;

    for (i = 0; i < smcf->max_reqs; i++, rp += sizeof(dpd_req_rec_t)) {

        if (__atomic_load_n(&((const dpd_req_rec_t *) rp)->id_hash,
                            __ATOMIC_RELAXED) == 0)
        {
            continue;
        }

        state = __atomic_load_n(&((const dpd_req_rec_t *) rp)->state,
                                __ATOMIC_RELAXED);

        if (state == DPD_REQ_FREE || state > DPD_REQ_FAILED) {
            continue;
        }

        counts[state]++;
        total++;
    }

    p = ngx_sprintf(p, "],\"nodes_alive\":%ui,\"requests\":%uL,"
                    "\"requests_by_state\":{\"reserved\":%uL,"
                    "\"transferring\":%uL,\"ready\":%uL,\"failed\":%uL}}\n",
                    nodes_alive, total, counts[DPD_REQ_RESERVED],
                    counts[DPD_REQ_TRANSFERRING], counts[DPD_REQ_READY],
                    counts[DPD_REQ_FAILED]);

send:

    b->last = p;

    return ngx_http_dpd_state_send(r, r->headers_out.status, b);
}


static ngx_int_t
ngx_http_dpd_state_lookup_handler(ngx_http_request_t *r, ngx_str_t *addr,
    ngx_str_t *req)
{
    u_char                     *p;
    ngx_buf_t                  *b;
    ngx_uint_t                  status;
    ngx_http_dpd_state_req_t    rec;
    ngx_http_dpd_state_node_t   node;

    b = ngx_create_temp_buf(r->pool, NGX_HTTP_DPD_STATE_NODE_JSON_LEN
                                     + sizeof(ngx_http_dpd_state_req_t) * 2
                                     + 512);
    if (b == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    p = b->last;
    status = NGX_HTTP_OK;

    if (!ngx_http_dpd_state_enabled(r)) {
        status = NGX_HTTP_SERVICE_UNAVAILABLE;
        p = ngx_sprintf(p, "{\"ok\":false,\"error\":\"no table\"}\n");

    } else if (addr) {

        if (ngx_http_dpd_state_node_by_addr(r, addr, &node) != NGX_OK) {
            status = NGX_HTTP_NOT_FOUND;
            p = ngx_sprintf(p, "{\"ok\":false,\"error\":\"unknown node\"}\n");

        } else {
            p = ngx_sprintf(p, "{\"id\":\"%s\",\"role\":\"%s\","
                            "\"http\":\"%s\",\"self\":%s,\"alive\":%s,"
                            "\"heartbeat_age_ms\":%i,\"free_blocks\":%uL,"
                            "\"total_blocks\":%uL,\"block_bytes\":%uL,"
                            "\"inflight\":%ui}\n",
                            node.id, dpd_state_role_name(node.role),
                            node.http_addr, node.self ? "true" : "false",
                            node.alive ? "true" : "false",
                            (ngx_int_t) node.heartbeat_age, node.free_blocks,
                            node.total_blocks, node.block_bytes,
                            node.inflight);
        }

    } else if (ngx_http_dpd_state_request(r, req, &rec) != NGX_OK) {
        status = NGX_HTTP_NOT_FOUND;
        p = ngx_sprintf(p, "{\"ok\":false,\"error\":\"unknown request\"}\n");

    } else {
        p = ngx_sprintf(p, "{\"state\":\"%s\",\"bytes_done\":%uL,"
                        "\"bytes_total\":%uL,\"nblocks\":%ui,"
                        "\"t_reserved_ms\":%uL,\"t_start_ms\":%uL,"
                        "\"t_done_ms\":%uL,\"error\":%i,\"node\":\"%s\","
                        "\"peer\":\"%s\"}\n",
                        dpd_state_req_name(rec.state), rec.bytes_done,
                        rec.bytes_total, rec.nblocks, rec.t_reserved_ms,
                        rec.t_start_ms, rec.t_done_ms, rec.error,
                        rec.node_id, rec.peer_id);
    }

    b->last = p;

    return ngx_http_dpd_state_send(r, status, b);
}


/* NGX_OK with the unescaped argument, NGX_DECLINED when absent. */

static ngx_int_t
ngx_http_dpd_state_arg(ngx_http_request_t *r, char *name, size_t len,
    ngx_str_t *value)
{
    u_char     *dst, *src;
    ngx_str_t   raw;

    if (ngx_http_arg(r, (u_char *) name, len, &raw) != NGX_OK
        || raw.len == 0)
    {
        return NGX_DECLINED;
    }

    dst = ngx_pnalloc(r->pool, raw.len);
    if (dst == NULL) {
        return NGX_ERROR;
    }

    value->data = dst;
    src = raw.data;

    ngx_unescape_uri(&dst, &src, raw.len, 0);

    value->len = dst - value->data;

    return value->len ? NGX_OK : NGX_DECLINED;
}


static ngx_int_t
ngx_http_dpd_state_send(ngx_http_request_t *r, ngx_uint_t status,
    ngx_buf_t *b)
{
    ngx_int_t    rc;
    ngx_chain_t  out;

    b->last_buf = (r == r->main) ? 1 : 0;
    b->last_in_chain = 1;

    r->headers_out.status = status;
    ngx_str_set(&r->headers_out.content_type, "application/json");
    r->headers_out.content_type_len = r->headers_out.content_type.len;
    r->headers_out.content_length_n = b->last - b->pos;

    rc = ngx_http_send_header(r);

    if (rc == NGX_ERROR || rc > NGX_OK || r->header_only) {
        return rc;
    }

    out.buf = b;
    out.next = NULL;

    return ngx_http_output_filter(r, &out);
}
