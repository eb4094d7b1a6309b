#!/usr/bin/env bash
# Session 33, call 2: latency hiding for the main walk's gathered rows (the consumers' stage wait, ~7% of their
# samples in session 30's profile; docs/kernels/bwd.md "Session 33"). Built with scripts/patch_variant.sh:
# - st3: three pipeline stages (bench/probes/bwd-three-stages.patch): dS^T single-buffered to make room, the consumers
#   meet after their dQ GEMMs (both have read dS^T) before the next chunk stages it;
# - pf: the producer prefetches the next chunk's Q and dO rows into the L2 (prefetch.global.L2, per 128-byte line)
#   right after it issues this chunk's gathers (bench/probes/bwd-l2-prefetch.patch; the fused kernel's walk only);
# - st3pf: both.
# Tests of the three (in parallel processes), the A/B alternated by round, m3 128k, the README call per library.
# Results land in $OUT (logs and JSON packed into one archive at the end).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/r" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
R=$OUT/r
F='Bwd.SmallSparse:Bwd.SmallDense:Bwd.DenseVarlen:Bwd.FmsaVarlenOddLengthsPoisonedWorkspace:Bwd.G1Topk32:Proxy.SmallSparse:Proxy.Gcd3PaddedHeadSlots:Proxy.DqStoreFirstM3:Proxy.LongSegment:Kl.SmallSparseG1:Kl.M3Sparse:Kl.SparseWithoutProxyLseOutput:Deterministic.SmallSparse:Dense.SmallM3:Graph.TrainingStepCaptureReplay'
stamp tests
for v in st3 pf st3pf; do
  timeout 200 ./.gpu/flashmsa_gpu_tests_$v --gtest_filter="$F" > "$R/$v-tests.log" 2>&1 &
done
wait
for v in st3 pf st3pf; do echo "$v: $(grep -E '^\[  (PASSED|FAILED)' "$R/$v-tests.log" | tr '\n' ' ')"; grep "FAILED  \]" "$R/$v-tests.log" | head -5; done
stamp ab
OUT0=$OUT; OUT=$R
for args in "--config m3 --seqlens 32768 --patterns clustered --iters 20" "--config m3 --seqlens 32768 --patterns random --iters 20" \
            "--config fmsa --seqlens 16384 --patterns clustered --iters 100"; do
  bench_variants "$args" 2 def:flashmsa_bench: st3:flashmsa_bench_st3: pf:flashmsa_bench_pf: st3pf:flashmsa_bench_st3pf:
done
bench_variants "--config m3 --seqlens 131072 --patterns clustered --iters 10" 1 def:flashmsa_bench: st3:flashmsa_bench_st3: \
  pf:flashmsa_bench_pf: st3pf:flashmsa_bench_st3pf:
stamp user
user_ab 1 500 "" _st3 _pf _st3pf
stamp done
OUT=$OUT0
tar -czf "$OUT/s33-call2.tgz" -C "$R" . && rm -rf "$R"
