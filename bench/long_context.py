#!/usr/bin/env python3
"""Long context on one GPU (docs/distributed.md, "How long on one GPU"): the README's training step
(`out, kl = flashmsa.msa_attention(q, k, v, qp, kp, topk=16, cu_seqlens=cu, max_seqlen=T)`, then
`torch.autograd.backward([out, kl], [dout, 1])`) at lengths where the whole user's-path protocol
(user_path.py: eight timings per row, among them the dense warmup mode) would take minutes per row.

Per (config, T, pattern): the selection alone (flashmsa.msa_select) and, with --fp8, the fp8 selection alone
(fp8_selection=True: its time, its speed-up and its set recall, the share of the input dtype's selected non-local
blocks that it also selects, per (token, proxy head) averaged), the default step, the peak memory
of one step (torch's allocator: the library takes its workspaces from it), the memory the inputs hold,
the kl value; per T the peer cuDNN SDPA dense causal f+b where T <= --dense-max (above it '-': the
ratio column then uses the quadratic extrapolation of the longest measured cuDNN step, marked '~').
A step that does not fit is a row with the allocator's message. Appends to <out>/long_context.md
and overwrites <out>/long_context.latest.json (bench/README.md; <out> as run_bench.py's).

    python3 bench/long_context.py --configs m3 --seqlens 131072,262144,524288,1048576 --dense-max 262144
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # 1M: one 40 GiB workspace among 16 GiB tensors

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import run_bench as RB  # noqa: E402

TITLE = "Long context on one GPU (bench/long_context.py)"
INTRO = (
    "One row per configuration, length and selection pattern, appended by bench/long_context.py. The README's call "
    "and its backward (defaults: topk 16, the kl term on) timed end to end, ms, median of --iters single calls after "
    "one warm-up; select: flashmsa.msa_select alone on the same inputs; peak GB: torch's peak allocation during one "
    "step (inputs, outputs, gradients, the library's workspaces), inputs GB: q, k, v, qp, kp and dout; cuDNN: torch "
    "SDPA dense causal fwd+bwd measured up to --dense-max, '~' an extrapolation (time x (T / T_measured)^2) from the "
    "longest measured length. Raw rows of the latest run: long_context.latest.json.")


def columns():
    def u(key, nd=2):
        return lambda m, r: RB.fmt(r.get(key), nd)  # (a row cut by an error keeps what came before it)

    def err(m, r):
        return r.get("error", "")

    def cudnn(m, r):
        c = r.get("cudnn") or {}
        if "error" in c:
            return "err"
        if c.get("step_ms") is not None:
            return RB.fmt(c["step_ms"], 1)
        return "~" + RB.fmt(r["cudnn_extrapolated_ms"], 0) if r.get("cudnn_extrapolated_ms") else "-"

    def speedup(m, r):
        c = (r.get("cudnn") or {}).get("step_ms") or r.get("cudnn_extrapolated_ms")
        s = RB.ratio(c, r.get("step_ms"))
        return s if s == "-" or (r.get("cudnn") or {}).get("step_ms") else "~" + s

    return RB.stamp_columns() + [
        ("config", lambda m, r: r["config"]),
        ("T", lambda m, r: r["seqlen"]),
        ("pattern", lambda m, r: r["pattern"]),
        ("select ms", u("select_ms")),
        ("**step** ms", u("step_ms")),
        ("fp8 select ms", u("fp8_select_ms")),
        ("fp8 speed-up", lambda m, r: RB.ratio(r.get("select_ms"), r.get("fp8_select_ms"))),
        ("fp8 set recall", u("fp8_set_recall", 4)),
        ("select share", lambda m, r: "-" if "error" in r or not r.get("step_ms") else
         f"{100 * r['select_ms'] / r['step_ms']:.0f}%"),
        ("peak GB", lambda m, r: RB.fmt(r.get("peak_gb"), 2)),
        ("inputs GB", u("inputs_gb")),
        ("GPU GB", lambda m, r: RB.fmt(r.get("gpu_total_gb"), 1)),
        ("kl", u("kl", 4)),
        ("cuDNN fwd+bwd ms", cudnn),
        ("cuDNN peak GB", lambda m, r: RB.peer_cell({"peers": {"cudnn": r.get("cudnn")}}, "cudnn", "peak_gb")),
        ("step vs cuDNN", speedup),
        ("error", err),
    ]


def lm_long_context():
    """examples/lm_long_context.py as a module (its selection statistics), after user_path picked flashmsa."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("lm_long_context", os.path.join(RB.REPO, "examples",
                                                                                  "lm_long_context.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def measure(cfg, T, pattern, iters, log, r, fp8=False):
    """One row's numbers on the GPU, into r as they come (raises on out-of-memory; the caller records it next to
    what was measured before it)."""
    import torch

    import user_path
    flashmsa = user_path.import_flashmsa()
    inputs = user_path.make_inputs(cfg, T, pattern, torch.device("cuda"))
    step, clear, dout = user_path.training_step(inputs, cfg["topk"])
    r["inputs_gb"] = sum(x.numel() * x.element_size() for x in list(inputs[:5]) + [dout]) / 1e9
    q, k, v, qp, kp, cu = inputs
    log("select")

    def select():
        with torch.no_grad():
            flashmsa.msa_select(qp.detach(), kp.detach(), cfg["topk"], cu_seqlens=cu, max_seqlen=T)
    r["select_ms"] = user_path.median_ms(select, lambda: None, iters, 1, reps=1)
    if fp8:
        log("fp8 select")

        def select8():
            with torch.no_grad():
                return flashmsa.msa_select(qp.detach(), kp.detach(), cfg["topk"], cu_seqlens=cu, max_seqlen=T,
                                           fp8_selection=True)
        r["fp8_select_ms"] = user_path.median_ms(select8, lambda: None, iters, 1, reps=1)
        with torch.no_grad():
            want = flashmsa.msa_select(qp.detach(), kp.detach(), cfg["topk"], cu_seqlens=cu, max_seqlen=T)
            r["fp8_set_recall"] = lm_long_context().set_recall(want, select8())
        del want
        torch.cuda.empty_cache()
    log("step")
    last = {}

    def run():
        last["kl"] = step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    clear()
    run()  # also the warm-up
    torch.cuda.synchronize()
    r["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    r["step_ms"] = user_path.median_ms(run, clear, iters, 0, reps=1)
    r["kl"] = last["kl"].item()
    clear()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="m3")
    ap.add_argument("--seqlens", default="131072,262144,524288,1048576")
    ap.add_argument("--patterns", default="clustered,random")
    ap.add_argument("--dense-max", type=int, default=262144, help="the longest T cuDNN dense f+b runs at")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(RB.REPO, "bench", "results"))
    ap.add_argument("--results-dir", default=os.path.join(RB.REPO, "bench", "results"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--fp8", action="store_true", help="also the fp8 selection alone: time, speed-up, set recall")
    full = [sys.argv[0]] + list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(full[1:])
    args.argv = full
    import torch

    info = RB.gpu_info()
    meta = RB.run_meta(args, info)
    path = RB.seed_table(args.out, args.results_dir, "long_context.md")
    latest = os.path.join(args.out, "long_context.latest.json")
    total = torch.cuda.get_device_properties(0).total_memory / 1e9
    rows = []
    for name in args.configs.split(","):
        cfg = RB.CONFIGS[name]
        lengths = [int(x) for x in args.seqlens.split(",")]
        # cuDNN first, shortest to longest, so that every row above --dense-max gets its extrapolation whatever
        # the order of --seqlens (the longest first lands the most valuable rows before a time limit)
        dense_at, longest = {}, None  # longest: (T, cuDNN step ms) of the longest measured length
        for T in sorted(t for t in set(lengths) if t <= args.dense_max):
            RB.log(f"[long] cudnn dense causal {name} {T}")
            try:
                dense_at[T] = RB.sdpa_times(cfg, T, "cudnn", iters=3)
                longest = (T, dense_at[T]["step_ms"])
            except Exception as e:
                dense_at[T] = dict(error=str(e)[:300])
            torch.cuda.empty_cache()
        for T in lengths:
            dense = dense_at.get(T)
            for pattern in args.patterns.split(","):
                row = dict(config=name, seqlen=T, pattern=pattern, cudnn=dense, gpu_total_gb=total)
                if dense is None and longest:
                    row["cudnn_extrapolated_ms"] = longest[1] * (T / longest[0]) ** 2
                try:
                    measure(cfg, T, pattern, args.iters, lambda what: RB.log(f"[long] {name} {T} {pattern}: {what}"),
                            row, args.fp8)
                except torch.cuda.OutOfMemoryError as e:
                    row["error"] = "out of memory: " + " ".join(str(e).split())[:240]
                    row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
                torch.cuda.empty_cache()
                row["clocks"] = RB.sample_clocks(info)
                rows.append(row)
                print(RB.append_rows(path, TITLE, INTRO, columns(), meta, [row])[-1], flush=True)
                RB.write_latest(latest, meta, rows)
    RB.log(f"[long] {len(rows)} rows appended to {path}; raw: {latest}")


if __name__ == "__main__":
    main()
