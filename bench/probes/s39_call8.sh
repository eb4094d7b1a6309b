#!/usr/bin/env bash
# Session 39, call 8: issue 16's second point (m3 128k clustered) with and without the dQ writer's bulk operations
# (nbulk, bench/probes/bwd-dq-no-bulk-ops-s38.patch), alternated, two rounds (90 s per run: the bench's dense backward
# at 128k takes seconds). Not run in session 39 (device time spent). Build first: bash scripts/setup.sh && bash
# scripts/pack_gpu.sh --from-build; bash scripts/probe_variant.sh nbulk bench/probes/bwd-dq-no-bulk-ops-s38.patch
# bwd_fused_bf16; bash scripts/pack_gpu.sh (carry .gpu_pack).
OUT=${OUT:-/tmp/out}
source bench/probes/callkit.sh
call_open
stamp ab
BENCH_TIMEOUT=90 bench_bins "--config m3 --seqlens 131072 --patterns clustered --iters 5" 2 260 flashmsa_bench \
  flashmsa_bench_nbulk
stamp done
call_close s39-call8
