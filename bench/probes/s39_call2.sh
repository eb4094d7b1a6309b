#!/usr/bin/env bash
# Session 39, call 2: what of the dQ writer's bulk adds costs (call 1: nbulk, no bulk operations, -10% at m3 32k;
# nst, no consumer tile stores, -3.6%). bst: bulk STORES in place of the adds (same shared-memory reads, same bytes to
# the L2, no reduction); bhalf: each add moves half its bytes; the default with FLASHMSA_BWD_DQ=add (no store-first
# words or waits). Built: bash scripts/probe_variant.sh bst bench/probes/bwd-dq-bulk-store-s39.patch bwd_fused_bf16;
# ... bhalf bench/probes/bwd-dq-bulk-half-s39.patch bwd_fused_bf16; bash scripts/pack_gpu.sh. Logs in one archive.
OUT=${OUT:-/tmp/out}
source bench/probes/callkit.sh
call_open
stamp ab
bench_std 2 400 flashmsa_bench flashmsa_bench_bst flashmsa_bench_bhalf flashmsa_bench_nbulk
for args in "${std_args[@]}"; do bench_knob "$args" 1 FLASHMSA_BWD_DQ add; done
stamp done
call_close s39-call2
