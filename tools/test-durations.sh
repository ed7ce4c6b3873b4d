#!/usr/bin/env bash
# Merge a run's per-file times (tools/test-timed.pl: "<wall s> <cpu s>
# <file>" lines) into t/durations.txt, the order tools/run-tests.sh starts
# files in (longest first).  Files the run did not time keep their line;
# files that are gone lose it.  `make test-durations` runs the whole suite
# (long files included) and calls this.
set -euo pipefail
cd "$(dirname "$0")/.."
times=${1:?usage: test-durations.sh TIMES-FILE}
out=t/durations.txt
tmp=$out.tmp.$$
trap 'rm -f "$tmp"' EXIT
{
  echo "# wall_s cpu_s file: one run's seconds per test file (the CPU of the"
  echo "# processes it started); tools/run-tests.sh starts the longest first."
  echo "# Regenerate with \`make test-durations\`; see README \"Tests\"."
  awk 'FILENAME == ARGV[1] { if ($1 ~ /^[0-9.]+$/) old[$3] = $0; next }
       $1 ~ /^[0-9.]+$/ { new[$3] = $0 }
       END {
         for (f in old) if (!(f in new)) new[f] = old[f]
         for (f in new) { split(new[f], a, " ");
                          if ((getline l < f) >= 0) print new[f] }
       }' "$([ -f $out ] && echo $out || echo /dev/null)" "$times" \
    | sort -k1,1gr -k3,3
} > "$tmp"
mv -f "$tmp" "$out"
