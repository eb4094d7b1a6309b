"""flashmsa.nn.MSAttention and the long-context example (a short smoke run)."""
import importlib.util
import math
import types
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
ROOT = pathlib.Path(__file__).resolve().parents[2]

import flashmsa  # noqa: E402
from flashmsa.nn import MSAttention, positions, set_warmup  # noqa: E402
from flashmsa.testing import rel_l2  # noqa: E402


def layer(**kw):
    torch.manual_seed(0)
    args = dict(embed_dim=32, num_heads=4, num_kv_heads=2, num_proxy_heads=2, head_dim=8, topk=2)
    return MSAttention(**{**args, **kw}).double()


def test_shapes_and_varlen_equals_batched():
    m = layer()
    x = torch.randn(3, 200, 32, dtype=torch.float64)
    with torch.no_grad():  # (evaluation: the forward computes kl)
        y, kl = m(x)
        cu = torch.tensor([0, 200, 400, 600], dtype=torch.int32)
        yv, klv = m(x.reshape(600, 32), cu_seqlens=cu, max_seqlen=200)
    assert y.shape == x.shape and kl.shape == () and kl.item() > 0
    assert rel_l2(yv.reshape(x.shape), y) < 1e-13 and rel_l2(klv, kl) < 1e-13
    assert positions(cu, 600).tolist() == list(range(200)) * 3


@pytest.mark.parametrize("warmup", [False, True])
def test_flashmsa_backend_matches_reference_backend(warmup):
    m = layer(warmup=warmup)
    x = torch.randn(2, 300, 32, dtype=torch.float64)
    res = {}
    for backend in ("flashmsa", "reference"):
        m.backend = backend
        m.zero_grad(set_to_none=True)
        y, kl = m(x)
        (y.square().mean() + kl).backward()
        res[backend] = (y, kl, {n: p.grad.clone() for n, p in m.named_parameters()})
    (y1, k1, g1), (y2, k2, g2) = res.values()
    assert rel_l2(y1, y2) < 1e-12 and rel_l2(k1, k2) < 1e-12
    for n in g1:
        assert rel_l2(g1[n], g2[n]) < 1e-10, n


def test_precise_dpsum_option():
    """precise_dpsum=True reaches msa_attention; on the CPU (exact fp64 dpsum) the gradients stay equal."""
    x = torch.randn(2, 300, 32, dtype=torch.float64)
    grads = []
    for precise in (False, True):
        m = layer(precise_dpsum=precise)
        y, kl = m(x)
        (y.square().mean() + kl).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


def test_warmup_switch_and_kl_routing():
    m = layer()
    x = torch.randn(1, 400, 32, dtype=torch.float64, requires_grad=True)
    set_warmup(torch.nn.Sequential(m), True)
    assert m.warmup
    y_dense, _ = m(x)
    set_warmup(m, False)
    y_sparse, kl = m(x)
    assert rel_l2(y_sparse, y_dense) > 1e-3  # the selection drops blocks
    # the kl term trains the proxy projections only (their input is detached)
    grads = torch.autograd.grad(kl, [m.q_proj.weight, m.qp_proj.weight, m.kp_proj.weight, x])
    assert grads[0].abs().max() == 0 and grads[1].abs().max() > 0 and grads[2].abs().max() > 0
    assert grads[3].abs().max() == 0
    m.detach_proxy_input = False
    _, kl = m(x)
    assert torch.autograd.grad(kl, x)[0].abs().max() > 0


def test_kl_coef_and_record_indices():
    """kl_term is the kl value (filled in by the backward when training) whose gradient is kl_coef
    times the upstream one; last_kl is the same value."""
    m = layer(kl_coef=0.25)
    m.record_indices = True
    x = torch.randn(1, 300, 32, dtype=torch.float64)
    with torch.no_grad():
        _, term_eval = m(x)
        q, k, v, qp, kp = m.project(x)
        out, kl, idx = flashmsa.msa_attention(q, k, v, qp, kp, 2, return_indices=True)
    assert term_eval.item() == kl.item() > 0 and torch.equal(m.last_indices, idx)
    _, term = m(x)  # training: the parameters require grad
    assert math.isnan(term.item()) and math.isnan(m.last_kl.item())  # no value before the backward
    g = torch.autograd.grad(term, m.qp_proj.weight)[0]
    assert term.item() == kl.item() and m.last_kl.item() == kl.item()
    m1 = layer(kl_coef=1.0)
    m1.load_state_dict(m.state_dict())
    g1 = torch.autograd.grad(m1(x)[1], m1.qp_proj.weight)[0]
    assert rel_l2(g, 0.25 * g1) < 1e-14


def test_bad_configuration():
    with pytest.raises(ValueError, match="num_kv_heads"):
        MSAttention(32, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_proxy_kv_heads"):
        MSAttention(32, 4, 2, num_proxy_heads=2, num_proxy_kv_heads=3)
    with pytest.raises(ValueError, match="backend"):
        MSAttention(32, 4, backend="triton")
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer()(torch.randn(10, 32, dtype=torch.float64))


def _example():
    spec = importlib.util.spec_from_file_location("train_long_context", ROOT / "examples" / "train_long_context.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_smoke(tmp_path, capsys):
    ex = _example()
    hist = ex.main(["--steps", "4", "--warmup-steps", "2", "--eval-every", "2", "--seqlen", "256",
                    "--batch", "2", "--queries", "8", "--out", str(tmp_path)])
    assert [h["mode"] for h in hist] == ["dense", "sparse", "sparse"]
    assert all(0 <= h["recall"] <= 1 and h["kl"] >= 0 for h in hist)
    assert (tmp_path / "train_long_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "recall" in capsys.readouterr().out


def test_example_bf16_autocast_keeps_fp32_weights(tmp_path):
    """--dtype bfloat16 (the GPU preset's): fp32 weights, bf16 compute under autocast; training
    moves the weights (pure bf16 weights lost AdamW's small updates on the H200)."""
    ex = _example()
    hist = ex.main(["--steps", "3", "--warmup-steps", "1", "--eval-every", "3", "--seqlen", "256",
                    "--batch", "2", "--queries", "8", "--dtype", "bfloat16"])
    assert [h["mode"] for h in hist] == ["dense", "sparse"]
    assert all(0 <= h["recall"] <= 1 and h["kl"] >= 0 for h in hist)
    task = ex.Recall(256, 4, 8)
    a = types.SimpleNamespace(**{**ex.PRESETS["cpu"], "dtype": "bfloat16", "kl_coef": 1.0, "backend": "flashmsa"})
    model = ex.Model(a, task)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    tok, val, tgt = task.batch(2, torch.Generator().manual_seed(0))
    with model.autocast():
        logits, kl = model(tok, val)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_example_tiny_png_writer(tmp_path):
    ex = _example()
    series = [("loss", [3.0, 2.0, 1.0]), ("kl", [0.1, 0.2, 0.05]), ("recall", [0.5, 0.7, 0.8])]
    png = ex._tiny_png([0, 10, 20], series, 10, tmp_path / "p.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and b"IEND" in png[-12:]


def test_example_length_curriculum(tmp_path):
    """--start-seqlen: the warmup trains on doubling lengths up to --seqlen; the sparse phase and
    the evaluations use --seqlen; a bad start length is refused."""
    ex = _example()
    a = types.SimpleNamespace(start_seqlen=1024, seqlen=8192, warmup_steps=500)
    assert [ex.train_seqlen(a, s) for s in (0, 124, 125, 250, 374, 375, 499, 500, 900)] == \
        [1024, 1024, 2048, 4096, 4096, 8192, 8192, 8192, 8192]
    a.start_seqlen = 8192
    assert ex.train_seqlen(a, 0) == 8192
    hist = ex.main(["--steps", "4", "--warmup-steps", "2", "--eval-every", "1", "--seqlen", "512",
                    "--start-seqlen", "256", "--batch", "2", "--queries", "8"])
    assert [h["train_seqlen"] for h in hist] == [256, 512, 512, 512, 512]
    with pytest.raises(SystemExit):
        ex.main(["--steps", "1", "--seqlen", "512", "--start-seqlen", "1024"])


def test_last_kl_collects_the_layers_values_after_the_backward():
    """flashmsa.nn.last_kl: the mean (or sum) of the layers' kl values that the backward filled in,
    equal to the values an evaluation forward computes."""
    from flashmsa.nn import last_kl

    torch.manual_seed(1)
    model = torch.nn.Sequential(layer(), layer(kl_coef=0.5))
    with pytest.raises(ValueError, match="no MSAttention"):
        last_kl(model)
    x = torch.randn(1, 300, 32, dtype=torch.float64)
    with torch.no_grad():
        y0, kl0 = model[0](x)
        _, kl1 = model[1](y0)
    want = [kl0.item(), kl1.item()]
    y, k0 = model[0](x)
    y, k1 = model[1](y)
    assert math.isnan(last_kl(model).item())  # before the backward: no value yet
    (y.square().mean() + k0 + k1).backward()
    assert abs(last_kl(model).item() - sum(want) / 2) < 1e-14
    assert abs(last_kl(model, "sum").item() - sum(want)) < 1e-14
    with pytest.raises(ValueError, match="reduce"):
        last_kl(model, "max")



def test_proxy_param_groups():
    from flashmsa.nn import proxy_param_groups
    model = torch.nn.Sequential(MSAttention(32, 4, 2, 2, head_dim=8, dtype=torch.float64), torch.nn.Linear(32, 32))
    groups = proxy_param_groups(model, 0.5)
    proxy = list(model[0].qp_proj.parameters()) + list(model[0].kp_proj.parameters())
    assert len(groups) == 2 and "lr" not in groups[0] and groups[1]["lr"] == 0.5
    assert [id(p) for p in groups[1]["params"]] == [id(p) for p in proxy]
    assert len(groups[0]["params"]) + len(proxy) == len(list(model.parameters()))
    assert not {id(p) for p in groups[0]["params"]} & {id(p) for p in proxy}
    torch.optim.AdamW(groups, lr=0.1)  # a valid optimizer argument
    assert len(proxy_param_groups(torch.nn.Linear(3, 3), 0.5)) == 1
    with pytest.raises(ValueError, match="proxy_lr"):
        proxy_param_groups(model, 0.0)
