/*
 * Tokens to the tree, with Jinja2's grammar and precedence:
 *
 *   expr    := or ["if" or ["else" expr]]
 *   or      := and ("or" and)*          and := not ("and" not)*
 *   not     := "not" not | compare      compare := math1 (cmpop math1)*
 *   math1   := concat (("+"|"-") concat)*
 *   concat  := math2 ("~" math2)*       math2 := pow (("*"|"/"|"//"|"%") pow)*
 *   pow     := unary ("**" unary)*      unary := ("-"|"+") unary | primary
 *   primary := literal | name | "(" ... ")" | "[" ... "]" | "{" ... "}"
 *              then .attr [key] [a:b:c] (args), then | filter and is test
 *
 * Statements: if/elif/else, for (targets, "if" filter, else, recursive),
 * set (names, tuples, namespace attributes, block set), macro, call,
 * filter blocks, break/continue, do, generation (a plain block), raw.
 * Anything else (extends, include, import, block) is a compile error.
 *
 * At the end, vLLM's content format detection runs on the tree.
 */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"
#include "tok_jinja.h"


typedef struct {
    tj_arena_t   *a;
    tj_token_t   *t;
    size_t        n, i;
    char         *err;
    size_t        errlen;
    unsigned      depth;
    jmp_buf       jb;
    /* the names, one canonical pointer and id each (open addressing) */
    const char  **syms;
    size_t       *symn;
    unsigned     *symid;
    size_t        scap, nsym;
    unsigned char *local;       /* by id: a frame may hold the name */
    size_t        lcap;
} tj_ps_t;


static _Noreturn void
tj_ps_fail(tj_ps_t *p, const char *fmt, const char *arg, size_t an)
{
    char  msg[200];

    snprintf(msg, sizeof(msg), fmt, (int) an, arg ? arg : "");
    tok_err(p->err, p->errlen, "chat template: line %u: %s",
            p->t[p->i < p->n ? p->i : p->n - 1].line, msg);
    longjmp(p->jb, 1);
}


static tj_node_t *
tj_node(tj_ps_t *p, tj_node_kind_t k)
{
    tj_node_t  *nd = tj_arena_alloc(p->a, sizeof(tj_node_t));

    if (nd == NULL) {
        tj_ps_fail(p, "out of memory%.*s", "", 0);
    }
    memset(nd, 0, sizeof(*nd));
    nd->kind = (uint16_t) k;
    nd->line = p->t[p->i < p->n ? p->i : p->n - 1].line;
    nd->fid = -1;
    return nd;
}


static tj_token_t *
tj_cur(tj_ps_t *p)
{
    return &p->t[p->i];
}


/*
 * A name's canonical pointer (tj_intern()'s where it has one) and its id:
 * every variable and attribute name of a template is one pointer per
 * distinct name, so the evaluator finds frame variables by pointer alone
 * and caches the globals by id.
 */
static const char *
tj_psym(tj_ps_t *p, const char *s, size_t n, int *id)
{
    size_t        h = 2166136261u, i, j, cap;
    const char  **ns;
    size_t       *nn;
    unsigned     *ni;

    if (2 * (p->nsym + 1) > p->scap) {
        cap = p->scap ? 2 * p->scap : 64;
        ns = calloc(cap, sizeof(*ns));
        nn = calloc(cap, sizeof(*nn));
        ni = calloc(cap, sizeof(*ni));
        if (ns == NULL || nn == NULL || ni == NULL) {
            free(ns);
            free(nn);
            free(ni);
            tj_ps_fail(p, "out of memory%.*s", "", 0);
        }
        for (i = 0; i < p->scap; i++) {
            if (p->syms[i] == NULL) {
                continue;
            }
            h = 2166136261u;
            for (j = 0; j < p->symn[i]; j++) {
                h = (h ^ (unsigned char) p->syms[i][j]) * 16777619u;
            }
            for (j = h & (cap - 1); ns[j]; j = (j + 1) & (cap - 1)) { }
            ns[j] = p->syms[i];
            nn[j] = p->symn[i];
            ni[j] = p->symid[i];
        }
        free(p->syms);
        free(p->symn);
        free(p->symid);
        p->syms = ns;
        p->symn = nn;
        p->symid = ni;
        p->scap = cap;
        h = 2166136261u;
    }
    for (j = 0; j < n; j++) {
        h = (h ^ (unsigned char) s[j]) * 16777619u;
    }
    for (i = h & (p->scap - 1); p->syms[i]; i = (i + 1) & (p->scap - 1)) {
        if (p->symn[i] == n && memcmp(p->syms[i], s, n) == 0) {
            if (id) {
                *id = (int) p->symid[i];
            }
            return p->syms[i];
        }
    }
    p->syms[i] = tj_intern(s, n);
    p->symn[i] = n;
    p->symid[i] = (unsigned) p->nsym++;
    if (id) {
        *id = (int) p->symid[i];
    }
    return p->syms[i];
}


/* the name id is assigned somewhere (set, for, macro, parameter) */
static void
tj_plocal(tj_ps_t *p, int id)
{
    unsigned char  *l;
    size_t          cap;

    if ((size_t) id >= p->lcap) {
        cap = p->lcap ? p->lcap : 64;
        while (cap <= (size_t) id) {
            cap *= 2;
        }
        if ((l = realloc(p->local, cap)) == NULL) {
            tj_ps_fail(p, "out of memory%.*s", "", 0);
        }
        memset(l + p->lcap, 0, cap - p->lcap);
        p->local = l;
        p->lcap = cap;
    }
    p->local[id] = 1;
}


static int
tj_is_op(tj_ps_t *p, const char *op)
{
    tj_token_t  *t = tj_cur(p);

    return t->kind == TK_OP && t->n == strlen(op) && memcmp(t->s, op, t->n) == 0;
}


static int
tj_is_name(tj_ps_t *p, const char *name)
{
    tj_token_t  *t = tj_cur(p);

    return t->kind == TK_NAME && t->n == strlen(name)
           && memcmp(t->s, name, t->n) == 0;
}


static int
tj_is_name_at(tj_ps_t *p, size_t i, const char *name)
{
    tj_token_t  *t = &p->t[i < p->n ? i : p->n - 1];

    return t->kind == TK_NAME && t->n == strlen(name)
           && memcmp(t->s, name, t->n) == 0;
}


static void
tj_expect_op(tj_ps_t *p, const char *op)
{
    if (!tj_is_op(p, op)) {
        tj_ps_fail(p, "expected '%.*s'", op, strlen(op));
    }
    p->i++;
}


static void
tj_expect_name(tj_ps_t *p, const char *name)
{
    if (!tj_is_name(p, name)) {
        tj_ps_fail(p, "expected '%.*s'", name, strlen(name));
    }
    p->i++;
}


static void
tj_expect_end(tj_ps_t *p)
{
    if (tj_cur(p)->kind != TK_BLOCK_END) {
        tj_ps_fail(p, "expected end of statement block%.*s", "", 0);
    }
    p->i++;
}


static tj_node_t *tj_expr(tj_ps_t *p);
static tj_node_t *tj_expr_noif(tj_ps_t *p);
static tj_node_t *tj_unary(tj_ps_t *p, int with_filter);
static tj_node_t *tj_body(tj_ps_t *p, const char *const *ends, int *which);


static void
tj_enter(tj_ps_t *p)
{
    if (++p->depth > 200) {
        tj_ps_fail(p, "expression or block nesting too deep%.*s", "", 0);
    }
}


/* call arguments after "(": positional and name=value */
static tj_node_t *
tj_args(tj_ps_t *p)
{
    tj_node_t  *head = NULL, **tail = &head, *a;

    while (!tj_is_op(p, ")")) {
        if (head) {
            tj_expect_op(p, ",");
            if (tj_is_op(p, ")")) {
                break;
            }
        }
        if (tj_cur(p)->kind == TK_NAME && p->i + 1 < p->n
            && p->t[p->i + 1].kind == TK_OP && p->t[p->i + 1].n == 1
            && p->t[p->i + 1].s[0] == '=')
        {
            a = tj_node(p, TN_KWARG);
            a->v = tj_str(tj_psym(p, tj_cur(p)->s, tj_cur(p)->n, NULL),
                          tj_cur(p)->n);
            p->i += 2;
            a->a = tj_expr(p);
        } else {
            a = tj_expr(p);
        }
        *tail = a;
        tail = &a->next;
    }
    p->i++;
    return head;
}


static tj_node_t *
tj_subscript(tj_ps_t *p, tj_node_t *obj)
{
    tj_node_t  *nd, *parts[3] = { NULL, NULL, NULL };
    int         k = 0, slice = 0;

    for ( ;; ) {
        if (tj_is_op(p, ":")) {
            slice = 1;
            if (++k > 2) {
                tj_ps_fail(p, "too many ':' in a subscript%.*s", "", 0);
            }
            p->i++;
            continue;
        }
        if (tj_is_op(p, "]")) {
            break;
        }
        if (parts[k]) {
            tj_ps_fail(p, "expected ']'%.*s", "", 0);
        }
        parts[k] = tj_expr(p);
    }
    p->i++;
    if (!slice) {
        if (parts[0] == NULL) {
            tj_ps_fail(p, "empty subscript%.*s", "", 0);
        }
        nd = tj_node(p, TN_ITEM);
        nd->a = obj;
        nd->b = parts[0];
        return nd;
    }
    nd = tj_node(p, TN_SLICE);
    nd->a = obj;
    nd->b = parts[0];
    nd->c = parts[1];
    nd->d = parts[2];
    return nd;
}


static tj_node_t *
tj_postfix(tj_ps_t *p, tj_node_t *nd)
{
    tj_node_t  *x;

    for ( ;; ) {
        if (tj_is_op(p, ".")) {
            p->i++;
            if (tj_cur(p)->kind == TK_NAME) {
                x = tj_node(p, TN_ATTR);
                x->a = nd;
                x->v = tj_str(tj_psym(p, tj_cur(p)->s, tj_cur(p)->n, NULL),
                              tj_cur(p)->n);
                x->fid = tj_attr_special(x->v.u.s, x->v.n);
                x->op = (uint16_t) tj_loop_attr_id(x->v.u.s, x->v.n);
            } else if (tj_cur(p)->kind == TK_INT) {
                x = tj_node(p, TN_ITEM);
                x->a = nd;
                x->b = tj_node(p, TN_LIT);
                x->b->v = tj_int(tj_cur(p)->i);
            } else {
                tj_ps_fail(p, "expected a name after '.'%.*s", "", 0);
            }
            p->i++;
            nd = x;
        } else if (tj_is_op(p, "[")) {
            p->i++;
            nd = tj_subscript(p, nd);
        } else if (tj_is_op(p, "(")) {
            p->i++;
            x = tj_node(p, TN_CALL);
            x->a = nd;
            x->b = tj_args(p);
            nd = x;
        } else {
            return nd;
        }
    }
}


/* a filter name, possibly dotted, then optional (args) */
static tj_node_t *
tj_filter(tj_ps_t *p, tj_node_t *arg)
{
    tj_node_t    *f = tj_node(p, TN_FILTER);
    tj_token_t   *t = tj_cur(p);

    if (t->kind != TK_NAME) {
        tj_ps_fail(p, "expected a filter name%.*s", "", 0);
    }
    f->v = tj_str(t->s, t->n);
    f->fid = tj_filter_id(t->s, t->n);
    if (f->fid < 0) {
        tj_ps_fail(p, "no filter named '%.*s'", t->s, t->n);
    }
    p->i++;
    f->a = arg;
    if (tj_is_op(p, "(")) {
        p->i++;
        f->b = tj_args(p);
    }
    return f;
}


static int
tj_starts_arg(tj_ps_t *p)
{
    tj_token_t  *t = tj_cur(p);

    if (t->kind == TK_STRING || t->kind == TK_INT || t->kind == TK_FLOAT) {
        return 1;
    }
    if (t->kind == TK_NAME) {
        return !(tj_is_name(p, "and") || tj_is_name(p, "or")
                 || tj_is_name(p, "else") || tj_is_name(p, "if")
                 || tj_is_name(p, "in") || tj_is_name(p, "is")
                 || tj_is_name(p, "not"));
    }
    return tj_is_op(p, "[") || tj_is_op(p, "{") || tj_is_op(p, "-");
}


static tj_node_t *
tj_filters(tj_ps_t *p, tj_node_t *nd)
{
    tj_node_t   *x;
    tj_token_t  *t;

    for ( ;; ) {
        if (tj_is_op(p, "|")) {
            p->i++;
            nd = tj_filter(p, nd);
        } else if (tj_is_name(p, "is")) {
            p->i++;
            x = tj_node(p, TN_TEST);
            if (tj_is_name(p, "not")) {
                x->op = 1;
                p->i++;
            }
            t = tj_cur(p);
            if (t->kind != TK_NAME) {
                tj_ps_fail(p, "expected a test name%.*s", "", 0);
            }
            x->v = tj_str(t->s, t->n);
            x->fid = tj_test_id(t->s, t->n);
            if (x->fid < 0) {
                tj_ps_fail(p, "no test named '%.*s'", t->s, t->n);
            }
            p->i++;
            x->a = nd;
            if (tj_is_op(p, "(")) {
                p->i++;
                x->b = tj_args(p);
            } else if (tj_starts_arg(p)) {
                /* "is divisibleby 3", "is sameas none" */
                x->b = tj_unary(p, 0);
                x->b = tj_postfix(p, x->b);
            }
            nd = x;
        } else if (tj_is_op(p, "(")) {
            p->i++;
            x = tj_node(p, TN_CALL);
            x->a = nd;
            x->b = tj_args(p);
            nd = x;
        } else {
            return nd;
        }
    }
}


static tj_node_t *
tj_primary(tj_ps_t *p)
{
    tj_token_t  *t = tj_cur(p);
    tj_node_t   *nd, *x, *head = NULL, **tail = &head;
    int          tuple = 0;

    switch (t->kind) {
    case TK_NAME:
        nd = tj_node(p, TN_LIT);
        if ((t->n == 4 && (memcmp(t->s, "true", 4) == 0
                           || memcmp(t->s, "True", 4) == 0)))
        {
            nd->v = tj_bool(1);
        } else if (t->n == 5 && (memcmp(t->s, "false", 5) == 0
                                 || memcmp(t->s, "False", 5) == 0))
        {
            nd->v = tj_bool(0);
        } else if (t->n == 4 && (memcmp(t->s, "none", 4) == 0
                                 || memcmp(t->s, "None", 4) == 0))
        {
            nd->v = tj_none();
        } else {
            nd->kind = TN_NAME;
            nd->v = tj_str(tj_psym(p, t->s, t->n, &nd->fid), t->n);
        }
        p->i++;
        return nd;
    case TK_STRING:
        nd = tj_node(p, TN_LIT);
        nd->v = tj_str(tj_intern(t->s, t->n), t->n);
        p->i++;
        /* adjacent literals concatenate */
        if (tj_cur(p)->kind == TK_STRING) {
            size_t total = nd->v.n, o;
            size_t j;
            char *buf;
            for (j = p->i; p->t[j].kind == TK_STRING; j++) {
                total += p->t[j].n;
            }
            buf = tj_arena_alloc(p->a, total + 1);
            if (buf == NULL) {
                tj_ps_fail(p, "out of memory%.*s", "", 0);
            }
            memcpy(buf, nd->v.u.s, nd->v.n);
            o = nd->v.n;
            for ( ; tj_cur(p)->kind == TK_STRING; p->i++) {
                memcpy(buf + o, tj_cur(p)->s, tj_cur(p)->n);
                o += tj_cur(p)->n;
            }
            buf[o] = '\0';
            nd->v = tj_str(buf, o);
        }
        return nd;
    case TK_INT:
        nd = tj_node(p, TN_LIT);
        nd->v = tj_int(t->i);
        p->i++;
        return nd;
    case TK_FLOAT:
        nd = tj_node(p, TN_LIT);
        nd->v = tj_float(t->f);
        p->i++;
        return nd;
    case TK_OP:
        if (tj_is_op(p, "(")) {
            p->i++;
            if (tj_is_op(p, ")")) {
                p->i++;
                nd = tj_node(p, TN_TUPLE);
                return nd;
            }
            x = tj_expr(p);
            if (!tj_is_op(p, ",")) {
                tj_expect_op(p, ")");
                return x;
            }
            nd = tj_node(p, TN_TUPLE);
            *tail = x;
            tail = &x->next;
            while (tj_is_op(p, ",")) {
                p->i++;
                if (tj_is_op(p, ")")) {
                    break;
                }
                x = tj_expr(p);
                *tail = x;
                tail = &x->next;
            }
            tj_expect_op(p, ")");
            nd->a = head;
            return nd;
        }
        if (tj_is_op(p, "[")) {
            p->i++;
            nd = tj_node(p, TN_LIST);
            while (!tj_is_op(p, "]")) {
                if (head) {
                    tj_expect_op(p, ",");
                    if (tj_is_op(p, "]")) {
                        break;
                    }
                }
                x = tj_expr(p);
                *tail = x;
                tail = &x->next;
            }
            p->i++;
            nd->a = head;
            return nd;
        }
        if (tj_is_op(p, "{")) {
            p->i++;
            nd = tj_node(p, TN_DICT);
            while (!tj_is_op(p, "}")) {
                if (head) {
                    tj_expect_op(p, ",");
                    if (tj_is_op(p, "}")) {
                        break;
                    }
                }
                x = tj_node(p, TN_PAIR);
                x->a = tj_expr(p);
                tj_expect_op(p, ":");
                x->b = tj_expr(p);
                *tail = x;
                tail = &x->next;
            }
            p->i++;
            nd->a = head;
            return nd;
        }
        break;
    default:
        break;
    }
    (void) tuple;
    if (t->kind == TK_VAR_END || t->kind == TK_BLOCK_END || t->kind == TK_EOF) {
        tj_ps_fail(p, "unexpected end of expression%.*s", "", 0);
    }
    tj_ps_fail(p, "unexpected '%.*s'", t->s, t->s ? t->n : 0);
}


static tj_node_t *
tj_unary(tj_ps_t *p, int with_filter)
{
    tj_node_t  *nd;

    tj_enter(p);
    if (tj_is_op(p, "-") || tj_is_op(p, "+")) {
        nd = tj_node(p, tj_is_op(p, "-") ? TN_NEG : TN_POS);
        p->i++;
        nd->a = tj_unary(p, 0);
    } else {
        nd = tj_postfix(p, tj_primary(p));
    }
    if (with_filter) {
        nd = tj_filters(p, nd);
    }
    p->depth--;
    return nd;
}


static tj_node_t *
tj_binop(tj_ps_t *p, tj_node_t *l, int op, tj_node_t *r)
{
    tj_node_t  *nd = tj_node(p, TN_BIN);

    nd->op = (uint16_t) op;
    nd->a = l;
    nd->b = r;
    return nd;
}


static tj_node_t *
tj_pow(tj_ps_t *p)
{
    tj_node_t  *l = tj_unary(p, 1);

    while (tj_is_op(p, "**")) {
        p->i++;
        l = tj_binop(p, l, TO_POW, tj_unary(p, 1));
    }
    return l;
}


static tj_node_t *
tj_math2(tj_ps_t *p)
{
    tj_node_t  *l = tj_pow(p);
    int         op;

    for ( ;; ) {
        if (tj_is_op(p, "*")) {
            op = TO_MUL;
        } else if (tj_is_op(p, "/")) {
            op = TO_DIV;
        } else if (tj_is_op(p, "//")) {
            op = TO_FDIV;
        } else if (tj_is_op(p, "%")) {
            op = TO_MOD;
        } else {
            return l;
        }
        p->i++;
        l = tj_binop(p, l, op, tj_pow(p));
    }
}


static tj_node_t *
tj_concat(tj_ps_t *p)
{
    tj_node_t  *l = tj_math2(p), *nd;

    while (tj_is_op(p, "~")) {
        p->i++;
        nd = tj_node(p, TN_CONCAT);
        nd->a = l;
        nd->b = tj_math2(p);
        l = nd;
    }
    return l;
}


static tj_node_t *
tj_math1(tj_ps_t *p)
{
    tj_node_t  *l = tj_concat(p);
    int         op;

    for ( ;; ) {
        if (tj_is_op(p, "+")) {
            op = TO_ADD;
        } else if (tj_is_op(p, "-")) {
            op = TO_SUB;
        } else {
            return l;
        }
        p->i++;
        l = tj_binop(p, l, op, tj_concat(p));
    }
}


static tj_node_t *
tj_compare(tj_ps_t *p)
{
    tj_node_t  *l = tj_math1(p), *nd, *prev = NULL, *both;
    int         op;

    for ( ;; ) {
        if (tj_is_op(p, "==")) {
            op = TO_EQ;
        } else if (tj_is_op(p, "!=")) {
            op = TO_NE;
        } else if (tj_is_op(p, "<")) {
            op = TO_LT;
        } else if (tj_is_op(p, "<=")) {
            op = TO_LE;
        } else if (tj_is_op(p, ">")) {
            op = TO_GT;
        } else if (tj_is_op(p, ">=")) {
            op = TO_GE;
        } else if (tj_is_name(p, "in")) {
            op = TO_IN;
        } else if (tj_is_name(p, "not") && tj_is_name_at(p, p->i + 1, "in")) {
            op = TO_NOTIN;
            p->i++;
        } else {
            return l;
        }
        p->i++;
        nd = tj_node(p, TN_CMP);
        nd->op = (uint16_t) op;
        if (prev == NULL) {
            nd->a = l;
            nd->b = tj_math1(p);
            l = nd;
        } else {
            /* a < b < c: (a < b) and (b < c), b evaluated twice here */
            nd->a = prev->b;
            nd->b = tj_math1(p);
            both = tj_node(p, TN_AND);
            both->a = l;
            both->b = nd;
            l = both;
        }
        prev = nd;
    }
}


static tj_node_t *
tj_not(tj_ps_t *p)
{
    tj_node_t  *nd;

    if (tj_is_name(p, "not")) {
        tj_enter(p);
        p->i++;
        nd = tj_node(p, TN_NOT);
        nd->a = tj_not(p);
        p->depth--;
        return nd;
    }
    return tj_compare(p);
}


static tj_node_t *
tj_and(tj_ps_t *p)
{
    tj_node_t  *l = tj_not(p), *nd;

    while (tj_is_name(p, "and")) {
        p->i++;
        nd = tj_node(p, TN_AND);
        nd->a = l;
        nd->b = tj_not(p);
        l = nd;
    }
    return l;
}


static tj_node_t *
tj_or(tj_ps_t *p)
{
    tj_node_t  *l = tj_and(p), *nd;

    while (tj_is_name(p, "or")) {
        p->i++;
        nd = tj_node(p, TN_OR);
        nd->a = l;
        nd->b = tj_and(p);
        l = nd;
    }
    return l;
}


static tj_node_t *
tj_expr(tj_ps_t *p)
{
    tj_node_t  *nd, *c;

    tj_enter(p);
    nd = tj_or(p);
    while (tj_is_name(p, "if")) {
        p->i++;
        c = tj_node(p, TN_COND);
        c->b = nd;
        c->a = tj_or(p);
        if (tj_is_name(p, "else")) {
            p->i++;
            c->c = tj_expr(p);
        }
        nd = c;
    }
    p->depth--;
    return nd;
}


/* an expression without the "x if c" form (for-loop iterables) */
static tj_node_t *
tj_expr_noif(tj_ps_t *p)
{
    tj_node_t  *nd;

    tj_enter(p);
    nd = tj_or(p);
    p->depth--;
    return nd;
}


/* assignment targets: name, name.attr, or a, b (tuple of names) */
static tj_node_t *
tj_target(tj_ps_t *p, int allow_attr)
{
    tj_node_t   *nd, *head = NULL, **tail = &head, *x;
    tj_token_t  *t;

    for ( ;; ) {
        t = tj_cur(p);
        if (t->kind != TK_NAME) {
            tj_ps_fail(p, "expected a name to assign to%.*s", "", 0);
        }
        x = tj_node(p, TN_NAME);
        x->v = tj_str(tj_psym(p, t->s, t->n, &x->fid), t->n);
        tj_plocal(p, x->fid);
        p->i++;
        if (allow_attr && tj_is_op(p, ".")) {
            p->i++;
            t = tj_cur(p);
            if (t->kind != TK_NAME) {
                tj_ps_fail(p, "expected an attribute name%.*s", "", 0);
            }
            nd = tj_node(p, TN_ATTR);
            nd->a = x;
            nd->v = tj_str(tj_psym(p, t->s, t->n, NULL), t->n);
            p->i++;
            return nd;
        }
        *tail = x;
        tail = &x->next;
        if (!tj_is_op(p, ",")) {
            break;
        }
        p->i++;
    }
    if (head->next == NULL) {
        return head;
    }
    nd = tj_node(p, TN_TUPLE);
    nd->a = head;
    return nd;
}


/* macro / call parameters: (name, name=default, ...) */
static tj_node_t *
tj_params(tj_ps_t *p)
{
    tj_node_t   *head = NULL, **tail = &head, *x;
    tj_token_t  *t;
    int          id;

    tj_expect_op(p, "(");
    while (!tj_is_op(p, ")")) {
        if (head) {
            tj_expect_op(p, ",");
        }
        t = tj_cur(p);
        if (t->kind != TK_NAME) {
            tj_ps_fail(p, "expected a parameter name%.*s", "", 0);
        }
        x = tj_node(p, TN_PARAM);
        x->v = tj_str(tj_psym(p, t->s, t->n, &id), t->n);
        tj_plocal(p, id);
        p->i++;
        if (tj_is_op(p, "=")) {
            p->i++;
            x->a = tj_expr(p);
        }
        *tail = x;
        tail = &x->next;
    }
    p->i++;
    return head;
}


static const char *const tj_end_if[] = { "elif", "else", "endif", NULL };
static const char *const tj_end_for[] = { "else", "endfor", NULL };
static const char *const tj_end_for2[] = { "endfor", NULL };
static const char *const tj_end_set[] = { "endset", NULL };
static const char *const tj_end_macro[] = { "endmacro", NULL };
static const char *const tj_end_call[] = { "endcall", NULL };
static const char *const tj_end_filter[] = { "endfilter", NULL };
static const char *const tj_end_gen[] = { "endgeneration", NULL };


static tj_node_t *
tj_stmt_if(tj_ps_t *p)
{
    tj_node_t  *nd = tj_node(p, TN_IF);
    int         which;

    nd->a = tj_expr(p);
    tj_expect_end(p);
    nd->b = tj_body(p, tj_end_if, &which);
    if (which == 0) {           /* elif */
        nd->c = tj_stmt_if(p);
        return nd;
    }
    if (which == 1) {           /* else */
        tj_expect_end(p);
        nd->c = tj_body(p, tj_end_if + 2, &which);
    }
    tj_expect_end(p);           /* endif */
    return nd;
}


static tj_node_t *
tj_stmt_for(tj_ps_t *p)
{
    tj_node_t  *nd = tj_node(p, TN_FOR);
    int         which, id;

    (void) tj_psym(p, "loop", 4, &id);
    tj_plocal(p, id);
    nd->a = tj_target(p, 0);
    tj_expect_name(p, "in");
    nd->b = tj_expr_noif(p);
    if (tj_is_name(p, "if")) {
        p->i++;
        nd->e = tj_expr_noif(p);
    }
    if (tj_is_name(p, "recursive")) {
        p->i++;
        nd->op = 1;
    }
    tj_expect_end(p);
    nd->c = tj_body(p, tj_end_for, &which);
    if (which == 0) {
        tj_expect_end(p);
        nd->d = tj_body(p, tj_end_for2, &which);
    }
    tj_expect_end(p);
    return nd;
}


static tj_node_t *
tj_stmt_set(tj_ps_t *p)
{
    tj_node_t  *nd = tj_node(p, TN_SET), *f, **fp;
    int         which;

    nd->a = tj_target(p, 1);
    if (tj_is_op(p, "=")) {
        p->i++;
        nd->b = tj_expr(p);
        if (tj_is_op(p, ",")) {
            /* set a = x, y: a tuple */
            tj_node_t *t = tj_node(p, TN_TUPLE), **tail;
            t->a = nd->b;
            tail = &nd->b->next;
            while (tj_is_op(p, ",")) {
                p->i++;
                *tail = tj_expr(p);
                tail = &(*tail)->next;
            }
            nd->b = t;
        }
        tj_expect_end(p);
        return nd;
    }
    /* {% set x %}...{% endset %}, optionally {% set x | filter %} */
    nd->kind = TN_SETBLOCK;
    fp = &nd->c;
    while (tj_is_op(p, "|")) {
        p->i++;
        f = tj_filter(p, NULL);
        *fp = f;
        fp = &f->next;
    }
    tj_expect_end(p);
    nd->b = tj_body(p, tj_end_set, &which);
    tj_expect_end(p);
    return nd;
}


static tj_node_t *
tj_stmt_macro(tj_ps_t *p)
{
    tj_node_t   *nd = tj_node(p, TN_MACRO);
    tj_token_t  *t = tj_cur(p);
    int          which, id;

    if (t->kind != TK_NAME) {
        tj_ps_fail(p, "expected a macro name%.*s", "", 0);
    }
    nd->v = tj_str(tj_psym(p, t->s, t->n, &id), t->n);
    tj_plocal(p, id);
    p->i++;
    nd->a = tj_params(p);
    tj_expect_end(p);
    nd->b = tj_body(p, tj_end_macro, &which);
    if (tj_cur(p)->kind == TK_NAME) {
        p->i++;     /* {% endmacro name %} */
    }
    tj_expect_end(p);
    return nd;
}


static tj_node_t *
tj_stmt_call(tj_ps_t *p)
{
    tj_node_t  *nd = tj_node(p, TN_CALLBLOCK);
    int         which;

    if (tj_is_op(p, "(")) {
        nd->c = tj_params(p);
    }
    nd->a = tj_expr(p);
    if (nd->a->kind != TN_CALL) {
        tj_ps_fail(p, "expected a call in {%% call %%}%.*s", "", 0);
    }
    tj_expect_end(p);
    nd->b = tj_body(p, tj_end_call, &which);
    tj_expect_end(p);
    return nd;
}


static tj_node_t *
tj_stmt_filter(tj_ps_t *p)
{
    tj_node_t  *nd = tj_node(p, TN_FILTERBLOCK), *f, **fp = &nd->a;
    int         which;

    do {
        f = tj_filter(p, NULL);
        *fp = f;
        fp = &f->next;
    } while (tj_is_op(p, "|") && ++p->i);
    tj_expect_end(p);
    nd->b = tj_body(p, tj_end_filter, &which);
    tj_expect_end(p);
    return nd;
}


/* statements up to a block named in ends (consumed up to its name) */
static tj_node_t *
tj_body(tj_ps_t *p, const char *const *ends, int *which)
{
    tj_node_t   *head = NULL, **tail = &head, *nd;
    tj_token_t  *t;
    int          k;

    tj_enter(p);
    *which = -1;
    for ( ;; ) {
        t = tj_cur(p);
        if (t->kind == TK_EOF) {
            if (ends) {
                char want[120];
                size_t o = 0;
                for (k = 0; ends[k] && o < sizeof(want) - 40; k++) {
                    o += (size_t) snprintf(want + o, sizeof(want) - o,
                                           "%s'{%% %s %%}'", k ? " or " : "",
                                           ends[k]);
                }
                tj_ps_fail(p, "unexpected end of template, expected %.*s",
                           want, o);
            }
            break;
        }
        if (t->kind == TK_DATA) {
            nd = tj_node(p, TN_TEXT);
            nd->v = tj_str(t->s, t->n);
            p->i++;
        } else if (t->kind == TK_VAR_BEGIN) {
            p->i++;
            nd = tj_node(p, TN_OUT);
            nd->a = tj_expr(p);
            if (tj_cur(p)->kind != TK_VAR_END) {
                tj_ps_fail(p, "expected '}}'%.*s", "", 0);
            }
            p->i++;
        } else if (t->kind == TK_BLOCK_BEGIN) {
            p->i++;
            t = tj_cur(p);
            if (t->kind != TK_NAME) {
                tj_ps_fail(p, "expected a statement name%.*s", "", 0);
            }
            for (k = 0; ends && ends[k]; k++) {
                if (tj_is_name(p, ends[k])) {
                    p->i++;
                    *which = k;
                    *tail = NULL;
                    p->depth--;
                    return head;
                }
            }
            p->i++;
            if (t->n == 2 && memcmp(t->s, "if", 2) == 0) {
                nd = tj_stmt_if(p);
            } else if (t->n == 3 && memcmp(t->s, "for", 3) == 0) {
                nd = tj_stmt_for(p);
            } else if (t->n == 3 && memcmp(t->s, "set", 3) == 0) {
                nd = tj_stmt_set(p);
            } else if (t->n == 5 && memcmp(t->s, "macro", 5) == 0) {
                nd = tj_stmt_macro(p);
            } else if (t->n == 4 && memcmp(t->s, "call", 4) == 0) {
                nd = tj_stmt_call(p);
            } else if (t->n == 6 && memcmp(t->s, "filter", 6) == 0) {
                nd = tj_stmt_filter(p);
            } else if (t->n == 5 && memcmp(t->s, "break", 5) == 0) {
                nd = tj_node(p, TN_BREAK);
                tj_expect_end(p);
            } else if (t->n == 8 && memcmp(t->s, "continue", 8) == 0) {
                nd = tj_node(p, TN_CONTINUE);
                tj_expect_end(p);
            } else if (t->n == 2 && memcmp(t->s, "do", 2) == 0) {
                nd = tj_node(p, TN_DO);
                nd->a = tj_expr(p);
                tj_expect_end(p);
            } else if (t->n == 10 && memcmp(t->s, "generation", 10) == 0) {
                /* transformers' AssistantTracker: a plain block here */
                int w;
                tj_expect_end(p);
                nd = tj_node(p, TN_IF);
                nd->a = tj_node(p, TN_LIT);
                nd->a->v = tj_bool(1);
                nd->b = tj_body(p, tj_end_gen, &w);
                tj_expect_end(p);
            } else {
                p->i--;
                tj_ps_fail(p, "unknown or unsupported tag '%.*s'", t->s, t->n);
            }
        } else {
            tj_ps_fail(p, "unexpected token%.*s", "", 0);
        }
        *tail = nd;
        tail = &nd->next;
    }
    p->depth--;
    return head;
}


/* ---- vLLM's content format detection (vllm/renderers/hf.py
 * _detect_content_format, e7ad92e5308e): the template loops over a
 * message's "content" -> the "openai" format */

typedef struct {
    tj_val_t    names[64];
    size_t      n;
} tj_names_t;


static int
tj_names_has(const tj_names_t *s, tj_val_t v)
{
    size_t  i;

    for (i = 0; i < s->n; i++) {
        if (s->names[i].n == v.n && memcmp(s->names[i].u.s, v.u.s, v.n) == 0) {
            return 1;
        }
    }
    return 0;
}


static void
tj_names_add(tj_names_t *s, tj_val_t v)
{
    if (!tj_names_has(s, v) && s->n < 64) {
        s->names[s->n++] = v;
    }
}


static int
tj_is_var(const tj_node_t *nd, tj_val_t name)
{
    return nd && nd->kind == TN_NAME && nd->v.n == name.n
           && memcmp(nd->v.u.s, name.u.s, name.n) == 0;
}


static int
tj_is_attr(const tj_node_t *nd, tj_val_t name, const char *key)
{
    size_t  kn = strlen(key);

    if (nd->kind == TN_ITEM) {
        return tj_is_var(nd->a, name) && nd->b->kind == TN_LIT
               && nd->b->v.t == TJ_STR && nd->b->v.n == kn
               && memcmp(nd->b->v.u.s, key, kn) == 0;
    }
    if (nd->kind == TN_ATTR) {
        return tj_is_var(nd->a, name) && nd->v.n == kn
               && memcmp(nd->v.u.s, key, kn) == 0;
    }
    return 0;
}


static int
tj_is_var_or_elems(const tj_node_t *nd, tj_val_t name, const char *key)
{
    if (nd == NULL) {
        return 0;
    }
    if (nd->kind == TN_FILTER) {
        return nd->a != NULL && tj_is_var_or_elems(nd->a, name, key);
    }
    if (nd->kind == TN_TEST) {
        return tj_is_var_or_elems(nd->a, name, key);
    }
    if (nd->kind == TN_SLICE) {
        return tj_is_var_or_elems(nd->a, name, key);
    }
    return key ? tj_is_attr(nd, name, key) : tj_is_var(nd, name);
}


typedef void (*tj_visit_pt)(const tj_node_t *nd, void *data);


static void
tj_walk(const tj_node_t *nd, tj_visit_pt f, void *data, unsigned depth)
{
    for ( ; nd && depth < 400; nd = nd->next) {
        f(nd, data);
        tj_walk(nd->a, f, data, depth + 1);
        tj_walk(nd->b, f, data, depth + 1);
        tj_walk(nd->c, f, data, depth + 1);
        tj_walk(nd->d, f, data, depth + 1);
        tj_walk(nd->e, f, data, depth + 1);
    }
}


typedef struct {
    tj_names_t  *from, *to;
    const char  *key;
    int          assign;    /* collect set targets, else for targets */
    int          changed;
    int          bad;       /* a matching target that is no plain name */
    int          first;     /* stop at the first matching loop */
    int          found;
} tj_fmt_t;


/*
 * vLLM asserts that each target it follows is a plain name ({% set ns.x
 * = messages %}, {% for a, b in messages %} are not) and falls back to
 * the "string" format when the assertion fails: every {% set %} from a
 * messages name and every loop over one are checked, and of the loops
 * over a message's content the first (in document order), where its
 * search stops.
 */
static void
tj_fmt_visit(const tj_node_t *nd, void *data)
{
    tj_fmt_t  *f = data;
    size_t     i;

    if (f->assign && nd->kind == TN_SET) {
        for (i = 0; i < f->from->n; i++) {
            if (!tj_is_var_or_elems(nd->b, f->from->names[i], NULL)) {
                continue;
            }
            if (nd->a->kind != TN_NAME) {
                f->bad = 1;
                break;
            }
            if (!tj_names_has(f->to, nd->a->v)) {
                tj_names_add(f->to, nd->a->v);
                f->changed = 1;
            }
        }
    }
    if (!f->assign && nd->kind == TN_FOR && !f->found) {
        for (i = 0; i < f->from->n; i++) {
            if (tj_is_var_or_elems(nd->b, f->from->names[i], f->key)) {
                if (nd->a->kind != TN_NAME) {
                    f->bad = 1;
                } else {
                    tj_names_add(f->to, nd->a->v);
                }
                f->found = f->first;
                break;
            }
        }
    }
}


static int
tj_detect_openai(const tj_node_t *body)
{
    tj_names_t  msgs = { .n = 0 }, items = { .n = 0 }, parts = { .n = 0 };
    tj_fmt_t    f;

    tj_names_add(&msgs, tj_cstr("messages"));
    do {
        f = (tj_fmt_t) { &msgs, &msgs, NULL, 1, 0, 0, 0, 0 };
        tj_walk(body, tj_fmt_visit, &f, 0);
        if (f.bad) {
            return 0;
        }
    } while (f.changed);
    f = (tj_fmt_t) { &msgs, &items, NULL, 0, 0, 0, 0, 0 };
    tj_walk(body, tj_fmt_visit, &f, 0);
    if (f.bad) {
        return 0;
    }
    f = (tj_fmt_t) { &items, &parts, "content", 0, 0, 0, 1, 0 };
    tj_walk(body, tj_fmt_visit, &f, 0);
    return !f.bad && parts.n > 0;
}


tj_template_t *
tj_compile(const char *src, size_t len, char *err, size_t errlen)
{
    tj_template_t  *volatile t;
    tj_arena_t      a = { NULL, 0, 0 };
    tj_tokens_t     toks = { NULL, 0, 0 };
    tj_ps_t         p;
    int             which;

    if (len >= TJ_STR_MAX) {
        tok_err(err, errlen, "chat template: too large");
        return NULL;
    }
    t = calloc(1, sizeof(*t));
    if (t == NULL) {
        tok_err(err, errlen, "chat template: out of memory");
        return NULL;
    }
    if (tj_lex(&a, src, len, &toks, err, errlen) != 0) {
        tj_arena_free(&a);
        free(t);
        return NULL;
    }
    memset(&p, 0, sizeof(p));
    p.a = &a;
    p.t = toks.t;
    p.n = toks.n;
    p.err = err;
    p.errlen = errlen;
    if (setjmp(p.jb) != 0) {
        free(p.local);
        free(p.syms);
        free(p.symn);
        free(p.symid);
        tj_arena_free(&a);
        free(t);
        return NULL;
    }
    t->body = tj_body(&p, NULL, &which);
    t->openai = tj_detect_openai(t->body);
    t->nsym = p.nsym;
    t->local = tj_arena_alloc(&a, p.nsym + 1);
    if (t->local == NULL) {
        tok_err(err, errlen, "chat template: out of memory");
        free(p.local);
        free(p.syms);
        free(p.symn);
        free(p.symid);
        tj_arena_free(&a);
        free(t);
        return NULL;
    }
    memset(t->local, 0, p.nsym + 1);
    if (p.local) {
        memcpy(t->local, p.local, p.lcap < p.nsym ? p.lcap : p.nsym);
    }
    t->arena = a;
    free(p.local);
    free(p.syms);
    free(p.symn);
    free(p.symid);
    return t;
}


void
tj_template_free(tj_template_t *t)
{
    if (t) {
        tj_arena_free(&t->arena);
        free(t);
    }
}
