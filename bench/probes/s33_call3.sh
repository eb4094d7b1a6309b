#!/usr/bin/env bash
# Session 33, call 3: the three-stage main walk (st3, bench/probes/bwd-three-stages.patch; call 2: m3 32k -1.2%
# clustered, -2.0% random, 128k -1.6%, fmsa 16k +0.7%) before it ships: the whole GPU suite on it in six gtest shards
# run side by side (the fp64 references are CPU-bound), memcheck and racecheck of small fused cases beside them
# (dS^T is single-buffered now: racecheck is the check of the new barrier), then the README call with the default
# library and with st3's, alternated. Results packed into $OUT/s33-call3.tgz.
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp suite
for i in 0 1 2 3 4 5; do
  GTEST_TOTAL_SHARDS=6 GTEST_SHARD_INDEX=$i timeout 230 ./.gpu/flashmsa_gpu_tests_st3 > "$R/st3-suite-shard$i.log" 2>&1 &
done
timeout 220 compute-sanitizer --tool racecheck --error-exitcode 3 ./.gpu/flashmsa_gpu_tests_st3 \
  --gtest_filter='Proxy.SmallSparse:Bwd.SmallSparse:Deterministic.SmallSparse' > "$R/st3-racecheck.log" 2>&1 &
timeout 220 compute-sanitizer --tool memcheck --error-exitcode 3 ./.gpu/flashmsa_gpu_tests_st3 \
  --gtest_filter='Proxy.SmallSparse:Kl.SmallSparseG1:Bwd.SmallSparse:Bwd.SmallDense:Proxy.DqStoreFirstGiven' > "$R/st3-memcheck.log" 2>&1 &
wait
for f in "$R"/st3-suite-shard*.log; do echo "$(basename "$f"): $(grep -E '^\[  (PASSED|FAILED)|tests ran' "$f" | tr '\n' ' ')"; grep "FAILED  \]" "$f" | head -5; done
grep -E "RACECHECK SUMMARY|ERROR SUMMARY|PASSED|FAILED" "$R/st3-racecheck.log" "$R/st3-memcheck.log" | head -8
tar -czf "$OUT/s33-call3-tests.tgz" -C "$R" .
stamp user
OUT0=$OUT; OUT=$R
user_ab 1 $((SECONDS + 100)) "" _st3
OUT=$OUT0
stamp done
tar -czf "$OUT/s33-call3.tgz" -C "$R" . && rm -rf "$R"
