# Helpers for device-call scripts (sourced): the A/B of bench binaries and of libraries on the user's path, with the
# binaries and libraries alternated by round. Session 28's calls repeated these loops inline (records of what ran).
#   source bench/probes/callkit.sh; bench_ab "ARGS" ROUNDS BIN...; bench_variants "ARGS" ROUNDS TAG:BIN:ENV...;
#   bench_three ROUNDS TAG:BIN:ENV...;
#   user_ab ROUNDS DEADLINE_S LIBSUFFIX...; bench_line FILE TAG; bench_knob "ARGS" ROUNDS VAR VALUE...;
#   call_open; ...; call_close NAME (a call's logs in one archive); sanitize TOOL SECONDS FILTER
stamp() { echo "== $1 ($(date +%T))"; }
# call_open: the packed binaries into .gpu/, and OUT moved to $OUT/l (many loose files do not all come back from the
# machine); call_close NAME: that folder archived as $OUT/NAME.tgz.
call_open() {
  mkdir -p .gpu
  tar -xJf .gpu_pack/bins.tar.xz -C .gpu
  FINAL=$OUT
  OUT=$OUT/l
  mkdir -p "$OUT"
}
call_close() { tar -czf "$FINAL/$1.tgz" -C "$FINAL" l && rm -rf "$FINAL/l"; }
# One line per run: backward and step ms of flashmsa_bench's last JSON line; the JSON under $OUT.
bench_ab() {
  local args=$1 rounds=$2 round b tag
  shift 2
  for round in $(seq 1 "$rounds"); do
    for b in "$@"; do
      tag=$b-$(echo "$args" | awk '{print $2"-"$4"-"$6}')-r$round
      ./.gpu/$b $args --options 0 > "$OUT/bench-$tag.json" 2>&1
      echo "$tag $(python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print('bwd', r['bwd_ms'], 'step', r['step_ms'], 'fwd', r['fwd_train_ms'])" "$OUT/bench-$tag.json" 2>&1 | tail -1)"
    done
  done
}
# Like bench_ab, with variants "TAG:BIN:ENV" (ENV: VAR=VALUE pairs joined by commas, or empty), e.g.
#   bench_variants "--config m3 --seqlens 32768 --patterns clustered --iters 30" 2 add:flashmsa_bench:FLASHMSA_BWD_DQ=add
bench_variants() {
  local args=$1 rounds=$2 round v tag name bin envs
  shift 2
  for round in $(seq 1 "$rounds"); do
    for v in "$@"; do
      IFS=: read -r name bin envs <<< "$v"
      tag=$name-$(echo "$args" | awk '{print $2"-"$4"-"$6}')-r$round
      env ${envs//,/ } timeout 60 ./.gpu/$bin $args --options 0 > "$OUT/bench-$tag.json" 2>&1
      echo "$tag $(python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print('bwd', r['bwd_ms'], 'step', r['step_ms'])" "$OUT/bench-$tag.json" 2>&1 | tail -1)"
    done
  done
}
# bench_variants over the three standard A/B cases (m3 32k clustered and random, 20 iterations; fmsa 16k clustered,
# 100), as sessions 32-33's calls wrote the loop out: bench_three ROUNDS TAG:BIN:ENV...
bench_three() {
  local rounds=$1 args
  shift
  for args in "--config m3 --seqlens 32768 --patterns clustered --iters 20" "--config m3 --seqlens 32768 --patterns random --iters 20" \
              "--config fmsa --seqlens 16384 --patterns clustered --iters 100"; do
    bench_variants "$args" "$rounds" "$@"
  done
}
# The README call (bench/run_bench.py --user-only, m3 32k clustered, cuDNN beside it) with .gpu/libflashmsa$SUFFIX.so
# for each suffix ("" the default), alternated by round; skipped once the call has run DEADLINE_S seconds.
user_ab() {
  local rounds=$1 deadline=$2 r v d
  shift 2
  for r in $(seq 1 "$rounds"); do
    for v in "$@"; do
      [ $SECONDS -lt "$deadline" ] || { echo "user lib$v skipped (time)"; continue; }
      d=$OUT/user$v-r$r; mkdir -p "$d"
      FLASHMSA_LIBRARY=$PWD/.gpu/libflashmsa$v.so PYTHONUNBUFFERED=1 timeout 90 python3 bench/run_bench.py --user-only \
        --out "$d" --configs m3 --seqlens 32768 --patterns clustered > "$d/log.txt" 2>&1
      echo "user lib$v round $r rc=$?"; grep -E "^\| m3" "$d"/*.md || tail -5 "$d/log.txt"
    done
  done
}
# One GPU-test run in its own process, cut at SECONDS: gtest_run LOG SECONDS BIN FILTER [PATTERN]; prints the rc and
# the log's summary lines (plus lines matching PATTERN, an extended regex).
gtest_run() {
  local log=$1 secs=$2 bin=$3 filter=$4 extra=${5:-}
  timeout "$secs" ./.gpu/$bin --gtest_filter="$filter" > "$OUT/$log" 2>&1
  echo "$log rc=$?"
  grep -E "^\[  (PASSED|FAILED)|FAILED  \]${extra:+|$extra}" "$OUT/$log" | head -40
}
# One summary line of a flashmsa_bench JSON (its last line): bench_line FILE TAG -> TAG bwd (ms, TF/s), main-only bwd (ms, TF/s),
# dense bwd (ms, TF/s), dense fwd and step ms (fields an older bench lacks print None).
bench_line() {
  python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); g=r.get; print(sys.argv[2], 'bwd', g('bwd_ms'), g('bwd_tflops'), 'main', g('bwd_main_ms'), g('bwd_main_tflops'), 'dense_bwd', g('dense_bwd_ms'), g('dense_bwd_tflops'), 'dense_fwd', g('dense_fwd_ms'), 'step', g('step_ms'))" "$1" "$2" 2>&1 | tail -1
}
# bench_knob ARGS ROUNDS VAR VALUE...: flashmsa_bench alternated over the values of one environment variable.
bench_knob() {
  local args=$1 rounds=$2 var=$3 round v tag
  shift 3
  for round in $(seq 1 "$rounds"); do
    for v in "$@"; do
      tag=$var-$v-$(echo "$args" | awk '{print $2"-"$4"-"$6}')-r$round
      env "$var=$v" timeout 120 ./.gpu/flashmsa_bench $args --options 0 > "$OUT/bench-$tag.json" 2>&1
      bench_line "$OUT/bench-$tag.json" "$tag"
    done
  done
}
# bench_bins "ARGS" ROUNDS DEADLINE_S BIN...: flashmsa_bench binaries of .gpu/ alternated by round (--options 0), one
# bench_line each; skipped once the call has run DEADLINE_S seconds; each run cut at BENCH_TIMEOUT s (40).
bench_bins() {
  local args=$1 rounds=$2 deadline=$3 round b tag
  shift 3
  for round in $(seq 1 "$rounds"); do
    for b in "$@"; do
      [ $SECONDS -lt "$deadline" ] || { echo "skipped (time)"; continue; }
      tag=$b-$(echo "$args" | awk '{print $2"-"$4}')-r$round
      timeout "${BENCH_TIMEOUT:-40}" ./.gpu/$b $args --options 0 > "$OUT/bench-$tag.json" 2>&1
      bench_line "$OUT/bench-$tag.json" "$tag"
    done
  done
}
# The two standard A/B points (m3 32k and fmsa 16k, clustered); bench_std ROUNDS DEADLINE_S BIN...: bench_bins at both.
std_args=("--config m3 --seqlens 32768 --patterns clustered --iters 20"
  "--config fmsa --seqlens 16384 --patterns clustered --iters 100")
bench_std() {
  local rounds=$1 deadline=$2 args
  shift 2
  for args in "${std_args[@]}"; do bench_bins "$args" "$rounds" "$deadline" "$@"; done
}
# compute-sanitizer's TOOL (memcheck, racecheck, ...) on the GPU tests of FILTER, cut at SECONDS: sanitize TOOL SECONDS
# FILTER; prints the rc (3: the tool found errors) and the tests' and the tool's summary lines.
sanitize() {
  local tool=$1 secs=$2 filter=$3
  timeout "$secs" compute-sanitizer --tool "$tool" --error-exitcode 3 ./.gpu/flashmsa_gpu_tests --gtest_filter="$filter" \
    > "$OUT/$tool-small.log" 2>&1
  echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/$tool-small.log" | head -3
}
