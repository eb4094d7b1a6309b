#!/usr/bin/env bash
# Session 37, call 2: SPARSE/GIVEN without a proxy side through the fused kernel's main walk (FusedArgs::main_only,
# BwdLayout::fused_main) instead of the standalone kernel. The GPU tests that take that path or its neighbours, memcheck
# and racecheck on small main-only cases, then the A/B against session 36's binaries (flashmsa_bench_s36: the
# standalone kernel for bwd_main_ms; the default backward must not move), m3 128k, the Python CUDA tests and the
# README call with the frozen-proxy columns (this library and session 36's).
# Pack: the tree's build plus flashmsa_bench_s36, libflashmsa_s36.so (call 1's build) and flashmsa_bench_mainonly.
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
OUT0=$OUT; OUT=$R
line() { python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print(sys.argv[2], 'bwd', r['bwd_ms'], r['bwd_tflops'], 'main', r.get('bwd_main_ms'), r.get('bwd_main_tflops'), 'step', r['step_ms'])" "$1" "$2" 2>&1 | tail -1; }
stamp tests
gtest_run gpu-tests-main-only.log 230 flashmsa_gpu_tests 'Bwd.*:Given.*:Numerics.*:Graph.*:Workspace.*:Proxy.SmallSparse:Proxy.G8:Kl.SmallSparseG1:Deterministic.SmallSparse:Deterministic.FourUnitsPerKvHead'
stamp sanitizers
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests \
  --gtest_filter='Bwd.SmallSparse:Bwd.G1Topk32:Bwd.GivenWithEmptyRows:Bwd.GroupOverUnitsStandalone' > "$OUT/memcheck-main-only.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED)" "$OUT/memcheck-main-only.log"
timeout 150 compute-sanitizer --tool racecheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests \
  --gtest_filter='Bwd.SmallSparse:Bwd.G1Topk32' > "$OUT/racecheck-main-only.log" 2>&1
echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|^\[  (PASSED|FAILED)" "$OUT/racecheck-main-only.log"
stamp bench
for round in 1 2; do
  for args in "--config m3 --seqlens 32768 --patterns clustered --iters 20" "--config m3 --seqlens 32768 --patterns random --iters 20" \
              "--config fmsa --seqlens 16384 --patterns clustered --iters 100"; do
    for b in flashmsa_bench flashmsa_bench_s36; do
      tag=$b-$(echo "$args" | awk '{print $2"-"$4"-"$6}')-r$round
      timeout 90 ./.gpu/$b $args --options 0 > "$OUT/bench-$tag.json" 2>&1; line "$OUT/bench-$tag.json" "$tag"
    done
  done
done
stamp 128k
for b in flashmsa_bench flashmsa_bench_s36; do
  [ $SECONDS -lt 430 ] || { echo "128k $b skipped (time)"; continue; }
  tag=$b-m3-131072-clustered
  timeout 100 ./.gpu/$b --config m3 --seqlens 131072 --patterns clustered --iters 10 --options 0 > "$OUT/bench-$tag.json" 2>&1
  line "$OUT/bench-$tag.json" "$tag"
done
stamp user
user_ab 1 540 "" _s36
OUT=$OUT0
stamp done
tar -czf "$OUT/s37-call2.tgz" -C "$R" . && rm -rf "$R"
