# vLLM emulator: the NIXL (pull) reply of current vLLM
# (nixl/pull_scheduler.py request_finished): remote_block_ids one list per
# KV cache group, remote_num_tokens, tp/dcp/pp_size,
# remote_blocks_expiry_time, transfer_mode; and the decode side's check
# (update_state_after_alloc): a missing required field -> recompute.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/../inc";
use Test::More;
use JSON::PP;
use Time::HiRes qw(sleep time);
use DPD::Emu;

my $J = JSON::PP->new->utf8->canonical;
my $T = JSON::PP::true;
my $F = JSON::PP::false;
my $base = ($ENV{DPD_EMU_PORT} || 19000) + 11;
my %ports = (port => $base, side_channel_port => $base + 100,
             lmcache_init_port => $base + 200,
             lmcache_alloc_port => $base + 300);
my %common = (%ports, time_scale => 0.02, kv_hold_timeout => 1.5);

my $p = DPD::Emu->start(host => '127.0.0.2', role => 'prefill', %common,
                        args => ['--kv-cache-groups', 3]);
my $p1 = DPD::Emu->start(host => '127.0.0.4', role => 'prefill', %common);
my $d = DPD::Emu->start(host => '127.0.0.3', role => 'decode', %common);
my $bs = $p->block_size;
my $nblocks = $p->stats->{kv}{total_blocks};

my $prompt = join ' ', map { "tok$_" } 1 .. 100;     # 101 tokens (BOS)
my $ptoks = 101;
my $nfull = int($ptoks / $bs);
my $expect = $bs * int(($ptoks - 1) / $bs);

sub prefill {
    my ($emu, $rid) = @_;
    my $r = $emu->post_json('/v1/completions',
        {prompt => $prompt, max_tokens => 1, stream => $F,
         kv_transfer_params => {do_remote_decode => $T,
                                do_remote_prefill => $F}},
        'X-Request-Id' => $rid);
    return ($r, $J->decode($r->content));
}

sub decode {
    my ($rid, $kv) = @_;
    my $r = $d->post_json('/v1/completions',
        {prompt => $prompt, max_tokens => 3, kv_transfer_params => $kv},
        'X-Request-Id' => $rid);
    return ($r, $J->decode($r->content));
}

# --- the reply, three groups ------------------------------------------------
my ($r, $pr) = prefill($p, 'g1');
is $r->code, 200, 'prefill 200';
my $kv = $pr->{kv_transfer_params};
like $r->content,
    qr/"kv_transfer_params":\{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":\[\[[\d,]+\],\[\d+\],\[\d+\]\],"remote_engine_id":"[^"]+","remote_request_id":"cmpl-g1-0","remote_host":"127\.0\.0\.2","remote_port":\d+,"tp_size":1,"dcp_size":1,"pp_size":1,"remote_num_tokens":101,"remote_blocks_expiry_time":null,"remote_registration_generation":0,"transfer_mode":"pull"\}\}$/,
    'fields named and ordered as vLLM request_finished';
my $g = $kv->{remote_block_ids};
is scalar @$g, 3, 'one block list per KV cache group';
is scalar @{ $g->[0] }, $nfull, 'group 0: the full prompt blocks';
is_deeply [map { scalar @$_ } @$g[1, 2]], [1, 1], 'groups 1, 2: a one-block tail';
is $g->[1][0], $nblocks + $g->[0][-1], 'group 1 ids in their own range';
is $g->[2][0], 2 * $nblocks + $g->[0][-1], 'group 2 ids in theirs';

my ($r2, $dr) = decode('g1', $kv);
is $r2->code, 200, 'decode 200';
is $dr->{usage}{prompt_tokens_details}{cached_tokens}, $expect,
    "per-group ids pulled: cached_tokens $expect";
is $d->last_request(request_id => 'g1')->{kv}{outcome}, 'ok', 'pull ok';

# --- one group (the default) --------------------------------------------------
($r, $pr) = prefill($p1, 'g2');
my $kv1 = $pr->{kv_transfer_params};
is scalar @{ $kv1->{remote_block_ids} }, 1, 'default: one group';
is scalar @{ $kv1->{remote_block_ids}[0] }, $nfull, '  ... of the prompt blocks';
(undef, $dr) = decode('g2', $kv1);
is $dr->{usage}{prompt_tokens_details}{cached_tokens}, $expect, 'pulled';

# --- altered block ids: the side channel's list differs ------------------------
(undef, $pr) = prefill($p, 'g3');
my %alt = %{ $pr->{kv_transfer_params} };
$alt{remote_block_ids} = [@{ $alt{remote_block_ids} }[0, 1]];   # a group lost
(undef, $dr) = decode('g3', \%alt);
is $dr->{usage}{prompt_tokens_details}, undef, 'a group dropped on the way: no reuse';
is $d->last_request(request_id => 'g3')->{kv}{outcome}, 'mismatch', '  ... mismatch';

# --- a required field missing: "invalid KVTransferParams", recompute ------------
for my $field (qw(remote_port remote_host remote_engine_id remote_request_id)) {
    my $rid = "miss-$field";
    (undef, $pr) = prefill($p, $rid);
    my %m = %{ $pr->{kv_transfer_params} };
    delete $m{$field};
    (undef, $dr) = decode($rid, \%m);
    is $dr->{usage}{prompt_tokens_details}, undef, "no $field: recomputed";
    like $d->last_request(request_id => $rid)->{kv}{outcome},
        qr/^failed: invalid KVTransferParams \(no $field\)/, "  ... and says why";
}
is $d->counter('nixl_invalid_params_total'), 4, 'invalid params counted';

# --- empty block ids: nothing to pull ------------------------------------------
(undef, $dr) = decode('empty', {%$kv, remote_block_ids => []});
is $dr->{usage}{prompt_tokens_details}, undef, 'no block ids: recomputed';

# --- the lease: unpulled blocks go after --kv-lease-duration -------------------
{
    my $l = DPD::Emu->start(host => '127.0.0.5', role => 'prefill', %ports,
                            time_scale => 0.02,
                            args => ['--kv-lease-duration', '0.5']);
    prefill($l, 'lease');
    is $l->stats->{kv}{nixl_held_blocks}, $nfull, 'held after the prefill';
    my $t = time + 10;
    sleep 0.2 while $l->stats->{kv}{nixl_held_blocks} && time < $t;
    is $l->stats->{kv}{nixl_held_blocks}, 0, 'freed once the lease ran out';
    is $l->counter('nixl_expired_total'), 1, 'expiry counted';
    $l->stop;
}

done_testing;
