# DPD gateway: top-level build.  `make` builds everything into build/;
# `make test` installs what is missing, builds, and runs every test;
# `make demo` installs, builds and runs the end-to-end demo.
#
# Each component keeps its rules in its own fragment (build.mk) so the
# architecture stays visible: tokenizer, kv_agent, the nginx module.

SHELL      := /bin/bash
BUILD      ?= build
CC         ?= cc
OPT        ?= -O2
CSTD       := -std=c11 -D_GNU_SOURCE
WARN       := -Wall -Wextra -Wno-unused-parameter -Wshadow -Wpointer-arith
CFLAGS     ?= $(OPT) -g
NGX_SRC    ?= /usr/share/nginx/src
NGINX_BIN  ?= /usr/sbin/nginx
CUDA_HOME  ?= /usr/local/cuda
PROVE      ?= prove

.PHONY: all deps test test-quick test-long test-durations test-real test-valgrind test-valgrind-ci test-asan \
        module-asan fuzz-nginx demo bench clean module programs fuzz image \
        k8s-manifests install
all: module programs

include ngx_dpd_module/tokenizer/build.mk
include kv_agent/build.mk
include ngx_dpd_module/build.mk
include ngx_dpd_module/nginx-1.30.mk

deps:
	@bash tools/deps.sh

# make install [DESTDIR=/tmp/stage] [PREFIX=/usr/local]
#              [MODDIR=/usr/lib/nginx/modules] [TOKENIZER=/models/m/tokenizer.json]
# The module where Debian's nginx loads modules from, dpd-tokenize and
# kv_agent to $(PREFIX)/bin, and the example configurations to
# $(CONFDIR) with their repository-relative paths made absolute: load_module
# names $(MODDIR)/ngx_http_dpd_module.so, dpd_tokenizer names $(TOKENIZER)
# (tokenizer_config.json next to it is found as ever).  DESTDIR stages the
# whole tree elsewhere (the paths written into the files leave it out).
PREFIX    ?= /usr/local
MODDIR    ?= /usr/lib/nginx/modules
BINDIR    ?= $(PREFIX)/bin
CONFDIR   ?= $(PREFIX)/share/dpd-gateway/conf
TOKENIZER ?= /models/tokenizer.json
INSTALL_CONFS := nginx.conf nginx-dpd.conf nginx-kv-agent.conf observe.conf

install: all
	install -d $(DESTDIR)$(MODDIR) $(DESTDIR)$(BINDIR) $(DESTDIR)$(CONFDIR)
	install -m 0644 $(MODULE_SO) $(DESTDIR)$(MODDIR)/ngx_http_dpd_module.so
	install -m 0755 $(BUILD)/dpd-tokenize $(BUILD)/kv_agent $(DESTDIR)$(BINDIR)/
	for f in $(INSTALL_CONFS); do \
	    sed -e 's|^load_module build/ngx_http_dpd_module\.so;|load_module $(MODDIR)/ngx_http_dpd_module.so;|' \
	        -e 's|^\( *dpd_tokenizer  *\)\.\./tools/npm/node_modules/[^ ;]*|\1$(TOKENIZER)|' \
	        -e 's|^\(# *nginx -t\) -p "$$PWD" -c conf/|\1 -c $(CONFDIR)/|' \
	        conf/$$f > $(DESTDIR)$(CONFDIR)/$$f.tmp && \
	    if grep -n 'build/\|\.\./tools/' $(DESTDIR)$(CONFDIR)/$$f.tmp; then \
	        echo "install: $$f keeps a repository path" >&2; exit 1; fi && \
	    mv -f $(DESTDIR)$(CONFDIR)/$$f.tmp $(DESTDIR)$(CONFDIR)/$$f; \
	done

# The whole suite but the long files of t/long.list: every t/**/*.t through
# prove, 2 x nproc files at a time, each in a network namespace of its own
# (tools/run-tests.sh: DPD_TEST_JOBS, longest first by t/durations.txt),
# one TAP summary at the end.
test: deps
	@$(MAKE) --no-print-directory all
	@bash tools/run-tests.sh

# Same, without the dependency step (for a machine already set up).
test-quick: all
	@bash tools/run-tests.sh

# The long fuzz and soak files t/long.list names, which `make test` leaves
# out (CI runs them as a stage of their own).
LONG_TESTS ?= $(shell sed -e 's/\#.*//' t/long.list 2>/dev/null)

test-long: all
	@bash tools/run-tests.sh $(LONG_TESTS)

# Every file, the long ones too, timed: rewrites t/durations.txt, the
# order in which tools/run-tests.sh starts files (longest first).
test-durations: all
	@DPD_TEST_LONG=1 DPD_TEST_RECORD=1 bash tools/run-tests.sh

# The module's tests (t/*.t) under openresty's real Test::Nginx instead of
# the clean-room t/lib (tools/run-tests.sh, DPD_HARNESS=real: its lib/
# from DPD_TEST_NGINX_LIB or ../shared/vendor/test-nginx.tar.gz); every
# file, t/260's mutation run included (CI runs 3 files at a time:
# DPD_TEST_JOBS, see .ci/run).
REAL_TESTS ?= $(sort $(wildcard t/*.t))

test-real: all
	@DPD_HARNESS=real bash tools/run-tests.sh $(REAL_TESTS)

# The module's tests with nginx under valgrind memcheck (fails on any
# invalid access or definite leak).
test-valgrind: all
	@TEST_NGINX_USE_VALGRIND=1 bash tools/run-tests.sh $(sort $(wildcard t/[1-4]*.t))

# CI's valgrind subset: every path where the module ends a request itself
# (kept-alive finalize, prefill failures, client aborts, table faults, KV
# wait faults); see README "Tests".
VALGRIND_CI_TESTS ?= t/205-failures.t t/206-abort.t t/250-finalize-keepalive.t \
                     t/310-state-bad-file.t t/410-kv-agent-faults.t

test-valgrind-ci: all
	@TEST_NGINX_USE_VALGRIND=1 bash tools/run-tests.sh $(VALGRIND_CI_TESTS)

# The black-box mutation run of t/260-fuzz-nginx.t, longer and with
# bigger cases (bodies up to ~16 MB); FUZZ_NGINX_SEED/COUNT/SECONDS.
# Peak bound 24 x the largest body, not t/260's 8 x: a prompt that is one
# long word costs the tokenizer 20 B per byte of scratch on top of the
# body's copies (bench/body_memory.sh: a 16 MB word peaks at 338 MB over
# idle), and --big sends words of up to 16 MB.
FUZZ_NGINX_SEED    ?= 1
FUZZ_NGINX_COUNT   ?= 20000
FUZZ_NGINX_SECONDS ?= 600

fuzz-nginx: all
	@DPD_FUZZ_SEED=$(FUZZ_NGINX_SEED) DPD_FUZZ_COUNT=$(FUZZ_NGINX_COUNT) \
	    DPD_FUZZ_SECONDS=$(FUZZ_NGINX_SECONDS) \
	    DPD_FUZZ_ARGS="--big --peak-factor 24" \
	    bash tools/run-tests.sh t/260-fuzz-nginx.t

# The module (and the tokenizer inside it) with -fsanitize=address,undefined
# in its own build directory; the tests run the stock nginx with the
# runtime preloaded (tools/nginx-sanitized) and fail on any report
# (t/990-sanitizer-report.t).  SAN_TESTS picks the test files.  clang by
# default: its UBSan lives in the ASan runtime and writes to the report
# files (gcc's libubsan writes to stderr, i.e. nginx's error log).
SAN_BUILD   ?= build-asan
SAN_CC      ?= clang
# -asan-use-private-alias: the module's generated ngx_modules[] (and
# ngx_module_names[], ngx_module_order[]: nginx's dlsym() names) share their
# names with nginx's own exported arrays; ASan registered the module's
# redzones at the interposed symbol, i.e. on nginx's arrays, and the next
# SIGHUP's ngx_cycle_modules() copy of them read into those "redzones"
# (a false global-buffer-overflow; README.md "Sanitizers").  A private
# alias registers the module's own copy (clang; later LLVMs default to it).
SAN_FLAGS   ?= -fsanitize=address,undefined -fno-sanitize-recover=all \
               -fno-omit-frame-pointer \
               $(if $(findstring clang,$(SAN_CC)),-shared-libsan \
                 -mllvm -asan-use-private-alias=1)
SAN_RUNTIME ?= $(shell $(SAN_CC) -print-file-name=$(if $(findstring \
                 clang,$(SAN_CC)),libclang_rt.asan-x86_64.so,libasan.so))
SAN_TESTS   ?= $(sort $(wildcard t/[1-4]*.t))

module-asan:
	@CC=$(SAN_CC) CFLAGS="-O1 -g $(SAN_FLAGS)" \
	    MODULE_CC="$(SAN_CC) $(SAN_FLAGS)" \
	    $(MAKE) --no-print-directory BUILD=$(SAN_BUILD) module

test-asan: all module-asan
	@DPD_SAN_RUNTIME=$(SAN_RUNTIME) SAN_BUILD=$(SAN_BUILD) \
	    bash tools/run-sanitized.sh $(SAN_TESTS)

# Container images without a registry (tools/image.sh, docker/README.md):
# a Debian 12 base made here with debootstrap, the gateway image (nginx
# 1.30.4 from ../shared/vendor built in its build stage) run and
# smoke-tested (nginx -t, a short and a long request against the emulator
# on loopback), the kv_agent image with $(CUDA_HOME) mounted into its build.
image:
	@bash tools/deps.sh image
	@bash tools/image.sh all

# docker/k8s/dpd-gateway.yaml: the Helm chart (deploy/helm/dpd-gateway)
# rendered with its defaults by the helm `make deps` builds;
# t/deploy/10-manifests.t fails when it is stale.
k8s-manifests:
	@bash tools/k8s-manifests.sh

demo: deps
	@$(MAKE) --no-print-directory all
	@bash tools/demo.sh

bench: all
	@bash bench/run-all.sh

clean:
	rm -rf $(BUILD) $(SAN_BUILD) $(NGX130_BUILD) t/servroot* \
	    $(addprefix build-cuda,$(CUDA_MAJORS))
