"""examples/lm_long_context.py, CPU preset (issue 17): a byte-level LM on the Python standard
library's source, MSA vs dense SDPA from the same weights on the same batches. Runs in ~40 s on
the CPU backend."""
import pytest

from file_module import load

torch = pytest.importorskip("torch")


def _example():
    return load("examples/lm_long_context.py", "lm_long_context")


def test_corpus_is_the_stdlib_without_installed_packages():
    ex = _example()
    files = ex.stdlib_files()
    assert len(files) > 100
    assert not any("site-packages" in f.parts or "dist-packages" in f.parts for f in files)
    train, val, facts = ex.load_corpus(0)
    assert facts["train_files"] + facts["val_files"] + facts["unreadable"] == facts["files"]
    assert abs(facts["val_files"] - 0.05 * facts["files"]) <= 1
    assert train.numel() == facts["train_bytes"] and val.numel() == facts["val_bytes"]
    assert ex.load_corpus(0)[2] == facts  # the split is seeded
    assert ex.load_corpus(1)[2]["val_bytes"] != facts["val_bytes"]


def test_causality_check_sees_a_leak():
    import types
    ex = _example()
    a = types.SimpleNamespace(**ex.PRESETS["cpu"])
    torch.manual_seed(0)
    m = ex.LM(a, "dense")
    tok = torch.randint(0, 256, (2, a.seqlen))
    assert ex.causality_check(m, tok, a, torch.device("cpu")) == 0.0
    sdpa = ex.F.scaled_dot_product_attention
    try:  # a baseline that sees the future must fail the check
        ex.F.scaled_dot_product_attention = lambda q, k, v, is_causal=True, **kw: sdpa(q, k, v, is_causal=False, **kw)
        assert ex.causality_check(m, tok, a, torch.device("cpu")) > 1e-3
    finally:
        ex.F.scaled_dot_product_attention = sdpa


def test_set_recall():
    """lm_long_context.set_recall (the fp8 selection's set recall in megatron_gpt.py and bench/long_context.py): the
    share of each row's non-local blocks of `want` that `got` holds, in any slot order, the local block (the last
    valid slot) and -1 slots not counted, rows without non-local blocks skipped."""
    ex = _example()
    want = torch.tensor([[[3, 1, 5, 7], [0, 2, -1, -1], [4, -1, -1, -1]]], dtype=torch.int32)  # locals 7, 2, 4
    same = torch.tensor([[[1, 3, 5, 7], [0, 2, -1, -1], [4, -1, -1, -1]]], dtype=torch.int32)
    assert ex.set_recall(want, same) == 1.0
    got = torch.tensor([[[3, 6, 6, 7], [1, 2, -1, -1], [4, -1, -1, -1]]], dtype=torch.int32)
    assert ex.set_recall(want, got) == pytest.approx((1 / 3 + 0 / 1) / 2)  # row 3 has no non-local block
    assert ex.set_recall(want[:, 2:], got[:, 2:]) != ex.set_recall(want[:, 2:], got[:, 2:])  # no row counted: nan


def test_cpu_preset_trains_both_models(tmp_path):
    ex = _example()
    r = ex.main(["--out", str(tmp_path)])
    msa, dense = r["runs"]["msa"]["curve"], r["runs"]["dense"]["curve"]
    # both models learn the bytes (5.55 nats = uniform over 256; ~2.8 after 40 steps)
    for c in (msa, dense):
        assert c[0]["val_loss"] > 5.0 and c[-1]["val_loss"] < c[0]["val_loss"] - 2.0
    # the dense warmup through the library is dense attention: the MSA model's curve equals the
    # SDPA model's (same initial weights, same batches) until the switch
    for m, d in zip(msa, dense):
        if m["mode"] == "dense":
            assert abs(m["val_loss"] - d["val_loss"]) <= 1e-3 * d["val_loss"], (m, d)
    assert any(m["mode"] == "sparse" for m in msa)
    # the proxy learns: its kl falls over training, and in this preset (proxy lr 5x) after the
    # switch to sparse too, over the selected and the causal set (at 1x both rose:
    # docs/lm_long_context.md); the recall is a share
    assert msa[-1]["kl"] < msa[0]["kl"]
    first_sparse = next(m for m in msa if m["mode"] == "sparse")
    assert msa[-1]["kl_selected_set"] < first_sparse["kl_selected_set"]
    assert msa[-1]["kl_causal_set"] < first_sparse["kl_causal_set"]
    assert all(0.0 < m["recall"] <= 1.0 for m in msa)
    s = r["summary"]
    assert abs(s["gap"]) < 0.05  # 25% of the blocks lose little at this size
    ts = s["trained_selection"]
    assert 1.0 <= ts["union_factor"] <= 1024 // 128 / 2 and ts["tiles"] == 2 * 2 * 8
    for p in ("clustered", "random"):
        assert 1.0 <= s["synthetic_patterns"][p]["union_factor"] <= 4.0
    assert r["corpus"]["files"] > 100 and r["runs"]["msa"]["tokens_per_s"] > 0
    assert 0 < r["runs"]["dense"]["attention_share"] < 2
    # nothing leaks from the future: the first half's logits ignore the second half's tokens
    # (the check itself sees a non-causal SDPA: its max difference is ~0.05 there)
    assert r["runs"]["msa"]["causality_max_abs_diff"] == 0.0
    assert r["runs"]["dense"]["causality_max_abs_diff"] == 0.0
    assert r["runs"]["msa"]["step_ms_sparse_phase"] > 0 and s["step_time_ratio_sparse_phase"] > 0
    assert (tmp_path / "lm_long_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "lm_long_context.csv").read_text().count("\n") == 1 + len(msa) + len(dense)
    sel = torch.load(tmp_path / "selection_layer0_seq0.pt")
    assert sel.shape == (2, 1024, 2)
    proj = torch.load(tmp_path / "proxy_inputs_layer0_seq0.pt")  # (bench/tools/fp8_selection_quality.py --trained)
    assert proj["topk"] == 2 and proj["qp"].shape == (1024, 2, 16) and proj["kp"].shape == (1024, 1, 16)
    assert proj["q"].shape == (1024, 4, 16) and proj["k"].shape == (1024, 2, 16)


def test_joint_indexer_run(tmp_path):
    """--joint: a third run with MSAttention(proxy_output=True) from the same weights and batches; it starts as the
    kl-only model (po_proj zero) and learns."""
    ex = _example()
    r = ex.main(["--joint", "--steps", "10", "--warmup-steps", "5", "--eval-every", "5", "--eval-batches", "1",
                 "--out", str(tmp_path)])
    msa, joint = r["runs"]["msa"]["curve"], r["runs"]["joint"]["curve"]
    assert joint[0]["val_loss"] == msa[0]["val_loss"] and joint[0]["kl"] == msa[0]["kl"]
    assert joint[-1]["val_loss"] < joint[0]["val_loss"] - 1.0 and joint[-1]["mode"] == "sparse"
    assert joint[-1]["val_loss"] != msa[-1]["val_loss"]  # the proxy's output reaches the loss
    s = r["summary"]
    assert s["final_val_loss_joint"] == joint[-1]["val_loss"] and 0 < s["recall_last_joint"] <= 1
    csv = (tmp_path / "lm_long_context.csv").read_text().splitlines()
    assert sum(line.startswith("joint,") for line in csv) == len(joint)
