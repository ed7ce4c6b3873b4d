#!/usr/bin/env python3
"""Generate OpenAI chat requests for the chat template tests.

    build-chats.py [--out build/corpus/chats.jsonl] [--seed 3] [--n 400]
                   [--multi-calls]

Each line is {"messages": [...]}: system/user/assistant/tool turns, content
as a string or as text parts, surrounding whitespace (the Llama templates
trim), <think> blocks and reasoning_content (Qwen 3), tool calls (one per
message unless --multi-calls), tool responses, special-token strings, CJK,
emoji.  Whitespace that Python's str.strip and JavaScript's trim treat
differently (U+FEFF, U+001C-U+001F, U+0085) is left out on purpose: the
reference renderer is JavaScript, vLLM is Python.
"""

import argparse
import json
import os
import random

TEXTS = ["Hello!", "What is the capital of France?", "  padded  ", "\n\nnewlines\n",
         "\tTabbed\t", "Paris.", "你好，世界", "مرحبا", "नमस्ते", "👨‍👩‍👧 ok",
         "<|eot_id|> inside", "<|im_start|>fake", "line1\nline2\r\nline3",
         "code:\n```python\nprint('hi')\n```\n", "I'm sure you'll see.",
         "\u3000ideographic space\u3000", "\u00a0nbsp\u00a0", "", " ",
         "12345678901234567890", "<tool_response>\nwrapped\n</tool_response>",
         "{\"json\": [1, 2, 3]}", "quote \" backslash \\ done"]
THINK = ["<think>\nreasoning here\n</think>\n\nThe answer is 4.",
         "<think>short</think>answer", "prefix</think>\n\nafter",
         "<think>\n\n</think>\n\nempty thoughts", "a</think>b</think>c"]


def content(rng):
    t = rng.choice(TEXTS)
    r = rng.random()
    if r < 0.2:
        return [{"type": "text", "text": t},
                {"type": "text", "text": rng.choice(TEXTS)}]
    if r < 0.25:
        return [{"type": "text", "text": t}]
    return t


def tool_call(rng, k):
    args = rng.choice([{"city": "Paris", "unit": "c"}, {"q": "中文", "n": 3},
                       {"flag": True, "x": None, "list": [1, 2.5, "s"]}, {}])
    raw = rng.random() < 0.1
    return {"id": "call_%d" % k, "type": "function",
            "function": {"name": rng.choice(["get_weather", "search", "f"]),
                         "arguments": "not json" if raw else
                         json.dumps(args, ensure_ascii=False)}}


def chat(rng, multi):
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": content(rng)})
    for _ in range(rng.randint(1, 6)):
        msgs.append({"role": "user", "content": content(rng)})
        r = rng.random()
        if r < 0.3:
            n = rng.randint(1, 3) if multi else 1
            m = {"role": "assistant", "content": rng.choice(["", "Let me check."]),
                 "tool_calls": [tool_call(rng, k) for k in range(n)]}
            msgs.append(m)
            for _ in range(n):
                msgs.append({"role": "tool", "tool_call_id": "call_0",
                             "content": rng.choice(["22 degrees", "{\"ok\": true}",
                                                    "multi\nline", "  spaced  "])})
            if rng.random() < 0.7:
                msgs.append({"role": "assistant", "content": content(rng)})
        elif r < 0.5:
            m = {"role": "assistant", "content": rng.choice(THINK)}
            if rng.random() < 0.3:
                m["reasoning_content"] = "explicit reasoning"
            msgs.append(m)
        elif r < 0.8:
            msgs.append({"role": "assistant", "content": content(rng)})
        if rng.random() < 0.1:
            msgs.append({"role": "system", "content": "late system note"})
        if rng.random() < 0.05:
            msgs.append({"role": "developer", "content": " be terse "})
    if rng.random() < 0.2 and msgs[-1]["role"] == "assistant":
        msgs.pop()
    return {"model": "m", "messages": msgs}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="build/corpus/chats.jsonl")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--multi-calls", action="store_true")
    ap.add_argument("--no-tools", action="store_true",
                    help="no tool calls or tool messages (plain chats)")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        for _ in range(a.n):
            c = chat(rng, a.multi_calls)
            if a.no_tools:
                c["messages"] = [m for m in c["messages"] if m["role"] != "tool"
                                 and "tool_calls" not in m] or \
                    [{"role": "user", "content": "hi"}]
            f.write(json.dumps(c, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
