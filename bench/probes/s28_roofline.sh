#!/usr/bin/env bash
# Session 28, third call: the fused backward kernel's bounds at the free-running clock (ncu --clock-control none,
# SpeedOfLight / memory / compute sections, one launch at m3 32k clustered and random), and the time of zeroing the
# backward's accumulators (1.29 GB at m3 32k: dq, dk, dv, dqp, dkp; bwd.cpp's cudaMemsetAsync), timed in torch.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
for pat in clustered random; do
  timeout 240 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section Occupancy --kernel-name regex:bwd_fused_kernel --launch-skip 1 \
    --launch-count 1 ./.gpu/flashmsa_bench --config m3 --seqlens 32768 --patterns $pat --iters 2 --options 0 \
    > "$OUT/ncu-fused-$pat.txt" 2>&1
  echo "ncu $pat rc=$?"
  grep -E "Duration|SM Frequency|DRAM Throughput|Memory Throughput|Compute \(SM\)|L2 Hit|Mem Busy|Max Bandwidth|Mem Pipes|Executed Ipc A|highest-utilized" "$OUT/ncu-fused-$pat.txt" | head -20
done
python3 - > "$OUT/memset.txt" 2>&1 <<'PY'
import torch
n = int(1.29e9) // 4
x = torch.empty(n, dtype=torch.float32, device="cuda")
for _ in range(3): x.zero_()
ts = []
for _ in range(20):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); x.zero_(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
ts.sort()
print(f"zeroing 1.29 GB: median {ts[10]:.3f} ms, min {ts[0]:.3f}, max {ts[-1]:.3f} ({1.29 / ts[10]:.2f} TB/s)")
PY
cat "$OUT/memset.txt"
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
