#!/usr/bin/perl
# Runs one test file (the arguments: perl's switches and the file, as
# prove hands them to --exec) and, when DPD_TEST_TIMES names a file,
# appends "<wall s> <cpu s> <file>" to it: the wall time and the CPU time
# of every process the test started.  A subreaper (prctl) collects the
# daemons the tests start (nginx, emulators, agents), whose CPU would
# otherwise go to init; tools/run-tests.sh orders the next run by these
# numbers (t/durations.txt, `make test-durations`).
use strict;
use warnings;
use Fcntl qw(:flock);
use POSIX qw(WNOHANG);
use Time::HiRes qw(sleep time);

my $file = $ARGV[-1];
my $out = $ENV{DPD_TEST_TIMES};

# PR_SET_CHILD_SUBREAPER (36); SYS_prctl is 157 on x86_64, 167 on
# aarch64.  Failing it only loses the daemons' share of the CPU time.
if ($out) {
    my %prctl = (x86_64 => 157, aarch64 => 167);
    my ($arch) = (POSIX::uname())[4];
    syscall($prctl{$arch}, 36, 1, 0, 0, 0) if $prctl{$arch};
}

# DPD_TEST_SLOTS=N: one of N slots (lock files in DPD_TEST_SLOT_DIR) is
# held while the file runs, so runs side by side (CI's stages) share N
# files at a time between them.  The lock's descriptor is close-on-exec:
# a daemon the test leaves behind does not keep the slot.
my $slot;
if (my $n = $ENV{DPD_TEST_SLOTS}) {
    my $dir = $ENV{DPD_TEST_SLOT_DIR} or die "test-timed: DPD_TEST_SLOT_DIR\n";
    SLOT: while (1) {
        for my $i (1 .. $n) {
            open my $fh, '>>', "$dir/slot.$i"
                or die "test-timed: $dir/slot.$i: $!\n";
            if (flock $fh, LOCK_EX | LOCK_NB) {
                $slot = $fh;
                last SLOT;
            }
            close $fh;
        }
        sleep 0.1 + rand 0.1;
    }
}

my $t0 = time;
my $pid = fork() // die "test-timed: fork: $!\n";
if ($pid == 0) {
    exec $^X, @ARGV or die "test-timed: exec $^X: $!\n";
}
# the test's own exit status decides; reparented daemons that already
# ended are collected without waiting for the ones still running
my $status;
while (1) {
    my $w = waitpid(-1, 0);
    last if $w < 0;
    if ($w == $pid) {
        $status = $?;
        last;
    }
}
1 while waitpid(-1, WNOHANG) > 0;

if ($out) {
    my (undef, undef, $cu, $cs) = times;
    if (open my $fh, '>>', $out) {
        syswrite $fh, sprintf("%.1f %.1f %s\n", time - $t0, $cu + $cs, $file);
        close $fh;
    }
}
exit($status >> 8) unless $status & 127;
kill $status & 127, $$;
exit 128 + ($status & 127);
