"""Context parallelism (flashmsa.distributed.msa_attention_cp) on the CPU with gloo: worlds of
P = 2 and P = 4 processes (cp_worker.py, one process per rank, 127.0.0.1) compare every rank's
output and gradient shards with flashmsa.msa_attention on the full tensors; plus the head split
rules, the single-rank path, and a 2-GPU NCCL run (skipped without two GPUs) that also prints
the step time and the all-to-all share.

Both worlds and the dry run of the GPU harness start once per module, side by side.
"""
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
HERE = pathlib.Path(__file__).resolve().parent

import flashmsa  # noqa: E402
import flashmsa.distributed as fcp  # noqa: E402
from cp_worker import CASES  # noqa: E402
from flashmsa.testing import make_inputs, rel_l2  # noqa: E402

WORKER = HERE / "cp_worker.py"
WORLDS = (2, 3, 4, 8)
# P = 3 divides no head count of the cases: the tokens scheme's cases (and its errors) only
WORLD_CASES = {P: [c for c, spec in CASES.items() if P in spec.get("worlds", (2, 4) + ((3,) if c.startswith(
    ("tok_", "err_zigzag", "err_tok")) else ()))] for P in WORLDS}
TOL = {"float64": 1e-12, "float32": 1e-6}
# the GPU harness's dry run on the CPU: bf16, fmsa's ratios (each kv head on two ranks at P = 2
# would need Hkv = 1; here kv is split and the proxy key head gathered)
DRY = ["--dry-run", "--heads", "16,4,4,1", "--dim", "16", "--lengths", "300,129,127", "--topk", "2",
       "--iters", "2"]
# bf16: replicated heads (dkp here) sum P bf16-rounded partials; out, lse, dq are exact
BF16_TOL = {"out": 1e-6, "lse": 1e-6, "kl": 1e-5, "dq": 1e-6, "dk": 1e-2, "dv": 1e-2, "dqp": 1e-6,
            "dkp": 1e-2}
GPU_TOL = {"out": 1e-3, "lse": 1e-3, "kl": 1e-3, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2, "dqp": 2e-2,
           "dkp": 2e-2}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(P, args, out):
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = dict(os.environ, FLASHMSA_NUM_THREADS="1", OMP_NUM_THREADS="1")
    if "GLOO_SOCKET_IFNAME" not in env and pathlib.Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's pairs on the loopback, whatever the hostname says
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (SHARP) buffers: all-to-all needs none
    return [subprocess.Popen([sys.executable, str(WORKER), "--rank", str(r), "--world", str(P),
                              "--port", str(port), "--out", str(out), *args],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            for r in range(P)]


def _collect(procs, out, deadline):
    """(per-rank results or None, the workers' output)."""
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    q.kill()
            logs.append(p.communicate()[0] + "\n[timed out]")
    if any(p.returncode for p in procs):
        return None, "\n".join(logs)[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(procs))], "\n".join(logs)


def _run_worlds(jobs, tmp, timeout):
    """jobs: {key: (P, args)}, all started at once; one retry for a world that failed (a port
    taken between _free_port and the bind)."""
    res = {}
    for attempt in range(2):
        started = {key: (_launch(P, args, tmp / f"{key}-{attempt}"), tmp / f"{key}-{attempt}")
                   for key, (P, args) in jobs.items() if res.get(key, (None,))[0] is None}
        deadline = time.monotonic() + timeout
        for key, (procs, out) in started.items():
            res[key] = _collect(procs, out, deadline)
    return res


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    jobs = {P: (P, WORLD_CASES[P]) for P in WORLDS}
    jobs["dry"] = (2, DRY)
    t0 = time.perf_counter()
    res = _run_worlds(jobs, tmp, timeout=240)
    print(f"\ncontext-parallel worlds (P = {WORLDS} and the GPU harness dry run): "
          f"{time.perf_counter() - t0:.1f} s")
    return res


# ---- the head split ------------------------------------------------------------------------------
def test_head_ranges_m3_fmsa():
    r = fcp.head_ranges(64, 4, 4, 1, 4)  # m3, P = 4: one MSA group, one kv head per rank
    assert r["q"] == [(0, 16), (16, 16), (32, 16), (48, 16)]
    assert r["kv"] == r["qp"] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert r["kp"] == [(0, 1)] * 4  # the shared proxy key head, gathered
    r = fcp.head_ranges(16, 2, 4, 1, 4)  # fmsa, P = 4: each kv head on two ranks
    assert r["kv"] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    r = fcp.head_ranges(16, 2, 4, 1, 2)
    assert r["kv"] == [(0, 1), (1, 1)] and r["qp"] == [(0, 2), (2, 2)]
    r = fcp.head_ranges(8, 4, 4, 2, 2)
    assert r["kp"] == [(0, 1), (1, 1)]
    assert fcp.head_ranges(8, 4, 4, 2, 4)["kp"] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert "qp" not in fcp.head_ranges(8, 2, None, None, 4)  # dense, no proxy: query heads split


@pytest.mark.parametrize("P", [1, 2, 4, 8])
def test_head_ranges_hold_every_head_a_group_needs(P):
    """For every valid configuration: each rank's query heads are whole MSA groups whose kv and
    proxy key heads the rank holds, and the local GQA mapping matches the global one."""
    checked = 0
    for Hq in (8, 16, 64):
        for Hkv in (1, 2, 4, 8):
            for Hp in (1, 2, 4, 8, 16):
                for Hpk in (1, 2, 4):
                    if Hq % Hkv or Hq % Hp or Hp % Hpk:
                        continue
                    try:
                        r = fcp.head_ranges(Hq, Hkv, Hp, Hpk, P)
                    except ValueError:
                        assert Hp % P or (Hkv % P and P % Hkv) or (Hpk % P and P % Hpk)
                        continue
                    checked += 1
                    for rank in range(P):
                        (q0, nq), (k0, nk), (p0, np_), (c0, nc) = (r[f][rank] for f in ("q", "kv", "qp", "kp"))
                        for h in range(q0, q0 + nq):
                            hl = h - q0
                            assert h // (Hq // Hkv) - k0 == hl // (nq // nk)  # kv(h), local
                            assert h // (Hq // Hp) - p0 == hl // (nq // np_)  # grp(h), local
                        for p in range(p0, p0 + np_):
                            assert p // (Hp // Hpk) - c0 == (p - p0) // (np_ // nc)  # pk(p), local
    assert checked > 10


def test_head_ranges_errors():
    with pytest.raises(ValueError, match=r"Hp \(proxy heads, one per MSA group\) = 2 is not divisible .* P = 4"):
        fcp.head_ranges(64, 4, 2, 1, 4)
    with pytest.raises(ValueError, match=r"Hkv \(kv heads\) = 3 .* P = 2"):
        fcp.head_ranges(12, 3, 4, 1, 2)
    with pytest.raises(ValueError, match=r"Hpk \(proxy key heads\) = 3 .* P = 2"):
        fcp.head_ranges(12, 2, 6, 3, 2)
    with pytest.raises(ValueError, match=r"Hq \(query heads\) = 6 is not divisible .* P = 4"):
        fcp.head_ranges(6, 2, None, None, 4)
    with pytest.raises(ValueError, match="Hq = 16 is not a multiple of Hkv = 3"):
        fcp.head_ranges(16, 3, 4, 1, 2)


def test_cuda_warmup_runs_the_heads_scheme():
    """Warmup (dense) calls on CUDA run the heads scheme where P lines up with the heads (the CUDA backend takes
    the tokens scheme's query segments in the sparse modes only), and are refused with the reason where not; every
    other call runs the scheme asked for."""
    m3 = (64, 4, 4, 1)
    for scheme in ("tokens", "hybrid"):
        assert fcp._run_scheme(scheme, True, "cuda", *m3, 2) == "heads"
        assert fcp._run_scheme(scheme, True, "cuda", *m3, 4) == "heads"
        assert fcp._run_scheme(scheme, False, "cuda", *m3, 8) == scheme
        assert fcp._run_scheme(scheme, True, "cpu", *m3, 8) == scheme
        with pytest.raises(ValueError, match="warmup=True on CUDA runs the heads scheme .* over P = 8"):
            fcp._run_scheme(scheme, True, "cuda", *m3, 8)
    assert fcp._run_scheme("heads", True, "cuda", *m3, 4) == "heads"


def test_shard_sizes():
    assert fcp.shard_sizes(10, 4) == [3, 3, 2, 2]
    assert fcp.shard_sizes(3, 4) == [1, 1, 1, 0]
    assert fcp.shard_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    x = torch.arange(10)
    assert torch.cat([fcp.shard_tokens(x, 4, r) for r in range(4)]).equal(x)
    assert [len(t) for t in torch.tensor_split(x, 4)] == fcp.shard_sizes(10, 4)


def test_not_initialised_and_single_rank(tmp_path):
    x = make_inputs(lengths=[300, 1, 129], D=8, Dp=8, requires_grad=True, seed=2)
    args = [x[n] for n in ("q", "k", "v", "qp", "kp")]
    kw = dict(cu_seqlens=x["cu_seqlens"], max_seqlen=x["max_seqlen"], return_lse=True)
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="not initialised"):
        fcp.msa_attention_cp(*args, 2, **kw)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        got = fcp.msa_attention_cp(*args, 2, **kw)  # P = 1: msa_attention itself
        want = flashmsa.msa_attention(*args, 2, **kw)
        for a, b in zip(got, want):
            assert rel_l2(a, b) == 0
    finally:
        torch.distributed.destroy_process_group()


# ---- the worlds --------------------------------------------------------------------------------
@pytest.mark.parametrize("P,case", [(P, c) for P in WORLDS for c in WORLD_CASES[P]])
def test_cp_matches_single_process(worlds, P, case):
    ranks, log = worlds[P]
    assert ranks is not None, f"the P = {P} world failed:\n{log}"
    spec = CASES[case]
    for rank, res in enumerate(r[case] for r in ranks):
        if "error" in spec:
            kind, text = spec["error_rank1"] if rank == 1 and "error_rank1" in spec else spec["error"]
            text = text.format(hp=P // 2)
            assert "exc" in res, f"rank {rank}: expected {kind}, got a result"
            assert res["exc"][0] == kind and text in res["exc"][1], f"rank {rank}: {res['exc']}"
            continue
        assert "exc" not in res, f"rank {rank}: {res.get('exc')}"
        assert res["shapes_ok"], f"rank {rank}: shapes/dtypes differ"
        tol = TOL[spec.get("dtype", "float64")]
        bad = {k: v for k, v in res["err"].items() if not v <= tol}
        assert not bad, f"rank {rank}: rel-L2 vs the single-process result above {tol}: {bad}"
        if spec.get("impl") == "all_gather":
            assert res["impl"] == "all_gather"
    if "error" not in spec:
        assert len({r[case]["kl"] for r in ranks}) == 1  # same reference everywhere


def test_gpu_harness_dry_run(worlds):
    """cp_worker.py --gpu's code, on the CPU with gloo in bf16: the comparison and the timing
    instrumentation run and report sound numbers."""
    ranks, log = worlds["dry"]
    assert ranks is not None, f"the dry run failed:\n{log}"
    for res in ranks:
        bad = {k: v for k, v in res["err"].items() if not v <= BF16_TOL[k]}
        assert not bad, bad
        assert res["a2a_calls_per_step"] == 4 and res["bytes_sent_per_step"] > 0
        assert 0 < res["a2a_share"] < 1 and res["impl"] == "all_to_all_single"


# ---- 2 GPUs, NCCL --------------------------------------------------------------------------------
def _gpus() -> int:
    if not torch.cuda.is_available():
        return 0
    try:
        return torch.cuda.device_count() if flashmsa.cuda_available() else 0
    except OSError:
        return 0


@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA device and libflashmsa built with CUDA")
def test_nccl_one_gpu_path(tmp_path):
    """The NCCL harness with a world of one GPU (m3 heads, 7096 tokens): the process group, the
    harness and its timed NCCL all-to-all on one rank, against msa_attention on the same GPU.
    msa_attention_cp with P = 1 is msa_attention itself, so the sharded path still needs 2 GPUs:
    this is what a single-GPU machine can check of the multi-GPU run."""
    procs = _launch(1, ["--gpu", "--lengths", "4096,3000"], tmp_path)
    ranks, log = _collect(procs, tmp_path, time.monotonic() + 300)
    assert ranks is not None, log
    for res in ranks:
        print(f"P = 1 over NCCL, {res['total']} tokens: single {res['t_single_ms']:.1f} ms, "
              f"CP {res['t_cp_ms']:.1f} ms; rel-L2 vs single GPU {res['err']}")
        bad = {k: v for k, v in res["err"].items() if not v <= GPU_TOL[k]}
        assert not bad, bad


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA devices and libflashmsa built with CUDA")
def test_nccl_two_gpus_m3(tmp_path):
    """m3 heads (64/4/4/1), D = 128, bf16, topk 16, P = 2 over NCCL against the single-GPU result
    on the same GPU; prints the step times and the all-to-all share. Sizes:
    FLASHMSA_CP_LENGTHS (default 16384,9000,7384: 32k tokens), FLASHMSA_CP_GPUS (default 2),
    FLASHMSA_CP_SCHEME (heads or tokens; default msa_attention_cp's choice), FLASHMSA_CP_LAYOUT (the tokens scheme's:
    contiguous or zigzag)."""
    P = int(os.environ.get("FLASHMSA_CP_GPUS", "2"))
    lengths = os.environ.get("FLASHMSA_CP_LENGTHS", "16384,9000,7384")
    extra = []
    for env, flag in (("FLASHMSA_CP_SCHEME", "--scheme"), ("FLASHMSA_CP_LAYOUT", "--layout")):
        if os.environ.get(env):
            extra += [flag, os.environ[env]]
    procs = _launch(P, ["--gpu", "--lengths", lengths] + extra, tmp_path)
    ranks, log = _collect(procs, tmp_path, time.monotonic() + 540)
    print(log)
    assert ranks is not None, log
    for res in ranks:
        print(f"rank {res['rank']}: {res['device']}, P = {P}, {res['total']} tokens: single-GPU step "
              f"{res['t_single_ms']:.1f} ms, CP step {res['t_cp_ms']:.1f} ms "
              f"(speed-up {res['t_single_ms'] / res['t_cp_ms']:.2f}x), all-to-all {res['a2a_ms']:.1f} ms "
              f"= {100 * res['a2a_share']:.1f}% of the instrumented step "
              f"({res['bytes_sent_per_step'] / 2**20:.0f} MiB sent per step in "
              f"{res['a2a_calls_per_step']} all-to-alls); rel-L2 vs single GPU {res['err']}")
        bad = {k: v for k, v in res["err"].items() if not v <= GPU_TOL[k]}
        assert not bad, bad
