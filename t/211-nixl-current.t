# dpd_protocol nixl against current vLLM's reply (nixl/pull_scheduler.py
# request_finished: remote_block_ids one list per KV cache group,
# remote_num_tokens, tp/dcp/pp_size, remote_blocks_expiry_time,
# transfer_mode), end to end through nginx: the decoder gets the params as
# the prefill sent them but remote_host (dpd_nixl_remote_hosts), and a
# request without usable params is a fallback.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;
use DPD::Pools qw(block_defaults recs one);
use JSON::PP ();

plan(skip_all => $_) for DPD::Pools->unavailable;
plan('no_plan');

# ports: $DPD_TEST_PORT_BASE (default 18600) + 114 .. 117
my $pools = DPD::Pools->start(offset => 114, time_scale => 0.01,
                              prefill => {args => ['--kv-cache-groups', 3]});
my @prefill = $pools->prefill;
my @decode = $pools->decode;
my %o = $pools->emu_options;
my $flat = DPD::Emu->start(host => '127.0.0.6', role => 'prefill', %o,
                           args => ['--nixl-reply-shape', 'flat']);
# side channel on "another NIC" (127.0.0.17) than HTTP (127.0.0.7)
my $nic = DPD::Emu->start(host => '127.0.0.7', role => 'prefill', %o,
                          args => ['--side-channel-host', '127.0.0.17']);
# vLLM's default VLLM_NIXL_SIDE_CHANNEL_HOST: a hostname
my $named = DPD::Emu->start(host => '127.0.0.8', role => 'prefill', %o,
                            args => ['--side-channel-host', 'localhost']);
my $unk = DPD::Emu->start(host => '127.0.0.9', role => 'prefill', %o);
my $noport = DPD::Emu->start(host => '127.0.0.10', role => 'prefill', %o);
my $v6 = DPD::Emu->start(host => '127.0.0.11', role => 'prefill', %o);
my $v6b = DPD::Emu->start(host => '127.0.0.13', role => 'prefill', %o);
# the peer's own address, spelt so that inet_aton() reads 127.0.0.10
my $odd = DPD::Emu->start(host => '127.0.0.12', role => 'prefill', %o);

my %future = (future_field => {nested => [1, {x => "y\x{e9}"}, undef]},
              tp_size => 2, remote_blocks_expiry_time => 123.5,
              remote_block_ids => [[3, 1, 2], [], [7]]);
$unk->fault(role => 'prefill', kv_override => {%future});
$noport->fault(role => 'prefill', kv_remove => ['remote_port']);
$v6->fault(role => 'prefill', kv_override => {remote_host => '::1'});
$v6b->fault(role => 'prefill', kv_override => {remote_host => '[::1]'});
$odd->fault(role => 'prefill', kv_override => {remote_host => '127.000.000.012'});

my $http_config = $pools->http_config . join '', map {
    "    upstream $_->[0] { server $_->[1]:\$TEST_NGINX_EMU_PORT; }\n"
} [flat => '127.0.0.6'], [nic => '127.0.0.7'], [named => '127.0.0.8'],
  [unk => '127.0.0.9'], [noport => '127.0.0.10'], [v6 => '127.0.0.11'],
  [v6b => '127.0.0.13'], [odd => '127.0.0.12'];

my $config = <<'_EOC_';
    dpd on;
    dpd_threshold 256;
    dpd_protocol nixl;
    add_header X-Route $dpd_route always;

    location /v1/ {
        dpd_prefill_pass /_p/prefill;
        proxy_pass http://decode;
    }

    location /flat/ { dpd_prefill_pass /_p/flat; proxy_pass http://decode/; }
    location /nic/ {
        dpd_prefill_pass /_p/nic;
        dpd_nixl_remote_hosts 10.0.0.0/8 127.0.0.16/30 fd00::/8;
        proxy_pass http://decode/;
    }
    location /nic-no/ { dpd_prefill_pass /_p/nic; proxy_pass http://decode/; }
    location /nic-other/ {
        dpd_prefill_pass /_p/nic;
        dpd_nixl_remote_hosts 10.0.0.0/8 127.0.0.20 ::1;
        proxy_pass http://decode/;
    }
    location /named/ {
        dpd_prefill_pass /_p/named;
        dpd_nixl_remote_hosts 127.0.0.0/8;
        proxy_pass http://decode/;
    }
    location /unk/ { dpd_prefill_pass /_p/unk; proxy_pass http://decode/; }
    location /noport/ { dpd_prefill_pass /_p/noport; proxy_pass http://decode/; }
    location /v6/ {
        dpd_prefill_pass /_p/v6;
        dpd_nixl_remote_hosts ::1/128;
        proxy_pass http://decode/;
    }
    location /v6b/ {
        dpd_prefill_pass /_p/v6b;
        dpd_nixl_remote_hosts ::1;
        proxy_pass http://decode/;
    }
    location /odd/ { dpd_prefill_pass /_p/odd; proxy_pass http://decode/; }

    location ~ ^/_p/(\w+)(/.*)$ {
        internal;
        subrequest_output_buffer_size 64k;
        proxy_pass http://$1$2;
    }

    location = /metrics { dpd on; dpd_metrics; }
_EOC_

sub body {
    return "POST $_[0]v1/completions\n" . JSON::PP->new->encode({model => "m",
        prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 2});
}

block_defaults(http_config => $http_config, config => $config, timeout => 30,
               more_headers => sub {
                   "Content-Type: application/json\nX-Request-Id: "
                   . $_[0]->name =~ s/^TEST \d+: ([^:\s]+).*/$1/sr . "\n" });

no_shuffle();
log_level('info');
run_tests();

# --- what the engines received ---------------------------------------------

my $J = JSON::PP->new->canonical;

sub pair {
    my ($id, @p) = @_;
    return (one('prefill', $id, @p), one('decode', $id, @decode));
}

sub cached_ok {
    my ($d) = @_;
    return $d->{cached_tokens}
        == $d->{emu}->block_size * int(($d->{prompt_tokens} - 1)
                                       / $d->{emu}->block_size);
}

for my $case ([cur => \@prefill, 3], [flat => [$flat], 0]) {
    my ($id, $emus, $groups) = @$case;
    my ($p, $d) = pair($id, @$emus);
    my $sent = JSON::PP->new->decode($p->{kv_reply_raw});
    my $got = $d->{body}{kv_transfer_params};
    if ($groups) {
        is scalar @{ $sent->{remote_block_ids} }, $groups,
            "$id: the prefill answered $groups block lists";
        ok exists $sent->{remote_num_tokens}, "$id: with remote_num_tokens";
    } else {
        ok !ref $sent->{remote_block_ids}[0], "$id: a flat block list";
    }
    is $J->encode($got), $J->encode($sent),
        "$id: the decoder got every field as sent (remote_host is the peer's)";
    my $raw = $J->encode($sent->{remote_block_ids});
    like $d->{body_text}, qr/"remote_block_ids":\Q$raw\E[,}]/,
        "$id: remote_block_ids byte-identical";
    is $d->{kv}{outcome}, 'ok', "$id: the decoder pulled";
    ok cached_ok($d), "$id: cached_tokens as after a full pull";
}

{
    my ($p, $d) = pair('unk', $unk);
    my $got = $d->{body}{kv_transfer_params};
    is_deeply { map { $_ => $got->{$_} } keys %future }, \%future,
        'fields unknown to the gateway, and odd block id lists, pass unchanged';
    my $raw = $J->encode($future{future_field});
    like $d->{body_text}, qr/"future_field":\Q$raw\E/,
        '  ... byte for byte';
}

{
    my ($p, $d) = pair('nic-in', $nic);
    is $d->{body}{kv_transfer_params}{remote_host}, '127.0.0.17',
        'remote_host inside dpd_nixl_remote_hosts: kept';
    is $d->{kv}{outcome}, 'ok', '  ... and the decoder pulled from it';
    ok cached_ok($d), '  ... the whole prompt';

    for my $id (qw(nic-none nic-other)) {
        ($p, $d) = pair($id, $nic);
        is $d->{body}{kv_transfer_params}{remote_host}, '127.0.0.7',
            "$id: remote_host outside the list: the peer's address";
        is $d->{cached_tokens} // 0, 0, "$id: nothing pulled from there";
    }
    is $nic->counter('nixl_served_total'), 1, 'one pull served by the other NIC';
}

{
    my ($p, $d) = pair('named', $named);
    is $d->{body}{kv_transfer_params}{remote_host}, '127.0.0.8',
        'a hostname is replaced even with 127.0.0.0/8 allowed';
}

{
    my ($p, $d) = pair('v6', $v6);
    is $d->{body}{kv_transfer_params}{remote_host}, '::1',
        'an IPv6 remote_host inside an IPv6 allowlist: kept';
}

{
    my ($p, $d) = pair('v6b', $v6b);
    is $d->{body}{kv_transfer_params}{remote_host}, '::1',
        'a bracketed IPv6 remote_host goes on as canonical text';
    ($p, $d) = pair('odd', $odd);
    is $d->{body}{kv_transfer_params}{remote_host}, '127.0.0.12',
        'the peer spelt with leading zeros goes on as canonical text';
}

{
    my ($p, $d) = pair('noport', $noport);
    ok !exists JSON::PP->new->decode($p->{kv_reply_raw})->{remote_port},
        'noport: the prefill reply lacked remote_port';
    ok !exists $d->{body}{kv_transfer_params},
        'noport: the decoder gets no transfer params';
}

__DATA__

=== TEST 1: cur: per-group block ids of current vLLM reach the decoder
--- request eval: main::body("/")
--- response_body_like: "cached_tokens":[1-9]\d\d
--- response_headers
X-Route: disaggregated
--- no_error_log
[warn]
[error]



=== TEST 2: flat: the older flat reply still works
--- request eval: main::body("/flat/")
--- response_body_like: "cached_tokens":[1-9]\d\d
--- response_headers
X-Route: disaggregated
--- no_error_log
[warn]
[error]



=== TEST 3: unk: unknown fields pass through
--- request eval: main::body("/unk/")
--- response_body_like: "choices"
--- response_headers
X-Route: disaggregated
--- no_error_log
[warn]



=== TEST 4: nic-in: a side channel on another NIC, allowed
--- request eval: main::body("/nic/")
--- response_body_like: "cached_tokens":[1-9]\d\d
--- response_headers
X-Route: disaggregated
--- no_error_log
[warn]



=== TEST 5: nic-none: the same reply without an allowlist
--- request eval: main::body("/nic-no/")
--- response_body_like: "choices"
--- response_headers
X-Route: disaggregated
--- error_log eval
qr/request "nic-none": the prefill reply's remote_host "127\.0\.0\.17" is not the prefill peer, the decoder pulls from 127\.0\.0\.7 instead/



=== TEST 6: nic-other: outside the allowlist
--- request eval: main::body("/nic-other/")
--- response_body_like: "choices"
--- response_headers
X-Route: disaggregated
--- error_log eval
qr/remote_host "127\.0\.0\.17" is neither the prefill peer nor in dpd_nixl_remote_hosts, the decoder pulls from 127\.0\.0\.7/



=== TEST 7: named: a hostname is never passed on
--- request eval: main::body("/named/")
--- response_body_like: "choices"
--- error_log eval
qr/remote_host "localhost" is not an IP address, the decoder pulls from 127\.0\.0\.8 instead/



=== TEST 8: v6: IPv6 allowlist
--- request eval: main::body("/v6/")
--- response_body_like: "choices"
--- response_headers
X-Route: disaggregated
--- no_error_log
[warn]



=== TEST 9: v6b: bracketed IPv6
--- request eval: main::body("/v6b/")
--- response_body_like: "choices"
--- no_error_log
[warn]



=== TEST 10: odd: leading zeros
--- request eval: main::body("/odd/")
--- response_body_like: "choices"
--- no_error_log
[warn]



=== TEST 11: noport: a reply without remote_port is a fallback
--- request eval: main::body("/noport/")
--- response_body_like: "choices"
--- response_headers
X-Route: fallback
--- error_log
decodes without KV transfer params (remote_port missing or out of range)



=== TEST 12: metrics: the fallback counted as such
--- request eval
[main::body("/noport/"), "GET /metrics"]
--- more_headers
Content-Type: application/json
--- response_body_like eval
["choices", qr/dpd_requests_total\{route="disaggregated",status="2xx"\} 0\n.*dpd_requests_total\{route="fallback",status="2xx"\} 1\n.*dpd_fallbacks_total\{cause="no_kv_params"\} 1\n/s]



=== TEST 13: dpd_nixl_remote_hosts: not an address
--- config
    location /v1/ { dpd on; dpd_nixl_remote_hosts 10.0.0.0/8 pod-a.local; }
--- must_die
--- error_log
invalid address or network "pod-a.local" in "dpd_nixl_remote_hosts"



=== TEST 14: dpd_nixl_remote_hosts: once per block
--- config
    location /v1/ {
        dpd on;
        dpd_nixl_remote_hosts 10.0.0.0/8;
        dpd_nixl_remote_hosts fd00::/8;
    }
--- must_die
--- error_log
"dpd_nixl_remote_hosts" directive is duplicate



=== TEST 15: dpd_nixl_remote_hosts: low bits set warn; unix: is refused
--- config
    location /v1/ { dpd on; dpd_nixl_remote_hosts 10.1.2.3/8 ::1 unix:; }
--- must_die
--- error_log
low address bits of 10.1.2.3/8 are meaningless
invalid address or network "unix:" in "dpd_nixl_remote_hosts"
