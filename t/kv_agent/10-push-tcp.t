#!/usr/bin/perl
# Llama-70B-shaped pushes between two real agents over tcp;ofi_rxm on
# loopback, checked byte for byte; C client library; clean shutdown.
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use KvAgentTest;
use PushSuite;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();
plan skip_all => "libfabric tcp;ofi_rxm provider not available here"
    unless provider_ok('tcp;ofi_rxm');

PushSuite::run('tcp;ofi_rxm', 10);
done_testing();
