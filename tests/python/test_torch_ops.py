"""flashmsa.msa_attention / msa_select on the CPU backend: agreement with flashmsa.reference,
with the independent numpy spec, varlen vs batched, gradcheck in fp64, kl and grad conventions."""
import math
import pathlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashmsa  # noqa: E402
import spec_numpy  # noqa: E402
from flashmsa import reference as R  # noqa: E402
from flashmsa.testing import make_inputs, rel_l2  # noqa: E402

PROXY = ("qp", "kp")
MAIN = ("q", "k", "v")
HEADS = {
    "gqa": dict(Hq=8, Hkv=4, Hp=2, Hpk=1),  # Hp < Hkv
    "hpk2": dict(Hq=4, Hkv=2, Hp=4, Hpk=2),  # G = 1, two proxy key heads
    "m3like": dict(Hq=16, Hkv=1, Hp=1, Hpk=1),
}
LENGTHS = [0, 300, 1, 129, 127]


def run(fn, x, mode, topk=2, indices=None, **kw):
    """(out, kl, lse, indices) of fn on the inputs dict x in one of the three modes."""
    extra = dict(warmup=mode == "warmup", indices=indices if mode == "given" else None)
    if "cu_seqlens" in x:
        extra.update(cu_seqlens=x["cu_seqlens"], max_seqlen=x["max_seqlen"])
    return fn(x["q"], x["k"], x["v"], x["qp"], x["kp"], topk, return_lse=True, return_indices=True,
              **extra, **kw)


def loss_of(out, kl, lse, seed=1):
    """A loss that uses out, lse (dlse) and kl (dkl = 3)."""
    g = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    w_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
    return (out * w_out).sum() + (torch.where(torch.isfinite(lse), lse, 0) * w_lse).sum() + 3.0 * kl


def grads(x, loss):
    names = [n for n in MAIN + PROXY if x[n].requires_grad]
    return dict(zip(names, torch.autograd.grad(loss, [x[n] for n in names])))


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("mode", ["sparse", "warmup", "given"])
def test_matches_reference_fp64(heads, mode):
    x = make_inputs(lengths=LENGTHS, D=8, Dp=8, requires_grad=True, seed=list(HEADS).index(heads) * 10 + len(mode), **HEADS[heads])
    given = R.msa_select(x["qp"], x["kp"], 3, cu_seqlens=x["cu_seqlens"]) if mode == "given" else None
    if given is not None:
        given[:, ::7, 0] = -1  # some empty slots
    got = run(flashmsa.msa_attention, x, mode, 3, given)
    want = run(R.msa_attention, x, mode, 3, given)
    for name, a, b in zip(("out", "kl", "lse"), got[:3], want[:3]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if name != "kl":  # (the training call's kl value comes with the backward)
            assert rel_l2(a, b) < 1e-12, name
    if mode == "sparse":
        assert torch.equal(got[3], want[3])
    ga, gb = grads(x, loss_of(*got[:3])), grads(x, loss_of(*want[:3]))
    for n in ga:
        assert rel_l2(ga[n], gb[n]) < 1e-10, n
    assert rel_l2(got[1], want[1]) < 1e-12, "kl (after the backward)"


@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_matches_numpy_spec(mode):
    """The independent numpy implementation (tests/python/spec_numpy.py) as a further oracle."""
    x = make_inputs(lengths=[0, 260, 1, 129], Hq=4, Hkv=2, Hp=2, Hpk=1, D=8, Dp=8, requires_grad=True, seed=5)
    out, kl, lse, idx = run(flashmsa.msa_attention, x, mode, topk=2)
    dout = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    dlse = torch.randn(lse.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    g = grads(x, (out * dout).sum() + (lse * dlse).sum() + 0.5 * kl)
    n = {k: x[k].detach().numpy() for k in MAIN + PROXY}
    want = spec_numpy.msa(n["q"], n["k"], n["v"], n["qp"], n["kp"], x["cu_seqlens"].numpy(), 2,
                          "warmup" if mode == "warmup" else "train", dout.numpy(), dlse=dlse.numpy(), kl_grad=0.5)
    assert np.allclose(out.detach().numpy(), want["out"], rtol=0, atol=1e-12)
    assert np.allclose(lse.detach().numpy(), want["lse"], rtol=0, atol=1e-12)
    assert abs(kl.item() - want["kl"]) < 1e-12
    if mode == "sparse":
        assert np.array_equal(idx.numpy(), want["indices"])
    for name in MAIN + PROXY:
        assert np.allclose(g[name].numpy(), want["d" + name], rtol=0, atol=1e-11), name


def test_selection_ties_and_proxy_lse():
    """Integer proxy inputs make many exact ties: the lower block index must win, everywhere."""
    x = make_inputs(lengths=[700, 129, 0, 5], Hp=4, Hpk=2, Dp=4, seed=3)
    g = torch.Generator().manual_seed(0)
    qp = torch.randint(-1, 2, x["qp"].shape, generator=g).double()
    kp = torch.randint(-1, 2, x["kp"].shape, generator=g).double()
    cu = x["cu_seqlens"]
    idx, plse = flashmsa.msa_select(qp, kp, 3, cu_seqlens=cu, max_seqlen=700, return_proxy_lse=True)
    ridx, rplse = R.msa_select(qp, kp, 3, cu_seqlens=cu, return_proxy_lse=True)
    assert torch.equal(idx, ridx)
    assert rel_l2(plse, rplse) < 1e-13
    for b in range(len(cu) - 1):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        if s1 > s0:
            want = spec_numpy.select(qp[s0:s1].numpy(), kp[s0:s1].numpy(), 3, 0.5)
            assert np.array_equal(idx[:, s0:s1].numpy(), want)
    # layout: slot n-1 is the local block, -1 padding after it
    row = idx[0, 0]  # token 0: only its own block
    assert row.tolist() == [0, -1, -1]


@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_varlen_equals_batched(mode):
    B, S = 3, 200
    xb = make_inputs(batch=B, seqlen=S, requires_grad=True, seed=11)
    xv = {n: t.detach().reshape(B * S, *t.shape[2:]).requires_grad_() for n, t in xb.items()}
    xv["cu_seqlens"] = torch.arange(0, (B + 1) * S, S, dtype=torch.int32)
    xv["max_seqlen"] = S
    rb, rv = run(flashmsa.msa_attention, xb, mode), run(flashmsa.msa_attention, xv, mode)
    assert rb[0].shape == (B, S, 4, 16) and rv[0].shape == (B * S, 4, 16)
    assert torch.equal(rb[0].reshape(B * S, 4, 16), rv[0])
    for a, b in zip(rb[2:], rv[2:]):  # lse, indices
        assert (a is None and b is None) or torch.equal(a, b)
    gb, gv = grads(xb, loss_of(*rb[:3])), grads(xv, loss_of(*rv[:3]))
    for n in gb:
        assert rel_l2(gb[n].reshape(gv[n].shape), gv[n]) < 1e-14, n
    assert torch.equal(rb[1], rv[1])  # kl, filled in by the backwards


def test_strided_views():
    """Token/head strides of packed projections pass through as they are (no copies)."""
    T, Hq, Hkv, Hp, D = 300, 4, 2, 2, 16
    g = torch.Generator().manual_seed(4)
    packed = torch.randn(T, Hq + 2 * Hkv + Hp + 1, D, dtype=torch.float64, generator=g)
    q, k, v, qp, kp = packed.split([Hq, Hkv, Hkv, Hp, 1], dim=1)
    assert not q.is_contiguous()
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    a = flashmsa.msa_attention(q, k, v, qp, kp, 2, cu_seqlens=cu, max_seqlen=200, return_lse=True)
    b = flashmsa.msa_attention(*(t.contiguous() for t in (q, k, v, qp, kp)), 2, cu_seqlens=cu,
                               max_seqlen=200, return_lse=True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_gradcheck_main_fp64():
    """d(out, lse)/d(q, k, v): sparse, varlen, two blocks so the selection matters."""
    x = make_inputs(lengths=[260, 3], Hq=2, Hkv=1, Hp=1, Hpk=1, D=4, Dp=4, seed=7)
    cu = x["cu_seqlens"]

    def f(q, k, v):
        out, kl, lse = flashmsa.msa_attention(q, k, v, x["qp"], x["kp"], 2, cu_seqlens=cu, max_seqlen=260,
                                              return_lse=True)
        return out, lse

    inputs = [x[n].detach().requires_grad_() for n in MAIN]
    assert torch.autograd.gradcheck(f, inputs, fast_mode=True, atol=1e-8)


@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_gradcheck_kl_fp64(mode):
    """d kl/d(qp, kp) is the true derivative (the teacher does not depend on qp, kp)."""
    x = make_inputs(lengths=[200, 40], Hq=2, Hkv=1, Hp=2, Hpk=1, D=4, Dp=4, seed=8)

    def f(qp, kp):
        return flashmsa.msa_attention(x["q"], x["k"], x["v"], qp, kp, 1, cu_seqlens=x["cu_seqlens"],
                                      max_seqlen=200, warmup=mode == "warmup", compute_kl=True)[1]

    inputs = [x[n].detach().requires_grad_() for n in PROXY]
    assert torch.autograd.gradcheck(f, inputs, fast_mode=True, atol=1e-9)


def test_gradcheck_given_full_jacobian_tiny():
    """Full (slow-mode) gradcheck on a tiny given-indices case, with an empty slot row."""
    x = make_inputs(lengths=[6, 3], Hq=2, Hkv=1, Hp=1, Hpk=1, D=2, Dp=2, seed=9)
    idx = torch.zeros(1, 9, 1, dtype=torch.int32)
    idx[0, 4] = -1  # token 4 attends to nothing: out 0, lse -inf, zero gradients

    def f(q, k, v, qp, kp):
        out, kl, lse = flashmsa.msa_attention(q, k, v, qp, kp, cu_seqlens=x["cu_seqlens"], max_seqlen=6,
                                              indices=idx, return_lse=True)
        return out, torch.where(torch.isfinite(lse), lse, 0)

    inputs = [x[n].detach().requires_grad_() for n in MAIN + PROXY]
    assert torch.autograd.gradcheck(f, inputs)
    out, _, lse = flashmsa.msa_attention(*inputs, cu_seqlens=x["cu_seqlens"], max_seqlen=6, indices=idx,
                                         return_lse=True)
    assert torch.all(out[4] == 0) and lse[:, 4].eq(float("-inf")).all()


def test_kl_placeholder_and_gradient_routing():
    x = make_inputs(lengths=[300, 50], requires_grad=True, seed=12)
    kw = dict(cu_seqlens=x["cu_seqlens"], max_seqlen=300)
    args = [x[n] for n in MAIN + PROXY]
    out, kl = flashmsa.msa_attention(*args, 2, compute_kl=True, **kw)
    _, kl0 = flashmsa.msa_attention(*args, 2, compute_kl=False, **kw)
    with torch.no_grad():  # no backward will follow: the forward computes the value
        _, kl_auto = flashmsa.msa_attention(*args, 2, **kw)
    assert kl.item() > 0 and kl0.item() == 0.0 and kl_auto.item() == kl.item()  # the CPU computes kl
    # the placeholder's gradient is the value's gradient
    g1 = torch.autograd.grad(2.0 * kl, args)
    g0 = torch.autograd.grad(2.0 * kl0, args)
    for a, b in zip(g1, g0):
        assert torch.equal(a, b)
    # kl trains the proxy only; out trains the main heads only
    assert all(g.abs().max() == 0 for g in g1[:3]) and all(g.abs().max() > 0 for g in g1[3:])
    out, kl = flashmsa.msa_attention(*args, 2, **kw)
    g = torch.autograd.grad(out.square().sum(), args)
    assert all(t.abs().max() > 0 for t in g[:3]) and all(t.abs().max() == 0 for t in g[3:])


@pytest.mark.parametrize("mode", ["sparse", "given", "warmup"])
def test_kl_from_the_backward(mode):
    """The default training call: kl reads NaN after the forward (no kl pass: it holds no value
    yet), and after the backward holds the forward's value (bitwise on the CPU); the gradients
    equal those of the forward-kl call (the gradient never depends on kl's value); without a kl
    gradient the value still comes and the proxy gradients stay zero; compute_kl=False stays 0."""
    x = make_inputs(lengths=[300, 50, 0], requires_grad=True, seed=31)
    idx = flashmsa.msa_select(x["qp"], x["kp"], 2, cu_seqlens=x["cu_seqlens"], max_seqlen=300)
    args = [x[n] for n in MAIN + PROXY]
    _, want, _, _ = run(flashmsa.msa_attention, x, mode, indices=idx, compute_kl=True)
    assert want.item() > 0
    out, kl, lse, _ = run(flashmsa.msa_attention, x, mode, indices=idx)
    assert math.isnan(kl.item())  # nothing computed yet
    loss = loss_of(out, kl, lse)
    assert math.isnan(loss.item())  # a task + kl read before the backward is NaN, not a number to log
    got = torch.autograd.grad(loss, args)
    assert kl.item() == want.item()
    assert math.isnan(loss.item())  # a loss built in the forward keeps the NaN: only kl itself is filled in
    out_f, kl_f, lse_f, _ = run(flashmsa.msa_attention, x, mode, indices=idx, compute_kl=True)
    ref = torch.autograd.grad(loss_of(out_f, kl_f, lse_f), args)
    for n, a, b in zip(MAIN + PROXY, got, ref):
        assert torch.equal(a, b), n
    # no kl gradient (kl not in the loss): the value still comes, no proxy gradient
    out, kl, lse, _ = run(flashmsa.msa_attention, x, mode, indices=idx)
    g = torch.autograd.grad(out.square().sum(), args)
    assert kl.item() == want.item() and all(t.abs().max() == 0 for t in g[3:])
    # the placeholder is never filled
    out, kl0, lse, _ = run(flashmsa.msa_attention, x, mode, indices=idx, compute_kl=False)
    torch.autograd.grad(loss_of(out, kl0, lse), args)
    assert kl0.item() == 0.0


def test_kl_from_the_backward_under_activation_checkpointing():
    """torch.utils.checkpoint (non-reentrant, the default): the backward recomputes the forward,
    and the kl tensor the caller holds still gets the value."""
    from torch.utils.checkpoint import checkpoint

    x = make_inputs(lengths=[300, 50], requires_grad=True, seed=32)
    args = [x[n] for n in MAIN + PROXY]
    kw = dict(cu_seqlens=x["cu_seqlens"], max_seqlen=300)
    want = flashmsa.msa_attention(*args, 2, compute_kl=True, **kw)[1].item()
    out, kl = checkpoint(lambda *a: flashmsa.msa_attention(*a, 2, **kw), *args, use_reentrant=False)
    assert math.isnan(kl.item())
    (out.square().sum() + kl).backward()
    assert kl.item() == want and x["qp"].grad.abs().max() > 0


def test_kl_reads_nan_until_the_backward_fills_it():
    """The deferred kl of a training call holds no value before the backward: it reads NaN (a
    value that cannot pass for a kl), the backward writes the value into the same tensor, and the
    gradient is the one of the forward-kl call (it never depended on the value)."""
    x = make_inputs(lengths=[300, 50], requires_grad=True, seed=33)
    args = [x[n] for n in MAIN + PROXY]
    kw = dict(cu_seqlens=x["cu_seqlens"], max_seqlen=300)
    out_f, kl_f = flashmsa.msa_attention(*args, 2, compute_kl=True, **kw)
    want = torch.autograd.grad(out_f.square().sum() + 0.5 * kl_f, args)
    out, kl = flashmsa.msa_attention(*args, 2, **kw)
    assert math.isnan(kl.item())
    task = out.square().sum()
    got = torch.autograd.grad(task + 0.5 * kl, args)
    assert kl.item() == kl_f.item() > 0
    for n, a, b in zip(MAIN + PROXY, got, want):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("mode", ["sparse", "warmup", "given"])
@pytest.mark.parametrize("name", ["q", "k", "qp", "kp"])
def test_nan_input_makes_kl_nan(mode, name):
    """A NaN in one element of q, k, qp or kp makes the kl value NaN: the forward's, and the one
    the backward fills in; the proxy gradient of the rows the NaN reaches is NaN too (value and
    gradient agree), the other sequence's stays finite. The eager reference agrees. A query row
    (token 150 of sequence 0) for q and qp; a key (token 20) that every row of block 0 sees for
    k and kp."""
    x = make_inputs(lengths=[300, 200], seed=41)
    kw = dict(cu_seqlens=x["cu_seqlens"], max_seqlen=300)
    idx = flashmsa.msa_select(x["qp"], x["kp"], 2, **kw) if mode == "given" else None
    x[name][20 if name.startswith("k") else 150, 0, 1] = float("nan")
    for n in MAIN + PROXY:
        x[n].requires_grad_()
    for fn in (flashmsa.msa_attention, R.msa_attention):
        assert math.isnan(run(fn, x, mode, indices=idx, compute_kl=True)[1].item()), fn.__module__
        out, kl, lse, _ = run(fn, x, mode, indices=idx)
        dqp, dkp = torch.autograd.grad(kl, [x["qp"], x["kp"]])
        assert math.isnan(kl.item()), fn.__module__
        assert dqp[:300].isnan().any(), fn.__module__
        assert dqp[300:].isfinite().all() and dkp[300:].isfinite().all(), fn.__module__
    # without the NaN the value is finite: the NaN is what makes it NaN
    with torch.no_grad():
        x[name][20 if name.startswith("k") else 150, 0, 1] = 0.5
    assert math.isfinite(run(flashmsa.msa_attention, x, mode, indices=idx, compute_kl=True)[1].item())


def test_numpy_spec_kl_is_nan_for_a_nan_teacher():
    """The numpy spec's kl rule: an exact zero teacher adds 0 (0 log 0 = 0), a NaN one makes kl NaN."""
    x = make_inputs(lengths=[130], Hq=2, Hkv=1, Hp=1, Hpk=1, D=4, Dp=4, seed=42)
    a = {n: x[n].numpy().copy() for n in MAIN + PROXY}
    dout = np.zeros_like(a["q"])
    cu = x["cu_seqlens"].numpy()
    assert np.isfinite(spec_numpy.msa(a["q"], a["k"], a["v"], a["qp"], a["kp"], cu, 2, "warmup", dout)["kl"])
    a["q"][100, 0, 1] = np.nan
    assert np.isnan(spec_numpy.msa(a["q"], a["k"], a["v"], a["qp"], a["kp"], cu, 2, "warmup", dout)["kl"])


def spy_kernel(monkeypatch, seen, name, what):
    """Wraps flashmsa._kernels.<name> (the library calls): each call appends what(args) to seen."""
    from flashmsa import _kernels as K

    orig = getattr(K, name)

    def spy(*a):
        seen.append(what(a))
        return orig(*a)

    monkeypatch.setattr(K, name, spy)


def test_numerics_follow_requires_grad(monkeypatch):
    seen = []
    from flashmsa import _autograd as A

    spy_kernel(monkeypatch, seen, "fwd", lambda a: a[A.FWD_ARGS.index("numerics")])
    x = make_inputs(batch=1, seqlen=130, seed=13)
    args = [x[n] for n in MAIN + PROXY]
    flashmsa.msa_attention(*args, 2)
    flashmsa.msa_attention(*[t.requires_grad_() if i == 4 else t for i, t in enumerate(args)], 2)
    with torch.no_grad():
        flashmsa.msa_attention(*args, 2)
    flashmsa.msa_attention(*args, 2, numerics="infer")
    assert seen == [1, 0, 1, 1]  # INFER, TRAIN (kp requires grad), INFER (no_grad), explicit


def test_precise_dpsum_passes_out_lo(monkeypatch):
    """precise_dpsum=True (training): the forward asks for out_lo and the backward receives it;
    the CPU backend's dpsum uses its exact fp64 output, so the gradients are unchanged."""
    seen = []
    from flashmsa import _autograd as A

    lo_f, lo_b = A.FWD_ARGS.index("want_out_lo"), A.BWD_ARGS.index("out_lo")
    spy_kernel(monkeypatch, seen, "fwd", lambda a: ("fwd", a[lo_f]))
    spy_kernel(monkeypatch, seen, "bwd", lambda a: ("bwd", a[lo_b] is not None and a[lo_b].numel() > 0))
    x = make_inputs(lengths=[300, 40], dtype=torch.bfloat16, requires_grad=True, seed=16)
    args = [x[n] for n in MAIN + PROXY]
    kw = dict(cu_seqlens=x["cu_seqlens"], max_seqlen=x["max_seqlen"])
    grads = []
    for precise in (False, True):
        out, kl = flashmsa.msa_attention(*args, 2, precise_dpsum=precise, **kw)
        grads.append(torch.autograd.grad(out.float().square().sum() + kl, args))
    assert seen == [("fwd", False), ("bwd", False), ("fwd", True), ("bwd", True)]
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    with torch.no_grad():  # inference: nothing to keep
        seen.clear()
        flashmsa.msa_attention(*args, 2, precise_dpsum=True, **kw)
        assert seen == [("fwd", False)]
    with pytest.raises(TypeError, match="precise_dpsum"):
        flashmsa.msa_attention(*args, 2, precise_dpsum=1, **kw)


def test_deterministic_follows_torch_setting(monkeypatch):
    """torch.use_deterministic_algorithms(True) reaches the library's bwd call as deterministic=1;
    the gradients are those of the default backward (the CPU backend is deterministic anyway)."""
    seen = []
    from flashmsa import _autograd as A

    spy_kernel(monkeypatch, seen, "bwd", lambda a: a[A.BWD_ARGS.index("deterministic")])
    x = make_inputs(lengths=[300, 40], requires_grad=True, seed=15)
    args = [x[n] for n in MAIN + PROXY]
    grads = []
    before = torch.are_deterministic_algorithms_enabled()
    for det in (False, True):
        torch.use_deterministic_algorithms(det)
        try:
            out, kl = flashmsa.msa_attention(*args, 2, cu_seqlens=x["cu_seqlens"], max_seqlen=x["max_seqlen"])
            grads.append(torch.autograd.grad(out.square().sum() + kl, args))
        finally:
            torch.use_deterministic_algorithms(before)
    assert seen == [False, True]
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_inputs_on_cpu(dtype):
    """bf16/fp16/fp32 inputs: the CPU backend computes in fp64 and rounds once."""
    x = make_inputs(lengths=[300, 70], dtype=dtype, requires_grad=True, seed=14)
    out, kl, lse, idx = run(flashmsa.msa_attention, x, "sparse")
    assert out.dtype == dtype and lse.dtype == torch.float32 and kl.dtype == torch.float32
    ref = run(R.msa_attention, {**x, **{n: x[n].double() for n in MAIN + PROXY}}, "given", indices=idx)
    assert rel_l2(out, ref[0]) < 2 * rel_l2(ref[0].to(dtype), ref[0]) + 1e-6
    assert rel_l2(lse, ref[2]) < 1e-6
    g = grads(x, loss_of(out, kl, lse))
    assert all(t.dtype == dtype and torch.isfinite(t).all() for t in g.values())


def test_reference_ignores_autocast():
    """flashmsa.reference computes in fp32 inside a bf16 autocast region too (autocast would run its
    einsums in bf16: recall and out moved by ~1e-2 before the reference switched it off)."""
    x = make_inputs(batch=1, seqlen=300, dtype=torch.float32, seed=21)
    idx = R.msa_select(x["qp"], x["kp"], 2)
    plain = (R.msa_attention(x["q"], x["k"], x["v"], x["qp"], x["kp"], topk=2)[0],
             R.attention_mass_recall(x["q"], x["k"], idx))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled("cpu")
        cast = (R.msa_attention(x["q"], x["k"], x["v"], x["qp"], x["kp"], topk=2)[0],
                R.attention_mass_recall(x["q"], x["k"], idx))
        assert torch.is_autocast_enabled("cpu"), "the caller's autocast state must be restored"
    for a, b in zip(plain, cast):
        assert a.dtype == b.dtype == torch.float32
        assert torch.equal(a, b)


def test_empty_inputs():
    x = make_inputs(lengths=[0, 0], requires_grad=True)
    out, kl, lse, idx = run(flashmsa.msa_attention, x, "sparse")
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0) and idx.shape == (2, 0, 2)
    assert math.isnan(kl.item())  # training: filled in by the backward
    (out.sum() + kl).backward()
    assert kl.item() == 0  # no rows: kl = 0
    assert x["q"].grad.shape == (0, 4, 16)
