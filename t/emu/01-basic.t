# vLLM emulator: endpoints, response shapes, prompt shapes, deterministic
# text, metrics and the /emu/stats view.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/../inc";
use Test::More;
use JSON::PP;
use IO::Socket::INET;
use DPD::Emu;

my $J = JSON::PP->new->utf8->canonical;
my $base = ($ENV{DPD_EMU_PORT} || 19000) + 1;
my $e = DPD::Emu->start(host => '127.0.0.2', port => $base,
                        side_channel_port => $base + 100,
                        lmcache_init_port => $base + 200,
                        lmcache_alloc_port => $base + 300,
                        time_scale => 0.02, model => 'test-model');

sub post {
    my ($path, $body, %h) = @_;
    my $r = $e->post_json($path, $body, %h);
    my $d = eval { $J->decode($r->content) };
    return ($r, $d);
}

# --- health, models --------------------------------------------------------
{
    my $r = $e->get('/health');
    is $r->code, 200, 'GET /health 200';
    is $r->content, '', '/health has an empty body';
    $r = $e->get('/v1/models');
    my $m = $J->decode($r->content);
    is $m->{object}, 'list', '/v1/models object list';
    is $m->{data}[0]{id}, 'test-model', 'served model name';
    is $m->{data}[0]{object}, 'model', 'model object';
    is $m->{data}[0]{owned_by}, 'vllm', 'owned_by vllm';
    ok $m->{data}[0]{max_model_len} > 0, 'max_model_len';
}

# --- non-streaming completions ----------------------------------------------
my $now = time;
my ($r, $d) = post('/v1/completions', {prompt => 'a b c', max_tokens => 5},
                   'X-Request-Id' => 'rid-1');
is $r->code, 200, 'completion 200';
is $r->header('Content-Type'), 'application/json', 'JSON content type';
like $r->content,
    qr/^\{"id":"cmpl-rid-1","object":"text_completion","created":\d+,"model":"test-model","choices":\[\{"index":0,"text":"[^"]*","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_logprobs":null\}\],"usage":\{"prompt_tokens":4,"total_tokens":9,"completion_tokens":5,"prompt_tokens_details":null\},"kv_transfer_params":null\}$/,
    'completion body shaped (and ordered) as vLLM';
ok abs($d->{created} - $now) < 60, 'created is a unix time';
like $d->{choices}[0]{text}, qr/^( [a-z]+){5}$/, 'five generated words';
my $text5 = $d->{choices}[0]{text};

# deterministic text
(undef, my $d2) = post('/v1/completions', {prompt => 'a b c', max_tokens => 5});
is $d2->{choices}[0]{text}, $text5, 'same prompt, same text';
(undef, $d2) = post('/v1/completions', {prompt => 'a b c', max_tokens => 9});
is substr($d2->{choices}[0]{text}, 0, length $text5), $text5,
    'longer generation continues the same text';
is $d2->{usage}{completion_tokens}, 9, 'max_tokens honoured';
(undef, $d2) = post('/v1/completions', {prompt => 'x y z w', max_tokens => 5});
isnt $d2->{choices}[0]{text}, $text5, 'other prompt, other text';
like $d2->{id}, qr/^cmpl-[0-9a-f]{32}$/, 'generated id without X-Request-Id';

# default max_tokens (16, as vLLM completions)
(undef, $d2) = post('/v1/completions', {prompt => 'a b c'});
is $d2->{usage}{completion_tokens}, 16, 'default max_tokens 16';

# --- prompt shapes -------------------------------------------------------------
(undef, $d2) = post('/v1/completions', {prompt => ['a b', 'c d e'],
                                        max_tokens => 2});
is scalar @{ $d2->{choices} }, 2, 'list of strings: one choice each';
is_deeply [map { $_->{index} } @{ $d2->{choices} }], [0, 1], 'choice indexes';
is $d2->{usage}{prompt_tokens}, 3 + 4, 'list of strings: tokens summed (BOS each)';
is $d2->{usage}{completion_tokens}, 4, 'completion tokens summed';
(undef, $d2) = post('/v1/completions', {prompt => [11, 12, 13], max_tokens => 1});
is $d2->{usage}{prompt_tokens}, 3, 'token ids counted, no BOS added';
(undef, $d2) = post('/v1/completions', {prompt => [[1, 2], [3, 4, 5]],
                                        max_tokens => 1});
is $d2->{usage}{prompt_tokens}, 5, 'list of id lists counted';
is scalar @{ $d2->{choices} }, 2, 'list of id lists: two choices';
(undef, $d2) = post('/v1/completions', {prompt => 'a b c', max_tokens => 1,
                                        add_special_tokens => JSON::PP::false});
is $d2->{usage}{prompt_tokens}, 3, 'add_special_tokens false: no BOS';
($r, $d2) = post('/v1/completions', {prompt => 'a', max_tokens => 1,
                                     temperature => 0.3, foo => {bar => [1]},
                                     model => 'whatever'});
is $r->code, 200, 'unknown fields and other model names ignored';

# stop strings
{
    (undef, my $full) = post('/v1/completions', {prompt => 'stop test',
                                                 max_tokens => 8});
    my $t = $full->{choices}[0]{text};
    my @w = $t =~ / (\w+)/g;
    my $stop = " $w[2]";
    my $want = substr($t, 0, index($t, $stop));
    (undef, my $s) = post('/v1/completions', {prompt => 'stop test',
                                              max_tokens => 8,
                                              stop => [$stop]});
    is $s->{choices}[0]{text}, $want, 'text cut before the stop string';
    is $s->{choices}[0]{finish_reason}, 'stop', 'finish_reason stop';
    is $s->{choices}[0]{stop_reason}, $stop, 'stop_reason names the string';
}

# --- chat ----------------------------------------------------------------------
my $msgs = [{role => 'system', content => 'be brief'},
            {role => 'user', content => 'hello there'}];
($r, $d) = post('/v1/chat/completions', {messages => $msgs, max_tokens => 3},
                'X-Request-Id' => 'rid-2');
is $r->code, 200, 'chat 200';
like $r->content,
    qr/^\{"id":"chatcmpl-rid-2","object":"chat.completion","created":\d+,"model":"test-model","choices":\[\{"index":0,"message":\{"role":"assistant","content":"[^"]*","reasoning":null\},"logprobs":null,"finish_reason":"length","stop_reason":null\}\],"usage":\{"prompt_tokens":\d+,"total_tokens":\d+,"completion_tokens":3,"prompt_tokens_details":null\},"prompt_logprobs":null,"kv_transfer_params":null\}$/,
    'chat body shaped (and ordered) as vLLM';
like $d->{choices}[0]{message}{content}, qr/^( [a-z]+){3}$/, 'chat text';
(undef, $d2) = post('/v1/chat/completions', {messages => $msgs, max_tokens => 3,
                                             max_completion_tokens => 2});
is $d2->{usage}{completion_tokens}, 2,
    'max_completion_tokens wins over max_tokens';
is $d2->{choices}[0]{message}{content},
    substr($d->{choices}[0]{message}{content}, 0,
           length $d2->{choices}[0]{message}{content}),
    'chat text deterministic';
(undef, $d2) = post('/v1/chat/completions', {messages => [
    {role => 'user', content => [{type => 'text', text => 'hello'}]}],
    max_tokens => 1});
is $d2->{usage}{completion_tokens}, 1, 'content as text parts accepted';

# --- errors for paths and methods -------------------------------------------
$r = $e->get('/v1/nothing');
is $r->code, 404, 'unknown path 404';
is $r->content, '{"detail":"Not Found"}', 'FastAPI 404 body';
$r = $e->get('/v1/completions');
is $r->code, 405, 'GET on completions 405';

# --- keep-alive: two requests on one connection ------------------------------
{
    my $s = IO::Socket::INET->new(PeerAddr => '127.0.0.2', PeerPort => $base)
        or die "connect: $!";
    my $b = '{"prompt":"k","max_tokens":2}';
    my $req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
              . "Content-Type: application/json\r\nContent-Length: "
              . length($b) . "\r\n\r\n$b";
    local $SIG{ALRM} = sub { die "timeout\n" };
    alarm 10;
    my $resp = '';
    for (1 .. 2) {
        print $s $req;
        my $buf = '';
        while (1) {
            sysread($s, my $d, 65536) or last;
            $buf .= $d;
            next unless $buf =~ /\r\n\r\n/;
            my ($len) = $buf =~ /content-length: (\d+)/i;
            last if length($buf) - index($buf, "\r\n\r\n") - 4 >= $len;
        }
        $resp .= $buf;
    }
    alarm 0;
    my @st = $resp =~ m{HTTP/1\.1 200 OK}g;
    is scalar @st, 2, 'HTTP/1.1 keep-alive: two answers on one connection';
    unlike $resp, qr/connection: close/i, 'no connection: close';
    close $s;
}

# chunked request body (nginx with proxy_request_buffering off)
{
    my $s = IO::Socket::INET->new(PeerAddr => '127.0.0.2', PeerPort => $base)
        or die;
    my $b = '{"prompt":"chunked body","max_tokens":1}';
    my $p1 = substr($b, 0, 10);
    my $p2 = substr($b, 10);
    print $s "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        . "Transfer-Encoding: chunked\r\n\r\n"
        . sprintf("%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n", length $p1, $p1,
                  length $p2, $p2);
    local $/;
    my $resp = <$s>;
    like $resp, qr/^HTTP\/1\.1 200 .*"prompt_tokens":3,/s,
        'chunked request body read';
}

# --- metrics -------------------------------------------------------------------
{
    my $m = $e->metrics;
    for my $n (qw(vllm:num_requests_running vllm:num_requests_waiting
                  vllm:gpu_cache_usage_perc vllm:prompt_tokens_total
                  vllm:generation_tokens_total vllm:request_success_total
                  emu_requests_total emu_nixl_held_blocks)) {
        like $m, qr/^# TYPE \Q$n\E (gauge|counter)$/m, "metric $n typed";
        like $m, qr/^\Q$n\E\{[^}]*model_name="test-model"[^}]*\} \d/m,
            "metric $n sample";
    }
    my $g0 = $e->metric('vllm:generation_tokens_total');
    my $p0 = $e->metric('vllm:prompt_tokens_total');
    my $s0 = $e->metric('vllm:request_success_total', 'finished_reason="length"');
    post('/v1/completions', {prompt => 'a b c', max_tokens => 7});
    post('/v1/chat/completions', {messages => $msgs, max_tokens => 2});
    is $e->metric('vllm:generation_tokens_total'), $g0 + 9,
        'generation_tokens_total counts generated tokens';
    my $chat_prompt = $d->{usage}{prompt_tokens};
    is $e->metric('vllm:prompt_tokens_total'), $p0 + 4 + $chat_prompt,
        'prompt_tokens_total counts prompt tokens';
    is $e->metric('vllm:request_success_total', 'finished_reason="length"'),
        $s0 + 2, 'request_success_total by finished_reason';
    is $e->metric('vllm:num_requests_running'), 0, 'nothing running when idle';
    is $e->metric('vllm:gpu_cache_usage_perc'), 0, 'KV cache empty when idle';
}

# --- /emu/stats ------------------------------------------------------------------
{
    $e->reset;
    my $st = $e->stats;
    is scalar @{ $st->{requests} }, 0, 'reset forgets records';
    my $body = {prompt => 'seen body', max_tokens => 2, extra => 'kept'};
    post('/v1/completions', $body, 'X-Request-Id' => 'rid-3',
         Authorization => 'Bearer sk-test');
    my $rec = $e->last_request(request_id => 'rid-3');
    ok $rec, 'request recorded by X-Request-Id';
    is_deeply $rec->{body}, $body, 'body recorded as received';
    is $rec->{headers}{authorization}, 'Bearer sk-test',
        'headers recorded (Authorization)';
    is $rec->{path}, '/v1/completions', 'path recorded';
    is $rec->{status}, 200, 'status recorded';
    is $rec->{prompt_tokens}, 3, 'prompt tokens recorded';
    is $rec->{completion_tokens}, 2, 'completion tokens recorded';
    is $rec->{finish_reason}, 'length', 'finish reason recorded';
    like $rec->{text}, qr/^( \w+){2}$/, 'text recorded';
    ok defined $rec->{ttft_ms} && defined $rec->{duration_ms}, 'timings';
    my $n = $rec->{n};
    post('/v1/completions', {prompt => 'later', max_tokens => 1});
    my @later = $e->requests(since => $n);
    is scalar @later, 1, 'stats since=N returns newer records only';
    is $e->stats->{counters}{requests_total}, 2, 'counters after reset';
    is $e->stats->{instance}{model}, 'test-model', 'instance info';
}

done_testing;
