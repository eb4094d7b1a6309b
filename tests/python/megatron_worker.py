"""One rank of a Megatron-Core world for test_megatron.py (not a test itself):

    python3 megatron_worker.py --rank R --world P --port PORT --out DIR --tp TP --cp CP [--device cuda] CASE...

CPU, gloo (the cases below but distopt); --device cuda: one GPU a rank, NCCL, the case distopt. Builds a small GPTModel with flashmsa's MSA layer spec (fp32, CPU backend) from a fixed seed, runs one
training step on fixed tokens and writes, per case, the loss, the kl tracker values and every parameter's gradient
(the full tensor: TP shards gathered) to DIR/<case>-rank<R>.pt. The CPU shims below stand in for the CUDA calls
Megatron-Core makes even on the CPU path (the rotary embedding's device, the CUDA RNG tracker, checkpointing's CUDA
RNG state); they touch nothing of flashmsa.
"""
import argparse
import os
import pathlib
import sys
import warnings

warnings.filterwarnings("ignore")
if os.environ.get("FLASHMSA_TEST_INSTALLED") != "1":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SEQ = 320  # 3 key blocks: topk 2 selects
VOCAB = 96


def cpu_shims():
    from flashmsa.integrations.megatron import cpu_support
    cpu_support()


def config(tp=1, cp=1, **extra):
    from flashmsa.integrations.megatron import MSAConfig
    kw = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
              ffn_hidden_size=128, use_cpu_initialization=True, params_dtype=torch.float32,
              pipeline_dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False,
              bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
              gradient_accumulation_fusion=False, persist_layer_norm=False, tensor_model_parallel_size=tp,
              context_parallel_size=cp, msa_topk=2, msa_proxy_heads=2, msa_proxy_key_heads=1, msa_kl_coeff=0.5)
    kw.update(extra)
    return MSAConfig(**kw)


def model(cfg, spec=None):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from flashmsa.integrations.megatron import get_msa_gpt_layer_spec
    torch.manual_seed(0)
    return GPTModel(config=cfg, transformer_layer_spec=spec or get_msa_gpt_layer_spec(), vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope")


def tokens(b=2):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (b, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def zigzag(x, cp, r, dim=1):
    """Megatron's CP layout of a [b, S] tensor: chunks r and 2cp-1-r of the sequence dim."""
    c = x.shape[dim] // (2 * cp)
    return torch.cat([x.narrow(dim, r * c, c), x.narrow(dim, (2 * cp - 1 - r) * c, c)], dim=dim)


def full_grads(m, tp_group):
    """Every parameter's gradient, TP shards gathered along the parallel dim."""
    res = {}
    tp = dist.get_world_size(tp_group)
    for n, p in m.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g.contiguous(), group=tp_group)
            g = torch.cat(parts, dim=p.partition_dim)
        res[n] = g.clone()
    return res


def step(m, ids, labels, packed=False, b=2):
    """One training step's loss (summed token loss / tokens of this rank) and backward."""
    from flashmsa.integrations import megatron as fm
    from megatron.core.packed_seq_params import PackedSeqParams
    m.zero_grad(set_to_none=True)
    m.train()
    fm.set_kl_loss_scale(m.config, 1)
    if packed:  # b sequences packed as one THD row [1, b*S_local]
        cp = m.config.context_parallel_size
        S = ids.shape[1] * cp
        cu = torch.arange(b + 1, dtype=torch.int32) * S
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=S, max_seqlen_kv=S)
        out = m(ids.reshape(1, -1), None, None, labels=labels.reshape(1, -1), packed_seq_params=psp)
    else:
        out = m(ids, None, None, labels=labels)
    loss = out.float().mean()
    loss.backward()
    return loss.detach()


def counting_batch(g):
    """Learnable text, 2 rows: each counts up from a random token in steps of 1 or 3 -> (ids, labels)."""
    start, stride = torch.randint(0, VOCAB, (2, 1), generator=g), 1 + 2 * torch.randint(0, 2, (2, 1), generator=g)
    ids = (start + stride * torch.arange(SEQ)) % VOCAB
    return ids, torch.roll(ids, -1, dims=1)


def curve(m, cp, steps=50, packed=True):
    """Training losses of `steps` Adam steps on fresh batches (the same on every rank; CP ranks take their zigzag
    share and sum their gradients as Megatron's DDP does)."""
    from megatron.core import parallel_state
    from flashmsa.integrations import megatron as fm
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(5)
    cp_group = parallel_state.get_context_parallel_group()
    r = parallel_state.get_context_parallel_rank()
    losses = []
    for _ in range(steps):
        ids, labels = counting_batch(g)
        if cp > 1:
            ids, labels = zigzag(ids, cp, r), zigzag(labels, cp, r)
        loss = step(m, ids, labels, packed=packed)
        if cp > 1:
            dist.all_reduce(loss, group=cp_group)
            loss = loss / cp
            for p in m.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=cp_group)
                    p.grad /= cp
        opt.step()
        losses.append(float(loss))
        fm.kl_metrics(reduce=False)  # (read and cleared each step, as a trainer logs it)
    return losses


def distopt(use_distributed_optimizer, steps=30):
    """Megatron's training stack on the GPU: the MSA GPTModel (head dim 128, bf16 weights through Float16Module)
    wrapped in Megatron's DistributedDataParallel, stepped by get_megatron_optimizer's optimizer (the distributed
    one, or Megatron's bf16 optimizer with fp32 main weights) for `steps` steps of the curve's batches (packed).
    Returns the losses, the proxy projections' weights before and after, and the optimizer's class name."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core import tensor_parallel
    from flashmsa.integrations import megatron as fm
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # the same initial weights in every call
    # deterministic kernels (flashmsa's deterministic backward among them): the two optimizers' curves then differ
    # only by the optimizers' own arithmetic, not by the run-to-run bf16 noise of atomics amplified over 30 steps
    torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = config(hidden_size=256, kv_channels=128, bf16=True, params_dtype=torch.bfloat16,
                 pipeline_dtype=torch.bfloat16, use_cpu_initialization=False)
    m = Float16Module(cfg, model(cfg).cuda())
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=use_distributed_optimizer, grad_reduce_in_fp32=True, overlap_grad_reduce=False), m)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, bf16=True, params_dtype=torch.bfloat16,
                                                 use_distributed_optimizer=use_distributed_optimizer, clip_grad=1.0,
                                                 weight_decay=0.0), [ddp])
    proxy = {n: p for n, p in ddp.named_parameters() if "linear_qp" in n or "linear_kp" in n}
    before = {n: p.detach().float().cpu().clone() for n, p in proxy.items()}
    g = torch.Generator().manual_seed(5)
    losses, grad_norms = [], {}
    from megatron.core.packed_seq_params import PackedSeqParams
    for it in range(steps):
        ids, labels = (t.cuda() for t in counting_batch(g))
        cu = torch.arange(3, dtype=torch.int32, device="cuda") * SEQ
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=SEQ, max_seqlen_kv=SEQ)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        fm.set_kl_loss_scale(cfg, 1)
        loss = ddp(ids.reshape(1, -1), None, None, labels=labels.reshape(1, -1), packed_seq_params=psp).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        if it == 0:  # where the first step's gradients arrive (DDP's main_grad buffers, which the optimizer reads)
            grads = {n: getattr(p, "main_grad", p.grad) for n, p in ddp.named_parameters()}
            grad_norms = {n: None if g is None else float(g.float().norm()) for n, g in grads.items()}
        ok, _, _ = opt.step()
        assert ok, "optimizer step skipped"
        losses.append(float(loss))
        fm.kl_metrics(reduce=False)
    after = {n: p.detach().float().cpu().clone() for n, p in proxy.items()}
    inner = [type(o).__name__ for o in getattr(opt, "chained_optimizers", [opt])]  # (get_megatron_optimizer chains)
    return dict(losses=losses, before=before, after=after, optimizers=inner, grad_norms=grad_norms)


def run(case, rank, P, tp, cp, out_dir):
    from megatron.core import parallel_state
    if case.startswith("distopt"):  # distopt_on / distopt_off: the distributed optimizer or Megatron's bf16 one
        torch.save(distopt(case == "distopt_on"), pathlib.Path(out_dir) / f"{case}-rank{rank}.pt")
        return
    from flashmsa.integrations import megatron as fm
    extra = {}
    if case == "recompute_selective":
        extra = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif case == "recompute_full":
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif case == "packed_heads":  # the heads scheme on Megatron's zigzag shards
        extra = dict(msa_cp_scheme="heads")
    elif case == "share":  # IndexShare: layer 2 attends to layer 1's blocks (packed batches)
        extra = dict(msa_index_share=2)
    cfg = config(tp=tp, cp=cp, **extra)
    m = model(cfg)
    if case == "curve":
        torch.save(dict(losses=curve(m, cp)), pathlib.Path(out_dir) / f"{case}-rank{rank}.pt")
        return
    ids, labels = tokens()
    cp_rank = parallel_state.get_context_parallel_rank()
    if cp > 1:
        ids, labels = zigzag(ids, cp, cp_rank), zigzag(labels, cp, cp_rank)
    loss = step(m, ids, labels, packed=case.startswith("packed") or case == "share")
    # the model's loss: the mean over every rank's tokens (equal counts)
    if cp > 1:
        dist.all_reduce(loss, group=parallel_state.get_context_parallel_group())
        loss = loss / cp
    kl = fm.kl_metrics().get("msa_kl_loss")
    grads = full_grads(m, parallel_state.get_tensor_model_parallel_group())
    if cp > 1:  # each CP rank holds its tokens' part of every gradient (Megatron's DDP sums them)
        for g in grads.values():
            dist.all_reduce(g, group=parallel_state.get_context_parallel_group())
            g /= cp  # the losses above are per-rank means: the model's mean is their average
    torch.save(dict(loss=loss, kl=kl, grads=grads), pathlib.Path(out_dir) / f"{case}-rank{rank}.pt")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("cases", nargs="+")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.device == "cuda":
        torch.cuda.set_device(a.rank)
    dist.init_process_group("gloo" if a.device == "cpu" else "nccl", init_method=f"tcp://127.0.0.1:{a.port}",
                            rank=a.rank, world_size=a.world)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=a.tp, context_parallel_size=a.cp)
    if a.device == "cpu":
        cpu_shims()
    else:
        from megatron.core import tensor_parallel
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    for case in a.cases:
        run(case, a.rank, a.world, a.tp, a.cp, a.out)
        dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown after the results are written (flashmsa/cp_run.py says why)


if __name__ == "__main__":
    main()
