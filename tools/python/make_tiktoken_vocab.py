#!/usr/bin/env python3
"""Write o200k_base.tiktoken from the gpt-oss tokenizer.json.

openai-harmony (the library vLLM renders gpt-oss with) loads its vocab
from a tiktoken file: downloaded, or read from $TIKTOKEN_ENCODINGS_BASE/
o200k_base.tiktoken, and in that case checked against the SHA-256 of the
published file (openai/harmony src/tiktoken_ext/public_encodings.rs,
Encoding::load and load_tiktoken_vocab, v0.0.8 ec7606df).  That file is
one line per ordinary token, ordered by rank: base64 of the token's bytes,
a space, the rank, "\n".  gpt-oss's tokenizer.json holds the same vocab
as byte-level BPE: each byte of a token is shown as one unicode character
(GPT-2's bytes_to_unicode), so the token's bytes are recovered by mapping
each character back.  harmony's hash check then proves the conversion
exact, byte for byte.

usage: make_tiktoken_vocab.py TOKENIZER_JSON OUT_DIR
"""

import base64
import hashlib
import json
import os
import sys

# openai/harmony public_encodings.rs Encoding::expected_hash, O200kHarmony
O200K_SHA256 = \
    "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


def unicode_to_bytes():
    """The inverse of GPT-2's bytes_to_unicode: printable Latin-1 bytes
    stand for themselves, the other 68 bytes for U+0100 onwards, in byte
    order."""
    keep = (list(range(ord("!"), ord("~") + 1))
            + list(range(ord("\u00a1"), ord("\u00ac") + 1))
            + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    table = {}
    n = 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table


def main(argv):
    if len(argv) != 3:
        sys.stderr.write("usage: make_tiktoken_vocab.py TOKENIZER_JSON "
                         "OUT_DIR\n")
        return 2
    with open(argv[1], encoding="utf-8") as f:
        tok = json.load(f)
    model = tok.get("model", {})
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        sys.stderr.write("%s: not a BPE tokenizer.json\n" % argv[1])
        return 1
    u2b = unicode_to_bytes()
    ranks = {}
    for piece, rank in model["vocab"].items():
        try:
            raw = bytes(u2b[c] for c in piece)
        except KeyError as e:
            sys.stderr.write("%s: token %r (rank %d) has a character "
                             "outside the byte-level alphabet: %r\n"
                             % (argv[1], piece, rank, e.args[0]))
            return 1
        if rank in ranks:
            sys.stderr.write("%s: rank %d twice\n" % (argv[1], rank))
            return 1
        ranks[rank] = raw
    if sorted(ranks) != list(range(len(ranks))):
        sys.stderr.write("%s: ranks are not 0..%d without gaps\n"
                         % (argv[1], len(ranks) - 1))
        return 1
    lines = b"".join(base64.b64encode(ranks[r]) + b" %d\n" % r
                     for r in range(len(ranks)))
    digest = hashlib.sha256(lines).hexdigest()
    os.makedirs(argv[2], exist_ok=True)
    out = os.path.join(argv[2], "o200k_base.tiktoken")
    tmp = out + ".tmp.%d" % os.getpid()
    with open(tmp, "wb") as f:
        f.write(lines)
    os.replace(tmp, out)
    print("%s: %d tokens, sha256 %s (%s)"
          % (out, len(ranks), digest,
             "= harmony's" if digest == O200K_SHA256 else "NOT harmony's"))
    return 0 if digest == O200K_SHA256 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
