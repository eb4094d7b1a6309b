"""flashmsa: MiniMax Sparse Attention (MSA) training kernels for PyTorch.

    out, kl = flashmsa.msa_attention(q, k, v, qp, kp, topk=16, cu_seqlens=cu, max_seqlen=n)
    loss = task_loss(out) + kl_coef * kl        # kl's gradient trains the proxy (qp, kp)

The kernels live in libflashmsa.so (the C ABI of include/flashmsa/flashmsa.h), loaded on first
use through ctypes; `flashmsa.reference` is an eager torch implementation of the contract
(docs/semantics.md).

The names below are imported on first use (PEP 562), so `import flashmsa` alone does not import
torch: the console command `flashmsa` (the main job, a C++ program: _main_job.py) starts at once
and needs no torch. When torch is already imported, everything is imported here, which also
registers the torch.library ops (torch.ops.flashmsa.*).
"""
import importlib
import sys

# public name -> (module, attribute); a module alone for the submodules
_EXPORTS = {
    "msa_attention": ("ops", "msa_attention"),
    "msa_select": ("ops", "msa_select"),
    "proxy_attention": ("ops", "proxy_attention"),
    "nn": ("nn", None),
    "reference": ("reference", None),
    "HAS_CUSTOM_OP": ("_autograd", "HAS_CUSTOM_OP"),
    "op_names": ("_autograd", "op_names"),
    "check": ("_lib", "check_device"),
    **{name: ("_lib", name) for name in (
        "BLOCK_SIZE", "MAX_TOPK", "FlashMSAError", "InvalidArgumentError", "NotSupportedError",
        "cuda_available", "library_path", "version")},
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'flashmsa' has no attribute '{name}'") from None
    value = importlib.import_module(f".{module}", __name__)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


if "torch" in sys.modules:
    for _name in __all__:
        __getattr__(_name)
    del _name
