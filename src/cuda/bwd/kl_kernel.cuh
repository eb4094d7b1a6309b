// The proxy (KL) walk from a stored teacher, every mode (DENSE over implicit lists: every token from the block on;
// the backward, its deterministic mode and the forward's kl alike): dqp, dkp and the kl terms,
// key-block-outer over the same inversion as the main backward; run by the fused kernel
// (fused_kernel.cuh) after the main walk of the same list segment.
//
// The main walk (bwd_kernel.cuh) already has the main probabilities of every list entry and
// stores the teacher t(entry, key) = mean over the group's heads, fp32 [entry, 128], in the CTA's
// scratch. This walk needs only the proxy side, so a chunk is 64 tokens (not 64 / G, as a walk
// that recomputed the teacher from the G heads' S would need): one item = one key block j x one
// proxy head p; per chunk the producer gathers the 64 Qp rows and the 64 teacher rows (contiguous
// entries) with cp.async; the consumers (2 warpgroups x 64 keys) compute z^T = Kp Qp^T, the
// student s = exp(z - plse), dz = g (s - t) (the 1/N and the proxy scale are applied by the
// convert kernel), the kl terms t (ln t - ln s); dKp_j += dz^T Qp stays in registers for the
// segment, dQp = dz Kp goes through dz^T staged in shared memory to an fp32 accumulator with
// float2 atomics. The caller writes the item's kl partial.
#pragma once

#include <type_traits>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "cuda/bwd/bwd.h"
#include "cuda/bwd/bwd_common.cuh"
#include "cuda/bwd/kl_rule.cuh"
#include "cuda/ptx/cp_async.cuh"

namespace flashmsa::cuda::attn_bwd {

template <class Element>
struct KlConfig {
  static constexpr int kBlockN = kBlockKeys, kTok = 64, kHeadDim = kHeadDimInst, kTeachStride = 132,  // 132: no bank conflicts
                       kDqpStride = 136;  // the dQp tile's rows: 4 rows of a half-warp's float2 store in 4 bank groups
  // the producer warpgroup's last warp is the dQp writer (as the main walk's dQ writer); the other
  // three gather the rows
  static constexpr int kThreads = kCtaThreads, kStages = 2, kConsumers = kConsumerThreads,
                       kProducers = kWarpGroupThreads - 32;
  using Pipeline = cutlass::PipelineAsync<kStages>;
  using Major = cute::GMMA::Major;
  // Kp (keys, dp), and its (dp, keys) view: the B operand of dQp = dz Kp
  using SmemLayoutKp = SwizzledTile<Element, kBlockN, kHeadDim>;
  using SmemLayoutKpt = TransposedView<SmemLayoutKp, kBlockN, kHeadDim>;
  // proxy query rows (tokens, dp) per stage, and the (dp, tokens) view for dKp += dz^T Qp
  using SmemLayoutQp = SwizzledTiles<Element, kTok, kHeadDim, kStages>;
  using SmemLayoutQpT = TransposedViews<SmemLayoutQp, kTok, kHeadDim, kStages>;
  // dz^T staged as (keys, tokens), tokens contiguous, and its (tokens, keys) view (A of dQp)
  using SmemLayoutDz = SwizzledTile<Element, kBlockN, kTok>;
  using SmemLayoutDzT = TransposedView<SmemLayoutDz, kBlockN, kTok>;
  // z^T = Kp Qp^T: (64 keys) x (64 tokens) x dp
  using MmaZ = SsMma<Element, 64, kTok, kHeadDim>;
  // dKp += dz^T Qp: (64 keys) x dp x (64 tokens), A from registers
  using MmadKp = RsMma<Element, 64, kHeadDim, kTok, Major::K, Major::MN>;
  // dQp = dz Kp: (64 tokens) x (64 dp, one half per warpgroup) x (128 keys)
  using MmadQp = SsMma<Element, 64, 64, kBlockN, Major::MN, Major::MN>;

  struct Smem {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKp>, 1024> kp;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQp>, 1024> qp;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutDz>, 1024> dz;
    alignas(16) float teach[kStages][kTok][kTeachStride];
    float plse[kStages][kTok];
    int32_t tok[kStages][kTok];  // global token of each row; -1: past the list
    int32_t pos[kStages][kTok];  // its position in the key sequence (Common::row_pos)
    alignas(16) float dq[kTok][kDqpStride];  // the chunk's dQp tile (tokens x dp, padded rows: 2 wavefronts per
                                             // float2 store; a 132-float stride took 4 in ncu)
    int64_t dq_row[kTok];                    // dqp_acc offset of each row; -1: nothing to add
  };
  // the barriers (outside Smem: the fused kernel overlays the two walks' Smem)
  struct Sync {
    typename Pipeline::SharedStorage pipe;
    cutlass::arch::ClusterTransactionBarrier kp_bar;
    cutlass::arch::ClusterBarrier dq_full, dq_empty;  // the dQp tile written by the consumers / added
  };
  static constexpr size_t kSmemBytes = sizeof(Smem) + sizeof(Sync) + 1024;
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared-memory plan over the SM's 227 KB");
  static_assert(kTok == 64, "each gathering lane holds rows lane and lane + 32 (kl_produce)");
};

// A kl-walk item: key block j of sequence b (global block gb) x proxy head grp, and its list.
struct KlItem {
  int gb, grp, b, j, pk, n;
  int64_t kl_slot, s0, L, entry0, dense_first;  // dense_first: DENSE mode's first token (the list is implicit)
  const int32_t* list;
};
// false: nothing to walk (a block past the last sequence, or an empty list); kl_slot is set
__device__ __forceinline__ bool kl_item(const Common& p, int gb, int grp, KlItem& k) {
  k.gb = gb;
  k.grp = grp;
  k.kl_slot = int64_t(grp) * p.inv.nblk + gb;
  k.b = seq_of_block(p.inv.blk_off, p.seqs.batch, gb);
  if (k.b < 0) return false;
  p.seqs.get(k.b, k.s0, k.L);
  k.j = gb - p.inv.blk_off[k.b];
  k.pk = grp / (p.Hp / p.Hpk);
  k.n = item_list(p, grp, gb, k.s0, k.L, k.j, k.dense_first, k.entry0, k.list);
  return k.n > 0;
}

// The producer's side of list entries [first, first + count): Kp_j by TMA on kp_bar (armed
// here), then per chunk the Qp rows, the teacher rows (entry first + i at teach + 128 i) and the
// proxy lse into the pipeline, whose state carries over between calls.
template <class Element, class Params>
__device__ __forceinline__ void kl_produce(const Params& P, typename KlConfig<Element>::Smem& S_in,
                                           typename KlConfig<Element>::Pipeline& pipeline,
                                           cutlass::PipelineState<KlConfig<Element>::kStages>& state,
                                           typename KlConfig<Element>::Sync& sync, const KlItem& k,
                                           int first, int count, const float* teach) {
  auto& S = opaque_ref(S_in);
  using namespace cute;
  using C = KlConfig<Element>;
  const Common& p = P.c;
  const int tid = opaque_tid(), grp = k.grp, b = k.b;
  const int64_t s0 = k.s0;
  const int nchunks = (count + C::kTok - 1) / C::kTok;
  Tensor sKp = make_tensor(make_smem_ptr(S.kp.data()), typename C::SmemLayoutKp{});
  Tensor sQp = make_tensor(make_smem_ptr(S.qp.data()), typename C::SmemLayoutQp{});
  if (tid >= C::kProducers) {  // the dQp writer warp (main_produce's dQ writer loop, twin of it)
    if (Params::kDetMode || !P.grads) return;
    const int lane = tid % 32;
    for (int c = 0; c < nchunks; ++c) {
      sync.dq_full.wait(state.count() & 1);
      if (lane == 0) {
        for (int r = 0; r < C::kTok; ++r) {
          const int64_t off = S.dq_row[r];
          if (off >= 0) bulk_add_row(p.dqp_acc + off, &S.dq[r][0], C::kHeadDim * sizeof(float));
        }
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
      }
      __syncwarp();
      sync.dq_empty.arrive();
      ++state;
    }
    if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    return;
  }
  if (tid == 0) {  // Kp_j, by TMA
    sync.kp_bar.arrive_and_expect_tx(C::kBlockN * C::kHeadDim * sizeof(Element));
    tma_load_block(P.tma_kp, P.tma_shape_kp, k.pk, b, s0, P.batched, k.j, sKp, sync.kp_bar);
  }
  const Element* qpptr = static_cast<const Element*>(p.qp.ptr);
  // token of row r of chunk c (-1 past the range or the chunk): every gathering warp holds rows
  // lane and lane + 32, loaded one chunk ahead, and shuffles them (bwd_common.cuh: the slot hand-off)
  auto tok_at = [&](int c, int r) -> int32_t {
    const int li = c * C::kTok + r;
    if (r >= C::kTok || li >= count) return -1;
    return list_token(p, k.dense_first, k.list, first, li);
  };
  const int lane = tid % 32;
  int32_t next_a = tok_at(0, lane), next_b = tok_at(0, lane + 32);
  for (int c = 0; c < nchunks; ++c) {
    pipeline.producer_acquire(state);
    const int st = state.index();
    const int32_t cur_a = next_a, cur_b = next_b;
    if (tid < C::kTok) S.tok[st][tid] = tid < 32 ? cur_a : cur_b;  // for the consumers
    if (c + 1 < nchunks) next_a = tok_at(c + 1, lane), next_b = tok_at(c + 1, lane + 32);  // in flight meanwhile
    auto tok_of = [&](int r) -> int32_t {  // (called by whole warps)
      const int32_t a = __shfl_sync(0xffffffffu, cur_a, r & 31), bb = __shfl_sync(0xffffffffu, cur_b, r & 31);
      return r < 32 ? a : bb;
    };
    for (int x = tid; x < C::kTok * 16; x += C::kProducers) {  // Qp rows, zero past the range
      const int r = x / 16, col = (x % 16) * 8;
      const int32_t t = tok_of(r);
      const int64_t tt = t >= 0 ? t : p.spare_row(s0);
      ptx::cp_async_16(&sQp(r, col, st), qpptr + b * p.qp.batch_corr + tt * p.qp.tok + grp * p.qp.head + col,
                       t >= 0 ? 16 : 0);
    }
    for (int x = tid; x < C::kTok * 32; x += C::kProducers) {  // teacher rows (contiguous entries)
      const int r = x / 32, col = (x % 32) * 4;
      const bool valid = c * C::kTok + r < count;
      const float* src = teach + (valid ? int64_t(c) * C::kTok + r : 0) * C::kBlockN + col;
      ptx::cp_async_16(&S.teach[st][r][col], src, valid ? 16 : 0);
    }
    if (tid < C::kTok) {
      const int32_t t = tok_of(tid);
      S.pos[st][tid] = t >= 0 ? p.row_pos(s0, t) : -1;
      ptx::cp_async_4(&S.plse[st][tid], p.plse.at(grp, t >= 0 ? t : p.spare_row(s0)), t >= 0 ? 4 : 0);
    }
    pipeline.producer_commit(state, cutlass::arch::cpasync_barrier_arrive);
    ++state;
  }
  ptx::cp_async_wait<0>();
}

// The consumers' side of list entries [first, first + count): dQp per chunk, dKp_j of the range
// added at its end, the kl terms into kl_sum. kp_phase: the parity of kp_bar's load.
template <class Element, class Params>
__device__ __forceinline__ void kl_consume(const Params& P, typename KlConfig<Element>::Smem& S_in,
                                           typename KlConfig<Element>::Pipeline& pipeline,
                                           cutlass::PipelineState<KlConfig<Element>::kStages>& state,
                                           typename KlConfig<Element>::Sync& sync, uint32_t kp_phase,
                                           const KlItem& k, int count, float& kl_sum) {
  auto& S = opaque_ref(S_in);
  using namespace cute;
  using C = KlConfig<Element>;
  constexpr bool kDet = Params::kDetMode;
  const Common& p = P.c;
  const int tid = opaque_tid(), grp = k.grp;
  const int64_t s0 = k.s0;
  const int nchunks = (count + C::kTok - 1) / C::kTok;
  const int w = tid / kWarpGroupThreads - 1, wtid = tid % kWarpGroupThreads;
  Tensor sKp = make_tensor(make_smem_ptr(S.kp.data()), typename C::SmemLayoutKp{});
  Tensor sQp = make_tensor(make_smem_ptr(S.qp.data()), typename C::SmemLayoutQp{});
  Tensor sQpT = make_tensor(make_smem_ptr(S.qp.data()), typename C::SmemLayoutQpT{});
  Tensor sKpt = make_tensor(make_smem_ptr(S.kp.data()), typename C::SmemLayoutKpt{});
  Tensor sDz = make_tensor(make_smem_ptr(S.dz.data()), typename C::SmemLayoutDz{});
  Tensor sDzT = make_tensor(make_smem_ptr(S.dz.data()), typename C::SmemLayoutDzT{});

  typename C::MmaZ mma_z;
  typename C::MmadKp mma_dkp;
  typename C::MmadQp mma_dqp;
  auto thr_z = mma_z.get_thread_slice(wtid);
  auto thr_dkp = mma_dkp.get_thread_slice(wtid);
  auto thr_dqp = mma_dqp.get_thread_slice(wtid);
  Tensor tZrKp = thr_z.partition_fragment_A(local_tile(sKp, Shape<_64, Int<C::kHeadDim>>{}, make_coord(w, _0{})));
  Tensor tZrQp = thr_z.partition_fragment_B(sQp);
  Tensor tKprQpT = thr_dkp.partition_fragment_B(sQpT);  // (N = dp, K = tokens, stage)
  Tensor tQprDz = thr_dqp.partition_fragment_A(sDzT);   // (M = tokens, K = keys)
  Tensor tQprKp = thr_dqp.partition_fragment_B(local_tile(sKpt, Shape<_64, Int<C::kBlockN>>{}, make_coord(w, _0{})));

  Tensor accZ = partition_fragment_C(mma_z, Shape<_64, Int<C::kTok>>{});
  Tensor accdKp = partition_fragment_C(mma_dkp, Shape<_64, Int<C::kHeadDim>>{});
  Tensor accdQp = partition_fragment_C(mma_dqp, Shape<Int<C::kTok>, _64>{});  // (token, dp)
  clear(accdKp);
  Tensor cZ = thr_z.partition_C(make_identity_tensor(Shape<_64, Int<C::kTok>>{}));     // (key, token)
  Tensor cQp = thr_dqp.partition_C(make_identity_tensor(Shape<Int<C::kTok>, _64>{}));  // (token, dp)

  // dz^T to shared memory with stmatrix, as the main walk stages dS^T
  auto stsm_dz = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_z);
  auto thr_stsm = stsm_dz.get_thread_slice(wtid);
  Tensor tDzs = thr_stsm.partition_D(local_tile(sDz, Shape<_64, Int<C::kTok>>{}, make_coord(w, _0{})));

  const float psl2 = p.proxy_scale * kLog2e;
  const KlGain gain = kl_gain((P.grads && p.dkl) ? *p.dkl : 0.f);  // dz's gain, undone on dQp and dKp
  const bool want_kl = p.kl_acc != nullptr;  // the caller asked for the kl value (uniform)
  const float unit = kDet ? p.fix[kUnitDqp] : 0.f;  // deterministic mode: dQp's fixed-point unit
  bool bad = false;
  const int64_t key_base = int64_t(k.j) * C::kBlockN + 64 * w;
  // SM90 accumulator fragment (64 keys x 64 tokens): value x = e0 + 2 e1 + 4 i at (key0 + 8 e1,
  // row0 + 8 i + e0), as in the main walk; fixed offsets instead of per-element coordinates keep
  // the element loop's addresses out of the registers
  const int key0 = get<0>(cZ(0)), row0 = get<1>(cZ(0));
  if (get<0>(cZ(2)) != key0 + 8 || get<1>(cZ(5)) != row0 + 9) __trap();
  const int kpos0 = int(key_base) + key0;  // in-sequence position of this thread's first key
  sync.kp_bar.wait(kp_phase);

  for (int c = 0; c < nchunks; ++c) {
    pipeline.consumer_wait(state);  // (no proxy fence: see bwd_kernel.cuh)
    const int st = state.index();
    wg_gemm<true>(mma_z, tZrKp, tZrQp(_, _, _, st), accZ);
    const float* teach = &S.teach[st][row0][64 * w + key0];
    // dz per element, and the kl terms only where the kl value is wanted (a log per element)
    auto elements = [&](auto want_kl) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int2 tk = *reinterpret_cast<const int2*>(&S.tok[st][row0 + 8 * i]);
        const int2 tp = *reinterpret_cast<const int2*>(&S.pos[st][row0 + 8 * i]);
        const float2 pl = *reinterpret_cast<const float2*>(&S.plse[st][row0 + 8 * i]);
#pragma unroll
        for (int e0 = 0; e0 < 2; ++e0) {
          const int32_t t = e0 ? tk.y : tk.x;
          const float pl2 = (e0 ? pl.y : pl.x) * kLog2e;
          const int64_t pos = e0 ? tp.y : tp.x;
#pragma unroll
          for (int e1 = 0; e1 < 2; ++e1) {
            // branch-free: every row of a stage is readable (the producer zero-fills the rows past the range,
            // their plse too) and the masked elements' values are dropped by selects. A branch per element
            // (BSSY/BSYNC regions, the teacher's address recomputed in each) serialised the 32 elements: 5% of
            // the consumers' stall samples; without it the backward is 0.5% faster (docs/kernels/bwd.md)
            const int x = 4 * i + 2 * e1 + e0;
            const bool ok = t >= 0 && kpos0 + 8 * e1 <= pos;
            const float zl2 = accZ(x) * psl2 - pl2;  // log2 of the student
            const float tv = teach[(8 * i + e0) * C::kTeachStride + 8 * e1];
            float dz;
            if constexpr (decltype(want_kl)::value) dz = kl_element(tv, zl2, gain.gain, kl_sum, ok);
            else dz = kl_gradient(tv, zl2, gain.gain);
            accZ(x) = ok ? dz : 0.f;
          }
        }
      }
    };
    if (want_kl) elements(std::true_type{});
    else elements(std::false_type{});
    Tensor rDz = make_tensor_like<Element>(accZ);
#pragma unroll
    for (int x = 0; x < size(accZ); ++x) rDz(x) = Element(accZ(x));
    const int32_t tok_a = S.tok[st][get<0>(cQp(0))], tok_b = S.tok[st][get<0>(cQp(0)) + 8];
    if (P.grads) {
      wg_gemm<false>(mma_dkp, make_tensor(rDz.data(), acc_to_a_regs(rDz.layout())), tKprQpT(_, _, _, st), accdKp);
      copy(stsm_dz, thr_stsm.retile_S(rDz), tDzs);
    }
    pipeline.consumer_release(state);
    if (P.grads) {
      ptx::fence_proxy_async_smem();
      barrier_sync(NamedBarrier::kConsumers, kConsumerThreads);  // dz^T staged by both
      wg_gemm<true>(mma_dqp, tQprDz, tQprKp, accdQp);
#pragma unroll
      for (int x = 0; x < size(accdQp); ++x) accdQp(x) *= gain.unscale;
#pragma unroll
      for (int x = 0; x < size(accdQp); x += 2) {
        const int r = get<0>(cQp(x)), d = 64 * w + get<1>(cQp(x));
        const int32_t t = (r == get<0>(cQp(0))) ? tok_a : tok_b;
        const int64_t at = (int64_t(t) * p.Hp + grp) * C::kHeadDim + d;
        if constexpr (kDet) {  // integer adds: the same sum in any order (sector-wise: quad_pair)
          float A, B;
          int dA, dB;
          quad_pair(accdQp(x), accdQp(x + 1), A, B, dA, dB);
          if (t < 0) continue;
          const int64_t quad = at - 2 * (wtid & 3);
          add_fixed(p.dqp_fix + quad + dA, A, unit, bad);
          add_fixed(p.dqp_fix + quad + dB, B, unit, bad);
        } else {
          if (x == 0 && state.count() > 0) sync.dq_empty.wait((state.count() - 1) & 1);  // the tile is free
          *reinterpret_cast<float2*>(&S.dq[r][d]) = make_float2(accdQp(x), accdQp(x + 1));
          if (w == 0 && (wtid & 3) == 0 && get<1>(cQp(x)) == get<1>(cQp(0)))  // each row's offset, once
            S.dq_row[r] = t < 0 ? int64_t(-1) : at - d;
        }
      }
      if constexpr (!kDet) {
        ptx::fence_proxy_async_smem();  // the tile is read by the TMA engine (async proxy)
        sync.dq_full.arrive();
      }
      // dz^T is rewritten next chunk: both warpgroups must be past their dQp GEMM
      barrier_sync(NamedBarrier::kConsumers, kConsumerThreads);
    }
    ++state;
  }

  if (kDet && bad) atomicOr(reinterpret_cast<int32_t*>(p.fix) + kBad + 3, 1);
  add_dkp<C::kHeadDim, kDet>(p, P.grads, accdKp, gain.unscale, thr_dkp, k.pk, key_base, k.L, s0);
}

}  // namespace flashmsa::cuda::attn_bwd
