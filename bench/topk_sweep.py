#!/usr/bin/env python3
"""Top-k sweep of the training step on the user's path: where sparse stops paying off.

For each configuration and length, the README's call with its defaults and its backward
(bench/user_path.py: `out, kl = msa_attention(q, k, v, qp, kp, topk=K, cu_seqlens=cu,
max_seqlen=T)`, then `torch.autograd.backward([out, kl], [dout, 1])`, 3 calls back to back per
sample, median) at every topk, next to cuDNN's dense causal fwd+bwd in the same process. The
speed-up is cuDNN's step time over ours. Selections of the given pattern (docs/performance.md).

    python3 bench/topk_sweep.py                                    # m3 and fmsa, 32k and 128k
    python3 bench/topk_sweep.py --configs fmsa --seqlens 32768 --topks 4,16
    python3 bench/topk_sweep.py --plot bench/results/topk_sweep.latest.json   # its plot again

Appends one row per point to <out>/topk_sweep.md (stamped with the UTC date, the commit, the GPU,
its clocks and the command) and overwrites <out>/topk_sweep.latest.json and, with matplotlib,
<out>/topk_sweep.latest.png. <out> is --out, else $OUT, else bench/results; where <out> has no table
yet, --results-dir's (default bench/results) is copied there first (bench/README.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_bench  # noqa: E402  (the tables, the stamps and the cuDNN peer)


def speedups(result: dict) -> dict:
    """{(config, T): [(topk, speed-up over cuDNN), ...]} of a result's rows, in topk order;
    rows whose step failed are left out."""
    out = {}
    for r in result["rows"]:
        if r.get("step_ms") and r.get("cudnn_step_ms"):
            out.setdefault((r["config"], r["seqlen"]), []).append((r["topk"], r["cudnn_step_ms"] / r["step_ms"]))
    return {k: sorted(v) for k, v in out.items()}


SWEEP_TITLE = "Top-k sweep of the user's step (bench/topk_sweep.py)"
SWEEP_INTRO = (
    "One row per configuration, length and topk, appended by bench/topk_sweep.py: the README's call with its "
    "defaults and its backward (bench/user_path.py; ms, median of 3 calls back to back per sample) at every topk, "
    "next to cuDNN's dense causal fwd+bwd (torch SDPA, enable_gqa) in the same process; speed-up = cuDNN's time / "
    "ours. share of the blocks = topk x 128 / T. Raw rows of the latest run: topk_sweep.latest.json (and its plot, "
    "topk_sweep.latest.png).")


def sweep_columns():
    def share(m, r):
        return f"{min(1.0, r['topk'] * 128 / r['seqlen']):.1%}"

    def step(m, r):
        return f"{r['step_ms']:.2f}" if r.get("step_ms") else f"error: {r.get('error', '?')[:60]}"

    def speedup(m, r):
        return f"**{r['cudnn_step_ms'] / r['step_ms']:.2f}x**" if r.get("step_ms") and r.get("cudnn_step_ms") else "-"

    return run_bench.stamp_columns() + [
        ("pattern", lambda m, r: m.get("pattern", "-")),
        ("config", lambda m, r: r["config"]),
        ("T", lambda m, r: r["seqlen"]),
        ("topk", lambda m, r: r["topk"]),
        ("share of the blocks", share),
        ("step ms", step),
        ("cuDNN fwd+bwd ms", lambda m, r: run_bench.fmt(r.get("cudnn_step_ms"), 1)),
        ("speed-up", speedup),
        ("peak GB ours", lambda m, r: run_bench.fmt(r.get("peak_gb"), 2)),
        ("peak GB cuDNN", lambda m, r: run_bench.fmt(r.get("cudnn_peak_gb"), 2)),
    ]


def rows_text(result: dict) -> str:
    """The table lines of a result's rows, header first (what a run appends, for printing)."""
    cols = sweep_columns()
    lines = run_bench.header_lines(cols) + [run_bench.row_line(cols, result, r) for r in result["rows"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> str | None:
    """Speed-up over cuDNN against topk, one line per (config, T); None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (cfg, T), pts in sorted(speedups(result).items()):
        ax.plot([k for k, _ in pts], [s for _, s in pts], marker="o", label=f"{cfg}, {T // 1024}k tokens")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    topks = sorted({r["topk"] for r in result["rows"]})
    ax.set_xticks(topks, [str(k) for k in topks])
    ax.set_yscale("log")
    ax.set_xlabel("topk (128-token blocks per query and proxy head)")
    ax.set_ylabel("training step speed-up over cuDNN dense")
    ax.set_title(f"flashmsa training step vs cuDNN dense fwd+bwd ({result.get('pattern', '?')} selections, "
                 f"{gpu_name(result)})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gpu_name(result: dict) -> str:
    g = result.get("gpu", "?")
    return g.get("name", "?") if isinstance(g, dict) else str(g)


def write_plot(result: dict, json_path: str) -> str | None:
    """The plot of a result next to its JSON (<stem>.png, stem without .json); None without matplotlib."""
    stem = json_path[:-len(".json")] if json_path.endswith(".json") else json_path
    return plot(result, stem + ".png")


def parse_args(argv=None, command=None):
    full = list(sys.argv if argv is None else [sys.argv[0] if sys.argv else "bench/topk_sweep.py"] + list(argv))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(run_bench.REPO, "bench", "results"),
                    help="where the table is appended and the latest JSON written (default $OUT, else bench/results)")
    ap.add_argument("--results-dir", default=os.path.join(run_bench.REPO, "bench", "results"),
                    help="the table to continue: copied into --out first where --out has none (default bench/results)")
    ap.add_argument("--commit", default=None,
                    help="the commit to stamp (default: git's short HEAD, +dirty; $BENCH_COMMIT outside a checkout)")
    ap.add_argument("--configs", default="m3,fmsa")
    ap.add_argument("--seqlens", default="32768,131072")
    ap.add_argument("--topks", default="4,8,16,32,64")
    ap.add_argument("--pattern", default="clustered", choices=["clustered", "random"])
    ap.add_argument("--iters", type=int, default=5, help="samples per point (each 3 calls back to back)")
    ap.add_argument("--plot", default=None, help="a topk_sweep.latest.json: its PNG again and its rows printed; no run")
    args = ap.parse_args(full[1:])
    args.argv = list(command) if command is not None else full
    for name in args.configs.split(","):
        if name not in run_bench.CONFIGS:
            ap.error(f"unknown config {name!r} (choose from {','.join(run_bench.CONFIGS)})")
    try:
        args.seqlen_list = [int(x) for x in args.seqlens.split(",")]
        args.topk_list = [int(x) for x in args.topks.split(",")]
    except ValueError as e:
        ap.error(f"lengths and topks are comma-separated integers: {e}")
    return args


def run(args) -> dict:
    import torch

    import user_path
    dev = torch.device("cuda")
    info = run_bench.gpu_info()
    result = dict(run_bench.run_meta(args, info), pattern=args.pattern, rows=[])
    os.makedirs(args.out, exist_ok=True)
    table = run_bench.seed_table(args.out, args.results_dir, "topk_sweep.md")
    latest = os.path.join(args.out, "topk_sweep.latest.json")
    cols = sweep_columns()
    for name in args.configs.split(","):
        cfg = dict(run_bench.CONFIGS[name])
        for T in args.seqlen_list:
            run_bench.log(f"[sweep] cudnn dense causal {name} {T}")
            try:
                cud = run_bench.sdpa_times(cfg, T, "cudnn")
            except Exception as e:  # the rows then carry no speed-up
                cud = dict(error=str(e)[:300])
            torch.cuda.empty_cache()
            inputs = user_path.make_inputs(cfg, T, args.pattern, dev)
            for k in args.topk_list:
                run_bench.log(f"[sweep] user step {name} {T} topk {k}")
                step, clear, _ = user_path.training_step(inputs, k)
                row = dict(config=name, seqlen=T, topk=k, cudnn_step_ms=cud.get("step_ms"),
                           cudnn_peak_gb=cud.get("peak_gb"))
                if "error" in cud:
                    row["cudnn_error"] = cud["error"]
                try:
                    row["step_ms"] = user_path.median_ms(step, clear, args.iters, 2)
                    clear()
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    step()
                    torch.cuda.synchronize()
                    row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
                except Exception as e:  # reported in the row (a topk past a length's blocks, memory)
                    row["error"] = str(e)[:300]
                clear()
                torch.cuda.empty_cache()
                row["clocks"] = run_bench.sample_clocks(info)
                result["rows"].append(row)
                print(run_bench.append_rows(table, SWEEP_TITLE, SWEEP_INTRO, cols, result, [row])[-1], flush=True)
                run_bench.write_latest(latest, {k: v for k, v in result.items() if k != "rows"}, result["rows"])
            del inputs, step, clear  # the closures hold the inputs: free them before the next cuDNN run
            torch.cuda.empty_cache()
    png = write_plot(result, latest)
    run_bench.log(f"[sweep] {len(result['rows'])} rows appended to {table}; raw: {latest}"
                  + (f"; plot: {png}" if png else " (no matplotlib: no plot)"))
    return result


def main(argv=None, command=None):
    args = parse_args(argv, command)
    if args.plot:
        with open(args.plot) as f:
            result = json.load(f)
        png = write_plot(result, os.path.abspath(args.plot))
        print(rows_text(result))
        print(f"plot: {png}" if png else "no matplotlib: no plot")
        return result
    return run(args)


if __name__ == "__main__":
    main()
