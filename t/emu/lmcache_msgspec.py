#!/usr/bin/env python3
"""LMCache's ProxyNotif, encoded by msgspec itself (test helper).

The structs are declared as LMCache declares them in
lmcache/v1/storage_backend/pd_backend.py (LMCache/LMCache commit
07e0786947f9a4bf585563d280c7aee3882adecf):

    class PDMsgBase(msgspec.Struct, tag=True)      # tag field "type",
    AllocRequest / AllocResponse / ProxyNotif(PDMsgBase)   # value: class name
    PDMsg = Union[AllocRequest, AllocResponse, ProxyNotif]

The sender (PDBackend.batched_submit_put_task, every TP rank, after the
last prefill chunk) does proxy_side_channel.send(msgspec.msgpack.encode(
ProxyNotif(req_id=...))) over ZeroMQ PUSH; the proxy
(examples/disagg_prefill/disagg_proxy_server.py, zmq_pull_server) decodes
msgspec.msgpack.decode(msg_bytes, type=PDMsg) and counts msg.req_id.

    lmcache_msgspec.py send --to HOST:PORT [--from ADDR] [--count N]
                            [--conns N] [--then ID] KIND ID
    lmcache_msgspec.py recv --bind HOST:PORT --count N [--timeout S]
    lmcache_msgspec.py verdicts ID        # msgspec's verdict on every KIND

send prints one JSON line: the bytes sent (hex) and msgspec's own verdict
on them ({"ok": true, "req_id": ...} or {"ok": false, "error": ...}), i.e.
what LMCache's proxy would do with them.  --then ID sends a plain notice for
ID on the same connection afterwards (a marker: ZeroMQ keeps one
connection's messages in order).  recv binds a PULL socket (as LMCache's
proxy does), prints one JSON line per message: its hex, msgspec's decode
and whether the bytes equal msgspec's encoding of the struct decoded.
"""

import argparse
import json
import sys
import time
from typing import Union

import msgpack
import msgspec
import zmq


# --- as LMCache declares them (map form: tag=True) ---------------------------

class PDMsgBase(msgspec.Struct, tag=True):
    pass


class AllocRequest(PDMsgBase):
    keys: list[str]
    fmt: int
    shape: list[int]
    dtype: str
    last_chunk_toks: int


class AllocResponse(PDMsgBase):
    already_sent_indexes: list[int]
    remote_indexes: list[int]


class ProxyNotif(PDMsgBase):
    req_id: str


PDMsg = Union[AllocRequest, AllocResponse, ProxyNotif]


# --- the other form msgspec produces: array_like, the tag first ---------------

class PDMsgBaseArray(msgspec.Struct, tag="ProxyNotif", array_like=True):
    pass


class ProxyNotifArray(PDMsgBaseArray):
    req_id: str


# --- near misses, each built by msgspec ---------------------------------------

class ProxyNotify(PDMsgBase):               # unknown tag "ProxyNotify"
    req_id: str


class ProxyNotifExtra(msgspec.Struct, tag_field="type", tag="ProxyNotif"):
    req_id: str
    tp_rank: int                            # a field LMCache does not send


class ProxyNotifInt(msgspec.Struct, tag_field="type", tag="ProxyNotif"):
    req_id: int


class ProxyNotifLower(msgspec.Struct, tag_field="type", tag="proxynotif"):
    req_id: str


def enc(obj):
    return msgspec.msgpack.encode(obj)


def raw_map(*pairs):
    """A msgpack map from (key, value) pairs, keys possibly repeated."""
    out = bytearray()
    n = len(pairs)
    out += bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
    for k, v in pairs:
        out += msgpack.packb(k, use_bin_type=True)
        out += msgpack.packb(v, use_bin_type=True)
    return bytes(out)


def frames(kind, rid):
    """KIND -> the message (bytes)."""
    k = {
        # what LMCache sends
        "notice": lambda: enc(ProxyNotif(req_id=rid)),
        # the same struct in msgspec's array form: ["ProxyNotif", req_id]
        "array": lambda: enc(ProxyNotifArray(req_id=rid)),
        # siblings in the same union: LMCache's proxy decodes them too
        "allocreq": lambda: enc(AllocRequest(keys=[rid], fmt=1, shape=[2, 3],
                                             dtype="half",
                                             last_chunk_toks=7)),
        "allocresp": lambda: enc(AllocResponse(already_sent_indexes=[0],
                                               remote_indexes=[1])),
        "unknowntag": lambda: enc(ProxyNotify(req_id=rid)),
        "lowertag": lambda: enc(ProxyNotifLower(req_id=rid)),
        "extra": lambda: enc(ProxyNotifExtra(req_id=rid, tp_rank=1)),
        "intid": lambda: enc(ProxyNotifInt(req_id=12345)),
        "binid": lambda: raw_map(("type", "ProxyNotif"),
                                 ("req_id", rid.encode())),
        "nilid": lambda: raw_map(("type", "ProxyNotif"), ("req_id", None)),
        "noid": lambda: raw_map(("type", "ProxyNotif")),
        "notype": lambda: raw_map(("req_id", rid)),
        "tagint": lambda: raw_map(("type", 1), ("req_id", rid)),
        "taglast": lambda: raw_map(("req_id", rid), ("type", "ProxyNotif")),
        "dupid": lambda: raw_map(("type", "ProxyNotif"), ("req_id", rid + "-first"),
                                 ("req_id", rid)),
        "duptype": lambda: raw_map(("type", "ProxyNotif"),
                                   ("type", "ProxyNotif"), ("req_id", rid)),
        "intkey": lambda: raw_map(("type", "ProxyNotif"), ("req_id", rid),
                                  (1, 2)),
        "emptyid": lambda: enc(ProxyNotif(req_id="")),
        "nulid": lambda: enc(ProxyNotif(req_id=rid + "\0x")),
        "utf8id": lambda: enc(ProxyNotif(req_id=rid + "\u00e9")),
        "spaceid": lambda: enc(ProxyNotif(req_id=rid + " x")),
        "badutf8": lambda: (b"\x82\xa4type\xaaProxyNotif\xa6req_id\xa2"
                            b"\xff\xfe"),
        "longid": lambda: enc(ProxyNotif(req_id=rid + "a" * 200)),
        "huge": lambda: enc(ProxyNotif(req_id=rid + "h" * 4096)),
        "trailing": lambda: enc(ProxyNotif(req_id=rid)) + b"\xc0",
        "truncated": lambda: enc(ProxyNotif(req_id=rid))[:-1],
        "garbage": lambda: b"\xc1" * 16,
    }
    if kind not in k:
        raise SystemExit("unknown kind %r" % kind)
    return k[kind]()


KINDS = ["notice", "array", "allocreq", "allocresp", "unknowntag",
         "lowertag", "extra", "intid", "binid", "nilid", "noid", "notype",
         "tagint", "taglast", "dupid", "duptype", "intkey", "emptyid",
         "nulid", "utf8id", "spaceid", "badutf8", "longid", "huge",
         "trailing", "truncated", "garbage"]


def verdict(data, limit=160):
    """What LMCache's proxy makes of DATA: msgspec decode as PDMsg, then
    msg.req_id (an AttributeError there ends its receive loop)."""
    try:
        m = msgspec.msgpack.decode(data, type=PDMsg)
    except Exception as e:           # noqa: BLE001 - any refusal counts
        return {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
    if not isinstance(m, ProxyNotif):
        return {"ok": False, "decoded_as": type(m).__name__,
                "error": "no req_id (LMCache's proxy loop would stop)"}
    return {"ok": True, "req_id": m.req_id[:limit]}


def cmd_send(a):
    ctx = zmq.Context()
    ep = "tcp://" + ((a.src + ":0;") if a.src else "") + a.to
    data = frames(a.kind, a.id)
    socks = []
    for _ in range(a.conns):
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 2000)
        s.setsockopt(zmq.SNDTIMEO, 2000)
        s.connect(ep)
        socks.append(s)
    rc = 0
    try:
        for s in socks:
            for _ in range(a.count):
                s.send(data)
            if a.then:
                s.send(enc(ProxyNotif(req_id=a.then)))
    except zmq.Again:
        rc = 3
    time.sleep(0.1)
    for s in socks:
        s.close()
    ctx.term()
    out = {"kind": a.kind, "hex": data.hex(), "len": len(data),
           "msgspec": verdict(data), "sent": rc == 0}
    print(json.dumps(out, sort_keys=True))
    return rc


def cmd_recv(a):
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.LINGER, 0)
    s.bind("tcp://" + a.bind)
    print(json.dumps({"listening": a.bind}), flush=True)
    poller = zmq.Poller()
    poller.register(s, zmq.POLLIN)
    deadline = time.time() + a.timeout
    got = 0
    while got < a.count and time.time() < deadline:
        if not poller.poll(100):
            continue
        data = s.recv()
        v = verdict(data, limit=None)
        same = None
        if v["ok"]:
            same = data == enc(ProxyNotif(req_id=v["req_id"]))
        print(json.dumps({"hex": data.hex(), "msgspec": v,
                          "identical": same}, sort_keys=True), flush=True)
        got += 1
    s.close()
    ctx.term()
    return 0 if got == a.count else 4


def cmd_verdicts(a):
    for kind in KINDS:
        data = frames(kind, a.id)
        print(json.dumps({"kind": kind, "len": len(data),
                          "msgspec": verdict(data)}, sort_keys=True))
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("send")
    s.add_argument("--to", required=True)
    s.add_argument("--from", dest="src", default=None)
    s.add_argument("--count", type=int, default=1)
    s.add_argument("--conns", type=int, default=1)
    s.add_argument("--then", default=None)
    s.add_argument("kind")
    s.add_argument("id")
    r = sub.add_parser("recv")
    r.add_argument("--bind", required=True)
    r.add_argument("--count", type=int, default=1)
    r.add_argument("--timeout", type=float, default=20)
    v = sub.add_parser("verdicts")
    v.add_argument("id")
    a = ap.parse_args()
    return {"send": cmd_send, "recv": cmd_recv,
            "verdicts": cmd_verdicts}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
