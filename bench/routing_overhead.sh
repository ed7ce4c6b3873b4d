#!/usr/bin/env bash
# Routing overhead of ngx_http_dpd_module on the direct path.
#
# One nginx, one worker, four servers:
#   backend  a location returning a canned SSE answer (the "fast backend")
#   plain    proxy_pass to the backend
#   exact    the same proxy_pass with "dpd on" and "dpd_count exact" (the
#            default): body read, JSON parse, chat template, exact token
#            count, decision
#   bound    the same with "dpd_count bound": the BPE count is skipped when
#            the rendered prompt's byte bound is below the threshold
# Both dpd servers use dpd_threshold $THRESHOLD (default 4096, the module's
# default) and no prefill pool, so every request is proxied to the backend
# (observe mode).  wrk POSTs the same chat request to the three servers,
# for prompts of ~100 and ~4096 tokens, in turn ROUNDS times; the median
# requests/s of each is compared with plain.  The module's own decision
# time ($dpd_decision_time, read + parse + count) is measured in separate,
# logged passes.  Target (README.md, Benchmarks): dpd >= 0.9x plain at 100 tokens.
#
# Usage: bench/routing_overhead.sh          (after `make`)
# Printed per size: median req/s of plain, exact and bound and the ratios
# to plain, and the same ratios from the nginx worker's CPU time per request
# (plain CPU / dpd CPU: what the throughput ratio is when nginx is the
# bottleneck; steadier than req/s when other jobs share the machine).
# Knobs (env): DURATION=8 ROUNDS=3 CONNS=16 THRESHOLD=4096
#              BENCH_PORT_BASE=18690 (uses BASE .. BASE+5)
set -euo pipefail

. "$(dirname "$0")/lib.sh"
DURATION=${DURATION:-8}
ROUNDS=${ROUNDS:-3}
CONNS=${CONNS:-16}
THRESHOLD=${THRESHOLD:-4096}
BASE=${BENCH_PORT_BASE:-18690}
BACK=$BASE
PLAIN=$((BASE + 1))
EXACT=$((BASE + 2))
BOUND=$((BASE + 3))
EXACTLOG=$((BASE + 4))
BOUNDLOG=$((BASE + 5))

command -v wrk >/dev/null || { echo "wrk is not installed (apt-get install wrk)" >&2; exit 1; }
bench_require "$MODULE" "$TOK/tokenizer.json"
bench_workdir dpd-overhead

# pin nginx and wrk to different CPUs when there are two
PIN_NGINX=() PIN_WRK=()
if command -v taskset >/dev/null && [[ $(nproc) -ge 2 ]]; then
    PIN_NGINX=(taskset -c 0) PIN_WRK=(taskset -c 1)
fi

SSE='data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"Hello"},"finish_reason":null}]}\n\ndata: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" world"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'

cat >"$WORK/nginx.conf" <<EOF
load_module $MODULE;
worker_processes 1;
pid $WORK/nginx.pid;
error_log $WORK/error.log warn;
events { worker_connections 4096; }
http {
    client_body_temp_path $WORK/body;
    proxy_temp_path $WORK/proxy;
    access_log off;
    keepalive_requests 100000;
    client_body_buffer_size 128k;
    dpd_tokenizer $TOK/tokenizer.json config=$TOK/tokenizer_config.json;

    log_format decision '\$dpd_prompt_tokens \$dpd_decision_time';

    upstream back { server 127.0.0.1:$BACK; keepalive 64; }

    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_buffering off;

    server {
        listen 127.0.0.1:$BACK;
        location / {
            default_type text/event-stream;
            return 200 '$SSE';
        }
    }
    server {
        listen 127.0.0.1:$PLAIN;
        location /v1/ { proxy_pass http://back; }
    }
    server {
        listen 127.0.0.1:$EXACT;
        location /v1/ {
            dpd on;
            dpd_count exact;
            dpd_threshold $THRESHOLD;
            proxy_pass http://back;
        }
    }
    server {
        listen 127.0.0.1:$BOUND;
        location /v1/ {
            dpd on;
            dpd_count bound;
            dpd_threshold $THRESHOLD;
            proxy_pass http://back;
        }
    }
    server {
        listen 127.0.0.1:$EXACTLOG;
        location /v1/ {
            dpd on;
            dpd_count exact;
            dpd_threshold $THRESHOLD;
            proxy_pass http://back;
            add_header X-Tokens \$dpd_prompt_tokens;
            access_log $WORK/decision-exact.log decision;
        }
    }
    server {
        listen 127.0.0.1:$BOUNDLOG;
        location /v1/ {
            dpd on;
            dpd_count bound;
            dpd_threshold $THRESHOLD;
            proxy_pass http://back;
            access_log $WORK/decision-bound.log decision;
        }
    }
}
EOF
"${PIN_NGINX[@]}" "$NGINX" -p "$WORK" -c "$WORK/nginx.conf" -e "$WORK/error.log"
sleep 0.3

# a chat body of about $1 prompt tokens, counted by the module itself
make_body() {
    local target=$1 words=$(( $1 * 3 / 4 )) got
    for _ in 1 2 3 4 5 6; do
        python3 - "$words" >"$WORK/body-$target.json" <<'EOF'
import json, random, sys
rng = random.Random(42)
w = ("the of and to in is that for it as was with be by on not this are "
     "or from at which but have an they you were their one all we can her "
     "has there been if more when will would who so no model token cache "
     "river mountain history science music garden window silver").split()
text = " ".join(rng.choice(w) for _ in range(int(sys.argv[1])))
print(json.dumps({"model": "m", "stream": True, "max_tokens": 16,
                  "messages": [{"role": "user", "content": text}]}), end="")
EOF
        got=$(curl -s -o /dev/null -D - -H 'Content-Type: application/json' \
                --data-binary @"$WORK/body-$target.json" \
                "http://127.0.0.1:$EXACTLOG/v1/chat/completions" \
              | tr -d '\r' | awk -F': ' 'tolower($1)=="x-tokens"{print $2}')
        [[ -n $got ]] || { echo "no token count from the module" >&2; exit 1; }
        if (( got * 100 >= target * 98 && got * 100 <= target * 102 )); then
            break
        fi
        words=$(( words * target / got ))
    done
    echo "$got"
}

T100=$(make_body 100)
T4096=$(make_body 4096)

cat >"$WORK/post.lua" <<'EOF'
local f = io.open(os.getenv("BODY_FILE"), "rb")
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"
EOF

# the worker's CPU time (user + system), in clock ticks
WORKER=$(pgrep -P "$(cat "$WORK/nginx.pid")" | head -1)
TICK=$(getconf CLK_TCK)
cpu_ticks() { awk '{print $14 + $15}' "/proc/$WORKER/stat"; }

# port tokens -> "rps latency_avg cpu_us_per_request"
# CPU per request (the worker serves the proxy and the backend location):
# far less sensitive than req/s to other jobs on a shared machine
run_wrk() {
    local c0 c1
    c0=$(cpu_ticks)
    BODY_FILE="$WORK/body-$2.json" "${PIN_WRK[@]}" wrk -t1 -c"$CONNS" \
        -d"${DURATION}s" -s "$WORK/post.lua" \
        "http://127.0.0.1:$1/v1/chat/completions" >"$WORK/wrk.out" 2>&1
    c1=$(cpu_ticks)
    if grep -q "Non-2xx" "$WORK/wrk.out"; then
        echo "non-2xx answers on port $1:" >&2
        cat "$WORK/wrk.out" >&2
        exit 1
    fi
    awk -v c=$((c1 - c0)) -v hz="$TICK" '
        /Requests\/sec/{r=$2} /^    Latency/{l=$2} / requests in /{n=$1}
        END{printf "%s %s %.2f\n", r, l, (n ? c * 1e6 / hz / n : 0)}' \
        "$WORK/wrk.out"
}

median() { sort -g | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }

echo "# nginx 1 worker, wrk 1 thread x $CONNS connections, ${DURATION}s x $ROUNDS rounds each, dpd_threshold $THRESHOLD"
for t in 100 4096; do
    tok=$([[ $t == 100 ]] && echo "$T100" || echo "$T4096")
    for s in PLAIN EXACT BOUND; do      # warm up every path
        run_wrk "${!s}" "$t" >/dev/null
        : >"$WORK/$s-$t"
    done
    for _ in $(seq 1 "$ROUNDS"); do
        for s in PLAIN EXACT BOUND; do
            run_wrk "${!s}" "$t" >>"$WORK/$s-$t"
        done
    done
    p=$(cut -d' ' -f1 "$WORK/PLAIN-$t" | median)
    e=$(cut -d' ' -f1 "$WORK/EXACT-$t" | median)
    b=$(cut -d' ' -f1 "$WORK/BOUND-$t" | median)
    printf "prompt %5s tokens: plain %9.0f req/s  exact %9.0f req/s (ratio %.3f)  bound %9.0f req/s (ratio %.3f)\n" \
        "$tok" "$p" "$e" "$(echo "$e / $p" | bc -l)" \
        "$b" "$(echo "$b / $p" | bc -l)"
    # the same ratios from the worker's CPU time per request
    p=$(cut -d' ' -f3 "$WORK/PLAIN-$t" | median)
    e=$(cut -d' ' -f3 "$WORK/EXACT-$t" | median)
    b=$(cut -d' ' -f3 "$WORK/BOUND-$t" | median)
    printf "      worker CPU/request: plain %7.2f us  exact %7.2f us (ratio %.3f)  bound %7.2f us (ratio %.3f)\n" \
        "$p" "$e" "$(echo "$p / $e" | bc -l)" \
        "$b" "$(echo "$p / $b" | bc -l)"
    for s in PLAIN EXACT BOUND; do
        printf "    latency avg %-5s: %s\n" "$s" \
            "$(awk '{print $2}' "$WORK/$s-$t" | tr '\n' ' ')"
    done
done

# decision time, logged passes: 3 s of requests per size and mode
for mode in exact bound; do
    port=$([[ $mode == exact ]] && echo "$EXACTLOG" || echo "$BOUNDLOG")
    for t in 100 4096; do
        : >"$WORK/decision-$mode.log"
        BODY_FILE="$WORK/body-$t.json" "${PIN_WRK[@]}" wrk -t1 -c4 -d3s \
            -s "$WORK/post.lua" "http://127.0.0.1:$port/v1/chat/completions" \
            >/dev/null 2>&1
        sleep 0.2
        awk '{print $2}' "$WORK/decision-$mode.log" | sort -n \
        | awk -v t="$t" -v m="$mode" '
            {a[NR]=$1; s+=$1}
            END { if (NR == 0) { print "no decision samples"; exit }
                  i50 = int(NR * 0.5) + 1; i99 = int(NR * 0.99) + 1
                  if (i99 > NR) i99 = NR
                  printf "decision time, dpd_count %s, %s-token prompt: mean %.0f us, p50 %d us, p99 %d us (n=%d)\n",
                         m, t, s / NR, a[i50], a[i99], NR }'
    done
done
