/*
 * main.c - kv_agent subcommands: run (the daemon), bench, status.
 */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "kv.h"


/* `kv_agent check --config FILE`: validate a configuration and print
 * what it means, without starting anything. */
static int
check_main(int argc, char **argv)
{
    kv_config_t *c;
    char err[512];
    int i, rc;

    if (argc != 2 || strcmp(argv[0], "--config") != 0) {
        fprintf(stderr, "usage: kv_agent check --config FILE\n");
        return 2;
    }
    c = malloc(sizeof(*c));
    if (c == NULL) {
        return 1;
    }
    rc = kv_config_load(c, argv[1], err, sizeof(err));
    if (rc != 0) {
        fprintf(stderr, "kv_agent: config: %s\n", err);
        free(c);
        return 2;
    }
    /* what `run` refuses before it opens anything: the table's directory
     * (missing, or writable by others and not sticky); the message is
     * run's own */
    if (kv_state_dir_check(c->state_path, 0) != 0) {
        kv_auth_forget(c);
        free(c);
        return 1;
    }
    printf("node %s (%s), %s%s%s, control %s, %d peer(s)\n",
           c->node_id, dpd_state_role_name(c->role),
           c->has_pool ? "provider " : "no fabric (no pool)",
           c->has_pool ? c->provider : "",
           c->has_pool && c->allow_fallback ? " (fall-back allowed)" : "",
           c->listen, c->npeers);
    for (i = 0; i < c->npeers; i++) {
        printf("  peer %s (%s) at %s, key %s", c->peers[i].id,
               dpd_state_role_name(c->peers[i].role), c->peers[i].ctrl,
               c->peers[i].kid[0]);
        if (c->peers[i].nkeys > 1) {
            printf(" (also accepts %s)", c->peers[i].kid[1]);
        }
        printf("\n");
    }
    for (i = 0; i < c->ndns; i++) {
        printf("  peers_dns %s port %d (%s), key_file %s, every %d ms\n",
               c->dns[i].name, c->dns[i].port,
               dpd_state_role_name(c->dns[i].role), c->dns[i].key_file,
               c->dns[i].resolve_ms);
    }
    if (c->has_pool) {
        printf("pool: %u layers x %u regions x %u blocks x %llu bytes = "
               "%llu bytes on %s, x %d rank(s)\n", c->layout.layers,
               c->layout.regions, c->layout.nblocks,
               (unsigned long long) c->layout.block_bytes,
               (unsigned long long) c->layout.size,
               c->cuda_per_rank ? "cuda:<rank>" : c->cuda_dev >= 0 ? "cuda"
                                                                    : "host",
               c->ranks);
    }
    for (i = 0; i < c->evs.nsrc; i++) {
        printf("kv_events: %s (%s) from %s topic \"%s\"%s%s\n",
               c->evs.src[i].node, c->evs.src[i].http, c->evs.src[i].endpoint,
               c->evs.src[i].topic, c->evs.src[i].replay[0] ? ", replay " : "",
               c->evs.src[i].replay);
    }
    for (i = 0; i < c->evs.ndns; i++) {
        printf("kv_events: every address of %s (%s, every %d ms): ADDRESS:%d "
               "from tcp://ADDRESS:%d topic \"%s\"", c->evs.dns[i].name,
               c->evs.dns[i].family == AF_INET ? "ipv4"
               : c->evs.dns[i].family == AF_INET6 ? "ipv6" : "any",
               c->evs.dns[i].resolve_ms, c->evs.dns[i].http_port,
               c->evs.dns[i].port, c->evs.dns[i].topic);
        if (c->evs.dns[i].replay_port) {
            printf(", replay tcp://ADDRESS:%d", c->evs.dns[i].replay_port);
        }
        printf("\n");
    }
    if (c->pfx.path[0]) {
        printf("prefix index: %s (%llu slots, block %d, %llu engine ids)\n",
               c->pfx.path, (unsigned long long) c->pfx.slots, c->pfx.block,
               (unsigned long long) c->pfx.map_entries);
    }
    printf("state table: %s\n", c->state_path);
    /* only a config that used ${VAR}: a static one prints as before */
    if (kv_config_print_expanded(argv[1], stdout) != 0) {
        fprintf(stderr, "kv_agent: config: %s: cannot print it\n", argv[1]);
        kv_auth_forget(c);
        free(c);
        return 2;
    }
    kv_auth_forget(c);
    free(c);
    return 0;
}


static void
usage(void)
{
    fprintf(stderr,
        "usage: kv_agent run --config FILE\n"
        "       kv_agent bench [--provider P] [--size BYTES] [--block BYTES]"
        " [--iters N] [--json]\n"
        "       kv_agent status [--state FILE] [--json] [--req ID]\n"
        "       kv_agent check --config FILE\n"
        "       kv_agent topo [--sysfs ROOT] [--domains a,b] [--rails a,b]"
        " [--ranks N] [--json]\n"
        "       kv_agent events (--decode FILE... | --config FILE | "
        "--endpoint EP ...)\n"
        "       kv_agent version\n");
}


int
main(int argc, char **argv)
{
    if (argc < 2) {
        usage();
        return 2;
    }
    if (strcmp(argv[1], "run") == 0) {
        return kv_run_main(argc - 2, argv + 2);
    }
    if (strcmp(argv[1], "bench") == 0) {
        return kv_bench_main(argc - 2, argv + 2);
    }
    if (strcmp(argv[1], "check") == 0) {
        return check_main(argc - 2, argv + 2);
    }
    if (strcmp(argv[1], "topo") == 0) {
        return kv_topo_main(argc - 2, argv + 2);
    }
    if (strcmp(argv[1], "status") == 0) {
        return kv_status_main(argc - 2, argv + 2);
    }
    if (strcmp(argv[1], "events") == 0) {
        return kv_events_main(argc - 2, argv + 2);
    }
    if (strcmp(argv[1], "version") == 0) {
        printf("kv_agent state-table v%u, libfabric %d.%d (headers %d.%d)"
#ifdef KV_HAVE_CUDA
               ", cuda"
#endif
               "\n", DPD_STATE_VERSION, FI_MAJOR(fi_version()),
               FI_MINOR(fi_version()), FI_MAJOR_VERSION, FI_MINOR_VERSION);
        return 0;
    }
    usage();
    return 2;
}
