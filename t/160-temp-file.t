# ngx_http_dpd_module: bodies larger than client_body_buffer_size land in a
# temp file; they are read from there, counted exactly, and forwarded
# unchanged (Content-Length and chunked uploads alike).
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;
use JSON::PP ();

my ($llama_tj) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'tokenizer fixtures or build/libdpdtok.so missing '
                 . '(make deps && make)')
    unless $llama_tj && DPD::Emu->have_tokenizer_lib;
plan('no_plan');   # after the skip checks: a skip must not plan twice

my $base = $ENV{DPD_CORE_EMU_PORT} || 18500;
my $JSON = JSON::PP->new->utf8->canonical;

our $emu = DPD::Emu->start(port => $base + 30,
                           side_channel_port => $base + 31,
                           tokenizer => 'llama3', args => ['--no-lmcache'],
                           default_max_tokens => 1, time_scale => 0.01);

$ENV{TEST_NGINX_LLAMA3} = $llama_tj;
$ENV{TEST_NGINX_EMU} = $emu->addr;

# ~60 KB of varied text
our $DOC = join '', map { "Paragraph $_: the gateway reads bodies from "
                          . "temp files — ünïcödé, 数字 $_, ✓.\n" } 1 .. 400;
our $BODY = $JSON->encode({ prompt => $DOC });
our $KVBODY = $JSON->encode({ prompt => $DOC,
    kv_transfer_params => { remote_host => '10.0.0.66' } });
our $CHAT = $JSON->encode({ messages => [
    { role => 'user', content => $DOC } ] });

our %N;
for my $k (['completions', '/v1/completions', $BODY],
           ['chat', '/v1/chat/completions', $CHAT])
{
    my $r = $emu->post_json($k->[1], $k->[2]);
    die "emulator: " . $r->status_line . "\n" unless $r->is_success;
    $N{$k->[0]} = $JSON->decode($r->content)->{usage}{prompt_tokens};
}

sub chunked {
    my ($path, $body, $id) = @_;
    my $out = "POST $path HTTP/1.1\r\nHost: localhost\r\n"
              . "Connection: close\r\nX-Request-Id: $id\r\n"
              . "Transfer-Encoding: chunked\r\n\r\n";
    while (length $body) {
        my $piece = substr $body, 0, 7000, '';
        $out .= sprintf("%x\r\n", length $piece) . $piece . "\r\n";
    }
    return $out . "0\r\n\r\n";
}

add_block_preprocessor(sub {
    my $block = shift;

    $block->set_value('http_config', <<'_EOC_');
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    upstream emu { server $TEST_NGINX_EMU; }
_EOC_

    if (!defined $block->config) {
        $block->set_value('config', <<'_EOC_');
    location ~ ^/v1/(chat/)?completions$ {
        dpd on;
        client_body_buffer_size 1k;
        client_max_body_size 1m;
        add_header X-Dpd-Tokens $dpd_prompt_tokens always;
        proxy_pass http://emu;
    }
_EOC_
    }
});

no_shuffle();
log_level('debug');
run_tests();

# what the decoder received: the very same document

for my $id (qw(tf-1 tf-2 tf-3 tf-4)) {
    my $rec = $emu->last_request(request_id => $id);
    ok($rec, "$id reached the decoder");
    my $got = $rec && ($rec->{body}{prompt}
                       // $rec->{body}{messages}[0]{content});
    ok(defined $got && $got eq $DOC, "$id: body forwarded intact");
}

my $rec = $emu->last_request(request_id => 'tf-5');
ok($rec && !exists $rec->{body}{kv_transfer_params}
       && $rec->{body}{prompt} eq $DOC,
   'tf-5: temp-file body rewritten without kv_transfer_params');

__DATA__

=== TEST 1: completions body in a temp file (Content-Length)
--- request eval
"POST /v1/completions\n$::BODY"
--- more_headers
X-Request-Id: tf-1
--- response_headers eval
"X-Dpd-Tokens: $::N{completions}"
--- response_body_like eval
qr/"prompt_tokens":$::N{completions},/
--- error_log
(from temp file)


=== TEST 2: chat body in a temp file
--- request eval
"POST /v1/chat/completions\n$::CHAT"
--- more_headers
X-Request-Id: tf-2
--- response_headers eval
"X-Dpd-Tokens: $::N{chat}"
--- response_body_like eval
qr/"prompt_tokens":$::N{chat},/
--- error_log
(from temp file)


=== TEST 3: chunked upload into a temp file
--- raw_request eval
::chunked('/v1/completions', $::BODY, 'tf-3')
--- response_headers eval
"X-Dpd-Tokens: $::N{completions}"
--- response_body_like eval
qr/"prompt_tokens":$::N{completions},/


=== TEST 4: client_body_in_file_only: the whole body from the file
--- config
    location ~ ^/v1/(chat/)?completions$ {
        dpd on;
        client_body_in_file_only clean;
        client_max_body_size 1m;
        add_header X-Dpd-Tokens $dpd_prompt_tokens always;
        proxy_pass http://emu;
    }
--- request eval
"POST /v1/completions\n$::BODY"
--- more_headers
X-Request-Id: tf-4
--- response_headers eval
"X-Dpd-Tokens: $::N{completions}"


=== TEST 5: temp-file body with client kv_transfer_params: rewritten
--- request eval
"POST /v1/completions\n$::KVBODY"
--- more_headers
X-Request-Id: tf-5
--- response_headers eval
"X-Dpd-Tokens: $::N{completions}"
--- error_log
dpd body replaced
