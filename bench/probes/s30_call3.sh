#!/usr/bin/env bash
# Session 30, call 3: the kl segment rule on the default build (a quarter of the dq accumulator, 1024..4096 entries;
# 3968 at m3 32k on 132 SMs): its GPU tests, the A/B against the former default (FLASHMSA_KL_SEGMENT=1024, the same
# binary, alternated, two rounds), the user's path with each, then an ncu profile of the fused kernel (m3 32k
# clustered) for the kl walk's and the segment boundaries' stall samples, if time is left.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp tests
timeout 100 ./.gpu/flashmsa_gpu_tests --gtest_filter='Workspace.KlSegmentRule:Errors.BadSegmentKnob:Proxy.LongSegment' \
  > "$OUT/tests-default.log" 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]|OK \]" "$OUT/tests-default.log" | head -12
stamp ab
for args in "--config m3 --seqlens 32768 --patterns clustered --iters 30" "--config m3 --seqlens 32768 --patterns random --iters 30"; do
  for round in 1 2; do
    for seg in rule 1024; do
      tag=seg$seg-$(echo "$args" | awk '{print $2"-"$4"-"$6}')-r$round
      if [ $seg = rule ]; then ./.gpu/flashmsa_bench $args --options 0 > "$OUT/bench-$tag.json" 2>&1
      else FLASHMSA_KL_SEGMENT=$seg ./.gpu/flashmsa_bench $args --options 0 > "$OUT/bench-$tag.json" 2>&1; fi
      echo "$tag $(python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print('bwd', r['bwd_ms'], 'step', r['step_ms'])" "$OUT/bench-$tag.json" 2>&1 | tail -1)"
    done
  done
done
stamp user
for r in 1 2; do
  for seg in rule 1024; do
    d=$OUT/user-seg$seg-r$r; mkdir -p "$d"
    if [ $seg = rule ]; then unset FLASHMSA_KL_SEGMENT; else export FLASHMSA_KL_SEGMENT=$seg; fi
    FLASHMSA_LIBRARY=$PWD/.gpu/libflashmsa.so PYTHONUNBUFFERED=1 timeout 90 python3 bench/run_bench.py \
      --user-only --out "$d" --configs m3 --seqlens 32768 --patterns clustered > "$d/log.txt" 2>&1
    echo "user seg$seg round $r rc=$?"; grep -E "^\| m3" "$d"/*.md || tail -5 "$d/log.txt"
  done
done
unset FLASHMSA_KL_SEGMENT
stamp ncu
if [ $SECONDS -lt 380 ]; then
  timeout $((560 - SECONDS)) ncu --set full --import-source no --kernel-name regex:bwd_fused_kernel --launch-skip 1 --launch-count 1 \
    -o "$OUT/fused" ./.gpu/flashmsa_bench --config m3 --seqlens 32768 --patterns clustered --iters 1 --options 0 > "$OUT/ncu.log" 2>&1
  echo "ncu rc=$?"
  if [ -f "$OUT/fused.ncu-rep" ]; then
    ncu -i "$OUT/fused.ncu-rep" --page details > "$OUT/fused_details.txt" 2>&1
    ncu -i "$OUT/fused.ncu-rep" --page source --csv --print-source sass > "$OUT/fused_sass.csv" 2>&1
    rm -f "$OUT/fused.ncu-rep"
    grep -E "Duration|Throughput|Issued" "$OUT/fused_details.txt" | head -8
  fi
else echo "ncu skipped (time)"; fi
stamp done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
