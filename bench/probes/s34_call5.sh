#!/usr/bin/env bash
# Session 34, fifth call: where the fused backward's DRAM bytes come from, by L2 operation (loads: the gathers, Qp and
# teacher rows; stores: teacher rows, first dq stores; reductions: dq, dQp, dK, dV adds), on the shipped kernels at m3
# 32k clustered (ncu, free-running clock, one launch). Session 22's accounting (bwd.md) predates the store-first dQ and
# the long kl segments; call 3 measured 31.1 GB read and 16.8 GB written, more writes than the dq lines' write-backs
# explain. Logs: one archive in $OUT.
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
B="./.gpu/flashmsa_bench --config m3 --seqlens 32768 --patterns clustered --iters 2 --options 0"
ncu --query-metrics 2>/dev/null | grep -E "^lts__t_(sectors|requests)_(srcunit_tex_)?op_|^lts__t_sectors_(srcunit|aperture)|^dram__" > "$R/metrics.txt"
echo "metrics listed: $(wc -l < "$R/metrics.txt")"
timeout 120 ncu --clock-control none --section MemoryWorkloadAnalysis_Tables --print-details all \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum --kernel-name regex:bwd_fused_kernel --launch-skip 1 \
  --launch-count 1 $B > "$R/ncu-tables.txt" 2>&1
echo "tables rc=$?"; grep -iE "L2|dram__|Load|Store|Reduction|Atomic" "$R/ncu-tables.txt" | head -40
M=$(grep -oE "^lts__t_sectors_op_(read|write|red|atom)(_lookup_(hit|miss))?" "$R/metrics.txt" | sort -u | sed 's/$/.sum/' | paste -sd,)
echo "metrics: $M"
[ -n "$M" ] && timeout 100 ncu --clock-control none --metrics "$M" --kernel-name regex:bwd_fused_kernel --launch-skip 1 \
  --launch-count 1 $B > "$R/ncu-ops.txt" 2>&1
echo "ops rc=$?"; grep -E "lts__" "$R/ncu-ops.txt" | head -20
tar -czf "$OUT/s34-call5.tgz" -C "$R" . && rm -rf "$R"
