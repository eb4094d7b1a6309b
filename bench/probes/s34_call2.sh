#!/usr/bin/env bash
# Prepared in session 33 (after s34_first_call.sh, same pack): the fused backward's items in groups of neighbouring
# key blocks of one proxy head (bench/probes/bwd-item-span{4,8}.patch, built with
# `bash scripts/patch_variant.sh span4 bench/probes/bwd-item-span4.patch` and span8 likewise; docs/kernels/bwd.md
# "Session 33", Next). Today's order hands out a block's proxy heads one after another, so CTAs that start together
# walk unrelated lists; in groups, blocks that the same tokens select start side by side and walk alike lists at one
# pace, so a token's gathered rows and dq adds meet in the L2. Bound by session 27-28's probes: ~4-5% clustered, ~0
# random. Tests of both (15 backward tests, one after the other), the A/B alternated by round, m3 128k, the README call.
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
F='Bwd.SmallSparse:Bwd.FmsaVarlenOddLengthsPoisonedWorkspace:Bwd.G1Topk32:Proxy.SmallSparse:Proxy.Gcd3PaddedHeadSlots:Proxy.DqStoreFirstM3:Proxy.LongSegment:Proxy.SegmentedLists:Kl.SmallSparseG1:Kl.M3Sparse:Kl.SegmentedSparse:Deterministic.SmallSparse:Deterministic.M3Sparse:Graph.TrainingStepCaptureReplay'
for v in span4 span8; do
  stamp "$v-tests"
  timeout 150 ./.gpu/flashmsa_gpu_tests_$v --gtest_filter="$F" > "$R/$v-tests.log" 2>&1
  echo "$v tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$R/$v-tests.log" | head
done
stamp ab
OUT0=$OUT; OUT=$R
for args in "--config m3 --seqlens 32768 --patterns clustered --iters 20" "--config m3 --seqlens 32768 --patterns random --iters 20" \
            "--config fmsa --seqlens 16384 --patterns clustered --iters 100"; do
  bench_variants "$args" 2 def:flashmsa_bench: span4:flashmsa_bench_span4: span8:flashmsa_bench_span8:
done
bench_variants "--config m3 --seqlens 131072 --patterns clustered --iters 10" 1 def:flashmsa_bench: span4:flashmsa_bench_span4: \
  span8:flashmsa_bench_span8:
stamp user
user_ab 1 $((SECONDS + 120)) "" _span4 _span8
OUT=$OUT0
stamp done
tar -czf "$OUT/s34-call2.tgz" -C "$R" . && rm -rf "$R"
