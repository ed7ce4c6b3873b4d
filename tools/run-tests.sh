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

# DPD_TEST_JOBS=N runs N files at a time (default: twice the CPUs, at
# least 2: most files wait on sleeps, timeouts and daemons more than they
# compute), each in a network namespace and a servroot of its own
# (tools/test-netns.sh; servroots under $DPD_SERVROOT_JOBS, default
# t/servroot-jobs, so runs in separate directories may share a checkout),
# the longest first by t/durations.txt (a file it does not list counts
# as $DPD_TEST_DEFAULT_S seconds, 20), so no long file starts last and
# ends the run alone.  DPD_TEST_JOBS=1, or no namespace to be had (not
# root, no user namespaces: it says so), runs them one after the other.
# Either way prove's one summary ("All tests successful." / "Files=..,
# Tests=..") over every file closes the run.
# Without test files: every t/**/*.t but the long ones t/long.list names
# (the fuzz and soak runs, `make test-long`); DPD_TEST_LONG=1 adds them.
# DPD_TEST_RECORD=1 writes this run's wall/CPU seconds per file into
# t/durations.txt (`make test-durations`).
# Arguments: prove options and, optionally, the test files to run.
opts=() files=()
for a in "$@"; do
  case $a in *.t) files+=("$a") ;; *) opts+=("$a") ;; esac
done
if ((${#files[@]} == 0)); then
  long=()
  if [ "${DPD_TEST_LONG:-0}" != 1 ] && [ -f t/long.list ]; then
    mapfile -t long < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' t/long.list)
  fi
  mapfile -t files < <(find t -name '*.t' -not -path 't/lib/*' \
                        -not -path 't/servroot*' | sort \
                        | grep -v -x -F -f <(printf '%s\n' "${long[@]}" ''))
fi
ncpu=$(nproc 2>/dev/null || echo 1)
jobs=${DPD_TEST_JOBS:-$((ncpu < 1 ? 2 : 2 * ncpu))}
if ! [[ $jobs =~ ^[0-9]+$ ]] || ((jobs < 1)); then
  echo "run-tests: DPD_TEST_JOBS must be a number of files at a time" >&2
  exit 2
fi
if ((jobs > 1)); then
  if unshare -n true 2>/dev/null && command -v ip >/dev/null; then
    # perl's -I through PERL5LIB: prove passes no switches to --exec
    inc=""
    for ((i = 1; i < ${#PERL_INC[@]}; i += 2)); do inc+="${PERL_INC[i]}:"; done
    export PERL5LIB="$inc${PERL5LIB:-}"
    export DPD_SERVROOT_JOBS=${DPD_SERVROOT_JOBS:-$ROOT/t/servroot-jobs}
    rm -rf "$DPD_SERVROOT_JOBS" && mkdir -p "$DPD_SERVROOT_JOBS" || exit 2
    export DPD_TEST_TIMES=$DPD_SERVROOT_JOBS/times.txt
    # longest first: prove -j starts the files in the order given
    mapfile -t files < <(
      awk -v d="${DPD_TEST_DEFAULT_S:-20}" '
        FILENAME == ARGV[1] { if ($1 ~ /^[0-9.]+$/) w[$3] = $1; next }
        { print ($0 in w ? w[$0] : d), FNR, $0 }' \
        "$([ -f t/durations.txt ] && echo t/durations.txt || echo /dev/null)" \
        <(printf '%s\n' "${files[@]}") \
      | sort -k1,1gr -k2,2n | cut -d' ' -f3-)
    prove -j "$jobs" --exec "$ROOT/tools/test-netns.sh" \
          "${opts[@]}" "${files[@]}"
    rc=$?
    if [ "${DPD_TEST_RECORD:-0}" = 1 ]; then
      bash "$ROOT/tools/test-durations.sh" "$DPD_TEST_TIMES"
    fi
    exit $rc
  fi
  echo "run-tests: no network namespace here (unshare -n failed):" \
       "the ${#files[@]} files run one after the other, not $jobs at a time" >&2
fi
exec prove "${PERL_INC[@]}" "${opts[@]}" "${files[@]}"
