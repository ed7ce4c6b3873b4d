#!/usr/bin/env bash
# Run every test under t/ through prove.  DPD_HARNESS picks the
# Test::Nginx::Socket the files run under (the same files for each):
#   auto        (default) an installed one (CPAN) when there is one, else
#               the clean-room subset in t/lib
#   clean-room  t/lib, even where another one is installed
#   real        openresty's Test::Nginx: its lib/ from DPD_TEST_NGINX_LIB,
#               else ../shared/vendor/test-nginx.tar.gz unpacked into
#               build/test-nginx/, else an installed one; none: exit 2
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

export TEST_NGINX_BINARY=${TEST_NGINX_BINARY:-/usr/sbin/nginx}
export TEST_NGINX_LOAD_MODULES=${TEST_NGINX_LOAD_MODULES:-$ROOT/build/ngx_http_dpd_module.so}
export DPD_ROOT=$ROOT
export DPD_BUILD=$ROOT/build
export DPD_NPM=$ROOT/tools/npm/node_modules
. "$ROOT/tools/python-path.sh"

PERL_INC=()
case ${DPD_HARNESS:-auto} in
  auto)
    perl -MTest::Nginx::Socket -e 1 2>/dev/null || PERL_INC=(-I "$ROOT/t/lib")
    ;;
  clean-room)
    PERL_INC=(-I "$ROOT/t/lib")
    ;;
  real)
    lib=${DPD_TEST_NGINX_LIB:-}
    tarball=$ROOT/../shared/vendor/test-nginx.tar.gz
    if [ -z "$lib" ] && [ -f "$tarball" ]; then
      lib=$ROOT/build/test-nginx/lib
      if [ ! -f "$lib/Test/Nginx/Socket.pm" ] || [ "$tarball" -nt "$lib" ]; then
        rm -rf "$ROOT/build/test-nginx"
        mkdir -p "$ROOT/build/test-nginx"
        tar xzf "$tarball" -C "$ROOT/build/test-nginx" --strip-components=1 \
          || exit 2
        touch "$lib"
      fi
    fi
    if [ -n "$lib" ]; then
      [ -f "$lib/Test/Nginx/Socket.pm" ] || {
        echo "run-tests: DPD_HARNESS=real: no Test/Nginx/Socket.pm in $lib" >&2
        exit 2
      }
      PERL_INC=(-I "$lib")
    elif ! perl -MTest::Nginx::Socket -e 1 2>/dev/null; then
      echo "run-tests: DPD_HARNESS=real: no real Test::Nginx (set" \
           "DPD_TEST_NGINX_LIB, or put test-nginx.tar.gz in ../shared/vendor)" >&2
      exit 2
    fi
    ;;
  *)
    echo "run-tests: DPD_HARNESS must be auto, clean-room or real" >&2
    exit 2
    ;;
esac
PERL_INC+=(-I "$ROOT/t/inc")

# prove runs the files one after the other (ports and servroot are shared);
# its summary ("All tests successful." / "Files=.., Tests=..") closes the run.
# DPD_TEST_JOBS=N (CI's extra stages) runs N files at a time instead, each
# in a network namespace and a servroot of its own (tools/test-netns.sh);
# where no namespace can be made (not root, no user namespaces) it says so
# and runs them one after the other.
# Arguments: prove options and, optionally, the test files to run.
opts=() files=()
for a in "$@"; do
  case $a in *.t) files+=("$a") ;; *) opts+=("$a") ;; esac
done
if ((${#files[@]} == 0)); then
  mapfile -t files < <(find t -name '*.t' -not -path 't/lib/*' \
                        -not -path 't/servroot*' | sort)
fi
jobs=${DPD_TEST_JOBS:-1}
if [[ $jobs =~ ^[0-9]+$ ]] && ((jobs > 1)); then
  if unshare -n true 2>/dev/null && command -v ip >/dev/null; then
    # perl's -I through PERL5LIB: prove passes no switches to --exec
    inc=""
    for ((i = 1; i < ${#PERL_INC[@]}; i += 2)); do inc+="${PERL_INC[i]}:"; done
    export PERL5LIB="$inc${PERL5LIB:-}"
    rm -rf "$ROOT/t/servroot-jobs" && mkdir "$ROOT/t/servroot-jobs"
    exec prove -j "$jobs" --exec "$ROOT/tools/test-netns.sh" \
         "${opts[@]}" "${files[@]}"
  fi
  echo "run-tests: DPD_TEST_JOBS=$jobs: no network namespace here" \
       "(unshare -n failed); the files run one after the other" >&2
fi
exec prove "${PERL_INC[@]}" "${opts[@]}" "${files[@]}"
