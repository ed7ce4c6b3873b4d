#!/usr/bin/env bash
# prove's interpreter when tools/run-tests.sh runs test files side by side
# (DPD_TEST_JOBS > 1, the default): one test file, run by perl in a network
# namespace of its own (its own loopback, so the fixed ports the tests
# listen on, 1984 and the emulators', never meet another file's) and with a
# servroot of its own ($DPD_SERVROOT_JOBS/<path>, default
# t/servroot-jobs/), through tools/test-timed.pl (wall and CPU time per
# file into $DPD_TEST_TIMES).  Needs unshare(1) with CAP_SYS_ADMIN or user
# namespaces; run-tests.sh checks that before it picks this.
set -u
t=${@: -1}
dir=${t%.t}
export TEST_NGINX_SERVROOT=${DPD_SERVROOT_JOBS:-$DPD_ROOT/t/servroot-jobs}/${dir//\//_}
exec unshare -n bash -c 'ip link set lo up && exec perl "$@"' perl \
    "$DPD_ROOT/tools/test-timed.pl" "$@"
