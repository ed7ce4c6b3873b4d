# dpd_prefix_cache events under load through every fault (issue 23's
# proof): two decode emulators and one prefill emulator with prefix caching
# publish vLLM KV events (decode-0 in vLLM 0.26's map form with integer
# hashes and a replay endpoint, decode-1 in the older positional form with
# bytes hashes and no replay, prefill-0 as decode-0); the router-role
# kv_agent writes the prefix index; nginx (two workers) routes by it.  A
# load generator (t/inc/pfx_fault_load.py: 8 multi-turn sessions, long and
# short prompts, streamed and not) runs from the first fault to the last,
# while the test injects one after another:
#   a publisher restart (seq back to 0), dropped messages with replay
#   (decode-0) and without (decode-1), a garbage batch, a huge one (17 MiB,
#   over the agent's 16 MiB bound), one of 70000 events (over its 65536),
#   events of unknown types, a decoder killed and started again, the index
#   torn (garbage over its slots) and cut short under the running agent
#   (which restores it from memory: what was cached before stays cached),
#   the agent SIGKILLed mid-update, its file then cut to a few bytes and
#   overwritten with garbage, and the agent started again.
# Checked: every request got a complete, well-formed answer (200, a full
# SSE stream ending in [DONE] or a full chat.completion), except streams
# that were running on the killed decoder when it died (docs/dpd.md,
# failure table: "decoder fails after the header reached the client: the
# response ends there"); requests it had not answered yet go to the other
# decoder (dpd_decode_retry), so nothing else fails, and no 5xx at all;
# every answer's text is the emulator's reply for that prompt (each request
# asked again of a pod directly); after each fault the index comes back: a
# repeated conversation on the affected node gets cached tokens
# ($dpd_cached_tokens) again; no worker crashed, no alert.
use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/kv_agent";
use Test::Nginx::Socket;
use DPD::Emu;
use KvAgentTest;
use JSON::PP ();
use LWP::UserAgent ();
use HTTP::Request ();
use File::Temp ();
use POSIX ();
use Time::HiRes qw(sleep time);

my ($tj, $tc) = DPD::Emu->tokenizer_files('llama3');
plan(skip_all => 'Llama 3 tokenizer fixture not installed (make deps)')
    unless $tj && $tc;
plan(skip_all => 'build/kv_agent not built') unless -x kv_bin();
plan(skip_all => 'python3 without pyzmq: the emulator cannot publish')
    unless system("python3 -c 'import zmq' 2>/dev/null") == 0;
plan('no_plan');   # after the skip checks: a skip must not plan twice

$ENV{TEST_NGINX_LLAMA3} = $tj;

my $base = $ENV{DPD_TEST_PORT_BASE} || 18600;
our $HTTP = $base + 81;                   # every pod: 127.0.0.2 .. .4
our @EP = ($base + 82, $base + 84, $base + 86);   # PUB; replay = +1
our @HOST = ('127.0.0.2', '127.0.0.3', '127.0.0.4');
our @NODE = ('decode-0', 'decode-1', 'prefill-0');
$ENV{TEST_NGINX_HTTP} = $HTTP;

our $DIR = File::Temp::tempdir('dpd-pfxload-XXXXXX', TMPDIR => 1,
                               CLEANUP => !$ENV{PFX_KEEP});
our $IDX = "$DIR/prefix.idx";
$ENV{TEST_NGINX_IDX} = $IDX;
our $JSON = JSON::PP->new->canonical;
our $UA = LWP::UserAgent->new(timeout => 60, keep_alive => 0);
our (@EMU, $AGENT, $LOAD, $STOP, $OUT);
our @FAULT;                     # [name, t_start, t_end]
our $T_KILL;                    # when decode-1 was killed

sub emu {
    my ($i) = @_;
    my $replay = $i != 1;       # decode-1: no replay endpoint
    my $cfg = $JSON->encode({ enable_kv_cache_events => JSON::PP::true,
                              endpoint => "tcp://*:$EP[$i]",
                              $replay ? (replay_endpoint =>
                                         "tcp://*:" . ($EP[$i] + 1)) : (),
                              topic => "kv\@$NODE[$i]\@m" });
    return DPD::Emu->start(host => $HOST[$i], port => $HTTP,
        role => $i == 2 ? 'prefill' : 'decode', model => 'm',
        tokenizer => 'llama3', prefix_caching => 1,
        side_channel_port => $base + 90 + $i, no_lmcache => 1,
        kv_blocks => 32768, timeout => 30,
        args => ['--kv-events-config', $cfg,
                 '--kv-events-form', $i == 1 ? 'array' : 'map',
                 '--kv-events-hash', $i == 1 ? 'bytes' : 'int',
                 '--stats-keep', 16]);
}

sub agent {
    my $c = agent_config(id => "router-0", role => "router",
                         port => kv_port(940));
    $c->{kv_events} = [map {
        { node => $NODE[$_], http => "$HOST[$_]:$HTTP", model => "m",
          endpoint => "tcp://$HOST[$_]:$EP[$_]",
          $_ != 1 ? (replay => "tcp://$HOST[$_]:" . ($EP[$_] + 1)) : (),
          topic => "kv\@$NODE[$_]\@m" }
    } 0 .. 2];
    $c->{prefix_index} = { path => $IDX, slots => 65536 };
    my $a = start_agent($c, name => 'router-0');
    log_wait($a, qr/(?:subscribed to tcp(?s:.*)){3}/, 20)
        or die "the router agent did not subscribe: " . log_text($a);
    wait_for(10, sub { -s $IDX }) or die "no index file";
    chmod 0644, $IDX;
    return $a;
}

# the agent's whole log (every start appends to it) from byte $from on
sub alog {
    my ($from) = @_;
    open my $fh, '<', $AGENT->{log} or return '';
    local $/;
    my $t = <$fh> // '';
    return substr($t, $from // 0);
}
sub alog_mark { length alog(0) }

# one chat completion through nginx, not streamed: (status, decoder host,
# nginx's cached tokens, text)
sub chat {
    my ($msgs, $salt) = @_;
    my $req = HTTP::Request->new(POST => "http://127.0.0.1:"
                                 . Test::Nginx::Util::server_port()
                                 . "/v1/chat/completions");
    $req->content($JSON->encode({ model => 'm', messages => $msgs,
                                  max_tokens => 4, cache_salt => $salt }));
    my $res = $UA->request($req);
    my $b = eval { $JSON->decode($res->content) } // {};
    my $up = $res->header('X-Up') // '';
    $up =~ s/:\d+$//;
    $up =~ s/.*, //;            # a retried request: the last decoder
    return ($res->code, $up, $res->header('X-Cached') // 0,
            $b->{choices}[0]{message}{content});
}

sub words { my ($tag, $n) = @_; join ' ', map { "$tag$_" } 1 .. $n }

# The index works again (for $host when given): a new conversation (a salt
# of its own, so nothing earlier counts) gets cached tokens for its history
# on the decoder that served it.  Conversations that start elsewhere are
# left; polls until $secs have passed.
my $probe_n = 0;
sub recovered {
    my ($tag, $host, $secs) = @_;
    my ($ok, $how) = probe($tag, $host, $secs);
    return ($ok, $how);
}

# (ok, how, the conversation, its salt, its decoder)
sub probe {
    my ($tag, $host, $secs) = @_;
    my $end = time + ($secs // 25);
    my $why = 'no conversation reached it';
    while (time < $end) {
        my $salt = "probe-$tag-" . ++$probe_n;
        my @c = ({ role => 'system', content => words("p${probe_n}w", 320) },
                 { role => 'user', content => 'hello' });
        my ($s, $d) = chat(\@c, $salt);
        if ($s != 200) {
            $why = "first turn: status $s";
            next;
        }
        next if $host && $d ne $host;
        for my $t (1 .. 12) {
            last if time > $end;
            sleep 0.5;
            push @c, { role => 'assistant', content => 'ok' },
                     { role => 'user', content => "more $t" };
            my ($s2, $d2, $k2) = chat(\@c, $salt);
            $why = "turn $t: status $s2, decoder $d2, cached $k2";
            return (1, "turn $t on $d2: cached $k2", \@c, $salt, $d)
                if $s2 == 200 && $d2 eq $d && $k2 >= 256;
        }
    }
    return (0, $why);
}

sub fault {
    my ($name, $host, $do, $expect) = @_;
    my $mark = alog_mark();
    my $t0 = time;
    $do->();
    if ($expect) {
        my $ok = wait_for(15, sub { alog($mark) =~ $expect });
        ok $ok, "$name: the agent saw it" or diag(alog($mark));
    }
    my ($ok, $how) = recovered($name =~ s/\W+/-/gr, $host);
    ok $ok, "$name: the index came back ($how)";
    push @FAULT, [$name, $t0, time];
}

sub emu_post {
    my ($i, $spec) = @_;
    my $r = $UA->post($EMU[$i]->url('/emu/kv_events'),
                      Content => $JSON->encode($spec));
    die "emu $i /emu/kv_events: " . $r->status_line . " " . $r->content
        unless $r->is_success;
}

sub start_load {
    $STOP = "$DIR/stop";
    $OUT = "$DIR/load.jsonl";
    my @cmd = ('python3', "$FindBin::Bin/inc/pfx_fault_load.py",
               '--port', Test::Nginx::Util::server_port(),
               '--sessions', 8, '--stop-file', $STOP, '--out', $OUT,
               '--check', join(',', map { "$HOST[$_]:$HTTP" } 0, 1));
    $LOAD = fork();
    die "fork: $!" unless defined $LOAD;
    if ($LOAD == 0) {
        open STDOUT, '>', "$DIR/load.log";
        open STDERR, '>&', \*STDOUT;
        exec @cmd or POSIX::_exit(127);
    }
}

sub records {
    open my $fh, '<', $OUT or return ();
    my @r;
    while (<$fh>) { push @r, eval { $JSON->decode($_) } // { bad => $_ } }
    return @r;
}

sub file_write {               # in place: same inode, as a reader sees it
    my ($off, $data, $trunc) = @_;
    open my $fh, '+<', $IDX or die "$IDX: $!";
    binmode $fh;
    if (defined $data) {
        sysseek $fh, $off, 0;
        syswrite $fh, $data;
    }
    truncate $fh, $trunc if defined $trunc;
    close $fh;
}

sub garbage { join '', map { chr(int(rand(256))) } 1 .. $_[0] }

sub init_1 {
    srand(224);
    @EMU = map { emu($_) } 0 .. 2;
    $AGENT = agent();
    start_load();

    # the load is on: requests answered, the index feeding the routes
    ok wait_for(30, sub { grep { $_->{ok} } records() }),
       'the load generator gets answers';
    my ($ok, $how) = recovered('warm-up');
    ok $ok, "warm-up: cached tokens come back ($how)";

    fault('publisher restart (decode-0)', $HOST[0],
          sub { emu_post(0, { restart => JSON::PP::true }) },
          qr/decode-0: (?:publisher restarted|reconnected)/);
    fault('dropped messages, replayed (decode-0)', $HOST[0],
          sub { emu_post(0, { drop => 3 }) },
          qr/decode-0: replaying from seq/);
    fault('dropped messages, no replay (decode-1)', $HOST[1],
          sub { emu_post(1, { drop => 3 }) },
          qr/decode-1: messages lost at seq/);
    fault('a garbage batch (decode-1)', $HOST[1],
          sub { emu_post(1, { inject => 'garbage' }) },
          qr/decode-1: (?:seq \d+: |message dropped)/);
    fault('a huge batch (decode-0)', $HOST[0],
          sub { emu_post(0, { inject => 'huge' }) },
          qr/decode-0: (?:connection to \S+ lost|replaying|messages lost)/);
    fault('70000 events in one batch (decode-1)', $HOST[1],
          sub { emu_post(1, { inject => 'many' }) },
          qr/decode-1: seq \d+: .*more events/);
    fault('unknown event types (decode-0)', $HOST[0],
          sub { emu_post(0, { inject => 'unknown' }) });

    # a decoder leaves (killed: what it was streaming is cut, the rest
    # goes to the other one) and comes back as a new process
    fault('decode-1 killed and back', $HOST[1], sub {
        $T_KILL = time;
        kill 'KILL', $EMU[1]->pid;
        waitpid $EMU[1]->pid, 0;
        $EMU[1]{pid} = undef;
        sleep 3;                # under load without it
        $EMU[1] = emu(1);
    }, qr/decode-1: (?:connection to \S+ lost|publisher restarted)/);

    # the index torn and cut short under the running agent and nginx:
    # slots overwritten with garbage in place, then the file cut to its
    # header.  The agent keeps writing (its own copy of the header and
    # its map in memory); the next start writes a new file.
    fault('index torn under the agent', undef, sub {
        my $sz = -s $IDX;
        file_write(int($sz / 3), garbage(65536));
        sleep 1.5;
    });

    # cut to 100 bytes (inside the header) under the agent: its next store
    # past the end is SIGBUS; it restores the size and rewrites the file
    # from memory, so a conversation indexed before the cut is still
    # cached after it, without a new event for its blocks
    {
        my ($ok, $how, $c, $salt, $d) = probe('before-cut');
        ok $ok, "before the cut: a conversation cached on its decoder "
           . "($how)";
        my $mark = alog_mark();
        my $t0 = time;
        file_write(0, undef, 100);
        ok wait_for(15, sub { alog($mark) =~ /cut short under the agent/ }),
           'index cut short under the agent: rewritten'
           or diag(alog($mark));
        ok agent_alive($AGENT), '... the agent lives on';
        sleep 1.5;              # nginx looks at the header once a second
        push @$c, { role => 'assistant', content => 'ok' },
                  { role => 'user', content => 'after the cut' };
        # the same turn again until the rewritten index is read (a loaded
        # host can be late on the once-a-second look; nothing new is
        # indexed for $d meanwhile: only the rewrite can make it cached)
        my ($s2, $d2, $k2);
        my $until = time + 15;
        do {
            ($s2, $d2, $k2) = chat($c, $salt);
            select undef, undef, undef, 0.5
                unless $d2 eq $d && $k2 >= 256;
        } until ($d2 eq $d && $k2 >= 256) || time > $until;
        is $s2, 200, '... answered';
        ok $d2 eq $d && $k2 >= 256, "... the conversation indexed before "
           . "the cut still cached on $d (got $k2 on $d2)";
        push @FAULT, ['index cut short under the agent', $t0, time];
    }

    # the agent SIGKILLed while the load keeps events coming (mid-update),
    # its file then cut to a few bytes and overwritten with garbage under
    # nginx; the agent started again writes a fresh index (replaying what
    # decode-0 and prefill-0 still buffer)
    fault('agent killed, index shrunk and torn, agent back', undef, sub {
        die "the agent is gone already" unless agent_alive($AGENT);
        kill 'KILL', $AGENT->{pid};
        waitpid $AGENT->{pid}, 0;
        $AGENT->{pid} = 0;
        sleep 1.5;
        file_write(0, undef, 100);
        sleep 1.5;
        file_write(0, garbage(200000));
        sleep 1.5;
        $AGENT = agent();
    });

    # the load ends; its verdict
    open my $s, '>', $STOP or die;
    close $s;
    my $t_stop = time;
    my $end = time + 120;
    while (time < $end && waitpid($LOAD, POSIX::WNOHANG()) == 0) {
        sleep 0.2;
    }
    diag(sprintf "the load's last answers and the check of every answer "
         . "took %.1f s", time - $t_stop);
    is $?, 0, 'the load generator finished';
    my @r = records();
    my ($chk) = grep { exists $_->{check} } @r;
    @r = grep { exists $_->{sess} } @r;
    my @ok = grep { $_->{ok} } @r;
    my @bad = grep { !$_->{ok} } @r;
    my $k1 = "$HOST[1]:$HTTP";
    my @cut = grep {
        $_->{stream} && $_->{status} == 200 && ($_->{up} // '') =~ /\Q$k1\E$/
        && $_->{t0} <= $T_KILL && $_->{t1} >= $T_KILL - 1
        && ($_->{why} // '') =~ /IncompleteRead|no \[DONE\]|RemoteDisc/
    } @bad;
    my %cut = map { ("$_->{sess}.$_->{conv}.$_->{turn}" => 1) } @cut;
    my @lost = grep { !$cut{"$_->{sess}.$_->{conv}.$_->{turn}"} } @bad;
    my $streamed = grep { $_->{stream} } @ok;
    my $cached = grep { ($_->{cached} // 0) > 0 } @ok;
    my %routes;
    $routes{$_->{route} // '-'}++ for @ok;
    diag(sprintf "load: %d requests, %d ok (%d streamed, %d with cached "
         . "tokens; routes %s), %d cut by the decoder's kill, over %.0f s",
         scalar @r, scalar @ok, $streamed, $cached,
         join(' ', map { "$_=$routes{$_}" } sort keys %routes),
         scalar @cut, $r[-1]{t1} - $r[0]{t0}) if @r;
    ok @r >= 100, 'the load went on (' . scalar(@r) . ' requests)';
    is scalar(@lost), 0, 'every request answered completely (but streams '
       . 'cut by the decoder\'s kill: ' . scalar(@cut) . ')'
       or diag($JSON->encode([@lost[0 .. ($#lost > 4 ? 4 : $#lost)]]));
    ok @cut <= 8, '... at most one stream per session cut there';
    ok $streamed > 20 && @ok - $streamed > 20, '... streamed and not';
    ok $cached > 20, '... many routed to a decoder holding their history';
    for my $f (@FAULT) {
        my $n = grep { $_->{t1} >= $f->[1] && $_->{t1} <= $f->[2] } @ok;
        ok $n > 0, "$f->[0]: $n load requests answered meanwhile";
    }
    ok $chk, 'the answers were checked against the pods';
    is $chk->{mismatches}, 0, "every answer's text is the pod's reply for "
       . "its prompt ($chk->{check} checked)"
       or diag($JSON->encode($chk->{mismatch}));
    is $chk->{unchecked}, 0, '... none left unchecked';

    my $err = do {
        local $/;
        open my $fh, '<', Test::Nginx::Util::server_root()
                          . '/logs/error.log' or die;
        <$fh>;
    };
    unlike $err, qr/exited on signal|\[(?:alert|emerg|crit)\]/,
           'no worker crashed, no alert';
    like $err, qr/dpd prefix index .*routing as if nothing were cached/,
         'nginx saw the bad index (and said so)';
    ok agent_alive($AGENT), 'the agent is running';
    $_->stop for grep { $_->pid } @EMU;
}

add_block_preprocessor(sub {
    my $block = shift;

    $block->set_value('request', "GET /ok");
    $block->set_value('response_body', "ok\n");
    $block->set_value('timeout', 300);
    $block->set_value('http_config', <<'_EOC_');
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    upstream decode {
        dpd_balance;
        zone decode 64k;
        server 127.0.0.2:$TEST_NGINX_HTTP max_fails=1 fail_timeout=2s;
        server 127.0.0.3:$TEST_NGINX_HTTP max_fails=1 fail_timeout=2s;
        keepalive 16;
    }
    upstream prefill {
        dpd_balance;
        zone prefill 64k;
        server 127.0.0.4:$TEST_NGINX_HTTP;
        keepalive 16;
    }
_EOC_
    $block->set_value('config', <<'_EOC_');
    client_body_buffer_size 1m;
    location /v1/ {
        dpd on;
        dpd_threshold 512;
        dpd_prefill_pass /_dpd_prefill;
        dpd_decode_upstream decode;
        dpd_prefix_cache events file=$TEST_NGINX_IDX prefill=prefill;
        add_header X-Cached $dpd_cached_tokens always;
        add_header X-Route $dpd_route always;
        add_header X-Up $upstream_addr always;
        proxy_read_timeout 60s;
        proxy_pass http://decode;
    }
    location /_dpd_prefill/ {
        internal;
        subrequest_output_buffer_size 64k;
        proxy_pass http://prefill/;
    }
    location = /ok { return 200 "ok\n"; }
_EOC_
});

master_on();
workers(2);
no_shuffle();
log_level('info');
run_tests();

__DATA__

=== TEST 1: under load, through every fault of the KV-event stream, the index file, a decoder and the agent, every request is answered
--- init
main::init_1();
--- no_error_log
[alert]
[emerg]
exited on signal
