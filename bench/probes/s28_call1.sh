#!/usr/bin/env bash
# Session 28, first call: the two-dQ-tile candidate (bench/probes/bwd-dq-two-tiles.patch, `scripts/patch_variant.sh
# tt ...`): its GPU tests and racecheck on the small fused cases, then its A/B against the default with nvidia-smi
# beside every run (binaries alternated, two rounds), then cuDNN's dense m3 32k step under the same clock log
# (bench/probes/cudnn_clock.py). One bundle under $OUT.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
stamp() { echo "== $1 ($(date +%T))"; }
stamp tests
timeout 300 ./.gpu/flashmsa_gpu_tests_tt \
  --gtest_filter='Bwd.*:Kl.*:Proxy.*:Deterministic.*:Numerics.Precise*:Dense.*:Given.*:Graph.*' > "$OUT/tests-tt.log" 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/tests-tt.log" | head -20
stamp racecheck
timeout 150 compute-sanitizer --tool racecheck ./.gpu/flashmsa_gpu_tests_tt \
  --gtest_filter='Kl.SmallSparseG1:Bwd.Small*:Proxy.SmallSparse:Deterministic.SmallSparse' > "$OUT/racecheck-tt.log" 2>&1
echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|^\[  (PASSED|FAILED)" "$OUT/racecheck-tt.log"
smi() { nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader -lms 20 > "$1" 2>&1 & }
for args in "--config m3 --seqlens 32768 --patterns clustered --iters 50" "--config m3 --seqlens 32768 --patterns random --iters 30" "--config fmsa --seqlens 16384 --patterns clustered --iters 100"; do
  stamp "ab $args"
  for round in 1 2; do
    for b in flashmsa_bench flashmsa_bench_tt; do
      tag=$b-$(echo "$args" | awk '{print $2"-"$6}')-r$round
      smi "$OUT/clocks-$tag.csv"; pid=$!
      ./.gpu/$b $args --options 0 > "$OUT/bench-$tag.json" 2>&1
      kill $pid; wait $pid 2>/dev/null
      echo "$tag $(python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print('bwd', r['bwd_ms'], 'step', r['step_ms'], 'fwd', r['fwd_train_ms'])" "$OUT/bench-$tag.json")"
      python3 bench/probes/clock_phases.py --bwd "$OUT/clocks-$tag.csv"
      sleep 2
    done
  done
done
stamp cudnn
smi "$OUT/clocks-cudnn.csv"; pid=$!
python3 bench/probes/cudnn_clock.py > "$OUT/cudnn.txt" 2>&1
kill $pid; wait $pid 2>/dev/null
cat "$OUT/cudnn.txt"
python3 bench/probes/clock_phases.py "$OUT/clocks-cudnn.csv"
stamp done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
