"""Public functional API: msa_attention and msa_select (SPEC.md section 1)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import _autograd as A
from . import _lib as L

Tensor = torch.Tensor

_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_NUMERICS = {"train": L.NUMERICS_TRAIN, "infer": L.NUMERICS_INFER}


# ---- argument checks (cheap, metadata only: no host sync, traceable by torch.compile) ---------
def _tensor(name: str, t, optional: bool = False) -> None:
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flashmsa: {name}: expected a torch.Tensor{' or None' if optional else ''}, "
                        f"got {type(t).__name__}")


def _check_inputs(q, k, v, qp, kp, cu_seqlens, indices) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor(name, t)
    for name, t in (("qp", qp), ("kp", kp), ("cu_seqlens", cu_seqlens), ("indices", indices)):
        _tensor(name, t, optional=True)
    if q.dtype not in _FLOATS:
        raise TypeError(f"flashmsa: q: expected dtype bfloat16 or float16 (float32, float64 on the CPU), "
                        f"got {q.dtype}")
    for name, t in (("k", k), ("v", v), ("qp", qp), ("kp", kp)):
        if t is not None and t.dtype != q.dtype:
            raise TypeError(f"flashmsa: {name}: expected dtype {q.dtype} (the dtype of q), got {t.dtype}")
    _check_index_tensors(cu_seqlens, indices)
    if (qp is None) != (kp is None):
        raise ValueError(f"flashmsa: {'kp' if kp is None else 'qp'}: qp and kp must be given together")
    for name, t in (("k", k), ("v", v), ("qp", qp), ("kp", kp), ("cu_seqlens", cu_seqlens),
                    ("indices", indices)):
        if t is not None and t.device != q.device:
            raise ValueError(f"flashmsa: {name}: expected device {q.device} (the device of q), got {t.device}")


def _check_index_tensors(cu_seqlens, indices) -> None:
    if cu_seqlens is not None and cu_seqlens.dtype != torch.int32:
        raise TypeError(f"flashmsa: cu_seqlens: expected dtype torch.int32, got {cu_seqlens.dtype}")
    if indices is not None and indices.dtype != torch.int32:
        raise TypeError(f"flashmsa: indices: expected dtype torch.int32, got {indices.dtype}")


def _int(name: str, x, lo: Optional[int] = None) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"flashmsa: {name}: expected an int, got {type(x).__name__}")
    if lo is not None and x < lo:
        raise ValueError(f"flashmsa: {name}: expected a value >= {lo}, got {x}")
    return x


def _scale(name: str, s) -> float:
    """None -> 0.0 (the library's default 1/sqrt(dim)); otherwise finite and > 0."""
    if s is None:
        return 0.0
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        raise TypeError(f"flashmsa: {name}: expected a float or None, got {type(s).__name__}")
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"flashmsa: {name}: expected a finite value > 0 (or None for the default), got {s}")
    return float(s)


def _max_seqlen(x: Tensor, cu_seqlens: Optional[Tensor], max_seqlen) -> int:
    if cu_seqlens is None:
        if max_seqlen is not None:
            _int("max_seqlen", max_seqlen, 0)
        if x.dim() == 4:
            return 0  # batched: S
        raise ValueError(f"flashmsa: cu_seqlens: is required for varlen [total, H, D] inputs "
                         f"(got {x.dim()} dimensions {list(x.shape)}; batched inputs are [B, S, H, D])")
    if x.dim() == 4:
        raise ValueError(f"flashmsa: cu_seqlens: must be None for batched [B, S, H, D] inputs, "
                         f"got {list(cu_seqlens.shape)}")
    if max_seqlen is None:
        # Reads cu_seqlens on the host (a sync): pass max_seqlen under torch.compile / CUDA graphs.
        if cu_seqlens.dim() != 1:
            raise ValueError(f"flashmsa: cu_seqlens: expected 1 dimension [B+1], got {list(cu_seqlens.shape)}")
        return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item()) if cu_seqlens.numel() > 1 else 0
    return _int("max_seqlen", max_seqlen, 0)


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


# ---- the operations --------------------------------------------------------------------------
def msa_attention(q: Tensor, k: Tensor, v: Tensor, qp: Optional[Tensor] = None,
                  kp: Optional[Tensor] = None, topk: int = 16, *,
                  cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None,
                  warmup: bool = False, indices: Optional[Tensor] = None,
                  softmax_scale: Optional[float] = None, proxy_scale: Optional[float] = None,
                  compute_kl: Optional[bool] = None, return_lse: bool = False,
                  return_indices: bool = False, numerics: Optional[str] = None,
                  precise_dpsum: bool = False, validate: bool = False):
    """MiniMax Sparse Attention: proxy selection of topk 128-token blocks, then causal GQA
    attention over them, plus the proxy's KL term.

    q [total, Hq, D], k/v [total, Hkv, D], qp [total, Hp, Dp], kp [total, Hpk, Dp] with
    cu_seqlens [B+1] int32 (varlen), or all [B, S, H, D] without cu_seqlens (batched).

    Modes: sparse (default; needs qp, kp), `warmup=True` (dense causal attention, kl over the
    full causal set), `indices=` [Hp, total, topk] int32 (reuse a selection; kl only with qp, kp).

    compute_kl: None -> the kl value where the backend computes it, else a zero placeholder
    (the CUDA backend declines some head layouts); True -> the value or NotImplementedError;
    False -> the placeholder. Either way the gradient of kl drives the proxy
    (dz = g/N (s - t)): add it to the loss.

    numerics: None picks "train" (exact running max) when an input requires grad, else "infer".

    precise_dpsum: when training, the forward also keeps the low part of its fp32 output
    (out_lo, one more activation of out's size) and the backward computes dpsum from
    out + out_lo: more accurate dq and dk on peaked rows (SPEC section 3, docs/numerics.md).

    Returns (out, kl), then lse [Hq, total] fp32 if return_lse (differentiable), then indices
    [Hp, total, topk] int32 if return_indices (None in warmup mode).
    """
    _check_inputs(q, k, v, qp, kp, cu_seqlens, indices)
    has_proxy = qp is not None
    if warmup and indices is not None:
        raise ValueError("flashmsa: indices: must be None with warmup=True (dense mode selects nothing)")
    if indices is not None:
        mode = L.MODE_GIVEN
    elif warmup:
        mode = L.MODE_DENSE
    else:
        mode = L.MODE_SPARSE
        if not has_proxy:
            raise ValueError("flashmsa: qp: qp and kp are required in sparse mode (they select the blocks); "
                             "pass indices= to reuse a selection, or warmup=True for dense attention")
    topk = _int("topk", topk)
    max_seqlen = _max_seqlen(q, cu_seqlens, max_seqlen)
    grad = _needs_grad(q, k, v, qp, kp)
    if numerics is None:
        num = L.NUMERICS_TRAIN if grad else L.NUMERICS_INFER
    elif numerics in _NUMERICS:
        num = _NUMERICS[numerics]
    else:
        raise ValueError(f"flashmsa: numerics: expected 'train', 'infer' or None, got {numerics!r}")
    if compute_kl is None:
        kl_mode = -1 if has_proxy else 0
    elif isinstance(compute_kl, bool):
        kl_mode = int(compute_kl)
    else:
        raise TypeError(f"flashmsa: compute_kl: expected a bool or None, got {type(compute_kl).__name__}")

    if not isinstance(precise_dpsum, bool):
        raise TypeError(f"flashmsa: precise_dpsum: expected a bool, got {type(precise_dpsum).__name__}")
    out, lse, idx, _plse, kl, _out_lo = A.msa_fn(
        q, k, v, qp, kp, cu_seqlens, indices, max_seqlen, mode, num, topk,
        _scale("softmax_scale", softmax_scale), _scale("proxy_scale", proxy_scale), kl_mode,
        return_indices or grad, grad and has_proxy, bool(validate), precise_dpsum and grad)
    result = [out, kl]
    if return_lse:
        result.append(lse)
    if return_indices:
        result.append(idx if mode == L.MODE_SPARSE else indices)
    return tuple(result)


def msa_select(qp: Tensor, kp: Tensor, topk: int = 16, *, cu_seqlens: Optional[Tensor] = None,
               max_seqlen: Optional[int] = None, proxy_scale: Optional[float] = None,
               return_proxy_lse: bool = False):
    """The selection alone: indices [Hp, total, topk] int32 (slots 0..n-2 the chosen blocks by
    descending score, slot n-1 the query's own block, -1 padding), and proxy_lse [Hp, total]
    fp32 (the proxy's log-normaliser over the selected keys) if return_proxy_lse."""
    _tensor("qp", qp)
    _tensor("kp", kp)
    _tensor("cu_seqlens", cu_seqlens, optional=True)
    if qp.dtype not in _FLOATS:
        raise TypeError(f"flashmsa: qp: expected a floating dtype, got {qp.dtype}")
    if kp.dtype != qp.dtype:
        raise TypeError(f"flashmsa: kp: expected dtype {qp.dtype} (the dtype of qp), got {kp.dtype}")
    _check_index_tensors(cu_seqlens, None)
    for name, t in (("kp", kp), ("cu_seqlens", cu_seqlens)):
        if t is not None and t.device != qp.device:
            raise ValueError(f"flashmsa: {name}: expected device {qp.device} (the device of qp), got {t.device}")
    topk = _int("topk", topk)
    max_seqlen = _max_seqlen(qp, cu_seqlens, max_seqlen)
    idx, plse = A.select_op(qp, kp, cu_seqlens, max_seqlen, topk, _scale("proxy_scale", proxy_scale),
                            bool(return_proxy_lse))
    return (idx, plse) if return_proxy_lse else idx
