#!/usr/bin/env bash
# Session 28, fourth call: the accumulators' zeroing on a side stream next to the preprocess and the inversion
# (bench/probes/bwd-zero-side-stream.patch, `scripts/patch_variant.sh ms ...`): its GPU tests (the graph suite with the
# new Graph.EagerBackwardDuringCapture, the poisoned-workspace and proxy cases), the A/B against the default
# (alternated, two rounds) and the user's path with each library, m3 32k clustered, alternated.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
stamp() { echo "== $1 ($(date +%T))"; }
stamp ab
for args in "--config m3 --seqlens 32768 --patterns clustered --iters 30" "--config fmsa --seqlens 16384 --patterns clustered --iters 100"; do
  for round in 1 2; do
    for b in flashmsa_bench flashmsa_bench_ms; do
      tag=$b-$(echo "$args" | awk '{print $2"-"$6}')-r$round
      ./.gpu/$b $args --options 0 > "$OUT/bench-$tag.json" 2>&1
      echo "$tag $(python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print('bwd', r['bwd_ms'], 'step', r['step_ms'], 'fwd', r['fwd_train_ms'])" "$OUT/bench-$tag.json")"
      sleep 1
    done
  done
done
stamp tests
timeout 200 ./.gpu/flashmsa_gpu_tests_ms \
  --gtest_filter='Graph.*:Bwd.FmsaVarlenOddLengthsPoisonedWorkspace:Bwd.Small*:Proxy.SmallSparse:Proxy.G8:Kl.*:Deterministic.SmallSparse:Dense.SmallM3:Given.SmallOdd:Errors.*' \
  > "$OUT/tests-ms.log" 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/tests-ms.log" | head
for r in 1 2; do
  for v in "" _ms; do
    [ $SECONDS -lt 470 ] || { echo "user $v skipped (time)"; continue; }
    d=$OUT/user$v-r$r; mkdir -p $d
    FLASHMSA_LIBRARY=$PWD/.gpu/libflashmsa$v.so PYTHONUNBUFFERED=1 timeout 100 python3 bench/run_bench.py --user-only \
      --out $d --configs m3 --seqlens 32768 --patterns clustered > $d/log.txt 2>&1
    echo "user lib$v round $r rc=$?"; grep -E "^\| m3" $d/*.md || tail -5 $d/log.txt
  done
done
stamp done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
