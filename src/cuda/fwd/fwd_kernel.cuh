// Sparse (and dense warmup) main forward on Hopper: query-outer over the union of a tile's
// selected blocks.
//
// Tile = NT consecutive tokens x R query heads that share one MSA group and one kv head
// (R = gcd(Hq/Hp, Hq/Hkv), capped to a divisor <= 128), so its 128 MMA rows read one K/V
// stream: m3 (R = 16) packs 8 tokens x 16 heads, fmsa (R = 4) 32 tokens x 4 heads. The CTA
// builds the union of the tokens' selected blocks (ascending) and a per-(union block, token)
// bit. Warp-specialised: warpgroup 0 is the producer (one thread issues TMA loads of K_j and V_j
// into two two-stage mbarrier pipelines, one for K and one for V; registers given back),
// warpgroups 1 and 2 are consumers that own 64 rows each. Per block, FlashAttention-3's
// intra-warpgroup overlap: S_n = Q K_n^T (wgmma SS) is issued, then O += P_{n-1} V_{n-1} (wgmma
// RS), and the softmax of S_n runs while the second GEMM does. The softmax masks with one limit
// per row (the token's selection bit, causal u <= i): only blocks that reach a row's own position
// pay a per-element mask, and a row whose token did not select the block pays no exp (P = 0).
// Running max exact (Train) or lazily rescaled at threshold 8 in log2 units (Infer). Masked rows
// still occupy MMA rows: the union factor of BENCHMARKS.md is the price of this design (1.47 for
// m3 clustered). docs/kernels/fwd.md has the measurements.
//
// The shared-stream kernel (fwd_persistent_kernel) is persistent: one CTA per SM takes the
// launch's tiles one at a time from a counter in the workspace (longest lists first: tile_at), and
// the producer warpgroup's warps 1-3 (the builders) prepare the next tile -- its token positions,
// union, token masks and Q rows (cp.async) -- in a second set of buffers while the consumers run
// the current one, so that a tile's prologue and epilogue no longer stall the tensor pipe
// (docs/kernels/fwd.md, the persistent forward). Where a second
// set does not fit the shared memory (NT x topk > kTwoBufferUnion), one set: the builders
// prepare a tile once the consumers have stored the previous one.
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
// is skipped inside a stream, so no stage is held across a skip (an earlier form, per-warpgroup
// lists over one stream, paid for that). The consumer loop is sequential per block (S, softmax, P V),
// FlashAttention-2's order: with one stage per ring, K_{n+1} loads under softmax_n and P_n V_n,
// V_n under S_n and softmax_n, and the two warpgroups run desynchronised. Each warpgroup loads its
// own copy of a shared block. A ring block costs 1.2-1.3x a shared-stream block (the lost overlap),
// so the rings pay where a warpgroup's list is well under the tile's union: fwd_route.cu decides
// per tile (sparse mode), and each of the two kernels runs the tiles routed to it (docs/kernels/fwd.md,
// the router). Measured alone (H200, the rings kernel on every tile): m3 32k random 15% faster, clustered 8% and dense
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
  // the persistent kernel's shared-memory plan (persistent_plan): tile buffers (1 or 2) and the
  // union capacity of each (entries; 0 in dense mode)
  int nbuf = 1, ucap = 0;
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
  // The persistent kernel's fixed part; after it (persistent_plan), at run-time offsets: the second
  // Q buffer (two buffers), then per buffer the union list and the token masks of ucap entries.
  struct PSmem {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;  // tile buffer 0's Q (and O)
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> v;
    uint32_t blockbits[kMaxBlocks / 32];  // the builders' (one tile at a time)
    int wordprefix[kMaxBlocks / 32];
    typename Pipeline::SharedStorage pipe_k, pipe_v;
    // per tile buffer: written by the builders (ready), released by the consumers and the TMA issuer (free)
    cutlass::arch::ClusterBarrier ready[2], free[2];
    int ulen[2];
    int64_t tile[2];  // the buffer's tile (its index in the launch's order), or -1: no more tiles
    int32_t tpos[2][kBlockM];
  };
  static constexpr size_t kQBytes = sizeof(Element) * cute::cosize_v<SmemLayoutQ>;
  static_assert(sizeof(PSmem) % 1024 == 0 && kQBytes % 1024 == 0, "the tail's Q buffer 1024-aligned");
};

// The persistent kernel's builders: warps 1-3 of the producer warpgroup (warp 0's lane 0 issues the
// TMA loads).
constexpr int kBuilderThreads = kWarpGroupThreads - 32;
constexpr int kBuilderRegEntries = 6;  // a builder's (token, slot) entries held in registers: 576 per tile
// A union of at most this many entries (NT x topk) gets two tile buffers (m3 topk <= 64: 512; fmsa
// topk 16: 512); the shared memory holds two of up to ~760.
constexpr int kTwoBufferUnion = 512;
struct PersistentPlan {
  int nbuf = 1, ucap = 0;
  size_t bytes = 0;
};
template <class Element>
inline PersistentPlan persistent_plan(int NT, int topk) {
  using C = Config<Element>;
  PersistentPlan pl;
  pl.ucap = (NT * topk + 3) / 4 * 4;  // dense (topk 0): no list
  pl.nbuf = pl.ucap <= kTwoBufferUnion ? 2 : 1;
  const size_t per_entry = sizeof(int) + sizeof(uint32_t) * (C::kBlockM / 32);
  pl.bytes = sizeof(typename C::PSmem) + size_t(pl.nbuf - 1) * C::kQBytes + size_t(pl.nbuf) * pl.ucap * per_entry + 1024;
  return pl;
}
// The larger of the two plans' worst cases (two buffers of kTwoBufferUnion entries; one of kMaxUnion), which fits
// the SM (persistent_plans_fit).
template <class Element>
constexpr size_t persistent_max_bytes() {
  using C = Config<Element>;
  constexpr size_t per_entry = sizeof(int) + sizeof(uint32_t) * (C::kBlockM / 32);
  constexpr size_t two = sizeof(typename C::PSmem) + C::kQBytes + 2 * kTwoBufferUnion * per_entry + 1024;
  constexpr size_t one = sizeof(typename C::PSmem) + kMaxUnion * per_entry + 1024;
  return two > one ? two : one;
}
template <class Element>
constexpr bool persistent_plans_fit() {
  return persistent_max_bytes<Element>() <= kMaxSmemBytes;
}

// A tile's coordinates: from its grid position (m_tile, unit: its head unit, b: its query unit, a sequence or a
// query segment), or from its index t in the shared-stream kernel's order (tile_at). False when the tile has no
// rows or (routed, sparse mode: fwd_route.cu) belongs to the other kernel. Keys: key sequence kb from key row s0;
// queries: positions i0 .. i0 + ntok - 1 (from the unit's first position lo), at query rows qrow0 + position
// (seqlen.cuh's query_unit; without segments kb = b and qrow0 = s0). L: the end of the unit's positions.
struct TileCoord {
  int m_tile, unit, b, kb, ntok, h0, grp, kvh;
  int64_t s0, L, i0, qrow0;
};
__device__ __forceinline__ bool tile_from(const Args& p, int m_tile, int unit, int b, bool rings, TileCoord& c) {
  c.m_tile = m_tile;
  c.unit = unit;
  c.b = b;
  if (p.route != nullptr && (p.route[(int64_t(b) * (p.Hq / p.R) + unit) * p.num_m_tiles + m_tile] != 0) != rings)
    return false;
  const QueryUnit u = query_unit(p.seqs, b);
  c.kb = u.b;
  c.s0 = u.s0;
  c.L = u.hi;
  c.qrow0 = u.qrow0;
  c.i0 = u.lo + int64_t(m_tile) * p.NT;  // first position of the tile (in the key sequence)
  if (c.i0 >= c.L) return false;
  c.ntok = int(c.L - c.i0 < p.NT ? c.L - c.i0 : int64_t(p.NT));
  c.h0 = unit * p.R;
  c.grp = c.h0 / (p.Hq / p.Hp);
  c.kvh = c.h0 / (p.Hq / p.Hkv);
  return true;
}
// Tile t of the shared-stream kernel's order: the m-tiles from the last (the longest lists) to the first, and
// within an m-tile every (sequence, unit), so that the grid's last tiles are the cheapest (causal lists grow with
// the position) and a CTA that holds one tile ahead at the end of the grid holds a short one.
__device__ __forceinline__ bool tile_at(const Args& p, int64_t t, bool rings, TileCoord& c) {
  const int units = p.Hq / p.R, per = units * p.seqs.segments;  // (query unit, head unit) pairs per m-tile
  if (t <= INT32_MAX) {  // (32-bit divisions; a launch's tiles fit 31 bits in practice)
    const uint32_t tt = uint32_t(t), q = tt / uint32_t(per), ub = tt - q * uint32_t(per);
    return tile_from(p, p.num_m_tiles - 1 - int(q), int(ub % uint32_t(units)), int(ub / uint32_t(units)), rings, c);
  }
  const int64_t q = t / per, ub = t - q * per;
  return tile_from(p, p.num_m_tiles - 1 - int(q), int(ub % units), int(ub / units), rings, c);
}

// The union of a sparse tile's selected blocks, ascending, into ulist[0, *ulen), and per entry the
// tile tokens that selected it (tokmask), from the tokens' positions tpos (written before the
// call). Run by `nthr` threads (index t; the first 32 a whole warp), `sync` a barrier of exactly
// those; the caller synchronises after the return. kRegs > 0: where the tile's (token, slot) entries
// number at most kRegs per thread, each thread loads its entries once, all before the first barrier
// (one memory latency instead of one per entry), and keeps them in registers for the second pass.
template <int kWords, int kRegs, class Sync>
__device__ __forceinline__ void build_union(const Args& p, const TileCoord& c, const int32_t* tpos, int nblk_tile,
                                            uint32_t* blockbits, int* wordprefix, int* ulist,
                                            uint32_t (*tokmask)[kWords], int* ulen, int t, int nthr, Sync&& sync) {
  const int nwords = (nblk_tile + 31) / 32;
  for (int w = t; w < nwords; w += nthr) blockbits[w] = 0u;
  const int nent = c.ntok * p.topk;
  // an entry's selected block j when valid (0 <= j <= the token's own block), else -1
  auto entry = [&](int e, int& tok) {
    tok = e / p.topk;
    const int s = e - tok * p.topk;
    const int64_t i = tpos[tok];
    const int j = p.indices.at(c.grp, c.qrow0 + i)[s];
    return j >= 0 && int64_t(j) <= i / kBlockKeys ? j : -1;
  };
  constexpr int kR = kRegs > 0 ? kRegs : 1;
  int reg[kR];  // (j << 8 | tok), or -1
  const bool in_regs = kRegs > 0 && nent <= kRegs * nthr;
  if (in_regs) {  // the loads only (their values used after the barrier: all in flight at once)
#pragma unroll
    for (int k = 0; k < kR; ++k) {
      const int e = t + k * nthr;
      reg[k] = -1;
      if (e < nent) {
        const int tok = e / p.topk;
        reg[k] = p.indices.at(c.grp, c.qrow0 + tpos[tok])[e - tok * p.topk];
      }
    }
  }
  sync();
  if (in_regs) {
#pragma unroll
    for (int k = 0; k < kR; ++k) {
      const int e = t + k * nthr, j = reg[k];
      const int tok = e / p.topk;
      const bool valid = e < nent && j >= 0 && int64_t(j) <= int64_t(tpos[tok < c.ntok ? tok : 0]) / kBlockKeys;
      reg[k] = valid ? (j << 8 | tok) : -1;
      if (valid) atomicOr(&blockbits[j / 32], 1u << (j % 32));
    }
  } else {
    for (int e = t; e < nent; e += nthr) {
      int tok;
      const int j = entry(e, tok);
      if (j >= 0) atomicOr(&blockbits[j / 32], 1u << (j % 32));
    }
  }
  sync();
  if (t < 32) {  // exclusive prefix of popcounts over the words (one warp)
    const int n = warp_word_prefix(blockbits, nwords, wordprefix, t);
    if (t == 0) *ulen = n;
  }
  sync();
  for (int w = t; w < nwords; w += nthr) {
    uint32_t bits = blockbits[w];
    int pos = wordprefix[w];
    while (bits) {
      const int bit = __ffs(bits) - 1;
      bits &= bits - 1;
      ulist[pos++] = w * 32 + bit;
    }
  }
  const int n = *ulen;
  for (int x = t; x < n * kWords; x += nthr) tokmask[x / kWords][x % kWords] = 0u;
  sync();
  auto mark = [&](int j, int tok) {
    const int pos = bit_rank(blockbits, wordprefix, j);
    atomicOr(&tokmask[pos][tok / 32], 1u << (tok % 32));
  };
  if (in_regs) {
#pragma unroll
    for (int k = 0; k < kR; ++k)
      if (reg[k] >= 0) mark(reg[k] >> 8, reg[k] & 255);
  } else {
    for (int e = t; e < nent; e += nthr) {
      int tok;
      const int j = entry(e, tok);
      if (j >= 0) mark(j, tok);
    }
  }
}

// A consumer thread's two rows (of its warpgroup's 64): token, in-sequence position, running max
// and partial sum, and the factor that brings O to the latest max.
struct RowState {
  int tok[2];
  int64_t pos[2];
  float max[2], sum[2], scale_o[2];
};
// S of one block -> P in place: the mask (the token's selection bit sel, causal u <= i) as one
// per-row limit, the last column the row may see (-1: none), so that only the blocks that reach a
// row's own position pay a per-element mask and a row that did not select the block pays no exp;
// online softmax with the running max exact (Train) or lazily rescaled (Infer). scale_o: the
// factor that brings O (accumulated against the previous max) to the new one, applied before the
// next O += P V.
template <bool kLazyRescale, int kBlockN, class TS, class TC>
__device__ __forceinline__ void softmax_block(TS& sRC, const TC& cRC, const bool (&sel)[2], int64_t key0, float sl2,
                                              RowState& rs) {
  using namespace cute;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t last = rs.pos[r] - key0;  // the row's own position within the block
    const int lim = !sel[r] || last < 0 ? -1 : last >= kBlockN - 1 ? kBlockN - 1 : int(last);
    float mx = -INFINITY;
    if (lim >= 0) {
      if (lim < kBlockN - 1) {
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
      rs.scale_o[r] = 1.f;
      continue;
    }
    float m_new = fmaxf(rs.max[r], mx);
    if constexpr (kLazyRescale) {
      // keep the stale max unless the new one exceeds it by more than 8 (log2 units)
      if (rs.max[r] != -INFINITY && (m_new - rs.max[r]) * sl2 <= 8.f) m_new = rs.max[r];
    }
    rs.scale_o[r] = (m_new == -INFINITY) ? 1.f : ptx::exp2f_approx((rs.max[r] - m_new) * sl2);
    rs.max[r] = m_new;
    const float ms = (m_new == -INFINITY) ? 0.f : m_new * sl2;
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < size<1>(sRC); ++c) {
      const float e = ptx::exp2f_approx(sRC(r, c) * sl2 - ms);
      sRC(r, c) = e;
      sum += e;
    }
    rs.sum[r] = rs.sum[r] * rs.scale_o[r] + sum;  // partial per thread; reduced at the end
  }
}
template <class TO>
__device__ __forceinline__ void rescale_o(TO& oRC, const RowState& rs) {
  if (rs.scale_o[0] == 1.f && rs.scale_o[1] == 1.f) return;  // (the max did not move)
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int c = 0; c < cute::size<1>(oRC); ++c) oRC(r, c) *= rs.scale_o[r];
}

// A consumer thread's rows at a tile's start: token row / R (rows past the tile: token >= ntok, which see nothing;
// their position the last token's), no max, no sum.
template <class TC>
__device__ __forceinline__ void start_rows(RowState& rs, const TC& cRC, int wg, int R, const int32_t* tpos, int ntok) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = wg * 64 + cute::get<0>(cRC(r, 0));
    rs.tok[r] = row / R;
    rs.pos[r] = tpos[min(rs.tok[r], ntok - 1)];
    rs.max[r] = -INFINITY;
    rs.sum[r] = 0.f;
    rs.scale_o[r] = 1.f;
  }
}
// Whether each of the rows' tokens selected union entry qi (dense: every token of the tile).
template <int kWords>
__device__ __forceinline__ void rows_selected(bool (&sel)[2], const RowState& rs, int ntok, bool dense,
                                              const uint32_t (*tokmask)[kWords], int qi) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    sel[r] = rs.tok[r] < ntok;
    if (sel[r] && !dense) sel[r] = ((tokmask[qi][rs.tok[r] / 32] >> (rs.tok[r] % 32)) & 1u) != 0u;
  }
}

// The epilogue of a consumer warpgroup's 64 rows: normalise O, stage it through the warpgroup's
// rows of sQ (Q no longer read), store out (and out_lo) and lse. wg_sync: the warpgroup's barrier.
template <class Element, class TQ, class TMma, class TO, class TCS>
__device__ __forceinline__ void store_rows(const Args& p, const TileCoord& c, const int32_t* tpos, int wg, TQ& sQ,
                                           const TMma& thr_pv, TO& accO, const TCS& cRC, RowState& rs, float sl2) {
  using namespace cute;
  const int tid = threadIdx.x, lane = tid % 32;
  Tensor oRC = make_tensor(accO.data(), acc_rowcol(accO.layout()));
  Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<_64, Int<kHeadDimInst>>{}));
  float row_lse[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float sum = quad_sum(rs.sum[r]);
    const bool empty = !(sum > 0.f);
    const float inv = empty ? 0.f : 1.f / sum;
    row_lse[r] = empty ? -INFINITY : (rs.max[r] * sl2 + __log2f(sum)) * kLn2;
#pragma unroll
    for (int x = 0; x < size<1>(oRC); ++x) oRC(r, x) *= inv;
  }
  // O (then its low part) staged through this warpgroup's rows of sQ, each once the rows are free (Q no longer
  // read; the previous store done), and stored as 16-byte row pieces
  auto stage_and_store = [&](const auto& dst_t, auto value) {
    barrier_sync(consumer_wg_barrier(wg), kWarpGroupThreads);
#pragma unroll
    for (int x = 0; x < size(accO); ++x) {
      const int row = wg * 64 + get<0>(cO(x));
      sQ(row, get<1>(cO(x))) = value(accO(x));
    }
    barrier_sync(consumer_wg_barrier(wg), kWarpGroupThreads);
    Element* base = static_cast<Element*>(dst_t.ptr);
    for (int x = tid % kWarpGroupThreads; x < 64 * 16; x += kWarpGroupThreads) {
      const int row = wg * 64 + x / 16, col = (x % 16) * 8;  // this warpgroup's rows
      const int tok = row / p.R;
      if (tok >= c.ntok) continue;
      const int h = c.h0 + row % p.R;
      Element* dst = base + c.b * dst_t.batch_corr + (c.qrow0 + tpos[tok]) * dst_t.tok + h * dst_t.head + col;
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&sQ(row, col));
    }
  };
  stage_and_store(p.out, [](float a) { return Element(a); });
  if (p.out_lo.ptr) stage_and_store(p.out_lo, [](float a) { return Element(a - float(Element(a))); });
  if ((lane & 3) == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wg * 64 + get<0>(cRC(r, 0));
      if (rs.tok[r] < c.ntok) *p.lse.at(c.h0 + row % p.R, c.qrow0 + rs.pos[r]) = row_lse[r];
    }
  }
}

// The rings kernel: one tile per CTA (grid (num_m_tiles, Hq / R, batch)).
template <class Element, bool kLazyRescale>
__global__ void __launch_bounds__(kCtaThreads, 1) fwd_rings_kernel(const __grid_constant__ Params<Element> p) {
  using namespace cute;
  using C = Config<Element>;
  extern __shared__ char smem_raw[];
  auto& S = smem_struct<typename C::Smem>(smem_raw);

  TileCoord c;
  if (!tile_from(p, p.num_m_tiles - 1 - int(blockIdx.x), int(blockIdx.y), int(blockIdx.z), true, c)) return;
  const int tid = threadIdx.x, lane = tid % 32;
  // the tile's tokens: positions i0 .. i0 + ntok - 1, or with a regrouping (fwd_regroup.cu) the
  // tokens its permutation puts at those slots, all inside the 128-token span of i0
  if (tid < c.ntok) S.tpos[tid] = int32_t(tile_token_pos(p, c.grp, c.qrow0, c.i0, tid));
  const int64_t i_last = tile_last_pos(c.i0, c.ntok, c.L, p.perm != nullptr);
  const int nblk_tile = int(i_last / C::kBlockN) + 1;  // blocks 0..l(i_last)
  const bool dense = p.indices.ptr == nullptr;

  // ---- the union of the tile's blocks ----
  if (dense) {
    if (tid == 0) S.ulen = nblk_tile;  // every block 0..l(i_last), in order (block_of: no list)
  } else {
    build_union<C::kBlockM / 32, 0>(p, c, S.tpos, nblk_tile, S.blockbits, S.wordprefix, S.ulist, S.tokmask, &S.ulen,
                                 tid, C::kThreads, [] { __syncthreads(); });  // (its first sync: S.tpos too)
  }
  __syncthreads();
  const int ulen = S.ulen;
  static_assert(kConsumerWarpGroups == 2 && C::kBlockM == 128, "two warpgroups of 64 rows");
  // warp w (w < 2) lists the union entries that a token of warpgroup w's rows selected: rows
  // 64 w .. 64 w + 63, tokens row / R (dense: every entry, not stored: entry k is block k)
  if (tid < 64) {
    const int w = tid / 32;
    const int t_lo = wg_first_token(p.R, w), t_hi = min(wg_last_token(p.R, w), c.ntok - 1);
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

  // ---- rings: ring w's K issued by warp 2w's lane 0, V by warp 2w + 1's; consumed by warpgroup
  // w + 1. Warp 0 initialises the four; the loops use their two barriers directly (a one-stage
  // ring's phase is the block's parity) ----
  const int role_wg = tid / kWarpGroupThreads;
  {
    typename C::Ring::Params rp;  // (for the barrier counts: one producer arrival, 128 consumer arrivals)
    rp.num_consumers = kWarpGroupThreads;
#pragma unroll
    for (int w = 0; w < kConsumerWarpGroups; ++w) {
      C::Ring::init_barriers(S.ring_k[w], rp, Shape<_1, _1, _1>{});
      C::Ring::init_barriers(S.ring_v[w], rp, Shape<_1, _1, _1>{});
    }
  }
  __syncthreads();  // barrier initialisation visible to every thread
  auto block_of = [&](int qi) { return dense ? qi : S.ulist[qi]; };  // the qi-th block of the union

  Tensor sK = make_tensor(make_smem_ptr(S.k.data()), typename C::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(S.v.data()), typename C::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(S.v.data()), typename C::SmemLayoutVt{});

  if (role_wg == 0) {  // ---- producer ----
    cutlass::arch::warpgroup_reg_dealloc<kFwdRegs.producer>();
    if (lane == 0) {  // warp x: ring x / 2, K (even) or V (odd)
      const int x = tid / 32, w = x / 2;
      const bool is_v = x % 2 == 1;
      auto& ring = is_v ? S.ring_v[w] : S.ring_k[w];
      const auto& tma = is_v ? p.tma_v : p.tma_k;
      Tensor tg = tma_blocks(tma, p.tma_shape_k, c.kvh, c.kb, c.s0, p.batched);  // (TMA, block)
      Tensor ts = tma_stages(tma, is_v ? sV : sK);                                // (TMA, stage)
      const int n = S.wlen[w];
      for (int k = 0; k < n; ++k) {
        const int j = block_of(dense ? k : S.wlist[w][k]);
        ring.empty_barrier_[0].wait(uint32_t(k & 1) ^ 1u);  // released (first use: at once)
        ring.full_barrier_[0].arrive_and_expect_tx(C::kBlockN * C::kHeadDim * uint32_t(sizeof(Element)));
        copy(tma.with(*reinterpret_cast<uint64_t*>(&ring.full_barrier_[0])), tg(_, j), ts(_, w));
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
    for (int x = tid % kWarpGroupThreads; x < 64 * 16; x += kWarpGroupThreads) {
      const int r = wg * 64 + x / 16, col = (x % 16) * 8;
      const int tok = min(r / p.R, c.ntok - 1);
      const int h = c.h0 + r % p.R;
      const Element* src = qp + c.b * p.q.batch_corr + (c.qrow0 + S.tpos[tok]) * p.q.tok + h * p.q.head + col;
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
  RowState rs;
  start_rows(rs, cRC, wg, p.R, S.tpos, c.ntok);
  auto softmax = [&](int qi) {
    bool sel[2];
    rows_selected(sel, rs, c.ntok, dense, S.tokmask, qi);
    softmax_block<kLazyRescale, C::kBlockN>(sRC, cRC, sel, int64_t(block_of(qi)) * C::kBlockN, sl2, rs);
  };
  // FlashAttention-2's order per block, over this warpgroup's own ring
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
    rescale_o(oRC, rs);
#pragma unroll
    for (int x = 0; x < size(accS); ++x) rP(x) = Element(accS(x));
    rv.full_barrier_[0].wait(phase);
    wg_gemm<false>(mma_pv, tOrP, tOrVt(_, _, _, wg), accO);
    rv.empty_barrier_[0].arrive();
  }
  store_rows<Element>(p, c, S.tpos, wg, sQ, thr_pv, accO, cRC, rs, sl2);
}

// The shared-stream kernel, persistent: each CTA takes tiles of the launch's order (tile_at) from
// the workspace counter (p.tile_counter; without it, one CTA per tile: tiles x, x + grid, ...), its
// first builder skipping those without rows or routed to the rings kernel and handing each taken
// tile to every role through the buffer (S.tile, -1: done). Roles: warp 0's lane 0 issues the
// TMA loads of K and V over every tile's union, one stream across tiles; warps 1-3 (the builders)
// write tile n's positions, union, token masks and Q rows into buffer n % nbuf once its previous
// tile freed it; the two consumer warpgroups compute tile n from that buffer and store O through
// its Q rows. Per buffer, `ready` (the builders' kBuilderThreads arrivals) and `free` (the 256
// consumer threads' and the issuer's) alternate phases, the k-th use of a buffer being phase k & 1.
template <class Element, bool kLazyRescale>
__global__ void __launch_bounds__(kCtaThreads, 1) fwd_persistent_kernel(const __grid_constant__ Params<Element> p) {
  using namespace cute;
  using C = Config<Element>;
  static_assert(persistent_plans_fit<Element>(), "a persistent plan over the SM's 227 KB");
  extern __shared__ char smem_raw[];
  auto& S = smem_struct<typename C::PSmem>(smem_raw);
  char* tail = reinterpret_cast<char*>(&S) + sizeof(typename C::PSmem);
  int* ulists = reinterpret_cast<int*>(tail + size_t(p.nbuf - 1) * C::kQBytes);  // [nbuf][ucap]
  auto* tokmasks = reinterpret_cast<uint32_t(*)[C::kBlockM / 32]>(ulists + p.nbuf * p.ucap);  // [nbuf * ucap]
  auto qbuf = [&](int buf) { return buf == 0 ? S.q.data() : reinterpret_cast<Element*>(tail); };
  const int tid = threadIdx.x;
  const bool dense = p.indices.ptr == nullptr;
  const int64_t ntiles = num_tiles(p);

  using Pipeline = typename C::Pipeline;
  const int role_wg = tid / kWarpGroupThreads;
  const auto pp = tma_pipeline_params<Pipeline>(role_wg, C::kConsumers, C::kBlockN * C::kHeadDim * sizeof(Element));
  Pipeline pipe_k(S.pipe_k, pp, Shape<_1, _1, _1>{});
  Pipeline pipe_v(S.pipe_v, pp, Shape<_1, _1, _1>{});
  if (tid == 0) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      S.ready[x].init(kBuilderThreads);
      S.free[x].init(C::kConsumers + 1);
    }
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();  // barrier initialisation visible to every thread

  Tensor sK = make_tensor(make_smem_ptr(S.k.data()), typename C::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(S.v.data()), typename C::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(S.v.data()), typename C::SmemLayoutVt{});

  if (role_wg == 0) {  // ---- producer warpgroup ----
    cutlass::arch::warpgroup_reg_dealloc<kFwdRegs.producer>();
    if (tid < 32) {  // the TMA issuer
      if (tid != 0) return;
      Tensor tKs = tma_stages(p.tma_k, sK);  // (TMA, stage)
      Tensor tVs = tma_stages(p.tma_v, sV);
      auto sk = cutlass::make_producer_start_state<Pipeline>();
      auto sv = cutlass::make_producer_start_state<Pipeline>();
      TileCoord c;
      for (int n = 0;; ++n) {
        const int buf = n % p.nbuf;
        S.ready[buf].wait(uint32_t(n / p.nbuf) & 1u);
        if (S.tile[buf] < 0) break;
        tile_at(p, S.tile[buf], false, c);  // (a tile of this kernel with rows: the builders checked)
        Tensor tKg = tma_blocks(p.tma_k, p.tma_shape_k, c.kvh, c.kb, c.s0, p.batched);  // (TMA, block)
        Tensor tVg = tma_blocks(p.tma_v, p.tma_shape_k, c.kvh, c.kb, c.s0, p.batched);
        const int* ulist = ulists + buf * p.ucap;
        const int ulen = S.ulen[buf];
        for (int qi = 0; qi < ulen; ++qi) {
          const int j = dense ? qi : ulist[qi];
          pipe_k.producer_acquire(sk);
          copy(p.tma_k.with(*pipe_k.producer_get_barrier(sk)), tKg(_, j), tKs(_, sk.index()));
          ++sk;
          pipe_v.producer_acquire(sv);
          copy(p.tma_v.with(*pipe_v.producer_get_barrier(sv)), tVg(_, j), tVs(_, sv.index()));
          ++sv;
        }
        S.free[buf].arrive();  // (the list read)
      }
      return;
    }
    // the builders
    const int bt = tid - 32;
    auto bsync = [] { barrier_sync(NamedBarrier::kFwdBuilders, kBuilderThreads); };
    const Element* qp = static_cast<const Element*>(p.q.ptr);
    // The tiles are handed out one at a time: by a counter in global memory that every CTA's first builder
    // takes from (p.tile_counter, zeroed by the launch: the CTAs that finish early take more tiles), or
    // statically, tiles c, c + grid, ... (no counter: one CTA per tile). The first builder skips the tiles of
    // the rings kernel and those without rows, and hands the tile to every role through the buffer (-1: done).
    int64_t fetched = 0;  // (static order: the tiles this CTA has looked at)
    auto next_tile = [&]() -> int64_t {
      TileCoord c0;
      for (;;) {
        const int64_t t = p.tile_counter != nullptr ? int64_t(atomicAdd(p.tile_counter, 1ull))
                                                    : int64_t(blockIdx.x) + fetched++ * int64_t(gridDim.x);
        if (t >= ntiles) return -1;
        if (tile_at(p, t, false, c0)) return t;
      }
    };
    TileCoord c;
    for (int n = 0;; ++n) {
      const int buf = n % p.nbuf;
      // The tile is taken once its buffer is free, not before: taken earlier, it would wait in this CTA's queue
      // behind the tile its consumers are running while other CTAs ran dry at the end of the grid (measured:
      // 6% of the SMs' cycles idle at fmsa 16k when each CTA held two tiles ahead).
      S.free[buf].wait((uint32_t(n / p.nbuf) & 1u) ^ 1u);  // (first use: at once)
      if (bt == 0) S.tile[buf] = next_tile();
      bsync();
      const int64_t t = S.tile[buf];
      if (t < 0) {
        S.ready[buf].arrive();  // (the end, to the issuer and the consumers)
        break;
      }
      tile_at(p, t, false, c);
      int32_t* tpos = S.tpos[buf];
      // the tile's tokens: positions i0 .. i0 + ntok - 1, or with a regrouping (fwd_regroup.cu) the
      // tokens its permutation puts at those slots, all inside the 128-token span of i0
      for (int x = bt; x < c.ntok; x += kBuilderThreads) tpos[x] = int32_t(tile_token_pos(p, c.grp, c.qrow0, c.i0, x));
      bsync();
      {  // Q: row r = token r / R, head h0 + r % R (rows past the tile clamp), by cp.async under the union's work
        Tensor sQ = make_tensor(make_smem_ptr(qbuf(buf)), typename C::SmemLayoutQ{});
        static_assert(kBuilderThreads % 16 == 0, "a builder keeps its 16-byte column of rows r, r + 6, ...");
        constexpr int kRowStep = kBuilderThreads / 16;
        const int col = (bt % 16) * 8;
        int r = bt / 16, tok = r / p.R, hr = r % p.R;  // row r: token r / R, head h0 + r % R, tracked as r grows
        const Element* qb = qp + c.b * p.q.batch_corr + c.qrow0 * p.q.tok + c.h0 * p.q.head + col;
        for (; r < C::kBlockM; r += kRowStep) {
          ptx::cp_async_16(&sQ(r, col), qb + tpos[min(tok, c.ntok - 1)] * p.q.tok + hr * p.q.head);
          for (hr += kRowStep; hr >= p.R; hr -= p.R) ++tok;
        }
        ptx::cp_async_commit();
      }
      const int64_t i_last = tile_last_pos(c.i0, c.ntok, c.L, p.perm != nullptr);
      const int nblk_tile = int(i_last / C::kBlockN) + 1;  // blocks 0..l(i_last)
      if (dense) {
        if (bt == 0) S.ulen[buf] = nblk_tile;  // every block 0..l(i_last), in order (no list)
      } else {
        build_union<C::kBlockM / 32, kBuilderRegEntries>(p, c, tpos, nblk_tile, S.blockbits, S.wordprefix, ulists + buf * p.ucap,
                                     tokmasks + buf * p.ucap, &S.ulen[buf], bt, kBuilderThreads, bsync);
      }
      ptx::cp_async_wait<0>();
      ptx::fence_proxy_async_smem();  // this thread's Q rows visible to the consumers' wgmma
      S.ready[buf].arrive();          // (and its union writes to every role)
      // (the next tile's bsync after its positions keeps its blockbits zeroing behind every builder's reads here)
    }
    return;
  }

  // ---- consumers ----
  cutlass::arch::warpgroup_reg_alloc<kFwdRegs.consumer>();
  const int wg = role_wg - 1;
  const float sl2 = p.scale * kLog2e;
  typename Pipeline::PipelineState sk, sv;  // consumer start: index 0, phase 0 (one stream across tiles)
  TileCoord c;
  for (int n = 0;; ++n) {
    const int buf = n % p.nbuf;
    S.ready[buf].wait(uint32_t(n / p.nbuf) & 1u);
    if (S.tile[buf] < 0) break;
    tile_at(p, S.tile[buf], false, c);
    // Everything derived from the thread index is derived again per tile from a laundered copy: hoisted
    // out of the tile loop, the fragments' addresses and coordinates would stay live across it (spills).
    int wtid = tid % kWarpGroupThreads;
    asm volatile("" : "+r"(wtid));
    typename C::MmaQK mma_qk;
    typename C::MmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(wtid);
    auto thr_pv = mma_pv.get_thread_slice(wtid);
    Tensor tSrK = thr_qk.partition_fragment_B(sK);
    Tensor tOrVt = thr_pv.partition_fragment_B(sVt);
    Tensor accS = partition_fragment_C(mma_qk, Shape<_64, Int<C::kBlockN>>{});
    Tensor accO = partition_fragment_C(mma_pv, Shape<_64, Int<C::kHeadDim>>{});
    Tensor sRC = make_tensor(accS.data(), acc_rowcol(accS.layout()));
    Tensor oRC = make_tensor(accO.data(), acc_rowcol(accO.layout()));
    Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<_64, Int<C::kBlockN>>{}));
    Tensor cRC = make_tensor(cS.data(), acc_rowcol(cS.layout()));
    Tensor rP = make_tensor_like<Element>(accS);  // P (bf16/fp16): the A operand of O += P V
    Tensor tOrP = make_tensor(rP.data(), acc_to_a_regs(rP.layout()));
    auto to_p = [&] {
#pragma unroll
      for (int x = 0; x < size(accS); ++x) rP(x) = Element(accS(x));
    };
    const int32_t* tpos = S.tpos[buf];
    const int* ulist = ulists + buf * p.ucap;
    const uint32_t(*tokmask)[C::kBlockM / 32] = tokmasks + buf * p.ucap;
    const int ulen = S.ulen[buf];
    Tensor sQ = make_tensor(make_smem_ptr(qbuf(buf)), typename C::SmemLayoutQ{});
    Tensor tSrQ = thr_qk.partition_fragment_A(local_tile(sQ, Shape<_64, Int<C::kHeadDim>>{}, make_coord(wg, _0{})));
    clear(accO);
    RowState rs;
    start_rows(rs, cRC, wg, p.R, tpos, c.ntok);
    auto softmax = [&](int qi) {
      bool sel[2];
      rows_selected(sel, rs, c.ntok, dense, tokmask, qi);
      softmax_block<kLazyRescale, C::kBlockN>(sRC, cRC, sel, int64_t(dense ? qi : ulist[qi]) * C::kBlockN, sl2, rs);
    };
    // Intra-warpgroup overlap (FlashAttention-3): S_n = Q K_n^T is issued before O += P_{n-1}
    // V_{n-1}, and the softmax of S_n runs while the P V GEMM does. (FlashAttention-3's ping-pong
    // of the two warpgroups measured slower here: docs/kernels/fwd.md.)
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
      rescale_o(oRC, rs);
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
      rescale_o(oRC, rs);
      pipe_v.consumer_wait(sv);
      wg_gemm_issue<false>(mma_pv, tOrP, tOrVt(_, _, _, sv.index()), accO);
      warpgroup_wait<0>();
      wg_gemm_done(mma_pv, tOrP, accO);
      pipe_v.consumer_release(sv);
      ++sv;
    }
    store_rows<Element>(p, c, tpos, wg, sQ, thr_pv, accO, cRC, rs, sl2);
    S.free[buf].arrive();  // (every read of the buffer done: its Q/O rows, positions and masks)
  }
}

template <class Element, bool kLazyRescale, bool kRings>
void launch(Params<Element>& p, cudaStream_t stream) {
  using C = Config<Element>;
  const int64_t ntiles = num_tiles(p);
  if (ntiles == 0) return;
  if constexpr (kRings) {
    auto kernel = fwd_rings_kernel<Element, kLazyRescale>;
    FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(C::kSmemBytes)));
    dim3 grid(p.num_m_tiles, p.Hq / p.R, p.seqs.segments);
    kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(p);
  } else {
    auto kernel = fwd_persistent_kernel<Element, kLazyRescale>;
    const PersistentPlan pl = persistent_plan<Element>(p.NT, p.topk);
    p.nbuf = pl.nbuf;
    p.ucap = pl.ucap;
    // the attribute at the largest plan (both worst cases fit: persistent_plans_fit), not this launch's: set per
    // launch, another host thread's smaller plan could lower it between this thread's set and its launch
    FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             int(persistent_max_bytes<Element>())));
    int dev = 0, sms = 0;
    FLASHMSA_CUDA_CHECK(cudaGetDevice(&dev));
    FLASHMSA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    // one CTA per SM taking tiles from the zeroed counter (persistent), or, without a counter, one per tile in the
    // static order (FLASHMSA_FWD_PERSISTENT=0: the same kernel, for A/B)
    const bool persistent = p.tile_counter != nullptr;
    const int64_t grid = persistent ? std::min<int64_t>(ntiles, sms) : ntiles;
    if (persistent) FLASHMSA_CUDA_CHECK(cudaMemsetAsync(p.tile_counter, 0, sizeof(unsigned long long), stream));
    kernel<<<unsigned(grid), C::kThreads, pl.bytes, stream>>>(p);
  }
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
