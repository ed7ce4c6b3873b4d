# vLLM emulator: the kv_agent prefill protocol between two instances, each
# in front of a real kv_agent (tcp;ofi_rxm on loopback), without nginx:
# prefill on 127.0.0.2 + agent prefill-0, decode on 127.0.0.3 + decode-0.
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
my $base = $ENV{DPD_EMU_KVA_PORT} || 19500;
my $abase = DPD::KvAgent::port_base();
my $NBLK = 64;
my ($pa, $da) = DPD::KvAgent->pair(base => $abase,
    pool => DPD::KvAgent->small_pool(blocks => $NBLK),
    timeouts => {transfer_ms => 3000},
    config => {api => {debug_verbs => JSON::PP::true}});

my %common = (port => $base, side_channel_port => $base + 10,
              no_lmcache => 1, time_scale => 0.02);
my $p = DPD::Emu->start(host => '127.0.0.2', role => 'prefill',
                        kv_agent => $pa, %common);
my $d = DPD::Emu->start(host => '127.0.0.3', role => 'decode',
                        kv_agent => $da, %common);
my $bs = $p->block_size;
# registering a pool makes an agent's peers reconnect (new keys)
ok $pa->wait_connected(['decode-0']), 'prefill agent connected to decode'
    or diag $pa->log_text, $da->log_text;
ok $da->wait_connected(['prefill-0']), 'decode agent connected to prefill';

my $ka = $p->kv_agent_stats;
ok $ka->{registered}, 'prefill emulator registered its pool';
is $ka->{node}, 'prefill-0', 'prefill emulator sees its agent';
is $ka->{pool}{blocks}, $NBLK, 'pool geometry from the agent';
is $d->kv_agent_stats->{node}, 'decode-0', 'decode emulator registered';

my $prompt = join ' ', map { "tok$_" } 1 .. 100;     # 101 tokens (BOS)
my $ptoks = 101;
my $nfull = int($ptoks / $bs);
my $expect = $bs * int(($ptoks - 1) / $bs);

sub prefill {
    my ($rid, %o) = @_;
    my $r = $p->post_json('/v1/completions', {
        prompt => $o{prompt} // $prompt, max_tokens => 1, stream => $F,
        kv_transfer_params => {dpd => {req_id => $rid,
                                       decode_node => $o{node}
                                                      // 'decode-0'}}},
        'X-Request-Id' => $rid);
    return ($r, $J->decode($r->content));
}

sub decode {
    my ($rid, %o) = @_;
    my $body = {prompt => $o{prompt} // $prompt, max_tokens => 5};
    $body->{kv_transfer_params} = {dpd => {req_id => $rid}} if $rid;
    my $r = ($o{on} // $d)->post_json($o{path} // '/v1/completions', $body,
                                      'X-Request-Id' => $rid // 'plain');
    return ($r, $J->decode($r->content));
}

sub settle {
    # the prefill side frees its source blocks when the push ends
    my ($emu, $timeout) = @_;
    my $deadline = time + ($timeout // 10);
    my $s;
    while (time < $deadline) {
        $s = $emu->kv_agent_stats;
        return $s if !$s->{held_blocks}
            && $s->{src_free_blocks} == $s->{pool}{blocks};
        sleep 0.05;
    }
    return $s;
}

# --- a push that lands, then a decode that reuses it ----------------------
my (undef, $plain) = decode(undef);
my ($r, $pr) = prefill('r1');
is $r->code, 200, 'prefill 200';
like $r->content,
    qr/"kv_transfer_params":\{"dpd":\{"req_id":"r1","blocks":$nfull,"state":"pushed"\}\}\}$/,
    'kv_transfer_params: dpd req_id, blocks, state pushed';
is $pr->{usage}{completion_tokens}, 1, 'prefill generates one token';
my $prec = $p->last_request(request_id => 'r1');
is $prec->{kv}{protocol}, 'kv_agent', 'prefill record: kv_agent';
is $prec->{kv}{outcome}, 'pushed', 'prefill record: pushed';
is scalar @{ $prec->{kv}{src_blocks} }, $nfull, 'one source block each';

# as nginx: wait on the decode side until the KV has landed
my $st = $da->wait_final('r1', 10);
is $st->{state}, 'ready', 'decode agent: r1 ready' or diag explain $st;
is $st->{nblocks}, $nfull, "decode agent holds $nfull blocks";
is $da->free_blocks, $NBLK - $nfull, 'decode pool: blocks in use';

my ($r2, $dr) = decode('r1');
is $r2->code, 200, 'decode 200';
is $dr->{usage}{prompt_tokens_details}{cached_tokens}, $expect,
    "cached_tokens = bs*floor((P-1)/bs) = $expect";
is $dr->{usage}{prompt_tokens}, $ptoks, 'prompt_tokens unchanged';
is $dr->{choices}[0]{text}, $plain->{choices}[0]{text},
    'same text as without transfer';
my $rec = $d->last_request(request_id => 'r1');
is $rec->{kv}{protocol}, 'kv_agent', 'decode record: kv_agent';
is $rec->{kv}{outcome}, 'ready', 'decode record: ready (bytes verified)';
is $rec->{kv}{blocks}, $nfull, 'decode record: blocks landed';
is $rec->{cached_tokens}, $expect, 'decode record: cached tokens';
is $da->free_blocks, $NBLK, 'decode agent: blocks released';
is $da->poll('r1')->{code}, 'not_found', 'decode agent: record dropped';
is $d->counter('kv_agent_ready_total'), 1, 'ready counted';
is $d->counter('prefill_tokens_computed_total'),
    $ptoks + ($ptoks - $expect),
    'decoder computed plain prompt + only the uncached tail';
my $ps = settle($p);
is $ps->{held_blocks}, 0, 'prefill: no source blocks held';
is $ps->{src_free_blocks}, $NBLK, 'prefill: every source block free';
is $pa->poll('r1')->{code}, 'not_found', 'prefill agent: push released';
is $p->counter('kv_agent_pushed_total'), 1, 'pushed counted';
is $p->counter('kv_agent_push_done_total'), 1, 'push completion counted';

# used twice: the KV is gone, recompute
(undef, $dr) = decode('r1');
is $dr->{usage}{prompt_tokens_details}, undef, 'second use: no reuse';
is $d->last_request(request_id => 'r1')->{kv}{outcome}, 'not_ready',
    'second use: not_ready';

# --- a different prompt on the decode side: mismatch ---------------------
my $other = join ' ', map { "alt$_" } 1 .. 100;
prefill('r2');
is $da->wait_final('r2', 10)->{state}, 'ready', 'r2 landed';
(undef, $dr) = decode('r2', prompt => $other);
is $dr->{usage}{prompt_tokens_details}, undef,
    'other prompt: cached_tokens 0';
is $d->last_request(request_id => 'r2')->{kv}{outcome}, 'mismatch',
    'other prompt: mismatch';
is $d->counter('kv_agent_mismatch_total'), 1, 'mismatch counted';
is $da->free_blocks, $NBLK, 'mismatch: blocks released anyway';

# --- same prompt, but the landed bytes were changed: mismatch ------------
prefill('r3');
$st = $da->wait_final('r3', 10);
is $st->{state}, 'ready', 'r3 landed';
my $last = $st->{blocks_runs}[-1];
my $fill = $da->api({verb => 'fill', seed => 7,
                     blocks_runs => [[$last->[0] + $last->[1] - 1, 1]]});
ok $fill && $fill->{ok}, 'overwrote the last landed block';
(undef, $dr) = decode('r3');
is $dr->{usage}{prompt_tokens_details}, undef,
    'corrupted KV: cached_tokens 0';
is $d->last_request(request_id => 'r3')->{kv}{outcome}, 'mismatch',
    'corrupted KV: mismatch (the bytes are checked)';

# --- a prefix-sharing but longer prompt reuses what landed ----------------
prefill('r4');
is $da->wait_final('r4', 10)->{state}, 'ready', 'r4 landed';
(undef, $dr) = decode('r4', prompt => "$prompt more words here");
is $dr->{usage}{prompt_tokens_details}{cached_tokens}, $nfull * $bs,
    'longer prompt with the same prefix: all landed blocks reused';

# --- short prompt: nothing to push ----------------------------------------
($r, $pr) = prefill('r5', prompt => 'just a few words');
is_deeply $pr->{kv_transfer_params},
    {dpd => {req_id => 'r5', blocks => 0, state => 'pushed'}},
    'prompt shorter than a block: pushed, 0 blocks';

# --- unknown decode node: failed at once ----------------------------------
($r, $pr) = prefill('r6', node => 'decode-9');
is $r->code, 200, 'unknown node: still 200';
is_deeply $pr->{kv_transfer_params},
    {dpd => {req_id => 'r6', blocks => 0, state => 'failed'}},
    'unknown node: state failed';
like $p->last_request(request_id => 'r6')->{kv}{outcome}, qr/^failed: /,
    'unknown node: reason recorded';
is $p->counter('kv_agent_push_failed_total'), 1, 'failed push counted';
(undef, $dr) = decode('r6');
is $dr->{usage}{prompt_tokens_details}, undef, 'decoder recomputes';

# --- chat, streamed decode ------------------------------------------------
{
    my $msgs = [{role => 'user', content => $prompt}];
    my $cr = $p->post_json('/v1/chat/completions', {
        messages => $msgs, max_tokens => 1,
        kv_transfer_params => {dpd => {req_id => 'c1',
                                       decode_node => 'decode-0'}}},
        'X-Request-Id' => 'c1');
    my $cp = $J->decode($cr->content);
    is $cp->{kv_transfer_params}{dpd}{state}, 'pushed', 'chat: pushed';
    is $da->wait_final('c1', 10)->{state}, 'ready', 'chat: landed';
    my $rr = $d->raw(method => 'POST', path => '/v1/chat/completions',
        headers => {'X-Request-Id' => 'c1'},
        body => {messages => $msgs, max_tokens => 3, stream => JSON::PP::true,
                 stream_options => {include_usage => JSON::PP::true},
                 kv_transfer_params => {dpd => {req_id => 'c1'}}});
    my ($u) = grep { $_->{usage} } map { eval { $J->decode($_->[1]) } || () }
              @{ $rr->{events} };
    my $cp_n = $u->{usage}{prompt_tokens};
    is $u->{usage}{prompt_tokens_details}{cached_tokens},
        $bs * int(($cp_n - 1) / $bs), 'chat stream: cached tokens';
}

# --- nothing leaks ----------------------------------------------------------
$ps = settle($p);
is $ps->{held_blocks}, 0, 'prefill emulator: nothing held at the end';
is $pa->info->{stats}{pushes_failed}, 0, 'prefill agent: no failed push';
is $da->free_blocks, $NBLK, 'decode agent: every block free at the end';
like $d->metrics, qr/^emu_kv_agent_ready_total\{[^}]*\} 3\.0$/m,
    'metrics: kv_agent counters';

done_testing();
