#!/usr/bin/env bash
# The libFuzzer driver the fuzz/run.sh entry points share: run each target
# for a bounded time and say what it found.
#   fuzz-run.sh BUILD_DIR SECONDS DICT SEEDS TARGET...
# DICT: a libFuzzer dictionary ("" for none); SEEDS: the seed corpus,
# read but never written; FUZZ_MAX_LEN (environment): the longest input,
# 65536 unless set.  Each target grows its own corpus in
# BUILD/fuzz/corpus-TARGET and logs to BUILD/fuzz/TARGET.log; findings
# (crashing, leaking or timing-out inputs) go to fuzz-artifacts/ (in the
# current directory, gitignored).  Exit status 1 when any target found a
# problem or could not run, 2 on a usage error, else 0.
set -uo pipefail
if [ $# -lt 5 ]; then
  echo "usage: fuzz-run.sh BUILD_DIR SECONDS DICT SEEDS TARGET..." >&2
  exit 2
fi
BUILD=$1 SECS=$2 DICT=$3 SEEDS=$4
shift 4
case $SECS in
  ''|*[!0-9]*) echo "fuzz-run.sh: SECONDS must be a whole number: $SECS" >&2
               exit 2 ;;
esac
MAXLEN=${FUZZ_MAX_LEN:-65536}
case $MAXLEN in
  ''|*[!0-9]*) echo "fuzz-run.sh: FUZZ_MAX_LEN must be a whole number: $MAXLEN" >&2
               exit 2 ;;
esac
dict=()
[ -n "$DICT" ] && dict=(-dict="$DICT")
fail=0
for t in "$@"; do
  dir=$BUILD/fuzz/corpus-$t
  mkdir -p "$dir" fuzz-artifacts
  echo "fuzz: $t for ${SECS}s"
  # the hard timeout leaves libFuzzer room to finish its last input and
  # print its statistics; a hang past it counts as a finding
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    timeout $((SECS + 120)) "$BUILD/fuzz/$t" \
      -max_total_time="$SECS" -max_len="$MAXLEN" -timeout=20 -rss_limit_mb=4096 \
      "${dict[@]}" -artifact_prefix="fuzz-artifacts/$t-" \
      -print_final_stats=1 "$dir" "$SEEDS" > "$BUILD/fuzz/$t.log" 2>&1
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
