# The wire transforms of the disaggregated path (docs/dpd.md), tested on
# ngx_dpd_module/ngx_http_dpd_protocol.c alone: a small C driver (below,
# compiled here with cc and libcjson) feeds it requests and replies.

use strict;
use warnings;

use Test::More;
use JSON::PP ();
use DPD::ProtoDriver;

plan skip_all => $_ for DPD::ProtoDriver->unavailable;

# slurp() (all of stdin) and the includes come from DPD::ProtoDriver
my $drv = DPD::ProtoDriver->build(tmp => 'dpd-proto', main => <<'_C_');
static size_t ports(const char *s, unsigned short *out)
{
    size_t n = 0;
    while (s && *s && n < 64) {
        out[n++] = (unsigned short) strtoul(s, (char **) &s, 10);
        if (*s == ',') s++;
    }
    return n;
}

int main(int argc, char **argv)
{
    size_t n, len;
    char *in = slurp(&n), *out, *nl;
    int proto = (argc > 2 && strcmp(argv[2], "lmcache") == 0)
                ? NGX_HTTP_DPD_PROTO_LMCACHE : NGX_HTTP_DPD_PROTO_NIXL;
    cJSON *j, *params;
    const char *why;

    if (strcmp(argv[1], "prefill") == 0) {
        unsigned short ip[64], ap[64];
        ngx_http_dpd_lmcache_spec_t spec = { 0 };
        if (argc > 6) {
            spec.req_id = argv[3];
            spec.receiver_host = argv[4];
            spec.nports = ports(argv[5], ip);
            ports(argv[6], ap);
            spec.init_ports = ip;
            spec.alloc_ports = ap;
        }
        out = ngx_http_dpd_proto_prefill_body(parse_req(in, n), proto,
                                              argc > 6 ? &spec : NULL, &len);
        if (out == NULL) { puts("NULL"); return 0; }
        fwrite(out, 1, len, stdout);
        free(out);
        ngx_http_dpd_proto_release(&dpd_req);
        free(in);
        return 0;
    }

    if (strcmp(argv[1], "reply") == 0) {
        int kind = ngx_http_dpd_proto_parse_reply(in, n, proto, &params, &why);
        out = params ? cJSON_PrintUnformatted(params) : NULL;
        printf("%d\t%s\t%s", kind, why ? why : "", out ? out : "");
        cJSON_free(out);
        cJSON_Delete(params);
        free(in);
        return 0;
    }

    if (strcmp(argv[1], "decode") == 0) {
        /* stdin: the params (JSON or null) on the first line, then the
         * request body */
        nl = memchr(in, '\n', n);
        if (nl == NULL) { puts("NULL"); return 0; }
        j = cJSON_ParseWithLength(in, (size_t) (nl - in));
        out = ngx_http_dpd_proto_decode_body(
                  parse_req(nl + 1, n - (size_t) (nl + 1 - in)),
                  cJSON_IsObject(j) ? j : NULL,
                  argc > 2 ? argv[2] : NULL, &len);
        if (out == NULL) { puts("NULL"); return 0; }
        fwrite(out, 1, len, stdout);
        free(out);
        cJSON_Delete(j);
        ngx_http_dpd_proto_release(&dpd_req);
        free(in);
        return 0;
    }

    if (strcmp(argv[1], "direct") == 0) {
        /* what the direct path sends: the client's bytes, minus their
         * kv_transfer_params */
        ngx_http_dpd_req_t *req = parse_req(in, n);
        if (req == NULL) { return 0; }
        printf("%zu\t", req->kv_params);
        out = ngx_http_dpd_proto_decode_body(req, NULL, NULL, &len);
        if (out == NULL) { puts("NULL"); return 0; }
        fwrite(out, 1, len, stdout);
        free(out);
        ngx_http_dpd_proto_release(&dpd_req);
        free(in);
        return 0;
    }

    free(in);
    return 2;
}
_C_
is $drv->status, 0,
    'driver builds with ngx_http_dpd_protocol.c alone (no nginx)'
    or diag $drv->output;
BAIL_OUT("cannot build the protocol driver") if $drv->status;

my $json = JSON::PP->new->utf8->canonical;

sub run_driver {
    my ($input, @args) = @_;
    my ($out, $status) = $drv->run($input, @args);
    die "driver @args exited $status" if $status;
    return $out;
}

sub prefill { $json->decode(run_driver($json->encode($_[0]), 'prefill', @_[1 .. $#_])) }

# the decode driver reads the params (or null) on the first line, then
# the client's body
sub dec_input { my ($req, $params) = @_;
                $json->encode($params) . "\n" . (ref $req ? $json->encode($req) : $req) }

# --- the prefill copy -------------------------------------------------------

my $chat = {model => 'm', messages => [{role => 'user', content => "hi \x{e9}"}],
            stream => JSON::PP::true, stream_options => {include_usage => JSON::PP::true},
            max_tokens => 200, max_completion_tokens => 300, min_tokens => 5,
            temperature => 0.7, seed => 42,
            kv_transfer_params => {remote_host => '10.9.9.9', do_remote_prefill => JSON::PP::true}};

my $p = prefill($chat, 'nixl');
is $p->{max_tokens}, 1, 'prefill copy: max_tokens 1';
is $p->{max_completion_tokens}, 1, 'prefill copy: max_completion_tokens 1 when present';
ok !$p->{stream}, 'prefill copy: stream false';
ok JSON::PP::is_bool($p->{stream}), 'prefill copy: stream is a JSON boolean';
ok !exists $p->{stream_options}, 'prefill copy: no stream_options';
ok !exists $p->{min_tokens}, 'prefill copy: no min_tokens';
is $p->{temperature}, 0.7, 'prefill copy keeps sampling fields';
is $p->{seed}, 42, 'prefill copy keeps seed';
is_deeply $p->{messages}, $chat->{messages}, 'prefill copy keeps the messages (UTF-8 intact)';
is_deeply $p->{kv_transfer_params},
    {do_remote_decode => JSON::PP::true, do_remote_prefill => JSON::PP::false,
     remote_engine_id => undef, remote_block_ids => undef,
     remote_host => undef, remote_port => undef},
    'nixl prefill params replace the client-supplied ones';

my $cmpl = {model => 'm', prompt => [1, 2, 3], max_tokens => 7,
            min_completion_tokens => 2};
$p = prefill($cmpl, 'nixl');
is $p->{max_tokens}, 1, 'completions: max_tokens 1';
ok !exists $p->{max_completion_tokens}, 'max_completion_tokens not added when absent';
ok !exists $p->{min_completion_tokens}, 'no min_completion_tokens';
is_deeply $p->{prompt}, [1, 2, 3], 'token-id prompt kept';

$p = prefill({model => 'm', prompt => 'x'}, 'nixl');
is $p->{max_tokens}, 1, 'max_tokens 1 added when the client gave none';

# repeated kv_transfer_params: every occurrence goes, whatever its place
my $dup = run_driver('{"kv_transfer_params":{"a":1},"prompt":"x",'
                     . '"kv_transfer_params":{"remote_host":"169.254.169.254"},'
                     . '"stream":true,"kv_transfer_params":{"b":2}}',
                     'prefill', 'nixl');
my $n_stream = () = $dup =~ /"stream"/g;
my $n_ktp = () = $dup =~ /"kv_transfer_params"/g;
is $n_stream, 1, 'prefill copy: one "stream" (false)';
is $n_ktp, 1, 'repeated client kv_transfer_params leave only ours';
unlike $dup, qr/"[ab]":|169\.254/, 'no client transfer params survive';

# any other repeated key is refused: the engine (Python's json) keeps the
# last one, cJSON finds the first, the gateway cannot count what it sees
for my $case (
    ['{"prompt":"x","stream":false,"stream":true}', 'top-level "stream"'],
    ['{"prompt":"short","prompt":"long long long"}', 'top-level "prompt"'],
    ['{"messages":[{"role":"user","content":"a","content":"bbbb"}]}',
     'nested "content"'],
    ['{"prompt":"x","m\\u006fdel":"a","model":"b"}', 'escaped spelling'],
    ['{"prompt":"x","o":{' . join(',', map { "\"k$_\":1" } 1 .. 40)
     . ',"k7":2}}', 'large nested object (sorted check)'],
) {
    my $o = run_driver($case->[0], 'prefill', 'nixl');
    like $o, qr/^REFUSED 6\t.*appears more than once/, "repeated key refused: $case->[1]";
}
like run_driver('{"prompt":"x","vllm_xargs":{"kv_transfer_params":"y"}}',
                'prefill', 'nixl'),
     qr/^REFUSED 4\tvllm_xargs\.kv_transfer_params is reserved/,
     'vllm_xargs.kv_transfer_params refused (vLLM passes it to the connector)';

# "\u0000": cJSON ends the string there, the engine does not
for my $body ('{"prompt":"\\u0000' . ('word ' x 50) . '"}',
              '{"messages":[{"role":"user","content":"a\\u0000b"}]}',
              '{"prompt":"x","k\\u0000y":1}') {
    like run_driver($body, 'prefill', 'nixl'), qr/^REFUSED 7\t.*NUL character/,
        'a NUL character is refused: ' . substr($body, 0, 30);
}
# escapes outside RFC 8259: cJSON reads "\u00]9" as U+0000 and ends the
# string there (found by the request-path fuzzer)
for my $body ('{"prompt":"caf\\u00]9 long text"}', '{"prompt":"\\uZZZZ"}',
              '{"prompt":"\\x41"}', '{"prompt":"\\u12"}', qq({"prompt":"\\\0"})) {
    like run_driver($body, 'prefill', 'nixl'), qr/^REFUSED 1\tmalformed JSON: invalid escape/,
        'an invalid escape is refused: ' . substr($body, 10, 12);
}
unlike run_driver('{"prompt":"a\\\\u0000b"}', 'prefill', 'nixl'), qr/REFUSED/,
    'an escaped backslash before "u0000" is not a NUL';
like run_driver(qq({"prompt":"x",\x01"stream":true}), 'prefill', 'nixl'),
     qr/^REFUSED 1\t.*control character outside a string/,
     'raw control bytes between tokens refused (cJSON skips them, Python does not)';

$p = prefill($chat, 'lmcache', 'req-42', '127.0.0.5', '7300,7301', '7400,7401');
is_deeply $p->{kv_transfer_params},
    {ret_first_tok => JSON::PP::true,
     disagg_spec => {req_id => 'req-42', receiver_host => '127.0.0.5',
                     receiver_init_port => [7300, 7301],
                     receiver_alloc_port => [7400, 7401]}},
    'lmcache prefill params: disagg_spec with the decoder and its ports';
is $p->{max_tokens}, 1, 'lmcache prefill copy: max_tokens 1';

is run_driver($json->encode($chat), 'prefill', 'lmcache'), "NULL\n",
    'lmcache without a decoder spec builds nothing';
is run_driver('[1,2]', 'prefill', 'nixl'),
    "REFUSED 4\tthe request body must be a JSON object\nNULL\n",
    'a non-object request is refused and builds nothing';

# --- the prefill reply ------------------------------------------------------

my $ktp = {do_remote_prefill => JSON::PP::true, do_remote_decode => JSON::PP::false,
           remote_block_ids => [1, 2, 3], remote_engine_id => 'eng-1',
           remote_request_id => 'cmpl-x-0', remote_host => '6.6.6.6',
           remote_port => 5600, tp_size => 1};
my $reply = {id => 'cmpl-x', choices => [{text => 'a'}], kv_transfer_params => $ktp};

my ($kind, $why, $out) = split /\t/, run_driver($json->encode($reply), 'reply', 'nixl'), 3;
is $kind, 0, 'nixl reply with params: usable';
is_deeply $json->decode($out), $ktp, 'params kept as sent (host replaced later)';

my %old = %$ktp;
delete @old{qw(tp_size)};
($kind) = split /\t/, run_driver($json->encode({kv_transfer_params => \%old}), 'reply', 'nixl');
is $kind, 0, 'params without tp_size are usable';

# current vLLM (nixl/pull_scheduler.py request_finished): one block list
# per KV cache group, and fields the gateway does not know: all kept as sent
for my $case (
    [[[11, 12, 13], [40]], 'per-group block ids'],
    [[], 'no block ids (full prefix hit)'],
    ['all', 'block ids of a shape unknown here'],
    [[1.5, -2], 'block ids that are not ids'],
) {
    my $cur = {%$ktp, remote_block_ids => $case->[0], remote_num_tokens => 600,
               dcp_size => 1, pp_size => 1, remote_blocks_expiry_time => undef,
               transfer_mode => 'pull', future_field => {a => [1, {b => 2}]}};
    ($kind, $why, $out) = split /\t/,
        run_driver($json->encode({kv_transfer_params => $cur}), 'reply', 'nixl'), 3;
    is $kind, 0, "reply with $case->[1]: usable";
    is_deeply $json->decode($out), $cur, "  ... every field kept as sent";
}

for my $case (
    [{%$ktp, do_remote_prefill => JSON::PP::false}, 'do_remote_prefill false'],
    [do { my %h = %$ktp; delete $h{remote_request_id}; \%h }, 'no request id'],
    [{%$ktp, remote_request_id => 7}, 'request id not a string'],
    [do { my %h = %$ktp; delete $h{remote_port}; \%h }, 'no port'],
    [{%$ktp, remote_port => 0}, 'port 0'],
    [{%$ktp, remote_port => 70000}, 'port out of range'],
    [{%$ktp, remote_port => '5600'}, 'port as a string'],
    [{%$ktp, remote_engine_id => ''}, 'empty engine id'],
    [do { my %h = %$ktp; delete $h{remote_engine_id}; \%h }, 'no engine id'],
    ['nope', 'params not an object'],
) {
    ($kind, $why) = split /\t/,
        run_driver($json->encode({kv_transfer_params => $case->[0]}), 'reply', 'nixl');
    is $kind, 1, "unusable params ($case->[1]): decode without them";
    ok length $why, "  ... with a reason ($why)";
}

# a repeated key inside the reply's params: the decoder would keep the last
# copy, which the checks never saw
for my $case (
    ['"remote_port":5600,"remote_port":22', 'remote_port'],
    ['"remote_block_ids":[1],"remote_block_ids":[-1]', 'remote_block_ids'],
    ['"x":{"a":1,"a":2}', 'a nested key'],
) {
    my $base = $json->encode($ktp);
    $base =~ s/^\{/{$case->[0],/;
    ($kind, $why) = split /\t/,
        run_driver("{\"kv_transfer_params\":$base}", 'reply', 'nixl');
    is $kind, 1, "reply repeating $case->[1]: decode without its params";
    like $why, qr/repeats a key/, '  ... with that reason';
}

($kind, $why) = split /\t/, run_driver('{"id":"x"}', 'reply', 'nixl');
is $kind, 1, 'reply without kv_transfer_params: decode without';
($kind) = split /\t/, run_driver('{"kv_transfer_params":null}', 'reply', 'nixl');
is $kind, 1, 'kv_transfer_params null: decode without';

for my $bad ('', 'not json', '[1,2,3]', '"str"', '{"a":', "{\"a\":1}trailing") {
    ($kind) = split /\t/, run_driver($bad, 'reply', 'nixl');
    is $kind, 2, "reply " . ($bad eq '' ? 'empty' : "'$bad'") . ": invalid (as a 5xx)";
}

($kind, $why, $out) = split /\t/, run_driver($json->encode($reply), 'reply', 'lmcache'), 3;
is $kind, 1, 'lmcache reply: nothing to carry (the KV was pushed)';
is $out, '', 'lmcache reply: no params';

# --- the decode body --------------------------------------------------------

my $dec = $json->decode(run_driver(dec_input($chat, $ktp), 'decode', '127.0.0.2'));
is $dec->{kv_transfer_params}{remote_host}, '127.0.0.2',
    'decode params: remote_host is the prefill peer, not the reply\'s';
is $dec->{kv_transfer_params}{remote_engine_id}, 'eng-1', 'decode params: engine id copied';
is_deeply $dec->{kv_transfer_params}{remote_block_ids}, [1, 2, 3], 'decode params: block ids copied';
ok $dec->{stream}, 'decode body keeps the client\'s stream flag';
is $dec->{max_tokens}, 200, 'decode body keeps the client\'s max_tokens';
is_deeply $dec->{stream_options}, {include_usage => JSON::PP::true},
    'decode body keeps stream_options';

$dec = $json->decode(run_driver(dec_input($chat, undef), 'decode'));
ok !exists $dec->{kv_transfer_params}, 'decode body without params: client params stripped';

$dec = $json->decode(run_driver(dec_input($chat, $ktp), 'decode'));
ok !exists $dec->{kv_transfer_params},
    'params without a known prefill host are dropped, never passed through';

{
    # a vetted remote_host equal to the reply's: the params go on as sent,
    # byte for byte (same order, per-group block ids, unknown fields)
    my $raw = '{"remote_engine_id":"e","remote_request_id":"r-0",'
            . '"remote_block_ids":[[11,12,13],[40]],"remote_host":"10.1.2.3",'
            . '"remote_port":5600,"tp_size":2,"x_new":{"k":[1,null]}}';
    my $body = run_driver("$raw\n" . $json->encode($cmpl), 'decode', '10.1.2.3');
    like $body, qr/"kv_transfer_params":\Q$raw\E[,}]/,
        'decode params byte-identical when remote_host stands';
    $body = run_driver("$raw\n" . $json->encode($cmpl), 'decode', '10.0.0.9');
    my $d = $json->decode($body)->{kv_transfer_params};
    is $d->{remote_host}, '10.0.0.9', 'an overruled remote_host is replaced';
    is_deeply $d->{remote_block_ids}, [[11, 12, 13], [40]], '  ... the rest kept';
    is_deeply $d->{x_new}, {k => [1, undef]}, '  ... unknown fields too';
}

my $noh = {%$ktp};
delete $noh->{remote_host};
$dec = $json->decode(run_driver(dec_input($cmpl, $noh), 'decode', '::1'));
is $dec->{kv_transfer_params}{remote_host}, '::1', 'remote_host added when the reply had none';

# --- the direct path: the client's bytes ------------------------------------

my $raw = qq({ "model" : "m",\n "prompt":"caf\xc3\xa9 \\u00e9 \\"q\\"",\t"n":1.50e0 ,"x":[ 1, {"a" :null} ] }\n);
my ($cnt, $rest) = split /\t/, run_driver($raw, 'direct'), 2;
is $cnt, 0, 'no kv_transfer_params';
is $rest, qq({"model" : "m","prompt":"caf\xc3\xa9 \\u00e9 \\"q\\"","n":1.50e0,"x":[ 1, {"a" :null} ]}),
    'members copied byte for byte (escapes, number spelling, inner spacing kept)';

($cnt, $rest) = split /\t/, run_driver('{"a":1,"kv_transfer_params":{},"kv_transfer_params":2,"KV_TRANSFER_PARAMS":3}', 'direct');
is $cnt, 2, 'every kv_transfer_params counted';
is $rest, '{"a":1,"KV_TRANSFER_PARAMS":3}', 'all removed; other keys (and other spellings) untouched';
($cnt, $rest) = split /\t/, run_driver('{"kv_transfer_\\u0070arams":{"remote_host":"h"},"prompt":"x"}', 'direct');
is $rest, '{"prompt":"x"}', 'an escaped spelling of kv_transfer_params is removed too';
($cnt, $rest) = split /\t/, run_driver('{"kv_transfer_params":1}', 'direct');
is $rest, '{}', 'nothing left: an empty object';

# --- linear in the body (issue 8, item 4) ------------------------------------
# N repeated keys used to cost O(N^2) (5.7 s for N = 40k in a disaggregated
# request); now a repeated key is refused in one pass, and 200k distinct keys
# are indexed, checked and spliced in well under a second.

use Time::HiRes ();
sub timed { my $t0 = Time::HiRes::time(); my $o = run_driver(@_);
            return (Time::HiRes::time() - $t0, $o) }
my ($t, $o) = timed('{"prompt":"x"' . (',"stream":true' x 40000) . '}', 'prefill', 'nixl');
like $o, qr/^REFUSED 6/, '40k repeated "stream" keys: refused';
cmp_ok $t, '<', 2, "  ... in ${\ sprintf '%.2f', $t} s (was 5.7 s)";
($t, $o) = timed('{"prompt":"x","kv_transfer_params":0' . (',"kv_transfer_params":{}' x 40000) . '}', 'prefill', 'nixl');
is(() = $o =~ /"kv_transfer_params"/g, 1, '40k repeated kv_transfer_params: all removed');
cmp_ok $t, '<', 2, "  ... in ${\ sprintf '%.2f', $t} s";
my $wide = '{"prompt":"x"' . join('', map { ",\"k$_\":$_" } 1 .. 200000) . '}';
($t, $o) = timed($wide, 'prefill', 'nixl');
like $o, qr/"k199999":199999.*"max_tokens":1/, '200k distinct keys: spliced';
cmp_ok $t, '<', 3, "  ... in ${\ sprintf '%.2f', $t} s";

# --- memory: every path under valgrind --------------------------------------

SKIP: {
    skip 'valgrind not installed', 1 unless `sh -c 'command -v valgrind'`;
    my @runs = (
        [$json->encode($chat), 'prefill', 'nixl'],
        [$json->encode($chat), 'prefill', 'lmcache', 'r', 'h', '1,2', '3,4'],
        [$json->encode($reply), 'reply', 'nixl'],
        [$json->encode({kv_transfer_params => {%$ktp, remote_port => -1}}), 'reply', 'nixl'],
        ['{"a":', 'reply', 'nixl'],
        [dec_input($chat, $ktp), 'decode', '127.0.0.2'],
        ['{"prompt":"x","kv_transfer_params":1,"kv_transfer_params":2}', 'direct'],
        ['{"prompt":"x","stream":1,"stream":2}', 'prefill', 'nixl'],
        ['{"prompt":"\\u0000"}', 'prefill', 'nixl'],
    );
    my @memcheck = ('valgrind', '-q', '--error-exitcode=99',
                    '--leak-check=full',
                    '--errors-for-leak-kinds=definite,indirect');
    my $errors = '';
    for my $run (@runs) {
        my ($input, @args) = @$run;
        my ($o, $st) = $drv->run_under(\@memcheck, $input, @args);
        $errors .= "@args: exit " . ($st >> 8) . "\n$o\n" if $st >> 8 == 99;
    }
    is $errors, '', 'no leak or invalid access on any path (valgrind)';
}

done_testing;
