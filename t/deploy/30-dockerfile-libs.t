# Every shared library a shipped binary links directly (its ELF NEEDED
# entries, as built on this Debian 12 host) comes from a package the
# image installs: the runtime package in the Dockerfile's last stage, its
# -dev package in the build stage.  A library added to the link line but
# not to the Dockerfile (as libzmq/libmsgpack for lmcache_notify once
# were) fails here, not in `make image` or at the pod's first start.
# The C runtime (libc6 and the compiler's runtime libraries: in every
# base, their -dev side from build-essential), packages of priority
# required, and the CUDA toolkit's libraries (copied from the mounted
# toolkit) are not packages to install.
use strict;
use warnings;

use FindBin;
use Test::More;
use Cwd qw(realpath);

my $root = realpath("$FindBin::Bin/../..");
my $build = $ENV{DPD_BUILD} || "$root/build";

plan skip_all => "readelf/dpkg not available here"
    unless `sh -c "command -v readelf && command -v dpkg-query"`;

sub slurp {
    open my $in, '<', $_[0] or die "$_[0]: $!\n";
    local $/;
    return scalar <$in>;
}

# apt-get install lists of each stage of a Dockerfile, in order
sub stage_packages {
    my ($file) = @_;
    my $text = slurp($file);
    $text =~ s/\\\n/ /g;
    my @stages;
    for my $line (split /\n/, $text) {
        push @stages, {} if $line =~ /^\s*FROM\s/i;
        next unless @stages && $line =~ /apt-get install(.*)/;
        my $args = $1;
        $args =~ s/&&.*//;
        $stages[-1]{$_} = 1 for grep { !/^-/ } split ' ', $args;
    }
    return @stages;
}

sub owner {
    my ($path) = @_;
    for my $p ($path, realpath($path) // $path) {
        for my $q ($p, $p =~ s{^/usr/lib/}{/lib/}r, $p =~ s{^/lib/}{/usr/lib/}r) {
            my $o = `dpkg-query -S '$q' 2>/dev/null`;
            return $1 if $o =~ /^([^:\s]+)(?::\w+)?:/;
        }
    }
    return undef;
}

sub priority {
    my $p = `dpkg-query -W -f='\${Priority}' '$_[0]' 2>/dev/null`;
    return $p;
}

# NEEDED libraries of a binary, resolved through ldd
sub needed {
    my ($bin) = @_;
    my %where;
    for (`ldd '$bin' 2>/dev/null`) {
        $where{$1} = $2 if /^\s*(\S+) => (\S+)/;
    }
    my @libs;
    for (`readelf -d '$bin' 2>/dev/null`) {
        push @libs, [$1, $where{$1}] if /\(NEEDED\).*\[(.+)\]/;
    }
    return @libs;
}

my %crt = map { $_ => 1 } qw(libc6 libgcc-s1 libstdc++6 libatomic1);

my %checks = (
    "docker/Dockerfile.kv_agent" => ["kv_agent", "kv_agent_ctl"],
    "docker/Dockerfile.gateway"  => ["ngx_http_dpd_module.so", "dpd-tokenize"],
);

for my $df (sort keys %checks) {
    my @stages = stage_packages("$root/$df");
    ok(@stages >= 2, "$df: a build stage and a runtime stage")
        or next;
    my ($build_pk, $run_pk) = ($stages[0], $stages[-1]);
    for my $b (@{ $checks{$df} }) {
        my $bin = "$build/$b";
        SKIP: {
            skip "$bin not built", 1 unless -e $bin;
            my @miss;
            for my $lib (needed($bin)) {
                my ($name, $path) = @$lib;
                next if $name =~ /^ld-linux/;      # the loader itself
                if (!$path) {
                    push @miss, "$name (not found by ldd)";
                    next;
                }
                next if $path =~ m{^/usr/local/cuda};     # from the toolkit
                my $pk = owner($path);
                if (!$pk) {
                    push @miss, "$name ($path: no package owns it)";
                    next;
                }
                next if $crt{$pk} || priority($pk) eq 'required';
                push @miss, "$name: runtime package $pk" unless $run_pk->{$pk};
                (my $so = $path) =~ s/\.so\.[\d.]+$/.so/;
                my $dev = owner($so);
                push @miss, "$name: build package " . ($dev // "(for $so)")
                    unless $dev && $build_pk->{$dev};
            }
            is(join("; ", @miss), "", "$df installs what $b links");
        }
    }
}
done_testing();
