// Reference chat rendering: @huggingface/jinja runs a model's chat template
// on each chat request of a JSONL file, after the message preparation vLLM
// does for templates that take string content (text parts joined with
// "\n", tool call arguments parsed from their JSON string).
//   node jinja-render.js TEMPLATE_SOURCE BOS EOS < requests.jsonl
// TEMPLATE_SOURCE is a tokenizer_config.json (its chat_template) or a
// .jinja file.  Writes one JSON string (the prompt) per line.
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
    const ws = /[\s]/;
    function strip(s, chars, left, right) {
        const inSet = chars == null ? (c) => ws.test(c) : (c) => chars.includes(c);
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

function templateText(src) {
    if (src.endsWith('.json')) {
        let t = JSON.parse(fs.readFileSync(src, 'utf8')).chat_template;
        if (Array.isArray(t)) t = (t.find((x) => x.name === 'default') || t[0]).template;
        return t;
    }
    return fs.readFileSync(src, 'utf8');
}

function prepare(messages) {
    return messages.map((m) => {
        const o = Object.assign({}, m);
        if (Array.isArray(o.content)) o.content = o.content.map((p) => p.text).join('\n');
        if (o.content === null || o.content === undefined) o.content = '';
        if (Array.isArray(o.tool_calls)) {
            o.tool_calls = o.tool_calls.map((c) => {
                const f = Object.assign({}, c.function || c);
                if (typeof f.arguments === 'string') {
                    try { f.arguments = JSON.parse(f.arguments); } catch (e) { /* keep */ }
                }
                return c.function ? Object.assign({}, c, { function: f }) : f;
            });
        }
        return o;
    });
}

const tmpl = new Template(templateText(process.argv[2]));
const bos = process.argv[3] || '';
const eos = process.argv[4] || '';
const lines = fs.readFileSync(0, 'utf8').split('\n').filter((l) => l.length);
const out = lines.map((l) => {
    const req = JSON.parse(l);
    const messages = prepare(Array.isArray(req) ? req : req.messages);
    return JSON.stringify(tmpl.render({
        messages, bos_token: bos, eos_token: eos, add_generation_prompt: true,
    }));
});
fs.writeFileSync(1, out.join('\n') + (out.length ? '\n' : ''));
