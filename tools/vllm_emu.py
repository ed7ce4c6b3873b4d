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
from collections import deque
try:                               # LMCache's notify port (--lmcache-proxy)
    import msgpack
    import zmq
except ImportError:                # only that option needs them
    msgpack = zmq = None
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
  generation never emits EOS: finish_reason is "length" or "stop" (stop=);
  no automatic prefix caching (vLLM V1 has it on by default), so
  cached_tokens counts only KV that came from a prefill instance.

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
  POST /emu/reset            forget request records and zero counters
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
                 "t_first", "first_tok")

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
        self.free_ids = deque(range(a.kv_blocks))
        self.overcommit = 0
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
        return self.total_blocks - len(self.free_ids) + self.overcommit

    def alloc(self, n):
        out = []
        for _ in range(n):
            if self.free_ids:
                out.append(self.free_ids.popleft())
            else:
                self.overcommit += 1
                out.append(-1)
        return out

    def free(self, ids):
        for b in ids:
            if b < 0:
                self.overcommit -= 1
            else:
                self.free_ids.append(b)

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
                    self.cv.wait()
                    self._reap()
                    deadline = time.monotonic()
                decodes = [s for s in self.running if s.computed >= s.n_prompt]
                budget = self.mnbt - len(decodes)
                chunks = []
                for s in self.running:
                    if s.computed < s.n_prompt and budget > 0:
                        c = min(s.n_prompt - s.computed, budget)
                        chunks.append((s, c))
                        budget -= c
                while (self.waiting and budget > 0
                       and len(self.running) < self.max_seqs):
                    s = self.waiting[0]
                    need = (s.n_prompt + 1 + bs - 1) // bs
                    if need > len(self.free_ids) and self.running:
                        break  # wait for KV space
                    self.waiting.popleft()
                    s.blocks = self.alloc(need)
                    self.running.append(s)
                    c = min(s.n_prompt - s.computed, budget)
                    if c > 0:
                        chunks.append((s, c))
                        budget -= c
                    elif s.computed >= s.n_prompt:
                        # everything cached: one-token recompute this step
                        chunks.append((s, 0))
                ptoks = sum(c for _, c in chunks)
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
                   "kv_agent": self.kva.snapshot() if self.kva else None},
            "faults": self.faults.get(),
            "requests": recs, "next": nxt}

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
            kvinfo = self.nixl_pull(kvp, prompts[0], eids[0])
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
            c = sum(cached)
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

    def nixl_pull(self, kvp, ids, own_eid):
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
            return self._nixl_pull(info, kvp, ids, host, port, blocks)
        finally:
            with emu.lock:
                emu.pulling -= 1

    def _nixl_pull(self, info, kvp, ids, host, port, blocks):
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
        self.transfer_sleep(ntok)
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
    g.add_argument("--kv-blocks", type=int, default=8192,
                   help="KV cache capacity in blocks (gpu_cache_usage_perc)")
    g.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block")
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
    if a.lmcache_proxy and zmq is None:
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
