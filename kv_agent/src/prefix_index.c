/*
 * prefix_index.c - the single writer of the KV-events prefix index
 * (dpd_prefix_index.h; see prefix_index.h for what feeds it).
 *
 * The file: created once at start (temporary name, O_EXCL, rename), then
 * written in place under the per-record seqlocks; nginx workers pread()
 * it and never map it.  The agent keeps its own map from (node, engine
 * block id) to the gateway key in process memory: readers never need it.
 *
 * Slots: open addressing, home = dpd_pfx_home() (the key mixed with the
 * file's random salt: a client choosing prompts cannot aim their keys at
 * one probe window), at most max_probe slots probed.  Key 0 ends a probe, so a slot's key is never reset to 0;
 * a slot whose masks are both 0 is a tombstone, reused for the same key
 * or, when a key is inserted and no earlier slot of its probe holds it,
 * for another one (a reader probing for the old key then misses, which
 * is what a tombstone means anyway).
 *
 * Cut short under the agent (a truncate(1), a copy over it): its next
 * store into a page past the new end is SIGBUS.  A handler restores the
 * file's size (ftruncate is async-signal-safe) so that store lands, and
 * the next call rewrites the whole file from process memory (the header
 * as created, the node records, every slot from the id map).
 *
 * Duplicates: vLLM may hold two physical blocks with the same content on
 * one node; the map has one entry per engine id, the slot one bit per
 * node, so removing one of the two clears the bit while the other still
 * lives.  That costs a missed hit (a recompute), never a wrong answer.
 */

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kv.h"
#include "dpd_prefix.h"
#include "prefix_index.h"

#define PFX_PROBE      32              /* slots probed per key */
#define PFX_MAP_EMPTY  0
#define PFX_MAP_USED   1
#define PFX_MAP_TOMB   2
#define PFX_RECENT     4096            /* ids a node's clear can visit */

typedef struct {
    uint64_t  eid;                     /* engine block id */
    uint64_t  key;                     /* gateway key */
    uint16_t  node;
    uint8_t   state;                   /* PFX_MAP_* */
    uint8_t   lower;                   /* stored in a lower tier */
    uint32_t  pad;
} pfx_map_ent_t;

typedef struct {
    uint64_t  eid;
    uint8_t   lower;
} pfx_recent_t;

typedef struct {
    uint64_t  seed;                    /* dpd_prefix_seed(model, "") */
    char      model[128];
    size_t    model_len;
    uint64_t  gpu_blocks;
    uint64_t  lower_blocks;
    char      id[DPD_PFX_ID_LEN];      /* its record's, for a rewrite */
    char      http[DPD_PFX_ADDR_LEN];
    /* the ids stored since the last clear, while they fit: a clear then
     * visits them instead of scanning the whole table and map */
    pfx_recent_t  *recent;
    uint32_t       nrecent;
    int            overflow;
    int            released;           /* kv_pfx_node_release(): free */
    uint64_t       released_ms;        /* ... since (monotonic) */
} pfx_node_t;

struct kv_pfx {
    char               path[KV_PATH_LEN];
    void              *map;            /* the file */
    size_t             size;
    int                fd;             /* for the SIGBUS handler */
    dpd_pfx_header_t   hdr0;           /* the header as created */
    dpd_pfx_header_t  *hdr;
    dpd_pfx_node_t    *nodes;
    dpd_pfx_slot_t    *slots;
    uint64_t           smask;          /* nslots - 1 */
    uint32_t           nnodes;
    pfx_node_t         node[DPD_PFX_MAX_NODES];

    pfx_map_ent_t     *ents;           /* the id map */
    uint64_t           emask;          /* table size - 1 */
    uint64_t           cap;            /* live entries allowed */
    uint64_t           live;
    uint64_t           tombs;

    kv_pfx_stats_t     st;
    kv_loglim_t        lim;
};


/* ---- a file cut short under us --------------------------------------- */

/* one index per process: the mapping the handler may restore */
static struct {
    char                  *base;
    size_t                 len;
    int                    fd;
    dpd_pfx_header_t      *hdr0;
    volatile sig_atomic_t  hit;
    int                    installed;
    struct sigaction       prev;
} pfx_bus;


static void
pfx_on_sigbus(int sig, siginfo_t *si, void *uc)
{
    char  *a;

    (void) sig;
    (void) uc;
    a = si->si_addr;
    if (pfx_bus.base != NULL && a >= pfx_bus.base
        && a < pfx_bus.base + pfx_bus.len
        && ftruncate(pfx_bus.fd, (off_t) pfx_bus.len) == 0)
    {
        /* the access is retried and lands; the header is back at once
         * (block size, probes, slots: what every call reads first), the
         * rest at the next call (pfx_rewrite) */
        memcpy(pfx_bus.base, pfx_bus.hdr0, sizeof(dpd_pfx_header_t));
        pfx_bus.hit = 1;
        return;
    }
    /* not ours: the previous disposition, on the same fault again */
    sigaction(SIGBUS, &pfx_bus.prev, NULL);
}


static void
pfx_bus_watch(kv_pfx_t *x)
{
    struct sigaction  sa;

    pfx_bus.base = NULL;
    pfx_bus.len = x->size;
    pfx_bus.fd = x->fd;
    pfx_bus.hdr0 = &x->hdr0;
    pfx_bus.base = x->map;
    if (pfx_bus.installed) {
        return;
    }
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = pfx_on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &pfx_bus.prev) == 0) {
        pfx_bus.installed = 1;
    }
}


static int slot_update(kv_pfx_t *x, uint64_t key, uint64_t bit, int lower,
    int on);
static void node_publish(kv_pfx_t *x, int node);


/* After a SIGBUS: the pages past the cut came back as zeros.  Readers
 * see no magic (a corrupt file: cache-blind) until the header is back,
 * then the nodes and the slots as the id map has them. */
static void
pfx_rewrite(kv_pfx_t *x)
{
    uint32_t          i;
    uint64_t          k;
    pfx_map_ent_t    *e;
    dpd_pfx_node_t   *r;
    dpd_pfx_header_t  h;

    pfx_bus.hit = 0;
    __atomic_store_n(&x->hdr->magic, 0, __ATOMIC_RELEASE);
    /* the header first (without its magic): the slots' places depend
     * on it (max_probe, and a salted home) */
    h = x->hdr0;
    h.magic = 0;
    memcpy(x->hdr, &h, sizeof(h));
    memset((char *) x->map + sizeof(dpd_pfx_header_t), 0,
           x->size - sizeof(dpd_pfx_header_t));
    for (i = 0; i < x->nnodes; i++) {
        if (x->node[i].released) {
            continue;               /* no node's: left zero (unused) */
        }
        r = &x->nodes[i];
        memcpy(r->id, x->node[i].id, sizeof(r->id));
        memcpy(r->http_addr, x->node[i].http, sizeof(r->http_addr));
        r->flags = DPD_PFX_NODE_USED | DPD_PFX_NODE_READY;
        node_publish(x, (int) i);
    }
    for (k = 0; k <= x->emask; k++) {
        e = &x->ents[k];
        if (e->state == PFX_MAP_USED) {
            (void) slot_update(x, e->key, UINT64_C(1) << e->node, e->lower,
                               1);
        }
    }
    x->hdr->updated_ms = kv_wall_ms();
    __atomic_store_n(&x->hdr->magic, DPD_PFX_MAGIC, __ATOMIC_RELEASE);
    kv_warn("prefix index: %s was cut short under the agent: rewritten "
            "from memory (%u nodes, %llu blocks)", x->path, x->nnodes,
            (unsigned long long) x->live);
}


static void
pfx_check(kv_pfx_t *x)
{
    if (pfx_bus.hit && x->map == (void *) pfx_bus.base) {
        pfx_rewrite(x);
    }
}


/* ---- seqlock (the state table's discipline) ------------------------- */

static void
seq_begin(uint32_t *seq)
{
    __atomic_store_n(seq, *seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}


static void
seq_end(uint32_t *seq)
{
    __atomic_store_n(seq, *seq + 1, __ATOMIC_RELEASE);
}


uint64_t
kv_pfx_bytes_id(const void *p, size_t n)
{
    uint64_t  h;

    h = dpd_prefix_hash_str(p, n);
    return h ? h : 1;
}


/* ---- the id map ------------------------------------------------------- */

static uint64_t
map_home(uint64_t eid, uint16_t node, int lower)
{
    return dpd_prefix_fmix(eid ^ ((uint64_t) node << 56) ^ node
                           ^ ((uint64_t) !!lower << 48));
}


static pfx_map_ent_t *
map_find(kv_pfx_t *x, int node, uint64_t eid, int lower)
{
    uint64_t        i, n;
    pfx_map_ent_t  *e;

    i = map_home(eid, (uint16_t) node, lower);
    for (n = 0; n <= x->emask; n++, i++) {
        e = &x->ents[i & x->emask];
        if (e->state == PFX_MAP_EMPTY) {
            return NULL;
        }
        if (e->state == PFX_MAP_USED && e->eid == eid && e->node == node
            && e->lower == !!lower)
        {
            return e;
        }
    }
    return NULL;
}


/* Rebuilds the table without tombstones (they only lengthen probes). */
static void
map_rehash(kv_pfx_t *x)
{
    uint64_t        i, j, size;
    pfx_map_ent_t  *old, *e;

    size = x->emask + 1;
    old = malloc(size * sizeof(*old));
    if (old == NULL) {
        return;                        /* keep the tombstones */
    }
    memcpy(old, x->ents, size * sizeof(*old));
    memset(x->ents, 0, size * sizeof(*old));
    for (i = 0; i < size; i++) {
        if (old[i].state != PFX_MAP_USED) {
            continue;
        }
        j = map_home(old[i].eid, old[i].node, old[i].lower);
        for (;; j++) {
            e = &x->ents[j & x->emask];
            if (e->state == PFX_MAP_EMPTY) {
                *e = old[i];
                break;
            }
        }
    }
    free(old);
    x->tombs = 0;
}


/*
 * The entry for (node, eid, tier), made when absent; NULL: the map is
 * full.  The tier is part of the name: a block offloaded to CPU keeps
 * its GPU copy's hash, and both live until each is removed.
 */
static pfx_map_ent_t *
map_put(kv_pfx_t *x, int node, uint64_t eid, int lower)
{
    uint64_t        i, n;
    pfx_map_ent_t  *e, *tomb;

    e = map_find(x, node, eid, lower);
    if (e != NULL) {
        return e;
    }
    if (x->live >= x->cap) {
        return NULL;
    }
    if (x->tombs > (x->emask + 1) / 4) {
        map_rehash(x);
    }
    tomb = NULL;
    i = map_home(eid, (uint16_t) node, lower);
    for (n = 0; n <= x->emask; n++, i++) {
        e = &x->ents[i & x->emask];
        if (e->state == PFX_MAP_TOMB && tomb == NULL) {
            tomb = e;
        } else if (e->state == PFX_MAP_EMPTY) {
            break;
        }
    }
    if (tomb != NULL) {
        e = tomb;
        x->tombs--;
    }
    memset(e, 0, sizeof(*e));
    e->state = PFX_MAP_USED;
    e->eid = eid;
    e->node = (uint16_t) node;
    e->lower = !!lower;
    x->live++;
    return e;
}


static void
map_del(kv_pfx_t *x, pfx_map_ent_t *e)
{
    e->state = PFX_MAP_TOMB;
    x->live--;
    x->tombs++;
}


/* ---- slots ------------------------------------------------------------ */

/*
 * Sets (on) or clears node bit "bit" of key's slot, in the GPU or the
 * lower-tier mask.  0, or -1 when setting found no slot in the probe.
 */
static int
slot_update(kv_pfx_t *x, uint64_t key, uint64_t bit, int lower, int on)
{
    uint64_t         p, home, free_i;
    int              have_free;
    dpd_pfx_slot_t  *s;

    have_free = 0;
    free_i = 0;
    home = dpd_pfx_home(x->hdr, key);

    for (p = 0; p < x->hdr->max_probe; p++) {
        s = &x->slots[(home + p) & x->smask];
        if (s->key == key) {
            goto found;
        }
        if (s->key == 0) {
            if (!have_free) {
                have_free = 1;
                free_i = (home + p) & x->smask;
            }
            break;
        }
        if (!have_free && s->gpu_mask == 0 && s->lower_mask == 0) {
            have_free = 1;
            free_i = (home + p) & x->smask;
        }
    }
    if (!on) {
        return 0;                      /* not there: nothing to clear */
    }
    if (!have_free) {
        return -1;
    }
    s = &x->slots[free_i];
    seq_begin(&s->seq);
    s->key = key;
    s->gpu_mask = lower ? 0 : bit;
    s->lower_mask = lower ? bit : 0;
    seq_end(&s->seq);
    return 0;

found:
    seq_begin(&s->seq);
    if (lower) {
        s->lower_mask = on ? (s->lower_mask | bit) : (s->lower_mask & ~bit);
    } else {
        s->gpu_mask = on ? (s->gpu_mask | bit) : (s->gpu_mask & ~bit);
    }
    seq_end(&s->seq);
    return 0;
}


static void
node_publish(kv_pfx_t *x, int node)
{
    dpd_pfx_node_t  *r;

    r = &x->nodes[node];
    seq_begin(&r->seq);
    r->blocks = x->node[node].gpu_blocks;
    r->lower_blocks = x->node[node].lower_blocks;
    r->updated_ms = kv_wall_ms();
    seq_end(&r->seq);
    __atomic_store_n(&x->hdr->updated_ms, r->updated_ms, __ATOMIC_RELAXED);
}


void
kv_pfx_heartbeat(kv_pfx_t *x, uint64_t wall_ms)
{
    uint64_t  last;

    if (x == NULL) {
        return;
    }
    pfx_check(x);       /* an idle agent rewrites a cut file too */
    /* at most once a second (DPD_PFX_HEARTBEAT_MS, readers allow several
     * missed beats); a clock stepped back counts as due */
    last = __atomic_load_n(&x->hdr->updated_ms, __ATOMIC_RELAXED);
    if (wall_ms >= last && wall_ms - last < DPD_PFX_HEARTBEAT_MS / 2) {
        return;
    }
    __atomic_store_n(&x->hdr->updated_ms, wall_ms, __ATOMIC_RELAXED);
}


/* ---- the file --------------------------------------------------------- */

kv_pfx_t *
kv_pfx_open(const char *path, uint64_t nslots, uint32_t max_nodes,
    uint32_t block_size, uint64_t map_cap)
{
    int                fd, tries;
    char               tmp[KV_PATH_LEN + 32];
    void              *m;
    uint64_t           rnd, size, nodes_off, slots_off, esize;
    kv_pfx_t          *x;
    dpd_pfx_header_t  *h;

    if (nslots == 0 || (nslots & (nslots - 1)) != 0
        || nslots > (UINT64_C(1) << 30)
        || max_nodes == 0 || max_nodes > DPD_PFX_MAX_NODES
        || block_size == 0 || block_size > DPD_PREFIX_MAX_BLOCK
        || map_cap == 0 || map_cap > (UINT64_C(1) << 30)
        || strlen(path) >= KV_PATH_LEN)
    {
        kv_err("prefix index: bad parameters (%llu slots, %u nodes, block "
               "%u, map %llu)", (unsigned long long) nslots, max_nodes,
               block_size, (unsigned long long) map_cap);
        return NULL;
    }

    x = calloc(1, sizeof(*x));
    if (x == NULL) {
        return NULL;
    }
    for (esize = 2; esize < map_cap * 2; esize <<= 1) { /* load <= 1/2 */ }
    x->ents = calloc(esize, sizeof(pfx_map_ent_t));
    if (x->ents == NULL) {
        kv_err("prefix index: cannot allocate the id map (%llu entries)",
               (unsigned long long) esize);
        free(x);
        return NULL;
    }
    x->emask = esize - 1;
    x->cap = map_cap;
    snprintf(x->path, sizeof(x->path), "%s", path);

    nodes_off = sizeof(dpd_pfx_header_t);
    slots_off = nodes_off + (uint64_t) max_nodes * sizeof(dpd_pfx_node_t);
    size = slots_off + nslots * sizeof(dpd_pfx_slot_t);

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
        kv_err("prefix index: cannot create %s: %s", tmp, strerror(errno));
        goto fail;
    }
    if (fchmod(fd, 0644) != 0 || ftruncate(fd, size) != 0) {
        kv_err("prefix index: cannot size %s: %s", tmp, strerror(errno));
        goto fail_fd;
    }
    m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        kv_err("prefix index: cannot map %s: %s", tmp, strerror(errno));
        goto fail_fd;
    }
    h = m;
    h->version = DPD_PFX_VERSION;
    h->header_size = sizeof(dpd_pfx_header_t);
    h->node_size = sizeof(dpd_pfx_node_t);
    h->slot_size = sizeof(dpd_pfx_slot_t);
    h->max_nodes = max_nodes;
    h->max_probe = PFX_PROBE;
    h->nslots = nslots;
    h->nodes_off = nodes_off;
    h->slots_off = slots_off;
    h->file_size = size;
    if (getrandom(&h->generation, sizeof(h->generation), 0)
        != sizeof(h->generation))
    {
        h->generation = kv_wall_ms() ^ ((uint64_t) getpid() << 32) ^ rnd;
    }
    if (getrandom(&h->salt, sizeof(h->salt), 0) != sizeof(h->salt)) {
        h->salt = dpd_prefix_fmix(h->generation ^ rnd ^ kv_now_us());
    }
    h->key_version = DPD_PFX_KEY_VERSION;
    h->block_size = block_size;
    h->writer_pid = (uint32_t) getpid();
    h->writer_alive = 1;
    h->updated_ms = kv_wall_ms();
    /* magic last: a reader of the temporary file never sees a valid
     * header over unset fields */
    __atomic_store_n(&h->magic, DPD_PFX_MAGIC, __ATOMIC_RELEASE);
    if (rename(tmp, path) != 0) {
        kv_err("prefix index: cannot install %s: %s", path, strerror(errno));
        munmap(m, size);
        goto fail_fd;
    }

    x->map = m;
    x->size = size;
    x->fd = fd;
    x->hdr0 = *h;
    x->hdr = h;
    x->nodes = (dpd_pfx_node_t *) ((char *) m + nodes_off);
    x->slots = (dpd_pfx_slot_t *) ((char *) m + slots_off);
    x->smask = nslots - 1;
    pfx_bus_watch(x);
    kv_info("prefix index: %s ready (%llu slots, %u nodes, block %u, "
            "%llu bytes, id map %llu)", path, (unsigned long long) nslots,
            max_nodes, block_size, (unsigned long long) size,
            (unsigned long long) map_cap);
    return x;

fail_fd:
    close(fd);
    unlink(tmp);
fail:
    free(x->ents);
    free(x);
    return NULL;
}


void
kv_pfx_close(kv_pfx_t *x, int clean)
{
    uint32_t  i;

    if (x == NULL) {
        return;
    }
    if (x->map != NULL) {
        if (clean) {
            __atomic_store_n(&x->hdr->writer_alive, 0, __ATOMIC_RELEASE);
        }
        if (pfx_bus.base == (char *) x->map) {
            pfx_bus.base = NULL;
        }
        munmap(x->map, x->size);
        close(x->fd);
    }
    for (i = 0; i < x->nnodes; i++) {
        free(x->node[i].recent);
    }
    free(x->ents);
    free(x);
}


int
kv_pfx_node(kv_pfx_t *x, const char *id, const char *http_addr,
    const char *model)
{
    int              i;
    uint32_t         k;
    uint64_t         now;
    dpd_pfx_node_t  *r;

    pfx_check(x);
    if (strlen(id) >= DPD_PFX_ID_LEN
        || strlen(http_addr) >= DPD_PFX_ADDR_LEN
        || strlen(model) >= sizeof(x->node[0].model))
    {
        return -1;
    }
    if (x->nnodes < x->hdr->max_nodes) {
        x->node[x->nnodes].recent = calloc(PFX_RECENT, sizeof(pfx_recent_t));
        if (x->node[x->nnodes].recent == NULL) {
            return -1;
        }
        i = (int) x->nnodes++;

    } else {
        /*
         * A released record, the one released longest ago, and only once
         * every reader has had time to re-read the node table (the module
         * does at most once a second, before a lookup): a reader that
         * still maps the old engine's address to this index would credit
         * it with the new engine's blocks for that long.  Its bits are
         * all cleared already (kv_pfx_node_release()).
         */
        now = kv_now_ms();
        i = -1;
        for (k = 0; k < x->nnodes; k++) {
            if (x->node[k].released
                && now - x->node[k].released_ms >= KV_PFX_REUSE_MS
                && (i < 0 || x->node[k].released_ms
                             < x->node[i].released_ms))
            {
                i = (int) k;
            }
        }
        if (i < 0) {
            return -1;
        }
        x->node[i].released = 0;
        x->node[i].gpu_blocks = 0;
        x->node[i].lower_blocks = 0;
        x->node[i].nrecent = 0;
        x->node[i].overflow = 0;
    }
    snprintf(x->node[i].model, sizeof(x->node[i].model), "%s", model);
    x->node[i].model_len = strlen(model);
    snprintf(x->node[i].id, sizeof(x->node[i].id), "%s", id);
    snprintf(x->node[i].http, sizeof(x->node[i].http), "%s", http_addr);

    r = &x->nodes[i];
    seq_begin(&r->seq);
    memset(r->id, 0, sizeof(r->id));
    memset(r->http_addr, 0, sizeof(r->http_addr));
    snprintf(r->id, sizeof(r->id), "%s", id);
    snprintf(r->http_addr, sizeof(r->http_addr), "%s", http_addr);
    r->flags = DPD_PFX_NODE_USED | DPD_PFX_NODE_READY;
    r->blocks = 0;
    r->lower_blocks = 0;
    r->updated_ms = kv_wall_ms();
    seq_end(&r->seq);
    return i;
}


int
kv_pfx_node_free(const kv_pfx_t *x)
{
    uint32_t  k;
    uint64_t  now;
    int       n;

    n = (int) (x->hdr->max_nodes - x->nnodes);
    now = kv_now_ms();
    for (k = 0; k < x->nnodes; k++) {
        n += x->node[k].released
             && now - x->node[k].released_ms >= KV_PFX_REUSE_MS;
    }
    return n;
}


uint64_t
kv_pfx_node_release(kv_pfx_t *x, int node)
{
    uint64_t         held;
    dpd_pfx_node_t  *r;

    if (node < 0 || (uint32_t) node >= x->nnodes || x->node[node].released)
    {
        return 0;
    }
    held = kv_pfx_node_clear(x, node);

    /* readers skip a record without USED: the address is no longer any
     * node's, and nothing of it is left in the slots */
    r = &x->nodes[node];
    seq_begin(&r->seq);
    r->flags = 0;
    r->epoch++;
    memset(r->id, 0, sizeof(r->id));
    memset(r->http_addr, 0, sizeof(r->http_addr));
    r->updated_ms = kv_wall_ms();
    seq_end(&r->seq);
    x->node[node].released = 1;
    x->node[node].released_ms = kv_now_ms();
    return held;
}


uint64_t
kv_pfx_node_clear(kv_pfx_t *x, int node)
{
    uint64_t         i, bit, held;
    pfx_node_t      *nd;
    pfx_map_ent_t   *e;
    dpd_pfx_node_t  *r;
    dpd_pfx_slot_t  *s;

    pfx_check(x);
    if (node < 0 || (uint32_t) node >= x->nnodes
        || x->node[node].released)
    {
        return 0;
    }
    bit = UINT64_C(1) << node;
    r = &x->nodes[node];
    nd = &x->node[node];
    held = nd->gpu_blocks + nd->lower_blocks;
    x->st.cleared++;

    /*
     * Nothing held, nothing to scan: the node's live map entries are
     * exactly its counted blocks and only they set its slot bits.  A
     * batch may carry 65536 AllBlocksCleared (a restart storm as many
     * messages): a full scan each (~1.7 ms for the default 1M slots)
     * would hold the loop for minutes.
     */
    if (held == 0) {
        nd->nrecent = 0;               /* all of them removed since */
        nd->overflow = 0;
        seq_begin(&r->seq);
        r->epoch++;
        seq_end(&r->seq);
        return 0;
    }

    /* not READY while its bits go: readers ignore it meanwhile */
    seq_begin(&r->seq);
    r->flags &= ~DPD_PFX_NODE_READY;
    r->epoch++;
    seq_end(&r->seq);

    if (!nd->overflow) {
        /* every live entry of the node is among its recent ids: a store
         * and a clear, repeated, cost what they carry, not a scan */
        for (i = 0; i < nd->nrecent; i++) {
            e = map_find(x, node, nd->recent[i].eid, nd->recent[i].lower);
            if (e == NULL) {
                continue;              /* removed since, or a repeat */
            }
            if (e->key != 0) {
                (void) slot_update(x, e->key, bit, e->lower, 0);
            }
            map_del(x, e);
        }

    } else {
        for (i = 0; i <= x->smask; i++) {
            s = &x->slots[i];
            if ((s->gpu_mask | s->lower_mask) & bit) {
                seq_begin(&s->seq);
                s->gpu_mask &= ~bit;
                s->lower_mask &= ~bit;
                seq_end(&s->seq);
            }
        }
        for (i = 0; i <= x->emask; i++) {
            if (x->ents[i].state == PFX_MAP_USED
                && x->ents[i].node == node)
            {
                map_del(x, &x->ents[i]);
            }
        }
    }
    nd->nrecent = 0;
    nd->overflow = 0;
    x->node[node].gpu_blocks = 0;
    x->node[node].lower_blocks = 0;

    seq_begin(&r->seq);
    r->flags |= DPD_PFX_NODE_READY;
    r->blocks = 0;
    r->lower_blocks = 0;
    r->updated_ms = kv_wall_ms();
    seq_end(&r->seq);
    return held;
}


void
kv_pfx_stored(kv_pfx_t *x, int node, const kv_pfx_stored_t *ev)
{
    if (node < 0 || (uint32_t) node >= x->nnodes) {
        return;
    }
    kv_pfx_stored_seeded(x, node, ev, x->node[node].model,
                         x->node[node].model_len);
}


void
kv_pfx_stored_seeded(kv_pfx_t *x, int node, const kv_pfx_stored_t *ev,
    const char *model, size_t model_len)
{
    size_t          k, B;
    uint64_t        parent, key, bit;
    pfx_node_t     *nd;
    pfx_map_ent_t  *e;

    pfx_check(x);
    if (node < 0 || (uint32_t) node >= x->nnodes || ev->nblocks == 0
        || x->node[node].released)
    {
        return;
    }
    nd = &x->node[node];
    B = ev->block_size;

    if (B != x->hdr->block_size || ev->ntokens != ev->nblocks * B) {
        x->st.bad_size += ev->nblocks;
        if (kv_log_limit(&x->lim)) {
            kv_warn("prefix index: node %d: BlockStored with block size "
                    "%zu and %zu tokens for %zu blocks (the index keys "
                    "blocks of %u): not indexed", node, B, ev->ntokens,
                    ev->nblocks, x->hdr->block_size);
        }
        return;
    }

    if (ev->has_parent) {
        e = map_find(x, node, ev->parent_id, ev->lower_tier);
        if (e == NULL && ev->lower_tier) {
            /* a lower tier's block may chain on a GPU parent */
            e = map_find(x, node, ev->parent_id, 0);
        }
        if (e == NULL) {
            /* its parent was stored before we listened, or dropped: its
             * keys cannot be computed; a later prompt recomputes them */
            x->st.orphans += ev->nblocks;
            return;
        }
        parent = e->key;
    } else {
        parent = dpd_prefix_salted(dpd_prefix_seed(model, model_len,
                                                   ev->lora, ev->lora_len),
                                   ev->salt, ev->salt_len);
    }

    bit = UINT64_C(1) << node;

    for (k = 0; k < ev->nblocks; k++) {
        key = dpd_prefix_block_key(parent, ev->tokens + k * B, B);
        parent = key;

        e = map_put(x, node, ev->ids[k], ev->lower_tier);
        if (e == NULL) {
            x->st.full += ev->nblocks - k;
            if (kv_log_limit(&x->lim)) {
                kv_warn("prefix index: id map full (%llu entries): blocks "
                        "not indexed", (unsigned long long) x->cap);
            }
            break;
        }
        if (e->key != 0 && e->key != key) {
            /* the engine reused the id for other content: the old bit */
            (void) slot_update(x, e->key, bit, e->lower, 0);
            if (e->lower) {
                nd->lower_blocks--;
            } else {
                nd->gpu_blocks--;
            }
            e->key = 0;
        }
        if (e->key == key) {
            continue;                  /* stored twice: already indexed */
        }
        if (slot_update(x, key, bit, ev->lower_tier, 1) != 0) {
            map_del(x, e);
            x->st.full++;
            if (kv_log_limit(&x->lim)) {
                kv_warn("prefix index: no free slot in %u probes (%llu "
                        "slots): block not indexed", x->hdr->max_probe,
                        (unsigned long long) x->smask + 1);
            }
            continue;
        }
        e->key = key;
        if (e->lower) {
            nd->lower_blocks++;
        } else {
            nd->gpu_blocks++;
        }
        x->st.stored++;
        if (nd->nrecent < PFX_RECENT) {
            nd->recent[nd->nrecent].eid = ev->ids[k];
            nd->recent[nd->nrecent].lower = (uint8_t) !!ev->lower_tier;
            nd->nrecent++;
        } else {
            nd->overflow = 1;
        }
    }
    node_publish(x, node);
}


void
kv_pfx_removed(kv_pfx_t *x, int node, const uint64_t *ids, size_t n,
    int lower_tier)
{
    size_t          k;
    uint64_t        bit;
    pfx_map_ent_t  *e;

    pfx_check(x);
    if (node < 0 || (uint32_t) node >= x->nnodes
        || x->node[node].released)
    {
        return;
    }
    bit = UINT64_C(1) << node;

    for (k = 0; k < n; k++) {
        e = map_find(x, node, ids[k], lower_tier);
        if (e == NULL) {
            /* never stored, or stored before we listened */
            x->st.unknown_removed++;
            continue;
        }
        if (e->key != 0) {
            (void) slot_update(x, e->key, bit, e->lower, 0);
            if (e->lower) {
                x->node[node].lower_blocks--;
            } else {
                x->node[node].gpu_blocks--;
            }
            x->st.removed++;
        }
        map_del(x, e);
    }
    node_publish(x, node);
}


const kv_pfx_stats_t *
kv_pfx_stats(const kv_pfx_t *x)
{
    return &x->st;
}


uint64_t
kv_pfx_node_blocks(const kv_pfx_t *x, int node)
{
    if (node < 0 || (uint32_t) node >= x->nnodes) {
        return 0;
    }
    return x->node[node].gpu_blocks;
}
