"""The differentiable operation: torch.library custom ops (torch >= 2.4) with fake kernels and a
registered autograd formula, so torch.compile(fullgraph=True) and CUDA graphs see three opaque
ops (flashmsa::fwd, flashmsa::bwd, flashmsa::select); on an older torch, a plain
torch.autograd.Function around the same kernels.

Backward (SPEC section 1): flashmsa_bwd gets dout, dlse when lse received a gradient, and
dkl = the gradient of the kl output (a 0-dim tensor on the device: no host sync). Without a
gradient for kl the proxy gradients are exactly zero; q, k, v get none from kl, qp, kp none
from out.
"""
import inspect
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import _kernels as K
from . import _lib as L

Tensor = torch.Tensor

HAS_CUSTOM_OP = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_autograd")

# The ops' arguments by name, in schema order. Every positional use goes through these lists:
# the autograd context binds the forward's inputs by FWD_ARGS, the backward builds the bwd op's
# arguments with args_tuple(BWD_ARGS, ...), and callers can do the same (fwd_args, select_args).
# check_signatures() (run at import) compares each list with the registered op's schema, with the
# kernel in _kernels.py the op calls positionally and with the fake kernel: adding, renaming or
# reordering an argument in one place and not the others fails at import, naming the position.
FWD_ARGS = ("q", "k", "v", "qp", "kp", "cu_seqlens", "indices", "max_seqlen", "mode", "numerics",
            "topk", "softmax_scale", "proxy_scale", "compute_kl", "want_indices", "want_proxy_lse",
            "validate", "want_out_lo", "cu_seqlens_q", "q_origin", "max_seqlen_q", "selection")
FWD_OUTPUTS = ("out", "lse", "indices", "proxy_lse", "kl", "out_lo")
BWD_ARGS = ("dout", "dlse", "dkl", "q", "k", "v", "qp", "kp", "cu_seqlens", "indices", "out", "lse",
            "proxy_lse", "max_seqlen", "mode", "softmax_scale", "proxy_scale", "deterministic", "out_lo",
            "want_kl", "cu_seqlens_q", "q_origin", "max_seqlen_q")
BWD_OUTPUTS = ("dq", "dk", "dv", "dqp", "dkp", "kl")
SELECT_ARGS = ("qp", "kp", "cu_seqlens", "max_seqlen", "topk", "proxy_scale", "want_proxy_lse", "cu_seqlens_q",
               "q_origin", "max_seqlen_q", "selection")
SELECT_OUTPUTS = ("indices", "proxy_lse")
# what the forward saves for the backward, in save_for_backward order
_SAVED = ("q", "k", "v", "qp", "kp", "cu_seqlens", "indices", "out", "lse", "proxy_lse", "out_lo", "cu_seqlens_q",
          "q_origin")
# the differentiable inputs of the forward and the bwd op's output that is their gradient
_GRADS = {"q": "dq", "k": "dk", "v": "dv", "qp": "dqp", "kp": "dkp"}


def args_tuple(names: Sequence[str], values: Dict[str, object]) -> tuple:
    """The positional arguments of an op whose argument list is `names`, from a value per name;
    TypeError naming what is missing or unknown (no argument can silently shift)."""
    missing = [n for n in names if n not in values]
    extra = [n for n in values if n not in names]
    if missing or extra:
        raise TypeError(f"flashmsa: arguments: missing {missing}, unknown {extra} (expected {list(names)})")
    return tuple(values[n] for n in names)


def fwd_args(**values) -> tuple:
    """The positional arguments of flashmsa::fwd (msa_fn, MSAFunction) from keywords."""
    return args_tuple(FWD_ARGS, values)


def select_args(**values) -> tuple:
    """The positional arguments of flashmsa::select (select_op) from keywords."""
    return args_tuple(SELECT_ARGS, values)


def _setup_context(ctx, inputs, output):
    a = dict(zip(FWD_ARGS, inputs))
    o = dict(zip(FWD_OUTPUTS, output))
    mode = a["mode"]
    sel = o["indices"] if mode == L.MODE_SPARSE else a["indices"] if mode == L.MODE_GIVEN else None
    saved = dict(a, indices=sel, out=o["out"], lse=o["lse"], proxy_lse=o["proxy_lse"],
                 out_lo=o["out_lo"] if a["want_out_lo"] else None)
    ctx.save_for_backward(*(saved[n] for n in _SAVED))
    ctx.max_seqlen, ctx.max_seqlen_q, ctx.mode = a["max_seqlen"], a["max_seqlen_q"], mode
    ctx.softmax_scale, ctx.proxy_scale = a["softmax_scale"], a["proxy_scale"]
    ctx.mark_non_differentiable(o["indices"], o["proxy_lse"], o["out_lo"])
    ctx.set_materialize_grads(False)
    # KL_FROM_BACKWARD: the backward writes its kl value into the forward's kl tensor. An alias
    # without autograd history (.data: no reference cycle through the graph, no version bump).
    ctx.kl_out = o["kl"].data if a["compute_kl"] == K.KL_FROM_BACKWARD else None


def _dense(g: Tensor) -> Tensor:
    """A gradient with unit last-dim stride and no zero strides (autograd may hand in expanded
    views, e.g. the gradient of out.sum()); fresh strides even when empty."""
    if g.stride(-1) == 1 and 0 not in g.stride():
        return g
    return g.new_empty(g.shape).copy_(g)


def _backward(ctx, *output_grads):
    s = dict(zip(_SAVED, ctx.saved_tensors))
    g = dict(zip(FWD_OUTPUTS, output_grads))  # only out, lse and kl are differentiable
    dout, dlse, dkl = g["out"], g["lse"], g["kl"]
    dout = torch.zeros_like(s["out"]) if dout is None else _dense(dout)
    if dlse is not None:
        dlse = _dense(dlse)
    if dkl is not None:
        dkl = dkl.reshape(())
    # kl's gradient reaches only qp and kp: where neither takes a gradient (a frozen or detached
    # indexer), the backward gets none, so the library skips the proxy gradient's work (the kl walk's
    # GEMMs; with no kl value to fill in, the whole proxy side: the main attention's backward alone)
    train_proxy = any(ctx.needs_input_grad[FWD_ARGS.index(n)] for n in ("qp", "kp"))
    if not train_proxy:
        dkl = None
    # torch.use_deterministic_algorithms(True) selects the bitwise reproducible backward
    deterministic = torch.are_deterministic_algorithms_enabled()
    kl_out = ctx.kl_out
    outs = bwd_op(*args_tuple(BWD_ARGS, dict(
        s, dout=dout, dlse=dlse, dkl=dkl, max_seqlen=ctx.max_seqlen, max_seqlen_q=ctx.max_seqlen_q, mode=ctx.mode,
        softmax_scale=ctx.softmax_scale, proxy_scale=ctx.proxy_scale, deterministic=deterministic,
        want_kl=kl_out is not None)))
    d = dict(zip(BWD_OUTPUTS, outs))
    if kl_out is not None:  # the forward's kl, filled in (stream-ordered: no sync)
        kl_out.copy_(d["kl"])
    grads = {x: d[dx] for x, dx in _GRADS.items() if train_proxy or x not in ("qp", "kp")}
    return tuple(grads.get(n) for n in FWD_ARGS)


if HAS_CUSTOM_OP:
    # The ops' signatures make their schemas (torch infers them). Their bodies pass their own
    # arguments on in the argument list's order, picked by name (locals() is exactly the
    # parameters there); the fakes pass theirs by keyword.

    @torch.library.custom_op("flashmsa::fwd", mutates_args=())
    def fwd_op(q: Tensor, k: Tensor, v: Tensor, qp: Optional[Tensor], kp: Optional[Tensor],
               cu_seqlens: Optional[Tensor], indices: Optional[Tensor], max_seqlen: int, mode: int,
               numerics: int, topk: int, softmax_scale: float, proxy_scale: float, compute_kl: int,
               want_indices: bool, want_proxy_lse: bool, validate: bool, want_out_lo: bool,
               cu_seqlens_q: Optional[Tensor], q_origin: Optional[Tensor], max_seqlen_q: int, selection: int = 0
               ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        return K.fwd(*args_tuple(FWD_ARGS, locals()))

    @fwd_op.register_fake
    def _fwd_fake(q, k, v, qp, kp, cu_seqlens, indices, max_seqlen, mode, numerics, topk, softmax_scale,
                  proxy_scale, compute_kl, want_indices, want_proxy_lse, validate, want_out_lo, cu_seqlens_q,
                  q_origin, max_seqlen_q, selection=0):
        return K.fwd_outputs(q=q, qp=qp, indices=indices, mode=mode, topk=topk, want_indices=want_indices,
                             want_proxy_lse=want_proxy_lse, want_out_lo=want_out_lo)

    @torch.library.custom_op("flashmsa::bwd", mutates_args=())
    def bwd_op(dout: Tensor, dlse: Optional[Tensor], dkl: Optional[Tensor], q: Tensor, k: Tensor,
               v: Tensor, qp: Optional[Tensor], kp: Optional[Tensor], cu_seqlens: Optional[Tensor],
               indices: Optional[Tensor], out: Tensor, lse: Tensor, proxy_lse: Optional[Tensor],
               max_seqlen: int, mode: int, softmax_scale: float, proxy_scale: float,
               deterministic: bool, out_lo: Optional[Tensor], want_kl: bool,
               cu_seqlens_q: Optional[Tensor], q_origin: Optional[Tensor], max_seqlen_q: int
               ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        return K.bwd(*args_tuple(BWD_ARGS, locals()))

    @bwd_op.register_fake
    def _bwd_fake(dout, dlse, dkl, q, k, v, qp, kp, *rest):
        return K.bwd_outputs(q=q, k=k, v=v, qp=qp, kp=kp)

    @torch.library.custom_op("flashmsa::select", mutates_args=())
    def select_op(qp: Tensor, kp: Tensor, cu_seqlens: Optional[Tensor], max_seqlen: int, topk: int,
                  proxy_scale: float, want_proxy_lse: bool, cu_seqlens_q: Optional[Tensor],
                  q_origin: Optional[Tensor], max_seqlen_q: int, selection: int = 0) -> Tuple[Tensor, Tensor]:
        return K.select(*args_tuple(SELECT_ARGS, locals()))

    @select_op.register_fake
    def _select_fake(qp, kp, cu_seqlens, max_seqlen, topk, proxy_scale, want_proxy_lse, cu_seqlens_q, q_origin,
                     max_seqlen_q, selection=0):
        return K.select_outputs(qp=qp, topk=topk, want_proxy_lse=want_proxy_lse)

    _FAKES = {"flashmsa::fwd": _fwd_fake, "flashmsa::bwd": _bwd_fake, "flashmsa::select": _select_fake}
    torch.library.register_autograd("flashmsa::fwd", _backward, setup_context=_setup_context)
    msa_fn = fwd_op

else:  # torch < 2.4: no custom ops; eager autograd only
    fwd_op, bwd_op, select_op = K.fwd, K.bwd, K.select


def _params(fn) -> Tuple[List[str], bool]:
    """The named positional parameters of a Python function, and whether it takes *args too."""
    ps = inspect.signature(fn).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in ps if p.kind in kinds], any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in ps)


def _same(what: str, got: Sequence[str], want: Sequence[str], prefix: bool = False) -> None:
    """ImportError unless the names `got` are `want` (with prefix: its first len(got) names)."""
    got, want = list(got), list(want)
    if prefix and len(got) <= len(want):
        want = want[:len(got)]
    if got == want:
        return
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))

    def at(names):
        return repr(names[i]) if i < len(names) else "nothing"

    raise ImportError(f"flashmsa: {what} has {at(got)} at position {i} where the argument list has {at(want)}: "
                      f"{got} vs {want}")


def schema_of(op):
    """The registered schema of a custom op (None on a torch without custom ops)."""
    overload = getattr(op, "_opoverload", None)
    return overload._schema if overload is not None else None


def check_signatures() -> None:
    """Each op's argument list (FWD_ARGS, BWD_ARGS, SELECT_ARGS) against the registered schema and
    the number of its outputs, the kernel in _kernels.py that the op (and MSAFunction) calls
    positionally, and the op's fake kernel. ImportError naming the first differing position."""
    ops = ((fwd_op, "flashmsa::fwd", FWD_ARGS, FWD_OUTPUTS, K.fwd),
           (bwd_op, "flashmsa::bwd", BWD_ARGS, BWD_OUTPUTS, K.bwd),
           (select_op, "flashmsa::select", SELECT_ARGS, SELECT_OUTPUTS, K.select))
    for op, name, args, outputs, kernel in ops:
        _same(f"the kernel _kernels.{kernel.__name__} of {name}", _params(kernel)[0], args)
        schema = schema_of(op) if HAS_CUSTOM_OP else None
        if schema is None:
            continue
        _same(f"the schema of {name}", [a.name for a in schema.arguments], args)
        if len(schema.returns) != len(outputs):
            raise ImportError(f"flashmsa: the schema of {name} has {len(schema.returns)} outputs where the code "
                              f"names {len(outputs)}: {list(outputs)}")
        fake_params, var_args = _params(_FAKES[name])
        _same(f"the fake kernel of {name}", fake_params, args, prefix=var_args)


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

check_signatures()


def op_names() -> List[str]:
    """The registered custom ops (empty on a torch without torch.library.custom_op)."""
    return ["flashmsa::fwd", "flashmsa::bwd", "flashmsa::select"] if HAS_CUSTOM_OP else []
