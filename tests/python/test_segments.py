"""Query segments through the Python API (msa_attention / msa_select with cu_seqlens_q, q_origin):
the rows of a whole call split over "ranks" as chunks against all keys give the whole call's rows,
its kl as the row-weighted mean and, under autograd, its gradients (key gradients summed over the
ranks); bad segment arguments raise clear errors. CPU backend, fp64."""
import pytest

torch = pytest.importorskip("torch")

import flashmsa  # noqa: E402
from flashmsa.testing import make_inputs  # noqa: E402


def _segments(chunks, cu):
    """cu_seqlens_q, q_origin and the whole call's rows of chunks [(sequence, first position, length)]."""
    rows, cuq = [], [0]
    for b, pos, n in chunks:
        rows += list(range(int(cu[b]) + pos, int(cu[b]) + pos + n))
        cuq.append(len(rows))
    origin = torch.tensor([[b, pos] for b, pos, _ in chunks], dtype=torch.int32).reshape(-1, 2)
    return torch.tensor(cuq, dtype=torch.int32), origin, torch.tensor(rows, dtype=torch.long)


LENGTHS = [300, 0, 129, 260]
# three "ranks": chunks of the sequences at positions that are not block multiples, out of order
RANKS = [[(3, 200, 60), (0, 0, 77), (2, 0, 0)],
         [(0, 77, 150), (3, 0, 130), (2, 100, 29)],
         [(2, 0, 100), (0, 227, 73), (3, 130, 70)]]


@pytest.mark.parametrize("mode", ["sparse", "warmup", "given"])
def test_ranks_equal_the_whole_call(mode):
    x = make_inputs(lengths=LENGTHS, D=8, Dp=8, requires_grad=True, seed=41)
    cu, ms = x["cu_seqlens"], x["max_seqlen"]
    main, proxy = [x[n] for n in ("q", "k", "v")], [x[n] for n in ("qp", "kp")]
    kw = dict(cu_seqlens=cu, max_seqlen=ms, warmup=mode == "warmup")
    if mode == "given":
        kw["indices"] = flashmsa.msa_select(x["qp"].detach(), x["kp"].detach(), 3, cu_seqlens=cu, max_seqlen=ms)
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(x["q"].shape, generator=g, dtype=torch.float64)
    out, kl, lse, *idx = flashmsa.msa_attention(*main, *proxy, 3, return_lse=True, compute_kl=True,
                                                return_indices=mode != "warmup", **kw)
    total = x["q"].shape[0]
    want = torch.autograd.grad((out * dout).sum() + 0.7 * kl, main + proxy)
    got = [torch.zeros_like(t) for t in main + proxy]
    kl_sum = 0.0
    for chunks in RANKS:
        cuq, origin, rows = _segments(chunks, cu)
        q_r, qp_r = x["q"].detach()[rows].requires_grad_(), x["qp"].detach()[rows].requires_grad_()
        k_r, v_r, kp_r = (x[n].detach().requires_grad_() for n in ("k", "v", "kp"))
        kw_r = dict(kw, cu_seqlens_q=cuq, q_origin=origin)
        if mode == "given":
            kw_r["indices"] = kw["indices"][:, rows]
        o_r, kl_r, lse_r, *idx_r = flashmsa.msa_attention(q_r, k_r, v_r, qp_r, kp_r, 3, return_lse=True,
                                                          compute_kl=True, return_indices=mode != "warmup", **kw_r)
        assert torch.equal(o_r, out.detach()[rows]) and torch.equal(lse_r, lse.detach()[:, rows])
        if idx:
            assert torch.equal(idx_r[0], idx[0][:, rows])
        share = len(rows) / total  # the rank's kl is the mean over its rows
        kl_sum += kl_r.item() * share
        gr = torch.autograd.grad((o_r * dout[rows]).sum() + 0.7 * share * kl_r, [q_r, k_r, v_r, qp_r, kp_r])
        torch.testing.assert_close(gr[0], want[0][rows], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(gr[3], want[3][rows], rtol=1e-12, atol=1e-14)
        for i in (1, 2, 4):
            got[i] += gr[i]
    assert kl.item() > 0 and kl_sum == pytest.approx(kl.item(), rel=1e-12)
    for i, name in ((1, "dk"), (2, "dv"), (4, "dkp")):
        torch.testing.assert_close(got[i], want[i], rtol=1e-11, atol=1e-13, msg=name)


def test_select_with_segments():
    x = make_inputs(lengths=LENGTHS, D=8, Dp=8, seed=42)
    cu = x["cu_seqlens"]
    whole, plse = flashmsa.msa_select(x["qp"], x["kp"], 4, cu_seqlens=cu, return_proxy_lse=True)
    cuq, origin, rows = _segments(RANKS[1], cu)
    got, plse_r = flashmsa.msa_select(x["qp"][rows], x["kp"], 4, cu_seqlens=cu, cu_seqlens_q=cuq, q_origin=origin,
                                      return_proxy_lse=True)
    assert torch.equal(got, whole[:, rows]) and torch.equal(plse_r, plse[:, rows])


def test_bad_segments():
    x = make_inputs(lengths=[300, 129], D=8, Dp=8, seed=43)
    cu = x["cu_seqlens"]
    cuq, origin, rows = _segments([(0, 100, 150), (1, 0, 129)], cu)
    q, qp = x["q"][rows], x["qp"][rows]

    def call(k=x["k"], v=x["v"], kp=x["kp"], **kw):
        args = dict(cu_seqlens=cu, cu_seqlens_q=cuq, q_origin=origin)
        args.update(kw)
        return flashmsa.msa_attention(q, k, v, qp, kp, 3, **args)

    with pytest.raises(ValueError, match="q_origin: needs cu_seqlens_q"):
        call(cu_seqlens_q=None)
    with pytest.raises(ValueError, match="q_origin: is required with cu_seqlens_q"):
        call(q_origin=None)
    with pytest.raises(TypeError, match="cu_seqlens_q: expected dtype torch.int32"):
        call(cu_seqlens_q=cuq.long())
    with pytest.raises(ValueError, match=r"q_origin: expected 2 dimensions \[S, 2\]"):
        call(q_origin=origin.reshape(-1))
    with pytest.raises(ValueError, match=r"q_origin: expected shape \[2, 2\]"):
        call(q_origin=origin[:, :1].contiguous())
    with pytest.raises(ValueError, match=r"positions \[200, 350\) of its 150 queries are outside \[0, 300\)"):
        call(q_origin=torch.tensor([[0, 200], [1, 0]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"key sequence 2 is outside \[0, 2\)"):
        call(q_origin=torch.tensor([[0, 100], [2, 0]], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen_q: expected >= every segment length"):
        call(max_seqlen_q=100)
    with pytest.raises(ValueError, match=r"expected the last value to equal total_q = 279"):
        call(cu_seqlens_q=torch.tensor([0, 150, 200], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"expected the last value to equal total = 428 \(tokens in k\)"):
        call(k=x["k"][:-1], v=x["v"][:-1], kp=x["kp"][:-1])
    with pytest.raises(ValueError, match="v: expected total_k = 429 key tokens"):
        call(v=x["v"][:-1])
    xb = make_inputs(batch=2, seqlen=200, D=8, Dp=8, seed=44)
    with pytest.raises(ValueError, match="cu_seqlens_q: needs varlen"):
        flashmsa.msa_attention(xb["q"], xb["k"], xb["v"], xb["qp"], xb["kp"], 3, cu_seqlens_q=cuq, q_origin=origin)


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA backend's segments: needs a GPU")
@pytest.mark.parametrize("mode", ["sparse", "given"])
def test_ranks_equal_the_whole_call_cuda(mode):
    """The same split on the CUDA backend (bf16, head dim 128, m3-like 16/4/4/1 heads): rows of out and lse equal the
    whole call's, dq and dqp rows and the summed dk, dv, dkp within fp32 summation order of it, the kl the row-weighted
    mean. The warmup mode's backward refuses segments on CUDA so far (NotSupportedError, before anything runs)."""
    x = make_inputs(lengths=LENGTHS, Hq=16, Hkv=4, Hp=4, D=128, Dp=128, dtype=torch.bfloat16, device="cuda",
                    requires_grad=True, seed=43)
    cu, ms = x["cu_seqlens"], x["max_seqlen"]
    main, proxy = [x[n] for n in ("q", "k", "v")], [x[n] for n in ("qp", "kp")]
    kw = dict(cu_seqlens=cu, max_seqlen=ms)
    if mode == "given":
        kw["indices"] = flashmsa.msa_select(x["qp"].detach(), x["kp"].detach(), 3, cu_seqlens=cu, max_seqlen=ms)
    dout = torch.randn(x["q"].shape, generator=torch.Generator(device="cuda").manual_seed(5), device="cuda",
                       dtype=torch.bfloat16)
    out, kl, lse = flashmsa.msa_attention(*main, *proxy, 3, return_lse=True, compute_kl=True, **kw)
    total = x["q"].shape[0]
    want = torch.autograd.grad([out, 0.7 * kl], main + proxy, [dout, torch.ones_like(kl)])
    got = [torch.zeros_like(t, dtype=torch.float32) for t in main + proxy]
    kl_sum = 0.0
    for chunks in RANKS:
        cuq, origin, rows = _segments(chunks, cu.cpu())
        cuq, origin, rows = cuq.cuda(), origin.cuda(), rows.cuda()
        q_r, qp_r = x["q"].detach()[rows].requires_grad_(), x["qp"].detach()[rows].requires_grad_()
        k_r, v_r, kp_r = (x[n].detach().requires_grad_() for n in ("k", "v", "kp"))
        kw_r = dict(kw, cu_seqlens_q=cuq, q_origin=origin)
        if mode == "given":
            kw_r["indices"] = kw["indices"][:, rows]
        o_r, kl_r, lse_r = flashmsa.msa_attention(q_r, k_r, v_r, qp_r, kp_r, 3, return_lse=True, compute_kl=True,
                                                  **kw_r)
        assert _rel(o_r, out.detach()[rows]) <= 1e-6 and _rel(lse_r, lse.detach()[:, rows]) <= 1e-7
        share = len(rows) / total
        kl_sum += kl_r.item() * share
        gr = torch.autograd.grad([o_r, 0.7 * share * kl_r], [q_r, k_r, v_r, qp_r, kp_r],
                                 [dout[rows], torch.ones_like(kl_r)])
        assert _rel(gr[0], want[0][rows]) <= 2e-3, "dq"
        assert _rel(gr[3], want[3][rows]) <= 2e-3, "dqp"
        for i in (1, 2, 4):
            got[i] += gr[i].float()
    assert kl.item() > 0 and kl_sum == pytest.approx(kl.item(), rel=1e-4)
    for i, name in ((1, "dk"), (2, "dv"), (4, "dkp")):
        assert _rel(got[i], want[i]) <= 3e-3, name
    cuq, origin, rows = _segments(RANKS[0], cu.cpu())
    with pytest.raises(flashmsa.NotSupportedError, match="segments"):
        o_w, kl_w = flashmsa.msa_attention(x["q"].detach()[rows.cuda()].requires_grad_(), *main[1:], *proxy, 3,
                                           cu_seqlens=cu, max_seqlen=ms, warmup=True, cu_seqlens_q=cuq.cuda(),
                                           q_origin=origin.cuda())
        torch.autograd.backward([o_w, kl_w], [torch.ones_like(o_w), torch.ones_like(kl_w)])
