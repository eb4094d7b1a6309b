"""Issue 13: no value may crash or turn silently into numbers (SPEC section 2, docs/errors.md).

A battery of bad (and boundary) inputs, tried the way a new user would, through every face of the
CPU backend:
  - the Python API: flashmsa.msa_attention, msa_select, flashmsa.reference, nn.MSAttention, and
    flashmsa.distributed.msa_attention_cp (gloo, 2 processes: this file is also their worker);
  - the C ABI through ctypes (the struct mirrors of _lib), outputs pre-filled with a sentinel
    that a failed call must leave as it is;
  - the CLI (`flashmsa run` as a subprocess).
Every case asserts either a clear error (the exception type or exit code, and words of the
message naming the argument and the valid range) or a correct result (against
flashmsa.reference, the library itself at a reference setting, or bitwise equality).
"""
import ctypes
import datetime
import json
import math
import os
import pathlib
import resource
import socket
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
HERE = pathlib.Path(__file__).resolve()
if os.environ.get("FLASHMSA_TEST_INSTALLED") != "1":  # also run as a script (the distributed workers)
    sys.path.insert(0, str(HERE.parents[2] / "python"))

import flashmsa  # noqa: E402
import flashmsa.distributed as fcp  # noqa: E402
import flashmsa.reference as R  # noqa: E402
from flashmsa import _lib as L  # noqa: E402
from flashmsa.nn import MSAttention  # noqa: E402
from flashmsa.testing import make_inputs, rel_l2  # noqa: E402

NAMES = ("q", "k", "v", "qp", "kp")
LENGTHS = [200, 0, 57]
TOTAL, MAXLEN = sum(LENGTHS), max(LENGTHS)
HEADS = dict(Hq=4, Hkv=2, Hp=2, Hpk=1, D=8, Dp=8)
S = 100  # batched inputs: [2, S, H, D]
SENTINEL = 7.0


def varlen(seed=1, **kw):
    x = make_inputs(lengths=LENGTHS, seed=seed, **{**HEADS, **kw})
    return [x[n] for n in NAMES], dict(cu_seqlens=x["cu_seqlens"], max_seqlen=MAXLEN)


def batched(seed=2):
    x = make_inputs(batch=2, seqlen=S, seed=seed, **HEADS)
    return [x[n] for n in NAMES]


def close(got, want, rtol):
    """rel-L2 within rtol, or (for values that are zero up to rounding, like a kl of identical
    distributions) an absolute difference below 1e-12."""
    if rel_l2(got, want) < rtol:
        return True
    g, w = got.detach().double(), want.detach().double()
    fin = torch.isfinite(w)
    return torch.equal(torch.isfinite(g), fin) and bool(((g - w)[fin].abs() <= 1e-12).all())


def expect(exc, words, fn):
    """fn() raises exc (a subclass of TypeError or ValueError) whose message has every word."""
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


# =============================================================================================
# Python API
# =============================================================================================
def attn(a, kw, **extra):
    return flashmsa.msa_attention(*a, **{**kw, **extra})


def ref_attn(a, kw, **extra):
    return R.msa_attention(*a, **{**kw, **extra})


def select(a, kw, **extra):
    return flashmsa.msa_select(a[3], a[4], **{**kw, **extra})


def ref_select(a, kw, **extra):
    return R.msa_select(a[3], a[4], **{**kw, **extra})


FUNCS = {"msa_attention": attn, "reference.msa_attention": ref_attn, "msa_select": select,
         "reference.msa_select": ref_select}

# ---- topk: an int in [1, 64], checked before it is narrowed (no int32 wrap) ----------------
BAD_TOPK = [(0, ValueError), (-1, ValueError), (65, ValueError), (2**31, ValueError),
            (2**32 + 2, ValueError), (2**63, ValueError), (2**64 + 2, ValueError), (2.0, TypeError),
            ("2", TypeError), (True, TypeError), (None, TypeError)]


@pytest.mark.parametrize("fn", list(FUNCS))
@pytest.mark.parametrize("topk,exc", BAD_TOPK, ids=[repr(t) for t, _ in BAD_TOPK])
def test_topk(fn, topk, exc):
    a, kw = varlen()
    words = ["topk", "1 <= topk <= 64", str(topk)] if exc is ValueError else ["topk", "expected an int"]
    expect(exc, words, lambda: FUNCS[fn](a, kw, topk=topk))


@pytest.mark.parametrize("fn", ["msa_attention", "msa_select"])
@pytest.mark.parametrize("topk", [1, 64])
def test_topk_bounds_are_accepted(fn, topk):
    """The ends of the range run and agree with the reference (topk 64 >= every row's blocks)."""
    a, kw = varlen()
    got = FUNCS[fn](a, kw, topk=topk)
    want = FUNCS["reference." + fn](a, kw, topk=topk)
    for g, w in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
        assert rel_l2(g, w) < 1e-12


# ---- max_seqlen: varlen 0..2^31-1 and >= every length; batched None, 0 or S ----------------
BAD_MAXLEN = [(-1, ValueError, ["0 <= max_seqlen <= 2147483647", "-1"]),
              (2**31, ValueError, ["2147483647", str(2**31)]),
              (2**63, ValueError, ["2147483647", str(2**63)]),
              (2**64 + 5, ValueError, ["max_seqlen", str(2**64 + 5)]),
              (MAXLEN - 1, ValueError, ["max_seqlen", str(MAXLEN - 1), str(MAXLEN)]),
              (1.5, TypeError, ["max_seqlen", "int"]), ("300", TypeError, ["max_seqlen", "int"]),
              (True, TypeError, ["max_seqlen", "int"])]


@pytest.mark.parametrize("fn", list(FUNCS))
@pytest.mark.parametrize("ms,exc,words", BAD_MAXLEN, ids=[repr(m) for m, _, _ in BAD_MAXLEN])
def test_max_seqlen_varlen(fn, ms, exc, words):
    a, kw = varlen()
    expect(exc, words, lambda: FUNCS[fn](a, kw, topk=2, max_seqlen=ms))


@pytest.mark.parametrize("fn", list(FUNCS))
@pytest.mark.parametrize("ms", [1, S - 1, S + 1, 2 * S, 2**40])
def test_max_seqlen_batched_must_be_none_zero_or_s(fn, ms):
    a = batched()
    words = ["max_seqlen", f"S = {S}", str(ms)] if ms < 2**31 else ["max_seqlen", "2147483647", str(ms)]
    expect(ValueError, words, lambda: FUNCS[fn](a, {}, topk=2, max_seqlen=ms))


@pytest.mark.parametrize("ms", [None, 0, S])
def test_max_seqlen_batched_valid_values_agree(ms):
    a = batched()
    out, kl, lse = flashmsa.msa_attention(*a, 2, max_seqlen=ms, return_lse=True)
    rout, rkl, rlse = R.msa_attention(*a, 2, max_seqlen=ms, return_lse=True)
    assert rel_l2(out, rout) < 1e-12 and rel_l2(lse, rlse) < 1e-12 and rel_l2(kl, rkl) < 1e-12


def test_max_seqlen_int32_max_is_accepted():
    a, kw = varlen()
    out = attn(a, kw, topk=2)[0]
    assert torch.equal(attn(a, kw, topk=2, max_seqlen=2**31 - 1)[0], out)


# ---- flags: bool only (never a string or number read as one) -------------------------------
BAD_FLAGS = ["False", "no", 1, 0, None]
ATTN_FLAGS = ["warmup", "return_lse", "return_indices", "precise_dpsum", "validate"]


@pytest.mark.parametrize("flag", ATTN_FLAGS)
@pytest.mark.parametrize("value", BAD_FLAGS, ids=repr)
def test_flags_msa_attention(flag, value):
    a, kw = varlen()
    expect(TypeError, [flag, "expected a bool", repr(value)], lambda: attn(a, kw, topk=2, **{flag: value}))


@pytest.mark.parametrize("flag", ["warmup", "return_lse", "return_indices", "validate"])
@pytest.mark.parametrize("value", ["False", 1], ids=repr)
def test_flags_reference(flag, value):
    a, kw = varlen()
    expect(TypeError, [flag, "expected a bool"], lambda: ref_attn(a, kw, topk=2, **{flag: value}))


@pytest.mark.parametrize("fn", ["msa_select", "reference.msa_select"])
@pytest.mark.parametrize("value", ["True", 1, None], ids=repr)
def test_flag_return_proxy_lse(fn, value):
    a, kw = varlen()
    expect(TypeError, ["return_proxy_lse", "expected a bool"], lambda: FUNCS[fn](a, kw, topk=2, return_proxy_lse=value))


@pytest.mark.parametrize("fn", ["msa_attention", "reference.msa_attention"])
@pytest.mark.parametrize("value", ["yes", 1, 0.0], ids=repr)
def test_compute_kl_is_none_or_bool(fn, value):
    a, kw = varlen()
    expect(TypeError, ["compute_kl", "True or False or None"], lambda: FUNCS[fn](a, kw, topk=2, compute_kl=value))


@pytest.mark.parametrize("value,exc", [(1, TypeError), (b"train", TypeError), ("fast", ValueError),
                                       ("TRAIN", ValueError)], ids=repr)
def test_numerics(value, exc):
    a, kw = varlen()
    expect(exc, ["numerics", "'train', 'infer' or None"], lambda: attn(a, kw, topk=2, numerics=value))


# ---- scales: finite, > 0, <= 1e4 (None: the default) -------------------------------------------
SCALE_CASES = [("msa_attention", "softmax_scale", v) for v in
               (1e300, 1.0001e4, math.inf, -math.inf, math.nan, -1.0, 0.0, -0.0)] + \
              [("msa_attention", "proxy_scale", v) for v in (1e300, math.inf, -0.5, 2e4)] + \
              [("msa_select", "proxy_scale", v) for v in (1e300, -1.0, math.nan)] + \
              [("reference.msa_attention", "softmax_scale", v) for v in (1e300, -1.0, 0.0)] + \
              [("reference.msa_attention", "proxy_scale", 1e5), ("reference.msa_select", "proxy_scale", 1e300)]


@pytest.mark.parametrize("fn,name,value", SCALE_CASES, ids=[f"{f}-{n}-{v!r}" for f, n, v in SCALE_CASES])
def test_bad_scales(fn, name, value):
    a, kw = varlen()
    expect(ValueError, [name, "finite value > 0 and <= 10000"], lambda: FUNCS[fn](a, kw, topk=2, **{name: value}))


@pytest.mark.parametrize("name,value", [("softmax_scale", "0.1"), ("softmax_scale", True),
                                        ("proxy_scale", [0.1]), ("proxy_scale", 1j)], ids=repr)
def test_scale_types(name, value):
    a, kw = varlen()
    expect(TypeError, [name, "expected a float or None"], lambda: attn(a, kw, topk=2, **{name: value}))


@pytest.mark.parametrize("scale", [1e4, 3.0, 1e-30])
def test_valid_scales_give_finite_results_that_match_the_reference(scale):
    """At the bound (1e4) the results stay finite and agree with the fp64 reference."""
    a, kw = varlen()
    a = [t.requires_grad_() for t in a]
    got = attn(a, kw, topk=2, softmax_scale=scale, proxy_scale=scale, return_lse=True)
    want = ref_attn(a, kw, topk=2, softmax_scale=scale, proxy_scale=scale, return_lse=True)
    gg = torch.autograd.grad(got[0].sum() + got[1], a)
    gw = torch.autograd.grad(want[0].sum() + want[1], a)
    for g, w in zip(got, want):  # (kl, a training call's, holds its value after the backward)
        assert torch.isfinite(g).all() and close(g, w, 1e-9)
    for g, w in zip(gg, gw):
        assert torch.isfinite(g).all() and close(g, w, 1e-7)


# ---- tensor ranks: a clear ValueError, never an IndexError -----------------------------------
def _rank(i, shape_fn):
    def call(a, kw):
        a = list(a)
        a[i] = shape_fn(a[i])
        return a, kw
    return call


RANK_CASES = [
    ("q_0d", "attn", _rank(0, lambda t: t[0, 0, 0]), ["q", "3 dimensions", "got 0 dimensions"]),
    ("q_1d", "attn", _rank(0, lambda t: t[0, 0]), ["q", "3 dimensions", "got 1 dimension"]),
    ("q_2d", "attn", _rank(0, lambda t: t[0]), ["q", "got 2 dimensions"]),
    ("k_2d", "attn", _rank(1, lambda t: t[:, 0]), ["k", "3 dimensions", "like q"]),
    ("v_4d", "attn", _rank(2, lambda t: t[None]), ["v", "3 dimensions", "like q"]),
    ("qp_0d", "attn", _rank(3, lambda t: t[0, 0, 0]), ["qp", "got 0 dimensions"]),
    ("qp_1d", "attn", _rank(3, lambda t: t[0, 0]), ["qp", "got 1 dimension"]),
    ("kp_2d", "attn", _rank(4, lambda t: t[:, 0]), ["kp", "like q"]),
    ("cu_0d", "attn", lambda a, kw: (a, {**kw, "cu_seqlens": kw["cu_seqlens"][0]}), ["cu_seqlens", "1 dimension"]),
    ("select_qp_1d", "select", _rank(3, lambda t: t[0, 0]), ["qp", "got 1 dimension"]),
    ("select_qp_0d", "select", _rank(3, lambda t: t[0, 0, 0]), ["qp", "got 0 dimensions"]),
    ("select_kp_2d", "select", _rank(4, lambda t: t[:, 0]), ["kp", "like qp"]),
    ("ref_q_1d", "ref", _rank(0, lambda t: t[0, 0]), ["q", "got 1 dimension"]),
    ("ref_qp_0d", "ref", _rank(3, lambda t: t[0, 0, 0]), ["qp", "got 0 dimensions"]),
    ("ref_select_qp_1d", "ref_select", _rank(3, lambda t: t[0, 0]), ["qp", "got 1 dimension"]),
]
RANK_FN = {"attn": attn, "select": select, "ref": ref_attn, "ref_select": ref_select}


@pytest.mark.parametrize("case", RANK_CASES, ids=[c[0] for c in RANK_CASES])
def test_tensor_ranks(case):
    _, fn, mutate, words = case
    a, kw = mutate(*varlen())
    expect(ValueError, words, lambda: RANK_FN[fn](a, kw, topk=2))


def _expanded(i, h=None, d=None):
    """Input i as an expanded view claiming h heads / d dims (no memory behind them)."""
    def m(a, kw):
        a = list(a)
        t = a[i]
        a[i] = t[:, :1, :1].expand(t.shape[0], h or t.shape[1], d or t.shape[2])
        return a, kw
    return m


SIZE_CASES = [
    ("q_heads_2^32+4", "attn", _expanded(0, h=2**32 + 4), ["q", "Hq <= 2147483647", str(2**32 + 4)]),
    ("k_heads_2^31", "attn", _expanded(1, h=2**31), ["k", "Hkv <= 2147483647"]),
    ("q_dim_2^31", "attn", _expanded(0, d=2**31), ["q", "D <= 2147483647"]),
    ("select_qp_heads_2^33", "select", _expanded(3, h=2**33), ["qp", "Hp <= 2147483647"]),
    ("ref_kp_dim_2^32", "ref", _expanded(4, d=2**32), ["kp", "Dp <= 2147483647"]),
]


@pytest.mark.parametrize("case", SIZE_CASES, ids=[c[0] for c in SIZE_CASES])
def test_sizes_above_int32_before_any_allocation(case):
    _, fn, mutate, words = case
    a, kw = mutate(*varlen())
    expect(ValueError, words, lambda: RANK_FN[fn](a, kw, topk=2))


def test_indices_rank():
    a, kw = varlen()
    idx = flashmsa.msa_select(a[3], a[4], 2, **kw)
    expect(ValueError, ["indices", "3 dimensions"], lambda: attn(a, kw, indices=idx[0]))


# ---- flashmsa.reference: the library's checks, and the given-indices rules -------------------
def _given(a, kw, edit=None):
    idx = flashmsa.msa_select(a[3], a[4], 2, **kw)
    if edit:
        edit(idx)
    return idx


def _dup(idx):
    idx[1, 150, 1] = idx[1, 150, 0]  # token 150 (block 1) selects blocks 0, 1: now 0, 0


def _oob(idx):
    idx[0, 120, 0] = 5  # the first sequence has 2 blocks


REF_CASES = [
    ("repeat", lambda a, kw: ref_attn(a, kw, indices=_given(a, kw, _dup)), ["indices", "block 0 repeats", "token 150"]),
    ("repeat_no_proxy", lambda a, kw: ref_attn(a[:3], kw, indices=_given(a, kw, _dup)), ["indices", "repeats"]),
    ("out_of_range_validate", lambda a, kw: ref_attn(a, kw, indices=_given(a, kw, _oob), validate=True),
     ["indices", "value 5", "outside [0, 2)"]),
    ("indices_topk_65", lambda a, kw: ref_attn(a, kw, indices=torch.full((2, TOTAL, 65), -1, dtype=torch.int32)),
     ["indices", "1 <= topk <= 64", "65"]),
    ("indices_wrong_heads", lambda a, kw: ref_attn(a, kw, indices=_given(a, kw)[:1]), ["indices", "expected shape [2"]),
    ("cu_decreasing", lambda a, kw: ref_attn(a, {**kw, "cu_seqlens": torch.tensor([0, 200, 100, 257], dtype=torch.int32)}, topk=2),
     ["cu_seqlens", "non-decreasing"]),
    ("cu_wrong_total", lambda a, kw: ref_attn(a, {**kw, "cu_seqlens": torch.tensor([0, 200, 200, 250], dtype=torch.int32)}, topk=2),
     ["cu_seqlens", "total = 257", "250"]),
    ("cu_first_not_zero", lambda a, kw: ref_attn(a, {**kw, "cu_seqlens": torch.tensor([3, 200, 200, 257], dtype=torch.int32)}, topk=2),
     ["cu_seqlens[0] = 0", "3"]),
    ("hq_not_multiple_of_hkv", lambda a, kw: ref_attn([a[0][:, :3]] + a[1:], kw, topk=2), ["Hq (3)", "Hkv (2)"]),
    ("k_head_dim", lambda a, kw: ref_attn([a[0], a[1][..., :4]] + a[2:], kw, topk=2), ["k", "D = 8", "4"]),
    ("v_tokens", lambda a, kw: ref_attn(a[:2] + [a[2][:-1]] + a[3:], kw, topk=2), ["v", "total", "257"]),
    ("hp_not_multiple_of_hpk", lambda a, kw: ref_attn(a[:4] + [torch.cat([a[4]] * 3, 1)], kw, topk=2), ["Hp (2)", "Hpk (3)"]),
    ("compute_kl_without_proxy", lambda a, kw: ref_attn(a[:3], kw, indices=_given(a, kw), compute_kl=True),
     ["compute_kl", "qp and kp"]),
    ("k_dtype", lambda a, kw: ref_attn([a[0], a[1].float()] + a[2:], kw, topk=2), ["k", "dtype"]),
]


# the same bad input through the library: the same exception type and the same words
LIBRARY_SAYS_THE_SAME = {
    "repeat": lambda a, kw: attn(a, kw, indices=_given(a, kw, _dup)),
    "out_of_range_validate": lambda a, kw: attn(a, kw, indices=_given(a, kw, _oob), validate=True),
    "cu_decreasing": lambda a, kw: attn(a, {**kw, "cu_seqlens": torch.tensor([0, 200, 100, 257], dtype=torch.int32)}, topk=2),
    "cu_wrong_total": lambda a, kw: attn(a, {**kw, "cu_seqlens": torch.tensor([0, 200, 200, 250], dtype=torch.int32)}, topk=2),
    "hq_not_multiple_of_hkv": lambda a, kw: attn([a[0][:, :3]] + a[1:], kw, topk=2),
    "k_head_dim": lambda a, kw: attn([a[0], a[1][..., :4]] + a[2:], kw, topk=2),
}


@pytest.mark.parametrize("case", REF_CASES, ids=[c[0] for c in REF_CASES])
def test_reference_applies_the_library_checks(case):
    name, call, words = case
    a, kw = varlen()
    exc = TypeError if name == "k_dtype" else ValueError
    expect(exc, words, lambda: call(a, kw))
    if name in LIBRARY_SAYS_THE_SAME:
        expect(exc, words, lambda: LIBRARY_SAYS_THE_SAME[name](a, kw))


def test_reference_out_of_range_without_validate_is_an_empty_slot():
    """Without validate, a value outside [0, blocks) is an empty slot, in both implementations."""
    a, kw = varlen()
    idx = _given(a, kw, _oob)
    got = attn(a, kw, indices=idx, return_lse=True)
    want = ref_attn(a, kw, indices=idx, return_lse=True)
    for g, w in zip(got, want):
        assert rel_l2(g, w) < 1e-12


# ---- nn.MSAttention: 0 is an error (only None means the default) ------------------------------
MSA_BAD = [
    (dict(num_heads=0), ValueError, ["num_heads", "[1, 2147483647]", "0"]),
    (dict(num_heads=-1), ValueError, ["num_heads", "-1"]),
    (dict(embed_dim=0), ValueError, ["embed_dim", "[1, 2147483647]"]),
    (dict(num_kv_heads=0), ValueError, ["num_kv_heads", "[1, 2147483647]", "got 0"]),
    (dict(num_proxy_heads=0), ValueError, ["num_proxy_heads", "[1, 2147483647]", "got 0"]),
    (dict(num_proxy_kv_heads=0), ValueError, ["num_proxy_kv_heads", "got 0"]),
    (dict(head_dim=0), ValueError, ["head_dim", "[1, 2147483647]", "got 0"]),
    (dict(proxy_head_dim=0), ValueError, ["proxy_head_dim", "got 0"]),
    (dict(num_kv_heads=2**31), ValueError, ["num_kv_heads", "[1, 2147483647]", str(2**31)]),
    (dict(num_kv_heads=3), ValueError, ["num_heads % num_kv_heads", "4 % 3"]),
    (dict(num_proxy_heads=8), ValueError, ["num_heads % num_proxy_heads"]),
    (dict(embed_dim=3, head_dim=None), ValueError, ["head_dim", "3 // 4"]),
    (dict(num_heads=2.5), TypeError, ["num_heads", "int"]),
    (dict(num_kv_heads="2"), TypeError, ["num_kv_heads", "int"]),
    (dict(head_dim=8.0), TypeError, ["head_dim", "int"]),
    (dict(topk=0), ValueError, ["topk", "1 <= topk <= 64"]),
    (dict(topk=2**32 + 2), ValueError, ["topk", str(2**32 + 2)]),
    (dict(topk=2.0), TypeError, ["topk", "int"]),
    (dict(warmup="False"), TypeError, ["warmup", "bool"]),
    (dict(rotary=1), TypeError, ["rotary", "bool"]),
    (dict(rotary_proxy="yes"), TypeError, ["rotary_proxy", "bool"]),
    (dict(bias="no"), TypeError, ["bias", "bool"]),
    (dict(detach_proxy_input=None), TypeError, ["detach_proxy_input", "bool"]),
    (dict(precise_dpsum="yes"), TypeError, ["precise_dpsum", "bool"]),
    (dict(backend="cuda"), ValueError, ["backend", "'flashmsa' or 'reference'"]),
    (dict(backend=None), ValueError, ["backend"]),
    (dict(kl_coef=math.nan), ValueError, ["kl_coef", "finite"]),
    (dict(kl_coef="1"), TypeError, ["kl_coef", "float"]),
    (dict(rope_base=0.0), ValueError, ["rope_base", "> 0"]),
    (dict(rope_base=-1.0), ValueError, ["rope_base", "> 0"]),
]
MSA_ARGS = dict(embed_dim=32, num_heads=4, num_kv_heads=2, num_proxy_heads=2, head_dim=8, topk=2)


@pytest.mark.parametrize("kw,exc,words", MSA_BAD, ids=[",".join(f"{k}={v!r}" for k, v in c[0].items()) for c in MSA_BAD])
def test_msattention_arguments(kw, exc, words):
    expect(exc, words, lambda: MSAttention(**{**MSA_ARGS, **kw}))


def test_msattention_zero_heads_positional():
    expect(ValueError, ["num_heads", "[1, 2147483647]", "got 0"], lambda: MSAttention(64, 0))


def layer(**kw):
    torch.manual_seed(0)
    return MSAttention(**{**MSA_ARGS, **kw}).double()


MSA_FWD_BAD = [
    ("x_not_tensor", lambda m: m([[1.0] * 32]), TypeError, ["x", "torch.Tensor"]),
    ("x_1d", lambda m: m(torch.randn(32, dtype=torch.float64)), ValueError, ["x", "[B, S, E]"]),
    ("x_wrong_embed", lambda m: m(torch.randn(2, 50, 16, dtype=torch.float64)), ValueError, ["x", "embed_dim = 32", "16"]),
    ("batched_max_seqlen", lambda m: m(torch.randn(2, 50, 32, dtype=torch.float64), max_seqlen=49), ValueError,
     ["max_seqlen", "S = 50", "49"]),
    ("warmup_attr_str", lambda m: (setattr(m, "warmup", "yes"), m(torch.randn(1, 50, 32, dtype=torch.float64))),
     TypeError, ["warmup", "bool"]),
    ("topk_attr_wrap", lambda m: (setattr(m, "topk", 2**32 + 2), m(torch.randn(1, 50, 32, dtype=torch.float64))),
     ValueError, ["topk", str(2**32 + 2)]),
]


@pytest.mark.parametrize("case", MSA_FWD_BAD, ids=[c[0] for c in MSA_FWD_BAD])
@pytest.mark.parametrize("backend", ["flashmsa", "reference"])
def test_msattention_forward_arguments(case, backend):
    _, call, exc, words = case
    expect(exc, words, lambda: call(layer(backend=backend)))


def test_msattention_defaults_are_none_only():
    """None picks the defaults (kv heads = heads, proxy heads = kv heads, head dim = E / heads);
    the layer then matches its reference backend."""
    torch.manual_seed(0)
    m = MSAttention(32, 4, topk=2).double()
    assert (m.num_kv_heads, m.num_proxy_heads, m.head_dim, m.proxy_head_dim) == (4, 4, 8, 8)
    x = torch.randn(2, 150, 32, dtype=torch.float64)
    with torch.no_grad():  # (evaluation: the forward computes kl)
        y, kl = m(x)
        m.backend = "reference"
        yr, klr = m(x)
    assert rel_l2(y, yr) < 1e-12 and rel_l2(kl, klr) < 1e-12


# =============================================================================================
# C ABI through ctypes (the _lib struct mirrors; outputs pre-filled with a sentinel)
# =============================================================================================
class Call:
    """A valid fp64 varlen call of one entry point (lengths 200, 0, 57; Hq 4, Hkv 2, Hp 2, Hpk 1,
    D = Dp = 8), its output tensors filled with SENTINEL (indices with -7)."""

    def __init__(self, entry):
        self.entry = entry
        a, kw = varlen(seed=3)
        self.t = dict(zip(NAMES, a), cu=kw["cu_seqlens"])
        T = TOTAL
        f64 = dict(dtype=torch.float64)
        if entry == "select":
            self.outs = dict(indices=torch.full((2, T, 2), -7, dtype=torch.int32), proxy_lse=torch.full((2, T), SENTINEL, **f64))
            s = L.new_args(L.SelectArgs)
            s.qp, s.kp, s.cu_seqlens = L.view(a[3]), L.view(a[4]), L.view(kw["cu_seqlens"])
            s.max_seqlen, s.topk = MAXLEN, 2
            s.indices, s.proxy_lse = L.view(self.outs["indices"]), L.view(self.outs["proxy_lse"])
        elif entry == "fwd":
            self.outs = dict(out=torch.full((T, 4, 8), SENTINEL, **f64), lse=torch.full((4, T), SENTINEL, **f64),
                             indices=torch.full((2, T, 2), -7, dtype=torch.int32),
                             proxy_lse=torch.full((2, T), SENTINEL, **f64), kl=torch.full((), SENTINEL, **f64))
            s = L.new_args(L.FwdArgs)
            s.q, s.k, s.v, s.qp, s.kp = (L.view(x) for x in a)
            s.cu_seqlens, s.max_seqlen, s.topk, s.compute_kl = L.view(kw["cu_seqlens"]), MAXLEN, 2, 1
            for n, x in self.outs.items():
                setattr(s, n, L.view(x))
        else:
            out, _, lse, idx = flashmsa.msa_attention(*a, 2, **kw, return_lse=True, return_indices=True)
            self.t.update(out=out, lse=lse, idx=idx, dout=torch.randn(out.shape, dtype=torch.float64,
                                                                    generator=torch.Generator().manual_seed(4)),
                          dkl=torch.ones((), dtype=torch.float64))
            self.outs = {n: torch.full(x.shape, SENTINEL, **f64) for n, x in zip(("dq", "dk", "dv", "dqp", "dkp"), a)}
            s = L.new_args(L.BwdArgs)
            s.q, s.k, s.v, s.qp, s.kp = (L.view(x) for x in a)
            s.cu_seqlens, s.max_seqlen, s.mode = L.view(kw["cu_seqlens"]), MAXLEN, L.MODE_GIVEN
            s.indices, s.out, s.lse = L.view(idx), L.view(out), L.view(lse)
            s.dout, s.dkl = L.view(self.t["dout"]), L.view(self.t["dkl"])
            for n, x in self.outs.items():
                setattr(s, n, L.view(x))
        self.args = s

    def run(self):
        fn = getattr(L.lib(), f"flashmsa_{self.entry}")
        status = fn(ctypes.byref(self.args), None, 0)
        return status, L.lib().flashmsa_last_error().decode()

    def untouched(self):
        for n, x in self.outs.items():
            sentinel = -7 if x.dtype == torch.int32 else SENTINEL
            assert x.eq(sentinel).all(), f"{n} was written by a failed call"


def fake(v, shape, strides):
    """Rewrite a view's shape and strides (the data pointer stays: validation must stop first)."""
    v.ndim = len(shape)
    for i, (n, st) in enumerate(zip(shape, strides)):
        v.shape[i], v.strides[i] = n, st
    return v


def _set(field, value):
    return lambda c: setattr(c.args, field, value)


def _tensor(field, shape, strides):
    return lambda c: fake(getattr(c.args, field), shape, strides)


def _batched(S_=None):
    """Turn the fwd call into a batched one ([1, 257, H, D], no cu_seqlens)."""
    def m(c):
        for n in ("q", "k", "v", "qp", "kp", "out"):
            v = getattr(c.args, n)
            fake(v, [1, TOTAL, v.shape[1], v.shape[2]], [TOTAL * v.strides[0], v.strides[0], v.strides[1], 1])
        c.args.cu_seqlens = L.Tensor()
        if S_ is not None:
            c.args.max_seqlen = S_
    return m


def _env_threads(value):
    return lambda c: os.environ.__setitem__("FLASHMSA_NUM_THREADS", value)


BIG = 2**32 + 4
ABI_CASES = [
    # ---- sizes narrowed to int: checked first (no silent wrap to a small head count)
    ("fwd_hq_2^32+4", "fwd", _tensor("q", [TOTAL, BIG, 8], [0, 0, 1]), ["q", "Hq <= 2147483647", str(BIG)]),
    ("fwd_d_2^31", "fwd", _tensor("q", [TOTAL, 4, 2**31], [0, 0, 1]), ["q", "D <= 2147483647", str(2**31)]),
    ("fwd_hkv_2^31", "fwd", _tensor("k", [TOTAL, 2**31, 8], [0, 0, 1]), ["k", "Hkv <= 2147483647"]),
    ("fwd_hp_2^33", "fwd", _tensor("qp", [TOTAL, 2**33, 8], [0, 0, 1]), ["qp", "Hp <= 2147483647"]),
    ("fwd_hpk_2^32+1", "fwd", _tensor("kp", [TOTAL, 2**32 + 1, 8], [0, 0, 1]), ["kp", "Hpk <= 2147483647"]),
    ("fwd_dp_2^31+8", "fwd", _tensor("qp", [TOTAL, 2, 2**31 + 8], [0, 0, 1]), ["qp", "Dp <= 2147483647"]),
    ("select_hp_2^32+2", "select", _tensor("qp", [TOTAL, 2**32 + 2, 8], [0, 0, 1]), ["qp", "Hp <= 2147483647"]),
    ("select_dp_2^32", "select", _tensor("kp", [TOTAL, 1, 2**32], [0, 0, 1]), ["kp", "Dp"]),
    ("bwd_hq_2^32+4", "bwd", _tensor("q", [TOTAL, BIG, 8], [0, 0, 1]), ["q", "Hq <= 2147483647"]),
    ("fwd_total_2^31", "fwd", _tensor("q", [2**31, 4, 8], [0, 8, 1]), ["q", "total <= 2147483647", "int32"]),
    ("fwd_cu_length_2^31+2", "fwd", _tensor("cu_seqlens", [2**31 + 2], [1]), ["cu_seqlens", "B (its length - 1) <= 2147483647"]),
    ("fwd_given_hp_2^32+2", "fwd", lambda c: (setattr(c.args, "mode", L.MODE_GIVEN), setattr(c.args, "qp", L.Tensor()),
                                              setattr(c.args, "kp", L.Tensor()), setattr(c.args, "proxy_lse", L.Tensor()),
                                              setattr(c.args, "compute_kl", 0),
                                              fake(c.args.indices, [2**32 + 2, TOTAL, 2], [0, 2, 1])),
     ["indices", "Hp (its first dimension) <= 2147483647"]),
    ("fwd_batched_b_2^31+1", "fwd", lambda c: (_batched()(c), fake(c.args.q, [2**31 + 1, 1, 4, 8], [0, 0, 8, 1])),
     ["q", "B <= 2147483647"]),
    ("fwd_batched_bs_overflow", "fwd", lambda c: (_batched()(c), fake(c.args.q, [2**40, 2**40, 4, 8], [0, 0, 8, 1])),
     ["q", "more than 2^63 - 1 elements"]),
    ("fwd_batched_bs_above_int32", "fwd", lambda c: (_batched()(c), fake(c.args.q, [2**16, 2**16, 4, 8], [0, 0, 8, 1])),
     ["q", "B * S <= 2147483647"]),
    ("fwd_numel_overflow", "fwd", _tensor("k", [TOTAL, 2**40, 2**30], [0, 0, 1]), ["k", "more than 2^63 - 1 elements"]),
    ("fwd_offset_overflow", "fwd", _tensor("v", [TOTAL, 2, 8], [2**62, 8, 1]), ["v", "beyond offset 2^63 - 1"]),
    ("fwd_negative_size", "fwd", _tensor("k", [TOTAL, -2, 8], [16, 8, 1]), ["k", "negative size"]),
    # ---- codes and ranks
    ("fwd_ndim_-1", "fwd", lambda c: setattr(c.args.q, "ndim", -1), ["q", "at most 4 dimensions", "-1"]),
    ("fwd_ndim_5", "fwd", lambda c: setattr(c.args.k, "ndim", 5), ["k", "at most 4 dimensions", "5"]),
    ("fwd_dtype_99", "fwd", lambda c: setattr(c.args.q, "dtype", 99), ["q", "unknown dtype code 99"]),
    ("fwd_dtype_-1", "fwd", lambda c: setattr(c.args.v, "dtype", -1), ["v", "unknown dtype code -1"]),
    ("fwd_device_7", "fwd", lambda c: setattr(c.args.kp, "device_type", 7), ["kp", "unknown device type 7"]),
    ("fwd_mode_3", "fwd", _set("mode", 3), ["mode", "got 3"]),
    ("fwd_mode_-1", "fwd", _set("mode", -1), ["mode", "got -1"]),
    ("fwd_numerics_2", "fwd", _set("numerics", 2), ["numerics", "got 2"]),
    ("bwd_mode_9", "bwd", _set("mode", 9), ["mode", "got 9"]),
    # ---- topk (int32 in the struct): 1..64
    ("fwd_topk_-5", "fwd", _set("topk", -5), ["topk", "1 <= topk <= 64", "-5"]),
    ("fwd_topk_int32_min", "fwd", _set("topk", -2**31), ["topk", str(-2**31)]),
    ("fwd_topk_65", "fwd", _set("topk", 65), ["topk", "65"]),
    ("select_topk_0", "select", _set("topk", 0), ["topk", "got 0"]),
    ("select_topk_int32_max", "select", _set("topk", 2**31 - 1), ["topk", str(2**31 - 1)]),
    # ---- max_seqlen: varlen 0..2^31-1; batched 0 or S
    ("fwd_max_seqlen_2^31", "fwd", _set("max_seqlen", 2**31), ["max_seqlen", "0 <= max_seqlen <= 2147483647", str(2**31)]),
    ("fwd_max_seqlen_int64_max", "fwd", _set("max_seqlen", 2**63 - 1), ["max_seqlen", str(2**63 - 1)]),
    ("fwd_max_seqlen_-5", "fwd", _set("max_seqlen", -5), ["max_seqlen", "-5"]),
    ("select_max_seqlen_2^40", "select", _set("max_seqlen", 2**40), ["max_seqlen", "2147483647"]),
    ("bwd_max_seqlen_too_small", "bwd", _set("max_seqlen", MAXLEN - 1), ["max_seqlen", str(MAXLEN - 1)]),
    ("fwd_batched_max_seqlen_S+1", "fwd", _batched(TOTAL + 1), ["max_seqlen", f"0 or S = {TOTAL}", str(TOTAL + 1)]),
    ("fwd_batched_max_seqlen_1", "fwd", _batched(1), ["max_seqlen", f"S = {TOTAL}", "got 1"]),
    ("fwd_batched_max_seqlen_-1", "fwd", _batched(-1), ["max_seqlen", "got -1"]),
    # ---- scales: 0 (default) or finite in (0, 1e4]
    ("fwd_scale_1e300", "fwd", _set("softmax_scale", 1e300), ["softmax_scale", "<= 10000", "1e+300"]),
    ("fwd_scale_1.0001e4", "fwd", _set("softmax_scale", 1.0001e4), ["softmax_scale", "<= 10000"]),
    ("fwd_scale_inf", "fwd", _set("softmax_scale", math.inf), ["softmax_scale", "inf"]),
    ("fwd_scale_nan", "fwd", _set("softmax_scale", math.nan), ["softmax_scale", "nan"]),
    ("fwd_proxy_scale_1e5", "fwd", _set("proxy_scale", 1e5), ["proxy_scale", "<= 10000"]),
    ("select_proxy_scale_1e300", "select", _set("proxy_scale", 1e300), ["proxy_scale", "<= 10000"]),
    ("select_proxy_scale_-1", "select", _set("proxy_scale", -1.0), ["proxy_scale", "> 0"]),
    ("bwd_scale_1e300", "bwd", _set("softmax_scale", 1e300), ["softmax_scale", "<= 10000"]),
    ("bwd_proxy_scale_-inf", "bwd", _set("proxy_scale", -math.inf), ["proxy_scale", "-inf"]),
    # ---- flags: 0 or 1
    ("fwd_compute_kl_2", "fwd", _set("compute_kl", 2), ["compute_kl", "expected 0 or 1", "2"]),
    ("fwd_compute_kl_-1", "fwd", _set("compute_kl", -1), ["compute_kl", "-1"]),
    ("fwd_validate_256", "fwd", _set("validate", 256), ["validate", "256"]),
    ("bwd_deterministic_3", "bwd", _set("deterministic", 3), ["deterministic", "3"]),
    ("bwd_validate_-1", "bwd", _set("validate", -1), ["validate", "-1"]),
    # ---- data: the upstream kl gradient must be finite
    ("bwd_dkl_inf", "bwd", lambda c: (c.t["dkl"].fill_(math.inf)), ["dkl", "finite"]),
    ("bwd_dkl_nan", "bwd", lambda c: (c.t["dkl"].fill_(math.nan)), ["dkl", "finite"]),
    # ---- the thread setting of the CPU backend: an integer in [1, 1024]
] + [(f"{e}_threads_{v}", e, _env_threads(v), ["FLASHMSA_NUM_THREADS", "[1, 1024]", repr(v)])
     for e, v in [("fwd", "40000"), ("fwd", "0"), ("fwd", "-3"), ("fwd", "abc"), ("select", "4x"),
                  ("bwd", "1025"), ("bwd", "99999999999999999999"), ("select", " 2")]]


@pytest.mark.parametrize("case", ABI_CASES, ids=[c[0] for c in ABI_CASES])
def test_c_abi(case, monkeypatch):
    name, entry, mutate, words = case
    monkeypatch.setenv("FLASHMSA_NUM_THREADS", "2")
    c = Call(entry)
    mutate(c)
    status, msg = c.run()
    assert status == L.INVALID_ARGUMENT, (status, msg)
    assert msg.startswith(f"flashmsa_{entry}"), msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    c.untouched()


def _results(c):
    return {n: x.clone() for n, x in c.outs.items()}


@pytest.mark.parametrize("entry", ["select", "fwd", "bwd"])
def test_c_abi_boundaries_are_accepted(entry, monkeypatch):
    """The edges of the ranges run: max_seqlen 2^31 - 1, scales 1e4 (finite results), -0.0
    (the default, like 0), FLASHMSA_NUM_THREADS empty (unset) and 1024."""
    monkeypatch.setenv("FLASHMSA_NUM_THREADS", "1")
    base = Call(entry)
    assert base.run()[0] == L.SUCCESS
    want = _results(base)
    for env, edit in [("1", _set("max_seqlen", 2**31 - 1)), ("1", _set("proxy_scale", -0.0)),
                      ("", lambda c: None), ("1024", lambda c: None)]:
        monkeypatch.setenv("FLASHMSA_NUM_THREADS", env)
        c = Call(entry)
        edit(c)
        status, msg = c.run()
        assert status == L.SUCCESS, msg
        for n, x in c.outs.items():
            assert rel_l2(x, want[n]) < 1e-12, (env, n)
    c = Call(entry)
    if entry != "select":
        c.args.softmax_scale = 1e4
    c.args.proxy_scale = 1e4
    assert c.run()[0] == L.SUCCESS
    for n, x in c.outs.items():
        assert (torch.isfinite(x) | (x == -math.inf)).all() and not x.eq(SENTINEL).any(), n


def test_c_abi_thread_counts_agree(monkeypatch):
    """The forward is the same for any thread count (items own their rows); the backward is
    deterministic for a given count."""
    res = {}
    for threads in ("1", "3", "1024", "3"):
        monkeypatch.setenv("FLASHMSA_NUM_THREADS", threads)
        outs = {}
        for entry in ("fwd", "bwd"):
            c = Call(entry)
            assert c.run()[0] == L.SUCCESS
            outs.update(_results(c))
        if threads in res:
            assert all(torch.equal(outs[n], res[threads][n]) for n in outs)
        res[threads] = outs
    for n in ("out", "lse", "kl", "proxy_lse", "indices"):
        assert torch.equal(res["1"][n], res["1024"][n]), n
    for n in ("dq", "dk", "dv", "dqp", "dkp"):
        assert rel_l2(res["1024"][n], res["1"][n]) < 1e-12, n


# A process whose address space cannot hold 1024 thread stacks: thread creation fails part way.
_LIMITED = r"""
import os, resource, sys
sys.path.insert(0, sys.argv[1])
import torch, flashmsa
from flashmsa.testing import make_inputs
x = make_inputs(lengths=[900, 100], Hq=4, Hkv=2, Hp=2, Hpk=1, D=8, Dp=8, seed=5)
a = [x[n] for n in ("q", "k", "v", "qp", "kp")]
def vm():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
lim = vm() + 400 * 2**20  # room for the data, not for 1024 stacks of 8 MiB
resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
out, kl, lse, idx = flashmsa.msa_attention(*a, 2, cu_seqlens=x["cu_seqlens"], max_seqlen=900,
                                           return_lse=True, return_indices=True)
torch.save(dict(out=out, kl=kl, lse=lse, idx=idx), sys.argv[2])
"""


def test_thread_creation_failure_falls_back_and_stays_exact(tmp_path):
    """FLASHMSA_NUM_THREADS=1024 under an address-space limit: the threads that cannot start leave
    their work to the calling thread; the result is bitwise the unlimited one."""
    env = dict(os.environ, FLASHMSA_NUM_THREADS="1024", OMP_NUM_THREADS="1")
    py = str(pathlib.Path(flashmsa.__file__).parents[1])  # the package under test
    outs = []
    for limited in (False, True):
        script = _LIMITED if limited else _LIMITED.replace("resource.setrlimit", "(lambda *a: None)")
        path = tmp_path / f"{limited}.pt"
        p = subprocess.run([sys.executable, "-c", script, py, str(path)], env=env, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
        outs.append(torch.load(path))
    for n in outs[0]:
        assert torch.equal(outs[0][n], outs[1][n]), n


# =============================================================================================
# The CLI (flashmsa run)
# =============================================================================================
HEADS_ARGS = ["--backend", "cpu", "--hq", "4", "--hkv", "2", "--hp", "2", "--d", "8", "--dp", "8", "--topk", "2"]
SMALL = HEADS_ARGS + ["--seqlen", "300", "--quiet"]


def cli(build_dir, args, env=None, limit_as=None, timeout=120):
    """flashmsa run ARGS (FLASHMSA_NUM_THREADS unset unless env sets it); limit_as: RLIMIT_AS."""
    def pre():
        if limit_as:
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))
    e = {k: v for k, v in os.environ.items() if k != "FLASHMSA_NUM_THREADS"}
    e.update(env or {})
    return subprocess.run([str(build_dir / "flashmsa"), "run", *args], env=e, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=pre)


CLI_USAGE = [
    ("threads_0", ["--threads", "0"], ["--threads", "[1, 1024]", "0"]),
    ("threads_-1", ["--threads", "-1"], ["--threads", "[1, 1024]"]),
    ("threads_1025", ["--threads", "1025"], ["--threads", "[1, 1024]", "1025"]),
    ("threads_4096", ["--threads", "4096"], ["--threads", "[1, 1024]", "4096"]),
    ("threads_abc", ["--threads", "abc"], ["--threads", "integer"]),
    ("threads_1.5", ["--threads", "1.5"], ["--threads", "integer"]),
    ("threads_empty", ["--threads="], ["--threads", "empty"]),
    ("kl_grad_1e308", ["--kl-grad", "1e308"], ["--kl-grad", "|X| <= 1e6", "1e308"]),
    ("kl_grad_-1e7", ["--kl-grad", "-1e7"], ["--kl-grad", "|X| <= 1e6"]),
    ("kl_grad_inf", ["--kl-grad", "inf"], ["--kl-grad", "finite"]),
    ("kl_grad_nan", ["--kl-grad", "nan"], ["--kl-grad", "finite"]),
    ("kl_grad_abc", ["--kl-grad", "abc"], ["--kl-grad", "finite number"]),
    ("topk_0", ["--topk", "0"], ["--topk", "[1, 64]"]),
    ("topk_65", ["--topk", "65"], ["--topk", "[1, 64]"]),
    ("topk_2^32+2", ["--topk", str(2**32 + 2)], ["--topk", "[1, 64]"]),
    ("hq_0", ["--hq", "0"], ["--hq", "[1, 65536]"]),
    ("hq_2^31+1", ["--hq", str(2**31 + 1)], ["--hq", "[1, 65536]"]),
    ("d_0", ["--d", "0"], ["--d", "[1, 4096]"]),
    ("seqlen_-1", ["--seqlen", "-1"], ["--seqlen"]),
    ("seqlen_2^31+1", ["--seqlen", str(2**31 + 1)], ["--seqlen"]),
    ("lengths_sum_above_int32", ["--lengths", f"{2**31 - 1},5"], ["int32"]),
    ("batch_total_above_int32", ["--batch", str(2**20), "--seqlen", "4096"], ["int32"]),
    ("seed_negative", ["--seed", "-1"], ["--seed", "non-negative"]),
    ("dtype_fp8", ["--dtype", "fp8"], ["--dtype", "bf16, fp16, fp32 or fp64"]),
    ("cp_in_the_program", ["--cp", "2"], ["--cp", "pip-installed `flashmsa run --cp N`"]),
    ("host_memory", ["--seqlen", str(2**31 - 1), "--hq", "1024", "--hkv", "1", "--hp", "1", "--d", "4096"],
     ["host memory", "GiB"]),
]


@pytest.mark.parametrize("case", CLI_USAGE, ids=[c[0] for c in CLI_USAGE])
def test_cli_usage_errors(build_dir, tmp_path, case):
    """A bad flag: exit 2 with the flag and the valid range named, before anything runs (nothing
    saved, no progress line)."""
    _, flags, words = case
    save = tmp_path / "out"
    p = cli(build_dir, HEADS_ARGS + flags + ["--save", str(save)])  # later flags override earlier ones
    assert p.returncode == 2, (p.returncode, p.stderr)
    for w in words:
        assert w in p.stderr, f"{w!r} not in {p.stderr!r}"
    assert "[select]" not in p.stderr and "[inputs]" not in p.stderr
    assert not save.exists()


@pytest.mark.parametrize("value", ["40000", "0", "-2", "abc", "1025", "3.5"])
def test_cli_bad_thread_env(build_dir, tmp_path, value):
    save = tmp_path / "out"
    p = cli(build_dir, SMALL + ["--save", str(save)], env=dict(FLASHMSA_NUM_THREADS=value))
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "FLASHMSA_NUM_THREADS" in p.stderr and "[1, 1024]" in p.stderr and value in p.stderr
    assert not save.exists()


@pytest.mark.parametrize("where", ["under_a_file", "in_proc", "existing_file"])
def test_cli_save_checked_before_the_run(build_dir, tmp_path, where):
    f = tmp_path / "file.txt"
    f.write_text("x")
    path = {"under_a_file": f / "sub", "in_proc": pathlib.Path("/proc/flashmsa-no/such"),
            "existing_file": f}[where]
    t0 = time.monotonic()
    p = cli(build_dir, HEADS_ARGS + ["--seqlen", "2000", "--save", str(path)])
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "--save" in p.stderr and str(path) in p.stderr
    assert "[select]" not in p.stderr and "[inputs]" not in p.stderr  # nothing computed
    assert time.monotonic() - t0 < 20
    assert f.read_text() == "x"


def _saved(d):
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.npy"))}


def test_cli_valid_edges_run(build_dir, tmp_path):
    """--kl-grad 1e6 and -1e6, --threads 1024, FLASHMSA_NUM_THREADS empty (unset) all run, and
    --check passes."""
    for flags, env in [(["--kl-grad", "1e6", "--threads", "1024"], None),
                       (["--kl-grad", "-1e6", "--dtype", "fp64"], dict(FLASHMSA_NUM_THREADS=""))]:
        p = cli(build_dir, SMALL + flags + ["--check"], env=env)
        assert p.returncode == 0, p.stderr
        assert "PASS" in p.stdout


@pytest.mark.parametrize("mode", ["infer", "train"])
def test_cli_threads_under_a_memory_limit(build_dir, tmp_path, mode):
    """--threads 1024 under an address-space limit that cannot hold 1024 thread stacks: never a
    crash; the thread creation falls back, and the outputs are bitwise those of the same thread
    count without the limit (infer), or (train: the backward's per-thread buffers may not fit
    either) a clear out-of-memory error."""
    args = SMALL + ["--dtype", "fp64", "--seqlen", "1000", "--threads", "1024", "--mode", mode]
    p = cli(build_dir, args + ["--save", str(tmp_path / "free")])
    assert p.returncode == 0, p.stderr
    p = cli(build_dir, args + ["--save", str(tmp_path / "limited")], limit_as=600 * 2**20)
    assert p.returncode in (0, 1), (p.returncode, p.stderr)  # never a signal
    if p.returncode == 0:
        assert _saved(tmp_path / "free") == _saved(tmp_path / "limited")
    else:
        assert mode == "train" and "out of host memory" in p.stderr, p.stderr


# =============================================================================================
# flashmsa.distributed on the CPU (gloo, 2 processes): errors on every rank, no hang
# =============================================================================================
CP_LEN = 62  # the full sequence: varlen [62, H, D] (one sequence) or batched [2, 62, H, D]


def _cp(counts, sizes, extra=({}, {}), cu_total=CP_LEN, expect=None, batched=False):
    """counts: tokens per rank; sizes: shard_sizes per rank; extra: kwargs per rank; cu_total:
    cu_seqlens[-1]; expect: (exception type, words) per rank, None for a result that must match
    the single-process msa_attention."""
    return dict(counts=counts, sizes=sizes, extra=list(extra), cu_total=cu_total, expect=expect, batched=batched)


OK2 = [[32, 30], [32, 30]]
CP_CASES = {
    "none_but_unequal": _cp([32, 30], [None, None], expect=[
        ("ValueError", ["shard_sizes", "add up to 64", "cu_seqlens[-1] = 62", "shard_sizes=None"]),
        ("ValueError", ["shard_sizes", "add up to 60", "cu_seqlens[-1] = 62", "shard_sizes=None"])]),
    "batched_none_but_unequal": _cp([32, 30], [None, None], batched=True, expect=[
        ("ValueError", ["shard_sizes", "do not add up", "[32, 32]", "[30, 30]"])] * 2),
    "sum_not_cu_total": _cp([32, 30], OK2, cu_total=64, expect=[
        ("ValueError", ["shard_sizes", "add up to 62", "cu_seqlens[-1] = 64"])] * 2),
    "lists_disagree": _cp([30, 30], [[30, 32], [32, 30]], expect=[
        ("ValueError", ["shard_sizes", "do not add up", "[30, 32]", "[32, 30]"])] * 2),
    "mine_wrong_on_rank1": _cp([32, 30], [[32, 30], [32, 31]], expect=[
        ("ValueError", ["rank 1 rejected its arguments"]), ("ValueError", ["shard_sizes", "rank 1 holds 30"])]),
    "size_not_int": _cp([32, 30], [[32, "30"], [32, "30"]], expect=[("TypeError", ["shard_sizes", "ints"])] * 2),
    "sizes_a_string": _cp([32, 30], ["32,30", "32,30"], expect=[("TypeError", ["shard_sizes", "list"])] * 2),
    "wrong_length": _cp([32, 30], [[32, 30, 0]] * 2, expect=[("ValueError", ["shard_sizes", "expected 2"])] * 2),
    "negative": _cp([32, 30], [[32, 30, -30]] * 2, expect=[("ValueError", ["shard_sizes", "non-negative"])] * 2),
    "topk_wrap_one_rank": _cp([32, 30], OK2, extra=({}, {"topk": 2**32 + 2}), expect=[
        ("ValueError", ["rank 1 rejected its arguments"]), ("ValueError", ["topk", str(2**32 + 2)])]),
    "flag_str": _cp([32, 30], OK2, extra=({"warmup": "False"},) * 2, expect=[("TypeError", ["warmup", "bool"])] * 2),
    "scale_1e300": _cp([32, 30], OK2, extra=({"softmax_scale": 1e300},) * 2,
                       expect=[("ValueError", ["softmax_scale", "<= 10000"])] * 2),
    "max_seqlen_2^63": _cp([32, 30], OK2, extra=({"max_seqlen": 2**63},) * 2,
                           expect=[("ValueError", ["max_seqlen", "2147483647"])] * 2),
    "batched_max_seqlen_shard": _cp([32, 30], OK2, extra=({"max_seqlen": 32},) * 2, batched=True,
                                    expect=[("ValueError", ["max_seqlen", "S = 62", "32"])] * 2),
    "valid_uneven": _cp([32, 30], OK2),
    "valid_uneven_batched": _cp([32, 30], OK2, batched=True, extra=({"max_seqlen": CP_LEN},) * 2),
}


def cp_worker(rank, port, out):
    """One rank: every case in order, each result (or exception) recorded; a barrier after each."""
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    res = {}
    for name, case in CP_CASES.items():
        counts, b = case["counts"], case["batched"]
        heads = dict(Hq=4, Hkv=2, Hp=2, Hpk=1, D=8, Dp=8)
        x = (make_inputs(batch=2, seqlen=CP_LEN, seed=21, **heads) if b
             else make_inputs(lengths=[CP_LEN], seed=21, **heads))
        start, td = sum(counts[:rank]), 1 if b else 0
        loc = [x[n].narrow(td, start, counts[rank]) for n in NAMES]
        seq = {} if b else dict(cu_seqlens=torch.tensor([0, case["cu_total"]], dtype=torch.int32))
        kw = dict(topk=2, shard_sizes=case["sizes"][rank], return_lse=True, **seq)
        kw.update(case["extra"][rank])
        topk = kw.pop("topk")
        try:
            o, kl, lse = fcp.msa_attention_cp(*loc, topk, **kw)
            wo, wkl, wlse = flashmsa.msa_attention(*[x[n] for n in NAMES], 2, return_lse=True, **seq)
            wlse = wlse.view(4, 2, CP_LEN)[:, :, start:start + counts[rank]].reshape(4, -1) if b \
                else wlse[:, start:start + counts[rank]]
            res[name] = dict(err=[rel_l2(o, wo.narrow(td, start, counts[rank])), rel_l2(kl, wkl), rel_l2(lse, wlse)])
        except Exception as e:  # noqa: BLE001 - reported to the test
            res[name] = dict(exc=[type(e).__name__, str(e)])
        dist.barrier()
    pathlib.Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp_world(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_bad")
    for attempt in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, FLASHMSA_NUM_THREADS="1", OMP_NUM_THREADS="1")
        if "GLOO_SOCKET_IFNAME" not in env and pathlib.Path("/sys/class/net/lo").exists():
            env["GLOO_SOCKET_IFNAME"] = "lo"
        procs = [subprocess.Popen([sys.executable, str(HERE), "--cp-worker", str(r), str(port), str(out)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                 for r in range(2)]
        logs, deadline = [], time.monotonic() + 120
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                logs.append(p.communicate()[0] + "\n[timed out: a rank hung]")
        if all(p.returncode == 0 for p in procs):
            return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], ""
    return None, "\n".join(logs)[-6000:]


@pytest.mark.parametrize("case", list(CP_CASES))
def test_distributed_errors_on_every_rank(cp_world, case):
    ranks, log = cp_world
    assert ranks is not None, f"the world failed or hung:\n{log}"
    expected = CP_CASES[case]["expect"]
    for rank, res in enumerate(r[case] for r in ranks):
        if expected is None:
            assert "exc" not in res, res
            assert max(res["err"]) < 1e-12, res
            continue
        kind, words = expected[rank]
        assert "exc" in res, f"rank {rank}: expected {kind}, got a result"
        assert res["exc"][0] == kind, (rank, res["exc"])
        for w in words:
            assert w in res["exc"][1], (rank, w, res["exc"][1])


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--cp-worker":
    cp_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
