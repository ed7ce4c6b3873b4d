#!/usr/bin/env python3
"""Test writer of the KV-events prefix index (kv_agent/include/dpd_prefix_index.h).

A stand-in for the router-role kv_agent: it writes the file format the
nginx workers read with "dpd_prefix_cache events file=PATH", and computes
block keys with a Python port of kv_agent/include/dpd_prefix.h (a key that
differs from the C one makes the nginx tests miss, so they check the port
too).  Standard library only.

  prefix_index.py create PATH --node ADDR [--node ADDR ...] [--slots N]
                  [--block 16] [--probe 16] [--version V]
  prefix_index.py beat PATH [--age MS] [--dead]
                  the writer's heartbeat: updated_ms = now - MS (every
                  write below beats too); --dead: writer_alive = 0 (a
                  clean exit)
  prefix_index.py store PATH --node-index I --model M [--salt S]
                  (--ids 1,2,3 | --ids @FILE | --repeat ID:COUNT) [--lower]
  prefix_index.py clear-node PATH --node-index I
  prefix_index.py shrink PATH BYTES         truncate the file
  prefix_index.py tear PATH --model M (--ids ... | --repeat ...) [--salt S]
                  leave the first block's slot with an odd seq (a writer
                  that died mid-update)
  prefix_index.py tear-header PATH          break the magic
  prefix_index.py keys --model M [--salt S] (--ids ... | --repeat ...)
                  print the keys, one per line (hex)
  prefix_index.py nodes PATH     the USED node records as JSON, one a
                  line (index, id, http, flags, epoch, blocks, lower, and
                  "bits": the slots that have the node's bit), as a
                  reader sees them (a record being written is retried)
"""

import argparse
import os
import struct
import sys
import time

M64 = (1 << 64) - 1
P1 = 0x9E3779B185EBCA87
P2 = 0xC2B2AE3D27D4EB4F
P3 = 0x165667B19E3779F9

MAGIC = 0x3130584650445044     # "DPDPFX01"
VERSION = 2                    # 2: the home slot salted per file
KEY_VERSION = 1
HEADER = struct.Struct('<QIIIIIIQQQQQIIIIQQ152s')
ALIVE_OFF, UPDATED_OFF = 84, 88   # writer_alive, updated_ms
NODE = struct.Struct('<IIQQQQ64s128s24s')
SLOT = struct.Struct('<IIQQQ')
NODE_USED, NODE_READY = 1, 2
assert HEADER.size == 256 and NODE.size == 256 and SLOT.size == 32


def rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & M64


def fmix(h):
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & M64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & M64
    h ^= h >> 33
    return h


def hash_str(data):
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & M64
    return fmix(h ^ len(data))


def seed(model, lora=b''):
    h = hash_str(model)
    h ^= (rotl(hash_str(lora), 29) * P3) & M64
    return fmix((h + P1) & M64)


def salted(s, salt):
    if not salt:
        return s
    return fmix(s ^ rotl((hash_str(salt) * P2) & M64, 31))


def block_key(parent, ids):
    n = len(ids)
    acc = (parent * P1 + n * P3) & M64
    i = 0
    while i + 1 < n:
        lane = ids[i] | (ids[i + 1] << 32)
        acc ^= (rotl((lane * P2) & M64, 31) * P1) & M64
        acc = (rotl(acc, 27) * P1 + P3) & M64
        i += 2
    if i < n:
        acc ^= (ids[i] * P1) & M64
        acc = (rotl(acc, 23) * P2 + P3) & M64
    acc = fmix(acc ^ parent)
    return acc or 1


def keys(model, salt, ids, block):
    parent = salted(seed(model.encode()), salt.encode() if salt else b'')
    out = []
    for k in range(len(ids) // block):
        parent = block_key(parent, ids[k * block:(k + 1) * block])
        out.append(parent)
    return out


class Index:
    def __init__(self, path):
        self.path = path
        with open(path, 'rb') as f:
            h = HEADER.unpack(f.read(HEADER.size))
        (self.magic, self.version, _, _, _, self.max_nodes, self.max_probe,
         self.nslots, self.nodes_off, self.slots_off, self.file_size,
         self.generation, _, self.block, _, _, _, self.salt, _) = h

    def home(self, key):
        # dpd_prefix_index.h dpd_pfx_home(): the key mixed with the salt
        return fmix(key ^ self.salt) & (self.nslots - 1)

    def beat(self, f, age_ms=0, alive=True):
        f.seek(ALIVE_OFF)
        f.write(struct.pack('<IQ', 1 if alive else 0,
                            now_ms() - age_ms))

    def slot_off(self, i):
        return self.slots_off + i * SLOT.size

    def write_slot(self, f, i, seq, key, gpu, lower):
        f.seek(self.slot_off(i))
        f.write(SLOT.pack(seq, 0, key, gpu, lower))

    def read_slot(self, f, i):
        f.seek(self.slot_off(i))
        return SLOT.unpack(f.read(SLOT.size))

    def find(self, f, key, create):
        for p in range(self.max_probe):
            i = (self.home(key) + p) & (self.nslots - 1)
            seq, _, k, gpu, lower = self.read_slot(f, i)
            if k == key:
                return i, seq, gpu, lower
            if k == 0:
                if create:
                    return i, seq, 0, 0
                return None
        if create:
            raise SystemExit('prefix_index: probe window full')
        return None

    def store(self, ks, node, lower=False, torn=None):
        bit = 1 << node
        with open(self.path, 'r+b') as f:
            self.beat(f)
            for n, key in enumerate(ks):
                i, seq, gpu, low = self.find(f, key, True)
                if lower:
                    low |= bit
                else:
                    gpu |= bit
                if torn is not None and n == torn:
                    # a writer killed mid-update: seq stays odd
                    self.write_slot(f, i, seq + 1, key, gpu, low)
                    continue
                self.write_slot(f, i, seq + 2, key, gpu, low)

    def nodes(self):
        out = []
        with open(self.path, 'rb') as f:
            for i in range(self.max_nodes):
                for _ in range(64):
                    f.seek(self.nodes_off + i * NODE.size)
                    raw = f.read(NODE.size)
                    seq = struct.unpack_from('<I', raw)[0]
                    f.seek(self.nodes_off + i * NODE.size)
                    if seq % 2 == 0 and f.read(4) == raw[:4]:
                        break
                (seq, flags, epoch, blocks, lower, _, nid, http,
                 _) = NODE.unpack(raw)
                if not flags & NODE_USED:
                    continue
                out.append({'index': i, 'flags': flags, 'epoch': epoch,
                            'blocks': blocks, 'lower': lower,
                            'id': nid.split(b'\0')[0].decode(),
                            'http': http.split(b'\0')[0].decode(),
                            'bits': 0})
            byidx = {n['index']: n for n in out}
            f.seek(self.slots_off)
            data = f.read(self.nslots * SLOT.size)
            for k in range(self.nslots):
                _, _, key, gpu, low = SLOT.unpack_from(data, k * SLOT.size)
                m = gpu | low
                while key and m:
                    b = (m & -m).bit_length() - 1
                    m &= m - 1
                    if b in byidx:
                        byidx[b]['bits'] += 1
        return out

    def clear_node(self, node):
        bit = 1 << node
        with open(self.path, 'r+b') as f:
            self.beat(f)
            for i in range(self.nslots):
                seq, _, k, gpu, low = self.read_slot(f, i)
                if k and (gpu | low) & bit:
                    self.write_slot(f, i, seq + 2, k, gpu & ~bit, low & ~bit)


def now_ms():
    return int(time.time() * 1000)


def create(path, nodes, nslots, block, probe, version=VERSION):
    max_nodes = 64
    nodes_off = HEADER.size
    slots_off = nodes_off + max_nodes * NODE.size
    size = slots_off + nslots * SLOT.size
    gen = int.from_bytes(os.urandom(8), 'little')
    salt = int.from_bytes(os.urandom(8), 'little')
    tmp = path + '.tmp'
    with open(tmp, 'wb') as f:
        f.write(HEADER.pack(MAGIC, version, HEADER.size, NODE.size,
                            SLOT.size, max_nodes, probe, nslots, nodes_off,
                            slots_off, size, gen, KEY_VERSION, block,
                            os.getpid(), 1, now_ms(), salt, b''))
        for i in range(max_nodes):
            if i < len(nodes):
                f.write(NODE.pack(2, NODE_USED | NODE_READY, 1, 0, 0, 0,
                                  ('node%d' % i).encode(),
                                  nodes[i].encode(), b''))
            else:
                f.write(NODE.pack(0, 0, 0, 0, 0, 0, b'', b'', b''))
        f.truncate(size)
    os.rename(tmp, path)


def parse_ids(a):
    if a.ids and a.ids.startswith('@'):
        # @FILE: ids separated by commas or white space (a 32k-token
        # prompt does not fit one command-line argument)
        with open(a.ids[1:]) as f:
            return [int(x) for x in f.read().replace(',', ' ').split()]
    if a.ids:
        return [int(x) for x in a.ids.split(',')]
    out = []
    for part in a.repeat.split('+'):
        tok, count = part.split(':')
        out += [int(tok)] * int(count)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('cmd')
    ap.add_argument('path', nargs='?')
    ap.add_argument('bytes', nargs='?', type=int)
    ap.add_argument('--node', action='append', default=[])
    ap.add_argument('--node-index', type=int, default=0)
    ap.add_argument('--slots', type=int, default=1 << 16)
    ap.add_argument('--block', type=int, default=16)
    ap.add_argument('--probe', type=int, default=16)
    ap.add_argument('--model', default='')
    ap.add_argument('--salt', default='')
    ap.add_argument('--ids')
    ap.add_argument('--repeat')
    ap.add_argument('--lower', action='store_true')
    ap.add_argument('--version', type=int, default=VERSION)
    ap.add_argument('--age', type=int, default=0)
    ap.add_argument('--dead', action='store_true')
    a = ap.parse_args()

    if a.cmd == 'create':
        create(a.path, a.node, a.slots, a.block, a.probe, a.version)
    elif a.cmd == 'beat':
        with open(a.path, 'r+b') as f:
            Index(a.path).beat(f, a.age, not a.dead)
    elif a.cmd in ('store', 'tear'):
        ix = Index(a.path)
        ks = keys(a.model, a.salt, parse_ids(a), ix.block)
        ix.store(ks, a.node_index, a.lower,
                 torn=0 if a.cmd == 'tear' else None)
    elif a.cmd == 'clear-node':
        Index(a.path).clear_node(a.node_index)
    elif a.cmd == 'shrink':
        os.truncate(a.path, a.bytes)
    elif a.cmd == 'tear-header':
        with open(a.path, 'r+b') as f:
            f.write(b'XXXXXXXX')
    elif a.cmd == 'nodes':
        import json
        for n in Index(a.path).nodes():
            print(json.dumps(n, sort_keys=True))
    elif a.cmd == 'keys':
        for k in keys(a.model, a.salt, parse_ids(a), a.block):
            print('%016x' % k)
    else:
        ap.error('unknown command ' + a.cmd)


if __name__ == '__main__':
    sys.exit(main())
