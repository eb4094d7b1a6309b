"""How much two adjacent key blocks' inverted lists share (design data for a backward that walks the
union of blocks 2i and 2i+1 in a 2-CTA cluster and sums their dQ on chip before one bulk add).

Draws bench/user_path.py's selection pattern on the CPU, selects top-k blocks per token and proxy head as the library
does (block score = max of the causal proxy logits, the own block always in; ties irrelevant here), inverts, and for
the pairs (2i, 2i+1) of each sequence and proxy head prints:
  shared   = sum |L0 & L1| / sum (|L0| + |L1|): the dQ adds (and gathered rows) a pair walk saves,
  waste    = (2 sum |L0 | L1| - sum (|L0| + |L1|)) / sum (|L0| + |L1|): the masked rows it computes in addition.
    python3 bench/tools/pair_overlap.py --config m3 --seqlen 32768 --patterns clustered,random
"""
import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from user_path import make_inputs  # noqa: E402

CONFIGS = {"m3": dict(Hq=64, Hkv=4, Hp=4, Hpk=1), "fmsa": dict(Hq=16, Hkv=2, Hp=4, Hpk=1)}
BLK = 128


def select(qp, kp, topk, rows=2048):
    """[Hp, T, topk] block indices (-1 where a token has fewer than topk causal blocks)."""
    T, Hp, D = qp.shape
    nblk = -(-T // BLK)
    out = torch.full((Hp, T, topk), -1, dtype=torch.int64)
    pos = torch.arange(T)
    for p in range(Hp):
        kh = kp[:, p * kp.shape[1] // Hp].float()
        for r0 in range(0, T, rows):
            r1 = min(T, r0 + rows)
            s = qp[r0:r1, p].float() @ kh[:r1].T  # [rows, keys <= r1]
            s = s.masked_fill(pos[None, :r1] > pos[r0:r1, None], float("-inf"))
            nb = -(-r1 // BLK)
            s = torch.nn.functional.pad(s, (0, nb * BLK - r1), value=float("-inf"))
            bs = s.view(r1 - r0, nb, BLK).amax(-1)  # block scores
            own = pos[r0:r1] // BLK
            bs[torch.arange(r1 - r0), own] = float("inf")
            k = min(topk, nb)
            v, i = bs.topk(k, dim=-1)
            i = i.masked_fill(v == float("-inf"), -1)
            out[p, r0:r1, :k] = i
        del kh
    return out, nblk


def selection_args(ap):
    """The options of the probes that draw a bench pattern's selection on the CPU (this one, item_order_model.py)."""
    ap.add_argument("--config", default="m3")
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--patterns", default="clustered,random")
    return ap


def selections(a):
    """(pattern, indices [Hp, T, topk], nblk) for each of a.patterns, drawn as bench/user_path.py draws them."""
    for pattern in a.patterns.split(","):
        _, _, _, qp, kp, _ = make_inputs(CONFIGS[a.config], a.seqlen, pattern, "cpu", dtype=torch.float32)
        idx, nblk = select(qp.detach(), kp.detach(), a.topk)
        yield pattern, idx, nblk


def main():
    a = selection_args(argparse.ArgumentParser()).parse_args()
    cfg = CONFIGS[a.config]
    for pattern, idx, nblk in selections(a):
        tot = inter = union = 0
        per_pair = []
        for p in range(cfg["Hp"]):
            members = torch.zeros(nblk, a.seqlen, dtype=torch.bool)
            sel = idx[p]
            valid = sel >= 0
            tok = torch.arange(a.seqlen)[:, None].expand_as(sel)
            members[sel[valid], tok[valid]] = True
            for b in range(0, nblk - 1, 2):
                l0, l1 = members[b], members[b + 1]
                n0, n1 = int(l0.sum()), int(l1.sum())
                i, u = int((l0 & l1).sum()), int((l0 | l1).sum())
                tot += n0 + n1
                inter += i
                union += u
                per_pair.append(i / max(1, n0 + n1))
        pp = torch.tensor(per_pair)
        print(f"{a.config} {a.seqlen} {pattern} topk {a.topk}: entries {tot}, shared {inter / tot:.3f} "
              f"(dQ adds saved by a pair walk), waste {(2 * union - tot) / tot:.3f} (masked rows added); "
              f"per-pair shared: median {pp.median():.3f}, pairs >= 0.4: {(pp >= 0.4).float().mean():.2f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
