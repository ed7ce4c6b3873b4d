// The Kubernetes API server's checks that a JSON schema cannot express,
// for the kinds the chart renders, each as the API server words it:
//
//   node t/deploy/k8s-rules.mjs FILE.yaml ...
//
// The schema half (types, required fields, unknown fields at any depth) is
// kubeconform's, against Kubernetes' own JSON schemas (tools/k8s-check.sh
// runs both).  Every rule names the function of kubernetes/kubernetes that
// makes it (release-1.37), so that a rule here is never our own opinion:
//
//   core = pkg/apis/core/validation/validation.go
//   apps = pkg/apis/apps/validation/validation.go
//   policy = pkg/apis/policy/validation/validation.go
//   meta = staging/src/k8s.io/apimachinery/pkg/api/validation/objectmeta.go,
//          pkg/apis/meta/v1/validation/validation.go (labels)
//   util = staging/src/k8s.io/apimachinery/pkg/util/validation/validation.go
//
// plus two cluster-level checks no single object shows (marked "cross"):
// a StatefulSet's serviceName names a headless Service of the same render,
// and a Service's selector selects some pod of it.  t/deploy/4x-helm-*.t
// holds a failing example of each rule.
//
// Prints "ok FILE#N KIND/NAME" per document, "not ok FILE#N KIND/NAME:
// PATH: WHY (RULE)" per problem; exit 1 when there was one, 2 when the npm
// package yaml is missing (make deps).
import fs from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const npm = process.env.DPD_NPM ||
    path.join(path.dirname(new URL(import.meta.url).pathname),
              '..', '..', 'tools', 'npm', 'node_modules');
let YAML;
try {
    YAML = await import(pathToFileURL(path.join(npm, 'yaml/dist/index.js')).href);
} catch (e) {
    console.error(`k8s-rules: npm package yaml not in ${npm} (make deps)`);
    process.exit(2);
}

// ---- util: the name formats (IsDNS1123Label, IsDNS1123Subdomain,
// IsDNS1035Label, IsValidPortName, IsEnvVarName, IsQualifiedName)
const DNS1123_LABEL = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/;
const DNS1123_SUB = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$/;
const DNS1035_LABEL = /^[a-z]([-a-z0-9]*[a-z0-9])?$/;
const ENV_NAME = /^[-._a-zA-Z][-._a-zA-Z0-9]*$/;
const QUALIFIED = /^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$/;
const LABEL_VALUE = /^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$/;

function dns1123Label(v) {
    if (v.length > 63) return 'must be no more than 63 characters';
    if (!DNS1123_LABEL.test(v))
        return "a lowercase RFC 1123 label must consist of lower case " +
               "alphanumeric characters or '-', and must start and end with " +
               "an alphanumeric character";
    return null;
}
function dns1123Subdomain(v) {
    if (v.length > 253) return 'must be no more than 253 characters';
    if (!DNS1123_SUB.test(v))
        return "a lowercase RFC 1123 subdomain must consist of lower case " +
               "alphanumeric characters, '-' or '.', and must start and end " +
               "with an alphanumeric character";
    return null;
}
function dns1035Label(v) {
    if (v.length > 63) return 'must be no more than 63 characters';
    if (!DNS1035_LABEL.test(v))
        return "a DNS-1035 label must consist of lower case alphanumeric " +
               "characters or '-', start with an alphabetic character, and " +
               "end with an alphanumeric character";
    return null;
}
function portName(v) {            // util IsValidPortName (IANA_SVC_NAME)
    if (v.length < 1 || v.length > 15) return 'must be no more than 15 characters';
    if (!/^[-a-z0-9]+$/.test(v))
        return 'must contain only alpha-numeric characters (a-z, 0-9), and hyphens (-)';
    if (!/[a-z]/.test(v)) return 'must contain at least one letter (a-z)';
    if (v.includes('--')) return 'must not contain consecutive hyphens';
    if (v.startsWith('-') || v.endsWith('-')) return 'must not begin or end with a hyphen';
    return null;
}
function qualifiedName(k) {       // util IsQualifiedName
    let name = k;
    const slash = k.split('/');
    if (slash.length > 2) return 'a qualified name must consist of alphanumeric characters...';
    if (slash.length === 2) {
        if (dns1123Subdomain(slash[0])) return 'prefix part ' + dns1123Subdomain(slash[0]);
        name = slash[1];
    }
    if (name.length === 0 || name.length > 63) return 'name part must be no more than 63 characters';
    if (!QUALIFIED.test(name))
        return "name part must consist of alphanumeric characters, '-', '_' or " +
               "'.', and must start and end with an alphanumeric character";
    return null;
}

// ---- quantities (resource.ParseQuantity), enough to compare
const SUFFIX = { '': 1, k: 1e3, M: 1e6, G: 1e9, T: 1e12, P: 1e15, E: 1e18,
                 m: 1e-3, Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40,
                 Pi: 2 ** 50, Ei: 2 ** 60 };
function qty(v) {
    const m = /^([+-]?[0-9.]+)([eE][+-]?[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$/
        .exec(String(v));
    if (!m) return NaN;
    return Number(m[1] + (m[2] || '')) * SUFFIX[m[3] || ''];
}
const isHuge = (n) => n.startsWith('hugepages-');
const isNative = (n) => !n.includes('/') || n.startsWith('kubernetes.io/');
// core: helper.IsOvercommitAllowed: native and not hugepages
const overcommit = (n) => isNative(n) && !isHuge(n);
// core: helper.IsIntegerResourceName: extended resources (and pods)
const integerRes = (n) => !isNative(n) && !n.startsWith('requests.');

const problems = [];
let where = '';
function bad(p, why, rule) {
    problems.push(`not ok ${where}: ${p}: ${why} (${rule})`);
}

// ---- per object
function checkMeta(obj, nameRule) {
    const md = obj.metadata || {};
    if (typeof md.name === 'string') {
        const e = nameRule(md.name);
        if (e) bad('metadata.name', `"${md.name}": ${e}`, 'meta ValidateObjectMeta');
    }
    checkLabels('metadata.labels', md.labels);
}
function checkLabels(p, labels) {  // meta/v1 ValidateLabels
    for (const [k, v] of Object.entries(labels || {})) {
        const e = qualifiedName(k);
        if (e) bad(`${p}.${k}`, `"${k}": ${e}`, 'meta ValidateLabels');
        if (typeof v !== 'string' || v.length > 63 || !LABEL_VALUE.test(v))
            bad(`${p}.${k}`, `"${v}": a valid label must be an empty string ` +
                'or consist of alphanumeric characters, \'-\', \'_\' or \'.\', ' +
                'and must start and end with an alphanumeric character ' +
                '(at most 63)', 'meta ValidateLabelValue');
    }
}

function selectorMatches(sel, labels) {
    if (!sel) return false;
    for (const [k, v] of Object.entries(sel.matchLabels || {}))
        if ((labels || {})[k] !== v) return false;
    for (const e of sel.matchExpressions || []) {
        const has = Object.hasOwn(labels || {}, e.key);
        const val = (labels || {})[e.key];
        if (e.operator === 'In' && !(has && e.values.includes(val))) return false;
        if (e.operator === 'NotIn' && has && e.values.includes(val)) return false;
        if (e.operator === 'Exists' && !has) return false;
        if (e.operator === 'DoesNotExist' && has) return false;
    }
    return true;
}

function checkResources(p, r) {    // core validateResourceRequirements
    if (!r) return;
    const req = r.requests || {}, lim = r.limits || {};
    let cpuMem = false, huge = false;
    for (const [n, q] of Object.entries(lim)) {
        if (n === 'cpu' || n === 'memory') cpuMem = true;
        if (isHuge(n)) huge = true;
        if (integerRes(n) && !Number.isInteger(qty(q)))
            bad(`${p}.limits[${n}]`, `${q}: must be an integer`, 'core validateResourceQuantityValue');
    }
    for (const [n, q] of Object.entries(req)) {
        if (n === 'cpu' || n === 'memory') cpuMem = true;
        if (isHuge(n)) huge = true;
        if (integerRes(n) && !Number.isInteger(qty(q)))
            bad(`${p}.requests[${n}]`, `${q}: must be an integer`, 'core validateResourceQuantityValue');
        if (Object.hasOwn(lim, n)) {
            if (!overcommit(n) && qty(q) !== qty(lim[n]))
                bad(`${p}.requests[${n}]`, `${q}: must be equal to ${n} limit of ${lim[n]}`,
                    'core validateResourceRequirements');
            else if (qty(q) > qty(lim[n]))
                bad(`${p}.requests[${n}]`, `${q}: must be less than or equal to ${n} limit of ${lim[n]}`,
                    'core validateResourceRequirements');
        } else if (!overcommit(n)) {
            bad(`${p}.limits`, 'Limit must be set for non overcommitable resources',
                'core validateResourceRequirements');
        }
    }
    if (huge && !cpuMem)
        bad(p, 'Forbidden: HugePages require cpu or memory', 'core validateResourceRequirements');
}

function checkPodSpec(p, spec) {
    const vols = new Set();
    (spec.volumes || []).forEach((v, i) => {
        const e = dns1123Label(v.name || '');
        if (e) bad(`${p}.volumes[${i}].name`, `"${v.name}": ${e}`, 'core ValidateVolumes');
        if (vols.has(v.name))
            bad(`${p}.volumes[${i}].name`, `Duplicate value: "${v.name}"`, 'core ValidateVolumes');
        vols.add(v.name);
        for (const src of ['secret', 'configMap', 'projected']) {
            const m = v[src] && v[src].defaultMode;
            if (m !== undefined && (m < 0 || m > 0o777))
                bad(`${p}.volumes[${i}].${src}.defaultMode`,
                    `${m}: must be a number between 0 and 0777 (octal), both inclusive`,
                    'core validateSecretVolumeSource');
        }
        const med = v.emptyDir && v.emptyDir.medium;
        if (med && !['', 'Memory', 'HugePages'].includes(med) && !/^HugePages-/.test(med))
            bad(`${p}.volumes[${i}].emptyDir.medium`, `"${med}": not a storage medium`,
                'core validateEmptyDirVolumeSource');
    });
    const names = new Set();
    const ports = new Set();
    for (const kind of ['initContainers', 'containers']) {
        (spec[kind] || []).forEach((c, i) => {
            const cp = `${p}.${kind}[${i}]`;
            const e = dns1123Label(c.name || '');
            if (e) bad(`${cp}.name`, `"${c.name}": ${e}`, 'core validateContainers');
            if (names.has(c.name))
                bad(`${cp}.name`, `Duplicate value: "${c.name}"`, 'core validateContainers');
            names.add(c.name);
            const cports = new Set();
            (c.ports || []).forEach((pt, j) => {
                if (pt.name === undefined) return;
                const pe = portName(pt.name);
                if (pe) bad(`${cp}.ports[${j}].name`, `"${pt.name}": ${pe}`, 'core validateContainerPorts');
                if (cports.has(pt.name))
                    bad(`${cp}.ports[${j}].name`, `Duplicate value: "${pt.name}"`, 'core validateContainerPorts');
                cports.add(pt.name);
                ports.add(pt.name);
            });
            (c.env || []).forEach((ev, j) => {
                if (!ENV_NAME.test(ev.name || ''))
                    bad(`${cp}.env[${j}].name`, `"${ev.name}": a valid environment ` +
                        "variable name must consist of alphabetic characters, digits, " +
                        "'_', '-', or '.', and must not start with a digit",
                        'core validateEnvVarName');
            });
            (c.volumeMounts || []).forEach((m, j) => {
                if (!vols.has(m.name))
                    bad(`${cp}.volumeMounts[${j}].name`, `Not found: "${m.name}"`,
                        'core ValidateVolumeMounts');
            });
            checkResources(`${cp}.resources`, c.resources);
        });
    }
}

const objects = [];
function checkObject(obj) {
    const k = obj.kind;
    if (k === 'Service') checkMeta(obj, dns1035Label);      // core ValidateServiceName
    else checkMeta(obj, dns1123Subdomain);
    const s = obj.spec || {};
    if (k === 'Deployment' || k === 'StatefulSet' || k === 'DaemonSet' ||
        k === 'ReplicaSet' || k === 'Job') {
        const tpl = s.template || {};
        checkLabels('spec.template.metadata.labels', (tpl.metadata || {}).labels);
        if (k !== 'Job' && !selectorMatches(s.selector, (tpl.metadata || {}).labels))
            bad('spec.template.metadata.labels', 'Invalid value: `selector` does not match ' +
                'template `labels`', `apps Validate${k}Spec`);
        checkPodSpec('spec.template.spec', tpl.spec || {});
    }
    if (k === 'Pod') checkPodSpec('spec', s);
    if (k === 'Service') {                         // core ValidateService
        const ports = s.ports || [];
        const seen = new Set();
        ports.forEach((pt, i) => {
            if (ports.length > 1 && !pt.name)
                bad(`spec.ports[${i}].name`, 'Required value', 'core validateServicePort');
            if (pt.name) {
                const e = dns1123Label(pt.name);
                if (e) bad(`spec.ports[${i}].name`, `"${pt.name}": ${e}`, 'core validateServicePort');
                if (seen.has(pt.name))
                    bad(`spec.ports[${i}].name`, `Duplicate value: "${pt.name}"`, 'core validateServicePort');
                seen.add(pt.name);
            }
            if (typeof pt.targetPort === 'string' && portName(pt.targetPort))
                bad(`spec.ports[${i}].targetPort`, `"${pt.targetPort}": ${portName(pt.targetPort)}`,
                    'core validateServicePort');
        });
        if (s.clusterIP === 'None' && s.type === 'LoadBalancer')
            bad('spec.clusterIP', 'Invalid value: "None": may not be set to \'None\' for LoadBalancer services',
                'core ValidateService');
    }
    if (k === 'PodDisruptionBudget' &&            // policy ValidatePodDisruptionBudgetSpec
        s.minAvailable !== undefined && s.maxUnavailable !== undefined)
        bad('spec', 'Invalid value: minAvailable and maxUnavailable cannot be both set',
            'policy ValidatePodDisruptionBudgetSpec');
    if (k === 'ConfigMap' || k === 'Secret') {     // core ValidateConfigMap/ValidateSecret
        let total = 0;
        for (const f of ['data', 'binaryData', 'stringData'])
            for (const [key, v] of Object.entries(obj[f] || {})) {
                if (!/^[-._a-zA-Z0-9]+$/.test(key) || key.length > 253)
                    bad(`${f}[${key}]`, "a valid config key must consist of alphanumeric " +
                        "characters, '-', '_' or '.'", 'core ValidateConfigMap');
                total += Buffer.byteLength(String(v));
            }
        if (total > 1048576)
            bad('data', `Too long: must have at most 1048576 bytes`, `core Validate${k}`);
    }
    if (k === 'ServiceMonitor') {   // no Kubernetes schema: the CRD's own required fields
        if (!s.selector) bad('spec.selector', 'Required value', 'prometheus-operator CRD');
        (s.endpoints || []).forEach((e, i) => {
            if (!e.port && !e.targetPort)
                bad(`spec.endpoints[${i}]`, 'port or targetPort required', 'prometheus-operator CRD');
        });
    }
}

// ---- cross: across the objects of a render
function crossChecks() {
    const services = objects.filter((o) => o.obj.kind === 'Service');
    const pods = objects.filter((o) => o.obj.spec && o.obj.spec.template);
    for (const o of pods.filter((o) => o.obj.kind === 'StatefulSet')) {
        where = o.where;
        const want = o.obj.spec.serviceName;
        const svc = services.find((s) => s.obj.metadata.name === want);
        if (!svc) bad('spec.serviceName', `no Service "${want}" in the render`, 'cross');
        else if (svc.obj.spec.clusterIP !== 'None')
            bad('spec.serviceName', `Service "${want}" is not headless (clusterIP: None)`, 'cross');
    }
    for (const s of services) {
        where = s.where;
        const sel = s.obj.spec && s.obj.spec.selector;
        if (!sel) continue;
        if (!pods.some((p) => selectorMatches({ matchLabels: sel },
                                              (p.obj.spec.template.metadata || {}).labels)))
            bad('spec.selector', 'selects no pod of the render', 'cross');
        // a named targetPort must be a port of the selected pods
        for (const pt of s.obj.spec.ports || []) {
            if (typeof pt.targetPort !== 'string') continue;
            const sel2 = pods.filter((p) => selectorMatches({ matchLabels: sel },
                (p.obj.spec.template.metadata || {}).labels));
            const ok = sel2.every((p) => [...(p.obj.spec.template.spec.containers || [])]
                .some((c) => (c.ports || []).some((cp) => cp.name === pt.targetPort)));
            if (sel2.length && !ok)
                bad('spec.ports', `targetPort "${pt.targetPort}" is no container port of the selected pods`, 'cross');
        }
    }
}

const files = process.argv.slice(2);
if (!files.length) {
    console.error('usage: node k8s-rules.mjs FILE.yaml ...');
    process.exit(2);
}
for (const file of files) {
    let text;
    try { text = fs.readFileSync(file, 'utf8'); } catch (e) {
        problems.push(`not ok ${file}: cannot read: ${e.message}`);
        continue;
    }
    const docs = YAML.parseAllDocuments(text, { version: '1.1', uniqueKeys: true });
    docs.forEach((d, i) => {
        where = `${file}#${i + 1}`;
        if (d.errors.length) {
            bad('', `YAML: ${d.errors[0].message.split('\n')[0]}`, 'yaml');
            return;
        }
        const obj = d.toJS();
        if (obj === null || obj === undefined) return;
        if (typeof obj !== 'object' || !obj.kind) {
            bad('', 'not a Kubernetes object', 'yaml');
            return;
        }
        where = `${file}#${i + 1} ${obj.kind}/${(obj.metadata || {}).name}`;
        const before = problems.length;
        checkObject(obj);
        objects.push({ where, obj });
        if (problems.length === before) console.log(`ok ${where}`);
    });
}
crossChecks();
for (const p of problems) console.log(p);
process.exit(problems.length ? 1 : 0);
