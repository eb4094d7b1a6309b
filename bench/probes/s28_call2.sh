#!/usr/bin/env bash
# Session 28, second call: the teacher GEMM candidate (bench/probes/bwd-teacher-gemm.patch, `scripts/patch_variant.sh
# tg ...`): its GPU tests (the proxy/kl suites, where Rp >= 8 takes the GEMM: m3, G8, G32, G64) and racecheck of
# Proxy.G8; the A/B of default, tg and the timing probe cna (bwd-dq-copy-not-add.patch: plain bulk copies instead of
# the dQ reduce-adds, wrong dq) with nvidia-smi beside each run, alternated; then the user's path (the README call)
# with the default library and tg's, m3 32k clustered, alternated. One bundle under $OUT.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
stamp() { echo "== $1 ($(date +%T))"; }
smi() { nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader -lms 20 > "$1" 2>&1 & }
ab() {  # ab "ARGS" BIN...
  local args=$1; shift
  stamp "ab $args"
  for round in 1 2; do
    for b in "$@"; do
      tag=$b-$(echo "$args" | awk '{print $2"-"$6}')-r$round
      smi "$OUT/clocks-$tag.csv"; pid=$!
      ./.gpu/$b $args --options 0 > "$OUT/bench-$tag.json" 2>&1
      kill $pid; wait $pid 2>/dev/null
      echo "$tag $(python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print('bwd', r['bwd_ms'], 'step', r['step_ms'], 'fwd', r['fwd_train_ms'])" "$OUT/bench-$tag.json")"
      python3 bench/probes/clock_phases.py --bwd "$OUT/clocks-$tag.csv" | tail -1
      sleep 2
    done
  done
}
ab "--config m3 --seqlens 32768 --patterns clustered --iters 50" flashmsa_bench flashmsa_bench_tg flashmsa_bench_cna
ab "--config m3 --seqlens 32768 --patterns random --iters 30" flashmsa_bench flashmsa_bench_tg
stamp tests
timeout 280 ./.gpu/flashmsa_gpu_tests_tg \
  --gtest_filter='Proxy.*:Kl.*:Bwd.M3SparseDlse:Bwd.Small*:Deterministic.M3Sparse:Deterministic.Small*:Deterministic.SegmentedLists' \
  > "$OUT/tests-tg.log" 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/tests-tg.log" | head -20
stamp racecheck
timeout 150 compute-sanitizer --tool racecheck ./.gpu/flashmsa_gpu_tests_tg --gtest_filter='Proxy.G8' \
  > "$OUT/racecheck-tg.log" 2>&1
echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|^\[  (PASSED|FAILED)" "$OUT/racecheck-tg.log"
for r in 1; do
  for v in "" _tg; do
    [ $SECONDS -lt 420 ] || { echo "user $v skipped (time)"; continue; }
    d=$OUT/user$v-r$r; mkdir -p $d
    FLASHMSA_LIBRARY=$PWD/.gpu/libflashmsa$v.so PYTHONUNBUFFERED=1 timeout 100 python3 bench/run_bench.py --user-only \
      --out $d --configs m3 --seqlens 32768 --patterns clustered > $d/log.txt 2>&1
    echo "user lib$v round $r rc=$?"; grep -E "^\| m3" $d/*.md || tail -5 $d/log.txt
  done
done
stamp done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
