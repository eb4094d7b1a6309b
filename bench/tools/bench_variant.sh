#!/usr/bin/env bash
# A/B measurement helper: rebuilds one kernel translation unit with extra compile flags and links
# a second benchmark binary against it, next to the normal one (the rest of the library is
# shared). Carry .gpu/ to the GPU machine and run both binaries in the same call.
#   bash bench/tools/bench_variant.sh NAME TU[,TU...] FLAGS...
#   bash bench/tools/bench_variant.sh pr56 bwd_fused_bf16 -DFLASHMSA_EXAMPLE_FLAG=1
#   -> .gpu/flashmsa_bench_pr56 (and the ptxas register/spill line of the variant); run it with
#      --options 0 when the variant refuses the deterministic mode. With VARIANT_TESTS=1 also
#      .gpu/flashmsa_gpu_tests_pr56 (the GPU suite against the variant). VARIANT_SRC=DIR compiles
#      the TUs from DIR (a patched copy of src/, e.g. a timing probe that is never committed)
#      instead of src/; FLAGS may then be empty
set -euo pipefail
name=$1 tus=$2  # one TU, or several separated by commas
shift 2
build=${FLASHMSA_BUILD_DIR:-build}
work=$(mktemp -d)
src=$(cd "$(dirname "$0")/../../src" && pwd)
cd "$build"
cp libflashmsa_static.a "$work/lib.a"
for tu in ${tus//,/ }; do
  cmd=$(ninja -t commands | grep -F "/$tu.cu.o" | grep nvcc | head -1)
  [ -n "$cmd" ] || { echo "no nvcc command for $tu in $build" >&2; exit 2; }
  cmd=$(echo "$cmd" | sed -E "s#^/usr/bin/ccache ##; s# -o [^ ]+\.o# -o $work/$tu.cu.o#; s#-MD -MT [^ ]+ -MF [^ ]+##")
  if [ -n "${VARIANT_SRC:-}" ]; then cmd=${cmd//$src/$VARIANT_SRC}; fi
  echo "$tu:"
  eval "$cmd $* -Xptxas -v" 2>&1 | grep -E "spill|error|C751" || true  # C7514, C7515: serialised wgmma; C7517: an injected wait
  (cd "$work" && ar r lib.a "$tu.cu.o")
done
mkdir -p ../.gpu
link=$(ninja -t commands flashmsa_bench | tail -1 | sed "s#-o flashmsa_bench#-o ../.gpu/flashmsa_bench_$name#; s#libflashmsa_static.a#$work/lib.a#")
eval "$link"
if [ "${VARIANT_TESTS:-0}" = 1 ]; then
  link=$(ninja -t commands tests/flashmsa_gpu_tests | tail -1 |
         sed "s#-o tests/flashmsa_gpu_tests#-o ../.gpu/flashmsa_gpu_tests_$name#; s#libflashmsa_static.a#$work/lib.a#")
  eval "$link"
  echo "built .gpu/flashmsa_gpu_tests_$name"
fi
rm -rf "$work"
echo "built .gpu/flashmsa_bench_$name"
