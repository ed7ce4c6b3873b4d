package Test::Nginx::Util;

# Clean-room implementation of the part of Test::Nginx::Util (CPAN,
# openresty/test-nginx) that the DPD gateway tests use: settings, the
# server root, nginx.conf generation, the nginx process life cycle
# (plain, must_die, valgrind) and error-log access.  Written from the
# module's documented behaviour; see Test/Nginx/Socket.pm for the list of
# supported sections and the deliberate differences.

use strict;
use warnings;

our $VERSION = '0.30_dpd';

use base 'Exporter';

use Cwd qw(cwd);
use File::Path qw(make_path remove_tree);
use File::Spec ();
use IO::Socket::INET ();
use List::Util qw(shuffle);
use POSIX qw(:sys_wait_h SIGQUIT SIGKILL SIGTERM);
use Test::More ();
use Test::LongString ();
use Time::HiRes qw(sleep time);

# ---------------------------------------------------------------------------
# Settings (environment first, then the setters the .t files call)

our $NginxBinary       = $ENV{TEST_NGINX_BINARY} || 'nginx';
our $LoadModules       = $ENV{TEST_NGINX_LOAD_MODULES};
our $UseValgrind       = $ENV{TEST_NGINX_USE_VALGRIND};
our $CheckLeak         = $ENV{TEST_NGINX_CHECK_LEAK} || 0;
our $Verbose           = $ENV{TEST_NGINX_VERBOSE};
our $NoShuffle         = $ENV{TEST_NGINX_NO_SHUFFLE} || 0;
our $Timeout           = $ENV{TEST_NGINX_TIMEOUT} || 3;
our $TestNginxSleep    = $ENV{TEST_NGINX_SLEEP} || 0.015;
our $LogLevel          = $ENV{TEST_NGINX_LOG_LEVEL} || 'debug';
our $MasterProcessEnabled = $ENV{TEST_NGINX_MASTER_PROCESS} || 'off';
our $DaemonEnabled     = 'on';
our $Workers           = 1;
our $WorkerConnections = 64;
our $ServerPort        = $ENV{TEST_NGINX_SERVER_PORT}
                         || $ENV{TEST_NGINX_PORT} || 1984;
our $ServerPortForClient = $ENV{TEST_NGINX_CLIENT_PORT} || $ServerPort;
our $ServerAddr        = '127.0.0.1';
our $ServerName        = 'localhost';
our $NoRootLocation    = 0;
our $NoLongString;
our $RepeatEach        = 1;
our $ConfigPreamble    = '';
our $CheckAccumErrLog  = $ENV{TEST_NGINX_CHECK_ACCUM_ERR_LOG};
our $NoNginxManager    = $ENV{TEST_NGINX_NO_NGINX_MANAGER} || 0;
our @EnvToNginx;
our @BlockPreprocessors;
our @CleanupHandlers;

# Under valgrind nginx stays in the foreground as our child (daemon off);
# master_process keeps whatever the test file or environment asked for.
if ($UseValgrind) {
    $DaemonEnabled = 'off';
    # memcheck slows nginx ~20x: a longer default inactivity timeout
    # (blocks with their own --- timeout keep it)
    $Timeout = 10 unless $ENV{TEST_NGINX_TIMEOUT};
}

our $ServRoot = $ENV{TEST_NGINX_SERVROOT}
                || File::Spec->rel2abs('t/servroot');
$ServRoot = File::Spec->rel2abs($ServRoot);
$ServRoot =~ s{/+$}{};

our $LogDir     = "$ServRoot/logs";
our $ErrLogFile = "$LogDir/error.log";
our $AccLogFile = "$LogDir/access.log";
our $HtmlDir    = "$ServRoot/html";
our $ConfDir    = "$ServRoot/conf";
our $ConfFile   = "$ConfDir/nginx.conf";
our $PidFile    = "$LogDir/nginx.pid";

# Variables the config sections may reference as $TEST_NGINX_*.
$ENV{TEST_NGINX_SERVER_ROOT} = $ServRoot;
$ENV{TEST_NGINX_SERVROOT} ||= $ServRoot;
$ENV{TEST_NGINX_HTML_DIR}    = $HtmlDir;
$ENV{TEST_NGINX_CONF_DIR}    = $ConfDir;
$ENV{TEST_NGINX_LOG_DIR}     = $LogDir;
$ENV{TEST_NGINX_PORT}        ||= $ServerPort;

# Hooks Socket.pm installs.
our $RunTestHelper;
our $CheckErrorLog;
our $CheckShutdownErrorLog;

our $NginxVersion;        # canonical: 1.022001
our $NginxRawVersion;     # "1.22.1"
our $ErrLogFilePos = 0;
our $ChildPid;            # nginx (or valgrind) running in the foreground
our $CurrentBlock;        # block whose nginx is running
our $CurrentValgrind;     # ... and whether it runs under valgrind
our $PrevConfig;          # last --- config, for blocks without one
our $InSubprocess;
our $ValgrindFailures = 0;

our @EXPORT = qw(
    env_to_nginx is_str no_long_string server_addr server_name
    timeout no_shuffle no_nginx_manager repeat_each worker_connections
    workers log_level master_on master_off master_process_enabled
    config_preamble add_block_preprocessor add_cleanup_handler
    no_root_location html_dir server_root server_port
    server_port_for_client check_accum_error_log bail_out run_tests
    error_log_data access_log_data parse_time parse_headers trim
    show_all_chars get_nginx_version get_canon_version
    get_pid_from_pidfile is_running sleep_time verbose use_hup
    setup_server_root write_config_file
    $ServerPort $ServerPortForClient $ServRoot $ConfFile $PidFile
    $NginxVersion $NoLongString $RepeatEach $CheckLeak
    $RunTestHelper $CheckErrorLog $CheckShutdownErrorLog $NoNginxManager
);

# ---------------------------------------------------------------------------
# Setters / getters

sub env_to_nginx (@) {
    die "env_to_nginx: no arguments specified\n" unless @_;
    for my $v (@_) {
        die "env_to_nginx: bad argument value: $v\n"
            if $v !~ /^[A-Za-z_]/ || $v =~ /\n/;
        push @EnvToNginx, $v;
    }
}

sub no_long_string ()       { $NoLongString = 1 }
sub no_shuffle ()           { $NoShuffle = 1 }
sub no_nginx_manager ()     { $NoNginxManager = 1 }
sub no_root_location ()     { $NoRootLocation = 1 }
sub check_accum_error_log () { $CheckAccumErrLog = 1 }
sub use_hup ()              { }   # reload is never used: restart per block
sub master_on ()            { $MasterProcessEnabled = 'on' }
sub master_off ()           { $MasterProcessEnabled = 'off' }
sub sleep_time ()           { $TestNginxSleep }
sub verbose ()              { $Verbose }
sub html_dir ()             { $HtmlDir }
sub server_root ()          { $ServRoot }
sub config_preamble ($)     { $ConfigPreamble = shift }
sub add_cleanup_handler ($) { unshift @CleanupHandlers, shift }
sub add_block_preprocessor (&) { unshift @BlockPreprocessors, shift }

sub _accessor {
    my ($ref, @args) = @_;
    $$ref = shift @args if @args;
    return $$ref;
}

sub server_addr (@)            { _accessor(\$ServerAddr, @_) }
sub server_name (@)            { _accessor(\$ServerName, @_) }
sub timeout (@)                { _accessor(\$Timeout, @_) }
sub worker_connections (@)     { _accessor(\$WorkerConnections, @_) }
sub workers (@)                { _accessor(\$Workers, @_) }
sub log_level (@)              { _accessor(\$LogLevel, @_) }
sub server_port_for_client (@) { _accessor(\$ServerPortForClient, @_) }

sub server_port (@) {
    if (@_) {
        $ServerPort = shift;
        $ServerPortForClient = $ServerPort;
    }
    return $ServerPort;
}

sub repeat_each (@) {
    $RepeatEach = shift if @_ && !$CheckLeak;
    return $RepeatEach;
}

sub master_process_enabled (@) {
    $MasterProcessEnabled = $_[0] ? 'on' : 'off' if @_;
    return $MasterProcessEnabled;
}

sub is_str (@) {
    my ($got, $expected, $desc) = @_;
    if (ref $expected && ref $expected eq 'Regexp') {
        return Test::More::like($got, $expected, $desc);
    }
    return Test::More::is($got, $expected, $desc) if $NoLongString;
    return Test::LongString::is_string($got, $expected, $desc);
}

sub bail_out (@) {
    cleanup();
    Test::More::BAIL_OUT(join '', @_);
}

# ---------------------------------------------------------------------------
# Small helpers

sub parse_time ($) {
    my $tm = shift;
    return undef unless defined $tm;
    $tm =~ s/^\s+|\s+$//g;
    if ($tm =~ s/([^_a-zA-Z])ms$/$1/) {
        return $tm / 1000;
    }
    $tm =~ s/([^_a-zA-Z])s$/$1/;
    return $tm;
}

sub trim ($) {
    my $s = shift;
    return undef unless defined $s;
    $s =~ s/^\s+|\s+$//g;
    $s =~ s/\n/ /g;
    $s =~ s/\s{2,}/ /g;
    return $s;
}

sub show_all_chars ($) {
    my $s = shift;
    $s =~ s/\n/\\n/g;
    $s =~ s/\r/\\r/g;
    $s =~ s/\t/\\t/g;
    return $s;
}

# "Name: value" lines; "!Name" means the header must be absent.  Returns
# a list of [name, value-or-undef] pairs in file order.
# One entry per header name, as the real module's hash: a name given twice
# (say "X-A: 1" and "!X-A") is checked once, for its last line.
sub parse_headers ($) {
    my $s = shift;
    my (@headers, %at);
    for my $line (split /\n/, $s) {
        $line =~ s/^\s+|\s+$//g;
        next if $line eq '';
        my ($key, $val);
        if ($line =~ s/^!\s*//) {
            ($key, $val) = ($line, undef);
        } else {
            ($key, $val) = split /\s*:\s*/, $line, 2;
            $val = '' unless defined $val;
        }
        if (exists $at{$key}) {
            $headers[$at{$key}][1] = $val;
        } else {
            $at{$key} = @headers;
            push @headers, [$key, $val];
        }
    }
    return \@headers;
}

# A zombie counts as gone: a daemonized nginx is reparented to PID 1,
# which may reap it long after it exited.
sub is_running ($) {
    my $pid = shift;
    return 0 unless $pid && kill(0, $pid);
    if (open my $in, '<', "/proc/$pid/stat") {
        my $stat = <$in> // '';
        close $in;
        return 0 if $stat =~ /^\d+ \(.*\) Z/s;
    }
    return 1;
}

sub get_canon_version (@) {
    return sprintf "%d.%03d%03d", $_[0], $_[1], $_[2];
}

sub get_nginx_version () {
    my $out = `$NginxBinary -V 2>&1`;
    if (!defined $out || $? != 0) {
        bail_out("Failed to get the version of nginx ($NginxBinary): "
                 . ($out // ''));
    }
    if ($out =~ m{(?:nginx|openresty)[^/]*/(\d+)\.(\d+)\.(\d+)}s) {
        $NginxRawVersion = "$1.$2.$3";
        return get_canon_version($1, $2, $3);
    }
    bail_out("Failed to parse the output of \"$NginxBinary -V\": $out");
}

sub get_pid_from_pidfile ($) {
    my $name = shift;
    open my $in, '<', $PidFile or return undef;
    my $pid = do { local $/; <$in> };
    close $in;
    return undef unless defined $pid;
    $pid =~ s/\s+//g;
    return $pid =~ /^\d+$/ ? $pid : undef;
}

# $TEST_NGINX_FOO -> $ENV{TEST_NGINX_FOO}; an unknown name is a hard error
# (same as the real harness) so typos do not silently produce bad configs.
sub expand_env_in_text ($$) {
    my ($text, $name) = @_;
    return $text unless defined $text && !ref $text;
    $text =~ s{\$(TEST_NGINX_[_A-Z0-9]+)}{
        defined $ENV{$1}
            ? $ENV{$1}
            : bail_out("$name - No environment $1 defined.\n")
    }ge;
    return $text;
}

sub _slurp {
    my $file = shift;
    open my $in, '<', $file or return undef;
    local $/;
    my $data = <$in>;
    close $in;
    return $data;
}

# ---------------------------------------------------------------------------
# Logs

sub error_log_data () {
    # log-phase messages are written after the response has been sent
    sleep $TestNginxSleep * 3;
    open my $in, '<', $ErrLogFile or return [];
    if (!$CheckAccumErrLog && $ErrLogFilePos > 0) {
        seek $in, $ErrLogFilePos, 0;
    }
    my @lines = <$in>;
    $ErrLogFilePos = tell($in) unless $CheckAccumErrLog;
    close $in;
    return \@lines;
}

sub access_log_data () {
    sleep $TestNginxSleep * 3;
    open my $in, '<', $AccLogFile or return [];
    my @lines = <$in>;
    close $in;
    return \@lines;
}

# ---------------------------------------------------------------------------
# Server root and nginx.conf

sub setup_server_root () {
    if (-d $ServRoot) {
        # Remove only what we create, so a mistaken TEST_NGINX_SERVROOT
        # never wipes user data; then, as the real module does, the
        # directory itself: anything else a test left in it (a file, a
        # socket, a symlink) stops the run here.
        remove_tree($ConfDir, $HtmlDir, $LogDir, "$ServRoot/cache",
                    glob("$ServRoot/*_temp"), glob("$ServRoot/*_cache"));
        rmdir $ServRoot
            or bail_out("Can't remove $ServRoot (not empty?): $!");
    }
    for my $dir ($ServRoot, $LogDir, $HtmlDir, $ConfDir) {
        next if -d $dir;
        make_path($dir) or bail_out("Failed to mkdir $dir: $!");
    }
    open my $out, '>', "$HtmlDir/index.html"
        or bail_out("Can't write $HtmlDir/index.html: $!");
    print $out '<html><head><title>It works!</title></head>'
               . '<body>It works!</body></html>';
    close $out;
}

sub write_user_files ($) {
    my $block = shift;
    my $name = $block->name;
    my $files = $block->user_files;
    return unless defined $files;

    if (!ref $files) {
        my @list;
        my ($fname, $date, $body);
        for my $line (split /^/, $files) {
            if ($line =~ /^>>> (\S+)(?:\s+(.+?))?\s*$/) {
                push @list, [$fname, $body, $date] if defined $fname;
                ($fname, $date, $body) = ($1, $2, undef);
                next;
            }
            $body .= $line;
        }
        push @list, [$fname, $body, $date] if defined $fname;
        $files = \@list;
    } elsif (ref $files ne 'ARRAY') {
        bail_out("$name - --- user_files: only a string or an ARRAY");
    }

    for my $f (@$files) {
        my ($fname, $body, $date) = @$f;
        $body = '' unless defined $body;
        my $path = $fname =~ m{^/} ? $fname : "$HtmlDir/$fname";
        if ($path =~ m{^(.*)/}) {
            make_path($1) unless -d $1;
        }
        $body = expand_env_in_text($body, $name);
        open my $out, '>', $path
            or bail_out("$name - Cannot open $path for writing: $!");
        binmode $out;
        print $out $body;
        close $out;
        if ($date) {
            system('touch', '-t', $date, $path) == 0
                or bail_out("$name - touch -t $date $path failed");
        }
    }
}

# The temp paths nginx would otherwise take from its compile-time defaults
# (/var/lib/nginx/... on Debian); skipped when the test sets one itself.
my @TempPathDirectives = qw(client_body_temp_path proxy_temp_path
                            fastcgi_temp_path uwsgi_temp_path
                            scgi_temp_path);

sub write_config_file ($$) {
    my ($block, $config) = @_;
    my $name = $block->name;

    my $main_config = expand_env_in_text($block->main_config // '', $name);
    my $http_config = expand_env_in_text($block->http_config // '', $name);
    my $post_main   = expand_env_in_text($block->post_main_config // '',
                                         $name);
    my $server_name = $block->server_name // $ServerName;
    my $log_level   = $block->log_level // $LogLevel;
    $log_level =~ s/^\s+|\s+$//g;

    # as the real module: the load_module lines go in front of the
    # block's main_config, on its first line
    if ($LoadModules) {
        my @modules = map { "load_module $_;" } grep { length }
                      split /\s+/, $LoadModules;
        $main_config = join ' ', @modules, $main_config if @modules;
    }

    my $env = '';
    for my $v (@EnvToNginx) {
        $env .= "env " . ($v =~ /\s/ ? "'$v'" : $v) . ";\n";
    }

    my $temp = '';
    for my $d (@TempPathDirectives) {
        next if $http_config =~ /\b$d\b/ || $config =~ /\b$d\b/;
        (my $dir = $d) =~ s/_path$//;
        $temp .= "    $d $ServRoot/$dir;\n";
    }

    my $root_location = $NoRootLocation ? '' : <<"_EOC_";
        location / {
            root $HtmlDir;
            index index.html index.htm;
        }
_EOC_

    my $user = $> == 0 ? "user root;\n" : '';

    open my $out, '>', $ConfFile
        or bail_out("Can't open $ConfFile for writing: $!");
    print $out <<"_EOC_";
# generated by the clean-room Test::Nginx (t/lib) for: $name
worker_processes  $Workers;
daemon $DaemonEnabled;
master_process $MasterProcessEnabled;
error_log $ErrLogFile $log_level;
pid       $PidFile;
env LD_PRELOAD;
env LD_LIBRARY_PATH;
$env$user
$main_config

http {
    access_log $AccLogFile;

    default_type text/plain;
    keepalive_timeout  68;
$temp
$http_config

    server {
        listen          $ServerPort;
        server_name     '$server_name';

        client_max_body_size 30M;

        # Begin preamble config...
$ConfigPreamble
        # End preamble config...

        # Begin test case config...
$config
        # End test case config.

$root_location    }
}

$post_main

events {
    accept_mutex off;
    worker_connections  $WorkerConnections;
}
_EOC_
    close $out;
}

# ---------------------------------------------------------------------------
# nginx processes

sub valgrind_suppressions () {
    # t/valgrind.suppress also when run from elsewhere (this file is
    # t/lib/Test/Nginx/Util.pm)
    (my $t_dir = File::Spec->rel2abs(__FILE__)) =~ s{/lib/Test/Nginx/[^/]+$}{};
    for my $f ($ENV{TEST_NGINX_VALGRIND_SUPPRESS}, 't/valgrind.suppress',
               'valgrind.suppress', "$t_dir/valgrind.suppress")
    {
        return File::Spec->rel2abs($f) if defined $f && -f $f;
    }
    return undef;
}

sub nginx_command () {
    my @cmd = ($NginxBinary, '-p', "$ServRoot/", '-c', $ConfFile);
    # -e (nginx >= 1.19.5) sends start-up messages to our error log too,
    # so must_die blocks can check the reason even when the binary's
    # compiled-in error log is stderr or /var/log/nginx/error.log.
    if (defined $NginxVersion && $NginxVersion >= 1.019005) {
        push @cmd, '-e', $ErrLogFile;
    }
    return @cmd;
}

sub valgrind_command () {
    my @cmd = ('valgrind');
    if ($UseValgrind =~ /^\d+$/) {
        push @cmd, qw(-q --tool=memcheck --leak-check=full
                      --show-possibly-lost=no --num-callers=50
                      --gen-suppressions=all);
        my $supp = valgrind_suppressions();
        push @cmd, "--suppressions=$supp" if $supp;
    } else {
        push @cmd, split ' ', $UseValgrind;
    }
    push @cmd, "--log-file=$LogDir/valgrind.%p.log";
    return @cmd;
}

# Returns undef on success, or an error message.
sub start_nginx ($$) {
    my ($block, $use_valgrind) = @_;
    my $name = $block->name;
    my @cmd = nginx_command();

    if ($use_valgrind) {
        unshift @cmd, valgrind_command();
        warn "$name\n" if $Verbose;
        my $pid = fork();
        bail_out("$name - fork() failed: $!") unless defined $pid;
        if ($pid == 0) {
            $InSubprocess = 1;
            setpgrp(0, 0);
            open STDOUT, '>', '/dev/null';
            open STDERR, '>>', "$LogDir/nginx.stderr";
            exec @cmd or POSIX::_exit(127);
        }
        $ChildPid = $pid;
        sleep $TestNginxSleep;
        return undef;
    }

    # daemon on: the command returns once nginx runs in the background.
    # Retry a little when the previous instance still holds the port.
    my $waited = 0;
    my $try = 0;
    while (1) {
        my $status = run_cmd_quiet(\@cmd);
        return undef if $status == 0;
        my $log = _slurp($ErrLogFile) // '';
        $log .= _slurp("$LogDir/nginx.stderr") // '';
        if ($log =~ /Address already in use/ && $waited < 10) {
            my $delay = 0.1 * ++$try;
            $delay = 1 if $delay > 1;
            sleep $delay;
            $waited += $delay;
            truncate $ErrLogFile, 0;
            next;
        }
        my @lines = grep { /\[(?:emerg|alert|crit|error)\]|nginx: / }
                    split /\n/, $log;
        splice @lines, 0, @lines - 20 if @lines > 20;
        my $tail = join "\n", @lines;
        return "Cannot start nginx using command \"@cmd\" "
               . "(status $status):\n$tail";
    }
}

sub run_cmd_quiet ($) {
    my $cmd = shift;
    my $pid = fork();
    bail_out("fork() failed: $!") unless defined $pid;
    if ($pid == 0) {
        $InSubprocess = 1;
        open STDOUT, '>', '/dev/null';
        open STDERR, '>>', "$LogDir/nginx.stderr";
        exec @$cmd or POSIX::_exit(127);
    }
    waitpid($pid, 0);
    return $?;
}

# Wait until $pid is gone (reaping it when it is our child).
sub wait_gone ($$) {
    my ($pid, $secs) = @_;
    my $deadline = time + $secs;
    while (time < $deadline) {
        waitpid($pid, WNOHANG);
        return 1 unless is_running($pid);
        sleep 0.02;
    }
    waitpid($pid, WNOHANG);
    return !is_running($pid);
}

sub is_nginx_process ($) {
    my $pid = shift;
    open my $in, '<', "/proc/$pid/cmdline" or return is_running($pid);
    my $cmd = do { local $/; <$in> } // '';
    close $in;
    return $cmd =~ /nginx|valgrind|memcheck/;
}

# Graceful stop: QUIT (in-flight requests may finish), then TERM (fast
# shutdown: exit handlers and valgrind's leak check still run), then KILL
# (the whole process group for our foreground child).
sub stop_nginx ($) {
    my $name = shift;
    my $pid = get_pid_from_pidfile($name);
    my $child = $ChildPid;

    # a stale pid file may name a recycled pid: only signal an nginx
    if ($pid && !$child && !is_nginx_process($pid)) {
        unlink $PidFile;
        undef $pid;
    }
    my $target = $child || $pid;
    return unless $target;

    my $quit_grace = $Timeout > 3 ? $Timeout : 3;
    my $term_grace = $child && $UseValgrind ? 60 : 5;

    if (is_running($target)) {
        my $signalled = $pid && is_running($pid) ? $pid : $target;
        kill SIGQUIT, $signalled;
        if (!wait_gone($target, $quit_grace)) {
            kill SIGTERM, $signalled;
            if (!wait_gone($target, $term_grace)) {
                warn "$name - nginx $target did not exit after QUIT and "
                     . "TERM; killing it\n";
                kill SIGKILL, -$child if $child;
                kill SIGKILL, $target;
                wait_gone($target, 5);
            }
        }
    } elsif ($child) {
        waitpid($child, WNOHANG);
    }

    # a master we did not fork must be gone too
    if ($pid && $pid != $target && is_running($pid)) {
        kill SIGKILL, $pid;
        wait_gone($pid, 5);
    }

    undef $ChildPid;
    unlink $PidFile if -f $PidFile;
}

sub cleanup () {
    $_->() for @CleanupHandlers;
    if (defined $ChildPid || -f $PidFile) {
        stop_nginx('cleanup');
    }
}

# ---------------------------------------------------------------------------
# Valgrind report

# Error kinds that fail a block: invalid accesses, use of uninitialised
# memory, bad frees, definite leaks, and a crash under valgrind.
my $ValgrindErrorRe = qr{
    Invalid\ (?:read|write|free|alignment) |
    Mismatched\ free |
    Conditional\ jump\ or\ move\ depends\ on\ uninitialised |
    Use\ of\ uninitialised\ value |
    Syscall\ param\ .*\ (?:uninitialised|unaddressable) |
    Source\ and\ destination\ overlap |
    definitely\ lost\ in |
    Process\ terminating\ with\ default\ action |
    Argument\ .*\ of\ function\ .*\ has\ a\ fishy
}x;

sub check_valgrind_report ($) {
    my $name = shift;
    my @errors;
    my $report = '';
    for my $log (sort glob("$LogDir/valgrind.*.log")) {
        my $text = _slurp($log) // '';
        next if $text eq '';
        $report .= $text;
        for my $line (split /\n/, $text) {
            push @errors, $1 if $line =~ /^==\d+==\s+(.*(?:$ValgrindErrorRe).*)$/;
        }
    }
    if ($report ne '' && !@errors) {
        # warnings only (e.g. "Warning: set address range perms")
        warn "$name - valgrind output:\n$report" if $Verbose;
        return;
    }
    return unless @errors;

    $ValgrindFailures++;
    Test::More::fail("$name - valgrind reported "
                     . scalar(@errors) . " error(s): $errors[0]");
    Test::More::diag($report);
}

# ---------------------------------------------------------------------------
# The block loop

sub skip_spec ($) {
    my $block = shift;
    my $name = $block->name;

    if (defined(my $spec = $block->skip_nginx)) {
        if ($spec =~ /^\s*(\d+)\s*:\s*([<>]=?)\s*(\d+)\.(\d+)\.(\d+)
                      (?:\s*:\s*(.*?))?\s*$/xs)
        {
            my ($n, $op, $reason) = ($1, $2, $6);
            my $ver = get_canon_version($3, $4, $5);
            $reason = "nginx version $op $3.$4.$5" unless $reason;
            my $skip = eval "$NginxVersion $op $ver";
            return ($n, $reason) if $skip;
            return;
        }
        bail_out("$name - Invalid --- skip_nginx spec: $spec");
    }

    if (defined(my $spec = $block->skip_eval)) {
        if ($spec =~ /^\s*(\d+)\s*:\s*(.*)$/s) {
            my ($n, $code) = ($1, $2);
            my $skip = eval $code;
            bail_out("$name - skip_eval failed: $@") if $@;
            return ($n, 'skip_eval') if $skip;
            return;
        }
        bail_out("$name - Invalid --- skip_eval spec: $spec");
    }
    return;
}

sub run_tests () {
    $NginxVersion = get_nginx_version();
    $ENV{TEST_NGINX_SERVER_PORT} = $ServerPort
        unless defined $ENV{TEST_NGINX_SERVER_PORT};

    my @blocks = Test::Base::blocks();
    @blocks = shuffle @blocks unless $NoShuffle;

    for my $block (@blocks) {
        $_->($block) for @BlockPreprocessors;
        $block->set_value('name', "$0 " . $block->name);
        run_test($block);
    }

    # TEST_NGINX_NO_CLEAN leaves the last nginx running for inspection
    if ($ENV{TEST_NGINX_NO_CLEAN} && !$UseValgrind) {
        undef $ChildPid;
        undef $CurrentBlock;
        return;
    }
    finish_running_nginx('run_tests');
    cleanup();
}

# Stop the nginx of the block that started it, then run that block's
# shutdown_error_log checks and (under valgrind) the memcheck verdict.
sub finish_running_nginx ($) {
    my $why = shift;
    my $block = $CurrentBlock;
    my $valgrind = $CurrentValgrind;
    stop_nginx($block ? $block->name : $why)
        if $ChildPid || -f $PidFile;
    undef $CurrentBlock;
    undef $CurrentValgrind;
    return unless $block;

    if (defined $block->shutdown_error_log
        || defined $block->no_shutdown_error_log)
    {
        $CheckShutdownErrorLog->($block);
    }
    check_valgrind_report($block->name) if $valgrind;
}

sub nginx_alive () {
    return is_running($ChildPid) if $ChildPid;
    return is_running(get_pid_from_pidfile(''));
}

sub run_test ($) {
    my $block = shift;
    return if defined $block->SKIP;

    my $name = $block->name;
    my ($skip_n, $skip_reason) = skip_spec($block);

    if (defined $skip_n) {
        for (1 .. $RepeatEach) {
            SKIP: { Test::More::skip("$name - $skip_reason", $skip_n); }
        }
        return;
    }

    if ($NoNginxManager) {
        return run_requests($block);
    }

    my $must_die = $block->must_die;
    my $use_valgrind = $UseValgrind && !defined $must_die;
    local $DaemonEnabled = $use_valgrind ? 'off' : 'on';

    my $config;
    if (defined $block->config) {
        $config = expand_env_in_text($block->config, $name);
        $PrevConfig = $config;
    } else {
        # like the real harness: a block without --- config talks to the
        # nginx of the previous block (state such as counters in shared
        # memory carries over)
        if (!defined $must_die && $CurrentBlock && nginx_alive()) {
            write_user_files($block);
            return run_requests($block);
        }
        $config = $PrevConfig // '';
    }

    finish_running_nginx($name);

    setup_server_root();
    write_user_files($block);
    write_config_file($block, $config);
    $ErrLogFilePos = 0;

    if (defined $must_die) {
        my @cmd = nginx_command();
        for my $i (0 .. $RepeatEach - 1) {
            truncate $ErrLogFile, 0 if -f $ErrLogFile;
            $ErrLogFilePos = 0;
            my $status = run_cmd_quiet(\@cmd);
            my $code = $status >> 8;
            if ($status & 127) {
                Test::More::fail("$name - nginx died from signal "
                                 . ($status & 127));
            } elsif ($must_die =~ /^\s*(\d+)\s*$/) {
                Test::More::is($code, $1,
                               "$name - die with the expected exit code");
            } else {
                Test::More::isnt($status, 0, "$name - die as expected");
            }
            $CheckErrorLog->($block, undef, 0, $i, 0);
            if ($status == 0) {
                warn "WARNING: $name - nginx must die but it does not; "
                     . "killing it\n";
                for (1 .. 20) { last if -f $PidFile; sleep $TestNginxSleep }
                stop_nginx($name);
            }
        }
        return;
    }

    if (my $err = start_nginx($block, $use_valgrind)) {
        Test::More::fail("$name - $err");
        stop_nginx($name);
        return;
    }
    $CurrentBlock = $block;
    $CurrentValgrind = $use_valgrind;
    sleep $TestNginxSleep;

    run_requests($block);

    # under valgrind the verdict needs nginx's exit (leak check), so the
    # block's nginx stops now, as in the real harness
    finish_running_nginx($name) if $use_valgrind;
}

sub run_requests ($) {
    my $block = shift;
    my $name = $block->name;

    if (defined(my $init = $block->init)) {
        eval $init;
        bail_out("$name - init failed: $@") if $@;
    }

    $ErrLogFilePos = 0;
    for my $i (0 .. $RepeatEach - 1) {
        write_user_files($block) if $i > 0;
        if (defined $block->todo && $block->todo =~ /^\s*(\d+)\s*:\s*(.*)$/s) {
            my ($n, $reason) = ($1, $2);
            TODO: { Test::More::todo_skip("$name - $reason", $n); }
            next;
        }
        $RunTestHelper->($block, 0, $i);
    }
}

END {
    return if $InSubprocess;
    local $?;
    if ($ENV{TEST_NGINX_NO_CLEAN} && !$UseValgrind) {
        return;
    }
    cleanup();
}

1;
