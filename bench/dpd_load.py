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
import json
import random
import sys
import threading
import time

import sse_load
from sse_load import Result, one_request, words


def make_text(rng, n_words):
    return words(rng, n_words)


def percentile(values, q):
    return sse_load.percentile(values, q, float("nan"))


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
