// What the CUDA backend supports, in one place: every check that refuses a call with
// NOT_SUPPORTED (dtypes, head dims, strides and alignment, grid limits, the kl value's and the
// proxy gradient's head layouts) runs here, for the workspace queries and the calls alike, before
// anything is launched. Also the memory the status words may live in.
#include <algorithm>
#include <string>

#include "cuda/dispatch.h"
#include "cuda/tiles.h"

namespace flashmsa::cuda {

static_assert(kMaxTopk == FLASHMSA_MAX_TOPK && kBlockKeys == FLASHMSA_BLOCK_SIZE && kHeadDimInst == tiles::kHeadDim,
              "cuda/common/constants.h repeats flashmsa.h's limits and tiles.h's head dim");

static_assert(guard::kFirstNotZero == FLASHMSA_FAULT_FIRST_NOT_ZERO && guard::kNegative == FLASHMSA_FAULT_NEGATIVE &&
                  guard::kDecreasing == FLASHMSA_FAULT_DECREASING && guard::kAboveTotal == FLASHMSA_FAULT_ABOVE_TOTAL &&
                  guard::kLastNotTotal == FLASHMSA_FAULT_LAST_NOT_TOTAL &&
                  guard::kAboveMaxSeqlen == FLASHMSA_FAULT_ABOVE_MAX_SEQLEN && guard::kSegments == FLASHMSA_FAULT_SEGMENTS &&
                  guard::kWords == FLASHMSA_STATUS_WORDS &&
                  guard::kSelect == FLASHMSA_FAULT_OP_SELECT && guard::kFwd == FLASHMSA_FAULT_OP_FWD &&
                  guard::kBwd == FLASHMSA_FAULT_OP_BWD,
              "cuda/common/guard.cuh repeats flashmsa.h's status words");

void throw_cuda_error(cudaError_t err, const char* expr) {
  fail(FLASHMSA_ERROR_DEVICE, std::string("CUDA error: ") + cudaGetErrorString(err) + " at " + expr);
}

void unsupported(const char* fn, const std::string& what) {
  fail(FLASHMSA_ERROR_NOT_SUPPORTED, std::string(fn) + ": CUDA backend: " + what);
}

// Kernels load 16-byte chunks: base 16-byte aligned, token/head strides multiples of 8.
void check_aligned(const char* fn, const char* name, const flashmsa_tensor_t& t) {
  if (!present(t)) return;
  const bool base_ok = (reinterpret_cast<uintptr_t>(t.data) % 16) == 0;
  bool strides_ok = true;
  for (int d = 0; d + 1 < t.ndim; ++d) strides_ok = strides_ok && (t.strides[d] % 8 == 0 || t.shape[d] <= 1);
  if (!base_ok || !strides_ok)
    unsupported(fn, std::string(name) +
                        ": needs a 16-byte aligned base and token/head strides that are multiples "
                        "of 8 elements");
}

bool available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return n > 0;
}

void check_supported(const Geometry& g, const char* fn) {
  if (g.dtype != FLASHMSA_DTYPE_BF16 && g.dtype != FLASHMSA_DTYPE_FP16)
    unsupported(fn, std::string("inputs must be bf16 or fp16, got ") + flashmsa_dtype_name(g.dtype) +
                        " (fp32/fp64 run on the CPU backend)");
#ifdef FLASHMSA_NO_BF16
  if (g.dtype == FLASHMSA_DTYPE_BF16) unsupported(fn, "this build has no bf16 kernels (CMake FLASHMSA_KERNEL_DTYPES)");
#endif
#ifdef FLASHMSA_NO_FP16
  if (g.dtype == FLASHMSA_DTYPE_FP16) unsupported(fn, "this build has no fp16 kernels (CMake FLASHMSA_KERNEL_DTYPES)");
#endif
  if (g.D != 0 && g.D != tiles::kHeadDim && std::string(fn).find("select") == std::string::npos)
    unsupported(fn, "head dim D = " + std::to_string(g.D) + " is not instantiated (D = 128 is)");
  if (g.has_proxy && g.Dp != tiles::kHeadDim)
    unsupported(fn, "proxy head dim Dp = " + std::to_string(g.Dp) + " is not instantiated (Dp = 128 is)");
  if (g.batch > tiles::kMaxGridYZ)  // the kernels' grids have one z index per sequence
    unsupported(fn, "at most " + std::to_string(tiles::kMaxGridYZ) + " sequences per call, got " + std::to_string(g.batch));
  if (std::max({g.Hq, g.Hkv, g.Hp, g.Hpk}) > tiles::kMaxGridYZ)
    unsupported(fn, "at most " + std::to_string(tiles::kMaxGridYZ) + " heads of each kind");
  if (g.max_seqlen > tiles::kMaxSeqlen)
    unsupported(fn, "max_seqlen " + std::to_string(g.max_seqlen) + " exceeds " + std::to_string(tiles::kMaxSeqlen));
}

// What the CUDA kernels support beyond the spec's validation; called by the workspace queries
// and the calls alike, so both refuse before anything runs.
void fwd_features(const flashmsa_fwd_args_t& a, const Geometry& g) {
  const char* fn = "flashmsa_fwd";
  for (auto [name, t] : {std::pair{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"qp", &a.qp}, {"kp", &a.kp},
                         {"out", &a.out}, {"out_lo", &a.out_lo}})
    check_aligned(fn, name, *t);
  if (present(a.lse) && a.lse.dtype != FLASHMSA_DTYPE_FP32) unsupported(fn, "lse must be fp32");
  if (present(a.proxy_lse) && a.proxy_lse.dtype != FLASHMSA_DTYPE_FP32)
    unsupported(fn, "proxy_lse must be fp32");
  if (present(a.kl) && a.kl.dtype != FLASHMSA_DTYPE_FP32) unsupported(fn, "kl must be fp32");
  if (g.segmented && a.compute_kl && a.mode == FLASHMSA_MODE_DENSE)
    unsupported(fn, "the kl value of the warmup (DENSE) mode with query segments (cu_seqlens_q, q_origin) runs on the "
                    "CPU backend only so far (the sparse modes take segments on the GPU)");
  if (a.compute_kl) {
    if ((g.Hq / g.Hkv) % (g.Hq / g.Hp) != 0)
      unsupported(fn, "the kl value needs every MSA group inside one kv head (Hkv dividing Hp); got Hkv = " +
                          std::to_string(g.Hkv) + ", Hp = " + std::to_string(g.Hp) + " (use the CPU backend)");
    if (g.Hq / g.Hp > 64) unsupported(fn, "the kl value supports at most 64 query heads per proxy head");
  }
}

void bwd_features(const flashmsa_bwd_args_t& a, const Geometry& g) {
  const char* fn = "flashmsa_bwd";
  if (g.segmented && a.mode == FLASHMSA_MODE_DENSE)
    unsupported(fn, "the warmup (DENSE) mode with query segments (cu_seqlens_q, q_origin): the CUDA backward takes "
                    "segments in SPARSE and GIVEN mode only so far; the CPU backend takes both");
#ifdef FLASHMSA_NO_DETERMINISTIC
  if (a.deterministic)
    unsupported(fn, "this build has no deterministic backward (CMake FLASHMSA_KERNEL_DETERMINISTIC=OFF)");
#endif
  for (auto [name, t] : {std::pair{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"qp", &a.qp}, {"kp", &a.kp},
                         {"out", &a.out}, {"out_lo", &a.out_lo}, {"dout", &a.dout}, {"dq", &a.dq}, {"dk", &a.dk}, {"dv", &a.dv},
                         {"dqp", &a.dqp}, {"dkp", &a.dkp}})
    check_aligned(fn, name, *t);
  if (a.lse.dtype != FLASHMSA_DTYPE_FP32) unsupported(fn, "lse must be fp32");
  if (present(a.dlse) && a.dlse.dtype != FLASHMSA_DTYPE_FP32) unsupported(fn, "dlse must be fp32");
  if (present(a.dkl) && a.dkl.dtype != FLASHMSA_DTYPE_FP32) unsupported(fn, "dkl must be fp32");
  if (present(a.kl) && a.kl.dtype != FLASHMSA_DTYPE_FP32) unsupported(fn, "kl must be fp32");
  if (present(a.proxy_lse) && a.proxy_lse.dtype != FLASHMSA_DTYPE_FP32) unsupported(fn, "proxy_lse must be fp32");
  if (bwd_proxy_side(a, g)) {
    if ((g.Hq / g.Hkv) % (g.Hq / g.Hp) != 0)
      unsupported(fn, "the proxy gradient and the kl value need every MSA group inside one kv head (Hkv dividing Hp); got Hkv = " +
                          std::to_string(g.Hkv) + ", Hp = " + std::to_string(g.Hp) + " (use the CPU backend)");
    if (g.Hq / g.Hp > 64)
      unsupported(fn, "the proxy gradient and the kl value support at most 64 query heads per proxy head");
  }
}

namespace {
cudaPointerAttributes pointer_attributes(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();  // not a pointer CUDA knows
    attr.type = cudaMemoryTypeUnregistered;
  }
  return attr;
}
}  // namespace

void check_status_memory(const flashmsa_tensor_t& s, const Geometry& g, const char* fn) {
  const bool on_device = s.device_type == FLASHMSA_DEVICE_CUDA;
  auto usable = [&](const cudaPointerAttributes& attr) {
    return on_device ? attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged
                     : attr.type == cudaMemoryTypeHost && attr.devicePointer == s.data;
  };
  cudaPointerAttributes attr = pointer_attributes(s.data);
  if (!usable(attr)) {
    // The answer is the calling thread's current context's: a thread on which no CUDA call has bound one yet
    // sees no device address for page-locked memory (torch's autograd thread, when the backward of a zero-token
    // call launched nothing before flashmsa_bwd). cudaFree(nullptr) binds the current device's primary context
    // only where the thread has no context (a caller's own context stays current), as this call's own work would;
    // then ask again.
    if (cudaFree(nullptr) == cudaSuccess)
      attr = pointer_attributes(s.data);
    else
      cudaGetLastError();  // (the first answer stands)
  }
  const std::string what = std::string(fn) + ": status: ";
  if (on_device) {
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
      invalid(what + "device_type is CUDA, but the pointer is not CUDA device memory");
    if (g.device == FLASHMSA_DEVICE_CUDA && attr.device != g.device_id)
      invalid(what + "expected memory of CUDA device " + std::to_string(g.device_id) + " (the device of the call), got device " +
              std::to_string(attr.device));
  } else if (!usable(attr)) {
    invalid(what + "host memory that the device writes must be page-locked and mapped (cudaHostAlloc, or a torch "
                   "tensor with pin_memory=True); got pageable host memory");
  }
}

}  // namespace flashmsa::cuda
