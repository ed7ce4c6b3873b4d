/*
 * main.c - kv_agent subcommands: run (the daemon), bench, status.
 */

#include <stdio.h>
#include <string.h>

#include "kv.h"


static void
usage(void)
{
    fprintf(stderr,
        "usage: kv_agent run --config FILE\n"
        "       kv_agent bench [--provider P] [--size BYTES] [--block BYTES]"
        " [--iters N] [--json]\n"
        "       kv_agent status [--state FILE] [--json] [--req ID]\n"
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
    if (strcmp(argv[1], "status") == 0) {
        return kv_status_main(argc - 2, argv + 2);
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
