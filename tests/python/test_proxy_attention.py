"""flashmsa.proxy_attention (the jointly trained indexer's output, docs/semantics.md "Joint indexer") and
MSAttention(proxy_output=True) against an independent fp64 torch formulation: softmax(proxy_scale qp kp^T) vp over
the causal keys of the selected blocks (every causal key in warmup), values and gradients of qp, kp, vp; the CUDA
backend against the CPU backend."""
import math
import os
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))
import flashmsa  # noqa: E402
from flashmsa.testing import make_inputs, rel_l2  # noqa: E402

BK = flashmsa.BLOCK_SIZE


def dense_proxy_attention(qp, kp, vp, indices, cu, scale):
    """The formulation itself, per sequence, proxy head and row: every causal key whose block the row selected."""
    out = torch.zeros(qp.shape[0], qp.shape[1], vp.shape[2], dtype=torch.float64)
    Hp, Hpk = qp.shape[1], kp.shape[1]
    for s in range(len(cu) - 1):
        a, b = int(cu[s]), int(cu[s + 1])
        L = b - a
        pos = torch.arange(L)
        for h in range(Hp):
            z = scale * qp[a:b, h].double() @ kp[a:b, h * Hpk // Hp].double().T
            allowed = pos[None, :] <= pos[:, None]
            if indices is not None:
                blocks = indices[h, a:b].long()                             # [L, topk], -1 padding
                sel = torch.zeros(L, (L + BK - 1) // BK + 1, dtype=torch.bool)
                sel.scatter_(1, torch.where(blocks >= 0, blocks, sel.shape[1] - 1), True)
                allowed = allowed & sel[:, pos // BK]
            p = torch.softmax(z.masked_fill(~allowed, -math.inf), dim=-1)
            out[a:b, h] = p @ vp[a:b, h * Hpk // Hp].double()
    return out


def inputs(seed, lengths=(300, 1, 0, 129, 257), Hp=4, Hpk=2, dtype=torch.float64, device="cpu", D=16):
    x = make_inputs(lengths=list(lengths), Hq=8, Hkv=2, Hp=Hp, Hpk=Hpk, D=D, Dp=D, dtype=dtype, seed=seed,
                    requires_grad=True, device=device)
    g = torch.Generator().manual_seed(seed + 100)
    vp = torch.randn(x["kp"].shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    return x, vp.requires_grad_()


@pytest.mark.parametrize("warmup", [False, True])
def test_values_and_gradients_match_the_formulation(warmup):
    x, vp = inputs(seed=7)
    cu = x["cu_seqlens"]
    _, _, idx = flashmsa.msa_attention(x["q"], x["k"], x["v"], x["qp"], x["kp"], topk=2, cu_seqlens=cu,
                                       max_seqlen=x["max_seqlen"], return_indices=True)
    indices = None if warmup else idx
    out = flashmsa.proxy_attention(x["qp"], x["kp"], vp, indices, cu_seqlens=cu, max_seqlen=x["max_seqlen"],
                                   warmup=warmup)
    scale = 16 ** -0.5
    ref = dense_proxy_attention(x["qp"], x["kp"], vp, indices, cu.tolist(), scale)
    assert out.shape == x["qp"].shape and out.dtype == x["qp"].dtype
    assert rel_l2(out, ref) <= 1e-12
    if not warmup:  # the selection matters: attending every causal key instead differs
        assert rel_l2(dense_proxy_attention(x["qp"], x["kp"], vp, None, cu.tolist(), scale), ref) > 1e-3
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = torch.autograd.grad(out, (x["qp"], x["kp"], vp), g)
    leaves = [t.detach().clone().requires_grad_() for t in (x["qp"], x["kp"], vp)]
    want = torch.autograd.grad(dense_proxy_attention(*leaves, indices, cu.tolist(), scale), leaves, g)
    for name, a, b in zip(("dqp", "dkp", "dvp"), got, want):
        assert rel_l2(a, b) <= 1e-10, name


def test_bad_input():
    x, vp = inputs(seed=2)
    kw = dict(cu_seqlens=x["cu_seqlens"], max_seqlen=x["max_seqlen"])
    with pytest.raises(ValueError, match="indices: the selection"):
        flashmsa.proxy_attention(x["qp"], x["kp"], vp, **kw)
    with pytest.raises(ValueError, match="vp: expected kp's shape"):
        flashmsa.proxy_attention(x["qp"], x["kp"], vp[:, :1], warmup=True, **kw)      # vp heads != kp heads
    with pytest.raises(TypeError, match="vp: expected kp's dtype"):
        flashmsa.proxy_attention(x["qp"], x["kp"], vp.float(), warmup=True, **kw)     # dtype
    _, _, idx = flashmsa.msa_attention(x["q"], x["k"], x["v"], x["qp"], x["kp"], topk=2, return_indices=True, **kw)
    with pytest.raises(ValueError, match="indices: expected .Hp, total, topk. with Hp = qp's 4 heads"):
        flashmsa.proxy_attention(x["qp"], x["kp"], vp, idx[:1], **kw)                 # indices heads != Hp
    with pytest.raises(ValueError, match="qp, kp, vp and proxy_scale run as"):
        flashmsa.proxy_attention(x["qp"], x["kp"], vp, idx, warmup=True, **kw)        # a selection and warmup
    with pytest.raises(ValueError, match="qp: expected"):
        flashmsa.proxy_attention(x["qp"][0, 0], x["kp"], vp, idx, **kw)               # rank


@pytest.mark.parametrize("warmup", [False, True])
def test_batched_equals_varlen(warmup):
    x = make_inputs(batch=2, seqlen=200, Hq=8, Hkv=2, Hp=4, Hpk=2, D=16, Dp=16, seed=9, requires_grad=True)
    vp = torch.randn(x["kp"].shape, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    idx = None
    if not warmup:
        _, _, idx = flashmsa.msa_attention(x["q"], x["k"], x["v"], x["qp"], x["kp"], topk=1, return_indices=True)
    out = flashmsa.proxy_attention(x["qp"], x["kp"], vp, idx, warmup=warmup)
    assert out.shape == x["qp"].shape
    cu = torch.tensor([0, 200, 400], dtype=torch.int32)
    flat = flashmsa.proxy_attention(x["qp"].reshape(400, 4, 16), x["kp"].reshape(400, 2, 16), vp.reshape(400, 2, 16),
                                    idx, cu_seqlens=cu, max_seqlen=200, warmup=warmup)
    assert rel_l2(out.reshape(400, 4, 16), flat) <= 1e-14
    ref = dense_proxy_attention(x["qp"].reshape(400, 4, 16), x["kp"].reshape(400, 2, 16), vp.reshape(400, 2, 16),
                                idx, [0, 200, 400], 16 ** -0.5)
    assert rel_l2(flat, ref) <= 1e-12


@pytest.mark.skipif(not flashmsa.cuda_available(), reason="no CUDA device")
def test_cuda_equals_the_cpu_backend():
    x, vp = inputs(seed=5, lengths=(1000, 0, 517, 129), Hp=4, Hpk=1, dtype=torch.bfloat16, D=128)  # CUDA: D = 128
    cu = x["cu_seqlens"]
    _, _, idx = flashmsa.msa_attention(x["q"], x["k"], x["v"], x["qp"], x["kp"], topk=4, cu_seqlens=cu,
                                       max_seqlen=x["max_seqlen"], return_indices=True)
    ref = flashmsa.proxy_attention(x["qp"], x["kp"], vp, idx, cu_seqlens=cu, max_seqlen=x["max_seqlen"])
    dev = [t.detach().cuda().requires_grad_() for t in (x["qp"], x["kp"], vp)]
    out = flashmsa.proxy_attention(*dev, idx.cuda(), cu_seqlens=cu.cuda(), max_seqlen=x["max_seqlen"])
    assert rel_l2(out.cpu().double(), ref.double()) <= 2e-2
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(6)).to(ref.dtype)
    want = torch.autograd.grad(ref, (x["qp"], x["kp"], vp), g)
    got = torch.autograd.grad(out, dev, g.cuda())
    for name, a, b in zip(("dqp", "dkp", "dvp"), got, want):
        assert rel_l2(a.cpu().double(), b.double()) <= 3e-2, name
    # warmup (dense) mode: every causal key
    ref = flashmsa.proxy_attention(x["qp"], x["kp"], vp, cu_seqlens=cu, max_seqlen=x["max_seqlen"], warmup=True)
    out = flashmsa.proxy_attention(*dev, cu_seqlens=cu.cuda(), max_seqlen=x["max_seqlen"], warmup=True)
    assert rel_l2(out.cpu().double(), ref.double()) <= 2e-2


@pytest.mark.parametrize("warmup", [False, True])
def test_module_proxy_output(warmup):
    from flashmsa.nn import MSAttention
    torch.manual_seed(0)
    kw = dict(num_kv_heads=2, num_proxy_heads=2, head_dim=16, topk=2, kl_coef=0.0, warmup=warmup,
              proxy_output=True, bias=True, dtype=torch.float64)
    m = MSAttention(64, 4, **kw)
    r = MSAttention(64, 4, backend="reference", **kw)
    r.load_state_dict(m.state_dict())
    assert float(m.po_proj.weight.detach().abs().max()) == 0 == float(m.po_proj.bias.detach().abs().max())
    plain = MSAttention(64, 4, **{**kw, "proxy_output": False})
    plain.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith(("vp_", "po_"))})
    x = torch.randn(300 + 129, 64, dtype=torch.float64)
    cu = torch.tensor([0, 300, 429], dtype=torch.int32)
    assert torch.equal(m(x, cu, 300)[0], plain(x, cu, 300)[0])
    for mod in (m, r):
        torch.nn.init.normal_(mod.po_proj.weight, generator=torch.Generator().manual_seed(4))
    ys = []
    for mod in (m, r):
        y, kl = mod(x, cu, 300)
        (y.square().mean() + 0 * kl).backward()
        ys.append(y)
    assert rel_l2(ys[0], ys[1]) <= 1e-12
    for name in ("qp_proj", "kp_proj", "vp_proj", "po_proj"):
        ga, gb = getattr(m, name).weight.grad, getattr(r, name).weight.grad
        assert ga is not None and float(ga.abs().max()) > 0, name  # the task loss trains the proxy (kl_coef 0)
        assert rel_l2(ga, gb) <= 1e-10, name
