# deploy/helm/dpd-gateway with protocol lmcache: accepted by kubeconform
# and the API server's rules; vLLM started with LMCacheConnectorV1
# (producer / consumer) and LMCache's PD settings as its docs name them
# (LMCACHE_ENABLE_PD, LMCACHE_PD_ROLE sender/receiver, LMCACHE_PD_PROXY_HOST
# and _PORT on the prefill, LMCACHE_PD_PEER_{HOST,INIT_PORT,ALLOC_PORT} on
# the decoder); the gateway's kv_agent sidecar is LMCache's notify port
# (a Service for pd_proxy_host) and its config passes today's
# `kv_agent check`; nginx gets dpd_lmcache_ports with one port per decode
# TP rank; and the chart refuses what cannot work: more than one gateway
# (the notices go to one pd_proxy_host) or a port count that is not the
# decode TP size.
use strict;
use warnings;

use FindBin;
use lib $FindBin::Bin;
use DPDHelm;
use Test::More;

need_tools();

my $r = render(set => {protocol => 'lmcache'});
isnt($r->{rc}, 0, 'lmcache with the default 2 gateways: refused');
like($r->{out}, qr/protocol lmcache: gateway\.replicas must be 1 \(LMCache's prefill sends its ProxyNotif to one pd_proxy_host/,
     '... saying why');

$r = render(set => {protocol => 'lmcache', 'gateway.replicas' => 1});
is($r->{rc}, 0, 'helm template, protocol lmcache') or diag $r->{out};
my ($rc, $out) = check($r->{file});
is($rc, 0, 'accepted by kubeconform + the API server rules') or diag $out;
like($out, qr/Valid: 14, Invalid: 0, Errors: 0/, '14 objects validated') or diag $out;

my %want_ktc = (prefill => ['kv_producer', 'producer1'],
                decode => ['kv_consumer', 'consumer1']);
for my $role (qw(prefill decode)) {
    my ($ss) = find_objects($r, 'StatefulSet', "dpd-$role");
    my $c = containers_of($ss);
    is_deeply([sort keys %$c], ['vllm'], "$role: no sidecar (LMCache runs inside vLLM)");
    my $v = $c->{vllm};
    is($v->{image}, 'lmcache/vllm-openai:2025-05-27-v1', "$role: an image with LMCache, pinned");
    my ($ktc) = map { /^--kv-transfer-config=(.*)/ ? $1 : () } @{ $v->{args} };
    is_deeply(JSON::PP->new->decode($ktc // 'null'),
              {kv_connector => 'LMCacheConnectorV1', kv_role => $want_ktc{$role}[0],
               kv_connector_extra_config => {discard_partial_chunks => JSON::PP::false(),
                                             lmcache_rpc_port => $want_ktc{$role}[1]}},
              "$role: LMCacheConnectorV1 $want_ktc{$role}[0]");
    my %env = map { $_->{name} => $_->{value} } @{ $v->{env} };
    is($env{LMCACHE_ENABLE_PD}, 'true', "$role: LMCACHE_ENABLE_PD");
    is($env{LMCACHE_PD_ROLE}, $role eq 'prefill' ? 'sender' : 'receiver',
       "$role: LMCACHE_PD_ROLE");
    if ($role eq 'prefill') {
        is($env{LMCACHE_PD_PROXY_HOST}, 'dpd-gateway-notify.dpd.svc.cluster.local',
           'prefill: notices to the gateway notify Service');
        is($env{LMCACHE_PD_PROXY_PORT}, '7500', '... port 7500');
    } else {
        is($env{LMCACHE_PD_PEER_HOST}, '$(POD_IP)', 'decode: receives on its pod IP');
        is($env{LMCACHE_PD_PEER_INIT_PORT}, join(',', 7300 .. 7307), '... init ports per rank');
        is($env{LMCACHE_PD_PEER_ALLOC_PORT}, join(',', 7400 .. 7407), '... alloc ports per rank');
    }
}

my ($gw) = find_objects($r, 'Deployment', 'dpd-gateway');
my $gc = containers_of($gw);
is_deeply([sort keys %$gc], [qw(kv-agent nginx tokenizer)],
          'gateway: nginx + a kv_agent sidecar (the notify port)');
is_deeply($gc->{'kv-agent'}{ports}, [{name => 'lmcache-notify', containerPort => 7500}],
          'kv_agent listens on 7500');
my ($ns) = find_objects($r, 'Service', 'dpd-gateway-notify');
is($ns->{spec}{ports}[0]{targetPort}, 'lmcache-notify', 'notify Service -> the sidecar');

my ($cm) = find_objects($r, 'ConfigMap', 'dpd-gateway');
my $conf = $cm->{data}{'nginx.conf'};
like($conf, qr/^\s*dpd_protocol\s+lmcache;/m, 'dpd_protocol lmcache');
like($conf, qr/^\s*dpd_state_table\s+\/dev\/shm\/dpd_state;/m, 'nginx reads the sidecar\'s table');
like($conf, qr/dpd_lmcache_ports init=7300,7301,7302,7303,7304,7305,7306,7307 alloc=7400,7401,7402,7403,7404,7405,7406,7407;/,
     'dpd_lmcache_ports: one port per decode TP rank');
SKIP: {
    my ($rc, $out) = nginx_t($conf);
    skip 'nginx 1.30.4 (make build-1.30) or the tokenizer fixture missing', 1
        unless defined $rc;
    is($rc, 0, 'the rendered nginx.conf passes nginx -t on nginx 1.30.4') or diag $out;
}

my ($kcm) = find_objects($r, 'ConfigMap', 'dpd-kv-agent');
my $kv = JSON::PP->new->decode($kcm->{data}{'gateway.json'});
is_deeply($kv->{lmcache_notify}, {listen => '0.0.0.0:7500',
                                  allow => ['10.0.0.0/8', '172.16.0.0/12', '192.168.0.0/16']},
          'kv_agent lmcache_notify: the port and the allowed senders');
SKIP: {
    my $agent = "$ROOT/build/kv_agent";
    skip 'build/kv_agent not built (make)', 2 unless -x $agent;
    my $f = spew("$DIR/lmcache-gateway.json", $kcm->{data}{'gateway.json'});
    my $o = `'$agent' check --config '$f' 2>&1`;
    is($? >> 8, 0, 'the gateway\'s kv_agent config passes `kv_agent check`') or diag $o;
    like($o, qr/node gateway \(router\), no fabric/, '... a router without fabric');
}

# one port per decode TP rank, or nothing renders
$r = render(set => {protocol => 'lmcache', 'gateway.replicas' => 1,
                    'decode.tensorParallelSize' => 4});
isnt($r->{rc}, 0, 'decode TP 4 with 8 LMCache ports: refused');
like($r->{out}, qr/lmcache\.initPorts and lmcache\.allocPorts: one port per decode TP rank \(4\), got 8 and 8/,
     '... saying why');
$r = render(set => {protocol => 'lmcache', 'gateway.replicas' => 1,
                    'decode.tensorParallelSize' => 2, 'decode.resources.gpus' => 2,
                    'lmcache.initPorts' => '{7300,7301}', 'lmcache.allocPorts' => '{7400,7401}'});
is($r->{rc}, 0, 'TP 2 with two ports each') or diag $r->{out};
($rc, $out) = check($r->{file});
is($rc, 0, '... accepted') or diag $out;

done_testing();
