#!/usr/bin/env python3
"""Host model: how much of the sparse forward's masked work would regrouping tokens remove?

The forward (docs/kernels/fwd.md) runs a tile of NT tokens x R heads (m3: 8 tokens x 16 heads = 128 rows,
4 per consumer warpgroup) over the union of its tokens' selected blocks, so it executes
sum over tiles of |union| x NT x R rows of work where the spec requires sum over tokens of |selection| x R:
the union factor (BENCHMARKS.md: 1.47 at 8 tokens clustered, 4.50 random). Today a tile is NT consecutive
tokens. This model draws BENCHMARKS.md's selections on the CPU (bench/user_path.py's generator, the top-k of
the block max of the proxy logits, causal, own block always in; fp32 on the CPU, so not bitwise the GPU's
selection, the same distribution), then measures the union factor of tiles formed by:
  consecutive  NT consecutive tokens (today);
  sort         tokens of a window of W consecutive tokens sorted by their selection (the list of selected
               blocks, most recent first, compared lexicographically), then cut into NT-token tiles: a
               segmented sort a GPU does in microseconds;
  greedy       per window: a seed token (the earliest left), then NT - 1 times the token whose selection
               adds the fewest blocks to the tile's union (an upper-bound-ish heuristic, too slow for a GPU
               pass as written).
Each tile stays inside one sequence and one MSA group, as the forward requires.
  python3 bench/tools/fwd_regroup_model.py --T 32768 --patterns clustered,random --windows 128,512
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from user_path import make_inputs  # noqa: E402

BLOCK = 128
M3 = dict(Hq=64, Hkv=4, Hp=4, Hpk=1)


def select(qp, kp, topk, chunk=1024):
    """bool [Hp, T, nb]: each token's selected blocks (block score = max proxy logit over the block's
    causal keys; the own block always in; min(topk, visible blocks) blocks)."""
    T, Hp, _ = qp.shape
    Hpk = kp.shape[1]
    nb = -(-T // BLOCK)
    sel = np.zeros((Hp, T, nb), dtype=bool)
    keypos = torch.arange(T)
    for p in range(Hp):
        kpp = kp[:, p * Hpk // Hp].float()
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            logits = qp[s:e, p].float() @ kpp.T  # [c, T]
            qpos = torch.arange(s, e)[:, None]
            logits = logits.masked_fill(keypos[None, :] > qpos, float("-inf"))
            pad = nb * BLOCK - T
            if pad:
                logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
            score = logits.view(e - s, nb, BLOCK).amax(-1)  # [c, nb]; -inf past the token
            own = (qpos // BLOCK).squeeze(1)
            score[torch.arange(e - s), own] = float("inf")
            k = min(topk, nb)
            idx = score.topk(k, dim=-1).indices
            ok = torch.gather(score, 1, idx) > float("-inf")
            rows = torch.arange(e - s)[:, None].expand_as(idx)
            m = torch.zeros(e - s, nb, dtype=torch.bool)
            m[rows[ok], idx[ok]] = True
            sel[p, s:e] = m.numpy()
    return sel


def tile_union(sel_rows_packed, tiles):
    """sum over tiles of |union| x len(tile)."""
    tot = 0
    for t in tiles:
        u = np.bitwise_or.reduce(sel_rows_packed[t], axis=0)
        tot += int(np.bitwise_count(u).sum()) * len(t)
    return tot


def tiles_consecutive(n, nt):
    return [list(range(s, min(n, s + nt))) for s in range(0, n, nt)]


def tiles_sorted(sel, nt, W):
    """window-sorted: selected block ids most recent first, lexicographic."""
    n, nb = sel.shape
    tiles = []
    for s in range(0, n, W):
        e = min(n, s + W)
        # key: the selection as a bit string with the most recent block as the most significant bit
        keys = [tuple(np.flatnonzero(sel[i])[::-1]) for i in range(s, e)]
        order = sorted(range(s, e), key=lambda i: keys[i - s])
        tiles += [order[a:a + nt] for a in range(0, len(order), nt)]
    return tiles


def tiles_greedy(packed, nt, W):
    n = packed.shape[0]
    tiles = []
    for s in range(0, n, W):
        left = list(range(s, min(n, s + W)))
        while left:
            tile = [left.pop(0)]
            u = packed[tile[0]].copy()
            while len(tile) < nt and left:
                cand = packed[left]
                growth = np.bitwise_count(cand & ~u).sum(axis=1)
                j = int(np.argmin(growth))  # ties: the earliest
                tile.append(left.pop(j))
                u |= packed[tile[-1]]
            tiles.append(tile)
    return tiles


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--patterns", default="clustered,random")
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--nts", default="8,4", help="tokens per tile (m3: 8 per CTA, 4 per warpgroup)")
    ap.add_argument("--windows", default="128,512")
    ap.add_argument("--heads", type=int, default=4, help="proxy heads modelled (m3 has 4)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for pattern in args.patterns.split(","):
        t0 = time.time()
        _, _, _, qp, kp, _ = make_inputs(M3, args.T, pattern, "cpu", dtype=torch.float32, seed=0)
        sel = select(qp.detach()[:, :args.heads], kp.detach(), args.topk)
        print(f"{pattern} T={args.T}: selection drawn in {time.time() - t0:.0f} s", flush=True)
        need = sel.sum()
        for nt in map(int, args.nts.split(",")):
            res = {}
            for name, make in [("consecutive", None)] + [(f"sort W={w}", ("sort", int(w))) for w in args.windows.split(",")] \
                    + [(f"greedy W={w}", ("greedy", int(w))) for w in args.windows.split(",")]:
                t1 = time.time()
                tot = 0
                for p in range(sel.shape[0]):
                    packed = np.packbits(sel[p], axis=1)
                    if make is None:
                        tiles = tiles_consecutive(sel.shape[1], nt)
                    elif make[0] == "sort":
                        tiles = tiles_sorted(sel[p], nt, make[1])
                    else:
                        tiles = tiles_greedy(packed, nt, make[1])
                    tot += tile_union(packed, tiles)
                res[name] = tot / need
                print(f"  {nt} tokens per tile, {name:14s}: union factor {res[name]:.3f}  ({time.time() - t1:.0f} s)",
                      flush=True)


if __name__ == "__main__":
    main()
