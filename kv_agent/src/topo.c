/*
 * topo.c - which NICs (rails) serve which GPU (rank), from the PCIe tree.
 *
 * A p5.48xlarge has 8 H100 and 32 EFA NICs, four NICs under each GPU's
 * PCIe switch: a GPU's KV goes out fastest (and without crossing the root
 * complex) on those four.  sysfs says where every device hangs:
 * /sys/class/infiniband/<dev>/device and /sys/class/net/<dev>/device are
 * links into /sys/devices/pciDDDD:BB/<bridge>/<bridge>/.../<function>, and
 * GPUs are the PCI functions of vendor 0x10de, class 0x0300xx or 0x0302xx.
 * The rails of a GPU are the NICs that share the most PCIe ancestors with
 * it (the switch on a p5; the root port or the host bridge on smaller
 * nodes).  Rank r's GPU is the device of its pool (cudaDeviceGetPCIBusId)
 * or, for host pools, the r-th GPU in PCI bus order (CUDA_DEVICE_ORDER=
 * PCI_BUS_ID).  Without GPUs or NIC positions in sysfs every rank uses
 * every rail.  KV_SYSFS_ROOT prefixes every sysfs path (tests use fake
 * trees).  No libhwloc: sysfs has all this needs.
 */

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef KV_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include <cjson/cJSON.h>

#include "kv.h"


static const char *
sysfs_root(void)
{
    const char *r = getenv("KV_SYSFS_ROOT");

    return r ? r : "";
}


/* "rdmap16s27-rdm" (libfabric's EFA RDM domain) -> "rdmap16s27" */
static void
domain_device(const char *domain, char *out, size_t len)
{
    size_t n = strlen(domain);

    snprintf(out, len, "%s", domain);
    if (n > 4 && strcmp(domain + n - 4, "-rdm") == 0 && n - 4 < len) {
        out[n - 4] = '\0';
    } else if (n > 5 && strcmp(domain + n - 5, "-dgrm") == 0 && n - 5 < len)
    {
        out[n - 5] = '\0';
    }
}


/*
 * A configured rail name and a provider's domain name mean the same NIC:
 * equal, or equal once EFA's "-rdm" suffix is taken off either ("the NIC
 * rdmap16s27" is the domain "rdmap16s27-rdm").
 */
int
kv_rail_name_match(const char *want, const char *domain)
{
    char a[64], b[64];

    if (strcmp(want, domain) == 0) {
        return 2;                         /* exact */
    }
    domain_device(want, a, sizeof(a));
    domain_device(domain, b, sizeof(b));
    return strcmp(a, b) == 0 ? 1 : 0;
}


static int
resolve(const char *path, char *out, size_t len)
{
    char buf[PATH_MAX];

    if (realpath(path, buf) == NULL || strlen(buf) >= len) {
        return -1;
    }
    snprintf(out, len, "%s", buf);
    return 0;
}


/* The sysfs PCI path of the NIC behind a domain name, or -1. */
int
kv_topo_nic_pci(const char *domain, char *out, size_t len)
{
    static const char *const cls[] = { "infiniband", "net", NULL };
    char dev[64], path[PATH_MAX];
    int i;

    out[0] = '\0';
    domain_device(domain, dev, sizeof(dev));
    if (dev[0] == '\0' || strchr(dev, '/') || strcmp(dev, "..") == 0) {
        return -1;
    }
    for (i = 0; cls[i]; i++) {
        snprintf(path, sizeof(path), "%s/sys/class/%s/%s/device",
                 sysfs_root(), cls[i], dev);
        if (resolve(path, out, len) == 0) {
            return 0;
        }
    }
    out[0] = '\0';
    return -1;
}


static int
read_hex(const char *dir, const char *file, unsigned long *v)
{
    char path[PATH_MAX], buf[32];
    FILE *f;
    int ok;

    snprintf(path, sizeof(path), "%s/%s", dir, file);
    f = fopen(path, "r");
    if (f == NULL) {
        return -1;
    }
    ok = fgets(buf, sizeof(buf), f) != NULL;
    fclose(f);
    if (!ok) {
        return -1;
    }
    *v = strtoul(buf, NULL, 16);
    return 0;
}


static int
cmp_str(const void *a, const void *b)
{
    return strcmp((const char *) a, (const char *) b);
}


/* NVIDIA GPUs in PCI bus order (their sysfs paths); returns the count. */
int
kv_topo_gpus(char out[][KV_PATH_LEN], int max)
{
    char dir[PATH_MAX - 128], dev[PATH_MAX];
    char (*names)[64];
    struct dirent *e;
    unsigned long vendor, cls;
    int n = 0, k = 0, i;
    DIR *d;

    snprintf(dir, sizeof(dir), "%s/sys/bus/pci/devices", sysfs_root());
    d = opendir(dir);
    if (d == NULL) {
        return 0;
    }
    names = calloc(1024, sizeof(*names));
    if (names == NULL) {
        closedir(d);
        return 0;
    }
    while ((e = readdir(d)) != NULL && n < 1024) {
        if (e->d_name[0] == '.' || strlen(e->d_name) >= 64) {
            continue;
        }
        snprintf(dev, sizeof(dev), "%s/%s", dir, e->d_name);
        if (read_hex(dev, "vendor", &vendor) != 0 || vendor != 0x10de
            || read_hex(dev, "class", &cls) != 0
            || ((cls >> 8) != 0x0300 && (cls >> 8) != 0x0302))
        {
            continue;
        }
        snprintf(names[n++], 64, "%s", e->d_name);
    }
    closedir(d);
    /* "dddd:bb:dd.f" is fixed-width hex: text order is bus order */
    qsort(names, n, sizeof(*names), cmp_str);
    for (i = 0; i < n && k < max; i++) {
        snprintf(dev, sizeof(dev), "%s/%s", dir, names[i]);
        if (resolve(dev, out[k], KV_PATH_LEN) == 0) {
            k++;
        }
    }
    free(names);
    return k;
}


/* PCIe ancestors two devices share (components after "/devices/"). */
static int
common_depth(const char *a, const char *b)
{
    const char *pa = strstr(a, "/devices/"), *pb = strstr(b, "/devices/");
    int depth = 0;

    if (pa == NULL || pb == NULL) {
        return -1;
    }
    pa += 9;
    pb += 9;
    for (;;) {
        size_t la = strcspn(pa, "/"), lb = strcspn(pb, "/");
        if (la == 0 || la != lb || memcmp(pa, pb, la) != 0) {
            break;
        }
        depth++;
        pa += la;
        pb += lb;
        if (*pa != '/' || *pb != '/') {
            break;
        }
        pa++;
        pb++;
    }
    return depth;
}


/*
 * Rails per rank.  A rank whose GPU is known takes the NICs that share the
 * most PCIe ancestors with it (ties: all of them); a rank whose GPU is not
 * known, or a node where no NIC position is known, takes every rail.
 */
void
kv_topo_assign(kv_topo_t *t, int nranks, char gpus[][KV_PATH_LEN],
    char pcis[][KV_PATH_LEN], int nnames)
{
    int r, i, d, best, nic_any = 0;

    memset(t, 0, sizeof(*t));
    t->nranks = nranks;
    for (i = 0; i < nnames; i++) {
        nic_any |= pcis[i][0] != '\0';
    }
    for (r = 0; r < nranks; r++) {
        snprintf(t->gpu[r], KV_PATH_LEN, "%s", gpus[r]);
        t->depth[r] = -1;
        best = -1;
        if (gpus[r][0] && nic_any) {
            for (i = 0; i < nnames; i++) {
                if (pcis[i][0]
                    && (d = common_depth(gpus[r], pcis[i])) > best)
                {
                    best = d;
                }
            }
        }
        if (best >= 0) {
            t->known = 1;
            t->depth[r] = best;
            for (i = 0; i < nnames && t->nrails[r] < KV_MAX_RAILS; i++) {
                if (pcis[i][0] && common_depth(gpus[r], pcis[i]) == best) {
                    t->rail[r][t->nrails[r]++] = i;
                }
            }
        } else {
            for (i = 0; i < nnames && i < KV_MAX_RAILS; i++) {
                t->rail[r][t->nrails[r]++] = i;
            }
        }
    }
}


static const char *
bdf_of(const char *path)
{
    const char *s = strrchr(path, '/');

    return s ? s + 1 : path;
}


/* Rank r's GPU: its pool's CUDA device, else the r-th NVIDIA function. */
static void
rank_gpus(kv_ctx_t *ctx, char gpus[][KV_PATH_LEN])
{
    char list[KV_MAX_RANKS][KV_PATH_LEN];
    int r, n;

    memset(list, 0, sizeof(list));
    n = kv_topo_gpus(list, KV_MAX_RANKS);
    for (r = 0; r < ctx->nranks; r++) {
        gpus[r][0] = '\0';
#ifdef KV_HAVE_CUDA
        {
            int dev = ctx->cfg.cuda_per_rank ? r : ctx->cfg.cuda_dev;
            char bdf[32], path[PATH_MAX], *c;
            if (strlen(sysfs_root()) > PATH_MAX - 64) {
                continue;
            }
            if (dev >= 0
                && cudaDeviceGetPCIBusId(bdf, sizeof(bdf), dev) == cudaSuccess)
            {
                for (c = bdf; *c; c++) {
                    *c = (char) (*c >= 'A' && *c <= 'F' ? *c + 32 : *c);
                }
                snprintf(path, sizeof(path), "%s/sys/bus/pci/devices/%s",
                         sysfs_root(), bdf);
                if (resolve(path, gpus[r], KV_PATH_LEN) == 0) {
                    continue;
                }
            }
        }
#endif
        if (r < n) {
            memcpy(gpus[r], list[r], KV_PATH_LEN);
        }
    }
}


/*
 * Before the fabric opens: decide the rails and each rank's share.
 * "auto" opens the provider's domains local to some rank's GPU (all of a
 * p5's 32 EFA NICs for 8 ranks) or, when sysfs knows no topology, the
 * first domain only; a list opens what it names.
 */
int
kv_topo_plan(kv_ctx_t *ctx)
{
    static char cand[KV_MAX_RAILS][64];
    static char pcis[KV_MAX_RAILS][KV_PATH_LEN];
    char gpus[KV_MAX_RANKS][KV_PATH_LEN], list[512];
    int ncand, i, r, k, map[KV_MAX_RAILS], used[KV_MAX_RAILS], n;
    kv_config_t *c = &ctx->cfg;
    kv_topo_t *t = &ctx->topo;

    memset(pcis, 0, sizeof(pcis));
    if (c->nrails > 0) {
        ncand = c->nrails;
        for (i = 0; i < ncand; i++) {
            snprintf(cand[i], sizeof(cand[i]), "%s", c->rails[i]);
        }
    } else {
        ncand = kv_fabric_domains(c->provider, cand, KV_MAX_RAILS);
    }
    for (i = 0; i < ncand; i++) {
        kv_topo_nic_pci(cand[i], pcis[i], KV_PATH_LEN);
    }
    rank_gpus(ctx, gpus);
    kv_topo_assign(t, ctx->nranks, gpus, pcis, ncand);

    if (c->nrails == 0) {
        if (!t->known || ncand <= 0) {
            /* no topology: one rail (the first domain), every rank */
            memset(t, 0, sizeof(*t));
            t->nranks = ctx->nranks;
            for (r = 0; r < ctx->nranks; r++) {
                t->nrails[r] = 1;
                snprintf(t->gpu[r], KV_PATH_LEN, "%s", gpus[r]);
                t->depth[r] = -1;
            }
            kv_info("topology: no GPU/NIC positions in sysfs; rails "
                    "\"auto\" is one rail for every rank");
            return 0;
        }
        /* open the domains some rank uses, in the provider's order */
        memset(used, 0, sizeof(used));
        for (r = 0; r < ctx->nranks; r++) {
            for (k = 0; k < t->nrails[r]; k++) {
                used[t->rail[r][k]] = 1;
            }
        }
        for (i = 0, n = 0; i < ncand; i++) {
            map[i] = -1;
            if (used[i]) {
                map[i] = n;
                snprintf(c->rails[n++], 64, "%s", cand[i]);
            }
        }
        c->nrails = n;
        for (r = 0; r < ctx->nranks; r++) {
            for (k = 0; k < t->nrails[r]; k++) {
                t->rail[r][k] = map[t->rail[r][k]];
            }
        }
    }
    for (r = 0; r < ctx->nranks; r++) {
        list[0] = '\0';
        for (k = 0; k < t->nrails[r]; k++) {
            size_t l = strlen(list);
            snprintf(list + l, sizeof(list) - l, "%s%s", k ? ", " : "",
                     c->rails[t->rail[r][k]]);
        }
        kv_info("topology: rank %d (GPU %s) -> rail(s) %s%s", r,
                t->gpu[r][0] ? bdf_of(t->gpu[r]) : "unknown", list,
                t->depth[r] >= 0 ? " (PCIe-local)" : " (no topology)");
    }
    return 0;
}


/* ---- kv_agent topo: the same choice, printed (tests, operators) -------- */

static int
split_list(char *s, char out[][64], int max)
{
    char *tok, *save = NULL;
    int n = 0;

    for (tok = strtok_r(s, ",", &save); tok && n < max;
         tok = strtok_r(NULL, ",", &save))
    {
        snprintf(out[n++], 64, "%s", tok);
    }
    return n;
}


int
kv_topo_main(int argc, char **argv)
{
    static char doms[KV_MAX_RAILS][64], want[KV_MAX_RAILS][64];
    static char cand[KV_MAX_RAILS][64];
    static char pcis[KV_MAX_RAILS][KV_PATH_LEN];
    static char gl[KV_MAX_RANKS][KV_PATH_LEN];
    static kv_topo_t t;
    char *domains = NULL, *rails = NULL;
    int i, k, r, ndom = 0, nwant = 0, ncand, nranks = 0, ngpu, json = 0;
    int best;
    cJSON *j, *arr, *o, *ra;
    char *txt;

    for (i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--sysfs") == 0 && i + 1 < argc) {
            setenv("KV_SYSFS_ROOT", argv[++i], 1);
        } else if (strcmp(argv[i], "--domains") == 0 && i + 1 < argc) {
            domains = argv[++i];
        } else if (strcmp(argv[i], "--rails") == 0 && i + 1 < argc) {
            rails = argv[++i];
        } else if (strcmp(argv[i], "--ranks") == 0 && i + 1 < argc) {
            nranks = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--json") == 0) {
            json = 1;
        } else {
            fprintf(stderr, "usage: kv_agent topo [--sysfs ROOT] "
                    "[--domains a,b,...] [--rails a,b,...] [--ranks N] "
                    "[--json]\n");
            return 2;
        }
    }
    if (domains) {
        ndom = split_list(domains, doms, KV_MAX_RAILS);
    } else {
        ndom = kv_fabric_domains("efa", doms, KV_MAX_RAILS);
    }
    ncand = ndom;
    memcpy(cand, doms, sizeof(cand));
    if (rails && strcmp(rails, "auto") != 0) {
        /* configured names, each matched to a domain as the agent does */
        nwant = split_list(rails, want, KV_MAX_RAILS);
        for (k = 0; k < nwant; k++) {
            best = -1;
            for (i = 0; i < ndom; i++) {
                if (kv_rail_name_match(want[k], doms[i])
                    && (best < 0 || kv_rail_name_match(want[k], doms[i]) == 2))
                {
                    best = i;
                }
            }
            if (best < 0) {
                fprintf(stderr, "kv_agent topo: rail \"%s\" matches no "
                        "domain\n", want[k]);
                return 1;
            }
            snprintf(cand[k], 64, "%s", doms[best]);
        }
        ncand = nwant;
    }
    ngpu = kv_topo_gpus(gl, KV_MAX_RANKS);
    if (nranks <= 0) {
        nranks = ngpu > 0 ? ngpu : 1;
    }
    if (nranks > KV_MAX_RANKS) {
        fprintf(stderr, "kv_agent topo: at most %d ranks\n", KV_MAX_RANKS);
        return 2;
    }
    for (i = 0; i < ncand; i++) {
        kv_topo_nic_pci(cand[i], pcis[i], KV_PATH_LEN);
    }
    kv_topo_assign(&t, nranks, gl, pcis, ncand);
    j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "gpus", ngpu);
    cJSON_AddNumberToObject(j, "nics", ncand);
    cJSON_AddBoolToObject(j, "known", t.known);
    arr = cJSON_AddArrayToObject(j, "ranks");
    for (r = 0; r < nranks; r++) {
        o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "rank", r);
        cJSON_AddStringToObject(o, "gpu", t.gpu[r][0] ? bdf_of(t.gpu[r])
                                                       : "");
        cJSON_AddNumberToObject(o, "depth", t.depth[r]);
        ra = cJSON_AddArrayToObject(o, "rails");
        for (k = 0; k < t.nrails[r]; k++) {
            cJSON_AddItemToArray(ra, cJSON_CreateString(cand[t.rail[r][k]]));
        }
        cJSON_AddItemToArray(arr, o);
        if (!json) {
            printf("rank %d  gpu %-14s depth %d  rails", r,
                   t.gpu[r][0] ? bdf_of(t.gpu[r]) : "-", t.depth[r]);
            for (k = 0; k < t.nrails[r]; k++) {
                printf(" %s", cand[t.rail[r][k]]);
            }
            printf("\n");
        }
    }
    if (json) {
        txt = cJSON_PrintUnformatted(j);
        printf("%s\n", txt);
        free(txt);
    }
    cJSON_Delete(j);
    return 0;
}
