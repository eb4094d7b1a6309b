#!/usr/bin/env bash
# Nsight Compute on one training step (m3 by default), binaries in .gpu/, logs in $OUT.
#   CONFIG=m3 SEQLEN=32768 PATTERN=clustered bash bench/tools/gpu_profile.sh
#       per-kernel durations (which kernel of the step takes the time)
#   KERNEL=bwd_main_kernel BENCH=.gpu/flashmsa_bench bash bench/tools/gpu_profile.sh
#       one launch of KERNEL with --set full, plus its SASS page summarised by
#       bench/tools/ncu_sass_summary.py (stalls, instruction mix, spills)
set -uo pipefail
OUT=${OUT:-/tmp/out}
BENCH=${BENCH:-./.gpu/flashmsa_bench}
mkdir -p "$OUT"
args=(--config "${CONFIG:-m3}" --seqlens "${SEQLEN:-32768}" --patterns "${PATTERN:-clustered}" --iters 1)
if [ -z "${KERNEL:-}" ]; then
  timeout 500 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
    "$BENCH" "${args[@]}" > "$OUT/ncu_summary.txt" 2>&1
  echo "ncu rc=$?"
  grep -E "^\s+[a-z_]+.*\(|gpu__time_duration|Invocations" "$OUT/ncu_summary.txt" | head -80
else
  # --options 0: the bench skips the deterministic and out_lo runs, so KERNEL (which matches the
  # default and the deterministic instantiations alike) is the default kernel
  timeout 400 ncu --set full --import-source no --kernel-name "$KERNEL" --launch-skip 1 --launch-count 1 \
    -o "$OUT/$KERNEL" "$BENCH" "${args[@]}" --options 0 > "$OUT/ncu_$KERNEL.log" 2>&1
  echo "ncu rc=$?"
  ncu -i "$OUT/$KERNEL.ncu-rep" --page details > "$OUT/${KERNEL}_details.txt" 2>&1
  ncu -i "$OUT/$KERNEL.ncu-rep" --page source --csv --print-source sass > "$OUT/${KERNEL}_sass.csv" 2>&1
  grep -E "Duration|Throughput|Spilling|Issued|Warp Cycles" "$OUT/${KERNEL}_details.txt" | head -20
  python3 bench/tools/ncu_sass_summary.py "$OUT/${KERNEL}_sass.csv" --top 20
fi
