"""bench/topk_sweep.py's table rows, speed-ups, arguments and --plot mode on a synthetic result (the
sweep itself needs CUDA: `python3 bench/topk_sweep.py` on the GPU machine)."""
import json

import pytest

from file_module import load


def _sweep():
    return load("bench/topk_sweep.py", "topk_sweep")


def _result():
    rows = [dict(config="m3", seqlen=32768, topk=k, step_ms=ms, cudnn_step_ms=112.0, peak_gb=4.8, cudnn_peak_gb=5.05,
                 clocks=dict(sm_mhz=1980.0, mem_mhz=3201.0))
            for k, ms in ((16, 28.0), (4, 14.0), (64, 112.0))]
    rows.append(dict(config="fmsa", seqlen=32768, topk=8, cudnn_step_ms=28.0, error="out of memory"))
    gpu = dict(name="NVIDIA H200", torch="2.11.0", max_sm_mhz=1980.0, max_mem_mhz=3201.0, power_limit_w=700.0)
    return dict(date="2026-11-30 10:00Z", commit="abc1234", gpu=gpu, pattern="clustered",
                command="python3 bench/topk_sweep.py", rows=rows)


STAMP = ("| 2026-11-30 10:00Z | abc1234 | NVIDIA H200 (700 W) | 1980/3201 (max 1980/3201) | 2.11.0 | "
         "`python3 bench/topk_sweep.py` | clustered | ")


def test_speedups_sorted_by_topk_without_failed_rows():
    s = _sweep().speedups(_result())
    assert s == {("m3", 32768): [(4, 8.0), (16, 4.0), (64, 1.0)]}


def test_table_rows():
    md = _sweep().rows_text(_result())
    head = "| date (UTC) | commit | GPU | clocks MHz SM/mem | torch | command | pattern |"
    assert md.splitlines()[0].startswith(head)
    assert STAMP + "m3 | 32768 | 4 | 1.6% | 14.00 | 112.0 | **8.00x** | 4.80 | 5.05 |" in md
    assert STAMP + "m3 | 32768 | 64 | 25.0% | 112.00 | 112.0 | **1.00x** | 4.80 | 5.05 |" in md
    assert ("| fmsa | 32768 | 8 | 3.1% | error: out of memory | 28.0 | - | - | - |" in md)


def test_rows_append_to_one_table(tmp_path):
    sweep = _sweep()
    rb = sweep.run_bench
    path = tmp_path / "topk_sweep.md"
    result = _result()
    for r in result["rows"]:
        rb.append_rows(str(path), sweep.SWEEP_TITLE, sweep.SWEEP_INTRO, sweep.sweep_columns(), result, [r])
    text = path.read_text()
    assert text.count("| date (UTC) |") == 1
    assert text.startswith("# Top-k sweep")
    assert len([l for l in text.splitlines() if l.startswith("| 2026-11-30")]) == 4


def test_arguments():
    a = _sweep().parse_args(["--configs", "fmsa", "--seqlens", "32768", "--topks", "4,16", "--out", "/tmp/x"])
    assert (a.seqlen_list, a.topk_list, a.out) == ([32768], [4, 16], "/tmp/x")
    assert a.argv[1:] == ["--configs", "fmsa", "--seqlens", "32768", "--topks", "4,16", "--out", "/tmp/x"]
    with pytest.raises(SystemExit):
        _sweep().parse_args(["--configs", "m4"])
    with pytest.raises(SystemExit):
        _sweep().parse_args(["--topks", "4,x"])


def test_plot_mode_reads_latest_json(tmp_path, capsys):
    p = tmp_path / "topk_sweep.latest.json"
    p.write_text(json.dumps(_result()))
    _sweep().main(["--plot", str(p)])
    assert "**4.00x**" in capsys.readouterr().out
    assert not (tmp_path / "topk_sweep.md").exists()  # --plot appends nothing
    png = tmp_path / "topk_sweep.latest.png"
    if png.exists():  # with matplotlib
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
