#!/usr/bin/env bash
# Session 39, call 3: is the bulk operations' cost DRAM or the L2's reduction work or the SM side? dql2: every bulk
# operation (dQ and dQp adds and first stores) into the first 16 MB of its accumulator (L2-resident); bstl2: the same
# with stores in place of the adds (bst of call 2, confined); beside the default, bst and nbulk. Built:
# bash scripts/probe_variant.sh dql2 bench/probes/bwd-dq-bulk-l2-s39.patch bwd_fused_bf16;
# ... bstl2 bench/probes/bwd-dq-bulk-l2-s39.patch,bench/probes/bwd-dq-bulk-store-s39.patch bwd_fused_bf16;
# bash scripts/pack_gpu.sh.
OUT=${OUT:-/tmp/out}
source bench/probes/callkit.sh
call_open
stamp ab
bench_std 2 400 flashmsa_bench flashmsa_bench_dql2 flashmsa_bench_bstl2 flashmsa_bench_bst flashmsa_bench_nbulk
stamp done
call_close s39-call3
