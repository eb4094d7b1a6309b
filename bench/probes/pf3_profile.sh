#!/usr/bin/env bash
# One device call (session 26): why the dynamic persistent forward (pf3, bench/probes/fwd-persistent-dynamic.patch)
# is slower than the default at fmsa 16k clustered. ncu --set full of the shared-stream kernel of the default
# (fwd_kernel) and of pf3 (fwd_persistent_kernel) at fmsa 16k clustered, the SASS summaries, and the forward of
# pf3 one CTA per SM against one CTA per tile (FLASHMSA_FWD_PERSISTENT=0) next to the default, two rounds.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p .gpu && tar -xJf .gpu_pack/bins.tar.xz -C .gpu
for r in 1 2; do
  for mode in base pf1 pf0; do
    b=flashmsa_bench; [ $mode != base ] && b=flashmsa_bench_pf3
    FLASHMSA_FWD_PERSISTENT=$([ $mode = pf0 ] && echo 0 || echo 1) timeout 60 ./.gpu/$b --config fmsa --seqlens 16384 \
      --patterns clustered --options 0 2>/dev/null | grep '^{' | sed "s/^{/{\"mode\": \"$mode\", \"round\": $r, /" >> $OUT/probe-pf3.jsonl
  done
done
python3 -c "
import json,collections
d=collections.defaultdict(list)
for l in open('$OUT/probe-pf3.jsonl'):
    j=json.loads(l); d[(j['config'],j['seqlen'],j['mode'])].append(j['fwd_train_ms'])
for k in sorted(d): print(k, 'fwd_train_ms', [round(x,4) for x in d[k]])
" | tee $OUT/probe-pf3.txt
for pair in "flashmsa_bench fwd_kernel" "flashmsa_bench_pf3 fwd_persistent_kernel"; do
  set -- $pair
  echo "== profile $1 $2 ($(date +%T))"
  mkdir -p "$OUT/$1"
  OUT=$OUT/$1 BENCH=./.gpu/$1 KERNEL=$2 CONFIG=fmsa SEQLEN=16384 bash scripts/gpu_profile.sh 2>&1 | head -60
  rm -f "$OUT/$1/$2.ncu-rep"
done
