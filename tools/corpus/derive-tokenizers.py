#!/usr/bin/env python3
"""Derive test tokenizer.json variants from the real Llama 3 / Qwen 3 files,
to check with the Hugging Face oracle the parts those files do not use.

    derive-tokenizers.py LLAMA3_JSON QWEN3_JSON OUTDIR [LLAMA2_JSON]

  llama3-template.json  Meta's real layout: post_processor Sequence
                        [ByteLevel, TemplateProcessing] adding BOS (and EOS
                        here, to cover a suffix) with add_special_tokens.
  gpt2-bytelevel.json   GPT-2 style: no Split, ByteLevel with its built-in
                        regex and add_prefix_space, no ignore_merges,
                        RobertaProcessing.
  qwen3-flags.json      NFKC in a Sequence normalizer, Digits and String
                        Split pre-tokenizers with other behaviours, added
                        tokens with lstrip / rstrip / single_word /
                        normalized flags.

From Llama 2 (SentencePiece-style BPE, byte_fallback), when given:
  llama2-metaspace.json Mistral's newer layout: no normalizer, Metaspace
                        pre-tokenizer (prepend_scheme first, split false),
                        merges as ["a", "b"] pairs, NFC first.
  llama2-split.json     Metaspace prepend_scheme always, split true.
  llama2-never.json     Metaspace prepend_scheme never after a Split, and
                        a Regex Replace normalizer.
  llama2-unk.json       no byte_fallback: unknown characters fuse into one
                        <unk> (fuse_unk); some added tokens normalized.
  llama2-unk-nofuse.json  the same with fuse_unk false, and a few <0xNN>
                        tokens removed from a byte_fallback vocabulary
                        (a character missing one falls back to <unk>).
"""

import json
import os
import sys


def load(p):
    with open(p, encoding="utf-8") as f:
        return json.load(f)


def save(d, p):
    with open(p, "w", encoding="utf-8") as f:
        json.dump(d, f, ensure_ascii=False)


def main():
    llama, qwen, out = sys.argv[1:4]
    os.makedirs(out, exist_ok=True)

    d = load(llama)
    d["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
         "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                    {"SpecialToken": {"id": "<|end_of_text|>", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                  {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                  {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {
             "<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [128000],
                                   "tokens": ["<|begin_of_text|>"]},
             "<|end_of_text|>": {"id": "<|end_of_text|>", "ids": [128001],
                                 "tokens": ["<|end_of_text|>"]}}}]}
    save(d, os.path.join(out, "llama3-template.json"))

    d["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True,
                          "trim_offsets": True, "use_regex": True}
    d["model"]["ignore_merges"] = False
    d["post_processor"] = {"type": "RobertaProcessing",
                           "sep": ["<|end_of_text|>", 128001],
                           "cls": ["<|begin_of_text|>", 128000],
                           "trim_offsets": True, "add_prefix_space": True}
    save(d, os.path.join(out, "gpt2-bytelevel.json"))

    d = load(qwen)
    d["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFKC"}]}
    split = d["pre_tokenizer"]["pretokenizers"][0]
    d["pre_tokenizer"]["pretokenizers"] = [
        {"type": "Split", "pattern": {"String": "::"}, "behavior": "MergedWithNext",
         "invert": False},
        {"type": "Split", "pattern": {"Regex": "[,;]"}, "behavior": "MergedWithPrevious",
         "invert": False},
        split,
        {"type": "Digits", "individual_digits": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
         "use_regex": False}]
    nid = max(t["id"] for t in d["added_tokens"]) + 1
    extra = [("<lstrip>", dict(lstrip=True)), ("[rstrip]", dict(rstrip=True)),
             ("<both>", dict(lstrip=True, rstrip=True)),
             ("zork", dict(single_word=True, normalized=True, special=False)),
             ("\ufb01xme", dict(normalized=True, special=False)),
             ("<norm>", dict(normalized=True, special=False))]
    for content, flags in extra:
        t = {"id": nid, "content": content, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
        t.update(flags)
        d["added_tokens"].append(t)
        nid += 1
    for t in d["added_tokens"]:
        if t["content"] == "<think>":
            t["lstrip"] = t["rstrip"] = True
    save(d, os.path.join(out, "qwen3-flags.json"))

    if len(sys.argv) > 4:
        llama2(sys.argv[4], out)


def llama2(path, out):
    d = load(path)
    d["normalizer"] = {"type": "NFC"}
    d["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                          "prepend_scheme": "first", "split": False}
    d["model"]["merges"] = [m.split(" ") for m in d["model"]["merges"]]
    save(d, os.path.join(out, "llama2-metaspace.json"))

    d["normalizer"] = None
    d["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                          "prepend_scheme": "always", "split": True}
    save(d, os.path.join(out, "llama2-split.json"))

    d["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"Regex": "[0-9]+|\\t"}, "content": "#"},
        {"type": "Replace", "pattern": {"String": "ab"}, "content": ""}]}
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": "\n"}, "behavior": "Isolated",
         "invert": False},
        {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "never",
         "split": True}]}
    save(d, os.path.join(out, "llama2-never.json"))

    d = load(path)
    d["model"]["byte_fallback"] = False
    d["model"]["fuse_unk"] = True
    for t in d["added_tokens"]:
        if t["content"] == "</s>":
            t["normalized"] = True
    save(d, os.path.join(out, "llama2-unk.json"))

    d["model"]["fuse_unk"] = False
    d["model"]["byte_fallback"] = True
    for b in (0x80, 0x9F, 0xE4, 0xF0):
        del d["model"]["vocab"]["<0x%02X>" % b]
    save(d, os.path.join(out, "llama2-unk-nofuse.json"))


if __name__ == "__main__":
    main()
