#!/usr/bin/env bash
# Session 31, call 3: why the counted dq writer is slow (call 2: m3 32k backward 25.1 ms against 18.6 with the convert
# kernel; fmsa 16k 9.3 against 2.9). A probe build (FLASHMSA_DQ_PROBE, not committed) changes only the count's
# atomic: 0 acq_rel (the build of call 2: MEMBAR.ALL.GPU + ATOMG + CCTL.IVALL), 1 release (no L1 invalidation),
# 2 relaxed (no fence), 3 relaxed without the conversions (wrong dq: timing only).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp ab
for args in "--config fmsa --seqlens 16384 --patterns clustered --iters 50" "--config m3 --seqlens 32768 --patterns clustered --iters 20"; do
  for v in convert p0 p1 p2 p3; do
    tag=$v-$(echo "$args" | awk '{print $2"-"$4"-"$6}')
    if [ $v = convert ]; then env="FLASHMSA_BWD_DQ=convert"; else env="FLASHMSA_BWD_DQ=last FLASHMSA_DQ_PROBE=${v#p}"; fi
    env $env timeout 60 ./.gpu/flashmsa_bench $args --options 0 > "$OUT/bench-$tag.json" 2>&1
    echo "$tag $(python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print('bwd', r['bwd_ms'], 'step', r['step_ms'])" "$OUT/bench-$tag.json" 2>&1 | tail -1)"
  done
done
stamp done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
