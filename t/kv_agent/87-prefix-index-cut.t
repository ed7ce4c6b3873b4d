#!/usr/bin/perl
# The prefix index file cut short under its writer (a truncate(1) or a
# copy over it while the agent runs): the writer's next store into a page
# past the new end is SIGBUS, which killed the agent.  Now the store lands
# (the size is restored), the next call rewrites the file from memory, and
# the file then says what one never cut says: the same header, node
# records and (key, GPU mask, lower mask) set.  A SIGBUS elsewhere still
# kills the process as before.  A harness compiled here from the real
# sources (prefix_index.c) runs the same stores with and without the cut
# (to nothing, inside the header, the node records, the slots).
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use POSIX ();
use KvAgentTest;

my $root = kv_root();
my $dir = kv_tmpdir();
my $cc = $ENV{CC} || 'cc';
my $src = "$root/kv_agent/src";

plan skip_all => 'no cJSON headers' unless -f '/usr/include/cjson/cJSON.h';

open my $fh, '>', "$dir/cut.c" or die;
print $fh <<'_C_';
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "kv.h"
#include "prefix_index.h"

static void
store(kv_pfx_t *ix, int node, uint64_t id0, uint32_t tok0, size_t n,
    int lower)
{
    static uint64_t  ids[64];
    static uint32_t  tok[64 * 16];
    kv_pfx_stored_t  ev;
    size_t           i;

    for (i = 0; i < n; i++) {
        ids[i] = id0 + i;
    }
    for (i = 0; i < n * 16; i++) {
        tok[i] = tok0 + (uint32_t) i;
    }
    memset(&ev, 0, sizeof(ev));
    ev.ids = ids;
    ev.nblocks = n;
    ev.tokens = tok;
    ev.ntokens = n * 16;
    ev.block_size = 16;
    ev.lower_tier = lower;
    kv_pfx_stored(ix, node, &ev);
}

/* what a reader sees: header fields, nodes, the slot set (any order) */
static int
dump(const char *path)
{
    int                 fd;
    off_t               size;
    char               *m;
    uint64_t            i;
    dpd_pfx_header_t   *h;
    dpd_pfx_node_t     *r;
    dpd_pfx_slot_t     *s;

    fd = open(path, O_RDONLY);
    size = lseek(fd, 0, SEEK_END);
    m = malloc(size);
    if (fd < 0 || m == NULL || pread(fd, m, size, 0) != size) {
        return 5;
    }
    h = (dpd_pfx_header_t *) m;
    printf("size %lld magic %d version %u nslots %llu block %u alive %u\n",
           (long long) size, h->magic == DPD_PFX_MAGIC, h->version,
           (unsigned long long) h->nslots, h->block_size, h->writer_alive);
    for (i = 0; i < h->max_nodes; i++) {
        r = (dpd_pfx_node_t *) (m + h->nodes_off) + i;
        if (r->flags) {
            printf("node %llu %s %s flags %u blocks %llu lower %llu\n",
                   (unsigned long long) i, r->id, r->http_addr, r->flags,
                   (unsigned long long) r->blocks,
                   (unsigned long long) r->lower_blocks);
        }
    }
    for (i = 0; i < h->nslots; i++) {
        s = (dpd_pfx_slot_t *) (m + h->slots_off) + i;
        if (s->gpu_mask || s->lower_mask) {
            printf("slot %016llx %llx %llx\n", (unsigned long long) s->key,
                   (unsigned long long) s->gpu_mask,
                   (unsigned long long) s->lower_mask);
        }
    }
    close(fd);
    free(m);
    return 0;
}

int
main(int argc, char **argv)
{
    int        cut, fd;
    char      *p;
    kv_pfx_t  *ix;

    cut = strcmp(argv[2], "cut") == 0;
    if (strcmp(argv[2], "other") == 0) {
        /* a file of our own mapped and cut: not the index's SIGBUS */
        ix = kv_pfx_open(argv[1], 4096, 8, 16, 4096);
        fd = open(argv[3], O_RDWR | O_CREAT | O_TRUNC, 0600);
        if (ix == NULL || fd < 0 || ftruncate(fd, 65536) != 0) {
            return 2;
        }
        p = mmap(NULL, 65536, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED || ftruncate(fd, 100) != 0) {
            return 2;
        }
        p[8192] = 1;                   /* SIGBUS: the default action */
        return 3;
    }
    ix = kv_pfx_open(argv[1], 4096, 8, 16, 4096);
    if (ix == NULL || kv_pfx_node(ix, "d0", "10.0.0.1:8000", "m") != 0
        || kv_pfx_node(ix, "d1", "10.0.0.2:8000", "m") != 1)
    {
        return 2;
    }
    store(ix, 0, 1000, 1, 50, 0);      /* a 50-block prompt on d0 */
    store(ix, 1, 2000, 1, 20, 0);      /* its first 20 on d1 too */
    store(ix, 1, 3000, 90000, 5, 1);   /* a lower tier */
    if (cut && truncate(argv[1], atoi(argv[3])) != 0) {
        return 4;
    }
    /* the store that faults (past the cut), and the call that rewrites */
    store(ix, 0, 4000, 50000, 3, 0);
    kv_pfx_removed(ix, 1, (uint64_t[]) { 2019 }, 1, 0);
    store(ix, 1, 5000, 60000, 2, 0);
    fd = dump(argv[1]);
    kv_pfx_close(ix, 0);
    return fd;
}
_C_
close $fh;

my $out = `$cc -O2 -std=c11 -D_GNU_SOURCE -I$root/kv_agent/include -I$src \\
    $dir/cut.c $src/prefix_index.c $src/util.c -o $dir/cut -lcjson 2>&1`;
is $?, 0, 'the harness builds' or diag $out;

my $ref = `$dir/cut $dir/ref.idx ref 0 2>/dev/null`;
is $?, 0, 'stores into an index never cut';
sub canon {
    my @l = split /\n/, $_[0];
    return join("\n", grep(!/^slot/, @l), sort grep(/^slot/, @l)) . "\n";
}
like $ref, qr/^size \d+ magic 1 /, 'the reference index';
is scalar(() = $ref =~ /^slot/mg), 50 + 5 + 3 + 2,
   '... with a slot per distinct block';

# cut to nothing, inside the header, inside the node records, in the slots
for my $cut (0, 100, 256 + 300, 40000) {
    my $got = `$dir/cut $dir/cut$cut.idx cut $cut 2>$dir/cut.err`;
    is $?, 0, "the same stores, the file cut to $cut bytes under them: "
       . "alive" or diag(`cat $dir/cut.err`);
    my $err = `cat $dir/cut.err`;
    like $err, qr/cut short under the agent: rewritten from memory/,
         '... said so';
    is canon($got), canon($ref),
       '... the file rewritten: header, nodes and slots as the uncut one';
}

{
    open my $save, '>&', \*STDERR or die;
    open STDERR, '>', '/dev/null' or die;
    system("$dir/cut", "$dir/other.idx", 'other', "$dir/other.bin");
    open STDERR, '>&', $save or die;
}
ok POSIX::WIFSIGNALED($?) && POSIX::WTERMSIG($?) == 7,
   'a SIGBUS not in the index still kills (status ' . $? . ')';

done_testing();
