#!/usr/bin/env bash
# A/B builds from a patch: copies src/ to a temporary directory, applies PATCH there (git apply; several
# comma-separated patches apply in order, e.g. two probes combined;
# a timing probe with wrong results, or a candidate kept out of main), and rebuilds the kernel TUs from the
# copy with bench/tools/bench_variant.sh (VARIANT_SRC).
# The tree itself is never touched.
#   bash bench/tools/probe_variant.sh NAME PATCH[,PATCH...] TU[,TU...] [FLAGS...]
#   bash bench/tools/probe_variant.sh nk /tmp/no-kl-walk.patch bwd_fused_bf16
#   -> .gpu/flashmsa_bench_nk (VARIANT_TESTS=1: also .gpu/flashmsa_gpu_tests_nk)
set -euo pipefail
name=$1 patches=$2 tus=$3
shift 3
root=$(cd "$(dirname "$0")/../.." && pwd)
copy=$(mktemp -d)
trap 'rm -rf "$copy"' EXIT
cp -r "$root/src" "$copy/src"
IFS=, read -ra list <<< "$patches"
for patch in "${list[@]}"; do
  patch=$(cd "$(dirname "$patch")" && pwd)/$(basename "$patch")
  (cd "$copy" && git apply "$patch")  # (outside a repository git apply patches the files; fails loudly)
done
VARIANT_SRC="$copy/src" bash "$root/bench/tools/bench_variant.sh" "$name" "$tus" "$@"
