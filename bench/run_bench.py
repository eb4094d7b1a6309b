#!/usr/bin/env python3
"""The benchmark protocol (docs/performance.md) in one process on the GPU machine: flashmsa's kernels
(flashmsa_bench) and the peers measured in the same run, and the user's path (bench/user_path.py: the
README's Python call timed end to end next to the kernel sum).

Peers (--peers): cudnn and fa2, torch SDPA dense causal (enable_gqa); flex, FlexAttention serving the
same per-token selection (union block mask + per-token mask_mod; only at the --flex lengths);
cudnn_bsa, the SM90 block-sparse attention of nvidia-cudnn-frontend (>= 1.32.0, its 128-token blocks)
fed the union of the selections of each 128-query tile (skipped, with the reason printed, where the
package is missing or the GPU is not supported); torch_topk, a chunked torch top-k indexer for the
selection stage. Peers that serve a selection get flashmsa's: flashmsa_bench's (--save-indices) or,
under --user-only, flashmsa.msa_select on the user's path's own inputs.

Results (bench/README.md): one row per (config, T, pattern) APPENDED to
    <out>/kernels.md     the kernels and the peers (not under --user-only)
    <out>/user_path.md   the user's path and the peers (unless --no-user-path)
each row stamped with the UTC date, the commit, the GPU, its clocks and the command; the raw rows of
this run overwrite <out>/kernels.latest.json and <out>/user_path.latest.json. <out> is --out, else
$OUT, else bench/results. When <out> has no table yet, the one in --results-dir (default
bench/results) is copied there first, so a run that writes under $OUT on another machine returns the
whole table, ready to copy back over bench/results/.

    python3 bench/run_bench.py [--seqlens 16384,32768] [--configs m3,fmsa] [--patterns clustered,random]
    python3 bench/run_bench.py --user-only --configs m3 --seqlens 32768,65536,131072 \\
        --peers cudnn,fa2,flex,cudnn_bsa --flex 32768
(from the repo root; binaries in .gpu/, --bin). bench/user_path.py ARGS runs --user-only ARGS.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:  # user_path, when this file is loaded by its path
    sys.path.insert(0, HERE)

CONFIGS = {"m3": dict(Hq=64, Hkv=4, Hp=4, Hpk=1, topk=16), "fmsa": dict(Hq=16, Hkv=2, Hp=4, Hpk=1, topk=16)}
D = 128
BK = 128
PEERS = ("cudnn", "fa2", "flex", "cudnn_bsa", "torch_topk")
PATTERNS = ("clustered", "random", "trained")  # user_path.py's draws and tools/patterns.cpp's
CUDNN_FRONTEND_PIN = "nvidia-cudnn-frontend==1.32.0"  # the version whose SM90 block-sparse API the peer calls
BSA_TOLERANCE = 0.05  # max error / max value of a bf16 attention output against an fp32 reference


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# What a row is stamped with: date, commit, GPU, clocks, command.

def utc_stamp(now: datetime.datetime | None = None) -> str:
    """'2026-12-07 03:20Z': the UTC date and minute."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return now.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%MZ")


def git_commit(repo: str = REPO) -> str | None:
    """The short hash of HEAD, with "+dirty" when tracked files differ from it (bench/results/, which
    the harness itself appends to, excepted); None outside a git checkout (a copied tree)."""
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=20)
        if head.returncode != 0 or not head.stdout.strip():
            return None
        st = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no", "--", ".",
                             ":(exclude)bench/results"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if st.returncode != 0 or st.stdout.strip() else "")


SMI_FIELDS = ("name", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem", "power.limit", "driver_version")


def parse_smi(line: str) -> dict:
    """One line of `nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits` -> dict
    (name, sm_mhz, mem_mhz, max_sm_mhz, max_mem_mhz, power_limit_w, driver); numbers that nvidia-smi
    reports as [N/A] or that do not parse are None."""
    f = [x.strip() for x in line.split(",")]
    if len(f) < len(SMI_FIELDS):
        raise ValueError(f"expected {len(SMI_FIELDS)} fields, got {line!r}")

    def num(x):
        try:
            return float(x)
        except ValueError:
            return None

    return dict(name=f[0], sm_mhz=num(f[1]), mem_mhz=num(f[2]), max_sm_mhz=num(f[3]), max_mem_mhz=num(f[4]),
                power_limit_w=num(f[5]), driver=f[6])


def query_smi(device_uuid: str | None = None) -> dict | None:
    """nvidia-smi's view of the GPU (parse_smi's dict) or None without nvidia-smi. device_uuid picks
    the GPU that torch uses (CUDA_VISIBLE_DEVICES renumbers them); else the first."""
    cmd = ["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"]
    for extra in ([["-i", device_uuid]] if device_uuid else []) + [[]]:
        try:
            r = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        lines = [l for l in r.stdout.splitlines() if l.strip()]
        if r.returncode == 0 and lines:
            try:
                return parse_smi(lines[0])
            except ValueError:
                return None
    return None


def gpu_info() -> dict:
    """name (torch's), capability, the clocks and power limit (nvidia-smi; torch.cuda.clock_rate()
    for the SM clock where nvidia-smi is missing) and torch's version."""
    import torch
    props = torch.cuda.get_device_properties(0)
    uuid = getattr(props, "uuid", None)
    info = dict(name=torch.cuda.get_device_name(0), capability="%d.%d" % torch.cuda.get_device_capability(0),
                torch=torch.__version__, uuid=None if uuid is None else str(uuid))
    smi = query_smi(None if uuid is None else "GPU-" + str(uuid).removeprefix("GPU-"))
    if smi:
        info.update({k: v for k, v in smi.items() if k != "name"})
    else:
        try:
            info["sm_mhz"] = float(torch.cuda.clock_rate(0))
        except Exception:  # needs pynvml; the clocks then read "-"
            pass
    return info


def sample_clocks(info: dict) -> dict:
    """The current SM and memory clocks (right after a measurement: the clocks it ran at), else {}."""
    smi = query_smi(None if not info.get("uuid") else "GPU-" + info["uuid"].removeprefix("GPU-"))
    return {} if not smi else dict(sm_mhz=smi["sm_mhz"], mem_mhz=smi["mem_mhz"])


def clocks_cell(clocks: dict, info: dict) -> str:
    """'1980/3201 (max 1980/3201)': SM/memory MHz sampled after the row, and the maxima."""
    def mhz(x):
        return "-" if x is None else f"{x:.0f}"
    now = f"{mhz(clocks.get('sm_mhz'))}/{mhz(clocks.get('mem_mhz'))}"
    return now + f" (max {mhz(info.get('max_sm_mhz'))}/{mhz(info.get('max_mem_mhz'))})"


def gpu_cell(info: dict) -> str:
    w = info.get("power_limit_w")
    return info.get("name", "?") + (f" ({w:.0f} W)" if w else "")


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed from the repo root: python3 <script relative to the repo> <arguments>."""
    argv = list(sys.argv if argv is None else argv)
    script = os.path.abspath(argv[0]) if argv else ""
    if script.startswith(REPO + os.sep):
        script = os.path.relpath(script, REPO)
    return shlex.join(["python3", script] + argv[1:])


def run_meta(args, info: dict) -> dict:
    return dict(date=utc_stamp(), commit=args.commit or git_commit() or os.environ.get("BENCH_COMMIT") or "unknown",
                gpu=info, command=command_line(args.argv))


# ----------------------------------------------------------------------------------------------
# Tables: one markdown table per benchmark, rows appended; the latest run's raw JSON.

def fmt(x, nd=1):
    return "-" if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))) else f"{x:.{nd}f}"


def ms_tf(ms, tf, nd=2):
    """'7.05 (603)': ms (effective TF/s), '-' when not measured."""
    return "-" if ms is None else f"{fmt(ms, nd)} ({fmt(tf, 0)})"


def ratio(num, den, nd=2):
    return f"{num / den:.{nd}f}x" if num and den else "-"


def cell_text(x) -> str:
    return " ".join(str(x).split()).replace("|", "\\|")


def stamp_columns():
    """The columns every table starts with: (header, fn(meta, row) -> text)."""
    return [("date (UTC)", lambda m, r: m["date"]),
            ("commit", lambda m, r: m["commit"]),
            ("GPU", lambda m, r: gpu_cell(m["gpu"])),
            ("clocks MHz SM/mem", lambda m, r: clocks_cell(r.get("clocks", {}), m["gpu"])),
            ("torch", lambda m, r: m["gpu"].get("torch", "-")),
            ("command", lambda m, r: f"`{m['command']}`")]


def header_lines(columns) -> list[str]:
    return ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]


def row_line(columns, meta, row) -> str:
    return "| " + " | ".join(cell_text(fn(meta, row)) for _, fn in columns) + " |"


def seed_table(out_dir: str, results_dir: str, name: str) -> str:
    """<out_dir>/<name>: copied from <results_dir>/<name> first when out_dir has none and results_dir
    (a different folder) has one. Returns the path the run appends to."""
    dst = os.path.join(out_dir, name)
    src = os.path.join(results_dir, name)
    if (not os.path.exists(dst) and os.path.isfile(src)
            and os.path.realpath(out_dir) != os.path.realpath(results_dir)):
        os.makedirs(out_dir, exist_ok=True)
        shutil.copyfile(src, dst)
    return dst


def append_rows(path: str, title: str, intro: str, columns, meta: dict, rows: list[dict]) -> list[str]:
    """Appends one line per row to the markdown table in `path`. A new file gets the title, the intro
    and the header; a file whose last header differs from `columns` (a column added since) gets a
    new header first, so every table in it stays well formed. Returns the lines appended."""
    head = header_lines(columns)
    lines = []
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        lines += [f"# {title}", "", intro, ""] + head
    else:
        with open(path) as f:
            text = f.read()
        last = [l for l in text.splitlines() if l.startswith("| date (UTC) |")]
        if not last or last[-1] != head[0]:
            lines += ([""] if text.endswith("\n") else ["", ""]) + head
        elif not text.endswith("\n"):
            lines.append("")
    lines += [row_line(columns, meta, r) for r in rows]
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def write_latest(path: str, meta: dict, rows: list[dict]) -> None:
    """The raw rows of this run (overwritten after every row: a run cut short keeps what it measured)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    os.replace(tmp, path)


def peer(r, name):
    return r.get("peers", {}).get(name) or {}


def peer_step(r, name):
    p = peer(r, name)
    return p.get("step_ms")


def peer_cell(r, name, key, tf_key=None, nd=2):
    """A peer's number, 'err' where it failed, '-' where it did not run (skipped, not asked)."""
    p = peer(r, name)
    if "error" in p:
        return "err"
    if tf_key:
        return ms_tf(p.get(key), p.get(tf_key), nd)
    return fmt(p.get(key), nd)


KERNEL_TITLE = "Kernels and peers (bench/run_bench.py)"
KERNEL_INTRO = (
    "One row per configuration, length and selection pattern, appended by bench/run_bench.py; times in ms "
    "(median, CUDA events), effective TFLOP/s in parentheses (only the work the spec requires, ARCHITECTURE.md; "
    "peers serving the selection are credited the same work). union/128: distinct blocks selected by a 128-query "
    "tile / topk. torch top-k: a chunked torch indexer for the selection stage. step = select + fwd + bwd. "
    "deterministic: the deterministic backward (x its default). Peers, same process: cuDNN and FA2 torch SDPA dense "
    "causal; Flex: FlexAttention on the same per-token selection; cuDNN BSA: nvidia-cudnn-frontend's block-sparse "
    "attention on the union of the selections per 128-query tile (its own block whole: no causal mask), "
    "fwd+bwd including the K/V head expansion its MHA-only backward needs. 'err': the peer failed (kernels.latest.json "
    "has the message); '-': not measured. Raw rows of the latest run: kernels.latest.json.")


def slower(r, key, base):
    """'20.76 (1.20x)': an option's time and its ratio to the default's."""
    return "-" if r.get(key) is None else f"{fmt(r[key], 2)} ({ratio(r[key], r.get(base))})"


def kernel_columns():
    return stamp_columns() + [
        ("config", lambda m, r: r["config"]),
        ("T", lambda m, r: r["seqlen"]),
        ("pattern", lambda m, r: r["pattern"]),
        ("union/128", lambda m, r: fmt(r.get("union_factor_128"), 2)),
        ("select ms (TF/s)", lambda m, r: ms_tf(r.get("select_ms"), r.get("select_tflops"))),
        ("torch top-k ms", lambda m, r: fmt(r.get("peers", {}).get("torch_topk_indexer_ms"), 1)),
        ("fwd train ms (TF/s)", lambda m, r: ms_tf(r.get("fwd_train_ms"), r.get("fwd_train_tflops"))),
        ("fwd infer ms (TF/s)", lambda m, r: ms_tf(r.get("fwd_infer_ms"), r.get("fwd_infer_tflops"))),
        ("dense fwd ms (TF/s)", lambda m, r: ms_tf(r.get("dense_fwd_ms"), r.get("dense_fwd_tflops"))),
        ("bwd ms (TF/s)", lambda m, r: ms_tf(r.get("bwd_ms"), r.get("bwd_tflops"))),
        ("bwd main alone ms (TF/s)", lambda m, r: ms_tf(r.get("bwd_main_ms"), r.get("bwd_main_tflops"))),
        ("dense (warmup) bwd ms (TF/s)", lambda m, r: ms_tf(r.get("dense_bwd_ms"), r.get("dense_bwd_tflops"))),
        ("**step** ms (TF/s)", lambda m, r: ms_tf(r.get("step_ms"), r.get("step_tflops"))),
        ("step GB", lambda m, r: fmt(r.get("step_gb"), 2)),
        ("deterministic bwd ms (x)", lambda m, r: slower(r, "bwd_deterministic_ms", "bwd_ms")),
        ("deterministic dense bwd ms (x)", lambda m, r: slower(r, "dense_bwd_deterministic_ms", "dense_bwd_ms")),
        ("fwd + out_lo ms", lambda m, r: fmt(r.get("fwd_train_out_lo_ms"), 2)),
        ("bwd + out_lo ms", lambda m, r: fmt(r.get("bwd_out_lo_ms"), 2)),
        ("cuDNN fwd ms (TF/s)", lambda m, r: peer_cell(r, "cudnn", "fwd_ms", "fwd_tflops")),
        ("cuDNN fwd+bwd ms", lambda m, r: peer_cell(r, "cudnn", "step_ms", nd=1)),
        ("cuDNN peak GB", lambda m, r: peer_cell(r, "cudnn", "peak_gb")),
        ("FA2 fwd ms (TF/s)", lambda m, r: peer_cell(r, "fa2", "fwd_ms", "fwd_tflops")),
        ("FA2 fwd+bwd ms", lambda m, r: peer_cell(r, "fa2", "step_ms", nd=1)),
        ("Flex fwd ms (TF/s)", lambda m, r: peer_cell(r, "flex", "fwd_ms", "fwd_tflops")),
        ("Flex fwd+bwd ms", lambda m, r: peer_cell(r, "flex", "step_ms", nd=1)),
        ("cuDNN BSA fwd ms (TF/s)", lambda m, r: peer_cell(r, "cudnn_bsa", "fwd_ms", "fwd_tflops")),
        ("cuDNN BSA fwd+bwd ms", lambda m, r: peer_cell(r, "cudnn_bsa", "step_ms", nd=1)),
        ("step vs cuDNN", lambda m, r: ratio(peer_step(r, "cudnn"), r.get("step_ms"))),
    ]


USER_TITLE = "The user's path and peers (bench/run_bench.py, bench/user_path.py)"
USER_INTRO = (
    "One row per configuration, length and selection pattern, appended by bench/run_bench.py (--user-only, or with "
    "the kernels). The README's call `out, kl = flashmsa.msa_attention(q, k, v, qp, kp, topk=16, cu_seqlens=cu, "
    "max_seqlen=T)` and `torch.autograd.backward([out, kl], [dout, 1])`, timed end to end (ms, median of 3 calls back "
    "to back per sample): its forward, its step with the defaults, with compute_kl=False and compute_kl=True, with qp "
    "and kp detached (a frozen indexer: default / compute_kl=False), in warmup (dense) mode; the kernel sum is the "
    "library's calls of the default step without autograd (overhead = step / kernel sum - 1); peak GB of one default "
    "step. union/128: distinct blocks selected by a 128-query tile / topk, on these inputs. Peers, same process, "
    "fwd+bwd ms (the user's step speed-up over it): cuDNN and FA2 torch SDPA dense causal; Flex: FlexAttention on the "
    "call's own selection; cuDNN BSA: nvidia-cudnn-frontend's block-sparse attention on the union of that selection "
    "per 128-query tile (own block whole: no causal mask), K/V head expansion for its MHA-only backward included. "
    "'err': failed (user_path.latest.json has the message); '-': not measured.")


def user_cell(key, nd=2):
    def fn(m, r):
        u = r.get("user", {})
        return "-" if "error" in u else fmt(u.get(key), nd)
    return fn


def user_peer(name):
    def fn(m, r):
        p, u = peer(r, name), r.get("user", {})
        if "error" in p:
            return "err"
        if p.get("step_ms") is None:
            return "-"
        return f"{fmt(p['step_ms'], 1)} ({ratio(p['step_ms'], u.get('user_step_ms'))})"
    return fn


def user_columns():
    def fwd(m, r):
        u = r.get("user", {})
        return "error: " + u["error"] if "error" in u else fmt(u.get("user_fwd_ms"), 2)

    def frozen(m, r):
        u = r.get("user", {})
        if "error" in u:
            return "-"
        return f"{fmt(u.get('user_step_frozen_ms'), 2)} / {fmt(u.get('user_step_frozen_nokl_ms'), 2)}"

    return stamp_columns() + [
        ("config", lambda m, r: r["config"]),
        ("T", lambda m, r: r["seqlen"]),
        ("pattern", lambda m, r: r["pattern"]),
        ("union/128", lambda m, r: fmt(r.get("union_factor_128"), 2)),
        ("fwd ms", fwd),
        ("**step** ms", user_cell("user_step_ms")),
        ("step ms, compute_kl=False", user_cell("user_step_nokl_ms")),
        ("step ms, compute_kl=True", user_cell("user_step_klfwd_ms")),
        ("step ms, frozen proxy (default / kl off)", frozen),
        ("warmup (dense) step ms", user_cell("user_step_warmup_ms", 1)),
        ("kernel sum ms", user_cell("kern_sum_ms")),
        ("overhead %", user_cell("overhead_pct", 1)),
        ("peak GB", user_cell("user_peak_gb")),
        ("cuDNN fwd+bwd ms (x)", user_peer("cudnn")),
        ("FA2 fwd+bwd ms (x)", user_peer("fa2")),
        ("Flex fwd+bwd ms (x)", user_peer("flex")),
        ("cuDNN BSA fwd+bwd ms (x)", user_peer("cudnn_bsa")),
        ("cuDNN peak GB", lambda m, r: peer_cell(r, "cudnn", "peak_gb")),
    ]


# ----------------------------------------------------------------------------------------------
# Selections: the union per 128-query tile (what a tile-granular block-sparse kernel is fed) and
# the work the spec requires.

def tile_union(indices: np.ndarray, block: int = BK) -> tuple[np.ndarray, np.ndarray]:
    """indices [Hp, T, topk] (block ids, -1 padding; one sequence) -> (blocks [Hp, ntiles, U] int32,
    counts [Hp, ntiles] int32): for every proxy head and tile of `block` consecutive queries, the
    distinct blocks its tokens select, ascending, in the first counts[p, i] slots; the slots after
    them repeat the last one. U = the largest count (at least 1)."""
    Hp, T, _ = indices.shape
    nt = (T + block - 1) // block
    nb = nt  # keys and queries are the same sequence
    sel = np.zeros((Hp, nt, nb + 1), dtype=bool)
    idx = np.where((indices >= 0) & (indices < nb), indices, nb).astype(np.int64)
    sel[np.arange(Hp)[:, None, None], (np.arange(T) // block)[None, :, None], idx] = True
    sel = sel[:, :, :nb]
    counts = sel.sum(-1).astype(np.int32)
    U = max(1, int(counts.max()) if counts.size else 1)
    order = np.argsort(~sel, axis=-1, kind="stable")[:, :, :U].astype(np.int32)  # selected blocks first, ascending
    last = np.take_along_axis(order, np.maximum(counts - 1, 0)[:, :, None].astype(np.int64), axis=-1)
    slot = np.arange(U)[None, None, :]
    blocks = np.where(slot < counts[:, :, None], order, last).astype(np.int32)
    return blocks, counts


def union_factor(counts: np.ndarray, topk: int) -> float:
    """Mean over tiles and proxy heads of the distinct blocks per tile / topk (flashmsa_bench's union_factor_128)."""
    return float(counts.mean()) / topk if counts.size else float("nan")


def bsa_metadata(blocks: np.ndarray, counts: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """tile_union's per proxy head lists -> cuDNN BSA's (q2k_block_index [1, Hq, ntiles, U],
    q2k_block_nums [1, Hq, ntiles]) int32, query head h reading proxy head h // group."""
    return (np.ascontiguousarray(np.repeat(blocks, group, axis=0)[None], dtype=np.int32),
            np.ascontiguousarray(np.repeat(counts, group, axis=0)[None], dtype=np.int32))


def selected_pairs(indices: np.ndarray, group: int, block: int = BK) -> float:
    """(query head, key) pairs the spec requires for indices [Hp, T, topk]: the causal keys of each
    token's distinct valid blocks, times the query heads per proxy head."""
    Hp, T, K = indices.shape
    rows = np.sort(indices, axis=-1)
    first = np.ones_like(rows, dtype=bool)
    first[..., 1:] = rows[..., 1:] != rows[..., :-1]
    t = np.arange(T)[None, :, None]
    own = t // block
    keys = np.where(rows < own, block, np.where(rows == own, t % block + 1, 0))
    keys = np.where((rows >= 0) & first, keys, 0)
    return float(keys.sum(dtype=np.int64)) * group


# ----------------------------------------------------------------------------------------------
# Peers (CUDA).

def median_ms(fn, iters=10, warmup=3):
    """Median ms of fn over `iters` single timed calls (CUDA events) after `warmup` calls."""
    import user_path
    return user_path.median_ms(fn, lambda: None, iters, warmup, reps=1)


def sdpa_times(cfg, T, backend, iters=None):
    """torch SDPA dense causal (cuDNN or FA2): forward and fwd+bwd ms, peak GB of the steps; iters: the
    timed calls of each (default 10 forwards, 5 steps)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[backend]
    q = torch.randn(1, cfg["Hq"], T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, cfg["Hkv"], T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, cfg["Hkv"], T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(1, cfg["Hq"], T, D, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([be]):
        fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        t_fwd = median_ms(fwd, iters=iters or 10)

        def step():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            o.backward(do)
        torch.cuda.reset_peak_memory_stats()
        t_step = median_ms(step, iters=iters or 5)
        peak = torch.cuda.max_memory_allocated()
    flops = 4 * D * cfg["Hq"] * T * (T + 1) / 2
    return dict(fwd_ms=t_fwd, fwd_tflops=flops / t_fwd / 1e9, step_ms=t_step,
                step_tflops=3.5 * flops / t_step / 1e9, peak_gb=peak / 1e9)


def flex_times(cfg, T, indices, main_pairs):
    import torch
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    Hq, Hp = cfg["Hq"], cfg["Hp"]
    G = Hq // Hp
    nb = (T + BK - 1) // BK
    idx = torch.from_numpy(indices).cuda().long()  # [Hp, T, topk]
    sel = torch.zeros(Hp, T, nb + 1, dtype=torch.bool, device="cuda")
    sel.scatter_(2, torch.where(idx >= 0, idx, nb), True)
    sel = sel[:, :, :nb].contiguous()  # [Hp, T, nb]: token selects block
    padded = torch.zeros(Hp, nb * BK, nb, dtype=torch.bool, device="cuda")
    padded[:, :T] = sel
    tile = padded.view(Hp, nb, BK, nb).any(dim=2)  # [Hp, q-tile, kv-block]: the union
    del padded
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
    torch.cuda.reset_peak_memory_stats()
    t_step = median_ms(step, iters=5)
    peak = torch.cuda.max_memory_allocated()
    flops = 4 * D * main_pairs
    return dict(fwd_ms=t_fwd, fwd_tflops=flops / t_fwd / 1e9, step_ms=t_step, step_tflops=3.5 * flops / t_step / 1e9,
                peak_gb=peak / 1e9)


def cudnn_bsa_api():
    """((forward, backward), version) of nvidia-cudnn-frontend's block-sparse attention when it can run
    here, else (None, the reason). The forward takes GQA; the backward is MHA only (bf16, D = 128);
    both run 128-token blocks on SM90 (and SM100/SM110) from 1.32.0 (cudnn/block_sparse_attention/api.py)."""
    import torch
    try:
        major, minor = torch.cuda.get_device_capability(0)
    except Exception as e:
        return None, f"no CUDA device ({e})"
    if major not in (9, 10, 11):
        return None, f"SM{major}{minor}: cuDNN's block-sparse backward runs on SM90-SM110 only"
    try:  # the CuTe DSL's packages: a .pth adds them, which an install with pip --target does not run
        import nvidia_cutlass_dsl
        dsl = os.path.join(list(nvidia_cutlass_dsl.__path__)[0], "dsl_packages")
        if os.path.isdir(dsl) and dsl not in sys.path:
            sys.path.insert(0, dsl)
    except Exception:  # absent: cudnn's own import reports what is missing
        pass
    try:
        import cudnn
    except Exception as e:  # not installed, or its native part does not load
        return None, (f"nvidia-cudnn-frontend not importable ({type(e).__name__}: {str(e)[:160]}); "
                      f"pip install {CUDNN_FRONTEND_PIN}")
    version = getattr(cudnn, "__version__", "?")
    try:
        fwd = cudnn.block_sparse_attention_forward
        bwd = cudnn.block_sparse_attention_backward
    except Exception as e:  # older releases, or the CuTe DSL runtime (nvidia-cutlass-dsl) missing
        return None, (f"nvidia-cudnn-frontend {version}: no block-sparse attention ({type(e).__name__}: "
                      f"{str(e)[:160]}); {CUDNN_FRONTEND_PIN} with nvidia-cutlass-dsl[cu13] has it")
    return (fwd, bwd), version


def bsa_tile_error(q, k, v, o, q2k, nums, tiles, heads, block=BK):
    """Largest max|o - reference| / max|reference| over the given (128-query tile, query head) pairs:
    the reference is fp32 softmax attention of the tile's queries over the keys of its listed blocks,
    whole (cuDNN's block-sparse semantics); q, o [1, Hq, T, D], k, v [1, Hkv, T, D], q2k [1, Hq,
    ntiles, U], nums [1, Hq, ntiles]. bf16 rounding stays near 1%; a wrong reading of the metadata
    (other keys) gives errors of the order of the values themselves."""
    import torch
    T, d = q.shape[2], q.shape[3]
    g = q.shape[1] // k.shape[1]
    err = 0.0
    for i in tiles:
        rows = slice(i * block, min(T, (i + 1) * block))
        for h in heads:
            bl = q2k[0, h, i, :int(nums[0, h, i])].long()
            keys = (bl[:, None] * block + torch.arange(block, device=q.device)[None, :]).flatten()
            keys = keys[keys < T]
            s = (q[0, h, rows].float() @ k[0, h // g, keys].float().t()) * d ** -0.5
            ref = torch.softmax(s, dim=-1) @ v[0, h // g, keys].float()
            err = max(err, float((o[0, h, rows].float() - ref).abs().max() / ref.abs().max()))
    return err


def cudnn_bsa_times(api, cfg, T, indices, main_pairs, device="cuda", timer=None):
    """cuDNN's block-sparse attention fed the union of `indices` [Hp, T, topk] per 128-query tile:
    forward (GQA, its own K/V), backward alone (MHA: K/V expanded to the query heads beforehand),
    and a step = forward + expansion + backward + the dK/dV sum over each K/V head's query heads;
    max_rel_err: its output against bsa_tile_error's reference on the first and last tiles.
    timer(fn, iters) -> ms (default median_ms)."""
    import torch
    timer = timer or (lambda fn, iters: median_ms(fn, iters=iters))
    cuda = torch.device(device).type == "cuda"
    fwd_fn, bwd_fn = api
    Hq, Hkv, Hp = cfg["Hq"], cfg["Hkv"], cfg["Hp"]
    gkv = Hq // Hkv
    blocks, counts = tile_union(indices)
    idx_np, nums_np = bsa_metadata(blocks, counts, Hq // Hp)
    idx = torch.from_numpy(idx_np).to(device)
    nums = torch.from_numpy(nums_np).to(device)
    q = torch.randn(1, Hq, T, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, Hkv, T, D, device=device, dtype=torch.bfloat16)
    v = torch.randn(1, Hkv, T, D, device=device, dtype=torch.bfloat16)
    do = torch.randn_like(q)
    meta = dict(q2k_block_nums=nums, sparse_block_size=BK, layout="bhsd")

    def fwd():
        return fwd_fn(q, k, v, idx, **meta)

    def expand(x):
        return x.repeat_interleave(gkv, dim=1)

    def bwd(o, lse, kr, vr):
        return bwd_fn(do, q, kr, vr, o, lse, idx, **meta)

    def step():
        o, lse = fwd()
        kr, vr = expand(k), expand(v)
        _, dk, dv = bwd(o, lse, kr, vr)
        return dk.view(1, Hkv, gkv, T, D).sum(2), dv.view(1, Hkv, gkv, T, D).sum(2)

    t_fwd = timer(fwd, 10)  # the first call compiles the kernel (CuTe DSL JIT): warm-up
    o, lse = fwd()
    err = bsa_tile_error(q, k, v, o, idx, nums, sorted({0, idx.shape[2] - 1}), sorted({0, Hq - 1}))
    kr, vr = expand(k), expand(v)
    t_bwd = timer(lambda: bwd(o, lse, kr, vr), 5)
    del o, lse, kr, vr
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t_step = timer(step, 5)
    peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    flops = 4 * D * main_pairs
    return dict(fwd_ms=t_fwd, fwd_tflops=flops / t_fwd / 1e9, bwd_ms=t_bwd, step_ms=t_step,
                step_tflops=3.5 * flops / t_step / 1e9, peak_gb=peak, blocks_per_tile_max=int(idx_np.shape[-1]),
                union_factor_128=union_factor(counts, cfg["topk"]), max_rel_err=err)


def torch_topk_indexer_ms(cfg, T, chunk=2048):
    import torch
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


# ----------------------------------------------------------------------------------------------
# The run.

def parse_args(argv=None, command=None):
    """Arguments (argv without the program name; None: sys.argv[1:]). args.peers is a list; its default
    is every peer, or cudnn alone under --user-only; args.argv is the command the tables show
    (`command`, a full argv, else this program and argv)."""
    full = list(sys.argv if argv is None else [sys.argv[0] if sys.argv else "bench/run_bench.py"] + list(argv))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "bench", "results"),
                    help="where the tables are appended and the latest JSON written (default $OUT, else bench/results)")
    ap.add_argument("--results-dir", default=os.path.join(REPO, "bench", "results"),
                    help="the tables to continue: copied into --out first where --out has none (default bench/results)")
    ap.add_argument("--commit", default=None,
                    help="the commit to stamp (default: git's short HEAD, +dirty; $BENCH_COMMIT outside a checkout)")
    ap.add_argument("--seqlens", default="16384,32768")
    ap.add_argument("--configs", default="m3,fmsa")
    ap.add_argument("--patterns", default="clustered,random")
    ap.add_argument("--peers", default=None, help=f"comma-separated, of {','.join(PEERS)} (default: all; "
                    "--user-only: cudnn)")
    ap.add_argument("--flex", default="16384,32768", help="the lengths where FlexAttention runs")
    ap.add_argument("--bin", default=os.path.join(REPO, ".gpu", "flashmsa_bench"))
    ap.add_argument("--user-path", action=argparse.BooleanOptionalAction, default=True,
                    help="time the user's path (the README's call, user_path.py) in every row")
    ap.add_argument("--user-only", action="store_true",
                    help="only the user's path and its peers (no flashmsa_bench)")
    args = ap.parse_args(full[1:])
    args.argv = list(command) if command is not None else full
    if args.user_only and not args.user_path:
        ap.error("--user-only needs the user's path (drop --no-user-path)")
    args.peers = [p for p in (args.peers if args.peers is not None else
                              ("cudnn" if args.user_only else ",".join(PEERS))).split(",") if p]
    bad = [p for p in args.peers if p not in PEERS]
    if bad:
        ap.error(f"unknown peer(s) {','.join(bad)} (choose from {','.join(PEERS)})")
    if args.user_only and "torch_topk" in args.peers:
        ap.error("torch_topk is a peer of the selection stage: the kernel table's, not --user-only's")
    for name in args.configs.split(","):
        if name not in CONFIGS:
            ap.error(f"unknown config {name!r} (choose from {','.join(CONFIGS)})")
    try:
        args.seqlen_list = [int(x) for x in args.seqlens.split(",")]
        args.flex_list = [int(x) for x in args.flex.split(",") if x]
    except ValueError as e:
        ap.error(f"lengths are comma-separated integers: {e}")
    args.pattern_list = args.patterns.split(",")
    bad = [p for p in args.pattern_list if p not in PATTERNS]
    if bad:
        ap.error(f"unknown pattern(s) {','.join(bad)} (choose from {','.join(PATTERNS)})")
    return args


class Tables:
    """The tables a run appends to, and their raw JSON."""

    def __init__(self, args, meta):
        self.meta = meta
        os.makedirs(args.out, exist_ok=True)
        self.kinds = {}
        if not args.user_only:
            self.kinds["kernels"] = (KERNEL_TITLE, KERNEL_INTRO, kernel_columns(), lambda r: "select_ms" in r)
        if args.user_path:
            self.kinds["user_path"] = (USER_TITLE, USER_INTRO, user_columns(), lambda r: "user" in r)
        self.paths = {k: seed_table(args.out, args.results_dir, f"{k}.md") for k in self.kinds}
        self.latest = {k: os.path.join(args.out, f"{k}.latest.json") for k in self.kinds}
        self.rows = {k: [] for k in self.kinds}

    def add(self, row):
        for kind, (title, intro, columns, has) in self.kinds.items():
            if has(row):
                self.rows[kind].append(row)
                print(append_rows(self.paths[kind], title, intro, columns, self.meta, [row])[-1], flush=True)
                write_latest(self.latest[kind], self.meta, self.rows[kind])


def main(argv=None, command=None):
    args = parse_args(argv, command)
    import torch

    import user_path
    info = gpu_info()
    meta = run_meta(args, info)
    tables = Tables(args, meta)
    bsa_api = None
    if "cudnn_bsa" in args.peers:
        bsa_api, why = cudnn_bsa_api()
        log(f"[bench] cuDNN block-sparse peer: {'nvidia-cudnn-frontend ' + why if bsa_api else 'skipped: ' + why}")
        meta["cudnn_bsa"] = why
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        with tempfile.TemporaryDirectory() as tmp:
            if args.user_only:
                ours = [dict(config=name, seqlen=T, pattern=p) for T in args.seqlen_list for p in args.pattern_list]
            else:
                log(f"[bench] flashmsa kernels, {name}")
                cmd = [args.bin, "--config", name, "--seqlens", args.seqlens, "--patterns", args.patterns,
                       "--save-indices", tmp]
                res = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                ours = [json.loads(l) for l in res.splitlines() if l.startswith("{")]
            for T in args.seqlen_list:
                peers = {}
                for be in ("cudnn", "fa2"):
                    if be not in args.peers:
                        continue
                    log(f"[bench] {be} dense causal {name} {T}")
                    try:
                        peers[be] = sdpa_times(cfg, T, be)
                    except Exception as e:  # a backend missing for this shape is reported, not fatal
                        peers[be] = dict(error=str(e)[:300])
                    torch.cuda.empty_cache()
                if "torch_topk" in args.peers:
                    log(f"[bench] torch chunked top-k indexer {name} {T}")
                    peers["torch_topk_indexer_ms"] = torch_topk_indexer_ms(cfg, T)
                for o in ours:
                    if o["seqlen"] != T:
                        continue
                    row = dict(o)
                    row["peers"] = dict(peers)
                    want_flex = "flex" in args.peers and T in args.flex_list
                    if want_flex or bsa_api or args.user_only:
                        if args.user_only:  # the selection the user's call makes on its inputs
                            idx = user_path.selection(cfg, T, o["pattern"], torch.device("cuda"))
                        else:
                            idx = np.fromfile(os.path.join(tmp, f"indices-{name}-{T}-{o['pattern']}.bin"),
                                              dtype=np.int32).reshape(cfg["Hp"], T, cfg["topk"])
                        pairs = selected_pairs(idx, cfg["Hq"] // cfg["Hp"])
                        if args.user_only:
                            row["union_factor_128"] = union_factor(tile_union(idx)[1], cfg["topk"])
                        if want_flex:
                            log(f"[bench] flex {name} {T} {o['pattern']}")
                            try:
                                row["peers"]["flex"] = flex_times(cfg, T, idx, pairs)
                            except Exception as e:
                                row["peers"]["flex"] = dict(error=str(e)[:300])
                            torch.cuda.empty_cache()
                        if bsa_api:
                            log(f"[bench] cudnn block-sparse {name} {T} {o['pattern']}")
                            try:
                                bsa = row["peers"]["cudnn_bsa"] = cudnn_bsa_times(bsa_api, cfg, T, idx, pairs)
                                if not bsa["max_rel_err"] < BSA_TOLERANCE:  # timed, but not this attention
                                    bsa["error"] = (f"output differs from the reference by {bsa['max_rel_err']:.3g} "
                                                    f"of its largest value (tolerance {BSA_TOLERANCE})")
                                    log(f"[bench] cudnn block-sparse: {bsa['error']}")
                            except Exception as e:  # an unsupported shape or a JIT failure is reported in the row
                                row["peers"]["cudnn_bsa"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
                                log(f"[bench] cudnn block-sparse failed: {row['peers']['cudnn_bsa']['error']}")
                            torch.cuda.empty_cache()
                        del idx
                    if args.user_path:
                        where = f"[bench] user path {name} {T} {o['pattern']}:"
                        try:
                            row["user"] = user_path.user_step_times(cfg, T, o["pattern"],
                                                                    log=lambda what: log(where, what))
                        except Exception as e:  # reported in the row, like a failing peer
                            row["user"] = dict(error=str(e)[:300])
                        torch.cuda.empty_cache()
                    row["clocks"] = sample_clocks(info)
                    tables.add(row)
    for kind, path in tables.paths.items():
        log(f"[bench] {len(tables.rows[kind])} rows appended to {path}; raw: {tables.latest[kind]}")


if __name__ == "__main__":
    main()
