/*
 * UTF-8 helpers: lossy sanitising (every maximal invalid subpart becomes
 * one U+FFFD, as Rust's String::from_utf8_lossy and the WHATWG decoder do,
 * so the result equals what Hugging Face sees after a lossy decode), the
 * GPT-2 byte-level alphabet, and a few character classes.
 */

#include <string.h>
#include <utf8proc.h>

#include "tok_internal.h"
#include "tok_unicode9.h"


/*
 * Length of the next valid sequence at s (1..4), or 0 if invalid; then
 * *bad is the length of the maximal invalid subpart to replace.
 */
static size_t
tok_utf8_seq(const unsigned char *s, size_t len, size_t *bad)
{
    unsigned char  c = s[0];
    unsigned char  lo = 0x80, hi = 0xBF;
    size_t         need, i;

    if (c < 0x80) {
        return 1;
    }
    if (c >= 0xC2 && c <= 0xDF) {
        need = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
        need = 2;
        if (c == 0xE0) {
            lo = 0xA0;
        } else if (c == 0xED) {
            hi = 0x9F;
        }
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 3;
        if (c == 0xF0) {
            lo = 0x90;
        } else if (c == 0xF4) {
            hi = 0x8F;
        }
    } else {
        *bad = 1;
        return 0;
    }

    for (i = 1; i <= need; i++) {
        if (i >= len || s[i] < lo || s[i] > hi) {
            *bad = i;
            return 0;
        }
        lo = 0x80;
        hi = 0xBF;
    }
    return need + 1;
}


/* Length after sanitising; *valid = 1 if the text is already valid. */
size_t
tok_utf8_sanitize_len(const char *s, size_t len, int *valid)
{
    const unsigned char  *p = (const unsigned char *) s;
    size_t                i = 0, out = 0, n, bad;

    *valid = 1;
    while (i < len) {
        if (p[i] < 0x80) {
            /* most prompt text is ASCII: 8 bytes at a time */
            i++;
            out++;
            while (len - i >= 8) {
                uint64_t  v;

                memcpy(&v, p + i, 8);
                if (v & 0x8080808080808080ULL) {
                    break;
                }
                i += 8;
                out += 8;
            }
            continue;
        }
        n = tok_utf8_seq(p + i, len - i, &bad);
        if (n) {
            i += n;
            out += n;
        } else {
            *valid = 0;
            i += bad;
            out += 3;
        }
    }
    return out;
}


size_t
tok_utf8_sanitize(const char *s, size_t len, char *out)
{
    const unsigned char  *p = (const unsigned char *) s;
    size_t                i = 0, o = 0, n, bad;

    while (i < len) {
        if (p[i] < 0x80) {
            out[o++] = (char) p[i++];
            continue;
        }
        n = tok_utf8_seq(p + i, len - i, &bad);
        if (n) {
            memcpy(out + o, p + i, n);
            i += n;
            o += n;
        } else {
            out[o++] = (char) 0xEF;
            out[o++] = (char) 0xBF;
            out[o++] = (char) 0xBD;
            i += bad;
        }
    }
    return o;
}


size_t
tok_utf8_encode(uint32_t cp, char *out)
{
    unsigned char  *o = (unsigned char *) out;

    if (cp < 0x80) {
        o[0] = (unsigned char) cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char) (0xC0 | (cp >> 6));
        o[1] = (unsigned char) (0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char) (0xE0 | (cp >> 12));
        o[1] = (unsigned char) (0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char) (0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char) (0xF0 | (cp >> 18));
    o[1] = (unsigned char) (0x80 | ((cp >> 12) & 0x3F));
    o[2] = (unsigned char) (0x80 | ((cp >> 6) & 0x3F));
    o[3] = (unsigned char) (0x80 | (cp & 0x3F));
    return 4;
}


/* Decode one code point of valid UTF-8; returns its length (0 at end). */
size_t
tok_utf8_decode(const char *s, size_t len, uint32_t *cp)
{
    const unsigned char  *p = (const unsigned char *) s;
    size_t                n, bad, i;
    uint32_t              c;

    if (len == 0) {
        return 0;
    }
    n = tok_utf8_seq(p, len, &bad);
    if (n == 0) {
        *cp = 0xFFFD;
        return bad;
    }
    if (n == 1) {
        *cp = p[0];
        return 1;
    }
    c = p[0] & (0x7F >> n);
    for (i = 1; i < n; i++) {
        c = (c << 6) | (p[i] & 0x3F);
    }
    *cp = c;
    return n;
}


/*
 * GPT-2 byte-level alphabet: printable Latin-1 bytes stand for themselves,
 * the other 68 bytes map to U+0100.. in byte order.  Decode a vocabulary
 * string to the raw bytes it stands for; -1 if it uses another character.
 *
 * Every character of the alphabet is ASCII (0x21-0x7E) or two bytes of
 * UTF-8 led by C2-C5 (U+00A1-U+0143): a table per form.  Anything else --
 * another character, or invalid UTF-8 (which decodes to U+FFFD) -- is
 * outside the alphabet.  tok_byte_dec[b] for b < 0x80 and tok_byte_dec2[cp
 * - 0x80] for U+0080-U+017F: the byte plus 1, 0 when not in the alphabet
 * (generated from the rule above: 0x21-0x7E, 0xA1-0xAC and 0xAE-0xFF stand
 * for themselves, the other bytes are U+0100 + their rank).
 */
static const uint16_t  tok_byte_dec[128] = {
      0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,
      0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,
      0,   0,   0,   0,   0,   0,   0,   0,   0,  34,  35,  36,
     37,  38,  39,  40,  41,  42,  43,  44,  45,  46,  47,  48,
     49,  50,  51,  52,  53,  54,  55,  56,  57,  58,  59,  60,
     61,  62,  63,  64,  65,  66,  67,  68,  69,  70,  71,  72,
     73,  74,  75,  76,  77,  78,  79,  80,  81,  82,  83,  84,
     85,  86,  87,  88,  89,  90,  91,  92,  93,  94,  95,  96,
     97,  98,  99, 100, 101, 102, 103, 104, 105, 106, 107, 108,
    109, 110, 111, 112, 113, 114, 115, 116, 117, 118, 119, 120,
    121, 122, 123, 124, 125, 126, 127,   0,
};

static const uint16_t  tok_byte_dec2[256] = {
      0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,
      0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,
      0,   0,   0,   0,   0,   0,   0,   0,   0, 162, 163, 164,
    165, 166, 167, 168, 169, 170, 171, 172, 173,   0, 175, 176,
    177, 178, 179, 180, 181, 182, 183, 184, 185, 186, 187, 188,
    189, 190, 191, 192, 193, 194, 195, 196, 197, 198, 199, 200,
    201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211, 212,
    213, 214, 215, 216, 217, 218, 219, 220, 221, 222, 223, 224,
    225, 226, 227, 228, 229, 230, 231, 232, 233, 234, 235, 236,
    237, 238, 239, 240, 241, 242, 243, 244, 245, 246, 247, 248,
    249, 250, 251, 252, 253, 254, 255, 256,   1,   2,   3,   4,
      5,   6,   7,   8,   9,  10,  11,  12,  13,  14,  15,  16,
     17,  18,  19,  20,  21,  22,  23,  24,  25,  26,  27,  28,
     29,  30,  31,  32,  33, 128, 129, 130, 131, 132, 133, 134,
    135, 136, 137, 138, 139, 140, 141, 142, 143, 144, 145, 146,
    147, 148, 149, 150, 151, 152, 153, 154, 155, 156, 157, 158,
    159, 160, 161, 174,   0,   0,   0,   0,   0,   0,   0,   0,
      0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,
      0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,
      0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,
      0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,
      0,   0,   0,   0,
};


int
tok_byte_level_decode(const char *s, size_t len, char *out, size_t *outlen)
{
    const unsigned char  *p = (const unsigned char *) s, *end = p + len;
    size_t                o = 0;
    unsigned              c, v;

    while (p < end) {
        c = *p;
        if (c < 0x80) {
            v = tok_byte_dec[c];
            p++;
        } else if (c >= 0xC2 && c <= 0xC5 && end - p >= 2
                   && (p[1] & 0xC0) == 0x80)
        {
            v = tok_byte_dec2[((c & 0x1F) << 6 | (p[1] & 0x3F)) - 0x80];
            p += 2;
        } else {
            return -1;
        }
        if (v == 0) {
            return -1;
        }
        out[o++] = (char) (v - 1);
    }
    *outlen = o;
    return 0;
}


/* Unicode White_Space, as Rust's char::is_whitespace and regex \s. */
int
tok_is_unicode_space(uint32_t cp)
{
    return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85
           || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A)
           || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F
           || cp == 0x3000;
}


/* Unicode \w (letters, marks, decimal digits, connector punctuation). */
int
tok_is_word_char(uint32_t cp)
{
    utf8proc_category_t  c = utf8proc_category((utf8proc_int32_t) cp);

    if (cp == 0x200C || cp == 0x200D) {
        return 1;
    }
    switch (c) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT: case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
        return 1;
    default:
        return 0;
    }
}


/* binary search of the Unicode 9.0 ranges */
int
tok_unicode9_assigned(uint32_t cp)
{
    size_t  lo = 0, hi = sizeof(tok_unicode9_ranges)
                         / sizeof(tok_unicode9_ranges[0]), mid;

    while (lo < hi) {
        mid = lo + (hi - lo) / 2;
        if (cp < tok_unicode9_ranges[mid][0]) {
            hi = mid;
        } else if (cp > tok_unicode9_ranges[mid][1]) {
            lo = mid + 1;
        } else {
            return 1;
        }
    }
    return 0;
}
