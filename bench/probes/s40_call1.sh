#!/usr/bin/env bash
# Session 40, call 1: issue 16's 320 point measured once more on the head (kernels of session 38, SASS md5 f99b078e),
# with the main attention's backward alone beside it (flashmsa_bench's bwd_main_ms: the same fused kernel without a
# proxy side, the product's path for a frozen indexer) and the timing probe nbulk (the dQ writer's bulk operations
# gone, wrong dq: what the backward would be if dq never reached memory); then the README call once (m3 32k
# clustered, cuDNN beside it). Build first: bash scripts/setup.sh && bash scripts/pack_gpu.sh --from-build (nbulk:
# bash scripts/probe_variant.sh nbulk bench/probes/bwd-dq-no-bulk-ops-s38.patch bwd_fused_bf16; bash
# scripts/pack_gpu.sh); carry [".gpu_pack"].
OUT=${OUT:-/tmp/out}
source bench/probes/callkit.sh
call_open
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > "$OUT/gpu.csv" 2>&1; cat "$OUT/gpu.csv"
stamp m3-32k
bench_bins "--config m3 --seqlens 32768 --patterns clustered --iters 20" 2 300 flashmsa_bench flashmsa_bench_nbulk
bench_bins "--config m3 --seqlens 32768 --patterns random --iters 20" 1 300 flashmsa_bench
stamp m3-128k
BENCH_TIMEOUT=100 bench_bins "--config m3 --seqlens 131072 --patterns clustered --iters 5" 1 330 flashmsa_bench \
  flashmsa_bench_nbulk
stamp user
user_ab 1 480 ""
stamp done
call_close s40-call1
