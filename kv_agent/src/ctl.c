/*
 * ctl.c - kv_agent_ctl: a command-line front end to the C client library
 * (for scripts and tests).  Block lists are written "0-511,600,700-703".
 *
 *   kv_agent_ctl SOCK call JSON
 *   kv_agent_ctl SOCK register-memfd SIZE [SEED]
 *   kv_agent_ctl SOCK reserve REQ N
 *   kv_agent_ctl SOCK push REQ PEER SRC [DST]
 *   kv_agent_ctl SOCK poll REQ | wait REQ MS | release REQ
 *   kv_agent_ctl SOCK checksum BLOCKS
 */


#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kv_agent_client.h"


static uint32_t *
parse_list(const char *s, uint32_t *n)
{
    uint32_t *out = NULL, cap = 0, k = 0, a, b, i;
    char *dup = strdup(s), *tok, *save, *dash, *end;

    for (tok = strtok_r(dup, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save))
    {
        dash = strchr(tok, '-');
        a = (uint32_t) strtoul(tok, &end, 10);
        b = dash ? (uint32_t) strtoul(dash + 1, NULL, 10) : a;
        for (i = a; i <= b; i++) {
            if (k == cap) {
                cap = cap ? cap * 2 : 256;
                out = realloc(out, cap * sizeof(*out));
                if (out == NULL) {
                    exit(1);
                }
            }
            out[k++] = i;
            if (i == UINT32_MAX) {
                break;
            }
        }
    }
    free(dup);
    *n = k;
    return out;
}


static void
print_state(const char *req, const kvc_req_state_t *st)
{
    printf("{\"req_id\":\"%s\",\"state\":\"%s\",\"final\":%s,"
           "\"timeout\":%s,\"bytes_done\":%llu,\"bytes_total\":%llu,"
           "\"error\":\"%s\"}\n", req, st->state, st->final ? "true" : "false",
           st->timeout ? "true" : "false",
           (unsigned long long) st->bytes_done,
           (unsigned long long) st->bytes_total, st->error);
}


int
main(int argc, char **argv)
{
    char err[512], *reply, sum[17];
    kvc_req_state_t st;
    uint32_t *a, *b, na, nb, n;
    const char *cmd;
    kvc_t *c;
    int rc = 1;

    if (argc < 3) {
        fprintf(stderr, "usage: kv_agent_ctl SOCK COMMAND ARGS...\n");
        return 2;
    }
    c = kvc_connect(argv[1], 60000, err, sizeof(err));
    if (c == NULL) {
        fprintf(stderr, "kv_agent_ctl: %s\n", err);
        return 1;
    }
    cmd = argv[2];
    err[0] = '\0';
    if (strcmp(cmd, "call") == 0 && argc == 4) {
        rc = kvc_call(c, argv[3], -1, &reply, err, sizeof(err)) ? 1 : 0;
        if (reply) {
            printf("%s\n", reply);
            free(reply);
        }
    } else if (strcmp(cmd, "register-memfd") == 0 && argc >= 4) {
        size_t size = strtoull(argv[3], NULL, 10), i;
        unsigned long seed = argc > 4 ? strtoul(argv[4], NULL, 10) : 1;
        int fd = memfd_create("kv_pool", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        unsigned char *m;

        if (fd < 0 || ftruncate(fd, size) != 0) {
            snprintf(err, sizeof(err), "memfd: %s", strerror(errno));
        } else {
            m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (m != MAP_FAILED) {
                for (i = 0; i < size; i += 4096) {
                    m[i] = (unsigned char) (seed + i / 4096);
                }
                munmap(m, size);
                rc = kvc_register_host_pool(c, fd, size, err, sizeof(err))
                     ? 1 : 0;
            }
            close(fd);
        }
        if (rc == 0) {
            printf("{\"ok\":true}\n");
        }
    } else if (strcmp(cmd, "reserve") == 0 && argc == 5) {
        uint32_t want = (uint32_t) strtoul(argv[4], NULL, 10);
        a = malloc((want ? want : 1) * sizeof(*a));
        rc = kvc_reserve(c, argv[3], want, a, want, &n, err, sizeof(err))
             ? 1 : 0;
        if (rc == 0) {
            printf("{\"ok\":true,\"nblocks\":%u,\"first\":%u}\n", n,
                   n ? a[0] : 0);
        }
        free(a);
    } else if (strcmp(cmd, "push") == 0 && (argc == 6 || argc == 7)) {
        a = parse_list(argv[5], &na);
        b = argc == 7 ? parse_list(argv[6], &nb) : NULL;
        if (b && nb != na) {
            snprintf(err, sizeof(err), "src and dst differ in length");
        } else {
            rc = kvc_push(c, argv[3], argv[4], a, b, na, err, sizeof(err))
                 ? 1 : 0;
        }
        if (rc == 0) {
            printf("{\"ok\":true}\n");
        }
        free(a);
        free(b);
    } else if (strcmp(cmd, "poll") == 0 && argc == 4) {
        rc = kvc_poll(c, argv[3], &st, err, sizeof(err)) ? 1 : 0;
        if (rc == 0) {
            print_state(argv[3], &st);
        }
    } else if (strcmp(cmd, "wait") == 0 && argc == 5) {
        rc = kvc_wait(c, argv[3], atoi(argv[4]), &st, err, sizeof(err))
             ? 1 : 0;
        if (rc == 0) {
            print_state(argv[3], &st);
        }
    } else if (strcmp(cmd, "release") == 0 && argc == 4) {
        rc = kvc_release(c, argv[3], err, sizeof(err)) ? 1 : 0;
        if (rc == 0) {
            printf("{\"ok\":true}\n");
        }
    } else if (strcmp(cmd, "checksum") == 0 && argc == 4) {
        a = parse_list(argv[3], &na);
        rc = kvc_checksum(c, a, na, sum, err, sizeof(err)) ? 1 : 0;
        if (rc == 0) {
            printf("%s\n", sum);
        }
        free(a);
    } else {
        snprintf(err, sizeof(err), "unknown command or wrong arguments");
        rc = 2;
    }
    if (rc != 0 && err[0]) {
        fprintf(stderr, "kv_agent_ctl: %s\n", err);
    }
    kvc_close(c);
    return rc;
}
