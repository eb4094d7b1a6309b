#!/usr/bin/env bash
# Prepared in session 30 for the next session's first call: the whole GPU suite on the shipped build (af20bb0's
# kernels: the kl segment rule and the branch-free kl element loop were run through their own and the kl/proxy tests
# only, and Workspace.KlSegmentRule's review fix has not run), in two parts within one call (the whole suite took
# 463 s in one process in session 24; each part gets its own limit), then memcheck of the small fused cases.
# Carry .gpu_pack from `bash scripts/pack_gpu.sh --from-build` on the tree's build.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp suite-1
timeout 290 ./.gpu/flashmsa_gpu_tests --gtest_filter='Workspace.*:Proxy.*:Kl.*:Bwd.*:Given.*' > "$OUT/gpu-suite-1.log" 2>&1
echo "suite-1 rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/gpu-suite-1.log" | head
stamp suite-2
timeout 250 ./.gpu/flashmsa_gpu_tests --gtest_filter='-Workspace.*:Proxy.*:Kl.*:Bwd.*:Given.*' > "$OUT/gpu-suite-2.log" 2>&1
echo "suite-2 rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/gpu-suite-2.log" | head
stamp memcheck
timeout 45 compute-sanitizer --tool memcheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests \
  --gtest_filter='Proxy.SmallSparse:Kl.SmallSparseG1:Bwd.SmallSparse:Proxy.GivenWithEmptyRows' > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?"; tail -1 "$OUT/memcheck.log"
stamp done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
