// Main backward on Hopper (dq, dk, dv of the sparse attention), key-block-outer over the
// index inversion.
//
// One CTA = one key block j (128 keys of one sequence) x one head unit (R query heads sharing a
// group and a kv head). It walks the inverted list of the tokens that selected block j in
// chunks of 64 rows = NTc tokens x R heads (m3: 4 x 16), so no masked work is paid beyond the
// causal diagonal and partial chunks. dK_j and dV_j accumulate in registers for the whole list
// (two consumer warpgroups own 64 keys each, S^T = K Q^T layout as in FlashAttention-3's
// backward); dQ of each chunk goes to an fp32 accumulator with float2 atomics after a GEMM
// over both warpgroups' dS^T staged in shared memory. Warpgroup 0 produces: the chunk's Q and
// dO rows (gathered per token with cp.async), and its lse (log2) and dpsum from the padded
// buffers of the preprocess, into a two-stage mbarrier pipeline; K_j and V_j come once by TMA.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "cuda/bwd/bwd_params.cuh"
#include "cuda/common/utils.cuh"
#include "cuda/ptx/cp_async.cuh"

namespace flashmsa::cuda::attn_bwd {

template <class Element>
struct MainConfig {
  static constexpr int kBlockN = 128, kRows = 64, kHeadDim = 128;
  static constexpr int kThreads = 384, kStages = 2, kConsumers = 256, kProducers = 128;
  using Pipeline = cutlass::PipelineAsync<kStages>;
  using AtomK = cute::GMMA::Layout_K_SW128_Atom<Element>;
  // K, V resident: (keys, d), d contiguous
  using SmemLayoutKV = decltype(cute::tile_to_shape(AtomK{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // K^T view (d, keys) for dQ = dS K
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{},
                                                cute::Step<cute::_2, cute::_1>{})));
  // chunk rows (rows, d) per stage, and their (d, rows) views for dV += P^T dO, dK += dS^T Q
  using SmemLayoutRows = decltype(cute::tile_to_shape(
      AtomK{}, cute::Shape<cute::Int<kRows>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  using SmemLayoutRowsT = decltype(cute::composition(
      SmemLayoutRows{}, cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kRows>, cute::Int<kStages>>{},
                                                  cute::Step<cute::_2, cute::_1, cute::_3>{})));
  // dS^T staging (keys, rows), rows contiguous; double-buffered; and its (rows, keys) view
  using SmemLayoutdS = decltype(cute::tile_to_shape(
      AtomK{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kRows>, cute::_2>{}));
  using SmemLayoutdSt = decltype(cute::composition(
      SmemLayoutdS{}, cute::make_ordered_layout(cute::Shape<cute::Int<kRows>, cute::Int<kBlockN>, cute::_2>{},
                                                cute::Step<cute::_2, cute::_1, cute::_3>{})));
  // S^T = K Q^T and dP^T = V dO^T: (64 keys) x (64 rows) x d
  using MmaSdp = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kRows>, cute::Int<kHeadDim>>>(),
      cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>{}));
  // dV += P^T dO and dK += dS^T Q: (64 keys) x d x (64 rows), A from registers
  using MmadKV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kHeadDim>, cute::Int<kRows>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>{}));
  // dQ = dS K: (64 rows) x (64 d, one half per warpgroup) x (128 keys)
  using MmadQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::_64, cute::Int<kBlockN>>,
                                 cute::GMMA::Major::MN, cute::GMMA::Major::MN>(),
      cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>{}));

  struct Smem {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> v;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutRows>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutRows>, 1024> dout;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutdS>, 1024> ds;
    float lse2[kStages][kRows];
    float dsum[kStages][kRows];
    int32_t tok[kStages][kRows];  // global token of each row; -1: padding row
    typename Pipeline::SharedStorage pipe;
    cutlass::arch::ClusterTransactionBarrier kv_bar;
  };
  static constexpr size_t kSmemBytes = sizeof(Smem) + 1024;
};

template <class Element>
struct MainParams {
  using StageLayout = typename MainConfig<Element>::SmemLayoutKV;
  TmaBlockLoad<Element, StageLayout> tma_k, tma_v;
  TmaShape tma_shape;
  bool batched = false;
  Common c;
};

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

template <class Element>
__global__ void __launch_bounds__(384, 1) bwd_main_kernel(const __grid_constant__ MainParams<Element> P) {
  using namespace cute;
  using C = MainConfig<Element>;
  using Pipeline = typename C::Pipeline;
  const Common& p = P.c;
  extern __shared__ char smem_raw[];
  auto& S = *reinterpret_cast<typename C::Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  const int gb = blockIdx.x, unit = blockIdx.y;
  const int b = seq_of_block(p.inv.blk_off, p.seqs.batch, gb);
  if (b < 0) return;
  int64_t s0, L;
  p.seqs.get(b, s0, L);
  const int j = gb - p.inv.blk_off[b];
  const int h0 = unit * p.R;
  const int grp = h0 / (p.Hq / p.Hp), kvh = h0 / (p.Hq / p.Hkv);
  const int NTc = C::kRows / p.R;  // tokens per chunk
  // the tokens of this block's list
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
  if (n <= 0) return;
  const int nchunks = (n + NTc - 1) / NTc;
  const int tid = threadIdx.x, role_wg = tid / 128;

  typename Pipeline::Params pp;
  pp.role = role_wg == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.producer_arv_count = C::kProducers;
  pp.consumer_arv_count = C::kConsumers;
  Pipeline pipeline(S.pipe, pp);
  if (tid == 0) S.kv_bar.init(1);
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sK = make_tensor(make_smem_ptr(S.k.data()), typename C::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(S.v.data()), typename C::SmemLayoutKV{});
  Tensor sQ = make_tensor(make_smem_ptr(S.q.data()), typename C::SmemLayoutRows{});
  Tensor sdO = make_tensor(make_smem_ptr(S.dout.data()), typename C::SmemLayoutRows{});

  if (role_wg == 0) {  // ---- producer ----
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (tid == 0) {  // K_j, V_j once, by TMA
      const int bidx = P.batched ? b : 0;
      const int64_t off = P.batched ? 0 : s0;
      Tensor mK = P.tma_k.get_tma_tensor(P.tma_shape)(_, _, kvh, bidx);
      Tensor mV = P.tma_v.get_tma_tensor(P.tma_shape)(_, _, kvh, bidx);
      Tensor gK = local_tile(domain_offset(make_coord(off, _0{}), mK), Shape<_128, _128>{}, make_coord(j, _0{}));
      Tensor gV = local_tile(domain_offset(make_coord(off, _0{}), mV), Shape<_128, _128>{}, make_coord(j, _0{}));
      auto tk = P.tma_k.get_slice(_0{});
      auto tv = P.tma_v.get_slice(_0{});
      S.kv_bar.arrive_and_expect_tx(2 * C::kBlockN * C::kHeadDim * sizeof(Element));
      copy(P.tma_k.with(reinterpret_cast<uint64_t&>(S.kv_bar)), tk.partition_S(gK), tk.partition_D(sK));
      copy(P.tma_v.with(reinterpret_cast<uint64_t&>(S.kv_bar)), tv.partition_S(gV), tv.partition_D(sV));
    }
    const Element* qptr = static_cast<const Element*>(p.q.ptr);
    const Element* doptr = static_cast<const Element*>(p.dout.ptr);
    const int64_t pad0 = padded_offset(s0, b, kPadTile) - s0;  // padded index = pad0 + global token
    auto state = cutlass::make_producer_start_state<Pipeline>();
    for (int c = 0; c < nchunks; ++c) {
      pipeline.producer_acquire(state);
      const int st = state.index();
      // rows of this chunk: row r = token c * NTc + r / R of the list, head h0 + r % R
      for (int x = tid; x < C::kRows * 16; x += 128) {
        const int r = x / 16, col = (x % 16) * 8;
        const int li = min(c * NTc + r / p.R, n - 1);
        const int64_t t = p.dense ? dense_first + li : int64_t(list[li]);
        const int h = h0 + r % p.R;
        ptx::cp_async_16(&sQ(r, col, st), qptr + b * p.q.batch_corr + t * p.q.tok + h * p.q.head + col);
        ptx::cp_async_16(&sdO(r, col, st), doptr + b * p.dout.batch_corr + t * p.dout.tok + h * p.dout.head + col);
      }
      if (tid < C::kRows) {
        const int r = tid;
        const int li = c * NTc + r / p.R;
        const bool valid = (r / p.R) < NTc && li < n;
        const int64_t t = valid ? (p.dense ? dense_first + li : int64_t(list[li])) : -1;
        const int h = h0 + r % p.R;
        S.tok[st][r] = int32_t(t);
        S.lse2[st][r] = valid ? *p.lse2.at(h, pad0 + t) : 0.f;
        S.dsum[st][r] = valid ? *p.dsum.at(h, pad0 + t) : 0.f;
      }
      ptx::cp_async_commit();
      ptx::cp_async_wait<0>();
      ptx::fence_proxy_async_smem();
      pipeline.producer_commit(state);
      ++state;
    }
    return;
  }

  // ---- consumers: warpgroup w owns keys [64 w, 64 w + 64) ----
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int w = role_wg - 1;
  const int wtid = tid % 128;
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
  Tensor tQrdS = thr_dq.partition_fragment_A(sdSt);   // (MMA, M=rows, K=keys, buf)
  Tensor sKtw = local_tile(sKt, Shape<_64, Int<C::kBlockN>>{}, make_coord(w, _0{}));  // d half w
  Tensor tQrK = thr_dq.partition_fragment_B(sKtw);

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
  const int64_t key_base = int64_t(j) * C::kBlockN + 64 * w;  // in-sequence position of key 0 of this half
  S.kv_bar.wait(0);

  typename Pipeline::PipelineState state;
  for (int c = 0; c < nchunks; ++c) {
    pipeline.consumer_wait(state);
    const int st = state.index();
    wg_gemm<true>(mma_sdp, tSrK, tSrQ(_, _, _, st), accS);
    wg_gemm<true>(mma_sdp, tSrV, tSrdO(_, _, _, st), accdP);
#pragma unroll
    for (int x = 0; x < size(accS); ++x) {
      const int key = get<0>(cS(x)), r = get<1>(cS(x));
      const int32_t t = S.tok[st][r];
      const bool ok = t >= 0 && key_base + key <= int64_t(t) - s0;
      const float pr = ok ? ptx::exp2f_approx(accS(x) * sl2 - S.lse2[st][r]) : 0.f;
      accS(x) = pr;                                  // P^T
      accdP(x) = pr * (accdP(x) - S.dsum[st][r]);    // dS^T
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
    const int buf = c & 1;
#pragma unroll
    for (int x = 0; x < size(accdP); ++x) sdS(64 * w + get<0>(cS(x)), get<1>(cS(x)), buf) = rdS(x);
    // the tokens of this thread's dQ rows, read before the stage goes back to the producer
    const int32_t tok_a = S.tok[st][get<0>(cdQ(0))], tok_b = S.tok[st][get<0>(cdQ(0)) + 8];
    pipeline.consumer_release(state);
    ptx::fence_proxy_async_smem();
    ptx::named_barrier_sync(int(NamedBarrier::kConsumers), C::kConsumers);  // dS^T staged by both
    wg_gemm<true>(mma_dq, tQrdS(_, _, _, buf), tQrK, accdQ);
    // dQ rows of this chunk (unscaled: the convert kernel applies the softmax scale)
#pragma unroll
    for (int x = 0; x < size(accdQ); x += 2) {
      const int r = get<0>(cdQ(x)), d = 64 * w + get<1>(cdQ(x));
      const int32_t t = (r == get<0>(cdQ(0))) ? tok_a : tok_b;
      if (t < 0) continue;
      const int h = h0 + r % p.R;
      float2* dst = reinterpret_cast<float2*>(p.dq_acc + (int64_t(t) * p.Hq + h) * C::kHeadDim + d);
      atomicAdd(dst, make_float2(accdQ(x), accdQ(x + 1)));
    }
    ++state;
  }

  // dK_j, dV_j of this unit: fp32 atomics (several units may share a kv head)
  Tensor cKV = thr_dkv.partition_C(make_identity_tensor(Shape<_64, Int<C::kHeadDim>>{}));
#pragma unroll
  for (int x = 0; x < size(accdK); x += 2) {
    const int64_t pos = key_base + get<0>(cKV(x));
    if (pos >= L) continue;
    const int64_t row = ((s0 + pos) * p.Hkv + kvh) * C::kHeadDim + get<1>(cKV(x));
    atomicAdd(reinterpret_cast<float2*>(p.dk_acc + row), make_float2(accdK(x), accdK(x + 1)));
    atomicAdd(reinterpret_cast<float2*>(p.dv_acc + row), make_float2(accdV(x), accdV(x + 1)));
  }
}

template <class Element>
void launch_main(const MainParams<Element>& P, int units, cudaStream_t stream) {
  using C = MainConfig<Element>;
  auto kernel = bwd_main_kernel<Element>;
  FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(C::kSmemBytes)));
  dim3 grid(P.c.inv.nblk, units);
  if (grid.x == 0) return;
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(P);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flashmsa::cuda::attn_bwd
