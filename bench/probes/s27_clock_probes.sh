#!/usr/bin/env bash
# Session 27: the SM clock under the 700 W cap during the backward, for the default and two dQ-path timing probes
# (bwd-no-dq-tile.patch: nodq, bwd-dq-writer-no-adds.patch: noadd; scripts/probe_variant.sh, wrong results).
# nvidia-smi samples clock, power and the event reasons every 20 ms beside each bench run (m3 32k clustered,
# --iters 50: the backward's phase is ~1 s), the binaries alternated, two rounds; bench/probes/clock_phases.py
# reads the backward's clock from the samples. BINS: other binaries of .gpu/ (call 5: BINS="flashmsa_bench
# flashmsa_bench_nog flashmsa_bench_nokl flashmsa_bench_note", the no-gathers, no-kl-walk and no-teacher-store probes).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
for round in 1 2; do
  for b in ${BINS:-flashmsa_bench flashmsa_bench_nodq flashmsa_bench_noadd}; do
    [ -x .gpu/$b ] || continue
    tag=$b-r$round
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader -lms 20 \
      > "$OUT/clocks-$tag.csv" 2>&1 &
    smi=$!
    ./.gpu/$b --config m3 --seqlens 32768 --patterns clustered --iters 50 --options 0 > "$OUT/bench-$tag.json" 2>&1
    kill $smi; wait $smi 2>/dev/null
    echo "$tag $(python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print('bwd', r['bwd_ms'], 'step', r['step_ms'], 'fwd', r['fwd_train_ms'])" "$OUT/bench-$tag.json")"
    python3 bench/probes/clock_phases.py --bwd "$OUT/clocks-$tag.csv"
    sleep 3
  done
done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
