# vLLM emulator: NIXL (pull) prefill/decode handoff between two instances,
# without nginx: prefill on 127.0.0.2, decode on 127.0.0.3, the older
# vLLM reply shape (--nixl-reply-shape flat).
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
my $base = ($ENV{DPD_EMU_PORT} || 19000) + 6;
my %ports = (port => $base, side_channel_port => $base + 100,
             lmcache_init_port => $base + 200,
             lmcache_alloc_port => $base + 300);
my %common = (%ports, time_scale => 0.02, kv_hold_timeout => 1.5);

# the older flat reply (t/emu/11-nixl-groups.t: the current one)
my $p = DPD::Emu->start(host => '127.0.0.2', role => 'prefill', %common,
                        args => ['--nixl-reply-shape', 'flat']);
my $d = DPD::Emu->start(host => '127.0.0.3', role => 'decode', %common);
my $bs = $p->block_size;

my $prompt = join ' ', map { "tok$_" } 1 .. 100;     # 101 tokens (BOS)
my $ptoks = 101;

sub prefill_body {
    my (%o) = @_;
    return {prompt => $o{prompt} // $prompt, max_tokens => 1,
            stream => $F,
            kv_transfer_params => {do_remote_decode => $T,
                                   do_remote_prefill => $F,
                                   remote_engine_id => undef,
                                   remote_block_ids => undef,
                                   remote_host => undef,
                                   remote_port => undef}};
}

sub prefill {
    my ($rid, %o) = @_;
    my $r = $p->post_json($o{path} // '/v1/completions',
                          $o{body} // prefill_body(%o),
                          'X-Request-Id' => $rid);
    return ($r, $J->decode($r->content));
}

sub decode {
    my ($rid, $kv, %o) = @_;
    my $body = $o{body} // {prompt => $o{prompt} // $prompt,
                            max_tokens => $o{max_tokens} // 5};
    $body->{kv_transfer_params} = $kv if $kv;
    my $r = ($o{on} // $d)->post_json($o{path} // '/v1/completions', $body,
                                      'X-Request-Id' => $rid);
    return ($r, $J->decode($r->content));
}

# --- prefill reply ----------------------------------------------------------------
my ($r, $pr) = prefill('n1');
is $r->code, 200, 'prefill 200';
my $kv = $pr->{kv_transfer_params};
my $nfull = int($ptoks / $bs);
like $r->content,
    qr/"kv_transfer_params":\{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":\[[\d,]*\],"remote_engine_id":"[^"]+","remote_request_id":"cmpl-n1-0","remote_host":"127\.0\.0\.2","remote_port":\d+,"tp_size":1\}\}$/,
    'kv_transfer_params shaped and ordered as vLLM NixlConnector';
is scalar @{ $kv->{remote_block_ids} }, $nfull,
    "full prompt blocks named ($nfull of $bs tokens)";
is $kv->{remote_engine_id}, $p->engine_id, 'engine id';
is $kv->{remote_port}, $p->side_channel_port, 'side channel port';
is $pr->{usage}{completion_tokens}, 1, 'prefill generates one token';
my $st = $p->stats;
is $st->{kv}{nixl_held_blocks}, $nfull, 'prefill holds the blocks';
is $st->{kv}{nixl_held}[0]{request_id}, 'cmpl-n1-0', 'held under its id';
is $st->{kv}{used_blocks}, $nfull, 'only the held blocks stay allocated';
is $p->metric('emu_nixl_held_blocks'), $nfull, 'held blocks metric';
is $p->last_request->{kv}{outcome}, 'held', 'prefill record: held';

# reference: the text a plain decode produces
my (undef, $plain) = decode('plain-1', undef);

# --- decode pulls ---------------------------------------------------------------
my ($r2, $dr) = decode('n1', $kv);
is $r2->code, 200, 'decode 200';
my $expect = $bs * int(($ptoks - 1) / $bs);
is $dr->{usage}{prompt_tokens_details}{cached_tokens}, $expect,
    "cached_tokens = bs*floor((P-1)/bs) = $expect";
is $dr->{usage}{prompt_tokens}, $ptoks, 'prompt_tokens unchanged';
is $dr->{choices}[0]{text}, $plain->{choices}[0]{text},
    'same text as without transfer';
my $rec = $d->last_request(request_id => 'n1');
is $rec->{kv}{outcome}, 'ok', 'decoder record: pull ok';
is $rec->{cached_tokens}, $expect, 'decoder record: cached tokens';
is_deeply $rec->{body}{kv_transfer_params}, $kv,
    'decoder saw the transfer params';
is $p->stats->{kv}{nixl_held_blocks}, 0, 'blocks freed after the pull';
is $p->stats->{kv}{used_blocks}, 0, 'prefill KV empty';
is $d->counter('nixl_pull_ok_total'), 1, 'pull counted';
is $p->counter('nixl_served_total'), 1, 'served counted';

# the prefill computed the prompt; the decoder only the remainder
my $computed = $d->counter('prefill_tokens_computed_total');
is $computed, $ptoks + ($ptoks - $expect),
    'decoder computed plain prompt + only the uncached tail';

# --- pulling twice: blocks are gone ---------------------------------------------
(undef, $dr) = decode('n1', $kv);
is $dr->{usage}{prompt_tokens_details}, undef, 'second pull: no reuse';
like $d->last_request->{kv}{outcome}, qr/failed: unknown request/,
    'second pull: failed (already taken)';

# --- streaming decode, chat -----------------------------------------------------
{
    my $msgs = [{role => 'user', content => $prompt}];
    my (undef, $cp) = prefill('c1', path => '/v1/chat/completions',
                              body => {messages => $msgs, max_tokens => 1,
                                       kv_transfer_params => {
                                           do_remote_decode => $T}});
    my $ckv = $cp->{kv_transfer_params};
    is $ckv->{remote_request_id}, 'chatcmpl-c1', 'chat request id';
    my $rr = $d->raw(method => 'POST', path => '/v1/chat/completions',
                     headers => {'X-Request-Id' => 'c1'},
                     body => {messages => $msgs, max_tokens => 3,
                              stream => $T,
                              stream_options => {include_usage => $T},
                              kv_transfer_params => $ckv});
    my ($u) = grep { /"usage"/ } map { $_->[1] } @{ $rr->{events} };
    my $usage = $J->decode($u)->{usage};
    my $cpt = $cp->{usage}{prompt_tokens};
    is $usage->{prompt_tokens_details}{cached_tokens},
        $bs * int(($cpt - 1) / $bs),
        'streamed chat decode reports cached tokens in the usage chunk';
}

# --- other prompt tokens: no reuse ------------------------------------------------
{
    my (undef, $x) = prefill('w1');
    my ($rr, $dx) = decode('w1', $x->{kv_transfer_params},
                           prompt => "$prompt extra");
    is $rr->code, 200, 'mismatching decode still answers';
    is $dx->{usage}{prompt_tokens_details}, undef,
        'different prompt tokens -> cached 0';
    is $d->last_request->{kv}{outcome}, 'mismatch', 'recorded as mismatch';
    is $d->counter('nixl_pull_mismatch_total'), 1, 'mismatch counted';
    is $p->stats->{kv}{nixl_held_blocks}, 0, 'blocks released by the pull';
}

# --- wrong host / port: recompute, blocks expire on the prefill -------------------
{
    my (undef, $x) = prefill('h1');
    my %bad = (%{ $x->{kv_transfer_params} }, remote_host => '127.0.0.4');
    my $t = time;
    my ($rr, $dx) = decode('h1', \%bad);
    is $rr->code, 200, 'pull from a wrong host: still answers';
    is $dx->{usage}{prompt_tokens_details}, undef, 'wrong host -> cached 0';
    like $d->last_request->{kv}{outcome}, qr/^failed/, 'recorded as failed';
    %bad = (%{ $x->{kv_transfer_params} }, remote_port => $base + 150);
    (undef, $dx) = decode('h1', \%bad);
    is $dx->{usage}{prompt_tokens_details}, undef, 'wrong port -> cached 0';
    is $d->counter('nixl_pull_failed_total'), 3, 'failures counted';
    is $p->stats->{kv}{nixl_held_blocks}, $nfull,
        'unpulled blocks still held';
    my $deadline = time + 5;
    sleep 0.1 while time < $deadline && $p->stats->{kv}{nixl_held_blocks};
    is $p->stats->{kv}{nixl_held_blocks}, 0,
        'unpulled blocks freed after --kv-hold-timeout';
    is $p->counter('nixl_expired_total'), 1, 'expiry counted';
    is $p->stats->{kv}{used_blocks}, 0, 'prefill KV empty again';
}

# --- roles: a decode instance is no producer; a prefill instance no puller ------
{
    my $rr = $d->post_json('/v1/completions', prefill_body(),
                           'X-Request-Id' => 'r1');
    my $x = $J->decode($rr->content);
    is $x->{kv_transfer_params}, undef,
        'decode-role instance ignores do_remote_decode';
    is $d->stats->{kv}{nixl_held_blocks}, 0, 'and holds nothing';
    my (undef, $pp) = prefill('r2');
    my (undef, $dx) = decode('r2', $pp->{kv_transfer_params}, on => $p);
    is $dx->{usage}{prompt_tokens_details}, undef,
        'prefill-role instance does not pull';
    decode('r2', $pp->{kv_transfer_params});    # release the blocks
    is $p->stats->{kv}{nixl_held_blocks}, 0, 'released';
}

# --- a "both" instance does both, with itself -------------------------------------
{
    my $b = DPD::Emu->start(host => '127.0.0.5', role => 'both', %common);
    my $x = $J->decode($b->post_json('/v1/completions', prefill_body(),
                                     'X-Request-Id' => 'b1')->content);
    is $x->{kv_transfer_params}{remote_host}, '127.0.0.5', 'both: producer';
    my $y = $J->decode($b->post_json('/v1/completions',
        {prompt => $prompt, max_tokens => 2,
         kv_transfer_params => $x->{kv_transfer_params}})->content);
    is $y->{usage}{prompt_tokens_details}{cached_tokens}, $expect,
        'both: consumer';
    is $b->stats->{kv}{used_blocks}, 0, 'both: nothing leaked';
    $b->stop;
}

# --- client gone during the prefill: nothing held, nothing leaked --------------
{
    my $slow = DPD::Emu->start(host => '127.0.0.6', role => 'prefill', %ports,
                               time_scale => 1, prefill_tps => 10000);
    my $body = prefill_body(prompt => join(' ', map { "x$_" } 1 .. 6000));
    my $rr = $slow->raw(method => 'POST', path => '/v1/completions',
                        body => $body, timeout => 0.2,
                        headers => {'X-Request-Id' => 'gone-1'});
    ok $rr->{timeout}, 'client left before the prefill finished';
    ok $slow->wait_idle(3), 'prefill dropped from the scheduler';
    my $rec = $slow->last_request(request_id => 'gone-1');
    ok $rec->{aborted}, 'prefill record aborted';
    is $slow->stats->{kv}{nixl_held_blocks}, 0, 'no blocks held';
    is $slow->stats->{kv}{used_blocks}, 0, 'no blocks leaked';
    $slow->stop;
}

# --- many handoffs, nothing leaks --------------------------------------------------
{
    for my $i (1 .. 20) {
        my (undef, $x) = prefill("m$i", prompt => "$prompt $i");
        decode("m$i", $x->{kv_transfer_params}, prompt => "$prompt $i",
               max_tokens => 2);
    }
    my @ok = grep { ($_->{kv}{outcome} // '') eq 'ok' }
             $d->requests(since => 0);
    ok @ok >= 21, 'all handoffs reused the KV';
    is $p->stats->{kv}{used_blocks}, 0, 'prefill: no block leaked';
    ok $d->wait_idle(5), 'decoder idle';
    is $d->stats->{kv}{used_blocks}, 0, 'decoder: no block leaked';
}

done_testing;
