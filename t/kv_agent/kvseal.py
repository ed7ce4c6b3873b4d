#!/usr/bin/env python3
"""Test driver for pool registration (issue 9, items 3 and 8).

  kvseal.py SOCK unsealed        register an unsealed memfd, then shrink it
  kvseal.py SOCK sealed          register a sealed memfd, try to shrink it
  kvseal.py SOCK small           register a (sealed) memfd too small
  kvseal.py SOCK good SEED       register a sealed memfd filled from SEED

Prints one JSON object: {"reply": <agent's reply>, "truncate": "ok" or the
error the engine got}.  The memfd is shrunk to 0 bytes after registration
where the mode says so: an agent that mapped an unsealed one would die of
SIGBUS on its next access.
"""

import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "kv_agent", "python"))
from kv_agent_client import Client, HostPool  # noqa: E402


def main():
    sock, mode = sys.argv[1], sys.argv[2]
    c = Client(sock)
    size = c.info()["pool"]["size"]
    out = {}
    if mode == "small":
        pool = HostPool(4096, "small")
    else:
        pool = HostPool(size, mode, seal=(mode != "unsealed"))
    if mode == "good":
        rnd = random.Random(int(sys.argv[3]))
        pool.map[:] = rnd.randbytes(size)
    msg = {"verb": "register_pool", "memory": "host", "size": pool.size}
    out["reply"] = c.call_raw(msg, fds=[pool.fd])
    if mode in ("unsealed", "sealed"):
        try:
            os.ftruncate(pool.fd, 0)
            out["truncate"] = "ok"
        except OSError as e:
            out["truncate"] = e.strerror
    print(json.dumps(out))


if __name__ == "__main__":
    main()
