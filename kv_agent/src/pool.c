/*
 * pool.c - the KV pool's memory: host (a memfd, ours or the engine's via
 * SCM_RIGHTS) or CUDA (cudaMalloc'd by us or imported from the engine with
 * cudaIpcOpenMemHandle).  The pool is registered with every rail once;
 * GPU memory goes through fi_mr_regattr(FI_HMEM_CUDA) when the provider
 * has FI_HMEM, otherwise through a pinned host mirror (staging).
 */

#include <errno.h>
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
    fd = memfd_create("kv_pool", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, size) != 0 || host_map(p, fd, size) != 0) {
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


void
kv_pool_free(kv_ctx_t *ctx)
{
    kv_pool_t *p = &ctx->pool;

    kv_pool_unregister(ctx);
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


int
kv_pool_adopt_memfd(kv_ctx_t *ctx, int fd, size_t size, char *err,
    size_t elen)
{
    kv_pool_t np;
    struct stat sb;

    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        snprintf(err, elen, "passed descriptor is not a memfd/regular file");
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
    memset(&np, 0, sizeof(np));
    if (host_map(&np, fd, size) != 0) {
        snprintf(err, elen, "cannot map pool memory: %s", strerror(errno));
        return -1;
    }
    kv_pool_free(ctx);
    ctx->pool = np;
    kv_info("pool: adopted %zu bytes of engine host memory (memfd)", size);
    return 0;
}


int
kv_pool_adopt_cuda_ipc(kv_ctx_t *ctx, const char *hex, int dev, size_t size,
    char *err, size_t elen)
{
#ifdef KV_HAVE_CUDA
    cudaIpcMemHandle_t h;
    cudaError_t ce;
    size_t n;
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
    kv_pool_free(ctx);
    ctx->pool.base = ptr;
    ctx->pool.size = size;
    ctx->pool.cuda_dev = dev;
    ctx->pool.imported_cuda = 1;
    kv_info("pool: imported %zu bytes of cuda:%d memory (IPC handle)", size,
            dev);
    return 0;
#else
    snprintf(err, elen, "this kv_agent was built without CUDA");
    (void) ctx; (void) hex; (void) dev; (void) size;
    return -1;
#endif
}


int
kv_pool_register(kv_ctx_t *ctx)
{
    kv_pool_t *p = &ctx->pool;
    kv_rail_t *r;
    int i, dev;

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
                        &r->pool_mr, &r->pool_desc, &r->pool_key) != 0)
        {
            kv_pool_unregister(ctx);
            return -1;
        }
    }
    p->registered = 1;
    kv_info("pool: registered %zu bytes on %d rail(s), access %s%s",
            p->size, ctx->fab.nrails, kv_pool_access_name(ctx),
            ctx->cfg.role == DPD_ROLE_DECODE
            ? "; its key goes to authenticated prefill peers only" : "");
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
