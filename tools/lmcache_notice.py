#!/usr/bin/env python3
"""Send LMCache ProxyNotif messages (or hostile variants) to a notify port.

LMCache's PD sender (lmcache/v1/storage_backend/pd_backend.py) sends
msgspec.msgpack.encode(ProxyNotif(req_id=...)) -- the msgpack map
{"type": "ProxyNotif", "req_id": ID} -- over ZeroMQ PUSH to
pd_proxy_host:pd_proxy_port.  This tool does the same from a chosen source
address, for tests and for checking a deployment's notify port:

  lmcache_notice.py --to 127.0.0.1:7500 [--from 10.0.0.5] KIND [ID]

KIND: notice (a valid ProxyNotif for ID), garbage (random bytes),
      array (a msgpack array), notype (a map without "type"),
      wrongtype ({"type": "AllocRequest", ...}), intid (req_id a number),
      nulid (req_id with a NUL), longid (a 200-byte req_id), huge (a 2 KiB
      message), multipart (two frames), dupkey (two "req_id" keys),
      trailing (a notice followed by one more byte)
--count N sends it N times on one connection (a repeating sender);
--conns N does all that on N connections (N sender ranks).
Exit 0 once sent (ZeroMQ does not report whether the peer accepted);
exit 3 when no connection took the message within 2 s: nothing listens, or
the peer refused the handshake (an address outside its allowlist), which
can happen before or after the message is queued.
"""

import argparse
import os
import sys
import time

import msgpack
import zmq


def notice(rid):
    return msgpack.packb({"type": "ProxyNotif", "req_id": rid})


def frames(kind, rid):
    if kind == "notice":
        return [notice(rid)]
    if kind == "garbage":
        return [os.urandom(64)]
    if kind == "array":
        return [msgpack.packb(["ProxyNotif", rid])]
    if kind == "notype":
        return [msgpack.packb({"req_id": rid})]
    if kind == "wrongtype":
        return [msgpack.packb({"type": "AllocRequest", "req_id": rid})]
    if kind == "intid":
        return [msgpack.packb({"type": "ProxyNotif", "req_id": 12345})]
    if kind == "nulid":
        return [msgpack.packb({"type": "ProxyNotif", "req_id": rid + "\0x"})]
    if kind == "longid":
        return [msgpack.packb({"type": "ProxyNotif", "req_id": "a" * 200})]
    if kind == "huge":
        return [msgpack.packb({"type": "ProxyNotif", "req_id": rid,
                               "pad": "x" * 2048})]
    if kind == "multipart":
        return [notice(rid), notice(rid)]
    if kind == "dupkey":
        # msgpack map of 3 with "req_id" twice (packb cannot repeat keys)
        body = b"\x83" + msgpack.packb("type") + msgpack.packb("ProxyNotif")
        body += msgpack.packb("req_id") + msgpack.packb(rid)
        body += msgpack.packb("req_id") + msgpack.packb(rid + "x")
        return [body]
    if kind == "trailing":
        return [notice(rid) + b"\x00"]
    raise SystemExit("unknown kind %r" % kind)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--to", required=True, help="HOST:PORT of the notify "
                    "port (pd_proxy_host:pd_proxy_port)")
    ap.add_argument("--from", dest="src", default=None,
                    help="source address to connect from")
    ap.add_argument("--count", type=int, default=1)
    ap.add_argument("--conns", type=int, default=1)
    ap.add_argument("kind")
    ap.add_argument("id", nargs="?", default="x")
    a = ap.parse_args()
    ctx = zmq.Context()
    ep = "tcp://" + ((a.src + ":0;") if a.src else "") + a.to
    fr = frames(a.kind, a.id)
    socks = []
    for _ in range(a.conns):
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 2000)
        s.setsockopt(zmq.SNDTIMEO, 2000)
        s.connect(ep)
        socks.append(s)
    try:
        for s in socks:
            for _ in range(a.count):
                if len(fr) == 1:
                    s.send(fr[0])
                else:
                    s.send_multipart(fr)
    except zmq.Again:
        sys.stderr.write("lmcache_notice: not sent (no connection)\n")
        return 3
    time.sleep(0.1)         # let the IO thread write before LINGER
    for s in socks:
        s.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
