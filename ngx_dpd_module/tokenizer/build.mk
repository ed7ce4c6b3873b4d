# tokenizer library (nginx-free) + CLI.  Products:
#   $(TOK_LIB)      build/libdpdtok.a      static, for CLI and C tests
#   $(TOK_PIC_LIB)  build/libdpdtok_pic.a  position independent, for the .so module
#   $(TOK_SO)       build/libdpdtok.so     for ctypes (vLLM emulator)
#   build/dpd-tokenize                     the CLI
TOK_DIR     := ngx_dpd_module/tokenizer
TOK_LIB     := $(BUILD)/libdpdtok.a
TOK_PIC_LIB := $(BUILD)/libdpdtok_pic.a
TOK_SO      := $(BUILD)/libdpdtok.so
