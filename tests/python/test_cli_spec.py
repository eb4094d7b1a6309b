"""`flashmsa run --dtype fp64 --save DIR` checked from outside against spec_numpy.py."""
import json
import subprocess

import numpy as np
import pytest

import spec_numpy

CASES = [
    # m3-like heads at a small size, one sequence
    ["--config", "m3", "--seqlen", "300", "--topk", "2"],
    # varlen with empty and tiny sequences, dlse, odd head ratios (Hp < Hkv)
    ["--hq", "8", "--hkv", "4", "--hp", "2", "--hpk", "1", "--d", "16", "--dp", "16",
     "--lengths", "0,300,1,129", "--topk", "2", "--dlse"],
    # Hpk > 1, G = 1, clustered pattern
    ["--hq", "4", "--hkv", "2", "--hp", "4", "--hpk", "2", "--d", "32", "--dp", "32",
     "--seqlen", "385", "--topk", "3", "--pattern", "clustered"],
    # warmup (dense) mode, varlen
    ["--hq", "8", "--hkv", "2", "--hp", "2", "--hpk", "1", "--d", "16", "--dp", "16",
     "--lengths", "200,57", "--mode", "warmup"],
]


def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    fin = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), fin)
    den = np.linalg.norm(b[fin])
    return np.linalg.norm(a[fin] - b[fin]) / max(den, 1e-300)


@pytest.mark.parametrize("args", CASES, ids=["m3_small", "varlen_dlse", "hpk2_clustered", "warmup_varlen"])
def test_saved_fp64_run_matches_numpy_spec(build_dir, tmp_path, args):
    out = tmp_path / "run"
    cmd = [str(build_dir / "flashmsa"), "run", "--backend", "cpu", "--dtype", "fp64", "--seed", "7",
           "--save", str(out), "--quiet"] + args
    subprocess.run(cmd, check=True, timeout=600)
    t = {p.stem: np.load(p) for p in out.glob("*.npy")}
    cfg = json.loads((out / "config.json").read_text())
    mode = "warmup" if "warmup" in args else "train"
    topk = int(cfg.get("topk") or 1)  # null in warmup mode
    want = spec_numpy.msa(t["q"], t["k"], t["v"], t["qp"], t["kp"], t["cu_seqlens"], topk, mode,
                          t["dout"], dlse=t.get("dlse"), kl_grad=float(cfg.get("kl_grad", 1.0)))
    for name in ["out", "lse", "proxy_lse", "dq", "dk", "dv", "dqp", "dkp"]:
        assert t[name].dtype == np.float64, name
        assert t[name].shape == want[name].shape, name
        assert rel(t[name], want[name]) < 1e-9, name
    assert abs(float(t["kl"]) - want["kl"]) <= 1e-9 * abs(want["kl"]), "kl"
    if mode != "warmup":
        assert np.array_equal(t["indices"], want["indices"]), "indices"


def test_precise_dpsum_and_deterministic_flags(build_dir, tmp_path):
    """--precise-dpsum saves out_lo, the low part of the output: against the spec's fp64 output of
    the run's own (bf16-rounded) inputs, out + out_lo is ~2^-8 closer than out alone;
    --deterministic reaches the backward; --check passes."""
    out = tmp_path / "run"
    cmd = [str(build_dir / "flashmsa"), "run", "--backend", "cpu", "--dtype", "bf16", "--seed", "3",
           "--seqlen", "400", "--topk", "2", "--config", "fmsa", "--save", str(out), "--quiet",
           "--precise-dpsum", "--deterministic", "--check"]
    subprocess.run(cmd, check=True, timeout=600)
    t = {p.stem: np.load(p).astype(np.float64) for p in out.glob("*.npy")}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["precise_dpsum"] and cfg["deterministic"]
    want = spec_numpy.msa(t["q"], t["k"], t["v"], t["qp"], t["kp"], t["cu_seqlens"].astype(np.int64),
                          int(cfg["topk"]), "train", t["dout"], kl_grad=float(cfg["kl_grad"]))
    hi, lo = t["out"], t["out_lo"]
    assert rel(hi + lo, want["out"]) < rel(hi, want["out"]) / 64
