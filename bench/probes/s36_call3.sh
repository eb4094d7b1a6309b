#!/usr/bin/env bash
# Session 36, call 3: (1) the 55 GPU tests that call 1 (bench/probes/s36_first_call.sh) did not reach, on the tree's
# build (d746a84's kernels, session 35's final state), one process, cut at 400 s; (2) a timing probe that prices the
# proxy gradient's "light kl walk" (bench/probes/bwd-light-kl-walk-probe.patch, lightkl: the kl walk keeps its gathers
# and the dKp GEMM only: no z GEMM, no element loop, no dz^T stage, no dQp GEMM and no dQp tiles; wrong results) and
# the walk removed (bench/probes/no-kl-walk.patch, nokl, when it applies), alternated with the default, two rounds, m3
# 32k clustered. Pack: the tree's build plus the probe binaries.
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp rest
gtest_run gpu-suite-rest-s36.log 400 flashmsa_gpu_tests "$(cat bench/probes/s36_rest_filter.txt)"
echo "last test started: $(grep '^\[ RUN' "$OUT/gpu-suite-rest-s36.log" | tail -1)"
OUT0=$OUT; OUT=$R
stamp probes
V="def:flashmsa_bench: lightkl:flashmsa_bench_lightkl:"
[ -x .gpu/flashmsa_bench_nokl ] && V="$V nokl:flashmsa_bench_nokl:"
bench_variants "--config m3 --seqlens 32768 --patterns clustered --iters 20" 2 $V
OUT=$OUT0
stamp done
tar -czf "$OUT/s36-call3.tgz" -C "$R" . && rm -rf "$R"
