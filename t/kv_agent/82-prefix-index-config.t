#!/usr/bin/perl
# "prefix_index" in the router's config (kv_agent/README.md): what
# `kv_agent check` accepts and shows, and each refusal, with the same
# verdict from `run` (it exits before binding anything).
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use KvAgentTest;

my $bin = kv_bin();
plan skip_all => "build/kv_agent not built" unless -x $bin;
my $dir = kv_tmpdir();

my $src = { node => "decode-0", http => "127.0.0.1:8100", model => "llama",
            endpoint => "tcp://127.0.0.1:5557" };

sub cfg {
    my (%o) = @_;
    my $c = agent_config(id => "router-0", role => $o{role} // "router",
                         port => kv_port(940));
    $c->{kv_events} = $o{kv_events} if $o{kv_events};
    $c->{prefix_index} = $o{pfx} if exists $o{pfx};
    my $f = "$dir/cfg-" . int(rand(1e9)) . ".json";
    open my $fh, '>', $f or die;
    print $fh json_enc($c);
    close $fh;
    return $f;
}

sub verdict {
    my ($verb, $f) = @_;
    my $out = `timeout 10 $bin $verb --config $f 2>&1`;
    return ($? >> 8, $out);
}

my $f = cfg(kv_events => [$src], pfx => { path => "$dir/pfx", slots => 4096,
                                          block => 32 });
my ($rc, $out) = verdict("check", $f);
is $rc, 0, "accepted" or diag $out;
like $out, qr/prefix index: \Q$dir\E\/pfx \(4096 slots, block 32, 2048 engine ids\)/,
     "shown by check (map entries default to slots/2)";

for my $bad (
    [{ pfx => { path => "$dir/p" } }, qr/needs "kv_events"/, "no sources"],
    [{ kv_events => [$src], pfx => { path => "$dir/p", slots => 3000 } },
     qr/power of two/, "slots not a power of two"],
    [{ kv_events => [$src], pfx => { path => "$dir/p", slots => 512 } },
     qr/"slots" must be an integer/, "too few slots"],
    [{ kv_events => [$src], pfx => { path => "rel/p" } },
     qr/must be absolute/, "a relative path"],
    [{ kv_events => [$src], pfx => { path => "$dir/router-0.state" } },
     qr/is the state table's/, "the state table's path"],
    [{ kv_events => [$src], pfx => { path => "$dir/p", blocks => 16 } },
     qr/blocks/, "an unknown key"],
    [{ kv_events => [$src], pfx => { path => "$dir/p", block => 0 } },
     qr/"block"/, "block 0"],
    [{ kv_events => [$src], pfx => "on" }, qr/must be an object/,
     "not an object"],
    [{ kv_events => [{ %$src, model => undef }], pfx => { path => "$dir/p" } },
     qr/"model" is needed/, "a source without model"],
) {
    my ($o, $re, $name) = @$bad;
    delete $o->{kv_events}[0]{model}
        if $o->{kv_events} && !defined $o->{kv_events}[0]{model};
    my $g = cfg(%$o);
    for my $verb (qw(check run)) {
        my ($r, $t) = verdict($verb, $g);
        is $r, 2, "$name: $verb refuses";
        like $t, $re, "... saying why" or diag $t;
    }
}
ok !-e "$dir/p", "nothing was created by a refused config";

done_testing();
