#!/usr/bin/env bash
# Session 36, call 4: the main attention's backward alone, priced by timing probes (wrong results): nokl
# (bench/probes/no-kl-walk.patch: no kl walk, the teacher rows still stored) and mainonly
# (bench/probes/bwd-main-walk-only-probe.patch: no kl walk and no teacher stores), alternated with the default: m3 32k
# clustered and random (two rounds), m3 128k clustered (one round). Pack: the tree's build plus the probe binaries.
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
OUT0=$OUT; OUT=$R
V="def:flashmsa_bench: nokl:flashmsa_bench_nokl: mainonly:flashmsa_bench_mainonly:"
stamp 32k
bench_variants "--config m3 --seqlens 32768 --patterns clustered --iters 20" 2 $V
bench_variants "--config m3 --seqlens 32768 --patterns random --iters 20" 2 $V
stamp 128k
bench_variants "--config m3 --seqlens 131072 --patterns clustered --iters 10" 1 $V
OUT=$OUT0
stamp done
tar -czf "$OUT/s36-call4.tgz" -C "$R" . && rm -rf "$R"
