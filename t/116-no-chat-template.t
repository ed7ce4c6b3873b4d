# A tokenizer without a chat template (issue 24, 4): nginx -t warns with
# what it costs (chat prompts estimated, dpd_threshold decides chats on the
# estimate) and the fix; a tokenizer with one does not warn.  Before: only a
# notice 'chat template "none"', easy to miss, while every chat count was an
# estimate.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;
use File::Temp ();

my ($tj, $tc) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'Llama 3 tokenizer fixture not installed (make deps)')
    unless $tj && $tc;
plan('no_plan');   # after the skip checks: a skip must not plan twice

# the same tokenizer.json alone in a directory (no tokenizer_config.json)
my $lone = File::Temp::tempdir(CLEANUP => 1);
symlink($tj, "$lone/tokenizer.json") or die "symlink: $!\n";

$ENV{TEST_NGINX_LONE} = "$lone/tokenizer.json";
$ENV{TEST_NGINX_LLAMA3} = $tj;

no_shuffle();
log_level('info');
run_tests();

__DATA__

=== TEST 1: no tokenizer_config.json: a warning naming the consequence
--- http_config
    dpd_tokenizer $TEST_NGINX_LONE;
--- config
    location /t { dpd on; return 200 "ok\n"; }
--- request
GET /t
--- response_body
ok
--- error_log eval
qr/\[warn\].*dpd_tokenizer ".*tokenizer\.json" has no chat template \(no tokenizer_config\.json next to it and no config=\): \/v1\/chat\/completions prompts are estimated \(content tokens \+ 4 per message \+ 3, logged "\(estimated\)"\) and dpd_threshold routes chats on that estimate; completions stay exact; give config=tokenizer_config\.json or "dpd_chat_template FILE"/



=== TEST 2: a config without "chat_template": the warning says so
--- user_files
>>> cfg/tokenizer_config.json
{"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
--- http_config
    dpd_tokenizer $TEST_NGINX_LONE config=../html/cfg/tokenizer_config.json;
--- config
    location /t { dpd on; return 200 "ok\n"; }
--- request
GET /t
--- response_body
ok
--- error_log eval
qr/\[warn\].*has no chat template \(its tokenizer_config\.json has no "chat_template"\)/



=== TEST 3: the model's template found next to it: no warning
--- http_config
    dpd_tokenizer $TEST_NGINX_LLAMA3;
--- config
    location /t { dpd on; return 200 "ok\n"; }
--- request
GET /t
--- response_body
ok
--- no_error_log
has no chat template
[warn]
