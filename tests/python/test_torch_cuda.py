"""GPU tests of the PyTorch package (skipped without a CUDA device and a CUDA-enabled library):
the CUDA kernels against flashmsa.reference on SPEC's two configurations (m3, fmsa), forward
and backward, kl modes, torch.compile(fullgraph=True), CUDA graph capture/replay.

The harness itself (check_forward) also runs on the CPU backend at a small size, so CI checks
that these tests are sound before a GPU ever runs them.
"""
import math
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import flashmsa  # noqa: E402
from flashmsa import _kernels as K  # noqa: E402
from flashmsa import _lib as L  # noqa: E402
from flashmsa import reference as R  # noqa: E402
from flashmsa.nn import MSAttention  # noqa: E402
from flashmsa.testing import cuda_ready, CONFIGS, make_inputs, rel_l2, selection_mismatches  # noqa: E402


cuda = pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA device and libflashmsa built with CUDA")
MAIN_PROXY = ("q", "k", "v", "qp", "kp")
MODES = {"sparse": L.MODE_SPARSE, "given": L.MODE_GIVEN, "warmup": L.MODE_DENSE}
LENGTHS = [0, 1, 127, 129, 2100]  # 17 blocks in the long one: topk 16 really selects


def _inputs(cfg, device, dtype, layout, D, seed, requires_grad=False):
    heads = {k: v for k, v in cfg.items() if k != "topk"}
    if layout == "varlen":
        return make_inputs(lengths=LENGTHS, D=D, Dp=D, dtype=dtype, device=device, seed=seed,
                           requires_grad=requires_grad, proxy_gain=4.0, **heads)
    return make_inputs(batch=2, seqlen=1100, D=D, Dp=D, dtype=dtype, device=device, seed=seed,
                       requires_grad=requires_grad, proxy_gain=4.0, **heads)


def _seq_kw(x):
    return dict(cu_seqlens=x["cu_seqlens"], max_seqlen=x["max_seqlen"]) if "cu_seqlens" in x else {}


def check_forward(cfg, device, dtype=torch.bfloat16, layout="varlen", D=128, seed=0):
    """Selection as sets (tie tolerance), then out/lse of the three modes against the fp64
    reference fed with the kernel's own indices; out within 2x the dtype's rounding floor."""
    x = _inputs(cfg, device, dtype, layout, D, seed)
    x64 = {n: x[n].double() for n in MAIN_PROXY}
    kw, topk = _seq_kw(x), cfg["topk"]
    args = [x[n] for n in MAIN_PROXY]
    idx, plse = flashmsa.msa_select(x["qp"], x["kp"], topk, return_proxy_lse=True, **kw)
    ridx, rplse = R.msa_select(x64["qp"], x64["kp"], topk, return_proxy_lse=True, **kw)
    differ, bad = selection_mismatches(idx, ridx, x64["qp"], x64["kp"], x.get("cu_seqlens"))
    assert bad == 0, f"{bad} rows select other blocks than the reference beyond the tie tolerance"
    if differ == 0:
        assert rel_l2(plse, rplse) < 1e-5
    for mode in ("sparse", "given", "warmup"):
        mkw = dict(warmup=mode == "warmup", indices=idx if mode == "given" else None)
        out, kl, lse, got_idx = flashmsa.msa_attention(*args, topk, return_lse=True, return_indices=True,
                                                       **mkw, **kw)
        if mode == "sparse":
            assert torch.equal(got_idx, idx), "the forward's selection differs from msa_select's"
        ref_kw = dict(warmup=mode == "warmup", indices=None if mode == "warmup" else idx)
        rout, rkl, rlse = R.msa_attention(*(x64[n] for n in MAIN_PROXY), topk, return_lse=True, **ref_kw, **kw)
        floor = rel_l2(rout.to(dtype), rout)
        err = rel_l2(out, rout)
        assert err <= 2 * floor + 1e-5, f"{mode}: out rel-L2 {err:.3e} vs bar {2 * floor + 1e-5:.3e}"
        assert rel_l2(lse, rlse) <= 1e-5, f"{mode}: lse"
        # kl: the value where the backend computes it, else NaN (no value)
        if not math.isnan(kl.item()):
            assert abs(kl.item() - rkl.item()) <= 1e-3 * abs(rkl.item()) + 1e-6, mode
        else:
            key = K.feature_key(x["q"], x["k"], x["qp"], x["kp"], mkw["indices"], MODES[mode])
            assert (key, "kl") in K._declined, f"{mode}: kl is NaN but the backend did not decline it"


def test_harness_on_cpu_backend():
    """check_forward on the CPU backend at a small size (the CPU computes in fp64)."""
    check_forward(dict(Hq=4, Hkv=2, Hp=2, Hpk=1, topk=3), "cpu", torch.bfloat16, "varlen", D=16)


@cuda
@pytest.mark.parametrize("layout", ["varlen", "batched"])
@pytest.mark.parametrize("config", ["m3", "fmsa"])
def test_cuda_forward_matches_reference(config, layout):
    check_forward(CONFIGS[config], "cuda", torch.bfloat16, layout, seed=len(config) * 10 + len(layout))


@cuda
def test_cuda_forward_fp16_infer():
    with torch.no_grad():
        check_forward(CONFIGS["fmsa"], "cuda", torch.float16, "varlen", seed=3)


def _backward_available() -> bool:
    x = make_inputs(batch=1, seqlen=130, Hq=2, Hkv=1, Hp=1, Hpk=1, D=128, Dp=128, dtype=torch.bfloat16,
                    device="cuda", requires_grad=True)
    out, kl = flashmsa.msa_attention(*(x[n] for n in MAIN_PROXY), 2)
    try:
        (out.float().sum() + kl).backward()
    except NotImplementedError as e:
        assert "flashmsa_bwd" in str(e)  # the library's own message
        return False
    return True


@cuda
@pytest.mark.parametrize("precise", [False, True], ids=["dpsum", "precise_dpsum"])
@pytest.mark.parametrize("config", ["m3", "fmsa"])
def test_cuda_backward_matches_reference(config, precise):
    if not _backward_available():
        pytest.skip("the CUDA backward has not landed (flashmsa_bwd answers NOT_SUPPORTED)")
    cfg = CONFIGS[config]
    x = _inputs(cfg, "cuda", torch.bfloat16, "varlen", 128, seed=5, requires_grad=True)
    x64 = {n: x[n].detach().double().requires_grad_() for n in MAIN_PROXY}
    kw = _seq_kw(x)
    out, kl, lse, idx = flashmsa.msa_attention(*(x[n] for n in MAIN_PROXY), cfg["topk"], return_lse=True,
                                               return_indices=True, precise_dpsum=precise, **kw)
    rout, rkl, rlse = R.msa_attention(*(x64[n] for n in MAIN_PROXY), indices=idx, return_lse=True,
                                      compute_kl=False, **kw)
    g = torch.Generator(device="cuda").manual_seed(1)
    dout = torch.randn(out.shape, generator=g, device="cuda", dtype=torch.float32)
    dlse = torch.randn(lse.shape, generator=g, device="cuda", dtype=torch.float32)
    fin = torch.isfinite(rlse)

    def loss(o, l, k):
        return (o.float() * dout).sum() + (torch.where(fin, l, 0).float() * dlse).sum() + 2.0 * k

    got = torch.autograd.grad(loss(out, lse, kl), [x[n] for n in MAIN_PROXY])
    want = torch.autograd.grad(loss(rout, rlse, rkl), [x64[n] for n in MAIN_PROXY])
    for n, a, b in zip(MAIN_PROXY, got, want):
        assert rel_l2(a, b) < 1e-2, n  # the strict SPEC bar is the C++ GPU suite's


@cuda
def test_cuda_deterministic_backward_is_bitwise_reproducible():
    """torch.use_deterministic_algorithms(True) selects the ordered backward: two backward passes
    of the same forward give bitwise equal gradients (m3 heads, 16 blocks per token)."""
    if not _backward_available():
        pytest.skip("the CUDA backward has not landed")
    cfg = CONFIGS["m3"]
    x = _inputs(cfg, "cuda", torch.bfloat16, "varlen", 128, seed=9, requires_grad=True)
    leaves = [x[n] for n in MAIN_PROXY]
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        out, kl = flashmsa.msa_attention(*leaves, cfg["topk"], **_seq_kw(x))
        g = torch.Generator(device="cuda").manual_seed(2)
        loss = (out.float() * torch.randn(out.shape, generator=g, device="cuda")).sum() + kl
        first = torch.autograd.grad(loss, leaves, retain_graph=True)
        second = torch.autograd.grad(loss, leaves)
    finally:
        torch.use_deterministic_algorithms(before)
    for n, a, b in zip(MAIN_PROXY, first, second):
        assert torch.equal(a, b), f"{n}: the deterministic backward differs between two runs"


@cuda
def test_cuda_kl_modes():
    x = _inputs(CONFIGS["fmsa"], "cuda", torch.bfloat16, "varlen", 128, seed=6)
    args, kw = [x[n] for n in MAIN_PROXY], _seq_kw(x)
    _, kl_placeholder = flashmsa.msa_attention(*args, 16, compute_kl=False, **kw)
    assert kl_placeholder.item() == 0.0
    try:
        _, kl = flashmsa.msa_attention(*args, 16, compute_kl=True, **kw)
    except NotImplementedError as e:
        assert "kl" in str(e)
        _, kl = flashmsa.msa_attention(*args, 16, **kw)  # compute_kl=None: no value
        assert math.isnan(kl.item())
    else:
        rkl = R.msa_attention(*(t.double() for t in args), 16, **kw)[1]
        assert abs(kl.item() - rkl.item()) <= 1e-3 * rkl.item()


@cuda
@pytest.mark.parametrize("config", ["m3", "fmsa"])
def test_cuda_kl_from_the_backward(config):
    """The default training call: no kl pass in the forward (kl reads NaN), the backward fills in
    the value: the forward-kl call's value (same kernels' teacher) and the fp64 value of the
    kernel's own selection; the proxy gradients equal the forward-kl call's."""
    if not _backward_available():
        pytest.skip("the CUDA backward has not landed")
    cfg = CONFIGS[config]
    x = _inputs(cfg, "cuda", torch.bfloat16, "varlen", 128, seed=7, requires_grad=True)
    leaves, kw = [x[n] for n in MAIN_PROXY], _seq_kw(x)
    out, kl, idx = flashmsa.msa_attention(*leaves, cfg["topk"], return_indices=True, **kw)
    assert math.isnan(kl.item())
    got = torch.autograd.grad(out.float().square().mean() + kl, leaves[3:])
    out_f, kl_f = flashmsa.msa_attention(*leaves, cfg["topk"], compute_kl=True, **kw)
    want = torch.autograd.grad(out_f.float().square().mean() + kl_f, leaves[3:])
    rkl = R.msa_attention(*(t.detach().double() for t in leaves), indices=idx, **kw)[1].item()
    assert abs(kl.item() - kl_f.item()) <= 1e-4 * kl_f.item(), (kl.item(), kl_f.item())
    assert abs(kl.item() - rkl) <= 1e-3 * rkl, (kl.item(), rkl)
    for n, a, b in zip(("qp", "kp"), got, want):
        assert rel_l2(a, b) < 1e-3, n  # fp32 atomics: the same sums in another order


@cuda
def test_cuda_declined_kl_reads_nan():
    """A geometry whose kl value a backend declines (here Hp < Hkv: an MSA group spans two kv
    heads): compute_kl=None gives NaN (no value: it cannot pass for a kl), compute_kl=True says
    why, and training without the kl term still works (kl still NaN after its backward)."""
    x = make_inputs(lengths=[300, 700], Hq=16, Hkv=4, Hp=2, Hpk=1, D=128, Dp=128, dtype=torch.bfloat16,
                    device="cuda", requires_grad=True, seed=9)
    args, kw = [x[n] for n in MAIN_PROXY], _seq_kw(x)
    out, kl, lse = flashmsa.msa_attention(*args, 4, return_lse=True, **kw)
    assert math.isnan(kl.item())  # training: no value before the backward
    with torch.no_grad():
        kl_eval = flashmsa.msa_attention(*args, 4, **kw)[1]
    rout, rkl, rlse = R.msa_attention(*(t.detach().double() for t in args), 4, return_lse=True, **kw)
    assert rel_l2(out, rout) <= 2 * rel_l2(rout.to(torch.bfloat16), rout) + 1e-5
    declined = math.isnan(kl_eval.item())
    if declined:  # (the CUDA backend's rule today)
        with pytest.raises(NotImplementedError, match="kl"):
            flashmsa.msa_attention(*args, 4, compute_kl=True, **kw)
    else:
        assert abs(kl_eval.item() - rkl.item()) <= 1e-3 * rkl.item()
    if _backward_available():
        out.float().square().mean().backward()  # no kl gradient: no proxy gradient needed
        assert x["qp"].grad.abs().max() == 0 and x["q"].grad.abs().max() > 0
        assert math.isnan(kl.item()) == declined


@cuda
def test_cuda_errors():
    x = make_inputs(batch=1, seqlen=200, D=64, Dp=64, dtype=torch.bfloat16, device="cuda")
    args = [x[n] for n in MAIN_PROXY]
    with pytest.raises(NotImplementedError, match="D = 64"):
        flashmsa.msa_attention(*args, 2)
    with pytest.raises(NotImplementedError, match="bf16 or fp16"):
        flashmsa.msa_attention(*(t.float() for t in args), 2)
    with pytest.raises(ValueError, match="device"):
        flashmsa.msa_attention(args[0], args[1].cpu(), *args[2:], 2)


def _compile_case():
    x = _inputs(CONFIGS["fmsa"], "cuda", torch.bfloat16, "batched", 128, seed=7)
    return [x[n] for n in MAIN_PROXY]


@cuda
def test_cuda_compile_fullgraph():
    """The op is opaque to inductor: its outputs agree exactly between compiled and eager runs;
    the surrounding arithmetic, which inductor fuses (its reductions round differently), to 1e-5."""
    args = _compile_case()

    def f(q, k, v, qp, kp):
        out, kl, lse = flashmsa.msa_attention(q * 1.0, k, v, qp, kp, 16, return_lse=True)
        return out, kl, lse, out.float().square().mean(-1) + lse.t().reshape(*out.shape[:3]).float()

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    with torch.no_grad():
        a, b = cf(*args), f(*args)
    for x, y in zip(a[:3], b[:3]):
        assert torch.equal(x, y)
    torch.testing.assert_close(a[3], b[3], rtol=1e-5, atol=1e-5)


@cuda
def test_cuda_compile_reduce_overhead():
    """torch.compile's CUDA-graph mode around the op (batched: no max_seqlen needed)."""
    args = _compile_case()

    def f(q, k, v, qp, kp):
        return flashmsa.msa_attention(q, k, v, qp, kp, 16)[0]

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(3):
            a = cf(*args).clone()
        b = f(*args)
    assert torch.equal(a, b)


@cuda
def test_cuda_compile_module():
    torch.manual_seed(0)
    layer = MSAttention(512, 16, 2, 4, 1, head_dim=128, proxy_head_dim=128, topk=4).cuda().bfloat16()
    x = torch.randn(2, 1024, 512, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    cl = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        for warmup in (True, False):
            layer.warmup = warmup
            (y1, _), (y2, _) = cl(x), layer(x)
            assert y1.shape == y2.shape and torch.isfinite(y1).all()
            assert rel_l2(y1, y2) < 5e-2  # inductor may round the projections differently
    if _backward_available():
        layer.warmup = False
        y, kl = cl(x)
        (y.float().square().mean() + kl).backward()
        assert layer.qp_proj.weight.grad.abs().max() > 0


@cuda
@pytest.mark.parametrize("layout", ["batched", "varlen"])
def test_cuda_graph_capture_replay(layout):
    """Capture the forward (selection + sparse attention) in a CUDA graph; replay on new data."""
    x = _inputs(CONFIGS["fmsa"], "cuda", torch.bfloat16, layout, 128, seed=8)
    args, kw = [x[n] for n in MAIN_PROXY], _seq_kw(x)  # max_seqlen given: no host sync

    def fwd():
        out, kl, lse, idx = flashmsa.msa_attention(*args, 16, return_lse=True, return_indices=True, **kw)
        return out, lse, idx

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(s):
        for _ in range(2):
            fwd()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static = fwd()
    for trial in range(3):
        g = torch.Generator(device="cuda").manual_seed(100 + trial)
        for t in args:
            t.copy_(torch.randn(t.shape, generator=g, device="cuda", dtype=torch.float32) * (4 if t is args[3] else 1))
        graph.replay()
        with torch.no_grad():
            eager = fwd()
        for a, b in zip(static, eager):
            assert torch.equal(a, b)
    torch.cuda.synchronize()


# ---- non-finite inputs and empty calls ----------------------------------------------------------
def check_nan_input(device, dtype, mode, name, D=128):
    """A NaN in one element of q, k, qp or kp: the kl value is NaN, the forward's and the one the
    backward fills in, as the proxy gradient of the rows the NaN reaches is (value and gradient
    agree); the other sequence's proxy gradient stays finite. A query row (token 150 of sequence
    0) for q and qp; a key (token 20) that every row of block 0 sees for k and kp."""
    x = make_inputs(lengths=[300, 200], Hq=4, Hkv=2, Hp=2, Hpk=1, D=D, Dp=D, dtype=dtype, device=device,
                    seed=43)
    kw = _seq_kw(x)
    idx = flashmsa.msa_select(x["qp"], x["kp"], 2, **kw) if mode == "given" else None
    mkw = dict(warmup=mode == "warmup", indices=idx, **kw)
    x[name][20 if name.startswith("k") else 150, 0, 1] = float("nan")
    args = [x[n].requires_grad_() for n in MAIN_PROXY]
    with torch.no_grad():
        assert math.isnan(flashmsa.msa_attention(*args, 2, compute_kl=True, **mkw)[1].item()), "forward kl"
    out, kl = flashmsa.msa_attention(*args, 2, **mkw)
    dqp, dkp = torch.autograd.grad(kl, [x["qp"], x["kp"]])
    assert math.isnan(kl.item()), "the kl the backward filled in"
    assert dqp[:300].isnan().any(), "the rows the NaN reaches have a NaN proxy gradient"
    assert dqp[300:].isfinite().all() and dkp[300:].isfinite().all(), "sequence 1"


@pytest.mark.parametrize("mode", ["sparse", "warmup", "given"])
@pytest.mark.parametrize("name", ["q", "k", "qp", "kp"])
def test_nan_harness_on_cpu_backend(mode, name):
    check_nan_input("cpu", torch.bfloat16, mode, name, D=16)


@cuda
@pytest.mark.parametrize("mode", ["sparse", "warmup", "given"])
@pytest.mark.parametrize("name", ["q", "k", "qp", "kp"])
def test_cuda_nan_input_makes_kl_nan(mode, name):
    if not _backward_available():
        pytest.skip("the CUDA backward has not landed")
    check_nan_input("cuda", torch.bfloat16, mode, name)


ZERO_TOKEN_CASES = {"one_empty_sequence": dict(lengths=[0]), "three_empty_sequences": dict(lengths=[0, 0, 0]),
                    "no_sequence": dict(lengths=[]), "batched_S0": dict(batch=2, seqlen=0)}


def check_zero_tokens(device, dtype, case, mode, D=128):
    """A call with no tokens (SPEC: valid): empty outputs forward, empty gradients backward, kl NaN
    until the backward fills it in, then 0."""
    x = make_inputs(**ZERO_TOKEN_CASES[case], Hq=4, Hkv=2, Hp=2, Hpk=1, D=D, Dp=D, dtype=dtype, device=device,
                    requires_grad=True, seed=44)
    kw = _seq_kw(x)
    idx = None
    if mode == "given":
        idx = flashmsa.msa_select(x["qp"].detach(), x["kp"].detach(), 2, **kw)
        assert idx.shape == (2, 0, 2)
    out, kl, lse = flashmsa.msa_attention(*(x[n] for n in MAIN_PROXY), 2, return_lse=True,
                                          warmup=mode == "warmup", indices=idx, **kw)
    assert out.shape == x["q"].shape and out.numel() == 0 and lse.shape == (4, 0)
    assert math.isnan(kl.item())
    (out.float().sum() + lse.sum() + kl).backward()
    assert kl.item() == 0.0
    for n in MAIN_PROXY:
        assert x[n].grad is not None and x[n].grad.shape == x[n].shape, n
    with torch.no_grad():
        assert flashmsa.msa_attention(*(x[n] for n in MAIN_PROXY), 2, warmup=mode == "warmup", indices=idx,
                                      **kw)[1].item() == 0.0


@pytest.mark.parametrize("mode", ["sparse", "warmup", "given"])
@pytest.mark.parametrize("case", list(ZERO_TOKEN_CASES))
def test_zero_tokens_harness_on_cpu_backend(case, mode):
    check_zero_tokens("cpu", torch.bfloat16, case, mode, D=16)


@cuda
@pytest.mark.parametrize("mode", ["sparse", "warmup", "given"])
@pytest.mark.parametrize("case", list(ZERO_TOKEN_CASES))
def test_cuda_zero_tokens(case, mode):
    if not _backward_available():
        pytest.skip("the CUDA backward has not landed")
    check_zero_tokens("cuda", torch.bfloat16, case, mode)


@cuda
def test_cuda_zero_tokens_as_the_first_backward():
    """In a fresh process whose first backward is a zero-token call: autograd runs it on its own
    device thread, where no CUDA call has bound a context yet (the empty tensors launch nothing
    before flashmsa_bwd). Its status-word check once failed there ("host memory that the device
    writes must be page-locked and mapped")."""
    script = (
        "import torch, flashmsa\n"
        "from flashmsa.testing import make_inputs\n"
        "x = make_inputs(lengths=[0, 0], D=128, Dp=128, dtype=torch.bfloat16, device='cuda', requires_grad=True)\n"
        "args = [x[n] for n in ('q', 'k', 'v', 'qp', 'kp')]\n"
        "out, kl = flashmsa.msa_attention(*args, 2, cu_seqlens=x['cu_seqlens'], max_seqlen=0)\n"
        "(out.float().sum() + kl).backward()\n"
        "assert kl.item() == 0.0 and all(t.grad.shape == t.shape for t in args)\n"
        "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(flashmsa.__file__).resolve().parents[1]))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
