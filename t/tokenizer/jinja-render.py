#!/usr/bin/env python3
"""Reference chat rendering with Python's Jinja2, set up as transformers'
apply_chat_template sets it up (ImmutableSandboxedEnvironment,
trim_blocks, lstrip_blocks, loopcontrols, the generation tag, tojson as
json.dumps(ensure_ascii=False), raise_exception, strftime_now), on
requests prepared as vLLM's OpenAI server prepares them
(tools/python/vllm_chat_prep.py, shared with hf_chat_oracle.py, names
the vLLM commits it follows; a media part is left out, as the gateway
leaves it out), continue_final_message cut
as transformers 4.57 cuts it (the tag appended to the final text).

    jinja-render.py TEMPLATE_SOURCE < requests.jsonl > out.jsonl

TEMPLATE_SOURCE: a tokenizer_config.json (its chat_template and special
tokens) or a .jinja file (then a tokenizer_config.json may follow as a
second argument for the special tokens).  Writes one JSON object per
request: {"text": prompt} or {"error": message}.
"""

import json
import os
import sys
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "tools", "python"))
import vllm_chat_prep as prep                                   # noqa: E402


class AssistantTracker(Extension):
    """transformers' {% generation %} tag, as a plain block."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def strftime_now(fmt):
    return datetime.now().strftime(fmt)


def environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[AssistantTracker,
                                                    jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def tag_final(chat):
    """transformers 4.57's render_jinja_template: the tag after the final
    message's text (its last text block); returns that text"""
    final = chat[-1]["content"]
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:
                final = block["text"]
                block["text"] = final + TAG
                return final
        raise ValueError("continue_final_message is set but we could not "
                         "find any text to continue in the final message!")
    chat[-1]["content"] = final + TAG
    return final


def continue_final(rendered, final):
    if final.strip() not in rendered or TAG.strip() not in rendered:
        raise ValueError("continue_final_message is set but the final message "
                         "does not appear in the chat after applying the chat "
                         "template! This can happen if the chat template "
                         "deletes portions of the final message. Please verify "
                         "the chat template and final message in your chat to "
                         "ensure they are compatible.")
    loc = rendered.rindex(TAG.strip())
    if rendered[loc:loc + len(TAG)] == TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()


def special_tokens(cfg):
    out = {}
    for k in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
              "cls_token", "mask_token"):
        v = cfg.get(k)
        if isinstance(v, dict):
            v = v.get("content")
        if v:
            out[k] = v
    a = cfg.get("additional_special_tokens")
    if a:
        out["additional_special_tokens"] = [x["content"] if isinstance(x, dict) else x
                                            for x in a]
    return out


def render(tmpl, fmt, specials, req):
    msgs, kw = prep.prepare(req, fmt, media="drop")
    cfm = kw.pop("continue_final_message")
    # apply_chat_template's template variables: the special tokens under
    # the kwargs; tools and documents always defined
    variables = dict(specials)
    variables.update(tools=None, documents=None)
    variables.update(kw)
    final = tag_final(msgs) if cfm else None
    text = tmpl.render(messages=msgs, **variables)
    if cfm:
        text = continue_final(text, final)
    return text


def main():
    src = sys.argv[1]
    cfg = {}
    if src.endswith(".json"):
        cfg = json.load(open(src, encoding="utf-8"))
        t = cfg.get("chat_template")
        if isinstance(t, list):
            t = next((x["template"] for x in t if x["name"] == "default"), t[0]["template"])
    else:
        t = open(src, encoding="utf-8").read()
        if len(sys.argv) > 2:
            cfg = json.load(open(sys.argv[2], encoding="utf-8"))
    env = environment()
    fmt = prep.content_format(t, env.parse)
    tmpl = env.from_string(t)
    specials = special_tokens(cfg)
    out = sys.stdout
    for line in sys.stdin.buffer.read().decode("utf-8").split("\n"):
        if not line:
            continue
        try:
            r = {"text": render(tmpl, fmt, specials, json.loads(line))}
        except Exception as e:      # what vLLM answers with 400
            r = {"error": str(e)}
        out.write(json.dumps(r, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
