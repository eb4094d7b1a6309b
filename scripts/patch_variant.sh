#!/usr/bin/env bash
# A/B binaries from a patch of bench/probes (one that applies to the repository root, tests included): applies
# it to the tree, builds, copies the bench, the GPU tests and the library to .gpu/flashmsa_bench_NAME,
# .gpu/flashmsa_gpu_tests_NAME and .gpu/libflashmsa_NAME.so, reverts the patch and rebuilds (ccache: seconds),
# checking that the default bench is byte-identical to the one before. Then `bash scripts/pack_gpu.sh --from-build`
# packs the default build and every variant of .gpu/ for the device call (carry .gpu_pack).
#   bash scripts/patch_variant.sh pf2 bench/probes/fwd-persistent.patch
set -euo pipefail
cd "$(dirname "$0")/.."
name=$1 patch=$2
build=${FLASHMSA_BUILD_DIR:-build}
git diff --quiet -- src tests include || { echo "patch_variant: src/, tests/ or include/ has uncommitted changes" >&2; exit 2; }
[ -x "$build/flashmsa_bench" ] || { echo "patch_variant: no $build/flashmsa_bench (run scripts/setup.sh first)" >&2; exit 2; }
mkdir -p .gpu
rm -f ".gpu/flashmsa_bench_$name" ".gpu/flashmsa_gpu_tests_$name" ".gpu/libflashmsa_$name.so"  # (an earlier run's)
before=$(mktemp)
cp "$build/flashmsa_bench" "$before"
git apply "$patch"
restore() { git apply -R "$patch" || echo "patch_variant: could not revert $patch: check git status" >&2; }
trap restore EXIT
echo "[patch_variant] building $name ($(date +%T))"
log=$(mktemp)
if ! ninja -C "$build" > "$log" 2>&1; then
  grep -m 20 -E "error|FAILED" "$log" >&2 || true
  echo "patch_variant: $name does not build (no variant copied); rebuilding the default" >&2
  rm -f "$log" "$before"
  trap - EXIT
  restore
  ninja -C "$build" > /dev/null || true  # (outputs that linked before the failure are the variant's)
  exit 1
fi
grep -E "error|warning|spill" "$log" || true
rm -f "$log"
cp "$build/flashmsa_bench" ".gpu/flashmsa_bench_$name"
cp "$build/tests/flashmsa_gpu_tests" ".gpu/flashmsa_gpu_tests_$name"
cp "$build/libflashmsa.so" ".gpu/libflashmsa_$name.so"
trap - EXIT
restore
echo "[patch_variant] rebuilding the default ($(date +%T))"
ninja -C "$build" >/dev/null
cmp -s "$before" "$build/flashmsa_bench" || { echo "patch_variant: the default bench differs after the revert" >&2; exit 1; }
rm -f "$before"
echo "[patch_variant] .gpu/flashmsa_bench_$name, .gpu/flashmsa_gpu_tests_$name, .gpu/libflashmsa_$name.so"
