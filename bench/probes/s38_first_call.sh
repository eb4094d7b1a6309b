#!/usr/bin/env bash
# Prepared in session 37 for the next session's first call. Build first: `bash scripts/setup.sh && bash
# scripts/pack_gpu.sh --from-build`, then `bash scripts/patch_variant.sh fdk bench/probes/fwd-dense-kl-fused.patch` and
# pack again (carry [".gpu_pack"]).
# 1. The 78 GPU tests that session 37's calls did not run on its final kernels (bench/probes/s38_suite_rest_filter.txt:
#    the suite less the 49 that passed in calls 2, 3 and 5, plus Proxy.DenseM3Batched, Bwd.GivenNoProxyTensors and
#    Bwd.DenseNoProxyTensors, added after the calls), one process cut at 380 s: with those 49 the whole suite on the
#    shipped build.
# 2. fdk (bench/probes/fwd-dense-kl-fused.patch: the forward's dense kl value through the fused kernel's teacher_only
#    walks instead of the recomputing proxy kernel, which took 186 ms of the dense backward in session 37): its kl
#    tests (new Kl.DenseSegmentedLists) and memcheck, then the dense forward with its kl value timed with each library.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp suite-rest
gtest_run gpu-suite-rest-s37-kernels.log 380 flashmsa_gpu_tests "$(cat bench/probes/s38_suite_rest_filter.txt)"
echo "last test started: $(grep '^\[ RUN' "$OUT/gpu-suite-rest-s37-kernels.log" | tail -1)"
stamp fdk-tests
gtest_run gpu-tests-fdk.log 60 flashmsa_gpu_tests_fdk 'Kl.*:Proxy.DenseWarmup'
timeout 40 compute-sanitizer --tool memcheck --error-exitcode 3 ./.gpu/flashmsa_gpu_tests_fdk \
  --gtest_filter='Kl.FmsaVarlenDense' > "$OUT/memcheck-fdk.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck-fdk.log" | head -3
stamp fdk-time
for cfg in "--config m3 --seqlen 32768" "--config fmsa --seqlen 16384"; do
  for lib in "" _fdk; do
    [ $SECONDS -lt 560 ] || { echo "skipped (time)"; continue; }
    FLASHMSA_LIBRARY=$PWD/.gpu/libflashmsa$lib.so timeout 60 python3 bench/probes/dense_kl_fwd_time.py $cfg | tail -1
  done
done
stamp done
