#!/usr/bin/env bash
# Session 39, call 4: the ~1.0 ms between bstl2 and nbulk (call 3) - the hand-off or the bytes? early: the writer hands
# the dQ tile back without waiting for the engine's read (bench/probes/bwd-dq-early-handback-s39.patch); npub: the
# store-first writer publishes its first stores without waiting for their completion
# (bench/probes/bwd-dq-publish-nowait-s39.patch); both timing only (wrong dq). Built with scripts/probe_variant.sh
# (TU bwd_fused_bf16), packed by scripts/pack_gpu.sh.
OUT=${OUT:-/tmp/out}; mkdir -p .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
FINAL=$OUT; OUT=$OUT/l; mkdir -p "$OUT"
source bench/probes/callkit.sh
stamp ab
for args in "--config m3 --seqlens 32768 --patterns clustered --iters 20" "--config fmsa --seqlens 16384 --patterns clustered --iters 100"; do
  bench_bins "$args" 2 400 flashmsa_bench flashmsa_bench_early flashmsa_bench_npub flashmsa_bench_nbulk
done
stamp done
tar -czf "$FINAL/s39-call4.tgz" -C "$FINAL" l && rm -rf "$FINAL/l"
