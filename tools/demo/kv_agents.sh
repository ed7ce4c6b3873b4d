# shellcheck shell=bash disable=SC2034  # KVA_ERR etc. are read by demo.sh
# kv_agent part of the DPD demo; sourced by tools/demo.sh (bash).
#
# Five real agents (build/kv_agent run --config ...) on loopback:
#   router-0   router   127.0.0.1:$KVA_AGENT_PORT      writes $KVA_STATE
#   decode-0   decode   127.0.0.1:$KVA_AGENT_PORT+1    pod 127.0.0.2
#   decode-1   decode   127.0.0.1:$KVA_AGENT_PORT+2    pod 127.0.0.3
#   prefill-0  prefill  127.0.0.1:$KVA_AGENT_PORT+3    pod 127.0.0.4
#   prefill-1  prefill  127.0.0.1:$KVA_AGENT_PORT+4    pod 127.0.0.5
# Prefill agents know both decoders and the router, decode agents both
# prefill agents and the router, the router every pod agent.  Configs,
# API sockets, state files and logs live in $KVA_DIR.
#
# Expects from the caller: BUILD, KVA_DIR, KVA_AGENT_PORT, KVA_PROVIDER,
# EMU_PORT, DECODE_HOSTS, PREFILL_HOSTS, AGENT_PIDS (array), say.

KVA_BIN=$BUILD/kv_agent
KVA_CTL=$BUILD/kv_agent_ctl
KVA_STATE=$KVA_DIR/dpd_state
KVA_IDS=(router-0 decode-0 decode-1 prefill-0 prefill-1)
# small host pools: 2 layers x K/V x 4 KiB per block, 2048 blocks (32 MiB);
# a long demo prompt (~7000 tokens, 16 per block) moves about 7 MB
KVA_POOL='{"layers": 2, "regions": 2, "block_bytes": 4096, "blocks": 2048, "memory": "host"}'

kva_role() { echo "${1%-*}"; }

kva_ctrl() {   # id -> control address
    local i
    for i in "${!KVA_IDS[@]}"; do
        if [ "${KVA_IDS[$i]}" = "$1" ]; then
            echo "127.0.0.1:$((KVA_AGENT_PORT + i))"
            return
        fi
    done
}

kva_http() {   # id -> the pod's HTTP address ('' for the router)
    case $1 in
        decode-0) echo "${DECODE_HOSTS[0]}:$EMU_PORT" ;;
        decode-1) echo "${DECODE_HOSTS[1]}:$EMU_PORT" ;;
        prefill-0) echo "${PREFILL_HOSTS[0]}:$EMU_PORT" ;;
        prefill-1) echo "${PREFILL_HOSTS[1]}:$EMU_PORT" ;;
    esac
}

kva_socket() { echo "$KVA_DIR/$1.sock"; }

# why agents cannot run here, or nothing
kva_unavailable() {
    if [ ! -x "$KVA_BIN" ]; then
        echo "$KVA_BIN not built (make programs)"
    elif ! command -v fi_info >/dev/null; then
        echo "fi_info not found (libfabric-bin); provider $KVA_PROVIDER unknown"
    elif ! fi_info -p "$KVA_PROVIDER" 2>/dev/null | grep -q 'FI_EP_RDM'; then
        echo "libfabric provider $KVA_PROVIDER not available here"
    fi
}

kva_peer_json() {   # own-id peer-id
    local http
    http=$(kva_http "$2")
    printf '{"id": "%s", "ctrl": "%s", "role": "%s"%s, "key_file": "%s"}' \
        "$2" "$(kva_ctrl "$2")" "$(kva_role "$2")" \
        "${http:+, \"http\": \"$http\"}" "$(kva_key_file "$1" "$2")"
}

# the key file of the link between two nodes (the same for both ends):
# 32 random bytes as hex, mode 0600, made on first use
kva_key_file() {   # id peer-id
    local a=$1 b=$2 f
    [[ "$a" < "$b" ]] || { a=$2; b=$1; }
    f="$KVA_DIR/keys/$a+$b.key"
    if [ ! -s "$f" ]; then
        mkdir -p -m 700 "$KVA_DIR/keys"
        (umask 077; od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$f")
    fi
    printf '%s' "$f"
}

kva_write_config() {   # id peer-id...
    local id=$1 http peers='' p
    shift
    http=$(kva_http "$id")
    for p in "$@"; do
        peers+="${peers:+,
    }$(kva_peer_json "$id" "$p")"
    done
    {
        printf '{\n  "node_id": "%s",\n  "role": "%s",\n' "$id" \
            "$(kva_role "$id")"
        [ -n "$http" ] && printf '  "http": "%s",\n' "$http"
        if [ "$id" != router-0 ]; then
            printf '  "provider": "%s",\n  "rails": ["lo"],\n' "$KVA_PROVIDER"
            printf '  "api_socket": "%s",\n' "$(kva_socket "$id")"
            printf '  "pool": %s,\n' "$KVA_POOL"
            printf '  "state_path": "%s",\n' "$KVA_DIR/$id.state"
        else
            printf '  "state_path": "%s",\n' "$KVA_STATE"
        fi
        printf '  "listen": "%s",\n' "$(kva_ctrl "$id")"
        printf '  "timeouts": {"heartbeat_ms": 200, "dead_after_ms": 2000, '
        printf '"reconnect_ms": 200, "transfer_ms": 10000},\n'
        printf '  "peers": [\n    %s\n  ]\n}\n' "$peers"
    } > "$KVA_DIR/$id.json"
}

kva_write_configs() {
    mkdir -p "$KVA_DIR"
    kva_write_config router-0 decode-0 decode-1 prefill-0 prefill-1
    kva_write_config decode-0 prefill-0 prefill-1 router-0
    kva_write_config decode-1 prefill-0 prefill-1 router-0
    kva_write_config prefill-0 decode-0 decode-1 router-0
    kva_write_config prefill-1 decode-0 decode-1 router-0
}

# start every agent, wait for "info: ready"; 1 on failure, why in KVA_ERR
# (not in a subshell: AGENT_PIDS must reach the caller's cleanup)
kva_start() {
    local id _ ok
    for id in "${KVA_IDS[@]}"; do
        if ! "$KVA_BIN" check --config "$KVA_DIR/$id.json" \
                > "$KVA_DIR/$id.check" 2>&1; then
            KVA_ERR="config $id rejected: $(tail -1 "$KVA_DIR/$id.check")"
            return 1
        fi
        "$KVA_BIN" run --config "$KVA_DIR/$id.json" \
            < /dev/null > "$KVA_DIR/$id.log" 2>&1 &
        AGENT_PIDS+=($!)
    done
    for id in "${KVA_IDS[@]}"; do
        ok=
        for _ in $(seq 100); do
            if grep -q 'info: ready$' "$KVA_DIR/$id.log"; then
                ok=1
                break
            fi
            sleep 0.1
        done
        if [ -z "$ok" ]; then
            KVA_ERR="agent $id did not start: $(grep -m1 -i 'error\|fatal' \
                "$KVA_DIR/$id.log" || tail -1 "$KVA_DIR/$id.log")"
            return 1
        fi
    done
}

# the router's table as JSON
kva_table() { "$KVA_BIN" status --state "$KVA_STATE" --json 2>/dev/null; }

# wait until the router sees every pod agent alive (after the pods
# registered their pools: that makes the agents reconnect)
kva_wait_mesh() {
    local _ n
    for _ in $(seq 150); do
        n=$(kva_table | python3 -c 'import json,sys
try: t = json.load(sys.stdin)
except Exception: print(0); sys.exit()
print(sum(1 for n in t["nodes"] if n["alive"] and n["role"] != "router"
          and n["total_blocks"] > 0))' 2>/dev/null || echo 0)
        [ "$n" = 4 ] && return 0
        sleep 0.1
    done
    echo "the router table shows $n of 4 pod agents alive with a pool"
    return 1
}

# wait until a pod's emulator registered its pool with its agent
kva_wait_registered() {   # host id
    local _ st
    for _ in $(seq 100); do
        st=$(curl -sf --max-time 1 "http://$1:$EMU_PORT/emu/stats?since=1000000000" \
             | python3 -c 'import json,sys
k = json.load(sys.stdin)["kv"].get("kv_agent") or {}
print("ok" if k.get("registered") else (k.get("error") or "pending"))' \
             2>/dev/null || echo pending)
        [ "$st" = ok ] && return 0
        sleep 0.1
    done
    echo "pod $1 did not register its pool with $2: $st"
    return 1
}

# bytes each pod agent moved (API "info" stats)
kva_bytes() {
    local id
    for id in "${KVA_IDS[@]:1}"; do
        "$KVA_CTL" "$(kva_socket "$id")" call '{"verb": "info"}' 2>/dev/null \
            | python3 -c 'import json,sys
i = json.load(sys.stdin); s = i.get("stats", {}); p = i.get("pool", {})
print("   %-9s out %9.1f MB  in %9.1f MB  pushes ok %d failed %d  ready %d failed %d  free %s/%s blocks" % (
    sys.argv[1], s.get("bytes_out", 0) / 1e6, s.get("bytes_in", 0) / 1e6,
    s.get("pushes_ok", 0), s.get("pushes_failed", 0),
    s.get("reqs_ready", 0), s.get("reqs_failed", 0),
    p.get("free", "?"), p.get("blocks", "?")))' "$id" 2>/dev/null \
            || echo "   $id: no answer on $(kva_socket "$id")"
    done
}
