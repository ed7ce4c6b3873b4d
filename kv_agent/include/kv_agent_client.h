/*
 * kv_agent_client.h - C client for the kv_agent local API (Unix socket,
 * 4-byte big-endian length + JSON).  Link build/libkvagent_client.a and
 * -lcjson.  Every call is synchronous; functions return 0 on success and
 * -1 on failure with a message in err (the agent's error text when it
 * answered one).  A kvc_t is not thread-safe: use one per thread.
 */

#ifndef KV_AGENT_CLIENT_H
#define KV_AGENT_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvc kvc_t;

typedef struct {
    char     state[16];      /* reserved|transferring|ready|failed (receive)
                                pending|transferring|done|failed (push) */
    int      final;          /* 1 when the state will not change any more */
    int      timeout;        /* kvc_wait returned at its deadline */
    uint64_t bytes_done;
    uint64_t bytes_total;
    uint32_t nblocks;
    char     error[160];
} kvc_req_state_t;

kvc_t *kvc_connect(const char *socket_path, int timeout_ms, char *err,
    size_t elen);
void   kvc_close(kvc_t *c);

/* One raw request/reply; *reply is malloc'd JSON (free() it).  fd >= 0 is
 * passed with SCM_RIGHTS.  Returns 0 when the agent answered "ok": true. */
int kvc_call(kvc_t *c, const char *json, int fd, char **reply, char *err,
    size_t elen);

/* Host memory pool: a memfd (memfd_create with MFD_ALLOW_SEALING +
 * ftruncate) of >= the layout's size; the agent maps it MAP_SHARED.  The
 * memfd is sealed here (F_SEAL_SHRINK | F_SEAL_GROW) before it is sent:
 * the agent refuses unsealed ones, and the engine cannot resize it after. */
int kvc_register_host_pool(kvc_t *c, int memfd, size_t size, char *err,
    size_t elen);
/* GPU pool: a cudaIpcMemHandle_t exported by the engine, as raw bytes. */
int kvc_register_cuda_pool(kvc_t *c, int device, const void *ipc_handle,
    size_t handle_len, size_t size, char *err, size_t elen);

/* Decode side: reserve nblocks for req_id; the blocks (ascending) go to
 * blocks[0..*n) when blocks is not NULL (max entries). */
int kvc_reserve(kvc_t *c, const char *req_id, uint32_t nblocks,
    uint32_t *blocks, uint32_t max, uint32_t *n, char *err, size_t elen);

/* Prefill side: write src[i] -> dst[i] into peer's pool; dst NULL lets the
 * peer use its reservation for req_id (or pick free blocks). */
int kvc_push(kvc_t *c, const char *req_id, const char *peer,
    const uint32_t *src, const uint32_t *dst, uint32_t n, char *err,
    size_t elen);

int kvc_poll(kvc_t *c, const char *req_id, kvc_req_state_t *st, char *err,
    size_t elen);
int kvc_wait(kvc_t *c, const char *req_id, int timeout_ms,
    kvc_req_state_t *st, char *err, size_t elen);
int kvc_release(kvc_t *c, const char *req_id, char *err, size_t elen);

/* The agent's checksum of blocks (hex, 16 digits + NUL). */
int kvc_checksum(kvc_t *c, const uint32_t *blocks, uint32_t n,
    char out[17], char *err, size_t elen);

#ifdef __cplusplus
}
#endif

#endif /* KV_AGENT_CLIENT_H */
