/*
 * resolve.h - asynchronous name resolution for the agent's poll() loop.
 *
 * getaddrinfo() runs in worker threads; answers come back to the loop
 * through an eventfd, and handlers run on the loop's thread only (from
 * kv_res_process()), so a handler may use any loop state, start or
 * cancel requests.  The loop never blocks on a lookup:
 *
 *   - a request that has no answer after timeout_ms gets its handler
 *     called with KV_RES_ETIMEDOUT; a thread stuck in getaddrinfo() is
 *     left to finish (its late answer is discarded) and a fresh thread
 *     serves the next requests, up to KV_RES_THREADS_HARD threads in all;
 *   - at most max_pending requests are outstanding (kv_res_start() says
 *     no beyond that), and an answer keeps at most max_addrs addresses;
 *   - kv_res_destroy() waits at most ~200 ms for idle threads to leave
 *     and never for a thread inside getaddrinfo(): such a thread is
 *     detached and frees what it holds when (if ever) it returns.
 *
 * Answers are sorted (IPv4 before IPv6, then by address bytes) and
 * without duplicates, so two answers for one name compare entry by entry
 * and, when a name yields more than max_addrs addresses, the same lowest
 * max_addrs are kept every time (a large set does not flap).  getaddrinfo
 * gives no TTL: callers re-resolve on a period of their own.
 *
 * Usage:
 *     kv_res_t *r = kv_res_create(NULL);          // defaults
 *     poll kv_res_fd(r) for POLLIN; on it, and at least every timer tick
 *     (timeouts are checked there), call kv_res_process(r);
 *     id = kv_res_start(r, "svc.ns.svc.cluster.local", 5557, AF_UNSPEC,
 *                       handler, data);           // 0: refused, errno
 *     kv_res_cancel(r, id);    // the handler is then never called
 *     kv_res_destroy(r);       // pending requests dropped, no handler
 *
 * Not thread-safe: every call but the workers' is made on one thread.
 */

#ifndef KV_RESOLVE_H
#define KV_RESOLVE_H

#include <stddef.h>
#include <stdint.h>

#define KV_RES_NAME_MAX      255    /* bytes of a name (DNS: 253) */
#define KV_RES_MAX_ADDRS     64     /* default and cap of max_addrs */
#define KV_RES_THREADS_HARD  16     /* threads, stuck ones included */

/* kv_res_result_t.status: 0, one of these, or (negative) an EAI_* code
 * of getaddrinfo() (EAI_NONAME: no such name, EAI_AGAIN: try again). */
#define KV_RES_OK            0
#define KV_RES_ETIMEDOUT     1      /* no answer within timeout_ms */
#define KV_RES_ENOMEM        2

typedef struct kv_res kv_res_t;

typedef struct {
    int         max_threads;   /* workers not stuck; default 2, max 16 */
    int         max_pending;   /* outstanding requests; default 64 */
    int         max_addrs;     /* addresses kept per answer; default and
                                * at most KV_RES_MAX_ADDRS */
    int         timeout_ms;    /* default 10000 */
} kv_res_conf_t;

typedef struct {
    int         family;        /* AF_INET or AF_INET6 */
    uint8_t     addr[16];      /* network order; 4 bytes used for v4 */
    uint32_t    scope_id;      /* IPv6 link-local scope, else 0 */
    int         port;          /* as given to kv_res_start() */
} kv_res_addr_t;

typedef struct {
    uint64_t              id;
    const char           *name;
    int                   port;
    int                   status;      /* KV_RES_OK, KV_RES_E*, EAI_* */
    const char           *error;       /* text for status; "" when 0 */
    const kv_res_addr_t  *addrs;       /* sorted, unique */
    uint32_t              naddrs;      /* <= max_addrs */
    uint32_t              total;       /* unique addresses before the cap */
} kv_res_result_t;

/* Called on the loop's thread from kv_res_process().  res and what it
 * points to are valid during the call only. */
typedef void (*kv_res_handler_pt)(void *data, const kv_res_result_t *res);

/* conf NULL: the defaults.  NULL on failure (errno). */
kv_res_t *kv_res_create(const kv_res_conf_t *conf);

/* the descriptor to poll for POLLIN */
int       kv_res_fd(kv_res_t *r);

/* Start resolving name (a host name or a numeric address) for port;
 * family AF_UNSPEC, AF_INET or AF_INET6.  Returns the request's id
 * (never 0), or 0 with errno: EINVAL (empty or too long name, a NUL-free
 * C string is required; bad family or port), EAGAIN (max_pending
 * outstanding), ENOMEM, or what pthread_create() said when no worker
 * exists and none could be started. */
uint64_t  kv_res_start(kv_res_t *r, const char *name, int port, int family,
    kv_res_handler_pt handler, void *data);

/* Forget a request: its handler will not be called.  Unknown or already
 * answered ids are ignored. */
void      kv_res_cancel(kv_res_t *r, uint64_t id);

/* Deliver answers and timeouts.  Never blocks. */
void      kv_res_process(kv_res_t *r);

/* requests outstanding */
int       kv_res_pending(kv_res_t *r);

/* Drop every request (no handler is called) and free r; see above. */
void      kv_res_destroy(kv_res_t *r);

/* "192.0.2.1" or "2001:db8::1" (with_port 0); "192.0.2.1:80" or
 * "[2001:db8::1]:80" (with_port 1), as nginx names an upstream peer.
 * Returns the length, or -1 when len is too small (buf then ""). */
int       kv_res_addr_str(const kv_res_addr_t *a, int with_port, char *buf,
    size_t len);

/* <0, 0, >0 in the order answers are sorted (the port is not compared) */
int       kv_res_addr_cmp(const kv_res_addr_t *a, const kv_res_addr_t *b);

#endif /* KV_RESOLVE_H */
