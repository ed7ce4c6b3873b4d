#!/usr/bin/env bash
# Prefix-cache-aware routing (issue 23) on the emulator: the same workload,
# the same pods, one run, three gateway modes one after the other:
#
#   off          cache-blind: dpd_balance picks by load, every prompt of
#                >= DPD_THRESHOLD tokens prefilled apart (today)
#   approximate  dpd_prefix_cache approximate prefill=prefill
#   events       dpd_prefix_cache events file=... prefill=prefill, the index
#                written by the router-role kv_agent from the pods' KV events
#
# Pods: 2 prefill + 2 decode emulators (tools/vllm_emu.py) with automatic
# prefix caching in KV_BLOCKS blocks each (LRU, prefill time from uncached
# tokens only, a NIXL decoder pulls only the blocks it lacks), NIXL at
# KV_GBPS, KV events published (ZeroMQ).  Between modes every pod's prefix
# cache is reset (POST /reset_prefix_cache) and its counters are read
# before and after.  Workload (bench/prefix_load.py): SESSIONS multi-turn
# chats of TURNS turns growing FIRST_TOKENS -> LAST_TOKENS, CONCURRENCY in
# flight; a RAG mix (RAG_DOCS shared documents of RAG_DOC_TOKENS, RAG_QUESTIONS
# distinct questions); short chats at SHORT_RATE/s interleaved for ITL.
#
# Printed per mode: prefill tokens computed (sum over the 4 pods, the
# emulators' prefill_tokens_computed_total), KV bytes moved (the decoders'
# nixl_transferred_tokens_total x KV_BYTES_PER_TOKEN), TTFT p50/p99/mean of
# the chat turns and RAG requests, ITL p99 of the short requests; then the
# ratios against cache-blind and the issue's targets as PASS/MISS lines.
# A benchmark, not a test: numbers depend on the machine and its load.
#
# Usage: bench/prefix_cache.sh          (after `make`)
#        QUICK=1 bench/prefix_cache.sh  (a small profile, ~3 minutes)
# Knobs (env, full profile defaults): SESSIONS=64 TURNS=8 FIRST_TOKENS=2048
#   LAST_TOKENS=30720 CONCURRENCY=16 OPEN_SESSIONS=$CONCURRENCY (conversations
#   open at once, their turns interleaved) THINK_MS=500 RAG_DOCS=4
#   RAG_DOC_TOKENS=8192 RAG_QUESTIONS=64 SHORT_RATE=2 TURN_MAX_TOKENS=64
#   KV_BLOCKS=26000 (Llama 3 8B on an 80 GB GPU: ~56 GB of KV / 128 KiB per
#   token / 16 = ~0.8 of this workload's working set: 16 x 30k + 4 x 8k
#   tokens; the cache-aware pods fit it, a cache-blind pool that copies
#   every conversation to both pods does not) KV_BYTES_PER_TOKEN=131072 KV_GBPS=50 PREFILL_TPS=10000
#   DECODE_STEP_MS=20 BATCHED_TOKENS=2048 TIME_SCALE=1 DPD_THRESHOLD=1024
#   MODES="off approximate events" BENCH_PORT_BASE=18800 SEED=23
#   BENCH_KEEP=DIR (copy the access logs, pod and agent logs there)
set -euo pipefail

. "$(dirname "$0")/lib.sh"

if [[ ${QUICK:-0} = 1 ]]; then
    # the same shape, smaller: 8 turns growing 15x, a pod's KV_BLOCKS ~0.8
    # of the working set (conversations in flight x last size + documents)
    # as in the full profile
    : "${SESSIONS:=12}" "${TURNS:=8}" "${FIRST_TOKENS:=1024}"
    : "${LAST_TOKENS:=15360}" "${CONCURRENCY:=6}" "${THINK_MS:=200}"
    : "${RAG_DOCS:=2}" "${RAG_DOC_TOKENS:=4096}" "${RAG_QUESTIONS:=16}"
    : "${KV_BLOCKS:=4950}"
fi
SESSIONS=${SESSIONS:-64}
TURNS=${TURNS:-8}
FIRST_TOKENS=${FIRST_TOKENS:-2048}
LAST_TOKENS=${LAST_TOKENS:-30720}
CONCURRENCY=${CONCURRENCY:-16}
OPEN_SESSIONS=${OPEN_SESSIONS:-$CONCURRENCY}
THINK_MS=${THINK_MS:-500}
RAG_DOCS=${RAG_DOCS:-4}
RAG_DOC_TOKENS=${RAG_DOC_TOKENS:-8192}
RAG_QUESTIONS=${RAG_QUESTIONS:-64}
SHORT_RATE=${SHORT_RATE:-2}
TURN_MAX_TOKENS=${TURN_MAX_TOKENS:-64}
KV_BLOCKS=${KV_BLOCKS:-26000}
KV_BYTES_PER_TOKEN=${KV_BYTES_PER_TOKEN:-131072}
KV_GBPS=${KV_GBPS:-50}
PREFILL_TPS=${PREFILL_TPS:-10000}
DECODE_STEP_MS=${DECODE_STEP_MS:-20}
BATCHED_TOKENS=${BATCHED_TOKENS:-2048}
TIME_SCALE=${TIME_SCALE:-1}
DPD_THRESHOLD=${DPD_THRESHOLD:-1024}
MODES=${MODES:-off approximate events}
SEED=${SEED:-23}
BASE=${BENCH_PORT_BASE:-18800}

EMU_PORT=$BASE
SIDE_PORT=$((BASE + 1))
LMC_INIT=$((BASE + 2))
LMC_ALLOC=$((BASE + 3))
declare -A GW_PORT=([off]=$((BASE + 5)) [approximate]=$((BASE + 6))
                    [events]=$((BASE + 7)))
EV_PORT=$((BASE + 10))      # + pod index: KV event PUB; +20: replay ROUTER
DECODERS=(127.0.0.2 127.0.0.3)
PREFILLERS=(127.0.0.4 127.0.0.5)
PODS=("${DECODERS[@]}" "${PREFILLERS[@]}")
MAX_LEN=$((LAST_TOKENS + RAG_DOC_TOKENS + 4096))

bench_require "$MODULE" "$BUILD/libdpdtok.so" "$TOK/tokenizer.json"
bench_workdir dpd-prefix-bench
# nginx's workers may run as an unprivileged user: they read the index
chmod 755 "$WORK"

# the pods publish KV events for the events mode (vLLM binds, the agent
# connects); that needs pyzmq
EVENTS_WHY=
if [[ " $MODES " != *" events "* ]]; then
    EVENTS_WHY="not in MODES"
elif ! python3 -c 'import zmq' 2>/dev/null; then
    EVENTS_WHY="python3 without pyzmq: the pods cannot publish KV events"
fi

emu() {    # index host role
    local ev=()
    [[ -n $EVENTS_WHY ]] || ev=(--kv-events-config "$(printf \
        '{"enable_kv_cache_events":true,"publisher":"zmq",'`
        `'"endpoint":"tcp://*:%d","replay_endpoint":"tcp://*:%d",'`
        `'"topic":"kv@%s@emu-model"}' "$((EV_PORT + $1))" \
        "$((EV_PORT + 20 + $1))" "$2")")
    python3 "$ROOT/tools/vllm_emu.py" --host "$2" --port "$EMU_PORT" \
        --role "$3" --tokenizer "$TOK/tokenizer.json" \
        --tokenizer-config "$TOK/tokenizer_config.json" \
        --side-channel-port "$SIDE_PORT" --lmcache-init-port "$LMC_INIT" \
        --lmcache-alloc-port "$LMC_ALLOC" --time-scale "$TIME_SCALE" \
        --prefill-tps "$PREFILL_TPS" --decode-step-ms "$DECODE_STEP_MS" \
        --max-num-batched-tokens "$BATCHED_TOKENS" --kv-hold-timeout 120 \
        --kv-blocks "$KV_BLOCKS" --kv-transfer-gbps "$KV_GBPS" \
        --kv-bytes-per-token "$KV_BYTES_PER_TOKEN" --max-model-len "$MAX_LEN" \
        --stats-keep 8 "${ev[@]}" \
        --exit-with-parent $$ >"$WORK/emu-$2.log" 2>&1 &
    PIDS+=($!)
}

i=0
for h in "${DECODERS[@]}"; do emu $i "$h" decode; i=$((i + 1)); done
for h in "${PREFILLERS[@]}"; do emu $i "$h" prefill; i=$((i + 1)); done
for h in "${PODS[@]}"; do
    for _ in $(seq 1 150); do
        curl -sf "http://$h:$EMU_PORT/health" >/dev/null && break
        sleep 0.1
    done
    curl -sf "http://$h:$EMU_PORT/health" >/dev/null \
        || { echo "pod $h did not start:"; tail -5 "$WORK/emu-$h.log"; exit 1; }
done

# --- events mode: the router-role kv_agent writing the prefix index ------

EVENTS_DIRECTIVE=

ROUTER_PORT=$((BASE + 40))  # the router agent's control listener

events_start() {   # the router agent; sets EVENTS_WHY when it cannot run
    local i h node slots=65536 _
    if [[ ! -x $BUILD/kv_agent ]]; then
        EVENTS_WHY="$BUILD/kv_agent missing (make all)"
        return
    fi
    # a slot per distinct block of all pods (shared ones share it), twice
    while ((slots < 8 * KV_BLOCKS)); do slots=$((slots * 2)); done
    {
        printf '{"node_id": "router-0", "role": "router",\n'
        printf ' "state_path": "%s", "listen": "127.0.0.1:%d",\n' \
            "$WORK/router.state" "$ROUTER_PORT"
        printf ' "peers": [],\n "kv_events": [\n'
        for i in "${!PODS[@]}"; do
            h=${PODS[$i]}
            if ((i < ${#DECODERS[@]})); then
                node=decode-$i
            else
                node=prefill-$((i - ${#DECODERS[@]}))
            fi
            printf '  %s{"node": "%s", "http": "%s:%d", "model": "emu-model",'`
                `' "endpoint": "tcp://%s:%d", "replay": "tcp://%s:%d",'`
                `' "topic": "kv@%s@emu-model"}\n' "$([[ $i = 0 ]] || echo ,)" \
                "$node" "$h" "$EMU_PORT" "$h" "$((EV_PORT + i))" "$h" \
                "$((EV_PORT + 20 + i))" "$h"
        done
        printf ' ],\n "prefix_index": {"path": "%s", "slots": %d}}\n' \
            "$WORK/prefix.idx" "$slots"
    } >"$WORK/router.json"
    if ! "$BUILD/kv_agent" check --config "$WORK/router.json" \
            >"$WORK/router.check" 2>&1; then
        EVENTS_WHY="kv_agent refuses the router config (a kv_agent without"`
            `" the KV-events subscriber?): $(tail -1 "$WORK/router.check")"
        return
    fi
    "$BUILD/kv_agent" run --config "$WORK/router.json" \
        >"$WORK/router.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 1 100); do
        (($(grep -c 'subscribed to tcp' "$WORK/router.log") \
            >= ${#PODS[@]})) && [[ -f $WORK/prefix.idx ]] && break
        sleep 0.1
    done
    if (($(grep -c 'subscribed to tcp' "$WORK/router.log") < ${#PODS[@]})) \
        || [[ ! -f $WORK/prefix.idx ]]; then
        EVENTS_WHY="the router kv_agent did not subscribe to the 4 pods"`
            `" and write its index: $(tail -3 "$WORK/router.log" | tr '\n' ' ')"
        return
    fi
    # nginx's workers may run as another user
    chmod a+r "$WORK/prefix.idx"
}

if [[ -z $EVENTS_WHY ]]; then
    events_start
    if [[ -z $EVENTS_WHY ]]; then
        EVENTS_DIRECTIVE="dpd_decode_upstream decode;
            dpd_prefix_cache events file=$WORK/prefix.idx prefill=prefill;"
    fi
fi

# --- nginx ---------------------------------------------------------------

location() {   # mode directive
    cat <<EOF
    server {
        listen 127.0.0.1:${GW_PORT[$1]};
        access_log $WORK/access-$1.log bench;
        location /v1/ {
            dpd on;
            dpd_threshold $DPD_THRESHOLD;
            dpd_protocol nixl;
            dpd_prefill_pass /_dpd_prefill;
            dpd_prefill_timeout 600s;
            $2
            proxy_pass http://decode;
            add_header X-DPD-Route \$dpd_route always;
            add_header X-DPD-Cached \$dpd_cached_tokens always;
            add_header X-DPD-Decoder \$upstream_addr always;
        }
        location /_dpd_prefill/ {
            internal;
            subrequest_output_buffer_size 256k;
            proxy_set_header Accept-Encoding "";
            proxy_pass http://prefill/;
        }
        location = /metrics { dpd_metrics; }
    }
EOF
}

{
    cat <<EOF
load_module $MODULE;
worker_processes 2;
pid $WORK/nginx.pid;
error_log $WORK/error.log warn;
events { worker_connections 4096; }
http {
    client_body_temp_path $WORK/body;
    proxy_temp_path $WORK/proxy;
    access_log off;
    log_format bench '\$dpd_route \$dpd_prompt_tokens \$dpd_cached_tokens '
                     '\$dpd_uncached_tokens \$dpd_prefill_peer '
                     '\$upstream_addr \$status \$request_time';
    dpd_tokenizer $TOK/tokenizer.json config=$TOK/tokenizer_config.json;
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_buffering off;
    proxy_read_timeout 600s;
    client_max_body_size 16m;
    client_body_buffer_size 1m;

    upstream prefill { zone prefill 64k; dpd_balance;
                       server ${PREFILLERS[0]}:$EMU_PORT;
                       server ${PREFILLERS[1]}:$EMU_PORT; keepalive 64; }
    upstream decode  { zone decode 64k; dpd_balance;
                       server ${DECODERS[0]}:$EMU_PORT;
                       server ${DECODERS[1]}:$EMU_PORT; keepalive 64; }
EOF
    location off "dpd_prefix_cache off;"
    location approximate "dpd_decode_upstream decode;
            dpd_prefix_cache approximate zone=bench_approx:64m prefill=prefill;"
    if [[ -n $EVENTS_DIRECTIVE ]]; then
        location events "$EVENTS_DIRECTIVE"
    fi
    echo "}"
} >"$WORK/nginx.conf"
"$NGINX" -p "$WORK" -c "$WORK/nginx.conf" -e "$WORK/error.log"

# --- the runs ------------------------------------------------------------

pods_json() {   # file: every pod's /emu/stats (counters, kv) as one object
    python3 - "$EMU_PORT" "${PODS[@]}" >"$1" <<'EOF'
import json, sys, urllib.request
port, out = sys.argv[1], {}
for h in sys.argv[2:]:
    s = json.load(urllib.request.urlopen("http://%s:%s/emu/stats?since=%d"
                                         % (h, port, 1 << 60)))
    out[h] = {"counters": s["counters"], "kv": s["kv"]}
print(json.dumps(out))
EOF
}

reset_pods() {   # every pod's prefix cache, once nothing holds a block
    local h _ ok
    for h in "${PODS[@]}"; do
        ok=
        for _ in $(seq 1 100); do
            if python3 - "$h:$EMU_PORT" <<'EOF'
import json, sys, urllib.request
u = "http://%s" % sys.argv[1]
kv = json.load(urllib.request.urlopen(u + "/emu/stats?since=%d"
                                      % (1 << 60)))["kv"]
if kv["used_blocks"]:
    sys.exit(1)
before = kv["prefix_cache"]["resets"]
urllib.request.urlopen(urllib.request.Request(u + "/reset_prefix_cache",
                                              data=b"", method="POST"))
kv = json.load(urllib.request.urlopen(u + "/emu/stats?since=%d"
                                      % (1 << 60)))["kv"]
sys.exit(0 if kv["prefix_cache"]["resets"] > before else 1)
EOF
            then ok=1; break; fi
            sleep 0.2
        done
        [[ -n $ok ]] || echo "# warning: pod $h's prefix cache not reset" \
                             "(blocks in use)"
    done
}

echo "# workload: $SESSIONS chats x $TURNS turns (${FIRST_TOKENS} ->" \
     "${LAST_TOKENS} tokens, $OPEN_SESSIONS open at once, $CONCURRENCY" \
     "turns in flight, think ${THINK_MS} ms," \
     "$TURN_MAX_TOKENS output tokens); RAG: $RAG_DOCS docs x" \
     "$RAG_DOC_TOKENS tokens, $RAG_QUESTIONS questions; short chats at" \
     "${SHORT_RATE}/s"
echo "# pods: 2 prefill + 2 decode, prefix caching in $KV_BLOCKS blocks of" \
     "16 tokens each, prefill $PREFILL_TPS tok/s, decode step" \
     "$DECODE_STEP_MS ms, NIXL at $KV_GBPS GB/s x $KV_BYTES_PER_TOKEN" \
     "B/token, time scale $TIME_SCALE; dpd_threshold $DPD_THRESHOLD"

RAN=()
for mode in $MODES; do
    if [[ $mode = events && -z $EVENTS_DIRECTIVE ]]; then
        echo "# events mode skipped: ${EVENTS_WHY:-not configured}"
        continue
    fi
    [[ -n ${GW_PORT[$mode]:-} ]] || { echo "unknown mode $mode"; exit 1; }
    reset_pods
    [[ $mode = events ]] && sleep 1     # AllBlocksCleared reaches the index
    pods_json "$WORK/$mode.before"
    rc=0
    python3 "$ROOT/bench/prefix_load.py" \
        --url "http://127.0.0.1:${GW_PORT[$mode]}" --label "$mode" \
        --seed "$SEED" --sessions "$SESSIONS" --turns "$TURNS" \
        --first-tokens "$FIRST_TOKENS" --last-tokens "$LAST_TOKENS" \
        --concurrency "$CONCURRENCY" --open-sessions "$OPEN_SESSIONS" \
        --think-ms "$THINK_MS" \
        --turn-max-tokens "$TURN_MAX_TOKENS" --rag-docs "$RAG_DOCS" \
        --rag-doc-tokens "$RAG_DOC_TOKENS" --rag-questions "$RAG_QUESTIONS" \
        --short-rate "$SHORT_RATE" >"$WORK/$mode.out" || rc=$?
    grep -v '^JSON ' "$WORK/$mode.out" || true
    [[ $rc = 0 ]] || echo "# $mode: some requests failed (rc $rc)"
    sleep 0.5                           # the last pulls are counted
    pods_json "$WORK/$mode.after"
    RAN+=("$mode")
done

curl -sf "http://127.0.0.1:${GW_PORT[off]}/metrics" \
    | grep -E '^dpd_prefix_(routes|lookups|cached|imbalanced)' \
    | sed 's/^/# gateway (all modes): /' || true
grep -E '\[(crit|alert|emerg)\]' "$WORK/error.log" | tail -5 || true

python3 - "$WORK" "$KV_BYTES_PER_TOKEN" "${DECODERS[*]}" "${RAN[@]}" <<'EOF'
import json, sys
work, bpt, decoders, modes = sys.argv[1], int(sys.argv[2]), \
    sys.argv[3].split(), sys.argv[4:]

def load(p):
    return json.load(open(p))

def counter(snap, host, name):
    return snap[host]["counters"].get(name, 0)

rows = {}
for m in modes:
    before, after = load(f"{work}/{m}.before"), load(f"{work}/{m}.after")
    d = lambda h, n: counter(after, h, n) - counter(before, h, n)
    out = None
    for line in open(f"{work}/{m}.out"):
        if line.startswith("JSON "):
            out = json.loads(line[5:])
    hits = sum(after[h]["kv"]["prefix_cache"]["hits"] -
               before[h]["kv"]["prefix_cache"]["hits"] for h in after)
    evicted = sum(after[h]["kv"]["prefix_cache"]["evicted_blocks"] -
                  before[h]["kv"]["prefix_cache"]["evicted_blocks"]
                  for h in after)
    rows[m] = {
        "prefill": sum(d(h, "prefill_tokens_computed_total") for h in after),
        "prefill_p": sum(d(h, "prefill_tokens_computed_total")
                         for h in after if h not in decoders),
        "prefill_d": sum(d(h, "prefill_tokens_computed_total")
                         for h in decoders),
        "kv_tokens": sum(d(h, "nixl_transferred_tokens_total")
                         for h in decoders),
        "hits": hits, "evicted": evicted,
        "long": out["long"], "short": out["short"], "wall": out["wall_s"]}
    rows[m]["kv_bytes"] = rows[m]["kv_tokens"] * bpt

def f(v, spec="%.0f"):
    return "-" if v is None else spec % v

print()
print("%-12s %12s %10s %10s %9s %9s %10s | long TTFT p50 %7s %7s %7s | "
      "short ITL p99 | wall" % ("mode", "prefill tok", "(prefill", "decode)",
                               "KV GB", "APC hits", "evicted", "p99",
                               "mean", ""))
for m in modes:
    r = rows[m]
    print("%-12s %12d %10d %10d %9.2f %9d %10d | %18s %7s %7s ms | %8s ms | "
          "%.0f s" % (m, r["prefill"], r["prefill_p"], r["prefill_d"],
                      r["kv_bytes"] / 1e9, r["hits"], r["evicted"],
                      f(r["long"]["ttft_ms_p50"]), f(r["long"]["ttft_ms_p99"]),
                      f(r["long"]["ttft_ms_mean"]),
                      f(r["short"]["itl_ms_p99"], "%.1f"), r["wall"]))
    print("%-12s   long routes %s; engine cached %d of %d prompt tokens"
          % ("", " ".join("%s=%d" % kv for kv in
                         sorted(r["long"]["routes"].items())),
             r["long"]["engine_cached_tokens"], r["long"]["prompt_tokens"]))

def ratio(a, b):
    return a / b if b else float("inf") if a else 1.0

if "off" not in rows:
    sys.exit(0)
base = rows["off"]
print()
for m in modes:
    if m == "off":
        continue
    r = rows[m]
    print("# %s vs cache-blind: prefill tokens x%.3f, KV bytes x%.3f, "
          "mean TTFT %.2fx lower, p50 TTFT %.2fx lower, short ITL p99 x%.3f"
          % (m, ratio(r["prefill"], base["prefill"]),
             ratio(r["kv_bytes"], base["kv_bytes"]),
             ratio(base["long"]["ttft_ms_mean"] or 0,
                   r["long"]["ttft_ms_mean"] or 0),
             ratio(base["long"]["ttft_ms_p50"] or 0,
                   r["long"]["ttft_ms_p50"] or 0),
             ratio(r["short"]["itl_ms_p99"] or 0,
                   base["short"]["itl_ms_p99"] or 0)))

for m in modes:
    r = rows[m]
    print("# %s: computed %.3f of the prompt tokens (%d of %d; the rest "
          "reused from the pods' prefix caches or pulled)"
          % (m, ratio(r["prefill"], r["long"]["prompt_tokens"] +
                      r["short"]["prompt_tokens"]), r["prefill"],
             r["long"]["prompt_tokens"] + r["short"]["prompt_tokens"]))

def target(ok, text):
    print("%s  %s" % ("PASS" if ok else "MISS", text))

print()
for m in ("events", "approximate"):
    if m not in rows:
        print("SKIP  %s mode targets: %s not run" % (m, m))
        continue
    r = rows[m]
    v = ratio(r["prefill"], base["prefill"])
    target(v <= 1 / 3, "%s: prefill tokens <= 1/3 of cache-blind (x%.3f)"
           % (m, v))
    v = ratio(r["kv_bytes"], base["kv_bytes"])
    target(v <= 1 / 3, "%s: KV bytes moved <= 1/3 of cache-blind (x%.3f)"
           % (m, v))
    v = ratio(base["long"]["ttft_ms_mean"] or 0, r["long"]["ttft_ms_mean"]
              or 0)
    target(v >= 2, "%s: mean TTFT >= 2x lower than cache-blind (%.2fx)"
           % (m, v))
    v = ratio(r["short"]["itl_ms_p99"] or 0, base["short"]["itl_ms_p99"]
              or 0)
    target(v <= 1.10, "%s: short-request ITL p99 <= cache-blind + 10%% "
           "(x%.3f)" % (m, v))
if "events" in rows and "approximate" in rows:
    v = ratio(rows["approximate"]["prefill"], rows["events"]["prefill"])
    target(v <= 1.5, "approximate: prefill tokens within 1.5x of events "
           "(x%.3f)" % v)
else:
    print("SKIP  approximate within 1.5x of events: events not run")
EOF

if [[ -n ${BENCH_KEEP:-} ]]; then
    # the per-mode access logs ($dpd_route, prompt, cached and uncached
    # tokens, prefiller, decoder), pod and agent logs, counters
    mkdir -p "$BENCH_KEEP"
    cp "$WORK"/*.log "$WORK"/*.out "$WORK"/*.before "$WORK"/*.after \
       "$WORK"/*.json "$BENCH_KEEP"/ 2>/dev/null || true
    echo "# logs kept in $BENCH_KEEP"
fi
