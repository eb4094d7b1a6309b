// Selection on Hopper: proxy logits on tensor cores (wgmma), block max with the causal mask in
// the local block, a streaming top-k per (token, proxy head) with the spec's tie rule and slot
// order, and the selected-set proxy lse. Nothing quadratic touches device memory.
//
// One CTA = one query block (128 tokens of one sequence) of one proxy head. Warp-specialised:
// warpgroup 0 streams the key blocks 0..l with TMA into a three-stage mbarrier pipeline (one
// thread issues, the rest give their registers back); warpgroups 1 and 2 own 64 rows each. Per
// row and key block the CTA keeps (block max, block lse); the top-k list (non-local blocks by
// descending score, ties to the lower index) has one owner thread per row (quad lane 0 or 1): in
// its registers for topk <= 16 (RegList), else in shared memory, sized for the runtime topk
// (<= 64). The local block is scored last (masked u <= i) and only contributes its lse.
//
// Numbers (m3, 32k, Hp=4): 0.55 TFLOP of proxy logits; per key block a 128x128x128 GEMM
// (~1000 cycles of tensor work per SM) and 16K exp2 (~1000 cycles of MUFU). Measured bound
// (docs/kernels/select.md): the latency of each row's scoring chain and the list
// insert, so both rows are reduced together in independent chains and each row has its own owner
// lane.
#pragma once

#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "cuda/common/exp2_poly.h"
#include "cuda/common/seqlen.cuh"
#include "cuda/common/tma.cuh"
#include "cuda/common/utils.cuh"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/select/select.h"

namespace flashmsa::cuda::selection {

// kPolyCols = n (0..8): in the unmasked blocks' lse, n of every 8 columns of a thread take
// exp2f_poly (common/exp2_poly.h: the FMA pipe) instead of MUFU.EX2. Measured on the H200
// (docs/kernels/select.md, the exps on both pipes): n = 1 is 2-3.5% faster than n = 0 (MUFU only);
// n = 2 and 3 are slower than n = 0, the polynomial's 11 issue slots per exp outweigh the MUFU time
// they save.
constexpr int kPolyCols = 1;

template <class Element>
struct Config;

// The kernel's parameters: the dispatcher's plain arguments plus the TMA descriptor of kp.
template <class Element>
struct Params : Args {
  using StageLayout = decltype(cute::take<0, 2>(typename Config<Element>::SmemLayoutK{}));
  TmaBlockLoad<Element, StageLayout> tma_kp;
  TmaShape tma_shape_kp;
  Fp8Scales fp8;  // the kE4m3 instantiation's (last: the other members' offsets do not depend on it)
};

template <class Element>
constexpr bool kIsFp8 = std::is_same_v<Element, cutlass::float_e4m3_t>;

// The first set bit of `bits` at or after `from`, else `end` (bits covers [0, end)): the union walk's next block.
__device__ __forceinline__ int next_set(const uint32_t* bits, int from, int end) {
  if (from >= end) return end;
  int w = from >> 5;
  uint32_t m = bits[w] & (~0u << (from & 31));
  const int last_w = (end - 1) >> 5;
  while (m == 0) {
    if (++w > last_w) return end;
    m = bits[w];
  }
  const int j = (w << 5) + __ffs(m) - 1;
  return j < end ? j : end;
}

template <class Element>
struct Config {
  static constexpr int kBlockM = kConsumerWarpGroups * kWgmmaM, kBlockN = kBlockKeys, kHeadDim = kHeadDimInst;
  static constexpr int kThreads = kCtaThreads, kStages = 3;  // producer warpgroup + 2 consumer warpgroups
  static constexpr int kConsumers = kConsumerThreads;
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using SmemLayoutQ = SwizzledTile<Element, kBlockM, kHeadDim>;
  using SmemLayoutK = SwizzledTiles<Element, kBlockN, kHeadDim, kStages>;
  using Mma = SsMma<Element, 64, kBlockN, kHeadDim>;
  struct Smem {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;
    // top-k lists, [slot][row] so that the 8 row owners of a warp hit different banks
    float score[kMaxTopk][kBlockM];
    float lse2[kMaxTopk][kBlockM];
    int16_t idx[kMaxTopk][kBlockM];
    typename Pipeline::SharedStorage pipe;
  };
  static constexpr size_t kSmemBytes = sizeof(Smem) + 1024;  // + alignment slack
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared-memory plan over the SM's 227 KB");
};

// ---- the selection's tie rule (docs/semantics.md, "Selection"): non-local blocks by descending
// score, ties to the lower block id, the local block in the last valid slot, -1 after. Blocks are
// offered in ascending id order, so "a strictly higher score outranks" keeps the lower id first on
// a tie; everything that orders the list uses this one comparator.
__device__ __forceinline__ bool outranks(float score, float listed_score) { return score > listed_score; }
// The score a block is ranked by: a NaN block max (every logit of the block NaN; fmaxf skips a
// NaN next to a number) ranks below every number, as in the CPU reference, whose max ignores
// NaN. The lists then stay sorted (a NaN compared false everywhere and could break the insert
// network's monotone test). The block's lse stays NaN, so a row that selects it gets a NaN proxy
// lse.
__device__ __forceinline__ float rank_score(float block_max) { return block_max == block_max ? block_max : -INFINITY; }

// Sorted insert of (score, j, lse2) into a row's list of at most cap entries (blocks offered in
// ascending j). `last`: the full list's last score, kept in the owner's register.
template <class Smem>
__device__ __forceinline__ void list_insert(Smem& S, int row, int& count, float& last, int cap, float score,
                                            int j, float lse2) {
  if (count == cap && !outranks(score, last)) return;
  int pos = count < cap ? count : cap - 1;
  while (pos > 0 && outranks(score, S.score[pos - 1][row])) {
    S.score[pos][row] = S.score[pos - 1][row];
    S.lse2[pos][row] = S.lse2[pos - 1][row];
    S.idx[pos][row] = S.idx[pos - 1][row];
    --pos;
  }
  S.score[pos][row] = score;
  S.lse2[pos][row] = lse2;
  S.idx[pos][row] = int16_t(j);
  if (count < cap) ++count;
  if (count == cap) last = S.score[cap - 1][row];
}

// The same list in the owner's registers for cap <= kRegSlots (topk <= 16, the default): the
// insert is a branch-free select network over the slots (every slot's new value from the old
// values of its own slot and the one above), no shared memory and no loop. Slots >= cap only
// ever receive entries shifted out of the list and are never read.
constexpr int kRegSlots = 15;
struct RegList {
  float score[kRegSlots], lse2[kRegSlots];
  int idx[kRegSlots];
  __device__ __forceinline__ void insert(int& count, float& last, int cap, float sc, int j, float l2) {
    if (count == cap && !outranks(sc, last)) return;
    bool gt[kRegSlots];  // the new entry goes at or above slot k (monotone in k)
#pragma unroll
    for (int k = 0; k < kRegSlots; ++k) gt[k] = k >= count || outranks(sc, score[k]);
#pragma unroll
    for (int k = kRegSlots - 1; k >= 0; --k) {
      const bool from_above = k > 0 && gt[k > 0 ? k - 1 : 0];
      const bool here = gt[k] && !from_above;
      if (from_above) {
        score[k] = score[k - 1 >= 0 ? k - 1 : 0];
        lse2[k] = lse2[k - 1 >= 0 ? k - 1 : 0];
        idx[k] = idx[k - 1 >= 0 ? k - 1 : 0];
      } else if (here) {
        score[k] = sc;
        lse2[k] = l2;
        idx[k] = j;
      }
    }
    if (count < cap) ++count;
    if (count == cap) {
#pragma unroll
      for (int k = 0; k < kRegSlots; ++k)
        if (k == cap - 1) last = score[k];
    }
  }
};

// The row writer of the tie rule: slots 0..n-1 the ranked list, slot n the local block, then -1.
template <class Smem>
__device__ __forceinline__ void write_row(const Smem& S, int row, int n, int local_block, int topk, int32_t* out) {
  for (int s = 0; s < n; ++s) out[s] = S.idx[s][row];
  out[n] = local_block;
  for (int s = n + 1; s < topk; ++s) out[s] = -1;
}

// kUnion (kGivenLse only): the CTA walks the union of its rows' given blocks instead of every block 0..m_block
// (the lse over given blocks costs the union's GEMMs, not the causal prefix's). kE4m3 (kIsFp8): the fp8
// selection's ranking, no lse (docs/kernels/select.md, "fp8 selection").
template <class Element, bool kUnion>
__global__ void __launch_bounds__(kCtaThreads, 1) select_kernel(const __grid_constant__ Params<Element> p) {
  using namespace cute;
  using C = Config<Element>;
  extern __shared__ char smem_raw[];
  auto& S = smem_struct<typename C::Smem>(smem_raw);
  constexpr bool kFp8 = kIsFp8<Element>;
  // the lse mode (known at compile time in the union walk and the fp8 ranking)
  auto mode_is = [&](int m) { return kUnion ? m == kGivenLse : kFp8 ? m == kSelect : p.lse_mode == m; };

  const int m_block = p.num_m_blocks - 1 - int(blockIdx.x);  // heavy tiles first
  const int ph = blockIdx.y;
  // the query unit: key sequence b (keys s0..), query positions [lo, hi), query rows qrow0 + position
  const QueryUnit u = query_unit(p.seqs, blockIdx.z);
  const int b = u.b;
  const int64_t s0 = u.s0, lo = u.lo, hi = u.hi, qrow0 = u.qrow0;
  if (int64_t(m_block) * C::kBlockM >= hi || int64_t(m_block + 1) * C::kBlockM <= lo) return;
  const int tid = threadIdx.x, lane = tid % 32;
  const int pk = ph / (p.Hp / p.Hpk);

  using Pipeline = typename C::Pipeline;
  const int role_wg = tid / kWarpGroupThreads;
  const auto pp = tma_pipeline_params<Pipeline>(role_wg, C::kConsumers, C::kBlockN * C::kHeadDim * sizeof(Element));
  Pipeline pipeline(S.pipe, pp, Shape<_1, _1, _1>{});
  // the union walk's blocks: a bitmap over 0..m_block in the score lists' memory (kGivenLse keeps no score lists),
  // built by every thread before the producer starts
  uint32_t* const union_bits = reinterpret_cast<uint32_t*>(&S.score[0][0]);
  if constexpr (kUnion) {
    static_assert(sizeof(S.score) * 8 >= 8192, "the bitmap of 8192 blocks (max_seqlen 1M) fits the score lists");
    for (int w = threadIdx.x; w <= m_block / 32; w += kCtaThreads) union_bits[w] = 0u;
    __syncthreads();
    for (int e = threadIdx.x; e < C::kBlockM * p.topk; e += kCtaThreads) {
      const int64_t i = int64_t(m_block) * C::kBlockM + e / p.topk;
      if (i < lo || i >= hi) continue;
      const int v = p.given.at(ph, qrow0 + i)[e % p.topk];
      if (v >= 0 && v <= m_block) atomicOr(&union_bits[v >> 5], 1u << (v & 31));
    }
  }
  __syncthreads();  // barrier initialisation (and the union) visible to every thread
  // the blocks walked: 0..m_block (the fp8 ranking: 0..m_block-1, the local block is never ranked), or the union
  const int walk_last = kFp8 ? m_block - 1 : m_block;
  auto first_block = [&]() { return kUnion ? next_set(union_bits, 0, walk_last + 1) : 0; };
  auto next_block = [&](int j) { return kUnion ? next_set(union_bits, j + 1, walk_last + 1) : j + 1; };

  Tensor sQ = make_tensor(make_smem_ptr(S.q.data()), typename C::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(S.k.data()), typename C::SmemLayoutK{});

  if (role_wg == 0) {  // ---- producer: key blocks 0..m_block ----
    cutlass::arch::warpgroup_reg_dealloc<kFwdRegs.producer>();
    if (tid == 0) {
      Tensor tKg = tma_blocks(p.tma_kp, p.tma_shape_kp, pk, b, s0, p.batched);  // (TMA, block)
      Tensor tKs = tma_stages(p.tma_kp, sK);                                      // (TMA, stage)
      auto state = cutlass::make_producer_start_state<Pipeline>();
      for (int j = first_block(); j <= walk_last; j = next_block(j)) {
        pipeline.producer_acquire(state);
        copy(p.tma_kp.with(*pipeline.producer_get_barrier(state)), tKg(_, j), tKs(_, state.index()));
        ++state;
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<kFwdRegs.consumer>();
  const int wg = role_wg - 1;
  {
    // this warpgroup's 64 query rows (positions clamped to the unit's [lo, hi))
    const Element* qbase = p.qp.template row<const Element>(b, 0, ph);
    constexpr int kChunk = 16 / int(sizeof(Element)), kChunks = C::kHeadDim / kChunk;  // 16-byte copies a row
#pragma unroll
    for (int c = tid % kWarpGroupThreads; c < 64 * kChunks; c += kWarpGroupThreads) {
      const int r = wg * 64 + c / kChunks, col = (c % kChunks) * kChunk;
      const int64_t pos = min(max(int64_t(m_block) * C::kBlockM + r, lo), hi - 1);
      ptx::cp_async_16(&sQ(r, col), qbase + (qrow0 + pos) * p.qp.tok + col);
    }
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
    ptx::fence_proxy_async_smem();
    barrier_sync(consumer_wg_barrier(wg), kWarpGroupThreads);
  }

  typename C::Mma mma;
  auto thr = mma.get_thread_slice(tid % kWarpGroupThreads);
  Tensor sQw = local_tile(sQ, Shape<_64, Int<C::kHeadDim>>{}, make_coord(wg, _0{}));
  Tensor tSrQ = thr.partition_fragment_A(sQw);
  Tensor tSrK = thr.partition_fragment_B(sK);
  Tensor acc = partition_fragment_C(mma, Shape<_64, Int<C::kBlockN>>{});
  Tensor accRC = make_tensor(acc.data(), acc_rowcol(acc.layout()));
  Tensor tScS = thr.partition_C(make_identity_tensor(Shape<_64, Int<C::kBlockN>>{}));
  Tensor cRC = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  static_assert(decltype(size<0>(accRC))::value == 2, "two rows per thread");

  const int cap = p.topk - 1;
  const float sl2 = p.proxy_scale * kLog2e;
  // the list owner: quad lane r < 2 owns the thread's row r (own_row -1: no row)
  const int own_r = lane & 3;
  const int own_row = own_r == 0 ? wg * 64 + get<0>(cRC(0, 0)) : own_r == 1 ? wg * 64 + get<0>(cRC(1, 0)) : -1;
  const int64_t own_i = int64_t(m_block) * C::kBlockM + (own_row < 0 ? 0 : own_row);
  const bool own_valid = own_row >= 0 && own_i >= lo && own_i < hi;  // a query of this unit
  int count = 0;
  float list_last = -INFINITY;  // the full list's last score (the owner's register copy)
  const bool reg_list = cap <= kRegSlots;  // the list in registers (RegList), else in shared memory
  RegList rl{};
  float local_lse2[2] = {0.f, 0.f};
  // lse-only modes: running log2-sum-exp2 of the counted blocks (kept by all four quad lanes)
  float run_m[2] = {-INFINITY, -INFINITY}, run_s[2] = {0.f, 0.f};
  if (mode_is(kGivenLse) && (lane & 3) == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wg * 64 + get<0>(cRC(r, 0));
      const int64_t i = int64_t(m_block) * C::kBlockM + row;
      for (int s = 0; s < p.topk; ++s) {
        const int v = i >= lo && i < hi ? p.given.at(ph, qrow0 + i)[s] : -1;
        S.idx[s][row] = int16_t(v >= 0 && v <= m_block ? v : -1);  // blocks past the query's own hold no keys
      }
    }
  }
  if (mode_is(kGivenLse)) barrier_sync(consumer_wg_barrier(wg), kWarpGroupThreads);
  // the fp8 ranking's row scale (the owner's row; the block scale is read per block)
  float own_qscale = 0.f;
  if constexpr (kFp8)
    if (own_valid) own_qscale = p.fp8.qscale[int64_t(ph) * p.fp8.total_q + qrow0 + own_i];

  // One key block's logits in `a` -> the rows' block max and block lse, into the list (or the
  // running lse). The causal mask only in the local block (j == m_block). Both rows of a thread
  // are reduced together and each reduction is a tree of kChains independent chains (a single
  // chain of 32 dependent FMNMX/FADD per row was the loop's latency bound, docs/kernels/select.md);
  // the max is exact in any order, the sum's order is fixed.
  constexpr int kCols = decltype(size<1>(accRC))::value, kChains = 8;
  static_assert(kCols % kChains == 0, "columns split into whole chains");
  auto score_block = [&](auto& a, int j, auto masked) {
    Tensor aRC = make_tensor(a.data(), acc_rowcol(a.layout()));
    int lim[2];  // the row's last key column in this block (the local block only)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      lim[r] = int(int64_t(m_block) * C::kBlockM + wg * 64 + get<0>(cRC(r, 0)) - int64_t(j) * C::kBlockN);
    auto logit = [&](int r, int c) {
      if constexpr (decltype(masked)::value) return get<1>(cRC(r, c)) > lim[r] ? -INFINITY : aRC(r, c);
      else return aRC(r, c);
    };
    // both rows' values f(r, c) folded with op in kChains interleaved chains, then a tree
    auto reduce_rows = [&](auto f, auto op, float (&out)[2]) {
      float acc_[2][kChains];
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int k = 0; k < kChains; ++k) acc_[r][k] = f(r, k);
#pragma unroll
      for (int c = kChains; c < kCols; ++c)
#pragma unroll
        for (int r = 0; r < 2; ++r) acc_[r][c % kChains] = op(acc_[r][c % kChains], f(r, c));
#pragma unroll
      for (int w = kChains / 2; w > 0; w /= 2)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int k = 0; k < w; ++k) acc_[r][k] = op(acc_[r][k], acc_[r][k + w]);
      out[0] = acc_[0][0];
      out[1] = acc_[1][0];
    };
    float mx[2];
    reduce_rows(logit, [](float x, float y) { return fmaxf(x, y); }, mx);
#pragma unroll
    for (int r = 0; r < 2; ++r) mx[r] = quad_max(mx[r]);
    if constexpr (kFp8) {  // rank by the dequantised block max (the scales are positive, NaN or 0); no lse
      if (cap > 0 && own_valid) {
        const float ks = p.fp8.kscale[int64_t(pk) * p.total + s0 + int64_t(j) * C::kBlockN];
        const float sc = rank_score((own_r == 0 ? mx[0] : mx[1]) * (own_qscale * ks));
        if (reg_list) rl.insert(count, list_last, cap, sc, j, 0.f);
        else list_insert(S, own_row, count, list_last, cap, sc, j, 0.f);
      }
    } else {
      float blse2[2];
      // A block that no row of the warp takes needs no lse: the select mode reads a block's lse only
      // at its insert; the local block and the lse-only modes always need it (docs/kernels/select.md,
      // the lazy lse: clustered -13% at 32k, -25% at 128k; random +1-2%).
      if constexpr (!decltype(masked)::value) {
        if (mode_is(kSelect)) {
          const float sc = rank_score(own_r == 0 ? mx[0] : mx[1]);
          const bool take = cap > 0 && own_valid && (count < cap || outranks(sc, list_last));
          if (!__any_sync(0xffffffffu, take)) return;
        }
      }
      {
        float ms[2], sum[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) ms[r] = mx[r] * sl2;
        reduce_rows([&](int r, int c) {
                      const float x = logit(r, c) * sl2 - ms[r];
                      if constexpr (!decltype(masked)::value && kPolyCols > 0)
                        if (c % 8 < kPolyCols) return exp2f_poly(x);
                      return ptx::exp2f_approx(x);
                    },
                    [](float x, float y) { return x + y; }, sum);
#pragma unroll
        for (int r = 0; r < 2; ++r) blse2[r] = ms[r] + __log2f(quad_sum(sum[r]));
      }
      if (!mode_is(kSelect)) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          bool counted = true;
          if (mode_is(kGivenLse)) {
            const int row = wg * 64 + get<0>(cRC(r, 0));
            counted = false;
            for (int s = 0; s < p.topk; ++s) counted = counted || S.idx[s][row] == j;
          }
          if (counted) {
            const float m2 = fmaxf(run_m[r], blse2[r]);
            run_s[r] = run_s[r] * exp2f(run_m[r] - m2) + exp2f(blse2[r] - m2);
            run_m[r] = m2;
          }
        }
      } else if constexpr (decltype(masked)::value) {
        local_lse2[0] = blse2[0];
        local_lse2[1] = blse2[1];
      } else if (cap > 0 && own_valid) {
        // one owner lane per row (quad lane 0: the thread's first row, lane 1: its second), so
        // the two rows' inserts run side by side
        const float sc = rank_score(own_r == 0 ? mx[0] : mx[1]), l2 = own_r == 0 ? blse2[0] : blse2[1];
        if (reg_list) rl.insert(count, list_last, cap, sc, j, l2);
        else list_insert(S, own_row, count, list_last, cap, sc, j, l2);
      }
    }
  };
  typename Pipeline::PipelineState state;
  for (int j = first_block(); j <= walk_last; j = next_block(j)) {
    pipeline.consumer_wait(state);
    wg_gemm<true>(mma, tSrQ, tSrK(_, _, _, state.index()), acc);
    pipeline.consumer_release(state);
    ++state;
    if (j == m_block) score_block(acc, j, std::true_type{});
    else score_block(acc, j, std::false_type{});
  }

  // Write the rows (write_row), and the selected set's proxy lse: the row's owner lane.
  if (own_valid) {
    const int r = own_r, row = own_row;
    const int64_t i = own_i;
    if (!mode_is(kSelect)) {
      const float rs = r == 0 ? run_s[0] : run_s[1], rm = r == 0 ? run_m[0] : run_m[1];
      *p.proxy_lse.at(ph, qrow0 + i) = rs > 0.f ? (rm + log2f(rs)) * kLn2 : -INFINITY;
    } else {
      const int n = count;
      if (reg_list) {  // the register list to the row's shared-memory list, then one writer
#pragma unroll
        for (int k = 0; k < kRegSlots; ++k)
          if (k < n) {
            S.lse2[k][row] = rl.lse2[k];
            S.idx[k][row] = int16_t(rl.idx[k]);
          }
      }
      const float llse2 = r == 0 ? local_lse2[0] : local_lse2[1];
      float mx2 = llse2;
      for (int s = 0; s < n; ++s) mx2 = fmaxf(mx2, S.lse2[s][row]);
      write_row(S, row, n, m_block, p.topk, p.indices.at(ph, qrow0 + i));
      if (!kFp8 && p.proxy_lse.ptr) {
        float sum = exp2f(llse2 - mx2);
        for (int s = 0; s < n; ++s) sum += exp2f(S.lse2[s][row] - mx2);
        *p.proxy_lse.at(ph, qrow0 + i) = (mx2 + log2f(sum)) * kLn2;
      }
    }
  }
}

template <class Element, bool kUnion>
void launch(const Params<Element>& p, cudaStream_t stream) {
  using C = Config<Element>;
  auto kernel = select_kernel<Element, kUnion>;
  FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(C::kSmemBytes)));
  dim3 grid(p.num_m_blocks, p.Hp, p.seqs.segments);
  if (grid.x == 0 || grid.z == 0) return;
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(p);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

// select.h's run: the TMA descriptor of kp from the plain arguments, then the launch (explicitly
// instantiated once per dtype, one translation unit each).
template <Dtype D>
void run(const Args& a, cudaStream_t stream, const Fp8Scales& fp8) {
  using Element = typename ElementOf<D>::type;
  Params<Element> p;
  static_cast<Args&>(p) = a;
  const auto t = make_block_load<Element, typename Params<Element>::StageLayout>(a.kp, a.Hpk, a.batched, a.seqs.seqlen,
                                                                                 a.seqs.batch, a.total);
  p.tma_kp = t.copy;
  p.tma_shape_kp = t.shape;
  p.fp8 = fp8;
  if constexpr (kIsFp8<Element>) launch<Element, false>(p, stream);  // selection only
  else if (a.lse_mode == kGivenLse) launch<Element, true>(p, stream);
  else launch<Element, false>(p, stream);
}

}  // namespace flashmsa::cuda::selection
