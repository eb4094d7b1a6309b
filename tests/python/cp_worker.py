"""One rank of a context-parallel test world (used by test_distributed.py; not a test itself).

    python3 cp_worker.py --rank R --world P --port PORT --out DIR [--gpu] CASE...

CPU (gloo): every rank builds the same full inputs from a seed, runs flashmsa.msa_attention on
them (the single-process result), then flashmsa.distributed.msa_attention_cp on its token shard,
and writes, per case, the rel-L2 error of each output and gradient shard (or the exception) to
DIR/rank<R>.json. GPU (--gpu, NCCL, one GPU per rank): the same comparison against the
single-GPU result at m3 heads and a long sequence, plus timings and the all-to-all share.
"""
import argparse
import datetime
import json
import math
import os
import pathlib
import sys
import time

if os.environ.get("FLASHMSA_TEST_INSTALLED") != "1":  # (conftest.py: the package under test)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flashmsa  # noqa: E402
import flashmsa.distributed as fcp  # noqa: E402
from flashmsa.testing import make_inputs, rel_l2  # noqa: E402

M3LIKE = dict(Hq=16, Hkv=4, Hp=4, Hpk=1)  # m3's ratios (64/4/4/1) scaled down
FMSA = dict(Hq=16, Hkv=2, Hp=4, Hpk=1)  # P = 4: each kv head replicated on two ranks
HPK2 = dict(Hq=8, Hkv=4, Hp=4, Hpk=2)  # P = 2: kp heads split; P = 4: kp heads replicated
HP_LT_HKV = dict(Hq=16, Hkv=8, Hp=4, Hpk=1)  # Hp < Hkv: several kv heads per group

# name -> case; "shards": "even" (shard_sizes=None) or "balanced" (uneven, shard_sizes passed);
# "error": (exception type, substring) expected on every rank ("error_rank1": on rank 1).
CASES = {
    "m3like_varlen": dict(heads=M3LIKE, lengths=[300, 1, 0, 129, 127, 215], mode="sparse"),
    "m3like_uneven": dict(heads=M3LIKE, lengths=[301, 1, 129, 127, 3], mode="sparse", shards="balanced"),
    "m3like_warmup": dict(heads=M3LIKE, lengths=[257, 3, 0, 124, 1], mode="warmup", shards="balanced"),
    "m3like_batched": dict(heads=M3LIKE, batch=2, seqlen=260, mode="sparse"),
    "m3like_fp32": dict(heads=M3LIKE, lengths=[300, 1, 129, 127, 215], mode="sparse", dtype="float32",
                        shards="balanced"),
    "m3like_allgather": dict(heads=M3LIKE, lengths=[301, 1, 129, 127, 3], mode="sparse",
                             shards="balanced", impl="all_gather"),
    "m3like_no_grad": dict(heads=M3LIKE, lengths=[300, 1, 0, 129, 127, 215], mode="sparse", grad=False),
    "fmsa_varlen": dict(heads=FMSA, lengths=[300, 1, 129, 127, 215], mode="sparse", shards="balanced"),
    "fmsa_given": dict(heads=FMSA, lengths=[300, 1, 0, 129, 127, 215], mode="given"),
    "hpk2_varlen_strided": dict(heads=HPK2, lengths=[300, 129, 127, 215, 1], mode="sparse",
                                shards="balanced", head_major=True),  # inputs with head-major strides
    "hp_lt_hkv_warmup": dict(heads=HP_LT_HKV, batch=1, seqlen=388, mode="warmup"),
    "tiny_uneven": dict(heads=M3LIKE, lengths=[0, 3], mode="sparse", shards="balanced"),  # empty shards
    "err_hp": dict(heads="hp_half_p", lengths=[64], mode="sparse", scheme="heads",
                   error=("ValueError", "Hp (proxy heads, one per MSA group) = {hp} is not divisible")),
    "err_hkv": dict(heads=dict(Hq=12, Hkv=3, Hp=4, Hpk=1), lengths=[64], mode="sparse", scheme="heads",
                    error=("ValueError", "Hkv (kv heads) = 3 is not divisible")),
    # the tokens scheme: k, v, kp gathered, each rank's queries as query segments (any P)
    "tok_varlen": dict(heads=M3LIKE, lengths=[300, 1, 0, 129, 127, 215], mode="sparse", shards="balanced",
                       scheme="tokens", worlds=(2, 3, 4, 8)),
    "tok_zigzag": dict(heads=M3LIKE, lengths=[300, 129, 0, 260, 5], mode="sparse", shards="balanced",
                       scheme="tokens", layout="zigzag", worlds=(2, 3, 4, 8)),
    # the hybrid scheme: heads within groups of heads_size ranks, tokens across them (P = 4: 2 x 2; P = 8: 4 x 2)
    "hyb_varlen": dict(heads=M3LIKE, lengths=[300, 1, 0, 129, 127, 215], mode="sparse", shards="balanced",
                       scheme="hybrid", worlds=(4, 8)),
    "hyb_zigzag": dict(heads=M3LIKE, lengths=[300, 129, 0, 260, 5], mode="sparse", shards="balanced",
                       scheme="hybrid", layout="zigzag", worlds=(4, 8)),
    "hyb_given_kv_replicated": dict(heads=FMSA, lengths=[300, 1, 0, 129, 127, 215], mode="given", shards="balanced",
                                    scheme="hybrid", worlds=(4, 8)),  # P = 8: heads_size 4, each kv head on 2 ranks
    "hyb_warmup_2x2": dict(heads=M3LIKE, lengths=[257, 3, 0, 124, 1], mode="warmup", shards="balanced",
                           scheme="hybrid", heads_size=2, worlds=(4,)),
    "err_hyb_size": dict(heads=M3LIKE, lengths=[64], mode="sparse", scheme="hybrid", heads_size=3, worlds=(4,),
                         error=("ValueError", "heads_size: expected a divisor of the context-parallel size 4")),
    "tok_warmup": dict(heads=M3LIKE, lengths=[257, 3, 0, 124, 1], mode="warmup", shards="balanced",
                       scheme="tokens"),
    "tok_given": dict(heads=FMSA, lengths=[300, 1, 0, 129, 127, 215], mode="given", shards="balanced",
                      scheme="tokens", layout="zigzag"),
    "tok_batched": dict(heads=M3LIKE, batch=2, seqlen=260, mode="sparse", shards="balanced", scheme="tokens"),
    "tok_fp32": dict(heads=HPK2, lengths=[300, 1, 129, 127, 215], mode="sparse", dtype="float32",
                     shards="balanced", scheme="tokens"),
    "tok_empty_shards": dict(heads=M3LIKE, lengths=[0, 3], mode="sparse", shards="balanced", scheme="tokens"),
    "tok_by_default": dict(heads="hp_half_p", lengths=[200, 77], mode="sparse", shards="balanced"),
    "err_zigzag_sizes": dict(heads=M3LIKE, lengths=[7, 260], mode="sparse", shards="balanced", scheme="tokens",
                             layout="zigzag", zigzag_sizes=False,
                             error=("ValueError", "with layout='zigzag' rank r holds chunks r and 2P-1-r")),
    "err_tok_on_one_rank": dict(heads=M3LIKE, lengths=[64, 65], mode="sparse", shards="wrong_on_rank1", scheme="tokens",
                                error=("ValueError", "rank 1 rejected its arguments"),
                                error_rank1=("ValueError", "shard_sizes: rank 1 holds")),
    "err_tok_sizes_disagree": dict(heads=M3LIKE, lengths=[64, 65], mode="sparse", shards="disagree", scheme="tokens",
                                   worlds=(3, 4), error=("ValueError", "the ranks' token shards do not add up")),
    "err_heads_p_divides_nothing": dict(heads=M3LIKE, lengths=[129], mode="sparse", shards="balanced", scheme="heads",
                                        worlds=(3,), error=("ValueError", "is not divisible by the context-parallel size")),
    # the fp8 selection: kp quantised over whole key blocks on every rank (the single-process selection)
    "tok_fp8": dict(heads=M3LIKE, lengths=[300, 129, 0, 260, 5], mode="sparse", shards="balanced", scheme="tokens",
                    layout="zigzag", fp8=True),
    "heads_fp8": dict(heads=M3LIKE, lengths=[300, 1, 0, 129, 127, 215], mode="sparse", shards="balanced",
                      scheme="heads", fp8=True),
    # the heads scheme on Megatron's zigzag shards: rows put in sequence order after the all-to-all (and back)
    "heads_zigzag": dict(heads=M3LIKE, lengths=[300, 129, 0, 260, 5], mode="sparse", shards="balanced",
                         scheme="heads", layout="zigzag"),
    "heads_zigzag_warmup": dict(heads=M3LIKE, lengths=[257, 3, 0, 124, 1], mode="warmup", shards="balanced",
                                scheme="heads", layout="zigzag"),
    "heads_zigzag_given": dict(heads=FMSA, lengths=[300, 1, 0, 129, 127, 215], mode="given", shards="balanced",
                               scheme="heads", layout="zigzag"),
    "err_zigzag_batched": dict(heads=M3LIKE, batch=2, seqlen=260, mode="sparse", shards="balanced", scheme="heads",
                               layout="zigzag", error=("ValueError", "layout: 'zigzag' needs varlen inputs")),
    "err_shard_sizes": dict(heads=M3LIKE, lengths=[64], mode="sparse", shards="wrong",
                            error=("ValueError", "shard_sizes")),
    "err_on_one_rank": dict(heads=M3LIKE, lengths=[64], mode="sparse", shards="wrong_on_rank1",
                            error=("ValueError", "rank 1 rejected its arguments"),
                            error_rank1=("ValueError", "shard_sizes: rank 1 holds")),
    "err_ranks_disagree": dict(heads=M3LIKE, lengths=[64], mode="sparse", topk_by_rank=True,
                               error=("ValueError", "ranks disagree on topk")),
}
TOPK = 2
D = 8
GRADS = ("q", "k", "v", "qp", "kp")


def _heads(case, P):
    if case["heads"] == "hp_half_p":  # Hp = P / 2: never divisible by P
        return dict(Hq=8, Hkv=1, Hp=P // 2, Hpk=1)
    return case["heads"]


def _weights(out, lse, seed=7):
    """Fixed random weights of the loss sum(out * w_out) + sum(lse * w_lse) + 3 kl."""
    g = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    w_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
    return w_out, w_lse


def run_case(name, case, rank, P, device="cpu"):
    heads = _heads(case, P)
    dtype = getattr(torch, case.get("dtype", "float64"))
    grad = case.get("grad", True)
    if "lengths" in case:
        x = make_inputs(lengths=case["lengths"], D=D, Dp=D, dtype=dtype, device=device, seed=11,
                        proxy_gain=2.0, **heads)
        td, seq = 0, dict(cu_seqlens=x["cu_seqlens"], max_seqlen=x["max_seqlen"])
    else:
        x = make_inputs(batch=case["batch"], seqlen=case["seqlen"], D=D, Dp=D, dtype=dtype,
                        device=device, seed=11, proxy_gain=2.0, **heads)
        td, seq = 1, {}
    full = {n: x[n].requires_grad_(grad) for n in GRADS}
    S = full["q"].shape[td]
    shards = case.get("shards", "even")
    sizes = fcp.shard_sizes(S, P)
    if shards == "even":
        assert S % P == 0, (name, S, P)
    zigzag = case.get("layout") == "zigzag" and case.get("zigzag_sizes", True) and td == 0
    if zigzag:  # rank r holds chunks r and 2P-1-r of every sequence
        rows = [fcp.zigzag_rows(x["cu_seqlens"], P, r).to(device) for r in range(P)]
        sizes = [len(r_) for r_ in rows]
    kw = dict(warmup=case["mode"] == "warmup", return_lse=True, return_indices=True, **seq)
    if case.get("fp8"):
        kw["fp8_selection"] = True
    given = None
    if case["mode"] == "given":
        given = flashmsa.msa_select(full["qp"].detach(), full["kp"].detach(), TOPK, **seq)
        given[:, ::7, 0] = -1  # some empty slots
        kw["indices"] = given

    # the single-process result on the full tensors
    out, kl, lse, idx = flashmsa.msa_attention(*[full[n] for n in GRADS], TOPK, **kw)
    w_out, w_lse = _weights(out, lse)

    def loss_of(o, k_, l_, wo, wl):
        return (o * wo).sum() + (torch.where(torch.isfinite(l_), l_, 0) * wl).sum() + 3.0 * k_

    if grad:
        ref_grads = torch.autograd.grad(loss_of(out, kl, lse, w_out, w_lse), [full[n] for n in GRADS])

    # this rank's shard
    def shard(t, dim):
        if zigzag:
            return t.index_select(dim, rows[rank])
        return fcp.shard_tokens(t, P, rank, dim=dim, sizes=sizes)

    def shard_flat(t):  # [H, total(, topk)] -> this rank's tokens (b-major for batched)
        if td == 0:
            return shard(t, 1)
        B = full["q"].shape[0]
        v = t.reshape(t.shape[0], B, S, *t.shape[2:])
        return shard(v, 2).reshape(t.shape[0], -1, *t.shape[2:])

    loc = {n: shard(full[n].detach(), td).clone().requires_grad_(grad) for n in GRADS}
    ckw = dict(kw)
    for opt in ("scheme", "layout", "heads_size"):
        if opt in case:
            ckw[opt] = case[opt]
    args = [loc[n] for n in GRADS]
    if case.get("head_major"):  # token stride D, head stride T * D (differentiable views of loc)
        args = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in args]
        assert not args[0].is_contiguous()
    if given is not None:
        ckw["indices"] = shard_flat(given).contiguous()
    if shards == "balanced":
        ckw["shard_sizes"] = sizes
    elif shards == "wrong":
        ckw["shard_sizes"] = [s + (1 if i == rank else 0) for i, s in enumerate(sizes)]
    elif shards == "wrong_on_rank1":  # only rank 1's list is wrong (validate: no rank hangs)
        ckw["shard_sizes"] = [s + (1 if i == rank == 1 else 0) for i, s in enumerate(sizes)]
    elif shards == "disagree":  # rank 0 moves a token between ranks 1 and 2 in its list: right about itself, the
        # right total, but not the others' list (P >= 3)
        ckw["shard_sizes"] = [s + (1 if rank == 0 and i == 1 else -1 if rank == 0 and i == 2 else 0)
                              for i, s in enumerate(sizes)]
    fcp.set_all_to_all_impl(case.get("impl", "auto"))
    t0 = time.perf_counter()
    try:
        topk = TOPK + rank % 2 if case.get("topk_by_rank") else TOPK
        c_out, c_kl, c_lse, c_idx = fcp.msa_attention_cp(*args, topk, validate=True, **ckw)
        kl_before = c_kl.item()  # the tokens scheme in training: NaN until the backward fills it
        if grad:
            c_loss = loss_of(c_out, c_kl, c_lse, shard(w_out, td), shard_flat(w_lse))
            c_grads = torch.autograd.grad(c_loss, [loc[n] for n in GRADS])
    finally:
        fcp.set_all_to_all_impl("auto")
    seconds = time.perf_counter() - t0

    err = {"out": rel_l2(c_out, shard(out, td)), "lse": rel_l2(c_lse, shard_flat(lse)),
           "kl": abs(c_kl.item() - kl.item()) / max(abs(kl.item()), 1e-30)}
    late = grad  # every scheme forms the training kl in the backward
    err["kl_from_backward"] = 0.0 if math.isnan(kl_before) == late else float("inf")
    if case["mode"] == "warmup":
        err["indices"] = 0.0 if c_idx is None and idx is None else float("inf")
    else:
        err["indices"] = 0.0 if torch.equal(c_idx, shard_flat(idx)) else float("inf")
    shapes_ok = (c_out.shape == shard(out, td).shape and c_lse.shape == shard_flat(lse).shape
                 and c_out.dtype == out.dtype and c_lse.dtype == lse.dtype and c_kl.dtype == kl.dtype)
    if grad:
        for n, a, b in zip(GRADS, c_grads, ref_grads):
            err["d" + n] = rel_l2(a, shard(b, td))
    else:
        shapes_ok = shapes_ok and not c_out.requires_grad
    return dict(err=err, shapes_ok=bool(shapes_ok), seconds=seconds, kl=kl.item(),
                impl=case.get("impl", "auto"))


def cpu_main(args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=60))
    results = {}
    for name in args.cases:
        case = CASES[name]
        try:
            results[name] = run_case(name, case, args.rank, args.world)
        except Exception as e:  # noqa: BLE001 - reported to the test
            results[name] = dict(exc=[type(e).__name__, str(e)])
        dist.barrier()
    (pathlib.Path(args.out) / f"rank{args.rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


# ---- GPU (NCCL): m3 heads, long sequence, timing ---------------------------------------------
def gpu_main(args):
    """--gpu: NCCL, rank r on cuda:r, bf16. --dry-run: the same code on the CPU with gloo (CI
    checks the harness at a small size before a GPU ever runs it)."""
    rank, P = args.rank, args.world
    if args.gpu:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                                world_size=P, timeout=datetime.timedelta(seconds=300), device_id=dev)

        def sync():
            torch.cuda.synchronize(dev)
    else:
        torch.set_num_threads(1)
        dev = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                                world_size=P, timeout=datetime.timedelta(seconds=60))

        def sync():
            pass
    Hq, Hkv, Hp, Hpk = (int(n) for n in args.heads.split(","))
    heads = dict(Hq=Hq, Hkv=Hkv, Hp=Hp, Hpk=Hpk)
    lengths = [int(n) for n in args.lengths.split(",")]
    topk = args.topk
    x = make_inputs(lengths=lengths, D=args.dim, Dp=args.dim, dtype=torch.bfloat16, device=dev,
                    seed=3, proxy_gain=4.0, **heads)
    seq = dict(cu_seqlens=x["cu_seqlens"], max_seqlen=x["max_seqlen"])
    total = sum(lengths)
    sizes = fcp.shard_sizes(total, P)
    full = {n: x[n].requires_grad_(True) for n in GRADS}
    kw = dict(return_lse=True, **seq)

    def single():
        return flashmsa.msa_attention(*[full[n] for n in GRADS], topk, **kw)

    g = torch.Generator(device=dev).manual_seed(5)
    w_out = torch.randn(full["q"].shape, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)
    out, kl, lse = single()
    ref_grads = torch.autograd.grad((out * w_out).float().sum() + 3.0 * kl, [full[n] for n in GRADS])

    loc = {n: fcp.shard_tokens(full[n].detach(), P, rank, sizes=sizes).clone().requires_grad_(True)
           for n in GRADS}
    w_loc = fcp.shard_tokens(w_out, P, rank, sizes=sizes)

    def cp():
        return fcp.msa_attention_cp(*[loc[n] for n in GRADS], topk, shard_sizes=sizes, scheme=args.scheme,
                                    layout=args.layout, **kw)

    c_out, c_kl, c_lse = cp()
    c_grads = torch.autograd.grad((c_out * w_loc).float().sum() + 3.0 * c_kl, [loc[n] for n in GRADS])
    err = {"out": rel_l2(c_out, fcp.shard_tokens(out, P, rank, sizes=sizes)),
           "lse": rel_l2(c_lse, fcp.shard_tokens(lse, P, rank, dim=1, sizes=sizes)),
           "kl": abs(c_kl.item() - kl.item()) / max(abs(kl.item()), 1e-30)}
    for n, a, b in zip(GRADS, c_grads, ref_grads):
        err["d" + n] = rel_l2(a, fcp.shard_tokens(b, P, rank, sizes=sizes))
    del out, lse, ref_grads, c_out, c_lse, c_grads

    def step(fn, inputs, w):
        o, k_, _l = fn()
        torch.autograd.grad((o * w).float().sum() + 3.0 * k_, inputs)

    def timed(fn, inputs, w, iters):
        step(fn, inputs, w)
        sync()
        dist.barrier()
        ts = []
        for _ in range(iters):
            sync()
            t0 = time.perf_counter()
            step(fn, inputs, w)
            sync()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]

    t_single = timed(single, [full[n] for n in GRADS], w_out, args.iters)
    t_cp = timed(cp, [loc[n] for n in GRADS], w_loc, args.iters)
    # the all-to-all share: one more step with every exchange timed (synchronised around it)
    spent, moved, calls = [0.0], [0], [0]
    orig = fcp._all_to_all_bytes

    def timed_a2a(inbuf, M, r, group):
        sync()
        t0 = time.perf_counter()
        res = orig(inbuf, M, r, group)
        sync()
        spent[0] += time.perf_counter() - t0
        moved[0] += sum(M[r]) - M[r][r]
        calls[0] += 1
        return res

    fcp._all_to_all_bytes = timed_a2a
    try:
        t_inst = timed(cp, [loc[n] for n in GRADS], w_loc, 1)  # a warmup step and a timed one
    finally:
        fcp._all_to_all_bytes = orig
    res = dict(rank=rank, P=P, total=total, heads=heads, dim=args.dim, topk=topk, err=err,
               t_single_ms=t_single * 1e3, t_cp_ms=t_cp * 1e3, t_cp_instrumented_ms=t_inst * 1e3,
               a2a_ms=spent[0] / 2 * 1e3, a2a_share=spent[0] / 2 / t_inst,
               a2a_calls_per_step=calls[0] // 2, bytes_sent_per_step=moved[0] // 2,
               impl=fcp.all_to_all_impl(), device=str(torch.cuda.get_device_name(dev)) if args.gpu else "cpu")
    print(json.dumps(res), flush=True)
    (pathlib.Path(args.out) / f"rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("FLASHMSA_NUM_THREADS", "1")  # before the library loads
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpu", action="store_true", help="the timing run: NCCL, one GPU per rank")
    ap.add_argument("--dry-run", action="store_true", help="the timing run's code on the CPU (gloo)")
    ap.add_argument("--lengths", default="16384,9000,7384")
    ap.add_argument("--heads", default="64,4,4,1", help="Hq,Hkv,Hp,Hpk (default m3)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--scheme", default=None, help="msa_attention_cp's scheme (default: its choice)")
    ap.add_argument("--layout", default="contiguous", help="the tokens scheme's layout (contiguous, zigzag)")
    ap.add_argument("cases", nargs="*")
    a = ap.parse_args()
    gpu_main(a) if a.gpu or a.dry_run else cpu_main(a)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown after the results are written (flashmsa/cp_run.py says why)
