#!/usr/bin/env python3
"""Test driver for tensor-parallel pools: one engine worker per rank
registers its own memfd pool with its rank on a prefill and a decode agent,
then one push moves every rank's blocks; every rank's bytes are checked.

  kvtp.py --prefill SOCK --decode NAME=SOCK [--ranks 8] [--nblocks 64]
          [--reg-prefill N] [--reg-decode N] [--watch RANK] [--req ID]
          [--no-push] [--timeout-ms 30000]

--watch R: while the push runs, wait until every rank but R has landed and
report the decode state seen then (readiness must wait for rank R).
Prints one JSON object.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "kv_agent", "python"))
from kv_agent_client import Client, HostPool, KvAgentError  # noqa: E402


def off(p, lr, block):
    layer, region = divmod(lr, p["regions"])
    return (layer * p["layer_stride"] + region * p["region_stride"]
            + block * p["block_stride"])


def landed(pi, di, pp, dp, src, dst):
    """mismatched (layer, region) slices of these blocks on one rank; the
    blocks are runs on both sides, so each (layer, region) is compared as
    one slice first (mmap slices are bytes: memcmp)"""
    L = pi["layers"] * pi["regions"]
    bb = pi["block_bytes"]
    n = len(src)
    contiguous = (src == list(range(src[0], src[0] + n))
                  and dst == list(range(dst[0], dst[0] + n))
                  and pi["block_stride"] == bb and di["block_stride"] == bb)
    bad = 0
    for lr in range(L):
        if contiguous:
            so, do = off(pi, lr, src[0]), off(di, lr, dst[0])
            if pp.map[so:so + n * bb] == dp.map[do:do + n * bb]:
                continue
        for s, d in zip(src, dst):
            so, do = off(pi, lr, s), off(di, lr, d)
            if pp.map[so:so + bb] != dp.map[do:do + bb]:
                bad += 1
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--nblocks", type=int, default=64)
    ap.add_argument("--reg-prefill", type=int)
    ap.add_argument("--reg-decode", type=int)
    ap.add_argument("--watch", type=int, default=-1)
    ap.add_argument("--watch-s", type=float, default=10)
    ap.add_argument("--req", default="tp")
    ap.add_argument("--no-push", action="store_true")
    ap.add_argument("--timeout-ms", type=int, default=30000)
    a = ap.parse_args()
    name, dsock = a.decode.split("=", 1)
    pre, dec = Client(a.prefill), Client(dsock)
    pi, di = pre.info()["pool"], dec.info()["pool"]
    out = {"prefill_ranks": pi.get("ranks"), "decode_ranks": di.get("ranks")}

    # one "engine worker" per rank on each side
    ppools, dpools, regs = [], [], []
    for r in range(a.reg_prefill if a.reg_prefill is not None else a.ranks):
        hp = HostPool(pi["size"], "p%d" % r)
        chunk = 1 << 22
        for o in range(0, pi["size"], chunk):
            hp.map[o:o + chunk] = os.urandom(min(chunk, pi["size"] - o))
        rep = pre.call_raw({"verb": "register_pool", "memory": "host",
                            "size": pi["size"], "rank": r,
                            "ranks": a.ranks}, fds=[hp.fd])
        regs.append(rep)
        ppools.append(hp)
    for r in range(a.reg_decode if a.reg_decode is not None else a.ranks):
        hp = HostPool(di["size"], "d%d" % r)
        rep = dec.call_raw({"verb": "register_pool", "memory": "host",
                            "size": di["size"], "rank": r,
                            "ranks": a.ranks}, fds=[hp.fd])
        regs.append(rep)
        dpools.append(hp)
    out["registered"] = [bool(x.get("ok")) for x in regs]
    out["reg_errors"] = [x.get("error") for x in regs if not x.get("ok")]
    # bad registrations: a rank past the node's, a different TP size
    hp = HostPool(pi["size"], "bad")
    out["bad_rank"] = pre.call_raw({"verb": "register_pool", "memory": "host",
                                    "size": pi["size"], "rank": a.ranks},
                                   fds=[hp.fd])
    out["bad_tp"] = pre.call_raw({"verb": "register_pool", "memory": "host",
                                  "size": pi["size"], "rank": 0,
                                  "ranks": a.ranks // 2 or 2}, fds=[hp.fd])
    hp.close()
    deadline = time.time() + 15
    while time.time() < deadline:
        peers = {x["id"]: x for x in pre.info()["peers"]}
        if peers.get(name, {}).get("connected") and (
                peers[name].get("remote_pool")
                or len(dpools) < a.ranks or len(ppools) < a.ranks
                or di.get("ranks") != pi.get("ranks")):
            break
        time.sleep(0.05)
    if a.no_push:
        print(json.dumps(out))
        return 0
    src = list(range(8, 8 + a.nblocks))
    dst = list(range(di["blocks"] - a.nblocks, di["blocks"]))
    req = "%s-%d" % (a.req, os.getpid())
    t0 = time.time()
    out["push"] = pre.call_raw({"verb": "push", "req_id": req, "peer": name,
                                "src_runs": [[src[0], a.nblocks]],
                                "dst_runs": [[dst[0], a.nblocks]]})
    if not out["push"].get("ok"):
        print(json.dumps(out))
        return 0
    if a.watch >= 0:
        # every other rank lands while rank `watch` is held back
        others = [r for r in range(a.ranks) if r != a.watch]
        w_deadline = time.time() + a.watch_s
        seen = None
        while time.time() < w_deadline:
            if all(landed(pi, di, ppools[r], dpools[r], src, dst) == 0
                   for r in others):
                seen = dec.call_raw({"verb": "poll", "req_id": req})
                out["watch_state"] = seen.get("state")
                out["watch_rank_bad"] = landed(pi, di, ppools[a.watch],
                                               dpools[a.watch], src, dst)
                out["watch_ms"] = int((time.time() - t0) * 1000)
                break
            time.sleep(0.02)
        out["watch_others_landed"] = seen is not None
    ps = pre.wait(req, a.timeout_ms)
    try:
        rs = dec.wait(req, a.timeout_ms)
    except KvAgentError as e:
        rs = {"state": "absent", "error": str(e)}
    out["ms"] = int((time.time() - t0) * 1000)
    out["push_state"], out["recv_state"] = ps["state"], rs["state"]
    out["push_error"], out["recv_error"] = ps.get("error"), rs.get("error")
    out["bytes"] = rs.get("bytes_done", 0)
    out["bad"] = [landed(pi, di, ppools[r], dpools[r], src, dst)
                  for r in range(a.ranks)]
    out["slices"] = a.nblocks * pi["layers"] * pi["regions"]
    # the agents' own checksums agree per rank (one rank is enough here)
    r = a.ranks - 1
    out["sum_src"] = pre.call({"verb": "checksum", "rank": r,
                               "blocks_runs": [[src[0], a.nblocks]]})["checksum"]
    out["sum_dst"] = dec.call({"verb": "checksum", "rank": r,
                               "blocks_runs": [[dst[0], a.nblocks]]})["checksum"]
    out["decode_info"] = dec.info()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
