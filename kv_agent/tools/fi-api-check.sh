#!/usr/bin/env bash
# Compile every kv_agent source against another libfabric's headers (no
# link, no run): proves the version-gated code paths of fabric.c compile
# for API levels this machine's libfabric-dev does not have (Debian 12:
# 1.17; AWS's EFA installer: 1.18+, 2.x).
#   kv_agent/tools/fi-api-check.sh INCLUDE_DIR [INCLUDE_DIR ...]
#     INCLUDE_DIR holds rdma/fabric.h (e.g. libfabric's include/ at v1.18.0:
#     git -C libfabric archive v1.18.0 include | tar -x -C /tmp/fi-1.18)
# Prints the API level each set of headers gives and which gated options
# compiled in; exits non-zero on any compile error.
set -uo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 1 ] || { echo "usage: $0 INCLUDE_DIR ..." >&2; exit 2; }
CC=${CC:-cc}
rc=0
for inc in "$@"; do
    [ -f "$inc/rdma/fabric.h" ] || { echo "$inc: no rdma/fabric.h" >&2; rc=2; continue; }
    ver=$(printf '#include <rdma/fabric.h>\nFI_MAJOR_VERSION.FI_MINOR_VERSION\n' |
          $CC -E -P -I"$inc" - 2>/dev/null | tail -1 | tr -d ' ')
    ok=1
    for f in kv_agent/src/*.c; do
        case $f in *cuda_ipc_helper.c) continue ;; esac
        $CC -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -Werror -fsyntax-only -I"$inc" \
            -Ikv_agent/include -Ikv_agent/src "$f" || { ok=0; rc=1; }
    done
    gated=$(printf '#include <rdma/fabric.h>\n#include <rdma/fi_ext.h>\n#if FI_VERSION_GE(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), FI_VERSION(1, 18))\nKVGATE_EFA_USE_DEVICE_RDMA KVGATE_EFA_EMULATED_WRITE\n#endif\n#if FI_VERSION_GE(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), FI_VERSION(2, 0))\nKVGATE_MAX_RMA_SIZE KVGATE_SHARED_MEMORY_PERMITTED\n#endif\n' |
            $CC -E -P -I"$inc" - 2>/dev/null | grep -o 'KVGATE_[A-Z_]*' | sed 's/KVGATE_/FI_OPT_/' | tr '\n' ' ')
    echo "headers $inc: libfabric API $ver: $([ $ok = 1 ] && echo compiles || echo FAILS); gated options: ${gated:-none}"
done
exit $rc
