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
