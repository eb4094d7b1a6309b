"""The bindings cannot drift from the library or from the ops' schemas: every constant _lib.py
mirrors is compared with the library's (flashmsa_abi_constant) before the first call, and every
argument list of the custom ops is compared with the schema, the kernels and the fakes at import.
These tests change one side and expect the check to name what differs."""
import ctypes
import pathlib
import re
import sys

import pytest

torch = pytest.importorskip("torch")
ROOT = pathlib.Path(__file__).resolve().parents[2]

import flashmsa  # noqa: E402
from flashmsa import _autograd as A  # noqa: E402
from flashmsa import _kernels as K  # noqa: E402
from flashmsa import _lib as L  # noqa: E402
from flashmsa.testing import make_inputs  # noqa: E402

HEADER = ROOT / "include" / "flashmsa" / "flashmsa.h"


def header_constants() -> dict:
    """Every numeric constant of flashmsa.h by name: the enumerators and the numeric macros."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    found = {}
    for name, value in re.findall(r"^\s*#define\s+(FLASHMSA_\w+)\s+([0-9][0-9.eE+]*)\s*$", text, flags=re.M):
        found[name] = float(value) if any(c in value for c in ".eE") else int(value)
    for body in re.findall(r"typedef\s+enum\s+\w+\s*\{(.*?)\}", text, flags=re.S):
        for name, value in re.findall(r"(FLASHMSA_\w+)\s*=\s*(-?\d+)", body):
            found[name] = int(value)
    return found


def test_header_parse_sees_the_constants():
    h = header_constants()
    assert h["FLASHMSA_MODE_GIVEN"] == 2 and h["FLASHMSA_MAX_SCALE"] == 1e4 and h["FLASHMSA_FAULT_OP_BWD"] == 4
    assert len(h) >= 40


def test_library_knows_every_header_constant():
    """The library's table has every enumerator and numeric macro of the header, with its value."""
    lib = L.lib()
    for name, value in header_constants().items():
        got = L.abi_constant(lib, name)
        assert got is not None, f"flashmsa_abi_constant does not know {name}"
        assert got == value, name


def test_unknown_names():
    lib = L.lib()
    for name in ("FLASHMSA_NO_SUCH_CONSTANT", "", "MODE_GIVEN", "flashmsa_mode_given"):
        assert L.abi_constant(lib, name) is None
    v = ctypes.c_int64(5)
    assert lib.flashmsa_abi_constant(None, ctypes.byref(v)) == 0 and v.value == 5


def test_every_binding_constant_matches():
    lib = L.lib()
    h = header_constants()
    for py_name, c_name in L.ABI_CONSTANTS.items():
        assert c_name in h, f"{c_name} (for {py_name}) is not a constant of flashmsa.h"
        assert getattr(L, py_name) == L.abi_constant(lib, c_name) == h[c_name], py_name


def test_every_numeric_constant_of_the_bindings_is_checked():
    """A constant added to _lib.py without an ABI_CONSTANTS entry would go unchecked."""
    numeric = {n for n, v in vars(L).items()
               if n.isupper() and isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert numeric == set(L.ABI_CONSTANTS), numeric ^ set(L.ABI_CONSTANTS)


@pytest.mark.parametrize("py_name", sorted(L.ABI_CONSTANTS))
def test_changed_constant_is_refused(monkeypatch, py_name):
    """Bindings whose copy of a constant differs from the library's refuse to load, naming it."""
    lib = L.lib()
    L._check_abi(lib)
    monkeypatch.setattr(L, py_name, getattr(L, py_name) + 100)
    want = "ABI version" if py_name == "ABI_VERSION" else re.escape(L.ABI_CONSTANTS[py_name])
    with pytest.raises(ImportError, match=want) as e:
        L._check_abi(lib)
    if py_name != "ABI_VERSION":
        assert py_name in str(e.value)


def test_constant_the_library_does_not_know_is_refused(monkeypatch):
    monkeypatch.setitem(L.ABI_CONSTANTS, "MODE_GIVEN", "FLASHMSA_MODE_GIVEN_RENAMED")
    with pytest.raises(ImportError, match="does not know the constant FLASHMSA_MODE_GIVEN_RENAMED"):
        L._check_abi(L.lib())


def test_library_without_the_constant_query_is_refused():
    """A library of the same ABI version built before flashmsa_abi_constant existed."""
    class OldLibrary:
        def __init__(self, lib):
            self.flashmsa_abi_version = lambda: L.ABI_VERSION
            self.flashmsa_struct_size = lib.flashmsa_struct_size

    with pytest.raises(ImportError, match="no flashmsa_abi_constant"):
        L._check_abi(OldLibrary(L.lib()))


def test_struct_sizes_by_id(monkeypatch):
    """The struct checked under each flashmsa_struct_t id is the one the id names."""
    lib = L.lib()
    for py_name, struct in L._STRUCT_IDS.items():
        assert lib.flashmsa_struct_size(getattr(L, py_name)) == ctypes.sizeof(struct)
    monkeypatch.setitem(L._STRUCT_IDS, "STRUCT_TENSOR", L.FwdArgs)
    with pytest.raises(ImportError, match="struct FwdArgs is"):
        L._check_abi(lib)


# ---- the custom ops' argument lists -----------------------------------------------------------
LISTS = ("FWD_ARGS", "BWD_ARGS", "SELECT_ARGS")


def test_signatures_agree():
    A.check_signatures()
    if A.HAS_CUSTOM_OP:
        for op, names in ((A.fwd_op, A.FWD_ARGS), (A.bwd_op, A.BWD_ARGS), (A.select_op, A.SELECT_ARGS)):
            assert tuple(a.name for a in A.schema_of(op).arguments) == names


@pytest.mark.parametrize("which", LISTS)
@pytest.mark.parametrize("change", ["swap", "drop", "add"])
def test_changed_argument_list_is_caught(monkeypatch, which, change):
    names = list(getattr(A, which))
    if change == "swap":
        names[3], names[4] = names[4], names[3]
    elif change == "drop":
        names.pop(5)
    else:
        names.insert(2, "new_arg")
    monkeypatch.setattr(A, which, tuple(names))
    with pytest.raises(ImportError, match="at position [2-5] "):
        A.check_signatures()


def test_reordered_kernel_is_caught(monkeypatch):
    """_kernels.fwd is called positionally (by the op and by MSAFunction): its order must match."""
    def fwd(q, k, v, kp, qp, cu_seqlens, indices, max_seqlen, mode, numerics, topk, softmax_scale, proxy_scale,
            compute_kl, want_indices, want_proxy_lse, validate, want_out_lo=False):
        raise AssertionError("not called")

    monkeypatch.setattr(K, "fwd", fwd)
    with pytest.raises(ImportError, match=r"_kernels.fwd of flashmsa::fwd has 'kp' at position 3"):
        A.check_signatures()


@pytest.mark.skipif(not A.HAS_CUSTOM_OP, reason="torch without torch.library.custom_op")
def test_reordered_fake_is_caught(monkeypatch):
    def fake(qp, kp, cu_seqlens, topk, max_seqlen, proxy_scale, want_proxy_lse):
        raise AssertionError("not called")

    monkeypatch.setitem(A._FAKES, "flashmsa::select", fake)
    with pytest.raises(ImportError, match="fake kernel of flashmsa::select has 'topk' at position 3"):
        A.check_signatures()


def test_args_tuple():
    seg = dict(cu_seqlens_q=None, q_origin=None, max_seqlen_q=0, selection=1)
    assert A.select_args(want_proxy_lse=True, topk=3, qp="a", kp="b", cu_seqlens=None, max_seqlen=7,
                         proxy_scale=0.5, **seg) == ("a", "b", None, 7, 3, 0.5, True, None, None, 0, 1)
    with pytest.raises(TypeError, match=r"missing \['want_proxy_lse'\], unknown \['want_lse'\]"):
        A.select_args(want_lse=True, topk=3, qp="a", kp="b", cu_seqlens=None, max_seqlen=7, proxy_scale=0.5, **seg)


def _spy(monkeypatch, name, names):
    """Records each call of _autograd.<name> as a dict by argument name, then runs it."""
    calls, orig = [], getattr(A, name)

    def spy(*args):
        assert len(args) == len(names)
        calls.append(dict(zip(names, args)))
        return orig(*args)

    monkeypatch.setattr(A, name, spy)
    return calls


def test_msa_attention_passes_each_option_in_its_place(monkeypatch):
    """ops.py builds flashmsa::fwd's arguments positionally: each value lands under its name."""
    calls = _spy(monkeypatch, "msa_fn", A.FWD_ARGS)
    x = make_inputs(lengths=[300, 7], D=8, Dp=8, seed=31)
    q, k, v, qp, kp, cu = (x[n] for n in ("q", "k", "v", "qp", "kp", "cu_seqlens"))
    flashmsa.msa_attention(q, k, v, qp, kp, 3, cu_seqlens=cu, max_seqlen=300, softmax_scale=0.5,
                           proxy_scale=0.25, compute_kl=True, numerics="infer", validate=True, precise_dpsum=True,
                           fp8_selection=True)
    a = calls.pop()
    assert all(a[n] is t for n, t in (("q", q), ("k", k), ("v", v), ("qp", qp), ("kp", kp), ("cu_seqlens", cu)))
    assert a["indices"] is None
    assert {n: a[n] for n in A.FWD_ARGS[7:]} == dict(
        max_seqlen=300, mode=L.MODE_SPARSE, numerics=L.NUMERICS_INFER, topk=3, softmax_scale=0.5,
        proxy_scale=0.25, compute_kl=1, want_indices=False, want_proxy_lse=False, validate=True,
        want_out_lo=False, cu_seqlens_q=None, q_origin=None, max_seqlen_q=0, selection=L.SELECTION_FP8)
    # training (grad): indices, proxy_lse and out_lo wanted; given indices
    idx = flashmsa.msa_select(qp, kp, 3, cu_seqlens=cu, max_seqlen=300)
    qg = q.clone().requires_grad_()
    flashmsa.msa_attention(qg, k, v, qp, kp, 3, cu_seqlens=cu, max_seqlen=300, indices=idx, compute_kl=False,
                           precise_dpsum=True)
    a = calls.pop()
    assert a["q"] is qg and a["indices"] is idx
    assert {n: a[n] for n in A.FWD_ARGS[7:]} == dict(
        max_seqlen=300, mode=L.MODE_GIVEN, numerics=L.NUMERICS_TRAIN, topk=3, softmax_scale=0.0,
        proxy_scale=0.0, compute_kl=0, want_indices=True, want_proxy_lse=True, validate=False,
        want_out_lo=True, cu_seqlens_q=None, q_origin=None, max_seqlen_q=0, selection=L.SELECTION_INPUT)
    flashmsa.msa_attention(q, k, v, None, None, 3, cu_seqlens=cu, max_seqlen=300, warmup=True)
    a = calls.pop()
    assert (a["mode"], a["qp"], a["kp"], a["compute_kl"]) == (L.MODE_DENSE, None, None, 0)


def test_msa_select_passes_each_option_in_its_place(monkeypatch):
    calls = _spy(monkeypatch, "select_op", A.SELECT_ARGS)
    x = make_inputs(lengths=[300, 7], D=8, Dp=8, seed=32)
    flashmsa.msa_select(x["qp"], x["kp"], 3, cu_seqlens=x["cu_seqlens"], max_seqlen=300, proxy_scale=0.25,
                        return_proxy_lse=True, fp8_selection=True)
    a = calls.pop()
    assert a["qp"] is x["qp"] and a["kp"] is x["kp"] and a["cu_seqlens"] is x["cu_seqlens"]
    assert (a["max_seqlen"], a["topk"], a["proxy_scale"], a["want_proxy_lse"], a["selection"]) == \
        (300, 3, 0.25, True, L.SELECTION_FP8)


def test_backward_binds_by_name(monkeypatch):
    """The autograd backward builds flashmsa::bwd's arguments by name from the saved values."""
    calls = _spy(monkeypatch, "bwd_op", A.BWD_ARGS)
    x = make_inputs(lengths=[300, 7], D=8, Dp=8, requires_grad=True, seed=33)
    out, kl, lse = flashmsa.msa_attention(x["q"], x["k"], x["v"], x["qp"], x["kp"], 3, cu_seqlens=x["cu_seqlens"],
                                          max_seqlen=300, softmax_scale=0.5, proxy_scale=0.25, return_lse=True)
    (out.sum() + 2 * kl + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    a = calls.pop()
    for n in ("q", "k", "v", "qp", "kp", "cu_seqlens"):
        assert torch.equal(a[n], x[n]), n
    assert a["dkl"].item() == 2 and a["dlse"] is not None and a["dout"].shape == out.shape
    assert a["indices"].shape == (2, 307, 3) and a["out"].shape == out.shape and a["lse"].shape == lse.shape
    assert (a["max_seqlen"], a["mode"], a["softmax_scale"], a["proxy_scale"], a["deterministic"], a["out_lo"]) == (
        300, L.MODE_SPARSE, 0.5, 0.25, False, None)
    for n in ("q", "k", "v", "qp", "kp"):
        assert x[n].grad is not None and x[n].grad.shape == x[n].shape, n


@pytest.mark.parametrize("mode", ["sparse", "given", "warmup"])
def test_frozen_proxy_gets_no_kl_gradient(monkeypatch, mode):
    """qp, kp without requires_grad (a frozen or detached indexer): the backward gets no dkl, so the
    library skips the proxy gradient's work; q, k, v get exactly the gradients of the trained-proxy
    call, the default call's kl value still comes, and a proxy half that trains keeps dkl."""
    calls = _spy(monkeypatch, "bwd_op", A.BWD_ARGS)
    x = make_inputs(lengths=[300, 7], D=8, Dp=8, requires_grad=True, seed=34)
    kw = dict(cu_seqlens=x["cu_seqlens"], max_seqlen=300, warmup=mode == "warmup")
    if mode == "given":
        kw["indices"] = flashmsa.msa_select(x["qp"], x["kp"], 3, cu_seqlens=x["cu_seqlens"], max_seqlen=300)
    main = [x[n] for n in ("q", "k", "v")]

    def grads(qp, kp):
        out, kl = flashmsa.msa_attention(*main, qp, kp, 3, **kw)
        loss = (out * out).sum() + 2 * kl
        g = torch.autograd.grad(loss, main + [t for t in (qp, kp) if t.requires_grad])
        return g, kl, calls.pop()

    want, kl_want, a = grads(x["qp"], x["kp"])
    assert a["dkl"].item() == 2 and kl_want.item() > 0
    got, kl_got, a = grads(x["qp"].detach(), x["kp"].detach())
    assert a["dkl"] is None and a["want_kl"]  # no proxy gradient; the kl value still asked for
    assert kl_got.item() == kl_want.item()
    for n, g, w in zip("qkv", got, want):
        assert torch.equal(g, w), n
    for frozen in ("qp", "kp"):  # one half trains: the kl gradient still goes to the backward
        qp = x["qp"].detach() if frozen == "qp" else x["qp"]
        kp = x["kp"].detach() if frozen == "kp" else x["kp"]
        got, _, a = grads(qp, kp)
        assert a["dkl"].item() == 2
        for g, w in zip(got, want[:3] + (want[4] if frozen == "qp" else want[3],)):
            assert torch.equal(g, w), frozen
