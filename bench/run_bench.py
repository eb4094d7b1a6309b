#!/usr/bin/env python3
"""BENCHMARKS.md's protocol in one run on the GPU machine: flashmsa's kernels (flashmsa_bench)
and the peers measured in the same process run — cuDNN SDPA and FA2 SDPA dense causal
(enable_gqa), FlexAttention serving the same per-token selection (union block mask + per-token
mask_mod), and a chunked torch top-k indexer for the selection stage — and the user's path
(user_path.py: the README's Python call timed end to end next to the kernel sum) in every row.

Writes <out>/<date>-<gpu>.json and .md. Usage (from the repo root, binaries in .gpu/):
    python3 bench/run_bench.py --out $OUT [--seqlens 16384,32768] [--configs m3,fmsa] [--no-user-path]
    python3 bench/run_bench.py --out $OUT --user-only   # the user's path and cuDNN only (quick)
"""
import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import user_path

CONFIGS = {"m3": dict(Hq=64, Hkv=4, Hp=4, Hpk=1, topk=16), "fmsa": dict(Hq=16, Hkv=2, Hp=4, Hpk=1, topk=16)}
D = 128
BK = 128


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def median_ms(fn, iters=10, warmup=3):
    """Median ms of fn over `iters` single timed calls (CUDA events) after `warmup` calls."""
    return user_path.median_ms(fn, lambda: None, iters, warmup, reps=1)


def sdpa_times(cfg, T, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[backend]
    q = torch.randn(1, cfg["Hq"], T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, cfg["Hkv"], T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, cfg["Hkv"], T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(1, cfg["Hq"], T, D, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([be]):
        fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        t_fwd = median_ms(fwd)
        def step():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            o.backward(do)
        torch.cuda.reset_peak_memory_stats()
        t_step = median_ms(step, iters=5)
        peak = torch.cuda.max_memory_allocated()
    flops = 4 * D * cfg["Hq"] * T * (T + 1) / 2
    return dict(fwd_ms=t_fwd, fwd_tflops=flops / t_fwd / 1e9, step_ms=t_step,
                step_tflops=3.5 * flops / t_step / 1e9, peak_gb=peak / 1e9)


def flex_times(cfg, T, indices, main_pairs):
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    Hq, Hp = cfg["Hq"], cfg["Hp"]
    G = Hq // Hp
    nb = (T + BK - 1) // BK
    idx = torch.from_numpy(indices).cuda().long()  # [Hp, T, topk]
    sel = torch.zeros(Hp, T, nb + 1, dtype=torch.bool, device="cuda")
    sel.scatter_(2, torch.where(idx >= 0, idx, nb), True)
    sel = sel[:, :, :nb].contiguous()  # [Hp, T, nb]: token selects block
    tile = sel.view(Hp, nb, BK, nb).any(dim=2)  # [Hp, q-tile, kv-block]: the union
    num = tile.sum(-1).to(torch.int32)
    order = torch.argsort(tile.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    num = num.repeat_interleave(G, dim=0)[None]
    order = order.repeat_interleave(G, dim=0)[None]

    def mask_mod(b, h, q_idx, kv_idx):
        return sel[h // G, q_idx, kv_idx // BK] & (kv_idx <= q_idx)

    bm = BlockMask.from_kv_blocks(num, order, BLOCK_SIZE=BK, mask_mod=mask_mod, seq_lengths=(T, T))
    flex = torch.compile(flex_attention, dynamic=False)
    q = torch.randn(1, Hq, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, cfg["Hkv"], T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, cfg["Hkv"], T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn_like(q)
    t_fwd = median_ms(lambda: flex(q, k, v, block_mask=bm, enable_gqa=True))
    def step():
        flex(q, k, v, block_mask=bm, enable_gqa=True).backward(do)
    t_step = median_ms(step, iters=5)
    flops = 4 * D * main_pairs
    return dict(fwd_ms=t_fwd, fwd_tflops=flops / t_fwd / 1e9, step_ms=t_step, step_tflops=3.5 * flops / t_step / 1e9)


def torch_topk_indexer_ms(cfg, T, chunk=2048):
    Hp, topk = cfg["Hp"], cfg["topk"]
    qp = torch.randn(T, Hp, D, device="cuda", dtype=torch.bfloat16)
    kp = torch.randn(T, cfg["Hpk"], D, device="cuda", dtype=torch.bfloat16)
    nb = (T + BK - 1) // BK

    def run():
        out = []
        kpt = kp[:, 0].t()
        for s in range(0, T, chunk):
            z = (qp[s:s + chunk].transpose(0, 1) @ kpt).float()  # [Hp, c, T]
            pos = torch.arange(s, min(T, s + chunk), device="cuda")
            z.masked_fill_(torch.arange(T, device="cuda")[None, None, :] > pos[None, :, None], float("-inf"))
            blk = z.view(Hp, z.shape[1], nb, BK).amax(-1)
            local = (pos // BK)[None, :, None]
            blk.scatter_(2, local.expand(Hp, -1, 1), float("inf"))
            out.append(blk.topk(topk, dim=-1).indices)
        return out

    return median_ms(run, iters=5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--seqlens", default="16384,32768")
    ap.add_argument("--configs", default="m3,fmsa")
    ap.add_argument("--patterns", default="clustered,random")
    ap.add_argument("--flex", default="16384,32768", help="seqlens where FlexAttention runs")
    ap.add_argument("--bin", default=".gpu/flashmsa_bench")
    ap.add_argument("--user-path", action=argparse.BooleanOptionalAction, default=True,
                    help="time the user's path (the README's call, user_path.py) in every row")
    ap.add_argument("--user-only", action="store_true",
                    help="only the user's path and cuDNN: no flashmsa_bench, FA2, Flex or torch top-k indexer")
    args = ap.parse_args()
    if args.user_only and not args.user_path:
        ap.error("--user-only needs the user's path (drop --no-user-path)")
    seqlens = [int(x) for x in args.seqlens.split(",")]
    os.makedirs(args.out, exist_ok=True)
    gpu = torch.cuda.get_device_name(0)
    date = datetime.date.today().isoformat()
    rows = []
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        if args.user_only:
            ours = [dict(config=name, seqlen=T, pattern=p) for T in seqlens for p in args.patterns.split(",")]
        else:
            log(f"[bench] flashmsa kernels, {name}")
            res = subprocess.run([args.bin, "--config", name, "--seqlens", args.seqlens, "--patterns", args.patterns,
                                  "--save-indices", args.out], check=True, capture_output=True, text=True).stdout
            ours = [json.loads(l) for l in res.splitlines() if l.startswith("{")]
        for T in seqlens:
            peers = {}
            for be in ("cudnn",) if args.user_only else ("cudnn", "fa2"):
                log(f"[bench] {be} dense causal {name} {T}")
                try:
                    peers[be] = sdpa_times(cfg, T, be)
                except Exception as e:  # a backend missing for this shape is reported, not fatal
                    peers[be] = dict(error=str(e)[:200])
                torch.cuda.empty_cache()
            if not args.user_only:
                log(f"[bench] torch chunked top-k indexer {name} {T}")
                peers["torch_topk_indexer_ms"] = torch_topk_indexer_ms(cfg, T)
            for o in ours:
                if o["seqlen"] != T:
                    continue
                row = dict(o)
                row["peers"] = dict(peers)
                if not args.user_only and str(T) in args.flex.split(","):
                    idx = np.fromfile(os.path.join(args.out, f"indices-{name}-{T}-{o['pattern']}.bin"),
                                      dtype=np.int32).reshape(cfg["Hp"], T, cfg["topk"])
                    main_pairs = o["fwd_train_tflops"] * 1e12 * o["fwd_train_ms"] * 1e-3 / (4 * D)
                    log(f"[bench] flex {name} {T} {o['pattern']}")
                    try:
                        row["peers"]["flex"] = flex_times(cfg, T, idx, main_pairs)
                    except Exception as e:
                        row["peers"]["flex"] = dict(error=str(e)[:300])
                    torch.cuda.empty_cache()
                if args.user_path:
                    where = f"[bench] user path {name} {T} {o['pattern']}:"
                    try:
                        row["user"] = user_path.user_step_times(cfg, T, o["pattern"],
                                                                log=lambda what: log(where, what))
                    except Exception as e:  # reported in the row, like a failing peer
                        row["user"] = dict(error=str(e)[:300])
                    torch.cuda.empty_cache()
                rows.append(row)
                with open(os.path.join(args.out, "rows.jsonl"), "a") as f:  # kept if a later step dies
                    f.write(json.dumps(row) + "\n")
        for f in os.listdir(args.out):
            if f.startswith("indices-"):
                os.remove(os.path.join(args.out, f))
    stem = os.path.join(args.out, f"{date}-{gpu.replace(' ', '-').lower()}")
    meta = dict(date=date, gpu=gpu, torch=torch.__version__, command=" ".join(sys.argv), rows=rows)
    with open(stem + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(meta))
    print(markdown(meta))


def fmt(x, nd=1):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def cudnn_bwd(r):
    """cuDNN's dense backward alone (its fwd+bwd less its fwd, same run), or None."""
    cu = r.get("peers", {}).get("cudnn", {})
    return cu["step_ms"] - cu["fwd_ms"] if cu.get("step_ms") and cu.get("fwd_ms") else None


def markdown(meta):
    out = [f"GPU {meta['gpu']}, torch {meta['torch']}, {meta['date']}. Command: `{meta['command']}`.", "",
           "Effective TFLOP/s count only the work the spec requires (ARCHITECTURE.md). Times in ms (median)."]
    kernel_rows = [r for r in meta["rows"] if "select_ms" in r]  # none under --user-only
    if kernel_rows:
        out += ["",
                "| config | T | pattern | union/128 | select ms (TF/s) | torch top-k ms | fwd train ms (TF/s) | "
                "fwd infer ms | flex fwd ms (TF/s) | cuDNN dense fwd ms (TF/s) | FA2 dense fwd ms | "
                "our dense fwd ms (TF/s) | bwd ms (TF/s) | **step** ms (TF/s) | cuDNN fwd+bwd ms | FA2 fwd+bwd ms | "
                "flex fwd+bwd ms | step vs cuDNN | step GB (ours / cuDNN peak) |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in kernel_rows:
        p = r["peers"]
        fl = p.get("flex", {})
        cu = p.get("cudnn", {})
        fa = p.get("fa2", {})
        out.append(
            f"| {r['config']} | {r['seqlen']} | {r['pattern']} | {r['union_factor_128']:.2f} | "
            f"{fmt(r['select_ms'], 2)} ({fmt(r['select_tflops'], 0)}) | {fmt(p.get('torch_topk_indexer_ms'), 1)} | "
            f"{fmt(r['fwd_train_ms'], 2)} ({fmt(r['fwd_train_tflops'], 0)}) | {fmt(r['fwd_infer_ms'], 2)} | "
            f"{fmt(fl.get('fwd_ms'), 2)} ({fmt(fl.get('fwd_tflops'), 0)}) | "
            f"{fmt(cu.get('fwd_ms'), 2)} ({fmt(cu.get('fwd_tflops'), 0)}) | {fmt(fa.get('fwd_ms'), 2)} | "
            f"{fmt(r['dense_fwd_ms'], 2)} ({fmt(r['dense_fwd_tflops'], 0)}) | "
            f"{fmt(r.get('bwd_ms'), 2)} ({fmt(r.get('bwd_tflops'), 0)}) | {fmt(r.get('step_ms'), 2)} ({fmt(r.get('step_tflops'), 0)}) | "
            f"{fmt(cu.get('step_ms'), 1)} | {fmt(fa.get('step_ms'), 1)} | {fmt(fl.get('step_ms'), 1)} | "
            f"{fmt(cu['step_ms'] / r['step_ms'] if cu.get('step_ms') and r.get('step_ms') else None, 2)}x | "
            f"{fmt(r.get('step_gb'), 2)} / {fmt(cu.get('peak_gb'), 2)} |")
    extra = [r for r in kernel_rows if r.get("bwd_deterministic_ms") is not None]
    if extra:
        out += ["", "Costs of the options (same run): the deterministic backward (sparse, and the dense warmup "
                "mode's against its default), and the precise dpsum (forward writing out_lo, backward reading it).", "",
                "| config | T | pattern | bwd ms | deterministic bwd ms (x) | dense (warmup) bwd ms | "
                "deterministic dense bwd ms (x) | fwd train ms | fwd + out_lo ms | bwd + out_lo ms |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in extra:
            dd, dn = r.get("dense_bwd_deterministic_ms"), r.get("dense_bwd_ms")
            out.append(
                f"| {r['config']} | {r['seqlen']} | {r['pattern']} | {fmt(r['bwd_ms'], 2)} | "
                f"{fmt(r['bwd_deterministic_ms'], 2)} ({fmt(r['bwd_deterministic_ms'] / r['bwd_ms'], 2)}x) | "
                f"{fmt(dn, 2)} | {fmt(dd, 2)} ({fmt(dd / dn, 2) + 'x' if dd and dn else '-'}) | "
                f"{fmt(r['fwd_train_ms'], 2)} | {fmt(r['fwd_train_out_lo_ms'], 2)} | {fmt(r['bwd_out_lo_ms'], 2)} |")
    parts = [r for r in kernel_rows if r.get("bwd_main_ms") is not None]
    if parts:
        out += ["", "The backward and the main attention's backward alone (same run): the backward above trains the "
                "proxy too (the kl gradient and the kl value); without a proxy side (qp, kp that take no gradient, "
                "e.g. a frozen indexer) it is the main attention's backward only. Effective TF/s count the main "
                "backward's work in both. The dense (warmup) backward trains the proxy too (the fused kernel's kl walk "
                "over every causal pair); its TF/s count the dense main backward's work.", "",
                "| config | T | pattern | bwd ms (TF/s) | main attention alone ms (TF/s) | proxy side share | "
                "dense (warmup) bwd ms (TF/s) | cuDNN dense bwd ms (fwd+bwd - fwd) |",
                "|---|---|---|---|---|---|---|---|"]
        for r in parts:
            out.append(
                f"| {r['config']} | {r['seqlen']} | {r['pattern']} | {fmt(r['bwd_ms'], 2)} ({fmt(r['bwd_tflops'], 0)}) | "
                f"{fmt(r['bwd_main_ms'], 2)} ({fmt(r['bwd_main_tflops'], 0)}) | "
                f"{fmt(100 * (1 - r['bwd_main_ms'] / r['bwd_ms']), 1)}% | "
                f"{fmt(r.get('dense_bwd_ms'), 2)} ({fmt(r.get('dense_bwd_tflops'), 0)}) | {fmt(cudnn_bwd(r), 2)} |")
    return "\n".join(out + user_markdown(meta["rows"])) + "\n"


def user_markdown(rows):
    """The user's path table (lines; none without row["user"]): the README's call with its defaults,
    its step with compute_kl=False / True and with a frozen proxy, the kernel sum and the gap, against cuDNN dense."""
    rows = [r for r in rows if "user" in r]
    if not rows:
        return []
    out = ["", "The user's path (README call, defaults): `msa_attention(...)` and its backward end to end, "
           "next to the library's kernels on the same inputs without autograd (bench/user_path.py).", "",
           "| config | T | pattern | user fwd ms | user step ms (default) | step ms (compute_kl=False) | "
           "step ms (compute_kl=True) | step ms, frozen proxy (default / compute_kl=False) | kernel sum ms | "
           "overhead % | cuDNN fwd+bwd ms | step speed-up vs cuDNN | peak GB (user) | peak GB (cuDNN) | "
           "warmup (dense) step ms (x cuDNN's time) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        u, cu = r["user"], r["peers"].get("cudnn", {})
        head = f"| {r['config']} | {r['seqlen']} | {r['pattern']} | "
        if "error" in u:
            error = " ".join(u["error"].split()).replace("|", "\\|")
            out.append(head + f"error: {error} |" + " - |" * 11)
            continue
        speedup = cu["step_ms"] / u["user_step_ms"] if cu.get("step_ms") else None
        warm = u["user_step_warmup_ms"] / cu["step_ms"] if cu.get("step_ms") and u.get("user_step_warmup_ms") else None
        out.append(
            head + f"{fmt(u['user_fwd_ms'], 2)} | {fmt(u['user_step_ms'], 2)} | {fmt(u['user_step_nokl_ms'], 2)} | "
            f"{fmt(u['user_step_klfwd_ms'], 2)} | {fmt(u.get('user_step_frozen_ms'), 2)} / "
            f"{fmt(u.get('user_step_frozen_nokl_ms'), 2)} | {fmt(u['kern_sum_ms'], 2)} | {fmt(u['overhead_pct'], 1)} | "
            f"{fmt(cu.get('step_ms'), 1)} | {fmt(speedup, 2)}{'x' if speedup else ''} | "
            f"{fmt(u['user_peak_gb'], 2)} | {fmt(cu.get('peak_gb'), 2)} | {fmt(u.get('user_step_warmup_ms'), 1)} "
            f"({fmt(warm, 2)}{'x' if warm else ''}) |")
    return out


if __name__ == "__main__":
    import numpy as np  # noqa: E402  (numpy only where the run happens)
    main()
