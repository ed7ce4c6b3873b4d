# vLLM emulator: SSE streaming framing byte for byte as vLLM/uvicorn send
# it, include_usage, continuous usage, HTTP/1.0, incremental delivery.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/../inc";
use Test::More;
use JSON::PP;
use DPD::Emu;

my $J = JSON::PP->new->utf8->canonical;
my $T = JSON::PP::true;
my $base = ($ENV{DPD_EMU_PORT} || 19000) + 2;
my %ports = (side_channel_port => $base + 100,
             lmcache_init_port => $base + 200,
             lmcache_alloc_port => $base + 300);
my $e = DPD::Emu->start(host => '127.0.0.2', port => $base, %ports,
                        time_scale => 0.02, model => 'm1');

sub words {
    my ($path, $body) = @_;
    my $r = $e->post_json($path, $body);
    my $d = $J->decode($r->content);
    my $t = $path =~ /chat/ ? $d->{choices}[0]{message}{content}
                            : $d->{choices}[0]{text};
    return ($t =~ /( [a-z]+)/g);
}

sub sse {
    my ($path, $body, %o) = @_;
    return $e->raw(method => 'POST', path => $path, body => $body,
                   headers => {'X-Request-Id' => $o{rid} // 'sid'}, %o);
}

# --- completions stream, include_usage ---------------------------------------
{
    my @w = words('/v1/completions', {prompt => 'a b c', max_tokens => 4});
    my $r = sse('/v1/completions', {prompt => 'a b c', max_tokens => 4,
                                    stream => $T,
                                    stream_options => {include_usage => $T}},
                rid => 's1');
    is $r->{status}, 200, 'stream 200';
    like $r->{head}, qr{^HTTP/1\.1 200 OK\r\n}, 'status line';
    is $r->{headers}{'content-type'}, 'text/event-stream; charset=utf-8',
        'uvicorn SSE content type';
    is $r->{headers}{'transfer-encoding'}, 'chunked', 'chunked on HTTP/1.1';
    is $r->{headers}{server}, 'uvicorn', 'server header';
    ok !defined $r->{headers}{'content-length'}, 'no content-length';
    ok $r->{complete}, 'terminated by the last chunk';
    like $r->{raw}, qr/\r\n0\r\n\r\n\z/, 'raw stream ends with 0 CRLF CRLF';
    my ($created) = $r->{body} =~ /"created":(\d+)/;
    my $exp = '';
    for my $i (0 .. $#w) {
        my $fr = $i == $#w ? '"length"' : 'null';
        $exp .= 'data: {"id":"cmpl-s1","object":"text_completion","created":'
              . $created . ',"model":"m1","choices":[{"index":0,"text":"'
              . $w[$i] . '","logprobs":null,"finish_reason":' . $fr
              . ',"stop_reason":null}],"usage":null}' . "\n\n";
    }
    $exp .= 'data: {"id":"cmpl-s1","object":"text_completion","created":'
          . $created . ',"model":"m1","choices":[],"usage":{"prompt_tokens":4,'
          . '"total_tokens":8,"completion_tokens":4}}' . "\n\n";
    $exp .= "data: [DONE]\n\n";
    is $r->{body}, $exp, 'completion SSE byte-exact (tokens, usage, DONE)';
    is scalar @{ $r->{chunks} }, scalar @{ $r->{events} },
        'one HTTP chunk per SSE event';
    ok !(grep { $_->[1] !~ /\n\n\z/ } @{ $r->{chunks} }),
        'every chunk ends an event';
}

# --- without stream_options: no usage chunk ----------------------------------
{
    my $r = sse('/v1/completions', {prompt => 'a b c', max_tokens => 3,
                                    stream => $T}, rid => 's2');
    my @ev = map { $_->[1] } @{ $r->{events} };
    is scalar @ev, 4, '3 token events + DONE';
    is $ev[-1], '[DONE]', 'ends with [DONE]';
    unlike join('', @ev), qr/"choices":\[\]/, 'no usage chunk';
    like $ev[0], qr/"usage":null\}$/, 'token chunks carry usage null';
}

# --- chat stream ---------------------------------------------------------------
{
    my $msgs = [{role => 'user', content => 'tell me'}];
    my @w = words('/v1/chat/completions', {messages => $msgs, max_tokens => 3});
    my $r0 = $e->post_json('/v1/chat/completions',
                           {messages => $msgs, max_tokens => 3});
    my $pt = $J->decode($r0->content)->{usage}{prompt_tokens};
    my $r = sse('/v1/chat/completions', {messages => $msgs, max_tokens => 3,
                                         stream => $T,
                                         stream_options => {include_usage => $T}},
                rid => 'c1');
    my ($created) = $r->{body} =~ /"created":(\d+)/;
    my $pre = 'data: {"id":"chatcmpl-c1","object":"chat.completion.chunk",'
            . '"created":' . $created . ',"model":"m1","choices":';
    my $exp = $pre . '[{"index":0,"delta":{"role":"assistant","content":""},'
            . '"logprobs":null,"finish_reason":null}]}' . "\n\n";
    for my $i (0 .. $#w) {
        my $tail = $i == $#w ? '"finish_reason":"length","stop_reason":null'
                             : '"finish_reason":null';
        $exp .= $pre . '[{"index":0,"delta":{"content":"' . $w[$i]
              . '"},"logprobs":null,' . $tail . '}]}' . "\n\n";
    }
    $exp .= $pre . '[],"usage":{"prompt_tokens":' . $pt . ',"total_tokens":'
          . ($pt + 3) . ',"completion_tokens":3}}' . "\n\n";
    $exp .= "data: [DONE]\n\n";
    is $r->{body}, $exp, 'chat SSE byte-exact (role, deltas, usage, DONE)';
    ok $r->{complete}, 'chat stream complete';
}

# --- continuous usage stats ----------------------------------------------------
{
    my $r = sse('/v1/completions', {prompt => 'a b c', max_tokens => 3,
                                    stream => $T,
                                    stream_options => {include_usage => $T,
                                        continuous_usage_stats => $T}});
    my @u = map { $J->decode($_->[1])->{usage}{completion_tokens} }
            grep { $_->[1] ne '[DONE]' } @{ $r->{events} };
    is_deeply \@u, [1, 2, 3, 3], 'continuous usage in every chunk';
}

# --- HTTP/1.0 client: close-delimited ----------------------------------------
{
    my $r = sse('/v1/completions', {prompt => 'a b c', max_tokens => 2,
                                    stream => $T}, http10 => 1);
    is $r->{status}, 200, 'HTTP/1.0 stream 200';
    ok !defined $r->{headers}{'transfer-encoding'},
        'HTTP/1.0: no chunked encoding';
    is $r->{headers}{connection}, 'close', 'HTTP/1.0: connection close';
    is scalar @{ $r->{events} }, 3, 'HTTP/1.0: events until close';
    is $r->{events}[-1][1], '[DONE]', 'HTTP/1.0: ends with [DONE]';
    unlike $r->{raw}, qr/\r\n/, 'HTTP/1.0: no chunk framing in the body';
}

# --- validation specific to streaming -----------------------------------------
{
    my $r = $e->post_json('/v1/completions',
                          {prompt => 'x', stream_options => {include_usage => $T}});
    is $r->code, 400, 'stream_options without stream -> 400';
    like $r->content, qr/Stream options can only be defined when `stream=True`/,
        'vLLM message';
}

# --- tokens are flushed as they are produced ---------------------------------
{
    my $slow = DPD::Emu->start(host => '127.0.0.3', port => $base, %ports,
                               decode_step_ms => 60, time_scale => 1);
    my $r = $slow->raw(method => 'POST', path => '/v1/completions',
                       body => {prompt => 'x', max_tokens => 5, stream => $T});
    my @t = map { $_->[0] } @{ $r->{events} };
    my @gaps = map { $t[$_] - $t[$_ - 1] } 1 .. 4;
    # a loaded client may read two events at once: allow one short gap
    my $small = grep { $_ < 0.03 } @gaps;
    ok $small <= 1, 'each token arrives in its own step (gaps '
        . join(',', map { sprintf '%.3f', $_ } @gaps) . ')';
    ok $t[-1] - $t[0] > 4 * 0.06 * 0.8, 'spread over the decode steps';
    my $n = () = $r->{body} =~ /data: /g;
    is $n, 6, 'all events delivered';
    $slow->stop;
}

done_testing;
