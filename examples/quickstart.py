#!/usr/bin/env python3
"""The README's call, runnable: MSA over two packed sequences, a task loss, the backward.

    python3 examples/quickstart.py          # on the GPU in bf16 when flashmsa's CUDA backend sees one
    python3 examples/quickstart.py --cpu    # on the CPU in fp32 (a few seconds)

The kl term trains the proxy (qp, kp): add it to the loss. Its value is formed by the backward, so
kl reads NaN until loss.backward() has run: log kl.item() after the backward (docs/python.md).
"""
import argparse
import pathlib
import sys

import torch

try:
    import flashmsa
except ImportError:  # run from a checkout that is not installed: the source tree's package
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))
    import flashmsa


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU is there")
    args = parser.parse_args(argv)
    gpu = not args.cpu and torch.cuda.is_available() and flashmsa.cuda_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    torch.manual_seed(0)

    # flash-msa's default heads (docs/semantics.md): 16 query heads, 2 key/value heads, 4 proxy
    # heads sharing one proxy key head; head_dim 128 (what the CUDA kernels are built for).
    Hq, Hkv, Hp, Hpk, D = 16, 2, 4, 1, 128
    lengths = [300, 500]  # two sequences packed along dim 0 (varlen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    total, S = sum(lengths), max(lengths)

    def inputs(heads):
        return torch.randn(total, heads, D, device=device, dtype=dtype, requires_grad=True)

    q, k, v, qp, kp = inputs(Hq), inputs(Hkv), inputs(Hkv), inputs(Hp), inputs(Hpk)
    out, kl = flashmsa.msa_attention(q, k, v, qp, kp, topk=4, cu_seqlens=cu, max_seqlen=S)
    task = out.float().pow(2).mean()  # a stand-in for the model's loss
    (task + kl).backward()  # kl's gradient reaches only qp and kp: it trains the proxy

    print(f"flashmsa {flashmsa.version()} on {device} ({dtype}), library {flashmsa.library_path()}")
    print(f"out {tuple(out.shape)}  |out| = {out.float().norm():.4f}")
    print(f"task loss {task.item():.6f}   kl {kl.item():.6f} (read after the backward)")
    for name, t in (("q", q), ("k", k), ("v", v), ("qp", qp), ("kp", kp)):
        print(f"|d{name}| = {t.grad.float().norm():.4e}")
    assert torch.isfinite(out).all() and kl.item() >= 0
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v, qp, kp))
    return {"device": device, "task": task.item(), "kl": kl.item()}


if __name__ == "__main__":
    main()
