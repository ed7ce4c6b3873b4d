#!/usr/bin/env bash
# kv_agent benchmark (README.md, Benchmarks: "KV transfer"):
#  1. RMA write bandwidth of `kv_agent bench` over tcp;ofi_rxm on loopback
#     vs a plain TCP stream (iperf3) on loopback, same run, 64 MiB
#     transfers, interleaved rounds, medians; target ratio >= 0.8.
#  2. The Llama-70B-shaped push (80 layers x K,V x 4 KiB per block per
#     region, 512 blocks = 320 MiB) through the agent's segment walker,
#     with and without coalescing (GB/s each).
#  3. The same push end to end between two real agents (local API, control
#     channel, trailing completion message), coalescing on and off.
# Usage: bench/kv_agent.sh [--rounds N] [--quick]
#   env KV_BENCH_PORT (default 18800), KV_BENCH_PROVIDER (tcp;ofi_rxm)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
. "$ROOT/tools/python-path.sh"
B=$ROOT/build/kv_agent
ROUNDS=5
QUICK=0
while [ $# -gt 0 ]; do
    case $1 in
        --rounds) ROUNDS=$2; shift 2 ;;
        --quick) QUICK=1; ROUNDS=3; shift ;;
        *) echo "usage: $0 [--rounds N] [--quick]" >&2; exit 2 ;;
    esac
done
PORT=${KV_BENCH_PORT:-18800}
PROV=${KV_BENCH_PROVIDER:-"tcp;ofi_rxm"}
T=$(mktemp -d /tmp/kv-bench.XXXXXX)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
    wait 2>/dev/null
    rm -rf "$T"
}
trap cleanup EXIT

[ -x "$B" ] || { echo "build/kv_agent missing: run make" >&2; exit 1; }
command -v iperf3 >/dev/null || { echo "iperf3 missing (make deps)" >&2; exit 1; }

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
best() { sort -g | tail -1; }
jnum() { sed -n "s/.*\"$1\": *\([0-9.eE+-]*\).*/\1/p" | head -1; }

echo "== kv_agent vs iperf3, loopback, 64 MiB transfers, $ROUNDS rounds"
echo "   machine: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
iperf3 -s -p "$PORT" >/dev/null 2>&1 &
PIDS+=($!)
sleep 0.5
: >"$T/kv"; : >"$T/ip"
for r in $(seq "$ROUNDS"); do
    kv=$(timeout 120 "$B" bench --provider "$PROV" --rails lo --size 64M \
         --block 1M --iters 5 --json 2>/dev/null | jnum gbps)
    # iperf3: 5 x 64 MiB in 1 MiB writes, like the RMA side
    ip=$(timeout 60 iperf3 -c 127.0.0.1 -p "$PORT" -n 320M -l 1M -J 2>/dev/null |
         python3 -c 'import json,sys; d=json.load(sys.stdin); print("%.3f" % (d["end"]["sum_received"]["bits_per_second"]/8e9))')
    printf '   round %d: kv_agent %s GB/s   iperf3 %s GB/s\n' "$r" "${kv:-?}" "${ip:-?}"
    [ -n "$kv" ] && echo "$kv" >>"$T/kv"
    [ -n "$ip" ] && echo "$ip" >>"$T/ip"
done
KV=$(median <"$T/kv"); IP=$(median <"$T/ip")
RATIO=$(awk -v a="$KV" -v b="$IP" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }')
KVB=$(best <"$T/kv"); IPB=$(best <"$T/ip")
echo "   median: kv_agent ($PROV) $KV GB/s, iperf3 $IP GB/s"
echo "   best:   kv_agent ($PROV) $KVB GB/s, iperf3 $IPB GB/s"
echo "   ratio kv_agent/iperf3 = $RATIO on medians, $(awk -v a="$KVB" -v b="$IPB" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }') on bests (target >= 0.8)"

if fi_info -p shm >/dev/null 2>&1; then
    : >"$T/shm"
    for r in $(seq "$ROUNDS"); do
        timeout 120 "$B" bench --provider shm --size 64M --block 1M --iters 5 \
            --json 2>/dev/null | jnum gbps >>"$T/shm"
    done
    echo "   (for reference: shm provider, same transfers: median $(median <"$T/shm") GB/s)"
fi

echo
echo "== Llama-70B-shaped push (512 blocks, 80 layers, K+V, 4 KiB): segment walker"
: >"$T/lc"; : >"$T/ln"
for r in $(seq "$ROUNDS"); do
    timeout 120 "$B" bench --provider "$PROV" --rails lo --pattern llama \
        --iters 3 --json 2>/dev/null | jnum gbps >>"$T/lc"
    [ "$QUICK" = 1 ] && [ "$r" -gt 1 ] && continue
    timeout 300 "$B" bench --provider "$PROV" --rails lo --pattern llama \
        --no-coalesce --iters 1 --json 2>/dev/null | jnum gbps >>"$T/ln"
done
LC=$(median <"$T/lc"); LN=$(median <"$T/ln")
echo "   coalesced:   $LC GB/s (160 writes of 2 MiB)"
echo "   uncoalesced: $LN GB/s (81920 writes of 4 KiB)"
echo "   coalescing speed-up = $(awk -v a="$LC" -v b="$LN" 'BEGIN { if (b > 0) printf "%.1fx", a / b; else print "n/a" }')"

echo
echo "== the same push end to end between two agents (local API + control + fabric)"
agent() {  # id role port peer peerport coalesce
    cat >"$T/$1.json" <<EOF
{"node_id":"$1","role":"$2","provider":"$PROV","rails":["lo"],
 "listen":"127.0.0.1:$3",
 "peers":[{"id":"$4","ctrl":"127.0.0.1:$5","role":"$( [ "$2" = prefill ] && echo decode || echo prefill )",
           "key_file":"$T/link.key"}],
 "api_socket":"$T/$1.sock","state_path":"$T/$1.state",
 "pool":{"layers":80,"regions":2,"block_bytes":4096,"blocks":600},
 "transfer":{"coalesce":$6},"timeouts":{"transfer_ms":120000}}
EOF
    "$B" run --config "$T/$1.json" 2>"$T/$1.log" &
    PIDS+=($!)
}
# the link key of each pair (mode 0600; both configs name it)
(umask 077; od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$T/link.key")
for co in true false; do
    agent "p-$co" prefill $((PORT + 1)) "d-$co" $((PORT + 2)) $co
    agent "d-$co" decode $((PORT + 2)) "p-$co" $((PORT + 1)) $co
    for _ in $(seq 100); do grep -q "info: ready$" "$T/d-$co.log" 2>/dev/null && break; sleep 0.1; done
    n=$([ "$co" = true ] && echo "$ROUNDS" || echo 1)
    : >"$T/e2e"
    for r in $(seq "$n"); do
        timeout 200 python3 "$ROOT/t/kv_agent/kvpush.py" --prefill "$T/p-$co.sock" \
            --decode "d-$co=$T/d-$co.sock" --nblocks 512 --dst auto \
            --timeout-ms 180000 --req "b$r" >"$T/out" 2>&1
        ms=$(jnum ms <"$T/out"); bad=$(jnum mismatched_slices <"$T/out")
        if [ -n "$ms" ] && [ "$bad" = 0 ]; then
            awk -v ms="$ms" 'BEGIN { printf "%.3f\n", 335544320 / (ms / 1000) / 1e9 }' >>"$T/e2e"
        else
            echo "   round $r failed: $(tail -c 300 "$T/out")"
        fi
    done
    echo "   coalesce=$co: median $(median <"$T/e2e") GB/s over $n push(es), bytes verified"
    # once per link, not per push: connect + challenge + hello + hello_ok
    hs=$(grep -ho 'handshake [0-9.]* ms' "$T/p-$co.log" "$T/d-$co.log" | awk '{ print $2 }' | tr '\n' ' ')
    echo "   authenticated handshake (connect to hello_ok verified, per link): ${hs:-?}ms"
    for p in "${PIDS[@]:1}"; do kill "$p" 2>/dev/null; done
    sleep 0.5
    PIDS=("${PIDS[0]}")
done
