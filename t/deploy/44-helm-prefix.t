# deploy/helm/dpd-gateway with routing.prefixCache (issue 23 through the
# chart of issue 24), each mode x each protocol: accepted by kubeconform
# and the API server's rules; the rendered nginx.conf's DPD location has
# `dpd_decode_upstream decode` and `dpd_prefix_cache` with the mode's
# parameters and prefill=prefill, over the zone + dpd_balance upstreams it
# requires, and passes nginx -t; every vLLM engine gets --block-size (the
# module's block=) and, with events, --kv-events-config as vLLM's
# KVEventsConfig (vllm/config/kv_events.py: enable_kv_cache_events,
# publisher, endpoint, replay_endpoint, topic) with both ports declared;
# the gateway pod gets a router-role kv_agent whose config follows each
# pool's headless "-peers" Service (kv_events "dns" sources, node =
# IP:8000 as nginx names the peer) into the prefix index nginx reads, on
# the /dev/shm emptyDir (medium Memory) both containers mount, and
# `kv_agent check` accepts it.  "off" renders nothing of it, and the chart
# refuses a mode it does not know, an engine --block-size in extraArgs
# (two block sizes) and index slots that are not a power of two.
use strict;
use warnings;

use FindBin;
use lib $FindBin::Bin;
use DPDHelm;
use JSON::PP ();
use Test::More;

need_tools();

my $agent = "$ROOT/build/kv_agent";

# the directives of one nginx block, found by its header: {name => [args]}
sub block_directives {
    my ($conf, $header) = @_;
    my $at = index($conf, $header);
    return unless $at >= 0;
    my $i = $at + length $header;
    my $depth = 1;
    my $body = '';
    while ($depth > 0 && $i < length $conf) {
        my $ch = substr($conf, $i++, 1);
        $depth++ if $ch eq '{';
        $depth-- if $ch eq '}';
        $body .= $ch if $depth == 1 || ($depth > 1);
    }
    $body =~ s/#[^\n]*//g;
    my %d;
    for my $stmt (split /;/, $body) {
        my @w = split ' ', $stmt;
        next unless @w;
        push @{ $d{ shift @w } }, [@w];
    }
    return \%d;
}

sub vllm_args {
    my ($r, $role) = @_;
    my ($ss) = find_objects($r, 'StatefulSet', "dpd-$role");
    return containers_of($ss)->{vllm};
}

sub gateway_of {
    my ($r) = @_;
    my ($gw) = find_objects($r, 'Deployment', 'dpd-gateway');
    ($gw) = find_objects($r, 'StatefulSet', 'dpd-gateway') unless $gw;
    return $gw;
}

my %dns = (prefill => 'dpd-prefill-peers.dpd.svc.cluster.local',
           decode => 'dpd-decode-peers.dpd.svc.cluster.local');

for my $mode (qw(off approximate events)) {
    for my $proto (qw(nixl lmcache kv_agent)) {
        my $t = "$mode/$proto";
        my %set = (protocol => $proto, 'routing.prefixCache' => $mode,
                   'gateway.replicas' => 1);
        # kv_agent: peers from DNS, so the configs need no per-pod keys
        # to pass `kv_agent check` here (42-helm-kv-agent.t checks both)
        $set{'kvAgent.peers'} = 'dns' if $proto eq 'kv_agent';
        my $r = render(set => \%set);
        is($r->{rc}, 0, "$t: helm template") or diag($r->{out}), next;
        my ($rc, $out) = check($r->{file});
        is($rc, 0, "$t: accepted by kubeconform + the API server rules")
            or diag $out;

        my ($cm) = find_objects($r, 'ConfigMap', 'dpd-gateway');
        my $conf = $cm->{data}{'nginx.conf'};
        my $loc = block_directives($conf, 'location ~ ^/v1/(chat/)?completions$ {');
        ok($loc, "$t: the DPD location") or next;
        my $gw = gateway_of($r);
        my $gc = containers_of($gw);

        if ($mode eq 'off') {
            ok(!$loc->{dpd_prefix_cache} && $conf !~ /dpd_cached_tokens/,
               "$t: no dpd_prefix_cache, no cached tokens logged");
            for my $role (qw(prefill decode)) {
                ok(!(grep { /^--(block-size|kv-events-config)/ }
                     @{ vllm_args($r, $role)->{args} }),
                   "$t: $role: no --block-size, no --kv-events-config");
            }
            ok(!$gc->{'kv-agent'}, "$t: no gateway kv_agent for nixl")
                if $proto eq 'nixl';
            next;
        }

        # ---- nginx
        is_deeply($loc->{dpd_decode_upstream}, [['decode']],
                  "$t: dpd_decode_upstream decode (once)");
        my $pc = $loc->{dpd_prefix_cache};
        is(scalar @{ $pc || [] }, 1, "$t: one dpd_prefix_cache") or next;
        my @a = @{ $pc->[0] };
        is($a[0], $mode, "$t: dpd_prefix_cache $mode");
        my %p = map { /^([a-z]+)=(.*)$/ ? ($1 => $2) : () } @a[1 .. $#a];
        is(scalar keys %p, $#a, "$t: every parameter is name=value");
        is($p{block}, 16, "$t: block=16");
        is($p{prefill}, 'prefill', "$t: prefill=prefill (the prefill "
           . "location's upstream)");
        if ($mode eq 'approximate') {
            is($p{zone}, 'dpd_prefix:16m', "$t: zone=dpd_prefix:16m");
            is($p{ttl}, '120s', "$t: ttl=120s");
            ok(!exists $p{file}, "$t: no file=");
        } else {
            is($p{file}, '/dev/shm/dpd_prefix', "$t: file=/dev/shm/dpd_prefix");
            is($p{stale}, '5s', "$t: stale=5s");
        }
        like($conf, qr{^\s*'cached=\$dpd_cached_tokens/\$dpd_uncached_tokens '$}m,
             "$t: the access log has the cached/uncached tokens");
        is_deeply($loc->{proxy_pass}, [['http://decode']],
                  "$t: the location proxies to the upstream it chooses in");
        for my $u (qw(decode prefill)) {
            my $ub = block_directives($conf, "upstream $u {");
            ok($ub && $ub->{zone} && $ub->{dpd_balance},
               "$t: upstream $u has a zone and dpd_balance");
        }
        my $pl = block_directives($conf, 'location /_dpd_prefill/ {');
        is_deeply($pl->{proxy_pass}, [['http://prefill/']],
                  "$t: the dpd_prefill_pass location's upstream is prefill");
        SKIP: {
            my ($rc, $out) = nginx_t($conf);
            skip 'nginx 1.30.4 (make build-1.30) or the tokenizer fixture '
                . 'missing', 1 unless defined $rc;
            is($rc, 0, "$t: the rendered nginx.conf passes nginx -t")
                or diag $out;
        }

        # ---- the engines
        for my $role (qw(prefill decode)) {
            my $v = vllm_args($r, $role);
            my @args = @{ $v->{args} };
            is(scalar(grep { $_ eq '--block-size=16' } @args), 1,
               "$t: $role: --block-size=16");
            my @kec = grep { s/^--kv-events-config=// } map { "$_" } @args;
            my %ports = map { $_->{name} => $_->{containerPort} }
                        @{ $v->{ports} };
            my ($peers) = find_objects($r, 'Service', "dpd-$role-peers");
            my %sp = map { $_->{name} => $_->{port} } @{ $peers->{spec}{ports} };
            if ($mode eq 'approximate') {
                is(scalar @kec, 0, "$t: $role: no --kv-events-config");
                ok(!exists $ports{'kv-events'}, "$t: $role: no kv-events port");
                next;
            }
            is(scalar @kec, 1, "$t: $role: one --kv-events-config") or next;
            is_deeply(JSON::PP->new->decode($kec[0]),
                      {enable_kv_cache_events => JSON::PP::true,
                       publisher => 'zmq', endpoint => 'tcp://*:5557',
                       replay_endpoint => 'tcp://*:5558', topic => ''},
                      "$t: $role: KVEventsConfig: zmq PUB 5557, replay 5558");
            is_deeply([@ports{qw(kv-events kv-replay)}], [5557, 5558],
                      "$t: $role: container ports 5557, 5558 declared");
            is_deeply([@sp{qw(kv-events kv-replay)}], [5557, 5558],
                      "$t: $role: ... and on its -peers Service");
        }

        # ---- the gateway's kv_agent
        if ($mode eq 'approximate') {
            ok(!$gc->{'kv-agent'}, "$t: no gateway kv_agent for nixl")
                if $proto eq 'nixl';
            next;
        }
        my $ka = $gc->{'kv-agent'};
        ok($ka, "$t: a kv_agent beside nginx") or next;
        my %shm = map { $_->{name} => $_ } @{ $gw->{spec}{template}{spec}{volumes} };
        is($shm{shm}{emptyDir}{medium}, 'Memory', "$t: /dev/shm is an emptyDir "
           . "in memory");
        is($shm{shm}{emptyDir}{sizeLimit}, '96Mi',
           "$t: ... sized for the index (1M slots x 32 bytes + 64Mi)");
        for my $c ('nginx', 'kv-agent') {
            ok((grep { $_->{name} eq 'shm' && $_->{mountPath} eq '/dev/shm'
                       && !$_->{readOnly} } @{ $gc->{$c}{volumeMounts} }),
               "$t: $c mounts it at /dev/shm");
        }
        my ($kcm) = find_objects($r, 'ConfigMap', 'dpd-kv-agent');
        my $json = $kcm->{data}{'gateway.json'};
        $json =~ s/\@POD_NAME\@/dpd-gateway-0/g;
        $json =~ s/\@POD_IP\@/10.1.2.3/g;
        my $c = JSON::PP->new->decode($json);
        is($c->{role}, 'router', "$t: a router-role agent");
        is_deeply([sort { $a->{dns} cmp $b->{dns} } @{ $c->{kv_events} }],
                  [map { {dns => $dns{$_}, port => 5557, replay_port => 5558,
                          http_port => 8000, topic => '', resolve_ms => 5000,
                          model => 'llama-3.1-8b-instruct'} }
                   qw(decode prefill)],
                  "$t: kv_events: each pool's -peers Service, node = IP:8000, "
                  . "the served model");
        is_deeply($c->{prefix_index}, {path => '/dev/shm/dpd_prefix',
                                       block => 16, slots => 1048576},
                  "$t: prefix_index where nginx reads it, block 16");
        ok($proto ne 'nixl' || !$c->{peers},
           "$t: nixl: no peers, no keys (a router that only subscribes)");
        SKIP: {
            skip 'build/kv_agent not built (make)', 1 unless -x $agent;
            my $f = spew("$DIR/$mode-$proto.json", $json);
            chmod 0600, $f;
            local $ENV{POD_NAME} = 'dpd-gateway-0';
            local $ENV{POD_NAMESPACE} = 'dpd';
            local $ENV{POD_IP} = '10.1.2.3';
            my $o = `'$agent' check --config '$f' 2>&1`;
            is($? >> 8, 0, "$t: `kv_agent check` accepts the gateway's "
               . "config") or diag $o;
        }
    }
}

# a bare `off` in a values file is YAML 1.1's false: still off
{
    my $r = render(values => "routing:\n  prefixCache: off\n");
    is($r->{rc}, 0, 'prefixCache: off (a YAML boolean) renders')
        or diag $r->{out};
    my ($cm) = find_objects($r, 'ConfigMap', 'dpd-gateway');
    unlike($cm->{data}{'nginx.conf'}, qr/dpd_prefix_cache/, '... as off');
}

# the knobs reach every end: block size 32, the directive's parameters
{
    my $r = render(set => {'routing.prefixCache' => 'events',
                           'routing.blockSize' => 32,
                           'routing.weights' => '2:16',
                           'routing.imbalance' => 'off',
                           'routing.events.stale' => '10s',
                           'routing.events.slots' => 4194304});
    is($r->{rc}, 0, 'events with blockSize 32 and knobs') or diag $r->{out};
    my ($cm) = find_objects($r, 'ConfigMap', 'dpd-gateway');
    my $loc = block_directives($cm->{data}{'nginx.conf'},
                               'location ~ ^/v1/(chat/)?completions$ {');
    is_deeply($loc->{dpd_prefix_cache}, [[qw(events file=/dev/shm/dpd_prefix
        block=32 stale=10s weights=2:16 imbalance=off prefill=prefill)]],
              'nginx: block=32 stale=10s weights=2:16 imbalance=off');
    for my $role (qw(prefill decode)) {
        ok((grep { $_ eq '--block-size=32' } @{ vllm_args($r, $role)->{args} }),
           "$role: --block-size=32");
    }
    my ($kcm) = find_objects($r, 'ConfigMap', 'dpd-kv-agent');
    my $c = JSON::PP->new->decode($kcm->{data}{'gateway.json'});
    is_deeply([@{ $c->{prefix_index} }{qw(block slots)}], [32, 4194304],
              'kv_agent: prefix_index block 32, 4M slots');
    my %v = map { $_->{name} => $_ }
            @{ gateway_of($r)->{spec}{template}{spec}{volumes} };
    is($v{shm}{emptyDir}{sizeLimit}, '192Mi', '/dev/shm sized for 4M slots');
    $r = render(set => {'routing.prefixCache' => 'approximate',
                        'routing.approximate.zoneSize' => '64m',
                        'routing.approximate.ttl' => '300s'});
    ($cm) = find_objects($r, 'ConfigMap', 'dpd-gateway');
    $loc = block_directives($cm->{data}{'nginx.conf'},
                            'location ~ ^/v1/(chat/)?completions$ {');
    is_deeply($loc->{dpd_prefix_cache}, [[qw(approximate zone=dpd_prefix:64m
        block=16 ttl=300s prefill=prefill)]], 'nginx: zone 64m, ttl 300s');
}

# refused, saying why
{
    my $r = render(set => {'routing.prefixCache' => 'exact'});
    isnt($r->{rc}, 0, 'prefixCache exact: refused');
    like($r->{out}, qr/prefixCache/, '... naming the value');
    $r = render(set => {'routing.prefixCache' => 'approximate',
                        'decode.extraArgs[0]' => '--block-size=32'});
    isnt($r->{rc}, 0, '--block-size in extraArgs with the cache on: refused');
    like($r->{out}, qr/set routing\.blockSize instead/, '... saying what to set');
    $r = render(set => {'routing.prefixCache' => 'events',
                        'routing.events.slots' => 3000});
    isnt($r->{rc}, 0, 'slots 3000: refused');
    like($r->{out}, qr/not a power of two/, '... not a power of two');
    $r = render(set => {'routing.prefixCache' => 'events',
                        'routing.blockSize' => 0});
    isnt($r->{rc}, 0, 'blockSize 0: refused by the schema');
}

done_testing();
