#!/usr/bin/env bash
# Session 27: the SM clock and power during the bench's phases at m3 32k clustered (is the backward power-bound?).
# nvidia-smi samples every 20 ms beside one bench run with 50 iterations per timing (each phase 0.1-2 s long).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
[ -x .gpu/flashmsa_bench ] || tar -xJf .gpu_pack/bins.tar.xz -C .gpu
nvidia-smi -q -d POWER,CLOCK,PERFORMANCE > "$OUT/smi-q.txt" 2>&1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv,noheader -lms 20 > "$OUT/clocks.csv" 2>&1 &
smi=$!
sleep 1
date +%T.%N > "$OUT/bench-times.txt"
./.gpu/flashmsa_bench --config m3 --seqlens 32768 --patterns clustered --iters 50 --options 0 > "$OUT/bench.txt" 2>&1
date +%T.%N >> "$OUT/bench-times.txt"
sleep 1
kill $smi
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
