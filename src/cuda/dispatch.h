// The CUDA backend's dispatcher, internal to src/cuda/*.cpp (CuTe-free: it sees the kernels only
// through their plain launch interfaces select/select.h, fwd/fwd.h, bwd/bwd.h, bwd/bwd_misc.cuh
// and common/guard.cuh). The parts:
//   support.cpp     what the CUDA backend supports (NOT_SUPPORTED before anything runs)
//   tiles.h         tile policy (the numbers and their reasons)
//   workspace.cpp   the workspace layouts of the three calls
//   guard_host.cpp  the metadata guard's host side, status words, the opt-in host data checks
//   select.cpp, fwd.cpp, bwd.cpp   the calls' launch sequences
//   proxy_side.cpp  what the forward's kl and the backward's proxy gradient share
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "api/backends.hpp"
#include "api/data_checks.hpp"
#include "cuda/bwd/bwd.h"
#include "cuda/bwd/bwd_misc.cuh"
#include "cuda/common/constants.h"
#include "cuda/common/element.h"
#include "cuda/common/error.cuh"
#include "cuda/common/guard.cuh"
#include "cuda/fwd/fwd.h"
#include "cuda/select/select.h"

namespace flashmsa::cuda {

// ---- which instantiation: runtime values to the template arguments of the kernels' run functions.
// A subset build (CMake FLASHMSA_KERNEL_DTYPES, FLASHMSA_KERNEL_DETERMINISTIC) compiles out the
// missing ones; support.cpp refuses their calls with NOT_SUPPORTED before anything runs.
inline Dtype dtype_of(const Geometry& g) { return g.dtype == FLASHMSA_DTYPE_BF16 ? Dtype::kBf16 : Dtype::kFp16; }

// f(std::integral_constant<Dtype, d>{})
template <class F>
void by_dtype(Dtype d, F&& f) {
#ifndef FLASHMSA_NO_BF16
  if (d == Dtype::kBf16) return f(std::integral_constant<Dtype, Dtype::kBf16>{});
#endif
#ifndef FLASHMSA_NO_FP16
  if (d == Dtype::kFp16) return f(std::integral_constant<Dtype, Dtype::kFp16>{});
#endif
  fail(FLASHMSA_ERROR_INTERNAL, "flashmsa: CUDA backend: no kernels of this dtype in this build");
}

// f(std::bool_constant<det>{}): the default or the deterministic instantiation
template <class F>
void by_det(bool det, F&& f) {
#ifndef FLASHMSA_NO_DETERMINISTIC
  if (det) return f(std::true_type{});
#else
  if (det) fail(FLASHMSA_ERROR_INTERNAL, "flashmsa: CUDA backend: built without the deterministic kernels");
#endif
  f(std::false_type{});
}

// ---- views: the API's tensors as the kernels' addressing structs ----

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

// The sequences the kernels read: cu (the guard's safe copy for varlen), or S and B (batched); with
// query segments, the guard's safe copies of cu_seqlens_q and q_origin.
inline Seqs seqs_of(const flashmsa_tensor_t& cu, const Geometry& g, const int32_t* cuq = nullptr,
                    const int32_t* origin = nullptr) {
  Seqs s;
  s.cu_seqlens = g.batched ? nullptr : static_cast<const int*>(cu.data);
  s.seqlen = g.seqlen;
  s.batch = g.batch;
  s.cuq = cuq;
  s.qorigin = origin;
  s.segments = cuq != nullptr ? g.segments : g.batch;
  return s;
}

inline size_t align_up(size_t n) { return (n + 255) & ~size_t(255); }

// The host's part of the KL rule (bwd/kl_rule.cuh has the device's): kl = (1/N) sum of the
// kernels' per-CTA partials, N = Hp * total real tokens; the kernels keep dz N / proxy_scale times
// larger, so the proxy gradients' fp32 accumulators are scaled by proxy_scale / N when converted.
struct KlScales {
  double value = 0;  // of the kl sum
  float grad = 0;    // of the dqp, dkp accumulators
};
inline KlScales kl_scales(const Geometry& g) {
  const double n = double(g.Hp) * double(g.total);
  return {1.0 / n, float(g.proxy_scale / n)};
}

// Whether a backward runs its proxy side: for the proxy gradient (dkl given) or the kl value (kl
// asked for; without dkl the side runs without gradients).
inline bool bwd_proxy_side(const flashmsa_bwd_args_t& a, const Geometry& g) {
  return g.has_proxy && (present(a.dkl) || present(a.kl));
}

// ---- support.cpp ----
void fwd_features(const flashmsa_fwd_args_t& a, const Geometry& g);
void bwd_features(const flashmsa_bwd_args_t& a, const Geometry& g);
void check_aligned(const char* fn, const char* name, const flashmsa_tensor_t& t);
[[noreturn]] void unsupported(const char* fn, const std::string& what);

// ---- workspace.cpp ----
// Every varlen call's workspace starts with the guard's (the safe cu_seqlens); then the call's.
size_t guard_bytes(const Geometry& g);
// A call's own layout (computed once, from the environment of the call) against the bytes given: the knobs could
// have changed since the size query, and a layout past the buffer is refused (FLASHMSA_ERROR_WORKSPACE).
void check_layout_fits(const char* fn, const Geometry& g, size_t layout_bytes, size_t ws_bytes);
// The fused kernel's teacher scratch (fused_kernel.cuh): one slot of kl_segment(g, ctas) fp32 rows of
// 128 keys per persistent CTA, kl_ctas(g) CTAs (the device's SMs: one CTA each), in every mode (the
// backward's proxy side, default and deterministic, and the forward's kl). The segment (list entries per
// alternation of the main and the kl walk): a quarter of the dq accumulator's bytes for the scratch
// (total x Hq / (4 x ctas) entries, rounded down to 64), clamped to [kKlSegment, kKlSegmentMax];
// FLASHMSA_KL_SEGMENT overrides it for tests and tuning; at most max_seqlen, rounded up to a
// multiple of 64. Each segment boundary drains both walks' pipelines, adds dK/dV (or dKp) and
// reloads K/V (or Kp): ~20 us per boundary on the H200 (m3 32k: the rule against 1024 entries, backward
// -1.1%; docs/kernels/bwd.md, the kl segment). The quarter keeps the step's peak memory within ~5% of
// what it was at 1024 (m3 32k: 3.81 -> 4.01 GB against cuDNN's 5.05) and leaves the small problems
// (fmsa 16k, 32k) at 1024, where the step's memory is at cuDNN's. The layouts keep both numbers
// (kl_seg, kl_ctas), so the kernel runs with exactly what its scratch was sized for.
constexpr int kKlSegment = 1024, kKlSegmentMax = 4096;
int kl_ctas(const Geometry& g);
int kl_segment(const Geometry& g, int ctas);
// The forward's kernel choice in SPARSE/GIVEN mode (FLASHMSA_FWD_RINGS, for tests and tuning;
// docs/kernels/fwd.md): unset or "auto": the router decides per tile at its default ratio where a
// warpgroup holds at most kRingsMaxTokens tokens (R >= 8), else the shared stream; a ratio "0.x"
// (1 to 3 digits): the router at that ratio, whatever R; "0": the shared-stream kernel only; "1":
// the per-warpgroup rings kernel only. Anything else: FLASHMSA_ERROR_INVALID_ARGUMENT from every
// forward query and call (fwd_workspace, fwd), whatever the mode.
// kRingsMaxTokens (measured on the H200): with 16 tokens per warpgroup (fmsa, R = 4) a warpgroup's
// list is nearly the tile's union even for random selections (the rings 12% slower on all tiles),
// and the router's fixed cost (its kernel and a second launch, ~20 us) was +2.5% at fmsa 16k.
constexpr int kRingsMaxTokens = 8;
enum FwdRingsKind { kRingsAuto, kRingsNever, kRingsAlways };
struct FwdRings {
  FwdRingsKind kind = kRingsAuto;
  int ratio_permille = attn_fwd::kRingRatioPermille;
  bool ratio_given = false;  // a ratio in FLASHMSA_FWD_RINGS: route whatever R
  // FLASHMSA_FWD_REGROUP (unset or "1": on; "0": off; anything else refused as FLASHMSA_FWD_RINGS
  // is): SPARSE/GIVEN tiles of tokens regrouped by selection (attn_fwd::launch_regroup)
  bool regroup = true;
  // FLASHMSA_FWD_PERSISTENT (unset or "1": on; "0": off; anything else refused the same way): the
  // shared-stream kernel with one CTA per SM over the tiles, or one CTA per tile (attn_fwd::Args::tile_counter)
  bool persistent = true;
};
FwdRings fwd_rings_policy();
// (cuq, origin: the query segments' safe copies, or null)
attn_bwd::InversionArgs inversion_args(const int32_t* idx, int64_t idx_head, int64_t idx_tok,
                                       const flashmsa_tensor_t& cu, const Geometry& g, const int32_t* cuq = nullptr,
                                       const int32_t* origin = nullptr);

// Workspace of the backward after the guard's, in order: lse2, dsum (padded), the deterministic
// mode's dq units, the dq/dk/dv/dqp/dkp accumulators (deterministic mode: int64, except dq in
// SPARSE/GIVEN: int32 pairs), the deterministic mode's bounds and flags, the
// inversion (or the block offsets in dense mode), the proxy lse, the kl partials, the teacher
// scratch and the fused kernel's item counter.
struct BwdLayout {
  size_t lse2 = 0, dsum = 0, dq = 0, dk = 0, dv = 0, dqp = 0, dkp = 0, inv = 0, plse = 0, kl = 0, teach = 0,
         next_item = 0, total = 0;
  int kl_seg = 0, kl_ctas = 0;  // the teacher scratch's segment and CTAs (has_teacher)
  size_t dq_unit = 0, fix = 0;  // deterministic mode: dq units [Hq, padded]; the FixWord block
  bool deterministic = false;
  bool dq32 = false;  // deterministic SPARSE/GIVEN: dq in 32-bit pairs (bwd_params.cuh, pack_pair32)
  int64_t padded = 0;
  bool has_teacher = false;
  // default-mode SPARSE/GIVEN in the fused kernel (with the proxy side, or its main walk alone), by bwd_dq_path's rule:
  // the first contribution to a dq row stores it
  // (dq_writer.cuh), dq_acc is not zeroed; its rows' words [Hp, total] uint64 (in the zeroed range)
  bool dq_store_first = false;
  bool dq_force_wait = false;  // FLASHMSA_BWD_DQ=store-wait (tests): the store-first writer's rare wait on every row
  size_t dq_word = 0;
  size_t qrows = 0;  // query segments: each query row's position and padded index, 2 x total int32 (launch_query_rows)
  // The main walk without a teacher (SPARSE/GIVEN without a proxy side, or DENSE), default mode, one MSA group per head
  // unit: the fused kernel's main walk alone (main_only; its items' counter at next_item), not the standalone kernel
  bool fused_main = false;
};
BwdLayout bwd_layout(const flashmsa_bwd_args_t& a, const Geometry& g);
// The fused backward's dq path (default mode), FLASHMSA_BWD_DQ (tests and tuning; docs/kernels/bwd.md, the dQ path):
// 'store': the first contribution to a row stores it (dq_acc not zeroed); 'add': dq_acc zeroed, adds only; unset:
// bwd_layout's rule (store-first where Rp x topk >= 256); 'store-wait' (tests): 'store' with every later contribution
// taking the writer's rare wait. Anything else is refused.
enum class BwdDqPath { kAuto, kStoreFirst, kAddOnly, kStoreWait };
BwdDqPath bwd_dq_path();

// Workspace of the forward after the guard's: the indices (SPARSE without an indices output),
// then for compute_kl the padded lse2, the inversion, the proxy lse (when not an output), the kl
// partials, the teacher scratch and the item counter.
struct FwdLayout {
  size_t sched = 0;  // the persistent forward's tile counter (8 bytes, every mode)
  size_t route = 0;  // the forward router's per-tile bytes (SPARSE/GIVEN)
  size_t perm = 0;   // the regrouping's token order, Hp x total int32 (SPARSE/GIVEN)
  size_t idx = 0, lse2 = 0, inv = 0, plse = 0, kl = 0, teach = 0, next_item = 0, total = 0;
  size_t fp8 = 0;  // the fp8 selection's copies and scales (SPARSE with g.fp8_selection)
  int kl_seg = 0, kl_ctas = 0;  // as in BwdLayout
  int64_t padded = 0;
  bool has_teacher = false;
  size_t qrows = 0;  // as in BwdLayout (compute_kl with query segments)
};
FwdLayout fwd_layout(const flashmsa_fwd_args_t& a, const Geometry& g);

// ---- guard_host.cpp ----
// A call's guard: the check launched first, the poison list, the poison launched last.
struct Guard {
  flashmsa_tensor_t cu{};  // what the kernels read: the safe copy (varlen), absent (batched)
  const int32_t* cuq = nullptr;     // with query segments: the safe copies of cu_seqlens_q [S + 1]
  const int32_t* origin = nullptr;  // and q_origin [S, 2] (contiguous)
  guard::PoisonArgs outs;  // what the poison kernel fills on a fault
  bool on = false;
};
// cuq, origin: the call's query segments (absent: none; g.segmented says which)
Guard start_guard(const flashmsa_tensor_t& cu, const flashmsa_tensor_t& status, const Geometry& g, int32_t op,
                  void* ws, cudaStream_t st, const flashmsa_tensor_t* cuq = nullptr,
                  const flashmsa_tensor_t* origin = nullptr);
// Adds an output (rank 0 to 3, last dimension contiguous: validated) to the poison list.
void poison(Guard& r, const flashmsa_tensor_t& t);
void finish_guard(const Guard& r, cudaStream_t st);
// The opt-in `validate`: cu_seqlens (and index rows) copied to the host and checked (synchronises).
std::vector<int64_t> validate_offsets(const flashmsa_tensor_t& cu, const Geometry& g, cudaStream_t st,
                                      const char* fn);
// The query segments copied to the host and checked against the key sequences cu (empty without segments).
Segments validate_segments(const flashmsa_tensor_t& cuq, const flashmsa_tensor_t& origin, const std::vector<int64_t>& cu,
                           const Geometry& g, cudaStream_t st, const char* fn);
void validate_indices(const flashmsa_tensor_t& t, const std::vector<int64_t>& cu, const Geometry& g,
                      cudaStream_t st, const char* fn, const Segments* segments = nullptr);

// ---- select.cpp ----
void launch_select(Dtype d, const selection::Args& a, cudaStream_t st);
// Selection (kSelect) or the proxy lse alone over every causal key (kDenseLse) or over given
// blocks (kGivenLse, indices read from `given`).
void run_select(const flashmsa_tensor_t& qp, const flashmsa_tensor_t& kp, const flashmsa_tensor_t& cu,
                const Geometry& g, int32_t* indices, int64_t idx_head, int64_t idx_tok, HeadTensor<float> proxy_lse,
                cudaStream_t st, int lse_mode = selection::kSelect, HeadTensor<const int32_t> given = {},
                const Guard* segments = nullptr, void* fp8_ws = nullptr);
// The fp8 selection's workspace (g.fp8_selection: the e4m3 copies and scales, fp8_quant.h), else 0; in the
// select call's workspace it starts at select_fp8_offset (after the guard's).
size_t fp8_selection_bytes(const Geometry& g);
size_t select_fp8_offset(const Geometry& g);

// ---- proxy_side.cpp ----
// What the backward's kernels and the forward's kl share: q, k, the padded lse2, the sequences,
// the inversion (or the block offsets in dense mode), heads and scales.
// segments: the call's query segments (the guard's safe copies), or null; qrows: with segments, the workspace of
// launch_query_rows (2 x total int32), filled here.
attn_bwd::Common common_base(const Geometry& g, const flashmsa_tensor_t& q, const flashmsa_tensor_t& k,
                             const flashmsa_tensor_t& cu, float* lse2, int64_t padded, bool dense,
                             const int32_t* idx, int64_t idx_head, int64_t idx_tok, char* inv_ws,
                             cudaStream_t st, const Guard* segments = nullptr, int32_t* qrows = nullptr);
void launch_main(Dtype d, const attn_bwd::MainArgs& a, int units, cudaStream_t st);

// The proxy side: gradients (backward) or the kl value alone (forward's compute_kl).
struct ProxyRun {
  const flashmsa_tensor_t *qp = nullptr, *kp = nullptr, *cu = nullptr, *indices = nullptr, *proxy_lse = nullptr;
  const Guard* segments = nullptr;  // the call's query segments (the guard's safe copies), or null
  float* plse_ws = nullptr;  // [Hp, total] when proxy_lse is absent
  float *dqp_acc = nullptr, *dkp_acc = nullptr, *kl_acc = nullptr;
  const float* dkl = nullptr;
  bool grads = true;
};
// The fused kernel's scratch in a layout's workspace (has_teacher).
struct FusedScratch {
  float* teacher = nullptr;      // [ctas, seg, 128]
  int32_t* next_item = nullptr;  // the items' counter (zeroed by run_fused)
  int seg = 0, ctas = 0;
};
template <class Layout>
FusedScratch fused_scratch(const Layout& l, char* ws) {
  return {reinterpret_cast<float*>(ws + l.teach), reinterpret_cast<int32_t*>(ws + l.next_item), l.kl_seg, l.kl_ctas};
}
// The proxy side in every mode (DENSE over implicit lists): the fused kernel (the main backward's walk
// and the kl walk per CTA, the teacher in the scratch); c is the main backward's Common (the forward's kl:
// teacher_only); then, when kl_out is given, the kl value there (the partials added in a fixed order).
// dq_word: the backward's store-first dq words (dq_writer.cuh; BwdLayout::dq_store_first), null: adds only;
// dq_force_wait: BwdLayout::dq_force_wait.
void run_fused(const Geometry& g, const attn_bwd::Common& c, const ProxyRun& r, bool teacher_only,
               const FusedScratch& s, float* kl_out, cudaStream_t st, uint64_t* dq_word = nullptr,
               bool dq_force_wait = false);
// BwdLayout::fused_main: the fused kernel's main walk alone (FusedArgs::main_only), one segment per item, no teacher
// scratch; s.next_item and s.ctas only.
void run_fused_main(const Geometry& g, const attn_bwd::Common& c, const FusedScratch& s, cudaStream_t st,
                    uint64_t* dq_word, bool dq_force_wait);

}  // namespace flashmsa::cuda
