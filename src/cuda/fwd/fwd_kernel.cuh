// Sparse (and dense warmup) main forward on Hopper: query-outer over the union of a tile's
// selected blocks.
//
// Tile = NT consecutive tokens x R query heads that share one MSA group and one kv head
// (R = gcd(Hq/Hp, Hq/Hkv), capped to a divisor <= 128), so its 128 MMA rows read one K/V
// stream: m3 (R = 16) packs 8 tokens x 16 heads, fmsa (R = 4) 32 tokens x 4 heads. The CTA
// builds the union of the tokens' selected blocks (ascending) and a per-(union block, token)
// bit. Warp-specialised: warpgroup 0 is the producer (one thread issues TMA loads of K_j and V_j
// into two two-stage mbarrier pipelines, one for K and one for V; registers given back),
// warpgroups 1 and 2 are consumers that own 64 rows each (Q loaded once with cp.async). Per
// block, FlashAttention-3's intra-warpgroup overlap: S_n = Q K_n^T (wgmma SS) is issued, then
// O += P_{n-1} V_{n-1} (wgmma RS), and the softmax of S_n runs while the second GEMM does. The
// softmax masks with one limit per row (the token's selection bit, causal u <= i): only blocks
// that reach a row's own position pay a per-element mask, and a row whose token did not select
// the block pays no exp (P = 0). Running max exact (Train) or lazily rescaled at threshold 8 in
// log2 units (Infer). Masked rows still occupy MMA rows: the union factor of BENCHMARKS.md is
// the price of this design (1.47 for m3 clustered). docs/kernels/fwd.md has the measurements.
#pragma once

#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "cuda/common/bitmap.cuh"
#include "cuda/common/seqlen.cuh"
#include "cuda/common/tma.cuh"
#include "cuda/common/utils.cuh"
#include "cuda/fwd/fwd.h"
#include "cuda/ptx/cp_async.cuh"

// The rings kernel (kRings, the same template): each consumer warpgroup streams its own list, the
// union entries that one of its own tokens selected (m3 random: 2.89 x topk blocks instead of the
// tile's 4.50), through its own K and V rings of one stage each (stage w of the two-stage
// buffers), fed by two producer threads of its own (K: warp 2w, V: warp 2w + 1, lane 0). No entry
// is skipped inside a stream, so no stage is held across a skip (session 10's per-warpgroup lists
// over one stream paid for that). The consumer loop is sequential per block (S, softmax, P V),
// FlashAttention-2's order: with one stage per ring, K_{n+1} loads under softmax_n and P_n V_n,
// V_n under S_n and softmax_n, and the two warpgroups run desynchronised. Each warpgroup loads its
// own copy of a shared block. A ring block costs 1.2-1.3x a shared-stream block (the lost overlap),
// so the rings pay where a warpgroup's list is well under the tile's union: fwd_route.cu decides
// per tile (sparse mode), and each of the two kernels runs the tiles routed to it (docs/kernels/fwd.md,
// sessions 18-19). Measured alone (session 18): m3 32k random 15% faster, clustered 8% and dense
// 17% slower, fmsa random 12% slower. Rejected forms: one kernel choosing per tile (spilled), two
// 64-key stages per ring with FlashAttention-3's overlap per half-block (slower everywhere);
// both at commit 59f6503 (`FLASHMSA_FWD_WG_RINGS`), the measurements in docs/kernels/fwd.md.

namespace flashmsa::cuda::attn_fwd {

template <class Element>
struct Config;

// The kernel's parameters: the dispatcher's plain arguments plus the TMA descriptors of K and V.
template <class Element>
struct Params : Args {
  using StageLayout = decltype(cute::take<0, 2>(typename Config<Element>::SmemLayoutKV{}));
  TmaBlockLoad<Element, StageLayout> tma_k, tma_v;
  TmaShape tma_shape_k;
};

template <class Element>
struct Config {
  static constexpr int kBlockM = kConsumerWarpGroups * kWgmmaM, kBlockN = kBlockKeys, kHeadDim = kHeadDimInst;
  static constexpr int kThreads = kCtaThreads, kStages = 2;  // producer warpgroup + 2 consumer warpgroups
  static constexpr int kConsumers = kConsumerThreads;
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  // the rings kernel: a ring per warpgroup, one 128-key stage (stage w of the buffers)
  using Ring = cutlass::PipelineTmaAsync<kStages / kConsumerWarpGroups>;
  using SmemLayoutQ = SwizzledTile<Element, kBlockM, kHeadDim>;
  using SmemLayoutKV = SwizzledTiles<Element, kBlockN, kHeadDim, kStages>;
  // V^T view (d, keys, stage) of the same memory, for the B operand of O += P V.
  using SmemLayoutVt = TransposedViews<SmemLayoutKV, kBlockN, kHeadDim, kStages>;
  using MmaQK = SsMma<Element, 64, kBlockN, kHeadDim>;
  using MmaPV = RsMma<Element, 64, kHeadDim, kBlockN, cute::GMMA::Major::K, cute::GMMA::Major::MN>;
  struct Smem {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;  // reused for O
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> v;
    uint32_t blockbits[kMaxBlocks / 32];
    int wordprefix[kMaxBlocks / 32];
    int ulist[kMaxUnion];
    uint32_t tokmask[kMaxUnion][kBlockM / 32];
    typename Pipeline::SharedStorage pipe_k, pipe_v;
    int ulen;
    int32_t tpos[kBlockM];  // the in-sequence position of each tile token (fwd_regroup.cu's order)
    // the rings kernel's
    int16_t wlist[kConsumerWarpGroups][kMaxUnion];  // per warpgroup: the union entries its tokens selected
    int wlen[kConsumerWarpGroups];
    typename Ring::SharedStorage ring_k[kConsumerWarpGroups], ring_v[kConsumerWarpGroups];
  };
  static constexpr size_t kSmemBytes = sizeof(Smem) + 1024;
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared-memory plan over the SM's 227 KB");
};

template <class Element, bool kLazyRescale, bool kRings>
__global__ void __launch_bounds__(kCtaThreads, 1) fwd_kernel(const __grid_constant__ Params<Element> p) {
  using namespace cute;
  using C = Config<Element>;
  extern __shared__ char smem_raw[];
  auto& S = smem_struct<typename C::Smem>(smem_raw);

  const int m_tile = p.num_m_tiles - 1 - int(blockIdx.x);
  const int unit = blockIdx.y, b = blockIdx.z;
  // routed (sparse mode, fwd_route.cu): the tile belongs to the other kernel
  if (p.route != nullptr && (p.route[(int64_t(b) * gridDim.y + unit) * p.num_m_tiles + m_tile] != 0) != kRings) return;
  int64_t s0, L;
  p.seqs.get(b, s0, L);
  const int64_t i0 = int64_t(m_tile) * p.NT;  // first token of the tile (in the sequence)
  if (i0 >= L) return;
  const int ntok = int(min<int64_t>(p.NT, L - i0));
  const int tid = threadIdx.x, lane = tid % 32;
  const int h0 = unit * p.R;
  const int grp = h0 / (p.Hq / p.Hp), kvh = h0 / (p.Hq / p.Hkv);
  // the tile's tokens: positions i0 .. i0 + ntok - 1, or with a regrouping (fwd_regroup.cu) the
  // tokens its permutation puts at those slots, all inside the 128-token span of i0
  if (tid < ntok) S.tpos[tid] = int32_t(tile_token_pos(p, grp, s0, i0, tid));
  const int64_t i_last = tile_last_pos(i0, ntok, L, p.perm != nullptr);
  const int nblk_tile = int(i_last / C::kBlockN) + 1;  // blocks 0..l(i_last)
  const bool dense = p.indices.ptr == nullptr;

  // ---- the union of the tile's blocks ----
  const int nwords = (nblk_tile + 31) / 32;
  if (dense) {
    if (tid == 0) S.ulen = nblk_tile;  // every block 0..l(i_last), in order (block_of: no list)
  } else {
    for (int w = tid; w < nwords; w += C::kThreads) S.blockbits[w] = 0u;
    __syncthreads();  // (S.tpos written too)
    const int nent = ntok * p.topk;
    for (int e = tid; e < nent; e += C::kThreads) {
      const int tok = e / p.topk, s = e % p.topk;
      const int64_t i = S.tpos[tok];
      const int j = p.indices.at(grp, s0 + i)[s];
      if (j >= 0 && int64_t(j) <= i / C::kBlockN) atomicOr(&S.blockbits[j / 32], 1u << (j % 32));
    }
    __syncthreads();
    if (tid < 32) {  // exclusive prefix of popcounts over the words (one warp)
      const int n = warp_word_prefix(S.blockbits, nwords, S.wordprefix, lane);
      if (lane == 0) S.ulen = n;
    }
    __syncthreads();
    for (int w = tid; w < nwords; w += C::kThreads) {
      uint32_t bits = S.blockbits[w];
      int pos = S.wordprefix[w];
      while (bits) {
        const int bit = __ffs(bits) - 1;
        bits &= bits - 1;
        S.ulist[pos++] = w * 32 + bit;
      }
    }
    for (int x = tid; x < S.ulen * (C::kBlockM / 32); x += C::kThreads)
      S.tokmask[x / (C::kBlockM / 32)][x % (C::kBlockM / 32)] = 0u;
    __syncthreads();
    for (int e = tid; e < nent; e += C::kThreads) {
      const int tok = e / p.topk, s = e % p.topk;
      const int64_t i = S.tpos[tok];
      const int j = p.indices.at(grp, s0 + i)[s];
      if (j >= 0 && int64_t(j) <= i / C::kBlockN) {
        const int pos = bit_rank(S.blockbits, S.wordprefix, j);
        atomicOr(&S.tokmask[pos][tok / 32], 1u << (tok % 32));
      }
    }
  }
  __syncthreads();
  const int ulen = S.ulen;
  if constexpr (kRings) {
    static_assert(kConsumerWarpGroups == 2 && C::kBlockM == 128, "two warpgroups of 64 rows");
    // warp w (w < 2) lists the union entries that a token of warpgroup w's rows selected: rows
    // 64 w .. 64 w + 63, tokens row / R (dense: every entry, not stored: entry k is block k)
    if (tid < 64) {
      const int w = tid / 32;
      const int t_lo = wg_first_token(p.R, w), t_hi = min(wg_last_token(p.R, w), ntok - 1);
      uint32_t wmask[C::kBlockM / 32];
#pragma unroll
      for (int x = 0; x < C::kBlockM / 32; ++x) {
        const int lo = max(t_lo - 32 * x, 0), hi = min(t_hi - 32 * x, 31);  // bits lo..hi of word x
        wmask[x] = hi < lo ? 0u : (hi - lo == 31 ? 0xffffffffu : ((1u << (hi - lo + 1)) - 1u) << lo);
      }
      int n = 0;
      for (int q0 = 0; q0 < ulen; q0 += 32) {
        const int qi = q0 + lane;
        bool take = false;
        if (qi < ulen) {
          if (dense) take = true;
          else {
#pragma unroll
            for (int x = 0; x < C::kBlockM / 32; ++x) take = take || (S.tokmask[qi][x] & wmask[x]) != 0u;
          }
        }
        const uint32_t bal = __ballot_sync(0xffffffffu, take);
        if (take && !dense) S.wlist[w][n + __popc(bal & ((1u << lane) - 1u))] = int16_t(qi);  // (dense: entry k is k)
        n += __popc(bal);
      }
      if (lane == 0) S.wlen[w] = n;
    }
  }

  // ---- pipelines (FlashAttention-3's): K and V separately, so that K_{n+1} streams in while V_n
  // is still read; warpgroup 0 produces, warpgroups 1 and 2 consume ----
  using Pipeline = typename C::Pipeline;
  typename Pipeline::Params pp;
  const int role_wg = tid / kWarpGroupThreads;
  pp.role = role_wg == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = tid == 0;
  pp.num_consumers = C::kConsumers;
  pp.transaction_bytes = C::kBlockN * C::kHeadDim * sizeof(Element);
  if constexpr (kRings) {
    // ring w: K issued by warp 2w's lane 0, V by warp 2w + 1's; consumed by warpgroup w + 1. Warp 0
    // initialises the four; the loops use their two barriers directly (a one-stage ring's phase is
    // the block's parity)
    typename C::Ring::Params rp;  // (for the barrier counts: one producer arrival, 128 consumer arrivals)
    rp.num_consumers = kWarpGroupThreads;
#pragma unroll
    for (int w = 0; w < kConsumerWarpGroups; ++w) {
      C::Ring::init_barriers(S.ring_k[w], rp, Shape<_1, _1, _1>{});
      C::Ring::init_barriers(S.ring_v[w], rp, Shape<_1, _1, _1>{});
    }
  }
  Pipeline pipe_k(S.pipe_k, pp, Shape<_1, _1, _1>{});
  Pipeline pipe_v(S.pipe_v, pp, Shape<_1, _1, _1>{});
  __syncthreads();  // barrier initialisation visible to every thread
  auto block_of = [&](int qi) { return dense ? qi : S.ulist[qi]; };  // the qi-th block of the union

  Tensor sK = make_tensor(make_smem_ptr(S.k.data()), typename C::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(S.v.data()), typename C::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(S.v.data()), typename C::SmemLayoutVt{});

  if (role_wg == 0) {  // ---- producer ----
    cutlass::arch::warpgroup_reg_dealloc<kFwdRegs.producer>();
    if constexpr (kRings) {
      if (lane == 0) {  // warp x: ring x / 2, K (even) or V (odd)
        const int x = tid / 32, w = x / 2;
        const bool is_v = x % 2 == 1;
        auto& ring = is_v ? S.ring_v[w] : S.ring_k[w];
        const auto& tma = is_v ? p.tma_v : p.tma_k;
        Tensor tg = tma_blocks(tma, p.tma_shape_k, kvh, b, s0, p.batched);  // (TMA, block)
        Tensor ts = tma_stages(tma, is_v ? sV : sK);                          // (TMA, stage)
        const int n = S.wlen[w];
        for (int k = 0; k < n; ++k) {
          const int j = block_of(dense ? k : S.wlist[w][k]);
          ring.empty_barrier_[0].wait(uint32_t(k & 1) ^ 1u);  // released (first use: at once)
          ring.full_barrier_[0].arrive_and_expect_tx(C::kBlockN * C::kHeadDim * uint32_t(sizeof(Element)));
          copy(tma.with(*reinterpret_cast<uint64_t*>(&ring.full_barrier_[0])), tg(_, j), ts(_, w));
        }
      }
    } else if (tid == 0) {
      Tensor tKg = tma_blocks(p.tma_k, p.tma_shape_k, kvh, b, s0, p.batched);  // (TMA, block)
      Tensor tKs = tma_stages(p.tma_k, sK);                                      // (TMA, stage)
      Tensor tVg = tma_blocks(p.tma_v, p.tma_shape_k, kvh, b, s0, p.batched);
      Tensor tVs = tma_stages(p.tma_v, sV);
      auto sk = cutlass::make_producer_start_state<Pipeline>();
      auto sv = cutlass::make_producer_start_state<Pipeline>();
      for (int qi = 0; qi < ulen; ++qi) {
        const int j = block_of(qi);
        pipe_k.producer_acquire(sk);
        copy(p.tma_k.with(*pipe_k.producer_get_barrier(sk)), tKg(_, j), tKs(_, sk.index()));
        ++sk;
        pipe_v.producer_acquire(sv);
        copy(p.tma_v.with(*pipe_v.producer_get_barrier(sv)), tVg(_, j), tVs(_, sv.index()));
        ++sv;
      }
    }
    return;
  }

  // ---- consumers ----
  cutlass::arch::warpgroup_reg_alloc<kFwdRegs.consumer>();
  const int wg = role_wg - 1;
  Tensor sQ = make_tensor(make_smem_ptr(S.q.data()), typename C::SmemLayoutQ{});
  {
    // this warpgroup's 64 Q rows: row r = token r / R, head h0 + r % R (rows past the tile clamp)
    const Element* qp = static_cast<const Element*>(p.q.ptr);
#pragma unroll
    for (int c = tid % kWarpGroupThreads; c < 64 * 16; c += kWarpGroupThreads) {
      const int r = wg * 64 + c / 16, col = (c % 16) * 8;
      const int tok = min(r / p.R, ntok - 1);
      const int h = h0 + r % p.R;
      const Element* src = qp + b * p.q.batch_corr + (s0 + S.tpos[tok]) * p.q.tok + h * p.q.head + col;
      ptx::cp_async_16(&sQ(r, col), src);
    }
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
    ptx::fence_proxy_async_smem();
    barrier_sync(consumer_wg_barrier(wg), kWarpGroupThreads);
  }

  typename C::MmaQK mma_qk;
  typename C::MmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tid % kWarpGroupThreads);
  auto thr_pv = mma_pv.get_thread_slice(tid % kWarpGroupThreads);
  Tensor sQw = local_tile(sQ, Shape<_64, Int<C::kHeadDim>>{}, make_coord(wg, _0{}));
  Tensor tSrQ = thr_qk.partition_fragment_A(sQw);
  Tensor tSrK = thr_qk.partition_fragment_B(sK);
  Tensor tOrVt = thr_pv.partition_fragment_B(sVt);
  Tensor accS = partition_fragment_C(mma_qk, Shape<_64, Int<C::kBlockN>>{});
  Tensor accO = partition_fragment_C(mma_pv, Shape<_64, Int<C::kHeadDim>>{});
  clear(accO);
  Tensor sRC = make_tensor(accS.data(), acc_rowcol(accS.layout()));
  Tensor oRC = make_tensor(accO.data(), acc_rowcol(accO.layout()));
  Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<_64, Int<C::kBlockN>>{}));
  Tensor cRC = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  Tensor rP = make_tensor_like<Element>(accS);  // P (bf16/fp16): the A operand of O += P V
  Tensor tOrP = make_tensor(rP.data(), acc_to_a_regs(rP.layout()));

  const float sl2 = p.scale * kLog2e;
  int row_tok[2];
  int64_t row_pos[2];
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f}, scale_o[2] = {1.f, 1.f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = wg * 64 + get<0>(cRC(r, 0));
    row_tok[r] = row / p.R;
    row_pos[r] = S.tpos[min(row_tok[r], ntok - 1)];  // (rows past the tile see nothing: row_tok >= ntok)
  }

  // S of union entry qi -> P in accS: the mask (the token's selection bit, causal u <= i) as one
  // per-row limit, the last column the row may see (-1: none), so that only the blocks that
  // reach a row's own position pay a per-element mask and a row that did not select the block
  // pays no exp; online softmax with the running max exact (Train) or lazily rescaled (Infer).
  // scale_o: the factor that brings O (accumulated against the previous max) to the new one,
  // applied before the next O += P V.
  auto softmax = [&](int qi) {
    const int64_t key0 = int64_t(block_of(qi)) * C::kBlockN;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      bool sel = row_tok[r] < ntok;  // rows past the tile see nothing
      if (sel && !dense) sel = ((S.tokmask[qi][row_tok[r] / 32] >> (row_tok[r] % 32)) & 1u) != 0u;
      const int64_t last = row_pos[r] - key0;  // the row's own position within the block
      const int lim = !sel || last < 0 ? -1 : last >= C::kBlockN - 1 ? C::kBlockN - 1 : int(last);
      float mx = -INFINITY;
      if (lim >= 0) {
        if (lim < C::kBlockN - 1) {
#pragma unroll
          for (int c = 0; c < size<1>(sRC); ++c)
            if (get<1>(cRC(r, c)) > lim) sRC(r, c) = -INFINITY;
        }
#pragma unroll
        for (int c = 0; c < size<1>(sRC); ++c) mx = fmaxf(mx, sRC(r, c));
      }
      mx = quad_max(mx);  // (all lanes: a quad shares its rows, so lim is quad-uniform)
      if (lim < 0) {  // nothing of this block: P = 0, max and sum unchanged
#pragma unroll
        for (int c = 0; c < size<1>(sRC); ++c) sRC(r, c) = 0.f;
        scale_o[r] = 1.f;
        continue;
      }
      float m_new = fmaxf(row_max[r], mx);
      if constexpr (kLazyRescale) {
        // keep the stale max unless the new one exceeds it by more than 8 (log2 units)
        if (row_max[r] != -INFINITY && (m_new - row_max[r]) * sl2 <= 8.f) m_new = row_max[r];
      }
      scale_o[r] = (m_new == -INFINITY) ? 1.f : ptx::exp2f_approx((row_max[r] - m_new) * sl2);
      row_max[r] = m_new;
      const float ms = (m_new == -INFINITY) ? 0.f : m_new * sl2;
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < size<1>(sRC); ++c) {
        const float e = ptx::exp2f_approx(sRC(r, c) * sl2 - ms);
        sRC(r, c) = e;
        sum += e;
      }
      row_sum[r] = row_sum[r] * scale_o[r] + sum;  // partial per thread; reduced at the end
    }
  };
  auto rescale_o = [&] {
    if (scale_o[0] == 1.f && scale_o[1] == 1.f) return;  // (the max did not move)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int c = 0; c < size<1>(oRC); ++c) oRC(r, c) *= scale_o[r];
  };
  auto to_p = [&] {
#pragma unroll
    for (int x = 0; x < size(accS); ++x) rP(x) = Element(accS(x));
  };
  if constexpr (kRings) {  // FlashAttention-2's order per block, over this warpgroup's own ring
    auto& rk = S.ring_k[wg];
    auto& rv = S.ring_v[wg];
    const int n = S.wlen[wg];
    for (int k = 0; k < n; ++k) {
      const int qi = dense ? k : S.wlist[wg][k];
      const uint32_t phase = uint32_t(k & 1);
      rk.full_barrier_[0].wait(phase);
      wg_gemm<true>(mma_qk, tSrQ, tSrK(_, _, _, wg), accS);
      rk.empty_barrier_[0].arrive();
      softmax(qi);
      rescale_o();
      to_p();
      rv.full_barrier_[0].wait(phase);
      wg_gemm<false>(mma_pv, tOrP, tOrVt(_, _, _, wg), accO);
      rv.empty_barrier_[0].arrive();
    }
  } else {
    // Intra-warpgroup overlap (FlashAttention-3): S_n = Q K_n^T is issued before O += P_{n-1}
    // V_{n-1}, and the softmax of S_n runs while the P V GEMM does. (FlashAttention-3's ping-pong
    // of the two warpgroups measured slower here: docs/kernels/fwd.md.)
    typename Pipeline::PipelineState sk, sv;  // consumer start: index 0, phase 0
    if (ulen > 0) {
      pipe_k.consumer_wait(sk);
      wg_gemm_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, sk.index()), accS);
      warpgroup_wait<0>();
      wg_gemm_done(mma_qk, tSrQ, accS);
      pipe_k.consumer_release(sk);
      ++sk;
      softmax(0);
      to_p();
    }
    for (int qi = 1; qi < ulen; ++qi) {
      pipe_k.consumer_wait(sk);
      wg_gemm_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, sk.index()), accS);
      rescale_o();
      pipe_v.consumer_wait(sv);
      wg_gemm_issue<false>(mma_pv, tOrP, tOrVt(_, _, _, sv.index()), accO);
      warpgroup_wait<1>();  // S_n is in; P_{n-1} V_{n-1} may still run
      wg_gemm_done(mma_qk, tSrQ, accS);
      pipe_k.consumer_release(sk);
      ++sk;
      softmax(qi);
      warpgroup_wait<0>();
      wg_gemm_done(mma_pv, tOrP, accO);
      pipe_v.consumer_release(sv);
      ++sv;
      to_p();
    }
    if (ulen > 0) {
      rescale_o();
      pipe_v.consumer_wait(sv);
      wg_gemm_issue<false>(mma_pv, tOrP, tOrVt(_, _, _, sv.index()), accO);
      warpgroup_wait<0>();
      wg_gemm_done(mma_pv, tOrP, accO);
      pipe_v.consumer_release(sv);
    }
  }

  // ---- epilogue: normalise, stage O through smem (this warpgroup's Q rows), store ----
  float row_lse[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float sum = quad_sum(row_sum[r]);
    const bool empty = !(sum > 0.f);
    const float inv = empty ? 0.f : 1.f / sum;
    row_lse[r] = empty ? -INFINITY : (row_max[r] * sl2 + __log2f(sum)) * kLn2;
#pragma unroll
    for (int c = 0; c < size<1>(oRC); ++c) oRC(r, c) *= inv;
  }
  barrier_sync(consumer_wg_barrier(wg), kWarpGroupThreads);  // Q slice no longer read
  Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<_64, Int<C::kHeadDim>>{}));
#pragma unroll
  for (int x = 0; x < size(accO); ++x) {
    const int row = wg * 64 + get<0>(cO(x));
    sQ(row, get<1>(cO(x))) = Element(accO(x));
  }
  barrier_sync(consumer_wg_barrier(wg), kWarpGroupThreads);
  Element* optr = static_cast<Element*>(p.out.ptr);
  for (int c = tid % kWarpGroupThreads; c < 64 * 16; c += kWarpGroupThreads) {
    const int row = wg * 64 + c / 16, col = (c % 16) * 8;  // this warpgroup's rows
    const int tok = row / p.R;
    if (tok >= ntok) continue;
    const int h = h0 + row % p.R;
    Element* dst = optr + b * p.out.batch_corr + (s0 + S.tpos[tok]) * p.out.tok + h * p.out.head + col;
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&sQ(row, col));
  }
  if (p.out_lo.ptr) {  // the low part, staged through the same rows once they are stored
    barrier_sync(consumer_wg_barrier(wg), kWarpGroupThreads);
#pragma unroll
    for (int x = 0; x < size(accO); ++x) {
      const int row = wg * 64 + get<0>(cO(x));
      sQ(row, get<1>(cO(x))) = Element(accO(x) - float(Element(accO(x))));
    }
    barrier_sync(consumer_wg_barrier(wg), kWarpGroupThreads);
    Element* lptr = static_cast<Element*>(p.out_lo.ptr);
    for (int c = tid % kWarpGroupThreads; c < 64 * 16; c += kWarpGroupThreads) {
      const int row = wg * 64 + c / 16, col = (c % 16) * 8;
      const int tok = row / p.R;
      if (tok >= ntok) continue;
      const int h = h0 + row % p.R;
      Element* dst = lptr + b * p.out_lo.batch_corr + (s0 + S.tpos[tok]) * p.out_lo.tok + h * p.out_lo.head + col;
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&sQ(row, col));
    }
  }
  if ((lane & 3) == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wg * 64 + get<0>(cRC(r, 0));
      if (row_tok[r] < ntok) *p.lse.at(h0 + row % p.R, s0 + row_pos[r]) = row_lse[r];
    }
  }
}

template <class Element, bool kLazyRescale, bool kRings>
void launch(const Params<Element>& p, cudaStream_t stream) {
  using C = Config<Element>;
  auto kernel = fwd_kernel<Element, kLazyRescale, kRings>;
  FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(C::kSmemBytes)));
  dim3 grid(p.num_m_tiles, p.Hq / p.R, p.seqs.batch);
  if (grid.x == 0 || grid.z == 0) return;
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(p);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

// fwd.h's run: the TMA descriptors of K and V from the plain arguments, then the launch
// (explicitly instantiated once per dtype, numerics and kernel, one translation unit each).
template <Dtype D, bool kLazyRescale, bool kRings>
void run(const Args& a, cudaStream_t stream) {
  using Element = typename ElementOf<D>::type;
  using Stage = typename Params<Element>::StageLayout;
  Params<Element> p;
  static_cast<Args&>(p) = a;
  const auto tk = make_block_load<Element, Stage>(a.k, a.Hkv, a.batched, a.seqs.seqlen, a.seqs.batch, a.total);
  const auto tv = make_block_load<Element, Stage>(a.v, a.Hkv, a.batched, a.seqs.seqlen, a.seqs.batch, a.total);
  p.tma_k = tk.copy;
  p.tma_v = tv.copy;
  p.tma_shape_k = tk.shape;
  launch<Element, kLazyRescale, kRings>(p, stream);
}

}  // namespace flashmsa::cuda::attn_fwd
