"""Bad input gets a clear TypeError / ValueError naming the argument (SPEC section 2), checked in
Python where it is cheap and mapped from the library's status codes otherwise."""
import ctypes
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")

import flashmsa  # noqa: E402
from flashmsa import _kernels as K  # noqa: E402
from flashmsa import _lib as L  # noqa: E402
from flashmsa.testing import make_inputs  # noqa: E402


def base():
    x = make_inputs(lengths=[300, 20], Hq=4, Hkv=2, Hp=2, Hpk=1, D=16, Dp=16, seed=1)
    kw = dict(cu_seqlens=x["cu_seqlens"], max_seqlen=300)
    return [x["q"], x["k"], x["v"], x["qp"], x["kp"]], kw


def swap(args, i, t):
    args = list(args)
    args[i] = t
    return args


def idx_given(repeat=False, value=None):
    args, kw = base()
    idx = flashmsa.msa_select(args[3], args[4], 2, **kw)
    if repeat:
        idx[0, 200, 1] = idx[0, 200, 0]
    if value is not None:
        idx[1, 5, 0] = value
    return idx


# (id, call, expected exception, words the message must contain)
CASES = [
    ("q_not_tensor", lambda a, kw: flashmsa.msa_attention(a[0].numpy(), *a[1:], **kw), TypeError, ["q", "Tensor"]),
    ("q_int_dtype", lambda a, kw: flashmsa.msa_attention(a[0].long(), *a[1:], **kw), TypeError, ["q", "dtype"]),
    ("k_dtype_mismatch", lambda a, kw: flashmsa.msa_attention(*swap(a, 1, a[1].float()), **kw), TypeError, ["k", "dtype"]),
    ("cu_seqlens_int64", lambda a, kw: flashmsa.msa_attention(*a, **{**kw, "cu_seqlens": kw["cu_seqlens"].long()}), TypeError, ["cu_seqlens", "int32"]),
    ("indices_int64", lambda a, kw: flashmsa.msa_attention(*a, indices=idx_given().long(), **kw), TypeError, ["indices", "int32"]),
    ("qp_without_kp", lambda a, kw: flashmsa.msa_attention(*a[:4], None, **kw), ValueError, ["kp", "together"]),
    ("sparse_without_proxy", lambda a, kw: flashmsa.msa_attention(*a[:3], **kw), ValueError, ["qp", "sparse"]),
    ("warmup_and_indices", lambda a, kw: flashmsa.msa_attention(*a, warmup=True, indices=idx_given(), **kw), ValueError, ["indices", "warmup"]),
    ("topk_zero", lambda a, kw: flashmsa.msa_attention(*a, topk=0, **kw), ValueError, ["topk", "64", "0"]),
    ("topk_too_large", lambda a, kw: flashmsa.msa_attention(*a, topk=65, **kw), ValueError, ["topk", "65"]),
    ("topk_float", lambda a, kw: flashmsa.msa_attention(*a, topk=2.0, **kw), TypeError, ["topk", "int"]),
    ("hq_not_multiple_of_hkv", lambda a, kw: flashmsa.msa_attention(*swap(a, 0, a[0][:, :3]), **kw), ValueError, ["Hq", "Hkv"]),
    ("hp_not_multiple_of_hpk", lambda a, kw: flashmsa.msa_attention(*swap(swap(a, 3, a[3][:, :1]), 4, torch.cat([a[4]] * 2, 1)), **kw), ValueError, ["Hp", "Hpk"]),
    ("head_dim_mismatch", lambda a, kw: flashmsa.msa_attention(*swap(a, 1, a[1][..., :8]), **kw), ValueError, ["k", "D = 16"]),
    ("tokens_mismatch", lambda a, kw: flashmsa.msa_attention(*swap(a, 2, a[2][:-1]), **kw), ValueError, ["v", "total"]),
    ("last_dim_not_contiguous", lambda a, kw: flashmsa.msa_attention(*swap(a, 0, a[0].transpose(1, 2).contiguous().transpose(1, 2)), **kw), ValueError, ["q", "contiguous"]),
    ("five_dims", lambda a, kw: flashmsa.msa_attention(*swap(a, 0, a[0][None, None]), **kw), ValueError, ["dimensions"]),
    ("cu_seqlens_wrong_total", lambda a, kw: flashmsa.msa_attention(*a, **{**kw, "cu_seqlens": torch.tensor([0, 300, 319], dtype=torch.int32)}), ValueError, ["cu_seqlens", "320"]),
    ("cu_seqlens_decreasing", lambda a, kw: flashmsa.msa_attention(*a, **{**kw, "cu_seqlens": torch.tensor([0, 200, 100, 320], dtype=torch.int32)}), ValueError, ["cu_seqlens", "non-decreasing"]),
    ("cu_seqlens_2d", lambda a, kw: flashmsa.msa_attention(*a, cu_seqlens=kw["cu_seqlens"][None], max_seqlen=300), ValueError, ["cu_seqlens", "1 dimension"]),
    ("max_seqlen_too_small", lambda a, kw: flashmsa.msa_attention(*a, **{**kw, "max_seqlen": 299}), ValueError, ["max_seqlen", "299"]),
    ("max_seqlen_negative", lambda a, kw: flashmsa.msa_attention(*a, **{**kw, "max_seqlen": -1}), ValueError, ["max_seqlen"]),
    ("varlen_without_cu_seqlens", lambda a, kw: flashmsa.msa_attention(*a), ValueError, ["cu_seqlens", "varlen"]),
    ("batched_with_cu_seqlens", lambda a, kw: flashmsa.msa_attention(*(t[None] for t in a), **kw), ValueError, ["cu_seqlens", "batched"]),
    ("scale_negative", lambda a, kw: flashmsa.msa_attention(*a, softmax_scale=-1.0, **kw), ValueError, ["softmax_scale"]),
    ("proxy_scale_nan", lambda a, kw: flashmsa.msa_attention(*a, proxy_scale=float("nan"), **kw), ValueError, ["proxy_scale"]),
    ("numerics_unknown", lambda a, kw: flashmsa.msa_attention(*a, numerics="fast", **kw), ValueError, ["numerics"]),
    ("compute_kl_without_proxy", lambda a, kw: flashmsa.msa_attention(*a[:3], indices=idx_given(), compute_kl=True, **kw), ValueError, ["compute_kl", "qp"]),
    ("indices_repeat", lambda a, kw: flashmsa.msa_attention(*a, indices=idx_given(repeat=True), **kw), ValueError, ["indices", "repeat"]),
    ("indices_out_of_range_validate", lambda a, kw: flashmsa.msa_attention(*a, indices=idx_given(value=7), validate=True, **kw), ValueError, ["indices", "outside"]),
    ("indices_wrong_heads", lambda a, kw: flashmsa.msa_attention(*a, indices=idx_given()[:1], **kw), ValueError, ["indices", "shape"]),
    ("device_mismatch", lambda a, kw: flashmsa.msa_attention(*swap(a, 1, a[1].to("meta")), **kw), ValueError, ["k", "device"]),
    ("select_topk", lambda a, kw: flashmsa.msa_select(a[3], a[4], 100, **kw), ValueError, ["topk", "100"]),
    ("select_dtype", lambda a, kw: flashmsa.msa_select(a[3], a[4].float(), 2, **kw), TypeError, ["kp", "dtype"]),
    ("select_hp_hpk", lambda a, kw: flashmsa.msa_select(a[3][:, :1], torch.cat([a[4]] * 2, 1), 2, **kw), ValueError, ["Hp", "Hpk"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case):
    _, call, exc, words = case
    args, kw = base()
    with pytest.raises(exc) as info:
        call(args, kw)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_failed_call_writes_nothing():
    """The library validates everything before it writes: a failing forward leaves its outputs."""
    args, kw = base()
    a = L.new_args(L.FwdArgs)
    out = torch.full_like(args[0], 7.0)
    lse = torch.full((4, 320), 7.0, dtype=torch.float64)
    a.q, a.k, a.v, a.qp, a.kp = (L.view(t) for t in args)
    a.cu_seqlens, a.max_seqlen, a.topk = L.view(kw["cu_seqlens"]), 299, 2  # max_seqlen too small
    a.out, a.lse = L.view(out), L.view(lse)
    with pytest.raises(ValueError, match="max_seqlen"):
        L.call("fwd", a, out.device)
    assert out.eq(7).all() and lse.eq(7).all()


def test_status_mapping():
    with pytest.raises(ValueError):
        L.check(L.INVALID_ARGUMENT)
    with pytest.raises(NotImplementedError):
        L.check(L.NOT_SUPPORTED)
    for status in (L.DEVICE, L.WORKSPACE, L.INTERNAL):
        with pytest.raises(RuntimeError) as info:
            L.check(status)
        assert isinstance(info.value, flashmsa.FlashMSAError) and info.value.status == status


def test_not_supported_carries_the_library_message():
    """A CUDA view on a library without its CUDA backend (or without a GPU): NOT_SUPPORTED ->
    NotImplementedError with the library's message (the data is never touched)."""
    if L.cuda_available():
        pytest.skip("this library has a usable CUDA backend")
    args, kw = base()
    out = torch.empty_like(args[0])
    lse = torch.empty((4, 320), dtype=torch.float32)
    views = [L.view(t) for t in args + [kw["cu_seqlens"], out, lse]]
    for v in views:
        v.device_type = L.DEVICE_CUDA
    a = L.new_args(L.FwdArgs)
    a.q, a.k, a.v, a.qp, a.kp, a.cu_seqlens, a.out, a.lse = views
    a.max_seqlen, a.topk = 300, 2
    with pytest.raises(NotImplementedError, match="CUDA"):
        L.check(L.lib().flashmsa_fwd(ctypes.byref(a), None, 0))


def test_optional_features_are_retried_without(monkeypatch):
    """The forward's optional extras (the kl value under compute_kl=None, proxy_lse for the
    backward) are dropped, smallest drop first, when a backend declines them, and remembered."""
    monkeypatch.setattr(K, "_declined", set())
    calls = []

    def backend(features):  # declines kl, accepts proxy_lse
        calls.append(sorted(features))
        if "kl" in features:
            raise L.NotSupportedError("flashmsa_fwd: CUDA backend: compute_kl is not implemented yet")

    K._run_declining(backend, ["kl", "proxy_lse"], ("cuda", L.MODE_DENSE))
    assert calls == [["kl", "proxy_lse"], ["proxy_lse"]]
    assert K._declined == {(("cuda", L.MODE_DENSE), "kl")}
    calls.clear()
    K._run_declining(backend, ["kl", "proxy_lse"], ("cuda", L.MODE_DENSE))
    assert calls == [["proxy_lse"]]  # remembered: no failing call any more

    def broken(features):  # declines everything: the first error surfaces
        raise L.NotSupportedError(f"no {sorted(features)}")

    with pytest.raises(NotImplementedError, match=r"no \['kl', 'proxy_lse'\]"):
        K._run_declining(broken, ["kl", "proxy_lse"], ("cuda", L.MODE_GIVEN))
    assert (("cuda", L.MODE_GIVEN), "kl") not in K._declined

