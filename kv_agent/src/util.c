/*
 * util.c - logging, clocks, parsing helpers, framed JSON connections and
 * block-run encoding shared by the agent, its bench and its tools.
 */

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "kv.h"

int kv_log_level = KV_LOG_INFO;


/*
 * The length of the well-formed UTF-8 sequence at p (1..4 bytes, at most
 * n), or 0: RFC 3629, no overlong forms, no surrogates, nothing past
 * U+10FFFF.
 */
static size_t
kv_utf8_len(const unsigned char *p, size_t n)
{
    size_t k, len;
    unsigned c = p[0];

    if (c < 0x80) {
        return 1;
    }
    if (c >= 0xc2 && c <= 0xdf) {
        len = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
        len = 3;
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4;
    } else {
        return 0;
    }
    if (n < len) {
        return 0;
    }
    for (k = 1; k < len; k++) {
        if ((p[k] & 0xc0) != 0x80) {
            return 0;
        }
    }
    if ((c == 0xe0 && p[1] < 0xa0) || (c == 0xed && p[1] > 0x9f)
        || (c == 0xf0 && p[1] < 0x90) || (c == 0xf4 && p[1] > 0x8f))
    {
        return 0;
    }
    return len;
}


/*
 * Text for one log line: control bytes (newline, CR, ESC, DEL, ...), the
 * backslash and bytes that are not well-formed UTF-8 become \xNN, so a
 * peer's string (a node id, a req_id, an address) can neither forge a
 * line nor move a terminal's cursor.  At most olen - 1 bytes out, always
 * NUL-terminated; what does not fit ends in "...".
 */
size_t
kv_log_escape(char *out, size_t olen, const char *in, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *) in;
    size_t i = 0, o = 0, k;

    if (olen == 0) {
        return 0;
    }
    while (i < n) {
        k = kv_utf8_len(p + i, n - i);
        if (k == 1 && (p[i] < 0x20 || p[i] == 0x7f || p[i] == '\\')) {
            k = 0;
        }
        if (k == 0) {
            if (o + 4 + 4 > olen) {
                break;
            }
            out[o++] = '\\';
            out[o++] = 'x';
            out[o++] = hex[p[i] >> 4];
            out[o++] = hex[p[i] & 15];
            i++;
            continue;
        }
        if (o + k + 4 > olen) {
            break;
        }
        memcpy(out + o, p + i, k);
        o += k;
        i += k;
    }
    if (i < n) {
        memcpy(out + o, "...", 3);
        o += 3;
    }
    out[o] = '\0';
    return o;
}


/*
 * A rate-limited warning: 1 (log it now) for the first KV_LOG_BURST calls
 * of each second, 0 after, so a flood of refusals or bad messages costs a
 * few lines a second, each with its running count, while the first
 * distinct ones of a quiet moment are all seen.
 */
int
kv_log_limit(kv_loglim_t *l)
{
    uint64_t now = kv_now_ms();

    if (l->t_ms == 0 || now - l->t_ms >= 1000) {
        l->t_ms = now;
        l->n = 0;
    }
    return l->n++ < KV_LOG_BURST;
}


void
kv_log(int level, const char *fmt, ...)
{
    static const char *names[] = { "error", "warn", "info", "debug" };
    struct timespec ts;
    struct tm tm;
    char msg[2048], buf[2048 + 64];
    va_list ap;
    int n, m;

    if (level > kv_log_level) {
        return;
    }
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    n = snprintf(buf, sizeof(buf), "%02d:%02d:%02d.%03ld kv_agent[%d] %s: ",
                 tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
                 (int) getpid(), names[level]);
    va_start(ap, fmt);
    m = vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (m < 0) {
        m = 0;
    }
    if ((size_t) m >= sizeof(msg)) {
        m = sizeof(msg) - 1;
    }
    /* every line escaped as a whole: the peers' strings it may hold */
    n += (int) kv_log_escape(buf + n, sizeof(buf) - n - 1, msg, (size_t) m);
    buf[n++] = '\n';
    /* one write() per line so lines of concurrent agents do not mix */
    if (write(2, buf, n) < 0) {
        /* nothing sensible to do */
    }
}


uint64_t
kv_now_us(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000 + (uint64_t) ts.tv_nsec / 1000;
}


uint64_t
kv_now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}


uint64_t
kv_wall_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t) ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}


double
kv_now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}


int
kv_set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);

    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) {
        return -1;
    }
    return 0;
}


int
kv_parse_hostport(const char *s, char *host, size_t hlen, int *port)
{
    const char *colon = strrchr(s, ':');
    char *end;
    long p;
    size_t n;

    if (colon == NULL || colon == s) {
        return -1;
    }
    n = colon - s;
    if (s[0] == '[' && colon[-1] == ']') {      /* [v6]:port */
        s++;
        n -= 2;
    }
    if (n >= hlen) {
        return -1;
    }
    memcpy(host, s, n);
    host[n] = '\0';
    errno = 0;
    p = strtol(colon + 1, &end, 10);
    if (errno || *end != '\0' || p < 0 || p > 65535) {
        return -1;
    }
    *port = (int) p;
    return 0;
}


int
kv_parse_size(const char *s, uint64_t *out)
{
    char *end;
    unsigned long long v;
    uint64_t mul = 1;

    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno || end == s) {
        return -1;
    }
    switch (toupper((unsigned char) *end)) {
    case '\0': break;
    case 'K': mul = 1ULL << 10; end++; break;
    case 'M': mul = 1ULL << 20; end++; break;
    case 'G': mul = 1ULL << 30; end++; break;
    default: return -1;
    }
    if (*end == 'i' || *end == 'I') {
        end++;
    }
    if (*end == 'B' || *end == 'b') {
        end++;
    }
    if (*end != '\0') {
        return -1;
    }
    *out = (uint64_t) v * mul;
    return 0;
}


void
kv_hex_encode(const void *p, size_t n, char *out)
{
    static const char hx[] = "0123456789abcdef";
    const unsigned char *b = p;
    size_t i;

    for (i = 0; i < n; i++) {
        out[2 * i] = hx[b[i] >> 4];
        out[2 * i + 1] = hx[b[i] & 15];
    }
    out[2 * n] = '\0';
}


static int
hexval(int c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}


int
kv_hex_decode(const char *s, void *out, size_t max, size_t *n)
{
    size_t len = strlen(s), i;
    unsigned char *b = out;
    int hi, lo;

    if (len % 2 || len / 2 > max) {
        return -1;
    }
    for (i = 0; i < len / 2; i++) {
        hi = hexval(s[2 * i]);
        lo = hexval(s[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            return -1;
        }
        b[i] = (unsigned char) (hi << 4 | lo);
    }
    *n = len / 2;
    return 0;
}


/* Word-wise FNV-1a style checksum (8 bytes per step, tail byte-wise):
 * cheap enough to run over hundreds of MiB in tests. */
uint64_t
kv_checksum(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    uint64_t w;

    while (n >= 8) {
        memcpy(&w, b, 8);
        h = (h ^ w) * 0x100000001b3ULL;
        h ^= h >> 29;
        b += 8;
        n -= 8;
    }
    while (n--) {
        h = (h ^ *b++) * 0x100000001b3ULL;
    }
    return h;
}


/* ---- framed connections: 4-byte big-endian length + JSON -------------- */

void
kv_conn_init(kv_conn_t *c, int fd)
{
    memset(c, 0, sizeof(*c));
    c->fd = fd;
}


void
kv_conn_free(kv_conn_t *c)
{
    int i;

    for (i = 0; i < c->nfds; i++) {
        close(c->fds[i]);
    }
    if (c->fd >= 0) {
        close(c->fd);
    }
    free(c->rbuf);
    free(c->wbuf);
    memset(c, 0, sizeof(*c));
    c->fd = -1;
}


static int
conn_recv(kv_conn_t *c, int with_fds)
{
    char cbuf[CMSG_SPACE(4 * sizeof(int))];
    struct msghdr mh;
    struct cmsghdr *cm;
    struct iovec iov;
    ssize_t n;
    int i, nf, *fp;

    iov.iov_base = c->rbuf + c->rlen;
    iov.iov_len = c->rcap - c->rlen;
    memset(&mh, 0, sizeof(mh));
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (with_fds) {
        mh.msg_control = cbuf;
        mh.msg_controllen = sizeof(cbuf);
    }
    n = recvmsg(c->fd, &mh, MSG_CMSG_CLOEXEC);
    if (n < 0) {
        return (errno == EAGAIN || errno == EINTR) ? 0 : -1;
    }
    if (n == 0) {
        return -1;
    }
    if (with_fds) {
        for (cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
            if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) {
                continue;
            }
            nf = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            fp = (int *) CMSG_DATA(cm);
            for (i = 0; i < nf; i++) {
                if (c->nfds < 4) {
                    c->fds[c->nfds++] = fp[i];
                } else {
                    close(fp[i]);
                }
            }
        }
    }
    c->rlen += n;
    return (int) n;
}


int
kv_conn_read(kv_conn_t *c, uint32_t max, int with_fds, char **msg,
    uint32_t *len, const char **errmsg)
{
    uint32_t need;
    unsigned char *h;
    char *nb;
    int rc;

    for ( ;; ) {
        if (c->rlen >= 4) {
            h = (unsigned char *) c->rbuf;
            need = (uint32_t) h[0] << 24 | h[1] << 16 | h[2] << 8 | h[3];
            if (need > max) {
                *errmsg = "message too large";
                return -2;
            }
            if (c->rlen >= 4 + (size_t) need) {
                /* not NUL-terminated: parse with cJSON_ParseWithLength */
                *msg = c->rbuf + 4;
                *len = need;
                return 1;
            }
        } else {
            need = 0;
        }
        if (c->rcap < 4 + (size_t) need || c->rlen == c->rcap) {
            size_t ncap = c->rcap ? c->rcap * 2 : 4096;
            while (ncap < 4 + (size_t) need) {
                ncap *= 2;
            }
            nb = realloc(c->rbuf, ncap);
            if (nb == NULL) {
                *errmsg = "out of memory";
                return -1;
            }
            c->rbuf = nb;
            c->rcap = ncap;
        }
        rc = conn_recv(c, with_fds);
        if (rc < 0) {
            *errmsg = "connection closed";
            return -1;
        }
        if (rc == 0) {
            return 0;
        }
    }
}


/* Drop the frame returned by kv_conn_read. */
void
kv_conn_consume(kv_conn_t *c, uint32_t len)
{
    size_t used = 4 + (size_t) len;

    memmove(c->rbuf, c->rbuf + used, c->rlen - used);
    c->rlen -= used;
}


size_t kv_conn_wmax = 8u << 20;


int
kv_conn_queue(kv_conn_t *c, const char *data, size_t len)
{
    size_t need = c->wlen + 4 + len;
    unsigned char h[4];
    char *nb;

    if (c->woff && c->woff == c->wlen) {
        c->woff = c->wlen = 0;
        need = 4 + len;
    }
    if (need - c->woff > kv_conn_wmax && c->wlen > c->woff) {
        /* the other side stopped reading: do not buffer without bound
         * (one message larger than the cap still goes to a reader that
         * keeps up) */
        c->overflow = 1;
        return -1;
    }
    if (c->woff > 0 && need > c->wcap) {
        /* reclaim what was sent before growing */
        memmove(c->wbuf, c->wbuf + c->woff, c->wlen - c->woff);
        c->wlen -= c->woff;
        c->woff = 0;
        need = c->wlen + 4 + len;
    }
    if (need > c->wcap) {
        nb = realloc(c->wbuf, need + 4096);
        if (nb == NULL) {
            return -1;
        }
        c->wbuf = nb;
        c->wcap = need + 4096;
    }
    h[0] = len >> 24; h[1] = len >> 16; h[2] = len >> 8; h[3] = len;
    memcpy(c->wbuf + c->wlen, h, 4);
    memcpy(c->wbuf + c->wlen + 4, data, len);
    c->wlen += 4 + len;
    return kv_conn_flush(c);
}


int
kv_conn_flush(kv_conn_t *c)
{
    ssize_t n;

    while (c->woff < c->wlen) {
        n = send(c->fd, c->wbuf + c->woff, c->wlen - c->woff, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR) {
                return 0;
            }
            return -1;
        }
        c->woff += n;
    }
    c->woff = c->wlen = 0;
    return 0;
}


int
kv_conn_send_json(kv_conn_t *c, cJSON *j)
{
    char *s = cJSON_PrintUnformatted(j);
    int rc;

    cJSON_Delete(j);
    if (s == NULL) {
        return -1;
    }
    rc = kv_conn_queue(c, s, strlen(s));
    free(s);
    return rc;
}


/* ---- block lists --------------------------------------------------------- */

int
kv_ids_parse(cJSON *arr, uint32_t *out, uint32_t max, uint32_t *n,
    char *err, size_t elen)
{
    cJSON *e;
    uint32_t k = 0;
    double v;

    if (!cJSON_IsArray(arr)) {
        snprintf(err, elen, "block list must be an array");
        return -1;
    }
    cJSON_ArrayForEach(e, arr) {
        if (!cJSON_IsNumber(e)) {
            snprintf(err, elen, "block ids must be numbers");
            return -1;
        }
        v = e->valuedouble;
        if (v < 0 || v > 4294967295.0 || v != (double) (uint32_t) v) {
            snprintf(err, elen, "block id %.0f out of range", v);
            return -1;
        }
        if (k >= max) {
            snprintf(err, elen, "too many blocks (max %u)", max);
            return -1;
        }
        out[k++] = (uint32_t) v;
    }
    *n = k;
    return 0;
}


int
kv_runs_parse(cJSON *arr, uint32_t *out, uint32_t max, uint32_t *n,
    char *err, size_t elen)
{
    cJSON *e, *a, *b;
    uint32_t k = 0, i;
    double s, c;

    if (!cJSON_IsArray(arr)) {
        snprintf(err, elen, "runs must be an array of [start, count]");
        return -1;
    }
    cJSON_ArrayForEach(e, arr) {
        a = cJSON_GetArrayItem(e, 0);
        b = cJSON_GetArrayItem(e, 1);
        if (!cJSON_IsArray(e) || cJSON_GetArraySize(e) != 2
            || !cJSON_IsNumber(a) || !cJSON_IsNumber(b))
        {
            snprintf(err, elen, "runs must be an array of [start, count]");
            return -1;
        }
        s = a->valuedouble;
        c = b->valuedouble;
        if (s < 0 || c < 0 || s + c > 4294967296.0
            || s != (double) (uint32_t) s || c != (double) (uint32_t) c)
        {
            snprintf(err, elen, "block run [%.0f, %.0f] out of range", s, c);
            return -1;
        }
        if (c > max - k) {
            snprintf(err, elen, "too many blocks (max %u)", max);
            return -1;
        }
        for (i = 0; i < (uint32_t) c; i++) {
            out[k++] = (uint32_t) s + i;
        }
    }
    *n = k;
    return 0;
}


cJSON *
kv_runs_json(const uint32_t *ids, uint32_t n)
{
    cJSON *arr = cJSON_CreateArray(), *run;
    uint32_t i = 0, j;

    while (arr && i < n) {
        j = i + 1;
        while (j < n && ids[j] == ids[j - 1] + 1) {
            j++;
        }
        run = cJSON_CreateArray();
        cJSON_AddItemToArray(run, cJSON_CreateNumber(ids[i]));
        cJSON_AddItemToArray(run, cJSON_CreateNumber(j - i));
        cJSON_AddItemToArray(arr, run);
        i = j;
    }
    return arr;
}
