# vLLM emulator: usage counts come from the project's tokenizer library
# (build/libdpdtok.so through ctypes), as vLLM counts them: completions with
# the tokenizer's specials, chat = the rendered template without further
# specials.  Cross-checked against dpd-tokenize and Hugging Face tokenizers.
use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/../inc";
use Test::More;
use JSON::PP;
use File::Temp qw(tempfile tempdir);
use File::Spec;
use Encode ();
use DPD::Emu;

my $J = JSON::PP->new->utf8->canonical;
my $base = ($ENV{DPD_EMU_PORT} || 19000) + 8;
my $emu = DPD::Emu::emulator();

# --- failure modes that need no library --------------------------------------
{
    my ($tj) = DPD::Emu->tokenizer_files('llama3');
    $tj //= '/nonexistent/tokenizer.json';
    my $out = `python3 $emu --host 127.0.0.2 --port $base --tokenizer $tj --tokenizer-lib /nonexistent/libdpdtok.so 2>&1`;
    isnt $? >> 8, 0, 'missing tokenizer library: exit status';
    like $out, qr{tokenizer library /nonexistent/libdpdtok\.so does not exist},
        'missing tokenizer library: clear message';
}

my @tok = DPD::Emu->tokenizer_files('llama3');
# the checks above ran without the library; the rest needs it
my $why = !DPD::Emu::have_tokenizer_lib() ? 'build/libdpdtok.so not built'
        : !@tok ? 'llama3 tokenizer fixture not installed (make deps)'
        : undef;
if ($why) {
    SKIP: { skip $why, 1 }
    done_testing();
    exit 0;
}

{
    my ($fh, $bad) = tempfile(SUFFIX => '.json', UNLINK => 1);
    print $fh '{"model": {"type": "BPE"';
    close $fh;
    my $out = `python3 $emu --host 127.0.0.2 --port $base --tokenizer $bad 2>&1`;
    isnt $? >> 8, 0, 'broken tokenizer.json: exit status';
    like $out, qr/cannot load tokenizer/, 'broken tokenizer.json: reason';
}

my %ports = (port => $base, side_channel_port => $base + 100,
             lmcache_init_port => $base + 200,
             lmcache_alloc_port => $base + 300);
my $e = DPD::Emu->start(host => '127.0.0.2', %ports, time_scale => 0.02,
                        tokenizer => 'llama3');
like $e->stats->{instance}{tokenizer}, qr/^lib:.*libdpdtok\.so$/,
    'emulator uses the library';

my $cli = File::Spec->catfile(DPD::Emu::build_dir(), 'dpd-tokenize');
my @texts = ('Hello world, how are you?', "  spaces\tand\nnewlines  ",
             'Ünïcödé – ☃ 日本語 🚀', join(' ', ('lorem ipsum') x 300),
             "code: for (i = 0; i < 10; i++) { x += i; }");

sub cli_count {
    my ($input, @args) = @_;
    my $dir = tempdir(CLEANUP => 1);
    my $f = "$dir/in";
    open my $fh, '>:raw', $f or die;
    print $fh $input;
    close $fh;
    my $n = `$cli --tokenizer $tok[0] --config $tok[1] --count @args < $f`;
    chomp $n;
    return $n;
}

sub name {
    my $n = substr($_[0], 0, 20);
    $n =~ s/\s+/ /g;
    return $n;
}

sub usage {
    my ($path, $body) = @_;
    my $r = $e->post_json($path, $body);
    return $r->code == 200 ? $J->decode($r->content)->{usage}{prompt_tokens}
                           : "HTTP " . $r->code;
}

my @counts;
for my $t (@texts) {
    my $n = usage('/v1/completions', {prompt => $t, max_tokens => 1});
    push @counts, $n;
    is $n, cli_count(Encode::encode_utf8($t), '--special'),
        'completion prompt_tokens = library count: ' . name($t);
}

# Llama 3's tokenizer.json adds no BOS: "" is 0 tokens, which vLLM refuses
{
    my $r = $e->post_json('/v1/completions', {prompt => ''});
    is $r->code, 400, 'empty prompt (0 tokens) -> 400';
    like $r->content, qr/prompt cannot be empty/, 'vLLM message';
}

my @chats = (
    [{role => 'user', content => 'Hello world, how are you?'}],
    [{role => 'system', content => 'You are terse.'},
     {role => 'user', content => 'Summarise: ' . join(' ', ('data') x 200)},
     {role => 'assistant', content => 'Sure.'},
     {role => 'user', content => 'Again, 日本語 please.'}],
    [{role => 'user', content => [{type => 'text', text => 'part one '},
                                  {type => 'text', text => 'part two'}]}],
);
for my $m (@chats) {
    my $n = usage('/v1/chat/completions', {messages => $m, max_tokens => 1});
    my $line = $J->encode({messages => $m}) . "\n";
    is $n, cli_count($line, '--chat', '--jsonl'),
        'chat prompt_tokens = rendered template count';
}

# token ids are counted, and checked against the real vocabulary
is usage('/v1/completions', {prompt => [9906, 1917], max_tokens => 1}), 2,
    'ids counted as given';
my $r = $e->post_json('/v1/completions', {prompt => [1, 128256]});
is $r->code, 400, 'id >= vocab size -> 400';
is usage('/v1/completions', {prompt => [1, 128255], max_tokens => 1}), 2,
    'highest id accepted';

# an independent oracle: Hugging Face tokenizers (Rust) through node
SKIP: {
    my $npm = DPD::Emu::npm_dir();
    skip 'node or @anush008/tokenizers missing', scalar @texts
        unless -d "$npm/\@anush008/tokenizers" && `node -v 2>/dev/null`;
    my $js = <<'JS';
const {Tokenizer} = require(process.argv[2] + '/@anush008/tokenizers');
const texts = JSON.parse(require('fs').readFileSync(0, 'utf8'));
(async () => {
  const t = Tokenizer.fromFile(process.argv[3]);
  const out = [];
  for (const s of texts)
    out.push((await t.encode(s, null, {addSpecialTokens: true})).getIds().length);
  console.log(JSON.stringify(out));
})();
JS
    my $dir = tempdir(CLEANUP => 1);
    open my $fh, '>', "$dir/o.js" or die;
    print $fh $js;
    close $fh;
    open $fh, '>:raw', "$dir/in.json" or die;
    print $fh $J->encode(\@texts);
    close $fh;
    my $o = `node $dir/o.js $npm $tok[0] < $dir/in.json`;
    my $hf = eval { $J->decode($o) } || [];
    for my $i (0 .. $#texts) {
        is $counts[$i], $hf->[$i],
            'prompt_tokens = HF tokenizers: ' . name($texts[$i]);
    }
}

done_testing;
