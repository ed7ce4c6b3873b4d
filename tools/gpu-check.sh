#!/usr/bin/env bash
# GPU proof for kv_agent, for a machine with an NVIDIA GPU (< 5 minutes):
#   1. builds kv_agent, kv_agent_ctl and the CUDA IPC helper;
#   2. for each provider (tcp;ofi_rxm, and shm when present): starts a
#      prefill and a decode agent whose pools are cuda:<dev> (cudaMalloc'd
#      by the agents), fills 512 Llama-shaped blocks on the prefill GPU,
#      pushes them GPU -> GPU and compares the agents' checksums, which read
#      the bytes back from device memory;
#   3. registers an engine-owned GPU pool on the decode agent through a CUDA
#      IPC handle (cudaIpcOpenMemHandle path) and pushes into it;
#   4. tensor parallel over every GPU present (issue 12): both agents serve
#      N ranks, rank r's pool on cuda:r ("memory": "cuda", "ranks": N); one
#      push moves every rank's 256 blocks to the same rank on the decoder
#      and every rank's checksum (read back from device memory) is
#      compared.  Without FI_HMEM (tcp;ofi_rxm) the staging path must show
#      ring batches (pinned slots, cudaMemcpyAsync + events) and the
#      receiver's ring chunks copied in (recv_ring_chunks); with FI_HMEM (shm with CUDA) the decoder must have
#      flushed the GPUDirect RDMA writes before ready (gpu_flushes).
# Prints PASS/FAIL per step, which memory path was used (FI_HMEM or pinned
# staging), and exits non-zero on any failure; 2 ("SKIP") when there is no
# GPU, CUDA runtime (toolkit or `make deps`'s PyPI one) or libfabric
# headers (nothing was checked).
#   env: KV_GPU_DEV (default 0; decode uses KV_GPU_DEV2, default same),
#        KV_GPU_PORT (default 18950), KV_GPU_PROVIDERS ("tcp;ofi_rxm shm")
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
DEV=${KV_GPU_DEV:-0}
DEV2=${KV_GPU_DEV2:-$DEV}
PORT=${KV_GPU_PORT:-18950}
PROVIDERS=${KV_GPU_PROVIDERS:-"tcp;ofi_rxm shm"}
B=$ROOT/build
T=$(mktemp -d /tmp/kv-gpu-check.XXXXXX)
# the p<->d link key (both configs name it; mode 0600)
(umask 077; od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$T/link.key")
PIDS=()
FAIL=0

cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
    sleep 0.5
    for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
    rm -rf "$T"
}
trap cleanup EXIT

say()  { printf '%s\n' "gpu-check: $*"; }
pass() { say "PASS $*"; }
fail() { say "FAIL $*"; FAIL=1; }

# KV_GPU_DRY_RUN=1 runs the same flow with host pools (checks the script
# itself on a machine without a GPU; the IPC step is skipped; the TP step
# runs 2 ranks of host pools registered by t/kv_agent/kvtp.py, staged
# through the ring with the host copy engine)
DRY=${KV_GPU_DRY_RUN:-0}
MEM() { [ "$DRY" = 1 ] && echo host || echo "cuda:$1"; }
if [ "$DRY" != 1 ]; then
    command -v nvidia-smi >/dev/null && nvidia-smi -L || {
        say "SKIP: no NVIDIA GPU visible (nvidia-smi -L failed)"; exit 2; }
fi
for h in /usr/include/rdma/fabric.h /usr/include/cjson/cJSON.h; do
    [ -f "$h" ] || { say "missing $h: install libfabric-dev and libcjson-dev (make deps)"; exit 2; }
done
# The CUDA runtime: $CUDA_HOME, else the toolkit in /usr/local/cuda, else
# the PyPI runtime `make deps` put in .deps/cuda-N (no toolkit on the new
# machines), N the driver's CUDA major (nvidia-smi's "CUDA Version"), or
# 12 under a newer driver; built by `make kv-agent-cudaN` into
# build-cudaN/ (the libcudart.so.N rpath points at .deps/cuda-N).
TARGETS=(build/kv_agent build/kv_agent_ctl build/kv_cuda_ipc_helper)
if [ "$DRY" = 1 ]; then
    TARGETS=(build/kv_agent build/kv_agent_ctl)
elif [ -n "${CUDA_HOME:-}" ] || [ -f /usr/local/cuda/include/cuda_runtime.h ]
then
    [ -f "${CUDA_HOME:-/usr/local/cuda}/include/cuda_runtime.h" ] ||
        { say "SKIP: no CUDA runtime headers under $CUDA_HOME"; exit 2; }
    say "CUDA runtime: ${CUDA_HOME:-/usr/local/cuda}"
else
    drv=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\)\..*/\1/p' | head -1)
    cu=
    for n in 13 12; do
        if [ -n "$drv" ] && [ "$n" -le "$drv" ] &&
           [ -f "$ROOT/.deps/cuda-$n/include/cuda_runtime.h" ]; then
            cu=$n; break
        fi
    done
    [ -n "$cu" ] || {
        say "SKIP: no /usr/local/cuda and no PyPI CUDA runtime in .deps/" \
            "for this driver (CUDA ${drv:-unknown}): run make deps (needs" \
            "PyPI), or set CUDA_HOME"
        cat "$ROOT"/.deps/cuda-*.unavailable 2>/dev/null
        exit 2
    }
    say "CUDA runtime: PyPI's CUDA $cu in .deps/cuda-$cu (driver: CUDA $drv)"
    B=$ROOT/build-cuda$cu
    TARGETS=("kv-agent-cuda$cu")
fi
say "building"
make -j"$(nproc)" "${TARGETS[@]}" \
    >"$T/build.log" 2>&1 || { tail -30 "$T/build.log"; fail "build"; exit 1; }
[ "$DRY" = 1 ] || "$B/kv_agent" version | grep -q cuda ||
    { fail "built without CUDA"; exit 1; }
pass "build (CUDA path compiled)"

ctl() { timeout 60 "$B/kv_agent_ctl" "$@"; }

config() {  # id role port peer_id peer_port provider dev
    cat >"$T/$1.json" <<EOF
{"node_id":"$1","role":"$2","provider":"$6","allow_fallback":false,
 "rails":$( [ "$6" = shm ] && echo '"auto"' || echo '["lo"]' ),
 "listen":"127.0.0.1:$3",
 "peers":[{"id":"$4","ctrl":"127.0.0.1:$5","role":"$( [ "$2" = prefill ] && echo decode || echo prefill )",
           "key_file":"$T/link.key"}],
 "api_socket":"$T/$1.sock","state_path":"$T/$1.state",
 "pool":{"layers":80,"regions":2,"block_bytes":4096,"blocks":600,
         "memory":"$(MEM "$7")"},
 "timeouts":{"transfer_ms":60000},"api":{"debug_verbs":true}}
EOF
}

start() {  # id
    "$B/kv_agent" run --config "$T/$1.json" 2>"$T/$1.log" &
    PIDS+=($!)
    for _ in $(seq 200); do
        grep -q "info: ready$" "$T/$1.log" && return 0
        kill -0 "${PIDS[-1]}" 2>/dev/null || break
        sleep 0.1
    done
    tail -20 "$T/$1.log"
    return 1
}

connected() {  # sock peer (up to 60 s: a loaded CI host is slow)
    for _ in $(seq 600); do
        ctl "$1" call '{"verb":"info"}' | grep -q "\"id\":\"$2\",\"role\":\"[a-z]*\",\"connected\":true" && return 0
        sleep 0.1
    done
    return 1
}

push_check() {  # tag provider
    local tag=$1 prov=$2 req="gpu-$1-$$" rep first
    ctl "$T/p.sock" call '{"verb":"fill","blocks_runs":[[0,512]],"seed":11}' >/dev/null \
        || { fail "$tag: fill"; return; }
    ctl "$T/p.sock" push "$req" d 0-511 >/dev/null || { fail "$tag: push"; return; }
    rep=$(ctl "$T/d.sock" wait "$req" 60000)
    echo "$rep" | grep -q '"state":"ready"' || { fail "$tag: not ready: $rep"; return; }
    first=$(ctl "$T/d.sock" call "{\"verb\":\"poll\",\"req_id\":\"$req\"}" |
            sed -n 's/.*"blocks_runs":\[\[\([0-9]*\),512\]\].*/\1/p')
    [ -n "$first" ] || { fail "$tag: destination blocks not one run"; return; }
    local s1 s2
    s1=$(ctl "$T/p.sock" checksum 0-511)
    s2=$(ctl "$T/d.sock" checksum "$first-$((first + 511))")
    if [ -n "$s1" ] && [ "$s1" = "$s2" ]; then
        pass "$tag: 512 blocks (320 MiB) GPU->GPU bit-exact ($s1)"
    else
        fail "$tag: checksums differ: $s1 vs $s2"
    fi
    ctl "$T/p.sock" release "$req" >/dev/null
    ctl "$T/d.sock" release "$req" >/dev/null
}

for prov in $PROVIDERS; do
    fi_info -p "$prov" >/dev/null 2>&1 || { say "skip $prov: not available"; continue; }
    config p prefill "$PORT" d $((PORT + 1)) "$prov" "$DEV"
    config d decode $((PORT + 1)) p "$PORT" "$prov" "$DEV2"
    if ! { start p && start d; }; then
        fail "$prov: agents did not start"
        for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
        wait 2>/dev/null; PIDS=(); continue
    fi
    if ! connected "$T/p.sock" d; then
        fail "$prov: no control link"
        for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
        wait 2>/dev/null; PIDS=(); continue
    fi
    grep -h "rail 0:" "$T/p.log" | sed 's/^.*info: /  /'
    if grep -q "bounded ring of\|stage: rank" "$T/p.log" "$T/d.log"; then
        say "  memory path: GPU staged through pinned host memory (no FI_HMEM)"
    elif grep -q "hmem yes" "$T/p.log"; then
        say "  memory path: FI_HMEM (GPU memory registered directly)"
    else
        say "  memory path: host memory (dry run)"
    fi
    push_check "$prov agent-allocated" "$prov"

    # engine-owned pool via CUDA IPC on the decode side
    if [ "$DRY" = 1 ]; then
        for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
        wait 2>/dev/null; PIDS=(); continue
    fi
    size=$(ctl "$T/d.sock" call '{"verb":"info"}' | sed -n 's/.*"size":\([0-9]*\).*/\1/p')
    mkfifo "$T/hold"
    "$B/kv_cuda_ipc_helper" "$T/d.sock" "$DEV2" "$size" <"$T/hold" >"$T/helper.log" 2>&1 &
    HP=$!
    PIDS+=("$HP")
    exec 9>"$T/hold"
    for _ in $(seq 100); do grep -q registered "$T/helper.log" && break; sleep 0.1; done
    if grep -q registered "$T/helper.log"; then
        connected "$T/p.sock" d && push_check "$prov CUDA-IPC pool" "$prov" \
            || fail "$prov: no link after IPC registration"
    else
        fail "$prov: IPC registration: $(cat "$T/helper.log")"
    fi
    exec 9>&-
    rm -f "$T/hold"
    wait "$HP" 2>/dev/null
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
    wait 2>/dev/null
    PIDS=()
    grep -h "error:" "$T/p.log" "$T/d.log" | head -5
done
# ---- 4. tensor parallel over every GPU -----------------------------------
if [ "$DRY" = 1 ]; then NG=2; else NG=$(nvidia-smi -L | grep -c '^GPU '); fi
tp_config() {  # id role port peer_id peer_port provider
    local mem='"cuda"' stg='"auto"'
    [ "$DRY" = 1 ] && { mem='"host"'; stg='"host"'; }
    cat >"$T/$1.json" <<EOF
{"node_id":"$1","role":"$2","provider":"$6","allow_fallback":false,
 "rails":$( [ "$6" = shm ] && echo '"auto"' || echo '["lo"]' ),
 "listen":"127.0.0.1:$3",
 "peers":[{"id":"$4","ctrl":"127.0.0.1:$5","role":"$( [ "$2" = prefill ] && echo decode || echo prefill )",
           "key_file":"$T/link.key"}],
 "api_socket":"$T/$1.sock","state_path":"$T/$1.state",
 "pool":{"layers":80,"regions":2,"block_bytes":4096,"blocks":300,
         "memory":$mem,"ranks":$NG},
 "transfer":{"staging":$stg},
 "timeouts":{"transfer_ms":120000},"api":{"debug_verbs":true}}
EOF
}
jget() { sed -n "s/.*\"$1\":\"\\([0-9a-f]*\\)\".*/\\1/p"; }
for prov in $PROVIDERS; do
    fi_info -p "$prov" >/dev/null 2>&1 || continue
    tp_config p prefill $((PORT + 10)) d $((PORT + 11)) "$prov"
    tp_config d decode $((PORT + 11)) p $((PORT + 10)) "$prov"
    start p && start d || { fail "$prov TP=$NG: agents did not start"; continue; }
    if [ "$DRY" = 1 ]; then
        zeros=$(printf '0, %.0s' $(seq "$NG")); zeros=${zeros%, }
        out=$(timeout 120 python3 "$ROOT/t/kv_agent/kvtp.py" --prefill "$T/p.sock" \
              --decode "d=$T/d.sock" --ranks "$NG" --nblocks 256 2>&1 | tail -1)
        if echo "$out" | grep -q '"recv_state": "ready"' &&
           echo "$out" | grep -qF "\"bad\": [$zeros]"; then
            pass "$prov TP=$NG: every rank's 256 blocks bit-exact (host pools, staged)"
        else
            fail "$prov TP=$NG: $(echo "$out" | tail -c 400)"
            tail -n 5 "$T/p.log" "$T/d.log"     # what the agents saw
        fi
    else
        connected "$T/p.sock" d || fail "$prov TP=$NG: no control link"
        grep -h "topology: rank\|stage: rank 0\|rank 0: writes land" "$T/p.log" "$T/d.log" |
            sed 's/^.*info: /  /'
        req="tp-$$"
        ok=1
        for r in $(seq 0 $((NG - 1))); do
            ctl "$T/p.sock" call "{\"verb\":\"fill\",\"rank\":$r,\"blocks_runs\":[[0,256]],\"seed\":$((r + 3))}" |
                grep -q '"ok":true' || { fail "$prov TP=$NG: fill rank $r"; ok=0; }
        done
        t0=$(date +%s.%N)
        ctl "$T/p.sock" call "{\"verb\":\"push\",\"req_id\":\"$req\",\"peer\":\"d\",\"src_runs\":[[0,256]],\"dst_runs\":[[0,256]]}" |
            grep -q '"ok":true' || { fail "$prov TP=$NG: push refused"; ok=0; }
        rep=$(ctl "$T/d.sock" wait "$req" 120000)
        t1=$(date +%s.%N)
        echo "$rep" | grep -q '"state":"ready"' || { fail "$prov TP=$NG: not ready: $rep"; ok=0; }
        for r in $(seq 0 $((NG - 1))); do
            a=$(ctl "$T/p.sock" call "{\"verb\":\"checksum\",\"rank\":$r,\"blocks_runs\":[[0,256]]}" | jget checksum)
            b=$(ctl "$T/d.sock" call "{\"verb\":\"checksum\",\"rank\":$r,\"blocks_runs\":[[0,256]]}" | jget checksum)
            if [ -z "$a" ] || [ "$a" != "$b" ]; then
                fail "$prov TP=$NG: rank $r (cuda:$r) differs: $a vs $b"; ok=0
            fi
        done
        pinfo=$(ctl "$T/p.sock" call '{"verb":"info"}')
        dinfo=$(ctl "$T/d.sock" call '{"verb":"info"}')
        if grep -q "hmem yes" "$T/p.log"; then
            path="FI_HMEM"
            echo "$dinfo" | grep -q '"gpu_flushes":[1-9]' ||
                { fail "$prov TP=$NG: the FI_HMEM receiver did not flush GPUDirect RDMA writes before ready"; ok=0; }
        else
            path="staging ring"
            echo "$pinfo" | grep -q '"stage_batches":[1-9]' ||
                { fail "$prov TP=$NG: the staged sender shows no stage batches"; ok=0; }
            echo "$dinfo" | grep -q '"recv_ring_chunks":[1-9]' ||
                { fail "$prov TP=$NG: the staged receiver copied no chunk in through its ring"; ok=0; }
        fi
        ms=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f", (b - a) * 1000 }')
        [ "$ok" = 1 ] && pass "$prov TP=$NG ($path): $NG ranks x 256 blocks GPU->GPU bit-exact on every GPU, $ms ms"
    fi
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
    wait 2>/dev/null
    PIDS=()
    grep -h "error:" "$T/p.log" "$T/d.log" | head -5
done
[ "$FAIL" = 0 ] && say "ALL PASSED" || say "SOME CHECKS FAILED"
exit "$FAIL"
