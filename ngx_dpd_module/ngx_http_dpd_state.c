/*
 * ngx_http_dpd_state_module: the reader side of the kv_agent readiness
 * table (docs/state.md, kv_agent/include/dpd_state.h).
 *
 * The table is never mapped: a file mapped in a worker faults (SIGBUS) on
 * every page that something cut off after the mapping was made, and a
 * fault inside the balancer, under the upstream's peers lock, would leave
 * that lock held forever.  Instead each worker keeps a private snapshot:
 * a timer ("check" interval) stat()s the path, reads the header and the
 * node array with pread() (seqlock per record, see
 * ngx_http_dpd_state_read_nodes()), validates them and builds an
 * address -> node index.  The balancer, the variables and the status
 * handler read only that snapshot; request records, which the KV wait
 * needs fresh, are read with pread() at lookup time.  A read past the end
 * of a file that shrank returns short and never faults.  A missing,
 * truncated or corrupt file means "no readiness information": lookups
 * decline, a warning is logged when the condition changes and at most once
 * a minute while it lasts.
 */


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "ngx_http_dpd_state.h"


#define NGX_HTTP_DPD_STATE_MAX_SIZE     (1024 * 1024 * 1024)
#define NGX_HTTP_DPD_STATE_MAX_NODES    65536   /* the agent has <= 4096 */
#define NGX_HTTP_DPD_STATE_WARN_EVERY   60      /* seconds */
#define NGX_HTTP_DPD_STATE_REASON_LEN   160
#define NGX_HTTP_DPD_STATE_MAX_SHOWN    4096    /* nodes in the status */
#define NGX_HTTP_DPD_STATE_PROBE_CHUNK  4       /* request slots per read */
#define NGX_HTTP_DPD_STATE_COUNT_CHUNK  256     /* request slots per read */
#define NGX_HTTP_DPD_STATE_RETRIES      256     /* per snapshot, see below */


/* one node of the snapshot */
typedef struct {
    ngx_http_dpd_state_node_t   node;
    uint64_t                    heartbeat_ms;   /* 0: never seen */
    size_t                      addr_len;
    ngx_uint_t                  hash;           /* of node.http_addr */
} ngx_http_dpd_state_snode_t;


typedef struct {
    ngx_str_t                    path;          /* NUL-terminated */
    ngx_msec_t                   stale;         /* 0: never stale */
    ngx_msec_t                   check;

    ngx_str_t                    reqid_var;     /* "dpd_request_id" */
    ngx_uint_t                   reqid_key;

    /* per worker, after fork */
    ngx_event_t                  timer;
    ngx_fd_t                     fd;            /* NGX_INVALID_FILE */
    dev_t                        dev;
    ino_t                        ino;

    /* the snapshot, valid when "valid" is set */
    ngx_uint_t                   valid;         /* unsigned:1 */
    ngx_uint_t                   stale_now;     /* unsigned:1 */
    dpd_state_header_t           hdr;           /* as read */
    uint64_t                     generation;    /* validated copies */
    uint64_t                     nodes_off;
    uint64_t                     reqs_off;
    uint32_t                     max_nodes;
    uint32_t                     max_reqs;
    ngx_uint_t                   nodes_alive;

    ngx_http_dpd_state_snode_t  *nodes;         /* used, readable records */
    ngx_uint_t                   nnodes;
    uint32_t                    *index;         /* node + 1, 0: empty */
    ngx_uint_t                   index_mask;

    /* buffers, kept between snapshots, for "cap" node records */
    ngx_uint_t                   cap;
    u_char                      *raw;
    uint32_t                    *seqs;

    time_t                       last_warn;
    u_char                       reason[NGX_HTTP_DPD_STATE_REASON_LEN];
    size_t                       reason_len;
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
static void ngx_http_dpd_state_timer_handler(ngx_event_t *ev);
static void ngx_http_dpd_state_refresh(ngx_http_dpd_state_main_conf_t *smcf,
    ngx_log_t *log);
static ngx_int_t ngx_http_dpd_state_open(ngx_http_dpd_state_main_conf_t *smcf,
    ngx_log_t *log, off_t *size);
static void ngx_http_dpd_state_close(ngx_http_dpd_state_main_conf_t *smcf);
static ngx_int_t ngx_http_dpd_state_validate(
    ngx_http_dpd_state_main_conf_t *smcf, dpd_state_header_t *h, off_t size,
    ngx_log_t *log);
static ngx_int_t ngx_http_dpd_state_alloc(
    ngx_http_dpd_state_main_conf_t *smcf, ngx_uint_t n, ngx_log_t *log);
static ngx_int_t ngx_http_dpd_state_read_nodes(
    ngx_http_dpd_state_main_conf_t *smcf);
static void ngx_http_dpd_state_add_node(ngx_http_dpd_state_main_conf_t *smcf,
    dpd_node_rec_t *rec, ngx_uint_t fresh);
static void ngx_http_dpd_state_index(ngx_http_dpd_state_main_conf_t *smcf);
static void ngx_http_dpd_state_fail(ngx_http_dpd_state_main_conf_t *smcf,
    ngx_log_t *log, const char *fmt, ...);
static ssize_t ngx_http_dpd_state_pread(ngx_fd_t fd, void *buf, size_t size,
    uint64_t off);
static ngx_int_t ngx_http_dpd_state_read_rec(ngx_fd_t fd, uint64_t off,
    void *out, size_t size);
static uint64_t ngx_http_dpd_state_now_ms(void);
static void ngx_http_dpd_state_copy_node(ngx_http_dpd_state_snode_t *sn,
    ngx_http_dpd_state_node_t *out);
static ngx_int_t ngx_http_dpd_state_find_req(
    ngx_http_dpd_state_main_conf_t *smcf, u_char *id, size_t len,
    dpd_req_rec_t *rec);
static ngx_int_t ngx_http_dpd_state_request_id(ngx_http_request_t *r,
    ngx_http_dpd_state_main_conf_t *smcf, ngx_str_t *id);
static ngx_int_t ngx_http_dpd_state_variable(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, uintptr_t data);
static ngx_int_t ngx_http_dpd_state_status_handler(ngx_http_request_t *r);
static u_char *ngx_http_dpd_state_count_reqs(ngx_http_request_t *r,
    ngx_http_dpd_state_main_conf_t *smcf, u_char *p);
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
     *     smcf->valid = 0;
     *     smcf->nodes = NULL;
     *     smcf->cap = 0;
     */

    smcf->stale = NGX_CONF_UNSET_MSEC;
    smcf->check = NGX_CONF_UNSET_MSEC;
    smcf->fd = NGX_INVALID_FILE;

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
    smcf->check = 250;

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

    if (ngx_process != NGX_PROCESS_WORKER
        && ngx_process != NGX_PROCESS_SINGLE)
    {
        /* cache manager and loader */
        return NGX_OK;
    }

    /* NULL without an http{} block */

    smcf = ngx_http_cycle_get_module_main_conf(cycle,
                                               ngx_http_dpd_state_module);

    if (smcf == NULL || smcf->path.len == 0) {
        return NGX_OK;
    }

    smcf->timer.handler = ngx_http_dpd_state_timer_handler;
    smcf->timer.data = smcf;
    smcf->timer.log = cycle->log;
    smcf->timer.cancelable = 1;

    ngx_http_dpd_state_refresh(smcf, cycle->log);

    ngx_add_timer(&smcf->timer, smcf->check ? smcf->check : 1);

    return NGX_OK;
}


static void
ngx_http_dpd_state_exit_process(ngx_cycle_t *cycle)
{
    ngx_http_dpd_state_main_conf_t  *smcf;

    smcf = ngx_http_cycle_get_module_main_conf(cycle,
                                               ngx_http_dpd_state_module);

    if (smcf == NULL || smcf->path.len == 0) {
        return;
    }

    ngx_http_dpd_state_close(smcf);

    if (smcf->cap) {
        ngx_free(smcf->nodes);
        ngx_free(smcf->index);
        ngx_free(smcf->raw);
        ngx_free(smcf->seqs);
        smcf->cap = 0;
    }
}


/* The main conf, or NULL without dpd_state_table; never does I/O. */

static ngx_http_dpd_state_main_conf_t *
ngx_http_dpd_state_get(ngx_http_request_t *r)
{
    ngx_http_dpd_state_main_conf_t  *smcf;

    smcf = ngx_http_get_module_main_conf(r, ngx_http_dpd_state_module);

    if (smcf == NULL || smcf->path.len == 0) {
        return NULL;
    }

    return smcf;
}


static void
ngx_http_dpd_state_timer_handler(ngx_event_t *ev)
{
    ngx_http_dpd_state_main_conf_t  *smcf = ev->data;

    if (ngx_exiting || ngx_terminate || ngx_quit) {
        return;
    }

    ngx_http_dpd_state_refresh(smcf, ev->log);

    ngx_add_timer(ev, smcf->check ? smcf->check : 1);
}


/*
 * Takes a new snapshot.  Any failure drops the old one: no readiness
 * information until a good table is read again.
 */

static void
ngx_http_dpd_state_refresh(ngx_http_dpd_state_main_conf_t *smcf,
    ngx_log_t *log)
{
    off_t                size;
    ssize_t              n;
    uint64_t             gen, ino;
    ngx_uint_t           was_valid;
    dpd_state_header_t   h;

    was_valid = smcf->valid;
    gen = smcf->generation;
    ino = (uint64_t) smcf->ino;

    smcf->valid = 0;

    if (ngx_http_dpd_state_open(smcf, log, &size) != NGX_OK) {
        return;
    }

    n = ngx_http_dpd_state_pread(smcf->fd, &h, sizeof(h), 0);

    if (n != (ssize_t) sizeof(h)) {
        ngx_http_dpd_state_fail(smcf, log, "%s", n == -1 ? "cannot read"
                                                : "changed while reading");
        return;
    }

    if (ngx_http_dpd_state_validate(smcf, &h, size, log) != NGX_OK) {
        return;
    }

    if (ngx_http_dpd_state_alloc(smcf, smcf->max_nodes, log) != NGX_OK) {
        return;
    }

    smcf->hdr = h;
    smcf->stale_now = smcf->stale
                      && h.updated_ms + smcf->stale
                         < ngx_http_dpd_state_now_ms();

    if (ngx_http_dpd_state_read_nodes(smcf) != NGX_OK) {
        ngx_http_dpd_state_fail(smcf, log, "changed while reading");
        return;
    }

    ngx_http_dpd_state_index(smcf);

    smcf->valid = 1;
    smcf->reason_len = 0;

    if (was_valid && gen == smcf->generation && ino == (uint64_t) smcf->ino) {
        return;
    }

    ngx_log_error(NGX_LOG_NOTICE, log, 0,
                  "dpd_state: using table \"%V\" (writer pid %uD, "
                  "generation %uL, %uD nodes, %uD requests)",
                  &smcf->path, h.writer_pid, smcf->generation,
                  smcf->max_nodes, smcf->max_reqs);
}


/*
 * Keeps smcf->fd open on the file the path names now (a new inode, as the
 * agent's write-to-temp + rename makes, is opened afresh) and sets *size
 * from it.  NGX_ERROR with the reason recorded when there is no usable file.
 */

static ngx_int_t
ngx_http_dpd_state_open(ngx_http_dpd_state_main_conf_t *smcf, ngx_log_t *log,
    off_t *size)
{
    ngx_fd_t         fd;
    ngx_err_t        err;
    ngx_file_info_t  fi;

    if (ngx_file_info(smcf->path.data, &fi) == NGX_FILE_ERROR) {
        err = ngx_errno;
        ngx_http_dpd_state_close(smcf);
        ngx_http_dpd_state_fail(smcf, log, "%s (%s)",
                                err == NGX_ENOENT ? "missing"
                                                  : "cannot stat",
                                strerror(err));
        return NGX_ERROR;
    }

    if (smcf->fd != NGX_INVALID_FILE
        && (fi.st_ino != smcf->ino || fi.st_dev != smcf->dev))
    {
        ngx_http_dpd_state_close(smcf);
    }

    if (smcf->fd == NGX_INVALID_FILE) {

        if (!S_ISREG(fi.st_mode)) {
            ngx_http_dpd_state_fail(smcf, log, "not a regular file");
            return NGX_ERROR;
        }

        fd = open((char *) smcf->path.data,
                  O_RDONLY | O_CLOEXEC | O_NONBLOCK);
        if (fd == -1) {
            err = ngx_errno;
            ngx_http_dpd_state_fail(smcf, log, "cannot open (%s)",
                                    strerror(err));
            return NGX_ERROR;
        }

        /* the path may have been replaced between stat() and open() */

        if (fstat(fd, &fi) == -1 || !S_ISREG(fi.st_mode)) {
            close(fd);
            ngx_http_dpd_state_fail(smcf, log, "changed while opening");
            return NGX_ERROR;
        }

        smcf->fd = fd;
        smcf->dev = fi.st_dev;
        smcf->ino = fi.st_ino;
    }

    if (fi.st_size < (off_t) sizeof(dpd_state_header_t)) {
        ngx_http_dpd_state_fail(smcf, log, "truncated (%O bytes)",
                                fi.st_size);
        return NGX_ERROR;
    }

    if (fi.st_size > NGX_HTTP_DPD_STATE_MAX_SIZE) {
        ngx_http_dpd_state_fail(smcf, log, "too large (%O bytes)",
                                fi.st_size);
        return NGX_ERROR;
    }

    *size = fi.st_size;

    return NGX_OK;
}


static void
ngx_http_dpd_state_close(ngx_http_dpd_state_main_conf_t *smcf)
{
    smcf->valid = 0;

    if (smcf->fd != NGX_INVALID_FILE) {
        (void) close(smcf->fd);
        smcf->fd = NGX_INVALID_FILE;
    }
}


/*
 * Checks a header read from a file of "size" bytes and keeps its geometry:
 * every offset is checked against the size with overflow-safe arithmetic
 * before dpd_state_check() (which adds offsets) is trusted.  Later reads
 * use only the copies kept here.
 */

static ngx_int_t
ngx_http_dpd_state_validate(ngx_http_dpd_state_main_conf_t *smcf,
    dpd_state_header_t *h, off_t size, ngx_log_t *log)
{
    uint64_t  file_size, nodes_off, reqs_off;
    uint32_t  max_nodes, max_reqs;

    if (h->magic != DPD_STATE_MAGIC) {
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

    if (file_size > (uint64_t) size) {
        ngx_http_dpd_state_fail(smcf, log, "truncated (%O of %uL bytes)",
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
        || dpd_state_check(h, (size_t) size) != 0)
    {
        ngx_http_dpd_state_fail(smcf, log, "corrupt (bad sizes)");
        return NGX_ERROR;
    }

    if (max_nodes > NGX_HTTP_DPD_STATE_MAX_NODES) {
        ngx_http_dpd_state_fail(smcf, log, "too many nodes (%uD, at most %d)",
                                max_nodes, NGX_HTTP_DPD_STATE_MAX_NODES);
        return NGX_ERROR;
    }

    smcf->nodes_off = nodes_off;
    smcf->reqs_off = reqs_off;
    smcf->max_nodes = max_nodes;
    smcf->max_reqs = max_reqs;
    smcf->generation = h->generation;

    return NGX_OK;
}


/* Buffers for a snapshot of n node records; kept while n fits. */

static ngx_int_t
ngx_http_dpd_state_alloc(ngx_http_dpd_state_main_conf_t *smcf, ngx_uint_t n,
    ngx_log_t *log)
{
    u_char                      *raw;
    uint32_t                    *seqs, *index;
    ngx_uint_t                   size;
    ngx_http_dpd_state_snode_t  *nodes;

    if (n <= smcf->cap && smcf->cap) {
        return NGX_OK;
    }

    if (n < 8) {
        n = 8;
    }

    /* the index: a power of two, at least twice the nodes */

    for (size = 16; size < 2 * n; size <<= 1) { /* void */ }

    /* raw: reads A and C, then B */

    raw = ngx_alloc(2 * n * sizeof(dpd_node_rec_t), log);
    seqs = ngx_alloc(n * sizeof(uint32_t), log);
    nodes = ngx_alloc(n * sizeof(ngx_http_dpd_state_snode_t), log);
    index = ngx_alloc(size * sizeof(uint32_t), log);

    if (raw == NULL || seqs == NULL || nodes == NULL || index == NULL) {
        ngx_free(raw);
        ngx_free(seqs);
        ngx_free(nodes);
        ngx_free(index);
        ngx_http_dpd_state_fail(smcf, log, "out of memory");
        return NGX_ERROR;
    }

    if (smcf->cap) {
        ngx_free(smcf->raw);
        ngx_free(smcf->seqs);
        ngx_free(smcf->nodes);
        ngx_free(smcf->index);
    }

    smcf->raw = raw;
    smcf->seqs = seqs;
    smcf->nodes = nodes;
    smcf->index = index;
    smcf->index_mask = size - 1;
    smcf->cap = n;
    smcf->nnodes = 0;

    return NGX_OK;
}


/*
 * The node array, read with the seqlock of dpd_state.h.  One pread()
 * copies a record in an order nothing guarantees, so the seq it copies
 * cannot bracket the data it copies; three reads of the array do: A (its
 * seqs all read before B starts), B (the data), C (its seqs all read after
 * B ended).  A record whose seq is even and the same in A and C was not
 * written while B copied it.  The others are read alone with the 3-step
 * seqlock of ngx_http_dpd_state_read_rec(), at most DPD_STATE_READ_TRIES
 * times each and NGX_HTTP_DPD_STATE_RETRIES records per snapshot; one
 * still unstable is left out (unknown, as dpd_state.h says).  NGX_ERROR:
 * the file is shorter than its header says (it shrank while being read).
 */

static ngx_int_t
ngx_http_dpd_state_read_nodes(ngx_http_dpd_state_main_conf_t *smcf)
{
    size_t           len;
    uint32_t         i, seq;
    uint64_t         off;
    ngx_int_t        rc;
    ngx_uint_t       budget, fresh;
    dpd_node_rec_t   rec, *ac, *b;

    smcf->nnodes = 0;
    smcf->nodes_alive = 0;

    if (smcf->max_nodes == 0) {
        return NGX_OK;
    }

    len = (size_t) smcf->max_nodes * sizeof(dpd_node_rec_t);
    ac = (dpd_node_rec_t *) smcf->raw;
    b = ac + smcf->cap;

    if (ngx_http_dpd_state_pread(smcf->fd, ac, len, smcf->nodes_off)
        != (ssize_t) len)
    {
        return NGX_ERROR;
    }

    for (i = 0; i < smcf->max_nodes; i++) {
        smcf->seqs[i] = ac[i].seq;
    }

    if (ngx_http_dpd_state_pread(smcf->fd, b, len, smcf->nodes_off)
        != (ssize_t) len
        || ngx_http_dpd_state_pread(smcf->fd, ac, len, smcf->nodes_off)
           != (ssize_t) len)
    {
        return NGX_ERROR;
    }

    fresh = smcf->hdr.writer_alive && !smcf->stale_now;
    budget = NGX_HTTP_DPD_STATE_RETRIES;

    for (i = 0; i < smcf->max_nodes; i++) {

        seq = smcf->seqs[i];

        if (!(seq & 1) && seq == ac[i].seq) {
            ngx_http_dpd_state_add_node(smcf, &b[i], fresh);
            continue;
        }

        if (budget == 0) {
            continue;
        }

        budget--;

        off = smcf->nodes_off + (uint64_t) i * sizeof(dpd_node_rec_t);

        rc = ngx_http_dpd_state_read_rec(smcf->fd, off, &rec, sizeof(rec));

        if (rc == NGX_ERROR) {
            return NGX_ERROR;
        }

        if (rc == NGX_OK) {
            ngx_http_dpd_state_add_node(smcf, &rec, fresh);
        }
    }

    return NGX_OK;
}


/* A consistent copy of a record into the snapshot, if it holds a node. */

static void
ngx_http_dpd_state_add_node(ngx_http_dpd_state_main_conf_t *smcf,
    dpd_node_rec_t *rec, ngx_uint_t fresh)
{
    u_char                      *last;
    ngx_http_dpd_state_snode_t  *sn;

    if (!(rec->flags & DPD_NODE_USED)) {
        return;
    }

    sn = &smcf->nodes[smcf->nnodes++];

    ngx_http_dpd_state_copy_str(sn->node.id, rec->id, sizeof(rec->id));
    last = ngx_http_dpd_state_copy_str(sn->node.http_addr, rec->http_addr,
                                       sizeof(rec->http_addr));

    sn->addr_len = last - sn->node.http_addr;
    sn->hash = ngx_hash_key(sn->node.http_addr, sn->addr_len);
    sn->heartbeat_ms = rec->last_heartbeat_ms;

    sn->node.role = rec->role;
    sn->node.self = (rec->flags & DPD_NODE_SELF) ? 1 : 0;
    sn->node.alive = (rec->flags & DPD_NODE_ALIVE) && fresh;
    sn->node.free_blocks = rec->free_blocks;
    sn->node.total_blocks = rec->total_blocks;
    sn->node.block_bytes = rec->block_bytes;
    sn->node.inflight = rec->inflight;
    sn->node.heartbeat_age = -1;

    smcf->nodes_alive += sn->node.alive;
}


/*
 * The address -> node index (open addressing, linear probing).  Several
 * records with one address: the first alive one wins, else the first.
 */

static void
ngx_http_dpd_state_index(ngx_http_dpd_state_main_conf_t *smcf)
{
    ngx_uint_t                   i, k;
    ngx_http_dpd_state_snode_t  *sn, *old;

    ngx_memzero(smcf->index, (smcf->index_mask + 1) * sizeof(uint32_t));

    for (i = 0; i < smcf->nnodes; i++) {
        sn = &smcf->nodes[i];

        if (sn->addr_len == 0) {
            continue;
        }

        for (k = sn->hash & smcf->index_mask;
             smcf->index[k];
             k = (k + 1) & smcf->index_mask)
        {
            old = &smcf->nodes[smcf->index[k] - 1];

            if (old->addr_len == sn->addr_len
                && ngx_memcmp(old->node.http_addr, sn->node.http_addr,
                              sn->addr_len) == 0)
            {
                break;
            }
        }

        if (smcf->index[k] == 0
            || (!smcf->nodes[smcf->index[k] - 1].node.alive
                && sn->node.alive))
        {
            smcf->index[k] = (uint32_t) (i + 1);
        }
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

    smcf->valid = 0;

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


/* Bytes read (fewer at the end of the file), -1 on an error. */

static ssize_t
ngx_http_dpd_state_pread(ngx_fd_t fd, void *buf, size_t size, uint64_t off)
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


/*
 * The seqlock read of dpd_state_read_rec() over pread(): each pread() is a
 * system call, so s1 is read before the copy starts and s2 after it ends.
 * NGX_OK: a consistent copy; NGX_BUSY: still being written after
 * DPD_STATE_READ_TRIES tries (unknown); NGX_ERROR: short read.
 */

static ngx_int_t
ngx_http_dpd_state_read_rec(ngx_fd_t fd, uint64_t off, void *out,
    size_t size)
{
    uint32_t    s1, s2;
    ngx_uint_t  i;

    for (i = 0; i < DPD_STATE_READ_TRIES; i++) {

        if (ngx_http_dpd_state_pread(fd, &s1, sizeof(s1), off)
            != (ssize_t) sizeof(s1))
        {
            return NGX_ERROR;
        }

        if (s1 & 1) {
            continue;
        }

        if (ngx_http_dpd_state_pread(fd, out, size, off) != (ssize_t) size
            || ngx_http_dpd_state_pread(fd, &s2, sizeof(s2), off)
               != (ssize_t) sizeof(s2))
        {
            return NGX_ERROR;
        }

        if (s1 == s2 && *(uint32_t *) out == s1) {
            return NGX_OK;
        }
    }

    return NGX_BUSY;
}


static uint64_t
ngx_http_dpd_state_now_ms(void)
{
    ngx_time_t  *tp;

    tp = ngx_timeofday();

    return (uint64_t) tp->sec * 1000 + tp->msec;
}


static void
ngx_http_dpd_state_copy_node(ngx_http_dpd_state_snode_t *sn,
    ngx_http_dpd_state_node_t *out)
{
    uint64_t  now;

    *out = sn->node;

    if (sn->heartbeat_ms) {
        now = ngx_http_dpd_state_now_ms();
        out->heartbeat_age = now > sn->heartbeat_ms
                             ? (ngx_msec_int_t) (now - sn->heartbeat_ms)
                             : 0;
    }
}


/*
 * The probe of dpd_state_find_req() with pread() from the file the
 * snapshot came from, at lookup time (the KV wait needs a fresh answer).
 * NGX_OK: found; NGX_DECLINED: absent; NGX_ERROR: unstable, unknown state
 * or unreadable (the file shrank).
 */

static ngx_int_t
ngx_http_dpd_state_find_req(ngx_http_dpd_state_main_conf_t *smcf, u_char *id,
    size_t len, dpd_req_rec_t *rec)
{
    size_t         cmp;
    uint32_t       i, j, n, idx, probe;
    uint64_t       hash, off;
    dpd_req_rec_t  slots[NGX_HTTP_DPD_STATE_PROBE_CHUNK];

    hash = dpd_state_hash(id, len);
    cmp = ngx_min(len, DPD_STATE_REQID_LEN - 1);
    probe = ngx_min(smcf->max_reqs, DPD_STATE_MAX_PROBE);

    for (i = 0; i < probe; /* void */) {
        idx = (uint32_t) ((hash + i) % smcf->max_reqs);

        /* the next slots up to the end of the array, in one read */

        n = ngx_min(probe - i, NGX_HTTP_DPD_STATE_PROBE_CHUNK);
        n = ngx_min(n, smcf->max_reqs - idx);

        off = smcf->reqs_off + (uint64_t) idx * sizeof(dpd_req_rec_t);

        if (ngx_http_dpd_state_pread(smcf->fd, slots, n * sizeof(*rec), off)
            != (ssize_t) (n * sizeof(*rec)))
        {
            return NGX_ERROR;
        }

        for (j = 0; j < n; j++, i++, off += sizeof(*rec)) {

            if (slots[j].id_hash == 0) {
                return NGX_DECLINED;
            }

            if (slots[j].id_hash != hash) {
                continue;
            }

            if (ngx_http_dpd_state_read_rec(smcf->fd, off, rec, sizeof(*rec))
                != NGX_OK)
            {
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
    }

    return NGX_DECLINED;
}


ngx_flag_t
ngx_http_dpd_state_enabled(ngx_http_request_t *r)
{
    ngx_http_dpd_state_main_conf_t  *smcf;

    smcf = ngx_http_dpd_state_get(r);

    return smcf != NULL && smcf->valid;
}


/*
 * O(1) in the table size: one probe of the snapshot's address index, no
 * system call, nothing shared touched.  The balancer calls it for every
 * peer with the upstream's peers lock held.
 */

ngx_int_t
ngx_http_dpd_state_node_by_addr(ngx_http_request_t *r, ngx_str_t *http_addr,
    ngx_http_dpd_state_node_t *out)
{
    ngx_uint_t                       k, hash;
    ngx_http_dpd_state_snode_t      *sn;
    ngx_http_dpd_state_main_conf_t  *smcf;

    smcf = ngx_http_dpd_state_get(r);

    if (smcf == NULL || !smcf->valid
        || http_addr->len == 0 || http_addr->len >= DPD_STATE_ADDR_LEN)
    {
        return NGX_DECLINED;
    }

    hash = ngx_hash_key(http_addr->data, http_addr->len);

    for (k = hash & smcf->index_mask;
         smcf->index[k];
         k = (k + 1) & smcf->index_mask)
    {
        sn = &smcf->nodes[smcf->index[k] - 1];

        if (sn->hash == hash && sn->addr_len == http_addr->len
            && ngx_memcmp(sn->node.http_addr, http_addr->data,
                          http_addr->len) == 0)
        {
            ngx_http_dpd_state_copy_node(sn, out);
            return NGX_OK;
        }
    }

    return NGX_DECLINED;
}


ngx_int_t
ngx_http_dpd_state_request(ngx_http_request_t *r, ngx_str_t *request_id,
    ngx_http_dpd_state_req_t *out)
{
    dpd_req_rec_t                    rec;
    ngx_http_dpd_state_main_conf_t  *smcf;

    smcf = ngx_http_dpd_state_get(r);

    if (smcf == NULL || !smcf->valid || request_id->len == 0) {
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
    ngx_int_t                        rc;
    ngx_str_t                        id;
    dpd_req_rec_t                    rec;
    ngx_http_dpd_state_main_conf_t  *smcf;

    v->not_found = 1;

    smcf = ngx_http_dpd_state_get(r);

    if (smcf == NULL || !smcf->valid) {
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
        p = ngx_pnalloc(r->pool, NGX_INT_T_LEN);
        if (p == NULL) {
            return NGX_ERROR;
        }

        v->len = ngx_sprintf(p, "%ui", smcf->nodes_alive) - p;
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
    uint64_t                         now;
    ngx_int_t                        rc;
    ngx_buf_t                       *b;
    ngx_str_t                        addr, req;
    ngx_uint_t                       i, shown;
    ngx_http_dpd_state_node_t        node;
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

        if (smcf->valid) {
            len += sizeof(",\"generation\":,\"writer_pid\":,"
                          "\"writer_alive\":false,\"stale\":false,"
                          "\"updated_age_ms\":,\"self\":\"\","
                          "\"max_nodes\":,\"max_reqs\":,\"nodes_alive\":,"
                          "\"requests_by_state\":{\"reserved\":,"
                          "\"transferring\":,\"ready\":,\"failed\":}")
                   + 16 * NGX_INT64_LEN + DPD_STATE_ID_LEN
                   + ngx_min(smcf->nnodes, NGX_HTTP_DPD_STATE_MAX_SHOWN)
                     * NGX_HTTP_DPD_STATE_NODE_JSON_LEN;
        }
    }

    b = ngx_create_temp_buf(r->pool, len);
    if (b == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    p = b->last;

    if (smcf == NULL || !smcf->valid) {
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

    now = ngx_http_dpd_state_now_ms();

    ngx_http_dpd_state_copy_str(self, smcf->hdr.self_id,
                                sizeof(smcf->hdr.self_id));

    p = ngx_cpymem(p, "{\"table\":\"", sizeof("{\"table\":\"") - 1);
    p = (u_char *) ngx_escape_json(p, smcf->path.data, smcf->path.len);

    p = ngx_sprintf(p, "\",\"ok\":true,\"generation\":%uL,\"writer_pid\":%uD,"
                    "\"writer_alive\":%s,\"stale\":%s,\"updated_age_ms\":%uL,"
                    "\"self\":\"%s\",\"max_nodes\":%uD,\"max_reqs\":%uD,"
                    "\"nodes\":[",
                    smcf->generation, smcf->hdr.writer_pid,
                    smcf->hdr.writer_alive ? "true" : "false",
                    smcf->stale_now ? "true" : "false",
                    now > smcf->hdr.updated_ms
                    ? now - smcf->hdr.updated_ms : (uint64_t) 0,
                    self, smcf->max_nodes, smcf->max_reqs);

    shown = ngx_min(smcf->nnodes, NGX_HTTP_DPD_STATE_MAX_SHOWN);
    sep = (u_char *) "";

    /* the buffer was sized for this many; nodes_alive counts all */

    for (i = 0; i < shown; i++) {

        ngx_http_dpd_state_copy_node(&smcf->nodes[i], &node);

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

    p = ngx_sprintf(p, "],\"nodes_alive\":%ui,", smcf->nodes_alive);

    p = ngx_http_dpd_state_count_reqs(r, smcf, p);
    if (p == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

send:

    b->last = p;

    return ngx_http_dpd_state_send(r, r->headers_out.status, b);
}


/*
 * "requests":N,"requests_by_state":{...}} from the file as it is now.
 * Counting needs no consistent copy of a record: its id_hash and state
 * are each read whole.  A file that shrank is counted up to its end.
 */

static u_char *
ngx_http_dpd_state_count_reqs(ngx_http_request_t *r,
    ngx_http_dpd_state_main_conf_t *smcf, u_char *p)
{
    ssize_t         got;
    uint32_t        i, j, n, state;
    uint64_t        counts[DPD_REQ_FAILED + 1], total, off;
    dpd_req_rec_t  *recs;

    recs = ngx_palloc(r->pool,
                      NGX_HTTP_DPD_STATE_COUNT_CHUNK * sizeof(dpd_req_rec_t));
    if (recs == NULL) {
        return NULL;
    }

    ngx_memzero(counts, sizeof(counts));
    total = 0;

    for (i = 0; i < smcf->max_reqs; i += n) {
        n = ngx_min(smcf->max_reqs - i, NGX_HTTP_DPD_STATE_COUNT_CHUNK);
        off = smcf->reqs_off + (uint64_t) i * sizeof(dpd_req_rec_t);

        got = ngx_http_dpd_state_pread(smcf->fd, recs,
                                       n * sizeof(dpd_req_rec_t), off);
        if (got <= 0) {
            break;
        }

        n = (uint32_t) (got / sizeof(dpd_req_rec_t));

        for (j = 0; j < n; j++) {
            state = recs[j].state;

            if (recs[j].id_hash == 0
                || state == DPD_REQ_FREE || state > DPD_REQ_FAILED)
            {
                continue;
            }

            counts[state]++;
            total++;
        }

        if (n == 0) {
            break;
        }
    }

    ngx_pfree(r->pool, recs);

    return ngx_sprintf(p, "\"requests\":%uL,"
                       "\"requests_by_state\":{\"reserved\":%uL,"
                       "\"transferring\":%uL,\"ready\":%uL,\"failed\":%uL}}\n",
                       total, counts[DPD_REQ_RESERVED],
                       counts[DPD_REQ_TRANSFERRING], counts[DPD_REQ_READY],
                       counts[DPD_REQ_FAILED]);
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
