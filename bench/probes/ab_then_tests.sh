#!/usr/bin/env bash
# One device call that decides in-script: the variant .gpu/flashmsa_bench_$VAR alternated with .gpu/flashmsa_bench
# (two rounds, ALT_ARGS; JSON rows tagged with the binary in $OUT/ab.jsonl, means in $OUT/ab-summary.txt), then the
# variant's GPU tests (TESTS, a gtest filter) and memcheck (MEMCHECK, a filter) when its METRIC at m3 32k clustered
# is >= 0.5% lower, or always with ALWAYS_TEST=1; NCU (a kernel-name regex) times those kernels of both binaries
# under ncu (one metric: gpu__time_duration.sum) at m3 32k and fmsa 16k clustered. Run from the repository root
# with .gpu_pack carried:
#   bash bench/probes/ab_then_tests.sh                      # session 24: the no-launder backward (VAR=nl)
#   VAR=rm METRIC=fwd_train_ms ALWAYS_TEST=1 NCU=regroup TESTS='Regroup.*:Routes.*:Given.*:Sparse.*' \
#     MEMCHECK='Regroup.*' bash bench/probes/ab_then_tests.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
VAR=${VAR:-nl} METRIC=${METRIC:-bwd_ms}
TESTS=${TESTS:-'Bwd.*:Kl.*:Numerics.Precise*:Graph.*:Deterministic.*:Proxy.*-Deterministic.M3Sparse:Deterministic.Topk32:Deterministic.SegmentedLists:Proxy.M3SparseWithProxyLse:Proxy.FmsaVarlenRecomputedLse:Proxy.SegmentedLists:Proxy.SegmentedListsM3Given:Proxy.M3Batched'}
MEMCHECK=${MEMCHECK:-'Bwd.Small*:Kl.SmallSparseG1:Proxy.SmallSparse:Deterministic.SmallSparse'}
ALT_ARGS=${ALT_ARGS:-"--config m3 --seqlens 32768 --patterns clustered,random;--config fmsa --seqlens 16384 --patterns clustered,random"}
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
echo "== A/B flashmsa_bench vs flashmsa_bench_$VAR ($(date +%T))"
IFS=';' read -ra sets <<< "$ALT_ARGS"
for r in 1 2; do
  for a in "${sets[@]}"; do
    for b in flashmsa_bench "flashmsa_bench_$VAR"; do
      # shellcheck disable=SC2086
      timeout 60 "./.gpu/$b" $a --options 0 2>/dev/null | grep '^{' | sed "s/^{/{\"bin\": \"$b\", \"round\": $r, /" >> "$OUT/ab.jsonl"
    done
  done
done
python3 - "$OUT/ab.jsonl" "$METRIC" "flashmsa_bench_$VAR" > "$OUT/ab-summary.txt" <<'PY'
import collections, json, sys
path, metric, var = sys.argv[1:4]
d = collections.defaultdict(list)
for line in open(path):
    j = json.loads(line)
    d[(j['config'], j['seqlen'], j['pattern'], j['bin'])].append((j[metric], j['step_ms']))
win = False
for k in sorted({k[:3] for k in d}):
    b, v = d[k + ('flashmsa_bench',)], d[k + (var,)]
    mb, mv = sum(x[0] for x in b) / len(b), sum(x[0] for x in v) / len(v)
    print(k, metric, 'base', [x[0] for x in b], var, [x[0] for x in v], 'step base', [x[1] for x in b], var,
          [x[1] for x in v], f'{metric} {100 * (mv / mb - 1):+.2f}%')
    if k == ('m3', 32768, 'clustered'):
        win = mv < 0.995 * mb
print('VARIANT_WINS' if win else 'VARIANT_NOT_FASTER')
PY
cat "$OUT/ab-summary.txt"
if [ -n "${NCU:-}" ]; then
  for b in flashmsa_bench "flashmsa_bench_$VAR"; do
    for cfg in "m3 32768" "fmsa 16384"; do
      set -- $cfg
      echo "== ncu $NCU $b $1 $2 ($(date +%T))"
      timeout 45 ncu --clock-control none --kernel-name regex:"$NCU" --metrics gpu__time_duration.sum --print-summary per-kernel \
        "./.gpu/$b" --config "$1" --seqlens "$2" --patterns clustered --iters 1 --options 0 > "$OUT/ncu-$b-$1-$2.txt" 2>&1
      grep -E "^\s+[a-z_]+.*\(|gpu__time_duration" "$OUT/ncu-$b-$1-$2.txt" | head -8
    done
  done
fi
if grep -q VARIANT_WINS "$OUT/ab-summary.txt" || [ "${ALWAYS_TEST:-0}" = 1 ]; then
  echo "== tests $VAR ($(date +%T))"
  timeout "${TESTS_S:-160}" "./.gpu/flashmsa_gpu_tests_$VAR" --gtest_filter="$TESTS" > "$OUT/tests-$VAR.log" 2>&1
  echo "tests $VAR rc=$?"; grep -E "tests? from .* ran|PASSED|FAILED" "$OUT/tests-$VAR.log" | tail -6
  echo "== memcheck $VAR ($(date +%T))"
  timeout "${MEMCHECK_S:-45}" compute-sanitizer --tool memcheck --error-exitcode 1 "./.gpu/flashmsa_gpu_tests_$VAR" \
    --gtest_filter="$MEMCHECK" > "$OUT/memcheck-$VAR.log" 2>&1
  echo "memcheck $VAR rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck-$VAR.log" | tail -3
fi
echo "== done ($(date +%T))"
