"""Session 27: the SM clock under cuDNN's dense fwd+bwd (m3 32k, causal, GQA; run_bench.py's peer), to compare with
flashmsa's step under the 700 W cap. Runs the step 30 times (one timed event pair each, as run_bench.py's median) and
prints the median; run it with nvidia-smi sampling beside it (bench/probes/s27_cudnn_clock.sh)."""
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

T, D, Hq, Hkv = 32768, 128, 64, 4
q = torch.randn(1, Hq, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(1, Hkv, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(1, Hkv, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
do = torch.randn(1, Hq, T, D, device="cuda", dtype=torch.bfloat16)
times = []
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    for i in range(33):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.backward(do)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b))
times.sort()
print(f"cudnn step m3 32k: median {times[len(times) // 2]:.2f} ms, min {times[0]:.2f}, max {times[-1]:.2f} "
      f"(30 steps, end {time.strftime('%H:%M:%S')})")
sys.stdout.flush()
