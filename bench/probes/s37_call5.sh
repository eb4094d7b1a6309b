#!/usr/bin/env bash
# Session 37, call 5: DENSE mode's backward with a proxy side in the fused kernel (the main walk with its kl walk over
# lists of every token from the block on; the teacher in the per-CTA scratch) instead of the standalone main kernel
# and the recomputing proxy kernel (call 4: 186 ms of the 304 ms dense backward at m3 32k). GPU tests of the dense paths
# (new: Proxy.DenseSegmentedLists), memcheck and racecheck on small dense cases, then the bench alternated by
# FLASHMSA_BWD_FUSED_MAIN (0: the former path).
# Pack: the tree's build (bash scripts/pack_gpu.sh --from-build).
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
OUT0=$OUT; OUT=$R
stamp tests
gtest_run gpu-tests-dense-fused.log 150 flashmsa_gpu_tests '*Dense*:Bwd.*:Kl.*Dense*:Errors.BadFusedMainKnob:Proxy.SmallSparse:Proxy.LongSegment:Graph.TrainingStepCaptureReplay'
stamp sanitizers
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests \
  --gtest_filter='Proxy.SmallDense:Bwd.DenseVarlen' > "$OUT/memcheck-dense-fused.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED)" "$OUT/memcheck-dense-fused.log"
timeout 60 compute-sanitizer --tool racecheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests \
  --gtest_filter='Proxy.SmallDense' > "$OUT/racecheck-dense-fused.log" 2>&1
echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|^\[  (PASSED|FAILED)" "$OUT/racecheck-dense-fused.log"
stamp bench
bench_knob "--config m3 --seqlens 32768 --patterns clustered --iters 9" 1 FLASHMSA_BWD_FUSED_MAIN 1 0
bench_knob "--config fmsa --seqlens 16384 --patterns clustered --iters 30" 2 FLASHMSA_BWD_FUSED_MAIN 1 0
OUT=$OUT0
stamp done
tar -czf "$OUT/s37-call5.tgz" -C "$R" . && rm -rf "$R"
