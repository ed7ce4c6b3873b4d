# docker/k8s/*.yaml, the plain manifests for `kubectl apply` without helm:
# dpd-gateway.yaml is the chart's rendering with its defaults
# (tools/k8s-manifests.sh, make k8s-manifests) and must be up to date with
# deploy/helm/dpd-gateway; every object passes tools/k8s-check.sh
# (kubeconform against Kubernetes 1.37's schemas + the API server's rules);
# and what the manifests promise: the tokenizer from no ConfigMap, the pools
# named with `resolve` through headless Services, no kv_agent sidecar with
# the default protocol (nixl), no `:latest` image.
use strict;
use warnings;

use FindBin;
use lib $FindBin::Bin;
use DPDHelm;
use Test::More;

need_tools();

my @files = sort glob "$ROOT/docker/k8s/*.yaml";
is_deeply([map { s{.*/}{}r } @files], ['dpd-gateway.yaml', 'namespace.yaml'],
          'docker/k8s: the rendered chart and the namespace, no hand-kept twins');

my $out = `bash '$ROOT/tools/k8s-manifests.sh' --check 2>&1`;
is($? >> 8, 0, 'docker/k8s/dpd-gateway.yaml is the chart rendered now (make k8s-manifests)')
    or diag $out;

my ($rc, $chk) = check(@files);
is($rc, 0, 'docker/k8s/*.yaml: accepted by kubeconform + the API server rules')
    or diag $chk;
like($chk, qr/Summary: 13 resources found in 2 files - Valid: 13, Invalid: 0, Errors: 0/,
     '13 objects validated against the schemas') or diag $chk;

my $text = slurp("$ROOT/docker/k8s/dpd-gateway.yaml");
unlike($text, qr/^\s*image:\s*\S+:latest\s*$/m, 'no :latest image');
unlike($text, qr/kind: ConfigMap\n(?:.*\n)*?\s+tokenizer\.json:/, 'no tokenizer in a ConfigMap');
like($text, qr/server dpd-decode\.dpd\.svc\.cluster\.local:8000 resolve/, 'decode pool by resolve');
like($text, qr/clusterIP: None/, 'headless Services');
unlike($text, qr/name: kv-agent/, 'no kv_agent sidecar with nixl');

# a stale rendering is caught: change the chart's output, expect --check to fail
{
    my $copy = "$DIR/k8s-copy";
    mkdir $copy;
    system("cp -r '$ROOT/docker' '$ROOT/deploy' '$ROOT/tools' '$copy/'") == 0 or die;
    my $v = slurp("$copy/deploy/helm/dpd-gateway/values.yaml");
    $v =~ s/^routingThreshold: 4096$/routingThreshold: 8192/m or die 'values edit';
    spew("$copy/deploy/helm/dpd-gateway/values.yaml", $v);
    local $ENV{DPD_DEPS} = $ENV{DPD_DEPS} || "$ROOT/.deps";
    my $o = `bash '$copy/tools/k8s-manifests.sh' --check 2>&1`;
    is($? >> 8, 1, 'a chart change without make k8s-manifests: --check fails');
    like($o, qr/-\s+dpd_threshold\s+4096;\n\+\s+dpd_threshold\s+8192;.*is stale: run make k8s-manifests/s,
         '... showing the difference and the fix') or diag $o;
}

done_testing();
