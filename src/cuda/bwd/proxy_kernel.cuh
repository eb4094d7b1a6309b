// Proxy (KL) backward on Hopper: dqp, dkp and the kl value, key-block-outer over the same
// inversion as the main backward.
//
// One CTA = one key block j x one proxy head p (its G query heads share one kv head: Hkv | Hp).
// Chunks of 64 rows = NTc tokens x G heads. Per chunk the two consumer warpgroups (64 keys
// each) recompute S^T = K Q^T and the main probabilities P^T = exp2(S^T - lse2) of the G heads,
// stage them in shared memory and reduce them to the teacher t(key, token) = mean over the
// group's heads; the student comes from the proxy logits z^T = Kp Qp^T (kTok token columns,
// zero-padded) and the selection's proxy lse: s = exp(z - plse). dz = g (s - t) (the 1/N and
// the proxy scale are applied by the convert kernel, so dz keeps the precision of bf16/fp16);
// dKp_j += dz^T Qp stays in registers; dQp = dz Kp goes to an fp32 accumulator with atomics
// after a GEMM over both warpgroups' dz staged in shared memory. Each CTA writes its kl partial
// sum; a final kernel adds them in a fixed order.
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

template <class Element, int kTok>
struct ProxyConfig {
  static constexpr int kBlockN = kBlockKeys, kRows = 64, kHeadDim = kHeadDimInst;
  static constexpr int kThreads = kCtaThreads, kStages = 2, kConsumers = kConsumerThreads,
                       kProducers = kWarpGroupThreads;
  using Pipeline = cutlass::PipelineAsync<kStages>;
  using Major = cute::GMMA::Major;
  // K and Kp (keys, d); the Kp^T view (dp, keys): the A operand of dQp^T = Kp^T dz^T
  using SmemLayoutKV = SwizzledTile<Element, kBlockN, kHeadDim>;
  using SmemLayoutKt = TransposedView<SmemLayoutKV, kBlockN, kHeadDim>;
  using SmemLayoutRows = SwizzledTiles<Element, kRows, kHeadDim, kStages>;
  // proxy query rows (tokens, dp) per stage and the (dp, tokens) view
  using SmemLayoutTok = SwizzledTiles<Element, kTok, kHeadDim, kStages>;
  using SmemLayoutTokT = TransposedViews<SmemLayoutTok, kTok, kHeadDim, kStages>;
  // dz staged as (tokens, keys), keys contiguous: the B operand (N = tokens, K = keys) of dQp^T
  using SmemLayoutDz = SwizzledTile<Element, kTok, kBlockN>;
  using MmaS = SsMma<Element, 64, kRows, kHeadDim>;
  using MmaZ = SsMma<Element, 64, kTok, kHeadDim>;
  using MmadKp = RsMma<Element, 64, kHeadDim, kTok, Major::K, Major::MN>;
  using MmadQp = SsMma<Element, 64, kTok, kBlockN, Major::MN, Major::K>;

  struct Smem {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> kp;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutRows>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutTok>, 1024> qp;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutDz>, 1024> dz;
    float pt[kBlockN][kRows + 1];  // P^T of the chunk (fp32), padded row
    float lse2[kStages][kRows];
    float plse2[kStages][kTok];
    int32_t tok[kStages][kTok];  // global token of each token column; -1: padding
    int32_t rank[kStages][kTok];  // deterministic mode: the block's turn in each token's dqp sum
    typename Pipeline::SharedStorage pipe;
    cutlass::arch::ClusterTransactionBarrier kv_bar;
    float kl_warp[8];
  };
  static constexpr size_t kSmemBytes = sizeof(Smem) + 1024;
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared-memory plan over the SM's 227 KB");
};

// The kernel's parameters: the dispatcher's plain arguments plus the TMA descriptors of K_j, Kp_j.
template <class Element>
struct ProxyParams : ProxyArgs {
  using StageLayout = BlockLayout<Element>;
  TmaBlockLoad<Element, StageLayout> tma_k, tma_kp;
  TmaShape tma_shape_k, tma_shape_kp;
};

template <class Element, int kTok, bool kDet>
__global__ void __launch_bounds__(kCtaThreads, 1) bwd_proxy_kernel(const __grid_constant__ ProxyParams<Element> P) {
  using namespace cute;
  using C = ProxyConfig<Element, kTok>;
  using Pipeline = typename C::Pipeline;
  const Common& p = P.c;
  extern __shared__ char smem_raw[];
  auto& S = smem_struct<typename C::Smem>(smem_raw);
  const Turns turn = turns<kDet>(p);
  int32_t* const turn_rows = turn.rows;
  int32_t* const turn_keys = turn.keys;

  ProxyCta cta;
  if (!proxy_cta(p, cta)) return;
  const int gb = cta.gb, grp = cta.grp, b = cta.b, j = cta.j, tid = threadIdx.x;
  const int64_t kl_slot = cta.kl_slot, s0 = cta.s0, L = cta.L;
  const int G = P.G;
  const int h0 = grp * G;
  const int kvh = h0 / (p.Hq / p.Hkv), pk = grp / (p.Hp / p.Hpk);
  const int NTc = min(C::kRows / G, kTok);
  int n = 0;
  const int32_t* list = nullptr;
  int64_t dense_first = 0;
  if (p.dense) {
    dense_first = s0 + int64_t(j) * C::kBlockN;
    n = int(s0 + L - dense_first);
  } else {
    const int64_t k = int64_t(grp) * p.inv.nblk + gb;
    n = p.inv.offsets[k + 1] - p.inv.offsets[k];
    list = p.inv.tokens + p.inv.offsets[k];
  }
  // deterministic mode: this proxy head's turn among those adding into the same dKp_j rows
  const int ppk = p.Hp / p.Hpk;
  int32_t* kp_turn = (P.grads && turn_keys) ? turn_keys + int64_t(gb) * p.Hpk + pk : nullptr;
  if (n <= 0) {
    finish_empty_cta(p.kl_acc, kl_slot, kp_turn, grp % ppk);
    return;
  }
  const int nchunks = (n + NTc - 1) / NTc;
  const int role_wg = tid / kWarpGroupThreads;

  Pipeline pipeline = make_chunk_pipeline<Pipeline>(S.pipe, role_wg, C::kProducers, C::kConsumers, S.kv_bar);

  Tensor sK = make_tensor(make_smem_ptr(S.k.data()), typename C::SmemLayoutKV{});
  Tensor sKp = make_tensor(make_smem_ptr(S.kp.data()), typename C::SmemLayoutKV{});
  Tensor sQ = make_tensor(make_smem_ptr(S.q.data()), typename C::SmemLayoutRows{});
  Tensor sQp = make_tensor(make_smem_ptr(S.qp.data()), typename C::SmemLayoutTok{});

  if (role_wg == 0) {  // ---- producer ----
    cutlass::arch::warpgroup_reg_dealloc<kBwdRegs.producer>();
    if (tid == 0) {  // K_j and Kp_j, once, by TMA
      S.kv_bar.arrive_and_expect_tx(2 * C::kBlockN * C::kHeadDim * sizeof(Element));
      tma_load_block(P.tma_k, P.tma_shape_k, kvh, b, s0, P.batched, j, sK, S.kv_bar);
      tma_load_block(P.tma_kp, P.tma_shape_kp, pk, b, s0, P.batched, j, sKp, S.kv_bar);
    }
    const Element* qptr = static_cast<const Element*>(p.q.ptr);
    const Element* qpptr = static_cast<const Element*>(p.qp.ptr);
    const int64_t pad0 = padded_offset(s0, b, kPadTile) - s0;
    auto state = cutlass::make_producer_start_state<Pipeline>();
    for (int c = 0; c < nchunks; ++c) {
      pipeline.producer_acquire(state);
      const int st = state.index();
      for (int x = tid; x < C::kRows * 16; x += kWarpGroupThreads) {  // Q rows: token r / G, head h0 + r % G
        const int r = x / 16, col = (x % 16) * 8;
        const int li = min(c * NTc + min(r / G, NTc - 1), n - 1);
        const int64_t t = p.dense ? dense_first + li : int64_t(list[li]);
        ptx::cp_async_16(&sQ(r, col, st), qptr + b * p.q.batch_corr + t * p.q.tok + (h0 + r % G) * p.q.head + col);
      }
      for (int x = tid; x < kTok * 16; x += kWarpGroupThreads) {  // Qp rows, zero past the chunk's tokens
        const int r = x / 16, col = (x % 16) * 8;
        const int li = c * NTc + r;
        const bool valid = r < NTc && li < n;
        const int64_t t = valid ? (p.dense ? dense_first + li : int64_t(list[li])) : s0;
        ptx::cp_async_16(&sQp(r, col, st), qpptr + b * p.qp.batch_corr + t * p.qp.tok + grp * p.qp.head + col,
                         valid ? 16 : 0);
      }
      if (tid < C::kRows) {
        const int r = tid;
        const int li = c * NTc + r / G;
        const bool valid = r / G < NTc && li < n;
        const int64_t t = valid ? (p.dense ? dense_first + li : int64_t(list[li])) : 0;
        S.lse2[st][r] = valid ? *p.lse2.at(h0 + r % G, pad0 + t) : 0.f;
      }
      if (tid < kTok) {
        const int r = tid;
        const int li = c * NTc + r;
        const bool valid = r < NTc && li < n;
        const int64_t t = valid ? (p.dense ? dense_first + li : int64_t(list[li])) : -1;
        S.tok[st][r] = int32_t(t);
        // deterministic mode (DENSE only, proxy_side.cpp): block j is every token's j-th
        S.rank[st][r] = (!valid || !turn_rows) ? 0 : j;
        S.plse2[st][r] = valid ? *p.plse.at(grp, t) * kLog2e : 0.f;
      }
      ptx::cp_async_commit();
      ptx::cp_async_wait<0>();
      ptx::fence_proxy_async_smem();
      pipeline.producer_commit(state);
      ++state;
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<kBwdRegs.consumer>();
  const int w = role_wg - 1, wtid = tid % kWarpGroupThreads;
  Tensor sQpT = make_tensor(make_smem_ptr(S.qp.data()), typename C::SmemLayoutTokT{});
  Tensor sKpT = make_tensor(make_smem_ptr(S.kp.data()), typename C::SmemLayoutKt{});
  Tensor sDz = make_tensor(make_smem_ptr(S.dz.data()), typename C::SmemLayoutDz{});

  typename C::MmaS mma_s;
  typename C::MmaZ mma_z;
  typename C::MmadKp mma_dkp;
  typename C::MmadQp mma_dqp;
  auto thr_s = mma_s.get_thread_slice(wtid);
  auto thr_z = mma_z.get_thread_slice(wtid);
  auto thr_dkp = mma_dkp.get_thread_slice(wtid);
  auto thr_dqp = mma_dqp.get_thread_slice(wtid);
  Tensor tSrK = thr_s.partition_fragment_A(local_tile(sK, Shape<_64, Int<C::kHeadDim>>{}, make_coord(w, _0{})));
  Tensor tSrQ = thr_s.partition_fragment_B(sQ);
  Tensor tZrKp = thr_z.partition_fragment_A(local_tile(sKp, Shape<_64, Int<C::kHeadDim>>{}, make_coord(w, _0{})));
  Tensor tZrQp = thr_z.partition_fragment_B(sQp);
  Tensor tKprQpT = thr_dkp.partition_fragment_B(sQpT);  // (N = dp, K = tokens, stage)
  Tensor tQprKpT = thr_dqp.partition_fragment_A(local_tile(sKpT, Shape<_64, Int<C::kBlockN>>{}, make_coord(w, _0{})));
  Tensor tQprDz = thr_dqp.partition_fragment_B(sDz);

  Tensor accS = partition_fragment_C(mma_s, Shape<_64, Int<C::kRows>>{});
  Tensor accZ = partition_fragment_C(mma_z, Shape<_64, Int<kTok>>{});
  Tensor accdKp = partition_fragment_C(mma_dkp, Shape<_64, Int<C::kHeadDim>>{});
  Tensor accdQp = partition_fragment_C(mma_dqp, Shape<_64, Int<kTok>>{});  // (dp, token)
  clear(accdKp);
  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<_64, Int<C::kRows>>{}));   // (key, row)
  Tensor cZ = thr_z.partition_C(make_identity_tensor(Shape<_64, Int<kTok>>{}));       // (key, token)
  Tensor cQp = thr_dqp.partition_C(make_identity_tensor(Shape<_64, Int<kTok>>{}));    // (dp, token)

  const float sl2 = p.scale * kLog2e, psl2 = p.proxy_scale * kLog2e;
  const KlGain gain = kl_gain((P.grads && p.dkl) ? *p.dkl : 0.f);  // dz's gain, undone on dQp and dKp
  const int64_t key_base = int64_t(j) * C::kBlockN + 64 * w;
  float kl_sum = 0.f;
  S.kv_bar.wait(0);

  typename Pipeline::PipelineState state;
  for (int c = 0; c < nchunks; ++c) {
    pipeline.consumer_wait(state);
    const int st = state.index();
    wg_gemm<true>(mma_s, tSrK, tSrQ(_, _, _, st), accS);
    wg_gemm<true>(mma_z, tZrKp, tZrQp(_, _, _, st), accZ);
    // P^T of the G heads into shared memory (this warpgroup's 64 keys)
#pragma unroll
    for (int x = 0; x < size(accS); ++x) {
      const int key = get<0>(cS(x)), r = get<1>(cS(x));
      const int tc = r / G;
      const int32_t t = tc < NTc ? S.tok[st][tc] : -1;
      const bool ok = t >= 0 && key_base + key <= int64_t(t) - s0;
      S.pt[64 * w + key][r] = ok ? ptx::exp2f_approx(accS(x) * sl2 - S.lse2[st][r]) : 0.f;
    }
    barrier_sync(consumer_wg_barrier(w), kWarpGroupThreads);
    // teacher, student, dz (in the z^T accumulator), kl
#pragma unroll
    for (int x = 0; x < size(accZ); ++x) {
      const int key = get<0>(cZ(x)), tc = get<1>(cZ(x));
      const int32_t t = tc < NTc ? S.tok[st][tc] : -1;
      const bool ok = t >= 0 && key_base + key <= int64_t(t) - s0;
      float dz = 0.f;
      if (ok) {
        float tsum = 0.f;
        for (int h = 0; h < G; ++h) tsum += S.pt[64 * w + key][tc * G + h];
        const float teacher = tsum / float(G);  // the group's mean
        const float zl2 = accZ(x) * psl2 - S.plse2[st][tc];  // log2 of the student
        dz = kl_element(teacher, zl2, gain.gain, kl_sum);
      }
      accZ(x) = dz;
    }
    Tensor rDz = make_tensor_like<Element>(accZ);
#pragma unroll
    for (int x = 0; x < size(accZ); ++x) rDz(x) = Element(accZ(x));
    if (P.grads) {
      // dKp_j += dz^T Qp
      wg_gemm<false>(mma_dkp, make_tensor(rDz.data(), acc_to_a_regs(rDz.layout())), tKprQpT(_, _, _, st), accdKp);
      // stage dz as (token, key) for dQp^T = Kp^T dz^T over all 128 keys
#pragma unroll
      for (int x = 0; x < size(accZ); ++x) sDz(get<1>(cZ(x)), 64 * w + get<0>(cZ(x))) = rDz(x);
    }
    int32_t my_tok[kTok];
#pragma unroll
    for (int tc = 0; tc < kTok; ++tc) my_tok[tc] = S.tok[st][tc];
    // deterministic mode: threads < NTc of warpgroup 0 each hold one token's turn in its dqp sum
    int32_t* q_turn = nullptr;
    int32_t q_rank = 0;
    if (P.grads && turn_rows && w == 0 && wtid < NTc && S.tok[st][wtid] >= 0) {
      q_turn = turn_rows + int64_t(S.tok[st][wtid]) * p.Hp + grp;
      q_rank = S.rank[st][wtid];
    }
    pipeline.consumer_release(state);
    ptx::fence_proxy_async_smem();
    barrier_sync(NamedBarrier::kConsumers, kConsumerThreads);
    if (P.grads) {
      wg_gemm<true>(mma_dqp, tQprKpT, tQprDz, accdQp);
      if (turn_rows) {  // wait for the token's lower blocks to have added
        if (q_turn) ptx::wait_turn(q_turn, q_rank);
        barrier_sync(NamedBarrier::kConsumers, kConsumerThreads);
      }
#pragma unroll
      for (int x = 0; x < size(accdQp); ++x) {
        const int d = 64 * w + get<0>(cQp(x)), tc = get<1>(cQp(x));
        const int32_t t = my_tok[tc];
        if (t < 0) continue;
        atomicAdd(p.dqp_acc + (int64_t(t) * p.Hp + grp) * C::kHeadDim + d, accdQp(x) * gain.unscale);
      }
    }
    if (P.grads && turn_rows) __threadfence();  // the adds visible before the turn passes on
    // sDz and S.pt are rewritten next chunk: every consumer must be past its reads
    barrier_sync(NamedBarrier::kConsumers, kConsumerThreads);
    if (q_turn) ptx::st_release_gpu(q_turn, q_rank + 1);
    ++state;
  }

  proxy_cta_tail<C::kHeadDim>(p, P.grads, accdKp, gain.unscale, thr_dkp, kp_turn, grp, pk, key_base, L, s0, kl_sum,
                              S.kl_warp, kl_slot);
}

template <class Element, int kTok, bool kDet>
void launch_proxy(const ProxyParams<Element>& P, cudaStream_t stream) {
  using C = ProxyConfig<Element, kTok>;
  auto kernel = bwd_proxy_kernel<Element, kTok, kDet>;
  FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(C::kSmemBytes)));
  if (P.c.inv.nblk == 0) return;
  const dim3 grid = cta_grid(P.c.inv.nblk, P.c.Hp);
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(P);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

// bwd.h's run_proxy: the TMA descriptors of K_j and Kp_j, then the launch (one per TU).
template <Dtype D, int kTok, bool kDet>
void run_proxy(const ProxyArgs& a, cudaStream_t stream) {
  using Element = typename ElementOf<D>::type;
  using Stage = typename ProxyParams<Element>::StageLayout;
  ProxyParams<Element> p;
  static_cast<ProxyArgs&>(p) = a;
  const auto tk = make_block_load<Element, Stage>(a.c.k, a.c.Hkv, a.batched, a.c.seqs.seqlen, a.c.seqs.batch, a.total);
  const auto tkp = make_block_load<Element, Stage>(a.c.kp, a.c.Hpk, a.batched, a.c.seqs.seqlen, a.c.seqs.batch, a.total);
  p.tma_k = tk.copy;
  p.tma_shape_k = tk.shape;
  p.tma_kp = tkp.copy;
  p.tma_shape_kp = tkp.shape;
  launch_proxy<Element, kTok, kDet>(p, stream);
}

}  // namespace flashmsa::cuda::attn_bwd
