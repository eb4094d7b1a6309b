#!/usr/bin/env bash
# Prepared in session 35 for the next session's first call: the GPU suite on the final kernels of session 35 (dz's
# gain, kl_rule.cuh kl_gain, with its k clamped to [-126, 126] after review; call 4 ran the [-60, 60] form, the same
# code for every g in [2^-46, 2^74]). Build first: `bash scripts/setup.sh && bash scripts/pack_gpu.sh --from-build`
# (carry [".gpu_pack"]). Order: the tests new or changed in session 35 (Deterministic.LossScaledFp16Dense has not run
# yet), then the rest of the suite in one process (~460 s for the whole suite in session 24: cut at 440 s; what the
# cut leaves is the next call's), then memcheck of two small fp16 proxy cases. Logs in $OUT.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
NEW='*LossScaled*:*NearConverged*'
stamp new
gtest_run gpu-tests-new-s35.log 60 flashmsa_gpu_tests "$NEW"
stamp suite
gtest_run gpu-suite-s35-kernels.log 440 flashmsa_gpu_tests "-$NEW"
echo "last test started: $(grep '^\[ RUN' "$OUT/gpu-suite-s35-kernels.log" | tail -1)"
stamp memcheck
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 3 ./.gpu/flashmsa_gpu_tests \
  --gtest_filter='Proxy.LossScaledFp16Dense:Kl.SmallSparseG1' > "$OUT/memcheck-s35.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck-s35.log" | head -3
stamp done
