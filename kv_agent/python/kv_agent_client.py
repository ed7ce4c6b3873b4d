"""kv_agent local API client (Python standard library only).

The agent listens on a Unix socket; every message is a 4-byte big-endian
length followed by a JSON object.  Requests carry "verb"; replies carry
"ok" (and "error"/"code" when ok is false).  Host-memory pools are handed
over as a memfd with SCM_RIGHTS, GPU pools as a CUDA IPC handle (hex).

    from kv_agent_client import Client, HostPool
    pool = HostPool(size)                 # memfd + mmap, shared with the agent
    c = Client("/run/kv_agent.sock")
    c.register_pool(pool)
    c.push("req-1", "decode-0", src=[0, 1, 2])
    c.wait("req-1", timeout_ms=10000)
"""

import fcntl
import json
import mmap
import os
import socket
import struct

__all__ = ["Client", "HostPool", "KvAgentError", "runs"]


class KvAgentError(Exception):
    """An error reply from the agent: .code (short) and .message."""

    def __init__(self, code, message, reply=None):
        super().__init__("%s: %s" % (code, message))
        self.code = code
        self.message = message
        self.reply = reply or {}


def runs(ids):
    """[3, 4, 5, 9] -> [[3, 3], [9, 1]] (the compact block-list form)."""
    out = []
    for b in ids:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1][1] += 1
        else:
            out.append([b, 1])
    return out


class HostPool:
    """Host memory for a KV pool: a memfd mapped here and, once registered,
    in the agent too (MAP_SHARED), so both see the same bytes."""

    def __init__(self, size, name="kv_pool", seal=True):
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED,
                             mmap.PROT_READ | mmap.PROT_WRITE)
        if seal:
            self.seal()

    def seal(self):
        """Fix the size (F_SEAL_SHRINK | F_SEAL_GROW): the agent refuses a
        memfd that could shrink under it (SIGBUS) or grow."""
        want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        if fcntl.fcntl(self.fd, fcntl.F_GET_SEALS) & want != want:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, want)

    def close(self):
        self.map.close()
        os.close(self.fd)


class Client:
    def __init__(self, path, timeout=60.0):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- framing --------------------------------------------------------
    def send_raw(self, payload, fds=None):
        frame = struct.pack(">I", len(payload)) + payload
        if fds:
            socket.send_fds(self.sock, [frame], list(fds))
        else:
            self.sock.sendall(frame)

    def _recv_exact(self, n):
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("kv_agent closed the connection")
            buf += chunk
        return bytes(buf)

    def recv(self):
        (n,) = struct.unpack(">I", self._recv_exact(4))
        return json.loads(self._recv_exact(n))

    def call_raw(self, msg, fds=None):
        """Send one request, return the reply dict (ok true or false)."""
        self.send_raw(json.dumps(msg).encode(), fds)
        return self.recv()

    def call(self, msg, fds=None):
        """Like call_raw, but raise KvAgentError on an error reply."""
        rep = self.call_raw(msg, fds)
        if not rep.get("ok"):
            raise KvAgentError(rep.get("code", "error"),
                               rep.get("error", "unknown error"), rep)
        return rep

    # -- verbs ------------------------------------------------------------
    def info(self):
        return self.call({"verb": "info"})

    def register_pool(self, pool):
        """pool: a HostPool (memfd, sealed against resizing) ..."""
        pool.seal()
        return self.call({"verb": "register_pool", "memory": "host",
                          "size": pool.size}, fds=[pool.fd])

    def register_cuda_pool(self, device, ipc_handle_hex, size):
        """... or a CUDA allocation exported with cudaIpcGetMemHandle."""
        return self.call({"verb": "register_pool",
                          "memory": "cuda:%d" % device,
                          "ipc_handle": ipc_handle_hex, "size": size})

    def reserve(self, req_id, nblocks=None, blocks=None):
        msg = {"verb": "reserve", "req_id": req_id}
        if blocks is not None:
            msg["blocks_runs"] = runs(blocks)
        else:
            msg["nblocks"] = nblocks
        return self.call(msg)

    def push(self, req_id, peer, src, dst=None):
        msg = {"verb": "push", "req_id": req_id, "peer": peer,
               "src_runs": runs(src)}
        if dst is not None:
            msg["dst_runs"] = runs(dst)
        return self.call(msg)

    def poll(self, req_id):
        return self.call({"verb": "poll", "req_id": req_id})

    def wait(self, req_id, timeout_ms=30000):
        return self.call({"verb": "wait", "req_id": req_id,
                          "timeout_ms": timeout_ms})

    def release(self, req_id):
        return self.call({"verb": "release", "req_id": req_id})

    def checksum(self, blocks):
        return self.call({"verb": "checksum",
                          "blocks_runs": runs(blocks)})["checksum"]

    def fill(self, blocks, seed=1):
        return self.call({"verb": "fill", "blocks_runs": runs(blocks),
                          "seed": seed})
