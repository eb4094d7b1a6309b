#!/usr/bin/env bash
# Session 38, call 5: where the dense (warmup) backward's time goes (m3 32k; it runs at the sparse main walk's ~320
# effective TF/s against cuDNN's ~530 on the same dense work). `flashmsa run --mode warmup` (dense fwd + bwd, the kl
# from the backward, so the first fused-kernel launch is the backward's): 1. per-kernel durations; 2. one launch of
# bwd_fused_kernel with --set full, its details and SASS summary (scripts/ncu_sass_summary.py). Logs in one archive.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/l" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
run=(./.gpu/flashmsa run --mode warmup --config m3 --seqlen 32768 --quiet)
stamp summary
timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel "${run[@]}" \
  > "$OUT/l/ncu_summary_warmup.txt" 2>&1
echo "ncu rc=$?"
grep -E "^\s+[a-z_]+.*\(|gpu__time_duration|Invocations" "$OUT/l/ncu_summary_warmup.txt" | head -40
stamp full
K=bwd_fused_kernel
timeout 330 ncu --set full --import-source no --kernel-name regex:$K --launch-skip 0 --launch-count 1 \
  -o "$OUT/l/$K" "${run[@]}" > "$OUT/l/ncu_$K.log" 2>&1
echo "ncu rc=$?"; tail -3 "$OUT/l/ncu_$K.log"
ncu -i "$OUT/l/$K.ncu-rep" --page details > "$OUT/l/${K}_details.txt" 2>&1
ncu -i "$OUT/l/$K.ncu-rep" --page source --csv --print-source sass > "$OUT/l/${K}_sass.csv" 2>&1
grep -E "Duration|Throughput|Hit Rate|Spilling|Issued|Warp Cycles|Registers|Achieved Occ" "$OUT/l/${K}_details.txt" | head -30
python3 scripts/ncu_sass_summary.py "$OUT/l/${K}_sass.csv" --top 15 2>&1 | head -60
rm -f "$OUT/l/$K.ncu-rep" "$OUT/l/${K}_sass.csv"
stamp done
tar -czf "$OUT/s38-call5.tgz" -C "$OUT" l && rm -rf "$OUT/l"
