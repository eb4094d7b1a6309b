// The main forward's launch interface as the dispatcher sees it (CuTe-free): plain arguments and
// one run<Dtype, kLazyRescale, kRings>() per instantiation TU (fwd_{bf16,fp16}_{train,infer}.cu: the
// shared-stream kernel, fwd_persistent_kernel; fwd_*_rings.cu: the per-warpgroup rings kernel,
// fwd_rings_kernel), which builds the TMA descriptors of K and V and launches the kernel
// (fwd_kernel.cuh); and the router (fwd_route.cu)
// that, in sparse mode, sends each tile to one of the two kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/element.h"
#include "cuda/common/seqlen.cuh"

namespace flashmsa::cuda::attn_fwd {

// Capacity of the per-tile union (entries of (token, slot) pairs) and of the block bitmap in
// shared memory (fwd_kernel.cuh's Config): they bound topk * tokens per tile and max_seqlen.
constexpr int kMaxUnion = 2048;
constexpr int kMaxBlocks = 8192;  // max_seqlen <= 1M tokens

struct Args {
  bool batched = false;
  TokenTensor<const void> q, k, v;
  TokenTensor<void> out;
  TokenTensor<void> out_lo;  // optional: Element(O - Element(O)) of the fp32 output O
  HeadTensor<float> lse;              // [Hq, total]
  HeadTensor<const int32_t> indices;  // [Hp, total, topk]; ptr null in dense mode
  Seqs seqs;
  int Hq = 0, Hkv = 0, Hp = 0, topk = 0;
  int R = 0, NT = 0;                  // heads and tokens per tile (tiles.h)
  float scale = 0;
  int num_m_tiles = 0;
  int64_t total = 0;  // tokens of the per-token tensors (the TMA descriptors' extent)
  // per tile (index (b * Hq / R + unit) * num_m_tiles + m_tile): 1 = the rings kernel's, 0 = the
  // shared stream's; null: the launched kernel runs every tile
  const uint8_t* route = nullptr;
  // a regrouping of the tiles' tokens (fwd_regroup.cu): perm[grp * perm_head + s0 + i] is the
  // in-sequence position of the token at slot i of sequence s0's MSA group grp, a permutation of
  // each 128-token span; null: slot i holds token i
  const int32_t* perm = nullptr;
  int64_t perm_head = 0;
  // the shared-stream kernel's tile counter (8 bytes of workspace, zeroed by its launch): one CTA per
  // SM takes tiles from it (persistent); null (FLASHMSA_FWD_PERSISTENT=0, for tests and A/B): the same
  // kernel with one CTA per tile
  unsigned long long* tile_counter = nullptr;
};

template <Dtype, bool kLazyRescale, bool kRings>
void run(const Args& a, cudaStream_t stream);

// Tiles of a launch (the route's entries).
__host__ __device__ inline int64_t num_tiles(const Args& a) {
  return int64_t(a.num_m_tiles) * (a.Hq / a.R) * a.seqs.segments;  // per query unit (sequence or segment)
}

// The router (sparse mode): per tile, with n_w the blocks that warpgroup w's tokens selected and u
// their union, the rings kernel when 1000 * max(n_0, n_1) <= ratio_permille * u. The default 0.8: a
// ring block costs ~1.25x a shared-stream block (docs/kernels/fwd.md, the router).
constexpr int kRingRatioPermille = 800;
constexpr int kRowsPerWarpGroup = 64;  // a consumer warpgroup's MMA rows (tokens row / R)
// Consumer warpgroup w holds rows 64 w .. 64 w + 63, i.e. the tile's tokens first..last of these
// (a token's R rows may straddle both warpgroups; last is clipped to the tile by the caller): the
// rings kernel's lists and the router both count a warpgroup's blocks by this one rule.
__host__ __device__ inline int wg_first_token(int R, int w) { return (kRowsPerWarpGroup * w) / R; }
__host__ __device__ inline int wg_last_token(int R, int w) { return (kRowsPerWarpGroup * w + kRowsPerWarpGroup - 1) / R; }
void launch_route(const Args& a, int ratio_permille, uint8_t* route, cudaStream_t stream);

// The regrouping (sparse and given modes, fwd_regroup.cu): within each 128-token span of each
// sequence and MSA group, the tokens reordered so that each NT consecutive slots (one tile) hold
// tokens whose selections overlap: greedily, a tile's first token is the earliest one left and
// each next one the token that adds the fewest blocks to the tile's union. A token's out and lse do
// not depend on its tile (it adds nothing for a block it did not select and sees its blocks in
// ascending order), so the order changes the work, not the result. Applies when a tile lies in
// one span (NT divides 128, NT >= 2) and a span's indices fit the kernel's shared memory.
constexpr int kRegroupSpan = 128;
constexpr int kRegroupMaxTopk = 64;
__host__ __device__ inline bool regroup_applies(int NT, int topk) {
  return NT >= 2 && kRegroupSpan % NT == 0 && topk >= 1 && topk <= kRegroupMaxTopk;
}
// The last in-sequence position of a tile's tokens (tile i0, ntok tokens, sequence length L): i0 + ntok - 1, or
// with a regrouping anywhere up to the end of i0's span; the forward's block bitmap and the router's cover it.
__host__ __device__ inline int64_t tile_last_pos(int64_t i0, int ntok, int64_t L, bool regrouped) {
  const int64_t span_last = (i0 / kRegroupSpan + 1) * kRegroupSpan - 1;
  return !regrouped ? i0 + ntok - 1 : L - 1 < span_last ? L - 1 : span_last;
}
// The in-sequence position of the token at slot `slot` of the tile starting at i0 (MSA group grp, sequence start s0):
// the forward's prologue and the router read it the same way.
__host__ __device__ inline int64_t tile_token_pos(const Args& a, int grp, int64_t s0, int64_t i0, int slot) {
  return a.perm ? int64_t(a.perm[grp * a.perm_head + s0 + i0 + slot]) : i0 + slot;
}
// perm: Hp x perm_head int32 (perm_head >= total); a.perm is ignored.
void launch_regroup(const Args& a, int64_t max_seqlen, int32_t* perm, int64_t perm_head, cudaStream_t stream);

}  // namespace flashmsa::cuda::attn_fwd
