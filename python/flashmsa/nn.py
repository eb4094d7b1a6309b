"""flashmsa.nn.MSAttention: a drop-in causal self-attention layer built on msa_attention."""
from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch
from torch import nn

from . import ops, reference

Tensor = torch.Tensor
_M = "MSAttention"


def _count(name: str, x, default=None) -> int:
    """A head count or dimension: an int >= 1 (None: the default, where there is one)."""
    if x is None and default is not None:
        return default
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{_M}: {name}: expected an int >= 1{' or None' if default is not None else ''}, "
                        f"got {type(x).__name__} {x!r}")
    if x < 1 or x > 2**31 - 1:
        raise ValueError(f"{_M}: {name}: expected an int in [1, 2147483647]"
                         f"{' (None for the default)' if default is not None else ''}, got {x}")
    return int(x)


def _bool(name: str, x) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{_M}: {name}: expected a bool (True or False), got {type(x).__name__} {x!r}")
    return x


def _real(name: str, x, positive: bool = False) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{_M}: {name}: expected a float, got {type(x).__name__} {x!r}")
    x = float(x)
    if not math.isfinite(x) or (positive and x <= 0):
        raise ValueError(f"{_M}: {name}: expected a finite value{' > 0' if positive else ''}, got {x}")
    return x


def rotary(x: Tensor, pos: Tensor, base: float = 10000.0) -> Tensor:
    """Rotary position embedding (half-split form) of x [..., tokens, H, D] at positions pos
    [..., tokens] (broadcast over heads)."""
    d = x.shape[-1] // 2
    inv = base ** (-torch.arange(d, device=x.device, dtype=torch.float32) / d)
    ang = pos.to(torch.float32)[..., None, None] * inv  # [..., tokens, 1, d]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :d].float(), x[..., d:2 * d].float()
    rot = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., 2 * d:].float()], dim=-1)
    return rot.to(x.dtype)


def positions(cu_seqlens: Tensor, total: int) -> Tensor:
    """Position of every token inside its sequence (varlen), without a host sync."""
    tok = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    seq = torch.searchsorted(cu_seqlens, tok, right=True) - 1
    return tok - cu_seqlens[seq]


class _ScaleGrad(torch.autograd.Function):
    """A view of x (same storage: a value written into x later shows through) whose gradient is
    c times the upstream one."""

    @staticmethod
    def forward(ctx, x: Tensor, c: float) -> Tensor:
        ctx.c = c
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g * ctx.c, None


class MSAttention(nn.Module):
    """Causal GQA self-attention with MiniMax Sparse Attention.

    Projections: q (num_heads), k, v (num_kv_heads), proxy q (num_proxy_heads) and proxy k
    (num_proxy_kv_heads) of head_dim / proxy_head_dim, and the output projection. Optional
    rotary embedding (on the main and, with rotary_proxy, the proxy q/k).

    forward(x [B, S, E], or x [total, E] with cu_seqlens / max_seqlen) returns
    (y of x's shape, kl_term): add kl_term to the loss; its gradient, scaled by kl_coef, trains
    the proxy projections to imitate the main attention. kl_term is msa_attention's kl (a view of
    it, whose gradient is kl_coef times the upstream one): when training it reads NaN until the
    backward has filled in the value (log it after loss.backward(), apart from the task loss;
    self.last_kl is the same tensor), in evaluation the forward computes it; NaN where the
    backend declines the value. The gradient is there either way.

    `warmup=True` (attribute, switchable any time) runs dense causal attention and trains the
    proxy over the full causal set; False selects topk blocks. detach_proxy_input feeds the proxy
    projections x.detach(), so the kl term trains the proxy alone (as DeepSeek's indexer does).
    backend: "flashmsa" (libflashmsa) or "reference" (flashmsa.reference, eager torch).
    precise_dpsum: msa_attention's option (keep the output's low part for the backward's dpsum).

    proxy_output=True: the jointly trained indexer (docs/semantics.md, "Joint indexer"): proxy values vp_proj
    (num_proxy_kv_heads x proxy_head_dim) and the proxy attention's output over the main attention's blocks
    (flashmsa.proxy_attention), added to y through its own output projection po_proj (zero-initialised, so the
    layer starts as the kl-only one). The language-model loss then trains the proxy too; kl_coef = 0 leaves it
    to that loss alone.
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: Optional[int] = None,
                 num_proxy_heads: Optional[int] = None, num_proxy_kv_heads: int = 1,
                 head_dim: Optional[int] = None, proxy_head_dim: Optional[int] = None,
                 topk: int = 16, kl_coef: float = 1.0, warmup: bool = False, rotary: bool = True,
                 rotary_proxy: bool = True, rope_base: float = 10000.0, bias: bool = False,
                 detach_proxy_input: bool = True, backend: str = "flashmsa",
                 precise_dpsum: bool = False, proxy_output: bool = False, device=None, dtype=None):
        super().__init__()
        # Every argument checked here (only None means a default; 0 is an error, never a default)
        embed_dim = _count("embed_dim", embed_dim)
        num_heads = _count("num_heads", num_heads)
        self.num_heads = num_heads
        self.num_kv_heads = _count("num_kv_heads", num_kv_heads, default=num_heads)
        self.num_proxy_heads = _count("num_proxy_heads", num_proxy_heads, default=self.num_kv_heads)
        self.num_proxy_kv_heads = num_proxy_kv_heads = _count("num_proxy_kv_heads", num_proxy_kv_heads)
        if head_dim is None and embed_dim < num_heads:
            raise ValueError(f"{_M}: head_dim: the default embed_dim // num_heads = {embed_dim} // {num_heads} "
                             f"is 0; pass head_dim or use fewer heads")
        self.head_dim = _count("head_dim", head_dim, default=embed_dim // num_heads)
        self.proxy_head_dim = _count("proxy_head_dim", proxy_head_dim, default=self.head_dim)
        for a, b, what in ((num_heads, self.num_kv_heads, "num_heads % num_kv_heads"),
                           (num_heads, self.num_proxy_heads, "num_heads % num_proxy_heads"),
                           (self.num_proxy_heads, num_proxy_kv_heads, "num_proxy_heads % num_proxy_kv_heads")):
            if a % b:
                raise ValueError(f"{_M}: {what} must be 0, got {a} % {b}")
        if not isinstance(backend, str) or backend not in ("flashmsa", "reference"):
            raise ValueError(f"{_M}: backend must be 'flashmsa' or 'reference', got {backend!r}")
        topk = ops._int("topk", topk, 1, ops.L.MAX_TOPK)
        kl_coef = _real("kl_coef", kl_coef)
        rope_base = _real("rope_base", rope_base, positive=True)
        for name, x in (("warmup", warmup), ("rotary", rotary), ("rotary_proxy", rotary_proxy), ("bias", bias),
                        ("detach_proxy_input", detach_proxy_input), ("precise_dpsum", precise_dpsum),
                        ("proxy_output", proxy_output)):
            _bool(name, x)
        self.embed_dim = embed_dim
        self.topk, self.kl_coef, self.warmup = topk, kl_coef, warmup
        self.rotary, self.rotary_proxy, self.rope_base = rotary, rotary_proxy, rope_base
        self.detach_proxy_input, self.backend = detach_proxy_input, backend
        self.precise_dpsum = precise_dpsum
        kw = dict(bias=bias, device=device, dtype=dtype)
        D, Dp = self.head_dim, self.proxy_head_dim
        self.q_proj = nn.Linear(embed_dim, num_heads * D, **kw)
        self.k_proj = nn.Linear(embed_dim, self.num_kv_heads * D, **kw)
        self.v_proj = nn.Linear(embed_dim, self.num_kv_heads * D, **kw)
        self.qp_proj = nn.Linear(embed_dim, self.num_proxy_heads * Dp, **kw)
        self.kp_proj = nn.Linear(embed_dim, num_proxy_kv_heads * Dp, **kw)
        self.o_proj = nn.Linear(num_heads * D, embed_dim, **kw)
        self.proxy_output = proxy_output
        if proxy_output:
            self.vp_proj = nn.Linear(embed_dim, num_proxy_kv_heads * Dp, **kw)
            self.po_proj = nn.Linear(self.num_proxy_heads * Dp, embed_dim, **kw)
            nn.init.zeros_(self.po_proj.weight)
            if self.po_proj.bias is not None:
                nn.init.zeros_(self.po_proj.bias)
        self.last_indices: Optional[Tensor] = None  # set when record_indices is True
        self.last_kl: Optional[Tensor] = None  # the last forward's kl (filled in by its backward)
        self.record_indices = False

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, proxy_heads={self.num_proxy_heads}, "
                f"proxy_kv_heads={self.num_proxy_kv_heads}, head_dim={self.head_dim}, "
                f"proxy_head_dim={self.proxy_head_dim}, topk={self.topk}, kl_coef={self.kl_coef}, "
                f"warmup={self.warmup}, rotary={self.rotary}, backend={self.backend}"
                + (", proxy_output=True" if self.proxy_output else ""))

    def project(self, x: Tensor, cu_seqlens: Optional[Tensor] = None):
        """(q, k, v, qp, kp) in msa_attention's layouts, rotary applied."""
        lead = x.shape[:-1]  # (B, S) or (total,)

        def heads(t: Tensor, h: int) -> Tensor:
            return t.view(*lead, h, t.shape[-1] // h)

        q = heads(self.q_proj(x), self.num_heads)
        k = heads(self.k_proj(x), self.num_kv_heads)
        v = heads(self.v_proj(x), self.num_kv_heads)
        xp = self._proxy_input(x)
        qp = heads(self.qp_proj(xp), self.num_proxy_heads)
        kp = heads(self.kp_proj(xp), self.num_proxy_kv_heads)
        if self.rotary:
            if x.dim() == 3:
                pos = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
            else:
                if cu_seqlens is None:
                    raise ValueError("MSAttention: cu_seqlens is required for varlen x [total, E]")
                pos = positions(cu_seqlens, x.shape[0])
            q, k = rotary(q, pos, self.rope_base), rotary(k, pos, self.rope_base)
            if self.rotary_proxy:
                qp, kp = rotary(qp, pos, self.rope_base), rotary(kp, pos, self.rope_base)
        return q, k, v, qp, kp

    def forward(self, x: Tensor, cu_seqlens: Optional[Tensor] = None,
                max_seqlen: Optional[int] = None) -> Tuple[Tensor, Tensor]:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_M}: x: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() not in (2, 3):
            raise ValueError(f"{_M}: x: expected [B, S, E] or [total, E], got {list(x.shape)}")
        if x.shape[-1] != self.embed_dim:
            raise ValueError(f"{_M}: x: expected the last dimension E = embed_dim = {self.embed_dim}, "
                             f"got {list(x.shape)}")
        q, k, v, qp, kp = self.project(x, cu_seqlens)
        want_idx = self.record_indices or (self.proxy_output and not self.warmup)
        if self.backend == "flashmsa":
            res = ops.msa_attention(q, k, v, qp, kp, self.topk, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                    warmup=self.warmup, return_indices=want_idx, precise_dpsum=self.precise_dpsum)
        else:
            res = reference.msa_attention(q, k, v, qp, kp, self.topk, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                          warmup=self.warmup, return_indices=want_idx)
        out, kl = res[0], res[1]
        if self.record_indices:
            self.last_indices = res[2]
        y = self.o_proj(out.reshape(*x.shape[:-1], -1))
        if self.proxy_output:
            y = y + self.po_proj(self._proxy_out(x, qp, kp, res[2] if want_idx else None, cu_seqlens, max_seqlen)
                                 .reshape(*x.shape[:-1], -1))
        self.last_kl = kl.detach()
        return y, kl if self.kl_coef == 1.0 else _ScaleGrad.apply(kl, self.kl_coef)

    def _proxy_input(self, x: Tensor) -> Tensor:
        """The proxy projections' input: x, detached with detach_proxy_input."""
        return x.detach() if self.detach_proxy_input else x

    def _proxy_out(self, x, qp, kp, indices, cu_seqlens, max_seqlen) -> Tensor:
        """The proxy attention's output (proxy_output=True) over the main attention's keys: the selected blocks,
        or every causal key in warmup."""
        vp = self.vp_proj(self._proxy_input(x)).view(*kp.shape)
        if self.backend == "flashmsa":
            return ops.proxy_attention(qp, kp, vp, indices, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                       warmup=self.warmup)
        return reference.msa_attention(qp, kp, vp, None, None, self.topk if indices is None else indices.shape[-1],
                                       cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, warmup=self.warmup,
                                       indices=indices)[0]


def last_kl(model: nn.Module, reduce: str = "mean") -> Tensor:
    """The kl values of every MSAttention in `model` from its last forward, as one 0-dim tensor:
    their mean (reduce="mean", the per-layer average) or sum ("sum"). When training, a layer's
    kl is filled in by the backward: read this after loss.backward() (before it, or from a sum
    built in the forward, it reads NaN). No host sync until .item()."""
    if reduce not in ("mean", "sum"):
        raise ValueError(f"flashmsa.nn.last_kl: reduce: expected 'mean' or 'sum', got {reduce!r}")
    vals = [m.last_kl for m in model.modules() if isinstance(m, MSAttention) and m.last_kl is not None]
    if not vals:
        raise ValueError("flashmsa.nn.last_kl: no MSAttention in the model has run a forward")
    stacked = torch.stack(vals)
    return stacked.mean() if reduce == "mean" else stacked.sum()


def proxy_param_groups(model: nn.Module, proxy_lr: float) -> list:
    """Optimizer parameter groups: every parameter of `model`, with the proxy projections of
    each MSAttention (qp_proj, kp_proj: trained by the kl term, and with proxy_output=True by the task loss too) in
    a group of their own at learning rate proxy_lr; vp_proj and po_proj (proxy_output=True) stay at the model's
    rate. At the model's rate the proxy lags a fast-changing main attention and the kl rises; 5x made it fall on
    real text (docs/lm_long_context.md). Without MSAttention the result is one group.

        opt = torch.optim.AdamW(proxy_param_groups(model, 5 * lr), lr=lr)
    """
    if isinstance(proxy_lr, bool) or not isinstance(proxy_lr, numbers.Real) or not (0 < proxy_lr < math.inf):
        raise ValueError(f"flashmsa.nn.proxy_param_groups: proxy_lr: expected a finite value > 0, got {proxy_lr!r}")
    proxy = {id(p) for m in model.modules() if isinstance(m, MSAttention)
             for p in (*m.qp_proj.parameters(), *m.kp_proj.parameters())}
    rest = [p for p in model.parameters() if id(p) not in proxy]
    groups = [dict(params=rest)]
    if proxy:
        groups.append(dict(params=[p for p in model.parameters() if id(p) in proxy], lr=proxy_lr))
    return groups


def set_warmup(model: nn.Module, warmup: bool) -> None:
    """Switch every MSAttention in `model` between dense warmup and sparse selection."""
    for m in model.modules():
        if isinstance(m, MSAttention):
            m.warmup = warmup
