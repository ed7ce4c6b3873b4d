# dpd_prefix_cache events end to end (issue 23): two decode emulators with
# prefix caching publish vLLM KV events (one in vLLM 0.26's map form with
# integer hashes, one in the older positional form with bytes hashes); the
# router-role kv_agent subscribes ("kv_events") and writes the prefix index
# ("prefix_index"); nginx routes by it.  Checked: a conversation's next turn
# goes to the decoder that holds its history, with $dpd_cached_tokens equal
# to the full blocks the engine itself reports cached (usage
# prompt_tokens_details.cached_tokens) or more; cache_salt isolates; the
# engine's reset (AllBlocksCleared) and a publisher restart (seq back to 0)
# clear that node; a killed agent leaves nginx answering every request,
# cache-blind once its heartbeat is older than stale=, and a new agent's
# index is used again.
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
our $HTTP = $base + 61;                # both emulators, 127.0.0.2 and .3
our @EP = ($base + 62, $base + 64);    # publisher; replay = +1
$ENV{TEST_NGINX_HTTP} = $HTTP;

our $DIR = File::Temp::tempdir('dpd-pfxagent-XXXXXX', TMPDIR => 1,
                               CLEANUP => 1);
our $IDX = "$DIR/prefix.idx";
$ENV{TEST_NGINX_IDX} = $IDX;
our $JSON = JSON::PP->new->canonical;
our $UA = LWP::UserAgent->new(timeout => 60, keep_alive => 0);
our (@EMU, $AGENT);

sub emu {
    my ($i, $form, $hash) = @_;
    my $h = "127.0.0." . (2 + $i);
    my $cfg = $JSON->encode({ enable_kv_cache_events => JSON::PP::true,
                              # vLLM binds when the endpoint has a
                              # wildcard, else it connects
                              endpoint => "tcp://*:$EP[$i]",
                              replay_endpoint => "tcp://*:" . ($EP[$i] + 1),
                              topic => "kv\@d$i\@m" });
    return DPD::Emu->start(host => $h, port => $HTTP, role => 'decode',
        model => 'm', tokenizer => 'llama3', prefix_caching => 1,
        side_channel_port => $base + 70 + $i, no_lmcache => 1,
        kv_blocks => 4096,
        args => ['--kv-events-config', $cfg, '--kv-events-form', $form,
                 '--kv-events-hash', $hash]);
}

sub agent {
    my $c = agent_config(id => "router-0", role => "router",
                         port => kv_port(930));
    $c->{kv_events} = [map {
        my $h = "127.0.0." . (2 + $_);
        { node => "decode-$_", http => "$h:$HTTP", model => "m",
          endpoint => "tcp://$h:$EP[$_]",
          replay => "tcp://$h:" . ($EP[$_] + 1), topic => "kv\@d$_\@m" }
    } 0, 1];
    $c->{prefix_index} = { path => $IDX, slots => 65536 };
    $c->{log_level} = "debug" if $ENV{PFX_DEBUG};
    return start_agent($c);
}

sub start_all {
    @EMU = (emu(0, 'map', 'int'), emu(1, 'array', 'bytes'));
    $AGENT = agent();
    # subscribed (a slow joiner misses nothing: it replays from 0)
    log_wait($AGENT, qr/subscribed to tcp.*\n(?s:.*)subscribed to tcp/, 10)
        or die "the router agent did not subscribe: " . log_text($AGENT);
}

# one chat completion through nginx: (status, decoder host, nginx's
# cached tokens, the engine's cached tokens)
sub chat {
    my ($msgs, %o) = @_;
    my $req = HTTP::Request->new(POST => "http://127.0.0.1:"
                                 . Test::Nginx::Util::server_port()
                                 . "/v1/chat/completions");
    $req->content($JSON->encode({ model => 'm', messages => $msgs,
                                  max_tokens => 4,
                                  $o{salt} ? (cache_salt => $o{salt}) : ()
                                }));
    my $res;
    for (1 .. 50) {
        $res = $UA->request($req);
        last unless $res->code == 500
                    && ($res->header('Client-Warning') // '') eq
                       'Internal response';
        sleep 0.2;
    }
    my $b = eval { $JSON->decode($res->content) } // {};
    my $up = $res->header('X-Up') // '';
    $up =~ s/:\d+$//;
    return ($res->code, $up, $res->header('X-Cached'),
            $b->{usage}{prompt_tokens_details}{cached_tokens} // 0);
}

sub words { my ($tag, $n) = @_; join ' ', map { "$tag$_" } 1 .. $n }

# the events reach the agent, the index, then nginx's once-a-second look
sub settle { sleep 1.5 }

sub init_1 {
    start_all();

    my @conv = ({ role => 'system', content => words('sys', 200) },
                { role => 'user', content => words('q', 150) });
    my ($c, $d, $k, $e) = chat(\@conv);
    is $c, 200, 'turn 1 answered';
    is $k, 0, 'turn 1: nothing cached anywhere';
    settle();

    push @conv, { role => 'assistant', content => 'ok' },
                { role => 'user', content => words('r', 40) };
    my ($c2, $d2, $k2, $e2) = chat(\@conv);
    is $c2, 200, "turn 2 answered";
    diag(log_text($AGENT)) if $ENV{PFX_DEBUG};
    is $d2, $d, "turn 2 went to turn 1's decoder ($d)";
    ok $k2 >= 256, "turn 2: nginx saw $k2 tokens cached there";
    is $k2 % 16, 0, '... whole blocks';
    ok $e2 > 0 && $k2 >= $e2 - 16 && $k2 <= $e2 + 16,
       "... as many as the engine reports cached ($e2, within a block)";

    # more conversations: each follows its own decoder, on both decoders
    # (the map/int and the positional/bytes publishers alike).  A salt of
    # their own: unsalted chats share the template's first block, which
    # rightly draws every new chat to the decoder holding it.
    my (%used, @other, @convs, @first);
    for my $n (1 .. 4) {       # first turns back to back: equal costs
        my @o = ({ role => 'user', content => words("x${n}y", 300) });
        my ($c3, $d3) = chat(\@o, salt => "conv$n");
        push @convs, \@o;
        push @first, $d3;
        $used{$d3}++;
    }
    settle();
    for my $n (1 .. 4) {
        my @o = @{ $convs[$n - 1] };
        push @o, { role => 'assistant', content => 'ok' },
                 { role => 'user', content => 'and?' };
        my ($c4, $d4, $k4, $e4) = chat(\@o, salt => "conv$n");
        is $d4, $first[$n - 1],
           "conversation $n follows its decoder ($first[$n - 1])";
        ok $k4 >= 256 && $k4 == $e4,
           "... cached $k4, the engine says $e4";
        @other = @o;
    }
    is scalar(keys %used), 2, 'both decoders served first turns: '
       . join(', ', map { "$_ x$used{$_}" } sort keys %used);

    # cache_salt isolates: the same chat with a salt starts cold
    my ($c5, $d5, $k5) = chat(\@conv, salt => 'tenant-b');
    is $c5, 200, 'salted chat answered';
    is $k5, 0, 'a cache_salt sees nothing of the unsalted history';
    settle();
    my ($c6, $d6, $k6) = chat(\@conv, salt => 'tenant-b');
    is $d6, $d5, 'the salted chat follows its own blocks';
    ok $k6 >= 256, "... cached $k6 under its salt";

    # the engine drops its cache (AllBlocksCleared): that node forgets
    my ($emu) = grep { $_->host eq $d } @EMU;
    my $r = $UA->post($emu->url('/reset_prefix_cache'));
    ok $r->is_success, 'engine cache reset';
    settle();
    my ($c7, $d7, $k7) = chat([@conv[0 .. 1]]);
    is $k7, 0, 'after the reset: nothing cached for it';

    # a publisher restart (seq back to 0): cleared, then rebuilt
    settle();
    my ($c8, $d8) = chat(\@other, salt => 'conv4');
    settle();
    my ($emu2) = grep { $_->host eq $d8 } @EMU;
    $UA->post($emu2->url('/emu/kv_events'), Content => '{"restart":true}');
    sleep 0.5;
    # the restart keeps the engine's blocks but not the stream: the agent
    # cannot know what the new process holds until it says so
    my ($c9, $d9) = chat([@other, { role => 'assistant', content => 'ok' },
                          { role => 'user', content => words('z', 60) }],
                         salt => 'conv4');
    is $d9, $d8, 'after a publisher restart: its conversation still '
       . 'goes there (the index still held it)';
    settle();
    like log_text($AGENT),
         qr/prefix index: node decode-\d cleared \((restart|reconnect)\)/,
         '... and the agent cleared that node (seq went back)';
    my ($c10, $d10, $k10) = chat(\@other, salt => 'conv4');
    is $c10, 200, 'after the clear: answered';
    is $k10, 0, '... nothing of the old stream counted as cached';

    # a conversation cached on a decoder, the index says so
    my @live = ({ role => 'user', content => words('live', 300) });
    my ($c12, $d12) = chat(\@live, salt => 'live');
    settle();
    push @live, { role => 'assistant', content => 'ok' },
                { role => 'user', content => 'more?' };
    my ($c13, $d13, $k13) = chat(\@live, salt => 'live');
    ok $k13 >= 256, "before the kill: $k13 tokens cached on $d13";

    # the agent killed: the index stays as it was, nginx answers
    if ($ENV{KV_TEST_VALGRIND}) {      # a clean exit, then memcheck's verdict
        stop_agent($AGENT);
        like log_text($AGENT), qr/prefix index: \d+ blocks indexed/,
             "the agent's index counters at exit";
    }
    kill 'KILL', $AGENT->{pid};
    waitpid $AGENT->{pid}, 0;
    my ($c11) = chat(\@conv);
    is $c11, 200, 'agent killed: answered';
    # its heartbeat stops: after stale= (3s) and nginx's next look at the
    # file, the index counts nothing (the engines go on evicting and
    # storing without it following)
    sleep 4.5;
    my ($c14, $d14, $k14) = chat(\@live, salt => 'live');
    is $c14, 200, 'agent dead past stale=: answered';
    is $k14, 0, '... cache-blind: $dpd_cached_tokens 0';

    # a new agent: a new file, used again (what it hears from now on)
    $AGENT = agent();
    log_wait($AGENT, qr/subscribed to tcp.*\n(?s:.*)subscribed to tcp/, 10)
        or die "the router agent did not subscribe: " . log_text($AGENT);
    my @again = ({ role => 'user', content => words('again', 300) });
    my ($c15, $d15) = chat(\@again, salt => 'again');
    settle();
    push @again, { role => 'assistant', content => 'ok' },
                 { role => 'user', content => 'and?' };
    my ($c16, $d16, $k16) = chat(\@again, salt => 'again');
    is $d16, $d15, 'agent restarted: the next turn follows its decoder';
    ok $k16 >= 256, "... $k16 tokens cached by the new agent's index";
    stop_agent($AGENT);

    $_->stop for @EMU;
}

add_block_preprocessor(sub {
    my $block = shift;

    $block->set_value('request', "GET /ok");
    $block->set_value('response_body', "ok\n");
    $block->set_value('timeout', 120);
    $block->set_value('http_config', <<'_EOC_');
    dpd_tokenizer $TEST_NGINX_LLAMA3;
    upstream pool {
        dpd_balance;
        zone pool 64k;
        server 127.0.0.2:$TEST_NGINX_HTTP;
        server 127.0.0.3:$TEST_NGINX_HTTP;
    }
_EOC_
    $block->set_value('config', <<'_EOC_');
    client_body_buffer_size 1m;
    location /v1/ {
        dpd on;
        dpd_threshold 1000000;
        dpd_decode_upstream pool;
        dpd_prefix_cache events file=$TEST_NGINX_IDX stale=3s;
        add_header X-Cached $dpd_cached_tokens always;
        add_header X-Up $upstream_addr always;
        proxy_pass http://pool;
    }
    location = /ok { return 200 "ok\n"; }
_EOC_
});

no_shuffle();
log_level('info');
run_tests();

__DATA__

=== TEST 1: the router agent's index from live KV events routes each turn to the decoder holding its history
--- init
main::init_1();
--- no_error_log
[alert]
[emerg]
--- error_log
: stale: routing as if nothing were cached
usable again
