/*
 * status.c - `kv_agent status --state FILE [--json]`: a reader of the state
 * table that uses only the dpd_state.h helpers, as nginx does.
 */

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "kv.h"


static void
status_usage(void)
{
    fprintf(stderr, "usage: kv_agent status [--state FILE] [--json] "
            "[--req ID]\n");
}


/* Read the whole table into memory; sb->st_size becomes the bytes read (a
 * file that shrank meanwhile reads short and then fails the size check). */
static void *
status_snapshot(int fd, struct stat *sb)
{
    size_t   want, got = 0;
    ssize_t  n;
    char    *buf;

    if (sb->st_size <= 0 || sb->st_size > (off_t) 1 << 30) {
        errno = EFBIG;
        return NULL;
    }
    want = (size_t) sb->st_size;
    buf = malloc(want);
    if (buf == NULL) {
        return NULL;
    }
    while (got < want) {
        n = pread(fd, buf + got, want - got, (off_t) got);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            break;
        }
        got += (size_t) n;
    }
    sb->st_size = (off_t) got;
    return buf;
}


int
kv_status_main(int argc, char **argv)
{
    const char *path = DPD_STATE_DEFAULT_PATH, *only_req = NULL;
    const dpd_state_header_t *h;
    const dpd_node_rec_t *nodes;
    const dpd_req_rec_t *reqs;
    dpd_node_rec_t n;
    dpd_req_rec_t r;
    struct stat sb;
    int json = 0, fd, i, unknown = 0, rc;
    uint64_t now = kv_wall_ms();
    cJSON *root, *arr, *o;
    char *s;
    void *m;

    for (i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0) {
            json = 1;
        } else if (strcmp(argv[i], "--state") == 0 && i + 1 < argc) {
            path = argv[++i];
        } else if (strcmp(argv[i], "--req") == 0 && i + 1 < argc) {
            only_req = argv[++i];
        } else {
            status_usage();
            return 2;
        }
    }
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        fprintf(stderr, "kv_agent status: %s: %s\n", path, strerror(errno));
        return 1;
    }
    if (fstat(fd, &sb) != 0 || sb.st_size == 0) {
        fprintf(stderr, "kv_agent status: %s: empty\n", path);
        close(fd);
        return 1;
    }
    /* A private snapshot read with pread(), never a mapping: a writer that
     * truncates or replaces the file while we look cannot SIGBUS us. */
    m = status_snapshot(fd, &sb);
    close(fd);
    if (m == NULL) {
        fprintf(stderr, "kv_agent status: %s: %s\n", path, strerror(errno));
        return 1;
    }
    if (dpd_state_check(m, sb.st_size) != 0) {
        fprintf(stderr, "kv_agent status: %s is not a version %u state "
                "table\n", path, DPD_STATE_VERSION);
        free(m);
        return 1;
    }
    h = m;
    nodes = dpd_state_nodes(m);
    reqs = dpd_state_reqs(m);

    if (only_req) {
        rc = dpd_state_find_req(m, only_req, strlen(only_req), &r);
        if (json) {
            o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "req_id", only_req);
            cJSON_AddStringToObject(o, "state", rc == 1
                ? dpd_state_req_name(r.state) : rc == 0 ? "absent"
                : "unknown");
            if (rc == 1) {
                cJSON_AddNumberToObject(o, "bytes_done", r.bytes_done);
                cJSON_AddNumberToObject(o, "bytes_total", r.bytes_total);
                cJSON_AddStringToObject(o, "node", r.node_id);
            }
            s = cJSON_PrintUnformatted(o);
            printf("%s\n", s);
            free(s);
            cJSON_Delete(o);
        } else {
            printf("%s %s\n", only_req, rc == 1 ? dpd_state_req_name(r.state)
                   : rc == 0 ? "absent" : "unknown");
        }
        free(m);
        return rc == 1 ? 0 : 3;
    }

    if (!json) {
        printf("state table %s: version %u, writer %s (pid %u, %s), "
               "updated %.1fs ago\n", path, h->version, h->self_id,
               h->writer_pid, h->writer_alive ? "running" : "stopped",
               (now - h->updated_ms) / 1000.0);
        printf("nodes:\n");
    }
    root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "path", path);
    cJSON_AddNumberToObject(root, "version", h->version);
    cJSON_AddStringToObject(root, "self", h->self_id);
    cJSON_AddNumberToObject(root, "writer_pid", h->writer_pid);
    cJSON_AddBoolToObject(root, "writer_alive", h->writer_alive != 0);
    cJSON_AddNumberToObject(root, "generation", (double) h->generation);
    arr = cJSON_AddArrayToObject(root, "nodes");
    for (i = 0; i < (int) h->max_nodes; i++) {
        if (dpd_state_read_rec(&nodes[i], &n, sizeof(n)) != 0) {
            unknown++;
            continue;
        }
        if (!(n.flags & DPD_NODE_USED)) {
            continue;
        }
        n.id[sizeof(n.id) - 1] = n.http_addr[sizeof(n.http_addr) - 1] = 0;
        if (!json) {
            printf("  %-20s %-7s %-5s http=%s free=%llu/%llu inflight=%u "
                   "heartbeat=%s\n", n.id, dpd_state_role_name(n.role),
                   (n.flags & DPD_NODE_ALIVE) ? "alive" : "dead",
                   n.http_addr[0] ? n.http_addr : "-",
                   (unsigned long long) n.free_blocks,
                   (unsigned long long) n.total_blocks, n.inflight,
                   n.last_heartbeat_ms ? "seen" : "never");
        }
        o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "id", n.id);
        cJSON_AddStringToObject(o, "role", dpd_state_role_name(n.role));
        cJSON_AddBoolToObject(o, "alive", (n.flags & DPD_NODE_ALIVE) != 0);
        cJSON_AddBoolToObject(o, "self", (n.flags & DPD_NODE_SELF) != 0);
        cJSON_AddStringToObject(o, "http", n.http_addr);
        cJSON_AddNumberToObject(o, "free_blocks", n.free_blocks);
        cJSON_AddNumberToObject(o, "total_blocks", n.total_blocks);
        cJSON_AddNumberToObject(o, "block_bytes", n.block_bytes);
        cJSON_AddNumberToObject(o, "inflight", n.inflight);
        cJSON_AddNumberToObject(o, "last_heartbeat_ms",
                                (double) n.last_heartbeat_ms);
        cJSON_AddNumberToObject(o, "heartbeat_age_ms", n.last_heartbeat_ms
                                ? (double) (now - n.last_heartbeat_ms) : -1);
        cJSON_AddItemToArray(arr, o);
    }
    if (!json) {
        printf("requests:\n");
    }
    arr = cJSON_AddArrayToObject(root, "requests");
    for (i = 0; i < (int) h->max_reqs; i++) {
        if (dpd_state_read_rec(&reqs[i], &r, sizeof(r)) != 0) {
            unknown++;
            continue;
        }
        if (r.state == DPD_REQ_FREE) {
            continue;
        }
        r.req_id[sizeof(r.req_id) - 1] = 0;
        r.node_id[sizeof(r.node_id) - 1] = 0;
        r.peer_id[sizeof(r.peer_id) - 1] = 0;
        if (!json) {
            printf("  %-36s %-12s %llu/%llu bytes, %u blocks, node=%s "
                   "from=%s%s%s\n", r.req_id, dpd_state_req_name(r.state),
                   (unsigned long long) r.bytes_done,
                   (unsigned long long) r.bytes_total, r.nblocks,
                   r.node_id[0] ? r.node_id : "-",
                   r.peer_id[0] ? r.peer_id : "-",
                   r.error ? " error=" : "", r.error ? strerror(-r.error) : "");
        }
        o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "req_id", r.req_id);
        cJSON_AddStringToObject(o, "state", dpd_state_req_name(r.state));
        cJSON_AddNumberToObject(o, "bytes_done", (double) r.bytes_done);
        cJSON_AddNumberToObject(o, "bytes_total", (double) r.bytes_total);
        cJSON_AddNumberToObject(o, "nblocks", r.nblocks);
        cJSON_AddStringToObject(o, "node", r.node_id);
        cJSON_AddStringToObject(o, "peer", r.peer_id);
        cJSON_AddNumberToObject(o, "error", r.error);
        cJSON_AddNumberToObject(o, "t_reserved_ms", (double) r.t_reserved_ms);
        cJSON_AddNumberToObject(o, "t_start_ms", (double) r.t_start_ms);
        cJSON_AddNumberToObject(o, "t_done_ms", (double) r.t_done_ms);
        cJSON_AddItemToArray(arr, o);
    }
    cJSON_AddNumberToObject(root, "unreadable", unknown);
    if (json) {
        s = cJSON_PrintUnformatted(root);
        printf("%s\n", s);
        free(s);
    } else if (unknown) {
        printf("(%d records changing too fast to read)\n", unknown);
    }
    cJSON_Delete(root);
    free(m);
    return 0;
}
