package FakeSysfs;

# Fake sysfs trees (KV_SYSFS_ROOT) of GPU nodes for the topology tests:
# PCI functions under /sys/devices/pciDDDD:BB/<root port>/<switch up>/
# <switch down>/<function> with vendor and class files, the
# /sys/bus/pci/devices/<bdf> links, and /sys/class/{infiniband,net}/<dev>/
# device links to the NICs, all relative like the kernel's.

use strict;
use warnings;
use Exporter 'import';
use File::Path qw(make_path);
use File::Spec;

our @EXPORT_OK = qw(fake_node p5_node p4d_node small_node);

sub _bdf { sprintf("0000:%02x:%02x.0", $_[0], $_[1] // 0) }

sub _put {
    my ($path, $text) = @_;
    open my $fh, '>', $path or die "$path: $!";
    print $fh $text;
    close $fh;
}

# _func($root, "pci0000:00/0000:00:01.0/...", vendor, class)
sub _func {
    my ($root, $rel, $vendor, $class) = @_;
    my $dir = "$root/sys/devices/$rel";
    make_path($dir);
    _put("$dir/vendor", sprintf("0x%04x\n", $vendor));
    _put("$dir/class", sprintf("0x%06x\n", $class));
    my ($bdf) = $rel =~ m{([^/]+)$};
    make_path("$root/sys/bus/pci/devices");
    symlink("../../../devices/$rel", "$root/sys/bus/pci/devices/$bdf")
        or die "symlink: $!";
    return $rel;
}

sub _nic {
    my ($root, $rel, $name, $cls) = @_;
    _func($root, $rel, 0x1d0f, 0x020000);           # Amazon EFA
    my $dir = "$root/sys/class/$cls/$name";
    make_path($dir);
    symlink("../../../devices/$rel", "$dir/device") or die "symlink: $!";
}

# fake_node($root, switches => [[gpus, nics], ...], hosts => N, nic_class,
#           lone_nic => 1)  -- each switch under its own root port; the
# switches spread over `hosts` host bridges.  Returns the NIC names in
# PCI order.
sub fake_node {
    my ($root, %o) = @_;
    my $cls = $o{nic_class} // "infiniband";
    my $hosts = $o{hosts} // 1;
    my @nics;
    my $bus = 0x10;
    my $nsw = scalar @{ $o{switches} };
    for my $s (0 .. $nsw - 1) {
        my ($ng, $nn) = @{ $o{switches}[$s] };
        my $hb = sprintf("pci0000:%02x", int($s * $hosts / $nsw) * 0x40);
        my $rp = "$hb/" . _bdf(int($s * $hosts / $nsw) * 0x40, 1 + $s);
        my $up = "$rp/" . _bdf($bus, 0);
        my $down = $bus + 1;
        my $port = 0;
        my $ep = $bus + 2;
        for my $g (1 .. $ng) {
            my $dp = "$up/" . _bdf($down, $port++);
            _func($root, "$dp/" . _bdf($ep++), 0x10de, 0x030200);   # H100
        }
        for my $n (1 .. $nn) {
            my $dp = "$up/" . _bdf($down, $port++);
            my $name = $o{names} && @{ $o{names} } ? shift @{ $o{names} }
                       : sprintf("rdmap%ds%d", $ep, 27);
            _nic($root, "$dp/" . _bdf($ep++), $name, $cls);
            push @nics, $name;
        }
        # an NVMe drive and an NVSwitch-like bridge: not GPUs
        _func($root, "$up/" . _bdf($down, $port++) . "/" . _bdf($ep++),
              0x144d, 0x010802);
        _func($root, "$up/" . _bdf($down, $port++) . "/" . _bdf($ep++),
              0x10de, 0x068000);
        $bus += 0x10;
    }
    if ($o{lone_nic}) {
        # one NIC on a host bridge of its own: local to no GPU
        my $name = "rdmap250s0";
        _nic($root, "pci0000:f0/0000:f0:01.0/" . _bdf(0xfa), $name, $cls);
        push @nics, $name;
    }
    return @nics;
}

# p5.48xlarge: 8 H100 and 32 EFA NICs, one GPU and four NICs per PCIe
# switch, two host bridges
sub p5_node { fake_node($_[0], switches => [map { [1, 4] } 1 .. 8],
                        hosts => 2) }

# p4d-like: 8 GPUs and 4 NICs, two GPUs and one NIC per switch
sub p4d_node { fake_node($_[0], switches => [map { [2, 1] } 1 .. 4],
                         hosts => 2) }

# a small node: 4 GPUs on one switch, the only NIC elsewhere
sub small_node { fake_node($_[0], switches => [[4, 0]], lone_nic => 1) }

1;
