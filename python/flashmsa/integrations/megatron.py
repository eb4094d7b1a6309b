"""MSA as the self-attention of a Megatron-Core GPT model (docs/megatron.md).

    from flashmsa.integrations import megatron as fm
    config = fm.MSAConfig(num_layers=..., hidden_size=..., num_attention_heads=64, num_query_groups=4,
                          msa_topk=16, msa_proxy_heads=4, msa_kl_coeff=1.0, ...)
    model = GPTModel(config=config, transformer_layer_spec=fm.get_msa_gpt_layer_spec(), vocab_size=...,
                     max_sequence_length=..., position_embedding_type="rope")
    fm.set_warmup(model, True)            # the first steps: dense attention, the proxy trained on all keys
    ...                                   # each step, before the backward (as Megatron does for MoE):
    fm.set_kl_loss_scale(config, num_microbatches)
    ...                                   # after it: fm.kl_metrics() -> {"msa_kl_loss": per-layer values}

Layers: `MSASelfAttention` (Megatron's SelfAttention plus the proxy projections qp = x Wqp [Hp heads], kp = x Wkp
[Hpk heads], optionally rotated like q and k) feeding `MSACoreAttention`, which calls flashmsa.msa_attention on this
rank's heads (packed THD sequences through PackedSeqParams' cu_seqlens, or sbhd batches as equal-length sequences)
or, with context parallelism, flashmsa.distributed.msa_attention_cp on Megatron's CP group in Megatron's zigzag token
layout. The kl term is an auxiliary loss attached to the attention output (MSAKLLossAutoScaler, the way Megatron
attaches MoE's): its gradient flows with the main loss's backward, scaled by set_kl_loss_scale, and its value is
logged per layer into Megatron's auxiliary-loss tracker ("msa_kl_loss") after the backward has formed it.
Needs megatron-core (pip install 'flashmsa[megatron]': megatron-core==0.16.1). No Transformer Engine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import torch
import torch.distributed as dist

try:
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("flashmsa.integrations.megatron needs megatron-core: pip install 'flashmsa[megatron]' "
                      f"(megatron-core==0.16.1) ({e})") from e

from .. import distributed as _cp
from .. import ops as _ops

__all__ = ["MSAConfig", "MSASelfAttention", "MSASelfAttentionSubmodules", "MSACoreAttention",
           "MSAKLLossAutoScaler", "get_msa_gpt_layer_spec", "set_warmup", "set_kl_loss_scale", "kl_metrics",
           "cpu_support"]

_TRACKER_NAME = "msa_kl_loss"


@dataclass
class MSAConfig(TransformerConfig):
    """Megatron's TransformerConfig plus MSA's hyper-parameters (checked at construction)."""

    msa_topk: int = 16
    """Key blocks (128 tokens) per query and proxy head."""
    msa_proxy_heads: Optional[int] = None
    """Hp: proxy (indexer) query heads, one per MSA group of num_attention_heads / Hp query heads. None:
    num_query_groups (one MSA group per kv head, as m3)."""
    msa_proxy_key_heads: int = 1
    """Hpk: proxy key heads (Hp must be a multiple)."""
    msa_proxy_head_dim: Optional[int] = None
    """Dp: the proxy heads' dim. None: kv_channels."""
    msa_kl_coeff: float = 1.0
    """Weight of the kl auxiliary loss (the proxy learns only from it; 0: no proxy gradient, no logging)."""
    msa_detach_proxy_input: bool = True
    """Feed the proxy projections the layer's input detached (the MSA paper's stop-gradient, flashmsa.nn's default):
    the kl trains linear_qp and linear_kp alone and sends nothing into the rest of the model, so the dense warmup
    trains the model exactly as dense attention does. False: the kl's gradient also reaches the layer's input."""
    msa_rope_on_proxy: bool = True
    """Rotate qp and kp with the model's rotary embedding (needs Dp = the rotary dim)."""
    msa_warmup: bool = False
    """Dense attention over every causal key (the proxy trained on the whole causal set): a run's first steps.
    set_warmup(model, flag) switches the built model."""
    msa_cp_scheme: str = "tokens"
    """flashmsa.distributed's scheme under context parallelism: 'tokens' or 'hybrid' (both take Megatron's zigzag
    layout)."""
    msa_index_share: int = 1
    """IndexShare: layers in groups of this many, the first of each group selecting (its own proxy, its kl) and the
    others attending to its blocks (no proxy projections, no selection, no kl). 1: every layer selects. Needs packed
    (THD) micro-batches: the selection travels with their PackedSeqParams."""

    def __post_init__(self):
        super().__post_init__()
        tp = self.tensor_model_parallel_size
        Hq = self.num_attention_heads
        Hkv = self.num_query_groups if self.num_query_groups is not None else Hq
        Hp = self.msa_proxy_heads if self.msa_proxy_heads is not None else Hkv
        Hpk = self.msa_proxy_key_heads
        where = "flashmsa.integrations.megatron.MSAConfig"

        def bad(msg):
            raise ValueError(f"{where}: {msg}")

        if not isinstance(self.msa_topk, int) or not 1 <= self.msa_topk <= _ops.L.MAX_TOPK:
            bad(f"msa_topk: expected 1..{_ops.L.MAX_TOPK}, got {self.msa_topk!r}")
        if Hp < 1 or Hq % Hp:
            bad(f"msa_proxy_heads (Hp) = {Hp} must divide num_attention_heads = {Hq} (one proxy head per MSA group)")
        if Hpk < 1 or Hp % Hpk:
            bad(f"msa_proxy_key_heads (Hpk) = {Hpk} must divide msa_proxy_heads (Hp) = {Hp}")
        if Hkv % tp:
            bad(f"num_query_groups = {Hkv} must be a multiple of tensor_model_parallel_size = {tp} (each TP rank "
                f"holds whole kv heads)")
        if Hp % tp:
            bad(f"msa_proxy_heads (Hp) = {Hp} must be a multiple of tensor_model_parallel_size = {tp} (each TP rank "
                f"holds whole MSA groups)")
        if Hpk % tp and self.sequence_parallel:
            bad(f"msa_proxy_key_heads (Hpk) = {Hpk} is not a multiple of tensor_model_parallel_size = {tp}: its "
                f"projection is replicated over the TP ranks, which sequence_parallel does not support")
        if self.msa_cp_scheme not in ("tokens", "heads", "hybrid"):
            bad(f"msa_cp_scheme: expected 'tokens', 'heads' or 'hybrid', got {self.msa_cp_scheme!r}")
        cp = self.context_parallel_size
        local = (Hq // tp, Hkv // tp, Hp // tp, Hpk // tp if Hpk % tp == 0 else Hpk)  # a TP rank's heads
        if self.msa_cp_scheme == "heads" and cp > 1:
            try:
                _cp.head_ranges(*local, cp)
            except ValueError as e:
                bad(f"msa_cp_scheme 'heads': the heads of a TP rank do not split over context_parallel_size = {cp} "
                    f"({e}); use 'tokens' or 'hybrid'")
        if self.msa_warmup and cp > 1 and torch.cuda.is_available():
            try:  # the dense warmup on CUDA runs the heads scheme (flashmsa.distributed)
                _cp.head_ranges(*local, cp)
            except ValueError as e:
                bad(f"msa_warmup: the dense warmup on CUDA runs the heads scheme, and the heads of a TP rank do not "
                    f"split over context_parallel_size = {cp} ({e}); warm up on a CP size that divides them, or "
                    f"start sparse (msa_warmup=False)")
        if not self.msa_kl_coeff >= 0 or math.isinf(self.msa_kl_coeff):
            bad(f"msa_kl_coeff: expected a finite value >= 0, got {self.msa_kl_coeff!r}")
        if not isinstance(self.msa_detach_proxy_input, bool):
            bad(f"msa_detach_proxy_input: expected a bool, got {self.msa_detach_proxy_input!r}")
        if not isinstance(self.msa_index_share, int) or self.msa_index_share < 1:
            bad(f"msa_index_share: expected an int >= 1 (layers per shared selection), got {self.msa_index_share!r}")
        if self.msa_proxy_head_dim is not None and self.msa_proxy_head_dim < 1:
            bad(f"msa_proxy_head_dim: expected >= 1, got {self.msa_proxy_head_dim!r}")


def _offsets(psp, side: str = "q"):
    """A packed batch's sequence offsets (global, before the CP split): cu_seqlens_<side>_padded where given (the
    tokens' places in the buffer), else cu_seqlens_<side>; None without either."""
    cu = getattr(psp, f"cu_seqlens_{side}_padded")
    return getattr(psp, f"cu_seqlens_{side}") if cu is None else cu


def _one_dtype(*xs, default=None):
    """xs (None kept) in torch.autocast's dtype where autocast is on for their device, else in `default` (None:
    as they are): under autocast Megatron's projections and rotary embedding can hand over q, k, v and qp, kp in
    different dtypes (fp32 weights, bf16 compute), and flashmsa takes one."""
    dev = xs[0].device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else default
    return tuple(x if x is None or dt is None else x.to(dt) for x in xs)


def _size(group) -> int:
    """A process group's size (1 without one, or before torch.distributed is initialised)."""
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


# ---- the kl auxiliary loss ----------------------------------------------------------------------
class MSAKLLossAutoScaler(torch.autograd.Function):
    """Attaches the kl to the attention output: the forward returns the output unchanged, the backward gives the
    kl the gradient main_loss_backward_scale (set_kl_loss_scale), so the main loss's backward trains the proxy."""

    main_loss_backward_scale: Optional[torch.Tensor] = None

    @staticmethod
    def forward(ctx, output, kl):
        ctx.kl_meta = (kl.shape, kl.dtype, kl.device)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        shape, dtype, device = ctx.kl_meta
        scale = MSAKLLossAutoScaler.main_loss_backward_scale
        g = torch.ones(shape, dtype=dtype, device=device)
        if scale is not None:
            g = g * scale.to(device=device, dtype=dtype)
        return grad_output, g

    @staticmethod
    def set_loss_scale(scale: torch.Tensor):
        MSAKLLossAutoScaler.main_loss_backward_scale = torch.as_tensor(scale).detach().reshape(()).clone()


def set_kl_loss_scale(config, num_microbatches: int) -> None:
    """The kl's gradient scale for this step, as Megatron's schedule sets MoE's auxiliary loss: the grad scaler's
    scale (fp16 loss scaling: config.grad_scale_func), times the context-parallel size (Megatron averages the
    gradients over data and context ranks; each CP rank holds a shard of the kl's gradient), over the micro-batches
    (per-token loss: the scale alone). Call it before the backward of each step."""
    one = torch.ones(())
    scale = config.grad_scale_func(one) if getattr(config, "grad_scale_func", None) is not None else one
    scale = torch.as_tensor(scale, dtype=torch.float32).reshape(())
    if not getattr(config, "calculate_per_token_loss", False):
        scale = scale * config.context_parallel_size / num_microbatches
    MSAKLLossAutoScaler.set_loss_scale(scale)


def kl_metrics(reduce: bool = True) -> Dict[str, torch.Tensor]:
    """{"msa_kl_loss": per-layer kl x msa_kl_coeff summed over this step's micro-batches} from Megatron's
    auxiliary-loss tracker (reduce: averaged over the TP ranks, whose proxy heads differ, and the data-parallel
    ranks, as Megatron's track_moe_metrics does), then cleared. Megatron-LM users may pass
    track_names=["msa_kl_loss"] to track_moe_metrics instead."""
    from megatron.core.transformer.moe import moe_utils as mu
    tracker = mu.get_moe_layer_wise_logging_tracker()
    if _TRACKER_NAME not in tracker:
        return {}
    if reduce:
        mu.reduce_aux_losses_tracker_across_ranks([_TRACKER_NAME])
    values = tracker[_TRACKER_NAME]["values"].clone()
    mu.clear_aux_losses_tracker()
    return {_TRACKER_NAME: values}


# ---- the proxy projections ----------------------------------------------------------------------
class _ReplicatedLinearFn(torch.autograd.Function):
    """y = x W^T with W the same on every TP rank, each rank consuming y differently: the input's and the weight's
    gradients are summed over the TP group (the input is replicated there, as in ColumnParallelLinear)."""

    @staticmethod
    def forward(ctx, x, w, group):
        ctx.save_for_backward(x, w)
        ctx.group = group
        return torch.matmul(x, w.t())

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx = torch.matmul(g, w)
        dw = torch.matmul(g.reshape(-1, g.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
        if _size(ctx.group) > 1:
            dist.all_reduce(dx, group=ctx.group)
            dist.all_reduce(dw, group=ctx.group)
        return dx, dw, None


class _ReplicatedLinear(torch.nn.Module):
    """The proxy key projection when its heads do not split over the TP ranks (Hpk = 1 with TP > 1): one weight,
    the same on every TP rank (broadcast from TP rank 0 at construction), gradients summed over the TP group."""

    def __init__(self, in_features, out_features, config, init_method, tp_group):
        super().__init__()
        dtype = config.params_dtype
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        init_method(self.weight)
        self.tp_group = tp_group
        if _size(tp_group) > 1:
            dist.broadcast(self.weight.data, src=dist.get_global_rank(tp_group, 0), group=tp_group)

    def forward(self, x):
        return _ReplicatedLinearFn.apply(x, self.weight, self.tp_group), None


# ---- attention ----------------------------------------------------------------------------------
class MSACoreAttention(MegatronModule):
    """Megatron's core_attention slot: q [sq, b, np, hn] and k, v [sk, b, ng, hn] (sbhd), or [t, h, d] (packed THD),
    already rotated and restricted to this TP rank's heads, plus qp, kp from MSASelfAttention -> [sq, b, np*hn]
    ([t, np*hn]). flashmsa.msa_attention on one CP rank; flashmsa.distributed.msa_attention_cp over the CP group
    (Megatron's zigzag layout: chunks r and 2cp-1-r of every sequence, global cu_seqlens)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(f"flashmsa.integrations.megatron: MSA is self-attention (got attention_type "
                             f"{attention_type!r})")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"flashmsa.integrations.megatron: MSA is causal (got attn_mask_type {attn_mask_type})")
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("flashmsa.integrations.megatron: attention_dropout must be 0 (MSA has no dropout)")
        self.layer_number = layer_number
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.softmax_scale = softmax_scale
        self.warmup = bool(config.msa_warmup)
        n = config.msa_index_share
        self.share_group = (layer_number - 1) // n  # IndexShare: the group of layers sharing one selection
        self.selects = (layer_number - 1) % n == 0  # its first layer selects; the others reuse its blocks

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params: Optional[PackedSeqParams] = None, qp=None, kp=None):
        if attention_bias is not None:
            raise ValueError("flashmsa.integrations.megatron: MSA takes no attention_bias")
        if self.selects and (qp is None or kp is None):
            raise ValueError("flashmsa.integrations.megatron: MSACoreAttention needs qp and kp (build the layer "
                             "with get_msa_gpt_layer_spec: MSASelfAttention computes them)")
        cfg = self.config
        # one dtype for the five inputs (MSASelfAttention aligns them under autocast before any recompute; a caller
        # of this module alone gets the autocast dtype, else q's)
        query, key, value, qp, kp = _one_dtype(query, key, value, qp, kp, default=query.dtype)
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        cp_group = self.pg_collection.cp
        cp = _size(cp_group)
        if thd:
            cu = _offsets(packed_seq_params)
            if cu is None:
                raise ValueError("flashmsa.integrations.megatron: packed (THD) inputs need "
                                 "PackedSeqParams.cu_seqlens_q (or cu_seqlens_q_padded): the sequences' global "
                                 "offsets")
            cu = cu.to(torch.int32)
            max_seqlen = packed_seq_params.max_seqlen_q
            q, k, v, p, pk = query, key, value, qp, kp
        else:
            s, b = query.shape[:2]

            def to_thd(x):
                return x.transpose(0, 1).reshape(b * s, *x.shape[2:])
            q, k, v, p, pk = (None if x is None else to_thd(x) for x in (query, key, value, qp, kp))
            cu = torch.arange(0, b + 1, dtype=torch.int32, device=q.device) * (s * cp)
            max_seqlen = s * cp
        sharing = cfg.msa_index_share > 1 and not self.warmup
        if sharing and not thd:
            raise ValueError("flashmsa.integrations.megatron: msa_index_share > 1 needs packed (THD) micro-batches "
                             "(PackedSeqParams): the shared selection travels with them")
        indices = None
        if sharing and not self.selects:  # a follower: the blocks its group's first layer selected
            stash = getattr(packed_seq_params, "_flashmsa_indices", {})
            if self.share_group not in stash:
                raise RuntimeError(f"flashmsa.integrations.megatron: layer {self.layer_number} reuses the selection "
                                   f"of layer {self.share_group * cfg.msa_index_share + 1}, which did not run on this "
                                   f"micro-batch here (an IndexShare group split over pipeline stages?)")
            indices = stash[self.share_group]
            p = pk = None
        grad = self.training and torch.is_grad_enabled()
        coeff = float(cfg.msa_kl_coeff)
        log = grad and coeff > 0 and p is not None
        tp_group = self.pg_collection.tp
        tp = _size(tp_group)
        if log:  # the kl is added to the tracker after the backward has formed it (_KlTap, upstream of the keys)
            kl_holder = {}
            k = _KlTap.apply(k, kl_holder, self.layer_number, cfg.num_layers, tp_group)
        keep = sharing and self.selects  # the group's first layer hands its selection on
        kw = dict(cu_seqlens=cu, max_seqlen=max_seqlen, warmup=self.warmup, softmax_scale=self.softmax_scale,
                  compute_kl=None if grad and p is not None else False, indices=indices, return_indices=keep)
        if cp > 1:
            res = _cp.msa_attention_cp(q, k, v, p, pk, cfg.msa_topk, group=cp_group, layout="zigzag",
                                       scheme=cfg.msa_cp_scheme, **kw)
        else:
            res = _ops.msa_attention(q, k, v, p, pk, cfg.msa_topk, **kw)
        out, kl = res[0], res[1]
        if keep:
            if not hasattr(packed_seq_params, "_flashmsa_indices"):
                packed_seq_params._flashmsa_indices = {}
            packed_seq_params._flashmsa_indices[self.share_group] = res[2].detach()
        if log:
            kl_holder["kl"] = (kl, coeff)  # (the tensor itself: the backward fills it in place)
            # the proxy heads of this TP rank: the model's kl is the mean over the TP ranks
            out = MSAKLLossAutoScaler.apply(out, kl * (coeff / tp))
        if thd:
            return out.reshape(out.shape[0], -1)
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()


class _KlTap(torch.autograd.Function):
    """Identity on k (upstream of the attention and, under CP, of the keys' gather): its backward runs after the
    attention's and adds the kl, formed by then, into Megatron's auxiliary-loss tracker (averaged over TP when
    reduced)."""

    @staticmethod
    def forward(ctx, k, holder, layer_number, num_layers, tp_group):
        ctx.info = (holder, layer_number, num_layers, tp_group)
        return k.view_as(k)

    @staticmethod
    def backward(ctx, g):
        holder, layer_number, num_layers, tp_group = ctx.info
        if "kl" in holder:
            kl, coeff = holder["kl"]
            save_to_aux_losses_tracker(_TRACKER_NAME, kl.detach().float() * coeff, layer_number, num_layers,
                                       avg_group=tp_group)
        return g, None, None, None, None


@dataclass
class MSASelfAttentionSubmodules(SelfAttentionSubmodules):
    """SelfAttention's submodules plus the proxy query projection (Hp x Dp outputs, split over TP with the MSA
    groups); the proxy key projection is column-parallel where Hpk splits over TP, else replicated."""

    linear_qp: Union[ModuleSpec, type] = None


class MSASelfAttention(SelfAttention):
    """Megatron's SelfAttention (linear_qkv, rotary, linear_proj) with MSA's proxy projections qp, kp passed to the
    core attention. Training and full-sequence evaluation (no KV-cache inference)."""

    def __init__(self, config, submodules, layer_number, attn_mask_type=AttnMaskType.causal, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        tp_group = self.pg_collection.tp
        tp = _size(tp_group)
        Hkv = config.num_query_groups if config.num_query_groups is not None else config.num_attention_heads
        self.Hp = config.msa_proxy_heads if config.msa_proxy_heads is not None else Hkv
        self.Hpk = config.msa_proxy_key_heads
        self.Dp = config.msa_proxy_head_dim if config.msa_proxy_head_dim is not None else config.kv_channels
        self.Hp_local = self.Hp // tp
        n = config.msa_index_share
        self.has_proxy = (layer_number - 1) % n == 0  # IndexShare followers reuse the group's selection
        lin = dict(config=config, init_method=config.init_method, gather_output=False, bias=False,
                   skip_bias_add=False, is_expert=False, tp_group=tp_group)
        if not self.has_proxy:
            self.linear_qp = self.linear_kp = None
            return
        self.linear_qp = build_module(submodules.linear_qp or tensor_parallel.ColumnParallelLinear,
                                      config.hidden_size, self.Hp * self.Dp, tp_comm_buffer_name="msa_qp", **lin)
        if self.Hpk % tp == 0:
            self.Hpk_local = self.Hpk // tp
            self.linear_kp = tensor_parallel.ColumnParallelLinear(config.hidden_size, self.Hpk * self.Dp,
                                                                  tp_comm_buffer_name="msa_kp", **lin)
        else:  # every TP rank needs all proxy key heads
            self.Hpk_local = self.Hpk
            self.linear_kp = _ReplicatedLinear(config.hidden_size, self.Hpk * self.Dp, config, config.init_method,
                                               tp_group)

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("flashmsa.integrations.megatron: no KV-cache inference path (MSA trains and "
                                      "evaluates full sequences)")
        if self.config.no_rope_freq and self.config.no_rope_freq[self.layer_number - 1]:
            rotary_pos_emb = None
        if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb,) * 2
        query, key, value = self.get_query_key_value_tensors(hidden_states, key_value_states)
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if not self.has_proxy:  # (an IndexShare follower)
            return self._attend(query, key, value, None, None, attention_mask, rotary_pos_emb, attention_bias,
                                packed_seq_params, thd)
        proxy_in = hidden_states.detach() if self.config.msa_detach_proxy_input else hidden_states
        qp, _ = self.linear_qp(proxy_in)
        kp, _ = self.linear_kp(proxy_in)
        qp = qp.view(*qp.shape[:2], self.Hp_local, self.Dp)
        kp = kp.view(*kp.shape[:2], self.Hpk_local, self.Dp)
        return self._attend(query, key, value, qp, kp, attention_mask, rotary_pos_emb, attention_bias,
                            packed_seq_params, thd)

    def _attend(self, query, key, value, qp, kp, attention_mask, rotary_pos_emb, attention_bias, packed_seq_params,
                thd):
        proxy = qp is not None
        cu_q = cu_kv = None
        if thd:
            query, key, value = (t.squeeze(1) for t in (query, key, value))
            if proxy:
                qp, kp = qp.squeeze(1), kp.squeeze(1)
            cu_q, cu_kv = _offsets(packed_seq_params, "q"), _offsets(packed_seq_params, "kv")
        if rotary_pos_emb is not None:
            q_emb, k_emb = rotary_pos_emb

            def rope(t, f, cu):
                return apply_rotary_pos_emb(t, f, config=self.config, cu_seqlens=cu, cp_group=self.pg_collection.cp)
            query, key = rope(query, q_emb, cu_q), rope(key, k_emb, cu_kv)
            if proxy and self.config.msa_rope_on_proxy:
                qp, kp = rope(qp, q_emb, cu_q), rope(kp, k_emb, cu_kv)
        if proxy:
            qp, kp = qp.contiguous(), kp.contiguous()
        # one dtype for flashmsa's five inputs, chosen here, outside the selective recompute (which runs core again
        # without the forward's autocast state): under torch.autocast, Megatron's projections and rotary embedding
        # can hand over q, k, v and qp, kp in different dtypes (fp32 weights, bf16 compute)
        query, key, value, qp, kp = _one_dtype(query, key, value, qp, kp)

        def core(query, key, value, qp, kp, attention_mask):
            return self.core_attention(query, key, value, attention_mask, attn_mask_type=self.attn_mask_type,
                                       attention_bias=attention_bias, packed_seq_params=packed_seq_params,
                                       qp=qp, kp=kp)
        if self.checkpoint_core_attention and self.training:  # selective recompute: qp, kp are checkpoint inputs
            out = tensor_parallel.checkpoint(core, False, query, key, value, qp, kp, attention_mask)
        else:
            out = core(query, key, value, qp, kp, attention_mask)
        if thd:
            out = out.reshape(out.size(0), 1, -1)
        return self.linear_proj(out)


def get_msa_gpt_layer_spec(**local_spec_kwargs) -> ModuleSpec:
    """Megatron's local GPT layer spec (get_gpt_layer_local_spec(**local_spec_kwargs)) with MSA self-attention."""
    spec = get_gpt_layer_local_spec(**local_spec_kwargs)
    sub = spec.submodules.self_attention.submodules
    spec.submodules.self_attention = ModuleSpec(
        module=MSASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
        submodules=MSASelfAttentionSubmodules(linear_qkv=sub.linear_qkv, core_attention=MSACoreAttention,
                                              linear_proj=sub.linear_proj, q_layernorm=sub.q_layernorm,
                                              k_layernorm=sub.k_layernorm,
                                              linear_qp=tensor_parallel.ColumnParallelLinear))
    return spec


def set_warmup(model: torch.nn.Module, warmup: bool) -> int:
    """Switches every MSA layer of `model` to dense warmup attention (True) or sparse attention (False); returns the
    number of layers switched."""
    n = 0
    for m in model.modules():
        if isinstance(m, MSACoreAttention):
            m.warmup = bool(warmup)
            n += 1
    return n



def cpu_support() -> None:
    """Megatron-Core 0.16.1 on a machine without CUDA (tests, the CPU preset of examples/megatron_gpt.py): its CPU path
    still asks torch.cuda for the rotary embedding's device, forks the CUDA RNG tracker in attention and saves the
    CUDA RNG state when it checkpoints activations. This points torch.cuda.current_device at the CPU and installs
    Megatron's no-op RNG tracker and CPU RNG-state functions. Process-wide; refused where CUDA is available."""
    if torch.cuda.is_available():
        raise RuntimeError("flashmsa.integrations.megatron.cpu_support: CUDA is available; it is for CPU-only runs")
    import megatron.core.tensor_parallel.random as mrandom
    torch.cuda.current_device = lambda: "cpu"
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None
