#!/usr/bin/env bash
# Session 32, call 4 (short: the session's last device seconds): a share of the main walk's exps on the FMA pipe
# (bench/probes/bwd-exp2-poly-rows{1,2}.patch: 1 or 2 of each thread's 8 P^T rows through exp2f_poly_or_zero), A/B
# against the default, m3 32k first; then a few GPU tests of poly2. Each result lands in $OUT as it is written.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp ab
bench_variants "--config m3 --seqlens 32768 --patterns clustered --iters 20" 2 def:flashmsa_bench: \
  poly1:flashmsa_bench_poly1: poly2:flashmsa_bench_poly2:
bench_variants "--config fmsa --seqlens 16384 --patterns clustered --iters 100" 1 def:flashmsa_bench: \
  poly1:flashmsa_bench_poly1: poly2:flashmsa_bench_poly2:
stamp tests
timeout 60 ./.gpu/flashmsa_gpu_tests_poly2 --gtest_filter='Proxy.SmallSparse:Bwd.SmallSparse:Kl.SmallSparseG1:Proxy.G1Hpk2Tok64' \
  > "$OUT/poly2-tests.log" 2>&1
echo "poly2 tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/poly2-tests.log" | head
stamp done
