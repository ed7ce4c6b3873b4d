/*
 * pool.c - the KV pool's memory: host (a memfd, ours or the engine's via
 * SCM_RIGHTS) or CUDA (cudaMalloc'd by us or imported from the engine with
 * cudaIpcOpenMemHandle).  One pool per tensor-parallel rank (each engine
 * worker registers its own), each registered only on its rank's rails
 * (the NICs PCIe-local to its GPU, topo.c).  GPU memory goes through
 * fi_mr_regattr(FI_HMEM_CUDA) when the provider has FI_HMEM; otherwise it
 * is staged: a sender copies through a bounded pinned ring (stage.c), a
 * receiver lands writes in a pinned mirror and copies them in with
 * batched asynchronous copies before the request is ready.
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


static int
pool_alloc_one(kv_ctx_t *ctx, int rank)
{
    kv_pool_t *p = KV_POOL(ctx, rank);
    size_t size = ctx->cfg.layout.size;
    int fd, dev;

    memset(p, 0, sizeof(*p));
    p->fd = -1;
    p->cuda_dev = -1;
    dev = ctx->cfg.cuda_per_rank ? rank : ctx->cfg.cuda_dev;
    if (dev >= 0) {
#ifdef KV_HAVE_CUDA
        cudaError_t ce = cudaSetDevice(dev);
        if (ce == cudaSuccess) {
            ce = cudaMalloc(&p->base, size);
        }
        if (ce != cudaSuccess) {
            kv_err("pool: rank %d: cuda:%d: cannot allocate %zu bytes: %s",
                   rank, dev, size, cudaGetErrorString(ce));
            return -1;
        }
        p->size = size;
        p->cuda_dev = dev;
        p->owned_cuda = 1;
        kv_info("pool: rank %d: %zu bytes on cuda:%d", rank, size, dev);
        return 0;
#else
        kv_err("pool: memory cuda:%d requested but this kv_agent was built "
               "without CUDA", dev);
        return -1;
#endif
    }
    if (ctx->nranks > 1) {
        /* one engine worker per rank registers its own pool */
        kv_info("pool: rank %d: waiting for its engine worker's "
                "register_pool", rank);
        return 0;
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


int
kv_pool_alloc(kv_ctx_t *ctx)
{
    int r;

    for (r = 0; r < ctx->nranks; r++) {
        if (pool_alloc_one(ctx, r) != 0) {
            return -1;
        }
    }
    return 0;
}


/* Every rank's pool registered (a push moves all of them or nothing). */
int
kv_pools_ready(kv_ctx_t *ctx, char *err, size_t elen)
{
    int r, n = 0, first = -1;

    for (r = 0; r < ctx->nranks; r++) {
        if (KV_POOL(ctx, r)->registered) {
            n++;
        } else if (first < 0) {
            first = r;
        }
    }
    if (n == ctx->nranks) {
        return 0;
    }
    if (ctx->nranks == 1) {
        snprintf(err, elen, "node %s has no registered KV pool",
                 ctx->cfg.node_id);
    } else {
        snprintf(err, elen, "node %s has %d of %d rank pools registered "
                 "(rank %d missing)", ctx->cfg.node_id, n, ctx->nranks,
                 first);
    }
    return -1;
}


/* Free a pool's memory (not its registrations). */
static void
pool_release(kv_pool_t *p)
{
#ifdef KV_HAVE_CUDA
    if (p->owned_cuda) {
        cudaFree(p->base);
    } else if (p->imported_cuda) {
        cudaIpcCloseMemHandle(p->base);
    }
#endif
    if (p->cuda_dev < 0 && p->base && p->fd >= 0) {
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
    int r;

    kv_pool_unregister(ctx);
    for (r = 0; r < ctx->nranks; r++) {
        pool_release(KV_POOL(ctx, r));
        kv_ring_close(ctx, r);
    }
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
#if CUDART_VERSION >= 12000
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSuccess;
#endif
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
    /* CUDA 11 (Debian 12's nvidia-cuda-dev): no query result */
    ce = cudaGetDriverEntryPoint("cuMemGetAddressRange", (void **) &fn,
                                 cudaEnableDefault);
#endif
#if CUDART_VERSION >= 12000
    if (q != cudaDriverEntryPointSuccess) {
        fn = NULL;
    }
#endif
    if (ce != cudaSuccess || !fn) {
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


/* Is this pool copied through host memory?  GPU memory without FI_HMEM,
 * or any pool with transfer.staging "host" (the host copy engine stands in
 * for CUDA: tests and benchmarks run the staging code path). */
static int
pool_staged(kv_ctx_t *ctx, const kv_pool_t *p)
{
    if (ctx->cfg.staging == KV_STAGE_HOST_TEST) {
        return 1;
    }
    return p->cuda_dev >= 0
           && !(ctx->fab.nrails > 0 && ctx->fab.rail[0].hmem);
}


static void
close_mrs(struct fid_mr **mr)
{
    int i;

    for (i = 0; i < KV_MAX_RAILS; i++) {
        if (mr[i]) {
            fi_close(&mr[i]->fid);
            mr[i] = NULL;
        }
    }
}


/*
 * Register p on rank's rails into p->mr/desc/key.  A staged sender
 * registers nothing here (its staging ring is registered instead: the
 * NIC never reads device memory); a staged receiver registers its
 * bounded landing ring (ring.c; kept across re-registrations, so a new
 * key covers the same slots).  On failure nothing stays registered.
 */
static int
reg_all(kv_ctx_t *ctx, int rank, kv_pool_t *p)
{
    kv_topo_t *t = &ctx->topo;
    int k, ri, dev;
    size_t len;
    void *buf;

    memset(p->mr, 0, sizeof(p->mr));
    p->fab_base = p->base;
    p->staged = pool_staged(ctx, p);
    dev = p->cuda_dev >= 0 && !p->staged ? p->cuda_dev : -1;
    if (p->staged && ctx->cfg.role != DPD_ROLE_DECODE) {
        p->fab_base = NULL;
        return 0;
    }
    len = p->size;
    if (p->staged) {
        kv_rring_t *g;
        if (kv_ring_open(ctx, rank, p->cuda_dev) != 0) {
            return -1;
        }
        g = ctx->rring[rank];
        p->fab_base = g->buf;
        len = g->chunk * g->nslots;
        kv_info("pool: rank %d: writes land in a bounded ring of %u slot(s) "
                "x %zu bytes of pinned memory, copied in per chunk", rank,
                g->nslots, g->chunk);
    }
    buf = p->fab_base;
    for (k = 0; k < t->nrails[rank]; k++) {
        ri = t->rail[rank][k];
        if (kv_rail_reg(&ctx->fab.rail[ri], buf, len, dev,
                        pool_access(ctx), &p->mr[ri], &p->desc[ri],
                        &p->key[ri]) != 0)
        {
            close_mrs(p->mr);
            return -1;
        }
    }
    return 0;
}


static void
log_registered(kv_ctx_t *ctx, int rank)
{
    kv_pool_t *p = KV_POOL(ctx, rank);
    kv_topo_t *t = &ctx->topo;
    char list[1024], who[32];
    int k;

    list[0] = '\0';
    for (k = 0; k < t->nrails[rank]; k++) {
        size_t l = strlen(list);
        snprintf(list + l, sizeof(list) - l, "%s%s", k ? ", " : "",
                 ctx->fab.rail[t->rail[rank][k]].info->domain_attr->name);
    }
    snprintf(who, sizeof(who), ctx->nranks > 1 ? "rank %d: " : "", rank);
    if (p->staged && ctx->cfg.role != DPD_ROLE_DECODE) {
        kv_info("pool: %s%zu bytes staged through its ring on rail(s) %s",
                who, p->size, list);
        return;
    }
    kv_info("pool: %sregistered %zu bytes on %d rail(s)%s%s%s, access %s%s",
            who, p->size, t->nrails[rank], ctx->nranks > 1 ? " (" : "",
            ctx->nranks > 1 ? list : "", ctx->nranks > 1 ? ")" : "",
            kv_pool_access_name(ctx),
            ctx->cfg.role == DPD_ROLE_DECODE
            ? "; its key goes to authenticated prefill peers only" : "");
}


static int
open_engines(kv_ctx_t *ctx, int rank)
{
    kv_pool_t *p = KV_POOL(ctx, rank);

    /* a receiver's GPU pool needs its engine either way: copy-ins when
     * staged, the GPUDirect RDMA flush before ready when the NIC writes
     * device memory (FI_HMEM) */
    if (!p->staged && !(p->cuda_dev >= 0 && ctx->cfg.role == DPD_ROLE_DECODE))
    {
        return 0;
    }
    if (ctx->cfg.role == DPD_ROLE_DECODE) {
        if (ctx->rcopy_open[rank] && ctx->rcopy[rank].dev != p->cuda_dev) {
            /* a new pool on another device (never while busy) */
            ctx->rcopy[rank].ops->close(&ctx->rcopy[rank]);
            ctx->rcopy_open[rank] = 0;
        }
        if (!ctx->rcopy_open[rank]) {
            kv_copy_t *c = &ctx->rcopy[rank];
            uint64_t bb = ctx->cfg.layout.block_bytes;
            memset(c, 0, sizeof(*c));
            /* a slot's copy-in: a piece per block at most, and its event */
            c->jobs = (size_t) ctx->cfg.recv_slots
                      * (ctx->cfg.recv_chunk / (bb ? bb : 1) + 3);
#ifdef KV_HAVE_CUDA
            c->ops = p->cuda_dev >= 0 ? &kv_copy_cuda_ops : &kv_copy_host_ops;
#else
            c->ops = &kv_copy_host_ops;
#endif
            if (c->ops->open(c, p->cuda_dev) != 0) {
                return -1;
            }
            ctx->rcopy_open[rank] = 1;
        }
        return 0;
    }
    if (ctx->stage[rank] && ctx->stage[rank]->copy.dev != p->cuda_dev) {
        kv_stage_close(ctx, rank);
    }
    return ctx->stage[rank] ? 0 : kv_stage_open(ctx, rank);
}


int
kv_pool_register(kv_ctx_t *ctx)
{
    int r;

    for (r = 0; r < ctx->nranks; r++) {
        kv_pool_t *p = KV_POOL(ctx, r);
        if (p->base == NULL) {
            continue;                  /* its engine worker registers it */
        }
        if (reg_all(ctx, r, p) != 0 || open_engines(ctx, r) != 0) {
            return -1;
        }
        p->registered = 1;
        log_registered(ctx, r);
    }
    return 0;
}


/*
 * Make *np rank's pool: register it first, and only when that worked drop
 * the old registration and memory.  A refused pool changes nothing (np's
 * resources are freed, the old pool stays registered under its keys).
 */
int
kv_pool_replace(kv_ctx_t *ctx, int rank, kv_pool_t *np, char *err,
    size_t elen)
{
    kv_pool_t *op = KV_POOL(ctx, rank);

    if (ctx->fab_ok && reg_all(ctx, rank, np) != 0) {
        snprintf(err, elen, "cannot register the pool with the fabric");
        pool_release(np);
        return -1;
    }
    close_mrs(op->mr);
    pool_release(op);
    *op = *np;
    op->registered = ctx->fab_ok;
    if (ctx->fab_ok && open_engines(ctx, rank) != 0) {
        close_mrs(op->mr);
        op->registered = 0;
        snprintf(err, elen, "cannot set up the staging copies");
        return -1;
    }
    if (ctx->fab_ok) {
        log_registered(ctx, rank);
    }
    kv_info("pool: rank %d: adopted %zu bytes of engine %s memory", rank,
            op->size,
            op->cuda_dev >= 0 ? "GPU (CUDA IPC)" : "host (memfd)");
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
    kv_pool_t np;
    uint32_t i, nq = ctx->nquar;
    int r, failed = 0;

    if (!ctx->fab_ok || !ctx->revocable) {
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
    for (r = 0; r < ctx->nranks; r++) {
        kv_pool_t *p = KV_POOL(ctx, r);
        if (!p->registered) {
            continue;
        }
        np = *p;
        if (reg_all(ctx, r, &np) != 0) {
            failed = 1;
            break;
        }
        close_mrs(p->mr);
        memcpy(p->mr, np.mr, sizeof(p->mr));
        memcpy(p->desc, np.desc, sizeof(p->desc));
        memcpy(p->key, np.key, sizeof(p->key));
    }
    if (failed) {
        /* no new keys: without a registration nothing can land either */
        kv_pool_unregister(ctx);
        kv_err("pool: revocation could not register the pool again; it "
               "takes no transfers until the engine registers one");
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
    int r;

    for (r = 0; r < ctx->nranks; r++) {
        close_mrs(KV_POOL(ctx, r)->mr);
        KV_POOL(ctx, r)->registered = 0;
    }
}


int
kv_pool_read(kv_ctx_t *ctx, int rank, uint64_t off, void *dst, uint64_t len)
{
    kv_pool_t *p = KV_POOL(ctx, rank);

    if (p->base == NULL || off > p->size || len > p->size - off) {
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
kv_pool_write(kv_ctx_t *ctx, int rank, uint64_t off, const void *src,
    uint64_t len)
{
    kv_pool_t *p = KV_POOL(ctx, rank);

    if (p->base == NULL || off > p->size || len > p->size - off) {
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
