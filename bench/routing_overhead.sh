#!/usr/bin/env bash
# Routing overhead of ngx_http_dpd_module, and the stall a long prompt
# causes, against plain proxy_pass measured in the same run.
#
# One nginx, one worker, servers:
#   backend  a location returning a canned SSE answer (the "fast backend";
#            its NIXL twin answers prefill requests)
#   plain    proxy_pass to the backend
#   exact    the same proxy_pass with "dpd on" and "dpd_count exact" (the
#            default): body read, JSON parse, chat template, exact token
#            count, decision
#   bound    the same with "dpd_count bound": the BPE count is skipped when
#            the rendered prompt's byte bound is below the threshold
#   disagg   "dpd on", dpd_threshold 0, dpd_protocol nixl: every request
#            prefilled (subrequest to the NIXL twin) then decoded
#   thread   "dpd on" with dpd_count_thread_pool (bodies of 32k or more)
# The dpd servers use dpd_threshold $THRESHOLD (default 4096, the module's
# default) unless said; exact and bound have no prefill pool (observe
# mode).  wrk POSTs the same chat request, for prompts of ~100, ~1000 and
# ~4096 tokens, in turn ROUNDS times; the median requests/s of each is
# compared with plain.  The module's own decision time ($dpd_decision_time,
# read + parse + count) is measured in separate, logged passes.
#
# Stall: a client posts ~100k-token prompts (words no cache has seen) one
# after the other to a plain proxy_pass server, to the inline server
# (short: dpd on, counted in place) or to the thread server, while wrk
# measures the latency of short requests (1 connection) on the same
# worker; "added p99" is their p99 minus the p99 without the stream, the
# median of STALL_ROUNDS interleaved rounds.  These servers proxy to a
# second nginx (one worker) that reads the whole request body before it
# answers, as vLLM does: the in-worker backend above answers before the
# body is read, and a keepalive upstream connection reused after such an
# early answer delays the next request on it by ~40 ms (Linux's delayed
# ACK), for plain proxy_pass as much as for the module, which would hide
# what the count costs.  nginx is not pinned for that part (the pool's
# thread needs a core).
#
# Soak: SOAK seconds of mixed requests (short, 4096-token, 100k-token in
# the thread pool, disaggregated, malformed) after WARM_SOAK seconds of
# warm-up; the worker's VmRSS sampled every 5 s, its spread printed.
#
# Targets (issue 14): direct >= 0.9x plain at 100 tokens, disaggregated
# >= 0.45x, decision for a 4096-token chat <= 120 us p50, added p99 <= 2 ms
# with the thread pool, RSS within +-5 %.
#
# Usage: bench/routing_overhead.sh          (after `make`)
# Printed per size: median req/s of plain, exact and bound (and of the
# backend alone and disagg at 100 tokens) and the ratios to plain, and the
# same ratios from the nginx worker's CPU time per request (plain CPU / dpd
# CPU: what the throughput ratio is when nginx is the bottleneck; steadier
# than req/s when other jobs share the machine).  Instruction counts per
# request (repeatable on a shared machine): bench/request_cost.sh.
# Knobs (env): DURATION=8 ROUNDS=3 CONNS=16 THRESHOLD=4096 STALL=10
#              STALL_ROUNDS=3 SOAK=60 WARM_SOAK=10 (SOAK=0: skip)
#              PARTS="ratio decision stall soak" (the parts to run)
#              SIZES="100 1000 4096" (the prompt sizes of the ratio part)
#              BENCH_PORT_BASE=18690 (uses BASE .. BASE+12)
set -euo pipefail

. "$(dirname "$0")/lib.sh"
DURATION=${DURATION:-8}
# PREFIX=approximate: the dpd servers (exact, bound and their decision
# logs) choose their decoder with dpd_prefix_cache through a dpd_balance
# upstream of the same backend (issue 23: the direct path with the cache
# on stays >= 0.85x plain proxy_pass)
PREFIX=${PREFIX:-}
if [[ -n $PREFIX ]]; then
    PFX_CONF="dpd_decode_upstream backd; dpd_prefix_cache $PREFIX;"
    DIRECT_UP=backd
else
    PFX_CONF=""
    DIRECT_UP=back
fi
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
DISAGG=$((BASE + 6))
PREF=$((BASE + 7))
THREAD=$((BASE + 8))
SHORT=$((BASE + 9))
STALLPLAIN=$((BASE + 10))
READER=$((BASE + 11))
CANNED=$((BASE + 12))
STALL=${STALL:-10}
STALL_ROUNDS=${STALL_ROUNDS:-3}
PARTS=${PARTS:-ratio decision stall soak}
SIZES=${SIZES:-100 1000 4096}
part() { [[ " $PARTS " == *" $1 "* ]]; }
SOAK=${SOAK:-60}
WARM_SOAK=${WARM_SOAK:-10}

command -v wrk >/dev/null || { echo "wrk is not installed (apt-get install wrk)" >&2; exit 1; }
bench_require "$MODULE" "$TOK/tokenizer.json"
bench_workdir dpd-overhead

# pin nginx and wrk to different CPUs when there are two
PIN_NGINX=() PIN_WRK=()
if command -v taskset >/dev/null && [[ $(nproc) -ge 2 ]]; then
    PIN_NGINX=(taskset -c 0) PIN_WRK=(taskset -c 1)
fi

SSE='data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"Hello"},"finish_reason":null}]}\n\ndata: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" world"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'

NIXL='{"id":"p","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"H"},"finish_reason":"length"}],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"engine-0","remote_request_id":"r-0","remote_block_ids":[1,2,3,4],"remote_host":"127.0.0.1","remote_port":5600,"tp_size":1}}'

cat >"$WORK/nginx.conf" <<EOF
load_module $MODULE;
worker_processes 1;
thread_pool dpdcount threads=1;
pid $WORK/nginx.pid;
error_log $WORK/error.log warn;
events { worker_connections 4096; }
http {
    client_body_temp_path $WORK/body;
    proxy_temp_path $WORK/proxy;
    access_log off;
    keepalive_requests 100000;
    client_body_buffer_size 256k;
    dpd_tokenizer $TOK/tokenizer.json config=$TOK/tokenizer_config.json;

    log_format decision '\$dpd_prompt_tokens \$dpd_decision_time';

    client_max_body_size 16m;

    upstream back { server 127.0.0.1:$BACK; keepalive 64; }
    upstream backd {
        dpd_balance;
        zone backd 64k;
        server 127.0.0.1:$BACK;
        keepalive 64;
    }
    upstream pref { server 127.0.0.1:$PREF; keepalive 64; }
    upstream reader { server 127.0.0.1:$READER; keepalive 64; }

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
        listen 127.0.0.1:$PREF;
        location / {
            default_type application/json;
            return 200 '$NIXL';
        }
    }
    server {
        listen 127.0.0.1:$DISAGG;
        location /v1/ {
            dpd on;
            dpd_threshold 0;
            dpd_protocol nixl;
            dpd_prefill_pass /_dpd_prefill;
            proxy_pass http://back;
        }
        location /_dpd_prefill/ {
            internal;
            proxy_set_header Accept-Encoding "";
            proxy_set_header Connection "";
            proxy_pass http://pref/;
        }
    }
    server {
        listen 127.0.0.1:$THREAD;
        location /v1/ {
            dpd on;
            dpd_threshold $THRESHOLD;
            dpd_count_thread_pool dpdcount;
            proxy_pass http://reader;
        }
    }
    server {
        listen 127.0.0.1:$SHORT;
        location /v1/ {
            dpd on;
            dpd_threshold $THRESHOLD;
            proxy_pass http://reader;
        }
    }
    server {
        listen 127.0.0.1:$STALLPLAIN;
        location /v1/ { proxy_pass http://reader; }
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
            $PFX_CONF
            proxy_pass http://$DIRECT_UP;
        }
    }
    server {
        listen 127.0.0.1:$BOUND;
        location /v1/ {
            dpd on;
            dpd_count bound;
            dpd_threshold $THRESHOLD;
            $PFX_CONF
            proxy_pass http://$DIRECT_UP;
        }
    }
    server {
        listen 127.0.0.1:$EXACTLOG;
        location /v1/ {
            dpd on;
            dpd_count exact;
            dpd_threshold $THRESHOLD;
            $PFX_CONF
            proxy_pass http://$DIRECT_UP;
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
            $PFX_CONF
            proxy_pass http://$DIRECT_UP;
            access_log $WORK/decision-bound.log decision;
        }
    }
}
EOF
# the stall part's backend, like a vLLM pod: its own process, and it reads
# the whole request body before it answers (proxy_pass buffers the body;
# only the headers go on to the canned answer)
mkdir -p "$WORK/reader"
{ bench_conf_head "$WORK/reader"; cat <<EOF
    client_max_body_size 16m;
    client_body_buffer_size 1m;
    server {
        listen 127.0.0.1:$READER;
        location / {
            proxy_pass http://127.0.0.1:$CANNED;
            proxy_pass_request_body off;
            proxy_set_header Content-Length "";
        }
    }
    server {
        listen 127.0.0.1:$CANNED;
        location / {
            default_type text/event-stream;
            return 200 '$SSE';
        }
    }
}
EOF
} >"$WORK/reader/nginx.conf"
"$NGINX" -p "$WORK/reader" -c "$WORK/reader/nginx.conf" -e "$WORK/reader/error.log"
PIDS+=("$(sleep 0.2; cat "$WORK/reader/nginx.pid")")
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
T1000=$(make_body 1000)
T4096=$(make_body 4096)

# ~100k tokens of words no cache has seen (the pre-token cache would make
# a repeated vocabulary cheap): the stall's long prompt
python3 - "$WORK/body-long.json" <<'EOF'
import json, random, sys
rng = random.Random(7)
text = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                        for _ in range(rng.randint(3, 9)))
                for _ in range(29500))
with open(sys.argv[1], "w") as f:
    f.write(json.dumps({"model": "m", "stream": True, "max_tokens": 16,
                        "messages": [{"role": "user", "content": text}]}))
EOF
TLONG=$(curl -s -o /dev/null -D - -H 'Content-Type: application/json' \
          --data-binary @"$WORK/body-long.json" \
          "http://127.0.0.1:$EXACTLOG/v1/chat/completions" \
        | tr -d '\r' | awk -F': ' 'tolower($1)=="x-tokens"{print $2}')
printf '{"model":"m","messages":[{"role":"user","content":"hi"}' \
    >"$WORK/body-bad.json"

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

# FIELD SERVER [INVERT]: the median over rounds of SERVER's FIELD against
# plain's in the same round (each round runs the servers back to back, so a
# machine that slows down for a while slows both sides of a pair: steadier
# than the ratio of the medians when other jobs share the host)
paired() {
    paste -d' ' "$WORK/PLAIN-$t" "$WORK/$2-$t" \
        | awk -v f="$1" -v inv="${3:-0}" '{
              p = $f; d = $(f + 3)
              if (p > 0 && d > 0) print (inv ? p / d : d / p) }' \
        | median
}

part ratio &&
echo "# nginx 1 worker, wrk 1 thread x $CONNS connections, ${DURATION}s x $ROUNDS rounds each, dpd_threshold $THRESHOLD"
part ratio &&
for t in $SIZES; do
    case $t in
    100)  tok=$T100;  servers="BACK PLAIN EXACT BOUND DISAGG" ;;
    1000) tok=$T1000; servers="PLAIN EXACT BOUND" ;;
    *)    tok=$T4096; servers="PLAIN EXACT BOUND" ;;
    esac
    for s in $servers; do      # warm up every path
        run_wrk "${!s}" "$t" >/dev/null
        : >"$WORK/$s-$t"
    done
    for _ in $(seq 1 "$ROUNDS"); do
        for s in $servers; do
            run_wrk "${!s}" "$t" >>"$WORK/$s-$t"
        done
    done
    p=$(cut -d' ' -f1 "$WORK/PLAIN-$t" | median)
    e=$(cut -d' ' -f1 "$WORK/EXACT-$t" | median)
    b=$(cut -d' ' -f1 "$WORK/BOUND-$t" | median)
    printf "prompt %5s tokens: plain %9.0f req/s  exact %9.0f req/s (ratio %.3f)  bound %9.0f req/s (ratio %.3f)\n" \
        "$tok" "$p" "$e" "$(echo "$e / $p" | bc -l)" \
        "$b" "$(echo "$b / $p" | bc -l)"
    printf "      paired by round (median of each round's ratio to plain): exact %.3f  bound %.3f%s\n" \
        "$(paired 1 EXACT)" "$(paired 1 BOUND)" \
        "$([[ $t == 100 ]] && printf '  disaggregated %.3f' "$(paired 1 DISAGG)")"
    if [[ $t == 100 ]]; then
        k=$(cut -d' ' -f1 "$WORK/BACK-$t" | median)
        g=$(cut -d' ' -f1 "$WORK/DISAGG-$t" | median)
        printf "                    backend alone %9.0f req/s (plain/backend %.3f)  disaggregated %9.0f req/s (ratio %.3f)\n" \
            "$k" "$(echo "$p / $k" | bc -l)" "$g" "$(echo "$g / $p" | bc -l)"
    fi
    # the same ratios from the worker's CPU time per request
    p=$(cut -d' ' -f3 "$WORK/PLAIN-$t" | median)
    e=$(cut -d' ' -f3 "$WORK/EXACT-$t" | median)
    b=$(cut -d' ' -f3 "$WORK/BOUND-$t" | median)
    printf "      worker CPU/request: plain %7.2f us  exact %7.2f us (ratio %.3f)  bound %7.2f us (ratio %.3f)\n" \
        "$p" "$e" "$(echo "$p / $e" | bc -l)" \
        "$b" "$(echo "$p / $b" | bc -l)"
    printf "      worker CPU/request paired by round: exact %.3f  bound %.3f%s\n" \
        "$(paired 3 EXACT 1)" "$(paired 3 BOUND 1)" \
        "$([[ $t == 100 ]] && printf '  disaggregated %.3f' "$(paired 3 DISAGG 1)")"
    if [[ $t == 100 ]]; then
        g=$(cut -d' ' -f3 "$WORK/DISAGG-$t" | median)
        printf "      worker CPU/request: disaggregated %7.2f us (ratio %.3f)\n" \
            "$g" "$(echo "$p / $g" | bc -l)"
    fi
    for s in $servers; do
        printf "    latency avg %-6s: %s\n" "$s" \
            "$(awk '{print $2}' "$WORK/$s-$t" | tr '\n' ' ')"
    done
done

# decision time, logged passes: 3 s of requests per size and mode
part decision &&
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

# --- stall: short requests while ~100k-token prompts are counted ---------

# p99 of short requests (ms) on one connection for STALL seconds, while
# $1 (a port, or "none") gets the long prompts one after the other
stall_p99() {
    local feeder=
    if [[ $1 != none ]]; then
        python3 - "$1" "$WORK/body-long.json" "$STALL" <<'EOF' &
import http.client, sys, time
port, body, end = int(sys.argv[1]), open(sys.argv[2], "rb").read(), \
    time.time() + float(sys.argv[3]) + 1
c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
while time.time() < end:
    c.request("POST", "/v1/chat/completions", body,
              {"Content-Type": "application/json"})
    c.getresponse().read()
EOF
        feeder=$!
        sleep 0.5
    fi
    BODY_FILE="$WORK/body-100.json" wrk -t1 -c1 -d"${STALL}s" --latency \
        -s "$WORK/post.lua" "http://127.0.0.1:$SHORT/v1/chat/completions" \
        >"$WORK/stall.out" 2>&1
    [[ -n $feeder ]] && wait "$feeder"
    awk '$1 == "99%" { v = $2
            if (v ~ /us$/) { sub(/us$/, "", v); v /= 1000 }
            else if (v ~ /ms$/) { sub(/ms$/, "", v) }
            else if (v ~ /s$/) { sub(/s$/, "", v); v *= 1000 }
            printf "%.3f\n", v }' "$WORK/stall.out"
}

taskset -apc 0-$(($(nproc) - 1)) "$WORKER" >/dev/null 2>&1 || true
if part stall; then
for s in none STALLPLAIN SHORT THREAD; do : >"$WORK/stall-$s"; done
for r in $(seq 1 "$STALL_ROUNDS"); do
    stall_p99 none >>"$WORK/stall-none"
    for s in STALLPLAIN SHORT THREAD; do
        stall_p99 "${!s}" >>"$WORK/stall-$s"
    done
done
base=$(median <"$WORK/stall-none")
pln=$(median <"$WORK/stall-STALLPLAIN")
inl=$(median <"$WORK/stall-SHORT")
thr=$(median <"$WORK/stall-THREAD")
printf "stall, %s-token prompts streamed (median of %d rounds of %ss): short-request p99 %.3f ms alone; the stream through plain proxy_pass %.3f ms (added %.3f ms); inline count %.3f ms (added %.3f ms); dpd_count_thread_pool %.3f ms (added %.3f ms)\n" \
    "$TLONG" "$STALL_ROUNDS" "$STALL" "$base" \
    "$pln" "$(echo "$pln - $base" | bc -l)" \
    "$inl" "$(echo "$inl - $base" | bc -l)" \
    "$thr" "$(echo "$thr - $base" | bc -l)"
for s in none STALLPLAIN SHORT THREAD; do
    printf "    p99 rounds %-10s: %s\n" "$s" "$(tr '\n' ' ' <"$WORK/stall-$s")"
done
fi

# --- soak: RSS over mixed requests --------------------------------------

if (( SOAK > 0 )) && part soak; then
    cat >"$WORK/mixed.lua" <<EOF
local files = { "$WORK/body-100.json", "$WORK/body-4096.json",
                "$WORK/body-long.json", "$WORK/body-100.json",
                "$WORK/body-bad.json", "$WORK/body-1000.json" }
local reqs, i = {}, 0
for k, f in ipairs(files) do
    local h = io.open(f, "rb")
    reqs[k] = wrk.format("POST", "/v1/chat/completions",
        { ["Content-Type"] = "application/json" }, h:read("*a"))
    h:close()
end
request = function() i = i % #reqs + 1; return reqs[i] end
EOF
    # the mix to four servers at once (inline, thread pool, disaggregated,
    # the bench's exact server)
    soak_run() {
        local port
        for port in $SHORT $THREAD $DISAGG $EXACT; do
            wrk -t1 -c4 -d"$1s" -s "$WORK/mixed.lua" \
                "http://127.0.0.1:$port/v1/chat/completions" \
                >"$WORK/soak-$port.out" 2>&1 &
        done
        wait
    }
    rss() { awk '/^VmRSS/{print $2}' "/proc/$WORKER/status"; }
    soak_run "$WARM_SOAK"
    : >"$WORK/rss"
    soak_run "$SOAK" &
    soaker=$!
    for _ in $(seq 0 5 "$SOAK"); do rss >>"$WORK/rss"; sleep 5; done
    wait "$soaker"
    rss >>"$WORK/rss"
    n=$(cat "$WORK"/soak-*.out | awk '/ requests in /{n += $1} END{print n + 0}')
    echo "soak: $n requests"
    awk 'NR == 1 {f = $1; lo = $1; hi = $1}
         {if ($1 < lo) lo = $1; if ($1 > hi) hi = $1; last = $1}
         END {printf "soak %ss of mixed requests after %ss: worker VmRSS first %d kB, min %d, max %d, last %d (spread %+.1f%% .. %+.1f%% of the first)\n",
                     '"$SOAK"', '"$WARM_SOAK"', f, lo, hi, last,
                     (lo - f) * 100 / f, (hi - f) * 100 / f}' "$WORK/rss"
fi
