#!/usr/bin/env bash
# Session 39, call 5: the DRAM bytes and L2 reductions of the fused backward (one launch, m3 32k clustered, ncu at the
# free-running clock) on the default and on calls 2-3's timing probes: dql2 (bulk operations L2-resident), bstl2 (and
# stores), bhalf (half the bytes), nbulk (none). Logs in one archive.
OUT=${OUT:-/tmp/out}
source bench/probes/callkit.sh
call_open
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_red.sum,lts__t_sectors_op_red_lookup_hit.sum,lts__t_sectors_op_write.sum
for b in flashmsa_bench flashmsa_bench_dql2 flashmsa_bench_bstl2 flashmsa_bench_bhalf flashmsa_bench_nbulk; do
  stamp "$b"
  timeout 100 ncu --clock-control none --metrics "$M" --kernel-name regex:bwd_fused_kernel --launch-skip 1 \
    --launch-count 1 ./.gpu/$b --config m3 --seqlens 32768 --patterns clustered --iters 2 --options 0 > "$OUT/ncu-$b.txt" 2>&1
  echo "rc=$?"; grep -E "gpu__time|dram__|lts__" "$OUT/ncu-$b.txt"
done
stamp done
call_close s39-call5
