#!/usr/bin/perl
# The same proof over the shm provider (RMA through CMA between processes).
use strict;
use warnings;
use FindBin;
use lib $FindBin::Bin;
use Test::More;
use KvAgentTest;
use PushSuite;

plan skip_all => "build/kv_agent not built" unless -x kv_bin();
plan skip_all => "libfabric shm provider not available here"
    unless provider_ok('shm');

PushSuite::run('shm', 20);
done_testing();
