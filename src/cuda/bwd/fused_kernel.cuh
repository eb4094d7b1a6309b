// The main backward and the proxy (kl) backward of every mode (DENSE's lists, of the backward and of the
// forward's kl, are every token from the block on) in one persistent
// kernel, with the teacher in a per-CTA scratch instead of a buffer over every inversion entry.
//
// With a kl the main walk's unit is one MSA group (R = G: one proxy head), so the main walk of
// (key block j, proxy head p) produces exactly the teacher rows that the kl walk of (j, p)
// reads. One CTA runs both walks over the same list, in segments of at most `seg` entries:
//   main walk (bwd_kernel.cuh: dq per chunk, dK_j and dV_j of the segment added at its end, the
//   segment's teacher rows to this CTA's scratch), a CTA barrier, kl walk (kl_kernel.cuh: dQp per
//   chunk, dKp_j of the segment at its end, the kl terms), a CTA barrier.
// The two walks' shared-memory plans overlay each other (a union); their pipelines and block
// barriers live outside it, are initialised once, and carry their states from segment to segment
// and item to item. The grid is persistent: min(items, SMs) CTAs, each taking the next item
// (key block, proxy head) from a counter in the order of the standalone kernels' 1-D grid
// (cta_coord: the proxy heads of a block next to each other, long lists first), so the scratch
// is indexed by the CTA and never shared. Scratch: CTAs x seg x 128 floats (69 MB for 132 x 1024)
// instead of Hp x tokens x topk x 128 floats (0.54 GB at the fmsa heads and 16k tokens).
// teacher_only (the forward's kl) walks without dP, dS and the gradients. main_only (SPARSE/GIVEN
// without a proxy side, e.g. a frozen indexer; DENSE without one): the main walk alone, one segment
// per item, no teacher (the persistent items, the slot shuffle and the store-first dq of this
// kernel made that walk 7-13% faster than the standalone kernel's: H200, docs/kernels/bwd.md).
#pragma once

#include "cuda/bwd/bwd_kernel.cuh"
#include "cuda/bwd/kl_kernel.cuh"

namespace flashmsa::cuda::attn_bwd {

// The kernel's parameters: the dispatcher's plain arguments plus the TMA descriptors of K_j, V_j
// (the main walk) and Kp_j (the kl walk); the names the walks read.
template <class Element, bool kDet>
struct FusedParams : FusedArgs {
  static constexpr bool kDetMode = kDet;
  static constexpr bool kFusedWalk = true;
  using ElementType = Element;
  using StageLayout = BlockLayout<Element>;
  TmaBlockLoad<Element, StageLayout> tma_k, tma_v, tma_kp;
  TmaShape tma_shape, tma_shape_kp;
};

template <class Element>
struct FusedConfig {
  using CM = MainConfig<Element>;
  using CK = KlConfig<Element>;
  struct Plan {
    union Walks {
      typename CM::Smem m;
      typename CK::Smem k;
    } u;
    typename CM::Sync ms;
    typename CK::Sync ks;
    float kl_warp[8];
    int item[2];  // the CTA's current item, double-buffered by iteration
  };
  static constexpr size_t kSmemBytes = sizeof(Plan) + 1024;
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared-memory plan over the SM's 227 KB");
  static_assert(CK::kTok % CM::kRows == 0 || CM::kRows % CK::kTok == 0, "segments cut both walks' chunks");
};

// Register budgets: the producer keeps both walks' item state next to its gather loops, so it
// gets 40 registers and the consumers 232 (40 x 128 + 232 x 256 = 64512, the CTA's launch
// allocation of 168 per thread x 384 under __launch_bounds__(384, 1): setmaxnreg only moves
// registers inside it; a producer at 32 with consumers at 240, 65536, hung the kernel). With the
// standalone kernels' 24 / 240 the producer spilled in its gather loops and the backward was
// 4-10% slower than with 40 / 232 (H200, m3 32k random 23.15 vs 20.93 ms; docs/kernels/bwd.md,
// the fused kernel's register split).
constexpr RegBudget kFusedRegs{40, 232};
static_assert(fits_register_file(kFusedRegs), "setmaxnreg budgets exceed the CTA's launch allocation");

template <class Element, bool kDet>
__global__ void __launch_bounds__(kCtaThreads, 1) bwd_fused_kernel(const __grid_constant__ FusedParams<Element, kDet> P) {
  using F = FusedConfig<Element>;
  using PM = typename F::CM::Pipeline;
  using PK = typename F::CK::Pipeline;
  const Common& p = P.c;
  extern __shared__ char smem_raw[];
  auto& S = smem_struct<typename F::Plan>(smem_raw);
  const int tid = threadIdx.x, role_wg = tid / kWarpGroupThreads;
  // The CTA-wide barrier between the roles, which reach it from their own copies of the loop below:
  // a named barrier with the CTA's thread count, as FlashAttention-3's tile scheduler syncs its
  // producer and consumers. (compute-sanitizer synccheck calls an aligned barrier reached from two
  // code locations divergent; the unaligned barrier.sync that it accepts made the backward 18%
  // slower: docs/kernels/bwd.md.)
  auto cta_sync = [] { barrier_sync(NamedBarrier::kCta, kCtaThreads); };
  const bool producer = role_wg == 0;
  init_dq_writer(S.ms);
  init_dq_writer(S.ks);
  PM pm = make_chunk_pipeline<PM>(S.ms.pipe, role_wg, F::CM::kProducers, F::CM::kConsumers, S.ms.kv_bar);
  PK pk = make_chunk_pipeline<PK>(S.ks.pipe, role_wg, F::CK::kProducers, F::CK::kConsumers, S.ks.kp_bar);
  float* const scratch = P.scratch ? P.scratch + int64_t(blockIdx.x) * P.seg * kBlockKeys : nullptr;  // main_only: none
  const int items = p.inv.nblk * p.Hp;
  // The next item (from the counter) and its walks; false past the last item. Each role runs its
  // own copy of the loop below: setmaxnreg holds only where the two roles' code is apart.
  auto next_item = [&](int it, MainItem& m, KlItem& k, bool& live) {
    if (tid == 0) S.item[it & 1] = atomicAdd(P.next_item, 1);
    cta_sync();
    const int item = S.item[it & 1];
    if (item >= items) return false;
    const int gb = item / p.Hp, grp = item % p.Hp;
    live = main_item(p, gb, grp, m);
    if (!P.main_only) kl_item(p, gb, grp, k);
    return true;
  };
  // after each walk: its global stores (the teacher rows) and shared-memory writes (generic and
  // async proxy) ordered before the other walk's loads overwrite or read them
  auto walk_done = [&] {
    ptx::fence_proxy_async_smem();
    cta_sync();
  };
  uint32_t loads = 0;  // block loads so far (both barriers: one per segment); parity = the phase
  MainItem m;
  KlItem k;
  bool live = false;
  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<kFusedRegs.producer>();
    auto sm = cutlass::make_producer_start_state<PM>();
    auto sk = cutlass::make_producer_start_state<PK>();
    for (int it = 0; next_item(it, m, k, live); ++it) {
      if (!live) {  // nothing to walk: the item's kl partial is 0
        if (tid == 0 && p.kl_acc) p.kl_acc[k.kl_slot] = 0.f;
        continue;
      }
      for (int first = 0; first < m.n; first += P.seg) {
        const int count = min(P.seg, m.n - first);
        main_produce<Element>(P, S.u.m, pm, sm, S.ms, m, first, count);
        walk_done();
        if (P.main_only) continue;
        kl_produce<Element>(P, S.u.k, pk, sk, S.ks, k, first, count, scratch);
        walk_done();
      }
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<kFusedRegs.consumer>();
  typename PM::PipelineState sm;
  typename PK::PipelineState sk;
  for (int it = 0; next_item(it, m, k, live); ++it) {
    if (!live) continue;
    float kl_sum = 0.f;
    for (int first = 0; first < m.n; first += P.seg) {
      const int count = min(P.seg, m.n - first);
      main_consume<Element>(P, S.u.m, pm, sm, S.ms, loads & 1, m, count, scratch);
      walk_done();
      if (P.main_only) {
        ++loads;
        continue;
      }
      kl_consume<Element>(P, S.u.k, pk, sk, S.ks, loads & 1, k, count, kl_sum);
      ++loads;
      walk_done();
    }
    if (p.kl_acc) store_kl_partial(kl_sum, S.kl_warp, p.kl_acc, k.kl_slot);
  }
}

// The items' counter must be zero at the launch (the dispatcher zeroes it with the accumulators).
template <class Element, bool kDet>
void launch_fused(const FusedParams<Element, kDet>& P, cudaStream_t stream) {
  using F = FusedConfig<Element>;
  auto kernel = bwd_fused_kernel<Element, kDet>;
  FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(F::kSmemBytes)));
  const int64_t items = int64_t(P.c.inv.nblk) * P.c.Hp;
  if (items == 0 || P.ctas <= 0) return;
  const dim3 grid(unsigned(items < P.ctas ? items : P.ctas));
  kernel<<<grid, kCtaThreads, F::kSmemBytes, stream>>>(P);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

// bwd.h's run_fused: the TMA descriptors of K_j, V_j and Kp_j, then the launch (one per TU).
template <Dtype D, bool kDet>
void run_fused(const FusedArgs& a, cudaStream_t stream) {
  using Element = typename ElementOf<D>::type;
  FusedParams<Element, kDet> p;
  static_cast<FusedArgs&>(p) = a;
  set_main_tma(p, a.c, a.batched, a.teacher_only, a.total);
  if (!a.main_only) {  // (main_only: no kp)
    const auto t = make_block_load<Element, BlockLayout<Element>>(a.c.kp, a.c.Hpk, a.batched, a.c.seqs.seqlen,
                                                                  a.c.seqs.batch, a.total);
    p.tma_kp = t.copy;
    p.tma_shape_kp = t.shape;
  }
  launch_fused<Element, kDet>(p, stream);
}

}  // namespace flashmsa::cuda::attn_bwd
