"""flashmsa.nn.MSAttention: a drop-in causal self-attention layer built on msa_attention."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from . import ops, reference

Tensor = torch.Tensor


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


class MSAttention(nn.Module):
    """Causal GQA self-attention with MiniMax Sparse Attention.

    Projections: q (num_heads), k, v (num_kv_heads), proxy q (num_proxy_heads) and proxy k
    (num_proxy_kv_heads) of head_dim / proxy_head_dim, and the output projection. Optional
    rotary embedding (on the main and, with rotary_proxy, the proxy q/k).

    forward(x [B, S, E], or x [total, E] with cu_seqlens / max_seqlen) returns
    (y of x's shape, kl_term): add kl_term = kl_coef * kl to the loss; its gradient trains the
    proxy projections to imitate the main attention (its value is 0 where the backend declines
    the kl value; the gradient is there either way).

    `warmup=True` (attribute, switchable any time) runs dense causal attention and trains the
    proxy over the full causal set; False selects topk blocks. detach_proxy_input feeds the proxy
    projections x.detach(), so the kl term trains the proxy alone (as DeepSeek's indexer does).
    backend: "flashmsa" (libflashmsa) or "reference" (flashmsa.reference, eager torch).
    precise_dpsum: msa_attention's option (keep the output's low part for the backward's dpsum).
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: Optional[int] = None,
                 num_proxy_heads: Optional[int] = None, num_proxy_kv_heads: int = 1,
                 head_dim: Optional[int] = None, proxy_head_dim: Optional[int] = None,
                 topk: int = 16, kl_coef: float = 1.0, warmup: bool = False, rotary: bool = True,
                 rotary_proxy: bool = True, rope_base: float = 10000.0, bias: bool = False,
                 detach_proxy_input: bool = True, backend: str = "flashmsa",
                 precise_dpsum: bool = False, device=None, dtype=None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.num_proxy_heads = num_proxy_heads or self.num_kv_heads
        self.num_proxy_kv_heads = num_proxy_kv_heads
        self.head_dim = head_dim or embed_dim // num_heads
        self.proxy_head_dim = proxy_head_dim or self.head_dim
        for a, b, what in ((num_heads, self.num_kv_heads, "num_heads % num_kv_heads"),
                           (num_heads, self.num_proxy_heads, "num_heads % num_proxy_heads"),
                           (self.num_proxy_heads, num_proxy_kv_heads, "num_proxy_heads % num_proxy_kv_heads")):
            if b < 1 or a % b:
                raise ValueError(f"MSAttention: {what} must be 0, got {a} % {b}")
        if backend not in ("flashmsa", "reference"):
            raise ValueError(f"MSAttention: backend must be 'flashmsa' or 'reference', got {backend!r}")
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
        self.last_indices: Optional[Tensor] = None  # set when record_indices is True
        self.record_indices = False

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, proxy_heads={self.num_proxy_heads}, "
                f"proxy_kv_heads={self.num_proxy_kv_heads}, head_dim={self.head_dim}, "
                f"proxy_head_dim={self.proxy_head_dim}, topk={self.topk}, kl_coef={self.kl_coef}, "
                f"warmup={self.warmup}, rotary={self.rotary}, backend={self.backend}")

    def project(self, x: Tensor, cu_seqlens: Optional[Tensor] = None):
        """(q, k, v, qp, kp) in msa_attention's layouts, rotary applied."""
        lead = x.shape[:-1]  # (B, S) or (total,)

        def heads(t: Tensor, h: int) -> Tensor:
            return t.view(*lead, h, t.shape[-1] // h)

        q = heads(self.q_proj(x), self.num_heads)
        k = heads(self.k_proj(x), self.num_kv_heads)
        v = heads(self.v_proj(x), self.num_kv_heads)
        xp = x.detach() if self.detach_proxy_input else x
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
        if x.dim() not in (2, 3):
            raise ValueError(f"MSAttention: expected x [B, S, E] or [total, E], got {list(x.shape)}")
        q, k, v, qp, kp = self.project(x, cu_seqlens)
        if self.backend == "flashmsa":
            res = ops.msa_attention(q, k, v, qp, kp, self.topk, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                    warmup=self.warmup, return_indices=self.record_indices,
                                    precise_dpsum=self.precise_dpsum)
        else:
            res = reference.msa_attention(q, k, v, qp, kp, self.topk, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                          warmup=self.warmup, return_indices=self.record_indices)
        out, kl = res[0], res[1]
        if self.record_indices:
            self.last_indices = res[2]
        y = self.o_proj(out.reshape(*x.shape[:-1], -1))
        return y, self.kl_coef * kl


def set_warmup(model: nn.Module, warmup: bool) -> None:
    """Switch every MSAttention in `model` between dense warmup and sparse selection."""
    for m in model.modules():
        if isinstance(m, MSAttention):
            m.warmup = warmup
