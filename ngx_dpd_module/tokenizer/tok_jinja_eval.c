/*
 * The tree to text.  Scoping as Jinja2: a for loop's body and a macro
 * call have their own frame (a "set" there does not leak out, hence
 * namespace()), if blocks do not.  Undefined values print as "", are
 * false, iterate as empty; their attributes are errors.  Errors unwind
 * with longjmp to tj_render(): everything a render allocates is in its
 * arena, the output buffer is freed there.
 */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include <utf8proc.h>

#include "tok_internal.h"
#include "tok_jinja.h"


struct tj_frame_s {
    tj_frame_t     *parent;
    tj_dict_t       vars;
};

typedef struct {
    const tj_node_t *def;       /* TN_MACRO, or TN_CALLBLOCK for caller() */
    tj_frame_t      *closure;
    const tj_val_t  *caller;    /* the caller() seen inside a call block */
} tj_macro_t;

typedef struct {
    tj_list_t       *items;
    size_t           i;
    unsigned         depth;
} tj_loop_t;

/* function ids (TJ_FUNC aux) */
enum {
    F_RANGE = 1, F_NAMESPACE, F_DICT, F_RAISE, F_STRFTIME, F_CYCLE,
    /* str methods */
    M_STRIP, M_LSTRIP, M_RSTRIP, M_SPLIT, M_RSPLIT, M_STARTSWITH, M_ENDSWITH,
    M_UPPER, M_LOWER, M_TITLE, M_CAPITALIZE, M_REPLACE, M_FIND, M_RFIND,
    M_COUNT, M_JOIN, M_SPLITLINES, M_ISDIGIT, M_ISALPHA, M_ISSPACE,
    M_ISALNUM, M_ISUPPER, M_ISLOWER, M_INDEX,
    /* dict methods */
    M_GET, M_KEYS, M_VALUES, M_ITEMS,
    /* list methods */
    M_LINDEX, M_LCOUNT
};

#define TJ_MAX_ARGS  8

/* filter and test ids (tj_filter_id(), tj_test_id()) */
enum {
    FL_ABS, FL_CAPITALIZE, FL_COUNT, FL_DEFAULT, FL_D, FL_DICTSORT, FL_E,
    FL_ESCAPE, FL_FIRST, FL_FLOAT, FL_INDENT, FL_INT, FL_ITEMS, FL_JOIN,
    FL_LAST, FL_LENGTH, FL_LIST, FL_LOWER, FL_MAP, FL_MAX, FL_MIN, FL_REJECT,
    FL_REJECTATTR, FL_REPLACE, FL_REVERSE, FL_ROUND, FL_SAFE, FL_SELECT,
    FL_SELECTATTR, FL_SORT, FL_STRING, FL_SUM, FL_TITLE, FL_TOJSON, FL_TRIM,
    FL_UNIQUE, FL_UPPER, FL_WORDCOUNT, FL_CENTER, FL_FORMAT, FL_BATCH,
    FL_N
};

enum {
    TS_BOOLEAN, TS_CALLABLE, TS_DEFINED, TS_DIVISIBLEBY, TS_EQ, TS_EQUALTO,
    TS_EQ2, TS_ESCAPED, TS_EVEN, TS_FALSE, TS_FLOAT, TS_GE, TS_GE2, TS_GT,
    TS_GT2, TS_GREATERTHAN, TS_IN, TS_INTEGER, TS_ITERABLE, TS_LE, TS_LE2,
    TS_LOWER, TS_LT, TS_LT2, TS_LESSTHAN, TS_MAPPING, TS_NE, TS_NE2, TS_NONE,
    TS_NUMBER, TS_ODD, TS_SAMEAS, TS_SEQUENCE, TS_STRING, TS_TRUE,
    TS_UNDEFINED, TS_UPPER, TS_N
};

/* memcpy() that takes an empty (NULL) source */
static inline void
tj_mcpy(void *d, const void *s, size_t n)
{
    if (n) {
        memcpy(d, s, n);
    }
}

typedef struct {
    tj_val_t        pos[TJ_MAX_ARGS];
    size_t          npos;
    const char     *kn[TJ_MAX_ARGS];
    size_t          kl[TJ_MAX_ARGS];
    tj_val_t        kv[TJ_MAX_ARGS];
    size_t          nkw;
} tj_args_t;


static tj_val_t tj_eval(tj_ctx_t *c, const tj_node_t *nd);
static void tj_exec(tj_ctx_t *c, const tj_node_t *nd);
static tj_val_t tj_call_value(tj_ctx_t *c, tj_val_t f, tj_args_t *args,
    const tj_node_t *at);
static tj_val_t tj_apply_filter(tj_ctx_t *c, int fid, tj_val_t v,
    tj_args_t *args, const char *name, size_t nlen);
static int tj_apply_test(tj_ctx_t *c, int tid, tj_val_t v, tj_args_t *args,
    const char *name, size_t nlen);


/* ---- output */

static inline void
tj_emit(tj_ctx_t *c, const char *s, size_t n)
{
    tj_buf_t  *b = c->out;

    /* room and under the bound: append here (tj_buf_add() does the rest) */
    if (b->len + n < b->cap && (b->max == 0 || b->len + n <= b->max)
        && !b->oom && !b->over)
    {
        tj_mcpy(b->p + b->len, s, n);
        b->len += n;
        b->p[b->len] = '\0';
        return;
    }
    if (tj_buf_add(c->out, s, n) != 0) {
        if (c->out->over) {
            tj_fail(c, "chat template: the prompt exceeds %zu bytes",
                    c->out->max);
        }
        tj_fail(c, "chat template: out of memory");
    }
}


static void
tj_step(tj_ctx_t *c)
{
    if (++c->steps > c->lim.max_steps) {
        tj_fail(c, "chat template: evaluation limit reached (%lu steps)",
                c->lim.max_steps);
    }
}


/* ---- variables */

static tj_frame_t *
tj_frame_new(tj_ctx_t *c, tj_frame_t *parent)
{
    tj_frame_t  *f = tj_alloc(c, sizeof(*f));

    memset(f, 0, sizeof(*f));
    f->parent = parent;
    return f;
}


static tj_val_t
tj_func(int id, const tj_val_t *self)
{
    tj_val_t  v = { 0 };

    v.t = TJ_FUNC;
    v.aux = (uint32_t) id;
    v.u.p = (void *) self;        /* the bound value, or NULL */
    return v;
}


/*
 * Frame variables are keyed by the template's canonical name pointers
 * (tj_psym() in the parser: every name a frame can hold, "loop"
 * included, comes from a node), so a pointer comparison finds them.
 */
static inline tj_val_t *
tj_frame_get(tj_frame_t *f, const char *name)
{
    size_t  i;

    for (i = 0; i < f->vars.n; i++) {
        if (f->vars.p[i].k == name) {
            return &f->vars.p[i].v;
        }
    }
    return NULL;
}


static void
tj_frame_set(tj_ctx_t *c, tj_frame_t *f, const char *name, size_t n,
    tj_val_t v)
{
    tj_val_t  *old = tj_frame_get(f, name);

    if (old) {
        *old = v;
        return;
    }
    /* a new name (canonical: no other spelling of it is there) */
    if (tj_a_dict_add(&c->arena, &f->vars, name, n, v) != 0) {
        tj_fail(c, "chat template: out of memory");
    }
}


static tj_val_t tj_lookup_global(tj_ctx_t *c, const char *name, size_t n);


/* a TN_NAME: the frames, then the globals and builtins (cached by id) */
static tj_val_t
tj_lookup(tj_ctx_t *c, const tj_node_t *nd)
{
    tj_frame_t  *f;
    tj_val_t    *v;

    /* names never assigned in the template are in no frame */
    for (f = c->local[nd->fid] ? c->frame : NULL; f; f = f->parent) {
        if ((v = tj_frame_get(f, nd->v.u.s)) != NULL) {
            return *v;
        }
    }
    if (c->gset[nd->fid]) {
        return c->gval[nd->fid];
    }
    c->gval[nd->fid] = tj_lookup_global(c, nd->v.u.s, nd->v.n);
    /* caller() depends on where it is called from */
    c->gset[nd->fid] = !(nd->v.n == 6 && memcmp(nd->v.u.s, "caller", 6) == 0);
    return c->gval[nd->fid];
}


static tj_val_t
tj_lookup_global(tj_ctx_t *c, const char *name, size_t n)
{
    tj_val_t    *v;

    if (c->globals && (v = tj_dict_get(c->globals, name, n)) != NULL) {
        return *v;
    }
#define TJ_IS(s) (n == sizeof(s) - 1 && memcmp(name, s, n) == 0)
    if (TJ_IS("range")) {
        return tj_func(F_RANGE, NULL);
    }
    if (TJ_IS("namespace")) {
        return tj_func(F_NAMESPACE, NULL);
    }
    if (TJ_IS("dict")) {
        return tj_func(F_DICT, NULL);
    }
    if (TJ_IS("raise_exception")) {
        return tj_func(F_RAISE, NULL);
    }
    if (TJ_IS("strftime_now")) {
        return tj_func(F_STRFTIME, NULL);
    }
    if (TJ_IS("caller") && c->caller) {
        return *c->caller;
    }
#undef TJ_IS
    return tj_undef(name, n);
}


static tj_list_t *tj_iter_list(tj_ctx_t *c, tj_val_t v, const char *what);


static void
tj_assign(tj_ctx_t *c, const tj_node_t *target, tj_val_t v)
{
    const tj_node_t  *t;
    size_t            i;
    tj_val_t          ns;
    tj_list_t        *l;

    if (target->kind == TN_NAME) {
        tj_frame_set(c, c->frame, target->v.u.s, target->v.n, v);
        return;
    }
    if (target->kind == TN_ATTR) {
        ns = tj_eval(c, target->a);
        if (ns.t != TJ_DICT || !ns.u.d->ns) {
            tj_fail(c, "chat template: line %u: cannot assign attribute "
                    "'%.*s' on a %s (only namespace() objects)", target->line,
                    (int) target->v.n, target->v.u.s, tj_type_name(ns));
        }
        tj_dict_set(c, ns.u.d, target->v.u.s, target->v.n, v);
        return;
    }
    /* tuple unpacking: of any iterable, as Python's (a dict gives its
     * keys, a string its characters) */
    if (v.t != TJ_LIST && v.t != TJ_DICT && v.t != TJ_STR
        && v.t != TJ_UNDEF)
    {
        tj_fail(c, "chat template: line %u: cannot unpack a %s",
                target->line, tj_type_name(v));
    }
    l = tj_iter_list(c, v, "unpack");
    for (i = 0, t = target->a; t; t = t->next, i++) {
        if (i >= l->n) {
            tj_fail(c, "chat template: line %u: not enough values to unpack",
                    target->line);
        }
        tj_assign(c, t, l->v[i]);
    }
    if (i != l->n) {
        tj_fail(c, "chat template: line %u: too many values to unpack",
                target->line);
    }
}


/* ---- conversions */

static int64_t
tj_as_int(tj_ctx_t *c, tj_val_t v, const char *what)
{
    if (v.t == TJ_INT || v.t == TJ_BOOL) {
        return v.u.i;
    }
    tj_fail(c, "chat template: %s: expected an integer, got %s", what,
            tj_type_name(v));
}


static double
tj_as_num(tj_val_t v)
{
    return v.t == TJ_FLOAT ? v.u.f : (double) v.u.i;
}


static int
tj_isnum(tj_val_t v)
{
    return v.t == TJ_INT || v.t == TJ_FLOAT || v.t == TJ_BOOL;
}


static tj_val_t
tj_need_str(tj_ctx_t *c, tj_val_t v, const char *what)
{
    if (v.t != TJ_STR) {
        tj_fail(c, "chat template: %s: expected a string, got %s", what,
                tj_type_name(v));
    }
    return v;
}


/* list(v): lists as they are, dict keys, string characters */
static tj_list_t *
tj_iter_list(tj_ctx_t *c, tj_val_t v, const char *what)
{
    tj_val_t   l;
    size_t     i, k;
    uint32_t   cp;

    switch (v.t) {
    case TJ_LIST:
        return v.u.l;
    case TJ_UNDEF:
    case TJ_NONE:
        if (v.t == TJ_NONE) {
            tj_fail(c, "chat template: %s: 'NoneType' object is not "
                    "iterable", what);
        }
        return tj_new_list(c, 0).u.l;
    case TJ_DICT:
        l = tj_new_list(c, v.u.d->n);
        for (i = 0; i < v.u.d->n; i++) {
            l.u.l->v[i] = tj_str(v.u.d->p[i].k, v.u.d->p[i].kn);
        }
        l.u.l->n = v.u.d->n;
        return l.u.l;
    case TJ_STR:
        l = tj_new_list(c, tj_utf8_count(v.u.s, v.n));
        for (i = 0; i < v.n; i += k) {
            k = tj_utf8_next(v.u.s + i, v.n - i, &cp);
            l.u.l->v[l.u.l->n++] = tj_str(v.u.s + i, k);
        }
        return l.u.l;
    default:
        tj_fail(c, "chat template: %s: '%s' object is not iterable", what,
                tj_type_name(v));
    }
}


static size_t
tj_length(tj_ctx_t *c, tj_val_t v)
{
    switch (v.t) {
    case TJ_STR:
        return tj_utf8_count(v.u.s, v.n);
    case TJ_LIST:
        return v.u.l->n;
    case TJ_DICT:
        return v.u.d->n;
    case TJ_UNDEF:
        return 0;
    default:
        tj_fail(c, "chat template: object of type '%s' has no len()",
                tj_type_name(v));
    }
}


/* ---- comparison */

static int
tj_compare(tj_ctx_t *c, tj_val_t a, tj_val_t b, const char *op)
{
    size_t  i, n;
    int     r;

    if (tj_isnum(a) && tj_isnum(b)) {
        if (a.t != TJ_FLOAT && b.t != TJ_FLOAT) {
            return a.u.i < b.u.i ? -1 : a.u.i > b.u.i;
        }
        return tj_as_num(a) < tj_as_num(b) ? -1 : tj_as_num(a) > tj_as_num(b);
    }
    if (a.t == TJ_STR && b.t == TJ_STR) {
        n = a.n < b.n ? a.n : b.n;
        r = memcmp(a.u.s, b.u.s, n);
        if (r) {
            return r < 0 ? -1 : 1;
        }
        return a.n < b.n ? -1 : a.n > b.n;
    }
    if (a.t == TJ_LIST && b.t == TJ_LIST) {
        for (i = 0; i < a.u.l->n && i < b.u.l->n; i++) {
            if (!tj_equal(a.u.l->v[i], b.u.l->v[i])) {
                return tj_compare(c, a.u.l->v[i], b.u.l->v[i], op);
            }
        }
        return a.u.l->n < b.u.l->n ? -1 : a.u.l->n > b.u.l->n;
    }
    tj_fail(c, "chat template: '%s' not supported between instances of '%s' "
            "and '%s'", op, tj_type_name(a), tj_type_name(b));
}


/*
 * Whether n[0..nn) occurs in h[0..hn): short needles ('</think>') by
 * memchr() of the first byte (at most 16 bytes compared per candidate),
 * longer ones by memmem()
 */
static int
tj_find(const char *h, size_t hn, const char *n, size_t nn)
{
    const char  *p, *e;

    if (nn > hn) {
        return 0;
    }
    if (nn > 16) {
        return memmem(h, hn, n, nn) != NULL;
    }
    for (p = h, e = h + (hn - nn) + 1;
         (p = memchr(p, n[0], (size_t) (e - p))) != NULL; p++)
    {
        if (memcmp(p, n, nn) == 0) {
            return 1;
        }
    }
    return 0;
}


static int
tj_contains(tj_ctx_t *c, tj_val_t hay, tj_val_t needle)
{
    size_t  i;

    switch (hay.t) {
    case TJ_STR:
        if (needle.t != TJ_STR) {
            tj_fail(c, "chat template: 'in <string>' requires string as left "
                    "operand, not %s", tj_type_name(needle));
        }
        return needle.n == 0 || tj_find(hay.u.s, hay.n, needle.u.s, needle.n);
    case TJ_LIST:
        for (i = 0; i < hay.u.l->n; i++) {
            if (tj_equal(hay.u.l->v[i], needle)) {
                return 1;
            }
        }
        return 0;
    case TJ_DICT:
        return needle.t == TJ_STR
               && tj_dict_get(hay.u.d, needle.u.s, needle.n) != NULL;
    case TJ_UNDEF:
        return 0;
    default:
        tj_fail(c, "chat template: argument of type '%s' is not iterable",
                tj_type_name(hay));
    }
}


/* ---- attribute and item access */

static int
tj_method_id(tj_val_t obj, const char *n, size_t len)
{
    static const struct {
        const char *name;
        int         type;
        int         id;
    } m[] = {
        { "strip", TJ_STR, M_STRIP }, { "lstrip", TJ_STR, M_LSTRIP },
        { "rstrip", TJ_STR, M_RSTRIP }, { "split", TJ_STR, M_SPLIT },
        { "rsplit", TJ_STR, M_RSPLIT }, { "startswith", TJ_STR, M_STARTSWITH },
        { "endswith", TJ_STR, M_ENDSWITH }, { "upper", TJ_STR, M_UPPER },
        { "lower", TJ_STR, M_LOWER }, { "title", TJ_STR, M_TITLE },
        { "capitalize", TJ_STR, M_CAPITALIZE }, { "replace", TJ_STR, M_REPLACE },
        { "find", TJ_STR, M_FIND }, { "rfind", TJ_STR, M_RFIND },
        { "count", TJ_STR, M_COUNT }, { "join", TJ_STR, M_JOIN },
        { "splitlines", TJ_STR, M_SPLITLINES }, { "isdigit", TJ_STR, M_ISDIGIT },
        { "isalpha", TJ_STR, M_ISALPHA }, { "isspace", TJ_STR, M_ISSPACE },
        { "isalnum", TJ_STR, M_ISALNUM }, { "isupper", TJ_STR, M_ISUPPER },
        { "islower", TJ_STR, M_ISLOWER }, { "index", TJ_STR, M_INDEX },
        { "get", TJ_DICT, M_GET }, { "keys", TJ_DICT, M_KEYS },
        { "values", TJ_DICT, M_VALUES }, { "items", TJ_DICT, M_ITEMS },
        { "index", TJ_LIST, M_LINDEX }, { "count", TJ_LIST, M_LCOUNT },
    };
    size_t  i;

    if (obj.t == TJ_DICT && obj.u.d->ns) {
        return 0;
    }
    for (i = 0; i < sizeof(m) / sizeof(m[0]); i++) {
        if ((int) obj.t == m[i].type && strlen(m[i].name) == len
            && memcmp(m[i].name, n, len) == 0)
        {
            return m[i].id;
        }
    }
    return 0;
}


/* attributes the immutable sandbox refuses: a clear error, not undefined */
static int
tj_unsafe_attr(tj_val_t obj, const char *n, size_t len)
{
    static const char *const list_m[] = { "append", "extend", "insert", "pop",
        "remove", "clear", "sort", "reverse", NULL };
    static const char *const dict_m[] = { "update", "pop", "popitem",
        "setdefault", "clear", NULL };
    const char *const  *m;

    if (len > 1 && n[0] == '_') {
        return 1;
    }
    m = obj.t == TJ_LIST ? list_m : obj.t == TJ_DICT && !obj.u.d->ns ? dict_m
        : NULL;
    for ( ; m && *m; m++) {
        if (strlen(*m) == len && memcmp(*m, n, len) == 0) {
            return 1;
        }
    }
    return 0;
}


static tj_val_t
tj_bound(tj_ctx_t *c, tj_val_t obj, int id)
{
    tj_val_t  *self = tj_alloc(c, sizeof(tj_val_t));

    *self = obj;
    return tj_func(id, self);
}


static tj_val_t tj_loop_attr(tj_ctx_t *c, tj_val_t obj, const char *n,
    size_t len);


static tj_val_t tj_getitem(tj_ctx_t *c, tj_val_t obj, tj_val_t key,
    unsigned line, int from_attr);


/*
 * Whether obj.name may be a method or a refused attribute (decided once
 * per attribute node at parse time: other names are plain items).
 */
int
tj_attr_special(const char *n, size_t len)
{
    static const char *const names[] = { "strip", "lstrip", "rstrip",
        "split", "rsplit", "startswith", "endswith", "upper", "lower",
        "title", "capitalize", "replace", "find", "rfind", "count", "join",
        "splitlines", "isdigit", "isalpha", "isspace", "isalnum", "isupper",
        "islower", "index", "get", "keys", "values", "items", "append",
        "extend", "insert", "pop", "remove", "clear", "sort", "reverse",
        "update", "popitem", "setdefault", NULL };
    const char *const  *m;

    if (len > 1 && n[0] == '_') {
        return 1;
    }
    for (m = names; *m; m++) {
        if (strlen(*m) == len && memcmp(*m, n, len) == 0) {
            return 1;
        }
    }
    return 0;
}


static tj_val_t tj_getattr_any(tj_ctx_t *c, tj_val_t obj, const char *n,
    size_t len, unsigned line, int special);


/* obj.name: Jinja2 tries the attribute (methods), then the item */
static tj_val_t
tj_getattr(tj_ctx_t *c, tj_val_t obj, const char *n, size_t len,
    unsigned line)
{
    return tj_getattr_any(c, obj, n, len, line, 1);
}


static tj_val_t
tj_getattr_any(tj_ctx_t *c, tj_val_t obj, const char *n, size_t len,
    unsigned line, int special)
{
    int        id;
    tj_val_t  *v;

    if (obj.t == TJ_UNDEF) {
        tj_fail(c, "chat template: line %u: '%.*s' is undefined (reading "
                "'%.*s')", line, (int) obj.n, obj.u.s ? obj.u.s : "",
                (int) len, n);
    }
    if (obj.t == TJ_LOOP) {
        return tj_loop_attr(c, obj, n, len);
    }
    if (!special) {
        if (obj.t == TJ_DICT) {
            v = tj_dict_get(obj.u.d, n, len);
            return v ? *v : tj_undef(n, len);
        }
        return tj_undef(n, len);
    }
    if (tj_unsafe_attr(obj, n, len)) {
        tj_fail(c, "chat template: line %u: access to attribute '%.*s' of "
                "'%s' object is unsafe", line, (int) len, n, tj_type_name(obj));
    }
    if ((id = tj_method_id(obj, n, len)) != 0) {
        return tj_bound(c, obj, id);
    }
    if (obj.t == TJ_DICT) {
        v = tj_dict_get(obj.u.d, n, len);
        return v ? *v : tj_undef(n, len);
    }
    return tj_undef(n, len);
}


/* the byte offset of code point idx, stepping as tj_utf8_count() counts */
static size_t
tj_cp_offset(const char *s, size_t n, int64_t idx)
{
    size_t    i = 0;
    uint32_t  cp;

    while (idx > 0 && i < n) {
        i += ((unsigned char) s[i] < 0x80) ? 1 : tj_utf8_next(s + i, n - i,
                                                              &cp);
        idx--;
    }
    return i;
}


static tj_val_t
tj_getitem(tj_ctx_t *c, tj_val_t obj, tj_val_t key, unsigned line,
    int from_attr)
{
    int64_t    i, len;
    tj_val_t  *v;
    size_t     a, b;

    if (obj.t == TJ_UNDEF) {
        tj_fail(c, "chat template: line %u: '%.*s' is undefined", line,
                (int) obj.n, obj.u.s ? obj.u.s : "");
    }
    if (obj.t == TJ_DICT) {
        if (key.t == TJ_STR) {
            v = tj_dict_get(obj.u.d, key.u.s, key.n);
            if (v) {
                return *v;
            }
            if (tj_method_id(obj, key.u.s, key.n)) {
                return tj_bound(c, obj, tj_method_id(obj, key.u.s, key.n));
            }
            return tj_undef(key.u.s, key.n);
        }
        return tj_undef("(key)", 5);
    }
    if (obj.t == TJ_LOOP && key.t == TJ_STR) {
        return tj_loop_attr(c, obj, key.u.s, key.n);
    }
    if ((obj.t == TJ_LIST || obj.t == TJ_STR)
        && (key.t == TJ_INT || key.t == TJ_BOOL))
    {
        len = (int64_t) tj_length(c, obj);
        i = key.u.i;
        if (i < 0) {
            i += len;
        }
        if (i < 0 || i >= len) {
            return tj_undef("(index)", 7);
        }
        if (obj.t == TJ_LIST) {
            return obj.u.l->v[i];
        }
        a = tj_cp_offset(obj.u.s, obj.n, i);
        b = tj_cp_offset(obj.u.s + a, obj.n - a, 1) + a;
        return tj_str(obj.u.s + a, b - a);
    }
    if (key.t == TJ_STR && !from_attr) {
        return tj_getattr(c, obj, key.u.s, key.n, line);
    }
    return tj_undef("(item)", 6);
}


static tj_val_t
tj_slice(tj_ctx_t *c, tj_val_t obj, tj_val_t vs, tj_val_t ve, tj_val_t vst,
    unsigned line)
{
    int64_t    len, start, stop, step, i;
    tj_val_t   r;
    tj_buf_t   b = { 0 };
    size_t     k, off;
    uint32_t   cp;
    tj_list_t *src;
    size_t    *offs = NULL;

    if (obj.t == TJ_UNDEF) {
        tj_fail(c, "chat template: line %u: '%.*s' is undefined", line,
                (int) obj.n, obj.u.s ? obj.u.s : "");
    }
    if (obj.t != TJ_LIST && obj.t != TJ_STR) {
        tj_fail(c, "chat template: line %u: '%s' object is not subscriptable",
                line, tj_type_name(obj));
    }
    len = (int64_t) tj_length(c, obj);
    step = vst.t == TJ_NONE || vst.t == TJ_UNDEF ? 1
           : tj_as_int(c, vst, "slice step");
    if (step == 0) {
        tj_fail(c, "chat template: line %u: slice step cannot be zero", line);
    }
    if (vs.t == TJ_NONE || vs.t == TJ_UNDEF) {
        start = step < 0 ? len - 1 : 0;
    } else {
        start = tj_as_int(c, vs, "slice start");
        if (start < 0) {
            start += len;
            if (start < 0) {
                start = step < 0 ? -1 : 0;
            }
        } else if (start >= len) {
            start = step < 0 ? len - 1 : len;
        }
    }
    if (ve.t == TJ_NONE || ve.t == TJ_UNDEF) {
        stop = step < 0 ? -1 : len;
    } else {
        stop = tj_as_int(c, ve, "slice stop");
        if (stop < 0) {
            stop += len;
            if (stop < 0) {
                stop = step < 0 ? -1 : 0;
            }
        } else if (stop >= len) {
            stop = step < 0 ? len - 1 : len;
        }
    }
    if (obj.t == TJ_LIST) {
        src = obj.u.l;
        r = tj_new_list(c, 0);
        for (i = start; step > 0 ? i < stop : i > stop; i += step) {
            tj_list_push(c, r.u.l, src->v[i]);
        }
        return r;
    }
    /* strings: by code point */
    offs = tj_alloc(c, (size_t) (len + 1) * sizeof(size_t));
    for (off = 0, i = 0; off < obj.n; off += k, i++) {
        offs[i] = off;
        k = tj_utf8_next(obj.u.s + off, obj.n - off, &cp);
    }
    offs[len] = obj.n;
    b.a = &c->arena;
    for (i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (tj_buf_add(&b, obj.u.s + offs[i], offs[i + 1] - offs[i]) != 0) {
            tj_fail(c, "chat template: out of memory");
        }
    }
    return b.p ? tj_str(b.p, b.len) : tj_str("", 0);
}


/* ---- loop */

/* loop.NAME's number (TN_ATTR op, set by the parser), 0: none */
int
tj_loop_attr_id(const char *n, size_t len)
{
    static const char *const names[] = { "index", "index0", "revindex",
        "revindex0", "first", "last", "length", "depth", "depth0",
        "previtem", "nextitem", "cycle", NULL };
    int  i;

    for (i = 0; names[i]; i++) {
        if (strlen(names[i]) == len && memcmp(names[i], n, len) == 0) {
            return i + 1;
        }
    }
    return 0;
}


static tj_val_t
tj_loop_get(tj_ctx_t *c, tj_val_t obj, int id, const char *n, size_t len)
{
    tj_loop_t  *l = obj.u.p;
    size_t      cnt = l->items->n;

    switch (id) {
    case 1:
        return tj_int((int64_t) l->i + 1);
    case 2:
        return tj_int((int64_t) l->i);
    case 3:
        return tj_int((int64_t) (cnt - l->i));
    case 4:
        return tj_int((int64_t) (cnt - l->i - 1));
    case 5:
        return tj_bool(l->i == 0);
    case 6:
        return tj_bool(l->i + 1 == cnt);
    case 7:
        return tj_int((int64_t) cnt);
    case 8:
        return tj_int((int64_t) l->depth + 1);
    case 9:
        return tj_int((int64_t) l->depth);
    case 10:
        return l->i > 0 ? l->items->v[l->i - 1] : tj_undef("previtem", 8);
    case 11:
        return l->i + 1 < cnt ? l->items->v[l->i + 1]
                              : tj_undef("nextitem", 8);
    case 12:
        return tj_bound(c, obj, F_CYCLE);
    }
    return tj_undef(n, len);
}


static tj_val_t
tj_loop_attr(tj_ctx_t *c, tj_val_t obj, const char *n, size_t len)
{
    return tj_loop_get(c, obj, tj_loop_attr_id(n, len), n, len);
}


/* ---- string helpers with Python semantics */

static int
tj_in_chars(uint32_t cp, tj_val_t chars)
{
    size_t    i, k;
    uint32_t  x;

    for (i = 0; i < chars.n; i += k) {
        k = tj_utf8_next(chars.u.s + i, chars.n - i, &x);
        if (x == cp) {
            return 1;
        }
    }
    return 0;
}


/* str.strip([chars]): chars None -> whitespace */
static tj_val_t
tj_strip(tj_val_t s, tj_val_t chars, int left, int right)
{
    size_t    i = 0, j = s.n, k;
    uint32_t  cp;
    int       ws = chars.t != TJ_STR;

    if (left) {
        while (i < j) {
            k = tj_utf8_next(s.u.s + i, j - i, &cp);
            if (ws ? !tj_py_space(cp) : !tj_in_chars(cp, chars)) {
                break;
            }
            i += k;
        }
    }
    if (right) {
        while (j > i) {
            k = j - 1;
            while (k > i && ((unsigned char) s.u.s[k] & 0xC0) == 0x80) {
                k--;
            }
            tj_utf8_next(s.u.s + k, j - k, &cp);
            if (ws ? !tj_py_space(cp) : !tj_in_chars(cp, chars)) {
                break;
            }
            j = k;
        }
    }
    return tj_str(s.u.s + i, j - i);
}


/* Python 3 str.upper/title/lower of the code points whose full case
 * mapping (Unicode SpecialCasing) is more than one code point; generated
 * with unicodedata */
static const struct {
    uint32_t  cp, up[3], title[3], low[3];
} tj_special_case[] = {
    { 0x00DF, {0x0053, 0x0053, 0}, {0x0053, 0x0073, 0}, {0x00DF, 0, 0} },
    { 0x0130, {0x0130, 0, 0}, {0x0130, 0, 0}, {0x0069, 0x0307, 0} },
    { 0x0149, {0x02BC, 0x004E, 0}, {0x02BC, 0x004E, 0}, {0x0149, 0, 0} },
    { 0x01F0, {0x004A, 0x030C, 0}, {0x004A, 0x030C, 0}, {0x01F0, 0, 0} },
    { 0x0390, {0x0399, 0x0308, 0x0301}, {0x0399, 0x0308, 0x0301}, {0x0390, 0, 0} },
    { 0x03B0, {0x03A5, 0x0308, 0x0301}, {0x03A5, 0x0308, 0x0301}, {0x03B0, 0, 0} },
    { 0x0587, {0x0535, 0x0552, 0}, {0x0535, 0x0582, 0}, {0x0587, 0, 0} },
    { 0x1E96, {0x0048, 0x0331, 0}, {0x0048, 0x0331, 0}, {0x1E96, 0, 0} },
    { 0x1E97, {0x0054, 0x0308, 0}, {0x0054, 0x0308, 0}, {0x1E97, 0, 0} },
    { 0x1E98, {0x0057, 0x030A, 0}, {0x0057, 0x030A, 0}, {0x1E98, 0, 0} },
    { 0x1E99, {0x0059, 0x030A, 0}, {0x0059, 0x030A, 0}, {0x1E99, 0, 0} },
    { 0x1E9A, {0x0041, 0x02BE, 0}, {0x0041, 0x02BE, 0}, {0x1E9A, 0, 0} },
    { 0x1F50, {0x03A5, 0x0313, 0}, {0x03A5, 0x0313, 0}, {0x1F50, 0, 0} },
    { 0x1F52, {0x03A5, 0x0313, 0x0300}, {0x03A5, 0x0313, 0x0300}, {0x1F52, 0, 0} },
    { 0x1F54, {0x03A5, 0x0313, 0x0301}, {0x03A5, 0x0313, 0x0301}, {0x1F54, 0, 0} },
    { 0x1F56, {0x03A5, 0x0313, 0x0342}, {0x03A5, 0x0313, 0x0342}, {0x1F56, 0, 0} },
    { 0x1F80, {0x1F08, 0x0399, 0}, {0x1F88, 0, 0}, {0x1F80, 0, 0} },
    { 0x1F81, {0x1F09, 0x0399, 0}, {0x1F89, 0, 0}, {0x1F81, 0, 0} },
    { 0x1F82, {0x1F0A, 0x0399, 0}, {0x1F8A, 0, 0}, {0x1F82, 0, 0} },
    { 0x1F83, {0x1F0B, 0x0399, 0}, {0x1F8B, 0, 0}, {0x1F83, 0, 0} },
    { 0x1F84, {0x1F0C, 0x0399, 0}, {0x1F8C, 0, 0}, {0x1F84, 0, 0} },
    { 0x1F85, {0x1F0D, 0x0399, 0}, {0x1F8D, 0, 0}, {0x1F85, 0, 0} },
    { 0x1F86, {0x1F0E, 0x0399, 0}, {0x1F8E, 0, 0}, {0x1F86, 0, 0} },
    { 0x1F87, {0x1F0F, 0x0399, 0}, {0x1F8F, 0, 0}, {0x1F87, 0, 0} },
    { 0x1F88, {0x1F08, 0x0399, 0}, {0x1F88, 0, 0}, {0x1F80, 0, 0} },
    { 0x1F89, {0x1F09, 0x0399, 0}, {0x1F89, 0, 0}, {0x1F81, 0, 0} },
    { 0x1F8A, {0x1F0A, 0x0399, 0}, {0x1F8A, 0, 0}, {0x1F82, 0, 0} },
    { 0x1F8B, {0x1F0B, 0x0399, 0}, {0x1F8B, 0, 0}, {0x1F83, 0, 0} },
    { 0x1F8C, {0x1F0C, 0x0399, 0}, {0x1F8C, 0, 0}, {0x1F84, 0, 0} },
    { 0x1F8D, {0x1F0D, 0x0399, 0}, {0x1F8D, 0, 0}, {0x1F85, 0, 0} },
    { 0x1F8E, {0x1F0E, 0x0399, 0}, {0x1F8E, 0, 0}, {0x1F86, 0, 0} },
    { 0x1F8F, {0x1F0F, 0x0399, 0}, {0x1F8F, 0, 0}, {0x1F87, 0, 0} },
    { 0x1F90, {0x1F28, 0x0399, 0}, {0x1F98, 0, 0}, {0x1F90, 0, 0} },
    { 0x1F91, {0x1F29, 0x0399, 0}, {0x1F99, 0, 0}, {0x1F91, 0, 0} },
    { 0x1F92, {0x1F2A, 0x0399, 0}, {0x1F9A, 0, 0}, {0x1F92, 0, 0} },
    { 0x1F93, {0x1F2B, 0x0399, 0}, {0x1F9B, 0, 0}, {0x1F93, 0, 0} },
    { 0x1F94, {0x1F2C, 0x0399, 0}, {0x1F9C, 0, 0}, {0x1F94, 0, 0} },
    { 0x1F95, {0x1F2D, 0x0399, 0}, {0x1F9D, 0, 0}, {0x1F95, 0, 0} },
    { 0x1F96, {0x1F2E, 0x0399, 0}, {0x1F9E, 0, 0}, {0x1F96, 0, 0} },
    { 0x1F97, {0x1F2F, 0x0399, 0}, {0x1F9F, 0, 0}, {0x1F97, 0, 0} },
    { 0x1F98, {0x1F28, 0x0399, 0}, {0x1F98, 0, 0}, {0x1F90, 0, 0} },
    { 0x1F99, {0x1F29, 0x0399, 0}, {0x1F99, 0, 0}, {0x1F91, 0, 0} },
    { 0x1F9A, {0x1F2A, 0x0399, 0}, {0x1F9A, 0, 0}, {0x1F92, 0, 0} },
    { 0x1F9B, {0x1F2B, 0x0399, 0}, {0x1F9B, 0, 0}, {0x1F93, 0, 0} },
    { 0x1F9C, {0x1F2C, 0x0399, 0}, {0x1F9C, 0, 0}, {0x1F94, 0, 0} },
    { 0x1F9D, {0x1F2D, 0x0399, 0}, {0x1F9D, 0, 0}, {0x1F95, 0, 0} },
    { 0x1F9E, {0x1F2E, 0x0399, 0}, {0x1F9E, 0, 0}, {0x1F96, 0, 0} },
    { 0x1F9F, {0x1F2F, 0x0399, 0}, {0x1F9F, 0, 0}, {0x1F97, 0, 0} },
    { 0x1FA0, {0x1F68, 0x0399, 0}, {0x1FA8, 0, 0}, {0x1FA0, 0, 0} },
    { 0x1FA1, {0x1F69, 0x0399, 0}, {0x1FA9, 0, 0}, {0x1FA1, 0, 0} },
    { 0x1FA2, {0x1F6A, 0x0399, 0}, {0x1FAA, 0, 0}, {0x1FA2, 0, 0} },
    { 0x1FA3, {0x1F6B, 0x0399, 0}, {0x1FAB, 0, 0}, {0x1FA3, 0, 0} },
    { 0x1FA4, {0x1F6C, 0x0399, 0}, {0x1FAC, 0, 0}, {0x1FA4, 0, 0} },
    { 0x1FA5, {0x1F6D, 0x0399, 0}, {0x1FAD, 0, 0}, {0x1FA5, 0, 0} },
    { 0x1FA6, {0x1F6E, 0x0399, 0}, {0x1FAE, 0, 0}, {0x1FA6, 0, 0} },
    { 0x1FA7, {0x1F6F, 0x0399, 0}, {0x1FAF, 0, 0}, {0x1FA7, 0, 0} },
    { 0x1FA8, {0x1F68, 0x0399, 0}, {0x1FA8, 0, 0}, {0x1FA0, 0, 0} },
    { 0x1FA9, {0x1F69, 0x0399, 0}, {0x1FA9, 0, 0}, {0x1FA1, 0, 0} },
    { 0x1FAA, {0x1F6A, 0x0399, 0}, {0x1FAA, 0, 0}, {0x1FA2, 0, 0} },
    { 0x1FAB, {0x1F6B, 0x0399, 0}, {0x1FAB, 0, 0}, {0x1FA3, 0, 0} },
    { 0x1FAC, {0x1F6C, 0x0399, 0}, {0x1FAC, 0, 0}, {0x1FA4, 0, 0} },
    { 0x1FAD, {0x1F6D, 0x0399, 0}, {0x1FAD, 0, 0}, {0x1FA5, 0, 0} },
    { 0x1FAE, {0x1F6E, 0x0399, 0}, {0x1FAE, 0, 0}, {0x1FA6, 0, 0} },
    { 0x1FAF, {0x1F6F, 0x0399, 0}, {0x1FAF, 0, 0}, {0x1FA7, 0, 0} },
    { 0x1FB2, {0x1FBA, 0x0399, 0}, {0x1FBA, 0x0345, 0}, {0x1FB2, 0, 0} },
    { 0x1FB3, {0x0391, 0x0399, 0}, {0x1FBC, 0, 0}, {0x1FB3, 0, 0} },
    { 0x1FB4, {0x0386, 0x0399, 0}, {0x0386, 0x0345, 0}, {0x1FB4, 0, 0} },
    { 0x1FB6, {0x0391, 0x0342, 0}, {0x0391, 0x0342, 0}, {0x1FB6, 0, 0} },
    { 0x1FB7, {0x0391, 0x0342, 0x0399}, {0x0391, 0x0342, 0x0345}, {0x1FB7, 0, 0} },
    { 0x1FBC, {0x0391, 0x0399, 0}, {0x1FBC, 0, 0}, {0x1FB3, 0, 0} },
    { 0x1FC2, {0x1FCA, 0x0399, 0}, {0x1FCA, 0x0345, 0}, {0x1FC2, 0, 0} },
    { 0x1FC3, {0x0397, 0x0399, 0}, {0x1FCC, 0, 0}, {0x1FC3, 0, 0} },
    { 0x1FC4, {0x0389, 0x0399, 0}, {0x0389, 0x0345, 0}, {0x1FC4, 0, 0} },
    { 0x1FC6, {0x0397, 0x0342, 0}, {0x0397, 0x0342, 0}, {0x1FC6, 0, 0} },
    { 0x1FC7, {0x0397, 0x0342, 0x0399}, {0x0397, 0x0342, 0x0345}, {0x1FC7, 0, 0} },
    { 0x1FCC, {0x0397, 0x0399, 0}, {0x1FCC, 0, 0}, {0x1FC3, 0, 0} },
    { 0x1FD2, {0x0399, 0x0308, 0x0300}, {0x0399, 0x0308, 0x0300}, {0x1FD2, 0, 0} },
    { 0x1FD3, {0x0399, 0x0308, 0x0301}, {0x0399, 0x0308, 0x0301}, {0x1FD3, 0, 0} },
    { 0x1FD6, {0x0399, 0x0342, 0}, {0x0399, 0x0342, 0}, {0x1FD6, 0, 0} },
    { 0x1FD7, {0x0399, 0x0308, 0x0342}, {0x0399, 0x0308, 0x0342}, {0x1FD7, 0, 0} },
    { 0x1FE2, {0x03A5, 0x0308, 0x0300}, {0x03A5, 0x0308, 0x0300}, {0x1FE2, 0, 0} },
    { 0x1FE3, {0x03A5, 0x0308, 0x0301}, {0x03A5, 0x0308, 0x0301}, {0x1FE3, 0, 0} },
    { 0x1FE4, {0x03A1, 0x0313, 0}, {0x03A1, 0x0313, 0}, {0x1FE4, 0, 0} },
    { 0x1FE6, {0x03A5, 0x0342, 0}, {0x03A5, 0x0342, 0}, {0x1FE6, 0, 0} },
    { 0x1FE7, {0x03A5, 0x0308, 0x0342}, {0x03A5, 0x0308, 0x0342}, {0x1FE7, 0, 0} },
    { 0x1FF2, {0x1FFA, 0x0399, 0}, {0x1FFA, 0x0345, 0}, {0x1FF2, 0, 0} },
    { 0x1FF3, {0x03A9, 0x0399, 0}, {0x1FFC, 0, 0}, {0x1FF3, 0, 0} },
    { 0x1FF4, {0x038F, 0x0399, 0}, {0x038F, 0x0345, 0}, {0x1FF4, 0, 0} },
    { 0x1FF6, {0x03A9, 0x0342, 0}, {0x03A9, 0x0342, 0}, {0x1FF6, 0, 0} },
    { 0x1FF7, {0x03A9, 0x0342, 0x0399}, {0x03A9, 0x0342, 0x0345}, {0x1FF7, 0, 0} },
    { 0x1FFC, {0x03A9, 0x0399, 0}, {0x1FFC, 0, 0}, {0x1FF3, 0, 0} },
    { 0xFB00, {0x0046, 0x0046, 0}, {0x0046, 0x0066, 0}, {0xFB00, 0, 0} },
    { 0xFB01, {0x0046, 0x0049, 0}, {0x0046, 0x0069, 0}, {0xFB01, 0, 0} },
    { 0xFB02, {0x0046, 0x004C, 0}, {0x0046, 0x006C, 0}, {0xFB02, 0, 0} },
    { 0xFB03, {0x0046, 0x0046, 0x0049}, {0x0046, 0x0066, 0x0069}, {0xFB03, 0, 0} },
    { 0xFB04, {0x0046, 0x0046, 0x004C}, {0x0046, 0x0066, 0x006C}, {0xFB04, 0, 0} },
    { 0xFB05, {0x0053, 0x0054, 0}, {0x0053, 0x0074, 0}, {0xFB05, 0, 0} },
    { 0xFB06, {0x0053, 0x0054, 0}, {0x0053, 0x0074, 0}, {0xFB06, 0, 0} },
    { 0xFB13, {0x0544, 0x0546, 0}, {0x0544, 0x0576, 0}, {0xFB13, 0, 0} },
    { 0xFB14, {0x0544, 0x0535, 0}, {0x0544, 0x0565, 0}, {0xFB14, 0, 0} },
    { 0xFB15, {0x0544, 0x053B, 0}, {0x0544, 0x056B, 0}, {0xFB15, 0, 0} },
    { 0xFB16, {0x054E, 0x0546, 0}, {0x054E, 0x0576, 0}, {0xFB16, 0, 0} },
    { 0xFB17, {0x0544, 0x053D, 0}, {0x0544, 0x056D, 0}, {0xFB17, 0, 0} },
};


static const uint32_t *
tj_special(uint32_t cp, int which)
{
    size_t  lo = 0, hi = sizeof(tj_special_case) / sizeof(tj_special_case[0]);

    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (tj_special_case[mid].cp == cp) {
            return which == 0 ? tj_special_case[mid].low
                   : which == 1 ? tj_special_case[mid].up
                   : tj_special_case[mid].title;
        }
        if (tj_special_case[mid].cp < cp) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return NULL;
}


/* one code point mapped (which: 0 lower, 1 upper, 2 title) into out */
static size_t
tj_map_cp(uint32_t cp, int which, char *out)
{
    const uint32_t  *sp = tj_special(cp, which);
    size_t           o = 0;
    int              k;

    if (sp) {
        for (k = 0; k < 3 && sp[k]; k++) {
            o += tok_utf8_encode(sp[k], out + o);
        }
        return o;
    }
    cp = (uint32_t) (which == 0 ? utf8proc_tolower((utf8proc_int32_t) cp)
                     : which == 1 ? utf8proc_toupper((utf8proc_int32_t) cp)
                     : utf8proc_totitle((utf8proc_int32_t) cp));
    return tok_utf8_encode(cp, out);
}


static int
tj_cased(uint32_t cp)
{
    const utf8proc_property_t *pr = utf8proc_get_property((utf8proc_int32_t) cp);

    return pr->category == UTF8PROC_CATEGORY_LU
           || pr->category == UTF8PROC_CATEGORY_LL
           || pr->category == UTF8PROC_CATEGORY_LT;
}


/*
 * Python's case mappings (full, SpecialCasing); mode 0 lower(), 1 upper(),
 * 2 Jinja's title filter (upper() after whitespace or -([{<, lower()
 * elsewhere), 3 capitalize(), 4 str.title() (title case after a non-cased
 * character)
 */
static tj_val_t
tj_case(tj_ctx_t *c, tj_val_t s, int mode)
{
    char      *out = tj_alloc(c, (size_t) s.n * 3 + 16);
    size_t     i, k, o = 0;
    uint32_t   cp;
    int        start = 1, which;

    for (i = 0; i < s.n; i += k) {
        k = tj_utf8_next(s.u.s + i, s.n - i, &cp);
        switch (mode) {
        case 0:
            which = 0;
            break;
        case 1:
            which = 1;
            break;
        case 2:
            which = start ? 1 : 0;
            start = tj_py_space(cp) || cp == '-' || cp == '(' || cp == '{'
                    || cp == '[' || cp == '<';
            break;
        case 3:
            which = i == 0 ? 2 : 0;
            break;
        default:
            which = start ? 2 : 0;
            start = !tj_cased(cp);
        }
        if (cp < 0x80) {
            char ch = s.u.s[i];
            if (which == 0 && ch >= 'A' && ch <= 'Z') {
                ch = (char) (ch + 32);
            } else if (which != 0 && ch >= 'a' && ch <= 'z') {
                ch = (char) (ch - 32);
            }
            out[o++] = ch;
            continue;
        }
        o += tj_map_cp(cp, which, out + o);
    }
    out[o] = '\0';
    return tj_str(out, o);
}


/* Jinja's wordcount: runs of Python's \w (str.isalnum() or "_") */
static int64_t
tj_wordcount(tj_val_t s)
{
    size_t    i, k;
    uint32_t  cp;
    int64_t   n = 0;
    int       in = 0, w;

    for (i = 0; i < s.n; i += k) {
        k = tj_utf8_next(s.u.s + i, s.n - i, &cp);
        if (cp < 0x80) {
            w = (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')
                || (cp >= '0' && cp <= '9') || cp == '_';
        } else {
            const utf8proc_property_t *pr =
                utf8proc_get_property((utf8proc_int32_t) cp);
            w = (pr->category >= UTF8PROC_CATEGORY_LU
                 && pr->category <= UTF8PROC_CATEGORY_LO)
                || (pr->category >= UTF8PROC_CATEGORY_ND
                    && pr->category <= UTF8PROC_CATEGORY_NO);
        }
        if (w && !in) {
            n++;
        }
        in = w;
    }
    return n;
}


static tj_val_t
tj_replace(tj_ctx_t *c, tj_val_t s, tj_val_t old, tj_val_t new,
    int64_t count)
{
    tj_buf_t     b = { 0 };
    const char  *p = s.u.s, *e = s.u.s + s.n, *q;
    int64_t      done = 0;

    b.a = &c->arena;
    b.max = c->lim.max_output;
    if (old.n == 0) {
        /* Python inserts new between every character */
        size_t i = 0, k;
        uint32_t cp;
        while (count < 0 || done < count) {
            if (tj_buf_add(&b, new.u.s, new.n) != 0) {
                goto oom;
            }
            done++;
            if (i >= s.n) {
                break;
            }
            k = tj_utf8_next(s.u.s + i, s.n - i, &cp);
            if (tj_buf_add(&b, s.u.s + i, k) != 0) {
                goto oom;
            }
            i += k;
        }
        if (i < s.n && tj_buf_add(&b, s.u.s + i, s.n - i) != 0) {
            goto oom;
        }
        return b.p ? tj_str(b.p, b.len) : tj_str("", 0);
    }
    while ((count < 0 || done < count)
           && (q = memmem(p, (size_t) (e - p), old.u.s, old.n)) != NULL)
    {
        if (tj_buf_add(&b, p, (size_t) (q - p)) != 0
            || tj_buf_add(&b, new.u.s, new.n) != 0)
        {
            goto oom;
        }
        p = q + old.n;
        done++;
    }
    if (done == 0) {
        return s;
    }
    if (tj_buf_add(&b, p, (size_t) (e - p)) != 0) {
        goto oom;
    }
    return b.p ? tj_str(b.p, b.len) : tj_str("", 0);
oom:
    tj_fail(c, "chat template: replace(): result too large");
}


/* str.split(sep=None, maxsplit=-1) and rsplit */
static tj_val_t
tj_split(tj_ctx_t *c, tj_val_t s, tj_val_t sep, int64_t maxsplit, int right)
{
    tj_val_t     r = tj_new_list(c, 0);
    const char  *p = s.u.s, *e = s.u.s + s.n, *q;
    size_t       k;
    uint32_t     cp;
    int64_t      n = 0;

    if (sep.t == TJ_STR) {
        if (sep.n == 0) {
            tj_fail(c, "chat template: split(): empty separator");
        }
        if (!right) {
            while ((maxsplit < 0 || n < maxsplit)
                   && (q = memmem(p, (size_t) (e - p), sep.u.s, sep.n)))
            {
                tj_list_push(c, r.u.l, tj_str(p, (size_t) (q - p)));
                p = q + sep.n;
                n++;
            }
            tj_list_push(c, r.u.l, tj_str(p, (size_t) (e - p)));
            return r;
        }
        /* rsplit: collect from the right, then reverse */
        {
            const char *end = e;
            tj_val_t tmp = tj_new_list(c, 0);
            size_t i;
            while (maxsplit < 0 || n < maxsplit) {
                const char *last = NULL, *x = s.u.s;
                while ((x = memmem(x, (size_t) (end - x), sep.u.s, sep.n))) {
                    last = x;
                    x++;
                    if (x > end - sep.n) {
                        break;
                    }
                }
                if (last == NULL) {
                    break;
                }
                tj_list_push(c, tmp.u.l, tj_str(last + sep.n,
                             (size_t) (end - last - sep.n)));
                end = last;
                n++;
            }
            tj_list_push(c, tmp.u.l, tj_str(s.u.s, (size_t) (end - s.u.s)));
            for (i = tmp.u.l->n; i-- > 0; ) {
                tj_list_push(c, r.u.l, tmp.u.l->v[i]);
            }
            return r;
        }
    }
    /* whitespace runs, no empty strings */
    for ( ;; ) {
        while (p < e) {
            k = tj_utf8_next(p, (size_t) (e - p), &cp);
            if (!tj_py_space(cp)) {
                break;
            }
            p += k;
        }
        if (p >= e) {
            break;
        }
        if (maxsplit >= 0 && n >= maxsplit && !right) {
            tj_val_t rest = tj_strip(tj_str(p, (size_t) (e - p)),
                                     tj_none(), 0, 1);
            tj_list_push(c, r.u.l, rest);
            break;
        }
        q = p;
        while (q < e) {
            k = tj_utf8_next(q, (size_t) (e - q), &cp);
            if (tj_py_space(cp)) {
                break;
            }
            q += k;
        }
        tj_list_push(c, r.u.l, tj_str(p, (size_t) (q - p)));
        n++;
        p = q;
    }
    return r;
}


static int
tj_affix(tj_ctx_t *c, tj_val_t s, tj_val_t x, int end)
{
    size_t  i;

    if (x.t == TJ_LIST && x.u.l->tuple) {
        for (i = 0; i < x.u.l->n; i++) {
            if (tj_affix(c, s, x.u.l->v[i], end)) {
                return 1;
            }
        }
        return 0;
    }
    tj_need_str(c, x, end ? "endswith()" : "startswith()");
    if (x.n > s.n) {
        return 0;
    }
    return memcmp(end ? s.u.s + s.n - x.n : s.u.s, x.u.s, x.n) == 0;
}


/* ---- arguments */

static int
tj_arg(tj_args_t *a, size_t pos, const char *name, tj_val_t *out)
{
    size_t  i, n = strlen(name);

    if (pos < a->npos) {
        *out = a->pos[pos];
        return 1;
    }
    for (i = 0; i < a->nkw; i++) {
        if (a->kl[i] == n && memcmp(a->kn[i], name, n) == 0) {
            *out = a->kv[i];
            return 1;
        }
    }
    *out = tj_undef(name, n);
    return 0;
}


static void
tj_eval_args(tj_ctx_t *c, const tj_node_t *arg, tj_args_t *a)
{
    a->npos = 0;
    a->nkw = 0;
    for ( ; arg; arg = arg->next) {
        if (arg->kind == TN_KWARG) {
            if (a->nkw == TJ_MAX_ARGS) {
                tj_fail(c, "chat template: line %u: too many arguments",
                        arg->line);
            }
            a->kn[a->nkw] = arg->v.u.s;
            a->kl[a->nkw] = arg->v.n;
            a->kv[a->nkw++] = tj_eval(c, arg->a);
        } else {
            if (a->npos == TJ_MAX_ARGS) {
                tj_fail(c, "chat template: line %u: too many arguments",
                        arg->line);
            }
            a->pos[a->npos++] = tj_eval(c, arg);
        }
    }
}


/* ---- calls */

static tj_val_t
tj_capture_body(tj_ctx_t *c, const tj_node_t *body)
{
    tj_buf_t   b = { 0 }, *saved = c->out;

    b.a = &c->arena;
    b.max = c->lim.max_output;
    c->out = &b;
    tj_exec(c, body);
    c->out = saved;
    return b.p ? tj_str(b.p, b.len) : tj_str("", 0);
}


static tj_val_t
tj_call_macro(tj_ctx_t *c, tj_macro_t *m, tj_args_t *a, const tj_node_t *at)
{
    const tj_node_t  *par;
    tj_frame_t       *saved = c->frame;
    const tj_val_t   *saved_caller = c->caller;
    size_t            i, np = 0, k;
    tj_val_t          v, r;
    int               ctl = c->ctl;

    if (++c->depth > c->lim.max_depth) {
        tj_fail(c, "chat template: macro recursion deeper than %u",
                c->lim.max_depth);
    }
    for (par = m->def->kind == TN_MACRO ? m->def->a : m->def->c; par;
         par = par->next)
    {
        np++;
    }
    if (a->npos > np) {
        tj_fail(c, "chat template: line %u: macro '%.*s' takes not more than "
                "%zu argument(s)", at ? at->line : 0, (int) m->def->v.n,
                m->def->v.u.s ? m->def->v.u.s : "caller", np);
    }
    c->frame = tj_frame_new(c, m->closure);
    for (i = 0, par = m->def->kind == TN_MACRO ? m->def->a : m->def->c; par;
         par = par->next, i++)
    {
        if (i < a->npos) {
            v = a->pos[i];
        } else {
            for (k = 0; k < a->nkw; k++) {
                if (a->kl[k] == par->v.n
                    && memcmp(a->kn[k], par->v.u.s, par->v.n) == 0)
                {
                    break;
                }
            }
            if (k < a->nkw) {
                v = a->kv[k];
            } else if (par->a) {
                v = tj_eval(c, par->a);
            } else {
                v = tj_undef(par->v.u.s, par->v.n);
            }
        }
        tj_frame_set(c, c->frame, par->v.u.s, par->v.n, v);
    }
    c->caller = m->caller;
    r = tj_capture_body(c, m->def->kind == TN_MACRO ? m->def->b
                                                    : m->def->b);
    c->caller = saved_caller;
    c->frame = saved;
    c->ctl = ctl;
    c->depth--;
    return r;
}


static tj_val_t
tj_range(tj_ctx_t *c, tj_args_t *a)
{
    int64_t   start = 0, stop, step = 1, i, n;
    tj_val_t  r;

    if (a->npos == 1) {
        stop = tj_as_int(c, a->pos[0], "range()");
    } else if (a->npos >= 2) {
        start = tj_as_int(c, a->pos[0], "range()");
        stop = tj_as_int(c, a->pos[1], "range()");
        if (a->npos == 3) {
            step = tj_as_int(c, a->pos[2], "range()");
        }
    } else {
        tj_fail(c, "chat template: range() expects 1 to 3 arguments");
    }
    if (step == 0) {
        tj_fail(c, "chat template: range() arg 3 must not be zero");
    }
    n = step > 0 ? (stop > start ? (stop - start + step - 1) / step : 0)
                 : (start > stop ? (start - stop - step - 1) / -step : 0);
    if ((unsigned long) n > c->lim.max_steps) {
        tj_fail(c, "chat template: range() of %lld items is too large",
                (long long) n);
    }
    r = tj_new_list(c, (size_t) n);
    for (i = 0; i < n; i++) {
        r.u.l->v[i] = tj_int(start + i * step);
    }
    r.u.l->n = (size_t) n;
    return r;
}


static tj_val_t
tj_call_method(tj_ctx_t *c, int id, tj_val_t self, tj_args_t *a)
{
    tj_val_t   x, y, z, r;
    size_t     i, k;
    const char *p;
    uint32_t   cp;
    int        ok;

    switch (id) {
    case M_STRIP:
    case M_LSTRIP:
    case M_RSTRIP:
        tj_arg(a, 0, "chars", &x);
        if (x.t != TJ_STR && x.t != TJ_NONE && x.t != TJ_UNDEF) {
            tj_fail(c, "chat template: strip arg must be None or str");
        }
        return tj_strip(self, x, id != M_RSTRIP, id != M_LSTRIP);
    case M_SPLIT:
    case M_RSPLIT:
        tj_arg(a, 0, "sep", &x);
        tj_arg(a, 1, "maxsplit", &y);
        if (x.t != TJ_STR && x.t != TJ_NONE && x.t != TJ_UNDEF) {
            tj_fail(c, "chat template: split(): must be str or None");
        }
        return tj_split(c, self, x, y.t == TJ_UNDEF ? -1
                        : tj_as_int(c, y, "split()"), id == M_RSPLIT);
    case M_STARTSWITH:
    case M_ENDSWITH:
        if (!tj_arg(a, 0, "prefix", &x)) {
            tj_fail(c, "chat template: startswith()/endswith() takes an "
                    "argument");
        }
        return tj_bool(tj_affix(c, self, x, id == M_ENDSWITH));
    case M_UPPER:
        return tj_case(c, self, 1);
    case M_LOWER:
        return tj_case(c, self, 0);
    case M_TITLE:
        return tj_case(c, self, 4);
    case M_CAPITALIZE:
        return tj_case(c, self, 3);
    case M_REPLACE:
        tj_arg(a, 0, "old", &x);
        tj_arg(a, 1, "new", &y);
        tj_arg(a, 2, "count", &z);
        tj_need_str(c, x, "replace()");
        tj_need_str(c, y, "replace()");
        return tj_replace(c, self, x, y, z.t == TJ_UNDEF ? -1
                          : tj_as_int(c, z, "replace()"));
    case M_FIND:
    case M_RFIND:
    case M_INDEX:
    case M_COUNT:
        tj_arg(a, 0, "sub", &x);
        tj_need_str(c, x, "find()");
        if (id == M_COUNT) {
            int64_t n = 0;
            if (x.n == 0) {
                return tj_int((int64_t) tj_utf8_count(self.u.s, self.n) + 1);
            }
            for (p = self.u.s; (p = memmem(p, (size_t) (self.u.s + self.n - p),
                                            x.u.s, x.n)); p += x.n)
            {
                n++;
            }
            return tj_int(n);
        }
        if (id == M_RFIND) {
            const char *last = NULL;
            for (p = self.u.s; (size_t) (self.u.s + self.n - p) >= x.n
                 && (p = memmem(p, (size_t) (self.u.s + self.n - p), x.u.s,
                                x.n)); p++)
            {
                last = p;
            }
            p = x.n == 0 ? self.u.s + self.n : last;
        } else {
            p = memmem(self.u.s, self.n, x.u.s, x.n);
            if (x.n == 0) {
                p = self.u.s;
            }
        }
        if (p == NULL) {
            if (id == M_INDEX) {
                tj_fail(c, "chat template: substring not found");
            }
            return tj_int(-1);
        }
        return tj_int((int64_t) tj_utf8_count(self.u.s,
                                              (size_t) (p - self.u.s)));
    case M_JOIN: {
        tj_list_t *l;
        tj_buf_t b = { 0 };
        tj_arg(a, 0, "iterable", &x);
        l = tj_iter_list(c, x, "join()");
        b.a = &c->arena;
        b.max = c->lim.max_output;
        for (i = 0; i < l->n; i++) {
            tj_need_str(c, l->v[i], "join()");
            if ((i && tj_buf_add(&b, self.u.s, self.n) != 0)
                || tj_buf_add(&b, l->v[i].u.s, l->v[i].n) != 0)
            {
                tj_fail(c, "chat template: join(): result too large");
            }
        }
        return b.p ? tj_str(b.p, b.len) : tj_str("", 0);
    }
    case M_SPLITLINES:
        r = tj_new_list(c, 0);
        for (p = self.u.s, i = 0; i < self.n; ) {
            size_t j = i;
            while (j < self.n && self.u.s[j] != '\n' && self.u.s[j] != '\r') {
                j++;
            }
            tj_list_push(c, r.u.l, tj_str(self.u.s + i, j - i));
            if (j < self.n && self.u.s[j] == '\r' && j + 1 < self.n
                && self.u.s[j + 1] == '\n')
            {
                j++;
            }
            i = j + 1;
        }
        (void) p;
        return r;
    case M_ISDIGIT:
    case M_ISALPHA:
    case M_ISSPACE:
    case M_ISALNUM:
    case M_ISUPPER:
    case M_ISLOWER: {
        int cased = 0;
        if (self.n == 0) {
            return tj_bool(0);
        }
        for (i = 0; i < self.n; i += k) {
            const utf8proc_property_t *pr;
            k = tj_utf8_next(self.u.s + i, self.n - i, &cp);
            pr = utf8proc_get_property((utf8proc_int32_t) cp);
            int letter = pr->category >= UTF8PROC_CATEGORY_LU
                         && pr->category <= UTF8PROC_CATEGORY_LO;
            int digit = pr->category == UTF8PROC_CATEGORY_ND;
            switch (id) {
            case M_ISDIGIT: ok = digit; break;
            case M_ISALPHA: ok = letter; break;
            case M_ISSPACE: ok = tj_py_space(cp); break;
            case M_ISALNUM: ok = letter || digit; break;
            case M_ISUPPER:
                ok = pr->category != UTF8PROC_CATEGORY_LL;
                cased |= pr->category == UTF8PROC_CATEGORY_LU;
                break;
            default:
                ok = pr->category != UTF8PROC_CATEGORY_LU;
                cased |= pr->category == UTF8PROC_CATEGORY_LL;
            }
            if (!ok) {
                return tj_bool(0);
            }
        }
        return tj_bool(id == M_ISUPPER || id == M_ISLOWER ? cased : 1);
    }
    case M_GET:
        if (!tj_arg(a, 0, "key", &x)) {
            tj_fail(c, "chat template: get() takes a key");
        }
        if (!tj_arg(a, 1, "default", &y)) {
            y = tj_none();
        }
        if (x.t != TJ_STR) {
            return y;
        }
        {
            tj_val_t *v = tj_dict_get(self.u.d, x.u.s, x.n);
            return v ? *v : y;
        }
    case M_KEYS:
        return (tj_val_t) { .t = TJ_LIST, .u.l = tj_iter_list(c, self,
                                                              "keys()") };
    case M_VALUES:
        r = tj_new_list(c, self.u.d->n);
        for (i = 0; i < self.u.d->n; i++) {
            r.u.l->v[i] = self.u.d->p[i].v;
        }
        r.u.l->n = self.u.d->n;
        return r;
    case M_ITEMS:
        r = tj_new_list(c, self.u.d->n);
        for (i = 0; i < self.u.d->n; i++) {
            tj_val_t t = tj_new_list(c, 2);
            t.u.l->tuple = 1;
            t.u.l->v[0] = tj_str(self.u.d->p[i].k, self.u.d->p[i].kn);
            t.u.l->v[1] = self.u.d->p[i].v;
            t.u.l->n = 2;
            r.u.l->v[i] = t;
        }
        r.u.l->n = self.u.d->n;
        return r;
    case M_LINDEX:
    case M_LCOUNT: {
        int64_t n = 0;
        tj_arg(a, 0, "value", &x);
        for (i = 0; i < self.u.l->n; i++) {
            if (tj_equal(self.u.l->v[i], x)) {
                if (id == M_LINDEX) {
                    return tj_int((int64_t) i);
                }
                n++;
            }
        }
        if (id == M_LINDEX) {
            tj_fail(c, "chat template: list.index(x): x not in list");
        }
        return tj_int(n);
    }
    }
    tj_fail(c, "chat template: unknown method");
}


static tj_val_t
tj_call_value(tj_ctx_t *c, tj_val_t f, tj_args_t *a, const tj_node_t *at)
{
    tj_val_t   x, r;
    size_t     i;
    char       tbuf[512];
    time_t     now;
    struct tm  tm;

    if (f.t == TJ_MACRO) {
        return tj_call_macro(c, f.u.p, a, at);
    }
    if (f.t != TJ_FUNC) {
        if (f.t == TJ_UNDEF) {
            tj_fail(c, "chat template: line %u: '%.*s' is undefined",
                    at ? at->line : 0, (int) f.n, f.u.s ? f.u.s : "");
        }
        tj_fail(c, "chat template: line %u: '%s' object is not callable",
                at ? at->line : 0, tj_type_name(f));
    }
    switch (f.aux) {
    case F_RANGE:
        return tj_range(c, a);
    case F_NAMESPACE:
    case F_DICT:
        r = tj_new_dict(c, 0);
        r.u.d->ns = f.aux == F_NAMESPACE;
        if (a->npos == 1 && a->pos[0].t == TJ_DICT) {
            for (i = 0; i < a->pos[0].u.d->n; i++) {
                tj_dict_set(c, r.u.d, a->pos[0].u.d->p[i].k,
                            a->pos[0].u.d->p[i].kn, a->pos[0].u.d->p[i].v);
            }
        } else if (a->npos) {
            tj_fail(c, "chat template: %s() takes keyword arguments",
                    f.aux == F_DICT ? "dict" : "namespace");
        }
        for (i = 0; i < a->nkw; i++) {
            tj_dict_set(c, r.u.d, a->kn[i], a->kl[i], a->kv[i]);
        }
        return r;
    case F_RAISE:
        tj_arg(a, 0, "message", &x);
        x = tj_to_str(c, x);
        /* transformers: TemplateError(message); vLLM answers 400 with it */
        tj_fail(c, "%.*s", (int) x.n, x.u.s);
    case F_STRFTIME:
        tj_arg(a, 0, "format", &x);
        tj_need_str(c, x, "strftime_now()");
        {
            char fmt[256];
            size_t n = x.n < sizeof(fmt) - 1 ? x.n : sizeof(fmt) - 1;
            tj_mcpy(fmt, x.u.s, n);
            fmt[n] = '\0';
            now = time(NULL);
            localtime_r(&now, &tm);
            n = strftime(tbuf, sizeof(tbuf), fmt, &tm);
            return tj_str_copy(c, tbuf, n);
        }
    case F_CYCLE: {
        const tj_val_t *self = f.u.p;
        tj_loop_t *l = self->u.p;
        if (a->npos == 0) {
            tj_fail(c, "chat template: loop.cycle() needs an argument");
        }
        return a->pos[l->i % a->npos];
    }
    default:
        return tj_call_method(c, (int) f.aux, *(const tj_val_t *) f.u.p, a);
    }
}


/* ---- arithmetic */

/*
 * a + b (and a ~ b) on strings.  A template that accumulates, as
 * DeepSeek-V3's joins every system message into one namespace string
 * (ns.system_prompt = ns.system_prompt + '\n\n' + content), copied the
 * whole string at every step: quadratic allocation for a linear prompt
 * (1000 system messages of 1 KB: about 500 MB for a 1 MB prompt), which
 * the arena's bound refused while Jinja2 (vLLM) renders it.  So a result
 * of TJ_GROW_MIN bytes or more gets room to grow (half its length again,
 * within max_output) and is remembered; a later a + b whose a is exactly
 * the longest value made in that buffer writes b into the room, in place.
 * Every value that refers to the buffer is a prefix of it (or a slice of
 * a prefix), and no byte of a prefix changes: strings stay immutable, and
 * none relies on a NUL after its bytes.  A template that copies a large
 * string again and again (not the one it grows), or doubles one, still
 * meets max_memory and max_output.
 */
static tj_val_t
tj_str_cat(tj_ctx_t *c, tj_val_t a, tj_val_t b, unsigned line)
{
    tj_grow_t  *g = NULL;
    size_t      n = (size_t) a.n + b.n, cap;
    unsigned    i;
    char       *p;

    if (n > c->lim.max_output) {
        tj_fail(c, "chat template: line %u: string too large", line);
    }
    for (i = 0; i < TJ_NGROW; i++) {
        if (c->grow[i].p != NULL && c->grow[i].p == a.u.s) {
            g = &c->grow[i];
            if (g->n == a.n && n < g->cap) {
                /* b ends at or below a's end: never in the room */
                tj_mcpy(g->p + a.n, b.u.s, b.n);
                g->p[n] = '\0';
                g->n = n;
                return tj_str(g->p, n);
            }
            break;
        }
    }
    cap = n + 1;
    if (n >= TJ_GROW_MIN) {
        cap += n / 2;
        if (cap > c->lim.max_output + 1) {
            cap = c->lim.max_output + 1;
        }
    }
    p = tj_alloc(c, cap);
    tj_mcpy(p, a.u.s, a.n);
    tj_mcpy(p + a.n, b.u.s, b.n);
    p[n] = '\0';
    if (n >= TJ_GROW_MIN && cap > n + 1) {
        if (g == NULL) {               /* a's own slot, else the oldest */
            g = &c->grow[c->grow_next++ % TJ_NGROW];
        }
        g->p = p;
        g->n = n;
        g->cap = cap;
    }
    return tj_str(p, n);
}


static tj_val_t
tj_binary(tj_ctx_t *c, int op, tj_val_t a, tj_val_t b, unsigned line)
{
    double   x, y, r;
    int64_t  i, j, q;
    size_t   k;

    if (op == TO_ADD && a.t == TJ_STR && b.t == TJ_STR) {
        return tj_str_cat(c, a, b, line);
    }
    if (op == TO_ADD && a.t == TJ_LIST && b.t == TJ_LIST) {
        tj_val_t l = tj_new_list(c, a.u.l->n + b.u.l->n);
        tj_mcpy(l.u.l->v, a.u.l->v, a.u.l->n * sizeof(tj_val_t));
        if (b.u.l->n) {
            /* two empty lists: v is NULL, and NULL + 0 is undefined */
            tj_mcpy(l.u.l->v + a.u.l->n, b.u.l->v,
                    b.u.l->n * sizeof(tj_val_t));
        }
        l.u.l->n = a.u.l->n + b.u.l->n;
        l.u.l->tuple = a.u.l->tuple && b.u.l->tuple;
        return l;
    }
    if (op == TO_MUL && ((a.t == TJ_STR && (b.t == TJ_INT || b.t == TJ_BOOL))
                         || (b.t == TJ_STR && (a.t == TJ_INT
                                               || a.t == TJ_BOOL))))
    {
        tj_val_t s = a.t == TJ_STR ? a : b;
        int64_t n = a.t == TJ_STR ? b.u.i : a.u.i;
        char *p;
        if (n <= 0) {
            return tj_str("", 0);
        }
        if ((uint64_t) n * s.n > c->lim.max_output) {
            tj_fail(c, "chat template: line %u: string repetition too large",
                    line);
        }
        p = tj_alloc(c, (size_t) n * s.n + 1);
        for (k = 0; k < (size_t) n; k++) {
            tj_mcpy(p + k * s.n, s.u.s, s.n);
        }
        p[(size_t) n * s.n] = '\0';
        return tj_str(p, (size_t) n * s.n);
    }
    if (!tj_isnum(a) || !tj_isnum(b)) {
        static const char *const names[] = { "", "+", "-", "*", "/", "//",
                                             "%", "**" };
        tj_fail(c, "chat template: line %u: unsupported operand type(s) for "
                "%s: '%s' and '%s'", line, names[op], tj_type_name(a),
                tj_type_name(b));
    }
    if (a.t != TJ_FLOAT && b.t != TJ_FLOAT && op != TO_DIV) {
        i = a.u.i;
        j = b.u.i;
        switch (op) {
        case TO_ADD: return tj_int((int64_t) ((uint64_t) i + (uint64_t) j));
        case TO_SUB: return tj_int((int64_t) ((uint64_t) i - (uint64_t) j));
        case TO_MUL: return tj_int((int64_t) ((uint64_t) i * (uint64_t) j));
        case TO_FDIV:
        case TO_MOD:
            if (j == 0) {
                tj_fail(c, "chat template: line %u: integer division or "
                        "modulo by zero", line);
            }
            if (i == INT64_MIN && j == -1) {
                return tj_int(op == TO_MOD ? 0 : INT64_MIN);
            }
            q = i / j;
            if ((i % j != 0) && ((i < 0) != (j < 0))) {
                q--;
            }
            return tj_int(op == TO_FDIV ? q : i - q * j);
        case TO_POW:
            if (j >= 0) {
                int64_t res = 1;
                for (q = 0; q < j && q < 64; q++) {
                    res = (int64_t) ((uint64_t) res * (uint64_t) i);
                }
                return tj_int(res);
            }
            return tj_float(pow((double) i, (double) j));
        }
    }
    x = tj_as_num(a);
    y = tj_as_num(b);
    switch (op) {
    case TO_ADD: r = x + y; break;
    case TO_SUB: r = x - y; break;
    case TO_MUL: r = x * y; break;
    case TO_DIV:
        if (y == 0) {
            tj_fail(c, "chat template: line %u: division by zero", line);
        }
        r = x / y;
        break;
    case TO_FDIV:
        if (y == 0) {
            tj_fail(c, "chat template: line %u: float divmod()", line);
        }
        r = floor(x / y);
        break;
    case TO_MOD:
        if (y == 0) {
            tj_fail(c, "chat template: line %u: float modulo", line);
        }
        r = fmod(x, y);
        if (r != 0 && ((r < 0) != (y < 0))) {
            r += y;
        }
        break;
    default:
        r = pow(x, y);
    }
    return tj_float(r);
}


/* ---- expressions */

/* every kind; the ones needing argument lists or more (counted already) */
static __attribute__((noinline)) tj_val_t
tj_eval_more(tj_ctx_t *c, const tj_node_t *nd)
{
    tj_val_t          a, b, r;
    tj_args_t         args;
    const tj_node_t  *x;
    size_t            n;

    switch (nd->kind) {
    case TN_LIT:
        return nd->v;
    case TN_NAME:
        return tj_lookup(c, nd);
    case TN_LIST:
    case TN_TUPLE:
        for (n = 0, x = nd->a; x; x = x->next) {
            n++;
        }
        r = tj_new_list(c, n);
        r.u.l->tuple = nd->kind == TN_TUPLE;
        for (x = nd->a; x; x = x->next) {
            r.u.l->v[r.u.l->n++] = tj_eval(c, x);
        }
        return r;
    case TN_DICT:
        r = tj_new_dict(c, 0);
        for (x = nd->a; x; x = x->next) {
            a = tj_eval(c, x->a);
            if (a.t != TJ_STR) {
                tj_fail(c, "chat template: line %u: dict keys must be "
                        "strings here", nd->line);
            }
            tj_dict_set(c, r.u.d, a.u.s, a.n, tj_eval(c, x->b));
        }
        return r;
    case TN_ATTR:
        a = tj_eval(c, nd->a);
        if (a.t == TJ_DICT && nd->fid == 0) {
            /* message.role: the keys the request preparation interned */
            size_t  i;

            for (i = 0; i < a.u.d->n; i++) {
                if (a.u.d->p[i].k == nd->v.u.s) {
                    return a.u.d->p[i].v;
                }
            }
        }
        return tj_getattr_any(c, a, nd->v.u.s, nd->v.n, nd->line,
                              nd->fid != 0);
    case TN_ITEM:
        a = tj_eval(c, nd->a);
        return tj_getitem(c, a, tj_eval(c, nd->b), nd->line, 0);
    case TN_SLICE:
        a = tj_eval(c, nd->a);
        return tj_slice(c, a, nd->b ? tj_eval(c, nd->b) : tj_none(),
                        nd->c ? tj_eval(c, nd->c) : tj_none(),
                        nd->d ? tj_eval(c, nd->d) : tj_none(), nd->line);
    case TN_CALL:
        a = tj_eval(c, nd->a);
        tj_eval_args(c, nd->b, &args);
        return tj_call_value(c, a, &args, nd);
    case TN_FILTER:
        a = tj_eval(c, nd->a);
        if (nd->b == NULL && (nd->fid == FL_LENGTH || nd->fid == FL_COUNT)) {
            return tj_int((int64_t) tj_length(c, a));    /* messages|length */
        }
        tj_eval_args(c, nd->b, &args);
        return tj_apply_filter(c, nd->fid, a, &args, nd->v.u.s, nd->v.n);
    case TN_TEST:
        a = tj_eval(c, nd->a);
        if (nd->b == NULL) {
            /* the argument-less ones of chat templates */
            switch (nd->fid) {
            case TS_DEFINED:
                return tj_bool((a.t != TJ_UNDEF) != (int) nd->op);
            case TS_UNDEFINED:
                return tj_bool((a.t == TJ_UNDEF) != (int) nd->op);
            case TS_NONE:
                return tj_bool((a.t == TJ_NONE) != (int) nd->op);
            case TS_STRING:
                return tj_bool((a.t == TJ_STR) != (int) nd->op);
            }
        }
        args.npos = 0;
        args.nkw = 0;
        if (nd->b && nd->b->kind == TN_KWARG) {
            tj_eval_args(c, nd->b, &args);
        } else if (nd->b) {
            /* "is x(1, 2)" parsed as args list, "is x 1" as one value */
            tj_eval_args(c, nd->b, &args);
        }
        return tj_bool(tj_apply_test(c, nd->fid, a, &args, nd->v.u.s,
                                     nd->v.n) != (int) nd->op);
    case TN_NEG:
    case TN_POS:
        a = tj_eval(c, nd->a);
        if (!tj_isnum(a)) {
            tj_fail(c, "chat template: line %u: bad operand type for unary "
                    "%c: '%s'", nd->line, nd->kind == TN_NEG ? '-' : '+',
                    tj_type_name(a));
        }
        if (nd->kind == TN_POS) {
            return a.t == TJ_BOOL ? tj_int(a.u.i) : a;
        }
        return a.t == TJ_FLOAT ? tj_float(-a.u.f)
                               : tj_int((int64_t) (0 - (uint64_t) a.u.i));
    case TN_NOT:
        return tj_bool(!tj_truthy(tj_eval(c, nd->a)));
    case TN_AND:
        a = tj_eval(c, nd->a);
        return tj_truthy(a) ? tj_eval(c, nd->b) : a;
    case TN_OR:
        a = tj_eval(c, nd->a);
        return tj_truthy(a) ? a : tj_eval(c, nd->b);
    case TN_BIN:
        a = tj_eval(c, nd->a);
        b = tj_eval(c, nd->b);
        return tj_binary(c, nd->op, a, b, nd->line);
    case TN_CMP:
        a = tj_eval(c, nd->a);
        b = tj_eval(c, nd->b);
        switch (nd->op) {
        case TO_EQ: return tj_bool(tj_equal(a, b));
        case TO_NE: return tj_bool(!tj_equal(a, b));
        case TO_LT: return tj_bool(tj_compare(c, a, b, "<") < 0);
        case TO_LE: return tj_bool(tj_compare(c, a, b, "<=") <= 0);
        case TO_GT: return tj_bool(tj_compare(c, a, b, ">") > 0);
        case TO_GE: return tj_bool(tj_compare(c, a, b, ">=") >= 0);
        case TO_IN: return tj_bool(tj_contains(c, b, a));
        default: return tj_bool(!tj_contains(c, b, a));
        }
    case TN_CONCAT: {
        tj_val_t sa, sb;
        sa = tj_to_str(c, tj_eval(c, nd->a));
        sb = tj_to_str(c, tj_eval(c, nd->b));
        return tj_str_cat(c, sa, sb, nd->line);
    }
    case TN_COND:
        if (tj_truthy(tj_eval(c, nd->a))) {
            return tj_eval(c, nd->b);
        }
        return nd->c ? tj_eval(c, nd->c) : tj_undef("(else)", 6);
    default:
        tj_fail(c, "chat template: line %u: not an expression", nd->line);
    }
}


/* the frequent kinds, in a small frame */
static tj_val_t
tj_eval(tj_ctx_t *c, const tj_node_t *nd)
{
    tj_val_t  a, b;

    tj_step(c);
    switch (nd->kind) {
    case TN_LIT:
        return nd->v;
    case TN_NAME:
        return tj_lookup(c, nd);
    case TN_ATTR:
        a = tj_eval(c, nd->a);
        if (a.t == TJ_DICT && nd->fid == 0) {
            /* message.role: the keys the request preparation interned */
            size_t  i;

            for (i = 0; i < a.u.d->n; i++) {
                if (a.u.d->p[i].k == nd->v.u.s) {
                    return a.u.d->p[i].v;
                }
            }
        } else if (a.t == TJ_LOOP) {
            return tj_loop_get(c, a, nd->op, nd->v.u.s, nd->v.n);
        }
        return tj_getattr_any(c, a, nd->v.u.s, nd->v.n, nd->line,
                              nd->fid != 0);
    case TN_NOT:
        return tj_bool(!tj_truthy(tj_eval(c, nd->a)));
    case TN_AND:
        a = tj_eval(c, nd->a);
        return tj_truthy(a) ? tj_eval(c, nd->b) : a;
    case TN_OR:
        a = tj_eval(c, nd->a);
        return tj_truthy(a) ? a : tj_eval(c, nd->b);
    case TN_CMP:
        if (nd->op != TO_EQ && nd->op != TO_NE) {
            break;
        }
        a = tj_eval(c, nd->a);
        b = tj_eval(c, nd->b);
        if (a.t == TJ_STR && b.t == TJ_STR) {
            return tj_bool((a.n == b.n && (a.n == 0
                                           || memcmp(a.u.s, b.u.s, a.n) == 0))
                           == (nd->op == TO_EQ));
        }
        return tj_bool(tj_equal(a, b) == (nd->op == TO_EQ));
    case TN_COND:
        if (tj_truthy(tj_eval(c, nd->a))) {
            return tj_eval(c, nd->b);
        }
        return nd->c ? tj_eval(c, nd->c) : tj_undef("(else)", 6);
    case TN_BIN:
        a = tj_eval(c, nd->a);
        b = tj_eval(c, nd->b);
        if (a.t == TJ_INT && b.t == TJ_INT) {
            /* (messages|length - 1) - loop.index0 */
            int64_t  r;

            if (nd->op == TO_ADD
                && !__builtin_add_overflow(a.u.i, b.u.i, &r))
            {
                return tj_int(r);
            }
            if (nd->op == TO_SUB
                && !__builtin_sub_overflow(a.u.i, b.u.i, &r))
            {
                return tj_int(r);
            }
        }
        return tj_binary(c, nd->op, a, b, nd->line);
    }
    return tj_eval_more(c, nd);
}


/* ---- filters */


static const char *const tj_filter_names[FL_N] = {
    "abs", "capitalize", "count", "default", "d", "dictsort", "e", "escape",
    "first", "float", "indent", "int", "items", "join", "last", "length",
    "list", "lower", "map", "max", "min", "reject", "rejectattr", "replace",
    "reverse", "round", "safe", "select", "selectattr", "sort", "string",
    "sum", "title", "tojson", "trim", "unique", "upper", "wordcount",
    "center", "format", "batch"
};


static const char *const tj_test_names[TS_N] = {
    "boolean", "callable", "defined", "divisibleby", "eq", "equalto", "==",
    "escaped", "even", "false", "float", "ge", ">=", "gt", ">", "greaterthan",
    "in", "integer", "iterable", "le", "<=", "lower", "lt", "<", "lessthan",
    "mapping", "ne", "!=", "none", "number", "odd", "sameas", "sequence",
    "string", "true", "undefined", "upper"
};


int
tj_filter_id(const char *name, size_t n)
{
    int  i;

    for (i = 0; i < FL_N; i++) {
        if (strlen(tj_filter_names[i]) == n
            && memcmp(tj_filter_names[i], name, n) == 0)
        {
            return i;
        }
    }
    return -1;
}


int
tj_test_id(const char *name, size_t n)
{
    int  i;

    for (i = 0; i < TS_N; i++) {
        if (strlen(tj_test_names[i]) == n
            && memcmp(tj_test_names[i], name, n) == 0)
        {
            return i;
        }
    }
    return -1;
}


/* attribute paths of map/selectattr/sort: "a.b.0" */
static tj_val_t
tj_attr_path(tj_ctx_t *c, tj_val_t v, tj_val_t path)
{
    const char  *p, *e, *d;
    char        *end;
    long long    idx;

    if (path.t == TJ_INT) {
        return tj_getitem(c, v, path, 0, 0);
    }
    tj_need_str(c, path, "attribute");
    p = path.u.s;
    e = path.u.s + path.n;
    while (p <= e) {
        d = memchr(p, '.', (size_t) (e - p));
        if (d == NULL) {
            d = e;
        }
        idx = strtoll(p, &end, 10);
        if (end == d && d > p) {
            v = tj_getitem(c, v, tj_int(idx), 0, 0);
        } else {
            v = tj_getitem(c, v, tj_str(p, (size_t) (d - p)), 0, 0);
        }
        if (d == e) {
            break;
        }
        p = d + 1;
        if (v.t == TJ_UNDEF) {
            break;
        }
    }
    return v;
}


static int
tj_sort_cmp(tj_ctx_t *c, tj_val_t a, tj_val_t b, int cs)
{
    if (!cs && a.t == TJ_STR && b.t == TJ_STR) {
        a = tj_case(c, a, 0);
        b = tj_case(c, b, 0);
    }
    return tj_compare(c, a, b, "<");
}


/* stable merge sort of keys k[] with values v[] */
static void
tj_msort(tj_ctx_t *c, tj_val_t *k, tj_val_t *v, size_t n, int cs, int rev,
    tj_val_t *tk, tj_val_t *tv)
{
    size_t  m, i, j, o;
    int     r;

    if (n < 2) {
        return;
    }
    m = n / 2;
    tj_msort(c, k, v, m, cs, rev, tk, tv);
    tj_msort(c, k + m, v + m, n - m, cs, rev, tk, tv);
    for (i = 0, j = m, o = 0; i < m || j < n; o++) {
        if (i < m && j < n) {
            r = tj_sort_cmp(c, k[j], k[i], cs);
            if (rev) {
                r = -r;
            }
        } else {
            r = j < n ? -1 : 1;
        }
        if (r < 0) {
            tk[o] = k[j];
            tv[o] = v[j];
            j++;
        } else {
            tk[o] = k[i];
            tv[o] = v[i];
            i++;
        }
    }
    tj_mcpy(k, tk, n * sizeof(tj_val_t));
    tj_mcpy(v, tv, n * sizeof(tj_val_t));
}


static tj_val_t
tj_html_escape(tj_ctx_t *c, tj_val_t s)
{
    tj_buf_t  b = { 0 };
    size_t    i;

    b.a = &c->arena;
    for (i = 0; i < s.n; i++) {
        const char *r = NULL;
        switch (s.u.s[i]) {
        case '&': r = "&amp;"; break;
        case '<': r = "&lt;"; break;
        case '>': r = "&gt;"; break;
        case '"': r = "&#34;"; break;
        case '\'': r = "&#39;"; break;
        }
        if (tj_buf_add(&b, r ? r : s.u.s + i, r ? strlen(r) : 1) != 0) {
            tj_fail(c, "chat template: out of memory");
        }
    }
    return b.p ? tj_str(b.p, b.len) : tj_str("", 0);
}


static tj_val_t
tj_apply_filter(tj_ctx_t *c, int fid, tj_val_t v, tj_args_t *a,
    const char *name, size_t nlen)
{
    tj_val_t    x, y, z, r;
    tj_list_t  *l;
    size_t      i;
    tj_buf_t    b = { 0 };

    b.a = &c->arena;
    b.max = c->lim.max_output;

    switch (fid) {
    case FL_ABS:
        if (v.t == TJ_FLOAT) {
            return tj_float(fabs(v.u.f));
        }
        return tj_int(tj_as_int(c, v, "abs") < 0 ? -v.u.i : v.u.i);
    case FL_CAPITALIZE:
        return tj_case(c, tj_to_str(c, v), 3);
    case FL_COUNT:
    case FL_LENGTH:
        return tj_int((int64_t) tj_length(c, v));
    case FL_DEFAULT:
    case FL_D:
        tj_arg(a, 0, "default_value", &x);
        if (x.t == TJ_UNDEF) {
            x = tj_str("", 0);
        }
        tj_arg(a, 1, "boolean", &y);
        if (v.t == TJ_UNDEF || (tj_truthy(y) && !tj_truthy(v))) {
            return x;
        }
        return v;
    case FL_DICTSORT:
        if (v.t != TJ_DICT) {
            tj_fail(c, "chat template: dictsort: expected a dict");
        }
        {
            size_t n = v.u.d->n;
            tj_val_t *k = tj_alloc(c, (n + 1) * sizeof(tj_val_t) * 4);
            tj_val_t *vals = k + n + 1;
            tj_arg(a, 0, "case_sensitive", &x);
            tj_arg(a, 1, "by", &y);
            tj_arg(a, 2, "reverse", &z);
            r = tj_apply_filter(c, FL_ITEMS, v, a, "items", 5);
            for (i = 0; i < n; i++) {
                vals[i] = r.u.l->v[i];
                k[i] = r.u.l->v[i].u.l->v[y.t == TJ_STR && y.n == 5 ? 1 : 0];
            }
            tj_msort(c, k, vals, n, tj_truthy(x), tj_truthy(z),
                     vals + n + 1, vals + 2 * n + 1);
            for (i = 0; i < n; i++) {
                r.u.l->v[i] = vals[i];
            }
            return r;
        }
    case FL_E:
    case FL_ESCAPE:
        return tj_html_escape(c, tj_to_str(c, v));
    case FL_FIRST:
        l = tj_iter_list(c, v, "first");
        return l->n ? l->v[0] : tj_undef("first", 5);
    case FL_LAST:
        l = tj_iter_list(c, v, "last");
        return l->n ? l->v[l->n - 1] : tj_undef("last", 4);
    case FL_FLOAT:
    case FL_INT:
        tj_arg(a, 0, "default", &x);
        if (x.t == TJ_UNDEF) {
            x = fid == FL_INT ? tj_int(0) : tj_float(0.0);
        }
        if (v.t == TJ_INT || v.t == TJ_BOOL) {
            return fid == FL_INT ? tj_int(v.u.i) : tj_float((double) v.u.i);
        }
        if (v.t == TJ_FLOAT) {
            if (fid == FL_FLOAT) {
                return v;
            }
            if (isnan(v.u.f) || isinf(v.u.f)) {
                return x;
            }
            return tj_int((int64_t) v.u.f);
        }
        if (v.t == TJ_STR) {
            char tmp[128], *end;
            size_t n = v.n < sizeof(tmp) - 1 ? v.n : sizeof(tmp) - 1;
            tj_val_t sv = tj_strip(tj_str(v.u.s, n), tj_none(), 1, 1);
            tj_mcpy(tmp, sv.u.s, sv.n);
            tmp[sv.n] = '\0';
            if (fid == FL_INT) {
                long long ll = strtoll(tmp, &end, 10);
                if (*end == '\0' && end != tmp) {
                    return tj_int(ll);
                }
            }
            double d = strtod(tmp, &end);
            if (*end == '\0' && end != tmp) {
                return fid == FL_INT ? tj_int((int64_t) d) : tj_float(d);
            }
        }
        return x;
    case FL_INDENT: {
        int64_t width = 4;
        tj_val_t s = tj_to_str(c, v), pad;
        const char *p, *e, *nl;
        int first, blank;
        tj_arg(a, 0, "width", &x);
        tj_arg(a, 1, "first", &y);
        tj_arg(a, 2, "blank", &z);
        if (x.t == TJ_STR) {
            pad = x;
        } else {
            if (x.t != TJ_UNDEF) {
                width = tj_as_int(c, x, "indent");
            }
            if (width < 0 || width > 1024) {
                width = 0;
            }
            char *sp = tj_alloc(c, (size_t) width + 1);
            memset(sp, ' ', (size_t) width);
            pad = tj_str(sp, (size_t) width);
        }
        first = tj_truthy(y);
        blank = tj_truthy(z);
        p = s.u.s;
        e = s.u.s + s.n;
        for (i = 0; p <= e; i++) {
            nl = memchr(p, '\n', (size_t) (e - p));
            size_t ln = nl ? (size_t) (nl - p) : (size_t) (e - p);
            if ((i > 0 || first) && (ln > 0 || blank)) {
                if (tj_buf_add(&b, pad.u.s, pad.n) != 0) {
                    tj_fail(c, "chat template: indent: too large");
                }
            }
            if (tj_buf_add(&b, p, ln) != 0
                || (nl && tj_buf_add(&b, "\n", 1) != 0))
            {
                tj_fail(c, "chat template: indent: too large");
            }
            if (!nl) {
                break;
            }
            p = nl + 1;
        }
        return b.p ? tj_str(b.p, b.len) : tj_str("", 0);
    }
    case FL_ITEMS:
        if (v.t == TJ_UNDEF) {
            return tj_new_list(c, 0);
        }
        if (v.t != TJ_DICT) {
            tj_fail(c, "chat template: items: can only get item pairs from a "
                    "mapping");
        }
        {
            tj_args_t none = { .npos = 0, .nkw = 0 };
            return tj_call_method(c, M_ITEMS, v, &none);
        }
    case FL_JOIN:
        tj_arg(a, 0, "d", &x);
        tj_arg(a, 1, "attribute", &y);
        if (x.t == TJ_UNDEF) {
            x = tj_str("", 0);
        }
        x = tj_to_str(c, x);
        l = tj_iter_list(c, v, "join");
        for (i = 0; i < l->n; i++) {
            tj_val_t item = y.t != TJ_UNDEF ? tj_attr_path(c, l->v[i], y)
                                            : l->v[i];
            item = tj_to_str(c, item);
            if ((i && tj_buf_add(&b, x.u.s, x.n) != 0)
                || tj_buf_add(&b, item.u.s, item.n) != 0)
            {
                tj_fail(c, "chat template: join: result too large");
            }
        }
        return b.p ? tj_str(b.p, b.len) : tj_str("", 0);
    case FL_LIST:
        l = tj_iter_list(c, v, "list");
        r = tj_new_list(c, l->n);
        tj_mcpy(r.u.l->v, l->v, l->n * sizeof(tj_val_t));
        r.u.l->n = l->n;
        return r;
    case FL_LOWER:
        return tj_case(c, tj_to_str(c, v), 0);
    case FL_UPPER:
        return tj_case(c, tj_to_str(c, v), 1);
    case FL_TITLE:
        return tj_case(c, tj_to_str(c, v), 2);
    case FL_MAP:
        l = tj_iter_list(c, v, "map");
        r = tj_new_list(c, l->n);
        if (tj_arg(a, 99, "attribute", &x)) {
            tj_arg(a, 99, "default", &y);
            for (i = 0; i < l->n; i++) {
                z = tj_attr_path(c, l->v[i], x);
                if (z.t == TJ_UNDEF && y.t != TJ_UNDEF) {
                    z = y;
                }
                r.u.l->v[r.u.l->n++] = z;
            }
            return r;
        }
        if (a->npos == 0 || a->pos[0].t != TJ_STR) {
            tj_fail(c, "chat template: map: expected a filter name or "
                    "attribute=");
        }
        {
            int f2 = tj_filter_id(a->pos[0].u.s, a->pos[0].n);
            tj_args_t rest = *a;
            if (f2 < 0) {
                tj_fail(c, "chat template: map: no filter named '%.*s'",
                        (int) a->pos[0].n, a->pos[0].u.s);
            }
            memmove(rest.pos, rest.pos + 1, (rest.npos - 1) * sizeof(tj_val_t));
            rest.npos--;
            for (i = 0; i < l->n; i++) {
                r.u.l->v[r.u.l->n++] = tj_apply_filter(c, f2, l->v[i], &rest,
                                                       a->pos[0].u.s,
                                                       a->pos[0].n);
            }
            return r;
        }
    case FL_MAX:
    case FL_MIN:
        l = tj_iter_list(c, v, "min/max");
        tj_arg(a, 0, "case_sensitive", &x);
        tj_arg(a, 1, "attribute", &y);
        if (l->n == 0) {
            return tj_undef("(empty)", 7);
        }
        r = l->v[0];
        for (i = 1; i < l->n; i++) {
            tj_val_t ka = y.t != TJ_UNDEF ? tj_attr_path(c, l->v[i], y)
                                          : l->v[i];
            tj_val_t kb = y.t != TJ_UNDEF ? tj_attr_path(c, r, y) : r;
            int cmp = tj_sort_cmp(c, ka, kb, tj_truthy(x));
            if (fid == FL_MAX ? cmp > 0 : cmp < 0) {
                r = l->v[i];
            }
        }
        return r;
    case FL_SELECT:
    case FL_REJECT:
    case FL_SELECTATTR:
    case FL_REJECTATTR: {
        int attr = fid == FL_SELECTATTR || fid == FL_REJECTATTR;
        int want = fid == FL_SELECT || fid == FL_SELECTATTR;
        size_t skip = attr ? 1 : 0;
        int tid = -1;
        tj_args_t rest = { .npos = 0, .nkw = 0 };
        l = tj_iter_list(c, v, name);
        if (attr && a->npos == 0) {
            tj_fail(c, "chat template: %.*s: missing attribute", (int) nlen,
                    name);
        }
        if (a->npos > skip) {
            tj_need_str(c, a->pos[skip], "select test");
            tid = tj_test_id(a->pos[skip].u.s, a->pos[skip].n);
            if (tid < 0) {
                tj_fail(c, "chat template: no test named '%.*s'",
                        (int) a->pos[skip].n, a->pos[skip].u.s);
            }
            for (i = skip + 1; i < a->npos; i++) {
                rest.pos[rest.npos++] = a->pos[i];
            }
        }
        r = tj_new_list(c, 0);
        for (i = 0; i < l->n; i++) {
            tj_val_t item = attr ? tj_attr_path(c, l->v[i], a->pos[0])
                                 : l->v[i];
            int ok = tid < 0 ? tj_truthy(item)
                     : tj_apply_test(c, tid, item, &rest, "", 0);
            if (ok == want) {
                tj_list_push(c, r.u.l, l->v[i]);
            }
        }
        return r;
    }
    case FL_REPLACE:
        tj_arg(a, 0, "old", &x);
        tj_arg(a, 1, "new", &y);
        tj_arg(a, 2, "count", &z);
        return tj_replace(c, tj_to_str(c, v), tj_to_str(c, x), tj_to_str(c, y),
                          z.t == TJ_UNDEF || z.t == TJ_NONE ? -1
                          : tj_as_int(c, z, "replace"));
    case FL_REVERSE:
        if (v.t == TJ_STR) {
            return tj_slice(c, v, tj_none(), tj_none(), tj_int(-1), 0);
        }
        l = tj_iter_list(c, v, "reverse");
        r = tj_new_list(c, l->n);
        for (i = 0; i < l->n; i++) {
            r.u.l->v[i] = l->v[l->n - 1 - i];
        }
        r.u.l->n = l->n;
        return r;
    case FL_ROUND: {
        int64_t prec = 0;
        double m, f;
        tj_arg(a, 0, "precision", &x);
        tj_arg(a, 1, "method", &y);
        if (x.t != TJ_UNDEF) {
            prec = tj_as_int(c, x, "round");
        }
        if (!tj_isnum(v)) {
            tj_fail(c, "chat template: round: expected a number");
        }
        m = pow(10.0, (double) prec);
        f = tj_as_num(v) * m;
        if (y.t == TJ_STR && y.n == 4 && memcmp(y.u.s, "ceil", 4) == 0) {
            f = ceil(f);
        } else if (y.t == TJ_STR && y.n == 5 && memcmp(y.u.s, "floor", 5) == 0) {
            f = floor(f);
        } else {
            f = nearbyint(f);
        }
        return tj_float(f / m);
    }
    case FL_SAFE:
        return v;
    case FL_SORT: {
        size_t n;
        tj_val_t *k;
        l = tj_iter_list(c, v, "sort");
        n = l->n;
        tj_arg(a, 0, "reverse", &x);
        tj_arg(a, 1, "case_sensitive", &y);
        tj_arg(a, 2, "attribute", &z);
        k = tj_alloc(c, (4 * n + 1) * sizeof(tj_val_t));
        r = tj_new_list(c, n);
        for (i = 0; i < n; i++) {
            r.u.l->v[i] = l->v[i];
            k[i] = z.t != TJ_UNDEF ? tj_attr_path(c, l->v[i], z) : l->v[i];
        }
        r.u.l->n = n;
        tj_msort(c, k, r.u.l->v, n, tj_truthy(y), tj_truthy(x), k + n,
                 k + 2 * n);
        return r;
    }
    case FL_STRING:
        return tj_to_str(c, v);
    case FL_SUM:
        l = tj_iter_list(c, v, "sum");
        tj_arg(a, 0, "attribute", &x);
        tj_arg(a, 1, "start", &y);
        r = y.t == TJ_UNDEF ? tj_int(0) : y;
        for (i = 0; i < l->n; i++) {
            r = tj_binary(c, TO_ADD, r, x.t != TJ_UNDEF
                          ? tj_attr_path(c, l->v[i], x) : l->v[i], 0);
        }
        return r;
    case FL_TOJSON: {
        long indent = -1;
        tj_arg(a, 0, "indent", &x);
        if (x.t == TJ_INT) {
            indent = x.u.i < 0 ? 0 : x.u.i > 64 ? 64 : (long) x.u.i;
        } else if (x.t != TJ_UNDEF && x.t != TJ_NONE && x.t != TJ_STR) {
            tj_fail(c, "chat template: tojson: indent must be an int or a "
                    "string");
        }
        tj_tojson(c, &b, v, indent, x.t == TJ_STR ? x.u.s : NULL,
                  x.t == TJ_STR ? x.n : 0, 0);
        return b.p ? tj_str(b.p, b.len) : tj_str("", 0);
    }
    case FL_TRIM:
        tj_arg(a, 0, "chars", &x);
        return tj_strip(tj_to_str(c, v), x, 1, 1);
    case FL_UNIQUE:
        l = tj_iter_list(c, v, "unique");
        tj_arg(a, 0, "case_sensitive", &x);
        tj_arg(a, 1, "attribute", &y);
        r = tj_new_list(c, 0);
        for (i = 0; i < l->n; i++) {
            size_t j;
            tj_val_t ki = y.t != TJ_UNDEF ? tj_attr_path(c, l->v[i], y)
                                          : l->v[i];
            if (!tj_truthy(x) && ki.t == TJ_STR) {
                ki = tj_case(c, ki, 0);
            }
            for (j = 0; j < r.u.l->n; j++) {
                tj_val_t kj = y.t != TJ_UNDEF
                              ? tj_attr_path(c, r.u.l->v[j], y) : r.u.l->v[j];
                if (!tj_truthy(x) && kj.t == TJ_STR) {
                    kj = tj_case(c, kj, 0);
                }
                if (tj_equal(ki, kj)) {
                    break;
                }
            }
            if (j == r.u.l->n) {
                tj_list_push(c, r.u.l, l->v[i]);
            }
        }
        return r;
    case FL_WORDCOUNT:
        return tj_int(tj_wordcount(tj_to_str(c, v)));
    case FL_CENTER: {
        int64_t width = 80, len, left;
        tj_val_t s = tj_to_str(c, v);
        tj_arg(a, 0, "width", &x);
        if (x.t != TJ_UNDEF) {
            width = tj_as_int(c, x, "center");
        }
        len = (int64_t) tj_utf8_count(s.u.s, s.n);
        if (width <= len || width > 4096) {
            return s;
        }
        left = (width - len) / 2 + ((width - len) & width & 1);
        for (i = 0; i < (size_t) left; i++) {
            tj_buf_add(&b, " ", 1);
        }
        tj_buf_add(&b, s.u.s, s.n);
        for (i = 0; i < (size_t) (width - len - left); i++) {
            tj_buf_add(&b, " ", 1);
        }
        return tj_str(b.p, b.len);
    }
    case FL_FORMAT: {
        /* "%s" style with %s / %d / %% only */
        tj_val_t s = tj_need_str(c, v, "format");
        size_t k = 0;
        for (i = 0; i < s.n; i++) {
            if (s.u.s[i] != '%' || i + 1 >= s.n) {
                tj_buf_add(&b, s.u.s + i, 1);
                continue;
            }
            i++;
            if (s.u.s[i] == '%') {
                tj_buf_add(&b, "%", 1);
            } else if (s.u.s[i] == 's' || s.u.s[i] == 'd') {
                if (k >= a->npos) {
                    tj_fail(c, "chat template: format: not enough arguments");
                }
                x = tj_to_str(c, s.u.s[i] == 'd'
                              ? tj_int(tj_as_int(c, a->pos[k], "format"))
                              : a->pos[k]);
                k++;
                tj_buf_add(&b, x.u.s, x.n);
            } else {
                tj_fail(c, "chat template: format: only %%s and %%d are "
                        "supported");
            }
        }
        if (b.over || b.oom) {
            tj_fail(c, "chat template: format: result too large");
        }
        return b.p ? tj_str(b.p, b.len) : tj_str("", 0);
    }
    case FL_BATCH: {
        int64_t n;
        tj_val_t cur = { 0 };
        l = tj_iter_list(c, v, "batch");
        tj_arg(a, 0, "linecount", &x);
        n = tj_as_int(c, x, "batch");
        if (n <= 0) {
            tj_fail(c, "chat template: batch: linecount must be positive");
        }
        r = tj_new_list(c, 0);
        for (i = 0; i < l->n; i++) {
            if (i % (size_t) n == 0) {
                cur = tj_new_list(c, 0);
                tj_list_push(c, r.u.l, cur);
            }
            tj_list_push(c, cur.u.l, l->v[i]);
        }
        return r;
    }
    }
    tj_fail(c, "chat template: no filter named '%.*s'", (int) nlen, name);
}


/* ---- tests */

static int
tj_apply_test(tj_ctx_t *c, int tid, tj_val_t v, tj_args_t *a,
    const char *name, size_t nlen)
{
    tj_val_t  x;

    tj_arg(a, 0, "other", &x);
    switch (tid) {
    case TS_BOOLEAN:
        return v.t == TJ_BOOL;
    case TS_CALLABLE:
        return v.t == TJ_MACRO || v.t == TJ_FUNC;
    case TS_DEFINED:
        return v.t != TJ_UNDEF;
    case TS_UNDEFINED:
        return v.t == TJ_UNDEF;
    case TS_DIVISIBLEBY:
        if (tj_as_int(c, x, "divisibleby") == 0) {
            tj_fail(c, "chat template: divisibleby 0");
        }
        return tj_as_int(c, v, "divisibleby") % x.u.i == 0;
    case TS_EQ:
    case TS_EQUALTO:
    case TS_EQ2:
        return tj_equal(v, x);
    case TS_NE:
    case TS_NE2:
        return !tj_equal(v, x);
    case TS_ESCAPED:
        return 0;
    case TS_EVEN:
        return tj_as_int(c, v, "even") % 2 == 0;
    case TS_ODD:
        return tj_as_int(c, v, "odd") % 2 != 0;
    case TS_FALSE:
        return v.t == TJ_BOOL && !v.u.i;
    case TS_TRUE:
        return v.t == TJ_BOOL && v.u.i;
    case TS_FLOAT:
        return v.t == TJ_FLOAT;
    case TS_INTEGER:
        return v.t == TJ_INT;
    case TS_NUMBER:
        return v.t == TJ_INT || v.t == TJ_FLOAT || v.t == TJ_BOOL;
    case TS_GE:
    case TS_GE2:
        return tj_compare(c, v, x, ">=") >= 0;
    case TS_GT:
    case TS_GT2:
    case TS_GREATERTHAN:
        return tj_compare(c, v, x, ">") > 0;
    case TS_LE:
    case TS_LE2:
        return tj_compare(c, v, x, "<=") <= 0;
    case TS_LT:
    case TS_LT2:
    case TS_LESSTHAN:
        return tj_compare(c, v, x, "<") < 0;
    case TS_IN:
        return tj_contains(c, x, v);
    case TS_ITERABLE:
        return v.t == TJ_STR || v.t == TJ_LIST || v.t == TJ_DICT;
    case TS_SEQUENCE:
        return v.t == TJ_STR || v.t == TJ_LIST || v.t == TJ_DICT;
    case TS_MAPPING:
        return v.t == TJ_DICT;
    case TS_NONE:
        return v.t == TJ_NONE;
    case TS_STRING:
        return v.t == TJ_STR;
    case TS_SAMEAS:
        if (v.t != x.t) {
            return 0;
        }
        if (v.t == TJ_NONE || v.t == TJ_UNDEF) {
            return 1;
        }
        if (v.t == TJ_BOOL || v.t == TJ_INT) {
            return v.u.i == x.u.i;
        }
        return v.u.p == x.u.p && v.n == x.n;
    case TS_LOWER:
    case TS_UPPER: {
        tj_args_t none = { .npos = 0, .nkw = 0 };
        if (v.t != TJ_STR) {
            return 0;
        }
        tj_val_t s = tj_case(c, v, tid == TS_LOWER ? 0 : 1);
        (void) none;
        return tj_equal(s, v);
    }
    }
    tj_fail(c, "chat template: no test named '%.*s'", (int) nlen, name);
}


/* ---- statements */

static void
tj_exec_for(tj_ctx_t *c, const tj_node_t *nd)
{
    tj_val_t     it, loopv = { 0 }, item;
    tj_list_t   *src, *items;
    tj_loop_t   *lp;
    tj_frame_t  *saved = c->frame, *f;
    size_t       i;

    it = tj_eval(c, nd->b);
    src = tj_iter_list(c, it, "for");
    if (nd->e) {
        /* the loop's filter: evaluated with the target bound */
        items = tj_new_list(c, 0).u.l;
        f = tj_frame_new(c, saved);
        c->frame = f;
        for (i = 0; i < src->n; i++) {
            tj_step(c);
            tj_assign(c, nd->a, src->v[i]);
            if (tj_truthy(tj_eval(c, nd->e))) {
                tj_list_push(c, items, src->v[i]);
            }
        }
        c->frame = saved;
    } else {
        items = src;
    }
    if (items->n == 0) {
        if (nd->d) {
            tj_exec(c, nd->d);
        }
        return;
    }
    lp = tj_alloc(c, sizeof(*lp));
    lp->items = items;
    lp->depth = 0;
    loopv.t = TJ_LOOP;
    loopv.u.p = lp;
    f = tj_frame_new(c, saved);
    c->frame = f;
    tj_frame_set(c, f, tj_k_loop, 4, loopv);
    for (i = 0; i < items->n; i++) {
        tj_step(c);
        lp->i = i;
        item = items->v[i];
        tj_assign(c, nd->a, item);
        tj_exec(c, nd->c);
        if (c->ctl == 1) {
            c->ctl = 0;
            break;
        }
        c->ctl = 0;
    }
    c->frame = saved;
}


/*
 * {{ a + b + c }} and {{ a ~ b ~ c }}: the operands are evaluated in
 * order and, when + only meets strings, written out one by one instead of
 * being joined first (the same text, no copies of long contents).
 */
#define TJ_CHAIN_MAX  32

static void
tj_emit_expr(tj_ctx_t *c, const tj_node_t *nd)
{
    const tj_node_t  *ops[TJ_CHAIN_MAX], *x;
    tj_val_t          vals[TJ_CHAIN_MAX], v;
    size_t            n = 0, i;
    int               concat = nd->kind == TN_CONCAT, strs = 1;

    if ((nd->kind == TN_BIN && nd->op == TO_ADD) || concat) {
        /* left-leaning chain: collect the right operands */
        for (x = nd; n < TJ_CHAIN_MAX - 1
             && (concat ? x->kind == TN_CONCAT
                        : x->kind == TN_BIN && x->op == TO_ADD);
             x = x->a)
        {
            ops[n++] = x->b;
        }
        ops[n++] = x;
        tj_step(c);
        for (i = 0; i < n; i++) {
            vals[i] = tj_eval(c, ops[n - 1 - i]);
            if (vals[i].t != TJ_STR) {
                strs = 0;
            }
        }
        if (concat || strs) {
            for (i = 0; i < n; i++) {
                if (vals[i].t == TJ_STR) {
                    tj_emit(c, vals[i].u.s, vals[i].n);
                } else {
                    tj_str_of(c, c->out, vals[i]);
                }
            }
            return;
        }
        v = vals[0];
        for (i = 1; i < n; i++) {
            v = tj_binary(c, TO_ADD, v, vals[i], nd->line);
        }
    } else {
        v = tj_eval(c, nd);
    }
    if (v.t == TJ_STR) {
        tj_emit(c, v.u.s, v.n);
    } else {
        tj_str_of(c, c->out, v);
    }
}


static void
tj_exec(tj_ctx_t *c, const tj_node_t *nd)
{
    tj_val_t      v;
    tj_macro_t   *m;
    tj_args_t     args;
    const tj_node_t *f;

    for ( ; nd; nd = nd->next) {
        if (c->ctl) {
            return;
        }
        tj_step(c);
        switch (nd->kind) {
        case TN_TEXT:
            tj_emit(c, nd->v.u.s, nd->v.n);
            break;
        case TN_OUT:
            tj_emit_expr(c, nd->a);
            break;
        case TN_IF: {
            const tj_node_t *br = nd;
            for ( ;; ) {
                if (tj_truthy(tj_eval(c, br->a))) {
                    tj_exec(c, br->b);
                    break;
                }
                if (br->c && br->c->kind == TN_IF && br->c->next == NULL) {
                    /* elif chains are nested ifs: loop, not recurse */
                    br = br->c;
                    continue;
                }
                if (br->c) {
                    tj_exec(c, br->c);
                }
                break;
            }
            break;
        }
        case TN_FOR:
            if (++c->depth > c->lim.max_depth) {
                tj_fail(c, "chat template: loops nested deeper than %u",
                        c->lim.max_depth);
            }
            tj_exec_for(c, nd);
            c->depth--;
            break;
        case TN_SET:
            tj_assign(c, nd->a, tj_eval(c, nd->b));
            break;
        case TN_SETBLOCK:
            v = tj_capture_body(c, nd->b);
            for (f = nd->c; f; f = f->next) {
                tj_eval_args(c, f->b, &args);
                v = tj_apply_filter(c, f->fid, v, &args, f->v.u.s, f->v.n);
            }
            tj_assign(c, nd->a, v);
            break;
        case TN_MACRO:
            m = tj_alloc(c, sizeof(*m));
            m->def = nd;
            m->closure = c->frame;
            m->caller = NULL;
            v = (tj_val_t) { .t = TJ_MACRO, .u.p = m };
            tj_frame_set(c, c->frame, nd->v.u.s, nd->v.n, v);
            break;
        case TN_CALLBLOCK: {
            tj_macro_t *cm = tj_alloc(c, sizeof(*cm));
            tj_val_t *cv = tj_alloc(c, sizeof(*cv)), fn;
            cm->def = nd;
            cm->closure = c->frame;
            cm->caller = c->caller;
            *cv = (tj_val_t) { .t = TJ_MACRO, .u.p = cm };
            fn = tj_eval(c, nd->a->a);
            tj_eval_args(c, nd->a->b, &args);
            if (fn.t == TJ_MACRO) {
                tj_macro_t copy = *(tj_macro_t *) fn.u.p;
                copy.caller = cv;
                v = tj_call_macro(c, &copy, &args, nd);
            } else {
                v = tj_call_value(c, fn, &args, nd);
            }
            tj_str_of(c, c->out, v);
            break;
        }
        case TN_FILTERBLOCK:
            v = tj_capture_body(c, nd->b);
            for (f = nd->a; f; f = f->next) {
                tj_eval_args(c, f->b, &args);
                v = tj_apply_filter(c, f->fid, v, &args, f->v.u.s, f->v.n);
            }
            tj_str_of(c, c->out, v);
            break;
        case TN_BREAK:
            c->ctl = 1;
            return;
        case TN_CONTINUE:
            c->ctl = 2;
            return;
        case TN_DO:
            (void) tj_eval(c, nd->a);
            break;
        default:
            tj_fail(c, "chat template: line %u: not a statement", nd->line);
        }
    }
}


int
tj_render(const tj_template_t *t, tj_arena_t *a, const tj_dict_t *globals,
    const tj_limits_t *lim, char **out, size_t *outlen, char *err,
    size_t errlen)
{
    tj_ctx_t           *c;
    tj_buf_t            buf = { 0 };
    volatile int        failed = 0;

    *out = NULL;
    *outlen = 0;
    c = tj_arena_alloc(a, sizeof(*c));
    if (c == NULL) {
        tok_err(err, errlen, "chat template: out of memory");
        return -1;
    }
    memset(c, 0, sizeof(*c));
    c->arena = *a;          /* the render continues the caller's arena */
    c->lim = *lim;
    c->arena.limit = lim->max_memory;
    buf.max = lim->max_output;
    c->out = &buf;
    c->gval = tj_arena_alloc(&c->arena, (t->nsym + 1) * sizeof(tj_val_t));
    c->gset = tj_arena_alloc(&c->arena, t->nsym + 1);
    if (c->gval == NULL || c->gset == NULL) {
        *a = c->arena;
        tok_err(err, errlen, "chat template: out of memory");
        return -1;
    }
    memset(c->gset, 0, t->nsym + 1);
    c->local = t->local;
    if (lim->out_hint) {
        buf.cap = lim->out_hint < buf.max ? lim->out_hint : buf.max;
        buf.cap++;
        if ((buf.p = malloc(buf.cap)) == NULL) {
            *a = c->arena;
            tok_err(err, errlen, "chat template: out of memory");
            return -1;
        }
        buf.p[0] = '\0';
    }
    c->globals = globals;
    c->err = err;
    c->errlen = errlen;
    if (err && errlen) {
        err[0] = '\0';
    }
    if (setjmp(c->jb) != 0) {
        failed = 1;
    } else {
        c->frame = tj_frame_new(c, NULL);
        c->top = c->frame;
        tj_exec(c, t->body);
    }
    *a = c->arena;          /* hand the blocks back for freeing */
    if (failed) {
        free(buf.p);
        return -1;
    }
    if (buf.p == NULL && tj_buf_add(&buf, "", 0) != 0) {
        tok_err(err, errlen, "chat template: out of memory");
        return -1;
    }
    *out = buf.p;
    *outlen = buf.len;
    return 0;
}
