#!/usr/bin/env bash
# One device call: GPU suite, compute-sanitizer on the small cases, benchmarks. Binaries come
# prebuilt in .gpu/ (carried); logs go to $OUT. Usage: bash scripts/gpu_session.sh [what...]
#   what: tests sanitize bench (default: all three)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${*:-tests sanitize bench}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
for w in $what; do
  case $w in
    tests)
      echo "== GPU suite"; ./.gpu/flashmsa_gpu_tests 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^\[|rel-L2|FAIL|Failure|error" ;;
    sanitize)
      echo "== memcheck"; compute-sanitizer --tool memcheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests --gtest_filter='*Small*' > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -3 "$OUT/memcheck.log"
      echo "== racecheck"; compute-sanitizer --tool racecheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests --gtest_filter='*Small*' > "$OUT/racecheck.log" 2>&1; echo "racecheck rc=$?"; tail -3 "$OUT/racecheck.log" ;;
    bench)
      echo "== bench"; for cfg in m3 fmsa; do ./.gpu/flashmsa_bench --config $cfg --seqlens ${SEQLENS:-8192,32768} --patterns clustered,random; done 2>&1 | tee "$OUT/bench.jsonl" ;;
  esac
done
