#!/usr/bin/env python3
"""Chat prompt ids from Hugging Face transformers' own apply_chat_template,
on requests prepared as vLLM's OpenAI server prepares them today.

    hf_chat_oracle.py MODEL_DIR [TEMPLATE.jinja] < requests.jsonl > out.jsonl

MODEL_DIR holds tokenizer.json and tokenizer_config.json; it is loaded
offline (HF_HUB_OFFLINE=1) with AutoTokenizer.  TEMPLATE.jinja replaces
the package's chat template (or gives one where the package ships none).
Writes one JSON object per request line: {"ids": [...]} or {"error": msg}
(what vLLM answers with 400), or {"media": n} when the request holds
non-text parts (vLLM fetches them for a multimodal model and refuses them
for a text-only one; the gateway leaves them out: not comparable).

The preparation (content format, messages, keyword arguments) is
tools/python/vllm_chat_prep.py, which names the vLLM commits it follows;
then, as vllm/renderers/hf.py (e7ad92e5308e) safe_apply_chat_template
does, tokenizer.apply_chat_template renders it, and the text is encoded
with add_special_tokens=False (the request's default), which is what
apply_chat_template(tokenize=True) does.
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from transformers import AutoTokenizer                          # noqa: E402
from transformers.utils import chat_template_utils as hf_ctu    # noqa: E402

import vllm_chat_prep as prep                                   # noqa: E402


def content_format(src):
    """vLLM parses the template with transformers' own environment"""
    return prep.content_format(
        src, lambda t: hf_ctu._compile_jinja_template(t).environment.parse(t))


def render(tok, tmpl, fmt, req):
    msgs, kw = prep.prepare(req, fmt)
    tools = kw.pop("tools", None)
    return tok.apply_chat_template(msgs, tools=tools, chat_template=tmpl,
                                   tokenize=True, return_dict=False, **kw)


def main():
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    if len(sys.argv) > 2:
        with open(sys.argv[2], encoding="utf-8") as f:
            tmpl = f.read()
    else:
        tmpl = tok.get_chat_template()
    fmt = content_format(tmpl)
    out = sys.stdout
    for line in sys.stdin.buffer.read().decode("utf-8").split("\n"):
        if not line:
            continue
        try:
            r = {"ids": list(render(tok, tmpl, fmt, json.loads(line)))}
        except prep.Media:
            r = {"media": 1}
        except Exception as e:      # vLLM answers 400
            r = {"error": "%s: %s" % (type(e).__name__, e)}
        out.write(json.dumps(r, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
