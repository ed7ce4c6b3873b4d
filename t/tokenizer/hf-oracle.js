// Hugging Face oracle: reads JSONL (one JSON string per line) and writes the
// ids Hugging Face's Rust tokenizers produce, one line per input.
//   node hf-oracle.js TOKENIZER_JSON [--special] < in.jsonl > out.txt
// Lines are read as bytes and decoded lossily (invalid UTF-8 -> U+FFFD, as
// Rust's from_utf8_lossy), then JSON.parse'd: the same text our CLI sees
// after its own replacement.
'use strict';
const fs = require('fs');
const path = require('path');
const npm = process.env.DPD_NPM ||
    path.join(__dirname, '..', '..', 'tools', 'npm', 'node_modules');
const { Tokenizer } = require(path.join(npm, '@anush008', 'tokenizers'));

async function main() {
    const file = process.argv[2];
    const special = process.argv.includes('--special');
    const tok = Tokenizer.fromFile(file);
    const buf = fs.readFileSync(0);
    const text = new TextDecoder('utf-8', { fatal: false }).decode(buf);
    const lines = text.split('\n');
    if (lines.length && lines[lines.length - 1] === '') lines.pop();
    const out = [];
    for (const line of lines) {
        const s = JSON.parse(line);
        const enc = await tok.encode(s, null, { addSpecialTokens: special });
        out.push(Array.from(enc.getIds()).join(' '));
    }
    fs.writeFileSync(1, out.join('\n') + (out.length ? '\n' : ''));
}
main().catch((e) => { console.error(e); process.exit(1); });
