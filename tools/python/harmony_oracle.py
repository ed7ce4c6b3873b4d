#!/usr/bin/env python3
"""The ids vLLM feeds gpt-oss for an OpenAI chat request, from openai-harmony.

The oracle for ngx_dpd_module/tokenizer/tok_harmony.c: the same input
dpd-tokenize --chat takes (a chat request, or a bare messages array),
prepared as current vLLM prepares it for gpt-oss, rendered by harmony's
own render_conversation_for_completion(conversation, Role.ASSISTANT).

vLLM followed (read, not imported: vLLM needs a GPU stack):
  vllm/renderers/online_renderer.py (commit 01063cd0)
    OnlineRenderer.render_chat: tool_dicts is None only without "tools"
    (exclude_tools_when_tool_choice_none off, the default), and
    _make_request_with_harmony: extract_instructions_from_messages,
    reasoning_effort "none" refused, build_harmony_preamble(instructions,
    tools, reasoning_effort), parse_chat_inputs_to_harmony_messages,
    render_for_completion.
  vllm/entrypoints/openai/parser/harmony_utils.py (the version that
    online_renderer imports: build_harmony_preamble with
    force_developer_instructions, get_system_or_developer_message,
    auto_drop_analysis_messages called by
    parse_chat_inputs_to_harmony_messages, create_tool_definition with
    `description or ""`), with VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS off
    and VLLM_SYSTEM_START_DATE unset (the defaults): the date is today's,
    given here with --date so both sides use the same one.

The vocab: $TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken
(tools/python/make_tiktoken_vocab.py writes it offline).

A vLLM that drops only the current turn's analysis (the other published
form of auto_drop_analysis_messages) is --drop-turn.

usage: harmony_oracle.py [--date YYYY-MM-DD] [--jsonl] [--drop-turn] < input
  one request on stdin: prints its ids, space-separated; exit 2 and the
  reason on stderr when vLLM would refuse it (400).
  --jsonl: one request per line; one line out per request: the ids, or
  "ERROR <reason>".
"""

import datetime
import json
import sys

from openai_harmony import (Author, Conversation, DeveloperContent,
                            HarmonyEncodingName, Message, ReasoningEffort,
                            Role, SystemContent, TextContent,
                            ToolDescription, load_harmony_encoding)

EFFORT = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM,
          "high": ReasoningEffort.HIGH}
ROLES = ("system", "developer", "user", "assistant", "tool")


class Refused(Exception):
    """What vLLM answers with a 400 (pydantic or harmony_utils)."""


def flatten(content):
    """harmony_utils.flatten_input_text_content"""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = []
    for item in content:
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, dict) and item.get("text") is not None:
            texts.append(item["text"])
    return "".join(texts) if texts else None


def check_parts(content):
    """pydantic's ChatCompletionMessageParam and harmony_utils' part-type
    check: text parts only here (the gateway estimates the others)."""
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise Refused("content must be a string, a list of parts or null")
    for c in content:
        if not isinstance(c, dict) or c.get("type") != "text" \
                or not isinstance(c.get("text"), str):
            raise Refused("only text parts are compared")


def system_message(effort, date):
    """harmony_utils.get_system_message (no identity, no builtin tools)"""
    content = SystemContent.new()
    if effort is not None:
        content = content.with_reasoning_effort(EFFORT[effort])
    content = content.with_conversation_start_date(date)
    return Message.from_role_and_content(Role.SYSTEM, content)


def developer_message(instructions, tools):
    """harmony_utils.get_developer_message + create_tool_definition"""
    content = DeveloperContent.new()
    if instructions is not None:
        content = content.with_instructions(instructions)
    if tools is not None:
        descs = [ToolDescription.new(name=t["function"]["name"],
                                     description=t["function"].get(
                                         "description") or "",
                                     parameters=t["function"].get(
                                         "parameters"))
                 for t in tools]
        if descs:
            content = content.with_function_tools(descs)
    return Message.from_role_and_content(Role.DEVELOPER, content)


def chat_message(m, tool_id_names):
    """harmony_utils.parse_chat_input_to_harmony_message"""
    role = m.get("role")
    out = []
    tool_calls = m.get("tool_calls", [])
    if role == "assistant" and tool_calls:
        content = flatten(m.get("content"))
        if content:
            out.append(Message.from_role_and_content(Role.ASSISTANT, content)
                       .with_channel("commentary"))
        reasoning = m.get("reasoning")
        if reasoning:
            out.append(Message.from_role_and_content(Role.ASSISTANT,
                                                     reasoning)
                       .with_channel("analysis"))
        for call in tool_calls:
            func = call.get("function", {})
            name = func.get("name", "")
            args = func.get("arguments", "") or ""
            out.append(Message.from_role_and_content(Role.ASSISTANT, args)
                       .with_channel("commentary")
                       .with_recipient("functions.%s" % name)
                       .with_content_type("json"))
        return out
    if role == "tool":
        name = tool_id_names.get(m.get("tool_call_id", ""), "")
        content = flatten(m.get("content")) or ""
        return [Message.from_author_and_content(
                    Author.new(Role.TOOL, "functions.%s" % name), content)
                .with_channel("commentary").with_recipient("assistant")]
    reasoning = m.get("reasoning")
    if role == "assistant" and reasoning:
        out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning)
                   .with_channel("analysis"))
    content = m.get("content") or ""
    if isinstance(content, str):
        contents = [TextContent(text=content)]
    else:
        contents = [TextContent(text=c.get("text", "")) for c in content]
    if role == "assistant" and contents and contents[0].text:
        out.append(Message.from_role_and_contents(Role.ASSISTANT, contents)
                   .with_channel("final"))
    elif role in ("system", "developer"):
        # get_system_or_developer_message: a developer message either way
        instructions = flatten(m.get("content"))
        if instructions is not None:
            out.append(developer_message(instructions, None))
    elif role != "assistant":
        out.append(Message.from_role_and_contents(Role(role), contents))
    return out


def auto_drop_analysis(msgs):
    """harmony_utils.auto_drop_analysis_messages: every analysis message
    before the last assistant final goes"""
    last = -1
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i].author.role == Role.ASSISTANT \
                and msgs[i].channel == "final":
            last = i
            break
    return [m for i, m in enumerate(msgs)
            if not (i < last and m.channel == "analysis")]


def auto_drop_analysis_turn(msgs):
    """the other published form of auto_drop_analysis_messages (vLLM
    commit 0142105b's harmony_utils.py): only the analysis messages of the
    current turn (after the last user message) before its last final go"""
    start = 0
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i].author.role == Role.USER:
            start = i + 1
            break
    last = -1
    for i in range(len(msgs) - 1, start - 1, -1):
        if msgs[i].author.role == Role.ASSISTANT \
                and msgs[i].channel == "final":
            last = i
            break
    if last < start:
        return msgs
    return [m for i, m in enumerate(msgs)
            if not (start <= i < last and m.channel == "analysis"
                    and m.author.role != Role.USER)]


def validate(req):
    """What ChatCompletionRequest's pydantic model refuses, for the shapes
    the oracle is given."""
    if isinstance(req, list):
        req = {"messages": req}
    if not isinstance(req, dict):
        raise Refused("request must be an object or an array")
    msgs = req.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise Refused("messages: empty or missing")
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise Refused("unknown role")
        check_parts(m.get("content"))
        for c in m.get("tool_calls", []) or []:
            if not isinstance(c, dict) \
                    or not isinstance(c.get("function"), dict):
                raise Refused("tool_calls: not a call")
    effort = req.get("reasoning_effort")
    if effort == "none":
        raise Refused("Harmony does not support reasoning_effort='none'")
    if effort is not None and effort not in EFFORT:
        raise Refused("reasoning_effort: not low, medium or high")
    tools = req.get("tools")
    if tools is not None:
        for t in tools:
            if t.get("type") != "function" \
                    or not isinstance(t.get("function"), dict) \
                    or not isinstance(t["function"].get("name"), str):
                raise Refused("tools: type \"function\" with function.name")
    return req


def render(enc, req, date, drop):
    req = validate(req)
    chat = list(req["messages"])
    # extract_instructions_from_messages
    instructions = None
    if chat[0].get("role") in ("system", "developer"):
        instructions = flatten(chat[0].get("content"))
        chat = chat[1:]
    tools = req.get("tools")
    # build_harmony_preamble
    msgs = [system_message(req.get("reasoning_effort"), date)]
    if instructions or tools:
        msgs.append(developer_message(instructions, tools))
    # parse_chat_inputs_to_harmony_messages
    tool_id_names = {}
    for m in chat:
        for call in m.get("tool_calls", []) or []:
            tool_id_names[call.get("id")] = call.get("function",
                                                     {}).get("name")
    parsed = []
    for m in chat:
        parsed.extend(chat_message(m, tool_id_names))
    msgs.extend(drop(parsed))
    # render_for_completion
    return enc.render_conversation_for_completion(
        Conversation.from_messages(msgs), Role.ASSISTANT)


def main(argv):
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    jsonl = False
    drop = auto_drop_analysis
    args = argv[1:]
    while args:
        a = args.pop(0)
        if a == "--date" and args:
            date = args.pop(0)
        elif a == "--drop-turn":
            drop = auto_drop_analysis_turn
        elif a == "--jsonl":
            jsonl = True
        else:
            sys.stderr.write(__doc__)
            return 2
    enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    data = sys.stdin.buffer.read().decode("utf-8")
    if not jsonl:
        try:
            ids = render(enc, json.loads(data), date, drop)
        except Refused as e:
            sys.stderr.write("refused: %s\n" % e)
            return 2
        print(" ".join(map(str, ids)))
        return 0
    out = []
    for line in data.split("\n"):
        if not line.strip():
            continue
        try:
            out.append(" ".join(map(str, render(enc, json.loads(line),
                                                date, drop))))
        except Exception as e:  # a refusal, or harmony's own error
            out.append("ERROR %s: %s" % (type(e).__name__,
                                         str(e).replace("\n", " ")))
    sys.stdout.write("".join(l + "\n" for l in out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
