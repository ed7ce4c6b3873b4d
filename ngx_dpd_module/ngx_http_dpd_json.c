/*
 * The cJSON trees of the request body and of the prefill replies, built
 * without cJSON's parser: the same nodes, strings, verdicts and error
 * positions as libcjson's cJSON_ParseWithLengthOpts(data, len, &end, 0)
 * (Debian 12's 1.7.15 with its CVE-2023-26819 fix: a number is read
 * whole, at any length), at a fraction of its cost.  cJSON finds a string's end byte by byte, then
 * copies it byte by byte; here memchr() finds the closing quote and the
 * escapes and memcpy() moves the runs between them, and small integers
 * skip strtod().
 *
 * What is mirrored, and why it matters (the error message names a byte):
 * any byte <= 0x20 is white space; white space that runs to the end of
 * the input leaves the position on its last byte; a failed string leaves
 * it on the escape that failed, or one past the opening quote; a lone or
 * reversed UTF-16 surrogate fails; at most CJSON_NESTING_LIMIT arrays and
 * objects nest; a BOM is skipped when at least 5 bytes are given.
 * ngx_dpd_module/fuzz/dpd_fuzz_json.c (libFuzzer, and t/216-json-builder.t)
 * compares both parsers on each input.
 */

#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <limits.h>
#include <locale.h>

#include "ngx_http_dpd_json.h"


/* _parse_in(): the block carved into nodes and short strings */
#define DPD_JSON_BLOCK  4000

/* a string longer than this: an allocation of its own (bounds the waste) */
#define DPD_JSON_SHORT  256

#define DPD_JSON_ONES   0x0101010101010101ULL


typedef struct {
    const unsigned char  *data;
    size_t                len;
    size_t                off;
    size_t                depth;
    unsigned char         point;    /* the locale's decimal point, or 0 */

    /* _parse_in(): the caller's pool, else cJSON_malloc() */
    void               *(*alloc)(void *data, size_t size);
    void                 *alloc_data;
    unsigned char        *pos;      /* the free part of the block */
    unsigned char        *last;
} dpd_json_t;


static cJSON *dpd_json_run(dpd_json_t *b, const char *data, size_t len,
    const char **end);
static void *dpd_json_alloc(dpd_json_t *b, size_t size);
static void dpd_json_drop(dpd_json_t *b, cJSON *item);
static cJSON *dpd_json_item(dpd_json_t *b);
static void dpd_json_space(dpd_json_t *b);
static int dpd_json_value(dpd_json_t *b, cJSON *item);
static int dpd_json_string(dpd_json_t *b, cJSON *item);
static const unsigned char *dpd_json_short(const unsigned char *p);
static unsigned dpd_json_hex4(const unsigned char *p);
static size_t dpd_json_utf16(const unsigned char *p,
    const unsigned char *end, unsigned char **out);
static int dpd_json_number(dpd_json_t *b, cJSON *item);
static int dpd_json_array(dpd_json_t *b, cJSON *item);
static int dpd_json_object(dpd_json_t *b, cJSON *item);


/* the bytes cJSON copies into a number before strtod() */
static const unsigned char  dpd_json_num[256] = {
    ['0'] = 1, ['1'] = 1, ['2'] = 1, ['3'] = 1, ['4'] = 1,
    ['5'] = 1, ['6'] = 1, ['7'] = 1, ['8'] = 1, ['9'] = 1,
    ['+'] = 2, ['-'] = 2, ['e'] = 2, ['E'] = 2, ['.'] = 2
};

/* bytes strtod() never reads on from: it may then parse in place */
static const unsigned char  dpd_json_stop[256] = {
    [' '] = 1, ['\t'] = 1, ['\r'] = 1, ['\n'] = 1, [','] = 1, [']'] = 1,
    ['}'] = 1, [':'] = 1, ['"'] = 1, ['['] = 1, ['{'] = 1
};


cJSON *
ngx_http_dpd_json_parse(const char *data, size_t len, const char **end)
{
    return ngx_http_dpd_json_parse_in(data, len, end, NULL, NULL);
}


cJSON *
ngx_http_dpd_json_parse_in(const char *data, size_t len, const char **end,
    void *(*alloc)(void *data, size_t size), void *alloc_data)
{
    dpd_json_t  b;

    b.alloc = alloc;
    b.alloc_data = alloc_data;
    b.pos = NULL;
    b.last = NULL;

    return dpd_json_run(&b, data, len, end);
}


static cJSON *
dpd_json_run(dpd_json_t *b_, const char *data, size_t len, const char **end)
{
    cJSON       *root;
    dpd_json_t   b;

    b = *b_;
    b.data = (const unsigned char *) data;
    b.len = len;
    b.off = 0;
    b.depth = 0;
    b.point = 0;

    root = NULL;

    if (data == NULL) {
        return NULL;
    }

    if (len == 0) {
        goto fail;
    }

    root = dpd_json_item(&b);
    if (root == NULL) {
        goto fail;
    }

    if (len > 4 && memcmp(data, "\xEF\xBB\xBF", 3) == 0) {
        b.off = 3;
    }

    dpd_json_space(&b);

    if (!dpd_json_value(&b, root)) {
        goto fail;
    }

    if (end) {
        *end = data + b.off;
    }

    return root;

fail:

    if (root) {
        dpd_json_drop(&b, root);
    }

    if (end) {
        *end = data + (b.off < len ? b.off : (len ? len - 1 : 0));
    }

    return NULL;
}


/*
 * From the caller's pool: nodes and short strings carved from a block (a
 * call of alloc() for each would cost more than the parse of the value)
 */

static void *
dpd_json_alloc(dpd_json_t *b, size_t size)
{
    unsigned char  *p;

    if (b->alloc == NULL) {
        return cJSON_malloc(size);
    }

    if (size > DPD_JSON_SHORT) {
        return b->alloc(b->alloc_data, size);
    }

    size = (size + 7) & ~(size_t) 7;

    if ((size_t) (b->last - b->pos) < size) {
        p = b->alloc(b->alloc_data, DPD_JSON_BLOCK);
        if (p == NULL) {
            return NULL;
        }

        b->pos = p;
        b->last = p + DPD_JSON_BLOCK;
    }

    p = b->pos;
    b->pos += size;

    return p;
}


/* a failed part: the pool's memory goes back with the pool */

static void
dpd_json_drop(dpd_json_t *b, cJSON *item)
{
    if (b->alloc == NULL) {
        cJSON_Delete(item);
    }
}


static cJSON *
dpd_json_item(dpd_json_t *b)
{
    cJSON  *item;

    item = dpd_json_alloc(b, sizeof(cJSON));
    if (item) {
        memset(item, 0, sizeof(cJSON));
    }

    return item;
}


/* cJSON's buffer_skip_whitespace(), end quirk included */

static void
dpd_json_space(dpd_json_t *b)
{
    if (b->off >= b->len) {
        return;
    }

    while (b->off < b->len && b->data[b->off] <= 0x20) {
        b->off++;
    }

    if (b->off == b->len) {
        b->off--;
    }
}


static int
dpd_json_value(dpd_json_t *b, cJSON *item)
{
    size_t                rest;
    const unsigned char  *p;

    if (b->off >= b->len) {
        return 0;
    }

    p = b->data + b->off;
    rest = b->len - b->off;

    switch (p[0]) {

    case '"':
        return dpd_json_string(b, item);

    case '-':
    case '0': case '1': case '2': case '3': case '4':
    case '5': case '6': case '7': case '8': case '9':
        return dpd_json_number(b, item);

    case '[':
        return dpd_json_array(b, item);

    case '{':
        return dpd_json_object(b, item);

    case 'n':
        if (rest >= 4 && memcmp(p, "null", 4) == 0) {
            item->type = cJSON_NULL;
            b->off += 4;
            return 1;
        }

        return 0;

    case 'f':
        if (rest >= 5 && memcmp(p, "false", 5) == 0) {
            item->type = cJSON_False;
            b->off += 5;
            return 1;
        }

        return 0;

    case 't':
        if (rest >= 4 && memcmp(p, "true", 4) == 0) {
            item->type = cJSON_True;
            item->valueint = 1;
            b->off += 4;
            return 1;
        }

        return 0;
    }

    return 0;
}


/*
 * Two steps, as cJSON's: find the closing quote (a backslash takes the
 * byte after it along) and count the escapes, which sizes the string as
 * cJSON does; then copy the runs between escapes and decode those.
 */

static int
dpd_json_string(dpd_json_t *b, cJSON *item)
{
    size_t                skipped, n;
    unsigned char        *out, *o;
    const unsigned char  *s, *q, *dq, *bs, *lim;

    /* cJSON reports a failure before the copy one past the quote */

    if (b->off >= b->len || b->data[b->off] != '"') {
        b->off++;
        return 0;
    }

    s = b->data + b->off + 1;

    lim = b->data + b->len;
    q = s;
    dq = NULL;
    skipped = 0;

    /* a short string without escapes (keys, most values): found here */

    if (lim - s >= 16) {
        dq = dpd_json_short(s);

        if (dq && *dq == '"') {
            goto found;
        }

        dq = NULL;
    }

    for ( ;; ) {
        if (dq == NULL || dq < q) {
            dq = (q < lim) ? memchr(q, '"', lim - q) : NULL;

            if (dq == NULL) {
                b->off = s - b->data;
                return 0;
            }
        }

        bs = memchr(q, '\\', dq - q);
        if (bs == NULL) {
            break;
        }

        skipped++;
        q = bs + 2;
    }

found:

    out = dpd_json_alloc(b, (size_t) (dq - s) + 2 - skipped);
    if (out == NULL) {
        b->off = s - b->data;
        return 0;
    }

    if (skipped == 0) {
        n = dq - s;
        memcpy(out, s, n);
        out[n] = '\0';

    } else {
        o = out;
        q = s;

        while (q < dq) {
            bs = memchr(q, '\\', dq - q);
            if (bs == NULL) {
                memcpy(o, q, dq - q);
                o += dq - q;
                break;
            }

            memcpy(o, q, bs - q);
            o += bs - q;
            q = bs;

            switch (q[1]) {
            case 'b':
                *o++ = '\b';
                break;
            case 'f':
                *o++ = '\f';
                break;
            case 'n':
                *o++ = '\n';
                break;
            case 'r':
                *o++ = '\r';
                break;
            case 't':
                *o++ = '\t';
                break;
            case '"':
            case '\\':
            case '/':
                *o++ = q[1];
                break;

            case 'u':
                n = dpd_json_utf16(q, dq, &o);
                if (n == 0) {
                    goto fail;
                }

                q += n;
                continue;

            default:
                goto fail;
            }

            q += 2;
        }

        *o = '\0';
    }

    item->type = cJSON_String;
    item->valuestring = (char *) out;

    b->off = (size_t) (dq - b->data) + 1;

    return 1;

fail:

    if (b->alloc == NULL) {
        cJSON_free(out);
    }

    b->off = q - b->data;

    return 0;
}


/*
 * The first '"' or '\\' of the 16 bytes at p, NULL if none: two words
 * tested at once for both (the lowest byte a zero test flags is a zero:
 * a borrow only flags bytes above one), instead of two memchr() calls.
 */

static const unsigned char *
dpd_json_short(const unsigned char *p)
{
#if (defined(__GNUC__) && defined(__BYTE_ORDER__)                             \
     && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__)
    size_t    i;
    uint64_t  v, q, e, m;

    for (i = 0; i < 16; i += 8) {
        memcpy(&v, p + i, 8);

        q = v ^ (DPD_JSON_ONES * '"');
        e = v ^ (DPD_JSON_ONES * '\\');
        m = (((q - DPD_JSON_ONES) & ~q) | ((e - DPD_JSON_ONES) & ~e))
            & (DPD_JSON_ONES * 0x80);

        if (m) {
            return p + i + (__builtin_ctzll(m) >> 3);
        }
    }

    return NULL;
#else
    size_t  i;

    for (i = 0; i < 16; i++) {
        if (p[i] == '"' || p[i] == '\\') {
            return p + i;
        }
    }

    return NULL;
#endif
}


/* 4 hex digits; 0 when one is not (cJSON's parse_hex4()) */

static unsigned
dpd_json_hex4(const unsigned char *p)
{
    unsigned  h, i, c;

    h = 0;

    for (i = 0; i < 4; i++) {
        c = p[i];

        if (c >= '0' && c <= '9') {
            c -= '0';

        } else if ((c | 0x20) >= 'a' && (c | 0x20) <= 'f') {
            c = (c | 0x20) - 'a' + 10;

        } else {
            return 0;
        }

        h = (h << 4) | c;
    }

    return h;
}


/*
 * a \u escape (four hex digits) or a surrogate pair at p, before the
 * closing quote at end, as UTF-8 at *out; returns the escape's length, 0 for a bad one: a low
 * surrogate first, a high one without a low one after it.
 */

static size_t
dpd_json_utf16(const unsigned char *p, const unsigned char *end,
    unsigned char **out)
{
    size_t          n;
    unsigned        hi, lo;
    unsigned long   cp;
    unsigned char  *o;

    if (end - p < 6) {
        return 0;
    }

    hi = dpd_json_hex4(p + 2);

    if (hi >= 0xdc00 && hi <= 0xdfff) {
        return 0;
    }

    if (hi >= 0xd800 && hi <= 0xdbff) {
        if (end - (p + 6) < 6 || p[6] != '\\' || p[7] != 'u') {
            return 0;
        }

        lo = dpd_json_hex4(p + 8);

        if (lo < 0xdc00 || lo > 0xdfff) {
            return 0;
        }

        cp = 0x10000 + (((unsigned long) (hi & 0x3ff) << 10) | (lo & 0x3ff));
        n = 12;

    } else {
        cp = hi;
        n = 6;
    }

    o = *out;

    if (cp < 0x80) {
        *o++ = (unsigned char) cp;

    } else if (cp < 0x800) {
        *o++ = (unsigned char) (0xc0 | (cp >> 6));
        *o++ = (unsigned char) (0x80 | (cp & 0x3f));

    } else if (cp < 0x10000) {
        *o++ = (unsigned char) (0xe0 | (cp >> 12));
        *o++ = (unsigned char) (0x80 | ((cp >> 6) & 0x3f));
        *o++ = (unsigned char) (0x80 | (cp & 0x3f));

    } else {
        *o++ = (unsigned char) (0xf0 | (cp >> 18));
        *o++ = (unsigned char) (0x80 | ((cp >> 12) & 0x3f));
        *o++ = (unsigned char) (0x80 | ((cp >> 6) & 0x3f));
        *o++ = (unsigned char) (0x80 | (cp & 0x3f));
    }

    *out = o;

    return n;
}


/*
 * cJSON copies the run of [0-9+-eE.] bytes (the locale's decimal point
 * for '.') and hands it to strtod().  Up to 18 digits after an optional
 * '-' are an exact integer: converted here, the same double.  Otherwise
 * strtod() reads in place when the byte after the run stops it (and the
 * decimal point is '.'), else from a copy.
 */

static int
dpd_json_number(dpd_json_t *b, cJSON *item)
{
    int                   neg, other;
    char                 *e, small[64], *copy;
    double                d;
    size_t                n, i, used;
    uint64_t              u;
    const unsigned char  *p;

    p = b->data + b->off;
    n = b->len - b->off;
    neg = (p[0] == '-');
    other = 0;
    u = 0;

    for (i = neg; i < n; i++) {
        if (dpd_json_num[p[i]] != 1) {
            break;
        }

        u = u * 10 + (p[i] - '0');
    }

    if (i < n && dpd_json_num[p[i]] == 2) {
        other = 1;

        while (i < n && dpd_json_num[p[i]]) {
            i++;
        }
    }

    n = i;

    if (!other && n > (size_t) neg && n - neg <= 18) {
        d = (double) u;
        if (neg) {
            d = -d;
        }

        used = n;

    } else {
        if (b->point == 0) {
            b->point = (unsigned char) localeconv()->decimal_point[0];
        }

        if (b->off + n < b->len && dpd_json_stop[p[n]] && b->point == '.') {
            d = strtod((const char *) p, &e);
            used = e - (const char *) p;

        } else {
            copy = (n < sizeof(small)) ? small : cJSON_malloc(n + 1);
            if (copy == NULL) {
                return 0;
            }

            for (i = 0; i < n; i++) {
                copy[i] = (p[i] == '.') ? (char) b->point : (char) p[i];
            }

            copy[n] = '\0';

            d = strtod(copy, &e);
            used = e - copy;

            if (copy != small) {
                cJSON_free(copy);
            }
        }

        if (used == 0) {
            return 0;
        }
    }

    item->valuedouble = d;

    if (d >= INT_MAX) {
        item->valueint = INT_MAX;

    } else if (d <= (double) INT_MIN) {
        item->valueint = INT_MIN;

    } else {
        item->valueint = (int) d;
    }

    item->type = cJSON_Number;
    b->off += used;

    return 1;
}


static int
dpd_json_array(dpd_json_t *b, cJSON *item)
{
    cJSON  *head, *cur, *next;

    if (b->depth >= CJSON_NESTING_LIMIT) {
        return 0;
    }

    b->depth++;

    head = NULL;
    cur = NULL;

    b->off++;
    dpd_json_space(b);

    if (b->off < b->len && b->data[b->off] == ']') {
        goto done;
    }

    if (b->off >= b->len) {
        b->off--;
        goto fail;
    }

    /* each element: step past the byte before it, as cJSON does */
    b->off--;

    do {
        next = dpd_json_item(b);
        if (next == NULL) {
            goto fail;
        }

        if (head == NULL) {
            head = next;

        } else {
            cur->next = next;
            next->prev = cur;
        }

        cur = next;

        b->off++;
        dpd_json_space(b);

        if (!dpd_json_value(b, cur)) {
            goto fail;
        }

        dpd_json_space(b);

    } while (b->off < b->len && b->data[b->off] == ',');

    if (b->off >= b->len || b->data[b->off] != ']') {
        goto fail;
    }

done:

    b->depth--;

    if (head) {
        head->prev = cur;
    }

    item->type = cJSON_Array;
    item->child = head;
    b->off++;

    return 1;

fail:

    if (head) {
        dpd_json_drop(b, head);
    }

    return 0;
}


static int
dpd_json_object(dpd_json_t *b, cJSON *item)
{
    cJSON  *head, *cur, *next;

    if (b->depth >= CJSON_NESTING_LIMIT) {
        return 0;
    }

    b->depth++;

    head = NULL;
    cur = NULL;

    b->off++;
    dpd_json_space(b);

    if (b->off < b->len && b->data[b->off] == '}') {
        goto done;
    }

    if (b->off >= b->len) {
        b->off--;
        goto fail;
    }

    b->off--;

    do {
        next = dpd_json_item(b);
        if (next == NULL) {
            goto fail;
        }

        if (head == NULL) {
            head = next;

        } else {
            cur->next = next;
            next->prev = cur;
        }

        cur = next;

        b->off++;
        dpd_json_space(b);

        if (!dpd_json_string(b, cur)) {
            goto fail;
        }

        dpd_json_space(b);

        /* the name was parsed as a string value */
        cur->string = cur->valuestring;
        cur->valuestring = NULL;

        if (b->off >= b->len || b->data[b->off] != ':') {
            goto fail;
        }

        b->off++;
        dpd_json_space(b);

        if (!dpd_json_value(b, cur)) {
            goto fail;
        }

        dpd_json_space(b);

    } while (b->off < b->len && b->data[b->off] == ',');

    if (b->off >= b->len || b->data[b->off] != '}') {
        goto fail;
    }

done:

    b->depth--;

    if (head) {
        head->prev = cur;
    }

    item->type = cJSON_Object;
    item->child = head;
    b->off++;

    return 1;

fail:

    if (head) {
        dpd_json_drop(b, head);
    }

    return 0;
}
