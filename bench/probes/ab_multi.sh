#!/usr/bin/env bash
# One device call for one or several prepared variants (session 25; it replaces session 24's ab_then_tests.sh, which
# did the same for one variant: VARS=nl TESTS=auto ... here): the default .gpu/flashmsa_bench and each
# .gpu/flashmsa_bench_$v of VARS alternated, ROUNDS rounds over ALT_ARGS (JSON rows tagged with the binary in
# $OUT/ab.jsonl; per variant and case the means of METRIC and step_ms against the default in $OUT/ab-summary.txt);
# then, with TESTS=1, per variant its GPU tests (filter TESTS_$v) and memcheck (filter MEMCHECK_$v), and
# racecheck (RACECHECK_$v) where given (TESTS=auto: only for a variant whose METRIC, default fwd_train_ms, at m3 32k
# clustered is below the default's in the A/B); NCU_$v (a kernel-name regex) times those kernels of the default and the
# variant under ncu at m3 32k and fmsa 16k clustered. Steps are skipped once BUDGET_S seconds have passed.
# Run from the repository root with .gpu_pack carried:
#   VARS="rm fd pf" AB=1 bash bench/probes/ab_multi.sh
#   VARS="rm fd pf" AB=0 TESTS=1 TESTS_rm='Regroup.*' MEMCHECK_rm='Regroup.*' ... bash bench/probes/ab_multi.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
VARS=${VARS:?VARS: the variants} ROUNDS=${ROUNDS:-2} BUDGET_S=${BUDGET_S:-560}
ALT_ARGS=${ALT_ARGS:-"--config m3 --seqlens 32768 --patterns clustered,random;--config fmsa --seqlens 16384 --patterns clustered,random"}
t0=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - t0) )); }
[ -d .gpu_pack ] && tar -xJf .gpu_pack/bins.tar.xz -C .gpu
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
if [ "${AB:-1}" = 1 ]; then
  echo "== A/B flashmsa_bench vs $VARS ($(date +%T))"
  IFS=';' read -ra sets <<< "$ALT_ARGS"
  for r in $(seq 1 "$ROUNDS"); do
    for a in "${sets[@]}"; do
      for b in flashmsa_bench $(for v in $VARS; do echo "flashmsa_bench_$v"; done); do
        # shellcheck disable=SC2086
        timeout 90 "./.gpu/$b" $a --options 0 2>/dev/null | grep '^{' | sed "s/^{/{\"bin\": \"$b\", \"round\": $r, /" >> "$OUT/ab.jsonl"
      done
    done
    echo "round $r done ($(date +%T), $(left) s left)"
  done
  python3 - "$OUT/ab.jsonl" "$VARS" > "$OUT/ab-summary.txt" <<'PY'
import collections, json, sys
path, var_list = sys.argv[1], sys.argv[2].split()
d = collections.defaultdict(list)
for line in open(path):
    j = json.loads(line)
    d[(j['config'], j['seqlen'], j['pattern'], j['bin'])].append(j)
cases = sorted({k[:3] for k in d})
for metric in ('fwd_train_ms', 'bwd_ms', 'step_ms'):
    print(f'== {metric} (means of the rounds; per-round values in brackets)')
    for k in cases:
        base = d[k + ('flashmsa_bench',)]
        mb = sum(x[metric] for x in base) / len(base)
        row = f'{k} base {mb:.4f} {[round(x[metric], 4) for x in base]}'
        for v in var_list:
            xs = d[k + ('flashmsa_bench_' + v,)]
            if not xs:
                row += f' | {v} -'
                continue
            mv = sum(x[metric] for x in xs) / len(xs)
            row += f' | {v} {mv:.4f} {[round(x[metric], 4) for x in xs]} {100 * (mv / mb - 1):+.2f}%'
        print(row)
PY
  cat "$OUT/ab-summary.txt"
fi
for v in $VARS; do
  ncu_re=NCU_$v
  if [ -n "${!ncu_re:-}" ] && [ "$(left)" -gt 60 ]; then
    for b in flashmsa_bench "flashmsa_bench_$v"; do
      for cfg in "m3 32768" "fmsa 16384"; do
        set -- $cfg
        echo "== ncu ${!ncu_re} $b $1 $2 ($(date +%T))"
        timeout 45 ncu --clock-control none --kernel-name regex:"${!ncu_re}" --metrics gpu__time_duration.sum \
          --print-summary per-kernel "./.gpu/$b" --config "$1" --seqlens "$2" --patterns clustered --iters 1 --options 0 \
          > "$OUT/ncu-$b-$1-$2.txt" 2>&1
        grep -E "^\s+[a-z_]+.*\(|gpu__time_duration" "$OUT/ncu-$b-$1-$2.txt" | head -8
      done
    done
  fi
done
faster() {  # the variant's METRIC mean at m3 32k clustered below the default's
  python3 - "$OUT/ab.jsonl" "flashmsa_bench_$1" "${METRIC_T:-fwd_train_ms}" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def mean(b):
    xs = [r[sys.argv[3]] for r in rows if r['bin'] == b and r['config'] == 'm3' and r['seqlen'] == 32768 and r['pattern'] == 'clustered']
    return sum(xs) / len(xs) if xs else float('nan')
sys.exit(0 if mean(sys.argv[2]) < mean('flashmsa_bench') else 1)
PY
}
if [ "${TESTS:-0}" = 1 ] || [ "${TESTS:-0}" = auto ]; then
  for v in $VARS; do
    if [ "${TESTS:-0}" = auto ] && ! faster "$v"; then echo "== $v not faster at m3 32k clustered: no tests"; continue; fi
    tf=TESTS_$v mf=MEMCHECK_$v rf=RACECHECK_$v ts=TESTS_S_$v
    if [ -n "${!tf:-}" ]; then
      lim=${!ts:-200}; [ "$(left)" -lt "$lim" ] && lim=$(left)
      [ "$lim" -gt 10 ] || { echo "== tests $v skipped: no time left"; continue; }
      echo "== tests $v (${!tf}; $(date +%T), limit $lim s)"
      timeout "$lim" "./.gpu/flashmsa_gpu_tests_$v" --gtest_filter="${!tf}" > "$OUT/tests-$v.log" 2>&1
      echo "tests $v rc=$?"; grep -E "tests? from .* ran|PASSED|FAILED" "$OUT/tests-$v.log" | tail -8
    fi
    for tool in memcheck racecheck; do
      f=$mf; [ $tool = racecheck ] && f=$rf
      [ -n "${!f:-}" ] || continue
      lim=60; [ "$(left)" -lt 60 ] && lim=$(left)
      [ "$lim" -gt 10 ] || { echo "== $tool $v skipped: no time left"; continue; }
      echo "== $tool $v (${!f}; $(date +%T))"
      timeout "$lim" compute-sanitizer --tool $tool --error-exitcode 1 "./.gpu/flashmsa_gpu_tests_$v" \
        --gtest_filter="${!f}" > "$OUT/$tool-$v.log" 2>&1
      echo "$tool $v rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/$tool-$v.log" | tail -3
    done
  done
fi
echo "== done ($(date +%T), $(( $(date +%s) - t0 )) s)"
