#!/usr/bin/env bash
# One device call (session 26): the dynamic persistent forward's forms against the default, alternated, two rounds
# (bench/probes/ab_multi.sh): pf3 (fwd-persistent-dynamic.patch: a tile taken before its buffer is free, two ahead),
# pf4 (fwd-persistent-dynamic-late.patch: taken once its buffer is free, one ahead), pf5
# (fwd-persistent-dynamic-late-order.patch: pf4 with the tiles m-tile-major, longest lists first); then pf5's GPU tests
# with memcheck and racecheck, and the user's path (the README's call) of the default library and pf5's, m3 32k and
# fmsa 16k, alternated.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T='Persistent.*:Errors.BadPersistentKnob:Regroup.*:Routes.*:Given.*:Sparse.*:Dense.*:Numerics.*:Graph.*'
VARS="pf3 pf4 pf5" AB=1 TESTS=1 BUDGET_S=420 \
  ALT_ARGS="--config m3 --seqlens 32768 --patterns clustered,random;--config fmsa --seqlens 16384,32768 --patterns clustered" \
  TESTS_pf5="$T" TESTS_S_pf5=150 MEMCHECK_pf5='Persistent.FewTiles:Persistent.M3Dense' RACECHECK_pf5='Persistent.FewTiles' \
  OUT=$OUT bash bench/probes/ab_multi.sh
for r in 1 2; do
  for v in "" _pf5; do
    for cfg in "m3 32768" "fmsa 16384"; do
      set -- $cfg
      d=$OUT/user$v-$1-r$r; mkdir -p $d
      FLASHMSA_LIBRARY=$PWD/.gpu/libflashmsa$v.so PYTHONUNBUFFERED=1 timeout 100 python3 bench/run_bench.py --user-only \
        --out $d --configs $1 --seqlens $2 > $d/log.txt 2>&1
      echo "user lib$v $1 $2 round $r rc=$?"; grep -E "^\| (m3|fmsa)" $d/*.md || tail -5 $d/log.txt
    done
  done
done
# the device returns at most 8 files: everything in one archive, the A/B summary beside it
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 ! -name ab-summary.txt -delete && mv /tmp/bundle.tgz .)
