/*
 * Disaggregated path: the prefill subrequest, the prefill protocols (nixl,
 * lmcache) and the hand-off to the decoder.  Owned by ngx_http_dpd_prefill.c
 * and ngx_http_dpd_protocol.c; the core (ngx_http_dpd_module.c) embeds the
 * structs below in its location conf and request ctx and calls the hooks.
 *
 * Directives (location level, inherited):
 *   dpd_protocol nixl|lmcache|kv_agent;  default nixl
 *   dpd_prefill_pass URI|off;         internal location of the prefill pool;
 *                                     the subrequest goes to URI followed by
 *                                     the engine path (/v1/completions or
 *                                     /v1/chat/completions)
 *   dpd_prefill_timeout TIME;         default 60s, whole prefill incl. retries
 *   dpd_fallback decode|error;        default decode
 *   dpd_decode_upstream NAME;         lmcache, kv_agent: the decode pool to
 *                                     pin in (lmcache default: the one
 *                                     upstream{} that has dpd_lmcache_ports;
 *                                     kv_agent: required)
 *   dpd_kv_wait TIME;                 kv_agent: how long to wait after the
 *                                     prefill for the state table to say the
 *                                     KV is ready on the decoder; default 2s
 *   dpd_nixl_remote_hosts CIDR ...;   nixl: where else than the prefill
 *                                     peer's own address a reply's
 *                                     remote_host may point (side channel
 *                                     on another NIC); default none
 * Variables: $dpd_prefill_peer $dpd_decode_peer $dpd_prefill_time (ms)
 *            $dpd_prefill_status $dpd_kv_wait_time (ms)
 */

#ifndef _NGX_HTTP_DPD_PREFILL_H_INCLUDED_
#define _NGX_HTTP_DPD_PREFILL_H_INCLUDED_


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_event.h>
#include <ngx_http.h>


typedef struct ngx_http_dpd_ctx_s  ngx_http_dpd_ctx_t;


#define NGX_HTTP_DPD_FALLBACK_DECODE   1
#define NGX_HTTP_DPD_FALLBACK_ERROR    2

/* ngx_http_dpd_prefill_ctx_t.state */
#define NGX_HTTP_DPD_PREFILL_NEW       0
#define NGX_HTTP_DPD_PREFILL_WAITING   1   /* subrequest in flight */
#define NGX_HTTP_DPD_PREFILL_FINISHED  2   /* outcome applied */
#define NGX_HTTP_DPD_PREFILL_KV_WAIT   3   /* kv_agent: waiting for the KV
                                              to land on the decoder */

/* ngx_http_dpd_prefill_ctx_t.cause: why the prefill did not hand off */
#define NGX_HTTP_DPD_CAUSE_NONE        0
#define NGX_HTTP_DPD_CAUSE_5XX         1
#define NGX_HTTP_DPD_CAUSE_4XX         2
#define NGX_HTTP_DPD_CAUSE_TIMEOUT     3
#define NGX_HTTP_DPD_CAUSE_CONNECT     4
#define NGX_HTTP_DPD_CAUSE_BAD_REPLY   5
#define NGX_HTTP_DPD_CAUSE_NO_DECODER  6
#define NGX_HTTP_DPD_CAUSE_NO_NODE     7   /* kv_agent: no state table or
                                              no record of the decoder */

/* ngx_http_dpd_prefill_ctx_t.kv: how the kv_agent wait ended */
#define NGX_HTTP_DPD_KV_NONE           0   /* no wait (yet) */
#define NGX_HTTP_DPD_KV_READY          1   /* the table says ready */
#define NGX_HTTP_DPD_KV_FAILED         2   /* the table says failed */
#define NGX_HTTP_DPD_KV_TIMEOUT        3   /* dpd_kv_wait passed */
#define NGX_HTTP_DPD_KV_NOT_PUSHED     4   /* the prefill reply said so */
#define NGX_HTTP_DPD_KV_NO_TABLE       5   /* nothing to poll (lmcache: no
                                              usable dpd_state_table) */


/* location-level settings of the disaggregated path */
typedef struct {
    ngx_str_t                    prefill_pass;  /* empty: observe mode */
    ngx_uint_t                   protocol;      /* dpd_protocol */
    ngx_msec_t                   timeout;       /* dpd_prefill_timeout */
    ngx_uint_t                   fallback;      /* dpd_fallback */
    ngx_str_t                    decode_name;   /* dpd_decode_upstream */
    ngx_http_upstream_srv_conf_t *decode_upstream; /* lmcache, kv_agent */
    ngx_msec_t                   kv_wait;       /* dpd_kv_wait */
    ngx_array_t                 *nixl_hosts;    /* dpd_nixl_remote_hosts,
                                                   of ngx_cidr_t */
    ngx_uint_t                   prefix;        /* dpd_prefix_cache on: it
                                                   pins in decode_name */
} ngx_http_dpd_prefill_conf_t;


/* how much of a refused remote_host the warning shows */
#define NGX_HTTP_DPD_NIXL_HOST_SHOWN   64


/* per-request state of the disaggregated path */
typedef struct {
    ngx_uint_t                   state;
    ngx_uint_t                   cause;         /* NGX_HTTP_DPD_CAUSE_* */
    ngx_http_request_t          *sr;            /* the prefill subrequest */
    ngx_event_t                  timer;         /* dpd_prefill_timeout */
    ngx_msec_t                   start;
    ngx_msec_t                   elapsed;       /* $dpd_prefill_time */
    ngx_int_t                    rc;            /* subrequest finalize rc */
    ngx_uint_t                   status;        /* $dpd_prefill_status */
    ngx_str_t                    peer;          /* $dpd_prefill_peer */
    ngx_str_t                    decode_peer;   /* pinned decoder */
    ngx_str_t                    reply;         /* prefill reply body */
    ngx_str_t                    content_type;  /* of the reply */
    ngx_str_t                    sent;          /* request line sent to
                                                   the prefill (or the
                                                   subrequest URI) */
    ngx_event_t                  kv_timer;      /* kv_agent: state polls */
    ngx_msec_t                   kv_start;
    ngx_msec_t                   kv_interval;   /* next poll, 1..10 ms */
    ngx_msec_t                   kv_elapsed;    /* $dpd_kv_wait_time */
    ngx_uint_t                   kv;            /* NGX_HTTP_DPD_KV_* */
    ngx_uint_t                   kv_state;      /* last DPD_REQ_* seen */
    struct ngx_http_dpd_proto_s *proto;         /* the protocol that ran */
    void                        *proto_data;    /* the protocol's own
                                                   (ngx_http_dpd_proto.h) */
    unsigned                     done:1;        /* subrequest finalized */
    unsigned                     answered:1;    /* a prefill peer replied */
    unsigned                     timed_out:1;   /* our deadline passed */
    unsigned                     aborted:1;     /* client went away */
    unsigned                     broken:1;      /* reply too large etc. */
    unsigned                     params:1;      /* decode got KV params */
    unsigned                     kv_waited:1;   /* a KV wait ran */
    unsigned                     kv_done:1;     /* the KV wait is over */
    unsigned                     quiet:1;       /* no KV, and not a fault
                                                   (log at info) */
    unsigned                     retried:1;     /* a decode retry re-pinned
                                                   another decoder */
} ngx_http_dpd_prefill_ctx_t;


extern ngx_conf_enum_t  ngx_http_dpd_prefill_fallbacks[];

char *ngx_http_dpd_prefill_protocol(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
char *ngx_http_dpd_prefill_pass(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
char *ngx_http_dpd_nixl_remote_hosts(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);


/* directive entries spliced into the module's command table */
#define NGX_HTTP_DPD_PREFILL_COMMANDS                                         \
                                                                              \
    { ngx_string("dpd_protocol"),                                             \
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,  \
      ngx_http_dpd_prefill_protocol,                                          \
      NGX_HTTP_LOC_CONF_OFFSET,                                               \
      offsetof(ngx_http_dpd_loc_conf_t, prefill.protocol),                    \
      NULL },                                                                 \
                                                                              \
    { ngx_string("dpd_prefill_pass"),                                         \
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,  \
      ngx_http_dpd_prefill_pass,                                              \
      NGX_HTTP_LOC_CONF_OFFSET,                                               \
      offsetof(ngx_http_dpd_loc_conf_t, prefill),                             \
      NULL },                                                                 \
                                                                              \
    { ngx_string("dpd_prefill_timeout"),                                      \
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,  \
      ngx_conf_set_msec_slot,                                                 \
      NGX_HTTP_LOC_CONF_OFFSET,                                               \
      offsetof(ngx_http_dpd_loc_conf_t, prefill.timeout),                     \
      NULL },                                                                 \
                                                                              \
    { ngx_string("dpd_fallback"),                                             \
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,  \
      ngx_conf_set_enum_slot,                                                 \
      NGX_HTTP_LOC_CONF_OFFSET,                                               \
      offsetof(ngx_http_dpd_loc_conf_t, prefill.fallback),                    \
      ngx_http_dpd_prefill_fallbacks },                                       \
                                                                              \
    { ngx_string("dpd_decode_upstream"),                                      \
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,  \
      ngx_conf_set_str_slot,                                                  \
      NGX_HTTP_LOC_CONF_OFFSET,                                               \
      offsetof(ngx_http_dpd_loc_conf_t, prefill.decode_name),                 \
      NULL },                                                                 \
                                                                              \
    { ngx_string("dpd_kv_wait"),                                              \
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,  \
      ngx_conf_set_msec_slot,                                                 \
      NGX_HTTP_LOC_CONF_OFFSET,                                               \
      offsetof(ngx_http_dpd_loc_conf_t, prefill.kv_wait),                     \
      NULL },                                                                 \
                                                                              \
    { ngx_string("dpd_nixl_remote_hosts"),                                    \
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_1MORE,  \
      ngx_http_dpd_nixl_remote_hosts,                                         \
      NGX_HTTP_LOC_CONF_OFFSET,                                               \
      offsetof(ngx_http_dpd_loc_conf_t, prefill.nixl_hosts),                  \
      NULL },

void ngx_http_dpd_prefill_init_conf(ngx_http_dpd_prefill_conf_t *conf);
char *ngx_http_dpd_prefill_merge_conf(ngx_conf_t *cf,
    ngx_http_dpd_prefill_conf_t *prev, ngx_http_dpd_prefill_conf_t *conf);
ngx_int_t ngx_http_dpd_prefill_add_variables(ngx_conf_t *cf);

/* postconfiguration: the protocols' init hooks (output filters) */
ngx_int_t ngx_http_dpd_prefill_init(ngx_conf_t *cf);

/* ngx_http_dpd_check.c: dpd_prefill_pass mistakes, at nginx -t and on a
 * prefill 404 that is not an OpenAI error (NGX_DONE: answer 502) */
ngx_int_t ngx_http_dpd_check_init(ngx_conf_t *cf);
ngx_int_t ngx_http_dpd_check_prefill_404(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx, ngx_str_t *pass);

/*
 * Called by the core phase handler once the body is read, parsed and the
 * route decided as disaggregated, and again each time the phase handler
 * runs while the prefill is in flight.  Returns:
 *   NGX_AGAIN     waiting for the prefill subrequest or the KV (the phase
 *                 handler returns NGX_AGAIN as auth_request does; the
 *                 post-subrequest handler and our timers only record and
 *                 resume the phases)
 *   NGX_DECLINED  done: the decode body is in place (and the decode peer
 *                 pinned where the protocol needs it); continue phases
 *   NGX_DONE      answer the client with ctx->answer (a prefill 4xx
 *                 relayed as is, or the dpd_fallback error reply): the
 *                 core's content handler sends it; nothing was sent here
 *   >= NGX_HTTP_SPECIAL_RESPONSE / NGX_ERROR   the phase engine finalizes
 *                 with that (499: the client went away during the KV wait)
 * Nothing here sends a response or finalizes the main request.
 */
ngx_int_t ngx_http_dpd_prefill_handler(ngx_http_request_t *r,
    ngx_http_dpd_ctx_t *ctx);

/*
 * For a decode retry (the balancer) after it pinned another decoder and
 * set ctx->prefill.decode_peer to it: sets ctx->prefill.retried and
 * replaces the main request body by the protocol's decode body for that
 * decoder (its decode_body hook: nixl the same params, any decoder pulls;
 * lmcache and kv_agent the same prompt, the new decoder has no pushed KV
 * and recomputes).  Only after the prefill hand-off (NGX_DECLINED from the
 * handler); NGX_OK (body replaced), NGX_DECLINED (a fallback's plain body,
 * left as it is) or NGX_ERROR.  The caller re-inits the upstream body
 * (u->request_bufs) as for any retry.
 */
ngx_int_t ngx_http_dpd_prefill_rebuild(ngx_http_request_t *r);


#endif /* _NGX_HTTP_DPD_PREFILL_H_INCLUDED_ */
