# dpd_balance (ngx_http_dpd_balancer_module): peer choice, weights, down,
# backup, max_fails/fail_timeout, and the configuration errors of
# dpd_balance / dpd_lmcache_ports / dpd_protocol lmcache.  The backends are
# server blocks of the same nginx; concurrency (least outstanding across
# workers) is in t/207-spread.t.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;

my ($tj, $tc) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'Llama 3 tokenizer fixture not installed (make deps)')
    unless $tj && $tc;
plan('no_plan');   # after the skip checks: a skip must not plan twice

$ENV{TEST_NGINX_LLAMA3} = $tj;
$ENV{TEST_NGINX_LLAMA3_CONFIG} = $tc;

# backend ports: DPD_TEST_PORT_BASE (default 18600) + 10..19
my $base = $ENV{DPD_TEST_PORT_BASE} || 18600;
$ENV{TEST_NGINX_B1} = $base + 10;
$ENV{TEST_NGINX_B2} = $base + 11;
$ENV{TEST_NGINX_B3} = $base + 12;
$ENV{TEST_NGINX_DEAD1} = $base + 17;     # nothing listens there
$ENV{TEST_NGINX_DEAD2} = $base + 18;

no_shuffle();
log_level('info');
run_tests();

# conf/nginx-dpd.conf, the documented example, passes nginx -t
SKIP: {
    my $so = (split ' ', $ENV{TEST_NGINX_LOAD_MODULES} // '')[0];
    my $root = $ENV{DPD_ROOT} || '.';
    skip 'no module to load (TEST_NGINX_LOAD_MODULES)', 1 unless $so && -f $so;
    open my $in, '<', "$root/conf/nginx-dpd.conf" or die "nginx-dpd.conf: $!";
    my $conf = do { local $/; <$in> };
    $conf =~ s{^load_module \S+;}{load_module $so;}m;
    # its relative paths are relative to conf/ of the repository: made
    # absolute here (a link to the repository left in the server root
    # would stop Test::Nginx's clean-up of it for every file after this)
    $conf =~ s{(\s)\.\./}{$1$root/}g;
    my $dir = server_root();
    mkdir "$dir/conf";
    open my $out, '>', "$dir/conf/nginx-dpd.conf" or die $!;
    print $out $conf;
    close $out;
    my $bin = $ENV{TEST_NGINX_BINARY} || 'nginx';
    my $res = `$bin -t -p $dir -c conf/nginx-dpd.conf 2>&1`;
    is $? >> 8, 0, 'conf/nginx-dpd.conf passes nginx -t' or diag $res;
}

# dpd_balance without a zone: nginx -t warns when there are several
# worker processes (each would count only its own requests), not with a
# zone, with one worker or without a master; the configuration loads
SKIP: {
    my $so = (split ' ', $ENV{TEST_NGINX_LOAD_MODULES} // '')[0];
    skip 'no module to load (TEST_NGINX_LOAD_MODULES)', 12
        unless $so && -f $so;
    my $dir = server_root();
    mkdir "$dir/conf";
    mkdir "$dir/logs";
    my $bin = $ENV{TEST_NGINX_BINARY} || 'nginx';
    my $warn = qr/\[warn\] .*"dpd_balance" in upstream "pool" without "zone": each of the 4 worker processes counts only its own requests to its peers in \S+zone-test\.conf:10/;
    for my $case (['4 workers, no zone', "worker_processes 4;", '', 1],
                  ['4 workers, zone', "worker_processes 4;",
                   'zone pool 64k;', 0],
                  ['1 worker, no zone', "worker_processes 1;", '', 0],
                  ['no master, no zone',
                   "worker_processes 4;\nmaster_process off;", '', 0]) {
        my ($name, $main, $zone, $want) = @$case;
        open my $out, '>', "$dir/conf/zone-test.conf" or die $!;
        print $out <<"EOF";
load_module $so;
$main
pid $dir/logs/zone-test.pid;
error_log $dir/logs/zone-test.log;
events { worker_connections 64; }
http {
    access_log off;
    upstream pool {
        $zone
        dpd_balance;
        server 127.0.0.1:1;
        server 127.0.0.2:1;
    }
    server { listen 127.0.0.1:1; location / { proxy_pass http://pool; } }
}
EOF
        close $out;
        my $res = `$bin -t -p $dir -c conf/zone-test.conf 2>&1`;
        is $? >> 8, 0, "$name: nginx -t passes" or diag $res;
        if ($want) {
            like $res, $warn, "$name: warned";
        } else {
            unlike $res, qr/without "zone"/, "$name: no warning";
        }
        like $res, qr/test is successful/, "$name: test is successful";
    }
}

__DATA__

=== TEST 1: equally loaded peers share the requests in turn (zone)
--- http_config
    upstream pool {
        dpd_balance;
        zone pool 64k;
        server 127.0.0.1:$TEST_NGINX_B1;
        server 127.0.0.1:$TEST_NGINX_B2;
    }
    server {
        listen 127.0.0.1:$TEST_NGINX_B1;
        listen 127.0.0.1:$TEST_NGINX_B2;
        location / { return 200 "$server_port\n"; }
    }
--- config
    location /t { proxy_pass http://pool; }
--- request eval
["GET /t", "GET /t", "GET /t", "GET /t"]
--- response_body eval
["$ENV{TEST_NGINX_B1}\n", "$ENV{TEST_NGINX_B2}\n",
 "$ENV{TEST_NGINX_B1}\n", "$ENV{TEST_NGINX_B2}\n"]
--- no_error_log
[error]
[warn]



=== TEST 2: weights are honoured among equally loaded peers
--- http_config
    upstream pool {
        dpd_balance;
        server 127.0.0.1:$TEST_NGINX_B1 weight=3;
        server 127.0.0.1:$TEST_NGINX_B2;
    }
    server {
        listen 127.0.0.1:$TEST_NGINX_B1;
        listen 127.0.0.1:$TEST_NGINX_B2;
        location / { return 200 "$server_port\n"; }
    }
--- config
    location /t { proxy_pass http://pool; }
--- request eval
["GET /t", "GET /t", "GET /t", "GET /t", "GET /t", "GET /t", "GET /t", "GET /t"]
--- response_body eval
[map { "$_\n" } @ENV{qw(TEST_NGINX_B1 TEST_NGINX_B1 TEST_NGINX_B2 TEST_NGINX_B1
                         TEST_NGINX_B1 TEST_NGINX_B1 TEST_NGINX_B2 TEST_NGINX_B1)}]
--- no_error_log
[error]



=== TEST 3: a peer marked down gets nothing
--- http_config
    upstream pool {
        dpd_balance;
        zone pool 64k;
        server 127.0.0.1:$TEST_NGINX_B1 down;
        server 127.0.0.1:$TEST_NGINX_B2;
    }
    server {
        listen 127.0.0.1:$TEST_NGINX_B1;
        listen 127.0.0.1:$TEST_NGINX_B2;
        location / { return 200 "$server_port\n"; }
    }
--- config
    location /t { proxy_pass http://pool; }
--- request eval
["GET /t", "GET /t", "GET /t"]
--- response_body eval
["$ENV{TEST_NGINX_B2}\n", "$ENV{TEST_NGINX_B2}\n", "$ENV{TEST_NGINX_B2}\n"]
--- no_error_log
[error]



=== TEST 4: backup peers take over when every primary fails
--- http_config
    upstream pool {
        dpd_balance;
        zone pool 64k;
        server 127.0.0.1:$TEST_NGINX_DEAD1;
        server 127.0.0.1:$TEST_NGINX_DEAD2;
        server 127.0.0.1:$TEST_NGINX_B3 backup;
    }
    server {
        listen 127.0.0.1:$TEST_NGINX_B3;
        location / { return 200 "backup $server_port\n"; }
    }
--- config
    location /t { proxy_pass http://pool; }
--- request
GET /t
--- response_body eval
"backup $ENV{TEST_NGINX_B3}\n"
--- error_log eval
[qr/connect\(\) failed .* upstream: "http:\/\/127.0.0.1:$ENV{TEST_NGINX_DEAD1}/,
 qr/connect\(\) failed .* upstream: "http:\/\/127.0.0.1:$ENV{TEST_NGINX_DEAD2}/]



=== TEST 5: max_fails/fail_timeout: a failed peer is skipped afterwards
--- http_config
    upstream pool {
        dpd_balance;
        zone pool 64k;
        server 127.0.0.1:$TEST_NGINX_DEAD1 max_fails=1 fail_timeout=60s;
        server 127.0.0.1:$TEST_NGINX_B2;
    }
    server {
        listen 127.0.0.1:$TEST_NGINX_B2;
        location / { return 200 "$server_port\n"; }
    }
--- config
    location /t {
        proxy_pass http://pool;
        add_header X-Tried $upstream_addr;
    }
--- request eval
["GET /t", "GET /t", "GET /t", "GET /t"]
--- response_body eval
["$ENV{TEST_NGINX_B2}\n", "$ENV{TEST_NGINX_B2}\n", "$ENV{TEST_NGINX_B2}\n",
 "$ENV{TEST_NGINX_B2}\n"]
--- response_headers eval
["X-Tried: 127.0.0.1:$ENV{TEST_NGINX_DEAD1}, 127.0.0.1:$ENV{TEST_NGINX_B2}",
 "X-Tried: 127.0.0.1:$ENV{TEST_NGINX_B2}",
 "X-Tried: 127.0.0.1:$ENV{TEST_NGINX_B2}",
 "X-Tried: 127.0.0.1:$ENV{TEST_NGINX_B2}"]



=== TEST 6: a single peer is always tried, as round robin does
--- http_config
    upstream pool {
        dpd_balance;
        server 127.0.0.1:$TEST_NGINX_B1 max_fails=1;
    }
    server {
        listen 127.0.0.1:$TEST_NGINX_B1;
        location / { return 200 "$server_port\n"; }
    }
--- config
    location /t { proxy_pass http://pool; }
--- request eval
["GET /t", "GET /t"]
--- response_body eval
["$ENV{TEST_NGINX_B1}\n", "$ENV{TEST_NGINX_B1}\n"]



=== TEST 7: dpd_lmcache_ports needs init= and alloc=
--- http_config
    upstream decode {
        dpd_balance;
        server 127.0.0.1:$TEST_NGINX_B1;
        dpd_lmcache_ports init=7300;
    }
--- config
--- must_die
--- error_log
"dpd_lmcache_ports" needs both init= and alloc=



=== TEST 8: dpd_lmcache_ports: one port per rank on both sides
--- http_config
    upstream decode {
        dpd_balance;
        server 127.0.0.1:$TEST_NGINX_B1;
        dpd_lmcache_ports init=7300,7301 alloc=7400;
    }
--- config
--- must_die
--- error_log
init= and alloc= must list one port per TP rank each (2 vs 1)



=== TEST 9: dpd_lmcache_ports: bad port
--- http_config
    upstream decode {
        dpd_balance;
        server 127.0.0.1:$TEST_NGINX_B1;
        dpd_lmcache_ports init=7300,70000 alloc=7400,7401;
    }
--- config
--- must_die
--- error_log
invalid parameter "init=7300,70000"



=== TEST 10: dpd_balance only once per upstream
--- http_config
    upstream decode {
        dpd_balance;
        dpd_balance;
        server 127.0.0.1:$TEST_NGINX_B1;
    }
--- config
--- must_die
--- error_log
"dpd_balance" directive is duplicate



=== TEST 11: dpd_balance is an upstream directive
--- config
    location /t { dpd_balance; }
--- must_die
--- error_log
"dpd_balance" directive is not allowed here



=== TEST 12: lmcache without any upstream carrying dpd_lmcache_ports
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
    upstream decode { dpd_balance; server 127.0.0.1:$TEST_NGINX_B1; }
--- config
    location /v1/ {
        dpd on;
        dpd_protocol lmcache;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode;
    }
--- must_die
--- error_log
"dpd_protocol lmcache": lmcache needs an upstream{} with "dpd_lmcache_ports"



=== TEST 13: lmcache: the decode pool must use dpd_balance
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
    upstream decode {
        least_conn;
        server 127.0.0.1:$TEST_NGINX_B1;
        dpd_lmcache_ports init=7300 alloc=7400;
    }
--- config
    location /v1/ {
        dpd on;
        dpd_protocol lmcache;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode;
    }
--- must_die
--- error_log
the decode upstream must use "dpd_balance"



=== TEST 14: lmcache: two pools with ports need dpd_decode_upstream
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
    upstream d1 { dpd_balance; server 127.0.0.1:$TEST_NGINX_B1;
                  dpd_lmcache_ports init=7300 alloc=7400; }
    upstream d2 { dpd_balance; server 127.0.0.1:$TEST_NGINX_B2;
                  dpd_lmcache_ports init=7300 alloc=7400; }
--- config
    location /v1/ {
        dpd on;
        dpd_protocol lmcache;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://d1;
    }
--- must_die
--- error_log
several upstreams carry "dpd_lmcache_ports": name the decode pool with "dpd_decode_upstream"



=== TEST 15: lmcache: dpd_decode_upstream picks one of several pools
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
    upstream d1 { dpd_balance; server 127.0.0.1:$TEST_NGINX_B1;
                  dpd_lmcache_ports init=7300 alloc=7400; }
    upstream d2 { dpd_balance; server 127.0.0.1:$TEST_NGINX_B2;
                  dpd_lmcache_ports init=7300 alloc=7400; }
--- config
    location /v1/ {
        dpd on;
        dpd_protocol lmcache;
        dpd_prefill_pass /_dpd_prefill;
        dpd_decode_upstream d2;
        proxy_pass http://d2;
    }
    location /_dpd_prefill/ { internal; proxy_pass http://d1/; }
    location /t { return 200 "ok\n"; }
--- request
GET /t
--- response_body
ok



=== TEST 16: lmcache: dpd_decode_upstream naming no upstream{}
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
    upstream d1 { dpd_balance; server 127.0.0.1:$TEST_NGINX_B1;
                  dpd_lmcache_ports init=7300 alloc=7400; }
--- config
    location /v1/ {
        dpd on;
        dpd_protocol lmcache;
        dpd_prefill_pass /_dpd_prefill;
        dpd_decode_upstream nosuch;
        proxy_pass http://d1;
    }
--- must_die
--- error_log
"dpd_protocol lmcache" with upstream "nosuch": no upstream{} block of that name



=== TEST 17: prefill directives: bad values fail nginx -t
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
--- config
    location /v1/ {
        dpd on;
        dpd_protocol grpc;
    }
--- must_die
--- error_log
invalid value "grpc"



=== TEST 18: dpd_fallback takes decode or error
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
--- config
    location /v1/ {
        dpd on;
        dpd_fallback retry;
    }
--- must_die
--- error_log
invalid value "retry"



=== TEST 19: dpd_prefill_pass needs a URI
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
--- config
    location /v1/ {
        dpd on;
        dpd_prefill_pass prefill;
    }
--- must_die
--- error_log
"dpd_prefill_pass" needs the URI of an internal location



=== TEST 20: dpd_prefill_timeout takes a time
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3 config=$TEST_NGINX_LLAMA3_CONFIG;
--- config
    location /v1/ {
        dpd on;
        dpd_prefill_timeout soon;
    }
--- must_die
--- error_log
"dpd_prefill_timeout" directive invalid value
