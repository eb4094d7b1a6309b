// The C ABI: argument checks, error capture, dispatch by device.
#include <cstring>
#include <exception>
#include <new>
#include <cstdint>
#include <string>

#include "api/backends.hpp"
#include "flashmsa/flashmsa.h"

namespace flashmsa {
namespace {

thread_local std::string g_last_error;

template <class F>
flashmsa_status_t guarded(F&& f) {
  try {
    f();
    g_last_error.clear();
    return FLASHMSA_SUCCESS;
  } catch (const ApiError& e) {
    g_last_error = e.what();
    return e.status;
  } catch (const std::bad_alloc&) {
    g_last_error = "flashmsa: out of host memory";
    return FLASHMSA_ERROR_INTERNAL;
  } catch (const std::exception& e) {
    g_last_error = std::string("flashmsa: internal error: ") + e.what();
    return FLASHMSA_ERROR_INTERNAL;
  } catch (...) {
    g_last_error = "flashmsa: internal error";
    return FLASHMSA_ERROR_INTERNAL;
  }
}

template <class A>
void require(const A* a, const char* fn) {
  if (a == nullptr) invalid(std::string(fn) + ": args is NULL");
}

void require_out(const void* p, const char* fn, const char* name) {
  if (p == nullptr) invalid(std::string(fn) + ": " + name + " is NULL");
}

void cuda_ready(const Geometry& g, const char* fn) {
  if (!cuda::available())
    fail(FLASHMSA_ERROR_NOT_SUPPORTED,
         std::string(fn) + ": the tensors are on a CUDA device, but this flashmsa was built "
                           "without its CUDA backend or no CUDA device is visible");
  cuda::check_supported(g, fn);
}

void workspace_ok(size_t need, void* ws, size_t bytes, const char* fn) {
  if (need > 0 && (ws == nullptr || bytes < need))
    fail(FLASHMSA_ERROR_WORKSPACE, std::string(fn) + ": workspace: expected at least " +
                                       std::to_string(need) + " bytes, got " +
                                       std::to_string(ws ? bytes : 0) +
                                       " (ask flashmsa_*_workspace_size)");
  // the kernels' bulk copies and 64-bit atomics on the workspace need 16-byte alignment; a misaligned
  // pointer would fault on the device (and end the CUDA context) instead of failing here
  if (need > 0 && reinterpret_cast<uintptr_t>(ws) % 16 != 0)
    fail(FLASHMSA_ERROR_WORKSPACE, std::string(fn) + ": workspace: expected a 16-byte aligned pointer, got one at " +
                                       std::to_string(reinterpret_cast<uintptr_t>(ws) % 16) +
                                       " bytes past a 16-byte boundary (cudaMalloc and torch allocations are aligned)");
}

// The optional status words: int32 [FLASHMSA_STATUS_WORDS], contiguous; for a CUDA call in
// memory the device can write. The CPU backend never writes them.
void check_status_tensor(const flashmsa_tensor_t& t, const Geometry& g, const char* fn) {
  if (!present(t)) return;
  const std::string what = std::string(fn) + ": status: ";
  if (t.dtype != FLASHMSA_DTYPE_INT32)
    invalid(what + "expected dtype int32, got " + flashmsa_dtype_name(t.dtype));
  if (t.ndim != 1 || t.shape[0] != FLASHMSA_STATUS_WORDS || t.strides[0] != 1 || t.data == nullptr)
    invalid(what + "expected a contiguous int32 tensor of shape [" + std::to_string(FLASHMSA_STATUS_WORDS) +
            "], got " + shape_string(t));
  if (g.device == FLASHMSA_DEVICE_CUDA) cuda::check_status_memory(t, g, fn);
}

// The text of status words (flashmsa_check_status).
std::string describe_faults(const int32_t* w) {
  static const struct { int32_t bit; const char* text; } kFaults[] = {
      {FLASHMSA_FAULT_FIRST_NOT_ZERO, "cu_seqlens[0] is not 0"},
      {FLASHMSA_FAULT_NEGATIVE, "a value is negative"},
      {FLASHMSA_FAULT_DECREASING, "values decrease (cu_seqlens must be non-decreasing)"},
      {FLASHMSA_FAULT_ABOVE_TOTAL, "a value exceeds total (the token count of q)"},
      {FLASHMSA_FAULT_LAST_NOT_TOTAL, "the last value is not total"},
      {FLASHMSA_FAULT_ABOVE_MAX_SEQLEN, "a sequence is longer than max_seqlen"},
      {FLASHMSA_FAULT_SEGMENTS, "query segments (cu_seqlens_q, q_origin) do not fit the key sequences"}};
  std::string faults, ops;
  for (const auto& f : kFaults)
    if (w[0] & f.bit) faults += (faults.empty() ? "" : "; ") + std::string(f.text);
  for (auto [bit, name] : {std::pair{FLASHMSA_FAULT_OP_SELECT, "flashmsa_select"}, {FLASHMSA_FAULT_OP_FWD, "flashmsa_fwd"},
                           {FLASHMSA_FAULT_OP_BWD, "flashmsa_bwd"}})
    if (w[1] & bit) ops += (ops.empty() ? "" : ", ") + std::string(name);
  std::string msg = "flashmsa: invalid cu_seqlens found on the device by " + std::to_string(w[2]) + " call(s) (" +
                    ops + "): " + faults + ".";
  if (w[3] > 0 && (w[0] & ~FLASHMSA_FAULT_SEGMENTS) == 0) {  // a segment fault alone: words 3-7 describe it
    const int sg = w[3] - 1;
    msg += " First faulting segment " + std::to_string(sg) + ": cu_seqlens_q[" + std::to_string(sg) + "] = " +
           std::to_string(w[4]) + ", cu_seqlens_q[" + std::to_string(sg + 1) + "] = " + std::to_string(w[5]) +
           " (total_q = " + std::to_string(w[6]) + ", max_seqlen_q = " + std::to_string(w[7]) +
           "; its q_origin row is not in the words).";
  } else if (w[3] > 0) {
    const int b = w[3] - 1;
    msg += " First fault at cu_seqlens[" + std::to_string(b) + "] = " + std::to_string(w[4]);
    if (w[0] & (FLASHMSA_FAULT_DECREASING | FLASHMSA_FAULT_ABOVE_MAX_SEQLEN))
      msg += ", cu_seqlens[" + std::to_string(b + 1) + "] = " + std::to_string(w[5]);
    msg += " (total = " + std::to_string(w[6]) + ", max_seqlen = " + std::to_string(w[7]) + ").";
  }
  msg += " Those calls computed nothing: their outputs are NaN (indices INT32_MIN).";
  return msg;
}

flashmsa_tensor_t none() {
  flashmsa_tensor_t t{};
  t.data = nullptr;
  t.ndim = 0;
  t.dtype = FLASHMSA_DTYPE_FP32;
  t.device_type = FLASHMSA_DEVICE_CPU;
  return t;
}

}  // namespace
}  // namespace flashmsa

using namespace flashmsa;

extern "C" {

void flashmsa_select_args_init(flashmsa_select_args_t* a) {
  if (!a) return;
  *a = flashmsa_select_args_t{};
  a->qp = a->kp = a->cu_seqlens = a->cu_seqlens_q = a->q_origin = a->indices = a->proxy_lse = a->status = none();
}

void flashmsa_fwd_args_init(flashmsa_fwd_args_t* a) {
  if (!a) return;
  *a = flashmsa_fwd_args_t{};
  a->q = a->k = a->v = a->qp = a->kp = a->cu_seqlens = a->cu_seqlens_q = a->q_origin = a->indices = a->out = a->lse =
      a->proxy_lse = a->kl = a->status = none();
  a->mode = FLASHMSA_MODE_SPARSE;
  a->numerics = FLASHMSA_NUMERICS_TRAIN;
}

void flashmsa_bwd_args_init(flashmsa_bwd_args_t* a) {
  if (!a) return;
  *a = flashmsa_bwd_args_t{};
  a->q = a->k = a->v = a->qp = a->kp = a->cu_seqlens = a->cu_seqlens_q = a->q_origin = a->indices = a->out = a->lse =
      a->proxy_lse = a->dout = a->dlse = a->dkl = a->dq = a->dk = a->dv = a->dqp = a->dkp =
          a->kl = a->status = none();
  a->mode = FLASHMSA_MODE_SPARSE;
}

flashmsa_status_t flashmsa_select_workspace_size(const flashmsa_select_args_t* a, size_t* bytes) {
  return guarded([&] {
    const char* fn = "flashmsa_select_workspace_size";
    require(a, fn);
    require_out(bytes, fn, "bytes");
    const Geometry g = validate_select(*a);
    check_status_tensor(a->status, g, fn);
    size_t n = 0;
    if (g.device == FLASHMSA_DEVICE_CUDA) {
      cuda_ready(g, fn);
      n = cuda::select_workspace(*a, g);
    }
    *bytes = n;
  });
}

flashmsa_status_t flashmsa_fwd_workspace_size(const flashmsa_fwd_args_t* a, size_t* bytes) {
  return guarded([&] {
    const char* fn = "flashmsa_fwd_workspace_size";
    require(a, fn);
    require_out(bytes, fn, "bytes");
    const Geometry g = validate_fwd(*a);
    check_status_tensor(a->status, g, fn);
    size_t n = 0;
    if (g.device == FLASHMSA_DEVICE_CUDA) {
      cuda_ready(g, fn);
      n = cuda::fwd_workspace(*a, g);
    }
    *bytes = n;
  });
}

flashmsa_status_t flashmsa_bwd_workspace_size(const flashmsa_bwd_args_t* a, size_t* bytes) {
  return guarded([&] {
    const char* fn = "flashmsa_bwd_workspace_size";
    require(a, fn);
    require_out(bytes, fn, "bytes");
    const Geometry g = validate_bwd(*a);
    check_status_tensor(a->status, g, fn);
    size_t n = 0;
    if (g.device == FLASHMSA_DEVICE_CUDA) {
      cuda_ready(g, fn);
      n = cuda::bwd_workspace(*a, g);
    }
    *bytes = n;
  });
}

flashmsa_status_t flashmsa_select(const flashmsa_select_args_t* a, void* ws, size_t bytes) {
  return guarded([&] {
    const char* fn = "flashmsa_select";
    require(a, fn);
    const Geometry g = validate_select(*a);
    check_status_tensor(a->status, g, fn);
    if (g.device == FLASHMSA_DEVICE_CPU) return cpu::select(*a, g);
    cuda_ready(g, fn);
    workspace_ok(cuda::select_workspace(*a, g), ws, bytes, fn);
    cuda::select(*a, g, ws, bytes);
  });
}

flashmsa_status_t flashmsa_fwd(const flashmsa_fwd_args_t* a, void* ws, size_t bytes) {
  return guarded([&] {
    const char* fn = "flashmsa_fwd";
    require(a, fn);
    const Geometry g = validate_fwd(*a);
    check_status_tensor(a->status, g, fn);
    if (g.device == FLASHMSA_DEVICE_CPU) return cpu::fwd(*a, g);
    cuda_ready(g, fn);
    workspace_ok(cuda::fwd_workspace(*a, g), ws, bytes, fn);
    cuda::fwd(*a, g, ws, bytes);
  });
}

flashmsa_status_t flashmsa_bwd(const flashmsa_bwd_args_t* a, void* ws, size_t bytes) {
  return guarded([&] {
    const char* fn = "flashmsa_bwd";
    require(a, fn);
    const Geometry g = validate_bwd(*a);
    check_status_tensor(a->status, g, fn);
    if (g.device == FLASHMSA_DEVICE_CPU) return cpu::bwd(*a, g);
    cuda_ready(g, fn);
    workspace_ok(cuda::bwd_workspace(*a, g), ws, bytes, fn);
    cuda::bwd(*a, g, ws, bytes);
  });
}

flashmsa_status_t flashmsa_check_status(const flashmsa_tensor_t* status, void* stream, int32_t flags,
                                         int32_t* faults) {
  int32_t w[FLASHMSA_STATUS_WORDS] = {};
  const flashmsa_status_t rc = guarded([&] {
    const char* fn = "flashmsa_check_status";
    if (status == nullptr || !present(*status)) invalid(std::string(fn) + ": status is NULL or absent");
    if (flags & ~(FLASHMSA_CHECK_SYNC | FLASHMSA_CHECK_RESET))
      invalid(std::string(fn) + ": flags: unknown bits in " + std::to_string(flags));
    Geometry g;
    g.device = status->device_type;
    g.device_id = status->device_id;
    check_status_tensor(*status, g, fn);
    if (status->device_type == FLASHMSA_DEVICE_CUDA) {
      cuda::read_status(*status, stream, flags, w);
    } else {  // host words: read after the stream's work when asked
      if ((flags & FLASHMSA_CHECK_SYNC) && cuda::available()) cuda::synchronize(stream);
      volatile int32_t* h = static_cast<int32_t*>(status->data);
      for (int i = 0; i < FLASHMSA_STATUS_WORDS; ++i) w[i] = h[i];
      if (flags & FLASHMSA_CHECK_RESET)
        for (int i = 0; i < FLASHMSA_STATUS_WORDS; ++i) h[i] = 0;
    }
  });
  if (rc != FLASHMSA_SUCCESS) return rc;
  if (faults) *faults = w[0];
  if (w[0] == 0) return FLASHMSA_SUCCESS;
  g_last_error = describe_faults(w);
  return FLASHMSA_ERROR_INVALID_ARGUMENT;
}

const char* flashmsa_last_error(void) { return g_last_error.c_str(); }

const char* flashmsa_status_string(flashmsa_status_t s) {
  switch (s) {
    case FLASHMSA_SUCCESS: return "success";
    case FLASHMSA_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case FLASHMSA_ERROR_NOT_SUPPORTED: return "not supported";
    case FLASHMSA_ERROR_DEVICE: return "device error";
    case FLASHMSA_ERROR_WORKSPACE: return "workspace too small";
    case FLASHMSA_ERROR_INTERNAL: return "internal error";
  }
  return "unknown status";
}

const char* flashmsa_dtype_name(flashmsa_dtype_t t) {
  switch (t) {
    case FLASHMSA_DTYPE_BF16: return "bf16";
    case FLASHMSA_DTYPE_FP16: return "fp16";
    case FLASHMSA_DTYPE_FP32: return "fp32";
    case FLASHMSA_DTYPE_FP64: return "fp64";
    case FLASHMSA_DTYPE_INT32: return "int32";
  }
  return "unknown";
}

int flashmsa_cuda_available(void) { return cuda::available() ? 1 : 0; }

const char* flashmsa_version(void) { return "0.1.0"; }

int flashmsa_abi_version(void) { return FLASHMSA_ABI_VERSION; }

size_t flashmsa_struct_size(flashmsa_struct_t which) {
  switch (which) {
    case FLASHMSA_STRUCT_TENSOR: return sizeof(flashmsa_tensor_t);
    case FLASHMSA_STRUCT_SELECT_ARGS: return sizeof(flashmsa_select_args_t);
    case FLASHMSA_STRUCT_FWD_ARGS: return sizeof(flashmsa_fwd_args_t);
    case FLASHMSA_STRUCT_BWD_ARGS: return sizeof(flashmsa_bwd_args_t);
  }
  return 0;
}

int flashmsa_abi_constant(const char* name, int64_t* value) {
  // FLASHMSA_MAX_SCALE is a double in the header; this table reports it as an integer, exactly.
  static_assert(double(int64_t(FLASHMSA_MAX_SCALE)) == FLASHMSA_MAX_SCALE, "FLASHMSA_MAX_SCALE is not integral");
  struct Constant {
    const char* name;
    int64_t value;
  };
#define FLASHMSA_CONSTANT(c) Constant{#c, static_cast<int64_t>(c)}
  static const Constant table[] = {
      FLASHMSA_CONSTANT(FLASHMSA_VERSION_MAJOR),
      FLASHMSA_CONSTANT(FLASHMSA_VERSION_MINOR),
      FLASHMSA_CONSTANT(FLASHMSA_VERSION_PATCH),
      FLASHMSA_CONSTANT(FLASHMSA_BLOCK_SIZE),
      FLASHMSA_CONSTANT(FLASHMSA_MAX_TOPK),
      FLASHMSA_CONSTANT(FLASHMSA_MAX_SCALE),
      FLASHMSA_CONSTANT(FLASHMSA_MAX_DIMS),
      // flashmsa_status_t
      FLASHMSA_CONSTANT(FLASHMSA_SUCCESS),
      FLASHMSA_CONSTANT(FLASHMSA_ERROR_INVALID_ARGUMENT),
      FLASHMSA_CONSTANT(FLASHMSA_ERROR_NOT_SUPPORTED),
      FLASHMSA_CONSTANT(FLASHMSA_ERROR_DEVICE),
      FLASHMSA_CONSTANT(FLASHMSA_ERROR_WORKSPACE),
      FLASHMSA_CONSTANT(FLASHMSA_ERROR_INTERNAL),
      // flashmsa_dtype_t
      FLASHMSA_CONSTANT(FLASHMSA_DTYPE_BF16),
      FLASHMSA_CONSTANT(FLASHMSA_DTYPE_FP16),
      FLASHMSA_CONSTANT(FLASHMSA_DTYPE_FP32),
      FLASHMSA_CONSTANT(FLASHMSA_DTYPE_FP64),
      FLASHMSA_CONSTANT(FLASHMSA_DTYPE_INT32),
      // flashmsa_device_type_t
      FLASHMSA_CONSTANT(FLASHMSA_DEVICE_CPU),
      FLASHMSA_CONSTANT(FLASHMSA_DEVICE_CUDA),
      // flashmsa_mode_t
      FLASHMSA_CONSTANT(FLASHMSA_MODE_SPARSE),
      FLASHMSA_CONSTANT(FLASHMSA_MODE_DENSE),
      FLASHMSA_CONSTANT(FLASHMSA_MODE_GIVEN),
      // flashmsa_numerics_t
      FLASHMSA_CONSTANT(FLASHMSA_NUMERICS_TRAIN),
      FLASHMSA_CONSTANT(FLASHMSA_NUMERICS_INFER),
      // flashmsa_selection_t
      FLASHMSA_CONSTANT(FLASHMSA_SELECTION_INPUT),
      FLASHMSA_CONSTANT(FLASHMSA_SELECTION_FP8),
      // metadata faults
      FLASHMSA_CONSTANT(FLASHMSA_STATUS_WORDS),
      FLASHMSA_CONSTANT(FLASHMSA_FAULT_FIRST_NOT_ZERO),
      FLASHMSA_CONSTANT(FLASHMSA_FAULT_NEGATIVE),
      FLASHMSA_CONSTANT(FLASHMSA_FAULT_DECREASING),
      FLASHMSA_CONSTANT(FLASHMSA_FAULT_ABOVE_TOTAL),
      FLASHMSA_CONSTANT(FLASHMSA_FAULT_LAST_NOT_TOTAL),
      FLASHMSA_CONSTANT(FLASHMSA_FAULT_ABOVE_MAX_SEQLEN), FLASHMSA_CONSTANT(FLASHMSA_FAULT_SEGMENTS),
      FLASHMSA_CONSTANT(FLASHMSA_FAULT_OP_SELECT),
      FLASHMSA_CONSTANT(FLASHMSA_FAULT_OP_FWD),
      FLASHMSA_CONSTANT(FLASHMSA_FAULT_OP_BWD),
      FLASHMSA_CONSTANT(FLASHMSA_CHECK_SYNC),
      FLASHMSA_CONSTANT(FLASHMSA_CHECK_RESET),
      // ABI
      FLASHMSA_CONSTANT(FLASHMSA_ABI_VERSION),
      FLASHMSA_CONSTANT(FLASHMSA_STRUCT_TENSOR),
      FLASHMSA_CONSTANT(FLASHMSA_STRUCT_SELECT_ARGS),
      FLASHMSA_CONSTANT(FLASHMSA_STRUCT_FWD_ARGS),
      FLASHMSA_CONSTANT(FLASHMSA_STRUCT_BWD_ARGS),
  };
#undef FLASHMSA_CONSTANT
  if (name == nullptr) return 0;
  for (const Constant& c : table)
    if (std::strcmp(c.name, name) == 0) {
      if (value) *value = c.value;
      return 1;
    }
  return 0;
}

}  // extern "C"
