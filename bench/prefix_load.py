#!/usr/bin/env python3
"""Load driver of bench/prefix_cache.sh (Python stdlib only).

Three request classes through one OpenAI-compatible endpoint, streamed:

  turn   multi-turn chats: --sessions conversations of --turns turns each,
         --open-sessions of them open at once, their turns interleaved,
         at most --concurrency turns in flight; a conversation's prompt
         grows from about --first-tokens to --last-tokens (its history: a
         shared system prompt, every user message and every answer as the
         client received it), one turn after the previous answer plus
         --think-ms
  rag    shared-prefix RAG: --rag-docs documents of --rag-doc-tokens
         tokens, --rag-questions distinct short questions spread over them
         (the document first, the question after it), --rag-concurrency
         in flight
  short  short chats (--short-words words, --short-max-tokens tokens) at
         Poisson arrivals of --short-rate per second while the others run:
         their inter-token gaps (ITL) show what the rest costs a decoder

The workload (texts, sizes, order) depends only on --seed, so every mode of
one run gets the same requests.  Sizes are in words of a vocabulary whose
words are one Llama 3 token each (with the leading space), so words ~
tokens; the real counts are the engine's usage.prompt_tokens.

Per request it records TTFT, inter-token gaps, the engine's prompt_tokens
and prompt_tokens_details.cached_tokens, and the gateway's headers
X-DPD-Route ($dpd_route), X-DPD-Cached ($dpd_cached_tokens) and
X-DPD-Decoder ($upstream_addr).  Prints one line per class and one JSON
line ("JSON {...}") with everything.

    prefix_load.py --url http://127.0.0.1:8080 --label approximate
"""

import argparse
import heapq
import itertools
import json
import queue
import random
import sys
import threading
import time

from sse_load import Result, one_request, percentile, words


def body(messages, max_tokens, model):
    return {"model": model, "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": max_tokens, "temperature": 0,
            "messages": messages}


class Run:
    def __init__(self, a):
        self.a = a
        self.results = []
        self.lock = threading.Lock()
        self.done = threading.Event()

    def add(self, res):
        with self.lock:
            self.results.append(res)

    # multi-turn sessions --------------------------------------------------
    #
    # --open-sessions conversations are open at once (users who read an
    # answer for --think-ms before they ask again); --concurrency workers
    # serve their turns in the order the turns become ready, so the turns
    # of the open conversations interleave as a pool's users' do.  When a
    # conversation ends the next one opens.  --open-sessions equal to
    # --concurrency: each worker walks one conversation through its turns.

    class Chat:
        __slots__ = ("sid", "rng", "msgs", "have", "turn")

    def open_chat(self, sid):
        a = self.a
        c = Run.Chat()
        c.sid = sid
        c.rng = random.Random("%d-session-%d" % (a.seed, sid))
        c.msgs = [{"role": "system", "content": self.system}]
        c.have = a.system_tokens + 8        # template overhead, about
        c.turn = 0
        return c

    def chat_turn(self, c):
        """One turn of conversation c; False when it cannot go on."""
        a = self.a
        t = c.turn
        if a.turns > 1:
            target = a.first_tokens + (a.last_tokens - a.first_tokens) \
                * t // (a.turns - 1)
        else:
            target = a.first_tokens
        n = max(16, target - c.have - 8)
        c.msgs.append({"role": "user",
                       "content": "Session %d turn %d. %s" %
                       (c.sid, t + 1, words(c.rng, n))})
        res = Result("turn", c.sid, t + 1)
        self.add(res)
        one_request(a.url, body(c.msgs, a.turn_max_tokens, a.model), res,
                    a.timeout)
        if res.error:
            return False
        c.msgs.append({"role": "assistant", "content": res.text})
        c.have = (res.prompt_tokens or target) + \
            (res.completion_tokens or a.turn_max_tokens) + 8
        c.turn += 1
        return c.turn < a.turns

    def session_worker(self):
        """Take the open conversation whose next turn is ready first."""
        a = self.a
        while True:
            with self.cv:
                while True:
                    if not self.ready and not self.pending and \
                            self.busy == 0:
                        self.cv.notify_all()
                        return
                    if self.ready:
                        due, _, c = self.ready[0]
                        wait = due - time.monotonic()
                        if wait <= 0:
                            heapq.heappop(self.ready)
                            self.busy += 1
                            break
                        self.cv.wait(wait)
                    else:
                        self.cv.wait()
            more = self.chat_turn(c)
            with self.cv:
                self.busy -= 1
                now = time.monotonic()
                if more:
                    heapq.heappush(self.ready, (now + a.think_ms / 1000.0,
                                                next(self.order), c))
                elif self.pending:
                    heapq.heappush(self.ready,
                                   (now, next(self.order),
                                    self.open_chat(self.pending.pop(0))))
                self.cv.notify_all()

    # shared-prefix RAG ----------------------------------------------------

    def rag_worker(self, q):
        a = self.a
        while True:
            try:
                i, doc, question = q.get_nowait()
            except queue.Empty:
                return
            msgs = [{"role": "system", "content": self.system},
                    {"role": "user", "content":
                     "Document %d:\n%s\n\nQuestion %d: %s?" %
                     (doc, self.docs[doc], i, question)}]
            res = Result("rag", doc, i)
            self.add(res)
            one_request(a.url, body(msgs, a.rag_max_tokens, a.model), res,
                        a.timeout)
            if a.think_ms > 0:
                time.sleep(a.think_ms / 1000.0)

    # short requests -------------------------------------------------------

    def shorts(self):
        a = self.a
        rng = random.Random("%d-short" % a.seed)
        threads = []
        i = 0
        while not self.done.is_set():
            if self.done.wait(rng.expovariate(a.short_rate)):
                break
            i += 1
            msgs = [{"role": "user", "content": "Short %d: %s?" %
                     (i, words(rng, a.short_words))}]
            res = Result("short", None, i)
            self.add(res)
            th = threading.Thread(target=one_request, daemon=True,
                                  args=(a.url, body(msgs, a.short_max_tokens,
                                                    a.model),
                                        res, a.timeout))
            th.start()
            threads.append(th)
        for th in threads:
            th.join(a.timeout)

    def run(self):
        a = self.a
        rng = random.Random("%d-shared" % a.seed)
        self.system = ("You are a helpful assistant. " +
                       words(rng, max(1, a.system_tokens - 8)))
        self.docs = [words(rng, a.rag_doc_tokens) for _ in range(a.rag_docs)]
        rq = queue.Queue()
        for i in range(a.rag_questions if a.rag_docs else 0):
            rq.put((i, i % a.rag_docs, words(rng, a.rag_question_words)))
        opened = min(a.open_sessions or a.sessions, a.sessions)
        self.cv = threading.Condition()
        self.order = itertools.count()
        self.busy = 0
        self.pending = list(range(opened, a.sessions))
        self.ready = [(0.0, next(self.order), self.open_chat(s))
                      for s in range(opened)]
        heapq.heapify(self.ready)

        t0 = time.monotonic()
        workers = []
        for _ in range(min(a.concurrency, a.sessions)):
            workers.append(threading.Thread(target=self.session_worker,
                                            daemon=True))
        for _ in range(min(a.rag_concurrency, rq.qsize())):
            workers.append(threading.Thread(target=self.rag_worker,
                                            args=(rq,), daemon=True))
        short = None
        if a.short_rate > 0:
            short = threading.Thread(target=self.shorts, daemon=True)
            short.start()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        self.done.set()
        if short:
            short.join()
        return time.monotonic() - t0


def summarize(results, cls_list):
    ok = [r for r in results if r.cls in cls_list and r.error is None
          and r.ttft is not None]
    allr = [r for r in results if r.cls in cls_list]
    ttft = [r.ttft * 1000 for r in ok]
    gaps = [g * 1000 for r in ok for g in r.gaps]
    routes = {}
    decoders = {}
    for r in ok:
        routes[r.route or "-"] = routes.get(r.route or "-", 0) + 1
        decoders[r.decoder or "-"] = decoders.get(r.decoder or "-", 0) + 1
    gw = [int(r.gw_cached) for r in ok
          if r.gw_cached and r.gw_cached.isdigit()]
    # a direct route the index got wrong: the decoder held less than the
    # gateway counted on (it prefilled the difference beside its streams)
    stale = [int(r.gw_cached) - (r.cached_tokens or 0) for r in ok
             if r.route == "direct" and r.gw_cached
             and r.gw_cached.isdigit()
             and int(r.gw_cached) - (r.cached_tokens or 0) >= 16]
    return {
        "direct_stale": len(stale),
        "direct_stale_tokens": sum(stale),
        "n": len(allr), "ok": len(ok),
        "errors": [r.error for r in allr if r not in ok][:3],
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "engine_cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "gateway_cached_tokens": sum(gw) if gw else None,
        "routes": routes, "decoders": decoders,
        "ttft_ms_p50": percentile(ttft, 0.5),
        "ttft_ms_p99": percentile(ttft, 0.99),
        "ttft_ms_mean": (sum(ttft) / len(ttft)) if ttft else None,
        "itl_ms_p50": percentile(gaps, 0.5),
        "itl_ms_p99": percentile(gaps, 0.99),
    }


def fmt(v, spec="%.1f"):
    return "-" if v is None else spec % v


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--label", default="run")
    ap.add_argument("--model", default="emu-model")
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--system-tokens", type=int, default=256,
                    help="shared system prompt of every chat and RAG request")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--first-tokens", type=int, default=2048)
    ap.add_argument("--last-tokens", type=int, default=30720)
    ap.add_argument("--concurrency", type=int, default=16,
                    help="chat turns in flight at once")
    ap.add_argument("--open-sessions", type=int, default=0,
                    help="conversations open at once (their turns "
                    "interleave); 0: all --sessions")
    ap.add_argument("--think-ms", type=float, default=500.0,
                    help="pause between a conversation's turns")
    ap.add_argument("--turn-max-tokens", type=int, default=64)
    ap.add_argument("--rag-docs", type=int, default=4)
    ap.add_argument("--rag-doc-tokens", type=int, default=8192)
    ap.add_argument("--rag-questions", type=int, default=64)
    ap.add_argument("--rag-question-words", type=int, default=24)
    ap.add_argument("--rag-concurrency", type=int, default=4)
    ap.add_argument("--rag-max-tokens", type=int, default=64)
    ap.add_argument("--short-rate", type=float, default=2.0,
                    help="short requests per second (Poisson), 0: none")
    ap.add_argument("--short-words", type=int, default=60)
    ap.add_argument("--short-max-tokens", type=int, default=64)
    a = ap.parse_args()

    run = Run(a)
    wall = run.run()
    summary = {"label": a.label, "wall_s": wall}
    for name, classes in (("turn", ("turn",)), ("rag", ("rag",)),
                          ("long", ("turn", "rag")), ("short", ("short",))):
        summary[name] = summarize(run.results, classes)
    for name in ("turn", "rag", "short"):
        s = summary[name]
        print("%-12s %-5s n=%-4d ok=%-4d prompt %8d cached %8d  TTFT p50 "
              "%7s p99 %7s mean %7s ms | ITL p50 %6s p99 %6s ms | %s"
              % (a.label, name, s["n"], s["ok"], s["prompt_tokens"],
                 s["engine_cached_tokens"], fmt(s["ttft_ms_p50"], "%.0f"),
                 fmt(s["ttft_ms_p99"], "%.0f"), fmt(s["ttft_ms_mean"], "%.0f"),
                 fmt(s["itl_ms_p50"]), fmt(s["itl_ms_p99"]),
                 " ".join("%s=%d" % kv for kv in sorted(s["routes"].items()))))
        if s["direct_stale"]:
            print("%-12s %-5s %d direct routes found less cached than the "
                  "index said (%d tokens prefilled on the decoder)"
                  % (a.label, name, s["direct_stale"],
                     s["direct_stale_tokens"]))
        for e in s["errors"]:
            print("%-12s %-5s error: %s" % (a.label, name, e))
    print("JSON " + json.dumps(summary))
    bad = sum(summary[c]["n"] - summary[c]["ok"]
              for c in ("turn", "rag", "short"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
