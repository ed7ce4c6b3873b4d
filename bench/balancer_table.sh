#!/usr/bin/env bash
# Cost of the kv_agent readiness table in dpd_balance's peer choice.
#
# One backend nginx (8 listening ports, a canned reply: the "instant
# backends") and three proxy nginx, one worker each, whose upstream of the
# 8 backends uses dpd_balance with a zone (the peers lock is shared by all
# workers) and keepalive:
#   none   no dpd_state_table (the baseline)
#   t64    a table of 64 nodes, the 8 backends in its last records
#   t4096  a table of 4096 nodes (the agent's maximum), likewise
# The tables are written by t/inc/DPD/StateTable.pm (kv_agent's ABI,
# kv_agent/include/dpd_state.h): every node alive, the 8 backends with
# more free blocks than the rest.  wrk GETs through each proxy in turn,
# ROUNDS times; the median requests/s and the proxy worker's CPU time per
# request are compared with "none" in the same run.  Target (issue 8,
# item 10): t4096 >= 0.9x none.
#
# Usage: bench/balancer_table.sh          (after `make`)
# Knobs (env): DURATION=5 ROUNDS=3 CONNS=32 BENCH_PORT_BASE=18660
#              (uses BASE .. BASE+10), MODULE=path/to/ngx_http_dpd_module.so
set -euo pipefail

. "$(dirname "$0")/lib.sh"
DURATION=${DURATION:-5}
ROUNDS=${ROUNDS:-3}
CONNS=${CONNS:-32}
BASE=${BENCH_PORT_BASE:-18660}
NPEERS=8
CASES=(none t64 t4096)
declare -A PORT=([none]=$((BASE + 8)) [t64]=$((BASE + 9)) [t4096]=$((BASE + 10)))
declare -A NODES=([t64]=64 [t4096]=4096)

command -v wrk >/dev/null || { echo "wrk is not installed (apt-get install wrk)" >&2; exit 1; }
bench_require "$MODULE" "$ROOT/t/inc/DPD/StateTable.pm"
bench_workdir dpd-balancer
chmod 755 "$WORK"      # workers started by root run as nobody

# backends on one CPU, the proxies on the other, wrk wherever it fits
PIN_BACK=() PIN_PROXY=()
if command -v taskset >/dev/null && [[ $(nproc) -ge 2 ]]; then
    PIN_BACK=(taskset -c 1) PIN_PROXY=(taskset -c 0)
fi

addrs=() listens='' servers=''
for i in $(seq 0 $((NPEERS - 1))); do
    addrs+=("127.0.0.1:$((BASE + i))")
    listens+="        listen 127.0.0.1:$((BASE + i));"$'\n'
    servers+="        server 127.0.0.1:$((BASE + i));"$'\n'
done

for c in t64 t4096; do
    perl -I"$ROOT/t/inc" -MDPD::StateTable -e 'DPD::StateTable::main()' \
        "$WORK/$c.state" "${NODES[$c]}" "${addrs[@]}"
done

mkdir -p "$WORK/back"
{ bench_conf_head "$WORK/back" 4096; cat <<EOF
    server {
$listens
        location / { return 200 "ok\n"; }
    }
}
EOF
} >"$WORK/back/nginx.conf"
"${PIN_BACK[@]}" "$NGINX" -p "$WORK/back" -c "$WORK/back/nginx.conf" \
    -e "$WORK/back/error.log"
PIDFILES=("$WORK/back/nginx.pid")

for c in "${CASES[@]}"; do
    table=''
    [[ $c == none ]] || table="dpd_state_table $WORK/$c.state check=1s stale=0;"
    mkdir -p "$WORK/$c"
    cat >"$WORK/$c/nginx.conf" <<EOF
load_module $MODULE;
worker_processes 1;
pid $WORK/$c/nginx.pid;
error_log $WORK/$c/error.log notice;
events { worker_connections 4096; }
http {
    client_body_temp_path $WORK/$c/body;
    proxy_temp_path $WORK/$c/proxy;
    access_log off;
    keepalive_requests 1000000;
    $table
    upstream pool {
        dpd_balance;
        zone pool 256k;
$servers
        keepalive 64;
    }
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    server {
        listen 127.0.0.1:${PORT[$c]};
        location / { proxy_pass http://pool; }
        location = /state { dpd_state_status; }
    }
}
EOF
    "${PIN_PROXY[@]}" "$NGINX" -p "$WORK/$c" -c "$WORK/$c/nginx.conf" \
        -e "$WORK/$c/error.log"
    PIDFILES+=("$WORK/$c/nginx.pid")
done

# the extra nginx are stopped on exit too
trap 'for f in "${PIDFILES[@]}"; do [[ -f $f ]] && kill "$(cat "$f")" 2>/dev/null; done; bench_cleanup' EXIT INT TERM
sleep 0.5

# each proxy must have read its table: every node listed, the backends alive
for c in t64 t4096; do
    n=$(curl -s "http://127.0.0.1:${PORT[$c]}/state" \
        | grep -o '"nodes_alive":[0-9]*' | cut -d: -f2)
    [[ $n == "${NODES[$c]}" ]] || {
        echo "$c: the proxy sees ${n:-no} alive nodes, want ${NODES[$c]}" >&2
        cat "$WORK/$c/error.log" >&2
        exit 1
    }
done

worker_of() { pgrep -P "$(cat "$WORK/$1/nginx.pid")" | head -1; }
TICK=$(getconf CLK_TCK)
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# case -> "rps cpu_us_per_request"
run_wrk() {
    local w c0 c1
    w=$(worker_of "$1")
    c0=$(cpu_ticks "$w")
    wrk -t1 -c"$CONNS" -d"${DURATION}s" "http://127.0.0.1:${PORT[$1]}/" \
        >"$WORK/wrk.out" 2>&1
    c1=$(cpu_ticks "$w")
    if grep -q "Non-2xx\|Socket errors" "$WORK/wrk.out"; then
        echo "errors through $1:" >&2
        cat "$WORK/wrk.out" >&2
        exit 1
    fi
    awk -v c=$((c1 - c0)) -v hz="$TICK" '
        /Requests\/sec/{r=$2} / requests in /{n=$1}
        END{printf "%s %.2f\n", r, (n ? c * 1e6 / hz / n : 0)}' \
        "$WORK/wrk.out"
}

median() { sort -g | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }

echo "# $NPEERS peers, dpd_balance + zone + keepalive, proxy nginx 1 worker, wrk 1 thread x $CONNS connections, ${DURATION}s x $ROUNDS rounds"
echo "# module: $MODULE"
for c in "${CASES[@]}"; do
    run_wrk "$c" >/dev/null            # warm up
    : >"$WORK/$c.res"
done
for _ in $(seq 1 "$ROUNDS"); do
    for c in "${CASES[@]}"; do
        run_wrk "$c" >>"$WORK/$c.res"
    done
done

r0=$(cut -d' ' -f1 "$WORK/none.res" | median)
u0=$(cut -d' ' -f2 "$WORK/none.res" | median)
for c in "${CASES[@]}"; do
    r=$(cut -d' ' -f1 "$WORK/$c.res" | median)
    u=$(cut -d' ' -f2 "$WORK/$c.res" | median)
    printf "%-6s %5s nodes: %9.0f req/s (ratio %.3f)  worker CPU/request %7.2f us (ratio %.3f)  rounds: %s\n" \
        "$c" "${NODES[$c]:-0}" "$r" "$(echo "$r / $r0" | bc -l)" \
        "$u" "$(echo "$u0 / $u" | bc -l)" \
        "$(cut -d' ' -f1 "$WORK/$c.res" | tr '\n' ' ')"
done
