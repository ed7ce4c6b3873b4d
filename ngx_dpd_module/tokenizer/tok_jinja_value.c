/*
 * Template values: the arena they live in, constructors, lists and
 * insertion-ordered dicts, cJSON and JSON text in, json.dumps and Python's
 * str()/repr() out.
 */

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <cjson/cJSON.h>
#include <utf8proc.h>

#include "tok_internal.h"
#include "tok_jinja.h"


struct tj_blk_s {
    tj_blk_t   *next;
    size_t      used, cap;
    max_align_t data[];
};

#define TJ_BLK_MIN  (16 * 1024)


/*
 * A first block kept by each thread between arenas: a request's arena
 * (its preparation and render) mostly fits one, and its malloc() and
 * free() cost more than the preparation of a short chat's variables.  A
 * thread that ends frees its own (a key's destructor: no leak reported
 * for a pool's thread).
 */
static __thread tj_blk_t  *tj_blk_kept;
static __thread int        tj_blk_reg;      /* 1 keys, -1 none (no keep) */
static pthread_key_t       tj_blk_key;
static pthread_once_t      tj_blk_once = PTHREAD_ONCE_INIT;
static int                 tj_blk_key_ok;

/* under AddressSanitizer every block goes back: a use after the free
 * stays visible */
#if defined(__SANITIZE_ADDRESS__)
#define TJ_BLK_KEEP  0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TJ_BLK_KEEP  0
#endif
#endif
#ifndef TJ_BLK_KEEP
#define TJ_BLK_KEEP  1
#endif


void *
tj_arena_alloc(tj_arena_t *a, size_t n)
{
    tj_blk_t  *b = a->head;
    size_t     cap;
    void      *p;

    n = (n + 15) & ~(size_t) 15;
    if (b == NULL || b->cap - b->used < n) {
        cap = n > TJ_BLK_MIN / 2 ? n : TJ_BLK_MIN;
        if (b && b->cap * 2 > cap && b->cap < 1024 * 1024) {
            cap = b->cap * 2 > n ? b->cap * 2 : cap;
        }
        if (a->limit && a->total + cap > a->limit) {
            return NULL;
        }
        if (TJ_BLK_KEEP && cap == TJ_BLK_MIN && tj_blk_kept != NULL) {
            b = tj_blk_kept;
            tj_blk_kept = NULL;
        } else {
            b = malloc(sizeof(tj_blk_t) + cap);
        }
        if (b == NULL) {
            return NULL;
        }
        b->next = a->head;
        b->used = 0;
        b->cap = cap;
        a->head = b;
        a->total += cap;
    }
    p = (char *) b->data + b->used;
    b->used += n;
    return p;
}


static void
tj_blk_key_free(void *unused)
{
    free(tj_blk_kept);
    tj_blk_kept = NULL;
}


static void
tj_blk_key_init(void)
{
    tj_blk_key_ok = (pthread_key_create(&tj_blk_key, tj_blk_key_free) == 0);
}


/* 1: this thread may keep a block (its destructor is registered) */
static int
tj_blk_may_keep(void)
{
    if (tj_blk_reg == 0) {
        tj_blk_reg = -1;
        if (pthread_once(&tj_blk_once, tj_blk_key_init) == 0
            && tj_blk_key_ok
            && pthread_setspecific(tj_blk_key, &tj_blk_reg) == 0)
        {
            tj_blk_reg = 1;
        }
    }
    return tj_blk_reg == 1;
}


void
tj_arena_free(tj_arena_t *a)
{
    tj_blk_t  *b, *next;

    for (b = a->head; b; b = next) {
        next = b->next;
        if (TJ_BLK_KEEP && b->cap == TJ_BLK_MIN && tj_blk_kept == NULL
            && tj_blk_may_keep())
        {
            tj_blk_kept = b;
        } else {
            free(b);
        }
    }
    a->head = NULL;
    a->total = 0;
}


_Noreturn void
tj_fail(tj_ctx_t *c, const char *fmt, ...)
{
    va_list  ap;

    if (c->err && c->errlen) {
        va_start(ap, fmt);
        vsnprintf(c->err, c->errlen, fmt, ap);
        va_end(ap);
    }
    longjmp(c->jb, 1);
}


void *
tj_alloc(tj_ctx_t *c, size_t n)
{
    void  *p = tj_arena_alloc(&c->arena, n);

    if (p == NULL) {
        tj_fail(c, "chat template: out of memory (limit %zu bytes)",
                c->lim.max_memory);
    }
    return p;
}


int
tj_buf_add(tj_buf_t *b, const char *s, size_t n)
{
    size_t   cap;
    char    *p;

    if (b->oom || b->over) {
        return -1;
    }
    if (b->max && b->len + n > b->max) {
        b->over = 1;
        return -1;
    }
    if (b->len + n + 1 > b->cap) {
        cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) {
            cap *= 2;
        }
        if (b->a) {
            p = tj_arena_alloc(b->a, cap);
            if (p && b->len) {
                memcpy(p, b->p, b->len);
            }
        } else {
            p = realloc(b->p, cap);
        }
        if (p == NULL) {
            b->oom = 1;
            return -1;
        }
        b->p = p;
        b->cap = cap;
    }
    if (n) {
        memcpy(b->p + b->len, s, n);
    }
    b->len += n;
    b->p[b->len] = '\0';
    return 0;
}


/* ---- constructors */

tj_val_t
tj_undef(const char *name, size_t n)
{
    tj_val_t  v = { 0 };

    v.t = TJ_UNDEF;
    v.u.s = name;
    v.n = n;
    return v;
}


tj_val_t
tj_none(void)
{
    tj_val_t  v = { 0 };

    v.t = TJ_NONE;
    return v;
}


tj_val_t
tj_float(double f)
{
    tj_val_t  v = { 0 };

    v.t = TJ_FLOAT;
    v.u.f = f;
    return v;
}


tj_val_t
tj_str(const char *s, size_t n)
{
    tj_val_t  v = { 0 };

    v.t = TJ_STR;
    v.u.s = s;
    v.n = n;
    return v;
}


tj_val_t
tj_cstr(const char *s)
{
    return tj_str(s, strlen(s));
}


tj_val_t
tj_str_copy(tj_ctx_t *c, const char *s, size_t n)
{
    char  *p = tj_alloc(c, n + 1);

    if (n) {
        memcpy(p, s, n);
    }
    p[n] = '\0';
    return tj_str(p, n);
}


tj_list_t *
tj_a_list(tj_arena_t *a)
{
    tj_list_t  *l = tj_arena_alloc(a, sizeof(*l));

    if (l) {
        memset(l, 0, sizeof(*l));
    }
    return l;
}


tj_dict_t *
tj_a_dict(tj_arena_t *a)
{
    /* room for 4 pairs in the same allocation (a message's keys) */
    return tj_a_dict_cap(a, 4);
}


tj_dict_t *
tj_a_dict_cap(tj_arena_t *a, size_t cap)
{
    tj_dict_t  *d = tj_arena_alloc(a, sizeof(*d) + cap * sizeof(tj_pair_t));

    if (d) {
        memset(d, 0, sizeof(*d));
        d->p = (tj_pair_t *) (d + 1);
        d->cap = cap;
    }
    return d;
}


tj_val_t
tj_new_list(tj_ctx_t *c, size_t cap)
{
    tj_val_t  v = { 0 };

    v.t = TJ_LIST;
    v.u.l = tj_alloc(c, sizeof(tj_list_t));
    memset(v.u.l, 0, sizeof(tj_list_t));
    if (cap) {
        v.u.l->v = tj_alloc(c, cap * sizeof(tj_val_t));
        v.u.l->cap = cap;
    }
    return v;
}


tj_val_t
tj_new_dict(tj_ctx_t *c, size_t cap)
{
    tj_val_t  v = { 0 };

    v.t = TJ_DICT;
    v.u.d = tj_alloc(c, sizeof(tj_dict_t));
    memset(v.u.d, 0, sizeof(tj_dict_t));
    if (cap) {
        v.u.d->p = tj_alloc(c, cap * sizeof(tj_pair_t));
        v.u.d->cap = cap;
    }
    return v;
}


int
tj_a_list_push(tj_arena_t *a, tj_list_t *l, tj_val_t v)
{
    tj_val_t  *nv;
    size_t     cap;

    if (l->n == l->cap) {
        cap = l->cap ? l->cap * 2 : 4;
        nv = tj_arena_alloc(a, cap * sizeof(tj_val_t));
        if (nv == NULL) {
            return -1;
        }
        if (l->n) {
            memcpy(nv, l->v, l->n * sizeof(tj_val_t));
        }
        l->v = nv;
        l->cap = cap;
    }
    l->v[l->n++] = v;
    return 0;
}


/*
 * The names templates and the request preparation use most, interned: a
 * template's "message.role" and the prepared message's "role" key are then
 * the same pointer, found without comparing bytes.
 */
/* the names by length: one short list per lookup, no strlen() */
const char tj_k_role[] = "role";
const char tj_k_content[] = "content";
const char tj_k_name[] = "name";
const char tj_k_type[] = "type";
const char tj_k_text[] = "text";
const char tj_k_loop[] = "loop";
const char tj_k_tools[] = "tools";
const char tj_k_messages[] = "messages";
const char tj_k_function[] = "function";
const char tj_k_reasoning[] = "reasoning";
const char tj_k_documents[] = "documents";
const char tj_k_tool_calls[] = "tool_calls";
const char tj_k_tool_call_id[] = "tool_call_id";
const char tj_k_reasoning_content[] = "reasoning_content";
const char tj_k_add_generation_prompt[] = "add_generation_prompt";
const char tj_k_continue_final_message[] = "continue_final_message";

static const char *const tj_in2[] = { "ns", NULL };
static const char *const tj_in4[] = { tj_k_role, tj_k_name, tj_k_type,
    tj_k_text, "tool", tj_k_loop, "user", "last", NULL };
static const char *const tj_in5[] = { tj_k_tools, "index", "first", NULL };
static const char *const tj_in6[] = { "system", "index0", "length", NULL };
static const char *const tj_in7[] = { tj_k_content, "message", NULL };
static const char *const tj_in8[] = { tj_k_messages, tj_k_function,
    "thinking", NULL };
static const char *const tj_in9[] = { "tool_call", "arguments",
    tj_k_reasoning, tj_k_documents, "bos_token", "eos_token", "assistant",
    NULL };
static const char *const tj_in10[] = { tj_k_tool_calls, "parameters", NULL };
static const char *const tj_in11[] = { "description", NULL };
static const char *const tj_in12[] = { tj_k_tool_call_id, "content_type",
    NULL };
static const char *const tj_in15[] = { "enable_thinking", NULL };
static const char *const tj_in17[] = { tj_k_reasoning_content, NULL };
static const char *const tj_in21[] = { tj_k_add_generation_prompt, NULL };
static const char *const tj_in22[] = { tj_k_continue_final_message, NULL };

static const char *const *const tj_interned[23] = {
    NULL, NULL, tj_in2, NULL, tj_in4, tj_in5, tj_in6, tj_in7, tj_in8, tj_in9,
    tj_in10, tj_in11, tj_in12, NULL, NULL, tj_in15, NULL, tj_in17, NULL, NULL,
    NULL, tj_in21, tj_in22
};


const char *
tj_intern(const char *s, size_t n)
{
    const char *const  *p;
    size_t              i;

    if (n >= sizeof(tj_interned) / sizeof(tj_interned[0])
        || tj_interned[n] == NULL)
    {
        return s;
    }
    for (p = tj_interned[n]; *p; p++) {
        for (i = 0; i < n && (*p)[i] == s[i]; i++) { }
        if (i == n) {
            return *p;
        }
    }
    return s;
}


static inline int
tj_memeq(const char *a, const char *b, size_t n)
{
    size_t  i;

    if (n > 16) {
        return memcmp(a, b, n) == 0;
    }
    for (i = 0; i < n; i++) {
        if (a[i] != b[i]) {
            return 0;
        }
    }
    return 1;
}


tj_val_t *
tj_dict_get(const tj_dict_t *d, const char *k, size_t kn)
{
    size_t  i;

    for (i = 0; i < d->n; i++) {
        if (d->p[i].k == k
            || (d->p[i].kn == kn && tj_memeq(d->p[i].k, k, kn)))
        {
            return &d->p[i].v;
        }
    }
    return NULL;
}


/* Python dict semantics: a repeated key keeps its place, takes the value */
int
tj_a_dict_set(tj_arena_t *a, tj_dict_t *d, const char *k, size_t kn,
    tj_val_t v)
{
    tj_val_t   *old = tj_dict_get(d, k, kn);

    if (old) {
        *old = v;
        return 0;
    }
    return tj_a_dict_add(a, d, k, kn, v);
}


/* append a key the dict does not have */
int
tj_a_dict_add(tj_arena_t *a, tj_dict_t *d, const char *k, size_t kn,
    tj_val_t v)
{
    tj_pair_t  *np;
    size_t      cap;

    if (d->n == d->cap) {
        cap = d->cap ? d->cap * 2 : 4;
        np = tj_arena_alloc(a, cap * sizeof(tj_pair_t));
        if (np == NULL) {
            return -1;
        }
        if (d->n) {
            memcpy(np, d->p, d->n * sizeof(tj_pair_t));
        }
        d->p = np;
        d->cap = cap;
    }
    d->p[d->n].k = k;
    d->p[d->n].kn = kn;
    d->p[d->n].v = v;
    d->n++;
    return 0;
}


void
tj_list_push(tj_ctx_t *c, tj_list_t *l, tj_val_t v)
{
    if (tj_a_list_push(&c->arena, l, v) != 0) {
        tj_fail(c, "chat template: out of memory");
    }
}


void
tj_dict_set(tj_ctx_t *c, tj_dict_t *d, const char *k, size_t kn, tj_val_t v)
{
    if (tj_a_dict_set(&c->arena, d, k, kn, v) != 0) {
        tj_fail(c, "chat template: out of memory");
    }
}


/* ---- cJSON in */

int
tj_from_cjson(tj_arena_t *a, const cJSON *j, tj_val_t *v, unsigned depth)
{
    const cJSON  *e;
    tj_val_t      x;
    double        d;

    memset(v, 0, sizeof(*v));
    if (depth > 512) {
        return -1;
    }
    if (j == NULL || cJSON_IsNull(j)) {
        v->t = TJ_NONE;
    } else if (cJSON_IsTrue(j)) {
        *v = tj_bool(1);
    } else if (cJSON_IsFalse(j)) {
        *v = tj_bool(0);
    } else if (cJSON_IsString(j)) {
        if (strlen(j->valuestring) >= TJ_STR_MAX) {
            return -1;
        }
        *v = tj_cstr(j->valuestring);
    } else if (cJSON_IsNumber(j)) {
        /* cJSON keeps no source text: integral values are ints */
        d = j->valuedouble;
        if (d == floor(d) && d > -9007199254740992.0
            && d < 9007199254740992.0)
        {
            *v = tj_int((int64_t) d);
        } else {
            *v = tj_float(d);
        }
    } else if (cJSON_IsArray(j)) {
        v->t = TJ_LIST;
        if ((v->u.l = tj_a_list(a)) == NULL) {
            return -1;
        }
        cJSON_ArrayForEach(e, j) {
            if (tj_from_cjson(a, e, &x, depth + 1) != 0
                || tj_a_list_push(a, v->u.l, x) != 0)
            {
                return -1;
            }
        }
    } else if (cJSON_IsObject(j)) {
        v->t = TJ_DICT;
        if ((v->u.d = tj_a_dict(a)) == NULL) {
            return -1;
        }
        cJSON_ArrayForEach(e, j) {
            if (tj_from_cjson(a, e, &x, depth + 1) != 0
                || tj_a_dict_set(a, v->u.d, e->string, strlen(e->string), x)
                   != 0)
            {
                return -1;
            }
        }
    } else {
        v->t = TJ_NONE;
    }
    return 0;
}


/* ---- JSON text in, as Python's json.loads (NaN, Infinity, big ints as
 * floats, repeated keys: the last value at the first place) */

typedef struct {
    tj_arena_t  *a;
    const char  *p, *e;
    unsigned     depth;
} tj_jp_t;


static void
tj_jp_ws(tj_jp_t *j)
{
    while (j->p < j->e && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n'
                           || *j->p == '\r'))
    {
        j->p++;
    }
}


static int
tj_jp_hex4(const char *p, uint32_t *out)
{
    uint32_t  v = 0;
    int       i;

    for (i = 0; i < 4; i++) {
        char c = p[i];
        v <<= 4;
        if (c >= '0' && c <= '9') {
            v |= (uint32_t) (c - '0');
        } else if (c >= 'a' && c <= 'f') {
            v |= (uint32_t) (c - 'a' + 10);
        } else if (c >= 'A' && c <= 'F') {
            v |= (uint32_t) (c - 'A' + 10);
        } else {
            return -1;
        }
    }
    *out = v;
    return 0;
}


static int
tj_jp_string(tj_jp_t *j, const char **s, size_t *n)
{
    const char  *q;
    char        *out;
    size_t       o = 0;
    uint32_t     cp, lo;

    j->p++;     /* the quote */
    for (q = j->p; q < j->e && *q != '"' && *q != '\\'; q++) {
        if ((unsigned char) *q < 0x20) {
            return -1;
        }
    }
    if (q < j->e && *q == '"') {
        /* no escapes: reference the text */
        *s = j->p;
        *n = (size_t) (q - j->p);
        j->p = q + 1;
        return 0;
    }
    out = tj_arena_alloc(j->a, (size_t) (j->e - j->p) + 1);
    if (out == NULL) {
        return -1;
    }
    while (j->p < j->e && *j->p != '"') {
        unsigned char c = (unsigned char) *j->p;
        if (c < 0x20) {
            return -1;
        }
        if (c != '\\') {
            out[o++] = (char) c;
            j->p++;
            continue;
        }
        if (j->p + 1 >= j->e) {
            return -1;
        }
        j->p++;
        switch (*j->p) {
        case '"': out[o++] = '"'; break;
        case '\\': out[o++] = '\\'; break;
        case '/': out[o++] = '/'; break;
        case 'b': out[o++] = '\b'; break;
        case 'f': out[o++] = '\f'; break;
        case 'n': out[o++] = '\n'; break;
        case 'r': out[o++] = '\r'; break;
        case 't': out[o++] = '\t'; break;
        case 'u':
            if (j->e - j->p < 5 || tj_jp_hex4(j->p + 1, &cp) != 0) {
                return -1;
            }
            j->p += 4;
            if (cp >= 0xD800 && cp <= 0xDBFF && j->e - j->p >= 7
                && j->p[1] == '\\' && j->p[2] == 'u'
                && tj_jp_hex4(j->p + 3, &lo) == 0
                && lo >= 0xDC00 && lo <= 0xDFFF)
            {
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                j->p += 6;
            }
            /* a lone surrogate: U+FFFD (the prompt is UTF-8 text) */
            if (cp >= 0xD800 && cp <= 0xDFFF) {
                cp = 0xFFFD;
            }
            o += tok_utf8_encode(cp, out + o);
            break;
        default:
            return -1;
        }
        j->p++;
    }
    if (j->p >= j->e) {
        return -1;
    }
    j->p++;
    out[o] = '\0';
    *s = out;
    *n = o;
    return 0;
}


static int tj_jp_value(tj_jp_t *j, tj_val_t *v);


static int
tj_jp_number(tj_jp_t *j, tj_val_t *v)
{
    const char  *s = j->p;
    char         tmp[128];
    int          isfloat = 0;
    size_t       n;

    if (j->p < j->e && *j->p == '-') {
        j->p++;
    }
    if (j->p < j->e && *j->p == '0') {
        j->p++;
    } else if (j->p < j->e && *j->p >= '1' && *j->p <= '9') {
        while (j->p < j->e && *j->p >= '0' && *j->p <= '9') {
            j->p++;
        }
    } else {
        return -1;
    }
    if (j->p < j->e && *j->p == '.') {
        isfloat = 1;
        j->p++;
        if (j->p >= j->e || *j->p < '0' || *j->p > '9') {
            return -1;
        }
        while (j->p < j->e && *j->p >= '0' && *j->p <= '9') {
            j->p++;
        }
    }
    if (j->p < j->e && (*j->p == 'e' || *j->p == 'E')) {
        isfloat = 1;
        j->p++;
        if (j->p < j->e && (*j->p == '+' || *j->p == '-')) {
            j->p++;
        }
        if (j->p >= j->e || *j->p < '0' || *j->p > '9') {
            return -1;
        }
        while (j->p < j->e && *j->p >= '0' && *j->p <= '9') {
            j->p++;
        }
    }
    n = (size_t) (j->p - s);
    if (n >= sizeof(tmp)) {
        isfloat = 1;
        n = sizeof(tmp) - 1;
    }
    memcpy(tmp, s, n);
    tmp[n] = '\0';
    if (!isfloat) {
        long long ll;
        errno = 0;
        ll = strtoll(tmp, NULL, 10);
        if (errno == 0) {
            *v = tj_int(ll);
            return 0;
        }
        /* beyond 64 bits: Python keeps the int, we keep its value */
    }
    *v = tj_float(strtod(tmp, NULL));
    return 0;
}


static int
tj_jp_lit(tj_jp_t *j, const char *w, size_t n)
{
    if ((size_t) (j->e - j->p) >= n && memcmp(j->p, w, n) == 0) {
        j->p += n;
        return 1;
    }
    return 0;
}


static int
tj_jp_value(tj_jp_t *j, tj_val_t *v)
{
    const char  *k;
    size_t       kn;
    tj_val_t     x;

    memset(v, 0, sizeof(*v));
    if (++j->depth > 256) {
        return -1;
    }
    tj_jp_ws(j);
    if (j->p >= j->e) {
        return -1;
    }
    switch (*j->p) {
    case '{':
        j->p++;
        v->t = TJ_DICT;
        if ((v->u.d = tj_a_dict(j->a)) == NULL) {
            return -1;
        }
        tj_jp_ws(j);
        if (j->p < j->e && *j->p == '}') {
            j->p++;
            break;
        }
        for ( ;; ) {
            tj_jp_ws(j);
            if (j->p >= j->e || *j->p != '"' || tj_jp_string(j, &k, &kn)) {
                return -1;
            }
            tj_jp_ws(j);
            if (j->p >= j->e || *j->p != ':') {
                return -1;
            }
            j->p++;
            if (tj_jp_value(j, &x) != 0
                || tj_a_dict_set(j->a, v->u.d, k, kn, x) != 0)
            {
                return -1;
            }
            tj_jp_ws(j);
            if (j->p < j->e && *j->p == ',') {
                j->p++;
                continue;
            }
            if (j->p < j->e && *j->p == '}') {
                j->p++;
                break;
            }
            return -1;
        }
        break;
    case '[':
        j->p++;
        v->t = TJ_LIST;
        if ((v->u.l = tj_a_list(j->a)) == NULL) {
            return -1;
        }
        tj_jp_ws(j);
        if (j->p < j->e && *j->p == ']') {
            j->p++;
            break;
        }
        for ( ;; ) {
            if (tj_jp_value(j, &x) != 0
                || tj_a_list_push(j->a, v->u.l, x) != 0)
            {
                return -1;
            }
            tj_jp_ws(j);
            if (j->p < j->e && *j->p == ',') {
                j->p++;
                continue;
            }
            if (j->p < j->e && *j->p == ']') {
                j->p++;
                break;
            }
            return -1;
        }
        break;
    case '"':
        if (tj_jp_string(j, &k, &kn) != 0) {
            return -1;
        }
        *v = tj_str(k, kn);
        break;
    default:
        if (tj_jp_lit(j, "true", 4)) {
            *v = tj_bool(1);
        } else if (tj_jp_lit(j, "false", 5)) {
            *v = tj_bool(0);
        } else if (tj_jp_lit(j, "null", 4)) {
            *v = tj_none();
        } else if (tj_jp_lit(j, "NaN", 3)) {
            *v = tj_float(NAN);
        } else if (tj_jp_lit(j, "Infinity", 8)) {
            *v = tj_float(INFINITY);
        } else if (tj_jp_lit(j, "-Infinity", 9)) {
            *v = tj_float(-INFINITY);
        } else if (tj_jp_number(j, v) != 0) {
            return -1;
        }
    }
    j->depth--;
    return 0;
}


int
tj_json_loads(tj_arena_t *a, const char *s, size_t n, tj_val_t *v)
{
    tj_jp_t  j = { a, s, s + n, 0 };

    if (tj_jp_value(&j, v) != 0) {
        return -1;
    }
    tj_jp_ws(&j);
    return j.p == j.e ? 0 : -1;
}


/* ---- numbers as Python prints them */

static size_t
tj_float_repr(double f, char *out, size_t cap)
{
    int      prec;
    size_t   n;
    char    *e;

    if (isnan(f)) {
        return (size_t) snprintf(out, cap, "nan");
    }
    if (isinf(f)) {
        return (size_t) snprintf(out, cap, f < 0 ? "-inf" : "inf");
    }
    for (prec = 1; prec <= 17; prec++) {
        snprintf(out, cap, "%.*g", prec, f);
        if (strtod(out, NULL) == f) {
            break;
        }
    }
    /* Python's repr: exponent when exp < -4 or >= 16, "e-05" style */
    {
        int exp10 = f == 0 ? 0 : (int) floor(log10(fabs(f)));
        char digits[32];
        if (exp10 >= -4 && exp10 < 16) {
            snprintf(out, cap, "%.*f", prec - 1 - exp10 > 0 ? prec - 1 - exp10
                     : 0, f);
            if (strchr(out, '.') == NULL) {
                n = strlen(out);
                snprintf(out + n, cap - n, ".0");
            }
            return strlen(out);
        }
        snprintf(digits, sizeof(digits), "%.*e", prec - 1, f);
        e = strchr(digits, 'e');
        if (e) {
            int ex = atoi(e + 1);
            *e = '\0';
            return (size_t) snprintf(out, cap, "%se%c%02d", digits,
                                     ex < 0 ? '-' : '+', ex < 0 ? -ex : ex);
        }
        return (size_t) snprintf(out, cap, "%s", digits);
    }
}


/* ---- json.dumps(ensure_ascii=False) */

static void
tj_bput(tj_ctx_t *c, tj_buf_t *b, const char *s, size_t n)
{
    if (tj_buf_add(b, s, n) != 0) {
        if (b->over) {
            tj_fail(c, "chat template: the prompt exceeds %zu bytes", b->max);
        }
        tj_fail(c, "chat template: out of memory");
    }
}


static void
tj_json_string(tj_ctx_t *c, tj_buf_t *b, const char *s, size_t n)
{
    char         tmp[8];
    const char  *run = s, *end = s + n;

    tj_bput(c, b, "\"", 1);
    for ( ; s < end; s++) {
        unsigned char ch = (unsigned char) *s;
        const char *esc = NULL;
        if (ch >= 0x20 && ch != '"' && ch != '\\') {
            continue;
        }
        tj_bput(c, b, run, (size_t) (s - run));
        switch (ch) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        default:
            snprintf(tmp, sizeof(tmp), "\\u%04x", ch);
            esc = tmp;
        }
        tj_bput(c, b, esc, strlen(esc));
        run = s + 1;
    }
    tj_bput(c, b, run, (size_t) (end - run));
    tj_bput(c, b, "\"", 1);
}


static void
tj_json_nl(tj_ctx_t *c, tj_buf_t *b, long indent, const char *is, size_t in,
    unsigned level)
{
    unsigned  i;
    long      k;

    tj_bput(c, b, "\n", 1);
    for (i = 0; i < level; i++) {
        if (is) {
            tj_bput(c, b, is, in);
        } else {
            for (k = 0; k < indent; k++) {
                tj_bput(c, b, " ", 1);
            }
        }
    }
}


void
tj_tojson(tj_ctx_t *c, tj_buf_t *b, tj_val_t v, long indent,
    const char *is, size_t in, unsigned level)
{
    char    num[64];
    size_t  i, n;
    int     pretty = indent >= 0 || is != NULL;

    if (level > 512) {
        tj_fail(c, "chat template: tojson: nesting too deep");
    }
    switch (v.t) {
    case TJ_UNDEF:
        tj_fail(c, "chat template: tojson: '%.*s' is undefined (Object of "
                "type Undefined is not JSON serializable)", (int) v.n,
                v.u.s ? v.u.s : "");
    case TJ_NONE:
        tj_bput(c, b, "null", 4);
        break;
    case TJ_BOOL:
        tj_bput(c, b, v.u.i ? "true" : "false", v.u.i ? 4 : 5);
        break;
    case TJ_INT:
        n = (size_t) snprintf(num, sizeof(num), "%lld", (long long) v.u.i);
        tj_bput(c, b, num, n);
        break;
    case TJ_FLOAT:
        if (isnan(v.u.f)) {
            tj_bput(c, b, "NaN", 3);
        } else if (isinf(v.u.f)) {
            tj_bput(c, b, v.u.f < 0 ? "-Infinity" : "Infinity",
                    v.u.f < 0 ? 9 : 8);
        } else {
            n = tj_float_repr(v.u.f, num, sizeof(num));
            tj_bput(c, b, num, n);
        }
        break;
    case TJ_STR:
        tj_json_string(c, b, v.u.s, v.n);
        break;
    case TJ_LIST:
        if (v.u.l->n == 0) {
            tj_bput(c, b, "[]", 2);
            break;
        }
        tj_bput(c, b, "[", 1);
        for (i = 0; i < v.u.l->n; i++) {
            if (i) {
                tj_bput(c, b, pretty ? "," : ", ", pretty ? 1 : 2);
            }
            if (pretty) {
                tj_json_nl(c, b, indent, is, in, level + 1);
            }
            tj_tojson(c, b, v.u.l->v[i], indent, is, in, level + 1);
        }
        if (pretty) {
            tj_json_nl(c, b, indent, is, in, level);
        }
        tj_bput(c, b, "]", 1);
        break;
    case TJ_DICT:
        if (v.u.d->n == 0) {
            tj_bput(c, b, "{}", 2);
            break;
        }
        tj_bput(c, b, "{", 1);
        for (i = 0; i < v.u.d->n; i++) {
            if (i) {
                tj_bput(c, b, pretty ? "," : ", ", pretty ? 1 : 2);
            }
            if (pretty) {
                tj_json_nl(c, b, indent, is, in, level + 1);
            }
            tj_json_string(c, b, v.u.d->p[i].k, v.u.d->p[i].kn);
            tj_bput(c, b, ": ", 2);
            tj_tojson(c, b, v.u.d->p[i].v, indent, is, in, level + 1);
        }
        if (pretty) {
            tj_json_nl(c, b, indent, is, in, level);
        }
        tj_bput(c, b, "}", 1);
        break;
    default:
        tj_fail(c, "chat template: tojson: Object of type %s is not JSON "
                "serializable", tj_type_name(v));
    }
}


/* ---- Python str() and repr() */

/* str.isprintable(): not Cc, Cf, Cs, Co, Cn, Zl, Zp, Zs (but ' ') */
static int
tj_printable(uint32_t cp)
{
    const utf8proc_property_t *pr = utf8proc_get_property((utf8proc_int32_t) cp);

    switch (pr->category) {
    case UTF8PROC_CATEGORY_CC: case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS: case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN: case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP: case UTF8PROC_CATEGORY_ZS:
        return cp == ' ';
    default:
        return 1;
    }
}

static void
tj_repr_string(tj_ctx_t *c, tj_buf_t *b, const char *s, size_t n)
{
    char         q = '\'', tmp[12];
    size_t       i, k;
    uint32_t     cp;

    if (memchr(s, '\'', n) && !memchr(s, '"', n)) {
        q = '"';
    }
    tj_bput(c, b, &q, 1);
    for (i = 0; i < n; i += k) {
        k = tj_utf8_next(s + i, n - i, &cp);
        if (cp == (uint32_t) q || cp == '\\') {
            tmp[0] = '\\';
            tmp[1] = (char) cp;
            tj_bput(c, b, tmp, 2);
        } else if (cp == '\n') {
            tj_bput(c, b, "\\n", 2);
        } else if (cp == '\r') {
            tj_bput(c, b, "\\r", 2);
        } else if (cp == '\t') {
            tj_bput(c, b, "\\t", 2);
        } else if (cp < 0x20 || cp == 0x7f || (cp >= 0x80 && !tj_printable(cp))) {
            if (cp < 0x100) {
                snprintf(tmp, sizeof(tmp), "\\x%02x", cp);
            } else if (cp < 0x10000) {
                snprintf(tmp, sizeof(tmp), "\\u%04x", cp);
            } else {
                snprintf(tmp, sizeof(tmp), "\\U%08x", cp);
            }
            tj_bput(c, b, tmp, strlen(tmp));
        } else {
            tj_bput(c, b, s + i, k);
        }
    }
    tj_bput(c, b, &q, 1);
}


void
tj_repr(tj_ctx_t *c, tj_buf_t *b, tj_val_t v)
{
    size_t  i;

    if (c->depth > c->lim.max_depth + 512) {
        tj_fail(c, "chat template: value nesting too deep");
    }
    switch (v.t) {
    case TJ_STR:
        tj_repr_string(c, b, v.u.s, v.n);
        break;
    case TJ_LIST:
        tj_bput(c, b, v.u.l->tuple ? "(" : "[", 1);
        c->depth++;
        for (i = 0; i < v.u.l->n; i++) {
            if (i) {
                tj_bput(c, b, ", ", 2);
            }
            tj_repr(c, b, v.u.l->v[i]);
        }
        c->depth--;
        if (v.u.l->tuple && v.u.l->n == 1) {
            tj_bput(c, b, ",", 1);
        }
        tj_bput(c, b, v.u.l->tuple ? ")" : "]", 1);
        break;
    case TJ_DICT:
        if (v.u.d->ns) {
            tj_bput(c, b, "<Namespace ", 11);
        }
        tj_bput(c, b, "{", 1);
        c->depth++;
        for (i = 0; i < v.u.d->n; i++) {
            if (i) {
                tj_bput(c, b, ", ", 2);
            }
            tj_repr_string(c, b, v.u.d->p[i].k, v.u.d->p[i].kn);
            tj_bput(c, b, ": ", 2);
            tj_repr(c, b, v.u.d->p[i].v);
        }
        c->depth--;
        tj_bput(c, b, "}", 1);
        if (v.u.d->ns) {
            tj_bput(c, b, ">", 1);
        }
        break;
    default:
        tj_str_of(c, b, v);
    }
}


void
tj_str_of(tj_ctx_t *c, tj_buf_t *b, tj_val_t v)
{
    char    num[64];
    size_t  n;

    switch (v.t) {
    case TJ_UNDEF:
        break;
    case TJ_NONE:
        tj_bput(c, b, "None", 4);
        break;
    case TJ_BOOL:
        tj_bput(c, b, v.u.i ? "True" : "False", v.u.i ? 4 : 5);
        break;
    case TJ_INT:
        n = (size_t) snprintf(num, sizeof(num), "%lld", (long long) v.u.i);
        tj_bput(c, b, num, n);
        break;
    case TJ_FLOAT:
        n = tj_float_repr(v.u.f, num, sizeof(num));
        tj_bput(c, b, num, n);
        break;
    case TJ_STR:
        tj_bput(c, b, v.u.s, v.n);
        break;
    case TJ_LIST:
    case TJ_DICT:
        tj_repr(c, b, v);
        break;
    case TJ_LOOP:
        tj_bput(c, b, "<LoopContext>", 13);
        break;
    case TJ_MACRO:
        tj_bput(c, b, "<Macro>", 7);
        break;
    default:
        tj_bput(c, b, "<function>", 10);
    }
}


/* str(v) as a string value (strings as they are) */
tj_val_t
tj_to_str(tj_ctx_t *c, tj_val_t v)
{
    tj_buf_t  b = { 0 };
    tj_val_t  r;

    if (v.t == TJ_STR) {
        return v;
    }
    if (v.t == TJ_UNDEF) {
        return tj_str("", 0);
    }
    b.max = c->lim.max_output;
    {
        char buf[64];
        if (v.t == TJ_INT) {
            size_t n = (size_t) snprintf(buf, sizeof(buf), "%lld",
                                         (long long) v.u.i);
            return tj_str_copy(c, buf, n);
        }
        if (v.t == TJ_FLOAT) {
            size_t n = tj_float_repr(v.u.f, buf, sizeof(buf));
            return tj_str_copy(c, buf, n);
        }
        if (v.t == TJ_NONE) {
            return tj_str("None", 4);
        }
        if (v.t == TJ_BOOL) {
            return v.u.i ? tj_str("True", 4) : tj_str("False", 5);
        }
    }
    /* containers: repr() into the arena */
    b.a = &c->arena;
    tj_repr(c, &b, v);
    r = tj_str(b.p ? b.p : "", b.len);
    return r;
}


int
tj_truthy_any(tj_val_t v)
{
    switch (v.t) {
    case TJ_UNDEF:
    case TJ_NONE:
        return 0;
    case TJ_BOOL:
    case TJ_INT:
        return v.u.i != 0;
    case TJ_FLOAT:
        return v.u.f != 0.0;
    case TJ_STR:
        return v.n != 0;
    case TJ_LIST:
        return v.u.l->n != 0;
    case TJ_DICT:
        return v.u.d->ns || v.u.d->n != 0;
    default:
        return 1;
    }
}


static int
tj_is_num(tj_val_t v)
{
    return v.t == TJ_BOOL || v.t == TJ_INT || v.t == TJ_FLOAT;
}


int
tj_equal(tj_val_t a, tj_val_t b)
{
    size_t     i;
    tj_val_t  *x;

    if (tj_is_num(a) && tj_is_num(b)) {
        if (a.t == TJ_FLOAT || b.t == TJ_FLOAT) {
            double fa = a.t == TJ_FLOAT ? a.u.f : (double) a.u.i;
            double fb = b.t == TJ_FLOAT ? b.u.f : (double) b.u.i;
            return fa == fb;
        }
        return a.u.i == b.u.i;
    }
    if (a.t != b.t) {
        return 0;
    }
    switch (a.t) {
    case TJ_UNDEF:
    case TJ_NONE:
        return 1;
    case TJ_STR:
        return a.n == b.n && (a.u.s == b.u.s || tj_memeq(a.u.s, b.u.s, a.n));
    case TJ_LIST:
        if (a.u.l->n != b.u.l->n) {
            return 0;
        }
        for (i = 0; i < a.u.l->n; i++) {
            if (!tj_equal(a.u.l->v[i], b.u.l->v[i])) {
                return 0;
            }
        }
        return 1;
    case TJ_DICT:
        if (a.u.d == b.u.d) {
            return 1;
        }
        if (a.u.d->ns || b.u.d->ns || a.u.d->n != b.u.d->n) {
            return 0;
        }
        for (i = 0; i < a.u.d->n; i++) {
            x = tj_dict_get(b.u.d, a.u.d->p[i].k, a.u.d->p[i].kn);
            if (x == NULL || !tj_equal(a.u.d->p[i].v, *x)) {
                return 0;
            }
        }
        return 1;
    default:
        return a.u.p == b.u.p && a.aux == b.aux;
    }
}


const char *
tj_type_name(tj_val_t v)
{
    switch (v.t) {
    case TJ_UNDEF: return "Undefined";
    case TJ_NONE: return "NoneType";
    case TJ_BOOL: return "bool";
    case TJ_INT: return "int";
    case TJ_FLOAT: return "float";
    case TJ_STR: return "str";
    case TJ_LIST: return v.u.l->tuple ? "tuple" : "list";
    case TJ_DICT: return v.u.d->ns ? "Namespace" : "dict";
    case TJ_LOOP: return "LoopContext";
    case TJ_MACRO: return "Macro";
    default: return "function";
    }
}


/* ---- UTF-8 and Python's whitespace */

int
tj_py_space(uint32_t cp)
{
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20)
           || cp == 0x85 || cp == 0xA0 || cp == 0x1680
           || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029
           || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}


size_t
tj_utf8_next(const char *s, size_t n, uint32_t *cp)
{
    size_t  k;

    if (n == 0) {
        *cp = 0;
        return 0;
    }
    if ((unsigned char) s[0] < 0x80) {
        *cp = (unsigned char) s[0];
        return 1;
    }
    k = tok_utf8_decode(s, n, cp);
    return k ? k : 1;
}


size_t
tj_utf8_count(const char *s, size_t n)
{
    size_t    i, c = 0;
    uint32_t  cp;

    /*
     * the code points tj_utf8_next() steps over, one by one: in invalid
     * UTF-8 a stray continuation byte is one (U+FFFD) too, so a count of
     * lead bytes would size a list shorter than the string's iteration
     */
    for (i = 0; i < n; c++) {
        i += ((unsigned char) s[i] < 0x80) ? 1 : tj_utf8_next(s + i, n - i,
                                                              &cp);
    }
    return c;
}
