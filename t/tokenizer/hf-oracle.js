// Hugging Face oracle: reads JSONL (one JSON string per line) and writes the
// ids Hugging Face's Rust tokenizers produce, one line per input.
//   node hf-oracle.js TOKENIZER_JSON [--special] [--config CONFIG] < in.jsonl > out.txt
// --config tokenizer_config.json: the post-processor transformers builds
// for LlamaTokenizerFast-class tokenizers (update_post_processor: the
// single template "BOS:0 $A:0 EOS:0" from add_bos_token, default true,
// and add_eos_token, default false) replaces the file's, as when
// transformers (vLLM) loads the model.
// Lines are read as bytes and decoded lossily (invalid UTF-8 -> U+FFFD, as
// Rust's from_utf8_lossy), then JSON.parse'd: the same text our CLI sees
// after its own replacement.
'use strict';
const fs = require('fs');
const path = require('path');
const npm = process.env.DPD_NPM ||
    path.join(__dirname, '..', '..', 'tools', 'npm', 'node_modules');
const { Tokenizer, templateProcessing } =
    require(path.join(npm, '@anush008', 'tokenizers'));

async function main() {
    const file = process.argv[2];
    const special = process.argv.includes('--special');
    const tok = Tokenizer.fromFile(file);
    const ci = process.argv.indexOf('--config');
    if (ci > 0) {
        const cfg = JSON.parse(fs.readFileSync(process.argv[ci + 1], 'utf8'));
        const llama = ['LlamaTokenizer', 'CodeLlamaTokenizer', 'GemmaTokenizer'];
        const cls = (cfg.tokenizer_class || '').replace(/Fast$/, '');
        if (llama.includes(cls)) {
            const str = (t) => (t && typeof t === 'object') ? t.content : t;
            const bos = str(cfg.bos_token), eos = str(cfg.eos_token);
            const addBos = cfg.add_bos_token === undefined ? true : cfg.add_bos_token;
            const addEos = cfg.add_eos_token === undefined ? false : cfg.add_eos_token;
            const single = `${addBos ? bos + ':0 ' : ''}$A:0${addEos ? ' ' + eos + ':0' : ''}`;
            const pair = `${single}${addBos ? ' ' + bos + ':1' : ''} $B:1${addEos ? ' ' + eos + ':1' : ''}`;
            const specials = [];
            if (addBos) specials.push([bos, tok.tokenToId(bos)]);
            if (addEos) specials.push([eos, tok.tokenToId(eos)]);
            tok.setPostProcessor(templateProcessing(single, pair, specials));
        }
    }
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
