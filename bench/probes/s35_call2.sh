#!/usr/bin/env bash
# Prepared in session 34 (after s35_first_call.sh, same pack): tf16 (the fp16 teacher) against the default, alternated:
# the three standard cases (two rounds), m3 128k (one round), then the README call once per library. Logs: one archive.
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
OUT0=$OUT; OUT=$R
stamp ab
bench_three 2 def:flashmsa_bench: tf16:flashmsa_bench_tf16:
stamp 128k
bench_variants "--config m3 --seqlens 131072 --patterns clustered --iters 10" 1 def:flashmsa_bench: tf16:flashmsa_bench_tf16:
stamp user
user_ab 1 $((SECONDS + 200)) "" _tf16
OUT=$OUT0
stamp done
tar -czf "$OUT/s35-call2.tgz" -C "$R" . && rm -rf "$R"
