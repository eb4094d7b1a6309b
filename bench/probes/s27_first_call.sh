#!/usr/bin/env bash
# The next session's first device call (prepared in session 26), ~400 s, .gpu_pack carried. Build first (a fresh
# checkout: `bash scripts/setup.sh`), then the variants:
#   bash scripts/patch_variant.sh dz bench/probes/bwd-dq-zero-in-preprocess.patch
#   bash scripts/patch_variant.sh si bench/probes/bwd-inversion-side-stream.patch
#   bash scripts/patch_variant.sh s25 bench/probes/fwd-before-persistent.patch
#   bash scripts/patch_variant.sh cm bench/probes/fwd-persistent-compact-masks.patch
#   bash scripts/pack_gpu.sh --from-build
# 1. The default against dz (dq's accumulator zeroed by the preprocess next to its reads, not by a memset), si (the
#    index inversion on a side stream under the preprocess), s25 (session 25's forward, before the persistent
#    kernel) and cm (compact token masks), alternated, two rounds. The variants' GPU tests: s27_second_call.sh.
# 2. The top-k sweep of the user's step (bench/topk_sweep.py) with the default library, s25's and cm's (compact token
#    masks: two tile buffers at fmsa topk 32), fmsa 32k at topk 16, 32, 64: topk >= 32 at fmsa runs the persistent
#    forward's one-buffer plan (NT x topk > 512) in the default, unmeasured so far.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# 0. The default build's tests of what changed after session 26's whole-suite run (host code only: the persistent
#    forward's shared-memory attribute at its largest plan, the workspace alignment check and its test).
mkdir -p .gpu && tar -xJf .gpu_pack/bins.tar.xz -C .gpu
timeout 120 ./.gpu/flashmsa_gpu_tests --gtest_filter='Errors.*:Persistent.*:Graph.*' > "$OUT/tests-default.log" 2>&1
echo "default tests rc=$?"; grep -E "tests? from .* ran|PASSED|FAILED" "$OUT/tests-default.log" | tail -6
VARS="dz si s25 cm" AB=1 TESTS=0 BUDGET_S=250 \
  ALT_ARGS="--config m3 --seqlens 32768 --patterns clustered,random;--config fmsa --seqlens 16384 --patterns clustered" \
  OUT=$OUT bash bench/probes/ab_multi.sh
for lib in "" _s25 _cm; do
  mkdir -p "$OUT/sweep$lib"
  FLASHMSA_LIBRARY=$PWD/.gpu/libflashmsa$lib.so PYTHONUNBUFFERED=1 timeout 120 python3 bench/topk_sweep.py \
    --out "$OUT/sweep$lib" --configs fmsa --seqlens 32768 --topks 16,32,64 > "$OUT/sweep$lib/log.txt" 2>&1
  echo "sweep lib$lib rc=$?"; tail -8 "$OUT/sweep$lib/log.txt"
done
# the device returns at most 8 files: everything in one archive, the A/B summary beside it
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 ! -name ab-summary.txt -delete && mv /tmp/bundle.tgz .)
