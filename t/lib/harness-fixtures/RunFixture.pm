package RunFixture;

# Runs a harness fixture (*.tfix, kept out of prove's t/**/*.t glob) in a
# child perl with the same Test::Nginx::Socket the caller would get, and
# returns its combined TAP/diagnostic output and exit status.

use strict;
use warnings;

use Cwd ();
use File::Basename qw(dirname);
use File::Spec ();

use base 'Exporter';
our @EXPORT = qw(run_fixture harness_inc);

sub harness_inc {
    for my $dir (@INC) {
        next if ref $dir;
        return Cwd::abs_path($dir) if -f "$dir/Test/Nginx/Socket.pm";
    }
    # t/lib next to this file's directory
    return Cwd::abs_path(dirname(__FILE__) . '/..');
}

# run_fixture($name, %env) -> ($output, $exit_code)
sub run_fixture {
    my ($name, %env) = @_;
    my $file = File::Spec->catfile(dirname(__FILE__), $name);
    my $inc = harness_inc();
    my $limit = delete $env{_timeout} // 120;

    local %ENV = %ENV;
    for my $k (keys %env) {
        if (defined $env{$k}) { $ENV{$k} = $env{$k} } else { delete $ENV{$k} }
    }
    delete $ENV{HARNESS_ACTIVE};    # the child is not under prove

    my $pid = open(my $out, '-|');
    die "fork: $!" unless defined $pid;
    if ($pid == 0) {
        open STDERR, '>&', \*STDOUT;
        exec 'timeout', $limit, $^X, "-I$inc", $file
            or die "exec: $!";
    }
    local $/;
    my $text = <$out> // '';
    close $out;
    return ($text, $? >> 8);
}

1;
