# tools/k8s-check.sh refuses what the API server refuses, each with the
# API server's words: one failing example per rule of t/deploy/k8s-rules.mjs
# (the rules cite kubernetes/kubernetes' validation functions) and of
# kubeconform's schema stage, beside a valid base that passes (so each
# refusal comes from its one change); the hugepages-only shape of the old
# docker/k8s manifests (issue 24: the API server answers "HugePages
# require cpu or memory", the old validator said ok) is refused; and the
# chart itself refuses values that could not work, naming the value.
use strict;
use warnings;

use FindBin;
use lib $FindBin::Bin;
use DPDHelm;
use Test::More;

need_tools();

my $base = <<'EOF';
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  labels: {app: web}
spec:
  selector:
    matchLabels: {app: web}
  template:
    metadata:
      labels: {app: web}
    spec:
      initContainers:
        - name: init
          image: busybox:1.36
      containers:
        - name: main
          image: nginx:1.30
          env:
            - {name: MODE, value: "1"}
          ports:
            - {name: http, containerPort: 8000}
          resources:
            requests: {cpu: "1", memory: 1Gi, nvidia.com/gpu: 1, hugepages-2Mi: 512Mi}
            limits: {memory: 1Gi, nvidia.com/gpu: 1, hugepages-2Mi: 512Mi}
          volumeMounts:
            - {name: data, mountPath: /data}
            - {name: keys, mountPath: /keys}
      volumes:
        - name: data
          emptyDir: {}
        - name: keys
          secret: {secretName: keys, defaultMode: 0400}
---
apiVersion: v1
kind: Service
metadata:
  name: web
spec:
  selector: {app: web}
  ports:
    - {name: http, port: 80, targetPort: http}
    - {name: metrics, port: 9100, targetPort: 8000}
EOF

my $n = 0;
sub run_check {
    my ($yaml) = @_;
    return check(spew("$DIR/case-" . ++$n . '.yaml', $yaml));
}

my ($rc, $out) = run_check($base);
is($rc, 0, 'the valid base passes') or diag $out;

sub refused {
    my ($what, $from, $to, $why) = @_;
    my $y = $base;
    if (ref $from eq 'CODE') {
        $y = $from->($y);
    } else {
        ok($y =~ s/\Q$from\E/$to/, "fixture edit applies: $what") or return;
    }
    my ($rc, $out) = run_check($y);
    is($rc, 1, "refused: $what") or diag $out;
    like($out, $why, "... with the API server's reason: $what") or diag $out;
}

# ---- core validateResourceRequirements
refused('hugepages without cpu or memory (the old docker/k8s shape)',
        'requests: {cpu: "1", memory: 1Gi, nvidia.com/gpu: 1, hugepages-2Mi: 512Mi}
            limits: {memory: 1Gi, nvidia.com/gpu: 1, hugepages-2Mi: 512Mi}',
        'limits: {nvidia.com/gpu: 8, vpc.amazonaws.com/efa: 32, hugepages-2Mi: 5120Mi}',
        qr/containers\[0\]\.resources: Forbidden: HugePages require cpu or memory \(core validateResourceRequirements\)/);
refused('hugepages requests != limits',
        'limits: {memory: 1Gi, nvidia.com/gpu: 1, hugepages-2Mi: 512Mi}',
        'limits: {memory: 1Gi, nvidia.com/gpu: 1, hugepages-2Mi: 1Gi}',
        qr/requests\[hugepages-2Mi\]: 512Mi: must be equal to hugepages-2Mi limit of 1Gi/);
refused('a GPU request without a limit',
        'limits: {memory: 1Gi, nvidia.com/gpu: 1, hugepages-2Mi: 512Mi}',
        'limits: {memory: 1Gi, hugepages-2Mi: 512Mi}',
        qr/resources\.limits: Limit must be set for non overcommitable resources/);
refused('half a GPU',
        'nvidia.com/gpu: 1, hugepages-2Mi: 512Mi}
            limits: {memory: 1Gi, nvidia.com/gpu: 1,',
        'nvidia.com/gpu: 500m, hugepages-2Mi: 512Mi}
            limits: {memory: 1Gi, nvidia.com/gpu: 500m,',
        qr/requests\[nvidia\.com\/gpu\]: 500m: must be an integer/);
refused('cpu request over its limit',
        'limits: {memory: 1Gi,', 'limits: {cpu: 500m, memory: 1Gi,',
        qr/requests\[cpu\]: 1: must be less than or equal to cpu limit of 500m/);

# ---- core validateContainerPorts (util IsValidPortName)
refused('a port name of 16 characters', '{name: http, containerPort: 8000}',
        '{name: kv-agent-control, containerPort: 8000}',
        qr/ports\[0\]\.name: "kv-agent-control": must be no more than 15 characters/);
refused('a port name with "_"', '{name: http, containerPort: 8000}',
        '{name: kv_agent, containerPort: 8000}',
        qr/"kv_agent": must contain only alpha-numeric characters/);
refused('a port name without a letter', '{name: http, containerPort: 8000}',
        '{name: "8000", containerPort: 8000}',
        qr/"8000": must contain at least one letter/);
refused('two ports of one name', '{name: http, containerPort: 8000}',
        "{name: http, containerPort: 8000}\n            - {name: http, containerPort: 8001}",
        qr/ports\[1\]\.name: Duplicate value: "http"/);

# ---- core validateEnvVarName
refused('an env name starting with a digit', '{name: MODE, value: "1"}',
        '{name: 1MODE, value: "1"}',
        qr/env\[0\]\.name: "1MODE": a valid environment variable name/);

# ---- apps ValidateDeploymentSpec
refused('selector not matching the template labels',
        "    metadata:\n      labels: {app: web}", "    metadata:\n      labels: {app: api}",
        qr/`selector` does not match template `labels` \(apps ValidateDeploymentSpec\)/);

# ---- names (meta ValidateObjectMeta, core ValidateServiceName, containers)
refused('a Deployment name with capitals', "  name: web\n  labels", "  name: Web\n  labels",
        qr/metadata\.name: "Web": a lowercase RFC 1123 subdomain/);
refused('a Service name starting with a digit', "kind: Service\nmetadata:\n  name: web",
        "kind: Service\nmetadata:\n  name: 1web",
        qr/Service\/1web: metadata\.name: "1web": a DNS-1035 label must/);
refused('a container name with "_"', '- name: main', '- name: main_1',
        qr/containers\[0\]\.name: "main_1": a lowercase RFC 1123 label/);
refused('an init container and a container of one name', '- name: init', '- name: main',
        qr/containers\[0\]\.name: Duplicate value: "main" \(core validateContainers\)/);
refused('a volumeMount naming no volume', '{name: data, mountPath: /data}',
        '{name: date, mountPath: /data}',
        qr/volumeMounts\[0\]\.name: Not found: "date"/);
refused('two volumes of one name', '- name: keys', '- name: data',
        qr/volumes\[1\]\.name: Duplicate value: "data"/);
refused('a label value of 64 characters', "  labels: {app: web}\nspec",
        "  labels: {app: web, release: " . ('x' x 64) . "}\nspec",
        qr/metadata\.labels\.release: "x{64}": a valid label must be/);
refused('a Secret volume mode over 0777', 'defaultMode: 0400', 'defaultMode: 01000',
        qr/defaultMode: 512: must be a number between 0 and 0777 \(octal\), both inclusive/);

# ---- core ValidateService
refused('a Service with two ports, one unnamed', '{name: metrics, port: 9100',
        '{port: 9100', qr/spec\.ports\[1\]\.name: Required value/);

# ---- policy, ConfigMap size, ServiceMonitor, cross checks
refused('a PDB with minAvailable and maxUnavailable', sub {
            $_[0] . "---\napiVersion: policy/v1\nkind: PodDisruptionBudget\n"
            . "metadata: {name: web}\nspec:\n  minAvailable: 1\n  maxUnavailable: 1\n"
            . "  selector: {matchLabels: {app: web}}\n" }, undef,
        qr/minAvailable and maxUnavailable cannot be both set \(policy ValidatePodDisruptionBudgetSpec\)/);
refused('a tokenizer.json in a ConfigMap (over 1 MiB)', sub {
            $_[0] . "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: tok}\n"
            . "data:\n  tokenizer.json: " . ('a' x 1048577) . "\n" }, undef,
        qr/ConfigMap\/tok: data: Too long: must have at most 1048576 bytes/);
refused('a StatefulSet whose serviceName names no Service', sub {
            (my $y = $_[0]) =~ s/kind: Deployment/kind: StatefulSet/;
            $y =~ s/^spec:\n  selector/spec:\n  serviceName: web-peers\n  selector/m;
            $y }, undef,
        qr/spec\.serviceName: no Service "web-peers" in the render \(cross\)/);
refused('a StatefulSet governed by a Service that is not headless', sub {
            (my $y = $_[0]) =~ s/kind: Deployment/kind: StatefulSet/;
            $y =~ s/^spec:\n  selector/spec:\n  serviceName: web\n  selector/m;
            $y }, undef,
        qr/Service "web" is not headless \(clusterIP: None\)/);
refused('a Service that selects no pod', 'selector: {app: web}
  ports', 'selector: {app: wbe}
  ports', qr/Service\/web: spec\.selector: selects no pod of the render/);
refused('a ServiceMonitor without selector', sub {
            $_[0] . "---\napiVersion: monitoring.coreos.com/v1\nkind: ServiceMonitor\n"
            . "metadata: {name: web}\nspec:\n  endpoints: [{port: http}]\n" }, undef,
        qr/ServiceMonitor\/web: spec\.selector: Required value/);

# ---- the schema stage (kubeconform against Kubernetes' JSON schemas)
refused('a field name typo (volumeMount)', "          volumeMounts:\n            - {name: data",
        "          volumeMount:\n            - {name: data",
        qr/additional properties 'volumeMount' not allowed/);
refused('a port as a string', 'containerPort: 8000}', 'containerPort: "8000"}',
        qr/containerPort': got string, want integer/);
refused('a kind that does not exist', 'kind: Deployment', 'kind: Deploymnet',
        qr/could not find schema for Deploymnet/);
refused('a replicas count as text', "spec:\n  selector:", "spec:\n  replicas: two\n  selector:",
        qr/replicas': got string, want null or integer/);
refused('duplicate YAML keys', "kind: Deployment\nmetadata:\n  name: web",
        "kind: Deployment\nmetadata:\n  name: web\n  name: web2",
        qr/Map keys must be unique/);

# ---- the chart refuses values that could not work: values.schema.json
# (helm checks it before rendering), then the templates' own checks
my $r = render(set => {protocol => 'grpc'});
isnt($r->{rc}, 0, 'chart: an unknown protocol is refused');
like($r->{out}, qr{at '/protocol': value must be one of 'nixl', 'lmcache', 'kv_agent'}, '... naming it');
$r = render(set => {'nixl.backend' => 'ucx'});
like($r->{out}, qr{at '/nixl/backend': value must be one of 'UCX', 'LIBFABRIC'}, 'chart: nixl.backend spelled wrong');
$r = render(set => {'model.source.type' => 'nfs'});
like($r->{out}, qr{at '/model/source/type': value must be one of 'pvc', 's3', 'hostPath'}, 'chart: a model source it lacks');
$r = render(set => {'decode.replica' => 2});
isnt($r->{rc}, 0, 'chart: a misspelt value (decode.replica) is refused, not ignored');
like($r->{out}, qr{at '/decode': additional properties 'replica' not allowed}, '... naming it');
$r = render(set => {'prefill.image.tag' => 'latest'});
like($r->{out}, qr{at '/prefill/image/tag': 'not' failed}, 'chart: an image tag "latest" is refused');
$r = render(set => {'gateway.metrics.allow[0]' => 'everyone'});
like($r->{out}, qr{at '/gateway/metrics/allow/0': 'everyone' does not match pattern}, 'chart: a metrics CIDR that is none');
$r = render(set => {'decode.resources.cpu' => '', 'decode.resources.memory' => ''});
isnt($r->{rc}, 0, 'chart: hugepages without cpu or memory refused before the API server');
like($r->{out}, qr/decode\.resources: hugepages2Mi needs cpu or memory as well/, '... naming the pool');

done_testing();
