#!/usr/bin/env python3
"""Train a small transformer whose attention is flashmsa.nn.MSAttention on associative recall
across a long sequence: key/value pairs lie far back (outside the query's own 128-token block),
the last tokens ask for the values of some keys. Dense warmup first (the proxy learns to imitate
the attention through the kl term), then sparse: every query token keeps only topk blocks.

Prints, every --eval-every steps: loss, answer accuracy, kl (the library's value, a mean over every
row; then split, on the first evaluation sequence, into the query rows the loss sees and the filler
rows it does not constrain), and the selection's attention-mass recall at the query tokens (share of the dense attention mass inside the blocks the proxy would
select), and plots them (PNG: matplotlib if present, else a tiny built-in PNG writer).

    python3 examples/train_long_context.py                   # CPU, a few minutes
    python3 examples/train_long_context.py --gpu             # larger: head_dim 128, 8k tokens
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import pathlib
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

try:
    import flashmsa
except ImportError:  # run from a checkout
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))
    import flashmsa
from flashmsa.nn import MSAttention, proxy_param_groups, set_warmup
from flashmsa.reference import attention_mass_recall

PRESETS = {
    # tiny CPU run: 4 blocks of 128 tokens, top-2 blocks (own + one chosen)
    "cpu": dict(seqlen=512, start_seqlen=0, batch=8, dim=64, heads=4, kv_heads=2, proxy_heads=2, head_dim=16, layers=2,
                topk=2, pairs=4, keys=16, values=16, queries=32, steps=500, warmup_steps=250, lr=3e-3,
                eval_every=25, dtype="float32"),
    # GPU: the CPU preset's task 16x longer; D = Dp = 128 (what the CUDA kernels instantiate), 64
    # blocks, top-8. A length curriculum in the dense warmup (1024 -> 2048 -> 4096 -> 8192
    # tokens): trained at 8192 tokens from the start, the model stayed at chance for 1500 steps
    # on the H200 (examples/results/gpu/README.md), as the memory tokens get 1/8192 of the
    # attention at first; at 1024 tokens it learns the task in ~75 steps.
    "gpu": dict(seqlen=8192, start_seqlen=1024, batch=8, dim=512, heads=8, kv_heads=2, proxy_heads=2, head_dim=128, layers=2,
                topk=8, pairs=4, keys=16, values=16, queries=32, steps=1500, warmup_steps=500, lr=1e-3,
                eval_every=50, dtype="bfloat16"),
}


# ---- the task --------------------------------------------------------------------------------
class Recall:
    """Associative recall. Token ids: filler [0, F), keys [F, F+K). A memory token is a key that
    also carries a value (a second id in [0, V), embedded and added like a segment embedding;
    other tokens carry the "no value" id V). The last `queries` tokens are keys again, whose
    answer is the value stored with that key far back (before the last 128-token block)."""

    def __init__(self, seqlen: int, pairs: int, queries: int, n_filler=1, n_keys=16, n_values=16):
        assert seqlen >= 256 and pairs <= seqlen - 128 and pairs <= n_keys
        self.S, self.P, self.Q = seqlen, pairs, queries
        self.F, self.K, self.V = n_filler, n_keys, n_values
        self.vocab = n_filler + n_keys

    def batch(self, B: int, gen: torch.Generator):
        """(tokens [B, S], values [B, S], targets [B, S]: the answer at the queries, else -100)."""
        S, P, Q = self.S, self.P, self.Q
        tok = torch.randint(0, self.F, (B, S), generator=gen)
        val = torch.full((B, S), self.V)
        tgt = torch.full((B, S), -100)
        for b in range(B):
            keys = torch.randperm(self.K, generator=gen)[:P]
            vals = torch.randint(0, self.V, (P,), generator=gen)
            where = torch.randperm(S - 128, generator=gen)[:P]  # memories: outside the last block
            tok[b, where], val[b, where] = self.F + keys, vals
            ask = torch.randint(0, P, (Q,), generator=gen)
            tok[b, S - Q:], tgt[b, S - Q:] = self.F + keys[ask], vals[ask]
        return tok, val, tgt


# ---- the model -------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(a.dim), nn.LayerNorm(a.dim)
        self.attn = MSAttention(a.dim, a.heads, a.kv_heads, a.proxy_heads, 1, head_dim=a.head_dim,
                                topk=a.topk, kl_coef=a.kl_coef, backend=a.backend)
        self.mlp = nn.Sequential(nn.Linear(a.dim, 4 * a.dim), nn.GELU(), nn.Linear(4 * a.dim, a.dim))

    def forward(self, x):
        y, kl = self.attn(self.ln1(x))
        x = x + y
        return x + self.mlp(self.ln2(x)), kl


class Model(nn.Module):
    def __init__(self, a, task):
        super().__init__()
        self.emb = nn.Embedding(task.vocab, a.dim)
        self.val_emb = nn.Embedding(task.V + 1, a.dim)
        self.blocks = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.ln = nn.LayerNorm(a.dim)
        self.head = nn.Linear(a.dim, task.V)
        # bf16/fp16 runs keep fp32 weights (AdamW's updates would round away in bf16 weights) and
        # compute under autocast: the projections, hence q, k, v, qp, kp, come out in that dtype
        self.compute_dtype = getattr(torch, a.dtype)

    def autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.emb.weight.device.type, dtype=self.compute_dtype)

    def forward(self, tok, val):
        x, kl = self.emb(tok) + self.val_emb(val), 0.0
        for blk in self.blocks:
            x, k = blk(x)
            kl = kl + k
        return self.head(self.ln(x)), kl / len(self.blocks)


# ---- evaluation ------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, tok, val, tgt, topk):
    """(loss, accuracy, kl, recall, recall per layer, (kl at the query rows, kl at the filler rows)): recall is the attention-mass recall of the selection at the
    query tokens, averaged over the layers; the selection is msa_select on each layer's proxy."""
    with model.autocast():
        return _evaluate(model, tok, val, tgt, topk)


def _evaluate(model, tok, val, tgt, topk):
    inputs = []
    hooks = [b.attn.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for b in model.blocks]
    logits, kl = model(tok, val)
    for h in hooks:
        h.remove()
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())
    ask = tgt != -100
    acc = (logits.argmax(-1)[ask] == tgt[ask]).float().mean()
    recalls, split = [], []
    for blk, x in zip(model.blocks, inputs):
        proj = blk.attn.project(x)
        q, k, v, qp, kp = proj
        idx = flashmsa.msa_select(qp, kp, topk)
        recalls.append(attention_mass_recall(q, k, idx, rows=ask.flatten()).item())
        split.append(kl_split(blk.attn, [t[0] for t in proj], ask[0]))
    kl_rows = (sum(a for a, _ in split) / len(split), sum(b for _, b in split) / len(split))
    kl = float(kl) / model.blocks[0].attn.kl_coef
    if math.isnan(kl) and tok.device.type == "cuda":  # NaN: the backend declined the value
        for b in model.blocks:
            b.attn.backend = "reference"
        kl = float(model(tok[:1], val[:1])[1]) / model.blocks[0].attn.kl_coef
        for b in model.blocks:
            b.attn.backend = "flashmsa"
    return loss.item(), acc.item(), kl, sum(recalls) / len(recalls), recalls, kl_rows


def kl_split(attn, proj, rows):
    """The kl of one sequence (proj: its (q, k, v, qp, kp) from attn.project, [S, H, D]) split by
    rows: (mean kl at the rows where rows [S] is
    True, i.e. the query tokens the loss sees; mean kl at the other rows, the filler the loss does
    not constrain). Same definition as the library's value (teacher: the mean of the group's main
    attention; student: the proxy's softmax; both over the set the mode trains on: the causal set
    in the warmup, the selected blocks after it), computed here in fp32 one proxy head at a time."""
    with torch.autocast(proj[0].device.type, enabled=False):
        return _kl_split(attn, proj, rows)


def _kl_split(attn, proj, rows):
    dt = proj[3].dtype
    q, k, _, qp, kp = (t.float() for t in proj)  # [S, H, D]
    S, Hq, D = q.shape
    Hp, Hkv, Hpk = qp.shape[1], k.shape[1], kp.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    if not attn.warmup:
        idx = flashmsa.msa_select(qp[None].to(dt), kp[None].to(dt), attn.topk).long()  # [Hp, S, topk], -1 pads
        nb = (S + 127) // 128
        chosen = torch.zeros(Hp, S, nb + 1, dtype=torch.bool, device=q.device)
        chosen.scatter_(2, torch.where(idx < 0, nb, idx), True)
        blk = torch.arange(S, device=q.device) // 128
    total = torch.zeros(S, device=q.device)
    for h in range(Hp):
        mask = causal if attn.warmup else causal & chosen[h, :, :nb][:, blk]
        t = 0
        for g in range(h * (Hq // Hp), (h + 1) * (Hq // Hp)):
            s = (q[:, g] @ k[:, g // (Hq // Hkv)].T) * D ** -0.5
            t = t + torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
        t = t / (Hq // Hp)
        z = (qp[:, h] @ kp[:, h // (Hp // Hpk)].T) * qp.shape[-1] ** -0.5
        log_s = torch.log_softmax(z.masked_fill(~mask, float("-inf")), -1)
        total += torch.where(t != 0, t * (t.clamp_min(1e-30).log() - log_s), torch.zeros_like(t)).sum(-1)
    per_row = total / Hp
    return per_row[rows].mean().item(), per_row[~rows].mean().item()


# ---- plotting --------------------------------------------------------------------------------
def plot(hist, warmup_steps, path: pathlib.Path, title: str):
    steps = [h["step"] for h in hist]
    series = [("loss", [h["loss"] for h in hist]), ("kl", [h["kl"] for h in hist]),
              ("recall", [h["recall"] for h in hist])]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _tiny_png(steps, series, warmup_steps, path)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, (name, ys) in zip(axes, series):
        ax.plot(steps, ys, marker=".")
        ax.axvline(warmup_steps, color="gray", ls="--", lw=1)
        ax.set_title(name + (" (attention mass at the queries)" if name == "recall" else ""), fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[2].set_ylim(0, 1.02)
    axes[0].text(warmup_steps, axes[0].get_ylim()[1], " dense | sparse", va="top", fontsize=8, color="gray")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


_FONT = {  # 3x5 glyphs, rows top to bottom
    "L": "100100100100111", "O": "111101101101111", "S": "111100111001111", "K": "101110100110101",
    "R": "110101110101101", "E": "111100110100111", "C": "111100100100111", "A": "010101111101101",
}


def _tiny_png(steps, series, warmup_steps, path: pathlib.Path):
    """Three line panels (loss, kl, recall) and a dashed line at the end of the warmup, written
    as a PNG with zlib alone. A series may be (name, ys, [more ys, ...]): the further lines (on
    the same steps) are drawn in orange in the same panel."""
    import struct
    import zlib

    W, H, pad = 900, 260, 20
    img = bytearray(b"\xff" * (W * H * 3))

    def px(x, y, c):
        if 0 <= x < W and 0 <= y < H:
            img[(y * W + x) * 3:(y * W + x) * 3 + 3] = bytes(c)

    def line(x0, y0, x1, y1, c):
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(n + 1):
            px(round(x0 + (x1 - x0) * i / n), round(y0 + (y1 - y0) * i / n), c)

    def text(x, y, s, c=(0, 0, 0), z=3):
        for ch in s:
            g = _FONT.get(ch.upper())
            if g:
                for r in range(5):
                    for col in range(3):
                        if g[r * 3 + col] == "1":
                            for dy in range(z):
                                for dx in range(z):
                                    px(x + col * z + dx, y + r * z + dy, c)
            x += 4 * z

    pw = (W - 4 * pad) // 3
    smin, smax = min(steps), max(max(steps), 1)
    for p, (name, ys, *more) in enumerate(series):
        more = more[0] if more else []
        every = list(ys) + [v for m in more for v in m]
        x0, y0, x1, y1 = pad + p * (pw + pad), pad + 25, pad + p * (pw + pad) + pw, H - pad
        lo, hi = (0.0, 1.0) if name == "recall" else (min(every + [0.0]), max(every) or 1.0)
        for a, b, c, d in ((x0, y0, x0, y1), (x0, y1, x1, y1)):
            line(a, b, c, d, (0, 0, 0))
        wx = x0 + round((warmup_steps - smin) / (smax - smin or 1) * (x1 - x0))
        for yy in range(y0, y1, 6):
            line(wx, yy, wx, min(yy + 3, y1), (150, 150, 150))
        for vals, color in [(m, (255, 127, 14)) for m in more] + [(ys, (31, 119, 180))]:
            pts = [(x0 + round((s - smin) / (smax - smin or 1) * (x1 - x0)),
                    y1 - round((v - lo) / (hi - lo or 1) * (y1 - y0))) for s, v in zip(steps, vals)]
            for (a, b), (c, d) in zip(pts, pts[1:]):
                line(a, b, c, d, color)
        text(x0 + 5, pad, name)
    raw = b"".join(b"\x00" + bytes(img[y * W * 3:(y + 1) * W * 3]) for y in range(H))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    path.write_bytes(png)
    return path


# ---- main ------------------------------------------------------------------------------------
def save(a, hist):
    """The JSON log and the PNG of the run so far, under a.out; returns the PNG's path."""
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_long_context.json").write_text(json.dumps(dict(args=vars(a), history=hist), indent=1))
    return plot(hist, a.warmup_steps, out / "train_long_context.png",
                f"associative recall, {a.seqlen} tokens, top-{a.topk} of {a.seqlen // 128} blocks "
                f"(dense warmup to step {a.warmup_steps})")


def train_seqlen(a, step: int) -> int:
    """The length curriculum: during the dense warmup the training sequences start at
    a.start_seqlen and double in equal stages up to a.seqlen (reached before the warmup ends);
    the sparse phase and every evaluation run at a.seqlen."""
    S, n = a.start_seqlen, 0
    while S * (2 ** n) < a.seqlen:
        n += 1
    if n == 0 or step >= a.warmup_steps:
        return a.seqlen
    stage = min(n, step * (n + 1) // a.warmup_steps)
    return min(a.seqlen, S * 2 ** stage)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="the larger preset, on CUDA")
    about = dict(start_seqlen="length curriculum: the warmup's training sequences start at this many "
                              "tokens and double up to --seqlen; 0: none ")
    for k, v in PRESETS["cpu"].items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v), default=None,
                       help=f"{about.get(k, '')}(cpu preset: {v}; gpu preset: {PRESETS['gpu'][k]})")
    p.add_argument("--kl-coef", type=float, default=1.0)
    p.add_argument("--proxy-lr-mult", type=float, default=1.0,
                   help="learning rate of the proxy projections (trained by the kl alone) over --lr; "
                        "5 made the kl fall in examples/lm_long_context.py (docs/lm_long_context.md), not in this "
                        "example's --gpu preset (examples/results/gpu/README.md)")
    p.add_argument("--backend", choices=["flashmsa", "reference"], default="flashmsa")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for the PNG and the JSON log (default: none)")
    a = p.parse_args(argv)
    preset = PRESETS["gpu" if a.gpu else "cpu"]
    given = {k for k in preset if getattr(a, k) is not None}
    for k, v in preset.items():
        if k not in given:
            setattr(a, k, v)
    device = torch.device(a.device or ("cuda" if a.gpu else "cpu"))
    torch.manual_seed(a.seed)
    if a.start_seqlen == 0 or ("start_seqlen" not in given and a.start_seqlen > a.seqlen):
        a.start_seqlen = a.seqlen  # no curriculum (or the preset's start is longer than --seqlen)
    if not 256 <= a.start_seqlen <= a.seqlen:
        p.error(f"--start-seqlen must be 0 (none) or in [256, --seqlen = {a.seqlen}], got {a.start_seqlen}")
    tasks = {}

    def task_of(S):
        if S not in tasks:
            tasks[S] = Recall(S, a.pairs, a.queries, n_keys=a.keys, n_values=a.values)
        return tasks[S]

    task = task_of(a.seqlen)
    model = Model(a, task).to(device=device)  # fp32 weights; a.dtype is the compute dtype
    opt = torch.optim.AdamW(proxy_param_groups(model, a.lr * a.proxy_lr_mult), lr=a.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    gen = torch.Generator().manual_seed(a.seed + 1)
    eval_batch = [t.to(device) for t in task.batch(a.batch, torch.Generator().manual_seed(12345))]
    print(f"flashmsa {flashmsa.version()} | {device} {a.dtype} | seqlen {a.seqlen} ({a.seqlen // 128} blocks), "
          f"topk {a.topk}, {a.pairs} pairs, {a.queries} queries, {a.layers} layers, dim {a.dim}, "
          f"heads {a.heads}/{a.kv_heads}/{a.proxy_heads}/1, head_dim {a.head_dim} | "
          f"dense warmup {a.warmup_steps} steps, then sparse | {sum(p.numel() for p in model.parameters())} params")
    if a.start_seqlen < a.seqlen:
        print(f"length curriculum in the warmup: training sequences of {a.start_seqlen} tokens doubling "
              f"to {a.seqlen}; evaluation always at {a.seqlen} tokens")
    print(f"{'step':>5} {'mode':>6} {'train S':>7} {'loss':>7} {'acc':>6} {'kl':>8} {'kl@query':>8} {'kl@fill':>8} {'recall':>7} {'per layer':>16} "
          f"{'s/step':>7}")
    hist, t0, last = [], time.time(), time.time()
    for step in range(a.steps + 1):
        sparse = step >= a.warmup_steps
        S = train_seqlen(a, step)
        set_warmup(model, not sparse)
        if step % a.eval_every == 0 or step == a.steps:
            model.eval()
            loss, acc, kl, rec, per, (kl_q, kl_f) = evaluate(model, *eval_batch, a.topk)
            model.train()
            dt = (time.time() - last) / max(1, a.eval_every if step else 1)
            last = time.time()
            hist.append(dict(step=step, mode="sparse" if sparse else "dense", train_seqlen=S, loss=loss,
                             acc=acc, kl=kl, kl_query_rows=kl_q, kl_filler_rows=kl_f, recall=rec,
                             recall_per_layer=per))
            print(f"{step:5d} {hist[-1]['mode']:>6} {S:7d} {loss:7.4f} {acc:6.3f} {kl:8.5f} {kl_q:8.5f} {kl_f:8.5f} "
                  f"{rec:7.4f} "
                  f"{' '.join(f'{r:.3f}' for r in per):>16} {dt:7.3f}", flush=True)
            if a.out:  # kept up to date, so a run cut short still leaves its curves
                save(a, hist)
        if step == a.steps:
            break
        tok, val, tgt = (t.to(device) for t in task_of(S).batch(a.batch, gen))
        with model.autocast():
            logits, kl = model(tok, val)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())
        opt.zero_grad(set_to_none=True)
        try:
            (loss + kl).backward()
        except NotImplementedError as e:  # e.g. a CUDA build without the backward yet
            sys.exit(f"training needs flashmsa's backward on {device}: {e}")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    print(f"done in {time.time() - t0:.0f} s")
    if a.out:
        png = save(a, hist)
        print(f"wrote {png} and {pathlib.Path(a.out) / 'train_long_context.json'}")
    return hist


if __name__ == "__main__":
    main()
