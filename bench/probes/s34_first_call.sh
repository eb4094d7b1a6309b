#!/usr/bin/env bash
# Prepared in session 33 for the next session's first call (carry [".gpu_pack"]). The pack (built at the end of session
# 33 from its last tree; rebuild if .gpu_pack is missing) holds the tree's build and four variants for s34_call2.sh:
#   bash scripts/patch_variant.sh span4 bench/probes/bwd-item-span4.patch   (span8, late: bwd-st3-late-barrier.patch,
#   nobar: bwd-st3-no-barrier-control.patch likewise), then bash scripts/pack_gpu.sh --from-build.
# This call: the 41 GPU tests that session 33's call 3 did not reach on
# the three-stage backward (docs/kernels/bwd.md "Session 33"), in one process (six side-by-side shards slowed one
# another past their limit), then the README call once. Next: s34_call2.sh (same pack). Logs in $OUT.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp rest
timeout 420 ./.gpu/flashmsa_gpu_tests --gtest_filter='Bwd.FmsaBatchedFp16:Bwd.M3SparseDlse:Deterministic.BatchedFp16:Deterministic.DenseFp16:Deterministic.FmsaOutlierKeys:Deterministic.FmsaVarlen:Deterministic.M3Sparse:Deterministic.SmallBrokenLseGivesNan:Deterministic.Topk32:Errors.BadBwdDqKnob:Errors.BadRegroupKnob:Errors.BadRingsKnob:Errors.MisalignedWorkspace:Errors.UnsupportedHeadDim:FixedPoint.UnitKeepsSumsBelowLimit:Graph.SparseForwardCaptureReplay:Kl.DenseWithoutProxyLseOutput:Kl.GivenWithoutProxyLseOutput:Kl.SegmentedSparse:Metadata.PageableStatusRefused:Metadata.SmallBatchedMaxSeqlen:Metadata.SmallFuzz:Metadata.SmallTableStatusInDeviceMemory:Metadata.SmallTableStatusInHostMemory:Numerics.LazyThresholdFailsOrderInvariance:Numerics.PreciseDpsumBySelfWeight:Numerics.PreciseDpsumWithOutLo:Persistent.FewTiles:Persistent.FmsaOneBuffer:Persistent.M3Dense:Persistent.M3TwoBuffers:Proxy.SegmentedLists:Regroup.EveryPathK16Nt8:Regroup.EveryPathK64Nt32:Regroup.FmsaTopk64:Regroup.Gcd3NotApplied:Regroup.M3Varlen:Routes.FmsaInferFp16:Routes.Gcd3Straddle:Routes.M3Varlen:Workspace.BwdDqRule' > "$OUT/gpu-suite-rest-s34.log" 2>&1
echo "rest rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]|tests ran" "$OUT/gpu-suite-rest-s34.log" | head
stamp user
user_ab 1 $((SECONDS + 60)) ""
stamp done
