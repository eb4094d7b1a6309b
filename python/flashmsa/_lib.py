"""ctypes binding of the C ABI (include/flashmsa/flashmsa.h) and torch -> tensor-view conversion.

Nothing here knows about autograd: it loads libflashmsa.so, mirrors the argument structs, turns
torch tensors into `flashmsa_tensor_t` views and maps status codes to Python exceptions.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import pathlib
import threading
from typing import Optional

import torch

# The header's constants these bindings mirror. _check_abi compares every one of them with the
# library's value (flashmsa_abi_constant) before the first call: ABI_CONSTANTS below names each.
BLOCK_SIZE = 128  # FLASHMSA_BLOCK_SIZE
MAX_TOPK = 64  # FLASHMSA_MAX_TOPK
MAX_DIMS = 4  # FLASHMSA_MAX_DIMS
MAX_SCALE = 1e4  # FLASHMSA_MAX_SCALE

# flashmsa_status_t
SUCCESS, INVALID_ARGUMENT, NOT_SUPPORTED, DEVICE, WORKSPACE, INTERNAL = range(6)
# flashmsa_dtype_t
DTYPE_BF16, DTYPE_FP16, DTYPE_FP32, DTYPE_FP64, DTYPE_INT32 = range(5)
# flashmsa_device_type_t
DEVICE_CPU, DEVICE_CUDA = range(2)
# flashmsa_mode_t
MODE_SPARSE, MODE_DENSE, MODE_GIVEN = range(3)
# flashmsa_numerics_t
NUMERICS_TRAIN, NUMERICS_INFER = range(2)
# flashmsa_selection_t
SELECTION_INPUT, SELECTION_FP8 = range(2)
# flashmsa_struct_t
STRUCT_TENSOR, STRUCT_SELECT_ARGS, STRUCT_FWD_ARGS, STRUCT_BWD_ARGS = range(4)

DTYPES = {
    torch.bfloat16: DTYPE_BF16,
    torch.float16: DTYPE_FP16,
    torch.float32: DTYPE_FP32,
    torch.float64: DTYPE_FP64,
    torch.int32: DTYPE_INT32,
}


# ---- exceptions -----------------------------------------------------------------------------
class FlashMSAError(RuntimeError):
    """A failed library call; `status` is the flashmsa_status_t code."""

    status = INTERNAL

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        if status is not None:
            self.status = status


class InvalidArgumentError(FlashMSAError, ValueError):
    """FLASHMSA_ERROR_INVALID_ARGUMENT: bad shape, dtype, stride, ratio or value."""

    status = INVALID_ARGUMENT


class NotSupportedError(FlashMSAError, NotImplementedError):
    """FLASHMSA_ERROR_NOT_SUPPORTED: valid per SPEC, but not built for this backend yet."""

    status = NOT_SUPPORTED


_ERRORS = {INVALID_ARGUMENT: InvalidArgumentError, NOT_SUPPORTED: NotSupportedError}


# ---- the structs (flashmsa.h, field for field) ----------------------------------------------
class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * MAX_DIMS),
        ("strides", ctypes.c_int64 * MAX_DIMS),
        ("device_type", ctypes.c_int),
        ("device_id", ctypes.c_int32),
    ]


class SelectArgs(ctypes.Structure):
    _fields_ = [
        ("qp", Tensor),
        ("kp", Tensor),
        ("cu_seqlens", Tensor),
        ("max_seqlen", ctypes.c_int64),
        ("cu_seqlens_q", Tensor),
        ("q_origin", Tensor),
        ("max_seqlen_q", ctypes.c_int64),
        ("topk", ctypes.c_int32),
        ("proxy_scale", ctypes.c_double),
        ("selection", ctypes.c_int),
        ("indices", Tensor),
        ("proxy_lse", Tensor),
        ("status", Tensor),
        ("stream", ctypes.c_void_p),
    ]


class FwdArgs(ctypes.Structure):
    _fields_ = [
        ("q", Tensor),
        ("k", Tensor),
        ("v", Tensor),
        ("qp", Tensor),
        ("kp", Tensor),
        ("cu_seqlens", Tensor),
        ("max_seqlen", ctypes.c_int64),
        ("cu_seqlens_q", Tensor),
        ("q_origin", Tensor),
        ("max_seqlen_q", ctypes.c_int64),
        ("mode", ctypes.c_int),
        ("numerics", ctypes.c_int),
        ("selection", ctypes.c_int),
        ("topk", ctypes.c_int32),
        ("softmax_scale", ctypes.c_double),
        ("proxy_scale", ctypes.c_double),
        ("compute_kl", ctypes.c_int32),
        ("validate", ctypes.c_int32),
        ("indices", Tensor),
        ("out", Tensor),
        ("out_lo", Tensor),
        ("lse", Tensor),
        ("proxy_lse", Tensor),
        ("kl", Tensor),
        ("status", Tensor),
        ("stream", ctypes.c_void_p),
    ]


class BwdArgs(ctypes.Structure):
    _fields_ = [
        ("q", Tensor),
        ("k", Tensor),
        ("v", Tensor),
        ("qp", Tensor),
        ("kp", Tensor),
        ("cu_seqlens", Tensor),
        ("max_seqlen", ctypes.c_int64),
        ("cu_seqlens_q", Tensor),
        ("q_origin", Tensor),
        ("max_seqlen_q", ctypes.c_int64),
        ("mode", ctypes.c_int),
        ("softmax_scale", ctypes.c_double),
        ("proxy_scale", ctypes.c_double),
        ("deterministic", ctypes.c_int32),
        ("validate", ctypes.c_int32),
        ("indices", Tensor),
        ("out", Tensor),
        ("out_lo", Tensor),
        ("lse", Tensor),
        ("proxy_lse", Tensor),
        ("dout", Tensor),
        ("dlse", Tensor),
        ("dkl", Tensor),
        ("dq", Tensor),
        ("dk", Tensor),
        ("dv", Tensor),
        ("dqp", Tensor),
        ("dkp", Tensor),
        ("kl", Tensor),
        ("status", Tensor),
        ("stream", ctypes.c_void_p),
    ]


# ---- loading --------------------------------------------------------------------------------
LIB_NAME = "libflashmsa.so"
_PKG_DIR = pathlib.Path(__file__).resolve().parent
_REPO_ROOT = _PKG_DIR.parents[1]
# the package used from the repository (python/flashmsa), not an installed copy
_IN_SOURCE_TREE = (_REPO_ROOT / "include" / "flashmsa" / "flashmsa.h").is_file()


def library_candidates() -> list[pathlib.Path]:
    """Where the library is looked for, in order: $FLASHMSA_LIBRARY; the build directory
    $FLASHMSA_BUILD_DIR (relative to the current directory, or to the repository root when the
    package is the source tree's); the library installed inside the package (pip install:
    flashmsa/lib/); the repository's build/ (source tree only)."""
    env = os.environ.get("FLASHMSA_LIBRARY")
    if env:
        return [pathlib.Path(env)]
    found = []
    build = os.environ.get("FLASHMSA_BUILD_DIR")
    if build:
        b = pathlib.Path(build)
        found += [b / LIB_NAME] if b.is_absolute() else [pathlib.Path.cwd() / b / LIB_NAME]
        if not b.is_absolute() and _IN_SOURCE_TREE:
            found.append(_REPO_ROOT / b / LIB_NAME)
    found.append(_PKG_DIR / "lib" / LIB_NAME)
    if _IN_SOURCE_TREE:
        found.append(_REPO_ROOT / "build" / LIB_NAME)
    return found


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    st, vp, sz = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
    for name, args_t in (("select", SelectArgs), ("fwd", FwdArgs), ("bwd", BwdArgs)):
        p = ctypes.POINTER(args_t)
        init = getattr(lib, f"flashmsa_{name}_args_init")
        init.argtypes, init.restype = [p], None
        ws = getattr(lib, f"flashmsa_{name}_workspace_size")
        ws.argtypes, ws.restype = [p, ctypes.POINTER(sz)], st
        run = getattr(lib, f"flashmsa_{name}")
        run.argtypes, run.restype = [p, vp, sz], st
    lib.flashmsa_last_error.argtypes, lib.flashmsa_last_error.restype = [], ctypes.c_char_p
    lib.flashmsa_status_string.argtypes, lib.flashmsa_status_string.restype = [st], ctypes.c_char_p
    lib.flashmsa_cuda_available.argtypes, lib.flashmsa_cuda_available.restype = [], ctypes.c_int
    lib.flashmsa_version.argtypes, lib.flashmsa_version.restype = [], ctypes.c_char_p
    lib.flashmsa_check_status.argtypes = [ctypes.POINTER(Tensor), vp, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)]
    lib.flashmsa_check_status.restype = st
    _check_abi(lib)
    return lib


ABI_VERSION = 6  # FLASHMSA_ABI_VERSION of the header these structs mirror

# Every constant of this module that mirrors flashmsa.h -> its name there. _check_abi compares each
# with the library (tests/python/test_abi.py checks that no int constant of the module is missing).
ABI_CONSTANTS = {name: "FLASHMSA_" + name for name in (
    "BLOCK_SIZE", "MAX_TOPK", "MAX_DIMS", "MAX_SCALE", "ABI_VERSION",
    "SUCCESS",
    "DTYPE_BF16", "DTYPE_FP16", "DTYPE_FP32", "DTYPE_FP64", "DTYPE_INT32",
    "DEVICE_CPU", "DEVICE_CUDA",
    "MODE_SPARSE", "MODE_DENSE", "MODE_GIVEN",
    "NUMERICS_TRAIN", "NUMERICS_INFER",
    "SELECTION_INPUT", "SELECTION_FP8",
    "STRUCT_TENSOR", "STRUCT_SELECT_ARGS", "STRUCT_FWD_ARGS", "STRUCT_BWD_ARGS",
    "STATUS_WORDS", "CHECK_SYNC", "CHECK_RESET",
)}
ABI_CONSTANTS.update({name: "FLASHMSA_ERROR_" + name for name in (
    "INVALID_ARGUMENT", "NOT_SUPPORTED", "DEVICE", "WORKSPACE", "INTERNAL")})
# the struct each flashmsa_struct_t id stands for (this module's constant names)
_STRUCT_IDS = {"STRUCT_TENSOR": Tensor, "STRUCT_SELECT_ARGS": SelectArgs, "STRUCT_FWD_ARGS": FwdArgs,
               "STRUCT_BWD_ARGS": BwdArgs}


def abi_constant(lib: ctypes.CDLL, c_name: str) -> Optional[int]:
    """The library's value of the header constant `c_name` (None when it does not know it)."""
    value = ctypes.c_int64(0)
    return value.value if lib.flashmsa_abi_constant(c_name.encode(), ctypes.byref(value)) else None


def _check_abi(lib: ctypes.CDLL) -> None:
    """Refuse a library whose ABI (version, struct layout or any constant these bindings mirror)
    differs from these bindings: ImportError naming what differs."""
    g = globals()  # read at call time: the module's current values
    lib.flashmsa_abi_version.argtypes, lib.flashmsa_abi_version.restype = [], ctypes.c_int
    lib.flashmsa_struct_size.argtypes, lib.flashmsa_struct_size.restype = [ctypes.c_int], ctypes.c_size_t
    got = lib.flashmsa_abi_version()
    if got != g["ABI_VERSION"]:
        raise ImportError(f"flashmsa: the library has ABI version {got}, these Python bindings expect "
                          f"{g['ABI_VERSION']}: rebuild the library or update the package")
    try:
        query = lib.flashmsa_abi_constant
    except AttributeError:
        raise ImportError("flashmsa: the library has no flashmsa_abi_constant (built from an older "
                          "checkout): rebuild the library") from None
    query.argtypes, query.restype = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64)], ctypes.c_int
    for py_name, c_name in ABI_CONSTANTS.items():
        ours, theirs = g[py_name], abi_constant(lib, c_name)
        if theirs is None:
            raise ImportError(f"flashmsa: the library does not know the constant {c_name} that the Python "
                              f"bindings mirror as {py_name}: rebuild the library or update the package")
        if ours != theirs:
            raise ImportError(f"flashmsa: constant {c_name} is {theirs} in the library but {py_name} = {ours} "
                              "in the Python bindings: rebuild the library or update the package")
    for py_name, struct in _STRUCT_IDS.items():
        size = lib.flashmsa_struct_size(g[py_name])
        if size != ctypes.sizeof(struct):
            raise ImportError(f"flashmsa: struct {struct.__name__} is {size} bytes in the library but "
                              f"{ctypes.sizeof(struct)} in the Python bindings: rebuild the library")


_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[pathlib.Path] = None
_lock = threading.Lock()


def lib() -> ctypes.CDLL:
    """The loaded library (loaded on first use, so `import flashmsa` works without it)."""
    global _lib, _lib_path
    if _lib is None:
        with _lock:
            if _lib is None:
                tried = library_candidates()
                for path in tried:
                    if path.is_file():
                        _lib = _declare(ctypes.CDLL(str(path)))
                        _lib_path = path
                        break
                else:
                    raise OSError(
                        f"flashmsa: {LIB_NAME} not found; looked at: {', '.join(map(str, tried))}. "
                        "Build it (bash scripts/setup.sh) or set FLASHMSA_LIBRARY to its path."
                    )
    return _lib


def library_path() -> pathlib.Path:
    lib()
    return _lib_path


def version() -> str:
    return lib().flashmsa_version().decode()


def cuda_available() -> bool:
    """True when the library has its CUDA backend and sees a device."""
    return bool(lib().flashmsa_cuda_available())


def check(status: int) -> None:
    if status == SUCCESS:
        return
    msg = lib().flashmsa_last_error().decode(errors="replace")
    if not msg:
        msg = lib().flashmsa_status_string(status).decode()
    raise _ERRORS.get(status, FlashMSAError)(msg, status)


# ---- tensor views ---------------------------------------------------------------------------
NONE = Tensor()  # absent: data NULL, ndim 0


def view(t: Optional[torch.Tensor]) -> Tensor:
    """A flashmsa_tensor_t over `t` (absent for None). Strides are passed as they are."""
    v = Tensor()
    if t is None:
        return v
    if t.dim() > MAX_DIMS:
        raise ValueError(f"flashmsa: expected at most {MAX_DIMS} dimensions, got {t.dim()} {list(t.shape)}")
    try:
        v.dtype = DTYPES[t.dtype]
    except KeyError:
        raise TypeError(f"flashmsa: unsupported dtype {t.dtype}") from None
    v.data = t.data_ptr() or None
    v.ndim = t.dim()
    for i, (n, s) in enumerate(zip(t.shape, t.stride())):
        v.shape[i], v.strides[i] = n, s
    if t.device.type == "cuda":
        v.device_type, v.device_id = DEVICE_CUDA, t.device.index or 0
    elif t.device.type == "cpu":
        v.device_type, v.device_id = DEVICE_CPU, 0
    else:
        raise ValueError(f"flashmsa: tensors must be on the CPU or a CUDA device, got {t.device}")
    return v


def stream_of(device: torch.device) -> Optional[int]:
    """The current torch stream of `device` as a cudaStream_t (None on the CPU)."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


# ---- metadata faults found on the device (flashmsa.h, "metadata faults") ---------------------
STATUS_WORDS = 8  # FLASHMSA_STATUS_WORDS
CHECK_SYNC, CHECK_RESET = 1, 2  # FLASHMSA_CHECK_*
_status: dict = {}  # CUDA device index -> its status words: pinned (page-locked, mapped) host int32


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def status_words(device: torch.device) -> Optional[torch.Tensor]:
    """The status words every CUDA call of this process on `device` records metadata faults in:
    page-locked host memory, so reading them needs no synchronisation (None on the CPU)."""
    if device.type != "cuda":
        return None
    i = _device_index(device)
    t = _status.get(i)
    if t is None:
        with _lock:
            t = _status.get(i)
            if t is None:
                t = torch.zeros(STATUS_WORDS, dtype=torch.int32, pin_memory=True)
                _status[i] = t
    return t


def _report(t: torch.Tensor, flags: int) -> None:
    """Raise InvalidArgumentError naming the recorded faults (and clear them), if any."""
    check(lib().flashmsa_check_status(ctypes.byref(view(t)), None, flags | CHECK_RESET, None))


def raise_pending(device: torch.device) -> None:
    """Raise for a fault that an earlier call on `device` recorded and that has reached the host
    already (no synchronisation: a call still running on the GPU reports at a later check)."""
    if device.type != "cuda":
        return
    t = _status.get(_device_index(device))
    if t is not None and int(t[0]) != 0:
        _report(t, 0)


def check_device(device: Optional[torch.device] = None) -> None:
    """Synchronise `device` (default: the current CUDA device) and raise InvalidArgumentError if
    any flashmsa call on it found invalid metadata since the last check. Clears the record."""
    if not torch.cuda.is_available():
        return
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        return
    t = _status.get(_device_index(device))
    if t is None:
        return
    torch.cuda.synchronize(device)
    _report(t, 0)


def call(name: str, args: ctypes.Structure, device: torch.device) -> None:
    """Query the workspace, allocate it with torch (caching allocator, graph-safe) and run.
    On CUDA, first raise for metadata faults of earlier calls that the host can see already;
    the call records its own in the device's status words."""
    L = lib()
    if device.type == "cuda":
        raise_pending(device)
        args.status = view(status_words(device))
    nbytes = ctypes.c_size_t(0)
    check(getattr(L, f"flashmsa_{name}_workspace_size")(ctypes.byref(args), ctypes.byref(nbytes)))
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        # Allocated on the current stream, which the call runs on: the caching allocator
        # reuses it only after the call's work in stream order (and CUDA graphs capture it).
        ws = torch.empty(nbytes.value, dtype=torch.uint8, device=device) if nbytes.value else None
        check(getattr(L, f"flashmsa_{name}")(ctypes.byref(args), ws.data_ptr() if ws is not None else None,
                                             nbytes.value))


def new_args(kind: type) -> ctypes.Structure:
    """An argument struct initialised by flashmsa_*_args_init (absent tensors, default scales)."""
    a = kind()
    name = {SelectArgs: "select", FwdArgs: "fwd", BwdArgs: "bwd"}[kind]
    getattr(lib(), f"flashmsa_{name}_args_init")(ctypes.byref(a))
    return a
