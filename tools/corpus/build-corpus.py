#!/usr/bin/env python3
"""Build the tokenizer test corpus from material found on a Debian machine
plus generated edge cases.  Deterministic for a given machine and seed.

    build-corpus.py [--out build/corpus] [--seed 2] [--min-bytes 2200000]

Writes OUT/corpus.jsonl (one JSON string per line; a few lines carry raw
invalid UTF-8 bytes inside the quotes on purpose) and OUT/corpus.tags (the
category of each line, for reporting).  Sources that are missing are
skipped; /usr/include and the Python library then fill up to --min-bytes.
"""

import argparse
import glob
import gzip
import json
import os
import random
import struct
import sys

LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>", "<|finetune_right_pad_id|>",
                  "<|reserved_special_token_0|>", "<|reserved_special_token_250|>"]
QWEN_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_pad|>",
              "<tool_call>", "</tool_call>", "<think>", "</think>",
              "<tool_response>", "</tool_response>", "<|fim_prefix|>",
              "<|file_sep|>", "<|box_start|>"]


class Corpus:
    def __init__(self):
        self.lines = []    # bytes, without newline
        self.tags = []
        self.size = 0

    def add_text(self, tag, text):
        if not text:
            return
        line = json.dumps(text, ensure_ascii=False).encode("utf-8")
        self.add_raw(tag, line, len(text.encode("utf-8")))

    def add_raw(self, tag, line, nbytes):
        self.lines.append(line)
        self.tags.append(tag)
        self.size += nbytes


def read_text(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
        if path.endswith(".gz"):
            data = gzip.decompress(data)
    except (OSError, EOFError, gzip.BadGzipFile):
        return ""
    return data.decode("utf-8", errors="replace")


def chunks(rng, text, lo=1, hi=4000):
    """Cut text at random points: texts of many sizes, cut anywhere."""
    i = 0
    while i < len(text):
        n = rng.randint(lo, hi)
        yield text[i:i + n]
        i += n


def add_files(c, rng, tag, paths, budget):
    used = 0
    for p in paths:
        if used >= budget:
            break
        t = read_text(p)
        if not t:
            continue
        t = t[: budget - used]
        for ch in chunks(rng, t):
            c.add_text(tag, ch)
        used += len(t.encode("utf-8"))
    return used


def mo_strings(path):
    """Translated strings (msgstr) of a gettext .mo file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return []
    if len(data) < 28:
        return []
    magic = struct.unpack("<I", data[:4])[0]
    end = "<" if magic == 0x950412DE else ">"
    try:
        _, n, _, toff = struct.unpack(end + "4I", data[4:20])
        out = []
        for i in range(1, n):        # entry 0 is the header
            ln, off = struct.unpack(end + "2I", data[toff + 8 * i: toff + 8 * i + 8])
            s = data[off:off + ln].decode("utf-8", errors="replace")
            out.extend(x for x in s.split("\0") if x)
        return out
    except struct.error:
        return []


def debian_material(c, rng):
    add_files(c, rng, "licenses", sorted(glob.glob("/usr/share/common-licenses/*")),
              400_000)
    add_files(c, rng, "copyright", sorted(glob.glob("/usr/share/doc/*/copyright")),
              450_000)
    add_files(c, rng, "changelog",
              sorted(glob.glob("/usr/share/doc/*/changelog.Debian.gz")), 200_000)
    add_files(c, rng, "c-headers", sorted(glob.glob("/usr/include/*.h")), 300_000)
    add_files(c, rng, "python", sorted(glob.glob("/usr/lib/python3*/*.py")), 250_000)
    add_files(c, rng, "perl", sorted(glob.glob("/usr/share/perl/5*/*.pm")), 150_000)
    man = []
    for lang in ("ja", "ko", "ru", "zh_CN", "zh_TW", "de", "fr", "pl", "tr", "uk"):
        man += sorted(glob.glob("/usr/share/man/%s/man*/*.gz" % lang))[:40]
    add_files(c, rng, "man-i18n", man, 300_000)
    used = 0
    for lang in ("ar", "he", "fa", "hi", "bn", "ta", "th", "zh_CN", "zh_TW", "ja",
                 "ko", "el", "ru", "vi", "am", "ka", "my", "km"):
        strings = []
        for mo in sorted(glob.glob("/usr/share/locale/%s/LC_MESSAGES/*.mo" % lang)):
            strings += mo_strings(mo)
        text = "\n".join(strings)[:25_000]
        for ch in chunks(rng, text, 1, 1500):
            c.add_text("mo-" + lang, ch)
        used += len(text.encode("utf-8"))
    return used


def rand_from(rng, ranges, n):
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def generated(c, rng):
    words_en = ("the quick brown fox jumps over lazy dog token count gateway "
                "request prefill decode cache Hello World HTTP JSON nginx").split()
    cjk = [(0x4E00, 0x9FA5), (0x3041, 0x3096), (0x30A1, 0x30FA), (0xAC00, 0xD7A3),
           (0x3000, 0x303F), (0xFF01, 0xFF5E)]
    arabic = [(0x0621, 0x064A), (0x064B, 0x0652), (0x0660, 0x0669)]
    hindi = [(0x0905, 0x0939), (0x093E, 0x094D), (0x0966, 0x096F)]
    phrases = ["你好，世界！这是一个测试。", "日本語のテキストとカタカナ、ひらがな。",
               "한국어 문장입니다. 토크나이저 테스트.", "مرحبا بالعالم، هذا اختبار.",
               "नमस्ते दुनिया, यह एक परीक्षण है।", "Привет, мир! Это тест.",
               "שלום עולם", "สวัสดีชาวโลก", "Γειά σου Κόσμε", "Xin chào thế giới"]
    emoji = ["👨‍👩‍👧‍👦", "🏳️‍🌈", "👍🏽", "🇫🇷", "🇯🇵🇺🇸", "❤️", "🧑🏿‍💻", "😀😃😄",
             "👩‍❤️‍💋‍👨", "🤷‍♀️", "1️⃣", "🫠", "☕"]
    ws = [" ", "  ", "\t", "\n", "\r\n", "\r", "\n\n", " \n", "\t \t", "\u00a0",
          "\u3000", "\u2028", "\u0085", "\u180e", "\v", "\f", "\u2009", "\u200b"]
    contr = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"]

    def caseforms(s):
        forms = {s, s.upper(), s.title()}
        if len(s) > 2:
            forms.add(s[0] + s[1].upper() + s[2:])
            forms.add(s[0] + s[1] + s[2].upper())
        return sorted(forms)

    for _ in range(300):
        c.add_text("cjk", "".join(rng.choice(phrases[:3]) if rng.random() < .3
                                  else rand_from(rng, cjk, rng.randint(1, 60))
                                  for _ in range(rng.randint(1, 8))))
        c.add_text("arabic", " ".join(rand_from(rng, arabic, rng.randint(1, 9))
                                      for _ in range(rng.randint(1, 30))) + " " +
                   phrases[3])
        c.add_text("hindi", " ".join(rand_from(rng, hindi, rng.randint(1, 9))
                                     for _ in range(rng.randint(1, 30))) + "। " +
                   phrases[4])
    for _ in range(400):
        parts = []
        for _ in range(rng.randint(1, 20)):
            parts.append(rng.choice(emoji + words_en + phrases))
            parts.append(rng.choice(["", " ", "\u200d", "\ufe0f", ", "]))
        c.add_text("emoji", "".join(parts))
    for n in list(range(1, 40)) + [64, 100, 257, 1000, 5000]:
        d = "".join(rng.choice("0123456789") for _ in range(n))
        c.add_text("digits", d)
        c.add_text("digits", "x" + d + " " + d[::-1] + "." + d[:7] + ",5")
        c.add_text("digits", "".join(chr(0x0660 + int(x)) for x in d[:50]) +
                   " " + "".join(chr(0xFF10 + int(x)) for x in d[:50]))
    for _ in range(600):
        parts = []
        for _ in range(rng.randint(1, 30)):
            parts.append(rng.choice(ws) * rng.randint(1, 5))
            if rng.random() < .6:
                parts.append(rng.choice(words_en + ["x", "1", ".", "!?", "é", "中"]))
        c.add_text("whitespace", "".join(parts))
    for n in (1, 2, 3, 100, 1000, 20000):
        c.add_text("whitespace", " " * n + "a" + "\t" * n + "\n" * n + " ")
        c.add_text("whitespace", "word" + " " * n)
    for _ in range(400):
        parts = []
        for _ in range(rng.randint(1, 20)):
            w = rng.choice(words_en)
            k = rng.choice(contr)
            parts.append(rng.choice([w, w.upper()]) + rng.choice(caseforms(k)))
            parts.append(rng.choice([" ", "", "'", " '", "\u2019s ", "ſ "]))
        c.add_text("contractions", "".join(parts))
    for k in contr:
        for f in caseforms(k):
            c.add_text("contractions", f)
            c.add_text("contractions", "I" + f + " you" + f + "x " + f + f)
    specials = LLAMA_SPECIALS + QWEN_ADDED
    for _ in range(500):
        parts = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < .4:
                parts.append(rng.choice(specials))
            elif r < .5:
                s = rng.choice(specials)
                parts.append(s[:rng.randint(1, len(s) - 1)])   # partial
            else:
                parts.append(rng.choice(words_en + ws + phrases + emoji))
            parts.append(rng.choice(["", " ", "\n", "  "]))
        c.add_text("specials", "".join(parts))
    # strings the derived test tokenizers give added-token flags or
    # split patterns (see derive-tokenizers.py)
    flagged = ["<lstrip>", "[rstrip]", "<both>", "zork", "zorky", "xzork",
               "_zork", "zork_", "\ufb01xme", "fixme", "<norm>", "<think>",
               "::", "a::b", ",", ";", "x,y;z", "12,345;6"]
    for _ in range(300):
        parts = []
        for _ in range(rng.randint(1, 14)):
            parts.append(rng.choice(flagged + words_en + ws + ["\u00e9", "中"]))
            parts.append(rng.choice(["", " ", "  ", "\t", "\n", "\u3000"]))
        c.add_text("addedflags", "".join(parts))
    nfc = ["e\u0301", "cafe\u0301 caf\u00e9", "\u212b\u2126\u212a", "\u0958\u0959",
           "\u1100\u1161\u11a8", "A\u030a", "\u0301alone", "o\u0308\u0304",
           "\ufb01 \ufb03", "\u00bd \u2075", "\u3131\u314f", "Å"]
    for _ in range(300):
        c.add_text("nfc", "".join(rng.choice(nfc + words_en + [" "])
                                  for _ in range(rng.randint(1, 15))))
    long_cases = ["a" * 5000, "ab" * 3000, "\u4e2d" * 3000, "!" * 4000,
                  "\U0001F600" * 1000, "x" * 200 + "'s" * 500,
                  "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8000)),
                  "aGVsbG8gd29ybGQ=" * 300]
    for t in long_cases:
        c.add_text("long", t)
    # random code points from long-assigned blocks (Unicode <= 6)
    blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF),
              (0x590, 0x5FF), (0x600, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F),
              (0x1E00, 0x1EFF), (0x2000, 0x206F), (0x2100, 0x214F),
              (0x2190, 0x21FF), (0x2500, 0x257F), (0x3040, 0x30FF),
              (0x4E00, 0x9FCC), (0xAC00, 0xD7A3), (0xFF00, 0xFFEF),
              (0x1F300, 0x1F5FF), (0x1D400, 0x1D7FF)]
    for _ in range(400):
        c.add_text("random", rand_from(rng, blocks, rng.randint(1, 200)))
    # blocks with characters added in Unicode 13-15: the regex engines'
    # Unicode tables (pcre2 here, Oniguruma in Hugging Face) must agree
    recent = [(0x31350, 0x323AF), (0x1FA70, 0x1FAFF), (0x11F00, 0x11F5F),
              (0x1E030, 0x1E08F), (0x11B00, 0x11B5F), (0x1E4D0, 0x1E4FF),
              (0x2EBF0, 0x2EE5F), (0x0870, 0x089F), (0x1E290, 0x1E2FF),
              (0x16FE0, 0x16FFF), (0x1AFF0, 0x1B16F), (0x10570, 0x105FF),
              (0xA7C0, 0xA7FF)]
    for lo, hi in recent:
        cps = list(range(lo, hi + 1))
        for i in range(0, len(cps), 16):
            c.add_text("unicode-recent", "".join(
                "a" + chr(x) + " 1" + chr(x) + "2 " for x in cps[i:i + 16]))
    for t in ["", " ", "\n", "a", "'", "'s", "\u00a0", "\ufeff", "\x00", "a\x00b",
              "\x01\x02\x1f\x7f", "\ufffd", "\U0010ffff", "<|", "|>", "<|im_start|>",
              "<|begin_of_text|><|begin_of_text|>", "  <|eot_id|>  "]:
        c.add_text("tiny", t)


def unicode9_ranges():
    """The Unicode 9.0 ranges of ngx_dpd_module/tokenizer/tok_unicode9.h."""
    import re
    h = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                     "ngx_dpd_module", "tokenizer", "tok_unicode9.h")
    with open(h) as f:
        return [(int(a, 16), int(b, 16))
                for a, b in re.findall(r"\{ 0x([0-9A-F]+), 0x([0-9A-F]+) \}", f.read())]


def spm_cases(c, rng):
    """SentencePiece-style files (Llama 2, Gemma): characters their
    vocabularies lack (byte_fallback <0xNN>, unknown tokens), whitespace
    runs the Metaspace replacement and Gemma's whitespace merges see, and
    the marks Hugging Face's Unicode 9.0 normalizer does not know."""
    import unicodedata
    u9 = unicode9_ranges()

    def in9(cp):
        return any(lo <= cp <= hi for lo, hi in u9)

    rare = [(0x3400, 0x4DB5), (0x20000, 0x2A6D6), (0x13A0, 0x13F4),
            (0x2D30, 0x2D67), (0x1200, 0x135A), (0x1400, 0x167F),
            (0x10330, 0x1034A), (0x12000, 0x12399), (0x10000, 0x1005D),
            (0xE000, 0xE0FF), (0x1F900, 0x1F9FF), (0x0F00, 0x0FD4),
            (0x1000, 0x109F), (0xA000, 0xA48C), (0x0370, 0x03FF),
            (0x16A0, 0x16F0), (0x0780, 0x07B1), (0x1780, 0x17F9)]
    ctrl = [chr(x) for x in list(range(1, 32)) + list(range(0x7F, 0xA0))] + \
        ["\ufeff", "\u200b", "\u200e", "\u2060", "\ufffe", "\uffff",
         "\U0010fffd", "\u0378", "\U000e0001", "\U000e0041"]
    words = "the model Hello  world token ▁ ▁▁ _ café naïve 東京 😀 <s> </s> <unk> <bos> <eos>".split(" ")
    for _ in range(500):
        parts = []
        for _ in range(rng.randint(1, 25)):
            r = rng.random()
            if r < .35:
                parts.append(rand_from(rng, rare, rng.randint(1, 6)))
            elif r < .5:
                parts.append(rng.choice(ctrl))
            else:
                parts.append(rng.choice(words))
            parts.append(rng.choice(["", " ", "  ", "\n", "\t", " \n "]))
        c.add_text("spm-fallback", "".join(parts))
    for t in ["\x00", "a\x00b", " \x00 ", "\x01", "\x7f\x80\x9f", "▁", "▁▁ ▁",
              " ", "  ", " a", "a ", "\ta", "\n", "<s>", " <s>", "<s> ", "<s>a",
              "a<s>b", "</s></s>", "<unk>", "<start_of_turn>user\nhi<end_of_turn>",
              "<bos> x", "\U0001F600", "\U0002A6D6", "\ue000", "𒀀𒀁 𒀂"]:
        c.add_text("spm-tiny", t)
    for n in (1, 2, 3, 15, 16, 17, 30, 31, 32, 33, 64, 100, 1000, 5000):
        for w in (" ", "\n", "\t", "\r\n", " \n", "▁", "\u3000"):
            c.add_text("spm-whitespace", w * n)
            c.add_text("spm-whitespace", "x" + w * n + "y" + w * (n // 2 + 1))
    # marks and decomposable characters assigned after Unicode 9.0 (per
    # this Python's tables, Unicode 14 on Debian 12), next to old marks in
    # both orders.  Not Unicode 15's: pcre2 10.42 has Unicode 14 tables,
    # Oniguruma 15, so \p{N} etc. differ on those (Kawi digits) whatever
    # the normalizer does.
    new = [cp for cp in range(0xA0, 0x30000)
           if not in9(cp) and (unicodedata.combining(chr(cp)) or
                               unicodedata.decomposition(chr(cp)))]
    old = ["\u0301", "\u0316", "\u064b", "\u0650", "\u0651", "\u05b0",
           "\u093c", "\u094d", "\u0e38", "\u302a", "\u1dc0", "\u0345"]
    bases = ["a", "e", "\u0628", "\u05d0", "\u0915", "\u0e01", "\u1100\u1161",
             "\U00011935", " "]
    for i in range(0, len(new), 6):
        parts = []
        for cp in new[i:i + 6]:
            b = rng.choice(bases)
            o = rng.choice(old)
            parts.append(b + chr(cp) + o + " " + b + o + chr(cp) + " " + chr(cp) + o)
        c.add_text("nfc-recent", "".join(parts))
    for t in ["\u0628\u08d2\u064b", "\u0628\u064b\u08d2", "\U00011935\U00011930",
              "a\u08d3\u0301\u0316", "e\ua7f2\u0301", "\U00011f04\U00011f41\u0301"]:
        c.add_text("nfc-recent", t)


def invalid_utf8(c, rng):
    """Lines with raw invalid UTF-8 inside the JSON string."""
    bad = [b"\x80", b"\xbf", b"\xc0\xaf", b"\xc1\xbf", b"\xe0\x80\x80",
           b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf5\x80",
           b"\xff", b"\xfe\xff", b"\xe2\x82", b"\xf0\x9f\x98", b"\xf0\x9f",
           b"\xc3", b"\xe4\xb8", b"\xf8\x88\x80\x80\x80", b"\xc3\x28",
           b"\xe2\x28\xa1", b"\xf0\x28\x8c\x28"]
    good = ["abc", " ", "中文", "é", "'s", "123", "\n", "<|eot_id|>", "<|im_end|>"]
    for _ in range(400):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < .5:
                parts.append(rng.choice(bad))
            else:
                t = json.dumps(rng.choice(good), ensure_ascii=False)[1:-1]
                parts.append(t.encode("utf-8"))
        line = b'"' + b"".join(parts) + b'"'
        c.add_raw("invalid-utf8", line, len(line) - 2)
    for b in bad:
        c.add_raw("invalid-utf8", b'"' + b + b'"', len(b))
        c.add_raw("invalid-utf8", b'"x' + b + b'"', len(b) + 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="build/corpus")
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--min-bytes", type=int, default=2_200_000)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    c = Corpus()
    debian_material(c, rng)
    generated(c, rng)
    invalid_utf8(c, rng)
    spm_cases(c, random.Random(a.seed + 100))
    # top up from sources every Debian system has, if the above fell short
    extra = sorted(glob.glob("/usr/include/*/*.h")) + \
        sorted(glob.glob("/usr/lib/python3*/*/*.py"))
    i = 0
    while c.size < a.min_bytes and i < len(extra):
        add_files(c, rng, "topup", extra[i:i + 20], a.min_bytes - c.size)
        i += 20
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "corpus.jsonl"), "wb") as f:
        f.write(b"".join(line + b"\n" for line in c.lines))
    with open(os.path.join(a.out, "corpus.tags"), "w") as f:
        f.write("".join(t + "\n" for t in c.tags))
    print("corpus: %d lines, %d bytes of text" % (len(c.lines), c.size))
    return 0 if c.size >= a.min_bytes else 1


if __name__ == "__main__":
    sys.exit(main())
