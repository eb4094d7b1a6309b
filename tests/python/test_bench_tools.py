"""bench/tools/fp8_selection_quality.py: its selection equals flashmsa.msa_select's sets, the e4m3 round trip keeps
every value within e4m3's rounding of its per-(token, head) scale, and a run reports sound numbers."""
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench" / "tools"))
import fp8_selection_quality as F  # noqa: E402


def test_fp8_roundtrip_is_e4m3_rounding():
    x = torch.randn(300, 4, 128, generator=torch.Generator().manual_seed(1)) * 3
    y = F.fp8_roundtrip(x)
    scale = x.abs().amax(-1, keepdim=True) / F.E4M3_MAX
    torch.testing.assert_close(y.abs().amax(-1), x.abs().amax(-1), rtol=1e-6, atol=0)  # the amax maps to 448
    # e4m3 has 3 mantissa bits: relative rounding <= 2^-4 for normal values, absolute 2^-10 scale below them
    err = (y - x).abs()
    assert bool((err <= torch.maximum(x.abs() * 2.0 ** -4, scale * 2.0 ** -9)).all())
    assert not torch.equal(y, x)


def test_selection_and_report(capsys):
    assert F.main(["--check", "--seqlen", "4096", "--config", "fmsa", "--patterns", "clustered", "--rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "equal sets" in out
    import json
    r = json.loads(out.strip().splitlines()[-1])
    assert r["tokens"] == 4096 and 0.8 < r["set_recall"] <= 1.0 and 0 <= r["rows_unchanged"] <= 1
    assert 0 < r["mass_recall_fp8"] <= 1 and 0 < r["mass_recall_bf16"] <= 1


def test_long_context_table_rows(tmp_path):
    """bench/long_context.py's table: a measured row, a row past --dense-max (cuDNN extrapolated, marked '~') and a
    row that ran out of memory (its message in the row, no numbers)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
    import long_context as LC
    import run_bench as RB
    meta = dict(date="2026-12-07 12:00", commit="abc", gpu={"name": "GPU"}, command="python3 bench/long_context.py")
    rows = [dict(config="m3", seqlen=262144, pattern="random", select_ms=20.0, step_ms=100.0, peak_gb=30.0,
                 inputs_gb=20.0, gpu_total_gb=150.0, kl=0.5, cudnn=dict(step_ms=800.0, peak_gb=25.0)),
            dict(config="m3", seqlen=524288, pattern="random", select_ms=80.0, step_ms=250.0, peak_gb=60.0,
                 inputs_gb=40.0, gpu_total_gb=150.0, kl=0.5, cudnn=None, cudnn_extrapolated_ms=3200.0),
            dict(config="m3", seqlen=1048576, pattern="random", error="out of memory: Tried to allocate 40 GiB",
                 peak_gb=140.0, cudnn=None, cudnn_extrapolated_ms=12800.0)]
    path = str(tmp_path / "long_context.md")
    lines = RB.append_rows(path, LC.TITLE, LC.INTRO, LC.columns(), meta, rows)
    cells = [[c.strip() for c in l.strip("|").split("|")] for l in lines[-3:]]
    head = [h for h, _ in LC.columns()]
    at = {h: i for i, h in enumerate(head)}
    assert cells[0][at["step vs cuDNN"]] == "8.00x" and cells[0][at["select share"]] == "20%"
    assert cells[1][at["cuDNN fwd+bwd ms"]] == "~3200" and cells[1][at["step vs cuDNN"]] == "~12.80x"
    assert cells[2][at["**step** ms"]] == "-" and "out of memory" in cells[2][at["error"]]
    assert cells[2][at["peak GB"]] == "140.00"


def test_cp_model_overlap_bounds():
    import cp_model as C
    T, P, step1 = 524288, 8, 1000.0
    # no exchange cost: every bound is the even split
    step, eff, fwd_ov, ideal = C.model(step1, T, P, 1e12, 1e12, select_ms=300.0)
    assert abs(step - step1 / P) < 1e-6 and abs(eff - 1) < 1e-6 and abs(fwd_ov - step) < 1e-6 and ideal == step1 / P
    # NVLink: the forward's gather of k and v (8/9 of a third of the key bytes) hides under a long selection
    step, eff, fwd_ov, ideal = C.model(step1, T, P, 370.0, 45.0, select_ms=1e6)
    t_key = 1e3 * C.key_bytes(T, P) / 370e9
    assert abs(step - (step1 / P + t_key)) < 1e-9 and abs(step - fwd_ov - t_key * 8 / 27) < 1e-9  # k, v: 8/9
    assert ideal == max(step1 / P, t_key) and eff < 1
    # a short selection hides only its own time
    _, _, fwd_ov2, _ = C.model(step1, T, P, 370.0, 45.0, select_ms=8.0)
    assert abs(step - fwd_ov2 - 1.0) < 1e-9
