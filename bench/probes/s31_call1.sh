#!/usr/bin/env bash
# Session 31, call 1: the fused backward's dq rows counted and converted by their last contribution (dq_writer.cuh),
# and the store-first variant (FLASHMSA_BWD_DQ=store: dq_acc not zeroed). GPU tests of the fused paths (the default
# and both knob values), memcheck and racecheck on small fused cases, then the three paths on one binary
# (FLASHMSA_BWD_DQ=convert is the previous path: adds only, the convert kernel), alternated by round, and the user's
# path with each.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp tests
timeout 240 ./.gpu/flashmsa_gpu_tests --gtest_filter='Proxy.SmallSparse:Proxy.GivenWithEmptyRows:Proxy.Gcd3PaddedHeadSlots:Proxy.G8:Proxy.G1Hpk2Tok64:Proxy.DqStoreFirstGiven:Proxy.DqStoreFirstM3:Proxy.DqConvertKernel:Proxy.SegmentedLists:Proxy.SegmentedListsM3Given:Proxy.BatchedFp16:Proxy.ZeroGradientIsExactlyZero:Kl.SmallSparseG1:Errors.BadBwdDqKnob:Workspace.KlSegmentRule:Deterministic.SmallSparse:Proxy.G64Given:Proxy.FmsaVarlenRecomputedLse' \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]|OK \]" "$OUT/tests.log" | head -40
stamp memcheck
timeout 70 compute-sanitizer --tool memcheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests \
  --gtest_filter='Proxy.SmallSparse:Proxy.DqStoreFirstGiven:Proxy.GivenWithEmptyRows' > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?"; tail -2 "$OUT/memcheck.log"
stamp racecheck
timeout 70 compute-sanitizer --tool racecheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests \
  --gtest_filter='Proxy.SmallSparse' > "$OUT/racecheck.log" 2>&1
echo "racecheck rc=$?"; tail -2 "$OUT/racecheck.log"
stamp ab
for args in "--config m3 --seqlens 32768 --patterns clustered --iters 30" "--config m3 --seqlens 32768 --patterns random --iters 30" "--config fmsa --seqlens 16384 --patterns clustered --iters 100"; do
  for round in 1 2; do
    for path in convert last store; do
      [ $SECONDS -lt 430 ] || { echo "bench $path skipped (time)"; continue; }
      tag=$path-$(echo "$args" | awk '{print $2"-"$4"-"$6}')-r$round
      FLASHMSA_BWD_DQ=$path timeout 60 ./.gpu/flashmsa_bench $args --options 0 > "$OUT/bench-$tag.json" 2>&1
      echo "$tag $(python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print('bwd', r['bwd_ms'], 'step', r['step_ms'], 'gb', r.get('step_gb'))" "$OUT/bench-$tag.json" 2>&1 | tail -1)"
    done
  done
done
stamp user
for path in convert last store; do
  [ $SECONDS -lt 520 ] || { echo "user $path skipped (time)"; continue; }
  d=$OUT/user-$path; mkdir -p "$d"
  FLASHMSA_BWD_DQ=$path FLASHMSA_LIBRARY=$PWD/.gpu/libflashmsa.so PYTHONUNBUFFERED=1 timeout 80 python3 bench/run_bench.py \
    --user-only --out "$d" --configs m3 --seqlens 32768 --patterns clustered > "$d/log.txt" 2>&1
  echo "user $path rc=$?"; grep -E "^\| m3" "$d"/*.md || tail -5 "$d/log.txt"
done
stamp done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
