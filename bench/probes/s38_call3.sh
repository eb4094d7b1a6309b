#!/usr/bin/env bash
# Session 38, call 3: the deterministic DENSE backward in the fused kernel (fixed-point kl walk over dense lists).
# Build: `bash scripts/pack_gpu.sh --from-build`, carry [".gpu_pack"].
# 1. every Deterministic test (new: DenseStandaloneByKnob, DenseSegmentedLists, DenseM3Batched) and the dense paths'
#    neighbours; 2. memcheck and racecheck on small deterministic dense cases; 3. flashmsa_bench with its options,
#    FLASHMSA_BWD_FUSED_MAIN=1 (the new path) against 0 (the former kernels), m3 32k clustered and fmsa 16k.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp tests
gtest_run gpu-tests-det-dense.log 300 flashmsa_gpu_tests 'Deterministic.*:*Dense*:FixedPoint.*:Errors.BadFusedMainKnob:Bwd.StandaloneByKnob'
stamp sanitizers
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 3 ./.gpu/flashmsa_gpu_tests \
  --gtest_filter='Deterministic.DenseWarmup:Deterministic.LossScaledFp16Dense:Deterministic.DenseFp16' > "$OUT/memcheck-det-dense.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck-det-dense.log" | head -3
timeout 150 compute-sanitizer --tool racecheck --error-exitcode 3 ./.gpu/flashmsa_gpu_tests \
  --gtest_filter='Deterministic.LossScaledFp16Dense' > "$OUT/racecheck-det-dense.log" 2>&1
echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|PASSED|FAILED" "$OUT/racecheck-det-dense.log" | head -3
stamp bench
for round in 1 2; do
  for knob in 1 0; do
    for args in "--config m3 --seqlens 32768 --patterns clustered --iters 10" "--config fmsa --seqlens 16384 --patterns clustered --iters 30"; do
      [ $SECONDS -lt 560 ] || { echo "skipped (time)"; continue; }
      tag=knob$knob-$(echo "$args" | awk '{print $2"-"$4}')-r$round
      FLASHMSA_BWD_FUSED_MAIN=$knob timeout 100 ./.gpu/flashmsa_bench $args > "$OUT/bench-$tag.json" 2>&1
      python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); g=r.get; print(sys.argv[2], 'bwd', g('bwd_ms'), 'det', g('bwd_deterministic_ms'), 'dense_bwd', g('dense_bwd_ms'), 'dense_det', g('dense_bwd_deterministic_ms'))" "$OUT/bench-$tag.json" "$tag" 2>&1 | tail -1
    done
  done
done
stamp done
