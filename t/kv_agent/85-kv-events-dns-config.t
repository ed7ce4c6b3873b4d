#!/usr/bin/perl
# "kv_events" sources given as a DNS name ({"dns", "port", "http_port",
# ...}, kv_agent/README.md): what `kv_agent check` accepts and shows, and
# each refusal, with the same verdict from `run` (it exits before binding
# anything), next to the static form, which is unchanged.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use KvAgentTest;

my $bin = kv_bin();
plan skip_all => "build/kv_agent not built" unless -x $bin;
my $dir = kv_tmpdir();

my $dns = { dns => 'vllm-decode-hl.${NS:-llm}.svc.cluster.local',
            port => 5557, replay_port => 5558, http_port => 8000,
            topic => "", model => "llama", resolve_ms => 2000 };
my $static = { node => "decode-0", http => "127.0.0.1:8100",
               model => "llama", endpoint => "tcp://127.0.0.1:5557" };

sub cfg {
    my (%o) = @_;
    my $c = agent_config(id => "router-0", role => $o{role} // "router",
                         port => kv_port(945));
    $c->{kv_events} = $o{kv_events} if $o{kv_events};
    $c->{prefix_index} = $o{pfx} if exists $o{pfx};
    my $f = "$dir/cfg-" . int(rand(1e9)) . ".json";
    open my $fh, '>', $f or die;
    print $fh json_enc($c);
    close $fh;
    return $f;
}

sub verdict {
    my ($verb, $f, %env) = @_;
    local @ENV{keys %env} = values %env;
    my $out = `timeout 10 $bin $verb --config $f 2>&1`;
    return ($? >> 8, $out);
}

# accepted: alone (the index fed by DNS sources only), and next to a
# static source; ${VAR} substituted in the name
my $f = cfg(kv_events => [$dns, $static],
            pfx => { path => "$dir/pfx", slots => 4096 });
my ($rc, $out) = verdict("check", $f, NS => "prod");
is $rc, 0, "accepted next to a static source" or diag $out;
like $out, qr/^kv_events: every address of vllm-decode-hl\.prod\.svc\.cluster\.local \(any, every 2000 ms\): ADDRESS:8000 from tcp:\/\/ADDRESS:5557 topic "", replay tcp:\/\/ADDRESS:5558$/m,
     "shown by check, \${NS} substituted" or diag $out;
like $out, qr/^kv_events: decode-0 \(127\.0\.0\.1:8100\) from tcp:\/\/127\.0\.0\.1:5557/m,
     "the static source as before";
($rc, $out) = verdict("check", cfg(kv_events => [{ %$dns,
                                                    family => "ipv6" }],
                                   pfx => { path => "$dir/pfx" }));
is $rc, 0, "DNS sources alone feed a prefix index" or diag $out;
like $out, qr/\(ipv6, every 2000 ms\)/, "family shown";
($rc, $out) = verdict("check", cfg(kv_events => [{
    dns => "10.0.0.7", port => 5557, http_port => 8000 }]));
is $rc, 0, "an address for a name, no replay, no model without an index"
    or diag $out;
like $out, qr/every 5000 ms\): ADDRESS:8000 from tcp:\/\/ADDRESS:5557 topic ""\n/,
     "default period 5 s, no replay";

my %no = map { $_ => undef } qw(port http_port model);
for my $bad (
    [{ %$dns, endpoint => "tcp://x:1" }, qr/"dns" and "endpoint" exclude each other/,
     "dns and endpoint"],
    [{ %$dns, node => "d0" }, qr/"dns" and "node" exclude/, "dns and node"],
    [{ %$dns, http => "x:1" }, qr/"dns" and "http" exclude/, "dns and http"],
    [{ %$dns, replay => "tcp://x:2" }, qr/"dns" and "replay" exclude/,
     "dns and replay"],
    [{ %$dns, port => undef }, qr/needs "port"/, "no port"],
    [{ %$dns, http_port => undef }, qr/needs "port" .*"http_port"/,
     "no http_port"],
    [{ %$dns, port => 0 }, qr/"port" must be an integer in \[1, 65535\]/,
     "port 0"],
    [{ %$dns, port => 65536 }, qr/"port" must be an integer/, "port 65536"],
    [{ %$dns, http_port => "80x" }, qr/"http_port" must be an integer/,
     "http_port not a number"],
    [{ %$dns, replay_port => -1 }, qr/"replay_port" must be an integer/,
     "negative replay_port"],
    [{ %$dns, replay_port => 5557 }, qr/"replay_port" is "port"/,
     "replay on the publisher's port"],
    [{ %$dns, dns => "" }, qr/"dns" must be a host name/, "empty name"],
    [{ %$dns, dns => "a b" }, qr/"dns" must be a host name/, "a space"],
    [{ %$dns, dns => "tcp://x" }, qr/"dns" must be a host name/, "a URL"],
    [{ %$dns, dns => "a..b" }, qr/"dns" must be a host name/, "an empty label"],
    [{ %$dns, dns => "-x.y" }, qr/"dns" must be a host name/, "a leading -"],
    [{ %$dns, dns => "a\x{1}b" }, qr/control character 0x01/,
     "a control byte (config_env.c)"],
    [{ %$dns, dns => "a\x{0}b" }, qr/a NUL character \(\\u0000\) in a string/,
     "a NUL byte"],
    [{ %$dns, dns => "a/b" }, qr/"dns" must be a host name/, "a slash"],
    [{ %$dns, dns => ("a" x 254) }, qr/"dns" must be a (host name|string shorter)/,
     "254 bytes"],
    [{ %$dns, dns => 7 }, qr/"dns" must be a string/, "not a string"],
    [{ %$dns, family => "ipv5" }, qr/"family" must be "any", "ipv4" or "ipv6"/,
     "a bad family"],
    [{ %$dns, resolve_ms => 50 }, qr/"resolve_ms" must be an integer in \[100, 3600000\]/,
     "resolve_ms too small"],
    [{ %$dns, resolve_ms => 3600001 }, qr/"resolve_ms" must be an integer/,
     "resolve_ms too large"],
    [{ %$dns, ttl => 5 }, qr/unknown key "ttl"/, "an unknown key"],
    [{ %$dns, model => undef }, qr/"model" is needed/,
     "no model with prefix_index"],
    [[$dns, { %$dns, dns => uc $dns->{dns} }], qr/given twice/,
     "one name and port twice"],
    [{ %$dns, role => "decode" }, qr/is for the router's agent/,
     "on a decode node"],
    [[ map { { %$dns, port => 1000 + $_ } } 1 .. 65 ], qr/at most 64 sources/,
     "65 entries"],
) {
    my ($src, $re, $name) = @$bad;
    my @srcs = ref $src eq 'ARRAY' ? @$src : ($src);
    my $role;
    for (@srcs) {
        $role = delete $_->{role} if exists $_->{role};
        for my $k (keys %$_) { delete $_->{$k} unless defined $_->{$k} }
    }
    my $g = cfg(kv_events => \@srcs, role => $role,
                pfx => $role ? undef : { path => "$dir/p" });
    for my $verb (qw(check run)) {
        my ($r, $t) = verdict($verb, $g);
        is $r, 2, "$name: $verb refuses";
        like $t, $re, "... saying why" or diag $t;
    }
}
ok !-e "$dir/p", "nothing was created by a refused config";

done_testing();
