#!/usr/bin/perl
# ${VAR} substitution in the agent's config (kv_agent/src/config_env.c): the
# downward API's POD_NAME/POD_IP give each replica its node id and address
# from one config.  Each refusal is checked on `run` and on `check` with the
# same message (both read the file through kv_config_load()), and a running
# agent's state-table record carries the substituted "http" nginx matches.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use KvAgentTest;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();

my $dir = kv_tmpdir();
my $bin = kv_bin();

sub write_file {
    my ($path, $data) = @_;
    open my $fh, '>', $path or die "$path: $!";
    print $fh $data;
    close $fh;
    chmod 0600, $path;
}

# runs "kv_agent SUB --config FILE" under a clean environment plus %$env
sub agent {
    my ($sub, $file, $env) = @_;
    local %ENV = (PATH => $ENV{PATH}, %{ $env // {} });
    my $out = `timeout 10 $bin $sub --config $file 2>&1`;
    return ($? >> 8, $out);
}

my $base = '"role":"router","listen":"127.0.0.1:1"';

# --- accepted forms --------------------------------------------------------
my @good = (
    [ '{"node_id":"${POD_NAME}",' . $base . '}', { POD_NAME => 'dpd-d-3' },
      qr/^node dpd-d-3 \(router\)/m, "plain \${VAR}" ],
    [ '{"node_id":"${POD_NAME:-solo}",' . $base . '}', {},
      qr/^node solo \(router\)/m, "default when unset" ],
    [ '{"node_id":"${POD_NAME:-solo}",' . $base . '}', { POD_NAME => '' },
      qr/^node solo \(router\)/m, "default when empty" ],
    [ '{"node_id":"n-${A}-${B:-b}",' . $base . '}', { A => 'x' },
      qr/^node n-x-b \(router\)/m, "two substitutions in one value" ],
    [ '{"node_id":"p$$q$r",' . $base . '}', {},
      qr/^node p\$q\$r \(router\)/m, "\$\$ is one \$, a lone \$ itself" ],
    [ '{"node_id":"${X}",' . $base . '}', { X => '${Y}', Y => 'no' },
      qr/^node \$\{Y\} \(router\)/m, "no recursive expansion" ],
    [ '{"node_id":"a","role":"router","listen":"${POD_IP}:7100",'
      . '"state":{"max_nodes":"${MAXN:-8}"}}', { POD_IP => '10.0.0.7' },
      qr/control 10\.0\.0\.7:7100/, "listen from POD_IP, numbers too" ],
);
for my $g (@good) {
    write_file("$dir/g.json", $g->[0]);
    my ($rc, $out) = agent('check', "$dir/g.json", $g->[1]);
    ok($rc == 0 && $out =~ $g->[2], "$g->[3]: accepted") or diag($out);
    like($out, qr/^expanded config:\n\{/m, "$g->[3]: expanded config printed");
}

# a static config prints exactly what it printed before substitution existed
write_file("$dir/s.json", '{"node_id":"a",' . $base . '}');
{
    my ($rc, $out) = agent('check', "$dir/s.json");
    is($out, "node a (router), no fabric (no pool), control 127.0.0.1:1, "
       . "0 peer(s)\nstate table: /dev/shm/dpd_state\n",
       "static config: check output unchanged");
}

# secrets substituted from the environment are never printed
{
    my $key = "5a" x 32;
    write_file("$dir/k.json", '{"node_id":"a",' . $base . ',"peers":[{"id":'
        . '"b","ctrl":"127.0.0.1:2","key":"${LINK_KEY}"}]}');
    my ($rc, $out) = agent('check', "$dir/k.json", { LINK_KEY => $key });
    ok($rc == 0 && $out =~ /"key":\s*"<redacted>"/ && $out !~ /$key/,
       "a key from the environment: accepted, redacted") or diag($out);
    # the file holds no key: no "readable by every user" warning
    chmod 0644, "$dir/k.json";
    ($rc, $out) = agent('check', "$dir/k.json", { LINK_KEY => $key });
    ok($rc == 0 && $out !~ /holds keys/,
       "a key from the environment: a readable config is not warned about")
        or diag($out);
    write_file("$dir/k2.json", '{"node_id":"${N:-a}",' . $base . ',"peers":'
        . '[{"id":"b","ctrl":"127.0.0.1:2","key":"' . $key . '"}]}');
    chmod 0644, "$dir/k2.json";
    ($rc, $out) = agent('check', "$dir/k2.json");
    ok($rc == 0 && $out =~ /holds keys and is readable by every user/
       && $out !~ /$key/, "a literal key in a readable config: warned, "
       . "and redacted in the expanded print") or diag($out);
}

# a StatefulSet's per-link key file named by the pod (README's scheme)
{
    mkdir "$dir/keys";
    write_file("$dir/keys/dpd-prefill-0+dpd-decode-1.key", ("6b" x 32) . "\n");
    write_file("$dir/p.json", '{"node_id":"${POD_NAME}",' . $base
        . ',"peers":[{"id":"dpd-decode-1","role":"decode","ctrl":'
        . '"dpd-decode-1.hl.${POD_NAMESPACE}.svc.cluster.local:7100",'
        . '"key_file":"${KEYS}/${POD_NAME}+dpd-decode-1.key"}]}');
    my $env = { POD_NAME => 'dpd-prefill-0', POD_NAMESPACE => 'ns1',
                KEYS => "$dir/keys" };
    my ($rc, $out) = agent('check', "$dir/p.json", $env);
    ok($rc == 0 && $out =~ /peer dpd-decode-1 \(decode\) at (?#
       )dpd-decode-1\.hl\.ns1\.svc\.cluster\.local:7100, key [0-9a-f]{16}/,
       "key_file and ctrl named from the pod's name and namespace")
        or diag($out);
    $env->{POD_NAME} = 'dpd-prefill-1';
    ($rc, $out) = agent('check', "$dir/p.json", $env);
    ok($rc == 2 && $out =~ /dpd-prefill-1\+dpd-decode-1\.key/,
       "another pod without that link's key file: refused, file named")
        or diag($out);
}

# --- refusals: run and check, same status, same message ---------------------
my @bad = (
    [ '{"node_id":"${POD_NAME}",' . $base . '}', {},
      qr/node_id: environment variable POD_NAME is not set/,
      "unset variable without default" ],
    [ '{"node_id":"a",' . $base . ',"peers":[{"id":"b","ctrl":"${PEER}:1",'
      . '"key":"' . ("5a" x 32) . '"}]}', {},
      qr/peers\[0\]\.ctrl: environment variable PEER is not set/,
      "error names the key's path" ],
    [ '{"node_id":"${POD_NAME}",' . $base . '}', { POD_NAME => "a\nb" },
      qr/node_id: control character 0x0a/, "newline from the environment" ],
    [ '{"node_id":"${POD_NAME}",' . $base . '}', { POD_NAME => "a\e[1m" },
      qr/node_id: control character 0x1b/, "ESC from the environment" ],
    [ '{"node_id":"${POD_NAME}",' . $base . '}', { POD_NAME => 'x' x 200 },
      qr/"node_id" must be a string shorter than/,
      "too long once expanded: the key's own bound" ],
    [ '{"node_id":"${POD_NAME}",' . $base . '}', { POD_NAME => 'x' x 5000 },
      qr/node_id: longer than 4096 bytes once expanded/,
      "huge value: refused before the key sees it" ],
    [ '{"node_id":"${POD_NAME}",' . $base . '}', { POD_NAME => '' },
      qr/"node_id" must not be empty/, "set but empty: validated as \"\"" ],
    [ '{"node_id":"${POD NAME}",' . $base . '}', {},
      qr/node_id: bad substitution/, "space in a name" ],
    [ '{"node_id":"${POD_NAME",' . $base . '}', {},
      qr/node_id: bad substitution/, "unterminated" ],
    [ '{"node_id":"${}",' . $base . '}', {},
      qr/node_id: bad substitution/, "empty name" ],
    [ '{"node_id":"${1A}",' . $base . '}', {},
      qr/node_id: bad substitution/, "name starting with a digit" ],
    [ '{"node_id":"${A:-x",' . $base . '}', {},
      qr/node_id: bad substitution/, "unterminated default" ],
    [ '{"node_id":"${' . ('A' x 200) . '}",' . $base . '}', {},
      qr/node_id: variable name longer than 128/, "huge name" ],
    [ '{"${K}":"a",' . $base . '}', { K => 'node_id' },
      qr/unknown key "\$\{K\}"/, "no substitution inside keys" ],
    [ '{"node_id":"a","role":"${ROLE}","listen":"127.0.0.1:1"}',
      { ROLE => 'chef' }, qr/role "chef" is not prefill, decode or/,
      "substituted value validated as the literal" ],
    [ '{"node_id":"a","role":"router","listen":"${POD_IP}"}',
      { POD_IP => '10.0.0.1' }, qr/"listen": "10\.0\.0\.1" is not host:port/,
      "substituted listen without a port" ],
    [ '{"node_id":"a",' . $base . ',"state":{"max_nodes":"${N}"}}',
      { N => '0' }, qr/"max_nodes" must be an integer in \[1, 4096\]/,
      "substituted number out of range" ],
);
for my $b (@bad) {
    write_file("$dir/b.json", $b->[0]);
    my ($rc, $out) = agent('run', "$dir/b.json", $b->[1]);
    ok($rc == 2 && $out =~ $b->[2], "$b->[3]: run refuses") or diag($out);
    my ($crc, $cout) = agent('check', "$dir/b.json", $b->[1]);
    ok($crc == 2 && $cout eq $out, "$b->[3]: check refuses, same message")
        or diag("check: $cout");
}

# --- what run refused that check let pass (found by the audit of run's
# start): the state table's directory, missing or writable by others and
# not sticky (a "${POD_NAME}.state" under a path the pod does not have)
mkdir "$dir/open";
chmod 0777, "$dir/open";
for my $c ([ "$dir/none/\${POD_NAME}.state",
             qr/error: state: directory \S+\/none of \S+: No such file/,
             "missing state directory" ],
           [ "$dir/open/t.state",
             qr/error: state: directory \S+\/open is writable by everyone (?#
                )and not sticky/, "state directory others may write" ]) {
    write_file("$dir/d.json", '{"node_id":"${POD_NAME}",' . $base
        . ',"state_path":"' . $c->[0] . '"}');
    my ($rc, $out) = agent('run', "$dir/d.json", { POD_NAME => 'n-0' });
    ok($rc == 1 && $out =~ $c->[1], "$c->[2]: run refuses") or diag($out);
    my ($crc, $cout) = agent('check', "$dir/d.json", { POD_NAME => 'n-0' });
    ok($crc == 1 && $cout =~ $c->[1] && $cout !~ /^node /m,
       "$c->[2]: check refuses, same message") or diag($cout);
}

# --- a running agent: the state table's record carries the expanded http ---
{
    my $port = kv_port(61);
    my $st = "$dir/state";
    write_file("$dir/r.json", '{"node_id":"${POD_NAME}","role":"router",'
        . '"listen":"127.0.0.1:' . $port . '","http":"${POD_IP}:8000",'
        . '"state_path":"' . $st . '","api_socket":"' . $dir . '/api.sock"}');
    my $pid = fork // die;
    if ($pid == 0) {
        %ENV = (PATH => $ENV{PATH}, POD_NAME => 'dpd-router-0',
                POD_IP => '10.42.0.9');
        open STDOUT, '>', "$dir/r.log";
        open STDERR, '>&', \*STDOUT;
        exec $bin, 'run', '--config', "$dir/r.json";
        exit 127;
    }
    my $j;
    for (1 .. 50) {
        select undef, undef, undef, 0.1;
        ($j) = status_json($st);
        last if $j;
    }
    kill 'TERM', $pid;
    waitpid $pid, 0;
    my ($self) = grep { $_->{id} eq 'dpd-router-0' } @{ $j->{nodes} // [] };
    ok($self, "the record is named by \${POD_NAME}")
        or diag(explain($j), `cat $dir/r.log`);
    is($self && $self->{http}, '10.42.0.9:8000',
       "its http is \${POD_IP}:8000, as nginx's resolved peer names it");
}

done_testing();
