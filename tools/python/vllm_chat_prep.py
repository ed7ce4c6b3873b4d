"""vLLM's OpenAI-server preparation of a chat completion request, up to
the call of transformers' apply_chat_template: the content format of the
template, the messages as the template sees them, and the keyword
arguments.  Shared by tools/python/hf_chat_oracle.py (transformers renders)
and t/tokenizer/jinja-render.py (plain Jinja2 renders, no transformers):
stdlib + jinja2 only; what differs between them (how the template is
parsed, what a media part does) is passed in.

Followed from vLLM's source (github.com/vllm-project/vllm), read at:
  vllm/renderers/hf.py  e7ad92e5308e
      _detect_content_format: names assigned from messages (BFS over
      {% set %}), loops over them, a loop over one's ["content"] ->
      "openai"; an assignment or loop target that is no plain name
      fails an assertion, which the detection turns into its default
      ("string"), as it does a template that does not parse.
  vllm/renderers/chat_utils/parse_chat_message_content.py  be90fe165bb8
  vllm/renderers/chat_utils/mm_parser_map.py  5e29e21aee0e
      _parse_chat_message_content: content None -> [], a string -> one
      text part; system text parts lose a leading Claude Code billing
      header line (_strip_claude_code_billing_header); a part is parsed
      by its type unless it has no type or a uuid (then by the media key
      it holds, or tool_reference, else "Missing 'type'"); text and
      refusal parts without their field are skipped; text parts joined
      with "\n" (string format; falsy ones dropped) or kept as
      {"type": "text", "text": ...} plus the part's unknown fields
      (openai format); assistant: tool_calls, "reasoning" as reasoning
      and reasoning_content; tool: tool_call_id, an all-text list joined
      with "\n"; "name" and "task" kept when strings; developer: tools.
  vllm/renderers/chat_utils/parse_chat_message.py  be90fe165bb8
      _postprocess_messages: an empty tool_calls list dropped; entries
      must be objects of type "function" with a function object;
      arguments: falsy -> {}, a dict kept, a string parsed, anything that
      is not then a dict -> {}.
  vllm/entrypoints/openai/chat_completion/protocol.py  002032ee2b18
      _normalize_messages_before: a message's "reasoning_content" is
      popped and becomes "reasoning" when that is unset;
      check_generation_prompt (a request validator: before the messages
      are parsed); build_chat_params: add_generation_prompt,
      continue_final_message, documents, reasoning_effort (and
      enable_thinking = reasoning_effort != "none" unless the kwargs set
      it) merged OVER chat_template_kwargs (vllm/renderers/params.py
      merge_kwargs: None/"auto" values do not override), all of it over
      the defaults {tools: model_dump()s, tokenize: False}.
"""

import json

from jinja2 import nodes


class Media(Exception):
    """A part vLLM hands to a multimodal model's processor (and refuses
    for a text-only one); the gateway leaves such parts out."""


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


class _NotAName(Exception):
    """vLLM's assert isinstance(target, jinja2.nodes.Name) failing"""


def _target(node):
    if not isinstance(node, nodes.Name):
        raise _NotAName()
    return node.name


def _message_names(ast):
    names, queue = ["messages"], ["messages"]
    while queue:
        n = queue.pop(0)
        for a in ast.find_all(nodes.Assign):
            if _is_var_or_elems(a.node, n):
                t = _target(a.target)
                names.append(t)
                if t != n:          # a self-assignment is not followed
                    queue.append(t)
    return names


def content_format(src, parse):
    """The content format vLLM detects for template source src; parse
    turns it into a Jinja2 AST as the renderer's environment does."""
    try:
        ast = parse(src)
    except Exception:
        return "string"
    try:
        names = _message_names(ast)
        items = []
        for loop in ast.find_all(nodes.For):
            if any(_is_var_or_elems(loop.iter, n) for n in names):
                items.append(_target(loop.target))
        for loop in ast.find_all(nodes.For):
            if any(_is_var_or_elems(loop.iter, n, "content") for n in items):
                _target(loop.target)
                return "openai"
    except _NotAName:
        return "string"
    return "string"


# ---- vllm/renderers/chat_utils: the messages

TEXT_TYPES = {"text": "text", "input_text": "text", "output_text": "text",
              "refusal": "refusal", "thinking": "thinking"}
# the types whose part is skipped when its field is absent or null
SKIP_NONE_TYPES = {"text", "refusal"}
MEDIA_TYPES = {"image_url", "input_image", "image_embeds", "audio_embeds",
               "video_embeds", "prompt_embeds", "image_pil", "audio_url",
               "input_audio", "video_url"}
# a part without a type (or with a uuid) is media by one of these keys
MEDIA_KEYS = ("image_url", "image_pil", "image_embeds", "audio_embeds",
              "video_embeds", "prompt_embeds", "audio_url", "input_audio",
              "video_url")
# the fields of the content part TypedDicts vLLM accepts (openai's and its
# own); the others ride along on a text part in the openai format
KNOWN_PART_FIELDS = {"type", "text", "image_url", "input_audio", "refusal",
                     "file", "audio_url", "video_url", "image_pil",
                     "image_embeds", "audio_embeds", "video_embeds", "data",
                     "uuid", "thinking", "closed", "name", "detail",
                     "file_id", "file_url", "filename"}
BILLING = "x-anthropic-billing-header"


def strip_billing(parts):
    """A system message's text parts lose Claude Code's attribution line
    (its cch changes on every request); a part that was only that line
    goes."""
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
    """One content part: a string (string format), a dict (openai format)
    or None (skipped); raises Media for a media part."""
    if isinstance(p, str):
        return {"type": "text", "text": p} if wrap else p
    if not isinstance(p, dict):
        raise ValueError("invalid content part")
    t = p.get("type")
    if t is None or p.get("uuid") is not None:
        if any(k in p for k in MEDIA_KEYS):
            raise Media()
        if "tool_reference" not in p:
            raise ValueError("Missing 'type' field in multimodal part.")
        t = "tool_reference"
    if not isinstance(t, str):
        raise ValueError("Invalid 'type' field in multimodal part.")
    if t in TEXT_TYPES:
        x = p.get(TEXT_TYPES[t])
        if x is None and t in SKIP_NONE_TYPES:
            return None
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


def parse_message(m, fmt, media="raise"):
    """One message as the template sees it.  media: "raise" (Media) or
    "drop" (the part is left out, as the gateway counts it)."""
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
    parts = []
    for p in content:
        try:
            x = parse_part(p, wrap)
        except Media:
            if media != "drop":
                raise
            continue
        if x:
            parts.append(x)
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
    """_postprocess_messages: the assistants' tool calls checked and their
    arguments turned into objects"""
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
            if a and isinstance(a, str):
                try:
                    a = json.loads(a)
                except json.JSONDecodeError:
                    a = None
            fn["arguments"] = a if a and isinstance(a, dict) else {}


# ---- the request: options over chat_template_kwargs over the defaults

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


def prepare(req, fmt, media="raise"):
    """A request (an object with "messages", or the bare list) ->
    (messages, kwargs): what vLLM hands to apply_chat_template.  kwargs
    hold tools, add_generation_prompt, continue_final_message and the
    template variables; raises ValueError where vLLM answers 400."""
    if isinstance(req, list):
        req = {"messages": req}
    req = json.loads(json.dumps(req))       # nothing shared with the caller
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
    msgs = [parse_message(m, fmt, media) for m in req["messages"]]
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
    # the caller renders to text; the template is the caller's
    kw.pop("tokenize", None)
    kw.pop("chat_template", None)
    return msgs, kw
