#!/usr/bin/env bash
# Run every test under t/ through prove.  Test::Nginx::Socket comes from CPAN
# when it is installed; otherwise the clean-room subset in t/lib is used.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

export TEST_NGINX_BINARY=${TEST_NGINX_BINARY:-/usr/sbin/nginx}
export TEST_NGINX_LOAD_MODULES=${TEST_NGINX_LOAD_MODULES:-$ROOT/build/ngx_http_dpd_module.so}
export DPD_ROOT=$ROOT
export DPD_BUILD=$ROOT/build
export DPD_NPM=$ROOT/tools/npm/node_modules

PERL_INC=()
if ! perl -MTest::Nginx::Socket -e 1 2>/dev/null; then
  PERL_INC=(-I "$ROOT/t/lib")
fi
PERL_INC+=(-I "$ROOT/t/inc")

# prove runs the files one after the other (ports and servroot are shared);
# its summary ("All tests successful." / "Files=.., Tests=..") closes the run.
# Arguments: prove options and, optionally, the test files to run.
opts=() files=()
for a in "$@"; do
  case $a in *.t) files+=("$a") ;; *) opts+=("$a") ;; esac
done
if ((${#files[@]} == 0)); then
  mapfile -t files < <(find t -name '*.t' -not -path 't/lib/*' \
                        -not -path 't/servroot*' | sort)
fi
exec prove "${PERL_INC[@]}" "${opts[@]}" "${files[@]}"
