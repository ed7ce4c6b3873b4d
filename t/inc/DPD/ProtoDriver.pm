package DPD::ProtoDriver;

# Build and run a small C driver around ngx_dpd_module/ngx_http_dpd_protocol.c
# alone (no nginx), for the wire-transform tests t/201 and t/401.  See the
# POD at the end of the file.

use strict;
use warnings;

use Carp qw(croak);
use File::Temp qw(tempdir);
use IPC::Open3 qw(open3);

use DPD::Emu;

our $VERSION = '1.0';

# what every driver starts with: the protocol header and slurp(), all of
# stdin in one malloc'd buffer
our $PREAMBLE = <<'_C_';
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ngx_http_dpd_protocol.h"

static char *slurp(size_t *n)
{
    size_t cap = 1 << 16, len = 0, r;
    char *buf = malloc(cap);
    while (buf && (r = fread(buf + len, 1, cap - len, stdin)) > 0) {
        len += r;
        if (len == cap) { cap *= 2; buf = realloc(buf, cap); }
    }
    *n = len;
    return buf;
}

/* the request as the module parses it (default caps); NULL when refused,
 * after printing "REFUSED <reason>\t<message>\n" */
static ngx_http_dpd_req_t  dpd_req;

static ngx_http_dpd_req_t *parse_req(const char *in, size_t n)
{
    ngx_http_dpd_limits_t  lim = { 64, 524288 };

    if (ngx_http_dpd_proto_parse_request(&dpd_req, in, n, &lim) != 0) {
        printf("REFUSED %d\t%s\n", dpd_req.bad, dpd_req.why);
        ngx_http_dpd_proto_release(&dpd_req);
        return NULL;
    }
    return &dpd_req;
}

_C_

# () when a driver can be built here, else the reason (for skip_all)
sub unavailable {
    return -f '/usr/include/cjson/cJSON.h' ? ()
        : 'cJSON headers not installed (apt-get install libcjson-dev)';
}

# build(tmp => 'dpd-proto', main => $c_text): writes driver.c (the preamble,
# then $c_text) to a temporary dir and compiles it with $CC (default cc)
# against ngx_http_dpd_protocol.c, ngx_http_dpd_json.c and libcjson; the
# caller tests status.
sub build {
    my ($class, %o) = @_;
    my $root = DPD::Emu::root();
    my $src = "$root/ngx_dpd_module/ngx_http_dpd_protocol.c "
            . "$root/ngx_dpd_module/ngx_http_dpd_json.c";
    my $cc = $ENV{CC} || 'cc';
    my $dir = tempdir(($o{tmp} || 'dpd-proto') . '-XXXXXX', TMPDIR => 1,
                      CLEANUP => 1);
    my $driver = "$dir/driver.c";
    open my $fh, '>', $driver or croak "$driver: $!";
    print $fh $PREAMBLE, $o{main} // croak 'DPD::ProtoDriver: main';
    close $fh;
    my $bin = "$dir/driver";
    my $flags = "-std=c11 -Wall -Wextra -Werror -O1 -g -I$root/ngx_dpd_module";
    my $out = `$cc $flags $driver $src -o $bin -lcjson -lm 2>&1`;
    return bless {dir => $dir, bin => $bin, status => $?, output => $out},
                 $class;
}

sub dir { $_[0]{dir} }
sub bin { $_[0]{bin} }
sub status { $_[0]{status} }      # the compiler's $?
sub output { $_[0]{output} }      # its messages

# run($input, @args) -> ($stdout_and_stderr, $?) of the driver;
# run_under([@wrapper], $input, @args): e.g. [valgrind, -q, ...]
sub run {
    my ($self, $input, @args) = @_;
    return $self->run_under([], $input, @args);
}

sub run_under {
    my ($self, $wrap, $input, @args) = @_;
    my $pid = open3(my $w, my $r, undef, @$wrap, $self->{bin}, @args);
    print $w $input;
    close $w;
    local $/;
    my $out = <$r>;
    waitpid $pid, 0;
    return ($out, $?);
}

1;

__END__

=head1 NAME

DPD::ProtoDriver - compile and run a C driver of
ngx_dpd_module/ngx_http_dpd_protocol.c (no nginx)

=head1 SYNOPSIS

    use Test::More;
    use DPD::ProtoDriver;

    plan skip_all => $_ for DPD::ProtoDriver->unavailable;
    my $drv = DPD::ProtoDriver->build(tmp => 'dpd-proto', main => <<'_C_');
    int main(int argc, char **argv) { size_t n; char *in = slurp(&n); ... }
    _C_
    is $drv->status, 0, 'driver builds' or diag $drv->output;
    my ($out, $status) = $drv->run('{"a":1}', 'reply', 'nixl');

=head1 DESCRIPTION

The driver source is C<$DPD::ProtoDriver::PREAMBLE> (stdio, stdlib,
string, ngx_http_dpd_protocol.h, C<static char *slurp(size_t *n)>,
which reads all of stdin, and C<parse_req(in, n)>, which parses a request
body as the module does, with the default caps, or prints
C<REFUSED reason\tmessage> and returns NULL) followed by the test's
C<main>.  It is compiled
with C<$CC -std=c11 -Wall -Wextra -Werror -O1 -g> together with
ngx_http_dpd_protocol.c and linked with -lcjson -lm.  C<run> and
C<run_under> feed C<$input> on stdin and return the driver's stdout and
stderr together, and its exit status (C<$?>).

=cut
