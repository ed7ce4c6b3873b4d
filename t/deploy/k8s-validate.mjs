// Offline validation of Kubernetes manifests against the API's schemas.
//
//   node t/deploy/k8s-validate.mjs FILE.yaml ...
//
// Every YAML document of every file must be an object of a kind the
// Kubernetes API serves, and pass:
//   1. the JSON schema of its kind (package kubernetes-models: ajv
//      validators generated from the Kubernetes OpenAPI spec): types,
//      required fields, enums, formats (int32, ...);
//   2. no field the API does not know, at any depth (the API server drops
//      unknown fields, or rejects them under kubectl's default
//      --validate=strict): the field lists of the official client's models
//      (@kubernetes/client-node, generated from the same spec), since the
//      OpenAPI schemas do not forbid extra properties;
//   3. checks the API server makes beyond the schema, for the kinds used
//      here: DNS-1123 names, a workload's selector matching its pod
//      template's labels, unique container and volume names, every
//      volumeMount naming a volume, container ports in 1..65535,
//      StatefulSet serviceName naming a Service in the same set of files,
//      and each Service's selector matching the pods of some workload
//      there;
//   plus YAML parsed as Kubernetes parses it (YAML 1.1: `on` is true;
//   duplicate keys are an error).
// Prints "ok FILE#N KIND/NAME" per document, "not ok ... : PATH: WHY" per
// problem; exits 1 when any problem was found, 2 when the packages are
// missing (make deps).
import fs from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const npm = process.env.DPD_NPM ||
    path.join(path.dirname(new URL(import.meta.url).pathname),
              '..', '..', 'tools', 'npm', 'node_modules');

async function load(rel) {
    return import(pathToFileURL(path.join(npm, rel)).href);
}

let YAML;
try {
    YAML = await load('yaml/dist/index.js');
    fs.accessSync(path.join(npm, 'kubernetes-models', 'package.json'));
    fs.accessSync(path.join(npm, '@kubernetes', 'client-node', 'package.json'));
} catch (e) {
    console.error(`k8s-validate: npm packages yaml, kubernetes-models and ` +
                  `@kubernetes/client-node not found in ${npm} (make deps): ` +
                  e.message);
    process.exit(2);
}

const problems = [];
const objects = [];   // {file, idx, obj}

function problem(where, p, why) {
    problems.push(`${where}: ${p || '(document)'}: ${why}`);
}

// ---- 1. the kind's JSON schema (kubernetes-models)

async function modelClass(apiVersion, kind) {
    const [group, version] = apiVersion.includes('/')
        ? apiVersion.split('/') : ['', apiVersion];
    const dir = group === '' ? version : `${group}/${version}`;
    let mod;
    try {
        mod = await load(`kubernetes-models/${dir}/index.js`);
    } catch {
        return null;
    }
    return mod[kind] || null;
}

// ---- 2. unknown fields (@kubernetes/client-node's models)

const typeCache = new Map();

async function clientType(name) {
    if (typeCache.has(name)) return typeCache.get(name);
    let t = null;
    try {
        const m = await load(`@kubernetes/client-node/dist/gen/models/${name}.js`);
        t = m[name] || null;
    } catch {
        t = null;
    }
    typeCache.set(name, t);
    return t;
}

// the client's class of a top-level kind: V1Deployment, V2HorizontalPod...,
// or with the group's prefix where names clash (CoreV1Event)
async function topType(apiVersion, kind) {
    const [group, version] = apiVersion.includes('/')
        ? apiVersion.split('/') : ['core', apiVersion];
    const v = version[0].toUpperCase() + version.slice(1);
    const g = group.split('.')[0];
    for (const name of [`${v}${kind}`,
                        `${g[0].toUpperCase()}${g.slice(1)}${v}${kind}`]) {
        const t = await clientType(name);
        if (t) return name;
    }
    return null;
}

const PRIMITIVE = new Set(['string', 'number', 'boolean', 'Date', 'any',
                           'object', 'IntOrString']);

async function strict(where, p, value, type) {
    if (value === null || value === undefined) return;
    let m;
    if ((m = /^Array<(.+)>$/.exec(type))) {
        if (!Array.isArray(value)) return;   // the schema reports the type
        for (let i = 0; i < value.length; i++) {
            await strict(where, `${p}[${i}]`, value[i], m[1]);
        }
        return;
    }
    if ((m = /^\{ \[key: string\]: (.+); \}$/.exec(type))) {
        if (typeof value !== 'object' || Array.isArray(value)) return;
        for (const [k, v] of Object.entries(value)) {
            await strict(where, `${p}.${k}`, v, m[1]);
        }
        return;
    }
    if (PRIMITIVE.has(type)) return;
    const cls = await clientType(type);
    if (!cls || !cls.attributeTypeMap) return;
    if (typeof value !== 'object' || Array.isArray(value)) return;
    const fields = new Map(cls.attributeTypeMap.map((a) => [a.baseName, a]));
    for (const [k, v] of Object.entries(value)) {
        const a = fields.get(k);
        if (!a) {
            const near = [...fields.keys()].filter(
                (f) => f.toLowerCase() === k.toLowerCase() ||
                       f.startsWith(k) || k.startsWith(f));
            problem(where, p ? `${p}.${k}` : k,
                    `unknown field "${k}" in ${type}` +
                    (near.length ? ` (did you mean ${near.join(', ')}?)` : ''));
            continue;
        }
        await strict(where, p ? `${p}.${k}` : k, v, a.type);
    }
}

// ---- 3. what the API server checks beyond the schema

const DNS1123_LABEL = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/;
const DNS1123_SUBDOMAIN =
    /^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$/;

function selectorMatches(sel, labels) {
    if (!sel) return false;
    labels = labels || {};
    for (const [k, v] of Object.entries(sel.matchLabels || {})) {
        if (labels[k] !== v) return false;
    }
    for (const e of sel.matchExpressions || []) {
        const has = Object.hasOwn(labels, e.key);
        const inv = has && (e.values || []).includes(labels[e.key]);
        if ((e.operator === 'In' && !inv) || (e.operator === 'NotIn' && inv) ||
            (e.operator === 'Exists' && !has) ||
            (e.operator === 'DoesNotExist' && has)) {
            return false;
        }
    }
    return Object.keys(sel.matchLabels || {}).length > 0 ||
           (sel.matchExpressions || []).length > 0;
}

function podSpecOf(obj) {
    switch (obj.kind) {
    case 'Pod': return [obj.spec, 'spec', obj.metadata?.labels];
    case 'Deployment': case 'StatefulSet': case 'DaemonSet':
    case 'ReplicaSet': case 'Job':
        return [obj.spec?.template?.spec, 'spec.template.spec',
                obj.spec?.template?.metadata?.labels];
    case 'CronJob':
        return [obj.spec?.jobTemplate?.spec?.template?.spec,
                'spec.jobTemplate.spec.template.spec',
                obj.spec?.jobTemplate?.spec?.template?.metadata?.labels];
    default: return [null, null, null];
    }
}

function semantic(where, obj) {
    const md = obj.metadata || {};
    const nameRule = ['Service', 'Namespace'].includes(obj.kind)
        ? DNS1123_LABEL : DNS1123_SUBDOMAIN;
    if (typeof md.name !== 'string' || !nameRule.test(md.name) ||
        md.name.length > (nameRule === DNS1123_LABEL ? 63 : 253)) {
        problem(where, 'metadata.name',
                `"${md.name}" is not a valid ${obj.kind} name (DNS-1123)`);
    }
    if (md.namespace !== undefined && !DNS1123_LABEL.test(md.namespace)) {
        problem(where, 'metadata.namespace', `"${md.namespace}" is not valid`);
    }

    if (['Deployment', 'StatefulSet', 'DaemonSet', 'ReplicaSet'].includes(obj.kind)
        && !selectorMatches(obj.spec?.selector,
                            obj.spec?.template?.metadata?.labels)) {
        problem(where, 'spec.selector',
                'selector does not match the pod template\'s labels');
    }

    const [pod, pp] = podSpecOf(obj);
    if (!pod) return;
    const volumes = new Set();
    for (const [i, v] of (pod.volumes || []).entries()) {
        if (volumes.has(v.name)) {
            problem(where, `${pp}.volumes[${i}].name`, `duplicate "${v.name}"`);
        }
        volumes.add(v.name);
    }
    const names = new Set();
    const all = [['initContainers', pod.initContainers || []],
                 ['containers', pod.containers || []]];
    for (const [list, cs] of all) {
        for (const [i, c] of cs.entries()) {
            const cp = `${pp}.${list}[${i}]`;
            if (names.has(c.name)) {
                problem(where, `${cp}.name`, `duplicate container "${c.name}"`);
            }
            names.add(c.name);
            if (c.name !== undefined && !DNS1123_LABEL.test(c.name)) {
                problem(where, `${cp}.name`, `"${c.name}" is not DNS-1123`);
            }
            for (const [j, m] of (c.volumeMounts || []).entries()) {
                if (!volumes.has(m.name)) {
                    problem(where, `${cp}.volumeMounts[${j}].name`,
                            `no volume "${m.name}" in ${pp}.volumes`);
                }
            }
            for (const [j, port] of (c.ports || []).entries()) {
                const n = port.containerPort;
                if (Number.isInteger(n) && (n < 1 || n > 65535)) {
                    problem(where, `${cp}.ports[${j}].containerPort`,
                            `${n} is not in 1..65535`);
                }
            }
        }
    }
}

// checks across the files: StatefulSet -> its Service, Service -> pods
function crossChecks() {
    const services = objects.filter((o) => o.obj.kind === 'Service');
    const workloads = objects.filter((o) => podSpecOf(o.obj)[0]);
    const ns = (o) => o.metadata?.namespace || 'default';
    for (const w of workloads) {
        if (w.obj.kind !== 'StatefulSet') continue;
        const want = w.obj.spec?.serviceName;
        if (want === undefined) continue;
        const svc = services.find((s) => s.obj.metadata?.name === want &&
                                         ns(s.obj) === ns(w.obj));
        if (!svc) {
            problem(w.where, 'spec.serviceName', `no Service "${want}" in ` +
                    `namespace ${ns(w.obj)} in these files`);
        } else if (svc.obj.spec?.clusterIP !== 'None') {
            problem(w.where, 'spec.serviceName', `Service "${want}" is not ` +
                    'headless (clusterIP: None): no per-pod DNS names');
        }
    }
    for (const s of services) {
        const sel = s.obj.spec?.selector;
        if (!sel || s.obj.spec?.type === 'ExternalName') continue;
        const hit = workloads.some((w) => ns(w.obj) === ns(s.obj) &&
            selectorMatches({ matchLabels: sel }, podSpecOf(w.obj)[2]));
        if (!hit) {
            problem(s.where, 'spec.selector',
                    `selects no pods of the workloads in these files`);
        }
    }
}

// ---- main

const files = process.argv.slice(2);
if (!files.length) {
    console.error('usage: node k8s-validate.mjs FILE.yaml ...');
    process.exit(2);
}

for (const file of files) {
    let text;
    try {
        text = fs.readFileSync(file, 'utf8');
    } catch (e) {
        problem(file, '', `cannot read: ${e.message}`);
        continue;
    }
    const docs = YAML.parseAllDocuments(text, { version: '1.1',
                                                uniqueKeys: true,
                                                strict: true });
    let idx = 0;
    for (const doc of docs) {
        idx++;
        const where = `${file}#${idx}`;
        for (const e of [...doc.errors, ...doc.warnings]) {
            problem(where, '', `YAML: ${e.message.split('\n')[0]}`);
        }
        if (doc.errors.length) continue;
        const obj = doc.toJS({ maxAliasCount: 0 });
        if (obj === null || obj === undefined) continue;   // empty document
        if (typeof obj !== 'object' || Array.isArray(obj)) {
            problem(where, '', 'not an object');
            continue;
        }
        if (typeof obj.apiVersion !== 'string' || typeof obj.kind !== 'string') {
            problem(where, '', 'apiVersion and kind are required');
            continue;
        }
        const before = problems.length;
        const Model = await modelClass(obj.apiVersion, obj.kind);
        if (!Model) {
            problem(where, 'kind',
                    `no kind ${obj.kind} in API version ${obj.apiVersion}`);
            continue;
        }
        try {
            new Model(obj).validate();
        } catch (e) {
            for (const err of e.errors || [{ instancePath: '', message: e.message }]) {
                const p = (err.instancePath || '').replace(/^\//, '')
                    .replace(/\/(\d+)(?=\/|$)/g, '[$1]').replace(/\//g, '.');
                const extra = err.params && err.params.allowedValues
                    ? ` (${err.params.allowedValues.join(', ')})` : '';
                problem(where, p, `${err.message}${extra}`);
            }
        }
        const top = await topType(obj.apiVersion, obj.kind);
        if (top) await strict(where, '', obj, top);
        semantic(where, obj);
        objects.push({ where, obj });
        if (problems.length === before) {
            console.log(`ok ${where} ${obj.kind}/${obj.metadata?.name}`);
        }
    }
}
crossChecks();

for (const p of problems) console.log(`not ok ${p}`);
process.exit(problems.length ? 1 : 0);
