#!/usr/bin/env bash
# Prepared in session 32 (its last call was refused: device time spent) for the next session's first call. Before it:
#   bash scripts/patch_variant.sh poly2 bench/probes/bwd-exp2-poly-rows2.patch
#   bash scripts/patch_variant.sh rot bench/probes/bwd-rotated-st.patch
#   bash scripts/patch_variant.sh rotp bench/probes/bwd-rotated-st-poly2.patch
#   bash scripts/pack_gpu.sh --from-build      # (remove other .gpu/*_NAME variants first)
# then `OUT=$OUT bash bench/probes/s33_first_call.sh` with carry [".gpu_pack"]. Candidates (docs/kernels/bwd.md
# "Session 32", Next):
# - poly2: 2 of each consumer thread's 8 P^T rows take exp2f_poly_or_zero (the FMA pipe) instead of MUFU.EX2 in the
#   main walk: the 32 MUFU.EX2 per warp and chunk, both warpgroups at once, are the exps' floor (1 row of 8:
#   bench/probes/bwd-exp2-poly-rows1.patch, not in this call).
# - rot: the main walk's loop rotated, chunk c + 1's S^T = K Q^T issued right behind chunk c's dQ = dS K and run under
#   c's dQ tile stores (the S^T wait was ~10% of the loop and the dQ stores and hand-off ~11%, session 22's profile);
#   P^T in its own registers (accP) so that no in-flight register is copied (ptxas: no C7514/C7515/C7517). ptxas
#   spills: ~5 local loads/stores per chunk and thread in the loop against ~1.
# - rotp: rot and poly2 together (ptxas happens to spill less: ~1 local load per chunk and thread in the loop).
# Tests of rotp and rot first, then the A/B alternated by round, the README call with each library. Results land in
# $OUT as written.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
for v in rotp rot; do
  stamp "$v-tests"
  timeout 150 ./.gpu/flashmsa_gpu_tests_$v --gtest_filter='Bwd.SmallSparse:Bwd.SmallDense:Bwd.DenseVarlen:Bwd.FmsaVarlenOddLengthsPoisonedWorkspace:Bwd.G1Topk32:Proxy.SmallSparse:Proxy.Gcd3PaddedHeadSlots:Proxy.DqStoreFirstM3:Proxy.LongSegment:Kl.SmallSparseG1:Kl.M3Sparse:Kl.SparseWithoutProxyLseOutput:Deterministic.SmallSparse:Dense.SmallM3:Graph.TrainingStepCaptureReplay' \
    > "$OUT/$v-tests.log" 2>&1
  echo "$v tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/$v-tests.log" | head
done
stamp ab
for args in "--config m3 --seqlens 32768 --patterns clustered --iters 20" "--config m3 --seqlens 32768 --patterns random --iters 20" \
            "--config fmsa --seqlens 16384 --patterns clustered --iters 100"; do
  bench_variants "$args" 2 def:flashmsa_bench: poly2:flashmsa_bench_poly2: rot:flashmsa_bench_rot: rotp:flashmsa_bench_rotp:
done
bench_variants "--config m3 --seqlens 131072 --patterns clustered --iters 10" 1 def:flashmsa_bench: rot:flashmsa_bench_rot: \
  rotp:flashmsa_bench_rotp:
stamp user
user_ab 1 560 "" _rot _rotp
stamp done
