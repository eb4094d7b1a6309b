// Proxy (KL) backward from a stored teacher, SPARSE/GIVEN mode: dqp, dkp and the kl value,
// key-block-outer over the same inversion as the main backward.
//
// The main backward (bwd_kernel.cuh) already has the main probabilities of every list entry and
// stores the teacher t(entry, key) = mean over the group's heads, fp32 [entries, 128]. This
// kernel needs only the proxy side, so a chunk is 64 tokens (not 64 / G as when the teacher is
// recomputed): one CTA = one key block j x one proxy head p; per chunk the producer gathers the
// 64 Qp rows and the 64 teacher rows (contiguous entries) with cp.async; the consumers
// (2 warpgroups x 64 keys) compute z^T = Kp Qp^T, the student s = exp(z - plse), dz = g (s - t)
// (the 1/N and the proxy scale are applied by the convert kernel), the kl terms
// t (ln t - ln s); dKp_j += dz^T Qp stays in registers, dQp = dz Kp goes through dz^T staged in
// shared memory to an fp32 accumulator with float2 atomics. Each CTA writes its kl partial.
// DENSE (warmup) mode keeps the recomputing proxy kernel (proxy_kernel.cuh): its teacher buffer
// would hold every causal (token, key) pair.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "cuda/bwd/bwd.h"
#include "cuda/bwd/bwd_common.cuh"
#include "cuda/bwd/kl_rule.cuh"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/order.cuh"

namespace flashmsa::cuda::attn_bwd {

template <class Element>
struct KlConfig {
  static constexpr int kBlockN = kBlockKeys, kTok = 64, kHeadDim = kHeadDimInst, kTeachStride = 132;  // 132: no bank conflicts
  static constexpr int kThreads = kCtaThreads, kStages = 2, kConsumers = kConsumerThreads,
                       kProducers = kWarpGroupThreads;
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
    typename Pipeline::SharedStorage pipe;
    cutlass::arch::ClusterTransactionBarrier kp_bar;
    float kl_warp[8];
  };
  static constexpr size_t kSmemBytes = sizeof(Smem) + 1024;
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared-memory plan over the SM's 227 KB");
};

// The kernel's parameters: the dispatcher's plain arguments plus the TMA descriptor of Kp_j.
template <class Element>
struct KlParams : KlArgs {
  using StageLayout = BlockLayout<Element>;
  TmaBlockLoad<Element, StageLayout> tma_kp;
  TmaShape tma_shape_kp;
};

template <class Element, bool kDet>
__global__ void __launch_bounds__(kCtaThreads, 1) bwd_kl_kernel(const __grid_constant__ KlParams<Element> P) {
  using namespace cute;
  using C = KlConfig<Element>;
  using Pipeline = typename C::Pipeline;
  const Common& p = P.c;
  extern __shared__ char smem_raw[];
  auto& S = smem_struct<typename C::Smem>(smem_raw);

  ProxyCta cta;
  if (!proxy_cta(p, cta)) return;
  const int gb = cta.gb, grp = cta.grp, b = cta.b, j = cta.j, tid = threadIdx.x;
  const int64_t kl_slot = cta.kl_slot, s0 = cta.s0, L = cta.L;
  const int pk = grp / (p.Hp / p.Hpk);
  const int64_t entry0 = p.inv.offsets[int64_t(grp) * p.inv.nblk + gb];
  const int n = p.inv.offsets[int64_t(grp) * p.inv.nblk + gb + 1] - int(entry0);
  const int32_t* list = p.inv.tokens + entry0;
  if (n <= 0) {
    finish_empty_cta(p.kl_acc, kl_slot, nullptr, 0);
    return;
  }
  const int nchunks = (n + C::kTok - 1) / C::kTok;
  const int role_wg = tid / kWarpGroupThreads;

  Pipeline pipeline = make_chunk_pipeline<Pipeline>(S.pipe, role_wg, C::kProducers, C::kConsumers, S.kp_bar);

  Tensor sKp = make_tensor(make_smem_ptr(S.kp.data()), typename C::SmemLayoutKp{});
  Tensor sQp = make_tensor(make_smem_ptr(S.qp.data()), typename C::SmemLayoutQp{});

  if (role_wg == 0) {  // ---- producer ----
    cutlass::arch::warpgroup_reg_dealloc<kBwdRegs.producer>();
    if (tid == 0) {  // Kp_j, once, by TMA
      S.kp_bar.arrive_and_expect_tx(C::kBlockN * C::kHeadDim * sizeof(Element));
      tma_load_block(P.tma_kp, P.tma_shape_kp, pk, b, s0, P.batched, j, sKp, S.kp_bar);
    }
    const Element* qpptr = static_cast<const Element*>(p.qp.ptr);
    auto row_token = [&](int c) -> int32_t {  // token of row `tid` of chunk c (threads < 64)
      const int li = c * C::kTok + tid;
      return (tid < C::kTok && li < n) ? list[li] : -1;
    };
    int32_t next = row_token(0);
    auto state = cutlass::make_producer_start_state<Pipeline>();
    for (int c = 0; c < nchunks; ++c) {
      pipeline.producer_acquire(state);
      const int st = state.index();
      if (tid < C::kTok) S.tok[st][tid] = next;
      if (c + 1 < nchunks) next = row_token(c + 1);
      barrier_sync(NamedBarrier::kProducer, kWarpGroupThreads);
      for (int x = tid; x < C::kTok * 16; x += kWarpGroupThreads) {  // Qp rows, zero past the list
        const int r = x / 16, col = (x % 16) * 8;
        const int32_t t = S.tok[st][r];
        const int64_t tt = t >= 0 ? t : s0;
        ptx::cp_async_16(&sQp(r, col, st), qpptr + b * p.qp.batch_corr + tt * p.qp.tok + grp * p.qp.head + col,
                         t >= 0 ? 16 : 0);
      }
      for (int x = tid; x < C::kTok * 32; x += kWarpGroupThreads) {  // teacher rows (contiguous entries)
        const int r = x / 32, col = (x % 32) * 4;
        const bool valid = c * C::kTok + r < n;
        const float* src = P.teacher + (entry0 + (valid ? int64_t(c) * C::kTok + r : 0)) * C::kBlockN + col;
        ptx::cp_async_16(&S.teach[st][r][col], src, valid ? 16 : 0);
      }
      if (tid < C::kTok) {
        const int32_t t = S.tok[st][tid];
        ptx::cp_async_4(&S.plse[st][tid], p.plse.at(grp, t >= 0 ? t : s0), t >= 0 ? 4 : 0);
      }
      pipeline.producer_commit(state, cutlass::arch::cpasync_barrier_arrive);
      ++state;
    }
    ptx::cp_async_wait<0>();
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<kBwdRegs.consumer>();
  const int w = role_wg - 1, wtid = tid % kWarpGroupThreads;
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

  const float psl2 = p.proxy_scale * kLog2e;
  const float coef = (P.grads && p.dkl) ? *p.dkl : 0.f;
  const float unit = kDet ? p.fix[kUnitDqp] : 0.f;  // deterministic mode: dQp's fixed-point unit
  bool bad = false;
  const int64_t key_base = int64_t(j) * C::kBlockN + 64 * w;
  float kl_sum = 0.f;
  S.kp_bar.wait(0);

  typename Pipeline::PipelineState state;
  for (int c = 0; c < nchunks; ++c) {
    pipeline.consumer_wait(state);  // (no proxy fence: see bwd_kernel.cuh)
    const int st = state.index();
    wg_gemm<true>(mma_z, tZrKp, tZrQp(_, _, _, st), accZ);
#pragma unroll
    for (int x = 0; x < size(accZ); ++x) {
      const int key = get<0>(cZ(x)), r = get<1>(cZ(x));
      const int32_t t = S.tok[st][r];
      const bool ok = t >= 0 && key_base + key <= int64_t(t) - s0;
      float dz = 0.f;
      if (ok) {
        const float zl2 = accZ(x) * psl2 - S.plse[st][r] * kLog2e;  // log2 of the student
        dz = kl_element(S.teach[st][r][64 * w + key], zl2, coef, kl_sum);
      }
      accZ(x) = dz;
    }
    Tensor rDz = make_tensor_like<Element>(accZ);
#pragma unroll
    for (int x = 0; x < size(accZ); ++x) rDz(x) = Element(accZ(x));
    const int32_t tok_a = S.tok[st][get<0>(cQp(0))], tok_b = S.tok[st][get<0>(cQp(0)) + 8];
    if (P.grads) {
      wg_gemm<false>(mma_dkp, make_tensor(rDz.data(), acc_to_a_regs(rDz.layout())), tKprQpT(_, _, _, st), accdKp);
#pragma unroll
      for (int x = 0; x < size(accZ); ++x) sDz(64 * w + get<0>(cZ(x)), get<1>(cZ(x))) = rDz(x);
    }
    pipeline.consumer_release(state);
    if (P.grads) {
      ptx::fence_proxy_async_smem();
      barrier_sync(NamedBarrier::kConsumers, kConsumerThreads);  // dz^T staged by both
      wg_gemm<true>(mma_dqp, tQprDz, tQprKp, accdQp);
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
          if (t < 0) continue;
          atomicAdd(reinterpret_cast<float2*>(p.dqp_acc + at), make_float2(accdQp(x), accdQp(x + 1)));
        }
      }
      // dz^T is rewritten next chunk: both warpgroups must be past their dQp GEMM
      barrier_sync(NamedBarrier::kConsumers, kConsumerThreads);
    }
    ++state;
  }

  if (kDet && bad) atomicOr(reinterpret_cast<int32_t*>(p.fix) + kBad + 3, 1);
  proxy_cta_tail<C::kHeadDim, kDet>(p, P.grads, accdKp, thr_dkp, nullptr, grp, pk, key_base, L, s0, kl_sum, S.kl_warp,
                              kl_slot);
}

template <class Element, bool kDet>
void launch_kl(const KlParams<Element>& P, cudaStream_t stream) {
  using C = KlConfig<Element>;
  auto kernel = bwd_kl_kernel<Element, kDet>;
  FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(C::kSmemBytes)));
  if (P.c.inv.nblk == 0) return;
  const dim3 grid = cta_grid(P.c.inv.nblk, P.c.Hp);
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(P);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

// bwd.h's run_kl: the TMA descriptor of Kp_j, then the launch (one instantiation per TU).
template <Dtype D, bool kDet>
void run_kl(const KlArgs& a, cudaStream_t stream) {
  using Element = typename ElementOf<D>::type;
  KlParams<Element> p;
  static_cast<KlArgs&>(p) = a;
  const auto t = make_block_load<Element, typename KlParams<Element>::StageLayout>(
      a.c.kp, a.c.Hpk, a.batched, a.c.seqs.seqlen, a.c.seqs.batch, a.total);
  p.tma_kp = t.copy;
  p.tma_shape_kp = t.shape;
  launch_kl<Element, kDet>(p, stream);
}

}  // namespace flashmsa::cuda::attn_bwd
