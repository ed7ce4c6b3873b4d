# vLLM emulator, kv_agent protocol when things go wrong: the decoder asked
# before the KV landed, instances without an agent, agents killed and
# restarted (the emulator re-registers its pool), --kv-wait-ms and
# --kv-push-wait-ms.  Real kv_agents over tcp;ofi_rxm on loopback.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/../inc";
use Test::More;
use JSON::PP;
use Time::HiRes qw(sleep time);
use DPD::Emu;
use DPD::KvAgent;

if (my ($why) = DPD::KvAgent->unavailable('tcp;ofi_rxm')) {
    plan skip_all => $why;
}

my $J = JSON::PP->new->utf8->canonical;
my $F = JSON::PP::false;
my $base = ($ENV{DPD_EMU_KVA_PORT} || 19500) + 20;
my $abase = DPD::KvAgent::port_base() + 10;
my $NBLK = 32;
my ($pa, $da) = DPD::KvAgent->pair(base => $abase,
    pool => DPD::KvAgent->small_pool(blocks => $NBLK),
    timeouts => {transfer_ms => 2000});

my %common = (port => $base, side_channel_port => $base + 10,
              no_lmcache => 1, time_scale => 0.02, kv_connect_timeout => 2);
my $p = DPD::Emu->start(host => '127.0.0.2', role => 'prefill',
                        kv_agent => $pa, %common);
my $d = DPD::Emu->start(host => '127.0.0.3', role => 'decode',
                        kv_agent => $da, kv_wait_ms => 3000, %common);
my $p0 = DPD::Emu->start(host => '127.0.0.4', role => 'prefill', %common);
my $d0 = DPD::Emu->start(host => '127.0.0.5', role => 'decode', %common);
ok $pa->wait_connected(['decode-0']), 'agents connected'
    or diag $pa->log_text, $da->log_text;
ok $da->wait_connected(['prefill-0']), 'agents connected both ways';
my $bs = $p->block_size;

my $prompt = join ' ', map { "tok$_" } 1 .. 100;     # 101 tokens (BOS)
my $ptoks = 101;
my $nfull = int($ptoks / $bs);
my $expect = $bs * int(($ptoks - 1) / $bs);

sub prefill {
    my ($rid, %o) = @_;
    my $r = ($o{on} // $p)->post_json('/v1/completions', {
        prompt => $prompt, max_tokens => 1, stream => $F,
        kv_transfer_params => {dpd => {req_id => $rid,
                                       decode_node => 'decode-0'}}},
        'X-Request-Id' => $rid);
    return ($r, $J->decode($r->content));
}

sub decode {
    my ($rid, %o) = @_;
    my $r = ($o{on} // $d)->post_json('/v1/completions', {
        prompt => $prompt, max_tokens => 3,
        kv_transfer_params => {dpd => {req_id => $rid}}},
        'X-Request-Id' => $rid);
    return ($r, $J->decode($r->content));
}

sub cached { $_[0]{usage}{prompt_tokens_details}{cached_tokens} // 0 }

sub outcome {
    my ($emu, $rid) = @_;
    my $rec = $emu->last_request(request_id => $rid);
    return $rec ? $rec->{kv}{outcome} : undef;
}

sub until_true {
    my ($cond, $timeout) = @_;
    my $deadline = time + ($timeout // 10);
    while (time < $deadline) {
        return 1 if $cond->();
        sleep 0.05;
    }
    return 0;
}

# --- --kv-wait-ms: the decoder itself waits for the KV to land -------------
my ($r, $pr) = prefill('w1');
is $pr->{kv_transfer_params}{dpd}{state}, 'pushed', 'w1 pushed';
my ($r2, $dr) = decode('w1');       # at once, no wait on the agent here
is $r2->code, 200, 'decode 200';
is cached($dr), $expect, '--kv-wait-ms: the decoder waited, KV reused';
is outcome($d, 'w1'), 'ready', 'w1 ready';

# --- asked for a request nobody pushed: waits --kv-wait-ms, recomputes -----
my $t0 = time;
($r2, $dr) = decode('never');
my $waited = time - $t0;
is $r2->code, 200, 'unknown request: 200';
is cached($dr), 0, 'unknown request: cached 0';
is outcome($d, 'never'), 'not_ready', 'unknown request: not_ready';
is $d->last_request(request_id => 'never')->{kv}{state}, 'not_found',
    'the agent did not know it';
ok $waited >= 2.9 && $waited < 8, "waited --kv-wait-ms (${waited}s)";

# --- instances without an agent ---------------------------------------------
($r, $pr) = prefill('n1', on => $p0);
is $r->code, 200, 'prefill without agent: 200';
is_deeply $pr->{kv_transfer_params},
    {dpd => {req_id => 'n1', blocks => 0, state => 'failed'}},
    'prefill without agent: state failed';
like outcome($p0, 'n1'), qr/^failed: no agent/, 'reason recorded';
is $p0->counter('kv_agent_push_failed_total'), 1, 'counted';
is $p0->stats->{kv}{kv_agent}, undef, 'no kv_agent section';
($r2, $dr) = decode('n1');
is cached($dr), 0, 'decoder recomputes (nothing was pushed)';
is outcome($d, 'n1'), 'not_ready', 'decoder: not_ready';
($r2, $dr) = decode('n1', on => $d0);
is $r2->code, 200, 'decoder without agent: 200';
is cached($dr), 0, 'decoder without agent: recompute';
is outcome($d0, 'n1'), 'no_agent', 'decoder without agent: no_agent';
is $d0->counter('kv_agent_no_agent_total'), 1, 'no_agent counted';

# --- --kv-push-wait-ms: the prefill answers once the KV has landed ---------
$p->stop;
$p = DPD::Emu->start(host => '127.0.0.2', role => 'prefill',
                     kv_agent => $pa, kv_push_wait_ms => 5000, %common);
ok $pa->wait_connected(['decode-0']), 'reconnected after re-registration';
($r, $pr) = prefill('s1');
is $pr->{kv_transfer_params}{dpd}{state}, 'pushed', 's1 pushed';
# the sender's "done" may reach the receiver a moment after the reply
is $pa->poll('s1')->{code}, 'not_found', 'push finished and released';
is $p->kv_agent_stats->{held_blocks}, 0, 'source blocks already free';
is $p->last_request(request_id => 's1')->{kv}{push_state}, 'done',
    'answered after the push was done';
is $da->wait_final('s1', 5)->{state}, 'ready', 's1 landed';
($r2, $dr) = decode('s1');
is cached($dr), $expect, 's1 reused';

# --- asked while the KV is on its way: freed once it lands ----------------
my $res = $da->api({verb => 'reserve', req_id => 'late',
                    nblocks => $nfull});
ok $res && $res->{ok}, 'decode side reserved blocks for "late"';
($r2, $dr) = decode('late');        # waits 3 s, the KV never comes
is cached($dr), 0, 'not landed within --kv-wait-ms: recompute';
is outcome($d, 'late'), 'not_ready', 'not_ready';
is $d->last_request(request_id => 'late')->{kv}{state}, 'reserved',
    'the agent said reserved';
($r, $pr) = prefill('late');        # lands in the reservation
is $pr->{kv_transfer_params}{dpd}{state}, 'pushed', 'late KV pushed';
ok until_true(sub { $d->counter('kv_agent_late_released_total') == 1 }, 10),
    'the late KV is released by the decoder once it landed';
ok until_true(sub { ($da->free_blocks // -1) == $NBLK }, 5),
    'decode agent: every block free again';

# --- the decode agent dies --------------------------------------------------
$da->stop('KILL');
ok until_true(sub { !$d->kv_agent_stats->{registered} }, 5),
    'decode emulator notices its agent is gone';
($r, $pr) = prefill('k1');
is $r->code, 200, 'prefill towards a dead decode node: 200';
my $state = $pr->{kv_transfer_params}{dpd}{state};
ok $state eq 'failed' || $state eq 'pushed', "prefill state $state";
ok until_true(sub { !$p->kv_agent_stats->{held_blocks} }, 10),
    'prefill frees its source blocks when the push ends';
is $p->kv_agent_stats->{src_free_blocks}, $NBLK, 'every source block free';
($r2, $dr) = decode('k1');
is $r2->code, 200, 'decode with its agent dead: 200, no crash';
is cached($dr), 0, 'decode with its agent dead: recompute';
is outcome($d, 'k1'), 'no_agent', 'decode with its agent dead: no_agent';
is $d->get('/health')->code, 200, 'decode emulator healthy';

# --- the decode agent comes back: the emulator registers again -------------
$da->restart;
ok until_true(sub { $d->kv_agent_stats->{registered} }, 10),
    'decode emulator re-registered its pool';
ok $pa->wait_connected(['decode-0']), 'prefill agent reconnected';
ok $da->wait_connected(['prefill-0']), 'decode agent reconnected';
($r, $pr) = prefill('k2');
is $pr->{kv_transfer_params}{dpd}{state}, 'pushed', 'k2 pushed';
($r2, $dr) = decode('k2');
is cached($dr), $expect, 'after the restart: KV reused';
is $da->free_blocks, $NBLK, 'decode agent: every block free';

# --- the prefill agent dies -------------------------------------------------
$pa->stop('KILL');
($r, $pr) = prefill('k3');
is $r->code, 200, 'prefill with its agent dead: 200';
is $pr->{kv_transfer_params}{dpd}{state}, 'failed', 'state failed';
is $p->kv_agent_stats->{held_blocks}, 0, 'nothing held';
($r2, $dr) = decode('k3');
is cached($dr), 0, 'decoder recomputes';
is outcome($d, 'k3'), 'not_ready', 'decoder: not_ready';
is $da->free_blocks, $NBLK, 'decode agent: nothing leaked';

# --- DPD::Emu: a pool that cannot be registered is a start-up error -------
my $bad = eval {
    DPD::Emu->start(host => '127.0.0.6', role => 'decode', %common,
                    kv_agent => $pa->socket_path . '.none', timeout => 3)
};
ok !$bad, 'start() croaks when the pool never gets registered';
like $@, qr/did not register its pool with the kv_agent: .+/,
    'and says why';

done_testing();
