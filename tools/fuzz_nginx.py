#!/usr/bin/env python3
"""Black-box mutation run through a real nginx with the DPD module.

Sends a bounded (--count, --seconds), deterministic (--seed) stream of
hostile requests to a running nginx and checks what comes back:

  * every answer is 2xx/4xx/5xx; a 2xx body is JSON (an SSE stream: every
    "data:" payload is JSON or [DONE]); a 4xx/5xx body is JSON (the
    module's OpenAI-shaped error or an engine's), except nginx's own page
    for requests nginx refuses before any location (bad request line or
    headers, unknown Transfer-Encoding ...: cases marked pre_location);
  * a request that is protocol-level garbage (a lying Content-Length, a
    body cut off, a client that goes away) may get a clean close instead;
  * no request waits longer than --slow seconds for its answer;
  * no worker exits on a signal, no [alert]/[crit]/[emerg] in the error
    log (--error-log), the workers are the same processes at the end
    (--pid-file: the master's pid);
  * worker RSS stays bounded: VmRSS growth over the run <= --rss-growth-mb
    and the peak (VmHWM) over the start <= max(--peak-mb, --peak-factor x
    the largest body sent);
  * a client's top-level kv_transfer_params (a canary host) never reaches
    an engine (--engine URL..., the vLLM emulators' /emu/stats records).

Each case is generated from (seed, index) alone: `--only INDEX` replays one.
Prints one line per finding and a JSON summary as the last line; exits 1
when there is a finding.  Python 3 standard library only.

    tools/fuzz_nginx.py --port 1984 --prefix /nixl --prefix /direct \\
        --seed 1 --count 2000 --seconds 60 --error-log t/servroot/logs/error.log
"""

import argparse
import json
import os
import random
import re
import socket
import sys
import time

CANARY = "dpd-fuzz-canary.invalid"

WORDS = ("the quick brown fox jumps over the lazy dog lorem ipsum dolor "
         "sit amet café naïve 日本語 emoji 🙂 tab\t newline\n quote\" "
         "backslash\\ slash/ <tag> & % $ # @").split(" ")

PATHS = ("/v1/completions", "/v1/chat/completions")

# nginx's own error pages, sent before any location applies (the module's
# error filter cannot see them): these statuses only, for pre_location cases
CORE_STATUSES = {400, 405, 411, 413, 414, 431, 494, 501, 505}


class Case:
    def __init__(self, kind, path, body=b"", method="POST", headers=None,
                 version="HTTP/1.1"):
        self.kind = kind
        self.path = path
        self.body = body
        self.method = method
        self.version = version
        self.headers = [("Host", "localhost"),
                        ("Content-Type", "application/json")]
        if headers is not None:
            self.headers = headers
        self.raw = None            # bytes: sent as is (no framing added)
        self.framing = "cl"        # cl | none (headers say it all)
        self.may_close = False     # a clean close is a correct answer
        self.pre_location = False  # nginx core may answer with its page
        self.shutdown = False      # half-close after sending
        self.pieces = None         # [(bytes, delay)]: dripped
        self.abort_after = None    # close this many seconds after sending
        self.pipelined = None      # a second, valid request on the conn
        self.canary = False

    def request_bytes(self):
        if self.raw is not None:
            return self.raw
        return build_request(self.method, self.path, self.version,
                             self.headers, self.body, self.framing,
                             "close" if self.pipelined is None
                             else "keep-alive")


def build_request(method, path, version, headers, body, framing, conn):
    lines = ["%s %s %s" % (method, path, version)]
    names = {k.lower() for k, _ in headers}
    out = lines[0].encode() + b"\r\n"
    for k, v in headers:
        out += k.encode() + b": " + (v if isinstance(v, bytes)
                                     else v.encode("utf-8")) + b"\r\n"
    if "connection" not in names:
        out += b"Connection: " + conn.encode() + b"\r\n"
    if framing == "cl" and "content-length" not in names \
            and "transfer-encoding" not in names:
        out += b"Content-Length: %d\r\n" % len(body)
    return out + b"\r\n" + body


# --- bodies -----------------------------------------------------------------

def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def base_obj(rng, path):
    long = rng.random() < 0.5     # over the tests' dpd_threshold
    n = rng.randint(300, 700) if long else rng.randint(1, 40)
    o = {"model": "m", "max_tokens": rng.randint(1, 4)}
    if "chat" in path:
        o["messages"] = [{"role": "system", "content": text(rng, 5)},
                         {"role": "user", "content": text(rng, n)}]
    elif rng.random() < 0.2:
        o["prompt"] = [rng.randint(0, 128000) for _ in range(n)]
    else:
        o["prompt"] = text(rng, n)
    if rng.random() < 0.3:
        o["stream"] = True
    return o


def dumps(o):
    return json.dumps(o, ensure_ascii=rng_ascii[0]).encode("utf-8")


rng_ascii = [False]


def prompt_key(path):
    return "messages" if "chat" in path else "prompt"


def mutate_bytes(rng, b):
    b = bytearray(b)
    for _ in range(rng.randint(1, 8)):
        if not b:
            break
        op = rng.randrange(4)
        i = rng.randrange(len(b))
        if op == 0:
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            b.insert(i, rng.choice(b'{}[]",:\\\x00\xff0e-'))
        elif op == 2:
            del b[i]
        else:
            j = min(len(b), i + rng.randint(1, 64))
            b[i:i] = b[i:j]
    return bytes(b)


def gen_truncate(rng, path, big):
    b = dumps(base_obj(rng, path))
    return Case("truncate", path, b[:rng.randrange(len(b))])


def gen_byteflip(rng, path, big):
    return Case("byteflip", path, mutate_bytes(rng, dumps(base_obj(rng,
                                                                   path))))


def gen_dupkeys(rng, path, big):
    o = base_obj(rng, path)
    key = rng.choice(["stream", "prompt", "messages", "model", "max_tokens",
                      "kv_transfer_params", "n", "stream_options"])
    n = rng.choice([2, 3, 10, 100, 1000, 5000 if big else 2000])
    vals = [json.dumps(v) for v in (True, False, None, 1, "x", [], {},
                                    o.get("prompt", "p"),
                                    {"include_usage": True})]
    inner = dumps(o)[1:-1]
    dup = b",".join(('"%s":%s' % (key, rng.choice(vals))).encode()
                    for _ in range(n))
    if rng.random() < 0.5:
        body = b"{" + dup + b"," + inner + b"}"
    else:
        body = b"{" + inner + b"," + dup + b"}"
    return Case("dupkeys", path, body)


def canary_params(rng):
    return json.dumps({"do_remote_prefill": True, "do_remote_decode": False,
                       "remote_host": CANARY, "remote_port": 1,
                       "remote_engine_id": CANARY,
                       "remote_block_ids": [0, 1], "req_id": CANARY})


def gen_kvparams(rng, path, big):
    """Client transfer metadata, plain, duplicated, in odd spellings."""
    o = base_obj(rng, path)
    inner = dumps(o)[1:-1].decode("utf-8")
    bad = canary_params(rng)
    forms = [
        '"kv_transfer_params":%s' % bad,
        '"kv_transfer_params":{},"kv_transfer_params":%s' % bad,
        '"kv_transfer_params":null,"kv_transfer_params":%s' % bad,
        '"kv_transfer_params":%s,"kv_transfer_params":{}' % bad,
        '"kv_transfer_params":[],"kv_transfer_params":%s' % bad,
        '"kv_transfer_\\u0070arams":%s' % bad,
        ",".join(['"kv_transfer_params":{}'] * rng.randint(2, 50)
                 + ['"kv_transfer_params":%s' % bad]),
    ]
    f = rng.choice(forms)
    body = ("{%s,%s}" % (f, inner) if rng.random() < 0.5
            else "{%s,%s}" % (inner, f))
    c = Case("kvparams", path, body.encode("utf-8"))
    c.canary = True
    return c


def nest(rng, depth, leaf):
    kind = rng.random()
    if kind < 0.4:
        return "[" * depth + leaf + "]" * depth
    if kind < 0.8:
        return '{"a":' * depth + leaf + "}" * depth
    return "[" * depth            # never closed


def gen_deep(rng, path, big):
    depth = rng.choice([16, 63, 64, 65, 100, 1000, 10000,
                        200000 if big else 50000])
    o = base_obj(rng, path)
    inner = dumps(o)[1:-1].decode("utf-8")
    where = rng.randrange(3)
    deep = nest(rng, depth, rng.choice(['1', '"x"', '{}', '[]', 'null']))
    if where == 0:
        body = '{"extra":%s,%s}' % (deep, inner)
    elif where == 1:
        body = '{%s,"%s":%s}' % (inner, prompt_key(path), deep)
    else:
        body = deep
    return Case("deep", path, body.encode("utf-8"))


def gen_huge(rng, path, big):
    scale = 8 if big else 1
    which = rng.randrange(5)
    o = base_obj(rng, path)
    if which == 0:
        s = "x" * rng.randint(100000, 2000000 * scale)
        if "chat" in path:
            o["messages"] = [{"role": "user", "content": s}]
        else:
            o["prompt"] = s
    elif which == 1:
        o["prompt"] = [rng.randint(0, 128000)
                       for _ in range(rng.randint(10000, 250000 * scale))]
        path = "/v1/completions"
    elif which == 2:
        o["messages"] = [{"role": "user", "content": "hi"}] * \
            rng.randint(1000, 50000 * scale)
        path = "/v1/chat/completions"
    elif which == 3:
        for i in range(rng.randint(1000, 50000 * scale)):
            o["k%d" % i] = i
    else:
        o["prompt"] = [[1, 2, 3]] * rng.randint(1000, 100000 * scale)
        path = "/v1/completions"
    return Case("huge", path, dumps(o))


def gen_nul(rng, path, big):
    o = base_obj(rng, path)
    s = text(rng, rng.randint(1, 400))
    pos = rng.choice(["start", "mid", "end", "key", "model", "raw", "rawstr"])
    if pos in ("start", "mid", "end"):
        i = {"start": 0, "mid": len(s) // 2, "end": len(s)}[pos]
        s = s[:i] + "\u0000" + s[i:]
        if "chat" in path:
            o["messages"][-1]["content"] = s
        else:
            o["prompt"] = s
        return Case("nul", path, dumps(o))
    if pos == "key":
        o["pro\u0000mpt"] = s
        return Case("nul", path, dumps(o))
    if pos == "model":
        o["model"] = "m\u0000evil"
        return Case("nul", path, dumps(o))
    b = dumps(o)
    i = rng.randrange(len(b) + 1)
    if pos == "rawstr":               # raw NUL inside a string: bad JSON
        j = b.find(b'"', len(b) // 2)
        i = j + 1 if j >= 0 else i
    return Case("nul", path, b[:i] + b"\x00" + b[i:])


BAD_UTF8 = [b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
            b"\xe2\x82", b"\x80", b"\xf8\x88\x80\x80\x80", b"\xc3"]
BAD_ESC = ["\\ud800", "\\udc00", "\\udc00\\ud800", "\\ud800x", "\\uZZZZ",
           "\\u00", "\\", "\\x41"]


def gen_utf8(rng, path, big):
    o = base_obj(rng, path)
    key = prompt_key(path)
    marker = "@@MARK@@"
    if key == "messages":
        o["messages"][-1]["content"] = marker + text(rng, rng.randint(1, 300))
    else:
        o["prompt"] = text(rng, rng.randint(1, 300)) + marker
    b = dumps(o)
    if rng.random() < 0.5:
        bad = b"".join(rng.choice(BAD_UTF8) for _ in range(rng.randint(1, 4)))
    else:
        bad = rng.choice(BAD_ESC).encode()
    return Case("utf8", path, b.replace(marker.encode(), bad))


ODD_VALUES = ['12', 'null', '{}', '[]', '[[]]', '[1,"a"]', '[-1]',
              '[1e309]', '[4294967296]', 'true', '""', '[""]', '[[-5]]',
              '[{"a":1}]', '"x"', '1e999', '-0', '123456789012345678901234567890',
              '[1.5]', '[[1,2],"x"]']
ODD_MESSAGES = ['"x"', '[1]', '[{"role":5}]', '[{"content":{"a":1}}]',
                '[{"role":"user","content":[{"type":"text","text":5}]}]',
                '[{"role":"user","content":[{"type":"image_url",'
                '"image_url":{"url":"x"}}]}]',
                '[{"role":"user","content":[]}]', '[]', '[null]',
                '[{"role":"user"}]', '[{"role":"user","content":null}]',
                '[{"role":"user","content":"a","tool_calls":[{"a":1}]}]']


def gen_types(rng, path, big):
    o = base_obj(rng, path)
    inner = dict(o)
    field = rng.choice(["prompt_or_messages", "max_tokens", "stream",
                        "model", "n", "stream_options"])
    if field == "prompt_or_messages":
        key = prompt_key(path)
        val = rng.choice(ODD_MESSAGES if key == "messages" else ODD_VALUES)
    else:
        key = field
        val = rng.choice(ODD_VALUES + ['"yes"', '-1', '1e400'])
    inner.pop(key, None)
    body = dumps(inner)[:-1] + (',"%s":%s}' % (key, val)).encode()
    return Case("types", path, body)


def gen_lying_cl(rng, path, big):
    b = dumps(base_obj(rng, path))
    c = Case("lying_cl", path, b)
    if rng.random() < 0.5:            # shorter: the rest is garbage after
        n = rng.randrange(len(b))
    else:                             # longer: then we stop sending
        n = len(b) + rng.randint(1, 100000)
        c.shutdown = True
    c.headers.append(("Content-Length", str(n)))
    c.may_close = True
    return c


def chunk(data, rng):
    out = b""
    i = 0
    while i < len(data):
        n = rng.randint(1, max(1, len(data) // rng.randint(1, 8)))
        piece = data[i:i + n]
        out += b"%x\r\n" % len(piece) + piece + b"\r\n"
        i += n
    return out + b"0\r\n\r\n"


def gen_chunked(rng, path, big):
    b = dumps(base_obj(rng, path))
    c = Case("chunked", path)
    c.framing = "none"
    c.headers.append(("Transfer-Encoding", "chunked"))
    form = rng.randrange(9)
    good = chunk(b, rng)
    if form == 0:
        body = good
    elif form == 1:
        body = good.replace(b"\r\n", b";ext=1\r\n", 1)
    elif form == 2:
        body = good[:-2] + b"X-Trailer: 1\r\n\r\n"
    elif form == 3:
        body = b"zz\r\n" + b + b"\r\n0\r\n\r\n"
    elif form == 4:
        body = b"ffffffffffffffff\r\n" + b
        c.shutdown = True
    elif form == 5:
        body = b"%x\r\n" % (len(b) + 10) + b + b"\r\n0\r\n\r\n"
        c.shutdown = True
    elif form == 6:
        body = b"-5\r\n" + b + b"\r\n0\r\n\r\n"
    elif form == 7:
        body = good.replace(b"\r\n", b"\n")
    else:
        body = mutate_bytes(rng, good)
        c.shutdown = True
    c.body = body
    c.may_close = form != 0 and form != 1 and form != 2
    c.raw = build_request("POST", path, "HTTP/1.1", c.headers, body,
                          "none", "close")
    return c


def gen_headers(rng, path, big):
    c = Case("headers", path, dumps(base_obj(rng, path)))
    form = rng.randrange(10)
    if form == 0:
        c.headers.append(("X-Request-Id", "r" * rng.choice(
            [200, 1000, 4000, 7000, 9000, 40000])))
        c.pre_location = True
    elif form == 1:
        for i in range(rng.randint(2, 50)):
            c.headers.append(("X-Request-Id", "dup-%d" % i))
    elif form == 2:
        c.headers.append(("X-Request-Id", rng.choice(
            ['a"b', "a\\b", "%00", "a b", "", " ", "\xff\xfe".encode(
                "latin-1"), "caf\u00e9".encode("utf-8"), "{}", "$x",
             "a\tb", "../../etc/passwd", "a;b,c"])))
        c.pre_location = True
    elif form == 3:
        te = rng.choice(["gzip", "chunked, chunked", "identity", " chunked",
                         "CHUNKED", "chunked, gzip", "gzip, chunked", ""])
        c.headers.append(("Transfer-Encoding", te))
        c.pre_location = True
        c.may_close = True
    elif form == 4:
        for i in range(rng.choice([50, 100, 500, 2000])):
            c.headers.append(("X-H%d" % i, "v" * rng.randint(0, 50)))
        c.pre_location = True
    elif form == 5:
        c.headers = [h for h in c.headers if h[0] != "Content-Type"]
        if rng.random() < 0.5:
            c.headers.append(("Content-Type", rng.choice(
                ["text/plain", "multipart/form-data; boundary=x",
                 "application/json; charset=latin1", "*/*", ""])))
    elif form == 6:
        c.headers.append(("Expect", "100-continue"))
        c.pre_location = True
    elif form == 7:
        c.headers.append(("Content-Encoding", "gzip"))
    elif form == 8:
        c.headers.append(("Content-Length", "%d" % len(c.body)))
        c.headers.append(("Content-Length", "%d" % (len(c.body) + 1)))
        c.pre_location = True
        c.may_close = True
    else:
        c.headers.append(("Content-Length", "%d" % len(c.body)))
        c.headers.append(("Transfer-Encoding", "chunked"))
        c.pre_location = True
        c.may_close = True
    return c


def gen_method(rng, path, big):
    c = Case("method", path, dumps(base_obj(rng, path)))
    form = rng.randrange(6)
    if form == 0:
        c.method = rng.choice(["GET", "PUT", "DELETE", "OPTIONS", "PATCH",
                               "HEAD"])
        if rng.random() < 0.5:
            c.body = b""
    elif form == 1:
        c.version = "HTTP/1.0"
    elif form == 2:
        c.path = path + rng.choice(["/", "/x", "?a=1", "%00", "/../x",
                                    "//", ";x"])
        c.pre_location = True
    elif form == 3:
        c.path = "http://localhost" + path
    elif form == 4:
        c.raw = rng.choice([b"POST\r\n\r\n", b"\x00\x01\x02\r\n\r\n",
                            b"POST " + path.encode() + b" HTTP/9.9\r\n\r\n",
                            b"GARBAGE " * 100 + b"\r\n\r\n",
                            b"POST " + path.encode() + b"\r\n\r\n",
                            b"\r\n" * 10])
        c.pre_location = True
        c.may_close = True
    else:
        c.path = path + "?" + "a" * rng.choice([100, 5000, 20000])
        c.pre_location = True
    return c


def gen_drip(rng, path, big):
    b = dumps(base_obj(rng, path))
    c = Case("drip", path, b)
    whole = c.request_bytes()
    cuts = sorted(rng.sample(range(1, len(whole)), min(4, len(whole) - 1)))
    parts = [whole[i:j] for i, j in zip([0] + cuts, cuts + [len(whole)])]
    c.pieces = [(p, rng.choice([0, 0.01, 0.05])) for p in parts]
    return c


def gen_abort(rng, path, big):
    """The client goes away: mid-request, right after it, mid-answer."""
    o = base_obj(rng, path)
    o["prompt" if "prompt" in o else "max_tokens"] = o.get("prompt",
                                                           o["max_tokens"])
    b = dumps(o)
    c = Case("abort", path, b)
    whole = c.request_bytes()
    stage = rng.randrange(3)
    if stage == 0:
        c.raw = whole[:rng.randrange(1, len(whole))]
        c.abort_after = 0
    else:
        c.abort_after = rng.choice([0, 0.005, 0.02, 0.1])
    c.may_close = True
    return c


def gen_pipeline(rng, path, big):
    """A mutated request kept alive, then a valid one on the connection."""
    first = rng.choice([gen_valid, gen_truncate, gen_types, gen_nul,
                        gen_dupkeys, gen_utf8])(rng, path, big)
    first.kind = "pipeline/" + first.kind
    nxt = Case("pipeline-next", path, dumps(base_obj(rng, path)))
    first.pipelined = nxt
    return first


def gen_valid(rng, path, big):
    return Case("valid", path, dumps(base_obj(rng, path)))


GENERATORS = [
    (gen_valid, 6), (gen_truncate, 6), (gen_byteflip, 8), (gen_dupkeys, 6),
    (gen_kvparams, 5), (gen_deep, 5), (gen_huge, 2), (gen_nul, 6),
    (gen_utf8, 6), (gen_types, 8), (gen_lying_cl, 4), (gen_chunked, 5),
    (gen_headers, 6), (gen_method, 5), (gen_drip, 2), (gen_abort, 4),
    (gen_pipeline, 5),
]


def make_case(seed, index, prefixes, big):
    rng = random.Random("%s:%d" % (seed, index))
    rng_ascii[0] = rng.random() < 0.3
    gens = [g for g, w in GENERATORS for _ in range(w)]
    gen = rng.choice(gens)
    prefix = rng.choice(prefixes)
    path = rng.choice(PATHS)
    c = gen(rng, path, big)
    c.prefix = prefix
    c.path = prefix + c.path if c.path.startswith("/") else c.path.replace(
        "localhost/", "localhost%s/" % prefix, 1)
    if c.raw is not None and c.kind == "chunked":
        c.raw = build_request("POST", c.path, "HTTP/1.1", c.headers, c.body,
                              "none", "close")
    if c.pipelined is not None:
        c.pipelined.path = prefix + c.pipelined.path
    if c.pieces is not None:
        whole = c.request_bytes()
        n = len(c.pieces)
        step = max(1, len(whole) // n)
        c.pieces = [(whole[i * step:(i + 1) * step if i < n - 1 else None],
                     d) for i, (_, d) in enumerate(c.pieces)]
    c.index = index
    return c


# --- the wire ----------------------------------------------------------------

def exchange(host, port, case, timeout):
    """Send the case; returns (raw answer bytes, error or None, seconds).
    The seconds are those until the answer's last byte arrived (until the
    end when nothing came): after an error answer to a body nginx did not
    read, its lingering close keeps the connection open up to
    lingering_timeout more without anything being late."""
    t0 = time.monotonic()
    t_last = None
    s = socket.create_connection((host, port), timeout=timeout)
    s.settimeout(timeout)
    data = b""
    err = None
    try:
        try:
            if case.pieces is not None:
                for piece, delay in case.pieces:
                    s.sendall(piece)
                    if delay:
                        time.sleep(delay)
            else:
                req = case.request_bytes()
                if case.pipelined is not None:
                    req += case.pipelined.request_bytes()
                s.sendall(req)
            if case.shutdown or (case.may_close and case.abort_after is None
                                 and case.pipelined is None):
                s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError) as e:
            err = "send: %s" % e.__class__.__name__
        if case.abort_after is not None:
            if case.abort_after:
                time.sleep(case.abort_after)
            # RST, not FIN: the most abrupt way to go
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                         b"\x01\x00\x00\x00\x00\x00\x00\x00")
            return b"", None, time.monotonic() - t0
        while True:
            try:
                chunk_ = s.recv(65536)
            except socket.timeout:
                err = "timeout after %.1fs" % timeout
                break
            except ConnectionResetError:
                err = err or "reset"
                break
            if not chunk_:
                break
            data += chunk_
            t_last = time.monotonic()
    finally:
        s.close()
    return data, err, (t_last if t_last is not None else time.monotonic()) - t0


def dechunk(b):
    """(body, rest) of a chunked body; (None, b"") when it is cut short."""
    out = []
    i = 0
    while True:
        j = b.find(b"\r\n", i)
        if j < 0:
            return None, b""
        try:
            n = int(b[i:j].split(b";")[0], 16)
        except ValueError:
            return None, b""
        i = j + 2
        if n == 0:
            k = b.find(b"\r\n\r\n", i - 2)      # trailers, then CRLF
            return b"".join(out), (b[k + 4:] if k >= 0 else b"")
        if len(b) < i + n + 2:
            return None, b""
        out.append(b[i:i + n])
        i += n + 2


def parse_responses(raw, head):
    """[(status, headers dict, body bytes or None)], leftover garbage."""
    out = []
    while raw:
        m = re.match(rb"HTTP/1\.[01] (\d{3})[^\r\n]*\r\n", raw)
        if not m:
            return out, raw
        end = raw.find(b"\r\n\r\n")
        if end < 0:
            return out, raw
        hdrs = {}
        for line in raw[m.end():end].split(b"\r\n"):
            if b":" in line:
                k, v = line.split(b":", 1)
                hdrs[k.strip().lower().decode("latin-1")] = \
                    v.strip().decode("latin-1")
        status = int(m.group(1))
        rest = raw[end + 4:]
        if 100 <= status < 200:       # interim (100 Continue): not counted
            raw = rest
            continue
        if head or status in (204, 304) or 100 <= status < 200:
            body, raw = b"", rest
        elif hdrs.get("transfer-encoding", "").lower() == "chunked":
            body, raw = dechunk(rest)
        elif "content-length" in hdrs:
            n = int(hdrs["content-length"])
            body, raw = (rest[:n], rest[n:]) if len(rest) >= n else (None,
                                                                      b"")
        else:
            body, raw = rest, b""
        out.append((status, hdrs, body))
    return out, b""


def json_ok(body):
    try:
        json.loads(body.decode("utf-8"))
        return True
    except (ValueError, UnicodeDecodeError):
        return False


def check_answer(case, status, hdrs, body, head):
    """None when the answer is correct, else the reason."""
    if not (200 <= status < 300 or 400 <= status < 600):
        return "status %d is not 2xx/4xx/5xx" % status
    if body is None:
        # a client that half-closed is a client gone: nginx aborts the
        # answer (proxy_ignore_client_abort off), a cut body is correct
        if case.shutdown or case.may_close:
            return None
        return "status %d: body cut short" % status
    if head or status == 204:
        return None
    ctype = hdrs.get("content-type", "")
    if 200 <= status < 300 and "event-stream" in ctype:
        for line in body.split(b"\n"):
            line = line.strip()
            if line.startswith(b"data:"):
                p = line[5:].strip()
                if p != b"[DONE]" and not json_ok(p):
                    return "SSE data line is not JSON: %r" % p[:120]
        return None
    if json_ok(body):
        return None
    if (case.pre_location and status in CORE_STATUSES
            and (body == b"" or b"<center>nginx" in body)):
        return None
    return "status %d, %s body is not JSON: %r" % (status, ctype or "no",
                                                   body[:160])


# --- nginx's side ------------------------------------------------------------

def read_pid(path):
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def workers(master):
    """{pid: (VmRSS kB, VmHWM kB)} of the master's children, or of the
    process itself when nginx runs without a master."""
    found = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/status" % d) as f:
                st = f.read()
        except OSError:
            continue
        ppid = re.search(r"^PPid:\s+(\d+)", st, re.M)
        if not ppid or int(ppid.group(1)) != master:
            continue
        name = re.search(r"^Name:\s+(\S+)", st, re.M)
        if name and "nginx" not in name.group(1):
            continue
        rss = re.search(r"^VmRSS:\s+(\d+)", st, re.M)
        hwm = re.search(r"^VmHWM:\s+(\d+)", st, re.M)
        if rss and hwm:
            found[int(d)] = (int(rss.group(1)), int(hwm.group(1)))
    if not found and master:
        try:
            with open("/proc/%d/status" % master) as f:
                st = f.read()
            found[master] = (
                int(re.search(r"^VmRSS:\s+(\d+)", st, re.M).group(1)),
                int(re.search(r"^VmHWM:\s+(\d+)", st, re.M).group(1)))
        except (OSError, AttributeError):
            pass
    return found


LOG_BAD = re.compile(r"exited on signal|\[(?:alert|crit|emerg)\]")


def log_findings(path, offset):
    if not path:
        return [], offset
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    lines = [ln.decode("utf-8", "replace") for ln in data.split(b"\n")
             if LOG_BAD.search(ln.decode("utf-8", "replace"))]
    return lines, offset + len(data)


def http_get(url, timeout=10):
    m = re.match(r"http://([^/:]+):(\d+)(/.*)", url)
    host, port, path = m.group(1), int(m.group(2)), m.group(3)
    s = socket.create_connection((host, port), timeout=timeout)
    s.settimeout(timeout)
    s.sendall(("GET %s HTTP/1.0\r\nHost: x\r\n\r\n" % path).encode())
    data = b""
    while True:
        b = s.recv(1 << 20)
        if not b:
            break
        data += b
    s.close()
    return data.split(b"\r\n\r\n", 1)[1]


class Engines:
    """The emulators' request records: did a canary reach an engine?"""

    def __init__(self, urls):
        self.urls = urls
        self.since = {u: 0 for u in urls}

    def mark(self):
        for u in self.urls:
            try:
                st = json.loads(http_get(u + "/emu/stats?since=%d"
                                         % (1 << 60)))
                self.since[u] = max(0, int(st["next"]) - 1)
            except (OSError, ValueError, KeyError):
                pass

    def canaries(self):
        hits = []
        for u in self.urls:
            try:
                st = json.loads(http_get(u + "/emu/stats?since=%d"
                                         % self.since[u]))
            except (OSError, ValueError) as e:
                hits.append("%s: stats unreadable (%s)" % (u, e))
                continue
            for rec in st.get("requests", []):
                self.since[u] = max(self.since[u], rec.get("n", 0))
                body = rec.get("body")
                ktp = body.get("kv_transfer_params") \
                    if isinstance(body, dict) else None
                if ktp is not None and CANARY in json.dumps(ktp):
                    hits.append("%s %s got the client's kv_transfer_params "
                                "(%s)" % (u, rec.get("path"),
                                          json.dumps(ktp)[:200]))
        return hits


# --- the run -----------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefix", action="append", default=[],
                    help="location prefix (repeat); default: none")
    ap.add_argument("--seed", default="1")
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--start", type=int, default=0, help="first index")
    ap.add_argument("--only", type=int, action="append",
                    help="replay these case indexes only")
    ap.add_argument("--big", action="store_true",
                    help="huge cases up to ~16 MB, deeper nesting")
    ap.add_argument("--timeout", type=float, default=15)
    ap.add_argument("--slow", type=float, default=10,
                    help="an answer later than this is a finding")
    ap.add_argument("--error-log")
    ap.add_argument("--pid-file")
    ap.add_argument("--engine", action="append", default=[],
                    help="emulator base URL (repeat): canary check")
    ap.add_argument("--rss-growth-mb", type=float, default=48)
    ap.add_argument("--peak-mb", type=float, default=96)
    ap.add_argument("--peak-factor", type=float, default=8)
    ap.add_argument("--show", action="store_true",
                    help="print each case's request (with --only)")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()

    prefixes = a.prefix or [""]
    findings = []
    kinds = {}
    statuses = {}
    largest = 0

    def finding(what, case=None):
        tag = ("case %d %s %s: " % (case.index, case.kind, case.path)
               if case else "")
        findings.append(tag + what)
        print("FINDING " + tag + what, flush=True)

    master = read_pid(a.pid_file) if a.pid_file else None
    engines = Engines(a.engine)
    engines.mark()
    log_off = os.path.getsize(a.error_log) if a.error_log and \
        os.path.exists(a.error_log) else 0

    # warm up (the workers' RSS settles), then the baseline
    warm = Case("valid", prefixes[0] + "/v1/completions",
                b'{"model":"m","prompt":"hi","max_tokens":1}')
    warm.index = -1
    for _ in range(20):
        try:
            exchange(a.host, a.port, warm, a.timeout)
        except OSError as e:
            finding("nginx does not answer before the run: %s" % e)
            break
    base = workers(master) if master else {}

    indexes = a.only or range(a.start, a.start + a.count)
    t_end = time.monotonic() + a.seconds
    done = 0
    for i in indexes:
        if time.monotonic() > t_end and not a.only:
            break
        case = make_case(a.seed, i, prefixes, a.big)
        head = case.method == "HEAD"
        kinds[case.kind] = kinds.get(case.kind, 0) + 1
        largest = max(largest, len(case.body), len(case.raw or b""))
        if a.show:
            print(repr(case.request_bytes()[:2000]))
        try:
            raw, err, secs = exchange(a.host, a.port, case, a.timeout)
        except OSError as e:
            finding("connect: %s (nginx down?)" % e, case)
            time.sleep(0.5)
            continue
        done += 1
        if secs > a.slow and case.abort_after is None \
                and not (err and case.may_close):
            finding("answered after %.1fs (over --slow %.0fs)"
                    % (secs, a.slow), case)
        if case.abort_after is not None:
            if a.verbose:
                print("case %d %s %s -> aborted %.3fs" % (
                    i, case.kind, case.path, secs), file=sys.stderr,
                    flush=True)
            continue
        resps, left = parse_responses(raw, head)
        want = 1 if case.pipelined is None else 2
        for n, (status, hdrs, body) in enumerate(resps[:want]):
            statuses[status] = statuses.get(status, 0) + 1
            c = case if n == 0 else case.pipelined
            c.index = case.index
            why = check_answer(c, status, hdrs, body, head)
            if why:
                finding(("" if n == 0 else "pipelined request: ") + why, case)
        if not resps:
            if err and err.startswith("timeout") and not case.may_close:
                finding("no answer (%s)" % err, case)
            elif not case.may_close:
                finding("connection closed without an answer%s (%r)"
                        % (" (%s)" % err if err else "", raw[:120]), case)
        elif len(resps) < want and not case.may_close:
            finding("pipelined request: no answer (%s)" % (err or "closed"),
                    case)
        if case.canary:
            for hit in engines.canaries():
                finding(hit, case)
        if a.verbose:
            print("case %d %s %s -> %s %.3fs" % (
                i, case.kind, case.path,
                [r[0] for r in resps] or err or "closed", secs),
                file=sys.stderr, flush=True)
        bad, log_off = log_findings(a.error_log, log_off)
        for line in bad:
            finding("error log: " + line.strip()[:300], case)

    # the end: same workers, bounded memory
    time.sleep(0.3)
    bad, log_off = log_findings(a.error_log, log_off)
    for line in bad:
        finding("error log: " + line.strip()[:300])
    end = workers(master) if master else {}
    rss = {}
    if master:
        if set(base) != set(end):
            finding("workers changed: %s -> %s" % (sorted(base),
                                                   sorted(end)))
        for pid, (r1, h1) in end.items():
            r0 = base.get(pid, (r1, h1))[0]
            rss[pid] = {"rss_start_kb": r0, "rss_end_kb": r1, "hwm_kb": h1}
            if (r1 - r0) / 1024.0 > a.rss_growth_mb:
                finding("worker %d RSS grew %.1f MB (%d -> %d kB; bound "
                        "%.0f MB)" % (pid, (r1 - r0) / 1024.0, r0, r1,
                                      a.rss_growth_mb))
            peak = max(a.peak_mb, a.peak_factor * largest / 1048576.0)
            if (h1 - r0) / 1024.0 > peak:
                finding("worker %d peak RSS %.1f MB over its start (VmHWM "
                        "%d kB, largest body %d bytes; bound %.0f MB)"
                        % (pid, (h1 - r0) / 1024.0, h1, largest, peak))
    summary = {"seed": a.seed, "cases": done, "findings": len(findings),
               "kinds": kinds, "statuses": statuses, "largest_body": largest,
               "workers": rss}
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
