#!/usr/bin/env python3
"""GPU probe: what would regrouping a forward tile's tokens save? Measured without changing a kernel.

The forward runs a tile of 8 consecutive tokens (m3: x 16 heads) over the union of their selections
(docs/kernels/fwd.md). Inside one 128-token span every token sees the same blocks (the blocks before the span
whole, its own block up to the token), so the selections of two tokens of one span can be exchanged and remain
valid. This probe takes the selection of the README's call (the SPARSE forward's indices), reorders each
span's rows so that the tokens a regrouping would put in one tile sit at 8 consecutive positions, and times the
GIVEN-mode forward on the original and the reordered indices: the difference is the gain of a forward whose tiles
are formed by that regrouping (the outputs belong to other tokens, so this is a timing probe, not a result).
Groupings (the tiling functions of bench/tools/fwd_regroup_model.py, which models them on the CPU):
  sort    a span's tokens sorted by their selection, most recent block first (a segmented sort on a GPU);
  greedy  a seed (the earliest token left), then 7 times the token that adds the fewest blocks to the union.
  python3 bench/tools/fwd_regroup_given.py --seqlens 32768,131072 --patterns clustered,random
"""
import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

# the library's own regrouping (FLASHMSA_FWD_REGROUP) would regroup the consecutive tiles too: this probe times the forward
# of consecutive tiles on reordered indices, so it runs with the regrouping off
os.environ["FLASHMSA_FWD_REGROUP"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from user_path import import_flashmsa, make_inputs, median_ms  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fwd_regroup_model import M3, tiles_greedy, tiles_sorted  # noqa: E402

BLOCK, NT = 128, 8


def as_bool(idx, nb):
    """[Hp, T, topk] int32 (out-of-range: empty) -> bool [Hp, T, nb]."""
    Hp, T, k = idx.shape
    sel = np.zeros((Hp, T, nb + 1), dtype=bool)
    v = np.where((idx >= 0) & (idx < nb), idx, nb)
    h = np.arange(Hp)[:, None, None]
    t = np.arange(T)[None, :, None]
    sel[h, t, v] = True
    return sel[..., :nb]


def order_span(sel, s, e, how):
    """the span's tokens in tile order (consecutive groups of NT form the tiles): the model's groupings."""
    tiles = tiles_sorted(sel[s:e], NT, BLOCK) if how == "sort" else tiles_greedy(np.packbits(sel[s:e], axis=1), NT, BLOCK)
    return [s + i for t in tiles for i in t]


def union_factor(sel):
    Hp, T, nb = sel.shape
    need = sel.sum()
    pad = (-T) % NT
    s = np.concatenate([sel, np.zeros((Hp, pad, nb), dtype=bool)], axis=1) if pad else sel
    return float(s.reshape(Hp, -1, NT, nb).any(axis=2).sum() * NT / need)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="32768")
    ap.add_argument("--patterns", default="clustered,random")
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--out", default=None, help="a JSON file for the rows")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script on the CPU backend (small T)")
    args = ap.parse_args()
    fm = import_flashmsa()
    from flashmsa import _autograd as A
    from flashmsa import _kernels as K
    from flashmsa import _lib as L
    rows = []

    def timed(fn):
        if args.device != "cuda":
            import time
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return median_ms(fn, lambda: None, iters=10, warmup=3, reps=1)
    for T in map(int, args.seqlens.split(",")):
        nb = -(-T // BLOCK)
        for pattern in args.patterns.split(","):
            q, k, v, qp, kp, cu = (x.detach() for x in make_inputs(M3, T, pattern, args.device))
            shared = dict(q=q, k=k, v=v, qp=qp, kp=kp, cu_seqlens=cu, max_seqlen=T, softmax_scale=0.0,
                          proxy_scale=0.0, numerics=L.NUMERICS_TRAIN, topk=args.topk, compute_kl=0,
                          want_proxy_lse=False, validate=args.device != "cuda", want_out_lo=False,
                          cu_seqlens_q=None, q_origin=None, max_seqlen_q=0, selection=L.SELECTION_INPUT)
            sparse = A.args_tuple(A.FWD_ARGS, dict(shared, indices=None, mode=L.MODE_SPARSE, want_indices=True))
            idx = dict(zip(A.FWD_OUTPUTS, K.fwd(*sparse)))["indices"]
            t_sparse = timed(lambda: K.fwd(*sparse))
            idx_np = idx.cpu().numpy()
            sel = as_bool(idx_np, nb)
            row = dict(T=T, pattern=pattern, sparse_fwd_ms=round(t_sparse, 3))
            for how in ("original", "sort", "greedy"):
                if how == "original":
                    perm_idx = idx
                    s2 = sel
                else:
                    perm = np.stack([np.concatenate([order_span(sel[h], s, min(T, s + BLOCK), how)
                                                     for s in range(0, T, BLOCK)]) for h in range(sel.shape[0])])
                    perm_idx = torch.gather(idx, 1, torch.from_numpy(perm).to(idx.device)[..., None]
                                            .expand(-1, -1, idx.shape[2]).long()).contiguous()
                    s2 = np.take_along_axis(sel, perm[..., None], axis=1)
                given = A.args_tuple(A.FWD_ARGS, dict(shared, indices=perm_idx, mode=L.MODE_GIVEN, want_indices=False))
                t = timed(lambda: K.fwd(*given))
                row[f"{how}_union8"] = round(union_factor(s2), 3)
                row[f"{how}_given_fwd_ms"] = round(t, 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del q, k, v, qp, kp, idx
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text("\n".join(json.dumps(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
