# DPD::Emu (t/inc/DPD/Emu.pm): instances go away when the test dies or is
# killed; start-up failures are reported with the emulator's reason.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/../inc";
use Test::More;
use Time::HiRes qw(sleep time);
use DPD::Emu;

my $base = ($ENV{DPD_EMU_PORT} || 19000) + 9;
my $inc = "$FindBin::Bin/../inc";
my %ports = (port => $base, side_channel_port => $base + 100,
             lmcache_init_port => $base + 200,
             lmcache_alloc_port => $base + 300);
my $pstr = join ', ', map { "$_ => $ports{$_}" } sort keys %ports;

sub gone {
    my ($pid, $within) = @_;
    my $deadline = time + $within;
    while (time < $deadline) {
        return 1 unless kill 0, $pid;
        sleep 0.05;
    }
    return 0;
}

# a test script that starts an instance and then dies
{
    my $out = `$^X -I$inc -MDPD::Emu -e 'my \$e = DPD::Emu->start(host => "127.0.0.2", $pstr); print \$e->pid, "\\n"; die "boom\\n"' 2>&1`;
    my ($pid) = $out =~ /^(\d+)$/m;
    ok $pid, 'child test started an instance';
    ok $pid && gone($pid, 1), 'instance stopped at END after die';
}

# a test script killed outright: the emulator follows its parent
{
    pipe my $r, my $w or die;
    my $child = fork // die;
    if (!$child) {
        close $r;
        my $e = DPD::Emu->start(host => '127.0.0.2', %ports);
        syswrite $w, $e->pid . "\n";
        sleep 30;
        exit 0;
    }
    close $w;
    my $pid = <$r>;
    chomp $pid;
    ok $pid, 'instance started in a child';
    kill 'KILL', $child;
    waitpid $child, 0;
    ok gone($pid, 3), 'instance exits when its test process is SIGKILLed';
}

# port clash: a clear error, nothing left behind
{
    my $a = DPD::Emu->start(host => '127.0.0.2', %ports);
    my $ok = eval { DPD::Emu->start(host => '127.0.0.2', %ports); 1 };
    ok !$ok, 'second instance on the same address and port fails';
    like $@, qr/exited at start.*cannot listen on 127\.0\.0\.2:$base/s,
        'error names the address and the reason';
    is $a->get('/health')->code, 200, 'first instance unaffected';
    my $pid = $a->pid;
    $a->stop;
    ok !kill(0, $pid), 'stop() reaps the process';
    is $a->pid, undef, 'pid cleared after stop';
}

# same port on other addresses works; accessors
{
    my @e = DPD::Emu->start_many(count => 3, first => 2, %ports, role => 'decode');
    is_deeply [map { $_->host } @e], [qw(127.0.0.2 127.0.0.3 127.0.0.4)],
        'start_many on consecutive loopback addresses';
    is_deeply [map { $_->port } @e], [($base) x 3], 'sharing one port';
    is $e[1]->addr, "127.0.0.3:$base", 'addr';
    is $e[1]->url('/health'), "http://127.0.0.3:$base/health", 'url';
    is $e[0]->lmcache_alloc_port, $base + 300, 'lmcache port reported';
    like $e[0]->engine_id, qr/^emu-127\.0\.0\.2-/, 'engine id reported';
    my $r = DPD::Emu::http_raw(host => '127.0.0.3', port => $base,
                               path => '/health');
    is $r->{status}, 200, 'http_raw';
    DPD::Emu->stop_all;
    ok !(grep { defined $_->pid } @e), 'stop_all';
}

done_testing;
