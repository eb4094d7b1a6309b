#!/usr/bin/env bash
# Session 30, call 2: the kl segment rule (default build: a quarter of the dq accumulator, 1024..4096 entries) through
# its new GPU tests; the writers without their final completion wait (bench/probes/bwd-writers-no-final-wait.patch,
# `nw`: built by `bash scripts/patch_variant.sh nw bench/probes/bwd-writers-no-final-wait.patch`) through the backward's
# GPU tests and sanitizers, then the A/B against the default (alternated, two rounds) and the user's path with each.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp tests-default
timeout 90 ./.gpu/flashmsa_gpu_tests --gtest_filter='Workspace.KlSegmentRule:Proxy.LongSegment:Proxy.Segmented*:Errors.BadSegmentKnob' \
  > "$OUT/tests-default.log" 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]|OK \]" "$OUT/tests-default.log" | head -12
stamp tests-nw
timeout 200 ./.gpu/flashmsa_gpu_tests_nw --gtest_filter='Proxy.*:Kl.*:Bwd.Small*:Bwd.M3*:Bwd.FmsaVarlen*:Given.*:Graph.*' \
  > "$OUT/tests-nw.log" 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/tests-nw.log" | head
stamp sanitizers
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests_nw \
  --gtest_filter='Proxy.SmallSparse:Kl.SmallSparseG1:Bwd.SmallSparse' > "$OUT/memcheck-nw.log" 2>&1
echo "memcheck rc=$?"; tail -1 "$OUT/memcheck-nw.log"
timeout 60 compute-sanitizer --tool racecheck ./.gpu/flashmsa_gpu_tests_nw \
  --gtest_filter='Proxy.SmallSparse:Kl.SmallSparseG1' > "$OUT/racecheck-nw.log" 2>&1
echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY" "$OUT/racecheck-nw.log"
stamp ab
for args in "--config m3 --seqlens 32768 --patterns clustered --iters 30" "--config m3 --seqlens 32768 --patterns random --iters 30" "--config fmsa --seqlens 16384 --patterns clustered --iters 100"; do
  bench_ab "$args" 2 flashmsa_bench flashmsa_bench_nw
done
user_ab 2 560 "" _nw
stamp done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
