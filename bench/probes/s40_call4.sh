#!/usr/bin/env bash
# Session 40, call 4: the five GPU tests that call 3's four side-by-side shards did not reach before their 470 s cut
# (shard 2, slowed by the other three), in one process. carry [".gpu_pack"].
OUT=${OUT:-/tmp/out}
source bench/probes/callkit.sh
call_open
stamp rest
gtest_run gpu-suite-rest5.log 420 flashmsa_gpu_tests \
  'Metadata.SmallFuzz:Metadata.SmallTableStatusInHostMemory:Persistent.FmsaOneBuffer:Regroup.EveryPathK16Nt8:Regroup.M3Varlen' 'OK \]'
stamp done
call_close s40-call4
