"""A model of the fused backward's item order and the L2 (design data for the item orders measured on the GPU:
docs/kernels/bwd.md).

Draws the bench's selection pattern on the CPU (bench/user_path.py's draw, pair_overlap.py's selection rule), builds the
inverted lists, and schedules the items (key block, proxy head) on `--sms` CTAs that each take the next item from a
counter when free (the fused kernel's persistent loop), in three orders: block-major (today: a block's proxy heads one
after another) and groups of 4 or 8 consecutive blocks of one head (block spans). An item of n list entries takes
`--item-cost` + ceil(n / NTc) chunk times (NTc = 64 / Rp token slots per chunk, Rp = 16 at m3). Each chunk touches its
tokens' rows (gathered Q/dO, dq added) for the item's head group; an access counts as an L2 hit when the same
(token, head group) was touched less than `--window` chunk times before (a reading of the backward's profiles: the L2
keeps a line ~20 us, ~5 chunks, under this traffic).
    python3 bench/tools/item_order_model.py --config m3 --seqlen 32768 --patterns clustered,random
    python3 bench/tools/item_order_model.py --config fmsa --seqlen 16384 --patterns clustered --spans 1 --lpt
"""
import argparse
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from pair_overlap import CONFIGS, selection_args, selections  # noqa: E402


def order(nblk, hp, span):
    """Item number -> (block, head): the fused kernel's mapping (span 1: block-major)."""
    out = []
    for item in range(nblk * hp):
        g = item // (span * hp)
        first = g * span
        nb = min(span, nblk - first)
        r = item - g * span * hp
        out.append((first + r % nb, r // nb))
    return out


def simulate(lists, items, sms, ntc, item_cost, window):
    """L2 hit fraction of the (token, head) touches and the makespan, in chunk times."""
    free = np.zeros(sms)
    times, keys = [], []
    T = max((int(l.max()) + 1 for l in lists.values() if len(l)), default=1)
    for it in items:
        toks = lists.get(it)
        if toks is None or len(toks) == 0:
            continue
        i = int(np.argmin(free))
        t0 = free[i] + item_cost
        chunk = np.arange(len(toks)) // ntc
        times.append(t0 + chunk + 0.5)
        keys.append(it[1] * T + toks)
        free[i] = t0 + chunk[-1] + 1
    t = np.concatenate(times)
    k = np.concatenate(keys)
    o = np.lexsort((t, k))
    t, k = t[o], k[o]
    same = k[1:] == k[:-1]
    hit = same & (t[1:] - t[:-1] < window)
    return hit.sum() / len(t), free.max()


def main():
    ap = selection_args(argparse.ArgumentParser())
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--item-cost", type=float, default=6.0, help="fixed time of an item, in chunk times")
    ap.add_argument("--window", type=float, default=5.0, help="L2 lifetime of a line, in chunk times")
    ap.add_argument("--spans", default="1,4,8")
    ap.add_argument("--lpt", action="store_true", help="also the items sorted by list length, longest first (an order "
                    "measured on the GPU: docs/kernels/bwd.md), against the ideal makespan")
    ap.add_argument("--windows", default="", help="token windows W (comma-separated): items (block, head, window), "
                    "window-major, each list split at multiples of W (a token-window-major schedule)")
    a = ap.parse_args()
    cfg = CONFIGS[a.config]
    rp = 1 << (cfg["Hq"] // cfg["Hp"] - 1).bit_length()
    ntc = 64 // rp
    for pattern, idx, nblk in selections(a):
        idx = idx.numpy()
        lists = {}
        for h in range(cfg["Hp"]):
            sel = idx[h]
            tok = np.broadcast_to(np.arange(a.seqlen)[:, None], sel.shape)
            ok = sel >= 0
            pairs = np.unique(np.stack([sel[ok], tok[ok]], 1), axis=0)  # (block, token) ascending
            bounds = np.searchsorted(pairs[:, 0], np.arange(nblk + 1))
            for b in range(nblk):
                lists[(b, h)] = pairs[bounds[b]:bounds[b + 1], 1]
        makespans = {}
        for span in (int(s) for s in a.spans.split(",")):
            hit, makespan = simulate(lists, order(nblk, cfg["Hp"], span), a.sms, ntc, a.item_cost, a.window)
            makespans[span] = makespan
            print(f"{a.config} {a.seqlen} {pattern} span {span}: L2 hits {hit:.3f} of the (token, head) touches, "
                  f"makespan {makespan:.0f} chunk times")
            sys.stdout.flush()
        if a.lpt:
            items = order(nblk, cfg["Hp"], 1)
            n = np.array([len(lists[i]) for i in items])
            ideal = ((-(-n // ntc)).sum() + a.item_cost * (n > 0).sum()) / a.sms
            today = makespans[1] if 1 in makespans else simulate(lists, items, a.sms, ntc, a.item_cost, a.window)[1]
            _, lpt = simulate(lists, [items[i] for i in np.argsort(-n, kind="stable")], a.sms, ntc, a.item_cost, a.window)
            print(f"{a.config} {a.seqlen} {pattern}: ideal makespan {ideal:.0f} chunk times, block-major {today:.0f} "
                  f"(+{100 * (today / ideal - 1):.1f}%), longest first {lpt:.0f} (+{100 * (lpt / ideal - 1):.1f}%)")
            sys.stdout.flush()
        for W in (int(w) for w in a.windows.split(",") if w):
            sub, items = {}, []
            for w in range(-(-a.seqlen // W)):
                for blk, h in order(nblk, cfg["Hp"], 1):
                    toks = lists[(blk, h)]
                    part = toks[(toks >= w * W) & (toks < (w + 1) * W)]
                    if len(part):
                        sub[(blk, h, w)] = part
                        items.append((blk, h, w))
            hit, makespan = simulate(sub, items, a.sms, ntc, a.item_cost, a.window)
            print(f"{a.config} {a.seqlen} {pattern} window {W}: L2 hits {hit:.3f} of the (token, head) touches, "
                  f"makespan {makespan:.0f} chunk times, {len(items)} items")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
