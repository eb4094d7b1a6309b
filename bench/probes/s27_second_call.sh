#!/usr/bin/env bash
# The next session's second device call (prepared in session 26; after s27_first_call.sh, the same .gpu_pack), ~450 s:
# the GPU tests of the variants that the first call found faster (VARS, default all three), with memcheck of dz's small
# backward cases. Ship a variant only with its tests green, then the whole suite on the shipped build.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
VARS=${VARS:-"dz si cm"} AB=0 TESTS=1 BUDGET_S=570 \
  TESTS_dz='Bwd.*:Kl.*:Deterministic.*:Proxy.Small*:Proxy.G*:Proxy.M3Batched:Proxy.DenseWarmup:Given.*:Numerics.Precise*' \
  TESTS_S_dz=200 MEMCHECK_dz='Bwd.Small*:Deterministic.SmallSparse:Proxy.SmallSparse:Proxy.SmallDense' \
  TESTS_si='Graph.*:Bwd.Small*:Bwd.GivenWithEmptyRows:Bwd.DenseVarlen:Proxy.Small*:Deterministic.SmallSparse:Kl.Small*' \
  TESTS_S_si=90 \
  TESTS_cm='Persistent.*:Routes.*:Regroup.*:Sparse.*:Given.*' TESTS_S_cm=150 MEMCHECK_cm='Persistent.FourMaskWords' \
  RACECHECK_cm='Persistent.FewTiles' OUT=$OUT bash bench/probes/ab_multi.sh
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
