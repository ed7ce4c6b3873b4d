#!/usr/bin/env bash
# Run the module's libFuzzer targets for a bounded time each and say what
# they found.   run.sh BUILD_DIR SECONDS
#   dpd_fuzz_request  the request path (parse -> count -> upstream bodies)
#   dpd_fuzz_json     the request body's tree builder against libcjson
# Seeds: ngx_dpd_module/fuzz/corpus (committed); the grown corpus stays in
# BUILD/fuzz/corpus-TARGET; findings (crashing inputs) go to
# fuzz-artifacts/ (gitignored) and make the run fail.  The driver is
# tools/fuzz-run.sh.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
exec bash "$HERE/../../tools/fuzz-run.sh" "${1:-build}" "${2:-60}" \
    "$HERE/request.dict" "$HERE/corpus" dpd_fuzz_request dpd_fuzz_json
