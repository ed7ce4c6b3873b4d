#!/usr/bin/env bash
# Run nginx test files against the module built with
# -fsanitize=address,undefined (`make test-asan` builds it into
# $SAN_BUILD, default build-asan/): the stock nginx starts through
# tools/nginx-sanitized (runtime preloaded, reports under
# $SAN_BUILD/reports/), and t/990-sanitizer-report.t, run last, fails on
# any report.  Arguments as tools/run-tests.sh (prove options, .t files;
# default t/[1-4]*.t); t/990 runs after them, with a summary of its own.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SAN_BUILD=${SAN_BUILD:-build-asan}

export DPD_SAN_RUNTIME=${DPD_SAN_RUNTIME:-$(clang \
    -print-file-name=libclang_rt.asan-x86_64.so)}
export DPD_SAN_LOG_DIR=$ROOT/$SAN_BUILD/reports
export DPD_SAN_MODULE=$ROOT/$SAN_BUILD/ngx_http_dpd_module.so
export TEST_NGINX_BINARY=$ROOT/tools/nginx-sanitized
export TEST_NGINX_LOAD_MODULES=$DPD_SAN_MODULE

if [ ! -f "$DPD_SAN_MODULE" ] || [ ! -f "$DPD_SAN_RUNTIME" ]; then
    echo "run-sanitized: missing $DPD_SAN_MODULE or $DPD_SAN_RUNTIME" \
         "(make test-asan builds them)" >&2
    exit 2
fi
rm -rf "$DPD_SAN_LOG_DIR"
mkdir -p "$DPD_SAN_LOG_DIR"

opts=() files=()
for a in "$@"; do
    case $a in *.t) files+=("$a") ;; *) opts+=("$a") ;; esac
done
if ((${#files[@]} == 0)); then
    files=(t/[1-4]*.t)
fi
# The files side by side as tools/run-tests.sh runs them (DPD_TEST_JOBS),
# then t/990 alone, once every nginx they started has stopped (it only
# reads the reports: no namespace, and the files' servroots stay).
bash tools/run-tests.sh "${opts[@]}" "${files[@]}"
rc=$?
DPD_TEST_JOBS=1 bash tools/run-tests.sh "${opts[@]}" t/990-sanitizer-report.t \
    || exit
exit $rc
