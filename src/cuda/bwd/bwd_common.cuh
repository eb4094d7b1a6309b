// Device pieces shared by the backward's wgmma kernels (main walk: bwd_kernel.cuh, kl walk:
// kl_kernel.cuh): the resident key block's layout and TMA load, the chunk pipeline, the CTA's
// coordinates over (key block, unit), the dQ writer's bulk row add, the key-side gradient adds
// (fp32, or the deterministic mode's fixed point) and the kl partials.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "cuda/bwd/bwd_params.cuh"
#include "cuda/common/tma.cuh"
#include "cuda/common/utils.cuh"
#include "cuda/ptx/cp_async.cuh"

// The slot hand-off of the producer's chunk loop. The fused kernel's walks (Params::kFusedWalk):
// every gathering warp loads the chunk's (at most 64) slot tokens itself, two per lane (slots
// lane and lane + 32, coalesced, one chunk ahead), and each gathering thread takes its rows'
// tokens by __shfl_sync; warps 0-1 still store the slots for the consumers. No named barrier in
// the producers' chunk loops, so compute-sanitizer racecheck sees every producer warp execute the
// same barrier sequence (with the kGatherers hand-off it reported the item broadcast; measured on
// the H200: 0 hazards, the speed of the barrier within 0.3% at m3 32k and 1% at fmsa 16k; the
// per-stage mbarrier hand-off cost 1-1.5%, the gathers reading the list 7-12%: docs/kernels/bwd.md).
// The standalone main kernel keeps the kGatherers barrier: its 24-register producers spill with
// the shuffles, and its barrier sequence draws no racecheck report.

namespace flashmsa::cuda::attn_bwd {

// The same object, through a reference the compiler cannot see through: what is derived from it
// (shared-memory addresses, wgmma descriptors) is computed after this point. The fused backward
// kernel calls this at the start of each walk, so that one walk's loop-invariant address math is
// not hoisted out of the item loop and kept live (spilled) across the other walk.
template <class T>
__device__ __forceinline__ T& opaque_ref(T& x) {
  // through the 32-bit shared address, so that the accesses stay LDS/STS (a laundered generic
  // pointer would make every access a generic LD/ST)
  uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(&x));
  asm volatile("" : "+r"(a));
  return *static_cast<T*>(__cvta_shared_to_generic(a));
}
// The thread's index, likewise: the per-thread fragment offsets derived from it are computed in
// the walk that uses them.
__device__ __forceinline__ int opaque_tid() {
  int t = int(threadIdx.x);
  asm volatile("" : "+r"(t));
  return t;
}

// The dQ writer's add of one row: the TMA engine reads the row from shared memory and adds it to
// global memory (PTX ISA: cp.reduce.async.bulk, bulk_group); the tile is reused after the engine
// has read it (cp.async.bulk.wait_group.read).
__device__ __forceinline__ void bulk_add_row(float* gdst, const float* ssrc, uint32_t bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(ssrc));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gdst), "r"(s),
               "r"(bytes)
               : "memory");
}
// The dQ writer's adds of a chunk's tile (bwd_params.cuh, dq_swizzle): slot s holds tile rows s * slot_rows ..,
// unpadded (kHeadDim floats each), whose first `slot_floats` floats go to acc + off[s * slot_rows] (-1: nothing), one
// bulk operation per slot.
template <int kHeadDim>
__device__ __forceinline__ void bulk_add_slots(float* acc, const int64_t* off, const float (*tile)[kHeadDim], int slots,
                                               int slot_rows, uint32_t slot_floats) {
  for (int s = 0; s < slots; ++s) {
    const int64_t o = off[s * slot_rows];
    if (o >= 0) bulk_add_row(acc + o, tile[s * slot_rows], slot_floats * uint32_t(sizeof(float)));
  }
}
// The dQ writer's barriers (Sync: dq_full, dq_empty), before make_chunk_pipeline (its fence and
// CTA barrier publish the initialisation); dq_full: the consumer threads that hand each tile over.
template <class Sync>
__device__ __forceinline__ void init_dq_writer(Sync& s) {
  if (threadIdx.x == 0) {
    s.dq_full.init(kConsumerThreads);
    s.dq_empty.init(32);
  }
}

// A resident key block (128 keys x 128 dims, dims contiguous) in shared memory: K_j, V_j, Kp_j.
template <class Element>
using BlockLayout = SwizzledTile<Element, kBlockKeys, kHeadDimInst>;

// The CTA's chunk pipeline (warpgroup 0 produces, the two others consume) and the barrier of
// its resident block loads, initialised and visible to the whole CTA.
template <class Pipeline>
__device__ __forceinline__ Pipeline make_chunk_pipeline(typename Pipeline::SharedStorage& storage, int role_wg,
                                                        int producers, int consumers,
                                                        cutlass::arch::ClusterTransactionBarrier& block_bar) {
  typename Pipeline::Params pp;
  pp.role = role_wg == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.producer_arv_count = producers;
  pp.consumer_arv_count = consumers;
  Pipeline pipeline(storage, pp);
  if (threadIdx.x == 0) block_bar.init(1);
  cutlass::arch::fence_barrier_init();
  __syncthreads();
  return pipeline;
}

// Key block j (128 tokens x 128) of head `head` of a per-token tensor, by TMA into `dst`,
// completing on `bar` (armed by the caller with the bytes of all its loads).
template <class Tma, class Dst>
__device__ __forceinline__ void tma_load_block(const Tma& tma, const TmaShape& shape, int head, int b, int64_t s0,
                                               bool batched, int j, Dst&& dst,
                                               cutlass::arch::ClusterTransactionBarrier& bar) {
  using namespace cute;
  copy(tma.with(reinterpret_cast<uint64_t&>(bar)), tma_blocks(tma, shape, head, b, s0, batched)(_, j),
       tma_stages(tma, dst));
}

// The kl partial of a CTA: its consumer warps' sums (2 warpgroups, 8 warps) added in a fixed
// order into kl_acc[slot] (the final reduction adds the partials in a fixed order too).
__device__ __forceinline__ void store_kl_partial(float kl_sum, float (&warp_sums)[8], float* kl_acc, int64_t slot) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) kl_sum += __shfl_xor_sync(0xffffffff, kl_sum, off);
  if (tid % 32 == 0) warp_sums[(tid - kWarpGroupThreads) / 32] = kl_sum;
  barrier_sync(NamedBarrier::kConsumers, kConsumerThreads);
  if (tid == kWarpGroupThreads) {  // the first consumer thread
    float total = 0.f;
    for (int x = 0; x < 8; ++x) total += warp_sums[x];
    kl_acc[slot] = total;
  }
}

// Deterministic mode: one contribution c added to a fixed-point sum (bwd_params.cuh, fixed_unit);
// bad is set when c * unit is past kFixLimit (or NaN).
__device__ __forceinline__ void add_fixed(int64_t* dst, float c, float unit, bool& bad) {
  const float x = c * unit;
  bad |= !(fabsf(x) <= kFixLimit);
  atomicAdd(reinterpret_cast<unsigned long long*>(dst), static_cast<unsigned long long>(__float2ll_rn(x)));
}

// The 32-bit form (kFixLimit32, fixed_unit32): two adjacent elements (dst 8-byte aligned) in one
// 64-bit integer reduction (pack_pair32).
__device__ __forceinline__ void add_fixed32_pair(int32_t* dst, float a, float b, float unit, bool& bad) {
  const float x = a * unit, y = b * unit;
  bad |= !(fabsf(x) <= kFixLimit32) || !(fabsf(y) <= kFixLimit32);
  atomicAdd(reinterpret_cast<unsigned long long*>(dst), pack_pair32(__float2int_rn(x), __float2int_rn(y)));
}

// This warpgroup's 64 keys x 128 of a key block's gradient (fp32 accumulator fragment, coords
// (key, d)) added to out [total, H, 128] at head h; keys past the sequence are skipped.
template <class Acc, class Coord>
__device__ __forceinline__ void add_key_rows(const Acc& acc, const Coord& c, int64_t key_base, int64_t L, int64_t s0,
                                             int H, int h, float* out) {
#pragma unroll
  for (int x = 0; x < cute::size(acc); x += 2) {
    const int64_t pos = key_base + cute::get<0>(c(x));
    if (pos >= L) continue;
    const int64_t row = ((s0 + pos) * H + h) * kHeadDimInst + cute::get<1>(c(x));
    atomicAdd(reinterpret_cast<float2*>(out + row), make_float2(acc(x), acc(x + 1)));
  }
}

// Deterministic mode: a thread's two adjacent elements (a, b) at columns (2 q, 2 q + 1) + 8 i of
// an SM90 accumulator row (q = lane % 4; the row's four lanes hold its 8 columns), exchanged within
// the quad so that each of the quad's two 64-bit adds covers 4 consecutive columns, one 32-byte
// sector, instead of every other column (two sectors): A at column offset dA, B at dB from the
// quad's first column. All 32 lanes must call it (a shuffle).
__device__ __forceinline__ void quad_pair(float a, float b, float& A, float& B, int& dA, int& dB) {
  const int q = threadIdx.x & 3;
  const float recv = __shfl_xor_sync(0xffffffff, q < 2 ? b : a, 2);  // lanes q and q ^ 2 trade
  A = q < 2 ? a : recv;
  B = q < 2 ? recv : b;
  dA = q < 2 ? 2 * q : 2 * q - 3;  // columns 0..3 of the quad's 8
  dB = q < 2 ? 2 * q + 4 : 2 * q + 1;  // columns 4..7
}

// Deterministic mode: add_key_rows into a fixed-point accumulator with `unit`; bad as add_fixed.
template <class Acc, class Coord>
__device__ __forceinline__ void add_key_rows_fixed(const Acc& acc, const Coord& c, int64_t key_base, int64_t L,
                                                   int64_t s0, int H, int h, int64_t* out, float unit, bool& bad) {
#pragma unroll
  for (int x = 0; x < cute::size(acc); x += 2) {
    float A, B;
    int dA, dB;
    quad_pair(acc(x), acc(x + 1), A, B, dA, dB);
    const int64_t pos = key_base + cute::get<0>(c(x));
    if (pos >= L) continue;
    const int64_t quad = ((s0 + pos) * H + h) * kHeadDimInst + cute::get<1>(c(x)) - 2 * (threadIdx.x & 3);
    add_fixed(out + quad + dA, A, unit, bad);
    add_fixed(out + quad + dB, B, unit, bad);
  }
}

// The CTA's (key block, unit) of a backward grid over nblk key blocks x `units` units (query-head
// units, or proxy heads): a 1-D grid with the units of a key block next to each other, so every
// unit's long lists (the early blocks, which most tokens may select) start first. A 2-D grid
// (key blocks along x) dispatched unit after unit: the last unit's long lists started near the
// end of the kernel. Measured (H200, m3 32k clustered, A/B on one machine): backward 30.32 -> 24.73
// ms.
struct CtaCoord {
  int gb, unit;
};
__device__ __forceinline__ CtaCoord cta_coord(int units) {
  return {int(blockIdx.x) / units, int(blockIdx.x) % units};
}
inline dim3 cta_grid(int nblk, int units) { return dim3(unsigned(nblk) * unsigned(units)); }

// Sequence of global block gb (blk_off[b] <= gb < blk_off[b+1]); -1 past the last.
__device__ __forceinline__ int seq_of_block(const int32_t* blk_off, int batch, int gb) {
  if (gb >= blk_off[batch]) return -1;
  int lo = 0, hi = batch;  // blk_off[lo] <= gb < blk_off[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (blk_off[mid] <= gb) lo = mid;
    else hi = mid;
  }
  return lo;
}

// The list of an item (proxy head grp, global block gb = block j of the sequence at s0 with L tokens), for the main and
// the kl walk alike: the inversion's entries [entry0, entry0 + n) at list, or in DENSE mode every token from the
// block's first to the sequence's end, implicit (dense_first + i; list null). Returns n.
__device__ __forceinline__ int item_list(const Common& p, int grp, int gb, int64_t s0, int64_t L, int j,
                                         int64_t& dense_first, int64_t& entry0, const int32_t*& list) {
  dense_first = 0;
  entry0 = 0;
  list = nullptr;
  if (p.dense) {
    dense_first = s0 + int64_t(j) * kBlockKeys;
    return int(s0 + L - dense_first);
  }
  const int64_t k = int64_t(grp) * p.inv.nblk + gb;
  entry0 = p.inv.offsets[k];
  const int n = p.inv.offsets[k + 1] - int(entry0);
  list = p.inv.tokens + entry0;
  return n;
}
// Token first + i of an item_list list (a walk's range starts at entry first).
__device__ __forceinline__ int32_t list_token(const Common& p, int64_t dense_first, const int32_t* list, int first,
                                              int i) {
  return p.dense ? int32_t(dense_first + first + i) : list[first + i];
}

}  // namespace flashmsa::cuda::attn_bwd
