/*
 * kv.h - kv_agent internals shared by its source files.
 *
 * One process, one thread, one context struct (kv_ctx_t): a poll() loop
 * drives the control channel, the local API, the libfabric completion
 * queues and the timers.  Everything the data path needs is allocated at
 * start (or when a pool is registered); nothing is allocated per block.
 */

#ifndef KV_H
#define KV_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include "dpd_state.h"

typedef struct kv_ctx kv_ctx_t;

#define KV_MAX_RAILS      32             /* p5.48xlarge: 32 EFA NICs */
#define KV_MAX_RANKS      8              /* tensor-parallel ranks per node */
#define KV_PATH_LEN       256
#define KV_MAX_PEERS      64
#define KV_ID_LEN         DPD_STATE_ID_LEN
#define KV_ADDR_LEN       DPD_STATE_ADDR_LEN
#define KV_REQID_LEN      DPD_STATE_REQID_LEN
#define KV_FABADDR_LEN    256
#define KV_MSG_MAX_DEF    (1u << 20)     /* framed JSON message cap */
#define KV_DONE_MAGIC     0x4b56444fu    /* "KVDO" */
#define KV_CHUNK_MAGIC    0x4b56434eu    /* "KVCN" */
#define KV_RING_MAX       32             /* receiver ring slots per rank */
#define KV_RING_PROTO     1              /* push_begin "credits": ring v1 */
#define KV_NRECV          64             /* posted receives per rail */
#define KV_NSEND          64             /* trailing-message buffers */
#define KV_MAX_KEYS       2              /* per link: current + next */
#define KV_KEY_MIN        16             /* key bytes */
#define KV_KEY_MAX        64
#define KV_KID_LEN        17             /* 8 bytes hex + NUL */
#define KV_NONCE_LEN      32
#define KV_MAC_LEN        32             /* HMAC-SHA-256 */
#define KV_HELLO_MAX      4096           /* frame cap before authentication */

/* ---- logging ---------------------------------------------------------- */

enum { KV_LOG_ERR = 0, KV_LOG_WARN, KV_LOG_INFO, KV_LOG_DEBUG };
extern int kv_log_level;
void kv_log(int level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
#define kv_err(...)   kv_log(KV_LOG_ERR, __VA_ARGS__)
#define kv_warn(...)  kv_log(KV_LOG_WARN, __VA_ARGS__)
#define kv_info(...)  kv_log(KV_LOG_INFO, __VA_ARGS__)
#define kv_debug(...) kv_log(KV_LOG_DEBUG, __VA_ARGS__)
/* control bytes, "\\" and non-UTF-8 as \\xNN (every log line gets it) */
size_t   kv_log_escape(char *out, size_t olen, const char *in, size_t n);
#define KV_LOG_BURST  5                 /* rate-limited lines a second */
typedef struct {
    uint64_t  t_ms;                         /* this second began */
    uint32_t  n;                            /* lines asked for in it */
} kv_loglim_t;
int      kv_log_limit(kv_loglim_t *l);      /* 1: log this one */

uint64_t kv_now_ms(void);          /* CLOCK_MONOTONIC */
uint64_t kv_now_us(void);
uint64_t kv_wall_ms(void);         /* CLOCK_REALTIME */
double   kv_now_s(void);
int      kv_set_nonblock(int fd);
int      kv_parse_hostport(const char *s, char *host, size_t hlen, int *port);
int      kv_parse_size(const char *s, uint64_t *out);  /* 4K, 1M, 64MiB */
void     kv_hex_encode(const void *p, size_t n, char *out);
int      kv_hex_decode(const char *s, void *out, size_t max, size_t *n);
uint64_t kv_checksum(uint64_t h, const void *p, size_t n);
#define  KV_CHECKSUM_INIT 0xcbf29ce484222325ULL

/* ---- pool layout ------------------------------------------------------ */

typedef struct {
    uint32_t layers;
    uint32_t regions;        /* 2: separate K and V, 1: fused */
    uint32_t nblocks;
    uint64_t block_bytes;    /* bytes per block per (layer, region) */
    uint64_t block_stride;   /* distance between blocks in one region */
    uint64_t region_stride;  /* distance between regions of one layer */
    uint64_t layer_stride;   /* distance between layers */
    uint64_t size;           /* bytes the pool must span */
} kv_layout_t;

int      kv_layout_finish(kv_layout_t *l, char *err, size_t elen);
uint64_t kv_layout_off(const kv_layout_t *l, uint32_t lr, uint32_t block);
struct cJSON;
void     kv_layout_json(struct cJSON *o, const kv_layout_t *l);

/* One contiguous write: source offset, destination offset, length. */
typedef struct {
    uint64_t src;
    uint64_t dst;
    uint64_t len;
} kv_seg_t;

/* Walks (src, dst) block pairs in runs, per (layer, region), merging
 * segments that are contiguous on both sides when coalescing is on.  No
 * allocation: it only indexes the caller's arrays. */
typedef struct {
    const kv_layout_t *sl, *dl;
    const uint32_t    *src, *dst;
    uint32_t           n;
    int                coalesce;
    uint32_t           lr, i, k;       /* cursor: layer-region, pair, block */
    int                have_peek;
    kv_seg_t           peek;
} kv_segiter_t;

void kv_segiter_init(kv_segiter_t *it, const kv_layout_t *sl,
    const kv_layout_t *dl, const uint32_t *src, const uint32_t *dst,
    uint32_t n, int coalesce);
int  kv_segiter_next(kv_segiter_t *it, kv_seg_t *out);

/* ---- configuration ---------------------------------------------------- */

/* "lmcache_notify": LMCache's ProxyNotif receiver (lmcache_notify.c) */
#define KV_LMC_MAX_ALLOW  16
typedef struct {
    uint32_t family;                   /* AF_INET, AF_INET6 */
    uint8_t  addr[16], mask[16];
} kv_lmc_cidr_t;
typedef struct {
    char           listen[KV_ADDR_LEN];  /* "" = off */
    kv_lmc_cidr_t  allow[KV_LMC_MAX_ALLOW];
    int            nallow;
} kv_lmc_conf_t;

/* "kv_events": vLLM KV-event publishers the router subscribes to
 * (kv_events_sub.c; parsed in config.c) */
#define KV_EVS_MAX_SOURCES  64
#define KV_EVS_EP_LEN       256
#define KV_EVS_TOPIC_LEN    256
typedef struct {
    char     node[KV_ID_LEN];          /* the node whose cache it is */
    char     http[KV_ADDR_LEN];        /* its vLLM, as nginx names it */
    char     endpoint[KV_EVS_EP_LEN];  /* the PUB: tcp://host:port */
    char     replay[KV_EVS_EP_LEN];    /* the ROUTER; "" = none */
    char     topic[KV_EVS_TOPIC_LEN];  /* exact; "" = vLLM's default */
    char     model[KV_EVS_TOPIC_LEN];  /* the name requests use for its
                                        * model: the prefix index's seed */
    int      replay_timeout_ms;        /* no reply this long: given up */
} kv_evs_src_conf_t;
/* a DNS source: every address its name resolves to is one engine
 * (kv_events_dns.c), e.g. a Kubernetes headless Service's pods */
#define KV_EVS_DNS_LEN      254        /* a name: 253 bytes at most */
typedef struct {
    char     name[KV_EVS_DNS_LEN];     /* "dns" */
    int      port;                     /* the PUB's on each address */
    int      replay_port;              /* the ROUTER's; 0 = none */
    int      http_port;                /* its vLLM's: node = IP:http_port */
    int      family;                   /* AF_UNSPEC, AF_INET, AF_INET6 */
    int      resolve_ms;               /* re-resolved this often */
    char     topic[KV_EVS_TOPIC_LEN];
    char     model[KV_EVS_TOPIC_LEN];
    int      replay_timeout_ms;
} kv_evs_dns_conf_t;
typedef struct {
    kv_evs_src_conf_t src[KV_EVS_MAX_SOURCES];   /* static sources */
    int               nsrc;
    kv_evs_dns_conf_t dns[KV_EVS_MAX_SOURCES];   /* DNS sources */
    int               ndns;
} kv_evs_conf_t;

/* "prefix_index": the KV-events prefix index nginx reads for
 * "dpd_prefix_cache events" (prefix_index.c, prefix_events.c) */
typedef struct {
    char      path[KV_PATH_LEN];       /* "" = off */
    uint64_t  slots;                   /* a power of two */
    uint64_t  map_entries;             /* engine ids remembered */
    int       block;                   /* tokens a block: the engines' */
} kv_pfx_conf_t;

/* "peers_dns": a pool's members from a (headless Service's) DNS name
 * (peers_dns.c; parsed in config.c).  An answer names addresses, never
 * identities: each node claims its id in the handshake and proves it with
 * the key of the link, read from key_file with "{peer}" replaced. */
#define KV_DNS_MAX        8
#define KV_DNS_NAME_LEN   256
#define KV_DNS_PEER_TOKEN "{peer}"
typedef struct {
    char     name[KV_DNS_NAME_LEN];    /* resolved every resolve_ms */
    int      port;                     /* the pool's control port */
    uint32_t role;
    char     key_file[KV_PATH_LEN];    /* pattern with one "{peer}" */
    int      resolve_ms;
} kv_dns_conf_t;

typedef struct {
    char     id[KV_ID_LEN];
    char     ctrl[KV_ADDR_LEN];    /* host:port of its control listener */
    char     http[KV_ADDR_LEN];    /* its vLLM */
    uint32_t role;
    /* the link's keys (the same on both ends); key[0] is the one we prove
     * with when we connect, any of them is accepted */
    uint8_t  key[KV_MAX_KEYS][KV_KEY_MAX];
    size_t   keylen[KV_MAX_KEYS];
    char     kid[KV_MAX_KEYS][KV_KID_LEN];
    int      nkeys;
} kv_peer_conf_t;

typedef struct {
    char           node_id[KV_ID_LEN];
    uint32_t       role;
    char           http[KV_ADDR_LEN];
    char           provider[64];
    int            allow_fallback;
    char           rails[KV_MAX_RAILS][64];
    int            nrails;             /* 0 = auto (topology, else one) */
    int            ranks;              /* pools served: one per TP rank */
    int            cuda_per_rank;      /* memory "cuda": rank r on cuda:r */
    int            staging;            /* KV_STAGE_* */
    uint64_t       stage_chunk;        /* bytes per staging slot */
    uint32_t       stage_slots;        /* slots per rank */
    uint64_t       recv_chunk;         /* bytes per receiver ring slot */
    uint32_t       recv_slots;         /* receiver ring slots per rank */
    char           listen[KV_ADDR_LEN];
    kv_peer_conf_t peers[KV_MAX_PEERS];
    int            npeers;
    kv_dns_conf_t  dns[KV_DNS_MAX];    /* peers_dns */
    int            ndns;
    char           api_socket[108];
    char           state_path[512];
    uint32_t       max_nodes, max_reqs;
    int            has_pool;
    kv_layout_t    layout;
    int            cuda_dev;           /* -1: host memory */
    int            heartbeat_ms, dead_after_ms, transfer_timeout_ms;
    int            reconnect_ms, retention_ms;
    int            quarantine_ms;      /* unacknowledged abort: revoke */
    uint32_t       window;             /* writes in flight per rail */
    uint64_t       max_write;          /* cap on one fi_write */
    int            coalesce;
    uint32_t       max_msg;            /* API/control message cap */
    int            max_clients;
    int            hello_timeout_ms;   /* handshake deadline, both sides */
    int            max_unauth;         /* control conns before the hello */
    int            max_peer_connects;  /* per peer id per window */
    int            peer_connect_window_ms;
    int            debug_verbs;
    int            log_level;
    int            inline_keys;        /* keys written in the config file */
    kv_lmc_conf_t  lmc;                /* lmcache_notify */
    kv_evs_conf_t  evs;                /* kv_events */
    kv_pfx_conf_t  pfx;                /* prefix_index */
} kv_config_t;

enum { KV_STAGE_AUTO = 0, KV_STAGE_HOST_TEST = 1, KV_STAGE_OFF = 2 };

int kv_config_load(kv_config_t *c, const char *path, char *err, size_t elen);
uint32_t kv_role_parse(const char *s);
/* a node id a peer may claim (peers_dns): [A-Za-z0-9._-], no "..", not
 * starting with '.' or '-', under KV_ID_LEN bytes: safe in a file name */
int kv_peer_id_safe(const char *id, size_t len);
/* config_env.c: ${VAR} substitution; the config as `check` shows it */
struct cJSON;
#define KV_ENV_USED            1   /* *used: some value was substituted */
#define KV_ENV_LITERAL_SECRET  2   /* a key is written in the file itself */
int kv_config_expand(struct cJSON *root, int *used, char *err, size_t elen);
int kv_config_print_expanded(const char *path, FILE *out);

/* ---- authentication (auth.c) ------------------------------------------ */

enum { KV_AUTH_CLIENT = 1, KV_AUTH_SERVER = 2 };

int  kv_auth_nonce(uint8_t *out, size_t n);
int  kv_auth_key_id(const uint8_t *key, size_t klen, char out[KV_KID_LEN]);
int  kv_auth_proof(const uint8_t *key, size_t klen, int dir,
    const char *client_id, uint32_t client_role, const char *server_id,
    uint32_t server_role, const uint8_t nc[KV_NONCE_LEN],
    const uint8_t ns[KV_NONCE_LEN], const char *kid, uint8_t out[KV_MAC_LEN]);
int  kv_auth_equal(const uint8_t *a, const uint8_t *b, size_t n);
int  kv_auth_key_hex(kv_peer_conf_t *p, const char *hex, const char *where,
    char *err, size_t elen);
int  kv_auth_key_file(kv_peer_conf_t *p, const char *path, char *err,
    size_t elen);
void kv_auth_forget(kv_config_t *c);
void kv_auth_forget_peer(kv_peer_conf_t *p);

/* ---- state table writer ---------------------------------------------- */

typedef struct {
    char                path[512];
    void               *map;
    size_t              size;
    dpd_state_header_t *hdr;
    dpd_node_rec_t     *nodes;
    dpd_req_rec_t      *reqs;
} kv_state_t;

/* the table's directory as kv_state_open() wants it (`check` asks too,
 * with warn 0: its refusals, not run's advice) */
int  kv_state_dir_check(const char *path, int warn);
int  kv_state_open(kv_state_t *s, const char *path, const char *self_id,
    uint32_t max_nodes, uint32_t max_reqs);
void kv_state_close(kv_state_t *s, int clean);
dpd_node_rec_t *kv_state_node(kv_state_t *s, const char *id);
void kv_state_node_remove(kv_state_t *s, const char *id);
void kv_state_node_begin(dpd_node_rec_t *r);
void kv_state_node_end(kv_state_t *s, dpd_node_rec_t *r);
dpd_req_rec_t *kv_state_req(kv_state_t *s, const char *req_id, int create);
void kv_state_req_begin(dpd_req_rec_t *r);
void kv_state_req_end(kv_state_t *s, dpd_req_rec_t *r);
void kv_state_req_delete(kv_state_t *s, dpd_req_rec_t *r);
void kv_state_gc(kv_state_t *s, uint64_t older_than_wall_ms);

int  kv_status_main(int argc, char **argv);

/* ---- libfabric rails --------------------------------------------------- */

typedef struct kv_op kv_op_t;

typedef struct {
    struct fi_info     *info;
    struct fid_fabric  *fabric;
    struct fid_domain  *domain;
    struct fid_ep      *ep;
    struct fid_av      *av;
    struct fid_cq      *cq;
    struct fid_mr      *pool_mr;
    void               *pool_desc;
    uint64_t            pool_key;
    struct fid_mr      *msg_mr;
    void               *msg_desc;
    char               *msgbuf;        /* KV_NRECV + KV_NSEND slots */
    uint8_t             addr[KV_FABADDR_LEN];
    size_t              addrlen;
    uint64_t            max_rma;
    uint64_t            mr_mode;
    int                 delivery_complete;
    int                 hmem;
    int                 index;
    int                 cq_fd;         /* FI_GETWAIT fd, -1: poll the CQ */
    uint64_t            next_key;
    uint32_t            inflight;      /* writes posted on this rail */
    uint64_t            bytes_out;     /* written (completed) */
    int                 emulated_write; /* EFA: writes are messages */
    char                pci[KV_PATH_LEN]; /* the NIC's sysfs PCI path */
} kv_rail_t;

typedef struct {
    char      provider[64];
    int       allow_fallback;
    int       want_hmem;
    char      rails[KV_MAX_RAILS][64];
    int       nrails;
    kv_rail_t rail[KV_MAX_RAILS];
} kv_fabric_t;

int  kv_fabric_open(kv_fabric_t *f, const char *provider, int allow_fallback,
    char rails[][64], int nrails, int want_hmem);
int  kv_fabric_domains(const char *provider, char names[][64], int max);
int  kv_rail_name_match(const char *want, const char *domain);
void kv_fabric_close(kv_fabric_t *f);
int  kv_rail_reg(kv_rail_t *r, void *buf, size_t len, int cuda_dev,
    uint64_t access, struct fid_mr **mr, void **desc, uint64_t *key);
uint64_t kv_rail_raddr(const kv_rail_t *r, const void *base, uint64_t off);
const char *kv_fi_err(int rc);
int  kv_rail_cq_error(kv_rail_t *r, struct fi_cq_err_entry *e);
ssize_t kv_rail_cq_read(kv_rail_t *r, struct fi_cq_data_entry *ce,
    size_t n);
void kv_fault_init(void);
extern int kv_fault_short_addr;

/* ---- framed JSON connections ----------------------------------------- */

typedef struct {
    int       fd;
    char     *rbuf;
    size_t    rlen, rcap;
    char     *wbuf;
    size_t    wlen, woff, wcap;
    int       fds[4];                 /* SCM_RIGHTS received, unconsumed */
    int       nfds;
    int       closing;
    int       overflow;               /* output limit hit: closed */
} kv_conn_t;

/* Output buffered for one connection is capped (a peer or client that
 * stops reading must not grow our memory): queueing past it fails. */
extern size_t kv_conn_wmax;

void kv_conn_init(kv_conn_t *c, int fd);
void kv_conn_free(kv_conn_t *c);
/* 1: message ready in *msg (length *len, not NUL-terminated); 0: need
 * more; -1: connection closed or error; -2: frame larger than max (errmsg
 * says which). */
int  kv_conn_read(kv_conn_t *c, uint32_t max, int with_fds, char **msg,
    uint32_t *len, const char **errmsg);
void kv_conn_consume(kv_conn_t *c, uint32_t len);
int  kv_conn_queue(kv_conn_t *c, const char *data, size_t len);
int  kv_conn_flush(kv_conn_t *c);     /* -1 on error */
struct cJSON;
int  kv_conn_send_json(kv_conn_t *c, struct cJSON *j);  /* frees j */

/* ---- runtime ----------------------------------------------------------- */

/* ---- PCIe topology (topo.c) ------------------------------------------- */

/* Which rails (NICs) are PCIe-local to each rank's GPU, from sysfs (root
 * overridable with KV_SYSFS_ROOT for tests). */
typedef struct {
    int  nranks;
    int  nrails[KV_MAX_RANKS];
    int  rail[KV_MAX_RANKS][KV_MAX_RAILS];   /* indexes into the names */
    char gpu[KV_MAX_RANKS][KV_PATH_LEN];     /* sysfs PCI path, or "" */
    int  known;                              /* topology was found */
    int  depth[KV_MAX_RANKS];                /* shared PCIe ancestors */
} kv_topo_t;

int  kv_topo_nic_pci(const char *domain, char *out, size_t len);
int  kv_topo_gpus(char out[][KV_PATH_LEN], int max);
void kv_topo_assign(kv_topo_t *t, int nranks, char gpus[][KV_PATH_LEN],
    char pcis[][KV_PATH_LEN], int nnames);
int  kv_topo_plan(kv_ctx_t *ctx);     /* before kv_fabric_open */
int  kv_topo_main(int argc, char **argv);

/* A posted fabric operation; its address is the libfabric context. */
struct kv_op {
    struct fi_context2 fctx;          /* must stay first */
    uint32_t           kind;          /* KV_OP_* */
    uint32_t           slot;          /* push slot or msg slot */
    uint64_t           gen;           /* push generation when posted */
    uint64_t           len;
    int                rail;
    int                rank;
    int                stage;         /* staging slot + 1, 0: none */
    uint32_t           cr;            /* receiver ring credit + 1, 0: none
                                       * (a send: 1 for a chunk notice) */
    int                written_off;   /* no longer in its rail's window */
    kv_op_t           *next_free;
};

enum { KV_OP_WRITE = 1, KV_OP_SEND, KV_OP_RECV };

/* What we know of a peer's pool and fabric, from its hello. */
/* fiaddr[l][r]: the peer's rail r in our rail l's AV (a rank's writes go
 * from its local rails to the peer's rails of the same rank). */
typedef struct {
    int         nrails;
    fi_addr_t   fiaddr[KV_MAX_RAILS][KV_MAX_RAILS];
    uint8_t     av_ok[KV_MAX_RAILS][KV_MAX_RAILS];
    int         nranks;
    int         nrr[KV_MAX_RANKS];                 /* its rails per rank */
    uint8_t     rr[KV_MAX_RANKS][KV_MAX_RAILS];
    uint64_t    key[KV_MAX_RANKS][KV_MAX_RAILS];   /* by its rail index */
    uint64_t    base[KV_MAX_RANKS][KV_MAX_RAILS];
    kv_layout_t layout;
    int         has_pool;
    /* its staged ranks land our writes in a bounded ring of slots it
     * grants (credits); base/key above are then the ring's */
    uint32_t    ring_slots;                        /* 0: no ring */
    uint64_t    ring_chunk;
    uint8_t     ring[KV_MAX_RANKS];
} kv_remote_t;

enum { KV_LINK_DOWN = 0, KV_LINK_CONNECTING, KV_LINK_HELLO, KV_LINK_UP };

typedef struct {
    kv_peer_conf_t conf;
    kv_conn_t      out;               /* our connection to its listener */
    int            out_state;
    uint64_t       next_connect_ms;
    uint64_t       last_heard_ms;     /* any message, either direction */
    uint64_t       last_hb_ms;
    int            alive;
    int            in_conn;           /* index of its inbound conn, -1 */
    kv_remote_t    remote;
    uint64_t       link_gen;
    uint64_t       free_blocks, total_blocks;
    uint32_t       inflight;
    int            warned_down;
    int            warned_auth;        /* a refusal was logged at warn */
    /* handshake of the outbound link */
    uint8_t        nonce_c[KV_NONCE_LEN], nonce_s[KV_NONCE_LEN];
    int            got_challenge;
    uint64_t       hs_deadline_ms;
    double         t_connect_s;
    /* accepted inbound handshakes, for max_peer_connects (ring) */
    uint64_t       in_accepts[64];
    uint32_t       in_accepts_n;
    uint64_t       inst;              /* its incarnation (from hello) */
    int            pidfd;             /* same host: its process, or -1 */
    uint64_t       old_inst;          /* the incarnation before */
    int            old_pidfd;
    int            pid, old_pid;      /* without pidfd_open: the pid and */
    uint64_t       pid_start, old_pid_start;  /* its /proc start time */
    /* the vLLM address it announced in its authenticated hello(_ok): its
     * state record's when our config gives it no "http" (a pod's IP) */
    char           http_seen[KV_ADDR_LEN];
    uint64_t       res_id;            /* its ctrl name being resolved, 0 */
    /* peers_dns (peers_dns.c): found from a DNS answer, not configured */
    int            dyn;               /* its peers_dns entry + 1, or 0 */
    int            dyn_proven;        /* its claimed id was proven */
    int            retired;           /* gone: hidden, its slot reusable
                                       * once nothing refers to it */
    int            dyn_addr;          /* the answer it is linked at, -1 */
    char           dyn_ip[64];        /* its address (answers, inbound) */
    int            dyn_missing;       /* answers in a row without it */
} kv_peer_t;

/* A slot of a receiver's ring granted to one of our pushes: chunk `chunk`
 * of the rank's byte stream goes to it; once every byte was written and
 * the writes completed, a notice tells the receiver. */
enum { KV_CR_FREE = 0, KV_CR_TAKING, KV_CR_WRITTEN };
typedef struct {
    int          state;
    uint32_t     slot, chunk;
    uint64_t     grant;
    uint64_t     len, taken, done;
} kv_credit_t;

enum {
    KV_PUSH_FREE = 0, KV_PUSH_BEGIN, KV_PUSH_WRITING, KV_PUSH_FLUSH,
    KV_PUSH_DONE, KV_PUSH_FAILED
};

/* An outgoing transfer (prefill side). */
typedef struct {
    int          state;
    uint64_t     gen;
    char         req_id[KV_REQID_LEN];
    uint64_t     hash;
    int          peer;
    uint32_t     n;
    uint32_t    *src, *dst;            /* preallocated, pool nblocks each */
    int          dst_given;
    kv_segiter_t it[KV_MAX_RANKS];     /* one walker per rank */
    kv_seg_t     cur[KV_MAX_RANKS];    /* segment being split */
    uint64_t     cur_off[KV_MAX_RANKS];
    uint8_t      cur_valid[KV_MAX_RANKS], rank_done[KV_MAX_RANKS];
    uint32_t     rail_rr[KV_MAX_RANKS];
    uint32_t     rank_rr;
    int          segs_done;            /* every rank's segments taken */
    uint32_t     stage_pending;        /* staged pieces not yet posted */
    uint64_t     bytes_total, bytes_posted, bytes_done;
    uint32_t     inflight;
    uint32_t     next_rail;
    uint64_t     t_start_ms, deadline_ms, t_done_ms;
    uint64_t     begin_id;
    char         error[160];
    int          done_sent;
    int          release_pending;      /* free when inflight drains */
    uint64_t     t_final_ms;           /* DONE/FAILED, for retention */
    uint32_t     cap;                  /* capacity of src/dst */
    int          abort_pending;        /* tell "drained" when inflight 0 */
    int          ring;                 /* the receiver grants ring slots */
    uint64_t     rank_bytes;           /* bytes of one rank's stream */
    uint32_t     nchunks;              /* ring chunks per rank */
    uint32_t     cr_take[KV_MAX_RANKS];  /* next chunk to fill, per rank */
    uint32_t     cr_live;              /* credits held (not yet noticed) */
    kv_credit_t  cr[KV_MAX_RANKS][KV_RING_MAX];
} kv_push_t;

/* A request on the receiving (decode) side: reserved blocks. */
typedef struct {
    int          used;
    uint32_t     state;                /* DPD_REQ_* */
    char         req_id[KV_REQID_LEN];
    uint64_t     hash;
    uint32_t     n;                    /* blocks owned (ctx->owner) */
    char         peer_id[KV_ID_LEN];
    int          peer;                 /* -1 when local only */
    uint64_t     bytes_total, bytes_done;
    uint64_t     deadline_ms;
    uint64_t     t_reserved_ms, t_start_ms, t_done_ms;
    uint64_t     t_final_ms;           /* monotonic, for retention */
    int          auto_res;             /* reserved by a peer's push */
    char         error[160];
    uint64_t     begin_id, begin_inst; /* the push we granted (sender's) */
    int          quar;                 /* failed: the sender may still
                                        * write its blocks */
    int          detached;             /* released: no record, no req_id;
                                        * the slot only holds quarantine */
    uint64_t     quar_since_ms;
    uint64_t     quar_warn_ms;
    /* staged ranks: chunks land in the receiver ring (ring.c) */
    int          ring;
    uint32_t    *blocks;               /* destination blocks, push order */
    uint32_t     nchunks;              /* per rank */
    uint32_t     granted[KV_MAX_RANKS], copied[KV_MAX_RANKS];
    uint32_t     held;                 /* ring slots granted or copying */
    uint32_t     copying;              /* of them, copying into its blocks
                                        * (or lost): the blocks stay owned
                                        * until the engine reports */
    int          ring_left;            /* its sender is done with the ring;
                                        * copies still to report */
    int          done_seen;            /* the sender's done message came */
} kv_rreq_t;

/* A local API client waiting for a request to finish. */
typedef struct {
    int          used;
    int          client;
    uint64_t     deadline_ms;
    char         req_id[KV_REQID_LEN];
} kv_waiter_t;

typedef struct {
    kv_conn_t    conn;
    int          used;
    int          is_peer;              /* control channel: inbound peer */
    int          peer;                 /* after hello, -1 before */
    uint64_t     t_open_ms;
    uint8_t      nonce_s[KV_NONCE_LEN];  /* our challenge (control) */
} kv_client_t;

typedef struct {
    int           fd;                  /* memfd or -1 */
    void         *base;                /* host or device address */
    size_t        size;
    int           cuda_dev;            /* -1 host */
    int           owned_cuda;          /* cudaMalloc'd by us */
    int           imported_cuda;       /* cudaIpcOpenMemHandle */
    void         *fab_base;            /* what the fabric sees */
    int           registered;
    int           staged;              /* copies through kv_stage_t */
    struct fid_mr *mr[KV_MAX_RAILS];   /* on this rank's rails only */
    void         *desc[KV_MAX_RAILS];
    uint64_t      key[KV_MAX_RAILS];
} kv_pool_t;

/* ---- copies between device and host (copy.c) --------------------------
 * An asynchronous copy engine: batches of copies on a stream, each batch
 * closed by an event.  CUDA (cudaMemcpyAsync + cudaEventRecord) when built
 * with it; a host stand-in (a worker thread doing memcpy at a configurable
 * rate) for tests and for staging host pools on purpose. */
typedef struct kv_copy kv_copy_t;
typedef struct {
    const char *name;
    int  (*open)(kv_copy_t *c, int dev);
    int  (*copy)(kv_copy_t *c, void *dst, const void *src, size_t len,
                 int to_dev);                      /* queue on the stream */
    int  (*record)(kv_copy_t *c, uint64_t *seq);   /* event after them */
    int  (*query)(kv_copy_t *c, uint64_t seq);     /* 1 done, 0, -1 */
    int  (*flush)(kv_copy_t *c);  /* make NIC writes visible to kernels */
    void (*close)(kv_copy_t *c);
} kv_copy_ops_t;

struct kv_copy {
    const kv_copy_ops_t *ops;
    int                  dev;
    int                  wake_fd;     /* readable when an event passed, or
                                       * -1 (then the loop polls) */
    void                *priv;
    uint64_t             flushes;
    size_t               jobs;        /* set before open: the most copies
                                       * and events its user queues at
                                       * once (the host queue's size) */
    int                  failed;      /* an event could not be recorded or
                                       * reported an error: what was queued
                                       * may still run, nobody can say when */
};

extern const kv_copy_ops_t kv_copy_host_ops;
#ifdef KV_HAVE_CUDA
extern const kv_copy_ops_t kv_copy_cuda_ops;
#endif
void *kv_copy_host_alloc(kv_copy_t *c, size_t len);   /* pinned or plain */
void  kv_copy_host_free(kv_copy_t *c, void *p, size_t len);

/* The sender's bounded staging ring of one rank: slots of `chunk` bytes of
 * pinned host memory registered on the rank's rails.  A slot is filled by
 * a batch of device->host copies (one event), then written to the peer;
 * its write completion frees it.  Copy k+1 runs while write k is on the
 * wire. */
/* KV_SLOT_LOST: its copies' event failed (the engine cannot say whether
 * they still run): never filled again. */
enum { KV_SLOT_FREE = 0, KV_SLOT_COPYING, KV_SLOT_READY, KV_SLOT_LOST };
#define KV_SLOT_PIECES 64
typedef struct {
    uint64_t  off;                    /* in the slot */
    uint64_t  dst;                    /* in the peer's pool */
    uint64_t  len;
    uint32_t  cr;                     /* receiver ring credit + 1, or 0 */
} kv_piece_t;

typedef struct {
    int        state;
    uint64_t   seq;                   /* copy event */
    uint64_t   t_us, warn_us;         /* copies queued; last warning */
    uint32_t   push;                  /* push slot */
    uint64_t   gen;                   /* its generation */
    uint32_t   npieces, posted, done;
    uint64_t   used;
    kv_piece_t piece[KV_SLOT_PIECES];
} kv_slot_t;

typedef struct {
    kv_copy_t      copy;
    char          *buf;
    size_t         chunk;
    uint32_t       nslots, nfree, nlost;
    kv_slot_t     *slot;
    struct fid_mr *mr[KV_MAX_RAILS];
    void          *desc[KV_MAX_RAILS];
    int            overlap;           /* 0: one slot at a time (baseline) */
    uint64_t       stat_copies, stat_batches;
} kv_stage_t;

int  kv_stage_open(kv_ctx_t *ctx, int rank);
void kv_stage_close(kv_ctx_t *ctx, int rank);

/* A staged receiver's bounded ring of one rank (ring.c): recv_slots slots
 * of recv_chunk pinned bytes registered on the rank's rails, instead of a
 * mirror of the pool.  A slot is granted to one request for one chunk of
 * a rank's byte stream; the sender writes it and sends a notice; the slot
 * is copied into the pool (one event) and then granted again. */
/* KV_RS_LOST: the engine failed with its copies queued: the slot and the
 * holder's blocks stay held until the agent exits. */
enum { KV_RS_FREE = 0, KV_RS_GRANTED, KV_RS_COPYING, KV_RS_LOST };
/* A copy not reported after KV_COPY_SPIN_US is polled with the loop's
 * back-off instead of a busy loop (a hung engine must not spin a core);
 * one unreported for KV_COPY_WARN_US is warned about, and again as long. */
#define KV_COPY_SPIN_US  20000
#define KV_COPY_WARN_US  10000000
typedef struct {
    int        state;
    uint32_t   rreq;                  /* holder: rreq slot */
    uint32_t   chunk;
    uint64_t   grant;                 /* unique per grant */
    uint64_t   len;
    uint64_t   seq;                   /* copy event */
    uint64_t   t_us, warn_us;         /* copies queued; last warning */
} kv_rslot_t;

typedef struct {
    char          *buf;
    size_t         chunk;
    uint32_t       nslots, nfree, nlost;
    kv_rslot_t     slot[KV_RING_MAX];
    int            cuda_dev;          /* the pinned allocation's device */
} kv_rring_t;

int  kv_ring_open(kv_ctx_t *ctx, int rank, int dev);
void kv_ring_close(kv_ctx_t *ctx, int rank);

struct kv_ctx {
    kv_config_t  cfg;
    kv_state_t   st;
    kv_fabric_t  fab;
    int          fab_ok;
    kv_pool_t    pools[KV_MAX_RANKS];  /* one per TP rank */
    int          nranks;
    kv_topo_t    topo;                 /* rails of each rank */
    kv_stage_t  *stage[KV_MAX_RANKS];  /* sender staging rings, or NULL */
    kv_copy_t    rcopy[KV_MAX_RANKS];  /* receiver copy-in engines */
    kv_rring_t  *rring[KV_MAX_RANKS];  /* receiver rings, or NULL */
    uint64_t     grant_seq;
    uint32_t     ring_rr;
    uint64_t     stat_ring_grants, stat_ring_chunks, stat_ring_bad;
    int          rcopy_open[KV_MAX_RANKS];
    uint32_t    *owner;                /* per block: rreq slot + 1, 0 free */
    uint32_t     free_blocks;

    kv_peer_t    peers[KV_MAX_PEERS];
    int          npeers;               /* slots in use (configured first) */
    int          npeers_static;        /* the configured ones */
    struct kv_res  *res;               /* resolve.c: names, off the loop */
    struct kv_pdns *pdns;              /* peers_dns.c, or NULL */

    int          ctrl_lfd, api_lfd;
    /* out of descriptors (EMFILE/ENFILE): a listener is not polled until
     * then (monotonic ms), [0] control, [1] local API */
    uint64_t     accept_pause_ms[2];
    uint32_t     accept_backoff_ms[2];
    kv_loglim_t  accept_warn, ctrl_reject_warn;
    uint64_t     stat_accept_nofd, stat_ctrl_rejected;
    dev_t        api_dev;              /* the socket file bound (unlinked */
    ino_t        api_ino;              /* on exit only if still this one) */
    kv_client_t *clients;              /* API and inbound control conns */
    int          nclients;

    kv_push_t   *push;
    uint32_t     npush;
    uint64_t     push_gen;
    kv_rreq_t   *rreq;
    uint32_t     nrreq;
    kv_waiter_t *waiters;
    uint32_t     nwaiters;

    kv_op_t     *ops;
    kv_op_t     *op_free;
    uint32_t     nops, ops_used;
    uint32_t     send_free[KV_NSEND];
    uint32_t     nsend_free;
    uint32_t     writes_inflight;
    uint32_t     writes_owed;          /* of failed pushes, off the windows */
    uint32_t     push_rr;
    uint32_t    *scratch;              /* nblocks ids, control path */
    uint8_t     *dupmap;               /* nblocks bits: duplicate checks */
    uint64_t     inst;                 /* our incarnation (random) */
    int          revocable;            /* a new MR key stops old writes */
    uint32_t     nquar;                /* requests in quarantine */
    uint64_t     stat_revocations;
    uint32_t     push_cap;             /* max pairs per push */

    uint64_t     begin_seq;
    uint64_t     next_hb_ms;
    uint64_t     next_gc_ms;
    volatile int stop;
    uint64_t     stat_pushes_ok, stat_pushes_failed, stat_bytes_out;
    uint64_t     stat_bytes_in, stat_reqs_ready, stat_reqs_failed;
    uint64_t     stat_ctrl_refused, stat_ctrl_timeouts;
    uint64_t     stat_flushes;
    uint64_t     poll_last_us;         /* adaptive CQ polling (loop.c): */
    int          poll_backoff_us;      /* last completion or post */
    int          copy_backoff_us;      /* polling a slow copy's event */
    struct kv_lmc *lmc;                /* lmcache_notify.c, or NULL */
    struct kv_evs *evs;                /* kv_events_sub.c, or NULL */
    struct kv_evs_dns *evs_dns;        /* kv_events_dns.c, or NULL */
    struct kv_pfx *pfx;                /* prefix_index.c, or NULL */
    struct kv_pfx_feed *pfx_feed;      /* prefix_events.c: evs -> pfx */
};

/* ---- peers from DNS answers (peers_dns.c) ---------------------------- */
#define KV_PDNS_MAX_ADDRS  128         /* addresses followed, all names */
int  kv_pdns_open(kv_ctx_t *ctx);
void kv_pdns_close(kv_ctx_t *ctx);
int  kv_pdns_pollfds(kv_ctx_t *ctx, struct pollfd *pfd, int *who, int base);
void kv_pdns_event(kv_ctx_t *ctx, int i, short revents);
void kv_pdns_tick(kv_ctx_t *ctx, uint64_t now);
/* a discovered peer's outbound link went down / came up (ctrl.c) */
void kv_pdns_link_down(kv_ctx_t *ctx, int peer);
void kv_pdns_link_up(kv_ctx_t *ctx, int peer);
/* an inbound hello from an id no slot holds: a slot if one peers_dns
 * entry's key for it proves the hello, else -1 and why */
int  kv_pdns_inbound(kv_ctx_t *ctx, int client, const char *id,
    const char *kid, const uint8_t nc[KV_NONCE_LEN],
    const uint8_t ns[KV_NONCE_LEN], const uint8_t proof[KV_MAC_LEN],
    char *err, size_t elen);
int  kv_peer_visible(const kv_peer_t *pe);  /* listed, in the table */

/* ---- LMCache notices (lmcache_notify.c) -------------------------------- */
struct pollfd;
int  kv_lmc_config(kv_lmc_conf_t *c, struct cJSON *o, char *err,
    size_t elen);
int  kv_lmc_open(kv_ctx_t *ctx);
#define KV_LMC_NFDS  3   /* the most kv_lmc_pollfds() adds */
int  kv_lmc_pollfds(kv_ctx_t *ctx, struct pollfd *pfd);   /* 0..3 fds */
void kv_lmc_process(kv_ctx_t *ctx);
void kv_lmc_close(kv_ctx_t *ctx);

/* ---- vLLM KV events (kv_events_sub.c; decoder in kv_events.c) -------- */
#include "kv_events.h"

typedef struct {
    uint64_t msgs, refused_msgs;       /* payloads decoded / refused */
    uint64_t gaps, restarts, reconnects, clears;
    uint64_t replays, replays_ok, replays_failed, replayed, dups;
    uint64_t bad_frames, other_topic;
} kv_evs_src_stats_t;

struct kv_evs;
/* connects every static source of c (copied);
 * lim NULL: kv_events.h's bounds.  NULL on failure (logged). */
struct kv_evs *kv_evs_open(const kv_evs_conf_t *c, const kv_ev_sink_t *sink,
    const kv_ev_limits_t *lim);
/* A source added at run time (kv_events_dns.c): its slot index (the
 * origin's idx of its events), or -1 (no slot free, or no socket; logged).
 * c is copied. */
int  kv_evs_add(struct kv_evs *e, const kv_evs_src_conf_t *c);
/* ... closed: nothing more is delivered for slot i */
void kv_evs_remove(struct kv_evs *e, int i);
/* the slot of a source with this endpoint or (http not NULL) this http,
 * else -1 */
int  kv_evs_find(struct kv_evs *e, const char *endpoint, const char *http);
int  kv_evs_free_slots(struct kv_evs *e);
int  kv_evs_pollfds(struct kv_evs *e, struct pollfd *pfd, int max);
void kv_evs_process(struct kv_evs *e);   /* never blocks */
int  kv_evs_nsrc(struct kv_evs *e);
void kv_evs_stats(struct kv_evs *e, int i, kv_evs_src_stats_t *out,
    kv_ev_stats_t *dec);
void kv_evs_close(struct kv_evs *e);
int  kv_events_main(int argc, char **argv);  /* `kv_agent events` */
/* the sink the agent's subscriber delivers to (loop.c) */
void kv_events_sink(kv_ctx_t *ctx, kv_ev_sink_t *sink);


/* trailing "done" message over the fabric (sent after all writes of a
 * request completed with delivery-complete semantics) */
typedef struct {
    uint32_t magic;
    int32_t  status;
    uint64_t hash;
    uint64_t bytes;
    char     req_id[KV_REQID_LEN];
    char     node_id[KV_ID_LEN];
} kv_done_msg_t;

/* a chunk notice (over the fabric, after the writes of one granted ring
 * slot completed, like the done message) */
typedef struct {
    uint32_t magic;
    uint32_t rank;
    uint32_t slot;
    uint32_t pad;
    uint64_t grant;
    uint64_t hash;
    char     req_id[KV_REQID_LEN];
    char     node_id[KV_ID_LEN];
} kv_chunk_msg_t;

#define KV_MSG_SLOT 256   /* >= sizeof(kv_done_msg_t), kv_chunk_msg_t */

/* pool.c */
#define KV_POOL(ctx, r) (&(ctx)->pools[(r)])
int  kv_pool_alloc(kv_ctx_t *ctx);
int  kv_pools_ready(kv_ctx_t *ctx, char *err, size_t elen);
int  kv_pool_adopt_memfd(kv_ctx_t *ctx, kv_pool_t *np, int fd, size_t size,
    char *err, size_t elen);
int  kv_pool_adopt_cuda_ipc(kv_ctx_t *ctx, kv_pool_t *np, const char *hex,
    int dev, size_t size, char *err, size_t elen);
int  kv_pool_replace(kv_ctx_t *ctx, int rank, kv_pool_t *np, char *err,
    size_t elen);
int  kv_pool_register(kv_ctx_t *ctx);
int  kv_pool_revoke(kv_ctx_t *ctx, const char *why);
void kv_pool_unregister(kv_ctx_t *ctx);
const char *kv_pool_access_name(kv_ctx_t *ctx);
void kv_pool_free(kv_ctx_t *ctx);
int  kv_pool_read(kv_ctx_t *ctx, int rank, uint64_t off, void *dst,
    uint64_t len);
int  kv_pool_write(kv_ctx_t *ctx, int rank, uint64_t off, const void *src,
    uint64_t len);

/* ctrl.c */
int  kv_ctrl_listen(kv_ctx_t *ctx);
void kv_ctrl_tick(kv_ctx_t *ctx, uint64_t now);
void kv_ctrl_out_event(kv_ctx_t *ctx, int peer, short revents);
int  kv_ctrl_in_msg(kv_ctx_t *ctx, int client, char *msg, uint32_t len);
void kv_ctrl_link_down(kv_ctx_t *ctx, int peer, const char *why);
int  kv_ctrl_peer_find(kv_ctx_t *ctx, const char *id);
int  kv_ctrl_send(kv_ctx_t *ctx, int peer, struct cJSON *j);
void kv_ctrl_req_event(kv_ctx_t *ctx, const kv_rreq_t *r);
void kv_ctrl_update_node(kv_ctx_t *ctx, int peer);
void kv_ctrl_update_self(kv_ctx_t *ctx);
void kv_ctrl_inbound_closed(kv_ctx_t *ctx, int client);
int  kv_ctrl_accepted(kv_ctx_t *ctx, int client);
int  kv_ctrl_unauth_count(kv_ctx_t *ctx);
void kv_ctrl_rekeyed(kv_ctx_t *ctx, const char *why);
uint64_t kv_proc_start(int pid);      /* 0: gone (or a zombie) */
/* a discovered peer's probe connection, its challenge read: the slot
 * takes the connection over and answers it (peers_dns.c) */
void kv_ctrl_adopt(kv_ctx_t *ctx, int peer, kv_conn_t *conn,
    struct cJSON *challenge);
void kv_ctrl_bind_source(kv_ctx_t *ctx, int fd, int family);

/* xfer.c */
int  kv_xfer_init(kv_ctx_t *ctx);
void kv_xfer_fini(kv_ctx_t *ctx);
int  kv_xfer_progress(kv_ctx_t *ctx);     /* returns 1 when busy */
int  kv_push_start(kv_ctx_t *ctx, const char *req_id, int peer,
    const uint32_t *src, const uint32_t *dst, uint32_t n, int dst_given,
    char *err, size_t elen);
kv_push_t *kv_push_find(kv_ctx_t *ctx, const char *req_id);
void kv_push_release(kv_ctx_t *ctx, kv_push_t *p);
void kv_push_begin_reply(kv_ctx_t *ctx, int peer, struct cJSON *j);
void kv_push_peer_down(kv_ctx_t *ctx, int peer, const char *why);
int  kv_rreq_reserve(kv_ctx_t *ctx, const char *req_id, uint32_t n,
    const uint32_t *want, int peer, char *err, size_t elen,
    kv_rreq_t **out);
kv_rreq_t *kv_rreq_find(kv_ctx_t *ctx, const char *req_id);
void kv_rreq_set(kv_ctx_t *ctx, kv_rreq_t *r, uint32_t state,
    const char *error);
void kv_rreq_release(kv_ctx_t *ctx, kv_rreq_t *r);
void kv_rreq_peer_down(kv_ctx_t *ctx, int peer, const char *why);
int  kv_ctrl_push_begin(kv_ctx_t *ctx, int peer, struct cJSON *j,
    struct cJSON *reply);
void kv_xfer_timeouts(kv_ctx_t *ctx, uint64_t now);
void kv_xfer_fail_all(kv_ctx_t *ctx, const char *why);
int  kv_xfer_busy(kv_ctx_t *ctx);
typedef struct {
    int busy, copies, polled, live;
    int slow;                          /* copies to poll, all older than
                                        * KV_COPY_SPIN_US: back off */
} kv_poll_state_t;

/* A copy batch queued at t_us on engine c, for the poll loop: counted,
 * and without a wake fd busy-polled while young, backed off after. */
static inline void
kv_copy_poll(const kv_copy_t *c, uint64_t t_us, uint64_t now,
    kv_poll_state_t *ps)
{
    ps->copies = 1;
    if (c->wake_fd < 0) {
        if (now - t_us < KV_COPY_SPIN_US) {
            ps->polled = 1;
        } else {
            ps->slow = 1;
        }
    }
}

/* 1 (and *warn_us = now) when a copy still unreported is due a warning */
static inline int
kv_copy_overdue(uint64_t now, uint64_t *warn_us)
{
    if (now - *warn_us < KV_COPY_WARN_US) {
        return 0;
    }
    *warn_us = now;
    return 1;
}
void kv_xfer_poll_state(kv_ctx_t *ctx, uint64_t now, kv_poll_state_t *ps);
int  kv_dup_check(kv_ctx_t *ctx, const uint32_t *ids, uint32_t n,
    uint32_t *dup);
void kv_push_cancel_msg(kv_ctx_t *ctx, int peer, struct cJSON *j);
void kv_rreq_abort_msg(kv_ctx_t *ctx, int peer, struct cJSON *j);
void kv_rreq_peer_up(kv_ctx_t *ctx, int peer);
void kv_quar_tick(kv_ctx_t *ctx, uint64_t now);
void kv_quar_lift_all(kv_ctx_t *ctx, const char *why);

/* ring.c (receiver ring) */
int  kv_ring_setup(kv_ctx_t *ctx, kv_rreq_t *r, const uint32_t *dst,
    uint32_t n, char *err, size_t elen);
int  kv_ring_complete(kv_ctx_t *ctx, const kv_rreq_t *r);
void kv_ring_release(kv_ctx_t *ctx, kv_rreq_t *r);
int  kv_ring_usable(kv_ctx_t *ctx, char *err, size_t elen);
uint32_t kv_xfer_lost(kv_ctx_t *ctx);
uint32_t kv_copy_held(kv_ctx_t *ctx);
uint32_t kv_copies_settle(kv_ctx_t *ctx, int ms);
uint32_t kv_ring_lost(kv_ctx_t *ctx);
void kv_rreq_copies_done(kv_ctx_t *ctx, kv_rreq_t *r);
void kv_ring_grant(kv_ctx_t *ctx);
void kv_ring_notice(kv_ctx_t *ctx, const char *buf, size_t len);
int  kv_ring_progress(kv_ctx_t *ctx);
void kv_ring_poll_state(kv_ctx_t *ctx, uint64_t now_us,
    kv_poll_state_t *ps);
int  kv_rreq_ctrl_send(kv_ctx_t *ctx, kv_rreq_t *r, struct cJSON *j);
void kv_rreq_ring_check(kv_ctx_t *ctx, kv_rreq_t *r);
void kv_push_credit_msg(kv_ctx_t *ctx, int peer, struct cJSON *j);

/* api.c */
int  kv_api_listen(kv_ctx_t *ctx);
void kv_api_unlink(kv_ctx_t *ctx);
int  kv_api_msg(kv_ctx_t *ctx, int client, char *msg, uint32_t len);
void kv_api_notify(kv_ctx_t *ctx, const char *req_id);
void kv_api_waiters_tick(kv_ctx_t *ctx, uint64_t now);
struct cJSON *kv_api_req_json(kv_ctx_t *ctx, const char *req_id);

/* loop.c */
int  kv_run_main(int argc, char **argv);
int  kv_client_add(kv_ctx_t *ctx, int fd, int is_peer);
void kv_client_close(kv_ctx_t *ctx, int i);
int  kv_client_send(kv_ctx_t *ctx, int i, struct cJSON *j);

/* bench.c */
int  kv_bench_main(int argc, char **argv);

/* runs: encode/decode block lists as [[start, count], ...] */
int  kv_runs_parse(struct cJSON *arr, uint32_t *out, uint32_t max,
    uint32_t *n, char *err, size_t elen);
int  kv_ids_parse(struct cJSON *arr, uint32_t *out, uint32_t max,
    uint32_t *n, char *err, size_t elen);
struct cJSON *kv_runs_json(const uint32_t *ids, uint32_t n);

#endif /* KV_H */
