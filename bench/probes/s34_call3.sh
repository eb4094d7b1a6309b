#!/usr/bin/env bash
# Session 34, third call: the gathered Q / dO rows marked L2 evict-first (gef: bench/probes/bwd-gathers-l2-evict-first.patch),
# and with the dq accumulator's adds and first stores marked evict-last as well (gefdl: bwd-gathers-ef-dq-el.patch).
# Session 22's profile: the gathers hit the L2 10% of the time, the dq reductions 58%, and the dirty dq lines' reads
# and write-backs are a third of the fused kernel's DRAM bytes; with the streaming gathers first out, the dq lines stay
# longer. Built by `bash scripts/patch_variant.sh gef ...` / `gefdl ...`, packed with `bash scripts/pack_gpu.sh
# --from-build`. Tests (small cases: the hints change no value), the A/B, and ncu's memory tables of the fused kernel
# (free-running clock, one launch at m3 32k clustered) for the default and gefdl. Logs: one archive in $OUT.
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp tests
F='Bwd.SmallSparse:Bwd.FmsaVarlenOddLengthsPoisonedWorkspace:Proxy.SmallSparse:Proxy.DqStoreFirstM3:Kl.SmallSparseG1'
for v in gef gefdl; do
  timeout 100 ./.gpu/flashmsa_gpu_tests_$v --gtest_filter="$F" > "$R/$v-tests.log" 2>&1
  echo "$v rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$R/$v-tests.log" | tr '\n' ' ')"; grep "FAILED  \]" "$R/$v-tests.log" | head -5
done
stamp ab
OUT0=$OUT; OUT=$R
bench_three 2 def:flashmsa_bench: gef:flashmsa_bench_gef: gefdl:flashmsa_bench_gefdl:
OUT=$OUT0
stamp ncu
for v in "" _gefdl; do
  timeout 150 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
    --kernel-name regex:bwd_fused_kernel --launch-skip 1 --launch-count 1 \
    ./.gpu/flashmsa_bench$v --config m3 --seqlens 32768 --patterns clustered --iters 2 --options 0 > "$R/ncu$v.txt" 2>&1
  echo "ncu$v rc=$?"; grep -E "Duration|DRAM Throughput|dram__bytes|lts__t_sector_hit" "$R/ncu$v.txt" | head -6
done
stamp done
tar -czf "$OUT/s34-call3.tgz" -C "$R" . && rm -rf "$R"
