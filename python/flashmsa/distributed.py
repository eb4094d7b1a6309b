"""Context parallelism for MSA, autograd included: the heads scheme (a head-parallel all-to-all,
DeepSpeed-Ulysses style, P up to Hp), the tokens scheme (k, v, kp gathered, each rank's queries as
query segments: any P) and their composition (hybrid). Design, volumes and tests: docs/distributed.md.

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
single-process gradient's shard (no communication for kl in the backward). In training the
default kl value is formed in the backward, like the single-process call's (NaN until then): the
gradients' exchange back to the owners carries the local values and fills it. In inference or
with compute_kl=True the forward computes the local values (a pass over the selected blocks,
about 20% of the step) and the mean travels with the outputs' exchange.

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

__all__ = ["msa_attention_cp", "shard_sizes", "shard_bounds", "shard_tokens", "zigzag_rows", "head_ranges",
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


def zigzag_rows(cu_seqlens, world_size: int, rank: int) -> Tensor:
    """The rows of the packed total that rank `rank` holds in the zigzag layout (every sequence
    split into 2P chunks by shard_sizes(length, 2P), rank r holding chunks r and 2P - 1 - r of each,
    in sequence order): x.index_select(0, zigzag_rows(cu, P, r)) is its shard of a varlen tensor,
    and len() of it is its entry of shard_sizes."""
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    return _chunk_rows(cu, [_chunks(cu, [0] * int(world_size), "zigzag")[int(rank)]])


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
        self.late_kl = None  # (local kl, returned kl): the kl formed in the backward (to_tokens fills it)

    def kl_mean(self, recv, i: int) -> Tensor:
        """The P local kl values (piece i of each source in recv) -> their mean in fp64, in rank order (every head
        subset has Hp / P proxy heads): identical bits on every rank."""
        return torch.stack([recv[s][i] for s in range(self.P)]).double().sum() / self.P

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
        late = self.late_kl  # (the gradients' way back, after the local backward formed this rank's kl)
        extra = [] if late is None else [late[0].detach().reshape(())]

        def spec(s, d):
            return [(_sub(sh, td, self.T[d], hd, self.ranges[f][s][1]), y.dtype)
                    for (f, td, hd), sh, y in zip(fields, shapes, ys)] + [((), x.dtype) for x in extra]

        send = [[y.narrow(td, self.start[d], self.T[d]) for (f, td, hd), y in zip(fields, ys)] + extra
                for d in range(self.P)]
        recv = _exchange(send, spec, self)
        if late is not None:
            self.late_kl = None
            late[1].copy_(self.kl_mean(recv, -1).to(late[1].dtype))
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
        kl_mean = plan.kl_mean(recv, -1).to(kl.dtype)
        ctx.mark_non_differentiable(*outs[n_diff:])
        return (kl_mean, *outs)

    @staticmethod
    def backward(ctx, dkl, *gs):
        n = ctx.n_diff
        grads = ctx.plan.to_heads(ctx.fields[:n], list(gs[:n]))
        return (None, None, None, dkl / ctx.plan.P, *grads, *([None] * (len(gs) - n)))


# ---- token parallelism: queries stay on their rank, the keys are gathered ---------------------
def _chunks(cu: List[int], tsizes: List[int], layout: str, batched_S: Optional[int] = None
            ) -> List[List[Tuple[int, int, int]]]:
    """Per rank, the (sequence, first position, length) chunks of the full problem its rows hold,
    in row order. Varlen contiguous: rank r holds [start_r, start_r + T_r) of the packed total
    (a sequence may straddle ranks). Zigzag: every sequence of length n is split into 2P chunks
    (shard_sizes(n, 2P)) and rank r holds chunks r and 2P - 1 - r of each sequence, in sequence
    order. Batched (batched_S): rank r holds positions [start_r, start_r + T_r) of every sequence."""
    P, B = len(tsizes), len(cu) - 1
    res: List[List[Tuple[int, int, int]]] = [[] for _ in range(P)]
    if batched_S is not None:
        start = [sum(tsizes[:r]) for r in range(P)]
        for r in range(P):
            res[r] = [(b, start[r], tsizes[r]) for b in range(B)]
        return res
    if layout == "zigzag":
        for b in range(B):
            n = cu[b + 1] - cu[b]
            sz = shard_sizes(n, 2 * P)
            st = [sum(sz[:i]) for i in range(2 * P)]
            for r in range(P):
                for c in (r, 2 * P - 1 - r):
                    if sz[c]:
                        res[r].append((b, st[c], sz[c]))
        return res
    start = 0
    for r in range(P):
        lo, hi = start, start + tsizes[r]
        for b in range(B):
            a, e = max(lo, cu[b]), min(hi, cu[b + 1])
            if a < e:
                res[r].append((b, a - cu[b], e - a))
        start = hi
    return res


def _chunk_rows(cu: List[int], chunks: List[List[Tuple[int, int, int]]], device=None) -> Tensor:
    """The rows of the packed total that the (sequence, first position, length) chunks hold, chunk list after chunk
    list (rank after rank for _chunks' lists), as one long tensor."""
    parts = [torch.arange(cu[b] + pos, cu[b] + pos + n) for c in chunks for b, pos, n in c]
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)).to(device)


class _TokenPlan:
    """Who holds which rows: chunks per rank, the row of every rank's tokens in the full packed
    key tensor (perm), and this rank's query segments."""

    def __init__(self, group, rank, P, chunks, cu, device):
        self.group, self.rank, self.P, self.device = group, rank, P, device
        self.cu = cu
        self.total = cu[-1]
        self.rows = [sum(n for _, _, n in c) for c in chunks]
        self.perm = _chunk_rows(cu, chunks, device)  # full row of each gathered row
        self.offsets = [sum(self.rows[:r]) for r in range(P)]
        mine = chunks[rank]
        cuq = [0]
        for _, _, n in mine:
            cuq.append(cuq[-1] + n)
        self.cu_seqlens_q = torch.tensor(cuq, dtype=torch.int32, device=device)
        self.q_origin = torch.tensor([[b, pos] for b, pos, _ in mine], dtype=torch.int32,
                                     device=device).reshape(-1, 2)
        self.max_seqlen_q = max([n for _, _, n in mine], default=0)
        self.late_kl = None  # (local kl, returned kl): the kl formed in the backward (_KlFromBackward)
        self.share = self.rows[rank] / self.total if self.total else 0.0  # this rank's rows / all rows

    def kl_mean(self, recv, i: int) -> Tensor:
        """The ranks' local kl values (piece i of each source in recv; each a mean over Hp x its rows) -> the mean
        over all rows, in fp64 and rank order: identical bits on every rank."""
        vals = torch.stack([recv[s][i] for s in range(self.P)]).double()
        w = torch.tensor(self.rows, dtype=torch.float64, device=vals.device)
        return (vals * w).sum() / self.total if self.total else vals.sum() * 0

    def gather(self, xs: List[Tensor]) -> List[Tensor]:
        """This rank's rows of each tensor -> the full packed tensor (every rank's rows in place)."""
        shapes = [x.shape for x in xs]

        def spec(s, d):
            return [((self.rows[s],) + tuple(sh[1:]), x.dtype) for sh, x in zip(shapes, xs)]

        recv = _exchange([list(xs) for _ in range(self.P)], spec, self)
        res = []
        for i, x in enumerate(xs):
            cat = torch.cat([recv[s][i] for s in range(self.P)], dim=0)
            full = torch.empty((self.total,) + tuple(x.shape[1:]), dtype=x.dtype, device=self.device)
            res.append(full.index_copy_(0, self.perm, cat))
        return res

    def reduce(self, gs: List[Tensor]) -> List[Tensor]:
        """Full-length partial gradients -> this rank's rows, summed over the ranks in rank order
        (bf16/fp16 partials sent in fp32, rounded once). With a late kl (the local backward has just
        written this rank's kl), the same exchange carries the local values and the returned kl gets
        their row-weighted mean."""
        low = [g.dtype in (torch.bfloat16, torch.float16) for g in gs]
        wire = [g.float() if lo else g for g, lo in zip(gs, low)]
        late = self.late_kl
        extra = [] if late is None else [late[0].detach().reshape(())]

        def spec(s, d):
            return [((self.rows[d],) + tuple(g.shape[1:]), w.dtype) for g, w in zip(gs, wire)] + \
                [((), x.dtype) for x in extra]

        send = [[w.index_select(0, self.perm.narrow(0, self.offsets[d], self.rows[d])) for w in wire] + extra
                for d in range(self.P)]
        recv = _exchange(send, spec, self)
        if late is not None:
            self.late_kl = None
            late[1].copy_(self.kl_mean(recv, -1).to(late[1].dtype))
        res = []
        for i, g in enumerate(gs):
            acc = recv[0][i].clone()
            for s in range(1, self.P):
                acc.add_(recv[s][i])
            res.append(acc.to(g.dtype))
        return res


class _GatherKeys(torch.autograd.Function):
    """Forward: every rank's rows of k, v, kp -> the full tensors. Backward: the full-length
    partial gradients -> summed into each owner's rows."""

    @staticmethod
    def forward(ctx, plan, *xs):
        ctx.plan = plan
        outs = plan.gather(list(xs))
        ctx.meta = [(o.shape, o.dtype) for o in outs]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *gs):
        gs = [g if g is not None else torch.zeros(sh, dtype=dt, device=ctx.plan.device)
              for g, (sh, dt) in zip(gs, ctx.meta)]
        return (None, *ctx.plan.reduce(gs))


class _KlFromBackward(torch.autograd.Function):
    """The tokens scheme's default kl in training: the forward returns a NaN placeholder and registers it with the
    plan; the local backward writes this rank's kl (no forward pass for it), and the keys' gradient exchange that
    follows (_TokenPlan.reduce) carries the local values and fills the placeholder with their row-weighted mean, as
    msa_attention fills its kl in the backward. Backward: as _KlMean's."""

    @staticmethod
    def forward(ctx, plan, kl):
        ctx.share = plan.share
        res = torch.full((), float("nan"), dtype=kl.dtype, device=kl.device)
        plan.late_kl = (kl, res)
        return res

    @staticmethod
    def backward(ctx, g):
        return None, g * ctx.share


class _KlMean(torch.autograd.Function):
    """Forward: the ranks' local kl values (each a mean over Hp x its rows) -> the mean over all
    rows (fp64, rank order: identical bits on every rank). Backward: rank r's local kl gets
    g x rows_r / total, so that every proxy gradient equals the single-process one."""

    @staticmethod
    def forward(ctx, plan, kl):
        ctx.share = plan.share
        recv = _exchange([[kl] for _ in range(plan.P)], lambda s, d: [((), kl.dtype)], plan)
        return plan.kl_mean(recv, 0).to(kl.dtype)

    @staticmethod
    def backward(ctx, g):
        return None, g * ctx.share


def _token_parallel(q, k, v, qp, kp, topk, cu_seqlens, max_seqlen, indices, return_lse, return_indices,
                    tsizes, layout, group, rank, P, kw):
    """The tokens scheme (docs/distributed.md): k, v, kp gathered to every rank, each rank's own
    queries run as query segments against them; dk, dv, dkp summed back to their owners."""
    batched = q.dim() == 4
    if batched:
        B, S_loc = q.shape[0], q.shape[1]
        S = sum(tsizes)
        cu = [b * S for b in range(B + 1)]
        chunks = _chunks(cu, tsizes, layout, batched_S=S)
        flat = lambda t: None if t is None else t.reshape((-1,) + tuple(t.shape[2:]))  # noqa: E731
        q, k, v, qp, kp = (flat(t) for t in (q, k, v, qp, kp))
        cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
        max_seqlen = S
    else:
        cu = [int(x) for x in cu_seqlens.tolist()]  # (a host read of cu_seqlens: B + 1 values)
        chunks = _chunks(cu, tsizes, layout)
        cu_t = cu_seqlens
    plan = _TokenPlan(group, rank, P, chunks, cu, q.device)
    out, kl, lse, idx = _token_core(plan, q, k, v, qp, kp, topk, cu_t, max_seqlen, indices, return_lse,
                                    return_indices, kw)
    if batched:
        out = out.view(B, S_loc, *out.shape[1:])
    result = [out, kl]
    if return_lse:
        result.append(lse)
    if return_indices:
        result.append(idx)
    return tuple(result)


def _late_kl(kw, qp, tensors) -> bool:
    """Whether the default kl comes from the backward: training (grad mode, one of `tensors` requiring grad: the
    exchange whose backward carries the local values runs after the local backward), compute_kl None, a proxy, and
    eager mode."""
    return kw["compute_kl"] is None and qp is not None and torch.is_grad_enabled() and \
        any(t is not None and t.requires_grad for t in tensors) and not _ops._compiling()


def _token_core(plan, q, k, v, qp, kp, topk, cu_t, max_seqlen, indices, return_lse, return_indices, kw,
                late_kl=True):
    """The tokens scheme on a plan: k, v, kp gathered over plan's group, this rank's rows as query segments
    against them -> (out, kl: the mean over the group's rows, lse or None, indices or None). late_kl: the default
    kl in training may come from the backward (_KlFromBackward); False: from the forward."""
    keys = [k, v] + ([kp] if kp is not None else [])
    full = _GatherKeys.apply(plan, *keys)
    kf, vf = full[0], full[1]
    kpf = full[2] if kp is not None else None
    sparse = indices is None and not kw["warmup"]
    # the default kl in training comes from the backward (late) when the keys' exchange runs after the local
    # backward, i.e. when a key tensor requires grad; else from the forward
    late = late_kl and _late_kl(kw, qp, keys)
    res = _ops._attention(q, kf, vf, qp, kpf, topk, cu_seqlens=cu_t, max_seqlen=max_seqlen, indices=indices,
                          return_lse=bool(return_lse), return_indices=bool(return_indices) and sparse,
                          precise_dpsum=False, kl_from_backward=late, cu_seqlens_q=plan.cu_seqlens_q,
                          q_origin=plan.q_origin, max_seqlen_q=plan.max_seqlen_q, **kw)
    lse = res[2] if return_lse else None
    idx = (res[-1] if sparse else indices) if return_indices else None
    kl = _KlFromBackward.apply(plan, res[1]) if late else _KlMean.apply(plan, res[1])
    return res[0], kl, lse, idx


_SUBGROUPS: Dict[tuple, tuple] = {}


def _subgroups(group, P: int, Ph: int):
    """(heads group, tokens group) of this rank for the hybrid scheme: ranks t*Ph .. t*Ph + Ph - 1 of `group` form
    heads group t, ranks h, h + Ph, ... tokens group h. Created on first use and kept (torch.distributed.new_group is
    collective: the default group creates every subgroup on every rank in the same order; a caller's subgroup creates
    this rank's two with local synchronisation, their names hashed from their ranks)."""
    rank = dist.get_rank(group)
    t, h = divmod(rank, Ph)
    world = group is None or group is dist.group.WORLD
    key = (None if world else id(group), P, Ph)
    if key not in _SUBGROUPS:
        glob = list(range(P)) if world else [dist.get_global_rank(group, r) for r in range(P)]
        heads = [[glob[tt * Ph + i] for i in range(Ph)] for tt in range(P // Ph)]
        tokens = [[glob[tt * Ph + hh] for tt in range(P // Ph)] for hh in range(Ph)]
        if world:
            hg = [dist.new_group(r) for r in heads]
            tg = [dist.new_group(r) for r in tokens]
            _SUBGROUPS[key] = (hg[t], tg[h])
        else:
            _SUBGROUPS[key] = (dist.new_group(heads[t], use_local_synchronization=True),
                               dist.new_group(tokens[h], use_local_synchronization=True))
    return _SUBGROUPS[key]


def _heads_size(Hq, Hkv, Hp, Hpk, P: int, heads_size: Optional[int]) -> int:
    """The hybrid scheme's heads-group size: the given one (checked), else the largest divisor of P below P whose
    head split lines up (head_ranges), at least 1."""
    if heads_size is not None:
        if isinstance(heads_size, bool) or not isinstance(heads_size, numbers.Integral) or heads_size < 1 \
                or P % int(heads_size):
            raise ValueError(f"{_P}: heads_size: expected a divisor of the context-parallel size {P} (the ranks of "
                             f"one heads group), got {heads_size!r}")
        head_ranges(Hq, Hkv, Hp, Hpk, int(heads_size))  # (a ValueError naming the heads that do not split)
        return int(heads_size)
    for d in range(P - 1, 0, -1):
        if P % d == 0:
            try:
                head_ranges(Hq, Hkv, Hp, Hpk, d)
                return d
            except ValueError:
                continue
    return 1


def _head_fields(q, k, v, qp, kp, indices, td: int):
    """The heads exchange's inputs: (fields, tensors, how many are differentiable). td: the token dim (1 batched);
    indices (not differentiable) with their token dim explicit."""
    hd = td + 1
    fields, xs = [("q", td, hd), ("kv", td, hd), ("kv", td, hd)], [q, k, v]
    if qp is not None:
        fields += [("qp", td, hd), ("kp", td, hd)]
        xs += [qp, kp]
    n_diff = len(xs)
    if indices is not None:
        fields.append(("qp", td + 1, 0))
        xs.append(indices)
    return fields, xs, n_diff


def _out_fields(out, lse, idx, td: int):
    """The heads exchange's outputs back to token shards: out, lse (if not None; differentiable) and the indices
    (if not None) -> (fields, tensors, how many are differentiable)."""
    fields, ys = [("q", td, td + 1)], [out]
    if lse is not None:
        fields.append(("q", td + 1, 0))
        ys.append(lse)
    n_diff = len(ys)
    if idx is not None:
        fields.append(("qp", td + 1, 0))
        ys.append(idx)
    return fields, ys, n_diff


def _hybrid(q, k, v, qp, kp, topk, cu_seqlens, max_seqlen, indices, return_lse, return_indices, tsizes, layout,
            group, rank, P, Ph, kw):
    """The hybrid scheme (docs/distributed.md): P = Ph x Pt ranks. Within each heads group of Ph consecutive ranks
    one all-to-all (the heads scheme) gives every rank its MSA groups' heads for the group's rows; across the Pt
    heads groups those rows run as the tokens scheme (k, v, kp of the rank's heads gathered over its tokens group,
    its rows as query segments); the outputs go back the same way."""
    Pt = P // Ph
    t, h = divmod(rank, Ph)
    hgroup, tgroup = _subgroups(group, P, Ph)
    cu = [int(x) for x in cu_seqlens.tolist()]  # (a host read of cu_seqlens: B + 1 values)
    chunks = _chunks(cu, tsizes, layout)
    Hq, Hkv = q.shape[-2], k.shape[-2]
    Hp = qp.shape[-2] if qp is not None else indices.shape[0] if indices is not None else None
    Hpk = kp.shape[-2] if kp is not None else None
    members = [t * Ph + i for i in range(Ph)]
    plan_h = _Plan(hgroup, h, Ph, [tsizes[m] for m in members], head_ranges(Hq, Hkv, Hp, Hpk, Ph),
                   {"q": Hq, "kv": Hkv, "qp": Hp, "kp": Hpk}, q.device)
    fields, xs, n_diff = _head_fields(q, k, v, qp, kp, indices, 0)
    hs = _ToHeads.apply(plan_h, tuple(fields), n_diff, *xs)
    qh, kh, vh = hs[:3]
    qph, kph = (hs[3], hs[4]) if qp is not None else (None, None)
    idx_h = hs[-1] if indices is not None else None
    # the heads group's rows (its members' chunks, in member order) against the whole keys, over the tokens group
    plan_t = _TokenPlan(tgroup, t, Pt, [[c for m in range(tt * Ph, (tt + 1) * Ph) for c in chunks[m]]
                                        for tt in range(Pt)], cu, q.device)
    sparse = indices is None and not kw["warmup"]
    want_idx = bool(return_indices) and sparse
    late = _late_kl(kw, qp, xs[:n_diff])  # (the tokens group's mean fills kl_h first, then the heads group's)
    out_h, kl_h, lse_h, idx_o = _token_core(plan_t, qh, kh, vh, qph, kph, topk, cu_seqlens, max_seqlen, idx_h,
                                            return_lse, want_idx, kw, late_kl=late)
    ofields, ys, n_odiff = _out_fields(out_h, lse_h, idx_o if want_idx else None, 0)
    outs = _ToTokens.apply(plan_h, tuple(ofields), n_odiff, kl_h, *ys)
    if late:
        plan_h.late_kl = (kl_h, outs[0])
    result = [outs[1], outs[0]]
    if return_lse:
        result.append(outs[2])
    if return_indices:
        result.append(outs[-1] if want_idx else indices)
    return tuple(result)


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


_SCHEMES = (None, "heads", "tokens", "hybrid")
_LAYOUTS = ("contiguous", "zigzag")


def _prepare(q, k, v, qp, kp, cu_seqlens, indices, max_seqlen, warmup, shard_sizes, options, validate,
             group, rank, P, scheme=None, layout="contiguous", heads_size=None):
    """The local argument checks (no traffic): the plan (heads scheme; hybrid: its heads-group size; None for the
    tokens scheme), B, this rank's token count, Hp, the scheme, the shard sizes. options: the keyword arguments of
    msa_attention that need no tensor (checked first)."""
    if scheme not in _SCHEMES:
        raise ValueError(f"{_P}: scheme: expected None, 'heads', 'tokens' or 'hybrid', got {scheme!r}")
    if heads_size is not None and scheme != "hybrid":
        raise ValueError(f"{_P}: heads_size: only for scheme='hybrid' (got scheme {scheme!r})")
    if layout not in _LAYOUTS:
        raise ValueError(f"{_P}: layout: expected 'contiguous' or 'zigzag', got {layout!r}")
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
    if scheme is None:  # heads where P lines up with the head counts, else tokens
        try:
            head_ranges(Hq, Hkv, Hp, Hpk, P)
            scheme = "heads"
        except ValueError:
            scheme = "tokens"
    if layout == "zigzag" and batched:
        raise ValueError(f"{_P}: layout: 'zigzag' needs varlen inputs ([T, H, D] with cu_seqlens), got batched "
                         f"inputs")
    if scheme == "hybrid" and batched:
        raise ValueError(f"{_P}: scheme: 'hybrid' takes varlen inputs ([T, H, D] with cu_seqlens); batched inputs "
                         f"run the heads or the tokens scheme")
    if layout == "zigzag" and cu_seqlens.numel():
        cu = [int(x) for x in cu_seqlens.tolist()]
        want = [sum(n for _, _, n in c) for c in _chunks(cu, tsizes, "zigzag")]
        if want != tsizes:
            raise ValueError(f"{_P}: shard_sizes: with layout='zigzag' rank r holds chunks r and 2P-1-r of "
                             f"every sequence, {want} tokens per rank for these cu_seqlens, but the shards "
                             f"hold {tsizes}")
    if scheme == "hybrid":
        Ph = _heads_size(Hq, Hkv, Hp, Hpk, P, heads_size)  # (checked whatever runs: the same errors in every mode)
    scheme = _run_scheme(scheme, warmup, q.device.type, Hq, Hkv, Hp, Hpk, P)
    if scheme == "tokens":
        return None, B, T_loc, Hp, scheme, tsizes
    if scheme == "hybrid":
        return Ph, B, T_loc, Hp, scheme, tsizes
    ranges = head_ranges(Hq, Hkv, Hp, Hpk, P)
    full = {"q": Hq, "kv": Hkv, "qp": Hp, "kp": Hpk}
    plan = _Plan(group, rank, P, tsizes, ranges, full, q.device)
    return plan, B, T_loc, Hp, scheme, tsizes


def _run_scheme(scheme: str, warmup: bool, device_type: str, Hq: int, Hkv: int, Hp, Hpk, P: int) -> str:
    """The scheme a call runs: the asked one, except a warmup (dense) call on CUDA with the tokens or hybrid scheme,
    whose query segments the CUDA backend takes in the sparse modes only so far: it runs the heads scheme where P
    lines up with the head counts (the same results: each rank the whole sequence for its MSA groups) and is
    refused, with the reason, where it does not."""
    if not (warmup and device_type == "cuda" and scheme in ("tokens", "hybrid")):
        return scheme
    try:
        head_ranges(Hq, Hkv, Hp, Hpk, P)
    except ValueError as e:
        raise ValueError(f"{_P}: warmup=True on CUDA runs the heads scheme (the CUDA backend takes the tokens "
                         f"scheme's query segments in the sparse modes only so far), and the heads do not split "
                         f"over P = {P}: {e}. Run the warmup steps on a context-parallel group that divides the "
                         f"head counts, or start sparse") from None
    return "heads"


def msa_attention_cp(q: Tensor, k: Tensor, v: Tensor, qp: Optional[Tensor] = None,
                     kp: Optional[Tensor] = None, topk: int = 16, *,
                     cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None,
                     group=None, shard_sizes: Optional[Sequence[int]] = None,
                     warmup: bool = False, indices: Optional[Tensor] = None,
                     softmax_scale: Optional[float] = None, proxy_scale: Optional[float] = None,
                     compute_kl: Optional[bool] = None, return_lse: bool = False,
                     return_indices: bool = False, numerics: Optional[str] = None,
                     validate: bool = False, scheme: Optional[str] = None,
                     layout: str = "contiguous", heads_size: Optional[int] = None, fp8_selection: bool = False):
    """flashmsa.msa_attention with every per-token tensor sharded by tokens over the ranks of
    `group` (default: the world). Arguments and results as in msa_attention, except:

    - scheme: "heads" (an all-to-all to whole MSA groups per rank: P must line up with the head
      counts), "tokens" (k, v, kp gathered to every rank, each rank's queries against them as query segments:
      any P), None: heads where P lines up, else tokens; or "hybrid" (P = heads_size x P_t: the heads scheme
      within each group of heads_size consecutive ranks, the tokens scheme across the groups; varlen inputs).
      A warmup (dense) call on CUDA runs the heads scheme whatever the scheme (the CUDA backend takes query
      segments in the sparse modes only so far) and is refused where P does not line up with the heads.
    - heads_size: the hybrid scheme's heads-group size (a divisor of P whose head split lines up); None: the
      largest such divisor below P.
    - layout: "contiguous" (rank r holds the next T_r tokens of the packed total) or "zigzag"
      (varlen: every sequence split into 2P chunks, rank r holding chunks r and 2P-1-r of each, in sequence
      order: the causal work is the same on every rank; Megatron-Core's context-parallel layout).

    - no precise_dpsum (each rank's local msa_attention runs with the default).
    - fp8_selection as in msa_attention: every scheme quantises kp over the whole key blocks (the tokens
      schemes gather kp first), so the selection is the single-process one.
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
              compute_kl=compute_kl, numerics=numerics, validate=validate, fp8_selection=fp8_selection)
    if P == 1:
        return _ops.msa_attention(q, k, v, qp, kp, topk, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                  indices=indices, return_lse=return_lse,
                                  return_indices=return_indices, **kw)
    # the agreement check: always on gloo (cheap, CPU), opt-in (validate=True) elsewhere
    agree = validate is True or dist.get_backend(group) == "gloo"
    options = dict(topk=topk, return_lse=return_lse, return_indices=return_indices, **kw)
    tsizes = None
    try:
        plan, B, T_loc, Hp, scheme, tsizes = _prepare(q, k, v, qp, kp, cu_seqlens, indices, max_seqlen, warmup,
                                                      shard_sizes, options, validate is True, group, rank, P,
                                                      scheme, layout, heads_size)
        error = None
    except (TypeError, ValueError) as e:
        if not agree:
            raise
        error = e
    if agree:  # before any other traffic: bad arguments on one rank raise on every rank
        dev = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
        sig = _signature(q, k, v, qp, kp, indices, cu_seqlens, max_seqlen, topk, warmup, return_lse,
                         return_indices, shard_sizes, tsizes, P)
        sig.update(fp8_selection=int(fp8_selection) if isinstance(fp8_selection, bool) else -1,
                   scheme=_SCHEMES.index(scheme) if scheme in _SCHEMES else -2,
                   layout=_LAYOUTS.index(layout) if layout in _LAYOUTS else -2,
                   heads_size=int(heads_size) if isinstance(heads_size, numbers.Integral) else -1)
        _check_agreement(sig, error, group, dev, P)
    if scheme == "tokens":
        return _token_parallel(q, k, v, qp, kp, topk, cu_seqlens, max_seqlen, indices, return_lse,
                               return_indices, tsizes, layout, group, rank, P, kw)
    if scheme == "hybrid":
        return _hybrid(q, k, v, qp, kp, topk, cu_seqlens, max_seqlen, indices, return_lse, return_indices, tsizes,
                       layout, group, rank, P, plan, kw)
    batched = q.dim() == 4
    td = 1 if batched else 0
    Hq = q.shape[-2]

    # ---- tokens -> heads (one all-to-all for every input)
    idx_in = None
    if indices is not None:  # [Hp, T_r, topk] -> token dim explicit for batched
        idx_in = indices.reshape(Hp, B, T_loc, indices.shape[2]) if batched else indices
    fields, xs, n_diff = _head_fields(q, k, v, qp, kp, idx_in, td)
    hs = _ToHeads.apply(plan, tuple(fields), n_diff, *xs)
    perm = inv = None
    if layout == "zigzag":  # the ranks' rows (their chunks, rank after rank) -> sequence order, and back after
        cu = [int(x) for x in cu_seqlens.tolist()]
        perm = _chunk_rows(cu, _chunks(cu, tsizes, "zigzag"), q.device)
        inv = torch.argsort(perm)
        hs = [x.index_select(1 if i == len(hs) - 1 and indices is not None else 0, inv) for i, x in enumerate(hs)]
    qh, kh, vh = hs[:3]
    qph, kph = (hs[3], hs[4]) if qp is not None else (None, None)
    idx_h = None
    if indices is not None:
        idx_h = hs[-1].reshape(hs[-1].shape[0], -1, hs[-1].shape[-1]) if batched else hs[-1]

    # ---- local MSA on the full sequence
    sparse = indices is None and not warmup
    want_idx = bool(return_indices) and sparse
    # the default kl in training comes from the local backward (late): the gradients' all-to-all back to the token
    # shards (_ToHeads' backward, after the local backward) carries the local values and fills the returned kl; else
    # from the forward, the cross-rank mean formed with the outputs' all-to-all
    late = _late_kl(kw, qp, xs[:n_diff])
    res = _ops._attention(qh, kh, vh, qph, kph, topk, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                          indices=idx_h, return_lse=bool(return_lse), return_indices=want_idx,
                          precise_dpsum=False, kl_from_backward=late, **kw)
    out_h, kl_h = res[0], res[1]
    S_full = sum(tsizes)

    # ---- heads -> tokens (one all-to-all for every output)
    lse_h = idx_o = None
    if return_lse:
        lse_h = res[2].view(res[2].shape[0], B, S_full) if batched else res[2]
    if want_idx:
        idx_o = res[-1].view(res[-1].shape[0], B, S_full, res[-1].shape[-1]) if batched else res[-1]
    if perm is not None:
        out_h = out_h.index_select(0, perm)
        lse_h = lse_h.index_select(1, perm) if lse_h is not None else None
        idx_o = idx_o.index_select(1, perm) if idx_o is not None else None
    ofields, ys, n_odiff = _out_fields(out_h, lse_h, idx_o, td)
    outs = _ToTokens.apply(plan, tuple(ofields), n_odiff, kl_h, *ys)
    kl, out = outs[0], outs[1]
    if late:  # NaN until the backward fills it (as msa_attention's kl)
        plan.late_kl = (kl_h, kl)
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
