#!/usr/bin/env bash
# One device call's probe of bench/probes/fwd-persistent.patch (built as .gpu/flashmsa_bench_pf, packed into .gpu_pack):
# the forward at fmsa 16k/32k and m3 32k clustered, two rounds, of the default, of pf one CTA per SM
# (FLASHMSA_FWD_PERSISTENT=1) and of pf one CTA per tile (=0): the same kernel without the overlap of a tile's build
# with the previous tile, which separates the builders' latency from their throughput. Rows in $OUT/probe-pf.jsonl.
# Another variant and cases: PF=pf3 CASES="fmsa 16384" NAME=probe-pf3 (bench/probes/pf3_profile.sh).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PF=${PF:-pf} NAME=${NAME:-probe-pf}
mkdir -p .gpu && tar -xJf .gpu_pack/bins.tar.xz -C .gpu
IFS=';' read -ra cases <<< "${CASES:-fmsa 16384,32768;m3 32768}"
for r in 1 2; do
  for cfg in "${cases[@]}"; do
    set -- $cfg
    for mode in base pf1 pf0; do
      b=flashmsa_bench; [ $mode != base ] && b=flashmsa_bench_$PF
      FLASHMSA_FWD_PERSISTENT=$([ $mode = pf0 ] && echo 0 || echo 1) timeout 60 ./.gpu/$b --config $1 --seqlens $2 --patterns clustered --options 0 2>/dev/null |
        grep '^{' | sed "s/^{/{\"mode\": \"$mode\", \"round\": $r, /" >> "$OUT/$NAME.jsonl"
    done
  done
done
python3 -c "
import json,collections
d=collections.defaultdict(list)
for l in open('$OUT/$NAME.jsonl'):
    j=json.loads(l); d[(j['config'],j['seqlen'],j['mode'])].append(j['fwd_train_ms'])
for k in sorted(d): print(k, 'fwd_train_ms', [round(x,4) for x in d[k]])
" | tee "$OUT/$NAME.txt"
