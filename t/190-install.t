# README's quick path as written (issue 24, 4): `make install` puts the
# module where Debian's nginx loads modules from and the example
# configurations, with no repository-relative path left, under CONFDIR
# (DESTDIR stages it; here a temporary directory, never the real system);
# each installed configuration passes `nginx -t` as installed; and the
# README "Configuration" example passes `nginx -t` once the reader put in
# their model path (the events block included).  Before: no install
# target, the README example lacked "events {}" (nginx -t: no "events"
# section in configuration) and named a .so nothing put there, and the
# shipped confs only worked from the repository root.
use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/inc";
use Test::More;
use File::Temp ();
use Cwd ();
use DPD::Emu;

my $root = DPD::Emu->root;
my $nginx = $ENV{TEST_NGINX_BINARY} || '/usr/sbin/nginx';
my ($tj, $tc) = DPD::Emu->tokenizer_files('llama3');
$tj = Cwd::abs_path($tj) if $tj;

plan skip_all => 'Llama 3 tokenizer fixture not installed (make deps)'
    unless $tj && $tc;
plan skip_all => 'build/ngx_http_dpd_module.so not built (make)'
    unless -f "$root/build/ngx_http_dpd_module.so";
plan skip_all => "no $nginx" unless -x $nginx;
# another nginx (make test-1.30) would need its own module build
plan skip_all => 'TEST_NGINX_LOAD_MODULES names another module build'
    if ($ENV{TEST_NGINX_LOAD_MODULES} // '') ne ''
       && $ENV{TEST_NGINX_LOAD_MODULES} ne "$root/build/ngx_http_dpd_module.so";

my $tmp = File::Temp::tempdir(CLEANUP => 1);

sub make_install {
    my (@vars) = @_;
    my $out = `make -s -C '$root' install @vars 2>&1`;
    return ($? >> 8, $out);
}

sub nginx_t {
    my ($conf) = @_;
    mkdir "$tmp/prefix";
    my $out = `'$nginx' -t -p '$tmp/prefix/' -e '$tmp/prefix/error.log' -c '$conf' 2>&1`;
    return ($? >> 8, $out);
}

# --- DESTDIR: the layout, nothing outside it --------------------------------

{
    my ($rc, $out) = make_install("DESTDIR='$tmp/stage'");
    is $rc, 0, 'make install DESTDIR=... succeeds' or diag $out;
    ok -f "$tmp/stage/usr/lib/nginx/modules/ngx_http_dpd_module.so",
        'the module in /usr/lib/nginx/modules under DESTDIR';
    ok -x "$tmp/stage/usr/local/bin/dpd-tokenize", 'dpd-tokenize in PREFIX/bin';
    for my $f (qw(nginx.conf nginx-dpd.conf nginx-kv-agent.conf observe.conf)) {
        my $p = "$tmp/stage/usr/local/share/dpd-gateway/conf/$f";
        ok -f $p, "$f installed";
        open my $fh, '<', $p or next;
        my $text = do { local $/; <$fh> };
        like $text, qr{^load_module /usr/lib/nginx/modules/ngx_http_dpd_module\.so;}m,
            "$f: load_module names the installed module (DESTDIR left out)";
        unlike $text, qr{^[^#]*(?:build/|\.\./tools/|\Q$tmp\E)}m,
            "$f: no repository or staging path in a directive";
    }
}

# --- installed confs pass nginx -t as installed ------------------------------

{
    my ($rc, $out) = make_install("MODDIR='$tmp/mods'", "CONFDIR='$tmp/conf'",
                                  "BINDIR='$tmp/bin'", "TOKENIZER='$tj'");
    is $rc, 0, 'make install with MODDIR, CONFDIR, TOKENIZER' or diag $out;
    for my $f (qw(nginx.conf nginx-dpd.conf nginx-kv-agent.conf observe.conf)) {
        my ($trc, $tout) = nginx_t("$tmp/conf/$f");
        is $trc, 0, "installed $f: nginx -t passes" or diag $tout;
    }
}

# --- README's example, with the reader's model path --------------------------

{
    open my $fh, '<', "$root/README.md" or die "README.md: $!";
    my $readme = do { local $/; <$fh> };
    my ($section) = $readme =~ /^## Configuration\n(.*?)^## /ms;
    my ($conf) = ($section // '') =~ /```nginx\n(.*?)```/s;
    ok defined $conf, 'README: the Configuration example found';
    $conf //= '';

    like $conf, qr/^events\s*\{/m, 'README example: an events block';
    like $conf, qr{^load_module /usr/lib/nginx/modules/ngx_http_dpd_module\.so;}m,
        'README example: load_module names where make install puts it';

    # what the reader does: their model directory, where the .so went
    (my $dir = $tj) =~ s{/tokenizer\.json$}{};
    $conf =~ s{/models/llama-3-8b/}{$dir/}g;
    $conf =~ s{/usr/lib/nginx/modules/}{$tmp/mods/}g;

    open my $out, '>', "$tmp/readme.conf" or die $!;
    print $out "pid $tmp/readme.pid;\n", $conf;
    close $out;

    my ($rc, $tout) = nginx_t("$tmp/readme.conf");
    is $rc, 0, 'README example: nginx -t passes' or diag $tout;
}

# --- README's install commands, staged under DESTDIR --------------------------

{
    open my $fh, '<', "$root/README.md" or die "README.md: $!";
    my $readme = do { local $/; <$fh> };
    my ($section) = $readme =~ /^## Configuration\n(.*?)^## /ms;
    my ($sh) = ($section // '') =~ /```sh\n(.*?make install.*?)```/s;
    ok defined $sh, 'README: the install commands found';
    $sh //= '';
    my ($vars) = $sh =~ /sudo make install\b([^\n]*)/;
    my ($conf) = $sh =~ /sudo nginx -t -c (\S+)/;
    ok defined $vars && defined $conf, 'README: make install and nginx -t lines';
    $vars //= '';
    $vars =~ s{TOKENIZER=\S+}{TOKENIZER='$tj'};

    my ($rc, $out) = make_install("DESTDIR='$tmp/readme'", $vars);
    is $rc, 0, "README's make install$vars, staged" or diag $out;
    ok -f "$tmp/readme" . ($conf // '/none'),
        "the conf README's nginx -t names is installed ($conf)";
    ok -f "$tmp/readme/usr/lib/nginx/modules/ngx_http_dpd_module.so",
        'the module where the README example loads it';
}

done_testing();
