# tokenizer library (nginx-free) + CLI.  Products:
#   $(TOK_LIB)      build/libdpdtok.a      static, for CLI and C tests
#   $(TOK_PIC_LIB)  build/libdpdtok_pic.a  position independent, for the .so module
#   $(TOK_SO)       build/libdpdtok.so     for ctypes (vLLM emulator)
#   build/dpd-tokenize                     the CLI
#   make fuzz                              libFuzzer runs (clang), FUZZ_SECONDS each
#                                          (tokenizer + the module's request path)
TOK_DIR     := ngx_dpd_module/tokenizer
TOK_LIB     := $(BUILD)/libdpdtok.a
TOK_PIC_LIB := $(BUILD)/libdpdtok_pic.a
TOK_SO      := $(BUILD)/libdpdtok.so
TOK_LIBS    := -lpcre2-8 -lcjson -lutf8proc -lpthread -lm

TOK_SRCS    := $(addprefix $(TOK_DIR)/,tok_hash.c tok_utf8.c tok_trie.c \
                 tok_bpe.c tok_pretok.c tok_pretok_fast.c tok_encode.c \
                 tok_load.c tok_load_fast.c tok_config.c tok_chat.c \
                 tok_harmony.c tok_jinja_value.c tok_jinja_lex.c \
                 tok_jinja_parse.c tok_jinja_eval.c)
TOK_HDRS    := $(TOK_DIR)/dpd_tokenizer.h $(TOK_DIR)/tok_internal.h \
               $(TOK_DIR)/tok_jinja.h $(TOK_DIR)/tok_unicode9.h \
               $(TOK_DIR)/tok_pretok_class.h $(TOK_DIR)/tok_cjson.h
TOK_OBJS    := $(patsubst $(TOK_DIR)/%.c,$(BUILD)/tok/%.o,$(TOK_SRCS))
TOK_PIC_OBJS:= $(patsubst $(TOK_DIR)/%.c,$(BUILD)/tok_pic/%.o,$(TOK_SRCS))
TOK_CFLAGS   = $(CFLAGS) $(CSTD) $(WARN) -I$(TOK_DIR)

programs: $(TOK_LIB) $(TOK_PIC_LIB) $(TOK_SO) $(BUILD)/dpd-tokenize

$(BUILD)/tok/%.o: $(TOK_DIR)/%.c $(TOK_HDRS)
	@mkdir -p $(@D)
	$(CC) $(TOK_CFLAGS) -c $< -o $@

$(BUILD)/tok_pic/%.o: $(TOK_DIR)/%.c $(TOK_HDRS)
	@mkdir -p $(@D)
	$(CC) $(TOK_CFLAGS) -fPIC -c $< -o $@

$(TOK_LIB): $(TOK_OBJS)
	rm -f $@
	ar rcs $@ $^

$(TOK_PIC_LIB): $(TOK_PIC_OBJS)
	rm -f $@
	ar rcs $@ $^

$(TOK_SO): $(TOK_PIC_OBJS) $(TOK_DIR)/libdpdtok.map
	$(CC) -shared -Wl,--version-script=$(TOK_DIR)/libdpdtok.map \
	    -o $@ $(TOK_PIC_OBJS) $(TOK_LIBS)

# the fast pre-tokenizer's class table, from the system pcre2 (committed)
tok-class-table:
	@mkdir -p $(BUILD)
	$(CC) -O2 $(TOK_DIR)/gen_pretok_class.c -lpcre2-8 \
	    -o $(BUILD)/gen_pretok_class
	$(BUILD)/gen_pretok_class > $(TOK_DIR)/tok_pretok_class.h

$(BUILD)/dpd-tokenize: $(TOK_DIR)/dpd_tokenize.c $(TOK_LIB) $(TOK_HDRS)
	$(CC) $(TOK_CFLAGS) $< -o $@ $(TOK_LIB) $(TOK_LIBS)

# ---- libFuzzer (clang): loader and encode, bounded runs
FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 60
FUZZ_FLAGS   := -g -O1 -fsanitize=fuzzer,address,undefined \
                -fno-sanitize-recover=undefined $(CSTD) -I$(TOK_DIR)
TOK_FUZZ     := $(BUILD)/fuzz/tok_fuzz_load $(BUILD)/fuzz/tok_fuzz_encode \
                $(BUILD)/fuzz/tok_fuzz_jinja $(BUILD)/fuzz/tok_fuzz_pretok

$(BUILD)/fuzz/%: $(TOK_DIR)/fuzz/%.c $(TOK_SRCS) $(TOK_HDRS)
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_FLAGS) $< $(TOK_SRCS) -o $@ $(TOK_LIBS)

# the template engine as a plain program, for valgrind on the fuzz seeds
$(BUILD)/tok_jinja_standalone: $(TOK_DIR)/fuzz/tok_fuzz_jinja.c $(TOK_LIB) $(TOK_HDRS)
	$(CC) $(TOK_CFLAGS) -DTJ_STANDALONE $< -o $@ $(TOK_LIB) $(TOK_LIBS)

# (ngx_dpd_module/build.mk adds the request-path target)
fuzz: $(TOK_FUZZ)
	bash $(TOK_DIR)/fuzz/run.sh $(BUILD) $(FUZZ_SECONDS)
	bash ngx_dpd_module/fuzz/run.sh $(BUILD) $(FUZZ_SECONDS)
	bash kv_agent/fuzz/run.sh $(BUILD) $(FUZZ_SECONDS)
