# vLLM emulator: fault injection, from flags and at run time (/emu/fault).
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/../inc";
use Test::More;
use JSON::PP;
use Time::HiRes qw(time sleep);
use DPD::Emu;

my $J = JSON::PP->new->utf8->canonical;
my $T = JSON::PP::true;
my $base = ($ENV{DPD_EMU_PORT} || 19000) + 4;
my %ports = (port => $base, side_channel_port => $base + 100,
             lmcache_init_port => $base + 200,
             lmcache_alloc_port => $base + 300);
my %fast = (time_scale => 0.02);
my $cmpl = {prompt => 'a b c', max_tokens => 4};
my $prefill_copy = {prompt => 'a b c', max_tokens => 1,
                    kv_transfer_params => {do_remote_decode => $T}};

sub is_error_body {
    my ($r, $code, $name) = @_;
    is $r->code, $code, "$name: status $code";
    my $d = eval { $J->decode($r->content) } || {};
    ok $d->{error} && $d->{error}{code} == $code, "$name: error JSON"
        or diag $r->content;
}

# --- flags ---------------------------------------------------------------------
{
    my $a = DPD::Emu->start(host => '127.0.0.2', %ports, %fast,
                            args => ['--fail-status', 503]);
    is_error_body($a->post_json('/v1/completions', $cmpl), 503,
                  '--fail-status completions');
    is_error_body($a->post_json('/v1/chat/completions',
                                {messages => [{role => 'user', content => 'x'}]}),
                  503, '--fail-status chat');
    is $a->get('/health')->code, 200, '--fail-status leaves /health alone';
    is $a->last_request->{status}, 503, 'fault status recorded';
    is $a->last_request->{fault}{status}, 503, 'fault rule recorded';
    is_deeply $a->last_request->{body},
        {messages => [{role => 'user', content => 'x'}]},
        'faulted request body still recorded';
    $a->stop;

    my $b = DPD::Emu->start(host => '127.0.0.2', %ports, %fast,
                            args => ['--fail-status', 500, '--fault-count', 1,
                                     '--fault-role', 'prefill']);
    is $b->post_json('/v1/completions', $cmpl)->code, 200,
        '--fault-role prefill spares a decode request';
    is $b->post_json('/v1/completions', $prefill_copy)->code, 500,
        '--fault-role prefill hits the prefill copy';
    is $b->post_json('/v1/completions', $prefill_copy)->code, 200,
        '--fault-count 1: only once';
    $b->stop;

    my $c = DPD::Emu->start(host => '127.0.0.2', %ports, %fast,
                            args => ['--malformed-json', '--fault-path',
                                     '/v1/chat/completions']);
    my $r = $c->post_json('/v1/chat/completions',
                          {messages => [{role => 'user', content => 'x'}]});
    is $r->code, 200, '--malformed-json: 200';
    ok !eval { $J->decode($r->content); 1 }, '--malformed-json: broken JSON';
    ok eval { $J->decode($c->post_json('/v1/completions', $cmpl)->content); 1 },
        '--fault-path scopes it';
    $c->stop;

    my $d = DPD::Emu->start(host => '127.0.0.2', %ports, %fast,
                            args => ['--delay-ms', 300]);
    my $t = time;
    is $d->post_json('/v1/completions', $cmpl)->code, 200, '--delay-ms answers';
    ok time - $t >= 0.3, sprintf('--delay-ms delays (%.3fs)', time - $t);
    $d->stop;

    my $h = DPD::Emu->start(host => '127.0.0.2', %ports, %fast,
                            args => ['--hang']);
    my $rr = $h->raw(method => 'POST', path => '/v1/completions',
                     body => $cmpl, timeout => 0.5);
    ok $rr->{timeout} && !defined $rr->{status}, '--hang never answers';
    $h->stop;

    my $x = DPD::Emu->start(host => '127.0.0.2', %ports, %fast,
                            args => ['--disconnect-after', 2]);
    $rr = $x->raw(method => 'POST', path => '/v1/completions',
                  body => {%$cmpl, stream => $T});
    is scalar @{ $rr->{events} }, 2, '--disconnect-after 2: two events';
    ok !$rr->{complete}, '--disconnect-after: stream not terminated';
    $x->stop;
}

# --- run time --------------------------------------------------------------------
my $e = DPD::Emu->start(host => '127.0.0.2', %ports, %fast);

# status with count
$e->fault(status => 502, count => 2);
is $e->post_json('/v1/completions', $cmpl)->code, 502, 'runtime status 1/2';
is $e->post_json('/v1/completions', $cmpl)->code, 502, 'runtime status 2/2';
is $e->post_json('/v1/completions', $cmpl)->code, 200, 'count exhausted';
is_deeply $J->decode($e->get('/emu/fault')->content)->{rules}, [],
    'rule removed after its count';

# path scope
$e->fault(status => 429, path => '/v1/chat/completions');
is $e->post_json('/v1/completions', $cmpl)->code, 200, 'path: other path spared';
is $e->post_json('/v1/chat/completions',
                 {messages => [{role => 'user', content => 'x'}]})->code, 429,
    'path: named path hit';
$e->clear_faults;
is $e->post_json('/v1/chat/completions',
                 {messages => [{role => 'user', content => 'x'}]})->code, 200,
    'cleared';

# role scope (prefill copy vs anything else)
$e->fault(status => 503, role => 'decode');
is $e->post_json('/v1/completions', $prefill_copy)->code, 200,
    'role decode: prefill copy spared';
is $e->post_json('/v1/completions', $cmpl)->code, 503, 'role decode: hit';
$e->clear_faults;

# /health can be failed explicitly
$e->fault(status => 503, path => '/health', count => 1);
is $e->get('/health')->code, 503, '/health fault';
is $e->get('/health')->code, 200, '/health back';

# several rules, first match wins
$e->fault(rules => [{status => 418, path => '/v1/completions', count => 1},
                    {status => 500, count => 1}]);
is $e->post_json('/v1/completions', $cmpl)->code, 418, 'first rule';
is $e->post_json('/v1/completions', $cmpl)->code, 500, 'second rule';
is $e->post_json('/v1/completions', $cmpl)->code, 200, 'both used up';

# bad rules are refused
is $e->post_json('/emu/fault', {statuss => 500})->code, 400,
    'unknown fault field refused';
is $e->post_json('/emu/fault', {status => 500, role => 'x'})->code, 400,
    'bad role refused';

# delay
$e->fault(delay_ms => 250, count => 1);
my $t = time;
is $e->post_json('/v1/completions', $cmpl)->code, 200, 'delay answers';
ok time - $t >= 0.25, sprintf('delay_ms honoured (%.3fs)', time - $t);

# hang: no answer; the emulator notices the client leaving
$e->fault(hang => $T, count => 1);
my $rr = $e->raw(method => 'POST', path => '/v1/completions', body => $cmpl,
                 timeout => 0.4, headers => {'X-Request-Id' => 'hang-1'});
ok $rr->{timeout} && !defined $rr->{status}, 'hang: nothing sent';
sleep 0.3;
my $rec = $e->last_request(request_id => 'hang-1');
ok $rec->{aborted}, 'hang: client close noticed';
is $e->post_json('/v1/completions', $cmpl)->code, 200, 'after hang: serving';

# disconnect mid-stream
$e->fault(disconnect_after => 3, count => 1);
$rr = $e->raw(method => 'POST', path => '/v1/completions',
              body => {prompt => 'a', max_tokens => 10, stream => $T},
              headers => {'X-Request-Id' => 'disc-1'});
is $rr->{status}, 200, 'disconnect: headers sent';
is scalar @{ $rr->{events} }, 3, 'disconnect after 3 events';
ok !$rr->{complete}, 'disconnect: no terminating chunk';
sleep 0.1;
ok $e->last_request(request_id => 'disc-1')->{aborted},
    'disconnect: generation aborted';
ok $e->wait_idle(5), 'disconnect: nothing left running';
is $e->stats->{kv}{used_blocks}, 0, 'disconnect: KV blocks freed';

# disconnect on a non-streaming answer: part of the body
$e->fault(disconnect_after => 10, count => 1);
$rr = $e->raw(method => 'POST', path => '/v1/completions', body => $cmpl);
is $rr->{status}, 200, 'non-stream disconnect: headers';
ok $rr->{headers}{'content-length'} > 10, 'content-length of the full body';
is length($rr->{body}), 10, 'only 10 bytes of the body';
ok !$rr->{complete}, 'body truncated';

# disconnect before answering
$e->fault(disconnect_after => 0, count => 1);
$rr = $e->raw(method => 'POST', path => '/v1/completions', body => $cmpl);
ok !defined $rr->{status}, 'disconnect_after 0: connection closed, no answer';

# malformed JSON, non-stream and stream
$e->fault(malformed_json => $T, count => 2);
my $r = $e->post_json('/v1/completions', $cmpl);
is $r->code, 200, 'malformed: 200';
ok !eval { $J->decode($r->content); 1 }, 'malformed: body not JSON';
$rr = $e->raw(method => 'POST', path => '/v1/completions',
              body => {%$cmpl, stream => $T});
my @ev = grep { $_->[1] ne '[DONE]' } @{ $rr->{events} };
is scalar @ev, 4, 'malformed stream: events still framed';
ok !(grep { eval { $J->decode($_->[1]); 1 } } @ev),
    'malformed stream: no event is valid JSON';
is $e->post_json('/v1/completions', $cmpl)->code, 200, 'malformed used up';
ok eval { $J->decode($e->post_json('/v1/completions', $cmpl)->content); 1 },
    'valid JSON again';

# reply tampering for the gateway's tests: foreign remote_host, no params,
# oversized reply
$e->fault(kv_override => {remote_host => '10.9.9.9'}, role => 'prefill',
          count => 1);
my $kv = $J->decode($e->post_json('/v1/completions', $prefill_copy)->content)
    ->{kv_transfer_params};
is $kv->{remote_host}, '10.9.9.9', 'kv_override: foreign remote_host';
is $kv->{do_remote_prefill}, JSON::PP::true, 'kv_override: rest kept';
$e->fault(kv_drop => $T, count => 1);
my $x = $J->decode($e->post_json('/v1/completions', $prefill_copy)->content);
ok exists $x->{kv_transfer_params} && !defined $x->{kv_transfer_params},
    'kv_drop: reply without kv_transfer_params';
$e->fault(pad_bytes => 300000, count => 1);
$r = $e->post_json('/v1/completions', $cmpl);
ok length($r->content) > 300000, 'pad_bytes: oversized reply';
ok eval { $J->decode($r->content); 1 }, 'pad_bytes: still JSON';
is $e->post_json('/emu/fault', {kv_override => 5})->code, 400,
    'kv_override must be an object';

ok $e->counter('faults_total') >= 12, 'faults counted';

done_testing;
