#!/usr/bin/env bash
# Session 35, call 4: dz's gain against fp16 overflow under a loss scaler's g. The new tests (Proxy.LossScaledFp16,
# Proxy.LossScaledFp16Dense, Deterministic.LossScaledFp16: g = 2^24; the near-converged cases, fp16 now with g = 2^16)
# on the tree's build, then on nogain (bench/probes/bwd-no-kl-gain.patch: dz formed with g itself, as before session
# 35), where the loss-scaled ones must fail. Pack: flashmsa_gpu_tests and flashmsa_gpu_tests_nogain.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
F='*LossScaled*:*NearConverged*'
stamp default
timeout 60 ./.gpu/flashmsa_gpu_tests --gtest_filter="$F" > "$OUT/gpu-tests-gain.log" 2>&1
echo "default rc=$?"; grep -E "near converged|dqp|dkp|^\[  (PASSED|FAILED)|FAILED  \]|Expected|actual" "$OUT/gpu-tests-gain.log" | head -40
stamp nogain
timeout 60 ./.gpu/flashmsa_gpu_tests_nogain --gtest_filter="$F" > "$OUT/gpu-tests-nogain.log" 2>&1
echo "nogain rc=$?"; grep -E "dqp|dkp|^\[  (PASSED|FAILED)|FAILED  \]|unwritten" "$OUT/gpu-tests-nogain.log" | head -30
stamp done
