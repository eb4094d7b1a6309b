#!/usr/bin/env bash
# Session 39, call 7: the GPU tests of the backward's host routing on the session's head (79624d5's mend, host only:
# bwd_layout reads the proxy side once, the main-only launch takes fused_scratch; not run on the GPU in session 38).
OUT=${OUT:-/tmp/out}
source bench/probes/callkit.sh
call_open
stamp tests
gtest_run gpu-tests-routing-s39.log 330 flashmsa_gpu_tests 'Bwd.*:Given.*:Workspace.*:Graph.*:Kl.Small*:Proxy.Small*'
stamp done
call_close s39-call7
