// Shared device helpers for the Hopper kernels: warpgroup GEMM wrappers over CuTe's GMMA,
// accumulator layout views, quad reductions, and error checks.
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include "cuda/common/constants.h"
#include "cuda/common/element.h"
#include "cuda/common/error.cuh"
#include "cuda/ptx/cp_async.cuh"

namespace flashmsa::cuda {

// The kernel's shared-memory struct at the first 1024-byte boundary of the dynamic shared
// memory. Offsetting the shared array itself (not a uintptr_t round trip) keeps the pointer in
// the shared window for the compiler, so scalar accesses compile to LDS/STS instead of generic
// LD/ST (measured: 317M generic loads in one m3 32k backward before this).
template <class T>
__device__ __forceinline__ T& smem_struct(char* raw) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
  return *reinterpret_cast<T*>(raw + ((1024u - (a & 1023u)) & 1023u));
}

// ---- shared-memory layouts and warpgroup MMAs of the kernels' configs ----
// (R, C) tile of the 128-byte-swizzled K-major atom (C contiguous), and with a stage mode S.
template <class E, int R, int C>
using SwizzledTile =
    decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<E>{}, cute::Shape<cute::Int<R>, cute::Int<C>>{}));
template <class E, int R, int C, int S>
using SwizzledTiles = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<E>{},
                                                   cute::Shape<cute::Int<R>, cute::Int<C>, cute::Int<S>>{}));
// The (C, R) view of an (R, C) layout L, and the (C, R, S) view of an (R, C, S) one.
template <class L, int R, int C>
using TransposedView = decltype(cute::composition(
    L{}, cute::make_ordered_layout(cute::Shape<cute::Int<C>, cute::Int<R>>{}, cute::Step<cute::_2, cute::_1>{})));
template <class L, int R, int C, int S>
using TransposedViews = decltype(cute::composition(
    L{}, cute::make_ordered_layout(cute::Shape<cute::Int<C>, cute::Int<R>, cute::Int<S>>{},
                                   cute::Step<cute::_2, cute::_1, cute::_3>{})));
// One warpgroup's M x N x K MMA with fp32 accumulators: both operands in shared memory (K-major
// unless said), or A in registers.
template <class E, int M, int N, int K, cute::GMMA::Major MA = cute::GMMA::Major::K,
          cute::GMMA::Major MB = cute::GMMA::Major::K>
using SsMma = decltype(cute::make_tiled_mma(
    cute::GMMA::ss_op_selector<E, E, float, cute::Shape<cute::Int<M>, cute::Int<N>, cute::Int<K>>, MA, MB>(),
    cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>{}));
template <class E, int M, int N, int K, cute::GMMA::Major MA, cute::GMMA::Major MB>
using RsMma = decltype(cute::make_tiled_mma(
    cute::GMMA::rs_op_selector<E, E, float, cute::Shape<cute::Int<M>, cute::Int<N>, cute::Int<K>>, MA, MB>(),
    cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>{}));

// ---- the warp-specialised kernels' shape: one producer warpgroup (TMA / cp.async issue) and two
// consumer warpgroups (wgmma, 64 rows each), one CTA per SM ----
constexpr int kWarpGroupThreads = 128;
constexpr int kConsumerWarpGroups = 2;
constexpr int kConsumerThreads = kConsumerWarpGroups * kWarpGroupThreads;  // 256
constexpr int kCtaThreads = kWarpGroupThreads + kConsumerThreads;           // 384
// Shared memory an sm_90 CTA may use (227 KB); every Config static_asserts its plan against it.
constexpr size_t kMaxSmemBytes = 227 * 1024;

// Register budgets (setmaxnreg) per warpgroup: the producer gives registers back, the consumers
// take them; 128 * producer + 256 * consumer must fit the CTA's launch allocation, 168 registers
// per thread x 384 under __launch_bounds__(384, 1) = 64512 (setmaxnreg only moves registers
// inside it: a budget of 65536 compiled and hung the consumers' increase).
// The forward and the selection keep 40 in the producer (it also builds the union / prefetches
// token ids with ordinary code); the backward's producer only issues copies: 24, the minimum.
struct RegBudget {
  int producer, consumer;
};
constexpr RegBudget kFwdRegs{40, 232};
constexpr RegBudget kBwdRegs{24, 240};
constexpr bool fits_register_file(RegBudget r) {
  return r.producer * kWarpGroupThreads + r.consumer * kConsumerThreads <= 168 * kCtaThreads && r.producer % 8 == 0 &&
         r.consumer % 8 == 0 && r.producer >= 24 && r.consumer <= 256;
}
static_assert(fits_register_file(kFwdRegs) && fits_register_file(kBwdRegs), "setmaxnreg budgets exceed the SM");

// Named barriers (bar.sync ids) by purpose, FlashAttention-3 style: the ids start past CUTLASS's
// reserved ones (its pipelines and epilogues may use those), and a warpgroup's own barrier is
// picked by a function, not by arithmetic on the enum.
enum class NamedBarrier : int {
  kConsumerWg0 = int(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier),  // consumer warpgroup 0 alone
  kConsumerWg1,  // consumer warpgroup 1 alone
  kConsumers,    // both consumer warpgroups (kConsumerThreads): staged tiles they share
  kGatherers,    // the standalone main backward's gathering producer warps (the dQ writer warp apart)
  kCta,          // every thread of the CTA, reached from each role's own code (bwd/fused_kernel.cuh)
  kFwdBuilders,  // the persistent forward's builder warps (fwd/fwd_kernel.cuh)
};
static_assert(int(NamedBarrier::kFwdBuilders) < 16, "sm_90 has 16 named barriers");
// The barrier of consumer warpgroup w (0 or 1) alone.
__device__ __forceinline__ NamedBarrier consumer_wg_barrier(int w) {
  return w == 0 ? NamedBarrier::kConsumerWg0 : NamedBarrier::kConsumerWg1;
}
__device__ __forceinline__ void barrier_sync(NamedBarrier id, int threads) {
  ptx::named_barrier_sync(int(id), threads);
}

// The parameters of a CUTLASS PipelineTmaAsync of the warp-specialised shape: warpgroup 0 produces (thread 0
// leads), the others consume; `bytes` per stage.
template <class Pipeline>
__device__ __forceinline__ typename Pipeline::Params tma_pipeline_params(int role_wg, int consumers, uint32_t bytes) {
  typename Pipeline::Params pp;
  pp.role = role_wg == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = consumers;
  pp.transaction_bytes = bytes;
  return pp;
}

// One warpgroup GEMM issued as one batch (committed, not waited for): C (+)= A * B over all K
// blocks; zero_init clears C first. The caller waits (cute::warpgroup_wait<N>: N batches may stay
// in flight) and then fences what the batch wrote or read (wg_gemm_done).
template <bool zero_init, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void wg_gemm_issue(TiledMma& mma, TA const& a, TB const& b, TC& c) {
  using namespace cute;
  constexpr bool is_rs = !is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (is_rs) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (zero_init) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}
// After the wait for a batch of wg_gemm_issue: its accumulator (and a register A operand) fenced.
template <class TiledMma, class TA, class TC>
__device__ __forceinline__ void wg_gemm_done(TiledMma&, TA const& a, TC& c) {
  using namespace cute;
  constexpr bool is_rs = !is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  warpgroup_fence_operand(c);
  if constexpr (is_rs) warpgroup_fence_operand(const_cast<TA&>(a));
}

// One warpgroup GEMM, issued as one batch and waited for: C (+)= A * B over all K blocks;
// zero_init clears C first.
template <bool zero_init, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void wg_gemm(TiledMma& mma, TA const& a, TB const& b, TC& c) {
  wg_gemm_issue<zero_init>(mma, a, b, c);
  cute::warpgroup_wait<0>();
  wg_gemm_done(mma, a, c);
}

// View of an SM90 accumulator ((2,2,V),M,N) as (rows, cols) = ((2,M),(2,V,N)).
template <class L>
__device__ __forceinline__ auto acc_rowcol(L l) {
  using namespace cute;
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// The accumulator of S = Q K^T reinterpreted as the A operand (registers) of O += P V for
// 16-bit inputs: ((2,2,V),M,N) -> ((2,2,2),M,(V/2)*N).
template <class L>
__device__ __forceinline__ auto acc_to_a_regs(L l) {
  using namespace cute;
  auto d = logical_divide(get<0, 2>(l), Tile<_2>{});
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0, 0>(d)), get<1>(l),
                     coalesce(make_layout(get<0, 1>(d), get<2>(l))));
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// The CUTLASS element type of a Dtype.
template <Dtype> struct ElementOf;
template <> struct ElementOf<Dtype::kBf16> { using type = cutlass::bfloat16_t; };
template <> struct ElementOf<Dtype::kFp16> { using type = cutlass::half_t; };
template <> struct ElementOf<Dtype::kE4m3> { using type = cutlass::float_e4m3_t; };

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

}  // namespace flashmsa::cuda
