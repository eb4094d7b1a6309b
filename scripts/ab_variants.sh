#!/usr/bin/env bash
# Builds the backward's pending A/B variants into .gpu/ (docs/kernels/bwd.md, "A/B knobs"), each
# with its deterministic TUs, after copying the default binaries there. Then on the GPU machine:
# STEPS=ab bash scripts/gpu_all.sh (carry .gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${FLASHMSA_BUILD_DIR:-build}
mkdir -p .gpu
rm -f .gpu/flashmsa_bench_*
cp "$build/tests/flashmsa_gpu_tests" "$build/flashmsa_bench" "$build/flashmsa" "$build/libflashmsa.so" .gpu/
M=bwd_main_bf16,bwd_main_bf16_det
K=bwd_kl_bf16,bwd_kl_bf16_det
while IFS='|' read -r name tus flags; do
  echo "== $name ($flags)"
  # shellcheck disable=SC2086
  bash scripts/bench_variant.sh "$name" "$tus" $flags | grep -E "spill|C7515|built"
done <<LIST
ovl|$M|-DFLASHMSA_BWD_OVERLAP_DP
adkv|$M|-DFLASHMSA_BWD_ASYNC_DKV
both|$M|-DFLASHMSA_BWD_OVERLAP_DP -DFLASHMSA_BWD_ASYNC_DKV
uf|$M,$K|-DFLASHMSA_BWD_UNIT_FASTEST
all|$M,$K|-DFLASHMSA_BWD_UNIT_FASTEST -DFLASHMSA_BWD_OVERLAP_DP -DFLASHMSA_BWD_ASYNC_DKV
LIST
