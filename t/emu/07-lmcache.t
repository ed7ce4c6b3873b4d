# vLLM emulator: LMCache (push) prefill/decode handoff without nginx:
# prefill on 127.0.0.2 pushes to the decoder named in disagg_spec; two
# decoders (127.0.0.3, 127.0.0.4) listen on the same LMCache ports.
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
my $base = ($ENV{DPD_EMU_PORT} || 19000) + 7;
my %ports = (port => $base, side_channel_port => $base + 100,
             lmcache_init_port => $base + 200,
             lmcache_alloc_port => $base + 300);
my %common = (%ports, time_scale => 0.02, kv_hold_timeout => 1.5);

my $p = DPD::Emu->start(host => '127.0.0.2', role => 'prefill', %common);
my ($d1, $d2) = DPD::Emu->start_many(count => 2, first => 3, role => 'decode',
                                     %common);
my $chunk = $d1->stats->{instance}{lmcache_chunk_size};

sub words { join ' ', map { "$_[0]$_" } 1 .. $_[1] }

sub spec {
    my ($req_id, $host) = @_;
    return {ret_first_tok => $T,
            disagg_spec => {req_id => $req_id,
                            receiver_host => $host // '127.0.0.3',
                            receiver_init_port => [$base + 200],
                            receiver_alloc_port => [$base + 300]}};
}

sub prefill {
    my ($rid, $prompt, %o) = @_;
    my $body = $o{body} // {prompt => $prompt, max_tokens => 1};
    $body->{kv_transfer_params} = spec($rid, $o{host});
    my $r = $p->post_json($o{path} // '/v1/completions', $body,
                          'X-Request-Id' => $rid);
    return ($r, $J->decode($r->content));
}

sub decode {
    my ($emu, $rid, $prompt, %o) = @_;
    my $r = $emu->post_json('/v1/completions',
                            {prompt => $prompt, max_tokens => 3},
                            'X-Request-Id' => $rid);
    return ($r, $J->decode($r->content));
}

sub cached { ($_[0]{usage}{prompt_tokens_details} || {})->{cached_tokens} // 0 }

is $p->stats->{instance}{lmcache_init_port}, undef,
    'prefill-role instance has no LMCache receiver';
is $d1->lmcache_alloc_port, $d2->lmcache_alloc_port,
    'decoders share the LMCache ports on distinct addresses';

# --- one chunk prompt ------------------------------------------------------------
my $short = words('a', 100);    # 101 tokens
my ($r, $pr) = prefill('l1', $short);
is $r->code, 200, 'prefill 200';
is $pr->{usage}{completion_tokens}, 1, 'prefill generates one token';
like $r->content, qr/"kv_transfer_params":\{"first_tok":\d+\}\}$/,
    'ret_first_tok: reply carries kv_transfer_params.first_tok';
my $prec = $p->last_request(request_id => 'l1');
is $prec->{kv}{outcome}, 'pushed', 'prefill pushed';
is $prec->{kv}{receiver}, "127.0.0.3:" . ($base + 300), 'to the named receiver';
my $k = $d1->stats->{kv};
is $k->{lmcache_held_chunks}, 1, 'receiver holds 1 chunk';
is $k->{lmcache_held_tokens}, 101, 'covering the prompt';
is $k->{lmcache_held}[0]{req_id}, 'l1', 'tagged with the req_id';
is $d2->stats->{kv}{lmcache_held_chunks}, 0, 'other decoder got nothing';

my (undef, $plain) = decode($d2, 'l1-plain', $short);
is cached($plain), 0, 'other decoder: cached 0';
my ($r2, $dr) = decode($d1, 'l1', $short);
is $r2->code, 200, 'decode 200';
is cached($dr), 100, 'whole prompt held: cached = P - 1 (last token recomputed)';
is $dr->{choices}[0]{text}, $plain->{choices}[0]{text}, 'same text';
is $d1->stats->{kv}{lmcache_held_chunks}, 0, 'chunks freed after use';
is $d1->last_request->{kv}{outcome}, 'hit', 'decoder record: hit';
(undef, $dr) = decode($d1, 'l1-again', $short);
is cached($dr), 0, 'used chunks are gone';

# --- several chunks ---------------------------------------------------------------
my $long = words('b', 600);     # 601 tokens: chunks 256 + 256 + 89
prefill('l2', $long);
is $d1->stats->{kv}{lmcache_held_chunks}, 3, '3 chunks pushed';
is $p->last_request->{kv}{chunks}, 3, 'prefill record: 3 chunks';
(undef, $dr) = decode($d1, 'l2', $long);
is cached($dr), 600, 'multi-chunk: cached = P - 1';
is $d1->stats->{kv}{lmcache_held_chunks}, 0, 'all freed';

# --- shared prefix only: leading chunks reused ----------------------------------
{
    prefill('l3', $long);
    my $other = words('b', 300) . ' ' . words('z', 300);
    (undef, $dr) = decode($d1, 'l3', $other);
    is cached($dr), $chunk, 'prompt sharing the first chunk: that chunk reused';
    is $d1->stats->{kv}{lmcache_held_chunks}, 2, 'the rest still held';
}

# --- other prompt: no reuse; unused chunks expire ---------------------------------
{
    prefill('l4', $short);
    (undef, $dr) = decode($d1, 'l4', words('q', 100));
    is cached($dr), 0, 'different prompt tokens -> no reuse';
    is $d1->stats->{kv}{lmcache_held_chunks}, 3, 'unused chunks held';
    my $deadline = time + 5;
    sleep 0.1 while time < $deadline && $d1->stats->{kv}{lmcache_held_chunks};
    is $d1->stats->{kv}{lmcache_held_chunks}, 0,
        'unused chunks freed after --kv-hold-timeout';
    is $d1->counter('lmcache_expired_chunks_total'), 3, 'expiry counted';
}

# --- the second decoder receives when named ----------------------------------------
{
    prefill('l5', $short, host => '127.0.0.4');
    is $d2->stats->{kv}{lmcache_held_chunks}, 1, 'pushed to 127.0.0.4';
    is $d1->stats->{kv}{lmcache_held_chunks}, 0, 'not to 127.0.0.3';
    (undef, $dr) = decode($d2, 'l5', $short);
    is cached($dr), 100, '127.0.0.4 reuses it';
}

# --- streaming chat decode ----------------------------------------------------------
{
    my $msgs = [{role => 'user', content => $long}];
    my (undef, $cp) = prefill('l6', undef, path => '/v1/chat/completions',
                              body => {messages => $msgs, max_tokens => 1});
    my $pt = $cp->{usage}{prompt_tokens};
    my $rr = $d1->raw(method => 'POST', path => '/v1/chat/completions',
                      body => {messages => $msgs, max_tokens => 2,
                               stream => $T,
                               stream_options => {include_usage => $T}});
    my ($u) = grep { /"usage"/ } map { $_->[1] } @{ $rr->{events} };
    is $J->decode($u)->{usage}{prompt_tokens_details}{cached_tokens}, $pt - 1,
        'streamed chat decode: cached tokens in the usage chunk';
}

# --- push to a receiver that is not there ----------------------------------------
{
    my ($rr, $x) = prefill('l7', $short, host => '127.0.0.6');
    is $rr->code, 200, 'prefill still answers when the push fails';
    like $p->last_request->{kv}{outcome}, qr/^push failed/, 'recorded';
    is $p->counter('lmcache_push_failed_total'), 1, 'counted';
}

# --- a prefill copy sent to a decode instance is served, not pushed --------------
{
    my $rr = $d1->post_json('/v1/completions',
                            {prompt => $short, max_tokens => 1,
                             kv_transfer_params => spec('l8', '127.0.0.4')});
    is $rr->code, 200, 'decode-role instance answers a prefill copy';
    is $d2->stats->{kv}{lmcache_held_chunks}, 0, 'but pushes nothing';
}

is $p->counter('lmcache_push_ok_total'), 6, 'successful pushes counted';
ok $d1->wait_idle(5) && $d2->wait_idle(5), 'decoders idle';
is $d1->stats->{kv}{used_blocks} + $d2->stats->{kv}{used_blocks}
    + $p->stats->{kv}{used_blocks}, 0, 'no KV block leaked anywhere';

done_testing;
