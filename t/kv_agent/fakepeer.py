#!/usr/bin/env python3
"""A fake kv_agent control peer for the authentication tests.

It speaks the control channel's framing (4-byte big-endian length + JSON)
and the handshake of kv_agent/src/auth.c, honestly or not:

  client   connect to an agent as NODE with KEY; with a right key this is a
           legitimate peer: it prints the agent's hello_ok (what a peer of
           that role is told) and whether the agent's proof verified.
           --kid lies about the key id; --count N handshakes in a row.
  server   listen as NODE for an agent's outbound link; send a challenge,
           record the agent's hello (--record FILE), answer a hello_ok
           whose proof is random (--mode nokey), the agent's own proof
           echoed back (--mode echo) or right (--mode valid, needs KEY);
           prints whether the agent then used the link (sent a heartbeat).
  replay   connect to an agent and send a recorded hello as it is.
  reflect  accept the agent's outbound link while holding an inbound one
           to the same agent: pass the agent's own challenge nonce to its
           outbound side and send the hello it answers with back to it
           (--rewrite: claiming to be the peer it was meant for).

The last line printed is one JSON object with the outcome.
"""

import argparse
import hashlib
import hmac
import json
import os
import select
import socket
import struct
import sys
import time

TAG = b"kv_agent-auth-2"


def frame(obj):
    b = json.dumps(obj).encode()
    return struct.pack(">I", len(b)) + b


def read_exact(s, n, deadline):
    buf = b""
    while len(buf) < n:
        left = deadline - time.time()
        if left <= 0:
            return None
        r, _, _ = select.select([s], [], [], left)
        if not r:
            return None
        try:
            d = s.recv(n - len(buf))
        except OSError:
            return None
        if not d:
            return None
        buf += d
    return buf


def read_msg(s, timeout):
    deadline = time.time() + timeout
    h = read_exact(s, 4, deadline)
    if h is None:
        return None
    (n,) = struct.unpack(">I", h)
    b = read_exact(s, n, deadline)
    return None if b is None else json.loads(b)


def put(*fields):
    out = b""
    for f in fields:
        if isinstance(f, str):
            f = f.encode()
        out += struct.pack(">H", len(f)) + f
    return out


def key_id(key):
    return hmac.new(key, b"kv_agent key id", hashlib.sha256).digest()[:8].hex()


def proof(key, direction, cid, crole, sid, srole, nc, ns, kid):
    d = "client->server" if direction == "client" else "server->client"
    msg = put(TAG, d, cid, crole, sid, srole, nc, ns, kid)
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def out(obj):
    print(json.dumps(obj))
    sys.stdout.flush()


def connect(port):
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def do_client(a):
    key = bytes.fromhex(a.key)
    kid = a.kid or key_id(key)
    results = []
    for _ in range(a.count):
        s = connect(a.connect)
        ch = read_msg(s, 3)
        if ch is None or ch.get("type") != "challenge":
            results.append({"error": "no challenge", "got": ch})
            s.close()
            continue
        ns = bytes.fromhex(ch["nonce"])
        nc = os.urandom(32)
        hello = {"type": "hello", "version": 2, "node": a.node,
                 "peer": a.peer, "nonce": nc.hex(), "key_id": kid,
                 "proof": proof(key, "client", a.node, a.role, a.peer,
                                a.peer_role, nc, ns, kid)}
        s.sendall(frame(hello))
        rep = read_msg(s, 3)
        r = {"reply": rep}
        if rep and rep.get("type") == "hello_ok":
            want = proof(key, "server", a.node, a.role, a.peer,
                         a.peer_role, nc, ns, kid)
            r["server_proof_ok"] = hmac.compare_digest(want,
                                                       rep.get("proof", ""))
        if a.record:
            with open(a.record, "w") as f:
                json.dump(hello, f)
        results.append(r)
        if a.hold:
            time.sleep(a.hold)
        s.close()
    out({"results": results})


def do_server(a):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((a.host, a.listen))
    ls.listen(4)
    ls.settimeout(a.timeout)
    try:
        s, _ = ls.accept()
    except socket.timeout:
        out({"error": "no connection"})
        return
    ns = os.urandom(32)
    s.sendall(frame({"type": "challenge", "version": 2, "node": a.node,
                     "nonce": ns.hex()}))
    hello = read_msg(s, 3)
    if hello is None:
        out({"error": "no hello"})
        return
    if a.record:
        with open(a.record, "w") as f:
            json.dump(hello, f)
    if a.mode == "echo":
        pr = hello.get("proof", "00" * 32)
    elif a.mode == "valid":
        key = bytes.fromhex(a.key)
        pr = proof(key, "server", hello["node"], a.peer_role, a.node, a.role,
                   bytes.fromhex(hello["nonce"]), ns, hello["key_id"])
    else:
        pr = os.urandom(32).hex()
    # no rails and no pool: nothing an agent could fail to parse
    s.sendall(frame({"type": "hello_ok", "version": 2, "node": a.node,
                     "proof": pr, "role": a.role, "rails": []}))
    used, closed, got = False, False, []
    deadline = time.time() + a.hold
    while time.time() < deadline:
        m = read_msg(s, max(0.05, deadline - time.time()))
        if m is None:
            r, _, _ = select.select([s], [], [], 0)
            if r and not s.recv(1, socket.MSG_PEEK):
                closed = True
                break
            continue
        got.append(m.get("type"))
        if m.get("type") in ("hb", "push_begin", "req"):
            used = True
    out({"hello": hello, "used": used, "closed": closed, "got": got})


def do_replay(a):
    with open(a.hello) as f:
        hello = json.load(f)
    s = connect(a.connect)
    ch = read_msg(s, 1)
    s.sendall(frame(hello))
    out({"challenge": ch, "reply": read_msg(s, 3)})


def do_reflect(a):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", a.listen))
    ls.listen(4)
    ls.settimeout(a.timeout)
    try:
        outb, _ = ls.accept()          # the agent's outbound link
    except socket.timeout:
        out({"error": "no connection"})
        return
    inb = connect(a.connect)            # our inbound link to the agent
    ch = read_msg(inb, 1)
    ns = bytes.fromhex(ch["nonce"]) if ch else os.urandom(32)
    outb.sendall(frame({"type": "challenge", "version": 2, "node": a.node,
                        "nonce": ns.hex()}))
    hello = read_msg(outb, 3)
    if hello is None:
        out({"error": "no hello from the agent"})
        return
    sent = dict(hello)
    if a.rewrite:
        sent["node"], sent["peer"] = a.node, hello.get("node")
    inb.sendall(frame(sent))
    out({"hello": hello, "sent": sent, "reply": read_msg(inb, 3)})


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("client")
    c.add_argument("--connect", type=int, required=True)
    c.add_argument("--node", required=True)
    c.add_argument("--role", required=True)
    c.add_argument("--peer", required=True)
    c.add_argument("--peer-role", required=True)
    c.add_argument("--key", required=True)
    c.add_argument("--kid")
    c.add_argument("--count", type=int, default=1)
    c.add_argument("--hold", type=float, default=0)
    c.add_argument("--record")
    s = sub.add_parser("server")
    s.add_argument("--listen", type=int, required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--node", required=True)
    s.add_argument("--role", default="decode")
    s.add_argument("--peer-role", default="prefill")
    s.add_argument("--mode", choices=["nokey", "echo", "valid"],
                   default="nokey")
    s.add_argument("--key")
    s.add_argument("--record")
    s.add_argument("--hold", type=float, default=1.5)
    s.add_argument("--timeout", type=float, default=10)
    r = sub.add_parser("replay")
    r.add_argument("--connect", type=int, required=True)
    r.add_argument("--hello", required=True)
    f = sub.add_parser("reflect")
    f.add_argument("--listen", type=int, required=True)
    f.add_argument("--connect", type=int, required=True)
    f.add_argument("--node", required=True)
    f.add_argument("--rewrite", action="store_true")
    f.add_argument("--timeout", type=float, default=10)
    a = p.parse_args()
    {"client": do_client, "server": do_server, "replay": do_replay,
     "reflect": do_reflect}[a.cmd](a)


if __name__ == "__main__":
    main()
