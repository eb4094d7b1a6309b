#!/usr/bin/env bash
# A device call that decides in-script (session 24, the no-launder candidate): the variant .gpu/flashmsa_bench_nl
# alternated with .gpu/flashmsa_bench (two rounds, m3 32k and fmsa 16k); its GPU tests and memcheck only when its
# m3 32k clustered backward is >= 0.5% faster; otherwise the forward's kernels under ncu. Run from the repository
# root with .gpu_pack carried: bash bench/probes/ab_then_tests.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
echo "== A/B ($(date +%T))"
for r in 1 2; do
  for a in "--config m3 --seqlens 32768 --patterns clustered,random" "--config fmsa --seqlens 16384 --patterns clustered,random"; do
    for b in flashmsa_bench flashmsa_bench_nl; do
      timeout 60 ./.gpu/$b $a --options 0 > "$OUT/ab-$b-$r.part" 2>/dev/null
      grep '^{' "$OUT/ab-$b-$r.part" | sed "s/^{/{\"bin\": \"$b\", \"round\": $r, /" >> "$OUT/ab.jsonl"
    done
  done
done
python3 - "$OUT/ab.jsonl" > "$OUT/ab-summary.txt" <<'PY'
import json,sys,collections
d=collections.defaultdict(list)
for l in open(sys.argv[1]):
    j=json.loads(l); d[(j['config'],j['seqlen'],j['pattern'],j['bin'])].append((j['bwd_ms'],j['step_ms']))
keys=sorted({k[:3] for k in d})
win=None
for k in keys:
    b=d[k+('flashmsa_bench',)]; n=d[k+('flashmsa_bench_nl',)]
    mb=sum(x[0] for x in b)/len(b); mn=sum(x[0] for x in n)/len(n)
    print(k, 'bwd base', [x[0] for x in b], 'nl', [x[0] for x in n], 'step base', [x[1] for x in b], 'nl', [x[1] for x in n], f'bwd {100*(mn/mb-1):+.2f}%')
    if k==('m3',32768,'clustered'): win = mn < 0.995*mb
print('NL_WINS' if win else 'NL_NOT_FASTER')
PY
cat "$OUT/ab-summary.txt"
if grep -q NL_WINS "$OUT/ab-summary.txt"; then
  echo "== tests nl ($(date +%T))"
  timeout 160 ./.gpu/flashmsa_gpu_tests_nl --gtest_filter='Bwd.*:Kl.*:Numerics.Precise*:Graph.*:Deterministic.*:Proxy.*-Deterministic.M3Sparse:Deterministic.Topk32:Deterministic.SegmentedLists:Proxy.M3SparseWithProxyLse:Proxy.FmsaVarlenRecomputedLse:Proxy.SegmentedLists:Proxy.SegmentedListsM3Given:Proxy.M3Batched' > "$OUT/tests-nl.log" 2>&1
  echo "tests nl rc=$?"; grep -E "tests? from .* ran|PASSED|FAILED" "$OUT/tests-nl.log" | tail -6
  echo "== memcheck nl ($(date +%T))"
  timeout 45 compute-sanitizer --tool memcheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests_nl --gtest_filter='Bwd.Small*:Kl.SmallSparseG1:Proxy.SmallSparse:Deterministic.SmallSparse' > "$OUT/memcheck-nl.log" 2>&1
  echo "memcheck nl rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck-nl.log" | tail -3
else
  for cfg in "m3 32768" "fmsa 16384"; do
    set -- $cfg
    echo "== ncu forward kernels $1 $2 ($(date +%T))"
    timeout 45 ncu --clock-control none --kernel-name regex:"regroup|route|fwd_kernel" --metrics gpu__time_duration.sum --print-summary per-kernel \
      ./.gpu/flashmsa_bench --config $1 --seqlens $2 --patterns clustered --iters 1 --options 0 > "$OUT/ncu-fwd-$1-$2.txt" 2>&1
    echo "ncu rc=$?"; grep -E "^\s+[a-z_]+.*\(|gpu__time_duration|Invocations" "$OUT/ncu-fwd-$1-$2.txt" | head -24
  done
fi
echo "== done ($(date +%T))"
