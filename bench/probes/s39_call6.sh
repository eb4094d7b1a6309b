#!/usr/bin/env bash
# Session 39, call 6: the price of a segment boundary in the fused backward (the main walk's dK/dV flush, the kl
# walk's fill and dKp flush, the main walk's refill), which a token-window schedule would pay once per item:
# FLASHMSA_KL_SEGMENT at the default (m3 32k: 3968 entries, about one segment per item), 1024, 512 and 256,
# alternated, two rounds; then fmsa 16k (default 1024) at 512 and 256.
OUT=${OUT:-/tmp/out}
source bench/probes/callkit.sh
call_open
stamp seg
bench_knob "--config m3 --seqlens 32768 --patterns clustered --iters 20" 2 FLASHMSA_KL_SEGMENT 3968 1024 512 256
bench_knob "--config fmsa --seqlens 16384 --patterns clustered --iters 100" 1 FLASHMSA_KL_SEGMENT 1024 512 256
stamp done
call_close s39-call6
