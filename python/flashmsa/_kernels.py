"""The three library calls on torch tensors, without autograd: allocate the outputs, fill the
argument struct, run on the current stream. Used by the custom ops (and by the plain
autograd.Function on a torch without torch.library.custom_op).

Every function here is also valid as a fake (meta) implementation up to the library call:
`*_outputs` allocate from metadata only, so the fake kernels in _autograd.py reuse them.
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch

from . import _lib as L

Tensor = torch.Tensor

# Optional extras of a forward that a backend may decline (NOT_SUPPORTED, answered by the
# workspace query before anything runs, so the call is retried without them): the kl value under
# compute_kl=None, and proxy_lse (saved for the backward). The CUDA backend computes the kl value
# only when every MSA group lies inside one kv head, for example. What was declined is remembered
# per feature_key (device, mode, dtype, heads, dims), so the retry happens once per geometry;
# nothing here names a backend's limits, so nothing changes when a backend lifts one.
_declined: set = set()


def feature_key(q, k, qp, kp, indices, mode) -> tuple:
    Hp = proxy_heads(q, qp, indices, mode)
    return (q.device.type, mode, q.dtype, q.shape[-2], k.shape[-2], Hp,
            kp.shape[-2] if kp is not None else 0, q.shape[-1], qp.shape[-1] if qp is not None else 0)


def stat_dtype(x: Tensor) -> torch.dtype:
    """dtype of the statistics (lse, proxy_lse, kl): fp32, or fp64 for fp64 inputs (CPU)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def num_tokens(x: Tensor) -> int:
    return x.shape[0] * x.shape[1] if x.dim() == 4 else x.shape[0]


def _empty(x: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    return torch.empty(0, dtype=dtype or x.dtype, device=x.device)


def proxy_heads(q: Tensor, qp: Optional[Tensor], indices: Optional[Tensor], mode: int) -> int:
    if qp is not None:
        return qp.shape[-2]
    if mode == L.MODE_GIVEN and indices is not None:
        return indices.shape[0]
    return q.shape[-2]


# ---- forward --------------------------------------------------------------------------------
def fwd_outputs(q, qp, indices, mode, topk, want_indices, want_proxy_lse, want_out_lo=False):
    """(out, lse, indices_out, proxy_lse, kl, out_lo); unused outputs are empty tensors."""
    total, Hq, sd = num_tokens(q), q.shape[-2], stat_dtype(q)
    Hp = proxy_heads(q, qp, indices, mode)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((Hq, total), dtype=sd, device=q.device)
    if mode == L.MODE_SPARSE and want_indices:
        idx = torch.empty((Hp, total, topk), dtype=torch.int32, device=q.device)
    else:
        idx = _empty(q, torch.int32)
    plse = torch.empty((Hp, total), dtype=sd, device=q.device) if want_proxy_lse and qp is not None else _empty(q, sd)
    kl = torch.empty((), dtype=sd, device=q.device)
    out_lo = torch.empty(q.shape, dtype=q.dtype, device=q.device) if want_out_lo else _empty(q)
    return out, lse, idx, plse, kl, out_lo


# compute_kl codes of fwd(): the value (or NotSupportedError), a zero placeholder, the value where
# the backend computes it (else NaN), and NaN that the backward fills in (autograd:
# _autograd._backward writes the backward's kl value into the forward's kl tensor). A kl that
# holds no value reads NaN, so that it cannot pass for one; only the placeholder asked for
# (compute_kl=False) reads 0.
KL_VALUE, KL_PLACEHOLDER, KL_WHERE_SUPPORTED, KL_FROM_BACKWARD = 1, 0, -1, 2
NO_VALUE = float("nan")


def fwd(q, k, v, qp, kp, cu_seqlens, indices, max_seqlen: int, mode: int, numerics: int, topk: int,
        softmax_scale: float, proxy_scale: float, compute_kl: int, want_indices: bool,
        want_proxy_lse: bool, validate: bool, want_out_lo: bool = False, cu_seqlens_q=None, q_origin=None,
        max_seqlen_q: int = 0, selection: int = 0):
    """flashmsa_fwd. compute_kl: one of the KL_* codes above (KL_FROM_BACKWARD: the library
    does not touch kl, which reads NaN). want_proxy_lse is a hint for the backward; want_out_lo
    asks for the output's low part (the backward's precise dpsum). cu_seqlens_q, q_origin,
    max_seqlen_q: query segments (C header, "Query segments"), or None, None, 0. selection: a
    flashmsa_selection_t (SELECTION_INPUT or SELECTION_FP8)."""
    outs = fwd_outputs(q, qp, indices, mode, topk, want_indices, want_proxy_lse, want_out_lo)
    out, lse, idx, plse, kl, out_lo = outs
    a = L.new_args(L.FwdArgs)
    a.q, a.k, a.v, a.qp, a.kp = L.view(q), L.view(k), L.view(v), L.view(qp), L.view(kp)
    a.cu_seqlens = L.view(cu_seqlens)
    a.max_seqlen = max_seqlen
    _segments(a, cu_seqlens_q, q_origin, max_seqlen_q)
    a.mode, a.numerics, a.topk = mode, numerics, topk if mode == L.MODE_SPARSE else 0
    a.selection = selection
    a.softmax_scale, a.proxy_scale = softmax_scale, proxy_scale
    a.validate = int(validate)
    a.indices = L.view(indices if mode == L.MODE_GIVEN else idx if idx.numel() else None)
    a.out, a.lse = L.view(out), L.view(lse)
    a.kl = L.NONE if compute_kl == KL_FROM_BACKWARD else L.view(kl)
    a.out_lo = L.view(out_lo if want_out_lo else None)
    a.stream = L.stream_of(q.device)

    optional = []
    if compute_kl == KL_WHERE_SUPPORTED and qp is not None:
        optional.append("kl")
    if plse.numel():
        optional.append("proxy_lse")
    key = feature_key(q, k, qp, kp, indices, mode)

    def run(features):
        a.compute_kl = int(compute_kl == KL_VALUE or "kl" in features)
        a.proxy_lse = L.view(plse) if "proxy_lse" in features else L.NONE
        L.call("fwd", a, q.device)

    _run_declining(run, optional, key)
    if qp is not None and compute_kl != KL_PLACEHOLDER and not a.compute_kl:  # no value: deferred or declined
        kl.fill_(NO_VALUE)
    return outs


def _segments(a, cu_seqlens_q, q_origin, max_seqlen_q: int) -> None:
    a.cu_seqlens_q, a.q_origin = L.view(cu_seqlens_q), L.view(q_origin)
    a.max_seqlen_q = max_seqlen_q if cu_seqlens_q is not None else 0


def _run_declining(run, optional, key):
    """run(features) with the optional features this backend has not declined; on
    NOT_SUPPORTED, retry with fewer (smallest drop first) and remember what it declines."""
    active = [f for f in optional if (key, f) not in _declined]
    first_error = None
    for n_drop in range(len(active) + 1):
        for drop in itertools.combinations(active, n_drop):
            try:
                run(set(active) - set(drop))
            except L.NotSupportedError as e:
                first_error = first_error or e
                if not active:
                    raise
                continue
            _declined.update((key, f) for f in drop)
            return
    raise first_error


def proxy_lse_usable(key: tuple) -> bool:
    """Whether the forwards of this feature_key write proxy_lse (the backend may decline)."""
    return (key, "proxy_lse") not in _declined


# ---- backward -------------------------------------------------------------------------------
def bwd_outputs(q, k, v, qp, kp):
    """(dq, dk, dv, dqp, dkp, kl); dqp, dkp are empty without qp, kp; kl is written by bwd()."""
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    kl = torch.empty((), dtype=stat_dtype(q), device=q.device)
    if qp is None:
        return dq, dk, dv, _empty(q), _empty(q), kl
    dqp = torch.empty(qp.shape, dtype=qp.dtype, device=qp.device)
    dkp = torch.empty(kp.shape, dtype=kp.dtype, device=kp.device)
    return dq, dk, dv, dqp, dkp, kl


def bwd(dout, dlse, dkl, q, k, v, qp, kp, cu_seqlens, indices, out, lse, proxy_lse,
        max_seqlen: int, mode: int, softmax_scale: float, proxy_scale: float, deterministic: bool,
        out_lo=None, want_kl: bool = False, cu_seqlens_q=None, q_origin=None, max_seqlen_q: int = 0):
    """flashmsa_bwd -> (dq, dk, dv, dqp, dkp, kl); dqp, dkp are empty without qp, kp. out_lo: the
    forward's low output part, or None. want_kl: kl gets the kl value of the forward (the
    backward's proxy side forms it at no extra pass) where the backend computes it, else NaN
    (without want_kl, 0: an output nobody reads)."""
    outs = bwd_outputs(q, k, v, qp, kp)
    dq, dk, dv, dqp, dkp, kl = outs
    a = L.new_args(L.BwdArgs)
    a.q, a.k, a.v, a.qp, a.kp = L.view(q), L.view(k), L.view(v), L.view(qp), L.view(kp)
    a.cu_seqlens = L.view(cu_seqlens)
    a.max_seqlen = max_seqlen
    _segments(a, cu_seqlens_q, q_origin, max_seqlen_q)
    a.mode = mode
    a.softmax_scale, a.proxy_scale = softmax_scale, proxy_scale
    a.deterministic = int(deterministic)
    a.indices = L.view(indices if mode != L.MODE_DENSE else None)
    a.out, a.lse = L.view(out), L.view(lse)
    a.out_lo = L.view(out_lo)
    usable = (proxy_lse is not None and proxy_lse.numel() > 0
              and proxy_lse_usable(feature_key(q, k, qp, kp, indices, mode)))
    a.proxy_lse = L.view(proxy_lse if usable else None)
    a.dout = L.view(dout)
    a.dlse = L.view(dlse)
    a.dkl = L.view(dkl)
    a.dq, a.dk, a.dv = L.view(dq), L.view(dk), L.view(dv)
    if qp is not None:
        a.dqp, a.dkp = L.view(dqp), L.view(dkp)
    a.stream = L.stream_of(q.device)
    key = feature_key(q, k, qp, kp, indices, mode)

    def run(features):
        a.kl = L.view(kl) if "kl_bwd" in features else L.NONE
        L.call("bwd", a, q.device)
        if "kl_bwd" not in features:  # (the library writes kl only when it is passed)
            kl.fill_(NO_VALUE if want_kl else 0.0)

    _run_declining(run, ["kl_bwd"] if want_kl and qp is not None else [], key)
    return outs


# ---- selection ------------------------------------------------------------------------------
def select_outputs(qp, topk, want_proxy_lse):
    total, Hp, sd = num_tokens(qp), qp.shape[-2], stat_dtype(qp)
    idx = torch.empty((Hp, total, topk), dtype=torch.int32, device=qp.device)
    plse = torch.empty((Hp, total), dtype=sd, device=qp.device) if want_proxy_lse else _empty(qp, sd)
    return idx, plse


def select(qp, kp, cu_seqlens, max_seqlen: int, topk: int, proxy_scale: float, want_proxy_lse: bool,
           cu_seqlens_q=None, q_origin=None, max_seqlen_q: int = 0, selection: int = 0):
    outs = select_outputs(qp, topk, want_proxy_lse)
    idx, plse = outs
    a = L.new_args(L.SelectArgs)
    a.qp, a.kp, a.cu_seqlens = L.view(qp), L.view(kp), L.view(cu_seqlens)
    a.max_seqlen, a.topk, a.proxy_scale, a.selection = max_seqlen, topk, proxy_scale, selection
    _segments(a, cu_seqlens_q, q_origin, max_seqlen_q)
    a.indices = L.view(idx)
    a.proxy_lse = L.view(plse if want_proxy_lse else None)
    a.stream = L.stream_of(qp.device)
    L.call("select", a, qp.device)
    return outs
