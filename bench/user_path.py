"""The user's path (docs/performance.md): the README's Python call timed end to end, its forward and a
whole training step, next to the sum of the library's kernels on the same inputs:

    out, kl = flashmsa.msa_attention(q, k, v, qp, kp, topk=16, cu_seqlens=cu, max_seqlen=T)
    torch.autograd.backward([out, kl], [dout, 1])

make_inputs draws the benchmark's selection patterns in torch (on any device); selection gives the
blocks the call selects on them (the peers of run_bench.py serve that selection); user_step_times
times on the GPU and is what run_bench.py adds to each row as row["user"]. flashmsa is imported
from <repo>/python, with the library .gpu/libflashmsa.so when it exists (FLASHMSA_LIBRARY wins).

Run as a program, it is `bench/run_bench.py --user-only` with the same arguments: the user's path
and its peers, appended to bench/results/user_path.md (bench/README.md):
    python3 bench/user_path.py --configs m3 --seqlens 32768,65536,131072 --peers cudnn,fa2,flex,cudnn_bsa
"""
import functools
import os
import pathlib
import sys

import torch

from run_bench import PATTERNS  # (the harnesses' one list of selection patterns)

REPO = pathlib.Path(__file__).resolve().parents[1]
D = 128
# the clustered pattern (tools/patterns.hpp)
TOPICS, KEY_SPAN, QUERY_SPAN, TOPICS_PER_QUERY, TOPIC_NOISE = 64, 512, 128, 3, 0.5
# The trained-like pattern (trained_like_proxy): how many target blocks a query row's proxy draws at each time scale
# (every proxy head of a 64-token span, one head's 64-token span, one head's 8-token span, one token), the
# distance law (block distance = U^gamma x the query's block), the share of target blocks that bring their left
# neighbour, the per-token weight and the noise. Fitted to the statistics of a trained indexer's selection
# (bench/tools/trained_pattern.py checks them; docs/performance.md).
TRAINED = dict(span=64, n_shared=1, n_span=1, sub=8, n_sub=2, n_tok=12, gamma=2.4, p_pair=0.6, w_tok=1.2,
               key_noise=0.1, query_noise=0.1)


@functools.lru_cache(maxsize=None)  # once: user_call runs it inside the timed region
def import_flashmsa():
    """The flashmsa package of this repository (<repo>/python put first on sys.path if absent),
    loading .gpu/libflashmsa.so when it exists and FLASHMSA_LIBRARY is not set."""
    lib = REPO / ".gpu" / "libflashmsa.so"
    if "FLASHMSA_LIBRARY" not in os.environ and lib.is_file():
        os.environ["FLASHMSA_LIBRARY"] = str(lib)
    if str(REPO / "python") not in sys.path:
        sys.path.insert(0, str(REPO / "python"))
    import flashmsa
    return flashmsa


def make_inputs(cfg, T, pattern, device, dtype=torch.bfloat16, seed=0):
    """(q, k, v, qp, kp, cu): batch-1 varlen inputs [T, H, 128] of a benchmark selection pattern
    (PATTERNS: "clustered", "random", or "trained", trained_like_proxy's), drawn in fp32 on `device` and cast to
    `dtype`; q, k, v, qp, kp are leaves that require grad, cu = [0, T] int32. The clustered draw is tools/patterns.cpp's (one
    topic per 512-token span of keys and proxy key head, 3 distinct topics per 128-token span of
    queries and proxy head) with torch's generator: the C++ bench's distribution, other numbers."""
    g = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape):
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32)

    def leaf(x):
        return x.to(dtype).requires_grad_()

    q, k, v = (leaf(normal(T, cfg[h], D)) for h in ("Hq", "Hkv", "Hkv"))
    if pattern == "trained":
        qp, kp = trained_like_proxy(T, cfg["Hp"], cfg["Hpk"], g, device)
        qp, kp = leaf(qp), leaf(kp)
    elif pattern == "random":
        qp, kp = leaf(normal(T, cfg["Hp"], D)), leaf(normal(T, cfg["Hpk"], D))
    elif pattern == "clustered":
        topics = normal(TOPICS, D)
        key_topic = torch.randint(0, TOPICS, (cfg["Hpk"], -(-T // KEY_SPAN)), generator=g, device=device)
        picks = torch.rand(cfg["Hp"], -(-T // QUERY_SPAN), TOPICS, generator=g, device=device)
        picks = picks.topk(TOPICS_PER_QUERY, dim=-1).indices  # distinct, uniform
        key_mean = topics[key_topic].transpose(0, 1).repeat_interleave(KEY_SPAN, dim=0)[:T]  # [T, Hpk, D]
        query_mean = topics[picks].sum(2).transpose(0, 1).repeat_interleave(QUERY_SPAN, dim=0)[:T]  # [T, Hp, D]
        qp = leaf(query_mean + TOPIC_NOISE * normal(T, cfg["Hp"], D))
        kp = leaf(key_mean + TOPIC_NOISE * normal(T, cfg["Hpk"], D))
    else:
        raise ValueError(f"unknown pattern {pattern!r} ({', '.join(PATTERNS)})")
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    return q, k, v, qp, kp, cu


def trained_like_proxy(T, Hp, Hpk, g, device, p=TRAINED):
    """(qp [T, Hp, D], kp [T, Hpk, D]) fp32 whose selection has a trained indexer's statistics (the trained-like
    pattern of docs/performance.md, "Trained selections"). Every key block j of proxy key head h gets a random
    direction c[h, j] and its keys are c[h, j] plus noise. Each query row's proxy is the sum of the directions of the blocks it should select, drawn at
    four time scales: blocks every proxy head of a 64-token span shares, blocks of one head's 64-token span, of its
    8-token span, and of the token alone (consecutive tokens share about half their blocks, as trained selections
    do). A block lies U^gamma x (the query's block) blocks before the query's block (trained selections favour recent
    blocks: median distance ~0.3 of the way back), at least one; with probability p_pair it brings its left neighbour
    (runs of adjacent blocks), else its own direction counts twice (the parameters were fitted that way). The
    selection then picks those blocks, the local block and the noise's winners."""
    import torch.nn.functional as F
    nb = -(-T // 128)

    def normal(*shape):
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32)

    def draw(qb, n):  # [len(qb), 2n] blocks: n targets before each query block qb, then each one's partner (itself
        # when unpaired)
        u = torch.rand((qb.shape[0], n), generator=g, device=device) ** p["gamma"]
        b = (qb[:, None] - (u * qb[:, None]).round().clamp(min=1)).clamp(min=0).long()
        pair = torch.rand((qb.shape[0], n), generator=g, device=device) < p["p_pair"]
        return torch.cat([b, torch.where(pair, (b - 1).clamp(min=0), b)], dim=1)

    c = normal(Hpk, nb, D)
    tok = torch.arange(T, device=device)
    kp = c[:, tok // 128].transpose(0, 1) + p["key_noise"] * normal(T, Hpk, D)

    def first_blocks(span):  # the query block of each span's first token, and each token's span
        return (torch.arange(-(-T // span), device=device) * span) // 128, tok // span

    span_qb, span_of = first_blocks(p["span"])
    sub_qb, sub_of = first_blocks(p["sub"])
    shared = draw(span_qb, p["n_shared"])
    qp = torch.empty(T, Hp, D, device=device)
    for h in range(Hp):
        ch = c[h * Hpk // Hp]
        span_vec = F.embedding_bag(torch.cat([shared, draw(span_qb, p["n_span"])], 1), ch, mode="sum")
        sub_vec = F.embedding_bag(draw(sub_qb, p["n_sub"]), ch, mode="sum")
        tok_vec = F.embedding_bag(draw(tok // 128, p["n_tok"]), ch, mode="sum")
        qp[:, h] = span_vec[span_of] + sub_vec[sub_of] + p["w_tok"] * tok_vec + p["query_noise"] * normal(T, D)
    return qp, kp


def selection(cfg, T, pattern, device, seed=0):
    """indices [Hp, T, topk] int32 (numpy; -1 padding) that flashmsa.msa_select makes on
    make_inputs(cfg, T, pattern, device, seed)'s qp, kp: the selection of the README's call on the
    inputs user_step_times uses (same seed)."""
    flashmsa = import_flashmsa()
    q, k, v, qp, kp, cu = make_inputs(cfg, T, pattern, device, seed=seed)
    del q, k, v
    with torch.no_grad():
        idx = flashmsa.msa_select(qp.detach(), kp.detach(), cfg["topk"], cu_seqlens=cu, max_seqlen=T)
    return idx.cpu().numpy().astype("int32")


def user_call(inputs, topk, compute_kl=None, warmup=False):
    """The README's call on make_inputs' `inputs` -> (out, kl); compute_kl None is its default; warmup=True the dense
    warmup mode (every causal key, the proxy trained over the whole causal set)."""
    q, k, v, qp, kp, cu = inputs
    return import_flashmsa().msa_attention(q, k, v, qp, kp, topk=topk, cu_seqlens=cu, max_seqlen=q.shape[0],
                                           compute_kl=compute_kl, warmup=warmup)


def kernel_calls(inputs, topk, dout):
    """(fwd, bwd): the library calls of a default step without autograd, on any device. fwd: the
    sparse forward with its selection (compute_kl=0, indices and proxy_lse kept for the backward);
    bwd: the backward on the outputs of one fwd() run here, dkl = 1, with the kl value (what the
    default training call gets)."""
    import_flashmsa()
    from flashmsa import _autograd as A
    from flashmsa import _kernels as K
    from flashmsa import _lib as L
    q, k, v, qp, kp, cu = (x.detach() for x in inputs)
    shared = dict(q=q, k=k, v=v, qp=qp, kp=kp, cu_seqlens=cu, max_seqlen=q.shape[0], mode=L.MODE_SPARSE,
                  softmax_scale=0.0, proxy_scale=0.0,  # 0.0: the library's default scales
                  cu_seqlens_q=None, q_origin=None, max_seqlen_q=0)  # no query segments
    fa = A.args_tuple(A.FWD_ARGS, dict(shared, indices=None, numerics=L.NUMERICS_TRAIN, topk=topk, compute_kl=0,
                                       want_indices=True, want_proxy_lse=True, validate=False, want_out_lo=False,
                                       selection=L.SELECTION_INPUT))
    o = dict(zip(A.FWD_OUTPUTS, K.fwd(*fa)))
    ba = A.args_tuple(A.BWD_ARGS, dict(shared, dout=dout, dlse=None, dkl=torch.ones_like(o["kl"]),
                                       indices=o["indices"], out=o["out"], lse=o["lse"], proxy_lse=o["proxy_lse"],
                                       deterministic=False, out_lo=None, want_kl=True))
    return (lambda: K.fwd(*fa)), (lambda: K.bwd(*ba))


def median_ms(fn, setup, iters=10, warmup=3, reps=3):
    """Per-call ms, the median over `iters` samples of `reps` back-to-back calls (setup(), a
    host-side reset such as clearing .grad, before each): as in a training loop, the host queues
    a call while the previous one runs, so its Python time hides behind the GPU's except before
    the first call of a sample (1/reps of it counts)."""
    for _ in range(warmup):
        setup()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        setup()
        a.record()
        for i in range(reps):
            if i:
                setup()
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    times.sort()
    return times[len(times) // 2]


def training_step(inputs, topk, compute_kl=None):
    """(step, clear, dout) on make_inputs' `inputs`: step(compute_kl=None) runs the README's call
    and its backward, torch.autograd.backward([out, kl], [dout, 1]), and returns kl; clear() drops
    the leaves' .grad between runs; dout is the fixed upstream gradient (seed 1)."""
    dev = inputs[0].device
    leaves = inputs[:5]
    g = torch.Generator(device=dev).manual_seed(1)
    dout = torch.randn(inputs[0].shape, generator=g, device=dev).to(inputs[0].dtype)
    one = torch.ones((), device=dev)  # the gradient of kl (fp32 for bf16 inputs)

    def clear():
        for x in leaves:
            x.grad = None

    def step(compute_kl=compute_kl, warmup=False):
        out, kl = user_call(inputs, topk, compute_kl, warmup)
        torch.autograd.backward([out, kl], [dout, one])
        return kl

    return step, clear, dout


def user_step_times(cfg, T, pattern, iters=10, warmup=3, log=None):
    """The user's path on the GPU for one (config, T, pattern), times in ms (median of `iters`):
    user_fwd_ms / user_step_ms: the README's call with its defaults, alone and with its backward
    (torch.autograd.backward([out, kl], [dout, 1]), the leaves' .grad cleared between runs);
    the same with compute_kl=False (_nokl_) and compute_kl=True (_klfwd_; None and klfwd_error
    where the backend declines it); user_step_frozen_ms / user_step_frozen_nokl_ms: the default
    step and the compute_kl=False step with qp, kp detached (a frozen indexer: no proxy gradient);
    user_step_warmup_ms: the default step with warmup=True (dense mode, as a run's first steps);
    kern_fwd_ms, kern_bwd_ms and their sum kern_sum_ms: the library calls of that step without
    autograd (kernel_calls); kl_value_user: kl after the last
    default step's backward, kl_value_fwd: kl of a compute_kl=True forward; user_peak_gb: peak
    memory of one default step; overhead_pct = 100 (user_step_ms / kern_sum_ms - 1).
    log(what) is called before each measurement."""
    flashmsa = import_flashmsa()
    say = log or (lambda what: None)
    inputs = make_inputs(cfg, T, pattern, torch.device("cuda"))
    train_step, clear, dout = training_step(inputs, cfg["topk"])
    last = {}  # kl of the latest step (after its backward: no graph kept alive)

    def fwd(compute_kl):
        def run():
            user_call(inputs, cfg["topk"], compute_kl)
        return run

    def step(compute_kl):
        def run():
            last["kl"] = train_step(compute_kl)
        return run

    r = dict(library=str(flashmsa.library_path()))
    say("user fwd (defaults)")
    r["user_fwd_ms"] = median_ms(fwd(None), clear, iters, warmup)
    say("user step (defaults)")
    r["user_step_ms"] = median_ms(step(None), clear, iters, warmup)
    torch.cuda.synchronize()
    r["kl_value_user"] = last["kl"].item()
    say("user step peak memory")
    clear()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(None)()
    torch.cuda.synchronize()
    r["user_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    say("user fwd, step (compute_kl=False)")
    r["user_fwd_nokl_ms"] = median_ms(fwd(False), clear, iters, warmup)
    r["user_step_nokl_ms"] = median_ms(step(False), clear, iters, warmup)
    say("user fwd, step (compute_kl=True)")
    try:
        r["user_fwd_klfwd_ms"] = median_ms(fwd(True), clear, iters, warmup)
        r["kl_value_fwd"] = user_call(inputs, cfg["topk"], True)[1].item()  # a training forward, untimed
        r["user_step_klfwd_ms"] = median_ms(step(True), clear, iters, warmup)
    except flashmsa.NotSupportedError as e:  # the backend declines the kl value for this layout
        r.update(user_fwd_klfwd_ms=None, kl_value_fwd=None, user_step_klfwd_ms=None, klfwd_error=str(e)[:200])
    say("user step, warmup (dense) mode")
    r["user_step_warmup_ms"] = median_ms(lambda: train_step(None, True), clear, max(3, iters // 3), 1)
    say("user step, frozen proxy (qp, kp detached; defaults, and compute_kl=False)")
    frozen = tuple(inputs[:3]) + (inputs[3].detach(), inputs[4].detach(), inputs[5])
    frozen_step, frozen_clear, _ = training_step(frozen, cfg["topk"])
    r["user_step_frozen_ms"] = median_ms(lambda: frozen_step(None), frozen_clear, iters, warmup)
    r["user_step_frozen_nokl_ms"] = median_ms(lambda: frozen_step(False), frozen_clear, iters, warmup)
    clear()
    say("kernel fwd, bwd (no autograd)")
    kern_fwd, kern_bwd = kernel_calls(inputs, cfg["topk"], dout)
    r["kern_fwd_ms"] = median_ms(kern_fwd, lambda: None, iters, warmup)
    r["kern_bwd_ms"] = median_ms(kern_bwd, lambda: None, iters, warmup)
    r["kern_sum_ms"] = r["kern_fwd_ms"] + r["kern_bwd_ms"]
    r["overhead_pct"] = 100 * (r["user_step_ms"] / r["kern_sum_ms"] - 1)
    return r


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import run_bench
    run_bench.main(["--user-only"] + sys.argv[1:], command=sys.argv)
