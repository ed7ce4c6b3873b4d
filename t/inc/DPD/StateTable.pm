package DPD::StateTable;

# Writes kv_agent readiness tables (kv_agent/include/dpd_state.h, ABI
# version 1) without an agent: any number of nodes, request records at
# their hash slots, any header values.  Used by t/311 and bench/.
#
#   my $bytes = DPD::StateTable::build(
#       max_nodes => 64, max_reqs => 256, self_id => 'router-0',
#       writer_alive => 1, updated_ms => now_ms(),
#       nodes => [ { slot => 3, id => 'decode-0', role => 'decode',
#                    http => '127.0.0.1:8200', alive => 1,
#                    free => 60, total => 64 }, ... ],
#       reqs  => [ { id => 'req-1', state => 'ready', node => 'decode-0' } ]);
#   DPD::StateTable::write_file($path, $bytes);     # temp file + rename
#
# Nodes without "slot" take the next free slot from 0.  perl -It/inc
# -MDPD::StateTable -e 'DPD::StateTable::main()' -- PATH NODES [HTTP...]
# writes a table of NODES filler nodes whose last records are the given
# HTTP addresses, alive (bench/balancer_table.sh).

use strict;
use warnings;
no warnings 'portable';    # 64-bit constants

use Carp qw(croak);
use Time::HiRes ();

our $VERSION = '1.0';

use constant {
    MAGIC     => 0x3154415453445044,
    HDR_SIZE  => 256,
    NODE_SIZE => 288,
    REQ_SIZE  => 352,
    MAX_PROBE => 64,
};

my %ROLE = (unknown => 0, prefill => 1, decode => 2, router => 3);
my %STATE = (free => 0, reserved => 1, transferring => 2, ready => 3,
             failed => 4);

sub now_ms { int(Time::HiRes::time() * 1000) }

# FNV-1a 64 (offset basis 0xcbf29ce484222325, prime 2^40 + 0x1b3), 0 -> 1,
# in 32-bit halves so that no product leaves perl's integers
sub hash {
    my ($s) = @_;
    my ($hi, $lo) = (0xcbf29ce4, 0x84222325);
    for my $c (unpack 'C*', $s) {
        $lo ^= $c;
        my $m = $lo * 0x1b3;
        my $nhi = ($hi * 0x1b3 + ($m >> 32) + (($lo << 8) & 0xffffffff))
                  & 0xffffffff;
        ($hi, $lo) = ($nhi, $m & 0xffffffff);
    }
    my $h = ($hi << 32) | $lo;
    return $h || 1;
}

sub _node {
    my ($n) = @_;
    my $flags = 0x1 | ($n->{alive} ? 0x2 : 0) | ($n->{self} ? 0x4 : 0);
    $flags = $n->{flags} if defined $n->{flags};
    my $id = $n->{id} // '';
    return pack('V V V V Q< Q< Q< Q< Q< a64 a128 x40',
                $n->{seq} // 2, $flags, $ROLE{ $n->{role} // 'decode' } // 0,
                $n->{inflight} // 0, hash($id),
                $n->{heartbeat_ms} // now_ms(), $n->{free} // 0,
                $n->{total} // 0, $n->{block_bytes} // 0, $id,
                $n->{http} // '');
}

sub _req {
    my ($r) = @_;
    return pack('V V Q< Q< Q< Q< Q< Q< V l< a128 a64 a64 x32',
                $r->{seq} // 2, $STATE{ $r->{state} // 'ready' } // 0,
                hash($r->{id}), $r->{bytes_done} // 0,
                $r->{bytes_total} // 0, $r->{t_reserved_ms} // 0,
                $r->{t_start_ms} // 0, $r->{t_done_ms} // 0,
                $r->{nblocks} // 0, $r->{error} // 0, $r->{id},
                $r->{node} // '', $r->{peer} // '');
}

sub build {
    my (%o) = @_;
    my $max_nodes = $o{max_nodes} // 64;
    my $max_reqs = $o{max_reqs} // 256;
    my $nodes_off = HDR_SIZE;
    my $reqs_off = $nodes_off + $max_nodes * NODE_SIZE;
    $reqs_off += (64 - $reqs_off % 64) % 64;
    my $size = $reqs_off + $max_reqs * REQ_SIZE;

    my $hdr = pack('Q< V V V V V V Q< Q< Q< Q< Q< V V a64 Q< x104',
                   MAGIC, 1, HDR_SIZE, NODE_SIZE, REQ_SIZE, $max_nodes,
                   $max_reqs, $nodes_off, $reqs_off, $size,
                   $o{generation} // 0x1234_5678_9abc_def0,
                   $o{created_ms} // now_ms(), $o{writer_pid} // $$,
                   $o{writer_alive} // 1, $o{self_id} // 'router-0',
                   $o{updated_ms} // now_ms());
    croak 'header size' unless length $hdr == HDR_SIZE;

    my $bytes = $hdr . ("\0" x ($size - HDR_SIZE));

    my %used;
    my $next = 0;
    for my $n (@{ $o{nodes} // [] }) {
        my $slot = $n->{slot};
        unless (defined $slot) {
            $next++ while $used{$next};
            $slot = $next;
        }
        croak "node slot $slot beyond max_nodes" if $slot >= $max_nodes;
        $used{$slot} = 1;
        substr($bytes, $nodes_off + $slot * NODE_SIZE, NODE_SIZE) = _node($n);
    }

    my %taken;
    for my $r (@{ $o{reqs} // [] }) {
        my $home = hash($r->{id}) % $max_reqs;
        my ($i, $idx) = (0);
        for (; $i < MAX_PROBE; $i++) {
            $idx = ($home + $i) % $max_reqs;
            last unless $taken{$idx};
        }
        croak "no slot for request $r->{id}" if $i == MAX_PROBE;
        $taken{$idx} = 1;
        substr($bytes, $reqs_off + $idx * REQ_SIZE, REQ_SIZE) = _req($r);
    }

    return $bytes;
}

# the offset of node slot $i in a table built with max_nodes => ...
sub node_offset { HDR_SIZE + $_[0] * NODE_SIZE }

sub write_file {
    my ($path, $bytes) = @_;
    my $tmp = "$path.tmp.$$";
    open my $fh, '>:raw', $tmp or croak "$tmp: $!";
    print {$fh} $bytes or croak "$tmp: $!";
    close $fh or croak "$tmp: $!";
    rename $tmp, $path or croak "rename $tmp: $!";
}

# "cp GOOD PATH": the same inode, truncated, then written
sub write_in_place {
    my ($path, $bytes) = @_;
    my $fh;
    open $fh, '+<:raw', $path or open $fh, '>:raw', $path
        or croak "$path: $!";
    truncate $fh, 0 or croak "truncate $path: $!";
    print {$fh} $bytes or croak "$path: $!";
    close $fh or croak "$path: $!";
}

sub main {
    my ($path, $count, @http) = @ARGV;
    croak 'usage: PATH NODES [HTTP...]' unless $path && $count;
    croak 'more addresses than nodes' if @http > $count;
    my @nodes;
    for my $i (0 .. $count - 1) {
        my $k = $i - ($count - @http);
        push @nodes, $k >= 0
            ? { id => "decode-$k", http => $http[$k], alive => 1,
                free => 100, total => 128 }
            : { id => "filler-$i", alive => 1, free => 1, total => 128,
                http => sprintf('10.%d.%d.%d:8000', $i >> 16 & 255,
                                $i >> 8 & 255, $i & 255) };
    }
    write_file($path, build(max_nodes => $count, max_reqs => 1024,
                            nodes => \@nodes));
}

1;
