# vLLM emulator: timing model.  Continuous batching with chunked prefill:
# a prefill chunk co-located with running decodes lengthens their steps;
# prefill is compute bound; queueing shows in the metrics; client aborts
# free everything.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/../inc";
use Test::More;
use JSON::PP;
use IO::Socket::INET;
use Time::HiRes qw(time sleep);
use DPD::Emu;

my $J = JSON::PP->new->utf8->canonical;
my $T = JSON::PP::true;
my $base = ($ENV{DPD_EMU_PORT} || 19000) + 5;
my %ports = (port => $base, side_channel_port => $base + 100,
             lmcache_init_port => $base + 200,
             lmcache_alloc_port => $base + 300);
my %model = (decode_step_ms => 20, prefill_tps => 10000,
             max_num_batched_tokens => 512);
my $long_prompt = join ' ', map { "w$_" } 1 .. 6000;    # 6001 tokens

my $e = DPD::Emu->start(host => '127.0.0.2', %ports, %model, time_scale => 1);

sub median {
    my @s = sort { $a <=> $b } @_;
    return $s[$#s / 2];
}

sub gaps {
    my ($r) = @_;
    my @t = map { $_->[0] } grep { $_->[1] ne '[DONE]' } @{ $r->{events} };
    return map { $t[$_] - $t[$_ - 1] } 1 .. $#t;
}

sub send_raw {
    my ($emu, $body) = @_;
    my $s = IO::Socket::INET->new(PeerAddr => $emu->host,
                                  PeerPort => $emu->port) or die "$!";
    my $b = $J->encode($body);
    print $s "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        . "Content-Type: application/json\r\nContent-Length: "
        . length($b) . "\r\n\r\n$b";
    return $s;
}

sub read_all {
    my ($s) = @_;
    local $/;
    my $x = <$s>;
    my ($body) = $x =~ /\r\n\r\n(.*)\z/s;
    return $J->decode($body);
}

my $short = {prompt => 'short one', max_tokens => 40, stream => $T};

# --- A: a short stream alone --------------------------------------------------
my $ra = $e->raw(method => 'POST', path => '/v1/completions', body => $short);
my @ga = gaps($ra);
my $dur_a = $ra->{events}[-1][0] - $ra->{events}[0][0];
my $med_a = median(@ga);
ok $med_a > 0.015 && $med_a < 0.035,
    sprintf('alone: inter-token gap ~ decode step (median %.1f ms)',
            $med_a * 1000);

# --- B: the same stream while a long prompt is prefilled next to it ---------
my ($long_sock, $t_long);
my $rb = $e->raw(method => 'POST', path => '/v1/completions', body => $short,
                 on_event => sub {
                     return unless $_[0] == 3;
                     $t_long = time;
                     $long_sock = send_raw($e, {prompt => $long_prompt,
                                                max_tokens => 1});
                 });
my $long = read_all($long_sock);
my ($long_rec) = grep { ($_->{prompt_tokens} // 0) == 6001 } $e->requests;
my $long_ttft = $long_rec->{ttft_ms} / 1000;
my @gb = gaps($rb);
my $dur_b = $rb->{events}[-1][0] - $rb->{events}[0][0];
my $slow_a = grep { $_ > 0.06 } @ga;
my $slow_b = grep { $_ > 0.06 } @gb;
diag sprintf('A: %.3fs, %d gaps > 60ms; B: %.3fs, %d gaps > 60ms; '
             . 'long prefill %.3fs', $dur_a, $slow_a, $dur_b, $slow_b,
             $long_ttft);
is $long->{usage}{prompt_tokens}, 6001, 'long prompt counted';
ok $slow_b >= 8,
    "co-located prefill chunks lengthen decode steps ($slow_b slow gaps, ~12 expected)";
ok $slow_a <= 3, "without prefill no slow steps ($slow_a)";
ok $dur_b - $dur_a > 0.35,
    sprintf('stream slowed by the prefill: +%.0f ms (~610 expected)',
            ($dur_b - $dur_a) * 1000);
ok $long_ttft > 0.7 && $long_ttft < 1.5,
    sprintf('long prefill is compute bound: %.3fs (12 steps of 20 ms + '
            . '511/10000 s: 0.853 expected)', $long_ttft);

# --- the prefill of a short prompt is one step -------------------------------
{
    my $r = $e->raw(method => 'POST', path => '/v1/completions',
                    body => {prompt => 'tiny', max_tokens => 2, stream => $T});
    ok $r->{events}[0][0] < 0.08,
        sprintf('short prompt TTFT %.1f ms', $r->{events}[0][0] * 1000);
}

# --- time scale -------------------------------------------------------------------
{
    my $q = DPD::Emu->start(host => '127.0.0.3', %ports, %model,
                            time_scale => 0.25);
    my $r = $q->raw(method => 'POST', path => '/v1/completions', body => $short);
    my $d = $r->{events}[-1][0] - $r->{events}[0][0];
    ok $d < $dur_a * 0.5, sprintf('time_scale 0.25: %.3fs vs %.3fs', $d, $dur_a);
    $q->stop;
}

# --- queueing: max_num_seqs 1 -> waiting, KV usage --------------------------
{
    my $q = DPD::Emu->start(host => '127.0.0.4', %ports, %model,
                            time_scale => 1, max_num_seqs => 1,
                            kv_blocks => 100);
    my $s1 = send_raw($q, {prompt => 'first', max_tokens => 25});
    sleep 0.05;
    my $s2 = send_raw($q, {prompt => 'second', max_tokens => 2});
    sleep 0.15;
    is $q->metric('vllm:num_requests_running'), 1, 'running 1';
    is $q->metric('vllm:num_requests_waiting'), 1, 'waiting 1 (max_num_seqs)';
    ok $q->metric('vllm:gpu_cache_usage_perc') > 0, 'KV usage while running';
    my $t = time;
    read_all($s1);
    my $d2 = read_all($s2);
    is $d2->{usage}{completion_tokens}, 2, 'queued request served after';
    ok $q->wait_idle(5), 'idle again';
    is $q->metric('vllm:gpu_cache_usage_perc'), 0, 'KV usage back to 0';
    $q->stop;
}

# --- client abort mid-stream frees the sequence ------------------------------
{
    my $r = $e->raw(method => 'POST', path => '/v1/completions',
                    body => {prompt => 'abort me', max_tokens => 200,
                             stream => $T},
                    headers => {'X-Request-Id' => 'abort-1'},
                    close_after => 2);
    ok $r->{closed_early}, 'client closed after 2 events';
    ok $e->wait_idle(3), 'scheduler drops the aborted sequence';
    my $rec = $e->last_request(request_id => 'abort-1');
    ok $rec->{aborted}, 'record marked aborted';
    ok $rec->{completion_tokens} < 50, 'generation stopped early';
    is $e->stats->{kv}{used_blocks}, 0, 'its KV blocks are freed';
    is $e->counter('aborted_total'), 1, 'aborted counter';
}

done_testing;
