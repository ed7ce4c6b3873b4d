// DPD demo client: sends a mix of short and long streaming chat requests
// through nginx with the official `openai` npm client and measures, per
// request, the route nginx chose, prompt tokens (nginx's count and the
// server's usage), time to first token and the inter-token gaps.
//
//   node client.mjs run --base-url URL --label NAME --out FILE.json
//                       [--access-log FILE] [--short N] [--long N]
//                       [--long-words N] [--max-tokens N] [--seed N]
//   node client.mjs compare A.json B.json [C.json ...]
//   node client.mjs chat --base-url URL [--label NAME] [--turns N]
//                        [--doc-words N] [--max-tokens N] [--seed N]
//
// The workload is deterministic for a given seed, so the runs (co-located,
// disaggregated over NIXL, over kv_agent) see the same requests at the same
// offsets.  compare prints one row per run and the first two side by side.

import { createRequire } from 'node:module';
import { readFileSync, writeFileSync, existsSync } from 'node:fs';
import { performance } from 'node:perf_hooks';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const npmDir = process.env.DPD_NPM
    || path.join(here, '..', 'npm', 'node_modules');
const require = createRequire(path.join(npmDir, 'noop.js'));

function parseArgs(argv) {
    const opts = { _: [] };
    for (let i = 0; i < argv.length; i++) {
        const a = argv[i];
        if (a.startsWith('--')) {
            opts[a.slice(2)] = argv[i + 1];
            i++;
        } else {
            opts._.push(a);
        }
    }
    return opts;
}

// --- deterministic workload -------------------------------------------

function rng(seed) {
    let s = seed >>> 0;
    return () => {
        s = (s * 1664525 + 1013904223) >>> 0;
        return s / 4294967296;
    };
}

const WORDS = ('the a of to and in is that for on with as by at from it this '
    + 'gateway prefill decode cluster token cache latency throughput request '
    + 'stream model memory network transfer batch scheduler kernel pod node '
    + 'replica shard tensor layer attention vector context window budget '
    + 'queue worker upstream balance route threshold metric histogram '
    + 'engineer operator deploy region zone failure retry timeout health '
    + 'report quarterly revenue customer contract policy review summary '
    + 'river mountain harbor village market winter garden library bridge')
    .split(' ');

function sentence(r, n) {
    const w = [];
    for (let i = 0; i < n; i++) {
        w.push(WORDS[Math.floor(r() * WORDS.length)]);
    }
    w[0] = w[0][0].toUpperCase() + w[0].slice(1);
    return w.join(' ') + '.';
}

function paragraph(r, words) {
    const s = [];
    let left = words;
    while (left > 0) {
        const n = Math.min(left, 8 + Math.floor(r() * 12));
        s.push(sentence(r, n));
        left -= n;
    }
    return s.join(' ');
}

function workload(o) {
    const r = rng(o.seed);
    const reqs = [];
    // short interactive requests arrive steadily over the whole window
    for (let i = 0; i < o.short; i++) {
        reqs.push({
            kind: 'short',
            at: 150 * i,
            maxTokens: o.maxTokens,
            messages: [
                { role: 'system', content: 'You are a helpful assistant.' },
                { role: 'user', content: 'Question: '
                    + paragraph(r, 30 + Math.floor(r() * 120)) },
            ],
        });
    }
    // long-document requests land while the short ones are decoding
    for (let i = 0; i < o.long; i++) {
        const words = o.longWords + Math.floor(r() * o.longWords / 4);
        const doc = [];
        for (let left = words; left > 0; left -= 200) {
            doc.push(paragraph(r, Math.min(200, left)));
        }
        reqs.push({
            kind: 'long',
            at: 250 + 450 * i,
            maxTokens: 16,
            messages: [
                { role: 'system', content: 'You summarize documents.' },
                { role: 'user', content: 'Summarize this document:\n\n'
                    + doc.join('\n\n') },
            ],
        });
    }
    reqs.sort((a, b) => a.at - b.at);
    reqs.forEach((q, i) => { q.id = i + 1; });
    return reqs;
}

// --- measurement --------------------------------------------------------

function pct(values, p) {
    if (!values.length) return NaN;
    const v = [...values].sort((a, b) => a - b);
    const k = Math.min(v.length - 1, Math.ceil(p / 100 * v.length) - 1);
    return v[Math.max(0, k)];
}

function mean(values) {
    if (!values.length) return NaN;
    return values.reduce((a, b) => a + b, 0) / values.length;
}

function ms(x, w = 6) {
    return Number.isFinite(x) ? x.toFixed(1).padStart(w) : '-'.padStart(w);
}

async function one(client, q, label, runId) {
    const reqId = `demo-${runId}-${label}-${String(q.id).padStart(2, '0')}`;
    const res = { id: q.id, kind: q.kind, requestId: reqId, gaps: [] };
    const t0 = performance.now();
    try {
        const { data: stream, response } = await client.chat.completions
            .create({
                model: 'emu-model',
                messages: q.messages,
                max_tokens: q.maxTokens,
                stream: true,
                stream_options: { include_usage: true },
            }, { headers: { 'X-Request-Id': reqId } })
            .withResponse();
        res.route = response.headers.get('x-dpd-route') || undefined;
        res.nginxTokens = response.headers.get('x-dpd-prompt-tokens')
            || undefined;
        const h = (name) => response.headers.get(name) || undefined;
        // kv_agent run: $dpd_decode_peer (empty when direct), then
        // $upstream_addr
        res.decodePeer = h('x-dpd-decode-peer') || h('x-dpd-upstream');
        res.kvWaitMs = h('x-dpd-kv-wait-ms');
        res.kvState = h('x-dpd-kv-state');
        res.prefillPeer = h('x-dpd-prefill-peer');
        res.prefillMs = h('x-dpd-prefill-ms');
        res.decisionUs = h('x-dpd-decision-us');
        let last = null;
        let tokens = 0;
        for await (const chunk of stream) {
            const now = performance.now();
            if (chunk.usage) {
                res.usagePrompt = chunk.usage.prompt_tokens;
                res.usageCompletion = chunk.usage.completion_tokens;
                const d = chunk.usage.prompt_tokens_details;
                if (d && d.cached_tokens !== undefined) {
                    res.cachedTokens = d.cached_tokens;
                }
            }
            const delta = chunk.choices && chunk.choices[0]
                && chunk.choices[0].delta;
            if (!delta || !delta.content) continue;
            tokens++;
            if (last === null) {
                res.ttft = now - t0;
            } else {
                res.gaps.push(now - last);
            }
            last = now;
        }
        res.tokens = tokens;
    } catch (e) {
        res.error = (e && (e.status ? `HTTP ${e.status}: ` : '')
            + (e.message || String(e))).slice(0, 160);
    }
    res.total = performance.now() - t0;
    return res;
}

// nginx's access log line for a request id (demo log_format: key=value)
function fromAccessLog(file, reqId) {
    if (!file || !existsSync(file)) return {};
    for (const line of readFileSync(file, 'utf8').split('\n')) {
        if (!line.includes(`rid=${reqId} `)) continue;
        const kv = {};
        for (const m of line.matchAll(/(\w+)=(\S*)/g)) kv[m[1]] = m[2];
        return kv;
    }
    return {};
}

function line(label, r) {
    const head = `[${label}] #${String(r.id).padStart(2, '0')}`
        + ` ${r.kind.padEnd(5)}`;
    // observe mode: the decision is logged, the request still goes direct
    let route = r.route || '?';
    if (route === 'disaggregated' && !r.prefillPeer) route += '*';
    route = route.padEnd(14);
    const tok = String(r.nginxTokens ?? '?').padStart(5);
    if (r.error) {
        return `${head} ${route} prompt ${tok} tok  ERROR ${r.error}`;
    }
    const usage = String(r.usagePrompt ?? '?').padStart(5);
    // KV reused by the decoder (from the prefill pod), where reported
    const cached = r.cachedTokens ? `, ${r.cachedTokens} cached` : '';
    const dec = r.decisionUs !== undefined ? ` in ${r.decisionUs}us` : '';
    let where = r.decodePeer ? `decode ${r.decodePeer}` : '';
    if (r.prefillPeer) {
        // kv_agent: how long nginx waited for the table to say "ready"
        const kv = r.kvWaitMs !== undefined
            ? ` kv wait ${r.kvWaitMs}ms${r.kvState && r.kvState !== 'none'
                ? ` (${r.kvState})` : ''}`
            : '';
        where = `prefill ${r.prefillPeer} ${r.prefillMs ?? '?'}ms${kv} -> `
            + where;
    }
    return `${head} ${route} prompt ${tok} tok${dec} (server ${usage}${cached})`
        + `  ttft ${ms(r.ttft, 6)}ms`
        + `  gap mean ${ms(r.gaps.length ? mean(r.gaps) : NaN, 5)}`
        + ` p99 ${ms(pct(r.gaps, 99), 5)}ms`
        + `  ${where}`;
}

function summarize(label, results) {
    const out = {};
    for (const kind of ['short', 'long']) {
        const rs = results.filter(r => r.kind === kind && !r.error);
        const gaps = rs.flatMap(r => r.gaps);
        out[kind] = {
            n: rs.length,
            cached: rs.reduce((a, r) => a + (r.cachedTokens || 0), 0),
            prompt: rs.reduce((a, r) => a + (r.usagePrompt || 0), 0),
            kvWait: mean(rs.filter(r => r.kvWaitMs !== undefined
                                        && r.kvWaitMs !== '')
                           .map(r => Number(r.kvWaitMs))),
            ttftMean: mean(rs.map(r => r.ttft)),
            ttftP99: pct(rs.map(r => r.ttft), 99),
            gapMean: mean(gaps),
            gapP99: pct(gaps, 99),
        };
    }
    out.errors = results.filter(r => r.error).length;
    if (results.some(r => r.route === 'disaggregated' && !r.prefillPeer
                          && !r.error)) {
        console.log(`[${label}] * decision only: no prefill pool here, `
            + 'the request went straight to a decoder');
    }
    console.log(`[${label}] summary: short n=${out.short.n}`
        + ` gap mean=${ms(out.short.gapMean)}ms p99=${ms(out.short.gapP99)}ms`
        + ` ttft mean=${ms(out.short.ttftMean)}ms;`
        + ` long n=${out.long.n} ttft mean=${ms(out.long.ttftMean)}ms`
        + ` p99=${ms(out.long.ttftP99)}ms; errors=${out.errors}`);
    return out;
}

async function run(o) {
    const OpenAI = require('openai');
    const client = new OpenAI({
        baseURL: o['base-url'],
        apiKey: 'dpd-demo',
        maxRetries: 0,
        timeout: 120 * 1000,
    });
    const label = o.label || 'demo';
    const reqs = workload({
        seed: Number(o.seed || 7),
        short: Number(o.short || 10),
        long: Number(o.long || 4),
        longWords: Number(o['long-words'] || 5200),
        maxTokens: Number(o['max-tokens'] || 48),
    });
    const runId = Date.now().toString(36);
    const start = performance.now();
    const results = await Promise.all(reqs.map(q => new Promise(resolve => {
        const wait = Math.max(0, q.at - (performance.now() - start));
        setTimeout(() => one(client, q, label, runId).then(r => {
            // fill what the headers did not carry from the access log
            const log = fromAccessLog(o['access-log'], r.requestId);
            r.route = r.route || log.route;
            r.nginxTokens = r.nginxTokens || log.prompt_tokens;
            console.log(line(label, r));
            resolve(r);
        }), wait);
    })));
    results.sort((a, b) => a.id - b.id);
    const summary = summarize(label, results);
    if (o.out) {
        writeFileSync(o.out, JSON.stringify({ label, summary, results }));
    }
    return summary.errors === results.length ? 1 : 0;
}

// --- a conversation (dpd_prefix_cache) ---------------------------------

// Turns of one chat whose history grows: a pasted document, a short
// question, a second document, a short question.  Per turn: the gateway's
// count and what its prefix index said was cached on the chosen decoder
// ($dpd_cached_tokens / $dpd_uncached_tokens), the engine's usage
// (prompt_tokens_details.cached_tokens: its prefix-cache hit or the KV it
// pulled), the route and the peers.
async function chat(o) {
    const OpenAI = require('openai');
    const client = new OpenAI({
        baseURL: o['base-url'],
        apiKey: 'dpd-demo',
        maxRetries: 0,
        timeout: 120 * 1000,
    });
    const label = o.label || 'chat';
    const r = rng(Number(o.seed || 23));
    const docWords = Number(o['doc-words'] || 4400);
    const doc = () => {
        const p = [];
        for (let left = docWords; left > 0; left -= 200) {
            p.push(paragraph(r, Math.min(200, left)));
        }
        return p.join('\n\n');
    };
    const turns = [
        'Here is the incident report of last week. Read it:\n\n' + doc(),
        'What was the root cause? ' + paragraph(r, 16),
        'Now the follow-up review. Compare it with the report:\n\n' + doc(),
        'Summarize both in three points. ' + paragraph(r, 12),
    ].slice(0, Number(o.turns || 4));
    const messages = [{ role: 'system',
                        content: 'You are a helpful assistant.' }];
    const runId = Date.now().toString(36);
    let errors = 0;
    for (let i = 0; i < turns.length; i++) {
        messages.push({ role: 'user', content: turns[i] });
        const t0 = performance.now();
        const reqId = `demo-${runId}-${label}-turn${i + 1}`;
        const res = {};
        let text = '';
        try {
            const { data: stream, response } = await client.chat.completions
                .create({
                    model: 'emu-model',
                    messages,
                    max_tokens: Number(o['max-tokens'] || 24),
                    stream: true,
                    stream_options: { include_usage: true },
                }, { headers: { 'X-Request-Id': reqId } })
                .withResponse();
            const h = (name) => response.headers.get(name) || '-';
            res.route = h('x-dpd-route');
            res.prompt = h('x-dpd-prompt-tokens');
            res.cached = h('x-dpd-cached-tokens');
            res.uncached = h('x-dpd-uncached-tokens');
            res.prefill = h('x-dpd-prefill-peer');
            res.decode = h('x-dpd-decode-peer');
            for await (const chunk of stream) {
                if (chunk.usage) {
                    res.usagePrompt = chunk.usage.prompt_tokens;
                    const d = chunk.usage.prompt_tokens_details;
                    res.usageCached = d ? d.cached_tokens : undefined;
                }
                const delta = chunk.choices && chunk.choices[0]
                    && chunk.choices[0].delta;
                if (!delta || !delta.content) continue;
                if (res.ttft === undefined) {
                    res.ttft = performance.now() - t0;
                }
                text += delta.content;
            }
        } catch (e) {
            console.log(`[${label}] turn ${i + 1} ERROR `
                + (e && (e.status ? `HTTP ${e.status}: ` : '')
                   + (e.message || String(e))).slice(0, 160));
            errors++;
            break;
        }
        messages.push({ role: 'assistant', content: text });
        const route = res.route === 'direct' && res.cached !== '-'
            && Number(res.cached) > 0 ? 'direct (cached)' : res.route;
        const where = res.prefill !== '-' && res.prefill !== ''
            ? `prefill ${res.prefill} -> decode ${res.decode}`
            : `decode ${res.decode}`;
        console.log(`[${label}] turn ${i + 1}: prompt ${String(res.prompt)
            .padStart(5)} tok, gateway index: cached ${String(res.cached)
            .padStart(5)} uncached ${String(res.uncached).padStart(5)};`
            + ` engine: prompt ${String(res.usagePrompt ?? '?').padStart(5)}`
            + ` cached ${String(res.usageCached ?? '?').padStart(5)}`
            + `  ${route.padEnd(15)} ttft ${ms(res.ttft, 6)}ms  ${where}`);
    }
    return errors ? 1 : 0;
}

function compare(files) {
    const runs = files.map(f => JSON.parse(readFileSync(f, 'utf8')));
    const [a, b] = runs;
    const ratio = (x, y) => (Number.isFinite(x) && Number.isFinite(y) && y > 0)
        ? (x / y).toFixed(1) + 'x' : 'n/a';
    const s = (r) => r.summary;
    console.log(`short requests, p99 inter-token gap: ${a.label}`
        + ` ${ms(s(a).short.gapP99)}ms -> ${b.label} ${ms(s(b).short.gapP99)}ms`
        + ` (${ratio(s(a).short.gapP99, s(b).short.gapP99)} lower)`);
    console.log(`short requests, mean inter-token gap: ${a.label}`
        + ` ${ms(s(a).short.gapMean)}ms -> ${b.label}`
        + ` ${ms(s(b).short.gapMean)}ms`);
    console.log(`long requests, mean TTFT: ${a.label}`
        + ` ${ms(s(a).long.ttftMean)}ms -> ${b.label}`
        + ` ${ms(s(b).long.ttftMean)}ms`);
    // one row per run
    const w = Math.max(9, ...runs.map(r => r.label.length));
    console.log(`${'run'.padEnd(w)}  short gap p99   mean   ttft  `
        + ` long ttft mean    p99  kv wait  cached/prompt (long)  errors`);
    for (const r of runs) {
        const x = s(r);
        const share = x.long.prompt
            ? `${x.long.cached}/${x.long.prompt}`
                + ` (${(100 * x.long.cached / x.long.prompt).toFixed(0)}%)`
            : '-';
        console.log(`${r.label.padEnd(w)}  ${ms(x.short.gapP99, 11)}ms`
            + ` ${ms(x.short.gapMean, 5)} ${ms(x.short.ttftMean, 6)}ms`
            + ` ${ms(x.long.ttftMean, 13)}ms ${ms(x.long.ttftP99, 6)}`
            + ` ${ms(x.long.kvWait, 6)}ms  ${share.padEnd(20)}`
            + `  ${x.errors}`);
    }
    return 0;
}

const o = parseArgs(process.argv.slice(2));
const cmd = o._[0];
let rc;
if (cmd === 'run') {
    rc = await run(o);
} else if (cmd === 'chat') {
    rc = await chat(o);
} else if (cmd === 'compare') {
    rc = o._.length >= 3 ? compare(o._.slice(1)) : 2;
} else {
    console.error('usage: client.mjs run --base-url URL ... | chat --base-url URL'
        + ' [--turns N] [--doc-words N] | compare A B [C ...]');
    rc = 2;
}
process.exit(rc);
