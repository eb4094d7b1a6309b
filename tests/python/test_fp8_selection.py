"""The fp8 selection (C header, flashmsa_selection_t; CPU backend): the blocks are ranked on e4m3 copies of qp (one
scale per token and head) and kp (one per 128-token key block and head), the rest of the call uses qp, kp as given.
Checked against an independent emulation with torch's float8_e4m3fn: the same indices as the ordinary selection on
the dequantised values, the proxy lse of the unquantised values over those blocks, msa_attention equal to the
given-indices call with them, and that it does change some selections; on a GPU the CUDA kernel against the CPU
backend."""
import pytest

torch = pytest.importorskip("torch")

import flashmsa  # noqa: E402

BLOCK = 128


def inputs(lengths, Hp=4, Hpk=1, Dp=16, seed=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    qp = torch.randn(T, Hp, Dp, generator=g)
    kp = torch.randn(T, Hpk, Dp, generator=g)
    # scales over many orders of magnitude, a zero row and a zero key block: the groups' scales matter
    qp[::5] *= 1e3
    qp[1::7] *= 1e-3
    qp[3] = 0
    kp[: BLOCK // 2] *= 50
    kp[BLOCK:2 * BLOCK] = 0
    kp[2 * BLOCK + 3] *= 1e4
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return qp.to(dtype), kp.to(dtype), cu


def e4m3(x):
    """x [..., n] fp32 -> the dequantised e4m3 values with one scale amax / 448 per last-dim group (fp64)."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    q = (x * (448.0 / safe)).to(torch.float8_e4m3fn).double() * (safe / 448.0).double()
    return torch.where(amax > 0, q, torch.zeros_like(q))


def emulate(qp, kp, cu):
    q8 = e4m3(qp)
    k8 = torch.empty(kp.shape, dtype=torch.float64)
    for b in range(len(cu) - 1):
        for lo in range(int(cu[b]), int(cu[b + 1]), BLOCK):
            hi = min(lo + BLOCK, int(cu[b + 1]))
            blk = kp[lo:hi].float().transpose(0, 1).reshape(kp.shape[1], -1)  # [Hpk, rows x Dp]
            k8[lo:hi] = e4m3(blk).reshape(kp.shape[1], hi - lo, kp.shape[2]).transpose(0, 1)
    return q8, k8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_indices_equal_the_selection_of_the_e4m3_values(dtype):
    lengths = [700, 129, 1, 380]
    qp, kp, cu = inputs(lengths, dtype=dtype)
    q8, k8 = emulate(qp, kp, cu)
    want = flashmsa.msa_select(q8, k8, 4, cu_seqlens=cu)
    got = flashmsa.msa_select(qp, kp, 4, cu_seqlens=cu, fp8_selection=True)
    assert torch.equal(got, want)
    plain = flashmsa.msa_select(qp, kp, 4, cu_seqlens=cu)
    changed = (torch.sort(got, -1).values != torch.sort(plain, -1).values).any(-1).float().mean().item()
    assert 0 < changed < 0.5, changed  # it ranks differently on some rows, not on most


def test_proxy_lse_is_the_unquantised_one_over_the_selected_blocks():
    qp, kp, cu = inputs([300, 260], dtype=torch.float64)
    idx, plse = flashmsa.msa_select(qp, kp, 3, cu_seqlens=cu, fp8_selection=True, return_proxy_lse=True)
    Hp, Dp = qp.shape[1], qp.shape[2]
    for t in range(0, qp.shape[0], 7):
        b = int((cu[1:] <= t).sum())
        s0 = int(cu[b])
        pos = t - s0
        for p in range(Hp):
            keys = [s0 + u for j in idx[p, t].tolist() if j >= 0 for u in range(j * BLOCK, min(j * BLOCK + BLOCK, pos + 1))]
            z = (qp[t, p] @ kp[keys, p * kp.shape[1] // Hp].T) * Dp ** -0.5
            torch.testing.assert_close(plse[p, t], torch.logsumexp(z, 0), rtol=1e-12, atol=1e-12)


def test_attention_equals_the_given_call_with_its_indices():
    qp, kp, cu = inputs([300, 129, 260], dtype=torch.float64)
    g = torch.Generator().manual_seed(9)
    T = qp.shape[0]
    q, k, v = (torch.randn(T, h, 16, generator=g, dtype=torch.float64) for h in (8, 2, 2))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, qp, kp)]
    out, kl, idx = flashmsa.msa_attention(*leaves, 3, cu_seqlens=cu, fp8_selection=True, return_indices=True,
                                          compute_kl=True)
    assert torch.equal(idx, flashmsa.msa_select(qp, kp, 3, cu_seqlens=cu, fp8_selection=True))
    leaves2 = [x.clone().requires_grad_() for x in (q, k, v, qp, kp)]
    out2, kl2 = flashmsa.msa_attention(*leaves2, 3, cu_seqlens=cu, indices=idx, compute_kl=True)
    torch.testing.assert_close(out, out2, rtol=0, atol=0)
    torch.testing.assert_close(kl, kl2, rtol=0, atol=0)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    ga = torch.autograd.grad((out * w).sum() + 3 * kl, leaves)
    gb = torch.autograd.grad((out2 * w).sum() + 3 * kl2, leaves2)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_ignored_outside_the_sparse_mode_and_checked():
    qp, kp, cu = inputs([300], dtype=torch.float64)
    q = torch.randn(300, 4, 16, dtype=torch.float64)
    a = flashmsa.msa_attention(q, q[:, :1], q[:, :1], qp, kp, 3, cu_seqlens=cu, warmup=True, fp8_selection=True)
    b = flashmsa.msa_attention(q, q[:, :1], q[:, :1], qp, kp, 3, cu_seqlens=cu, warmup=True)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    with pytest.raises(TypeError, match="fp8_selection: expected a bool"):
        flashmsa.msa_select(qp, kp, 3, cu_seqlens=cu, fp8_selection=1)


def block_scores(q8, k8, cu, Hp, p, t, blocks):
    """fp64 block scores (max of the scaled logits over the block's keys up to t) of the dequantised copies."""
    b = int((cu[1:] <= t).sum())
    s0 = int(cu[b])
    c = p * k8.shape[1] // Hp
    out = []
    for j in blocks:
        keys = range(s0 + j * BLOCK, min(s0 + j * BLOCK + BLOCK, t + 1))
        out.append(float((k8[list(keys), c] @ q8[t, p]).max()) * q8.shape[-1] ** -0.5)
    return out


@pytest.mark.skipif(not torch.cuda.is_available() or not flashmsa.cuda_available(), reason="needs the CUDA backend")
@pytest.mark.parametrize("lengths,topk", [([2000, 129, 1, 900], 4), ([3000, 300], 20)])
def test_cuda_equals_the_cpu_backend(lengths, topk):
    """The CUDA e4m3 kernel against the CPU backend on the same bf16 values (scales over many orders of magnitude, a
    zero row, a zero key block): the rows equal up to swaps of blocks whose scores on the dequantised copies agree
    to 1e-2 (the fp8 tensor cores accumulate with fewer bits than fp32), the kernel follows the fp8 ranking where it
    differs from the input dtype's, and the proxy lse is the unquantised one (rows with the same blocks)."""
    qp, kp, cu = inputs(lengths, Dp=128)
    qp, kp = qp.bfloat16(), kp.bfloat16()
    want, wlse = flashmsa.msa_select(qp.double(), kp.double(), topk, cu_seqlens=cu, fp8_selection=True,
                                     return_proxy_lse=True)
    plain = flashmsa.msa_select(qp.double(), kp.double(), topk, cu_seqlens=cu)
    got, glse = flashmsa.msa_select(qp.cuda(), kp.cuda(), topk, cu_seqlens=cu.cuda(), fp8_selection=True,
                                    return_proxy_lse=True)
    got, glse = got.cpu(), glse.cpu()
    q8, k8 = emulate(qp, kp, cu)
    Hp = qp.shape[1]
    bad = []
    for p, t in (want != got).any(-1).nonzero().tolist():
        slots = (want[p, t] != got[p, t]).nonzero().flatten().tolist()
        a = block_scores(q8, k8, cu, Hp, p, t, [int(got[p, t, s]) for s in slots])
        b = block_scores(q8, k8, cu, Hp, p, t, [int(want[p, t, s]) for s in slots])
        chosen = [x for x in got[p, t].tolist() if x >= 0]
        if len(chosen) != len(set(chosen)) or any(abs(x - y) > 1e-2 * max(abs(x), abs(y)) for x, y in zip(a, b)):
            bad.append((p, t))
    assert not bad, f"{len(bad)} rows differ beyond ties, first {bad[0]}"
    differ = want != plain
    assert differ.any()
    took_fp8 = (got == want)[differ].float().mean().item()
    took_input = (got == plain)[differ].float().mean().item()
    assert took_fp8 > 2 * took_input, (took_fp8, took_input)
    same = (want == got).all(-1)
    torch.testing.assert_close(glse[same].double(), wlse[same], rtol=1e-4, atol=1e-4)
