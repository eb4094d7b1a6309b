#!/usr/bin/env python3
"""Proof on real data: a byte-level decoder-only language model trained on text that nobody in
this project wrote and that every machine with Python has, the source files of the Python
standard library. Two runs of the same model:
  msa:   attention = flashmsa.nn.MSAttention: a dense warmup (the proxy learns to imitate the
         attention through the kl term), then sparse (every query keeps topk 128-token blocks);
  dense: dense causal attention (torch SDPA, cuDNN/flash on the GPU),
from the same initial weights, on the same batches in the same order, with the same optimizer
and steps.

It reports the validation loss curves of both runs, the final gap, tokens/s of each run and the
attention's share of the step, the proxy's kl and the selection's attention-mass recall over
training, and the union factor of the trained indexer's selections next to BENCHMARKS.md's
synthetic patterns (clustered, random) at the same shape.

    python3 examples/lm_long_context.py --out DIR                 # CPU preset (CI: under a minute)
    python3 examples/lm_long_context.py --preset h200 --out DIR   # the H200 run (head dim 128, 16k)

The corpus: every *.py under sysconfig.get_paths()["stdlib"] outside site-packages and
dist-packages (they hold installed third-party packages, torch among them), in sorted path order,
one byte 0 between files; a seeded 5% of the files is held out for validation.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import random
import sys
import sysconfig
import time

import torch
from torch import nn
from torch.nn import functional as F

try:
    import flashmsa
except ImportError:  # run from a checkout
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))
    import flashmsa
from flashmsa.nn import MSAttention, last_kl, proxy_param_groups, rotary, set_warmup

BLOCK = 128
# proxy_lr_mult: the proxy projections (qp_proj, kp_proj: trained by the kl term alone) learn at
# this multiple of lr. At 1x the proxy lags the main attention while that changes fast and its kl
# rises, in the warmup and after the switch alike; at 5x it follows (docs/lm_long_context.md).
PRESETS = {
    # CI-sized: 8 blocks, topk 2 (25% of the blocks at the trained length), fp32 on the CPU
    # backend (the library's fp64 reference kernels)
    "cpu": dict(seqlen=1024, batch=2, dim=64, layers=2, heads=4, kv_heads=2, proxy_heads=2, head_dim=16,
                topk=2, steps=40, warmup_steps=20, lr=3e-3, proxy_lr_mult=5.0, eval_every=10, eval_batches=2,
                recall_rows=32, dtype="float32", device="cpu"),
    # the H200 run: 4 layers, head dim 128, GQA with MSA at the flash-msa heads (16/2/4/1), 16k
    # tokens (128 blocks), topk 16 (12.5% of the blocks), bf16 compute with fp32 weights
    "h200": dict(seqlen=16384, batch=2, dim=1024, layers=4, heads=16, kv_heads=2, proxy_heads=4, head_dim=128,
                 topk=16, steps=1000, warmup_steps=200, lr=1e-3, proxy_lr_mult=5.0, eval_every=50, eval_batches=4,
                 recall_rows=256, dtype="bfloat16", device="cuda"),
}


# ---- the corpus ------------------------------------------------------------------------------
def stdlib_files() -> list:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def load_corpus(seed: int, val_share: float = 0.05):
    """(train bytes, validation bytes, facts): the stdlib's *.py files, a seeded val_share of the
    files held out; files joined with one byte 0."""
    files = stdlib_files()
    if len(files) < 20:
        raise SystemExit(f"lm_long_context: only {len(files)} *.py files under the stdlib "
                         f"({sysconfig.get_paths()['stdlib']}): no corpus")
    held = set(random.Random(seed).sample(range(len(files)), max(1, round(val_share * len(files)))))
    parts = {"train": [], "val": []}
    unreadable = 0
    for i, f in enumerate(files):
        try:
            parts["val" if i in held else "train"].append(f.read_bytes())
        except OSError:
            unreadable += 1
    train, val = (b"\x00".join(parts[s]) for s in ("train", "val"))
    facts = dict(python=platform.python_version(), stdlib=sysconfig.get_paths()["stdlib"], files=len(files),
                 unreadable=unreadable, train_files=len(parts["train"]), val_files=len(parts["val"]),
                 train_bytes=len(train), val_bytes=len(val))
    return (torch.frombuffer(bytearray(train), dtype=torch.uint8), torch.frombuffer(bytearray(val), dtype=torch.uint8),
            facts)


def windows(data: torch.Tensor, B: int, S: int, gen: torch.Generator):
    """(x, y) [B, S] int64: B random windows of S + 1 bytes (y is x shifted by one)."""
    if data.numel() < S + 2:
        raise SystemExit(f"lm_long_context: the corpus split has {data.numel()} bytes, fewer than seqlen + 2")
    off = torch.randint(0, data.numel() - S - 1, (B,), generator=gen)
    w = torch.stack([data[o:o + S + 1] for o in off.tolist()]).long()
    return w[:, :-1], w[:, 1:]


# ---- the models ------------------------------------------------------------------------------
MSA_KINDS = ("msa", "joint")

class DenseAttention(nn.Module):
    """The baseline: MSAttention's main path (same projections, rotary, GQA) with dense causal
    SDPA; the same parameter names, so it starts from the MSA model's weights."""

    def __init__(self, a):
        super().__init__()
        self.h, self.hkv, self.d = a.heads, a.kv_heads, a.head_dim
        self.q_proj = nn.Linear(a.dim, a.heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(a.dim, a.kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(a.dim, a.kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.heads * a.head_dim, a.dim, bias=False)

    def forward(self, x):
        B, S, _ = x.shape
        pos = torch.arange(S, device=x.device).expand(B, -1)
        q = rotary(self.q_proj(x).view(B, S, self.h, self.d), pos)
        k = rotary(self.k_proj(x).view(B, S, self.hkv, self.d), pos)
        v = self.v_proj(x).view(B, S, self.hkv, self.d)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1)), None


class Block(nn.Module):
    def __init__(self, a, kind):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(a.dim), nn.LayerNorm(a.dim)
        if kind in MSA_KINDS:  # "joint": the jointly trained indexer (the proxy's own output added to y)
            self.attn = MSAttention(a.dim, a.heads, a.kv_heads, a.proxy_heads, 1, head_dim=a.head_dim, topk=a.topk,
                                    proxy_output=kind == "joint")
        else:
            self.attn = DenseAttention(a)
        self.mlp = nn.Sequential(nn.Linear(a.dim, 4 * a.dim), nn.GELU(), nn.Linear(4 * a.dim, a.dim))

    def forward(self, x):
        y, kl = self.attn(self.ln1(x))
        x = x + y
        return x + self.mlp(self.ln2(x)), kl


class LM(nn.Module):
    def __init__(self, a, kind):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(256, a.dim)
        self.blocks = nn.ModuleList(Block(a, kind) for _ in range(a.layers))
        self.ln = nn.LayerNorm(a.dim)
        self.head = nn.Linear(a.dim, 256, bias=False)

    def forward(self, tok):
        x, kls = self.emb(tok), []
        for blk in self.blocks:
            x, kl = blk(x)
            if kl is not None:
                kls.append(kl)
        return self.head(self.ln(x)), (sum(kls) / len(kls) if kls else None)


# ---- measurements ----------------------------------------------------------------------------
def sampled_recall(q, k, idx, rows: torch.Tensor) -> float:
    """Attention-mass recall of the selection (share of the dense causal attention mass of the
    main heads inside the selected blocks) at the positions `rows`, for q [B, S, Hq, D],
    k [B, S, Hkv, D], idx [Hp, B*S, topk]; fp32, mean over (batch, head, row)."""
    B, S, Hq, D = q.shape
    Hp = idx.shape[0]
    out = []
    for b in range(B):
        qr = q[b, rows].float()                                            # [R, Hq, D]
        kb = k[b].float().repeat_interleave(Hq // k.shape[2], dim=1)         # [S, Hq, D]
        x = torch.einsum("rhd,shd->hrs", qr, kb) * D ** -0.5               # [Hq, R, S]
        keys = torch.arange(S, device=q.device)
        x = x.masked_fill(keys[None, None, :] > rows[None, :, None], float("-inf"))
        P = x.softmax(-1)
        sel = idx[:, b * S + rows]                                           # [Hp, R, topk]
        nb = S // BLOCK
        blk_mask = torch.zeros(Hp, len(rows), nb + 1, dtype=torch.bool, device=q.device)  # column nb: empty slots
        blk_mask.scatter_(2, torch.where(sel >= 0, sel, nb).long(), True)
        kmask = blk_mask[:, :, keys // BLOCK].repeat_interleave(Hq // Hp, dim=0)  # [Hq, R, S]
        out.append((P * kmask).sum(-1).mean())
    return torch.stack(out).mean().item()


def set_recall(want: torch.Tensor, got: torch.Tensor) -> float:
    """Set recall of a selection `got` against `want` (both [Hp, total, K]): the share of each row's non-local
    selected blocks of `want` that `got` holds too, averaged over the rows that have any (the local block, always
    in both, is the last valid slot). bench/tools/fp8_selection_quality.py's set recall pools the blocks of all
    rows instead (the two differ only where rows hold different numbers of blocks)."""
    valid = want >= 0
    n = valid.sum(-1, keepdim=True)
    local = want.gather(-1, (n - 1).clamp(min=0))
    counted = valid & (want != local)
    hit = (want.unsqueeze(-1) == got.unsqueeze(-2)).any(-1) & counted
    rows = counted.sum(-1)
    has = rows > 0
    return float((hit.sum(-1)[has].double() / rows[has].double()).mean()) if bool(has.any()) else float("nan")


def union_stats(idx: torch.Tensor, B: int, S: int, topk: int) -> dict:
    """Union factor (distinct valid blocks of a 128-query tile / topk, mean over tiles and proxy
    heads) and blocks per tile of a selection idx [Hp, B*S, topk]."""
    Hp = idx.shape[0]
    x = idx.view(Hp, B, S // BLOCK, BLOCK * topk).cpu()
    distinct = []
    for row in x.reshape(-1, BLOCK * topk):
        v = row[row >= 0]
        distinct.append(len(torch.unique(v)))
    d = torch.tensor(distinct, dtype=torch.float64)
    return dict(union_factor=(d / topk).mean().item(), blocks_per_tile_mean=d.mean().item(),
                blocks_per_tile_max=d.max().item(), tiles=len(distinct))


def synthetic_union(a, device) -> dict:
    """The union factor of BENCHMARKS.md's patterns at the same shape (bench/user_path.py's draw)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    from user_path import make_inputs
    cfg = dict(Hq=a.heads, Hkv=a.kv_heads, Hp=a.proxy_heads, Hpk=1)
    res = {}
    for pattern in ("clustered", "random"):
        _, _, _, qp, kp, _ = make_inputs(cfg, a.seqlen, pattern, device, dtype=compute_dtype(a), seed=1)
        idx = flashmsa.msa_select(qp.detach()[None], kp.detach()[None], a.topk)
        res[pattern] = union_stats(idx, 1, a.seqlen, a.topk)
    return res


@torch.no_grad()
def causality_check(model, tok: torch.Tensor, a, device, seed: int = 7) -> float:
    """Does anything leak from the future? The model's logits on the first half of a window must
    not change when the second half's tokens do (the selection, the sparse and the dense attention
    are all causal). Returns the max |difference| of the first half's logits: 0 unless a later
    token reaches an earlier position (the half is a multiple of 128, so no query tile straddles
    it, and nothing else in the forward mixes positions)."""
    was_training = model.training
    model.eval()
    half = (tok.shape[1] // 2) // BLOCK * BLOCK
    other = tok.clone()
    g = torch.Generator().manual_seed(seed)
    other[:, half:] = torch.randint(0, 256, other[:, half:].shape, generator=g).to(tok.device)
    with torch.autocast(device.type, dtype=compute_dtype(a), enabled=a.dtype != "float32"):
        la, _ = model(tok)
        lb, _ = model(other)
    model.train(was_training)
    changed = (la[:, half:] != lb[:, half:]).float().mean().item()  # the second half must change
    if changed == 0:
        raise RuntimeError("causality check: the perturbed half did not change the logits")
    return (la[:, :half].float() - lb[:, :half].float()).abs().max().item()


def compute_dtype(a):
    return getattr(torch, a.dtype)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(model, batches, a, device, want_selection=False):
    """Validation loss (mean over the fixed batches); for MSA also kl (the forward's value in the
    model's current mode) and the selection's recall at sampled rows, averaged over the layers,
    and optionally the last batch's layer-0 selection."""
    losses, kls, other_kls, recalls, sel, proj = [], [], [], [], None, None
    inputs = []
    hooks = []
    if model.kind in MSA_KINDS:
        hooks = [b.attn.register_forward_pre_hook(lambda m, args: inputs.append(args[0])) for b in model.blocks]
    rows = torch.linspace(BLOCK, a.seqlen - 1, a.recall_rows, device=device).long().unique()
    for x, y in batches:
        inputs.clear()
        with torch.autocast(device.type, dtype=compute_dtype(a), enabled=a.dtype != "float32"):
            logits, kl = model(x)
            losses.append(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).item())
            if model.kind in MSA_KINDS:
                kls.append(float(kl))
                for li, (blk, h) in enumerate(zip(model.blocks, inputs)):
                    # the kl of the other set too (same layer input): over the causal set (warmup
                    # mode) and over the selected set (sparse mode), whichever mode is on
                    cur = blk.attn.warmup
                    blk.attn.warmup = not cur
                    other_kls.append(float(blk.attn(h)[1]))
                    blk.attn.warmup = cur
                    q, k, v, qp, kp = blk.attn.project(h)
                    idx = flashmsa.msa_select(qp, kp, a.topk)
                    recalls.append(sampled_recall(q, k, idx, rows))
                    if li == 0:
                        sel = idx
                        # the first sequence's projections (bench/tools/fp8_selection_quality.py --trained)
                        proj = {n: t[0].detach().to(torch.bfloat16).cpu() for n, t in (("q", q), ("k", k), ("qp", qp),
                                                                                      ("kp", kp))}
    for h in hooks:
        h.remove()
    r = dict(val_loss=sum(losses) / len(losses))
    if model.kind in MSA_KINDS:
        kl, other = sum(kls) / len(kls), sum(other_kls) / len(other_kls)
        warm = model.blocks[0].attn.warmup
        r.update(kl=kl, recall=sum(recalls) / len(recalls), kl_causal_set=kl if warm else other,
                 kl_selected_set=other if warm else kl)
    if want_selection:
        r["selection"] = sel
        r["projections"] = proj
    return r


def attention_share(model, a, device, step_s: float) -> float:
    """The attention layers' share of a training step: one layer's attention fwd + bwd on an
    input of the training shape, timed alone (median of 5) times the layer count, over the
    measured step time."""
    attn = model.blocks[0].attn
    x = torch.randn(a.batch, a.seqlen, a.dim, device=device, requires_grad=True)
    times = []
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=compute_dtype(a), enabled=a.dtype != "float32"):
            y, kl = attn(x)
            loss = y.float().square().mean() + (kl if kl is not None else 0.0)
        loss.backward()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[2] * a.layers / step_s


# ---- training --------------------------------------------------------------------------------
def train(kind, a, train_data, val_batches, init, device, log):
    torch.manual_seed(a.seed)
    model = LM(a, kind).to(device)
    own = model.state_dict()
    differ = set(own) ^ set(init)  # the dense model has no proxy projections, the joint one two more
    assert all(any(f".{p}_proj." in n for p in ("qp", "kp", "vp", "po")) for n in differ), differ
    missing, _ = model.load_state_dict({n: init[n] for n in own if n in init}, strict=False)
    assert all(".vp_proj." in n or ".po_proj." in n for n in missing), missing  # the joint run's own (po_proj: 0)
    opt = torch.optim.AdamW(proxy_param_groups(model, a.lr * a.proxy_lr_mult), lr=a.lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    warm = max(1, a.steps // 20)
    def lr_factor(s):  # linear warmup over 5% of the steps, then cosine to 0.1 (or constant)
        decay = 1.0 if a.lr_schedule == "constant" else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / a.steps)))
        return min(1.0, (s + 1) / warm) * decay
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    gen = torch.Generator().manual_seed(a.seed + 1)  # the same batches, in the same order, for both runs
    hist, train_s, train_kl = [], 0.0, []
    phase_s = {"warmup": 0.0, "sparse": 0.0}  # by step index, for both runs: like against like
    for step in range(a.steps + 1):
        sparse = step >= a.warmup_steps
        if kind in MSA_KINDS:
            set_warmup(model, not sparse)
        if step % a.eval_every == 0 or step == a.steps:
            model.eval()
            r = evaluate(model, val_batches, a, device)
            model.train()
            r.update(step=step, mode=("sparse" if sparse else "dense") if kind in MSA_KINDS else "dense-sdpa",
                     train_kl=(sum(train_kl) / len(train_kl)) if train_kl else None,
                     train_s=train_s)
            train_kl = []
            hist.append(r)
            extra = (f"  kl {r['kl']:.4f} (causal set {r['kl_causal_set']:.4f}, selected set "
                     f"{r['kl_selected_set']:.4f})  recall {r['recall']:.4f}" if kind in MSA_KINDS else "")
            log(f"[{kind:5s}] step {step:5d} {r['mode']:>10}  val loss {r['val_loss']:.4f}{extra}  "
                f"({train_s:.1f} s training)")
        if step == a.steps:
            break
        x, y = (t.to(device) for t in windows(train_data, a.batch, a.seqlen, gen))
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=compute_dtype(a), enabled=a.dtype != "float32"):
            logits, kl = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        (loss + kl if kl is not None else loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        sync(device)
        dt = time.perf_counter() - t0
        train_s += dt
        phase_s["sparse" if sparse else "warmup"] += dt
        if kind in MSA_KINDS:
            train_kl.append(last_kl(model).item())  # the backward filled it in
    return model, hist, train_s, phase_s


def plot(runs, a, path: pathlib.Path, kl_title: str = "proxy kl (validation)") -> pathlib.Path:
    """Validation loss of both runs in one panel, kl and recall of the MSA run in two more
    (without matplotlib: a small built-in PNG writer, MSA blue, dense orange)."""
    msa, dense = runs["msa"]["curve"], runs["dense"]["curve"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the three-panel PNG writer of the other example
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        from train_long_context import _tiny_png
        series = [("loss", [h["val_loss"] for h in msa], [[h["val_loss"] for h in dense]]),  # dense: orange
                  ("kl", [h["kl"] for h in msa]), ("recall", [h["recall"] for h in msa])]
        return _tiny_png([h["step"] for h in msa], series, a.warmup_steps, path)
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    ax[0].plot([h["step"] for h in dense], [h["val_loss"] for h in dense], marker=".", label="dense (SDPA)")
    ax[0].plot([h["step"] for h in msa], [h["val_loss"] for h in msa], marker=".", label=f"MSA (topk {a.topk})")
    ax[0].set_title("validation loss (nats/byte)", fontsize=10)
    ax[0].legend()
    ax[1].plot([h["step"] for h in msa], [h["kl"] for h in msa], marker=".")
    ax[1].set_title(kl_title, fontsize=10)
    ax[2].plot([h["step"] for h in msa], [h["recall"] for h in msa], marker=".")
    if "joint" in runs:  # the jointly trained indexer, green
        jc = runs["joint"]["curve"]
        steps = [h["step"] for h in jc]
        ax[0].plot(steps, [h["val_loss"] for h in jc], marker=".", label="MSA, joint indexer")
        ax[0].legend()
        ax[1].plot(steps, [h["kl"] for h in jc], marker=".", color="C2")
        ax[2].plot(steps, [h["recall"] for h in jc], marker=".", color="C2")
    ax[2].set_title("attention-mass recall of the selection", fontsize=10)
    ax[2].set_ylim(0, 1.02)
    for x in ax:
        x.axvline(a.warmup_steps, color="gray", ls="--", lw=1)
        x.set_xlabel("step")
        x.grid(alpha=0.3)
    fig.suptitle(f"byte LM on the Python {platform.python_version()} stdlib: {a.layers} layers, seqlen {a.seqlen}, "
                 f"heads {a.heads}/{a.kv_heads}/{a.proxy_heads}/1, head dim {a.head_dim}; dense warmup "
                 f"{a.warmup_steps} steps", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    for k, v in PRESETS["cpu"].items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v), default=None,
                       help=f"(cpu preset: {v}; h200 preset: {PRESETS['h200'][k]})")
    p.add_argument("--lr-schedule", choices=["cosine", "constant"], default="cosine",
                   help="after a linear warmup over 5%% of the steps: cosine decay to 0.1x, or constant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--joint", action="store_true",
                   help="a third run: MSA with the jointly trained indexer (MSAttention(proxy_output=True)), same "
                        "initial weights and batches")
    p.add_argument("--out", default=None, help="directory for the JSON, CSV, PNG and the saved selection")
    a = p.parse_args(argv)
    for k, v in PRESETS[a.preset].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.seqlen % BLOCK or a.seqlen < 2 * BLOCK:
        p.error(f"--seqlen must be a multiple of {BLOCK} and at least {2 * BLOCK}, got {a.seqlen}")
    if not 0 <= a.warmup_steps <= a.steps:
        p.error(f"--warmup-steps must be in [0, --steps], got {a.warmup_steps}")
    device = torch.device(a.device)
    out = pathlib.Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(msg, flush=True)

    t_start = time.time()
    train_data, val_data, corpus = load_corpus(a.seed)
    log(f"corpus: Python {corpus['python']} stdlib ({corpus['stdlib']}): {corpus['files']} files, "
        f"train {corpus['train_files']} files / {corpus['train_bytes'] / 1e6:.1f} MB, "
        f"validation {corpus['val_files']} files / {corpus['val_bytes'] / 1e6:.2f} MB")
    sparsity = a.topk * BLOCK / a.seqlen
    log(f"model: {a.layers} layers, dim {a.dim}, heads {a.heads}/{a.kv_heads}/{a.proxy_heads}/1, head dim "
        f"{a.head_dim}, seqlen {a.seqlen} ({a.seqlen // BLOCK} blocks), topk {a.topk} ({sparsity:.0%} of the "
        f"blocks), batch {a.batch}, {a.steps} steps (MSA: dense warmup {a.warmup_steps}), {a.dtype} on {device}")
    vgen = torch.Generator().manual_seed(a.seed + 2)
    val_batches = [tuple(t.to(device) for t in windows(val_data, a.batch, a.seqlen, vgen)) for _ in range(a.eval_batches)]
    torch.manual_seed(a.seed)
    init = {k: v.clone() for k, v in LM(a, "msa").state_dict().items()}

    runs = {}
    kinds = ("msa", "dense") + (("joint",) if a.joint else ())
    for kind in kinds:
        model, curve, train_s, phase_s = train(kind, a, train_data, val_batches, init, device, log)
        step_s = train_s / a.steps
        n_sparse = a.steps - a.warmup_steps
        runs[kind] = dict(curve=curve, train_s=train_s, step_ms=1e3 * step_s,
                          step_ms_warmup_phase=1e3 * phase_s["warmup"] / a.warmup_steps if a.warmup_steps else None,
                          step_ms_sparse_phase=1e3 * phase_s["sparse"] / n_sparse if n_sparse else None,
                          tokens_per_s=a.batch * a.seqlen / step_s,
                          attention_share=attention_share(model, a, device, step_s),
                          causality_max_abs_diff=causality_check(model, val_batches[0][0], a, device))
        if kind == "msa":
            final = evaluate(model, val_batches, a, device, want_selection=True)
            sel, proj = final.pop("selection"), final.pop("projections")
            runs[kind]["trained_selection"] = union_stats(sel, a.batch, a.seqlen, a.topk)
            if out:
                torch.save(sel[:, :a.seqlen].to(torch.int16).cpu(), out / "selection_layer0_seq0.pt")
                if proj is not None:
                    torch.save(dict(proj, topk=a.topk), out / "proxy_inputs_layer0_seq0.pt")
        r = runs[kind]
        phases = (f" (steps {a.warmup_steps}+: {r['step_ms_sparse_phase']:.1f} ms)" if r["step_ms_sparse_phase"] else "")
        log(f"[{kind:5s}] {r['step_ms']:.1f} ms/step{phases}, {r['tokens_per_s']:.0f} tokens/s, "
            f"attention {r['attention_share']:.0%} of the step; first-half logits change by "
            f"{r['causality_max_abs_diff']:.3g} when the second half's tokens change (0: causal)")
    msa, dense = runs["msa"], runs["dense"]
    gap = msa["curve"][-1]["val_loss"] / dense["curve"][-1]["val_loss"] - 1
    sparse_kl = [h["kl"] for h in msa["curve"] if h["mode"] == "sparse"]
    summary = dict(
        final_val_loss_msa=msa["curve"][-1]["val_loss"], final_val_loss_dense=dense["curve"][-1]["val_loss"],
        gap=gap, step_time_ratio_msa_over_dense=msa["step_ms"] / dense["step_ms"],
        # the sparse phase alone (MSA sparse steps vs the dense run's same steps)
        step_time_ratio_sparse_phase=(msa["step_ms_sparse_phase"] / dense["step_ms_sparse_phase"]
                                      if msa["step_ms_sparse_phase"] else None),
        kl_first_sparse=sparse_kl[0] if sparse_kl else None, kl_last=sparse_kl[-1] if sparse_kl else None,
        recall_last=msa["curve"][-1]["recall"], trained_selection=msa["trained_selection"],
        synthetic_patterns=synthetic_union(a, device))
    if "joint" in runs:  # the jointly trained indexer against the kl-only MSA run and dense
        jc = runs["joint"]["curve"]
        summary.update(final_val_loss_joint=jc[-1]["val_loss"], gap_joint=jc[-1]["val_loss"] / dense["curve"][-1]["val_loss"] - 1,
                       joint_vs_msa=jc[-1]["val_loss"] / msa["curve"][-1]["val_loss"] - 1, kl_last_joint=jc[-1]["kl"],
                       recall_last_joint=jc[-1]["recall"],
                       step_time_ratio_joint_over_msa=runs["joint"]["step_ms"] / msa["step_ms"])
        log(f"joint indexer: final validation loss {summary['final_val_loss_joint']:.4f} ({summary['joint_vs_msa']:+.2%} "
            f"vs MSA, {summary['gap_joint']:+.2%} vs dense), kl {jc[-1]['kl']:.4f}, recall {jc[-1]['recall']:.4f}, "
            f"step {summary['step_time_ratio_joint_over_msa']:.2f}x MSA's")
    log(f"final validation loss: MSA {summary['final_val_loss_msa']:.4f}, dense {summary['final_val_loss_dense']:.4f} "
        f"(gap {gap:+.2%}); MSA step / dense step {summary['step_time_ratio_msa_over_dense']:.2f} (sparse phase "
        f"{summary['step_time_ratio_sparse_phase'] or float('nan'):.2f}); kl after the "
        f"switch {summary['kl_first_sparse']} -> {summary['kl_last']}; recall {summary['recall_last']:.4f}")
    ts, syn = summary["trained_selection"], summary["synthetic_patterns"]
    log(f"union factor of 128-query tiles: trained indexer {ts['union_factor']:.2f} (blocks per tile "
        f"{ts['blocks_per_tile_mean']:.1f}), synthetic clustered {syn['clustered']['union_factor']:.2f}, "
        f"random {syn['random']['union_factor']:.2f}")
    result = dict(command="python3 examples/lm_long_context.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  date=time.strftime("%Y-%m-%d"), device=(torch.cuda.get_device_name(device) if device.type == "cuda"
                                                          else platform.processor() or "cpu"),
                  torch=torch.__version__, flashmsa=flashmsa.version(), corpus=corpus, config=vars(a),
                  summary=summary, runs=runs, wall_s=time.time() - t_start)
    if out:
        (out / "lm_long_context.json").write_text(json.dumps(result, indent=1))
        with open(out / "lm_long_context.csv", "w") as f:
            f.write("run,step,mode,val_loss,kl,kl_causal_set,kl_selected_set,recall,train_kl\n")
            for kind in kinds:
                for h in runs[kind]["curve"]:
                    f.write(f"{kind},{h['step']},{h['mode']},{h['val_loss']},{h.get('kl', '')},"
                            f"{h.get('kl_causal_set', '')},{h.get('kl_selected_set', '')},{h.get('recall', '')},"
                            f"{'' if h['train_kl'] is None else h['train_kl']}\n")
        png = plot(runs, a, out / "lm_long_context.png")
        log(f"wrote {out / 'lm_long_context.json'}, .csv and {png}")
    return result


if __name__ == "__main__":
    main()
