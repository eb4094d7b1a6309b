"""SPEC.md section 1 in eager torch: selection, sparse/dense/given forward, kl. Autograd gives
the backward with the spec's conventions: the teacher is detached (dz = g/N (s - t)), so the main
q, k, v get no gradient from kl, and qp, kp get none from out (they only pick integer blocks).

Same signatures as flashmsa.msa_attention / msa_select, so either can stand in for the other.
Dense [H, L, L] masks per sequence: meant for tests and small models. Computes in fp32 (fp64
for fp64 inputs) and rounds out to the input dtype once, under torch.autocast too (autocast
would run the einsums in bf16: the public functions switch it off for their own math).
"""
from __future__ import annotations

import contextlib
import functools
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

BLOCK_SIZE = 128
Tensor = torch.Tensor
_NEG_INF = float("-inf")


def _exact(fn):
    """Runs fn with autocast off on every device type that has it on (the reference computes in
    the dtype it chooses, whatever the caller's autocast region)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for dev in ("cpu", "cuda"):
                if torch.is_autocast_enabled(dev):
                    stack.enter_context(torch.autocast(dev, enabled=False))
            return fn(*args, **kwargs)
    return wrapper


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _spans(x: Tensor, cu_seqlens: Optional[Tensor]) -> Tuple[List[Tuple[int, int]], int]:
    """(start, end) of every sequence and total tokens; batched [B, S, ...] is B spans of S."""
    if x.dim() == 4:
        if cu_seqlens is not None:
            raise ValueError("reference: cu_seqlens must be None for batched [B, S, H, D] inputs")
        B, S = x.shape[:2]
        return [(b * S, (b + 1) * S) for b in range(B)], B * S
    if cu_seqlens is None:
        raise ValueError("reference: cu_seqlens is required for varlen [total, H, D] inputs")
    cu = [int(c) for c in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != x.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"reference: bad cu_seqlens {cu} for total = {x.shape[0]}")
    return list(zip(cu, cu[1:])), x.shape[0]


def _flat(x: Optional[Tensor]) -> Optional[Tensor]:
    """[B, S, H, D] -> [B*S, H, D]; varlen tensors and None pass through."""
    return x if x is None or x.dim() != 4 else x.flatten(0, 1)


def _safe_softmax(x: Tensor) -> Tuple[Tensor, Tensor]:
    """Softmax over the last dim and its log-normaliser; a row that is all -inf gives P = 0 and
    lse = -inf with finite (zero) gradients."""
    m = x.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x - m)
    s = e.sum(-1, keepdim=True)
    nonempty = s > 0
    s_safe = torch.where(nonempty, s, torch.ones_like(s))
    lse = torch.where(nonempty, m + torch.log(s_safe), torch.full_like(s, _NEG_INF))
    return e / s_safe, lse.squeeze(-1)


def _proxy_logits(qp: Tensor, kp: Tensor, proxy_scale: float, cdt: torch.dtype) -> Tensor:
    """z [Hp, L, L] (causal, -inf above the diagonal) of one sequence."""
    L, Hp = qp.shape[:2]
    kpx = kp.to(cdt).repeat_interleave(Hp // kp.shape[1], dim=1)
    z = proxy_scale * torch.einsum("iph,uph->piu", qp.to(cdt), kpx)
    causal = torch.ones(L, L, dtype=torch.bool, device=qp.device).tril()
    return z.masked_fill(~causal, _NEG_INF)


def _select_seq(z: Tensor, topk: int) -> Tensor:
    """indices [Hp, L, topk] of one sequence from its causal proxy logits z [Hp, L, L]."""
    Hp, L, _ = z.shape
    nb = (L + BLOCK_SIZE - 1) // BLOCK_SIZE
    score = F.pad(z.detach(), (0, nb * BLOCK_SIZE - L), value=_NEG_INF)
    score = score.view(Hp, L, nb, BLOCK_SIZE).amax(-1)  # max-pooled, -inf for blocks after l(i)
    dev = z.device
    local = torch.arange(L, device=dev) // BLOCK_SIZE
    score = score.masked_fill(torch.arange(nb, device=dev)[None] == local[:, None], float("inf"))
    if nb < topk:
        score = F.pad(score, (0, topk - nb), value=_NEG_INF)
    # stable descending sort: ties keep the lower block first; the local block (+inf) leads
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    n = torch.clamp(local + 1, max=topk)  # selected blocks per query
    slot = torch.arange(topk, device=dev)
    # slots 0..n-2: ranks 1..n-1 (non-local blocks by score); slot n-1: rank 0 (the local block)
    src = torch.where(slot[None] < (n - 1)[:, None], slot[None] + 1, torch.zeros_like(slot[None]))
    idx = order.gather(-1, src.expand(Hp, L, topk))
    return torch.where(slot[None] < n[:, None], idx, torch.full_like(idx, -1)).to(torch.int32)


def _key_mask(idx: Optional[Tensor], Hp: int, L: int, device) -> Tensor:
    """U_p(i) as a mask [Hp, L, L]; idx None means dense causal."""
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    if idx is None:
        return causal.expand(Hp, L, L)
    nb = (L + BLOCK_SIZE - 1) // BLOCK_SIZE
    idx = idx.long()
    valid = (idx >= 0) & (idx < nb)  # other values are empty slots
    blocks = torch.zeros(Hp, L, nb + 1, dtype=torch.bool, device=device)
    blocks.scatter_(-1, torch.where(valid, idx, torch.full_like(idx, nb)), True)
    keys_block = torch.arange(L, device=device) // BLOCK_SIZE
    return blocks[..., :nb][..., keys_block] & causal


@_exact
def msa_select(qp: Tensor, kp: Tensor, topk: int = 16, *, cu_seqlens: Optional[Tensor] = None,
               max_seqlen: Optional[int] = None, proxy_scale: Optional[float] = None,
               return_proxy_lse: bool = False):
    """Reference of flashmsa.msa_select (max_seqlen is accepted and ignored)."""
    spans, total = _spans(qp, cu_seqlens)
    qpf, kpf = _flat(qp), _flat(kp)
    Hp, Dp = qpf.shape[1:]
    ps = proxy_scale or Dp ** -0.5
    cdt = _compute_dtype(qp)
    idx = torch.full((Hp, total, topk), -1, dtype=torch.int32, device=qp.device)
    plse = torch.full((Hp, total), _NEG_INF, dtype=cdt, device=qp.device)
    for s0, s1 in spans:
        if s1 == s0:
            continue
        z = _proxy_logits(qpf[s0:s1], kpf[s0:s1], ps, cdt)
        sel = _select_seq(z, topk)
        idx[:, s0:s1] = sel
        plse[:, s0:s1] = _safe_softmax(z.masked_fill(~_key_mask(sel, Hp, s1 - s0, qp.device), _NEG_INF))[1]
    stat = torch.float64 if qp.dtype == torch.float64 else torch.float32
    return (idx, plse.to(stat)) if return_proxy_lse else idx


@_exact
def msa_attention(q: Tensor, k: Tensor, v: Tensor, qp: Optional[Tensor] = None,
                  kp: Optional[Tensor] = None, topk: int = 16, *,
                  cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None,
                  warmup: bool = False, indices: Optional[Tensor] = None,
                  softmax_scale: Optional[float] = None, proxy_scale: Optional[float] = None,
                  compute_kl: Optional[bool] = None, return_lse: bool = False,
                  return_indices: bool = False, numerics: Optional[str] = None,
                  validate: bool = False):
    """Reference of flashmsa.msa_attention; same arguments and return convention. compute_kl
    None or True gives the kl value, False the zero placeholder (same gradient). numerics and
    validate are accepted and ignored (the reference is exact and checks nothing more)."""
    spans, total = _spans(q, cu_seqlens)
    qf, kf, vf, qpf, kpf = _flat(q), _flat(k), _flat(v), _flat(qp), _flat(kp)
    Hq, D = qf.shape[1:]
    Hkv = kf.shape[1]
    has_proxy = qp is not None
    if warmup and indices is not None:
        raise ValueError("reference: indices must be None with warmup=True")
    if not has_proxy and not warmup and indices is None:
        raise ValueError("reference: qp and kp are required in sparse mode")
    Hp = qpf.shape[1] if has_proxy else indices.shape[0] if indices is not None else Hq
    G = Hq // Hp
    scale = softmax_scale or D ** -0.5
    ps = proxy_scale or (qpf.shape[2] ** -0.5 if has_proxy else 1.0)
    cdt = _compute_dtype(q)
    dev = q.device

    outs, lses, kl_sum = [], [], torch.zeros((), dtype=cdt, device=dev)
    idx_all = None
    if indices is None and not warmup:
        idx_all = torch.full((Hp, total, topk), -1, dtype=torch.int32, device=dev)
    for s0, s1 in spans:
        L = s1 - s0
        if L == 0:
            continue
        z = _proxy_logits(qpf[s0:s1], kpf[s0:s1], ps, cdt) if has_proxy else None
        if warmup:
            sel = None
        elif indices is None:
            sel = _select_seq(z, topk)
            idx_all[:, s0:s1] = sel
        else:
            sel = indices[:, s0:s1]
        mask = _key_mask(sel, Hp, L, dev)  # [Hp, L, L]
        mask_h = mask.repeat_interleave(G, dim=0)  # [Hq, L, L]
        kx = kf[s0:s1].to(cdt).repeat_interleave(Hq // Hkv, dim=1)
        vx = vf[s0:s1].to(cdt).repeat_interleave(Hq // Hkv, dim=1)
        x = scale * torch.einsum("ihd,uhd->hiu", qf[s0:s1].to(cdt), kx)
        P, lse = _safe_softmax(x.masked_fill(~mask_h, _NEG_INF))
        outs.append(torch.einsum("hiu,uhd->ihd", P, vx))
        lses.append(lse)
        if has_proxy:
            t = P.detach().view(Hp, G, L, L).mean(1)  # teacher
            zm = z.masked_fill(~mask, _NEG_INF)
            _, plse = _safe_softmax(zm)
            log_s = zm - plse[..., None]
            pos = t > 0
            log_t = torch.where(pos, t, torch.ones_like(t)).log()
            kl_sum = kl_sum + torch.where(pos, t * (log_t - log_s), torch.zeros_like(t)).sum()

    out = torch.cat(outs, 0) if outs else qf.new_zeros((0, Hq, vf.shape[2]), dtype=cdt)
    out = out.to(q.dtype).reshape(q.shape)
    lse = torch.cat(lses, 1) if lses else torch.zeros((Hq, 0), dtype=cdt, device=dev)
    stat = torch.float64 if q.dtype == torch.float64 else torch.float32
    N = Hp * total
    kl = kl_sum / N if N and has_proxy else torch.zeros((), dtype=cdt, device=dev)
    if compute_kl is False:
        kl = kl - kl.detach()  # zero value, same gradient
    result = [out, kl.to(stat)]
    if return_lse:
        result.append(lse.to(stat))
    if return_indices:
        result.append(idx_all if indices is None and not warmup else indices)
    return tuple(result)


@_exact
def attention_mass_recall(q: Tensor, k: Tensor, indices: Tensor, *, cu_seqlens: Optional[Tensor] = None,
                          softmax_scale: Optional[float] = None, rows: Optional[Tensor] = None) -> Tensor:
    """Share of the dense causal attention mass of the main heads that falls inside the selected
    key sets (1.0: the selection loses nothing), averaged over (query head, token).

    indices [Hp, total, topk] as msa_select returns them; rows: an optional bool mask [total] of
    the tokens to average over (e.g. the positions whose answer lies far back)."""
    spans, total = _spans(q, cu_seqlens)
    qf, kf = _flat(q), _flat(k)
    Hq, D = qf.shape[1:]
    Hp = indices.shape[0]
    scale = softmax_scale or D ** -0.5
    cdt = _compute_dtype(q)
    recall = torch.zeros(Hq, total, dtype=cdt, device=q.device)
    with torch.no_grad():
        for s0, s1 in spans:
            L = s1 - s0
            if L == 0:
                continue
            kx = kf[s0:s1].to(cdt).repeat_interleave(Hq // kf.shape[1], dim=1)
            x = scale * torch.einsum("ihd,uhd->hiu", qf[s0:s1].to(cdt), kx)
            causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
            P, _ = _safe_softmax(x.masked_fill(~causal, _NEG_INF))
            mask = _key_mask(indices[:, s0:s1], Hp, L, q.device).repeat_interleave(Hq // Hp, dim=0)
            recall[:, s0:s1] = (P * mask).sum(-1)
    if rows is not None:
        recall = recall[:, rows.reshape(-1)]
    return recall.mean()
