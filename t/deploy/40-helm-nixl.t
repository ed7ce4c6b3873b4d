# deploy/helm/dpd-gateway with its defaults (protocol nixl) and the values
# every protocol shares: rendered by the real `helm template`, accepted by
# kubeconform against Kubernetes 1.37's schemas and by the API server's
# rules (tools/k8s-check.sh), and saying what a user relies on: the KV
# connector vLLM is started with (NixlConnector, UCX or LIBFABRIC), images
# pinned, hugepages beside cpu/memory with requests == limits, the model
# from a PVC / S3 / hostPath, the tokenizer copied from the model, probes,
# routingThreshold -> dpd_threshold, metrics open to RFC 1918, Service
# type, Ingress, ServiceMonitor, PDBs, no kv_agent anywhere; and the
# gateway's nginx.conf passes `nginx -t` on nginx 1.30.4.
use strict;
use warnings;

use FindBin;
use lib $FindBin::Bin;
use DPDHelm;
use Test::More;

need_tools();

my $lint = `'$DPDHelm::HELM' lint '$CHART' 2>&1`;
is($? >> 8, 0, 'helm lint passes') or diag $lint;

my $r = render();
is($r->{rc}, 0, 'helm template with the defaults') or diag $r->{out};
my ($rc, $out) = check($r->{file});
is($rc, 0, 'defaults: kubeconform + API server rules accept every object')
    or diag $out;
like($out, qr/Summary: 12 resources found in 1 file - Valid: 12, Invalid: 0, Errors: 0/,
     'kubeconform validated all 12 objects against the schemas') or diag $out;
unlike($out, qr/^not ok/m, 'no rule broken');

my %kinds;
$kinds{$_->{kind}}++ for @{ $r->{docs} };
is_deeply(\%kinds, {StatefulSet => 2, Deployment => 1, Service => 5,
                    ConfigMap => 1, PodDisruptionBudget => 3},
          'objects: 2 engine StatefulSets, the gateway, 5 Services, its '
          . 'nginx.conf, 3 PDBs; no kv_agent ConfigMap or Secret')
    or diag explain \%kinds;

# ---- the engines
for my $role (qw(prefill decode)) {
    my ($ss) = find_objects($r, 'StatefulSet', "dpd-$role");
    ok($ss, "StatefulSet dpd-$role") or next;
    my $c = containers_of($ss);
    is_deeply([sort keys %$c], ['vllm'], "$role: only vLLM, no sidecar with nixl");
    my $v = $c->{vllm};
    is($v->{image}, 'vllm/vllm-openai:v0.33.0', "$role: image pinned");
    my @args = @{ $v->{args} };
    ok((grep { $_ eq '--served-model-name=llama-3.1-8b-instruct' } @args),
       "$role: --served-model-name");
    ok((grep { $_ eq '--tensor-parallel-size=8' } @args), "$role: TP 8");
    my ($ktc) = map { /^--kv-transfer-config=(.*)/ ? $1 : () } @args;
    is_deeply(JSON::PP->new->decode($ktc // 'null'),
              {kv_connector => 'NixlConnector', kv_role => 'kv_both',
               kv_connector_extra_config => {backends => ['UCX']}},
              "$role: NixlConnector, backend UCX");
    my %env = map { $_->{name} => $_ } @{ $v->{env} };
    is($env{POD_IP}{valueFrom}{fieldRef}{fieldPath}, 'status.podIP',
       "$role: POD_IP from the downward API");
    is($env{VLLM_NIXL_SIDE_CHANNEL_HOST}{value}, '$(POD_IP)',
       "$role: NIXL side channel on the pod's IP");
    my $res = $v->{resources};
    is_deeply($res->{limits}{'nvidia.com/gpu'}, 8, "$role: 8 GPUs");
    is($res->{requests}{'vpc.amazonaws.com/efa'}, 32, "$role: 32 EFA devices");
    is($res->{requests}{'hugepages-2Mi'}, $res->{limits}{'hugepages-2Mi'},
       "$role: hugepages requests == limits");
    ok($res->{requests}{cpu} && $res->{requests}{memory},
       "$role: cpu and memory beside the hugepages");
    for my $p (qw(startupProbe readinessProbe livenessProbe)) {
        is($v->{$p}{httpGet}{path}, '/health', "$role: $p on vLLM's /health");
    }
    is_deeply($ss->{spec}{template}{spec}{tolerations},
              [{key => 'nvidia.com/gpu', operator => 'Exists', effect => 'NoSchedule'}],
              "$role: tolerates the GPU nodes' taint");
    my %vol = map { $_->{name} => $_ } @{ $ss->{spec}{template}{spec}{volumes} };
    is($vol{model}{persistentVolumeClaim}{claimName}, 'models', "$role: model from the PVC");
    my ($svc) = find_objects($r, 'Service', "dpd-$role");
    is($svc->{spec}{clusterIP}, 'None', "$role: headless Service for nginx");
    ok(!$svc->{spec}{publishNotReadyAddresses}, '... with ready pods only');
    my ($peers) = find_objects($r, 'Service', "dpd-$role-peers");
    is($ss->{spec}{serviceName}, "dpd-$role-peers", "$role: pods named through -peers");
}

# ---- the gateway
my ($gw) = find_objects($r, 'Deployment', 'dpd-gateway');
my $gc = containers_of($gw);
is_deeply([sort keys %$gc], [qw(nginx tokenizer)],
          'gateway: nginx and the tokenizer init container, no kv_agent');
is($gc->{nginx}{image}, 'dpd-gateway:0.1.0', 'gateway image: ours, pinned');
is($gw->{spec}{replicas}, 2, 'gateway: 2 replicas');
like($gc->{tokenizer}{args}[0], qr{cp "/models/model/\$f" /models/tokenizer/},
     'tokenizer copied from the model volume (no ConfigMap size limit)');
my ($cm) = find_objects($r, 'ConfigMap', 'dpd-gateway');
my $conf = $cm->{data}{'nginx.conf'};
like($conf, qr/^\s*dpd_threshold\s+4096;/m, 'routingThreshold -> dpd_threshold');
like($conf, qr/^\s*dpd_protocol\s+nixl;/m, 'dpd_protocol nixl');
unlike($conf, qr/dpd_state_table/, 'no state table with nixl');
like($conf, qr/server dpd-decode\.dpd\.svc\.cluster\.local:8000 resolve/,
     'decode pool: the headless Service, resolve');
like($conf, qr/allow 10\.0\.0\.0\/8;\s+allow 172\.16\.0\.0\/12;\s+allow 192\.168\.0\.0\/16;\s+deny all;/,
     'metrics: RFC 1918 (EKS VPC 192.168/16 included), then deny');
my ($gsvc) = find_objects($r, 'Service', 'dpd-gateway');
is($gsvc->{spec}{type}, 'ClusterIP', 'gateway Service: ClusterIP');
my @pdb = find_objects($r, 'PodDisruptionBudget');
is(scalar @pdb, 3, 'a PDB per pool and for the gateway');

SKIP: {
    my ($rc, $out) = nginx_t($conf);
    skip 'nginx 1.30.4 (make build-1.30) or the tokenizer fixture missing', 1
        unless defined $rc;
    is($rc, 0, "the rendered nginx.conf passes nginx -t on nginx 1.30.4")
        or diag $out;
}

# ---- values users change
$r = render(set => {'nixl.backend' => 'LIBFABRIC', routingThreshold => 2048,
                    'gateway.service.type' => 'LoadBalancer',
                    'gateway.ingress.enabled' => 'true',
                    'gateway.ingress.host' => 'llm.example.com',
                    'gateway.metrics.serviceMonitor.enabled' => 'true',
                    'gateway.metrics.grafanaDashboard.enabled' => 'true',
                    'gateway.metrics.allow[0]' => '100.64.0.0/10',
                    'decode.replicas' => 3, 'decode.tensorParallelSize' => 4,
                    'decode.resources.gpus' => 4,
                    'prefill.nodeSelector.node\.kubernetes\.io/instance-type' => 'p5.48xlarge'});
is($r->{rc}, 0, 'helm template with changed values') or diag $r->{out};
($rc, $out) = check($r->{file});
is($rc, 0, '... accepted') or diag $out;
my ($ss) = find_objects($r, 'StatefulSet', 'dpd-prefill');
my ($ktc) = map { /^--kv-transfer-config=(.*)/ ? $1 : () }
            @{ containers_of($ss)->{vllm}{args} };
like($ktc, qr/"backends":\["LIBFABRIC"\]/, 'nixl.backend LIBFABRIC reaches vLLM');
is_deeply($ss->{spec}{template}{spec}{nodeSelector},
          {'node.kubernetes.io/instance-type' => 'p5.48xlarge'}, 'nodeSelector');
($ss) = find_objects($r, 'StatefulSet', 'dpd-decode');
is($ss->{spec}{replicas}, 3, 'decode replicas');
ok((grep { $_ eq '--tensor-parallel-size=4' } @{ containers_of($ss)->{vllm}{args} }),
   'decode TP 4');
($cm) = find_objects($r, 'ConfigMap', 'dpd-gateway');
like($cm->{data}{'nginx.conf'}, qr/^\s*dpd_threshold\s+2048;/m, 'dpd_threshold 2048');
like($cm->{data}{'nginx.conf'}, qr/allow 100\.64\.0\.0\/10;/, 'metrics CIDRs configurable');
($gsvc) = find_objects($r, 'Service', 'dpd-gateway');
is($gsvc->{spec}{type}, 'LoadBalancer', 'Service type LoadBalancer');
my ($ing) = find_objects($r, 'Ingress', 'dpd-gateway');
is($ing->{spec}{rules}[0]{host}, 'llm.example.com', 'Ingress with the host');
my ($sm) = find_objects($r, 'ServiceMonitor', 'dpd-gateway');
is_deeply($sm->{spec}{endpoints}, [{port => 'http', path => '/metrics', interval => '15s'}],
          'ServiceMonitor scrapes /metrics');
is($sm->{spec}{selector}{matchLabels}{'dpd.io/service'}, 'api',
   '... of the API Service only');
my ($dash) = find_objects($r, 'ConfigMap', 'dpd-gateway-dashboard');
is(($dash->{metadata}{labels} || {})->{grafana_dashboard}, '1',
   'the dashboard ConfigMap has the Grafana sidecar\'s label');
is_deeply(JSON::PP->new->decode($dash->{data}{'dpd-gateway.json'} // 'null'),
          JSON::PP->new->decode(slurp("$CHART/dashboards/dpd-gateway.json")),
          '... and holds the dashboard (t/151-metrics-routes.t checks its queries)');

# ---- the model from S3 and from the node
$r = render(set => {'model.source.type' => 's3'});
is($r->{rc}, 0, 'model from S3') or diag $r->{out};
($rc, $out) = check($r->{file});
is($rc, 0, '... accepted') or diag $out;
($ss) = find_objects($r, 'StatefulSet', 'dpd-decode');
my $dl = containers_of($ss)->{'model-download'};
like($dl->{args}[0], qr/aws s3 sync --only-show-errors "\$MODEL_URI" "\/models\/model"/,
     'engines: an init container syncs the model into the pod');
($gw) = find_objects($r, 'Deployment', 'dpd-gateway');
like(containers_of($gw)->{tokenizer}{args}[0],
     qr/for f in tokenizer.json tokenizer_config.json; do\s+aws s3 cp/,
     'gateway: only the two tokenizer files from S3');
$r = render(set => {'model.source.type' => 'hostPath'});
($rc, $out) = check($r->{file});
is($rc, 0, 'model from hostPath: accepted') or diag $out;
($ss) = find_objects($r, 'StatefulSet', 'dpd-decode');
my %vol = map { $_->{name} => $_ } @{ $ss->{spec}{template}{spec}{volumes} };
is($vol{model}{hostPath}{path}, '/mnt/models/current', 'hostPath');

# ---- README.md's EKS walkthrough: its my-values.yaml, as written
my $readme = slurp("$ROOT/README.md");
my ($mv) = $readme =~ /^ +cat > my-values\.yaml <<EOF\n(.*?)^ +EOF$/ms;
ok($mv, "README.md's my-values.yaml found") or diag 'no my-values.yaml block';
$mv =~ s/^ {7}//mg;
$mv =~ s/\$ECR/123456789012.dkr.ecr.us-west-2.amazonaws.com/g;
$r = render(values => $mv);
is($r->{rc}, 0, "README's my-values.yaml renders") or diag $r->{out};
($rc, $out) = check($r->{file});
is($rc, 0, '... and is accepted') or diag $out;
($gw) = find_objects($r, 'Deployment', 'dpd-gateway');
is(containers_of($gw)->{nginx}{image},
   '123456789012.dkr.ecr.us-west-2.amazonaws.com/dpd-gateway:0.1.0', '... our image from ECR');
my @cmds = $readme =~ /^ +(helm install dpd deploy\/helm\/dpd-gateway [^\n]*)$/mg;
is_deeply(\@cmds, ['helm install dpd deploy/helm/dpd-gateway -n dpd --create-namespace -f my-values.yaml'],
          'README: helm install with the release and namespace the Service names assume');
like($readme, qr{port-forward svc/dpd-gateway 8000:80 &\n\s+curl -N http://127\.0\.0\.1:8000/v1/chat/completions},
     'README: port-forward to the gateway Service (port 80) and a streamed curl');

# ---- no hugepages, no EFA: nothing of them rendered
$r = render(set => {'prefill.resources.hugepages2Mi' => '', 'prefill.resources.efa' => 0});
($rc, $out) = check($r->{file});
is($rc, 0, 'without hugepages and EFA: accepted') or diag $out;
($ss) = find_objects($r, 'StatefulSet', 'dpd-prefill');
my $v = containers_of($ss)->{vllm};
ok(!exists $v->{resources}{limits}{'hugepages-2Mi'}
   && !exists $v->{resources}{limits}{'vpc.amazonaws.com/efa'},
   'no hugepages or EFA requested');
ok(!(grep { $_->{name} eq 'FI_PROVIDER' } @{ $v->{env} }), 'no FI_PROVIDER=efa');

done_testing();
