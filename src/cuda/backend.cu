// CUDA backend (Hopper, sm_90a): feature checks, workspace sizes, and dispatch to the kernel
// instantiations (one per translation unit under select/ and fwd/).
#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "api/backends.hpp"
#include "api/data_checks.hpp"
#include "cuda/bwd/bwd_kernel.cuh"
#include "cuda/bwd/bwd_misc.cuh"
#include "cuda/bwd/kl_kernel.cuh"
#include "cuda/bwd/proxy_kernel.cuh"
#include "cuda/common/guard.cuh"
#include "cuda/fwd/fwd_kernel.cuh"
#include "cuda/select/select_kernel.cuh"

namespace flashmsa::cuda {

static_assert(kMaxTopk == FLASHMSA_MAX_TOPK && kSpecBlock == FLASHMSA_BLOCK_SIZE,
              "cuda/common/error.cuh repeats flashmsa.h's limits");

static_assert(guard::kFirstNotZero == FLASHMSA_FAULT_FIRST_NOT_ZERO && guard::kNegative == FLASHMSA_FAULT_NEGATIVE &&
                  guard::kDecreasing == FLASHMSA_FAULT_DECREASING && guard::kAboveTotal == FLASHMSA_FAULT_ABOVE_TOTAL &&
                  guard::kLastNotTotal == FLASHMSA_FAULT_LAST_NOT_TOTAL &&
                  guard::kAboveMaxSeqlen == FLASHMSA_FAULT_ABOVE_MAX_SEQLEN && guard::kWords == FLASHMSA_STATUS_WORDS &&
                  guard::kSelect == FLASHMSA_FAULT_OP_SELECT && guard::kFwd == FLASHMSA_FAULT_OP_FWD &&
                  guard::kBwd == FLASHMSA_FAULT_OP_BWD,
              "cuda/common/guard.cuh repeats flashmsa.h's status words");

void throw_cuda_error(cudaError_t err, const char* expr) {
  fail(FLASHMSA_ERROR_DEVICE, std::string("CUDA error: ") + cudaGetErrorString(err) + " at " + expr);
}

namespace selection {
extern template void launch<cutlass::bfloat16_t>(const Params<cutlass::bfloat16_t>&, cudaStream_t);
extern template void launch<cutlass::half_t>(const Params<cutlass::half_t>&, cudaStream_t);
}  // namespace selection
namespace attn_fwd {
extern template void launch<cutlass::bfloat16_t, false>(const Params<cutlass::bfloat16_t>&, cudaStream_t);
extern template void launch<cutlass::bfloat16_t, true>(const Params<cutlass::bfloat16_t>&, cudaStream_t);
extern template void launch<cutlass::half_t, false>(const Params<cutlass::half_t>&, cudaStream_t);
extern template void launch<cutlass::half_t, true>(const Params<cutlass::half_t>&, cudaStream_t);
}  // namespace attn_fwd
namespace attn_bwd {
// each kernel in a default and a deterministic (kDet) instantiation, one per translation unit
#define FLASHMSA_BWD_EXTERN(E, DET)                                                                \
  extern template void launch_main<E, DET>(const MainParams<E>&, int, cudaStream_t);              \
  extern template void launch_proxy<E, 16, DET>(const ProxyParams<E>&, cudaStream_t);             \
  extern template void launch_proxy<E, 64, DET>(const ProxyParams<E>&, cudaStream_t);             \
  extern template void launch_kl<E, DET>(const KlParams<E>&, cudaStream_t);
FLASHMSA_BWD_EXTERN(cutlass::bfloat16_t, false)
FLASHMSA_BWD_EXTERN(cutlass::bfloat16_t, true)
FLASHMSA_BWD_EXTERN(cutlass::half_t, false)
FLASHMSA_BWD_EXTERN(cutlass::half_t, true)
#undef FLASHMSA_BWD_EXTERN

// The default or the deterministic instantiation, by whether the parameters carry turn counters
// (both kinds or none: one without the other would order only half of the adds).
inline bool deterministic(const Common& c) {
  if (!c.turn_rows != !c.turn_keys)
    fail(FLASHMSA_ERROR_INTERNAL, "flashmsa_bwd: CUDA backend: turn counters for rows and keys must come together");
  return c.turn_rows != nullptr;
}
template <class Element>
void launch_main(const MainParams<Element>& p, int units, cudaStream_t st) {
  if (deterministic(p.c)) launch_main<Element, true>(p, units, st);
  else launch_main<Element, false>(p, units, st);
}
template <class Element, int kTok>
void launch_proxy(const ProxyParams<Element>& p, cudaStream_t st) {
  if (deterministic(p.c)) launch_proxy<Element, kTok, true>(p, st);
  else launch_proxy<Element, kTok, false>(p, st);
}
template <class Element>
void launch_kl(const KlParams<Element>& p, cudaStream_t st) {
  if (deterministic(p.c)) launch_kl<Element, true>(p, st);
  else launch_kl<Element, false>(p, st);
}
}  // namespace attn_bwd

namespace {

constexpr int kHeadDim = 128;
constexpr int64_t kMaxSeqlen = int64_t(attn_fwd::kMaxBlocks) * FLASHMSA_BLOCK_SIZE;
constexpr int kMaxGridZ = 65535;  // CUDA's limit of gridDim.y and gridDim.z

[[noreturn]] void unsupported(const char* fn, const std::string& what) {
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

// Heads per tile: R = gcd(Hq/Hp, Hq/Hkv), reduced to a divisor <= 128; tokens per tile NT.
void tile_shape(const Geometry& g, int& R, int& NT) {
  R = std::gcd(g.Hq / g.Hp, g.Hq / g.Hkv);
  while (R > 128) {
    int d = 128;
    while (R % d) --d;
    R = d;
  }
  NT = 128 / R;
  if (g.topk > 0) NT = std::min(NT, attn_fwd::kMaxUnion / g.topk);
}

template <class T>
TokenTensor<T> token_tensor(const flashmsa_tensor_t& t, const Geometry& g) {
  const TokenLayout l = token_layout(t, g);
  TokenTensor<T> r;
  r.ptr = static_cast<T*>(t.data);
  r.tok = l.tok;
  r.head = l.head;
  r.batch_corr = l.batch_corr;
  return r;
}

template <class T>
HeadTensor<T> head_tensor(const flashmsa_tensor_t& t) {
  HeadTensor<T> r;
  if (!present(t)) return r;
  r.ptr = static_cast<T*>(t.data);
  r.head = t.strides[0];
  r.tok = t.strides[1];
  return r;
}

Seqs seqs_of(const flashmsa_tensor_t& cu, const Geometry& g) {
  Seqs s;
  s.cu_seqlens = g.batched ? nullptr : static_cast<const int*>(cu.data);
  s.seqlen = g.seqlen;
  s.batch = g.batch;
  return s;
}

// Opt-in data validation: copy cu_seqlens (and indices) to the host and check them.
std::vector<int64_t> validate_offsets(const flashmsa_tensor_t& cu, const Geometry& g, cudaStream_t st,
                                      const char* fn) {
  std::vector<int32_t> host;
  if (!g.batched) {
    host.resize(size_t(g.batch) + 1);
    for (int b = 0; b <= g.batch; ++b)
      FLASHMSA_CUDA_CHECK(cudaMemcpyAsync(&host[size_t(b)], static_cast<const int32_t*>(cu.data) + b * cu.strides[0],
                                          4, cudaMemcpyDeviceToHost, st));
    FLASHMSA_CUDA_CHECK(cudaStreamSynchronize(st));
  }
  return checked_offsets(host.data(), 1, g, fn);
}

void validate_indices(const flashmsa_tensor_t& t, const std::vector<int64_t>& cu, const Geometry& g,
                      cudaStream_t st, const char* fn) {
  std::vector<int32_t> host(size_t(g.Hp) * g.total * g.topk);
  for (int h = 0; h < g.Hp; ++h)
    FLASHMSA_CUDA_CHECK(cudaMemcpy2DAsync(host.data() + size_t(h) * g.total * g.topk, size_t(g.topk) * 4,
                                          static_cast<const int32_t*>(t.data) + h * t.strides[0],
                                          size_t(t.strides[1]) * 4, size_t(g.topk) * 4, size_t(g.total),
                                          cudaMemcpyDeviceToHost, st));
  FLASHMSA_CUDA_CHECK(cudaStreamSynchronize(st));
  check_index_rows(host, cu, g.Hp, g.total, g.topk, true, fn);
}

size_t align_up(size_t n) { return (n + 255) & ~size_t(255); }

// ---- the metadata guard (cuda/common/guard.cuh) ----
// Varlen calls start with the check of cu_seqlens (workspace in front of each call's layout) and
// end with the poison kernel; every kernel in between reads the safe copy of cu_seqlens.
size_t guard_bytes(const Geometry& g) { return g.batched ? 0 : guard::workspace(g.batch); }

struct Guard {
  flashmsa_tensor_t cu{};  // what the kernels read: the safe copy (varlen), absent (batched)
  guard::PoisonArgs outs;  // what the poison kernel fills on a fault
  bool on = false;
};

Guard start_guard(const flashmsa_tensor_t& cu, const flashmsa_tensor_t& status, const Geometry& g, int32_t op,
                  void* ws, cudaStream_t st) {
  Guard r;
  r.cu = cu;
  if (g.batched) return r;
  guard::CheckArgs c;
  c.cu = static_cast<const int32_t*>(cu.data);
  c.cu_stride = cu.strides[0];
  c.batch = g.batch;
  c.total = g.total;
  c.max_seqlen = g.max_seqlen;
  c.status = present(status) ? static_cast<int32_t*>(status.data) : nullptr;
  c.op = op;
  r.cu.data = const_cast<int32_t*>(guard::launch_check(c, ws, st));
  r.cu.strides[0] = 1;
  r.outs.fault = guard::fault_word(ws);
  r.on = true;
  return r;
}

// Adds an output (rank 0 to 3, last dimension contiguous: validated) to the poison list.
void poison(Guard& r, const flashmsa_tensor_t& t) {
  if (!r.on || !present(t) || t.data == nullptr || t.ndim > 3) return;
  guard::Out o;
  o.ptr = t.data;
  if (t.ndim >= 1) o.n0 = t.shape[0], o.s0 = t.strides[0];
  if (t.ndim >= 2) o.n1 = t.shape[1], o.s1 = t.strides[1];
  if (t.ndim == 3) o.n2 = t.shape[2];
  switch (t.dtype) {
    case FLASHMSA_DTYPE_BF16: o.bytes = 2; o.pattern = guard::kNanBf16; break;
    case FLASHMSA_DTYPE_FP16: o.bytes = 2; o.pattern = guard::kNanFp16; break;
    case FLASHMSA_DTYPE_INT32: o.bytes = 4; o.pattern = guard::kPoisonIndex; break;
    default: o.bytes = 4; o.pattern = guard::kNanFp32; break;
  }
  r.outs.add(o);
}

void finish_guard(const Guard& r, cudaStream_t st) {
  if (r.on) guard::launch_poison(r.outs, st);
}

}  // namespace

void check_status_memory(const flashmsa_tensor_t& s, const Geometry& g, const char* fn) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, s.data) != cudaSuccess) {
    cudaGetLastError();  // not a pointer CUDA knows
    attr.type = cudaMemoryTypeUnregistered;
  }
  const std::string what = std::string(fn) + ": status: ";
  if (s.device_type == FLASHMSA_DEVICE_CUDA) {
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
      invalid(what + "device_type is CUDA, but the pointer is not CUDA device memory");
    if (g.device == FLASHMSA_DEVICE_CUDA && attr.device != g.device_id)
      invalid(what + "expected memory of CUDA device " + std::to_string(g.device_id) + " (the device of the call), got device " +
              std::to_string(attr.device));
  } else if (attr.type != cudaMemoryTypeHost || attr.devicePointer != s.data) {
    invalid(what + "host memory that the device writes must be page-locked and mapped (cudaHostAlloc, or a torch "
                   "tensor with pin_memory=True); got pageable host memory");
  }
}

void read_status(const flashmsa_tensor_t& s, void* stream, int32_t flags, int32_t* w) {
  auto st = static_cast<cudaStream_t>(stream);
  const size_t bytes = sizeof(int32_t) * FLASHMSA_STATUS_WORDS;
  if (s.device_type == FLASHMSA_DEVICE_CUDA) {
    FLASHMSA_CUDA_CHECK(cudaMemcpyAsync(w, s.data, bytes, cudaMemcpyDeviceToHost, st));
    if (flags & FLASHMSA_CHECK_RESET) FLASHMSA_CUDA_CHECK(cudaMemsetAsync(s.data, 0, bytes, st));
    FLASHMSA_CUDA_CHECK(cudaStreamSynchronize(st));
    return;
  }
  if (flags & FLASHMSA_CHECK_SYNC) FLASHMSA_CUDA_CHECK(cudaStreamSynchronize(st));
  volatile int32_t* h = static_cast<int32_t*>(s.data);
  for (int i = 0; i < FLASHMSA_STATUS_WORDS; ++i) w[i] = h[i];
  if (flags & FLASHMSA_CHECK_RESET)
    for (int i = 0; i < FLASHMSA_STATUS_WORDS; ++i) h[i] = 0;
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
  if (g.D != 0 && g.D != kHeadDim && std::string(fn).find("select") == std::string::npos)
    unsupported(fn, "head dim D = " + std::to_string(g.D) + " is not instantiated (D = 128 is)");
  if (g.has_proxy && g.Dp != kHeadDim)
    unsupported(fn, "proxy head dim Dp = " + std::to_string(g.Dp) + " is not instantiated (Dp = 128 is)");
  if (g.batch > kMaxGridZ)  // the kernels' grids have one z index per sequence
    unsupported(fn, "at most " + std::to_string(kMaxGridZ) + " sequences per call, got " + std::to_string(g.batch));
  if (std::max({g.Hq, g.Hkv, g.Hp, g.Hpk}) > kMaxGridZ)
    unsupported(fn, "at most " + std::to_string(kMaxGridZ) + " heads of each kind");
  if (g.max_seqlen > kMaxSeqlen)
    unsupported(fn, "max_seqlen " + std::to_string(g.max_seqlen) + " exceeds " + std::to_string(kMaxSeqlen));
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
  if (a.compute_kl) {
    if ((g.Hq / g.Hkv) % (g.Hq / g.Hp) != 0)
      unsupported(fn, "the kl value needs every MSA group inside one kv head (Hkv dividing Hp); got Hkv = " +
                          std::to_string(g.Hkv) + ", Hp = " + std::to_string(g.Hp) + " (use the CPU backend)");
    if (g.Hq / g.Hp > 64) unsupported(fn, "the kl value supports at most 64 query heads per proxy head");
  }
}

void bwd_features(const flashmsa_bwd_args_t& a, const Geometry& g) {
  const char* fn = "flashmsa_bwd";
  for (auto [name, t] : {std::pair{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"qp", &a.qp}, {"kp", &a.kp},
                         {"out", &a.out}, {"out_lo", &a.out_lo}, {"dout", &a.dout}, {"dq", &a.dq}, {"dk", &a.dk}, {"dv", &a.dv},
                         {"dqp", &a.dqp}, {"dkp", &a.dkp}})
    check_aligned(fn, name, *t);
  if (a.lse.dtype != FLASHMSA_DTYPE_FP32) unsupported(fn, "lse must be fp32");
  if (present(a.dlse) && a.dlse.dtype != FLASHMSA_DTYPE_FP32) unsupported(fn, "dlse must be fp32");
  if (present(a.dkl) && a.dkl.dtype != FLASHMSA_DTYPE_FP32) unsupported(fn, "dkl must be fp32");
  if (present(a.proxy_lse) && a.proxy_lse.dtype != FLASHMSA_DTYPE_FP32) unsupported(fn, "proxy_lse must be fp32");
  if (g.has_proxy && present(a.dkl)) {
    if ((g.Hq / g.Hkv) % (g.Hq / g.Hp) != 0)
      unsupported(fn, "the proxy gradient needs every MSA group inside one kv head (Hkv dividing Hp); got Hkv = " +
                          std::to_string(g.Hkv) + ", Hp = " + std::to_string(g.Hp) + " (use the CPU backend)");
    if (g.Hq / g.Hp > 64) unsupported(fn, "the proxy gradient supports at most 64 query heads per proxy head");
  }
}

size_t select_workspace(const flashmsa_select_args_t&, const Geometry& g) { return guard_bytes(g); }

namespace {

// Heads per unit of the main backward: R = gcd(Hq/Hp, Hq/Hkv) reduced to a divisor <= 64.
int bwd_unit_heads(const Geometry& g) {
  int R = std::gcd(g.Hq / g.Hp, g.Hq / g.Hkv);
  while (R > 64) {
    int d = 64;
    while (R % d) --d;
    R = d;
  }
  return R;
}

int global_blocks_bound(const Geometry& g) { return int(g.total / 128 + g.batch + 1); }

// Head slots per token in the main backward's chunks: R rounded up to a power of two.
int head_slots(int R) {
  int Rp = 1;
  while (Rp < R) Rp *= 2;
  return Rp;
}

// The teacher buffer of the kl kernel: one fp32 row of 128 keys per inversion entry (at most
// topk entries per proxy head and token). SPARSE/GIVEN only: in DENSE mode the recomputing proxy
// kernel runs instead (the buffer would hold every causal pair).
size_t teacher_bytes(const Geometry& g) { return size_t(g.Hp) * size_t(g.total) * size_t(g.topk) * 128 * 4; }

attn_bwd::InversionArgs inversion_args(const int32_t* idx, int64_t idx_head, int64_t idx_tok,
                                       const flashmsa_tensor_t& cu, const Geometry& g) {
  attn_bwd::InversionArgs ia;
  ia.indices.ptr = idx;
  ia.indices.head = idx_head;
  ia.indices.tok = idx_tok;
  ia.seqs = seqs_of(cu, g);
  ia.Hp = g.Hp;
  ia.topk = g.topk;
  ia.total = g.total;
  ia.nblk = global_blocks_bound(g);
  return ia;
}

attn_bwd::InversionArgs inversion_args(const flashmsa_bwd_args_t& a, const Geometry& g) {
  return inversion_args(static_cast<const int32_t*>(a.indices.data), a.indices.strides[0], a.indices.strides[1],
                        a.cu_seqlens, g);
}

// Workspace of the backward, in order: lse2, dsum (padded), dq/dk/dv/dqp/dkp accumulators,
// then the inversion (or the block offsets in dense mode).
struct BwdLayout {
  size_t lse2 = 0, dsum = 0, dq = 0, dk = 0, dv = 0, dqp = 0, dkp = 0, inv = 0, plse = 0, kl = 0, teach = 0,
         total = 0;
  size_t turn_q = 0, turn_kv = 0, turn_qp = 0, turn_kp = 0;  // deterministic mode's turn counters
  bool deterministic = false;
  int64_t padded = 0;
  bool has_teacher = false;
};

BwdLayout bwd_layout(const flashmsa_bwd_args_t& a, const Geometry& g) {
  BwdLayout l;
  l.padded = padded_total(g.total, g.batch, attn_bwd::kPadTile);
  size_t off = 0;
  auto take = [&](size_t bytes) { const size_t o = off; off += align_up(bytes); return o; };
  l.lse2 = take(size_t(g.Hq) * l.padded * 4);
  l.dsum = take(size_t(g.Hq) * l.padded * 4);
  l.dq = take(size_t(g.total) * g.Hq * kHeadDim * 4);
  l.dk = take(size_t(g.total) * g.Hkv * kHeadDim * 4);
  l.dv = take(size_t(g.total) * g.Hkv * kHeadDim * 4);
  if (g.has_proxy) {
    l.dqp = take(size_t(g.total) * g.Hp * kHeadDim * 4);
    l.dkp = take(size_t(g.total) * g.Hpk * kHeadDim * 4);
  }
  if (a.deterministic) {  // zeroed with the accumulators (the range [dq, inv))
    l.deterministic = true;
    l.turn_q = take(size_t(g.total) * size_t(g.Hq / bwd_unit_heads(g)) * 4);
    l.turn_kv = take(size_t(global_blocks_bound(g)) * g.Hkv * 4);
    l.turn_qp = take(size_t(g.total) * g.Hp * 4);
    l.turn_kp = take(size_t(global_blocks_bound(g)) * g.Hpk * 4);
  }
  l.inv = take(a.mode == FLASHMSA_MODE_DENSE ? attn_bwd::blk_off_workspace(g.batch)
                                             : attn_bwd::inversion_workspace(inversion_args(a, g)));
  if (g.has_proxy && present(a.dkl)) {
    l.plse = take(size_t(g.Hp) * g.total * 4);
    l.kl = take(size_t(g.Hp) * global_blocks_bound(g) * 4);
    if (a.mode != FLASHMSA_MODE_DENSE) {
      l.teach = take(teacher_bytes(g));
      l.has_teacher = true;
    }
  }
  l.total = off;
  return l;
}

}  // namespace

size_t bwd_workspace(const flashmsa_bwd_args_t& a, const Geometry& g) {
  bwd_features(a, g);
  return guard_bytes(g) + (g.total == 0 ? 0 : bwd_layout(a, g).total);
}

namespace {

// Selection (lse_mode kSelect) or the proxy lse alone over every causal key (kDenseLse) or over
// given blocks (kGivenLse, indices read from `given`).
template <class Element>
void run_select_t(const flashmsa_tensor_t& qp, const flashmsa_tensor_t& kp, const flashmsa_tensor_t& cu,
                  const Geometry& g, int32_t* indices, int64_t idx_head, int64_t idx_tok,
                  HeadTensor<float> proxy_lse, cudaStream_t st, int lse_mode = selection::kSelect,
                  HeadTensor<const int32_t> given = {}) {
  using P = selection::Params<Element>;
  P p;
  p.qp = token_tensor<const void>(qp, g);
  p.kp = token_tensor<const void>(kp, g);
  const auto t = make_block_load<Element, typename P::StageLayout>(p.kp, g.Hpk, g.batched, g.seqlen, g.batch, g.total);
  p.tma_kp = t.copy;
  p.tma_shape_kp = t.shape;
  p.batched = g.batched;
  p.seqs = seqs_of(cu, g);
  p.Hp = g.Hp;
  p.Hpk = g.Hpk;
  p.topk = g.topk;
  p.proxy_scale = float(g.proxy_scale);
  p.indices.ptr = indices;
  p.indices.head = idx_head;
  p.indices.tok = idx_tok;
  p.proxy_lse = proxy_lse;
  p.num_m_blocks = int((g.max_seqlen + 127) / 128);
  p.lse_mode = lse_mode;
  p.given = given;
  selection::launch<Element>(p, st);
}

void run_select(const flashmsa_tensor_t& qp, const flashmsa_tensor_t& kp, const flashmsa_tensor_t& cu,
                const Geometry& g, int32_t* indices, int64_t idx_head, int64_t idx_tok,
                const flashmsa_tensor_t& proxy_lse, cudaStream_t st) {
  if (g.dtype == FLASHMSA_DTYPE_BF16)
    run_select_t<cutlass::bfloat16_t>(qp, kp, cu, g, indices, idx_head, idx_tok, head_tensor<float>(proxy_lse), st);
  else
    run_select_t<cutlass::half_t>(qp, kp, cu, g, indices, idx_head, idx_tok, head_tensor<float>(proxy_lse), st);
}

template <class Element>
void run_fwd(const flashmsa_fwd_args_t& a, const Geometry& g, const int32_t* idx, int64_t idx_head,
             int64_t idx_tok, cudaStream_t st) {
  using P = attn_fwd::Params<Element>;
  using Stage = typename P::StageLayout;
  P p;
  p.q = token_tensor<const void>(a.q, g);
  p.k = token_tensor<const void>(a.k, g);
  p.v = token_tensor<const void>(a.v, g);
  const auto tk = make_block_load<Element, Stage>(p.k, g.Hkv, g.batched, g.seqlen, g.batch, g.total);
  const auto tv = make_block_load<Element, Stage>(p.v, g.Hkv, g.batched, g.seqlen, g.batch, g.total);
  p.tma_k = tk.copy;
  p.tma_v = tv.copy;
  p.tma_shape_k = tk.shape;
  p.batched = g.batched;
  p.out = token_tensor<void>(a.out, g);
  if (present(a.out_lo)) p.out_lo = token_tensor<void>(a.out_lo, g);
  p.lse = head_tensor<float>(a.lse);
  p.indices.ptr = idx;
  p.indices.head = idx_head;
  p.indices.tok = idx_tok;
  p.seqs = seqs_of(a.cu_seqlens, g);
  p.Hq = g.Hq;
  p.Hkv = g.Hkv;
  p.Hp = g.Hp;
  p.topk = a.mode == FLASHMSA_MODE_DENSE ? 0 : g.topk;
  Geometry gt = g;
  gt.topk = p.topk;
  tile_shape(gt, p.R, p.NT);
  p.scale = float(g.scale);
  p.num_m_tiles = int((g.max_seqlen + p.NT - 1) / p.NT);
  if (a.numerics == FLASHMSA_NUMERICS_INFER) attn_fwd::launch<Element, true>(p, st);
  else attn_fwd::launch<Element, false>(p, st);
}

}  // namespace

void select(const flashmsa_select_args_t& a, const Geometry& g, void* ws, size_t) {
  const char* fn = "flashmsa_select";
  check_aligned(fn, "qp", a.qp);
  check_aligned(fn, "kp", a.kp);
  if (present(a.proxy_lse) && a.proxy_lse.dtype != FLASHMSA_DTYPE_FP32)
    unsupported(fn, "proxy_lse must be fp32");
  auto st = static_cast<cudaStream_t>(a.stream);
  Guard gd = start_guard(a.cu_seqlens, a.status, g, guard::kSelect, ws, st);
  if (g.total == 0) return;
  run_select(a.qp, a.kp, gd.cu, g, static_cast<int32_t*>(a.indices.data), a.indices.strides[0],
             a.indices.strides[1], a.proxy_lse, st);
  poison(gd, a.indices);
  poison(gd, a.proxy_lse);
  finish_guard(gd, st);
}

namespace {

// What the backward's kernels and the forward's kl share: q, k, the padded lse2, the sequences,
// the inversion (or the block offsets in dense mode), heads and scales.
attn_bwd::Common common_base(const Geometry& g, const flashmsa_tensor_t& q, const flashmsa_tensor_t& k,
                             const flashmsa_tensor_t& cu, float* lse2, int64_t padded, bool dense,
                             const int32_t* idx, int64_t idx_head, int64_t idx_tok, char* inv_ws,
                             cudaStream_t st, bool ranks = false) {
  attn_bwd::Common c;
  c.q = token_tensor<const void>(q, g);
  c.k = token_tensor<const void>(k, g);
  c.lse2.ptr = lse2;
  c.lse2.head = padded;
  c.lse2.tok = 1;
  c.seqs = seqs_of(cu, g);
  c.dense = dense;
  if (dense) {
    c.inv.blk_off = attn_bwd::build_blk_off(c.seqs, inv_ws, st);
    c.inv.nblk = global_blocks_bound(g);
  } else {
    attn_bwd::InversionArgs ia = inversion_args(idx, idx_head, idx_tok, cu, g);
    ia.ranks = ranks;
    c.inv = attn_bwd::build_inversion(ia, inv_ws, st);
  }
  c.Hq = g.Hq;
  c.Hkv = g.Hkv;
  c.Hp = g.Hp;
  c.Hpk = g.Hpk;
  c.scale = float(g.scale);
  c.proxy_scale = float(g.proxy_scale);
  c.total = g.total;
  return c;
}

// The proxy kernel: gradients (backward) or the kl value alone (forward's compute_kl).
struct ProxyRun {
  const flashmsa_tensor_t *qp = nullptr, *kp = nullptr, *cu = nullptr, *indices = nullptr, *proxy_lse = nullptr;
  float* plse_ws = nullptr;  // [Hp, total] when proxy_lse is absent
  float *dqp_acc = nullptr, *dkp_acc = nullptr, *kl_acc = nullptr;
  const float* dkl = nullptr;
  bool grads = true;
};

// The proxy lse the kl needs: the given tensor, or recomputed over the same sets into workspace.
template <class Element>
HeadTensor<float> proxy_lse_for_kl(const Geometry& g, const attn_bwd::Common& c, const ProxyRun& r, cudaStream_t st) {
  HeadTensor<float> plse;
  if (present(*r.proxy_lse)) {
    plse = head_tensor<float>(*r.proxy_lse);
  } else {  // the proxy lse over the same sets
    plse.ptr = r.plse_ws;
    plse.head = g.total;
    plse.tok = 1;
    HeadTensor<const int32_t> given;
    if (!c.dense) {
      given.ptr = static_cast<const int32_t*>(r.indices->data);
      given.head = r.indices->strides[0];
      given.tok = r.indices->strides[1];
    }
    run_select_t<Element>(*r.qp, *r.kp, *r.cu, g, nullptr, 0, 0, plse, st,
                          c.dense ? selection::kDenseLse : selection::kGivenLse, given);
  }
  return plse;
}

// The shared parameters plus the proxy side's: qp, kp, the proxy lse (given or recomputed), the
// dqp/dkp/kl accumulators and the kl gradient.
template <class Element>
attn_bwd::Common proxy_common(const Geometry& g, const attn_bwd::Common& c, const ProxyRun& r, cudaStream_t st) {
  const HeadTensor<float> plse = proxy_lse_for_kl<Element>(g, c, r, st);
  attn_bwd::Common pc = c;
  pc.qp = token_tensor<const void>(*r.qp, g);
  pc.kp = token_tensor<const void>(*r.kp, g);
  pc.plse.ptr = plse.ptr;
  pc.plse.head = plse.head;
  pc.plse.tok = plse.tok;
  pc.dqp_acc = r.dqp_acc;
  pc.dkp_acc = r.dkp_acc;
  pc.kl_acc = r.kl_acc;
  pc.dkl = r.dkl;
  return pc;
}

// The recomputing proxy kernel (DENSE mode): the teacher from the group's S^T, chunk by chunk.
template <class Element, class TmaK>
void run_proxy(const Geometry& g, const attn_bwd::Common& c, const TmaK& tma_k, const TmaShape& tma_shape_k,
               const ProxyRun& r, cudaStream_t st) {
  using PP = attn_bwd::ProxyParams<Element>;
  PP pp;
  pp.c = proxy_common<Element>(g, c, r, st);
  pp.G = g.Hq / g.Hp;
  pp.grads = r.grads;
  const auto tkp = make_block_load<Element, typename PP::StageLayout>(pp.c.kp, g.Hpk, g.batched, g.seqlen, g.batch, g.total);
  pp.tma_k = tma_k;
  pp.tma_shape_k = tma_shape_k;
  pp.tma_kp = tkp.copy;
  pp.tma_shape_kp = tkp.shape;
  pp.batched = g.batched;
  if (64 / pp.G <= 16) attn_bwd::launch_proxy<Element, 16>(pp, st);
  else attn_bwd::launch_proxy<Element, 64>(pp, st);
}

// The kl kernel (SPARSE/GIVEN): the proxy side only, the teacher read from the main backward's buffer.
template <class Element>
void run_kl(const Geometry& g, const attn_bwd::Common& c, const float* teacher, const ProxyRun& r, cudaStream_t st) {
  attn_bwd::KlParams<Element> kp;
  kp.c = proxy_common<Element>(g, c, r, st);
  kp.teacher = teacher;
  kp.grads = r.grads;
  const auto tkp = make_block_load<Element, typename attn_bwd::KlParams<Element>::StageLayout>(
      kp.c.kp, g.Hpk, g.batched, g.seqlen, g.batch, g.total);
  kp.tma_kp = tkp.copy;
  kp.tma_shape_kp = tkp.shape;
  kp.batched = g.batched;
  attn_bwd::launch_kl<Element>(kp, st);
}

template <class Element>
void run_bwd(const flashmsa_bwd_args_t& a, const Geometry& g, char* ws, const BwdLayout& l, cudaStream_t st) {
  const Seqs seqs = seqs_of(a.cu_seqlens, g);
  float* dq_acc = reinterpret_cast<float*>(ws + l.dq);
  float* dk_acc = reinterpret_cast<float*>(ws + l.dk);
  float* dv_acc = reinterpret_cast<float*>(ws + l.dv);
  // the accumulators start at zero (this launch initialises them; nothing else does)
  FLASHMSA_CUDA_CHECK(cudaMemsetAsync(ws + l.dq, 0, l.inv - l.dq, st));

  attn_bwd::PreprocessArgs pa;
  pa.out = token_tensor<const void>(a.out, g);
  if (present(a.out_lo)) pa.out_lo = token_tensor<const void>(a.out_lo, g);
  pa.dout = token_tensor<const void>(a.dout, g);
  pa.lse = head_tensor<const float>(a.lse);
  pa.dlse = head_tensor<const float>(a.dlse);
  pa.seqs = seqs;
  pa.Hq = g.Hq;
  pa.max_seqlen = g.max_seqlen;
  pa.lse2 = reinterpret_cast<float*>(ws + l.lse2);
  pa.dsum = reinterpret_cast<float*>(ws + l.dsum);
  pa.padded_stride = l.padded;
  attn_bwd::launch_preprocess<Element>(pa, st);

  using P = attn_bwd::MainParams<Element>;
  P mp;
  attn_bwd::Common& c = mp.c;
  c = common_base(g, a.q, a.k, a.cu_seqlens, pa.lse2, l.padded, a.mode == FLASHMSA_MODE_DENSE,
                  static_cast<const int32_t*>(a.indices.data), a.indices.strides[0], a.indices.strides[1],
                  ws + l.inv, st, l.deterministic);
  c.v = token_tensor<const void>(a.v, g);
  c.dout = token_tensor<const void>(a.dout, g);
  c.dsum.ptr = pa.dsum;
  c.dsum.head = l.padded;
  c.dsum.tok = 1;
  c.R = bwd_unit_heads(g);
  c.dq_acc = dq_acc;
  c.dk_acc = dk_acc;
  c.dv_acc = dv_acc;
  if (l.deterministic) {
    c.turn_rows = reinterpret_cast<int32_t*>(ws + l.turn_q);
    c.turn_keys = reinterpret_cast<int32_t*>(ws + l.turn_kv);
  }
  const auto tk = make_block_load<Element, typename P::StageLayout>(c.k, g.Hkv, g.batched, g.seqlen, g.batch, g.total);
  const auto tv = make_block_load<Element, typename P::StageLayout>(c.v, g.Hkv, g.batched, g.seqlen, g.batch, g.total);
  mp.tma_k = tk.copy;
  mp.tma_v = tv.copy;
  mp.tma_shape = tk.shape;
  mp.batched = g.batched;
  mp.Rp = head_slots(c.R);
  mp.log_rp = __builtin_ctz(unsigned(mp.Rp));
  if (l.has_teacher) mp.teacher = reinterpret_cast<float*>(ws + l.teach);  // R = G here (bwd_features)
  attn_bwd::launch_main<Element>(mp, g.Hq / c.R, st);

  attn_bwd::launch_convert<Element>(dq_acc, token_tensor<void>(a.dq, g), seqs, g.max_seqlen, g.Hq, float(g.scale), st);
  attn_bwd::launch_convert<Element>(dk_acc, token_tensor<void>(a.dk, g), seqs, g.max_seqlen, g.Hkv, float(g.scale), st);
  attn_bwd::launch_convert<Element>(dv_acc, token_tensor<void>(a.dv, g), seqs, g.max_seqlen, g.Hkv, 1.f, st);
  if (g.has_proxy) {
    float pscale = 1.f;
    if (present(a.dkl)) {  // the proxy gradient; without dkl the accumulators stay zero
      pscale = float(g.proxy_scale / (double(g.Hp) * double(g.total)));  // dz was kept N times larger
      ProxyRun r;
      r.qp = &a.qp;
      r.kp = &a.kp;
      r.cu = &a.cu_seqlens;
      r.indices = &a.indices;
      r.proxy_lse = &a.proxy_lse;
      r.plse_ws = reinterpret_cast<float*>(ws + l.plse);
      r.dqp_acc = reinterpret_cast<float*>(ws + l.dqp);
      r.dkp_acc = reinterpret_cast<float*>(ws + l.dkp);
      r.kl_acc = reinterpret_cast<float*>(ws + l.kl);
      r.dkl = static_cast<const float*>(a.dkl.data);
      r.grads = true;
      attn_bwd::Common cp = c;  // the proxy side's own turn counters
      cp.turn_rows = l.deterministic ? reinterpret_cast<int32_t*>(ws + l.turn_qp) : nullptr;
      cp.turn_keys = l.deterministic ? reinterpret_cast<int32_t*>(ws + l.turn_kp) : nullptr;
      if (l.has_teacher) run_kl<Element>(g, cp, mp.teacher, r, st);
      else run_proxy<Element>(g, cp, mp.tma_k, mp.tma_shape, r, st);
    }
    attn_bwd::launch_convert<Element>(reinterpret_cast<float*>(ws + l.dqp), token_tensor<void>(a.dqp, g), seqs,
                                      g.max_seqlen, g.Hp, pscale, st);
    attn_bwd::launch_convert<Element>(reinterpret_cast<float*>(ws + l.dkp), token_tensor<void>(a.dkp, g), seqs,
                                      g.max_seqlen, g.Hpk, pscale, st);
  }
}

}  // namespace

namespace {

// Workspace of the forward: the indices (SPARSE without an indices output), then for compute_kl
// the padded lse2, the inversion, the proxy lse (when not an output) and the kl partials.
struct FwdLayout {
  size_t idx = 0, lse2 = 0, inv = 0, plse = 0, kl = 0, teach = 0, total = 0;
  int64_t padded = 0;
  bool has_teacher = false;
};

FwdLayout fwd_layout(const flashmsa_fwd_args_t& a, const Geometry& g) {
  FwdLayout l;
  size_t off = 0;
  auto take = [&](size_t bytes) { const size_t o = off; off += align_up(bytes); return o; };
  if (a.mode == FLASHMSA_MODE_SPARSE && !present(a.indices)) l.idx = take(size_t(g.Hp) * g.total * g.topk * 4);
  if (a.compute_kl) {
    l.padded = padded_total(g.total, g.batch, attn_bwd::kPadTile);
    l.lse2 = take(size_t(g.Hq) * l.padded * 4);
    l.inv = take(a.mode == FLASHMSA_MODE_DENSE
                     ? attn_bwd::blk_off_workspace(g.batch)
                     : attn_bwd::inversion_workspace(inversion_args(nullptr, 0, 0, a.cu_seqlens, g)));
    if (!present(a.proxy_lse)) l.plse = take(size_t(g.Hp) * g.total * 4);
    l.kl = take(size_t(g.Hp) * global_blocks_bound(g) * 4);
    if (a.mode != FLASHMSA_MODE_DENSE) {
      l.teach = take(teacher_bytes(g));
      l.has_teacher = true;
    }
  }
  l.total = off;
  return l;
}

// kl of the forward: the proxy kernel without gradients over the main probabilities that the
// forward's lse defines, partials added in a fixed order.
template <class Element>
void run_fwd_kl(const flashmsa_fwd_args_t& a, const Geometry& g, const int32_t* idx, int64_t idx_head,
                int64_t idx_tok, const flashmsa_tensor_t& plse_t, char* ws, const FwdLayout& l, cudaStream_t st) {
  const Seqs seqs = seqs_of(a.cu_seqlens, g);
  attn_bwd::PreprocessArgs pa;
  pa.out = token_tensor<const void>(a.out, g);
  pa.lse = head_tensor<const float>(a.lse);
  pa.seqs = seqs;
  pa.Hq = g.Hq;
  pa.max_seqlen = g.max_seqlen;
  pa.lse2 = reinterpret_cast<float*>(ws + l.lse2);
  pa.padded_stride = l.padded;
  attn_bwd::launch_preprocess<Element>(pa, st);
  const attn_bwd::Common c = common_base(g, a.q, a.k, a.cu_seqlens, pa.lse2, l.padded,
                                         a.mode == FLASHMSA_MODE_DENSE, idx, idx_head, idx_tok, ws + l.inv, st);
  using Stage = typename attn_bwd::MainParams<Element>::StageLayout;
  const auto tk = make_block_load<Element, Stage>(c.k, g.Hkv, g.batched, g.seqlen, g.batch, g.total);
  if (l.has_teacher) {  // the main backward's S and P only, storing the teacher (R = G: fwd_features)
    attn_bwd::MainParams<Element> mp;
    mp.c = c;
    mp.c.R = bwd_unit_heads(g);
    mp.tma_k = tk.copy;
    mp.tma_v = tk.copy;  // not loaded
    mp.tma_shape = tk.shape;
    mp.batched = g.batched;
    mp.Rp = head_slots(mp.c.R);
    mp.log_rp = __builtin_ctz(unsigned(mp.Rp));
    mp.teacher = reinterpret_cast<float*>(ws + l.teach);
    mp.teacher_only = true;
    attn_bwd::launch_main<Element>(mp, g.Hq / mp.c.R, st);
  }
  flashmsa_tensor_t idx_t{};  // the rows the proxy lse recompute reads (GIVEN)
  idx_t.data = const_cast<int32_t*>(idx);
  idx_t.ndim = 3;
  idx_t.strides[0] = idx_head;
  idx_t.strides[1] = idx_tok;
  idx_t.strides[2] = 1;
  ProxyRun r;
  r.qp = &a.qp;
  r.kp = &a.kp;
  r.cu = &a.cu_seqlens;
  r.indices = &idx_t;
  r.proxy_lse = &plse_t;
  r.plse_ws = reinterpret_cast<float*>(ws + l.plse);
  r.kl_acc = reinterpret_cast<float*>(ws + l.kl);
  r.grads = false;
  if (l.has_teacher) run_kl<Element>(g, c, reinterpret_cast<const float*>(ws + l.teach), r, st);
  else run_proxy<Element>(g, c, tk.copy, tk.shape, r, st);
  attn_bwd::launch_kl_reduce(r.kl_acc, int64_t(g.Hp) * global_blocks_bound(g), 1.0 / (double(g.Hp) * double(g.total)),
                             static_cast<float*>(a.kl.data), st);
}

}  // namespace

size_t fwd_workspace(const flashmsa_fwd_args_t& a, const Geometry& g) {
  fwd_features(a, g);
  return guard_bytes(g) + (g.total == 0 ? 0 : fwd_layout(a, g).total);
}

void fwd(const flashmsa_fwd_args_t& user, const Geometry& g, void* ws_raw, size_t) {
  const char* fn = "flashmsa_fwd";
  fwd_features(user, g);
  auto st = static_cast<cudaStream_t>(user.stream);
  if (user.validate) {
    const auto cu = validate_offsets(user.cu_seqlens, g, st, fn);
    if (user.mode == FLASHMSA_MODE_GIVEN) validate_indices(user.indices, cu, g, st, fn);
  }
  // From here on the kernels see the guard's safe cu_seqlens (a fault: every sequence empty).
  Guard gd = start_guard(user.cu_seqlens, user.status, g, guard::kFwd, ws_raw, st);
  flashmsa_fwd_args_t a = user;
  a.cu_seqlens = gd.cu;
  for (const flashmsa_tensor_t* t : {&a.out, &a.out_lo, &a.lse, &a.proxy_lse, &a.kl}) poison(gd, *t);
  if (a.mode == FLASHMSA_MODE_SPARSE) poison(gd, a.indices);
  if (present(a.kl)) FLASHMSA_CUDA_CHECK(cudaMemsetAsync(a.kl.data, 0, sizeof(float), st));
  if (g.total == 0) return finish_guard(gd, st);
  char* ws = static_cast<char*>(ws_raw) + guard_bytes(g);
  const FwdLayout l = fwd_layout(a, g);

  const int32_t* idx = nullptr;
  int64_t idx_head = 0, idx_tok = 0;
  // the proxy lse: an output, or (for the kl) workspace
  flashmsa_tensor_t plse_t = a.proxy_lse;
  if (!present(plse_t) && a.compute_kl) {
    plse_t = flashmsa_tensor_t{};
    plse_t.data = ws + l.plse;
    plse_t.dtype = FLASHMSA_DTYPE_FP32;
    plse_t.ndim = 2;
    plse_t.shape[0] = g.Hp;
    plse_t.shape[1] = g.total;
    plse_t.strides[0] = g.total;
    plse_t.strides[1] = 1;
    plse_t.device_type = FLASHMSA_DEVICE_CUDA;
  }
  if (a.mode == FLASHMSA_MODE_SPARSE) {
    int32_t* dst = present(a.indices) ? static_cast<int32_t*>(a.indices.data) : reinterpret_cast<int32_t*>(ws + l.idx);
    idx_head = present(a.indices) ? a.indices.strides[0] : g.total * g.topk;
    idx_tok = present(a.indices) ? a.indices.strides[1] : g.topk;
    run_select(a.qp, a.kp, a.cu_seqlens, g, dst, idx_head, idx_tok, plse_t, st);
    idx = dst;
  } else {
    if (a.mode == FLASHMSA_MODE_GIVEN) {
      idx = static_cast<const int32_t*>(a.indices.data);
      idx_head = a.indices.strides[0];
      idx_tok = a.indices.strides[1];
    }
    if (present(plse_t)) {  // the proxy lse over the given sets / the causal set (an output, or the kl's)
      HeadTensor<const int32_t> given;
      given.ptr = idx;
      given.head = idx_head;
      given.tok = idx_tok;
      const int mode = a.mode == FLASHMSA_MODE_DENSE ? selection::kDenseLse : selection::kGivenLse;
      if (g.dtype == FLASHMSA_DTYPE_BF16)
        run_select_t<cutlass::bfloat16_t>(a.qp, a.kp, a.cu_seqlens, g, nullptr, 0, 0, head_tensor<float>(plse_t), st, mode, given);
      else
        run_select_t<cutlass::half_t>(a.qp, a.kp, a.cu_seqlens, g, nullptr, 0, 0, head_tensor<float>(plse_t), st, mode, given);
    }
  }

  if (g.dtype == FLASHMSA_DTYPE_BF16) run_fwd<cutlass::bfloat16_t>(a, g, idx, idx_head, idx_tok, st);
  else run_fwd<cutlass::half_t>(a, g, idx, idx_head, idx_tok, st);
  if (a.compute_kl) {
    if (g.dtype == FLASHMSA_DTYPE_BF16) run_fwd_kl<cutlass::bfloat16_t>(a, g, idx, idx_head, idx_tok, plse_t, ws, l, st);
    else run_fwd_kl<cutlass::half_t>(a, g, idx, idx_head, idx_tok, plse_t, ws, l, st);
  }
  finish_guard(gd, st);
}

void bwd(const flashmsa_bwd_args_t& user, const Geometry& g, void* ws_raw, size_t) {
  const char* fn = "flashmsa_bwd";
  bwd_features(user, g);
  auto st = static_cast<cudaStream_t>(user.stream);
  if (user.validate) {
    const auto cu = validate_offsets(user.cu_seqlens, g, st, fn);
    if (user.mode != FLASHMSA_MODE_DENSE) validate_indices(user.indices, cu, g, st, fn);
  }
  // From here on the kernels see the guard's safe cu_seqlens (a fault: every sequence empty).
  Guard gd = start_guard(user.cu_seqlens, user.status, g, guard::kBwd, ws_raw, st);
  flashmsa_bwd_args_t a = user;
  a.cu_seqlens = gd.cu;
  for (const flashmsa_tensor_t* t : {&a.dq, &a.dk, &a.dv, &a.dqp, &a.dkp}) poison(gd, *t);
  if (g.total == 0) return finish_guard(gd, st);
  char* ws = static_cast<char*>(ws_raw) + guard_bytes(g);
  const BwdLayout l = bwd_layout(a, g);
  if (g.dtype == FLASHMSA_DTYPE_BF16) run_bwd<cutlass::bfloat16_t>(a, g, ws, l, st);
  else run_bwd<cutlass::half_t>(a, g, ws, l, st);
  finish_guard(gd, st);
}

}  // namespace flashmsa::cuda
