# nginx module: built against a private copy of Debian's nginx-dev source
# tree with Debian's own configure flags (--with-compat among them), so the
# .so loads into the stock /usr/sbin/nginx with load_module.

NGX_BUILD   := $(BUILD)/nginx
NGX_FLAGS    = $(shell . $(NGX_SRC)/conf_flags 2>/dev/null && \
                 echo "$${NGX_CONF_FLAGS[@]}")
MODULE_SO   := $(BUILD)/ngx_http_dpd_module.so
MODULE_CSRC := $(sort $(wildcard ngx_dpd_module/ngx_http_dpd_*.c))
MODULE_DEPS := $(MODULE_CSRC) $(wildcard ngx_dpd_module/*.h) \
               $(wildcard kv_agent/include/*.h)
# compiler for the module's objects and link (nginx's objs/Makefile keeps
# its own CFLAGS, -Werror among them); the sanitizer build adds its flags
MODULE_CC   ?= $(CC)

module: $(MODULE_SO)

# objs/Makefile lists the module's sources: configure again whenever the
# addon config or the set of source files changes.
$(BUILD)/module-srcs.txt: FORCE | $(BUILD)
	@echo "$(MODULE_CSRC)" | cmp -s - $@ || echo "$(MODULE_CSRC)" > $@

# nginx's objs/Makefile rebuilds on sources only: a change of compiler or
# flags (the sanitizer build's SAN_FLAGS) drops the module's objects
$(BUILD)/module-cc.txt: FORCE | $(BUILD)
	@echo "$(MODULE_CC)" | cmp -s - $@ || { \
	    rm -f $(NGX_BUILD)/objs/addon/ngx_dpd_module/*.o \
	        $(NGX_BUILD)/objs/ngx_http_dpd_module_modules.o; \
	    echo "$(MODULE_CC)" > $@; }

$(NGX_BUILD)/objs/Makefile: config $(BUILD)/module-srcs.txt | $(BUILD)
	@test -f $(NGX_BUILD)/configure || cp -r $(NGX_SRC) $(NGX_BUILD)
	@# nginx's own compiler flags (-Werror ...): configure would take
	@# CFLAGS from the environment instead
	cd $(NGX_BUILD) && env -u CFLAGS DPD_BUILD_DIR=$(abspath $(BUILD)) \
	    ./configure $(NGX_FLAGS) \
	    --add-dynamic-module=$(CURDIR) >configure.log 2>&1 \
	    || { tail -30 configure.log; exit 1; }

$(MODULE_SO): $(NGX_BUILD)/objs/Makefile $(MODULE_DEPS) $(TOK_PIC_LIB) \
              $(BUILD)/module-cc.txt
	rm -f $(NGX_BUILD)/objs/ngx_http_dpd_module.so
	$(MAKE) --no-print-directory -C $(NGX_BUILD) -f objs/Makefile modules \
	    CC="$(MODULE_CC)"
	@# replace by rename: a running nginx keeps its mapping of the old file
	cp $(NGX_BUILD)/objs/ngx_http_dpd_module.so $@.tmp && mv -f $@.tmp $@

$(BUILD):
	mkdir -p $(BUILD)

.PHONY: FORCE
FORCE:

# ---- libFuzzer (clang): parse -> count -> upstream bodies, no nginx
# (FUZZ_CC, FUZZ_FLAGS and the fuzz target come from tokenizer/build.mk)
MODULE_FUZZ      := $(BUILD)/fuzz/dpd_fuzz_request
MODULE_FUZZ_SRCS := ngx_dpd_module/ngx_http_dpd_protocol.c \
                    ngx_dpd_module/ngx_http_dpd_json.c \
                    ngx_dpd_module/ngx_http_dpd_count.c

$(MODULE_FUZZ): ngx_dpd_module/fuzz/dpd_fuzz_request.c $(MODULE_FUZZ_SRCS) \
                ngx_dpd_module/ngx_http_dpd_protocol.h \
                ngx_dpd_module/ngx_http_dpd_count.h $(TOK_SRCS) $(TOK_HDRS) \
                kv_agent/include/dpd_prefix.h
	@mkdir -p $(@D)
	@# the count makes dpd_prefix_cache's keys (kv_agent/include)
	$(FUZZ_CC) $(FUZZ_FLAGS) -Ingx_dpd_module -Ikv_agent/include \
	    $< $(MODULE_FUZZ_SRCS) \
	    $(TOK_SRCS) -o $@ $(TOK_LIBS) -lm

# the request body's tree builder against libcjson's parser
JSON_FUZZ := $(BUILD)/fuzz/dpd_fuzz_json

$(JSON_FUZZ): ngx_dpd_module/fuzz/dpd_fuzz_json.c \
              ngx_dpd_module/ngx_http_dpd_json.c \
              ngx_dpd_module/ngx_http_dpd_json.h \
              $(TOK_DIR)/tok_cjson.h
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_FLAGS) -Ingx_dpd_module $< \
	    ngx_dpd_module/ngx_http_dpd_json.c -o $@ -lcjson -lm

fuzz: $(MODULE_FUZZ) $(JSON_FUZZ)
