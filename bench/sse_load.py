"""What the load drivers of the benchmarks share (Python stdlib only):
the word list, percentiles, and one streamed chat request measured
(bench/dpd_load.py, bench/prefix_load.py)."""

import http.client
import json
import time
import urllib.parse

# common English words, each one token of the Llama 3 vocabulary with its
# leading space (so words ~ tokens)
WORDS = ("the of and to in is that for it as was with be by on not he this "
         "are or his from at which but have an they you were their one all "
         "we can her has there been if more when will would who so no model "
         "token cache prefill decode engine latency request stream network "
         "memory transfer block layer attention batch queue gateway pod node "
         "river mountain history science music garden window silver orange "
         "quickly slowly bright quiet ancient modern simple complex").split()


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


def percentile(values, q, empty=None):
    if not values:
        return empty
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class Result:
    """One request: what the client saw and the gateway's headers
    (X-DPD-Route: $dpd_route, X-DPD-Cached: $dpd_cached_tokens,
    X-DPD-Decoder: $upstream_addr)."""

    __slots__ = ("cls", "session", "turn", "ttft", "gaps", "status", "error",
                 "prompt_tokens", "cached_tokens", "completion_tokens",
                 "tokens", "text", "route", "gw_cached", "decoder",
                 "t_start")

    def __init__(self, cls, session=None, turn=None):
        self.cls = cls
        self.session = session
        self.turn = turn
        self.ttft = None
        self.gaps = []
        self.status = None
        self.error = None
        self.prompt_tokens = None
        self.cached_tokens = None
        self.completion_tokens = None
        self.tokens = 0
        self.text = ""
        self.route = None
        self.gw_cached = None
        self.decoder = None
        self.t_start = None


def one_request(url, body, res, timeout):
    """POST a streamed chat completion; fill res: TTFT and the gaps
    between content chunks, usage, the answer's text; res.error when the
    status is not 200, the stream carries no content, or it breaks."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80,
                                      timeout=timeout)
    data = json.dumps(body).encode()
    t0 = time.monotonic()
    res.t_start = t0
    parts = []
    try:
        conn.request("POST", "/v1/chat/completions", body=data,
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        res.status = r.status
        res.route = r.getheader("X-DPD-Route")
        res.gw_cached = r.getheader("X-DPD-Cached")
        res.decoder = r.getheader("X-DPD-Decoder")
        if r.status != 200:
            res.error = "%d %s" % (r.status,
                                   r.read(300).decode("utf-8", "replace"))
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
                us = ev["usage"]
                res.prompt_tokens = us.get("prompt_tokens")
                res.completion_tokens = us.get("completion_tokens")
                det = us.get("prompt_tokens_details") or {}
                res.cached_tokens = det.get("cached_tokens")
            choices = ev.get("choices") or []
            if not choices:
                continue
            content = (choices[0].get("delta") or {}).get("content")
            if not content:
                continue
            parts.append(content)
            res.tokens += 1
            if last is None:
                res.ttft = now - t0
            else:
                res.gaps.append(now - last)
            last = now
        if res.ttft is None:
            res.error = "no content"
    except Exception as e:  # noqa: BLE001 - reported per request
        res.error = repr(e)
    finally:
        conn.close()
        res.text = "".join(parts)
