#!/usr/bin/env bash
# Run the request-path libFuzzer target (dpd_fuzz_request) for a bounded
# time and say what it found.   run.sh BUILD_DIR SECONDS
# Seeds: ngx_dpd_module/fuzz/corpus (committed); the grown corpus stays in
# BUILD/fuzz/corpus-dpd_fuzz_request; findings (crashing inputs) go to
# fuzz-artifacts/ (gitignored) and make the run fail.
set -uo pipefail
BUILD=${1:-build}
SECS=${2:-60}
HERE=$(cd "$(dirname "$0")" && pwd)
t=dpd_fuzz_request
dir=$BUILD/fuzz/corpus-$t
mkdir -p "$dir" fuzz-artifacts
echo "fuzz: $t for ${SECS}s"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  timeout $((SECS + 120)) "$BUILD/fuzz/$t" \
    -max_total_time="$SECS" -max_len=65536 -timeout=20 -rss_limit_mb=4096 \
    -dict="$HERE/request.dict" -artifact_prefix=fuzz-artifacts/$t- \
    -print_final_stats=1 "$dir" "$HERE/corpus" > "$BUILD/fuzz/$t.log" 2>&1
r=$?
grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb|cov:" \
    "$BUILD/fuzz/$t.log" | tail -3
if [ $r -ne 0 ]; then
  echo "fuzz: $t FOUND A PROBLEM (exit $r), see $BUILD/fuzz/$t.log and fuzz-artifacts/"
  grep -E "ERROR|SUMMARY|==[0-9]+==|dpd_fuzz_request:" "$BUILD/fuzz/$t.log" | head -10
  exit 1
fi
echo "fuzz: $t: no crash, leak, failed assertion or sanitizer report"
