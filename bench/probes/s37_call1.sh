#!/usr/bin/env bash
# Session 37, call 1: the main attention's backward alone through the library (no proxy side: the path a frozen
# indexer's step now takes from Python) next to the default backward, in one bench process per case (the bench's new
# bwd_main_ms), and session 36's fused main-walk-only probe (flashmsa_bench_mainonly, wrong results) beside it; the
# Python tests on the GPU build (the frozen-proxy routing and the CUDA ones); the README call with its new
# frozen-proxy columns.
# Pack: the tree's build (bash scripts/pack_gpu.sh --from-build) plus session 36's flashmsa_bench_mainonly.
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
OUT0=$OUT; OUT=$R
line() { python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print(sys.argv[2], 'bwd', r['bwd_ms'], r['bwd_tflops'], 'main', r.get('bwd_main_ms'), r.get('bwd_main_tflops'), 'step', r['step_ms'])" "$1" "$2" 2>&1 | tail -1; }
stamp bench
for round in 1 2; do
  for args in "--config m3 --seqlens 32768 --patterns clustered --iters 20" "--config m3 --seqlens 32768 --patterns random --iters 20" \
              "--config fmsa --seqlens 16384 --patterns clustered --iters 100"; do
    for b in flashmsa_bench flashmsa_bench_mainonly; do
      tag=$b-$(echo "$args" | awk '{print $2"-"$4"-"$6}')-r$round
      timeout 90 ./.gpu/$b $args --options 0 > "$OUT/bench-$tag.json" 2>&1; line "$OUT/bench-$tag.json" "$tag"
    done
  done
done
stamp 128k
for b in flashmsa_bench flashmsa_bench_mainonly; do
  tag=$b-m3-131072-clustered
  timeout 150 ./.gpu/$b --config m3 --seqlens 131072 --patterns clustered --iters 10 --options 0 > "$OUT/bench-$tag.json" 2>&1
  line "$OUT/bench-$tag.json" "$tag"
done
stamp pytest
FLASHMSA_BUILD_DIR=.gpu timeout 240 python3 -m pytest -q tests/python/test_torch_cuda.py tests/python/test_abi.py \
  tests/python/test_torch_compile.py > "$OUT/pytest-cuda-abi-compile.log" 2>&1
echo "pytest rc=$?"; tail -4 "$OUT/pytest-cuda-abi-compile.log"
stamp user
d=$OUT/user; mkdir -p "$d"
FLASHMSA_BUILD_DIR=.gpu PYTHONUNBUFFERED=1 timeout 150 python3 bench/run_bench.py --user-only --out "$d" --configs m3 \
  --seqlens 32768 --patterns clustered > "$d/log.txt" 2>&1
echo "user rc=$?"; grep -E "^\| m3" "$d"/*.md || tail -5 "$d/log.txt"
OUT=$OUT0
stamp done
tar -czf "$OUT/s37-call1.tgz" -C "$R" . && rm -rf "$R"
