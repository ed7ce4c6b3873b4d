/*
 * bench.c - `kv_agent bench`: RMA write bandwidth between two processes
 * over the chosen provider (in the spirit of fabtests' fi_rma_bw).
 *
 * The parent is the initiator, a forked child the target; they exchange
 * address blobs, keys and base addresses over a socketpair (the agent uses
 * its TCP control channel for the same).  The target only progresses its
 * CQ, as a receiving agent does.
 *
 *   --size BYTES    bytes per iteration (default: sweep 4 KiB .. 256 MiB)
 *   --block BYTES   bytes per fi_write (default min(size, 1 MiB))
 *   --pattern llama Llama-70B-shaped push through the agent's segment
 *                   walker (80 layers, K+V, 4 KiB per block per region,
 *                   512 blocks), --no-coalesce for one write per block
 */

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kv.h"

#define BENCH_WINDOW_DEF 64
#define BENCH_CTX        1024

typedef struct {
    uint32_t nrails;
    uint32_t addrlen[KV_MAX_RAILS];
    uint8_t  addr[KV_MAX_RAILS][KV_FABADDR_LEN];
    uint64_t key[KV_MAX_RAILS];
    uint64_t base[KV_MAX_RAILS];
    uint64_t len;
} bench_peer_t;

typedef struct {
    const char  *provider;
    char         rails[KV_MAX_RAILS][64];
    int          nrails;
    uint64_t     size, block, max_size;
    int          iters, json, window, llama, coalesce, spin;
    kv_fabric_t  fab;
    char        *buf;
    uint64_t     buflen;
    void        *desc[KV_MAX_RAILS];
    fi_addr_t    peer[KV_MAX_RAILS];
    bench_peer_t rp;
    struct fi_context2 ctx[BENCH_CTX];
} bench_t;


static int
full_io(int fd, void *p, size_t n, int wr)
{
    char *b = p;
    ssize_t r;

    while (n) {
        r = wr ? write(fd, b, n) : read(fd, b, n);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            return -1;
        }
        b += r;
        n -= r;
    }
    return 0;
}


static int
bench_setup(bench_t *b, int target)
{
    struct fid_mr *mr;
    uint64_t key;
    int i;

    if (kv_fabric_open(&b->fab, b->provider, 0, b->rails, b->nrails, 0)) {
        return -1;
    }
    if (posix_memalign((void **) &b->buf, 4096, b->buflen) != 0) {
        kv_err("bench: cannot allocate %llu bytes",
               (unsigned long long) b->buflen);
        return -1;
    }
    /* touch every page now, not inside the timed loop */
    memset(b->buf, target ? 0 : 0x5a, b->buflen);
    for (i = 0; i < b->fab.nrails; i++) {
        if (kv_rail_reg(&b->fab.rail[i], b->buf, b->buflen, -1,
                        target ? FI_REMOTE_WRITE : FI_WRITE, &mr,
                        &b->desc[i], &key) != 0)
        {
            return -1;
        }
        b->fab.rail[i].pool_mr = mr;
        b->fab.rail[i].pool_key = key;
    }
    return 0;
}


static int
bench_target(bench_t *b, int sock)
{
    struct fi_cq_data_entry ce[64];
    struct fi_cq_err_entry ee;
    bench_peer_t me;
    unsigned long spins = 0;
    char c;
    int i;

    if (bench_setup(b, 1) != 0) {
        me.nrails = 0;
        full_io(sock, &me, sizeof(me), 1);
        return 1;
    }
    memset(&me, 0, sizeof(me));
    me.nrails = b->fab.nrails;
    me.len = b->buflen;
    for (i = 0; i < b->fab.nrails; i++) {
        me.addrlen[i] = b->fab.rail[i].addrlen;
        memcpy(me.addr[i], b->fab.rail[i].addr, b->fab.rail[i].addrlen);
        me.key[i] = b->fab.rail[i].pool_key;
        me.base[i] = kv_rail_raddr(&b->fab.rail[i], b->buf, 0);
    }
    if (full_io(sock, &me, sizeof(me), 1) != 0) {
        return 1;
    }
    kv_set_nonblock(sock);
    for ( ;; ) {
        /* the target's provider needs progress for RMA data to land */
        int idle = 1;
        for (i = 0; i < b->fab.nrails; i++) {
            ssize_t rc = (b->spin || b->fab.rail[i].cq_fd < 0)
                         ? fi_cq_read(b->fab.rail[i].cq, ce, 64)
                         : fi_cq_sread(b->fab.rail[i].cq, ce, 64, NULL,
                                       b->fab.nrails > 1 ? 1 : 20);
            if (rc == -FI_EAVAIL) {
                kv_rail_cq_error(&b->fab.rail[i], &ee);
            }
            if (rc > 0) {
                idle = 0;
            }
        }
        /* the initiator says when to stop: look when idle (sread timed
         * out) or every 1024 turns while spinning */
        if (idle && ((++spins & 1023) == 0
                     || (!b->spin && b->fab.rail[0].cq_fd >= 0)))
        {
            ssize_t r = read(sock, &c, 1);
            if (r == 0 || (r == 1 && c == 'q')) {
                break;
            }
        }
    }
    kv_fabric_close(&b->fab);
    free(b->buf);
    return 0;
}


/* Post every segment, split at block/max_rma, over the rails with a
 * bounded window; wait for all completions.  Returns bytes or -1. */
static int64_t
bench_round(bench_t *b, kv_segiter_t *it, uint64_t plain_size)
{
    struct fi_cq_data_entry ce[64];
    struct fi_cq_err_entry ee;
    kv_seg_t seg = { 0, 0, 0 };
    uint64_t off = 0, chunk, total = 0, lim;
    uint32_t inflight = 0, next_ctx = 0, rail = 0;
    int have = 0, done_posting = 0, i;
    ssize_t rc;
    kv_rail_t *r;

    for ( ;; ) {
        while (!done_posting && inflight < (uint32_t) b->window) {
            if (!have || off == seg.len) {
                if (it) {
                    have = kv_segiter_next(it, &seg);
                } else if (!have) {
                    seg.src = seg.dst = 0;
                    seg.len = plain_size;
                    have = 1;
                } else {
                    have = 0;
                }
                off = 0;
                if (!have) {
                    done_posting = 1;
                    break;
                }
            }
            r = &b->fab.rail[rail];
            lim = b->block < r->max_rma ? b->block : r->max_rma;
            chunk = seg.len - off < lim ? seg.len - off : lim;
            rc = fi_write(r->ep, b->buf + seg.src + off, chunk, b->desc[rail],
                          b->peer[rail],
                          b->rp.base[rail] + seg.dst + off, b->rp.key[rail],
                          &b->ctx[next_ctx]);
            if (rc == -FI_EAGAIN) {
                break;
            }
            if (rc != 0) {
                kv_err("bench: fi_write: %s", kv_fi_err((int) rc));
                return -1;
            }
            next_ctx = (next_ctx + 1) % BENCH_CTX;
            off += chunk;
            total += chunk;
            inflight++;
            rail = (rail + 1) % b->fab.nrails;
        }
        if (done_posting && inflight == 0) {
            return (int64_t) total;
        }
        for (i = 0; i < b->fab.nrails; i++) {
            rc = (b->spin || b->fab.nrails > 1 || b->fab.rail[i].cq_fd < 0)
                 ? fi_cq_read(b->fab.rail[i].cq, ce, 64)
                 : fi_cq_sread(b->fab.rail[i].cq, ce, 64, NULL, 1);
            if (rc > 0) {
                inflight -= (uint32_t) rc;
            } else if (rc == -FI_EAVAIL) {
                kv_rail_cq_error(&b->fab.rail[i], &ee);
                kv_err("bench: write failed: %s", kv_fi_err(ee.err));
                return -1;
            } else if (rc != -FI_EAGAIN && rc != -FI_ETIMEDOUT) {
                kv_err("bench: fi_cq_read: %s", kv_fi_err((int) rc));
                return -1;
            }
        }
    }
}


static void
bench_print(bench_t *b, const char *what, uint64_t size, uint64_t block,
    uint64_t writes, double secs, uint64_t bytes)
{
    double gbs = bytes / secs / 1e9;

    if (b->json) {
        printf("{\"provider\":\"%s\",\"pattern\":\"%s\",\"size\":%llu,"
               "\"block\":%llu,\"iters\":%d,\"writes_per_iter\":%llu,"
               "\"rails\":%d,\"seconds\":%.6f,\"gbps\":%.3f,"
               "\"gbit_s\":%.3f}\n",
               b->fab.rail[0].info->fabric_attr->prov_name, what,
               (unsigned long long) size, (unsigned long long) block,
               b->iters, (unsigned long long) writes, b->fab.nrails, secs,
               gbs, gbs * 8);
    } else {
        printf("%-8s %12llu %10llu %6d %10llu %10.3f GB/s %10.3f Gbit/s\n",
               what, (unsigned long long) size, (unsigned long long) block,
               b->iters, (unsigned long long) writes, gbs, gbs * 8);
    }
    fflush(stdout);
}


static int
bench_initiator(bench_t *b, int sock)
{
    static const uint32_t llama_n = 512;
    kv_layout_t sl, dl;
    kv_segiter_t it;
    kv_seg_t seg;
    uint32_t *src = NULL, *dst = NULL, i;
    uint64_t size, writes, bytes;
    double t0, secs;
    char err[128];
    int64_t got;
    int k, rc = 1;

    if (bench_setup(b, 0) != 0) {
        return 1;
    }
    if (full_io(sock, &b->rp, sizeof(b->rp), 0) != 0 || b->rp.nrails == 0) {
        kv_err("bench: target failed to start");
        return 1;
    }
    if ((int) b->rp.nrails != b->fab.nrails) {
        kv_err("bench: rail count mismatch");
        return 1;
    }
    for (k = 0; k < b->fab.nrails; k++) {
        if (fi_av_insert(b->fab.rail[k].av, b->rp.addr[k], 1, &b->peer[k], 0,
                         NULL) != 1)
        {
            kv_err("bench: fi_av_insert failed");
            return 1;
        }
    }
    if (!b->json) {
        printf("# provider %s, fabric %s, %d rail(s), window %d\n",
               b->fab.rail[0].info->fabric_attr->prov_name,
               b->fab.rail[0].info->fabric_attr->name, b->fab.nrails,
               b->window);
        printf("%-8s %12s %10s %6s %10s %15s %17s\n", "pattern", "size",
               "block", "iters", "writes", "bandwidth", "");
    }

    if (b->llama) {
        /* 80 layers x {K,V} x 4 KiB per block; the request's 512 blocks
         * sit at 0..511 on the prefill side and 300..811 on the decode
         * side of 1024-block pools, so runs never span a whole region */
        memset(&sl, 0, sizeof(sl));
        sl.layers = 80;
        sl.regions = 2;
        sl.block_bytes = 4096;
        sl.nblocks = 1024;
        if (kv_layout_finish(&sl, err, sizeof(err)) != 0) {
            goto out;
        }
        dl = sl;
        src = malloc(llama_n * sizeof(*src));
        dst = malloc(llama_n * sizeof(*dst));
        if (src == NULL || dst == NULL) {
            goto out;
        }
        for (i = 0; i < llama_n; i++) {
            src[i] = i;
            dst[i] = 300 + i;
        }
        kv_segiter_init(&it, &sl, &dl, src, dst, llama_n, b->coalesce);
        for (writes = 0; kv_segiter_next(&it, &seg); writes++) {
            /* count only */
        }
        kv_segiter_init(&it, &sl, &dl, src, dst, llama_n, b->coalesce);
        if (bench_round(b, &it, 0) < 0) {          /* warm-up */
            goto out;
        }
        t0 = kv_now_s();
        bytes = 0;
        for (k = 0; k < b->iters; k++) {
            kv_segiter_init(&it, &sl, &dl, src, dst, llama_n, b->coalesce);
            got = bench_round(b, &it, 0);
            if (got < 0) {
                goto out;
            }
            bytes += (uint64_t) got;
        }
        secs = kv_now_s() - t0;
        bench_print(b, b->coalesce ? "llama" : "llama-nc",
                    bytes / b->iters, b->coalesce ? b->block : 4096, writes,
                    secs, bytes);
        rc = 0;
        goto out;
    }

    for (size = b->size ? b->size : 4096; size <= b->max_size; size *= 4) {
        uint64_t blk = b->block ? b->block : (size < (1u << 20) ? size
                                                                : 1u << 20);
        uint64_t save = b->block;
        int iters = b->iters;

        if (blk > size) {
            blk = size;
        }
        b->block = blk;
        if (!b->size && size <= (1u << 20)) {
            b->iters = iters * 8;     /* small sizes: more rounds */
        }
        if (bench_round(b, NULL, size) < 0) {
            goto out;
        }
        t0 = kv_now_s();
        for (k = 0; k < b->iters; k++) {
            if (bench_round(b, NULL, size) < 0) {
                goto out;
            }
        }
        secs = kv_now_s() - t0;
        bench_print(b, "plain", size, blk, (size + blk - 1) / blk, secs,
                    size * b->iters);
        b->block = save;
        b->iters = iters;
        if (b->size) {
            break;
        }
    }
    rc = 0;

out:
    free(src);
    free(dst);
    kv_fabric_close(&b->fab);
    free(b->buf);
    return rc;
}


static void
bench_usage(void)
{
    fprintf(stderr,
        "usage: kv_agent bench [--provider P] [--size BYTES] [--block BYTES]"
        "\n         [--iters N] [--window N] [--rails a,b] [--json]\n"
        "         [--pattern llama [--no-coalesce]]\n");
}


int
kv_bench_main(int argc, char **argv)
{
    static bench_t b;
    int sv[2], status = 0, rc, i;
    char *tok, *save, q = 'q';
    uint64_t v;
    pid_t pid;

    memset(&b, 0, sizeof(b));
    b.provider = "tcp;ofi_rxm";
    b.iters = 10;
    b.window = BENCH_WINDOW_DEF;
    b.coalesce = 1;
    b.max_size = 256u << 20;
    for (i = 0; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;

        if (strcmp(a, "--json") == 0) {
            b.json = 1;
        } else if (strcmp(a, "--spin") == 0) {
            b.spin = 1;
            setenv("KV_CQ_SPIN", "1", 1);
        } else if (strcmp(a, "--no-coalesce") == 0) {
            b.coalesce = 0;
        } else if (val == NULL) {
            bench_usage();
            return 2;
        } else if (strcmp(a, "--provider") == 0) {
            b.provider = val;
            i++;
        } else if (strcmp(a, "--size") == 0 || strcmp(a, "--block") == 0
                   || strcmp(a, "--max-size") == 0)
        {
            if (kv_parse_size(val, &v) != 0 || v == 0) {
                fprintf(stderr, "kv_agent bench: bad size %s\n", val);
                return 2;
            }
            if (a[2] == 's') b.size = v;
            else if (a[2] == 'b') b.block = v;
            else b.max_size = v;
            i++;
        } else if (strcmp(a, "--iters") == 0) {
            b.iters = atoi(val);
            i++;
        } else if (strcmp(a, "--window") == 0) {
            b.window = atoi(val);
            i++;
        } else if (strcmp(a, "--pattern") == 0 && strcmp(val, "llama") == 0) {
            b.llama = 1;
            i++;
        } else if (strcmp(a, "--rails") == 0) {
            static char rbuf[512];
            snprintf(rbuf, sizeof(rbuf), "%s", val);
            for (tok = strtok_r(rbuf, ",", &save); tok && b.nrails <
                 KV_MAX_RAILS; tok = strtok_r(NULL, ",", &save))
            {
                snprintf(b.rails[b.nrails++], 64, "%s", tok);
            }
            i++;
        } else {
            bench_usage();
            return 2;
        }
    }
    if (b.iters < 1 || b.window < 1 || b.window > BENCH_CTX / 2) {
        fprintf(stderr, "kv_agent bench: iters >= 1, 1 <= window <= %d\n",
                BENCH_CTX / 2);
        return 2;
    }
    if (b.size) {
        b.max_size = b.size;
    }
    if (b.llama) {
        b.buflen = 80ULL * 2 * 1024 * 4096;
        if (!b.block) {
            b.block = 4u << 20;
        }
    } else {
        b.buflen = b.max_size;
    }
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        perror("socketpair");
        return 1;
    }
    pid = fork();
    if (pid < 0) {
        perror("fork");
        return 1;
    }
    if (pid == 0) {
        close(sv[0]);
        _exit(bench_target(&b, sv[1]));
    }
    close(sv[1]);
    rc = bench_initiator(&b, sv[0]);
    if (write(sv[0], &q, 1) != 1) {
        kill(pid, SIGTERM);
    }
    close(sv[0]);
    waitpid(pid, &status, 0);
    return rc;
}
