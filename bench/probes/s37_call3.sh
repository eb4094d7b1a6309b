#!/usr/bin/env bash
# Session 37, call 3: DENSE mode's main walk through the fused kernel too (main_only; the recomputing proxy kernel after
# it), with FLASHMSA_BWD_FUSED_MAIN=0 (the standalone kernel) as the same binary's A/B. GPU tests of the dense and
# main-only paths and the knob, memcheck and racecheck on small dense cases, then the bench (its new dense_bwd_ms: the
# warmup step's backward) alternated by the knob, and the README call.
# Pack: the tree's build (bash scripts/pack_gpu.sh --from-build).
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
OUT0=$OUT; OUT=$R
stamp tests
gtest_run gpu-tests-dense-main.log 200 flashmsa_gpu_tests 'Bwd.*:Dense.*:Proxy.SmallDense:Proxy.*Dense*:Kl.*Dense*:Deterministic.Dense*:Deterministic.SmallSparse:Errors.Bad*Knob:Workspace.*:Graph.*:Proxy.SmallSparse:Kl.SmallSparseG1'
stamp sanitizers
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests \
  --gtest_filter='Bwd.SmallDense:Proxy.SmallDense:Bwd.StandaloneByKnob:Bwd.SmallSparse' > "$OUT/memcheck-dense-main.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED)" "$OUT/memcheck-dense-main.log"
timeout 120 compute-sanitizer --tool racecheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests \
  --gtest_filter='Bwd.SmallDense:Proxy.SmallDense' > "$OUT/racecheck-dense-main.log" 2>&1
echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|^\[  (PASSED|FAILED)" "$OUT/racecheck-dense-main.log"
stamp bench
for args in "--config m3 --seqlens 32768 --patterns clustered --iters 20" "--config fmsa --seqlens 16384 --patterns clustered --iters 60"; do
  bench_knob "$args" 2 FLASHMSA_BWD_FUSED_MAIN 1 0
done
stamp user
user_ab 1 520 ""
OUT=$OUT0
stamp done
tar -czf "$OUT/s37-call3.tgz" -C "$R" . && rm -rf "$R"
