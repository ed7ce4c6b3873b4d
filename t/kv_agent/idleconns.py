#!/usr/bin/env python3
"""Open N TCP connections to HOST:PORT, send nothing, hold them.

  idleconns.py HOST PORT N [--from ADDR]

An outsider's descriptor flood: prints "opened K" once every connect()
has been started and given up to 5 s to complete (K: how many the kernel
reports established), then holds them all until stdin closes.  The soft
RLIMIT_NOFILE is raised to the hard limit first (N may exceed 1024).
"""

import errno
import resource
import select
import socket
import sys
import time


def main():
    host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    src = sys.argv[5] if len(sys.argv) > 5 and sys.argv[4] == "--from" \
        else None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, n + 64) if hard != resource.RLIM_INFINITY else n + 64
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        if src:
            s.bind((src, 0))
        rc = s.connect_ex((host, port))
        if rc not in (0, errno.EINPROGRESS):
            s.close()
            continue
        socks.append(s)
    # established: writable without a pending error
    done, pending = set(), set(socks)
    deadline = time.time() + 5
    poller = select.poll()
    for s in socks:
        poller.register(s, select.POLLOUT)
    fds = {s.fileno(): s for s in socks}
    while pending and time.time() < deadline:
        for fd, ev in poller.poll(100):
            s = fds[fd]
            if s in pending:
                pending.discard(s)
                poller.unregister(s)
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    done.add(s)
    print("opened %d" % len(done), flush=True)
    sys.stdin.read()
    for s in socks:
        s.close()


if __name__ == "__main__":
    main()
