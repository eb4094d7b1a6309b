#!/usr/bin/env bash
# Session 36, call 2: the fused kernel's items taken longest list first (the inversion's `order`; bwd_misc.cu
# item_keys_kernel + a stable descending radix sort of the list lengths) against session 35's binaries (block-major
# order): a few fused tests on the new build first, then the backward A/B (m3 32k clustered and random, fmsa 16k; two
# rounds, alternated), m3 128k clustered (one round), and the README call with each library (one round).
# Pack: the tree's build plus flashmsa_bench_s35 and libflashmsa_s35.so (session 35's d746a84).
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp smoke
gtest_run gpu-tests-lpt-smoke.log 60 flashmsa_gpu_tests 'Proxy.SmallSparse:Proxy.G8:Proxy.DqStoreFirstFp16BatchedPadded:Proxy.GivenWithEmptyRows:Deterministic.SmallSparse:Kl.SmallSparseG1:Kl.FmsaVarlenDense'
OUT0=$OUT; OUT=$R
stamp ab
bench_three 2 lpt:flashmsa_bench: s35:flashmsa_bench_s35:
stamp 128k
bench_variants "--config m3 --seqlens 131072 --patterns clustered --iters 10" 1 lpt:flashmsa_bench: s35:flashmsa_bench_s35:
stamp user
user_ab 1 520 "" _s35
OUT=$OUT0
stamp done
tar -czf "$OUT/s36-call2.tgz" -C "$R" . && rm -rf "$R"
