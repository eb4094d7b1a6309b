#!/usr/bin/env bash
# One device call (session 26): why the dynamic persistent forward (pf3, bench/probes/fwd-persistent-dynamic.patch)
# is slower than the default at fmsa 16k clustered. ncu --set full of the shared-stream kernel of the default
# (fwd_kernel) and of pf3 (fwd_persistent_kernel) at fmsa 16k clustered, the SASS summaries, and the forward of
# pf3 one CTA per SM against one CTA per tile (FLASHMSA_FWD_PERSISTENT=0) next to the default, two rounds.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PF=pf3 CASES="fmsa 16384" NAME=probe-pf3 OUT=$OUT bash bench/probes/persistent_probe.sh
for pair in "flashmsa_bench fwd_kernel" "flashmsa_bench_pf3 fwd_persistent_kernel"; do
  set -- $pair
  echo "== profile $1 $2 ($(date +%T))"
  mkdir -p "$OUT/$1"
  OUT=$OUT/$1 BENCH=./.gpu/$1 KERNEL=$2 CONFIG=fmsa SEQLEN=16384 bash scripts/gpu_profile.sh 2>&1 | head -60
  rm -f "$OUT/$1/$2.ncu-rep"
done
