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

The preparation follows vLLM's source, read at these commits
(github.com/vllm-project/vllm):
  vllm/renderers/chat_utils/parse_chat_message_content.py  be90fe165bb8
      _parse_chat_message_content: content None -> [], a string -> one
      text part; system text parts lose a leading Claude Code billing
      header line (_strip_claude_code_billing_header); text parts joined
      with "\n" (string format) or kept as {"type": "text", "text": ...}
      plus the part's unknown fields (openai format); assistant:
      tool_calls, "reasoning" as reasoning and reasoning_content; tool:
      tool_call_id, an all-text list joined with "\n"; "name" and "task"
      kept when strings; developer: tools.
  vllm/renderers/chat_utils/parse_chat_message.py  be90fe165bb8
      _postprocess_messages: an empty tool_calls list dropped; entries
      must be objects of type "function" with a function object;
      arguments: falsy -> {}, a dict kept, a string parsed, anything that
      is not then a dict -> {}.
  vllm/entrypoints/openai/chat_completion/protocol.py  002032ee2b18
      _normalize_messages_before: a message's "reasoning_content" is
      popped and becomes "reasoning" when that is unset;
      check_generation_prompt; build_chat_params: add_generation_prompt,
      continue_final_message, documents, reasoning_effort (and
      enable_thinking = reasoning_effort != "none" unless the kwargs set
      it) merged OVER chat_template_kwargs (merge_kwargs: None/"auto"
      values do not override).
  OpenAIServing._preprocess_chat (same era)
      defaults {tools: model_dump()s, tokenize: False} under all of it
      (ChatParams.with_defaults: the kwargs over them).
  vllm/renderers/hf.py  e7ad92e5308e
      content format detection (_detect_content_format),
      safe_apply_chat_template -> tokenizer.apply_chat_template; the
      text is then encoded with add_special_tokens=False (the request's
      default), which is what apply_chat_template(tokenize=True) does.
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jinja2.nodes as nodes                                    # noqa: E402
from transformers import AutoTokenizer                          # noqa: E402
from transformers.utils import chat_template_utils as hf_ctu    # noqa: E402


# ---- vllm/renderers/hf.py: _detect_content_format ("string" / "openai")

def _is_var(node, name):
    return isinstance(node, nodes.Name) and node.ctx == "load" \
        and node.name == name


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


def content_format(src):
    try:
        ast = hf_ctu._compile_jinja_template(src).environment.parse(src)
    except Exception:
        return "string"
    names, queue = ["messages"], ["messages"]
    while queue:
        n = queue.pop(0)
        for a in ast.find_all(nodes.Assign):
            if _is_var_or_elems(a.node, n) and isinstance(a.target, nodes.Name):
                names.append(a.target.name)
                if a.target.name != n:
                    queue.append(a.target.name)
    items = []
    for loop in ast.find_all(nodes.For):
        for n in names:
            if _is_var_or_elems(loop.iter, n):
                items.append(loop.target.name)
                break
    for loop in ast.find_all(nodes.For):
        for n in items:
            if _is_var_or_elems(loop.iter, n, "content"):
                return "openai"
    return "string"


# ---- vLLM's message preparation

TEXT_TYPES = {"text": "text", "input_text": "text", "output_text": "text",
              "refusal": "refusal", "thinking": "thinking"}
MEDIA_TYPES = {"image_url", "input_image", "image_embeds", "audio_embeds",
               "video_embeds", "prompt_embeds", "image_pil", "audio_url",
               "input_audio", "video_url"}
# the fields of the content part TypedDicts vLLM accepts (openai's and its
# own); the others ride along on a text part in the openai format
KNOWN_PART_FIELDS = {"type", "text", "image_url", "input_audio", "refusal",
                     "file", "audio_url", "video_url", "image_pil",
                     "image_embeds", "audio_embeds", "video_embeds", "data",
                     "uuid", "thinking", "closed", "name", "detail",
                     "file_id", "file_url", "filename"}
BILLING = "x-anthropic-billing-header"


class Media(Exception):
    pass


def strip_billing(parts):
    out = []
    for p in parts:
        if isinstance(p, str):
            t = p
        elif isinstance(p, dict) and p.get("type") == "text":
            t = p.get("text")
        else:
            t = None
        if not (isinstance(t, str) and t.startswith(BILLING)):
            out.append(p)
            continue
        rest = t.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(p, str) else {**p, "text": rest})
    return out


def parse_part(p, wrap):
    if isinstance(p, str):
        return {"type": "text", "text": p} if wrap else p
    if not isinstance(p, dict):
        raise ValueError("invalid content part")
    t = p.get("type")
    if t is None or p.get("uuid") is not None:
        if any(k in p for k in MEDIA_TYPES):
            raise Media()
        if "tool_reference" in p:
            t = "tool_reference"
        else:
            raise ValueError("Missing 'type' field in multimodal part.")
    if not isinstance(t, str):
        raise ValueError("Invalid 'type' field in multimodal part.")
    if t in TEXT_TYPES:
        x = p.get(TEXT_TYPES[t])
        if x is None:
            return None         # skipped (text / refusal without content)
        if not wrap:
            return x
        r = {"type": "text", "text": x}
        r.update({k: v for k, v in p.items() if k not in KNOWN_PART_FIELDS})
        return r
    if t in MEDIA_TYPES:
        raise Media()
    if t == "tool_reference":
        n = p.get("name")
        return {"type": "tool_reference", "name": n} if wrap else n
    raise ValueError("Unsupported chat content part type: %r" % t)


def parse_message(m, fmt):
    role = m["role"]
    content = m.get("content")
    reasoning = m.get("reasoning")
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if role == "system":
        content = strip_billing(content)
    wrap = fmt == "openai"
    parts = [x for x in (parse_part(p, wrap) for p in content) if x]
    out = {"role": role, "content": parts if wrap else "\n".join(parts)}
    if role == "assistant":
        if m.get("tool_calls") is not None:
            out["tool_calls"] = list(m["tool_calls"])
        if reasoning is not None:
            out["reasoning"] = reasoning
            out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        c = out["content"]
        if isinstance(c, list) and not any(
                isinstance(x, dict) and x.get("type") != "text" for x in c):
            texts = [x.get("text", "") for x in c
                     if isinstance(x, dict) and x.get("type") == "text"]
            out["content"] = "\n".join(texts) if texts else ""
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if isinstance(m.get("task"), str):
        out["task"] = m["task"]
    if role == "developer":
        out["tools"] = m.get("tools")
    return out


def postprocess(msgs):
    for m in msgs:
        if m["role"] != "assistant" or "tool_calls" not in m:
            continue
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
            if a:
                if isinstance(a, str):
                    try:
                        a = json.loads(a)
                    except json.JSONDecodeError:
                        a = None
                fn["arguments"] = a if isinstance(a, dict) else {}
            else:
                fn["arguments"] = {}


def dump_tool(t):
    """pydantic's model_dump() of vLLM's ChatCompletionToolsParam."""
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


def merge(defaults, overrides):
    """vllm/renderers/params.py merge_kwargs"""
    return {**defaults, **{k: v for k, v in overrides.items()
                           if not (v is None or (isinstance(v, str)
                                                 and v == "auto"))}}


def render(tok, tmpl, fmt, req):
    if isinstance(req, list):
        req = {"messages": req}
    req = json.loads(json.dumps(req))
    for m in req.get("messages") or []:
        if isinstance(m, dict):
            rc = m.pop("reasoning_content", None)
            if rc is not None and m.get("reasoning") is None:
                m["reasoning"] = rc
    agp = req.get("add_generation_prompt", True)
    cfm = req.get("continue_final_message", False)
    if agp and cfm:
        raise ValueError("Cannot set both `continue_final_message` and "
                         "`add_generation_prompt` to True.")
    msgs = [parse_message(m, fmt) for m in req["messages"]]
    postprocess(msgs)
    effort = req.get("reasoning_effort")
    user = req.get("chat_template_kwargs") or {}
    extra = dict(add_generation_prompt=agp, continue_final_message=cfm,
                 documents=req.get("documents"), reasoning_effort=effort)
    if effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = effort != "none"
    tools = req.get("tools")
    defaults = {"tools": None if tools is None else
                [dump_tool(t) for t in tools], "tokenize": False}
    kw = merge(defaults, merge(user, extra))
    kw.pop("tokenize", None)
    kw.pop("chat_template", None)
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
        except Media:
            r = {"media": 1}
        except Exception as e:      # vLLM answers 400
            r = {"error": "%s: %s" % (type(e).__name__, e)}
        out.write(json.dumps(r, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
