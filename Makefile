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

.PHONY: all deps test test-quick test-valgrind demo bench clean module programs fuzz
all: module programs

include ngx_dpd_module/tokenizer/build.mk
include kv_agent/build.mk
include ngx_dpd_module/build.mk

deps:
	@bash tools/deps.sh

# The whole suite: every t/**/*.t through prove (TAP summary at the end).
test: deps
	@$(MAKE) --no-print-directory all
	@bash tools/run-tests.sh

# Same, without the dependency step (for a machine already set up).
test-quick: all
	@bash tools/run-tests.sh

# The module's tests with nginx under valgrind memcheck (fails on any
# invalid access or definite leak).
test-valgrind: all
	@TEST_NGINX_USE_VALGRIND=1 bash tools/run-tests.sh $(sort $(wildcard t/[1-4]*.t))

demo: deps
	@$(MAKE) --no-print-directory all
	@bash tools/demo.sh

bench: all
	@bash bench/run-all.sh

clean:
	rm -rf $(BUILD) t/servroot*
