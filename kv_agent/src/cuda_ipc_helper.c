/*
 * cuda_ipc_helper.c - plays the inference engine for tools/gpu-check.sh:
 * allocates a GPU pool with cudaMalloc, exports it with cudaIpcGetMemHandle
 * and registers it with a kv_agent (register_pool, memory cuda:<dev>), then
 * keeps the allocation alive until stdin closes (IPC memory lives as long
 * as its exporter).
 *
 *   kv_cuda_ipc_helper SOCK DEVICE SIZE
 */

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "kv_agent_client.h"


int
main(int argc, char **argv)
{
    cudaIpcMemHandle_t h;
    cudaError_t ce;
    char err[256], buf[16];
    size_t size;
    void *ptr = NULL;
    kvc_t *c;
    int dev;

    if (argc != 4) {
        fprintf(stderr, "usage: kv_cuda_ipc_helper SOCK DEVICE SIZE\n");
        return 2;
    }
    dev = atoi(argv[2]);
    size = strtoull(argv[3], NULL, 10);
    if ((ce = cudaSetDevice(dev)) != cudaSuccess
        || (ce = cudaMalloc(&ptr, size)) != cudaSuccess
        || (ce = cudaMemset(ptr, 0, size)) != cudaSuccess
        || (ce = cudaIpcGetMemHandle(&h, ptr)) != cudaSuccess)
    {
        fprintf(stderr, "helper: cuda: %s\n", cudaGetErrorString(ce));
        return 1;
    }
    c = kvc_connect(argv[1], 60000, err, sizeof(err));
    if (c == NULL
        || kvc_register_cuda_pool(c, dev, &h, sizeof(h), size, err,
                                  sizeof(err)) != 0)
    {
        fprintf(stderr, "helper: %s\n", err);
        return 1;
    }
    printf("registered %zu bytes of cuda:%d\n", size, dev);
    fflush(stdout);
    while (read(0, buf, sizeof(buf)) > 0) {
        /* hold the allocation */
    }
    kvc_close(c);
    cudaFree(ptr);
    return 0;
}
