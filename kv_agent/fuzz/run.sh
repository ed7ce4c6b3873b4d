#!/usr/bin/env bash
# Run kv_agent's libFuzzer targets for a bounded time each and say what
# they found.   run.sh BUILD_DIR SECONDS
#   kv_fuzz_events  the vLLM KV-event decoder (kv_agent/src/kv_events.c)
#   kv_fuzz_prefix  the prefix index writer behind it (prefix_events.c,
#                   prefix_index.c)
# Seeds: kv_agent/fuzz/corpus (committed, built with msgspec by
# t/kv_agent/kvevents.py); the grown corpus stays in
# BUILD/fuzz/corpus-TARGET; findings go to fuzz-artifacts/ (gitignored)
# and make the run fail.  The driver is tools/fuzz-run.sh.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
exec bash "$HERE/../../tools/fuzz-run.sh" "${1:-build}" "${2:-60}" \
    "$HERE/kv_events.dict" "$HERE/corpus" kv_fuzz_events kv_fuzz_prefix
