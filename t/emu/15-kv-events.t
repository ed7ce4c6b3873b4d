# vLLM emulator: the KV event publisher (--kv-events-config), decoded
# independently of the emulator's own msgpack encoder: Python msgspec with
# the structs declared as in vLLM's vllm/distributed/kv_events.py (map form:
# @0181ea3173e5 with the batch array-like as vLLM 0.26 sends it, PR #42892;
# typed: vLLM main after 0.26, extra keys as tagged ExtraKey structs and
# event_version; array: the map form's structs with array_like=True, as
# before PR #42892; array0: @b4e69e0af33f, vLLM 0.9's five-field
# BlockStored and [ts, events]).
# Checks BlockStored/BlockRemoved/AllBlocksCleared content, the parent
# chain, cache_salt and LoRA extra keys, seq, replay (PR #45177 framing for
# the map form), dropped batches, a publisher restart and the injected bad
# batches (garbage, unknown types, too many events, too large).
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/../inc";
use Test::More;
use File::Temp qw(tempfile);
use DPD::Emu;

my $venv = $ENV{DPD_VENV} || DPD::Emu::root() . '/.venv';
my $PY = "$venv/bin/python";
plan skip_all => "no Python in $venv (tools/deps.sh)" unless -x $PY;
plan skip_all => 'pyzmq or msgspec missing in the venv '
    . '(tools/python/requirements.txt)'
    if system($PY, '-c', 'import zmq, msgspec') != 0;

my $base = ($ENV{DPD_EMU_PORT} || 19000) + 15;
my %ports = (port => $base, side_channel_port => $base + 100,
             lmcache_init_port => $base + 200,
             lmcache_alloc_port => $base + 300);
my ($pub, $rep) = ($base + 400, $base + 500);

# --- configuration errors: clear, before anything listens ------------------
{
    my $emu = DPD::Emu::emulator();
    for (['{"enable_kv_cache_events":true,"bogus":1}', qr/unknown field.*bogus/],
         ['[1]', qr/expected a JSON object/],
         ['{"enable_kv_cache_events":true,"buffer_steps":0}',
          qr/buffer_steps: expected an integer >= 1/],
         ['{"enable_kv_cache_events":true,"endpoint":"http://x"}',
          qr/endpoint: expected tcp:/]) {
        my ($cfg, $re) = @$_;
        my $out = `$PY $emu --port $base --kv-events-config '$cfg' 2>&1`;
        ok $? != 0 && $out =~ $re, "refused: $cfg" or diag $out;
    }
    # the emulator where pyzmq cannot be imported
    my $nozmq = q{import runpy, sys; sys.modules["zmq"] = None; }
        . q{sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], }
        . q{run_name="__main__")};
    my $out = `$PY -c '$nozmq' $emu --port $base --kv-events-config '{"enable_kv_cache_events":true}' 2>&1`;
    ok $? != 0 && $out =~ /needs pyzmq/, 'without pyzmq: refused, says why'
        or diag $out;
    $out = `$PY $emu --port $base --data-parallel-rank 1 --kv-events-config '{"enable_kv_cache_events":true,"endpoint":"ipc:///tmp/x"}' 2>&1`;
    ok $? != 0 && $out =~ /ipc:\/\/ endpoint cannot be offset/,
        'an ipc endpoint with a data-parallel rank: refused' or diag $out;
}

# --- a data-parallel rank shifts the port and is in every batch -----------
{
    my $cfg = sprintf('{"enable_kv_cache_events":true,'
                      . '"endpoint":"tcp://*:%d"}', $pub);
    my $e = DPD::Emu->start(host => '127.0.0.6', %ports, prefix_caching => 1,
                            python => $PY, time_scale => 0.01,
                            args => ['--kv-events-config', $cfg,
                                     '--data-parallel-rank', 2]);
    my $got = `$PY -c '
import json, sys, time, urllib.request, zmq, msgspec
s = zmq.Context().socket(zmq.SUB)
s.setsockopt(zmq.SUBSCRIBE, b"")
s.connect("tcp://127.0.0.6:%d" % ($pub + 2))
time.sleep(0.5)
urllib.request.urlopen(urllib.request.Request(
    "http://127.0.0.6:$base/v1/completions", headers={"Content-Type":
    "application/json"}, data=json.dumps({"prompt": list(range(100, 140)),
    "max_tokens": 1}).encode())).read()
if s.poll(3000):
    b = msgspec.msgpack.decode(s.recv_multipart()[2])
    print(b[2], b[1][0]["type"])
' 2>&1`;
    is $got, "2 BlockStored\n", 'rank 2: port + 2, data_parallel_rank 2';
    $e->stop;
}

my $script = do { local $/; <DATA> };
my %forms = (map => ['127.0.0.2', 'int'], typed => ['127.0.0.3', 'bytes'],
             array => ['127.0.0.4', 'bytes'], array0 => ['127.0.0.5', 'int']);
for my $form (qw(map typed array array0)) {
    my ($host, $hash) = @{ $forms{$form} };
    my $cfg = sprintf('{"enable_kv_cache_events":true,"endpoint":"tcp://*:%d",'
                      . '"replay_endpoint":"tcp://*:%d","topic":"kv@%s@m",'
                      . '"buffer_steps":50}', $pub, $rep, $host);
    my $e = DPD::Emu->start(host => $host, %ports, prefix_caching => 1,
                            python => $PY, time_scale => 0.01, kv_blocks => 24,
                            args => ['--kv-events-config', $cfg,
                                     '--kv-events-form', $form,
                                     '--kv-events-hash', $hash,
                                     '--lora-modules', 'ad1=/x']);
    my ($fh, $file) = tempfile(SUFFIX => '.py', UNLINK => 1);
    print $fh $script;
    close $fh;
    my @out = `$PY $file $form $hash $host $base $pub $rep 2>&1`;
    my $n = 0;
    for (@out) {
        chomp;
        if (/^(not )?ok - (.*)/) {
            ok !$1, "$form/$hash: $2";
            $n++;
        } else {
            diag $_;
        }
    }
    ok $n > 20, "$form/$hash: the checker ran ($n checks)"
        or diag join "\n", @out;
    $e->stop;
}

done_testing;

__DATA__
import json, sys, time, urllib.request
from typing import Any
import msgspec, zmq

form, hashform, host, port, pub, rep = sys.argv[1:7]
port, pub, rep = int(port), int(pub), int(rep)
ARRAY = form in ("array", "array0")
V0 = form == "array0"
ExternalBlockHash = bytes | int

# --- vllm/distributed/kv_events.py, as declared there ------------------------
if V0:
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True,
                     gc=False):
        ts: float
        events: list[Any]
else:
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True,
                     gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

if ARRAY:
    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True,
                       gc=False, tag=True):
        pass
else:
    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False,
                       tag=True):
        pass

class ExtraKey(msgspec.Struct, gc=False, frozen=True, tag=True):
    pass

class LoRAKey(ExtraKey, frozen=True, tag="lora"):
    name: str

class CacheSaltKey(ExtraKey, frozen=True, tag="cache_salt"):
    salt: str

class PromptEmbedsKey(ExtraKey, frozen=True, tag="prompt_embeds"):
    hash: bytes

class MultiModalKey(ExtraKey, frozen=True, tag="mm"):
    modality: str
    hash: str
    block_offset: int

class LegacyExtraKey(ExtraKey, frozen=True, tag="legacy"):
    value: Any

ExtraKeyUnion = ExtraKey | LoRAKey | CacheSaltKey | PromptEmbedsKey | (
    MultiModalKey | LegacyExtraKey)

if V0:
    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
elif form == "typed":
    class BlockStored(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        event_version: int = 1
        extra_keys: list[tuple[ExtraKeyUnion, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None
else:
    class BlockStored(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        medium: str | None
        group_idx: int | None = None

def ekeys(ev):
    """extra_keys as plain tuples (typed ones flattened as to_tuple())."""
    out = []
    for k in ev.extra_keys or []:
        if k is None:
            out.append(None)
        else:
            out.append(tuple(x if isinstance(x, str) else
                             x.name if isinstance(x, LoRAKey) else
                             x.salt if isinstance(x, CacheSaltKey) else
                             ("?", x) for x in k))
    return out

class AllBlocksCleared(KVCacheEvent):
    pass

class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]

DEC = msgspec.msgpack.Decoder(KVEventBatch)
TOPIC = ("kv@%s@m" % host).encode()
fails = 0

def check(cond, what):
    global fails
    print(("ok - " if cond else "not ok - ") + what, flush=True)
    if not cond:
        fails += 1

def post(path, body):
    r = urllib.request.urlopen(urllib.request.Request(
        "http://%s:%d%s" % (host, port, path),
        data=json.dumps(body).encode() if body is not None else b"",
        headers={"Content-Type": "application/json"}), timeout=20)
    t = r.read()
    return json.loads(t) if t else None

ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
sub.setsockopt(zmq.RECONNECT_IVL, 20)
sub.connect("tcp://%s:%d" % (host, pub))
time.sleep(0.5)                               # the slow joiner

def recv_all(wait=0.5):
    out = []
    while sub.poll(int(wait * 1000)):
        f = sub.recv_multipart()
        wait = 0.2
        out.append(f)
    return out

def decode(frames):
    """(seq, batch) of a (topic, seq, payload) message; checks framing and
    that msgspec re-encodes the decoded batch to the very same bytes."""
    t, s, p = frames
    b = DEC.decode(p)
    same = msgspec.msgpack.encode(b) == p
    return int.from_bytes(s, "big"), b, t, len(s), same

def ids(a, n):
    return list(range(a, a + n))

def completion(prompt, **kw):
    body = {"prompt": prompt, "max_tokens": 1}
    body.update(kw)
    return post("/v1/completions", body)

stored = {}          # hash -> token ids (what a consumer keeps)

def events_of(msgs):
    evs = []
    for f in msgs:
        seq, b, t, slen, same = decode(f)
        evs.append((seq, b))
    return evs

# 1. a 40-token prompt: two full blocks, block 0 without a parent
p1 = ids(1000, 40)
completion(p1)
msgs = recv_all()
check(len(msgs) == 1, "one batch for one request (got %d)" % len(msgs))
seq, b, t, slen, same = decode(msgs[0])
check(t == TOPIC and slen == 8, "frames: topic, 8-byte seq, payload")
check(seq == 0, "first seq is 0")
check(same, "msgspec re-encodes the batch byte for byte")
check(isinstance(b.ts, float) and abs(b.ts - time.time()) < 30
      and (V0 or b.data_parallel_rank == 0), "batch: ts now, dp rank 0")
ev = b.events[0]
check(isinstance(ev, BlockStored), "BlockStored")
check(ev.token_ids == p1[:32] and ev.block_size == 16,
      "token_ids: the two full blocks, block_size 16")
check(len(ev.block_hashes) == 2 and ev.parent_block_hash is None,
      "two hashes, no parent")
want = int if hashform == "int" else bytes
check(all(isinstance(h, want) for h in ev.block_hashes),
      "hashes are %s" % hashform)
if want is bytes:
    check(all(len(h) == 32 for h in ev.block_hashes), "32-byte hashes")
else:
    check(all(0 <= h < 1 << 64 for h in ev.block_hashes), "uint64 hashes")
check(ev.lora_id is None, "no LoRA")
if not V0:
    check(ev.medium == "GPU" and ev.lora_name is None, "medium GPU")
    check(ev.extra_keys == [None, None] and ev.group_idx == 0
          and ev.kv_cache_spec_kind == "full_attention",
          "extra_keys [None, None], group_idx 0, full_attention")
if form == "typed":
    check(ev.event_version == 1 and ev.locality is None, "event_version 1")
h1 = ev.block_hashes
for h, i in zip(h1, range(2)):
    stored[h] = p1[16 * i:16 * i + 16]

# 2. a longer prompt with the same start: hits 2 blocks, stores the next 2
p2 = p1 + ids(5000, 30)
r = completion(p2)
check(r["usage"]["prompt_tokens_details"]["cached_tokens"] == 32,
      "reply: 32 cached")
seq, b, *_ = decode(recv_all()[0])
ev = b.events[0]
check(seq == 1, "seq 1")
check(ev.parent_block_hash == h1[-1] and ev.token_ids == p2[32:64],
      "stored blocks 2-3: parent = block 1's hash, their token ids")
for h, i in zip(ev.block_hashes, range(2, 4)):
    stored[h] = p2[16 * i:16 * i + 16]

# 3. cache_salt changes block 0 and so every later hash
completion(p1, cache_salt="tenant-a")
seq, b, *_ = decode(recv_all()[0])
ev = b.events[0]
if not V0:
    check(ekeys(ev) == [("tenant-a",), None],
          "cache_salt on block 0 only: %r" % (ev.extra_keys,))
if form == "typed":
    check(ev.extra_keys[0] == (CacheSaltKey(salt="tenant-a"),),
          "typed: CacheSaltKey")
check(not set(ev.block_hashes) & set(h1), "salted hashes differ")
for h, i in zip(ev.block_hashes, range(2)):
    stored[h] = p1[16 * i:16 * i + 16]

# 4. LoRA: its name on every block, lora_id from its position
completion(p1, model="ad1")
seq, b, *_ = decode(recv_all()[0])
ev = b.events[0]
check(ev.lora_id == 1 and (V0 or ev.lora_name == "ad1"),
      "lora_name ad1, lora_id 1")
if not V0:
    check(ekeys(ev) == [("ad1",), ("ad1",)], "LoRA name on each block")
if form == "typed":
    check(ev.extra_keys[1] == (LoRAKey(name="ad1"),), "typed: LoRAKey")
for h, i in zip(ev.block_hashes, range(2)):
    stored[h] = p1[16 * i:16 * i + 16]
last_seq = seq

# 5. eviction in a 24-block pool: BlockRemoved names stored hashes
for k in range(4):
    completion(ids(20000 + 1000 * k, 150))
removed, seqs, bad = [], [], 0
for seq, b in events_of(recv_all()):
    seqs.append(seq)
    for ev in b.events:
        if isinstance(ev, BlockStored):
            for h, i in zip(ev.block_hashes, range(len(ev.block_hashes))):
                stored[h] = ev.token_ids[16 * i:16 * i + 16]
        elif isinstance(ev, BlockRemoved):
            bad += len(ev.block_hashes) != 1 or not V0 and (
                ev.medium != "GPU" or ev.group_idx != 0)
            removed += ev.block_hashes
check(bad == 0, "BlockRemoved: one hash each, medium GPU, group 0")
check(seqs == list(range(last_seq + 1, last_seq + 1 + len(seqs))),
      "seq without gaps")
check(len(removed) > 0, "evictions published (%d)" % len(removed))
check(all(h in stored for h in removed),
      "every removed hash was stored before")
check(len(set(removed) & set(h1)) > 0, "the first prompt's blocks evicted")
pc = json.loads(urllib.request.urlopen(
    "http://%s:%d/emu/stats?since=1000000" % (host, port)).read())
check(pc["kv"]["prefix_cache"]["evicted_blocks"] == len(removed),
      "as many BlockRemoved hashes as evictions")
last_seq = seqs[-1]

# 6. /reset_prefix_cache: AllBlocksCleared
post("/reset_prefix_cache", None)
seq, b, *_ = decode(recv_all()[0])
check(seq == last_seq + 1 and len(b.events) == 1
      and isinstance(b.events[0], AllBlocksCleared), "AllBlocksCleared")
last_seq = seq

# 7. dropped batches: a gap in seq, filled from the replay endpoint
post("/emu/kv_events", {"drop": 2})
for k in range(3):
    completion(ids(40000 + 100 * k, 40))
got = [s for s, _ in events_of(recv_all())]
check(got == [last_seq + 3], "two dropped: the subscriber sees %r" % got)
dealer = ctx.socket(zmq.DEALER)
dealer.connect("tcp://%s:%d" % (host, rep))
dealer.send_multipart([b"", (last_seq + 1).to_bytes(8, "big")])
replies = []
while dealer.poll(3000):
    f = dealer.recv_multipart()
    replies.append(f)
    if f[-2] == b"\xff" * 8:
        break
want_len = 4 if not ARRAY else 3        # "", [topic,] seq, payload
check(all(len(f) == want_len for f in replies),
      "replay framing: %d frames" % want_len)
check(replies and replies[-1][-2:] == [b"\xff" * 8, b""],
      "end marker: seq eight 0xFF, empty payload")
if not ARRAY:
    check(all(f[1] == TOPIC for f in replies[:-1]),
          "replies carry the topic (vLLM >= 0.26)")
rseq = [int.from_bytes(f[-2], "big") for f in replies[:-1]]
check(rseq == [last_seq + 1, last_seq + 2, last_seq + 3],
      "replay from the first missing seq: %r" % rseq)
rb = [DEC.decode(f[-1]) for f in replies[:-1]]
check(all(isinstance(x.events[0], BlockStored) for x in rb)
      and rb[0].events[0].token_ids == ids(40000, 32),
      "replayed batches decode: the dropped BlockStored")
dealer.send_multipart([(0).to_bytes(8, "big")])   # no empty delimiter
check(not dealer.poll(300), "a malformed replay request gets no answer")

# 8. publisher restart: seq starts again at 0
post("/emu/kv_events", {"restart": True})
# the subscriber reconnects by itself; a batch sent before it did is lost
# (ZeroMQ's slow joiner), so send until one arrives
got, sent = [], 0
deadline = time.time() + 10
while not got and time.time() < deadline:
    completion(ids(60000 + 100 * sent, 40))
    sent += 1
    got = [s for s, _ in events_of(recv_all(0.3))]
check(got and got[0] < sent and got == list(range(got[0], sent)),
      "after a restart seq starts again from 0 (got %r of %d)" % (got, sent))
dealer.send_multipart([b"", (0).to_bytes(8, "big")])
replies = []
while dealer.poll(3000):
    f = dealer.recv_multipart()
    if f[-2] == b"\xff" * 8:
        break
    replies.append(f)
check([int.from_bytes(f[-2], "big") for f in replies] == list(range(sent))
      and DEC.decode(replies[0][-1]).events[0].token_ids == ids(60000, 32),
      "the replay buffer starts again too: seq 0 is the first batch after")
st = post("/emu/kv_events", {})
check(st["restarts"] == 1 and st["dropped"] == 2, "publisher counters")

# 9. injected bad batches: each in the stream with the next seq, the
# stream going on after it
try:
    post("/emu/kv_events", {"inject": "nonsense"})
    check(False, "an unknown inject kind refused")
except urllib.error.HTTPError as e:
    check(e.code == 400, "an unknown inject kind refused (400)")
nxt = post("/emu/kv_events", {})["next_seq"]
got = {}
for kind in ("garbage", "unknown", "many", "huge"):
    post("/emu/kv_events", {"inject": kind})
    fr = recv_all(2.0)
    got[kind] = fr[0] if fr else None
def raw(kind):
    f = got[kind]
    return (int.from_bytes(f[1], "big"), f[2]) if f else (None, b"")
check([raw(k)[0] for k in ("garbage", "unknown", "many", "huge")]
      == list(range(nxt, nxt + 4)), "injected batches take the next seqs")
try:
    msgspec.msgpack.decode(raw("garbage")[1])
    check(False, "garbage: not msgpack")
except msgspec.DecodeError:
    check(True, "garbage: not msgpack")
u = msgspec.msgpack.decode(raw("unknown")[1])
names = [e["type"] if isinstance(e, dict) else e[0] for e in u[1]]
check(names == ["BlockFrobbed", "KVCacheMoved"],
      "unknown: events of unknown types only (%r)" % names)
check(len(msgspec.msgpack.decode(raw("many")[1])[1]) == 70000,
      "many: 70000 events in one batch")
check(len(raw("huge")[1]) > 16 << 20, "huge: a payload over 16 MiB")
completion(ids(70000, 40))
fr = recv_all()
check(fr and int.from_bytes(fr[0][1], "big") == nxt + 4
      and len(DEC.decode(fr[0][2]).events) >= 1,
      "the stream goes on after them")
sys.exit(1 if fails else 0)
