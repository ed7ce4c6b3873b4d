#!/usr/bin/env python3
"""vLLM KV-event payloads and publishers for t/kv_agent/80-kv-events.t.

Built with msgspec (what vLLM encodes with), the Structs declared as in
vLLM's vllm/distributed/kv_events.py - independently of any encoder of
this project:
  current   @0181ea3173e53eea8cf04a86891488e3dc89bb34: events are maps
            (tag=True, no array_like; vLLM PR #42892, >= 0.26), the batch
            array_like [ts, events, data_parallel_rank];
  old       @b4e69e0af33f4698e157a262cc787fe61983cd3d: everything
            array_like, batch [ts, events], BlockStored up to lora_id;
  mid       the array_like events with medium/lora_name/extra_keys/
            group_idx/kv_cache_spec_* (declaration order as current).
The publisher is ZmqEventPublisher's wire protocol (PUB frames topic,
seq 8B big-endian, payload; ROUTER replay answering [id, "", seq,
payload] per buffered batch then [id, "", 0xFF*8, ""]; with --replay-topic
[id, "", topic, seq, payload], as TensorRT-LLM's vLLM-compatible one).

  kvevents.py cases OUTDIR        payload files + OUTDIR/expected.json
  kvevents.py pub --pub EP [--replay EP] [--topic T] --script FILE
"""

import json
import os
import sys
import time
from typing import Any, Optional, Union

import msgspec


# ---- current vLLM (map events) --------------------------------------------

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True,
                 gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class EventBatchMap(msgspec.Struct, omit_defaults=True, gc=False):
    # EventBatch as declared at 0181ea31 (no array_like): a map
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


ExternalBlockHash = Union[bytes, int]


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class BlockStoredLoc(KVCacheEvent, tag="BlockStored"):
    # with the newer locality field (Dynamo's types.rs)
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class SomethingNew(KVCacheEvent):
    block_hashes: list[int]
    note: str


# ---- array_like events (older vLLM) ----------------------------------------

class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True,
               gc=False):
    ts: float
    events: list[Any]


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True,
               gc=False, tag=True):
    pass


class OldBlockStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]


class OldBlockRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class OldAllBlocksCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class MidBlockStored(OldEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class MidBlockRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None


ENC = msgspec.msgpack.Encoder()


def toks(n, base=1000):
    return [base + i for i in range(n)]


def h_int(v):
    return str(v & (2 ** 64 - 1))


def h_bytes(b):
    return "hex:" + b.hex()


def id_bytes(b):
    return str(int.from_bytes(b[-8:], "big"))


def exp_stored(hashes, ids, parent, tokens, bs, medium=None, tier="gpu",
               lora_name=None, lora_id=-1, group=-1, kind=None, dp=-1,
               extra=None):
    # extra_keys: the bytes msgspec encodes for that list, as hex
    return {"event": "stored", "hashes": hashes, "ids": ids,
            "parent": parent, "tokens": tokens, "block_size": bs,
            "tier": tier, "medium": medium, "lora_name": lora_name,
            "lora_id": lora_id, "group_idx": group, "spec_kind": kind,
            "dp_rank": dp, "extra_keys": None if extra is None
            else "hex:" + ENC.encode(extra).hex()}


def exp_removed(hashes, ids, medium=None, tier="gpu", group=-1, dp=-1):
    return {"event": "removed", "hashes": hashes, "ids": ids,
            "tier": tier, "medium": medium, "group_idx": group,
            "dp_rank": dp}


def cases():
    """(name, payload bytes, expected events, expected stats deltas)"""
    out = []
    big = 2 ** 64 - 5                  # > int64: msgpack uint64
    d32 = bytes(range(1, 33))          # a sha256-sized digest
    d16 = bytes(range(100, 116))

    # 1. current vLLM: map events, int hashes, 3-element batch
    ev = [BlockStored(block_hashes=[big, 7], parent_block_hash=None,
                      token_ids=toks(32), block_size=16, lora_id=None,
                      medium="GPU", lora_name=None, extra_keys=[None, None],
                      group_idx=0, kv_cache_spec_kind="full_attention"),
          BlockStored(block_hashes=[9], parent_block_hash=7,
                      token_ids=toks(16, 5000), block_size=16, lora_id=3,
                      medium="CPU", lora_name="adapter-a",
                      extra_keys=[("adapter-a", "salt")]),
          BlockRemoved(block_hashes=[big], medium="GPU", group_idx=0),
          AllBlocksCleared()]
    out.append(("map_int", ENC.encode(EventBatch(ts=1.5, events=ev,
                                                 data_parallel_rank=2)), [
        exp_stored([h_int(big), "7"], [h_int(big), "7"], None, toks(32),
                   16, "GPU", group=0, kind="full_attention", dp=2,
                   extra=[None, None]),
        exp_stored(["9"], ["9"], "7", toks(16, 5000), 16, "CPU", "lower",
                   "adapter-a", 3, dp=2, extra=[("adapter-a", "salt")]),
        exp_removed([h_int(big)], [h_int(big)], "GPU", group=0, dp=2),
        {"event": "cleared", "why": "engine", "dp_rank": 2}]))

    # 2. current vLLM, bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
    ev = [BlockStored(block_hashes=[d32, d16], parent_block_hash=d16,
                      token_ids=toks(8), block_size=4, lora_id=None,
                      medium=None, lora_name=None),
          BlockRemoved(block_hashes=[d32], medium=None)]
    out.append(("map_bytes", ENC.encode(EventBatch(ts=2.0, events=ev,
                                                   data_parallel_rank=0)), [
        exp_stored([h_bytes(d32), h_bytes(d16)], [id_bytes(d32),
                   id_bytes(d16)], h_bytes(d16), toks(8), 4, dp=0),
        exp_removed([h_bytes(d32)], [id_bytes(d32)], dp=0)]))

    # 3. old vLLM: array events, 2-element batch
    ev = [OldBlockStored(block_hashes=[11, 12], parent_block_hash=None,
                         token_ids=toks(4), block_size=2, lora_id=None),
          OldBlockRemoved(block_hashes=[11]),
          OldAllBlocksCleared()]
    out.append(("array_old", ENC.encode(OldBatch(ts=3.0, events=ev)), [
        exp_stored(["11", "12"], ["11", "12"], None, toks(4), 2),
        exp_removed(["11"], ["11"]),
        {"event": "cleared", "why": "engine", "dp_rank": -1}]))

    # 4. array events with every field (bytes hashes), 3-element batch
    ev = [MidBlockStored(block_hashes=[d32], parent_block_hash=big,
                         token_ids=toks(16), block_size=16, lora_id=None,
                         medium="GPU", lora_name="lora-x",
                         extra_keys=[("lora-x",)], group_idx=1,
                         kv_cache_spec_kind="sliding_window",
                         kv_cache_spec_sliding_window=4096),
          MidBlockRemoved(block_hashes=[d32], medium="CPU", group_idx=1)]
    out.append(("array_mid", ENC.encode(EventBatch(ts=4.0, events=ev,
                                                   data_parallel_rank=1)), [
        exp_stored([h_bytes(d32)], [id_bytes(d32)], h_int(big), toks(16),
                   16, "GPU", lora_name="lora-x", group=1,
                   kind="sliding_window", dp=1, extra=[("lora-x",)]),
        exp_removed([h_bytes(d32)], [id_bytes(d32)], "CPU", "lower",
                    group=1, dp=1)]))

    # 5. a batch as a map (EventBatch without array_like), signed hashes
    raw = ENC.encode(EventBatchMap(ts=5.0, events=[
        BlockStored(block_hashes=[-2, 5], parent_block_hash=-3,
                    token_ids=toks(2), block_size=1, lora_id=None,
                    medium="GPU", lora_name=None)], data_parallel_rank=4))
    out.append(("batch_map", raw, [
        exp_stored([h_int(-2), "5"], [h_int(-2), "5"], h_int(-3), toks(2),
                   1, "GPU", dp=4)]))

    # 6. unknown types, unknown keys, non-LOCAL locality: ignored
    ev = [SomethingNew(block_hashes=[1], note="x"),
          {"type": "BlockStored", "block_hashes": [21],
           "parent_block_hash": None, "token_ids": [1, 2], "block_size": 2,
           "lora_id": None, "medium": "GPU", "lora_name": None,
           "brand_new_field": {"deep": [1, [2, [3]]]},
           "another": b"\x00\x01"},
          BlockStoredLoc(block_hashes=[22], parent_block_hash=None,
                         token_ids=[3, 4], block_size=2, lora_id=None,
                         medium="GPU", lora_name=None, locality="REMOTE"),
          BlockStoredLoc(block_hashes=[23], parent_block_hash=None,
                         token_ids=[5, 6], block_size=2, lora_id=None,
                         medium="GPU", lora_name=None, locality="LOCAL"),
          ["SomeOldThing", 1, 2, 3]]
    out.append(("unknown", ENC.encode(EventBatch(ts=6.0, events=ev)), [
        exp_stored(["21"], ["21"], None, [1, 2], 2, "GPU"),
        exp_stored(["23"], ["23"], None, [5, 6], 2, "GPU")]))

    # 7. wrong types and lies: each refused alone, the good ones kept
    good = {"type": "BlockRemoved", "block_hashes": [31], "medium": "GPU"}
    ev = [good,
          {"type": "BlockStored", "block_hashes": [1, 2],
           "parent_block_hash": None, "token_ids": [1, 2, 3],
           "block_size": 2},                         # 3 tokens, 2 blocks
          {"type": "BlockStored", "block_hashes": "nope",
           "token_ids": [], "block_size": 2},        # hashes not a list
          {"type": "BlockStored", "block_hashes": [1],
           "token_ids": [-1, 2], "block_size": 2},   # negative token
          {"type": "BlockStored", "block_hashes": [1],
           "token_ids": [1, 2], "block_size": 0},    # block size 0
          {"type": "BlockRemoved", "block_hashes": [b""]},   # empty hash
          {"type": "BlockRemoved", "block_hashes": [b"x" * 65]},  # > 64
          {"type": "BlockRemoved", "block_hashes": [1.5]},   # float hash
          {"type": "BlockRemoved", "block_hashes": [1],
           "medium": "G\x00PU"},                     # NUL in a string
          {"type": "BlockStored", "block_hashes": [1], "token_ids": [1],
           "block_size": 1, "lora_name": 7},         # name not a string
          {"type": "BlockStored", "block_hashes": [1], "token_ids": [1],
           "block_size": 1, "extra_keys": "x"},      # not a list
          {"block_hashes": [1]},                     # no type
          {"type": 5},                               # type not a string
          42,                                        # not an event
          [],                                        # empty array
          ["BlockStored", [1], None],                # array too short
          good]
    out.append(("wrong", ENC.encode(EventBatch(ts=7.0, events=ev)), [
        exp_removed(["31"], ["31"], "GPU"),
        exp_removed(["31"], ["31"], "GPU")]))

    # 8. a repeated key (msgpack allows it; built by hand): refused
    rep = (b"\x92\xcb" + msgspec.msgpack.encode(8.0)[1:] + b"\x91"
           + b"\x83" + msgspec.msgpack.encode("type")
           + msgspec.msgpack.encode("BlockRemoved")
           + msgspec.msgpack.encode("block_hashes")
           + msgspec.msgpack.encode([1])
           + msgspec.msgpack.encode("block_hashes")
           + msgspec.msgpack.encode([2]))
    out.append(("repeated_key", rep, []))
    return out


def refused_cases():
    """payloads refused whole: (name, bytes)"""
    ok = ENC.encode(EventBatch(ts=1.0, events=[AllBlocksCleared()]))
    deep = b"\x91" * 100 + b"\xc0"
    return [
        ("truncated", ok[:-1]),
        ("trailing", ok + b"\x00"),
        ("not_batch", msgspec.msgpack.encode("hello")),
        ("short_batch", msgspec.msgpack.encode([1.0])),
        ("ts_string", msgspec.msgpack.encode(["x", []])),
        ("events_map", msgspec.msgpack.encode([1.0, {"a": 1}])),
        ("deep", b"\x92\xcb" + bytes(8) + deep),
        ("lying_array", b"\x92\xcb" + bytes(8) + b"\xdd\xff\xff\xff\xff"),
        ("lying_str", b"\x92\xcb" + bytes(8) + b"\x91\xdb\xff\xff\xff\xf0"),
        ("reserved_c1", b"\x92\xcb" + bytes(8) + b"\x91\xc1"),
        ("empty", b""),
    ]


def huge_cases():
    """over the decoder's bounds"""
    many = EventBatch(ts=1.0, events=[AllBlocksCleared()] * 65537)
    blocks = EventBatch(ts=1.0, events=[BlockRemoved(
        block_hashes=list(range(65537)), medium=None)])
    return [("too_many_events", ENC.encode(many)),
            ("too_many_blocks", ENC.encode(blocks))]


def write_cases(outdir):
    exp = {"cases": [], "refused": [], "huge": []}
    for name, raw, events in cases():
        with open(os.path.join(outdir, name + ".mp"), "wb") as f:
            f.write(raw)
        exp["cases"].append({"name": name, "events": events})
    for name, raw in refused_cases():
        with open(os.path.join(outdir, name + ".mp"), "wb") as f:
            f.write(raw)
        exp["refused"].append(name)
    for name, raw in huge_cases():
        with open(os.path.join(outdir, name + ".mp"), "wb") as f:
            f.write(raw)
        exp["huge"].append(name)
    with open(os.path.join(outdir, "expected.json"), "w") as f:
        json.dump(exp, f)


# ---- publisher ---------------------------------------------------------------

def stored_batch(seq, dp=0):
    """one recognisable BlockStored per seq: hash 1000+seq"""
    return ENC.encode(EventBatch(ts=float(seq), events=[BlockStored(
        block_hashes=[1000 + seq], parent_block_hash=None,
        token_ids=[seq, seq + 1], block_size=2, lora_id=None, medium="GPU",
        lora_name=None)], data_parallel_rank=dp))


def publish(args):
    import zmq
    pub_ep = args[args.index("--pub") + 1]
    replay_ep = args[args.index("--replay") + 1] if "--replay" in args \
        else None
    topic = (args[args.index("--topic") + 1] if "--topic" in args
             else "").encode()
    replay_topic = "--replay-topic" in args
    script = json.load(open(args[args.index("--script") + 1]))
    ctx = zmq.Context()
    # XPUB: PUB on the wire (the same frames reach the subscriber), and it
    # sees the subscription arrive, so nothing is sent before anyone
    # listens (ZeroMQ's slow joiner) however slow the subscriber starts
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 1000)
    pub.bind(pub_ep)
    if pub.poll(20000):
        pub.recv()
    router = None
    if replay_ep:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 1000)
        router.bind(replay_ep)
    buf = []                           # (seq, payload), as vLLM's deque
    replay_mute = False

    def service(timeout_ms):
        end = time.time() + timeout_ms / 1000.0
        while True:
            left = max(0, int((end - time.time()) * 1000))
            if router is None:
                time.sleep(left / 1000.0)
                return
            if not router.poll(left):
                return
            frame = router.recv_multipart()
            if len(frame) != 3 or replay_mute:
                continue
            cid, _, start = frame
            start = int.from_bytes(start, "big")
            for s, p in buf:
                if s >= start:
                    if replay_topic:
                        router.send_multipart((cid, b"", topic,
                                               s.to_bytes(8, "big"), p))
                    else:
                        router.send_multipart((cid, b"",
                                               s.to_bytes(8, "big"), p))
            end_seq = (-1).to_bytes(8, "big", signed=True)
            if replay_topic:
                router.send_multipart((cid, b"", b"", end_seq, b""))
            else:
                router.send_multipart((cid, b"", end_seq, b""))

    for step in script:
        op = step[0]
        if op == "sleep":
            service(step[1])
        elif op == "send":             # ["send", seq, publish?]
            seq = step[1]
            payload = stored_batch(seq)
            buf.append((seq, payload))
            buf[:] = buf[-10000:]
            if len(step) < 3 or step[2]:
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
        elif op == "raw":              # ["raw", [hex frames]]
            pub.send_multipart([bytes.fromhex(x) for x in step[1]])
        elif op == "big":              # ["big", seq, bytes]: a huge frame
            seq = step[1]
            payload = b"\xdb" + step[2].to_bytes(4, "big") + b"a" * step[2]
            pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
        elif op == "forget":           # the buffer rolled over
            buf[:] = [x for x in buf if x[0] >= step[1]]
        elif op == "mute":             # replay never answers
            replay_mute = True
        elif op == "restart":          # a new process: empty buffer
            buf.clear()
    service(200)
    print("publisher done", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "cases":
        write_cases(sys.argv[2])
    elif sys.argv[1] == "pub":
        publish(sys.argv[2:])
    else:
        sys.exit("usage: kvevents.py cases DIR | pub ...")
