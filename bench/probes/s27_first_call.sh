#!/usr/bin/env bash
# The next session's first device call (prepared in session 26), ~450 s, .gpu_pack carried. Build first (a fresh
# checkout: `bash scripts/setup.sh`), then the variants:
#   bash scripts/patch_variant.sh dz bench/probes/bwd-dq-zero-in-preprocess.patch
#   bash scripts/patch_variant.sh si bench/probes/bwd-inversion-side-stream.patch
#   bash scripts/patch_variant.sh s25 bench/probes/fwd-before-persistent.patch
#   bash scripts/pack_gpu.sh --from-build
# 1. The default against dz (dq's accumulator zeroed by the preprocess next to its reads, not by a memset), si (the
#    index inversion on a side stream under the preprocess) and s25 (session 25's forward, before the persistent
#    kernel), alternated, two rounds; dz's and si's GPU tests (si: the CUDA-graph tests too), memcheck of dz.
# 2. The top-k sweep of the user's step (bench/topk_sweep.py) with the default library and s25's, fmsa 32k at topk 16,
#    32, 64: topk >= 32 at fmsa runs the persistent forward's one-buffer plan (NT x topk > 512), unmeasured so far.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# 0. The default build's tests of what changed after session 26's whole-suite run (host code only: the persistent
#    forward's shared-memory attribute at its largest plan, the workspace alignment check and its test).
mkdir -p .gpu && tar -xJf .gpu_pack/bins.tar.xz -C .gpu
timeout 120 ./.gpu/flashmsa_gpu_tests --gtest_filter='Errors.*:Persistent.*:Graph.*' > "$OUT/tests-default.log" 2>&1
echo "default tests rc=$?"; grep -E "tests? from .* ran|PASSED|FAILED" "$OUT/tests-default.log" | tail -6
VARS="dz si s25" AB=1 TESTS=1 BUDGET_S=400 \
  ALT_ARGS="--config m3 --seqlens 32768 --patterns clustered,random;--config fmsa --seqlens 16384 --patterns clustered" \
  TESTS_dz='Bwd.*:Kl.*:Deterministic.*:Proxy.Small*:Proxy.G*:Proxy.M3Batched:Proxy.DenseWarmup:Given.*:Numerics.Precise*' \
  TESTS_S_dz=200 MEMCHECK_dz='Bwd.Small*:Deterministic.SmallSparse:Proxy.SmallSparse:Proxy.SmallDense' \
  TESTS_si='Graph.*:Bwd.Small*:Bwd.GivenWithEmptyRows:Bwd.DenseVarlen:Proxy.Small*:Deterministic.SmallSparse:Kl.Small*' \
  TESTS_S_si=90 OUT=$OUT bash bench/probes/ab_multi.sh
for lib in "" _s25; do
  mkdir -p "$OUT/sweep$lib"
  FLASHMSA_LIBRARY=$PWD/.gpu/libflashmsa$lib.so PYTHONUNBUFFERED=1 timeout 120 python3 bench/topk_sweep.py \
    --out "$OUT/sweep$lib" --configs fmsa --seqlens 32768 --topks 16,32,64 > "$OUT/sweep$lib/log.txt" 2>&1
  echo "sweep lib$lib rc=$?"; tail -8 "$OUT/sweep$lib/log.txt"
done
# the device returns at most 8 files: everything in one archive, the A/B summary beside it
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 ! -name ab-summary.txt -delete && mv /tmp/bundle.tgz .)
