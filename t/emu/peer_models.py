#!/usr/bin/env python3
"""Check a running emulator's replies against the peers' own models.

    peer_models.py http://HOST:PORT

The `openai` package's pydantic models (what OpenAI's client parses into)
validate every reply: ChatCompletion, ChatCompletionChunk, Completion (also
the stream chunks), CompletionUsage with prompt_tokens_details, and the
error object (openai.types.shared.ErrorObject).  vLLM's own protocol
classes cannot be imported without torch (vllm 0.33.0: `import vllm` runs
vllm/env_override.py, which imports torch; the protocol modules import
vllm.config and vllm.utils, which import torch too), so their field names
are listed below as vllm 0.33.0 declares them, and every key the emulator
sends must be one of them:
  vllm/entrypoints/openai/chat_completion/protocol.py  ChatCompletionResponse,
      ChatCompletionResponseChoice, ChatMessage, ChatCompletionStreamResponse,
      ChatCompletionResponseStreamChoice
  vllm/entrypoints/generate/base/protocol.py  DeltaMessage
  vllm/entrypoints/openai/completion/protocol.py  CompletionResponse,
      CompletionResponseChoice, CompletionStreamResponse,
      CompletionResponseStreamChoice
  vllm/entrypoints/serve/engine/protocol.py  UsageInfo, PromptTokenUsageInfo,
      ErrorResponse, ErrorInfo
  vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py
      request_finished (the prefill reply's kv_transfer_params)
Prints one JSON line per check: {"name", "ok", "detail"}.
"""

import json
import sys
import urllib.error
import urllib.request

from openai.types import Completion, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject

VLLM = {
    "ChatCompletionResponse": {
        "id", "object", "created", "model", "choices", "service_tier",
        "system_fingerprint", "usage", "prompt_logprobs", "prompt_token_ids",
        "prompt_text", "kv_transfer_params", "ec_transfer_params",
        "metrics"},
    "ChatCompletionResponseChoice": {
        "index", "message", "logprobs", "finish_reason", "stop_reason",
        "token_ids", "routed_experts", "weight_versions"},
    "ChatMessage": {
        "role", "content", "refusal", "annotations", "audio",
        "function_call", "tool_calls", "reasoning"},
    "ChatCompletionStreamResponse": {
        "id", "object", "created", "model", "choices", "usage",
        "system_fingerprint", "prompt_token_ids", "prompt_text", "metrics",
        "kv_transfer_params"},
    "ChatCompletionResponseStreamChoice": {
        "index", "delta", "logprobs", "finish_reason", "stop_reason",
        "token_ids", "weight_versions"},
    "DeltaMessage": {"role", "content", "reasoning", "tool_calls"},
    "CompletionResponse": {
        "id", "object", "created", "model", "choices", "service_tier",
        "system_fingerprint", "usage", "kv_transfer_params",
        "ec_transfer_params", "metrics"},
    "CompletionResponseChoice": {
        "index", "text", "logprobs", "finish_reason", "stop_reason",
        "token_ids", "prompt_logprobs", "prompt_token_ids",
        "routed_experts", "weight_versions"},
    "CompletionStreamResponse": {
        "id", "object", "created", "model", "choices", "usage",
        "system_fingerprint", "metrics", "kv_transfer_params"},
    "CompletionResponseStreamChoice": {
        "index", "text", "logprobs", "finish_reason", "stop_reason",
        "prompt_token_ids", "token_ids", "weight_versions"},
    "UsageInfo": {
        "prompt_tokens", "total_tokens", "completion_tokens",
        "prompt_tokens_details", "completion_tokens_details"},
    "PromptTokenUsageInfo": {
        "cached_tokens", "created_cache_tokens", "multimodal_tokens"},
    "ErrorResponse": {"error"},
    "ErrorInfo": {"message", "type", "param", "code"},
    # pull_scheduler.py request_finished, in its order
    "NixlParams": [
        "do_remote_prefill", "do_remote_decode", "remote_block_ids",
        "remote_engine_id", "remote_request_id", "remote_host",
        "remote_port", "tp_size", "dcp_size", "pp_size",
        "remote_num_tokens", "remote_blocks_expiry_time",
        "remote_registration_generation", "transfer_mode"],
}

BASE = sys.argv[1].rstrip("/") if len(sys.argv) > 1 else ""
FAILS = 0


def report(name, ok, detail=""):
    global FAILS
    FAILS += 0 if ok else 1
    print(json.dumps({"name": name, "ok": bool(ok), "detail": str(detail)}),
          flush=True)


def post(path, body, headers=None):
    req = urllib.request.Request(
        BASE + path, data=json.dumps(body).encode(),
        headers=dict({"Content-Type": "application/json"},
                     **(headers or {})))
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def events(text):
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            out.append(block[6:])
    return out


def keys_in(name, obj, cls):
    extra = sorted(set(obj) - VLLM[cls])
    report("%s: keys are vLLM's %s fields" % (name, cls), not extra,
           "not in vLLM: %s" % extra if extra else "")


def validate(name, model, obj):
    try:
        m = model.model_validate(obj)
    except Exception as e:           # noqa: BLE001 - report any refusal
        report("%s: %s validates" % (name, model.__name__), False, e)
        return None
    report("%s: %s validates" % (name, model.__name__), True)
    return m


def check_usage(name, u, want_details):
    if not isinstance(u, dict):
        report("%s: usage present" % name, False, u)
        return
    keys_in(name + " usage", u, "UsageInfo")
    m = validate(name + " usage", CompletionUsage, u)
    if m is not None:
        report("%s: total_tokens = prompt + completion" % name,
               m.total_tokens == m.prompt_tokens + m.completion_tokens,
               u)
    if want_details:
        d = u.get("prompt_tokens_details")
        ok = (isinstance(d, dict) and isinstance(d.get("cached_tokens"), int)
              and m is not None and m.prompt_tokens_details is not None
              and m.prompt_tokens_details.cached_tokens == d["cached_tokens"])
        report("%s: prompt_tokens_details.cached_tokens parsed" % name, ok, d)
        if isinstance(d, dict):
            keys_in(name + " prompt_tokens_details", d,
                    "PromptTokenUsageInfo")


def chat_body(**kw):
    b = {"model": "m", "max_tokens": 4,
         "messages": [{"role": "user", "content": "hello there"}]}
    b.update(kw)
    return b


def run():
    # chat, not streamed
    st, text = post("/v1/chat/completions", chat_body())
    report("chat: 200", st == 200, st)
    o = json.loads(text)
    validate("chat", ChatCompletion, o)
    keys_in("chat", o, "ChatCompletionResponse")
    for c in o.get("choices", []):
        keys_in("chat choice", c, "ChatCompletionResponseChoice")
        keys_in("chat message", c.get("message", {}), "ChatMessage")
    check_usage("chat", o.get("usage"), False)

    # chat, streamed, with usage
    st, text = post("/v1/chat/completions", chat_body(
        stream=True, stream_options={"include_usage": True}))
    ev = events(text)
    report("chat stream: 200, ends with [DONE]",
           st == 200 and ev and ev[-1] == "[DONE]", ev[-1:] if ev else text)
    chunks = [json.loads(e) for e in ev[:-1]]
    ok = True
    for i, c in enumerate(chunks):
        try:
            ChatCompletionChunk.model_validate(c)
        except Exception as e:       # noqa: BLE001
            ok = False
            report("chat stream chunk %d: ChatCompletionChunk" % i, False, e)
        keys_in("chat chunk %d" % i, c, "ChatCompletionStreamResponse")
        for ch in c.get("choices", []):
            keys_in("chat chunk %d choice" % i, ch,
                    "ChatCompletionResponseStreamChoice")
            keys_in("chat chunk %d delta" % i, ch.get("delta", {}),
                    "DeltaMessage")
    report("chat stream: %d chunks validate as ChatCompletionChunk"
           % len(chunks), ok and len(chunks) >= 3)
    last = chunks[-1] if chunks else {}
    report("chat stream: include_usage: a last chunk with usage and no "
           "choices", last.get("choices") == [] and last.get("usage"), last)
    check_usage("chat stream", last.get("usage"), False)
    report("chat stream: no usage before the last chunk",
           all(not c.get("usage") for c in chunks[:-1]))
    text_all = "".join((ch.get("delta") or {}).get("content") or ""
                       for c in chunks for ch in c.get("choices", []))
    report("chat stream: content tokens = usage.completion_tokens",
           len(text_all.split()) == (last.get("usage") or {}).get(
               "completion_tokens"), text_all)

    # completions, not streamed, with prompt_tokens_details (vLLM:
    # --enable-prompt-tokens-details; the emulator always reports them
    # when the request asks for cached tokens)
    st, text = post("/v1/completions", {"model": "m", "prompt": "a b c d",
                                        "max_tokens": 3})
    report("completions: 200", st == 200, st)
    o = json.loads(text)
    validate("completions", Completion, o)
    keys_in("completions", o, "CompletionResponse")
    for c in o.get("choices", []):
        keys_in("completions choice", c, "CompletionResponseChoice")
    check_usage("completions", o.get("usage"), False)

    # completions, streamed, with usage
    st, text = post("/v1/completions", {
        "model": "m", "prompt": "a b c d", "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    ev = events(text)
    report("completions stream: 200, ends with [DONE]",
           st == 200 and ev and ev[-1] == "[DONE]", ev[-1:] if ev else text)
    chunks = [json.loads(e) for e in ev[:-1]]
    ok = True
    for i, c in enumerate(chunks):
        # openai's Completion (the client's stream chunk type too) types
        # finish_reason as non-null; every streamed chunk but the last
        # carries null, as OpenAI's API and vLLM send it (the client
        # builds chunks without validation): only that is substituted
        v = dict(c, choices=[dict(ch, finish_reason=ch["finish_reason"]
                                  or "stop")
                             for ch in c.get("choices", [])])
        try:
            Completion.model_validate(v)
        except Exception as e:       # noqa: BLE001
            ok = False
            report("completions chunk %d: Completion" % i, False, e)
        keys_in("completions chunk %d" % i, c, "CompletionStreamResponse")
        for ch in c.get("choices", []):
            keys_in("completions chunk %d choice" % i, ch,
                    "CompletionResponseStreamChoice")
    report("completions stream: %d chunks validate as Completion"
           % len(chunks), ok and len(chunks) >= 2)
    last = chunks[-1] if chunks else {}
    report("completions stream: include_usage: last chunk has usage, "
           "no choices", last.get("choices") == [] and last.get("usage"),
           last)
    check_usage("completions stream", last.get("usage"), False)

    # a second identical prompt: cached tokens in prompt_tokens_details
    long_prompt = " ".join("w%d" % i for i in range(200))
    post("/v1/completions", {"model": "m", "prompt": long_prompt,
                             "max_tokens": 1})
    st, text = post("/v1/completions", {"model": "m", "prompt": long_prompt,
                                        "max_tokens": 1})
    o = json.loads(text)
    if isinstance((o.get("usage") or {}).get("prompt_tokens_details"),
                  dict):
        check_usage("completions cached", o.get("usage"), True)
    else:
        report("completions cached: prompt_tokens_details null (vLLM "
               "without --enable-prompt-tokens-details)",
               (o.get("usage") or {}).get("prompt_tokens_details") is None,
               o.get("usage"))

    # errors: the OpenAI shape, as vLLM's ErrorResponse
    for name, path, body in (
            ("max_tokens -1", "/v1/completions",
             {"model": "m", "prompt": "x", "max_tokens": -1}),
            ("no messages", "/v1/chat/completions", {"model": "m"}),
            ("not JSON", "/v1/completions", None)):
        if body is None:
            req = urllib.request.Request(
                BASE + path, data=b"{nope",
                headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=20) as r:
                    st, text = r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                st, text = e.code, e.read().decode()
        else:
            st, text = post(path, body)
        report("error %s: 400" % name, st == 400, st)
        try:
            o = json.loads(text)
        except ValueError:
            report("error %s: JSON" % name, False, text)
            continue
        keys_in("error %s" % name, o, "ErrorResponse")
        e = o.get("error")
        report("error %s: {\"error\": {...}}" % name, isinstance(e, dict), o)
        if not isinstance(e, dict):
            continue
        keys_in("error %s object" % name, e, "ErrorInfo")
        # vLLM's ErrorInfo.code is the HTTP status (int); OpenAI's
        # ErrorObject.code is a string: compare the rest with OpenAI's model
        validate("error %s" % name, ErrorObject,
                 dict(e, code=str(e.get("code"))))
        report("error %s: code is the status, an int (vLLM ErrorInfo)"
               % name, e.get("code") == 400 and type(e.get("code")) is int,
               e.get("code"))
        report("error %s: message a non-empty string" % name,
               isinstance(e.get("message"), str) and e["message"], e)

    # the NIXL prefill reply (pull): kv_transfer_params as request_finished
    st, text = post("/v1/completions", {
        "model": "m", "prompt": long_prompt, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True,
                               "do_remote_prefill": False}},
        {"X-Request-Id": "pm-nixl"})
    o = json.loads(text)
    validate("nixl prefill reply", Completion, o)
    kvp = o.get("kv_transfer_params") or {}
    report("nixl: kv_transfer_params fields and order = vLLM's "
           "request_finished", list(kvp) == VLLM["NixlParams"],
           "got %s" % list(kvp))
    types_ok = (kvp.get("do_remote_prefill") is True
                and kvp.get("do_remote_decode") is False
                and isinstance(kvp.get("remote_block_ids"), list)
                and all(isinstance(g, list) and all(isinstance(b, int)
                                                    for b in g)
                        for g in kvp.get("remote_block_ids", []))
                and isinstance(kvp.get("remote_engine_id"), str)
                and isinstance(kvp.get("remote_request_id"), str)
                and isinstance(kvp.get("remote_host"), str)
                and all(isinstance(kvp.get(k), int) and kvp[k] >= 1
                        for k in ("remote_port", "tp_size", "dcp_size",
                                  "pp_size"))
                and isinstance(kvp.get("remote_num_tokens"), int)
                and isinstance(kvp.get("remote_registration_generation"),
                               int)
                and kvp.get("transfer_mode") == "pull")
    report("nixl: field types as vLLM sets them", types_ok, kvp)
    keys_in("nixl reply", o, "CompletionResponse")


if __name__ == "__main__":
    run()
    sys.exit(1 if FAILS else 0)
