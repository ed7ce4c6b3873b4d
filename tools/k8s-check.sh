#!/usr/bin/env bash
# Would the API server accept these manifests?  Two checkers, neither ours
# alone:
#  1. kubeconform -strict against Kubernetes 1.37's own JSON schemas (from
#     PyPI kubernetes-validate, made by `make deps` into .deps/k8s-schemas):
#     kinds, types, required fields, enums, unknown fields at any depth;
#  2. t/deploy/k8s-rules.mjs: the API server's checks that a schema cannot
#     say (hugepages need cpu or memory, requests == limits for GPUs, EFA
#     and hugepages, selector vs template labels, port and env names, ...),
#     each citing the Kubernetes function that makes it.
# The ServiceMonitor (a CRD, no schema shipped) is skipped by kubeconform
# and checked by k8s-rules.mjs for the CRD's required fields.
#   tools/k8s-check.sh FILE.yaml ...      exit 0: accepted; 1: refused;
#                                         2: a tool is missing (make deps)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${DPD_DEPS:-$root/.deps}/bin
schemas=${DPD_DEPS:-$root/.deps}/k8s-schemas
K8S_VERSION=${K8S_VERSION:-1.37.0}
if [ ! -x "$bin/kubeconform" ] || [ ! -f "$schemas/.dpd-installed" ]; then
    echo "k8s-check: no kubeconform or schemas under ${bin%/bin} (make deps)" >&2
    exit 2
fi
rc=0
"$bin/kubeconform" -strict -summary -output text \
    -kubernetes-version "$K8S_VERSION" -skip ServiceMonitor \
    -schema-location "$schemas/{{.NormalizedKubernetesVersion}}-standalone{{.StrictSuffix}}/{{.ResourceKind}}{{.KindSuffix}}.json" \
    "$@" || rc=1
node "$root/t/deploy/k8s-rules.mjs" "$@"
r=$?
[ $r = 2 ] && exit 2
[ $r = 0 ] || rc=1
exit $rc
