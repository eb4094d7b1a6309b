#!/usr/bin/env bash
# Everything one device call needs, logs under $OUT: the GPU suite, compute-sanitizer on the
# small cases, the main job on the GPU, and the benchmarks with peers.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
echo "== GPU suite"
timeout 400 ./.gpu/flashmsa_gpu_tests > "$OUT/gpu_suite.log" 2>&1; echo "suite rc=$?"
grep -E "^\[  (PASSED|FAILED)|FAILED  \]|tests? from .* ran" "$OUT/gpu_suite.log" | tail -5
echo "== sanitizers"
timeout 200 compute-sanitizer --tool memcheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests --gtest_filter='*Small*' > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -1 "$OUT/memcheck.log"
timeout 300 compute-sanitizer --tool racecheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests --gtest_filter='*Small*' > "$OUT/racecheck.log" 2>&1; echo "racecheck rc=$?"; tail -1 "$OUT/racecheck.log"
echo "== main job"
timeout 200 ./.gpu/flashmsa run > "$OUT/run_default.log" 2>&1; echo "run rc=$?"; tail -25 "$OUT/run_default.log"
timeout 200 ./.gpu/flashmsa run --config fmsa --seqlen 3000 --topk 8 --check > "$OUT/run_check.log" 2>&1; echo "check rc=$?"; tail -14 "$OUT/run_check.log"
echo "== bench"
PYTHONUNBUFFERED=1 timeout 560 python3 bench/run_bench.py --out "$OUT" ${BENCH_ARGS:---seqlens 16384,32768,65536 --flex 32768} > "$OUT/bench_log.txt" 2>&1; echo "bench rc=$?"
tail -14 "$OUT/bench_log.txt"
