"""bench/tools/trained_pattern.py and the trained-like pattern (bench/user_path.trained_like_proxy): the tool's
selection equals flashmsa.msa_select's sets, its statistics are right on a constructed selection, and the pattern
meets the trained indexer's statistics at 16k while the random and clustered patterns do not."""
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "tools"))
sys.path.insert(0, str(REPO / "python"))
import trained_pattern as TP  # noqa: E402
import user_path  # noqa: E402  (trained_pattern put bench/ on the path)


def test_selection_equals_msa_select():
    import flashmsa
    T, tiles = 2048, [3, 9, 15]
    _, _, _, qp, kp, cu = user_path.make_inputs(TP.LM, T, "trained", torch.device("cpu"), dtype=torch.float32,
                                                 seed=3)
    qp, kp = qp.detach(), kp.detach()
    got = TP.select_tiles(qp, kp, tiles)
    ref = flashmsa.msa_select(qp, kp, TP.TOPK, cu_seqlens=cu, max_seqlen=T)  # [Hp, T, topk]
    rows = torch.cat([torch.arange(t * 128, (t + 1) * 128) for t in tiles])
    same = [set(a) - {-1} == set(b) - {-1} for a, b in zip(got.reshape(-1, TP.TOPK).tolist(),
                                                             ref[:, rows].reshape(-1, TP.TOPK).tolist())]
    assert sum(same) >= 0.99 * len(same), f"{len(same) - sum(same)} of {len(same)} sets differ"


def test_statistics_of_a_constructed_selection():
    # 4 tiles at blocks 40..43, every token of every head selects its own block and the 15 before it
    qb = torch.arange(40, 44).repeat_interleave(128)
    s = (qb[:, None] - torch.arange(16)[None, :]).expand(2, -1, -1).contiguous()
    st = TP.statistics(s, qb)
    assert st["union128"] == 1 and st["union4"] == 1 and st["union16"] == 1
    assert st["next"] == 1 and st["d16"] == 1 and st["heads"] == 1
    assert st["run"] == 16 and abs(st["d1"] - 1 / 15) < 1e-12
    assert st["rel"][2] == pytest.approx(8 / 41.5, abs=0.01)  # distances 1..15 over blocks 40..43
    # half the tokens shift their set one block back: the union of a tile grows by one block
    s2 = s.clone()
    s2[:, ::2] -= 1
    st2 = TP.statistics(s2, qb)
    assert st2["union128"] == pytest.approx(17 / 16) and st2["next"] == pytest.approx(15 / 16)


def test_trained_like_meets_the_trained_statistics_and_the_others_do_not(capsys):
    assert TP.main(["--patterns", "trained,random,clustered", "--check"]) == 0
    out = capsys.readouterr().out
    assert "check: within bounds" in out
    for pattern in ("random", "clustered"):
        line = next(l for l in out.splitlines() if l.split()[:1] == [pattern])
        vals = line.split()
        got = dict(union128=float(vals[vals.index("union128") + 1]), union4=float(vals[vals.index("union4") + 1]),
                   next=float(vals[vals.index("next") + 1]))
        assert any(abs(got[k] - TP.TARGET[k]) > TP.BOUNDS[k] for k in got), pattern


def test_cli_draw_matches_the_python_draw(build_dir, tmp_path):
    """tools/patterns.cpp's trained pattern (flashmsa run / flashmsa_bench --pattern trained) has the statistics of
    bench/user_path.py's at 8k tokens: the selection the CLI saved against the one of the Python draw."""
    import json
    import subprocess
    import numpy as np
    T = 8192
    out = tmp_path / "run"
    subprocess.run([str(build_dir / "flashmsa"), "run", "--backend", "cpu", "--dtype", "fp32", "--mode", "infer",
                    "--pattern", "trained", "--hq", "4", "--hkv", "1", "--hp", "4", "--hpk", "1", "--d", "128",
                    "--dp", "128", "--seqlen", str(T), "--topk", "16", "--seed", "5", "--save", str(out), "--quiet"],
                   check=True, timeout=900)
    assert json.loads((out / "config.json").read_text())["pattern"] == "trained"
    tiles = TP.sample_tiles(T, 0)
    rows = torch.cat([torch.arange(t * 128, (t + 1) * 128) for t in tiles])
    cli = TP.statistics(torch.from_numpy(np.load(out / "indices.npy")).long()[:, rows], rows // 128)
    _, _, _, qp, kp, _ = user_path.make_inputs(TP.LM, T, "trained", torch.device("cpu"), dtype=torch.float32, seed=5)
    py = TP.statistics(TP.select_tiles(qp.detach(), kp.detach(), tiles), rows // 128)
    bad = TP.misses(cli, py)
    assert not bad, f"the C++ draw's statistics differ from the Python draw's: {bad}"
