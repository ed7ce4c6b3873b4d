# The nginx side of tools/fuzz_nginx.py for t/260 and t/261: the same
# locations in the same order (the prefixes pick the cases of a seed), and
# one runner that collects the driver's findings and summary.
package DPD::FuzzNginx;

use strict;
use warnings;

use File::Spec ();
use Test::Nginx::Util ();

our @Prefixes = qw(/direct /observe /nixl /lmcache /kv /bound);

our $Config = <<'_EOC_';
    proxy_http_version 1.1;
    proxy_buffering off;
    dpd_prefill_timeout 5s;
    dpd_kv_wait 200ms;

    location /direct/ {
        dpd on;
        dpd_threshold 1000000;
        proxy_pass http://decode/;
    }

    location /observe/ {
        dpd on;
        dpd_threshold 256;
        proxy_pass http://decode/;
    }

    location /nixl/ {
        dpd on;
        dpd_threshold 256;
        dpd_protocol nixl;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode/;
    }

    location /lmcache/ {
        dpd on;
        dpd_threshold 256;
        dpd_protocol lmcache;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode/;
    }

    location /kv/ {
        dpd on;
        dpd_threshold 0;
        dpd_protocol kv_agent;
        dpd_decode_upstream decode;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode/;
    }

    location /bound/ {
        dpd on;
        dpd_threshold 256;
        dpd_count bound;
        dpd_prefill_pass /_dpd_prefill;
        proxy_pass http://decode/;
    }

    location /_dpd_prefill/ {
        internal;
        subrequest_output_buffer_size 64k;
        proxy_pass http://prefill/;
    }

    location = /ping { return 200 "pong\n"; }
_EOC_

# run(\@engines, ARGS...): fuzz_nginx.py against this nginx with ARGS;
# returns (\@findings, $summary_json_line, $exit_code)
sub run {
    my ($engines, @args) = @_;
    my $root = $ENV{DPD_ROOT} // '.';
    my $logs = File::Spec->catdir(Test::Nginx::Util::server_root(),
                                  'logs');
    my @cmd = ('python3', "$root/tools/fuzz_nginx.py",
               '--port', Test::Nginx::Util::server_port(),
               (map { ('--prefix', $_) } @Prefixes),
               '--error-log', "$logs/error.log",
               '--pid-file', "$logs/nginx.pid",
               (map { ('--engine', $_->url) } @$engines), @args);
    my (@findings, $summary);
    open my $out, '-|', @cmd or die "fuzz_nginx.py: $!";
    while (my $line = <$out>) {
        chomp $line;
        push @findings, $1 if $line =~ /^FINDING (.*)/;
        $summary = $line if $line =~ /^\{/;
    }
    close $out;
    return (\@findings, $summary, $? >> 8);
}

1;
