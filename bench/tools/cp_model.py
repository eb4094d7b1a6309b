#!/usr/bin/env python3
"""Context-parallel scaling model (docs/distributed.md, "Scaling model"): the step time of the tokens and hybrid
schemes at P ranks from a measured one-GPU step (bench/long_context.py's rows) and the bytes each rank moves.

    step_P = step_1 (1 + kl_fwd) / P + bytes_per_rank / bandwidth      (no overlap of the exchanges with compute)

kl_fwd: a forward kl pass, --kl-fwd of the step (0 by default: in training msa_attention_cp forms the kl in the
backward, as the one-GPU call does; with compute_kl=True, the user's-path table's compute_kl=True step against the
default one).
    efficiency = step_1 / (P x step_P)

bytes_per_rank (tokens scheme, m3-like GQA, bf16): the gather of k, v, kp, (T - T/P) x (2 Hkv D + Hpk Dp) x 2 bytes,
and the backward's return of their gradients in fp32, twice that: 3 x (T - T/P) x (2 Hkv D + Hpk Dp) x 2 bytes. The
hybrid scheme with heads groups of H ranks: the heads all-to-all moves q, out, dout, dq (and k, v, qp, kp, dk, ...) of
T/P tokens, about 2 (T/P)(H-1)/H x (2 Hq D + 2 Hkv D + Hp Dp) x 2 bytes, over NVLink inside a node; the tokens part
moves the key heads of one group only (1/H of the above) across the P/H groups. Compute is assumed to split evenly
(zigzag shards) and the one-GPU step to be what the ranks' kernels do on 1/P of the queries (selection, forward and
backward scale with the queries against a fixed key set).

What overlapping the exchanges with compute could gain, two bounds per row:
    fwd overlap   the forward's gather of k and v (bf16; with kp's, a third of the key bytes) hidden under the
                  selection, which needs only the gathered kp (select_ms / P of the rank's step): the step less
                  min(k and v's gather, selection)
    ideal         every byte hidden: max(compute, exchange)

    python3 bench/tools/cp_model.py bench/results/long_context.latest.json [--nvlink 370] [--ib 45]
"""
import argparse
import json
import sys

M3 = dict(Hq=64, Hkv=4, Hp=4, Hpk=1, D=128)


def key_bytes(T, P, c=M3, heads_size=1):
    """bytes one rank sends and receives for the key side of the tokens scheme (gather + gradient return)."""
    per_tok = (2 * c["Hkv"] * c["D"] + c["Hpk"] * c["D"]) * 2 / heads_size
    groups = P // heads_size
    return 3 * (T - T / groups) * per_tok if groups > 1 else 0.0


def head_bytes(T, P, heads_size, c=M3):
    """bytes of the heads all-to-alls (forward in/out, backward in/out) one rank moves inside its heads group."""
    if heads_size <= 1:
        return 0.0
    per_tok = (2 * c["Hq"] + 2 * c["Hkv"] + c["Hp"]) * c["D"] * 2
    return 2 * (T / P) * (heads_size - 1) / heads_size * per_tok


def model(step1_ms, T, P, nvlink_gbs, ib_gbs, scheme="tokens", heads_size=1, ranks_per_node=8, kl_fwd=0.0,
          select_ms=0.0):
    """(step_P ms, efficiency, step with the forward's gather under the selection, step with every byte hidden) on
    NVLink inside nodes of ranks_per_node GPUs, InfiniBand across them; select_ms: the one-GPU selection."""
    kb = key_bytes(T, P, heads_size=heads_size if scheme == "hybrid" else 1)
    hb = head_bytes(T, P, heads_size) if scheme == "hybrid" else 0.0
    across = P > ranks_per_node  # the tokens exchanges span nodes
    t_key = 1e3 * kb / ((ib_gbs if across else nvlink_gbs) * 1e9)
    t_comm = t_key + 1e3 * hb / (nvlink_gbs * 1e9)
    compute = step1_ms * (1 + kl_fwd) / P
    step = compute + t_comm
    kv_share = 2 * M3["Hkv"] * M3["D"] / (2 * M3["Hkv"] * M3["D"] + M3["Hpk"] * M3["D"])  # k, v of the gather
    fwd_overlap = step - min(t_key / 3 * kv_share, select_ms / P)
    return step, step1_ms / (P * step), fwd_overlap, max(compute, t_comm)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("latest", help="bench/long_context.py's long_context.latest.json")
    ap.add_argument("--nvlink", type=float, default=370.0, help="GB/s per GPU and direction inside a node")
    ap.add_argument("--ib", type=float, default=45.0, help="GB/s per GPU and direction across nodes")
    ap.add_argument("--ps", default="2,8,16")
    ap.add_argument("--kl-fwd", type=float, default=0.0, help="the forward kl pass, a fraction of the one-GPU step")
    a = ap.parse_args(argv)
    rows = json.load(open(a.latest))["rows"]
    gpu = json.load(open(a.latest)).get("gpu", {}).get("name", "?")
    print(f"one-GPU steps from {a.latest} ({gpu}); NVLink {a.nvlink:g} GB/s inside 8-GPU nodes, InfiniBand {a.ib:g} "
          f"GB/s across; forward kl pass {100 * a.kl_fwd:.0f}% of the step; efficiency without overlap, with the "
          "forward's gather under the selection, with every byte hidden")
    print("| T | pattern | 1 GPU ms | P | scheme | key bytes/rank GiB | step ms | efficiency | fwd overlap | ideal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r or not r.get("step_ms"):
            continue
        T = r["seqlen"]
        for P in (int(x) for x in a.ps.split(",")):
            for scheme, hs in (("tokens", 1), ("hybrid", 4)):
                if scheme == "hybrid" and P % hs:
                    continue
                step, eff, fwd_ov, ideal = model(r["step_ms"], T, P, a.nvlink, a.ib, scheme, hs, kl_fwd=a.kl_fwd,
                                                 select_ms=r.get("select_ms") or 0.0)
                kb = key_bytes(T, P, heads_size=hs if scheme == "hybrid" else 1) / 2**30
                name = scheme if scheme == "tokens" else f"hybrid {hs} x {P // hs}"
                pct = lambda t: f"{100 * r['step_ms'] / (P * t):.0f}%"  # noqa: E731
                print(f"| {T} | {r['pattern']} | {r['step_ms']:.0f} | {P} | {name} | {kb:.2f} | {step:.0f} | "
                      f"{100 * eff:.0f}% | {pct(fwd_ov)} | {pct(ideal)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
