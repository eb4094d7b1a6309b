#!/usr/bin/env bash
# Per-kernel durations of one training step (m3 by default) with Nsight Compute: which kernel of
# the backward (preprocess, inversion sort, main, proxy, convert) takes the time.
#   CONFIG=m3 SEQLEN=32768 bash scripts/gpu_profile.sh      (binaries in .gpu/, logs in $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 500 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
  ./.gpu/flashmsa_bench --config "${CONFIG:-m3}" --seqlens "${SEQLEN:-32768}" --patterns clustered --iters 1 \
  > "$OUT/ncu_summary.txt" 2>&1
echo "ncu rc=$?"
grep -E "^\s+[a-z_]+.*\(|gpu__time_duration|Invocations" "$OUT/ncu_summary.txt" | head -80
