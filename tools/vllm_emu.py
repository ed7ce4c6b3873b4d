#!/usr/bin/env python3
"""vLLM emulator for the DPD gateway tests, demo and benchmarks.

Speaks vLLM's OpenAI-compatible HTTP API (shapes of vLLM 0.9.x), models GPU
timing with one continuous-batching scheduler loop per instance, implements
the NIXL (pull) and LMCache (push) prefill/decode handoffs between
instances, and exposes fault injection and a JSON view of what it received
so tests can assert what nginx forwarded.  Python 3 standard library only.

Run `tools/vllm_emu.py --help` for flags, endpoints and formats.
"""

import argparse
import array
import ctypes
import hashlib
import json
import os
import re
import select
import signal
import socket
import socketserver
import struct
import sys
import threading
import time
import traceback
import uuid
import zlib
from collections import OrderedDict, deque
try:                               # --lmcache-proxy, --kv-events-config
    import zmq
except ImportError:                # only those options need it
    zmq = None
try:                               # --lmcache-proxy
    import msgpack
except ImportError:
    msgpack = None
from email.utils import formatdate

VERSION = "0.9.2-emu"

HELP_EPILOG = r"""
ENDPOINTS (as vLLM)
  POST /v1/completions        prompt: string | [string] | [ids] | [[ids]]
  POST /v1/chat/completions   messages (rendered with the chat template)
  GET  /v1/models   GET /health   GET /metrics (Prometheus text)
  Bodies, SSE framing (`data: {...}\n\n` ... `data: [DONE]\n\n`, chunked
  transfer encoding on HTTP/1.1, close-delimited on HTTP/1.0) and errors
  ({"object":"error","message":..,"type":..,"param":null,"code":N}) follow
  vLLM 0.9.  Response ids: "cmpl-<X-Request-Id>" / "chatcmpl-<X-Request-Id>"
  (a uuid without the header); engine request ids (NIXL remote_request_id):
  "cmpl-<X-Request-Id>-<prompt index>" / "chatcmpl-<X-Request-Id>".
  n must be 1.  Unknown fields are ignored.  Any "model" is accepted.
  Deviations: max_tokens defaults to --default-max-tokens for chat as well;
  prompt_tokens_details is filled (as with --enable-prompt-tokens-details);
  generation never emits EOS: finish_reason is "length" or "stop" (stop=).
  POST /reset_prefix_cache    (vLLM's, dev mode there) forget every cached
  block; refused (logged, 200 all the same) while blocks are in use.

EMULATOR ENDPOINTS (tests)
  GET  /emu/stats[?since=N]  JSON: {"instance":{..},"counters":{..},
        "kv":{"block_size","total_blocks","used_blocks","nixl_held":
        [{"request_id","blocks","tokens","age_s"}],"nixl_held_blocks",
        "lmcache_held":[{"key","req_id","tokens","age_s"}],
        "lmcache_held_chunks","lmcache_held_tokens","kv_agent":null|{
        "socket","node","registered","error","pool" (the agent's geometry),
        "src_free_blocks","agent_free_blocks","held":[{"req_id","peer",
        "blocks","age_s"}] (source blocks of pushes in flight),
        "held_blocks"}},
        "scheduler":{"running","waiting","pulling","steps","busy_s"},
        "faults":[rules], "requests":[records], "next":N}
        counters (present once non-zero): requests_total,
        responses_{2,4,5}xx_total, aborted_total, faults_total, steps_total,
        prefill_tokens_computed_total, decode_tokens_total,
        cached_tokens_total, prefill_requests_total, nixl_held_total,
        nixl_served_total, nixl_pull_{ok,failed,mismatch}_total,
        nixl_transferred_tokens_total (KV tokens this decoder's pulls moved),
        nixl_expired_total, nixl_replaced_total, nixl_invalid_params_total,
        lmcache_push_{ok,failed}_total,
        lmcache_inits_total, lmcache_received_chunks_total,
        lmcache_hit_tokens_total, lmcache_expired_chunks_total,
        kv_agent_{pushed,push_failed,push_done,push_lost}_total,
        kv_agent_{ready,not_ready,failed,mismatch,no_agent}_total,
        kv_agent_late_released_total (the same
        names with an emu_ prefix are in /metrics).
        A record: {"n","t","method","path","request_id" (X-Request-Id),
        "client_request_id" (X-Client-Request-Id: the gateway forwards the
        client's id so, and sends its own as X-Request-Id),
        "headers" (lower-case names),"body" (parsed JSON, or null and
        "body_raw"),"status","fault","stream","prompt_tokens",
        "cached_tokens","completion_tokens","finish_reason","text",
        "aborted","kv":{..protocol outcome..},"ttft_ms","duration_ms"},
        plus "body_text" (the body as received, first 64 KiB) when it
        names kv_transfer_params and "kv_reply_raw" (the reply's
        kv_transfer_params as sent) when it answered some;
        status 0 = connection closed before a full answer.  kv, e.g.
        {"protocol":"nixl","side":"consumer","outcome":"ok"|"mismatch"|
        "failed: ..","cached_tokens":N,"remote_host",..} or
        {"protocol":"lmcache","side":"producer","outcome":"pushed"|
        "push failed: ..","chunks":N,"receiver":"host:port",..} or
        {"protocol":"kv_agent","side":"producer","outcome":"pushed"|
        "failed: ..","req_id","decode_node","blocks":N,"src_blocks",
        "push_state"} or {"protocol":"kv_agent","side":"consumer",
        "outcome":"ready"|"not_ready"|"failed"|"mismatch"|"no_agent",
        "req_id","state" (the agent's),"blocks","cached_tokens","error"}.
        kv.prefix_cache: {"enabled","queries","hits" (tokens),"requests",
        "stored_blocks","evicted_blocks","resets","resets_refused",
        "cached_blocks","free_blocks","cached_free_blocks"}; kv.kv_events:
        null or the publisher's state (as GET /emu/kv_events).  A record
        also has "prefix_cache_hit_tokens" (its cached_tokens is what the
        usage reports: the prefix-cache hit or the transferred KV).
  POST /emu/reset            forget request records and zero counters
  GET|POST /emu/kv_events    KV event publisher: {"endpoint",
        "replay_endpoint","topic","form","hash","next_seq","sent",
        "dropped","restarts","replays","replayed","buffered",..}; POST
        {"drop":N} publishes the next N batches to the replay buffer only
        (their seq is used: subscribers see a gap), {"restart":true}
        reopens the sockets with seq from 0 and an empty replay buffer,
        {"inject":KIND} publishes one bad batch in the stream (next seq,
        kept for replay as any other): "garbage" (not msgpack), "huge" (a
        batch of 17 MiB, over a subscriber's 16 MiB bound), "many" (70000
        events, over its 65536), "unknown" (events of unknown types only).
  GET|POST|DELETE /emu/fault fault rules (see FAULTS)

FAULTS  (flags apply one rule from the start; POST /emu/fault replaces the
  rules at run time with one rule object, {"rules":[...]}, or {} to clear)
  A rule: {"status":N, "delay_ms":N, "hang":true, "disconnect_after":N,
  "reset":true (abort the connection with a TCP RST, nothing answered),
  "malformed_json":true, "kv_override":{..}, "kv_remove":[names],
  "kv_drop":true,
  "pad_bytes":N, "path":"/v1/completions", "role":"prefill"|"decode"|"any",
  "count":K}.  kv_override merges its fields into the reply's
  kv_transfer_params (e.g. a foreign remote_host; objects one level deep,
  so {"dpd":{"state":"failed"}} keeps dpd.req_id); kv_remove drops those
  fields from them (a reply without remote_port); kv_drop answers without
  them (blocks stay held until they expire); pad_bytes adds a field of N
  bytes to a non-streaming JSON reply (oversized reply).  path/role scope
  a rule (role = the request's: "prefill" when it carries do_remote_decode,
  a disagg_spec or dpd.decode_node, else "decode"); count = only the next
  K matching requests; the first matching rule applies.  disconnect_after:
  streaming: close after N SSE events; non-streaming: send the headers and N
  bytes of the body (N=0: close without answering).  delay_ms is real time
  (not scaled).  Rules apply to /v1/* generation endpoints unless "path"
  names another one (/health, /v1/models, /metrics).

PREFIX CACHING (vLLM v1; --no-enable-prefix-caching turns it off)
  The pod's --kv-blocks are one pool.  A request's full blocks are cached
  under chained hashes (sha256 over the parent hash, the block's token ids
  and its extra keys: the LoRA name (--lora-modules) on every block, the
  request's cache_salt on block 0; the seed is PYTHONHASHSEED's or random
  per process, as vLLM's NONE_HASH) as they are computed, the output's too
  (a generated word's id is the tokenizer's id for it).  At admission the
  longest run of cached blocks from block 0, at most (prompt - 1) tokens
  (vLLM always computes the last token), is reused, not with
  prompt_logprobs; KV from a transfer (nixl, lmcache, kv_agent) is cached
  on arrival (a NIXL decoder pulls, and times, only the blocks it lacks:
  kv.transferred_tokens); cached_tokens = the larger of the two.  Freed blocks keep
  their hash in the free queue (LRU; a request's blocks are freed tail
  first) until reused; blocks of running or held requests are never
  evicted.  Metrics: vllm:prefix_cache_queries_total, _hits_total.
  --kv-events-config (vllm/config/kv_events.py's JSON; needs pyzmq):
  ZeroMQ PUB (bound when the endpoint has * or ::, else connected), frames
  (topic, seq 8 bytes big-endian from 0, msgpack [ts, events, 0]), one
  batch per scheduler step with events: BlockStored (block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium "GPU",
  lora_name, extra_keys one per block, group_idx 0, kv_cache_spec_kind
  "full_attention"), BlockRemoved (evictions), AllBlocksCleared (reset).
  --kv-events-form map: {"type":..} maps without null-defaulted fields
  (vLLM 0.26), replay replies [topic, seq, payload], end ["", 0xFF*8,
  ""]; typed: the same with extra_keys as tagged structs ({"type":
  "cache_salt","salt":..}, {"type":"lora","name":..}; vLLM main after
  0.26); array: positional ["BlockStored", ...] with every field (vLLM
  0.10-0.25), replay replies [seq, payload], end [0xFF*8, ""]; array0:
  vLLM 0.9's (BlockStored [name, hashes, parent, token_ids, block_size,
  lora_id], BlockRemoved [name, hashes], batch [ts, events]).  Hashes: the
  digest's last 8 bytes as uint64 or the 32 bytes (--kv-events-hash).
  --data-parallel-rank N: the batches' rank; both ports shifted by N.
  --kv-events-bind-host ADDR: tcp://*:P bound on ADDR only (a pod's own
  address: several emulators share the ports, as pods behind a name).
  replay_endpoint: ROUTER; a request [identity, "", start_seq] gets every
  kept batch (buffer_steps) from start_seq on, then the end marker.

TIMING MODEL  One scheduler thread: each step runs every decoding sequence
  (1 token each) plus prefill chunks up to --max-num-batched-tokens; a step
  lasts decode-step-ms + chunk_tokens/prefill-tps (a co-located prefill
  chunk lengthens everybody's decode step), times --time-scale.  The step
  that finishes a prompt yields its first token.

PREFILL PROTOCOLS
  nixl (pull): a request with kv_transfer_params.do_remote_decode=true on a
    prefill/both instance is prefilled, answers with kv_transfer_params
    {do_remote_prefill:true, do_remote_decode:false, remote_block_ids,
    remote_engine_id, remote_request_id, remote_host, remote_port (side
    channel), tp_size:1, dcp_size:1, pp_size:1, remote_num_tokens (the
    prompt), remote_blocks_expiry_time:null, transfer_mode:"pull"} as
    current vLLM does (--nixl-reply-shape groups: remote_block_ids is one
    list per KV cache group, --kv-cache-groups of them; group 0 the
    prompt's blocks, the others a one-block tail with ids g*--kv-blocks+id;
    --nixl-reply-shape flat: one flat list, only the fields up to tp_size)
    and holds its full prompt blocks until pulled or --kv-lease-duration
    (= --kv-hold-timeout) passes.  A decode/both instance given
    do_remote_prefill=true checks the params as vLLM's
    update_state_after_alloc does (remote_block_ids non-empty and
    remote_engine_id, remote_request_id, remote_host, remote_port present,
    else it logs "Got invalid KVTransferParams" and recomputes, counted in
    nixl_invalid_params_total) and pulls from remote_host:remote_port (line
    JSON over TCP); the side channel answers with the prompt's token hash
    and the block ids as published; both must match what the decoder got.
    cached_tokens = block_size * floor((prompt_tokens-1)/block_size), capped
    by the blocks pulled (the last token is always recomputed).  A failed or
    mismatching pull recomputes (cached_tokens 0), counted.  Wire: one
    JSON line {"op":"pull","request_id","engine_id","block_ids"} -> one
    line {"ok":true,"engine_id","request_id","block_ids","n_blocks",
    "tokens","n_prompt","token_hash","block_size"} (or {"ok":false,
    "error"}); the blocks are freed once answered.
  lmcache (push): a request with kv_transfer_params.disagg_spec on a
    prefill/both instance is prefilled, then its KV chunks
    (--lmcache-chunk-size tokens, last partial chunk included, keyed by a
    hash of the chunk's token ids and everything before them) are pushed to
    receiver_host: receiver_init_port[0] (handshake), receiver_alloc_port[0]
    (allocation + data); the reply's kv_transfer_params is
    {"first_tok": <token id>} when ret_first_tok is given (as LMCache's
    connector answers; choices[0].text is that token's text).  The prompt
    may be token ids (LMCache's proxy sends ids).  With
    --lmcache-push-delay-ms D the push runs D ms after the reply, as
    LMCache's asynchronous sender does (a decode sent before it lands
    finds nothing and recomputes).  With --lmcache-proxy HOST:PORT (the
    sender's pd_proxy_host:pd_proxy_port) each TP rank (one per
    receiver_init_port entry) then sends ProxyNotif over its own ZeroMQ
    PUSH connection, msgspec's msgpack encoding of the tagged struct:
    {"type": "ProxyNotif", "req_id": <disagg_spec.req_id>}; fault keys
    lmc_notices (how many ranks notify, 0: none) and lmc_dup (each repeats
    its notice that often more) model lost and repeated notices; the
    record's "lmc_notified" is the wall time (s) the notices went.  A decode/both instance listens on its own address
    on --lmcache-init-port/--lmcache-alloc-port and reports as cached the
    leading prompt tokens whose chunks it holds (minus one if that is the
    whole prompt), then frees them.  Chunks not used expire after
    --kv-hold-timeout.  Wire: {"op":"init","sender","req_id"} on the init
    port, then {"op":"alloc","req_id","chunks":[{"key","n_tokens"}]} on the
    alloc port, each answered by one line {"ok":true,..}.
  kv_agent (push through this project's agent, --kv-agent-socket): at start
    the instance creates a memfd pool of the agent's geometry (info) and
    registers it (register_pool, SCM_RIGHTS); it re-registers when the agent
    comes back after being unreachable. A request with kv_transfer_params
    {"dpd":{"req_id":ID,"decode_node":NODE}} on a prefill/both instance is
    prefilled, then its full prompt blocks (floor(P/block_size)) get source
    blocks of that pool, are filled with bytes derived from the prompt's
    token ids (block i of layer-region lr: SHAKE-128 of a chained SHA-256
    over the token ids of blocks 0..i, its first 8 bytes replaced by <u32 i,
    u32 lr>), and are pushed (push req_id=ID, peer=NODE, src_runs; no dst:
    the receiver picks or uses its reservation). The reply's
    kv_transfer_params is {"dpd":{"req_id":ID,
    "blocks":N,"state":"pushed"|"failed"}}: pushed = the agent accepted it
    (with --kv-push-wait-ms: the sender finished it; the receiver may mark
    it ready a moment later); failed = no agent, unknown or
    unconnected peer, source pool full... N = 0 with pushed means nothing to
    send (prompt shorter than a block): do not wait for it. Source blocks
    are freed, and the agent's push record released, when the push ends. A
    request with {"dpd":{"req_id":ID}} on a decode/both instance polls the
    agent for ID (or waits up to --kv-wait-ms, also for an ID the agent does
    not know yet); when it is ready, the landed blocks (blocks_runs,
    ascending = push order) must hold the bytes its own prompt tokens give,
    else "mismatch"; cached_tokens = block_size *
    floor((prompt_tokens-1)/block_size), capped by the blocks landed (as
    nixl). The request is released at the agent in every final case (ready,
    failed, mismatch); one that is not final yet is released by a background
    waiter once it is (late_released). Anything but ready recomputes
    (cached_tokens 0), counted by outcome.
  Transfer time: --kv-transfer-gbps > 0 adds tokens*kv-bytes-per-token/rate
  (times --time-scale) to the pull (nixl) or the push (lmcache); kv_agent
  transfers are real (the agents move the bytes).
"""

WORDS = (
    "the of and to in is was for on that with as by at from his it an were "
    "are which this be or has had first one their its new after who they "
    "two her she been other when time during there into school more years "
    "over only city some world would where later up such used many can "
    "state about national out known university united then made"
).split()


# what vLLM's NIXL consumer needs besides remote_block_ids
# (NixlPullConnectorScheduler.update_state_after_alloc)
NIXL_REQUIRED = ("remote_engine_id", "remote_request_id", "remote_host",
                 "remote_port")


def now_ms():
    return time.monotonic() * 1000.0


def jdump(obj):
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


class ApiError(Exception):
    def __init__(self, status, message, etype=None):
        Exception.__init__(self, message)
        self.status = status
        self.message = message
        self.etype = etype or {400: "BadRequestError", 404: "NotFoundError",
                               500: "InternalServerError",
                               503: "ServiceUnavailableError"}.get(
                                   status, "Error")

    def body(self):
        # vLLM's ErrorResponse (entrypoints/serve/engine/protocol.py, 0.33.0):
        # the OpenAI shape, {"error": {...}}, code the HTTP status
        return jdump({"error": {"message": self.message,
                                "type": self.etype, "param": None,
                                "code": self.status}})


# ---------------------------------------------------------------------------
# Tokenizer: the project's library through ctypes, or a rough fallback.
# ---------------------------------------------------------------------------

class LibTokenizer(object):
    """build/libdpdtok.so (ngx_dpd_module/tokenizer/dpd_tokenizer.h)."""

    def __init__(self, lib_path, tok_path, cfg_path, template):
        c = ctypes
        lib = c.CDLL(lib_path)
        lib.dpd_tok_load.restype = c.c_void_p
        lib.dpd_tok_load.argtypes = [c.c_char_p, c.c_char_p, c.c_char_p,
                                     c.c_size_t]
        lib.dpd_tok_encode.restype = c.c_long
        lib.dpd_tok_encode.argtypes = [c.c_void_p, c.c_char_p, c.c_size_t,
                                       c.c_int, c.POINTER(c.c_uint32),
                                       c.c_size_t]
        lib.dpd_tok_vocab_size.restype = c.c_uint32
        lib.dpd_tok_vocab_size.argtypes = [c.c_void_p]
        lib.dpd_tok_chat_template.restype = c.c_int
        lib.dpd_tok_chat_template.argtypes = [c.c_void_p]
        lib.dpd_chat_template_from_name.restype = c.c_int
        lib.dpd_chat_template_from_name.argtypes = [c.c_char_p]
        lib.dpd_chat_render.restype = c.c_int
        lib.dpd_chat_render.argtypes = [c.c_void_p, c.c_int, c.c_char_p,
                                        c.c_size_t, c.POINTER(c.c_void_p),
                                        c.POINTER(c.c_size_t), c.c_char_p,
                                        c.c_size_t]
        lib.dpd_chat_count.restype = c.c_long
        lib.dpd_chat_count.argtypes = [c.c_void_p, c.c_int, c.c_char_p,
                                       c.c_size_t, c.POINTER(c.c_int),
                                       c.c_char_p, c.c_size_t]
        self.lib = lib
        self.libc = c.CDLL(None)
        self.libc.free.argtypes = [c.c_void_p]
        err = c.create_string_buffer(1024)
        h = lib.dpd_tok_load(tok_path.encode(),
                             cfg_path.encode() if cfg_path else None,
                             err, 1024)
        if not h:
            raise RuntimeError("cannot load tokenizer %s: %s"
                               % (tok_path, err.value.decode("utf-8",
                                                             "replace")))
        self.h = h
        self.vocab = int(lib.dpd_tok_vocab_size(h))
        t = lib.dpd_chat_template_from_name(template.encode())
        if t < 0:
            raise RuntimeError("unknown chat template %r" % template)
        if t == 0:  # auto: detected from tokenizer_config.json
            t = lib.dpd_tok_chat_template(h)
        self.tmpl = t
        self.desc = "lib:%s" % lib_path

    def encode(self, text, add_special):
        b = text.encode("utf-8", "surrogatepass")
        cap = len(b) + 16
        while True:
            buf = (ctypes.c_uint32 * cap)()
            n = self.lib.dpd_tok_encode(self.h, b, len(b),
                                        1 if add_special else 0, buf, cap)
            if n < 0:
                raise ApiError(400, "tokenizer failed on prompt")
            if n <= cap:
                return list(buf[:n])
            cap = n

    def chat_ids(self, messages, request=None):
        mj = jdump(request if request is not None else messages).encode(
            "utf-8", "surrogatepass")
        out = ctypes.c_void_p()
        outlen = ctypes.c_size_t()
        err = ctypes.create_string_buffer(1024)
        rc = self.lib.dpd_chat_render(self.h, self.tmpl, mj, len(mj),
                                      ctypes.byref(out), ctypes.byref(outlen),
                                      err, 1024)
        if rc < 0:
            raise ApiError(400, err.value.decode("utf-8", "replace"))
        if rc == 0 or rc == 2:      # 2: non-text parts left out
            text = ctypes.string_at(out, outlen.value).decode("utf-8",
                                                              "replace")
            self.libc.free(out)
            return self.encode(text, False)
        # unknown template: the library's documented estimate, hashed ids
        est = ctypes.c_int()
        n = self.lib.dpd_chat_count(self.h, self.tmpl, mj, len(mj),
                                    ctypes.byref(est), err, 1024)
        if n < 0:
            raise ApiError(400, err.value.decode("utf-8", "replace"))
        seed = zlib.crc32(mj)
        return [(seed + i * 2654435761) % self.vocab for i in range(n)]


class FallbackTokenizer(object):
    """Used only without --tokenizer: words and punctuation count as one
    token each, ids are hashes.  Counts do NOT match a real tokenizer."""

    BOS = 128000
    RX = re.compile(r"\w+|[^\w\s]", re.UNICODE)

    def __init__(self):
        self.vocab = 128256
        self.desc = "fallback:words"

    def encode(self, text, add_special):
        ids = [zlib.crc32(w.encode("utf-8", "surrogatepass")) % 128000
               for w in self.RX.findall(text)]
        return ([self.BOS] + ids) if add_special else ids

    def chat_ids(self, messages, request=None):
        parts = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, "messages[%d].role: expected string" % i)
            c = m.get("content")
            if isinstance(c, list):
                c = "".join(p.get("text", "") for p in c
                            if isinstance(p, dict))
            elif c is None:
                c = ""
            elif not isinstance(c, str):
                raise ApiError(400, "messages[%d].content: expected string "
                               "or array of text parts" % i)
            parts.append("%s : %s ." % (m["role"], c))
        return [self.BOS] + self.encode(" ".join(parts) + " assistant :",
                                        False)


def default_lib_path():
    here = os.path.dirname(os.path.abspath(__file__))
    b = os.environ.get("DPD_BUILD") or os.path.join(here, "..", "build")
    return os.path.normpath(os.path.join(b, "libdpdtok.so"))


# ---------------------------------------------------------------------------
# Scheduler: continuous batching with chunked prefill.
# ---------------------------------------------------------------------------

class Seq(object):
    __slots__ = ("rid", "index", "prompt_ids", "n_prompt", "computed",
                 "n_cached", "max_tokens", "stop", "out_n", "text", "seed",
                 "vocab", "blocks", "events", "finished", "finish_reason",
                 "stop_reason", "aborted", "hold_kv", "held_blocks",
                 "t_first", "first_tok",
                 # prefix caching (PrefixCache): block hashes, the number of
                 # s.blocks already cached, output token ids, the request's
                 # extra keys, prefix-cache hit tokens, no read
                 "apc_hashes", "apc_ncb", "out_ids", "salt", "lora",
                 "apc_hit", "apc_skip_read")

    def __init__(self, rid, index, prompt_ids, n_cached, max_tokens, stop,
                 events, vocab):
        self.rid = rid
        self.index = index
        self.prompt_ids = prompt_ids
        self.n_prompt = len(prompt_ids)
        self.n_cached = n_cached
        self.computed = n_cached
        self.max_tokens = max_tokens
        self.stop = stop
        self.out_n = 0
        self.text = ""
        self.seed = token_hash(prompt_ids)
        self.vocab = vocab
        self.blocks = []
        self.events = events
        self.finished = False
        self.finish_reason = None
        self.stop_reason = None
        self.aborted = False
        self.hold_kv = False
        self.held_blocks = None
        self.t_first = None
        self.first_tok = None
        self.apc_hashes = []
        self.apc_ncb = 0
        self.out_ids = []
        self.salt = None
        self.lora = None
        self.apc_hit = 0
        self.apc_skip_read = False

    def next_token(self):
        h = hashlib.blake2b(("%s:%d" % (self.seed, self.out_n)).encode(),
                            digest_size=8).digest()
        v = int.from_bytes(h, "little")
        if self.out_n == 0:
            self.first_tok = (v >> 16) % self.vocab
        self.out_n += 1
        return " " + WORDS[v % len(WORDS)]


def token_hash(ids, n=None):
    if n is not None:
        ids = ids[:n]
    return hashlib.sha256(ids_bytes(ids)).hexdigest()[:32]


def ids_bytes(ids):
    """Token ids as little-endian uint32 bytes (hash input)."""
    a = array.array("I", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


class Scheduler(threading.Thread):
    def __init__(self, emu):
        threading.Thread.__init__(self, name="scheduler", daemon=True)
        a = emu.args
        self.emu = emu
        self.block_size = a.block_size
        self.total_blocks = a.kv_blocks
        self.pool = PrefixCache(a.kv_blocks, a.block_size,
                                a.enable_prefix_caching,
                                emu.kv_events_cfg is not None)
        self.mnbt = a.max_num_batched_tokens
        self.max_seqs = a.max_num_seqs
        self.step_s = a.decode_step_ms / 1000.0
        self.tps = float(a.prefill_tps)
        self.scale = a.time_scale
        self.cv = threading.Condition()
        self.waiting = deque()
        self.running = []
        self.steps = 0
        self.busy_s = 0.0

    # block accounting (caller holds self.cv)
    def used_blocks(self):
        return self.pool.used()

    def alloc(self, n):
        return self.pool.alloc(n)

    def free(self, ids):
        self.pool.free(ids)

    def flush_events(self):
        """Hand the pool's KV events to the publisher as one batch (vLLM:
        once per schedule() step); caller holds cv."""
        ev = self.pool.take_events()
        if ev and self.emu.kv_pub is not None:
            self.emu.kv_pub.publish(ev)

    def peek_hit(self, ids, salt, lora, skip_read):
        """Tokens of ids this pod's prefix cache holds now (no touch)."""
        pool = self.pool
        if not pool.enabled or skip_read:
            return 0
        h = apc_hash_blocks(pool.seed, ids[:((len(ids) - 1) // pool.bs)
                                          * pool.bs], pool.bs, [], lora,
                            salt)
        with self.cv:
            return len(pool.lookup(h, len(h))) * pool.bs

    def reset_prefix_cache(self):
        with self.cv:
            ok = self.pool.reset()
            self.flush_events()
        return ok

    def _admit_apc(self, s, hit, new):
        """s takes its hit blocks and new ones; the hit (or the KV a
        transfer brought, cached now as vLLM caches received blocks)
        counts as computed; caller holds cv."""
        pool = self.pool
        pool.touch(hit)
        s.blocks = hit + pool.alloc(new)
        s.apc_ncb = len(hit)
        s.apc_hit = len(hit) * self.block_size
        if pool.enabled:
            pool.stats["requests"] += 1
            if not s.apc_skip_read:
                pool.stats["queries"] += s.n_prompt
                pool.stats["hits"] += s.apc_hit
        if s.apc_hit > s.n_cached:
            s.n_cached = s.apc_hit
        s.computed = s.n_cached
        pool.cache_upto(s, s.computed)

    def free_blocks(self, ids):
        with self.cv:
            self.free(ids)

    def submit(self, seqs):
        with self.cv:
            self.waiting.extend(seqs)
            self.cv.notify()

    def abort(self, seqs):
        with self.cv:
            for s in seqs:
                s.aborted = True
            self.cv.notify()

    def counts(self):
        with self.cv:
            return (len(self.running), len(self.waiting), self.used_blocks())

    def _reap(self):
        keep = []
        for s in self.running:
            if s.aborted:
                self.free(s.blocks)
                s.blocks = []
                s.finished = True
            else:
                keep.append(s)
        self.running = keep
        if any(s.aborted for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.aborted)

    def run(self):
        bs = self.block_size
        deadline = time.monotonic()
        while True:
            with self.cv:
                self._reap()
                while not self.running and not self.waiting:
                    self.flush_events()
                    self.cv.wait()
                    self._reap()
                    deadline = time.monotonic()
                decodes = [s for s in self.running if s.computed >= s.n_prompt]
                budget = self.mnbt - len(decodes)
                chunks = []
                for s in decodes:
                    # the last sampled token is computed this step
                    self.pool.cache_upto(s, s.n_prompt + s.out_n)
                for s in self.running:
                    if s.computed < s.n_prompt and budget > 0:
                        c = min(s.n_prompt - s.computed, budget)
                        chunks.append((s, c))
                        budget -= c
                        self.pool.cache_upto(s, s.computed + c)
                while (self.waiting and budget > 0
                       and len(self.running) < self.max_seqs):
                    s = self.waiting[0]
                    need = (s.n_prompt + 1 + bs - 1) // bs
                    hit, new, evictable = self.pool.admit(s, need)
                    if new + evictable > self.pool.num_free() and \
                            self.running:
                        break  # wait for KV space
                    self.waiting.popleft()
                    self._admit_apc(s, hit, new)
                    self.running.append(s)
                    c = min(s.n_prompt - s.computed, budget)
                    if c > 0:
                        chunks.append((s, c))
                        budget -= c
                        self.pool.cache_upto(s, s.computed + c)
                    elif s.computed >= s.n_prompt:
                        # everything cached: one-token recompute this step
                        chunks.append((s, 0))
                ptoks = sum(c for _, c in chunks)
                self.flush_events()
            if not decodes and not chunks:
                time.sleep(0.001)
                continue
            dur = self.step_s + ptoks / self.tps
            # next step end; catch up at most 5 ms when the thread was late
            deadline = (max(deadline, time.monotonic() - 0.005)
                        + dur * self.scale)
            delay = deadline - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self.emu.counter_add("steps_total", 1)
            self.emu.counter_add("prefill_tokens_computed_total", ptoks)
            self.emu.counter_add("decode_tokens_total", len(decodes))
            with self.cv:
                self.steps += 1
                self.busy_s += dur
                for s in decodes:
                    if not s.aborted:
                        self._emit(s)
                for s, c in chunks:
                    if s.aborted:
                        continue
                    s.computed += c
                    if s.computed >= s.n_prompt:
                        s.t_first = time.monotonic()
                        self._emit(s)
                self.running = [s for s in self.running if not s.finished]

    def _emit(self, s):
        """One generated token for s (caller holds cv)."""
        tok = s.next_token()
        s.out_ids.append(self.emu.word_id(tok))
        total = s.n_prompt + s.out_n
        need = (total + self.block_size - 1) // self.block_size
        if need > len(s.blocks):
            s.blocks.extend(self.alloc(need - len(s.blocks)))
        delta = tok
        reason = None
        if s.stop:
            prev = len(s.text)
            full = s.text + tok
            cut = None
            for st in s.stop:
                k = full.find(st, max(0, prev - len(st) + 1))
                if k >= 0 and (cut is None or k < cut[0]):
                    cut = (k, st)
            if cut is not None:
                delta = full[prev:cut[0]] if cut[0] > prev else ""
                s.text = full[:max(cut[0], prev)]
                reason = "stop"
                s.stop_reason = cut[1]
            else:
                s.text = full
        else:
            s.text += tok
        if reason is None and s.out_n >= s.max_tokens:
            reason = "length"
        if reason is not None:
            s.finished = True
            s.finish_reason = reason
            if s.hold_kv:
                # NIXL producer: keep the full prompt blocks for the puller
                nfull = s.n_prompt // self.block_size
                s.held_blocks = s.blocks[:nfull]
                self.free(s.blocks[nfull:])
            else:
                self.free(s.blocks)
            s.blocks = []
        s.events.put((s.index, delta, reason, s.stop_reason, s.out_n))


# ---------------------------------------------------------------------------
# KV handoff state: NIXL holder (prefill side), LMCache store (decode side).
# ---------------------------------------------------------------------------

class KvState(object):
    def __init__(self, emu):
        self.emu = emu
        self.lock = threading.Lock()
        self.nixl = {}      # request_id -> entry
        self.lmc = {}       # chunk key -> entry

    def nixl_hold(self, rid, blocks, prompt_ids, published=None):
        e = {"request_id": rid, "blocks": blocks,
             "published": blocks if published is None else published,
             "tokens": len(blocks) * self.emu.args.block_size,
             "n_prompt": len(prompt_ids),
             "token_hash": token_hash(prompt_ids,
                                      len(blocks) * self.emu.args.block_size),
             "t": time.monotonic()}
        with self.lock:
            old = self.nixl.pop(rid, None)
            self.nixl[rid] = e
        if old:
            self.emu.sched.free_blocks(old["blocks"])
            self.emu.counter_add("nixl_replaced_total", 1)
        self.emu.counter_add("nixl_held_total", 1)

    def nixl_take(self, rid):
        with self.lock:
            return self.nixl.pop(rid, None)

    def lmc_put(self, req_id, chunks):
        t = time.monotonic()
        with self.lock:
            for c in chunks:
                self.lmc[c["key"]] = {"key": c["key"], "req_id": req_id,
                                      "tokens": int(c["n_tokens"]), "t": t}

    def lmc_take_prefix(self, keys_tokens):
        """Leading chunks held; they are freed (consumed)."""
        got = 0
        with self.lock:
            for key, n in keys_tokens:
                e = self.lmc.get(key)
                if e is None or e["tokens"] != n:
                    break
                del self.lmc[key]
                got += n
        return got

    def expire(self):
        lim = self.emu.args.kv_hold_timeout
        t = time.monotonic()
        freed = []
        with self.lock:
            for rid in [k for k, e in self.nixl.items() if t - e["t"] > lim]:
                freed.append(self.nixl.pop(rid))
            dead = [k for k, e in self.lmc.items() if t - e["t"] > lim]
            for k in dead:
                del self.lmc[k]
        for e in freed:
            self.emu.sched.free_blocks(e["blocks"])
        if freed:
            self.emu.counter_add("nixl_expired_total", len(freed))
        if dead:
            self.emu.counter_add("lmcache_expired_chunks_total", len(dead))

    def snapshot(self):
        t = time.monotonic()
        with self.lock:
            nx = [{"request_id": e["request_id"], "blocks": len(e["blocks"]),
                   "tokens": e["tokens"], "age_s": round(t - e["t"], 3)}
                  for e in self.nixl.values()]
            lm = [{"key": e["key"], "req_id": e["req_id"],
                   "tokens": e["tokens"], "age_s": round(t - e["t"], 3)}
                  for e in self.lmc.values()]
        return nx, lm


def lmc_chunk_keys(ids, chunk):
    """[(key, n_tokens)] for the prompt's chunks; the key hashes the chunk's
    ids and every id before it (a prefix hash, as LMCache keys chunks)."""
    out = []
    h = hashlib.sha256(b"lmcache")
    for i in range(0, len(ids), chunk):
        part = ids[i:i + chunk]
        h.update(ids_bytes(part))
        out.append((h.copy().hexdigest()[:32], len(part)))
    return out


# ---------------------------------------------------------------------------
# kv_agent: this project's transport.  The emulator plays the inference
# engine in front of a local kv_agent (kv_agent/README.md, "Local API"):
# it registers a memfd host pool, writes the KV it "computed" into it, asks
# the agent to push it (prefill) or to say whether it landed (decode).
# ---------------------------------------------------------------------------

_KV_CLIENT = None


def kv_client_mod():
    """kv_agent/python/kv_agent_client.py (stdlib only), loaded on demand."""
    global _KV_CLIENT
    if _KV_CLIENT is None:
        here = os.path.dirname(os.path.abspath(__file__))
        d = os.path.normpath(os.path.join(here, "..", "kv_agent", "python"))
        if d not in sys.path:
            sys.path.insert(0, d)
        import kv_agent_client
        _KV_CLIENT = kv_agent_client
    return _KV_CLIENT


def kv_block_seeds(ids, bs, n):
    """Chained prefix hashes of the first n full blocks: block i's seed
    depends on every token up to its end, as real KV does."""
    out = []
    h = hashlib.sha256(b"dpd-kv")
    for i in range(n):
        h.update(ids_bytes(ids[i * bs:(i + 1) * bs]))
        out.append(h.copy().digest())
    return out


def kv_block_body(seed, n):
    """Block bytes (n = block_bytes) from a block seed."""
    return hashlib.shake_128(seed).digest(n)


def kv_slice_bytes(body, i, lr):
    """Prompt block i in layer-region lr: the block body under an 8-byte
    tag <u32 i, u32 lr>, so slices moved to the wrong place show."""
    n = len(body)
    return (struct.pack("<II", i, lr) + body[8:])[:n]


class KvAgent(object):
    """The engine side of one local kv_agent: pool, source blocks, pushes,
    consumption.  Every agent call uses a fresh connection (the agent
    serves many clients; HTTP threads never share a socket)."""

    def __init__(self, emu, path):
        self.emu = emu
        self.path = path
        self.timeout = emu.args.kv_connect_timeout
        self.lock = threading.Lock()
        self.reg_lock = threading.Lock()    # one registration at a time
        self.reg_gen = 0        # successful registrations so far
        self.pool = None        # HostPool (memfd, MAP_SHARED)
        self.geo = None         # the agent's "pool" from info
        self.node = None
        self.registered = False
        self.error = "not connected yet"
        self.free_src = deque()
        self.held = {}          # req_id -> producer entry (source blocks)
        self.agent_free = None  # the agent's free pool blocks (last info)

    # -- agent calls ------------------------------------------------------

    def call(self, msg, timeout=None, fds=None):
        """One request; the reply dict (ok true or false).  Raises OSError
        / ValueError when the agent cannot be reached or answers junk."""
        m = kv_client_mod()
        c = m.Client(self.path, timeout=timeout or self.timeout)
        try:
            r = c.call_raw(msg, fds)
        finally:
            c.close()
        if not isinstance(r, dict):
            raise ValueError("agent reply is not a JSON object")
        return r

    def register(self, stale_gen=None):
        """Connect, create (or keep) the pool of the agent's geometry and
        register it.  Returns True when the pool is registered.  stale_gen:
        register again even if registered, unless another thread already
        did since registration stale_gen."""
        with self.reg_lock:
            if self.registered and (stale_gen is None or
                                    self.reg_gen != stale_gen):
                return True
            return self._register()

    def _register(self):
        try:
            info = self.call({"verb": "info"})
            if not info.get("ok") or not isinstance(info.get("pool"), dict):
                raise ValueError(info.get("error") or "agent has no pool")
            g = info["pool"]
            key = ("layers", "regions", "blocks", "block_bytes",
                   "block_stride", "region_stride", "layer_stride", "size")
            with self.lock:
                if self.geo is None or any(self.geo.get(k) != g.get(k)
                                           for k in key):
                    if self.held:
                        raise ValueError("pool geometry changed while "
                                         "pushes are in flight")
                    if self.pool is not None:
                        self.pool.close()
                    self.pool = kv_client_mod().HostPool(
                        int(g["size"]), "emu_kv_pool")
                    self.geo = dict(g)
                    self.free_src = deque(range(int(g["blocks"])))
                pool = self.pool
            r = self.call({"verb": "register_pool", "memory": "host",
                           "size": pool.size}, fds=[pool.fd])
            if not r.get("ok"):
                raise ValueError("register_pool: %s" % r.get("error"))
            # registering drops the agent's peer links (they learn the new
            # keys on reconnect): wait a little for those that were up
            was_up = {x.get("id") for x in info.get("peers") or []
                      if x.get("connected")}
            deadline = time.monotonic() + 3.0
            while was_up and time.monotonic() < deadline:
                time.sleep(0.05)
                up = {x.get("id") for x in
                      self.call({"verb": "info"}).get("peers") or []
                      if x.get("connected")}
                if was_up <= up:
                    break
            self.node = info.get("node")
            self.agent_free = g.get("free")
            self.reg_gen += 1
            self.registered = True
            self.error = None
            return True
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.registered = False
            self.error = str(e) or e.__class__.__name__
            return False

    def monitor(self):
        """Register at start; re-register when the agent went away (a
        restarted agent has no pool).  One connection stays open: the
        agent closing it means the agent is gone; a slow answer does not
        (registering again would drop the agent's peer links)."""
        c = None
        while True:
            if not self.registered:
                if c is not None:
                    c.close()
                    c = None
                self.register()
            else:
                try:
                    if c is None:
                        c = kv_client_mod().Client(self.path, timeout=2.0)
                    r = c.call_raw({"verb": "info"})
                    if isinstance(r, dict) and isinstance(r.get("pool"),
                                                          dict):
                        self.agent_free = r["pool"].get("free")
                except socket.timeout:
                    if c is not None:
                        c.close()   # busy, not gone: resync next time
                    c = None
                except (OSError, ValueError):
                    self.registered = False
                    self.error = "agent unreachable"
            time.sleep(0.5 if self.registered else 0.2)

    def start(self):
        self.register()
        threading.Thread(target=self.monitor, name="kv-agent",
                         daemon=True).start()

    # -- pool ---------------------------------------------------------------

    def slice_off(self, lr, block):
        g = self.geo
        layer, region = divmod(lr, int(g["regions"]))
        return (layer * int(g["layer_stride"]) +
                region * int(g["region_stride"]) +
                block * int(g["block_stride"]))

    def nslices(self):
        return int(self.geo["layers"]) * int(self.geo["regions"])

    def write_blocks(self, ids, blocks):
        """Write the deterministic KV of prompt blocks 0..len(blocks)-1 into
        pool blocks `blocks`."""
        bs = self.emu.args.block_size
        bb = int(self.geo["block_bytes"])
        mv = self.pool.map
        for i, seed in enumerate(kv_block_seeds(ids, bs, len(blocks))):
            body = kv_block_body(seed, bb)
            for lr in range(self.nslices()):
                o = self.slice_off(lr, blocks[i])
                mv[o:o + bb] = kv_slice_bytes(body, i, lr)

    def blocks_match(self, ids, blocks):
        """True when pool blocks `blocks` hold prompt blocks 0..n-1 of ids."""
        bs = self.emu.args.block_size
        bb = int(self.geo["block_bytes"])
        if len(ids) < len(blocks) * bs:
            return False
        mv = memoryview(self.pool.map)
        try:
            for i, seed in enumerate(kv_block_seeds(ids, bs, len(blocks))):
                body = kv_block_body(seed, bb)
                for lr in range(self.nslices()):
                    o = self.slice_off(lr, blocks[i])
                    if mv[o:o + bb] != kv_slice_bytes(body, i, lr):
                        return False
        finally:
            mv.release()
        return True

    # -- producer (prefill) ---------------------------------------------------

    def push(self, req_id, node, ids, info):
        """Write the prompt's full blocks and push them to node under
        req_id.  Fills info; returns "pushed" or "failed"."""
        emu = self.emu
        a = emu.args
        n = len(ids) // a.block_size
        info["blocks"] = n
        if not self.registered and not self.register():
            info["outcome"] = "failed: no agent (%s)" % self.error
            return "failed"
        if n == 0:
            info["outcome"] = "pushed"
            info["push_state"] = "nothing to push"
            return "pushed"
        with self.lock:
            if req_id in self.held:
                info["outcome"] = "failed: request id already pushing"
                return "failed"
            if len(self.free_src) < n:
                info["outcome"] = "failed: source pool full"
                return "failed"
            src = [self.free_src.popleft() for _ in range(n)]
            e = {"req_id": req_id, "peer": node, "blocks": src,
                 "t": time.monotonic(), "state": "pending"}
            self.held[req_id] = e
        info["src_blocks"] = src
        try:
            gen = self.reg_gen
            self.write_blocks(ids, src)
            r = self.call({"verb": "push", "req_id": req_id, "peer": node,
                           "src_runs": kv_client_mod().runs(src)})
            if not r.get("ok") and "no registered KV pool" in \
                    str(r.get("error")) and self.register(stale_gen=gen):
                # the agent restarted since our last look: pool again
                self.write_blocks(ids, src)
                r = self.call({"verb": "push", "req_id": req_id,
                               "peer": node,
                               "src_runs": kv_client_mod().runs(src)})
        except (OSError, ValueError) as ex:
            r = {"ok": False, "error": str(ex)}
        if not r.get("ok"):
            self.drop_src(req_id)
            info["outcome"] = "failed: %s" % r.get("error")
            return "failed"
        e["state"] = r.get("state")
        info["push_state"] = r.get("state")
        wait_ms = a.kv_push_wait_ms
        if wait_ms > 0 or r.get("final"):
            r = self.finish_push(req_id, wait_ms)
            info["push_state"] = r.get("state")
            if r.get("state") != "done":
                info["outcome"] = "failed: %s" % (
                    r.get("error") or "push %s" % r.get("state"))
                return "failed"
        else:
            threading.Thread(target=self.finish_push,
                             args=(req_id, a.kv_push_timeout_s * 1000),
                             name="kv-push", daemon=True).start()
        info["outcome"] = "pushed"
        return "pushed"

    def finish_push(self, req_id, wait_ms):
        """Wait for the push to end, then drop the agent's record and free
        the source blocks.  Returns the last state reply."""
        try:
            r = self.call({"verb": "wait", "req_id": req_id,
                           "timeout_ms": int(wait_ms)},
                          timeout=wait_ms / 1000.0 + self.timeout)
        except (OSError, ValueError) as ex:
            r = {"ok": False, "state": "unknown", "error": str(ex)}
        if r.get("ok") and not r.get("final"):
            # still moving: the background waiter takes over
            if threading.current_thread().name != "kv-push":
                threading.Thread(
                    target=self.finish_push,
                    args=(req_id, self.emu.args.kv_push_timeout_s * 1000),
                    name="kv-push", daemon=True).start()
            return r
        st = r.get("state")
        self.emu.counter_add("kv_agent_push_done_total" if st == "done"
                             else "kv_agent_push_lost_total", 1)
        try:
            self.call({"verb": "release", "req_id": req_id})
        except (OSError, ValueError):
            pass
        self.drop_src(req_id)
        return r

    def drop_src(self, req_id):
        with self.lock:
            e = self.held.pop(req_id, None)
            if e:
                self.free_src.extend(e["blocks"])

    # -- consumer (decode) ----------------------------------------------------

    def consume(self, req_id, ids, info):
        """Look the request up at the agent, verify and release what landed.
        Returns the tokens reused; info gets outcome and details."""
        emu = self.emu
        a = emu.args
        if not self.registered and not self.register():
            info["outcome"] = "no_agent"
            info["error"] = self.error
            return 0
        try:
            # wait up to --kv-wait-ms, also for a request the agent does
            # not know yet (the sender's push_begin may still be on its way)
            deadline = time.monotonic() + a.kv_wait_ms / 1000.0
            while True:
                left = int((deadline - time.monotonic()) * 1000)
                if left > 0:
                    r = self.call({"verb": "wait", "req_id": req_id,
                                   "timeout_ms": left},
                                  timeout=left / 1000.0 + self.timeout)
                else:
                    r = self.call({"verb": "poll", "req_id": req_id})
                if left <= 0 or r.get("code") != "not_found":
                    break
                time.sleep(min(0.01, left / 1000.0))
        except (OSError, ValueError) as ex:
            self.registered = False
            self.error = str(ex)
            info["outcome"] = "no_agent"
            info["error"] = str(ex)
            return 0
        info["state"] = r.get("state") if r.get("ok") else r.get("code")
        if not r.get("ok") or not r.get("final"):
            info["outcome"] = "not_ready"
            if r.get("ok"):
                # it may still land: free it then, nobody will use it
                threading.Thread(target=self.release_late, args=(req_id,),
                                 name="kv-late", daemon=True).start()
            return 0
        if r.get("state") != "ready":
            info["outcome"] = "failed"
            info["error"] = r.get("error")
            self.release(req_id)
            return 0
        blocks = [s + k for s, c in r.get("blocks_runs") or []
                  for k in range(c)]
        info["blocks"] = len(blocks)
        try:
            ok = bool(blocks) and self.blocks_match(ids, blocks)
        except (ValueError, IndexError, TypeError) as ex:
            ok = False      # pool replaced meanwhile, or blocks off range
            info["error"] = str(ex)
        self.release(req_id)
        if not ok:
            info["outcome"] = "mismatch"
            return 0
        bs = a.block_size
        c = min(len(blocks) * bs, ((len(ids) - 1) // bs) * bs)
        info["outcome"] = "ready"
        return c

    def release(self, req_id):
        try:
            self.call({"verb": "release", "req_id": req_id})
        except (OSError, ValueError):
            pass

    def release_late(self, req_id):
        """A request asked for too early: wait for it to end, then free its
        blocks at the agent (counted as kv_agent_late_released_total)."""
        ms = self.emu.args.kv_push_timeout_s * 1000
        try:
            r = self.call({"verb": "wait", "req_id": req_id,
                           "timeout_ms": int(ms)},
                          timeout=ms / 1000.0 + self.timeout)
        except (OSError, ValueError):
            return
        if r.get("ok") and r.get("final"):
            self.release(req_id)
            self.emu.counter_add("kv_agent_late_released_total", 1)

    def snapshot(self):
        t = time.monotonic()
        with self.lock:
            held = [{"req_id": e["req_id"], "peer": e["peer"],
                     "blocks": len(e["blocks"]),
                     "age_s": round(t - e["t"], 3)}
                    for e in self.held.values()]
            g = dict(self.geo) if self.geo else None
            free = len(self.free_src)
        return {"socket": self.path, "node": self.node,
                "registered": self.registered, "error": self.error,
                "pool": g, "src_free_blocks": free,
                "agent_free_blocks": self.agent_free, "held": held,
                "held_blocks": sum(e["blocks"] for e in held)}


def line_rpc(host, port, msg, timeout):
    """One newline-terminated JSON request, one JSON line back."""
    s = socket.create_connection((host, int(port)), timeout=timeout)
    try:
        s.sendall((jdump(msg) + "\n").encode())
        buf = b""
        while b"\n" not in buf:
            d = s.recv(65536)
            if not d:
                break
            buf += d
        r = json.loads(buf.split(b"\n", 1)[0].decode())
        if not isinstance(r, dict):
            raise ValueError("peer reply is not a JSON object")
        return r
    finally:
        s.close()


class LineServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 128


def serve_lines(host, port, handler, name):
    """Start a line-JSON TCP server: handler(msg) -> reply dict."""
    class H(socketserver.StreamRequestHandler):
        def handle(self):
            try:
                line = self.rfile.readline(1 << 24)
                if not line:
                    return
                reply = handler(json.loads(line.decode()))
            except Exception as e:  # malformed peer message
                reply = {"ok": False, "error": str(e)}
            self.wfile.write((jdump(reply) + "\n").encode())
    srv = LineServer((host, port), H)
    threading.Thread(target=srv.serve_forever, name=name,
                     daemon=True).start()
    return srv


# ---------------------------------------------------------------------------
# Faults
# ---------------------------------------------------------------------------

GEN_PATHS = ("/v1/completions", "/v1/chat/completions")
FAULT_KEYS = ("status", "delay_ms", "hang", "disconnect_after", "reset",
              "malformed_json", "kv_override", "kv_remove", "kv_drop",
              "pad_bytes", "lmc_notices", "lmc_dup",
              "path", "role", "count")


def check_rule(r):
    if not isinstance(r, dict):
        raise ValueError("a fault rule is a JSON object")
    for k in r:
        if k not in FAULT_KEYS:
            raise ValueError("unknown fault field %r" % k)
    if r.get("role", "any") not in ("prefill", "decode", "any"):
        raise ValueError("role must be prefill, decode or any")
    for k in ("status", "delay_ms", "disconnect_after", "count",
              "pad_bytes", "lmc_notices", "lmc_dup"):
        if k in r and r[k] is not None and not isinstance(r[k], int):
            raise ValueError("%s must be an integer" % k)
    if r.get("kv_override") is not None and \
            not isinstance(r["kv_override"], dict):
        raise ValueError("kv_override must be an object")
    if r.get("kv_remove") is not None and \
            (not isinstance(r["kv_remove"], list) or
             not all(isinstance(k, str) for k in r["kv_remove"])):
        raise ValueError("kv_remove must be a list of field names")
    return dict(r)


class Faults(object):
    def __init__(self):
        self.lock = threading.Lock()
        self.rules = []

    def set(self, rules):
        with self.lock:
            self.rules = [check_rule(r) for r in rules]

    def get(self):
        with self.lock:
            return [dict(r) for r in self.rules]

    def match(self, path, req_role):
        with self.lock:
            for r in self.rules:
                p = r.get("path")
                if p is None:
                    if path not in GEN_PATHS:
                        continue
                elif p != path:
                    continue
                role = r.get("role", "any")
                if role != "any" and role != req_role:
                    continue
                if r.get("count") is not None:
                    r["count"] -= 1
                    if r["count"] <= 0:
                        self.rules.remove(r)
                return dict(r)
        return None


# ---------------------------------------------------------------------------
# The instance
# ---------------------------------------------------------------------------

# ---------------------------------------------------------------------------
# Automatic prefix caching and KV events, as vLLM v1 does them.
#
# Followed (vllm-project/vllm):
#   vllm/v1/core/kv_cache_utils.py @001cabc1be16: hash_block_tokens,
#     generate_block_hash_extra_keys (LoRA name on every block, cache_salt on
#     block 0 only), request_block_hasher (full blocks only), init_none_hash
#     (PYTHONHASHSEED or 32 random bytes), maybe_convert_block_hash (the
#     last 8 bytes big-endian when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, its
#     default), FreeKVCacheBlockQueue (LRU; a request's blocks freed tail
#     first);
#   vllm/v1/core/block_pool.py (upstream layout as of 2026): cache_full_blocks
#     (one BlockStored per call for the new full blocks, parent = the block
#     before them), get_new_blocks/_maybe_evict_cached_block (a cached free
#     block is evicted when reused: BlockRemoved), touch, free_blocks,
#     reset_prefix_cache (refused while blocks are in use; AllBlocksCleared);
#   vllm/v1/core/kv_cache_manager.py get_computed_blocks: the longest run of
#     cached block hashes from block 0, at most num_tokens - 1 tokens (the
#     last token is always computed), none read with prompt_logprobs;
#   vllm/distributed/kv_events.py @0181ea3173e5 (and @b4e69e0af33f, the first
#     array-only one), vLLM PR #42892 (events as maps with "type", the batch
#     stays an array) and PR #45177 (replay replies carry the topic frame);
#     the 0.26 payload quoted in volcano-sh/kthena#1535;
#   vllm/config/kv_events.py @00634b8acf93: KVEventsConfig.
# The block hash is not vLLM's (pickle/CBOR + sha256 of the tuple): nobody
# outside vLLM can reproduce it, consumers key by token_ids; it has vLLM's
# structure (sha256 chain over the parent, the block's ids, the extra keys).
# ---------------------------------------------------------------------------

def mp_pack(obj):
    """msgpack encoding of None/bool/int/float/str/bytes/list/tuple/dict
    with the smallest forms, as msgspec writes them (floats as float64)."""
    out = []
    _mp(obj, out)
    return b"".join(out)


def _mp(o, out):
    P = struct.pack
    if o is None:
        out.append(b"\xc0")
    elif o is True:
        out.append(b"\xc3")
    elif o is False:
        out.append(b"\xc2")
    elif isinstance(o, int):
        if 0 <= o < 0x80:
            out.append(P("B", o))
        elif o >= 0:
            for lim, tag, f in ((0x100, 0xcc, "B"), (0x10000, 0xcd, ">H"),
                                (1 << 32, 0xce, ">I"), (1 << 64, 0xcf, ">Q")):
                if o < lim:
                    out.append(P("B", tag) + P(f, o))
                    return
            raise ValueError("integer too large for msgpack")
        elif o >= -32:
            out.append(P("b", o))
        else:
            for lim, tag, f in ((1 << 7, 0xd0, "b"), (1 << 15, 0xd1, ">h"),
                                (1 << 31, 0xd2, ">i"), (1 << 63, 0xd3, ">q")):
                if o >= -lim:
                    out.append(P("B", tag) + P(f, o))
                    return
            raise ValueError("integer too small for msgpack")
    elif isinstance(o, float):
        out.append(b"\xcb" + P(">d", o))
    elif isinstance(o, str):
        b = o.encode("utf-8", "surrogatepass")
        n = len(b)
        out.append((P("B", 0xa0 | n) if n < 32 else
                    P(">BB", 0xd9, n) if n < 0x100 else
                    P(">BH", 0xda, n) if n < 0x10000 else
                    P(">BI", 0xdb, n)) + b)
    elif isinstance(o, (bytes, bytearray)):
        n = len(o)
        out.append((P(">BB", 0xc4, n) if n < 0x100 else
                    P(">BH", 0xc5, n) if n < 0x10000 else
                    P(">BI", 0xc6, n)) + bytes(o))
    elif isinstance(o, (list, tuple)):
        n = len(o)
        out.append(P("B", 0x90 | n) if n < 16 else
                   P(">BH", 0xdc, n) if n < 0x10000 else P(">BI", 0xdd, n))
        for x in o:
            _mp(x, out)
    elif isinstance(o, dict):
        n = len(o)
        out.append(P("B", 0x80 | n) if n < 16 else
                   P(">BH", 0xde, n) if n < 0x10000 else P(">BI", 0xdf, n))
        for k, v in o.items():
            _mp(k, out)
            _mp(v, out)
    else:
        raise TypeError("cannot msgpack %r" % type(o))


def apc_none_hash():
    """vLLM's init_none_hash: the seed of block 0's parent."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        return os.urandom(32)
    return hashlib.sha256(seed.encode("utf-8", "surrogatepass")).digest()


def apc_extra_keys(start, lora, salt):
    """generate_block_hash_extra_keys: LoRA name, then cache_salt on the
    block that starts at token 0; None when there is none."""
    k = []
    if lora is not None:
        k.append(lora[0])
    if salt and start == 0:
        k.append(salt)
    return tuple(k) if k else None


def apc_hash_blocks(seed, ids, bs, have, lora, salt):
    """Hashes of the full blocks of ids after the len(have) already
    hashed (vLLM's request_block_hasher), appended to have."""
    parent = have[-1] if have else seed
    i = len(have) * bs
    n = len(ids)
    while i + bs <= n:
        ek = apc_extra_keys(i, lora, salt)
        h = hashlib.sha256(parent)
        h.update(ids_bytes(ids[i:i + bs]))
        if ek is not None:
            h.update(jdump(list(ek)).encode("utf-8", "surrogatepass"))
        parent = h.digest()
        have.append(parent)
        i += bs
    return have


class PrefixCache(object):
    """The pod's KV block pool (vLLM's BlockPool): ref counts, a free queue
    in eviction order (head = next allocated: least recently used first),
    and the map of cached full blocks.  Blocks held by a running request
    (or a NIXL/kv_agent hand-off) have ref > 0 and are never evicted; a
    freed cached block stays findable until its slot is reused.  Beyond
    the capacity alloc() overcommits (-1 ids) as the emulator always did.
    Every method is called with the scheduler's lock held."""

    def __init__(self, nblocks, bs, enabled, events):
        self.n = nblocks
        self.bs = bs
        self.enabled = enabled
        self.events_on = events and enabled
        self.ref = [0] * nblocks
        self.bhash = [None] * nblocks
        self.free_q = OrderedDict((i, None) for i in range(nblocks))
        self.cached = {}          # block hash -> {block id: None}, ordered
        self.overcommit = 0
        self.events = []          # ("stored", ..) ("removed", h) ("cleared",)
        self.seed = apc_none_hash()
        self.stats = {"queries": 0, "hits": 0, "requests": 0,
                      "stored_blocks": 0, "evicted_blocks": 0, "resets": 0,
                      "resets_refused": 0}

    def num_free(self):
        return len(self.free_q)

    def used(self):
        return self.n - len(self.free_q) + self.overcommit

    def alloc(self, k):
        out = []
        q = self.free_q
        for _ in range(k):
            if q:
                b = q.popitem(last=False)[0]
                if self.bhash[b] is not None:
                    self._evict(b)
                self.ref[b] = 1
                out.append(b)
            else:
                self.overcommit += 1
                out.append(-1)
        return out

    def _evict(self, b):
        h = self.bhash[b]
        self.bhash[b] = None
        d = self.cached.get(h)
        if d is None or b not in d:
            return
        del d[b]
        if not d:
            del self.cached[h]
        self.stats["evicted_blocks"] += 1
        if self.events_on:
            self.events.append(("removed", h))

    def touch(self, ids):
        for b in ids:
            if self.ref[b] == 0:
                del self.free_q[b]
            self.ref[b] += 1

    def free(self, ids):
        """ids in request order; freed tail first, as vLLM's manager does
        (the tail of a chain is evicted before its prefix)."""
        for b in reversed(ids):
            if b < 0:
                self.overcommit -= 1
                continue
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free_q[b] = None

    def lookup(self, hashes, max_blocks):
        out = []
        for h in hashes[:max_blocks]:
            d = self.cached.get(h)
            if not d:
                break
            out.append(next(iter(d)))
        return out

    def admit(self, s, total_blocks):
        """A waiting request's prefix hit and blocks; None when the pool
        (free and evictable blocks) cannot hold it now."""
        hit = []
        if self.enabled and not s.apc_skip_read:
            hit = self.lookup(s.apc_hashes, (s.n_prompt - 1) // self.bs)
        return hit, total_blocks - len(hit), \
            sum(1 for b in hit if self.ref[b] == 0)

    def cache_upto(self, s, ntok):
        """cache_full_blocks: blocks of s whose tokens are all computed
        (or are being computed this step) become cached, one BlockStored
        for the new ones."""
        if not self.enabled:
            return
        bs = self.bs
        nfull = min(ntok // bs, len(s.blocks))
        first = s.apc_ncb
        if nfull <= first:
            return
        if nfull * bs > s.n_prompt:
            ids = s.prompt_ids + s.out_ids
        else:
            ids = s.prompt_ids
        if len(s.apc_hashes) < nfull:
            apc_hash_blocks(self.seed, ids[:nfull * bs], bs, s.apc_hashes,
                            s.lora, s.salt)
        new = []
        for i in range(first, nfull):
            b = s.blocks[i]
            h = s.apc_hashes[i]
            if b < 0 or self.bhash[b] is not None:
                continue          # overcommitted, or a hit block
            self.bhash[b] = h
            self.cached.setdefault(h, {})[b] = None
            new.append(h)
        s.apc_ncb = nfull
        self.stats["stored_blocks"] += len(new)
        if self.events_on and new:
            self.events.append((
                "stored", new, s.apc_hashes[first - 1] if first else None,
                ids[first * bs:nfull * bs],
                [apc_extra_keys(i * bs, s.lora, s.salt)
                 for i in range(first, nfull)], s.lora, s.salt))

    def reset(self):
        """reset_prefix_cache: only with every block free."""
        if self.used() != 0:
            self.stats["resets_refused"] += 1
            return False
        self.cached = {}
        self.bhash = [None] * self.n
        self.stats["resets"] += 1
        if self.events_on:
            self.events.append(("cleared",))
        return True

    def take_events(self):
        ev = self.events
        self.events = []
        return ev

    def snapshot(self):
        d = dict(self.stats)
        d.update(enabled=self.enabled, cached_blocks=sum(
            len(v) for v in self.cached.values()),
            free_blocks=len(self.free_q),
            cached_free_blocks=sum(1 for b in self.free_q
                                   if self.bhash[b] is not None))
        return d


KV_EVENTS_DEFAULTS = {
    # vllm/config/kv_events.py KVEventsConfig
    "enable_kv_cache_events": False, "publisher": None,
    "endpoint": "tcp://*:5557", "replay_endpoint": None,
    "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000,
    "topic": ""}


def parse_kv_events_config(text):
    """--kv-events-config JSON -> dict (KVEventsConfig's fields), or a
    ValueError that says what is wrong."""
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise ValueError("not JSON: %s" % e)
    if not isinstance(cfg, dict):
        raise ValueError("expected a JSON object")
    unknown = sorted(set(cfg) - set(KV_EVENTS_DEFAULTS))
    if unknown:
        raise ValueError("unknown field(s) %s (known: %s)" % (
            ", ".join(unknown), ", ".join(sorted(KV_EVENTS_DEFAULTS))))
    out = dict(KV_EVENTS_DEFAULTS)
    out.update(cfg)
    if not isinstance(out["enable_kv_cache_events"], bool):
        raise ValueError("enable_kv_cache_events: expected true or false")
    if out["publisher"] is None:
        out["publisher"] = "zmq" if out["enable_kv_cache_events"] else "null"
    if out["publisher"] not in ("null", "zmq"):
        raise ValueError("publisher: expected \"zmq\" or \"null\"")
    for k in ("endpoint", "topic"):
        if not isinstance(out[k], str):
            raise ValueError("%s: expected a string" % k)
    if out["replay_endpoint"] is not None and \
            not isinstance(out["replay_endpoint"], str):
        raise ValueError("replay_endpoint: expected a string or null")
    for k, lo in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
        v = out[k]
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError("%s: expected an integer >= %d" % (k, lo))
    for k in ("endpoint", "replay_endpoint"):
        ep = out[k]
        if ep is not None and not re.match(
                r"^(tcp://.+:\d{1,5}|(ipc|inproc)://.+)$", ep):
            raise ValueError("%s: expected tcp://HOST:PORT, ipc:// or "
                             "inproc:// (got %r)" % (k, ep))
    return out


class KvEventPublisher(threading.Thread):
    """vLLM's ZmqEventPublisher: PUB socket (bound when the endpoint has *,
    :: or is ipc/inproc, else connected), frames (topic, seq as 8 bytes
    big-endian from 0, msgpack batch [ts, events, data_parallel_rank]); the
    last buffer_steps payloads kept for the ROUTER replay endpoint, which
    answers a request [identity, "", start_seq] with every kept batch from
    start_seq on and an end marker (seq = eight 0xFF bytes, empty payload).
    Fault knobs (POST /emu/kv_events): drop the next N batches (their seq
    is used and they stay replayable: the subscriber sees a gap), restart
    (sockets reopened, seq from 0, replay buffer empty) and inject one bad
    batch (INJECT: garbage, huge, many, unknown)."""

    INJECT = ("garbage", "huge", "many", "unknown")

    END_SEQ = b"\xff" * 8

    def __init__(self, emu, cfg, form, hash_form, dp_rank=0):
        threading.Thread.__init__(self, name="kv-events", daemon=True)
        self.emu = emu
        self.cfg = cfg
        self.form = form              # map | typed | array | array0
        self.int_hash = hash_form == "int"
        self.dp_rank = dp_rank
        self.bs = emu.args.block_size
        self.topic = cfg["topic"].encode("utf-8")
        self.pinned = False
        self.endpoint = self.pod(self.offset(cfg["endpoint"], dp_rank))
        self.replay_ep = self.pod(self.offset(cfg["replay_endpoint"],
                                              dp_rank))
        self.cv = threading.Condition()
        self.q = deque()
        self.buffer = deque(maxlen=cfg["buffer_steps"])
        self.seq = 0
        self.drop_left = 0
        self.restart_req = False
        self.info = {"sent": 0, "dropped": 0, "restarts": 0, "replays": 0,
                     "replayed": 0, "bad_replay_requests": 0}
        self.ctx = zmq.Context()
        self.pub = self.rep = None
        self._open()

    def pod(self, ep):
        """--kv-events-bind-host: tcp://*:P bound on that host only."""
        host = getattr(self.emu.args, "kv_events_bind_host", None)
        if not ep or not host or not ep.startswith("tcp://*:"):
            return ep
        self.pinned = True            # bound, not connected
        if ":" in host:
            host = "[%s]" % host
        return "tcp://%s:%s" % (host, ep[len("tcp://*:"):])

    @staticmethod
    def offset(ep, rank):
        """ZmqEventPublisher.offset_endpoint_port."""
        if not ep or rank == 0:
            return ep
        if "inproc" in ep:
            return "%s_dp%d" % (ep, rank)
        i = ep.rfind(":")
        return "%s:%d" % (ep[:i], int(ep[i + 1:]) + rank)

    def _open(self):
        pub = self.ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.cfg["hwm"])
        pub.setsockopt(zmq.LINGER, 0)
        ep = self.endpoint
        if "[" in ep or "::" in ep:
            pub.setsockopt(zmq.IPV6, 1)   # libzmq's sockets are v4-only
        bind = ("*" in ep or "::" in ep or ep.startswith("ipc://")
                or ep.startswith("inproc://") or self.pinned)
        self._retry(lambda: pub.bind(ep) if bind else pub.connect(ep), pub)
        self.pub = pub
        if self.replay_ep:
            rep = self.ctx.socket(zmq.ROUTER)
            rep.setsockopt(zmq.LINGER, 0)
            if "[" in self.replay_ep or "::" in self.replay_ep:
                rep.setsockopt(zmq.IPV6, 1)
            self._retry(lambda: rep.bind(self.replay_ep), rep)
            self.rep = rep

    @staticmethod
    def _retry(fn, sock):
        # a port just closed (restart) is released by zmq's I/O thread a
        # moment later
        end = time.monotonic() + 3.0
        while True:
            try:
                fn()
                return
            except zmq.ZMQError:
                if time.monotonic() > end:
                    sock.close(0)
                    raise
                time.sleep(0.05)

    def _close(self):
        for s in (self.pub, self.rep):
            if s is not None:
                s.close(0)
        self.pub = self.rep = None

    # -- called by the scheduler / HTTP threads ----------------------------

    def publish(self, events):
        if not events:
            return
        with self.cv:
            while len(self.q) >= self.cfg["max_queue_size"]:
                self.cv.wait(0.05)   # vLLM's Queue.put blocks too
            self.q.append((time.time(), events, None))
            self.cv.notify_all()

    def fault(self, drop=None, restart=False, inject=None):
        with self.cv:
            if drop is not None:
                self.drop_left = drop
            if inject is not None:
                self.q.append((time.time(), None, inject))
                self.cv.notify_all()
            if restart:
                self.restart_req = True
                self.cv.notify_all()
                while self.restart_req:
                    self.cv.wait(0.05)

    def snapshot(self):
        with self.cv:
            d = dict(self.info)
            d.update(endpoint=self.endpoint, replay_endpoint=self.replay_ep,
                     topic=self.cfg["topic"], form=self.form,
                     hash="int" if self.int_hash else "bytes",
                     next_seq=self.seq, buffered=len(self.buffer),
                     queued=len(self.q), drop_left=self.drop_left)
        return d

    # -- encoding ----------------------------------------------------------

    def ext(self, h):
        # maybe_convert_block_hash
        return int.from_bytes(h[-8:], "big") if self.int_hash else h

    def wire(self, ev):
        """One event as the chosen vLLM version's msgspec structs encode
        it.  map (0.26: tag=True, omit_defaults), typed (vLLM main after
        it: extra keys as tagged ExtraKey structs, event_version 1 left out
        as the default), array (0.10-0.25: array_like, every field),
        array0 (0.9, @b4e69e0af33f: five BlockStored fields)."""
        form = self.form
        kind = ev[0]
        if kind == "stored":
            _, hashes, parent, toks, extra, lora, salt = ev
            if form == "typed":
                # extra_keys_to_typed: the LoRA name, then cache_salt
                ek = [[({"type": "lora", "name": x}
                        if lora is not None and x == lora[0]
                        else {"type": "cache_salt", "salt": x}
                        if salt is not None and x == salt
                        else {"type": "legacy", "value": x}) for x in k]
                       if k is not None else None for k in extra]
            else:
                ek = [list(k) if k is not None else None for k in extra]
            f = [("block_hashes", [self.ext(h) for h in hashes]),
                 ("parent_block_hash",
                  self.ext(parent) if parent is not None else None),
                 ("token_ids", list(toks)), ("block_size", self.bs),
                 ("lora_id", lora[1] if lora else None), ("medium", "GPU"),
                 ("lora_name", lora[0] if lora else None),
                 ("extra_keys", ek), ("group_idx", 0),
                 ("kv_cache_spec_kind", "full_attention"),
                 ("kv_cache_spec_sliding_window", None)]
            name = "BlockStored"
            if form == "array0":
                f = f[:5]
        elif kind == "removed":
            f = [("block_hashes", [self.ext(ev[1])]), ("medium", "GPU"),
                 ("group_idx", 0)]
            name = "BlockRemoved"
            if form == "array0":
                f = f[:1]
        else:
            f, name = [], "AllBlocksCleared"
        if form in ("array", "array0"):
            # array_like structs: every field, in declaration order
            return [name] + [v for _, v in f]
        # maps (omit_defaults): fields whose default is None are left out
        # when None (typed: locality and ownership too); lora_id, medium,
        # lora_name have no default
        d = {"type": name}
        for k, v in f:
            if v is None and k in ("kv_cache_spec_sliding_window",
                                   "group_idx", "extra_keys"):
                continue
            d[k] = v
        return d

    def batch(self, ts, events):
        b = [ts, [self.wire(e) for e in events]]
        if self.form != "array0":        # EventBatch.data_parallel_rank
            b.append(self.dp_rank)
        return mp_pack(b)

    def bad_batch(self, ts, kind):
        """One batch a subscriber must survive (the inject fault)."""
        if kind == "garbage":
            return b"\xc1\xc1\xc1 not msgpack \xff"   # 0xc1: never used
        tail = [self.dp_rank] if self.form != "array0" else []
        if kind == "huge":
            return mp_pack([ts, ["x" * (17 << 20)]] + tail)
        if self.form in ("array", "array0"):
            odd = [["BlockFrobbed", 1, 2], ["KVCacheMoved", [3], "CPU"]]
        else:
            odd = [{"type": "BlockFrobbed", "x": 1},
                   {"type": "KVCacheMoved", "block_hashes": [3]}]
        if kind == "many":
            return mp_pack([ts, odd[:1] * 70000] + tail)
        return mp_pack([ts, odd] + tail)

    # -- thread ------------------------------------------------------------

    def run(self):
        poller = None
        while True:
            if self.rep is not None:
                if poller is None:
                    poller = zmq.Poller()
                    poller.register(self.rep, zmq.POLLIN)
                if poller.poll(5):
                    try:
                        self._replay()
                    except zmq.ZMQError as e:   # as vLLM: logged, ignored
                        sys.stderr.write("vllm_emu: Error in replay: %s\n"
                                         % e)
            with self.cv:
                if self.restart_req:
                    self._close()
                    poller = None
                    self._open()
                    self.seq = 0
                    self.buffer.clear()
                    self.q.clear()
                    self.info["restarts"] += 1
                    self.restart_req = False
                    self.cv.notify_all()
                    continue
                if not self.q:
                    if self.rep is None:
                        self.cv.wait(0.2)
                    continue
                ts, events, bad = self.q.popleft()
                self.cv.notify_all()
                seq = self.seq
                self.seq += 1
                drop = self.drop_left > 0
                if drop:
                    self.drop_left -= 1
            payload = self.batch(ts, events) if bad is None \
                else self.bad_batch(ts, bad)
            sb = seq.to_bytes(8, "big")
            if not drop:
                try:
                    self.pub.send_multipart((self.topic, sb, payload))
                except zmq.ZMQError as e:
                    # vLLM: logged, a short back-off, the batch is lost
                    # (its seq stays used: subscribers see a gap)
                    sys.stderr.write("vllm_emu: Error in publisher thread:"
                                     " %s\n" % e)
                    time.sleep(0.1)
                    with self.cv:
                        self.info["send_errors"] = \
                            self.info.get("send_errors", 0) + 1
                    continue
            with self.cv:
                self.buffer.append((seq, payload))
                self.info["dropped" if drop else "sent"] += 1

    def _replay(self):
        frames = self.rep.recv_multipart()
        if len(frames) != 3:
            self.info["bad_replay_requests"] += 1
            sys.stderr.write("vllm_emu: WARNING Invalid replay request: "
                             "%d frames\n" % len(frames))
            return
        ident, _, start = frames
        start = int.from_bytes(start, "big")
        with self.cv:
            items = [(q, p) for q, p in self.buffer if q >= start]
            self.info["replays"] += 1
            self.info["replayed"] += len(items)
        # vLLM PR #45177: replies carry the topic frame (map forms)
        topic = [self.topic] if self.form in ("map", "typed") else []
        for q, p in items:
            self.rep.send_multipart([ident, b""] + topic +
                                    [q.to_bytes(8, "big"), p])
        self.rep.send_multipart([ident, b""] + ([b""] if topic else []) +
                                [self.END_SEQ, b""])


def parse_lora_modules(specs):
    """--lora-modules NAME=PATH | JSON {"name":..,"path":..}: name ->
    (name, lora_int_id), ids from 1 in order as vLLM's serving models."""
    out = {}
    for sp in specs or []:
        name = None
        if sp.startswith("{"):
            try:
                o = json.loads(sp)
                name = o.get("name") if isinstance(o, dict) else None
            except ValueError:
                name = None
        else:
            name = sp.split("=", 1)[0]
        if not isinstance(name, str) or not name:
            raise ValueError("bad --lora-modules entry %r (NAME=PATH or "
                             "{\"name\":..,\"path\":..})" % sp)
        if name not in out:
            out[name] = (name, len(out) + 1)
    return out


def apc_request_keys(emu, body):
    """The request's cache_salt and LoRA (vLLM's protocol validator:
    cache_salt must be a non-empty string when given)."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError(400, "Parameter 'cache_salt' must be a non-empty "
                       "string if provided.")
    lora = emu.loras.get(body.get("model"))
    skip = body.get("prompt_logprobs") is not None
    return salt, lora, skip


class Emu(object):
    lmc_lock = threading.Lock()
    lmc_zctx = None

    def __init__(self, args):
        self.lmc_socks = {}
        self.args = args
        self.t0 = time.time()
        self.lock = threading.Lock()
        self.counters = {}
        self.records = deque(maxlen=args.stats_keep)
        self.next_n = 1
        self.engine_id = args.engine_id or ("emu-%s-%d-%s" % (
            args.host, args.port, uuid.uuid4().hex[:8]))
        self.tok = self._load_tokenizer()
        self.loras = args.loras
        self._word_ids = {}
        self.kv_events_cfg = args.kv_events
        self.kv_pub = None
        self.sched = Scheduler(self)
        self.kv = KvState(self)
        self.faults = Faults()
        r = {}
        if args.fail_status is not None:
            r["status"] = args.fail_status
        if args.delay_ms:
            r["delay_ms"] = args.delay_ms
        if args.hang:
            r["hang"] = True
        if args.disconnect_after is not None:
            r["disconnect_after"] = args.disconnect_after
        if args.malformed_json:
            r["malformed_json"] = True
        if r:
            if args.fault_path:
                r["path"] = args.fault_path
            if args.fault_role:
                r["role"] = args.fault_role
            if args.fault_count:
                r["count"] = args.fault_count
            self.faults.set([r])
        self.prom = {"prompt": 0, "gen": 0, "success": {}}
        self.pulling = 0    # NIXL pulls in flight (vLLM: waiting for KVs)
        self.kva = KvAgent(self, args.kv_agent_socket) \
            if args.kv_agent_socket else None

    def _load_tokenizer(self):
        a = self.args
        if not a.tokenizer:
            return FallbackTokenizer()
        lib = a.tokenizer_lib or default_lib_path()
        if not os.path.exists(lib):
            sys.exit("vllm_emu: --tokenizer given but the tokenizer library "
                     "%s does not exist (build it with `make`, or pass "
                     "--tokenizer-lib)" % lib)
        try:
            return LibTokenizer(lib, a.tokenizer, a.tokenizer_config,
                                a.chat_template)
        except (OSError, RuntimeError, AttributeError) as e:
            sys.exit("vllm_emu: %s" % e)

    def word_id(self, tok):
        """The token id of a generated word (its text as the tokenizer
        encodes it), so blocks filled by the output are cached under the
        ids the next turn's prompt has."""
        i = self._word_ids.get(tok)
        if i is None:
            try:
                ids = self.tok.encode(tok, False)
            except ApiError:
                ids = []
            i = ids[0] if ids else 0
            self._word_ids[tok] = i
        return i

    def start_kv_events(self):
        cfg = self.kv_events_cfg
        if cfg is None:
            return
        a = self.args
        if not a.enable_prefix_caching:
            sys.stderr.write("vllm_emu: WARNING KV cache events are on, but "
                             "prefix caching is not enabled. Use "
                             "--enable-prefix-caching to enable.\n")
        try:
            self.kv_pub = KvEventPublisher(self, cfg, a.kv_events_form,
                                           a.kv_events_hash,
                                           a.data_parallel_rank)
        except zmq.ZMQError as e:
            sys.exit("vllm_emu: KV events publisher on %s (replay %s): %s"
                     % (cfg["endpoint"], cfg["replay_endpoint"], e))
        self.kv_pub.start()

    def counter_add(self, name, v):
        with self.lock:
            self.counters[name] = self.counters.get(name, 0) + v

    def lmc_send(self, rank, msg, times):
        """One PUSH connection per sender rank, as each rank's PDBackend
        keeps its own."""
        with self.lmc_lock:
            if self.lmc_zctx is None:
                self.lmc_zctx = zmq.Context()
            s = self.lmc_socks.get(rank)
            if s is None:
                s = self.lmc_zctx.socket(zmq.PUSH)
                s.setsockopt(zmq.LINGER, 1000)
                s.setsockopt(zmq.SNDTIMEO, 1000)
                # from this instance's address, as a pod's ranks connect
                s.connect("tcp://%s:0;%s" % (self.args.host,
                                             self.args.lmcache_proxy))
                self.lmc_socks[rank] = s
            for _ in range(times):
                try:
                    s.send(msg)
                except zmq.Again:
                    self.counter_add("lmcache_notices_lost_total", 1)

    def new_record(self, method, path, headers, body_raw):
        rec = {"method": method, "path": path,
               "request_id": headers.get("x-request-id"),
               "client_request_id": headers.get("x-client-request-id"),
               "headers": dict(headers), "body": None, "status": None,
               "fault": None, "stream": False, "prompt_tokens": None,
               "cached_tokens": None, "completion_tokens": None,
               "finish_reason": None, "text": None, "aborted": False,
               "kv": None, "ttft_ms": None, "duration_ms": None}
        try:
            rec["body"] = json.loads(body_raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            rec["body_raw"] = body_raw[:4096].decode("utf-8", "replace")
        if b'"kv_transfer_params"' in body_raw:
            # a KV hand-off: its bytes as received (a gateway's copy)
            rec["body_text"] = body_raw[:65536].decode("utf-8", "replace")
        with self.lock:
            rec["n"] = self.next_n
            rec["t"] = round(time.time() - self.t0, 6)
            rec["t_wall"] = round(time.time(), 6)
            self.next_n += 1
            self.records.append(rec)
        return rec

    def stats(self, since=0):
        nx, lm = self.kv.snapshot()
        running, waiting, used = self.sched.counts()
        a = self.args
        with self.lock:
            recs = [dict(r) for r in self.records if r["n"] > since]
            counters = dict(self.counters)
            nxt = self.next_n
        return {
            "instance": {
                "host": a.host, "port": a.port, "role": a.role,
                "model": a.model, "engine_id": self.engine_id,
                "tokenizer": self.tok.desc, "block_size": a.block_size,
                "side_channel_host": a.side_channel_host or a.host,
                "side_channel_port": a.side_channel_port,
                "lmcache_init_port": a.lmcache_init_port,
                "lmcache_alloc_port": a.lmcache_alloc_port,
                "lmcache_chunk_size": a.lmcache_chunk_size,
                "kv_agent_socket": a.kv_agent_socket,
                "kv_wait_ms": a.kv_wait_ms,
                "time_scale": a.time_scale, "pid": os.getpid()},
            "counters": counters,
            "scheduler": {"running": running, "waiting": waiting,
                          "pulling": self.pulling,
                          "steps": self.sched.steps,
                          "busy_s": round(self.sched.busy_s, 6)},
            "kv": {"block_size": a.block_size, "total_blocks": a.kv_blocks,
                   "used_blocks": used, "nixl_held": nx,
                   "nixl_held_blocks": sum(e["blocks"] for e in nx),
                   "lmcache_held": lm, "lmcache_held_chunks": len(lm),
                   "lmcache_held_tokens": sum(e["tokens"] for e in lm),
                   "kv_agent": self.kva.snapshot() if self.kva else None,
                   "prefix_cache": self.apc_snapshot(),
                   "kv_events": self.kv_pub.snapshot() if self.kv_pub
                   else None},
            "faults": self.faults.get(),
            "requests": recs, "next": nxt}

    def apc_snapshot(self):
        with self.sched.cv:
            return self.sched.pool.snapshot()

    def reset(self):
        with self.lock:
            self.records.clear()
            self.counters = {}
            self.prom = {"prompt": 0, "gen": 0, "success": {}}

    def metrics(self):
        running, waiting, used = self.sched.counts()
        waiting += self.pulling
        a = self.args
        lab = 'model_name="%s"' % a.model.replace('"', '\\"')
        usage = min(1.0, used / float(a.kv_blocks)) if a.kv_blocks else 0.0
        nx, lm = self.kv.snapshot()
        with self.lock:
            c = dict(self.counters)
            prom = {"prompt": self.prom["prompt"], "gen": self.prom["gen"],
                    "success": dict(self.prom["success"])}
        out = []

        def m(name, typ, hlp, samples):
            out.append("# HELP %s %s" % (name, hlp))
            out.append("# TYPE %s %s" % (name, typ))
            for labels, v in samples:
                out.append("%s{%s} %s" % (name, labels, float(v)))
        m("vllm:num_requests_running", "gauge",
          "Number of requests in model execution batches.", [(lab, running)])
        m("vllm:num_requests_waiting", "gauge",
          "Number of requests waiting to be processed.", [(lab, waiting)])
        m("vllm:gpu_cache_usage_perc", "gauge",
          "GPU KV-cache usage. 1 means 100 percent usage.", [(lab, usage)])
        m("vllm:kv_cache_usage_perc", "gauge",
          "KV-cache usage. 1 means 100 percent usage.", [(lab, usage)])
        apc = self.apc_snapshot()
        m("vllm:prefix_cache_queries_total", "counter",
          "Prefix cache queries, in terms of number of queried tokens.",
          [(lab, apc["queries"])])
        m("vllm:prefix_cache_hits_total", "counter",
          "Prefix cache hits, in terms of number of cached tokens.",
          [(lab, apc["hits"])])
        m("vllm:prompt_tokens_total", "counter",
          "Number of prefill tokens processed.", [(lab, prom["prompt"])])
        m("vllm:generation_tokens_total", "counter",
          "Number of generation tokens processed.", [(lab, prom["gen"])])
        m("vllm:request_success_total", "counter",
          "Count of successfully processed requests.",
          [('finished_reason="%s",%s' % (k, lab), v)
           for k, v in sorted(prom["success"].items())] or
          [('finished_reason="length",%s' % lab, 0)])
        emu_names = [
            ("requests_total", "HTTP generation requests received."),
            ("responses_2xx_total", "Generation requests answered 2xx."),
            ("responses_4xx_total", "Generation requests answered 4xx."),
            ("responses_5xx_total", "Generation requests answered 5xx."),
            ("aborted_total", "Requests aborted by client disconnect."),
            ("faults_total", "Requests that hit a fault rule."),
            ("steps_total", "Scheduler steps."),
            ("prefill_tokens_computed_total", "Prompt tokens computed."),
            ("decode_tokens_total", "Tokens produced by decode steps."),
            ("cached_tokens_total", "Prompt tokens reused from a transfer."),
            ("prefill_requests_total", "Requests served as a prefill copy."),
            ("nixl_held_total", "NIXL prefills whose blocks were held."),
            ("nixl_pull_ok_total", "NIXL pulls that reused the KV."),
            ("nixl_transferred_tokens_total",
             "Prompt tokens whose KV NIXL pulls moved (blocks the decoder "
             "lacked)."),
            ("nixl_pull_failed_total", "NIXL pulls that failed (recompute)."),
            ("nixl_pull_mismatch_total",
             "NIXL pulls with other prompt tokens (recompute)."),
            ("nixl_served_total", "NIXL side-channel pulls answered."),
            ("nixl_expired_total", "Held NIXL blocks freed by timeout."),
            ("nixl_invalid_params_total",
             "NIXL consumer params missing a required field (recompute)."),
            ("lmcache_push_ok_total", "LMCache pushes to a decoder."),
            ("lmcache_push_failed_total", "LMCache pushes that failed."),
            ("lmcache_received_chunks_total", "LMCache chunks received."),
            ("lmcache_hit_tokens_total", "Prompt tokens found in LMCache."),
            ("lmcache_expired_chunks_total", "LMCache chunks expired."),
            ("kv_agent_pushed_total", "kv_agent prefills answered pushed."),
            ("kv_agent_push_failed_total",
             "kv_agent prefills answered failed."),
            ("kv_agent_push_done_total", "kv_agent pushes that completed."),
            ("kv_agent_push_lost_total",
             "kv_agent pushes accepted that failed later."),
            ("kv_agent_ready_total", "kv_agent KV landed and reused."),
            ("kv_agent_not_ready_total",
             "kv_agent KV not (yet) landed (recompute)."),
            ("kv_agent_failed_total",
             "kv_agent transfers failed (recompute)."),
            ("kv_agent_mismatch_total",
             "kv_agent KV of another prompt (recompute)."),
            ("kv_agent_no_agent_total",
             "dpd decode requests without a usable agent (recompute)."),
            ("kv_agent_late_released_total",
             "kv_agent KV that landed after its request; freed."),
        ]
        for n, h in emu_names:
            m("emu_" + n, "counter", h, [(lab, c.get(n, 0))])
        m("emu_nixl_held_blocks", "gauge", "KV blocks held for pullers.",
          [(lab, sum(e["blocks"] for e in nx))])
        m("emu_lmcache_held_chunks", "gauge", "LMCache chunks held.",
          [(lab, len(lm))])
        if self.kva:
            ka = self.kva.snapshot()
            m("emu_kv_agent_held_blocks", "gauge",
              "Source blocks held for kv_agent pushes.",
              [(lab, ka["held_blocks"])])
        return "\n".join(out) + "\n"

    # -- side channel (NIXL, prefill side) ---------------------------------

    def on_side_channel(self, msg):
        if msg.get("op") != "pull":
            return {"ok": False, "error": "unknown op"}
        if msg.get("engine_id") not in (None, self.engine_id):
            return {"ok": False, "error": "engine id mismatch"}
        e = self.kv.nixl_take(str(msg.get("request_id")))
        if e is None:
            return {"ok": False, "error": "unknown request id"}
        self.sched.free_blocks(e["blocks"])
        self.counter_add("nixl_served_total", 1)
        return {"ok": True, "engine_id": self.engine_id,
                "request_id": e["request_id"], "block_ids": e["published"],
                "n_blocks": len(e["blocks"]), "tokens": e["tokens"],
                "n_prompt": e["n_prompt"], "token_hash": e["token_hash"],
                "block_size": self.args.block_size}

    # -- LMCache receiver (decode side) ------------------------------------

    def on_lmc_init(self, msg):
        if msg.get("op") != "init":
            return {"ok": False, "error": "unknown op"}
        self.counter_add("lmcache_inits_total", 1)
        return {"ok": True, "engine_id": self.engine_id}

    def on_lmc_alloc(self, msg):
        if msg.get("op") != "alloc" or not isinstance(msg.get("chunks"),
                                                       list):
            return {"ok": False, "error": "bad alloc"}
        self.kv.lmc_put(str(msg.get("req_id")), msg["chunks"])
        self.counter_add("lmcache_received_chunks_total", len(msg["chunks"]))
        return {"ok": True, "n_chunks": len(msg["chunks"])}

    def start(self):
        a = self.args
        self.start_kv_events()
        self.sched.start()
        if self.kva:
            self.kva.start()
        if a.role in ("prefill", "both"):
            serve_lines(a.side_channel_host or a.host, a.side_channel_port,
                        self.on_side_channel, "side-channel")
        if a.role in ("decode", "both") and a.lmcache_init_port:
            serve_lines(a.host, a.lmcache_init_port, self.on_lmc_init,
                        "lmcache-init")
            serve_lines(a.host, a.lmcache_alloc_port, self.on_lmc_alloc,
                        "lmcache-alloc")

        def reaper():
            while True:
                time.sleep(0.2)
                self.kv.expire()
        threading.Thread(target=reaper, name="reaper", daemon=True).start()


# ---------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------

class ClientGone(Exception):
    pass


REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized",
           403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
           408: "Request Timeout", 413: "Payload Too Large",
           422: "Unprocessable Entity", 429: "Too Many Requests",
           500: "Internal Server Error", 502: "Bad Gateway",
           503: "Service Unavailable", 504: "Gateway Timeout"}


class HttpServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 256


class Conn(socketserver.BaseRequestHandler):
    """One client connection: HTTP/1.1 keep-alive loop (h11/uvicorn-like)."""

    emu = None  # set on the subclass

    def setup(self):
        self.sock = self.request
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rbuf = b""

    # -- reading -----------------------------------------------------------

    def _fill(self):
        d = self.sock.recv(65536)
        if not d:
            raise ClientGone()
        self.rbuf += d

    def _readline(self, limit=65536):
        while b"\r\n" not in self.rbuf:
            if len(self.rbuf) > limit:
                raise ValueError("line too long")
            self._fill()
        line, self.rbuf = self.rbuf.split(b"\r\n", 1)
        return line

    def _read(self, n):
        while len(self.rbuf) < n:
            self._fill()
        d, self.rbuf = self.rbuf[:n], self.rbuf[n:]
        return d

    def _read_request(self):
        line = self._readline()
        while line == b"":
            line = self._readline()
        parts = line.decode("latin-1").split()
        if len(parts) != 3:
            raise ValueError("bad request line")
        method, target, version = parts
        headers = {}
        while True:
            h = self._readline()
            if h == b"":
                break
            k, _, v = h.decode("latin-1").partition(":")
            k = k.strip().lower()
            v = v.strip()
            headers[k] = (headers[k] + ", " + v) if k in headers else v
        if headers.get("expect", "").lower() == "100-continue":
            self.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = b""
            while True:
                size = int(self._readline().split(b";")[0], 16)
                if size == 0:
                    while self._readline() != b"":
                        pass
                    break
                body += self._read(size)
                self._read(2)
        else:
            body = self._read(int(headers.get("content-length", "0") or 0))
        return method, target, version, headers, body

    # -- writing -----------------------------------------------------------

    def _head(self, status, ctype, length=None, chunked=False, extra=()):
        self.status = status
        h = ["HTTP/1.1 %d %s" % (status, REASONS.get(status, "Unknown")),
             "date: " + formatdate(usegmt=True), "server: uvicorn"]
        if length is not None:
            h.append("content-length: %d" % length)
        if ctype:
            h.append("content-type: " + ctype)
        for k, v in extra:
            h.append("%s: %s" % (k, v))
        if chunked:
            h.append("transfer-encoding: chunked")
        if not self.keep:
            h.append("connection: close")
        return ("\r\n".join(h) + "\r\n\r\n").encode("latin-1")

    def send(self, data):
        try:
            self.sock.sendall(data)
        except OSError:
            raise ClientGone()

    def respond(self, status, body, ctype="application/json", extra=()):
        if isinstance(body, str):
            body = body.encode("utf-8")
        self.send(self._head(status, ctype, len(body), extra=extra) + body)

    def client_closed(self):
        """True when the peer has closed (EOF pending) — poll, no wait."""
        try:
            r, _, _ = select.select([self.sock], [], [], 0)
            if not r:
                return False
            d = self.sock.recv(65536, socket.MSG_PEEK)
            return d == b""
        except OSError:
            return True

    # -- main loop ---------------------------------------------------------

    def handle(self):
        try:
            while True:
                try:
                    method, target, version, headers, body = \
                        self._read_request()
                except (ValueError, IndexError):
                    self.keep = False
                    self.respond(400, "Invalid HTTP request received.",
                                 "text/plain; charset=utf-8")
                    return
                self.version = version
                conn = headers.get("connection", "").lower()
                self.keep = version == "HTTP/1.1" and "close" not in conn
                self.status = 0
                t0 = now_ms()
                try:
                    self.dispatch(method, target, headers, body)
                except (ClientGone, OSError):
                    raise
                except Exception:
                    # a bug here must look like vLLM's 500, not a hang
                    traceback.print_exc()
                    self.keep = False
                    if not self.status:
                        self.respond(500, ApiError(
                            500, "emulator internal error").body())
                    return
                finally:
                    if self.emu.args.verbose:
                        self.access_log(method, target, headers, t0)
                if not self.keep:
                    return
        except ClientGone:
            return
        except OSError:
            return

    def access_log(self, method, target, headers, t0):
        sys.stderr.write("%s %s:%d %s %s %s rid=%s %.1fms\n" % (
            time.strftime("%H:%M:%S"), self.client_address[0],
            self.client_address[1], method, target, self.status or "-",
            headers.get("x-request-id", "-"), now_ms() - t0))
        sys.stderr.flush()

    def dispatch(self, method, target, headers, body):
        emu = self.emu
        path, _, query = target.partition("?")
        gen = path in ("/v1/completions", "/v1/chat/completions")
        if not gen and path in ("/health", "/v1/models", "/metrics"):
            fault = emu.faults.match(path, "any")
            if fault and self.apply_fault(fault, None, headers, False, None):
                return
        if path == "/health" and method == "GET":  # vLLM: empty 200
            return self.respond(200, b"", None)
        if path == "/v1/models" and method == "GET":
            return self.respond(200, jdump(self.models()))
        if path == "/metrics" and method == "GET":
            return self.respond(200, emu.metrics(),
                                "text/plain; version=0.0.4; charset=utf-8")
        if path == "/emu/stats" and method == "GET":
            since = 0
            m = re.search(r"(?:^|&)since=(\d+)", query)
            if m:
                since = int(m.group(1))
            return self.respond(200, jdump(emu.stats(since)))
        if self.apc_dispatch(method, path, body):
            return
        if path == "/emu/reset" and method == "POST":
            emu.reset()
            return self.respond(200, jdump({"ok": True}))
        if path == "/emu/fault":
            if method == "GET":
                return self.respond(200, jdump({"rules": emu.faults.get()}))
            if method in ("POST", "PUT", "DELETE"):
                try:
                    spec = json.loads(body.decode() or "{}") \
                        if method != "DELETE" else {}
                    if isinstance(spec, dict) and "rules" in spec:
                        rules = spec["rules"]
                    elif spec in ({}, None) or (isinstance(spec, dict)
                                                and spec.get("clear")):
                        rules = []
                    else:
                        rules = [spec]
                    emu.faults.set(rules)
                except (ValueError, TypeError) as e:
                    return self.respond(400, jdump({"ok": False,
                                                    "error": str(e)}))
                return self.respond(200, jdump({"rules": emu.faults.get()}))
        if gen:
            if method != "POST":
                return self.respond(405, jdump(
                    {"detail": "Method Not Allowed"}),
                    extra=[("allow", "POST")])
            return self.generate(path, headers, body)
        if path in ("/health", "/v1/models", "/metrics", "/emu/stats",
                    "/emu/reset", "/emu/fault"):
            return self.respond(405, jdump({"detail": "Method Not Allowed"}))
        return self.respond(404, jdump({"detail": "Not Found"}))

    # -- prefix caching / KV events ----------------------------------------

    def apc_prepare(self, s, salt, lora, skip_read):
        """The request's extra keys and its prompt's block hashes (vLLM
        hashes them when the request is created)."""
        s.salt = salt
        s.lora = lora
        s.apc_skip_read = skip_read
        pool = self.emu.sched.pool
        if pool.enabled:
            apc_hash_blocks(pool.seed, s.prompt_ids, pool.bs, s.apc_hashes,
                            lora, salt)

    def apc_dispatch(self, method, path, body):
        """POST /reset_prefix_cache (vLLM's, dev mode there) and the
        emulator's /emu/kv_events (publisher state and faults)."""
        emu = self.emu
        if path == "/reset_prefix_cache":
            if method != "POST":
                self.respond(405, jdump({"detail": "Method Not Allowed"}))
            elif emu.sched.reset_prefix_cache():
                sys.stderr.write("vllm_emu: Successfully reset prefix "
                                 "cache\n")
                self.respond(200, b"", None)
            else:
                # vLLM logs it and answers 200 all the same
                used = emu.sched.counts()[2]
                sys.stderr.write("vllm_emu: WARNING Failed to reset prefix "
                                 "cache because some blocks (%d) are not "
                                 "freed yet\n" % used)
                self.respond(200, b"", None)
            return True
        if path != "/emu/kv_events":
            return False
        if emu.kv_pub is None:
            self.respond(404, jdump({"detail": "KV events are off "
                                     "(--kv-events-config)"}))
            return True
        if method == "POST":
            try:
                spec = json.loads(body.decode("utf-8") or "{}")
                if not isinstance(spec, dict) or set(spec) - {
                        "drop", "restart", "inject"}:
                    raise ValueError("expected {\"drop\": N}, "
                                     "{\"restart\": true} and/or "
                                     "{\"inject\": KIND}")
                inject = spec.get("inject")
                if inject is not None and \
                        inject not in KvEventPublisher.INJECT:
                    raise ValueError("inject: expected one of %s" %
                                     ", ".join(KvEventPublisher.INJECT))
                drop = spec.get("drop")
                if drop is not None and (not isinstance(drop, int) or
                                         isinstance(drop, bool) or
                                         drop < 0):
                    raise ValueError("drop: expected an integer >= 0")
                if not isinstance(spec.get("restart", False), bool):
                    raise ValueError("restart: expected true or false")
            except (ValueError, UnicodeDecodeError) as e:
                self.respond(400, jdump({"ok": False, "error": str(e)}))
                return True
            emu.kv_pub.fault(drop=drop, restart=spec.get("restart", False),
                             inject=inject)
        elif method != "GET":
            self.respond(405, jdump({"detail": "Method Not Allowed"}))
            return True
        self.respond(200, jdump(emu.kv_pub.snapshot()))
        return True

    def models(self):
        a = self.args_
        t = int(self.emu.t0)
        return {"object": "list", "data": [{
            "id": a.model, "object": "model", "created": t,
            "owned_by": "vllm", "root": a.model, "parent": None,
            "max_model_len": a.max_model_len,
            "permission": [{
                "id": "modelperm-" + uuid.uuid5(uuid.NAMESPACE_DNS,
                                                a.model).hex,
                "object": "model_permission", "created": t,
                "allow_create_engine": False, "allow_sampling": True,
                "allow_logprobs": True, "allow_search_indices": False,
                "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None,
                "is_blocking": False}]}]}

    @property
    def args_(self):
        return self.emu.args

    # -- faults ------------------------------------------------------------

    def apply_fault(self, f, rec, headers, stream, body_obj):
        """Apply rule f.  True when the request was fully answered (or
        dropped); False when generation proceeds (delay, malformed JSON,
        disconnect-after are then applied while answering)."""
        emu = self.emu
        emu.counter_add("faults_total", 1)
        if rec is not None:
            rec["fault"] = f
        if f.get("delay_ms"):
            end = time.monotonic() + f["delay_ms"] / 1000.0
            while time.monotonic() < end:
                if self.client_closed():
                    if rec is not None:
                        rec["aborted"] = True
                    raise ClientGone()
                time.sleep(min(0.01, max(0, end - time.monotonic())))
        if f.get("hang"):
            while not self.client_closed():
                time.sleep(0.02)
            if rec is not None:
                rec["aborted"] = True
            raise ClientGone()
        if f.get("status"):
            st = int(f["status"])
            err = ApiError(st, "emulated fault: status %d" % st)
            if rec is not None:
                rec["status"] = st
            self.count_status(st)
            self.respond(st, err.body())
            return True
        if f.get("disconnect_after") == 0:
            if rec is not None:
                rec["status"] = 0
            self.keep = False
            self.drop()
            return True
        if f.get("reset"):
            # the request was read: abort the connection (TCP RST)
            if rec is not None:
                rec["status"] = 0
            self.keep = False
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                 struct.pack("ii", 1, 0))
            self.sock.close()
            raise ClientGone()
        return False

    def drop(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        raise ClientGone()

    def count_status(self, st):
        self.emu.counter_add("responses_%dxx_total" % (st // 100), 1)

    # -- generation --------------------------------------------------------

    def generate(self, path, headers, raw):
        emu = self.emu
        a = emu.args
        chat = path == "/v1/chat/completions"
        emu.counter_add("requests_total", 1)
        rec = emu.new_record("POST", path, headers, raw)
        t_start = now_ms()
        body = rec["body"]
        kvp = body.get("kv_transfer_params") if isinstance(body, dict) \
            else None
        if not isinstance(kvp, dict):
            kvp = None
        dpd = kvp.get("dpd") if kvp else None
        if not isinstance(dpd, dict):
            dpd = None
        req_role = "prefill" if kvp and (kvp.get("do_remote_decode") or
                                         kvp.get("disagg_spec") or
                                         (dpd and "decode_node" in dpd)) \
            else "decode"
        fault = emu.faults.match(path, req_role)
        stream = bool(isinstance(body, dict) and body.get("stream") is True)
        if fault and self.apply_fault(fault, rec, headers, stream, body):
            return
        try:
            p = self.parse(chat, body)
            salt, lora, skip_read = apc_request_keys(emu, body)
        except ApiError as e:
            rec["status"] = e.status
            self.count_status(e.status)
            return self.respond(e.status, e.body())
        rec["stream"] = p["stream"]
        xrid = headers.get("x-request-id")
        base = xrid if xrid else uuid.uuid4().hex
        rid = ("chatcmpl-" if chat else "cmpl-") + base
        prompts = p["prompts"]
        n_prompt = sum(len(x) for x in prompts)
        rec["prompt_tokens"] = n_prompt
        # engine-level request ids (what NIXL's remote_request_id names)
        eids = [rid] if chat else ["%s-%d" % (rid, i)
                                   for i in range(len(prompts))]

        # -- KV handoff, consumer side (before scheduling) --
        kvinfo = None
        cached = [0] * len(prompts)
        single = len(prompts) == 1
        if kvp and single and kvp.get("do_remote_prefill"):
            kvinfo = self.nixl_pull(kvp, prompts[0], eids[0],
                                    emu.sched.peek_hit(prompts[0], salt, lora,
                                                       skip_read))
            cached[0] = kvinfo["cached_tokens"]
        elif dpd is not None and req_role == "decode":
            kvinfo = self.kv_agent_consume(dpd, prompts)
            cached[0] = kvinfo["cached_tokens"]
        elif (single and req_role == "decode" and a.lmcache_init_port
              and a.role in ("decode", "both")):
            got = emu.kv.lmc_take_prefix(
                lmc_chunk_keys(prompts[0], a.lmcache_chunk_size))
            if got:
                c = min(got, len(prompts[0]) - 1)
                kvinfo = {"protocol": "lmcache", "side": "consumer",
                          "outcome": "hit", "hit_tokens": got,
                          "cached_tokens": c}
                cached[0] = c
                emu.counter_add("lmcache_hit_tokens_total", got)
        nixl_producer = bool(kvp and single and kvp.get("do_remote_decode")
                             and a.role in ("prefill", "both"))
        lmc_spec = kvp.get("disagg_spec") if (kvp and single and
                                              a.role in ("prefill", "both")) \
            else None
        dpd_producer = bool(dpd is not None and req_role == "prefill"
                            and single and a.role in ("prefill", "both"))
        if req_role == "prefill":
            if nixl_producer or lmc_spec or dpd_producer:
                emu.counter_add("prefill_requests_total", 1)
            else:
                kvinfo = {"protocol": "nixl" if kvp.get("do_remote_decode")
                          else "lmcache" if kvp.get("disagg_spec")
                          else "kv_agent", "side": "producer",
                          "outcome": "ignored (role %s)" % a.role}
        rec["cached_tokens"] = sum(cached)
        emu.counter_add("cached_tokens_total", sum(cached))

        # -- schedule --
        events = QueueLite()
        seqs = []
        for i, ids in enumerate(prompts):
            s = Seq(eids[i], i, ids, cached[i], p["max_tokens"], p["stop"],
                    events, emu.tok.vocab)
            s.hold_kv = nixl_producer
            self.apc_prepare(s, salt, lora, skip_read)
            seqs.append(s)
        emu.sched.submit(seqs)
        created = int(time.time())
        model = a.model
        extra = [("x-request-id", xrid)] if (a.enable_request_id_headers
                                             and xrid) else []
        malformed = bool(fault and fault.get("malformed_json"))
        disc = fault.get("disconnect_after") if fault else None

        def finish_rec(status, texts, reasons):
            rec["status"] = status
            rec["completion_tokens"] = sum(s.out_n for s in seqs)
            # what usage reports: the transfer's KV or the prefix cache's
            rec["cached_tokens"] = sum(s.n_cached for s in seqs)
            rec["prefix_cache_hit_tokens"] = sum(s.apc_hit for s in seqs)
            rec["finish_reason"] = reasons[0] if len(reasons) == 1 \
                else reasons
            rec["text"] = texts[0] if len(texts) == 1 else texts
            rec["duration_ms"] = round(now_ms() - t_start, 3)
            rec["kv"] = kvinfo
            self.count_status(status)

        ntok = [0] * len(prompts)   # tokens delivered so far, per choice

        def usage_obj(final):
            comp = sum(ntok)
            u = {"prompt_tokens": n_prompt,
                 "total_tokens": n_prompt + comp,
                 "completion_tokens": comp}
            # num_cached_tokens: local prefix-cache hit or transferred KV,
            # known once the request was scheduled
            c = sum(s.n_cached for s in seqs)
            if final and a.prompt_tokens_details and c:
                u["prompt_tokens_details"] = {"cached_tokens": c}
            elif final == "full":
                u["prompt_tokens_details"] = None
            return u

        nleft = len(seqs)
        texts = [""] * len(seqs)
        reasons = [None] * len(seqs)
        stops = [None] * len(seqs)
        first = [True] * len(seqs)
        sent = 0
        chunked = self.version == "HTTP/1.1"
        try:
            if p["stream"]:
                if not chunked:
                    self.keep = False
                self.send(self._head(200, "text/event-stream; charset=utf-8",
                                     None, chunked=chunked, extra=extra))

                def event(obj):
                    d = jdump(obj) if isinstance(obj, dict) else obj
                    if malformed and isinstance(obj, dict):
                        d = d[:max(1, len(d) // 2)] + "\x01"
                    data = ("data: " + d + "\n\n").encode("utf-8")
                    if chunked:
                        data = b"%x\r\n%s\r\n" % (len(data), data)
                    self.send(data)
            while nleft:
                ev = events.get(0.02)
                if ev is None:
                    if self.client_closed():
                        raise ClientGone()
                    continue
                idx, delta, reason, stop_reason, ntok[idx] = ev
                if rec["ttft_ms"] is None:
                    rec["ttft_ms"] = round(now_ms() - t_start, 3)
                texts[idx] += delta
                if reason is not None:
                    reasons[idx] = reason
                    stops[idx] = stop_reason
                    nleft -= 1
                if not p["stream"]:
                    continue
                if disc is not None and sent >= disc:
                    self.keep = False
                    self.drop()
                if chat:
                    if first[idx]:
                        first[idx] = False
                        ch = {"id": rid, "object": "chat.completion.chunk",
                              "created": created, "model": model,
                              "choices": [{"index": idx, "delta": {
                                  "role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}]}
                        if p["cont_usage"]:
                            ch["usage"] = usage_obj(False)
                        event(ch)
                        sent += 1
                        if disc is not None and sent >= disc:
                            self.keep = False
                            self.drop()
                    choice = {"index": idx, "delta": {"content": delta},
                              "logprobs": None, "finish_reason": reason}
                    if reason is not None:
                        choice["stop_reason"] = stop_reason
                    ch = {"id": rid, "object": "chat.completion.chunk",
                          "created": created, "model": model,
                          "choices": [choice]}
                    if p["cont_usage"]:
                        ch["usage"] = usage_obj(False)
                else:
                    ch = {"id": rid, "object": "text_completion",
                          "created": created, "model": model,
                          "choices": [{"index": idx, "text": delta,
                                       "logprobs": None,
                                       "finish_reason": reason,
                                       "stop_reason": stop_reason}],
                          "usage": usage_obj(False) if p["cont_usage"]
                          else None}
                event(ch)
                sent += 1
            # prefill-side protocol work after the prompt is computed
            kv_out = None
            if nixl_producer:
                kv_out, kvinfo = self.nixl_hold(seqs[0], eids[0])
            elif lmc_spec is not None:
                if a.lmcache_push_delay_ms > 0:
                    kvinfo = {"protocol": "lmcache", "side": "producer",
                              "outcome": "async"}
                    threading.Thread(target=self.lmc_push_later,
                                     args=(lmc_spec, list(prompts[0]),
                                           fault, rec),
                                     daemon=True).start()
                else:
                    kvinfo = self.lmc_push(lmc_spec, prompts[0])
                    if kvinfo.get("outcome") == "pushed":
                        self.lmc_notify(lmc_spec, fault, rec)
            elif dpd_producer:
                kv_out, kvinfo = self.kv_agent_push(dpd, prompts[0])
            if kvp and "ret_first_tok" in kvp:
                # LMCache's connector returns the prefill's first token
                kv_out = {"first_tok": seqs[0].first_tok}
            if fault and fault.get("kv_override") is not None:
                kv_out = dict(kv_out or {})
                for k, v in fault["kv_override"].items():
                    # objects merge one level deep: {"dpd":{"state":..}}
                    # keeps the request's dpd.req_id
                    if isinstance(v, dict) and isinstance(kv_out.get(k),
                                                          dict):
                        kv_out[k] = dict(kv_out[k], **v)
                    else:
                        kv_out[k] = v
            if fault and fault.get("kv_remove") and kv_out:
                kv_out = dict((k, v) for k, v in kv_out.items()
                              if k not in fault["kv_remove"])
            if fault and fault.get("kv_drop"):
                kv_out = None
            if kv_out is not None:
                # what the reply carries, as its bytes (jdump is the wire)
                rec["kv_reply_raw"] = jdump(kv_out)
            self.prom_account(seqs, reasons)
            if p["stream"]:
                if disc is not None and sent >= disc:
                    self.keep = False
                    self.drop()
                if p["include_usage"]:
                    event({"id": rid, "object": "chat.completion.chunk"
                           if chat else "text_completion",
                           "created": created, "model": model,
                           "choices": [], "usage": usage_obj(True)})
                event("[DONE]")
                if chunked:
                    self.send(b"0\r\n\r\n")
                finish_rec(200, texts, reasons)
                if not chunked:
                    self.keep = False
                return
            if chat:
                choices = [{"index": i, "message": {
                    # vLLM 0.33.0 ChatMessage: "reasoning" (the old
                    # "reasoning_content" renamed), an empty tool_calls
                    # left out by its serializer
                    "role": "assistant", "content": texts[i],
                    "reasoning": None},
                    "logprobs": None, "finish_reason": reasons[i],
                    "stop_reason": stops[i]} for i in range(len(seqs))]
                resp = {"id": rid, "object": "chat.completion",
                        "created": created, "model": model,
                        "choices": choices, "usage": usage_obj("full"),
                        "prompt_logprobs": None,
                        "kv_transfer_params": kv_out}
            else:
                choices = [{"index": i, "text": texts[i], "logprobs": None,
                            "finish_reason": reasons[i],
                            "stop_reason": stops[i],
                            "prompt_logprobs": None}
                           for i in range(len(seqs))]
                resp = {"id": rid, "object": "text_completion",
                        "created": created, "model": model,
                        "choices": choices, "usage": usage_obj("full"),
                        "kv_transfer_params": kv_out}
            if fault and fault.get("pad_bytes"):
                resp["emu_padding"] = "x" * int(fault["pad_bytes"])
            out = jdump(resp).encode("utf-8")
            if malformed:
                out = out[:len(out) // 2]
            finish_rec(200, texts, reasons)
            if disc is not None:
                self.keep = False
                self.send(self._head(200, "application/json", len(out),
                                     extra=extra) + out[:disc])
                self.drop()
            self.respond(200, out, extra=extra)
        except ClientGone:
            # client gone, or a disconnect fault: status 0 = no full answer
            if any(r is None for r in reasons):
                emu.sched.abort(seqs)
                rec["aborted"] = True
                emu.counter_add("aborted_total", 1)
            if rec["status"] is None:
                rec["status"] = 0
                rec["completion_tokens"] = sum(s.out_n for s in seqs)
                rec["duration_ms"] = round(now_ms() - t_start, 3)
                rec["text"] = texts[0] if len(texts) == 1 else texts
                rec["kv"] = kvinfo
            raise

    def prom_account(self, seqs, reasons):
        emu = self.emu
        with emu.lock:
            emu.prom["prompt"] += sum(s.n_prompt for s in seqs)
            emu.prom["gen"] += sum(s.out_n for s in seqs)
            for r in reasons:
                emu.prom["success"][r] = emu.prom["success"].get(r, 0) + 1

    # -- request parsing (vLLM's validation) -------------------------------

    def parse(self, chat, body):
        emu = self.emu
        a = emu.args
        if not isinstance(body, dict):
            raise ApiError(400, "Invalid request body: expected a JSON "
                           "object")
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise ApiError(400, "stream: Input should be a valid boolean")
        so = body.get("stream_options")
        if so is not None and not stream:
            raise ApiError(400, "Stream options can only be defined when "
                           "`stream=True`.")
        if so is not None and not isinstance(so, dict):
            raise ApiError(400, "stream_options: Input should be an object")
        so = so or {}
        n = body.get("n", 1)
        if n is not None and n != 1:
            raise ApiError(400, "n must be 1 in the emulator (got %r)" % (n,))
        mt = body.get("max_completion_tokens") if chat else None
        if mt is None:
            mt = body.get("max_tokens")
        if mt is None:
            mt = a.default_max_tokens
        if not isinstance(mt, int) or isinstance(mt, bool):
            raise ApiError(400, "max_tokens: Input should be a valid "
                           "integer")
        if mt < 1:
            raise ApiError(400, "max_tokens must be at least 1, got %d."
                           % mt)
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not (isinstance(stop, list) and
                  all(isinstance(x, str) for x in stop)):
            raise ApiError(400, "stop: Input should be a string or a list "
                           "of strings")
        stop = [x for x in stop if x]
        tok = emu.tok
        if chat:
            msgs = body.get("messages")
            if msgs is None:
                raise ApiError(400, "messages: Field required")
            if not isinstance(msgs, list):
                raise ApiError(400, "messages: Input should be a valid list")
            if not msgs:
                raise ApiError(400, "messages: List should have at least 1 "
                               "item")
            for i, m in enumerate(msgs):
                if not isinstance(m, dict) or not isinstance(m.get("role"),
                                                             str):
                    raise ApiError(400, "messages[%d].role: Field required"
                                   % i)
            # the whole request: tools, chat_template_kwargs, documents, ...
            prompts = [tok.chat_ids(msgs, body)]
        else:
            pr = body.get("prompt")
            if pr is None:
                raise ApiError(400, "Either prompt or prompt_embeds must be "
                               "provided and non-empty.")
            add = body.get("add_special_tokens", True) is not False
            prompts = self.prompt_ids(pr, add)
        for ids in prompts:
            if not ids:
                raise ApiError(400, "The decoder prompt cannot be empty")
            if len(ids) + mt > a.max_model_len:
                raise ApiError(400, "This model's maximum context length is "
                               "%d tokens. However, you requested %d tokens "
                               "(%d in the messages, %d in the completion). "
                               "Please reduce the length of the messages or "
                               "completion." % (a.max_model_len,
                                                len(ids) + mt, len(ids), mt))
            if (len(ids) + 1 + a.block_size - 1) // a.block_size > \
                    a.kv_blocks:
                raise ApiError(400, "prompt of %d tokens does not fit the KV "
                               "cache (%d blocks)" % (len(ids), a.kv_blocks))
        return {"stream": stream, "prompts": prompts, "max_tokens": mt,
                "stop": stop,
                "include_usage": bool(stream and so.get("include_usage")),
                "cont_usage": bool(stream and so.get("include_usage") and
                                   so.get("continuous_usage_stats"))}

    def prompt_ids(self, pr, add):
        tok = self.emu.tok
        vocab = tok.vocab

        def ids_ok(lst):
            for x in lst:
                if not isinstance(x, int) or isinstance(x, bool):
                    raise ApiError(400, "prompt: token ids must be integers")
                if x < 0 or x >= vocab:
                    raise ApiError(400, "Token id %d is out of vocabulary"
                                   % x)
            if not lst:
                raise ApiError(400, "Prompt cannot be empty")
            return list(lst)
        if isinstance(pr, str):
            return [tok.encode(pr, add)]
        if isinstance(pr, list):
            if not pr:
                raise ApiError(400, "Prompt cannot be empty")
            if all(isinstance(x, str) for x in pr):
                return [tok.encode(x, add) for x in pr]
            if all(isinstance(x, list) for x in pr):
                return [ids_ok(x) for x in pr]
            if all(isinstance(x, int) and not isinstance(x, bool)
                   for x in pr):
                return [ids_ok(pr)]
        return self._bad_prompt()

    @staticmethod
    def _bad_prompt():
        raise ApiError(400, "prompt must be a string, array of strings, "
                       "array of tokens, or array of token arrays")

    # -- NIXL ----------------------------------------------------------------

    def nixl_pull(self, kvp, ids, own_eid, local=0):
        """Decoder: pull the prompt blocks named by kvp; returns kv info."""
        emu = self.emu
        a = emu.args
        info = {"protocol": "nixl", "side": "consumer",
                "remote_host": kvp.get("remote_host"),
                "remote_port": kvp.get("remote_port"),
                "remote_engine_id": kvp.get("remote_engine_id"),
                "remote_request_id": kvp.get("remote_request_id") or own_eid,
                "cached_tokens": 0}
        if a.role not in ("decode", "both"):
            info["outcome"] = "ignored (role %s)" % a.role
            return info
        host, port = kvp.get("remote_host"), kvp.get("remote_port")
        blocks = kvp.get("remote_block_ids")
        # vLLM NixlPullConnectorScheduler.update_state_after_alloc: no block
        # ids: nothing to pull; block ids without all of the four fields:
        # "Got invalid KVTransferParams", recompute
        if not blocks:
            info["outcome"] = "failed: no remote_block_ids"
            emu.counter_add("nixl_pull_failed_total", 1)
            return info
        missing = [k for k in NIXL_REQUIRED if k not in kvp]
        if missing:
            sys.stderr.write("vllm_emu: WARNING Got invalid KVTransferParams:"
                             " %s. This request will not utilize KVTransfer"
                             "\n" % jdump(kvp))
            info["outcome"] = "failed: invalid KVTransferParams (no %s)" % \
                ", ".join(missing)
            emu.counter_add("nixl_pull_failed_total", 1)
            emu.counter_add("nixl_invalid_params_total", 1)
            return info
        if not isinstance(host, str) or not isinstance(port, int) or \
                not isinstance(blocks, list):
            info["outcome"] = "failed: incomplete kv_transfer_params"
            emu.counter_add("nixl_pull_failed_total", 1)
            return info
        with emu.lock:
            emu.pulling += 1
        try:
            return self._nixl_pull(info, kvp, ids, host, port, blocks, local)
        finally:
            with emu.lock:
                emu.pulling -= 1

    def _nixl_pull(self, info, kvp, ids, host, port, blocks, local=0):
        emu = self.emu
        a = emu.args
        try:
            r = line_rpc(host, port, {
                "op": "pull", "request_id": info["remote_request_id"],
                "engine_id": kvp.get("remote_engine_id"),
                "block_ids": blocks}, a.kv_connect_timeout)
        except (OSError, ValueError) as e:
            info["outcome"] = "failed: %s" % e
            emu.counter_add("nixl_pull_failed_total", 1)
            return info
        if not r.get("ok"):
            info["outcome"] = "failed: %s" % r.get("error")
            emu.counter_add("nixl_pull_failed_total", 1)
            return info
        ntok = int(r.get("n_blocks", 0)) * a.block_size
        if (r.get("block_ids") != blocks or r.get("n_prompt") != len(ids) or
                r.get("token_hash") != token_hash(ids, ntok) or
                r.get("block_size") != a.block_size):
            info["outcome"] = "mismatch"
            emu.counter_add("nixl_pull_mismatch_total", 1)
            return info
        # modelled transfer time for the pulled blocks
        # vLLM's NIXL worker reads only the blocks the decoder's own prefix
        # cache does not hold (local: its hit now)
        moved = max(0, ntok - local)
        self.transfer_sleep(moved)
        info["transferred_tokens"] = moved
        emu.counter_add("nixl_transferred_tokens_total", moved)
        c = min(ntok, ((len(ids) - 1) // a.block_size) * a.block_size)
        info["outcome"] = "ok"
        info["pulled_blocks"] = int(r["n_blocks"])
        info["cached_tokens"] = c
        emu.counter_add("nixl_pull_ok_total", 1)
        return info

    def transfer_sleep(self, ntok):
        a = self.emu.args
        if a.kv_transfer_gbps > 0 and ntok > 0:
            t = ntok * a.kv_bytes_per_token / (a.kv_transfer_gbps * 1e9)
            time.sleep(t * a.time_scale)

    def nixl_hold(self, s, eid):
        emu = self.emu
        a = emu.args
        blocks = s.held_blocks or []
        if a.nixl_reply_shape == "flat":
            # vLLM before the hybrid KV cache manager: one flat list
            published = [b for b in blocks]
            kv_out = {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_block_ids": published,
                      "remote_engine_id": emu.engine_id,
                      "remote_request_id": eid,
                      "remote_host": a.side_channel_host or a.host,
                      "remote_port": a.side_channel_port, "tp_size": 1}
        else:
            # current vLLM (nixl/pull_scheduler.py request_finished): one
            # list per KV cache group; group 0 holds the prompt's blocks,
            # groups 1.. a sliding-window-like tail of one block each, ids in
            # their own range (g * --kv-blocks + id)
            published = [[b for b in blocks]] + [
                [g * a.kv_blocks + b for b in blocks[-1:]]
                for g in range(1, a.kv_cache_groups)]
            kv_out = {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_block_ids": published,
                      "remote_engine_id": emu.engine_id,
                      "remote_request_id": eid,
                      "remote_host": a.side_channel_host or a.host,
                      "remote_port": a.side_channel_port,
                      "tp_size": 1, "dcp_size": 1, "pp_size": 1,
                      "remote_num_tokens": len(s.prompt_ids),
                      # set by vLLM on a decode node only (turn-2 readback);
                      # the prefill side's lease is --kv-lease-duration
                      "remote_blocks_expiry_time": None,
                      # 0 until the engine re-registers its KV memory
                      "remote_registration_generation": 0,
                      "transfer_mode": "pull"}
        emu.kv.nixl_hold(eid, blocks, s.prompt_ids, published)
        info = {"protocol": "nixl", "side": "producer", "outcome": "held",
                "request_id": eid, "blocks": len(blocks),
                "tokens": len(blocks) * a.block_size}
        return kv_out, info

    # -- kv_agent -----------------------------------------------------------

    def kv_agent_push(self, dpd, ids):
        """Prefill: hand the prompt's full blocks to the local agent for
        dpd.decode_node.  Returns (kv_transfer_params, kv info)."""
        emu = self.emu
        req_id = dpd.get("req_id")
        node = dpd.get("decode_node")
        info = {"protocol": "kv_agent", "side": "producer",
                "req_id": req_id, "decode_node": node, "blocks": 0}
        if not isinstance(req_id, str) or not req_id or \
                not isinstance(node, str) or not node:
            info["outcome"] = "failed: dpd needs req_id and decode_node"
            state = "failed"
        elif emu.kva is None:
            info["outcome"] = "failed: no agent (--kv-agent-socket)"
            state = "failed"
        else:
            state = emu.kva.push(req_id, node, ids, info)
        emu.counter_add("kv_agent_pushed_total" if state == "pushed"
                        else "kv_agent_push_failed_total", 1)
        kv_out = {"dpd": {"req_id": req_id, "blocks": info["blocks"]
                          if state == "pushed" else 0, "state": state}}
        return kv_out, info

    def kv_agent_consume(self, dpd, prompts):
        """Decoder: reuse the KV the agent says landed for dpd.req_id."""
        emu = self.emu
        a = emu.args
        req_id = dpd.get("req_id")
        info = {"protocol": "kv_agent", "side": "consumer",
                "req_id": req_id, "cached_tokens": 0}
        if a.role not in ("decode", "both") or len(prompts) != 1:
            info["outcome"] = "ignored (%s)" % (
                "role %s" % a.role if len(prompts) == 1
                else "%d prompts" % len(prompts))
            return info
        if not isinstance(req_id, str) or not req_id:
            info["outcome"] = "failed"
            info["error"] = "dpd needs req_id"
        elif emu.kva is None:
            info["outcome"] = "no_agent"
        else:
            with emu.lock:
                emu.pulling += 1
            try:
                info["cached_tokens"] = emu.kva.consume(req_id, prompts[0],
                                                        info)
            finally:
                with emu.lock:
                    emu.pulling -= 1
        emu.counter_add("kv_agent_%s_total" % info["outcome"], 1)
        return info

    # -- LMCache ------------------------------------------------------------

    def lmc_push_later(self, spec, ids, fault, rec):
        time.sleep(self.emu.args.lmcache_push_delay_ms / 1000.0)
        info = self.lmc_push(spec, ids)
        rec["kv"] = info
        if info.get("outcome") == "pushed":
            self.lmc_notify(spec, fault, rec)

    def lmc_notify(self, spec, fault, rec):
        """ProxyNotif from each sender rank to pd_proxy_host:port."""
        emu = self.emu
        if not emu.args.lmcache_proxy:
            return
        ip = spec.get("receiver_init_port")
        ranks = len(ip) if isinstance(ip, list) else 1
        if fault and fault.get("lmc_notices") is not None:
            ranks = fault["lmc_notices"]
        dup = (fault.get("lmc_dup") or 0) if fault else 0
        msg = msgpack.packb({"type": "ProxyNotif",
                             "req_id": spec.get("req_id")})
        for rank in range(ranks):
            emu.lmc_send(rank, msg, 1 + dup)
        rec["lmc_notified"] = round(time.time(), 6)
        emu.counter_add("lmcache_notices_total", ranks * (1 + dup))

    def lmc_push(self, spec, ids):
        emu = self.emu
        a = emu.args
        info = {"protocol": "lmcache", "side": "producer"}
        try:
            host = spec["receiver_host"]
            ip = spec["receiver_init_port"]
            ap = spec["receiver_alloc_port"]
            ip = ip[0] if isinstance(ip, list) else ip
            ap = ap[0] if isinstance(ap, list) else ap
            req_id = spec.get("req_id")
            info.update(receiver="%s:%s" % (host, ap), req_id=req_id)
            keys = lmc_chunk_keys(ids, a.lmcache_chunk_size)
            r = line_rpc(host, ip, {"op": "init", "sender": "%s:%d" % (
                a.host, a.port), "req_id": req_id}, a.kv_connect_timeout)
            if not r.get("ok"):
                raise ValueError(r.get("error"))
            self.transfer_sleep(len(ids))
            r = line_rpc(host, ap, {"op": "alloc", "req_id": req_id,
                                    "chunks": [{"key": k, "n_tokens": n}
                                               for k, n in keys]},
                         a.kv_connect_timeout)
            if not r.get("ok"):
                raise ValueError(r.get("error"))
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            info["outcome"] = "push failed: %s" % e
            emu.counter_add("lmcache_push_failed_total", 1)
            return info
        info["outcome"] = "pushed"
        info["chunks"] = len(keys)
        info["tokens"] = len(ids)
        emu.counter_add("lmcache_push_ok_total", 1)
        return info


class QueueLite(object):
    """Minimal blocking queue (queue.Queue without the extras)."""

    def __init__(self):
        self.cv = threading.Condition()
        self.items = deque()

    def put(self, x):
        with self.cv:
            self.items.append(x)
            self.cv.notify()

    def get(self, timeout):
        with self.cv:
            if not self.items:
                self.cv.wait(timeout)
            return self.items.popleft() if self.items else None


# ---------------------------------------------------------------------------

class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
    pass


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="vllm_emu.py", description=__doc__.split("\n\n")[0] + " "
        "Emulates one vLLM instance (pod).",
        epilog=HELP_EPILOG, formatter_class=HelpFormatter)
    g = ap.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (127.0.0.2, 127.0.0.3... let "
                   "instances share a port)")
    g.add_argument("--port", type=int, default=8000, help="HTTP port")
    g.add_argument("--role", choices=("prefill", "decode", "both"),
                   default="both", help="prefill: NIXL producer + side "
                   "channel; decode: NIXL puller + LMCache receiver; both")
    g.add_argument("--model", default="emu-model",
                   help="served model name (any request model accepted)")
    g.add_argument("--max-model-len", type=int, default=32768,
                   help="prompt + max_tokens limit (400 beyond)")
    g.add_argument("--default-max-tokens", type=int, default=16,
                   help="max_tokens when the request gives none")
    g.add_argument("--engine-id", default=None,
                   help="NIXL engine id (default emu-HOST-PORT-random)")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="echo X-Request-Id in responses (as vLLM's flag)")
    g.add_argument("--no-prompt-tokens-details", dest="prompt_tokens_details",
                   action="store_false",
                   help="never report usage.prompt_tokens_details")
    g.add_argument("--stats-keep", type=int, default=1000,
                   help="request records kept for /emu/stats")
    g.add_argument("--exit-with-parent", type=int, default=0, metavar="PID",
                   help="exit when process PID is gone")
    g = ap.add_argument_group("tokenizer")
    g.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="tokenizer.json; counts through build/libdpdtok.so. "
                   "Without it a word-count fallback is used")
    g.add_argument("--tokenizer-config", default=None, metavar="FILE",
                   help="tokenizer_config.json (chat template detection)")
    g.add_argument("--tokenizer-lib", default=None, metavar="SO",
                   help="path of libdpdtok.so (default $DPD_BUILD or "
                   "build/ next to tools/)")
    g.add_argument("--chat-template", default="auto",
                   choices=("auto", "llama3", "llama3.1", "chatml", "none"),
                   help="chat template family (auto: from the config)")
    g = ap.add_argument_group("timing model")
    g.add_argument("--prefill-tps", type=float, default=10000.0,
                   help="prompt tokens per second of compute-bound prefill")
    g.add_argument("--decode-step-ms", type=float, default=20.0,
                   help="duration of one memory-bound decode step")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget per scheduler step (chunked prefill)")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="sequences running at once (others wait)")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every modelled time (0.01 = 100x faster)")
    g.add_argument("--kv-blocks", "--num-gpu-blocks-override", type=int,
                   default=8192, dest="kv_blocks",
                   help="KV cache capacity in blocks (gpu_cache_usage_perc; "
                   "the prefix cache lives in the free ones)")
    g.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block")
    g = ap.add_argument_group("prefix caching and KV events (see PREFIX "
                              "CACHING)")
    g.add_argument("--enable-prefix-caching",
                   action=argparse.BooleanOptionalAction, default=True,
                   help="automatic prefix caching (vLLM v1's default: on)")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="vLLM's KVEventsConfig: {\"enable_kv_cache_events\""
                   ":true, \"publisher\":\"zmq\", \"endpoint\":"
                   "\"tcp://*:5557\", \"replay_endpoint\":null, "
                   "\"buffer_steps\":10000, \"hwm\":100000, "
                   "\"max_queue_size\":100000, \"topic\":\"\"} (needs "
                   "pyzmq)")
    g.add_argument("--kv-events-form",
                   choices=("map", "typed", "array", "array0"),
                   default="map",
                   help="map: events as maps with a \"type\" key (vLLM "
                   "0.26; replay replies carry the topic frame); typed: the "
                   "same with extra_keys as tagged structs (vLLM main after "
                   "0.26); array: positional arrays with every field (vLLM "
                   "0.10-0.25; no topic frame in replay replies); array0: "
                   "vLLM 0.9's (BlockStored with five fields, batch [ts, "
                   "events])")
    g.add_argument("--data-parallel-rank", type=int, default=0,
                   help="the events' data_parallel_rank; the KV event "
                   "endpoints' ports are shifted by it, as vLLM does")
    g.add_argument("--kv-events-bind-host", default=None, metavar="HOST",
                   help="bind the KV event endpoints' wildcard (tcp://*:P) "
                   "on HOST only: one pod of several sharing a port, each "
                   "on its own address (tests of DNS sources)")
    g.add_argument("--kv-events-hash", choices=("int", "bytes"),
                   default=None,
                   help="block hashes on the wire: uint64 (the digest's "
                   "last 8 bytes) or the 32 digest bytes (default: "
                   "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, 1 = int)")
    g.add_argument("--lora-modules", nargs="+", default=None,
                   metavar="NAME=PATH",
                   help="LoRA adapters: a request whose model is NAME "
                   "uses it (its name keys every block, lora_id = its "
                   "position from 1)")
    g = ap.add_argument_group("prefill protocols")
    g.add_argument("--side-channel-host", default=None,
                   help="NIXL side channel address (default --host)")
    g.add_argument("--side-channel-port", type=int, default=None,
                   help="NIXL side channel port (default --port + 1000)")
    g.add_argument("--lmcache-init-port", type=int, default=None,
                   help="LMCache receiver init port (default --port + 2000)")
    g.add_argument("--lmcache-alloc-port", type=int, default=None,
                   help="LMCache receiver alloc port (default --port + 3000)")
    g.add_argument("--no-lmcache", action="store_true",
                   help="decode/both: do not listen on the LMCache ports")
    g.add_argument("--lmcache-chunk-size", type=int, default=256,
                   help="tokens per LMCache chunk")
    g.add_argument("--lmcache-proxy", default=None, metavar="HOST:PORT",
                   help="prefill/both: LMCache's pd_proxy_host:pd_proxy_port"
                   ", where every sender rank sends ProxyNotif (ZeroMQ "
                   "PUSH, msgpack) once the request's KV is pushed")
    g.add_argument("--lmcache-push-delay-ms", type=float, default=0,
                   help="prefill/both: push the KV (and notify) this long "
                   "after the reply, as LMCache's asynchronous sender")
    g.add_argument("--kv-hold-timeout", "--kv-lease-duration",
                   dest="kv_hold_timeout", type=float, default=120.0,
                   help="seconds (real time) held KV waits for its user "
                   "(NIXL: vLLM's kv_lease_duration, without heartbeats)")
    g.add_argument("--nixl-reply-shape", choices=("groups", "flat"),
                   default="groups",
                   help="NIXL prefill reply: current vLLM (remote_block_ids "
                   "per KV cache group, remote_num_tokens, tp/dcp/pp_size, "
                   "remote_blocks_expiry_time, transfer_mode) or the older "
                   "flat block list")
    g.add_argument("--kv-cache-groups", type=int, default=1,
                   help="KV cache groups in a groups-shaped NIXL reply")
    g.add_argument("--kv-connect-timeout", type=float, default=5.0,
                   help="seconds for a side-channel / LMCache connection")
    g.add_argument("--kv-transfer-gbps", type=float, default=0.0,
                   help="modelled transfer rate in GB/s (0: instant)")
    g.add_argument("--kv-bytes-per-token", type=int, default=131072,
                   help="KV bytes per token (Llama 3 8B: 128 KiB)")
    g = ap.add_argument_group("kv_agent protocol (see PREFILL PROTOCOLS)")
    g.add_argument("--kv-agent-socket", default=None, metavar="PATH",
                   help="local kv_agent API socket; a memfd pool of the "
                   "agent's geometry is registered at start (without it "
                   "dpd prefills answer state failed, dpd decodes "
                   "recompute)")
    g.add_argument("--kv-wait-ms", type=int, default=0,
                   help="decode: wait up to this long for the KV to land, "
                   "also for a request the agent does not know yet (0: "
                   "poll once; nginx already waited)")
    g.add_argument("--kv-push-wait-ms", type=int, default=0,
                   help="prefill: answer only once the push finished, "
                   "waiting up to this long (0: answer once the agent "
                   "accepted it)")
    g.add_argument("--kv-push-timeout", dest="kv_push_timeout_s",
                   type=float, default=60.0, metavar="S",
                   help="seconds a background waiter follows a push (or a "
                   "KV that lands late) before giving up on freeing it")
    g = ap.add_argument_group("faults (see FAULTS below)")
    g.add_argument("--fail-status", type=int, default=None, metavar="CODE",
                   help="answer CODE with an error JSON")
    g.add_argument("--delay-ms", type=int, default=0,
                   help="wait before answering (real ms)")
    g.add_argument("--hang", action="store_true",
                   help="accept, never answer")
    g.add_argument("--disconnect-after", type=int, default=None, metavar="N",
                   help="close after N SSE events / N body bytes")
    g.add_argument("--malformed-json", action="store_true",
                   help="answer broken JSON")
    g.add_argument("--fault-path", default=None,
                   help="only requests to this path")
    g.add_argument("--fault-role", choices=("prefill", "decode", "any"),
                   default=None, help="only prefill copies / other requests")
    g.add_argument("--fault-count", type=int, default=None, metavar="K",
                   help="only the next K matching requests")
    g.add_argument("-v", "--verbose", action="store_true",
                   help="log one line per HTTP request to stderr")
    a = ap.parse_args(argv)
    if a.side_channel_port is None:
        a.side_channel_port = a.port + 1000
    if a.lmcache_proxy and (zmq is None or msgpack is None):
        sys.stderr.write("vllm_emu: --lmcache-proxy needs python3-zmq and "
                         "python3-msgpack\n")
        sys.exit(2)
    if a.no_lmcache:
        a.lmcache_init_port = a.lmcache_alloc_port = None
    else:
        if a.lmcache_init_port is None:
            a.lmcache_init_port = a.port + 2000
        if a.lmcache_alloc_port is None:
            a.lmcache_alloc_port = a.port + 3000
    if a.role == "prefill":
        a.lmcache_init_port = a.lmcache_alloc_port = None
    if a.time_scale < 0 or a.prefill_tps <= 0 or a.max_num_batched_tokens < 1:
        ap.error("bad timing model values")
    if a.kv_blocks < 1 or a.block_size < 1:
        ap.error("--kv-blocks and --block-size must be at least 1")
    try:
        a.loras = parse_lora_modules(a.lora_modules)
    except ValueError as e:
        ap.error(str(e))
    if a.kv_events_hash is None:
        a.kv_events_hash = "int" if os.environ.get(
            "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").strip() not in (
                "0", "false", "False") else "bytes"
    a.kv_events = None
    if a.kv_events_config is not None:
        try:
            cfg = parse_kv_events_config(a.kv_events_config)
        except ValueError as e:
            ap.error("--kv-events-config: %s" % e)
        if cfg["enable_kv_cache_events"] and cfg["publisher"] == "zmq":
            if zmq is None:
                sys.stderr.write("vllm_emu: --kv-events-config needs pyzmq "
                                 "(pip install pyzmq, or Debian's "
                                 "python3-zmq); not found by %s\n"
                                 % sys.executable)
                sys.exit(2)
            a.kv_events = cfg
            if a.data_parallel_rank and any(
                    (cfg[k] or "").startswith("ipc://")
                    for k in ("endpoint", "replay_endpoint")):
                ap.error("--kv-events-config: an ipc:// endpoint cannot be "
                         "offset by --data-parallel-rank (vLLM: \"Invalid "
                         "endpoint\")")
    if a.data_parallel_rank < 0:
        ap.error("--data-parallel-rank must be >= 0")
    return a


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    emu = Emu(args)

    class H(Conn):
        pass
    H.emu = emu
    try:
        srv = HttpServer((args.host, args.port), H)
    except OSError as e:
        sys.exit("vllm_emu: cannot listen on %s:%d: %s"
                 % (args.host, args.port, e))
    try:
        emu.start()
    except OSError as e:
        sys.exit("vllm_emu: cannot open a protocol port on %s: %s"
                 % (args.host, e))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    if args.exit_with_parent:
        def watch(pid):
            while True:
                time.sleep(0.5)
                try:
                    os.kill(pid, 0)
                except OSError:
                    os._exit(0)
        threading.Thread(target=watch, args=(args.exit_with_parent,),
                         daemon=True).start()
    sys.stderr.write("vllm_emu: %s role=%s on %s:%d tokenizer=%s "
                     "side=%s lmcache=%s/%s engine=%s\n" % (
                         VERSION, args.role, args.host, args.port,
                         emu.tok.desc, args.side_channel_port,
                         args.lmcache_init_port, args.lmcache_alloc_port,
                         emu.engine_id))
    sys.stderr.flush()
    try:
        srv.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
