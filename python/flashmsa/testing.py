"""Helpers for tests and checks: the reference head configurations, seeded inputs, metrics."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

# SPEC.md's reference configurations (D = Dp = 128 on the GPU).
CONFIGS = {
    "m3": dict(Hq=64, Hkv=4, Hp=4, Hpk=1, topk=16),  # MiniMax-M3
    "fmsa": dict(Hq=16, Hkv=2, Hp=4, Hpk=1, topk=16),  # flash-msa's default
}


def make_inputs(*, lengths: Optional[Sequence[int]] = None, batch: Optional[int] = None,
                seqlen: Optional[int] = None, Hq: int = 4, Hkv: int = 2, Hp: int = 2, Hpk: int = 1,
                D: int = 16, Dp: int = 16, dtype=torch.float64, device="cpu",
                requires_grad: bool = False, seed: int = 0, proxy_gain: float = 1.0) -> dict:
    """Fresh random inputs: varlen (lengths) or batched (batch, seqlen). Returns a dict with
    q, k, v, qp, kp and, for varlen, cu_seqlens and max_seqlen. proxy_gain scales qp (a larger
    gain makes the block scores more distinct)."""
    g = torch.Generator().manual_seed(seed)
    if lengths is not None:
        lead = (sum(lengths),)
    else:
        lead = (batch, seqlen)

    def rnd(h, d, gain=1.0):
        x = (torch.randn(*lead, h, d, generator=g, dtype=torch.float64) * gain).to(dtype=dtype, device=device)
        return x.requires_grad_(requires_grad)

    r = dict(q=rnd(Hq, D), k=rnd(Hkv, D), v=rnd(Hkv, D), qp=rnd(Hp, Dp, proxy_gain), kp=rnd(Hpk, Dp))
    if lengths is not None:
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0).to(torch.int32)
        r["cu_seqlens"] = cu.to(device)
        r["max_seqlen"] = max(lengths) if lengths else 0
    return r


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 over the entries where b is finite (a must be finite exactly
    there: -inf lse rows must match)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin):
        return float("inf")
    den = b[fin].norm().item()
    return (a[fin] - b[fin]).norm().item() / max(den, 1e-300)


def block_scores(qp: torch.Tensor, kp: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                 proxy_scale: Optional[float] = None) -> list:
    """Per sequence, the fp64 block scores [Hp, L, nb] (max-pooled causal proxy logits), for
    comparing selections with a tolerance for near-ties."""
    from . import reference as R

    spans, _ = R._spans(qp, cu_seqlens)
    qpf, kpf = R._flat(qp), R._flat(kp)
    ps = proxy_scale or qpf.shape[-1] ** -0.5
    res = []
    for s0, s1 in spans:
        L = s1 - s0
        if L == 0:
            res.append(None)
            continue
        z = R._proxy_logits(qpf[s0:s1].double(), kpf[s0:s1].double(), ps, torch.float64)
        nb = (L + R.BLOCK_SIZE - 1) // R.BLOCK_SIZE
        z = torch.nn.functional.pad(z, (0, nb * R.BLOCK_SIZE - L), value=float("-inf"))
        res.append(z.view(z.shape[0], L, nb, R.BLOCK_SIZE).amax(-1))
    return res


def selection_mismatches(got: torch.Tensor, want: torch.Tensor, qp, kp, cu_seqlens=None,
                         proxy_scale=None, rtol: float = 1e-3) -> tuple:
    """Compares two selections as sets (SPEC section 4). Returns (rows that differ, rows that
    differ beyond the tie tolerance: a block chosen by one and not the other whose fp64 score is
    not within rtol of the weakest block the reference chose)."""
    from . import reference as R

    spans, _ = R._spans(qp, cu_seqlens)
    scores = block_scores(qp, kp, cu_seqlens, proxy_scale)
    got, want = got.cpu().long(), want.cpu().long()
    differ = bad = 0
    for (s0, s1), sc in zip(spans, scores):
        if sc is None:
            continue
        sc = sc.cpu()
        g, w = got[:, s0:s1], want[:, s0:s1]
        nb = sc.shape[-1]

        def as_mask(ix):
            ix = torch.where((ix >= 0) & (ix < nb), ix, torch.full_like(ix, nb))
            return torch.zeros(*ix.shape[:2], nb + 1, dtype=torch.bool).scatter_(-1, ix, True)[..., :nb]

        gm, wm = as_mask(g), as_mask(w)
        rows = (gm != wm).any(-1)
        differ += int(rows.sum())
        if rows.any():
            # the weakest non-local block the reference chose, per row
            local = (torch.arange(s1 - s0) // R.BLOCK_SIZE)[None, :, None]
            chosen = wm & (torch.arange(nb)[None, None] != local)
            thr = torch.where(chosen, sc, torch.full_like(sc, float("inf"))).amin(-1, keepdim=True)
            tie = torch.isfinite(thr) & ((sc - thr).abs() <= rtol * thr.abs())
            bad += int(((gm ^ wm) & ~tie).any(-1).sum())
    return differ, bad


def cuda_ready() -> bool:
    """True when torch sees a CUDA device and the loaded libflashmsa has its CUDA backend (the
    GPU tests' skip condition)."""
    import flashmsa
    if not torch.cuda.is_available():
        return False
    try:
        return flashmsa.cuda_available()
    except OSError:
        return False
