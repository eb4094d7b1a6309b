#!/usr/bin/env bash
# Session 38, call 2 (build: `bash scripts/pack_gpu.sh --from-build`, carry [".gpu_pack"]), on the shipped build with the
# forward's dense kl in the fused kernel:
# 1. the 39 GPU tests of bench/probes/s38_suite_rest_filter.txt that call 1 did not reach (its process was cut at
#    380 s; the other 39 passed there): bench/probes/s38_call2_filter.txt;
# 2. memcheck on the two backward tests without proxy tensors and the forward's dense segmented kl;
# 3. flashmsa_bench with its options at m3 32k clustered and fmsa 16k (the new dense_bwd_deterministic_ms: the warmup
#    backward under torch.use_deterministic_algorithms, which keeps the standalone and recomputing proxy kernels).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp suite-rest2
gtest_run gpu-suite-rest2.log 400 flashmsa_gpu_tests "$(cat bench/probes/s38_call2_filter.txt)"
echo "last test started: $(grep '^\[ RUN' "$OUT/gpu-suite-rest2.log" | tail -1)"
stamp memcheck
timeout 90 compute-sanitizer --tool memcheck --error-exitcode 3 ./.gpu/flashmsa_gpu_tests \
  --gtest_filter='Bwd.GivenNoProxyTensors:Bwd.DenseNoProxyTensors:Kl.DenseSegmentedLists' > "$OUT/memcheck-noproxy.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck-noproxy.log" | head -3
stamp bench
for args in "--config m3 --seqlens 32768 --patterns clustered --iters 10" "--config fmsa --seqlens 16384 --patterns clustered --iters 30"; do
  [ $SECONDS -lt 540 ] || { echo "skipped (time)"; continue; }
  tag=$(echo "$args" | awk '{print $2"-"$4}')
  timeout 100 ./.gpu/flashmsa_bench $args > "$OUT/bench-opts-$tag.json" 2>&1
  python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); g=r.get; print(sys.argv[2], 'bwd', g('bwd_ms'), 'det', g('bwd_deterministic_ms'), 'dense_bwd', g('dense_bwd_ms'), 'dense_det', g('dense_bwd_deterministic_ms'), 'dense_fwd', g('dense_fwd_ms'))" "$OUT/bench-opts-$tag.json" "$tag" 2>&1 | tail -1
done
stamp done
