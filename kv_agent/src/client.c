/*
 * client.c - the C client library for the kv_agent local API
 * (kv_agent_client.h).  Self-contained: only libc and cJSON.
 */

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "kv_agent_client.h"

#define KVC_MAX_REPLY (64u << 20)

struct kvc {
    int fd;
    int timeout_ms;
};


kvc_t *
kvc_connect(const char *path, int timeout_ms, char *err, size_t elen)
{
    struct sockaddr_un sa;
    kvc_t *c;
    int fd;

    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof(sa.sun_path)) {
        snprintf(err, elen, "socket path too long");
        return NULL;
    }
    strcpy(sa.sun_path, path);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *) &sa, sizeof(sa)) != 0) {
        snprintf(err, elen, "connect %s: %s", path, strerror(errno));
        if (fd >= 0) {
            close(fd);
        }
        return NULL;
    }
    c = calloc(1, sizeof(*c));
    if (c == NULL) {
        close(fd);
        snprintf(err, elen, "out of memory");
        return NULL;
    }
    c->fd = fd;
    c->timeout_ms = timeout_ms > 0 ? timeout_ms : 60000;
    return c;
}


void
kvc_close(kvc_t *c)
{
    if (c) {
        close(c->fd);
        free(c);
    }
}


static int
send_frame(kvc_t *c, const char *json, int fd, char *err, size_t elen)
{
    size_t len = strlen(json), off = 0;
    unsigned char hdr[4];
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct msghdr mh;
    struct cmsghdr *cm;
    struct iovec iov[2];
    ssize_t n;

    hdr[0] = len >> 24; hdr[1] = len >> 16; hdr[2] = len >> 8; hdr[3] = len;
    memset(&mh, 0, sizeof(mh));
    iov[0].iov_base = hdr;
    iov[0].iov_len = 4;
    iov[1].iov_base = (void *) json;
    iov[1].iov_len = len;
    mh.msg_iov = iov;
    mh.msg_iovlen = 2;
    if (fd >= 0) {
        memset(cbuf, 0, sizeof(cbuf));
        mh.msg_control = cbuf;
        mh.msg_controllen = sizeof(cbuf);
        cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    }
    n = sendmsg(c->fd, &mh, MSG_NOSIGNAL);
    if (n < 0) {
        snprintf(err, elen, "send: %s", strerror(errno));
        return -1;
    }
    off = (size_t) n;
    /* the rest, if the kernel took a partial frame */
    while (off < 4 + len) {
        const char *p = off < 4 ? (const char *) hdr + off
                                : json + (off - 4);
        size_t rem = off < 4 ? 4 - off : 4 + len - off;
        n = send(c->fd, p, rem, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            snprintf(err, elen, "send: %s", strerror(errno));
            return -1;
        }
        off += n;
    }
    return 0;
}


static int
recv_exact(kvc_t *c, void *buf, size_t n, int timeout_ms, char *err,
    size_t elen)
{
    struct pollfd pfd;
    char *p = buf;
    ssize_t r;
    int rc;

    while (n) {
        pfd.fd = c->fd;
        pfd.events = POLLIN;
        rc = poll(&pfd, 1, timeout_ms);
        if (rc == 0) {
            snprintf(err, elen, "timed out waiting for kv_agent");
            return -1;
        }
        if (rc < 0 && errno == EINTR) {
            continue;
        }
        r = recv(c->fd, p, n, 0);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            snprintf(err, elen, "kv_agent closed the connection");
            return -1;
        }
        p += r;
        n -= r;
    }
    return 0;
}


static cJSON *
call_json(kvc_t *c, cJSON *req, int fd, int extra_ms, char *err, size_t elen)
{
    unsigned char hdr[4];
    char *s, *buf;
    uint32_t len;
    cJSON *rep;

    s = cJSON_PrintUnformatted(req);
    cJSON_Delete(req);
    if (s == NULL) {
        snprintf(err, elen, "out of memory");
        return NULL;
    }
    if (send_frame(c, s, fd, err, elen) != 0) {
        free(s);
        return NULL;
    }
    free(s);
    if (recv_exact(c, hdr, 4, c->timeout_ms + extra_ms, err, elen) != 0) {
        return NULL;
    }
    len = (uint32_t) hdr[0] << 24 | hdr[1] << 16 | hdr[2] << 8 | hdr[3];
    if (len > KVC_MAX_REPLY) {
        snprintf(err, elen, "reply too large");
        return NULL;
    }
    buf = malloc(len + 1);
    if (buf == NULL) {
        snprintf(err, elen, "out of memory");
        return NULL;
    }
    if (recv_exact(c, buf, len, c->timeout_ms, err, elen) != 0) {
        free(buf);
        return NULL;
    }
    rep = cJSON_ParseWithLength(buf, len);
    free(buf);
    if (rep == NULL) {
        snprintf(err, elen, "malformed reply");
    }
    return rep;
}


/* 0 when ok is true; else -1 with the agent's error text in err. */
static int
check_ok(cJSON *rep, char *err, size_t elen)
{
    cJSON *e;

    if (rep == NULL) {
        return -1;
    }
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(rep, "ok"))) {
        return 0;
    }
    e = cJSON_GetObjectItemCaseSensitive(rep, "error");
    snprintf(err, elen, "%s", cJSON_IsString(e) ? e->valuestring
                                                : "unknown error");
    return -1;
}


int
kvc_call(kvc_t *c, const char *json, int fd, char **reply, char *err,
    size_t elen)
{
    cJSON *req = cJSON_Parse(json), *rep;
    int rc;

    *reply = NULL;
    if (req == NULL) {
        snprintf(err, elen, "request is not JSON");
        return -1;
    }
    rep = call_json(c, req, fd, 0, err, elen);
    if (rep == NULL) {
        return -1;
    }
    rc = check_ok(rep, err, elen);
    *reply = cJSON_PrintUnformatted(rep);
    cJSON_Delete(rep);
    return rc;
}


static cJSON *
verb(const char *name, const char *req_id)
{
    cJSON *j = cJSON_CreateObject();

    cJSON_AddStringToObject(j, "verb", name);
    if (req_id) {
        cJSON_AddStringToObject(j, "req_id", req_id);
    }
    return j;
}


static cJSON *
runs_json(const uint32_t *ids, uint32_t n)
{
    cJSON *arr = cJSON_CreateArray(), *run;
    uint32_t i = 0, j;

    while (i < n) {
        for (j = i + 1; j < n && ids[j] == ids[j - 1] + 1; j++) {
        }
        run = cJSON_CreateArray();
        cJSON_AddItemToArray(run, cJSON_CreateNumber(ids[i]));
        cJSON_AddItemToArray(run, cJSON_CreateNumber(j - i));
        cJSON_AddItemToArray(arr, run);
        i = j;
    }
    return arr;
}


static int
simple(kvc_t *c, cJSON *req, int fd, char *err, size_t elen)
{
    cJSON *rep = call_json(c, req, fd, 0, err, elen);
    int rc = check_ok(rep, err, elen);

    cJSON_Delete(rep);
    return rc;
}


/* The agent refuses a memfd that can still shrink (SIGBUS) or grow:
 * seal it before handing it over. */
static int
seal_memfd(int fd, char *err, size_t elen)
{
    int want = F_SEAL_SHRINK | F_SEAL_GROW, seals = fcntl(fd, F_GET_SEALS);

    if (seals >= 0 && (seals & want) == want) {
        return 0;
    }
    if (seals < 0 || fcntl(fd, F_ADD_SEALS, want) != 0) {
        snprintf(err, elen, "cannot seal the pool memfd (%s): create it "
                 "with memfd_create(..., MFD_ALLOW_SEALING)",
                 strerror(errno));
        return -1;
    }
    return 0;
}


int
kvc_register_host_pool(kvc_t *c, int memfd, size_t size, char *err,
    size_t elen)
{
    cJSON *j;

    if (seal_memfd(memfd, err, elen) != 0) {
        return -1;
    }
    j = verb("register_pool", NULL);

    cJSON_AddStringToObject(j, "memory", "host");
    cJSON_AddNumberToObject(j, "size", (double) size);
    return simple(c, j, memfd, err, elen);
}


int
kvc_register_cuda_pool(kvc_t *c, int device, const void *ipc_handle,
    size_t handle_len, size_t size, char *err, size_t elen)
{
    static const char hx[] = "0123456789abcdef";
    const unsigned char *b = ipc_handle;
    char mem[32], *hex;
    cJSON *j;
    size_t i;

    hex = malloc(2 * handle_len + 1);
    if (hex == NULL) {
        snprintf(err, elen, "out of memory");
        return -1;
    }
    for (i = 0; i < handle_len; i++) {
        hex[2 * i] = hx[b[i] >> 4];
        hex[2 * i + 1] = hx[b[i] & 15];
    }
    hex[2 * handle_len] = '\0';
    snprintf(mem, sizeof(mem), "cuda:%d", device);
    j = verb("register_pool", NULL);
    cJSON_AddStringToObject(j, "memory", mem);
    cJSON_AddStringToObject(j, "ipc_handle", hex);
    cJSON_AddNumberToObject(j, "size", (double) size);
    free(hex);
    return simple(c, j, -1, err, elen);
}


int
kvc_reserve(kvc_t *c, const char *req_id, uint32_t nblocks,
    uint32_t *blocks, uint32_t max, uint32_t *n, char *err, size_t elen)
{
    cJSON *j = verb("reserve", req_id), *rep, *arr, *e;
    uint32_t k = 0;

    cJSON_AddNumberToObject(j, "nblocks", nblocks);
    rep = call_json(c, j, -1, 0, err, elen);
    if (check_ok(rep, err, elen) != 0) {
        cJSON_Delete(rep);
        return -1;
    }
    arr = cJSON_GetObjectItemCaseSensitive(rep, "blocks");
    cJSON_ArrayForEach(e, arr) {
        if (blocks && k < max) {
            blocks[k] = (uint32_t) e->valuedouble;
        }
        k++;
    }
    if (n) {
        *n = k;
    }
    cJSON_Delete(rep);
    return 0;
}


int
kvc_push(kvc_t *c, const char *req_id, const char *peer, const uint32_t *src,
    const uint32_t *dst, uint32_t n, char *err, size_t elen)
{
    cJSON *j = verb("push", req_id);

    cJSON_AddStringToObject(j, "peer", peer);
    cJSON_AddItemToObject(j, "src_runs", runs_json(src, n));
    if (dst) {
        cJSON_AddItemToObject(j, "dst_runs", runs_json(dst, n));
    }
    return simple(c, j, -1, err, elen);
}


static void
fill_state(cJSON *rep, kvc_req_state_t *st)
{
    cJSON *v;

    memset(st, 0, sizeof(*st));
    v = cJSON_GetObjectItemCaseSensitive(rep, "state");
    snprintf(st->state, sizeof(st->state), "%s",
             cJSON_IsString(v) ? v->valuestring : "");
    st->final = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(rep, "final"));
    st->timeout = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(rep,
                                                                "timeout"));
    v = cJSON_GetObjectItemCaseSensitive(rep, "bytes_done");
    st->bytes_done = cJSON_IsNumber(v) ? (uint64_t) v->valuedouble : 0;
    v = cJSON_GetObjectItemCaseSensitive(rep, "bytes_total");
    st->bytes_total = cJSON_IsNumber(v) ? (uint64_t) v->valuedouble : 0;
    v = cJSON_GetObjectItemCaseSensitive(rep, "nblocks");
    st->nblocks = cJSON_IsNumber(v) ? (uint32_t) v->valuedouble : 0;
    v = cJSON_GetObjectItemCaseSensitive(rep, "error");
    snprintf(st->error, sizeof(st->error), "%s",
             cJSON_IsString(v) ? v->valuestring : "");
}


static int
state_call(kvc_t *c, cJSON *j, int extra_ms, kvc_req_state_t *st, char *err,
    size_t elen)
{
    cJSON *rep = call_json(c, j, -1, extra_ms, err, elen);

    if (check_ok(rep, err, elen) != 0) {
        cJSON_Delete(rep);
        return -1;
    }
    fill_state(rep, st);
    cJSON_Delete(rep);
    return 0;
}


int
kvc_poll(kvc_t *c, const char *req_id, kvc_req_state_t *st, char *err,
    size_t elen)
{
    return state_call(c, verb("poll", req_id), 0, st, err, elen);
}


int
kvc_wait(kvc_t *c, const char *req_id, int timeout_ms, kvc_req_state_t *st,
    char *err, size_t elen)
{
    cJSON *j = verb("wait", req_id);

    cJSON_AddNumberToObject(j, "timeout_ms", timeout_ms);
    return state_call(c, j, timeout_ms, st, err, elen);
}


int
kvc_release(kvc_t *c, const char *req_id, char *err, size_t elen)
{
    return simple(c, verb("release", req_id), -1, err, elen);
}


int
kvc_checksum(kvc_t *c, const uint32_t *blocks, uint32_t n, char out[17],
    char *err, size_t elen)
{
    cJSON *j = verb("checksum", NULL), *rep, *v;

    cJSON_AddItemToObject(j, "blocks_runs", runs_json(blocks, n));
    rep = call_json(c, j, -1, 0, err, elen);
    if (check_ok(rep, err, elen) != 0) {
        cJSON_Delete(rep);
        return -1;
    }
    v = cJSON_GetObjectItemCaseSensitive(rep, "checksum");
    snprintf(out, 17, "%s", cJSON_IsString(v) ? v->valuestring : "");
    cJSON_Delete(rep);
    return 0;
}
