#!/usr/bin/env bash
# Prepared in session 34 for the next session's first call (carry [".gpu_pack"]; if .gpu_pack is missing or stale:
# `bash scripts/patch_variant.sh tf16 bench/probes/bwd-teacher-fp16.patch`, then `bash scripts/pack_gpu.sh --from-build`).
# tf16: the fused kernel's teacher rows in fp16 (bench/probes/bwd-teacher-fp16.patch; docs/kernels/bwd.md "Session 34":
# session 34's timing probes bound the teacher's round trip at 3.6% of the backward, half of its bytes and its store
# width are what this saves, ~1-2%). fp16, not bf16: the teacher is a mean of probabilities in [0, 1], where fp16's
# 11 bits (subnormals below 6e-5 carry an absolute error under 3e-8) keep its rounding at the level of the
# straightforward reference's own per-head P rounding (tests/gpu/gpu_harness.hpp: the teacher as the fp32 mean of P
# rounded to the input dtype). This call: every test that reads a teacher (the Kl, Proxy, Deterministic and Graph
# suites: the fp64 bars of SPEC section 3 decide) in one process, and compute-sanitizer memcheck and racecheck of two
# small fused cases. Next: bench/probes/s35_call2.sh (the A/B and the README call). Logs in $OUT.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp near-converged-default
timeout 60 ./.gpu/flashmsa_gpu_tests --gtest_filter='*NearConverged*' > "$OUT/gpu-tests-near-default.log" 2>&1
echo "default near-converged rc=$?"; grep -E "near converged|rel-L2|^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/gpu-tests-near-default.log" | head -30
stamp tests
timeout 400 ./.gpu/flashmsa_gpu_tests_tf16 --gtest_filter='Kl.*:Proxy.*:Deterministic.*:Graph.*' > "$OUT/gpu-tests-tf16.log" 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]|tests ran" "$OUT/gpu-tests-tf16.log" | head -20
grep -A12 "RUN.*NearConverged" "$OUT/gpu-tests-tf16.log" | grep -E "RUN|near converged|rel-L2|OK|FAILED" | head -30
stamp sanitizers
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 3 ./.gpu/flashmsa_gpu_tests_tf16 \
  --gtest_filter='Proxy.SmallSparse:Kl.SmallSparseG1' > "$OUT/memcheck-tf16.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck-tf16.log" | head -3
timeout 60 compute-sanitizer --tool racecheck --error-exitcode 3 ./.gpu/flashmsa_gpu_tests_tf16 \
  --gtest_filter='Proxy.SmallSparse:Kl.SmallSparseG1' > "$OUT/racecheck-tf16.log" 2>&1
echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|PASSED|FAILED" "$OUT/racecheck-tf16.log" | head -3
stamp done
