# vLLM emulator: request validation errors (400, vLLM's error shape).
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/../inc";
use Test::More;
use JSON::PP;
use DPD::Emu;

my $J = JSON::PP->new->utf8->canonical;
my $base = ($ENV{DPD_EMU_PORT} || 19000) + 3;
my $e = DPD::Emu->start(host => '127.0.0.2', port => $base,
                        side_channel_port => $base + 100,
                        lmcache_init_port => $base + 200,
                        lmcache_alloc_port => $base + 300,
                        time_scale => 0.02, max_model_len => 64);

my @bad = (
    ['/v1/completions', '{"max_tokens":2}', qr/prompt/, 'missing prompt'],
    ['/v1/completions', '{"prompt":null}', qr/prompt/, 'null prompt'],
    ['/v1/completions', '{"prompt":5}', qr/prompt/, 'prompt a number'],
    ['/v1/completions', '{"prompt":{"a":1}}', qr/prompt/, 'prompt an object'],
    ['/v1/completions', '{"prompt":[]}', qr/empty/i, 'empty prompt list'],
    ['/v1/completions', '{"prompt":[[]]}', qr/empty/i, 'empty id list'],
    ['/v1/completions', '{"prompt":["a",1]}', qr/prompt/, 'mixed prompt list'],
    ['/v1/completions', '{"prompt":[1,2,128256]}', qr/out of vocabulary/,
     'token id out of range'],
    ['/v1/completions', '{"prompt":[1,-1]}', qr/out of vocabulary/,
     'negative token id'],
    ['/v1/completions', '{"prompt":[1,2.5]}', qr/prompt/, 'float token id'],
    ['/v1/completions', '{"prompt":[[1],[2,999999]]}', qr/out of vocabulary/,
     'id out of range in a list of lists'],
    ['/v1/completions', '{"prompt":"x","n":2}', qr/n must be 1/, 'n=2'],
    ['/v1/completions', '{"prompt":"x","max_tokens":0}', qr/at least 1/,
     'max_tokens 0'],
    ['/v1/completions', '{"prompt":"x","max_tokens":"3"}', qr/integer/,
     'max_tokens a string'],
    ['/v1/completions', '{"prompt":"x","stream":"yes"}', qr/boolean/,
     'stream not a boolean'],
    ['/v1/completions', '{"prompt":"x","stop":5}', qr/stop/, 'stop a number'],
    ['/v1/completions', '{"prompt":"' . join(' ', ('w') x 70) . '"}',
     qr/maximum context length is 64 tokens/, 'prompt over max_model_len'],
    ['/v1/completions', '{"prompt":"x",', qr/./, 'malformed JSON'],
    ['/v1/completions', '', qr/./, 'empty body'],
    ['/v1/completions', '[1,2]', qr/object/, 'body not an object'],
    ['/v1/chat/completions', '{"max_tokens":2}', qr/messages/,
     'missing messages'],
    ['/v1/chat/completions', '{"messages":"hi"}', qr/messages/,
     'messages a string'],
    ['/v1/chat/completions', '{"messages":[]}', qr/messages/,
     'empty messages'],
    ['/v1/chat/completions', '{"messages":[{"content":"x"}]}', qr/role/,
     'message without role'],
    ['/v1/chat/completions', '{"messages":[{"role":"user","content":5}]}',
     qr/content/, 'content a number'],
    ['/v1/chat/completions', '{"messages":[{"role":"user","content":"x"}],'
     . '"max_completion_tokens":-1}', qr/at least 1/,
     'negative max_completion_tokens'],
);

for my $b (@bad) {
    my ($path, $body, $rx, $name) = @$b;
    my $r = $e->post_json($path, $body);
    is $r->code, 400, "$name -> 400";
    my $d = eval { $J->decode($r->content) };
    my $e = $d && ref $d->{error} eq 'HASH' ? $d->{error} : undef;
    ok $e && $e->{type} eq 'BadRequestError'
        && $e->{code} == 400 && exists $e->{param},
        "$name: vLLM error shape" or diag $r->content;
    like $e && $e->{message}, $rx, "$name: message";
}

# errors are recorded and counted; nothing is left running
my @r = $e->requests(status => 400);
is scalar @r, scalar @bad, 'every rejected request recorded with status 400';
is $e->counter('responses_4xx_total'), scalar @bad, '4xx counter';
is $e->metric('vllm:num_requests_running'), 0, 'nothing scheduled';

# the emulator still serves after all that
my $ok = $e->post_json('/v1/completions', {prompt => 'fine', max_tokens => 1});
is $ok->code, 200, 'still serving';

done_testing;
