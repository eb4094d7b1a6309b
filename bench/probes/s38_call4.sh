#!/usr/bin/env bash
# Session 38, call 4, on the session's final build (the forward's dense kl and the deterministic DENSE backward in the
# fused kernel): the Python tests on the GPU, then the README call (bench/run_bench.py --user-only, with its new
# warmup-step column) at m3 32k and fmsa 16k clustered, cuDNN beside it. Everything under $OUT in one archive.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/l" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp pytest
FLASHMSA_BUILD_DIR=.gpu timeout 240 python3 -m pytest -q tests/python/test_torch_cuda.py tests/python/test_abi.py \
  tests/python/test_torch_compile.py > "$OUT/l/pytest-gpu.log" 2>&1
echo "pytest rc=$?"; tail -2 "$OUT/l/pytest-gpu.log"
stamp user
for c in "m3 32768" "fmsa 16384"; do
  set -- $c
  [ $SECONDS -lt 480 ] || { echo "user $1 skipped (time)"; continue; }
  d=$OUT/l/user-$1; mkdir -p "$d"
  FLASHMSA_LIBRARY=$PWD/.gpu/libflashmsa.so PYTHONUNBUFFERED=1 timeout 120 python3 bench/run_bench.py --user-only \
    --out "$d" --configs $1 --seqlens $2 --patterns clustered > "$d/log.txt" 2>&1
  echo "user $1 rc=$?"; grep -E "^\| $1" "$d"/*.md || tail -5 "$d/log.txt"
done
stamp done
tar -czf "$OUT/s38-call4.tgz" -C "$OUT" l && rm -rf "$OUT/l"
