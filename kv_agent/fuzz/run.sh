#!/usr/bin/env bash
# Run kv_agent's libFuzzer targets for a bounded time each and say what
# they found.   run.sh BUILD_DIR SECONDS
#   kv_fuzz_events  the vLLM KV-event decoder (kv_agent/src/kv_events.c)
# Seeds: kv_agent/fuzz/corpus (committed, built with msgspec by
# t/kv_agent/kvevents.py); the grown corpus stays in
# BUILD/fuzz/corpus-TARGET; findings go to fuzz-artifacts/ (gitignored)
# and make the run fail.
set -uo pipefail
BUILD=${1:-build}
SECS=${2:-60}
HERE=$(cd "$(dirname "$0")" && pwd)
fail=0
for t in kv_fuzz_events; do
  dir=$BUILD/fuzz/corpus-$t
  mkdir -p "$dir" fuzz-artifacts
  echo "fuzz: $t for ${SECS}s"
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    timeout $((SECS + 120)) "$BUILD/fuzz/$t" \
      -max_total_time="$SECS" -max_len=65536 -timeout=20 -rss_limit_mb=4096 \
      -dict="$HERE/kv_events.dict" -artifact_prefix=fuzz-artifacts/$t- \
      -print_final_stats=1 "$dir" "$HERE/corpus" > "$BUILD/fuzz/$t.log" 2>&1
  r=$?
  grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb|cov:" \
      "$BUILD/fuzz/$t.log" | tail -3
  if [ $r -ne 0 ]; then
    echo "fuzz: $t FOUND A PROBLEM (exit $r), see $BUILD/fuzz/$t.log and fuzz-artifacts/"
    grep -E "ERROR|SUMMARY|==[0-9]+==|$t:" "$BUILD/fuzz/$t.log" | head -10
    fail=1
    continue
  fi
  echo "fuzz: $t: no crash, leak, failed assertion or sanitizer report"
done
exit $fail
