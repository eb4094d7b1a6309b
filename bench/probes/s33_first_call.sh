#!/usr/bin/env bash
# Prepared in session 32 (its call 4 was refused: device time spent) for the next session's first call. Before it:
#   bash scripts/patch_variant.sh poly1 bench/probes/bwd-exp2-poly-rows1.patch
#   bash scripts/patch_variant.sh poly2 bench/probes/bwd-exp2-poly-rows2.patch
#   bash scripts/pack_gpu.sh --from-build      # (remove other .gpu/*_NAME variants first)
# then run `OUT=$OUT bash bench/probes/s33_first_call.sh` with carry [".gpu_pack"].
# The candidates: 1 (poly1) or 2 (poly2) of each consumer thread's 8 P^T rows take exp2f_poly_or_zero (the FMA pipe,
# common/exp2_poly.h) instead of MUFU.EX2 in the main walk (docs/kernels/bwd.md "Session 32", Next): the 32 MUFU.EX2
# per warp and chunk, both consumer warpgroups at once, are the exps' floor (~512 cycles per scheduler and chunk).
# Their GPU tests first, then the A/B alternated by round (m3 32k clustered and random, fmsa 16k, m3 128k), the README
# call with each library, then part 1 of the suite on poly2 with the time left. Results land in $OUT as written.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
for v in poly2 poly1; do
  stamp "$v-tests"
  timeout 120 ./.gpu/flashmsa_gpu_tests_$v --gtest_filter='Bwd.SmallSparse:Bwd.SmallDense:Bwd.FmsaVarlenOddLengthsPoisonedWorkspace:Bwd.G1Topk32:Proxy.SmallSparse:Proxy.Gcd3PaddedHeadSlots:Proxy.DqStoreFirstM3:Kl.SmallSparseG1:Kl.M3Sparse:Deterministic.SmallSparse:Dense.SmallM3' \
    > "$OUT/$v-tests.log" 2>&1
  echo "$v tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/$v-tests.log" | head
done
stamp ab
for args in "--config m3 --seqlens 32768 --patterns clustered --iters 20" "--config m3 --seqlens 32768 --patterns random --iters 20" \
            "--config fmsa --seqlens 16384 --patterns clustered --iters 100"; do
  bench_variants "$args" 2 def:flashmsa_bench: poly1:flashmsa_bench_poly1: poly2:flashmsa_bench_poly2:
done
bench_variants "--config m3 --seqlens 131072 --patterns clustered --iters 10" 1 def:flashmsa_bench: poly2:flashmsa_bench_poly2:
stamp user
user_ab 1 420 "" _poly2
stamp suite-1-poly2
timeout $((590 - SECONDS)) ./.gpu/flashmsa_gpu_tests_poly2 --gtest_filter='Workspace.*:Proxy.*:Kl.*:Given.*' > "$OUT/gpu-suite-1-poly2.log" 2>&1
echo "suite-1 rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/gpu-suite-1-poly2.log" | head
stamp done
