// Reference chat rendering: @huggingface/jinja runs a model's chat template
// on each chat request of a JSONL file, after the preparation vLLM does
// (vllm/renderers/chat_utils/ at be90fe165bb8: text parts joined with
// "\n", empty ones left out, or, when the template loops over content, kept
// as parts; the Claude Code billing header line dropped from system text;
// tool call arguments parsed, whatever is then no object -> {}; protocol.py
// at 002032ee2b18: reasoning_content as reasoning; tools as model_dump();
// the special tokens, chat_template_kwargs, then the request's
// add_generation_prompt, documents, reasoning_effort over them;
// continue_final_message cut as transformers 4.57 cuts it).  The second, independent oracle beside
// jinja-render.py (Python's Jinja2, what vLLM runs).
//   node jinja-render.js TEMPLATE_SOURCE [tokenizer_config.json] < requests.jsonl
// TEMPLATE_SOURCE is a tokenizer_config.json (its chat_template and special
// tokens) or a .jinja file.  Writes {"text": ...} or {"error": ...} per line.
'use strict';
const fs = require('fs');
const path = require('path');
const npm = process.env.DPD_NPM ||
    path.join(__dirname, '..', '..', 'tools', 'npm', 'node_modules');
const jinja = require(path.join(npm, '@huggingface', 'jinja'));
const { Template } = jinja;

// @huggingface/jinja 0.5 ignores the argument of strip/lstrip/rstrip
// ('\tx'.lstrip('\n') gives 'x'); vLLM runs Python's Jinja2, where only
// the given characters go.  Give string values Python's behaviour.
(function pythonStrip() {
    const env = new jinja.Environment();
    const sv = new jinja.Interpreter(env).evaluate({ type: 'StringLiteral', value: 'x' }, env);
    const proto = Object.getPrototypeOf(sv);
    const desc = Object.getOwnPropertyDescriptor(proto, 'builtins');
    const FunctionValue = desc.get.call(sv).get('strip').constructor;
    function strip(s, chars, left, right) {
        const inSet = chars == null ? (c) => pyspace(c) : (c) => chars.includes(c);
        let a = 0, b = s.length;
        if (left) while (a < b && inSet(s[a])) a++;
        if (right) while (b > a && inSet(s[b - 1])) b--;
        return s.slice(a, b);
    }
    Object.defineProperty(proto, 'builtins', {
        get() {
            const m = desc.get.call(this);
            const Str = this.constructor;
            const mk = (l, r) => new FunctionValue((args) => new Str(
                strip(this.value, args.length ? args[0].value : null, l, r)));
            m.set('strip', mk(true, true));
            m.set('lstrip', mk(true, false));
            m.set('rstrip', mk(false, true));
            return m;
        },
    });
})();

function pyspace(c) {
    // Python's str.isspace(), not JavaScript's \s (U+001C-U+001F, U+0085 in;
    // U+FEFF out)
    return /[\t\n\v\f\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]/.test(c);
}

function templateText(src) {
    if (src.endsWith('.json')) {
        let t = JSON.parse(fs.readFileSync(src, 'utf8')).chat_template;
        if (Array.isArray(t)) t = (t.find((x) => x.name === 'default') || t[0]).template;
        return t;
    }
    return fs.readFileSync(src, 'utf8');
}

// vLLM's content format detection on the template's tree: "openai" when
// a loop runs over a message's content (chat_utils._detect_content_format)
function nodesOf(root) {
    const out = [];
    const seen = new Set();
    (function walk(n) {
        if (!n || typeof n !== 'object' || seen.has(n)) return;
        seen.add(n);
        if (typeof n.type === 'string') out.push(n);
        for (const k of Object.keys(n)) walk(n[k]);
    })(root);
    return out;
}
function isVar(n, name) { return n && n.type === 'Identifier' && n.value === name; }
function isAttr(n, name, key) {
    return n && n.type === 'MemberExpression' && isVar(n.object, name)
        && (n.computed ? n.property.type === 'StringLiteral' && n.property.value === key
                       : n.property.type === 'Identifier' && n.property.value === key);
}
function isVarOrElems(n, name, key) {
    if (!n) return false;
    if (n.type === 'FilterExpression' || n.type === 'TestExpression') return isVarOrElems(n.operand, name, key);
    if (n.type === 'SelectExpression') return isVarOrElems(n.lhs, name, key);
    if (n.type === 'MemberExpression' && n.property && n.property.type === 'SliceExpression')
        return isVarOrElems(n.object, name, key);
    return key ? isAttr(n, name, key) : isVar(n, name);
}
function contentFormat(tmpl) {
    const all = nodesOf(tmpl.parsed);
    const msgs = ['messages'];
    for (let i = 0; i < msgs.length; i++) {
        for (const n of all) {
            if (n.type === 'Set' && n.assignee && n.assignee.type === 'Identifier'
                && isVarOrElems(n.value, msgs[i]) && !msgs.includes(n.assignee.value)) {
                msgs.push(n.assignee.value);
            }
        }
    }
    const items = [];
    for (const n of all) {
        if (n.type === 'For' && n.loopvar.type === 'Identifier'
            && msgs.some((m) => isVarOrElems(n.iterable, m))) items.push(n.loopvar.value);
    }
    for (const n of all) {
        if (n.type === 'For' && items.some((m) => isVarOrElems(n.iterable, m, 'content'))) return 'openai';
    }
    return 'string';
}

const TEXT = { text: 'text', input_text: 'text', output_text: 'text', refusal: 'refusal', thinking: 'thinking' };
const MEDIA = ['image_url', 'input_image', 'image_embeds', 'audio_url', 'input_audio',
               'audio_embeds', 'video_url', 'image_pil'];

const BILLING = 'x-anthropic-billing-header';

function stripBilling(content) {
    const out = [];
    for (const p of content) {
        const t = typeof p === 'string' ? p
            : p && typeof p === 'object' && p.type === 'text' ? p.text : null;
        if (!(typeof t === 'string' && t.startsWith(BILLING))) { out.push(p); continue; }
        const nl = t.indexOf('\n');
        const rest = nl < 0 ? '' : t.slice(nl + 1);
        if (rest) out.push(typeof p === 'string' ? rest : Object.assign({}, p, { text: rest }));
    }
    return out;
}

function prepareMessage(m, fmt) {
    let content = m.content;
    if (content === null || content === undefined) content = [];
    else if (typeof content === 'string') content = [{ type: 'text', text: content }];
    if (m.role === 'system') content = stripBilling(content);
    const texts = [];
    for (const p of content) {
        if (typeof p === 'string') { if (p || fmt === 'openai') texts.push(p); continue; }
        if (TEXT[p.type]) {
            const x = p[TEXT[p.type]];
            if (x !== null && x !== undefined && (x || fmt === 'openai')) texts.push(x);
        } else if (!MEDIA.includes(p.type) && p.type !== undefined) {
            throw new Error(`Unsupported chat content part type: '${p.type}'`);
        }
    }
    const o = { role: m.role, content: fmt === 'openai'
        ? texts.map((t) => ({ type: 'text', text: t })) : texts.join('\n') };
    if (m.role === 'assistant') {
        if (Array.isArray(m.tool_calls) && m.tool_calls.length) {
            o.tool_calls = m.tool_calls.map((c) => {
                if (!c || typeof c !== 'object' || Array.isArray(c))
                    throw new Error('assistant tool_calls entries must be objects.');
                if ((c.type !== undefined && c.type !== 'function') || !c.function
                    || typeof c.function !== 'object' || Array.isArray(c.function))
                    throw new Error("chat completions only support assistant tool_calls of type 'function'.");
                const f = Object.assign({}, c.function);
                let a = f.arguments;
                if (a && typeof a === 'string') {
                    try { a = JSON.parse(a); } catch (e) { a = null; }
                }
                f.arguments = a && typeof a === 'object' && !Array.isArray(a) ? a : {};
                return Object.assign({}, c, { function: f });
            });
        }
        if (m.reasoning !== undefined && m.reasoning !== null) {
            o.reasoning = m.reasoning;
            o.reasoning_content = m.reasoning;
        }
    } else if (m.role === 'tool') {
        if ('tool_call_id' in m) o.tool_call_id = m.tool_call_id;
        if (Array.isArray(o.content)) o.content = o.content.map((x) => x.text).join('\n');
    }
    if (typeof m.name === 'string') o.name = m.name;
    return o;
}

function dumpTool(t) {
    const f = t.function;
    const fn = { name: f.name, description: f.description === undefined ? null : f.description,
                 parameters: f.parameters === undefined ? null : f.parameters };
    for (const k of Object.keys(f)) if (!(k in fn)) fn[k] = f[k];
    const o = { type: 'function', function: fn };
    for (const k of Object.keys(t)) if (k !== 'type' && k !== 'function') o[k] = t[k];
    return o;
}

function strip(s, f) {
    let a = 0, b = s.length;
    while (a < b && pyspace(s[a])) a++;
    while (b > a && pyspace(s[b - 1])) b--;
    return f === 'l' ? s.slice(a) : f === 'r' ? s.slice(0, b) : s.slice(a, b);
}

// transformers 4.57: the tag after the final text (its last text block)
const TAG = 'CONTINUE_FINAL_MESSAGE_TAG ';

function tagFinal(msgs) {
    const last = msgs[msgs.length - 1];
    if (Array.isArray(last.content)) {
        const t = [...last.content].reverse().find((b) => 'text' in b);
        if (!t) throw new Error('continue_final_message is set but we could not find any text to continue in the final message!');
        const fin = t.text;
        t.text = fin + TAG;
        return fin;
    }
    const fin = last.content;
    last.content = fin + TAG;
    return fin;
}

function continueFinal(text, fin) {
    if (!text.includes(strip(fin)) || !text.includes(TAG.trim())) throw new Error('continue_final_message is set but the final message does not appear in the chat after applying the chat template! This can happen if the chat template deletes portions of the final message. Please verify the chat template and final message in your chat to ensure they are compatible.');
    const loc = text.lastIndexOf(TAG.trim());
    if (text.slice(loc, loc + TAG.length) === TAG) return text.slice(0, loc);
    return strip(text.slice(0, loc), 'r');
}

function specials(cfg) {
    const o = {};
    for (const k of ['bos_token', 'eos_token', 'unk_token', 'sep_token', 'pad_token', 'cls_token', 'mask_token']) {
        let v = cfg[k];
        if (v && typeof v === 'object') v = v.content;
        if (v) o[k] = v;
    }
    if (Array.isArray(cfg.additional_special_tokens) && cfg.additional_special_tokens.length)
        o.additional_special_tokens = cfg.additional_special_tokens.map((x) => (typeof x === 'object' ? x.content : x));
    return o;
}

// TEMPLATE_SOURCE [CONFIG]: whole requests in, {"text"} / {"error"} out
const src = process.argv[2];
const cfg = src.endsWith('.json') ? JSON.parse(fs.readFileSync(src, 'utf8'))
    : process.argv[3] ? JSON.parse(fs.readFileSync(process.argv[3], 'utf8')) : {};
const tmpl = new Template(templateText(src));
const fmt = contentFormat(tmpl);
const lines = fs.readFileSync(0, 'utf8').split('\n').filter((l) => l.length);
const out = lines.map((l) => {
    let req = JSON.parse(l);
    if (Array.isArray(req)) req = { messages: req };
    try {
        for (const m of req.messages) {
            if (!m || typeof m !== 'object') continue;
            const rc = m.reasoning_content;
            delete m.reasoning_content;
            if (rc !== undefined && rc !== null && (m.reasoning === undefined || m.reasoning === null))
                m.reasoning = rc;
        }
        const messages = req.messages.map((m) => prepareMessage(m, fmt));
        const agp = req.add_generation_prompt === undefined ? true : req.add_generation_prompt;
        const cfm = !!req.continue_final_message;
        if (agp && cfm) throw new Error('Cannot set both `continue_final_message` and `add_generation_prompt` to True.');
        const user = req.chat_template_kwargs || {};
        const vars = Object.assign({}, specials(cfg), {
            tools: req.tools ? req.tools.map(dumpTool) : null, documents: null,
        });
        for (const k of Object.keys(user)) {
            const v = user[k];
            if (k === 'messages' || k === 'continue_final_message' || v === null || v === 'auto') continue;
            vars[k] = v;
        }
        vars.add_generation_prompt = agp;
        if (req.documents !== undefined && req.documents !== null) vars.documents = req.documents;
        if (typeof req.reasoning_effort === 'string') {
            vars.reasoning_effort = req.reasoning_effort;
            if (!('enable_thinking' in user)) vars.enable_thinking = req.reasoning_effort !== 'none';
        }
        vars.messages = messages;
        const fin = cfm ? tagFinal(messages) : null;
        let text = tmpl.render(vars);
        if (cfm) text = continueFinal(text, fin);
        return JSON.stringify({ text });
    } catch (e) {
        return JSON.stringify({ error: String(e.message || e) });
    }
});
fs.writeFileSync(1, out.join('\n') + (out.length ? '\n' : ''));
