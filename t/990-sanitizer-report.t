# Closes a sanitizer run (tools/run-sanitized.sh, `make test-asan`): fails
# on every AddressSanitizer / UndefinedBehaviorSanitizer / LeakSanitizer
# report the nginx processes wrote under $DPD_SAN_LOG_DIR, and checks that
# the run really used the instrumented module and the preloaded runtime.
# Skipped outside such a run.
use strict;
use warnings;
use Test::More;

my $dir = $ENV{DPD_SAN_LOG_DIR};
plan(skip_all => 'not a sanitizer run (DPD_SAN_LOG_DIR unset)')
    unless $dir;

sub slurp {
    my $f = shift;
    open my $in, '<', $f or return '';
    local $/;
    return scalar <$in>;
}

# the run was real: nginx started through the wrapper, and the module is
# the instrumented build
my @started = grep { length } split /\n/, slurp("$dir/invocations");
ok(@started > 0, 'nginx started through tools/nginx-sanitized')
    or diag("no $dir/invocations: TEST_NGINX_BINARY is "
            . ($ENV{TEST_NGINX_BINARY} // 'unset'));

my $so = $ENV{DPD_SAN_MODULE} // '';
my $syms = -f $so ? `nm -D --undefined-only '$so' 2>/dev/null` : '';
like($syms, qr/\b__asan_report_(?:load|store)/,
     "module $so is built with AddressSanitizer");
like($syms, qr/\b__ubsan_handle_/,
     "module $so is built with UndefinedBehaviorSanitizer");

# Which leak stacks are ours: a frame in the module's sources (the
# tokenizer included), the module object, cJSON (only the module uses
# it), or an "<unknown module>": nginx unloads its dynamic modules (ours
# is the only one the tests load) before LeakSanitizer symbolizes at exit.
# nginx itself leaves a few allocations unreachable at exit (the event
# arrays of ngx_event_process_init in single-process mode): leak reports
# whose every stack is nginx's own are listed, not failed.
my $ours = qr{/ngx_dpd_module/|ngx_http_dpd_module\.so|libcjson|\bcJSON_
              |<unknown\ module>}x;

sub findings {
    my $text = shift;
    return ($text) unless $text =~ /ERROR: LeakSanitizer/
                          && $text !~ /ERROR: AddressSanitizer|runtime error/;
    my @blocks = split /\n(?=(?:Direct|Indirect) leak of )/, $text;
    shift @blocks;                          # the banner
    return grep { /$ours/ } @blocks;
}

# every report fails (one test per file, the report in the diagnostics)
my @files = sort grep { -f && -s _ } glob("$dir/*.san.*");
my (@reports, @ignored);
for my $f (@files) {
    my @found = findings(slurp($f));
    if (@found) { push @reports, [$f, join "\n", @found] }
    else        { push @ignored, $f }
}
note("nginx-only leak report (not ours): $_") for @ignored;

is(scalar @reports, 0, 'no sanitizer report');
for my $r (@reports) {
    my ($f, $text) = @$r;
    (my $name = $f) =~ s{.*/}{};
    my ($kind) = $text =~ /((?:ERROR|SUMMARY|runtime error):? [^\n]*)/;
    ($kind) = $text =~ /^((?:Direct|Indirect) leak [^\n]*)/ unless $kind;
    fail("$name: " . ($kind // 'report'));
    my @lines = split /\n/, $text;
    splice @lines, 80 if @lines > 80;
    diag(join "\n", @lines);
}

done_testing();
