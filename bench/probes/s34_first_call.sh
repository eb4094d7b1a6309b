#!/usr/bin/env bash
# Prepared in session 33 for the next session's first call (carry [".gpu_pack"] after
# `bash scripts/pack_gpu.sh --from-build`, the tree's build): the 41 GPU tests that session 33's call 3 did not reach on
# the three-stage backward (docs/kernels/bwd.md "Session 33"), in one process (six side-by-side shards slowed one
# another past their limit), then the README call twice. Logs in $OUT.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp rest
timeout 420 ./.gpu/flashmsa_gpu_tests --gtest_filter='Bwd.FmsaBatchedFp16:Bwd.M3SparseDlse:Deterministic.BatchedFp16:Deterministic.DenseFp16:Deterministic.FmsaOutlierKeys:Deterministic.FmsaVarlen:Deterministic.M3Sparse:Deterministic.SmallBrokenLseGivesNan:Deterministic.Topk32:Errors.BadBwdDqKnob:Errors.BadRegroupKnob:Errors.BadRingsKnob:Errors.MisalignedWorkspace:Errors.UnsupportedHeadDim:FixedPoint.UnitKeepsSumsBelowLimit:Graph.SparseForwardCaptureReplay:Kl.DenseWithoutProxyLseOutput:Kl.GivenWithoutProxyLseOutput:Kl.SegmentedSparse:Metadata.PageableStatusRefused:Metadata.SmallBatchedMaxSeqlen:Metadata.SmallFuzz:Metadata.SmallTableStatusInDeviceMemory:Metadata.SmallTableStatusInHostMemory:Numerics.LazyThresholdFailsOrderInvariance:Numerics.PreciseDpsumBySelfWeight:Numerics.PreciseDpsumWithOutLo:Persistent.FewTiles:Persistent.FmsaOneBuffer:Persistent.M3Dense:Persistent.M3TwoBuffers:Proxy.SegmentedLists:Regroup.EveryPathK16Nt8:Regroup.EveryPathK64Nt32:Regroup.FmsaTopk64:Regroup.Gcd3NotApplied:Regroup.M3Varlen:Routes.FmsaInferFp16:Routes.Gcd3Straddle:Routes.M3Varlen:Workspace.BwdDqRule' > "$OUT/gpu-suite-rest-s34.log" 2>&1
echo "rest rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]|tests ran" "$OUT/gpu-suite-rest-s34.log" | head
stamp user
user_ab 2 $((SECONDS + 170)) ""
stamp done
