/*
 * fabric.c - libfabric rails: one RDM endpoint (with its own fabric,
 * domain, CQ and AV) per configured NIC/domain.
 *
 * We ask for the API version of the headers we are built with (older
 * requests leave features off on newer providers), advertise every mr_mode
 * bit we handle, and log the provider, fabric and domain actually chosen so
 * a silent fall-back (e.g. EFA -> TCP) is visible; the config can forbid it.
 *
 * API levels (the headers decide what compiles; Debian ships 1.17, AWS's
 * EFA installer 1.18 and later, 2.x):
 *   >= 1.18  EFA endpoints: FI_OPT_EFA_USE_DEVICE_RDMA on (the NIC's RDMA
 *            write, not the emulated protocol), FI_OPT_EFA_EMULATED_WRITE
 *            read back and logged;
 *   >= 2.0   FI_OPT_MAX_RMA_SIZE (the split size of writes, else
 *            ep_attr->max_msg_size); FI_OPT_SHARED_MEMORY_PERMITTED off on
 *            EFA (peers are other nodes; EFA's shm path is what refuses CQ
 *            wait fds), so the CQ can sleep on an fd.
 */

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kv.h"
#include <rdma/fi_ext.h>

#define KV_FI_API FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION)


const char *
kv_fi_err(int rc)
{
    return fi_strerror(rc < 0 ? -rc : rc);
}


static struct fi_info *
make_hints(const char *provider, const char *domain, int want_hmem, int dc)
{
    struct fi_info *h = fi_allocinfo();

    if (h == NULL) {
        return NULL;
    }
    h->ep_attr->type = FI_EP_RDM;
    h->caps = FI_RMA | FI_MSG | FI_WRITE | FI_REMOTE_WRITE | FI_SEND
              | FI_RECV;
    if (want_hmem) {
        h->caps |= FI_HMEM;
    }
    h->mode = FI_CONTEXT | FI_CONTEXT2;
    h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR
                              | FI_MR_ALLOCATED | FI_MR_PROV_KEY
                              | FI_MR_ENDPOINT
                              | (want_hmem ? FI_MR_HMEM : 0);
    h->domain_attr->threading = FI_THREAD_DOMAIN;
    h->domain_attr->av_type = FI_AV_TABLE;
    if (dc) {
        h->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    }
    if (provider && provider[0] && strcmp(provider, "auto") != 0) {
        h->fabric_attr->prov_name = strdup(provider);
    }
    if (domain && domain[0]) {
        h->domain_attr->name = strdup(domain);
    }
    return h;
}


/* Keep the entry whose domain is `domain` (layered providers such as
 * ofi_rxm do not filter on a domain-name hint): the exact name first,
 * else the same NIC under EFA's other spelling ("rdmap16s27" is the
 * domain "rdmap16s27-rdm", and the reverse). */
static int
pick_domain(struct fi_info **list, const char *domain)
{
    struct fi_info *i, *found = NULL;
    int m, best = 0;

    for (i = *list; i; i = i->next) {
        if (i->domain_attr && i->domain_attr->name
            && (m = kv_rail_name_match(domain, i->domain_attr->name)) > best)
        {
            found = i;
            best = m;
            if (m == 2) {
                break;
            }
        }
    }
    found = found ? fi_dupinfo(found) : NULL;
    fi_freeinfo(*list);
    *list = found;
    return found ? 0 : -FI_ENODATA;
}


/* The distinct domain names the provider offers (RDM, RMA), in its order:
 * the candidates of rails "auto". */
int
kv_fabric_domains(const char *provider, char names[][64], int max)
{
    struct fi_info *hints, *list = NULL, *i;
    int n = 0, k, dup;

    hints = make_hints(provider, NULL, 0, 0);
    if (hints == NULL) {
        return 0;
    }
    if (fi_getinfo(KV_FI_API, NULL, NULL, 0, hints, &list) != 0) {
        fi_freeinfo(hints);
        return 0;
    }
    fi_freeinfo(hints);
    for (i = list; i && n < max; i = i->next) {
        if (!i->domain_attr || !i->domain_attr->name
            || strlen(i->domain_attr->name) >= 64)
        {
            continue;
        }
        for (k = 0, dup = 0; k < n; k++) {
            dup |= strcmp(names[k], i->domain_attr->name) == 0;
        }
        if (!dup) {
            snprintf(names[n++], 64, "%s", i->domain_attr->name);
        }
    }
    fi_freeinfo(list);
    return n;
}


/* fi_getinfo with delivery-complete first, then without. */
static int
get_info(const char *provider, const char *domain, int want_hmem,
    struct fi_info **out, int *dc)
{
    struct fi_info *hints;
    int rc = -FI_ENODATA, pass;

    for (pass = 0; pass < 2; pass++) {
        hints = make_hints(provider, NULL, want_hmem, pass == 0);
        if (hints == NULL) {
            return -FI_ENOMEM;
        }
        rc = fi_getinfo(KV_FI_API, NULL, NULL, 0, hints, out);
        fi_freeinfo(hints);
        if (rc == 0 && domain && domain[0]) {
            rc = pick_domain(out, domain);
        }
        if (rc == 0) {
            *dc = (pass == 0);
            return 0;
        }
    }
    return rc;
}


static void
mr_mode_str(uint64_t m, char *buf, size_t len)
{
    snprintf(buf, len, "%s%s%s%s%s%s%s",
             (m & FI_MR_LOCAL) ? "LOCAL," : "",
             (m & FI_MR_VIRT_ADDR) ? "VIRT_ADDR," : "",
             (m & FI_MR_ALLOCATED) ? "ALLOCATED," : "",
             (m & FI_MR_PROV_KEY) ? "PROV_KEY," : "",
             (m & FI_MR_ENDPOINT) ? "ENDPOINT," : "",
             (m & FI_MR_HMEM) ? "HMEM," : "",
             (m & FI_MR_RAW) ? "RAW," : "");
    if (buf[0]) {
        buf[strlen(buf) - 1] = '\0';
    } else {
        snprintf(buf, len, "none");
    }
}


/* Endpoint options of the newer API levels, before fi_enable (EFA reads
 * them there).  A refusal is logged, never fatal. */
static int
ep_options(kv_rail_t *r)
{
    const char *prov = r->info->fabric_attr->prov_name;
    int efa = prov && strcmp(prov, "efa") == 0;

    (void) efa;
#if FI_VERSION_GE(KV_FI_API, FI_VERSION(1, 18))
    if (efa) {
        bool on = true, emulated = false;
        size_t len = sizeof(emulated);
        int rc;

        rc = fi_setopt(&r->ep->fid, FI_OPT_ENDPOINT,
                       FI_OPT_EFA_USE_DEVICE_RDMA, &on, sizeof(on));
        if (rc != 0) {
            kv_warn("fabric: rail %d: FI_OPT_EFA_USE_DEVICE_RDMA refused: "
                    "%s", r->index, kv_fi_err(rc));
        }
        if (fi_getopt(&r->ep->fid, FI_OPT_ENDPOINT,
                      FI_OPT_EFA_EMULATED_WRITE, &emulated, &len) == 0)
        {
            r->emulated_write = emulated ? 1 : 0;
            if (emulated) {
                kv_warn("fabric: rail %d: this EFA device emulates RDMA "
                        "writes (messages): expect a fraction of its "
                        "bandwidth", r->index);
            }
        }
    }
#endif
#if FI_VERSION_GE(KV_FI_API, FI_VERSION(2, 0))
    if (efa) {
        bool off = false;
        int rc = fi_setopt(&r->ep->fid, FI_OPT_ENDPOINT,
                           FI_OPT_SHARED_MEMORY_PERMITTED, &off, sizeof(off));
        if (rc != 0) {
            kv_info("fabric: rail %d: FI_OPT_SHARED_MEMORY_PERMITTED: %s",
                    r->index, kv_fi_err(rc));
        }
    }
#endif
    return 0;
}


static int
rail_open(kv_rail_t *r, const char *provider, int allow_fallback,
    const char *domain, int want_hmem)
{
    struct fi_cq_attr cqa;
    struct fi_av_attr ava;
    char modes[128];
    size_t optlen;
    int rc, dc = 0;

    rc = get_info(provider, domain, want_hmem, &r->info, &dc);
    if (rc != 0 && want_hmem) {
        /* no FI_HMEM: GPU pools are staged through pinned host memory */
        kv_warn("fabric: provider %s has no FI_HMEM here (%s); GPU memory "
                "will be staged through host buffers", provider,
                kv_fi_err(rc));
        want_hmem = 0;
        rc = get_info(provider, domain, 0, &r->info, &dc);
    }
    if (rc != 0 && strcmp(provider, "auto") != 0) {
        if (!allow_fallback) {
            kv_err("fabric: provider \"%s\"%s%s not available: %s "
                   "(fall-back forbidden by config)", provider,
                   domain ? " domain " : "", domain ? domain : "",
                   kv_fi_err(rc));
            return -1;
        }
        kv_warn("fabric: provider \"%s\" not available (%s); falling back "
                "to any provider", provider, kv_fi_err(rc));
        rc = get_info("auto", domain, want_hmem, &r->info, &dc);
    }
    if (rc != 0) {
        kv_err("fabric: no RDM provider with FI_RMA|FI_MSG%s: %s",
               domain ? " on that domain" : "", kv_fi_err(rc));
        return -1;
    }
    r->mr_mode = r->info->domain_attr->mr_mode;
    r->delivery_complete = dc;
    r->hmem = want_hmem && (r->info->caps & FI_HMEM);
    if (r->mr_mode & FI_MR_RAW) {
        kv_err("fabric: provider %s needs FI_MR_RAW keys (unsupported)",
               r->info->fabric_attr->prov_name);
        return -1;
    }

    rc = fi_fabric(r->info->fabric_attr, &r->fabric, NULL);
    if (rc == 0) {
        rc = fi_domain(r->fabric, r->info, &r->domain, NULL);
    }
    if (rc != 0) {
        kv_err("fabric: fi_fabric/fi_domain: %s", kv_fi_err(rc));
        return -1;
    }
    memset(&cqa, 0, sizeof(cqa));
    cqa.format = FI_CQ_FORMAT_DATA;
    /* a wait object lets an idle side sleep in fi_cq_sread / poll()
     * instead of spinning against its peer for the CPU */
    cqa.wait_obj = getenv("KV_CQ_SPIN") ? FI_WAIT_NONE : FI_WAIT_FD;
    cqa.size = r->info->tx_attr->size + r->info->rx_attr->size;
    if (cqa.size < 1024) {
        cqa.size = 1024;
    }
    memset(&ava, 0, sizeof(ava));
    ava.type = FI_AV_TABLE;
    ava.count = 256;      /* a hint; shm refuses more than its peers */
    r->cq_fd = -1;
    rc = fi_cq_open(r->domain, &cqa, &r->cq, NULL);
    if (rc == 0 && cqa.wait_obj == FI_WAIT_FD
        && fi_control(&r->cq->fid, FI_GETWAIT, &r->cq_fd) != 0)
    {
        r->cq_fd = -1;
    }
    if (rc != 0 && cqa.wait_obj != FI_WAIT_NONE) {
        /* e.g. shm: no wait objects; the loop then polls the CQ */
        cqa.wait_obj = FI_WAIT_NONE;
        rc = fi_cq_open(r->domain, &cqa, &r->cq, NULL);
    }
    if (rc != 0
        || (rc = fi_av_open(r->domain, &ava, &r->av, NULL)) != 0
        || (rc = fi_endpoint(r->domain, r->info, &r->ep, NULL)) != 0
        || (rc = ep_options(r)) != 0
        || (rc = fi_ep_bind(r->ep, &r->cq->fid, FI_TRANSMIT | FI_RECV)) != 0
        || (rc = fi_ep_bind(r->ep, &r->av->fid, 0)) != 0
        || (rc = fi_enable(r->ep)) != 0)
    {
        kv_err("fabric: endpoint setup: %s", kv_fi_err(rc));
        return -1;
    }
    r->addrlen = sizeof(r->addr);
    rc = fi_getname(&r->ep->fid, r->addr, &r->addrlen);
    if (rc != 0) {
        kv_err("fabric: fi_getname: %s", kv_fi_err(rc));
        return -1;
    }

    /* the largest single RMA the endpoint takes; writes are split at it */
    r->max_rma = r->info->ep_attr->max_msg_size;
#if FI_VERSION_GE(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), \
                  FI_VERSION(2, 0))
    {
        size_t v = 0;
        optlen = sizeof(v);
        if (fi_getopt(&r->ep->fid, FI_OPT_ENDPOINT, FI_OPT_MAX_RMA_SIZE, &v,
                      &optlen) == 0 && v > 0)
        {
            r->max_rma = v;
        }
    }
#else
    (void) optlen;
#endif
    if (r->max_rma == 0) {
        r->max_rma = 1u << 20;
    }
    r->next_key = 1;
    kv_topo_nic_pci(r->info->domain_attr->name, r->pci, sizeof(r->pci));

    mr_mode_str(r->mr_mode, modes, sizeof(modes));
    kv_info("fabric: rail %d: provider %s, fabric %s, domain %s, api %d.%d "
            "(headers %d.%d, requested %d.%d), mr_mode %s, max_rma %llu, "
            "delivery_complete %s, hmem %s, cq wait fd %s", r->index,
            r->info->fabric_attr->prov_name, r->info->fabric_attr->name,
            r->info->domain_attr->name, FI_MAJOR(fi_version()),
            FI_MINOR(fi_version()), FI_MAJOR_VERSION, FI_MINOR_VERSION,
            FI_MAJOR(KV_FI_API), FI_MINOR(KV_FI_API), modes, (unsigned long long) r->max_rma,
            dc ? "yes" : "no (trailing message after transmit-complete)",
            r->hmem ? "yes" : "no", r->cq_fd >= 0 ? "yes" : "no (polling)");
    return 0;
}


int
kv_fabric_open(kv_fabric_t *f, const char *provider, int allow_fallback,
    char rails[][64], int nrails, int want_hmem)
{
    int i, n = nrails > 0 ? nrails : 1;

    memset(f, 0, sizeof(*f));
    kv_fault_init();
    /* fi_av_remove must close the provider's connection to that peer
     * (rxm keeps it otherwise, and a write it half received would still
     * land after the peer was removed and its quarantine ended); read by
     * libfabric once, at its first call */
    if (setenv("FI_AV_REMOVE_CLEANUP", "1", 1) != 0) {
        kv_warn("fabric: cannot set FI_AV_REMOVE_CLEANUP");
    }
    snprintf(f->provider, sizeof(f->provider), "%s", provider);
    f->allow_fallback = allow_fallback;
    f->want_hmem = want_hmem;
    for (i = 0; i < n; i++) {
        f->rail[i].index = i;
        if (rail_open(&f->rail[i], provider, allow_fallback,
                      nrails > 0 ? rails[i] : NULL, want_hmem) != 0)
        {
            f->nrails = i + 1;
            kv_fabric_close(f);
            return -1;
        }
        f->nrails = i + 1;
    }
    return 0;
}


static void
close_fid(struct fid *fid)
{
    if (fid) {
        fi_close(fid);
    }
}


void
kv_fabric_close(kv_fabric_t *f)
{
    kv_rail_t *r;
    int i;

    for (i = 0; i < f->nrails; i++) {
        r = &f->rail[i];
        close_fid(r->ep ? &r->ep->fid : NULL);
        close_fid(r->pool_mr ? &r->pool_mr->fid : NULL);
        close_fid(r->msg_mr ? &r->msg_mr->fid : NULL);
        close_fid(r->av ? &r->av->fid : NULL);
        close_fid(r->cq ? &r->cq->fid : NULL);
        close_fid(r->domain ? &r->domain->fid : NULL);
        close_fid(r->fabric ? &r->fabric->fid : NULL);
        if (r->info) {
            fi_freeinfo(r->info);
        }
        free(r->msgbuf);
        memset(r, 0, sizeof(*r));
    }
    f->nrails = 0;
}


int
kv_rail_reg(kv_rail_t *r, void *buf, size_t len, int cuda_dev,
    uint64_t access, struct fid_mr **mr, void **desc, uint64_t *key)
{
    struct fi_mr_attr attr;
    struct iovec iov;
    int rc;

    memset(&attr, 0, sizeof(attr));
    iov.iov_base = buf;
    iov.iov_len = len;
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = access;
    attr.requested_key = r->next_key++;
    attr.iface = FI_HMEM_SYSTEM;
    if (cuda_dev >= 0) {
        attr.iface = FI_HMEM_CUDA;
        attr.device.cuda = cuda_dev;
    }
    rc = fi_mr_regattr(r->domain, &attr, 0, mr);
    if (rc != 0) {
        kv_err("fabric: rail %d: registering %zu bytes failed: %s", r->index,
               len, kv_fi_err(rc));
        return -1;
    }
    if (r->mr_mode & FI_MR_ENDPOINT) {
        if ((rc = fi_mr_bind(*mr, &r->ep->fid, 0)) != 0
            || (rc = fi_mr_enable(*mr)) != 0)
        {
            kv_err("fabric: rail %d: binding MR: %s", r->index,
                   kv_fi_err(rc));
            fi_close(&(*mr)->fid);
            *mr = NULL;
            return -1;
        }
    }
    *desc = fi_mr_desc(*mr);
    *key = fi_mr_key(*mr);
    if (*key == FI_KEY_NOTAVAIL) {
        kv_err("fabric: rail %d: provider returned no MR key", r->index);
        fi_close(&(*mr)->fid);
        *mr = NULL;
        return -1;
    }
    return 0;
}


/* The address a peer must use for byte `off` of a region we registered at
 * base: virtual addresses with FI_MR_VIRT_ADDR, offsets without. */
uint64_t
kv_rail_raddr(const kv_rail_t *r, const void *base, uint64_t off)
{
    if (r->mr_mode & FI_MR_VIRT_ADDR) {
        return (uint64_t) (uintptr_t) base + off;
    }
    return off;
}


/*
 * Test-only fault injection (environment KV_TEST_FAULT, comma-separated):
 *   cq_readerr:N  the next N CQ reads on rail 0 report an error entry that
 *                 fi_cq_readerr then fails to return (-FI_EAGAIN)
 *   short_addr    advertise our fabric address one byte short (ctrl.c)
 */
static long kv_fault_cq_readerr;
static int  kv_fault_err_now;


void
kv_fault_init(void)
{
    const char *f = getenv("KV_TEST_FAULT"), *p;

    if (f == NULL || f[0] == '\0') {
        return;
    }
    if ((p = strstr(f, "cq_readerr:")) != NULL) {
        kv_fault_cq_readerr = strtol(p + 11, NULL, 10);
    }
    if (strstr(f, "short_addr")) {
        kv_fault_short_addr = 1;
    }
    kv_warn("fabric: test faults injected: %s", f);
}


ssize_t
kv_rail_cq_read(kv_rail_t *r, struct fi_cq_data_entry *ce, size_t n)
{
    if (kv_fault_cq_readerr > 0 && r->index == 0) {
        kv_fault_cq_readerr--;
        kv_fault_err_now = 1;
        return -FI_EAVAIL;
    }
    return fi_cq_read(r->cq, ce, n);
}


/* At most a few warnings a second per rail; the rest are counted. */
static int
cq_warn_ok(kv_rail_t *r)
{
    static uint64_t window_ms[KV_MAX_RAILS];
    static uint32_t count[KV_MAX_RAILS], dropped[KV_MAX_RAILS];
    uint64_t now = kv_now_ms();
    int i = r->index;

    if (now >= window_ms[i] + 1000) {
        if (dropped[i]) {
            kv_warn("fabric: rail %d: %u more completion error(s) not "
                    "logged", i, dropped[i]);
        }
        window_ms[i] = now;
        count[i] = dropped[i] = 0;
    }
    if (count[i] < 8) {
        count[i]++;
        return 1;
    }
    dropped[i]++;
    return 0;
}


/*
 * Read one error entry after fi_cq_read said -FI_EAVAIL.  1: *e holds it
 * (logged at warn with the provider's own description); -1: it could not
 * be read: the caller stops draining this CQ for this turn (the entry is
 * retried on the next one) instead of asking again in a loop.
 */
int
kv_rail_cq_error(kv_rail_t *r, struct fi_cq_err_entry *e)
{
    char buf[256];
    const char *ps;
    ssize_t rc;

    memset(e, 0, sizeof(*e));
    if (kv_fault_err_now) {
        kv_fault_err_now = 0;
        rc = -FI_EAGAIN;
    } else {
        rc = fi_cq_readerr(r->cq, e, 0);
    }
    if (rc < 0 || rc == 0) {
        if (cq_warn_ok(r)) {
            kv_warn("fabric: rail %d: a completion error could not be "
                    "read: %s", r->index, rc < 0 ? kv_fi_err((int) rc)
                                                 : "no entry");
        }
        return -1;
    }
    if (cq_warn_ok(r)) {
        buf[0] = '\0';
        ps = fi_cq_strerror(r->cq, e->prov_errno, e->err_data, buf,
                            sizeof(buf));
        kv_warn("fabric: rail %d: completion error: %s (provider %s: %s)",
                r->index, kv_fi_err(e->err ? e->err : FI_EIO),
                r->info->fabric_attr->prov_name,
                ps && ps[0] ? ps : "no detail");
    }
    return 1;
}
