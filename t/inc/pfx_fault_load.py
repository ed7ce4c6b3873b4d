#!/usr/bin/env python3
"""Load generator of t/224-prefix-faults-load.t (Python stdlib only).

--sessions threads, each a chain of multi-turn chats through the gateway
until --stop-file exists: a session's system prompt is its own (long
sessions ~1000-1600 words of one token each, short ones ~20-60), each turn
adds a user message of 10-120 words and the answer as received; a chat
ends after --turns turns and the next one starts.  Turns alternate between
streaming and not.  Every request is recorded, one JSON line per request
in --out:

  {"sess","conv","turn","stream","t0","t1" (time.time()),"status","ok",
   "why" (why not ok),"text","up" ($upstream_addr),"cached"
   ($dpd_cached_tokens),"route","err" (the body of a non-200)}

ok means a complete, well-formed answer: 200 and, streamed, `data:` lines
of JSON chunks with one role, content deltas, a finish_reason and a final
`data: [DONE]` (a chunked body cut short raises IncompleteRead: not ok);
not streamed, a chat.completion with choices[0].message.content,
finish_reason and usage.

--check URL,URL..: after the stop, every ok answer's request is asked
again directly of a pod (not streamed; round robin, the next pod on a
connection error) and its text must be the same: the emulator's reply is
a function of the prompt alone, whichever pod, route or cache served it.
A line {"check": N, "mismatch": [...], "unchecked": K} closes --out.
"""

import argparse
import http.client
import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "bench"))
from sse_load import WORDS   # noqa: E402  (one Llama 3 token each)


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def post(host, port, body, timeout):
    """One chat completion: (status, headers dict, ok, why, text, err)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions",
                     body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        hd = {k.lower(): v for k, v in r.getheaders()}
        if r.status != 200:
            return r.status, hd, False, "status %d" % r.status, "", \
                r.read(2000).decode("utf-8", "replace")
        if body.get("stream"):
            ok, why, text = read_sse(r)
        else:
            ok, why, text = read_json(r.read())
        return 200, hd, ok, why, text, None
    except (OSError, http.client.HTTPException, ValueError) as e:
        return 0, {}, False, "%s: %s" % (type(e).__name__, e), "", None
    finally:
        conn.close()


def read_sse(r):
    parts, roles, finish, done = [], 0, None, False
    for raw in r:                      # IncompleteRead if the body is cut
        line = raw.rstrip(b"\r\n")
        if not line:
            continue
        if done:
            return False, "data after [DONE]", ""
        if not line.startswith(b"data: "):
            return False, "not an SSE data line: %r" % line[:80], ""
        payload = line[6:]
        if payload == b"[DONE]":
            done = True
            continue
        ev = json.loads(payload)
        if ev.get("object") != "chat.completion.chunk":
            return False, "not a chunk: %r" % payload[:120], ""
        for c in ev.get("choices") or []:
            d = c.get("delta") or {}
            if d.get("role"):
                roles += 1
            if d.get("content"):
                parts.append(d["content"])
            if c.get("finish_reason"):
                finish = c["finish_reason"]
    if not done:
        return False, "no [DONE]", ""
    if roles != 1 or finish is None:
        return False, "roles %d, finish_reason %r" % (roles, finish), ""
    return True, None, "".join(parts)


def read_json(data):
    o = json.loads(data)
    try:
        c = o["choices"][0]
        text = c["message"]["content"]
        if o["object"] != "chat.completion" or not c["finish_reason"] \
                or not isinstance(text, str) \
                or o["usage"]["completion_tokens"] < 1:
            raise KeyError("shape")
    except (KeyError, IndexError, TypeError):
        return False, "not a chat.completion: %r" % data[:200], ""
    return True, None, text


class Session(threading.Thread):
    def __init__(self, a, idx, out, lock, bodies):
        threading.Thread.__init__(self, daemon=True)
        self.a, self.idx, self.out, self.lock = a, idx, out, lock
        self.bodies = bodies
        self.rng = random.Random(a.seed * 1000 + idx)

    def run(self):
        a, rng = self.a, self.rng
        long_ = self.idx % 2 == 0
        conv = 0
        while not os.path.exists(a.stop_file):
            conv += 1
            n = rng.randint(1000, 1600) if long_ else rng.randint(20, 60)
            msgs = [{"role": "system", "content": "session %d chat %d: %s"
                     % (self.idx, conv, words(rng, n))}]
            for turn in range(1, a.turns + 1):
                if os.path.exists(a.stop_file):
                    break
                msgs.append({"role": "user",
                             "content": words(rng, rng.randint(10, 120))})
                stream = (turn + self.idx) % 2 == 0
                body = {"model": a.model, "messages": msgs,
                        "max_tokens": a.max_tokens, "stream": stream}
                t0 = time.time()
                st, hd, ok, why, text, err = post(a.host, a.port, body,
                                                  a.timeout)
                rec = {"sess": self.idx, "conv": conv, "turn": turn,
                       "stream": stream, "t0": t0, "t1": time.time(),
                       "status": st, "ok": ok, "why": why, "text": text,
                       "up": hd.get("x-up"), "cached": hd.get("x-cached"),
                       "route": hd.get("x-route"), "err": err}
                with self.lock:
                    if ok:
                        rec["n"] = len(self.bodies)
                        self.bodies.append((dict(body, stream=False), text))
                    self.out.write(json.dumps(rec) + "\n")
                    self.out.flush()
                if not ok:
                    break              # a new chat: this one is broken
                msgs = msgs + [{"role": "assistant", "content": text}]
                time.sleep(rng.uniform(0.02, 0.12))


def check(a, bodies, out):
    pods = [p.rsplit(":", 1) for p in a.check.split(",")]
    lock = threading.Lock()
    pending = list(enumerate(bodies))
    bad, unchecked = [], [0]

    def worker(w):
        while True:
            with lock:
                if not pending:
                    return
                n, (body, text) = pending.pop()
            for k in range(len(pods) * 2):
                h, p = pods[(n + k) % len(pods)]
                st, _, ok, why, ref, _ = post(h, int(p), body, a.timeout)
                if st == 200 or st >= 400:
                    break
                time.sleep(0.2)
            with lock:
                if not ok:
                    unchecked[0] += 1
                elif ref != text:
                    bad.append({"n": n, "got": text, "want": ref})

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out.write(json.dumps({"check": len(bodies), "mismatch": bad[:20],
                          "mismatches": len(bad),
                          "unchecked": unchecked[0]}) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="m")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--seed", type=int, default=224)
    ap.add_argument("--stop-file", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--check", default=None)
    a = ap.parse_args()
    lock = threading.Lock()
    bodies = []
    with open(a.out, "w") as out:
        ss = [Session(a, i, out, lock, bodies) for i in range(a.sessions)]
        for s in ss:
            s.start()
        for s in ss:
            s.join()
        if a.check:
            check(a, bodies, out)
        out.write(json.dumps({"end": True}) + "\n")


if __name__ == "__main__":
    main()
