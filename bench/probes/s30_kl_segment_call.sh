#!/usr/bin/env bash
# Session 30, call 1: the fused backward's kl segment (FLASHMSA_KL_SEGMENT, a run-time knob: list entries per
# main-walk / kl-walk alternation, the teacher scratch CTAs x seg x 512 B) at 1024 (the default), 2048 and 4096,
# alternated by round on the default binary; then the user's path (the README call) at m3 32k clustered with each.
# Each segment boundary drains both walks' pipelines, flushes dK/dV (or dKp) and reloads K/V (or Kp): the sweep
# prices that per boundary (docs/kernels/bwd.md "Session 30").
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp ab
for args in "--config m3 --seqlens 32768 --patterns clustered --iters 30" "--config m3 --seqlens 32768 --patterns random --iters 30" "--config fmsa --seqlens 16384 --patterns clustered --iters 100"; do
  for round in 1 2; do
    for seg in 1024 2048 4096; do
      tag=seg$seg-$(echo "$args" | awk '{print $2"-"$4"-"$6}')-r$round
      FLASHMSA_KL_SEGMENT=$seg ./.gpu/flashmsa_bench $args --options 0 > "$OUT/bench-$tag.json" 2>&1
      echo "$tag $(python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print('bwd', r['bwd_ms'], 'step', r['step_ms'], 'gb', r.get('step_gb'))" "$OUT/bench-$tag.json" 2>&1 | tail -1)"
    done
  done
done
stamp user
for r in 1 2; do
  for seg in 1024 4096; do
    [ $SECONDS -lt 500 ] || { echo "user seg$seg skipped (time)"; continue; }
    d=$OUT/user-seg$seg-r$r; mkdir -p "$d"
    FLASHMSA_KL_SEGMENT=$seg FLASHMSA_LIBRARY=$PWD/.gpu/libflashmsa.so PYTHONUNBUFFERED=1 timeout 90 python3 bench/run_bench.py \
      --user-only --out "$d" --configs m3 --seqlens 32768 --patterns clustered > "$d/log.txt" 2>&1
    echo "user seg$seg round $r rc=$?"; grep -E "^\| m3" "$d"/*.md || tail -5 "$d/log.txt"
  done
done
stamp done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
