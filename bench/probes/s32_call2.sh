#!/usr/bin/env bash
# Session 32, call 2: part 2 of the whole GPU suite on the default build (the complement of part 1's
# Workspace.*:Proxy.*:Kl.*:Given.*), then memcheck and racecheck of small fused cases (carry .gpu_pack).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp suite-2
timeout 420 ./.gpu/flashmsa_gpu_tests --gtest_filter='-Workspace.*:Proxy.*:Kl.*:Given.*' > "$OUT/gpu-suite-2.log" 2>&1
echo "suite-2 rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/gpu-suite-2.log" | head
stamp memcheck
timeout 90 compute-sanitizer --tool memcheck --error-exitcode 3 ./.gpu/flashmsa_gpu_tests \
  --gtest_filter='Proxy.SmallSparse:Kl.SmallSparseG1:Bwd.SmallSparse:Proxy.GivenWithEmptyRows:Proxy.DqStoreFirstGiven' > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck.log" | head -4
stamp racecheck
timeout $((585 - SECONDS)) compute-sanitizer --tool racecheck --error-exitcode 3 ./.gpu/flashmsa_gpu_tests \
  --gtest_filter='Proxy.SmallSparse:Proxy.DqStoreFirstGiven' > "$OUT/racecheck.log" 2>&1
echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|PASSED|FAILED" "$OUT/racecheck.log" | head -4
stamp done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
