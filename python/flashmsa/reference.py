"""SPEC.md section 1 in eager torch: selection, sparse/dense/given forward, kl. Autograd gives
the backward with the spec's conventions: the teacher is detached (dz = g/N (s - t)), so the main
q, k, v get no gradient from kl, and qp, kp get none from out (they only pick integer blocks).

Same signatures as flashmsa.msa_attention / msa_select, so either can stand in for the other,
and the same checks (SPEC section 2, docs/errors.md): argument types and ranges, shapes and head
ratios, cu_seqlens and max_seqlen, and the given-indices rules (a block repeated in a row is an
error; with validate=True so is a value outside [0, blocks) other than -1). The one difference:
any strides are fine here (the library needs a contiguous last dimension).
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

from . import ops as _ops

BLOCK_SIZE = 128
_R = "flashmsa.reference"
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


def _spans(x: Tensor, cu_seqlens: Optional[Tensor], max_seqlen=None) -> Tuple[List[Tuple[int, int]], int]:
    """(start, end) of every sequence and total tokens; batched [B, S, ...] is B spans of S.
    cu_seqlens and a given max_seqlen are checked as the library checks them."""
    if x.dim() == 4:
        if cu_seqlens is not None:
            raise ValueError(f"{_R}: cu_seqlens: must be None for batched [B, S, H, D] inputs")
        _ops._max_seqlen(x, None, max_seqlen)  # None, 0 or S
        B, S = x.shape[:2]
        return [(b * S, (b + 1) * S) for b in range(B)], B * S
    if cu_seqlens is None:
        raise ValueError(f"{_R}: cu_seqlens: is required for varlen [total, H, D] inputs")
    if max_seqlen is not None:
        max_seqlen = _ops._int("max_seqlen", max_seqlen, 0, _ops.INT32_MAX)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{_R}: cu_seqlens: expected 1 dimension [B+1] with B >= 0, got {list(cu_seqlens.shape)}")
    cu = [int(c) for c in cu_seqlens.tolist()]
    total = x.shape[0]
    if cu[0] != 0:
        raise ValueError(f"{_R}: cu_seqlens: expected cu_seqlens[0] = 0, got {cu[0]}")
    for b in range(len(cu) - 1):
        if cu[b + 1] < cu[b]:
            raise ValueError(f"{_R}: cu_seqlens: expected non-decreasing values, got cu_seqlens[{b + 1}] = "
                             f"{cu[b + 1]} < cu_seqlens[{b}] = {cu[b]}")
        if max_seqlen is not None and cu[b + 1] - cu[b] > max_seqlen:
            raise ValueError(f"{_R}: max_seqlen: expected >= every sequence length, got {max_seqlen} < "
                             f"length {cu[b + 1] - cu[b]} of sequence {b}")
    if cu[-1] != total:
        raise ValueError(f"{_R}: cu_seqlens: expected the last value to equal total = {total} (tokens in q), "
                         f"got {cu[-1]}")
    return list(zip(cu, cu[1:])), total


def _heads(name: str, t: Tensor, x: Tensor, want_h=None, want_d=None, hname="H", dname="D") -> Tuple[int, int]:
    """A per-token tensor like x (the library's shape rules): same token dims, heads and dim >= 1."""
    td = x.dim() - 2
    if tuple(t.shape[:td]) != tuple(x.shape[:td]):
        lead = "B, S" if td == 2 else "total"
        raise ValueError(f"{_R}: {name}: expected {lead} = {list(x.shape[:td])} (from {'q' if name != 'kp' else 'qp'}), "
                         f"got {list(t.shape)}")
    h, d = t.shape[-2], t.shape[-1]
    if h < 1 or d < 1:
        raise ValueError(f"{_R}: {name}: expected {hname} >= 1 and {dname} >= 1, got {list(t.shape)}")
    if want_h is not None and h != want_h:
        raise ValueError(f"{_R}: {name}: expected {hname} = {want_h}, got {h} in {list(t.shape)}")
    if want_d is not None and d != want_d:
        raise ValueError(f"{_R}: {name}: expected {dname} = {want_d}, got {d} in {list(t.shape)}")
    return h, d


def _ratio(a: int, an: str, b: int, bn: str) -> None:
    if a % b:
        raise ValueError(f"{_R}: heads: {an} ({a}) must be a multiple of {bn} ({b})")


def _check_indices(indices: Tensor, spans, Hp: int, validate: bool) -> None:
    """The given-indices rules: a valid block must not repeat in a row; with validate, a value
    outside [0, blocks of the sequence) other than -1 is an error too."""
    K = indices.shape[2]
    for b, (s0, s1) in enumerate(spans):
        if s1 == s0:
            continue
        nb = (s1 - s0 + BLOCK_SIZE - 1) // BLOCK_SIZE
        rows = indices[:, s0:s1].long()
        valid = (rows >= 0) & (rows < nb)
        if validate:
            bad = ~valid & (rows != -1)
            if bad.any():
                p, t, s = (int(i) for i in bad.nonzero()[0])
                raise ValueError(f"{_R}: indices: value {int(rows[p, t, s])} at (head {p}, token {s0 + t}, slot {s}) "
                                 f"is outside [0, {nb}), the blocks of sequence {b} (use -1 for an empty slot)")
        # invalid slots get distinct negative stand-ins, so only valid blocks can repeat
        keyed = torch.where(valid, rows, -2 - torch.arange(K, device=rows.device))
        srt = keyed.sort(-1).values
        dup = (srt[..., 1:] == srt[..., :-1]).any(-1)
        if dup.any():
            p, t = (int(i) for i in dup.nonzero()[0])
            row = rows[p, t]
            vals = [int(v) for v in row[valid[p, t]]]
            j = next(v for v in vals if vals.count(v) > 1)
            raise ValueError(f"{_R}: indices: block {j} repeats at (head {p}, token {s0 + t}); blocks must not "
                             f"repeat in a row")


def _check_attention(q, k, v, qp, kp, cu_seqlens, indices, max_seqlen, topk, warmup, softmax_scale,
                     proxy_scale, compute_kl, return_lse, return_indices, numerics, validate):
    """msa_attention's checks (the library's, SPEC section 2): returns (spans, total, Hp, topk,
    softmax_scale or None, proxy_scale or None)."""
    _ops._check_inputs(q, k, v, qp, kp, cu_seqlens, indices)
    topk, sm, px, _ = _ops._check_options(topk, warmup, softmax_scale, proxy_scale, compute_kl, return_lse,
                                          return_indices, numerics, validate)
    has_proxy = qp is not None
    if warmup and indices is not None:
        raise ValueError(f"{_R}: indices: must be None with warmup=True (dense mode selects nothing)")
    if not has_proxy and not warmup and indices is None:
        raise ValueError(f"{_R}: qp: qp and kp are required in sparse mode (they select the blocks)")
    Hq, D = _heads("q", q, q, hname="Hq")
    Hkv, _ = _heads("k", k, q, None, D, "Hkv")
    _heads("v", v, q, Hkv, D, "Hkv")
    Hp = Hq
    if has_proxy:
        Hp, Dp = _heads("qp", qp, q, hname="Hp", dname="Dp")
        Hpk, _ = _heads("kp", kp, qp, None, Dp, "Hpk", "Dp")
        _ratio(Hp, "Hp", Hpk, "Hpk")
    elif indices is not None:
        Hp = indices.shape[0]
        if Hp < 1:
            raise ValueError(f"{_R}: indices: expected Hp >= 1 rows, got {list(indices.shape)}")
    _ratio(Hq, "Hq", Hkv, "Hkv")
    _ratio(Hq, "Hq", Hp, "Hp")
    if compute_kl is True and not has_proxy:
        raise ValueError(f"{_R}: compute_kl: needs qp and kp")
    spans, total = _spans(q, cu_seqlens, max_seqlen)
    if indices is not None:
        K = indices.shape[2]
        if not 1 <= K <= _ops.L.MAX_TOPK:
            raise ValueError(f"{_R}: indices: expected 1 <= topk <= {_ops.L.MAX_TOPK} (its last dimension), got {K}")
        if indices.shape[0] != Hp or indices.shape[1] != total:
            raise ValueError(f"{_R}: indices: expected shape [{Hp}, {total}, {K}], got {list(indices.shape)}")
        _check_indices(indices, spans, Hp, validate)
    return spans, total, Hp, topk, sm or None, px or None


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
    """Reference of flashmsa.msa_select (with its checks)."""
    _ops._tensor("qp", qp)
    _ops._tensor("kp", kp)
    _ops._tensor("cu_seqlens", cu_seqlens, optional=True)
    if qp.dtype not in _ops._FLOATS:
        raise TypeError(f"{_R}: qp: expected a floating dtype, got {qp.dtype}")
    if kp.dtype != qp.dtype:
        raise TypeError(f"{_R}: kp: expected dtype {qp.dtype} (the dtype of qp), got {kp.dtype}")
    _ops._check_index_tensors(cu_seqlens, None)
    for name, t in (("kp", kp), ("cu_seqlens", cu_seqlens)):
        if t is not None and t.device != qp.device:
            raise ValueError(f"{_R}: {name}: expected device {qp.device} (the device of qp), got {t.device}")
    _ops._check_select_ranks(qp, kp, cu_seqlens)
    topk = _ops._int("topk", topk, 1, _ops.L.MAX_TOPK)
    proxy_scale = _ops._scale("proxy_scale", proxy_scale) or None
    _ops._flag("return_proxy_lse", return_proxy_lse)
    Hp, Dp = _heads("qp", qp, qp, hname="Hp", dname="Dp")
    Hpk, _ = _heads("kp", kp, qp, None, Dp, "Hpk", "Dp")
    _ratio(Hp, "Hp", Hpk, "Hpk")
    spans, total = _spans(qp, cu_seqlens, max_seqlen)
    qpf, kpf = _flat(qp), _flat(kp)
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
    """Reference of flashmsa.msa_attention; same arguments, checks and return convention.
    compute_kl None or True gives the kl value, False the zero placeholder (same gradient).
    numerics is checked and ignored (the reference is exact); validate adds the out-of-range
    check of given indices, as in the library."""
    spans, total, Hp, topk, softmax_scale, proxy_scale = _check_attention(
        q, k, v, qp, kp, cu_seqlens, indices, max_seqlen, topk, warmup, softmax_scale, proxy_scale,
        compute_kl, return_lse, return_indices, numerics, validate)
    qf, kf, vf, qpf, kpf = _flat(q), _flat(k), _flat(v), _flat(qp), _flat(kp)
    Hq, D = qf.shape[1:]
    Hkv = kf.shape[1]
    has_proxy = qp is not None
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
            pos = t != 0  # 0 log 0 = 0; a NaN teacher makes kl NaN (as it makes the gradient), `t > 0` would drop it
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
