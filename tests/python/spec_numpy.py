"""SPEC.md section 1 in plain numpy (fp64), written from the spec's text for the tests.

It shares no code with the C++ reference: the tests use it to check, from outside, what
`flashmsa run --save` wrote. Dense masks per sequence: meant for small sizes.
"""
import numpy as np

BK = 128


def _logsumexp(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return (np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m).squeeze(axis)


def select(qp, kp, topk, proxy_scale):
    """One sequence: qp [L, Hp, Dp], kp [L, Hpk, Dp] -> indices [Hp, L, topk]."""
    L, Hp, _ = qp.shape
    Hpk = kp.shape[1]
    nb = (L + BK - 1) // BK
    pos = np.arange(L)
    causal = pos[None, :] <= pos[:, None]
    idx = np.full((Hp, L, topk), -1, dtype=np.int32)
    for p in range(Hp):
        c = p // (Hp // Hpk)
        z = proxy_scale * qp[:, p] @ kp[:, c].T
        z = np.where(causal, z, -np.inf)
        zpad = np.full((L, nb * BK), -np.inf)
        zpad[:, :L] = z
        score = zpad.reshape(L, nb, BK).max(axis=2)  # [L, nb]
        for i in range(L):
            l = i // BK
            others = list(range(l))
            others.sort(key=lambda j: (-score[i, j], j))
            chosen = others[: min(topk - 1, l)] + [l]
            idx[p, i, : len(chosen)] = chosen
    return idx


def key_mask(indices_p, L, dense):
    """Key-set mask [L, L] of one proxy head of one sequence."""
    pos = np.arange(L)
    causal = pos[None, :] <= pos[:, None]
    if dense:
        return causal
    nb = (L + BK - 1) // BK
    blk = np.zeros((L, nb), dtype=bool)
    for i in range(L):
        for j in indices_p[i]:
            if 0 <= j < nb:
                blk[i, j] = True
    return blk[:, pos // BK] & causal


def msa(q, k, v, qp, kp, cu, topk, mode, dout, dlse=None, kl_grad=1.0, scale=None, proxy_scale=None):
    """Forward and backward over varlen inputs. Returns a dict of every SPEC output."""
    total, Hq, D = q.shape
    Hkv, Hp, Hpk, Dp = k.shape[1], qp.shape[1], kp.shape[1], qp.shape[2]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    proxy_scale = 1.0 / np.sqrt(Dp) if proxy_scale is None else proxy_scale
    G = Hq // Hp
    N = Hp * total
    r = {n: np.zeros_like(x) for n, x in (("out", q), ("dq", q), ("dk", k), ("dv", v), ("dqp", qp), ("dkp", kp))}
    r["lse"] = np.zeros((Hq, total))
    r["proxy_lse"] = np.zeros((Hp, total))
    r["indices"] = np.full((Hp, total, topk), -1, dtype=np.int32)
    kl = 0.0
    for b in range(len(cu) - 1):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        L = s1 - s0
        if L == 0:
            continue
        sl = slice(s0, s1)
        dense = mode == "warmup"
        if not dense:
            r["indices"][:, sl] = select(qp[sl], kp[sl], topk, proxy_scale)
        for p in range(Hp):
            M = key_mask(r["indices"][p, sl], L, dense)
            c = p // (Hp // Hpk)
            teacher = np.zeros((L, L))
            for h in range(p * G, (p + 1) * G):
                kv = h // (Hq // Hkv)
                x = np.where(M, scale * q[sl, h] @ k[sl, kv].T, -np.inf)
                lse = _logsumexp(x)
                P = np.exp(x - lse[:, None])
                out = P @ v[sl, kv]
                r["out"][sl, h] = out
                r["lse"][h, sl] = lse
                teacher += P / G
                do = dout[sl, h]
                Dh = np.sum(do * out, axis=1)
                if dlse is not None:
                    Dh = Dh - dlse[h, sl]
                dS = P * (do @ v[sl, kv].T - Dh[:, None])
                r["dq"][sl, h] += scale * dS @ k[sl, kv]
                r["dk"][sl, kv] += scale * dS.T @ q[sl, h]
                r["dv"][sl, kv] += P.T @ do
            z = np.where(M, proxy_scale * qp[sl, p] @ kp[sl, c].T, -np.inf)
            plse = _logsumexp(z)
            s = np.exp(z - plse[:, None])
            r["proxy_lse"][p, sl] = plse
            # 0 log 0 = 0: only an exact zero teacher is skipped (a NaN one makes kl NaN, as it does dz)
            with np.errstate(divide="ignore", invalid="ignore"):
                kl += np.sum(np.where(teacher != 0, teacher * (np.log(teacher) - np.log(s)), 0.0))
            dz = (kl_grad / N) * (s - teacher)
            r["dqp"][sl, p] += proxy_scale * dz @ kp[sl, c]
            r["dkp"][sl, c] += proxy_scale * dz.T @ qp[sl, p]
    r["kl"] = kl / N if N else 0.0
    return r
