#!/usr/bin/env python3
"""Top-k sweep of the training step on the user's path (issue 16): where sparse stops paying off.

For each configuration and length, the README's call with its defaults and its backward
(bench/user_path.py: `out, kl = msa_attention(q, k, v, qp, kp, topk=K, cu_seqlens=cu,
max_seqlen=T)`, then `torch.autograd.backward([out, kl], [dout, 1])`, 3 calls back to back per
sample, median) at every topk, next to cuDNN's dense causal fwd+bwd in the same process. The
speed-up is cuDNN's step time over ours. Selections of the given BENCHMARKS.md pattern.

    python3 bench/topk_sweep.py --out DIR                          # m3 and fmsa, 32k and 128k
    python3 bench/topk_sweep.py --out DIR --configs fmsa --seqlens 32768 --topks 4,16
    python3 bench/topk_sweep.py --plot DIR/topk-sweep.json         # the PNG and table again

Writes DIR/topk-sweep.{json,md,png} (the PNG needs matplotlib) and prints the table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def speedups(result: dict) -> dict:
    """{(config, T): [(topk, speed-up over cuDNN), ...]} of a result's rows, in topk order;
    rows whose step failed are left out."""
    out = {}
    for r in result["rows"]:
        if r.get("step_ms") and r.get("cudnn_step_ms"):
            out.setdefault((r["config"], r["seqlen"]), []).append((r["topk"], r["cudnn_step_ms"] / r["step_ms"]))
    return {k: sorted(v) for k, v in out.items()}


def markdown(result: dict) -> str:
    lines = [f"GPU {result['gpu']}, torch {result['torch']}, {result['date']}, {result['pattern']} selections. "
             f"Command: `{result['command']}`.", "",
             "| config | T | topk | share of the blocks | step ms | cuDNN fwd+bwd ms | speed-up | peak GB ours | "
             "peak GB cuDNN |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        step = f"{r['step_ms']:.2f}" if r.get("step_ms") else f"error: {r.get('error', '?')[:60]}"
        sp = f"**{r['cudnn_step_ms'] / r['step_ms']:.2f}x**" if r.get("step_ms") and r.get("cudnn_step_ms") else "-"
        share = min(1.0, r["topk"] * 128 / r["seqlen"])
        peak = f"{r['peak_gb']:.2f}" if r.get("peak_gb") else "-"
        cud = f"{r['cudnn_step_ms']:.1f}" if r.get("cudnn_step_ms") else "-"
        cpeak = f"{r['cudnn_peak_gb']:.2f}" if r.get("cudnn_peak_gb") else "-"
        lines.append(f"| {r['config']} | {r['seqlen']} | {r['topk']} | {share:.1%} | {step} | {cud} | {sp} | {peak} "
                     f"| {cpeak} |")
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
    ax.set_title(f"flashmsa training step vs cuDNN dense fwd+bwd ({result['pattern']} selections, "
                 f"{result['gpu']})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(result: dict, out: str) -> None:
    with open(os.path.join(out, "topk-sweep.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(os.path.join(out, "topk-sweep.md"), "w") as f:
        f.write(md)
    png = plot(result, os.path.join(out, "topk-sweep.png"))
    print(md)
    print(f"wrote {os.path.join(out, 'topk-sweep.json')}, .md" + (f" and {png}" if png else " (no matplotlib: no PNG)"))


def run(args) -> dict:
    import torch

    import run_bench
    import user_path
    dev = torch.device("cuda")
    result = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                  pattern=args.pattern, command="python3 bench/topk_sweep.py " + " ".join(sys.argv[1:]), rows=[])
    for name in args.configs.split(","):
        cfg = dict(run_bench.CONFIGS[name])
        for T in (int(x) for x in args.seqlens.split(",")):
            run_bench.log(f"[sweep] cudnn dense causal {name} {T}")
            cud = run_bench.sdpa_times(cfg, T, "cudnn")
            torch.cuda.empty_cache()
            inputs = user_path.make_inputs(cfg, T, args.pattern, dev)
            for k in (int(x) for x in args.topks.split(",")):
                run_bench.log(f"[sweep] user step {name} {T} topk {k}")
                step, clear, _ = user_path.training_step(inputs, k)
                row = dict(config=name, seqlen=T, topk=k, cudnn_step_ms=cud["step_ms"], cudnn_peak_gb=cud["peak_gb"])
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
                result["rows"].append(row)
                with open(os.path.join(args.out, "topk-sweep.json"), "w") as f:  # a run cut short keeps its rows
                    json.dump(result, f, indent=1)
            del inputs, step, clear  # the closures hold the inputs: free them before the next cuDNN run
            torch.cuda.empty_cache()
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--configs", default="m3,fmsa")
    ap.add_argument("--seqlens", default="32768,131072")
    ap.add_argument("--topks", default="4,8,16,32,64")
    ap.add_argument("--pattern", default="clustered", choices=["clustered", "random"])
    ap.add_argument("--iters", type=int, default=5, help="samples per point (each 3 calls back to back)")
    ap.add_argument("--plot", default=None, help="a topk-sweep.json: write its table and PNG again, no run")
    args = ap.parse_args(argv)
    if args.plot:
        with open(args.plot) as f:
            result = json.load(f)
        write(result, os.path.dirname(os.path.abspath(args.plot)))
        return result
    os.makedirs(args.out, exist_ok=True)
    result = run(args)
    write(result, args.out)
    return result


if __name__ == "__main__":
    main()
