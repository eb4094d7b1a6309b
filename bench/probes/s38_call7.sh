#!/usr/bin/env bash
# Session 38, call 7: session 20's no-dQ-hand-off probe re-based on today's kernel (bench/probes/bwd-no-dq-handoff-s38.patch,
# `bash scripts/probe_variant.sh ndq bench/probes/bwd-no-dq-handoff-s38.patch bwd_fused_bf16`: no dQ tile, no writer,
# the dQ GEMM kept; wrong dq, timing only), alternated with the default, m3 32k clustered, then fmsa 16k while time is left.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp ab
for args in "--config m3 --seqlens 32768 --patterns clustered --iters 20" "--config fmsa --seqlens 16384 --patterns clustered --iters 100"; do
  for round in 1 2; do
    for b in flashmsa_bench flashmsa_bench_ndq; do
      [ $SECONDS -lt 130 ] || { echo "skipped (time)"; continue; }
      tag=$b-$(echo "$args" | awk '{print $2"-"$4}')-r$round
      timeout 40 ./.gpu/$b $args --options 0 > "$OUT/bench-$tag.json" 2>&1
      bench_line "$OUT/bench-$tag.json" "$tag"
    done
  done
done
stamp done
