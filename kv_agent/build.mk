# kv_agent daemon, client library and test helpers.  Products:
#   build/kv_agent               the daemon (+ bench and status subcommands)
#   build/libkvagent_client.a    C client library (kv_agent_client.h)
#   build/kv_agent_ctl           CLI over the client library (tests, scripts)
#   build/kv_cuda_ipc_helper     CUDA IPC "engine" for tools/gpu-check.sh
#                                (only when CUDA is present)
# The GPU path (-DKV_HAVE_CUDA) is compiled when the CUDA runtime headers
# exist under $(CUDA_HOME); nothing else changes without it.
KVA_DIR    := kv_agent
KVA_OBJDIR := $(BUILD)/obj/kv_agent
KVA_SRCS   := util.c layout.c config.c config_env.c auth.c state.c status.c fabric.c \
              topo.c copy.c stage.c ring.c \
              bench.c pool.c ctrl.c xfer.c api.c loop.c main.c \
              lmcache_notify.c prefix_index.c prefix_events.c peers_dns.c \
              kv_events.c kv_events_sub.c kv_events_dump.c kv_events_dns.c resolve.c
KVA_OBJS   := $(addprefix $(KVA_OBJDIR)/,$(KVA_SRCS:.c=.o))
KVA_CLI_OBJS := $(KVA_OBJDIR)/client.o
KVA_HDRS   := $(wildcard $(KVA_DIR)/src/*.h $(KVA_DIR)/include/*.h)
KVA_CFLAGS := $(CSTD) $(WARN) $(CFLAGS) -I$(KVA_DIR)/include -I$(KVA_DIR)/src
KVA_CRYPTO_CFLAGS := $(shell pkg-config --cflags libcrypto 2>/dev/null)
KVA_CRYPTO_LIBS   := $(shell pkg-config --libs libcrypto 2>/dev/null \
                       || echo -lcrypto)
KVA_CFLAGS += $(KVA_CRYPTO_CFLAGS)
KVA_LIBS   := -lfabric -lcjson $(KVA_CRYPTO_LIBS) -lpthread -lzmq -lmsgpackc

KVA_PROGS  := $(BUILD)/kv_agent $(BUILD)/libkvagent_client.a \
              $(BUILD)/kv_agent_ctl
# libcudart: a toolkit's libcudart.so, else the versioned libcudart.so.N
# alone (PyPI's wheels ship no unversioned link: -l:libcudart.so.N); the
# rpath is absolute, so CUDA_HOME may be relative (.deps/cuda-13).
KVA_CUDART := $(firstword \
    $(wildcard $(CUDA_HOME)/lib64/libcudart.so $(CUDA_HOME)/lib/libcudart.so) \
    $(wildcard $(CUDA_HOME)/lib64/libcudart.so.[0-9]* \
               $(CUDA_HOME)/lib/libcudart.so.[0-9]*))
ifeq ($(KVA_CUDART),)
KVA_CUDA_LIBDIR := $(abspath $(CUDA_HOME)/lib64)
KVA_CUDA_LINK   := -lcudart
else
KVA_CUDA_LIBDIR := $(abspath $(dir $(KVA_CUDART)))
KVA_CUDA_LINK   := $(if $(filter libcudart.so,$(notdir $(KVA_CUDART))),\
                        -lcudart,-l:$(notdir $(KVA_CUDART)))
endif
KVA_CUDA_LIBS := -L$(KVA_CUDA_LIBDIR) -Wl,-rpath,$(KVA_CUDA_LIBDIR) \
                 $(KVA_CUDA_LINK)

ifneq ($(wildcard $(CUDA_HOME)/include/cuda_runtime.h),)
KVA_CFLAGS += -DKV_HAVE_CUDA -I$(CUDA_HOME)/include
KVA_LIBS   += $(KVA_CUDA_LIBS)
KVA_PROGS  += $(BUILD)/kv_cuda_ipc_helper
endif

.PHONY: kv_agent
kv_agent: $(KVA_PROGS)
programs: $(KVA_PROGS)

$(KVA_OBJDIR)/%.o: $(KVA_DIR)/src/%.c $(KVA_HDRS)
	@mkdir -p $(KVA_OBJDIR)
	$(CC) $(KVA_CFLAGS) -c -o $@ $<

$(BUILD)/kv_agent: $(KVA_OBJS)
	$(CC) $(CFLAGS) -o $@ $(KVA_OBJS) $(KVA_LIBS)

$(BUILD)/libkvagent_client.a: $(KVA_CLI_OBJS)
	@mkdir -p $(BUILD)
	rm -f $@
	ar rcs $@ $(KVA_CLI_OBJS)

$(BUILD)/kv_agent_ctl: $(KVA_OBJDIR)/ctl.o $(BUILD)/libkvagent_client.a
	$(CC) $(CFLAGS) -o $@ $< $(BUILD)/libkvagent_client.a -lcjson

# plays the engine in tools/gpu-check.sh (CUDA IPC registration)
$(BUILD)/kv_cuda_ipc_helper: $(KVA_OBJDIR)/cuda_ipc_helper.o \
		$(BUILD)/libkvagent_client.a
	$(CC) $(CFLAGS) -o $@ $< $(BUILD)/libkvagent_client.a -lcjson \
		$(KVA_CUDA_LIBS)

# The GPU path against the PyPI CUDA runtimes tools/deps.sh installs
# (.deps/cuda-12, .deps/cuda-13; a toolkit instead: CUDA_HOME_12=DIR or
# CUDA_HOME_13=DIR), each into its own build-cudaN/, warnings as errors.
# Only these targets write build-cudaN/, so an object there that is up to
# date was compiled with -Werror.  t/kv_agent/61-cuda-build.t runs them.
CUDA_MAJORS ?= 12 13
.PHONY: kv-agent-cuda $(addprefix kv-agent-cuda,$(CUDA_MAJORS))
kv-agent-cuda: $(addprefix kv-agent-cuda,$(CUDA_MAJORS))
$(addprefix kv-agent-cuda,$(CUDA_MAJORS)): kv-agent-cuda%:
	@h=$${CUDA_HOME_$*:-.deps/cuda-$*}; \
	test -f $$h/include/cuda_runtime.h || { \
	    echo "kv-agent-cuda$*: no CUDA $* runtime under $$h" \
	         "(make deps; CUDA_HOME_$*=DIR for a toolkit)" >&2; exit 2; }; \
	$(MAKE) --no-print-directory BUILD=build-cuda$* CUDA_HOME=$$h \
	    CFLAGS="$(OPT) -g -Werror" kv_agent

# ---- libFuzzer (clang; FUZZ_CC and FUZZ_FLAGS from tokenizer/build.mk):
# the KV-event decoder, which reads what any engine on the network sends
KVA_FUZZ := $(BUILD)/fuzz/kv_fuzz_events

$(KVA_FUZZ): $(KVA_DIR)/fuzz/kv_fuzz_events.c $(KVA_DIR)/src/kv_events.c \
		$(KVA_DIR)/src/kv_events.h
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_FLAGS) -I$(KVA_DIR)/src $< $(KVA_DIR)/src/kv_events.c \
	    -o $@

# the prefix index writer behind it (prefix_events.c, prefix_index.c)
KVA_FUZZ_PFX := $(BUILD)/fuzz/kv_fuzz_prefix
KVA_FUZZ_PFX_SRCS := $(addprefix $(KVA_DIR)/src/,kv_events.c prefix_events.c \
                       prefix_index.c util.c)

$(KVA_FUZZ_PFX): $(KVA_DIR)/fuzz/kv_fuzz_prefix.c $(KVA_FUZZ_PFX_SRCS) \
		$(KVA_HDRS)
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_FLAGS) $(CSTD) -I$(KVA_DIR)/include -I$(KVA_DIR)/src \
	    $< $(KVA_FUZZ_PFX_SRCS) -o $@ -lcjson

# (run by the fuzz recipe in tokenizer/build.mk)
fuzz: $(KVA_FUZZ) $(KVA_FUZZ_PFX)
