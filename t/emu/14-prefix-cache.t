# vLLM emulator: automatic prefix caching per pod, as vLLM v1 does it
# (vllm/v1/core/kv_cache_manager.py get_computed_blocks, block_pool.py,
# kv_cache_utils.py @001cabc1be16): full blocks only, chained hashes with
# cache_salt on block 0 and the LoRA name on every block, at most
# num_tokens - 1 tokens cached (the last token is always computed), a block
# pool of the pod's capacity whose free cached blocks are evicted least
# recently used first, a chain's tail before its head; prefill time from
# the uncached tokens only; usage.prompt_tokens_details.cached_tokens.
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
my $base = ($ENV{DPD_EMU_PORT} || 19000) + 14;
my %ports = (port => $base, side_channel_port => $base + 100,
             lmcache_init_port => $base + 200,
             lmcache_alloc_port => $base + 300);
my $BS = 16;

sub post {
    my ($e, $path, $body) = @_;
    my $r = $e->post_json($path, $body);
    die "$path: " . $r->status_line . ' ' . $r->content
        unless $r->is_success;
    return $J->decode($r->content);
}

sub cached { ($_[0]{usage}{prompt_tokens_details} || {})->{cached_tokens} // 0 }

sub ids { my ($from, $n) = @_; [map { $from + $_ } 0 .. $n - 1] }

sub full { $BS * int(($_[0] - 1) / $BS) }    # what a whole-prompt hit gives

my ($a, $b) = DPD::Emu->start_many(count => 2, %ports, prefix_caching => 1, time_scale => 0.01,
                                   args => ['--lora-modules', 'ad1=/x']);

# --- a multi-turn chat grows its cached prefix turn by turn -----------------
{
    my @msgs = ({role => 'system', content => join ' ', map { "sys$_" } 1 .. 60},
                {role => 'user', content => 'first question about things'});
    my ($prev_prompt, $prev) = (0, -1);
    my @got;
    for my $turn (1 .. 5) {
        my $r = post($a, '/v1/chat/completions',
                     {messages => \@msgs, max_tokens => 12});
        my ($p, $c) = ($r->{usage}{prompt_tokens}, cached($r));
        push @got, "$c/$p";
        if ($turn == 1) {
            is $c, 0, 'turn 1: nothing cached';
            ok !defined $r->{usage}{prompt_tokens_details},
                'turn 1: prompt_tokens_details null';
        } else {
            ok $c > $prev, "turn $turn: cached grows ($c > $prev)";
            is $c % $BS, 0, "turn $turn: whole blocks";
            cmp_ok $c, '<=', $p - 1, "turn $turn: the last token computed";
            # the previous prompt's full blocks are all cached (and the
            # reply's, as far as the template renders them back alike)
            cmp_ok $c, '>=', $BS * int($prev_prompt / $BS),
                "turn $turn: at least the previous prompt's full blocks";
        }
        ($prev_prompt, $prev) = ($p, $c);
        push @msgs, {role => 'assistant',
                     content => $r->{choices}[0]{message}{content}},
                    {role => 'user', content => "follow up number $turn"};
    }
    diag 'cached/prompt per turn: ' . join ' ', @got;
    my $rec = $a->last_request(path => '/v1/chat/completions');
    is $rec->{cached_tokens}, $prev, 'record: cached_tokens as reported';
    is $rec->{prefix_cache_hit_tokens}, $prev, 'record: all from the cache';

    # the same conversation on another pod: nothing there
    my $r = post($b, '/v1/chat/completions',
                 {messages => [@msgs[0 .. $#msgs - 2]], max_tokens => 1});
    is cached($r), 0, 'another pod: 0 cached';

    # the stream's final usage reports it too
    my $s = $a->raw(method => 'POST', path => '/v1/chat/completions',
                    body => {messages => [@msgs[0 .. $#msgs - 2]],
                             max_tokens => 2, stream => $T,
                             stream_options => {include_usage => $T}});
    my ($u) = map { $J->decode($_->[1])->{usage} }
              grep { $_->[1] =~ /"usage":\{/ } @{ $s->{events} };
    ok $u && ($u->{prompt_tokens_details} || {})->{cached_tokens}
        == full($u->{prompt_tokens}),
        'stream usage: cached_tokens = the whole prompt minus its last block'
        or diag explain $u;

    is $a->metric('vllm:prefix_cache_hits_total'),
       $a->stats->{kv}{prefix_cache}{hits},
       'vllm:prefix_cache_hits_total';
    cmp_ok $a->metric('vllm:prefix_cache_queries_total'), '>',
           $a->metric('vllm:prefix_cache_hits_total'), 'queries > hits';
}

# --- completions: token ids, whole-prompt hit, salt, LoRA, logprobs --------
{
    my $p = ids(500, 100);
    my $r1 = post($a, '/v1/completions', {prompt => $p, max_tokens => 1});
    is cached($r1), 0, 'completions: first time 0';
    my $r2 = post($a, '/v1/completions', {prompt => $p, max_tokens => 1});
    is cached($r2), 96, 'whole prompt cached: 96 of 100 (last block computed)';
    my $p2 = ids(500, 96);
    is cached(post($a, '/v1/completions', {prompt => $p2, max_tokens => 1})),
       80, 'prompt of exactly 6 blocks: 5 reused, the last block recomputed';

    my %seen;
    for my $salt (qw(tenant-a tenant-a tenant-b)) {
        my $r = post($a, '/v1/completions',
                     {prompt => $p, max_tokens => 1, cache_salt => $salt});
        my $want = $seen{$salt}++ ? 96 : 0;
        is cached($r), $want, "cache_salt $salt: $want";
    }
    my $bad = $a->post_json('/v1/completions',
                            {prompt => $p, max_tokens => 1, cache_salt => ''});
    is $bad->code, 400, 'empty cache_salt: 400';
    like $bad->content, qr/cache_salt' must be a non-empty string/,
        "vLLM's message";
    is $a->post_json('/v1/completions', {prompt => $p, max_tokens => 1,
                                          cache_salt => 7})->code,
       400, 'cache_salt not a string: 400';

    is cached(post($a, '/v1/completions',
                   {prompt => $p, max_tokens => 1, model => 'ad1'})),
       0, 'LoRA ad1: the base model\'s blocks do not match';
    is cached(post($a, '/v1/completions',
                   {prompt => $p, max_tokens => 1, model => 'ad1'})),
       96, 'LoRA ad1: its own blocks do';
    is cached(post($a, '/v1/completions',
                   {prompt => $p, max_tokens => 1, prompt_logprobs => 1})),
       0, 'prompt_logprobs: the cache is not read';
}

# --- the timing model: prefill from the uncached tokens only ---------------
{
    my $t = DPD::Emu->start(host => '127.0.0.4', %ports, prefix_caching => 1, time_scale => 1,
                            prefill_tps => 10000, decode_step_ms => 10,
                            max_num_batched_tokens => 8192);
    my $p = ids(7000, 4000);
    my $c0 = $t->counter('prefill_tokens_computed_total');
    post($t, '/v1/completions', {prompt => $p, max_tokens => 1});
    my $c1 = $t->counter('prefill_tokens_computed_total');
    my $r = post($t, '/v1/completions', {prompt => $p, max_tokens => 1});
    my $c2 = $t->counter('prefill_tokens_computed_total');
    my @rec = $t->requests(path => '/v1/completions');
    is $c1 - $c0, 4000, 'first: 4000 tokens computed';
    is cached($r), 3984, 'second: 3984 cached';
    is $c2 - $c1, 16, 'second: only the last 16 computed';
    my ($t1, $t2) = map { $_->{ttft_ms} } @rec[-2, -1];
    ok $t2 < $t1 / 4, sprintf('TTFT %.1f ms cached vs %.1f ms cold', $t2, $t1);
    $t->stop;
}

# --- eviction: a 20-block pool, LRU, a chain's tail first ------------------
{
    # decode steps of 20 ms (scaled): a 40-token stream runs ~0.8 s
    my $s = DPD::Emu->start(host => '127.0.0.5', %ports, prefix_caching => 1, time_scale => 0.01,
                            decode_step_ms => 2000, kv_blocks => 20);
    my ($x, $y, $z) = (ids(1000, 80), ids(2000, 80), ids(3000, 160));
    # x: 6 blocks (5 full ones cached), y: the same, z: 11 blocks: the 8
    # never used, then x's partial block, then x's 5th and 4th blocks
    post($s, '/v1/completions', {prompt => $_, max_tokens => 1})
        for $x, $y, $z;
    my $pc = $s->stats->{kv}{prefix_cache};
    is $pc->{evicted_blocks}, 2, 'two cached blocks evicted';
    is cached(post($s, '/v1/completions', {prompt => $x, max_tokens => 1})),
       48, 'x, least recently used: its first 3 blocks left';
    is $s->stats->{kv}{prefix_cache}{evicted_blocks}, 4,
        'x took y\'s partial block and evicted y\'s last two';
    # x's 3 new blocks came from the head of the queue: y's partial block,
    # then y's last two
    is cached(post($s, '/v1/completions', {prompt => $y, max_tokens => 1})),
       48, 'y: lost its tail to x';

    # blocks of a running request are never evicted
    my $long = ids(4000, 80);
    post($s, '/v1/completions', {prompt => $long, max_tokens => 1});
    my ($started, $running);
    my $run = $s->raw(method => 'POST', path => '/v1/completions',
                      body => {prompt => $long, max_tokens => 40,
                               stream => $T},
                      on_event => sub {
                          return if $started || $_[0] != 2;
                          $started = 1;
                          # 3 x 11 blocks through what the stream leaves
                          post($s, '/v1/completions',
                               {prompt => ids(5000 + 200 * $_, 160),
                                max_tokens => 1}) for 1 .. 3;
                          $running = $s->stats(since => 1 << 30)
                              ->{scheduler}{running};
                      });
    ok $started && $running, 'other prompts ran beside the stream';
    cmp_ok $s->stats->{kv}{prefix_cache}{evicted_blocks}, '>', 4,
        'they evicted cached blocks';
    is cached(post($s, '/v1/completions', {prompt => $long, max_tokens => 1})),
       64, 'the running request\'s blocks survived';

    # reset_prefix_cache: everything forgotten
    my $rr = $s->post_json('/reset_prefix_cache', '');
    is $rr->code, 200, 'POST /reset_prefix_cache: 200';
    is $s->stats->{kv}{prefix_cache}{resets}, 1, 'reset done';
    is cached(post($s, '/v1/completions', {prompt => $long, max_tokens => 1})),
       0, 'after the reset: 0';
    is $s->stats->{kv}{prefix_cache}{cached_blocks}, 5,
        'only the new prompt cached (its 5 full blocks)';
    $s->stop;
}

# --- disaggregated: the decoder caches what it pulled, the prefiller what
#     it computed (vLLM caches received blocks like computed ones) -----------
{
    my %c = (%ports, prefix_caching => 1, time_scale => 0.01);
    my $p = DPD::Emu->start(host => '127.0.0.6', role => 'prefill', %c);
    my $d = DPD::Emu->start(host => '127.0.0.7', role => 'decode', %c);
    my $prompt = ids(9000, 200);
    my $pr = post($p, '/v1/completions',
                  {prompt => $prompt, max_tokens => 1,
                   kv_transfer_params => {do_remote_decode => $T}});
    my $dr = post($d, '/v1/completions',
                  {prompt => $prompt, max_tokens => 4,
                   kv_transfer_params => $pr->{kv_transfer_params}});
    is cached($dr), 192, 'decode after the pull: 192 cached';
    is $d->last_request->{prefix_cache_hit_tokens}, 0, '... by the transfer';
    my $again = post($d, '/v1/completions',
                     {prompt => $prompt, max_tokens => 1});
    is cached($again), 192, 'the same prompt again on the decoder: cached';
    is $d->last_request->{prefix_cache_hit_tokens}, 192,
        '... from its own prefix cache now';
    my $pr2 = post($p, '/v1/completions',
                   {prompt => $prompt, max_tokens => 1,
                    kv_transfer_params => {do_remote_decode => $T}});
    is cached($pr2), 192, 'the prefiller reuses its own blocks';
    # a longer prompt with the same start: the decoder pulls only the
    # blocks its own cache lacks (vLLM's NIXL worker reads the tail)
    my $longer = [@$prompt, @{ ids(9500, 100) }];
    my $pr3 = post($p, '/v1/completions',
                   {prompt => $longer, max_tokens => 1,
                    kv_transfer_params => {do_remote_decode => $T}});
    my $dr3 = post($d, '/v1/completions',
                   {prompt => $longer, max_tokens => 1,
                    kv_transfer_params => $pr3->{kv_transfer_params}});
    is cached($dr3), 288, 'decode of the longer prompt: 288 cached';
    my $kv = $d->last_request->{kv};
    is $kv->{outcome}, 'ok', 'pulled';
    is $kv->{transferred_tokens}, 288 - 192,
        'only the 96 tokens the decoder lacked were moved';
    is $d->counter('nixl_transferred_tokens_total'), 192 + 96,
        'the decoder counts the tokens its pulls moved (192, then 96)';
    is $d->metric('emu_nixl_transferred_tokens_total'), 192 + 96,
        '... in /metrics too';
    $p->stop;
    $d->stop;
}

# --- --no-enable-prefix-caching --------------------------------------------
{
    my $n = DPD::Emu->start(host => '127.0.0.8', %ports, prefix_caching => 1, time_scale => 0.01,
                            args => ['--no-enable-prefix-caching']);
    my $p = ids(100, 64);
    post($n, '/v1/completions', {prompt => $p, max_tokens => 1});
    is cached(post($n, '/v1/completions', {prompt => $p, max_tokens => 1})),
       0, 'prefix caching off: nothing cached';
    is $n->metric('vllm:prefix_cache_queries_total'), 0, 'no queries';
    $n->stop;
}

done_testing;
