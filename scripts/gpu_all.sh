#!/usr/bin/env bash
# What the GPU machine runs, logs under $OUT. STEPS picks the parts (default: suite sanitize pytest run bench):
#   suite      the GPU suite (tests/gpu) as gtest shards run side by side on the one GPU: SUITE_SHARDS of them
#              (default 4), each cut at SUITE_S seconds (default 540), logs gpu_suite-shard<i>.log. The whole
#              suite, longer than a 10-minute device command in one process, takes two: SUITE_PART=1/2, then
#              SUITE_PART=2/2 (part i of n runs its SUITE_SHARDS of the n x SUITE_SHARDS shards; default 1/1).
#              SUITE_FILTER: a gtest filter (default every test); SUITE_BIN: another binary of .gpu/, e.g. a
#              variant's flashmsa_gpu_tests_<name>; SUITE_RUNS="bin=filter;bin=filter": several binaries of
#              .gpu/ in turn, each sharded the same way, logs gpu_suite-<bin>-shard<i>.log (e.g. the variants'
#              tests before an A/B)
#   sanitize   compute-sanitizer memcheck + racecheck on the small cases
#   race       compute-sanitizer racecheck of each binary of RACE_BINS (default flashmsa_gpu_tests; variants:
#              flashmsa_gpu_tests_<name>) on RACE_FILTER (default the small fused cases), a log and a summary each
#   pytest     the Python tests against the CUDA build (tests/python, GPU ones included)
#   run        the main job on the GPU
#   wheel      the wheel of .whl/ (pip wheel . -w .whl) installed without an index; the GPU pytest
#              against it from outside the source tree; `flashmsa run` (console command) timed
#   profile    per-kernel durations of one m3 training step (bench/tools/gpu_profile.sh)
#   kbench     flashmsa's kernels alone (flashmsa_bench, KBENCH_ARGS), no peers
#   bench      the benchmarks with peers (BENCH_ARGS)
#   user       the user's path (bench/user_path.py: the README's Python call, its step with and
#              without the forward's kl, next to the kernel sum) against cuDNN, USER_ARGS (default
#              "--configs m3 --seqlens 32768,65536,131072;--configs fmsa --seqlens 16384,32768": one
#              run_bench.py per ';'-separated list, clustered and random), under $OUT/user/<n>
#   sweep      the top-k sweep of the user's step against cuDNN (bench/topk_sweep.py, SWEEP_ARGS; issue 16's
#              PNG), under $OUT/sweep
#   ab         every A/B variant .gpu/flashmsa_bench_<name> (bench/tools/bench_variant.sh) next to
#              .gpu/flashmsa_bench, m3 32k clustered (AB_ARGS="--options 0" skips the option runs)
#   example    examples/train_long_context.py --gpu (EXAMPLE_ARGS), curves under $OUT/example
#   lm         examples/lm_long_context.py --preset h200 (LM_ARGS), MSA vs dense SDPA on the stdlib's
#              source, results under $OUT/lm (issue 17)
#   balance    the backward's CTA balance on the real m3 32k selections (bench/list_balance.py)
#   metadata   the metadata-guard tests (Metadata.*) alone, under compute-sanitizer memcheck
#              (the 200-corruption fuzz included), and the Python GPU tests of invalid cu_seqlens
#   alternate  two or more bench binaries (ALT_BINS, default .gpu/flashmsa_bench_before and
#              .gpu/flashmsa_bench: the last commit's and this tree's) alternated ALT_ROUNDS times
#              (default 2), ALT_ARGS (default m3 32k clustered; ';' separates argument sets, e.g. with
#              "--only select" for the selection alone), --options 0: a before/after in one device command
#   cp         context parallelism over NCCL on every GPU of the machine (needs 2 or more):
#              tests/python/test_distributed.py::test_nccl_two_gpus_m3 for each token count in
#              CP_LENGTHS (default "16384,9000,7384 65536,40000,25536": 32k and 128k tokens)
#   long       the long-context table (bench/long_context.py: the README's step at 128k-1M, cuDNN to --dense-max),
#              LONG_ARGS (default "--configs m3 --seqlens 1048576,524288,262144,131072 --dense-max 262144"),
#              under $OUT/long
#   fp8        the fp8 selection's e4m3 kernel: its GPU tests against the CPU reference
#              (Fp8Selection.*, the fp8 cases of Segments.SmallSelectRowsEqualWholeCall) with the union walk's (Given.*,
#              Proxy.GivenWithEmptyRows, Proxy.FmsaVarlenRecomputedLse), memcheck on the small ones, the Python
#              tests (tests/python/test_fp8_selection.py), then its speed and set recall against the bf16 selection
#              (bench/long_context.py --fp8, FP8_ARGS, default m3 at 128k and 1M; FP8_BENCH_S=0 skips it), under $OUT/fp8
#   wgmma      the wgmma throughput probe (bench/tools/wgmma_probe.cu: SS and RS, N = 16 .. 256), $OUT/wgmma.txt
#   megatron   Megatron-Core on the GPU: megatron-core's wheel (and packaging's) from .gpu_pack/ (pip download
#              --no-deps --python-version 3.12 --only-binary=:all: megatron-core==0.16.1 packaging==24.2 -d .gpu_pack;
#              the GPU machine has no index) installed into a folder on PYTHONPATH, the GPU tests of
#              tests/python/test_megatron.py (MG_PYTEST=0 skips them), then examples/megatron_gpt.py --preset h200
#              --index-share 2 (MG_ARGS replaces the last two), under $OUT/megatron
# Binaries and libflashmsa.so are expected in .gpu/ (copied from build/, carried by the device call),
# or packed by scripts/pack_gpu.sh into .gpu_pack/bins.tar.xz (carry .gpu_pack: several binaries
# exceed the device tool's 64 MiB), which is unpacked into .gpu/ first.
set -uo pipefail
if [ -f .gpu_pack/bins.tar.xz ]; then
  mkdir -p .gpu && tar -xJf .gpu_pack/bins.tar.xz -C .gpu && echo "unpacked .gpu_pack/bins.tar.xz into .gpu/"
fi
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-suite sanitize pytest run bench}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
has() { [[ " $STEPS " == *" $1 "* ]]; }
stamp() { echo "== $1 ($(date +%T))"; }
if has suite; then
  # one binary (SUITE_BIN, SUITE_FILTER) or several (SUITE_RUNS="bin=filter;bin=filter", bin a name in .gpu/), each as
  # SUITE_SHARDS gtest shards side by side (shards (i - 1) x SUITE_SHARDS .. i x SUITE_SHARDS - 1 of n x SUITE_SHARDS
  # for SUITE_PART=i/n), each shard within SUITE_S seconds
  part=${SUITE_PART:-1/1} per=${SUITE_SHARDS:-4}
  part_i=${part%/*} part_n=${part#*/}
  runs=("${SUITE_BIN:-flashmsa_gpu_tests}=${SUITE_FILTER:-*}")
  [ -n "${SUITE_RUNS:-}" ] && IFS=';' read -ra runs <<< "$SUITE_RUNS"
  for r in "${runs[@]}"; do
    bin=${r%%=*} filter=${r#*=} base="$OUT/gpu_suite${SUITE_RUNS:+-${r%%=*}}"
    stamp "GPU suite $bin ($filter), part $part: $per shards of $((part_n * per)) side by side"
    shards=$(seq $(((part_i - 1) * per)) $((part_i * per - 1)))
    declare -A pid=()
    for i in $shards; do
      GTEST_TOTAL_SHARDS=$((part_n * per)) GTEST_SHARD_INDEX=$i timeout ${SUITE_S:-540} "./.gpu/$bin" \
        --gtest_filter="$filter" > "$base-shard$i.log" 2>&1 &
      pid[$i]=$!
    done
    for i in $shards; do
      wait "${pid[$i]}"; rc=$?
      log="$base-shard$i.log"
      echo "suite ($bin) shard $i rc=$rc: $(grep -cE '^\[       OK \]' "$log") passed," \
        "$(grep -cE '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$log") failed"
      grep -E "^\[  (PASSED|FAILED)|FAILED  \]|tests? from .* ran" "$log" | tail -8
      [ "$rc" = 124 ] && echo "  cut at ${SUITE_S:-540} s in: $(grep -E '^\[ RUN      \]' "$log" | tail -1)"
    done
    unset pid
    # the numbers the numerics docs and the deterministic mode need
    for i in $shards; do
      awk '/^\[ RUN      \] (Numerics|Deterministic)\./{p=1} /^\[       OK \]|^\[  FAILED  \]/{if(p)print; p=0} p' \
        "$base-shard$i.log"
    done
  done
fi
if has sanitize; then
  stamp "sanitizers"
  timeout ${MEMCHECK_S:-200} compute-sanitizer --tool memcheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests --gtest_filter='*Small*' > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -1 "$OUT/memcheck.log"
  # racecheck without Metadata.*: its table test runs ~20 whole training steps, which racecheck did not finish in
  # 110 s; the kernels it drives are the ones the other small cases check, and the metadata step runs it
  # under memcheck
  timeout ${RACECHECK_S:-300} compute-sanitizer --tool racecheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests --gtest_filter='*Small*:-Metadata.*' > "$OUT/racecheck.log" 2>&1; echo "racecheck rc=$?"; tail -1 "$OUT/racecheck.log"
fi
if has race; then
  stamp "racecheck"
  for bin in ${RACE_BINS:-flashmsa_gpu_tests}; do
    timeout ${RACE_S:-150} compute-sanitizer --tool racecheck "./.gpu/$bin" \
      --gtest_filter="${RACE_FILTER:-Kl.SmallSparseG1:Bwd.Small*:Proxy.SmallSparse:Deterministic.SmallSparse}" \
      > "$OUT/racecheck-$bin.log" 2>&1
    echo "racecheck $bin rc=$?"; grep -E "RACECHECK SUMMARY|^\[  (PASSED|FAILED)" "$OUT/racecheck-$bin.log"
  done
fi
if has metadata; then
  stamp "metadata guard (memcheck)"
  timeout ${MEMCHECK_META_S:-300} compute-sanitizer --tool memcheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests \
    --gtest_filter='Metadata.*' > "$OUT/memcheck-metadata.log" 2>&1; echo "memcheck (Metadata.*) rc=$?"
  grep -E "^\[  (PASSED|FAILED)|FAILED  \]|corruptions|ERROR SUMMARY" "$OUT/memcheck-metadata.log" | tail -8
  FLASHMSA_BUILD_DIR=.gpu timeout 200 python3 -m pytest -q tests/python/test_metadata_cuda.py > "$OUT/pytest-metadata.log" 2>&1
  echo "pytest (metadata) rc=$?"; tail -3 "$OUT/pytest-metadata.log"
fi
if has alternate; then
  stamp "alternated benches"
  IFS=';' read -ra alt_sets <<< "${ALT_ARGS:---config m3 --seqlens 32768 --patterns clustered}"  # ';' separates argument sets
  for round in $(seq ${ALT_ROUNDS:-2}); do
    for args in "${alt_sets[@]}"; do
      for bin in ${ALT_BINS:-./.gpu/flashmsa_bench_before ./.gpu/flashmsa_bench}; do
        [ -x "$bin" ] || continue
        timeout 120 "$bin" $args --options 0 | tee -a "$OUT/alternate.jsonl" |
          python3 -c "
import json, sys
for r in map(json.loads, sys.stdin):
    f = lambda k: (f'{r[k]:.3f}' if isinstance(r.get(k), float) else '-')
    print(f\"  $bin round $round {r['config']} {r['seqlen']} {r['pattern']}: select {f('select_ms')} ({r.get('select_tflops')}) \"
          f\"fwd {f('fwd_train_ms')} ({r.get('fwd_train_tflops', '-')}) dense {f('dense_fwd_ms')} bwd {f('bwd_ms')} step {f('step_ms')} ms\")"
      done
    done
  done
fi
if has pytest; then
  stamp "pytest (CUDA build)"
  FLASHMSA_BUILD_DIR=.gpu timeout 300 python3 -m pytest -q -rs tests/python ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1; echo "pytest rc=$?"
  tail -25 "$OUT/pytest.log"
fi
if has wheel; then
  # The wheel built here (pip wheel . -w .whl, carried): installed into a fresh environment with
  # no index, then the GPU pytest against the installed package from outside the source tree, and
  # the default main job through the console command, timed (README: "<= 5 s").
  stamp "wheel"
  W=/tmp/flashmsa-wheel; rm -rf "$W"; tests=$(pwd)/tests/python
  # --target, not a venv: the machine's python3 may keep torch where a venv does not look
  PY=python3; BIN="$W/bin"; export PYTHONPATH="$W"
  python3 -m pip install --quiet --no-index --no-deps --target "$W" .whl/flashmsa-*.whl; echo "wheel install rc=$?"
  (cd /tmp && "$PY" -c "import flashmsa, flashmsa._lib as L; print('flashmsa from', flashmsa.__file__); print('library', L.library_path(), 'cuda available', L.cuda_available())" 2>&1 | tee "$OUT/wheel_import.txt")
  for i in 1 2 3; do
    s0=$(date +%s.%N); (cd /tmp && timeout 100 "$BIN/flashmsa" run > "$OUT/wheel_run_default_$i.log" 2>&1); rc=$?; s1=$(date +%s.%N)
    echo "flashmsa run (defaults, console command) #$i rc=$rc wall $(python3 -c "print(f'{$s1-$s0:.2f}')") s" | tee -a "$OUT/wheel_run_wall.txt"
  done
  tail -30 "$OUT/wheel_run_default_1.log"
  (cd /tmp && timeout 100 "$BIN/flashmsa" run --check > "$OUT/wheel_run_check_32k.log" 2>&1); echo "flashmsa run --check (32k defaults) rc=$?"
  tail -20 "$OUT/wheel_run_check_32k.log"
  (cd /tmp && timeout 100 "$BIN/flashmsa" run --pattern random --check --seqlen 5000 --batch 2 > "$OUT/wheel_run_check_random.log" 2>&1); echo "flashmsa run --check (random) rc=$?"
  tail -16 "$OUT/wheel_run_check_random.log"
  (cd /tmp && FLASHMSA_TEST_INSTALLED=1 PYTHONUNBUFFERED=1 timeout ${WHEEL_PYTEST_S:-240} "$PY" -m pytest -q -rs "$tests" ${PYTEST_ARGS:-} > "$OUT/wheel_pytest.log" 2>&1); echo "pytest (installed wheel) rc=$?"
  tail -8 "$OUT/wheel_pytest.log"
fi
if has run; then
  stamp "main job"
  timeout 200 ./.gpu/flashmsa run > "$OUT/run_default.log" 2>&1; echo "run rc=$?"; tail -25 "$OUT/run_default.log"
  timeout 200 ./.gpu/flashmsa run --config fmsa --seqlen 3000 --topk 8 --check > "$OUT/run_check.log" 2>&1; echo "check rc=$?"; tail -14 "$OUT/run_check.log"
  timeout 200 ./.gpu/flashmsa run --config fmsa --seqlen 3000 --topk 8 --check --deterministic --precise-dpsum > "$OUT/run_check_det_lo.log" 2>&1; echo "check (deterministic, precise dpsum) rc=$?"; tail -14 "$OUT/run_check_det_lo.log"
fi
if has profile; then
  stamp "profile"
  bash bench/tools/gpu_profile.sh
fi
if has kbench; then
  stamp "kernel bench"
  timeout 300 ./.gpu/flashmsa_bench ${KBENCH_ARGS:---config m3 --seqlens 32768,65536 --patterns clustered} > "$OUT/kbench.jsonl" 2>&1; echo "kbench rc=$?"
  cat "$OUT/kbench.jsonl"
fi
if has bench; then
  stamp "bench"
  PYTHONUNBUFFERED=1 timeout 560 python3 bench/run_bench.py --out "$OUT" ${BENCH_ARGS:---seqlens 16384,32768,65536 --flex 32768} > "$OUT/bench_log.txt" 2>&1; echo "bench rc=$?"
  tail -14 "$OUT/bench_log.txt"
fi
if has user; then
  stamp "user's path"
  mkdir -p "$OUT/user"
  IFS=';' read -ra runs <<< "${USER_ARGS:---configs m3 --seqlens 32768,65536,131072;--configs fmsa --seqlens 16384,32768}"
  n=0
  for args in "${runs[@]}"; do  # one run_bench.py per ';'-separated argument list, each in its own folder
    n=$((n + 1)); mkdir -p "$OUT/user/$n"
    PYTHONUNBUFFERED=1 timeout ${USER_S:-400} python3 bench/run_bench.py --user-only --out "$OUT/user/$n" $args \
      > "$OUT/user/$n/log.txt" 2>&1; echo "user ($args) rc=$?"
    grep -E '^\| [0-9]{4}-' "$OUT"/user/$n/user_path.md 2>/dev/null || tail -5 "$OUT/user/$n/log.txt"
  done
fi
if has sweep; then
  stamp "top-k sweep"
  mkdir -p "$OUT/sweep"
  PYTHONUNBUFFERED=1 timeout ${SWEEP_S:-560} python3 bench/topk_sweep.py --out "$OUT/sweep" ${SWEEP_ARGS:-} \
    > "$OUT/sweep/log.txt" 2>&1; echo "sweep rc=$?"
  grep -E '^\| [0-9]{4}-' "$OUT/sweep/topk_sweep.md" 2>/dev/null || tail -5 "$OUT/sweep/log.txt"
fi
if has ab; then
  stamp "A/B variants"
  for bin in ./.gpu/flashmsa_bench ./.gpu/flashmsa_bench_*; do
    [ -x "$bin" ] || continue
    echo "-- $bin"
    timeout 120 "$bin" --config m3 --seqlens 32768 --patterns clustered ${AB_ARGS:-} | tee -a "$OUT/ab.jsonl" |
      python3 -c "import json,sys; [print(f\"  bwd {r['bwd_ms']:.2f} ms ({r['bwd_tflops']} TF/s), step {r['step_ms']:.2f} ms, deterministic bwd {r['bwd_deterministic_ms']} ms\") for r in map(json.loads, sys.stdin)]"
  done
fi
if has balance; then
  stamp "CTA balance"
  mkdir -p "$OUT/indices"
  timeout 120 ./.gpu/flashmsa_bench --config m3 --seqlens 32768 --patterns clustered,random --options 0 \
    --save-indices "$OUT/indices" > /dev/null
  for pat in clustered random; do
    echo "-- $pat"; python3 bench/list_balance.py "$OUT/indices/indices-m3-32768-$pat.bin" --hq 64 --hp 4 --topk 16
  done
  rm -rf "$OUT/indices"
fi
if has example; then
  stamp "example"
  mkdir -p "$OUT/example"
  FLASHMSA_BUILD_DIR=.gpu PYTHONUNBUFFERED=1 timeout ${EXAMPLE_S:-300} python3 examples/train_long_context.py --gpu \
    --out "$OUT/example" ${EXAMPLE_ARGS:-} > "$OUT/example/train_long_context.txt" 2>&1; echo "example rc=$?"
  tail -40 "$OUT/example/train_long_context.txt"
fi
if has lm; then
  stamp "real-data LM (MSA vs dense)"
  mkdir -p "$OUT/lm"
  FLASHMSA_BUILD_DIR=.gpu PYTHONUNBUFFERED=1 timeout ${LM_S:-540} python3 examples/lm_long_context.py --preset h200 \
    --out "$OUT/lm" ${LM_ARGS:-} > "$OUT/lm/log.txt" 2>&1; echo "lm rc=$?"
  grep -E "^\[|final|union|corpus|model" "$OUT/lm/log.txt" | tail -40
fi
if has cp; then
  stamp "context parallelism (NCCL)"
  n=$(nvidia-smi -L | wc -l); echo "GPUs: $n; NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-unset}"
  for lens in ${CP_LENGTHS:-16384,9000,7384 65536,40000,25536}; do
    echo "-- lengths $lens"
    FLASHMSA_BUILD_DIR=.gpu FLASHMSA_CP_GPUS=$n FLASHMSA_CP_LENGTHS=$lens timeout 560 python3 -m pytest -q -s \
      tests/python/test_distributed.py -k "${CP_K:-nccl}" > "$OUT/cp-$n-${lens//,/_}.log" 2>&1; echo "cp rc=$?"
    grep -E "^rank|^P = 1|passed|failed|Error" "$OUT/cp-$n-${lens//,/_}.log" | tail -8
  done
fi
if has long; then
  stamp "long context"
  mkdir -p "$OUT/long"
  FLASHMSA_BUILD_DIR=.gpu PYTHONUNBUFFERED=1 timeout ${LONG_S:-540} python3 bench/long_context.py --out "$OUT/long" \
    ${LONG_ARGS:---configs m3 --seqlens 1048576,524288,262144,131072 --dense-max 262144} > "$OUT/long/log.txt" 2>&1
  echo "long rc=$?"
  grep -E '^\| [0-9]{4}-' "$OUT/long/long_context.md" 2>/dev/null | tail -8 || tail -5 "$OUT/long/log.txt"
fi
if has fp8; then
  stamp "fp8 selection"
  mkdir -p "$OUT/fp8"
  timeout ${FP8_TEST_S:-120} ./.gpu/flashmsa_gpu_tests --gtest_filter='Fp8Selection.*:Segments.SmallSelectRowsEqualWholeCall:Given.*:Proxy.GivenWithEmptyRows:Proxy.FmsaVarlenRecomputedLse' \
    > "$OUT/fp8/gtest.log" 2>&1; echo "fp8 GPU tests rc=$?"
  grep -E "^\[  (PASSED|FAILED)|FAILED  \]|slots where|proxy_lse" "$OUT/fp8/gtest.log" | tail -24
  timeout ${FP8_MEMCHECK_S:-90} compute-sanitizer --tool memcheck --error-exitcode 1 ./.gpu/flashmsa_gpu_tests \
    --gtest_filter='Fp8Selection.SmallTopk40Hpk2:Given.SmallOdd:Segments.SmallSelectRowsEqualWholeCall' \
    > "$OUT/fp8/memcheck.log" 2>&1; echo "memcheck (fp8, union walk) rc=$?"; tail -1 "$OUT/fp8/memcheck.log"
  FLASHMSA_BUILD_DIR=.gpu timeout 60 python3 -m pytest -q tests/python/test_fp8_selection.py > "$OUT/fp8/pytest.log" 2>&1
  echo "pytest (fp8) rc=$?"; tail -3 "$OUT/fp8/pytest.log"
  if [ "${FP8_BENCH_S:-240}" != 0 ]; then  # 0: no bench here (e.g. the long step runs with --fp8)
    FLASHMSA_BUILD_DIR=.gpu PYTHONUNBUFFERED=1 timeout ${FP8_BENCH_S:-240} python3 bench/long_context.py --out "$OUT/fp8" --fp8 \
      ${FP8_ARGS:---configs m3 --seqlens 1048576,131072} > "$OUT/fp8/bench.txt" 2>&1; echo "long_context --fp8 rc=$?"
    grep -E '^\| [0-9]{4}-' "$OUT/fp8/long_context.md" 2>/dev/null | tail -4
  fi
fi
if has wgmma; then
  stamp "wgmma probe"
  timeout 120 ./.gpu/flashmsa_wgmma_probe | tee "$OUT/wgmma.txt"
fi
if has megatron; then
  stamp "Megatron-Core"
  mkdir -p "$OUT/megatron"; M=/tmp/flashmsa-megatron; rm -rf "$M"
  python3 -m pip install --quiet --no-index --no-deps --target "$M" .gpu_pack/megatron_core-*.whl .gpu_pack/packaging-*.whl
  echo "megatron-core install rc=$?"
  if [ "${MG_PYTEST:-1}" = 1 ]; then
    PYTHONPATH="$M" FLASHMSA_BUILD_DIR=$PWD/.gpu timeout 200 python3 -m pytest -q -rs -s tests/python/test_megatron.py \
      -k cuda > "$OUT/megatron/pytest.log" 2>&1; echo "pytest (Megatron, GPU) rc=$?"
    grep -E "distributed optimizer|passed|failed|Error" "$OUT/megatron/pytest.log" | tail -5
  fi
  PYTHONPATH="$M" FLASHMSA_BUILD_DIR=$PWD/.gpu PYTHONUNBUFFERED=1 timeout ${MG_S:-540} python3 examples/megatron_gpt.py \
    --preset h200 --out "$OUT/megatron" ${MG_ARGS:---index-share 2} > "$OUT/megatron/log.txt" 2>&1
  echo "example rc=$?"
  grep -E "^\[|final|attention|IndexShare|Error" "$OUT/megatron/log.txt" | tail -30
fi
stamp "done"
