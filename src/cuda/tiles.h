// Tile policy of the CUDA backend, in one place: each number with the limit that chose it. The
// kernels' own shared-memory plans are in their Config structs (static_asserts there); this
// header is what the dispatcher decides per call.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>

#include "api/validate.hpp"
#include "cuda/fwd/fwd.h"

namespace flashmsa::cuda::tiles {

// D = Dp = 128: the one head dim instantiated (every wgmma tile's K or N of 128; SPEC v1).
constexpr int kHeadDim = 128;
// The spec's key block (FLASHMSA_BLOCK_SIZE) is also every kernel's key tile and TMA box.
constexpr int kBlock = 128;
// MMA rows of a forward / selection tile: two consumer warpgroups x wgmma M = 64.
constexpr int kTileRows = 128;
// Rows of a backward chunk: one consumer warpgroup's wgmma M (64 keys) times N = 64 rows.
constexpr int kChunkRows = 64;
// CUDA's limit of gridDim.y and gridDim.z: the kernels put heads in y and sequences in z.
constexpr int kMaxGridYZ = 65535;
// The forward's block bitmap in shared memory (attn_fwd::kMaxBlocks) bounds the sequence length.
constexpr int64_t kMaxSeqlen = int64_t(attn_fwd::kMaxBlocks) * kBlock;

// The largest divisor of n that is <= cap.
inline int divisor_at_most(int n, int cap) {
  if (n <= cap) return n;
  int d = cap;
  while (n % d) --d;
  return d;
}

// Forward tile: R query heads x NT tokens = kTileRows MMA rows. R = gcd(Hq/Hp, Hq/Hkv): the heads
// of one tile share one MSA group (one selection) and one kv head (one K/V stream); reduced to a
// divisor <= 128 rows. NT is capped so that NT * topk (token, slot) pairs fit the union buffer.
struct FwdTile {
  int R = 0, NT = 0;
};
inline FwdTile fwd_tile(const Geometry& g, int topk) {
  FwdTile t;
  t.R = divisor_at_most(std::gcd(g.Hq / g.Hp, g.Hq / g.Hkv), kTileRows);
  t.NT = kTileRows / t.R;
  if (topk > 0) t.NT = std::min(t.NT, attn_fwd::kMaxUnion / topk);
  return t;
}

// Forward tiles along the longest sequence (grid x), and all of a call's tiles (the router's bytes:
// the grid's x, heads / R in y, sequences in z).
// m-tiles per query unit (a sequence, or a query segment: max_seqlen_q bounds its positions) and all tiles
inline int64_t fwd_m_tiles(const Geometry& g, const FwdTile& t) { return (g.max_seqlen_q + t.NT - 1) / t.NT; }
inline int64_t fwd_tiles(const Geometry& g, const FwdTile& t) {
  return fwd_m_tiles(g, t) * (g.Hq / t.R) * (g.segmented ? g.segments : g.batch);
}

// Heads per unit of the main backward: the same gcd, reduced to a divisor <= 64 (a chunk holds
// kChunkRows rows = token slots x head slots).
inline int bwd_unit_heads(const Geometry& g) {
  return divisor_at_most(std::gcd(g.Hq / g.Hp, g.Hq / g.Hkv), kChunkRows);
}

// Head slots per token in the main backward's chunks: R rounded up to a power of two (the
// teacher's register reduction pairs adjacent slots).
inline int head_slots(int R) {
  int Rp = 1;
  while (Rp < R) Rp *= 2;
  return Rp;
}

// Global key blocks of all sequences together: at most total / 128 + B (+1 for a partial last).
inline int global_blocks_bound(const Geometry& g) { return int(g.total_k / kBlock + g.batch + 1); }  // (key blocks)

}  // namespace flashmsa::cuda::tiles
