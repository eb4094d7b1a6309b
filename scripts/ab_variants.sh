#!/usr/bin/env bash
# Builds A/B variants of the backward into .gpu/ (docs/kernels/bwd.md, "A/B knobs"), each
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
# One line per variant between the LIST markers: NAME|TUs|FLAGS, e.g.
#   pr56|bwd_fused_bf16,bwd_fused_bf16_det|-DFLASHMSA_FUSED_PRODUCER_REGS=56
# None is pending: session 4 measured ovl, adkv, both, uf and all (docs/kernels/bwd.md); uf
# became the default code and the other knobs were deleted.
while IFS='|' read -r name tus flags; do
  [ -n "$name" ] || continue
  echo "== $name ($flags)"
  # shellcheck disable=SC2086
  bash scripts/bench_variant.sh "$name" "$tus" $flags | grep -E "spill|C7515|built"
done <<LIST
LIST
