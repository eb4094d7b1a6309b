"""The trained-like selection pattern (bench/user_path.trained_like_proxy) against a trained indexer's selection.

Statistics of the selection (SPEC section 1: fp32 proxy logits, block max, top-k with the local block in), computed
on the 128-query tiles from block 40 on (at 16k: 88 tiles, each with at least 40 causal blocks; --tiles N: N tiles
spread over them):
  union128     distinct blocks a 128-query tile selects / topk (BENCHMARKS.md's union factor; on the tiles sampled)
  union4/16    the same over 4 and 16 consecutive tokens: the forward's 64-row tile in m3 (4 tokens x 16 heads) and
               fmsa (16 tokens x 4 heads), what its work follows
  rel          quantiles (10/25/50/75/90%) of a non-local block's distance back / the query's block
  d1           share of non-local blocks that are the previous block
  next, 16     share of a token's blocks that the next token (the token 16 later) also selects
  run          mean length of runs of adjacent blocks in a token's set
  heads        share of a token's blocks that proxy head 1 shares with head 0
TARGET holds these for the layer-0 selection of examples/lm_long_context.py's trained indexer (H200, 1000 steps,
16 heads, 4 proxy heads, 1 proxy key head, 16k tokens, topk 16; the file selection_layer0_seq0.pt the example
writes to --out; git keeps the H200 run's copy at commit 54fd084, examples/results/lm_long_context/h200-1000steps/),
measured with --selection on that file.

    python3 bench/tools/trained_pattern.py                       # 16k: trained-like, random, clustered vs TARGET
    python3 bench/tools/trained_pattern.py --seqlen 131072 --tiles 12   # how the patterns differ at 128k
    python3 bench/tools/trained_pattern.py --selection FILE      # a saved selection [Hp, S, topk]
    python3 bench/tools/trained_pattern.py --check               # exit 1 when trained-like misses TARGET's bounds
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import user_path  # noqa: E402

BLOCK, TOPK = 128, 16
LM = dict(Hq=16, Hkv=4, Hp=4, Hpk=1, topk=TOPK)  # the LM example's heads
TARGET = dict(union128=5.164, union4=2.290, union16=3.982, rel=[0.039, 0.111, 0.287, 0.568, 0.830], d1=0.043,
              next=0.453, d16=0.359, run=1.544, heads=0.361)
# --check: |trained-like - TARGET| within these (rel: each quantile)
BOUNDS = dict(union128=0.4, union4=0.25, union16=0.4, rel=0.07, d1=0.03, next=0.1, d16=0.12, run=0.15, heads=0.12)


def sample_tiles(T: int, n: int) -> list:
    """Every 128-query tile from block 40 (16k: 88 tiles), or n tiles spread over them when n > 0."""
    nb = T // BLOCK
    if n <= 0:
        return list(range(40, nb))
    return sorted({int(x) for x in np.linspace(40, nb - 1, n)})


def select_tiles(qp: torch.Tensor, kp: torch.Tensor, tiles: list, topk: int = TOPK) -> torch.Tensor:
    """The selection of the tiles' query rows -> [Hp, len(tiles) x 128, topk] int64 (fp32 logits, block max over
    causal keys, the local block in, top-k by score)."""
    T, Hp, _ = qp.shape
    Hpk = kp.shape[1]
    out = []
    for t0 in tiles:
        rows = torch.arange(t0 * BLOCK, (t0 + 1) * BLOCK, device=qp.device)
        nb = t0 + 1
        res = torch.full((Hp, BLOCK, topk), -1, dtype=torch.long)
        for h in range(Hp):
            z = qp[rows, h].float() @ kp[:nb * BLOCK, h * Hpk // Hp].float().T
            z = z.masked_fill(torch.arange(nb * BLOCK, device=qp.device)[None, :] > rows[:, None], float("-inf"))
            s = z.view(BLOCK, nb, BLOCK).amax(-1)
            s[:, t0] = float("inf")
            res[h, :, :min(topk, nb)] = s.topk(min(topk, nb), dim=-1).indices.cpu()
        out.append(res)
    return torch.cat(out, 1)


def statistics(s: torch.Tensor, qb: torch.Tensor) -> dict:
    """The statistics above of selected sets s [Hp, N, topk] (N a multiple of 128, rows tile by tile), qb [N] the
    rows' query blocks."""
    s = s.long()
    Hp, N, K = s.shape

    def union(n):
        x = s.view(Hp, N // n, n * K).reshape(-1, n * K)
        return float(np.mean([len(torch.unique(r[r >= 0])) for r in x])) / K

    res = dict(union128=union(128), union4=union(4), union16=union(16))
    far = (s >= 0) & (s != qb[None, :, None]) & (qb >= 2 * K)[None, :, None]
    back = (qb[None, :, None] - s)[far].double()
    rel = back / qb[None, :, None].expand_as(s)[far].double()
    res["rel"] = [round(float(x), 3) for x in np.quantile(rel.numpy(), [0.1, 0.25, 0.5, 0.75, 0.9])]
    res["d1"] = float((back == 1).double().mean())
    sets = [[set(x) - {-1} for x in s[h].tolist()] for h in range(Hp)]

    def overlap(a, b):
        return len(a & b) / K

    def later(d):  # the token d later, in the same tile
        return float(np.mean([overlap(sets[h][t], sets[h][t + d]) for h in range(Hp) for t in range(N - d)
                              if qb[t] == qb[t + d] and qb[t] >= 2 * K]))

    res["next"], res["d16"] = later(1), later(16)
    runs = []
    for h in range(Hp):
        for b in sets[h]:
            b = sorted(b)
            r = 1
            for i in range(1, len(b)):
                if b[i] == b[i - 1] + 1:
                    r += 1
                else:
                    runs.append(r)
                    r = 1
            runs.append(r)
    res["run"] = float(np.mean(runs))
    res["heads"] = float(np.mean([overlap(sets[0][t], sets[1][t]) for t in range(N) if qb[t] >= 2 * K])) \
        if Hp > 1 else float("nan")
    return res


def misses(got: dict, target: dict = TARGET, bounds: dict = BOUNDS) -> list:
    """The statistics outside target +- bounds, as 'name got vs target' strings."""
    bad = []
    for k, b in bounds.items():
        g, t = got[k], target[k]
        if isinstance(t, list):
            if any(abs(x - y) > b for x, y in zip(g, t)):
                bad.append(f"{k} {g} vs {t}")
        elif abs(g - t) > b:
            bad.append(f"{k} {g:.3f} vs {t:.3f}")
    return bad


def fmt(d: dict) -> str:
    return "  ".join(f"{k} {v}" if isinstance(v, list) else f"{k} {v:.3f}" for k, v in d.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--patterns", default="trained,random,clustered")
    ap.add_argument("--tiles", type=int, default=0, help="tiles sampled (0: every tile from block 40)")
    ap.add_argument("--selection", default=None, help="a saved selection [Hp, S, topk] (torch.save) to measure")
    ap.add_argument("--check", action="store_true", help="exit 1 when the trained-like pattern misses TARGET")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.seqlen % BLOCK or a.seqlen < 64 * BLOCK:
        ap.error(f"--seqlen must be a multiple of {BLOCK} and at least {64 * BLOCK}")
    dev = torch.device(a.device)
    tiles = sample_tiles(a.seqlen, a.tiles)
    rows = torch.cat([torch.arange(t * BLOCK, (t + 1) * BLOCK) for t in tiles])
    print(f"T {a.seqlen}, {len(tiles)} tiles of 128 queries, LM heads {LM}")
    print(f"{'target':>10}  {fmt(TARGET)}")
    if a.selection:
        sel = torch.load(a.selection)
        print(f"{'file':>10}  {fmt(statistics(sel[:, rows], rows // BLOCK))}")
    ok = True
    for pattern in a.patterns.split(","):
        _, _, _, qp, kp, _ = user_path.make_inputs(LM, a.seqlen, pattern, dev, dtype=torch.float32, seed=a.seed)
        st = statistics(select_tiles(qp.detach(), kp.detach(), tiles), rows // BLOCK)
        print(f"{pattern:>10}  {fmt(st)}", flush=True)
        if a.check and pattern == "trained":
            bad = misses(st)
            ok = not bad
            print("check: " + ("within bounds" if ok else "outside: " + "; ".join(bad)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
