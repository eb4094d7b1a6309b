"""flashmsa.integrations.megatron: MSA as the self-attention of a Megatron-Core GPTModel, on the CPU (gloo, the
CPU backend, fp32). One training step of a 2-layer model (4 query heads, 2 kv heads, 2 proxy heads, 1 proxy key
head, 320 tokens, topk 2 of 3 blocks) gives the same loss, logged kl and gradients in every layout and mode:
batched (sbhd) and packed (THD), selective and full activation recompute, TP = 2 and CP = 2 (packed) against one
process; the warmup mode equals Megatron's own dense attention with the same weights; bad configurations fail at
construction. Skipped without megatron-core (pip install 'flashmsa[megatron]')."""
import os
import pathlib
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "megatron_worker.py"


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world(tmp, P, tp, cp, cases, device="cpu"):
    env = dict(os.environ, FLASHMSA_NUM_THREADS="1", OMP_NUM_THREADS="1")
    if device == "cpu":  # Megatron-Core's CPU path (cpu_support) where a GPU is present too
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:  # deterministic cuBLAS (the distributed-optimizer case runs deterministic algorithms)
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if "GLOO_SOCKET_IFNAME" not in env and pathlib.Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"
    port = _port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--rank", str(r), "--world", str(P), "--port", str(port),
                               "--out", str(tmp), "--tp", str(tp), "--cp", str(cp), "--device", device, *cases],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(P)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-6000:]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron")
    one = tmp / "one"
    one.mkdir()
    _world(one, 1, 1, 1, ["plain", "packed", "recompute_selective", "recompute_full", "curve", "share"])
    tp2 = tmp / "tp2"
    tp2.mkdir()
    _world(tp2, 2, 2, 1, ["plain", "curve"])
    cp2 = tmp / "cp2"
    cp2.mkdir()
    _world(cp2, 2, 1, 2, ["packed", "packed_heads", "curve", "share"])
    load = lambda d, case, r=0: torch.load(d / f"{case}-rank{r}.pt")  # noqa: E731
    return dict(plain=load(one, "plain"), packed=load(one, "packed"), sel=load(one, "recompute_selective"),
                full=load(one, "recompute_full"), tp2=[load(tp2, "plain", r) for r in range(2)],
                cp2=[load(cp2, "packed", r) for r in range(2)], cp2_heads=[load(cp2, "packed_heads", r) for r in range(2)],
                share=load(one, "share"), share_cp2=[load(cp2, "share", r) for r in range(2)],
                curves={k: [load(d, "curve", r)["losses"] for r in range(n)]
                        for k, d, n in (("one", one, 1), ("tp2", tp2, 2), ("cp2", cp2, 2))})


def _same(a, b, rtol, atol=1e-7, what=""):
    assert torch.isfinite(a["loss"]) and torch.allclose(a["loss"], b["loss"], rtol=rtol, atol=atol), \
        (what, a["loss"], b["loss"])
    assert a["kl"] is not None and b["kl"] is not None and bool((a["kl"] > 0).all()), (what, a["kl"])
    torch.testing.assert_close(a["kl"], b["kl"], rtol=rtol, atol=atol, msg=f"{what}: logged kl")
    assert a["grads"].keys() == b["grads"].keys()
    for n in a["grads"]:
        torch.testing.assert_close(a["grads"][n], b["grads"][n], rtol=rtol, atol=atol, msg=f"{what}: grad {n}")


def test_proxy_is_trained(results):
    g = results["plain"]["grads"]
    for name in ("linear_qp", "linear_kp"):
        gs = [v for n, v in g.items() if name in n]
        assert len(gs) == 2 and all(float(v.abs().max()) > 0 for v in gs), name  # one per layer, nonzero
    assert results["plain"]["kl"].shape == (2,)  # one logged value per layer


def test_packed_equals_batched(results):
    _same(results["packed"], results["plain"], rtol=1e-5, what="THD vs sbhd")


def test_recompute(results):
    _same(results["sel"], results["plain"], rtol=0, atol=0, what="selective recompute")  # bitwise: same calls
    _same(results["full"], results["plain"], rtol=0, atol=0, what="full recompute")


def test_tensor_parallel_2(results):
    for r, res in enumerate(results["tp2"]):
        _same(res, results["plain"], rtol=1e-4, atol=1e-6, what=f"TP = 2 rank {r}")


def test_fifty_step_curves(results):
    """50 Adam steps (packed batches): TP = 2 and CP = 2 follow the one-process loss curve (fp32; every rank the
    same curve), and the loss falls."""
    one = results["curves"]["one"][0]
    assert len(one) == 50 and one[-1] < one[0] - 0.5, (one[0], one[-1])
    for k in ("tp2", "cp2"):
        for r, c in enumerate(results["curves"][k]):
            worst = max(abs(a - b) / abs(b) for a, b in zip(c, one))
            print(f"{k} rank {r}: loss {c[0]:.4f} -> {c[-1]:.4f}, at most {worst:.1e} from one process "
                  f"({one[0]:.4f} -> {one[-1]:.4f})")
            assert worst < 1e-3, f"{k} rank {r}: loss curve off by {worst:.2e} relative"


def test_index_share(results, mcore):
    """msa_index_share=2: layer 2 has no proxy projections and attends to the blocks layer 1 selected (the call's
    given indices are layer 1's returned ones), only layer 1 logs a kl, CP = 2 equals one process, and batched
    (sbhd) inputs are refused (the selection travels with PackedSeqParams)."""
    from flashmsa.integrations import megatron as fm
    from megatron.core.packed_seq_params import PackedSeqParams
    share = results["share"]
    names = [n for n in share["grads"] if "linear_qp" in n or "linear_kp" in n]
    assert names and all("layers.0." in n for n in names), names
    assert float(share["kl"][0]) > 0 and float(share["kl"][1]) == 0.0, share["kl"]
    for r, res in enumerate(results["share_cp2"]):
        torch.testing.assert_close(res["loss"], share["loss"], rtol=1e-4, atol=1e-6, msg=f"CP 2 rank {r}")
        for n in share["grads"]:
            torch.testing.assert_close(res["grads"][n], share["grads"][n], rtol=1e-4, atol=1e-6, msg=n)
    m = mcore.model(mcore.config(msa_index_share=2))
    calls, orig = [], fm._ops.msa_attention

    def record(*a, **kw):
        res = orig(*a, **kw)
        calls.append((kw.get("indices"), res[2] if kw.get("return_indices") else None))
        return res
    fm._ops.msa_attention = record
    try:
        ids, labels = mcore.tokens(1)
        cu = torch.tensor([0, ids.shape[1]], dtype=torch.int32)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=ids.shape[1],
                              max_seqlen_kv=ids.shape[1])
        m.train()
        m(ids, None, None, labels=labels, packed_seq_params=psp).mean().backward()
        fm.kl_metrics()
    finally:
        fm._ops.msa_attention = orig
    assert len(calls) == 2 and calls[0][0] is None and calls[0][1] is not None
    assert calls[1][0] is not None and torch.equal(calls[1][0], calls[0][1])
    with pytest.raises(ValueError, match="needs packed"):
        m(ids, None, None, labels=labels)


def test_context_parallel_2(results):
    """CP = 2 in Megatron's zigzag layout equals one process, with the tokens scheme (default) and the heads one."""
    for r, res in enumerate(results["cp2"]):
        _same(res, results["packed"], rtol=1e-4, atol=1e-6, what=f"CP = 2 rank {r}")
    for r, res in enumerate(results["cp2_heads"]):
        _same(res, results["packed"], rtol=1e-4, atol=1e-6, what=f"CP = 2 heads scheme rank {r}")


# ---- one process: construction errors and the warmup mode against Megatron's dense attention -----------------
@pytest.fixture(scope="module")
def mcore():
    if torch.cuda.is_available():  # cpu_support() is process-wide; the subprocess worlds above cover the CPU there
        pytest.skip("the in-process CPU tests run where no GPU is visible (CI)")
    import torch.distributed as dist
    sys.path.insert(0, str(HERE))
    import megatron_worker as W
    from megatron.core import parallel_state
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    W.cpu_shims()
    yield W
    parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("kw,text", [
    (dict(msa_proxy_heads=3), "msa_proxy_heads (Hp) = 3 must divide num_attention_heads = 4"),
    (dict(msa_proxy_key_heads=3), "msa_proxy_key_heads (Hpk) = 3 must divide msa_proxy_heads (Hp) = 2"),
    (dict(msa_topk=0), "msa_topk: expected 1..64"),
    (dict(tensor_model_parallel_size=4, num_attention_heads=8, num_query_groups=4, msa_proxy_heads=2),
     "msa_proxy_heads (Hp) = 2 must be a multiple of tensor_model_parallel_size = 4"),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True),
     "msa_proxy_key_heads (Hpk) = 1 is not a multiple of tensor_model_parallel_size = 2"),
    (dict(msa_cp_scheme="ring"), "msa_cp_scheme: expected 'tokens', 'heads' or 'hybrid'"),
    (dict(context_parallel_size=4, msa_cp_scheme="heads"),
     "msa_cp_scheme 'heads': the heads of a TP rank do not split over context_parallel_size = 4"),
    (dict(tensor_model_parallel_size=2, context_parallel_size=2, msa_cp_scheme="heads"),  # Hp 2 / TP 2 = 1 a rank
     "msa_cp_scheme 'heads': the heads of a TP rank do not split over context_parallel_size = 2"),
    (dict(msa_kl_coeff=float("nan")), "msa_kl_coeff: expected a finite value >= 0"),
    (dict(msa_index_share=0), "msa_index_share: expected an int >= 1"),
    (dict(msa_detach_proxy_input=1), "msa_detach_proxy_input: expected a bool"),
])
def test_bad_configurations(mcore, kw, text):
    with pytest.raises(ValueError, match=None) as e:
        mcore.config(**kw)
    assert text in str(e.value)


def test_cuda_warmup_cp_size_checked_at_construction(mcore, monkeypatch):
    """On a CUDA machine the dense warmup runs flashmsa.distributed's heads scheme: a CP size that a TP rank's heads
    do not split over is refused at construction (CPU-only machines run every scheme and are not refused)."""
    kw = dict(context_parallel_size=4, msa_warmup=True)  # Hp = 2 over CP 4
    mcore.config(**kw)  # no CUDA here: accepted
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="msa_warmup: the dense warmup on CUDA runs the heads scheme"):
        mcore.config(**kw)
    mcore.config(context_parallel_size=2, msa_warmup=True)  # Hp = 2 over CP 2: the heads split


def test_warmup_equals_megatron_dense_attention(mcore):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from flashmsa.integrations import megatron as fm
    cfg = mcore.config(msa_kl_coeff=0.0)
    msa = mcore.model(cfg)
    assert fm.set_warmup(msa, True) == 2
    dense = mcore.model(mcore.config(msa_kl_coeff=0.0), spec=get_gpt_layer_local_spec())
    missing, unexpected = dense.load_state_dict(msa.state_dict(), strict=False)
    assert not missing and all("linear_qp" in n or "linear_kp" in n for n in unexpected), (missing, unexpected)
    ids, _ = mcore.tokens()
    msa.eval()
    dense.eval()
    mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), 1)[None, None]  # True: masked
    with torch.no_grad():  # (Megatron's default causal mask is made on CUDA: the test passes its own)
        a, b = msa(ids, None, None), dense(ids, None, mask)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    fm.set_warmup(msa, False)  # sparse: topk 2 of 3 blocks differs from dense at the sequence's end
    with torch.no_grad():
        c = msa(ids, None, None)
    assert float((c - b).abs().max()) > 1e-3


@pytest.mark.parametrize("warmup", [True, False])
def test_kl_trains_the_proxy_alone(mcore, warmup):
    """msa_detach_proxy_input (default True): a step's gradients of every parameter but linear_qp and linear_kp are
    the same with the kl in the loss as without it (the paper's stop-gradient: the dense warmup then trains the model
    as dense attention does), while the proxy projections get the kl's; False lets the kl reach the rest too."""
    from flashmsa.integrations import megatron as fm

    def grads(**kw):
        m = mcore.model(mcore.config(**kw))
        fm.set_warmup(m, warmup)
        ids, labels = mcore.tokens()
        m(ids, None, None, labels=labels).float().mean().backward()
        fm.kl_metrics(reduce=False)
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    base, kl, leak = grads(msa_kl_coeff=0.0), grads(msa_kl_coeff=1.0), grads(msa_kl_coeff=1.0,
                                                                             msa_detach_proxy_input=False)
    proxy = [n for n in kl if "linear_qp" in n or "linear_kp" in n]
    assert proxy and all(float(kl[n].abs().max()) > 0 for n in proxy)
    for n in base:
        if n not in proxy:
            torch.testing.assert_close(kl[n], base[n], rtol=0, atol=0, msg=n)
    assert any(not torch.equal(leak[n], base[n]) for n in base if n not in proxy)


def test_example_cpu_preset(tmp_path):
    """examples/megatron_gpt.py's CPU preset, shortened: MSA and Megatron dense attention from the same weights agree
    through the dense warmup (the kl trains only the proxy), the kl is logged per layer, and after the switch to
    sparse the validation loss stays within 10% of dense."""
    env = dict(os.environ, MASTER_PORT=str(_port()), FLASHMSA_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(HERE.parents[1] / "examples" / "megatron_gpt.py"), "--out", str(tmp_path),
                        "--steps", "20", "--warmup-steps", "10", "--eval-every", "10", "--index-share", "2"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import json
    res = json.loads((tmp_path / "megatron_gpt.json").read_text())
    msa, dense = (res["runs"][k]["history"] for k in ("msa", "dense"))
    assert [h["step"] for h in msa] == [0, 10, 20]
    assert msa[0]["val_loss"] == dense[0]["val_loss"]  # the same weights
    assert abs(msa[1]["val_loss"] - dense[1]["val_loss"]) < 1e-3 * dense[1]["val_loss"]  # end of the warmup
    assert abs(res["gap"]) < 0.10 and abs(res["gap_share"]) < 0.10, (res["gap"], res["gap_share"])
    assert res["runs"]["msa_share"]["history"][0]["val_loss"] == dense[0]["val_loss"]
    kl = res["last_kl_per_layer"]
    assert len(kl) == 2 and all(0 < x < 10 for x in kl), kl


def test_kl_loss_scale(mcore):
    """set_kl_loss_scale: the fp16 grad scaler's scale x CP size / micro-batches (Megatron's MoE rule), and the
    autoscaler hands the kl exactly that gradient while the output's gradient passes through unchanged."""
    from flashmsa.integrations import megatron as fm
    cfg = mcore.config()
    cfg.grad_scale_func = lambda one: one * 1024.0
    fm.set_kl_loss_scale(cfg, num_microbatches=4)
    w = torch.tensor([0.5, 1.5], requires_grad=True)
    x = torch.ones(3, requires_grad=True)
    out = fm.MSAKLLossAutoScaler.apply(x * 2, (w * w).sum())
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    torch.testing.assert_close(w.grad, 256.0 * 2 * w.detach())  # d(kl)/dw x 1024 / 4
    cfg.calculate_per_token_loss = True
    fm.set_kl_loss_scale(cfg, num_microbatches=4)
    assert float(fm.MSAKLLossAutoScaler.main_loss_backward_scale) == 1024.0
    fm.MSAKLLossAutoScaler.set_loss_scale(torch.ones(()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Megatron-Core's distributed optimizer needs CUDA")
def test_distributed_optimizer_cuda(tmp_path):
    """Megatron's DistributedDataParallel + distributed optimizer (bf16 weights, fp32 main weights, one GPU: a data
    parallel group of 1, the one this machine lends) trains the MSA model: with deterministic kernels, 30 steps follow
    the curve of Megatron's non-distributed bf16 optimizer within 2%, the loss falls, and the proxy projections
    (trained by the kl alone) move."""
    _world(tmp_path, 1, 1, 1, ["distopt_on", "distopt_off"], device="cuda")
    on, off = (torch.load(tmp_path / f"distopt_{k}-rank0.pt") for k in ("on", "off"))
    assert "DistributedOptimizer" in on["optimizers"] and "DistributedOptimizer" not in off["optimizers"], \
        (on["optimizers"], off["optimizers"])
    a, b = on["losses"], off["losses"]
    print(f"distributed optimizer: loss {a[0]:.4f} -> {a[-1]:.4f}; bf16 optimizer {b[0]:.4f} -> {b[-1]:.4f}")
    for n, v in on["grad_norms"].items():  # where the first step's gradients arrive (a diagnosis when the loss stalls)
        print(f"  first-step gradient norm {n}: {v}")
    assert a[-1] < a[0] - 0.5, (a[0], a[-1])
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    assert worst < 2e-2, f"curves {worst:.2e} apart"
    assert on["before"].keys() == on["after"].keys() and len(on["before"]) == 4  # qp and kp of both layers
    for n in on["before"]:
        assert not torch.equal(on["before"][n], on["after"][n]), f"{n} did not move"


def test_autocast(mcore):
    """fp32 weights under torch.autocast (the example's GPU preset): Megatron's projections and rotary embedding hand
    over q, k, v and qp, kp in different dtypes; the layer runs them in the autocast dtype. The forward only: on the
    CPU, Megatron-Core 0.16.1's linear layers do not take autocast in their own backward (bf16 gradients against
    fp32 weights); on CUDA they do, and the example's GPU preset trains this way."""
    from flashmsa.integrations import megatron as fm
    m = mcore.model(mcore.config())
    ids, labels = mcore.tokens()
    m.eval()
    seen, orig = [], fm._ops.msa_attention

    def record(*a, **kw):
        seen.append({x.dtype for x in a[:5] if x is not None})
        return orig(*a, **kw)
    fm._ops.msa_attention = record
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(ids, None, None, labels=labels).float().mean()
    finally:
        fm._ops.msa_attention = orig
    assert torch.isfinite(loss)
    assert seen and all(d == {torch.bfloat16} for d in seen), seen


def test_autocast_recompute_inputs(mcore, monkeypatch):
    """Selective recompute under autocast: the checkpointed core attention's tensor inputs already share the autocast
    dtype (the recompute runs without the forward's autocast state, so a cast inside it would pick another)."""
    from flashmsa.integrations import megatron as fm
    m = mcore.model(mcore.config(recompute_granularity="selective", recompute_modules=["core_attn"]))
    ids, labels = mcore.tokens()
    m.train()
    seen, orig = [], fm.tensor_parallel.checkpoint

    def record(fn, distribute, *args):
        seen.append({a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()})
        return orig(fn, distribute, *args)
    monkeypatch.setattr(fm.tensor_parallel, "checkpoint", record)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(ids, None, None, labels=labels)
    assert len(seen) == 2 and all(d == {torch.bfloat16} for d in seen), seen
