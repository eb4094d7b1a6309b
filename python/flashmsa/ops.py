"""Public functional API: msa_attention and msa_select (SPEC.md section 1)."""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from . import _autograd as A
from . import _kernels as K
from . import _lib as L

Tensor = torch.Tensor

_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_NUMERICS = {"train": L.NUMERICS_TRAIN, "infer": L.NUMERICS_INFER}

# Limits of the scalar arguments (docs/errors.md); the C ABI checks the same ones.
INT32_MAX = 2**31 - 1  # max_seqlen (sequence lengths are int32, like cu_seqlens)
MAX_SCALE = L.MAX_SCALE  # softmax_scale, proxy_scale: larger ones overflow the fp32 logits


# ---- argument checks (cheap, metadata only: no host sync, traceable by torch.compile) ---------
def _tensor(name: str, t, optional: bool = False) -> None:
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flashmsa: {name}: expected a torch.Tensor{' or None' if optional else ''}, "
                        f"got {type(t).__name__}")


def _rank(name: str, t: Optional[Tensor], ndims, form: str) -> None:
    """t (if given) has one of the ranks in ndims; form describes the expected layout."""
    if t is not None and t.dim() not in ndims:
        raise ValueError(f"flashmsa: {name}: expected {form}, got {t.dim()} dimension{'' if t.dim() == 1 else 's'} "
                         f"{list(t.shape)}")


def _check_ranks(q, k, v, qp, kp, cu_seqlens, indices) -> None:
    """Ranks of every tensor (before anything reads a shape: no IndexError on a bad rank)."""
    _rank("q", q, (3, 4), "3 dimensions [total, Hq, D] or 4 dimensions [B, S, Hq, D]")
    nd = q.dim()
    form = "[total, {}, {}]" if nd == 3 else "[B, S, {}, {}]"
    for name, t, h, d in (("k", k, "Hkv", "D"), ("v", v, "Hkv", "D"), ("qp", qp, "Hp", "Dp"),
                          ("kp", kp, "Hpk", "Dp")):
        _rank(name, t, (nd,), f"{nd} dimensions {form.format(h, d)} like q")
    _rank("cu_seqlens", cu_seqlens, (1,), "1 dimension [B+1]")
    _rank("indices", indices, (3,), "3 dimensions [Hp, total, topk]")
    _check_sizes((("q", q, "Hq", "D"), ("k", k, "Hkv", "D"), ("v", v, "Hkv", "D"), ("qp", qp, "Hp", "Dp"),
                  ("kp", kp, "Hpk", "Dp")))


def _check_sizes(named) -> None:
    """Head counts, head dims and token counts fit the library's int (int32) before any output is
    allocated from them (an expanded view can claim 2^32 heads with no memory behind them)."""
    for name, t, h, d in named:
        if t is None:
            continue
        tokens = t.shape[0] * t.shape[1] if t.dim() == 4 else t.shape[0]
        for what, n in ((h, t.shape[-2]), (d, t.shape[-1]), ("B * S" if t.dim() == 4 else "total", tokens)):
            if n > INT32_MAX:
                raise ValueError(f"flashmsa: {name}: expected {what} <= {INT32_MAX}, got {n} in {list(t.shape)}")


def _check_inputs(q, k, v, qp, kp, cu_seqlens, indices) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor(name, t)
    for name, t in (("qp", qp), ("kp", kp), ("cu_seqlens", cu_seqlens), ("indices", indices)):
        _tensor(name, t, optional=True)
    _check_ranks(q, k, v, qp, kp, cu_seqlens, indices)
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


def _show(x) -> str:
    r = repr(x)
    return f"{type(x).__name__} {r if len(r) <= 60 else r[:57] + '...'}"


def _int(name: str, x, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """A Python (or numpy) integer, not a bool, checked against [lo, hi] before it is narrowed."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"flashmsa: {name}: expected an int, got {_show(x)}")
    x = int(x)
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        want = (f"{lo} <= {name} <= {hi}" if lo is not None and hi is not None
                else f"{name} >= {lo}" if lo is not None else f"{name} <= {hi}")
        raise ValueError(f"flashmsa: {name}: expected {want}, got {x}")
    return x


def _flag(name: str, x, none_ok: bool = False) -> None:
    """A flag is a bool (True / False), never a string or a number that would read as one."""
    if isinstance(x, bool) or (none_ok and x is None):
        return
    raise TypeError(f"flashmsa: {name}: expected a bool (True or False{' or None' if none_ok else ''}), "
                    f"got {_show(x)}")


def _scale(name: str, s) -> float:
    """None -> 0.0 (the library's default 1/sqrt(dim)); otherwise finite, > 0 and <= MAX_SCALE."""
    if s is None:
        return 0.0
    if isinstance(s, bool) or not isinstance(s, numbers.Real):
        raise TypeError(f"flashmsa: {name}: expected a float or None, got {_show(s)}")
    s = float(s)
    if not math.isfinite(s) or s <= 0 or s > MAX_SCALE:
        raise ValueError(f"flashmsa: {name}: expected a finite value > 0 and <= {MAX_SCALE:g} "
                         f"(or None for the default 1/sqrt(head dim)), got {s}")
    return s


def _numerics(numerics) -> Optional[int]:
    if numerics is None:
        return None
    if not isinstance(numerics, str):
        raise TypeError(f"flashmsa: numerics: expected 'train', 'infer' or None, got {_show(numerics)}")
    if numerics not in _NUMERICS:
        raise ValueError(f"flashmsa: numerics: expected 'train', 'infer' or None, got {numerics!r}")
    return _NUMERICS[numerics]


def _check_options(topk, warmup=False, softmax_scale=None, proxy_scale=None, compute_kl=None,
                   return_lse=False, return_indices=False, numerics=None, validate=False,
                   precise_dpsum=False, fp8_selection=False):
    """Every non-tensor argument of msa_attention (types and ranges, no tensor needed):
    (topk, softmax_scale, proxy_scale, numerics code or None), scales 0.0 for None."""
    topk = _int("topk", topk, 1, L.MAX_TOPK)
    for name, x in (("warmup", warmup), ("return_lse", return_lse), ("return_indices", return_indices),
                    ("validate", validate), ("precise_dpsum", precise_dpsum), ("fp8_selection", fp8_selection)):
        _flag(name, x)
    _flag("compute_kl", compute_kl, none_ok=True)
    num = _numerics(numerics)
    return topk, _scale("softmax_scale", softmax_scale), _scale("proxy_scale", proxy_scale), num


def _max_seqlen(x: Tensor, cu_seqlens: Optional[Tensor], max_seqlen) -> int:
    """The max_seqlen passed to the library: varlen, the given value (0..INT32_MAX) or the longest
    sequence of cu_seqlens (a host read); batched, 0 (the library takes S), after checking that a
    given value is 0 or S."""
    if max_seqlen is not None:
        max_seqlen = _int("max_seqlen", max_seqlen, 0, INT32_MAX)
    if cu_seqlens is None:
        if x.dim() == 4:
            S = x.shape[1]
            if max_seqlen not in (None, 0, S):
                raise ValueError(f"flashmsa: max_seqlen: expected None, 0 or S = {S} (the sequence length "
                                 f"of the batched [B, S, H, D] inputs), got {max_seqlen}")
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
        # (never negative: decreasing cu_seqlens are the library's data check to report)
        return max(int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item()), 0) if cu_seqlens.numel() > 1 else 0
    return max_seqlen


def _segments(x: Tensor, cu_seqlens, cu_seqlens_q, q_origin, max_seqlen_q):
    """Checks the query segments (cu_seqlens_q [S+1], q_origin [S, 2], int32, together, varlen only)
    and returns max_seqlen_q for the library: 0 without segments; else the given value or the longest
    segment of cu_seqlens_q (a host read)."""
    _tensor("cu_seqlens_q", cu_seqlens_q, optional=True)
    _tensor("q_origin", q_origin, optional=True)
    if cu_seqlens_q is None:
        if q_origin is not None:
            raise ValueError("flashmsa: q_origin: needs cu_seqlens_q (query segments)")
        if max_seqlen_q is not None:
            raise ValueError(f"flashmsa: max_seqlen_q: expected None without cu_seqlens_q, got {_show(max_seqlen_q)}")
        return 0
    if q_origin is None:
        raise ValueError("flashmsa: q_origin: is required with cu_seqlens_q ([S, 2] int32: for each query segment "
                         "its key sequence and the position of its first query)")
    if cu_seqlens is None:
        raise ValueError("flashmsa: cu_seqlens_q: needs varlen [total, H, D] inputs with cu_seqlens (the key "
                         "sequences)")
    for name, t, nd, form in (("cu_seqlens_q", cu_seqlens_q, 1, "1 dimension [S+1]"),
                              ("q_origin", q_origin, 2, "2 dimensions [S, 2]")):
        if t.dtype != torch.int32:
            raise TypeError(f"flashmsa: {name}: expected dtype torch.int32, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"flashmsa: {name}: expected device {x.device} (the device of q), got {t.device}")
        _rank(name, t, (nd,), form)
    if max_seqlen_q is not None:
        return _int("max_seqlen_q", max_seqlen_q, 0, INT32_MAX)
    # (a host read, like max_seqlen's: pass max_seqlen_q under torch.compile / CUDA graphs)
    return max(int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()), 0) if cu_seqlens_q.numel() > 1 else 0


def _check_select_ranks(qp, kp, cu_seqlens) -> None:
    _rank("qp", qp, (3, 4), "3 dimensions [total, Hp, Dp] or 4 dimensions [B, S, Hp, Dp]")
    nd = qp.dim()
    _rank("kp", kp, (nd,), f"{nd} dimensions {'[total, Hpk, Dp]' if nd == 3 else '[B, S, Hpk, Dp]'} like qp")
    _rank("cu_seqlens", cu_seqlens, (1,), "1 dimension [B+1]")
    _check_sizes((("qp", qp, "Hp", "Dp"), ("kp", kp, "Hpk", "Dp")))


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def _kl_mode(compute_kl: Optional[bool], has_proxy: bool, grad: bool, from_backward: bool) -> int:
    """The forward's compute_kl code (_kernels.KL_*). None: when a backward will follow (an input
    requires grad) the backward's proxy side forms the value at no extra pass and writes it into
    kl, NaN until then (eager autograd; under torch.compile the forward computes it); otherwise
    the forward computes it where the backend does. True: the forward computes it; False: a
    zero placeholder."""
    if compute_kl is not None:
        return K.KL_VALUE if compute_kl else K.KL_PLACEHOLDER
    if not has_proxy:
        return K.KL_PLACEHOLDER
    if grad and from_backward and not _compiling():
        return K.KL_FROM_BACKWARD
    return K.KL_WHERE_SUPPORTED


# ---- the operations --------------------------------------------------------------------------
def msa_attention(q: Tensor, k: Tensor, v: Tensor, qp: Optional[Tensor] = None,
                  kp: Optional[Tensor] = None, topk: int = 16, *,
                  cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None,
                  warmup: bool = False, indices: Optional[Tensor] = None,
                  softmax_scale: Optional[float] = None, proxy_scale: Optional[float] = None,
                  compute_kl: Optional[bool] = None, return_lse: bool = False,
                  return_indices: bool = False, numerics: Optional[str] = None,
                  precise_dpsum: bool = False, validate: bool = False,
                  cu_seqlens_q: Optional[Tensor] = None, q_origin: Optional[Tensor] = None,
                  max_seqlen_q: Optional[int] = None, fp8_selection: bool = False):
    """MiniMax Sparse Attention: proxy selection of topk 128-token blocks, then causal GQA
    attention over them, plus the proxy's KL term.

    q [total, Hq, D], k/v [total, Hkv, D], qp [total, Hp, Dp], kp [total, Hpk, Dp] with
    cu_seqlens [B+1] int32 (varlen), or all [B, S, H, D] without cu_seqlens (batched).

    Modes: sparse (default; needs qp, kp), `warmup=True` (dense causal attention, kl over the
    full causal set), `indices=` [Hp, total, topk] int32 (reuse a selection; kl only with qp, kp).

    compute_kl: None (default) -> when training (an input requires grad) the forward makes no
    kl pass: kl reads NaN after the forward and holds the value once the backward has run (the
    backward's proxy side forms it at no extra pass). Log it after loss.backward(), apart from
    the task loss: a `task + kl` built in the forward reads NaN, before and after the backward
    (only kl's own tensor is filled in); a training loop that checks its loss for NaN must check
    the task loss, or pass compute_kl=True. (Under
    torch.compile the forward computes it.) Without grad, the forward computes the value. Either
    way NaN where the backend declines the value (the CUDA backend declines some head layouts).
    True -> the forward computes the value (or NotImplementedError); it costs a pass over the
    selected blocks (about 20% of a training step): for evaluation, or a loss that needs kl's
    value in the forward. False -> a zero placeholder. In every case the gradient of kl drives
    the proxy (dz = g/N (s - t)) and does not depend on kl's value: add kl to the loss (a
    coefficient times kl, or kl itself). A NaN or inf in q, k, qp or kp makes the kl value
    NaN (or inf), as it makes the proxy gradient.

    numerics: None picks "train" (exact running max) when an input requires grad, else "infer".

    precise_dpsum: when training, the forward also keeps the low part of its fp32 output
    (out_lo, one more activation of out's size) and the backward computes dpsum from
    out + out_lo: more accurate dq and dk on peaked rows (SPEC section 3, docs/numerics.md).

    Query segments (context parallelism; on CUDA not yet with warmup=True): with cu_seqlens_q [S+1] and
    q_origin [S, 2] (int32), q, qp (and out, lse, indices) hold only some queries: rows
    cu_seqlens_q[s] .. cu_seqlens_q[s+1] are positions q_origin[s, 1], q_origin[s, 1] + 1, ... of key
    sequence q_origin[s, 0], while k, v, kp hold the whole key sequences that cu_seqlens describes.
    Everything (mask, selection, kl terms, gradients) is the whole sequence's, restricted to these
    queries; kl is their mean (N = Hp x the query rows). max_seqlen_q: the longest segment (None:
    read from cu_seqlens_q).

    fp8_selection: the sparse mode ranks the blocks on e4m3 copies of qp (one scale per token and
    head) and kp (one per 128-token block and head); the proxy lse, the kl and every gradient still
    use qp, kp as given (C header, flashmsa_selection_t). Both backends; ignored in the warmup and given
    modes.

    Returns (out, kl), then lse [Hq, total] fp32 if return_lse (differentiable), then indices
    [Hp, total, topk] int32 if return_indices (None in warmup mode).
    """
    return _attention(q, k, v, qp, kp, topk, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, warmup=warmup,
                      indices=indices, softmax_scale=softmax_scale, proxy_scale=proxy_scale,
                      compute_kl=compute_kl, return_lse=return_lse, return_indices=return_indices,
                      numerics=numerics, precise_dpsum=precise_dpsum, validate=validate, kl_from_backward=True,
                      cu_seqlens_q=cu_seqlens_q, q_origin=q_origin, max_seqlen_q=max_seqlen_q,
                      fp8_selection=fp8_selection)


def _attention(q, k, v, qp, kp, topk, *, cu_seqlens, max_seqlen, warmup, indices, softmax_scale, proxy_scale,
               compute_kl, return_lse, return_indices, numerics, precise_dpsum, validate, kl_from_backward,
               cu_seqlens_q=None, q_origin=None, max_seqlen_q=None, fp8_selection=False):
    """msa_attention with the choice of where the default kl value comes from: kl_from_backward
    (msa_attention) or the forward (flashmsa.distributed, whose kl is a cross-rank mean)."""
    _check_inputs(q, k, v, qp, kp, cu_seqlens, indices)
    topk, sm_scale, px_scale, num = _check_options(topk, warmup, softmax_scale, proxy_scale, compute_kl,
                                                   return_lse, return_indices, numerics, validate,
                                                   precise_dpsum, fp8_selection)
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
    max_seqlen = _max_seqlen(q, cu_seqlens, max_seqlen)
    max_seqlen_q = _segments(q, cu_seqlens, cu_seqlens_q, q_origin, max_seqlen_q)
    grad = _needs_grad(q, k, v, qp, kp)
    if num is None:
        num = L.NUMERICS_TRAIN if grad else L.NUMERICS_INFER
    kl_mode = _kl_mode(compute_kl, has_proxy, grad, kl_from_backward)
    out, lse, idx, _plse, kl, _out_lo = A.msa_fn(*A.fwd_args(
        q=q, k=k, v=v, qp=qp, kp=kp, cu_seqlens=cu_seqlens, indices=indices, max_seqlen=max_seqlen, mode=mode,
        numerics=num, topk=topk, softmax_scale=sm_scale, proxy_scale=px_scale, compute_kl=kl_mode,
        want_indices=return_indices or grad, want_proxy_lse=grad and has_proxy, validate=validate,
        want_out_lo=precise_dpsum and grad, cu_seqlens_q=cu_seqlens_q, q_origin=q_origin,
        max_seqlen_q=max_seqlen_q, selection=L.SELECTION_FP8 if fp8_selection else L.SELECTION_INPUT))
    result = [out, kl]
    if return_lse:
        result.append(lse)
    if return_indices:
        result.append(idx if mode == L.MODE_SPARSE else indices)
    return tuple(result)


def msa_select(qp: Tensor, kp: Tensor, topk: int = 16, *, cu_seqlens: Optional[Tensor] = None,
               max_seqlen: Optional[int] = None, proxy_scale: Optional[float] = None,
               return_proxy_lse: bool = False, cu_seqlens_q: Optional[Tensor] = None,
               q_origin: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
               fp8_selection: bool = False):
    """The selection alone: indices [Hp, total, topk] int32 (slots 0..n-2 the chosen blocks by
    descending score, slot n-1 the query's own block, -1 padding), and proxy_lse [Hp, total]
    fp32 (the proxy's log-normaliser over the selected keys) if return_proxy_lse. Query segments
    (cu_seqlens_q, q_origin, max_seqlen_q) and fp8_selection as in msa_attention."""
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
    _check_select_ranks(qp, kp, cu_seqlens)
    topk = _int("topk", topk, 1, L.MAX_TOPK)
    px_scale = _scale("proxy_scale", proxy_scale)
    _flag("return_proxy_lse", return_proxy_lse)
    _flag("fp8_selection", fp8_selection)
    max_seqlen = _max_seqlen(qp, cu_seqlens, max_seqlen)
    max_seqlen_q = _segments(qp, cu_seqlens, cu_seqlens_q, q_origin, max_seqlen_q)
    idx, plse = A.select_op(*A.select_args(qp=qp, kp=kp, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, topk=topk,
                                           proxy_scale=px_scale, want_proxy_lse=return_proxy_lse,
                                           cu_seqlens_q=cu_seqlens_q, q_origin=q_origin, max_seqlen_q=max_seqlen_q,
                                           selection=L.SELECTION_FP8 if fp8_selection else L.SELECTION_INPUT))
    return (idx, plse) if return_proxy_lse else idx


def proxy_attention(qp: Tensor, kp: Tensor, vp: Tensor, indices: Optional[Tensor] = None, *,
                    cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None, warmup: bool = False,
                    proxy_scale: Optional[float] = None, numerics: Optional[str] = None, validate: bool = False):
    """The proxy (index branch) attention's own output, for the jointly trained indexer (docs/semantics.md,
    "Joint indexer"): O_idx = softmax(proxy_scale * qp kp^T) vp over the keys the main attention reads, causal.

    qp [total, Hp, Dp], kp and vp [total, Hpk, Dp] (vp: the proxy values, one head per proxy key head), varlen
    with cu_seqlens or batched [B, S, H, Dp] as in msa_attention. The keys: the blocks of `indices` [Hp, total,
    topk] (msa_attention(..., return_indices=True)'s selection, the main attention's blocks) or, with
    warmup=True, every causal key. proxy_scale: the selection's scale (default Dp^-0.5).

    Returns O_idx [total, Hp, Dp] (batched: [B, S, Hp, Dp]) in qp's dtype, differentiable in qp, kp and vp: the
    language-model loss through O_idx trains the proxy jointly with (or instead of) the kl term. It runs the
    library's attention on the proxy's heads (given or dense mode, no proxy of its own), on every backend; errors
    name the attention's arguments (qp, kp, vp as q, k, v; proxy_scale as softmax_scale; indices' last dimension as
    topk; on CUDA, Dp as the head dim D).
    """
    if indices is None and not warmup:
        raise ValueError("flashmsa.proxy_attention: indices: the selection to attend over is required "
                         "(msa_attention(..., return_indices=True)), or warmup=True for every causal key")
    fn = "flashmsa.proxy_attention"
    for name, t in (("qp", qp), ("kp", kp), ("vp", vp)):
        _tensor(name, t)
    if qp.dim() not in (3, 4):
        raise ValueError(f"{fn}: qp: expected [total, Hp, Dp] or [B, S, Hp, Dp], got {list(qp.shape)}")
    if vp.shape != kp.shape:
        raise ValueError(f"{fn}: vp: expected kp's shape {list(kp.shape)} (one value head per proxy key head), "
                         f"got {list(vp.shape)}")
    if vp.dtype != kp.dtype or vp.device != kp.device:
        raise TypeError(f"{fn}: vp: expected kp's dtype and device ({kp.dtype}, {kp.device}), got "
                        f"({vp.dtype}, {vp.device})")
    topk = 16
    if indices is not None:
        _tensor("indices", indices)
        if indices.dim() != 3 or indices.shape[0] != qp.shape[-2]:
            raise ValueError(f"{fn}: indices: expected [Hp, total, topk] with Hp = qp's {qp.shape[-2]} heads (one "
                             f"selection per proxy head), got {list(indices.shape)}")
        topk = indices.shape[-1]
    try:
        out, _ = _attention(qp, kp, vp, None, None, topk, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                            warmup=warmup, indices=indices, softmax_scale=proxy_scale, proxy_scale=None,
                            compute_kl=False, return_lse=False, return_indices=False, numerics=numerics,
                            precise_dpsum=False, validate=validate, kl_from_backward=True)
    except (ValueError, TypeError, NotImplementedError) as e:  # name the caller's tensors: qp, kp, vp run as q, k, v
        raise type(e)(f"{fn} (qp, kp, vp and proxy_scale run as the attention's q, k, v and softmax_scale): "
                      f"{e}") from None
    return out
