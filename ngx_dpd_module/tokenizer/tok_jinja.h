/*
 * A Jinja2 template engine for Hugging Face chat templates (no nginx
 * dependency).  Parsed once (tj_compile), rendered any number of times by
 * any number of threads (tj_render): a compiled template is immutable,
 * everything a render allocates lives in that render's arena.
 *
 * The environment is transformers' one: trim_blocks, lstrip_blocks,
 * keep_trailing_newline off, the loopcontrols extension, the generation
 * tag (a plain block), tojson as json.dumps(ensure_ascii=False),
 * raise_exception and strftime_now, sandboxed: no attribute of a value is
 * reachable but the documented methods, lists and dicts are immutable.
 *
 *   tok_jinja_value.c  arena, values, JSON in and out, Python str()/repr()
 *   tok_jinja_lex.c    template text to tokens (whitespace control)
 *   tok_jinja_parse.c  tokens to the tree, vLLM's content format detection
 *   tok_jinja_eval.c   the tree to text: statements, expressions, filters,
 *                      tests, methods
 */

#ifndef TOK_JINJA_H
#define TOK_JINJA_H

#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>

struct cJSON;

/* ---- arena: chunked bump allocation, freed at once */

typedef struct tj_blk_s  tj_blk_t;

typedef struct {
    tj_blk_t   *head;
    size_t      total;          /* bytes taken from malloc */
    size_t      limit;          /* 0: no limit */
} tj_arena_t;

void *tj_arena_alloc(tj_arena_t *a, size_t n);    /* NULL: out of memory */
void tj_arena_free(tj_arena_t *a);


/* ---- values */

typedef enum {
    TJ_UNDEF = 0,   /* u.s/n: the name, for messages */
    TJ_NONE,
    TJ_BOOL,
    TJ_INT,
    TJ_FLOAT,
    TJ_STR,
    TJ_LIST,        /* also tuples (l->tuple) */
    TJ_DICT,        /* also namespace() objects (d->ns) */
    TJ_LOOP,        /* a for loop's "loop" */
    TJ_MACRO,
    TJ_FUNC         /* a global function or a bound method */
} tj_type_t;

/*
 * A value is 16 bytes, returned in registers: string lengths are 32 bits.
 * Longer strings are refused where they enter (JSON, the request, the
 * template), and a render's memory and output stay below it.
 */
#define TJ_STR_MAX  0xfffffff0u

typedef struct tj_list_s   tj_list_t;
typedef struct tj_dict_s   tj_dict_t;
typedef struct tj_node_s   tj_node_t;

typedef struct {
    uint16_t        t;
    uint16_t        aux;        /* TJ_FUNC: function id */
    uint32_t        n;          /* TJ_STR: bytes (< TJ_STR_MAX) */
    union {
        int64_t     i;
        double      f;
        const char *s;
        tj_list_t  *l;
        tj_dict_t  *d;
        void       *p;          /* TJ_FUNC: the bound value (tj_val_t *) */
    } u;
} tj_val_t;

struct tj_list_s {
    tj_val_t   *v;
    size_t      n, cap;
    int         tuple;
};

typedef struct {
    const char *k;
    size_t      kn;
    tj_val_t    v;
} tj_pair_t;

/* insertion ordered, string keys (JSON objects, namespace, kwargs) */
struct tj_dict_s {
    tj_pair_t  *p;
    size_t      n, cap;
    int         ns;
};


/* ---- output buffer (malloc, bounded) */

typedef struct {
    char       *p;
    size_t      len, cap, max;
    int         over;           /* max reached */
    int         oom;
    tj_arena_t *a;              /* grow in this arena, not with malloc */
} tj_buf_t;

int tj_buf_add(tj_buf_t *b, const char *s, size_t n);


/* ---- the render state (one per render, on the caller's stack) */

typedef struct tj_frame_s  tj_frame_t;

typedef struct {
    size_t      max_output;     /* bytes of rendered text */
    size_t      max_memory;     /* arena bytes */
    unsigned long max_steps;    /* evaluated nodes and loop iterations */
    unsigned    max_depth;      /* macro / caller / recursion depth */
    size_t      out_hint;       /* the output buffer's first size, or 0 */
} tj_limits_t;

/* a string made by +, ~ with room after it (tj_str_cat) */
#define TJ_NGROW     4
#define TJ_GROW_MIN  256        /* shorter results get no room */

typedef struct {
    char       *p;
    size_t      n;              /* the longest value made in it so far */
    size_t      cap;
} tj_grow_t;

typedef struct {
    tj_arena_t      arena;
    tj_buf_t       *out;        /* current sink */
    tj_grow_t       grow[TJ_NGROW];
    unsigned        grow_next;
    tj_frame_t     *frame;
    tj_frame_t     *top;        /* template level */
    const tj_dict_t *globals;   /* the caller's variables */
    tj_limits_t     lim;
    unsigned long   steps;
    unsigned        depth;
    int             ctl;        /* 1 break, 2 continue */
    const tj_val_t *caller;     /* inside {% call %}: caller() */
    const unsigned char *local; /* by name id: a frame may hold it */
    tj_val_t       *gval;       /* by name id: the global or builtin */
    unsigned char  *gset;       /* by name id: gval[id] is known */
    jmp_buf         jb;
    char           *err;
    size_t          errlen;
} tj_ctx_t;

_Noreturn void tj_fail(tj_ctx_t *c, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void *tj_alloc(tj_ctx_t *c, size_t n);      /* fails the render on OOM */

/* constructors */
tj_val_t tj_undef(const char *name, size_t n);
tj_val_t tj_none(void);

/* inline: the evaluator makes them for every comparison and loop.index */
static inline tj_val_t
tj_bool(int b)
{
    tj_val_t  v = { 0 };

    v.t = TJ_BOOL;
    v.u.i = b ? 1 : 0;
    return v;
}


static inline tj_val_t
tj_int(int64_t i)
{
    tj_val_t  v = { 0 };

    v.t = TJ_INT;
    v.u.i = i;
    return v;
}

tj_val_t tj_float(double f);
tj_val_t tj_str(const char *s, size_t n);
tj_val_t tj_cstr(const char *s);
tj_val_t tj_str_copy(tj_ctx_t *c, const char *s, size_t n);
tj_val_t tj_new_list(tj_ctx_t *c, size_t cap);
tj_val_t tj_new_dict(tj_ctx_t *c, size_t cap);

void tj_list_push(tj_ctx_t *c, tj_list_t *l, tj_val_t v);
void tj_dict_set(tj_ctx_t *c, tj_dict_t *d, const char *k, size_t kn,
    tj_val_t v);
tj_val_t *tj_dict_get(const tj_dict_t *d, const char *k, size_t kn);
const char *tj_intern(const char *s, size_t n);     /* common names */
/* some of them, for keys set without tj_intern()'s search */
extern const char tj_k_role[], tj_k_content[], tj_k_name[], tj_k_type[],
    tj_k_text[], tj_k_loop[], tj_k_tools[], tj_k_messages[], tj_k_function[],
    tj_k_reasoning[], tj_k_documents[], tj_k_tool_calls[], tj_k_tool_call_id[],
    tj_k_reasoning_content[], tj_k_add_generation_prompt[],
    tj_k_continue_final_message[];

/* the same on an arena, for values built before a render (NULL: OOM) */
int tj_a_list_push(tj_arena_t *a, tj_list_t *l, tj_val_t v);
int tj_a_dict_set(tj_arena_t *a, tj_dict_t *d, const char *k, size_t kn,
    tj_val_t v);
int tj_a_dict_add(tj_arena_t *a, tj_dict_t *d, const char *k, size_t kn,
    tj_val_t v);                                    /* k not there */
tj_dict_t *tj_a_dict(tj_arena_t *a);
tj_dict_t *tj_a_dict_cap(tj_arena_t *a, size_t cap);   /* room for cap */
tj_list_t *tj_a_list(tj_arena_t *a);

/* cJSON to values: strings are referenced, not copied (NULL v: OOM) */
int tj_from_cjson(tj_arena_t *a, const struct cJSON *j, tj_val_t *v,
    unsigned depth);

/* Python's json.loads of s[0..n): 0, or -1 when it is not JSON */
int tj_json_loads(tj_arena_t *a, const char *s, size_t n, tj_val_t *v);

/* json.dumps(v, ensure_ascii=False, indent=indent) (indent < 0: none) */
void tj_tojson(tj_ctx_t *c, tj_buf_t *b, tj_val_t v, long indent,
    const char *indent_str, size_t indent_n, unsigned level);

/* Python str(v) and repr(v) */
void tj_str_of(tj_ctx_t *c, tj_buf_t *b, tj_val_t v);
void tj_repr(tj_ctx_t *c, tj_buf_t *b, tj_val_t v);
tj_val_t tj_to_str(tj_ctx_t *c, tj_val_t v);

int tj_truthy_any(tj_val_t v);

static inline int
tj_truthy(tj_val_t v)
{
    return v.t == TJ_BOOL ? v.u.i != 0 : tj_truthy_any(v);
}

int tj_equal(tj_val_t a, tj_val_t b);
const char *tj_type_name(tj_val_t v);

/* Python str.isspace() for a code point */
int tj_py_space(uint32_t cp);
size_t tj_utf8_next(const char *s, size_t n, uint32_t *cp);
size_t tj_utf8_count(const char *s, size_t n);


/* ---- lexer */

typedef enum {
    TK_EOF = 0,
    TK_DATA,            /* raw text */
    TK_VAR_BEGIN,       /* {{ */
    TK_VAR_END,         /* }} */
    TK_BLOCK_BEGIN,     /* {% */
    TK_BLOCK_END,       /* %} */
    TK_NAME,
    TK_STRING,          /* escapes resolved */
    TK_INT,
    TK_FLOAT,
    TK_OP               /* s: the operator */
} tj_tok_kind_t;

typedef struct {
    tj_tok_kind_t   kind;
    unsigned        line;
    const char     *s;      /* into the source, or into the arena */
    size_t          n;
    int64_t         i;
    double          f;
} tj_token_t;

typedef struct {
    tj_token_t     *t;
    size_t          n, cap;
} tj_tokens_t;

int tj_lex(tj_arena_t *a, const char *src, size_t len, tj_tokens_t *out,
    char *err, size_t errlen);


/* ---- the tree */

typedef enum {
    /* expressions */
    TN_LIT, TN_NAME, TN_LIST, TN_TUPLE, TN_DICT, TN_PAIR, TN_ATTR, TN_ITEM,
    TN_SLICE, TN_CALL, TN_KWARG, TN_FILTER, TN_TEST, TN_NEG, TN_POS, TN_NOT,
    TN_AND, TN_OR, TN_BIN, TN_CMP, TN_CONCAT, TN_COND,
    /* statements */
    TN_TEXT, TN_OUT, TN_IF, TN_FOR, TN_SET, TN_SETBLOCK, TN_MACRO,
    TN_CALLBLOCK, TN_FILTERBLOCK, TN_BREAK, TN_CONTINUE, TN_DO, TN_PARAM
} tj_node_kind_t;

/* TN_BIN / TN_CMP operators */
enum {
    TO_ADD = 1, TO_SUB, TO_MUL, TO_DIV, TO_FDIV, TO_MOD, TO_POW,
    TO_EQ, TO_NE, TO_LT, TO_LE, TO_GT, TO_GE, TO_IN, TO_NOTIN
};

struct tj_node_s {
    uint16_t        kind;
    uint16_t        op;         /* operator; TN_TEST: negated; TN_FOR:
                                   recursive */
    unsigned        line;
    tj_node_t      *a, *b, *c, *d, *e;
    tj_node_t      *next;       /* lists: statements, items, arguments */
    tj_val_t        v;          /* literal, name, attribute, filter name */
    int             fid;        /* filter / test id, -1 none; TN_NAME:
                                   the name id; TN_ATTR: special */
};

typedef struct {
    tj_arena_t      arena;      /* the tree and its strings */
    tj_node_t      *body;
    int             openai;     /* vLLM: content format "openai" */
    unsigned        nsym;       /* distinct names (TN_NAME fid: the id) */
    unsigned char  *local;      /* by id: set/for/macro/parameter names */
} tj_template_t;

tj_template_t *tj_compile(const char *src, size_t len, char *err,
    size_t errlen);
void tj_template_free(tj_template_t *t);

/* filter / test ids (tok_jinja_eval.c), -1 unknown */
int tj_filter_id(const char *name, size_t n);
int tj_test_id(const char *name, size_t n);
int tj_attr_special(const char *name, size_t n);   /* may be a method */
int tj_loop_attr_id(const char *name, size_t n);   /* loop.NAME, 0 none */

/*
 * Render with the variables in globals.  The caller's arena (a) holds
 * globals and becomes the render's arena (freed by the caller).
 * Returns 0 and the text in *out (malloc'ed, NUL-terminated), or -1 with
 * the message in err.
 */
int tj_render(const tj_template_t *t, tj_arena_t *a, const tj_dict_t *globals,
    const tj_limits_t *lim, char **out, size_t *outlen, char *err,
    size_t errlen);

/* tok_chat.c: a request rendered with t as dpd_chat_render_json() does */
struct dpd_tok_s;
int tok_chat_render_with(const struct dpd_tok_s *tok, const tj_template_t *t,
    const struct cJSON *request, char **out, size_t *outlen, char *err,
    size_t errlen);

#endif /* TOK_JINJA_H */
