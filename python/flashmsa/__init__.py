"""flashmsa: MiniMax Sparse Attention (MSA) training kernels for PyTorch.

    out, kl = flashmsa.msa_attention(q, k, v, qp, kp, topk=16, cu_seqlens=cu, max_seqlen=n)
    loss = task_loss(out) + kl_coef * kl        # kl's gradient trains the proxy (qp, kp)

The kernels live in libflashmsa.so (the C ABI of include/flashmsa/flashmsa.h), loaded on first
use through ctypes; `flashmsa.reference` is an eager torch implementation of the contract
(docs/semantics.md).
"""
from . import nn, reference
from ._autograd import HAS_CUSTOM_OP, op_names
from ._lib import (BLOCK_SIZE, MAX_TOPK, FlashMSAError, InvalidArgumentError, NotSupportedError,
                   cuda_available, library_path, version)
from ._lib import check_device as check
from .ops import msa_attention, msa_select

__all__ = [
    "msa_attention", "msa_select", "nn", "reference", "BLOCK_SIZE", "MAX_TOPK", "FlashMSAError",
    "InvalidArgumentError", "NotSupportedError", "HAS_CUSTOM_OP", "op_names", "cuda_available",
    "library_path", "version", "check",
]
