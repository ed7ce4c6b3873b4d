#!/usr/bin/env bash
# Worker memory per request (issue 8, item 5): one nginx worker, a fresh
# one per body and path, RSS and peak RSS (VmHWM) after one request of
# each body on the direct and the disaggregated path (the prefill and the
# decoder are instant nginx locations).  MODULE=... compares builds.
#   bench/body_memory.sh          (PORT=18997: three ports from there;
#                                  BODIES="ids-8M ...": some bodies only)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
bench_require "$MODULE" "$TOK/tokenizer.json"
bench_workdir dpd-bodymem
PORT=${PORT:-18997}

python3 - "$WORK" <<'PY'
import sys
w = sys.argv[1]
open(w + '/ids-8M.json', 'w').write('{"model":"m","prompt":[' + ','.join(['1'] * 8000000) + ']}')
open(w + '/ids-262144.json', 'w').write('{"model":"m","prompt":[' + ','.join(['1'] * 262144) + ']}')
open(w + '/members-524000.json', 'w').write('{"model":"m","prompt":"x","b":[' + ','.join(['1'] * 524000) + ']}')
open(w + '/text-16M.json', 'w').write('{"model":"m","prompt":"' + 'word ' * 3200000 + '"}')
# one 16 MB word: the tokenizer's BPE scratch is per byte of a word
open(w + '/word-16M.json', 'w').write('{"model":"m","prompt":"' + 'x' * 16000000 + '"}')
PY

for body in ${BODIES:-ids-8M ids-262144 members-524000 text-16M word-16M}; do
  for path in direct disagg; do
    mkdir -p "$WORK/logs"
    cat > "$WORK/nginx.conf" <<EOC
load_module $MODULE;
worker_processes 1;
error_log $WORK/logs/error.log warn;
pid $WORK/nginx.pid;
events { worker_connections 64; }
http {
  access_log off;
  dpd_tokenizer $TOK/tokenizer.json config=$TOK/tokenizer_config.json;
  client_body_temp_path $WORK/body;
  server { listen 127.0.0.1:$((PORT + 1));
           client_max_body_size 32m;
           location / { return 200 '{"id":"x"}'; } }
  server {
    listen 127.0.0.1:$PORT;
    client_max_body_size 32m; client_body_buffer_size 256k;
    location /direct/ { dpd on; dpd_threshold 100000000;
                        proxy_pass http://127.0.0.1:$((PORT + 1))/; }
    location /disagg/ { dpd on; dpd_threshold 1; dpd_prefill_pass /_pf;
                        proxy_pass http://127.0.0.1:$((PORT + 1))/; }
    location /_pf/ { internal; proxy_pass http://127.0.0.1:$((PORT + 1))/; }
  }
}
EOC
    [[ $(id -u) == 0 ]] && sed -i '1a user root;' "$WORK/nginx.conf"
    "$NGINX" -p "$WORK" -c "$WORK/nginx.conf" -e "$WORK/logs/error.log"
    sleep 0.5
    w=$(pgrep -P "$(cat "$WORK/nginx.pid")")
    idle=$(awk '/VmRSS/{print $2}' /proc/$w/status)
    t0=$(date +%s.%N)
    code=$(curl -s -o "$WORK/out" -w '%{http_code}' --data-binary "@$WORK/$body.json" \
           -H 'Content-Type: application/json' "http://127.0.0.1:$PORT/$path/v1/completions")
    t1=$(date +%s.%N)
    printf '%-15s %-7s %s %5.2f s  idle %3d MB  after %4d MB  peak %4d MB  %s\n' \
        "$body" "$path" "$code" "$(echo "$t1 - $t0" | bc)" $((idle / 1024)) \
        $(( $(awk '/VmRSS/{print $2}' /proc/$w/status) / 1024 )) \
        $(( $(awk '/VmHWM/{print $2}' /proc/$w/status) / 1024 )) \
        "$(head -c 60 "$WORK/out")"
    kill "$(cat "$WORK/nginx.pid")"; sleep 0.3
  done
done
