#!/usr/bin/env python3
"""Open-loop load generator for the DPD benchmarks (Python stdlib only).

Sends a mixed workload of streaming chat requests to an OpenAI-compatible
endpoint with Poisson arrivals: short chats and long documents (to
summarize).  For every request it records the time to the first content
token (TTFT) and the gaps between content tokens (inter-token latency),
then prints p50/p99 per class, and one JSON line with everything.

    dpd_load.py --url http://127.0.0.1:8080 --duration 30 --rate 4 \
                --long-frac 0.2 --long-words 6000 --label dpd
"""

import argparse
import http.client
import json
import random
import sys
import threading
import time
import urllib.parse

WORDS = ("the of and to in is that for it as was with be by on not he this "
         "are or his from at which but have an they you were their one all "
         "we can her has there been if more when will would who so no model "
         "token cache prefill decode engine latency request stream network "
         "memory transfer block layer attention batch queue gateway pod node "
         "river mountain history science music garden window silver orange "
         "quickly slowly bright quiet ancient modern simple complex").split()


def make_text(rng, n_words):
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def percentile(values, q):
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class Result:
    __slots__ = ("cls", "ttft", "gaps", "status", "error", "prompt_tokens",
                 "cached_tokens", "tokens", "route")

    def __init__(self, cls):
        self.cls = cls
        self.ttft = None
        self.gaps = []
        self.status = None
        self.error = None
        self.prompt_tokens = None
        self.cached_tokens = None
        self.tokens = 0
        self.route = None


def one_request(url, body, res, timeout):
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80,
                                      timeout=timeout)
    data = json.dumps(body).encode()
    t0 = time.monotonic()
    try:
        conn.request("POST", "/v1/chat/completions", body=data,
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        res.status = r.status
        res.route = r.getheader("X-DPD-Route")
        if r.status != 200:
            res.error = r.read(300).decode("utf-8", "replace")
            return
        last = None
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                break
            now = time.monotonic()
            ev = json.loads(payload)
            if ev.get("usage"):
                u_ = ev["usage"]
                res.prompt_tokens = u_.get("prompt_tokens")
                det = u_.get("prompt_tokens_details") or {}
                res.cached_tokens = det.get("cached_tokens")
            choices = ev.get("choices") or []
            if not choices:
                continue
            delta = choices[0].get("delta") or {}
            if not delta.get("content"):
                continue
            res.tokens += 1
            if last is None:
                res.ttft = now - t0
            else:
                res.gaps.append(now - last)
            last = now
    except Exception as e:  # noqa: BLE001 - reported per request
        res.error = repr(e)
    finally:
        conn.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--duration", type=float, default=30.0,
                    help="seconds of arrivals")
    ap.add_argument("--rate", type=float, default=4.0,
                    help="mean arrivals per second (Poisson)")
    ap.add_argument("--long-frac", type=float, default=0.2)
    ap.add_argument("--short-words", type=int, default=60)
    ap.add_argument("--long-words", type=int, default=6000,
                    help="words of a long document (~1.3 tokens each)")
    ap.add_argument("--short-max-tokens", type=int, default=64)
    ap.add_argument("--long-max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--label", default="run")
    a = ap.parse_args()

    rng = random.Random(a.seed)
    plan = []
    t = 0.0
    while True:
        t += rng.expovariate(a.rate)
        if t >= a.duration:
            break
        cls = "long" if rng.random() < a.long_frac else "short"
        words = a.long_words if cls == "long" else a.short_words
        text = make_text(rng, words)
        if cls == "long":
            content = "Summarize this document.\n\n" + text
        else:
            content = text + "?"
        body = {"model": "m", "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": (a.long_max_tokens if cls == "long"
                               else a.short_max_tokens),
                "messages": [{"role": "user", "content": content}]}
        plan.append((t, cls, body))

    results = []
    threads = []
    start = time.monotonic()
    for at, cls, body in plan:
        delay = start + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        res = Result(cls)
        results.append(res)
        th = threading.Thread(target=one_request,
                              args=(a.url, body, res, a.timeout), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(a.timeout)

    summary = {"label": a.label, "requests": len(results)}
    lines = []
    for cls in ("short", "long"):
        rs = [r for r in results if r.cls == cls]
        ok = [r for r in rs if r.status == 200 and r.ttft is not None]
        ttft = [r.ttft * 1000 for r in ok]
        gaps = [g * 1000 for r in ok for g in r.gaps]
        pt = [r.prompt_tokens for r in ok if r.prompt_tokens]
        cached = [r.cached_tokens or 0 for r in ok]
        routes = {}
        for r in ok:
            routes[r.route or "-"] = routes.get(r.route or "-", 0) + 1
        s = {"n": len(rs), "ok": len(ok),
             "errors": [r.error or r.status for r in rs if r not in ok][:3],
             "prompt_tokens_mean": (sum(pt) / len(pt)) if pt else None,
             "cached_tokens_mean": (sum(cached) / len(cached)) if cached
             else None,
             "routes": routes,
             "ttft_ms_p50": percentile(ttft, 0.5),
             "ttft_ms_p99": percentile(ttft, 0.99),
             "itl_ms_p50": percentile(gaps, 0.5),
             "itl_ms_p99": percentile(gaps, 0.99)}
        summary[cls] = s
        lines.append("%-10s %-5s n=%-4d ok=%-4d prompt~%-6s TTFT p50 %8.1f ms"
                     "  p99 %8.1f ms | ITL p50 %7.1f ms  p99 %7.1f ms"
                     % (a.label, cls, s["n"], s["ok"],
                        "%.0f" % s["prompt_tokens_mean"]
                        if s["prompt_tokens_mean"] else "-",
                        s["ttft_ms_p50"], s["ttft_ms_p99"],
                        s["itl_ms_p50"], s["itl_ms_p99"]))
    for ln in lines:
        print(ln)
    print("JSON " + json.dumps(summary))
    bad = sum(summary[c]["n"] - summary[c]["ok"] for c in ("short", "long"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
