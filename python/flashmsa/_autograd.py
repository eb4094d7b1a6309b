"""The differentiable operation: torch.library custom ops (torch >= 2.4) with fake kernels and a
registered autograd formula, so torch.compile(fullgraph=True) and CUDA graphs see three opaque
ops (flashmsa::fwd, flashmsa::bwd, flashmsa::select); on an older torch, a plain
torch.autograd.Function around the same kernels.

Backward (SPEC section 1): flashmsa_bwd gets dout, dlse when lse received a gradient, and
dkl = the gradient of the kl output (a 0-dim tensor on the device: no host sync). Without a
gradient for kl the proxy gradients are exactly zero; q, k, v get none from kl, qp, kp none
from out.
"""
from typing import List, Optional, Tuple

import torch

from . import _kernels as K
from . import _lib as L

Tensor = torch.Tensor

HAS_CUSTOM_OP = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_autograd")

# Positions of the forward's inputs (the op's schema order).
FWD_ARGS = ("q", "k", "v", "qp", "kp", "cu_seqlens", "indices", "max_seqlen", "mode", "numerics",
            "topk", "softmax_scale", "proxy_scale", "compute_kl", "want_indices", "want_proxy_lse",
            "validate", "want_out_lo")


def _setup_context(ctx, inputs, output):
    a = dict(zip(FWD_ARGS, inputs))
    out, lse, idx, plse, kl, out_lo = output
    mode = a["mode"]
    sel = idx if mode == L.MODE_SPARSE else a["indices"] if mode == L.MODE_GIVEN else None
    ctx.save_for_backward(a["q"], a["k"], a["v"], a["qp"], a["kp"], a["cu_seqlens"], sel, out, lse, plse,
                          out_lo if a["want_out_lo"] else None)
    ctx.max_seqlen, ctx.mode = a["max_seqlen"], mode
    ctx.softmax_scale, ctx.proxy_scale = a["softmax_scale"], a["proxy_scale"]
    ctx.mark_non_differentiable(idx, plse, out_lo)
    ctx.set_materialize_grads(False)


def _dense(g: Tensor) -> Tensor:
    """A gradient with unit last-dim stride and no zero strides (autograd may hand in expanded
    views, e.g. the gradient of out.sum()); fresh strides even when empty."""
    if g.stride(-1) == 1 and 0 not in g.stride():
        return g
    return g.new_empty(g.shape).copy_(g)


def _backward(ctx, dout, dlse, _didx, _dplse, dkl, _dout_lo):
    q, k, v, qp, kp, cu, sel, out, lse, plse, out_lo = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else _dense(dout)
    if dlse is not None:
        dlse = _dense(dlse)
    if dkl is not None:
        dkl = dkl.reshape(())
    # torch.use_deterministic_algorithms(True) selects the bitwise reproducible backward
    deterministic = torch.are_deterministic_algorithms_enabled()
    dq, dk, dv, dqp, dkp = bwd_op(dout, dlse, dkl, q, k, v, qp, kp, cu, sel, out, lse, plse,
                                  ctx.max_seqlen, ctx.mode, ctx.softmax_scale, ctx.proxy_scale, deterministic,
                                  out_lo)
    has_proxy = qp is not None
    grads = [dq, dk, dv, dqp if has_proxy else None, dkp if has_proxy else None]
    return tuple(grads + [None] * (len(FWD_ARGS) - len(grads)))


if HAS_CUSTOM_OP:

    @torch.library.custom_op("flashmsa::fwd", mutates_args=())
    def fwd_op(q: Tensor, k: Tensor, v: Tensor, qp: Optional[Tensor], kp: Optional[Tensor],
               cu_seqlens: Optional[Tensor], indices: Optional[Tensor], max_seqlen: int, mode: int,
               numerics: int, topk: int, softmax_scale: float, proxy_scale: float, compute_kl: int,
               want_indices: bool, want_proxy_lse: bool, validate: bool, want_out_lo: bool
               ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        return K.fwd(q, k, v, qp, kp, cu_seqlens, indices, max_seqlen, mode, numerics, topk,
                     softmax_scale, proxy_scale, compute_kl, want_indices, want_proxy_lse, validate,
                     want_out_lo)

    @fwd_op.register_fake
    def _(q, k, v, qp, kp, cu_seqlens, indices, max_seqlen, mode, numerics, topk, softmax_scale,
          proxy_scale, compute_kl, want_indices, want_proxy_lse, validate, want_out_lo):
        return K.fwd_outputs(q, qp, indices, mode, topk, want_indices, want_proxy_lse, want_out_lo)

    @torch.library.custom_op("flashmsa::bwd", mutates_args=())
    def bwd_op(dout: Tensor, dlse: Optional[Tensor], dkl: Optional[Tensor], q: Tensor, k: Tensor,
               v: Tensor, qp: Optional[Tensor], kp: Optional[Tensor], cu_seqlens: Optional[Tensor],
               indices: Optional[Tensor], out: Tensor, lse: Tensor, proxy_lse: Optional[Tensor],
               max_seqlen: int, mode: int, softmax_scale: float, proxy_scale: float,
               deterministic: bool, out_lo: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return K.bwd(dout, dlse, dkl, q, k, v, qp, kp, cu_seqlens, indices, out, lse, proxy_lse,
                     max_seqlen, mode, softmax_scale, proxy_scale, deterministic, out_lo)

    @bwd_op.register_fake
    def _(dout, dlse, dkl, q, k, v, qp, kp, *rest):
        return K.bwd_outputs(q, k, v, qp, kp)

    @torch.library.custom_op("flashmsa::select", mutates_args=())
    def select_op(qp: Tensor, kp: Tensor, cu_seqlens: Optional[Tensor], max_seqlen: int, topk: int,
                  proxy_scale: float, want_proxy_lse: bool) -> Tuple[Tensor, Tensor]:
        return K.select(qp, kp, cu_seqlens, max_seqlen, topk, proxy_scale, want_proxy_lse)

    @select_op.register_fake
    def _(qp, kp, cu_seqlens, max_seqlen, topk, proxy_scale, want_proxy_lse):
        return K.select_outputs(qp, topk, want_proxy_lse)

    torch.library.register_autograd("flashmsa::fwd", _backward, setup_context=_setup_context)
    msa_fn = fwd_op

else:  # torch < 2.4: no custom ops; eager autograd only
    fwd_op, bwd_op, select_op = K.fwd, K.bwd, K.select


class MSAFunction(torch.autograd.Function):
    """The same forward/backward as a plain autograd.Function (used where torch has no
    torch.library.custom_op; opaque to torch.compile)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = K.fwd(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        return _backward(ctx, *grads)


if not HAS_CUSTOM_OP:
    msa_fn = MSAFunction.apply


def op_names() -> List[str]:
    """The registered custom ops (empty on a torch without torch.library.custom_op)."""
    return ["flashmsa::fwd", "flashmsa::bwd", "flashmsa::select"] if HAS_CUSTOM_OP else []
