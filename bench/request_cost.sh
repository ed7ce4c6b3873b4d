#!/usr/bin/env bash
# Instructions per request of the gateway paths, counted by callgrind:
# repeatable on a shared machine where req/s is not.
#
# A backend nginx (not measured) answers the decode requests with a
# canned SSE stream and the prefill requests with a canned NIXL reply.
# The measured nginx runs as one process (master_process off) under
# valgrind --tool=callgrind with four servers:
#   plain   proxy_pass to the backend
#   direct  "dpd on" (dpd_count exact, dpd_threshold 4096): body read,
#           parse, count, decision, proxy_pass (100-token prompt)
#   direct1k  the same with a 1000-token prompt
#   disagg  "dpd on", dpd_threshold 0, dpd_protocol nixl: prefill
#           subrequest + decode body + proxy_pass (100-token prompt)
#   balanced  "dpd on" through a dpd_balance upstream (the baseline of:)
#   prefix  the same with "dpd_prefix_cache approximate" (keys, lookup,
#           pin, remember; the same prompt each time: a full hit), 100
#           and 1000 tokens, and a 32k-token chat turn by turn
#   long    ~100k-token chats (words no cache has seen) counted inline
#           and with dpd_count_thread_pool: the instructions of the event
#           loop's thread alone per request (what every other request on
#           the worker waits for) and of the pool's thread
# For each, WARM requests, callgrind_control --zero, COUNT requests on
# one keep-alive connection, callgrind_control --dump; Ir / COUNT is the
# cost of a request (the driver is outside valgrind).
#
# Usage: bench/request_cost.sh            (after `make`)
# Knobs (env): COUNT=200 WARM=50 LONG=10 (long requests measured)
#              BENCH_PORT_BASE=18720 (BASE .. BASE+7)
#              KEEP=dir  (keep the callgrind files there, for
#                         callgrind_annotate)
set -euo pipefail

. "$(dirname "$0")/lib.sh"
COUNT=${COUNT:-200}
WARM=${WARM:-50}
BASE=${BENCH_PORT_BASE:-18720}
BACK=$BASE
PLAIN=$((BASE + 1))
DIRECT=$((BASE + 2))
DISAGG=$((BASE + 3))
PREF=$((BASE + 4))
THREAD=$((BASE + 5))
BALANCED=$((BASE + 6))
PREFIX=$((BASE + 7))
LONG=${LONG:-10}

command -v valgrind >/dev/null || { echo "valgrind is not installed" >&2; exit 1; }
bench_require "$MODULE" "$TOK/tokenizer.json"
bench_workdir dpd-cost

SSE='data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hello"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
NIXL='{"id":"p","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"H"},"finish_reason":"length"}],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"engine-0","remote_request_id":"r-0","remote_block_ids":[1,2,3,4],"remote_host":"127.0.0.1","remote_port":5600,"tp_size":1}}'

mkdir -p "$WORK/back" "$WORK/gw"
{ bench_conf_head "$WORK/back"; cat <<EOF
    server {
        listen 127.0.0.1:$BACK;
        location / { default_type text/event-stream; return 200 '$SSE'; }
    }
    server {
        listen 127.0.0.1:$PREF;
        location / { default_type application/json; return 200 '$NIXL'; }
    }
}
EOF
} >"$WORK/back/nginx.conf"
"$NGINX" -p "$WORK/back" -c "$WORK/back/nginx.conf" -e "$WORK/back/error.log"
PIDS+=("$(sleep 0.2; cat "$WORK/back/nginx.pid")")

cat >"$WORK/gw/nginx.conf" <<EOF
load_module $MODULE;
master_process off;
daemon off;
worker_processes 1;
pid $WORK/gw/nginx.pid;
error_log $WORK/gw/error.log warn;
thread_pool dpdcount threads=1;
events { worker_connections 1024; }
http {
    client_max_body_size 16m;
    client_body_temp_path $WORK/gw;
    proxy_temp_path $WORK/gw;
    access_log off;
    keepalive_requests 100000;
    client_body_buffer_size 1m;
    dpd_tokenizer $TOK/tokenizer.json config=$TOK/tokenizer_config.json;

    upstream back { server 127.0.0.1:$BACK; keepalive 16; }
    upstream backd {
        dpd_balance;
        zone backd 64k;
        server 127.0.0.1:$BACK;
        keepalive 16;
    }
    upstream pref { server 127.0.0.1:$PREF; keepalive 16; }

    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_buffering off;

    server {
        listen 127.0.0.1:$PLAIN;
        location /v1/ { proxy_pass http://back; }
    }
    server {
        listen 127.0.0.1:$DIRECT;
        location /v1/ { dpd on; proxy_pass http://back; }
    }
    server {
        listen 127.0.0.1:$BALANCED;
        location /v1/ { dpd on; proxy_pass http://backd; }
    }
    server {
        listen 127.0.0.1:$PREFIX;
        location /v1/ {
            dpd on;
            dpd_decode_upstream backd;
            dpd_prefix_cache approximate;
            proxy_pass http://backd;
        }
    }
    server {
        listen 127.0.0.1:$THREAD;
        location /v1/ {
            dpd on;
            dpd_count_thread_pool dpdcount;
            proxy_pass http://back;
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
}
EOF

valgrind --tool=callgrind --separate-threads=yes --compress-strings=no \
    --callgrind-out-file="$WORK/cg.%p" \
    "$NGINX" -p "$WORK/gw" -c "$WORK/gw/nginx.conf" \
    >"$WORK/valgrind.log" 2>&1 &
VG=$!
PIDS+=("$VG")

for _ in $(seq 1 200); do
    grep -q "callgrind" "$WORK/valgrind.log" 2>/dev/null \
        && curl -s -o /dev/null "http://127.0.0.1:$PLAIN/" && break
    sleep 0.2
done

python3 - "$WORK" <<'EOF'
import json, random, sys
rng = random.Random(42)
w = ("the of and to in is that for it as was with be by on not this are "
     "or from at which but have an they you were their one all we can her "
     "has there been if more when will would who so no model token cache "
     "river mountain history science music garden window silver").split()
for name, words in (("100", 75), ("1000", 750)):
    text = " ".join(rng.choice(w) for _ in range(words))
    with open(f"{sys.argv[1]}/body-{name}.json", "w") as f:
        f.write(json.dumps({"model": "m", "stream": True, "max_tokens": 16,
                  "messages": [{"role": "user", "content": text}]}))
text = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                        for _ in range(rng.randint(3, 9)))
                for _ in range(29500))
# a 32k-token chat: ~24k words of history (the cache's worst case: 2k
# blocks looked up and remembered each time)
msgs = []
for t in range(16):
    msgs.append({"role": "user", "content": " ".join(rng.choice(w)
                 for _ in range(750))})
    msgs.append({"role": "assistant", "content": " ".join(rng.choice(w)
                 for _ in range(750))})
msgs.append({"role": "user", "content": "and now?"})
with open(f"{sys.argv[1]}/body-32k.json", "w") as f:
    f.write(json.dumps({"model": "m", "stream": True, "max_tokens": 16,
                        "messages": msgs}))
with open(f"{sys.argv[1]}/body-long.json", "w") as f:
    f.write(json.dumps({"model": "m", "stream": True, "max_tokens": 16,
              "messages": [{"role": "user", "content": text}]}))
EOF

cat >"$WORK/drive.py" <<'EOF'
import http.client, sys, time
port, n, body = int(sys.argv[1]), int(sys.argv[2]), open(sys.argv[3], "rb").read()
c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
for _ in range(600):            # valgrind starts slowly on a busy machine
    try:
        c.connect()
        break
    except OSError:
        time.sleep(0.1)
for i in range(n):
    c.request("POST", "/v1/chat/completions", body,
              {"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    if r.status != 200:
        sys.exit(f"port {port}: status {r.status}")
EOF

# name port body [count warm [thread]] -> Ir per request (of thread
# number "thread", default 1: the event loop; 2: the pool's thread)
measure() {
    local f n=${4:-$COUNT} w=${5:-$WARM} t=${6:-1}
    python3 "$WORK/drive.py" "$2" "$w" "$WORK/body-$3.json" || exit 1
    callgrind_control --zero "$VG" >/dev/null 2>&1
    python3 "$WORK/drive.py" "$2" "$n" "$WORK/body-$3.json" || exit 1
    callgrind_control --dump="$1" "$VG" >/dev/null 2>&1
    sleep 0.5
    f=$(grep -lx "desc: Trigger: dump $1" "$WORK"/cg.*-0"$t" | head -1)
    [[ -n $f ]] || { echo "no callgrind dump for $1" >&2; exit 1; }
    [[ -n ${KEEP:-} ]] && mkdir -p "$KEEP" && cp "$f" "$KEEP/callgrind.$1.$t"
    awk -v n="$n" '/^summary:/{printf "%.0f\n", $2 / n}' "$f"
}

P=$(measure plain "$PLAIN" 100)
D=$(measure direct "$DIRECT" 100)
K=$(measure direct1k "$DIRECT" 1000)
G=$(measure disagg "$DISAGG" 100)
B=$(measure balanced "$BALANCED" 100)
X=$(measure prefix "$PREFIX" 100)
XK=$(measure prefix1k "$PREFIX" 1000)
B32=$(measure balanced32k "$BALANCED" 32k "$LONG" 2)
X32=$(measure prefix32k "$PREFIX" 32k "$LONG" 2)
LI=$(measure long-inline "$DIRECT" long "$LONG" 2)
LT=$(measure long-thread "$THREAD" long "$LONG" 2 1)
f=$(grep -lx "desc: Trigger: dump long-thread" "$WORK"/cg.*-02 | head -1)
LP=$(awk -v n="$LONG" '/^summary:/{printf "%.0f\n", $2 / n}' "$f")

echo "# callgrind, instructions per request ($COUNT requests after $WARM, one keep-alive connection, proxy side only)"
printf "plain proxy_pass          %9d Ir\n" "$P"
printf "direct, 100-token chat    %9d Ir  (plain/direct %.3f)\n" "$D" "$(echo "$P / $D" | bc -l)"
printf "direct, 1000-token chat   %9d Ir  (plain/direct %.3f)\n" "$K" "$(echo "$P / $K" | bc -l)"
printf "disaggregated, 100 tokens %9d Ir  (plain/disagg %.3f)\n" "$G" "$(echo "$P / $G" | bc -l)"
printf "dpd_balance, 100 tokens   %9d Ir  (plain/balanced %.3f)\n" "$B" "$(echo "$P / $B" | bc -l)"
printf "prefix cache, 100 tokens  %9d Ir  (plain/prefix %.3f, +%d Ir over balanced)\n" "$X" "$(echo "$P / $X" | bc -l)" "$((X - B))"
printf "prefix cache, 1000 tokens %9d Ir  (plain/prefix %.3f)\n" "$XK" "$(echo "$P / $XK" | bc -l)"
printf "32k-token chat: balanced %11d Ir, prefix cache %11d Ir (+%d Ir)\n" "$B32" "$X32" "$((X32 - B32))"
printf "~100k-token chat, inline:     event loop %11d Ir a request\n" "$LI"
printf "~100k-token chat, thread pool: event loop %11d Ir a request (%.4f of inline), pool thread %d Ir\n" \
    "$LT" "$(echo "$LT / $LI" | bc -l)" "$LP"
