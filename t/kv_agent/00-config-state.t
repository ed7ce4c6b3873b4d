#!/usr/bin/perl
# Configuration errors, the state table (status, --json, corrupt or
# wrong-version files at start), and the dpd_state.h reader helpers compiled
# stand-alone the way the nginx module will use them.
use strict;
use warnings;
no warnings 'portable';    # 64-bit magic constant
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use KvAgentTest;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();

my $dir = kv_tmpdir();
my $bin = kv_bin();
my $po = 60;

sub write_file {
    my ($path, $data) = @_;
    open my $fh, '>', $path or die "$path: $!";
    binmode $fh;
    print $fh $data;
    close $fh;
}

# --- configuration errors: exit 2 with a message that names the problem --
my @bad = (
    [ '{"node_id": "a",', qr/invalid JSON near byte/, "truncated JSON" ],
    [ '{"node_id":"a","role":"decode","listen":"127.0.0.1:1",'
      . '"colour":"blue"}', qr/unknown key "colour"/,
      "unknown key" ],
    [ '{"node_id":"a","role":"chef","listen":"127.0.0.1:1"}',
      qr/role "chef" is not prefill, decode or/, "bad role" ],
    [ '{"node_id":"a","role":"router","listen":"127.0.0.1:1",'
      . '"token":"12345678"}',
      qr/"token" \(one plaintext secret sent in every hello\) is no longer (?#
         )supported: remove it and give each entry of "peers" the key of (?#
         )that link as "key_file"/,
      "the old shared token: an error that says what to change" ],
    [ '{"node_id":"a","role":"router","listen":"127.0.0.1:1",'
      . '"peers":[{"id":"b","ctrl":"127.0.0.1:2"}]}',
      qr/peer b: give exactly one of "key", "keys" or "key_file"/,
      "a peer without a key" ],
    [ '{"node_id":"a","role":"router","listen":"127.0.0.1:1",'
      . '"peers":[{"id":"b","ctrl":"127.0.0.1:2","key":"00112233"}]}',
      qr/peer b: key: a key is 16 to 64 bytes written as hex/,
      "a short key" ],
    [ '{"node_id":"a","role":"router","listen":"127.0.0.1:1",'
      . '"peers":[{"id":"b","ctrl":"127.0.0.1:2","key":"'
      . ("zz" x 32) . '"}]}',
      qr/peer b: key: a key is 16 to 64 bytes written as hex/,
      "a key that is not hex" ],
    [ '{"node_id":"a","role":"router","listen":"127.0.0.1:1",'
      . '"peers":[{"id":"b","ctrl":"127.0.0.1:2","keys":["'
      . ("ab" x 32) . '","' . ("cd" x 32) . '","' . ("ef" x 32) . '"]}]}',
      qr/peer b: at most 2 keys/, "three keys for one link" ],
    # one key for two links: a node holding it could claim the other's id
    [ '{"node_id":"a","role":"router","listen":"127.0.0.1:1",'
      . '"peers":[{"id":"b","ctrl":"127.0.0.1:2","key":"' . ("ab" x 32)
      . '"},{"id":"c","ctrl":"127.0.0.1:3","key":"' . ("ab" x 32) . '"}]}',
      qr/peers b and c share the key \w+: each link needs its own key (?#
         )\(either node could claim to be the other\)/,
      "one key for two peers" ],
    [ '{"node_id":"a","role":"router","listen":"127.0.0.1:1",'
      . '"peers":[{"id":"b","ctrl":"127.0.0.1:2","keys":["' . ("01" x 32)
      . '","' . ("cd" x 32) . '"]},{"id":"c","ctrl":"127.0.0.1:3",'
      . '"keys":["' . ("ef" x 32) . '","' . ("cd" x 32) . '"]}]}',
      qr/peers b and c share the key \w+/,
      "two peers' next keys equal" ],
    [ '{"node_id":"a","role":"router","listen":"127.0.0.1:1",'
      . '"peers":[{"id":"b","ctrl":"127.0.0.1:2","key_file":"'
      . "$dir/no-such.key" . '"}]}',
      qr/peer b: key_file .*no-such\.key: No such file/,
      "a missing key file" ],
    [ '{"node_id":"a","role":"router","listen":"127.0.0.1:1",'
      . '"ctrl":{"hello_timeout_ms":0}}',
      qr/"hello_timeout_ms" must be an integer in \[50, 60000\]/,
      "hello timeout out of range" ],
    [ '{"node_id":"a","role":"decode","listen":"127.0.0.1:1"}',
      qr/a decode node needs a "pool"/, "decode without pool" ],
    [ '{"node_id":"a","role":"decode","listen":"127.0.0.1:1",'
      . '"pool":{"layers":0,"block_bytes":4096,'
      . '"blocks":4}}', qr/"layers" must be an integer in \[1, 4096\]/,
      "zero layers" ],
    [ '{"node_id":"a","role":"decode","listen":"127.0.0.1:1",'
      . '"pool":{"layers":2,"block_bytes":4096,'
      . '"blocks":4,"memory":"tpu:0"}}', qr/not host or cuda:<dev>/,
      "bad memory kind" ],
    [ '{"node_id":"a","role":"decode","listen":"127.0.0.1:1",'
      . '"pool":{"layers":2,"block_bytes":4096,"blocks":4,"ranks":9}}',
      qr/"ranks" must be an integer in \[1, 8\]/, "more ranks than 8" ],
    [ '{"node_id":"a","role":"decode","listen":"127.0.0.1:1",'
      . '"pool":{"layers":2,"block_bytes":4096,"blocks":4},'
      . '"transfer":{"staging":"sometimes"}}',
      qr/transfer\.staging: "sometimes" is not auto, off or host/,
      "bad staging mode" ],
    [ '{"node_id":"a","role":"decode","listen":"127.0.0.1:1",'
      . '"pool":{"layers":2,"block_bytes":4096,"blocks":4},'
      . '"transfer":{"stage_slots":0}}',
      qr/"stage_slots" must be an integer in \[1, 1024\]/,
      "zero staging slots" ],
    [ '{"node_id":"a","role":"decode","listen":"127.0.0.1:1",'
      . '"rails":[' . join(",", map { '"r' . $_ . '"' } 1 .. 33) . '],'
      . '"pool":{"layers":2,"block_bytes":4096,"blocks":4}}',
      qr/"rails": at most 32 names/, "33 rails" ],
);
for my $b (@bad) {
    write_file("$dir/bad.json", $b->[0]);
    chmod 0600, "$dir/bad.json";
    # timeout: a config "run" wrongly accepts would run for ever
    my $out = `timeout 10 $bin run --config $dir/bad.json 2>&1`;
    is($? >> 8, 2, "$b->[2]: exit status 2");
    like($out, $b->[1], "$b->[2]: message");
    $out = `$bin check --config $dir/bad.json 2>&1`;
    ok($? >> 8 != 0 && $out =~ $b->[1], "$b->[2]: check refuses it too")
        or diag($out);
}
my $out = `$bin run --config $dir/missing.json 2>&1`;
like($out, qr/missing\.json: No such file/, "missing config file named");

# --- key files: readable by others -> refused; 0600 -> accepted ---------
{
    my $kf = "$dir/a+b.key";
    write_file($kf, "# the a-b link\n" . ("5a" x 32) . "\n");
    my $cfg = '{"node_id":"a","role":"router","listen":"127.0.0.1:1",'
        . '"peers":[{"id":"b","ctrl":"127.0.0.1:2","key_file":"' . $kf
        . '"}]}';
    write_file("$dir/kf.json", $cfg);
    chmod 0644, $kf;
    my $o = `$bin check --config $dir/kf.json 2>&1`;
    ok($? >> 8 == 2 && $o =~ /key_file \S+a\+b\.key is mode 0644: others (?#
       )may read or change it \(chmod 600 or 640\)/,
       "a world-readable key file is refused") or diag($o);
    chmod 0600, $kf;
    $o = `$bin check --config $dir/kf.json 2>&1`;
    is($? >> 8, 0, "a 0600 key file is accepted") or diag($o);
    write_file($kf, "# nothing here\n");
    $o = `$bin check --config $dir/kf.json 2>&1`;
    like($o, qr/holds no key/, "an empty key file is refused");
    # an inline key in a world-readable config: a warning
    write_file("$dir/inl.json", '{"node_id":"a","role":"router",'
        . '"listen":"127.0.0.1:1","peers":[{"id":"b","ctrl":"127.0.0.1:2",'
        . '"key":"' . ("5a" x 32) . '"}]}');
    chmod 0644, "$dir/inl.json";
    $o = `$bin check --config $dir/inl.json 2>&1`;
    ok($? == 0 && $o =~ /holds keys and is readable by every user/,
       "inline keys in a world-readable config: warned") or diag($o);
}

# the example configurations shipped in conf/kv_agent are valid (their
# key files, under /etc/kv_agent/keys, are made here)
for my $src (glob(kv_root() . "/conf/kv_agent/*.json")) {
    my $cj = do { local (@ARGV, $/) = $src; <> };
    my $c = json_dec($cj);
    for my $p (@{ $c->{peers} // [] }) {
        ok($p->{key_file} && $p->{key_file} =~ m{^/etc/kv_agent/keys/},
           "example $src: peer $p->{id} has a key_file");
        my $kf = "$dir/" . (split m{/}, $p->{key_file})[-1];
        write_file($kf, link_key($c->{node_id}, $p->{id}) . "\n");
        chmod 0600, $kf;
        $p->{key_file} = $kf;
    }
    my $f = "$dir/example-" . (split m{/}, $src)[-1];
    write_file($f, json_enc($c));
    my $o = `$bin check --config $f 2>&1`;
    ok($? == 0 && $o =~ /^node \S+ \((prefill|decode|router)\)/,
       "example config " . (split m{/}, $f)[-1] . " passes check")
        or diag($o);
}

# --- a provider that is not there: refused unless fall-back is allowed -----
{
    my $cfg = agent_config(id => "decode-9", role => "decode",
        port => kv_port($po + 3), pool => small_pool(), provider => "efa",
        rails => "auto");
    my $a = start_agent($cfg);
    my $st = stop_agent($a);
    like(log_text($a), qr/provider "efa" not available: .*\(fall-back forbidden by config\)/,
         "missing provider with fall-back forbidden: clear error");
    ok($st != 0 && $st != -1, "... and the agent exits");
    $cfg->{allow_fallback} = JSON::PP::true;
    $cfg->{node_id} = "decode-8";
    $a = start_agent($cfg);
    like(log_text($a), qr/provider "efa" not available .*falling back/,
         "fall-back allowed: logged as a warning");
    like(log_text($a), qr/fabric: rail 0: provider \S+, fabric/,
         "... with the provider actually chosen");
    is(stop_agent($a), 0, "... and it runs");
}

# --- a router (no pool, no fabric): its own record in the table ----------
my $rcfg = agent_config(id => "router-0", role => "router",
    port => kv_port($po), http => "127.0.0.1:9999",
    peers => [{ id => "decode-0", ctrl => "127.0.0.1:" . kv_port($po + 1),
                role => "decode", http => "127.0.0.1:8200" }]);
my $r = start_agent($rcfg);
ok(log_text($r) =~ /info: ready$/m, "router started");
my ($st, $rc) = status_json($rcfg->{state_path});
is($rc, 0, "status --json exit 0");
is($st->{version}, 1, "table version 1");
is($st->{self}, "router-0", "writer id");
ok($st->{writer_alive}, "writer alive");
my ($self) = grep { $_->{id} eq "router-0" } @{ $st->{nodes} };
ok($self && $self->{alive} && $self->{self}, "own record alive");
is($self->{role}, "router", "own role");
is($self->{http}, "127.0.0.1:9999", "own http address");
my ($peer) = grep { $_->{id} eq "decode-0" } @{ $st->{nodes} };
ok($peer && !$peer->{alive}, "configured peer listed, not alive");
is($peer->{http}, "127.0.0.1:8200", "peer http address from config");
my $human = `$bin status --state $rcfg->{state_path}`;
like($human, qr/router-0\s+router\s+alive/, "status for humans");
like($human, qr/decode-0\s+decode\s+dead/, "... with the dead peer");
`$bin status --state $rcfg->{state_path} --req nope`;
is($? >> 8, 3, "status --req on an absent request exits 3");

# --- the reader helpers compile alone and find what the agent wrote -------
SKIP: {
    my ($cc) = grep { -x "$_/cc" } split /:/, $ENV{PATH};
    $cc &&= "$cc/cc";
    skip "no C compiler", 6 unless $cc;
    my $inc = kv_root() . "/kv_agent/include";
    write_file("$dir/reader.c", <<'EOC');
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include "dpd_state.h"
int main(int argc, char **argv) {
    struct stat sb; dpd_node_rec_t n; dpd_req_rec_t r; int fd, rc;
    void *m;
    fd = open(argv[1], O_RDONLY);
    if (fd < 0 || fstat(fd, &sb) != 0) return 2;
    m = mmap(NULL, sb.st_size, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED || dpd_state_check(m, sb.st_size) != 0) {
        printf("invalid\n"); return 1;
    }
    rc = dpd_state_find_node(m, argv[2], &n);
    printf("node %s rc=%d alive=%d role=%s total=%llu\n", argv[2], rc,
           rc == 1 && (n.flags & DPD_NODE_ALIVE) ? 1 : 0,
           rc == 1 ? dpd_state_role_name(n.role) : "-",
           rc == 1 ? (unsigned long long) n.total_blocks : 0ULL);
    if (argc > 3) {
        rc = dpd_state_find_req(m, argv[3], strlen(argv[3]), &r);
        printf("req %s rc=%d state=%s nblocks=%u\n", argv[3], rc,
               rc == 1 ? dpd_state_req_name(r.state) : "-",
               rc == 1 ? r.nblocks : 0);
    }
    printf("hash(abc)=%016llx\n",
           (unsigned long long) dpd_state_hash("abc", 3));
    return 0;
}
EOC
    my $cout = `$cc -std=c99 -D_DEFAULT_SOURCE -Wall -Wextra -Werror -pedantic -I$inc -o $dir/reader $dir/reader.c 2>&1`;
    is($?, 0, "dpd_state.h compiles stand-alone (C99, -pedantic -Werror)")
        or diag($cout);
    skip "reader did not build", 5 if $?;

    # a decode agent with a reservation, to find a request record
    my $dcfg = agent_config(id => "decode-0", role => "decode",
        port => kv_port($po + 1), pool => small_pool(blocks => 32),
        peers => [{ id => "router-0", ctrl => "127.0.0.1:" . kv_port($po),
                    role => "router" }]);
    my $d = start_agent($dcfg);
    my $res = api($d, { verb => "reserve", req_id => "chatcmpl-42",
                        nblocks => 5 });
    ok($res->{ok}, "reserve on the decode agent") or diag(json_enc($res));
    my $o = `$dir/reader $dcfg->{state_path} decode-0 chatcmpl-42`;
    like($o, qr/node decode-0 rc=1 alive=1 role=decode total=32/,
         "reader: node lookup by id");
    like($o, qr/req chatcmpl-42 rc=1 state=reserved nblocks=5/,
         "reader: request lookup by X-Request-Id");
    like($o, qr/hash\(abc\)=e71fa2190541574b/,
         "reader: FNV-1a 64 of the request id");
    $o = `$dir/reader $dcfg->{state_path} decode-0 chatcmpl-43`;
    like($o, qr/req chatcmpl-43 rc=0/, "reader: absent request");
    stop_agent($d);
}
stop_agent($r);

# --- corrupt / wrong-version / truncated files are recreated, logged ------
my $path = "$dir/broken.state";
my @cases = (
    [ "garbage" x 100, qr/is corrupt \(bad magic\): recreated/, "corrupt" ],
    [ pack("Q<L<", 0x3154415453445044, 7) . ("\0" x 500),
      qr/has wrong version 7 \(want 1\): recreated/, "wrong version" ],
    [ "DPD", qr/is truncated \(3 bytes\): recreated/, "truncated" ],
);
for my $c (@cases) {
    write_file($path, $c->[0]);
    my $cfg = agent_config(id => "router-1", role => "router",
                           port => kv_port($po + 2), state_path => $path);
    my $a = start_agent($cfg);
    ok(log_wait($a, $c->[1], 5), "$c->[2] state file: recreated and logged");
    my ($s2, $rc2) = status_json($path);
    ok($rc2 == 0 && $s2->{self} eq "router-1", "$c->[2]: table valid again");
    stop_agent($a);
}
my ($s3, $rc3) = status_json($path);
ok($rc3 == 0 && !$s3->{writer_alive}, "after SIGTERM the file stays valid "
   . "and says the writer stopped");
# --- the API socket: a live agent's is never taken; on exit an agent ------
# --- removes its socket file only while that file is still its own ------
{
    my $cfg = agent_config(id => "sock-a", role => "router",
                           port => kv_port($po + 5));
    my $a = start_agent($cfg);
    ok(log_text($a) =~ /info: ready$/m, "socket: first agent ready");
    my $cfg2 = agent_config(id => "sock-b", role => "router",
                            port => kv_port($po + 6));
    $cfg2->{api_socket} = $cfg->{api_socket};
    $cfg2->{state_path} = "$dir/sock-b.state";
    my $b = start_agent($cfg2, keep_socket => 1);
    ok(!agent_alive($b), "socket: a second agent on a live agent's socket "
       . "exits");
    like(log_text($b), qr/api: \Q$cfg->{api_socket}\E is in use by a running agent/,
         "socket: ... and says why");
    my $r = api($a, { verb => "info" });
    ok($r && $r->{ok}, "socket: the first agent still answers on it");

    # a new agent took the path while the old one shuts down: the old one
    # leaves the new socket in place
    rename $cfg->{api_socket}, "$dir/sock-a.old" or die "rename: $!";
    my $c = start_agent($cfg2);   # same path, binds it afresh
    ok(log_text($c) =~ /info: ready$/m, "socket: a new agent on the path");
    stop_agent($a);
    ok(-S $cfg->{api_socket}, "socket: the old agent's exit left the new "
       . "agent's socket file");
    $r = api($c, { verb => "info" });
    ok($r && $r->{ok}, "socket: the new agent answers");
    stop_agent($c);
    ok(!-e $cfg->{api_socket}, "socket: an agent removes its own file");
}
done_testing();
