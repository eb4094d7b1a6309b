#!/usr/bin/env bash
# Session 39, call 4: the ~0.8 ms between bstl2 and nbulk (call 3) - the hand-off or the bytes? early: the writer hands
# the dQ tile back without waiting for the engine's read (bench/probes/bwd-dq-early-handback-s39.patch); npub: the
# store-first writer publishes its first stores without waiting for their completion
# (bench/probes/bwd-dq-publish-nowait-s39.patch); both timing only (wrong dq). Built with scripts/probe_variant.sh
# (TU bwd_fused_bf16), packed by scripts/pack_gpu.sh.
OUT=${OUT:-/tmp/out}
source bench/probes/callkit.sh
call_open
stamp ab
bench_std 2 400 flashmsa_bench flashmsa_bench_early flashmsa_bench_npub flashmsa_bench_nbulk
stamp done
call_close s39-call4
