#!/usr/bin/env bash
# Session 37, call 4: where the dense (warmup) backward's time goes (call 3: m3 32k 304 ms, 144 effective TF/s, against
# cuDNN's dense backward of ~82 ms): ncu's duration of the recomputing proxy kernel (the only kernel of DENSE mode's
# proxy side; the rest of the dense backward is the main walk, the preprocess, the convert and the proxy lse).
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp ncu
timeout 400 ncu --clock-control none --metrics gpu__time_duration.sum --kernel-name regex:'bwd_proxy_kernel|select_kernel' \
  --print-summary per-kernel ./.gpu/flashmsa_bench --config m3 --seqlens 32768 --patterns clustered --iters 1 --options 0 \
  > "$R/ncu-proxy-kernel-m3-32k.txt" 2>&1
echo "ncu rc=$?"; grep -E "bwd_proxy_kernel|select_kernel|gpu__time_duration|Invocations|^\{" "$R/ncu-proxy-kernel-m3-32k.txt" | cut -c1-220 | head -30
stamp done
tar -czf "$OUT/s37-call4.tgz" -C "$R" . && rm -rf "$R"
