#!/usr/bin/env bash
# Session 40, call 2: m3 128k clustered again, two rounds of 8 iterations (call 1's main-only sample at 128k was an
# outlier). carry [".gpu_pack"].
OUT=${OUT:-/tmp/out}
source bench/probes/callkit.sh
call_open
BENCH_TIMEOUT=120 bench_bins "--config m3 --seqlens 131072 --patterns clustered --iters 8" 2 400 flashmsa_bench
call_close s40-call2
