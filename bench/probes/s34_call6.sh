#!/usr/bin/env bash
# Session 34, sixth call: timing probes (wrong kl gradients; not candidates) that bound the kl walk's teacher round trip
# (bwd.md "Session 34", Next (1)): ntt (bench/probes/bwd-no-teacher-traffic.patch: the main walk stores no teacher
# rows and the kl walk reads none, zero-filling its stage instead), ntr (bwd-no-teacher-reads.patch: only the reads
# gone). Alternated with the default, two rounds, m3 32k clustered. Logs: one archive in $OUT.
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
OUT0=$OUT; OUT=$R
bench_variants "--config m3 --seqlens 32768 --patterns clustered --iters 20" 2 def:flashmsa_bench: ntt:flashmsa_bench_ntt: ntr:flashmsa_bench_ntr:
OUT=$OUT0
tar -czf "$OUT/s34-call6.tgz" -C "$R" . && rm -rf "$R"
