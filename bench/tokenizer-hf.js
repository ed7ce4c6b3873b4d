// Hugging Face side of bench/tokenizer.sh: the Rust tokenizers through the
// Node binding (npm @anush008/tokenizers), on a JSONL corpus.
//   node tokenizer-hf.js TOKENIZER_JSON CORPUS_JSONL [SECONDS]
// Two ways, each run for at least SECONDS: encode() one text at a time
// (awaited in turn: the per-request pattern a gateway has) and
// encodeBatch() over the whole corpus (amortises the binding's per-call
// cost; Rust may use several threads here unless pinned with taskset).
'use strict';
const fs = require('fs');
const path = require('path');
const npm = process.env.DPD_NPM ||
    path.join(__dirname, '..', 'tools', 'npm', 'node_modules');
const { Tokenizer } = require(path.join(npm, '@anush008', 'tokenizers'));

async function main() {
    const [file, corpus, secsArg] = process.argv.slice(2);
    const secs = Number(secsArg || 3);
    let t0 = process.hrtime.bigint();
    const tok = Tokenizer.fromFile(file);
    let t1 = process.hrtime.bigint();
    console.log('hf.load_ms ' + (Number(t1 - t0) / 1e6).toFixed(1));
    console.log('hf.rss_after_load_mb ' + (process.memoryUsage().rss / 1048576).toFixed(1));
    const texts = fs.readFileSync(corpus, 'utf8').split('\n').filter((l) => l.length)
        .map((l) => JSON.parse(l));
    const bytes = texts.reduce((a, s) => a + Buffer.byteLength(s, 'utf8'), 0);
    let tokens = 0;
    for (const s of texts) tokens += (await tok.encode(s, null, { addSpecialTokens: false })).getIds().length;
    console.log('hf.corpus.bytes ' + bytes + '\nhf.corpus.tokens ' + tokens);

    let reps = 0;
    t0 = process.hrtime.bigint();
    do {
        for (const s of texts) await tok.encode(s, null, { addSpecialTokens: false });
        reps++;
        t1 = process.hrtime.bigint();
    } while (Number(t1 - t0) / 1e9 < secs);
    let dt = Number(t1 - t0) / 1e9;
    console.log('hf.encode.mb_per_s ' + (bytes * reps / dt / 1e6).toFixed(2));
    console.log('hf.encode.tokens_per_s ' + (tokens * reps / dt).toFixed(0));

    reps = 0;
    t0 = process.hrtime.bigint();
    do {
        await tok.encodeBatch(texts, { addSpecialTokens: false });
        reps++;
        t1 = process.hrtime.bigint();
    } while (Number(t1 - t0) / 1e9 < secs);
    dt = Number(t1 - t0) / 1e9;
    console.log('hf.batch.mb_per_s ' + (bytes * reps / dt / 1e6).toFixed(2));
    console.log('hf.batch.tokens_per_s ' + (tokens * reps / dt).toFixed(0));
}
main().catch((e) => { console.error(e); process.exit(1); });
