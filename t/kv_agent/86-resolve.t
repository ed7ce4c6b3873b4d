#!/usr/bin/perl
# resolve.c, the agent's asynchronous resolver (src/resolve.h: the API
# kv_events_dns.c and the peers' DNS discovery use), through a harness
# compiled here from the real source, in a mount namespace with a private
# /etc/hosts and an /etc/resolv.conf whose server answers NXDOMAIN, except
# for hang.test, whose queries it never answers:
#   - every address of a name, sorted (IPv4 first), without duplicates;
#     10,000 addresses: the lowest 64 kept, the total told;
#   - "ADDR:port" / "[ADDR]:port" as nginx names a peer; a family asked;
#   - errors: NXDOMAIN, bad arguments, a full queue (EAGAIN);
#   - a lookup that hangs: timed out on time while others are answered,
#     cancel means no callback, at most 16 threads however many hang, and
#     kv_res_destroy() does not wait for them.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use KvAgentTest;
use Time::HiRes qw(time);

my $root = kv_root();
my $cc = $ENV{CC} || 'cc';
my $py = ($ENV{DPD_VENV} // "$root/.venv") . "/bin/python";
$py = "python3" unless -x $py;

if (!$ENV{KV_RES_TEST_NS}) {
    plan skip_all => "not root: no mount namespace for a private "
                     . "/etc/hosts" if $> != 0;
    plan skip_all => "unshare -m is not allowed here"
        unless system("unshare -m --propagation private true "
                      . "2>/dev/null") == 0;
    $ENV{KV_RES_TEST_NS} = 1;
    exec "unshare", "-m", "--propagation", "private", $^X,
         (map { "-I$_" } grep { !ref } @INC), $0;
    die "exec unshare: $!";
}

my $dir = kv_tmpdir();
open my $fh, '>', "$dir/h.c" or die;
print $fh <<'_C_';
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include "resolve.h"

static int calls;

static double
now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int
threads(void)
{
    DIR *d = opendir("/proc/self/task");
    struct dirent *e;
    int n = 0;
    while (d && (e = readdir(d)) != NULL) {
        n += e->d_name[0] != '.';
    }
    if (d) closedir(d);
    return n;
}

static void
show(void *data, const kv_res_result_t *r)
{
    char b[80];
    uint32_t i;

    calls++;
    printf("answer %s status=%d error=%s total=%u n=%u t=%.3f\n", r->name,
           r->status, r->status ? r->error : "-", r->total, r->naddrs,
           now() - *(double *) data);
    for (i = 0; i < r->naddrs && i < 4; i++) {
        kv_res_addr_str(&r->addrs[i], 1, b, sizeof(b));
        printf("addr %s\n", b);
    }
    if (r->naddrs > 4) {
        kv_res_addr_str(&r->addrs[r->naddrs - 1], 1, b, sizeof(b));
        printf("last %s\n", b);
    }
}

static void
run(kv_res_t *r, double secs)
{
    double end = now() + secs;
    while (now() < end && kv_res_pending(r) > 0) {
        struct pollfd p = { kv_res_fd(r), POLLIN, 0 };
        poll(&p, 1, 10);
        kv_res_process(r);
    }
}

int
main(int argc, char **argv)
{
    kv_res_conf_t c = { 0 };
    kv_res_t *r;
    double t0 = now();
    int i, fam = AF_UNSPEC;
    uint64_t id;
    char big[300];

    c.timeout_ms = argc > 3 ? atoi(argv[3]) : 0;
    c.max_pending = argc > 4 ? atoi(argv[4]) : 0;
    if (argc > 2) {
        fam = strcmp(argv[2], "6") == 0 ? AF_INET6
            : strcmp(argv[2], "4") == 0 ? AF_INET : AF_UNSPEC;
    }
    r = kv_res_create(&c);
    if (strcmp(argv[1], "args") == 0) {
        memset(big, 'a', 256); big[256] = '\0';
        printf("empty=%d", kv_res_start(r, "", 80, 0, show, &t0) == 0
               && errno == EINVAL);
        printf(" long=%d", kv_res_start(r, big, 80, 0, show, &t0) == 0
               && errno == EINVAL);
        printf(" port=%d", kv_res_start(r, "x", 65536, 0, show, &t0) == 0
               && errno == EINVAL);
        printf(" family=%d", kv_res_start(r, "x", 1, 99, show, &t0) == 0
               && errno == EINVAL);
        printf(" nohandler=%d\n", kv_res_start(r, "x", 1, 0, NULL, &t0)
               == 0 && errno == EINVAL);
    } else if (strcmp(argv[1], "queue") == 0) {
        for (i = 0; i < c.max_pending; i++) {
            kv_res_start(r, "hang.test", 1, 0, show, &t0);
        }
        id = kv_res_start(r, "localhost", 1, 0, show, &t0);
        printf("full=%d\n", id == 0 && errno == EAGAIN);
    } else if (strcmp(argv[1], "cancel") == 0) {
        id = kv_res_start(r, "hang.test", 1, 0, show, &t0);
        kv_res_cancel(r, id);
        kv_res_cancel(r, id);           /* twice: ignored */
        kv_res_cancel(r, 12345);        /* unknown: ignored */
        id = kv_res_start(r, "localhost", 1, 0, show, &t0);
        kv_res_cancel(r, id);
        run(r, 1);
        printf("pending=%d calls=%d\n", kv_res_pending(r), calls);
    } else if (strcmp(argv[1], "hang") == 0) {
        /* one lookup stuck, others still answered, the stuck one timed
         * out; 40 more stuck ones: never more than 16 threads */
        kv_res_start(r, "hang.test", 5557, 0, show, &t0);
        kv_res_start(r, "pods.test", 5557, 0, show, &t0);
        run(r, 5);
        for (i = 0; i < 40; i++) {
            kv_res_start(r, "hang.test", 1, 0, show, &t0);
            run(r, 0.05);
        }
        run(r, 5);
        printf("threads=%d\n", threads());
        t0 = now();
        kv_res_start(r, "hang.test", 1, 0, show, &t0);
        kv_res_destroy(r);
        printf("destroy=%.3f calls=%d\n", now() - t0, calls);
        return 0;
    } else {
        for (i = 1; i < argc && i < 2; i++) {
            kv_res_start(r, argv[i], 5557, fam, show, &t0);
        }
        run(r, 20);
    }
    kv_res_destroy(r);
    return 0;
}
_C_
close $fh;
system("$cc -std=c11 -Wall -Wextra -Werror -O1 -g -I$root/kv_agent/src "
       . "-o $dir/h $dir/h.c $root/kv_agent/src/resolve.c -lpthread") == 0
    or BAIL_OUT("harness did not build");

sub put {
    my ($f, $text) = @_;
    open my $o, '>', $f or die "$f: $!";
    print $o $text;
    close $o;
}

# 10,000 addresses of many.test in reverse order; pods.test with two
# IPv4 addresses (one listed twice) and an IPv6 one (not ::1: glibc
# answers an IPv4 query for a name on ::1 with 127.0.0.1)
my $hosts = "127.0.0.1 localhost\n::1 localhost\n"
    . "127.0.0.9 pods.test\nfd00::7 pods.test\n127.0.0.7 pods.test\n"
    . "127.0.0.7 pods.test\n";
$hosts .= join "", map { sprintf "10.%d.%d.%d many.test\n", $_ >> 16,
                         ($_ >> 8) & 255, $_ & 255 } reverse 1 .. 10000;
put("$dir/hosts", $hosts);
put("$dir/resolv.conf", "nameserver 127.0.0.53\noptions timeout:30 "
    . "attempts:3\n");
system("mount --bind $dir/hosts /etc/hosts") == 0
    && system("mount --bind $dir/resolv.conf /etc/resolv.conf") == 0
    or plan skip_all => "cannot bind-mount /etc/hosts";

my $dns = fork // die;
if ($dns == 0) {
    exec $py, "-c", 'import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.53", 53))
while True:
    q, peer = s.recvfrom(2048)
    if len(q) < 12 or b"\x04hang\x04test\x00" in q.lower():
        continue
    end = q.find(b"\x00", 12) + 5
    s.sendto(q[:2] + bytes([0x81, 0x83, 0, 1]) + bytes(6) + q[12:end], peer)
' or exit 127;
}
sleep 0.3;

sub h { my $o = `timeout 60 $dir/h @_ 2>&1`; return ($? >> 8, $o) }

my ($rc, $o) = h("pods.test");
like($o, qr/^answer pods\.test status=0 error=- total=3 n=3/m,
     "every address of a name, a duplicate dropped") or diag $o;
like($o, qr/addr 127\.0\.0\.7:5557\naddr 127\.0\.0\.9:5557\naddr \[fd00::7\]:5557\n/,
     "sorted, IPv4 first; IPv6 in brackets");
($rc, $o) = h("pods.test", 6);
like($o, qr/total=1 n=1 t=[\d.]+\naddr \[fd00::7\]:5557\n/,
     "family IPv6 only");
($rc, $o) = h("pods.test", 4);
like($o, qr/total=2 n=2 t=[\d.]+\naddr 127\.0\.0\.7:5557\naddr 127\.0\.0\.9:5557\n/, "family IPv4 only");

my $t = time;
($rc, $o) = h("many.test");
my $dt = time - $t;
like($o, qr/total=10000 n=64 t=[\d.]+\naddr 10\.0\.0\.1:5557\n(?s:.*)last 10\.0\.0\.64:5557/,
     sprintf("10,000 addresses: the lowest 64 kept (%.2f s)", $dt))
    or diag $o;

($rc, $o) = h("nothing.test");
like($o, qr/status=-2 error=Name or service not known/,
     "NXDOMAIN: EAI_NONAME, its text") or diag $o;
($rc, $o) = h("args");
is($o, "empty=1 long=1 port=1 family=1 nohandler=1\n",
   "bad arguments: EINVAL");
($rc, $o) = h("queue", 0, 1000, 3);
is($o, "full=1\n", "max_pending outstanding: EAGAIN");
($rc, $o) = h("cancel", 0, 500);
is($o, "pending=0 calls=0\n", "cancelled: no callback, ever");

($rc, $o) = h("hang", 0, 300, 64);
like($o, qr/^answer pods\.test status=0/m, "answered while another hangs")
    or diag $o;
like($o, qr/^answer hang\.test status=1 error=timed out total=0 n=0 t=0\.(2[89]|3|4)/m,
     "the hanging lookup times out on time");
my ($th) = $o =~ /threads=(\d+)/;
ok(defined $th && $th <= 17, "41 lookups stuck: at most 16 worker threads ("
   . ($th // '?') . " in all)");
my ($dd) = $o =~ /destroy=([\d.]+)/;
ok(defined $dd && $dd < 0.5, "destroy does not wait for stuck lookups ("
   . ($dd // '?') . " s)");
is($rc, 0, "the process exits with threads stuck in getaddrinfo");

kill 'TERM', $dns;
waitpid $dns, 0;
done_testing();
