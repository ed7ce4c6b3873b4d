# The module against nginx.org's current stable, 1.30.4, built from the
# unmodified source in ../shared/vendor (next to the repository root; CI has
# it too).  `make build-1.30` unpacks and configures nginx 1.30.4 with the
# module as a dynamic module into build-1.30/ and builds both (nginx's own
# CFLAGS, -Werror among them); `make test-1.30` runs the module's test suite
# (t/*.t) with TEST_NGINX_BINARY / TEST_NGINX_LOAD_MODULES pointing at them.
# Both skip, saying why, when the tarball is absent (a fresh user machine):
# the stock Debian 1.22 build (`make`, `make test`) needs nothing from it.
# The tokenizer library comes from the main build ($(BUILD)).

NGX130_VER    := 1.30.4
NGX130_VENDOR ?= $(abspath $(CURDIR)/../shared/vendor)
NGX130_TAR    ?= $(NGX130_VENDOR)/nginx-$(NGX130_VER).tar.gz
NGX130_BUILD  ?= build-1.30
NGX130_SRC    := $(NGX130_BUILD)/nginx-$(NGX130_VER)
NGX130_BIN    := $(NGX130_BUILD)/nginx
NGX130_SO     := $(NGX130_BUILD)/ngx_http_dpd_module.so
NGX130_TESTS  ?= $(sort $(wildcard t/*.t))
# as Debian configures 1.22: the same built-in modules where the suite,
# the harness self-tests or docker/nginx-gateway.conf may name them
# (--with-compat so the .so matches the binary's signature).  The paths:
# NGX130_PATHS (the image installs into Debian's layout; here all stays
# under build-1.30/inst, the error log before the configuration is read
# goes to stderr as with Debian's binary).
NGX130_PATHS    ?= --prefix=$(abspath $(NGX130_BUILD))/inst \
                   --error-log-path=stderr
NGX130_FEATURES ?= --with-compat --with-debug --with-threads --with-pcre-jit \
                   --with-http_ssl_module --with-http_v2_module \
                   --with-http_stub_status_module --with-http_realip_module \
                   --with-http_auth_request_module --with-http_sub_module \
                   --with-http_addition_module --with-http_dav_module \
                   --with-http_slice_module --with-http_gunzip_module \
                   --with-http_gzip_static_module \
                   --with-http_secure_link_module
NGX130_FLAGS    ?= $(NGX130_PATHS) $(NGX130_FEATURES)

.PHONY: build-1.30 test-1.30

ifeq ($(wildcard $(NGX130_TAR)),)
build-1.30 test-1.30:
	@echo "$@: skipped: $(NGX130_TAR) is absent (nginx $(NGX130_VER)" \
	      "source, see ../shared/vendor/README.md); the Debian 1.22 build" \
	      "and tests do not need it"
else
build-1.30: $(NGX130_BIN) $(NGX130_SO)

test-1.30: build-1.30
	@echo "test-1.30: $$($(NGX130_BIN) -v 2>&1) with $(NGX130_SO)"
	@TEST_NGINX_BINARY=$(abspath $(NGX130_BIN)) \
	    TEST_NGINX_LOAD_MODULES=$(abspath $(NGX130_SO)) \
	    bash tools/run-tests.sh $(NGX130_TESTS)

# the vendored source has the git layout (auto/configure), a release
# tarball from nginx.org has ./configure: either works
$(NGX130_SRC)/.unpacked: $(NGX130_TAR)
	@mkdir -p $(NGX130_BUILD)
	rm -rf $(NGX130_SRC)
	tar xzf $< -C $(NGX130_BUILD)
	@test -d $(NGX130_SRC) || { echo "$<: no nginx-$(NGX130_VER)/ inside"; \
	    exit 1; }
	@touch $@

# configure again when the flags change (the image build passes others)
$(NGX130_BUILD)/configure-flags.txt: FORCE
	@mkdir -p $(@D)
	@echo "$(NGX130_FLAGS)" | cmp -s - $@ || echo "$(NGX130_FLAGS)" > $@

$(NGX130_SRC)/objs/Makefile: $(NGX130_SRC)/.unpacked config \
                             $(BUILD)/module-srcs.txt \
                             $(NGX130_BUILD)/configure-flags.txt
	cd $(NGX130_SRC) && { test -x configure && c=./configure || \
	    c=auto/configure; } && env -u CFLAGS \
	    DPD_BUILD_DIR=$(abspath $(BUILD)) $$c $(NGX130_FLAGS) \
	    --add-dynamic-module=$(CURDIR) >configure.log 2>&1 \
	    || { tail -30 configure.log; exit 1; }

# nginx's objs/Makefile knows its own and the module's dependencies; the
# .so is removed first so the tokenizer library is always linked fresh
$(NGX130_BIN) $(NGX130_SO) &: $(NGX130_SRC)/objs/Makefile $(MODULE_DEPS) \
                              $(TOK_PIC_LIB) FORCE
	rm -f $(NGX130_SRC)/objs/ngx_http_dpd_module.so
	$(MAKE) --no-print-directory -C $(NGX130_SRC) -f objs/Makefile \
	    binary modules CC="$(MODULE_CC)"
	@# by rename: a running nginx keeps its mapping of the old files
	cp $(NGX130_SRC)/objs/nginx $(NGX130_BIN).tmp && \
	    mv -f $(NGX130_BIN).tmp $(NGX130_BIN)
	cp $(NGX130_SRC)/objs/ngx_http_dpd_module.so $(NGX130_SO).tmp && \
	    mv -f $(NGX130_SO).tmp $(NGX130_SO)
endif
