#!/usr/bin/env bash
# Packs the binaries of .gpu/ (the default build's, copied from build/, and any A/B variants of
# bench/tools/bench_variant.sh) into .gpu_pack/bins.tar.xz: the device tool carries at most 64 MiB and
# each binary is ~12 MB, while the archive of five is ~7 MB. On the GPU machine
# scripts/gpu_all.sh unpacks it into .gpu/ before anything runs; carry [".gpu_pack"].
#   bash scripts/pack_gpu.sh                 # .gpu/ as it is
#   bash scripts/pack_gpu.sh --from-build    # first copy build/'s bench, tests, CLI and library into .gpu/
set -euo pipefail
cd "$(dirname "$0")/.."
build=${FLASHMSA_BUILD_DIR:-build}
if [ "${1:-}" = --from-build ]; then
  mkdir -p .gpu
  cp "$build/flashmsa_bench" "$build/tests/flashmsa_gpu_tests" "$build/flashmsa" "$build/libflashmsa.so" .gpu/
  [ -f "$build/flashmsa_wgmma_probe" ] && cp "$build/flashmsa_wgmma_probe" .gpu/
fi
files=$(cd .gpu && find . -maxdepth 1 -type f ! -name '*.tar.xz' -printf '%f\n' | sort)
[ -n "$files" ] || { echo "nothing in .gpu/ to pack" >&2; exit 2; }
mkdir -p .gpu_pack
# shellcheck disable=SC2086
tar -cJf .gpu_pack/bins.tar.xz -C .gpu $files
echo "packed into .gpu_pack/bins.tar.xz ($(du -h .gpu_pack/bins.tar.xz | cut -f1)):" $files
