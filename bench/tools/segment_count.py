"""How many kl segments (main-walk / kl-walk alternations) the fused backward runs per seg value, for
the bench's selections drawn on the CPU (bench/tools/pair_overlap.py's selection rule). With the measured backward
times at seg 1024 / 2048 / 4096 this prices one segment boundary:
    python3 bench/tools/segment_count.py --config m3 --seqlen 32768 --patterns clustered,random
"""
import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from pair_overlap import CONFIGS, select  # noqa: E402
from user_path import make_inputs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="m3")
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--patterns", default="clustered,random")
    ap.add_argument("--segs", default="1024,2048,3968,4096")
    ap.add_argument("--ctas", type=int, default=132)
    a = ap.parse_args()
    cfg = CONFIGS[a.config]
    for pattern in a.patterns.split(","):
        _, _, _, qp, kp, _ = make_inputs(cfg, a.seqlen, pattern, "cpu", dtype=torch.float32)
        idx, nblk = select(qp.detach(), kp.detach(), a.topk)
        Hp = idx.shape[0]
        lens = torch.zeros(Hp, nblk, dtype=torch.int64)
        for p in range(Hp):
            v = idx[p].flatten()
            lens[p] = torch.bincount(v[v >= 0], minlength=nblk)
        n = lens.flatten()
        items = int((n > 0).sum())
        print(f"{a.config} {a.seqlen} {pattern}: {items} items, entries {int(n.sum())}, list mean {n.float().mean():.0f}"
              f" max {int(n.max())}")
        for seg in map(int, a.segs.split(",")):
            segs = int(((n + seg - 1) // seg).sum())
            print(f"  seg {seg}: {segs} segments, {segs - items} beyond one per item, {segs / a.ctas:.1f} per CTA")


if __name__ == "__main__":
    main()
