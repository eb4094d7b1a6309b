#!/usr/bin/env python3
"""Host model of the backward's dQ tile and dq_acc layout (docs/kernels/bwd.md, the dQ tile's swizzle;
bwd_params.cuh, dq_swizzle).

Replays, for random chunk lists, what the main walk and the dq convert do with the dQ tile:
  - the consumers' float2 stores into the unpadded tile, each row's columns XOR-swizzled by
    dq_swizzle(t, r, Rp) = 8 ((r + Rp t) mod 4) (t the row's global token, r its head within the unit; the earlier
    key 4 ((r + Rp t) mod 8) is modelled too, for the comparison);
  - the writer's bulk adds: one per token slot, covering the slot's R head rows;
  - the dq convert, which reads each 8-column group from its swizzled block;
and asserts that every (token, head, d) lands where the convert reads it, that no padding row is copied and no
dq_acc element is written twice by one chunk set. It prints the operations per chunk and the shared-memory
wavefronts of one float2 store (worst and mean over the stores, counted per half-warp), for lists of consecutive tokens (clustered
selections) and of random ascending tokens. Run: python3 bench/tools/dq_token_ops_model.py
"""
import random


def swz_fullwarp(t, r, rp):  # the earlier key: 8 different keys per 8 rows (a full-warp bank model)
    return 4 * ((r + rp * t) & 7)


def swz_halfwarp(t, r, rp):  # bwd_params.cuh dq_swizzle: 4 keys per 4 rows of a half-warp
    return 8 * ((r + rp * t) & 3)


swz = swz_halfwarp


def chunk(Hq, R, Rp, h0, toks, acc):
    tile = [[None] * 128 for _ in range(64)]
    dq_row = [-1] * 64
    for row in range(64):
        s, r = row // Rp, row % Rp
        valid = r < R and toks[s] >= 0
        for d in range(128):
            tile[row][d ^ swz(toks[s], r, Rp)] = (toks[s], h0 + r, d) if valid else "pad"
        dq_row[row] = (toks[s] * Hq + h0 + r) * 128 if toks[s] >= 0 else -1
    flat = [x for row in tile for x in row]
    ops = 0
    for s in range(64 // Rp):
        off = dq_row[s * Rp]
        if off < 0:
            continue
        ops += 1
        for k in range(R * 128):
            v = flat[s * Rp * 128 + k]
            assert v != "pad", "a padding row copied"
            assert off + k not in acc, "an element written twice"
            acc[off + k] = v
    return ops


def wavefronts(Rp, toks):
    """Per float2 store (8 rows x 4 column pairs, the 8 rows rq0 .. rq0 + 7 of the tile): the shared-memory
    wavefronts, counted as the GPU serves a 64-bit store: each half-warp (lanes 0-15: rows rq0 .. rq0 + 3; lanes
    16-31: the next 4 rows) on its own, in as many wavefronts as the most accesses to one bank within it (ncu: the
    earlier key, which spreads 8 rows over the banks, took 4 wavefronts per store, as this model counts, where a
    full-warp model counts 2). 2 is the minimum for 256 bytes."""
    out = []
    for base in range(0, 64, 8):
        for i in range(16):
            total = 0
            for half in (base, base + 4):
                banks = {}
                for row in range(half, half + 4):
                    t, r = toks[row // Rp], row % Rp
                    for q in range(4):
                        p = row * 128 + ((8 * i + 2 * q) ^ swz(t, r, Rp))
                        for e in range(2):
                            banks[(p + e) % 32] = banks.get((p + e) % 32, 0) + 1
                total += max(banks.values())
            out.append(total)
    return out


def check(Hq, R, Rp, steps, total=5000, trials=20):
    ops, waves = 0, []
    for _ in range(trials):
        acc = {}
        ntc = 64 // Rp
        for u in range(Hq // R):
            t, toks = random.randrange(total - 20 * ntc), []
            for _ in range(ntc):
                t += random.choice(steps)
                toks.append(t if t < total else -1)
            if random.random() < 0.3:
                toks[-1] = -1  # a slot past the list
            ops += chunk(Hq, R, Rp, u * R, toks, acc)
            waves += wavefronts(Rp, [x if x >= 0 else 0 for x in toks])
            for t2 in toks:
                if t2 < 0:
                    continue
                for h in range(u * R, u * R + R):
                    for d0 in range(0, 128, 8):
                        sw = swz(t2, h % R, Rp)  # the convert: head within the unit, Rp from R
                        src = (t2 * Hq + h) * 128 + (d0 ^ (sw & 24))
                        x = [acc[src + i] for i in range(8)]
                        if sw & 4:
                            x = x[4:] + x[:4]
                        assert x == [(t2, h, d0 + i) for i in range(8)], (Hq, R, Rp, t2, h, d0)
    return ops / trials / (Hq // R), max(waves), sum(waves) / len(waves)


if __name__ == "__main__":
    for key in (swz_halfwarp, swz_fullwarp):
        swz = key
        random.seed(21)
        print(f"key {key.__name__}:")
        for Hq, R, Rp in [(64, 16, 16), (16, 4, 4), (12, 3, 4), (8, 1, 1), (8, 2, 2), (24, 6, 8), (32, 8, 8),
                          (128, 64, 64)]:
            for name, steps in (("consecutive", [1]), ("random", [1, 2, 3, 5, 7, 11, 13])):
                ops, worst, mean = check(Hq, R, Rp, steps)
                print(f"  Hq {Hq} R {R} Rp {Rp}, {name} tokens: ok, {ops:.2f} operations per chunk (64 before), "
                      f"wavefronts per float2 store worst {worst}, mean {mean:.2f}")
