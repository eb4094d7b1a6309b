#!/usr/bin/env bash
# Prepared in session 38 for the next session's first call. Build first: `bash scripts/setup.sh && bash
# scripts/pack_gpu.sh --from-build`, then the three timing probes (wrong dq, timing only; each rebuilds bwd_fused_bf16
# from a patched copy of src/):
#   bash scripts/probe_variant.sh ndq bench/probes/bwd-no-dq-handoff-s38.patch bwd_fused_bf16     # no dq path at all
#   bash scripts/probe_variant.sh nbulk bench/probes/bwd-dq-no-bulk-ops-s38.patch bwd_fused_bf16  # no bulk ops
#   bash scripts/probe_variant.sh nst bench/probes/bwd-dq-no-tile-stores-s38.patch bwd_fused_bf16 # no tile stores
# and `bash scripts/pack_gpu.sh` (carry [".gpu_pack"]).
# 1. The GPU tests changed after session 38's calls (review fixes: the recomputing proxy kernel's 64-token chunks by
#    the knob, deterministic and default; DenseG1Tok64 also on the fused path).
# 2. The dq path's 12.5% (session 38 call 7, ndq) split: nbulk (the TMA engine's bulk stores/adds gone: their
#    shared-memory reads and L2 reductions), nst (the consumers' tile stores gone), alternated with the default.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp tests
gtest_run gpu-tests-review-s38.log 200 flashmsa_gpu_tests \
  'Deterministic.DenseG1Tok64*:Bwd.StandaloneByKnob:Deterministic.DenseStandaloneByKnob:Deterministic.DenseWarmup'
stamp ab
for args in "--config m3 --seqlens 32768 --patterns clustered --iters 20" "--config fmsa --seqlens 16384 --patterns clustered --iters 100"; do
  bench_bins "$args" 2 540 flashmsa_bench flashmsa_bench_ndq flashmsa_bench_nbulk flashmsa_bench_nst
done
stamp done
