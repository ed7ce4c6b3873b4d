# docker/k8s/*.yaml validated offline against the Kubernetes API schemas
# (t/deploy/k8s-validate.mjs: kubernetes-models' JSON schemas, unknown
# fields from @kubernetes/client-node's models, the API server's own
# checks), so a typo fails here; wrong manifests of each kind of mistake
# must be refused with their reason; and what the manifests promise:
# the tokenizer does not come from a ConfigMap (1 MiB limit), the pools
# are headless Services that nginx.conf names with `resolve`.
use strict;
use warnings;

use FindBin;
use File::Temp ();
use Test::More;

my $root = "$FindBin::Bin/../..";
my $npm = $ENV{DPD_NPM} || "$root/tools/npm/node_modules";
my $validator = "$FindBin::Bin/k8s-validate.mjs";

plan skip_all => 'node not installed (make deps)'
    unless system('node --version >/dev/null 2>&1') == 0;
plan skip_all => "npm packages kubernetes-models, \@kubernetes/client-node, "
                 . "yaml not in $npm (make deps)"
    unless -f "$npm/kubernetes-models/package.json"
        && -f "$npm/\@kubernetes/client-node/package.json"
        && -f "$npm/yaml/package.json";

sub validate {
    my @files = @_;
    local $ENV{DPD_NPM} = $npm;
    my $out = `node '$validator' @{[map { "'$_'" } @files]} 2>&1`;
    return ($? >> 8, $out);
}

sub slurp {
    open my $in, '<', $_[0] or die "$_[0]: $!\n";
    local $/;
    return scalar <$in>;
}

my @manifests = sort glob "$root/docker/k8s/*.yaml";
ok(@manifests >= 4, 'manifests found: ' . scalar @manifests);

# ---- every shipped manifest, each document

my ($rc, $out) = validate(@manifests);
is($rc, 0, 'docker/k8s/*.yaml pass the Kubernetes schemas') or diag $out;
my %kinds = map { $_ => 1 } $out =~ /^ok \S+ (\w+)\//mg;
for my $k (qw(Namespace Deployment StatefulSet Service)) {
    ok($kinds{$k}, "a $k was checked");
}
unlike($out, qr/^not ok/m, 'no problem reported');

# ---- wrong manifests: each refused, with the reason

my $dir = File::Temp::tempdir(CLEANUP => 1);
my $n = 0;
sub refused {
    my ($what, $yaml, $why, @more) = @_;
    my $file = "$dir/case-" . ++$n . '.yaml';
    open my $o, '>', $file or die $!;
    print $o $yaml;
    close $o;
    my ($rc, $out) = validate($file, @more);
    is($rc, 1, "refused: $what") or diag $out;
    like($out, $why, "reason given: $what") or diag $out;
}

my $gateway = slurp("$root/docker/k8s/gateway.yaml");

# the real file, one typo each
(my $t = $gateway) =~ s/^(\s+)volumeMounts:/$1volumeMount:/m;
refused('typo in a field name (volumeMount)', $t,
        qr/unknown field "volumeMount" in V1Container \(did you mean volumeMounts/);
($t = $gateway) =~ s/containerPort: 8000/containerPort: "8000"/;
refused('a port as a string', $t,
        qr/containerPort: must be integer/);
($t = $gateway) =~ s/kind: Deployment/kind: Deploymnet/;
refused('a kind that does not exist', $t,
        qr/no kind Deploymnet in API version apps\/v1/);
($t = $gateway) =~ s/apiVersion: apps\/v1/apiVersion: apps\/v2/;
refused('an API version that does not exist', $t,
        qr/no kind Deployment in API version apps\/v2/);
($t = $gateway) =~ s/medium: Memory, sizeLimit:/medium: Memory, sizeLimt:/;
refused('a typo deep in a volume (sizeLimt)', $t,
        qr/unknown field "sizeLimt" in V1EmptyDirVolumeSource/);

my $pod = sub {
    my ($spec) = @_;
    return <<"EOF";
apiVersion: apps/v1
kind: Deployment
metadata: {name: x, namespace: dpd}
spec:
  selector: {matchLabels: {app: x}}
  template:
    metadata: {labels: {app: x}}
    spec:
$spec
EOF
};

refused('a required field missing (containers)',
        $pod->("      volumes: []\n"),
        qr/must have required property containers/);
refused('a volumeMount naming no volume',
        $pod->(<<'EOF'), qr/no volume "data" in spec\.template\.spec\.volumes/);
      containers:
        - name: c
          image: i
          volumeMounts: [{name: data, mountPath: /d}]
EOF
refused('two containers of one name',
        $pod->(<<'EOF'), qr/duplicate container "c"/);
      containers:
        - {name: c, image: i}
        - {name: c, image: j}
EOF
refused('YAML 1.1 as Kubernetes reads it: on is a boolean',
        $pod->(<<'EOF'), qr/env\[0\]\.value: must be string/);
      containers:
        - name: c
          image: i
          env: [{name: FLAG, value: on}]
EOF
refused('a key given twice',
        $pod->(<<'EOF'), qr/YAML: Map keys must be unique/);
      containers:
        - name: c
          image: i
          image: j
EOF
(my $nomatch = $pod->("      containers: [{name: c, image: i}]\n"))
    =~ s/labels: \{app: x\}/labels: {app: y}/;
refused("a selector that does not match the pod template's labels",
        $nomatch, qr/selector does not match the pod template's labels/);
refused('a name that is not DNS-1123',
        $pod->("      containers: [{name: c, image: i}]\n")
            =~ s/name: x,/name: Bad_Name,/r,
        qr/"Bad_Name" is not a valid Deployment name/);
refused('a StatefulSet whose serviceName names no Service', <<'EOF',
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: s, namespace: dpd}
spec:
  serviceName: nowhere
  selector: {matchLabels: {app: s}}
  template:
    metadata: {labels: {app: s}}
    spec:
      containers: [{name: c, image: i}]
EOF
        qr/no Service "nowhere" in namespace dpd/);
refused('a Service selecting no pods', <<'EOF',
apiVersion: v1
kind: Service
metadata: {name: lost, namespace: dpd}
spec:
  selector: {app: nothing-has-this}
  ports: [{port: 80}]
EOF
        qr/selects no pods of the workloads in these files/);

# ---- what the manifests promise

# the tokenizer directory nginx.conf names comes from no ConfigMap
my $conf = slurp("$root/docker/nginx-gateway.conf");
my ($tok) = $conf =~ /^\s*dpd_tokenizer\s+(\S+)/m;
ok($tok, "nginx-gateway.conf names a tokenizer: $tok");
(my $tokdir = $tok // '') =~ s{/[^/]+$}{};
my ($mount) = $gateway =~ /\{name: (\S+), mountPath: \Q$tokdir\E[,}]/;
ok($mount, "the nginx container mounts $tokdir (volume "
           . ($mount // 'none') . ')');
my $mname = $mount // 'none';
my ($vol) = $gateway =~ /^\s+- name: \Q$mname\E\n\s+(\w+):/m;
ok($vol && $vol !~ /^(configMap|secret)$/,
   "that volume is no ConfigMap or Secret (1 MiB): " . ($vol // 'none'));

# the pools: headless Services, named in nginx.conf with `resolve`
for my $pool (qw(decode prefill)) {
    my $svc = slurp("$root/docker/k8s/vllm-$pool.yaml");
    like($svc, qr/^  clusterIP: None$/m, "vllm-$pool: a headless Service");
    like($conf, qr/^\s*server\s+vllm-$pool\.dpd\.svc\.cluster\.local:8000\s+
                   resolve\b/mx,
         "nginx-gateway.conf: the $pool pool follows its Service (resolve)");
}
like($conf, qr{^\s*include\s+/etc/nginx/dpd-resolver\.conf;}m,
     'nginx-gateway.conf takes the resolver the entrypoint writes');

done_testing();
