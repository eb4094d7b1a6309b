// Parameters shared by the backward's kernels (preprocess, index inversion, main backward,
// proxy backward, convert). CuTe-free: the dispatcher fills them.
#pragma once

#include <cstdint>

#include "cuda/common/seqlen.cuh"

namespace flashmsa::cuda::attn_bwd {

// Tile of the padded per-token buffers (lse2, dpsum): written by the preprocess, read by the
// main backward, both through padded_offset(..., kPadTile).
constexpr int kPadTile = 128;

// The tiled dq accumulator (the main kernel's A/B knob FLASHMSA_BWD_DQ_TILED; run_main says
// which layout its dq_acc has): [total, 2 (d half), H, 64] fp32, so that the heads of a token's
// d half are contiguous (one bulk reduce-add per token and warp), with each row's eight 8-float
// groups permuted by XOR with dq_tiled_swizzle (conflict-free staging in shared memory).
// Element (t, h, d) sits at dq_tiled_row(t, d / 64, h, H) + ((d % 64) ^ dq_tiled_swizzle(t, h)).
__host__ __device__ inline int dq_tiled_swizzle(int64_t t, int h) { return 8 * int((t + h) & 3); }
__host__ __device__ inline int64_t dq_tiled_row(int64_t t, int half, int h, int H) {
  return ((t * 2 + half) * H + h) * 64;
}

// The inversion: for each (proxy head p, global key block gb) the tokens (global index,
// ascending) whose key set holds block gb: list = tokens[offsets[p * nblk + gb] ..
// offsets[p * nblk + gb + 1]). Global blocks number the blocks of all sequences in order:
// gb = blk_off[b] + j.
struct Inversion {
  const int32_t* tokens = nullptr;
  const int32_t* offsets = nullptr;   // [Hp * nblk + 1]
  const int32_t* blk_off = nullptr;   // [B + 1]
  const int32_t* rank = nullptr;      // deterministic mode: per entry, the block's rank among the
                                      // token's selected blocks (its turn in the token's dq sum)
  int nblk = 0;                       // total global blocks
};

struct Common {
  TokenTensor<const void> q, k, v, dout, qp, kp;
  HeadTensor<const float> lse2, dsum;  // padded: at(h, padded_offset(s0, b, kPadTile) + i)
  HeadTensor<const float> plse;        // [Hp, total] natural log (proxy lse over the set)
  Seqs seqs;
  Inversion inv;
  int Hq = 0, Hkv = 0, Hp = 0, Hpk = 0, R = 0;
  float scale = 0, proxy_scale = 0;
  bool dense = false;
  // fp32 accumulators [total, H, 128] (dense layout)
  float* dq_acc = nullptr;
  float* dk_acc = nullptr;
  float* dv_acc = nullptr;
  float* dqp_acc = nullptr;
  float* dkp_acc = nullptr;
  float* kl_acc = nullptr;   // [num CTAs of the proxy kernel] partial kl sums, or null
  const float* dkl = nullptr;  // device scalar g (null: 0)
  int64_t total = 0;
  // deterministic mode (ptx/order.cuh): turn counters, zeroed before the launch, of the per-token
  // rows (dq: [total, units]; dqp: [total, Hp]) and of the per-block rows (dk/dv: [nblk, Hkv];
  // dkp: [nblk, Hpk]); null: atomics in any order
  int32_t* turn_rows = nullptr;
  int32_t* turn_keys = nullptr;
};

}  // namespace flashmsa::cuda::attn_bwd
