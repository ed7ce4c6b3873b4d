/*
 * copy.c - asynchronous copy engines between a pool and host memory.
 *
 * The staging code (stage.c, the receiver's copy-in in xfer.c) only sees
 * kv_copy_ops_t: queue copies on a stream, record an event after them,
 * ask whether an event has completed.  Two engines:
 *
 *   cuda  cudaMemcpyAsync on a non-blocking stream per device, events from
 *         a ring (cudaEventDisableTiming), cudaEventQuery; flush is
 *         cudaDeviceFlushGPUDirectRDMAWrites (CUDA >= 11.3), which makes
 *         NIC writes into device memory visible to the device's kernels.
 *   host  the stand-in: one worker thread per engine runs the queued
 *         memcpy()s in order and publishes the last event it passed.
 *         KV_COPY_HOST_GBPS=N throttles it to N GB/s (a DMA engine's
 *         pace), so tests and benchmarks can see copies overlap writes.
 *
 * The event loop never blocks on a copy except when the host engine's
 * queue is full (back-pressure: the worker is draining it).
 */

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#ifdef KV_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "kv.h"

/* ---- host stand-in ------------------------------------------------------ */

/* The queue holds what its user can queue at once (kv_copy_t.jobs, at
 * least KV_HQ_MIN), so queuing never waits for the worker; past KV_HQ_MAX
 * (a config with tiny blocks and huge chunks) it is capped and a full
 * queue makes the loop wait (said at open). */
#define KV_HQ_MIN (16u << 10)
#define KV_HQ_MAX (4u << 20)

typedef struct {
    void       *dst;
    const void *src;
    size_t      len;
    uint64_t    mark;                 /* an event: 0 for a copy */
} kv_hjob_t;

typedef struct {
    pthread_t        thr;
    pthread_mutex_t  mu;
    pthread_cond_t   cv_work, cv_room;
    kv_hjob_t       *q;
    uint32_t         cap, head, tail, n;
    uint64_t         recorded;
    volatile uint64_t done;           /* last event passed (under mu) */
    int              stop;
    int              efd;             /* eventfd: an event passed */
    double           bps;             /* 0: as fast as memcpy */
    double           t_next;
    /* test faults (KV_TEST_FAULT): the worker stops for stall_ms before
     * its stall_at-th copy (a hung engine that comes back); events from
     * the fail_at-th on report an error; records from the rec_fail_at-th
     * on fail (a broken device context) */
    uint64_t         ncopies, stall_at, fail_at, rec_fail_at;
    long             stall_ms;
    int              no_wake;         /* polled like CUDA's events */
} kv_hcopy_t;


static double
mono_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}


static void
pace(kv_hcopy_t *h, size_t len)
{
    struct timespec ts;
    double now, wait;

    if (h->bps <= 0) {
        return;
    }
    now = mono_s();
    if (h->t_next < now) {
        h->t_next = now;
    }
    h->t_next += (double) len / h->bps;
    wait = h->t_next - mono_s();
    if (wait > 0) {
        ts.tv_sec = (time_t) wait;
        ts.tv_nsec = (long) ((wait - (double) ts.tv_sec) * 1e9);
        nanosleep(&ts, NULL);
    }
}


static void *
host_worker(void *arg)
{
    kv_hcopy_t *h = arg;
    kv_hjob_t j;

    pthread_mutex_lock(&h->mu);
    for (;;) {
        while (h->n == 0 && !h->stop) {
            pthread_cond_wait(&h->cv_work, &h->mu);
        }
        if (h->n == 0 && h->stop) {
            break;
        }
        j = h->q[h->head];
        h->head = (h->head + 1) % h->cap;
        h->n--;
        pthread_cond_signal(&h->cv_room);
        if (j.mark) {
            uint64_t one = 1;
            h->done = j.mark;
            if (write(h->efd, &one, sizeof(one)) < 0) {
                /* the counter is full: the loop is awake anyway */
            }
            continue;
        }
        pthread_mutex_unlock(&h->mu);
        if (++h->ncopies == h->stall_at) {
            struct timespec st = { h->stall_ms / 1000,
                                   (h->stall_ms % 1000) * 1000000 };
            nanosleep(&st, NULL);
        }
        memcpy(j.dst, j.src, j.len);
        pace(h, j.len);
        pthread_mutex_lock(&h->mu);
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
}


static void
host_faults(kv_hcopy_t *h)
{
    const char *f = getenv("KV_TEST_FAULT"), *q;
    char *e;

    if (f == NULL) {
        return;
    }
    if ((q = strstr(f, "copy_stall:")) != NULL) {
        h->stall_at = strtoull(q + 11, &e, 10);
        h->stall_ms = *e == ':' ? strtol(e + 1, NULL, 10) : 0;
    }
    if ((q = strstr(f, "copy_fail:")) != NULL) {
        h->fail_at = strtoull(q + 10, NULL, 10);
    }
    if ((q = strstr(f, "copy_record_fail:")) != NULL) {
        h->rec_fail_at = strtoull(q + 17, NULL, 10);
    }
    h->no_wake = strstr(f, "copy_no_wake") != NULL;
}


static int
host_open(kv_copy_t *c, int dev)
{
    kv_hcopy_t *h = calloc(1, sizeof(*h));
    const char *g = getenv("KV_COPY_HOST_GBPS");
    size_t cap = c->jobs < KV_HQ_MIN ? KV_HQ_MIN : c->jobs;

    if (cap > KV_HQ_MAX) {
        kv_warn("copy: up to %zu copies may be queued at once (chunk / "
                "block_bytes x slots); the host engine's queue holds %u, "
                "past that queuing waits for it", cap, KV_HQ_MAX);
        cap = KV_HQ_MAX;
    }
    if (h == NULL || (h->q = calloc(cap, sizeof(kv_hjob_t))) == NULL) {
        free(h);
        return -1;
    }
    h->cap = (uint32_t) cap;
    h->bps = g ? atof(g) * 1e9 : 0;
    host_faults(h);
    h->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (h->efd < 0) {
        free(h->q);
        free(h);
        return -1;
    }
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv_work, NULL);
    pthread_cond_init(&h->cv_room, NULL);
    if (pthread_create(&h->thr, NULL, host_worker, h) != 0) {
        close(h->efd);
        free(h->q);
        free(h);
        return -1;
    }
    c->dev = dev;
    c->priv = h;
    c->wake_fd = h->no_wake ? -1 : h->efd;
    return 0;
}


static void
host_push(kv_hcopy_t *h, kv_hjob_t *j)
{
    pthread_mutex_lock(&h->mu);
    while (h->n == h->cap) {
        pthread_cond_wait(&h->cv_room, &h->mu);   /* back-pressure */
    }
    h->q[h->tail] = *j;
    h->tail = (h->tail + 1) % h->cap;
    h->n++;
    pthread_cond_signal(&h->cv_work);
    pthread_mutex_unlock(&h->mu);
}


static int
host_copy(kv_copy_t *c, void *dst, const void *src, size_t len, int to_dev)
{
    kv_hjob_t j = { dst, src, len, 0 };

    (void) to_dev;
    host_push(c->priv, &j);
    return 0;
}


static int
host_record(kv_copy_t *c, uint64_t *seq)
{
    kv_hcopy_t *h = c->priv;
    kv_hjob_t j = { NULL, NULL, 0, 0 };

    if (h->rec_fail_at && h->recorded + 1 >= h->rec_fail_at) {
        return -1;
    }
    j.mark = *seq = ++h->recorded;
    host_push(h, &j);
    return 0;
}


static int
host_query(kv_copy_t *c, uint64_t seq)
{
    kv_hcopy_t *h = c->priv;
    uint64_t d;

    pthread_mutex_lock(&h->mu);
    d = h->done;
    pthread_mutex_unlock(&h->mu);
    if (h->fail_at && seq >= h->fail_at && d >= seq) {
        return -1;
    }
    return d >= seq ? 1 : 0;
}


static int
host_flush(kv_copy_t *c)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    c->flushes++;
    return 0;
}


static void
host_close(kv_copy_t *c)
{
    kv_hcopy_t *h = c->priv;

    if (h == NULL) {
        return;
    }
    pthread_mutex_lock(&h->mu);
    h->stop = 1;
    pthread_cond_signal(&h->cv_work);
    pthread_mutex_unlock(&h->mu);
    pthread_join(h->thr, NULL);
    close(h->efd);
    c->wake_fd = -1;
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv_work);
    pthread_cond_destroy(&h->cv_room);
    free(h->q);
    free(h);
    c->priv = NULL;
}


const kv_copy_ops_t kv_copy_host_ops = {
    "host", host_open, host_copy, host_record, host_query, host_flush,
    host_close
};


/* ---- CUDA --------------------------------------------------------------- */

#ifdef KV_HAVE_CUDA

#define KV_CU_EVENTS 1024

typedef struct {
    cudaStream_t stream;
    cudaEvent_t  ev[KV_CU_EVENTS];
    uint64_t     recorded, done;
} kv_cucopy_t;


static int
cuda_open(kv_copy_t *c, int dev)
{
    kv_cucopy_t *u = calloc(1, sizeof(*u));
    int i;

    if (u == NULL || dev < 0 || cudaSetDevice(dev) != cudaSuccess
        || cudaStreamCreateWithFlags(&u->stream, cudaStreamNonBlocking)
           != cudaSuccess)
    {
        kv_err("copy: cuda:%d: cannot create a stream", dev);
        free(u);
        return -1;
    }
    for (i = 0; i < KV_CU_EVENTS; i++) {
        if (cudaEventCreateWithFlags(&u->ev[i], cudaEventDisableTiming)
            != cudaSuccess)
        {
            while (i-- > 0) {
                cudaEventDestroy(u->ev[i]);
            }
            cudaStreamDestroy(u->stream);
            free(u);
            return -1;
        }
    }
    c->dev = dev;
    c->priv = u;
    c->wake_fd = -1;                 /* polled: cudaEventQuery */
    return 0;
}


static int
cuda_copy(kv_copy_t *c, void *dst, const void *src, size_t len, int to_dev)
{
    kv_cucopy_t *u = c->priv;

    /* the stream's device must be the current one (several ranks' GPUs
     * are driven from this one thread) */
    if (cudaSetDevice(c->dev) != cudaSuccess) {
        return -1;
    }
    return cudaMemcpyAsync(dst, src, len, to_dev ? cudaMemcpyHostToDevice
                                                 : cudaMemcpyDeviceToHost,
                           u->stream) == cudaSuccess ? 0 : -1;
}


static int
cuda_record(kv_copy_t *c, uint64_t *seq)
{
    kv_cucopy_t *u = c->priv;
    uint64_t s = u->recorded + 1;

    if (s > u->done + KV_CU_EVENTS) {
        return -1;                 /* the caller keeps fewer in flight */
    }
    if (cudaSetDevice(c->dev) != cudaSuccess
        || cudaEventRecord(u->ev[s % KV_CU_EVENTS], u->stream) != cudaSuccess) {
        return -1;
    }
    u->recorded = *seq = s;
    return 0;
}


static int
cuda_query(kv_copy_t *c, uint64_t seq)
{
    kv_cucopy_t *u = c->priv;
    cudaError_t ce;

    if (seq <= u->done) {
        return 1;
    }
    ce = cudaEventQuery(u->ev[seq % KV_CU_EVENTS]);
    if (ce == cudaErrorNotReady) {
        return 0;
    }
    if (ce != cudaSuccess) {
        return -1;
    }
    u->done = seq;                 /* a stream's events complete in order */
    return 1;
}


static int
cuda_flush(kv_copy_t *c)
{
    c->flushes++;
#if CUDART_VERSION >= 11030
    if (cudaSetDevice(c->dev) != cudaSuccess
        || cudaDeviceFlushGPUDirectRDMAWrites(
               cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
               cudaFlushGPUDirectRDMAWritesToOwner) != cudaSuccess)
    {
        return -1;
    }
#endif
    return 0;
}


static void
cuda_close(kv_copy_t *c)
{
    kv_cucopy_t *u = c->priv;
    int i;

    if (u == NULL) {
        return;
    }
    cudaStreamSynchronize(u->stream);
    for (i = 0; i < KV_CU_EVENTS; i++) {
        cudaEventDestroy(u->ev[i]);
    }
    cudaStreamDestroy(u->stream);
    free(u);
    c->priv = NULL;
}


const kv_copy_ops_t kv_copy_cuda_ops = {
    "cuda", cuda_open, cuda_copy, cuda_record, cuda_query, cuda_flush,
    cuda_close
};

#endif /* KV_HAVE_CUDA */


/* Host memory the NIC and the copy engine share: pinned (cudaMallocHost)
 * for a GPU, page-aligned and populated otherwise. */
void *
kv_copy_host_alloc(kv_copy_t *c, size_t len)
{
    void *p = NULL;

#ifdef KV_HAVE_CUDA
    if (c->dev >= 0) {
        return cudaMallocHost(&p, len) == cudaSuccess ? p : NULL;
    }
#endif
    (void) c;
    if (posix_memalign(&p, 4096, len) != 0) {
        return NULL;
    }
    memset(p, 0, len);
    return p;
}


void
kv_copy_host_free(kv_copy_t *c, void *p, size_t len)
{
    (void) len;
    if (p == NULL) {
        return;
    }
#ifdef KV_HAVE_CUDA
    if (c->dev >= 0) {
        cudaFreeHost(p);
        return;
    }
#endif
    (void) c;
    free(p);
}
