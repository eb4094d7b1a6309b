#!/usr/bin/env python3
"""Host model of the backward's FLASHMSA_BWD_DQ_TOKEN_OPS layouts (docs/kernels/bwd.md, "Session 20, prepared").

Replays, for random chunk lists, what the kernel and the convert do with the dQ tile (and, check_kl, the kl walk's dQp
tile under FLASHMSA_KL_DQ_TOKEN_OPS):
  - the consumers' float2 stores into the unpadded tile, each row's columns XOR-swizzled by its head (dq_swizzle);
  - the writer's bulk adds: one per token slot (value 1), or merged runs of consecutive tokens (value 2, R == Rp);
  - the dq convert, which reads each 8-column group from its swizzled block (and, value 2, the unit-major row);
and asserts that every (token, head, d) lands where the convert reads it, that no padding row is copied and no
dq_acc element is written twice by one chunk set. It also prints the operations per chunk and the shared-memory
wavefronts of one float2 store. Run: python3 bench/probes/dq_token_ops_model.py
"""
import random


def swz(h):  # bwd_params.cuh dq_swizzle
    return 4 * (h & 7)


def row_of(t, h, Hq, R, total, mode):  # bwd_params.cuh dq_acc_row
    return ((h // R) * total + t) * R + h % R if mode == 2 else t * Hq + h


def chunk(Hq, R, Rp, h0, toks, total, mode, acc):
    tile = [[None] * 128 for _ in range(64)]
    dq_row = [-1] * 64
    for r in range(64):
        s, hs = r // Rp, r % Rp
        h = h0 + hs
        valid = hs < R and toks[s] >= 0
        for d in range(128):
            tile[r][d ^ swz(h0 + (r & (Rp - 1)))] = (toks[s], h, d) if valid else "pad"
        dq_row[r] = row_of(toks[s], h0 + (r & (Rp - 1)), Hq, R, total, mode) * 128 if toks[s] >= 0 else -1
    flat = [x for row in tile for x in row]
    ntc, unit, s, ops = 64 // Rp, R * 128, 0, 0
    while s < ntc:
        off, n = dq_row[s * Rp], 1
        if mode == 2 and R == Rp:
            while s + n < ntc and off >= 0 and dq_row[(s + n) * Rp] == off + n * unit:
                n += 1
        if off >= 0:
            ops += 1
            for k in range(n * unit):
                v = flat[s * Rp * 128 + k]
                assert v != "pad", "a padding row copied"
                assert off + k not in acc, "an element written twice"
                acc[off + k] = v
        s += n
    return ops


def wavefronts(R, Rp, h0):
    worst = 0
    for base in range(0, 64, 8):
        for i in range(8):
            banks = {}
            for r in range(base, base + 8):
                for q in range(4):
                    p = r * 128 + ((8 * i + 2 * q) ^ swz(h0 + (r & (Rp - 1))))
                    for e in range(2):
                        banks[(p + e) % 32] = banks.get((p + e) % 32, 0) + 1
            worst = max(worst, max(banks.values()))
    return worst


def check(Hq, R, Rp, mode, total=5000, trials=20):
    ops = 0
    for _ in range(trials):
        acc = {}
        ntc = 64 // Rp
        for u in range(Hq // R):
            t, toks = random.randrange(total - 4 * ntc), []
            for _ in range(ntc):
                t += random.choice([1, 1, 1, 2, 5])  # ascending, with runs of consecutive tokens
                toks.append(t if t < total else -1)
            if random.random() < 0.3:
                toks[-1] = -1  # a slot past the list
            ops += chunk(Hq, R, Rp, u * R, toks, total, mode, acc)
            for t2 in toks:
                if t2 < 0:
                    continue
                for h in range(u * R, u * R + R):
                    for d0 in range(0, 128, 8):
                        sw = swz(h)
                        src = row_of(t2, h, Hq, R, total, mode) * 128 + (d0 ^ (sw & 24))
                        x = [acc[src + i] for i in range(8)]
                        if sw & 4:
                            x = x[4:] + x[:4]
                        assert x == [(t2, h, d0 + i) for i in range(8)], (Hq, R, Rp, mode, t2, h, d0)
    return ops / trials / (Hq // R)


def check_kl(Hp, total=5000, trials=20):
    """The kl walk's dQp tile (FLASHMSA_KL_DQ_TOKEN_OPS): 64 rows = 64 ascending tokens of one proxy head, dqp_acc
    head-major [Hp, total, 128], columns swizzled by the token; the writer merges runs of consecutive tokens."""
    ops, worst = 0, 0
    for _ in range(trials):
        acc = {}
        for p in range(Hp):
            t, toks = random.randrange(total - 400), []
            for _ in range(64):
                t += random.choice([1, 1, 1, 2, 5])
                toks.append(t if t < total else -1)
            cut = random.randrange(1, 65)  # the list ends inside the chunk
            toks = toks[:cut] + [-1] * (64 - cut)
            tile = [[None] * 128 for _ in range(64)]
            dq_row = []
            for r, tk in enumerate(toks):
                for d in range(128):
                    tile[r][d ^ swz(tk & 7 if tk >= 0 else 7)] = (tk, p, d) if tk >= 0 else "pad"
                dq_row.append((p * total + tk) * 128 if tk >= 0 else -1)
            flat = [x for row in tile for x in row]
            r = 0
            while r < 64:
                off, n = dq_row[r], 1
                while r + n < 64 and off >= 0 and dq_row[r + n] == off + n * 128:
                    n += 1
                if off >= 0:
                    ops += 1
                    for k in range(n * 128):
                        v = flat[r * 128 + k]
                        assert v != "pad" and off + k not in acc
                        acc[off + k] = v
                r += n
            for base in range(0, 64, 8):  # one float2 store: 8 rows (tokens) x 4 column pairs
                banks = {}
                for rr in range(base, base + 8):
                    tk = toks[rr]
                    for q in range(4):
                        pos = rr * 128 + ((2 * q) ^ swz(tk & 7 if tk >= 0 else 7))
                        for e in range(2):
                            banks[(pos + e) % 32] = banks.get((pos + e) % 32, 0) + 1
                worst = max(worst, max(banks.values()))
            for tk in toks:
                if tk < 0:
                    continue
                for d0 in range(0, 128, 8):
                    sw = swz(tk & 7)
                    src = (p * total + tk) * 128 + (d0 ^ (sw & 24))
                    x = [acc[src + i] for i in range(8)]
                    if sw & 4:
                        x = x[4:] + x[:4]
                    assert x == [(tk, p, d0 + i) for i in range(8)], (p, tk, d0)
    return ops / trials / Hp, worst


if __name__ == "__main__":
    random.seed(20)
    for mode in (1, 2):
        for Hq, R, Rp in [(64, 16, 16), (16, 4, 4), (12, 3, 4), (8, 1, 1), (24, 6, 8), (32, 8, 8)]:
            print(f"value {mode}, Hq {Hq} R {R} Rp {Rp}: ok, {check(Hq, R, Rp, mode):.2f} operations per chunk, "
                  f"{wavefronts(R, Rp, 0)} wavefronts per float2 store")
    ops, worst = check_kl(4)
    print(f"kl walk (FLASHMSA_KL_DQ_TOKEN_OPS), Hp 4: ok, {ops:.2f} operations per chunk (64 before), "
          f"worst {worst} wavefronts per float2 store")
