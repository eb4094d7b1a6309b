"""bench/topk_sweep.py's table, speed-ups and --plot mode on a synthetic result (the sweep itself
needs CUDA: `python3 bench/topk_sweep.py --out DIR` on the GPU machine)."""
import json

from file_module import load


def _sweep():
    return load("bench/topk_sweep.py", "topk_sweep")


def _result():
    rows = [dict(config="m3", seqlen=32768, topk=k, step_ms=ms, cudnn_step_ms=112.0, peak_gb=4.8, cudnn_peak_gb=5.05)
            for k, ms in ((16, 28.0), (4, 14.0), (64, 112.0))]
    rows.append(dict(config="fmsa", seqlen=32768, topk=8, cudnn_step_ms=28.0, error="out of memory"))
    return dict(date="2026-11-30", gpu="NVIDIA H200", torch="2.11", pattern="clustered",
                command="python3 bench/topk_sweep.py", rows=rows)


def test_speedups_sorted_by_topk_without_failed_rows():
    s = _sweep().speedups(_result())
    assert s == {("m3", 32768): [(4, 8.0), (16, 4.0), (64, 1.0)]}


def test_markdown_rows():
    md = _sweep().markdown(_result())
    assert "| m3 | 32768 | 4 | 1.6% | 14.00 | 112.0 | **8.00x** | 4.80 | 5.05 |" in md
    assert "| m3 | 32768 | 64 | 25.0% | 112.00 | 112.0 | **1.00x** | 4.80 | 5.05 |" in md
    assert "| fmsa | 32768 | 8 | 3.1% | error: out of memory | 28.0 | - | - | - |" in md


def test_plot_mode_rewrites_table_from_json(tmp_path):
    p = tmp_path / "topk-sweep.json"
    p.write_text(json.dumps(_result()))
    _sweep().main(["--plot", str(p)])
    assert "**4.00x**" in (tmp_path / "topk-sweep.md").read_text()
    png = tmp_path / "topk-sweep.png"
    if png.exists():  # with matplotlib
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
