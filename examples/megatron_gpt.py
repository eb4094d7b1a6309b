#!/usr/bin/env python3
"""MSA in a Megatron-Core GPTModel (docs/megatron.md), trained on real text: the byte-level corpus of
examples/lm_long_context.py (the Python standard library's sources, 5% of the files held out). Two runs of the same
Megatron-Core GPTModel from the same initial weights, on the same batches in the same order:
  msa:   self-attention = flashmsa.integrations.megatron (dense warmup for --warmup-steps, then sparse; the proxy
         trained by the kl auxiliary loss, logged per layer through Megatron's auxiliary-loss tracker);
  dense: Megatron's SelfAttention (the same projections and rotary embedding) with dense causal attention in the
         core-attention slot (torch SDPA: cuDNN/flash on the GPU; the local DotProductAttention materialises the
         [S, S] scores, which does not fit at long context; tests/python/test_megatron.py checks that MSA's warmup
         mode equals DotProductAttention).
It prints the validation loss of both runs, the final gap, the kl per layer, the selection's attention-mass recall
(at each evaluation: flashmsa.msa_select on each layer's qp, kp, the share of the dense causal attention mass inside
the selected blocks at sampled rows, mean over layers; with it the fp8 selection's mass recall and set recall on the
same projections), the step times and their ratio, the peak memory and the
attention's share of the step (one layer's attention fwd + bwd at the training shape timed alone, times the layer
count, over the step), and writes DIR/megatron_gpt.json and DIR/megatron_gpt.png (loss, kl, recall).

    python3 examples/megatron_gpt.py --out DIR                    # CPU preset (CI-sized: under a minute)
    python3 examples/megatron_gpt.py --preset h200 --out DIR      # one GPU, 32k tokens, head dim 128

Needs megatron-core (pip install 'flashmsa[megatron]'). On the CPU, Megatron-Core 0.16.1 makes a few CUDA calls even
on its CPU path (the rotary embedding's device, the CUDA RNG tracker): flashmsa.integrations.megatron.cpu_support()
redirects them.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pathlib
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.nn import functional as F

HERE = pathlib.Path(__file__).resolve().parent
try:
    import flashmsa  # noqa: F401
except ImportError:  # run from a checkout
    sys.path.insert(0, str(HERE.parents[0] / "python"))
from flashmsa.integrations import megatron as fm  # noqa: E402

_spec = importlib.util.spec_from_file_location("lm_long_context", HERE / "lm_long_context.py")
lm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lm)

PRESETS = {
    "cpu": dict(seqlen=512, batch=2, hidden=64, layers=2, heads=4, groups=2, proxy_heads=2, head_dim=16, topk=2,
                steps=30, warmup_steps=15, lr=3e-3, eval_every=10, eval_batches=2, recall_rows=32, dtype="float32",
                device="cpu"),
    "h200": dict(seqlen=32768, batch=1, hidden=1024, layers=4, heads=16, groups=2, proxy_heads=4, head_dim=128,
                 topk=16, steps=400, warmup_steps=100, lr=1e-3, eval_every=50, eval_batches=4, recall_rows=128,
                 dtype="bfloat16", device="cuda"),
}


class SDPACoreAttention(torch.nn.Module):
    """The dense baseline's core attention: causal torch SDPA on Megatron's [s, b, h, d] q, k, v (GQA)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.config = config

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        s, b = query.shape[:2]
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)


def dense_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def build(kind, a, init=None, share=1):
    from megatron.core.models.gpt.gpt_model import GPTModel
    dt = getattr(torch, a.dtype)
    cfg = fm.MSAConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                       num_query_groups=a.groups, kv_channels=a.head_dim, ffn_hidden_size=4 * a.hidden,
                       use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=dt,
                       bf16=a.dtype == "bfloat16", attention_dropout=0.0, hidden_dropout=0.0,
                       masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
                       apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
                       msa_topk=a.topk, msa_proxy_heads=a.proxy_heads, msa_proxy_key_heads=1, msa_kl_coeff=1.0,
                       msa_warmup=True, msa_index_share=share)
    torch.manual_seed(a.seed)
    spec = fm.get_msa_gpt_layer_spec() if kind == "msa" else dense_spec()
    m = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=256, max_sequence_length=a.seqlen,
                 position_embedding_type="rope")
    if init is not None:  # the same weights (the dense model has no proxy projections)
        missing, _ = m.load_state_dict(init, strict=False)
        assert not missing, missing
    return m.to(a.device)


def loss_of(m, x, y, a):
    """Mean token loss; IndexShare models take the batch packed (THD: the shared selection travels with its
    PackedSeqParams), the same sequences."""
    from megatron.core.packed_seq_params import PackedSeqParams
    kw = {}
    if m.config.msa_index_share > 1:
        b, s = x.shape
        cu = torch.arange(b + 1, dtype=torch.int32, device=x.device) * s
        kw["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                  max_seqlen_q=s, max_seqlen_kv=s)
        x, y = x.reshape(1, -1), y.reshape(1, -1)
    with torch.autocast(a.device, dtype=getattr(torch, a.dtype), enabled=a.dtype != "float32"):
        per_tok = m(x, None, None, labels=y, **kw)
    return per_tok.float().mean()


def recall_of(m, x, y, a):
    """The selection's attention-mass recall on one validation batch: each layer's flashmsa call is intercepted,
    its proxy's selection recomputed by flashmsa.msa_select and scored by lm.sampled_recall (mean over layers).
    With it, the fp8 selection's (fp8_selection=True) on the same trained projections: its mass recall and its set
    recall against the input dtype's selection. Returns (recall, fp8 recall, fp8 set recall)."""
    import flashmsa
    rec, orig = [], fm._ops.msa_attention

    def probe(q, k, v, qp=None, kp=None, topk=16, **kw):
        if qp is not None:
            B, S = x.shape
            sel = dict(cu_seqlens=kw["cu_seqlens"], max_seqlen=kw["max_seqlen"])
            idx = flashmsa.msa_select(qp, kp, topk, **sel)
            try:
                idx8 = flashmsa.msa_select(qp, kp, topk, fp8_selection=True, **sel)
            except flashmsa.NotSupportedError:  # a shape the CUDA fp8 selection does not serve (docs/errors.md)
                idx8 = None
            rows = torch.linspace(lm.BLOCK, S - 1, a.recall_rows, device=q.device).long().unique()
            qs, ks = q.view(B, S, *q.shape[1:]), k.view(B, S, *k.shape[1:])
            nan = float("nan")
            rec.append((lm.sampled_recall(qs, ks, idx, rows),
                        nan if idx8 is None else lm.sampled_recall(qs, ks, idx8, rows),
                        nan if idx8 is None else lm.set_recall(idx, idx8)))
        return orig(q, k, v, qp, kp, topk, **kw)
    fm._ops.msa_attention = probe
    try:
        loss_of(m, x, y, a)
    finally:
        fm._ops.msa_attention = orig
    return tuple(sum(r[i] for r in rec) / len(rec) for i in range(3)) if rec else (float("nan"),) * 3


def attention_times(a):
    """One layer's attention fwd + bwd at the training shape, timed alone (median of 5 after a warm-up), ms: MSA
    (flashmsa.msa_attention, sparse, its kl on) and dense (torch SDPA causal, GQA)."""
    import flashmsa
    dev, dt = torch.device(a.device), getattr(torch, a.dtype)
    T, Hq, Hkv, Hp, D = a.batch * a.seqlen, a.heads, a.groups, a.proxy_heads, a.head_dim
    g = torch.Generator(device=dev).manual_seed(3)
    mk = lambda *sh: torch.randn(*sh, generator=g, device=dev, dtype=dt).requires_grad_()  # noqa: E731
    q, k, v, qp, kp = mk(T, Hq, D), mk(T, Hkv, D), mk(T, Hkv, D), mk(T, Hp, D), mk(T, 1, D)
    cu = torch.arange(a.batch + 1, dtype=torch.int32, device=dev) * a.seqlen

    def msa():
        out, kl = flashmsa.msa_attention(q, k, v, qp, kp, a.topk, cu_seqlens=cu, max_seqlen=a.seqlen)
        torch.autograd.backward([out, kl], [torch.ones_like(out), torch.ones_like(kl)])

    def dense():
        f = lambda t: t.view(a.batch, a.seqlen, *t.shape[1:]).transpose(1, 2)  # noqa: E731
        o = F.scaled_dot_product_attention(f(q), f(k), f(v), is_causal=True, enable_gqa=True)
        o.backward(torch.ones_like(o))
    res = {}
    for name, fn in (("msa", msa), ("dense", dense)):
        ts = []
        for _ in range(6):
            lm.sync(dev)
            t0 = time.perf_counter()
            fn()
            lm.sync(dev)
            ts.append(time.perf_counter() - t0)
        res[name] = 1e3 * sorted(ts[1:])[2]
    return res


def plot(runs, a, path):
    """Validation loss of both runs, the MSA run's train kl (mean over layers) and recall, via lm.plot."""
    import types
    fin = lambda x: x if x is not None and math.isfinite(x) else 0.0  # noqa: E731 (the PNG writer needs numbers)
    curves = {}
    for kind in ("msa", "dense"):
        pts, last = [], float("nan")
        for h in runs[kind]["history"]:  # the kl of the training step right after each evaluation (the last: before)
            kls = [x for x in h.get("kl") or [] if x]
            last = sum(kls[0]) / len(kls[0]) if kls else last
            pts.append(dict(val_loss=fin(h["val_loss"]), step=h["step"], recall=fin(h.get("recall")), kl=fin(last)))
        curves[kind] = {"curve": pts}
    ns = types.SimpleNamespace(warmup_steps=a.warmup_steps, layers=a.layers, seqlen=a.seqlen, heads=a.heads,
                               kv_heads=a.groups, proxy_heads=a.proxy_heads, head_dim=a.head_dim, topk=a.topk)
    return lm.plot(curves, ns, path, kl_title="proxy kl (training step, mean over layers)")


def train(kind, a, data, val, init, log):
    m = build("msa" if kind.startswith("msa") else kind, a, init, share=a.index_share if kind == "msa_share" else 1)
    if a.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    opt = torch.optim.AdamW(m.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(a.seed + 1)
    hist, times = [], {"warmup": [], "sparse": []}
    for step in range(a.steps + 1):
        sparse = step >= a.warmup_steps
        if kind.startswith("msa"):
            fm.set_warmup(m, not sparse)
        if step % a.eval_every == 0 or step == a.steps:
            m.eval()
            with torch.no_grad():
                vl = sum(loss_of(m, x, y, a).item() for x, y in val) / len(val)
                rc, rc8, set8 = recall_of(m, *val[0], a) if kind.startswith("msa") else (None,) * 3
            m.train()
            hist.append(dict(step=step, val_loss=vl, recall=rc, recall_fp8=rc8, set_recall_fp8=set8))
            ph = times["sparse"] or times["warmup"]
            log(f"[{kind:5s}] step {step:4d}  val loss {vl:.4f}" + (f"  recall {rc:.4f}" if rc is not None else "")
                + (f"  step {median(ph):.3f} s" if ph else ""))
        if step == a.steps:
            break
        x, y = (t.to(a.device) for t in lm.windows(data, a.batch, a.seqlen, gen))
        lm.sync(torch.device(a.device))
        t0 = time.perf_counter()
        fm.set_kl_loss_scale(m.config, 1)
        loss = loss_of(m, x, y, a)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        lm.sync(torch.device(a.device))
        times["sparse" if sparse else "warmup"].append(time.perf_counter() - t0)
        if kind.startswith("msa"):
            kl = fm.kl_metrics(reduce=False).get("msa_kl_loss")
            hist[-1].setdefault("kl", []).append(kl.tolist() if kl is not None else None)
    peak = torch.cuda.max_memory_allocated() / 1e9 if a.device == "cuda" else None
    if a.profile:
        profile_steps(m, opt, kind, a, data, gen, log)
    return m, hist, times, peak


def profile_steps(m, opt, kind, a, data, gen, log, steps=3):
    """--profile: `steps` more training steps of the final mode under torch.profiler; the ops by total device time
    (CPU time on the CPU), top 30, to the log and to DIR/profile_<kind>.txt: where a step's time goes beside the
    attention."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            x, y = (t.to(a.device) for t in lm.windows(data, a.batch, a.seqlen, gen))
            fm.set_kl_loss_scale(m.config, 1)
            loss = loss_of(m, x, y, a)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if kind.startswith("msa"):
                fm.kl_metrics(reduce=False)
        lm.sync(torch.device(a.device))
    table = prof.key_averages().table(sort_by="cuda_time_total" if a.device == "cuda" else "cpu_time_total",
                                      row_limit=30)
    log(f"[{kind}] profile of {steps} steps:\n{table}")
    if a.out:
        pathlib.Path(a.out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(a.out) / f"profile_{kind}.txt").write_text(table)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true",
                    help="after each run, 3 more steps under torch.profiler: the top ops to the log and DIR/profile_*.txt")
    ap.add_argument("--index-share", type=int, default=1,
                    help="> 1: a third run, MSA with IndexShare over groups of this many layers (msa_share)")
    for k, v in PRESETS["cpu"].items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=None)
    a = ap.parse_args(argv)
    for k, v in PRESETS[a.preset].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    warnings.filterwarnings("ignore")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("megatron_gpt: --preset h200 needs a CUDA GPU (the CPU preset runs anywhere)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    from megatron.core import parallel_state
    dist.init_process_group("gloo" if a.device == "cpu" else "nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    if a.device == "cpu":
        fm.cpu_support()
    else:
        from megatron.core import tensor_parallel
        tensor_parallel.model_parallel_cuda_manual_seed(a.seed)
    train_data, val_data, facts = lm.load_corpus(a.seed)
    vg = torch.Generator().manual_seed(a.seed + 2)
    val = [tuple(t.to(a.device) for t in lm.windows(val_data, a.batch, a.seqlen, vg)) for _ in range(a.eval_batches)]
    log = lambda s: print(s, flush=True)  # noqa: E731
    log(f"megatron_gpt: preset {a.preset}, {a.layers} layers, hidden {a.hidden}, heads {a.heads}/{a.groups}, "
        f"proxy heads {a.proxy_heads}, head dim {a.head_dim}, {a.seqlen} tokens x {a.batch}, topk {a.topk}, "
        f"{a.steps} steps ({a.warmup_steps} dense warmup), {a.dtype} on {a.device}; corpus {facts['train_bytes']} "
        f"train / {facts['val_bytes']} val bytes")
    init = build("msa", a).state_dict()
    runs = {}
    for kind in ("msa", "dense") + (("msa_share",) if a.index_share > 1 else ()):
        m, hist, times, peak = train(kind, a, train_data, val, init, log)
        del m
        runs[kind] = dict(history=hist, step_s_warmup=median(times["warmup"]), step_s_sparse=median(times["sparse"]),
                          peak_gb=peak)
    fin = {k: r["history"][-1]["val_loss"] for k, r in runs.items()}
    gap = (fin["msa"] - fin["dense"]) / fin["dense"]
    kls = [h["kl"][-1] for h in runs["msa"]["history"] if h.get("kl")]
    res = dict(preset=a.preset, args={k: v for k, v in vars(a).items() if k != "out"}, corpus=facts, runs=runs,
               final_val_loss=fin, gap=gap, last_kl_per_layer=kls[-1] if kls else None,
               step_ratio_sparse=runs["dense"]["step_s_sparse"] / runs["msa"]["step_s_sparse"],
               last_recall=runs["msa"]["history"][-1]["recall"],
               last_recall_fp8=runs["msa"]["history"][-1]["recall_fp8"],
               last_set_recall_fp8=runs["msa"]["history"][-1]["set_recall_fp8"],
               device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu")
    at = attention_times(a)
    res["attention_ms"] = at
    res["attention_share"] = {k: a.layers * at[k] / 1e3 / runs[k]["step_s_sparse"] for k in ("msa", "dense")}
    if "msa_share" in runs:
        res["gap_share"] = (fin["msa_share"] - fin["dense"]) / fin["dense"]
        res["step_ratio_share"] = runs["msa"]["step_s_sparse"] / runs["msa_share"]["step_s_sparse"]
        log(f"IndexShare over {a.index_share} layers: final val loss {fin['msa_share']:.4f} (gap "
            f"{100 * res['gap_share']:+.2f}% to dense), sparse step {runs['msa_share']['step_s_sparse']:.3f} s "
            f"({res['step_ratio_share']:.2f}x the MSA run's speed)")
    log(f"final val loss: msa {fin['msa']:.4f}, dense {fin['dense']:.4f} (gap {100 * gap:+.2f}%); kl per layer "
        f"{res['last_kl_per_layer']}; step s (sparse phase): msa {runs['msa']['step_s_sparse']:.3f}, dense "
        f"{runs['dense']['step_s_sparse']:.3f} (dense / msa {res['step_ratio_sparse']:.2f}x); recall "
        f"{res['last_recall']:.4f} (fp8 selection: {res['last_recall_fp8']:.4f}, set recall "
        f"{res['last_set_recall_fp8']:.4f})")
    log(f"attention fwd+bwd of one layer: msa {at['msa']:.2f} ms, dense {at['dense']:.2f} ms; share of the step: "
        f"msa {100 * res['attention_share']['msa']:.0f}%, dense {100 * res['attention_share']['dense']:.0f}%"
        + ("" if a.device != "cuda" else f"; peak memory GB: msa {runs['msa']['peak_gb']:.2f}, dense "
                                          f"{runs['dense']['peak_gb']:.2f}"))
    if a.out:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "megatron_gpt.json").write_text(json.dumps(res, indent=1))
        png = plot(runs, a, out / "megatron_gpt.png")
        log(f"wrote {out / 'megatron_gpt.json'} and {png}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return res


if __name__ == "__main__":
    main()
