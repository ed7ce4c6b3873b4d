/*
 * resolve.c - getaddrinfo() in worker threads for the poll() loop (see
 * resolve.h for the contract).
 *
 * Two kinds of state:
 *   - the loop's: kv_res_t, its request slots (handler, data, deadline);
 *     touched by the loop's thread only;
 *   - the shared: res_shared_t and the jobs (name, family, the answer),
 *     under its mutex.  A job is QUEUED (on the queue), RUNNING (a worker
 *     has it, outside the lock, in getaddrinfo()) or DONE (answer ready).
 *     Whoever drops it last frees it: the loop when it takes a DONE job
 *     or forgets a QUEUED one; the worker when it finishes a job the loop
 *     abandoned (cancelled, timed out, destroyed) while it ran.
 * res_shared_t lives as long as its last user: the loop (until
 * kv_res_destroy()) and each worker hold a reference, so a worker stuck
 * in getaddrinfo() past kv_res_destroy() finds it intact when it returns.
 *
 * Workers block every signal (SIGTERM goes to the loop) and are detached:
 * nothing ever joins one.
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "resolve.h"


#define RES_DESTROY_WAIT_MS  200
#define RES_COUNT_MAX        65536   /* addresses looked at per answer */

enum { JOB_QUEUED = 0, JOB_RUNNING, JOB_DONE };

typedef struct res_job_s res_job_t;

struct res_job_s {
    res_job_t      *next;              /* on the queue */
    int             state;
    int             abandoned;         /* the loop forgot it while RUNNING */
    char            name[KV_RES_NAME_MAX + 1];
    int             port, family, max_addrs;
    int             status;
    kv_res_addr_t  *addrs;
    uint32_t        naddrs, total;
};

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t  work;              /* workers wait for jobs */
    pthread_cond_t  gone;              /* a worker left */
    res_job_t      *head, *tail;
    int             nqueued;
    int             nthreads, nidle, nstuck;
    int             closing;
    int             refs;              /* the loop + each worker */
    int             efd;
} res_shared_t;

typedef struct {
    uint64_t            id;            /* 0: free slot */
    res_job_t          *job;
    kv_res_handler_pt   handler;
    void               *data;
    uint64_t            deadline;
    char                name[KV_RES_NAME_MAX + 1];
    int                 port;
} res_req_t;

struct kv_res {
    kv_res_conf_t   conf;
    res_shared_t   *sh;
    res_req_t      *req;               /* conf.max_pending slots */
    int             npending;
    uint64_t        next_id;
};


static uint64_t
res_now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000 + (uint64_t) ts.tv_nsec / 1000000;
}


static void
res_job_free(res_job_t *j)
{
    if (j != NULL) {
        free(j->addrs);
        free(j);
    }
}


static void
res_shared_free(res_shared_t *sh)
{
    res_job_t *j;

    while ((j = sh->head) != NULL) {
        sh->head = j->next;
        res_job_free(j);
    }
    pthread_cond_destroy(&sh->work);
    pthread_cond_destroy(&sh->gone);
    pthread_mutex_destroy(&sh->lock);
    close(sh->efd);
    free(sh);
}


int
kv_res_addr_cmp(const kv_res_addr_t *a, const kv_res_addr_t *b)
{
    int c;

    if (a->family != b->family) {
        return a->family == AF_INET ? -1 : 1;
    }
    c = memcmp(a->addr, b->addr, a->family == AF_INET ? 4 : 16);
    if (c != 0) {
        return c;
    }
    return (a->scope_id > b->scope_id) - (a->scope_id < b->scope_id);
}


static int
res_addr_qcmp(const void *a, const void *b)
{
    return kv_res_addr_cmp(a, b);
}


int
kv_res_addr_str(const kv_res_addr_t *a, int with_port, char *buf,
    size_t len)
{
    char ip[INET6_ADDRSTRLEN];
    int n;

    if (len == 0) {
        return -1;
    }
    buf[0] = '\0';
    if (inet_ntop(a->family, a->addr, ip, sizeof(ip)) == NULL) {
        return -1;
    }
    if (!with_port) {
        n = snprintf(buf, len, "%s", ip);
    } else if (a->family == AF_INET6) {
        n = snprintf(buf, len, "[%s]:%d", ip, a->port);
    } else {
        n = snprintf(buf, len, "%s:%d", ip, a->port);
    }
    if (n < 0 || (size_t) n >= len) {
        buf[0] = '\0';
        return -1;
    }
    return n;
}


/*
 * getaddrinfo() and the answer: every address of the name's list, sorted,
 * duplicates dropped (one per socket type otherwise, and names listed
 * twice), the lowest max_addrs kept.  Runs in a worker, outside the lock.
 */
static void
res_lookup(res_job_t *j)
{
    struct addrinfo hints, *ai, *p;
    kv_res_addr_t *all;
    uint32_t n, i, u;
    int rc;

    memset(&hints, 0, sizeof(hints));
    hints.ai_family = j->family;
    hints.ai_socktype = SOCK_STREAM;
    /* no AI_ADDRCONFIG: it hides IPv4 answers from a host whose only
     * IPv4 address is on loopback, and the caller asked for a family */
    rc = getaddrinfo(j->name, NULL, &hints, &ai);
    if (rc != 0) {
        /* glibc's EAI_* codes are negative: never KV_RES_E* */
        j->status = rc == EAI_MEMORY ? KV_RES_ENOMEM
                  : rc == EAI_SYSTEM && errno == ENOMEM ? KV_RES_ENOMEM
                  : rc;
        return;
    }
    n = 0;
    for (p = ai; p != NULL && n < RES_COUNT_MAX; p = p->ai_next) {
        n++;
    }
    all = calloc(n ? n : 1, sizeof(*all));
    if (all == NULL) {
        freeaddrinfo(ai);
        j->status = KV_RES_ENOMEM;
        return;
    }
    i = 0;
    for (p = ai; p != NULL && i < n; p = p->ai_next) {
        if (p->ai_family == AF_INET
            && p->ai_addrlen >= sizeof(struct sockaddr_in))
        {
            const struct sockaddr_in *s4 = (void *) p->ai_addr;
            all[i].family = AF_INET;
            memcpy(all[i].addr, &s4->sin_addr, 4);
        } else if (p->ai_family == AF_INET6
                   && p->ai_addrlen >= sizeof(struct sockaddr_in6))
        {
            const struct sockaddr_in6 *s6 = (void *) p->ai_addr;
            all[i].family = AF_INET6;
            memcpy(all[i].addr, &s6->sin6_addr, 16);
            all[i].scope_id = s6->sin6_scope_id;
        } else {
            continue;
        }
        all[i].port = j->port;
        i++;
    }
    freeaddrinfo(ai);
    n = i;
    qsort(all, n, sizeof(*all), res_addr_qcmp);
    for (i = 0, u = 0; i < n; i++) {
        if (u == 0 || kv_res_addr_cmp(&all[u - 1], &all[i]) != 0) {
            all[u++] = all[i];
        }
    }
    j->total = u;
    j->naddrs = u < (uint32_t) j->max_addrs ? u : (uint32_t) j->max_addrs;
    if (j->naddrs == 0) {
        free(all);
        j->status = EAI_NONAME;     /* no address of the family asked */
        return;
    }
    if (j->naddrs < n) {
        kv_res_addr_t *small = malloc(j->naddrs * sizeof(*all));
        if (small != NULL) {        /* else keep the larger array */
            memcpy(small, all, j->naddrs * sizeof(*all));
            free(all);
            all = small;
        }
    }
    j->addrs = all;
    j->status = KV_RES_OK;
}


static void *
res_worker(void *arg)
{
    res_shared_t *sh = arg;
    res_job_t *j;
    uint64_t one = 1;
    int last;

    pthread_mutex_lock(&sh->lock);
    for ( ;; ) {
        while (sh->head == NULL && !sh->closing) {
            sh->nidle++;
            pthread_cond_wait(&sh->work, &sh->lock);
            sh->nidle--;
        }
        if (sh->closing) {
            break;
        }
        j = sh->head;
        sh->head = j->next;
        if (sh->head == NULL) {
            sh->tail = NULL;
        }
        sh->nqueued--;
        j->next = NULL;
        j->state = JOB_RUNNING;
        pthread_mutex_unlock(&sh->lock);

        res_lookup(j);

        pthread_mutex_lock(&sh->lock);
        if (j->abandoned) {
            sh->nstuck--;
            res_job_free(j);
            continue;
        }
        j->state = JOB_DONE;
        /* a full eventfd counter (never, at 2^64-2) or EAGAIN: the loop
         * reads it on its timer anyway */
        if (write(sh->efd, &one, sizeof(one)) < 0) {
            /* nothing to do: kv_res_process() also runs on the timer */
        }
    }
    sh->nthreads--;
    last = --sh->refs == 0;
    pthread_cond_broadcast(&sh->gone);
    pthread_mutex_unlock(&sh->lock);
    if (last) {
        res_shared_free(sh);
    }
    return NULL;
}


/* under sh->lock: a worker for the queue when none is free */
static int
res_spawn(kv_res_t *r)
{
    res_shared_t *sh = r->sh;
    pthread_attr_t attr;
    pthread_t tid;
    sigset_t all, old;
    int rc;

    if (sh->nqueued <= sh->nidle
        || sh->nthreads - sh->nstuck >= r->conf.max_threads
        || sh->nthreads >= KV_RES_THREADS_HARD)
    {
        return 0;
    }
    if (pthread_attr_init(&attr) != 0) {
        return ENOMEM;
    }
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);    /* inherited */
    rc = pthread_create(&tid, &attr, res_worker, sh);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        return rc;
    }
    sh->nthreads++;
    sh->refs++;
    return 0;
}


kv_res_t *
kv_res_create(const kv_res_conf_t *conf)
{
    kv_res_t *r;
    res_shared_t *sh;

    r = calloc(1, sizeof(*r));
    sh = calloc(1, sizeof(*sh));
    if (r == NULL || sh == NULL) {
        goto fail;
    }
    if (conf != NULL) {
        r->conf = *conf;
    }
    if (r->conf.max_threads <= 0) {
        r->conf.max_threads = 2;
    }
    if (r->conf.max_threads > KV_RES_THREADS_HARD) {
        r->conf.max_threads = KV_RES_THREADS_HARD;
    }
    if (r->conf.max_pending <= 0) {
        r->conf.max_pending = 64;
    }
    if (r->conf.max_addrs <= 0 || r->conf.max_addrs > KV_RES_MAX_ADDRS) {
        r->conf.max_addrs = KV_RES_MAX_ADDRS;
    }
    if (r->conf.timeout_ms <= 0) {
        r->conf.timeout_ms = 10000;
    }
    r->req = calloc((size_t) r->conf.max_pending, sizeof(*r->req));
    if (r->req == NULL) {
        goto fail;
    }
    sh->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (sh->efd < 0) {
        goto fail;
    }
    if (pthread_mutex_init(&sh->lock, NULL) != 0) {
        close(sh->efd);
        goto fail;
    }
    pthread_cond_init(&sh->work, NULL);
    pthread_cond_init(&sh->gone, NULL);
    sh->refs = 1;
    r->sh = sh;
    r->next_id = 1;
    return r;

fail:
    if (r != NULL) {
        free(r->req);
    }
    free(r);
    free(sh);
    errno = ENOMEM;
    return NULL;
}


int
kv_res_fd(kv_res_t *r)
{
    return r->sh->efd;
}


int
kv_res_pending(kv_res_t *r)
{
    return r->npending;
}


uint64_t
kv_res_start(kv_res_t *r, const char *name, int port, int family,
    kv_res_handler_pt handler, void *data)
{
    res_shared_t *sh = r->sh;
    res_req_t *q = NULL;
    res_job_t *j;
    size_t len;
    int i, rc;

    len = name != NULL ? strlen(name) : 0;
    if (len == 0 || len > KV_RES_NAME_MAX || port < 0 || port > 65535
        || handler == NULL
        || (family != AF_UNSPEC && family != AF_INET && family != AF_INET6))
    {
        errno = EINVAL;
        return 0;
    }
    for (i = 0; i < r->conf.max_pending; i++) {
        if (r->req[i].id == 0) {
            q = &r->req[i];
            break;
        }
    }
    if (q == NULL) {
        errno = EAGAIN;
        return 0;
    }
    j = calloc(1, sizeof(*j));
    if (j == NULL) {
        errno = ENOMEM;
        return 0;
    }
    memcpy(j->name, name, len + 1);
    j->port = port;
    j->family = family;
    j->max_addrs = r->conf.max_addrs;
    j->state = JOB_QUEUED;

    pthread_mutex_lock(&sh->lock);
    if (sh->tail != NULL) {
        sh->tail->next = j;
    } else {
        sh->head = j;
    }
    sh->tail = j;
    sh->nqueued++;
    rc = res_spawn(r);
    if (rc != 0 && sh->nthreads - sh->nstuck == 0) {
        /* nobody will ever take it: take it back */
        if (sh->head == j) {
            sh->head = sh->tail = NULL;
        } else {
            res_job_t *p = sh->head;
            while (p->next != j) {
                p = p->next;
            }
            p->next = NULL;
            sh->tail = p;
        }
        sh->nqueued--;
        pthread_mutex_unlock(&sh->lock);
        res_job_free(j);
        errno = rc;
        return 0;
    }
    pthread_cond_signal(&sh->work);
    pthread_mutex_unlock(&sh->lock);

    q->id = r->next_id++;
    q->job = j;
    q->handler = handler;
    q->data = data;
    q->deadline = res_now_ms() + (uint64_t) r->conf.timeout_ms;
    memcpy(q->name, name, len + 1);
    q->port = port;
    r->npending++;
    return q->id;
}


/* under sh->lock: the loop lets go of q's job */
static void
res_forget_locked(res_shared_t *sh, res_job_t *j, res_job_t **free_it)
{
    res_job_t *p;

    *free_it = NULL;
    switch (j->state) {
    case JOB_QUEUED:
        if (sh->head == j) {
            sh->head = j->next;
            if (sh->head == NULL) {
                sh->tail = NULL;
            }
        } else {
            for (p = sh->head; p != NULL && p->next != j; p = p->next) {
                /* find its predecessor */
            }
            if (p != NULL) {
                p->next = j->next;
                if (sh->tail == j) {
                    sh->tail = p;
                }
            }
        }
        sh->nqueued--;
        *free_it = j;
        break;
    case JOB_RUNNING:
        j->abandoned = 1;          /* the worker frees it */
        sh->nstuck++;
        break;
    default:
        *free_it = j;
        break;
    }
}


void
kv_res_cancel(kv_res_t *r, uint64_t id)
{
    res_job_t *f;
    int i;

    if (id == 0) {
        return;
    }
    for (i = 0; i < r->conf.max_pending; i++) {
        if (r->req[i].id == id) {
            pthread_mutex_lock(&r->sh->lock);
            res_forget_locked(r->sh, r->req[i].job, &f);
            pthread_mutex_unlock(&r->sh->lock);
            res_job_free(f);
            memset(&r->req[i], 0, sizeof(r->req[i]));
            r->npending--;
            return;
        }
    }
}


static const char *
res_error(int status)
{
    switch (status) {
    case KV_RES_OK:
        return "";
    case KV_RES_ETIMEDOUT:
        return "timed out";
    case KV_RES_ENOMEM:
        return "out of memory";
    default:
        return gai_strerror(status);
    }
}


void
kv_res_process(kv_res_t *r)
{
    res_shared_t *sh = r->sh;
    kv_res_result_t res;
    res_req_t q;
    res_job_t *j, *f;
    uint64_t v, now;
    int i, done;

    if (read(sh->efd, &v, sizeof(v)) < 0) {
        /* EAGAIN: nothing signalled; timeouts are still checked */
    }
    now = res_now_ms();
    for (i = 0; i < r->conf.max_pending; i++) {
        if (r->req[i].id == 0) {
            continue;
        }
        j = r->req[i].job;
        f = NULL;
        pthread_mutex_lock(&sh->lock);
        done = j->state == JOB_DONE;
        if (!done && now >= r->req[i].deadline) {
            res_forget_locked(sh, j, &f);
        }
        pthread_mutex_unlock(&sh->lock);
        if (!done && now < r->req[i].deadline) {
            continue;
        }

        /* the slot is freed before the handler runs: it may start or
         * cancel requests, this one's id is no longer known */
        q = r->req[i];
        memset(&r->req[i], 0, sizeof(r->req[i]));
        r->npending--;

        memset(&res, 0, sizeof(res));
        res.id = q.id;
        res.name = q.name;
        res.port = q.port;
        if (done) {
            res.status = j->status;
            res.addrs = j->addrs;
            res.naddrs = j->naddrs;
            res.total = j->total;
        } else {
            res.status = KV_RES_ETIMEDOUT;
        }
        res.error = res_error(res.status);
        q.handler(q.data, &res);
        if (done) {
            res_job_free(j);
        } else {
            res_job_free(f);
        }
    }
}


void
kv_res_destroy(kv_res_t *r)
{
    res_shared_t *sh;
    struct timespec ts;
    res_job_t *f;
    int i, last;

    if (r == NULL) {
        return;
    }
    sh = r->sh;
    pthread_mutex_lock(&sh->lock);
    for (i = 0; i < r->conf.max_pending; i++) {
        if (r->req[i].id != 0) {
            res_forget_locked(sh, r->req[i].job, &f);
            res_job_free(f);
        }
    }
    sh->closing = 1;
    pthread_cond_broadcast(&sh->work);

    /* idle workers leave at once; a stuck one is not waited for */
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += (long) RES_DESTROY_WAIT_MS * 1000000L;
    ts.tv_sec += ts.tv_nsec / 1000000000L;
    ts.tv_nsec %= 1000000000L;
    while (sh->nthreads > sh->nstuck) {
        if (pthread_cond_timedwait(&sh->gone, &sh->lock, &ts) != 0) {
            break;
        }
    }
    last = --sh->refs == 0;
    pthread_mutex_unlock(&sh->lock);
    if (last) {
        res_shared_free(sh);
    }
    free(r->req);
    free(r);
}
