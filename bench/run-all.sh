#!/usr/bin/env bash
# All benchmarks, one after the other (`make bench`).  Each one compares
# against its named baseline in the same run and prints the ratio:
#   tokenizer.sh          ours vs Hugging Face tokenizers (one core each)
#   routing_overhead.sh   module on the direct and disaggregated paths vs
#                         plain proxy_pass; stall of a 100k-token prompt;
#                         RSS over a soak
#   request_cost.sh       callgrind instructions per request of the same
#   balancer_table.sh     dpd_balance with 64 and 4096-node state tables vs none
#   kv_agent.sh           kv_agent over tcp;ofi_rxm vs iperf3 (loopback),
#                         Llama-shaped push with and without coalescing
#   kv_stage.sh           kv_agent staging ring: copies overlapping writes vs serial
#   dpd_vs_colocated.sh   DPD vs co-located serving, emulator timing model
#   prefix_cache.sh       cache-blind vs dpd_prefix_cache approximate and
#                         events on a multi-turn + RAG mix, 2+2 emulator pods
#                         (~20 min; QUICK=1: ~3 min)
# They are not tests: numbers depend on the machine and on its load.
set -uo pipefail
cd "$(dirname "$0")"
rc=0
for b in tokenizer.sh routing_overhead.sh request_cost.sh balancer_table.sh kv_agent.sh kv_stage.sh \
         dpd_vs_colocated.sh prefix_cache.sh; do
  printf '\n######## bench/%s\n' "$b"
  bash "$b" || { echo "bench/$b failed (rc=$?)"; rc=1; }
done
exit $rc
