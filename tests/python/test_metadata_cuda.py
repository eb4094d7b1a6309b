"""Invalid cu_seqlens / max_seqlen on the GPU through the Python API (issue 13): the call returns
(no host sync on the default path), its outputs are NaN, flashmsa.check() raises
InvalidArgumentError naming the fault, a later call raises it too once the GPU has finished, and a
correct call right after returns correct results. validate=True raises at once. Skipped without
a CUDA device; the status-word plumbing is also checked on the CPU (the words stay clean)."""
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")

import flashmsa  # noqa: E402
from flashmsa import _lib as L  # noqa: E402
from flashmsa import reference as R  # noqa: E402
from flashmsa.testing import cuda_ready, make_inputs, rel_l2  # noqa: E402


cuda = pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA device and libflashmsa built with CUDA")
HEADS = dict(Hq=16, Hkv=2, Hp=4, Hpk=1)


@pytest.fixture(autouse=True)
def _clean_status():
    """Each test starts with clean status words (a failed test may leave a fault behind)."""
    if cuda_ready():
        try:
            flashmsa.check()
        except flashmsa.InvalidArgumentError:
            pass
    yield
ROWS = [  # (name, cu_seqlens, max_seqlen, words the message must hold)
    ("last_above_total", [0, 1000, 4000], 3000, ["exceeds total", "last value is not total"]),
    ("first_not_zero", [100, 1000, 3000], 3000, ["cu_seqlens[0] is not 0"]),
    ("non_monotonic", [0, 2000, 1000, 3000], 3000, ["decrease"]),
    ("last_below_total", [0, 1000, 1500], 3000, ["last value is not total"]),
    ("max_seqlen_too_small", [0, 1000, 3000], 1500, ["longer than max_seqlen"]),
    ("negative", [0, -7, 3000], 3000, ["negative"]),
    ("huge", [0, 2**31 - 1, 3000], 3000, ["exceeds total"]),
]


def _inputs(requires_grad=True):
    x = make_inputs(lengths=[1000, 2000], D=128, Dp=128, dtype=torch.bfloat16, device="cuda", seed=3,
                    requires_grad=requires_grad, proxy_gain=4.0, **HEADS)
    return [x[n] for n in ("q", "k", "v", "qp", "kp")], x["cu_seqlens"]


@cuda
@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_bad_cu_seqlens_is_reported_poisoned_and_survivable(row):
    name, bad, max_seqlen, words = row
    flashmsa.check()  # nothing pending from earlier tests
    args, cu = _inputs()
    out, kl = flashmsa.msa_attention(*args, topk=4, cu_seqlens=torch.tensor(bad, dtype=torch.int32, device="cuda"),
                                     max_seqlen=max_seqlen, compute_kl=True)
    # the call returned without a sync; its outputs are NaN (reading them synchronises) ...
    assert torch.isnan(out).all() and torch.isnan(kl).all(), "outputs of a faulting call must be NaN"
    # ... so the fault has reached the host: the backward, the next flashmsa call, raises it
    with pytest.raises(flashmsa.InvalidArgumentError) as e:
        (out.float().square().sum() + kl).backward()
    for w in words + ["cu_seqlens", "flashmsa_fwd"]:
        assert w in str(e.value), (w, str(e.value))
    flashmsa.check()  # cleared by the report
    # a correct call right after: the context survives and the results match the fp64 reference
    args2, cu2 = _inputs(requires_grad=False)
    out2, _, lse2, idx2 = flashmsa.msa_attention(*args2, topk=4, cu_seqlens=cu2, max_seqlen=2000,
                                              return_lse=True, return_indices=True)
    x64 = [a.double() for a in args2]
    rout = R.msa_attention(*x64, 4, indices=idx2, cu_seqlens=cu2, max_seqlen=2000)[0]
    floor = rel_l2(rout.to(torch.bfloat16), rout)
    assert torch.isfinite(out2).all()
    assert rel_l2(out2, rout) <= 2 * floor + 1e-5
    assert torch.isfinite(lse2).all()
    flashmsa.check()


@cuda
def test_pending_fault_raises_at_the_next_call():
    flashmsa.check()
    args, cu = _inputs(requires_grad=False)
    bad = torch.tensor([0, 2000, 1000, 3000], dtype=torch.int32, device="cuda")
    out = flashmsa.msa_attention(*args, topk=4, cu_seqlens=bad, max_seqlen=3000)[0]
    torch.cuda.synchronize()  # e.g. loss.item(): the GPU has finished, the fault is on the host
    assert torch.isnan(out).all()
    with pytest.raises(flashmsa.InvalidArgumentError, match="decrease"):
        flashmsa.msa_attention(*args, topk=4, cu_seqlens=cu, max_seqlen=2000)
    out = flashmsa.msa_attention(*args, topk=4, cu_seqlens=cu, max_seqlen=2000)[0]
    assert torch.isfinite(out).all()
    flashmsa.check()


@cuda
def test_validate_raises_at_once_and_writes_nothing():
    flashmsa.check()
    args, cu = _inputs(requires_grad=False)
    bad = torch.tensor([0, 1000, 4000], dtype=torch.int32, device="cuda")
    with pytest.raises(flashmsa.InvalidArgumentError, match="cu_seqlens"):
        flashmsa.msa_attention(*args, topk=4, cu_seqlens=bad, max_seqlen=3000, validate=True)
    flashmsa.check()


@cuda
def test_backward_fault_poisons_gradients():
    """The library backward with invalid cu_seqlens (the forward was valid): NaN gradients and a
    NaN kl value (the backward's kl output is poisoned too), and flashmsa.check() names
    flashmsa_bwd."""
    from flashmsa import _kernels as K
    flashmsa.check()
    args, cu = _inputs(requires_grad=False)
    q, k, v, qp, kp = args
    out, lse, idx, plse, kl, _ = K.fwd(q, k, v, qp, kp, cu, None, 2000, L.MODE_SPARSE, L.NUMERICS_TRAIN, 4, 0.0, 0.0,
                                       K.KL_VALUE, True, True, False)
    dout = torch.randn_like(out)
    dkl = torch.ones((), device="cuda")
    bad = torch.tensor([0, 1000, 1500], dtype=torch.int32, device="cuda")
    grads = K.bwd(dout, None, dkl, q, k, v, qp, kp, bad, idx, out, lse, plse, 2000, L.MODE_SPARSE, 0.0, 0.0, False,
                  want_kl=True)
    assert len(grads) == 6  # dq, dk, dv, dqp, dkp, kl
    for g in grads:
        assert torch.isnan(g).all()
    with pytest.raises(flashmsa.InvalidArgumentError, match="flashmsa_bwd"):
        flashmsa.check()
    grads = K.bwd(dout, None, dkl, q, k, v, qp, kp, cu, idx, out, lse, plse, 2000, L.MODE_SPARSE, 0.0, 0.0, False,
                  want_kl=True)
    for g in grads:
        assert torch.isfinite(g).all()
    assert torch.equal(grads[5], kl)  # the backward's kl is the forward's
    flashmsa.check()


@cuda
def test_select_fault():
    flashmsa.check()
    args, cu = _inputs(requires_grad=False)
    idx = flashmsa.msa_select(args[3], args[4], 4, cu_seqlens=torch.tensor([5, 1000, 3000], dtype=torch.int32,
                                                                            device="cuda"), max_seqlen=3000)
    assert (idx == -2**31).all(), "the indices of a faulting selection must be INT32_MIN"
    with pytest.raises(flashmsa.InvalidArgumentError, match="flashmsa_select"):
        flashmsa.check()


def test_status_words_stay_clean_on_the_cpu():
    """The CPU backend checks cu_seqlens before it computes (an error at once), and flashmsa.check()
    is a no-op without CUDA calls."""
    x = make_inputs(lengths=[300, 20], Hq=4, Hkv=2, Hp=2, Hpk=1, D=16, Dp=16, seed=1)
    bad = torch.tensor([0, 200, 100, 320], dtype=torch.int32)
    with pytest.raises(flashmsa.InvalidArgumentError, match="cu_seqlens"):
        flashmsa.msa_attention(x["q"], x["k"], x["v"], x["qp"], x["kp"], topk=2, cu_seqlens=bad, max_seqlen=300)
    flashmsa.check()
    assert L.status_words(torch.device("cpu")) is None


def test_check_status_c_abi_on_host_words():
    """flashmsa_check_status on host words (no GPU needed): clean words succeed, set words give
    INVALID_ARGUMENT with a message naming the fault and are reset; bad arguments are refused."""
    import ctypes
    lib = L.lib()
    w = torch.zeros(L.STATUS_WORDS, dtype=torch.int32)
    v = L.view(w)
    faults = ctypes.c_int32(-1)
    assert lib.flashmsa_check_status(ctypes.byref(v), None, 0, ctypes.byref(faults)) == L.SUCCESS
    assert faults.value == 0
    w[:] = torch.tensor([4 | 16, 2, 1, 2, 2000, 1000, 3000, 3000], dtype=torch.int32)
    assert lib.flashmsa_check_status(ctypes.byref(v), None, L.CHECK_RESET, ctypes.byref(faults)) == L.INVALID_ARGUMENT
    msg = lib.flashmsa_last_error().decode()
    assert faults.value == 20
    for word in ["flashmsa_fwd", "decrease", "last value is not total", "cu_seqlens[1] = 2000", "cu_seqlens[2] = 1000"]:
        assert word in msg, (word, msg)
    assert (w == 0).all(), "CHECK_RESET must clear the words"
    short = L.view(torch.zeros(3, dtype=torch.int32))
    assert lib.flashmsa_check_status(ctypes.byref(short), None, 0, None) == L.INVALID_ARGUMENT
    assert "status" in lib.flashmsa_last_error().decode()
    assert lib.flashmsa_check_status(None, None, 0, None) == L.INVALID_ARGUMENT
    assert lib.flashmsa_check_status(ctypes.byref(v), None, 64, None) == L.INVALID_ARGUMENT
