# LMCache's ProxyNotif as msgspec itself encodes it (t/emu/lmcache_msgspec.py
# declares the structs as lmcache/v1/storage_backend/pd_backend.py does,
# LMCache/LMCache 07e0786947f9a4bf585563d280c7aee3882adecf), sent over
# ZeroMQ PUSH to a router kv_agent's lmcache_notify port, and the
# emulator's own notices compared byte for byte with msgspec's encoding.
#
#   * the agent records exactly what LMCache sends (the map form,
#     {"type": "ProxyNotif", "req_id": ...}): READY, peer "lmcache",
#     nblocks = distinct sender connections;
#   * for every variant, the agent accepts only what msgspec's own decoder
#     of the PDMsg union (LMCache's proxy, disagg_proxy_server.py) accepts
#     as a ProxyNotif; where the agent is stricter (duplicate keys, a
#     req_id the gateway never generates: empty, NUL, non-ASCII, space,
#     over 127 bytes, messages over 1 KiB) that is listed here, each
#     refused without a record and without harm;
#   * msgspec's array form (array_like=True, the tag first) is refused, as
#     LMCache's decoder (a map-form tagged union) refuses it.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/../inc";
use Test::More;
use JSON::PP;
use Time::HiRes qw(sleep time);
use DPD::Emu;
use DPD::KvAgent;

my $ROOT = DPD::Emu::root();
my $PY = ($ENV{DPD_VENV} || "$ROOT/.venv") . '/bin/python';
my $HELPER = "$ROOT/t/emu/lmcache_msgspec.py";

if (my ($why) = DPD::KvAgent->unavailable('tcp;ofi_rxm')) {
    plan skip_all => $why;
}
plan skip_all => "no msgspec/pyzmq in the venv ($PY; make deps)"
    unless -x $PY
           && system("$PY -c 'import msgspec, zmq, msgpack' 2>/dev/null") == 0;

my $J = JSON::PP->new->utf8->canonical;
my $abase = DPD::KvAgent::port_base() + 60;
my $NOTIFY = '127.0.0.1:' . ($abase + 1);

my $R = DPD::KvAgent->start(id => 'router-0', role => 'router',
    port => $abase,
    config => {lmcache_notify => {listen => $NOTIFY,
                                  allow => ['127.0.0.2/31']}});

sub helper {
    my (@args) = @_;
    my $cmd = join ' ', $PY, $HELPER, map { "'$_'" } @args;
    my @out = `$cmd 2>&1`;
    return ($? >> 8, map { my $l = $_; eval { $J->decode($l) } // {raw => $l} }
                         @out);
}

sub send_notice {
    my ($kind, $id, %o) = @_;
    my ($rc, $out) = helper('send', '--to', $NOTIFY,
        '--from', $o{from} // '127.0.0.2',
        ($o{count} ? ('--count', $o{count}) : ()),
        ($o{conns} ? ('--conns', $o{conns}) : ()),
        ($o{then} ? ('--then', $o{then}) : ()), $kind, $id);
    die "lmcache_msgspec.py send $kind: exit $rc"
        unless $rc == 0 || ($o{refusable} && $rc == 3);
    return $out;
}

sub table {
    my $out = `'@{[DPD::KvAgent::bin()]}' status --state '@{[$R->state_path]}' --json 2>&1`;
    my $j = eval { $J->decode($out) } || {};
    return {map { $_->{req_id} => $_ } @{ $j->{requests} || [] }};
}

sub wait_rec {
    my ($id, $timeout) = @_;
    my $deadline = time + ($timeout // 5);
    while (time < $deadline) {
        my $t = table();
        return $t->{$id} if $t->{$id};
        sleep 0.02;
    }
    return undef;
}

# --- what LMCache sends ---------------------------------------------------------

my $out = send_notice('notice', 'ms-plain');
is $out->{hex}, unpack('H*', "\x82\xa4type\xaaProxyNotif\xa6req_id\xa8ms-plain"),
    'msgspec encodes ProxyNotif as the map {"type": "ProxyNotif", "req_id"}';
ok $out->{msgspec}{ok}, 'msgspec decodes it back as a ProxyNotif';
my $rec = wait_rec('ms-plain');
ok $rec, 'the agent recorded the notice' or diag $R->log_text;
is $rec->{state}, 'ready', 'state ready';
is $rec->{peer}, 'lmcache', 'peer lmcache';
is $rec->{node}, '', 'no node id';
is $rec->{nblocks}, 1, 'one sender';

# two ranks (connections), each repeating its notice three times
send_notice('notice', 'ms-tp2', conns => 2, count => 3);
$rec = wait_rec('ms-tp2');
my $deadline = time + 3;
$rec = table()->{'ms-tp2'}, sleep 0.02
    while $rec && $rec->{nblocks} < 2 && time < $deadline;
is $rec && $rec->{nblocks}, 2, 'two connections, six notices: nblocks 2';

# a 127-byte req_id (the longest the table holds), str8 on the wire
my $long = 'L' x 127;
send_notice('notice', $long);
ok wait_rec($long), '127-byte req_id recorded';

# outside the allowlist: no record
send_notice('notice', 'ms-foreign', from => '127.0.0.9', refusable => 1);
send_notice('notice', 'ms-after-foreign');
ok wait_rec('ms-after-foreign'), 'marker after the foreign sender recorded';
ok !table()->{'ms-foreign'}, 'a notice from outside the allowlist: no record';

# --- the variants: msgspec's verdict and the agent's ------------------------------
# kind => [msgspec accepts it as a ProxyNotif, the agent records it]
my %expect = (
    notice     => [1, 1],
    taglast    => [1, 1],   # the tag after req_id: msgspec finds it anywhere
    extra      => [1, 1],   # unknown fields: msgspec ignores them
    array      => [0, 0],   # array_like form: LMCache's decoder wants a map
    allocreq   => [0, 0],   # siblings: decoded by msgspec, but no req_id
    allocresp  => [0, 0],
    unknowntag => [0, 0],
    lowertag   => [0, 0],
    intid      => [0, 0],
    binid      => [0, 0],
    nilid      => [0, 0],
    noid       => [0, 0],
    notype     => [0, 0],
    tagint     => [0, 0],
    intkey     => [0, 0],
    badutf8    => [0, 0],
    trailing   => [0, 0],
    truncated  => [0, 0],
    garbage    => [0, 0],
    # stricter than msgspec, on purpose: the gateway's req_ids are 32 hex
    # digits, a record key must be printable, and a message that says two
    # things (msgspec: the last key wins) is refused, not guessed at
    dupid      => [1, 0],
    duptype    => [1, 0],
    emptyid    => [1, 0],
    nulid      => [1, 0],
    utf8id     => [1, 0],
    spaceid    => [1, 0],
    longid     => [1, 0],   # 202 bytes: over the table's 127
    huge       => [1, 0],   # 4 KiB message: over 1 KiB, connection closed
);
my ($rc, @v) = helper('verdicts', 'k-x');
is $rc, 0, 'msgspec verdicts';
my %seen;
for my $v (@v) {
    my $k = $v->{kind} // next;
    $seen{$k} = 1;
    ok exists $expect{$k}, "variant $k is in the table" or next;
    is $v->{msgspec}{ok} ? 1 : 0, $expect{$k}[0],
        "msgspec " . ($expect{$k}[0] ? 'accepts' : 'refuses') . " $k"
        . ($v->{msgspec}{error} ? " ($v->{msgspec}{error})" : '');
}
is_deeply [sort keys %seen], [sort keys %expect], 'every variant checked';

my $malformed = 0;
for my $k (sort keys %expect) {
    my $id = "k-$k";
    if ($k eq 'huge') {
        # the connection is closed at 1 KiB: its marker comes on another
        send_notice($k, $id, refusable => 1);
        send_notice('notice', "m-$k");
    } else {
        send_notice($k, $id, then => "m-$k");
        $malformed++ unless $expect{$k}[1];
    }
    ok wait_rec("m-$k"), "$k: the marker after it recorded (agent alive)";
    my $t = table();
    my @ids = grep { /^k-\Q$k\E|^12345$|^$/ } keys %$t;
    if ($expect{$k}[1]) {
        is_deeply \@ids, [$id], "$k: recorded as $id";
        is $t->{$id}{nblocks}, 1, "$k: one sender";
    } else {
        is_deeply \@ids, [], "$k: no record";
    }
}
ok $R->alive, 'the agent survived every variant';

my %want = map { $_ => 1 } ('ms-plain', 'ms-tp2', $long, 'ms-after-foreign',
    (map { "m-$_" } keys %expect),
    (map { "k-$_" } grep { $expect{$_}[1] } keys %expect));
is_deeply [sort keys %{ table() }], [sort keys %want],
    'the table holds the accepted notices and nothing else';

# the totals the agent logs at exit: every refusal counted, no notice lost
my $accepted = keys %want;
$accepted += 1;                  # ms-tp2: two senders
$R->stop;
like $R->log_text,
    qr/lmcache_notify: $accepted notices accepted, 4 repeated, $malformed malformed, 0 for foreign records, [1-9]\d* connections refused/,
    "exit totals: $accepted accepted, 4 repeated, $malformed malformed"
    or diag $R->log_text;

# --- the emulator's notice is msgspec's encoding ------------------------------------

my $base = ($ENV{DPD_EMU_PORT} || 19000) + 13;
my $SINK = '127.0.0.1:' . ($base + 400);
my @rids = ('emu-1', 'E' x 40, 'x' x 127);
my $pid = open(my $sink, '-|', $PY, $HELPER, 'recv', '--bind', $SINK,
               '--count', scalar @rids, '--timeout', 30)
    // die "recv: $!";
my $first = <$sink>;
like $first // '', qr/"listening"/, 'a PULL socket where LMCache\'s proxy binds';

my %ports = (port => $base, side_channel_port => $base + 100,
             lmcache_init_port => $base + 200,
             lmcache_alloc_port => $base + 300);
my $p = DPD::Emu->start(host => '127.0.0.2', role => 'prefill', %ports,
                        time_scale => 0.02, python => $PY,
                        args => ['--lmcache-proxy', $SINK]);
my $d = DPD::Emu->start(host => '127.0.0.3', role => 'decode', %ports,
                        time_scale => 0.02, python => $PY);
for my $rid (@rids) {
    my $r = $p->post_json('/v1/completions', {
        prompt => 'a b c d e f', max_tokens => 1,
        kv_transfer_params => {ret_first_tok => JSON::PP::true,
            disagg_spec => {req_id => $rid, receiver_host => '127.0.0.3',
                            receiver_init_port => [$base + 200],
                            receiver_alloc_port => [$base + 300]}}},
        'X-Request-Id' => "h-" . substr($rid, 0, 20));
    is $r->code, 200, "prefill for " . substr($rid, 0, 12) . " answered";
}
my @got = map { eval { $J->decode($_) } || {raw => $_} } <$sink>;
close $sink;
is scalar @got, scalar @rids, 'one notice per request (one rank)';
my %by = map { (($_->{msgspec} || {})->{req_id} // '?') => $_ } @got;
for my $rid (@rids) {
    my $g = $by{$rid} || {};
    my $n = length $rid;
    ok $g->{msgspec}{ok}, "emulator notice ($n-byte id) decodes as LMCache's PDMsg";
    ok $g->{identical}, "emulator notice ($n-byte id) is byte-identical to "
        . "msgspec.msgpack.encode(ProxyNotif(...))" or diag $g->{hex};
}

done_testing();
