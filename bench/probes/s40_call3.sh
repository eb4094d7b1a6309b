#!/usr/bin/env bash
# Session 40, call 3: the whole GPU suite on the head's build (kernels of session 38), in four gtest shards run side by
# side (GTEST_TOTAL_SHARDS / GTEST_SHARD_INDEX; the tests' fp64 references are CPU work), each cut at 470 s; then
# memcheck and racecheck on small fused, standalone and deterministic cases (callkit.sh `sanitize`, the same
# commands as ran, moved there after the call). Build first: bash scripts/setup.sh &&
# bash scripts/pack_gpu.sh --from-build; carry [".gpu_pack"].
OUT=${OUT:-/tmp/out}
source bench/probes/callkit.sh
call_open
stamp suite
for i in 0 1 2 3; do
  GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i timeout 470 ./.gpu/flashmsa_gpu_tests > "$OUT/gpu-suite-shard$i.log" 2>&1 &
done
wait
for i in 0 1 2 3; do
  echo "shard $i: $(grep -cE '^\[       OK' "$OUT/gpu-suite-shard$i.log") ok, $(grep -cE '^\[  FAILED  \] [A-Z]' "$OUT/gpu-suite-shard$i.log") failed lines; $(grep -E '^\[  (PASSED|FAILED)' "$OUT/gpu-suite-shard$i.log" | head -2 | tr '\n' ' ')"
  grep -E '^\[  FAILED  \] [A-Z]' "$OUT/gpu-suite-shard$i.log" | head -5
done
stamp sanitizers
small='Bwd.Small*:Kl.SmallSparseG1:Proxy.SmallSparse:Deterministic.SmallSparse'
sanitize memcheck 60 "$small"
sanitize racecheck 60 "$small"
stamp done
call_close s40-call3
