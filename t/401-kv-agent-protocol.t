# The kv_agent wire transforms of ngx_dpd_module/ngx_http_dpd_protocol.c
# alone (no nginx): the prefill copy with {"dpd":{"req_id","decode_node"}},
# the classification of prefill replies (wait for the KV or not), and the
# decode body with {"dpd":{"req_id"}}.  A small C driver is compiled here
# with cc and libcjson, run under valgrind too when it is installed.
use strict;
use warnings;

use Test::More;
use JSON::PP ();
use DPD::ProtoDriver;

plan skip_all => $_ for DPD::ProtoDriver->unavailable;

# slurp() (all of stdin) and the includes come from DPD::ProtoDriver
my $drv = DPD::ProtoDriver->build(tmp => 'dpd-kvaproto', main => <<'_C_');
int main(int argc, char **argv)
{
    size_t n, len;
    char *in = slurp(&n), *out = NULL;
    int rc = 0;

    if (argc > 3 && strcmp(argv[1], "prefill") == 0) {
        out = ngx_http_dpd_proto_kv_agent_prefill_body(parse_req(in, n),
                  strcmp(argv[2], "-") ? argv[2] : NULL,
                  strcmp(argv[3], "-") ? argv[3] : NULL, &len);

    } else if (argc > 2 && strcmp(argv[1], "reply") == 0) {
        unsigned long blocks;
        const char *why;
        int kind = ngx_http_dpd_proto_kv_agent_reply(in, n, argv[2],
                                                     &blocks, &why);
        printf("%d\t%lu\t%s", kind, blocks, why ? why : "");
        free(in);
        return 0;

    } else if (argc > 2 && strcmp(argv[1], "decode") == 0) {
        out = ngx_http_dpd_proto_kv_agent_decode_body(parse_req(in, n),
                  strcmp(argv[2], "-") ? argv[2] : NULL, &len);

    } else {
        rc = 2;
    }

    if (rc == 0) {
        if (out == NULL) {
            fputs("NULL", stdout);
        } else {
            fwrite(out, 1, len, stdout);
        }
    }

    free(out);
    ngx_http_dpd_proto_release(&dpd_req);
    free(in);
    return rc;
}
_C_
is $drv->status, 0, 'driver builds with ngx_http_dpd_protocol.c alone'
    or diag $drv->output;
BAIL_OUT("cannot build the protocol driver") if $drv->status;

my $vg = !system('valgrind --version >/dev/null 2>&1');
my $J = JSON::PP->new->utf8->canonical;
my @vg_errors;

my @wrap = ('valgrind', '-q', '--leak-check=full', '--error-exitcode=99',
            '--log-file=' . $drv->dir . '/vg.%p');
@wrap = () unless $vg && ($ENV{DPD_PROTO_VALGRIND}
                          || $ENV{TEST_NGINX_USE_VALGRIND});

sub run_driver {
    my ($input, @args) = @_;
    my ($out, $status) = $drv->run_under(\@wrap, $input, @args);
    push @vg_errors, "@args" if ($status >> 8) == 99;
    return $out;
}

my $req = $J->encode({model => 'm', prompt => 'hello', max_tokens => 50,
                      stream => JSON::PP::true,
                      stream_options => {include_usage => JSON::PP::true},
                      min_tokens => 3,
                      kv_transfer_params => {dpd => {req_id => 'evil',
                                                     decode_node => 'x'}}});

# --- the prefill copy --------------------------------------------------------

my $p = $J->decode(run_driver($req, 'prefill', 'rid-1', 'decode-0'));
is_deeply $p->{kv_transfer_params},
    {dpd => {req_id => 'rid-1', decode_node => 'decode-0'}},
    'prefill: kv_transfer_params {dpd:{req_id, decode_node}}, client ones gone';
is $p->{max_tokens}, 1, 'prefill: max_tokens 1';
ok !$p->{stream}, 'prefill: not streamed';
ok !exists $p->{stream_options}, 'prefill: no stream_options';
ok !exists $p->{min_tokens}, 'prefill: no min_tokens';
is $p->{prompt}, 'hello', 'prefill: prompt kept';
is run_driver($req, 'prefill', '-', 'decode-0'), 'NULL',
    'prefill: no request id, no body';
is run_driver($req, 'prefill', 'rid-1', '-'), 'NULL',
    'prefill: no decode node, no body';
is run_driver('[1,2]', 'prefill', 'rid-1', 'decode-0'),
    "REFUSED 4\tthe request body must be a JSON object\nNULL",
    'prefill: not an object, no body';

# --- replies -----------------------------------------------------------------

sub reply {
    my ($body, $rid) = @_;
    my ($kind, $blocks, $why) = split /\t/, run_driver($body, 'reply',
                                                       $rid // 'rid-1'), 3;
    return ($kind, $blocks, $why // '');
}

sub ktp {
    my (%d) = @_;
    return $J->encode({id => 'cmpl-rid-1', choices => [{text => 'x'}],
                       kv_transfer_params => {dpd => {%d}}});
}

my ($k, $b, $w) = reply(ktp(req_id => 'rid-1', blocks => 37,
                            state => 'pushed'));
is "$k/$b", '0/37', 'pushed 37 blocks: wait for them';

($k, $b, $w) = reply(ktp(req_id => 'rid-1', blocks => 0, state => 'pushed'));
is $k, 1, 'pushed 0 blocks: do not wait';
like $w, qr/^nothing to push/, '... why: nothing to push';

($k, $b, $w) = reply(ktp(req_id => 'rid-1', blocks => 0, state => 'failed'));
is $k, 1, 'failed: do not wait';
like $w, qr/could not push/, '... why: the agent could not push';

($k, $b, $w) = reply(ktp(req_id => 'other', blocks => 5, state => 'pushed'));
is $k, 1, 'another req_id: never wait for it';
like $w, qr/another req_id/, '... why: another req_id';

($k, $b, $w) = reply(ktp(req_id => 'rid-1', blocks => 5, state => 'weird'));
is $k, 1, 'unknown state: do not wait';

for my $bad (-1, 1.5, '"7"', 1e12) {
    my $body = '{"kv_transfer_params":{"dpd":{"req_id":"rid-1","state":'
             . '"pushed","blocks":' . $bad . '}}}';
    ($k) = reply($body);
    is $k, 1, "blocks $bad: not a block count, do not wait";
}

($k, $b, $w) = reply('{"id":"x","choices":[]}');
is $k, 1, 'no kv_transfer_params: do not wait';
like $w, qr/no kv_transfer_params\.dpd/, '... why';

($k, $b, $w) = reply('{"kv_transfer_params":{"dpd":"x"}}');
is $k, 1, 'dpd not an object: do not wait';

($k) = reply('not json');
is $k, 2, 'not JSON: invalid (as a 5xx)';
($k) = reply('[1]');
is $k, 2, 'an array: invalid';
($k) = reply('');
is $k, 2, 'empty: invalid';
($k) = reply(ktp(req_id => 'rid-1', blocks => 3, state => 'pushed') . ' x');
is $k, 2, 'trailing junk: invalid';
($k, $b) = reply(ktp(req_id => 'rid-1', blocks => 3, state => 'pushed') . "\n");
is "$k/$b", '0/3', 'trailing white space is fine';

# --- the decode body -----------------------------------------------------------

my $d = $J->decode(run_driver($req, 'decode', 'rid-1'));
is_deeply $d->{kv_transfer_params}, {dpd => {req_id => 'rid-1'}},
    'decode: {dpd:{req_id}} only';
is $d->{max_tokens}, 50, 'decode: the client max_tokens';
ok $d->{stream}, 'decode: streamed as the client asked';
is $d->{min_tokens}, 3, 'decode: min_tokens kept';

$d = $J->decode(run_driver($req, 'decode', '-'));
ok !exists $d->{kv_transfer_params}, 'decode without id: no params at all';

is_deeply \@vg_errors, [], 'valgrind: no errors or leaks in the driver'
    if $vg && ($ENV{DPD_PROTO_VALGRIND} || $ENV{TEST_NGINX_USE_VALGRIND});

done_testing();
