#!/usr/bin/env bash
# Session 38, call 6: the SPARSE backward's fused kernel (m3 32k clustered, `flashmsa run --mode train`: the kl comes
# from the backward, so the first fused-kernel launch is the backward's) with --set full, as call 5 profiled the dense
# one: the two walks at the same ~320-350 effective TF/s, the dense at 37% of DRAM. Logs in one archive.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/l" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
run=(./.gpu/flashmsa run --mode train --config m3 --seqlen 32768 --pattern clustered --quiet)
K=bwd_fused_kernel
stamp full
timeout 200 ncu --set full --import-source no --kernel-name regex:$K --launch-skip 0 --launch-count 1 \
  -o "$OUT/l/$K" "${run[@]}" > "$OUT/l/ncu_$K.log" 2>&1
echo "ncu rc=$?"; tail -2 "$OUT/l/ncu_$K.log"
ncu -i "$OUT/l/$K.ncu-rep" --page details > "$OUT/l/${K}_details.txt" 2>&1
ncu -i "$OUT/l/$K.ncu-rep" --page source --csv --print-source sass > "$OUT/l/${K}_sass.csv" 2>&1
grep -E "Duration|Throughput|Hit Rate|Spilling|Issued|Warp Cycles|highest-utilized|Eligible|No Eligible" "$OUT/l/${K}_details.txt" | head -30
python3 scripts/ncu_sass_summary.py "$OUT/l/${K}_sass.csv" --top 12 > "$OUT/l/${K}_sass_summary.txt" 2>&1
grep -A40 "opcode" "$OUT/l/${K}_sass_summary.txt" | head -40
rm -f "$OUT/l/$K.ncu-rep"
gzip "$OUT/l/${K}_sass.csv"
stamp done
tar -czf "$OUT/s38-call6.tgz" -C "$OUT" l && rm -rf "$OUT/l"
