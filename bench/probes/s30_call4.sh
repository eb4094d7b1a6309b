#!/usr/bin/env bash
# Session 30, call 4: the kl walk's element loop without branches (kl_kernel.cuh, kl_rule.cuh: the masked elements
# dropped by selects; ncu of call 3 showed 32 BSSY/BSYNC regions per chunk, 5% of the consumers' time). The new
# default build's GPU tests (kl value, proxy gradients, deterministic kl walk), then the A/B against the build before
# it (flashmsa_bench_old: the same tree without the change; alternated, two rounds) and the user's path with each.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp tests
timeout 120 ./.gpu/flashmsa_gpu_tests --gtest_filter='Kl.SmallSparseG1:Kl.M3Sparse:Kl.FmsaGivenWithEmptySlots:Kl.Gcd3PaddedHeadSlots:Proxy.SmallSparse:Proxy.GivenWithEmptyRows:Proxy.Gcd3PaddedHeadSlots:Proxy.ZeroGradientIsExactlyZero:Proxy.G8:Deterministic.SmallSparse:Kl.SegmentedSparse:Proxy.M3SparseWithProxyLse' \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]|OK \]" "$OUT/tests.log" | head -30
stamp ab
for args in "--config m3 --seqlens 32768 --patterns clustered --iters 30" ; do
  bench_ab "$args" 2 flashmsa_bench flashmsa_bench_old
done
user_ab 1 330 "" _old
stamp done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
