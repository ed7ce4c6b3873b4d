#!/usr/bin/env bash
# The decision time ($dpd_decision_time: read + parse + render + count +
# the prefix cache) of a 32k-token chat turn, with dpd_prefix_cache off,
# approximate and events, and the cache's own share of it
# ($dpd_prefix_time: keys, lookup, pick, pin; issue 23's target: <= 300 us
# p50), one worker, requests one after the other:
#
#   chat32k  a chat of 16 user/assistant turns of 1020 words each (~32.8k
#            tokens rendered), the same body each time: with the cache on,
#            every request is a full hit (2k blocks walked and refreshed,
#            the worst case of the approximate index)
#   ids32k   32768 token ids (no tokenizer work: the cache's own cost)
# events: the index holds every block of both prompts for one decoder
#
# Usage: bench/prefix_decision.sh          (after `make`)
# Knobs: N=200 (requests per mode after 20 warm), BENCH_PORT_BASE=18760
set -euo pipefail

. "$(dirname "$0")/lib.sh"
N=${N:-200}
BASE=${BENCH_PORT_BASE:-18760}
BACK1=$BASE
BACK2=$((BASE + 1))
GW=$((BASE + 2))

bench_require "$MODULE" "$TOK/tokenizer.json"
bench_workdir dpd-prefix

mkdir -p "$WORK/back" "$WORK/gw"
{ bench_conf_head "$WORK/back"; cat <<EOF
    server {
        listen 127.0.0.1:$BACK1;
        listen 127.0.0.1:$BACK2;
        location / { return 200 "ok\n"; }
    }
}
EOF
} >"$WORK/back/nginx.conf"
"$NGINX" -p "$WORK/back" -c "$WORK/back/nginx.conf" -e "$WORK/back/error.log"
PIDS+=("$(sleep 0.2; cat "$WORK/back/nginx.pid")")

# the bodies; the index (events) holds both prompts for the first decoder
python3 - "$WORK" <<'EOF'
import json, random, sys
rng = random.Random(42)
w = ("the of and to in is that for it as was with be by on not this are "
     "or from at which but have an they you were their one all we can her "
     "has there been if more when will would who so no model token cache "
     "river mountain history science music garden window silver").split()
msgs = []
for t in range(16):
    for role in ("user", "assistant"):
        msgs.append({"role": role,
                     "content": " ".join(rng.choice(w) for _ in range(1020))})
msgs.append({"role": "user", "content": "and now?"})
with open(sys.argv[1] + "/chat.json", "w") as f:
    json.dump({"model": "m", "max_tokens": 16, "messages": msgs}, f)
with open(sys.argv[1] + "/ids.json", "w") as f:
    json.dump({"model": "m", "max_tokens": 16, "prompt": [1000] * 32768}, f)
EOF
"$BUILD/dpd-tokenize" --tokenizer "$TOK/tokenizer.json" --chat --ids \
    <"$WORK/chat.json" >"$WORK/chat.ids"
python3 "$ROOT/tools/prefix_index.py" create "$WORK/index" \
    --node "127.0.0.1:$BACK1" --node "127.0.0.1:$BACK2" --slots 65536
python3 "$ROOT/tools/prefix_index.py" store "$WORK/index" --node-index 0 \
    --model m --repeat 1000:32768
python3 "$ROOT/tools/prefix_index.py" store "$WORK/index" --node-index 0 \
    --model m --ids "@$WORK/chat.ids"
# the workers run as nginx's unprivileged user
chmod 755 "$WORK"
chmod 644 "$WORK/index"

cat >"$WORK/gw/nginx.conf" <<EOF
load_module $MODULE;
worker_processes 1;
pid $WORK/gw/nginx.pid;
error_log $WORK/gw/error.log warn;
events { worker_connections 1024; }
http {
    client_max_body_size 16m;
    client_body_buffer_size 2m;
    client_body_temp_path $WORK/gw;
    proxy_temp_path $WORK/gw;
    keepalive_requests 100000;
    log_format dt '\$dpd_decision_time \$dpd_cached_tokens \$dpd_prefix_time';
    dpd_tokenizer $TOK/tokenizer.json config=$TOK/tokenizer_config.json;
    dpd_threshold 100000;
    dpd_decode_upstream backd;

    upstream backd {
        dpd_balance;
        zone backd 64k;
        server 127.0.0.1:$BACK1;
        server 127.0.0.1:$BACK2;
        keepalive 16;
    }

    proxy_http_version 1.1;
    proxy_set_header Connection "";

    server {
        listen 127.0.0.1:$GW;
        location /off/ {
            dpd on;
            access_log $WORK/gw/off.log dt;
            proxy_pass http://backd/;
        }
        location /approximate/ {
            dpd on;
            dpd_prefix_cache approximate;
            access_log $WORK/gw/approximate.log dt;
            proxy_pass http://backd/;
        }
        location /events/ {
            dpd on;
            dpd_prefix_cache events file=$WORK/index;
            access_log $WORK/gw/events.log dt;
            proxy_pass http://backd/;
        }
    }
}
EOF
"$NGINX" -p "$WORK/gw" -c "$WORK/gw/nginx.conf" -e "$WORK/gw/error.log"
PIDS+=("$(sleep 0.2; cat "$WORK/gw/nginx.pid")")

python3 - "$WORK" "$GW" "$N" <<'EOF'
import http.client, json, random, statistics, sys, time
work, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
chat = open(f"{work}/chat.json").read()
ids = open(f"{work}/ids.json").read()
c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
for _ in range(100):
    try:
        c.connect()
        break
    except OSError:
        time.sleep(0.1)
# the modes interleaved request by request: a shared host's drift hits
# them alike
modes = ("off", "approximate", "events")
for name, body, path in (("chat32k", chat, "/v1/chat/completions"),
                         ("ids32k", ids, "/v1/completions")):
    for mode in modes:
        open(f"{work}/gw/{mode}.log", "w").close()
    for i in range(n + 20):
        for mode in modes:
            c.request("POST", f"/{mode}{path}", body,
                      {"Content-Type": "application/json"})
            r = c.getresponse()
            r.read()
            if r.status != 200:
                sys.exit(f"{mode} {name}: status {r.status}")
    time.sleep(0.2)
    p50 = {}
    for mode in modes:
        rows = [l.split() for l in open(f"{work}/gw/{mode}.log")][20:]
        us = sorted(int(r[0]) for r in rows)
        p50[mode] = us[len(us) // 2]
        cached = rows[-1][1] if len(rows[-1]) > 1 else "-"
        own = sorted(int(r[2]) for r in rows if len(r) > 2 and r[2] != "-")
        own = (f"  cache's own p50 {own[len(own) // 2]:4d} us "
               f"p99 {own[int(len(own) * 0.99) - 1]:4d} us" if own else "")
        print(f"{mode:12s} {name:8s} decision p50 {p50[mode]:6d} us  "
              f"p99 {us[int(len(us) * 0.99) - 1]:6d} us  "
              f"cached tokens {cached} (of the last request){own}")
    for mode in modes[1:]:
        print(f"  {mode} - off, p50: {p50[mode] - p50['off']:+d} us")
EOF
grep -E "warn|error|crit" "$WORK/gw/error.log" | tail -5 || true
