/*
 * Readiness of the kv_agent state table (docs/state.md) for the rest
 * of ngx_http_dpd_module: every worker keeps a snapshot of the table, read
 * with pread() on a timer (dpd_state_table check=), and these calls copy
 * records out of it; request records are read from the file at lookup
 * time (seqlock, bounded retries).  Nothing here blocks or can fault; a
 * missing, shrunk, corrupt or replaced file is handled inside.
 */

#ifndef _NGX_HTTP_DPD_STATE_H_INCLUDED_
#define _NGX_HTTP_DPD_STATE_H_INCLUDED_


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include "dpd_state.h"


/* one node record, copied out of the table */
typedef struct {
    u_char           id[DPD_STATE_ID_LEN];          /* NUL-terminated */
    u_char           http_addr[DPD_STATE_ADDR_LEN]; /* "host:port" */
    ngx_uint_t       role;           /* DPD_ROLE_* */
    ngx_flag_t       alive;          /* agent says alive, writer running,
                                        table not stale */
    ngx_flag_t       self;           /* the writer's own record */
    uint64_t         free_blocks;
    uint64_t         total_blocks;
    uint64_t         block_bytes;    /* bytes per block, all layers */
    ngx_uint_t       inflight;       /* transfers in progress */
    ngx_msec_int_t   heartbeat_age;  /* ms since its last heartbeat,
                                        -1: never seen */
} ngx_http_dpd_state_node_t;


/* one request record, copied out of the table */
typedef struct {
    ngx_uint_t       state;          /* DPD_REQ_RESERVED .. DPD_REQ_FAILED */
    uint64_t         bytes_done;
    uint64_t         bytes_total;
    uint64_t         t_reserved_ms;  /* CLOCK_REALTIME ms, 0: not set */
    uint64_t         t_start_ms;
    uint64_t         t_done_ms;
    ngx_uint_t       nblocks;
    ngx_int_t        error;          /* 0 or a negative errno-style code */
    u_char           node_id[DPD_STATE_ID_LEN];  /* decode node */
    u_char           peer_id[DPD_STATE_ID_LEN];  /* prefill node */
} ngx_http_dpd_state_req_t;


/*
 * 1 when dpd_state_table is configured and this worker's last snapshot of
 * it was good; 0 otherwise ("no readiness information").
 */
ngx_flag_t ngx_http_dpd_state_enabled(ngx_http_request_t *r);

/*
 * The node whose vLLM HTTP address is exactly http_addr ("host:port", as
 * in the agent's config and in an upstream peer's name).  NGX_OK with a
 * copy in out; NGX_DECLINED when there is no table or no such node, or its
 * record could not be read consistently.  When several records carry the
 * address, an alive one wins.  From the snapshot: one hash probe, no system
 * call, safe to call with an upstream's peers lock held.
 */
ngx_int_t ngx_http_dpd_state_node_by_addr(ngx_http_request_t *r,
    ngx_str_t *http_addr, ngx_http_dpd_state_node_t *out);

/*
 * The record of an X-Request-Id.  NGX_OK with a copy in out (out->state is
 * one of DPD_REQ_RESERVED, _TRANSFERRING, _READY, _FAILED); NGX_DECLINED
 * when there is no table, no such request, or its record stayed unstable
 * (treat as unknown, never as ready).
 */
ngx_int_t ngx_http_dpd_state_request(ngx_http_request_t *r,
    ngx_str_t *request_id, ngx_http_dpd_state_req_t *out);


extern ngx_module_t  ngx_http_dpd_state_module;


#endif /* _NGX_HTTP_DPD_STATE_H_INCLUDED_ */
