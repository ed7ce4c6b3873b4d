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
KVA_SRCS   := util.c layout.c config.c auth.c state.c status.c fabric.c \
              topo.c copy.c stage.c ring.c \
              bench.c pool.c ctrl.c xfer.c api.c loop.c main.c \
              lmcache_notify.c kv_events.c kv_events_sub.c kv_events_dump.c
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
KVA_CUDA_LIBS := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart

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

# ---- libFuzzer (clang; FUZZ_CC and FUZZ_FLAGS from tokenizer/build.mk):
# the KV-event decoder, which reads what any engine on the network sends
KVA_FUZZ := $(BUILD)/fuzz/kv_fuzz_events

$(KVA_FUZZ): $(KVA_DIR)/fuzz/kv_fuzz_events.c $(KVA_DIR)/src/kv_events.c \
		$(KVA_DIR)/src/kv_events.h
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_FLAGS) -I$(KVA_DIR)/src $< $(KVA_DIR)/src/kv_events.c \
	    -o $@

# (run by the fuzz recipe in tokenizer/build.mk)
fuzz: $(KVA_FUZZ)
