# deploy/helm/dpd-gateway with protocol kv_agent: accepted by kubeconform
# and the API server's rules; a kv_agent sidecar in every engine pod and in
# the gateway (then a StatefulSet: routers need stable node ids), holding
# the EFA devices and hugepages (a device goes to one container), IPC_LOCK;
# each pod's config made from its role's template by the init container
# with the pod's own name and IP (downward API), peers by their stable DNS
# names; the link keys from the Secret that the chart README's one-liner
# makes (run here as written, with kubectl recorded), each pod mounting
# only its role's links; and every pod's config passes today's
# `kv_agent check`, both ends of a link holding the same key.
use strict;
use warnings;

use FindBin;
use lib $FindBin::Bin;
use DPDHelm;
use Test::More;

need_tools();

my %set = (protocol => 'kv_agent', 'decode.replicas' => 2);
my $r = render(set => \%set);
is($r->{rc}, 0, 'helm template, protocol kv_agent, 2 decoders') or diag $r->{out};
my ($rc, $out) = check($r->{file});
is($rc, 0, 'accepted by kubeconform + the API server rules') or diag $out;
like($out, qr/Valid: 14, Invalid: 0, Errors: 0/, '14 objects validated') or diag $out;

my ($gw) = find_objects($r, 'StatefulSet', 'dpd-gateway');
ok($gw, 'the gateway is a StatefulSet (stable router ids)');
is($gw->{spec}{serviceName}, 'dpd-gateway-peers', '... named through dpd-gateway-peers');
my ($gp) = find_objects($r, 'Service', 'dpd-gateway-peers');
ok($gp && $gp->{spec}{clusterIP} eq 'None' && $gp->{spec}{publishNotReadyAddresses},
   'dpd-gateway-peers: headless, not-ready pods included');

my ($kcm) = find_objects($r, 'ConfigMap', 'dpd-kv-agent');
my @links = slurp($r->{file}) =~ /^# link: (\S+)$/mg;
is(scalar @links, 1 * 2 + 2 * (1 + 2), '8 links: prefill x decode + gateways x engines');

my %pods = (prefill => ['dpd-prefill-0'], decode => ['dpd-decode-0', 'dpd-decode-1'],
            gateway => ['dpd-gateway-0', 'dpd-gateway-1']);
for my $role (qw(prefill decode gateway)) {
    my ($ss) = find_objects($r, 'StatefulSet', "dpd-$role");
    my $c = containers_of($ss);
    ok($c->{'kv-agent'} && $c->{'kv-agent-config'}, "$role: kv_agent sidecar + config init");
    my $a = $c->{'kv-agent'};
    is_deeply($a->{securityContext}{capabilities}{add}, ['IPC_LOCK'], "$role: IPC_LOCK");
    my %env = map { $_->{name} => $_ } @{ $c->{'kv-agent-config'}{env} };
    is($env{POD_NAME}{valueFrom}{fieldRef}{fieldPath}, 'metadata.name',
       "$role: POD_NAME from the downward API");
    my ($keys) = grep { $_->{name} eq 'kv-agent-keys' } @{ $ss->{spec}{template}{spec}{volumes} };
    my @mine = sort grep { my $l = $_; grep { $l =~ /(^|\+)\Q$_\E[+.]/ } @{ $pods{$role} } } @links;
    is_deeply([sort map { $_->{key} } @{ $keys->{secret}{items} }], \@mine,
              "$role: mounts its role's links only (" . scalar(@mine) . ')');
    is($keys->{secret}{defaultMode}, 0400, "$role: keys mode 0400");
    next if $role eq 'gateway';
    my $v = $c->{vllm};
    ok(!exists $v->{resources}{limits}{'vpc.amazonaws.com/efa'}
       && !exists $v->{resources}{limits}{'hugepages-2Mi'},
       "$role: vLLM holds no EFA device or hugepages");
    is($v->{resources}{limits}{'nvidia.com/gpu'}, 8, "$role: vLLM holds the GPUs");
    is($a->{resources}{limits}{'vpc.amazonaws.com/efa'}, 32, "$role: the agent holds the EFA devices");
    is($a->{resources}{requests}{'hugepages-2Mi'}, $a->{resources}{limits}{'hugepages-2Mi'},
       "$role: ... and the hugepages, requests == limits");
    my %aenv = map { $_->{name} => $_->{value} } @{ $a->{env} };
    is($aenv{LD_LIBRARY_PATH}, '/opt/amazon/efa/lib64:/opt/amazon/efa/lib',
       "$role: the agent loads AWS's libfabric (efa provider) from the node");
    ok((grep { $_->{name} eq 'efa-libfabric' && $_->{mountPath} eq '/opt/amazon/efa'
               && $_->{readOnly} } @{ $a->{volumeMounts} }), "$role: ... mounted read-only");
    ok(!(grep { /^--kv-transfer-config/ } @{ $v->{args} }),
       "$role: no --kv-transfer-config unless kvAgent.kvTransferConfig names a connector");
}

my ($cm) = find_objects($r, 'ConfigMap', 'dpd-gateway');
like($cm->{data}{'nginx.conf'}, qr/^\s*dpd_decode_upstream\s+decode;/m, 'nginx: dpd_decode_upstream');
SKIP: {
    my ($rc, $out) = nginx_t($cm->{data}{'nginx.conf'});
    skip 'nginx 1.30.4 (make build-1.30) or the tokenizer fixture missing', 1
        unless defined $rc;
    is($rc, 0, 'the rendered nginx.conf passes nginx -t on nginx 1.30.4') or diag $out;
}

# ---- the README's key one-liner, as written, with kubectl recorded
my $readme = slurp("$CHART/README.md");
my ($oneliner) = $readme =~ /^(kubectl create secret generic dpd-kv-agent-keys [^\n]*)$/m;
ok($oneliner, 'the README has the key one-liner') or BAIL_OUT('no one-liner');
my $fake = "$DIR/fakebin";
mkdir $fake;
spew("$fake/kubectl", "#!/bin/sh\nprintf '%s\\n' \"\$@\" > '$DIR/kubectl.args'\n");
chmod 0755, "$fake/kubectl";
spew("$DIR/my-values.yaml", "protocol: kv_agent\ndecode:\n  replicas: 2\n");
my $deps = $ENV{DPD_DEPS} || "$ROOT/.deps";
{
    local $ENV{PATH} = "$fake:$deps/bin:$ENV{PATH}";
    spew("$DIR/oneliner.sh", "$oneliner\n");
    my $o = `cd '$DIR' && ln -sfn '$ROOT/deploy' deploy && bash -e oneliner.sh 2>&1`;
    is($? >> 8, 0, 'the one-liner runs') or diag $o;
}
my @args = split /\n/, slurp("$DIR/kubectl.args");
is_deeply([@args[0 .. 5]], [qw(create secret generic dpd-kv-agent-keys -n dpd)],
          'kubectl create secret generic dpd-kv-agent-keys -n dpd');
my %key = map { /^--from-literal=([^=]+)=(.*)$/ ? ($1 => $2) : () } @args;
is_deeply([sort keys %key], [sort @links], 'one key per link');
ok(!(grep { !/^[0-9a-f]{64}$/ } values %key), 'each 32 random bytes in hex');
my %uniq = map { $_ => 1 } values %key;
is(scalar keys %uniq, scalar @links, 'no two links share a key');

# ---- each pod's config, made as its init container makes it
SKIP: {
    my $agent = "$ROOT/build/kv_agent";
    skip 'build/kv_agent not built (make)', 1 unless -x $agent;
    my $kd = "$DIR/keys";
    mkdir $kd;
    for my $l (keys %key) {
        spew("$kd/$l", $key{$l});
        chmod 0400, "$kd/$l";
    }
    my %fp;
    for my $role (qw(prefill decode gateway)) {
        my ($ss) = find_objects($r, 'StatefulSet', "dpd-$role");
        my $script = containers_of($ss)->{'kv-agent-config'}{args}[0];
        $script =~ s/'/'\\''/g;
        my $td = "$DIR/tpl-$role";
        mkdir $td; mkdir "$td/run";
        for my $f (keys %{ $kcm->{data} }) {
            (my $t = $kcm->{data}{$f}) =~ s{/etc/kv_agent/keys}{$kd}g;
            spew("$td/$f", $t);
        }
        $script =~ s{/etc/kv_agent/template}{$td}g;
        $script =~ s{/etc/kv_agent/run}{$td/run}g;
        $script =~ s{/tmp/c\.json}{$td/c.json}g;
        for my $pod (@{ $pods{$role} }) {
            local $ENV{POD_NAME} = $pod;
            local $ENV{POD_IP} = '10.1.2.3';
            my $o = `sh -ec '$script' 2>&1`;
            is($? >> 8, 0, "$pod: the init container's script runs") or diag $o;
            my $c = JSON::PP->new->decode(slurp("$td/run/config.json"));
            is($c->{node_id}, $pod, "$pod: node_id is the pod's name");
            is($c->{http}, '10.1.2.3:8000', "$pod: http is the pod's IP") unless $role eq 'gateway';
            $o = `'$agent' check --config '$td/run/config.json' 2>&1`;
            is($? >> 8, 0, "$pod: `kv_agent check` accepts the config") or diag $o;
            while ($o =~ /^\s+peer (\S+) \(\w+\) at (\S+), key ([0-9a-f]+)$/mg) {
                my $link = join '+', sort($pod, $1);
                push @{ $fp{$link} }, $3;
            }
        }
    }
    is(scalar keys %fp, scalar @links, 'every link seen from its pods');
    ok(!(grep { @{ $fp{$_} } != 2 || $fp{$_}[0] ne $fp{$_}[1] } keys %fp),
       'both ends of every link hold the same key') or diag explain \%fp;
}

# a connector for vLLM, where the user has one
$r = render(set => {protocol => 'kv_agent',
                    'kvAgent.kvTransferConfig.kv_connector' => 'MyKvAgentConnector',
                    'kvAgent.kvTransferConfig.kv_role' => 'kv_both'});
my ($ss) = find_objects($r, 'StatefulSet', 'dpd-decode');
ok((grep { $_ eq '--kv-transfer-config={"kv_connector":"MyKvAgentConnector","kv_role":"kv_both"}' }
    @{ containers_of($ss)->{vllm}{args} }), 'kvAgent.kvTransferConfig reaches vLLM');

# ---- kvAgent.peers: dns -- one config per pool, peers from the headless
# Services (kv_agent's peers_dns); keys made ahead for 3 pods a pool
{
    my $r = render(set => {protocol => 'kv_agent', 'kvAgent.peers' => 'dns',
                           'decode.replicas' => 2,
                           'kvAgent.keysForReplicas' => 3});
    is($r->{rc}, 0, 'helm template, kvAgent.peers=dns') or diag $r->{out};
    my ($rc, $out) = check($r->{file});
    is($rc, 0, 'peers=dns: accepted by kubeconform + the API server rules')
        or diag $out;
    my @links = slurp($r->{file}) =~ /^# link: (\S+)$/mg;
    is(scalar @links, 3 * 3 * 3, 'peers=dns: links for 3 pods a pool '
       . '(a scale-up finds its keys)');
    my %link = map { $_ => 1 } @links;
    my ($kcm) = find_objects($r, 'ConfigMap', 'dpd-kv-agent');
    my %svc = (prefill => 'dpd-prefill-peers', decode => 'dpd-decode-peers',
               gateway => 'dpd-gateway-peers');
    my %krole = (prefill => 'prefill', decode => 'decode',
                 gateway => 'router');
    for my $role (qw(prefill decode gateway)) {
        my $c = JSON::PP->new->decode($kcm->{data}{"$role.json"});
        is_deeply($c->{peers}, [], "peers=dns: $role lists no peer");
        is($c->{listen}, '@POD_IP@:18001',
           "peers=dns: $role listens (and connects) from its pod IP");
        my @others = grep { $_ ne $role } qw(prefill decode gateway);
        is_deeply([sort map { $_->{name} } @{ $c->{peers_dns} }],
                  [sort map { "$svc{$_}.dpd.svc.cluster.local" } @others],
                  "peers=dns: $role resolves the other pools' headless "
                  . "Services");
        # every pod of this role, every pod of each other pool: the
        # pattern names a key file the Secret holds
        my $ok = 1;
        for my $e (@{ $c->{peers_dns} }) {
            my ($pr) = grep { $krole{$_} eq $e->{role} } @others;
            for my $i (0 .. 2) {
                for my $k (0 .. 2) {
                    (my $f = $e->{key_file}) =~ s/\@POD_NAME\@/dpd-$role-$i/;
                    $f =~ s/\{peer\}/dpd-$pr-$k/;
                    $f =~ s{^/etc/kv_agent/keys/}{};
                    $ok = 0, diag "no link $f" unless $link{$f};
                }
            }
        }
        ok($ok, "peers=dns: $role: each pattern names a link of the Secret");
        my ($ss) = find_objects($r, 'StatefulSet', "dpd-$role");
        my ($keys) = grep { $_->{name} eq 'kv-agent-keys' }
            @{ $ss->{spec}{template}{spec}{volumes} };
        ok(!$keys->{secret}{items} && $keys->{secret}{defaultMode} == 0400,
           "peers=dns: $role mounts the Secret whole, mode 0400 (pods come "
           . "and go without a render)");
        SKIP: {
            my $agent = "$ROOT/build/kv_agent";
            skip 'build/kv_agent not built (make)', 1 unless -x $agent;
            (my $t = $kcm->{data}{"$role.json"}) =~ s/\@POD_NAME\@/dpd-$role-0/g;
            $t =~ s/\@POD_IP\@/10.1.2.3/g;
            spew("$DIR/dns-$role.json", $t);
            chmod 0600, "$DIR/dns-$role.json";
            my $o = `'$agent' check --config '$DIR/dns-$role.json' 2>&1`;
            is($? >> 8, 0, "peers=dns: `kv_agent check` accepts the $role "
               . "config") or diag $o;
        }
    }
}

done_testing();
