"""What the fp8 (e4m3) proxy selection changes, emulated in torch (any device; the scale groups can be varied).

qp and kp are quantised as an fp8 selection kernel would read them (e4m3, one fp32 scale per token and head:
amax / 448, DeepGEMM's fp8_mqa_logits convention), dequantised, and the selection of SPEC section 1 runs on
both the bf16 and the fp8 values. Reported per input set:
  set recall    |I_fp8 ∩ I_bf16| / |I_bf16| over the rows' selected blocks (the local block, always in both,
                excluded), and the share of rows whose set is unchanged;
  mass recall   the share of the main attention's dense causal softmax mass inside the selected keys, at
                sampled rows, for the bf16 and the fp8 selections (the loss that matters: a block swapped for
                one of equal mass costs nothing).
Inputs: BENCHMARKS.md's synthetic patterns (bench/user_path.make_inputs: clustered, random) at --seqlen, and the
trained indexer's layer-0 projections that examples/lm_long_context.py saves with --out
(proxy_inputs_layer0_seq0.pt), via --trained FILE.

    python3 bench/tools/fp8_selection_quality.py --seqlen 8192 --config m3 [--trained DIR/proxy_inputs_layer0_seq0.pt]

The selection here is a chunked torch version of the reference (fp32 logits, block max, top-k with the lower id
winning ties, the local block forced); --check compares it with flashmsa.msa_select at a small length first.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
BLOCK = 128
E4M3_MAX = 448.0
CONFIGS = {"m3": dict(Hq=64, Hkv=4, Hp=4, Hpk=1), "fmsa": dict(Hq=16, Hkv=2, Hp=4, Hpk=1)}  # bench/run_bench.py's


def fp8_roundtrip(x: torch.Tensor, group: str = "token") -> torch.Tensor:
    """x [T, H, D] -> e4m3 with one scale amax / 448 per group, back to fp32. group: "token" (per token and head,
    DeepGEMM's fp8_mqa_logits), "block" (per 128-token key block and head: a kernel multiplies the block's max logit by
    it once, instead of every logit by its token's scale), "head" (one per head over the whole sequence)."""
    x = x.float()
    T = x.shape[0]
    if group == "token":
        amax = x.abs().amax(-1, keepdim=True)
    elif group == "block":
        nb = (T + BLOCK - 1) // BLOCK
        xp = torch.nn.functional.pad(x.abs(), (0, 0, 0, 0, 0, nb * BLOCK - T))
        amax = xp.view(nb, BLOCK, *x.shape[1:]).amax(dim=(1, 3)).repeat_interleave(BLOCK, 0)[:T, :, None]
    elif group == "head":
        amax = x.abs().amax(dim=(0, 2), keepdim=True)
    else:
        raise ValueError(f"group: expected token, block or head, got {group!r}")
    scale = amax.clamp_min(1e-12) / E4M3_MAX
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def select(qp: torch.Tensor, kp: torch.Tensor, topk: int, chunk: int = 1024) -> torch.Tensor:
    """The selection of one sequence (qp [T, Hp, D], kp [T, Hpk, D]) -> sets [Hp, T, topk] int64, -1 padded:
    slots in ascending block id (a set, not MiniMax's slot order)."""
    T, Hp, D = qp.shape
    Hpk = kp.shape[1]
    nb = (T + BLOCK - 1) // BLOCK
    scale = D ** -0.5
    out = torch.full((Hp, T, topk), -1, dtype=torch.long)
    pos = torch.arange(T)
    for p in range(Hp):
        kk = kp[:, p // (Hp // Hpk)].float()
        for c0 in range(0, T, chunk):
            rows = pos[c0:c0 + chunk]
            z = (qp[c0:c0 + chunk, p].float() @ kk.T) * scale                    # [R, T]
            z = z.masked_fill(pos[None, :] > rows[:, None], float("-inf"))
            pad = nb * BLOCK - T
            zb = torch.nn.functional.pad(z, (0, pad), value=float("-inf")).view(len(rows), nb, BLOCK).amax(-1)
            own = rows // BLOCK
            zb = zb.masked_fill(torch.arange(nb)[None, :] >= own[:, None], float("-inf"))   # non-local blocks only
            # top-(topk - 1) by score, the lower id first on ties: sort by (-score, id)
            key = torch.where(torch.isfinite(zb), zb, torch.full_like(zb, -3e38))
            order = torch.argsort(-key, dim=1, stable=True)  # descending, ties in ascending block id
            n_non = torch.clamp(own, max=topk - 1)                                 # non-local slots used
            for i, r in enumerate(rows.tolist()):
                k = int(n_non[i])
                sel = sorted(order[i, :k].tolist()) + [int(own[i])]
                out[p, r, :len(sel)] = torch.tensor(sel)
    return out


def set_recall(a: torch.Tensor, b: torch.Tensor) -> dict:
    """b is the bf16 reference. Local blocks excluded (the last valid slot is the row's own block). Pooled over all
    rows' blocks (examples/lm_long_context.set_recall, which the GPU reports use, averages per row)."""
    hit = tot = same = rows = 0
    Hp, T, _ = a.shape
    for p in range(Hp):
        for t in range(T):
            own = t // BLOCK
            sa = {x for x in a[p, t].tolist() if x >= 0 and x != own}
            sb = {x for x in b[p, t].tolist() if x >= 0 and x != own}
            hit += len(sa & sb)
            tot += len(sb)
            same += sa == sb
            rows += 1
    return dict(set_recall=hit / tot if tot else 1.0, rows_unchanged=same / rows)


def mass_recall(q, k, sets, rows, Hp) -> float:
    """Dense causal softmax mass of the main heads inside the selected blocks, mean over (head, row)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    vals = []
    for h in range(Hq):
        kk = k[:, h // (Hq // Hkv)].float()
        p = h // (Hq // Hp)
        for r in rows:
            x = (q[r, h].float() @ kk[:r + 1].T) * D ** -0.5
            P = x.softmax(-1)
            blocks = [j for j in sets[p, r].tolist() if j >= 0]
            m = torch.zeros(r + 1, dtype=torch.bool)
            for j in blocks:
                m[j * BLOCK:min((j + 1) * BLOCK, r + 1)] = True
            vals.append(float(P[m].sum()))
    return sum(vals) / len(vals)


def measure(name, q, k, qp, kp, topk, n_rows, seed=0, kp_scales=("token",)) -> dict:
    T = qp.shape[0]
    Hp = qp.shape[1]
    ref = select(qp.float(), kp.float(), topk)
    g = torch.Generator().manual_seed(seed)
    rows = sorted(set(torch.randint(BLOCK * topk, T, (n_rows,), generator=g).tolist())) if T > BLOCK * topk else []
    r = dict(inputs=name, tokens=T, topk=topk)
    if rows and q is not None:
        r["mass_recall_bf16"] = mass_recall(q, k, ref, rows, Hp)
    for group in kp_scales:  # qp: one scale per token (a row's factor does not change its ranking)
        f8 = select(fp8_roundtrip(qp), fp8_roundtrip(kp, group), topk)
        sr = set_recall(f8, ref)
        sfx = "" if group == "token" else f"_kp_{group}"
        r.update({k + sfx: v for k, v in sr.items()})
        if rows and q is not None:
            r["mass_recall_fp8" + sfx] = mass_recall(q, k, f8, rows, Hp)
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--config", choices=("m3", "fmsa"), default="m3")
    ap.add_argument("--patterns", default="clustered,random")
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--rows", type=int, default=16, help="sampled rows of the mass recall")
    ap.add_argument("--trained", default=None, help="proxy_inputs_layer0_seq0.pt of examples/lm_long_context.py")
    ap.add_argument("--check", action="store_true", help="first compare this selection with flashmsa.msa_select")
    ap.add_argument("--kp-scales", default="token",
                    help="kp's scale groups to compare, of token,block,head (keys of a group other than token get a "
                         "_kp_<group> suffix)")
    a = ap.parse_args(argv)
    import user_path as U
    cfg = CONFIGS[a.config]
    if a.check:
        flashmsa = U.import_flashmsa()
        q, k, v, qp, kp, cu = U.make_inputs(cfg, 1000, "clustered", "cpu", dtype=torch.float32, seed=3)
        want = flashmsa.msa_select(qp.detach(), kp.detach(), a.topk, cu_seqlens=cu).long()
        got = select(qp.detach(), kp.detach(), a.topk)
        same = all(set(want[p, t].tolist()) == set(got[p, t].tolist()) for p in range(want.shape[0]) for t in range(1000))
        print(f"check against flashmsa.msa_select at 1000 tokens: {'equal sets' if same else 'DIFFERENT'}")
        if not same:
            return 1
    scales = [x for x in a.kp_scales.split(",") if x]
    res = []
    for pattern in [x for x in a.patterns.split(",") if x]:
        q, k, v, qp, kp, cu = U.make_inputs(cfg, a.seqlen, pattern, "cpu", dtype=torch.bfloat16, seed=0)
        res.append(measure(f"{a.config} {pattern}", q.detach(), k.detach(), qp.detach(), kp.detach(), a.topk, a.rows,
                           kp_scales=scales))
        print(json.dumps(res[-1]), flush=True)
    if a.trained:
        d = torch.load(a.trained)
        topk = int(d.get("topk", a.topk))
        res.append(measure("trained (examples/lm_long_context.py)", d["q"], d["k"], d["qp"], d["kp"], topk, a.rows,
                           kp_scales=scales))
        print(json.dumps(res[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
