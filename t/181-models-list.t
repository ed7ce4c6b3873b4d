# GET /v1/models with several models behind one gateway (issue 24, 4;
# ngx_http_dpd_models.c): "dpd_models [NAME ...];" answers the union of the
# server's dpd_model names (no "*", no repeats, configuration order) and the
# names it is given, in vLLM's / OpenAI's ModelList shape; other servers'
# models are not listed; nothing to list fails nginx -t.  Before: no such
# directive (a /v1/models proxied to one pool lists that pool's model only).
use strict;
use warnings;

use Test::Nginx::Socket;
$ENV{TEST_NGINX_HTML_DIR} ||= html_dir();   # not exported by the real one
use DPD::Emu;
use JSON::PP ();

my ($tj, $tc) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'Llama 3 tokenizer fixture not installed (make deps)')
    unless $tj && $tc;
plan('no_plan');   # after the skip checks: a skip must not plan twice

$ENV{TEST_NGINX_LLAMA3} = $tj;

our $JSON = JSON::PP->new->utf8->canonical;

# the body: exactly these ids, each an OpenAI model card
sub cards_are {
    my ($body, @ids) = @_;
    my $j = eval { $JSON->decode($body) } or return "not JSON: $body";
    return "object is not list" unless ($j->{object} // '') eq 'list';
    my @got = map { $_->{id} } @{$j->{data} || []};
    return "ids: @got, not @ids" unless "@got" eq "@ids";
    for my $c (@{$j->{data}}) {
        return "bad card " . $JSON->encode($c)
            unless ($c->{object} // '') eq 'model'
                && ($c->{owned_by} // '') eq 'vllm'
                && ($c->{created} // '') =~ /^\d{10}$/
                && abs($c->{created} - time) < 60
                && keys(%$c) == 4;
    }
    return 'ok';
}

add_block_preprocessor(sub {
    my $block = shift;
    $block->set_value('http_config', <<'_EOC_')
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    upstream a { server 127.0.0.1:1; }
    server {
        listen unix:$TEST_NGINX_HTML_DIR/other.sock;
        location /v1/ { dpd_model other-model @o; proxy_pass http://a; }
        location @o { dpd on; proxy_pass http://a; }
    }
_EOC_
        unless defined $block->http_config;
});

no_shuffle();
run_tests();

__DATA__

=== TEST 1: the union of the server's dpd_model names and the given ones
--- config
    location /v1/ {
        dpd_model llama-3 @a;
        dpd_model qwen-3 @b;
        dpd_model * @a;
        proxy_pass http://a;
    }
    location /v2/ {
        dpd_model qwen-3 @b;
        dpd_model "we\"ird" @b;
        proxy_pass http://a;
    }
    location @a { dpd on; proxy_pass http://a; }
    location @b { dpd on; proxy_pass http://a; }
    location = /v1/models { dpd_models default-model llama-3; }
--- request
GET /v1/models
--- response_headers
Content-Type: application/json
--- response_body_filters eval
sub { main::cards_are($_[0], 'llama-3', 'qwen-3', 'we"ird', 'default-model') }
--- response_body: ok



=== TEST 2: a single-model gateway names its model
--- config
    location /v1/ { dpd on; proxy_pass http://a; }
    location = /v1/models { dpd_models meta-llama/Llama-3.1-8B-Instruct; }
--- request
GET /v1/models
--- response_body_filters eval
sub { main::cards_are($_[0], 'meta-llama/Llama-3.1-8B-Instruct') }
--- response_body: ok



=== TEST 3: POST: 405, OpenAI-shaped
--- config
    location = /v1/models { dpd_models m; }
--- request
POST /v1/models
{}
--- error_code: 405
--- response_body_like: ^\{"error":\{"message":"only GET lists the models",.*"code":405\}\}



=== TEST 4: HEAD: headers only
--- config
    location = /v1/models { dpd_models m; }
--- request
HEAD /v1/models
--- response_headers
Content-Type: application/json
--- response_body:



=== TEST 5: nothing to list: nginx -t fails
--- config
    location = /v1/models { dpd_models; }
--- must_die
--- error_log
"dpd_models": no model to list



=== TEST 6: "*" is no name
--- config
    location = /v1/models { dpd_models *; }
--- must_die
--- error_log
"dpd_models" needs model names, not "*"



=== TEST 7: duplicate
--- config
    location = /v1/models { dpd_models a; dpd_models b; }
--- must_die
--- error_log
"dpd_models" directive is duplicate
