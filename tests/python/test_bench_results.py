"""bench/run_bench.py's CPU parts: the dated tables (appended, header once, seeded from bench/results),
the latest JSON, the run stamps (commit, GPU clocks, command), the arguments, and the union of the
selections per 128-query tile that cuDNN's block-sparse peer is fed (the peers themselves need CUDA)."""
import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

from file_module import load

rb = load("bench/run_bench.py", "run_bench")

INFO = dict(name="NVIDIA H200", torch="2.11.0+cu130", max_sm_mhz=1980.0, max_mem_mhz=3201.0, power_limit_w=700.0)
META = dict(date="2026-12-07 03:20Z", commit="abc1234+dirty", gpu=INFO,
            command="python3 bench/run_bench.py --user-only")


def kernel_row(**kw):
    """A flashmsa_bench row (its JSON keys) with every peer."""
    r = dict(gpu="NVIDIA H200", config="m3", seqlen=32768, pattern="clustered", topk=16, union_factor_128=1.94,
             select_ms=1.23, select_tflops=180.0, fwd_train_ms=7.05, fwd_train_tflops=301.0, fwd_infer_ms=6.9,
             fwd_infer_tflops=307.0, dense_fwd_ms=29.0, dense_fwd_tflops=600.0, bwd_ms=17.3, bwd_tflops=299.0,
             bwd_main_ms=16.0, bwd_main_tflops=323.0, dense_bwd_ms=90.0, dense_bwd_tflops=480.0, step_ms=25.6,
             step_tflops=290.0, step_gb=3.8, bwd_deterministic_ms=20.76, dense_bwd_deterministic_ms=None,
             fwd_train_out_lo_ms=7.4, bwd_out_lo_ms=17.9, clocks=dict(sm_mhz=1980.0, mem_mhz=3201.0))
    r["peers"] = dict(cudnn=dict(fwd_ms=29.2, fwd_tflops=602.7, step_ms=112.5, step_tflops=547.5, peak_gb=5.05),
                      fa2=dict(error="No available kernel"), torch_topk_indexer_ms=66.0,
                      flex=dict(fwd_ms=15.8, fwd_tflops=140.0, step_ms=31.5, step_tflops=230.0, peak_gb=6.0),
                      cudnn_bsa=dict(fwd_ms=9.0, fwd_tflops=236.0, bwd_ms=30.0, step_ms=45.0, step_tflops=165.0))
    r.update(kw)
    return r


def user_row(**kw):
    r = dict(config="m3", seqlen=32768, pattern="random", union_factor_128=4.03,
             clocks=dict(sm_mhz=1965.0, mem_mhz=3201.0))
    r["peers"] = dict(cudnn=dict(fwd_ms=29.2, step_ms=112.5, peak_gb=5.05), fa2=dict(step_ms=330.0))
    r["user"] = dict(user_fwd_ms=13.44, user_step_ms=32.21, user_step_nokl_ms=32.18, user_step_klfwd_ms=40.13,
                     user_step_frozen_ms=31.0, user_step_frozen_nokl_ms=30.1, user_step_warmup_ms=171.2,
                     kern_sum_ms=32.41, overhead_pct=-0.6, user_peak_gb=3.81)
    r.update(kw)
    return r


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


def test_kernel_row_has_every_column():
    cols = rb.kernel_columns()
    line = rb.row_line(cols, META, kernel_row())
    c = dict(zip([h for h, _ in cols], cells(line)))
    assert len(cells(line)) == len(cols)
    assert c["date (UTC)"] == "2026-12-07 03:20Z" and c["commit"] == "abc1234+dirty"
    assert c["GPU"] == "NVIDIA H200 (700 W)" and c["clocks MHz SM/mem"] == "1980/3201 (max 1980/3201)"
    assert c["command"] == "`python3 bench/run_bench.py --user-only`"
    assert c["**step** ms (TF/s)"] == "25.60 (290)"
    assert c["deterministic bwd ms (x)"] == "20.76 (1.20x)"
    assert c["deterministic dense bwd ms (x)"] == "-"
    assert c["torch top-k ms"] == "66.0"
    assert c["FA2 fwd ms (TF/s)"] == "err" and c["FA2 fwd+bwd ms"] == "err"
    assert c["cuDNN BSA fwd+bwd ms"] == "45.0" and c["cuDNN BSA fwd ms (TF/s)"] == "9.00 (236)"
    assert c["step vs cuDNN"] == "4.39x"


def test_kernel_row_without_optional_peers():
    r = kernel_row()
    r["peers"] = dict(cudnn=r["peers"]["cudnn"])
    c = dict(zip([h for h, _ in rb.kernel_columns()], cells(rb.row_line(rb.kernel_columns(), META, r))))
    assert c["Flex fwd+bwd ms"] == "-" and c["cuDNN BSA fwd ms (TF/s)"] == "-" and c["torch top-k ms"] == "-"


def test_user_row_speedups_and_error():
    cols = rb.user_columns()
    c = dict(zip([h for h, _ in cols], cells(rb.row_line(cols, META, user_row()))))
    assert c["**step** ms"] == "32.21" and c["union/128"] == "4.03"
    assert c["cuDNN fwd+bwd ms (x)"] == "112.5 (3.49x)" and c["FA2 fwd+bwd ms (x)"] == "330.0 (10.25x)"
    assert c["Flex fwd+bwd ms (x)"] == "-" and c["cuDNN BSA fwd+bwd ms (x)"] == "-"
    assert c["step ms, frozen proxy (default / kl off)"] == "31.00 / 30.10"
    bad = rb.row_line(cols, META, user_row(user=dict(error="CUDA out of | memory")))
    assert len(cells(bad)) >= len(cols)  # the escaped '|' keeps the cell count
    assert "error: CUDA out of \\| memory" in bad


def test_append_writes_header_once_and_rows_in_order(tmp_path):
    path = str(tmp_path / "user_path.md")
    cols = rb.user_columns()
    rb.append_rows(path, rb.USER_TITLE, rb.USER_INTRO, cols, META, [user_row()])
    rb.append_rows(path, rb.USER_TITLE, rb.USER_INTRO, cols, dict(META, date="2026-12-08 01:00Z"),
                   [user_row(seqlen=65536), user_row(seqlen=131072)])
    lines = pathlib.Path(path).read_text().splitlines()
    assert lines[0] == "# " + rb.USER_TITLE
    assert sum(l.startswith("| date (UTC) |") for l in lines) == 1
    rows = [l for l in lines if l.startswith("| 2026-")]
    assert [cells(r)[7] for r in rows] == ["32768", "65536", "131072"]
    assert cells(rows[0])[0] == "2026-12-07 03:20Z" and cells(rows[2])[0] == "2026-12-08 01:00Z"
    header = lines.index(rb.header_lines(cols)[0])
    assert lines[header + 1] == rb.header_lines(cols)[1] and lines[header + 2] == rows[0]


def test_append_starts_a_new_header_when_the_columns_change(tmp_path):
    path = tmp_path / "kernels.md"
    # an older table with other columns, and no final newline
    path.write_text("# Kernels\n\n| date (UTC) | commit | old |\n|---|---|---|\n| 2026-01-01 00:00Z | x | 1 |")
    rb.append_rows(str(path), rb.KERNEL_TITLE, rb.KERNEL_INTRO, rb.kernel_columns(), META, [kernel_row()])
    lines = path.read_text().splitlines()
    assert lines[4] == "| 2026-01-01 00:00Z | x | 1 |" and lines[5] == ""
    assert lines[6] == rb.header_lines(rb.kernel_columns())[0]
    assert lines[-1].startswith("| 2026-12-07 03:20Z |")
    rb.append_rows(str(path), rb.KERNEL_TITLE, rb.KERNEL_INTRO, rb.kernel_columns(), META, [kernel_row()])
    assert path.read_text().count("| date (UTC) |") == 2  # same columns: no third header


def test_seed_table_copies_the_existing_table_once(tmp_path):
    results, out = tmp_path / "results", tmp_path / "out"
    results.mkdir()
    (results / "kernels.md").write_text("# old table\n")
    dst = rb.seed_table(str(out), str(results), "kernels.md")
    assert pathlib.Path(dst).read_text() == "# old table\n"
    pathlib.Path(dst).write_text("# old table\n| row |\n")
    rb.seed_table(str(out), str(results), "kernels.md")  # out has one now: kept
    assert pathlib.Path(dst).read_text() == "# old table\n| row |\n"
    assert not os.path.exists(rb.seed_table(str(out), str(results), "user_path.md"))  # nothing to continue
    assert rb.seed_table(str(results), str(results), "kernels.md") == str(results / "kernels.md")


def test_tables_route_rows_and_overwrite_latest_json(tmp_path):
    results, out = tmp_path / "results", tmp_path / "out"
    results.mkdir()
    cols = rb.user_columns()
    rb.append_rows(str(results / "user_path.md"), rb.USER_TITLE, rb.USER_INTRO, cols, META, [user_row()])
    args = rb.parse_args(["--out", str(out), "--results-dir", str(results)])
    t = rb.Tables(args, META)
    t.add(kernel_row())  # no "user": the kernel table only
    t.add(dict(kernel_row(), user=user_row()["user"]))
    kern = (out / "kernels.md").read_text()
    user = (out / "user_path.md").read_text()
    assert kern.count("| 2026-12-07") == 2 and user.count("| 2026-12-07") == 2  # the seeded row + this run's
    assert user.count("| date (UTC) |") == 1
    latest = json.loads((out / "user_path.latest.json").read_text())
    assert latest["commit"] == "abc1234+dirty" and len(latest["rows"]) == 1
    assert len(json.loads((out / "kernels.latest.json").read_text())["rows"]) == 2
    t2 = rb.Tables(rb.parse_args(["--out", str(out), "--results-dir", str(results), "--user-only"]), META)
    assert set(t2.paths) == {"user_path"}
    t2.add(user_row())
    assert len(json.loads((out / "user_path.latest.json").read_text())["rows"]) == 1  # the latest run only
    assert (out / "user_path.md").read_text().count("| 2026-12-07") == 3


def test_parse_smi():
    s = rb.parse_smi("NVIDIA H200, 1980, 3201, 1980, 3201, 700.00, 580.95.05")
    assert s == dict(name="NVIDIA H200", sm_mhz=1980.0, mem_mhz=3201.0, max_sm_mhz=1980.0, max_mem_mhz=3201.0,
                     power_limit_w=700.0, driver="580.95.05")
    s = rb.parse_smi("NVIDIA H100 80GB HBM3, 345, 2619, 1980, 2619, [N/A], 570.1")
    assert s["sm_mhz"] == 345.0 and s["power_limit_w"] is None
    assert rb.clocks_cell({}, dict(max_sm_mhz=1980.0)) == "-/- (max 1980/-)"
    assert rb.gpu_cell(dict(name="NVIDIA H100 80GB HBM3", power_limit_w=None)) == "NVIDIA H100 80GB HBM3"
    with pytest.raises(ValueError):
        rb.parse_smi("NVIDIA H200, 1980")


def test_utc_stamp_and_command_line():
    import datetime
    t = datetime.datetime(2026, 12, 7, 4, 20, tzinfo=datetime.timezone(datetime.timedelta(hours=1)))
    assert rb.utc_stamp(t) == "2026-12-07 03:20Z"
    cmd = rb.command_line([os.path.join(rb.REPO, "bench", "run_bench.py"), "--seqlens", "32768", "--out", "a b"])
    assert cmd == "python3 bench/run_bench.py --seqlens 32768 --out 'a b'"


def _git(repo, *a):
    subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)


def test_git_commit_marks_dirty_trees_except_results(tmp_path):
    repo = tmp_path / "r"
    (repo / "bench" / "results").mkdir(parents=True)
    (repo / "src.txt").write_text("a\n")
    (repo / "bench" / "results" / "kernels.md").write_text("# t\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert rb.git_commit(str(repo)) == head
    (repo / "bench" / "results" / "kernels.md").write_text("# t\n| row |\n")  # the harness's own appends
    (repo / "untracked.txt").write_text("x")
    assert rb.git_commit(str(repo)) == head
    (repo / "src.txt").write_text("b\n")
    assert rb.git_commit(str(repo)) == head + "+dirty"
    assert rb.git_commit(str(tmp_path / "nowhere")) is None


def test_arguments():
    a = rb.parse_args([])
    assert a.peers == list(rb.PEERS) and a.user_path and not a.user_only
    assert a.out == (os.environ.get("OUT") or os.path.join(rb.REPO, "bench", "results"))
    assert a.results_dir == os.path.join(rb.REPO, "bench", "results")
    a = rb.parse_args(["--user-only", "--seqlens", "32768,131072", "--out", "/tmp/o"])
    assert a.peers == ["cudnn"] and a.seqlen_list == [32768, 131072] and a.out == "/tmp/o"
    a = rb.parse_args(["--user-only", "--peers", "cudnn,fa2,flex,cudnn_bsa", "--flex", "32768"])
    assert a.peers == ["cudnn", "fa2", "flex", "cudnn_bsa"] and a.flex_list == [32768]
    assert rb.parse_args(["--peers", ""]).peers == []
    a = rb.parse_args(["--user-only"], command=["bench/user_path.py", "--configs", "m3"])
    assert a.argv == ["bench/user_path.py", "--configs", "m3"]
    for bad in (["--user-only", "--no-user-path"], ["--peers", "cudnn,fa3"], ["--user-only", "--peers", "torch_topk"],
                ["--configs", "m4"], ["--seqlens", "32k"]):
        with pytest.raises(SystemExit):
            rb.parse_args(bad)


def _brute_union(indices, block=128):
    Hp, T, _ = indices.shape
    nt = -(-T // block)
    return [[sorted({int(j) for t in range(i * block, min(T, (i + 1) * block)) for j in indices[p, t] if 0 <= j < nt})
             for i in range(nt)] for p in range(Hp)]


def _random_selection(rng, Hp, T, topk, block=128):
    """Causal selections like the library's: the own block, then distinct earlier blocks, -1 padding."""
    idx = np.full((Hp, T, topk), -1, dtype=np.int32)
    for p in range(Hp):
        for t in range(T):
            own = t // block
            earlier = rng.permutation(own)[:topk - 1]
            row = list(earlier) + [own]
            idx[p, t, :len(row)] = row
    return idx


@pytest.mark.parametrize("T", [128, 1000, 1536])
def test_tile_union_matches_brute_force(T):
    rng = np.random.default_rng(T)
    idx = _random_selection(rng, 3, T, 4)
    blocks, counts = rb.tile_union(idx)
    want = _brute_union(idx)
    U = max(1, max(len(u) for h in want for u in h))
    assert blocks.shape == (3, -(-T // 128), U) and blocks.dtype == np.int32 and counts.dtype == np.int32
    for p in range(3):
        for i, u in enumerate(want[p]):
            n = counts[p, i]
            assert n == len(u) and list(blocks[p, i, :n]) == u
            assert all(blocks[p, i, n:] == u[-1])  # padding repeats the last block: valid ids only
    assert rb.union_factor(counts, 4) == pytest.approx(np.mean([len(u) for h in want for u in h]) / 4)


def test_bsa_metadata_maps_query_heads_to_their_proxy_head():
    rng = np.random.default_rng(1)
    idx = _random_selection(rng, 2, 640, 3)
    blocks, counts = rb.tile_union(idx)
    q2k, nums = rb.bsa_metadata(blocks, counts, group=4)
    assert q2k.shape == (1, 8) + blocks.shape[1:] and nums.shape == (1, 8, blocks.shape[1])
    assert q2k.flags.c_contiguous and q2k.dtype == np.int32 and nums.dtype == np.int32
    for h in range(8):
        assert (q2k[0, h] == blocks[h // 4]).all() and (nums[0, h] == counts[h // 4]).all()


def test_selected_pairs_counts_causal_keys_once():
    idx = np.array([[[0, -1]] * 128 + [[1, 0], [1, 1]]], dtype=np.int32)  # 130 tokens, 1 head; a repeat counts once
    want = 0
    for t in range(130):
        keys = set()
        for j in idx[0, t]:
            if j >= 0:
                keys |= {u for u in range(j * 128, (j + 1) * 128) if u <= t}
        want += len(keys)
    assert rb.selected_pairs(idx, group=16) == want * 16


def test_union_of_the_library_selection(tmp_path):
    """user_path.selection (flashmsa.msa_select on the user's inputs) -> tile_union, on the CPU backend."""
    torch = pytest.importorskip("torch")
    up = load("bench/user_path.py", "user_path_for_test")
    try:
        up.import_flashmsa().library_path()
    except Exception as e:  # no built library
        pytest.skip(f"flashmsa library not loadable: {e}")
    cfg = dict(Hq=4, Hkv=1, Hp=2, Hpk=1, topk=3)
    T = 700
    idx = up.selection(cfg, T, "clustered", torch.device("cpu"))
    assert idx.shape == (2, T, 3) and idx.dtype == np.int32
    own = np.arange(T) // 128
    assert ((idx == own[None, :, None]).any(-1)).all()  # the own block is always selected
    assert ((idx < 0) | (idx <= own[None, :, None])).all()  # causal
    blocks, counts = rb.tile_union(idx)
    want = _brute_union(idx)
    for p in range(2):
        for i, u in enumerate(want[p]):
            assert list(blocks[p, i, :counts[p, i]]) == u
    assert 1.0 <= rb.union_factor(counts, 3) <= (T // 128 + 1) / 3 + 1e-9


# ----------------------------------------------------------------------------------------------
# The run's control flow with the CUDA parts replaced: a fake flashmsa_bench, peers and user's path.

FAKE_BENCH = r'''#!/usr/bin/env python3
import json, sys
a = dict(zip(sys.argv[1::2], sys.argv[2::2]))
Hp, topk = 4, 16
for T in map(int, a["--seqlens"].split(",")):
    for pat in a["--patterns"].split(","):
        idx = [[[min(t // 128, s) if s < 2 else -1 for s in range(topk)] for t in range(T)] for _ in range(Hp)]
        with open(f"{a['--save-indices']}/indices-{a['--config']}-{T}-{pat}.bin", "wb") as f:
            import array
            f.write(array.array("i", [x for h in idx for r in h for x in r]).tobytes())
        print(json.dumps(dict(gpu="Fake", config=a["--config"], seqlen=T, pattern=pat, topk=topk,
                              union_factor_128=0.125, select_ms=1.0, select_tflops=1.0, fwd_train_ms=2.0,
                              fwd_train_tflops=2.0, fwd_infer_ms=2.0,
                              fwd_infer_tflops=2.0, dense_fwd_ms=3.0, dense_fwd_tflops=3.0, bwd_ms=4.0, bwd_tflops=4.0,
                              bwd_main_ms=3.5, bwd_main_tflops=4.5, dense_bwd_ms=9.0, dense_bwd_tflops=9.0, step_ms=7.0,
                              step_tflops=7.0, step_gb=1.0, bwd_deterministic_ms=5.0, dense_bwd_deterministic_ms=None,
                              fwd_train_out_lo_ms=2.1, bwd_out_lo_ms=4.1)))
'''


@pytest.fixture
def fake_run(tmp_path, monkeypatch):
    """run_bench.main with flashmsa_bench, the peers and the user's path replaced by CPU fakes; returns
    (run(argv) -> None, calls: what the fakes were asked)."""
    import sys
    import types
    pytest.importorskip("torch")
    calls = dict(selection=[], bsa=[], flex=[], sdpa=[])
    fake_up = types.SimpleNamespace(
        selection=lambda cfg, T, pat, dev: (calls["selection"].append((T, pat)),
                                            np.tile((np.arange(T) // 128)[None, :, None], (cfg["Hp"], 1, cfg["topk"]))
                                            .astype(np.int32))[1],
        user_step_times=lambda cfg, T, pat, log=None: (dict(error="CUDA out of memory") if T == 256 else
                                                       dict(user_fwd_ms=1.0, user_step_ms=2.0, kern_sum_ms=2.1,
                                                            overhead_pct=-4.8, user_peak_gb=0.5)))
    monkeypatch.setitem(sys.modules, "user_path", fake_up)
    monkeypatch.setattr(rb, "gpu_info", lambda: dict(INFO))
    monkeypatch.setattr(rb, "sample_clocks", lambda info: dict(sm_mhz=1900.0, mem_mhz=3201.0))
    monkeypatch.setattr(rb, "git_commit", lambda repo=rb.REPO: "f00dfee")

    def sdpa(cfg, T, be):
        calls["sdpa"].append((be, T))
        if be == "fa2":
            raise RuntimeError("No available kernel")
        return dict(fwd_ms=10.0, fwd_tflops=1.0, step_ms=40.0, step_tflops=1.0, peak_gb=2.0)

    def bsa(api, cfg, T, idx, pairs):
        calls["bsa"].append((T, idx.shape, pairs))
        return dict(fwd_ms=3.0, fwd_tflops=1.0, bwd_ms=9.0, step_ms=13.0, step_tflops=1.0, peak_gb=3.0,
                    max_rel_err=0.5 if T == 256 else 0.004)  # at 256: an output that is not the attention asked

    monkeypatch.setattr(rb, "sdpa_times", sdpa)
    monkeypatch.setattr(rb, "flex_times",
                        lambda cfg, T, idx, pairs: (calls["flex"].append(T), dict(fwd_ms=5.0, step_ms=20.0))[1])
    monkeypatch.setattr(rb, "torch_topk_indexer_ms", lambda cfg, T: 66.0)
    monkeypatch.setattr(rb, "cudnn_bsa_api", lambda: (("fwd", "bwd"), "1.32.0"))
    monkeypatch.setattr(rb, "cudnn_bsa_times", bsa)
    binary = tmp_path / "flashmsa_bench"
    binary.write_text(FAKE_BENCH)
    binary.chmod(0o755)
    out = tmp_path / "out"

    def run(argv):
        rb.main(argv + ["--out", str(out), "--results-dir", str(tmp_path / "results"), "--bin", str(binary)])
        return out

    return run, calls


def test_user_only_run_appends_user_rows_with_peers(fake_run):
    run, calls = fake_run
    out = run(["--user-only", "--configs", "fmsa", "--seqlens", "256,384", "--patterns", "clustered",
               "--peers", "cudnn,fa2,flex,cudnn_bsa", "--flex", "384"])
    assert not (out / "kernels.md").exists()
    lines = [l for l in (out / "user_path.md").read_text().splitlines() if l.startswith("| 20")]
    assert len(lines) == 2 and all("| f00dfee |" in l and "1900/3201 (max 1980/3201)" in l for l in lines)
    assert "error: CUDA out of memory" in lines[0]  # T = 256: the user's path failed, the row is kept
    assert cells(lines[0])[-2] == "err"  # and cuDNN BSA's output failed the check
    c = dict(zip([h for h, _ in rb.user_columns()], cells(lines[1])))
    assert c["T"] == "384" and c["**step** ms"] == "2.00" and c["union/128"] == "0.06"  # one block of 16 per tile
    assert c["cuDNN fwd+bwd ms (x)"] == "40.0 (20.00x)" and c["FA2 fwd+bwd ms (x)"] == "err"
    assert c["Flex fwd+bwd ms (x)"] == "20.0 (10.00x)" and c["cuDNN BSA fwd+bwd ms (x)"] == "13.0 (6.50x)"
    assert calls["selection"] == [(256, "clustered"), (384, "clustered")] and calls["flex"] == [384]
    # the BSA peer gets the selection and the causal pairs of the own blocks: 16 heads x sum(t % 128 + 1)
    assert [b[:2] for b in calls["bsa"]] == [(256, (4, 256, 16)), (384, (4, 384, 16))]
    assert calls["bsa"][0][2] == 16 * 2 * sum(range(1, 129))
    latest = json.loads((out / "user_path.latest.json").read_text())
    assert latest["command"].startswith("python3 ") and "--user-only" in latest["command"]
    assert latest["cudnn_bsa"] == "1.32.0" and len(latest["rows"]) == 2
    assert latest["rows"][0]["peers"]["fa2"]["error"] == "No available kernel"
    assert latest["rows"][0]["peers"]["cudnn_bsa"]["error"].startswith("output differs from the reference by 0.5")
    assert "error" not in latest["rows"][1]["peers"]["cudnn_bsa"]


def test_kernel_run_appends_both_tables_and_continues_them(fake_run):
    run, calls = fake_run
    out = run(["--configs", "m3", "--seqlens", "256", "--patterns", "clustered,random", "--flex", "256"])
    kern = (out / "kernels.md").read_text()
    rows = [l for l in kern.splitlines() if l.startswith("| 20")]
    assert len(rows) == 2 and kern.count("| date (UTC) |") == 1
    c = dict(zip([h for h, _ in rb.kernel_columns()], cells(rows[0])))
    assert c["union/128"] == "0.12" and c["torch top-k ms"] == "66.0" and c["step vs cuDNN"] == "5.71x"
    assert c["cuDNN BSA fwd+bwd ms"] == "err" and c["Flex fwd+bwd ms"] == "20.0" and c["FA2 fwd+bwd ms"] == "err"
    assert calls["selection"] == []  # the kernels' own selections (the fake bench's files) feed the peers
    assert calls["bsa"][0][1] == (4, 256, 16)
    assert len([l for l in (out / "user_path.md").read_text().splitlines() if l.startswith("| 20")]) == 2
    run(["--configs", "m3", "--seqlens", "256", "--patterns", "random", "--peers", "cudnn"])
    kern = (out / "kernels.md").read_text()
    assert len([l for l in kern.splitlines() if l.startswith("| 20")]) == 3 and kern.count("| date (UTC) |") == 1
    assert len(json.loads((out / "kernels.latest.json").read_text())["rows"]) == 1
    assert calls["bsa"] and len(calls["bsa"]) == 2  # the last run asked for cudnn alone


def test_cudnn_bsa_skip_reasons(monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the skip reasons are for machines without one")
    api, why = rb.cudnn_bsa_api()
    assert api is None and why.startswith("no CUDA device")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert "SM80" in rb.cudnn_bsa_api()[1]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    import builtins
    real_import = builtins.__import__

    def no_cudnn(name, *a, **kw):
        if name == "cudnn":
            raise ImportError("No module named 'cudnn'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_cudnn)
    api, why = rb.cudnn_bsa_api()
    assert api is None and "not importable" in why and rb.CUDNN_FRONTEND_PIN in why


def _fake_bsa(torch, shift=0):
    """cuDNN's block-sparse API as its documentation defines it (bhsd, GQA forward, MHA backward),
    in fp32 torch on the CPU; shift > 0 misreads the block ids (to see the check catch it)."""
    calls = []

    def attention(q, k, v, idx, nums):
        B, Hq, T, d = q.shape
        g = Hq // k.shape[1]
        o = torch.zeros_like(q)
        lse = torch.zeros(B, Hq, T)
        for h in range(Hq):
            for i in range(idx.shape[2]):
                bl = (idx[0, h, i, :int(nums[0, h, i])].long() + shift) % idx.shape[2]
                keys = (bl[:, None] * 128 + torch.arange(128)[None, :]).flatten()
                keys = keys[keys < T]
                rows = slice(i * 128, min(T, (i + 1) * 128))
                s = q[0, h, rows].float() @ k[0, h // g, keys].float().t() * d ** -0.5
                o[0, h, rows] = (torch.softmax(s, -1) @ v[0, h // g, keys].float()).to(q.dtype)
                lse[0, h, rows] = torch.logsumexp(s, -1)
        return o, lse

    def fwd(q, k, v, idx, block_sparse_num=None, block_sizes=None, q2k_block_nums=None, *, sparse_block_size=None,
            layout="bhsd"):
        assert (sparse_block_size, layout) == (128, "bhsd") and idx.dtype == torch.int32
        assert idx.shape[:3] == (1, q.shape[1], -(-q.shape[2] // 128)) and q2k_block_nums.shape == idx.shape[:3]
        calls.append("fwd")
        o, lse = attention(q, k, v, idx, q2k_block_nums)
        return dict(o_tensor=o, lse_tensor=lse).values()

    def bwd(do, q, k, v, o, lse, idx, block_sparse_num=None, block_sizes=None, q2k_block_nums=None, *,
            sparse_block_size=None, layout="bhsd"):
        assert k.shape[1] == q.shape[1] == v.shape[1]  # MHA only: K/V expanded to the query heads
        assert do.shape == o.shape == q.shape and lse.shape == q.shape[:3]
        calls.append("bwd")
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    return (fwd, bwd), calls


@pytest.mark.parametrize("shift,ok", [(0, True), (1, False)])
def test_cudnn_bsa_peer_plumbing_on_the_cpu(shift, ok):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    cfg = dict(Hq=4, Hkv=2, Hp=2, Hpk=1, topk=2)
    T = 384
    idx = _random_selection(np.random.default_rng(3), 2, T, 2)
    api, calls = _fake_bsa(torch, shift)
    r = rb.cudnn_bsa_times(api, cfg, T, idx, rb.selected_pairs(idx, 2), device="cpu",
                           timer=lambda fn, n: (fn(), 2.0)[1])
    assert calls.count("bwd") == 2 and calls.count("fwd") == 3  # timed fwd, fwd for the check, step's fwd
    assert r["fwd_ms"] == 2.0 and r["step_ms"] == 2.0 and r["peak_gb"] is None
    assert r["union_factor_128"] == pytest.approx(rb.union_factor(rb.tile_union(idx)[1], 2))
    assert (r["max_rel_err"] < rb.BSA_TOLERANCE) == ok


def test_patterns_argument(capsys):
    """--patterns: the three patterns (user_path's names), unknown names refused."""
    pytest.importorskip("torch")
    import user_path
    assert rb.PATTERNS == user_path.PATTERNS
    assert rb.parse_args(["--patterns", "clustered,random,trained"]).pattern_list == ["clustered", "random", "trained"]
    with pytest.raises(SystemExit):
        rb.parse_args(["--user-only", "--patterns", "zipf"])
    assert "unknown pattern(s) zipf" in capsys.readouterr().err
