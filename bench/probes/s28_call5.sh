#!/usr/bin/env bash
# Session 28, fifth call: the store-first dQ (bench/probes/bwd-dq-store-first.patch, `scripts/patch_variant.sh sf ...`):
# its GPU tests (poisoned workspace, given indices with empty rows and no own block, segments, m3 heads, graphs),
# then the A/B against the default (alternated, two rounds) and the user's path with each library, m3 32k clustered.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
stamp() { echo "== $1 ($(date +%T))"; }
stamp tests
timeout 150 ./.gpu/flashmsa_gpu_tests_sf \
  --gtest_filter='Bwd.FmsaVarlenOddLengthsPoisonedWorkspace:Bwd.Small*:Kl.*:Proxy.SmallSparse:Proxy.G8:Proxy.GivenWithEmptyRows:Proxy.G64Given:Proxy.SegmentedLists:Proxy.M3Batched:Given.*:Graph.*:Deterministic.SmallSparse:Errors.*' \
  > "$OUT/tests-sf.log" 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/tests-sf.log" | head
stamp ab
for round in 1 2; do
  for b in flashmsa_bench flashmsa_bench_sf; do
    tag=$b-m3-clustered-r$round
    ./.gpu/$b --config m3 --seqlens 32768 --patterns clustered --iters 30 --options 0 > "$OUT/bench-$tag.json" 2>&1
    echo "$tag $(python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print('bwd', r['bwd_ms'], 'step', r['step_ms'], 'fwd', r['fwd_train_ms'])" "$OUT/bench-$tag.json" 2>&1 | tail -1)"
  done
done
for v in "" _sf; do
  [ $SECONDS -lt 230 ] || { echo "user $v skipped (time)"; continue; }
  d=$OUT/user$v; mkdir -p $d
  FLASHMSA_LIBRARY=$PWD/.gpu/libflashmsa$v.so PYTHONUNBUFFERED=1 timeout 90 python3 bench/run_bench.py --user-only \
    --out $d --configs m3 --seqlens 32768 --patterns clustered > $d/log.txt 2>&1
  echo "user lib$v rc=$?"; grep -E "^\| m3" $d/*.md || tail -5 $d/log.txt
done
stamp done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
