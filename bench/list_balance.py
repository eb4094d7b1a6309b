#!/usr/bin/env python3
"""How evenly the backward's work spreads over its CTAs, from a selection's indices.

The main backward kernel runs one CTA per (key block, unit of R query heads) and walks the
inverted list of that block for the unit's proxy head: the tokens whose row selected it, in
chunks of 64 / Rp tokens. A long list (a "sink" block that every token selects) makes one CTA
long: in the default mode it may end the kernel late (a tail), in the deterministic mode every
token's dq turn waits behind it. This script reads indices [Hp, T, topk] int32 (one sequence,
as `flashmsa_bench --save-indices DIR` writes them) and reports the list lengths, the chunk
counts per CTA and a greedy schedule of the CTAs (in launch order) on the GPU's SMs.

    python3 bench/list_balance.py indices-m3-32768-clustered.bin --hq 64 --hp 4 --topk 16
"""
from __future__ import annotations

import argparse

import numpy as np


def lists(idx: np.ndarray) -> np.ndarray:
    """[Hp, nblk] inverted-list lengths: tokens t with block j in their row (j <= t // 128,
    repeated blocks counted once), per proxy head."""
    Hp, T, K = idx.shape
    nblk = (T + 127) // 128
    own = (np.arange(T) // 128)[None, :, None]
    out = np.zeros((Hp, nblk), dtype=np.int64)
    for p in range(Hp):
        rows = np.sort(idx[p], axis=1)
        first = np.ones_like(rows, dtype=bool)
        first[:, 1:] = rows[:, 1:] != rows[:, :-1]
        ok = (rows >= 0) & (rows <= own[0]) & first
        out[p] = np.bincount(rows[ok], minlength=nblk)[:nblk]
    return out


def schedule(costs: np.ndarray, sms: int) -> float:
    """Makespan of CTAs dispatched in order to the first free SM (one CTA per SM)."""
    free = np.zeros(sms)
    for c in costs:
        i = int(np.argmin(free))
        free[i] += c
    return float(free.max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("indices", help="raw int32 [Hp, T, topk]")
    ap.add_argument("--hq", type=int, default=64)
    ap.add_argument("--hp", type=int, default=4)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--r", type=int, default=0, help="query heads per unit (default: Hq / Hp, the teacher path)")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--chunk-cost", type=float, default=1.0, help="time of one chunk (any unit)")
    ap.add_argument("--cta-cost", type=float, default=4.0, help="fixed time of a CTA, in chunks")
    a = ap.parse_args()
    raw = np.fromfile(a.indices, dtype=np.int32)
    T = raw.size // (a.hp * a.topk)
    idx = raw.reshape(a.hp, T, a.topk)
    n = lists(idx)
    G = a.hq // a.hp
    R = a.r or G
    Rp = 1 << (R - 1).bit_length()
    ntc = 64 // Rp
    units_per_grp = G // R
    chunks = -(-n // ntc)  # [Hp, nblk]
    # launch order: blockIdx.x (key block) fastest, then blockIdx.y (unit); unit u reads grp u // units_per_grp
    nblk = n.shape[1]
    order = [chunks[u // units_per_grp, j] for u in range(a.hq // R) for j in range(nblk)]
    costs = np.array(order, dtype=np.float64) * a.chunk_cost + a.cta_cost
    ideal = costs.sum() / a.sms
    span = schedule(costs, a.sms)
    print(f"T {T}, Hp {a.hp}, topk {a.topk}, blocks {nblk}, units {a.hq // R} (R {R}, Rp {Rp}, {ntc} tokens per chunk)")
    print(f"list length: mean {n.mean():.1f}, max {n.max()} (block {np.unravel_index(n.argmax(), n.shape)[1]}), "
          f"p99 {np.percentile(n, 99):.0f}; total entries {n.sum()}")
    print(f"CTA chunks: mean {chunks.mean():.1f}, max {chunks.max()}; the longest CTA is "
          f"{chunks.max() * a.chunk_cost / ideal:.2f}x the ideal makespan")
    print(f"greedy schedule on {a.sms} SMs: {span / ideal:.3f}x the ideal (sum / SMs); tail {span - ideal:.0f} chunk times")
    top = np.argsort(n.ravel())[::-1][:8]
    print("longest lists (proxy head, block, tokens):",
          ", ".join(f"({i // nblk}, {i % nblk}, {n.ravel()[i]})" for i in top))


if __name__ == "__main__":
    main()
