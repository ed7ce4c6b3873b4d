/*
 * state.c - the single writer of the readiness table (dpd_state.h).
 *
 * At start the file is always rebuilt (write to a temporary file, then
 * rename), so readers never map a half-initialised table; what was there
 * before (corrupt, another version, a previous run) is logged.
 */

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kv.h"

_Static_assert(sizeof(dpd_state_header_t) == 256, "header ABI size");
_Static_assert(sizeof(dpd_node_rec_t) == 288, "node record ABI size");
_Static_assert(sizeof(dpd_req_rec_t) == 352, "request record ABI size");

#define ALIGN64(x) (((x) + 63) & ~(uint64_t) 63)


/* Describe what an existing file holds, for the log. */
static void
inspect_old(const char *path)
{
    const dpd_state_header_t *h;
    struct stat sb;
    void *m;
    int fd;

    fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        if (errno != ENOENT) {
            kv_warn("state: cannot read existing %s: %s", path,
                    strerror(errno));
        }
        return;
    }
    if (fstat(fd, &sb) != 0 || (size_t) sb.st_size < sizeof(*h)) {
        kv_warn("state: existing %s is truncated (%lld bytes): recreated",
                path, (long long) sb.st_size);
        close(fd);
        return;
    }
    m = mmap(NULL, sb.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        kv_warn("state: cannot map existing %s: recreated", path);
        return;
    }
    h = m;
    if (h->magic != DPD_STATE_MAGIC) {
        kv_warn("state: existing %s is corrupt (bad magic): recreated", path);
    } else if (h->version != DPD_STATE_VERSION) {
        kv_warn("state: existing %s has wrong version %u (want %u): "
                "recreated", path, h->version, DPD_STATE_VERSION);
    } else if (dpd_state_check(m, sb.st_size) != 0) {
        kv_warn("state: existing %s is corrupt (bad sizes): recreated", path);
    } else {
        kv_info("state: replacing the table of a previous run (pid %u) at %s",
                h->writer_pid, path);
    }
    munmap(m, sb.st_size);
}


/*
 * The table's directory must be one only the agent (and root) can write:
 * whoever else can write it can replace the table nginx trusts.  A
 * directory writable by others without the sticky bit is refused; a
 * sticky shared one (/dev/shm, the default) is accepted with a warning.
 */
int
kv_state_dir_check(const char *path, int warn)
{
    char dir[512], *slash;
    struct stat sb;

    snprintf(dir, sizeof(dir), "%s", path);
    slash = strrchr(dir, '/');
    if (slash == NULL) {
        snprintf(dir, sizeof(dir), ".");
    } else if (slash == dir) {
        dir[1] = '\0';
    } else {
        *slash = '\0';
    }
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        kv_err("state: directory %s of %s: %s", dir, path,
               errno ? strerror(errno) : "not a directory");
        return -1;
    }
    if ((sb.st_mode & (S_IWOTH | S_IWGRP)) && !(sb.st_mode & S_ISVTX)) {
        kv_err("state: directory %s is writable by %s and not sticky: "
               "another user could replace the table; use a directory "
               "only the agent writes", dir,
               (sb.st_mode & S_IWOTH) ? "everyone" : "its group");
        return -1;
    }
    if (!warn) {
        return 0;
    }
    if (sb.st_mode & S_IWOTH) {
        kv_warn("state: directory %s is shared (world-writable, sticky); a "
                "directory only the agent writes is safer", dir);
    } else if (sb.st_uid != geteuid() && sb.st_uid != 0) {
        kv_warn("state: directory %s belongs to uid %u, not to the agent",
                dir, (unsigned) sb.st_uid);
    }
    return 0;
}


int
kv_state_open(kv_state_t *s, const char *path, const char *self_id,
    uint32_t max_nodes, uint32_t max_reqs)
{
    char tmp[600];
    uint64_t rnd;
    int tries;
    dpd_state_header_t *h;
    struct timespec ts;
    uint64_t nodes_off, reqs_off, size;
    void *m;
    int fd;

    memset(s, 0, sizeof(*s));
    snprintf(s->path, sizeof(s->path), "%s", path);
    inspect_old(path);

    nodes_off = ALIGN64(sizeof(dpd_state_header_t));
    reqs_off = ALIGN64(nodes_off + (uint64_t) max_nodes
                                   * sizeof(dpd_node_rec_t));
    size = reqs_off + (uint64_t) max_reqs * sizeof(dpd_req_rec_t);

    if (kv_state_dir_check(path, 1) != 0) {
        return -1;
    }
    /* a fresh file, never one someone placed there: O_EXCL with a name
     * nobody can guess, no symlink followed; readable by nginx workers
     * whatever our umask */
    for (tries = 0; ; tries++) {
        if (getrandom(&rnd, sizeof(rnd), 0) != sizeof(rnd)) {
            rnd = kv_wall_ms() ^ ((uint64_t) getpid() << 40) ^ tries;
        }
        snprintf(tmp, sizeof(tmp), "%s.tmp.%016llx", path,
                 (unsigned long long) rnd);
        fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                  0644);
        if (fd >= 0 || errno != EEXIST || tries >= 8) {
            break;
        }
    }
    if (fd < 0) {
        kv_err("state: cannot create %s: %s", tmp, strerror(errno));
        return -1;
    }
    if (fchmod(fd, 0644) != 0) {
        kv_err("state: cannot chmod %s: %s", tmp, strerror(errno));
        goto fail;
    }
    if (ftruncate(fd, size) != 0) {
        kv_err("state: cannot size %s: %s", tmp, strerror(errno));
        goto fail;
    }
    m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        kv_err("state: cannot map %s: %s", tmp, strerror(errno));
        goto fail;
    }
    memset(m, 0, size);
    h = m;
    h->version = DPD_STATE_VERSION;
    h->header_size = sizeof(dpd_state_header_t);
    h->node_rec_size = sizeof(dpd_node_rec_t);
    h->req_rec_size = sizeof(dpd_req_rec_t);
    h->max_nodes = max_nodes;
    h->max_reqs = max_reqs;
    h->nodes_off = nodes_off;
    h->reqs_off = reqs_off;
    h->file_size = size;
    clock_gettime(CLOCK_REALTIME, &ts);
    h->generation = ((uint64_t) ts.tv_sec << 32) ^ ts.tv_nsec
                    ^ ((uint64_t) getpid() << 16);
    h->created_ms = kv_wall_ms();
    h->updated_ms = h->created_ms;
    h->writer_pid = (uint32_t) getpid();
    h->writer_alive = 1;
    snprintf(h->self_id, sizeof(h->self_id), "%s", self_id);
    /* magic last: a reader of the temp file never sees a valid header
     * over unset fields */
    __atomic_store_n(&h->magic, DPD_STATE_MAGIC, __ATOMIC_RELEASE);
    if (msync(m, size, MS_SYNC) != 0 || rename(tmp, path) != 0) {
        kv_err("state: cannot install %s: %s", path, strerror(errno));
        munmap(m, size);
        goto fail;
    }
    close(fd);
    s->map = m;
    s->size = size;
    s->hdr = h;
    s->nodes = (dpd_node_rec_t *) ((char *) m + nodes_off);
    s->reqs = (dpd_req_rec_t *) ((char *) m + reqs_off);
    kv_info("state: table %s ready (%u nodes, %u requests, %llu bytes, "
            "version %u)", path, max_nodes, max_reqs,
            (unsigned long long) size, DPD_STATE_VERSION);
    return 0;

fail:
    close(fd);
    unlink(tmp);
    return -1;
}


void
kv_state_close(kv_state_t *s, int clean)
{
    uint32_t i;

    if (s->map == NULL) {
        return;
    }
    if (clean) {
        for (i = 0; i < s->hdr->max_nodes; i++) {
            if (s->nodes[i].flags & DPD_NODE_ALIVE) {
                kv_state_node_begin(&s->nodes[i]);
                s->nodes[i].flags &= ~DPD_NODE_ALIVE;
                kv_state_node_end(s, &s->nodes[i]);
            }
        }
        __atomic_store_n(&s->hdr->writer_alive, 0, __ATOMIC_RELEASE);
        msync(s->map, s->size, MS_SYNC);
    }
    munmap(s->map, s->size);
    s->map = NULL;
}


static void
seq_begin(uint32_t *seq)
{
    __atomic_store_n(seq, *seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}


static void
seq_end(kv_state_t *s, uint32_t *seq)
{
    __atomic_store_n(seq, *seq + 1, __ATOMIC_RELEASE);
    s->hdr->updated_ms = kv_wall_ms();
}


void
kv_state_node_begin(dpd_node_rec_t *r)
{
    seq_begin(&r->seq);
}


void
kv_state_node_end(kv_state_t *s, dpd_node_rec_t *r)
{
    seq_end(s, &r->seq);
}


void
kv_state_req_begin(dpd_req_rec_t *r)
{
    seq_begin(&r->seq);
}


void
kv_state_req_end(kv_state_t *s, dpd_req_rec_t *r)
{
    seq_end(s, &r->seq);
}


/* The record for node id, created (id set, USED) when absent; NULL when
 * the table is full. */
dpd_node_rec_t *
kv_state_node(kv_state_t *s, const char *id)
{
    uint64_t hash = dpd_state_hash(id, strlen(id));
    dpd_node_rec_t *free_rec = NULL, *r;
    uint32_t i;

    for (i = 0; i < s->hdr->max_nodes; i++) {
        r = &s->nodes[i];
        if ((r->flags & DPD_NODE_USED) && r->id_hash == hash
            && strncmp(r->id, id, sizeof(r->id)) == 0)
        {
            return r;
        }
        if (!(r->flags & DPD_NODE_USED) && free_rec == NULL) {
            free_rec = r;
        }
    }
    if (free_rec == NULL) {
        kv_warn("state: node table full, %s not recorded", id);
        return NULL;
    }
    kv_state_node_begin(free_rec);
    memset((char *) free_rec + sizeof(uint32_t), 0,
           sizeof(*free_rec) - sizeof(uint32_t));
    free_rec->flags = DPD_NODE_USED;
    free_rec->id_hash = hash;
    snprintf(free_rec->id, sizeof(free_rec->id), "%s", id);
    kv_state_node_end(s, free_rec);
    return free_rec;
}


/* A node that left (a discovered peer gone from DNS): its record is
 * freed, so readers (nginx) no longer list it at all. */
void
kv_state_node_remove(kv_state_t *s, const char *id)
{
    uint64_t hash = dpd_state_hash(id, strlen(id));
    dpd_node_rec_t *r;
    uint32_t i;

    for (i = 0; s->map && i < s->hdr->max_nodes; i++) {
        r = &s->nodes[i];
        if ((r->flags & DPD_NODE_USED) && !(r->flags & DPD_NODE_SELF)
            && r->id_hash == hash
            && strncmp(r->id, id, sizeof(r->id)) == 0)
        {
            kv_state_node_begin(r);
            memset((char *) r + sizeof(uint32_t), 0,
                   sizeof(*r) - sizeof(uint32_t));
            kv_state_node_end(s, r);
            return;
        }
    }
}


static int
req_matches(const dpd_req_rec_t *r, uint64_t hash, const char *req_id)
{
    return r->id_hash == hash && r->state != DPD_REQ_FREE
           && strncmp(r->req_id, req_id, sizeof(r->req_id) - 1) == 0;
}


/* The record for req_id; with create, a new one (state FREE, id set) is
 * made in the first reusable slot of its probe window, evicting the
 * oldest finished record if needed.  NULL when impossible. */
dpd_req_rec_t *
kv_state_req(kv_state_t *s, const char *req_id, int create)
{
    uint32_t max = s->hdr->max_reqs, i, idx, probe;
    uint64_t hash = dpd_state_hash(req_id, strlen(req_id));
    dpd_req_rec_t *r, *slot = NULL, *oldest = NULL;

    probe = max < DPD_STATE_MAX_PROBE ? max : DPD_STATE_MAX_PROBE;
    for (i = 0; i < probe; i++) {
        idx = (uint32_t) ((hash + i) % max);
        r = &s->reqs[idx];
        if (r->id_hash == 0) {
            if (slot == NULL) {
                slot = r;
            }
            break;
        }
        if (req_matches(r, hash, req_id)) {
            return r;
        }
        if (r->state == DPD_REQ_FREE && slot == NULL) {
            slot = r;
        }
        if ((r->state == DPD_REQ_READY || r->state == DPD_REQ_FAILED)
            && (oldest == NULL || r->t_done_ms < oldest->t_done_ms))
        {
            oldest = r;
        }
    }
    if (!create) {
        return NULL;
    }
    if (slot == NULL) {
        slot = oldest;
    }
    if (slot == NULL) {
        kv_warn("state: request table window full, %s not recorded", req_id);
        return NULL;
    }
    kv_state_req_begin(slot);
    memset((char *) slot + sizeof(uint32_t), 0,
           sizeof(*slot) - sizeof(uint32_t));
    slot->id_hash = hash;
    snprintf(slot->req_id, sizeof(slot->req_id), "%s", req_id);
    slot->state = DPD_REQ_RESERVED;
    kv_state_req_end(s, slot);
    return slot;
}


void
kv_state_req_delete(kv_state_t *s, dpd_req_rec_t *r)
{
    /* keep id_hash: a tombstone, so probes continue past it */
    kv_state_req_begin(r);
    r->state = DPD_REQ_FREE;
    kv_state_req_end(s, r);
}


void
kv_state_gc(kv_state_t *s, uint64_t older_than_wall_ms)
{
    uint32_t i;
    dpd_req_rec_t *r;

    for (i = 0; i < s->hdr->max_reqs; i++) {
        r = &s->reqs[i];
        if ((r->state == DPD_REQ_READY || r->state == DPD_REQ_FAILED)
            && r->t_done_ms < older_than_wall_ms)
        {
            kv_state_req_delete(s, r);
        }
    }
}
