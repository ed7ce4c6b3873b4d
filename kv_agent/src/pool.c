/*
 * pool.c - the KV pool's memory: host (a memfd, ours or the engine's via
 * SCM_RIGHTS) or CUDA (cudaMalloc'd by us or imported from the engine with
 * cudaIpcOpenMemHandle).  The pool is registered with every rail once;
 * GPU memory goes through fi_mr_regattr(FI_HMEM_CUDA) when the provider
 * has FI_HMEM, otherwise through a pinned host mirror (staging).
 */

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef KV_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "kv.h"

/*
 * Least privilege: a decode pool is only ever the target of prefill peers'
 * RMA writes (FI_REMOTE_WRITE; nothing reads it remotely, and the agent
 * never posts an operation from it); a prefill pool is only ever the local
 * source of our own writes (FI_WRITE, the access FI_MR_LOCAL needs for the
 * descriptor) and is not remotely accessible.
 */
static uint64_t
pool_access(kv_ctx_t *ctx)
{
    return ctx->cfg.role == DPD_ROLE_DECODE ? FI_REMOTE_WRITE : FI_WRITE;
}


const char *
kv_pool_access_name(kv_ctx_t *ctx)
{
    return ctx->cfg.role == DPD_ROLE_DECODE
           ? "FI_REMOTE_WRITE (remote write only)"
           : "FI_WRITE (local source only, no remote access)";
}


static int
host_map(kv_pool_t *p, int fd, size_t size)
{
    /* populate now: page faults inside the provider's receive path would
     * otherwise cost a fault per 4 KiB on the first transfer */
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_POPULATE, fd, 0);

    if (m == MAP_FAILED) {
        return -1;
    }
    p->fd = fd;
    p->base = m;
    p->size = size;
    p->cuda_dev = -1;
    return 0;
}


int
kv_pool_alloc(kv_ctx_t *ctx)
{
    kv_pool_t *p = &ctx->pool;
    size_t size = ctx->cfg.layout.size;
    int fd;

    memset(p, 0, sizeof(*p));
    p->fd = -1;
    p->cuda_dev = -1;
    if (ctx->cfg.cuda_dev >= 0) {
#ifdef KV_HAVE_CUDA
        cudaError_t ce = cudaSetDevice(ctx->cfg.cuda_dev);
        if (ce == cudaSuccess) {
            ce = cudaMalloc(&p->base, size);
        }
        if (ce != cudaSuccess) {
            kv_err("pool: cuda:%d: cannot allocate %zu bytes: %s",
                   ctx->cfg.cuda_dev, size, cudaGetErrorString(ce));
            return -1;
        }
        p->size = size;
        p->cuda_dev = ctx->cfg.cuda_dev;
        p->owned_cuda = 1;
        kv_info("pool: %zu bytes on cuda:%d", size, p->cuda_dev);
        return 0;
#else
        kv_err("pool: memory cuda:%d requested but this kv_agent was built "
               "without CUDA", ctx->cfg.cuda_dev);
        return -1;
#endif
    }
    fd = memfd_create("kv_pool", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ftruncate(fd, size) != 0
        || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
           != 0
        || host_map(p, fd, size) != 0)
    {
        kv_err("pool: cannot allocate %zu bytes of host memory: %s", size,
               strerror(errno));
        if (fd >= 0) {
            close(fd);
        }
        return -1;
    }
    kv_info("pool: %zu bytes of host memory (%u layers x %u regions x %u "
            "blocks x %llu bytes)", size, ctx->cfg.layout.layers,
            ctx->cfg.layout.regions, ctx->cfg.layout.nblocks,
            (unsigned long long) ctx->cfg.layout.block_bytes);
    return 0;
}


/* Free a pool's memory (not its registrations). */
static void
pool_release(kv_pool_t *p)
{
#ifdef KV_HAVE_CUDA
    if (p->mirror) {
        cudaFreeHost(p->mirror);
    }
    if (p->owned_cuda) {
        cudaFree(p->base);
    } else if (p->imported_cuda) {
        cudaIpcCloseMemHandle(p->base);
    }
#endif
    if (p->cuda_dev < 0 && p->base) {
        munmap(p->base, p->size);
    }
    if (p->fd >= 0) {
        close(p->fd);
    }
    memset(p, 0, sizeof(*p));
    p->fd = -1;
    p->cuda_dev = -1;
}


void
kv_pool_free(kv_ctx_t *ctx)
{
    kv_pool_unregister(ctx);
    pool_release(&ctx->pool);
}


/*
 * Adopt the engine's memfd into *np (ctx's pool is not touched).  The
 * memfd must be sealed against shrinking and growing: the engine keeps
 * its descriptor, and a pool it could ftruncate would kill the agent with
 * SIGBUS on the next access (or a provider's write into it).  On error the
 * caller still owns fd.
 */
int
kv_pool_adopt_memfd(kv_ctx_t *ctx, kv_pool_t *np, int fd, size_t size,
    char *err, size_t elen)
{
    struct stat sb;
    int seals;

    memset(np, 0, sizeof(*np));
    np->fd = -1;
    np->cuda_dev = -1;
    seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0) {
        snprintf(err, elen, "the pool descriptor is not a sealable memfd "
                 "(F_GET_SEALS: %s): create it with memfd_create("
                 "MFD_ALLOW_SEALING) and seal it with F_SEAL_SHRINK | "
                 "F_SEAL_GROW", strerror(errno));
        return -1;
    }
    if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW))
        != (F_SEAL_SHRINK | F_SEAL_GROW))
    {
        snprintf(err, elen, "the pool memfd is not sealed against resizing "
                 "(seals 0x%x): add F_SEAL_SHRINK | F_SEAL_GROW with "
                 "fcntl(F_ADD_SEALS) before register_pool", seals);
        return -1;
    }
    /* sealed: the size read now cannot change under us */
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        snprintf(err, elen, "passed descriptor is not a memfd");
        return -1;
    }
    if (size == 0) {
        size = sb.st_size;
    }
    if ((uint64_t) sb.st_size < size || size < ctx->cfg.layout.size) {
        snprintf(err, elen, "pool memory is %lld bytes, the layout needs %llu",
                 (long long) sb.st_size,
                 (unsigned long long) ctx->cfg.layout.size);
        return -1;
    }
    if (host_map(np, fd, size) != 0) {
        snprintf(err, elen, "cannot map pool memory: %s", strerror(errno));
        np->fd = -1;
        return -1;
    }
    return 0;
}


#ifdef KV_HAVE_CUDA
/* The allocation ptr belongs to, from the driver (cuMemGetAddressRange,
 * reached through the runtime so that we do not link libcuda). */
typedef int (*kv_cu_range_fn)(unsigned long long *base, size_t *size,
    unsigned long long ptr);

static int
cuda_alloc_range(void *ptr, uintptr_t *base, size_t *size, char *err,
    size_t elen)
{
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSuccess;
    unsigned long long b = 0;
    kv_cu_range_fn fn = NULL;
    cudaError_t ce;
    int rc;

#if CUDART_VERSION >= 12050
    ce = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange",
                                          (void **) &fn, 12000,
                                          cudaEnableDefault, &q);
#elif CUDART_VERSION >= 12000
    ce = cudaGetDriverEntryPoint("cuMemGetAddressRange", (void **) &fn,
                                 cudaEnableDefault, &q);
#else
    ce = cudaGetDriverEntryPoint("cuMemGetAddressRange", (void **) &fn,
                                 cudaEnableDefault);
#endif
    if (ce != cudaSuccess || q != cudaDriverEntryPointSuccess || !fn) {
        snprintf(err, elen, "cannot check the size of the imported "
                 "allocation (cuMemGetAddressRange unavailable: %s)",
                 cudaGetErrorString(ce));
        return -1;
    }
    rc = fn(&b, size, (unsigned long long) (uintptr_t) ptr);
    if (rc != 0) {
        snprintf(err, elen, "cuMemGetAddressRange failed (CUresult %d)", rc);
        return -1;
    }
    *base = (uintptr_t) b;
    return 0;
}
#endif


int
kv_pool_adopt_cuda_ipc(kv_ctx_t *ctx, kv_pool_t *np, const char *hex,
    int dev, size_t size, char *err, size_t elen)
{
    memset(np, 0, sizeof(*np));
    np->fd = -1;
    np->cuda_dev = -1;
#ifdef KV_HAVE_CUDA
    cudaIpcMemHandle_t h;
    struct cudaPointerAttributes pa;
    cudaError_t ce;
    uintptr_t abase = 0;
    size_t n, asize = 0;
    void *ptr = NULL;

    if (kv_hex_decode(hex, &h, sizeof(h), &n) != 0 || n != sizeof(h)) {
        snprintf(err, elen, "ipc_handle must be %zu bytes of hex",
                 sizeof(h));
        return -1;
    }
    if (size < ctx->cfg.layout.size) {
        snprintf(err, elen, "pool memory is %zu bytes, the layout needs %llu",
                 size, (unsigned long long) ctx->cfg.layout.size);
        return -1;
    }
    ce = cudaSetDevice(dev);
    if (ce == cudaSuccess) {
        ce = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
    }
    if (ce != cudaSuccess) {
        snprintf(err, elen, "cudaIpcOpenMemHandle: %s",
                 cudaGetErrorString(ce));
        return -1;
    }
    /* the engine's "size" is a claim: the allocation behind the handle
     * must really span it, or the NIC and our copies would run past it */
    ce = cudaPointerGetAttributes(&pa, ptr);
    if (ce != cudaSuccess || pa.type != cudaMemoryTypeDevice
        || pa.device != dev)
    {
        snprintf(err, elen, "the imported handle is not device memory of "
                 "cuda:%d", dev);
        cudaIpcCloseMemHandle(ptr);
        return -1;
    }
    if (cuda_alloc_range(ptr, &abase, &asize, err, elen) != 0) {
        cudaIpcCloseMemHandle(ptr);
        return -1;
    }
    if ((uintptr_t) ptr < abase
        || size > asize - ((uintptr_t) ptr - abase))
    {
        snprintf(err, elen, "pool size %zu exceeds the imported allocation "
                 "(%zu bytes)", size, asize - ((uintptr_t) ptr - abase));
        cudaIpcCloseMemHandle(ptr);
        return -1;
    }
    np->base = ptr;
    np->size = size;
    np->cuda_dev = dev;
    np->imported_cuda = 1;
    return 0;
#else
    snprintf(err, elen, "this kv_agent was built without CUDA");
    (void) ctx; (void) hex; (void) dev; (void) size;
    return -1;
#endif
}


/* Register p with every rail into mr/desc/key (the rails' current pool
 * MRs are not touched).  On failure nothing stays registered. */
static int
reg_all(kv_ctx_t *ctx, kv_pool_t *p, struct fid_mr **mr, void **desc,
    uint64_t *key)
{
    kv_rail_t *r;
    int i, k, dev;

    p->fab_base = p->base;
    dev = -1;
    if (p->cuda_dev >= 0) {
        if (ctx->fab.nrails > 0 && ctx->fab.rail[0].hmem) {
            dev = p->cuda_dev;
        } else {
#ifdef KV_HAVE_CUDA
            if (p->mirror == NULL
                && cudaMallocHost(&p->mirror, p->size) != cudaSuccess)
            {
                p->mirror = NULL;
                kv_err("pool: cannot allocate %zu bytes of pinned staging "
                       "memory", p->size);
                return -1;
            }
            p->fab_base = p->mirror;
            kv_info("pool: GPU memory staged through a pinned host mirror");
#endif
        }
    }
    for (i = 0; i < ctx->fab.nrails; i++) {
        r = &ctx->fab.rail[i];
        if (kv_rail_reg(r, p->fab_base, p->size, dev, pool_access(ctx),
                        &mr[i], &desc[i], &key[i]) != 0)
        {
            for (k = 0; k < i; k++) {
                fi_close(&mr[k]->fid);
            }
            return -1;
        }
    }
    return 0;
}


static void
install_mrs(kv_ctx_t *ctx, struct fid_mr **mr, void **desc, uint64_t *key)
{
    kv_rail_t *r;
    int i;

    for (i = 0; i < ctx->fab.nrails; i++) {
        r = &ctx->fab.rail[i];
        if (r->pool_mr) {
            fi_close(&r->pool_mr->fid);
        }
        r->pool_mr = mr[i];
        r->pool_desc = desc[i];
        r->pool_key = key[i];
    }
    ctx->pool.registered = 1;
    kv_info("pool: registered %zu bytes on %d rail(s), access %s%s",
            ctx->pool.size, ctx->fab.nrails, kv_pool_access_name(ctx),
            ctx->cfg.role == DPD_ROLE_DECODE
            ? "; its key goes to authenticated prefill peers only" : "");
}


int
kv_pool_register(kv_ctx_t *ctx)
{
    struct fid_mr *mr[KV_MAX_RAILS];
    void *desc[KV_MAX_RAILS];
    uint64_t key[KV_MAX_RAILS];

    if (reg_all(ctx, &ctx->pool, mr, desc, key) != 0) {
        return -1;
    }
    install_mrs(ctx, mr, desc, key);
    return 0;
}


/*
 * Make *np the pool: register it first, and only when that worked drop
 * the old registration and memory.  A refused pool changes nothing (np's
 * resources are freed, the old pool stays registered under its keys).
 */
int
kv_pool_replace(kv_ctx_t *ctx, kv_pool_t *np, char *err, size_t elen)
{
    struct fid_mr *mr[KV_MAX_RAILS];
    void *desc[KV_MAX_RAILS];
    uint64_t key[KV_MAX_RAILS];

    if (ctx->fab_ok && reg_all(ctx, np, mr, desc, key) != 0) {
        snprintf(err, elen, "cannot register the pool with the fabric");
        pool_release(np);
        return -1;
    }
    if (ctx->fab_ok) {
        install_mrs(ctx, mr, desc, key);  /* closes the old MRs */
    }
    pool_release(&ctx->pool);
    ctx->pool = *np;
    ctx->pool.registered = ctx->fab_ok;
    kv_info("pool: adopted %zu bytes of engine %s memory", ctx->pool.size,
            ctx->pool.cuda_dev >= 0 ? "GPU (CUDA IPC)" : "host (memfd)");
    return 0;
}


/*
 * Revocation: the same memory under new keys.  Receives in progress fail
 * (their senders' later writes carry the old key), every peer's address
 * leaves our AVs (with FI_AV_REMOVE_CLEANUP the provider closes its
 * connections, so a write half received cannot finish), the old MRs are
 * closed, and peers reconnect to learn the new keys.  After that no write
 * issued under the old registration can land: quarantines end.
 */
int
kv_pool_revoke(kv_ctx_t *ctx, const char *why)
{
    struct fid_mr *mr[KV_MAX_RAILS];
    void *desc[KV_MAX_RAILS];
    uint64_t key[KV_MAX_RAILS];
    uint32_t i, nq = ctx->nquar;

    if (!ctx->fab_ok || !ctx->pool.registered || !ctx->revocable) {
        return -1;
    }
    for (i = 0; ctx->rreq && i < ctx->nrreq; i++) {
        if (ctx->rreq[i].used
            && ctx->rreq[i].state == DPD_REQ_TRANSFERRING)
        {
            kv_rreq_set(ctx, &ctx->rreq[i], DPD_REQ_FAILED,
                        "memory keys revoked");
        }
    }
    kv_ctrl_rekeyed(ctx, "memory keys revoked");
    if (reg_all(ctx, &ctx->pool, mr, desc, key) != 0) {
        /* no new keys: without a registration nothing can land either */
        kv_pool_unregister(ctx);
        kv_err("pool: revocation could not register the pool again; it "
               "takes no transfers until the engine registers one");
    } else {
        install_mrs(ctx, mr, desc, key);
    }
    ctx->stat_revocations++;
    kv_warn("pool: memory keys revoked (%s); %u quarantined request(s) "
            "freed, peers reconnect with the new keys", why, nq);
    kv_quar_lift_all(ctx, "memory keys revoked");
    return 0;
}


void
kv_pool_unregister(kv_ctx_t *ctx)
{
    int i;

    for (i = 0; i < ctx->fab.nrails; i++) {
        if (ctx->fab.rail[i].pool_mr) {
            fi_close(&ctx->fab.rail[i].pool_mr->fid);
            ctx->fab.rail[i].pool_mr = NULL;
        }
    }
    ctx->pool.registered = 0;
}


/*
 * Copy [off, off + len) between the GPU pool and its pinned mirror: to_gpu
 * after the fabric wrote the mirror, else before the fabric reads it.
 * A no-op without a mirror.
 */
int
kv_pool_stage(kv_ctx_t *ctx, uint64_t off, uint64_t len, int to_gpu)
{
#ifdef KV_HAVE_CUDA
    kv_pool_t  *p = &ctx->pool;
    char       *gpu, *host;

    if (p->mirror == NULL) {
        return 0;
    }
    gpu = (char *) p->base + off;
    host = (char *) p->mirror + off;
    if ((to_gpu ? cudaMemcpy(gpu, host, len, cudaMemcpyHostToDevice)
                : cudaMemcpy(host, gpu, len, cudaMemcpyDeviceToHost))
        != cudaSuccess)
    {
        return -1;
    }
#else
    (void) ctx; (void) off; (void) len; (void) to_gpu;
#endif
    return 0;
}


int
kv_pool_read(kv_ctx_t *ctx, uint64_t off, void *dst, uint64_t len)
{
    kv_pool_t *p = &ctx->pool;

    if (off > p->size || len > p->size - off) {
        return -1;
    }
#ifdef KV_HAVE_CUDA
    if (p->cuda_dev >= 0) {
        return cudaMemcpy(dst, (char *) p->base + off, len,
                          cudaMemcpyDeviceToHost) == cudaSuccess ? 0 : -1;
    }
#endif
    memcpy(dst, (char *) p->base + off, len);
    return 0;
}


int
kv_pool_write(kv_ctx_t *ctx, uint64_t off, const void *src, uint64_t len)
{
    kv_pool_t *p = &ctx->pool;

    if (off > p->size || len > p->size - off) {
        return -1;
    }
#ifdef KV_HAVE_CUDA
    if (p->cuda_dev >= 0) {
        return cudaMemcpy((char *) p->base + off, src, len,
                          cudaMemcpyHostToDevice) == cudaSuccess ? 0 : -1;
    }
#endif
    memcpy((char *) p->base + off, src, len);
    return 0;
}
