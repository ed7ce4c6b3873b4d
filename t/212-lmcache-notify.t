# dpd_protocol lmcache as LMCache's own proxy does it
# (examples/disagg_prefill/disagg_proxy_server.py), end to end: nginx, a
# router kv_agent receiving LMCache's ProxyNotif messages (ZeroMQ PULL,
# msgpack) and vLLM emulators whose prefill side pushes the KV 300 ms after
# its reply (LMCache's asynchronous sender) and then notifies from each TP
# rank's own connection.
#   * the prefill gets the prompt as token ids, max_tokens 1 and
#     {"ret_first_tok": true, "disagg_spec": {...}};
#   * the decoder gets the ids plus the prefill's first_tok, max_tokens - 1,
#     and only after the notices arrived (it finds the KV: cached tokens);
#   * the client sees the prefill's first token first (streamed: the first
#     SSE event; not streamed: in front of choices[0].text, usage moved);
#   * missing notices (one of two ranks, or a rank repeating itself): the
#     decode goes after dpd_kv_wait, counted as a timeout;
#   * a notice from an address outside lmcache_notify.allow does not count,
#     one from an allowed prefill node does; garbage, oversized, repeated
#     and malformed notices change nothing and the agent keeps running.
# Ports: emulators $DPD_TEST_PORT_BASE + 100 .. 103, router agent + 104,
# notify port + 105, second rank's LMCache ports + 110/111.
use strict;
use warnings;

use Test::Nginx::Socket;
use DPD::Emu;
use DPD::KvAgent;
use DPD::Pools qw(block_defaults recs one wait_for);
use IO::Socket::INET ();
use POSIX ();
use JSON::PP ();
use Time::HiRes qw(sleep time);

our $PY = -x '/usr/bin/python3' ? '/usr/bin/python3' : 'python3';

plan(skip_all => $_) for DPD::Pools->unavailable,
                         DPD::KvAgent->unavailable('tcp;ofi_rxm');
plan(skip_all => 'python3-zmq / python3-msgpack missing (make deps)')
    if system("$PY -c 'import zmq, msgpack' 2>/dev/null") != 0;
plan('no_plan');   # after the skip checks: a skip must not plan twice

our $J = JSON::PP->new->utf8->canonical;
my $base = DPD::Pools::port_base();
our $NOTIFY = '127.0.0.1:' . ($base + 105);
our $TOOL = "$PY " . DPD::Emu::root() . '/tools/lmcache_notice.py';

our $R = DPD::KvAgent->start(id => 'router-0', role => 'router',
    port => $base + 104,
    config => {lmcache_notify => {listen => $NOTIFY,
                                  allow => ['127.0.0.2/31']}});
my $pools = DPD::Pools->start(offset => 100, time_scale => 0.01,
    python => $PY,
    prefill => {args => ['--lmcache-proxy', $NOTIFY,
                         '--lmcache-push-delay-ms', 300]});
our @prefill = $pools->prefill;
our @decode = $pools->decode;

my $init2 = $pools->lmcache_init_port;
my $alloc2 = $pools->lmcache_alloc_port;
my $http_config = $pools->http_config(lmcache => 1)
    . "    dpd_state_table " . $R->state_path . " check=10ms stale=3s;\n\n"
    . DPD::Pools::upstream_conf(name => 'decode2', port => $pools->port,
          hosts => ['127.0.0.4', '127.0.0.5'],
          lines => ["dpd_lmcache_ports init=$init2," . ($base + 110)
                    . " alloc=$alloc2," . ($base + 111) . ";"]);

my $common = <<'_EOC_';
        dpd on;
        dpd_threshold 256;
        dpd_protocol lmcache;
        dpd_prefill_pass /_dpd_prefill;
        dpd_prefill_timeout 20s;
        proxy_http_version 1.1;
        proxy_buffering off;
        add_header X-Route $dpd_route always;
        add_header X-KV-Wait $dpd_kv_wait_time always;
        add_header X-Decode-Peer $dpd_decode_peer always;
_EOC_

my $config = <<"_EOC_";
    location /v1/ {
$common
        dpd_decode_upstream decode;
        dpd_kv_wait 3s;
        proxy_pass http://decode;
    }

    # two decode TP ranks: two notices needed
    location /tp2/v1/ {
$common
        dpd_decode_upstream decode2;
        dpd_kv_wait 1200ms;
        proxy_pass http://decode2/v1/;
    }

    location /_dpd_prefill/ {
        internal;
        proxy_pass http://prefill/;
        proxy_http_version 1.1;
    }

    location = /metrics { dpd_metrics; }
_EOC_

# each block's nginx starts afresh: its metrics are its own requests'
block_defaults(http_config => $http_config, config => $config, timeout => 30,
               request => "GET /metrics",
               response_body_like => qr/dpd_kv_handoffs_total\{transfer_params="yes"\} 1\n.*dpd_kv_wait_total\{outcome="ready"\} 1\n.*dpd_kv_wait_total\{outcome="timeout"\} 0\n.*dpd_kv_transfer_seconds_count\{protocol="lmcache"\} 1\n/s);

# A whole exchange with nginx (HTTP/1.0: the body ends with the connection)
sub fetch {
    my ($path, $rid, $body) = @_;
    my $s = IO::Socket::INET->new(PeerAddr => '127.0.0.1',
        PeerPort => Test::Nginx::Socket::server_port(), Timeout => 20)
        or die "connect: $!";
    print $s "POST $path HTTP/1.0\r\nHost: localhost\r\n"
           . "Content-Type: application/json\r\nX-Request-Id: $rid\r\n"
           . "Content-Length: " . length($body) . "\r\n\r\n$body";
    local $/;
    my $resp = <$s> // '';
    close $s;
    my ($head, $text) = split /\r\n\r\n/, $resp, 2;
    my ($status) = ($head // '') =~ m{^HTTP/1\.\d (\d+)};
    my %h = map { /^([^:]+):\s*(.*)$/ ? (lc $1, $2) : () }
            split /\r\n/, $head // '';
    return {status => $status // 0, h => \%h, body => $text // ''};
}

our %RES;

sub cmpl {
    my ($path, $rid, %o) = @_;
    $RES{$rid} = fetch($path, $rid, $J->encode({model => 'm',
        prompt => $o{prompt} // $ENV{TEST_NGINX_LONG},
        max_tokens => $o{max_tokens} // 8,
        $o{stream} ? (stream => JSON::PP::true) : ()}));
}

# the prefill record of $rid, once it exists
sub prefill_rec {
    my ($rid) = @_;
    my $r;
    wait_for("$rid at the prefill", sub {
        ($r) = recs($rid, @prefill);
        $r && $r->{status} }, 20);
    return $r || {};
}

# the child's answer, in a file of this run's own (CI runs this file in
# several stages at once)
our $Tmp = "/tmp/dpd-t212-$$";

# a request whose notices the prefill does not send; $during runs while
# nginx waits (with the gateway's req_id)
sub held {
    my ($path, $rid, $during) = @_;
    $_->fault(lmc_notices => 0, role => 'prefill', count => 1)
        for @prefill;
    my $pid = fork() // die "fork: $!";
    if ($pid == 0) {
        my $res = fetch($path, $rid, $J->encode({model => 'm',
            prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 4}));
        open my $fh, '>', "$Tmp-$rid.$$" or POSIX::_exit(1);
        print $fh $J->encode($res);
        close $fh;
        rename "$Tmp-$rid.$$", "$Tmp-$rid";
        POSIX::_exit(0);
    }
    my $p = prefill_rec($rid);
    my $kv_id = $p->{body}{kv_transfer_params}{disagg_spec}{req_id};
    $during->($kv_id) if $during;
    waitpid $pid, 0;
    $_->clear_faults for @prefill;
    open my $fh, '<', "$Tmp-$rid" or die "no result for $rid";
    local $/;
    $RES{$rid} = $J->decode(<$fh>);
    close $fh;
    unlink "$Tmp-$rid";
    $RES{$rid}{kv_id} = $kv_id;
}

# $refusable: the sender is outside the allowlist, so ZeroMQ may drop its
# connection before the message is queued (the tool's exit 3); either way
# the notice must not count
sub notice {
    my ($from, $kind, $id, $count, $conns, $refusable) = @_;
    system(split(/ /, $TOOL), '--to', $NOTIFY, '--from', $from,
           ($count ? ('--count', $count) : ()),
           ($conns ? ('--conns', $conns) : ()), $kind, $id // 'x');
    my $rc = $? >> 8;
    return if $rc == 0 || ($refusable && $rc == 3);
    die "lmcache_notice.py $kind failed (exit $rc)";
}

no_shuffle();
log_level('info');
run_tests();

# --- what the engines and the client saw -----------------------------------

sub sse_texts {
    my ($body) = @_;
    return map { $_->{choices}[0]{text} // '' }
           map { $J->decode($_) }
           grep { $_ ne '[DONE]' } $body =~ /^data: (.*)$/mg;
}

for my $rid (qw(lmcn-plain lmcn-stream)) {
    my $res = $RES{$rid} || {};
    my $p = one('prefill', $rid, @prefill);
    my $d = one('decode', $rid, @decode);
    my $kvp = $p->{body}{kv_transfer_params} || {};
    my $spec = $kvp->{disagg_spec} || {};
    my $ids = $p->{body}{prompt};

    is $res->{status}, 200, "$rid: 200";
    is $res->{h}{'x-route'}, 'disaggregated', "$rid: disaggregated";
    ok ref $ids eq 'ARRAY' && @$ids == $p->{prompt_tokens}
       && !grep({ !/^\d+$/ } @$ids) && @$ids > 256,
        "$rid: the prefill got the prompt as token ids";
    is $p->{body}{max_tokens}, 1, "$rid: prefill max_tokens 1";
    ok $kvp->{ret_first_tok}, "$rid: ret_first_tok";
    is_deeply [sort keys %$spec],
        [qw(receiver_alloc_port receiver_host receiver_init_port req_id)],
        "$rid: disagg_spec has the adapter's field names";
    is $spec->{req_id}, $p->{request_id}, "$rid: req_id is the X-Request-Id";
    is $spec->{receiver_host}, $d->{emu}->host,
        "$rid: pushed to the decoder that decoded";

    my $first = (eval { $J->decode($p->{kv_reply_raw} // "") } || {})->{first_tok};
    is_deeply $d->{body}{prompt}, [ref $ids eq 'ARRAY' ? @$ids : $ids, $first],
        "$rid: decoder prompt = the ids + the prefill's first_tok";
    is $d->{body}{max_tokens}, 7, "$rid: decoder max_tokens 8 - 1";
    ok !exists $d->{body}{kv_transfer_params},
        "$rid: decoder without kv_transfer_params";

    # the decode waited for the notices (and so found the KV)
    ok $p->{lmc_notified} && $d->{t_wall} >= $p->{lmc_notified},
        "$rid: decode sent after the notices ("
        . ($d->{t_wall} // '?') . " >= " . ($p->{lmc_notified} // '?') . ")";
    ok $res->{h}{'x-kv-wait'} >= 250, "$rid: nginx waited for them ("
        . ($res->{h}{'x-kv-wait'} // '?') . " ms)";
    is $d->{cached_tokens}, int($p->{prompt_tokens} / 256) * 256,
        "$rid: the decoder found the pushed KV";

    my $want = $p->{text} . $d->{text};
    if ($rid eq 'lmcn-stream') {
        my @t = sse_texts($res->{body});
        is $t[0], $p->{text}, "$rid: the first event is the prefill's token";
        is join('', @t), $want, "$rid: then the decoder's tokens";
        like $res->{body}, qr/\n\ndata: \[DONE\]\n\n\z/, "$rid: [DONE] last";
    } else {
        my $o = eval { $J->decode($res->{body}) } || {};
        is $o->{choices}[0]{text}, $want,
            "$rid: text = the prefill's token + the decoder's";
        is $o->{usage}{prompt_tokens}, $p->{prompt_tokens},
            "$rid: usage.prompt_tokens of the client's prompt";
        is $o->{usage}{completion_tokens}, $d->{completion_tokens} + 1,
            "$rid: usage.completion_tokens counts the prefill's token";
        is $o->{usage}{total_tokens},
            $p->{prompt_tokens} + $d->{completion_tokens} + 1,
            "$rid: total_tokens";
    }
}

{
    # not exact: n > 1 is refused by the emulator, echo is not; use a one-
    # token answer (max_tokens 1): no first token carried over
    my $p = one('prefill', 'lmcn-one', @prefill);
    my $d = one('decode', 'lmcn-one', @decode);
    is_deeply $d->{body}{prompt}, $p->{body}{prompt},
        'max_tokens 1: the decoder gets the ids without a first token';
    is $d->{body}{max_tokens}, 1, 'max_tokens 1: unchanged';
    my $o = eval { $J->decode($RES{'lmcn-one'}{body}) } || {};
    is $o->{choices}[0]{text}, $d->{text},
        'max_tokens 1: the decoder\'s answer as it is';
}

{
    my $res = $RES{'lmcn-tp2-one'} || {};
    ok $res->{h}{'x-kv-wait'} >= 1150,
        'tp2, one rank notified: waited dpd_kv_wait ('
        . ($res->{h}{'x-kv-wait'} // '?') . ' ms)';
    is $res->{status}, 200, 'tp2, one rank: decoded anyway';
    $res = $RES{'lmcn-tp2-dup'} || {};
    ok $res->{h}{'x-kv-wait'} >= 1150,
        'tp2, one rank repeating its notice: still dpd_kv_wait ('
        . ($res->{h}{'x-kv-wait'} // '?') . ' ms)';
    $res = $RES{'lmcn-tp2-both'} || {};
    ok $res->{h}{'x-kv-wait'} >= 250 && $res->{h}{'x-kv-wait'} < 1150,
        'tp2, both ranks: decoded once both arrived ('
        . ($res->{h}{'x-kv-wait'} // '?') . ' ms)';
}

{
    my $res = $RES{'lmcn-foreign'} || {};
    ok $res->{kv_id}, 'foreign sender: the gateway\'s req_id seen';
    ok $res->{h}{'x-kv-wait'} >= 1150,
        'a notice from 127.0.0.9 (not allowed) does not count ('
        . ($res->{h}{'x-kv-wait'} // '?') . ' ms)';
    $res = $RES{'lmcn-allowed'} || {};
    ok $res->{h}{'x-kv-wait'} < 1100,
        'the same notice from 127.0.0.3 (an allowed prefill node) does ('
        . ($res->{h}{'x-kv-wait'} // '?') . ' ms)';
    $res = $RES{'lmcn-hostile'} || {};
    ok $res->{h}{'x-kv-wait'} >= 1150,
        'garbage, malformed, oversized, repeated notices: nothing counted ('
        . ($res->{h}{'x-kv-wait'} // '?') . ' ms)';
    is $res->{status}, 200, 'hostile notices: the request still answered';
    ok $R->alive, 'the router agent survived the hostile notices';
    # refused at accept (libzmq's accept filter: no descriptor held), so
    # the line has a count, not the address
    like $R->log_text,
        qr/lmcache_notify: connections refused at accept \(not in (?#
          )lmcache_notify\.allow\) or failed \(\d+ so far\)/,
        'the refused connection is logged';
    like $R->log_text, qr/lmcache_notify: message dropped: /,
        'dropped messages are logged';
}

__DATA__

=== TEST 1: completions, not streamed: ids, first token, decode after the notices
--- init
main::cmpl('/v1/completions', 'lmcn-plain');



=== TEST 2: completions, streamed
--- init
main::cmpl('/v1/completions', 'lmcn-stream', stream => 1);



=== TEST 3: max_tokens 1: nothing to carry over
--- init
main::cmpl('/v1/completions', 'lmcn-one', max_tokens => 1);



=== TEST 4: two TP ranks, one notified: decode after dpd_kv_wait, counted
--- init
$_->fault(lmc_notices => 1, role => 'prefill', count => 1) for @main::prefill;
main::cmpl('/tp2/v1/completions', 'lmcn-tp2-one', max_tokens => 4);
$_->clear_faults for @main::prefill;
--- response_body_like eval
qr/dpd_kv_handoffs_total\{transfer_params="no"\} 1\n.*dpd_kv_wait_total\{outcome="ready"\} 0\n.*dpd_kv_wait_total\{outcome="timeout"\} 1\n.*dpd_kv_transfer_seconds_count\{protocol="lmcache"\} 0\n/s



=== TEST 5: two TP ranks, one notifying three times: still one
--- init
$_->fault(lmc_notices => 1, lmc_dup => 2, role => 'prefill', count => 1)
    for @main::prefill;
main::cmpl('/tp2/v1/completions', 'lmcn-tp2-dup', max_tokens => 4);
$_->clear_faults for @main::prefill;
--- response_body_like eval
qr/dpd_kv_handoffs_total\{transfer_params="no"\} 1\n.*dpd_kv_wait_total\{outcome="ready"\} 0\n.*dpd_kv_wait_total\{outcome="timeout"\} 1\n.*dpd_kv_transfer_seconds_count\{protocol="lmcache"\} 0\n/s



=== TEST 6: two TP ranks, both notified
--- init
main::cmpl('/tp2/v1/completions', 'lmcn-tp2-both', max_tokens => 4);



=== TEST 7: a valid notice from an address outside the allowlist
--- init
main::held('/tp2/v1/completions', 'lmcn-foreign', sub {
    main::notice('127.0.0.9', 'notice', $_[0], 1, 2, 1) });
--- response_body_like eval
qr/dpd_kv_handoffs_total\{transfer_params="no"\} 1\n.*dpd_kv_wait_total\{outcome="ready"\} 0\n.*dpd_kv_wait_total\{outcome="timeout"\} 1\n.*dpd_kv_transfer_seconds_count\{protocol="lmcache"\} 0\n/s
--- no_error_log
[alert]



=== TEST 8: the same from two allowed prefill connections
--- init
main::held('/tp2/v1/completions', 'lmcn-allowed', sub {
    main::notice('127.0.0.3', 'notice', $_[0], 1, 2) });



=== TEST 9: garbage and malformed notices from an allowed address
--- init
main::held('/tp2/v1/completions', 'lmcn-hostile', sub {
    my $id = $_[0];
    main::notice('127.0.0.2', $_, $id)
        for qw(garbage array notype wrongtype intid nulid longid huge
               multipart dupkey trailing);
    main::notice('127.0.0.2', 'notice', $id, 5);   # one sender, 5 times
});
--- response_body_like eval
qr/dpd_kv_handoffs_total\{transfer_params="no"\} 1\n.*dpd_kv_wait_total\{outcome="ready"\} 0\n.*dpd_kv_wait_total\{outcome="timeout"\} 1\n.*dpd_kv_transfer_seconds_count\{protocol="lmcache"\} 0\n/s



=== TEST 10: HTTP/1.1 (chunked to the client), streamed: the prefill's event, then the decoder's, [DONE]
--- request eval
"POST /v1/completions\n" . $main::J->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 4,
    stream => JSON::PP::true})
--- more_headers
Content-Type: application/json
X-Request-Id: lmcn-chunked-stream
--- response_body_like: ^data: \{"id":"cmpl-[0-9a-f]{32}","object":"text_completion","created":\d+,"model":"[^"]+","choices":\[\{"index":0,"text":"[^"]+","logprobs":null,"finish_reason":null,"stop_reason":null\}\],"usage":null\}\n\n(data: \{[^\n]+\}\n\n){3}data: \[DONE\]\n\n$
--- response_headers_like
X-Route: disaggregated
--- no_error_log
[warn]
[error]



=== TEST 11: HTTP/1.1, not streamed: one JSON, four tokens of text
--- request eval
"POST /v1/completions\n" . $main::J->encode({model => "m",
    prompt => $ENV{TEST_NGINX_LONG}, max_tokens => 4})
--- more_headers
Content-Type: application/json
X-Request-Id: lmcn-chunked
--- response_body_like: ^\{.*"choices":\[\{[^\]]*"text":"( [^" ]+){4}".*"usage":\{[^}]*"completion_tokens":4,
--- response_headers_like
X-Route: disaggregated
--- no_error_log
[warn]
[error]
