#!/usr/bin/env bash
# kv_agent staging ring (README.md, "GPU staging"): the Llama-70B-shaped
# push (512 blocks x 80 layers x K,V x 4 KiB = 320 MiB) between two agents
# whose pools go through the staging path (transfer.staging "host": the
# code GPU pools without FI_HMEM use, with the host copy engine standing
# in for cudaMemcpyAsync, throttled to KV_BENCH_COPY_GBPS like a DMA
# engine), with the ring's copies overlapping the fabric writes (8 slots)
# vs the same code with one slot (copy, write, copy, write: the serial
# baseline).  The receiver's landing ring follows the same setting
# (recv_slots 8: chunk k copied in while k+1 is on the wire; 1: write,
# copy-in, write, ...), so the ratio covers both sides; the receiver's
# copy-in is then timed alone (sender direct from its pool, receiver ring
# of 8 vs 1 slot).  Same run, interleaved rounds, medians.
# Usage: bench/kv_stage.sh [--rounds N]
#   env KV_BENCH_PORT (18850), KV_BENCH_PROVIDER (tcp;ofi_rxm),
#       KV_BENCH_COPY_GBPS (1.0), KV_BENCH_CHUNK (2M)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
. "$ROOT/tools/python-path.sh"
B=$ROOT/build/kv_agent
ROUNDS=5
while [ $# -gt 0 ]; do
    case $1 in
        --rounds) ROUNDS=$2; shift 2 ;;
        *) echo "usage: $0 [--rounds N]" >&2; exit 2 ;;
    esac
done
PORT=${KV_BENCH_PORT:-18850}
PROV=${KV_BENCH_PROVIDER:-"tcp;ofi_rxm"}
GBPS=${KV_BENCH_COPY_GBPS:-1.0}
CHUNK=${KV_BENCH_CHUNK:-2M}
T=$(mktemp -d /tmp/kv-stage.XXXXXX)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
    wait 2>/dev/null
    rm -rf "$T"
}
trap cleanup EXIT
[ -x "$B" ] || { echo "build/kv_agent missing: run make" >&2; exit 1; }
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
jnum() { sed -n "s/.*\"$1\": *\([0-9.eE+-]*\).*/\1/p" | head -1; }
(umask 077; od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$T/link.key")
RAILS=$([ "$PROV" = shm ] && echo '"auto"' || echo '["lo"]')

agent() {  # id role port peer peerport slots
    cat >"$T/$1.json" <<EOF2
{"node_id":"$1","role":"$2","provider":"$PROV","rails":$RAILS,
 "listen":"127.0.0.1:$3",
 "peers":[{"id":"$4","ctrl":"127.0.0.1:$5","role":"$( [ "$2" = prefill ] && echo decode || echo prefill )",
           "key_file":"$T/link.key"}],
 "api_socket":"$T/$1.sock","state_path":"$T/$1.state",
 "pool":{"layers":80,"regions":2,"block_bytes":4096,"blocks":600},
 "transfer":{"staging":"${7:-host}","stage_slots":$6,"stage_chunk":"$CHUNK",
             "recv_slots":$6,"recv_chunk":"$CHUNK"},
 "timeouts":{"transfer_ms":120000}}
EOF2
    KV_COPY_HOST_GBPS=$GBPS "$B" run --config "$T/$1.json" 2>"$T/$1.log" &
    PIDS+=($!)
}
echo "== staging ring: Llama-70B push (320 MiB), $PROV, copy engine at $GBPS GB/s, $CHUNK slots"
echo "   machine: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
agent p8 prefill $((PORT + 1)) d8 $((PORT + 2)) 8
agent d8 decode $((PORT + 2)) p8 $((PORT + 1)) 8
agent p1 prefill $((PORT + 3)) d1 $((PORT + 4)) 1
agent d1 decode $((PORT + 4)) p1 $((PORT + 3)) 1
# receiver ring alone: senders write straight from their pools
agent pr8 prefill $((PORT + 5)) dr8 $((PORT + 6)) 8 off
agent dr8 decode $((PORT + 6)) pr8 $((PORT + 5)) 8
agent pr1 prefill $((PORT + 7)) dr1 $((PORT + 8)) 1 off
agent dr1 decode $((PORT + 8)) pr1 $((PORT + 7)) 1
for id in p8 d8 p1 d1 pr8 dr8 pr1 dr1; do
    for _ in $(seq 100); do grep -q "info: ready$" "$T/$id.log" 2>/dev/null && break; sleep 0.1; done
done
: >"$T/ms8"; : >"$T/ms1"; : >"$T/msr8"; : >"$T/msr1"
for r in $(seq "$ROUNDS"); do
    for s in 8 1 r8 r1; do
        timeout 200 python3 "$ROOT/t/kv_agent/kvpush.py" --prefill "$T/p$s.sock" \
            --decode "d$s=$T/d$s.sock" --nblocks 512 --dst auto \
            --timeout-ms 180000 --req "s$r" >"$T/out" 2>&1
        ms=$(jnum ms <"$T/out"); bad=$(jnum mismatched_slices <"$T/out")
        # the agent's own push time (sender: first copy to last completion)
        pms=$(grep -o "push s$r-d$s-[0-9]* -> d$s done: [0-9]* bytes in [0-9]* ms" "$T/p$s.log" | tail -1 | awk '{ print $(NF-1) }')
        if [ -n "$pms" ] && [ "$bad" = 0 ]; then
            # receiver-ring rows: end to end (it ends at the last copy-in)
            if [ "${s#r}" != "$s" ]; then echo "$ms" >>"$T/ms$s"; else echo "$pms" >>"$T/ms$s"; fi
            printf '   round %d: %s slot(s)%s: push %s ms (end to end %s ms), bytes verified\n' "$r" "${s#r}" "$( [ "${s#r}" != "$s" ] && echo ", receiver ring only")" "$pms" "$ms"
        else
            echo "   round $r ($s slots) failed: $(tail -c 300 "$T/out")"
        fi
    done
done
M8=$(median <"$T/ms8"); M1=$(median <"$T/ms1")
echo "   median push time: overlap (8 slots) $M8 ms, serial (1 slot) $M1 ms"
echo "   overlap speed-up serial/overlap = $(awk -v a="$M1" -v b="$M8" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else print "n/a" }')"
R8=$(median <"$T/msr8"); R1=$(median <"$T/msr1")
echo "   receiver ring alone (medians end to end: the last chunk's copy-in is after the sender's done):"
echo "   overlap (8 slots) $R8 ms, serial (1 slot) $R1 ms, speed-up $(awk -v a="$R1" -v b="$R8" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else print "n/a" }')"
awk -v g="$GBPS" 'BEGIN { printf "   (copy alone at %s GB/s: %.0f ms per side for 320 MiB)\n", g, 335544320 / (g * 1e9) * 1000 }'
grep -h "stage: rank 0" "$T/p8.log" "$T/p1.log" | sed 's/^/   /'
