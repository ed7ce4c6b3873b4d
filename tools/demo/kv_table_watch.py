#!/usr/bin/env python3
"""Watch the router's state table during the demo's kv_agent run.

The decode engine releases a request's record once it has used the KV, so
after the run the table shows no requests.  This samples the table every
--interval seconds until SIGTERM, then prints, per request id, the states
it went through (reserved -> transferring -> ready), its blocks and bytes,
the node the KV went to and where it came from, and the transfer time the
agents recorded (t_start_ms .. t_done_ms).

The table is read directly (mmap, the ABI of kv_agent/include/dpd_state.h,
with its per-record seqlock): `kv_agent status --json` takes ~200 ms to
start here, too slow to see a 30 ms transfer.

    kv_table_watch.py --state FILE [--interval 0.01]
"""

import argparse
import mmap
import os
import signal
import struct
import sys
import time

MAGIC = 0x3154415453445044           # "DPDSTAT1"
VERSION = 1
HEADER = struct.Struct('<QIIIIIIQQQ')  # magic .. file_size
# dpd_req_rec_t: seq state id_hash bytes_done bytes_total t_reserved_ms
# t_start_ms t_done_ms nblocks error req_id[128] node_id[64] peer_id[64]
# reserved[32]
REQ = struct.Struct('<IIQQQQQQIi128s64s64s32x')
STATES = {1: 'reserved', 2: 'transferring', 3: 'ready', 4: 'failed'}

stop = False


def on_term(_sig, _frm):
    global stop
    stop = True


def cstr(b):
    return b.split(b'\0', 1)[0].decode('ascii', 'replace')


def sample(path):
    """[(req_id, record dict)] or None when the table is not readable."""
    try:
        with open(path, 'rb') as f:
            size = os.fstat(f.fileno()).st_size
            if size < HEADER.size:
                return None
            m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    try:
        (magic, version, _hs, _ns, rs, _mn, max_reqs, _no, reqs_off,
         fsize) = HEADER.unpack_from(m, 0)
        if (magic != MAGIC or version != VERSION or rs != REQ.size
                or fsize > size or reqs_off + max_reqs * rs > size):
            return None
        out = []
        for i in range(max_reqs):
            off = reqs_off + i * rs
            if m[off + 4] == 0 and m[off + 5:off + 8] == b'\0\0\0':
                continue                      # state FREE: skip quickly
            for _ in range(64):               # seqlock read
                s1 = struct.unpack_from('<I', m, off)[0]
                if s1 & 1:
                    continue
                rec = REQ.unpack_from(m, off)
                if struct.unpack_from('<I', m, off)[0] == s1:
                    break
            else:
                continue
            (_seq, state, _h, done, total, t_res, t_start, t_done, nblocks,
             err, rid, node, peer) = rec
            if state not in STATES:
                continue
            out.append((cstr(rid), {
                'state': STATES[state], 'bytes_done': done,
                'bytes_total': total, 't_reserved_ms': t_res,
                't_start_ms': t_start, 't_done_ms': t_done,
                'nblocks': nblocks, 'error': err, 'node': cstr(node),
                'peer': cstr(peer)}))
        return out
    finally:
        m.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--state', required=True)
    ap.add_argument('--interval', type=float, default=0.01)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    seen = {}      # req_id -> {"states": [...], "last": record}
    order = []
    samples = 0
    while not stop:
        t = sample(args.state)
        if t is not None:
            samples += 1
            for rid, r in t:
                if rid not in seen:
                    seen[rid] = {'states': [], 'last': r}
                    order.append(rid)
                s = seen[rid]
                if not s['states'] or s['states'][-1] != r['state']:
                    s['states'].append(r['state'])
                s['last'] = r
        time.sleep(args.interval)

    print(f'   {len(order)} request(s) seen in {samples} samples of the '
          'router table during the run (records are dropped once the '
          'decoder used the KV):')
    for rid in order:
        s = seen[rid]
        r = s['last']
        xfer = ''
        if r.get('t_start_ms') and r.get('t_done_ms'):
            ms = r['t_done_ms'] - r['t_start_ms']
            rate = (r['bytes_done'] / 1e6 / (ms / 1e3)) if ms > 0 else 0
            xfer = f', moved in {ms:.0f} ms' + (
                f' ({rate:.0f} MB/s)' if rate else '')
        err = f' error={r["error"]}' if r.get('error') else ''
        print(f'     {rid:<28} {" -> ".join(s["states"]):<34}'
              f' {r["nblocks"]:4d} blocks {r["bytes_done"] / 1e6:6.1f}/'
              f'{r["bytes_total"] / 1e6:.1f} MB  {r["peer"] or "-"} -> '
              f'{r["node"] or "-"}{xfer}{err}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
