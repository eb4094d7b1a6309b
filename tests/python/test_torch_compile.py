"""Custom-op registration (torch.library.opcheck), torch.compile(fullgraph=True) on the CPU, and
the plain autograd.Function used on a torch without custom ops."""
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")

import flashmsa  # noqa: E402
from flashmsa import _autograd as A  # noqa: E402
from flashmsa import _lib as L  # noqa: E402
from flashmsa.nn import MSAttention  # noqa: E402
from flashmsa.testing import make_inputs, rel_l2  # noqa: E402

needs_custom_op = pytest.mark.skipif(not A.HAS_CUSTOM_OP, reason="torch < 2.4: no torch.library.custom_op")


def fwd_args(mode, batched=False, grad=True, out_lo=False):
    """Positional arguments of flashmsa::fwd for a small fp64 case."""
    if batched:
        x = make_inputs(batch=2, seqlen=150, D=8, Dp=8, requires_grad=grad, seed=21)
        cu, ms = None, 0
    else:
        x = make_inputs(lengths=[260, 0, 9], D=8, Dp=8, requires_grad=grad, seed=22)
        cu, ms = x["cu_seqlens"], 260
    idx = None
    if mode == L.MODE_GIVEN:
        idx = flashmsa.msa_select(x["qp"].detach(), x["kp"].detach(), 2, cu_seqlens=cu, max_seqlen=ms)
    return (x["q"], x["k"], x["v"], x["qp"], x["kp"], cu, idx, ms, mode, L.NUMERICS_TRAIN, 2, 0.0, 0.0, 1,
            True, True, False, out_lo, None, None, 0)


@needs_custom_op
def test_ops_are_registered():
    assert flashmsa.op_names() == ["flashmsa::fwd", "flashmsa::bwd", "flashmsa::select"]
    for name in ("fwd", "bwd", "select"):
        assert hasattr(torch.ops.flashmsa, name)


@needs_custom_op
@pytest.mark.parametrize("mode,batched", [(L.MODE_SPARSE, False), (L.MODE_SPARSE, True),
                                          (L.MODE_DENSE, False), (L.MODE_GIVEN, False)],
                         ids=["sparse_varlen", "sparse_batched", "dense_varlen", "given_varlen"])
def test_opcheck_fwd(mode, batched):
    """Schema, fake kernel, autograd registration and AOT dispatch (dynamic shapes)."""
    torch.library.opcheck(torch.ops.flashmsa.fwd.default, fwd_args(mode, batched))


@needs_custom_op
def test_opcheck_fwd_frozen_proxy():
    """qp, kp without requires_grad (the backward then passes no dkl): autograd registration and
    AOT dispatch still check out."""
    args = list(fwd_args(L.MODE_SPARSE))
    args[3], args[4] = args[3].detach(), args[4].detach()
    torch.library.opcheck(torch.ops.flashmsa.fwd.default, tuple(args))


@needs_custom_op
def test_opcheck_fwd_with_out_lo():
    torch.library.opcheck(torch.ops.flashmsa.fwd.default, fwd_args(L.MODE_SPARSE, out_lo=True))


@needs_custom_op
def test_opcheck_bwd_and_select():
    args = fwd_args(L.MODE_SPARSE, grad=False)
    q, k, v, qp, kp, cu = args[:6]
    out, lse, idx, plse, kl, _ = torch.ops.flashmsa.fwd(*args)
    dout, dlse, dkl = torch.randn_like(out), torch.randn_like(lse), torch.tensor(2.0, dtype=torch.float64)
    for out_lo, want_kl in ((None, False), (torch.zeros_like(out), True)):
        torch.library.opcheck(torch.ops.flashmsa.bwd.default,
                              (dout, dlse, dkl, q, k, v, qp, kp, cu, idx, out, lse, plse, 260, L.MODE_SPARSE, 0.0,
                               0.0, False, out_lo, want_kl, None, None, 0))
    torch.library.opcheck(torch.ops.flashmsa.select.default, (qp, kp, cu, 260, 3, 0.0, True, None, None, 0))


def _model_loss(layer, x, **kw):
    y, kl = layer(x, **kw)
    return y.square().mean(), kl


@needs_custom_op
@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_compile_fullgraph_matches_eager(varlen):
    """torch.compile(fullgraph=True) traces a model using MSAttention (forward and backward)."""
    torch.manual_seed(0)
    layer = MSAttention(32, 4, 2, 2, 1, head_dim=8, topk=2).double()
    if varlen:
        x = torch.randn(400, 32, dtype=torch.float64)
        kw = dict(cu_seqlens=torch.tensor([0, 130, 400], dtype=torch.int32), max_seqlen=270)
    else:
        x, kw = torch.randn(2, 200, 32, dtype=torch.float64), {}
    torch._dynamo.reset()
    compiled = torch.compile(_model_loss, fullgraph=True, backend="aot_eager")
    results = []
    for f in (compiled, _model_loss):
        layer.zero_grad(set_to_none=True)
        task, kl = f(layer, x, **kw)
        (task + kl).backward()
        # kl: the compiled forward's value, the eager backward's (the same number)
        results.append(((task.detach(), kl.detach()), {n: p.grad.clone() for n, p in layer.named_parameters()}))
    (l1, g1), (l2, g2) = results
    assert rel_l2(l1[0], l2[0]) < 1e-12 and rel_l2(l1[1], l2[1]) < 1e-12 and l1[1] > 0
    for n in g1:
        assert rel_l2(g1[n], g2[n]) < 1e-10, n
    assert g1["qp_proj.weight"].abs().max() > 0  # the kl term reached the proxy


@needs_custom_op
def test_compile_warmup_switch_and_select():
    layer = MSAttention(32, 4, 2, 2, 1, head_dim=8, topk=2).double()
    x = torch.randn(1, 300, 32, dtype=torch.float64)

    def f(x):
        q, k, v, qp, kp = layer.project(x)
        return flashmsa.msa_select(qp, kp, 2), layer(x)[0]

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    for warmup in (True, False):
        layer.warmup = warmup
        (i1, y1), (i2, y2) = cf(x), f(x)
        assert torch.equal(i1, i2) and rel_l2(y1, y2) < 1e-12


@needs_custom_op
def test_compile_default_kl_comes_from_the_forward():
    """Under torch.compile the default kl is the forward's value (the backward cannot write into
    a compiled graph's output); the gradients equal eager ones."""
    x = make_inputs(lengths=[300, 50], requires_grad=True, seed=33)
    args = [x[n] for n in ("q", "k", "v", "qp", "kp")]

    def f(*a):
        return flashmsa.msa_attention(*a, 2, cu_seqlens=x["cu_seqlens"], max_seqlen=300)

    want = flashmsa.msa_attention(*args, 2, cu_seqlens=x["cu_seqlens"], max_seqlen=300, compute_kl=True)[1]
    torch._dynamo.reset()
    out, kl = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    assert kl.item() == want.item() > 0
    got = torch.autograd.grad(out.square().sum() + kl, args)
    out_e, kl_e = f(*args)
    ref = torch.autograd.grad(out_e.square().sum() + kl_e, args)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_autograd_function_matches_custom_op():
    """MSAFunction (the path on torch < 2.4) gives the same values and gradients."""
    args = fwd_args(L.MODE_SPARSE)
    outs = [A.MSAFunction.apply(*args), A.msa_fn(*args)]
    grads = []
    for out, lse, idx, plse, kl, _out_lo in outs:
        fin = torch.isfinite(lse)
        loss = out.square().sum() + torch.where(fin, lse, 0).sum() + 2 * kl
        grads.append(torch.autograd.grad(loss, args[:5]))
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a, b)
    for a, b in zip(*grads):
        assert torch.equal(a, b)
