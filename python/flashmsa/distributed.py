"""Context parallelism for MSA: head-parallel all-to-all (DeepSpeed-Ulysses style), autograd
included. Design, communication volume and the ring plan: docs/distributed.md.

    import torch.distributed as dist, flashmsa.distributed as fcp
    # every rank: its contiguous token shard of q, k, v, qp, kp; the FULL cu_seqlens
    out, kl = fcp.msa_attention_cp(q, k, v, qp, kp, topk=16, cu_seqlens=cu, max_seqlen=n)
    loss = task_loss(out) + kl_coef * kl     # kl is the same value on every rank

Sharding. Varlen [total, H, D]: rank r of the group holds the tokens [start_r, start_r + T_r)
of the packed total dimension, in rank order (sequences may straddle ranks). With
`shard_sizes=None` every rank holds the same number of tokens (total = P * T); otherwise
`shard_sizes` lists T_0..T_{P-1} (the same list on every rank; `shard_sizes(total, P)` gives
the balanced split, torch.tensor_split's convention). Batched [B, S, H, D]: rank r holds the
positions [start_r, start_r + S_r) of every sequence ([B, S_r, H, D]); shard sizes count
positions. lse comes back as [Hq, T_r] (batched [Hq, B * S_r], b-major like the single-process
layout) and indices as [Hp, T_r, topk].

Heads. One all-to-all gives every rank all tokens of Hp/P whole MSA groups: rank r gets the
proxy heads [r Hp/P, (r+1) Hp/P), their query heads [r Hq/P, (r+1) Hq/P) and the kv heads and
proxy key heads those need. P must divide Hp (Hq when there is no proxy). A kv head range lines
up when P divides Hkv (rank r gets Hkv/P kv heads) or Hkv divides P (every rank needs one kv
head, shared by P/Hkv ranks: it is replicated and its gradient summed back); otherwise a
ValueError. The same rule holds for the proxy key heads against Hp/P (Hpk = 1: kp is gathered
to every rank and dkp reduce-scattered). MSA then runs locally on the full sequence (the same
cu_seqlens) and a second all-to-all returns out (and lse, indices) to token shards. The
backward mirrors both.

kl is a mean over Hp * total: every rank's local kl is the mean over its Hp/P heads, so the
returned kl (identical on every rank) is the mean of the P local values. kl is a replicated
value: each rank adds it to its loss as a single process would, and its upstream gradient g on
rank r scales rank r's proxy heads by g/P, which makes every gradient shard equal to the
single-process gradient's shard (no communication for kl in the backward). Unlike the
single-process call, the default kl value here comes from the forward (a pass over the selected
blocks, about 20% of the step; compute_kl=False skips it): the cross-rank mean is formed in the
forward.

Requirements: torch.distributed initialised (gloo for CPU tensors, NCCL for CUDA tensors);
every rank calls with the same head counts, dims, dtype, topk, mode and flags, and every rank
runs the backward through out (the all-to-alls are collectives). Every argument is checked on
each rank before any traffic (types, ranges, shapes; with CPU cu_seqlens, that the shards add up
to cu_seqlens[-1]). Then one small all_gather compares the ranks' metadata (token counts of
every shard, head counts, dims, dtype, topk, mode, flags) and whether each rank's checks passed,
so that bad or inconsistent arguments raise a ValueError on every rank instead of leaving the
others waiting in a collective (or gloo aborting the process on a size mismatch): always for a
gloo group (a CPU all_gather, cheap), and with `validate=True` on other backends (NCCL: it
synchronises with the host, so it is opt-in there, like the library's data checks that
`validate=True` also turns on). Eager only: torch.compile graph-breaks around the collectives.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import ops as _ops

Tensor = torch.Tensor
_P = "flashmsa.distributed"
_ALIGN = 16  # bytes; every piece of a packed buffer starts at a multiple of this

__all__ = ["msa_attention_cp", "shard_sizes", "shard_bounds", "shard_tokens", "head_ranges",
           "all_to_all_impl", "set_all_to_all_impl"]


# ---- sharding helpers -----------------------------------------------------------------------
def shard_sizes(total: int, world_size: int) -> List[int]:
    """The balanced token split (torch.tensor_split's convention): the first total % P ranks hold
    one token more."""
    q, rem = divmod(int(total), int(world_size))
    return [q + 1] * rem + [q] * (world_size - rem)


def shard_bounds(total: int, world_size: int) -> List[Tuple[int, int]]:
    """[(start, end)] per rank of the balanced split."""
    res, s = [], 0
    for n in shard_sizes(total, world_size):
        res.append((s, s + n))
        s += n
    return res


def shard_tokens(x: Tensor, world_size: int, rank: int, dim: int = 0,
                 sizes: Optional[Sequence[int]] = None) -> Tensor:
    """Rank `rank`'s token shard of a full tensor (a view): dim 0 of varlen [total, H, D], dim 1
    of batched [B, S, H, D]; `sizes` defaults to shard_sizes(x.shape[dim], world_size)."""
    sizes = list(sizes) if sizes is not None else shard_sizes(x.shape[dim], world_size)
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank])


def head_ranges(Hq: int, Hkv: int, Hp: Optional[int], Hpk: Optional[int], world_size: int
                ) -> Dict[str, List[Tuple[int, int]]]:
    """Per head family ('q', 'kv', 'qp', 'kp'), per rank, (first head, count) that rank runs.
    Raises ValueError naming the count that P does not divide (or that does not line up)."""
    P = int(world_size)
    if Hq % Hkv:
        raise ValueError(f"{_P}: head counts: Hq = {Hq} is not a multiple of Hkv = {Hkv}")
    if Hp is not None and Hq % Hp:
        raise ValueError(f"{_P}: head counts: Hq = {Hq} is not a multiple of Hp = {Hp}")
    if Hp is not None and Hpk is not None and Hp % Hpk:
        raise ValueError(f"{_P}: head counts: Hp = {Hp} is not a multiple of Hpk = {Hpk}")
    if Hp is not None:
        if Hp % P:
            raise ValueError(
                f"{_P}: Hp (proxy heads, one per MSA group) = {Hp} is not divisible by the context-"
                f"parallel size P = {P}: head-parallel CP gives every rank Hp/P whole MSA groups "
                f"(their query, kv and proxy key heads), so P must divide Hp; P > Hp needs the ring "
                f"variant (docs/distributed.md)")
    elif Hq % P:
        raise ValueError(f"{_P}: Hq (query heads) = {Hq} is not divisible by the context-parallel "
                         f"size P = {P}: every rank takes Hq/P query heads")
    hq = Hq // P
    r = {"q": [(i * hq, hq) for i in range(P)]}
    r["kv"] = _dependent("Hkv (kv heads)", Hkv, Hq, P, "query")
    if Hp is not None:
        hp = Hp // P
        r["qp"] = [(i * hp, hp) for i in range(P)]
        if Hpk is not None:
            r["kp"] = _dependent("Hpk (proxy key heads)", Hpk, Hp, P, "proxy")
    return r


def _dependent(name: str, Hd: int, Hs: int, P: int, what: str) -> List[Tuple[int, int]]:
    """Heads of a family that a rank's Hs/P consecutive source heads map to (h -> h / (Hs/Hd)):
    Hd/P of them when P divides Hd, one (shared by P/Hd ranks) when Hd divides P."""
    if Hd % P == 0:
        n = Hd // P
        return [(i * n, n) for i in range(P)]
    if P % Hd == 0:
        per = Hs // Hd  # source heads per dependent head; a multiple of Hs/P here
        return [((i * (Hs // P)) // per, 1) for i in range(P)]
    short = name.split()[0]
    raise ValueError(
        f"{_P}: {name} = {Hd} is not divisible by the context-parallel size P = {P} and does not "
        f"divide it either: the {Hs // P} {what} heads of a rank would need a range of {short} heads "
        f"that straddles head boundaries unevenly. Choose P dividing {short} = {Hd} (each rank gets "
        f"{short}/P of them) or a multiple of it (each {short} head replicated on P/{short} ranks, "
        f"its gradient summed back)")


# ---- the all-to-all: one function, bytes in, bytes out -----------------------------------------
_IMPLS = ("auto", "all_to_all_single", "all_gather")
_impl = os.environ.get("FLASHMSA_CP_ALL_TO_ALL", "auto")
_unsupported: set = set()  # backends that answered "does not support alltoall"


def set_all_to_all_impl(impl: str) -> None:
    """'auto' (all_to_all_single; all_gather where the backend lacks all-to-all), or force one.
    All ranks must use the same."""
    global _impl
    if impl not in _IMPLS:
        raise ValueError(f"{_P}: all-to-all implementation: expected one of {_IMPLS}, got {impl!r}")
    _impl = impl


def all_to_all_impl(group=None) -> str:
    """The implementation the next exchange on `group` uses."""
    if _impl != "auto":
        return _impl
    return "all_gather" if dist.get_backend(group) in _unsupported else "all_to_all_single"


def _all_to_all_bytes(inbuf: Tensor, M: List[List[int]], rank: int, group) -> Tuple[Tensor, List[int]]:
    """Rank s sends M[s][d] bytes to rank d: inbuf holds this rank's messages in destination
    order. Returns the receive buffer and the offset of each source's message in it.
    NCCL and gloo (torch >= 1.8, CPU tensors) have all_to_all_single, uneven splits included;
    where a backend has none, all_gather_into_tensor of padded buffers and local slicing (P times
    the traffic) does the same."""
    P = len(M)
    impl = all_to_all_impl(group)
    if impl == "all_to_all_single":
        col = [M[s][rank] for s in range(P)]
        outbuf = torch.empty(sum(col), dtype=torch.uint8, device=inbuf.device)
        try:
            dist.all_to_all_single(outbuf, inbuf, output_split_sizes=col,
                                   input_split_sizes=list(M[rank]), group=group)
            return outbuf, [sum(col[:s]) for s in range(P)]
        except RuntimeError as e:  # raised by every rank before any traffic
            if _impl != "auto" or "does not support" not in str(e):
                raise
            _unsupported.add(dist.get_backend(group))
    width = max(max(sum(row) for row in M), 1)
    padded = torch.zeros(width, dtype=torch.uint8, device=inbuf.device)
    padded[:inbuf.numel()].copy_(inbuf)
    gathered = torch.empty(P * width, dtype=torch.uint8, device=inbuf.device)
    dist.all_gather_into_tensor(gathered, padded, group=group)
    return gathered, [s * width + sum(M[s][:rank]) for s in range(P)]


def _itemsize(dtype) -> int:
    return getattr(dtype, "itemsize", None) or torch.empty((), dtype=dtype).element_size()


def _nbytes(shape, dtype) -> int:
    n = math.prod(shape) * _itemsize(dtype)
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _view(buf: Tensor, off: int, shape, dtype) -> Tensor:
    return buf.narrow(0, off, math.prod(shape) * _itemsize(dtype)).view(dtype).view(shape)


def _exchange(send: List[List[Tensor]], spec, plan: "_Plan") -> List[List[Tensor]]:
    """send[d]: the tensors for rank d (any strides); spec(s, d): [(shape, dtype)] of what rank s
    sends rank d (every rank can compute it). Packs everything into one uint8 buffer, runs one
    all-to-all and returns, per source rank, views of its tensors in the receive buffer."""
    P, rank = plan.P, plan.rank
    specs = [[spec(s, d) for d in range(P)] for s in range(P)]
    M = [[sum(_nbytes(sh, dt) for sh, dt in specs[s][d]) for d in range(P)] for s in range(P)]
    inbuf = torch.empty(sum(M[rank]), dtype=torch.uint8, device=plan.device)
    off = 0
    for d in range(P):
        for t, (sh, dt) in zip(send[d], specs[rank][d]):
            assert tuple(t.shape) == tuple(sh) and t.dtype == dt, (t.shape, sh, t.dtype, dt)
            _view(inbuf, off, sh, dt).copy_(t)
            off += _nbytes(sh, dt)
    outbuf, base = _all_to_all_bytes(inbuf, M, rank, plan.group)
    res = []
    for s in range(P):
        off, pieces = base[s], []
        for sh, dt in specs[s][rank]:
            pieces.append(_view(outbuf, off, sh, dt))
            off += _nbytes(sh, dt)
        res.append(pieces)
    return res


# ---- the plan: who holds which tokens and heads -----------------------------------------------
def _sub(shape, td: int, t: int, hd: int, h: int) -> tuple:
    s = list(shape)
    s[td], s[hd] = t, h
    return tuple(s)


class _Plan:
    """Token shards (T_r, start_r), head ranges per family, and the two directions of the
    exchange. A field is (family, token dim, head dim) of a tensor."""

    def __init__(self, group, rank, P, tsizes, ranges, full_heads, device):
        self.group, self.rank, self.P, self.device = group, rank, P, device
        self.T = list(tsizes)
        self.start = [sum(self.T[:i]) for i in range(P)]
        self.ranges, self.H = ranges, full_heads
        # a family whose ranges tile [0, H) in rank order needs no accumulation on the way back
        self.disjoint = {f: all(r[i][0] == sum(n for _, n in r[:i]) for i in range(P))
                         and sum(n for _, n in r) == full_heads[f] for f, r in ranges.items()}

    def to_heads(self, fields, xs) -> List[Tensor]:
        """Token shard with all heads -> all tokens with this rank's heads (per field)."""
        shapes = [x.shape for x in xs]

        def spec(s, d):
            return [(_sub(sh, td, self.T[s], hd, self.ranges[f][d][1]), x.dtype)
                    for (f, td, hd), sh, x in zip(fields, shapes, xs)]

        send = [[x.narrow(hd, self.ranges[f][d][0], self.ranges[f][d][1])
                 for (f, td, hd), x in zip(fields, xs)] for d in range(self.P)]
        recv = _exchange(send, spec, self)
        return [torch.cat([recv[s][i] for s in range(self.P)], dim=td)
                for i, (f, td, hd) in enumerate(fields)]

    def to_tokens(self, fields, ys) -> List[Tensor]:
        """All tokens with this rank's heads -> token shard with all heads; heads held by several
        ranks (replicated kv / proxy key heads) are summed."""
        shapes = [y.shape for y in ys]

        def spec(s, d):
            return [(_sub(sh, td, self.T[d], hd, self.ranges[f][s][1]), y.dtype)
                    for (f, td, hd), sh, y in zip(fields, shapes, ys)]

        send = [[y.narrow(td, self.start[d], self.T[d]) for (f, td, hd), y in zip(fields, ys)]
                for d in range(self.P)]
        recv = _exchange(send, spec, self)
        res = []
        for i, (f, td, hd) in enumerate(fields):
            pieces = [recv[s][i] for s in range(self.P)]
            if self.disjoint[f]:
                res.append(torch.cat(pieces, dim=hd))
                continue
            # bf16/fp16 partial sums are accumulated in fp32 and rounded once
            low = pieces[0].dtype in (torch.bfloat16, torch.float16)
            acc = torch.zeros(_sub(pieces[0].shape, td, self.T[self.rank], hd, self.H[f]),
                              dtype=torch.float32 if low else pieces[0].dtype, device=self.device)
            for s, p in enumerate(pieces):
                acc.narrow(hd, self.ranges[f][s][0], self.ranges[f][s][1]).add_(p)
            res.append(acc.to(pieces[0].dtype))
        return res


class _ToHeads(torch.autograd.Function):
    """Forward: token shards -> head shards. Backward: the gradients back to token shards (summed
    over the ranks that shared a head). Fields after `n_diff` are not differentiable (indices)."""

    @staticmethod
    def forward(ctx, plan, fields, n_diff, *xs):
        ctx.plan, ctx.fields, ctx.n_diff = plan, fields, n_diff
        outs = plan.to_heads(fields, xs)
        ctx.mark_non_differentiable(*outs[n_diff:])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *gs):
        n = ctx.n_diff
        grads = ctx.plan.to_tokens(ctx.fields[:n], list(gs[:n]))
        grads = [g if need else None for g, need in zip(grads, ctx.needs_input_grad[3:])]
        return (None, None, None, *grads, *([None] * (len(gs) - n)))


class _ToTokens(torch.autograd.Function):
    """Forward: head shards of out (lse, indices) -> token shards; the local kl values -> their
    mean (identical bits on every rank). Backward: dout (dlse) -> head shards; dkl -> dkl / P."""

    @staticmethod
    def forward(ctx, plan, fields, n_diff, kl, *ys):
        ctx.plan, ctx.fields, ctx.n_diff = plan, fields, n_diff
        P = plan.P
        shapes = [y.shape for y in ys]

        def spec(s, d):
            return [(_sub(sh, td, plan.T[d], hd, plan.ranges[f][s][1]), y.dtype)
                    for (f, td, hd), sh, y in zip(fields, shapes, ys)] + [((), kl.dtype)]

        send = [[y.narrow(td, plan.start[d], plan.T[d]) for (f, td, hd), y in zip(fields, ys)]
                + [kl] for d in range(P)]  # kl: a 0-dim piece, the same to every rank
        recv = _exchange(send, spec, plan)
        outs = [torch.cat([recv[s][i] for s in range(P)], dim=hd) for i, (f, td, hd) in enumerate(fields)]
        kl_mean = (torch.stack([recv[s][-1] for s in range(P)]).double().sum() / P).to(kl.dtype)
        ctx.mark_non_differentiable(*outs[n_diff:])
        return (kl_mean, *outs)

    @staticmethod
    def backward(ctx, dkl, *gs):
        n = ctx.n_diff
        grads = ctx.plan.to_heads(ctx.fields[:n], list(gs[:n]))
        return (None, None, None, dkl / ctx.plan.P, *grads, *([None] * (len(gs) - n)))


# ---- the operation -----------------------------------------------------------------------------
def _check_agreement(sig: Dict[str, int], error: Optional[Exception], group, device, P: int) -> None:
    """validate=True: one all_gather of every rank's argument signature and of whether its local
    argument checks failed, so that every rank raises (instead of the others waiting in a
    collective) when one rank's arguments are bad or the ranks disagree."""
    names, vals = ["argument checks failed"] + list(sig), [int(error is not None)] + list(sig.values())
    mine = torch.tensor(vals, dtype=torch.int64, device=device)
    allsig = torch.empty(P * len(vals), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(allsig, mine, group=group)
    allsig = allsig.view(P, len(vals)).cpu()
    if error is not None:
        raise error
    failed = allsig[:, 0].nonzero()
    if failed.numel():
        raise ValueError(f"{_P}: rank {int(failed[0, 0])} rejected its arguments (its own error says "
                         f"why); no rank ran")
    shard_cols = [j for j, n in enumerate(names) if n.startswith("shard_sizes[")]
    for s in range(P):
        bad = (allsig[s] != allsig[0]).nonzero()
        if bad.numel():
            j = int(bad[0, 0])
            if j in shard_cols:
                mine, theirs = ([int(allsig[r, c]) for c in shard_cols] for r in (0, s))
                raise ValueError(
                    f"{_P}: shard_sizes: the ranks' token shards do not add up: rank 0 sees shard sizes "
                    f"{mine}, rank {s} sees {theirs} (with shard_sizes=None every rank must hold the same "
                    f"number of tokens; otherwise pass the same shard_sizes list on every rank)")
            raise ValueError(f"{_P}: ranks disagree on {names[j]}: rank 0 has {int(allsig[0, j])}, "
                             f"rank {s} has {int(allsig[s, j])} (every rank must pass the same "
                             f"head counts, dims, dtype, topk, mode, flags and shard sizes)")


def _i64(x) -> int:
    """A signature value: an int in int64 range (bad arguments map to -2, absent ones to -1)."""
    if x is None:
        return -1
    if isinstance(x, bool):
        return int(x)
    if not isinstance(x, numbers.Integral) or not -2**63 <= int(x) < 2**63:
        return -2
    return int(x)


def _signature(q, k, v, qp, kp, indices, cu_seqlens, max_seqlen, topk, warmup, return_lse,
               return_indices, shard_sizes, tsizes, P) -> Dict[str, int]:
    """What every rank must agree on, read defensively (the arguments may be bad). tsizes: the
    token count of every shard as this rank sees it (None when its checks failed)."""
    def dim(t, i):
        return int(t.shape[i]) if isinstance(t, torch.Tensor) and -t.dim() <= i < t.dim() else -1

    if tsizes is None:  # this rank's checks failed: the sizes as given, where readable
        try:
            tsizes = [] if shard_sizes is None or isinstance(shard_sizes, (str, bytes)) else list(shard_sizes)
        except TypeError:
            tsizes = []
    cu_last = -1
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type == "cpu" and cu_seqlens.numel() \
            and not cu_seqlens.is_floating_point():
        cu_last = int(cu_seqlens.reshape(-1)[-1])
    sig = dict(ndim=q.dim() if isinstance(q, torch.Tensor) else -1,
               B=dim(q, 0) if isinstance(q, torch.Tensor) and q.dim() == 4 else 1,
               Hq=dim(q, -2), D=dim(q, -1), Hkv=dim(k, -2), Dv=dim(v, -1), Hp=dim(qp, -2),
               Dp=dim(qp, -1), Hpk=dim(kp, -2),
               dtype=_ops._FLOATS.index(q.dtype) if getattr(q, "dtype", None) in _ops._FLOATS else -1,
               topk=_i64(topk),
               mode=2 if indices is not None else 1 if warmup is True else 0, has_proxy=int(qp is not None),
               given_Hp=dim(indices, 0), given_topk=dim(indices, -1),
               return_lse=_i64(return_lse), return_indices=_i64(return_indices),
               cu_len=cu_seqlens.numel() if isinstance(cu_seqlens, torch.Tensor) else 0,
               cu_last=cu_last, max_seqlen=_i64(max_seqlen),
               shard_sizes_given=int(shard_sizes is not None))
    for i in range(P):
        sig[f"shard_sizes[{i}]"] = _i64(tsizes[i]) if i < len(tsizes) else -1
    return sig


def _prepare(q, k, v, qp, kp, cu_seqlens, indices, max_seqlen, warmup, shard_sizes, options, validate,
             group, rank, P):
    """The local argument checks (no traffic): the plan, B, this rank's token count, Hp.
    options: the keyword arguments of msa_attention that need no tensor (checked first)."""
    _ops._check_inputs(q, k, v, qp, kp, cu_seqlens, indices)
    _ops._check_options(**options)
    if max_seqlen is not None:
        _ops._int("max_seqlen", max_seqlen, 0, _ops.INT32_MAX)
    if q.dim() not in (3, 4):
        raise ValueError(f"{_P}: q: expected [T, Hq, D] (varlen) or [B, S, Hq, D] (batched), got "
                         f"{list(q.shape)}")
    batched = q.dim() == 4
    td = 1 if batched else 0
    if batched and cu_seqlens is not None:
        raise ValueError(f"{_P}: cu_seqlens: must be None for batched [B, S, H, D] inputs")
    if not batched and cu_seqlens is None:
        raise ValueError(f"{_P}: cu_seqlens: is required for varlen inputs (the full sequence's, on "
                         f"every rank)")
    named = [("q", q), ("k", k), ("v", v), ("qp", qp), ("kp", kp)]
    for name, t in named:
        if t is not None and (t.dim() != q.dim() or t.shape[:td + 1] != q.shape[:td + 1]):
            raise ValueError(f"{_P}: {name}: expected {q.dim()} dimensions with leading "
                             f"{list(q.shape[:td + 1])} (the shape of q's token dims), got {list(t.shape)}")
    if warmup and indices is not None:
        raise ValueError(f"{_P}: indices: must be None with warmup=True (dense mode selects nothing)")
    if indices is None and not warmup and qp is None:
        raise ValueError(f"{_P}: qp: qp and kp are required in sparse mode (they select the blocks)")
    T_loc = q.shape[td]
    if shard_sizes is None:
        tsizes = [T_loc] * P
    else:
        if isinstance(shard_sizes, (str, bytes)) or not hasattr(shard_sizes, "__len__"):
            raise TypeError(f"{_P}: shard_sizes: expected a list of {P} ints (one per rank) or None, got "
                            f"{type(shard_sizes).__name__}")
        tsizes = shard_sizes.tolist() if isinstance(shard_sizes, torch.Tensor) else list(shard_sizes)
        for i, n in enumerate(tsizes):
            if isinstance(n, bool) or not isinstance(n, numbers.Integral):
                raise TypeError(f"{_P}: shard_sizes: expected ints, got {type(n).__name__} {n!r} at "
                                f"position {i}")
        tsizes = [int(n) for n in tsizes]
        if len(tsizes) != P or min(tsizes) < 0 or max(tsizes) > _ops.INT32_MAX:
            raise ValueError(f"{_P}: shard_sizes: expected {P} non-negative token counts (one per "
                             f"rank), got {list(shard_sizes)}")
        if tsizes[rank] != T_loc:
            raise ValueError(f"{_P}: shard_sizes: rank {rank} holds {T_loc} tokens (q.shape[{td}]) "
                             f"but shard_sizes[{rank}] = {tsizes[rank]}")
    full = sum(tsizes)
    if batched:
        if max_seqlen not in (None, 0, full):
            raise ValueError(f"{_P}: max_seqlen: expected None, 0 or S = {full} (the full sequence length: "
                             f"the sum of the shards), got {max_seqlen}")
    elif cu_seqlens.numel() and (cu_seqlens.device.type == "cpu" or validate):
        last = int(cu_seqlens[-1])  # free on the CPU; a synchronisation on CUDA (validate only)
        if last != full:
            hint = (f"; shard_sizes=None means every rank holds this rank's {T_loc} tokens: pass "
                    f"shard_sizes for uneven shards" if shard_sizes is None else "")
            raise ValueError(f"{_P}: shard_sizes: the token shards add up to {full} tokens "
                             f"({' + '.join(map(str, tsizes))}) but cu_seqlens[-1] = {last} (the full "
                             f"packed sequence, the same on every rank){hint}")
    B = q.shape[0] if batched else 1
    flat = T_loc * B  # this rank's tokens in the [H, total] layouts
    if indices is not None:
        if indices.dim() != 3 or indices.shape[1] != flat:
            raise ValueError(f"{_P}: indices: expected [Hp, {flat}, topk] (this rank's tokens), got "
                             f"{list(indices.shape)}")

    # ---- heads
    Hq, Hkv = q.shape[-2], k.shape[-2]
    Hp = qp.shape[-2] if qp is not None else indices.shape[0] if indices is not None else None
    Hpk = kp.shape[-2] if kp is not None else None
    if v.shape[-2] != Hkv:
        raise ValueError(f"{_P}: v: expected {Hkv} heads (those of k), got {v.shape[-2]}")
    if qp is not None and indices is not None and indices.shape[0] != Hp:
        raise ValueError(f"{_P}: indices: expected {Hp} proxy heads (those of qp), got {indices.shape[0]}")
    ranges = head_ranges(Hq, Hkv, Hp, Hpk, P)
    full = {"q": Hq, "kv": Hkv, "qp": Hp, "kp": Hpk}
    plan = _Plan(group, rank, P, tsizes, ranges, full, q.device)
    return plan, B, T_loc, Hp


def msa_attention_cp(q: Tensor, k: Tensor, v: Tensor, qp: Optional[Tensor] = None,
                     kp: Optional[Tensor] = None, topk: int = 16, *,
                     cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None,
                     group=None, shard_sizes: Optional[Sequence[int]] = None,
                     warmup: bool = False, indices: Optional[Tensor] = None,
                     softmax_scale: Optional[float] = None, proxy_scale: Optional[float] = None,
                     compute_kl: Optional[bool] = None, return_lse: bool = False,
                     return_indices: bool = False, numerics: Optional[str] = None,
                     validate: bool = False):
    """flashmsa.msa_attention with every per-token tensor sharded by tokens over the ranks of
    `group` (default: the world). Arguments and results as in msa_attention, except:

    - no precise_dpsum (each rank's local msa_attention runs with the default).
    - q, k, v, qp, kp: this rank's token shard ([T_r, H, D] varlen, [B, S_r, H, D] batched);
      cu_seqlens [B+1] and max_seqlen describe the FULL packed sequence (same on every rank).
    - shard_sizes: T_0..T_{P-1} (positions per sequence when batched); None: equal shards.
    - indices (given mode) and the returned indices: this rank's tokens, [Hp, T_r, topk].
    - lse: [Hq, T_r] (batched [Hq, B * S_r]).
    - kl: the single-process value, identical on every rank (see the module docstring for its
      gradient convention).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{_P}: torch.distributed is not initialised (call "
                           f"torch.distributed.init_process_group first)")
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{_P}: group: this process is not a member of the group")
    kw = dict(warmup=warmup, softmax_scale=softmax_scale, proxy_scale=proxy_scale,
              compute_kl=compute_kl, numerics=numerics, validate=validate)
    if P == 1:
        return _ops.msa_attention(q, k, v, qp, kp, topk, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                  indices=indices, return_lse=return_lse,
                                  return_indices=return_indices, **kw)
    # the agreement check: always on gloo (cheap, CPU), opt-in (validate=True) elsewhere
    agree = validate is True or dist.get_backend(group) == "gloo"
    options = dict(topk=topk, return_lse=return_lse, return_indices=return_indices, **kw)
    tsizes = None
    try:
        plan, B, T_loc, Hp = _prepare(q, k, v, qp, kp, cu_seqlens, indices, max_seqlen, warmup,
                                      shard_sizes, options, validate is True, group, rank, P)
        tsizes, error = plan.T, None
    except (TypeError, ValueError) as e:
        if not agree:
            raise
        error = e
    if agree:  # before any other traffic: bad arguments on one rank raise on every rank
        dev = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
        _check_agreement(_signature(q, k, v, qp, kp, indices, cu_seqlens, max_seqlen, topk, warmup,
                                    return_lse, return_indices, shard_sizes, tsizes, P), error, group, dev, P)
    batched = q.dim() == 4
    td = 1 if batched else 0
    Hq = q.shape[-2]
    tsizes = plan.T

    # ---- tokens -> heads (one all-to-all for every input)
    hd = td + 1
    fields, xs = [("q", td, hd), ("kv", td, hd), ("kv", td, hd)], [q, k, v]
    if qp is not None:
        fields += [("qp", td, hd), ("kp", td, hd)]
        xs += [qp, kp]
    n_diff = len(xs)
    if indices is not None:  # [Hp, T_r, topk] -> token dim explicit for batched
        fields.append(("qp", 1 + int(batched), 0))
        xs.append(indices.reshape(Hp, B, T_loc, indices.shape[2]) if batched else indices)
    hs = _ToHeads.apply(plan, tuple(fields), n_diff, *xs)
    qh, kh, vh = hs[:3]
    qph, kph = (hs[3], hs[4]) if qp is not None else (None, None)
    idx_h = None
    if indices is not None:
        idx_h = hs[-1].reshape(hs[-1].shape[0], -1, hs[-1].shape[-1]) if batched else hs[-1]

    # ---- local MSA on the full sequence
    sparse = indices is None and not warmup
    want_idx = bool(return_indices) and sparse
    # the local kl from the forward: the returned kl is the cross-rank mean formed here (a value
    # the local backward would write only into the local tensor)
    res = _ops._attention(qh, kh, vh, qph, kph, topk, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                          indices=idx_h, return_lse=bool(return_lse), return_indices=want_idx,
                          precise_dpsum=False, kl_from_backward=False, **kw)
    out_h, kl_h = res[0], res[1]
    S_full = sum(tsizes)

    # ---- heads -> tokens (one all-to-all for every output)
    ofields, ys = [("q", td, hd)], [out_h]
    if return_lse:
        lse_h = res[2]
        ofields.append(("q", 1 + int(batched), 0))
        ys.append(lse_h.view(lse_h.shape[0], B, S_full) if batched else lse_h)
    n_odiff = len(ys)
    if want_idx:
        idx_o = res[-1]
        ofields.append(("qp", 1 + int(batched), 0))
        ys.append(idx_o.view(idx_o.shape[0], B, S_full, idx_o.shape[-1]) if batched else idx_o)
    outs = _ToTokens.apply(plan, tuple(ofields), n_odiff, kl_h, *ys)
    kl, out = outs[0], outs[1]
    result = [out, kl]
    if return_lse:
        lse = outs[2]
        result.append(lse.reshape(Hq, B * T_loc) if batched else lse)
    if return_indices:
        if want_idx:
            idx = outs[-1]
            result.append(idx.reshape(Hp, B * T_loc, idx.shape[-1]) if batched else idx)
        else:
            result.append(indices)  # given mode: the caller's own; warmup: None
    return tuple(result)
