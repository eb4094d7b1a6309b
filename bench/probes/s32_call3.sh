#!/usr/bin/env bash
# Session 32, call 3: part 1 of the whole GPU suite on the default build (Workspace.*:Proxy.*:Kl.*:Given.*; call 1 ran
# it on the nomask candidate), then the README call at m3 32k clustered with cuDNN beside it (carry .gpu_pack).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
source bench/probes/callkit.sh
stamp suite-1
timeout 400 ./.gpu/flashmsa_gpu_tests --gtest_filter='Workspace.*:Proxy.*:Kl.*:Given.*' > "$OUT/gpu-suite-1.log" 2>&1
echo "suite-1 rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$OUT/gpu-suite-1.log" | head
stamp user
user_ab 1 500 ""
stamp done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
