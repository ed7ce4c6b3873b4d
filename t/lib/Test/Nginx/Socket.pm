package Test::Nginx::Socket;

# Clean-room implementation of the subset of Test::Nginx::Socket (CPAN,
# openresty/test-nginx) used by the DPD gateway tests.  It is put on @INC
# only when the real module is not installed (tools/run-tests.sh), so the
# same t/*.t files run under both.  Written from the documented behaviour
# of the real module; see the POD at the end for the supported sections
# and the deliberate differences.

use strict;
use warnings;

use Test::Base -base;

our $VERSION = '0.30_dpd';

use Encode ();
use Errno qw(EAGAIN EWOULDBLOCK EINTR);
use IO::Select ();
use IO::Socket::INET ();
use POSIX qw(:sys_wait_h);
use Test::LongString ();
use Time::HiRes qw(sleep time);

use Test::Nginx::Util qw(
    env_to_nginx is_str no_long_string server_addr server_name
    timeout no_shuffle no_nginx_manager repeat_each worker_connections
    workers log_level master_on master_off master_process_enabled
    config_preamble add_block_preprocessor add_cleanup_handler
    no_root_location html_dir server_root server_port
    server_port_for_client check_accum_error_log bail_out run_tests
    error_log_data access_log_data parse_time parse_headers trim
    show_all_chars sleep_time verbose use_hup
);

our @EXPORT = qw(
    env_to_nginx is_str plan run_tests run_test repeat_each
    config_preamble worker_connections master_process_enabled
    no_long_string workers master_on master_off log_level no_shuffle
    no_root_location use_hup server_name server_addr server_root html_dir
    server_port server_port_for_client timeout no_nginx_manager
    check_accum_error_log add_block_preprocessor bail_out
    add_cleanup_handler add_response_body_check
);

our @ResponseBodyChecks;

# The last raw response (status line, headers, undecoded body) for helper
# modules that want to look at SSE framing.  Not part of the real API.
our $LastRawResponse;

sub add_response_body_check ($) { push @ResponseBodyChecks, shift }

sub run_test ($) { Test::Nginx::Util::run_test(shift) }

$Test::Nginx::Util::RunTestHelper         = \&run_test_helper;
$Test::Nginx::Util::CheckErrorLog         = \&check_error_log;
$Test::Nginx::Util::CheckShutdownErrorLog = \&check_shutdown_error_log;

sub expand ($$) { Test::Nginx::Util::expand_env_in_text($_[0], $_[1]) }

# ---------------------------------------------------------------------------
# Building requests

# "--- more_headers": one "Key: value" per line, '#' lines ignored.
sub parse_more_headers ($) {
    my $in = shift;
    my ($out, $chunked) = ('', 0);
    for my $line (split /\n+/, $in) {
        next if $line =~ /^\s*#/ || $line !~ /\S/;
        my ($key, $val) = split /:\s*/, $line, 2;
        $val = '' unless defined $val;
        $val =~ s/\r$//;
        $chunked = 1 if lc($key) eq 'transfer-encoding' && $val eq 'chunked';
        $out .= "$key: $val\r\n";
    }
    return ($out, $chunked);
}

# "METH [URI [HTTP/x.y]]\nbody": the body is trimmed and gets a
# Content-Length unless the headers say otherwise; Host and Connection
# are added unless given.
sub build_request ($$$$$) {
    my ($name, $req, $more_headers, $chunked, $conn) = @_;

    $req =~ s/^(?:\s*#[^\n]*\n|\s+)+//s;
    my ($first, $content) = split /\n/, $req, 2;
    bail_out("$name - Request line should be non-empty")
        unless defined $first && $first =~ /\S/;
    $first =~ s/\r$//;
    my ($meth, $uri, $ver) = split ' ', $first;
    $uri = '/' unless defined $uri;
    $ver = 'HTTP/1.1' unless defined $ver;
    $content = '' unless defined $content;

    my $headers = '';
    $headers .= "Host: $Test::Nginx::Util::ServerName\r\n"
        if $more_headers !~ /(?:^|\n)Host:/i;
    $headers .= "Connection: $conn\r\n"
        if $more_headers !~ /(?:^|\n)Connection/i;
    $headers .= $more_headers;

    if (!$chunked && $content ne '') {
        $content =~ s/^\s+|\s+$//gs;
        $headers .= "Content-Length: " . length($content) . "\r\n"
            if $more_headers !~ /(?:^|\n)Content-Length:/i;
    }

    return "$meth $uri $ver\r\n$headers\r\n$content";
}

sub pick_headers ($$$) {
    my ($name, $more, $i) = @_;
    if (ref $more eq 'ARRAY') {
        my $h = $more->[$i];
        bail_out("$name - --- more_headers lacks data for request $i")
            unless defined $h;
        return parse_more_headers($h);
    }
    return parse_more_headers($more);
}

# A list of requests; each request is a list of packets
# { value => bytes, delay_before => secs }.
sub get_req_from_block ($) {
    my $block = shift;
    my $name = $block->name;
    my @reqs;

    if (defined(my $raw = $block->raw_request)) {
        my @packets = ref $raw eq 'ARRAY' ? @$raw : ($raw);
        push @reqs, [ map { ref $_ ? $_ : { value => expand($_, $name) } }
                      @packets ];
        return \@reqs;
    }

    my $more = $block->more_headers // '';
    $more = expand($more, $name) unless ref $more;

    if (defined(my $pl = $block->pipelined_requests)) {
        bail_out("$name - invalid entries in --- pipelined_requests")
            unless ref $pl eq 'ARRAY';
        my $all = '';
        for my $i (0 .. $#$pl) {
            my ($hdr, $chunked) = pick_headers($name, $more, $i);
            $all .= build_request($name, expand($pl->[$i], $name), $hdr,
                                  $chunked,
                                  $i == $#$pl ? 'close' : 'keep-alive');
        }
        return [[{ value => $all }]];
    }

    my $request = $block->request;
    bail_out("$name - no --- request, --- raw_request or "
             . "--- pipelined_requests section")
        unless defined $request;

    my @list = ref $request eq 'ARRAY' ? @$request : ($request);
    for my $i (0 .. $#list) {
        my $one = $list[$i];
        my ($hdr, $chunked) = pick_headers($name, $more, $i);
        if (!ref $one) {
            push @reqs, [{ value => build_request($name, expand($one, $name),
                                                  $hdr, $chunked, 'close') }];
            next;
        }
        bail_out("$name - a request must be a string or an array of "
                 . "packets") unless ref $one eq 'ARRAY';

        # packets: the request is built from their concatenation and then
        # cut again at the same offsets, shifted by what was added
        my @packets = map { ref $_ ? {%$_} : { value => $_ } } @$one;
        my $joined = join '', map { $_->{value} } @packets;
        my $built = build_request($name, $joined, $hdr, $chunked, 'close');
        my $added = length($built) - length($joined);
        my $off = 0;
        for my $j (0 .. $#packets) {
            my $len = length $packets[$j]{value};
            $len += $added if $j == 0;
            $len = length($built) - $off if $j == $#packets;
            $packets[$j]{value} = substr $built, $off, $len;
            $off += $len;
        }
        push @reqs, \@packets;
    }
    return \@reqs;
}

# ---------------------------------------------------------------------------
# Talking to nginx

sub connect_server ($$) {
    my ($block, $timeout) = @_;
    my $name = $block->name;
    my $addr = $block->server_addr_for_client
               // $Test::Nginx::Util::ServerAddr;
    my $port = $Test::Nginx::Util::ServerPortForClient;

    # nginx may still be starting (slow under valgrind)
    my $deadline = time + ($Test::Nginx::Util::UseValgrind ? 60 : 10);
    my $tries = 0;
    while (1) {
        my $sock = IO::Socket::INET->new(PeerAddr => $addr,
                                         PeerPort => $port,
                                         Proto    => 'tcp',
                                         Timeout  => $timeout);
        return $sock if $sock;
        my $err = $!;

        my $child = $Test::Nginx::Util::ChildPid;
        if (defined $child && waitpid($child, WNOHANG) != 0) {
            undef $Test::Nginx::Util::ChildPid;
            return (undef, "Can't connect to $addr:$port: $err "
                    . "(nginx exited)\n" . log_tail());
        }
        if (time >= $deadline) {
            return (undef, "Can't connect to $addr:$port: $err\n"
                    . log_tail());
        }
        $tries++;
        my $wait = sleep_time() * $tries;
        $wait = 0.5 if $wait > 0.5;
        sleep $wait;
    }
}

sub log_tail () {
    my $f = $Test::Nginx::Util::ErrLogFile;
    open my $in, '<', $f or return '';
    my @lines = <$in>;
    close $in;
    @lines = grep { !/\[debug\]/ } @lines;
    splice @lines, 0, @lines - 20 if @lines > 20;
    return join '', @lines;
}

# Returns (raw response, timed_out, error).  The timeout is an inactivity
# timeout, as in the real harness: it restarts on every byte received.
sub send_request ($$$) {
    my ($packets, $timeout, $block) = @_;
    my $name = $block->name;

    # nginx may answer early (413, 400) and close while we still write
    local $SIG{PIPE} = 'IGNORE';

    my ($sock, $err) = connect_server($block, $timeout);
    return ('', 0, $err) unless $sock;
    $sock->blocking(0);

    my @queue = map { {%$_} } @$packets;
    my $middle_delay = parse_time($block->raw_request_middle_delay);
    my $first = 1;
    my ($wbuf, $woff) = (undef, 0);
    my $resp = '';
    my $writing = 1;
    my $sel = IO::Select->new($sock);

    while (1) {
        if ($writing) {
            if (!defined $wbuf) {
                my $p = shift @queue;
                if (!$p) {
                    $writing = 0;
                    if (defined(my $sd = $block->shutdown)) {
                        $sd = 1 if $sd !~ /\S/;
                        shutdown $sock, $sd;
                    }
                    next;
                }
                my $delay = $p->{delay_before};
                $delay = $middle_delay if !defined $delay && !$first;
                sleep $delay if $delay;
                ($wbuf, $woff, $first) = ($p->{value}, 0, 0);
            }
        }

        my ($r, $w) = IO::Select->select($sel, $writing ? $sel : undef,
                                         undef, $timeout);
        if (!$r && !$w) {
            next if $! == EINTR;
            close $sock;
            return ($resp, 1, undef);
        }

        if ($w && @$w && defined $wbuf) {
            my $n = syswrite $sock, $wbuf, length($wbuf) - $woff, $woff;
            if (!defined $n) {
                next if $! == EAGAIN || $! == EWOULDBLOCK || $! == EINTR;
                # nginx may answer (e.g. 413) and close before we finish
                $writing = 0;
                undef $wbuf;
            } else {
                $woff += $n;
                undef $wbuf if $woff >= length $wbuf;
            }
        }

        if ($r && @$r) {
            my $n = sysread $sock, my $buf, 65536;
            if (!defined $n) {
                next if $! == EAGAIN || $! == EWOULDBLOCK || $! == EINTR;
                warn "WARNING: $name - HTTP response read failure: $!\n";
                last;
            }
            last if $n == 0;
            $resp .= $buf;
        }
    }

    close $sock;
    return ($resp, 0, undef);
}

# ---------------------------------------------------------------------------
# Parsing responses

# Minimal response object: code, header(name), content, raw_content.
{
    package Test::Nginx::Socket::Response;

    sub new {
        my ($class, %a) = @_;
        return bless { headers => [], %a }, $class;
    }

    sub code { my $s = shift; $s->{code} = shift if @_; $s->{code} }

    sub content {
        my $s = shift;
        $s->{content} = shift if @_;
        return $s->{content};
    }

    sub raw_content { $_[0]{raw_content} }

    # all values of a header, joined by ", " (as HTTP::Headers does)
    sub header {
        my ($s, $key) = @_;
        my @v = map { $_->[1] } grep { lc $_->[0] eq lc $key }
                @{ $s->{headers} };
        return undef unless @v;
        return join ', ', @v;
    }
}

# Returns ($res, $raw_headers, $leftover bytes, $error).
sub parse_response ($$$$) {
    my ($name, $raw, $head_req, $lenient) = @_;

    my $res = Test::Nginx::Socket::Response->new(content => '');
    my ($head, $body);
    if ($raw =~ /^(.*?\r?\n)\r?\n(.*)\z/s) {
        ($head, $body) = ($1, $2);
    } else {
        ($head, $body) = ($raw, '');
    }
    my $raw_headers = $head;

    my @lines = split /\r?\n/, $head;
    my $status = shift @lines // '';
    if ($status =~ m{^HTTP/\d+\.\d+\s+(\d{3})}) {
        $res->code($1);
    }
    for my $line (@lines) {
        if ($line =~ /^([^:\s]+)\s*:\s*(.*?)\s*$/) {
            push @{ $res->{headers} }, [$1, $2];
        }
    }
    $res->{raw_content} = $body;

    my $code = $res->code;
    if ($head_req || ($code && ($code == 304 || $code == 204
                                || $code =~ /^1/)))
    {
        return ($res, $raw_headers, $body eq '' ? undef : $body, undef);
    }

    my $te = $res->header('Transfer-Encoding');
    my $len = $res->header('Content-Length');
    my $left;

    if (defined $te && $te =~ /\bchunked\b/i) {
        # as the real module: a chunked body that is cut short (a timeout
        # under --- abort too) or malformed is one failure and leaves no
        # response at all (no status, headers or body to compare)
        my ($decoded, $rest, $err) = dechunk($body);
        if (defined $err) {
            return (undef, undef, undef,
                    $err eq 'no last chunk found'
                    ? "$name - no last chunk found - $body"
                    : "$name - invalid chunked data received ($err)");
        }
        $res->content($decoded);
        $left = $rest;
    } elsif (defined $len && $len =~ /^\d+$/) {
        if (length $body > $len) {
            $left = substr $body, $len;
            $body = substr $body, 0, $len;
        } elsif (length $body < $len && !$lenient) {
            warn "WARNING: $name - response body truncated: $len "
                 . "expected, but got " . length($body) . "\n";
        }
        $res->content($body);
    } else {
        $res->content($body);
    }

    return ($res, $raw_headers, $left, undef);
}

# Decode a chunked body.  Returns (data, bytes after the last chunk,
# error or undef).
sub dechunk ($) {
    my $raw = shift;
    my $out = '';
    my $pos = 0;
    while (1) {
        my $eol = index $raw, "\r\n", $pos;
        return ($out, undef, 'no last chunk found') if $eol < 0;
        my $line = substr $raw, $pos, $eol - $pos;
        return ($out, undef, "bad chunk size line \"$line\"")
            unless $line =~ /^[ \t]*([0-9A-Fa-f]+)[ \t]*(?:;.*)?$/;
        my $size = hex $1;
        $pos = $eol + 2;
        if ($size == 0) {
            # trailers up to the empty line
            my $end = index $raw, "\r\n", $pos;
            while ($end >= 0 && $end != $pos) {
                $pos = $end + 2;
                $end = index $raw, "\r\n", $pos;
            }
            return ($out, undef, 'unterminated last chunk') if $end < 0;
            $pos = $end + 2;
            my $rest = substr $raw, $pos;
            return ($out, $rest eq '' ? undef : $rest, undef);
        }
        if ($pos + $size > length $raw) {
            $out .= substr $raw, $pos;
            return ($out, undef, 'not enough octets for the data section');
        }
        $out .= substr $raw, $pos, $size;
        $pos += $size;
        return ($out, undef, 'expected CRLF after chunk data')
            unless substr($raw, $pos, 2) eq "\r\n";
        $pos += 2;
    }
}

# ---------------------------------------------------------------------------
# Checks

sub get_indexed_value ($$$$) {
    my ($name, $value, $idx, $need_array) = @_;
    if ($need_array) {
        return $value->[$idx] if ref $value eq 'ARRAY';
        bail_out("$name - You asked for many requests, the expected "
                 . "results should be arrays as well.");
    }
    return $value->[0] if ref $value eq 'ARRAY';
    return $value;
}

sub check_error_code ($$$$) {
    my ($block, $res, $idx, $need_array) = @_;
    my $name = $block->name;
    my $got = ($res && $res->code) || '';
    if (defined $block->error_code_like) {
        my $pat = get_indexed_value($name, $block->error_code_like, $idx,
                                    $need_array);
        Test::More::like($got, qr/$pat/sm, "$name - status code ok");
    } elsif (defined $block->error_code) {
        my $want = get_indexed_value($name, $block->error_code, $idx,
                                     $need_array);
        $want =~ s/^\s+|\s+$//g if defined $want;
        Test::More::is($got, $want, "$name - status code ok");
    } else {
        Test::More::is($got, 200, "$name - status code ok");
    }
}

sub subst_port ($) {
    my $v = shift;
    return $v if !defined $v || ref $v;
    $v =~ s/\$ServerPortForClient\b/$Test::Nginx::Util::ServerPortForClient/g;
    $v =~ s/\$ServerPort\b/$Test::Nginx::Util::ServerPort/g;
    return $v;
}

sub check_response_headers ($$$$$) {
    my ($block, $res, $raw_headers, $idx, $need_array) = @_;
    my $name = $block->name;

    if (defined $block->raw_response_headers_like) {
        my $pat = get_indexed_value($name, $block->raw_response_headers_like,
                                    $idx, $need_array);
        Test::More::like($raw_headers, qr/$pat/s,
                         "$name - raw resp headers like");
    }
    if (defined $block->raw_response_headers_unlike) {
        my $pat = get_indexed_value($name,
                                    $block->raw_response_headers_unlike,
                                    $idx, $need_array);
        Test::More::unlike($raw_headers, qr/$pat/s,
                           "$name - raw resp headers unlike");
    }

    if (defined $block->response_headers) {
        my $spec = get_indexed_value($name, $block->response_headers, $idx,
                                     $need_array);
        for my $h (@{ parse_headers($spec) }) {
            my ($key, $val) = @$h;
            if (!defined $val) {
                Test::More::unlike($raw_headers, qr/^\s*\Q$key\E\s*:/mi,
                    "$name - header $key not present in the raw headers");
                next;
            }
            my $got = $res ? $res->header($key) : undef;
            Test::More::is($got // '', subst_port($val),
                           "$name - header $key ok");
        }
    } elsif (defined $block->response_headers_like) {
        my $spec = get_indexed_value($name, $block->response_headers_like,
                                     $idx, $need_array);
        for my $h (@{ parse_headers($spec) }) {
            my ($key, $val) = @$h;
            my $got = $res ? $res->header($key) : undef;
            $val = '' unless defined $val;
            Test::More::like($got // '', qr/^$val$/,
                             "$name - header $key like ok");
        }
    }
}

sub run_body_filter ($$$) {
    my ($name, $filter, $content) = @_;
    return $filter->($content) if ref $filter eq 'CODE';
    my %simple = (
        uc => sub { uc $_[0] }, lc => sub { lc $_[0] },
        ucfirst => sub { ucfirst $_[0] }, lcfirst => sub { lcfirst $_[0] },
        length => sub { length $_[0] },
        md5_hex => sub { require Digest::MD5; Digest::MD5::md5_hex($_[0]) },
        sha1_hex => sub { require Digest::SHA; Digest::SHA::sha1_hex($_[0]) },
    );
    my $f = $simple{$filter}
        or bail_out("$name - unknown filter \"$filter\" in "
                    . "--- response_body_filters");
    return $f->($content);
}

sub transform_response_body ($$) {
    my ($block, $res) = @_;
    my $filters = $block->response_body_filters;
    return unless defined $filters && $res;
    my $name = $block->name;
    if (!ref $filters) {
        $filters =~ s/^\s+|\s+$//g;
        $filters = [split /\s+/, $filters];
    } elsif (ref $filters ne 'ARRAY') {
        $filters = [$filters];
    }
    my $content = $res->content;
    $content = run_body_filter($name, $_, $content) for @$filters;
    $res->content($content);
}

sub check_response_body ($$$$$) {
    my ($block, $res, $idx, $rep, $need_array) = @_;
    my $name = $block->name;
    my $content = $res ? $res->content : undef;

    if (defined $block->response_body) {
        my $want = get_indexed_value($name, $block->response_body, $idx,
                                     $need_array);
        if (defined $block->charset && defined $want && !ref $want) {
            Encode::from_to($want, 'UTF-8', $block->charset);
        }
        $want = subst_port($want);
        my $desc = "$name - response_body - response is expected "
                   . "(repeated req $rep, req $idx)";
        if (ref $want) {
            Test::More::like($content, $want,
                "$name - response_body - like (repeated req $rep, req $idx)");
        } else {
            my $ok = $Test::Nginx::Util::NoLongString
                     ? Test::More::is($content, $want, $desc)
                     : Test::LongString::is_string($content, $want, $desc);
            diag_diff($content, $want) unless $ok;
        }
    } elsif (defined $block->response_body_like
             || defined $block->response_body_unlike)
    {
        my $like = defined $block->response_body_like;
        my $pat = get_indexed_value($name,
            $like ? $block->response_body_like : $block->response_body_unlike,
            $idx, $need_array);
        $pat = subst_port($pat);
        my $type = $like ? 'like' : 'unlike';
        my $summary = trim($content) // '';
        $summary = substr($summary, 0, 200) . '...' if length $summary > 200;
        my $re = ref $pat eq 'Regexp' ? $pat : qr/$pat/s;
        my $desc = "$name - response_body_$type - response is expected "
                   . "($summary)";
        $like ? Test::More::like($content, $re, $desc)
              : Test::More::unlike($content, $re, $desc);
    }

    for my $check (@ResponseBodyChecks) {
        $check->($block, $content, $idx, $rep, 0);
    }
}

# A unified diff for multi-line bodies (SSE streams, JSON), in addition
# to the first-difference report of Test::LongString.
sub diag_diff ($$) {
    my ($got, $want) = @_;
    return unless defined $got && defined $want;
    return unless $got =~ /\n./ || $want =~ /\n./;
    my $diff = eval {
        require Text::Diff;
        Text::Diff::diff(\$want, \$got, { STYLE => 'Unified',
                                          FILENAME_A => 'expected',
                                          FILENAME_B => 'got' });
    };
    Test::More::diag($diff) if $diff;
}

sub fmt_str ($) {
    my $s = shift;
    chomp $s;
    $s =~ s/"/\\"/g;
    $s =~ s/\r/\\r/g;
    $s =~ s/\n/\\n/g;
    return $s;
}

# "--- error_log" and friends: a plain value is one pattern per line
# (substring match); eval values may be a qr// or an array of both.
sub patterns ($) {
    my $pats = shift;
    if (!ref $pats) {
        chomp $pats;
        return [grep { length } split /\n+/, $pats];
    }
    return [$pats] if ref $pats eq 'Regexp';
    return [@$pats];
}

sub line_matches ($$) {
    my ($line, $pat) = @_;
    return ref $pat ? $line =~ $pat : index($line, $pat) >= 0;
}

sub check_log_patterns ($$$$$) {
    my ($name, $what, $file, $lines, $spec) = @_;
    my ($want, $unwant, $rep) = @$spec;

    if (defined $want) {
        my @pats = @{ patterns($want) };
        for my $line (@$lines) {
            for my $p (@pats) {
                next unless defined $p;
                if (line_matches($line, $p)) {
                    Test::More::pass("$name - pattern \"$p\" matches a line "
                                     . "in $file (req $rep)");
                    undef $p;
                }
            }
        }
        for my $p (grep { defined } @pats) {
            Test::More::fail("$name - pattern \"$p\" should match a line "
                             . "in $file (req $rep)");
        }
    }

    if (defined $unwant) {
        for my $p (@{ patterns($unwant) }) {
            my ($hit) = grep { line_matches($_, $p) } @$lines;
            if (defined $hit) {
                Test::More::fail("$name - pattern \"" . fmt_str($p)
                    . "\" should not match any line in $file but matches "
                    . "line \"" . fmt_str($hit) . "\" (req $rep)");
            } else {
                Test::More::pass("$name - pattern \"" . fmt_str($p)
                    . "\" does not match a line in $file (req $rep)");
            }
        }
    }
}

sub check_error_log ($$$$$) {
    my ($block, $res, $dry_run, $rep, $need_array) = @_;
    my $name = $block->name;
    my $lines;

    if (defined(my $grep = $block->grep_error_log)) {
        $grep = $grep->[$rep] if ref $grep eq 'ARRAY';
        my $want = $block->grep_error_log_out;
        bail_out("$name - --- grep_error_log needs --- grep_error_log_out")
            unless defined $want;
        $want = $want->[$rep] if ref $want eq 'ARRAY';
        $lines ||= Test::Nginx::Util::error_log_data();
        my $got = '';
        for my $line (@$lines) {
            if (ref $grep ? $line =~ $grep : $line =~ /\Q$grep\E/) {
                $got .= "$&\n" if $& !~ /\n/;
            }
        }
        if (ref $want eq 'Regexp') {
            Test::More::like($got, $want,
                             "$name - grep_error_log_out (req $rep)");
        } else {
            is_str($got, $want, "$name - grep_error_log_out (req $rep)");
        }
    }

    my $want = $block->error_log;
    my $unwant = $block->no_error_log;
    if (defined $want || defined $unwant) {
        $lines ||= Test::Nginx::Util::error_log_data();
        check_log_patterns($name, 'error_log', 'error.log', $lines,
                           [$want, $unwant, $rep]);
    }

    # like the real harness: loud warnings for serious log levels nobody
    # asked about, and a failure for assertion messages
    $lines ||= Test::Nginx::Util::error_log_data();
    my $asked = join "\n", map { ref $_ eq 'ARRAY' ? @$_ : $_ }
                           grep { defined } $want, $unwant;
    for my $level (qw(alert crit emerg)) {
        next if index($asked, "[$level") >= 0;
        for my $line (@$lines) {
            warn "WARNING: $name - " . fmt_str($line) . "\n"
                if $line =~ /\[$level\]/;
        }
    }
    for my $line (@$lines) {
        if ($line =~ /\bAssertion .*?failed\b/) {
            chomp(my $l = $line);
            Test::More::fail("$name - $l");
        }
    }
}

sub check_access_log ($$) {
    my ($block, $rep) = @_;
    my $want = $block->access_log;
    my $unwant = $block->no_access_log;
    return unless defined $want || defined $unwant;
    check_log_patterns($block->name, 'access_log', 'access.log',
                       Test::Nginx::Util::access_log_data(),
                       [$want, $unwant, $rep]);
}

sub check_shutdown_error_log ($) {
    my $block = shift;
    my $name = $block->name;
    open my $in, '<', $Test::Nginx::Util::ErrLogFile or return;
    my @lines = <$in>;
    close $in;
    check_log_patterns($name, 'shutdown_error_log', 'error.log', \@lines,
                       [scalar $block->shutdown_error_log,
                        scalar $block->no_shutdown_error_log, 'shutdown']);
}

# ---------------------------------------------------------------------------
# One repetition of a block: send every request, check every response,
# then the logs.

sub run_test_helper ($$$) {
    my ($block, $dry_run, $rep) = @_;
    my $name = $block->name;

    my $reqs = get_req_from_block($block);
    bail_out("$name - request empty") unless @$reqs;

    my $timeout = parse_time($block->timeout) // Test::Nginx::Util::timeout();
    my $abort = defined $block->abort;
    my $n_pipelined = $block->pipelined_requests
                      ? scalar @{ $block->pipelined_requests } : 0;
    my $need_array = $n_pipelined ? 1 : @$reqs > 1;
    my $res;
    my $idx = 0;

    for my $r (0 .. $#$reqs) {
        my $packets = $reqs->[$r];
        my $head_req = ($packets->[0]{value} // '') =~ /^\s*HEAD\s/;
        my ($raw, $timed_out, $err) = send_request($packets, $timeout,
                                                   $block);
        $LastRawResponse = $raw;

        if (defined $err) {
            Test::More::fail("$name - $err");
        } elsif ($timed_out && !$abort) {
            Test::More::fail("ERROR: client socket timed out - $name");
        }

        my $count = $n_pipelined || 1;
        while ($count-- > 0) {
            my ($raw_headers, $left, $perr) = ('', undef, undef);
            if (!defined $block->ignore_response) {
                ($res, $raw_headers, $left, $perr) =
                    parse_response($name, $raw, $head_req,
                                   $timed_out || defined $err);
                Test::More::fail($perr) if defined $perr;

                check_error_code($block, $res, $idx, $need_array);
                check_response_headers($block, $res, $raw_headers, $idx,
                                       $need_array);
                transform_response_body($block, $res);
                check_response_body($block, $res, $idx, $rep, $need_array);
            }
            $raw = $left // '';
            if (!$n_pipelined && defined $left && $left ne '') {
                (my $l = $left) =~ s/([\0-\037\200-\377])/sprintf('\x{%02x}',ord $1)/eg;
                warn "WARNING: $name - unexpected extra bytes after the "
                     . "response: \"$l\"\n";
            }
            if ($count > 0 || $r < $#$reqs) {
                sleep parse_time($block->wait) if $block->wait;
                check_error_log($block, $res, $dry_run, $rep, $need_array);
                check_access_log($block, $rep)
                    unless defined $block->ignore_response;
            }
            $idx++;
        }
    }

    sleep parse_time($block->wait) if $block->wait;
    check_error_log($block, $res, $dry_run, $rep, $need_array);
    check_access_log($block, $rep) unless defined $block->ignore_response;
}

1;
__END__

=head1 NAME

Test::Nginx::Socket - clean-room subset of the CPAN test scaffold (DPD)

=head1 SYNOPSIS

    use Test::Nginx::Socket 'no_plan';

    log_level('warn');
    no_shuffle();
    run_tests();

    __DATA__

    === TEST 1: echo
    --- config
        location /t { return 200 "hello\n"; }
    --- request
    GET /t
    --- response_body
    hello
    --- no_error_log
    [error]

=head1 DESCRIPTION

Used by tools/run-tests.sh only when the real Test::Nginx::Socket is not
installed.  Test files must stay valid for the real module; so this one
follows its format and semantics: Test::Base blocks (C<--- ONLY>,
C<--- SKIP>, C<--- LAST>, filters such as C<eval> and C<chomp>), one nginx
per block, blocks shuffled unless C<no_shuffle()>, default log level
C<debug>, C<master_process off> unless C<master_on()>, the same TAP test
names and the same number of tests per block:

=over

=item * 1 status test per response (C<--- error_code>,
C<--- error_code_like>, else 200),

=item * 1 per C<--- response_headers> / C<--- response_headers_like> line
(C<!Name> asserts absence), 1 per C<--- raw_response_headers_like|unlike>,

=item * 1 for C<--- response_body> (C<eval> may give a qr//),
C<--- response_body_like> or C<--- response_body_unlike>,

=item * 1 per pattern of C<--- error_log>, C<--- no_error_log>,
C<--- access_log>, C<--- no_access_log>, C<--- shutdown_error_log>,
C<--- no_shutdown_error_log> (plain text: one substring per line;
C<eval>: qr// or an array of strings and qr//),

=item * C<--- must_die>: 1 test (non-zero exit, or the given exit code)
plus the C<--- error_log> patterns (start-up messages are there because
nginx gets C<-e> pointing at the block's error log).

=back

Sections: main_config, http_config, config, post_main_config,
server_name, log_level, user_files, init, request (string, C<eval>
array of requests or packet arrays), raw_request, raw_request_middle_delay,
pipelined_requests, more_headers, timeout (inactivity timeout, C<ms>/C<s>
suffixes), abort, wait, shutdown, ignore_response, error_code(_like),
response_headers(_like), raw_response_headers_(un)like,
response_body(_like|_unlike), response_body_filters, charset,
error_log, no_error_log, grep_error_log(_out), access_log,
no_access_log, shutdown_error_log, no_shutdown_error_log, must_die,
skip_nginx, skip_eval, todo.

Environment: TEST_NGINX_BINARY, TEST_NGINX_LOAD_MODULES (a C<load_module>
line each, at the top of nginx.conf), TEST_NGINX_SERVROOT,
TEST_NGINX_PORT / TEST_NGINX_SERVER_PORT / TEST_NGINX_CLIENT_PORT,
TEST_NGINX_TIMEOUT, TEST_NGINX_SLEEP, TEST_NGINX_LOG_LEVEL,
TEST_NGINX_MASTER_PROCESS, TEST_NGINX_NO_SHUFFLE, TEST_NGINX_NO_CLEAN,
TEST_NGINX_USE_VALGRIND, TEST_NGINX_VALGRIND_SUPPRESS, TEST_NGINX_VERBOSE.
Every C<$TEST_NGINX_*> in the config sections, user files, requests and
more_headers is replaced by the environment value (an undefined one stops
the run).  For portability to the real module, prefer
C<--- request eval> with C<$ENV{TEST_NGINX_...}> in requests.

=head1 DIFFERENCES FROM THE REAL MODULE

=over

=item * TEST_NGINX_USE_VALGRIND=1 B<fails> a block (one extra failing
test with the report) when memcheck reports an invalid access, use of
uninitialised memory, a bad free, a definite leak or a crash.  The real
harness only prints valgrind's report.  Reports go to
servroot/logs/valgrind.PID.log; suppressions come from
TEST_NGINX_VALGRIND_SUPPRESS, else t/valgrind.suppress, else
valgrind.suppress.  Under valgrind the default inactivity timeout is 10 s
(unless TEST_NGINX_TIMEOUT is set).

=item * nginx is stopped (QUIT, then KILL after a grace period) at the end
of each block rather than at the start of the next one; HUP reloads
(TEST_NGINX_USE_HUP) are not implemented.

=item * Temp paths (client_body_temp_path, proxy_temp_path, ...) are set
inside the server root unless the test sets them, because Debian's nginx
defaults to /var/lib/nginx.

=item * A block without C<--- config> reuses the running nginx of the
previous block (as the real module does); it also gets its
C<--- user_files> written.  Under valgrind nginx is stopped after every
block, so such a block restarts nginx with the previous configuration.

=item * A client timeout without C<--- abort> fails the block and, unlike
the real module (whose timeout handler turns off Test::Builder's ending),
leaves the plan and the exit status in place.

=item * No HTTP/2, HTTP/3, stap, TCP/UDP mock servers, HUP reloads,
TEST_NGINX_CHECK_LEAK or benchmark modes, curl output.

=back

=cut
