#!/usr/bin/env bash
# Session 27: nvidia-smi beside cuDNN's dense m3 32k step (bench/probes/cudnn_clock.py) and beside flashmsa's bench,
# to compare the two under the 700 W cap.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
[ -x .gpu/flashmsa_bench ] || tar -xJf .gpu_pack/bins.tar.xz -C .gpu
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader -lms 20 \
  > "$OUT/clocks-cudnn.csv" 2>&1 &
smi=$!
python3 bench/probes/cudnn_clock.py > "$OUT/cudnn.txt" 2>&1
kill $smi; wait $smi 2>/dev/null
cat "$OUT/cudnn.txt"
python3 bench/probes/clock_phases.py "$OUT/clocks-cudnn.csv"
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
