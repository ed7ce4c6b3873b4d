# Users' mistakes around dpd_prefill_pass (issue 24, 4; ngx_http_dpd_check.c):
#   - dpd_prefill_pass naming no location, a location caught by a broader
#     one, one without proxy_pass, the dpd location itself: nginx -t fails
#     and says which location and the fix (before: all passed nginx -t and
#     every long request got nginx's HTML 404 or went to the decoders);
#   - a prefill location whose proxy_pass keeps the prefix
#     ("proxy_pass http://prefill;" without the "/"): nginx -t cannot see the
#     proxy module's private URI, so the first request logs at error the
#     request line sent and the fix, and the client gets an OpenAI-shaped
#     502 whatever dpd_fallback says (before: the engine's
#     {"detail":"Not Found"} 404 went to the client on every long request);
#   - vLLM's own 404 for a model it does not serve (an OpenAI error body)
#     is still the client's answer, as any prefill 4xx.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Pools qw(block_defaults long_body recs);
use JSON::PP ();
use File::Temp ();
use DPD::Emu;

plan(skip_all => $_) for DPD::Pools->unavailable;
plan('no_plan');   # after the skip checks: a skip must not plan twice

# ports: $DPD_TEST_PORT_BASE (default 18600) + 70 .. 73
my $pools = DPD::Pools->start(offset => 70, time_scale => 0.01);
our @prefill = $pools->prefill;
our @decode = $pools->decode;

my $http_config = $pools->http_config;

block_defaults(http_config => $http_config, timeout => 30,
               more_headers => sub {
                   "Content-Type: application/json\nX-Request-Id: "
                   . ($_[0]->rid // 'x') },
               request => sub {
                   "POST " . ($_[0]->uri // '/v1/completions') . "\n"
                   . long_body() });

sub faults {
    my (%rule) = @_;
    $_->clear_faults for @decode, @prefill;
    $_->fault(%rule) for @prefill;
}

no_shuffle();
log_level('info');
run_tests();

# a server without any location that takes the prefill request (Test::Nginx
# always adds "location /", so this one is checked with a plain nginx -t)
SKIP: {
    my $root = DPD::Emu->root;
    my $mod = $ENV{TEST_NGINX_LOAD_MODULES} // '';
    my ($tj) = DPD::Emu->tokenizer_files('llama3');
    skip 'another module build (sanitizer, 1.30): its runtime is not loaded '
         . 'by a plain nginx -t', 2
        unless $mod eq "$root/build/ngx_http_dpd_module.so" && $tj;
    my $dir = File::Temp::tempdir(CLEANUP => 1);
    open my $fh, '>', "$dir/nginx.conf" or die $!;
    print $fh <<"_EOC_";
load_module $mod;
pid $dir/nginx.pid;
events { }
http {
    dpd_tokenizer $tj;
    upstream d { server 127.0.0.1:1; }
    server {
        listen 127.0.0.1:1;
        location /v1/ { dpd on; dpd_prefill_pass /_nope; proxy_pass http://d; }
    }
}
_EOC_
    close $fh;
    my $nginx = $ENV{TEST_NGINX_BINARY} || '/usr/sbin/nginx';
    my $out = `'$nginx' -t -p '$dir/' -e '$dir/error.log' -c '$dir/nginx.conf' 2>&1`;
    isnt $? >> 8, 0, 'no location at all: nginx -t fails';
    like $out, qr{\[emerg\].*"dpd_prefill_pass /_nope" in location "/v1/": no location of its server matches the prefill request "/_nope/v1/completions" \(nginx itself would answer 404\)},
        '... saying nginx itself would answer 404, and the fix';
}

for my $id (qw(m-slash m-slash-chat)) {
    my @d = recs($id, @decode);
    is scalar(@d), 0, "$id: no silent fallback to the decoders";
}

__DATA__

=== TEST 1: dpd_prefill_pass naming no location: nginx -t fails
(Test::Nginx's server has a "location /": the request would land there)
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 256;
        dpd_prefill_pass /_dpd_nothere;
        proxy_pass http://decode;
    }
    location /_dpd_prefill/ { internal; proxy_pass http://prefill/; }
--- must_die
--- error_log
"dpd_prefill_pass /_dpd_nothere" in location "/v1/" names no location: the prefill request "/_dpd_nothere/v1/completions" lands in "location /"; add "location /_dpd_nothere/ { internal; proxy_pass http://PREFILL_POOL/; }"



=== TEST 2: a typo caught by a broader prefix location: nginx -t fails
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 256;
        dpd_prefill_pass /_dpd_prefil;
        proxy_pass http://decode;
    }
    location /_dpd { proxy_pass http://decode/; }
    location /_dpd_prefill/ { internal; proxy_pass http://prefill/; }
--- must_die
--- error_log
"dpd_prefill_pass /_dpd_prefil" in location "/v1/" names no location: the prefill request "/_dpd_prefil/v1/completions" lands in "location /_dpd"



=== TEST 3: a regex location catching the prefill request: nginx -t fails
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 256;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode;
    }
    location ~ completions$ { proxy_pass http://decode; }
    location /_dpd_prefill/ { internal; proxy_pass http://prefill/; }
--- must_die
--- error_log
lands in "location completions$"



=== TEST 4: a prefill location without proxy_pass: nginx -t fails
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 256;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode;
    }
    location /_dpd_prefill/ { internal; }
--- must_die
--- error_log
"location /_dpd_prefill/" has no proxy_pass



=== TEST 5: a named dpd_model target is checked too
--- config
    location /v1/ {
        dpd_model m1 @m1;
        proxy_pass http://decode;
    }
    location @m1 {
        dpd on;
        dpd_threshold 256;
        dpd_prefill_pass /_dpd_gone;
        proxy_pass http://decode;
    }
--- must_die
--- error_log
"dpd_prefill_pass /_dpd_gone" in location "@m1" names no location



=== TEST 6: a prefill location that is not internal: a warning, it runs
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 256;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode;
    }
    location /_dpd_prefill/ { proxy_pass http://prefill/; }
--- init
main::faults();
--- rid: m-open
--- response_body_like: "choices"
--- error_log
"dpd_prefill_pass /_dpd_prefill": "location /_dpd_prefill/" is not "internal"



=== TEST 7: proxy_pass keeping the prefix: 502 OpenAI error, not a fallback
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 256;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode;
    }
    location /_dpd_prefill/ { internal; proxy_pass http://prefill; }
--- init
main::faults();
--- rid: m-slash
--- error_code: 502
--- response_body_like: ^\{"error":\{"message":"the gateway's prefill location is misconfigured \(the prefill engine has no such path\)","type":"server_error","param":null,"code":502\}\}
--- response_headers
Content-Type: application/json
--- error_log eval
qr/\[error\].*dpd: the prefill location of "dpd_prefill_pass \/_dpd_prefill" sent "POST \/_dpd_prefill\/v1\/completions HTTP\/1\.[01]" to 127\.0\.0\.[23]:\d+ and got 404 \(no such path\).*proxy_pass http:\/\/PREFILL_POOL\/;.*request "m-slash" answered 502/



=== TEST 8: the same for chat, and dpd_fallback error changes nothing
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 256;
        dpd_prefill_pass /_dpd_prefill;
        dpd_fallback error;
        proxy_pass http://decode;
    }
    location /_dpd_prefill/ { internal; proxy_pass http://prefill; }
--- init
main::faults();
--- rid: m-slash-chat
--- request eval
"POST /v1/chat/completions\n" . JSON::PP->new->encode({model => "m",
    max_tokens => 2, messages => [{role => "user",
                                   content => $DPD::Pools::LONG_PROMPT}]})
--- error_code: 502
--- response_body_like: "type":"server_error"
--- error_log eval
qr/sent "POST \/_dpd_prefill\/v1\/chat\/completions HTTP\/1\.[01]"/



=== TEST 9: vLLM's 404 for an unknown model is still the client's answer
--- config
    location /v1/ {
        dpd on;
        dpd_threshold 256;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode;
    }
    location /_dpd_prefill/ { internal; proxy_pass http://prefill/; }
--- init
main::faults(status => 404);
--- rid: m-model
--- error_code: 404
--- response_body_like: "NotFoundError"
--- error_log
prefill of request "m-model" answered 404, returned to the client
--- no_error_log
[error]
