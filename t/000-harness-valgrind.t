# TEST_NGINX_USE_VALGRIND=1: a clean block passes under memcheck, and a
# report (here: stock nginx's process-lifetime allocations, shown because
# the suppression file is replaced by an empty one) fails the block.
use strict;
use warnings;
use Cwd ();
use FindBin;
use lib "$FindBin::Bin/lib/harness-fixtures";
use RunFixture;
use Test::More;

plan skip_all => 'valgrind is not installed'
    unless grep { -x "$_/valgrind" } split /:/, $ENV{PATH};

my ($out, $rc) = run_fixture('valgrind.tfix',
                             TEST_NGINX_USE_VALGRIND => 1,
                             TEST_NGINX_VALGRIND_SUPPRESS => undef,
                             _timeout => 180);
is($rc, 0, 'clean block passes under valgrind') or diag $out;
like($out, qr/^ok \d+ .* response_body/m, 'the request was answered');
unlike($out, qr/^not ok/m, 'no failure reported');

use File::Temp ();
my $tmp = File::Temp->new(SUFFIX => '.supp');
my $empty = $tmp->filename;
($out, $rc) = run_fixture('valgrind.tfix',
                          TEST_NGINX_USE_VALGRIND => 1,
                          TEST_NGINX_VALGRIND_SUPPRESS => $empty,
                          _timeout => 180);
# failing the block is the clean-room harness's own (t/lib/README.md);
# the real Test::Nginx only shows the report
SKIP: {
    skip 'the real Test::Nginx does not fail a block on a valgrind report', 2
        unless Cwd::abs_path(harness_inc()) eq Cwd::abs_path("$FindBin::Bin/lib");
    isnt($rc, 0, 'a valgrind report fails the test file');
    like($out, qr/^not ok \d+ .*valgrind reported \d+ error/m,
         'the block is reported not ok');
}
like($out, qr/definitely lost/, 'the report is shown');

done_testing();
