#!/usr/bin/env bash
# Prepared in session 28 for the next session's first call: the store-first dQ after its fix
# (bench/probes/bwd-dq-store-first.patch; build: `bash scripts/patch_variant.sh sf bench/probes/bwd-dq-store-first.patch`,
# then `bash scripts/pack_gpu.sh --from-build`, carry .gpu_pack). Its GPU tests (the backward, proxy, kl, given, graph
# and error suites: poisoned workspaces, given rows without their own block, segments, m3 heads), racecheck and
# memcheck of small fused cases, the A/B against the default (alternated, two rounds) and the user's path with each
# library at m3 32k clustered. Call 5 of session 28 ran the unfixed build: 7 proxy/graph tests failed and the backward
# was 1.3-1.7% slower (docs/kernels/bwd.md "Session 28").
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp tests
timeout 240 ./.gpu/flashmsa_gpu_tests_sf \
  --gtest_filter='Proxy.*:Kl.*:Bwd.Small*:Bwd.FmsaVarlenOddLengthsPoisonedWorkspace:Bwd.M3SparseDlse:Given.*:Graph.*:Deterministic.Small*:Errors.*' \
  > "$OUT/tests-sf.log" 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/tests-sf.log" | head
stamp sanitizers
timeout 120 compute-sanitizer --tool racecheck ./.gpu/flashmsa_gpu_tests_sf \
  --gtest_filter='Proxy.SmallSparse:Kl.SmallSparseG1:Proxy.GivenWithEmptyRows' > "$OUT/racecheck-sf.log" 2>&1
echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|^\[  (PASSED|FAILED)" "$OUT/racecheck-sf.log"
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests_sf \
  --gtest_filter='Proxy.SmallSparse:Kl.SmallSparseG1:Proxy.GivenWithEmptyRows:Bwd.SmallSparse' > "$OUT/memcheck-sf.log" 2>&1
echo "memcheck rc=$?"; tail -1 "$OUT/memcheck-sf.log"
stamp ab
for args in "--config m3 --seqlens 32768 --patterns clustered --iters 30" "--config m3 --seqlens 32768 --patterns random --iters 30" "--config fmsa --seqlens 16384 --patterns clustered --iters 100"; do
  bench_ab "$args" 2 flashmsa_bench flashmsa_bench_sf
done
user_ab 2 520 "" _sf
stamp done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
