# Self-test of repeat_each(), an explicit plan computed from blocks(),
# shuffled blocks, Test::Base's SKIP and LAST, add_block_preprocessor,
# env_to_nginx, workers/master_on and server_name.  Stock nginx only.
BEGIN { delete $ENV{TEST_NGINX_LOAD_MODULES} }

use Test::Nginx::Socket;

repeat_each(2);
master_on();
workers(2);
log_level('warn');
env_to_nginx('HARNESS_SELFTEST_ENV=from-harness');

# every block gets the same shared location from the preprocessor
add_block_preprocessor(sub {
    my $block = shift;
    if (!defined $block->config) {
        $block->set_value('config', <<'_EOC_');
    location /pre { return 200 "preprocessed\n"; }
_EOC_
    }
});

# 2 tests per block and repetition: status and body
plan tests => repeat_each() * 2 * blocks();

run_tests();

__DATA__

=== TEST 1: block from the preprocessor
--- request
GET /pre
--- response_body
preprocessed



=== TEST 2: every repetition sees a fresh response
--- config
    location /t { return 200 "pid-independent\n"; }
--- request
GET /t
--- response_body
pid-independent



=== TEST 3: skipped by Test::Base, would fail if run
--- SKIP
--- config
    location /t { return 500; }
--- request
GET /t
--- response_body
never



=== TEST 4: server_name section and two workers under a master
--- config
    server_name_in_redirect on;
    location /dir/ { return 200 "$server_name\n"; }
--- server_name: harness.test
--- request
GET /dir/
--- response_body
harness.test



=== TEST 5: last block run
--- LAST
--- config
    location /t { return 200 "last\n"; }
--- request
GET /t
--- response_body
last



=== TEST 6: after LAST, never run
--- config
    location /t { return 500; }
--- request
GET /t
--- response_body
never
