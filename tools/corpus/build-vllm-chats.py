#!/usr/bin/env python3
"""Generate whole OpenAI chat requests the way users send them to vLLM,
for the chat template oracle tests (t/tokenizer/21-chat-templates.t).

    build-vllm-chats.py [--out FILE] [--seed 7] [--n 300] [--alternate]
                        [--js-safe]

Each line is a request object: "messages" (system/developer/user/assistant/
tool turns; content a string, null, or parts: text, refusal, image_url),
assistant tool calls with JSON, empty and invalid "arguments", "reasoning",
<think> blocks), and sometimes "tools" (with and without description and
parameters), "chat_template_kwargs" (enable_thinking, a custom variable),
"add_generation_prompt": false, "continue_final_message": true,
"documents".  --alternate keeps user/assistant alternation (templates that
raise otherwise); --js-safe leaves out the whitespace where Python's
str.strip and JavaScript's trim differ (U+001C-U+001F, U+0085, U+FEFF).
"""

import argparse
import json
import random

TEXTS = ["Hello!", "What is the capital of France?", "  padded  ", "\n\nnewlines\n",
         "\tTabbed\t", "Paris.", "你好，世界", "مرحبا", "नमस्ते", "👨‍👩‍👧 ok",
         "<|eot_id|> inside", "<|im_start|>fake", "line1\nline2\r\nline3",
         "code:\n```python\nprint('hi')\n```\n", "I'm sure you'll see.",
         "\u3000ideographic space\u3000", "\u00a0nbsp\u00a0", "", " ",
         "12345678901234567890", "<tool_response>\nwrapped\n</tool_response>",
         "{\"json\": [1, 2, 3]}", "quote \" backslash \\ done", "Ünïcödé ÇÀ ß ﬁ",
         "{{ not a template }} {% raw %}", "tab\tand\u2028line sep"]
PY_ONLY_WS = ["\x1cfile sep\x1f", "\x85next line\x85", "\ufeffbom\ufeff"]
THINK = ["<think>\nreasoning here\n</think>\n\nThe answer is 4.",
         "<think>short</think>answer", "prefix</think>\n\nafter",
         "<think>\n\n</think>\n\nempty thoughts", "a</think>b</think>c"]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web — für alle.",
        "parameters": {"type": "object", "properties": {
            "q": {"type": "string"}, "n": {"type": "integer", "default": 3}}}}},
    {"type": "function", "function": {"name": "now"}},
    {"function": {"name": "calc", "description": "Calculator",
                  "parameters": {"type": "object", "properties": {
                      "expr": {"type": "string"}}, "required": ["expr"]}},
     "type": "function"},
]


def text(rng, js_safe):
    if not js_safe and rng.random() < 0.05:
        return rng.choice(PY_ONLY_WS)
    return rng.choice(TEXTS)


def content(rng, js_safe, allow_null=False):
    r = rng.random()
    if allow_null and r < 0.05:
        return None
    t = text(rng, js_safe)
    if r < 0.15:
        return [{"type": "text", "text": t}, {"type": "text", "text": text(rng, js_safe)}]
    if r < 0.2:
        return [{"type": "text", "text": t}]
    if r < 0.23:
        return [{"type": "text", "text": t},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    if r < 0.25:
        return [t, {"type": "text", "text": "second"}]
    return t


def tool_call(rng, k, js_safe):
    # JavaScript prints 1e-7 where Python's json.dumps prints 1e-07
    args = rng.choice([{"city": "Paris", "unit": "c"}, {"q": "中文", "n": 3},
                       {"flag": True, "x": None, "list": [1, 2.5, "s"],
                        "f": 0.5 if js_safe else 1e-7}, {}])
    r = rng.random()
    raw = "not json" if r < 0.08 else "" if r < 0.14 else json.dumps(args, ensure_ascii=r < 0.5)
    return {"id": "call_%d" % k, "type": "function",
            "function": {"name": rng.choice(["get_weather", "search", "calc"]),
                         "arguments": raw}}


def chat(rng, alternate, js_safe):
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": content(rng, js_safe)})
    for _ in range(rng.randint(1, 5)):
        msgs.append({"role": "user", "content": content(rng, js_safe)})
        r = rng.random()
        if r < 0.3 and not alternate:
            n = rng.randint(1, 2)
            msgs.append({"role": "assistant",
                         "content": rng.choice(["", "Let me check.", None]),
                         "tool_calls": [tool_call(rng, k, js_safe) for k in range(n)]})
            for k in range(n):
                msgs.append({"role": "tool", "tool_call_id": "call_%d" % k,
                             "content": rng.choice(["22 degrees", "{\"ok\": true}",
                                                    "multi\nline", "  spaced  ",
                                                    [{"type": "text", "text": "part"}]])})
            if rng.random() < 0.7:
                msgs.append({"role": "assistant", "content": content(rng, js_safe)})
        elif r < 0.45:
            m = {"role": "assistant", "content": rng.choice(THINK)}
            if rng.random() < 0.3:
                m["reasoning"] = "explicit reasoning"
            msgs.append(m)
        elif r < 0.85 or alternate:
            msgs.append({"role": "assistant", "content": content(rng, js_safe, True)})
    req = {"model": "m", "messages": msgs}
    r = rng.random()
    if r < 0.3 and not alternate:
        req["tools"] = rng.sample(TOOLS, rng.randint(1, len(TOOLS)))
    if rng.random() < 0.25:
        req["chat_template_kwargs"] = rng.choice([
            {"enable_thinking": False}, {"enable_thinking": True},
            {"custom_note": "x", "enable_thinking": False}])
    r = rng.random()
    if r < 0.08:
        req["add_generation_prompt"] = False
    elif r < 0.14 and msgs[-1]["role"] == "assistant" \
            and isinstance(msgs[-1]["content"], str) and msgs[-1]["content"].strip():
        req["add_generation_prompt"] = False
        req["continue_final_message"] = True
    if rng.random() < 0.05:
        req["documents"] = [{"title": "Doc", "text": "Some text."}]
    return req


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="build/corpus/vllm-chats.jsonl")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--alternate", action="store_true")
    ap.add_argument("--js-safe", action="store_true")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    with open(a.out, "w", encoding="utf-8") as f:
        for _ in range(a.n):
            f.write(json.dumps(chat(rng, a.alternate, a.js_safe), ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
