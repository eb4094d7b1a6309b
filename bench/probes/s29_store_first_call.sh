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
stamp() { echo "== $1 ($(date +%T))"; }
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
  for round in 1 2; do
    for b in flashmsa_bench flashmsa_bench_sf; do
      tag=$b-$(echo "$args" | awk '{print $2"-"$6}')-r$round
      ./.gpu/$b $args --options 0 > "$OUT/bench-$tag.json" 2>&1
      echo "$tag $(python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print('bwd', r['bwd_ms'], 'step', r['step_ms'])" "$OUT/bench-$tag.json" 2>&1 | tail -1)"
    done
  done
done
for r in 1 2; do
  for v in "" _sf; do
    [ $SECONDS -lt 520 ] || { echo "user $v skipped (time)"; continue; }
    d=$OUT/user$v-r$r; mkdir -p $d
    FLASHMSA_LIBRARY=$PWD/.gpu/libflashmsa$v.so PYTHONUNBUFFERED=1 timeout 90 python3 bench/run_bench.py --user-only \
      --out $d --configs m3 --seqlens 32768 --patterns clustered > $d/log.txt 2>&1
    echo "user lib$v round $r rc=$?"; grep -E "^\| m3" $d/*.md || tail -5 $d/log.txt
  done
done
stamp done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
