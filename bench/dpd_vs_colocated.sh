#!/usr/bin/env bash
# DPD vs co-located serving, same emulated GPUs, same workload.
#
#   (a) co-located: two vLLM emulators with --role both behind nginx
#       (dpd_balance, the module only observing)
#   (b) DPD: one prefill + one decode emulator behind the module
#       (dpd_protocol nixl, prompts >= DPD_THRESHOLD tokens prefilled apart)
#
# Both get the same mixed workload (tools: bench/dpd_load.py): short chats
# and long documents (~8k tokens), Poisson arrivals, streamed.  Printed per
# class: TTFT p50/p99 and inter-token gap p50/p99.  The emulator's timing
# model (compute-bound prefill at PREFILL_TPS, memory-bound decode steps,
# chunked prefill lengthening co-located decode steps) is the same for both.
#
# Usage: bench/dpd_vs_colocated.sh            (after `make`)
# Knobs (env): DURATION=30 RATE=4 LONG_FRAC=0.25 LONG_WORDS=6000
#   SHORT_WORDS=60 MAX_TOKENS=64 TIME_SCALE=1 PREFILL_TPS=10000
#   DECODE_STEP_MS=20 BATCHED_TOKENS=2048 DPD_THRESHOLD=1024
#   BENCH_PORT_BASE=18680 NGINX=/usr/sbin/nginx
set -euo pipefail

. "$(dirname "$0")/lib.sh"

DURATION=${DURATION:-30}
RATE=${RATE:-4}
LONG_FRAC=${LONG_FRAC:-0.25}
LONG_WORDS=${LONG_WORDS:-6000}
SHORT_WORDS=${SHORT_WORDS:-60}
MAX_TOKENS=${MAX_TOKENS:-64}
TIME_SCALE=${TIME_SCALE:-1}
PREFILL_TPS=${PREFILL_TPS:-10000}
DECODE_STEP_MS=${DECODE_STEP_MS:-20}
BATCHED_TOKENS=${BATCHED_TOKENS:-2048}
DPD_THRESHOLD=${DPD_THRESHOLD:-1024}
BASE=${BENCH_PORT_BASE:-18680}

EMU_PORT=$BASE
SIDE_PORT=$((BASE + 1))
LMC_INIT=$((BASE + 2))
LMC_ALLOC=$((BASE + 3))
COLOC_PORT=$((BASE + 4))
DPD_PORT=$((BASE + 5))

bench_require "$MODULE" "$BUILD/libdpdtok.so" "$TOK/tokenizer.json"
bench_workdir dpd-bench

emu() {    # host role
    python3 "$ROOT/tools/vllm_emu.py" --host "$1" --port "$EMU_PORT" \
        --role "$2" --tokenizer "$TOK/tokenizer.json" \
        --tokenizer-config "$TOK/tokenizer_config.json" \
        --side-channel-port "$SIDE_PORT" --lmcache-init-port "$LMC_INIT" \
        --lmcache-alloc-port "$LMC_ALLOC" --time-scale "$TIME_SCALE" \
        --prefill-tps "$PREFILL_TPS" --decode-step-ms "$DECODE_STEP_MS" \
        --max-num-batched-tokens "$BATCHED_TOKENS" --kv-hold-timeout 120 \
        --exit-with-parent $$ >"$WORK/emu-$1.log" 2>&1 &
    PIDS+=($!)
}

emu 127.0.0.2 both        # (a) co-located pair
emu 127.0.0.3 both
emu 127.0.0.4 prefill     # (b) DPD pair
emu 127.0.0.5 decode

for h in 2 3 4 5; do
    for _ in $(seq 1 100); do
        curl -sf "http://127.0.0.$h:$EMU_PORT/health" >/dev/null && break
        sleep 0.1
    done
done

cat >"$WORK/nginx.conf" <<EOF
load_module $MODULE;
worker_processes 2;
pid $WORK/nginx.pid;
error_log $WORK/error.log warn;
events { worker_connections 4096; }
http {
    client_body_temp_path $WORK/body;
    proxy_temp_path $WORK/proxy;
    access_log off;
    dpd_tokenizer $TOK/tokenizer.json config=$TOK/tokenizer_config.json;
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_buffering off;
    proxy_read_timeout 600s;
    client_body_buffer_size 256k;

    upstream coloc  { zone coloc 64k; dpd_balance;
                      server 127.0.0.2:$EMU_PORT; server 127.0.0.3:$EMU_PORT;
                      keepalive 64; }
    upstream prefill { zone prefill 64k; dpd_balance;
                       server 127.0.0.4:$EMU_PORT; keepalive 64; }
    upstream decode  { zone decode 64k; dpd_balance;
                       server 127.0.0.5:$EMU_PORT; keepalive 64; }

    server {
        listen 127.0.0.1:$COLOC_PORT;
        location /v1/ {
            dpd on;
            proxy_pass http://coloc;
            add_header X-DPD-Route \$dpd_route always;
        }
    }
    server {
        listen 127.0.0.1:$DPD_PORT;
        location /v1/ {
            dpd on;
            dpd_threshold $DPD_THRESHOLD;
            dpd_protocol nixl;
            dpd_prefill_pass /_dpd_prefill;
            dpd_prefill_timeout 300s;
            proxy_pass http://decode;
            add_header X-DPD-Route \$dpd_route always;
        }
        location /_dpd_prefill/ {
            internal;
            subrequest_output_buffer_size 256k;
            proxy_pass http://prefill/;
        }
    }
}
EOF
"$NGINX" -p "$WORK" -c "$WORK/nginx.conf" -e "$WORK/error.log"

LOAD=(python3 "$ROOT/bench/dpd_load.py" --duration "$DURATION" --rate "$RATE"
      --long-frac "$LONG_FRAC" --long-words "$LONG_WORDS"
      --short-words "$SHORT_WORDS" --short-max-tokens "$MAX_TOKENS"
      --long-max-tokens "$MAX_TOKENS" --seed 7)

echo "# workload: ${DURATION}s of Poisson arrivals at ${RATE}/s, ${LONG_FRAC} long" \
     "(~${LONG_WORDS} words), ${MAX_TOKENS} output tokens, streamed;" \
     "emulator: prefill ${PREFILL_TPS} tok/s, decode step ${DECODE_STEP_MS} ms," \
     "${BATCHED_TOKENS} batched tokens, time scale ${TIME_SCALE}"
echo "# (a) co-located: 2 x --role both    (b) DPD: 1 prefill + 1 decode, nixl," \
     "threshold ${DPD_THRESHOLD}"
"${LOAD[@]}" --url "http://127.0.0.1:$COLOC_PORT" --label colocated \
    | tee "$WORK/a.out"
"${LOAD[@]}" --url "http://127.0.0.1:$DPD_PORT" --label dpd \
    | tee "$WORK/b.out"

python3 - "$WORK/a.out" "$WORK/b.out" <<'EOF'
import json, sys
def load(p):
    for line in open(p):
        if line.startswith("JSON "):
            return json.loads(line[5:])
a, b = load(sys.argv[1]), load(sys.argv[2])
def ratio(x, y):
    return x / y if y else float("nan")
print("# short-request inter-token gap p99: co-located %.1f ms, DPD %.1f ms"
      " -> %.1fx lower with DPD"
      % (a["short"]["itl_ms_p99"], b["short"]["itl_ms_p99"],
         ratio(a["short"]["itl_ms_p99"], b["short"]["itl_ms_p99"])))
print("# long-request TTFT p50: co-located %.0f ms, DPD %.0f ms; DPD long"
      " requests with KV reused: mean cached tokens %.0f of %.0f"
      % (a["long"]["ttft_ms_p50"], b["long"]["ttft_ms_p50"],
         b["long"]["cached_tokens_mean"] or 0,
         b["long"]["prompt_tokens_mean"] or 0))
print("# DPD routes: short %s, long %s"
      % (b["short"]["routes"], b["long"]["routes"]))
EOF
