#!/usr/bin/env bash
# Session 35, call 3: dz's gain (kl_rule.cuh kl_gain: the proxy's dz formed with g 2^k, |g 2^k| in [2^13, 2^14),
# the dQp tiles and dKp scaled back by 2^-k) on the tree's build: the near-converged tests first (their new 1e-2 bars
# on dqp and dkp), then the Kl suite and 10 Proxy and 8 Deterministic cases (the kl walk and the dense proxy kernel, default and deterministic, bf16 and fp16, ~100 s; the device budget was short) in one process, then the backward against
# session 34's default binary (flashmsa_bench_s34), one round. Pack: the tree's default build plus flashmsa_bench_s34.
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp near
timeout 40 ./.gpu/flashmsa_gpu_tests --gtest_filter='*NearConverged*' > "$OUT/gpu-tests-near-gain.log" 2>&1
echo "near rc=$?"; grep -E "near converged|dqp|dkp|^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/gpu-tests-near-gain.log" | head -30
stamp suite
timeout 170 ./.gpu/flashmsa_gpu_tests --gtest_filter='Kl.*:Proxy.Small*:Proxy.G1Hpk2Tok64:Proxy.DenseWarmup:Proxy.GivenWithEmptyRows:Proxy.BatchedFp16:Proxy.ZeroGradientIsExactlyZero:Proxy.G8:Proxy.Gcd3PaddedHeadSlots:Proxy.M3SparseWithProxyLse:Deterministic.Dense*:Deterministic.Small*:Deterministic.BatchedFp16:Deterministic.SegmentedLists:-*NearConverged*' > "$OUT/gpu-tests-kl-proxy-det-gain.log" 2>&1
echo "suite rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]|tests ran" "$OUT/gpu-tests-kl-proxy-det-gain.log" | head -20
OUT0=$OUT; OUT=$R
stamp ab
bench_three 1 def:flashmsa_bench: s34:flashmsa_bench_s34:
OUT=$OUT0
stamp done
tar -czf "$OUT/s35-call3.tgz" -C "$R" . && rm -rf "$R"
