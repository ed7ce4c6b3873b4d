#!/usr/bin/env python3
"""Reference chat rendering with Python's Jinja2, set up as transformers'
apply_chat_template sets it up (ImmutableSandboxedEnvironment,
trim_blocks, lstrip_blocks, loopcontrols, the generation tag, tojson as
json.dumps(ensure_ascii=False), raise_exception, strftime_now), on
requests prepared as vLLM's OpenAI server prepares them
(vllm/renderers/chat_utils/parse_chat_message_content.py and
parse_chat_message.py at be90fe165bb8: content parts, the content format,
the Claude Code billing header, tool call arguments;
vllm/entrypoints/openai/chat_completion/protocol.py at 002032ee2b18:
reasoning_content, the request's add_generation_prompt,
continue_final_message, documents and reasoning_effort over
chat_template_kwargs; tools as model_dump()), continue_final_message cut
as transformers 4.57 cuts it (the tag appended to the final text).

    jinja-render.py TEMPLATE_SOURCE < requests.jsonl > out.jsonl

TEMPLATE_SOURCE: a tokenizer_config.json (its chat_template and special
tokens) or a .jinja file (then a tokenizer_config.json may follow as a
second argument for the special tokens).  Writes one JSON object per
request: {"text": prompt} or {"error": message}.
"""

import json
import sys
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


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


# ---- vLLM's content format detection (string / openai)

def _is_var(node, name):
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node, name, key):
    if isinstance(node, nodes.Getitem):
        return (_is_var(node.node, name) and isinstance(node.arg, nodes.Const)
                and node.arg.value == key)
    if isinstance(node, nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node, name, key=None):
    if isinstance(node, nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def content_format(env, src):
    try:
        ast = env.parse(src)
    except Exception:
        return "string"
    msg_names = ["messages"]
    queue = ["messages"]
    while queue:
        n = queue.pop(0)
        for a in ast.find_all(nodes.Assign):
            if _is_var_or_elems(a.node, n) and isinstance(a.target, nodes.Name):
                if a.target.name not in msg_names:
                    msg_names.append(a.target.name)
                    queue.append(a.target.name)
    items = []
    for loop in ast.find_all(nodes.For):
        for n in msg_names:
            if _is_var_or_elems(loop.iter, n) and isinstance(loop.target, nodes.Name):
                items.append(loop.target.name)
                break
    for loop in ast.find_all(nodes.For):
        for n in items:
            if _is_var_or_elems(loop.iter, n, "content"):
                return "openai"
    return "string"


# ---- vLLM's message preparation

TEXT_FIELDS = {"text": "text", "input_text": "text", "output_text": "text",
               "refusal": "refusal", "thinking": "thinking"}
MEDIA = {"image_url", "input_image", "image_embeds", "audio_url", "input_audio",
         "audio_embeds", "video_url", "image_pil"}


BILLING = "x-anthropic-billing-header"


def strip_billing(content):
    out = []
    for p in content:
        t = p if isinstance(p, str) else p.get("text") \
            if isinstance(p, dict) and p.get("type") == "text" else None
        if not (isinstance(t, str) and t.startswith(BILLING)):
            out.append(p)
            continue
        rest = t.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(p, str) else {**p, "text": rest})
    return out


def prepare_message(m, fmt):
    role = m["role"]
    content = m.get("content")
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if role == "system":
        content = strip_billing(content)
    parts = []
    for p in content:
        if isinstance(p, str):
            if p or fmt == "openai":
                parts.append(p)
            continue
        t = p.get("type")
        if t in TEXT_FIELDS:
            x = p.get(TEXT_FIELDS[t])
            # a falsy part is not appended (the string format)
            if x is not None and (x or fmt == "openai"):
                parts.append(x)
        elif t in MEDIA or t is None:
            pass            # not counted by the gateway (a text-only model)
        else:
            raise ValueError("Unsupported chat content part type: %r" % t)
    if fmt == "openai":
        out = {"role": role, "content": [{"type": "text", "text": x} for x in parts]}
    else:
        out = {"role": role, "content": "\n".join(parts)}
    if role == "assistant":
        if m.get("tool_calls") is not None:
            out["tool_calls"] = [json.loads(json.dumps(c)) for c in m["tool_calls"]]
        if m.get("reasoning") is not None:
            out["reasoning"] = m["reasoning"]
            out["reasoning_content"] = m["reasoning"]
    elif role == "tool":
        if "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        if isinstance(out["content"], list):
            out["content"] = "\n".join(x["text"] for x in out["content"])
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if isinstance(m.get("task"), str):
        out["task"] = m["task"]
    if role == "developer":
        out["tools"] = m.get("tools")
    return out


def postprocess(msgs):
    for m in msgs:
        if m["role"] == "assistant" and "tool_calls" in m:
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                continue
            if not calls:
                m.pop("tool_calls")
                continue
            for c in calls:
                if not isinstance(c, dict):
                    raise ValueError("assistant tool_calls entries must be objects.")
                fn = c.get("function")
                if c.get("type", "function") != "function" or not isinstance(fn, dict):
                    raise ValueError("chat completions only support assistant "
                                     "tool_calls of type 'function'.")
                a = fn.get("arguments")
                if a and isinstance(a, str):
                    try:
                        a = json.loads(a)
                    except json.JSONDecodeError:
                        a = None
                fn["arguments"] = a if isinstance(a, dict) else {}


def dump_tool(t):
    f = t["function"]
    fn = {"name": f["name"], "description": f.get("description"),
          "parameters": f.get("parameters")}
    for k, v in f.items():
        if k not in fn:
            fn[k] = v
    out = {"type": "function", "function": fn}
    for k, v in t.items():
        if k not in ("type", "function"):
            out[k] = v
    return out


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


def render(env, tmpl, fmt, specials, req):
    if isinstance(req, list):
        req = {"messages": req}
    req = json.loads(json.dumps(req))
    for m in req["messages"]:
        # the deprecated name, renamed when the request is parsed
        rc = m.pop("reasoning_content", None) if isinstance(m, dict) else None
        if rc is not None and m.get("reasoning") is None:
            m["reasoning"] = rc
    msgs = [prepare_message(m, fmt) for m in req["messages"]]
    postprocess(msgs)
    agp = req.get("add_generation_prompt", True)
    cfm = req.get("continue_final_message", False)
    if agp and cfm:
        raise ValueError("Cannot set both `continue_final_message` and "
                         "`add_generation_prompt` to True.")
    user = req.get("chat_template_kwargs") or {}
    effort = req.get("reasoning_effort")
    extra = dict(add_generation_prompt=agp, documents=req.get("documents"),
                 reasoning_effort=effort)
    if effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = effort != "none"
    # merge_kwargs(): None and "auto" override nothing; the request over
    # the kwargs over the tools; continue_final_message is
    # apply_chat_template's own argument, no template variable
    kw = dict(tools=None if req.get("tools") is None
              else [dump_tool(t) for t in req["tools"]], documents=None)
    kw.update({k: v for k, v in user.items()
               if k not in ("messages", "continue_final_message")
               and v is not None and v != "auto"})
    kw.update({k: v for k, v in extra.items() if v is not None})
    variables = dict(specials)
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
    fmt = content_format(env, t)
    tmpl = env.from_string(t)
    specials = special_tokens(cfg)
    out = sys.stdout
    for line in sys.stdin.buffer.read().decode("utf-8").split("\n"):
        if not line:
            continue
        try:
            r = {"text": render(env, tmpl, fmt, specials, json.loads(line))}
        except Exception as e:      # what vLLM answers with 400
            r = {"error": str(e)}
        out.write(json.dumps(r, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
