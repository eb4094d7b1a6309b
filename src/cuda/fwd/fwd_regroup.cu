// The forward's regrouping (sparse and given modes; fwd.h): one warp per (128-token span,
// sequence, MSA group) orders the span's tokens into tiles of NT whose selections overlap, so that
// a tile's union of blocks (the forward's work: every row of a tile runs over it) shrinks. Greedy:
// a tile starts with the earliest token left; each next token is the one whose selection adds the
// fewest blocks to the tile's union (ties: the earliest). A slot counts as the forward counts it
// (0 <= j <= the token's own block, which for every token of the span is the span's block), and a
// block a token selected twice counts once (the forward pays a block once).
// Writes perm[grp * perm_head + s0 + i]: the in-sequence position of the token at slot i; every
// slot of a span gets exactly one of the span's tokens. No CuTe.
//
// Two paths, the same rule. Where the span's distinct selected blocks number at most 256 (every span
// of a sequence up to 32k tokens, and clustered selections at any length), they are renumbered
// 0..D-1 and each candidate's selection becomes a bit mask of W = 2, 4 or 8 words in registers; a
// placement then costs W and-not-popcounts per candidate and a W-word broadcast, no shared memory.
// Otherwise each candidate's slots are looked up in the tile's union bitmap, slot by slot, after
// each token's repeated slots are cleared.
#include <climits>

#include "cuda/common/bitmap.cuh"
#include "cuda/common/constants.h"
#include "cuda/common/error.cuh"
#include "cuda/fwd/fwd.h"

namespace flashmsa::cuda::attn_fwd {

namespace {

constexpr int kWarps = 4;                   // spans per CTA
constexpr int kCands = kRegroupSpan / 32;   // a lane's candidates: tokens lane + 32 k
constexpr int kWords = kMaxBlocks / 32;     // the union bitmap of a span's blocks 0..span
constexpr int kRegSlots = 16;               // a candidate's slots held in registers (topk <= 16)
constexpr int kMaskWords = 8;               // the mask path: at most 256 distinct blocks per span
static_assert(kRegroupSpan == 4 * 32 && kRegroupSpan <= 256, "candidate ids in 8 bits, 4 per lane");
// a span's tokens all have its block as their own (the forward's and the router's tile bound use it)
static_assert(kRegroupSpan == kBlockKeys, "a span is one key block of tokens");

__host__ __device__ constexpr size_t warp_smem_bytes(int topk) {  // slots, the bitmap, its word prefix
  return size_t(kRegroupSpan) * topk * sizeof(int32_t) + 2 * kWords * sizeof(uint32_t);
}

// The mask path's greedy (W words per mask): sel[k] is candidate lane + 32 k's selection over the
// span's renumbered blocks; U the tile's union (the same in every lane).
template <int W>
__device__ __forceinline__ void greedy_masks(const uint32_t (&sel)[kCands][kMaskWords], uint32_t& left, int n, int NT,
                                             int64_t st, int32_t* out, int lane) {
  for (int pos = 0; pos < n;) {
    uint32_t U[W];
#pragma unroll
    for (int w = 0; w < W; ++w) U[w] = 0u;
    auto place = [&](int c) {  // c (the same in every lane) joins the tile
      const int kc = c / 32, src = c % 32;
#pragma unroll
      for (int w = 0; w < W; ++w) {
        uint32_t v = sel[0][w];
#pragma unroll
        for (int k = 1; k < kCands; ++k) v = kc == k ? sel[k][w] : v;
        U[w] |= __shfl_sync(0xffffffffu, v, src);
      }
      if (lane == src) left &= ~(1u << kc);
      if (lane == 0) out[pos] = int32_t(st + c);
      ++pos;
    };
    const unsigned first = left ? unsigned(lane + 32 * (__ffs(left) - 1)) : unsigned(INT_MAX);
    place(int(__reduce_min_sync(0xffffffffu, first)));
    for (int m = 1; m < NT && pos < n; ++m) {
      unsigned key = unsigned(INT_MAX);  // (blocks added) << 8 | candidate: the fewest, then the earliest
#pragma unroll
      for (int k = 0; k < kCands; ++k) {
        unsigned add = 0;
#pragma unroll
        for (int w = 0; w < W; ++w) add += __popc(sel[k][w] & ~U[w]);
        if ((left >> k) & 1u) key = min(key, add << 8 | unsigned(lane + 32 * k));
      }
      place(int(__reduce_min_sync(0xffffffffu, key) & 0xffu));
    }
  }
}

__global__ void __launch_bounds__(kWarps * 32)
    regroup_kernel(const Args a, int spans, int32_t* __restrict__ perm, int64_t perm_head) {
  extern __shared__ uint32_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int span = int(blockIdx.x) * kWarps + warp, grp = blockIdx.y, b = blockIdx.z;
  if (span >= spans) return;
  int64_t s0, L;
  a.seqs.get(b, s0, L);
  const int64_t st = int64_t(span) * kRegroupSpan;
  if (st >= L) return;
  const int n = L - st < kRegroupSpan ? int(L - st) : kRegroupSpan;
  const int K = a.topk, NT = a.NT;
  int32_t* idx = reinterpret_cast<int32_t*>(reinterpret_cast<char*>(smem) + warp * warp_smem_bytes(K));
  uint32_t* ubits = reinterpret_cast<uint32_t*>(idx + kRegroupSpan * K);
  int32_t* wprefix = reinterpret_cast<int32_t*>(ubits + kWords);
  const int nwords = span / 32 + 1;  // blocks 0..span
  // the span's slots, slot-major (idx[s * 128 + t]: the candidates' reads below are conflict-free);
  // a slot the forward would not count reads -1
  for (int e = lane; e < n * K; e += 32) {
    const int t = e / K, s = e % K;
    const int j = a.indices.at(grp, s0 + st + t)[s];
    idx[s * kRegroupSpan + t] = j >= 0 && j <= span ? j : -1;
  }
  uint32_t left = 0;  // bit k: candidate lane + 32 k not placed yet
#pragma unroll
  for (int k = 0; k < kCands; ++k)
    if (lane + 32 * k < n) left |= 1u << k;
  int32_t* out = perm + grp * perm_head + s0 + st;
  __syncwarp();
  // the span's distinct blocks: a bitmap over blocks 0..span and its exclusive word prefix (the
  // forward's prologue does the same for a tile), D of them
  for (int w = lane; w < nwords; w += 32) ubits[w] = 0u;
  __syncwarp();
  for (int e = lane; e < K * kRegroupSpan; e += 32) {
    const int j = e % kRegroupSpan < n ? idx[e] : -1;  // (slot-major: slots of tokens past n unwritten)
    if (j >= 0) atomicOr(&ubits[j / 32], 1u << (j % 32));
  }
  __syncwarp();
  const int D = warp_word_prefix(ubits, nwords, wprefix, lane);
  __syncwarp();
  if (D <= 32 * kMaskWords) {
    // each candidate's selection as a mask over the renumbered blocks (a repeated block sets its bit once)
    uint32_t sel[kCands][kMaskWords];
#pragma unroll
    for (int k = 0; k < kCands; ++k) {
#pragma unroll
      for (int w = 0; w < kMaskWords; ++w) sel[k][w] = 0u;
      const int c = lane + 32 * k;
      if (c >= n) continue;
      for (int u = 0; u < K; ++u) {
        const int j = idx[u * kRegroupSpan + c];
        if (j < 0) continue;
        const int id = bit_rank(ubits, wprefix, j);
#pragma unroll
        for (int w = 0; w < kMaskWords; ++w) sel[k][w] |= id / 32 == w ? 1u << (id % 32) : 0u;
      }
    }
    if (D <= 64) greedy_masks<2>(sel, left, n, NT, st, out, lane);
    else if (D <= 128) greedy_masks<4>(sel, left, n, NT, st, out, lane);
    else greedy_masks<8>(sel, left, n, NT, st, out, lane);
    return;
  }
  // more than 256 distinct blocks: a token's repeated slots cleared (each lane its own candidates'),
  // then the union bitmap read slot by slot
#pragma unroll
  for (int k = 0; k < kCands; ++k) {
    const int c = lane + 32 * k;
    if (c >= n) continue;
    for (int u = 1; u < K; ++u) {
      const int j = idx[u * kRegroupSpan + c];
      if (j < 0) continue;
      bool seen = false;
      for (int v = 0; v < u && !seen; ++v) seen = idx[v * kRegroupSpan + c] == j;
      if (seen) idx[u * kRegroupSpan + c] = -1;
    }
  }
  __syncwarp();
  // the candidates' slots in registers where they fit (topk <= 16, the default), so that a step reads
  // only the union bitmap; every load of a step is independent (unrolled), a slot of -1 reads word 0
  // and counts nothing
  int cj[kCands][kRegSlots];
  const bool in_regs = K <= kRegSlots;
  if (in_regs) {
#pragma unroll
    for (int k = 0; k < kCands; ++k)
#pragma unroll
      for (int u = 0; u < kRegSlots; ++u) cj[k][u] = u < K && lane + 32 * k < n ? idx[u * kRegroupSpan + lane + 32 * k] : -1;
  }
  auto uncovered = [&](int j) -> unsigned {  // 1 when slot block j (>= 0) is not in the tile's union yet
    const int jj = j < 0 ? 0 : j;
    return unsigned(j >= 0) & ~(ubits[jj / 32] >> (jj % 32)) & 1u;
  };
  auto place = [&](int c, int pos) {  // c joins the tile: its blocks into the union
    __syncwarp();  // (every lane's reads of the union done; __reduce_min_sync orders them too, this says so to racecheck)
    for (int s = lane; s < K; s += 32) {
      const int j = idx[s * kRegroupSpan + c];
      if (j >= 0) atomicOr(&ubits[j / 32], 1u << (j % 32));
    }
    if (lane == c % 32) left &= ~(1u << (c / 32));
    if (lane == 0) out[pos] = int32_t(st + c);
    __syncwarp();
  };
  for (int pos = 0; pos < n;) {
    for (int w = lane; w < nwords; w += 32) ubits[w] = 0u;
    __syncwarp();
    const unsigned first = left ? unsigned(lane + 32 * (__ffs(left) - 1)) : unsigned(INT_MAX);
    place(int(__reduce_min_sync(0xffffffffu, first)), pos++);
    for (int m = 1; m < NT && pos < n; ++m, ++pos) {
      unsigned key = unsigned(INT_MAX);  // (blocks added) << 8 | candidate: the fewest, then the earliest
#pragma unroll
      for (int k = 0; k < kCands; ++k) {
        if (!((left >> k) & 1u)) continue;
        const int c = lane + 32 * k;
        unsigned add = 0;
        if (in_regs) {
#pragma unroll
          for (int u = 0; u < kRegSlots; ++u) add += uncovered(cj[k][u]);
        } else {
          for (int s = 0; s < K; s += kRegSlots)
#pragma unroll
            for (int u = 0; u < kRegSlots; ++u) add += uncovered(s + u < K ? idx[(s + u) * kRegroupSpan + c] : -1);
        }
        key = min(key, add << 8 | unsigned(c));
      }
      place(int(__reduce_min_sync(0xffffffffu, key) & 0xffu), pos);
    }
  }
}

}  // namespace

void launch_regroup(const Args& a, int64_t max_seqlen, int32_t* perm, int64_t perm_head, cudaStream_t stream) {
  const int spans = int((max_seqlen + kRegroupSpan - 1) / kRegroupSpan);
  if (spans == 0 || a.seqs.batch == 0 || a.Hp == 0) return;
  // the limit for the largest topk, the same on every call (a per-call value could race with another
  // host thread's launch); the launch takes what its topk needs
  static_assert(kWarps * warp_smem_bytes(kRegroupMaxTopk) <= 227 * 1024, "the largest topk's plan");
  FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(regroup_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(kWarps * warp_smem_bytes(kRegroupMaxTopk))));
  const size_t smem = kWarps * warp_smem_bytes(a.topk);
  const dim3 grid(unsigned((spans + kWarps - 1) / kWarps), unsigned(a.Hp), unsigned(a.seqs.batch));
  regroup_kernel<<<grid, kWarps * 32, smem, stream>>>(a, spans, perm, perm_head);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flashmsa::cuda::attn_fwd
