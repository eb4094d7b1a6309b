#!/usr/bin/env bash
# Prepared in session 31 for the next session's first call. Before it:
#   bash scripts/patch_variant.sh lag bench/probes/bwd-dq-store-first-lag.patch
#   bash scripts/patch_variant.sh rlx bench/probes/bwd-dq-relaxed-arrivals-probe.patch   # timing only
#   bash scripts/pack_gpu.sh --from-build
# (carry .gpu_pack). Added in session 32: nomask (.gpu/*_nomask, copied from a build of the tree's change: chunks
# wholly after a warpgroup's keys skip the causal mask; padding rows' lse2 = +inf), its tests and its A/B; part 1 of the
# suite runs on the nomask build (the candidate). rlx: the arrivals' atomics relaxed (no CCTL.IVALL per token slot; formally unordered: a probe).
# The lag variant publishes each chunk's first stores one chunk later (session 31's call 4 measured
# the shipped form, which waits for each chunk's bulk operations when it holds a first store: fmsa 16k +10% with
# store-first, hence the rule Rp x topk >= 256). Its store-path tests, then the A/B with the paths forced
# (FLASHMSA_BWD_DQ), alternated by round, then part 1 of the whole GPU suite on the default build (Workspace.*,
# Proxy.*, Kl.*, Given.*: session 31's unrun tests included; part 2, the complement, in the next call), with the m3 128k
# backward between them.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp lag-tests
timeout 90 ./.gpu/flashmsa_gpu_tests_lag --gtest_filter='Proxy.SmallSparse:Proxy.GivenWithEmptyRows:Proxy.DqStoreFirstGiven:Proxy.DqStoreFirstM3:Proxy.DqStoreFirstWaitPath:Proxy.BatchedFp16' \
  > "$OUT/lag-tests.log" 2>&1
echo "lag tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/lag-tests.log" | head
stamp nomask-tests
timeout 100 ./.gpu/flashmsa_gpu_tests_nomask --gtest_filter='Bwd.FmsaVarlenOddLengthsPoisonedWorkspace:Bwd.SmallSparse:Bwd.SmallDense:Bwd.DenseVarlen:Deterministic.SmallSparse:Bwd.G1Topk32' \
  > "$OUT/nomask-tests.log" 2>&1
echo "nomask tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/nomask-tests.log" | head
stamp ab
for args in "--config fmsa --seqlens 16384 --patterns clustered --iters 100" "--config m3 --seqlens 32768 --patterns clustered --iters 30"; do
  bench_variants "$args" 2 add:flashmsa_bench:FLASHMSA_BWD_DQ=add store:flashmsa_bench:FLASHMSA_BWD_DQ=store \
    lag:flashmsa_bench_lag:FLASHMSA_BWD_DQ=store rlx:flashmsa_bench_rlx:FLASHMSA_BWD_DQ=store nomask:flashmsa_bench_nomask:
done
stamp m3-128k
bench_variants "--config m3 --seqlens 131072 --patterns clustered --iters 10" 1 def:flashmsa_bench: nomask:flashmsa_bench_nomask:
stamp suite-1
timeout $((590 - SECONDS)) ./.gpu/flashmsa_gpu_tests_nomask --gtest_filter='Workspace.*:Proxy.*:Kl.*:Given.*' > "$OUT/gpu-suite-1.log" 2>&1
echo "suite-1 rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/gpu-suite-1.log" | head
stamp done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
