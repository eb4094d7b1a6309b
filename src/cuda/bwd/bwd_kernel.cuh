// Main backward on Hopper (dq, dk, dv of the sparse attention), key-block-outer over the
// index inversion.
//
// One CTA = one key block j (128 keys of one sequence) x one head unit (R query heads sharing a
// group and a kv head). It walks the inverted list of the tokens that selected block j in
// chunks of 64 rows = NTc token slots x Rp head slots (Rp = R rounded up to a power of two;
// m3: 4 x 16), so no masked work is paid beyond the causal diagonal and partial chunks. dK_j and
// dV_j accumulate in registers for the whole list (two consumer warpgroups own 64 keys each,
// S^T = K Q^T layout as in FlashAttention-3's backward); dQ of each chunk (a GEMM over both
// warpgroups' dS^T staged in shared memory) goes to a dQ tile in shared memory, whose rows the
// producer warpgroup's last warp (the dQ writer) has the TMA engine add to an fp32 accumulator
// (deterministic mode: dQ, and dK_j, dV_j at the end, go to 64-bit fixed-point accumulators from
// the consumers, whose integer adds give the same sum in any order; bwd_params.cuh). The other
// three producer warps gather: the chunk's token ids (prefetched one chunk ahead), then the Q and
// dO rows, lse (log2) and dpsum with cp.async into a three-stage mbarrier pipeline whose arrivals
// complete with the copies (the producer never waits for its own loads); K_j and V_j come once
// by TMA.
//
// The walk is written as two device functions (main_produce, main_consume) over a range of a
// list's entries, so that the fused kernel (fused_kernel.cuh: SPARSE/GIVEN with a kl, where the
// unit is exactly one MSA group, R = G) runs it segment by segment next to the kl walk. There the
// consumers also reduce P^T over the group's heads in registers (the head slots of a token are Rp
// adjacent accumulator columns: two per thread, then lanes xor 1 and 2) and store the teacher
// t(token, key) = mean_h P of every entry of the segment, fp32 [entry, 128], to the CTA's scratch;
// teacher_only (the forward's kl) skips dP, dS and the gradients; without a proxy side it runs
// alone there (main_only). The standalone kernel below (the deterministic mode without a proxy
// side, groups over several head units) walks the whole list without a teacher.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "cuda/bwd/bwd.h"
#include "cuda/bwd/bwd_common.cuh"
#include "cuda/bwd/dq_writer.cuh"
#include "cuda/common/utils.cuh"
#include "cuda/ptx/cp_async.cuh"

// The dQ path (docs/kernels/bwd.md): the consumers stage each chunk's dQ tile in shared memory and the producer
// warpgroup's last warp has the TMA engine add it to dq_acc, one token slot's R head rows per operation
// (cp.reduce.async.bulk), so no consumer waits for its reductions to drain. Three pipeline stages (m3 -1% to -2%
// against two; the third takes the room a second dS^T buffer had). The deterministic mode keeps its fixed-point adds
// in the consumers.

namespace flashmsa::cuda::attn_bwd {

template <class Element>
struct MainConfig {
  static constexpr int kBlockN = kBlockKeys, kRows = 64, kHeadDim = kHeadDimInst;
  // the producer warpgroup's last warp adds dQ (the dQ writer); the other three gather rows
  static constexpr int kThreads = kCtaThreads, kStages = 3, kConsumers = kConsumerThreads,
                       kProducers = kWarpGroupThreads - 32,
                       kDqStride = kHeadDim;  // unpadded rows, swizzled columns (bwd_params.cuh, dq_swizzle)
  using Pipeline = cutlass::PipelineAsync<kStages>;
  using Major = cute::GMMA::Major;
  // K, V resident: (keys, d), d contiguous; the K^T view (d, keys) for dQ = dS K
  using SmemLayoutKV = BlockLayout<Element>;
  using SmemLayoutKt = TransposedView<SmemLayoutKV, kBlockN, kHeadDim>;
  // chunk rows (rows, d) per stage, and their (d, rows) views for dV += P^T dO, dK += dS^T Q
  using SmemLayoutRows = SwizzledTiles<Element, kRows, kHeadDim, kStages>;
  using SmemLayoutRowsT = TransposedViews<SmemLayoutRows, kRows, kHeadDim, kStages>;
  // dS^T staging (keys, rows), rows contiguous; one buffer (its room went to the third stage: the consumers meet
  // after the dQ GEMM, before the next chunk's dS^T); and its (rows, keys) view
  using SmemLayoutdS = SwizzledTile<Element, kBlockN, kRows>;
  using SmemLayoutdSt = TransposedView<SmemLayoutdS, kBlockN, kRows>;
  // S^T = K Q^T and dP^T = V dO^T: (64 keys) x (64 rows) x d
  using MmaSdp = SsMma<Element, 64, kRows, kHeadDim>;
  // dV += P^T dO and dK += dS^T Q: (64 keys) x d x (64 rows), A from registers
  using MmadKV = RsMma<Element, 64, kHeadDim, kRows, Major::K, Major::MN>;
  // dQ = dS K: (64 rows) x (64 d, one half per warpgroup) x (128 keys)
  using MmadQ = SsMma<Element, 64, 64, kBlockN, Major::MN, Major::MN>;

  struct Smem {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> v;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutRows>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutRows>, 1024> dout;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutdS>, 1024> ds;
    alignas(16) float lse2[kStages][kRows];
    alignas(16) float dsum[kStages][kRows];
    alignas(16) int32_t pos[kStages][kRows];  // in-sequence position of each row's token; -1: padding row
    int32_t tok[kStages][kRows];   // global token of each row; -1: padding row
    int32_t slot[kStages][kRows];  // global token of each token slot; -1: past the list
    float unit[kStages][kRows];    // deterministic mode: each row's fixed-point unit (bwd_params.cuh)
    alignas(16) float dq[kRows][kDqStride];  // the chunk's dQ tile (rows x d, unpadded; columns swizzled so that
                                             // float2 stores take 2 wavefronts: bwd_params.cuh, dq_swizzle)
    int64_t dq_row[kRows];                   // dq_acc offset of each row; -1: nothing to add
    int32_t dq_tok[kRows];                   // the global token of each row; -1: none (the fused writer's words)
  };
  // the pipeline's barriers and the resident block's (outside Smem: the fused kernel overlays the
  // two walks' Smem and keeps both Syncs)
  struct Sync {
    typename Pipeline::SharedStorage pipe;
    cutlass::arch::ClusterTransactionBarrier kv_bar;
    cutlass::arch::ClusterBarrier dq_full, dq_empty;  // the dQ tile written by the consumers / added
  };
  struct Plan {
    Smem d;
    Sync s;
  };
  static constexpr size_t kSmemBytes = sizeof(Plan) + 1024;
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared-memory plan over the SM's 227 KB");
};

// The kernel's parameters: the dispatcher's plain arguments plus the TMA descriptors of K_j, V_j;
// kDetMode: the deterministic instantiation.
template <class Element, bool kDet = false>
struct MainParams : MainArgs {
  static constexpr bool kDetMode = kDet;
  static constexpr bool teacher_only = false;  // (the fused kernel's forward kl only)
  static constexpr bool kFusedWalk = false;    // (the fused kernel's walks: the slot shuffle, bwd_common.cuh)
  using ElementType = Element;
  using StageLayout = typename MainConfig<Element>::SmemLayoutKV;
  TmaBlockLoad<Element, StageLayout> tma_k, tma_v;
  TmaShape tma_shape;
};

// The teacher of one chunk from this warpgroup's P^T accumulator (64 keys x 64 rows, rows =
// Rp = 2^kLogRp head slots per token): sum over each token's head slots, scaled by 1/G, one store
// per (token, key). SM90 accumulator fragment: value x = e0 + 2 e1 + 4 i of lane l sits at
// key 16 warp + l / 4 + 8 e1 and row 8 i + 2 (l % 4) + e0 (cS gives both). A token's Rp >= 2
// slots are the aligned column group of its rows: e0 pairs, then i groups of Rp / 8, then the
// lanes xor 1 (Rp >= 4) and xor 2 (Rp >= 8); the rows' padding heads hold P = 0. Rp is a
// template parameter (store_teacher dispatches): with a runtime Rp every step was a branch, and
// the store took ~330 of the main walk's ~930 instructions per warp and chunk (ncu).
template <int kLogRp, class Acc>
__device__ __forceinline__ void store_teacher_rp(const Acc& accS, int key0, int row0, const int32_t* slot_tok,
                                                 float* dst, float inv_g) {
  using namespace cute;
  static_assert(decltype(size(accS))::value == 32, "64 x 64 fragment");
  if constexpr (kLogRp == 0) {  // one head per token: the teacher is P itself
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int e0 = 0; e0 < 2; ++e0) {
        const int r = row0 + 8 * i + e0;
        if (slot_tok[r] < 0) continue;
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) dst[r * kBlockKeys + key0 + 8 * e1] = accS(4 * i + 2 * e1 + e0) * inv_g;
      }
  } else {
    // only the first i of each token's group (i % kSpan == 0) accumulates: no symmetric copies,
    // so the reduction adds few live registers (it runs before dP^T exists)
    constexpr int kSpan = kLogRp >= 3 ? 1 << (kLogRp - 3) : 1;  // consecutive i of one token
    float a[8][2];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int e1 = 0; e1 < 2; ++e1) a[i][e1] = accS(4 * i + 2 * e1) + accS(4 * i + 2 * e1 + 1);
#pragma unroll
    for (int sft = 1; sft < kSpan; sft <<= 1)
#pragma unroll
      for (int i = 0; i < 8; i += 2 * sft) a[i][0] += a[i + sft][0], a[i][1] += a[i + sft][1];
    const int q = (threadIdx.x % 32) % 4;
#pragma unroll
    for (int i = 0; i < 8; i += kSpan) {
#pragma unroll
      for (int e1 = 0; e1 < 2; ++e1) {
        if constexpr (kLogRp >= 2) a[i][e1] += __shfl_xor_sync(0xffffffff, a[i][e1], 1);
        if constexpr (kLogRp >= 3) a[i][e1] += __shfl_xor_sync(0xffffffff, a[i][e1], 2);
      }
      const int slot = (row0 + 8 * i) >> kLogRp;
      const bool writer = kLogRp >= 3 ? q == (slot & 3) : (kLogRp == 2 ? (q & 1) == 0 : true);
      if (!writer || slot_tok[slot] < 0) continue;
#pragma unroll
      for (int e1 = 0; e1 < 2; ++e1) dst[slot * kBlockKeys + key0 + 8 * e1] = a[i][e1] * inv_g;
    }
  }
}

// store_teacher_rp for the runtime log2(Rp) (0..6: R <= 64, support.cpp); a uniform branch per chunk.
template <class Acc>
__device__ __forceinline__ void store_teacher(const Acc& accS, int key0, int row0, const int32_t* slot_tok, float* dst,
                                              int log_rp, float inv_g) {
  switch (log_rp) {
    case 0: store_teacher_rp<0>(accS, key0, row0, slot_tok, dst, inv_g); break;
    case 1: store_teacher_rp<1>(accS, key0, row0, slot_tok, dst, inv_g); break;
    case 2: store_teacher_rp<2>(accS, key0, row0, slot_tok, dst, inv_g); break;
    case 3: store_teacher_rp<3>(accS, key0, row0, slot_tok, dst, inv_g); break;
    case 4: store_teacher_rp<4>(accS, key0, row0, slot_tok, dst, inv_g); break;
    case 5: store_teacher_rp<5>(accS, key0, row0, slot_tok, dst, inv_g); break;
    default: store_teacher_rp<6>(accS, key0, row0, slot_tok, dst, inv_g); break;
  }
}

// A main-walk item: key block j of sequence b (global block gb) x one head unit, and its list of
// n tokens (the inversion's, or every token from the block's first in DENSE mode).
struct MainItem {
  int b, j, h0, grp, kvh, n;
  int64_t s0, L, dense_first, entry0;  // entry0: the list's first inversion entry (SPARSE/GIVEN)
  const int32_t* list;
};
// false: nothing to do (a block past the last sequence, or an empty list)
__device__ __forceinline__ bool main_item(const Common& p, int gb, int unit, MainItem& m) {
  m.b = seq_of_block(p.inv.blk_off, p.seqs.batch, gb);
  if (m.b < 0) return false;
  p.seqs.get(m.b, m.s0, m.L);
  m.j = gb - p.inv.blk_off[m.b];
  m.h0 = unit * p.R;
  m.grp = m.h0 / (p.Hq / p.Hp);
  m.kvh = m.h0 / (p.Hq / p.Hkv);
  m.n = item_list(p, m.grp, gb, m.s0, m.L, m.j, m.dense_first, m.entry0, m.list);
  return m.n > 0;
}

// The producer's side of list entries [first, first + count) of an item: K_j (and V_j) by TMA
// on sync.kv_bar (armed here), then the chunks' rows into the pipeline. The pipeline state carries
// over between calls (the fused kernel walks several ranges and items on one pipeline).
template <class Element, class Params>
__device__ __forceinline__ void main_produce(const Params& P, typename MainConfig<Element>::Smem& S_in,
                                             typename MainConfig<Element>::Pipeline& pipeline,
                                             cutlass::PipelineState<MainConfig<Element>::kStages>& state,
                                             typename MainConfig<Element>::Sync& sync, const MainItem& m,
                                             int first, int count) {
  auto& S = opaque_ref(S_in);
  using namespace cute;
  using C = MainConfig<Element>;
  const Common& p = P.c;
  const int tid = opaque_tid();
  const int NTc = C::kRows / P.Rp;  // token slots per chunk
  const int nchunks = (count + NTc - 1) / NTc;
  const int64_t s0 = m.s0;
  const int b = m.b;
  Tensor sK = make_tensor(make_smem_ptr(S.k.data()), typename C::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(S.v.data()), typename C::SmemLayoutKV{});
  Tensor sQ = make_tensor(make_smem_ptr(S.q.data()), typename C::SmemLayoutRows{});
  Tensor sdO = make_tensor(make_smem_ptr(S.dout.data()), typename C::SmemLayoutRows{});
  if (tid >= C::kProducers) {  // the dQ writer warp: per chunk, lane 0 has each token slot of the tile added
    if (Params::kDetMode || P.teacher_only) return;
    if constexpr (Params::kFusedWalk) {  // the first contribution to a row stores it (dq_writer.cuh)
      if (P.dq_word) return store_first_dq_writer<C>(P, S, sync, state, m, nchunks, NTc);
    }
    const int lane = tid % 32;
    for (int c = 0; c < nchunks; ++c) {
      sync.dq_full.wait(state.count() & 1);  // (the producer state counts the chunks as the consumers' does)
      if (lane == 0) {
        // one operation per token slot: its R heads' rows (slot * Rp ..), contiguous here and in dq_acc
        bulk_add_slots<C::kHeadDim>(p.dq_acc, S.dq_row, S.dq, NTc, P.Rp, uint32_t(p.R * C::kHeadDim));
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // the engine has read the tile
      }
      __syncwarp();
      sync.dq_empty.arrive();
      ++state;
    }
    if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // the adds done before the range ends
    return;
  }
  if (tid == 0) {  // K_j (and V_j), by TMA
    sync.kv_bar.arrive_and_expect_tx((P.teacher_only ? 1 : 2) * C::kBlockN * C::kHeadDim * sizeof(Element));
    tma_load_block(P.tma_k, P.tma_shape, m.kvh, b, s0, P.batched, m.j, sK, sync.kv_bar);
    if (!P.teacher_only) tma_load_block(P.tma_v, P.tma_shape, m.kvh, b, s0, P.batched, m.j, sV, sync.kv_bar);
  }
  const Element* qptr = static_cast<const Element*>(p.q.ptr);
  const Element* doptr = static_cast<const Element*>(p.dout.ptr);
  const int64_t pad0 = padded_offset(s0, b, kPadTile) - s0;  // padded index = pad0 + global token
  const int R = p.R, lrp = P.log_rp, rmask = P.Rp - 1, h0 = m.h0;
  // token of slot s of chunk c, -1 past the range. The fused kernel's walk (bwd_common.cuh: the
  // slot hand-off): every gathering warp holds slots lane and lane + 32 and shuffles them; the
  // standalone kernel's threads < NTc load their slot one chunk ahead and hand it over through
  // S.slot and the kGatherers barrier
  constexpr bool kShfl = Params::kFusedWalk;
  auto slot_of = [&](int c, int s) -> int32_t {
    const int li = c * NTc + s;
    if (s >= NTc || li >= count) return -1;
    return list_token(p, m.dense_first, m.list, first, li);
  };
  const int lane = tid % 32;
  int32_t next = 0, next_a = 0, next_b = 0;
  if constexpr (kShfl) next_a = slot_of(0, lane), next_b = slot_of(0, lane + 32);
  else next = slot_of(0, tid);
  for (int c = 0; c < nchunks; ++c) {
    pipeline.producer_acquire(state);
    const int st = state.index();
    int32_t cur_a = 0, cur_b = 0;
    if constexpr (kShfl) {
      cur_a = next_a, cur_b = next_b;
      if (tid < NTc) S.slot[st][tid] = tid < 32 ? cur_a : cur_b;  // for the consumers (warp 0: slots 0-31, warp 1: 32-63)
      if (c + 1 < nchunks) next_a = slot_of(c + 1, lane), next_b = slot_of(c + 1, lane + 32);  // in flight meanwhile
    } else {
      if (tid < NTc) S.slot[st][tid] = next;
      if (c + 1 < nchunks) next = slot_of(c + 1, tid);  // in flight meanwhile
      barrier_sync(NamedBarrier::kGatherers, C::kProducers);
    }
    auto row_slot = [&](int r) -> int32_t {
      if constexpr (kShfl) {  // (called by whole warps)
        const int s = r >> lrp;
        const int32_t a = __shfl_sync(0xffffffffu, cur_a, s & 31), bb = __shfl_sync(0xffffffffu, cur_b, s & 31);
        return s < 32 ? a : bb;
      } else {
        return S.slot[st][r >> lrp];
      }
    };
    // rows of this chunk: row r = slot r / Rp, head h0 + r % Rp (padding heads >= R: zero rows)
    for (int x = tid; x < C::kRows * 16; x += C::kProducers) {
      const int r = x / 16, col = (x % 16) * 8;
      const int32_t t = row_slot(r);
      const bool valid = t >= 0 && (r & rmask) < R;
      const int64_t tt = valid ? t : p.spare_row(s0);  // a readable row; nothing is read when !valid
      const int h = h0 + (valid ? (r & rmask) : 0);
      ptx::cp_async_16(&sQ(r, col, st), qptr + b * p.q.batch_corr + tt * p.q.tok + h * p.q.head + col, valid ? 16 : 0);
      if (!P.teacher_only)
        ptx::cp_async_16(&sdO(r, col, st), doptr + b * p.dout.batch_corr + tt * p.dout.tok + h * p.dout.head + col,
                         valid ? 16 : 0);
    }
    if (tid < C::kRows) {
      const int r = tid;
      const int32_t t = row_slot(r);
      const bool valid = t >= 0 && (r & rmask) < R;
      const int64_t tt = valid ? t : p.spare_row(s0);
      const int h = h0 + (valid ? (r & rmask) : 0);
      const int64_t pi = p.row_pad(pad0, tt);  // the row's padded index (query segments: its own)
      S.tok[st][r] = valid ? t : -1;
      S.pos[st][r] = valid ? p.row_pos(s0, t) : -1;
      ptx::cp_async_4(&S.lse2[st][r], p.lse2.at(h, pi), valid ? 4 : 0);
      if (!P.teacher_only) ptx::cp_async_4(&S.dsum[st][r], p.dsum.at(h, pi), valid ? 4 : 0);
      if constexpr (Params::kDetMode) ptx::cp_async_4(&S.unit[st][r], p.dq_unit.at(h, pi), valid ? 4 : 0);
    }
    // the stage is full when every producer thread's copies have landed
    pipeline.producer_commit(state, cutlass::arch::cpasync_barrier_arrive);
    ++state;
  }
  ptx::cp_async_wait<0>();
}

// The consumers' side of list entries [first, first + count): dK_j, dV_j of the range added at
// its end, dq per chunk; with `teach`, the teacher row of entry first + i at teach + 128 i.
// kv_phase: the parity of kv_bar's load for this range.
template <class Element, class Params>
__device__ __forceinline__ void main_consume(const Params& P, typename MainConfig<Element>::Smem& S_in,
                                             typename MainConfig<Element>::Pipeline& pipeline,
                                             cutlass::PipelineState<MainConfig<Element>::kStages>& state,
                                             typename MainConfig<Element>::Sync& sync, uint32_t kv_phase,
                                             const MainItem& m, int count, float* teach) {
  auto& S = opaque_ref(S_in);
  using namespace cute;
  using C = MainConfig<Element>;
  constexpr bool kDet = Params::kDetMode;
  const Common& p = P.c;
  const int tid = opaque_tid();
  const int NTc = C::kRows / P.Rp;
  const int nchunks = (count + NTc - 1) / NTc;
  const int w = tid / kWarpGroupThreads - 1;
  const int wtid = tid % kWarpGroupThreads;
  const int64_t s0 = m.s0, L = m.L;
  const int h0 = m.h0;
  Tensor sK = make_tensor(make_smem_ptr(S.k.data()), typename C::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(S.v.data()), typename C::SmemLayoutKV{});
  Tensor sQ = make_tensor(make_smem_ptr(S.q.data()), typename C::SmemLayoutRows{});
  Tensor sdO = make_tensor(make_smem_ptr(S.dout.data()), typename C::SmemLayoutRows{});
  Tensor sQt = make_tensor(make_smem_ptr(S.q.data()), typename C::SmemLayoutRowsT{});
  Tensor sdOt = make_tensor(make_smem_ptr(S.dout.data()), typename C::SmemLayoutRowsT{});
  Tensor sKt = make_tensor(make_smem_ptr(S.k.data()), typename C::SmemLayoutKt{});
  Tensor sdS = make_tensor(make_smem_ptr(S.ds.data()), typename C::SmemLayoutdS{});
  Tensor sdSt = make_tensor(make_smem_ptr(S.ds.data()), typename C::SmemLayoutdSt{});

  typename C::MmaSdp mma_sdp;
  typename C::MmadKV mma_dkv;
  typename C::MmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(wtid);
  auto thr_dkv = mma_dkv.get_thread_slice(wtid);
  auto thr_dq = mma_dq.get_thread_slice(wtid);
  Tensor sKw = local_tile(sK, Shape<_64, Int<C::kHeadDim>>{}, make_coord(w, _0{}));
  Tensor sVw = local_tile(sV, Shape<_64, Int<C::kHeadDim>>{}, make_coord(w, _0{}));
  Tensor tSrK = thr_sdp.partition_fragment_A(sKw);
  Tensor tSrV = thr_sdp.partition_fragment_A(sVw);
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);     // (MMA, N, K, stage)
  Tensor tSrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tKVrdOt = thr_dkv.partition_fragment_B(sdOt);  // (MMA, N=d, K=rows, stage)
  Tensor tKVrQt = thr_dkv.partition_fragment_B(sQt);
  Tensor tQrdS = thr_dq.partition_fragment_A(sdSt);   // (MMA, M=rows, K=keys)
  Tensor sKtw = local_tile(sKt, Shape<_64, Int<C::kBlockN>>{}, make_coord(w, _0{}));  // d half w
  Tensor tQrK = thr_dq.partition_fragment_B(sKtw);
  // dS^T to shared memory with stmatrix (8x8 tiles, 16 bytes per lane and instruction); the
  // element-wise store it replaces compiled to 32 generic 2-byte stores and ~220 address
  // instructions per thread and chunk (ncu: 16% of the consumers' stall samples)
  auto stsm_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
  auto thr_stsm = stsm_ds.get_thread_slice(wtid);
  Tensor accS = partition_fragment_C(mma_sdp, Shape<_64, Int<C::kRows>>{});
  Tensor accdP = partition_fragment_C(mma_sdp, Shape<_64, Int<C::kRows>>{});
  Tensor accdV = partition_fragment_C(mma_dkv, Shape<_64, Int<C::kHeadDim>>{});
  Tensor accdK = partition_fragment_C(mma_dkv, Shape<_64, Int<C::kHeadDim>>{});
  Tensor accdQ = partition_fragment_C(mma_dq, Shape<_64, _64>{});
  clear(accdV);
  clear(accdK);
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<_64, Int<C::kRows>>{}));  // (key, row)
  Tensor cdQ = thr_dq.partition_C(make_identity_tensor(Shape<_64, _64>{}));           // (row, d)

  const float sl2 = p.scale * kLog2e;
  const int64_t key_base = int64_t(m.j) * C::kBlockN + 64 * w;  // in-sequence position of key 0 of this half
  // SM90 accumulator fragment (64 x N): value x = e0 + 2 e1 + 4 i of a thread sits at
  // (key0 + 8 e1, row0 + 8 i + e0); dQ's (row, d) likewise at (rq0 + 8 e1, d0 + 8 i + e0). The
  // element loops below use these offsets instead of per-element coordinates; check them once.
  const int key0 = get<0>(cS(0)), row0 = get<1>(cS(0)), rq0 = get<0>(cdQ(0));
  if (get<0>(cS(2)) != key0 + 8 || get<1>(cS(5)) != row0 + 9 || get<0>(cdQ(2)) != rq0 + 8 ||
      get<1>(cdQ(5)) != get<1>(cdQ(0)) + 9)
    __trap();
  const int kpos0 = int(key_base) + key0;  // in-sequence position of this thread's first key
  const float inv_g = 1.f / float(p.R);
  sync.kv_bar.wait(kv_phase);

  for (int c = 0; c < nchunks; ++c) {
    // no proxy fence here: cp.async writes completed through the mbarrier are visible to wgmma
    // (CUTLASS's cp.async GMMA mainloop and FlashAttention-3's paged-KV path rely on the same);
    // a fence.proxy.async at this point cost ~1.8x (measured: 47 vs 26 ms at m3 32k)
    pipeline.consumer_wait(state);
    const int st = state.index();
    wg_gemm<true>(mma_sdp, tSrK, tSrQ(_, _, _, st), accS);
#pragma unroll
    for (int i = 0; i < 8; ++i) {  // P^T (0 where masked: padding rows, keys after the token)
      const int2 pos = *reinterpret_cast<const int2*>(&S.pos[st][row0 + 8 * i]);
      const float2 l2 = *reinterpret_cast<const float2*>(&S.lse2[st][row0 + 8 * i]);
#pragma unroll
      for (int e1 = 0; e1 < 2; ++e1) {
        const int x = 4 * i + 2 * e1;
        accS(x) = kpos0 + 8 * e1 <= pos.x ? ptx::exp2f_approx(accS(x) * sl2 - l2.x) : 0.f;
        accS(x + 1) = kpos0 + 8 * e1 <= pos.y ? ptx::exp2f_approx(accS(x + 1) * sl2 - l2.y) : 0.f;
      }
    }
    if (teach) store_teacher(accS, key0, row0, S.slot[st], teach + int64_t(c) * NTc * C::kBlockN + 64 * w, P.log_rp, inv_g);
    if (P.teacher_only) {
      pipeline.consumer_release(state);
      ++state;
      continue;
    }
    wg_gemm<true>(mma_sdp, tSrV, tSrdO(_, _, _, st), accdP);
#pragma unroll
    for (int i = 0; i < 8; ++i) {  // dS^T
      const float2 ds = *reinterpret_cast<const float2*>(&S.dsum[st][row0 + 8 * i]);
#pragma unroll
      for (int e1 = 0; e1 < 2; ++e1) {
        const int x = 4 * i + 2 * e1;
        accdP(x) = accS(x) * (accdP(x) - ds.x);
        accdP(x + 1) = accS(x + 1) * (accdP(x + 1) - ds.y);
      }
    }
    Tensor rP = make_tensor_like<Element>(accS);
    Tensor rdS = make_tensor_like<Element>(accdP);
#pragma unroll
    for (int x = 0; x < size(accS); ++x) {
      rP(x) = Element(accS(x));
      rdS(x) = Element(accdP(x));
    }
    wg_gemm<false>(mma_dkv, make_tensor(rP.data(), acc_to_a_regs(rP.layout())), tKVrdOt(_, _, _, st), accdV);
    wg_gemm<false>(mma_dkv, make_tensor(rdS.data(), acc_to_a_regs(rdS.layout())), tKVrQt(_, _, _, st), accdK);
    // stage dS^T (this warpgroup's 64 keys) for dQ = dS K over all 128 keys
    // (one buffer: the last chunk's dQ GEMMs are done, the barrier after them)
    copy(stsm_ds, thr_stsm.retile_S(rdS), thr_stsm.partition_D(local_tile(sdS, Shape<_64, Int<C::kRows>>{},
                                                                          make_coord(w, _0{}))));
    // the tokens of this thread's dQ rows (and their fixed-point units), read before the stage
    // goes back to the producer
    const int32_t tok_a = S.tok[st][rq0], tok_b = S.tok[st][rq0 + 8];
    float unit_a = 0.f, unit_b = 0.f;
    if constexpr (kDet) unit_a = S.unit[st][rq0], unit_b = S.unit[st][rq0 + 8];
    pipeline.consumer_release(state);
    ptx::fence_proxy_async_smem();
    barrier_sync(NamedBarrier::kConsumers, kConsumerThreads);  // dS^T staged by both
    wg_gemm<true>(mma_dq, tQrdS, tQrK, accdQ);
    barrier_sync(NamedBarrier::kConsumers, kConsumerThreads);  // both warpgroups' dQ GEMMs have read dS^T
    // dQ rows of this chunk (unscaled: the convert kernel applies the softmax scale)
    const int dq0 = 64 * w + get<1>(cdQ(0));
    bool bad = false;
#pragma unroll
    for (int e1 = 0; e1 < 2; ++e1) {
      const int32_t t = e1 ? tok_b : tok_a;
      const int64_t row = (int64_t(t) * p.Hq + h0 + ((rq0 + 8 * e1) & (P.Rp - 1))) * C::kHeadDim + dq0;
      if constexpr (kDet) {  // integer adds: the same sum in any order (sector-wise: quad_pair)
        const float u = e1 ? unit_b : unit_a;
        if (p.dq_fix32) {  // 32 bits per element (SPARSE/GIVEN rows): one 64-bit add per pair
          if (t < 0) continue;
#pragma unroll
          for (int i = 0; i < 8; ++i)
            add_fixed32_pair(p.dq_fix32 + row + 8 * i, accdQ(4 * i + 2 * e1), accdQ(4 * i + 2 * e1 + 1), u, bad);
          continue;
        }
        const int64_t quad = row - 2 * (wtid & 3);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          float A, B;
          int dA, dB;
          quad_pair(accdQ(4 * i + 2 * e1), accdQ(4 * i + 2 * e1 + 1), A, B, dA, dB);
          if (t < 0) continue;
          add_fixed(p.dq_fix + quad + 8 * i + dA, A, u, bad);
          add_fixed(p.dq_fix + quad + 8 * i + dB, B, u, bad);
        }
      } else {
        // to the dQ tile, whose rows the writer warp has added (main_produce)
        if (e1 == 0 && state.count() > 0) sync.dq_empty.wait((state.count() - 1) & 1);  // the tile is free
        const int r = (rq0 + 8 * e1) & (P.Rp - 1), sw = dq_swizzle(t, r, P.Rp);  // dq_acc's column order
#pragma unroll
        for (int i = 0; i < 8; ++i)
          *reinterpret_cast<float2*>(&S.dq[rq0 + 8 * e1][(dq0 + 8 * i) ^ sw]) =
              make_float2(accdQ(4 * i + 2 * e1), accdQ(4 * i + 2 * e1 + 1));
        if (w == 0 && (wtid & 3) == 0) {
          S.dq_row[rq0 + 8 * e1] = t < 0 ? int64_t(-1) : row - dq0;
          S.dq_tok[rq0 + 8 * e1] = t;
        }
        if (e1 == 1) {
          ptx::fence_proxy_async_smem();  // the tile is read by the TMA engine (async proxy)
          sync.dq_full.arrive();
        }
      }
    }
    if (kDet && bad) atomicOr(reinterpret_cast<int32_t*>(p.fix) + kBad + 0, 1);
    ++state;
  }

  if (P.teacher_only) return;
  // dK_j, dV_j of this unit and range: fp32 atomics (several units may share a kv head), in fixed
  // point in deterministic mode
  const auto cKV = thr_dkv.partition_C(make_identity_tensor(Shape<_64, Int<C::kHeadDim>>{}));
  if constexpr (kDet) {
    bool bad = false;
    add_key_rows_fixed(accdK, cKV, key_base, L, s0, p.Hkv, m.kvh, p.dk_fix, p.fix[kUnitDk], bad);
    if (bad) atomicOr(reinterpret_cast<int32_t*>(p.fix) + kBad + 1, 1);
    bad = false;
    add_key_rows_fixed(accdV, cKV, key_base, L, s0, p.Hkv, m.kvh, p.dv_fix, p.fix[kUnitDv], bad);
    if (bad) atomicOr(reinterpret_cast<int32_t*>(p.fix) + kBad + 2, 1);
  } else {
    add_key_rows(accdK, cKV, key_base, L, s0, p.Hkv, m.kvh, p.dk_acc);
    add_key_rows(accdV, cKV, key_base, L, s0, p.Hkv, m.kvh, p.dv_acc);
  }
}

// The standalone main backward: one CTA per (key block, unit), its whole list, no teacher.
template <class Element, bool kDet>
__global__ void __launch_bounds__(kCtaThreads, 1) bwd_main_kernel(const __grid_constant__ MainParams<Element, kDet> P) {
  using C = MainConfig<Element>;
  using Pipeline = typename C::Pipeline;
  const Common& p = P.c;
  extern __shared__ char smem_raw[];
  auto& S = smem_struct<typename C::Plan>(smem_raw);
  const CtaCoord cta = cta_coord(p.Hq / p.R);
  MainItem m;
  if (!main_item(p, cta.gb, cta.unit, m)) return;
  const int role_wg = threadIdx.x / kWarpGroupThreads;
  init_dq_writer(S.s);
  Pipeline pipeline = make_chunk_pipeline<Pipeline>(S.s.pipe, role_wg, C::kProducers, C::kConsumers, S.s.kv_bar);
  if (role_wg == 0) {  // ---- producer ----
    cutlass::arch::warpgroup_reg_dealloc<kBwdRegs.producer>();
    auto state = cutlass::make_producer_start_state<Pipeline>();
    main_produce<Element>(P, S.d, pipeline, state, S.s, m, 0, m.n);
    return;
  }
  // ---- consumers: warpgroup w owns keys [64 w, 64 w + 64) ----
  cutlass::arch::warpgroup_reg_alloc<kBwdRegs.consumer>();
  typename Pipeline::PipelineState state;
  main_consume<Element>(P, S.d, pipeline, state, S.s, 0, m, m.n, nullptr);
}

// kDet: the deterministic instantiation (the fixed-point fields of Common set), else the default one
template <class Element, bool kDet>
void launch_main(const MainParams<Element, kDet>& P, int units, cudaStream_t stream) {
  using C = MainConfig<Element>;
  auto kernel = bwd_main_kernel<Element, kDet>;
  FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(C::kSmemBytes)));
  if (P.c.inv.nblk == 0 || units == 0) return;
  const dim3 grid = cta_grid(P.c.inv.nblk, units);
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(P);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

// The TMA descriptors of K_j and V_j (teacher_only reads no V: the K descriptor stands in).
template <class Params>
void set_main_tma(Params& p, const Common& c, bool batched, bool teacher_only, int64_t total) {
  using Element = typename Params::ElementType;
  using Stage = typename MainConfig<Element>::SmemLayoutKV;
  const auto tk = make_block_load<Element, Stage>(c.k, c.Hkv, batched, c.seqs.seqlen, c.seqs.batch, total);
  p.tma_k = tk.copy;
  p.tma_v = teacher_only ? tk.copy
                         : make_block_load<Element, Stage>(c.v, c.Hkv, batched, c.seqs.seqlen, c.seqs.batch, total).copy;
  p.tma_shape = tk.shape;
}

// bwd.h's run_main: the TMA descriptors, then the launch (one instantiation per translation unit).
template <Dtype D, bool kDet>
void run_main(const MainArgs& a, int units, cudaStream_t stream) {
  using Element = typename ElementOf<D>::type;
  MainParams<Element, kDet> p;
  static_cast<MainArgs&>(p) = a;
  set_main_tma(p, a.c, a.batched, false, a.total);
  launch_main<Element, kDet>(p, units, stream);
}

}  // namespace flashmsa::cuda::attn_bwd
