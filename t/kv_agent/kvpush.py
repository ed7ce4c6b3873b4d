#!/usr/bin/env python3
"""Test driver: hand real memfd pools to running agents, push KV blocks from
one prefill agent to one or more decode agents, and check every byte.

  kvpush.py --prefill SOCK --decode NAME=SOCK [--decode NAME=SOCK ...]
            [--nblocks 512] [--dst reserve|auto|explicit] [--shuffle]
            [--req PREFIX] [--timeout-ms 20000] [--no-register]

Prints one JSON object: {"results": [{decode, push_state, recv_state,
mismatched_slices, sum_src, sum_dst, bytes, ms}, ...]}.  Pools are filled
with random bytes, so equal bytes cannot be a coincidence.
"""

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "kv_agent", "python"))
from kv_agent_client import Client, HostPool, KvAgentError  # noqa: E402


def layout(info):
    p = info["pool"]
    return p


def off(p, lr, block):
    layer, region = divmod(lr, p["regions"])
    return (layer * p["layer_stride"] + region * p["region_stride"]
            + block * p["block_stride"])


def wait_connected(client, peers, deadline):
    while time.time() < deadline:
        info = client.info()
        up = {x["id"] for x in info["peers"] if x["connected"]}
        if all(p in up for p in peers):
            return True
        time.sleep(0.05)
    return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", action="append", required=True)
    ap.add_argument("--nblocks", type=int, default=512)
    ap.add_argument("--dst", default="auto",
                    choices=["auto", "reserve", "explicit"])
    ap.add_argument("--shuffle", action="store_true")
    ap.add_argument("--req", default="req")
    ap.add_argument("--timeout-ms", type=int, default=20000)
    ap.add_argument("--no-register", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", action="store_true",
                    help="do not release the requests at the end")
    a = ap.parse_args()
    rnd = random.Random(a.seed)

    pre = Client(a.prefill)
    decs = []
    for spec in a.decode:
        name, sock = spec.split("=", 1)
        decs.append((name, Client(sock)))
    pinfo = pre.info()["pool"]

    pools = []
    if not a.no_register:
        ppool = HostPool(pinfo["size"], "prefill")
        chunk = 1 << 22
        for o in range(0, pinfo["size"], chunk):
            n = min(chunk, pinfo["size"] - o)
            ppool.map[o:o + n] = os.urandom(n)
        pre.register_pool(ppool)
        pools.append(ppool)
        dpools = {}
        for name, c in decs:
            dp = HostPool(c.info()["pool"]["size"], name)
            c.register_pool(dp)
            dpools[name] = dp
            pools.append(dp)
    deadline = time.time() + 15
    if not wait_connected(pre, [n for n, _ in decs], deadline):
        print(json.dumps({"error": "prefill never connected to decoders"}))
        return 1

    plan = []
    for k, (name, c) in enumerate(decs):
        dinfo = c.info()["pool"]
        req = "%s-%s-%d" % (a.req, name, os.getpid())
        src = [(k * 8 + i) % pinfo["blocks"] for i in range(a.nblocks)]
        dst = None
        if a.dst == "reserve":
            dst = c.reserve(req, nblocks=a.nblocks)["blocks"]
        elif a.dst == "explicit":
            # two runs far apart on the decode side
            half = a.nblocks // 2
            base2 = dinfo["blocks"] - (a.nblocks - half)
            dst = list(range(0, half)) + list(range(base2, dinfo["blocks"]))
        if a.shuffle:
            pairs = list(zip(src, dst if dst else src))
            rnd.shuffle(pairs)
            src = [p[0] for p in pairs]
            if dst:
                dst = [p[1] for p in pairs]
        plan.append({"name": name, "client": c, "req": req, "src": src,
                     "dst": dst, "info": dinfo})

    t0 = time.time()
    for p in plan:
        pre.push(p["req"], p["name"], p["src"], p["dst"])
    out = []
    for p in plan:
        ps = pre.wait(p["req"], a.timeout_ms)
        try:
            rs = p["client"].wait(p["req"], a.timeout_ms)
        except KvAgentError as e:
            rs = {"state": "absent", "error": str(e)}
        ms = int((time.time() - t0) * 1000)
        res = {"decode": p["name"], "req": p["req"], "push_state": ps["state"],
               "recv_state": rs["state"], "bytes": rs.get("bytes_done", 0),
               "ms": ms, "push_error": ps.get("error", ""),
               "recv_error": rs.get("error", "")}
        if rs["state"] == "ready":
            # the receiver's block order: ours when explicit, else ask
            if p["dst"] is None:
                # the receiver picked ascending free blocks, in push order
                p["dst"] = [s + i for s, c in rs.get("blocks_runs", [])
                            for i in range(c)]
            res["sum_src"] = pre.checksum(p["src"])
            if p["dst"] is not None:
                res["sum_dst"] = p["client"].checksum(p["dst"])
            if not a.no_register and p["dst"] is not None:
                pp, dp = pools[0], None
                dp = pools[1 + [x for x, _ in decs].index(p["name"])]
                L = pinfo["layers"] * pinfo["regions"]
                bb = pinfo["block_bytes"]
                bad = 0
                pm, dm = memoryview(pp.map), memoryview(dp.map)
                for s, d in zip(p["src"], p["dst"]):
                    for lr in range(L):
                        so, do = off(pinfo, lr, s), off(p["info"], lr, d)
                        if pm[so:so + bb] != dm[do:do + bb]:
                            bad += 1
                res["mismatched_slices"] = bad
                res["slices_checked"] = len(p["src"]) * L
        out.append(res)
    if not a.keep:
        for p in plan:
            for c in (pre, p["client"]):
                try:
                    c.release(p["req"])
                except KvAgentError:
                    pass
    print(json.dumps({"results": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
